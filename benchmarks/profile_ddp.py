"""Where the 2-GPU GPT step loses time against the 1-GPU step (diagnostic; torchrun, 2 GPUs).

Runs bench_parallel's GPT-style step (amp O2 bf16, fused AdamW) without DDP and under mixprec
DDP, profiles a few steps of each with the PyTorch profiler and compares, per step, on rank 0:

* the busy time of the compute stream (the sum of its kernels), by kernel family (GEMM,
  attention, element-wise, ...): a family that grows under DDP is slowed by the all-reduce
  running beside it (SMs and memory bandwidth shared with NCCL);
* the idle time of the compute stream inside the step, and its largest gaps with the kernels
  on either side: a gap at the end of backward is the exposed tail of the all-reduce;
* NCCL's kernel time and its end against the compute stream's last backward kernel.

    torchrun --standalone --nproc_per_node=2 benchmarks/profile_ddp.py [--steps 3] [--out DIR]

The profiler adds overhead; compare the variants with each other, not with bench_parallel.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import types
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_parallel as bp  # noqa: E402

from mixprec.parallel import DistributedDataParallel  # noqa: E402


def _family(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if "gemm" in n or "cutlass" in n or "sm90_xmma" in n or "nvjet" in n:
        return "gemm"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "adam" in n or "multi_tensor" in n or "foreach" in n:
        return "optimizer/multi-tensor"
    if "layer_norm" in n or "layernorm" in n:
        return "layer norm"
    if "reduce" in n:
        return "reduction"
    return "element-wise/other"


def _kernels(trace_path: str):
    with open(trace_path) as f:
        trace = json.load(f)
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "kernel":
            out.append((float(e["ts"]), float(e["dur"]), int(e["args"].get("stream", -1)),
                        e["name"]))
    out.sort()
    return out


def _analyse(kernels, steps: int):
    by_stream = collections.Counter()
    for _ts, _dur, stream, name in kernels:
        if "nccl" not in name.lower():
            by_stream[stream] += 1
    compute = by_stream.most_common(1)[0][0]
    comp = [k for k in kernels if k[2] == compute]
    nccl = [k for k in kernels if "nccl" in k[3].lower()]
    fam = collections.Counter()
    for _ts, dur, _stream, name in comp:
        fam[_family(name)] += dur
    busy = sum(k[1] for k in comp)
    span = comp[-1][0] + comp[-1][1] - comp[0][0]
    gaps = []
    for a, b in zip(comp, comp[1:]):
        gap = b[0] - (a[0] + a[1])
        if gap > 0:
            gaps.append((gap, a[3][:60], b[3][:60]))
    gaps.sort(reverse=True)
    return {
        "span_us": span / steps,
        "busy_us": busy / steps,
        "idle_us": (span - busy) / steps,
        "families_us": {k: v / steps for k, v in fam.most_common()},
        "nccl_us": sum(k[1] for k in nccl) / steps,
        "nccl_kernels": len(nccl) / steps,
        "top_gaps": [(round(g, 1), a, b) for g, a, b in gaps[:6]],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None, help="keep the chrome traces here")
    args = p.parse_args(argv)
    device = bp._init(False)
    setup_args = types.SimpleNamespace(smoke=False, gpt_batch=8)
    results = {}
    for name, wrap in (("1 GPU", lambda m: m), ("mixprec DDP", DistributedDataParallel)):
        model, opt, x, y = bp._gpt_setup(device, setup_args)
        step = bp._train_step(wrap(model), opt, x, y, bp._lm_loss)
        for _ in range(6):
            step()
        torch.cuda.synchronize()
        # Host synchronizations inside one step (each drains the GPU's queue of launches).
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            step()
            torch.cuda.set_sync_debug_mode("default")
        syncs = sorted({f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:80]}"
                        for w in caught})
        torch.cuda.synchronize()
        dist.barrier()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        folder = args.out or tempfile.mkdtemp()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"ddp_{name.replace(' ', '_')}_rank{dist.get_rank()}.json")
        prof.export_chrome_trace(path)
        results[name] = _analyse(_kernels(path), args.steps)
        results[name]["host_syncs"] = syncs
        del model, opt, step, prof
        bp._free(device)
    if dist.get_rank() == 0:
        print(json.dumps(results, indent=1))
        a, b = results["1 GPU"], results["mixprec DDP"]
        print(f"span {a['span_us']:.0f} -> {b['span_us']:.0f} us; busy {a['busy_us']:.0f} -> "
              f"{b['busy_us']:.0f}; idle {a['idle_us']:.0f} -> {b['idle_us']:.0f}")
        for fam in b["families_us"]:
            print(f"  {fam:<24} {a['families_us'].get(fam, 0):9.0f} -> "
                  f"{b['families_us'][fam]:9.0f} us")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
