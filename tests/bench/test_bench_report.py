"""The report: ratios against the baseline, the table's failed rows, CSV/JSON writers."""

import csv
import json

import pytest

from mixprec.bench.report import (
    _figure,
    few_steps_note,
    format_table,
    relative_to,
    rows_to_dicts,
    unsteady_timing_note,
    write_csv,
    write_json,
    write_plot,
)
from mixprec.bench.runner import ModeResult


def _row(mode, t, mem, loss, **kw):
    return ModeResult(
        mode=mode,
        label=mode,
        dtype="fp16",
        time_per_iter_s=t,
        peak_memory_mb=mem,
        final_loss=loss,
        skipped_steps=0,
        **kw,
    )


def test_relative_to_baseline():
    rows = [_row("O0", 0.2, 100.0, 2.0), _row("O2", 0.1, 60.0, 2.02)]
    rel = relative_to(rows)
    assert rel[0] == {"speedup_vs_baseline": 1.0, "memory_vs_baseline": 1.0, "loss_gap_pct": 0.0}
    assert rel[1]["speedup_vs_baseline"] == pytest.approx(2.0)
    assert rel[1]["memory_vs_baseline"] == pytest.approx(0.6)
    assert rel[1]["loss_gap_pct"] == pytest.approx(1.0)


def test_loss_gap_is_positive_for_a_higher_loss_whatever_the_baselines_sign():
    # A loss can be negative (a log-likelihood objective): the gap divides by its magnitude,
    # so a row ending higher than the baseline still reads as a positive (worse) gap.
    rows = [_row("O0", 0.2, 100.0, -2.0), _row("O2", 0.1, 60.0, -1.98), _row("O3", 0.1, 60.0, -2.02)]
    gaps = [r["loss_gap_pct"] for r in relative_to(rows)]
    assert gaps == [0.0, pytest.approx(1.0), pytest.approx(-1.0)]


def test_no_baseline_gives_none():
    failed_o0 = ModeResult(mode="O0", label="O0", dtype="fp32", status="failed", error="x")
    rows = [failed_o0, _row("O1", 0.1, 1.0, 1.0)]
    assert relative_to(rows)[1] == {
        "speedup_vs_baseline": None,
        "memory_vs_baseline": None,
        "loss_gap_pct": None,
    }
    table = format_table(rows)
    assert "| O1 | fp16 | 1.0 | 4.000 | - | 1.0000 | - | 0 | ok |" in table


def test_failed_row_in_table_keeps_its_reason_on_one_line():
    err = "RuntimeError: a | b\nsecond line " + "x" * 300
    rows = [
        _row("O0", 0.2, 10.0, 1.0),
        ModeResult(mode="O2", label="O2", dtype="fp16", status="failed", error=err),
    ]
    line = format_table(rows).splitlines()[-1]
    assert line.startswith("| O2 | fp16 | - | - | - | - | - | - | FAILED: RuntimeError: a / b")
    assert line.endswith("... |") and "\n" not in line


def test_json_rows_are_strict_json(tmp_path):
    rows = [_row("O0", 0.2, 10.0, float("nan"), losses=[1.0, float("inf")])]
    path = tmp_path / "sub" / "rows.json"
    write_json(rows, str(path), meta={"model": "cnn"})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    (d,) = json.loads(text)
    assert d["final_loss"] is None and d["losses"] == [1.0, None] and d["model"] == "cnn"
    assert rows_to_dicts(rows)[0]["time_per_40_iters_s"] == pytest.approx(8.0)


def test_diverged_run_shows_nan_and_says_so():
    rows = [_row("O0", 0.1, 100.0, 1.0), _row("O3", 0.05, 50.0, float("nan"))]
    table = format_table(rows).splitlines()
    o3 = next(line for line in table if line.startswith("| O3 "))
    cells = [c.strip() for c in o3.strip("|").split("|")]
    assert cells[5] == "nan"
    assert cells[6] == "-"  # no loss gap to a NaN loss (it printed "-%")
    assert cells[-1] == "ok, loss not finite (diverged)"


