"""Apex's functional norm API, with Apex's signatures and defaults.

``apex.normalization.fused_layer_norm`` held, beside the modules, functions whose argument
order differs from mixprec's own :func:`~mixprec.normalization.fused_layer_norm` (which follows
``torch.nn.functional.layer_norm``: ``x, normalized_shape, weight, bias, eps``) and whose
``eps`` defaults to ``1e-6`` (mixprec's and PyTorch's default is ``1e-5``). Code written for
Apex (timm's ``fast_norm``, Megatron-style layers) calls them positionally, so this module keeps
Apex's forms::

    fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False)
    fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False)
    mixed_dtype_fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, ...)
    fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False)
    fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False)
    mixed_dtype_fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, ...)

and Apex's autograd-function names, whose ``apply`` takes the same arguments
(``FusedLayerNormAffineFunction.apply(input, weight, bias, normalized_shape, eps)``; Apex's
``eps`` had no default, and their published ``forward`` signature keeps it so, while ``apply``
falls back to the functions' 1e-6).
The output has the input's dtype, except for the ``mixed_dtype_*`` forms, whose output has the
weight's (as :class:`~mixprec.normalization.MixedFusedLayerNorm`). All of them run mixprec's
kernels (Triton on CUDA, PyTorch's math elsewhere). Under ``torch.autocast`` the arguments are
used in the dtypes given (Apex cast them to the autocast dtype first): normalization is one of
CUDA autocast's fp32 ops, and mixprec computes its statistics in fp32 for every input dtype anyway.

The classes (:class:`~mixprec.normalization.FusedLayerNorm` and the others) are re-exported
here, so that this module can stand for ``apex.normalization.fused_layer_norm`` (see
:func:`mixprec.install_apex_alias`).
"""

from __future__ import annotations

import inspect
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from mixprec.normalization import _checks, _ops
from mixprec.normalization.layer_norm import FusedLayerNorm, MixedFusedLayerNorm
from mixprec.normalization.rms_norm import FusedRMSNorm, MixedFusedRMSNorm

__all__ = [
    "FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm",
    "fused_layer_norm", "fused_layer_norm_affine", "mixed_dtype_fused_layer_norm_affine",
    "fused_rms_norm", "fused_rms_norm_affine", "mixed_dtype_fused_rms_norm_affine",
    "FusedLayerNormFunction", "FusedLayerNormAffineFunction",
    "FusedLayerNormAffineMixedDtypesFunction", "FusedRMSNormFunction",
    "FusedRMSNormAffineFunction", "FusedRMSNormAffineMixedDtypesFunction",
]

_Shape = Union[int, Sequence[int]]
_APEX_EPS = 1e-6


def _norm(where: str, x: Tensor, normalized_shape: _Shape, weight: Optional[Tensor],
          bias: Optional[Tensor], eps: float, memory_efficient: bool, is_rms: bool,
          output_like_weight: bool) -> Tensor:
    shape = _checks.normalize_shape(normalized_shape, where)
    if not torch.jit.is_tracing():
        # (Under torch.jit.trace the sizes are traced tensors: the checks would only add
        # TracerWarnings, and the PyTorch ops recorded there check.)
        _checks.check_inputs(where, x, shape, weight, bias, eps)
    if output_like_weight and weight is None:
        raise ValueError(f"{where}: weight is None; the mixed-dtype form needs a weight tensor "
                         "(its output takes the weight's dtype)")
    out_dtype = weight.dtype if output_like_weight else x.dtype
    return _ops.fused_norm(x, shape, weight, bias, float(eps), is_rms, bool(memory_efficient),
                           out_dtype, output_like_weight=output_like_weight)


# One call_function node under torch.fx (the functions below call it through this module).
torch.fx.wrap("_norm")


def fused_layer_norm(input: Tensor, normalized_shape: _Shape, eps: float = _APEX_EPS,
                     memory_efficient: bool = False) -> Tensor:
    """LayerNorm without weight and bias over the trailing ``normalized_shape`` dims (Apex's
    signature; output in the input's dtype)."""
    return _norm("fused_layer_norm", input, normalized_shape, None, None, eps,
                 memory_efficient, False, False)


def fused_layer_norm_affine(input: Tensor, weight: Tensor, bias: Optional[Tensor],
                            normalized_shape: _Shape, eps: float = _APEX_EPS,
                            memory_efficient: bool = False) -> Tensor:
    """LayerNorm with ``weight`` and ``bias`` (Apex's argument order; output in the input's
    dtype)."""
    return _norm("fused_layer_norm_affine", input, normalized_shape, weight, bias, eps,
                 memory_efficient, False, False)


