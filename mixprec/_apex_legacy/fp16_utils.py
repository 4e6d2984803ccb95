"""``apex.fp16_utils`` under the Apex alias: Apex's manual half-precision helpers.

Apex's ImageNet example and the scripts copied from it start with
``from apex.fp16_utils import *`` and use ``to_python_float``; older scripts convert their
model with ``network_to_half`` and keep fp32 master copies by hand with ``prep_param_lists``,
``model_grads_to_master_grads`` and ``master_params_to_model_params``. Those helpers are here,
with Apex's signatures. Apex's legacy ``FP16_Optimizer`` and its loss scaler classes are not:
``amp.initialize(model, optimizer, opt_level="O2")`` gives the same fp32 master weights and
dynamic loss scaling, and constructing them raises an error that says so.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.modules.batchnorm import _BatchNorm

from mixprec._apex_legacy import NotProvided

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]


def to_python_float(t) -> float:
    """The Python number held by a one-element tensor (or the first item of a sequence)."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]


class tofp16(nn.Module):  # noqa: N801  (Apex's name)
    """A module that casts its input to fp16."""

    def forward(self, input):
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802  (Apex's name)
    """Cast every affine BatchNorm layer of ``module`` back to fp32, in place; returns it."""
    if isinstance(module, _BatchNorm) and module.affine:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Module:
    """``network`` in fp16 except its BatchNorm layers, behind a cast of the input to fp16."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def _check_dtype(where: str, dtype) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"{where}(dtype={dtype!r}): dtype must be a torch.dtype, as in Apex; pass "
            "torch.half (fp16), torch.bfloat16 or torch.float, not a string or a type name."
        )
    if not dtype.is_floating_point:
        raise ValueError(
            f"{where}(dtype={dtype}): the floating parameters and buffers would become "
            f"{dtype}, losing their values; pass a floating dtype such as torch.half, "
            "torch.bfloat16 or torch.float."
        )


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s own floating parameters and buffers (and their gradients) to
    ``dtype``, a floating ``torch.dtype``, in place."""
    _check_dtype("convert_module", dtype)
    for param in module.parameters(recurse=False):
        if param is not None and param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad.data = param.grad.data.to(dtype)
    for buf in module.buffers(recurse=False):
        if buf is not None and buf.is_floating_point():
            buf.data = buf.data.to(dtype)  # (in place: a buffer shared by two modules stays so)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every module of ``network`` to ``dtype`` except affine BatchNorm layers; returns
    it. RNN layers re-pack their weights for cuDNN (``flatten_parameters``, as Apex did: the
    cast leaves them in separate tensors, which cuDNN would re-pack, with a warning, at every
    forward). ``dtype`` is a floating ``torch.dtype``."""
    _check_dtype("convert_network", dtype)
    for module in network.modules():
        if isinstance(module, _BatchNorm) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """``network`` converted to fp16 (BatchNorm stays fp32); floating inputs are cast to fp16."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs):
        return self.network(*(t.half() if torch.is_tensor(t) and t.is_floating_point() else t
                              for t in inputs))


def prep_param_lists(model: nn.Module, flat_master: bool = False
                     ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The model's trainable parameters and fp32 master copies of them (one flat tensor with
    ``flat_master``), for hand-written master-weight training."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        if not model_params:  # (torch.cat's "expected a non-empty list of Tensors" otherwise)
            raise ValueError(
                "prep_param_lists(model, flat_master=True): the model has no parameter with "
                "requires_grad=True, so there is nothing to flatten into a master tensor.")
        # (clone: one contiguous fp32 parameter flattens to a view of itself, and the "copy"
        # would share the model's memory)
        master = nn.Parameter(
            _flatten_dense_tensors([p.detach().float() for p in model_params]).clone())
        master.grad = master.new_zeros(master.size())
        return model_params, [master]
    master_params = [nn.Parameter(p.detach().clone().float()) for p in model_params]
    return model_params, master_params


def model_grads_to_master_grads(model_params: List[torch.Tensor],
                                master_params: List[torch.Tensor],
                                flat_master: bool = False) -> None:
    """Copy the model's gradients into the masters' (as fp32); a missing one leaves the
    master's gradient None (with ``flat_master``, where a part of one tensor cannot be left
    out, it raises a ``ValueError`` naming the parameters without one)."""
    model_params, master_params = list(model_params), list(master_params)  # (generators too)
    _check_masters("model_grads_to_master_grads", model_params, master_params, flat_master)
    if flat_master:
        missing = [i for i, p in enumerate(model_params) if p.grad is None]
        if missing:  # (Apex: "'NoneType' object has no attribute 'data'")
            raise ValueError(
                f"model_grads_to_master_grads(flat_master=True): model_params "
                f"{_describe(model_params, missing)} have no gradient (not used in the "
                "backward, or zeroed with set_to_none). The flat master's gradient covers "
                "every parameter; use prep_param_lists(model, flat_master=False), which "
                "leaves those masters' gradients None so the optimizer skips them.")
        flat = master_params[0]
        if flat.grad is None:
            # PyTorch's optimizer.zero_grad() sets gradients to None by default since 2.0
            # (Apex's era zeroed them), so the master optimizer's zero_grad() takes away the
            # gradient prep_param_lists gave the flat master: make it again.
            flat.grad = torch.zeros_like(flat, memory_format=torch.contiguous_format)
        flat.grad.data.copy_(_flatten_dense_tensors([p.grad.data for p in model_params]))
        return
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
        elif master.grad is None:  # (a copy, also of an fp32 gradient: zeroing one of the
            # two before the master's step must not zero the other; in the master's dtype and
            # on its device, as Apex made it, e.g. fp64 masters or masters kept on the CPU)
            master.grad = torch.empty_like(master, memory_format=torch.preserve_format
                                           ).copy_(model.grad)
        else:
            master.grad.data.copy_(model.grad.data)


def master_params_to_model_params(model_params: List[torch.Tensor],
                                  master_params: List[torch.Tensor],
                                  flat_master: bool = False) -> None:
    """Copy the masters' values into the model's parameters (cast to their dtype)."""
    model_params, master_params = list(model_params), list(master_params)  # (generators too)
    _check_masters("master_params_to_model_params", model_params, master_params, flat_master)
    if flat_master:
        masters = _unflatten_dense_tensors(master_params[0].data, model_params)
    else:
        masters = [m.data for m in master_params]
    with torch.no_grad():
        for model, master in zip(model_params, masters):
            model.copy_(master)


def _describe(params, indices, limit=4) -> str:
    shown = ", ".join(f"[{i}] {tuple(params[i].shape)}" for i in indices[:limit])
    return shown + (f" and {len(indices) - limit} more" if len(indices) > limit else "")


def _check_masters(fn: str, model_params, master_params, flat_master: bool) -> None:
    """Refuse master lists that do not match ``model_params`` the way ``flat_master`` says.
    Apex zipped the lists: a shorter one silently left parameters out, and masters made with
    the other ``flat_master`` value copied into the wrong tensor or failed deep in ``copy_``."""
    numel = sum(p.numel() for p in model_params)
    if flat_master:
        if (len(master_params) == 1 and master_params[0].dim() == 1
                and master_params[0].numel() == numel):
            return
        raise ValueError(
            f"{fn}(flat_master=True): expected master_params to be the one-tensor list "
            f"prep_param_lists(model, flat_master=True) returned, holding all {numel} elements "
            f"of the {len(model_params)} model_params in one 1-D tensor; got "
            f"{len(master_params)} tensor(s) of shape(s) "
            f"{[tuple(m.shape) for m in master_params[:4]]}"
            f"{' ...' if len(master_params) > 4 else ''} with "
            f"{sum(m.numel() for m in master_params)} elements. Pass the flat_master value the "
            "masters were made with.")
    bad = [i for i, (p, m) in enumerate(zip(model_params, master_params))
           if p.shape != m.shape]
    if len(master_params) == len(model_params) and not bad:
        return
    if bad:
        i = bad[0]
        what = (f"master_params[{i}] has shape {tuple(master_params[i].shape)}, "
                f"model_params[{i}] {tuple(model_params[i].shape)}")
    else:
        what = f"got {len(master_params)} master_params for {len(model_params)} model_params"
    raise ValueError(
        f"{fn}: {what}. Expected the two lists prep_param_lists(model) returned, one master "
        "per model parameter in the same order" + (
            "; masters made with flat_master=True need flat_master=True here too."
            if len(master_params) == 1 and master_params[0].dim() == 1
            and master_params[0].numel() == numel else "."))


# Apex's old name for it (every argument of PyTorch's: error_if_nonfinite, foreach).
clip_grad_norm = nn.utils.clip_grad_norm_


class _NotProvided(NotProvided):
    _module = "fp16_utils"
    _what = " (Apex's legacy manual mixed precision)"


class FP16_Optimizer(_NotProvided):  # noqa: N801  (Apex's name)
    _use = ("Use `model, optimizer = amp.initialize(model, optimizer, opt_level=\"O2\")` "
            "(fp32 master weights; drop network_to_half, amp casts the model) and, for each "
            "call: optimizer.backward(loss) -> `with amp.scale_loss(loss, optimizer) as "
            "scaled: scaled.backward()`; optimizer.clip_master_grads(max_norm) -> "
            "torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm) after "
            "that block; static_loss_scale=S -> loss_scale=S in amp.initialize; "
            "dynamic_loss_scale=True -> the default (it starts at 2**16 and doubles after 2000 "
            "clean steps, where FP16_Optimizer's started at 2**32 and doubled after 1000; "
            "min_loss_scale=1 gives its floor of 1: Apex of 2018, later ones as amp); "
            "dynamic_loss_args={'scale_window': N} -> amp._amp_state.loss_scalers[0]"
            "._scale_seq_len = N after initialize; optimizer.overflow (read after "
            "optimizer.step()) -> amp.step_was_skipped(optimizer), which answers for the last "
            "step; optimizer.state_dict() -> "
            "optimizer.state_dict() and amp.state_dict(); to resume from an FP16_Optimizer "
            "checkpoint, amp.load_fp16_optimizer_state_dict(optimizer, "
            "checkpoint['optimizer']) after initialize.")


class _OldScaler(_NotProvided):
    """An Apex loss scaler: not constructible, but an FP16_Optimizer checkpoint that pickled
    one unpickles into it (its attributes, ``cur_scale`` among them), and scripts read its
    scale as Apex's property gave it."""

    @property
    def loss_scale(self) -> float:
        """The scale (Apex's property over ``cur_scale``)."""
        try:
            return self.__dict__["cur_scale"]
        except KeyError:
            raise AttributeError(
                f"{type(self).__name__}.loss_scale: this unpickled Apex loss scaler holds no "
                f"cur_scale; it has {sorted(self.__dict__)}.") from None


class LossScaler(_OldScaler):
    _use = "Pass loss_scale=<number> to amp.initialize and use amp.scale_loss."


class DynamicLossScaler(_OldScaler):
    _use = "amp.initialize's default loss_scale=\"dynamic\" with amp.scale_loss does this."
