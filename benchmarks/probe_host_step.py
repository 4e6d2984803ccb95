"""Host time of one amp GPT training step, for A/B runs of two checkouts on one machine.

The benchmark's GPT (d_model 1024, 12 layers) at batch 1 and sequence 16: the GPU finishes each
kernel before the host launches the next, so the step time is the host's (Python, dispatch,
launches). Run it once per checkout and configuration, alternating, in one device call::

    for tree in /path/old /path/new; do
        python benchmarks/probe_host_step.py --tree $tree --opt-level O1 --norm fused
    done

Prints one line: the tree, the configuration, the median and minimum of 7 rounds of 20 steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default=os.getcwd(),
                        help="checkout whose mixprec is imported (default: the current directory)")
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--norm", default="fused", choices=["fused", "torch"],
                        help="FusedLayerNorm or nn.LayerNorm")
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))

    import torch

    import mixprec
    from mixprec import amp
    from mixprec.bench.models import GPT, GPTConfig
    from mixprec.normalization import FusedLayerNorm

    if not mixprec.__file__.startswith(os.path.abspath(args.tree)):
        raise SystemExit(f"imported mixprec from {mixprec.__file__}, not from --tree {args.tree}")
    if not torch.cuda.is_available():
        raise SystemExit("probe_host_step.py needs a CUDA GPU")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    norm = FusedLayerNorm if args.norm == "fused" else torch.nn.LayerNorm
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16), norm_cls=norm).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt = amp.initialize(model, opt, opt_level=args.opt_level, dtype=dtype, verbosity=0)
    tokens = torch.randint(0, 32000, (1, 16), device="cuda")

    def step() -> None:
        loss = model(tokens).float().mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / 20 * 1e3)
    print(f"{os.path.basename(os.path.abspath(args.tree)):12s} {args.opt_level} {args.norm:5s} "
          f"{args.dtype} median {statistics.median(rounds):.3f} ms min {min(rounds):.3f} ms",
          flush=True)


if __name__ == "__main__":
    main()
