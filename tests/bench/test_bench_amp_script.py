"""benchmarks/bench_amp.py: the PASS/MISS logic, the CPU message, and a CPU smoke run."""

import importlib.util
import json
import os

import pytest
import torch

_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "benchmarks",
    "bench_amp.py",
)


@pytest.fixture(scope="module")
def bench_amp():
    spec = importlib.util.spec_from_file_location("bench_amp", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(mode, t, mem, dtype="bf16", variant="base", status="ok"):
    return {
        "model": "gpt",
        "half_dtype": dtype,
        "mode": mode,
        "variant": variant,
        "label": mode,
        "status": status,
        "time_per_iter_s": t,
        "peak_memory_mb": mem,
        "skipped_steps": 0,
    }


def test_targets_pass_and_miss(bench_amp):
    rows = [
        _row("fp32", 0.100, 3000, dtype="fp32"),
        _row("autocast", 0.031, 2000),
        _row("half", 0.0276, 1500),
        _row("O1", 0.0316, 2100),  # 1.019x autocast: PASS
        _row("O2", 0.0292, 2100),  # 0.942x autocast: MISS; 1.058x half: MISS; mem MISS
        _row("O3", 0.0270, 1400),
        _row("O2", 0.0280, 1900, variant="FusedLayerNorm"),  # 0.903x: PASS, 1.014x: PASS
    ]
    table, targets = bench_amp._tables(rows)
    got = {(t["variant"], t["target"]): t["verdict"] for t in targets}
    assert got[("base", "O1 time <= 1.02x autocast")] == "PASS"
    assert got[("base", "O2 time <= 0.92x autocast")] == "MISS"
    assert got[("base", "O2 time <= 1.05x pure half")] == "MISS"
    assert got[("base", "O2 peak mem <= autocast")] == "MISS"
    assert got[("FusedLayerNorm", "O2 time <= 0.92x autocast")] == "PASS"
    assert got[("FusedLayerNorm", "O2 time <= 1.05x pure half")] == "PASS"
    assert got[("FusedLayerNorm", "O2 peak mem <= autocast")] == "PASS"
    assert got[("FusedLayerNorm", "O1 time <= 1.02x autocast")] == "n/a"  # no such row
    assert "### gpt, bf16" in table and "| fp32 | base | 100.00 |" in table


def test_failed_row_gives_na(bench_amp):
    rows = [
        _row("autocast", 0.03, 2000),
        _row("half", 0.03, 2000),
        _row("O2", None, None, status="failed"),
    ]
    _, targets = bench_amp._tables(rows)
    assert {t["verdict"] for t in targets if t["target"].startswith("O2")} == {"n/a"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cpu_gives_a_clear_message(bench_amp, capsys, tmp_path):
    assert bench_amp.main(["--out", str(tmp_path)]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run")
def test_smoke_run_on_cpu_writes_json(bench_amp, capsys, tmp_path):
    code = bench_amp.main(
        [
            "--smoke",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--models",
            "gpt",
            "--gpt-dtypes",
            "bf16",
            "--norm",
            "torch",
            "--optimizer",
            "torch",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    with open(tmp_path / "bench_amp.json") as f:
        data = json.load(f)
    modes = [r["mode"] for r in data["rows"]]
    assert modes == ["fp32", "autocast", "half", "O1", "O2", "O3"]
    assert all(r["status"] == "ok" for r in data["rows"]), data["rows"]
    assert len(data["targets"]) == 5
    # Without CUDA there is no allocator peak of the timed steps: that target says n/a.
    steady = [t for t in data["targets"] if "timed steps" in t["target"]]
    assert [t["verdict"] for t in steady] == ["n/a"]
    out = capsys.readouterr().out
    assert "### Targets" in out and "| gpt | bf16 | base |" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run")
def test_smoke_run_adds_fused_adam_variants(bench_amp, tmp_path):
    """--optimizer both (the default): O1/O2 rows with mixprec's FusedAdam, and O2 with
    FusedLayerNorm and FusedAdam, each judged against the base autocast/pure-half rows."""
    code = bench_amp.main(["--smoke", "--steps", "1", "--warmup", "0", "--models", "gpt",
                           "--gpt-dtypes", "bf16", "--out", str(tmp_path)])
    assert code == 0
    with open(tmp_path / "bench_amp.json") as f:
        data = json.load(f)
    extra = [(r["variant"], r["mode"], r["optimizer"], r["norm"]) for r in data["rows"]
             if r["variant"] != "base"]
    assert extra == [
        ("FusedLayerNorm", "O1", "AdamW", "FusedLayerNorm"),
        ("FusedLayerNorm", "O2", "AdamW", "FusedLayerNorm"),
        ("FusedAdam", "O1", "FusedAdam", "LayerNorm"),
        ("FusedAdam", "O2", "FusedAdam", "LayerNorm"),
        ("FusedLayerNorm+FusedAdam", "O2", "FusedAdam", "FusedLayerNorm"),
    ]
    assert all(r["status"] == "ok" for r in data["rows"]), data["rows"]
    judged = {(t["variant"], t["target"]) for t in data["targets"] if t["verdict"] != "n/a"}
    assert ("FusedAdam", "O2 time <= 1.05x pure half") in judged
    assert ("FusedLayerNorm+FusedAdam", "O2 time <= 0.92x autocast") in judged


@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
def test_smoke_run_on_cuda(bench_amp, tmp_path):
    # Small models through the GPU code paths (events, allocator peaks, fused AdamW).
    code = bench_amp.main(
        [
            "--smoke",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--models",
            "gpt",
            "resnet50",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    with open(tmp_path / "bench_amp.json") as f:
        data = json.load(f)
    failed = [(r["model"], r["mode"], r["error"]) for r in data["rows"] if r["status"] != "ok"]
    assert not failed
    assert all(r["time_per_iter_s"] > 0 for r in data["rows"])
    # The timed steps' peak is part of the all-steps peak.
    for r in data["rows"]:
        assert 0 < r["peak_memory_steady_mb"] <= r["peak_memory_mb"] + 1e-6, r
