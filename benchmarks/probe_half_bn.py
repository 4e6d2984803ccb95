"""The seed's riddle, isolated: why pure half precision trains a CNN with BatchNorm slower.

ResNet-50 (torchvision, channels_last, batch 128, SGD momentum) on one GPU, one process, each
recipe in turn: per step the time (CUDA events over steps run back to back; every recipe timed
before any is profiled), the GPU time spent in
batch-norm kernels (profiler, 3 steps), and which backend PyTorch picks for the BatchNorm
layers (``torch._C._select_batch_norm_backend`` on the first layer's real input and
parameters: cuDNN or PyTorch's native CUDA kernels). Recipes:

* fp16: pure ``.half()``; amp O3 (the same model); O3 with ``keep_batchnorm_fp32=True``
  (BatchNorm parameters fp32, everything else as O3); O2 (dynamic loss scale: with a plain SGD
  the overflow flag is read on the host every step), O2 with a static loss scale and O2 with
  ``SGD(fused=True)`` (the flag stays on the GPU); torch autocast + GradScaler.
* bf16 (also timed as CUDA-graph replays: the GPU's share, without the host's):
  pure ``.bfloat16()``; O2; torch autocast; and O2 with every BatchNorm running
  mixprec's channels-last Triton kernels (SyncBatchNorm's, in one process told it has a peer
  with the collectives made local copies), against PyTorch's native kernels, which serve
  every bf16 BatchNorm; and with ``mixprec.normalization.FusedBatchNorm`` (the same kernels in a
  group of one) in bf16 O2, pure bf16 and fp16 O3.

    python benchmarks/probe_half_bn.py [--batch 128] [--image 224] [--steps 10]
        [--recipes 'bf16 O2,bf16 autocast'] [--no-profile]
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mixprec import amp  # noqa: E402


def _backend_of_first_bn(model, x):
    """PyTorch's backend choice for the first BatchNorm layer, on its real input."""
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
    seen = {}
    handle = bn.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        model(x)
    handle.remove()
    weight = bn.weight
    backend = torch._C._select_batch_norm_backend(
        seen["x"], weight, bn.bias, bn.running_mean, bn.running_var, True, bn.eps)
    return f"{str(backend).split('.')[-1]} (input {seen['x'].dtype}, weight {weight.dtype})"


def _step_fn(model, opt, x, y, mode, dtype=None):
    """One training step: ``mode`` "plain" (pure half), "amp" (mixprec) or "autocast"."""
    scaler = (torch.amp.GradScaler("cuda") if mode == "autocast" and dtype == torch.float16
              else None)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=mode == "autocast"):
            loss = F.cross_entropy(model(x).float(), y)
        if mode == "amp":
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        elif scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    return step


def _bn_kernel_ms(step, steps=3):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    bn = total = 0.0
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total += t
        name = evt.key.lower()
        if "batch_norm" in name or "bn_" in name or "batchnorm" in name:
            bn += t
    return bn / 1e3 / steps, total / 1e3 / steps


