#!/usr/bin/env bash
# Batched GPU session (device tool, nvidia-h200-x2): GPU tests and benchmarks, logs to $OUT.
#   bash benchmarks/gpu_session.sh STEP...
# Steps: amp, norm (each alone), amp_norm (bench_amp on GPU 0 beside bench_norm on GPU 1), sweep (bench_norm --sweep),
# tests1 (single-GPU tests), tests2 (two-GPU tests), parallel (bench_parallel, torchrun),
# cli (mixprec bench, gpt on GPU 0 beside resnet50 on GPU 1), tests_amp (amp's CUDA cases),
# tests12 (tests1 on GPU 0 beside tests2), graphs (bench_parallel --graphs: GPT and ResNet-50 steps as
# CUDA graph replays), host (norm_host_overhead.py: host time per norm call), gemm_clocks
# (probe_gemm_clocks.py: fp16 O2 vs .half() GEMM time, SM clock and power-cap reasons),
# halfbn (probe_half_bn.py: ResNet-50 BatchNorm backends and kernel time per recipe), adamw
# (probe_adamw_bandwidth.py: O2's optimizer passes, torch's vs FusedAdam, bf16 and fp16),
# bnbackends (probe_bn_backends.py: bf16/fp16 BatchNorm backends), normhost
# (probe_norm_host.py --parts step: host and GPU time of the GPT step per norm).
# Timing steps never share the machine with the test runs (compilers and test workers take
# the CPU, and launch-bound steps then time the CPU). The logs are packed after every step, so
# a run cut short still returns what it finished.
set -u
case " $* " in
  *" -h "*|*" --help "*|"  ")  # (the comment above, before anything runs)
    sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
OUT=${OUT:-$PWD/runs}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Never NVLink multicast on these shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOGS=$PWD/runs/logs
mkdir -p "$LOGS" "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'; } > "$LOGS/env.txt" 2>&1
cat "$LOGS/env.txt"
pack() { tar czf "$OUT/runs.tgz" -C "$PWD/runs" logs; }
step() {  # step NAME TIMEOUT CMD...: run CMD with a timeout, log and exit code in logs/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  echo "[$name rc=$? in $((SECONDS - t0)) s]" | tee -a "$LOGS/$name.log"
}
for s in "$@"; do
  case $s in
    amp_norm)
      step bench_amp 280 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_amp.py --out "$LOGS" &
      { step bench_norm 120 env CUDA_VISIBLE_DEVICES=1 python3 benchmarks/bench_norm.py --out "$LOGS"
        [ "${SWEEP:-0}" = 1 ] && step bench_norm_sweep 150 env CUDA_VISIBLE_DEVICES=1 python3 benchmarks/bench_norm.py --sweep --rep 30 --out "$LOGS/sweep"
        [ "${PROFILE:-0}" = 1 ] && for n in torch mixprec; do step profile_O1_$n 60 env CUDA_VISIBLE_DEVICES=1 python3 benchmarks/profile_step.py --mode O1 --norm $n; done; } &
      wait ;;
    amp) step bench_amp 280 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_amp.py --out "$LOGS" ;;
    amp_gpt) step bench_amp_gpt 240 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_amp.py --models gpt --out "$LOGS" ;;
    graphs)  # one process per model: a run that captured the GPT steps first failed a later
      # ResNet capture with "CUDA error: invalid argument" (once mixprec's, once torch's SyncBN)
      step bench_parallel_graphs_gpt 200 torchrun --standalone --nproc_per_node=2 benchmarks/bench_parallel.py --graphs --parts gpt --out "$LOGS/graphs_gpt"
      step bench_parallel_graphs 200 torchrun --standalone --nproc_per_node=2 benchmarks/bench_parallel.py --graphs --parts resnet --out "$LOGS/graphs" ;;
    host) step norm_host_overhead 90 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/norm_host_overhead.py ;;
    gemm_clocks) step gemm_clocks 200 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/probe_gemm_clocks.py ;;
    halfbn) step probe_half_bn 300 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/probe_half_bn.py ;;
    adamw) step probe_adamw_bf16 120 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/probe_adamw_bandwidth.py
      step probe_adamw_fp16 120 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/probe_adamw_bandwidth.py --dtype fp16 ;;
    bnbackends) step probe_bn_backends 90 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/probe_bn_backends.py ;;
    normhost) step probe_norm_host_step 120 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/probe_norm_host.py --parts step ;;
    tests12)
      step tests_1gpu 540 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider -n 8 tests/amp tests/normalization tests/bench tests/optimizers &
      step tests_2gpu 540 python3 -m pytest -q -p no:cacheprovider tests/parallel tests/amp/test_apex_surface.py::test_data_parallel_replicas_on_two_gpus &
      wait ;;
    norm) step bench_norm 120 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_norm.py --out "$LOGS" ;;
    sweep) step bench_norm_sweep 240 env CUDA_VISIBLE_DEVICES=1 python3 benchmarks/bench_norm.py --sweep --out "$LOGS/sweep" ;;
    tests1) step tests_1gpu 540 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider -n 8 tests/amp tests/normalization tests/bench tests/optimizers ;;
    tests_norm) step tests_norm_cuda 90 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider -n 8 tests/normalization/test_norm_numerics.py -k cuda ;;
    tests_amp) step tests_amp_cuda 200 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider -n 8 tests/amp -k "cuda or CUDA or fused" ;;
    tests2) step tests_2gpu 240 python3 -m pytest -q -p no:cacheprovider tests/parallel tests/amp/test_apex_surface.py::test_data_parallel_replicas_on_two_gpus ;;
    parallel) step bench_parallel 200 torchrun --standalone --nproc_per_node=2 benchmarks/bench_parallel.py --out "$LOGS" ;;
    cli)
      step cli_gpt 150 env CUDA_VISIBLE_DEVICES=0 python3 -m mixprec bench --model gpt --no-progress --json "$LOGS/cli_gpt.json" --plot "$LOGS/cli_gpt.png" &
      step cli_resnet50 150 env CUDA_VISIBLE_DEVICES=1 python3 -m mixprec bench --model resnet50 --channels-last --no-progress --json "$LOGS/cli_resnet50.json" --plot "$LOGS/cli_resnet50.png" &
      wait ;;
    *) echo "unknown step $s" ;;
  esac
  pack
done
for f in "$LOGS"/*.log; do echo "=== $f"; tail -n 12 "$f"; done
