"""Turn :class:`~mixprec.bench.runner.ModeResult` rows into a table, JSON, CSV and a plot.

Only :func:`format_table` builds text; nothing here prints. The plot uses matplotlib's Agg
canvas directly (no pyplot, no display, no change to the global backend).
"""

from __future__ import annotations

import csv
import json
import math
import os
import textwrap
from typing import Dict, List, Optional, Sequence

from mixprec.bench.runner import ModeResult

__all__ = [
    "NOT_RUN",
    "format_table",
    "relative_to",
    "few_steps_note",
    "unsteady_timing_note",
    "rows_to_dicts",
    "write_csv",
    "write_json",
    "write_plot",
]

#: Columns of the CSV file (scalars only; the JSON also has every step's loss and time). The
#: fields are :class:`~mixprec.bench.runner.ModeResult`'s (``diverged``: the mode ran but its
#: final loss is NaN or inf, which the CSV leaves empty) and :func:`rows_to_dicts`'s.
CSV_FIELDS = (
    "mode",
    "label",
    "dtype",
    "status",
    "diverged",
    "device",
    "iters",
    "warmup",
    "time_per_iter_s",
    "time_per_iter_mean_s",
    "time_per_iter_iqr_s",
    "time_per_iter_min_s",
    "time_per_iter_max_s",
    "total_time_s",
    "time_per_40_iters_s",
    "speedup_vs_baseline",
    "peak_memory_mb",
    "memory_vs_baseline",
    "final_loss",
    "loss_gap_pct",
    "skipped_steps",
    "error",
)


#: The status of a table row for a mode that did not run (the run was interrupted first).
NOT_RUN = "not run"


def _baseline(results: Sequence[ModeResult], baseline: str) -> Optional[ModeResult]:
    for r in results:
        if r.mode == baseline and r.ok:
            return r
    return None


def relative_to(results: Sequence[ModeResult], baseline: str = "O0") -> List[Dict[str, object]]:
    """Per row: speed-up, memory ratio and final-loss gap against the ``baseline`` mode.

    Args:
        results: rows from :func:`~mixprec.bench.runner.run_modes`.
        baseline (str): the mode compared against. Default ``"O0"``.

    Returns:
        list of dicts with ``speedup_vs_baseline`` (baseline time / row time),
        ``memory_vs_baseline`` (row memory / baseline memory) and ``loss_gap_pct``
        (100 * (row loss - baseline loss) / abs(baseline loss): positive when the row ends higher,
        whatever the baseline's sign); None where either side is missing or the baseline's
        time, memory or loss is zero.
    """
    base = _baseline(results, baseline)
    out = []
    for r in results:
        speed = mem = gap = None
        if base is not None and r.ok:
            if r.time_per_iter_s and base.time_per_iter_s:
                speed = base.time_per_iter_s / r.time_per_iter_s
            if r.peak_memory_mb is not None and base.peak_memory_mb:
                mem = r.peak_memory_mb / base.peak_memory_mb
            if r.final_loss is not None and base.final_loss:
                gap = 100.0 * (r.final_loss - base.final_loss) / abs(base.final_loss)
        out.append({"speedup_vs_baseline": speed, "memory_vs_baseline": mem, "loss_gap_pct": gap})
    return out


