"""Fused RMSNorm: ``fused_rms_norm``, ``FusedRMSNorm`` and ``MixedFusedRMSNorm``.

``y = x / sqrt(mean(x**2) + eps) * weight``, drop-in for Apex's ``FusedRMSNorm`` /
``MixedFusedRMSNorm`` (and, up to the default ``eps``, :class:`torch.nn.RMSNorm`).

Dtypes follow :mod:`mixprec.normalization.layer_norm`: statistics in fp32, output in the
input's dtype (the weight's for the Mixed variant), parameters read and differentiated in
their own dtype, unchanged under ``torch.autocast``.
"""

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from mixprec.normalization import _checks, _ops
from mixprec.normalization._module import _FusedNorm, _require_affine

__all__ = ["fused_rms_norm", "FusedRMSNorm", "MixedFusedRMSNorm"]


def fused_rms_norm(
    x: Tensor,
    normalized_shape: Union[int, Sequence[int]],
    weight: Optional[Tensor] = None,
    eps: float = 1e-5,
    memory_efficient: bool = False,
) -> Tensor:
    """RMSNorm over the trailing ``normalized_shape`` dims of ``x``, fused on CUDA.

    Triton kernels on CUDA for fp32/fp16/bf16 rows up to 65,536 elements; the plain-PyTorch
    :func:`mixprec.normalization.reference.rms_norm` math elsewhere (CPU, fp64, longer rows).

    Args:
        x (Tensor): input ``[*, *normalized_shape]``, fp32, fp16, bf16 or fp64; any leading
            shape, any strides.
        normalized_shape (int or tuple of int): the trailing dims to normalize over.
        weight (Tensor, optional): scale, shape ``normalized_shape``. Default: ``None``.
        eps (float): added to the mean square. Default: ``1e-5``.
        memory_efficient (bool): save the output instead of the input for backward and
            recover ``x_hat = y / weight``; needs every weight element non-zero. Default:
            ``False``.

    Returns:
        Tensor: same shape as ``x``, dtype of ``x``.

    Raises:
        ValueError: the input's trailing shape, or the weight's shape, is not
            ``normalized_shape``.
        TypeError: unsupported dtypes or argument types.

    Example::

        >>> x = torch.randn(8, 128, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        >>> w = torch.ones(4096, device="cuda", requires_grad=True)
        >>> y = fused_rms_norm(x, 4096, w)
        >>> y.float().sum().backward()
    """
    return _fused_rms_norm(x, normalized_shape, weight, eps, memory_efficient)


def _fused_rms_norm(x, normalized_shape, weight, eps, memory_efficient) -> Tensor:
    # Registered with torch.fx.wrap (below): one call_function node under torch.fx.
    shape = _checks.normalize_shape(normalized_shape, "fused_rms_norm")
    if not torch.jit.is_tracing():  # (traced sizes: TracerWarnings only; the traced ops check)
        _checks.check_inputs("fused_rms_norm", x, shape, weight, None, eps)
    return _ops.fused_norm(x, shape, weight, None, float(eps), True, memory_efficient, x.dtype)


torch.fx.wrap("_fused_rms_norm")


class FusedRMSNorm(_FusedNorm):
    """RMSNorm over the last dims, with fused Triton kernels on CUDA.

    Same arguments as Apex's ``FusedRMSNorm``; the parameter is ``weight`` (no bias), as in
    :class:`torch.nn.RMSNorm`. The output has the input's dtype.

    Args:
        normalized_shape (int or tuple of int): the trailing dims to normalize over.
        eps (float): added to the mean square. Default: ``1e-5``.
        elementwise_affine (bool): learn a per-element ``weight`` (ones). Default: ``True``.
        memory_efficient (bool): save the output, not the input, for backward; needs non-zero
            weights. Default: ``False``.
        device (torch.device, optional): where to create the parameter. Default: ``None``.
        dtype (torch.dtype, optional): dtype of the parameter. Default: ``None``.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(512, 4096), FusedRMSNorm(4096)).cuda()
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> for x, target in loader:
        ...     loss = torch.nn.functional.mse_loss(model(x.cuda()), target.cuda())
        ...     opt.zero_grad()
        ...     loss.backward()
        ...     opt.step()
    """

    _CLASS_IS_RMS = True  # (for __setstate__: see _FusedNorm)

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__(
            normalized_shape, eps, elementwise_affine, memory_efficient, is_rms=True,
            output_like_weight=False, device=device, dtype=dtype,
        )


class MixedFusedRMSNorm(FusedRMSNorm):
    """:class:`FusedRMSNorm` whose output takes the weight's dtype, as in Apex.

    Meant for an fp32 weight fed half-precision activations: the output is fp32, the input's
    gradient keeps the input's dtype. Always affine.

    Args:
        normalized_shape (int or tuple of int): the trailing dims to normalize over.
        eps (float): added to the mean square. Default: ``1e-5``.
        memory_efficient (bool): save the output for backward (see :func:`fused_rms_norm`).
            Default: ``False``.
        elementwise_affine (bool, keyword-only): accepted for Apex's callers; must be True.
        **ignored: other keywords (Megatron's ``sequence_parallel_enabled``, say) are dropped
            with a warning, as Apex's class dropped them (``bias=True`` too: RMSNorm has no
            bias); ``bias=False`` is accepted silently.
        device (torch.device, optional): where to create the parameter. Default: ``None``.
        dtype (torch.dtype, optional): dtype of the parameter. Default: ``None`` (fp32).

    Example::

        >>> norm = MixedFusedRMSNorm(4096).cuda()
        >>> x = torch.randn(16, 4096, device="cuda", dtype=torch.float16, requires_grad=True)
        >>> norm(x).sum().backward()  # output fp32, x.grad fp16, norm.weight.grad fp32
    """

    _CLASS_OUTPUT_LIKE_WEIGHT = True  # (for __setstate__: see _FusedNorm)

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float = 1e-5,
        *,
        memory_efficient: bool = False,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        **ignored,
    ):
        name = type(self).__name__
        if "bias" in ignored and not ignored["bias"]:
            # torch.nn.LayerNorm's flag: False is what RMSNorm is. (True is dropped with the
            # warning below, as Apex's class dropped it: an Apex script passing it runs.)
            del ignored["bias"]
        _require_affine(name, elementwise_affine, ignored)
        _FusedNorm.__init__(
            self, normalized_shape, eps, True, memory_efficient, is_rms=True,
            output_like_weight=True, device=device, dtype=dtype,
        )
