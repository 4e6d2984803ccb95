"""Where a fused norm's host time goes, and whether it decides the GPT step.

A diagnostic for the eager GPT rows of bench_amp.py with FusedLayerNorm (slower than with
``nn.LayerNorm`` although the kernels are faster). Two parts, both on one GPU:

1. The GPT-style step (amp O2 bf16) with ``nn.LayerNorm`` and with ``FusedLayerNorm``: host
   time per step (the Python and launch work, the GPU drained before each step), GPU time of
   the same step (CUDA events), and the step as a CUDA-graph replay (the GPU alone).
2. 25 norms in a chain on the GPT's activation shape: host time per norm, forward and
   backward, with and without Python's garbage collector.
3. One norm call (64 x 1024 bf16, so that every figure is host time) taken apart on the main
   thread: module call, the autograd Function, the launch plan, the bare launches.

    python benchmarks/probe_norm_host.py [--steps 20] [--calls 300]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _cuda_timing import capture_graph, median_ms  # noqa: E402
from norm_host_overhead import host_runs  # noqa: E402

from mixprec import amp  # noqa: E402
from mixprec.bench.models import build_workload  # noqa: E402
from mixprec.normalization import FusedLayerNorm, _launch, _ops  # noqa: E402


def _us(fn, calls, repeats=7):
    """(min, median) over repeats of the host microseconds per call. The host is shared and
    noisy: the minimum is the steadier figure of what the code costs."""
    runs = host_runs(fn, calls, repeats)
    return min(runs), statistics.median(runs)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def _step_fn(norm_cls):
    w = build_workload("gpt", device="cuda", size="large", norm_cls=norm_cls)
    model = w.build_model().cuda()
    opt = w.build_optimizer(model.parameters(), torch.device("cuda"))
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    for group in opt.param_groups:
        group["capturable"] = True  # (the graph-replay column captures the optimizer too)
    x, y = w.batches[0]

    phases = {"forward": [], "backward": [], "optimizer": []}

    def step(record=False):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = w.loss_fn(model(x), y)
        t1 = time.perf_counter()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        t2 = time.perf_counter()
        opt.step()
        if record:
            t3 = time.perf_counter()
            for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(dt * 1e3)

    step.phases = phases
    step.forward = lambda: w.loss_fn(model(x), y)
    return step


def _graph_ms(step, replays=20):
    graph = capture_graph(step)
    return median_ms(graph.replay, replays, warmup=3)


def part_step(steps):
    print("| norm | host ms per step | GPU ms per step (drained start) | eager ms (back to back) "
          "| graph replay ms |")
    print("|---|---:|---:|---:|---:|")
    for name, cls in (("nn.LayerNorm", None), ("FusedLayerNorm", FusedLayerNorm)):
        step = _step_fn(cls)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        host, gpu = [], []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(steps):
            torch.cuda.synchronize()
            start.record()
            t0 = time.perf_counter()
            step(record=True)
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end))
        phase_text = ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in step.phases.items())
        print(f"  {name}: host ms by phase (GPU drained first): {phase_text}")
        if cls is not None:
            import cProfile
            import pstats

            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(3):
                step.forward()
            prof.disable()
            torch.cuda.synchronize()
            print("  cProfile of 3 forward passes (main thread), top 14 by own time:")
            stats = pstats.Stats(prof)
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:14]
            for (path, line, func), (_cc, nc, tt, ct, _) in rows:
                print(f"    {tt * 1e3 / 3:7.2f} ms own {ct * 1e3 / 3:7.2f} ms cum {nc // 3:6d} "
                      f"calls  {os.path.basename(path)}:{line}({func})")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        eager = (time.perf_counter() - t0) * 1e3 / steps
        graph = _graph_ms(step)
        print(f"| {name} | {statistics.median(host):.2f} | {statistics.median(gpu):.2f} | "
              f"{eager:.2f} | {graph:.2f} |")
        del step
        torch.cuda.empty_cache()


def part_chain(repeats=10):
    """25 norms in a chain on the GPT's activation shape (8 x 1024 x 1024 bf16), one backward
    through all of them: host ms per norm (GPU drained before each pass), with and without
    Python's cyclic garbage collector."""
    import gc

    x = torch.randn(8, 1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    print("\n| chain of 25 on 8x1024x1024 bf16 | host us per norm, fwd | bwd | gc off: fwd | bwd |")
    print("|---|---:|---:|---:|---:|")
    for name, cls in (("nn.LayerNorm", torch.nn.LayerNorm), ("FusedLayerNorm", FusedLayerNorm)):
        chain = torch.nn.Sequential(*[cls(1024) for _ in range(25)]).to("cuda", torch.bfloat16)
        cells = []
        for gc_on in (True, False):
            fwd, bwd = [], []
            (gc.enable if gc_on else gc.disable)()
            try:
                for _ in range(repeats + 3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    y = chain(x)
                    t1 = time.perf_counter()
                    y.backward(dy)
                    t2 = time.perf_counter()
                    fwd.append((t1 - t0) / 25 * 1e6)
                    bwd.append((t2 - t1) / 25 * 1e6)
                    x.grad = None
            finally:
                gc.enable()
            cells += [min(fwd[3:]), min(bwd[3:])]
        print(f"| {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    # The host launchers alone at this shape (rows of the 8192 x 1024 view).
    x2, dy2 = x.detach().view(-1, 1024), dy.view(-1, 1024)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    b = torch.zeros_like(w)
    _, mean, rstd = _launch.forward(x2, w, b, 1e-5, False, x2.dtype)
    import cProfile
    import pstats

    for label, fn in (
        ("_launch.forward", lambda: _launch.forward(x2, w, b, 1e-5, False, x2.dtype)),
        ("_launch.backward", lambda: _launch.backward(dy2, x2, w, b, mean, rstd, False, False,
                                                      x2.dtype, True, True)),
    ):
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:8]
        print(f"  cProfile of 200 x {label} at 8192x1024, top 8 by own time (us per call):")
        for (path, line, func), (_cc, nc, tt, _ct, _) in rows:
            print(f"    {tt * 1e6 / 200:7.1f} us own, {nc // 200:3d} calls  "
                  f"{os.path.basename(path)}:{line}({func})")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_sm = sorted(set(_launch._PROGRAMS_PER_SM.values()))
    for label, fn in (
        ("_launch.forward", lambda: _launch.forward(x2, w, b, 1e-5, False, x2.dtype)),
        ("_launch.backward", lambda: _launch.backward(dy2, x2, w, b, mean, rstd, False, False,
                                                      x2.dtype, True, True)),
        ("torch.empty(8192, 1024) bf16", lambda: torch.empty((8192, 1024), dtype=x2.dtype,
                                                             device="cuda")),
    ):
        lo, mid = _us(fn, 200)
        print(f"  {label} at 8192x1024: {lo:.0f} us (median {mid:.0f})")
    print(f"  backward programs per SM learnt so far: {per_sm}, {sms} SMs (the partial sums: "
          f"2 x programs x 1024 fp32 = {[round(8 * p * sms * 1024 / 2**20, 1) for p in per_sm]}"
          " MiB)")


def part_call(calls):
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    norm = FusedLayerNorm(1024).to(device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.LayerNorm(1024).to(device="cuda", dtype=torch.bfloat16)
    w, b = norm.weight, norm.bias
    x2, wd, bd = x.detach(), w.detach(), b.detach()
    y, mean, rstd = _launch.forward(x2, wd, bd, 1e-5, False, x2.dtype)
    kernel = _launch._kernels().norm_fwd_kernel
    key = next(k for k in _launch._COMPILED if k[0] is kernel)
    compiled = _launch._COMPILED[key].compiled
    out = torch.empty_like(x2)
    cfg = _launch.default_config(1024)
    consts = dict(IS_RMS=False, HAS_WEIGHT=True, HAS_BIAS=True, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    args = (x2, out, wd, bd, mean, rstd, x2.stride(0), out.stride(0), 64, 1024, 1e-5)
    values = list(args) + [consts[n] for n in kernel.arg_names[len(args):]]
    grid = (64 // cfg.block_m, 1, 1)
    stream = torch.cuda.current_stream().cuda_stream
    cases = [
        ("torch nn.LayerNorm forward (grad on)", lambda: ref(x)),
        ("torch nn.LayerNorm fwd+bwd (autograd.grad)",
         lambda: torch.autograd.grad(ref(x), [x, ref.weight, ref.bias], dy)),
        ("FusedLayerNorm forward (grad on)", lambda: norm(x)),
        ("FusedLayerNorm forward (no grad)", lambda: norm(x2)),
        ("FusedLayerNorm fwd+bwd (autograd.grad)",
         lambda: torch.autograd.grad(norm(x), [x, w, b], dy)),
        ("_ops.fused_norm forward (no grad)",
         lambda: _ops.fused_norm(x2, (1024,), wd, bd, 1e-5, False, False, x2.dtype)),
        ("_launch.forward", lambda: _launch.forward(x2, wd, bd, 1e-5, False, x2.dtype)),
        ("_launch.launch (forward kernel)",
         lambda: _launch.launch(kernel, grid[:1], args, consts, x2.device)),
        ("compiled[grid](...) (Triton's runner)",
         lambda: compiled[grid](*values, stream=stream)),
        ("compiled.run(...) (the launcher)",
         lambda: compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                              compiled.packed_metadata, None, None, None, *values)),
        ("_launch.backward",
         lambda: _launch.backward(dy, x2, wd, bd, mean, rstd, False, False, x2.dtype, True,
                                  True)),
        ("torch.empty(64, 1024)", lambda: torch.empty((64, 1024), dtype=x2.dtype,
                                                      device=x2.device)),
        ("_launch._arg_key x 11", lambda: tuple(map(_launch._arg_key, args))),
    ]
    cases.append(("trivial Python autograd.Function fwd+bwd (autograd.grad)",
                  lambda: torch.autograd.grad(_Identity.apply(x, w, b), [x], dy)))

    # The module's launch plan called directly: what is left of a norm's host work once the
    # module, the autograd Function and the engine are taken away.
    plan = _launch.norm_plan(x.device, 64, 1024, x.dtype, x.dtype, w.dtype, b.dtype, 1e-5,
                             False, False)
    plan_out = torch.empty_like(x2)
    p_mean, p_rstd = plan.forward(x2, 1024, wd, bd, plan_out, 1024)
    cases.append(("NormPlan.forward (allocations + launch)",
                  lambda: plan.forward(x2, 1024, wd, bd, plan_out, 1024)))
    cases.append(("NormPlan.backward (allocations + 2 launches)",
                  lambda: plan.backward(dy, 1024, x2, 1024, wd, bd, p_mean, p_rstd, True, True,
                                        (64, 1024))))
    print("\n| call (64x1024 bf16) | host us, min | median |")
    print("|---|---:|---:|")
    for name, fn in cases:
        try:
            lo, mid = _us(fn, calls)
            print(f"| {name} | {lo:.1f} | {mid:.1f} |")
        except Exception as err:  # a Triton internal that moved: report, go on
            print(f"| {name} | failed: {type(err).__name__}: {err} | |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--parts", nargs="+", default=["step", "chain", "call"],
                   choices=["step", "chain", "call"])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("probe_norm_host.py needs a CUDA GPU")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}\n")
    if "step" in args.parts:
        part_step(args.steps)
    if "chain" in args.parts:
        part_chain()
    if "call" in args.parts:
        part_call(args.calls)


if __name__ == "__main__":
    main()
