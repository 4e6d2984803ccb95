"""Run one training recipe ("mode") on a workload and measure it.

Modes:

* ``"fp32"``: plain PyTorch fp32 training, no amp at all.
* ``"O0"`` ... ``"O3"``: ``mixprec.amp.initialize(model, optimizer, opt_level=...)`` and
  ``amp.scale_loss``.
* ``"autocast"``: PyTorch's native recipe, ``torch.autocast`` (+ ``torch.amp.GradScaler`` for
  fp16).
* ``"half"``: pure ``model.half()`` / ``model.bfloat16()`` with half inputs and no loss
  scaling (the seed's ``.half()`` row).

Each mode builds a fresh model from the same seed (same initial weights) and cycles the same
pool of batches. After ``warmup`` untimed steps it times ``iters`` steps one by one (CUDA
events on CUDA, ``time.perf_counter`` on CPU), keeps every step's loss on the device (read once
at the end, so the loop never waits for the device because of the measurement) and records the
peak memory.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated()`` minus what was allocated when the
mode started (the shared synthetic data): what the mode itself needs (weights, gradients,
optimizer state, activations, casts), over all steps; ``extra["peak_memory_steady_mb"]`` is the
same over the timed steps only (without the warm-up's one-off allocations, e.g. cuDNN's
algorithm search). On CPU there is no allocator statistic: the growth of the process's resident
set size (RSS) over the start of the mode is reported, an approximation, since the C allocator
keeps and reuses freed memory. On Linux the peak is the kernel's own high-water mark (``VmHWM``
in ``/proc/self/status``, reset through ``/proc/self/clear_refs`` when the mode starts): exact,
and nothing runs beside the timed steps. Where the reset is not possible (other systems, a
``/proc`` that refuses it) a background thread samples the RSS every 10 ms (``/proc/self/statm``
or ``psutil``, which the ``bench`` extra installs on other systems), and the runner once more
after every step. With neither, no CPU peak is reported (``None``): the only other figure,
``ru_maxrss``, is the process's lifetime peak, whose growth says nothing of a mode that ran
after a larger one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import gc
import inspect
import logging
import math
import os
import statistics
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mixprec.bench.models import Workload

__all__ = [
    "DTYPES",
    "MODES",
    "ModeResult",
    "cpu_memory_readable",
    "mode_dtype_name",
    "mode_label",
    "run_mode",
    "run_modes",
    "warm_up_process",
]

logger = logging.getLogger(__name__)

#: Every mode :func:`run_mode` knows, in the order reports list them.
MODES = ("fp32", "O0", "O1", "O2", "O3", "autocast", "half")
#: Short dtype names used by the CLI and in reports.
DTYPES: Dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_OPT_LEVELS = ("O0", "O1", "O2", "O3")

ProgressFn = Callable[[str, int], None]


@dataclasses.dataclass
class ModeResult:
    """One row of the benchmark: a mode's measurements, or the reason it failed.

    Attributes:
        mode (str): one of :data:`MODES`.
        label (str): human-readable name (``"autocast+GradScaler"``, ``".bfloat16()"``, ...).
        dtype (str): ``"fp32"``, ``"fp16"`` or ``"bf16"``: the half type the mode uses.
        status (str): ``"ok"`` or ``"failed"``.
        error (str or None): ``"ExceptionType: message"`` when failed.
        device (str): where it ran.
        iters (int): timed steps. warmup (int): untimed steps before them.
        time_per_iter_s (float or None): median time of a timed step, seconds.
        time_per_iter_mean_s (float or None): mean time of a timed step, seconds.
        time_per_iter_iqr_s (float or None): interquartile range of the timed steps' times
            (third minus first quartile, ``statistics.quantiles(method="inclusive")``; None
            for one step, which has no spread to measure), seconds: the timing noise next to
            the median.
        time_per_iter_min_s, time_per_iter_max_s (float or None): the fastest and the slowest
            timed step, seconds.
        total_time_s (float or None): wall time of all timed steps, the loop's own work between
            them included (so ``total_time_s / iters >= time_per_iter_mean_s``).
        peak_memory_mb (float or None): peak memory the mode added, MiB (see module docs).
        final_loss (float or None): mean loss of the last pass over the batch pool, its
            steps whose loss was inf or NaN left out (a forward overflow, which dynamic loss
            scaling skips, is not a diverged run); NaN when the last step's loss is not
            finite: the training diverged (see :attr:`diverged`).
        skipped_steps (int or None): optimizer steps skipped because of inf/NaN gradients
            (dynamic loss scaling); None when it could not be determined.
        losses (list of float): every step's loss, warm-up included.
        step_times_s (list of float): every timed step's time.
        extra (dict): free-form details (e.g. the norm layer).
    """

    mode: str
    label: str
    dtype: str
    status: str = "ok"
    error: Optional[str] = None
    device: str = "cpu"
    iters: int = 0
    warmup: int = 0
    time_per_iter_s: Optional[float] = None
    time_per_iter_mean_s: Optional[float] = None
    time_per_iter_iqr_s: Optional[float] = None
    time_per_iter_min_s: Optional[float] = None
    time_per_iter_max_s: Optional[float] = None
    total_time_s: Optional[float] = None
    peak_memory_mb: Optional[float] = None
    final_loss: Optional[float] = None
    skipped_steps: Optional[int] = None
    losses: List[float] = dataclasses.field(default_factory=list)
    step_times_s: List[float] = dataclasses.field(default_factory=list)
    extra: Dict[str, object] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def diverged(self) -> bool:
        """The mode ran (``status == "ok"``) but its final loss is NaN or inf (e.g. pure fp16
        with Adam, whose state is fp16 too: docs/amp.md, "Optimizer state")."""
        return self.ok and self.final_loss is not None and not math.isfinite(self.final_loss)

    def to_dict(self) -> dict:
        """A JSON-ready dict of every field plus ``diverged`` (non-finite floats become
        None)."""
        out = dataclasses.asdict(self)
        out["diverged"] = self.diverged
        out["losses"] = [_finite_or_none(v) for v in self.losses]
        if out["final_loss"] is not None:
            out["final_loss"] = _finite_or_none(out["final_loss"])
        return out


def _final_loss(window: List[float]) -> float:
    """The mean of ``window``'s finite losses; NaN when its last loss is not finite (the
    rule the plot's "(diverged)" label follows too)."""
    finite = [v for v in window if math.isfinite(v)]
    if not finite or not math.isfinite(window[-1]):
        return math.nan
    return sum(finite) / len(finite)


