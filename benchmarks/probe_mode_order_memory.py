"""Does a mode's measured peak memory depend on the modes run before it in the process?

``bench_amp.py`` runs its modes one after another in one process and charges each the
allocator's peak growth over its start. For ResNet-50 the O2-vs-autocast memory verdict is a
tie within a few MiB, so this probe runs the same modes (``mixprec bench``'s runner) in two
orders and prints each mode's growth, absolute peak and starting baseline.

Usage::

    python benchmarks/probe_mode_order_memory.py [--model resnet50] [--dtype fp16]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

try:
    import mixprec  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mixprec.bench.models import build_workload  # noqa: E402
from mixprec.bench.runner import DTYPES, run_modes, warm_up_process  # noqa: E402

ORDERS = (["autocast", "half", "O1", "O2", "O3"], ["O2", "O1", "autocast", "O2", "autocast"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("resnet50", "gpt", "cnn"), default="resnet50")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args(argv)
    dev = torch.device("cuda", torch.cuda.current_device())
    batch = 8 if args.model == "gpt" else 128
    wl = build_workload(args.model, device=dev, size="large", batch_size=batch, num_batches=2)
    warm_up_process(wl, device=dev, dtype=DTYPES[args.dtype])
    print("| order | mode | growth MiB | peak MiB | baseline MiB |\n|---|---|---:|---:|---:|")
    for k, order in enumerate(ORDERS):
        results = run_modes(wl, order, dtype=DTYPES[args.dtype], device=dev, iters=args.steps,
                            warmup=args.warmup, channels_last=wl.image, process_warmup=False)
        for r in results:
            total = r.extra.get("peak_memory_total_mb")
            print(f"| {k + 1} | {r.mode} | {r.peak_memory_mb:.3f} | {total:.3f} | "
                  f"{total - r.peak_memory_mb:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
