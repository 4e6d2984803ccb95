"""The fused norm as an autograd op: path choice, eager autograd, and the ``torch.library`` ops.

Two entry points run the same implementation (:func:`norm_fwd_impl` / :func:`norm_bwd_impl`):

* eager mode uses :class:`_FusedNormFunction`, a plain ``torch.autograd.Function``: it costs a
  few microseconds of Python per call where a ``torch.library`` op costs tens;
* under ``torch.compile`` the call goes to the custom ops ``mixprec::fused_norm_fwd`` and
  ``mixprec::fused_norm_bwd``, which have fake implementations and a registered autograd
  formula, so Dynamo keeps them as single opaque nodes and ``fullgraph=True`` holds.

Where the work runs: CUDA tensors of fp32/fp16/bf16 with rows of at most
``_launch.MAX_FUSED_N`` elements take the Triton kernels when Triton imports; everything else
(CPU tensors, fp64, longer rows, no Triton) takes :mod:`mixprec.normalization.reference`.
"""

import contextlib
import math
import warnings
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from mixprec.normalization import _launch, reference

__all__ = []

_triton_on_cpu = False
_warned_long_rows = False


@contextlib.contextmanager
def triton_on_cpu():
    """Testing hook: run CPU tensors through the Triton kernels (needs ``TRITON_INTERPRET=1``).

    Example::

        >>> with triton_on_cpu():  # doctest: +SKIP
        ...     y = fused_layer_norm(torch.randn(3, 8), 8)
    """
    global _triton_on_cpu
    previous, _triton_on_cpu = _triton_on_cpu, True
    try:
        yield
    finally:
        _triton_on_cpu = previous


def _use_triton(x: Tensor, *params: Optional[Tensor]) -> bool:
    if x.dtype not in _launch.FUSED_DTYPES:
        return False
    if any(p is not None and p.dtype not in _launch.FUSED_DTYPES for p in params):
        return False
    n = x.shape[1]
    if n == 0:
        return False
    if x.is_cuda:
        if not _launch.triton_available():
            return False
        if n > _launch.MAX_FUSED_N:
            global _warned_long_rows
            if not _warned_long_rows:
                _warned_long_rows = True
                warnings.warn(
                    f"mixprec.normalization: rows of {n} elements exceed the fused kernels' "
                    f"limit of {_launch.MAX_FUSED_N}; running the PyTorch reference path "
                    "(correct, slower)",
                    stacklevel=4,
                )
            return False
        return True
    if _triton_on_cpu and x.device.type == "cpu" and n <= _launch.MAX_FUSED_N:
        if not (_launch.triton_available() and _launch.interpreter_enabled()):
            raise RuntimeError(
                "triton_on_cpu() needs Triton installed and TRITON_INTERPRET=1 set before "
                "mixprec.normalization._kernels is first imported"
            )
        return True
    return False