def _finite_or_none(v):
    return v if v is None or math.isfinite(v) else None


def mode_dtype_name(mode: str, dtype: torch.dtype) -> str:
    """The dtype column of ``mode`` at half type ``dtype``: fp32 for the fp32 modes."""
    return "fp32" if mode in ("fp32", "O0") else _DTYPE_NAMES.get(dtype, str(dtype))


def mode_label(mode: str, dtype: torch.dtype) -> str:
    """The display name of ``mode`` at half type ``dtype``.

    Example::

        >>> mode_label("autocast", torch.float16)
        'autocast+GradScaler'
        >>> mode_label("half", torch.bfloat16)
        '.bfloat16()'
    """
    if mode == "autocast":
        return "autocast+GradScaler" if dtype == torch.float16 else "autocast"
    if mode == "half":
        return ".half()" if dtype == torch.float16 else ".bfloat16()"
    return mode


# --------------------------------------------------------------------------------------------
# Memory measurement
# --------------------------------------------------------------------------------------------
def _rss_reader() -> Optional[Callable[[], int]]:
    """A cheap function returning the current RSS in bytes, or None if there is none."""
    if sys.platform.startswith("linux") and os.path.exists("/proc/self/statm"):
        page = os.sysconf("SC_PAGE_SIZE")

        def read() -> int:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * page

        return read
    try:
        import psutil
    except ImportError:
        return None
    proc = psutil.Process()
    return lambda: proc.memory_info().rss


def cpu_memory_readable() -> bool:
    """Whether CPU peak memory can be measured here (``/proc`` or ``psutil``)."""
    return _rss_reader() is not None


def _release_free_heap() -> None:
    # glibc keeps freed memory for reuse; hand it back so the next mode's RSS growth is its own.
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def _read_hwm_bytes() -> int:
    """The kernel's peak RSS of this process (``VmHWM``), bytes."""
    with open(_STATUS, "rb") as f:
        for line in f:
            if line.startswith(b"VmHWM:"):
                return int(line.split()[1]) * 1024  # in kB
    raise OSError(f"no VmHWM line in {_STATUS}")