def test_plot_with_a_diverged_run(tmp_path):
    from mixprec.bench.report import write_plot

    ok = _row("O0", 0.1, 100.0, 1.0, losses=[2.0, 1.5, 1.0], status="ok")
    bad = _row("O3", 0.05, 50.0, float("nan"), losses=[2.0, 5e3, float("nan")], status="ok")
    path = tmp_path / "plot.png"
    write_plot([ok, bad], str(path), title="t")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_diverged_rows_say_so_in_json_and_csv(tmp_path):
    rows = [_row("O0", 0.1, 100.0, 1.0), _row("O3", 0.05, 50.0, float("nan")),
            ModeResult(mode="O2", label="O2", dtype="fp16", status="failed", error="x")]
    dicts = rows_to_dicts(rows)
    assert [d["diverged"] for d in dicts] == [False, True, False]
    assert dicts[1]["status"] == "ok" and dicts[1]["final_loss"] is None
    path = tmp_path / "rows.csv"
    write_csv(rows, str(path))
    with open(path, newline="") as f:
        assert [r["diverged"] for r in csv.DictReader(f)] == ["False", "True", "False"]


def test_step_time_spread_is_in_json_and_csv(tmp_path):
    import csv

    from mixprec.bench.report import write_csv

    row = _row("O0", 0.2, 10.0, 1.0, time_per_iter_iqr_s=0.01, time_per_iter_min_s=0.19,
               time_per_iter_max_s=0.3)
    (d,) = rows_to_dicts([row])
    assert (d["time_per_iter_iqr_s"], d["time_per_iter_min_s"], d["time_per_iter_max_s"]) == (
        0.01, 0.19, 0.3)
    path = tmp_path / "rows.csv"
    write_csv([row], str(path))
    with open(path, newline="") as f:
        (r,) = csv.DictReader(f)
    assert float(r["time_per_iter_iqr_s"]) == 0.01 and float(r["time_per_iter_max_s"]) == 0.3


def test_a_gap_that_rounds_to_zero_has_no_minus_sign():
    rows = [_row("O0", 0.1, 100.0, 1.0), _row("O1", 0.1, 100.0, 0.99999)]
    o1 = format_table(rows).splitlines()[-1]
    assert "| +0.00% |" in o1 and "-0.00" not in o1


def test_plot_of_few_steps_has_markers_and_whole_step_ticks():
    from mixprec.bench.report import _figure

    one = _row("O0", 0.1, 100.0, 1.0, losses=[2.0], warmup=0)
    fig = _figure([one], title="")
    ax = fig.axes[0]
    (line,) = ax.get_lines()
    assert line.get_marker() == "o"  # a single point is visible
    assert ax.get_xlabel() == "step"  # no dotted warm-up line to mention
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in ax.get_xticks())
    warm = _row("O0", 0.1, 100.0, 1.0, losses=[2.0] * 30, warmup=3)
    ax = _figure([warm], title="").axes[0]
    assert ax.get_lines()[0].get_marker() in ("None", None, "")  # many steps: a plain line
    assert "dotted line" in ax.get_xlabel()


def test_small_losses_and_times_print_enough_digits_to_check_the_ratios():
    # A fixed .4f printed 0.0104 and 0.0103 next to a -1.26% gap (the default CNN run ends
    # near 0.01): the printed numbers must give back the printed ratios.
    rows = [_row("O0", 0.0024, 1.0, 0.010432), _row("O2", 0.0019, 1.0, 0.0103)]
    line = format_table(rows).splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    time, speedup, loss, gap = float(cells[3]), cells[4], float(cells[5]), cells[6]
    o0 = [c.strip() for c in format_table(rows).splitlines()[2].strip("|").split("|")]
    assert f"{float(o0[3]) / time:.2f}x" == speedup
    assert f"{100 * (loss - float(o0[5])) / float(o0[5]):+.2f}%" == gap


