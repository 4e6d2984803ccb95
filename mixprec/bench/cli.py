"""``mixprec bench``: the experiment mixprec was built around (memory and time per 40
iterations for fp32, ``.half()``, O1, O2, O3) as one command, next to PyTorch's native
recipes.

This module is the command line; it is the only place in the package that prints.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import signal
import sys
import threading
import warnings
from typing import Dict, List, Optional, Sequence

import torch

from mixprec import __version__

__all__ = ["build_parser", "main"]

_OPT_LEVELS = ("O0", "O1", "O2", "O3")
_NATIVE_MODES = ("autocast", "half")

_DESCRIPTION = """\
Train a model for a few dozen steps under each mixed-precision recipe and compare them:
peak memory, seconds per 40 iterations, speed-up over O0, final loss and its gap to O0's,
and steps skipped by dynamic loss scaling. Every mode starts from the same initial weights and
sees the same synthetic batches.

Defaults run anywhere: a small CNN with BatchNorm on CUDA when present (fp16, large sizes),
otherwise on the CPU (bf16, small sizes; about 10 s on an idle two-core CPU). On CPU, peak memory
is the growth of the process's resident memory: approximate.
"""

_EPILOG = """\
examples:
  mixprec bench                                   # small CNN, all opt levels + native recipes
  mixprec bench --model gpt --dtype bf16 --plot gpt.png --json gpt.json
  mixprec bench --model resnet50 --channels-last --opt-levels O0 O2
  mixprec bench --frozen-bn                       # fine-tuning with BatchNorm frozen (eval mode)
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


#: The most --iters (and --warmup) steps: far more than a benchmark needs (the default is 40),
#: and few enough that a typo (an extra zero or three) is caught before the run, not hours in.
_MAX_STEPS = 1_000_000


def _opt_level(text: str) -> str:
    """An argparse type for --opt-levels: ``o1`` reads as ``O1``; ``01`` (a digit zero) is
    refused with the fix."""
    level = text.strip().upper()
    if level in _OPT_LEVELS:
        return level
    if "," in level:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r}; separate the levels with spaces, e.g. --opt-levels "
            f"{' '.join(part.strip() for part in text.split(',') if part.strip())}"
        )
    if len(level) == 2 and level[0] == "0" and level[1] in "0123":
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(_OPT_LEVELS)}); did you mean "
            f"O{level[1]}? The prefix is the letter O, not the digit zero"
        )
    return text  # (argparse's choices check names the allowed levels)


#: The largest --batch-size: beyond int64 shapes torch failed with a traceback instead of the
#: "does not fit in memory" error (which any batch this large gets).
_MAX_BATCH = 2**31 - 1

_batch_size = _int_in(1, f"a positive integer up to {_MAX_BATCH:,}", maximum=_MAX_BATCH)
_iters = _int_in(1, f"a positive integer up to {_MAX_STEPS:,} (default 40)", maximum=_MAX_STEPS)
_warmup = _int_in(0, f"an integer >= 0 and up to {_MAX_STEPS:,}", maximum=_MAX_STEPS)
_seed = _int_in(-(2**63), "an integer from -2**63 to 2**64 - 1 (torch.manual_seed's range)",
                maximum=2**64 - 1)


_DTYPE_NAMES = {"fp16": "fp16", "float16": "fp16", "half": "fp16",
                "bf16": "bf16", "bfloat16": "bf16"}


def _dtype_name(text: str) -> str:
    """An argparse type for --dtype: torch's names (float16, bfloat16, half) and any case
    read as fp16 / bf16; fp32 is refused with where its run is; anything else goes to
    argparse's choices check, which names them."""
    name = text.strip().lower()
    if name in ("fp32", "float32", "float"):
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from fp16, bf16): --dtype is the half type; "
            "the fp32 run is always there, as the O0 row (--opt-levels O0 --no-native runs "
            "it alone)"
        )
    return _DTYPE_NAMES.get(name, text)


def _lower(text: str) -> str:
    return text.strip().lower()


