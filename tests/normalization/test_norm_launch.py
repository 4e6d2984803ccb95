"""Host-side launch logic that needs no GPU: configs, occupancy arithmetic, program counts."""

import importlib
import importlib.util
import types

import pytest
import torch

from mixprec._checks import check_flag, listed
from mixprec.normalization import _launch, _ops
from tests._triton import interpreter_skip_reason


@pytest.mark.parametrize("n", [1, 45, 123, 1023, 1024, 4096, 8192, 15129, 65536])
def test_default_configs_cover_the_row(n):
    for cfg in (_launch.default_config(n), _launch.default_backward_config(n, 2, 2)):
        assert cfg.block_n >= n and cfg.block_n & (cfg.block_n - 1) == 0
        assert 1 <= cfg.block_m <= 64 and cfg.num_warps in (2, 4, 8, 16, 32)
        assert cfg.pipeline_stages == 0


def test_backward_prefetch_only_when_it_fits():
    # Half rows up to 4,096: prefetch (measured); fp32 at the same tile: not.
    assert _launch.default_backward_config(4096, 2, 2).prefetch
    assert _launch.default_backward_config(1024, 2, 2).prefetch
    assert not _launch.default_backward_config(4096, 4, 4).prefetch
    assert not _launch.default_backward_config(65536, 2, 2).prefetch


def _fake_h200(monkeypatch):
    # 132 SMs, 64K registers, 2,048 threads and 228 KiB of shared memory per SM.
    monkeypatch.setattr(_launch, "_sm_resources", lambda index: (132, 65536, 2048, 233472))


def test_occupancy_arithmetic(monkeypatch):
    _fake_h200(monkeypatch)

    def compiled(n_regs, shared):
        return types.SimpleNamespace(n_regs=n_regs, metadata=types.SimpleNamespace(shared=shared))

    # registers: 72 -> 72 per thread x 128 threads -> 7 programs of 4 warps
    assert _launch._occupancy(compiled(72, 4096), 4, 0) == 7
    # threads: 16 regs x 128 threads would allow 32, but 2,048 threads allow 16
    assert _launch._occupancy(compiled(16, 0), 4, 0) == 16
    # shared memory: 100 KiB per program -> 2
    assert _launch._occupancy(compiled(32, 100 * 1024), 4, 0) == 2
    # never below one
    assert _launch._occupancy(compiled(255, 0), 32, 0) == 1
    # Triton without the attributes: unknown
    assert _launch._occupancy(object(), 4, 0) is None


def test_occupancy_rounds_registers_and_caps_programs(monkeypatch):
    """The backward's program count is the SM's resident programs times the SMs: a count too
    high launches a second wave (a slower backward), too low leaves SMs idle. Registers are
    allocated per thread in units of 8, an SM holds at most 32 programs, and a shared-memory
    size the driver does not report (0) sets no limit. Against the arithmetic done by hand
    (D01, D02, D03)."""
    _fake_h200(monkeypatch)

    def compiled(n_regs, shared):
        return types.SimpleNamespace(n_regs=n_regs, metadata=types.SimpleNamespace(shared=shared))

    # 33 registers are allocated as 40: 40 x 64 threads per program -> 65,536 // 2,560 = 25
    assert _launch._occupancy(compiled(33, 0), 2, 0) == 25
    # one warp of 16 registers: 64 by threads, 128 by registers, but 32 at most
    assert _launch._occupancy(compiled(16, 0), 1, 0) == 32
    # shared memory per SM unknown: only registers and threads count (16 here)
    monkeypatch.setattr(_launch, "_sm_resources", lambda index: (132, 65536, 2048, 0))
    assert _launch._occupancy(compiled(32, 100 * 1024), 4, 0) == 16


def test_program_count_fallback_keeps_one_program_per_sm_at_32_warps(monkeypatch):
    """Where Triton hides the compiled kernel's register count, the heuristic of 16 warps per
    SM still gives every SM one program of 32 warps (rows of 16K-64K elements), not a single
    program for the whole backward. Against the SM count of the fake H200 (D04)."""
    _fake_h200(monkeypatch)
    monkeypatch.setattr(_launch, "_PROGRAMS_PER_SM", {})

    def broken():
        raise RuntimeError("no such attribute")

    device = torch.device("cuda", 0)
    for warps, per_sm in ((32, 1), (16, 1), (8, 2)):
        cfg = _launch.KernelConfig(1, 65536, warps)
        assert _launch.backward_num_programs(10**6, cfg, device, ("k", warps), broken) == \
            132 * per_sm, warps


def test_sm_resources_fall_back_to_every_nvidia_gpu_since_volta(monkeypatch):
    """A torch build whose device properties lack the per-SM limits gets 64K registers and
    2,048 threads per SM (every NVIDIA GPU since Volta) and an unknown (0) shared memory;
    reported values are taken as they are. (D05)"""
    def props(**attrs):
        return lambda index: types.SimpleNamespace(multi_processor_count=132, **attrs)

    _launch._sm_resources.cache_clear()
    try:
        monkeypatch.setattr(torch.cuda, "get_device_properties", props())
        assert _launch._sm_resources(0) == (132, 65536, 2048, 0)
        _launch._sm_resources.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_properties", props(
            regs_per_multiprocessor=32768, max_threads_per_multi_processor=1536,
            shared_memory_per_multiprocessor=102400))
        assert _launch._sm_resources(0) == (132, 32768, 1536, 102400)
    finally:
        _launch._sm_resources.cache_clear()


