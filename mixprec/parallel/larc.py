"""``LARC``: layer-wise adaptive rate scaling (or clipping) around any optimizer (Apex's)."""

from __future__ import annotations

import math
import numbers
from typing import Callable, Optional

import torch

__all__ = ["LARC"]


class LARC:
    """Wrap an optimizer so each parameter's step is scaled by its trust ratio (LARS / LARC).

    For each parameter ``p`` with gradient ``g`` in a group with learning rate ``lr`` and weight
    decay ``wd``, before the inner optimizer's step::

        local_lr = trust_coefficient * ||p|| / (||g|| + wd * ||p|| + eps)
        clip=True  (LARC):  local_lr = min(local_lr / lr, 1)   (0 stays 0, also at lr=0)
        g <- (g + wd * p) * local_lr

    and the inner step runs with ``weight_decay=0`` (weight decay is folded in above and the
    groups' values are restored afterwards). A parameter whose weight or gradient norm is zero
    is left alone (no scaling, no weight decay), as in Apex. All of it happens on the device,
    without a host synchronisation. A sparse gradient (``nn.Embedding(..., sparse=True)``)
    is scaled by the norm of its summed rows; its group needs ``weight_decay=0`` (LARC would
    add the decay into it, making it dense).

    The wrapper shares the inner optimizer's ``param_groups`` list and ``state`` (the same
    objects), so ``amp.initialize(model, LARC(optimizer), opt_level="O2")`` swapping fp32
    masters into the groups is seen by both. It is not a ``torch.optim.Optimizer`` subclass:
    give learning-rate schedulers the inner optimizer (``larc.optim``); they change the same
    groups.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer (typically SGD with momentum).
        trust_coefficient (float): the trust coefficient. Default ``0.02``.
        clip (bool): True clips the scaled rate at the group's ``lr`` (LARC); False scales the
            group's rate (LARS). Default True.
        eps (float): added to the denominator. Default ``1e-8``.

    Example::

        >>> base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        >>> optimizer = LARC(base, trust_coefficient=0.02)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer.optim, T_max=90)
        >>> loss = criterion(model(x), y)
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
        >>> optimizer.zero_grad()
    """

    def __init__(self, optimizer, trust_coefficient: float = 0.02, clip: bool = True,
                 eps: float = 1e-8):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"LARC(optimizer={type(optimizer).__name__}): expected a torch.optim.Optimizer, "
                "e.g. LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))."
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "LARC(LBFGS): LARC scales the gradients once before the inner step, and LBFGS "
                "recomputes them through its closure inside its step, which would undo the "
                "scaling. Wrap a first-order optimizer (SGD, Adam, ...), or use LBFGS alone."
            )
        for name, value in (("trust_coefficient", trust_coefficient), ("eps", eps)):
            # (NumPy scalars too: Apex took any number.)
            if (not isinstance(value, numbers.Real) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"LARC({name}={value!r}): must be a finite number >= 0.")
        if isinstance(clip, torch.Tensor) or clip not in (True, False):
            raise TypeError(f"LARC(clip={clip!r}): must be a bool (True clips the rate at the "
                            "group's lr, LARC; False scales it, LARS).")
        self.optim = optimizer
        self.trust_coefficient = float(trust_coefficient)
        self.clip = bool(clip)
        self.eps = float(eps)

    # -- the inner optimizer's state, shared (the same objects) -------------------------------
    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optim.param_groups = value

    @property
    def state(self):
        return self.optim.state

    @state.setter
    def state(self, value):
        self.optim.state = value

    @property
    def defaults(self):
        return self.optim.defaults

    def __repr__(self) -> str:
        return (f"LARC(trust_coefficient={self.trust_coefficient}, clip={self.clip}, "
                f"eps={self.eps}) wrapping {self.optim!r}")

    def state_dict(self) -> dict:
        """The inner optimizer's state dict (LARC itself has no state)."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict saved by :meth:`state_dict` into the inner optimizer."""
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, *args, **kwargs) -> None:
        """The inner optimizer's ``zero_grad`` (same arguments)."""
        self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        """The inner optimizer's ``add_param_group``."""
        self.optim.add_param_group(param_group)

    # -- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def _scale_gradients(self) -> None:
        # What each gradient's norm is taken over, all checked before any gradient changes.
        values = {id(p): self._grad_values(p, p.grad, float(group.get("weight_decay", 0.0)))
                  for group in self.optim.param_groups for p in group["params"]
                  if p.grad is not None}
        for group in self.optim.param_groups:
            weight_decay = float(group.get("weight_decay", 0.0))
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                # Norms in fp32 at least (half weights under O3 would lose the ratio); a
                # complex parameter's (a Fourier layer's) in a complex type, whose norm is
                # real (vector_norm refuses a real dtype for complex input).
                if p.is_complex():
                    acc = torch.complex128 if p.dtype == torch.complex128 else torch.complex64
                else:
                    acc = torch.float64 if p.dtype == torch.float64 else torch.float32
                p_norm = torch.linalg.vector_norm(p, dtype=acc)
                g_norm = torch.linalg.vector_norm(values[id(p)], dtype=acc)
                local_lr = self.trust_coefficient * p_norm / (
                    g_norm + p_norm * weight_decay + self.eps
                )
                if self.clip:
                    # (At lr 0, a warm-up's first step, a positive ratio clips to 1; a zero
                    # ratio, trust_coefficient=0 or one underflowed in fp32, stays 0, its
                    # limit at any lr > 0, not the 0/0 NaN that poisoned the momentum.)
                    local_lr = torch.where(local_lr == 0, local_lr,
                                           torch.clamp(local_lr / lr, max=1.0))
                # Zero weight or zero gradient: leave the gradient exactly as it is (Apex).
                keep = (p_norm == 0) | (g_norm == 0)
                scale = torch.where(keep, torch.ones_like(local_lr), local_lr)
                if weight_decay != 0:
                    decay = torch.where(keep, torch.zeros_like(local_lr),
                                        torch.full_like(local_lr, weight_decay))
                    g.add_(p * decay.to(p.dtype))
                if g.dtype in (torch.float16, torch.bfloat16):
                    # The product in fp32, rounded once: the ratio itself may pass fp16's
                    # 65504 (LARS on a small gradient: 2e5 for gradients of 1e-7) where the
                    # scaled gradient, whose norm is at most trust * ||p||, does not; cast
                    # first, it was inf (and inf * 0 NaN), and bf16 kept 8 bits of the ratio.
                    g.copy_(g.float().mul_(scale))
                else:
                    g.mul_(scale.to(g.dtype))

    @staticmethod
    def _grad_values(p: torch.Tensor, g: torch.Tensor, weight_decay: float) -> torch.Tensor:
        """What the gradient's norm is taken over: a sparse gradient's (``nn.Embedding(...,
        sparse=True)``) coalesced values, which its trust ratio then scales in place."""
        if g.layout is torch.strided:
            return g
        if g.layout is not torch.sparse_coo:
            raise TypeError(
                f"LARC: a gradient of layout {g.layout} (parameter of shape {tuple(p.shape)}) "
                "is not supported; LARC takes dense gradients and sparse COO ones "
                "(nn.Embedding(..., sparse=True)).")
        if weight_decay != 0:
            raise ValueError(
                f"LARC: the parameter of shape {tuple(p.shape)} has a sparse gradient and its "
                f"group has weight_decay={weight_decay}, but LARC adds weight decay into the "
                "gradient, which would make it dense. Put the sparse parameters in a group "
                "with weight_decay=0 (torch's optimizers refuse weight decay on sparse "
                "gradients too).")
        return g.coalesce().values()

    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None):
        """Scale every gradient by its trust ratio, then step the inner optimizer.

        Args:
            closure (callable, optional): re-evaluates the model and returns the loss; called
                (with gradients enabled) before the scaling.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._scale_gradients()
        saved = []
        for group in self.optim.param_groups:
            saved.append(group.get("weight_decay", None))
            if "weight_decay" in group:
                group["weight_decay"] = 0
        try:
            self.optim.step()
        finally:
            for group, value in zip(self.optim.param_groups, saved):
                if value is not None:
                    group["weight_decay"] = value
        return loss