def _reset_hwm() -> bool:
    """Reset the kernel's peak RSS to the current RSS; False where that is not possible."""
    read = _rss_reader()
    if read is None or not os.path.exists(_CLEAR_REFS):
        return False
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")  # "5": reset the peak RSS only (Linux >= 4.0)
        # An older kernel takes the write and ignores it: the peak must now be the current RSS
        # (give it some slack for pages touched in between).
        return _read_hwm_bytes() <= read() + 2**20
    except (OSError, ValueError):
        return False


class _CpuPeakMemory:
    """Peak RSS growth over the start (``peak_mb``): the kernel's high-water mark where it can
    be reset (Linux), else RSS samples from a background thread and from :meth:`sample`;
    None where the RSS cannot be read (no ``/proc``, no ``psutil``)."""

    # Only the fallback samples. Every 10 ms, not 2: a thread waking 500 times a second
    # competes with the timed steps of a small CPU run for the GIL and the cores, and the
    # bench's CPU workloads showed the same peaks at 10 ms (the runner also samples after
    # every step).
    def __init__(self, interval_s: float = 0.01):
        self._read = _rss_reader()
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._hwm = False
        self._base = 0
        self._peak = 0

    def sample(self) -> None:
        if self._read is not None and not self._hwm:
            self._peak = max(self._peak, self._read())

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def __enter__(self) -> _CpuPeakMemory:
        gc.collect()
        _release_free_heap()
        if self._read is not None:
            self._hwm = _reset_hwm()
            self._base = self._peak = self._read()
            if not self._hwm:
                self._thread = threading.Thread(
                    target=self._loop, name="mixprec-rss", daemon=True
                )
                self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._hwm:
            self._peak = max(self._peak, _read_hwm_bytes())
        elif self._thread is not None:
            self._thread.join()
            self.sample()

    @property
    def peak_mb(self) -> Optional[float]:
        if self._read is None:
            return None
        return max(0, self._peak - self._base) / 2**20


class _CudaPeakMemory:
    def __init__(self, device: torch.device):
        self._device = device
        self._base = 0
        self._peak = 0
        self._warm_peak = 0
        self._steady_peak: Optional[int] = None
        self.total_peak_mb = 0.0

    def sample(self) -> None:
        pass

    def start_steady(self) -> None:
        """From here on (the timed steps) also track a separate peak: the warm-up steps hold
        one-off allocations (cuDNN's algorithm search with cudnn.benchmark, optimizer state
        created lazily) that the training steps after them do not need."""
        torch.cuda.synchronize(self._device)
        self._warm_peak = torch.cuda.max_memory_allocated(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        self._steady_peak = 0

    def __enter__(self) -> _CudaPeakMemory:
        gc.collect()
        torch.cuda.synchronize(self._device)
        torch.cuda.empty_cache()
        self._base = torch.cuda.memory_allocated(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self._device)
        peak = torch.cuda.max_memory_allocated(self._device)
        if self._steady_peak is not None:
            self._steady_peak = peak
        self._peak = max(peak, self._warm_peak)
        self.total_peak_mb = self._peak / 2**20

    @property
    def peak_mb(self) -> float:
        return max(0, self._peak - self._base) / 2**20

    @property
    def steady_peak_mb(self) -> Optional[float]:
        """Peak over the timed steps only (None when ``start_steady`` was not called)."""
        if self._steady_peak is None:
            return None
        return max(0, self._steady_peak - self._base) / 2**20


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------
class _StepTimer:
    """Per-step times without a host sync per step on CUDA (events, read at the end)."""

    def __init__(self, device: torch.device, n: int):
        self._cuda = device.type == "cuda"
        self._device = device
        if self._cuda:
            self._events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(n)
            ]
        self._cpu_times: List[float] = []
        self._t0 = 0.0
        self._wall0 = 0.0
        self.wall_s = 0.0

    def start_all(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self._device)
        self._wall0 = time.perf_counter()

    def stop_all(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self._device)
        self.wall_s = time.perf_counter() - self._wall0

    def start(self, i: int) -> None:
        if self._cuda:
            self._events[i][0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self, i: int) -> None:
        if self._cuda:
            self._events[i][1].record()
        else:
            self._cpu_times.append(time.perf_counter() - self._t0)

    def times_s(self) -> List[float]:
        if self._cuda:
            return [a.elapsed_time(b) / 1000.0 for a, b in self._events]
        return list(self._cpu_times)