def test_program_count_is_learnt_once_per_specialization(monkeypatch):
    _fake_h200(monkeypatch)
    monkeypatch.setattr(_launch, "_PROGRAMS_PER_SM", {})
    cfg = _launch.KernelConfig(1, 1024, 4)
    device = torch.device("cuda", 0)
    calls = []

    class Compiled:
        n_regs = 64
        metadata = types.SimpleNamespace(shared=0)

        def _init_handles(self):
            calls.append("init")

    def compile_kernel():
        calls.append("compile")
        return Compiled()

    assert _launch.backward_num_programs(10**6, cfg, device, "k", compile_kernel) == 132 * 8
    assert _launch.backward_num_programs(10**6, cfg, device, "k", compile_kernel) == 132 * 8
    assert calls == ["compile", "init"]
    # fewer row blocks than slots: one block each
    assert _launch.backward_num_programs(100, cfg, device, "k", compile_kernel) == 100

    def broken():
        raise RuntimeError("no such attribute")

    # a Triton whose internals moved falls back to the heuristic, once
    fallback = _launch._FALLBACK_WARPS_PER_SM // cfg.num_warps
    assert _launch.backward_num_programs(10**6, cfg, device, "k2", broken) == 132 * fallback


class _FakeCompiled:
    """A compiled kernel: Triton's runner (``[grid](...)``) and the launcher it calls."""

    function, packed_metadata = "handle", "metadata"

    def __init__(self, log):
        self.log = log

    def _init_handles(self):
        self.log.append(("init",))

    def __getitem__(self, grid):
        return lambda *args, stream: self.log.append(("runner", grid, args, stream))

    def run(self, *args):
        self.log.append(("run", args))


class _Hooks:
    def __init__(self, calls=()):
        self.calls = list(calls)


class _Runtime:
    """Stands in for ``triton.knobs.runtime`` (its launch hook chains)."""

    def __init__(self, enter=(), exit=()):
        self.launch_enter_hook, self.launch_exit_hook = _Hooks(enter), _Hooks(exit)


