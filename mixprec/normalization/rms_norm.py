"""Fused RMSNorm: ``fused_rms_norm``, ``FusedRMSNorm`` and ``MixedFusedRMSNorm``.

``y = x / sqrt(mean(x**2) + eps) * weight``, drop-in for Apex's ``FusedRMSNorm`` /
``MixedFusedRMSNorm`` (and, up to the default ``eps``, :class:`torch.nn.RMSNorm`).

Dtypes follow :mod:`mixprec.normalization.layer_norm`: statistics in fp32, output in the
input's dtype (the weight's for the Mixed variant), parameters read and differentiated in
their own dtype, unchanged under ``torch.autocast``.
"""

import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from mixprec.normalization import _checks, _ops, reference

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
    shape = _checks.normalize_shape(normalized_shape, "fused_rms_norm")
    _checks.check_inputs("fused_rms_norm", x, shape, weight, None, eps)
    return _ops.fused_norm(x, shape, weight, None, float(eps), True, memory_efficient, x.dtype)


class FusedRMSNorm(nn.Module):
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

    __constants__ = [
        "normalized_shape", "eps", "elementwise_affine", "memory_efficient", "_output_like_weight"
    ]
    normalized_shape: Tuple[int, ...]
    eps: float
    elementwise_affine: bool
    memory_efficient: bool
    _output_like_weight: bool

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
        super().__init__()
        name = type(self).__name__
        self.normalized_shape = _checks.normalize_shape(normalized_shape, name)
        if not isinstance(eps, numbers.Real) or eps < 0:
            raise ValueError(f"{name}: eps must be a non-negative float, got {eps!r}")
        self.eps = float(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.memory_efficient = bool(memory_efficient)
        # True in the Mixed variant: the output takes the weight's dtype, not the input's.
        self._output_like_weight = False
        if self.elementwise_affine:
            self.weight = nn.Parameter(
                torch.empty(self.normalized_shape, device=device, dtype=dtype)
            )
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight to ones."""
        if self.elementwise_affine:
            nn.init.ones_(self.weight)

    def forward(self, input: Tensor) -> Tensor:
        out_dtype = input.dtype
        if self._output_like_weight and self.weight is not None:
            out_dtype = self.weight.dtype
        if torch.jit.is_scripting():
            # TorchScript cannot call the Triton launcher; run the plain-PyTorch math.
            return reference.rms_norm(
                input, list(self.normalized_shape), self.weight, self.eps, out_dtype
            )
        return self._fused_forward(input, out_dtype)

    @torch.jit.unused
    def _fused_forward(self, input: Tensor, out_dtype: torch.dtype) -> Tensor:
        where = type(self).__name__
        _checks.check_inputs(where, input, self.normalized_shape, self.weight, None, self.eps)
        return _ops.fused_norm(
            input, self.normalized_shape, self.weight, None, self.eps, True,
            self.memory_efficient, out_dtype,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}, "
            f"memory_efficient={self.memory_efficient}"
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
        device (torch.device, optional): where to create the parameter. Default: ``None``.
        dtype (torch.dtype, optional): dtype of the parameter. Default: ``None`` (fp32).

    Example::

        >>> norm = MixedFusedRMSNorm(4096).cuda()
        >>> x = torch.randn(16, 4096, device="cuda", dtype=torch.float16, requires_grad=True)
        >>> norm(x).sum().backward()  # output fp32, x.grad fp16, norm.weight.grad fp32
    """

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float = 1e-5,
        *,
        memory_efficient: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__(
            normalized_shape, eps, elementwise_affine=True, memory_efficient=memory_efficient,
            device=device, dtype=dtype,
        )
        self._output_like_weight = True