def _mean_ms(step, steps, rounds=3):
    """Milliseconds per step of ``steps`` steps run back to back (the host running ahead, as
    in training), the median of ``rounds`` rounds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def _fused_bn_backend(model):
    """How many FusedBatchNorm layers planned mixprec's kernels (the rest: PyTorch's)."""
    from mixprec.normalization import FusedBatchNorm

    layers = [m for m in model.modules() if isinstance(m, FusedBatchNorm)]
    ours = sum(any(v is not False for v in m._cache.values()) for m in layers)
    return f"mixprec Triton in {ours} of {len(layers)} layers, PyTorch's in the rest"


def _host_ms(step, rounds=5):
    """Host milliseconds of one step started on an idle GPU (it returns once its kernels are
    queued, unless the launch queue fills), the median of ``rounds``."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def _triton_bn(model):
    """Every BatchNorm as mixprec's SyncBatchNorm, which (told it has a peer whose collectives
    are local copies) runs its channels-last Triton kernels in this one process."""
    import mixprec.parallel._sync_batchnorm_function as sbf
    import mixprec.parallel.sync_batchnorm as sbm
    from mixprec.parallel import convert_syncbn_model

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0,
                                world_size=1)
    sbm.group_world_size = lambda group: 2
    sbf.all_gather_rows = lambda row, group, world: row.unsqueeze(0).expand(world, -1).clone()
    sbf.all_reduce_sum = lambda t, group: t
    return convert_syncbn_model(model)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="steps per timed round (3 rounds)")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--image", type=int, default=224,
                   help="image side; with a tiny batch (--batch 2 --image 64) the GPU work "
                        "is negligible and the eager column is the host's time per step")
    p.add_argument("--recipes", default="",
                   help="only these recipes, comma-separated, each as its table row's dtype "
                        "and recipe, e.g. 'bf16 O2,bf16 autocast' (default: all)")
    p.add_argument("--host", action="store_true",
                   help="also the host's time for one step started on an idle GPU")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the profiler columns (kernel times)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("probe_half_bn.py needs a CUDA GPU")
    import torchvision

    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    x32 = torch.randn(args.batch, 3, args.image, args.image, device=device).contiguous(
        memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    recipes = [
        ("fp16", "pure .half()", dict(pure=torch.float16)),
        ("fp16", "O3", dict(opt_level="O3")),
        ("fp16", "O3 + keep_batchnorm_fp32", dict(opt_level="O3", keep_batchnorm_fp32=True)),
        ("fp16", "O2", dict(opt_level="O2")),
        ("fp16", "O2, static loss scale 128", dict(opt_level="O2", loss_scale=128.0)),
        ("fp16", "O2, SGD(fused=True)", dict(opt_level="O2", fused=True)),
        ("fp16", "autocast + GradScaler", dict(autocast=torch.float16)),
        ("bf16", "pure .bfloat16()", dict(pure=torch.bfloat16)),
        ("bf16", "O2", dict(opt_level="O2")),
        ("bf16", "autocast", dict(autocast=torch.bfloat16)),
        ("bf16", "O2, SyncBatchNorm's Triton kernels (peer emulated)",
         dict(opt_level="O2", triton=True)),
        ("bf16", "O2 + FusedBatchNorm", dict(opt_level="O2", fused_bn=True)),
        ("bf16", "pure .bfloat16() + FusedBatchNorm", dict(pure=torch.bfloat16, fused_bn=True)),
        ("fp16", "O3 + FusedBatchNorm", dict(opt_level="O3", fused_bn=True)),
        ("fp16", "O2 + FusedBatchNorm (PyTorch's cuDNN path: fp32 parameters)",
         dict(opt_level="O2", fused_bn=True)),
    ]
    wanted = [w.strip() for w in args.recipes.split(",") if w.strip()]
    if wanted:
        recipes = [r for r in recipes if f"{r[0]} {r[1]}" in wanted]
        if not recipes:
            sys.exit(f"--recipes {args.recipes!r} matches no recipe")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, ResNet-50 channels_last, "
          f"batch {args.batch}, {args.image}x{args.image}\n")
    print("| dtype | recipe | step ms (eager) | graph replay ms | batch-norm kernels ms/step | "
          "all kernels ms/step | BatchNorm backend |")
    print("|---|---|---:|---:|---:|---:|---|")
    # Every recipe is timed before any is profiled: after a profiler session launches cost the
    # host more, which showed as 3-12 ms slower eager steps in a first version of this script
    # that profiled each recipe right after timing it (benchmarks/RESULTS.md).
    runs = []
    for dtype_name, name, spec in recipes:
        dtype = torch.float16 if dtype_name == "fp16" else torch.bfloat16
        torch.manual_seed(0)
        model = torchvision.models.resnet50().to(device).to(memory_format=torch.channels_last)
        if spec.get("triton"):
            model = _triton_bn(model)
        if spec.get("fused_bn"):
            from mixprec.normalization import convert_fused_batchnorm

            model = convert_fused_batchnorm(model)
        x = x32
        if "pure" in spec:
            model = model.to(spec["pure"])
            x = x32.to(spec["pure"])
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                              **({"fused": True} if spec.get("fused") else {}))
        if "pure" in spec:
            step = _step_fn(model, opt, x, y, "plain")
        elif "autocast" in spec:
            step = _step_fn(model, opt, x, y, "autocast", dtype)
        else:
            kw = {k: v for k, v in spec.items()
                  if k in ("opt_level", "keep_batchnorm_fp32", "loss_scale")}
            model, opt = amp.initialize(model, opt, dtype=dtype, verbosity=0, **kw)
            step = _step_fn(model, opt, x, y, "amp", dtype)
        row = [dtype_name, name]
        try:
            if spec.get("triton"):
                backend = "mixprec Triton (channels-last kernels)"
            elif not spec.get("fused_bn"):
                with torch.autocast("cuda", dtype=dtype, enabled="autocast" in spec):
                    backend = _backend_of_first_bn(model, x)
            for _ in range(args.warmup):
                step()
            if spec.get("fused_bn"):
                backend = _fused_bn_backend(model)
            row.append(f"{_mean_ms(step, args.steps):.2f}")
            if args.host:
                row[-1] += f" (host {_host_ms(step):.2f})"
            graph = "-"
            if dtype == torch.bfloat16:  # (static loss scale: the whole step captures)
                from probe_norm_host import _graph_ms

                try:
                    graph = f"{_graph_ms(step):.2f}"
                except Exception as err:
                    graph = f"failed ({type(err).__name__})"
            row.append(graph)
            runs.append((row, step, backend))
        except Exception as err:  # report and go on with the other recipes
            runs.append((row + [f"failed: {type(err).__name__}: {err}"], None, ""))
    for row, step, backend in runs:
        if step is not None:
            bn_ms, all_ms = ("-", "-") if args.no_profile else (
                f"{v:.2f}" for v in _bn_kernel_ms(step))
            row += [bn_ms, all_ms, backend]
        print("| " + " | ".join(row) + " |")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