def test_a_mode_that_added_no_memory_has_a_zero_memory_ratio():
    # (On CPU a mode can show no RSS growth: its ratio is 0.0, not missing.)
    rows = [_row("O0", 0.2, 100.0, 2.0), _row("O2", 0.1, 0.0, 2.0)]
    assert relative_to(rows)[1]["memory_vs_baseline"] == 0.0
    assert rows_to_dicts(rows)[1]["memory_vs_baseline"] == 0.0


def test_a_plot_path_without_an_extension_is_a_png(tmp_path):
    from mixprec.bench.report import plot_format, write_plot

    assert plot_format("bench") == "png"
    path = tmp_path / "bench"
    write_plot([_row("O0", 0.1, 100.0, 1.0, losses=[2.0, 1.0])], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_labels_a_run_ending_in_a_non_finite_loss_as_diverged():
    from mixprec.bench.report import _figure

    ok = _row("O0", 0.1, 100.0, 1.0, losses=[2.0, 1.5, 1.0])
    bad = _row("O3", 0.05, 50.0, float("nan"), losses=[2.0, 5e3, float("nan")])
    ax = _figure([ok, bad], title="").axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["O0", "O3 (fp16) (diverged)"]
    low, high = ax.get_ylim()  # scaled to the run that did not diverge (1.0 to 2.0)
    assert low == pytest.approx(0.95) and high == pytest.approx(2.05)


def test_plot_bars_are_seconds_per_40_iterations_and_peak_memory():
    from mixprec.bench.report import _figure

    rows = [_row("O0", 0.1, 100.0, 1.0, losses=[1.0]), _row("O2", 0.05, 60.0, 1.0, losses=[1.0]),
            ModeResult(mode="O3", label="O3", dtype="fp16", status="failed", error="x")]
    fig = _figure(rows, title="")
    ax_time, ax_mem = fig.axes[1], fig.axes[2]
    assert [b.get_height() for b in ax_time.patches] == pytest.approx([4.0, 2.0, 0.0])
    assert [b.get_height() for b in ax_mem.patches] == pytest.approx([100.0, 60.0, 0.0])


def test_unsteady_timing_note_names_the_modes_with_a_wide_spread():
    # On a busy CPU the same run gave O2 7.56x, then 0.55x: the note says which rows' times
    # are not to be trusted (the interquartile range over a quarter of the median).
    rows = [
        _row("O0", 0.2, 10.0, 1.0, time_per_iter_iqr_s=0.01),
        _row("O1", 0.2, 10.0, 1.0, time_per_iter_iqr_s=0.05),  # (exactly a quarter: steady)
        _row("O2", 0.1, 10.0, 1.0, time_per_iter_iqr_s=0.2),
        _row("O3", 0.1, 10.0, 1.0),  # (no spread recorded)
        ModeResult(mode="autocast", label="autocast", dtype="fp16", status="failed", error="x"),
    ]
    note = unsteady_timing_note(rows)
    assert note.startswith("unsteady timing: the step times of O2 varied by more than 25% ")
    assert "not reliable" in note and "--iters" in note
    assert unsteady_timing_note(rows[:2] + rows[3:]) is None


def test_few_steps_note_below_five_timed_steps():
    # One or two timed steps are one or two samples of a noisy time: the table says so, and
    # says how many steps give figures to compare; five or more get no note.
    one, four = few_steps_note(1), few_steps_note(4)
    assert one.startswith("only 1 timed step per mode: too few to time reliably")
    assert "the spread is not measured" in one and "--iters 5 or more" in one
    assert four.startswith("only 4 timed steps per mode") and "barely measured" in four
    assert few_steps_note(5) is None and few_steps_note(40) is None


# -- mutation run r50D over mixprec/bench/report.py: what the tests above let through -------

def _cells(line):
    return [c.strip() for c in line.strip("|").split("|")]


# R04: `base.peak_memory_mb` -> `... is not None` (ZeroDivisionError when O0 added no memory)
def test_a_baseline_that_added_no_memory_gives_no_memory_ratio():
    # On CPU, O0's RSS growth can be 0.0: the other rows have no ratio, not a crash.
    rows = [_row("O0", 0.2, 0.0, 2.0), _row("O2", 0.1, 5.0, 2.0)]
    assert [r["memory_vs_baseline"] for r in relative_to(rows)] == [None, None]
    assert "| O2 | fp16 | 5.0 |" in format_table(rows)


# R06: `r.final_loss is not None` -> `r.final_loss` (a zero final loss had no gap)
def test_a_zero_final_loss_is_a_minus_100_percent_gap():
    rows = [_row("O0", 0.2, 10.0, 2.0), _row("O2", 0.1, 10.0, 0.0)]
    assert relative_to(rows)[1]["loss_gap_pct"] == -100.0
    assert _cells(format_table(rows).splitlines()[-1])[5:7] == ["0.0000", "-100.00%"]


# R10: `d["baseline"] = baseline` dropped from the JSON rows
def test_json_rows_name_their_baseline(tmp_path):
    path = tmp_path / "rows.json"
    write_json([_row("O0", 0.2, 10.0, 2.0), _row("O1", 0.1, 10.0, 2.0)], str(path))
    assert [d["baseline"] for d in json.loads(path.read_text())] == ["O0", "O0"]
    assert rows_to_dicts([_row("O1", 0.1, 1.0, 1.0)], baseline="O1")[0]["baseline"] == "O1"


# R13: `not math.isfinite(v)` -> `math.isnan(v)` (an infinite gap written as Infinity)
def test_an_infinite_final_loss_writes_strict_json(tmp_path):
    rows = [_row("O0", 0.2, 10.0, 2.0), _row("O3", 0.1, 10.0, float("inf"))]
    path = tmp_path / "rows.json"
    write_json(rows, str(path))
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    o3 = json.loads(text)[1]
    assert o3["diverged"] is True and o3["final_loss"] is None and o3["loss_gap_pct"] is None


# R16: `if v != 0:` removed from _fmt_digits (log10(0): the table crashed on a zero value)
def test_a_zero_final_loss_prints_in_the_table():
    line = format_table([_row("O0", 0.2, 10.0, 0.0)]).splitlines()[-1]
    assert _cells(line)[5] == "0.0000"


# R21: `len(reason) <= 120` -> `< 120` (a reason of exactly 120 characters was cut)
def test_a_failure_reason_of_120_characters_is_printed_whole():
    reason = "E" * 120
    row = ModeResult(mode="O2", label="O2", dtype="fp16", status="failed", error=reason)
    assert _cells(format_table([row]).splitlines()[-1])[-1] == "FAILED: " + reason
    row.error = "E" * 121
    assert _cells(format_table([row]).splitlines()[-1])[-1] == "FAILED: " + "E" * 117 + "..."


# R27: the delimiter row got one cell too many (not a markdown table any more)
def test_table_delimiter_row_has_a_cell_per_column():
    header, rule, row = format_table([_row("O0", 0.2, 10.0, 2.0)]).splitlines()
    assert rule.count("---") == len(_cells(header)) == len(_cells(row)) == 9
    assert rule == "|" + "---|" * 9


# R29: `f.write("\n")` dropped: the JSON file has no final newline
def test_json_file_ends_with_a_newline(tmp_path):
    path = tmp_path / "rows.json"
    write_json([_row("O0", 0.2, 10.0, 2.0)], str(path))
    assert path.read_text().endswith("]\n")


# R34: `.lower()` dropped from plot_format (bench.PNG refused)
def test_plot_extension_in_capitals_is_accepted():
    from mixprec.bench.report import plot_format

    assert plot_format("bench.PNG") == "png" and plot_format("b.Svg") == "svg"


# R35: "pdf" dropped from PLOT_FORMATS (--help names .pdf)
def test_plot_formats_named_in_help_are_written(tmp_path):
    from mixprec.bench.report import plot_format, write_plot

    assert [plot_format(f"b.{e}") for e in ("png", "svg", "pdf", "jpg", "jpeg")] == \
        ["png", "svg", "pdf", "jpg", "jpeg"]
    path = tmp_path / "b.pdf"
    write_plot([_row("O0", 0.1, 100.0, 1.0, losses=[2.0, 1.0])], str(path))
    assert path.read_bytes()[:5] == b"%PDF-"


# R37: `r.losses[-1:]` -> `r.losses` (a run that recovered from an inf step called diverged)
def test_plot_calls_diverged_only_a_run_whose_last_loss_is_not_finite():
    from mixprec.bench.report import _figure

    ok = _row("O0", 0.1, 100.0, 1.0, losses=[2.0, 1.5, 1.0])
    spike = _row("O1", 0.1, 100.0, 1.0, losses=[2.0, float("inf"), 1.0])
    ax = _figure([ok, spike], title="").axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["O0", "O1 (fp16)"]


# -- mutation run r56B over report.py: what the tests above let through ---------------------


def test_csv_has_the_ratio_and_loss_gap_columns(tmp_path):
    """The CSV carries the ratios against the baseline and the loss gap, as the JSON and the
    table do, with the values of relative_to (a spreadsheet reads them from there). (M29)"""
    rows = [_row("O0", 0.2, 100.0, 2.0), _row("O2", 0.1, 60.0, 2.02)]
    path = tmp_path / "rows.csv"
    write_csv(rows, str(path))
    with open(path, newline="") as f:
        o0, o2 = csv.DictReader(f)
    for got, want in ((o0, relative_to(rows)[0]), (o2, relative_to(rows)[1])):
        for key in ("speedup_vs_baseline", "memory_vs_baseline", "loss_gap_pct"):
            assert float(got[key]) == pytest.approx(want[key], rel=1e-12), key
    assert float(o2["loss_gap_pct"]) == pytest.approx(1.0)


def test_an_unknown_skipped_step_count_is_not_printed_as_zero():
    """skipped_steps is None when the count could not be determined (GradScaler's scale grew
    or underflowed): the table shows "-" for it, not a 0 that claims no step was skipped.
    (M32)"""
    rows = [_row("O0", 0.2, 10.0, 2.0), _row("autocast", 0.2, 10.0, 2.0)]
    rows[1].skipped_steps = None
    lines = format_table(rows).splitlines()
    assert [_cells(line)[7] for line in lines[2:]] == ["0", "-"]


def test_a_row_timed_at_zero_has_no_speed_up():
    """A row whose median step time is 0.0 (a clock too coarse for its steps) has no
    speed-up, like a row with no time at all: the table shows "-" in both cells instead of
    failing on a division by zero."""
    rows = [_row("O0", 0.2, 10.0, 2.0), _row("O2", 0.0, 10.0, 2.0)]
    assert relative_to(rows)[1]["speedup_vs_baseline"] is None
    assert rows_to_dicts(rows)[1]["speedup_vs_baseline"] is None
    assert _cells(format_table(rows).splitlines()[-1])[3:5] == ["-", "-"]


def test_a_tiny_final_loss_keeps_five_significant_digits():
    """The final-loss column keeps 5 significant digits (up to 12 decimals), so a loss far
    below 1e-4, as a long run on an easy task reaches, does not print as zero."""
    rows = [_row("O0", 0.2, 10.0, 2.5e-7)]
    cell = _cells(format_table(rows).splitlines()[-1])[5]
    assert cell == "0.00000025000"
    assert float(cell) == pytest.approx(2.5e-7, rel=1e-12)


def test_a_not_run_row_prints_its_reason_only_when_it_has_one():
    """A NOT_RUN row reads "not run (reason)", or plain "not run" when no reason was given
    (never "not run (None)")."""
    from mixprec.bench.report import NOT_RUN

    rows = [
        _row("O0", 0.2, 10.0, 2.0),
        ModeResult(mode="O1", label="O1", dtype="fp16", status=NOT_RUN),
        ModeResult(mode="O2", label="O2", dtype="fp16", status=NOT_RUN, error="interrupted"),
    ]
    lines = format_table(rows).splitlines()
    assert _cells(lines[-2])[-1] == "not run"
    assert _cells(lines[-1])[-1] == "not run (interrupted)"


def test_a_failed_row_without_a_message_says_unknown_error():
    """A failed row whose error is missing still says why it is empty: "FAILED: unknown
    error", not a bare "FAILED: "."""
    rows = [_row("O0", 0.2, 10.0, 2.0),
            ModeResult(mode="O2", label="O2", dtype="fp16", status="failed")]
    assert _cells(format_table(rows).splitlines()[-1])[-1] == "FAILED: unknown error"


def test_plot_of_a_flat_loss_curve_sets_its_axis_without_a_warning():
    """A run of one step (or a loss that does not move) gets a loss axis padded around its
    value by the figure itself, without matplotlib's "identical low and high ylims" warning
    (which the CLI would show on stderr)."""
    import warnings

    from mixprec.bench.report import _figure

    for losses, low, high in (([2.0], 1.9, 2.1), ([0.0, 0.0], -0.05, 0.05)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ax = _figure([_row("O0", 0.1, 10.0, losses[-1], losses=losses)], title="").axes[0]
        assert ax.get_ylim() == (pytest.approx(low), pytest.approx(high))


def test_plot_of_a_run_where_every_mode_failed_has_no_legend():
    """With no curve to name, the loss axis has no legend, and matplotlib's "no artists with
    labels" warning is not raised."""
    import warnings

    from mixprec.bench.report import _figure

    rows = [ModeResult(mode="O0", label="O0", dtype="fp32", status="failed", error="x"),
            ModeResult(mode="O2", label="O2", dtype="fp16", status="failed", error="y")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = _figure(rows, title="")
    assert fig.axes[0].get_legend() is None


def test_plot_marks_every_step_of_a_curve_of_up_to_20_steps():
    """Curves of at most 20 steps get a marker per step (a short run is otherwise hard to
    read); from 21 steps on, a plain line."""
    from mixprec.bench.report import _figure

    markers = []
    for n in (20, 21):
        ax = _figure([_row("O0", 0.1, 10.0, 1.0, losses=[1.0 + i for i in range(n)])],
                     title="").axes[0]
        markers.append(ax.get_lines()[0].get_marker())
    assert markers[0] == "o" and markers[1] in ("None", None, "")


def test_another_baseline_is_used_by_the_ratios_the_table_and_the_files(tmp_path):
    """`baseline=` (public in relative_to, format_table, rows_to_dicts, write_json and
    write_csv) compares every row with that mode, not with O0, and the table's header names
    it. Expected ratios computed by hand against O1: time 0.1 / 0.05, memory 25 / 50,
    gap 100 * (3 - 1) / 1."""
    rows = [_row("O0", 0.2, 100.0, 2.0), _row("O1", 0.1, 50.0, 1.0), _row("O2", 0.05, 25.0, 3.0)]
    want = {"speedup_vs_baseline": pytest.approx(2.0), "memory_vs_baseline": pytest.approx(0.5),
            "loss_gap_pct": pytest.approx(200.0)}
    assert relative_to(rows, baseline="O1")[2] == want
    assert relative_to(rows, baseline="O1")[1] == {
        "speedup_vs_baseline": 1.0, "memory_vs_baseline": 1.0, "loss_gap_pct": 0.0}
    d = rows_to_dicts(rows, baseline="O1")[2]
    assert {k: d[k] for k in want} == want and d["baseline"] == "O1"
    table = format_table(rows, baseline="O1").splitlines()
    assert "| speed-up vs O1 |" in table[0] and "| loss gap vs O1 |" in table[0]
    assert _cells(table[-1])[4:7] == ["2.00x", "3.0000", "+200.00%"]
    path = tmp_path / "rows.csv"
    write_csv(rows, str(path), baseline="O1")
    with open(path, newline="") as f:
        o2 = list(csv.DictReader(f))[2]
    assert (float(o2["speedup_vs_baseline"]), float(o2["memory_vs_baseline"]),
            float(o2["loss_gap_pct"])) == (pytest.approx(2.0), pytest.approx(0.5),
                                           pytest.approx(200.0))


# -- mutation run r64C over report.py: what the tests above let through --------------------


def test_meta_never_overwrites_a_rows_own_fields():
    """meta adds the run's settings to each row; a key that is also a row's field (a caller's
    meta={"device": ...} or {"mode": ...}) does not replace the measured row's value, so a
    row keeps saying which mode it measured and where. (P01)"""
    rows = [_row("O0", 0.2, 10.0, 1.0), _row("O2", 0.1, 5.0, 1.0)]
    out = rows_to_dicts(rows, meta={"mode": "bogus", "device": "elsewhere", "model": "cnn"})
    assert [(d["mode"], d["device"], d["model"]) for d in out] == [
        ("O0", "cpu", "cnn"), ("O2", "cpu", "cnn")]


def test_plot_title_is_shown_wrapped_above_the_axes():
    """write_plot's title is the figure's title, wrapped at 110 characters so a long workload
    description stays within the figure; without one there is none. (P02)"""
    import textwrap

    from mixprec.bench.report import _figure

    title = "mixprec bench: " + "a long workload description " * 6
    fig = _figure([_row("O0", 0.1, 10.0, 1.0, losses=[2.0, 1.0])], title=title)
    assert fig._suptitle is not None
    assert fig._suptitle.get_text() == textwrap.fill(title, 110)
    assert "\n" in fig._suptitle.get_text()
    assert _figure([_row("O0", 0.1, 10.0, 1.0, losses=[2.0])], title="")._suptitle is None


def test_plot_bar_labels_are_whole_numbers_from_100_up():
    """The bars' value labels show whole numbers from 100 up (a peak of 1234.4 MiB reads
    "1234", not "1.23e+03") and three significant digits below (0.0123 s reads
    "0.0123"). (P03)"""
    from mixprec.bench.report import _figure

    rows = [_row("O0", 0.0123 / 40, 1234.4, 1.0, losses=[2.0])]
    fig = _figure(rows, title="")
    ax_time, ax_mem = fig.axes[1], fig.axes[2]
    assert [t.get_text() for t in ax_mem.texts] == ["1234"]
    assert [t.get_text() for t in ax_time.texts] == ["0.0123"]


# -- the baseline row and the loss plot ------------------------------------------------------------


def test_the_baseline_is_the_successful_row_of_its_mode():
    """run_modes may be given a mode twice (a retry after a failure): the ratios are against
    the baseline row that ran, not a failed one of the same mode, which has no numbers and
    would leave every ratio empty. (P03)"""
    failed_o0 = ModeResult(mode="O0", label="O0", dtype="fp32", status="failed", error="x")
    rows = [failed_o0, _row("O0", 0.2, 100.0, 2.0), _row("O2", 0.1, 50.0, 2.02)]
    rel = relative_to(rows)
    assert rel[0] == {"speedup_vs_baseline": None, "memory_vs_baseline": None,
                      "loss_gap_pct": None}
    assert rel[2]["speedup_vs_baseline"] == pytest.approx(2.0)
    assert rel[2]["memory_vs_baseline"] == pytest.approx(0.5)
    assert rel[2]["loss_gap_pct"] == pytest.approx(1.0)


def test_plot_separates_the_warm_up_steps_between_the_last_and_the_first_timed_one():
    """The loss plot numbers steps from 1, so the warm-up steps are 1..warmup; the dotted line
    the x label points to sits halfway between the last warm-up step and the first timed one,
    at warmup + 0.5: a reader counts the warm-up steps left of it. (P15)"""
    from mixprec.bench.report import _figure

    row = _row("O0", 0.1, 10.0, 1.0, losses=[3.0 - 0.1 * i for i in range(8)], warmup=3)
    ax = _figure([row], title="").axes[0]
    curve, rule = ax.get_lines()
    assert list(curve.get_xdata()) == list(range(1, 9))
    assert list(rule.get_xdata()) == [3.5, 3.5]
    assert rule.get_linestyle() == ":"


# Notes, the plot's colours and labels, write_json's baseline (r99A).

def test_two_timed_steps_have_a_barely_measured_spread():
    """(r99A) from two timed steps on the IQR is measured (runner: time_per_iter_iqr_s is
    set for two steps), so the note for two says "barely measured", not "not measured"."""
    assert "the spread is barely measured" in few_steps_note(2)
    assert "not measured" not in few_steps_note(2)


def test_unsteady_is_judged_against_the_median():
    """(r99A) the IQR is compared with a quarter of the median step time (the documented
    rule), not with the slowest step: IQR 0.03 s on a 0.1 s median with one 0.5 s outlier is
    unsteady (0.03 > 0.025)."""
    rows = [_row("O2", 0.1, 10.0, 1.0, time_per_iter_iqr_s=0.03, time_per_iter_max_s=0.5)]
    note = unsteady_timing_note(rows)
    assert note is not None and "O2" in note


def test_write_plot_creates_missing_parent_directories(tmp_path):
    """(r99A) as write_json and write_csv do (README: "missing parent directories are
    created"), write_plot creates the file's missing parent directories."""
    path = tmp_path / "new" / "sub" / "bench.png"
    write_plot([_row("O0", 0.1, 100.0, 1.0, losses=[2.0, 1.0])], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_modes_loss_curve_has_the_colour_of_its_bars():
    """(r99A) a mode's loss curve and its time and memory bars share one colour (C<i> for the
    i-th row), also after a diverged or failed row, so a reader matches them."""
    import matplotlib.colors as mcolors

    rows = [_row("O0", 0.1, 100.0, 1.0, losses=[2.0, 1.0]),
            _row("O3", 0.05, 50.0, float("nan"), losses=[2.0, float("nan")]),
            ModeResult(mode="O1", label="O1", dtype="fp16", status="failed", error="x"),
            _row("O2", 0.05, 60.0, 1.0, losses=[2.0, 1.1])]
    fig = _figure(rows, title="")
    ax_loss, ax_time = fig.axes[0], fig.axes[1]
    curve_colors = {line.get_label().split(" ")[0]: mcolors.to_rgba(line.get_color())
                    for line in ax_loss.get_lines() if not line.get_label().startswith("_")}
    bar_colors = [bar.get_facecolor() for bar in ax_time.patches]
    assert curve_colors["O0"] == pytest.approx(bar_colors[0])
    assert curve_colors["O3"] == pytest.approx(bar_colors[1])
    assert curve_colors["O2"] == pytest.approx(bar_colors[3])


def test_the_fp32_row_is_labelled_without_a_repeated_dtype_in_the_plot():
    """(r99A) the fp32 and O0 rows are fp32 by name: their plot label is the bare label,
    others get "(dtype)"."""
    rows = [ModeResult(mode="fp32", label="fp32", dtype="fp32", time_per_iter_s=0.1,
                       peak_memory_mb=10.0, final_loss=1.0, losses=[2.0, 1.0]),
            _row("O2", 0.1, 10.0, 1.0, losses=[2.0, 1.0])]
    ax = _figure(rows, title="").axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["fp32", "O2 (fp16)"]


def test_write_json_uses_the_given_baseline(tmp_path):
    """(r99A) write_json(baseline=...) computes the ratios against that mode (its doc and
    the public signature), as write_csv does."""
    rows = [_row("O0", 0.2, 100.0, 2.0), _row("O1", 0.1, 50.0, 1.0), _row("O2", 0.05, 25.0, 3.0)]
    path = tmp_path / "rows.json"
    write_json(rows, str(path), baseline="O1")
    o2 = json.loads(path.read_text())[2]
    assert o2["baseline"] == "O1"
    assert o2["speedup_vs_baseline"] == pytest.approx(2.0)
    assert o2["memory_vs_baseline"] == pytest.approx(0.5)
