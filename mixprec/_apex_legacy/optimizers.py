"""``apex.optimizers`` under the Apex alias: mixprec's ``FusedAdam``, Apex's ``FusedSGD`` as
PyTorch's SGD, and Apex's other optimizer names as stand-ins that say what to use instead.

Scripts of Apex's era import several of Apex's optimizers in one line
(``from apex.optimizers import FusedAdam, FusedSGD, FusedNovoGrad, FusedLAMB``, BERT
pretraining's ``FusedLAMB``, pytorch-pretrained-BERT's ``FP16_Optimizer``) and construct only
the one they were asked for. ``FusedAdam`` is mixprec's, ``FusedSGD`` is PyTorch's SGD (the
same update) with Apex's signature; the other names import, and constructing one raises an
error naming its replacement (Apex itself raised at construction where its CUDA extensions
were not built). Their Apex module paths (``apex.optimizers.fused_lamb``, ...) import too.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.optim.optimizer import required as _torch_required

import mixprec.optimizers as _mixprec_optimizers
from mixprec._apex_legacy import NotProvided
from mixprec.optimizers import fused_adam  # noqa: F401  (apex.optimizers.fused_adam)

__all__ = list(_mixprec_optimizers.__all__) + [
    "FP16_Optimizer",
    "FusedAdagrad",
    "FusedLAMB",
    "FusedLANS",
    "FusedMixedPrecisionLamb",
    "FusedNovoGrad",
    "FusedSGD",
]

# Every optimizer mixprec has (FusedAdam), as the same objects.
globals().update({name: getattr(_mixprec_optimizers, name)
                  for name in _mixprec_optimizers.__all__})

_REQUIRED = object()  # (Apex's FusedSGD has no default lr)

_ANY_OPTIMIZER = ("amp.initialize works with any torch.optim.Optimizer (at O2 it keeps the fp32 "
                  "masters for it and writes the half model after its step).")
_NO_TORCH_EQUIVALENT = ("PyTorch has no {algorithm} optimizer: use an implementation written "
                        "in PyTorch (any works under amp), or switch to "
                        "apex.optimizers.FusedAdam (mixprec's) or "
                        "torch.optim.AdamW(..., fused=True). " + _ANY_OPTIMIZER)


class _NotProvided(NotProvided):
    _module = "optimizers"
    _what = " (of Apex's optimizers mixprec has FusedAdam, and FusedSGD as PyTorch's SGD)"


class FusedSGD(torch.optim.SGD):
    """Apex's ``FusedSGD`` as PyTorch's SGD: the same update (weight decay added to the
    gradient before the momentum), Apex's signature and its ``set_grad_none``.

    ``FusedSGD(params, lr, momentum=0., dampening=0., weight_decay=0., nesterov=False,
    wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False)``. The step
    is ``torch.optim.SGD``'s (its multi-tensor ``foreach`` implementation on CUDA).
    ``materialize_master_grads`` concerned Apex's amp O2 internals and changes nothing here
    (amp O2 always gives the optimizer fp32 master gradients); ``wd_after_momentum=True``,
    Apex's variant that adds the weight decay after the momentum, is refused.
    """

    def __init__(self, params, lr=_REQUIRED, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, wd_after_momentum=False, materialize_master_grads=True,
                 set_grad_none=False):
        if lr is _REQUIRED:
            # Apex's lr=required: satisfied where every parameter group carries its own lr
            # (a group added later without one is refused by add_param_group, as there).
            params = list(params) if not isinstance(params, torch.Tensor) else [params]
            if not params or not all(isinstance(g, dict) and "lr" in g for g in params):
                raise TypeError(
                    "apex.optimizers.FusedSGD: lr is required (as in Apex): pass it, e.g. "
                    "FusedSGD(model.parameters(), lr=0.1, momentum=0.9), or give every "
                    "parameter group its own, FusedSGD([{'params': ..., 'lr': 0.1}, ...]).")
            lr = params[0]["lr"]
            required = True
        else:
            required = False
        if wd_after_momentum:
            raise ValueError(
                f"apex.optimizers.FusedSGD(wd_after_momentum={wd_after_momentum!r}): adding the "
                "weight decay after the momentum (Apex's variant) is not provided. Pass "
                "wd_after_momentum=False for PyTorch's SGD update (decay added to the gradient "
                "before the momentum, Apex's default), or write the variant as your own "
                "torch.optim.Optimizer.")
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov)
        if required:
            self.defaults["lr"] = _torch_required
        self.set_grad_none = bool(set_grad_none)
        self.materialize_master_grads = materialize_master_grads

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Apex's default: ``set_grad_none`` from the constructor (False: zero the gradients)."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def __getstate__(self) -> dict:
        # (PyTorch's keeps defaults, state and param_groups only: a deep copy, a pickle or
        # torch.save(optimizer) lost these, and the copy's zero_grad() failed.)
        state = super().__getstate__()
        state.update(set_grad_none=self.set_grad_none,
                     materialize_master_grads=self.materialize_master_grads)
        return state

    def __setstate__(self, state: dict) -> None:
        """PyTorch's, with Apex's defaults for what an optimizer pickled without them (under
        Apex, or by PyTorch's ``__getstate__``) lacks."""
        super().__setstate__(state)
        self.__dict__.setdefault("set_grad_none", False)
        self.__dict__.setdefault("materialize_master_grads", True)


class FusedAdagrad(_NotProvided):
    _use = "Use torch.optim.Adagrad(params, lr, ..., foreach=True). " + _ANY_OPTIMIZER


# (Apex's LAMB clipped the global gradient norm itself, max_grad_norm=1.0 by default; BERT's
# pretraining clips nothing else.)
_LAMB_CLIPPED = (" Apex's FusedLAMB also clipped the global gradient norm to max_grad_norm "
                 "(1.0 by default): with another LAMB, call torch.nn.utils.clip_grad_norm_("
                 "amp.master_params(optimizer), 1.0) after the scale_loss block and before "
                 "step(), or training runs unclipped.")


class FusedLAMB(_NotProvided):
    _use = _NO_TORCH_EQUIVALENT.format(algorithm="LAMB") + _LAMB_CLIPPED


class FusedMixedPrecisionLamb(_NotProvided):
    _use = _NO_TORCH_EQUIVALENT.format(algorithm="LAMB") + _LAMB_CLIPPED


class FusedLANS(_NotProvided):
    _use = _NO_TORCH_EQUIVALENT.format(algorithm="LANS")


class FusedNovoGrad(_NotProvided):
    _use = _NO_TORCH_EQUIVALENT.format(algorithm="NovoGrad")


class FP16_Optimizer(_NotProvided):  # noqa: N801  (Apex's name: its 2019 wrapper of FusedAdam)
    _use = ("Build FusedAdam without max_grad_norm, then `model, optimizer = amp.initialize("
            "model, optimizer, opt_level=\"O2\")`, `with amp.scale_loss(loss, optimizer) as "
            "scaled: scaled.backward()` and torch.nn.utils.clip_grad_norm_("
            "amp.master_params(optimizer), max_norm) before optimizer.step(): fp32 master "
            "weights and dynamic loss scaling, as FP16_Optimizer gave.")