def mixed_dtype_fused_layer_norm_affine(input: Tensor, weight: Tensor, bias: Optional[Tensor],
                                        normalized_shape: _Shape, eps: float = _APEX_EPS,
                                        memory_efficient: bool = False) -> Tensor:
    """:func:`fused_layer_norm_affine` whose output takes the weight's dtype (fp32 weights fed
    half activations give an fp32 output)."""
    return _norm("mixed_dtype_fused_layer_norm_affine", input, normalized_shape, weight, bias,
                 eps, memory_efficient, False, True)


def fused_rms_norm(input: Tensor, normalized_shape: _Shape, eps: float = _APEX_EPS,
                   memory_efficient: bool = False) -> Tensor:
    """RMSNorm without weight over the trailing ``normalized_shape`` dims (Apex's signature;
    output in the input's dtype)."""
    return _norm("fused_rms_norm", input, normalized_shape, None, None, eps, memory_efficient,
                 True, False)


def fused_rms_norm_affine(input: Tensor, weight: Tensor, normalized_shape: _Shape,
                          eps: float = _APEX_EPS, memory_efficient: bool = False) -> Tensor:
    """RMSNorm with ``weight`` (Apex's argument order; output in the input's dtype)."""
    return _norm("fused_rms_norm_affine", input, normalized_shape, weight, None, eps,
                 memory_efficient, True, False)


def mixed_dtype_fused_rms_norm_affine(input: Tensor, weight: Tensor, normalized_shape: _Shape,
                                      eps: float = _APEX_EPS,
                                      memory_efficient: bool = False) -> Tensor:
    """:func:`fused_rms_norm_affine` whose output takes the weight's dtype."""
    return _norm("mixed_dtype_fused_rms_norm_affine", input, normalized_shape, weight, None,
                 eps, memory_efficient, True, True)


class _ApexFunction:
    """Apex's autograd-function name: ``apply`` runs the matching function above (one node of
    mixprec's own autograd function)."""

    def __init__(self):
        raise TypeError(f"{type(self).__name__} is not instantiated: call "
                        f"{type(self).__name__}.apply(...) as in Apex")


def _apex_function(name: str, fn, signature: str):
    def apply(*args, **kwargs):
        return fn(*args, **kwargs)

    def forward(ctx, *args, **kwargs):
        return fn(*args, **kwargs)

    def backward(ctx, *grad_outputs):
        raise RuntimeError(f"{name}.backward is not called directly: {name}.apply(...) records "
                           "mixprec's own autograd node, whose backward autograd runs.")

    apply.__doc__ = f"``{name}.apply({signature})``: :func:`{fn.__name__}`."
    # Apex's forward(ctx, <apply's arguments>), eps required: Megatron-LM's layer probes
    # inspect.getfullargspec(FusedLayerNormAffineFunction.forward).args for "memory_efficient"
    # in every forward before calling apply.
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for param in inspect.signature(fn).parameters.values():
        params.append(param.replace(default=inspect.Parameter.empty)
                      if param.name == "eps" else param)
    forward.__signature__ = inspect.Signature(params)
    forward.__doc__ = (f"Apex's signature, ``forward(ctx, {signature})``; computes "
                       f":func:`{fn.__name__}` (``ctx`` unused). Call ``{name}.apply``.")
    return type(name, (_ApexFunction,), {
        "apply": staticmethod(apply), "forward": staticmethod(forward),
        "backward": staticmethod(backward), "__module__": __name__,
        "__doc__": f"Apex's ``{name}``: ``apply({signature})`` computes :func:`{fn.__name__}`."})


FusedLayerNormFunction = _apex_function(
    "FusedLayerNormFunction", fused_layer_norm,
    "input, normalized_shape, eps, memory_efficient=False")
FusedLayerNormAffineFunction = _apex_function(
    "FusedLayerNormAffineFunction", fused_layer_norm_affine,
    "input, weight, bias, normalized_shape, eps, memory_efficient=False")
FusedLayerNormAffineMixedDtypesFunction = _apex_function(
    "FusedLayerNormAffineMixedDtypesFunction", mixed_dtype_fused_layer_norm_affine,
    "input, weight, bias, normalized_shape, eps, memory_efficient=False")
FusedRMSNormFunction = _apex_function(
    "FusedRMSNormFunction", fused_rms_norm, "input, normalized_shape, eps, memory_efficient=False")
FusedRMSNormAffineFunction = _apex_function(
    "FusedRMSNormAffineFunction", fused_rms_norm_affine,
    "input, weight, normalized_shape, eps, memory_efficient=False")
FusedRMSNormAffineMixedDtypesFunction = _apex_function(
    "FusedRMSNormAffineMixedDtypesFunction", mixed_dtype_fused_rms_norm_affine,
    "input, weight, normalized_shape, eps, memory_efficient=False")
