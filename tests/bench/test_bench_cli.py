"""`mixprec bench` run in-process on the CPU with a tiny workload: table, JSON, CSV, PNG,
failed rows, argparse errors and the frozen-BatchNorm case."""

import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

from mixprec.bench.cli import _mode_line, main
from mixprec.bench.models import build_workload
from mixprec.bench.runner import ModeResult

# Few steps on a small batch: the whole file stays within a few seconds of CPU per run.
FAST = ["--iters", "2", "--warmup", "1", "--batch-size", "4", "--device", "cpu", "--no-progress"]
ALL_MODES = ["O0", "O1", "O2", "O3", "autocast", "half"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def _child_env():
    """The environment of a ``python -m mixprec`` child: this checkout first on its path, one
    OpenMP thread (the suite runs on two cores)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _table_rows(text):
    """The markdown table's data rows, as lists of cells."""
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    paths = {k: str(d / f"rows.{k}") for k in ("json", "csv", "png")}
    code, text = _run(
        ["bench", *FAST, "--json", paths["json"], "--csv", paths["csv"], "--plot", paths["png"]]
    )
    return code, text, paths


def test_table_has_a_row_per_mode(default_run):
    code, text, _ = default_run
    assert code == 0
    rows = _table_rows(text)
    assert [r[0] for r in rows] == ["O0", "O1", "O2", "O3", "autocast", ".bfloat16()"]
    assert all(r[-1] == "ok" for r in rows), text
    assert [r[1] for r in rows] == ["fp32", "bf16", "bf16", "bf16", "bf16", "bf16"]
    # O0 is its own baseline.
    assert rows[0][4] == "1.00x" and rows[0][6] == "+0.00%"
    assert "speed-up vs O0" in text and "peak mem" in text and "skipped steps" in text
    # On the CPU, peak memory is resident-memory growth, and the note says so.
    assert "note: peak mem = growth of the process's resident memory (RSS)" in text
    assert "max_memory_allocated" not in text


def test_no_cpu_memory_reader_shows_no_figure_and_says_why(monkeypatch):
    # (r99A R2) With no /proc and no psutil there is no honest CPU peak: the column shows "-"
    # and the note says what to install, instead of lifetime-peak growth (~0 after O0).
    import mixprec.bench.runner as runner_module

    monkeypatch.setattr(runner_module, "_rss_reader", lambda: None)
    code, text = _run(["bench", *FAST, "--opt-levels", "O0", "O2", "--no-native"])
    assert code == 0
    rows = _table_rows(text)
    assert [r[0] for r in rows] == ["O0", "O2"] and [r[2] for r in rows] == ["-", "-"]
    assert "peak mem: not measured (this system's resident memory needs psutil" in text
    assert "growth of the process's resident memory" not in text


def test_json_rows_are_sane(default_run):
    _, _, paths = default_run
    with open(paths["json"]) as f:
        rows = json.load(f)
    assert isinstance(rows, list) and [r["mode"] for r in rows] == ALL_MODES
    for r in rows:
        assert r["status"] == "ok" and r["error"] is None
        for key in ("time_per_iter_s", "time_per_iter_mean_s", "total_time_s"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["mode"], key, r[key])
        assert math.isfinite(r["peak_memory_mb"]) and r["peak_memory_mb"] >= 0
        assert math.isfinite(r["final_loss"]) and r["final_loss"] > 0
        assert len(r["losses"]) == 3 and all(math.isfinite(v) for v in r["losses"])
        assert len(r["step_times_s"]) == 2
        assert r["skipped_steps"] == 0  # bf16: static loss scale, nothing is skipped
        assert r["model"] == "cnn" and r["batch_size"] == 4 and r["device"] == "cpu"
        assert r["time_per_40_iters_s"] == pytest.approx(40 * r["time_per_iter_s"])
        assert r["run_status"] == "complete" and r["modes_not_run"] == []
        assert r["torch_version"] == torch.__version__ and r["device_name"] == "CPU"
    base = rows[0]
    assert base["speedup_vs_baseline"] == 1.0 and base["loss_gap_pct"] == 0.0


def test_every_mode_starts_from_the_same_weights_and_data(default_run):
    _, _, paths = default_run
    with open(paths["json"]) as f:
        rows = json.load(f)
    first = [r["losses"][0] for r in rows]
    # Same initial weights and batch: the first loss differs only by bf16 rounding.
    for mode, loss in zip(ALL_MODES, first):
        assert loss == pytest.approx(first[0], rel=3e-2), (mode, first)


def test_csv_has_header_and_a_line_per_mode(default_run):
    _, _, paths = default_run
    with open(paths["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["mode"] for r in rows] == ALL_MODES
    for r in rows:
        assert float(r["time_per_iter_s"]) > 0
        assert math.isfinite(float(r["final_loss"]))
        assert r["status"] == "ok"
        assert r["run_status"] == "complete" and r["modes_not_run"] == ""


def test_table_json_and_csv_of_one_run_agree(default_run):
    """The printed table, the JSON and the CSV of one run are one result: every table cell is
    the file's value rounded to the printed digits (memory, s / 40 it, speed-up, final loss,
    loss gap, skipped steps), and each CSV cell is the JSON value exactly, because users
    quote the table and script against the files and must not find two answers."""
    _, text, paths = default_run
    table = _table_rows(text)
    with open(paths["json"]) as f:
        rows = json.load(f)
    with open(paths["csv"], newline="") as f:
        lines = list(csv.DictReader(f))
    assert len(table) == len(rows) == len(lines) == len(ALL_MODES)

    def printed(cell, value):
        # The cell, with its unit stripped, is the value rounded to the cell's decimals.
        number = cell.rstrip("x%")
        decimals = len(number.split(".")[1]) if "." in number else 0
        return abs(float(number) - value) <= 0.5 * 10 ** -decimals + 1e-12

    keys = ("peak_memory_mb", "time_per_40_iters_s", "speedup_vs_baseline", "final_loss",
            "loss_gap_pct")
    for cells, row, line in zip(table, rows, lines):
        assert cells[:2] == [row["label"], row["dtype"]] == [line["label"], line["dtype"]]
        for cell, key in zip(cells[2:7], keys):
            assert printed(cell, row[key]), (row["label"], key, cell, row[key])
            assert float(line[key]) == row[key], (row["label"], key)
        assert int(cells[7]) == row["skipped_steps"] == int(line["skipped_steps"])
        # The final loss is the mean of the last pass over the 4-batch pool (here the
        # warm-up step and both timed ones: 3 losses).
        window = row["losses"][-4:]
        assert row["final_loss"] == pytest.approx(sum(window) / len(window), rel=1e-12)


def test_plot_is_a_png(default_run):
    _, _, paths = default_run
    with open(paths["png"], "rb") as f:
        data = f.read()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000  # three axes with curves, bars and labels


def test_plot_format_follows_the_extension(tmp_path):
    path = tmp_path / "bench.svg"
    code, text = _run(["bench", *FAST, "--opt-levels", "O0", "--no-native", "--iters", "1",
                       "--warmup", "0", "--plot", str(path)])
    assert code == 0
    assert path.read_bytes().lstrip().startswith(b"<?xml") and b"<svg" in path.read_bytes()
    # One step run: the note says what the final loss is the mean of.
    assert "mean over the last 1 step (every step run, 1 of the 4 batches; an inf" in text


def test_failed_mode_is_a_failed_row_and_others_run(monkeypatch, tmp_path):
    from mixprec import amp

    real = amp.initialize

    def flaky_initialize(*args, **kwargs):
        if kwargs.get("opt_level") == "O2":
            raise RuntimeError("fp16 unsupported here (forced by the test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(amp, "initialize", flaky_initialize)
    path = str(tmp_path / "rows.json")
    code, text = _run(["bench", *FAST, "--opt-levels", "O0", "O2", "O3", "--json", path])
    assert code == 0
    rows = {r[0]: r for r in _table_rows(text)}
    assert list(rows) == ["O0", "O2", "O3", "autocast", ".bfloat16()"]
    assert rows["O2"][-1].startswith("FAILED: RuntimeError: fp16 unsupported here")
    assert all(rows[m][-1] == "ok" for m in ("O0", "O3", "autocast", ".bfloat16()"))
    with open(path) as f:
        js = {r["mode"]: r for r in json.load(f)}
    assert js["O2"]["status"] == "failed" and "fp16 unsupported" in js["O2"]["error"]
    assert js["O2"]["time_per_iter_s"] is None and js["O3"]["status"] == "ok"


def test_failed_process_warm_up_still_runs_every_mode(monkeypatch):
    # The fp32 warm-up step (run before the modes) can fail where the modes do not, e.g. out
    # of memory in fp32 at a batch that fits in half: it must not abort the benchmark.
    import mixprec.bench.runner as runner

    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (forced by the test)")

    monkeypatch.setattr(runner, "warm_up_process", oom)
    code, text = _run(["bench", *FAST, "--opt-levels", "O0", "O2", "--no-native"])
    assert code == 0
    assert [r[-1] for r in _table_rows(text)] == ["ok", "ok"]


def test_an_output_that_cannot_be_written_costs_only_itself(monkeypatch, tmp_path):
    import mixprec.bench.report as report

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system (forced by the test)")

    monkeypatch.setattr(report, "write_json", refuse)
    csv_path = tmp_path / "rows.csv"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code, text = _run(["bench", *FAST, "--opt-levels", "O0", "--no-native",
                           "--json", str(tmp_path / "rows.json"), "--csv", str(csv_path)])
    assert code == 1  # the run itself was fine, but an asked-for output is missing
    assert "could not write" in err.getvalue() and "read-only" in err.getvalue()
    assert csv_path.exists() and f"wrote {csv_path}" in text


def test_every_mode_failing_exits_1(monkeypatch):
    import mixprec.bench.runner as runner

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(runner, "_build_recipe", boom)
    code, text = _run(["bench", *FAST, "--opt-levels", "O0", "O1", "--no-native"])
    assert code == 1
    assert text.count("FAILED: RuntimeError: boom") == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: {bench}"),  # (names the command)
        (["bench", "--opt-levels", "O4"], "invalid choice"),
        (["bench", "--opt-levels", "02"], "invalid choice"),
        (["bench", "--dtype", "fp8"], "invalid choice"),
        (["bench", "--model", "vgg"], "invalid choice"),
        (["bench", "--iters", "0"], "positive integer"),
        (["bench", "--iters", "ten"], "positive integer"),
        (["bench", "--batch-size", "-3"], "positive integer"),
        (["bench", "--warmup", "-1"], "integer >= 0"),
        (["bench", "--device", "tpu"], "--device"),
        (["bench", "--model", "gpt", "--channels-last"], "image models"),
        (["bench", "--model", "gpt", "--frozen-bn"], "models with BatchNorm"),
        (["bench", "--json", "."], "argument --json: cannot write '.': it is a directory"),
        (["bench", "--csv", "/dev/null/x.csv"], "argument --csv: cannot write"),
        (["bench", "--bogus"], "unrecognized"),
        (["bench", "--seed", str(2**64)], "from -2**63 to 2**64 - 1"),
        (["bench", "--seed", str(-(2**63) - 1)], "from -2**63 to 2**64 - 1"),
        (["bench", "--csv", ""], "argument --csv: expected a file path, got ''"),
        (["bench", "--plot", "out.txt"], "argument --plot: cannot write a plot as 'out.txt'"),
        (["bench", "--json", "rows.out", "--csv", "./rows.out"],
         "arguments --json and --csv: both name"),
    ],
)
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def _stop_at_build(monkeypatch):
    """Replace build_workload with one that records its arguments and stops the run there
    (as a failure to build does: an argparse error); returns the record."""
    from mixprec.bench import models

    calls = []

    def stop(*args, **kwargs):
        calls.append((args, kwargs))
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(models, "build_workload", stop)
    return calls


def test_default_device_is_cuda_when_available_else_cpu(monkeypatch):
    """Without --device the benchmark runs on CUDA where there is one and on the CPU
    elsewhere, so the bare `mixprec bench` runs on any machine."""
    from mixprec.bench.cli import _resolve_device, build_parser

    parser = build_parser()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _resolve_device(None, parser) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _resolve_device(None, parser) == torch.device("cuda")


def test_a_cuda_index_past_the_visible_devices_is_an_argparse_error(monkeypatch, capsys):
    """--device cuda:N needs N < the number of visible devices (indices start at 0): with two
    devices cuda:1 is taken and cuda:2 refused, naming the count."""
    from mixprec.bench.cli import _resolve_device, build_parser

    parser = build_parser()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _resolve_device("cuda:1", parser) == torch.device("cuda", 1)
    with pytest.raises(SystemExit) as exc:
        _resolve_device("cuda:2", parser)
    assert exc.value.code == 2
    assert "argument --device: 'cuda:2' but only 2 CUDA device(s) are visible" in \
        capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_device_without_cuda_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--device", "cuda"])
    assert exc.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_channels_last_and_frozen_bn_are_taken_for_resnet50(monkeypatch, capsys):
    """--channels-last and --frozen-bn apply to both image models: for --model resnet50 they
    pass the flag checks (here the run then stops at the missing torchvision, the next
    check), only the GPT refuses them."""
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import fails as if not installed
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--model", "resnet50", *FAST, "--channels-last", "--frozen-bn"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "needs torchvision" in err
    assert "argument --channels-last" not in err and "argument --frozen-bn" not in err


def test_resnet50_without_torchvision_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import fails as if not installed
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--model", "resnet50", *FAST])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "needs torchvision" in err
    # The release made with this torch (a bare `pip install torchvision` pulled the newest
    # torch, multi-GB CUDA build included, over a pinned one).
    minor = int(torch.__version__.split(".")[1])
    assert f"torchvision==0.{minor + 15}.*" in err


@pytest.mark.parametrize("version,want", [
    ("2.4.1+cu121", "torchvision==0.19.*"), ("2.13.0+cpu", "torchvision==0.28.*"),
    ("2.6.0", "torchvision==0.21.*"), ("3.0.0", "pip install torchvision"),
    ("weird", "pip install torchvision")])
def test_torchvision_requirement_follows_torch(monkeypatch, version, want):
    from mixprec.bench import models

    monkeypatch.setattr(torch, "__version__", version)
    assert want in models._torchvision_requirement()


@pytest.mark.parametrize("argv", [["--version"], ["bench", "--version"]])
def test_version_flag(argv, capsys):
    # (after the command too: "mixprec bench --version" was an unrecognized argument)
    import mixprec

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"mixprec {mixprec.__version__}"


def test_batch_too_large_for_memory_names_the_option(monkeypatch, capsys):
    # The synthetic batches are allocated before any mode runs: a huge --batch-size used to end
    # with only the allocator's message ("DefaultCPUAllocator: can't allocate memory ...").
    from mixprec.bench import models

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 307200000000 bytes.")

    monkeypatch.setattr(models, "_image_batches", no_memory)
    with pytest.raises(SystemExit) as exc:
        main(["bench", *FAST[:4], "--batch-size", "100000000", "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --batch-size: the synthetic data for --model cnn at --batch-size " \
        "100000000 does not fit in memory" in err
    assert "can't allocate memory" in err and "use a smaller --batch-size" in err
    # Without --batch-size the message names the size whose default batch did not fit.
    with pytest.raises(SystemExit):
        main(["bench", "--device", "cpu", "--no-progress"])
    assert "argument --batch-size: the synthetic data for --model cnn at the default batch " \
        "size of --size small does not fit in memory on cpu" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error_before_running(monkeypatch, capsys, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exc:
        main(["bench", *FAST, "--plot", str(tmp_path / "p.png")])
    assert exc.value.code == 2
    assert "needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_frozen_bn_runs():
    # The seed's crash: BatchNorm in eval mode under a half-precision model (O2, O3, .half()).
    code, text = _run(["bench", *FAST, "--frozen-bn", "--opt-levels", "O0", "O2", "O3"])
    assert code == 0
    rows = _table_rows(text)
    assert len(rows) == 5 and all(r[-1] == "ok" for r in rows), text
    assert "BatchNorm frozen (eval)" in text


def test_gpt_and_selected_levels_without_native():
    code, text = _run(["bench", "--model", "gpt", *FAST, "--opt-levels", "O2", "O0", "--no-native"])
    assert code == 0
    rows = _table_rows(text)
    assert [r[0] for r in rows] == ["O0", "O2"]  # run in opt-level order
    assert all(r[-1] == "ok" for r in rows), text


def test_gpt_with_mixprec_norm():
    pytest.importorskip("mixprec.normalization").FusedLayerNorm  # noqa: B018
    code, text = _run(
        ["bench", "--model", "gpt", *FAST, "--opt-levels", "O1", "--no-native", "--norm", "mixprec"]
    )
    assert code == 0 and "FusedLayerNorm" in text
    assert _table_rows(text)[0][-1] == "ok"


def test_gpt_with_mixprec_norm_builds_fused_layer_norms(monkeypatch):
    """--model gpt --norm mixprec trains a GPT whose norm layers are mixprec's FusedLayerNorm.
    test_gpt_with_mixprec_norm only finds "FusedLayerNorm" in the output, which the CPU note
    ("FusedLayerNorm ran PyTorch code here") prints from the flag alone: a CLI that dropped
    the norm factory trained nn.LayerNorm while its JSON said norm "mixprec". The workload is
    built, its model inspected, and the run stopped there."""
    FusedLayerNorm = pytest.importorskip("mixprec.normalization").FusedLayerNorm
    from mixprec.bench import models

    built = []
    real = models.build_workload

    def spy(*args, **kwargs):
        wl = real(*args, **kwargs)
        built.append((wl, wl.build_model()))
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(models, "build_workload", spy)
    with pytest.raises(SystemExit):
        main(["bench", "--model", "gpt", *FAST, "--norm", "mixprec"])
    ((wl, model),) = built
    norms = [m for m in model.modules()
             if isinstance(m, (torch.nn.LayerNorm, FusedLayerNorm))]
    assert norms and all(type(m) is FusedLayerNorm for m in norms)
    assert "norm=FusedLayerNorm" in wl.description


def test_gpt_with_mixprec_optimizer(tmp_path):
    path = str(tmp_path / "rows.json")
    code, text = _run(["bench", "--model", "gpt", *FAST, "--opt-levels", "O0", "O2",
                       "--optimizer", "mixprec", "--json", path])
    assert code == 0 and "mixprec FusedAdam" in text
    assert all(r[-1] == "ok" for r in _table_rows(text)), text
    with open(path) as f:
        data = json.load(f)
    assert {row["optimizer"] for row in data} == {"mixprec"}  # meta repeated on each row


@pytest.mark.parametrize("model", ["resnet50", "cnn"])
def test_image_model_with_mixprec_optimizer_is_an_argparse_error(model, capsys):
    # (The CNN, the default model, too: a usage error, not build_workload's traceback.)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--model", model, *FAST, "--optimizer", "mixprec"])
    assert exc.value.code == 2
    assert "argument --optimizer: mixprec (an AdamW) applies to --model gpt" in \
        capsys.readouterr().err


@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_norm_torch_builds_pytorchs_norm_layers(model, monkeypatch):
    """--norm torch (the default) is PyTorch's own layers: no norm factory for the GPT (so
    nn.LayerNorm) and no FusedBatchNorm for the image models; mixprec's layers only with
    --norm mixprec."""
    calls = _stop_at_build(monkeypatch)
    with pytest.raises(SystemExit):
        main(["bench", "--model", model, *FAST])
    ((_, kwargs),) = calls
    assert kwargs["norm_cls"] is None and kwargs["fused_batchnorm"] is False


def test_image_model_with_mixprec_norm_takes_fused_batchnorm(monkeypatch):
    pytest.importorskip("mixprec.normalization").FusedBatchNorm  # noqa: B018
    from mixprec.bench import models

    built = []
    real = models.build_workload

    def spy(*args, **kwargs):
        wl = real(*args, **kwargs)
        built.append(wl.build_model())
        return wl

    monkeypatch.setattr(models, "build_workload", spy)  # (the CLI imports it when it runs)
    code, text = _run(
        ["bench", "--model", "cnn", *FAST, "--opt-levels", "O2", "--no-native", "--norm", "mixprec"]
    )
    assert code == 0 and "FusedBatchNorm" in text
    assert _table_rows(text)[0][-1] == "ok"
    from mixprec.normalization import FusedBatchNorm

    bns = [m for m in built[0].modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert bns and all(type(m) is FusedBatchNorm for m in bns)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_callback_counts_steps(monkeypatch):
    pytest.importorskip("tqdm")
    from mixprec.bench.cli import _progress

    monkeypatch.setattr(sys, "stderr", _Terminal())  # the bar shows on terminals only
    bar, step = _progress(5, enabled=True, label={"O1": "O1", "half": ".bfloat16()"}.get)
    try:
        assert not bar.disable
        for i in range(3):
            step("O1", i)
        assert "O1" in sys.stderr.getvalue()  # the mode labels the bar
        for i in range(2):
            step("half", i)
        assert bar.total == 5 and bar.n == 5
    finally:
        bar.close()
    # As the table names it (the runner's name for the pure-half recipe is "half").
    assert ".bfloat16()" in sys.stderr.getvalue()
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file: no bar
    bar, _ = _progress(5, enabled=True)
    assert bar.disable
    bar.close()
    assert _progress(5, enabled=False) == (None, None)


def test_the_cli_progress_bar_names_each_mode_as_the_table_does(monkeypatch):
    """The bar the CLI shows (on a terminal) is described by each mode's table label
    (".bfloat16()", not the runner's "half"): test_progress_bar_callback_counts_steps passes
    its own label function to _progress, so the CLI's own (mode_label at the run's dtype)
    was not checked. No per-mode lines go to stderr while a bar shows, so the label there
    is the bar's."""
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", _Terminal())
    code, _ = _run(["bench", "--iters", "2", "--warmup", "1", "--batch-size", "4", "--device",
                    "cpu", "--opt-levels", "O0"])
    assert code == 0
    assert ".bfloat16()" in sys.stderr.getvalue()


def test_a_terminal_of_no_width_gets_the_per_mode_lines(monkeypatch):
    """(r100B R1) A terminal that reports 0 columns (some CI runners' pseudo-terminals): tqdm
    draws nothing there, and the CLI, taking the bar as shown, printed no per-mode lines
    either, so stderr stayed empty for the whole run. No bar there: the lines come."""
    pytest.importorskip("tqdm")
    import mixprec.bench.cli as cli

    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.setattr(cli, "_terminal_columns", lambda: 0)
    assert cli._progress(5, enabled=True) == (None, None)
    code, _ = _run(["bench", *FAST[:-1], "--opt-levels", "O0", "--no-native"])
    assert code == 0
    assert "O0" in sys.stderr.getvalue() and "step" not in sys.stderr.getvalue()
    monkeypatch.setattr(cli, "_terminal_columns", lambda: 80)
    bar, _ = cli._progress(5, enabled=True)
    assert bar is not None and not bar.disable
    bar.close()


def test_the_install_tqdm_hint_is_shown_on_a_terminal_only(monkeypatch):
    """Without tqdm there is no bar: a terminal is told how to get one, a log (stderr not a
    terminal, where tqdm would show no bar either) gets nothing."""
    from mixprec.bench.cli import _progress

    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails as if not installed
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert _progress(5, enabled=True) == (None, None)
    assert sys.stderr.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert _progress(5, enabled=True) == (None, None)
    assert "(no progress bar: install tqdm" in sys.stderr.getvalue()


def test_python_dash_m_help():
    env = _child_env()
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", "bench", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for flag in ("--opt-levels", "--frozen-bn", "--no-native", "--channels-last", "--plot"):
        assert flag in proc.stdout


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")


@requires_cuda
@pytest.mark.parametrize("model, dtype", [("cnn", "fp16"), ("gpt", "bf16"), ("gpt", "fp16")])
def test_cuda_run_every_mode(model, dtype, tmp_path):
    path = str(tmp_path / "rows.json")
    extra = ["--frozen-bn"] if model == "cnn" else []
    code, text = _run(
        [
            "bench",
            "--model",
            model,
            "--size",
            "small",
            "--device",
            "cuda",
            "--dtype",
            dtype,
            "--iters",
            "3",
            "--warmup",
            "1",
            "--no-progress",
            "--json",
            path,
            *extra,
        ]
    )
    assert code == 0
    with open(path) as f:
        rows = json.load(f)
    assert [r["mode"] for r in rows] == ALL_MODES
    for r in rows:
        assert r["status"] == "ok", (r["mode"], r["error"])
        assert r["time_per_iter_s"] > 0 and r["peak_memory_mb"] > 0
        assert math.isfinite(r["final_loss"]) and r["skipped_steps"] is not None
        assert r["extra"]["peak_memory_total_mb"] >= r["peak_memory_mb"]
    assert "torch.cuda.max_memory_allocated" in text


# --------------------------------------------------------------------------------------------
# Interruptions, closed pipes, output paths, progress lines, notes (review 19b)
# --------------------------------------------------------------------------------------------
def _interrupt_at(monkeypatch, mode):
    """Make the runner raise KeyboardInterrupt (as Ctrl-C does) when ``mode`` starts."""
    import mixprec.bench.runner as runner

    real = runner.run_mode

    def run_mode(workload, m, **kwargs):
        if m == mode:
            raise KeyboardInterrupt
        return real(workload, m, **kwargs)

    monkeypatch.setattr(runner, "run_mode", run_mode)


def test_ctrl_c_keeps_the_finished_modes_and_exits_130(monkeypatch, tmp_path):
    _interrupt_at(monkeypatch, "O1")
    paths = {k: tmp_path / f"rows.{k}" for k in ("json", "csv", "png")}
    try:
        code, text = _run(["bench", *FAST, "--opt-levels", "O0", "O1", "O2",
                           "--json", str(paths["json"]), "--csv", str(paths["csv"]),
                           "--plot", str(paths["png"])])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main(): the finished modes were thrown away")
    assert code == 130
    rows = _table_rows(text)  # the modes not reached are rows too, saying so
    assert [(r[0], r[-1]) for r in rows] == [
        ("O0", "ok"), ("O1", "not run (interrupted)"), ("O2", "not run (interrupted)"),
        ("autocast", "not run (interrupted)"), (".bfloat16()", "not run (interrupted)")]
    assert rows[1][1:-1] == ["bf16"] + ["-"] * 6
    assert "note: interrupted (Ctrl-C) during O1; did not run: O1, O2, autocast, .bfloat16()." \
        in text
    # The files hold the finished rows, each saying the run is partial and what is missing.
    (row,) = json.loads(paths["json"].read_text())
    assert row["mode"] == "O0" and row["status"] == "ok"
    assert row["run_status"] == "interrupted"
    assert row["modes_not_run"] == ["O1", "O2", "autocast", "half"]
    with open(paths["csv"], newline="") as f:
        (line,) = csv.DictReader(f)
    assert line["mode"] == "O0" and line["run_status"] == "interrupted"
    assert line["modes_not_run"] == "O1 O2 autocast half"
    assert paths["png"].read_bytes()[:8] == PNG_MAGIC


def test_closed_stdout_still_writes_the_files_and_exits_1_quietly(tmp_path):
    # `mixprec bench --json x.json | head -1`: the reader is gone before the table is printed.
    env = _child_env()
    path = tmp_path / "rows.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mixprec", "bench", *FAST, "--iters", "1", "--warmup", "0",
         "--opt-levels", "O0", "--no-native", "--json", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    proc.stdout.close()  # (before the child prints anything)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert [r["mode"] for r in json.loads(path.read_text())] == ["O0"]


@pytest.mark.parametrize(
    "flag, path, message",
    [
        ("--json", "newdir" + os.sep, "it ends with a path separator"),
        ("--plot", "newdir2" + os.sep, "name a file in it, e.g. 'newdir2/bench.png'"),
        ("--csv", "-", "writing to standard output is not supported"),
        ("--json", "-", "(stdout carries the table); give a file name, e.g. rows.json"),
    ],
)
def test_output_paths_that_are_not_files_are_refused(flag, path, message, capsys,
                                                     monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["bench", *FAST, flag, path])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: cannot write {path!r}" in err and message in err
    assert os.listdir(tmp_path) == []  # no file "-", no directory made


def test_output_check_opens_the_file_and_leaves_nothing_behind(capsys, tmp_path):
    # The parent directory could be made, but the file cannot be created in it.
    bad = tmp_path / "new" / "sub" / ("x" * 300 + ".json")
    with pytest.raises(SystemExit) as exc:
        main(["bench", *FAST, "--json", str(bad)])
    assert exc.value.code == 2
    assert "argument --json: cannot write" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # the directories made by the check are gone again
    # A passing check leaves nothing either (here a later flag is the error).
    with pytest.raises(SystemExit):
        main(["bench", *FAST, "--csv", str(tmp_path / "new" / "rows.csv"), "--plot", "p.txt"])
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_output_in_an_unwritable_place_fails_before_the_run(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *FAST, "--json", "/proc/x.json"])
    assert exc.value.code == 2
    assert "argument --json: cannot write '/proc/x.json'" in capsys.readouterr().err


def test_header_comes_first_and_stderr_gets_a_line_per_mode(monkeypatch):
    import mixprec.bench.runner as runner

    out, err = io.StringIO(), io.StringIO()  # stderr is no terminal: no bar
    seen = []
    real = runner.run_mode

    def run_mode(*args, **kwargs):
        seen.append(out.getvalue())
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_mode", run_mode)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["bench", *FAST[:-1], "--opt-levels", "O0", "O1", "--no-native"])
    assert code == 0
    assert "mixprec bench: SmallCNN" in seen[0] and "half type bf16" in seen[0]
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("mixprec bench: [")]
    assert [ln.split(": ok")[0] for ln in lines] == ["mixprec bench: [1/2] O0",
                                                     "mixprec bench: [2/2] O1"], lines


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["--steps", "3"], "; did you mean --iters?"),
        (["--itters=3"], "; did you mean --iters?"),
        (["--epochs", "3"], None),
        (["--itters", "3", "--sed", "1"],
         "; --itters: did you mean --iters?; --sed: did you mean --seed?"),
        # An abbreviation is refused, not read as the option it starts (a script relying on
        # it would break the day another option started with it; r69C's replay).
        (["--iter", "3"], "; did you mean --iters?"),
        (["--no-prog"], "; did you mean --no-progress?"),
    ],
)
def test_unknown_flags_are_bench_errors_with_a_suggestion(argv, suggestion, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mixprec bench ")  # the subcommand's usage, not mixprec's
    assert f"mixprec bench: error: unrecognized arguments: {' '.join(argv)}" in err
    if suggestion:
        assert suggestion in err
    else:
        assert "did you mean" not in err


def test_mixprec_kernels_on_cpu_say_they_were_not_used():
    pytest.importorskip("mixprec.normalization").FusedBatchNorm  # noqa: B018
    code, text = _run(["bench", *FAST, "--iters", "1", "--warmup", "0", "--opt-levels", "O0",
                       "--no-native", "--norm", "mixprec"])
    assert code == 0
    assert "note: FusedBatchNorm ran PyTorch code here, not mixprec's fused kernels" in text
    assert "CUDA only" in text


def test_large_size_on_cpu_warns_before_building(monkeypatch, capsys):
    _stop_at_build(monkeypatch)
    with pytest.raises(SystemExit):
        main(["bench", "--size", "large", "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert "warning: --size large on CPU is slow" in err and "--size small" in err
    assert err.index("warning") < err.index("stopped by the test")
    # The CPU's default size (small), implicit or asked for, runs without it.
    for size in ([], ["--size", "small"]):
        with pytest.raises(SystemExit):
            main(["bench", "--device", "cpu", "--no-progress", *size])
        err = capsys.readouterr().err
        assert "stopped by the test" in err and "warning" not in err


def test_iters_has_an_upper_bound(monkeypatch, capsys):
    _stop_at_build(monkeypatch)  # (should the bound be missing: no two million steps)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--iters", "2000000"])
    assert exc.value.code == 2
    assert "argument --iters: expected a positive integer up to 1,000,000" in \
        capsys.readouterr().err


def test_verbose_logs_a_failed_modes_traceback_and_restores_the_logger(monkeypatch):
    """-v sends mixprec's debug log to stderr for the call (a failed mode's traceback), then
    leaves the "mixprec" logger as it found it: level and handlers."""
    import logging

    import mixprec.bench.runner as runner

    def boom(*args, **kwargs):
        raise RuntimeError("boom (forced by the test)")

    monkeypatch.setattr(runner, "_build_recipe", boom)
    logger = logging.getLogger("mixprec")
    level, handlers = logger.level, list(logger.handlers)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code, _ = _run(["bench", *ONE_MODE, "-v"])
    assert code == 1
    assert "DEBUG mixprec.bench.runner: mode O0 failed" in err.getvalue()
    assert "Traceback" in err.getvalue() and "boom (forced by the test)" in err.getvalue()
    assert logger.level == level and logger.handlers == handlers


def test_failed_mode_note_under_verbose_does_not_ask_for_verbose(monkeypatch, capsys):
    import mixprec.bench.runner as runner

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(runner, "_build_recipe", boom)
    code = main(["bench", *FAST, "--opt-levels", "O0", "--no-native", "-v"])
    assert code == 1
    out = capsys.readouterr().out
    assert "run with -v" not in out and "failed modes: their tracebacks are" in out


# --------------------------------------------------------------------------------------------
# --opt-levels forms, --batch-size bound, ~ in paths
# --------------------------------------------------------------------------------------------
def _parsed(*argv):
    from mixprec.bench.cli import build_parser

    return build_parser().parse_args(["bench", *argv])


def test_opt_levels_repeated_add_up_and_lower_case_reads_as_the_letter_o():
    # "store" kept only the last --opt-levels: O0 (the baseline) was silently not run.
    assert _parsed("--opt-levels", "O0", "--opt-levels", "O2", "O3").opt_levels == \
        ["O0", "O2", "O3"]
    assert _parsed("--opt-levels", "o1", "O2").opt_levels == ["O1", "O2"]
    assert _parsed().opt_levels is None  # (all four: see the next test)


def test_repeated_opt_levels_run_each_once_in_order():
    code, text = _run(["bench", *FAST, "--iters", "1", "--warmup", "0", "--no-native",
                       "--opt-levels", "O1", "--opt-levels", "O0", "o1"])
    assert code == 0
    assert [r[0] for r in _table_rows(text)] == ["O0", "O1"]


@pytest.mark.parametrize("argv, message", [
    (["--opt-levels", "01"],
     "argument --opt-levels: invalid choice: '01' (choose from O0, O1, O2, O3); did you mean "
     "O1? The prefix is the letter O, not the digit zero"),
    (["--opt-levels", "O4"], "argument --opt-levels: invalid choice: 'O4' (choose from"),
    (["--opt-levels"], "argument --opt-levels: expected at least one argument"),
    # fp32 is no half type, and its run is there anyway: the message says where (r69C).
    (["--dtype", "float32"],
     "argument --dtype: invalid choice: 'float32' (choose from fp16, bf16): --dtype is the half "
     "type; the fp32 run is always there, as the O0 row (--opt-levels O0 --no-native runs it "
     "alone)"),
    # Past int64 torch raised a TypeError traceback while making the batches.
    (["--batch-size", str(10**22)],
     "argument --batch-size: expected a positive integer up to 2,147,483,647, got " + "1" +
     "0" * 22),
])
def test_more_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_tilde_in_an_output_path_is_the_home_directory(monkeypatch, tmp_path):
    # --json=~/x.json reaches the program unexpanded; it made a directory named "~" here.
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    code, text = _run(["bench", *FAST, "--iters", "1", "--warmup", "0", "--opt-levels", "O0",
                       "--no-native", "--json=~/out/rows.json"])
    assert code == 0
    assert os.listdir(work) == []
    assert [r["mode"] for r in json.loads((home / "out" / "rows.json").read_text())] == ["O0"]


def test_ctrl_c_before_any_mode_finished_empties_the_files_of_an_earlier_run(monkeypatch,
                                                                             tmp_path):
    # Left as they were, an earlier whole run's rows (run_status "complete") passed for this
    # run's result.
    paths = {k: tmp_path / f"rows.{k}" for k in ("json", "csv")}
    argv = ["bench", *FAST, "--iters", "1", "--warmup", "0", "--opt-levels", "O0",
            "--no-native", "--json", str(paths["json"]), "--csv", str(paths["csv"])]
    assert _run(argv)[0] == 0
    assert json.loads(paths["json"].read_text())[0]["run_status"] == "complete"
    _interrupt_at(monkeypatch, "O0")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code, text = _run([*argv, "--plot", str(tmp_path / "p.png")])
    assert code == 130
    assert [(r[0], r[-1]) for r in _table_rows(text)] == [("O0", "not run (interrupted)")]
    assert json.loads(paths["json"].read_text()) == []
    assert f"wrote {paths['json']} (no rows: no mode finished)" in text
    with open(paths["csv"], newline="") as f:
        reader = csv.DictReader(f)
        assert list(reader) == [] and "run_status" in reader.fieldnames
    assert f"did not write {tmp_path / 'p.png'}: no mode finished" in err.getvalue()
    assert not (tmp_path / "p.png").exists()


def test_a_device_type_the_benchmark_does_not_run_on_is_an_argparse_error(capsys):
    # torch knows "meta" (and mps, xpu, ...), the benchmark runs on cpu and cuda only.
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--device", "meta", "--no-progress"])
    assert exc.value.code == 2
    assert "argument --device: 'meta' is not supported by the benchmark; use cpu, cuda" in \
        capsys.readouterr().err


def test_output_check_keeps_an_existing_file_when_the_run_stops_early(capsys, monkeypatch,
                                                                     tmp_path):
    # The writability check opens an existing output for appending and leaves it as it was:
    # an argument error found after it (here --plot's extension) must not delete the file.
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "rows.json"
    path.write_text('[{"mode": "O0"}]\n')  # an earlier run's result
    with pytest.raises(SystemExit) as exc:
        main(["bench", *FAST, "--json", str(path), "--plot", "p.txt"])
    assert exc.value.code == 2
    assert "argument --plot" in capsys.readouterr().err
    assert path.read_text() == '[{"mode": "O0"}]\n'
    assert sorted(os.listdir(tmp_path)) == ["rows.json"]


def test_memory_error_while_making_the_batches_names_the_option(monkeypatch, capsys):
    # Python's own MemoryError (an empty message) is "does not fit in memory" too, not an
    # empty "mixprec bench: error:" line.
    from mixprec.bench import models

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(models, "_image_batches", no_memory)
    with pytest.raises(SystemExit) as exc:
        main(["bench", *FAST[:4], "--device", "cpu", "--batch-size", "100000000",
              "--no-progress"])
    assert exc.value.code == 2
    assert "argument --batch-size: the synthetic data for --model cnn at --batch-size " \
        "100000000 does not fit in memory on cpu (MemoryError); use a smaller --batch-size" \
        in capsys.readouterr().err


def test_a_failed_o0_row_notes_that_no_ratios_are_available(monkeypatch):
    from mixprec import amp

    real = amp.initialize

    def flaky_initialize(*args, **kwargs):
        if kwargs.get("opt_level") == "O0":
            raise RuntimeError("O0 broken (forced by the test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(amp, "initialize", flaky_initialize)
    code, text = _run(["bench", *FAST, "--iters", "1", "--warmup", "0", "--opt-levels", "O0",
                       "O1", "--no-native"])
    assert code == 0
    rows = {r[0]: r for r in _table_rows(text)}
    assert rows["O0"][-1].startswith("FAILED: RuntimeError: O0 broken")
    assert rows["O1"][-1] == "ok" and rows["O1"][4] == "-" and rows["O1"][6] == "-"
    assert "note: no successful O0 row: speed-up and loss gap are not available." in text


def test_ctrl_c_after_the_last_mode_keeps_a_complete_result(monkeypatch, tmp_path):
    # Every mode asked for ran: the rows say "complete" (run_status tells a partial result
    # from a whole one), though the exit status is still Ctrl-C's.
    import mixprec.bench.runner as runner

    real = runner.run_modes

    def run_modes(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt  # Ctrl-C once the last mode had finished

    monkeypatch.setattr(runner, "run_modes", run_modes)
    path = tmp_path / "rows.json"
    code, text = _run(["bench", *FAST, "--iters", "1", "--warmup", "0", "--opt-levels", "O0",
                       "--no-native", "--json", str(path)])
    assert code == 130
    assert "note: interrupted (Ctrl-C) after the last mode." in text
    (row,) = json.loads(path.read_text())
    assert row["status"] == "ok"
    assert row["run_status"] == "complete" and row["modes_not_run"] == []


def test_stderr_line_per_mode_gives_its_time_per_40_iterations(tmp_path):
    path = tmp_path / "rows.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["bench", *FAST, "--opt-levels", "O0", "--no-native", "--json", str(path)])
    assert code == 0
    (row,) = json.loads(path.read_text())
    (line,) = [ln for ln in err.getvalue().splitlines() if ln.startswith("mixprec bench: [")]
    # The same number as the table's "s / 40 it" column: 40 x the median step time.
    assert line == f"mixprec bench: [1/1] O0: ok, {40 * row['time_per_iter_s']:.3f} s / 40 it"


def test_stderr_line_of_a_diverged_mode_says_so():
    from mixprec.bench.cli import _mode_line
    from mixprec.bench.runner import ModeResult

    def row(loss):
        return ModeResult(mode="O3", label="O3", dtype="fp16", time_per_iter_s=0.01,
                          final_loss=loss)

    assert _mode_line(row(1.0), 1, 2) == "mixprec bench: [1/2] O3: ok, 0.400 s / 40 it"
    assert _mode_line(row(float("nan")), 2, 2) == \
        "mixprec bench: [2/2] O3: ok, 0.400 s / 40 it, loss not finite (diverged)"


def _cli(args, **popen):
    """``python -m mixprec bench`` in a child process: (returncode, stderr text)."""
    env = _child_env()
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.run([sys.executable, "-m", "mixprec", "bench", *args], env=env,
                          timeout=120, **popen)
    return proc.returncode, (proc.stderr or b"").decode()


ONE_MODE = [*FAST, "--iters", "1", "--warmup", "0", "--opt-levels", "O0", "--no-native"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_full_disk_under_stdout_or_stderr_does_not_lose_the_files(stream, tmp_path):
    # A write that fails with ENOSPC (or EIO: a terminal gone) was only caught for a closed
    # pipe: the run died with a traceback and wrote no file. stdout failing exits 1 (the
    # table was lost); stderr failing loses only progress lines: 0.
    path = tmp_path / "rows.json"
    with open("/dev/full", "wb") as full:
        code, err = _cli([*ONE_MODE, "--json", str(path)], **{stream: full})
    assert code == (1 if stream == "stdout" else 0), err
    assert "Traceback" not in err
    assert [r["mode"] for r in json.loads(path.read_text())] == ["O0"]
    # Why the exit status is 1, on stderr (it exited 1 saying nothing: r105A R4).
    assert ("mixprec bench: could not write to stdout: [Errno 28] No space left on device"
            in err) == (stream == "stdout"), err


def test_started_with_stdout_closed_still_writes_the_files(tmp_path):
    # `mixprec bench ... >&-`: sys.stdout is None in the process; the run failed at its first
    # print with AttributeError and wrote nothing.
    path = tmp_path / "rows.json"
    code, err = _cli([*ONE_MODE, "--json", str(path)], stdout=None,
                     preexec_fn=lambda: os.close(1))
    assert code == 1 and "Traceback" not in err, err
    assert [r["mode"] for r in json.loads(path.read_text())] == ["O0"]


def test_an_output_path_that_is_stdout_is_refused(tmp_path):
    # `--json /dev/stdout` passed the "not '-'" check: the file, opened for writing, truncated
    # what stdout had written and the JSON came out mixed with the table.
    with open(tmp_path / "out.txt", "wb") as out:
        code, err = _cli([*ONE_MODE, "--json", "/dev/stdout"], stdout=out)
    assert code == 2
    assert "argument --json: cannot write '/dev/stdout': it is where the standard output goes" \
        in err
    assert (tmp_path / "out.txt").read_bytes() == b""


def test_main_runs_outside_the_main_thread(tmp_path):
    """main() called from a worker thread (a notebook's background job, a test runner's
    thread) runs the benchmark: signal handlers can be set from the main thread only, so
    there it sets none."""
    import threading

    path = tmp_path / "rows.json"
    result = {}

    def target():
        try:
            result["code"] = main(["bench", *ONE_MODE, "--json", str(path)])
        except BaseException as exc:  # (reported below, not lost in the thread)
            result["error"] = exc

    with contextlib.redirect_stdout(io.StringIO()):
        worker = threading.Thread(target=target)
        worker.start()
        worker.join(timeout=120)
    assert result == {"code": 0}
    assert [r["mode"] for r in json.loads(path.read_text())] == ["O0"]


def test_sigterm_stops_the_run_as_ctrl_c_does(monkeypatch, tmp_path):
    # `timeout`, `kill`, a cancelled CI job: the run stopped with no file written, so an
    # earlier run's JSON passed for this one's. Now the finished modes are printed and
    # written, and the exit status is 128 + 15.
    import signal

    import mixprec.bench.runner as runner

    real = runner.run_mode

    def run_mode(workload, m, **kwargs):
        if m == "O1":
            os.kill(os.getpid(), signal.SIGTERM)
        return real(workload, m, **kwargs)

    monkeypatch.setattr(runner, "run_mode", run_mode)
    path = tmp_path / "rows.json"
    path.write_text('["an earlier run"]')
    before = signal.getsignal(signal.SIGTERM)
    code, text = _run(["bench", *FAST, "--opt-levels", "O0", "O1", "--no-native",
                       "--json", str(path)])
    assert code == 128 + signal.SIGTERM
    assert "note: interrupted (SIGTERM) during O1; did not run: O1." in text
    (row,) = json.loads(path.read_text())
    assert row["mode"] == "O0" and row["run_status"] == "interrupted"
    assert signal.getsignal(signal.SIGTERM) is before  # the handler before is put back


def test_argument_spellings_users_reach_for(capsys):
    # torch's dtype names and capitals are read as the short names; a comma-separated list
    # of levels gets the fix, not a bare "invalid choice".
    args = _parsed("--dtype", "BFloat16", "--model", "CNN")
    assert (args.dtype, args.model) == ("bf16", "cnn")
    assert _parsed("--dtype", "float16").dtype == "fp16"
    with pytest.raises(SystemExit):
        _parsed("--opt-levels", "O1,O2")
    assert "separate the levels with spaces, e.g. --opt-levels O1 O2" in capsys.readouterr().err


def test_no_o0_asked_for_is_not_reported_as_a_failed_o0():
    code, text = _run(["bench", *FAST, "--iters", "1", "--warmup", "0", "--opt-levels", "O1",
                       "--no-native"])
    assert code == 0
    assert "no successful O0 row" not in text
    assert "note: speed-up and loss gap are against O0, which was not asked for" in text


# -- mutation run r50D over mixprec/bench/cli.py: what the tests above let through ----------

# C02: `value > maximum` -> `>=`;  C03: the seed's lower end -(2**63) refused
def test_the_ends_of_each_numeric_range_are_accepted():
    args = _parsed("--iters", "1000000", "--warmup", "1000000", "--batch-size",
                   str(2**31 - 1), "--seed", str(2**64 - 1))
    assert (args.iters, args.warmup, args.batch_size, args.seed) == (
        10**6, 10**6, 2**31 - 1, 2**64 - 1)
    assert _parsed("--seed", str(-(2**63))).seed == -(2**63)
    assert (_parsed("--iters", "1").iters, _parsed("--warmup", "0").warmup) == (1, 0)


# C05: `level[1] in "0123"` -> "012" (only 00..02 got the "letter O" hint)
@pytest.mark.parametrize("digit", "0123")
def test_every_digit_zero_level_gets_the_letter_o_hint(digit, capsys):
    with pytest.raises(SystemExit) as exc:
        _parsed("--opt-levels", f"0{digit}")
    assert exc.value.code == 2
    assert f"did you mean O{digit}? The prefix is the letter O" in capsys.readouterr().err


# C08: `_int_in(1, ...)` -> `_int_in(0, ...)` for --batch-size (a batch of 0 accepted)
def test_a_zero_batch_size_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        _parsed("--batch-size", "0")
    assert exc.value.code == 2
    assert "argument --batch-size: expected a positive integer" in capsys.readouterr().err


# C10: "half" dropped from the --dtype spellings (torch.half's name)
def test_dtype_half_reads_as_fp16():
    assert [_parsed("--dtype", name).dtype for name in ("half", "HALF", "fp16", "bfloat16")] == \
        ["fp16", "fp16", "fp16", "bf16"]
    assert _parsed("--dtype", " bf16 ").dtype == "bf16"  # (blanks, as the named choices)


def test_dtype_fp16_runs_fp16_on_the_cpu(tmp_path):
    """--dtype picks the half type on the CPU too (its default there is bf16): O1 then runs
    fp16, as the header says."""
    path = tmp_path / "rows.json"
    code, text = _run(["bench", *FAST, "--iters", "1", "--warmup", "0", "--opt-levels", "O1",
                       "--no-native", "--dtype", "fp16", "--json", str(path)])
    assert code == 0
    assert "half type fp16" in text
    (row,) = json.loads(path.read_text())
    assert row["mode"] == "O1" and row["dtype"] == "fp16"


def test_named_choices_take_any_case():
    # --model and --dtype took "GPT" and "BF16"; --size, --norm and --optimizer refused
    # "Large", "MixPrec" (one rule for every flag that names a choice).
    args = _parsed("--model", "GPT", "--size", "Large", "--norm", "MixPrec", "--optimizer",
                   " TORCH ")
    assert (args.model, args.size, args.norm, args.optimizer) == ("gpt", "large", "mixprec",
                                                                  "torch")


def test_device_takes_any_case(tmp_path):
    # "--device CPU" was refused as an invalid device: torch's device names are lower case.
    path = tmp_path / "rows.json"
    code, _ = _run(["bench", *FAST[:6], "--device", " CPU ", "--no-progress", "--opt-levels",
                    "O0", "--no-native", "--iters", "1", "--warmup", "0", "--json", str(path)])
    assert code == 0
    assert [r["device"] for r in json.loads(path.read_text())] == ["cpu"]


# C12: --iters default 40 -> 4;  C15: --seed default 0 -> 1
def test_defaults():
    args = _parsed()
    assert (args.model, args.size, args.opt_levels, args.dtype, args.iters, args.warmup,
            args.batch_size, args.seed, args.device) == (
        "cnn", None, None, None, 40, None, None, 0, None)
    assert (args.native, args.norm, args.optimizer, args.channels_last, args.frozen_bn) == (
        True, "torch", "torch", False, False)


# C31: `not path.strip()` -> `not path` (a path of blanks accepted)
def test_an_output_path_of_blanks_is_an_argparse_error(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["bench", *ONE_MODE, "--json", "  "])
    assert exc.value.code == 2
    assert "argument --json: expected a file path, got '  '" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


# C32: realpath -> abspath (two outputs naming one file through a symlink)
def test_two_outputs_that_are_one_file_through_a_link_are_refused(capsys, tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(SystemExit) as exc:
        main(["bench", *ONE_MODE, "--json", str(tmp_path / "real" / "rows.out"),
              "--csv", str(tmp_path / "link" / "rows.out")])
    assert exc.value.code == 2
    assert "arguments --json and --csv: both name" in capsys.readouterr().err


# C21: the os.devnull exception dropped (`--json /dev/null` refused when stdout is /dev/null)
# C22: stderr dropped from the streams checked (`--json /dev/stderr` accepted)
def test_output_paths_that_are_the_null_device_or_stderr(monkeypatch, tmp_path):
    from mixprec.bench.cli import _unwritable

    with open(os.devnull, "w") as null:
        monkeypatch.setattr(sys, "stdout", null)  # `mixprec bench --json /dev/null >/dev/null`
        assert _unwritable(os.devnull, "rows.json") is None
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        monkeypatch.setattr(sys, "stderr", f)  # `2>log.txt --json log.txt`
        problem = _unwritable(str(log), "rows.json")
    assert problem and problem.startswith("it is where the standard error goes")
    assert "progress lines" in problem


# C29: the CPU's default warm-up 3 -> 2;  C42: the note's window left out the warm-up steps
def test_default_cpu_warm_up_and_the_final_loss_window(tmp_path):
    path = tmp_path / "rows.json"
    argv = ["bench", *FAST, "--opt-levels", "O0", "--no-native", "--json", str(path)]
    argv.remove("--warmup")
    argv.remove("1")
    code, text = _run(argv)
    assert code == 0
    assert "3 warm-up + 2 timed iterations per mode" in text
    # 5 steps over the 4-batch pool: the mean of the last 4, as the runner computes it.
    assert ("final loss = mean over the last 4 steps (one pass over the 4-batch pool; an inf "
            "or NaN loss left out).") in text
    (row,) = json.loads(path.read_text())
    assert row["final_loss"] == pytest.approx(sum(row["losses"][-4:]) / 4)
    code, text = _run(["bench", *FAST, "--opt-levels", "O0", "--no-native"])  # 1 + 2 steps
    assert ("mean over the last 3 steps (every step run, 3 of the 4 batches; an inf or NaN "
            "loss left out).") in text


# C36: " or --size small" suggested for the small size instead of the large one
@pytest.mark.parametrize("size", ["small", "large"])
def test_batch_too_large_suggests_the_small_size_only_at_the_large_one(size, monkeypatch,
                                                                          capsys):
    from mixprec.bench import models

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(models, "_image_batches", no_memory)
    with pytest.raises(SystemExit):
        main(["bench", "--device", "cpu", "--size", size, "--no-progress"])
    err = capsys.readouterr().err
    assert "use a smaller --batch-size" in err
    assert ("use a smaller --batch-size or --size small" in err) == (size == "large")


# C75: `splitlines()[-1]` -> `[0]` (the allocator's first line instead of its message)
def test_batch_too_large_quotes_the_last_line_of_the_error(monkeypatch, capsys):
    from mixprec.bench import models

    def no_memory(*args, **kwargs):
        raise RuntimeError("Exception raised from alloc_cpu at alloc_cpu.cpp:127\n"
                           "DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                           "3 bytes.")

    monkeypatch.setattr(models, "_image_batches", no_memory)
    with pytest.raises(SystemExit):
        main(["bench", *ONE_MODE])
    err = capsys.readouterr().err
    assert "(DefaultCPUAllocator: can't allocate memory" in err and "alloc_cpu.cpp" not in err


# C47: meta channels_last always False (the test also covers the header's ", channels_last" and
# meta frozen_bn, whose mutants were not run)
def test_channels_last_and_frozen_bn_are_in_the_header_and_the_files(tmp_path):
    path = tmp_path / "rows.csv"
    code, text = _run(["bench", *ONE_MODE, "--channels-last", "--frozen-bn", "--csv", str(path)])
    assert code == 0
    assert ", channels_last, BatchNorm frozen (eval)" in text.splitlines()[1]
    with open(path, newline="") as f:
        (row,) = csv.DictReader(f)
    assert (row["channels_last"], row["frozen_bn"]) == ("True", "True")
    code, text = _run(["bench", *ONE_MODE])
    assert "channels_last" not in text.splitlines()[1]


# C54: an ignored SIGHUP (nohup) got the stop handler during the run
@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="needs SIGHUP")
def test_an_ignored_sighup_stays_ignored_during_the_run(monkeypatch):
    import mixprec.bench.runner as runner

    seen = []
    real = runner.run_mode

    def run_mode(*args, **kwargs):
        seen.append((signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGTERM)))
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_mode", run_mode)
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        code, _ = _run(["bench", *ONE_MODE])
    finally:
        signal.signal(signal.SIGHUP, before)
    assert code == 0
    ((hup, term),) = seen
    assert hup is signal.SIG_IGN and callable(term)  # (SIGTERM still stops the run)


# C58: an interrupt before any mode ran exited 1 instead of 128 + the signal
@pytest.mark.parametrize("exc, code, said", [
    (KeyboardInterrupt(), 130, "mixprec bench: interrupted\n"),
    ("SIGTERM", 128 + 15, "mixprec bench: interrupted (SIGTERM)\n"),
])
def test_interrupted_before_the_modes_exits_with_the_signals_status(exc, code, said,
                                                                   monkeypatch, capsys):
    from mixprec.bench import cli, models

    if exc == "SIGTERM":
        exc = cli._Stopped(signal.SIGTERM)

    def stop(*args, **kwargs):
        raise exc

    monkeypatch.setattr(models, "build_workload", stop)
    assert main(["bench", *ONE_MODE]) == code
    assert capsys.readouterr().err.endswith(said)


# C64: the CPU note named FusedBatchNorm for --model gpt;  C65: FusedAdam left out of it
def test_cpu_note_names_the_mixprec_layers_that_ran_pytorch_code():
    pytest.importorskip("mixprec.normalization").FusedLayerNorm  # noqa: B018
    code, text = _run(["bench", "--model", "gpt", *ONE_MODE, "--norm", "mixprec",
                       "--optimizer", "mixprec"])
    assert code == 0
    assert "note: FusedLayerNorm and FusedAdam ran PyTorch code here, not mixprec's fused " \
        "kernels" in text


# The check of an output path leaves nothing behind for a dangling symbolic link (it created
# the link's target, which stayed when a later argument was refused).
def test_output_check_leaves_nothing_behind_for_a_dangling_link(capsys, tmp_path):
    os.symlink(tmp_path / "target.json", tmp_path / "rows.json")
    with pytest.raises(SystemExit) as exc:
        main(["bench", *ONE_MODE, "--json", str(tmp_path / "rows.json"), "--plot", "p.txt"])
    assert exc.value.code == 2 and "argument --plot" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["rows.json"]  # (not target.json too)


# -- mutation run r56B over cli.py and report.py: what the tests above let through ---------


def _seeded_first_loss(seed, frozen_bn=False):
    """The loss the CLI's first O0 step must report for --seed ``seed`` (FAST's batch of 4):
    the model seeded with ``seed`` on the first batch generated with ``seed``, before any
    update, in training mode (BatchNorm in eval mode for --frozen-bn)."""
    wl = build_workload("cnn", batch_size=4, seed=seed)
    torch.manual_seed(seed)
    model = wl.build_model().train()
    if frozen_bn:
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.eval()
    x, y = wl.batches[0]
    with torch.no_grad():
        return wl.loss_fn(model(x), y).item()


def test_seed_sets_both_the_initial_weights_and_the_data(tmp_path):
    """--seed N makes a run repeatable from N alone: it seeds the initial weights and the
    synthetic batches, so O0's first loss is that of the model seeded with N on the first
    batch generated with N (and not that of seed 0). (M19, M20)"""
    path = tmp_path / "rows.json"
    code, _ = _run(["bench", *ONE_MODE, "--seed", "7", "--json", str(path)])
    assert code == 0
    (row,) = json.loads(path.read_text())
    assert row["seed"] == 7
    want = _seeded_first_loss(7)
    assert row["losses"][0] == pytest.approx(want, rel=1e-6, abs=0)
    assert want != pytest.approx(_seeded_first_loss(0), rel=1e-3)


def test_a_run_repeated_with_its_seed_repeats_every_loss(tmp_path):
    """Two runs with one --seed in one process give every mode's losses bit for bit, fp16
    included (amp's loss scaler and patched functions keep no state from the first run into
    the second), and another seed gives other losses: users compare runs of one seed across
    code changes and attribute any difference to the change. (r69C replay)"""
    argv = ["bench", *FAST, "--iters", "1", "--dtype", "fp16", "--seed", "5", "--opt-levels",
            "O1", "O2"]
    runs = []
    for name in ("a.json", "b.json"):
        code, _ = _run([*argv, "--json", str(tmp_path / name)])
        assert code == 0
        runs.append(json.loads((tmp_path / name).read_text()))
    first, second = runs
    assert [r["mode"] for r in first] == [r["mode"] for r in second] == [
        "O1", "O2", "autocast", "half"]
    for a, b in zip(first, second):
        assert a["losses"] == b["losses"], a["mode"]
        assert a["skipped_steps"] == b["skipped_steps"], a["mode"]
    code, text = _run(["bench", *FAST, "--iters", "1", "--dtype", "fp16", "--seed", "6",
                       "--opt-levels", "O1", "--no-native", "--json", str(tmp_path / "c.json")])
    assert code == 0
    assert "1 warm-up + 1 timed iteration per mode, seed 6" in text  # (one: no plural)
    (other,) = json.loads((tmp_path / "c.json").read_text())
    assert other["losses"][0] != pytest.approx(first[0]["losses"][0], rel=1e-3)


def test_frozen_bn_trains_with_batchnorm_in_eval_mode(tmp_path):
    """--frozen-bn is the fine-tuning case: every mode trains with its BatchNorm layers
    normalising by their running statistics (eval mode), not just a word in the header and
    the files; O0's first loss is that of the seeded model with BatchNorm in eval mode. (M17)"""
    path = tmp_path / "rows.json"
    code, _ = _run(["bench", *ONE_MODE, "--frozen-bn", "--json", str(path)])
    assert code == 0
    (row,) = json.loads(path.read_text())
    want = _seeded_first_loss(0, frozen_bn=True)
    assert row["frozen_bn"] is True
    assert row["losses"][0] == pytest.approx(want, rel=1e-6, abs=0)
    assert want != pytest.approx(_seeded_first_loss(0), rel=1e-3)


def test_layout_batchnorm_and_seed_flags_reach_every_mode(monkeypatch):
    """--channels-last, --frozen-bn and --seed are applied to every mode run (amp's and
    PyTorch's alike), as the header and the files say they were. (M17, M18, M19)"""
    import mixprec.bench.runner as runner

    seen = []
    real = runner.run_mode

    def run_mode(workload, mode, **kwargs):
        seen.append((mode, kwargs.get("channels_last"), kwargs.get("frozen_bn"),
                     kwargs.get("seed")))
        return real(workload, mode, **kwargs)

    monkeypatch.setattr(runner, "run_mode", run_mode)
    code, text = _run(["bench", *FAST, "--iters", "1", "--warmup", "0", "--opt-levels", "O0",
                       "O2", "--channels-last", "--frozen-bn", "--seed", "3"])
    assert code == 0, text
    assert seen == [(m, True, True, 3) for m in ("O0", "O2", "autocast", "half")]


def test_files_name_the_size_and_batch_size_a_default_run_used(tmp_path):
    """Without --size and --batch-size each row records the size and the batch the run used
    (on the CPU: small, and that size's batch), not the absent flags, so that rows of runs on
    different machines (whose defaults differ) can be told apart. (M21, M22)"""
    path = tmp_path / "rows.json"
    code, _ = _run(["bench", "--iters", "1", "--warmup", "0", "--device", "cpu",
                    "--no-progress", "--opt-levels", "O0", "--no-native", "--json", str(path)])
    assert code == 0
    (row,) = json.loads(path.read_text())
    assert row["size"] == "small"
    assert row["batch_size"] == build_workload("cnn", size="small").batch_size == 16


def test_progress_bar_ends_at_its_total(monkeypatch):
    """The bar counts every step of every mode, warm-up included: its total is the number of
    times it is advanced, so it ends full instead of overrunning. (M24)"""
    pytest.importorskip("tqdm")
    import mixprec.bench.cli as cli

    monkeypatch.setattr(sys, "stderr", _Terminal())  # the bar shows on terminals only
    bars = []
    real = cli._progress

    def progress(*args, **kwargs):
        bar, step = real(*args, **kwargs)
        bars.append(bar)
        return bar, step

    monkeypatch.setattr(cli, "_progress", progress)
    code, _ = _run(["bench", *FAST[:-1], "--opt-levels", "O0", "O1", "--no-native"])
    assert code == 0
    (bar,) = bars
    assert bar.total == bar.n == 2 * (1 + 2)  # 2 modes x (1 warm-up + 2 timed steps)


def test_stderr_line_keeps_a_failure_reason_of_100_characters_whole():
    """The per-mode stderr line shows a failure reason of up to 100 characters whole and cuts
    a longer one to 97 plus "..."; a multi-line error shows its first line, a failure without
    a message "unknown error". (M25)"""
    reason = "RuntimeError: " + "x" * 86
    assert len(reason) == 100
    row = ModeResult(mode="O2", label="O2", dtype="bf16", status="failed", error=reason)
    assert _mode_line(row, 1, 2) == f"mixprec bench: [1/2] O2: FAILED: {reason}"
    row.error = reason + "y"
    assert _mode_line(row, 1, 2) == f"mixprec bench: [1/2] O2: FAILED: {reason[:97]}..."
    # It stays one line (a multi-line error's first) and never empty. (r64C's C05, C06)
    row.error = "RuntimeError: first line\nsecond line"
    assert _mode_line(row, 1, 2) == "mixprec bench: [1/2] O2: FAILED: RuntimeError: first line"
    row.error = None
    assert _mode_line(row, 2, 2) == "mixprec bench: [2/2] O2: FAILED: unknown error"


def test_a_run_whose_modes_all_diverged_exits_0(monkeypatch):
    """A mode that ran to the end with a non-finite loss (pure fp16 with Adam) is a result,
    shown as diverged, not a failure: the exit status is 0 as main() documents ("at least one
    mode ran"), so a script tells it from a crash. (M26)"""
    import mixprec.bench.runner as runner

    real = runner.run_mode

    def diverging(*args, **kwargs):
        row = real(*args, **kwargs)
        return dataclasses.replace(row, final_loss=float("nan"))

    monkeypatch.setattr(runner, "run_mode", diverging)
    code, text = _run(["bench", *ONE_MODE])
    assert code == 0
    assert [r[-1] for r in _table_rows(text)] == ["ok, loss not finite (diverged)"]


# -- mutation run r64C over cli.py: what the tests above let through -----------------------


def _with_spread(monkeypatch, iqr_of_median):
    """Make every mode's timed steps report an interquartile range of ``iqr_of_median`` x
    their median (the runner's real spread depends on the machine's load)."""
    import mixprec.bench.runner as runner

    real = runner.run_mode

    def run_mode(*args, **kwargs):
        row = real(*args, **kwargs)
        row.time_per_iter_iqr_s = iqr_of_median * row.time_per_iter_s
        return row

    monkeypatch.setattr(runner, "run_mode", run_mode)


def test_unsteady_timing_is_noted_under_the_table(monkeypatch):
    """A mode whose step times varied widely (IQR over a quarter of the median) is named in a
    note under the table, so a reader does not trust its speed-up; steady timing gets no such
    note. (C01)"""
    _with_spread(monkeypatch, 0.5)
    code, text = _run(["bench", *ONE_MODE])
    assert code == 0
    assert "note: unsteady timing: the step times of O0 varied by more than 25% of their " \
        "median" in text
    _with_spread(monkeypatch, 0.0)
    code, text = _run(["bench", *ONE_MODE])
    assert code == 0 and "unsteady timing" not in text


def test_a_run_of_one_timed_step_says_its_time_is_rough(tmp_path):
    """One timed step per mode is one sample of a noisy time: the table says the speed-ups
    are rough and the JSON's spread is null (unknown), not 0.0 (perfectly steady); a run of
    five steps gets no such note."""
    path = tmp_path / "rows.json"
    code, text = _run(["bench", *ONE_MODE, "--json", str(path)])
    assert code == 0
    assert "note: only 1 timed step per mode: too few to time reliably" in text
    (row,) = json.loads(path.read_text())
    assert row["time_per_iter_iqr_s"] is None and row["iters"] == 1
    code, text = _run(["bench", *FAST, "--iters", "5", "--warmup", "0", "--opt-levels", "O0",
                       "--no-native"])
    assert code == 0 and "too few to time" not in text


def test_files_and_header_describe_the_workload_that_ran(tmp_path):
    """The header and each row's "description" name the workload as built (model, sizes,
    batch), the same text in both, so a file read later says what was measured, not only the
    --model flag. (C02)"""
    path = tmp_path / "rows.json"
    code, text = _run(["bench", *ONE_MODE, "--json", str(path)])
    assert code == 0
    want = build_workload("cnn", batch_size=4).description
    assert text.splitlines()[0] == f"mixprec bench: {want}"
    (row,) = json.loads(path.read_text())
    assert row["description"] == want and row["description"] != "cnn"


def test_the_plot_is_titled_with_the_workload_device_and_half_type(monkeypatch, tmp_path):
    """The figure's title says what ran where: the workload's description, the device's name
    and the half type, as the table's header does. (C03)"""
    import mixprec.bench.report as report

    titles = []
    monkeypatch.setattr(report, "write_plot",
                        lambda results, path, title="": titles.append(title))
    code, _ = _run(["bench", *ONE_MODE, "--plot", str(tmp_path / "p.png")])
    assert code == 0
    want = build_workload("cnn", batch_size=4).description
    assert titles == [f"mixprec bench: {want} on CPU, bf16"]


def test_opt_levels_take_blanks_around_a_level_as_the_other_choices_do():
    """--opt-levels reads " O1 " as O1, as --model, --size, --norm and --dtype ignore blanks
    around their choice (a quoted list pasted from a config). (C04)"""
    assert _parsed("--opt-levels", " O1 ", "o2 ").opt_levels == ["O1", "O2"]


def test_started_with_stderr_closed_keeps_the_progress_lines_out_of_stdout(monkeypatch,
                                                                          tmp_path):
    """With stderr closed (sys.stderr is None: `2>&-`) the per-mode lines are dropped, not
    printed to stdout, where they would mix with the table; the run still writes its files and
    exits 0. (C08)"""
    monkeypatch.setattr(sys, "stderr", None)
    path = tmp_path / "rows.json"
    code, text = _run(["bench", *ONE_MODE, "--json", str(path)])
    assert code == 0
    assert "mixprec bench: [1/1]" not in text
    assert [r["mode"] for r in json.loads(path.read_text())] == ["O0"]


def test_a_run_interrupted_before_any_mode_finished_notes_only_the_interruption(monkeypatch):
    """With no row finished there is no O0 row to miss: the notes say the run was interrupted
    and not that O0 failed (the no-O0 note is about finished rows). (C15)"""
    _interrupt_at(monkeypatch, "O0")
    code, text = _run(["bench", *ONE_MODE])
    assert code == 130
    assert "note: interrupted (Ctrl-C) during O0; did not run: O0." in text
    assert "no successful O0 row" not in text


def test_one_failed_mode_among_ok_ones_gets_the_traceback_note(monkeypatch):
    """A run where some modes failed and others ran tells the reader where the failures'
    tracebacks are (run with -v), not only a run where every mode failed. (C11)"""
    import mixprec.bench.runner as runner

    real = runner._build_recipe

    def build_recipe(workload, mode, *args):
        if mode == "O1":
            raise RuntimeError("forced by the test")
        return real(workload, mode, *args)

    monkeypatch.setattr(runner, "_build_recipe", build_recipe)
    code, text = _run(["bench", *FAST, "--iters", "1", "--warmup", "0", "--opt-levels", "O0",
                       "O1", "--no-native"])
    assert code == 0
    assert [r[-1] for r in _table_rows(text)] == ["ok", "FAILED: RuntimeError: forced by the "
                                                        "test"]
    assert "note: failed modes: run with -v for their tracebacks." in text


# -- dtype spellings, the default size, the few-steps note -----------------------------------------


@pytest.mark.parametrize("spelling", ["fp32", "float32", "float", "FLOAT"])
def test_every_fp32_spelling_of_dtype_says_where_the_fp32_run_is(spelling, capsys):
    """--dtype names the half type; a user asking for fp32 by any of torch's names for it
    (torch.float is torch.float32) gets told that the fp32 run is the O0 row, not only a bare
    "invalid choice". (C11)"""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--dtype", spelling])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --dtype: invalid choice: {spelling!r} (choose from fp16, bf16)" in err
    assert "the fp32 run is always there, as the O0 row" in err


@pytest.mark.parametrize("cuda, size", [(True, "large"), (False, "small")])
def test_default_size_is_large_on_cuda_and_small_on_the_cpu(cuda, size, monkeypatch, capsys):
    """A bare `mixprec bench` is the GPU benchmark on a CUDA machine (the large sizes, where
    the recipes' differences show) and a smoke test of seconds on the CPU, as --help says;
    the workload is built at that size. (C17)"""
    calls = _stop_at_build(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--no-progress"])
    assert exc.value.code == 2
    assert "stopped by the test" in capsys.readouterr().err
    ((args, kwargs),) = calls
    assert kwargs["size"] == size and kwargs["batch_size"] is None
    assert kwargs["device"] == torch.device("cuda" if cuda else "cpu")


@pytest.mark.parametrize("cuda", [True, False])
def test_default_half_type_and_warm_up_follow_the_device(cuda, monkeypatch):
    """A bare `mixprec bench` on a CUDA machine runs fp16 (Apex's type, so loss scaling shows)
    with 5 warm-up steps, on the CPU bf16 with 3 (README, --help). The CUDA test passes
    --dtype and --warmup itself, so nothing else pins the CUDA defaults: CUDA is faked here
    and run_modes records what it is given."""
    from mixprec.bench import models, runner

    calls = []
    cpu_workload = build_workload("cnn", batch_size=2, num_batches=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(models, "build_workload", lambda *a, **kw: cpu_workload)
    monkeypatch.setattr(runner, "run_modes",
                        lambda workload, modes, **kw: calls.append((modes, kw)) or [])
    code, text = _run(["bench", "--no-progress"])
    assert code == 1  # (no row ran)
    ((modes, kwargs),) = calls
    assert modes == ALL_MODES
    assert kwargs["dtype"] == (torch.float16 if cuda else torch.bfloat16)
    assert (kwargs["warmup"], kwargs["iters"]) == ((5, 40) if cuda else (3, 40))
    assert kwargs["device"] == torch.device("cuda" if cuda else "cpu")
    half, warm = ("fp16", 5) if cuda else ("bf16", 3)
    assert f"half type {half}, {warm} warm-up + 40 timed iterations per mode" in text


def test_no_timing_note_when_no_mode_finished(monkeypatch):
    """The few-steps note is about the timings in the table: a run stopped before its first
    mode finished has none, so its notes say it was interrupted and do not warn about timings
    that were never taken (the note reads as if rows were shown). (C19)"""
    _interrupt_at(monkeypatch, "O0")
    code, text = _run(["bench", *ONE_MODE])
    assert code == 130
    notes = [line for line in text.splitlines() if line.startswith("note: ")]
    assert notes[0] == "note: interrupted (Ctrl-C) during O0; did not run: O0."
    assert not any("timed step" in note for note in notes)
    # The same flags with the mode finished do get the note (1 timed step < 5).
    monkeypatch.undo()
    code, text = _run(["bench", *ONE_MODE])
    assert code == 0 and "note: only 1 timed step per mode: too few to time" in text


@pytest.mark.parametrize("verbose", [False, True])
@pytest.mark.parametrize("stop_in_o1", [False, True])
def test_warnings_raised_while_modes_run_become_notes(monkeypatch, capsys, verbose, stop_in_o1):
    """A warning from the library while a mode runs (amp's about O3 fp16 with AdamW, on
    every GPU run of --model gpt) cut through the progress bar with its source line; it is a
    note under the table instead, naming the modes that raised it, once however often they
    did: its first sentence, the whole of it with -v. A mode that Ctrl-C stopped keeps its
    warnings too. Reference: the warnings the test raises. (r105A R1)"""
    import mixprec.bench.runner as runner

    real = runner.run_mode

    def run_mode(workload, mode, **kwargs):
        for _ in range(3):
            # (A dotted name first, as amp's own warnings have: the first sentence ends at
            # ". ", not at the first ".".)
            warnings.warn("amp.thing(x=1) happened. Here is why.", UserWarning, stacklevel=2)
        if mode == "O1":
            warnings.warn("only in O1", RuntimeWarning, stacklevel=2)
            if stop_in_o1:
                raise KeyboardInterrupt
        return real(workload, mode, **kwargs)

    monkeypatch.setattr(runner, "run_mode", run_mode)
    argv = ["bench", *ONE_MODE[:-3], "--opt-levels", "O0", "O1", "O2", "--no-native"]
    code, text = _run(argv + (["-v"] if verbose else []))
    assert code == (130 if stop_in_o1 else 0)
    assert "Warning" not in capsys.readouterr().err  # (nothing printed raw)
    notes = [line for line in text.splitlines() if "warned:" in line]
    shared = ("UserWarning: amp.thing(x=1) happened. Here is why." if verbose
              else "UserWarning: amp.thing(x=1) happened. (-v: all of it)")
    # (Stopped in O1, O2 never ran: the interrupted mode's warnings are O1's, not O2's.)
    assert notes == [f"note: {'O0, O1' if stop_in_o1 else 'O0, O1, O2'} warned: {shared}",
                     "note: O1 warned: RuntimeWarning: only in O1"], notes


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                 "allocate memory: you tried to allocate 987654321000 bytes. Error code 12"),
    MemoryError(),
    getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of ..."),
    # (Raised as a plain RuntimeError: an allocation failing in a kernel launch or cuBLAS.)
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
                 "reported"),
], ids=["cpu-allocator", "MemoryError", "OutOfMemoryError", "RuntimeError-cuda"])
def test_a_mode_out_of_memory_gets_a_note_naming_the_batch_size(monkeypatch, error):
    """A mode that ran out of memory showed the allocator's message cut to fit the table (its
    sizes gone) and no way out; a note under the table names the modes, the batch size and
    the flag to change. Another failure gets no such note. (r105A R2)"""
    import mixprec.bench.runner as runner

    real = runner.run_mode

    def run_mode(workload, mode, **kwargs):
        if mode == "O1":
            raise error
        if mode == "O2":
            raise ValueError("something else")
        return real(workload, mode, **kwargs)

    monkeypatch.setattr(runner, "run_mode", run_mode)
    code, text = _run(["bench", *ONE_MODE[:-3], "--opt-levels", "O0", "O1", "O2",
                       "--no-native"])
    assert code == 0
    notes = [line for line in text.splitlines()
             if line.startswith("note:") and "out of memory" in line]
    assert notes == ["note: O1 ran out of memory at batch size 4 on cpu: use a smaller "
                     "--batch-size."], notes


def test_an_out_of_memory_error_is_recognised_by_its_type_name():
    """_out_of_memory knows PyTorch's OutOfMemoryError by its type name, as its docstring says,
    not only by "out of memory" in its message (r107B G8)."""
    from mixprec.bench.cli import _out_of_memory

    assert _out_of_memory("OutOfMemoryError: Tried to allocate 20.00 GiB (GPU 0)")
    assert _out_of_memory("MemoryError: ")
    assert not _out_of_memory("ValueError: something else")
    assert not _out_of_memory(None)
