"""``mixprec bench``: the seed's experiment (memory and time per 40 iterations for fp32,
``.half()``, O1, O2, O3) as one command, next to PyTorch's native recipes.

This module is the command line; it is the only place in the package that prints.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional, Sequence

import torch

__all__ = ["build_parser", "main"]

_OPT_LEVELS = ("O0", "O1", "O2", "O3")
_NATIVE_MODES = ("autocast", "half")

_DESCRIPTION = """\
Train a model for a few dozen steps under each mixed-precision recipe and compare them:
peak memory, seconds per 40 iterations, speed-up over O0, final loss and its gap to O0's,
and steps skipped by dynamic loss scaling. Every mode starts from the same initial weights and
sees the same synthetic batches.

Defaults run anywhere: a small CNN with BatchNorm on CUDA when present (fp16, large sizes),
otherwise on the CPU (bf16, small sizes; well under a minute on two cores). On CPU, peak memory
is the growth of the process's resident memory: approximate.
"""

_EPILOG = """\
examples:
  mixprec bench                                   # small CNN, all opt levels + native recipes
  mixprec bench --model gpt --dtype bf16 --plot gpt.png --json gpt.json
  mixprec bench --model resnet50 --channels-last --opt-levels O0 O2
  mixprec bench --frozen-bn                       # the seed's fine-tuning case (BatchNorm eval)
"""


def _int_in(minimum: int, what: str, maximum: Optional[int] = None):
    """An argparse type: an int >= ``minimum`` (and <= ``maximum``), with ``what`` naming it
    in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _int_in(1, "a positive integer")
_non_negative_int = _int_in(0, "an integer >= 0")
_seed = _int_in(-(2**63), "an integer from -2**63 to 2**64 - 1 (torch.manual_seed's range)",
                maximum=2**64 - 1)


