"""``apex.amp.scaler`` under the Apex alias: Apex's ``LossScaler`` with Apex's interface.

mixprec's own :class:`mixprec.amp.LossScaler` serves ``amp.initialize`` and reads its scale
as a property. Apex-era training code that built its own fp16 optimizer wrapper (custom
master-weight steppers in GPT trainers, for instance) used Apex's class directly, through
its methods: ``loss_scale()``, ``unscale(model_grads, master_grads, ...)``,
``unscale_with_stashed(...)``, ``clear_overflow_state()`` and ``update_scale()``, and read or
wrote its attributes (``_loss_scale``, ``_unskipped``, ``_has_overflow``). This class gives
that interface, with Apex's dynamic policy, on PyTorch's multi-tensor kernels: the gradients
are checked for inf/NaN on the device and the host reads the result once, when
``_has_overflow`` or ``update_scale()`` asks for it (Apex's fallback without its compiled
kernels synchronized once per gradient).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from mixprec.amp.scaler import LossScaler as _MixprecLossScaler
from mixprec.amp.scaler import _flag_non_finite, unscale_grads_

__all__ = ["LossScaler"]


class _FixedScale:
    """What :func:`mixprec.amp.scaler.unscale_grads_` reads from a scaler, for one pass."""

    on_device = None  # (the scale is the host's)

    def __init__(self, loss_scale: float):
        self.loss_scale = loss_scale
        self._inv: Dict[torch.device, torch.Tensor] = {}

    def inv_scale(self, device: torch.device) -> torch.Tensor:
        inv = self._inv.get(device)
        if inv is None:
            inv = self._inv[device] = torch.full((), 1.0 / self.loss_scale,
                                                 dtype=torch.float32, device=device)
        return inv


def _check_pairs(where: str, **lists) -> None:
    lengths = {name: len(values) for name, values in lists.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"LossScaler.{where}: the gradient lists differ in length "
                         f"({', '.join(f'{k}={v}' for k, v in lengths.items())}); pass one "
                         "entry per parameter in each, None where a parameter has no "
                         "gradient.")


class LossScaler:
    """Apex's ``apex.amp.scaler.LossScaler``: a static or dynamic loss scale that unscales
    gradient lists itself.

    Args:
        loss_scale (float or str): a fixed scale, or ``"dynamic"``.
        init_scale (float): first dynamic scale. Default ``2.**16``.
        scale_factor (float): back-off / growth factor. Default ``2.0``.
        scale_window (int): clean steps before the dynamic scale grows. Default ``2000``.
        min_loss_scale (float, optional): floor of the dynamic scale. Default ``None`` (none,
            as in Apex).
        max_loss_scale (float): ceiling of the dynamic scale. Default ``2.**24``.

    A step's use, as in Apex: ``clear_overflow_state()``; backward of
    ``loss * scaler.loss_scale()``; ``unscale(model_grads, master_grads, None)`` (and/or
    ``unscale_with_stashed`` for gradients accumulated onto earlier ones); then
    ``should_skip = scaler.update_scale()``, which backs the scale off on an overflow and
    grows it after ``scale_window`` clean steps (by ``scale_factor``: the Apex versions whose
    ``update_scale`` this follows halved and doubled by 2 whatever was passed, which is the
    default here). The attributes Apex scripts read or set
    (``_loss_scale``, ``_unskipped``, ``_has_overflow``, ``_scale_seq_len``,
    ``_min_loss_scale``, ``_max_loss_scale``, ``dynamic``) are plain attributes here too.
    ``has_fused_kernel`` is False (Apex's ``amp_C`` kernels are not shipped), so scripts take
    their ``_has_overflow`` branch, not ``_overflow_buf``.

    Example::

        >>> scaler = LossScaler("dynamic", min_loss_scale=1.0)
        >>> scaler.clear_overflow_state()
        >>> (loss * scaler.loss_scale()).backward()
        >>> scaler.unscale([p.grad for p in half_params], [m.grad for m in masters], None)
        >>> if not scaler.update_scale():
        ...     optimizer.step()
    """

    has_fused_kernel = False
    warned_no_fused_kernel = True
    warned_unscaling_non_fp32_grad = False

    def __init__(self, loss_scale: Union[float, str], init_scale: float = 2.0**16,
                 scale_factor: float = 2.0, scale_window: int = 2000,
                 min_loss_scale: Optional[float] = None, max_loss_scale: float = 2.0**24):
        # (mixprec's class checks the arguments, with messages naming each.)
        _MixprecLossScaler(loss_scale, init_scale, scale_factor, scale_window, min_loss_scale,
                           max_loss_scale)
        self.dynamic = loss_scale == "dynamic"
        # (A dynamic scale starts at most at max_loss_scale, as Apex's did: old configs
        # passed init_scale=2**32.)
        self._loss_scale = float(min(init_scale, max_loss_scale) if self.dynamic
                                 else loss_scale)
        self._scale_factor = float(scale_factor)
        self._scale_seq_len = int(scale_window)
        self._min_loss_scale = min_loss_scale
        self._max_loss_scale = max_loss_scale
        self._unskipped = 0
        self._overflow = False
        # Device flags of this step's checks, not read yet (1.0 where an inf/NaN was seen).
        self._flags: List[torch.Tensor] = []

    def __setstate__(self, state: dict) -> None:
        # An object Apex's own class pickled (FP16_Optimizer.state_dict() of Apex 2019 and
        # later put its scaler in checkpoints), unpickled as this class through the alias,
        # holds Apex's attributes only: _has_overflow as a plain value (a property here), a
        # CUDA _overflow_buf (amp_C's, not used here), no _scale_factor (Apex's update_scale
        # halved and doubled by 2). One of this class's own keeps its unread device flags.
        state = dict(state)
        if "_flags" not in state:
            state["_overflow"] = bool(state.pop("_has_overflow", False))
            state.pop("_overflow_buf", None)
            state["_flags"] = []
            for name, default in (("_scale_factor", 2.0), ("_scale_seq_len", 2000),
                                  ("_min_loss_scale", None), ("_max_loss_scale", 2.0**24),
                                  ("_unskipped", 0), ("dynamic", True)):
                state.setdefault(name, default)
        self.__dict__.update(state)

    def loss_scale(self) -> float:
        """The current scale (Apex's method)."""
        return self._loss_scale

    @property
    def _has_overflow(self) -> bool:
        """Whether a check since ``clear_overflow_state()`` saw an inf/NaN. Reading it reads
        the device flags of this step's checks (one sync)."""
        if self._flags:
            flags, self._flags = self._flags, []
            found = torch.stack([f.to(flags[0].device) for f in flags]).amax().item()
            self._overflow = self._overflow or bool(found)
        return self._overflow

    @_has_overflow.setter
    def _has_overflow(self, value) -> None:
        # (Scripts that all-reduce the flag across ranks write the agreed value back.)
        self._flags = []
        self._overflow = bool(value)

    def clear_overflow_state(self) -> None:
        """Forget this step's overflow, before the next step's checks."""
        self._has_overflow = False

    def _scale_for(self, scale_override) -> float:
        scale = self._loss_scale if scale_override is None else float(scale_override)
        if not scale > 0:
            raise ValueError(f"LossScaler: the scale to unscale by is {scale!r}; it must be "
                             "> 0 (a loss scale set through _loss_scale or scale_override).")
        return scale

    def unscale(self, model_grads: Sequence[Optional[torch.Tensor]],
                master_grads: Sequence[Optional[torch.Tensor]], unused_scale=None,
                models_are_masters: bool = False,
                scale_override: Optional[float] = None) -> None:
        """``master_grads[i] = model_grads[i] / scale`` for each gradient (in place when the
        lists hold the same tensors, ``models_are_masters``), checking the model gradients for
        inf/NaN under a dynamic scale. ``unused_scale`` is ignored, as in Apex; the scale is
        ``scale_override`` if given, else the current one. Does nothing once an overflow of
        this step has been read (``_has_overflow`` or ``update_scale``; the check itself stays
        on the device until then, so an earlier call's unread inf does not stop this one:
        the step is skipped and its master gradients dropped either way, Apex's order); a
        static scale of 1 on masters' own gradients is a no-op."""
        _check_pairs("unscale", model_grads=model_grads, master_grads=master_grads)
        if self._overflow:
            return
        scale = self._scale_for(scale_override)
        if scale == 1.0 and models_are_masters and not self.dynamic:
            return
        pairs = [(g, m) for g, m in zip(model_grads, master_grads) if g is not None]
        if any(m is None for _, m in pairs):
            raise ValueError("LossScaler.unscale: a master gradient is None where its model "
                             "gradient is not; allocate it first (torch.empty_like(master)).")
        copies = [(g, m) for g, m in pairs if g is not m]
        if copies:
            torch._foreach_copy_([m for _, m in copies], [g for g, _ in copies])
        flags = unscale_grads_([m for _, m in pairs], _FixedScale(scale), self.dynamic)
        self._flags.extend(flags or [])

    def unscale_with_stashed(self, model_grads: Sequence[Optional[torch.Tensor]],
                             stashed_master_grads: Sequence[Optional[torch.Tensor]],
                             master_grads: Sequence[torch.Tensor],
                             scale_override: Optional[Tuple[float, float, float]] = None
                             ) -> None:
        """``master = model * (out / grads_scale) + stashed * (out / stashed_scale)`` for each
        gradient: a new (scaled) gradient added onto one kept from earlier (gradient
        accumulation), checking the new gradients for inf/NaN under a dynamic scale.
        ``scale_override`` is Apex's ``(grads_scale, stashed_scale, out_scale)``; by default
        ``(loss_scale(), 1.0, 1.0)``."""
        _check_pairs("unscale_with_stashed", model_grads=model_grads,
                     stashed_master_grads=stashed_master_grads, master_grads=master_grads)
        if self._overflow:
            return
        if scale_override is None:
            grads_scale, stashed_scale, out_scale = self._scale_for(None), 1.0, 1.0
        else:
            grads_scale, stashed_scale, out_scale = (float(v) for v in scale_override)
            if not (grads_scale > 0 and stashed_scale > 0):
                raise ValueError(f"LossScaler.unscale_with_stashed: scale_override="
                                 f"{scale_override!r}; its first two scales must be > 0.")
        triples = [(g, s, m) for g, s, m in zip(model_grads, stashed_master_grads,
                                                master_grads) if g is not None or s is not None]
        for g, s, m in triples:
            if g is None or s is None or m is None:
                raise ValueError("LossScaler.unscale_with_stashed: each entry needs its model, "
                                 "stashed and master gradient (or none of the first two).")
        if not triples:
            return
        # (Copies: the model's gradients are read, never written, as in Apex; .to() alone
        # returns the tensor itself when it has the master's dtype already.)
        fresh = [g.to(m.dtype, copy=True) for g, _, m in triples]
        if self.dynamic:
            by_device: Dict[torch.device, List[torch.Tensor]] = {}
            for g in fresh:
                by_device.setdefault(g.device, []).append(g)
            for device, group in by_device.items():
                flag = torch.zeros((), dtype=torch.float32, device=device)
                _flag_non_finite(group, flag)
                self._flags.append(flag)
        torch._foreach_mul_(fresh, out_scale / grads_scale)
        torch._foreach_add_(fresh, [s for _, s, _ in triples], alpha=out_scale / stashed_scale)
        torch._foreach_copy_([m for _, _, m in triples], fresh)

    def update_scale(self) -> bool:
        """Apply this step's outcome; returns True when the step must be skipped (a dynamic
        scale that saw an overflow, halved then, down to ``_min_loss_scale`` if set). A
        dynamic scale grows by the factor after ``_scale_seq_len`` clean steps, up to
        ``_max_loss_scale``."""
        overflow = self._has_overflow and self.dynamic
        if overflow:
            scale = self._loss_scale / self._scale_factor
            if self._min_loss_scale:
                scale = max(self._min_loss_scale, scale)
            self._loss_scale = scale
            self._unskipped = 0
        else:
            self._unskipped += 1
        # (">=": a window shortened below the clean steps counted, by a script writing
        # _scale_seq_len, grows at the next clean step, as mixprec.amp's scaler does; Apex's
        # "==" never grew again until an overflow reset the count.)
        if self.dynamic and self._unskipped >= self._scale_seq_len:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * self._scale_factor)
            self._unskipped = 0
        return overflow
