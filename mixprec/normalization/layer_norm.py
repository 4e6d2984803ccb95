"""Fused LayerNorm: ``fused_layer_norm``, ``FusedLayerNorm`` and ``MixedFusedLayerNorm``.

Drop-in for Apex's ``apex.normalization.FusedLayerNorm`` / ``MixedFusedLayerNorm`` (same
arguments, same ``weight``/``bias`` state-dict keys as :class:`torch.nn.LayerNorm`).

Dtypes: statistics are always computed in fp32 and the output is cast once. The output dtype
is the input's for :func:`fused_layer_norm` and :class:`FusedLayerNorm`, and the weight's for
:class:`MixedFusedLayerNorm`. Parameters are read in their own dtype and their gradients come
back in it. The op is not on ``torch.autocast``'s lists, so autocast changes nothing: a bf16
activation gives a bf16 output (``torch.nn.LayerNorm`` would give fp32 under CUDA autocast).
"""

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from mixprec.normalization import _checks, _ops
from mixprec.normalization._module import _FusedNorm, _require_affine

__all__ = ["fused_layer_norm", "FusedLayerNorm", "MixedFusedLayerNorm"]


def fused_layer_norm(
    x: Tensor,
    normalized_shape: Union[int, Sequence[int]],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    memory_efficient: bool = False,
) -> Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims of ``x``, fused on CUDA.

    Triton kernels on CUDA for fp32/fp16/bf16 rows up to 65,536 elements; the plain-PyTorch
    :func:`mixprec.normalization.reference.layer_norm` math elsewhere (CPU, fp64, longer rows).

    Args:
        x (Tensor): input ``[*, *normalized_shape]``, fp32, fp16, bf16 or fp64; any leading
            shape, any strides.
        normalized_shape (int or tuple of int): the trailing dims to normalize over.
        weight (Tensor, optional): scale, shape ``normalized_shape``. Default: ``None``.
        bias (Tensor, optional): shift, shape ``normalized_shape``. Default: ``None``.
        eps (float): added to the variance. Default: ``1e-5``.
        memory_efficient (bool): save the output instead of the input for backward and
            recover ``x_hat = (y - bias) / weight`` from it. Needs every weight element
            non-zero (a zero gives inf/nan gradients) and costs a little precision in half
            dtypes. Default: ``False``.

    Returns:
        Tensor: same shape as ``x``, dtype of ``x``.

    Raises:
        ValueError: the input's trailing shape, or a parameter's shape, is not
            ``normalized_shape``.
        TypeError: unsupported dtypes or argument types.

    Example::

        >>> x = torch.randn(8, 128, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        >>> w = torch.ones(1024, device="cuda", requires_grad=True)
        >>> b = torch.zeros(1024, device="cuda", requires_grad=True)
        >>> y = fused_layer_norm(x, 1024, w, b)  # bf16, statistics in fp32
        >>> y.float().pow(2).mean().backward()
    """
    return _fused_layer_norm(x, normalized_shape, weight, bias, eps, memory_efficient)


def _fused_layer_norm(x, normalized_shape, weight, bias, eps, memory_efficient) -> Tensor:
    # Registered with torch.fx.wrap (below): one call_function node under torch.fx.
    shape = _checks.normalize_shape(normalized_shape, "fused_layer_norm")
    if not torch.jit.is_tracing():  # (traced sizes: TracerWarnings only; the traced ops check)
        _checks.check_inputs("fused_layer_norm", x, shape, weight, bias, eps)
    return _ops.fused_norm(x, shape, weight, bias, float(eps), False, memory_efficient, x.dtype)


torch.fx.wrap("_fused_layer_norm")


class FusedLayerNorm(_FusedNorm):
    """LayerNorm over the last dims, with fused Triton kernels on CUDA.

    Apex's ``FusedLayerNorm`` arguments (in its positional order), plus
    :class:`torch.nn.LayerNorm`'s ``bias=`` as a keyword; the parameters and state-dict keys
    are those of both. The output has the input's dtype; parameters may have another dtype
    (e.g. fp32 weights with a bf16 input) and are read in their own precision.

    Args:
        normalized_shape (int or tuple of int): the trailing dims to normalize over.
        eps (float): added to the variance. Default: ``1e-5``.
        elementwise_affine (bool): learn a per-element ``weight`` (ones) and ``bias`` (zeros).
            Default: ``True``.
        memory_efficient (bool): save the output, not the input, for backward; needs non-zero
            weights (see :func:`fused_layer_norm`). Default: ``False``.
        bias (bool, keyword-only): with ``elementwise_affine``, also learn a ``bias``
            (``torch.nn.LayerNorm``'s flag). Default: ``True``.
        device (torch.device, optional): where to create the parameters. Default: ``None``.
        dtype (torch.dtype, optional): dtype of the parameters. Default: ``None``.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(512, 1024), FusedLayerNorm(1024)).cuda()
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> for x, target in loader:
        ...     loss = torch.nn.functional.mse_loss(model(x.cuda()), target.cuda())
        ...     opt.zero_grad()
        ...     loss.backward()
        ...     opt.step()
    """

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
        *,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__(
            normalized_shape, eps, elementwise_affine, memory_efficient, is_rms=False,
            output_like_weight=False, bias=bias, device=device, dtype=dtype,
        )


class MixedFusedLayerNorm(FusedLayerNorm):
    """:class:`FusedLayerNorm` whose output takes the parameters' dtype, as in Apex.

    Meant for fp32 parameters fed half-precision activations: the output (and the gradient
    flowing back into it) is fp32 while the input and its gradient stay half. Always affine.

    Args:
        normalized_shape (int or tuple of int): the trailing dims to normalize over.
        eps (float): added to the variance. Default: ``1e-5``.
        memory_efficient (bool): save the output for backward (see :func:`fused_layer_norm`).
            Default: ``False``.
        elementwise_affine (bool, keyword-only): accepted for Apex's callers; must be True.
        bias (bool, keyword-only): also learn a ``bias``, as in :class:`FusedLayerNorm`
            (``torch.nn.LayerNorm``'s flag; Apex's class had none). Default: ``True``.
        **ignored: other keywords (Megatron's ``sequence_parallel_enabled``, say) are dropped
            with a warning, as Apex's class dropped them.
        device (torch.device, optional): where to create the parameters. Default: ``None``.
        dtype (torch.dtype, optional): dtype of the parameters. Default: ``None`` (fp32).

    Example::

        >>> norm = MixedFusedLayerNorm(1024).cuda()  # fp32 weight and bias
        >>> x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        >>> y = norm(x)  # y is fp32
        >>> y.sum().backward()  # x.grad is bf16, norm.weight.grad fp32
    """

    _CLASS_OUTPUT_LIKE_WEIGHT = True  # (for __setstate__: see _FusedNorm)

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float = 1e-5,
        *,
        memory_efficient: bool = False,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
        **ignored,
    ):
        _require_affine(type(self).__name__, elementwise_affine, ignored)
        _FusedNorm.__init__(
            self, normalized_shape, eps, True, memory_efficient, is_rms=False,
            output_like_weight=True, bias=bias, device=device, dtype=dtype,
        )
