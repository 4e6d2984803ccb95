"""O2's optimizer step alone: PyTorch's fused AdamW + amp's copy vs mixprec's FusedAdam.

At amp O2 the optimizer steps the fp32 masters (read p, g, m, v; write p, m, v: 28 bytes per
parameter) and amp then copies them into the half model (read 4, write 2: 6 bytes);
:class:`mixprec.optimizers.FusedAdam` does both in one pass (30 bytes). A pure half model's
fused AdamW moves 14 bytes. This probe times each on the parameter shapes of ``mixprec
bench``'s GPT (large) against a large device-to-device copy (the ceiling: bytes read plus
written over time), launched from Python and as CUDA-graph replays (the GPU's time alone),
and checks FusedAdam's result against PyTorch's fused AdamW.

Usage::

    python benchmarks/probe_adamw_bandwidth.py [--reps 50] [--dtype bf16|fp16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

try:
    import mixprec  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mixprec.bench.models import GPT, gpt_config  # noqa: E402
from mixprec.optimizers import FusedAdam  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cuda_timing import capture_graph, median_ms  # noqa: E402


def _time(fn, reps):
    """(eager, replay, host): medians of ``reps`` CUDA-event timings, in ms, of ``fn()``
    launched from Python (the host's work included when the GPU waits for it) and of a CUDA
    graph of it (the GPU's time alone), and of the call's host time."""
    graph = capture_graph(fn)
    host = []  # the call's own time on the host (it returns once its work is queued)
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append(1e3 * (time.perf_counter() - t0))
    return median_ms(fn, reps), median_ms(graph.replay, reps), statistics.median(host)


def _masters(shapes, dev, seed):
    gen = torch.Generator(device=dev).manual_seed(seed)
    ps = [torch.randn(s, device=dev, generator=gen) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, device=dev, generator=gen) * 1e-3
    return ps


def _copy_ceiling(dev, reps):
    """A 1 GiB fp32 device-to-device copy: (ms, bytes read + written per second)."""
    big = torch.empty(2**28, device=dev)
    dst = torch.empty_like(big)
    # (Eagerly: a graph replay of the same copy measured 0.78 ms on the H200, 2.75 TB/s, where
    # the eager copy ran at 4.1: not a ceiling for kernels.)
    t_copy = _time(lambda: dst.copy_(big), reps)[0]
    return t_copy, 2 * big.numel() * 4 / (t_copy * 1e-3)


def _timings(shapes, dev, half, args):
    """(pass, ms, bytes per parameter) of each optimizer pass, on fresh tensors each."""
    hyper = dict(lr=1e-3, weight_decay=0.1)
    # O2 today: PyTorch's fused AdamW on the fp32 masters, then amp's copy into the model.
    ps = _masters(shapes, dev, 0)
    model_params = [p.detach().to(half) for p in ps]
    torch_opt = torch.optim.AdamW(ps, fused=True, capturable=True, **hyper)

    def torch_o2():
        torch_opt.step()
        torch._foreach_copy_(model_params, ps)

    yield "torch fused AdamW (fp32 masters)", _time(torch_opt.step, args.reps), 28
    yield ("amp's copy: _foreach_copy_ fp32 -> half",
           _time(lambda: torch._foreach_copy_(model_params, ps), args.reps), 6)
    yield "O2 with torch: AdamW + copy", _time(torch_o2, args.reps), 34
    # O2 with mixprec's FusedAdam: one pass writes the masters, moments and the half model.
    ps = _masters(shapes, dev, 0)
    model_params = [p.detach().to(half) for p in ps]
    opt = FusedAdam(ps, **hyper)
    opt._link_half_copies(list(zip(model_params, ps)))
    yield "O2 with mixprec: FusedAdam writing the half copy", _time(opt.step, args.reps), 30
    opt._link_half_copies([])
    yield "FusedAdam without half copies (fp32 model)", _time(opt.step, args.reps), 28
    # A pure half model's optimizer (the .half()/.bfloat16() baseline).
    ps = model_params = opt = torch_opt = None
    hs = [p.to(half) for p in _masters(shapes, dev, 1)]
    for h in hs:
        h.grad = torch.randn_like(h) * 1e-3
    half_opt = torch.optim.AdamW(hs, fused=True, capturable=True, **hyper)
    yield (f"torch fused AdamW on the {args.dtype} model (pure half)",
           _time(half_opt.step, args.reps), 14)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    args = ap.parse_args(argv)
    half = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    dev = torch.device("cuda")
    with torch.device(dev):
        model = GPT(gpt_config("large"))
    shapes = [p.shape for p in model.parameters()]
    del model
    n = sum(s.numel() for s in shapes)
    print(f"GPT parameters: {len(shapes)} tensors, {n / 1e6:.1f} M elements; half type {half}")

    t_copy, copy_bw = _copy_ceiling(dev, args.reps)
    rows = []

    def record(name, ms, bytes_per):
        eager, replay, host = ms
        bw = bytes_per * n / (replay * 1e-3)
        rows.append((name, eager, replay, host, bytes_per, bw / 1e12, bw / copy_bw))

    for name, ms, bytes_per in _timings(shapes, dev, half, args):
        record(name, ms, bytes_per)

    # Agreement: 10 steps of each from the same start, on the first 8 tensors.
    hyper = dict(lr=1e-3, weight_decay=0.1)
    a = _masters(shapes[:8], dev, 2)
    b = [p.detach().clone() for p in a]
    for p, q in zip(a, b):
        q.grad = p.grad.clone()
    copies = [q.detach().to(half) for q in b]
    ref = torch.optim.AdamW(a, fused=True, **hyper)
    ours = FusedAdam(b, **hyper)
    ours._link_half_copies(list(zip(copies, b)))
    for _ in range(10):
        ref.step()
        ours.step()
    err = max(((p - q).abs().max() / p.abs().max()).item() for p, q in zip(a, b))
    exact = all(torch.equal(c, q.to(half)) for c, q in zip(copies, b))
    print(f"copy ceiling: 1 GiB fp32 in {t_copy:.3f} ms = {copy_bw / 1e12:.2f} TB/s")
    print(f"FusedAdam vs torch fused AdamW after 10 steps: max relative difference {err:.1e}; "
          f"half copies equal the masters cast: {exact}")
    print("\n| pass | eager ms | graph ms | host ms | B/param | TB/s (graph) | of copy |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name, eager, replay, host, b_, tbs, frac in rows:
        print(f"| {name} | {eager:.3f} | {replay:.3f} | {host:.3f} | {b_} | {tbs:.2f} | "
              f"{frac:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