def _add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=_lower,
        choices=("cnn", "gpt", "resnet50"),
        default="cnn",
        help="cnn: small CNN with BatchNorm (default); gpt: built-in GPT-style model; "
        "resnet50: torchvision's ResNet-50 (needs torchvision)",
    )
    p.add_argument(
        "--size",
        type=_lower,
        choices=("small", "large"),
        default=None,
        help="model and input sizes: small (CPU smoke test) or large (GPT d_model 1024, 12 "
        "layers, seq 1024; ResNet-50 at 224x224). Default: large on CUDA, small on CPU",
    )
    p.add_argument(
        "--opt-levels",
        nargs="+",
        action="extend",  # (--opt-levels O0 --opt-levels O2 runs both; "store" kept the last)
        type=_opt_level,
        choices=_OPT_LEVELS,
        default=None,
        metavar="LEVEL",
        help="amp opt levels to run, from O0 O1 O2 O3 (letter O; may be repeated). Default: "
        "all four",
    )
    p.add_argument(
        "--dtype",
        type=_dtype_name,
        choices=("fp16", "bf16"),
        default=None,
        help="half type: fp16 or bf16. Default: fp16 on CUDA (Apex's type, exercises loss "
        "scaling), bf16 on CPU (fp16 on CPU is slow)",
    )
    p.add_argument(
        "--iters",
        type=_iters,
        default=40,
        help=f"timed iterations per mode, at most {_MAX_STEPS:,} (default 40)",
    )
    p.add_argument(
        "--warmup",
        type=_warmup,
        default=None,
        help="untimed iterations before them (default 5 on CUDA, 3 on CPU)",
    )
    p.add_argument(
        "--batch-size",
        type=_batch_size,
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
        type=_lower,
        choices=("torch", "mixprec"),
        default="torch",
        help="norm layers: PyTorch's (default) or mixprec's: FusedLayerNorm for gpt, "
        "FusedBatchNorm for cnn and resnet50",
    )
    p.add_argument(
        "--optimizer",
        type=_lower,
        choices=("torch", "mixprec"),
        default="torch",
        help="the gpt's AdamW: PyTorch's (default) or mixprec's FusedAdam (the same update in "
        "one Triton pass; at O2 it also writes the half model), for every mode",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="write the rows as a JSON list (a file: stdout carries the table, so not '-')",
    )
    p.add_argument("--csv", metavar="PATH", help="write the rows as CSV (a file, not '-')")
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="write a figure of loss curves, time and memory bars (needs matplotlib); the "
        "extension picks the format: .png, .svg, .pdf or .jpg",
    )
    p.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help="seed for weights and data (default 0). A run repeats bit for bit with the same "
        "seed on the same machine and number of CPU threads (another thread count sums in "
        "another order); a negative seed is torch's seed + 2**64",
    )
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: cuda when available, else cpu)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (a line per finished mode on stderr instead, as when stderr is "
        "not a terminal)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging, including the traceback of a failed mode (amp's own logs, "
        "its overflow lines, stay off in the timed modes)",
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
    # (allow_abbrev=False: "--iter 3" is refused with "did you mean --iters?" instead of read
    # as --iters, which would break the day another option starts with "--iter")
    parser = argparse.ArgumentParser(prog="mixprec", description="mixprec command line tools.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"mixprec {__version__}")
    sub = parser.add_subparsers(dest="command")
    sub.required = True
    bench = sub.add_parser(
        "bench",
        help="compare fp32, amp O0-O3 and PyTorch's recipes: memory, time, loss",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    _add_bench_arguments(bench)
    bench.add_argument("--version", action="version", version=f"mixprec {__version__}")
    # (usage and the missing-command error name the commands: "required: {bench}")
    sub.metavar = "{" + ",".join(sub.choices) + "}"
    # Errors found after parsing (a missing torchvision, --device cuda without CUDA) are
    # reported by the subcommand's parser, so the message reads "mixprec bench: error: ...".
    bench.set_defaults(subparser=bench)
    return parser


def _resolve_device(text: Optional[str], parser) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(_lower(text))  # (any case, as the named choices)
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


def _unwritable(path: Optional[str], example: str) -> Optional[str]:
    """Why ``path`` cannot be written (None when it can, or when no path was given);
    ``example`` is a file name to suggest.

    Checked by doing it: the missing parent directories are made (the writers make them too)
    and the file is opened for appending (its contents stay), then what did not exist before
    is removed again, so the check leaves nothing behind, whether it passes or fails.
    """
    if not path:
        return None
    if path == "-":
        return (
            "writing to standard output is not supported (stdout carries the table); give a "
            f"file name, e.g. {example}"
        )
    if path.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        return (
            "it ends with a path separator, so it names a directory; name a file in it, e.g. "
            f"{os.path.join(path, example)!r}"
        )
    if os.path.isdir(path):
        return "it is a directory"
    stream = _standard_stream_of(path)
    if stream is not None:
        return (
            f"it is where the standard {stream} goes, so the file would be mixed with the "
            f"{'table' if stream == 'output' else 'progress lines'}; give a file name, e.g. "
            f"{example}"
        )
    parent = os.path.dirname(os.path.abspath(path))
    missing = []
    while not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    existed = os.path.lexists(path)
    # (A dangling symbolic link exists while its target does not: the open creates the target.)
    dangling = existed and not os.path.exists(path)
    made = []
    try:
        for directory in reversed(missing):
            os.mkdir(directory)
            made.append(directory)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        return f"{exc.strerror or exc}; give a path in a writable directory"
    finally:
        with contextlib.suppress(OSError):
            if not existed and os.path.lexists(path):
                os.remove(path)
            elif dangling and os.path.exists(path):
                os.remove(os.path.realpath(path))
            for directory in reversed(made):
                os.rmdir(directory)
    return None


def _standard_stream_of(path: str) -> Optional[str]:
    """"output" or "error" when ``path`` is the file that stdout or stderr writes to
    (``/dev/stdout``, ``/proc/self/fd/1``, or the file they were redirected to), else None.
    The null device is none of them: writing it twice loses nothing."""
    try:
        target = os.stat(path)
    except OSError:
        return None
    if os.path.exists(os.devnull) and os.path.samestat(target, os.stat(os.devnull)):
        return None
    for name, stream in (("output", sys.stdout), ("error", sys.stderr)):
        try:
            if os.path.samestat(target, os.fstat(stream.fileno())):
                return name
        except (AttributeError, OSError, ValueError):  # closed, or in memory (tests)
            continue
    return None


def _to_devnull(stream) -> None:
    """Point ``stream``'s file descriptor at os.devnull after a BrokenPipeError (the pattern of
    Python's signal docs): what is still buffered, and the flush at exit, go nowhere instead of
    raising again."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation: in-memory)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


class _Stdout:
    """The CLI's prints to stdout. A reader that goes away (``mixprec bench | head -1``) does
    not stop the run: stdout then goes to os.devnull, ``broken`` is set and the output files
    are still written (:func:`main` exits 1)."""

    def __init__(self):
        self.broken = False

    def __call__(self, *lines: str) -> None:
        if self.broken:
            return
        if sys.stdout is None:  # (started with stdout closed: >&-)
            self.broken = True
            return
        try:
            for line in lines:
                print(line)
            sys.stdout.flush()  # (here, so that a closed pipe shows here)
        except OSError as exc:  # a closed pipe, a full disk (ENOSPC), a terminal gone (EIO)
            self.broken = True
            _to_devnull(sys.stdout)
            if not isinstance(exc, BrokenPipeError):  # (a reader that stopped: no news)
                # (Else the run exited 1 saying nothing of why.)
                _err(f"mixprec bench: could not write to stdout: {exc}")


def _err(message: str) -> None:
    """One line on stderr; a stderr that cannot be written (closed, a full disk) is not an
    error of the benchmark."""
    if sys.stderr is None:  # (started with stderr closed; print would write to stdout)
        return
    try:
        print(message, file=sys.stderr, flush=True)
    except OSError:
        _to_devnull(sys.stderr)


def _terminal_columns() -> Optional[int]:
    """stderr's terminal width, or None when stderr is not a terminal."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


def _progress(total: int, enabled: bool, label=lambda mode: mode):
    """A tqdm bar and its per-step callback, or (None, None). ``label(mode)``: the mode's name
    as the table shows it (``.bfloat16()``, not the runner's ``half``)."""
    if not enabled:
        return None, None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if sys.stderr.isatty():  # (tqdm would show no bar elsewhere either)
            _err("(no progress bar: install tqdm, e.g. pip install 'mixprec[bench]')")
        return None, None
    if _terminal_columns() == 0:
        return None, None  # (a terminal that reports no width: tqdm would draw nothing)
    # disable=None: no bar when stderr is not a terminal (logs, CI), so they stay clean.
    bar = tqdm(
        total=total, unit="step", file=sys.stderr, dynamic_ncols=True, leave=False, disable=None
    )

    def step(mode: str, i: int) -> None:
        if i == 0:
            bar.set_description(label(mode))
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


def _out_of_memory(error: Optional[str]) -> bool:
    """Whether a failed mode's ``"Type: message"`` is an allocation failure: PyTorch's CUDA
    ``OutOfMemoryError``, the CPU allocator's RuntimeError, Python's ``MemoryError``."""
    return bool(error) and (error.startswith(("MemoryError", "OutOfMemoryError"))
                            or "out of memory" in error or "can't allocate memory" in error)


def _mode_line(row, done: int, total: int) -> str:
    """The stderr line for a finished mode (when no progress bar shows)."""
    if not row.ok:
        reason = (row.error or "unknown error").splitlines()[0]
        what = "FAILED: " + (reason if len(reason) <= 100 else reason[:97] + "...")
    else:
        what = f"ok, {40 * row.time_per_iter_s:.3f} s / 40 it"
        if row.diverged:
            what += ", loss not finite (diverged)"
    return f"mixprec bench: [{done}/{total}] {row.label}: {what}"


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser, out: _Stdout) -> int:
    from mixprec.bench import report
    from mixprec.bench.models import build_workload
    from mixprec.bench.runner import (
        DTYPES,
        ModeResult,
        cpu_memory_readable,
        mode_dtype_name,
        mode_label,
        run_modes,
    )

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
    # "--json=~/rows.json" comes unexpanded (the shell expands ~ only at a word's start): the
    # check below made a directory named "~" in the working directory.
    for name in ("json", "csv", "plot"):
        if getattr(args, name):
            setattr(args, name, os.path.expanduser(getattr(args, name)))
    named = {}  # each output's resolved path -> the flag that named it
    for flag, path, example in (
        ("--json", args.json, "rows.json"),
        ("--csv", args.csv, "rows.csv"),
        ("--plot", args.plot, "bench.png"),
    ):
        if path is not None and not path.strip():
            parser.error(f"argument {flag}: expected a file path, got {path!r}")
        problem = _unwritable(path, example)
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
    if size == "large" and not on_cuda:
        _err(
            f"mixprec bench: warning: --size large on CPU is slow (a {args.model} step can take "
            "seconds to a minute, times 40 iterations, times each mode); use --size small or "
            "fewer --iters (e.g. --iters 5)"
        )

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
    except (RuntimeError, MemoryError) as exc:  # e.g. torchvision missing
        if isinstance(exc, MemoryError) or "alloc" in str(exc) or "out of memory" in str(exc):
            # The synthetic batches are made here: a huge --batch-size (an extra zero or
            # three) failed with the allocator's own message, naming neither the option nor
            # a way out.
            first = (str(exc) or type(exc).__name__).strip().splitlines()[-1]
            batch = (f"--batch-size {args.batch_size}" if args.batch_size is not None
                     else f"the default batch size of --size {size}")
            parser.error(
                f"argument --batch-size: the synthetic data for --model {args.model} at "
                f"{batch} does not fit in memory on {device} ({first}); use a smaller "
                "--batch-size" + (" or --size small" if size == "large" else "")
            )
        parser.error(str(exc))

    order = {m: i for i, m in enumerate(_OPT_LEVELS)}
    levels = args.opt_levels or _OPT_LEVELS
    modes: List[str] = sorted(dict.fromkeys(levels), key=order.__getitem__)
    if args.native:
        modes += list(_NATIVE_MODES)
    dtype = DTYPES[dtype_name]

    # The header first, so that a log (2>&1 | tee log) says what runs while it runs.
    where = torch.cuda.get_device_name(device) if on_cuda else "CPU"
    out(
        f"mixprec bench: {workload.description}",
        f"device {device} ({where}), half type {dtype_name}, {warmup} warm-up + {args.iters} "
        f"timed iteration{'s' if args.iters != 1 else ''} per mode, seed {args.seed}"
        + (", channels_last" if args.channels_last and workload.image else "")
        + (", BatchNorm frozen (eval)" if args.frozen_bn else ""),
        "",
    )
    bar, step = _progress(len(modes) * (warmup + args.iters), not args.no_progress,
                          lambda mode: mode_label(mode, dtype))
    # Without a bar on the screen (a log file, --no-progress), a line per finished mode.
    log_modes = bar is None or bar.disable
    results = []
    # Warnings raised while the modes run (amp's about O3 in fp16 with AdamW, say) would cut
    # through the progress bar: kept instead, each with the modes that raised it, for the
    # notes under the table.
    caught: List[warnings.WarningMessage] = []
    warned: Dict[str, List[str]] = {}

    def collect(label: str) -> None:
        for w in caught:
            text = f"{w.category.__name__}: {w.message}"
            labels = warned.setdefault(text, [])
            if label not in labels:
                labels.append(label)
        del caught[:]

    def finished(row) -> None:
        results.append(row)
        collect(row.label)
        if log_modes:
            _err(_mode_line(row, len(results), len(modes)))

    interrupted, stopped_by = False, signal.SIGINT
    try:
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always")
            caught = recorded  # (the list catch_warnings appends to)
            run_modes(
                workload,
                modes,
                dtype=dtype,
                device=device,
                iters=args.iters,
                warmup=warmup,
                channels_last=args.channels_last,
                frozen_bn=args.frozen_bn,
                seed=args.seed,
                progress=step,
                on_result=finished,
            )
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP: keep what finished
        interrupted = True
        stopped_by = _stop_signal(exc)
    finally:
        if bar is not None:
            bar.close()

    window = min(len(workload.batches), warmup + args.iters)
    over = (f"one pass over the {window}-batch pool" if window == len(workload.batches)
            else f"every step run, {window} of the {len(workload.batches)} batches")
    notes = []
    not_run = modes[len(results):] if interrupted else []
    if interrupted:
        left = [mode_label(m, dtype) for m in not_run]
        notes.append(
            f"interrupted ({_stop_label(stopped_by)}) during {left[0]}; did not run: "
            f"{', '.join(left)}." if left
            else f"interrupted ({_stop_label(stopped_by)}) after the last mode."
        )
    notes.append(
        "s / 40 it = 40 x the median step time; final loss = mean over the last "
        f"{window} step{'s' if window != 1 else ''} ({over}; an inf or NaN loss left out)."
    )
    if on_cuda:
        notes.append("peak mem = torch.cuda.max_memory_allocated() growth over the mode's start.")
    elif cpu_memory_readable():
        notes.append(
            "peak mem = growth of the process's resident memory (RSS): approximate on CPU."
        )
    else:
        notes.append("peak mem: not measured (this system's resident memory needs psutil: "
                     "pip install psutil).")
    if not on_cuda:
        fused = []
        if args.norm == "mixprec":
            fused.append("FusedLayerNorm" if args.model == "gpt" else "FusedBatchNorm")
        if args.optimizer == "mixprec":
            fused.append("FusedAdam")
        if fused:
            notes.append(
                f"{' and '.join(fused)} ran PyTorch code here, not mixprec's fused kernels: "
                "those are Triton kernels, which run on CUDA only; use --device cuda to time "
                "them."
            )
    few = report.few_steps_note(args.iters)
    if few and results:
        notes.append(few)
    unsteady = report.unsteady_timing_note(results)
    if unsteady:
        notes.append(unsteady)
    if results and not any(r.mode == "O0" and r.ok for r in results):
        notes.append(
            "no successful O0 row: speed-up and loss gap are not available."
            if "O0" in modes else
            "speed-up and loss gap are against O0, which was not asked for (add O0 to "
            "--opt-levels for them)."
        )
    if any(not r.ok for r in results):
        notes.append(
            "failed modes: their tracebacks are in the log above (-v)."
            if args.verbose
            else "failed modes: run with -v for their tracebacks."
        )
    short = [r.label for r in results if not r.ok and _out_of_memory(r.error)]
    if short:
        # (The row's reason is cut to fit the table, the allocator's sizes with it.)
        notes.append(
            f"{', '.join(short)} ran out of memory at batch size {workload.batch_size} on "
            f"{device}: use a smaller --batch-size"
            + (" or --size small." if size == "large" else ".")
        )
    if caught:  # raised by the mode an interruption stopped
        collect(mode_label(not_run[0], dtype) if not_run else "the last mode")
    for text, labels in warned.items():
        # Its first sentence (the whole warning with -v): what warned and about what.
        head, dot, rest = text.partition(". ")
        shown = text if args.verbose or not rest else head + dot.strip() + " (-v: all of it)"
        notes.append(f"{', '.join(labels)} warned: {shown}")

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
        # Whether every mode asked for ran: a script tells a partial result from a whole one.
        "run_status": "interrupted" if not_run else "complete",
        "modes_not_run": list(not_run),
    }
    title = f"mixprec bench: {workload.description} on {where}, {dtype_name}"
    # (path, writer, whether it needs rows): with none finished, the JSON and CSV are still
    # written, empty, so that a file of an earlier run does not pass for this one's result.
    outputs = (
        (args.json, lambda path: report.write_json(results, path, baseline="O0", meta=meta),
         False),
        (args.csv, lambda path: report.write_csv(results, path, baseline="O0", meta=meta),
         False),
        (args.plot, lambda path: report.write_plot(results, path, title=title), True),
    )
    # The files before the table: a reader that stops early (| head) must not cost them.
    written = True
    wrote = []
    for path, write, needs_rows in outputs:
        if not path:
            continue
        if not results and needs_rows:
            _err(f"mixprec bench: did not write {path}: no mode finished")
            written = False
            continue
        try:  # each output on its own: one that fails does not cost the others
            write(path)
        except OSError as exc:
            _err(f"mixprec bench: could not write {path}: {exc}")
            written = False
        else:
            wrote.append(f"wrote {path}" + ("" if results else " (no rows: no mode finished)"))

    missing = [  # the table shows the modes that did not run too
        ModeResult(mode=m, label=mode_label(m, dtype), dtype=mode_dtype_name(m, dtype),
                   status=report.NOT_RUN, error="interrupted", device=str(device))
        for m in not_run
    ]
    out(report.format_table(results + missing, baseline="O0"), "")
    out(*(f"note: {note}" for note in notes))
    out(*wrote)
    if interrupted:
        # 128 + the signal's number, as a shell reports a command stopped by it (130: Ctrl-C)
        return 128 + int(stopped_by)
    return 0 if any(r.ok for r in results) and written and not out.broken else 1


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (``timeout``, ``kill``, a CI job cancelled, a terminal closed),
    raised in the main thread as Ctrl-C raises KeyboardInterrupt: the run stops the same way,
    keeping and writing what finished, so that an earlier run's files do not pass for its."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop_signal(exc: BaseException) -> signal.Signals:
    """The signal that stopped the run: SIGTERM or SIGHUP, else Ctrl-C's SIGINT."""
    return signal.Signals(exc.signum) if isinstance(exc, _Stopped) else signal.SIGINT


def _stop_label(sig: signal.Signals) -> str:
    return "Ctrl-C" if sig == signal.SIGINT else sig.name


@contextlib.contextmanager
def _stop_on_termination():
    """SIGTERM and SIGHUP raise :class:`_Stopped` while the CLI runs (main thread only: a
    handler cannot be set from another), the handlers before are put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def stop(signum, frame):
        raise _Stopped(signum)

    for name in ("SIGTERM", "SIGHUP"):
        number = getattr(signal, name, None)
        if number is not None and signal.getsignal(number) is not signal.SIG_IGN:
            # (an ignored SIGHUP, as under nohup, stays ignored)
            previous[number] = signal.signal(number, stop)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _reject_unknown(parser: argparse.ArgumentParser, extra: List[str]) -> None:
    """``parser.error`` for arguments no option takes, naming the closest option of each."""
    longs = [o for action in parser._actions for o in action.option_strings if o[:2] == "--"]
    hints = []
    for arg in extra:
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        # Compared without the dashes, which every option shares: they would make "--epochs"
        # look like "--csv".
        close = difflib.get_close_matches(flag[2:], [o[2:] for o in longs], n=1)
        if close:
            hints.append((flag, "--" + close[0]))
    message = f"unrecognized arguments: {' '.join(extra)}"
    if len(hints) == 1:
        message += f"; did you mean {hints[0][1]}?"
    elif hints:
        message += "; " + "; ".join(f"{f}: did you mean {m}?" for f, m in hints)
    parser.error(message)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``mixprec`` / ``python -m mixprec``.

    Args:
        argv (sequence of str, optional): the arguments after the program name. Default:
            ``sys.argv[1:]``.

    Returns:
        int: 0 when at least one mode ran and every output file asked for was written. 1 when
        every mode failed, when an output file (``--json``/``--csv``/``--plot``) could not be
        written, or when stdout was closed before the table was printed (``mixprec bench |
        head -1``: the output files are written first, so they are still there). 130 when the
        run was interrupted (Ctrl-C): the modes that finished are printed and written (each
        row's ``run_status`` is ``"interrupted"`` and ``modes_not_run`` names the rest), the
        table shows those as ``not run`` and a note names them; a second Ctrl-C while that
        happens just stops. Bad arguments exit with argparse's status 2.

    Example::

        >>> main(["bench", "--iters", "5", "--json", "rows.json"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(list(argv) if argv is not None else None)
    if extra:  # the subcommand's error: its usage, and the closest option
        _reject_unknown(args.subparser, extra)
    try:
        with _stop_on_termination(), _VerboseLogging(args.verbose):
            return _bench(args, args.subparser, _Stdout())
    except KeyboardInterrupt as exc:  # before the modes ran, or a second Ctrl-C after them
        sig = _stop_signal(exc)
        _err("mixprec bench: interrupted"
             + ("" if sig == signal.SIGINT else f" ({_stop_label(sig)})"))
        return 128 + int(sig)