def _json_safe(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def rows_to_dicts(
    results: Sequence[ModeResult], baseline: str = "O0", meta: Optional[dict] = None
) -> List[dict]:
    """JSON-ready rows: every :class:`ModeResult` field (non-finite numbers as None), its
    ``diverged`` flag (True when the mode ran but its final loss is NaN or inf: ``status`` is
    then ``"ok"`` and ``final_loss`` None), the ratios of :func:`relative_to`,
    ``time_per_40_iters_s`` (40 x the median step time, the seed's unit) and ``meta``'s keys
    (model, batch size, ...) repeated in each row so that every row stands alone."""
    rows = []
    for r, rel in zip(results, relative_to(results, baseline)):
        d = r.to_dict()
        d["time_per_40_iters_s"] = 40 * r.time_per_iter_s if r.time_per_iter_s else None
        d["baseline"] = baseline
        d.update(rel)
        if meta:
            for k, v in meta.items():
                d.setdefault(k, v)
        rows.append({k: _json_safe(v) for k, v in d.items()})
    return rows


def _finite(v) -> bool:
    return v is not None and not (isinstance(v, float) and not math.isfinite(v))


def _fmt(v, spec: str, missing: str = "-") -> str:
    if not _finite(v):
        return missing
    return format(v, spec)


def _fmt_digits(v, decimals: int, digits: int) -> str:
    """``v`` with ``decimals`` decimals, or more where that leaves fewer than ``digits``
    significant digits: at a fixed ``.4f`` a small final loss (0.0052, as the default CNN run
    reaches) kept two digits, and the speed-up and loss-gap columns, computed from the full
    values, could not be checked against the printed ones (0.0103 vs 0.0104 printed for a
    -1.26% gap)."""
    if not _finite(v):
        return "-"
    if v != 0:
        decimals = min(12, max(decimals, digits - 1 - math.floor(math.log10(abs(v)))))
    return format(v, f".{decimals}f")


def format_table(results: Sequence[ModeResult], baseline: str = "O0") -> str:
    """A markdown table like the seed's, one row per mode.

    Columns: mode, dtype, peak memory (MiB), seconds per 40 iterations (40 x median step
    time), speed-up vs the baseline, final loss, its gap to the baseline's (%), skipped steps,
    status (``ok``, ``FAILED: reason``, or ``not run (reason)`` for a row whose status is
    :data:`NOT_RUN`: a mode an interrupted run did not reach).

    Example::

        >>> print(format_table(rows))  # doctest: +SKIP
        | mode | dtype | peak mem (MiB) | s / 40 it | speed-up vs O0 | final loss | ...
    """
    header = (
        f"| mode | dtype | peak mem (MiB) | s / 40 it | speed-up vs {baseline} | final loss "
        f"| loss gap vs {baseline} | skipped steps | status |"
    )
    lines = [header, _rule(header)]
    for r, rel in zip(results, relative_to(results, baseline)):
        diverged = r.diverged
        if diverged:
            # e.g. pure fp16 with Adam (fp16 optimizer state; docs/amp.md)
            status = "ok, loss not finite (diverged)"
        elif r.ok:
            status = "ok"
        elif r.status == NOT_RUN:
            status = NOT_RUN + (f" ({r.error})" if r.error else "")
        else:
            reason = (r.error or "unknown error").replace("|", "/").replace("\n", " ")
            status = "FAILED: " + (reason if len(reason) <= 120 else reason[:117] + "...")
        cells = [
            r.label,
            r.dtype,
            _fmt(r.peak_memory_mb, ".1f"),
            _fmt_digits(40 * r.time_per_iter_s, 3, 4) if r.time_per_iter_s else "-",
            _fmt(rel["speedup_vs_baseline"], ".2f") + ("x" if rel["speedup_vs_baseline"] else ""),
            "nan" if diverged else _fmt_digits(r.final_loss, 4, 5),
            _gap(rel["loss_gap_pct"]),
            _fmt(r.skipped_steps, "d") if r.ok else "-",
            status,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: Fewer timed steps per mode than this get the note of :func:`few_steps_note`.
FEW_TIMED_STEPS = 5


def few_steps_note(iters: int) -> Optional[str]:
    """A note for a run with fewer than :data:`FEW_TIMED_STEPS` timed steps per mode, whose
    medians one slow step can move and whose spread is barely measured (not at all for one
    step: its ``time_per_iter_iqr_s`` is None); None for a run with enough steps."""
    if iters >= FEW_TIMED_STEPS:
        return None
    spread = "not measured" if iters == 1 else "barely measured"
    return (
        f"only {iters} timed step{'s' if iters != 1 else ''} per mode: too few to time "
        f"reliably (one slow step moves the median; the spread is {spread}), so the "
        f"speed-ups are rough. Use --iters {FEW_TIMED_STEPS} or more (the default is 40) "
        "for figures to compare."
    )


#: A mode whose timed steps' interquartile range exceeds this fraction of their median is
#: called unsteady in :func:`unsteady_timing_note`.
UNSTEADY_IQR = 0.25


def unsteady_timing_note(results: Sequence[ModeResult]) -> Optional[str]:
    """A note naming the modes whose step times varied widely (interquartile range above
    :data:`UNSTEADY_IQR` of the median: a busy machine, or steps too short to time), whose
    speed-ups are then not to be trusted; None when every mode's timing was steady."""
    unsteady = [r.label for r in results
                if r.ok and r.time_per_iter_s and r.time_per_iter_iqr_s is not None
                and r.time_per_iter_iqr_s > UNSTEADY_IQR * r.time_per_iter_s]
    if not unsteady:
        return None
    return (
        f"unsteady timing: the step times of {', '.join(unsteady)} varied by more than "
        f"{UNSTEADY_IQR:.0%} of their median (interquartile range; the JSON has the spread), "
        "so the speed-ups involving them are not reliable: the machine was busy, or the steps "
        "are too short to time. Re-run on an idle machine, or with more --iters (on a busy "
        "CPU, OMP_NUM_THREADS=1 keeps PyTorch's threads from waiting on each other)."
    )


def _gap(pct) -> str:
    if not _finite(pct):
        return "-"
    text = format(pct, "+.2f")
    # A gap that rounds to zero reads as O0's own "+0.00%", whichever side it is on.
    return ("+0.00" if text == "-0.00" else text) + "%"


def _rule(header: str) -> str:
    return "|" + "---|" * (header.count("|") - 1)


def _parent_dir(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


def write_json(
    results: Sequence[ModeResult], path: str, baseline: str = "O0", meta: Optional[dict] = None
) -> None:
    """Write the rows of :func:`rows_to_dicts` to ``path`` as a JSON list."""
    _parent_dir(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rows_to_dicts(results, baseline, meta), f, indent=2)
        f.write("\n")


def write_csv(
    results: Sequence[ModeResult], path: str, baseline: str = "O0", meta: Optional[dict] = None
) -> None:
    """Write one CSV line per mode with :data:`CSV_FIELDS` (plus ``meta``'s keys; a list
    value as its items joined by spaces)."""
    _parent_dir(path)
    rows = rows_to_dicts(results, baseline, meta)
    fields = list(CSV_FIELDS) + [k for k in (meta or {}) if k not in CSV_FIELDS]
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_cell(row.get(k)) for k in fields})


def _csv_cell(v):
    if v is None:
        return ""
    if isinstance(v, (list, tuple)):  # e.g. meta's modes_not_run: "O2 autocast", not a repr
        return " ".join(str(x) for x in v)
    return v


def _import_matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib, which is not installed; install the bench extra "
            "(pip install 'mixprec[bench]') or drop --plot."
        ) from None
    return Figure, FigureCanvasAgg