def _add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        choices=("cnn", "gpt", "resnet50"),
        default="cnn",
        help="cnn: small CNN with BatchNorm (default); gpt: built-in GPT-style model; "
        "resnet50: torchvision's ResNet-50 (needs torchvision)",
    )
    p.add_argument(
        "--size",
        choices=("small", "large"),
        default=None,
        help="model and input sizes: small (CPU smoke test) or large (GPT d_model 1024, 12 "
        "layers, seq 1024; ResNet-50 at 224x224). Default: large on CUDA, small on CPU",
    )
    p.add_argument(
        "--opt-levels",
        nargs="+",
        choices=_OPT_LEVELS,
        default=list(_OPT_LEVELS),
        metavar="LEVEL",
        help="amp opt levels to run, from O0 O1 O2 O3 (letter O). Default: all four",
    )
    p.add_argument(
        "--dtype",
        choices=("fp16", "bf16"),
        default=None,
        help="half type: fp16 or bf16. Default: fp16 on CUDA (Apex's type, exercises loss "
        "scaling), bf16 on CPU (fp16 autocast on CPU needs torch >= 2.4 and is slow)",
    )
    p.add_argument(
        "--iters",
        type=_positive_int,
        default=40,
        help="timed iterations per mode (default 40, the seed's unit)",
    )
    p.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=None,
        help="untimed iterations before them (default 5 on CUDA, 3 on CPU)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help="batch size (default by --size: cnn 16 small / 256 large, gpt 8, "
        "resnet50 8 small / 128 large)",
    )
    p.add_argument(
        "--channels-last",
        action="store_true",
        help="NHWC memory format for the model and inputs (image models only)",
    )
    p.add_argument(
        "--frozen-bn",
        action="store_true",
        help="BatchNorm layers in eval mode while the rest trains (fine-tuning)",
    )
    p.add_argument(
        "--native",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run PyTorch's torch.autocast (+GradScaler for fp16) and pure "
        ".half()/.bfloat16() recipes (default: on)",
    )
    p.add_argument(
        "--norm",
        choices=("torch", "mixprec"),
        default="torch",
        help="norm layers: PyTorch's (default) or mixprec's: FusedLayerNorm for gpt, "
        "FusedBatchNorm for cnn and resnet50",
    )
    p.add_argument(
        "--optimizer",
        choices=("torch", "mixprec"),
        default="torch",
        help="the gpt's AdamW: PyTorch's (default) or mixprec's FusedAdam (the same update in "
        "one Triton pass; at O2 it also writes the half model), for every mode",
    )
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    p.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="write a figure of loss curves, time and memory bars (needs matplotlib); the "
        "extension picks the format: .png, .svg, .pdf or .jpg",
    )
    p.add_argument("--seed", type=_seed, default=0, help="seed for weights and data (default 0)")
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: cuda when available, else cpu)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging, including the traceback of a failed mode",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``mixprec`` argument parser, with the ``bench`` subcommand.

    Returns:
        argparse.ArgumentParser

    Example::

        >>> args = build_parser().parse_args(["bench", "--model", "gpt", "--iters", "5"])
        >>> args.model, args.iters
        ('gpt', 5)
    """
    parser = argparse.ArgumentParser(prog="mixprec", description="mixprec command line tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    bench = sub.add_parser(
        "bench",
        help="compare fp32, amp O0-O3 and PyTorch's recipes: memory, time, loss",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_bench_arguments(bench)
    # Errors found after parsing (a missing torchvision, --device cuda without CUDA) are
    # reported by the subcommand's parser, so the message reads "mixprec bench: error: ...".
    bench.set_defaults(subparser=bench)
    return parser


def _resolve_device(text: Optional[str], parser) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        parser.error(f"argument --device: invalid device {text!r}; use cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        parser.error(
            f"argument --device: {text!r} is not supported by the benchmark; use cpu, cuda "
            "or cuda:N"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(
                f"argument --device: {text!r} requested but CUDA is not available in this "
                "torch build or machine; use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(
                f"argument --device: {text!r} but only {torch.cuda.device_count()} CUDA "
                "device(s) are visible"
            )
    return device


def _norm_factory(name: str, parser):
    if name == "torch":
        return None
    try:
        from mixprec.normalization import FusedLayerNorm
    except ImportError:
        parser.error(
            "argument --norm: mixprec.normalization.FusedLayerNorm is not available in this "
            "install; use --norm torch"
        )
    return FusedLayerNorm


def _unwritable(path: Optional[str]) -> Optional[str]:
    """Why ``path`` cannot be written (None when it can, or when no path was given).

    The file itself is not created: its parent directory must exist and be writable, or be
    creatable (the writers make missing directories).
    """
    if not path:
        return None
    if os.path.isdir(path):
        return "it is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK):
        return f"{parent} is not writable"
    return None


def _progress(total: int, enabled: bool):
    """A tqdm bar and its per-step callback, or (None, None)."""
    if not enabled:
        return None, None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print("(no progress bar: install tqdm, e.g. pip install 'mixprec[bench]')", file=sys.stderr)
        return None, None
    # disable=None: no bar when stderr is not a terminal (logs, CI), so they stay clean.
    bar = tqdm(
        total=total, unit="step", file=sys.stderr, dynamic_ncols=True, leave=False, disable=None
    )

    def step(mode: str, i: int) -> None:
        if i == 0:
            bar.set_description(mode)
        bar.update(1)

    return bar, step


class _VerboseLogging:
    """Send the package's debug logs to stderr for the duration of one CLI call."""

    def __init__(self, enabled: bool):
        self._enabled = enabled
        self._handler: Optional[logging.Handler] = None
        self._logger = logging.getLogger("mixprec")
        self._level = self._logger.level

    def __enter__(self):
        if self._enabled:
            self._handler = logging.StreamHandler(sys.stderr)
            self._handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            self._logger.addHandler(self._handler)
            self._logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc):
        if self._handler is not None:
            self._logger.removeHandler(self._handler)
            self._logger.setLevel(self._level)


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from mixprec.bench import report
    from mixprec.bench.models import build_workload
    from mixprec.bench.runner import DTYPES, run_modes

    device = _resolve_device(args.device, parser)
    on_cuda = device.type == "cuda"
    dtype_name = args.dtype or ("fp16" if on_cuda else "bf16")
    size = args.size or ("large" if on_cuda else "small")
    warmup = args.warmup if args.warmup is not None else (5 if on_cuda else 3)
    if args.channels_last and args.model == "gpt":
        parser.error(
            "argument --channels-last: applies to image models (cnn, resnet50), not --model gpt"
        )
    if args.frozen_bn and args.model == "gpt":
        parser.error(
            "argument --frozen-bn: applies to models with BatchNorm (cnn, resnet50), not "
            "--model gpt"
        )
    if args.optimizer != "torch" and args.model != "gpt":
        parser.error(
            f"argument --optimizer: {args.optimizer} (an AdamW) applies to --model gpt; the "
            f"image models train with SGD (leave --optimizer torch for --model {args.model})"
        )
    named = {}  # each output's resolved path -> the flag that named it
    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)):
        if path is not None and not path.strip():
            parser.error(f"argument {flag}: expected a file path, got {path!r}")
        problem = _unwritable(path)
        if problem:  # fail before the run, not after it
            parser.error(f"argument {flag}: cannot write {path!r}: {problem}")
        if path:
            real = os.path.realpath(path)
            if real in named:
                parser.error(f"arguments {named[real]} and {flag}: both name {real}; give each "
                             "output its own file")
            named[real] = flag
    norm_cls = _norm_factory(args.norm, parser) if args.model == "gpt" else None
    if args.plot:  # fail before the run, not after it
        try:
            report.plot_format(args.plot)
        except ValueError as exc:
            parser.error(f"argument --plot: {exc}")
        try:
            report._import_matplotlib()
        except RuntimeError as exc:
            parser.error(str(exc))

    try:
        workload = build_workload(
            args.model,
            device=device,
            size=size,
            batch_size=args.batch_size,
            seed=args.seed,
            norm_cls=norm_cls,
            fused_batchnorm=args.norm == "mixprec" and args.model != "gpt",
            optimizer=args.optimizer,
        )
    except RuntimeError as exc:  # e.g. torchvision missing
        parser.error(str(exc))

    order = {m: i for i, m in enumerate(_OPT_LEVELS)}
    modes: List[str] = sorted(dict.fromkeys(args.opt_levels), key=order.__getitem__)
    if args.native:
        modes += list(_NATIVE_MODES)
    bar, step = _progress(len(modes) * (warmup + args.iters), not args.no_progress)
    try:
        results = run_modes(
            workload,
            modes,
            dtype=DTYPES[dtype_name],
            device=device,
            iters=args.iters,
            warmup=warmup,
            channels_last=args.channels_last,
            frozen_bn=args.frozen_bn,
            seed=args.seed,
            progress=step,
        )
    finally:
        if bar is not None:
            bar.close()

    where = torch.cuda.get_device_name(device) if on_cuda else "CPU"
    print(f"mixprec bench: {workload.description}")
    print(
        f"device {device} ({where}), half type {dtype_name}, {warmup} warm-up + {args.iters} "
        f"timed iterations per mode, seed {args.seed}"
        + (", channels_last" if args.channels_last and workload.image else "")
        + (", BatchNorm frozen (eval)" if args.frozen_bn else "")
    )
    print()
    print(report.format_table(results, baseline="O0"))
    print()
    window = min(len(workload.batches), warmup + args.iters)
    over = (f"one pass over the {window}-batch pool" if window == len(workload.batches)
            else f"every step run, {window} of the {len(workload.batches)} batches")
    notes = [
        "s / 40 it = 40 x the median step time; final loss = mean over the last "
        f"{window} step{'s' if window != 1 else ''} ({over})."
    ]
    if on_cuda:
        notes.append("peak mem = torch.cuda.max_memory_allocated() growth over the mode's start.")
    else:
        notes.append(
            "peak mem = growth of the process's resident memory (RSS): approximate on CPU."
        )
    if "O0" not in modes or not any(r.mode == "O0" and r.ok for r in results):
        notes.append("no successful O0 row: speed-up and loss gap are not available.")
    if any(not r.ok for r in results):
        notes.append("failed modes: run with -v for their tracebacks.")
    for note in notes:
        print(f"note: {note}")

    meta = {
        "model": args.model,
        "description": workload.description,
        "size": size,
        "batch_size": workload.batch_size,
        "seed": args.seed,
        "channels_last": bool(args.channels_last and workload.image),
        "frozen_bn": bool(args.frozen_bn),
        "norm": args.norm,
        "optimizer": args.optimizer,
        "torch_version": torch.__version__,
        "device_name": where,
    }
    title = f"mixprec bench: {workload.description} on {where}, {dtype_name}"
    outputs = (
        (args.json, lambda path: report.write_json(results, path, baseline="O0", meta=meta)),
        (args.csv, lambda path: report.write_csv(results, path, baseline="O0", meta=meta)),
        (args.plot, lambda path: report.write_plot(results, path, title=title)),
    )
    written = True
    for path, write in outputs:
        if not path:
            continue
        try:  # each output on its own: one that fails does not cost the others
            write(path)
        except OSError as exc:
            print(f"mixprec bench: could not write {path}: {exc}", file=sys.stderr)
            written = False
        else:
            print(f"wrote {path}")
    return 0 if any(r.ok for r in results) and written else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``mixprec`` / ``python -m mixprec``.

    Args:
        argv (sequence of str, optional): the arguments after the program name. Default:
            ``sys.argv[1:]``.

    Returns:
        int: 0 when at least one mode ran, 1 when every mode failed. Bad arguments exit with
        argparse's status 2.

    Example::

        >>> main(["bench", "--iters", "5", "--json", "rows.json"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    with _VerboseLogging(args.verbose):
        return _bench(args, args.subparser)
