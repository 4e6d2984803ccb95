"""Loss scaling: the scale policy and the fused unscale + inf/NaN check."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from mixprec.normalization._launch import is_compiling, outside_the_compiler

__all__ = ["LossScaler", "check_scale_order", "unscale_grads_"]


def _as_number(value) -> Optional[float]:
    """``value`` as a float (a Python or NumPy number, a string holding one, a one-element
    tensor), or None for a bool or anything ``float()`` refuses; inf for an integer too large
    for a float (``10**400``), which the callers' range checks then refuse."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf
    except (TypeError, ValueError, RuntimeError):
        return None


def _check_scale(name: str, value, alternative: str = "") -> float:
    """A loss scale argument: a finite number > 0."""
    number = _as_number(value)
    if number is None or not 0 < number < math.inf:
        raise ValueError(f"LossScaler({name}={value!r}): must be a finite number > 0"
                         + (f", {alternative}." if alternative else "."))
    return number


def check_scale_order(where: str, min_loss_scale, max_loss_scale, shown=None) -> None:
    """A floor above the ceiling: a ValueError naming ``where`` (``shown``: the ceiling as
    passed, when ``max_loss_scale`` is its parsed value)."""
    if min_loss_scale is not None and min_loss_scale > max_loss_scale:
        shown = max_loss_scale if shown is None else shown
        raise ValueError(
            f"{where}(min_loss_scale={min_loss_scale!r}, max_loss_scale={shown!r}): "
            "min_loss_scale must not exceed max_loss_scale.")


