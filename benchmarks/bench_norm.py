"""Benchmark mixprec's fused LayerNorm/RMSNorm against torch.nn.LayerNorm / torch.nn.RMSNorm.

GPU only. In one run it measures the device's copy bandwidth (a device-to-device copy, bytes
read + written), then forward and forward+backward of both implementations at
32768x1024, 16384x4096 and 8192x8192 in bf16 and fp32, and prints effective bandwidth as a
fraction of the copy bandwidth and the speed-up over torch, with PASS/MISS per target:

* forward:          >= 85% of copy bandwidth
* forward+backward: >= 80% of copy bandwidth and >= 1.5x torch

Effective bandwidth counts the bytes a norm must move: forward reads x and writes y
(2*M*N*elem); forward+backward adds reading x and dy and writing dx (5*M*N*elem in all).

Usage::

    python benchmarks/bench_norm.py --out results/      # ~1 min; writes results/bench_norm.json
    python benchmarks/bench_norm.py --quick             # one shape, bf16
    python benchmarks/bench_norm.py --sweep --out results/  # + kernel-config sweep, ~2-3 min more
"""

import argparse
import json
import os
import platform
import sys
import time

import torch

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FULL_SHAPES = [(32768, 1024), (16384, 4096), (8192, 8192)]
QUICK_SHAPES = [(16384, 4096)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TARGET_FWD_COPY = 0.85
TARGET_FWDBWD_COPY = 0.80
TARGET_FWDBWD_SPEEDUP = 1.5


def _do_bench(fn, rep_ms, grad_to_none=None):
    from triton.testing import do_bench

    return do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, grad_to_none=grad_to_none,
                    return_mode="median")


def _do_bench_graph(fn, rep_ms):
    """Median ms of ``fn`` replayed from a CUDA graph: the kernels' time without the host's
    launch overhead (which dominates eager timings of the small shapes)."""
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    except Exception as err:  # a capture failure is reported, not fatal
        print(f"graph timing failed: {type(err).__name__}: {err}"[:300], file=sys.stderr)
        return float("nan")