class _FakeKernel:
    """Stands in for a JITFunction: records launches, returns a fake compiled kernel."""

    arg_names = ["X", "n", "eps", "FLAG", "BLOCK"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return _FakeCompiled(self.log)
        return run


def _fast_launch_env(monkeypatch):
    """launch() on a fake CUDA device where its direct launch is supported: an empty compiled
    cache, stream 77, and the returned fake runtime (its launch hooks)."""
    runtime = _Runtime()
    monkeypatch.setattr(_launch, "_fast_launch_supported", lambda: True)
    monkeypatch.setattr(_launch, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(_launch, "_COMPILED", {})
    monkeypatch.setattr(_launch, "_raw_stream", lambda device: 77)
    monkeypatch.setattr(_launch, "_triton_runtime_knobs", lambda: runtime)
    return runtime


def test_launch_reuses_the_compiled_kernel_per_specialization(monkeypatch):
    # Triton's dispatch runs once per specialization; later calls launch the compiled kernel
    # with every argument in signature order (constexprs included, launch options not).
    runtime = _fast_launch_env(monkeypatch)
    kernel, device = _FakeKernel(), torch.device("cuda", 0)
    buf = torch.zeros(64)
    consts = dict(FLAG=True, BLOCK=128, num_warps=4)

    _launch.launch(kernel, (3,), (buf, 32, 1e-5), consts, device)
    _launch.launch(kernel, (5,), (buf, 48, 1e-6), consts, device)
    assert [entry[0] for entry in kernel.log] == ["triton", "init", "run"]
    assert kernel.log[0] == ("triton", (3,), (buf, 32, 1e-5), consts)
    # Triton's launcher, called as its runner would with no launch hook set: grid, stream,
    # handle, metadata, no launch metadata and no hooks, then the arguments in signature order.
    assert kernel.log[2] == ("run", (5, 1, 1, 77, "handle", "metadata", None, None, None,
                                     buf, 48, 1e-6, True, 128))
    # With a launch hook set (a profiler), Triton's own runner launches, so the hook runs.
    runtime.launch_enter_hook.calls.append(print)
    _launch.launch(kernel, (2, 3), (buf, 48, 1e-6), consts, device)
    assert kernel.log[3] == ("runner", (2, 3, 1), (buf, 48, 1e-6, True, 128), 77)
    # A hook assigned the older way (a plain callable) counts as set; None does not.
    runtime.launch_enter_hook = print
    _launch.launch(kernel, (4,), (buf, 48, 1e-6), consts, device)
    assert kernel.log[4][0] == "runner"
    runtime.launch_enter_hook = None
    _launch.launch(kernel, (4,), (buf, 48, 1e-6), consts, device)
    assert kernel.log[5][0] == "run"
    del kernel.log[1:]

    # Anything Triton specializes on makes a new key, which takes Triton's path once.
    _launch.launch(kernel, (1,), (buf[1:], 48, 1e-6), consts, device)  # 4-byte aligned data
    _launch.launch(kernel, (1,), (buf, 40, 1e-6), consts, device)  # of 8, not of 16 (C08)
    _launch.launch(kernel, (1,), (buf, 1, 1e-6), consts, device)  # equal to 1
    _launch.launch(kernel, (1,), (buf, 2**31 + 16, 1e-6), consts, device)  # 64-bit int
    _launch.launch(kernel, (1,), (buf.half(), 48, 1e-6), consts, device)  # dtype
    _launch.launch(kernel, (1,), (buf, 48, 1e-6), dict(consts, FLAG=False), device)
    _launch.launch(kernel, (1,), (buf, 48, 1e-6), dict(consts, num_warps=8), device)
    assert [entry[0] for entry in kernel.log[1:]] == ["triton", "init"] * 7


@pytest.mark.parametrize("case", ["cpu", "interpreter", "other_triton"])
def test_launch_takes_tritons_path_where_unverified(monkeypatch, case):
    monkeypatch.setattr(_launch, "_fast_launch_supported", lambda: case != "other_triton")
    monkeypatch.setattr(_launch, "interpreter_enabled", lambda: case == "interpreter")
    monkeypatch.setattr(_launch, "_COMPILED", {})
    kernel = _FakeKernel()
    device = torch.device("cpu") if case == "cpu" else torch.device("cuda", 0)
    for _ in range(3):
        _launch.launch(kernel, (1,), (torch.zeros(4), 16, 1.0), dict(FLAG=True, BLOCK=16), device)
    assert [entry[0] for entry in kernel.log] == ["triton"] * 3


def test_launch_keeps_a_compiled_kernel_per_gpu(monkeypatch):
    """A kernel compiled for one GPU is loaded into that GPU's context only: a launch of the
    same specialization on another GPU (a second model replica, pipeline stages) takes
    Triton's path, which compiles and loads it there, instead of launching the first GPU's
    handle. Against the launch log (D06)."""
    _fast_launch_env(monkeypatch)
    kernel, buf = _FakeKernel(), torch.zeros(64)
    consts = dict(FLAG=True, BLOCK=128, num_warps=4)
    for index in (0, 1, 0, 1):
        _launch.launch(kernel, (1,), (buf, 48, 1e-6), consts, torch.device("cuda", index))
    assert [entry[0] for entry in kernel.log] == ["triton", "init", "triton", "init", "run", "run"]


def test_launch_waits_for_an_asynchronous_compile(monkeypatch):
    """With Triton's asynchronous compile mode the first launch returns a future: the
    launcher keeps the compiled kernel it resolves to, so later launches are direct. Against
    the launch log (D07)."""
    _fast_launch_env(monkeypatch)
    kernel = _FakeKernel()
    runner = _FakeKernel.__getitem__

    def deferred(self, grid):
        run = runner(self, grid)
        return lambda *args, **kwargs: types.SimpleNamespace(result=lambda: run(*args, **kwargs))

    monkeypatch.setattr(_FakeKernel, "__getitem__", deferred)
    buf, consts = torch.zeros(64), dict(FLAG=True, BLOCK=128, num_warps=4)
    first = _launch.launch(kernel, (1,), (buf, 48, 1e-6), consts, torch.device("cuda", 0))
    assert isinstance(first, _launch._Launchable)
    _launch.launch(kernel, (2,), (buf, 48, 1e-6), consts, torch.device("cuda", 0))
    assert [entry[0] for entry in kernel.log] == ["triton", "init", "run"]


def test_launch_keeps_tritons_path_when_its_internals_moved(monkeypatch):
    """A Triton release whose compiled kernel lacks what the direct launch reads (here its
    loader raises) still runs every launch, through Triton's own runner, instead of failing
    the norm. Against the launch log (D08)."""
    _fast_launch_env(monkeypatch)
    kernel = _FakeKernel()

    def moved(self):
        raise AttributeError("_init_handles")

    monkeypatch.setattr(_FakeCompiled, "_init_handles", moved)
    buf, consts = torch.zeros(64), dict(FLAG=True, BLOCK=128, num_warps=4)
    for _ in range(3):
        assert _launch.launch(kernel, (1,), (buf, 48, 1e-6), consts,
                              torch.device("cuda", 0)) is None
    assert [entry[0] for entry in kernel.log] == ["triton"] * 3


def test_launch_tells_32_bit_ints_at_the_boundary(monkeypatch):
    """Triton passes an int as 32-bit only when it lies in [-2**31, 2**31): 2**31 itself (a
    row stride or element count of a 2**31-element buffer) needs the 64-bit kernel, not the
    one compiled for 2**31 - 16. Against the launch log (D10)."""
    _fast_launch_env(monkeypatch)
    kernel, buf = _FakeKernel(), torch.zeros(64)
    consts = dict(FLAG=True, BLOCK=128, num_warps=4)
    for value in (2**31 - 16, 2**31, -(2**31), -(2**31) - 16):
        _launch.launch(kernel, (1,), (buf, value, 1e-6), consts, torch.device("cuda", 0))
    # -2**31 is 32-bit like 2**31 - 16, -2**31 - 16 is 64-bit like 2**31 (all multiples of 16)
    assert [entry[0] for entry in kernel.log] == ["triton", "init"] * 2 + ["run"] * 2


def test_site_keeps_at_most_16_variants(monkeypatch):
    """A launch site keeps its compiled kernels for at most 16 variants (row strides, dtypes),
    so that a layer fed ever new strides does not grow without bound; variants past that still
    launch, through launch()'s own cache. Against the launch log (D09)."""
    _fast_launch_env(monkeypatch)
    kernel, buf = _FakeKernel(), torch.zeros(64)
    site = _launch._Site(kernel, dict(FLAG=True, BLOCK=128, num_warps=4), torch.device("cuda", 0))
    for stride in range(20):
        site((1,), (buf, stride, 1e-5), (stride,))
    assert len(site.cache) == 16 and set(site.cache) == {(s,) for s in range(16)}
    site((1,), (buf, 19, 1e-5), (19,))  # past the bound: launch()'s cache, a direct launch
    assert kernel.log[-1][0] == "run"


@pytest.mark.parametrize("version,parsed,fast", [
    ("3.6.0", (3, 6), True), ("3.6.1", (3, 6), True), ("3.6.0+git1a2b3c4", (3, 6), True),
    ("3.5.1", (3, 5), False), ("3.7.0", (3, 7), False), ("unknown", None, False),
])
def test_triton_version_is_major_and_minor(monkeypatch, version, parsed, fast):
    """The installed Triton is told by its (major, minor) release: a patch release or a local
    build of 3.6 (3.6.1, 3.6.0+git...) keeps the direct launches verified on 3.6, and the
    interpreter tests' version gate, instead of falling back to Triton's slower per-call
    runner; a version string that does not parse gives None (C07)."""
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "__version__", version)
    _launch.triton_version.cache_clear()
    try:
        assert _launch.triton_version() == parsed
        assert _launch._fast_launch_supported() is fast
    finally:
        monkeypatch.undo()
        _launch.triton_version.cache_clear()


def test_site_keeps_the_compiled_kernel_per_variant(monkeypatch):
    # A plan's launch site skips launch()'s key once its variant has been launched; a launch
    # with misaligned tensors (variant None) always takes launch(), which keys on alignment.
    _fast_launch_env(monkeypatch)
    keys = []
    arg_key = _launch._arg_key
    monkeypatch.setattr(_launch, "_arg_key", lambda arg: keys.append(arg) or arg_key(arg))
    kernel, device = _FakeKernel(), torch.device("cuda", 0)
    site = _launch._Site(kernel, dict(FLAG=True, BLOCK=128, num_warps=4), device)
    buf = torch.zeros(64)

    site((3,), (buf, 32, 1e-5), (32,))
    site((5,), (buf, 32, 1e-5), (32,))
    assert [entry[0] for entry in kernel.log] == ["triton", "init", "run"]
    assert kernel.log[2][1][:4] == (5, 1, 1, 77)
    assert len(keys) == 3  # one key, for the first launch only
    site((5,), (buf, 47, 1e-5), (47,))  # another variant (47: not a multiple of 16): keyed
    site((5,), (buf, 47, 1e-5), (47,))  # once, compiled by Triton once, then kept
    assert [entry[0] for entry in kernel.log[3:]] == ["triton", "init", "run"]
    assert len(keys) == 6
    site((1,), (buf[1:], 32, 1e-5), None)  # misaligned: launch() every time
    site((1,), (buf[1:], 32, 1e-5), None)
    assert [entry[0] for entry in kernel.log[6:]] == ["triton", "init", "run"]
    assert len(keys) == 12
    assert set(site.cache) == {(32,), (47,)}


def test_site_on_the_interpreter_keeps_nothing(monkeypatch):
    monkeypatch.setattr(_launch, "_COMPILED", {})
    kernel = _FakeKernel()
    site = _launch._Site(kernel, dict(FLAG=True, BLOCK=16), torch.device("cpu"))
    for _ in range(2):
        site((1,), (torch.zeros(4), 16, 1.0), ())
    assert [entry[0] for entry in kernel.log] == ["triton"] * 2 and not site.cache


def test_functional_launchers_reject_what_their_plans_cannot_take():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="out must be a"):
        _launch.forward(x, None, None, 1e-5, False, torch.float32,
                        out=torch.empty(4, 16, dtype=torch.bfloat16))
    # An out of another shape (fewer columns, a flat buffer) would be written past or short of
    # its rows: refused with the shape it needs, zero rows included. (L08)
    for rows, bad in ((0, torch.empty(0, 8)), (4, torch.empty(4, 8)), (4, torch.empty(64))):
        with pytest.raises(ValueError, match=rf"out must be a \({rows}, 16\) torch.float32 "
                                             r"tensor, got \("):
            _launch.forward(x[:rows], None, None, 1e-5, False, torch.float32, out=bad)
    # Any pipeline_stages > 0 loops with a runtime bound only a compiled GPU kernel runs. (L21)
    for stages in (1, 2, 3):
        cfg = _launch.KernelConfig(1, 16, 1, pipeline_stages=stages)
        with pytest.raises(ValueError, match=rf"pipeline_stages={stages} needs a compiled GPU "
                                             r"kernel; .* Use pipeline_stages=0\."):
            _launch.backward(x[:0], x[:0], None, None, x[:0, 0], x[:0, 0], False, False,
                             torch.float32, False, False, config=cfg)
    if importlib.util.find_spec("triton") is not None:  # (a plan of no rows: L14)
        with pytest.raises(ValueError, match="NormPlan needs at least one row, got m=0"):
            _launch.NormPlan(torch.device("cpu"), 0, 16, torch.float32, torch.float32, None,
                             None, 1e-5, False, False)


