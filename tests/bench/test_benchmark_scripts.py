"""Every script under benchmarks/ answers --help without a GPU (r100B R3: two took no
arguments and started their GPU run, dying with a CUDA or torchrun traceback)."""

import contextlib
import io
import os
import pathlib
import runpy
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_help_exits_cleanly(script, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # (their `from _cuda_timing import ...`)
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    out = io.StringIO()
    environ = dict(os.environ)  # (some set NCCL variables on import: not for later tests)
    try:
        with pytest.raises(SystemExit) as stop, contextlib.redirect_stdout(out):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        os.environ.clear()
        os.environ.update(environ)
    assert stop.value.code == 0, out.getvalue()
    assert out.getvalue().startswith("usage:"), out.getvalue()[:200]


def test_there_are_scripts():
    assert len(SCRIPTS) >= 20
