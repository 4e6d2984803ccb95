"""Plain-PyTorch LayerNorm and RMSNorm: the CPU path, the TorchScript path, and the reference.

Two kinds of functions live here:

* :func:`layer_norm` and :func:`rms_norm` are built from differentiable PyTorch ops, so
  autograd derives their gradients. The tests run them in float64 as the ground truth, the
  benchmarks time them, and the modules call them under ``torch.jit.script``.
* :func:`norm_forward` and :func:`norm_backward` are the explicit forward and backward on
  2-D ``[M, N]`` rows with saved statistics, the same contract as the Triton kernels. They are
  what the fused ops run on CPU tensors, for float64 inputs, and for rows too long for the
  fused kernel.

Numerics: statistics are computed in float32 (float64 for float64 inputs) whatever the input
dtype, and the result is cast once, on the way out.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["layer_norm", "rms_norm", "norm_forward", "norm_backward"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half inputs are normalized in fp32; fp64 stays fp64 so the reference can be exact.
    return torch.promote_types(dtype, torch.float32)


def _normalized_dims(normalized_shape: List[int]) -> List[int]:
    return [-i - 1 for i in range(len(normalized_shape))]


def layer_norm(
    x: Tensor,
    normalized_shape: List[int],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """LayerNorm over the last ``len(normalized_shape)`` dims, in plain differentiable PyTorch.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with the biased variance, like
    :func:`torch.nn.functional.layer_norm`, but the statistics are always computed in at least
    fp32 and the result is cast once to ``out_dtype``.

    Args:
        x (Tensor): input ``[*, *normalized_shape]``.
        normalized_shape (list of int): the trailing shape normalized over.
        weight (Tensor, optional): scale of shape ``normalized_shape``. Default: ``None``.
        bias (Tensor, optional): shift of shape ``normalized_shape``. Default: ``None``.
        eps (float): added to the variance. Default: ``1e-5``.
        out_dtype (torch.dtype, optional): dtype of the result. Default: ``x.dtype``.

    Returns:
        Tensor: the normalized input, shape of ``x``, dtype ``out_dtype``.

    Example::

        >>> x = torch.randn(4, 8, dtype=torch.float64)
        >>> y = layer_norm(x, [8])
        >>> torch.allclose(y, torch.nn.functional.layer_norm(x, [8]))
        True
    """
    compute = _compute_dtype(x.dtype)
    dims = _normalized_dims(normalized_shape)
    xf = x.to(compute)
    mean = xf.mean(dim=dims, keepdim=True)
    xc = xf - mean
    var = (xc * xc).mean(dim=dims, keepdim=True)
    y = xc * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype if out_dtype is None else out_dtype)


def rms_norm(
    x: Tensor,
    normalized_shape: List[int],
    weight: Optional[Tensor] = None,
    eps: float = 1e-5,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """RMSNorm over the last ``len(normalized_shape)`` dims, in plain differentiable PyTorch.

    ``y = x / sqrt(mean(x**2) + eps) * weight``, as in Apex's ``FusedRMSNorm`` and
    :class:`torch.nn.RMSNorm` (whose default ``eps`` differs: ours is ``1e-5``).

    Args:
        x (Tensor): input ``[*, *normalized_shape]``.
        normalized_shape (list of int): the trailing shape normalized over.
        weight (Tensor, optional): scale of shape ``normalized_shape``. Default: ``None``.
        eps (float): added to the mean square. Default: ``1e-5``.
        out_dtype (torch.dtype, optional): dtype of the result. Default: ``x.dtype``.

    Returns:
        Tensor: the normalized input, shape of ``x``, dtype ``out_dtype``.

    Example::

        >>> x = torch.randn(4, 8)
        >>> y = rms_norm(x, [8])
        >>> torch.allclose(y.pow(2).mean(-1), torch.ones(4), atol=1e-3)
        True
    """
    compute = _compute_dtype(x.dtype)
    dims = _normalized_dims(normalized_shape)
    xf = x.to(compute)
    y = xf * torch.rsqrt((xf * xf).mean(dim=dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    return y.to(x.dtype if out_dtype is None else out_dtype)


def norm_forward(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    out_dtype: torch.dtype,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward of LayerNorm (or RMSNorm) over the rows of a 2-D input, saving the statistics.

    Same contract as the Triton forward kernel, so the fused ops can run either.

    Args:
        x (Tensor): input ``[M, N]``.
        weight (Tensor, optional): ``[N]``.
        bias (Tensor, optional): ``[N]``; ignored when ``is_rms``.
        eps (float): added to the variance (mean square for RMSNorm).
        is_rms (bool): RMSNorm (no centering, no bias) instead of LayerNorm.
        out_dtype (torch.dtype): dtype of ``y``.

    Returns:
        (Tensor, Tensor, Tensor): ``y [M, N]`` in ``out_dtype``; ``mean [M]`` (empty ``[0]``
        for RMSNorm) and ``rstd [M]`` = ``1 / sqrt(var + eps)``, both in fp32 (fp64 for fp64
        input).

    Example::

        >>> y, mean, rstd = norm_forward(torch.randn(3, 5), None, None, 1e-5, False, torch.float32)
    """
    compute = _compute_dtype(x.dtype)
    xf = x.to(compute)
    if not is_rms and not (torch.is_grad_enabled() and (
            x.requires_grad or (weight is not None and weight.requires_grad)
            or (bias is not None and bias.requires_grad))):
        # PyTorch's own kernel: the same statistics and result (in ``compute``, cast once),
        # in one pass (10x faster on a 2-core CPU than the arithmetic below, which serves RMSNorm,
        # and LayerNorm where autograd records this: its mean and rstd outputs are not
        # differentiable, and a second derivative differentiates the statistics). The
        # backward stays the arithmetic of norm_backward: PyTorch's LayerNorm backward
        # folds x_hat into x * a + b and lost 4-5x more precision on inputs with an offset.
        y, mean, rstd = torch.native_layer_norm(
            xf, [xf.shape[1]], None if weight is None else weight.to(compute),
            None if bias is None else bias.to(compute), eps)
        return y.to(out_dtype), mean.view(-1), rstd.view(-1)
    if is_rms and not _records(x, weight):
        # Not recorded by autograd: two passes over x, one new [M, N] tensor (a half x's fp32
        # copy is scaled in place).
        mean = torch.empty(0, dtype=compute, device=x.device)
        rstd = torch.linalg.vector_norm(xf, dim=1).square_().div_(xf.shape[1]).add_(eps).rsqrt_()
        y = xf.mul_(rstd[:, None]) if xf is not x else xf * rstd[:, None]
        if weight is not None:
            y.mul_(weight.to(compute))
        return y.to(out_dtype), mean, rstd
    if is_rms:
        mean = torch.empty(0, dtype=compute, device=x.device)
        rstd = torch.rsqrt((xf * xf).mean(dim=1) + eps)
        x_hat = xf * rstd[:, None]
    else:
        mean = xf.mean(dim=1)
        xc = xf - mean[:, None]
        rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
        x_hat = xc * rstd[:, None]
    y = x_hat
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None and not is_rms:
        y = y + bias.to(compute)
    return y.to(out_dtype), mean, rstd