# -- TRITON_INTERPRET values, unit column strides (mutation testing) ------------------------------
@pytest.mark.parametrize("value,enabled", [
    ("1", True), ("true", True), ("True", True), ("ON", True), ("yes", True), ("y", True),
    ("Y", True), ("0", False), ("false", False), ("off", False), ("t", False), ("2", False),
    ("", False),
])
def test_interpreter_enabled_follows_the_environment(monkeypatch, value, enabled):
    # mixprec's routing reads the variable as Triton does (3.6's knob, where installed).
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert _launch.interpreter_enabled() is enabled
    if importlib.util.find_spec("triton") is not None:
        knobs = getattr(importlib.import_module("triton"), "knobs", None)
        if knobs is not None:
            assert knobs.runtime.interpret is enabled


def test_interpreter_disabled_without_the_variable(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _launch.interpreter_enabled() is False


def test_a_triton_that_fails_to_import_leaves_the_pytorch_path(monkeypatch, caplog):
    """A Triton that is installed but broken (a wheel built for another CUDA or Python, a
    missing shared library) must not break the norms: availability is False, so every call
    takes the PyTorch path, and a warning says why. Checked by making the import fail (D18)."""
    import logging
    import sys

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *args: object() if name == "triton" else find_spec(name, *args))
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    _launch.triton_available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=_launch.__name__):
            assert _launch.triton_available() is False
        assert "triton is installed but failed to import" in caplog.text
    finally:
        monkeypatch.undo()
        _launch.triton_available.cache_clear()


