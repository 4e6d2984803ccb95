"""GPU benchmark of mixprec.parallel against PyTorch's DDP and SyncBatchNorm (issue 5).

Launch on the 2-GPU machine (``--nproc_per_node=1`` also works: every ratio is then against
a one-GPU "world" and the scaling rows say so)::

    torchrun --nproc_per_node=2 benchmarks/bench_parallel.py --out $OUT

Writes ``$OUT/bench_parallel.json`` (every per-rank median) and prints ratio tables on rank 0.

(a) GPT-style model (d_model 1024, 12 layers, 16 heads, seq 1024, vocab 32000, batch 8 per GPU,
    fused AdamW) at amp O2 in bf16 (``model.bfloat16()`` if amp is unavailable):

    * ``1 GPU``: every rank trains its own copy without DDP, at the same time (so both GPUs run
      under the same conditions, and no GPU idles while the other measures the baseline);
    * ``torch DDP``: ``torch.nn.parallel.DistributedDataParallel`` with its defaults;
    * ``mixprec DDP``: ``mixprec.parallel.DistributedDataParallel`` (bf16 all-reduce);
    * ``mixprec DDP fp32``: the same with ``allreduce_always_fp32=True``.

    Scaling efficiency = (1-GPU step time) / (2-GPU step time), per-GPU batch fixed. Targets:
    mixprec DDP >= 0.97; the half all-reduce no slower than the fp32 one (1% noise band).

(b) ResNet-50 (torchvision), channels_last, amp O2 fp16, batch 64 per GPU, SGD momentum, all
    under mixprec DDP, with plain BatchNorm, mixprec SyncBatchNorm (default group, and its own
    process group so its small collectives never queue behind gradient buckets) and
    ``torch.nn.SyncBatchNorm``. Target: mixprec SyncBatchNorm <= 1.15x plain BatchNorm.

Step time: CUDA events around each whole step (zero_grad, forward, backward with all-reduce,
optimizer step), median over the timed steps, then the slowest rank. ``--smoke`` runs tiny
models on the CPU over gloo to check the script (numbers meaningless). NCCL's NVLink
multicast stays off (``NCCL_NVLS_ENABLE=0`` unless set).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

try:
    import mixprec  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mixprec.bench.models import GPT, GPTConfig, SmallCNN, gpt_config  # noqa: E402
from mixprec.parallel import DistributedDataParallel, convert_syncbn_model  # noqa: E402

try:
    from mixprec import amp as _amp

    _amp.initialize  # noqa: B018 - the lead's amp may not be complete
except (ImportError, AttributeError):
    _amp = None

EFFICIENCY_TARGET = 0.97
SYNCBN_TARGET = 1.15
NOISE_BAND = 1.01


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench", help="directory for bench_parallel.json")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    p.add_argument("--warmup", type=int, default=6, help="untimed steps first (default 6)")
    p.add_argument("--gpt-batch", type=int, default=8)
    p.add_argument("--resnet-batch", type=int, default=64)
    p.add_argument("--parts", nargs="+", choices=("gpt", "resnet"), default=["gpt", "resnet"])
    p.add_argument("--sweep", action="store_true",
                   help="also time mixprec DDP with message_size 2.5e6 and 4e7 and "
                        "delay_allreduce=True (GPT)")
    p.add_argument("--graphs", action="store_true",
                   help="capture each whole training step (forward, backward with its "
                        "collectives, optimizer) in a CUDA graph and time replays: the GPU's "
                        "time without the host's launch work; amp O2 with a static loss scale "
                        "(ResNet-50: 128; GPT bf16: 1.0) and AdamW(capturable=True). Sets "
                        "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 as PyTorch's CUDA-graph notes ask "
                        "for DDP capture. Run --parts gpt and --parts resnet in separate "
                        "processes: after the GPT captures, a later ResNet capture failed with "
                        "'CUDA error: invalid argument' in two runs (once mixprec's, once "
                        "torch's SyncBatchNorm variant).")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models on the CPU over gloo, to check the script")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    if args.graphs and args.smoke:
        p.error("--graphs needs CUDA GPUs; it cannot run with --smoke")
    if args.graphs:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    return args


# ------------------------------------------------------------------------------------------------
# process group
# ------------------------------------------------------------------------------------------------
def _init(smoke: bool) -> torch.device:
    if "RANK" not in os.environ:  # plain `python bench_parallel.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    if smoke or not torch.cuda.is_available():
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    return device


def _log(*parts):
    if dist.get_rank() == 0:
        print(*parts, file=sys.stderr, flush=True)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
def _time_steps(step, device, steps: int, warmup: int) -> float:
    """Median seconds per ``step()`` on this rank (CUDA events, or wall clock on the CPU)."""
    for _ in range(warmup):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) / 1e3 for s, e in events]
    else:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _all_ranks(value: float, device) -> list:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [float(p.item()) for p in parts]


def _measure(name, build, device, args, results):
    """Build a variant, time it, record every rank's median and the slowest one."""
    t0 = time.perf_counter()
    try:
        step = build()
        seconds = _time_steps(step, device, args.steps, args.warmup)
        error = None
    except Exception as err:  # report and go on: one failing variant must not hide the rest
        seconds, error = float("nan"), f"{type(err).__name__}: {err}"
    per_rank = _all_ranks(seconds, device)
    results[name] = {"per_rank_s": per_rank, "step_s": max(per_rank), "error": error}
    status = f"{1e3 * max(per_rank):8.2f} ms" if error is None else f"FAILED {error}"
    _log(f"  {name:<34} {status}   ({time.perf_counter() - t0:.1f} s)")
    step = None
    _free(device)