# --------------------------------------------------------------------------------------------
# Recipes: each returns a step function ``step(x, y) -> loss`` plus a skip counter.
# --------------------------------------------------------------------------------------------
class _Recipe:
    """Builds the model and optimizer for a mode and runs its training step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn):
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.skipped = 0
        self.skips_known = True

    def step(self, x, y) -> torch.Tensor:
        raise NotImplementedError

    def finish(self) -> None:
        """Called once after the last step (to derive skipped-step counts)."""


class _Fp32Recipe(_Recipe):
    def step(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss


class _HalfRecipe(_Recipe):
    def __init__(self, model, optimizer, loss_fn, dtype):
        super().__init__(model, optimizer, loss_fn)
        self.dtype = dtype

    def step(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        # The data loader gives fp32: casting is part of this recipe's cost, as it is of O2's.
        if x.is_floating_point():
            x = x.to(self.dtype)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss


def _grad_scaler(device_type: str):
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device_type)
    if device_type == "cuda":  # torch < 2.3
        return torch.cuda.amp.GradScaler()
    raise RuntimeError(
        f"this torch ({torch.__version__}) has no GradScaler for device type {device_type!r}; "
        "use --dtype bf16 (no loss scaling needed) or a newer torch."
    )


class _AutocastRecipe(_Recipe):
    def __init__(self, model, optimizer, loss_fn, dtype, device_type):
        super().__init__(model, optimizer, loss_fn)
        self.dtype = dtype
        self.device_type = device_type
        # fp16 needs loss scaling; bf16 has fp32's exponent range and does not.
        self.scaler = _grad_scaler(device_type) if dtype == torch.float16 else None
        self._scale0 = self.scaler.get_scale() if self.scaler is not None else None
        self.steps = 0

    def step(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device_type, dtype=self.dtype):
            loss = self.loss_fn(self.model(x), y)
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.steps += 1
        return loss

    def finish(self):
        if self.scaler is None:
            return
        # Reading the scale each step would add a host sync per step to this recipe only;
        # instead count the halvings. Exact while no growth happened (growth_interval = 2000)
        # and the scale is still above 0: GradScaler's fp32 scale underflows to 0 after ~165
        # halvings in a row (a diverged run), and from there on its skips no longer show.
        end = self.scaler.get_scale()
        self.skipped = _halvings(self._scale0, end)
        self.skips_known = self.steps < 2000 and end > 0


def _halvings(start: float, end: float) -> int:
    if not (start > 0 and end > 0):
        return 0
    return max(0, int(round(math.log2(start / end))))


class _AmpRecipe(_Recipe):
    def __init__(self, model, optimizer, loss_fn, opt_level, dtype, amp_module):
        self.amp = amp_module
        model, optimizer = amp_module.initialize(
            model, optimizer, opt_level=opt_level, dtype=dtype, verbosity=0
        )
        super().__init__(model, optimizer, loss_fn)

    def step(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        with self.amp.scale_loss(loss, self.optimizer) as scaled:
            scaled.backward()
        self.optimizer.step()
        return loss

    def finish(self):
        # amp's own count of the skipped steps, read once at the end (asking
        # amp.step_was_skipped every step would add a host sync per step). Exact wherever the
        # scale lives; the scale's halvings, counted for GradScaler, stop at amp's 2**-24
        # floor (a run overflowing at every step showed 40 of its 43 skips). amp.state_dict()
        # first: it collects the overflows flagged on the device.
        from mixprec.amp._state import optimizer_state

        self.amp.state_dict()
        self.skipped = optimizer_state(self.optimizer).amp_state.overflow_log.count
        self.skips_known = True


def _import_amp():
    try:
        from mixprec import amp
    except ImportError as exc:
        raise RuntimeError(f"mixprec.amp is not importable: {exc}") from exc
    return amp


def _freeze_batchnorm(model: nn.Module) -> int:
    """Put every BatchNorm layer in eval mode (running statistics frozen), the rest training."""
    n = 0
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            m.eval()
            n += 1
    return n


def _build_model(workload: Workload, device: torch.device) -> nn.Module:
    # Built directly on the device: initialising a 200M-parameter model on the CPU takes
    # seconds per mode. The seed set by the caller makes every build identical.
    with torch.device(device):
        model = workload.build_model()
    return model.to(device)


def _build_recipe(workload, mode, dtype, device, channels_last, frozen_bn) -> _Recipe:
    model = _build_model(workload, device)
    if channels_last and workload.image:
        model = model.to(memory_format=torch.channels_last)
    if mode == "half":
        model = model.to(dtype)  # before the optimizer, which must see the half parameters
    optimizer = workload.build_optimizer(model.parameters(), device)
    if mode == "fp32":
        recipe: _Recipe = _Fp32Recipe(model, optimizer, workload.loss_fn)
    elif mode == "half":
        recipe = _HalfRecipe(model, optimizer, workload.loss_fn, dtype)
    elif mode == "autocast":
        recipe = _AutocastRecipe(model, optimizer, workload.loss_fn, dtype, device.type)
    else:
        recipe = _AmpRecipe(model, optimizer, workload.loss_fn, mode, dtype, _import_amp())
    recipe.model.train()
    if frozen_bn:
        _freeze_batchnorm(recipe.model)
    return recipe


@contextlib.contextmanager
def _cudnn_benchmark(enabled: bool):
    # Let cuDNN pick the fastest convolution for each shape (during the warm-up steps); the
    # global flag is restored afterwards.
    prev = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = prev


def _indexed(device) -> torch.device:
    """``device`` as a torch.device; plain ``"cuda"`` as the current CUDA device
    (``cuda:0``), so every row of a run names its device the same way."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_args(fn: str, dtype, iters, warmup) -> None:
    """Raise for arguments no mode can run with; ``fn`` names the caller in the message."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"{fn}(dtype={dtype!r}): dtype must be a torch.dtype, torch.float16 or "
            "torch.bfloat16; pass e.g. dtype=torch.bfloat16 (or mixprec.bench.runner.DTYPES"
            "['bf16'])."
        )
    if dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"{fn}(dtype={dtype}): dtype must be torch.float16 or torch.bfloat16, the half type "
            "the mixed-precision modes use; the 'fp32' and 'O0' modes stay fp32 whatever it is, "
            "so pass dtype=torch.bfloat16 (or float16) and run those modes for fp32."
        )
    for name, value, low, example in (("iters", iters, 1, 40), ("warmup", warmup, 0, 3)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(
                f"{fn}({name}={value!r}): {name} must be an int >= {low}, not "
                f"{type(value).__name__}; pass e.g. {name}={example}."
            )
        if value < low:
            raise ValueError(
                f"{fn}({name}={value!r}): {name} must be an int >= {low}; pass e.g. "
                f"{name}={example}."
            )


def run_mode(
    workload: Workload,
    mode: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    iters: int = 40,
    warmup: int = 3,
    channels_last: bool = False,
    frozen_bn: bool = False,
    seed: int = 0,
    cudnn_benchmark: bool = True,
    progress: Optional[ProgressFn] = None,
) -> ModeResult:
    """Train ``workload`` for ``warmup + iters`` steps under ``mode`` and measure it.

    Args:
        workload (Workload): from :func:`mixprec.bench.models.build_workload`; its batches
            must already be on ``device``.
        mode (str): one of :data:`MODES`.
        dtype (torch.dtype): the half type, ``torch.float16`` or ``torch.bfloat16``. Default
            ``torch.bfloat16``. Ignored by ``"fp32"``; ``"O0"`` accepts it and stays fp32.
        device (str or torch.device): where to train. Default ``"cpu"``.
        iters (int): timed steps. Default ``40`` (the seed's unit).
        warmup (int): untimed steps first (cuDNN autotuning, allocator growth). Default ``3``.
        channels_last (bool): NHWC memory format for image models. Default ``False``.
        frozen_bn (bool): BatchNorm layers in eval mode while the rest trains. Default
            ``False``.
        seed (int): seeds the model's initialisation. Default ``0``.
        cudnn_benchmark (bool): set ``torch.backends.cudnn.benchmark`` while running.
            Default ``True``.
        progress (callable, optional): ``progress(mode, step)`` after every step.

    Returns:
        ModeResult: with ``status="ok"``. Errors propagate; :func:`run_modes` catches them.

    Example::

        >>> from mixprec.bench.models import build_workload
        >>> wl = build_workload("cnn", batch_size=8)
        >>> r = run_mode(wl, "fp32", iters=2, warmup=1)
        >>> r.status, len(r.losses)
        ('ok', 3)
    """
    if mode not in MODES:
        raise ValueError(f"run_mode(mode={mode!r}): mode must be one of {MODES}.")
    _check_args("run_mode", dtype, iters, warmup)
    device = _indexed(device)
    result = ModeResult(
        mode=mode,
        label=mode_label(mode, dtype),
        dtype=mode_dtype_name(mode, dtype),
        device=str(device),
        iters=iters,
        warmup=warmup,
    )
    batches = workload.batches
    if channels_last and workload.image:
        batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
    total = warmup + iters
    memory = _CudaPeakMemory(device) if device.type == "cuda" else _CpuPeakMemory()
    recipe = None
    try:
        # On CUDA, make the mode's device current: the timing events record on its stream.
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with on_device, _cudnn_benchmark(cudnn_benchmark), memory:
            torch.manual_seed(seed)
            recipe = _build_recipe(workload, mode, dtype, device, channels_last, frozen_bn)
            losses = torch.empty(total, dtype=torch.float32, device=device)
            timer = _StepTimer(device, iters)
            for i in range(total):
                if i == warmup:
                    if isinstance(memory, _CudaPeakMemory):
                        memory.start_steady()
                    timer.start_all()
                x, y = batches[i % len(batches)]
                if i >= warmup:
                    timer.start(i - warmup)
                loss = recipe.step(x, y)
                if i >= warmup:
                    timer.stop(i - warmup)
                # A device-side copy: no host sync inside the timed loop.
                losses[i].copy_(loss.detach())
                memory.sample()
                if progress is not None:
                    progress(mode, i)
            timer.stop_all()
            recipe.finish()
        result.losses = losses.tolist()
        result.step_times_s = timer.times_s()
        result.total_time_s = timer.wall_s
        times = result.step_times_s
        result.time_per_iter_s = statistics.median(times)
        result.time_per_iter_mean_s = statistics.fmean(times)
        if len(times) > 1:
            q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
            result.time_per_iter_iqr_s = q3 - q1
        result.time_per_iter_min_s = min(times)
        result.time_per_iter_max_s = max(times)
        result.peak_memory_mb = memory.peak_mb
        if isinstance(memory, _CudaPeakMemory):
            result.extra["peak_memory_total_mb"] = memory.total_peak_mb
            result.extra["peak_memory_steady_mb"] = memory.steady_peak_mb
        result.final_loss = _final_loss(result.losses[-min(len(batches), total) :])
        result.skipped_steps = recipe.skipped if recipe.skips_known else None
    finally:
        # Free this mode's model, optimizer and amp state before the next mode measures (on
        # CPU the next mode's gc.collect() in its memory probe does the rest: a full
        # collection costs a noticeable fraction of a small CPU run).
        del recipe
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    return result


def warm_up_process(workload: Workload, device="cpu", dtype: Optional[torch.dtype] = None) -> None:
    """Throw-away training steps (fp32, and autocast at ``dtype`` if given), so that one-time
    costs of the process (thread pools, kernel libraries, cuBLAS workspaces, lazily loaded
    code) are not charged to the memory and time of whichever mode happens to run first.

    Args:
        workload (Workload): the benchmark (its first batch is used).
        device (str or torch.device): where to run. Default ``"cpu"``.
        dtype (torch.dtype, optional): also warm up autocast in this half type.
    """
    device = torch.device(device)
    model = _build_model(workload, device)
    optimizer = workload.build_optimizer(model.parameters(), device)
    x, y = workload.batches[0]
    _Fp32Recipe(model, optimizer, workload.loss_fn).step(x, y)
    if dtype is not None:
        try:
            with torch.autocast(device.type, dtype=dtype):
                loss = workload.loss_fn(model(x), y)
            loss.backward()
        except Exception:  # noqa: BLE001 - the dtype's own mode will report the failure
            logger.debug("autocast warm-up at %s failed", dtype, exc_info=True)
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


#: The keyword arguments :func:`run_modes` passes through to :func:`run_mode`, with
#: run_mode's defaults.
_RUN_MODE_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(run_mode).parameters.items()
    if name not in ("workload", "mode", "dtype", "progress")
}


def _check_run_modes_args(modes, dtype, kwargs) -> None:
    if isinstance(modes, str):
        raise TypeError(
            f"run_modes(modes={modes!r}): modes must be a sequence of mode names, not one "
            f"string; pass e.g. modes=[{modes!r}]."
        )
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"run_modes(modes={list(modes)!r}): unknown {bad}; allowed: {MODES}.")
    allowed = tuple(_RUN_MODE_DEFAULTS)
    for name in kwargs:
        if name not in allowed:
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise TypeError(
                f"run_modes() got an unexpected keyword argument {name!r}; the keywords it "
                f"passes to run_mode are {', '.join(allowed)}{hint}"
            )
    options = {**_RUN_MODE_DEFAULTS, **kwargs}
    _check_args("run_modes", dtype, options["iters"], options["warmup"])
    device = options["device"]
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(
            f"run_modes(device={device!r}): not a device ({exc}); pass e.g. device='cpu' or "
            "device='cuda'."
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"run_modes(device={str(device)!r}): CUDA is not available in this torch build or "
            "machine; pass device='cpu'."
        )


def run_modes(
    workload: Workload,
    modes: Sequence[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    progress: Optional[ProgressFn] = None,
    process_warmup: bool = True,
    on_result: Optional[Callable[[ModeResult], None]] = None,
    **kwargs,
) -> List[ModeResult]:
    """Run several modes one after the other; a mode that raises becomes a failed row.

    The arguments are checked once, before anything runs: a mistake in them (``iters=0``,
    ``dtype=torch.float32``, a misspelled keyword) raises instead of failing every mode.

    Args:
        workload (Workload): the benchmark.
        modes (sequence of str): modes from :data:`MODES`, run in this order.
        dtype (torch.dtype): the half type. Default ``torch.bfloat16``.
        progress (callable, optional): see :func:`run_mode`.
        process_warmup (bool): first run :func:`warm_up_process`. Default ``True``.
        on_result (callable, optional): ``on_result(row)`` as each mode finishes (failed
            rows too), e.g. to keep the finished rows when the run is interrupted
            (``KeyboardInterrupt`` is not caught here). Default None.
        **kwargs: passed to :func:`run_mode` (device, iters, warmup, channels_last, frozen_bn,
            seed, cudnn_benchmark).

    Returns:
        list of ModeResult, one per mode, failed ones with ``status="failed"`` and ``error``.

    Raises:
        ValueError, TypeError: an unknown mode or keyword, a dtype other than float16 or
            bfloat16, ``iters < 1``, ``warmup < 0``, a device that is not one.

    Example::

        >>> from mixprec.bench.models import build_workload
        >>> rows = run_modes(build_workload("cnn", batch_size=8), ["fp32", "half"], iters=2)
        >>> [r.mode for r in rows]
        ['fp32', 'half']
    """
    _check_run_modes_args(modes, dtype, kwargs)
    device = kwargs.get("device", _RUN_MODE_DEFAULTS["device"])
    if process_warmup:
        try:
            warm_up_process(workload, device=device, dtype=dtype)
        except Exception:  # noqa: BLE001 - e.g. fp32 out of memory: the modes report their own
            logger.debug("process warm-up failed; running the modes anyway", exc_info=True)
            gc.collect()
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    results = []
    for mode in modes:
        try:
            row = run_mode(workload, mode, dtype=dtype, progress=progress, **kwargs)
        except Exception as exc:  # noqa: BLE001 - one failing recipe must not stop the others
            logger.debug("mode %s failed", mode, exc_info=True)
            row = ModeResult(
                mode=mode,
                label=mode_label(mode, dtype),
                dtype=mode_dtype_name(mode, dtype),
                status="failed",
                error=f"{type(exc).__name__}: {exc}",
                device=str(_indexed(device)),
                iters=kwargs.get("iters", _RUN_MODE_DEFAULTS["iters"]),
                warmup=kwargs.get("warmup", _RUN_MODE_DEFAULTS["warmup"]),
            )
        results.append(row)
        if on_result is not None:
            on_result(row)
    return results
