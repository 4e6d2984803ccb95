"""Loss scaling: the scale policy and the fused unscale + inf/NaN check."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["LossScaler", "unscale_grads_"]


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
        self.dynamic = loss_scale == "dynamic"
        self._min = float(min_loss_scale) if min_loss_scale is not None else 2.0**-24
        self._max = float(max_loss_scale)
        if self._min > self._max:
            raise ValueError(
                f"amp.initialize(min_loss_scale={min_loss_scale}, max_loss_scale="
                f"{max_loss_scale}): min_loss_scale must not exceed max_loss_scale."
            )
        if self.dynamic:
            self._scale = min(max(float(init_scale), self._min), self._max)
        else:
            self._scale = float(loss_scale)
        self._factor = float(scale_factor)
        self._window = int(scale_window)
        self._unskipped = 0
        # Cached device tensors of 1/scale, refreshed only when the scale moves.
        self._inv_scale_cache: Dict[torch.device, Tuple[float, torch.Tensor]] = {}

    @property
    def loss_scale(self) -> float:
        """The current scale (a Python float: reading it costs no device sync)."""
        return self._scale

    def inv_scale(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_scale_cache.get(device)
        if cached is None or cached[0] != self._scale:
            # Reciprocal in fp64 before rounding to fp32: 1/scale is exact for powers of two
            # and as close as fp32 allows otherwise.
            tensor = torch.full((), 1.0 / self._scale, dtype=torch.float32, device=device)
            cached = (self._scale, tensor)
            self._inv_scale_cache[device] = cached
        return cached[1]

    def update(self, found_inf: bool) -> bool:
        """Apply one step's outcome to the scale.

        Args:
            found_inf (bool): whether the step's gradients held an inf or NaN.

        Returns:
            bool: True when the step must be skipped (dynamic scaling and an overflow).
        """
        if not self.dynamic:
            return False
        if found_inf:
            self._scale = max(self._min, self._scale / self._factor)
            self._unskipped = 0
            return True
        self._unskipped += 1
        if self._unskipped >= self._window:
            self._scale = min(self._max, self._scale * self._factor)
            self._unskipped = 0
        return False

    def state_dict(self) -> dict:
        """Apex's format: ``{"loss_scale": float, "unskipped": int}``."""
        return {"loss_scale": self._scale, "unskipped": self._unskipped}

    def load_state_dict(self, state: dict) -> None:
        try:
            scale, unskipped = float(state["loss_scale"]), int(state["unskipped"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"LossScaler.load_state_dict: expected {{'loss_scale': float, 'unskipped': "
                f"int}}, got {state!r}."
            ) from None
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"LossScaler.load_state_dict: loss_scale={scale} must be > 0.")
        self._scale = scale
        self._unskipped = unskipped

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, loss_scale={self._scale}, unskipped={self._unskipped})"


def _group_by_device_and_dtype(tensors: Sequence[torch.Tensor]):
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return groups


def unscale_grads_(
    grads: Sequence[torch.Tensor], scaler: LossScaler, check: bool
) -> Optional[List[torch.Tensor]]:
    """Multiply ``grads`` in place by ``1/scale`` and flag any inf/NaN.

    One fused foreach kernel per (device, dtype) does both the multiply and the check, so the
    gradients are read and written once. Nothing here synchronizes with the device.

    Args:
        grads: gradient tensors, modified in place.
        scaler: gives the scale.
        check: also look for inf/NaN (dynamic scaling).

    Returns:
        list of 0-dim fp32 tensors (one per device, 1.0 where an inf/NaN was seen) when
        ``check``; else None.
    """
    flags = []
    for (device, dtype), group in _group_by_device_and_dtype(grads).items():
        inv = scaler.inv_scale(device)
        if check and (dtype != torch.bfloat16 or device.type == "cpu"):
            found = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
            flags.append(found)
        elif check:
            # PyTorch's fused CUDA kernel has no bf16 variant (bf16 gradients reach here only at
            # O3 with dynamic scaling): an inf-norm per tensor flags inf/NaN, then multiply.
            norms = torch._foreach_norm(group, float("inf"))
            flags.append((~torch.stack(norms).isfinite()).any().float())
            torch._foreach_mul_(group, inv)
        elif scaler.loss_scale != 1.0:
            torch._foreach_mul_(group, inv)
    return flags if check else None


def any_flag_set(flags: Sequence[torch.Tensor]) -> bool:
    """Read the overflow flags: the one host-device sync of a step."""
    if not flags:
        return False
    if len(flags) == 1:
        return bool(flags[0].item())
    return any(bool(f.item()) for f in flags)
