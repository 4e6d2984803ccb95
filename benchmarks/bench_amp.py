"""GPU benchmark of mixprec.amp against PyTorch's own mixed-precision recipes (issue 2).

Measures step time (median of the timed steps, CUDA events) and peak memory (allocator peak
growth over the mode's start) in one run for

1. a GPT-style model (d_model 1024, 12 layers, 16 heads, seq 1024, vocab 32000, batch 8,
   fused AdamW), in bf16 and fp16, and
2. ResNet-50 (torchvision; batch 128, 224x224, SGD momentum 0.9, channels_last), in fp16 and
   bf16,

under fp32, torch autocast (+GradScaler for fp16), pure ``.half()`` / ``.bfloat16()`` and
mixprec O1/O2/O3, and checks the targets, each a ratio measured in the same run:

* O1 step time <= 1.02x torch autocast's (same dtype);
* O2 step time <= 0.92x torch autocast's and <= 1.05x pure half's (same dtype);
* O2 peak memory <= torch autocast's (judged twice: over all steps, and over the timed steps
  only, without the warm-up's one-off allocations such as cuDNN's algorithm search).

With ``--norm both`` (the default when :mod:`mixprec.normalization` provides
``FusedLayerNorm``) the GPT's O1 and O2 also run with mixprec's fused LayerNorm, and
ResNet-50's with mixprec's ``FusedBatchNorm`` (its Triton kernels where PyTorch has no cuDNN
path: bf16, and fp16 with fp16 parameters; the fp16 rows show it stepping aside). With
``--optimizer both`` (the default) the GPT's O1 and O2 also run with
:class:`mixprec.optimizers.FusedAdam` in place of ``torch.optim.AdamW(fused=True)``, and O2
with both of mixprec's pieces (FusedLayerNorm and FusedAdam). Every variant row is judged
against the base rows (PyTorch's norm and optimizer) of autocast and pure half.

It reuses ``mixprec bench``'s models and runner, so both measure the same way.

Usage::

    python benchmarks/bench_amp.py --out runs/bench   # writes runs/bench/bench_amp.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

try:
    import mixprec  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mixprec.bench.models import build_workload  # noqa: E402
from mixprec.bench.runner import DTYPES, run_modes, warm_up_process  # noqa: E402

TARGETS = (
    # (name, numerator mode, denominator mode, metric, bound)
    ("O1 time <= 1.02x autocast", "O1", "autocast", "time", 1.02),
    ("O2 time <= 0.92x autocast", "O2", "autocast", "time", 0.92),
    ("O2 time <= 1.05x pure half", "O2", "half", "time", 1.05),
    ("O2 peak mem <= autocast", "O2", "autocast", "memory", 1.00),
    ("O2 peak mem, timed steps <= autocast", "O2", "autocast", "memory_steady", 1.00),
)
_METRIC_KEYS = {"time": "time_per_iter_s", "memory": "peak_memory_mb",
                "memory_steady": "peak_memory_steady_mb"}
_HALF_MODES = ("autocast", "half", "O1", "O2", "O3")


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench", help="directory for bench_amp.json")
    p.add_argument("--steps", type=int, default=30, help="timed steps per mode (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--models", nargs="+", choices=("gpt", "resnet50"), default=["gpt", "resnet50"])
    p.add_argument("--gpt-dtypes", nargs="+", choices=("bf16", "fp16"), default=["bf16", "fp16"])
    p.add_argument("--resnet-dtypes", nargs="+", choices=("bf16", "fp16"), default=["fp16", "bf16"])
    p.add_argument(
        "--norm",
        choices=("torch", "mixprec", "both"),
        default=None,
        help="GPT norm layers: torch LayerNorm, mixprec FusedLayerNorm, or both "
        "(extra O1/O2 rows with FusedLayerNorm); mixprec and both also add ResNet-50 O1/O2 "
        "rows with FusedBatchNorm. Default: both when available",
    )
    p.add_argument(
        "--optimizer",
        choices=("torch", "mixprec", "both"),
        default="both",
        help="GPT optimizer: torch.optim.AdamW(fused=True), mixprec's FusedAdam, or both "
        "(extra O1/O2 rows with FusedAdam, and an O2 row with FusedLayerNorm and FusedAdam "
        "when --norm allows). Default: both",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="without a GPU, run small models on the CPU to check the script (numbers "
        "meaningless); on a GPU it changes nothing but the model sizes",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    return args


def _fused_layer_norm():
    try:
        from mixprec.normalization import FusedLayerNorm
    except ImportError:
        return None
    return FusedLayerNorm


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _run_group(workload, modes, dtype_name, args, tag, channels_last):
    """Run ``modes`` on ``workload``; return JSON rows tagged with model/dtype/variant."""
    t0 = time.perf_counter()
    results = run_modes(
        workload,
        modes,
        dtype=DTYPES[dtype_name],
        device=args.device,
        iters=args.steps,
        warmup=args.warmup,
        channels_last=channels_last,
        process_warmup=False,
    )
    rows = []
    for r in results:
        d = r.to_dict()
        d.pop("losses")  # the per-step losses are noise here; keep the timings
        d["peak_memory_steady_mb"] = d["extra"].get("peak_memory_steady_mb")
        d.update(tag)
        # The fp32 row does not depend on the half type: file it under "fp32".
        d["half_dtype"] = "fp32" if r.mode == "fp32" else dtype_name
        rows.append(d)
        status = "ok" if r.ok else f"FAILED ({r.error})"
        ms = f"{1e3 * r.time_per_iter_s:.2f} ms" if r.ok else "-"
        print(
            f"  {tag['model']:<8} {dtype_name} {r.label:<20} {tag['variant']:<14} {ms:>10} "
            f"{status}",
            file=sys.stderr,
            flush=True,
        )
    print(f"  ({len(modes)} modes in {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    _free(args.device)
    return rows


def _find(rows, model, dtype, mode, variant):
    for r in rows:
        if (r["model"], r["half_dtype"], r["mode"], r["variant"]) == (model, dtype, mode, variant):
            return r if r["status"] == "ok" else None
    return None


def _ratio(a, b, key):
    if a is None or b is None or not b.get(key) or a.get(key) is None:
        return None
    return a[key] / b[key]


def _fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def _tables(rows):
    """Markdown: per (model, dtype) a ratio table, then the targets with PASS/MISS."""
    lines, targets = [], []
    groups = []
    for r in rows:
        key = (r["model"], r["half_dtype"])
        if r["half_dtype"] != "fp32" and key not in groups:
            groups.append(key)
    for model, dtype in groups:
        fp32_rows = [r for r in rows if (r["model"], r["half_dtype"]) == (model, "fp32")]
        group = fp32_rows + [r for r in rows if (r["model"], r["half_dtype"]) == (model, dtype)]
        auto = _find(rows, model, dtype, "autocast", "base")
        half = _find(rows, model, dtype, "half", "base")
        fp32 = _find(rows, model, "fp32", "fp32", "base")
        lines += [
            f"\n### {model}, {dtype}\n",
            "| mode | variant | step ms | vs autocast | vs pure half | vs fp32 "
            "| peak MiB | mem vs autocast | timed-steps peak MiB | vs autocast | skipped |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            ok = r["status"] == "ok"
            lines.append(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                    r["label"],
                    r["variant"],
                    _fmt(1e3 * r["time_per_iter_s"], ".2f") if ok else "FAILED",
                    _fmt(_ratio(r, auto, "time_per_iter_s")) if ok else "-",
                    _fmt(_ratio(r, half, "time_per_iter_s")) if ok else "-",
                    _fmt(_ratio(r, fp32, "time_per_iter_s")) if ok else "-",
                    _fmt(r["peak_memory_mb"], ".0f") if ok else "-",
                    _fmt(_ratio(r, auto, "peak_memory_mb")) if ok else "-",
                    _fmt(r.get("peak_memory_steady_mb"), ".0f") if ok else "-",
                    _fmt(_ratio(r, auto, "peak_memory_steady_mb")) if ok else "-",
                    _fmt(r["skipped_steps"], "d") if ok and r["skipped_steps"] is not None else "-",
                )
            )
        # In order of appearance: "base" first, then extra variants (FusedLayerNorm).
        variants = list(dict.fromkeys(r["variant"] for r in group if r["mode"] in ("O1", "O2")))
        for variant in variants:
            for name, num, den, metric, bound in TARGETS:
                key = _METRIC_KEYS[metric]
                a = _find(rows, model, dtype, num, variant)
                b = _find(rows, model, dtype, den, "base")
                ratio = _ratio(a, b, key)
                verdict = "n/a" if ratio is None else ("PASS" if ratio <= bound else "MISS")
                targets.append(
                    {
                        "model": model,
                        "dtype": dtype,
                        "variant": variant,
                        "target": name,
                        "ratio": ratio,
                        "bound": bound,
                        "verdict": verdict,
                    }
                )
    lines += [
        "\n### Targets (ratios measured in this run)\n",
        "| model | dtype | variant | target | ratio | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for t in targets:
        lines.append(
            f"| {t['model']} | {t['dtype']} | {t['variant']} | {t['target']} | "
            f"{_fmt(t['ratio'])} | {t['verdict']} |"
        )
    return "\n".join(lines), targets


def _workload(name, args, **kwargs):
    if args.smoke:  # small CPU-sized models, default batches
        return build_workload(name, device=args.device, size="small", num_batches=2, **kwargs)
    batch = 8 if name == "gpt" else 128
    return build_workload(
        name, device=args.device, size="large", batch_size=batch, num_batches=2, **kwargs
    )


def _run_gpt(args, norm, fused_ln):
    print("GPT (d_model 1024, 12 layers, seq 1024, batch 8, fused AdamW):", file=sys.stderr)
    fused = args.device.type == "cuda"
    rows = []
    base_optimizer = "mixprec" if args.optimizer == "mixprec" else "torch"
    wl = _workload("gpt", args, norm_cls=fused_ln if norm == "mixprec" else None,
                   fused_adamw=fused, optimizer=base_optimizer)
    warm_up_process(wl, device=args.device, dtype=DTYPES[args.gpt_dtypes[0]])
    tag = {
        "model": "gpt",
        "variant": "base",
        "norm": "FusedLayerNorm" if norm == "mixprec" else "LayerNorm",
        "optimizer": "FusedAdam" if base_optimizer == "mixprec" else "AdamW",
    }
    rows += _run_group(wl, ["fp32"], args.gpt_dtypes[0], args, tag, False)
    for dtype in args.gpt_dtypes:
        rows += _run_group(wl, list(_HALF_MODES), dtype, args, tag, False)
    del wl
    _free(args.device)
    variants = []  # (variant, norm class or None, optimizer, modes)
    if norm == "both":
        variants.append(("FusedLayerNorm", fused_ln, "torch", ["O1", "O2"]))
    if args.optimizer == "both":
        variants.append(("FusedAdam", None, "mixprec", ["O1", "O2"]))
        if norm == "both":
            variants.append(("FusedLayerNorm+FusedAdam", fused_ln, "mixprec", ["O2"]))
    for variant, norm_cls, optimizer, modes in variants:
        wl = _workload("gpt", args, norm_cls=norm_cls, fused_adamw=fused, optimizer=optimizer)
        tag = {"model": "gpt", "variant": variant,
               "norm": "FusedLayerNorm" if norm_cls is not None else "LayerNorm",
               "optimizer": "FusedAdam" if optimizer == "mixprec" else "AdamW"}
        for dtype in args.gpt_dtypes:
            rows += _run_group(wl, modes, dtype, args, tag, False)
        del wl
        _free(args.device)
    return rows


def _run_resnet(args, norm):
    print("ResNet-50 (batch 128, 224x224, SGD momentum 0.9, channels_last):", file=sys.stderr)
    try:
        wl = _workload("resnet50", args)
    except RuntimeError as exc:  # torchvision missing
        print(f"  skipped: {exc}", file=sys.stderr)
        return []
    warm_up_process(wl, device=args.device, dtype=DTYPES[args.resnet_dtypes[0]])
    tag = {"model": "resnet50", "variant": "base", "norm": "BatchNorm2d"}
    rows = _run_group(wl, ["fp32"], args.resnet_dtypes[0], args, tag, True)
    for dtype in args.resnet_dtypes:
        rows += _run_group(wl, list(_HALF_MODES), dtype, args, tag, True)
    del wl
    _free(args.device)
    if norm in ("mixprec", "both"):
        wl = _workload("resnet50", args, fused_batchnorm=True)
        tag = {"model": "resnet50", "variant": "FusedBatchNorm", "norm": "FusedBatchNorm"}
        for dtype in args.resnet_dtypes:
            rows += _run_group(wl, ["O1", "O2"], dtype, args, tag, True)
        del wl
        _free(args.device)
    return rows


def main(argv=None) -> int:
    args = _parse_args(argv)
    if torch.cuda.is_available():
        args.device = torch.device("cuda", torch.cuda.current_device())
        device_name = torch.cuda.get_device_name(args.device)
    elif args.smoke:
        args.device = torch.device("cpu")
        device_name = "CPU (smoke run: small models, numbers meaningless)"
    else:
        print(
            "bench_amp.py measures GPU step times and needs a CUDA device; none is "
            "available here (CPU-only torch or no GPU). Use `mixprec bench` on CPU, or "
            "--smoke to check that this script runs.",
            file=sys.stderr,
        )
        return 1
    fused_ln = _fused_layer_norm()
    norm = args.norm or ("both" if fused_ln is not None else "torch")
    if norm in ("mixprec", "both") and fused_ln is None:
        print(
            "--norm mixprec/both: mixprec.normalization.FusedLayerNorm is not available; "
            "running with torch's LayerNorm only.",
            file=sys.stderr,
        )
        norm = "torch"

    t_start = time.perf_counter()
    rows = []
    if "gpt" in args.models:
        rows += _run_gpt(args, norm, fused_ln)
    if "resnet50" in args.models:
        rows += _run_resnet(args, norm)
    table, targets = _tables(rows)
    elapsed = time.perf_counter() - t_start
    meta = {
        "device": device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "steps": args.steps,
        "warmup": args.warmup,
        "norm": norm,
        "optimizer": args.optimizer,
        "smoke": args.smoke,
        "elapsed_s": elapsed,
        "timing": "median of the timed steps (CUDA events); memory: max_memory_allocated "
        "growth over the mode's start, MiB",
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_amp.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows, "targets": targets}, f, indent=2)
        f.write("\n")
    print(
        f"## bench_amp on {device_name} (torch {meta['torch']}), "
        f"{args.steps} timed steps per mode (median), ratios measured in this run"
    )
    print(table)
    print(f"\nwrote {path} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