_needs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() and interpreter_skip_reason() is not None,
    reason="needs CUDA or Triton's CPU interpreter (TRITON_INTERPRET=1, Triton >= 3.6)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@_needs_kernels
@pytest.mark.parametrize("is_rms", [False, True])
def test_forward_rejects_a_non_unit_column_stride(is_rms):
    x = torch.randn(4, 32, device=DEVICE)[:, ::2]  # (4, 16) with column stride 2
    with pytest.raises(ValueError, match=r"unit column stride, got strides \(32, 2\)"):
        _launch.forward(x, None, None, 1e-5, is_rms, torch.float32)
    # The same rows made contiguous are taken, and match the reference.
    y, _, _ = _launch.forward(x.contiguous(), None, None, 1e-5, is_rms, torch.float32)
    f = torch.nn.functional
    want = f.rms_norm(x, (16,), eps=1e-5) if is_rms else f.layer_norm(x, (16,), eps=1e-5)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


@_needs_kernels
def test_backward_rejects_a_non_unit_column_stride():
    x = torch.randn(4, 16, device=DEVICE)
    dy = torch.randn(4, 32, device=DEVICE)[:, ::2]
    _, mean, rstd = _launch.forward(x, None, None, 1e-5, False, torch.float32)
    with pytest.raises(ValueError, match="the fused backward needs unit column strides"):
        _launch.backward(dy, x, None, None, mean, rstd, False, False, torch.float32, False, False)


def test_next_power_of_2_is_the_smallest_power_holding_the_row():
    """The kernels' tiles are this power of two wide and hold the whole row: a narrower tile
    leaves the row's last columns unread and unwritten (rows of 2**k + 1 elements, the case an
    off-by-one misses), a wider one wastes registers. Against a plain loop (L01)."""
    for n in range(0, 4100):
        want = 1
        while want < n:
            want *= 2
        assert _launch.triton_next_power_of_2(n) == want, n
    for n in (17, 65, 1025, 4097, 65537):
        for cfg in (_launch.default_config(n), _launch.default_backward_config(n, 2, 2)):
            assert cfg.block_n >= n, (n, cfg)


