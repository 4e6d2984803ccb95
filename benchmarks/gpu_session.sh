#!/usr/bin/env bash
# One batched GPU session (device tool, nvidia-h200-x2): GPU tests and benchmarks, logs to $OUT.
#   bash benchmarks/gpu_session.sh PART     PART = a | b | all
# Part a: single-GPU work split across the two GPUs (tests on GPU 1 while bench_amp times on
# GPU 0, then the norm benchmark). Part b: the two-GPU tests and benchmark, and the CLI runs.
# Runs from a source checkout (PYTHONPATH), with the machine's own torch and triton.
set -u
PART=${1:-all}
OUT=${OUT:-$PWD/runs}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Never NVLink multicast on these shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOGS=$PWD/runs/logs
mkdir -p "$LOGS" "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'; } > "$LOGS/env.txt" 2>&1
cat "$LOGS/env.txt"

if [ "$PART" = a ] || [ "$PART" = all ]; then
  ( CUDA_VISIBLE_DEVICES=0 timeout 420 python3 benchmarks/bench_amp.py --out "$LOGS" > "$LOGS/bench_amp.log" 2>&1; echo "bench_amp rc=$?" >> "$LOGS/bench_amp.log" ) &
  ( CUDA_VISIBLE_DEVICES=1 timeout 250 python3 -m pytest -q -p no:cacheprovider -n 6 tests/amp tests/normalization tests/bench > "$LOGS/tests_1gpu.log" 2>&1; echo "tests rc=$?" >> "$LOGS/tests_1gpu.log"
    CUDA_VISIBLE_DEVICES=1 timeout 170 python3 benchmarks/bench_norm.py --out "$LOGS" > "$LOGS/bench_norm.log" 2>&1; echo "bench_norm rc=$?" >> "$LOGS/bench_norm.log" ) &
  wait
fi
if [ "$PART" = b ] || [ "$PART" = all ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/parallel > "$LOGS/tests_parallel.log" 2>&1; echo "tests rc=$?" >> "$LOGS/tests_parallel.log"
  timeout 240 torchrun --standalone --nproc_per_node=2 benchmarks/bench_parallel.py --out "$LOGS" > "$LOGS/bench_parallel.log" 2>&1; echo "bench_parallel rc=$?" >> "$LOGS/bench_parallel.log"
  ( CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m mixprec bench --model gpt --no-progress --json "$LOGS/cli_gpt.json" --plot "$LOGS/cli_gpt.png" > "$LOGS/cli_gpt.log" 2>&1 ) &
  ( CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m mixprec bench --model resnet50 --channels-last --no-progress --json "$LOGS/cli_resnet50.json" --plot "$LOGS/cli_resnet50.png" > "$LOGS/cli_resnet50.log" 2>&1 ) &
  wait
fi
tar czf "$OUT/runs_$PART.tgz" -C "$PWD/runs" logs
for f in "$LOGS"/*.log; do echo "=== $f"; tail -n 25 "$f"; done
