"""Profile one training recipe of the GPT benchmark: where the step's time goes.

A diagnostic beside bench_amp.py (which gives the ratios): the top CUDA kernels and CPU ops of
a few steps under the PyTorch profiler, and the step time with and without a host sync.

    python benchmarks/profile_step.py --mode O1 --dtype bf16 --norm mixprec
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mixprec import amp  # noqa: E402
from mixprec.bench.models import build_workload  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="O1", choices=["O1", "O2", "O3", "autocast"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--norm", default="torch", choices=["torch", "mixprec"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    norm_cls = None
    if args.norm == "mixprec":
        from mixprec.normalization import FusedLayerNorm
        norm_cls = FusedLayerNorm
    w = build_workload("gpt", device="cuda", size="large", norm_cls=norm_cls)
    model = w.build_model().cuda()
    opt = w.build_optimizer(model.parameters(), torch.device("cuda"))
    if args.mode != "autocast":
        model, opt = amp.initialize(model, opt, opt_level=args.mode, dtype=dtype, verbosity=0)
    x, y = w.batches[0]

    def step():
        opt.zero_grad(set_to_none=True)
        if args.mode == "autocast":
            with torch.autocast("cuda", dtype=dtype):
                loss = w.loss_fn(model(x), y)
            loss.backward()
            opt.step()
            return
        loss = w.loss_fn(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    torch.cuda.synchronize()
    print(f"{args.mode} {args.dtype} norm={args.norm}: {start.elapsed_time(end) / args.steps:.2f} ms/step")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