@_needs_kernels
@pytest.mark.parametrize("is_rms", [False, True])
def test_forward_takes_one_column_rows_of_any_column_stride(is_rms):
    """A one-column row has no column stride to speak of: PyTorch gives a size-1 dim any
    stride (a transposed row vector has strides (1, 4)), and the launcher takes it as the
    rows it is. Against PyTorch's norms (L07)."""
    x = torch.randn(1, 4, device=DEVICE).t()  # (4, 1), strides (1, 4)
    assert x.stride() == (1, 4)
    y, _, _ = _launch.forward(x, None, None, 1e-5, is_rms, torch.float32)
    f = torch.nn.functional
    want = f.rms_norm(x, (1,), eps=1e-5) if is_rms else f.layer_norm(x, (1,), eps=1e-5)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_zero_row_rms_backward_gives_no_bias_gradient():
    """RMSNorm has no bias: its backward returns an empty [0] tensor for dbias whatever bias is
    passed, for zero rows as for any other count (the custom op's fake implementation promises
    that shape to torch.compile). dweight of zero rows is exact zeros (no kernel runs) (L11)."""
    x = torch.randn(0, 8)
    w, b = torch.rand(8) + 0.5, torch.randn(8)
    dx, dw, db = _launch.backward(x, x, w, b, x[:, 0], x[:, 0], True, False, torch.float32,
                                  True, True)
    assert dx.shape == (0, 8) and dx.dtype == torch.float32
    torch.testing.assert_close(dw, torch.zeros(8), rtol=0, atol=0)
    assert db.shape == (0,)


def test_zero_row_backward_gives_dx_in_the_input_dtype():
    """The input gradient comes in the input's dtype for zero rows as for any other count,
    also where the incoming gradient has another dtype (a Mixed norm's bf16 input with its
    fp32 output): the backward op's fake implementation promises that dtype to
    torch.compile. dweight and dbias of zero rows are zeros in the parameters' dtype (D40)."""
    x = torch.randn(0, 8, dtype=torch.bfloat16)
    dy = torch.randn(0, 8)
    w, b = torch.ones(8), torch.zeros(8)
    for is_rms in (False, True):
        dx, dw, db = _launch.backward(dy, x, w, b, dy[:, 0], dy[:, 0], is_rms, False,
                                      torch.bfloat16, True, True)
        assert dx.shape == (0, 8) and dx.dtype == torch.bfloat16, is_rms
        torch.testing.assert_close(dw, torch.zeros(8), rtol=0, atol=0)


def test_memory_efficient_plan_reads_the_output_dtype():
    """With memory_efficient (from_y) the backward reads the saved output and the incoming
    gradient, both in the output's dtype (a Mixed norm's bf16 input gives fp32 y): the plan's
    defaults say so, so that its backward config is sized for them and the modules' fast path
    recognises what autograd hands back (else every backward takes the generic fallback)
    (L16, L17)."""
    pytest.importorskip("triton")
    cpu = torch.device("cpu")
    for from_y, xy in ((True, torch.float32), (False, torch.bfloat16)):
        plan = _launch.NormPlan(cpu, 4, 16, torch.bfloat16, torch.float32, torch.float32,
                                torch.float32, 1e-5, False, from_y)
        assert plan.xy_dtype is xy and plan.dy_dtype is torch.float32, from_y


def test_check_flag_returns_a_real_bool():
    """(r99B) check_flag's contract is "value as a bool": callers store what it returns (DDP
    keeps delay_allreduce as returned and shows it in its repr); the value itself would leave
    an int, a tensor or None in place of True/False."""
    values = [(1, True), (0, False), (None, False), (torch.tensor(True), True), ("True", True)]
    np = pytest.importorskip("numpy")
    values += [(np.bool_(False), False), (np.bool_(True), True)]
    for value, want in values:
        got = check_flag("f", "flag", value, strings=True)
        assert type(got) is bool and got is want, value


# -- (r99B) the row limit and the dtypes that take the kernels ------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rows_up_to_65536_of_every_fused_dtype_take_the_kernels(monkeypatch, dtype):
    """README: the Triton kernels run for fp32/fp16/bf16 rows up to 65,536 elements; longer
    rows take the PyTorch reference. (The existing path test reads the limit from
    MAX_FUSED_N itself, so changing the constant went unnoticed; the interpreter's 7x65536
    cases compare numbers only, which the reference path also gets right.) Path choice only:
    no kernel runs."""
    monkeypatch.setattr(_launch, "triton_available", lambda: True)
    monkeypatch.setattr(_launch, "interpreter_enabled", lambda: True)
    x = torch.empty(1, 65537, dtype=dtype)
    with _ops.triton_on_cpu():
        assert _ops._use_triton(x[:, :65536], 65536)
        assert not _ops._use_triton(x, 65537)
        assert _ops._use_triton(x[:, :8], 8, torch.ones(8, dtype=dtype), torch.ones(8, dtype=dtype))


# -- (r99B) the launch heuristics documented in benchmarks/RESULTS.md and the docstrings ----------
def test_forward_config_warps_at_each_threshold():
    """Forward: 2 warps up to 1,024 columns (RESULTS.md: bf16 32768x1024 2 warps 80% vs 4
    warps 74%), then 4 up to 4,096, 8 up to 8,192, 16 up to 16,384, 32 beyond."""
    want = {1024: 2, 1025: 4, 4096: 4, 4097: 8, 8192: 8, 8193: 16, 16384: 16, 16385: 32}
    got = {n: _launch.default_config(n).num_warps for n in want}
    assert got == want