class LossScaler:
    """A static or dynamic loss scale, one per loss (``loss_id``).

    Dynamic policy (Apex's): start at ``init_scale``; halve on a step whose gradients hold an
    inf/NaN (that step is skipped); double after ``scale_window`` clean steps in a row; always
    stay within ``[min_loss_scale, max_loss_scale]``.

    Args:
        loss_scale (float or str): a fixed scale, or ``"dynamic"``. Default ``"dynamic"``.
        init_scale (float): first dynamic scale. Default ``2.**16``.
        scale_factor (float): growth/back-off factor. Default ``2.0``.
        scale_window (int): clean steps before growth. Default ``2000``.
        min_loss_scale (float, optional): floor of the dynamic scale. Default ``None`` (1/2**24
            is used, far below any useful scale, so a diverged run keeps skipping steps
            instead of dividing by zero).
        max_loss_scale (float): ceiling of the dynamic scale. Default ``2.**24``.

    Example::

        >>> scaler = LossScaler("dynamic")
        >>> scaler.loss_scale
        65536.0
        >>> scaler.update(found_inf=True)   # overflow: back off, skip the step
        True
        >>> scaler.loss_scale
        32768.0
    """

    def __init__(
        self,
        loss_scale="dynamic",
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: Optional[float] = None,
        max_loss_scale: float = 2.0**24,
    ):
        self.dynamic = isinstance(loss_scale, str) and loss_scale == "dynamic"
        if not self.dynamic:
            loss_scale = _check_scale("loss_scale", loss_scale, 'or "dynamic"')
        init_scale = _check_scale("init_scale", init_scale)
        factor = _as_number(scale_factor)
        if factor is None or not 1 < factor < math.inf:
            raise ValueError(
                f"LossScaler(scale_factor={scale_factor!r}): must be a finite number > 1 (the "
                "scale is multiplied by it after scale_window clean steps and divided by it on "
                "an overflow; Apex's is 2.0).")
        window = _as_number(scale_window)
        if window is None or not window.is_integer() or window < 1:
            raise ValueError(f"LossScaler(scale_window={scale_window!r}): must be a whole number "
                             ">= 1 (the clean steps before the scale grows; Apex's is 2000).")
        if min_loss_scale is not None:
            min_loss_scale = _check_scale("min_loss_scale", min_loss_scale, "or None (2**-24)")
        ceiling = _as_number(max_loss_scale)
        if ceiling is None or not ceiling > 0:
            raise ValueError(f"LossScaler(max_loss_scale={max_loss_scale!r}): must be a "
                             "number > 0 (the dynamic scale's ceiling; the default is 2.**24).")
        check_scale_order("LossScaler", min_loss_scale, ceiling, max_loss_scale)
        self._min = min_loss_scale if min_loss_scale is not None else 2.0**-24
        self._max = ceiling
        if self.dynamic:
            self._scale = min(max(init_scale, self._min), self._max)
        else:
            self._scale = loss_scale
        self._factor = factor
        self._window = int(window)
        self._unskipped = 0
        # Counts the updates and loads that may have moved the scale (a cheap "unchanged"
        # test for gradients held at it; a device scale cannot be compared without a sync).
        self.changes = 0
        # Cached device tensors of 1/scale, refreshed only when the scale moves.
        self._inv_scale_cache: Dict[torch.device, Tuple[float, torch.Tensor]] = {}
        # The dynamic scale kept on the gradients' device (see ``on_device``), or None.
        self._dev: Optional[_DeviceScale] = None
        # The most recent update's overflow: a bool, or the device flag it was given.
        self._last_found = False

    @property
    def loss_scale(self) -> float:
        """The current scale. A Python float; reading it costs a device sync only while the
        scale lives on the device (``on_device``)."""
        self._pull()
        return self._scale

    @property
    def found_overflow(self) -> bool:
        """Whether the most recent update saw an inf/NaN (its step was skipped). Reading it
        costs a device sync while the scale lives on the device."""
        found = self._last_found
        return bool(found.item()) if isinstance(found, torch.Tensor) else found

    @property
    def on_device(self) -> Optional[torch.device]:
        """The device holding the dynamic scale, or None while the host holds it."""
        return None if self._dev is None else self._dev.scale.device

    def device_state(self, device: torch.device) -> _DeviceScale:
        """Keep the dynamic scale on ``device`` from now on, and return its tensors.

        On the device the scale is updated by a kernel (``update_on_device``), never read by
        the host, so a step needs no host-device sync and can be captured in a CUDA graph. The
        tensors are created once and then only updated in place: a captured graph keeps
        pointing at them.
        """
        if self._dev is not None and self._dev.scale.device == device:
            return self._dev
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "amp.scale_loss: the first step with dynamic loss scaling on this device is "
                "being captured in a CUDA graph. Run at least one step eagerly before capture "
                "(the usual warm-up), so that the loss scale's device tensors exist."
            )
        self.release_device()
        self._dev = _DeviceScale(
            scale=torch.full((), self._scale, dtype=torch.float32, device=device),
            inv=torch.full((), 1.0 / self._scale, dtype=torch.float32, device=device),
            tracker=torch.full((), self._device_count(), dtype=torch.int32, device=device),
        )
        return self._dev

    def release_device(self) -> None:
        """Bring the dynamic scale back to the host (one device sync, if it was there)."""
        self._pull()
        self._dev = None

    def _pull(self) -> None:
        if self._dev is not None:
            self._scale = float(self._dev.scale.item())
            self._unskipped = int(self._dev.tracker.item())

    def update_on_device(self, found_inf: torch.Tensor) -> None:
        """``update`` done by kernels on the scale's device: ``found_inf`` (a 0-dim fp32 tensor,
        non-zero for an overflow) is never read by the host. Same policy as ``update``."""
        dev = self._dev
        self.changes += 1
        self._last_found = found_inf
        torch._amp_update_scale_(dev.scale, dev.tracker, found_inf, self._factor,
                                 1.0 / self._factor, self._window)
        dev.scale.clamp_(self._min, self._max)
        torch.reciprocal(dev.scale, out=dev.inv)

    def inv_scale(self, device: torch.device) -> torch.Tensor:
        """``1 / loss_scale`` as a 0-dim fp32 tensor on ``device`` (cached until the scale
        moves; the device-held one while the scale lives there)."""
        if self._dev is not None and self._dev.inv.device == device:
            return self._dev.inv
        if is_compiling():
            # Traced, the cache test below reads the Python float scale, which Dynamo guards
            # by its value: a compiled training step recompiled for every new dynamic scale
            # until its recompile limit, then ran that frame eagerly. Looked up eagerly, the
            # tensor enters the graph as an input (a graph break).
            return outside_the_compiler(LossScaler._inv_scale_on_host)(self, device)
        return self._inv_scale_on_host(device)

    def _inv_scale_on_host(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_scale_cache.get(device)
        if cached is None or cached[0] != self._scale:
            # Reciprocal in fp64 before rounding to fp32: 1/scale is exact for powers of two
            # and as close as fp32 allows otherwise.
            tensor = torch.full((), 1.0 / self._scale, dtype=torch.float32, device=device)
            cached = (self._scale, tensor)
            self._inv_scale_cache[device] = cached
        return cached[1]

    def update(self, found_inf: bool) -> bool:
        """Apply one step's outcome to the scale (host-held scale; see ``update_on_device``).

        Args:
            found_inf (bool): whether the step's gradients held an inf or NaN.

        Returns:
            bool: True when the step must be skipped (dynamic scaling and an overflow).
        """
        if not self.dynamic:
            # A static scale never moves, but counts its steps as Apex's did (scripts read
            # the count to tell a taken step from a skipped one).
            self._unskipped += 1
            return False
        self.release_device()
        self.changes += 1
        self._last_found = bool(found_inf)
        skip = bool(found_inf)
        if skip:
            self._scale /= self._factor
            self._unskipped = 0
        else:
            self._unskipped += 1
            if self._unskipped >= self._window:
                self._scale *= self._factor
                self._unskipped = 0
        # Within [min, max] after every update, as update_on_device's kernels keep it: a scale
        # set outside them (a checkpoint saved with a higher max_loss_scale, Apex's
        # `_loss_scale` written by hand) comes back at the first update either way.
        self._scale = min(self._max, max(self._min, self._scale))
        return skip

    def state_dict(self) -> dict:
        """Apex's format: ``{"loss_scale": float, "unskipped": int}``."""
        self._pull()
        return {"loss_scale": self._scale, "unskipped": self._unskipped}

    def load_state_dict(self, state: dict) -> None:
        try:
            if isinstance(state["loss_scale"], bool) or isinstance(state["unskipped"], bool):
                raise TypeError  # (a flag, not a scale or a count: as the constructor refuses)
            scale, unskipped = float(state["loss_scale"]), int(state["unskipped"])
        # (RuntimeError: a meta tensor. OverflowError: an infinite count, int(inf), or an
        # integer scale too large for a float.)
        except (KeyError, TypeError, ValueError, RuntimeError, OverflowError):
            raise ValueError(
                f"LossScaler.load_state_dict: expected {{'loss_scale': float, 'unskipped': "
                f"int}}, got {state!r}."
            ) from None
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(
                f"LossScaler.load_state_dict: loss_scale={scale} must be a finite number > 0 "
                "(a checkpoint's scale is the one its run last used; a non-finite one means the "
                "saved state is corrupt: load an earlier checkpoint, or leave the amp state out "
                "to start from the initial scale).")
        if unskipped < 0 or unskipped != float(state["unskipped"]):
            # A count of clean steps: a negative one silently delayed the next growth, and a
            # fractional one was truncated.
            raise ValueError(f"LossScaler.load_state_dict: unskipped={state['unskipped']!r} "
                             "must be an int >= 0.")
        self.set_state(scale, unskipped)

    def set_state(self, loss_scale: Optional[float] = None,
                  unskipped: Optional[int] = None) -> None:
        """Set the scale and/or the clean-step count now (where they live: host or device).

        For restoring and for Apex scripts that set ``_loss_scale`` directly; the values are
        taken as they are (a dynamic scale outside ``[min, max]`` is clamped at its next
        update). Callers check them.
        """
        if loss_scale is None or unskipped is None:
            self._pull()  # (the value not given stays as it is now)
        if loss_scale is not None:
            self._scale = float(loss_scale)
        if unskipped is not None:
            self._unskipped = int(unskipped)
        self.changes += 1
        if self._dev is not None:  # in place: a captured graph may hold these tensors
            self._dev.scale.fill_(self._scale)
            self._dev.inv.fill_(1.0 / self._scale)
            self._dev.tracker.fill_(self._device_count())

    def set_window(self, window: int) -> None:
        """Set the clean steps before growth (Apex's ``_scale_seq_len``) now. A count already
        at or past a shorter window grows the scale at the next clean step, on the host as
        on the device (whose tracker is capped again, see :meth:`_device_count`: left past
        the window, the kernel never grew the scale again)."""
        self._pull()
        self._window = int(window)
        if self._dev is not None:
            self._dev.tracker.fill_(self._device_count())

    def _device_count(self) -> int:
        """The clean-step count as the device's tracker holds it.

        PyTorch's update kernel grows the scale only when the count *equals* the window, where
        ``update`` grows it once the count reaches it (>=). A count put at or past the window
        (a checkpoint saved with a longer window, a GradScaler's growth tracker) then never
        grew on the device until an overflow, while the host grew at the next clean step.
        Capped at window - 1, the kernel's ``count + 1 == window`` is the host's
        ``count + 1 >= window``; the kernel itself never counts past it.
        """
        return min(self._unskipped, self._window - 1) if self.dynamic else self._unskipped

    def __repr__(self) -> str:
        """The current scale and count: read from the device while it holds them (one sync,
        as ``loss_scale`` costs), except during CUDA graph capture, which forbids the read."""
        kind = "dynamic" if self.dynamic else "static"
        if self._dev is None:
            return f"LossScaler({kind}, loss_scale={self._scale}, unskipped={self._unskipped})"
        device = self._dev.scale.device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return f"LossScaler({kind}, on {device}, not read during CUDA graph capture)"
        self._pull()
        return (f"LossScaler({kind}, on {device}, loss_scale={self._scale}, "
                f"unskipped={self._unskipped})")


class _DeviceScale(NamedTuple):
    scale: torch.Tensor  # 0-dim fp32
    inv: torch.Tensor  # 0-dim fp32, 1 / scale
    tracker: torch.Tensor  # 0-dim int32, clean steps since the last change (Apex's "unskipped")


def _group_by_device_and_dtype(tensors: Sequence[torch.Tensor]):
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        if t.is_complex():
            # (A complex parameter's gradient, e.g. a spectral layer's: PyTorch's unscale
            # kernels take real tensors only, GradScaler's too. Its real view is the same
            # memory, two reals per element.)
            t = torch.view_as_real(t)
        groups[(t.device, t.dtype)].append(t)
    return groups


def unscale_grads_(
    grads: Sequence[torch.Tensor], scaler: LossScaler, check: bool,
    found: Optional[Dict[torch.device, torch.Tensor]] = None,
) -> Optional[List[torch.Tensor]]:
    """Multiply ``grads`` in place by ``1/scale`` and flag any inf/NaN.

    One fused foreach kernel per (device, dtype) does both the multiply and the check, so the
    gradients are read and written once. Nothing here synchronizes with the device.

    Args:
        grads: gradient tensors, modified in place.
        scaler: gives the scale.
        check: also look for inf/NaN (dynamic scaling).
        found: flags already set by an earlier pass over other gradients of this backward, by
            device; updated in place and returned with the rest.

    Returns:
        list of 0-dim fp32 tensors (one per device, 1.0 where an inf/NaN was seen) when
        ``check``; else None.
    """
    if not check and scaler.on_device is None and scaler.loss_scale == 1.0:
        return None  # (a static scale of 1, bf16's default: nothing to multiply or look for)
    found_by_device: Dict[torch.device, torch.Tensor] = {} if found is None else found
    for (device, dtype), group in _group_by_device_and_dtype(grads).items():
        inv = scaler.inv_scale(device)
        if check:
            flag = found_by_device.get(device)
            if flag is None:
                flag = torch.zeros((), dtype=torch.float32, device=device)
                found_by_device[device] = flag
        if any(g.requires_grad for g in group):
            # backward(create_graph=True) (O1, O3): the gradients carry a graph, which a
            # second derivative through them (a gradient penalty, a Hessian-vector product)
            # follows. The fused kernel below is not recorded by autograd: the graph would
            # still give the scaled gradient's derivative, loss-scale times too large. A
            # recorded multiply per tensor instead (a rare path), the check on the values.
            if check:
                with torch.no_grad():
                    _flag_non_finite([g.detach() for g in group], flag)
            if check or scaler.loss_scale != 1.0:
                inv_kept = inv.clone()  # (autograd keeps it: the scaler's own changes later)
                for g in group:
                    g.mul_(inv_kept)
        elif check and (dtype != torch.bfloat16 or device.type == "cpu"):
            # Sets `flag` to 1 where it sees an inf/NaN, never back to 0: one flag per device
            # serves every dtype group.
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
        elif check:
            # PyTorch's fused CUDA kernel has no bf16 variant (bf16 gradients reach here only at
            # O3 with dynamic scaling): an inf-norm per tensor flags inf/NaN, then multiply.
            _flag_non_finite(group, flag)
            torch._foreach_mul_(group, inv)
        elif scaler.loss_scale != 1.0:
            torch._foreach_mul_(group, inv)
    return list(found_by_device.values()) if check else None


def _flag_non_finite(tensors: List[torch.Tensor], flag: torch.Tensor) -> None:
    """Set ``flag`` to 1 where any of ``tensors`` holds an inf/NaN (an inf-norm per tensor),
    never back to 0. No host sync."""
    norms = torch._foreach_norm(tensors, float("inf"))
    torch.maximum(flag, (~torch.stack(norms).isfinite()).any().float(), out=flag)


def flag_non_finite_grads(grads: Sequence[torch.Tensor], flag: torch.Tensor) -> None:
    """:func:`_flag_non_finite` over gradients of any dtypes and layouts (a sparse one through
    its coalesced values), one group per dtype, all on ``flag``'s device. No host sync."""
    values = [g if g.layout is torch.strided else g.coalesce()._values() for g in grads]
    for dtype in {g.dtype for g in values}:
        _flag_non_finite([g for g in values if g.dtype == dtype], flag)


def any_flag_set(flags: Sequence[torch.Tensor]) -> bool:
    """Read the overflow flags: the one host-device sync of a step."""
    if not flags:
        return False
    if len(flags) == 1:
        return bool(flags[0].item())
    return any(bool(f.item()) for f in flags)
