"""Host time of amp O2's ``optimizer.step()`` with part of the model frozen, for A/B runs of
two checkouts on one machine.

A stack of 75 ``Linear(16, 16)`` layers (150 parameters, tiny tensors: the time is the host's),
the first ``--frozen`` fraction of them with ``requires_grad=False`` and still held by the
optimizer (SGD, foreach), as MoCo's key encoder is. Run it once per checkout, alternating::

    for tree in /path/old /path/new; do
        python benchmarks/probe_step_frozen.py --tree $tree --frozen 0.5
    done

Prints one line: the tree, the frozen fraction, the median and 10th percentile of the step's
host time over 350 steps (after 50 untimed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default=os.getcwd(),
                        help="checkout whose mixprec is imported (default: the current directory)")
    parser.add_argument("--frozen", type=float, default=0.0,
                        help="fraction of the layers frozen (0 to 1)")
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    args = parser.parse_args()
    if not 0.0 <= args.frozen <= 1.0:
        parser.error(f"--frozen must be between 0 and 1, got {args.frozen}")
    sys.path.insert(0, os.path.abspath(args.tree))

    import torch
    from torch import nn

    from mixprec import amp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(75)]
    for layer in layers[:int(len(layers) * args.frozen)]:
        layer.requires_grad_(False)
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0,
                                loss_scale=128.0)
    x = torch.randn(4, 16)
    times = []
    for i in range(400):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        start = time.perf_counter()
        opt.step()
        if i >= 50:
            times.append(time.perf_counter() - start)
    times.sort()
    print(f"{args.tree} frozen={args.frozen} {args.dtype}: median "
          f"{times[len(times) // 2] * 1e6:.0f} us, p10 {times[len(times) // 10] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