@pytest.mark.parametrize("n", [1, 16, 17, 45, 100, 512, 1000, 1024, 1025, 4096])
def test_short_rows_are_stacked_to_about_1024_elements_a_program(n):
    """_block_shape: "Rows shorter than 1,024 are stacked so that a program still moves
    ~1,024 elements", at most 64 rows, on tiles at least 16 wide."""
    for cfg in (_launch.default_config(n), _launch.default_backward_config(n, 2, 2)):
        assert cfg.block_n == max(16, 1 << (n - 1).bit_length()), (n, cfg)
        assert cfg.block_m == max(1, min(64, 1024 // cfg.block_n)), (n, cfg)
        assert cfg.block_m * cfg.block_n == max(1024, cfg.block_n), (n, cfg)


def test_backward_config_matches_the_measured_heuristic():
    """default_backward_config's docstring and RESULTS.md: fp32 rows of 1,024 take four rows a
    program at 8 warps, no prefetch (87% of copy), and only at exactly 1,024 columns; half
    rows up to 4,096 use 2 warps (<= 1,024) or 4 warps with prefetch; otherwise 4 / 8 / 16 /
    32 warps by 1,024 / 4,096 / 16,384, prefetch when the second copy is at most 64 bytes per
    thread (fp32 rows of 2,048 at 8 warps: 8 values x 8 bytes = 64, on)."""
    K = _launch.KernelConfig
    want = {
        (1024, 4, 4): K(4, 1024, 8, prefetch=False),      # measured exception
        (512, 4, 4): K(2, 512, 4, prefetch=True),         # not the 1,024 exception
        (1024, 2, 2): K(1, 1024, 2, prefetch=True),       # bf16 32768x1024: 2 warps + prefetch
        (512, 2, 2): K(2, 512, 2, prefetch=True),
        (2048, 2, 2): K(1, 2048, 4, prefetch=True),
        (4096, 2, 2): K(1, 4096, 4, prefetch=True),       # bf16 16384x4096: 4 warps + prefetch
        (8192, 2, 2): K(1, 8192, 16, prefetch=True),      # bf16 8192x8192: 16 warps + prefetch
        (1024, 2, 4): K(1, 1024, 4, prefetch=True),       # mixed (6 bytes): the general rule
        (2048, 4, 4): K(1, 2048, 8, prefetch=True),       # 64 bytes per thread: prefetch on
        (4096, 4, 4): K(1, 4096, 8, prefetch=False),
        (4097, 4, 4): K(1, 8192, 16, prefetch=False),
        (16384, 4, 4): K(1, 16384, 16, prefetch=False),
        (16385, 4, 4): K(1, 32768, 32, prefetch=False),
        (4097, 2, 2): K(1, 8192, 16, prefetch=True),
        (16, 4, 4): K(64, 16, 4, prefetch=True),
    }
    got = {key: _launch.default_backward_config(*key) for key in want}
    assert got == want


def test_finalize_config_tiles():
    """default_finalize_config: 16 columns a program (fewer only for narrower rows), up to
    256 partial rows a step (a power of two), 4 warps once a tile holds 2,048 values.
   """
    f = _launch.default_finalize_config
    assert f(3, 45) == (4, 16, 1)
    assert f(3, 5) == (4, 8, 1)
    assert f(3, 1) == (4, 1, 1)
    assert f(128, 1024) == (128, 16, 4)   # 2,048 values: 4 warps
    assert f(127, 1024) == (128, 16, 4)
    assert f(64, 1024) == (64, 16, 1)
    assert f(300, 64) == (256, 16, 4)


# -- (r99B) the direct launch keys tell apart what Triton specializes on --------------------------
def test_arg_key_tells_16_byte_alignment_bools_and_int_subclasses():
    """_arg_key must be at least as fine as Triton's specialization: a tensor 8 but not 16
    bytes aligned is not 16-aligned (a kernel compiled for aligned pointers would be launched
    on it: vectorised loads at a misaligned address); a bool is not the int 1 or 0 (Triton
    passes i1 vs i32); an int subclass (IntEnum) is specialized by value like an int.
   """
    import enum

    buf = torch.zeros(64)
    base = buf.data_ptr() % 16
    # find an offset (in fp32 elements) giving an 8-byte but not 16-byte aligned start
    off = next(k for k in range(4) if (base + 4 * k) % 16 == 8)
    assert _launch._arg_key(buf[off:])[1] is False
    assert _launch._arg_key(True) != _launch._arg_key(1)
    assert _launch._arg_key(False) != _launch._arg_key(0)

    class E(enum.IntEnum):
        ONE, SIXTEEN, ODD = 1, 16, 17

    keys = {_launch._arg_key(E.ONE), _launch._arg_key(E.SIXTEEN), _launch._arg_key(E.ODD)}
    assert len(keys) == 3
    assert _launch._arg_key(E.SIXTEEN) == _launch._arg_key(16)


# -- (r99B) the backward refuses a saved tensor with a non-unit column stride ---------------------
def test_backward_rejects_a_non_unit_column_stride_of_the_saved_tensor():
    """backward() checks both xy and dy for unit column strides; the existing test only
    passes a strided dy. With a strided xy the kernel reads it as unit-stride rows: wrong
    gradients, silently."""
    x = torch.randn(4, 32)[:, ::2]  # (4, 16), column stride 2
    dy = torch.randn(4, 16)
    mean = x.mean(1)
    rstd = x.var(1, unbiased=False).add(1e-5).rsqrt()
    with pytest.raises(ValueError, match="the fused backward needs unit column strides"):
        _launch.backward(dy, x, None, None, mean, rstd, False, False, torch.float32, False,
                         False)


# -- (r99B) misaligned tensors never reach a site's per-variant cache -----------------------------
class _RecordingSite:
    def __init__(self):
        self.variants = []

    def __call__(self, grid, args, variant):
        self.variants.append(variant)


def _misaligned(rows, n, dtype=torch.float32):
    """(rows, n) rows starting 4 bytes past a 16-byte boundary (storage offset of fp32)."""
    buf = torch.randn(rows * n + 8, dtype=dtype)
    off = next(k for k in range(1, 8) if (buf.data_ptr() + k * buf.element_size()) % 16 == 4)
    t = buf[off:off + rows * n].view(rows, n)
    assert t.data_ptr() % 16 == 4
    return t


def test_forward_launches_misaligned_rows_without_a_variant():
    """NormPlan.forward passes variant=None when any tensor is not 16-byte aligned, so the
    site takes launch(), which keys on each tensor's alignment; a variant would reuse the
    kernel compiled for aligned pointers (on a GPU: misaligned vector loads). Checked with a
    recording site, no kernel run."""
    pytest.importorskip("triton")
    plan = _launch.NormPlan(torch.device("cpu"), 4, 16, torch.float32, torch.float32, None,
                            None, 1e-5, False, False)
    plan.fwd_site = site = _RecordingSite()
    aligned = torch.randn(4, 16)
    assert aligned.data_ptr() % 16 == 0
    y = torch.empty(4, 16)
    plan.forward(aligned, 16, None, None, y, 16)
    plan.forward(_misaligned(4, 16), 16, None, None, y, 16)
    assert site.variants == [(16, 16), None]


def test_backward_launches_misaligned_gradients_without_a_variant():
    """As above for NormPlan.backward's main kernel: a misaligned incoming gradient (a view
    at an odd offset) gives variant None."""
    pytest.importorskip("triton")
    plan = _launch.NormPlan(torch.device("cpu"), 4, 16, torch.float32, torch.float32, None,
                            None, 1e-5, False, False)
    site = _RecordingSite()
    plan._backward_setups[(False, False)] = (site, (1,), 1, 0, _RecordingSite(), (1, 0))
    x = torch.randn(4, 16)
    mean, rstd = torch.zeros(4), torch.ones(4)
    plan.backward(torch.randn(4, 16), 16, x, 16, None, None, mean, rstd, False, False, (4, 16))
    plan.backward(_misaligned(4, 16), 16, x, 16, None, None, mean, rstd, False, False, (4, 16))
    assert site.variants == [(16, 16), None]


# -- (r99B) launches on a GPU other than the current one switch to it -----------------------------
def test_on_device_switches_only_to_another_gpu(monkeypatch):
    """_on_device makes a CUDA tensor's GPU current when it is not (Triton launches on the
    current device's stream), and is the shared no-op otherwise (CPU tensors included). With
    fake tensors and a fake current device, no GPU needed."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    on0 = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    on1 = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))
    assert _launch._on_device(on0) is _launch._SAME_DEVICE
    assert _launch._on_device(torch.zeros(1)) is _launch._SAME_DEVICE
    ctx = _launch._on_device(on1)
    assert isinstance(ctx, torch.cuda.device) and ctx.idx == 1


# -- (r99B) listed(), as test_distributed's D03 check on one process ------------------------------
def test_listed_names_eight_in_full_by_default():
    """listed(): up to eight names in full, then "and N more" (DDP's messages use the
    default)."""
    names = [f"p{i}" for i in range(10)]
    assert listed(names[:8]) == ", ".join(names[:8])
    assert listed(names) == ", ".join(names[:8]) + " and 2 more"
    assert listed(names[:4], most=4) == "p0, p1, p2, p3"


# -- (r99B) the backward launches no program without a row block ----------------------------------
def test_backward_grid_has_no_idle_programs():
    """_setup_backward: after splitting row blocks evenly (blocks_per_program = cdiv(blocks,
    programs)), the program count is recomputed so that no program is left without rows; the
    interpreter test's comment: 74 rows of 45 -> 16-row tiles, 5 row blocks over 3 backward
    programs (not 4, the interpreter's cap, one of which would only write a zero partial row
    for the finish to add)."""
    pytest.importorskip("triton")
    m, n = 74, 45
    plan = _launch.NormPlan(torch.device("cpu"), m, n, torch.float32, torch.float32,
                            torch.float32, torch.float32, 1e-5, False, False)
    x, w = torch.randn(m, n), torch.ones(n)
    stats = torch.ones(m)
    setup = plan._setup_backward(True, True, (x, x, w, w, stats, stats, x, n, n))
    _, grid, blocks_per_program, n_partials, _, finish_grid = setup
    assert (grid, blocks_per_program, n_partials) == ((3,), 2, 2)
    assert finish_grid == (3, 2)  # 45 columns in 16-wide tiles, dw and db
