"""``apex.optimizers`` under the Apex alias: mixprec's ``FusedAdam``, and Apex's other optimizer
names as stand-ins that say what to use instead.

Scripts of Apex's era import several of Apex's optimizers in one line
(``from apex.optimizers import FusedAdam, FusedSGD, FusedNovoGrad, FusedLAMB``, BERT
pretraining's ``FusedLAMB``, pytorch-pretrained-BERT's ``FP16_Optimizer``) and construct only
the one they were asked for. mixprec has ``FusedAdam``; the others import here, so such a
script runs with ``FusedAdam`` or a PyTorch optimizer, and constructing one of them raises an
error naming its replacement (Apex itself raised at construction where its CUDA extensions were
not built). Their Apex module paths (``apex.optimizers.fused_lamb``, ...) import too.
"""

from __future__ import annotations

import mixprec.optimizers as _mixprec_optimizers
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

_ANY_OPTIMIZER = ("amp.initialize works with any torch.optim.Optimizer (at O2 it keeps the fp32 "
                  "masters for it and writes the half model after its step).")
_NO_TORCH_EQUIVALENT = ("PyTorch has no {algorithm} optimizer: use an implementation written "
                        "in PyTorch (any works under amp), or switch to "
                        "apex.optimizers.FusedAdam (mixprec's) or "
                        "torch.optim.AdamW(..., fused=True). " + _ANY_OPTIMIZER)


class _NotProvided:
    _use = ""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"apex.optimizers.{type(self).__name__} is not provided by mixprec's Apex alias "
            f"(of Apex's optimizers it has FusedAdam). {self._use}"
        )


class FusedSGD(_NotProvided):
    _use = ("Use torch.optim.SGD(params, lr, momentum=..., weight_decay=..., nesterov=..., "
            "fused=True) (foreach=True where fused is unsupported): the same update. "
            + _ANY_OPTIMIZER)


class FusedAdagrad(_NotProvided):
    _use = "Use torch.optim.Adagrad(params, lr, ..., foreach=True). " + _ANY_OPTIMIZER


class FusedLAMB(_NotProvided):
    _use = _NO_TORCH_EQUIVALENT.format(algorithm="LAMB")


class FusedMixedPrecisionLamb(_NotProvided):
    _use = _NO_TORCH_EQUIVALENT.format(algorithm="LAMB")


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
