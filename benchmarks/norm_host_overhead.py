"""Host (CPU) time per call of the fused norms, beside torch's, where the GPU is not the limit.

bench_norm.py judges the kernels (CUDA-graph replay); this script measures the other half of
an op's cost: the Python and launch work per call, which decides the step time whenever the
host, not the GPU, is the bottleneck (small batches, slow host CPUs). Shapes are small (64
rows) so that every figure is host time. Rows:

* ``fwd``: one forward call (module call, checks, autograd node, kernel launch).
* ``fwd+bwd, one call``: ``torch.autograd.grad`` of one norm: includes the autograd engine's
  hand-over to its device thread and back, paid once per backward pass, not per layer.
* ``chain of K, per layer``: K norms in sequence, one backward through all of them, divided
  by K: what a norm adds to a real model's step.
* BatchNorm: ``torch.nn.BatchNorm2d`` against ``FusedBatchNorm`` on a small bf16
  channels-last batch with fp32 parameters (amp O2's case, where FusedBatchNorm runs its
  Triton kernels).
* SyncBatchNorm: ``torch.nn.BatchNorm2d`` against ``SyncBatchNorm`` on the same batch, the
  layer told it is one of two ranks and its collectives replaced by local copies: the layer's
  own host cost (a real collective adds c10d's and NCCL's).
* ``trivial Python autograd.Function``: an identity op defined in Python, the floor for any
  op whose backward is written in Python (as every Triton-based norm's is).

    python benchmarks/norm_host_overhead.py [--rows 64] [--n 1024] [--chain 24]
        [--only batchnorm]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def host_runs(fn, calls=200, repeats=7):
    """Host microseconds per call of ``fn``, one figure per repeat of ``calls`` calls (after
    20 untimed ones; the GPU drained in between)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return runs


def _host_us(fn, calls=200, repeats=7):
    """Median over repeats of the host microseconds per call (the GPU drained in between)."""
    return statistics.median(host_runs(fn, calls, repeats))


def _compare(name, chains, x, dy, chain_len):
    """Table rows: host us of torch's and mixprec's layer, per case."""
    cases = {}
    for who, chain in chains.items():
        one = chain[0]
        params = list(one.parameters())
        cases.setdefault("fwd", {})[who] = _host_us(lambda one=one: one(x))
        cases.setdefault("fwd+bwd, one call", {})[who] = _host_us(
            lambda one=one, params=params: torch.autograd.grad(one(x), [x, *params], dy)
        )
        all_params = list(chain.parameters())
        per_chain = _host_us(
            lambda chain=chain, ps=all_params: torch.autograd.grad(chain(x), [x, *ps], dy),
            calls=20,
        )
        cases.setdefault(f"chain of {chain_len}, per layer", {})[who] = per_chain / chain_len
    return [f"| {name} | {case} | {r['torch']:.0f} | {r['mixprec']:.0f} | "
            f"{r['mixprec'] - r['torch']:+.0f} |" for case, r in cases.items()]


def _pretend_two_ranks():
    """SyncBatchNorm layers believe they are one of two ranks; their all-gather hands back this
    rank's row twice and their all-reduce does nothing (no process group needed)."""
    import mixprec.parallel._sync_batchnorm_function as sbf
    import mixprec.parallel.sync_batchnorm as sbm

    sbm.is_distributed = lambda: True
    sbm.group_world_size = lambda group: 2
    sbf.all_gather_rows = lambda row, group, world_size: row.unsqueeze(0).expand(
        world_size, -1).contiguous()
    sbf.all_reduce_sum = lambda t, group: t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--chain", type=int, default=24)
    p.add_argument("--only", choices=("all", "batchnorm"), default="all",
                   help="batchnorm: only the BatchNorm and SyncBatchNorm rows")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("norm_host_overhead.py needs a CUDA GPU")
    from mixprec.normalization import FusedBatchNorm, FusedLayerNorm, FusedRMSNorm

    dtype = torch.bfloat16
    x = torch.randn(args.rows, args.n, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    print(f"host us per call, {args.rows}x{args.n} bf16, torch {torch.__version__}\n")
    print("| op | case | torch | mixprec | mixprec - torch |")
    print("|---|---|---:|---:|---:|")
    rows = []
    for name, ours_cls, torch_cls in (
        ("LayerNorm", FusedLayerNorm, torch.nn.LayerNorm),
        ("RMSNorm", FusedRMSNorm, torch.nn.RMSNorm),
    ) if args.only == "all" else ():
        chains = {who: torch.nn.Sequential(*[cls(args.n) for _ in range(args.chain)]).to(
            device="cuda", dtype=dtype) for who, cls in (("torch", torch_cls),
                                                         ("mixprec", ours_cls))}
        rows += _compare(name, chains, x, dy, args.chain)
    # BatchNorm as amp O2 runs it: bf16 channels-last input, fp32 parameters (PyTorch's native
    # kernels serve that; FusedBatchNorm takes its Triton kernels).
    xb = torch.randn(8, 64, 4, 4, device="cuda", dtype=dtype).contiguous(
        memory_format=torch.channels_last).requires_grad_(True)
    chains = {who: torch.nn.Sequential(*[cls(64) for _ in range(args.chain)]).cuda()
              for who, cls in (("torch", torch.nn.BatchNorm2d), ("mixprec", FusedBatchNorm))}
    rows += _compare("BatchNorm2d 8x64x4x4", chains, xb, torch.randn_like(xb), args.chain)
    _pretend_two_ranks()
    from mixprec.parallel import SyncBatchNorm

    chains = {who: torch.nn.Sequential(*[cls(64) for _ in range(args.chain)]).cuda()
              for who, cls in (("torch", torch.nn.BatchNorm2d), ("mixprec", SyncBatchNorm))}
    rows += _compare("SyncBatchNorm 8x64x4x4, collectives local", chains, xb,
                     torch.randn_like(xb), args.chain)
    for row in rows:
        print(row)
    floor = _host_us(lambda: torch.autograd.grad(_Identity.apply(x), [x], dy))
    native = _host_us(lambda: torch.autograd.grad(x.clone(), [x], dy))
    print(f"\ntrivial Python autograd.Function (clone), fwd+bwd one call: {floor:.0f} us; "
          f"the same clone as a native op: {native:.0f} us")


if __name__ == "__main__":
    main()