def copy_bandwidth(rep_ms):
    """TB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = _do_bench(lambda: dst.copy_(src), rep_ms)
    tbps = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12
    return tbps, ms


def _modules(kind, n, dtype):
    from mixprec.normalization import FusedLayerNorm, FusedRMSNorm

    if kind == "layer":
        ours, native = FusedLayerNorm(n), torch.nn.LayerNorm(n)
    else:
        ours, native = FusedRMSNorm(n), torch.nn.RMSNorm(n, eps=1e-5)
    ours = ours.to(device="cuda", dtype=dtype)
    native = native.to(device="cuda", dtype=dtype)
    with torch.no_grad():
        for p in list(ours.parameters()):
            p.uniform_(0.5, 1.5)
    native.load_state_dict(ours.state_dict())
    return ours, native


def bench_case(kind, m, n, dtype, rep_ms):
    """Times (ms) of forward and forward+backward for mixprec and torch at one shape."""
    ours, native = _modules(kind, n, dtype)
    x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    with torch.no_grad():
        max_diff = (ours(x).float() - native(x).float()).abs().max().item()
    res = {"max_abs_diff_vs_torch": max_diff}
    for name, mod in (("mixprec", ours), ("torch", native)):
        inputs = [x] + list(mod.parameters())

        def fwd(mod=mod):
            return mod(x)

        def fwdbwd(mod=mod, inputs=inputs):
            # autograd.grad returns fresh gradients: no accumulation kernel into .grad
            return torch.autograd.grad(mod(x), inputs, dy)

        res[f"{name}_fwd_ms"] = _do_bench(fwd, rep_ms)
        res[f"{name}_fwdbwd_ms"] = _do_bench(fwdbwd, rep_ms)
        res[f"{name}_fwd_graph_ms"] = _do_bench_graph(fwd, rep_ms)
        res[f"{name}_fwdbwd_graph_ms"] = _do_bench_graph(fwdbwd, rep_ms)
    return res


def sweep_case(m, n, dtype, rep_ms):
    """LayerNorm kernel configs around the heuristic, to guide tuning.

    Forward: num_warps at half, equal and twice the heuristic's. Backward: warps at half, equal
    and twice the heuristic's, each with the plain loop, register prefetch, and Triton's loop
    pipeliner (2 and 3 stages), with the occupancy-derived program count; the heuristic
    config at 1-8 programs per SM; and tilings of the weight/bias gradient finish. Times
    the launchers directly (no autograd), so the rows compare configs with each other.
    Configs that fail to compile or run are recorded with their error. Timed as CUDA-graph
    replays, like the targets: eager launcher timings of the small shapes time the host.
    """
    from mixprec.normalization import _launch

    x = torch.randn(m, n, device="cuda", dtype=dtype)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
    b = torch.rand(n, device="cuda", dtype=dtype)
    fwd_default = _launch.default_config(n)
    bwd_default = _launch.default_backward_config(n, x.element_size(), dy.element_size())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    es = x.element_size()
    y, mean, rstd = _launch.forward(x, w, b, 1e-5, False, dtype)
    rows = []

    def timed(pass_, nbytes, fn, **info):
        row = {"pass": pass_, **info}
        try:
            ms = _do_bench_graph(fn, rep_ms)
            row.update(ms=ms, tbps=nbytes / (ms * 1e-3) / 1e12)
        except Exception as err:  # a config that does not compile is a data point too
            row.update(ms=None, tbps=None, error=f"{type(err).__name__}: {err}"[:300])
        rows.append(row)

    def around(warps):
        return [wp for wp in (warps // 2, warps, warps * 2) if 1 <= wp <= 32]

    for warps in around(fwd_default.num_warps):
        cfg = _launch.KernelConfig(fwd_default.block_m, fwd_default.block_n, warps)
        timed("fwd", 2 * m * n * es,
              lambda cfg=cfg: _launch.forward(x, w, b, 1e-5, False, dtype, config=cfg),
              num_warps=warps, variant="-", programs_per_sm="-",
              default=warps == fwd_default.num_warps)

    def bwd(cfg, programs=None, finalize=None):
        return lambda: _launch.backward(dy, x, w, b, mean, rstd, False, False, dtype, True,
                                        True, config=cfg, num_programs=programs,
                                        finalize=finalize)

    for warps in around(bwd_default.num_warps):
        for variant in ("plain", "prefetch", "pipeline2", "pipeline3"):
            stages = int(variant[-1]) if variant.startswith("pipeline") else 0
            cfg = _launch.KernelConfig(bwd_default.block_m, bwd_default.block_n, warps,
                                       prefetch=variant == "prefetch", pipeline_stages=stages)
            timed("bwd", 3 * m * n * es, bwd(cfg), num_warps=warps, variant=variant,
                  programs_per_sm="auto", default=cfg == bwd_default)
    if bwd_default.block_n <= 2048:
        # Short rows: several rows per program puts more bytes in flight per loop iteration.
        for block_m in (2, 4):
            for warps in (2, 4, 8):
                for variant in ("plain", "prefetch"):
                    cfg = _launch.KernelConfig(block_m, bwd_default.block_n, warps,
                                               prefetch=variant == "prefetch")
                    timed("bwd", 3 * m * n * es, bwd(cfg), num_warps=warps,
                          variant=f"{variant}, {block_m} rows", programs_per_sm="auto",
                          default=False)
    for per_sm in (1, 2, 4, 8):
        if per_sm * bwd_default.num_warps <= 64:  # an SM holds at most 64 warps
            variant = "prefetch" if bwd_default.prefetch else "plain"
            timed("bwd", 3 * m * n * es, bwd(bwd_default, sms * per_sm),
                  num_warps=bwd_default.num_warps, variant=variant, programs_per_sm=per_sm,
                  default=False)
    # The weight/bias gradient finish (BLOCK_P, BLOCK_C, num_warps), heuristic config otherwise.
    for fin in ((128, 16, 4), (256, 16, 4), (512, 16, 8), (256, 8, 4), (128, 32, 4), (64, 16, 2)):
        timed("bwd", 3 * m * n * es, bwd(bwd_default, finalize=fin),
              num_warps=bwd_default.num_warps, variant=f"finish {fin[0]}x{fin[1]}, {fin[2]} warps",
              programs_per_sm="auto", default=False)
    return rows


def _shape(text):
    try:
        m, n = (int(v) for v in text.lower().split("x"))
        if m < 1 or n < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shape {text!r}: expected two positive sizes as MxN, e.g. 32768x1024"
        ) from None
    return m, n


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="directory for bench_norm.json")
    parser.add_argument("--quick", action="store_true", help="one shape (16384x4096), bf16")
    parser.add_argument("--sweep", action="store_true",
                        help="also time LayerNorm kernel configs around the heuristic")
    parser.add_argument("--rep", type=int, default=None, help="do_bench rep time in ms")
    parser.add_argument("--shape", action="append", type=_shape, default=None, metavar="MxN",
                        help="only this shape (repeatable), e.g. --shape 32768x1024")
    parser.add_argument("--dtype", choices=sorted(DTYPES), action="append", default=None,
                        help="only this dtype (repeatable)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        sys.exit("bench_norm.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "run the CPU tests instead: python -m pytest -q tests/normalization")
    try:
        import triton
    except ImportError:
        sys.exit("bench_norm.py needs Triton (it ships with CUDA builds of PyTorch)")
    if not hasattr(torch.nn, "RMSNorm"):
        sys.exit("bench_norm.py needs torch >= 2.4 for the torch.nn.RMSNorm baseline")

    started = time.time()
    rep = args.rep or (40 if args.quick else 60)
    shapes = args.shape or (QUICK_SHAPES if args.quick else FULL_SHAPES)
    dtypes = {"bf16": torch.bfloat16} if args.quick else DTYPES
    if args.dtype:
        dtypes = {name: DTYPES[name] for name in args.dtype}

    copy_tbps, copy_ms = copy_bandwidth(rep)
    results = []
    for dname, dtype in dtypes.items():
        for m, n in shapes:
            for kind in ("layer", "rms"):
                r = bench_case(kind, m, n, dtype, rep)
                es = torch.empty(0, dtype=dtype).element_size()
                for mode, nbytes in (("fwd", 2 * m * n * es), ("fwdbwd", 5 * m * n * es)):
                    # Targets are judged on graph replays (kernel time); eager times, with the
                    # host's launch overhead, are reported beside them.
                    ours_ms, torch_ms = r[f"mixprec_{mode}_graph_ms"], r[f"torch_{mode}_graph_ms"]
                    eager_ours, eager_torch = r[f"mixprec_{mode}_ms"], r[f"torch_{mode}_ms"]
                    ours_tbps = nbytes / (ours_ms * 1e-3) / 1e12
                    torch_tbps = nbytes / (torch_ms * 1e-3) / 1e12
                    frac = ours_tbps / copy_tbps
                    speedup = torch_ms / ours_ms
                    if mode == "fwd":
                        ok = frac >= TARGET_FWD_COPY
                    else:
                        ok = frac >= TARGET_FWDBWD_COPY and speedup >= TARGET_FWDBWD_SPEEDUP
                    results.append({
                        "op": "LayerNorm" if kind == "layer" else "RMSNorm", "dtype": dname,
                        "M": m, "N": n, "mode": mode, "mixprec_ms": ours_ms,
                        "torch_ms": torch_ms, "mixprec_tbps": ours_tbps,
                        "torch_tbps": torch_tbps, "frac_of_copy": frac,
                        "torch_frac_of_copy": torch_tbps / copy_tbps, "speedup_vs_torch": speedup,
                        "pass": ok, "max_abs_diff_vs_torch": r["max_abs_diff_vs_torch"],
                        "eager_mixprec_ms": eager_ours, "eager_torch_ms": eager_torch,
                        "eager_frac_of_copy": nbytes / (eager_ours * 1e-3) / 1e12 / copy_tbps,
                        "eager_speedup_vs_torch": eager_torch / eager_ours,
                    })

    sweep = []
    if args.sweep:
        for dname, dtype in dtypes.items():
            for m, n in shapes:
                for row in sweep_case(m, n, dtype, max(20, rep // 2)):
                    sweep.append({"dtype": dname, "M": m, "N": n, **row})

    print(f"device: {torch.cuda.get_device_name(0)}; copy bandwidth {copy_tbps:.2f} TB/s "
          f"(= 100%)")
    print("targets: fwd >= 85% of copy; fwd+bwd >= 80% of copy and >= 1.5x torch\n")
    print("graph = CUDA-graph replay (kernel time, judged); eager = Python calls (with launch "
          "overhead)\n")
    print("| op | dtype | M x N | pass | mixprec % copy | torch % copy | speed-up vs torch "
          "| eager % copy | eager speed-up | target |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(f"| {r['op']} | {r['dtype']} | {r['M']}x{r['N']} | "
              f"{'fwd' if r['mode'] == 'fwd' else 'fwd+bwd'} | "
              f"{100 * r['frac_of_copy']:.0f}% ({r['mixprec_tbps']:.2f} TB/s) | "
              f"{100 * r['torch_frac_of_copy']:.0f}% | {r['speedup_vs_torch']:.2f}x | "
              f"{100 * r['eager_frac_of_copy']:.0f}% | {r['eager_speedup_vs_torch']:.2f}x | "
              f"{'PASS' if r['pass'] else 'MISS'} |")
    misses = sum(not r["pass"] for r in results)
    print(f"\n{len(results) - misses}/{len(results)} targets met")
    if sweep:
        print("\nLayerNorm config sweep (launchers alone, CUDA-graph replay; % of copy bandwidth; "
              "* = heuristic)\n")
        print("| dtype | M x N | pass | num_warps | loop | programs/SM | % copy |")
        print("|---|---|---|---:|---|---:|---:|")
        for s in sweep:
            frac = "error" if s["tbps"] is None else f"{100 * s['tbps'] / copy_tbps:.0f}%"
            print(f"| {s['dtype']} | {s['M']}x{s['N']} | {s['pass']} | {s['num_warps']} | "
                  f"{s['variant']} | {s['programs_per_sm']} | {frac}"
                  f"{' *' if s['default'] else ''} |")
    elapsed = time.time() - started
    print(f"\n(wall time {elapsed:.0f} s)")

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "bench_norm.json")
        with open(path, "w") as f:
            json.dump({
                "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "triton": triton.__version__, "python": platform.python_version(),
                "copy_tbps": copy_tbps, "copy_ms": copy_ms, "rep_ms": rep,
                "targets": {"fwd_frac_of_copy": TARGET_FWD_COPY,
                            "fwdbwd_frac_of_copy": TARGET_FWDBWD_COPY,
                            "fwdbwd_speedup_vs_torch": TARGET_FWDBWD_SPEEDUP},
                "results": results, "sweep": sweep, "wall_s": elapsed,
            }, f, indent=2)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
