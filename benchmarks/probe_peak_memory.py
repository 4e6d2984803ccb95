"""Where a recipe's peak GPU memory goes: the live allocations at the peak, by source line.

``bench_amp.py`` judges "O2 peak memory <= torch autocast's" from the allocator's peak. When
two recipes peak within a few MiB of each other that number says nothing about why. This
probe records the CUDA caching allocator's history (``torch.cuda.memory._record_memory_history``)
from before the model is built, runs the same steps as ``mixprec bench`` (its models and
recipes), replays the trace, and prints for each recipe the allocations alive at its peak
grouped by the innermost Python line outside ``torch/`` that made them (allocations the
autograd engine makes in backward have no Python frames), then the difference between the
recipes group by group. A throw-away warm-up runs first, so that one-time costs of the
process (cuBLAS workspaces) are charged to no recipe.

Usage::

    python benchmarks/probe_peak_memory.py                       # ResNet-50 fp16: autocast vs O2
    python benchmarks/probe_peak_memory.py --model gpt --dtype bf16 --modes autocast O2 half
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys

import torch

try:
    import mixprec  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mixprec.bench import runner  # noqa: E402
from mixprec.bench.models import build_workload  # noqa: E402

MiB = 2**20


def _key(frames) -> str:
    """The innermost frame outside torch/ (the model, mixprec, the recipe), with the innermost
    torch function under it, so that e.g. a convolution's output and its weight cast differ."""
    inner_torch = ""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" in name:
            inner_torch = inner_torch or f.get("name", "")
            continue
        where = f"{os.path.basename(name)}:{f.get('line')}:{f.get('name')}"
        return f"{where} [{inner_torch}]" if inner_torch else where
    return f"<no python frame> [{inner_torch}]" if inner_torch else "<no python frame>"


def _replay(trace, start_bytes, last_from):
    """Replay alloc/free events: the peak over all events and over the events from index
    ``last_from`` on, each with the live allocations (addr -> (size, key)) at that moment."""
    live = {}
    total = start_bytes
    peak = {"all": (-1, None, -1), "last": (-1, None, -1)}
    for i, ev in enumerate(trace):
        action = ev["action"]
        if action == "alloc":
            live[ev["addr"]] = (ev["size"], _key(ev.get("frames", [])))
            total += ev["size"]
            for name, lo in (("all", 0), ("last", last_from)):
                if i >= lo and total > peak[name][0]:
                    peak[name] = (total, dict(live), i)
        elif action == "free_completed":
            if ev["addr"] in live:
                total -= live.pop(ev["addr"])[0]
            else:  # allocated before the recording started
                total -= ev["size"]
    return peak


def _groups(live):
    out = collections.Counter()
    for size, key in live.values():
        out[key] += size
    return out


def probe(workload, mode, dtype, device, steps, warmup, channels_last):
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        torch.manual_seed(0)
        prev = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True
        recipe = runner._build_recipe(workload, mode, dtype, device, channels_last, False)
        batches = workload.batches
        if channels_last and workload.image:
            batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
        n_before_last = None
        for i in range(warmup + steps):
            if i == warmup + steps - 1:
                torch.cuda.synchronize(device)
                n_before_last = len(torch.cuda.memory._snapshot()["device_traces"][device.index])
            x, y = batches[i % len(batches)]
            recipe.step(x, y)
        torch.cuda.synchronize(device)
        torch.backends.cudnn.benchmark = prev
        snap = torch.cuda.memory._snapshot()
        allocator_peak = torch.cuda.max_memory_allocated(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][device.index]
    peak = _replay(trace, start, n_before_last or 0)
    del recipe
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "mode": mode,
        "start_bytes": start,
        "allocator_peak_bytes": allocator_peak,
        "events": len(trace),
        "peak_bytes": peak["all"][0],
        "peak_event": peak["all"][2],
        "peak_groups": _groups(peak["all"][1] or {}),
        "last_step_peak_bytes": peak["last"][0],
        "last_step_groups": _groups(peak["last"][1] or {}),
        "peak_alloc_key": trace[peak["all"][2]]["frames"][:6] if peak["all"][2] >= 0 else [],
    }


def _table(title, groups, top):
    print(f"\n{title}")
    for key, size in groups.most_common(top):
        print(f"  {size / MiB:10.2f} MiB  {key}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", choices=("resnet50", "gpt", "cnn"))
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    p.add_argument("--modes", nargs="+", default=["autocast", "O2"])
    p.add_argument("--steps", type=int, default=3, help="steps after the warm-up (default 3)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None, help="write a JSON summary here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the caching allocator's history)")
    device = torch.device("cuda", torch.cuda.current_device())
    workload = build_workload(args.model, device=device, size="large")
    channels_last = workload.image
    dtype = runner.DTYPES[args.dtype]
    # One-time costs of the process (cuBLAS workspaces: ~65 MiB on an H200) would otherwise
    # be charged to whichever recipe runs first, as bench_amp's fp32 row takes them there.
    runner.warm_up_process(workload, device, dtype)
    results = [probe(workload, m, dtype, device, args.steps, args.warmup, channels_last)
               for m in args.modes]
    print(f"{args.model} {args.dtype}, channels_last={channels_last}; peak = growth over the "
          "memory allocated before the model was built, as bench_amp measures it")
    for r in results:
        print(f"\n== {r['mode']}: peak {(r['peak_bytes'] - r['start_bytes']) / MiB:.2f} MiB "
              f"(allocator's own peak {(r['allocator_peak_bytes'] - r['start_bytes']) / MiB:.2f}"
              f"), last step's peak {(r['last_step_peak_bytes'] - r['start_bytes']) / MiB:.2f} "
              f"MiB; {r['events']} events, peak at event {r['peak_event']}")
        print("   allocation that reached the peak:",
              " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"
                          for f in r["peak_alloc_key"]))
        _table(f"   live at the peak, top {args.top} groups:", r["peak_groups"], args.top)
    base = results[0]
    for r in results[1:]:
        for which in ("peak_groups", "last_step_groups"):
            diff = collections.Counter(r[which])
            diff.subtract(base[which])
            rows = sorted(((k, v) for k, v in diff.items() if v), key=lambda kv: -abs(kv[1]))
            net = sum(v for _, v in rows)
            print(f"\n== {r['mode']} minus {base['mode']} ({which}), net {net / MiB:+.3f} MiB:")
            for key, v in rows[: args.top]:
                print(f"  {v / MiB:+10.3f} MiB  {key}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{k: (dict(v) if isinstance(v, collections.Counter) else v)
                        for k, v in r.items()} for r in results], f, indent=1, default=str)


if __name__ == "__main__":
    main()