def norm_backward(
    dy: Tensor,
    xy: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    is_rms: bool,
    from_y: bool,
    x_dtype: torch.dtype,
    need_dw: bool,
    need_db: bool,
    drstd: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`norm_forward`, with the same formulas as the Triton backward kernel.

    With ``x_hat`` the normalized row and ``wdy = weight * dy``:
    ``dx = rstd * (wdy - mean(wdy) - x_hat * mean(wdy * x_hat))`` (no ``mean(wdy)`` term for
    RMSNorm), ``dweight = sum over rows of dy * x_hat`` and ``dbias = sum over rows of dy``.

    Args:
        dy (Tensor): gradient of ``y``, ``[M, N]``.
        xy (Tensor): the saved input ``x``, or the saved output ``y`` when ``from_y``.
        weight (Tensor, optional): ``[N]``.
        bias (Tensor, optional): ``[N]``.
        mean (Tensor): ``[M]`` from the forward (unused for RMSNorm or ``from_y``).
        rstd (Tensor): ``[M]`` from the forward.
        is_rms (bool): RMSNorm instead of LayerNorm.
        from_y (bool): recover ``x_hat = (y - bias) / weight`` from the saved output (the
            memory-efficient mode) instead of from ``x``.
        x_dtype (torch.dtype): dtype of ``dx``.
        need_dw (bool): compute the weight gradient.
        need_db (bool): compute the bias gradient.
        drstd (Tensor, optional): ``[M]``, a gradient reaching ``rstd`` itself (where it is an
            output, as on the memory-efficient path, for second derivatives): adds
            ``drstd * d rstd / dx = -drstd * rstd**2 * x_hat / N`` to ``dx``. Default: ``None``.

    Being plain PyTorch, the result is differentiable where the arguments are (mean and rstd
    included: recompute them from ``x`` for that).

    Returns:
        (Tensor, Tensor, Tensor): ``dx [M, N]`` in ``x_dtype``; ``dweight`` and ``dbias`` ``[N]``
        in the parameters' dtypes, or empty ``[0]`` tensors when not requested.

    Example::

        >>> x, dy = torch.randn(3, 5), torch.randn(3, 5)
        >>> y, mean, rstd = norm_forward(x, None, None, 1e-5, False, torch.float32)
        >>> dx, _, _ = norm_backward(dy, x, None, None, mean, rstd, False, False,
        ...                          torch.float32, False, False)
    """
    if not _records(dy, xy, weight, bias, mean, rstd, drstd):
        return _norm_backward_unrecorded(dy, xy, weight, bias, mean, rstd, is_rms, from_y,
                                         x_dtype, need_dw, need_db, drstd)
    compute = rstd.dtype
    n = xy.shape[1]
    if from_y:
        x_hat = xy.to(compute)
        if bias is not None and not is_rms:
            x_hat = x_hat - bias.to(compute)
        if weight is not None:
            x_hat = x_hat / weight.to(compute)
    elif is_rms:
        x_hat = xy.to(compute) * rstd[:, None]
    else:
        x_hat = (xy.to(compute) - mean[:, None]) * rstd[:, None]
    dyf = dy.to(compute)
    wdy = dyf * weight.to(compute) if weight is not None else dyf
    c1 = (x_hat * wdy).sum(dim=1, keepdim=True) / n
    if is_rms:
        dx = (wdy - x_hat * c1) * rstd[:, None]
    else:
        c2 = wdy.sum(dim=1, keepdim=True) / n
        dx = (wdy - (x_hat * c1 + c2)) * rstd[:, None]
    if drstd is not None:
        # rstd = (var + eps)**-0.5 (mean square for RMSNorm): d rstd / dx = -rstd**2 * x_hat / n
        dx = dx - (drstd.to(compute) * rstd * rstd / n)[:, None] * x_hat
    # Separate empty tensors: the custom ops' outputs may not alias each other.
    dw = torch.empty(0, dtype=compute, device=dy.device)
    db = torch.empty(0, dtype=compute, device=dy.device)
    if need_dw and weight is not None:
        dw = (dyf * x_hat).sum(dim=0).to(weight.dtype)
    if need_db and bias is not None and not is_rms:  # (RMSNorm has no bias: [0], as the kernels)
        db = dyf.sum(dim=0).to(bias.dtype)
    return dx.to(x_dtype), dw, db


def _records(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records an op on ``tensors`` (a double backward, a gradient penalty)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _norm_backward_unrecorded(
    dy: Tensor,
    xy: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    is_rms: bool,
    from_y: bool,
    x_dtype: torch.dtype,
    need_dw: bool,
    need_db: bool,
    drstd: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`norm_backward` where autograd does not record: the same formulas, with three new
    ``[M, N]`` tensors instead of nine (in place where they are this function's own, and the
    row dot product with the weight a matrix-vector product). On a CPU, where each new large
    tensor is fresh memory, this halves the backward's time.
    """
    compute = rstd.dtype
    n = xy.shape[1]
    w = None if weight is None else weight.to(compute)
    r = rstd[:, None]
    x_hat = xy.to(compute, copy=True)
    if from_y:
        if bias is not None and not is_rms:
            x_hat.sub_(bias)
        if w is not None:
            x_hat.div_(w)
    else:
        if not is_rms:
            x_hat.sub_(mean[:, None])
        x_hat.mul_(r)
    dy = dy.to(compute)
    dy_x_hat = dy * x_hat
    # c1 = mean(wdy * x_hat) per row; dx = rstd * (wdy - x_hat * c1 - mean(wdy))
    if w is not None:
        c1 = torch.mv(dy_x_hat, w)
        dx = dy * w
    else:
        c1 = dy_x_hat.sum(dim=1)
        dx = dy.clone()
    c1.div_(n)
    if drstd is not None:
        # d rstd / dx = -rstd**2 * x_hat / n: folded into c1 before the final scaling by rstd
        c1.addcmul_(drstd.to(compute), rstd, value=1.0 / n)
    if not is_rms:
        dx.sub_(dx.sum(dim=1, keepdim=True).div_(n))
    dx.addcmul_(x_hat, c1[:, None], value=-1).mul_(r)
    dw = torch.empty(0, dtype=compute, device=dy.device)
    db = torch.empty(0, dtype=compute, device=dy.device)
    if need_dw and weight is not None:
        dw = dy_x_hat.sum(dim=0).to(weight.dtype)
    if need_db and bias is not None and not is_rms:
        db = dy.sum(dim=0).to(bias.dtype)
    return dx.to(x_dtype), dw, db