PLOT_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg")


def plot_format(path: str) -> str:
    """The image format for ``path``: its extension's, or ``"png"`` without one.

    Raises:
        ValueError: the extension names a format not in :data:`PLOT_FORMATS`.
    """
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if not ext:
        return "png"
    if ext not in PLOT_FORMATS:
        raise ValueError(
            f"cannot write a plot as {path!r}: the extension .{ext} is not one of "
            f"{', '.join('.' + f for f in PLOT_FORMATS)}; name the file e.g. 'bench.png'."
        )
    return ext


def write_plot(results: Sequence[ModeResult], path: str, title: str = "") -> None:
    """Save a figure: every mode's loss curve on one axis, and bars of step time and memory.

    The format follows the file's extension (one of :data:`PLOT_FORMATS`; PNG without one).

    Failed modes are left out of the curves and shown as empty bars labelled "failed".

    Args:
        results: rows from :func:`~mixprec.bench.runner.run_modes`.
        path (str): the file to write (``.png``, ``.svg``, ``.pdf``, ``.jpg``).
        title (str): figure title. Default ``""``.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    fig = _figure(results, title)
    _parent_dir(path)
    fig.savefig(path, format=plot_format(path), dpi=100)


# Curves of at most this many steps get a marker per step: one step is otherwise invisible.
_MARKERS_UP_TO = 20


def _figure(results: Sequence[ModeResult], title: str):
    """The matplotlib Figure of :func:`write_plot`."""
    Figure, FigureCanvasAgg = _import_matplotlib()
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 7.5), layout="constrained")
    FigureCanvasAgg(fig)  # attaches the Agg canvas: rendering never touches a display
    grid = fig.add_gridspec(2, 2, height_ratios=(1.3, 1.0))
    ax_loss = fig.add_subplot(grid[0, :])
    ax_time = fig.add_subplot(grid[1, 0])
    ax_mem = fig.add_subplot(grid[1, 1])

    labels = [
        f"{r.label} ({r.dtype})" if r.mode not in ("fp32", "O0") else r.label for r in results
    ]
    styles = ("-", "--", "-.", ":")  # curves of close recipes overlap: vary the dash too
    finite_runs = []
    for i, (r, label) in enumerate(zip(results, labels)):
        if r.ok and r.losses:
            steps = range(1, len(r.losses) + 1)
            diverged = not all(math.isfinite(v) for v in r.losses[-1:])
            if diverged:
                label += " (diverged)"
            else:
                finite_runs.append(r.losses)
            ax_loss.plot(
                steps,
                r.losses,
                label=label,
                linewidth=1.4,
                color=f"C{i % 10}",
                linestyle=styles[i % len(styles)],
                marker="o" if len(r.losses) <= _MARKERS_UP_TO else None,
                markersize=4,
            )
    if finite_runs:
        # Scale the axis to the runs that did not diverge; a diverging one (pure fp16 with
        # Adam, say) would otherwise flatten every other curve against the bottom.
        values = [v for run in finite_runs for v in run if math.isfinite(v)]
        if values:
            low, high = min(values), max(values)
            pad = 0.05 * (high - low or abs(high) or 1.0)
            ax_loss.set_ylim(low - pad, high + pad)
    warmups = {r.warmup for r in results if r.ok}
    if len(warmups) == 1 and next(iter(warmups)) > 0:
        ax_loss.axvline(next(iter(warmups)) + 0.5, color="0.6", linestyle=":", linewidth=1)
        ax_loss.set_xlabel("step (warm-up steps left of the dotted line)")
    else:
        ax_loss.set_xlabel("step")
    ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # whole steps
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title("Loss per step")
    if any(r.ok for r in results):
        ax_loss.legend(loc="upper right", fontsize="small")
    ax_loss.grid(alpha=0.3)

    xs = list(range(len(results)))
    times = [40 * r.time_per_iter_s if r.ok and r.time_per_iter_s else 0.0 for r in results]
    mems = [r.peak_memory_mb if r.ok and r.peak_memory_mb is not None else 0.0 for r in results]
    for ax, values, ylabel, name in (
        (ax_time, times, "seconds per 40 iterations", "Time (40 x median step)"),
        (ax_mem, mems, "peak memory (MiB)", "Peak memory"),
    ):
        bars = ax.bar(xs, values, color=[f"C{i % 10}" for i in xs])
        for bar, r, v in zip(bars, results, values):
            text = "failed" if not r.ok else (f"{v:.0f}" if v >= 100 else f"{v:.3g}")
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, v),
                ha="center",
                va="bottom",
                fontsize="small",
            )
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize="small")
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(textwrap.fill(title, 110), fontsize="medium")
    return fig