# ------------------------------------------------------------------------------------------------
# (a) GPT: DDP scaling
# ------------------------------------------------------------------------------------------------
def _gpt_setup(device, args, seed=0, capturable=False):
    cfg = gpt_config("small") if args.smoke else GPTConfig()
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(cfg)
    fused = {"fused": True} if device.type == "cuda" else {}
    if capturable:
        fused["capturable"] = True
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, **fused)
    if _amp is not None:
        model, opt = _amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                     verbosity=0)
    else:
        model.bfloat16()
    batch = 2 if args.smoke else args.gpt_batch
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    seq = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g).to(device)
    return model, opt, seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _train_step(model, opt, x, y, loss_fn):
    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        if _amp is not None:
            with _amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        else:
            loss.backward()
        opt.step()
    return step


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _graphed_step(model, opt, x, y, loss_fn, wrap):
    """PyTorch's recipe for capturing a (DDP) step: ``wrap`` (DDP) applied on a side stream, 11
    eager iterations there before capture, gradients set to None before capture (the captured
    backward then allocates and overwrites them every replay). Returns ``replay()``, which
    keeps everything the graph reads alive."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model = wrap(model)
        eager = _train_step(model, opt, x, y, loss_fn)
        for _ in range(11):
            eager()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = loss_fn(model(x), y)
        with _amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    def replay():
        graph.replay()

    replay.keep_alive = (graph, model, opt, x, y)
    return replay


def _run_gpt(device, args):
    results = {}
    _log("(a) GPT, amp O2 bf16" if _amp is not None else "(a) GPT, model.bfloat16()")

    def variant(wrap):
        def build():
            if args.graphs:
                model, opt, x, y = _gpt_setup(device, args, capturable=True)
                return _graphed_step(model, opt, x, y, _lm_loss, wrap)
            model, opt, x, y = _gpt_setup(device, args)
            return _train_step(wrap(model), opt, x, y, _lm_loss)
        return build

    device_ids = [device.index] if device.type == "cuda" else None
    variants = [
        ("1 GPU (no DDP)", lambda m: m),
        ("torch DDP", lambda m: nn.parallel.DistributedDataParallel(m, device_ids=device_ids)),
        ("mixprec DDP", lambda m: DistributedDataParallel(m)),
        ("mixprec DDP fp32 all-reduce",
         lambda m: DistributedDataParallel(m, allreduce_always_fp32=True)),
    ]
    if args.sweep:
        variants += [
            ("mixprec DDP message_size 2.5e6", lambda m: DistributedDataParallel(
                m, message_size=2_500_000)),
            ("mixprec DDP message_size 4e7", lambda m: DistributedDataParallel(
                m, message_size=40_000_000)),
            ("mixprec DDP delay_allreduce", lambda m: DistributedDataParallel(
                m, delay_allreduce=True)),
            ("torch DDP bucket view 20MB", lambda m: nn.parallel.DistributedDataParallel(
                m, device_ids=device_ids, bucket_cap_mb=20, gradient_as_bucket_view=True)),
        ]
    for name, wrap in variants:
        _measure(name, variant(wrap), device, args, results)
    return results


# ------------------------------------------------------------------------------------------------
# (b) ResNet-50: SyncBatchNorm cost
# ------------------------------------------------------------------------------------------------
def _resnet_model(smoke):
    if smoke:
        return SmallCNN(num_classes=10, width=8)
    import torchvision

    return torchvision.models.resnet50(weights=None)


def _run_resnet(device, args):
    results = {}
    _log("(b) ResNet-50, channels_last, amp O2 fp16, under mixprec DDP")
    batch = 4 if args.smoke else args.resnet_batch
    size, classes = (16, 10) if args.smoke else (224, 1000)
    g = torch.Generator().manual_seed(2 + dist.get_rank())
    half = torch.float16 if (device.type == "cuda" and _amp is not None) else torch.float32
    x = torch.randn(batch, 3, size, size, generator=g).to(device, half)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,), generator=g).to(device)
    own_group = [None]

    def loss_fn(out, t):
        return F.cross_entropy(out.float(), t)

    def model_and_optimizer(convert, **amp_kwargs):
        # The same weights in every variant; amp O2 when amp is available.
        torch.manual_seed(0)
        model = convert(_resnet_model(args.smoke)).to(device)
        model = model.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if _amp is not None:
            model, opt = _amp.initialize(model, opt, opt_level="O2", verbosity=0, **amp_kwargs)
        return model, opt

    def variant(convert):
        def build():
            dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
            model, opt = model_and_optimizer(convert, dtype=dtype)
            model = DistributedDataParallel(model)
            return _train_step(model, opt, x, y, loss_fn)
        return build

    def graphed(convert):
        def build():
            model, opt = model_and_optimizer(convert, loss_scale=128.0)
            return _graphed_step(model, opt, x, y, loss_fn, DistributedDataParallel)
        return build

    if args.graphs:
        _log("   each step captured in a CUDA graph; amp O2 with static loss scale 128")
        for name, convert in [
            ("plain BatchNorm", lambda m: m),
            ("mixprec SyncBatchNorm", convert_syncbn_model),
            ("torch SyncBatchNorm", nn.SyncBatchNorm.convert_sync_batchnorm),
        ]:
            _measure(name, graphed(convert), device, args, results)
        return results

    def own(model):
        if own_group[0] is None:  # collective: every rank creates it at the same point
            own_group[0] = dist.new_group()
        return convert_syncbn_model(model, process_group=own_group[0])

    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    for name, convert in [
        ("plain BatchNorm", lambda m: m),
        ("mixprec SyncBatchNorm", convert_syncbn_model),
        ("mixprec SyncBatchNorm own group", own),
        ("torch SyncBatchNorm", nn.SyncBatchNorm.convert_sync_batchnorm),
    ]:
        _measure(name, variant(convert), device, args, results)
    return results


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def _ratio(results, a, b):
    ra, rb = results.get(a), results.get(b)
    if not ra or not rb or ra["error"] or rb["error"]:
        return float("nan")
    return ra["step_s"] / rb["step_s"]


def _verdict(ok):
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def _report(out, world):
    lines, checks = [], []
    note = "" if world >= 2 else " (world size 1: no scaling measured)"
    graphs = " (CUDA graphs)" if out.get("graphs") else ""
    how = ", each step a CUDA graph replay" if out.get("graphs") else ""
    gpt = out.get("gpt")
    if gpt:
        base = "1 GPU (no DDP)"
        lines += [f"### GPT-style, bf16, {world} GPU(s){how}{note}", "",
                  "| variant | step ms | 1-GPU time / this (efficiency) | target |",
                  "| --- | --- | --- | --- |"]
        for name, r in gpt.items():
            eff = _ratio(gpt, base, name)
            target = ""
            if name == "mixprec DDP":
                ok = None if world < 2 or eff != eff else eff >= EFFICIENCY_TARGET
                target = f">= {EFFICIENCY_TARGET} {_verdict(ok)}"
                checks.append(("GPT 2-GPU scaling efficiency (mixprec DDP)" + graphs, eff, ok))
            ms = "failed" if r["error"] else f"{1e3 * r['step_s']:.2f}"
            lines.append(f"| {name} | {ms} | {eff:.3f} | {target} |")
        half_vs_fp32 = _ratio(gpt, "mixprec DDP", "mixprec DDP fp32 all-reduce")
        ok = None if world < 2 or half_vs_fp32 != half_vs_fp32 else half_vs_fp32 <= NOISE_BAND
        checks.append(("bf16 all-reduce time / fp32 all-reduce time" + graphs, half_vs_fp32, ok))
        torch_vs = _ratio(gpt, "mixprec DDP", "torch DDP")
        lines += ["", f"mixprec DDP / torch DDP step time: {torch_vs:.3f}; bf16 / fp32 "
                  f"all-reduce: {half_vs_fp32:.3f} (<= 1.0, {NOISE_BAND - 1:.0%} noise band: "
                  f"{_verdict(ok)})", ""]
    resnet = out.get("resnet")
    if resnet:
        base = "plain BatchNorm"
        lines += [f"### ResNet-50 channels_last fp16 under mixprec DDP, {world} GPU(s){how}{note}",
                  "", "| BatchNorm | step ms | this / plain BatchNorm | target |",
                  "| --- | --- | --- | --- |"]
        for name, r in resnet.items():
            ratio = _ratio(resnet, name, base)
            target = ""
            if name == "mixprec SyncBatchNorm":
                ok = None if world < 2 or ratio != ratio else ratio <= SYNCBN_TARGET
                target = f"<= {SYNCBN_TARGET} {_verdict(ok)}"
                checks.append(("mixprec SyncBatchNorm / plain BatchNorm" + graphs, ratio, ok))
            ms = "failed" if r["error"] else f"{1e3 * r['step_s']:.2f}"
            lines.append(f"| {name} | {ms} | {ratio:.3f} | {target} |")
        lines.append("")
    lines += ["| target | measured | verdict |", "| --- | --- | --- |"]
    lines += [f"| {name} | {value:.3f} | {_verdict(ok)} |" for name, value, ok in checks]
    out["targets"] = [{"name": n, "value": v, "verdict": _verdict(ok)} for n, v, ok in checks]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse_args(argv)
    device = _init(args.smoke)
    world = dist.get_world_size()
    out = {
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        "amp": _amp is not None,
        "steps": args.steps,
        "warmup": args.warmup,
        "smoke": args.smoke,
        "graphs": args.graphs,
    }
    t0 = time.perf_counter()
    if "gpt" in args.parts:
        out["gpt"] = _run_gpt(device, args)
    if "resnet" in args.parts:
        try:
            out["resnet"] = _run_resnet(device, args)
        except ImportError as err:
            _log(f"(b) skipped: {err} (install torchvision)")
    out["seconds"] = time.perf_counter() - t0
    if dist.get_rank() == 0:
        table = _report(out, world)
        print(table)
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "bench_parallel.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        _log(f"wrote {path} ({out['seconds']:.0f} s)")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
