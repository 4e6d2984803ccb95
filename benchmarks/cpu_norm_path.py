"""The fused norms' PyTorch path on a CPU, beside torch.nn.LayerNorm / torch.nn.RMSNorm.

On CPU tensors (and in float64, and for rows longer than the Triton kernel takes) mixprec's
FusedLayerNorm / FusedRMSNorm run plain PyTorch: LayerNorm's forward on PyTorch's own kernel,
the backward (and RMSNorm's forward) as tensor arithmetic on the normalized rows. This script
times both modules, forward and forward+backward, in fp32 and bf16, and prints mixprec's time
as a multiple of torch's.

CPU timings are easily disturbed by other work on the machine, so each figure is the minimum
over ``--reps`` calls, the two modules' calls interleaved (one of torch's, one of mixprec's),
so that both see the same load.

    python benchmarks/cpu_norm_path.py [--shape 4096x1024] [--reps 40] [--threads N]
"""

import argparse
import os
import platform
import sys
import time

import torch

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mixprec.normalization import FusedLayerNorm, FusedRMSNorm  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _shape(text):
    try:
        m, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shape takes MxN (e.g. 4096x1024), got {text!r}") from None
    if m < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"--shape needs positive sizes, got {text!r}")
    return m, n


def _call(module, x, dy, backward):
    def run():
        y = module(x)
        if backward:
            torch.autograd.grad(y, [x, *module.parameters()], dy)
    return run


def interleaved_min_ms(fns, reps):
    """Minimum milliseconds per call of each function, their calls interleaved."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], (time.perf_counter() - t0) * 1e3)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=_shape, default=(4096, 1024), metavar="MxN")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: PyTorch's choice)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    m, n = args.shape
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {m}x{n}, min of {args.reps} interleaved calls")
    print("| norm | dtype | pass | torch ms | mixprec ms | mixprec / torch |")
    print("|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for dname, dtype in DTYPES.items():
        x = torch.randn(m, n, dtype=dtype, requires_grad=True)
        dy = torch.randn(m, n, dtype=dtype)
        for name, theirs, ours in (
            ("LayerNorm", torch.nn.LayerNorm(n), FusedLayerNorm(n)),
            ("RMSNorm", torch.nn.RMSNorm(n), FusedRMSNorm(n)),
        ):
            theirs, ours = theirs.to(dtype), ours.to(dtype)
            for backward in (False, True):
                fns = [_call(theirs, x, dy, backward), _call(ours, x, dy, backward)]
                t_theirs, t_ours = interleaved_min_ms(fns, args.reps)
                print(f"| {name} | {dname} | {'fwd+bwd' if backward else 'fwd'} | "
                      f"{t_theirs:.2f} | {t_ours:.2f} | {t_ours / t_theirs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