def norm_fwd_impl(
    x: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    out_dtype: torch.dtype,
    out: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward on ``x [M, N]``: ``(y, mean, rstd)``; see ``reference.norm_forward``.

    ``out``, when given, is a ``[M, N]`` view (unit column stride) that receives ``y`` and is
    returned as ``y``.
    """
    if _use_triton(x, weight, bias):
        return _launch.forward(x, weight, bias, eps, is_rms, out_dtype, out=out)
    y, mean, rstd = reference.norm_forward(x, weight, bias, eps, is_rms, out_dtype)
    if out is not None:
        out.copy_(y)
        return out, mean, rstd
    # The fake implementation promises a contiguous y; row-strided inputs must not change that.
    return y.contiguous(), mean, rstd


def norm_bwd_impl(
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
) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward: ``(dx, dweight, dbias)``; see ``reference.norm_backward``."""
    if dy.shape[1] > 1 and dy.stride(1) != 1:
        # e.g. the expanded all-ones gradient of y.sum()
        dy = dy.contiguous()
    if (
        rstd.dtype == torch.float32
        and x_dtype in _launch.FUSED_DTYPES
        and dy.dtype in _launch.FUSED_DTYPES
        and _use_triton(xy, weight, bias)
    ):
        return _launch.backward(
            dy, xy, weight, bias, mean, rstd, is_rms, from_y, x_dtype, need_dw, need_db
        )
    return reference.norm_backward(
        dy, xy, weight, bias, mean, rstd, is_rms, from_y, x_dtype, need_dw, need_db
    )


def _rows(t: Tensor, n: int) -> Tensor:
    """``t`` as ``[M, n]`` rows with unit column stride (a view where the strides allow)."""
    if t.dim() == 2 and t.shape[1] == n and (n <= 1 or t.stride(1) == 1):
        return t  # already rows: no view to make (this runs per call, forward and backward)
    t2d = t.reshape(-1, n)
    if n > 1 and t2d.stride(1) != 1:
        # e.g. a transposed input, or the expanded all-ones gradient of y.sum()
        t2d = t2d.contiguous()
    return t2d


def _flat(p: Optional[Tensor]) -> Optional[Tensor]:
    """A parameter as the contiguous 1-D vector the kernels read."""
    if p is None or (p.dim() == 1 and p.is_contiguous()):
        return p
    return p.reshape(-1).contiguous()


def _forward(x, weight, bias, n, eps, is_rms, out_dtype) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Eager forward into an output allocated in ``x``'s shape: ``(y, x2d, mean, rstd)``."""
    x2d = _rows(x, n)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _, mean, rstd = norm_fwd_impl(
        x2d, _flat(weight), _flat(bias), eps, is_rms, out_dtype,
        out=y if x2d is x else y.view(-1, n),
    )
    return y, x2d, mean, rstd


class _FusedNormFunction(torch.autograd.Function):
    """Eager-mode autograd wrapper around :func:`norm_fwd_impl` / :func:`norm_bwd_impl`.

    It takes the input and parameters in their own shapes and does every reshape inside, so
    that a call adds one node to the autograd graph (not one per view), and it returns an
    output allocated in the input's shape (not a view, so in-place ops after it are allowed).
    A norm runs twice per transformer layer: its host cost is part of the step's.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, spec):
        # The non-tensor arguments travel as one tuple: apply() inspects each argument.
        n, eps, is_rms, memory_efficient, out_dtype = spec
        y, x2d, mean, rstd = _forward(x, weight, bias, n, eps, is_rms, out_dtype)
        # memory_efficient keeps y (which the next layer keeps anyway) instead of x. A copy made
        # by _rows is kept rather than remade in backward.
        saved = y if memory_efficient else (x if x2d is x or x2d._is_view() else x2d)
        ctx.save_for_backward(saved, weight, bias, mean, rstd)
        ctx.n = n
        ctx.is_rms = is_rms
        ctx.memory_efficient = memory_efficient
        ctx.x_dtype = x.dtype
        ctx.x_shape = x.shape
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        xy, weight, bias, mean, rstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        n = ctx.n
        dx, dw, db = norm_bwd_impl(
            _rows(dy, n), _rows(xy, n), _flat(weight), _flat(bias), mean, rstd, ctx.is_rms,
            ctx.memory_efficient, ctx.x_dtype, need_w, need_b,
        )
        # (Views only where shapes differ: each costs host time, and this runs per layer.)
        return (
            (dx if len(ctx.x_shape) == 2 else dx.view(ctx.x_shape)) if need_x else None,
            (dw if weight.dim() == 1 else dw.view(weight.shape)) if need_w else None,
            (db if bias.dim() == 1 else db.view(bias.shape)) if need_b else None,
            None,
        )


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


_HAS_CUSTOM_OP = hasattr(torch.library, "custom_op")

if _HAS_CUSTOM_OP:

    @torch.library.custom_op("mixprec::fused_norm_fwd", mutates_args=())
    def _fused_norm_fwd(
        x: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        eps: float,
        is_rms: bool,
        memory_efficient: bool,
        out_dtype: torch.dtype,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        return norm_fwd_impl(x, weight, bias, eps, is_rms, out_dtype)

    @_fused_norm_fwd.register_fake
    def _fused_norm_fwd_fake(x, weight, bias, eps, is_rms, memory_efficient, out_dtype):
        m = x.shape[0]
        stat = _stat_dtype(x.dtype)
        y = x.new_empty(x.shape, dtype=out_dtype)
        mean = x.new_empty((0,) if is_rms else (m,), dtype=stat)
        rstd = x.new_empty((m,), dtype=stat)
        return y, mean, rstd

    @torch.library.custom_op("mixprec::fused_norm_bwd", mutates_args=())
    def _fused_norm_bwd(
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
    ) -> Tuple[Tensor, Tensor, Tensor]:
        return norm_bwd_impl(
            dy, xy, weight, bias, mean, rstd, is_rms, from_y, x_dtype, need_dw, need_db
        )

    @_fused_norm_bwd.register_fake
    def _fused_norm_bwd_fake(
        dy, xy, weight, bias, mean, rstd, is_rms, from_y, x_dtype, need_dw, need_db
    ):
        dx = xy.new_empty(xy.shape, dtype=x_dtype)
        if need_dw and weight is not None:
            dw = weight.new_empty(weight.shape)
        else:
            dw = xy.new_empty((0,), dtype=rstd.dtype)
        if need_db and bias is not None and not is_rms:
            db = bias.new_empty(bias.shape)
        else:
            db = xy.new_empty((0,), dtype=rstd.dtype)
        return dx, dw, db

    def _fwd_setup_context(ctx, inputs, output):
        x, weight, bias, _eps, is_rms, memory_efficient, _out_dtype = inputs
        y, mean, rstd = output
        ctx.save_for_backward(y if memory_efficient else x, weight, bias, mean, rstd)
        ctx.is_rms = is_rms
        ctx.memory_efficient = memory_efficient
        ctx.x_dtype = x.dtype

    def _fwd_backward(ctx, dy, _dmean, _drstd):
        xy, weight, bias, mean, rstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx, dw, db = torch.ops.mixprec.fused_norm_bwd(
            dy, xy, weight, bias, mean, rstd, ctx.is_rms, ctx.memory_efficient, ctx.x_dtype,
            need_w, need_b,
        )
        return (
            dx if need_x else None,
            dw if need_w else None,
            db if need_b else None,
            None,
            None,
            None,
            None,
        )

    _fused_norm_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def fused_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    memory_efficient: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    """Normalize ``x`` over its trailing ``normalized_shape``; arguments already validated."""
    n = math.prod(normalized_shape)
    if is_rms:
        bias = None
    if n == 0:  # nothing to normalize (a zero in normalized_shape): the reference's empty result
        if is_rms:
            return reference.rms_norm(x, list(normalized_shape), weight, eps, out_dtype)
        return reference.layer_norm(x, list(normalized_shape), weight, bias, eps, out_dtype)
    if _HAS_CUSTOM_OP and (_launch.is_compiling() or torch.jit.is_tracing()):
        # One opaque node for Dynamo/AOTAutograd (and a serializable op in traces).
        y2d = torch.ops.mixprec.fused_norm_fwd(
            _rows(x, n), _flat(weight), _flat(bias), eps, is_rms, memory_efficient, out_dtype
        )[0]
        return y2d.view(x.shape)
    if torch.is_grad_enabled() and (
        x.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    ):
        return _FusedNormFunction.apply(
            x, weight, bias, (n, eps, is_rms, memory_efficient, out_dtype)
        )
    return _forward(x, weight, bias, n, eps, is_rms, out_dtype)[0]
