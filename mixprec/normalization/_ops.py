"""The fused norm as an autograd op: path choice, eager autograd, and the ``torch.library`` ops.

Two entry points run the same implementation (:func:`norm_fwd_impl` / :func:`norm_bwd_impl`):

* eager mode uses :class:`_FusedNormFunction`, a plain ``torch.autograd.Function``: it costs a
  few microseconds of Python per call where a ``torch.library`` op costs tens (on the PyTorch
  path its backward is differentiable, for second derivatives; ``memory_efficient`` there uses
  :class:`_FromOutputNormFunction`);
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
import torch.nn.functional as F
from torch import Tensor

from mixprec.amp._logging import is_rank_zero
from mixprec.normalization import _checks, _launch, reference

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


def _use_triton(x: Tensor, n: int, *params: Optional[Tensor]) -> bool:
    """Whether rows of ``n`` elements of ``x`` (with these parameters) take the kernels."""
    if x.dtype not in _launch.FUSED_DTYPES:
        return False
    if any(p is not None and p.dtype not in _launch.FUSED_DTYPES for p in params):
        return False
    if n == 0:
        return False
    if x.is_cuda:
        if not _launch.triton_available():
            return False
        if n > _launch.MAX_FUSED_N:
            global _warned_long_rows
            if not _warned_long_rows:
                _warned_long_rows = True
                if not is_rank_zero():
                    return False
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
) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward on ``x [M, N]``: ``(y, mean, rstd)``; see ``reference.norm_forward``."""
    if _use_triton(x, x.shape[1], weight, bias):
        return _launch.forward(x, weight, bias, eps, is_rms, out_dtype)
    y, mean, rstd = reference.norm_forward(x, weight, bias, eps, is_rms, out_dtype)
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
        and all(t is None or t.device == xy.device for t in (dy, weight, bias, mean, rstd))
        and _use_triton(xy, xy.shape[1], weight, bias)
    ):
        # (The statistics as the kernels read them: a saved-tensor hook may have returned
        # strided copies. The parameters come flat and contiguous from _flat.)
        return _launch.backward(
            dy, xy, weight, bias, mean.contiguous(), rstd.contiguous(), is_rms, from_y,
            x_dtype, need_dw, need_db
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
        # e.g. a transposed input, or the expanded all-ones gradient of y.sum(). (An empty
        # tensor counts as contiguous, so .contiguous() would keep its strides, e.g. the (32, 2)
        # of torch.empty(0, 32)[:, ::2]: the kernels' launcher rejected them and the PyTorch
        # path's row copy, still not rows, recursed forever. clone() gives row strides.)
        t2d = t2d.contiguous() if t2d.numel() else t2d.clone(
            memory_format=torch.contiguous_format)
    return t2d


def _flat(p: Optional[Tensor]) -> Optional[Tensor]:
    """A parameter as the contiguous 1-D vector the kernels read."""
    if p is None or (p.dim() == 1 and p.is_contiguous()):
        return p
    return p.reshape(-1).contiguous()


def _forward(x, weight, bias, n, eps, is_rms, out_dtype,
             kernels: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Eager forward into an output allocated in ``x``'s shape: ``(y, x2d, mean, rstd)``; on
    the Triton kernels where the path chose them (``kernels``), else the PyTorch reference."""
    x2d = _rows(x, n)
    weight, bias = _flat(weight), _flat(bias)
    if not kernels:
        y2d, mean, rstd = reference.norm_forward(x2d, weight, bias, eps, is_rms, out_dtype)
        return _as_shape(y2d, x.shape), x2d, mean, rstd
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _, mean, rstd = _launch.forward(
        x2d, weight, bias, eps, is_rms, out_dtype, out=y if x2d is x else y.view(-1, n),
    )
    return y, x2d, mean, rstd


def _as_shape(y2d: Tensor, shape) -> Tensor:
    """``y2d`` (fresh, made here) in ``shape``, on its own memory and not a view: a view made
    inside an autograd Function may not be written in place afterwards, and a copy into an
    output of that shape took as long as PyTorch's whole LayerNorm on a CPU."""
    if y2d.shape == shape:
        return y2d
    if not y2d.is_contiguous():
        y2d = y2d.contiguous()
    return torch.empty(0, dtype=y2d.dtype, device=y2d.device).set_(
        y2d.untyped_storage(), y2d.storage_offset(), shape, _contiguous_strides(shape))


def _row_stride(x: Tensor, n: int) -> Optional[int]:
    """The row stride when ``x``'s memory holds rows of ``n`` elements with unit column stride
    (as ``x.view(-1, n)`` would see it, without making the view), else None."""
    if x.dim() == 2 and x.shape[1] == n:
        return x.stride(0) if n <= 1 or x.stride(1) == 1 else None
    try:
        rows = x.view(-1, n)
    except RuntimeError:  # not viewable as rows: the generic path copies
        return None
    return rows.stride(0) if n <= 1 or rows.stride(1) == 1 else None


def _contiguous_strides(shape) -> Tuple[int, ...]:
    """The strides ``torch.empty(shape)`` has (sizes 0 and 1 count as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _TritonPath:
    """One input signature on the Triton kernels: the input is read in place (its rows at
    ``x_stride``), the output and the input gradient are allocated contiguous in its shape,
    and a :class:`~mixprec.normalization._launch.NormPlan` launches.

    The backward checks that what autograd hands back is what the forward saved (saved-tensor
    hooks, e.g. ``torch.autograd.graph.save_on_cpu``, return copies with other strides or
    dtypes, and a parameter may have been cast in between); anything else takes ``generic``.
    """

    __slots__ = ("plan", "shape", "n", "x_stride", "xy_stride", "xy_strides", "from_y",
                 "y_dtype", "generic")

    # The kernels' backward gives first derivatives only; the output alone is returned.
    kernels = True
    returns_rstd = False
    copies_rows = False

    def __init__(self, plan, shape, n: int, x_stride: int, x_strides, from_y: bool,
                 y_dtype: torch.dtype, generic: "_GenericPath"):
        self.plan, self.shape, self.n, self.x_stride = plan, shape, n, x_stride
        self.from_y, self.y_dtype, self.generic = from_y, y_dtype, generic
        self.xy_stride = n if from_y else x_stride
        # The saved tensor's full strides: y's (contiguous) or x's.
        self.xy_strides = _contiguous_strides(shape) if from_y else x_strides

    def forward(self, x, weight, bias):
        """``(y, saved for backward, mean, rstd)``."""
        y = torch.empty(self.shape, dtype=self.y_dtype, device=x.device)
        mean, rstd = self.plan.forward(x, self.x_stride, weight, bias, y, self.n)
        return y, y if self.from_y else x, mean, rstd

    def backward(self, dy, saved, weight, bias, mean, rstd, need_dw, need_db):
        """``(dx, dweight, dbias)`` in the input's and parameters' shapes (None where not
        requested)."""
        plan = self.plan
        # What the kernels were planned for, as saved-tensor hooks may return otherwise (e.g.
        # torch.autograd.graph.save_on_cpu, or a hook of the user's: a copy with other
        # strides, dtype or device); else the generic path, which takes any.
        if (
            saved.dtype is not plan.xy_dtype
            or saved.stride() != self.xy_strides
            or saved.device != plan.device
            or rstd.dtype is not torch.float32
            or mean.dtype is not torch.float32
            or not (rstd.is_contiguous() and mean.is_contiguous())
            or rstd.device != plan.device
            or mean.device != plan.device
            or (weight is not None and (weight.dtype is not plan.w_dtype
                                        or not weight.is_contiguous()
                                        or weight.device != plan.device))
            or (bias is not None and (bias.dtype is not plan.b_dtype
                                      or not bias.is_contiguous()
                                      or bias.device != plan.device))
        ):
            return self.generic.backward(dy, saved, weight, bias, mean, rstd, need_dw, need_db)
        if dy.dtype is not self.y_dtype:  # (autograd hands y's dtype; other callers may not)
            dy = dy.to(self.y_dtype)
        if not dy.is_contiguous():  # e.g. the expanded all-ones gradient of y.sum()
            dy = dy.contiguous()
        return plan.backward(dy, self.n, saved, self.xy_stride, weight, bias, mean, rstd,
                             need_dw, need_db, self.shape)


class _GenericPath:
    """One input signature on :func:`norm_fwd_impl` / :func:`norm_bwd_impl` over ``[M, N]``
    rows: the PyTorch reference (CPU, fp64, rows too long) or, for inputs whose memory is not
    rows, the kernels on a row copy (``kernels``).

    On the PyTorch reference the backward is itself differentiable (a second derivative, e.g.
    ``torch.autograd.gradgradcheck`` or a gradient penalty, works): under ``create_graph=True``
    it recomputes the statistics from the saved ``x``, so that autograd sees how they depend
    on it. With ``memory_efficient`` (``returns_rstd``) ``x`` is not kept; the autograd
    Function then returns ``rstd`` beside ``y`` (:class:`_FromOutputNormFunction`), and both
    stay connected to ``x`` through it.
    """

    __slots__ = ("shape", "x_dtype", "n", "eps", "is_rms", "from_y", "y_dtype", "kernels",
                 "returns_rstd", "copies_rows", "param_dtypes")

    def __init__(self, shape, x_dtype, n, eps, is_rms, from_y, y_dtype, kernels,
                 copies_rows=False, param_dtypes=(None, None)):
        self.shape, self.x_dtype, self.n, self.eps = shape, x_dtype, n, eps
        # (the weight's and bias's dtypes, which their gradients take: a saved-tensor hook may
        # hand the backward copies of another dtype)
        self.param_dtypes = param_dtypes
        self.is_rms, self.from_y, self.y_dtype = is_rms, from_y, y_dtype
        self.kernels = kernels
        self.returns_rstd = from_y and not kernels
        # On the reference, an input whose memory is not rows (transposed, strided) is copied
        # into rows by autograd before the Function (see fused_norm): the Function then keeps
        # that copy, not x (whose whole storage it would hold alive), and second derivatives
        # still reach x through the copy.
        self.copies_rows = copies_rows

    def forward(self, x, weight, bias):
        y, x2d, mean, rstd = _forward(x, weight, bias, self.n, self.eps, self.is_rms,
                                      self.y_dtype, self.kernels)
        # memory_efficient keeps y (which the next layer keeps anyway) instead of x. A copy
        # made by _rows is kept rather than remade in backward. (On the reference, with grad,
        # x is always rows here, through which a second derivative reaches the input: one that
        # is not was copied into rows by autograd first; see copies_rows.)
        if self.from_y:
            saved = y
        elif x2d is x or x2d._is_view():
            saved = x
        else:
            saved = x2d
        return y, saved, mean, rstd

    def backward(self, dy, saved, weight, bias, mean, rstd, need_dw, need_db, drstd=None):
        """``(dx, dweight, dbias)``; ``drstd``: the gradient reaching ``rstd`` where it is an
        output (``returns_rstd``)."""
        n = self.n
        dy2d, xy, w, b = _rows(dy, n), _rows(saved, n), _flat(weight), _flat(bias)
        w_dtype, b_dtype = self.param_dtypes
        # (A hook's copy of a parameter in another dtype is read in the parameter's own, so
        # that its gradient is computed and returned in it, not rounded to the copy's.)
        if w is not None and w.dtype is not w_dtype:
            w = w.to(w_dtype)
        if b is not None and b.dtype is not b_dtype:
            b = b.to(b_dtype)
        if self.kernels:
            dx, dw, db = norm_bwd_impl(dy2d, xy, w, b, mean, rstd, self.is_rms, self.from_y,
                                       self.x_dtype, need_dw, need_db)
        else:
            if torch.is_grad_enabled() and not self.from_y:
                # create_graph=True: autograd records this backward; the saved statistics are
                # constants to it, so recompute them from x.
                _, mean, rstd = reference.norm_forward(xy, None, None, self.eps, self.is_rms,
                                                       xy.dtype)
            dx, dw, db = reference.norm_backward(dy2d, xy, w, b, mean, rstd, self.is_rms,
                                                 self.from_y, self.x_dtype, need_dw, need_db,
                                                 drstd)
        # (Views only where shapes differ: each costs host time.)
        return (
            dx if dx.shape == self.shape else dx.view(self.shape),
            (dw if weight.dim() == 1 else dw.view(weight.shape)) if need_dw else None,
            (db if bias.dim() == 1 else db.view(bias.shape)) if need_db else None,
        )


def _make_path(x: Tensor, weight, bias, n: int, eps: float, is_rms: bool, from_y: bool,
               out_dtype: torch.dtype):
    """The path of one input signature (``n > 0``)."""
    m = x.numel() // n
    kernels = _use_triton(x, n, weight, bias)
    copies_rows = not kernels and not from_y and _row_stride(x, n) is None
    generic = _GenericPath(x.shape, x.dtype, n, eps, is_rms, from_y, out_dtype, kernels,
                           copies_rows, (None if weight is None else weight.dtype,
                                         None if bias is None else bias.dtype))
    if (
        kernels
        and m > 0
        and (weight is None or weight.is_contiguous())
        and (bias is None or bias.is_contiguous())
    ):
        x_stride = _row_stride(x, n)
        if x_stride is not None:
            plan = _launch.norm_plan(
                x.device, m, n, x.dtype, out_dtype, None if weight is None else weight.dtype,
                None if bias is None else bias.dtype, eps, is_rms, from_y)
            return _TritonPath(plan, x.shape, n, x_stride, x.stride(), from_y, out_dtype, generic)
    return generic


def _backward(ctx, dy):
    saved, weight, bias, mean, rstd = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    path = ctx.path
    if path.kernels and _launch.is_batched_grad(dy):
        path = _reference_path(path)  # (is_grads_batched=True: PyTorch's arithmetic)
    dx, dw, db = path.backward(dy, saved, weight, bias, mean, rstd, need_w, need_b)
    return dx if need_x else None, dw if need_w else None, db if need_b else None, None


def _reference_path(path) -> "_GenericPath":
    """``path``'s signature on the PyTorch reference (no kernels)."""
    g = path.generic if isinstance(path, _TritonPath) else path
    return _GenericPath(g.shape, g.x_dtype, g.n, g.eps, g.is_rms, g.from_y, g.y_dtype, False,
                        param_dtypes=g.param_dtypes)


class _FusedNormFunction(torch.autograd.Function):
    """Eager-mode autograd wrapper around a path (:class:`_TritonPath` or
    :class:`_GenericPath`).

    It takes the input and parameters in their own shapes and does every reshape inside, so
    that a call adds one node to the autograd graph (not one per view), and it returns an
    output allocated in the input's shape (not a view, so in-place ops after it are allowed).
    A norm runs twice per transformer layer: its host cost is part of the step's.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, path):
        y, saved, mean, rstd = path.forward(x, weight, bias)
        ctx.save_for_backward(saved, weight, bias, mean, rstd)
        ctx.path = path
        return y

    @staticmethod
    def backward(ctx, dy):
        if not ctx.path.kernels and torch.is_grad_enabled():
            # create_graph=True on the PyTorch reference: its backward is differentiable.
            return _backward(ctx, dy)
        # The kernels have no second derivative: an error if one is asked for.
        return _launch.first_derivatives_only(_backward, ctx, dy, _KERNELS_FIRST_ONLY)


_KERNELS_FIRST_ONLY = (
    "mixprec's fused norm on its Triton kernels (for second derivatives use "
    "torch.nn.LayerNorm / RMSNorm there; mixprec's PyTorch path, on CPU or in float64, has them)"
)


class _FromOutputNormFunction(torch.autograd.Function):
    """:class:`_FusedNormFunction` for ``memory_efficient`` on the PyTorch reference
    (``path.returns_rstd``): ``rstd`` is an output beside ``y`` so that both, saved for
    backward in place of ``x``, stay connected to ``x`` and a second derivative can flow
    through them (``d rstd / dx = -rstd**2 * x_hat / N``, see ``reference.norm_backward``).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, path):
        ctx.set_materialize_grads(False)
        y, _, mean, rstd = path.forward(x, weight, bias)
        ctx.save_for_backward(y, weight, bias, mean, rstd)
        ctx.path = path
        return y, rstd

    @staticmethod
    def backward(ctx, dy, drstd):
        y, weight, bias, mean, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(y)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx, dw, db = ctx.path.backward(dy, y, weight, bias, mean, rstd, need_w, need_b, drstd)
        return dx if need_x else None, dw if need_w else None, db if need_b else None, None


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


# Paths of the input signatures seen so far; not kept while the triton_on_cpu() testing switch
# is on (its path depends on the environment, and speed does not matter there).
_PATHS: dict = {}
_MAX_PATHS = 4096


def fused_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    is_rms: bool,
    memory_efficient: bool,
    out_dtype: torch.dtype,
    check: Optional[str] = None,
    output_like_weight: bool = False,
) -> Tensor:
    """Normalize ``x`` over its trailing ``normalized_shape``.

    With ``check`` (the caller's name for messages), the arguments are validated whenever
    their signature (shapes, strides, dtypes, devices, eps) has not been seen before; without
    it the caller has validated them. ``output_like_weight``: ``out_dtype`` is the weight's
    dtype (the Mixed norms), else the input's; only ``torch.jit.trace`` needs to know which
    (see :func:`_jit_traced_norm`).
    """
    if is_rms:
        bias = None
    if _launch.in_functorch_or_forward_ad():
        # torch.func transforms and forward-mode AD: PyTorch's differentiable math.
        if check is not None:
            _checks.check_inputs(check, x, tuple(normalized_shape), weight, bias, eps)
        return _reference_norm(x, normalized_shape, weight, bias, eps, is_rms, out_dtype)
    if torch.jit.is_tracing() or _launch.is_exporting():
        # torch.jit.trace and torch.export: PyTorch's own ops, so that the trace or exported
        # program loads and runs where mixprec is not installed (TorchScript serving, libtorch,
        # torch.export.load, backends that know PyTorch's ops only), as Apex's modules traced.
        # (No argument checks: on traced shapes they would only add TracerWarnings; PyTorch's
        # ops check.)
        return _jit_traced_norm(x, normalized_shape, weight, bias, eps, is_rms,
                                output_like_weight)
    if not isinstance(x, Tensor) or (_HAS_CUSTOM_OP and _launch.is_compiling()):
        if check is not None:
            _checks.check_inputs(check, x, tuple(normalized_shape), weight, bias, eps)
        return _traced_norm(x, normalized_shape, weight, bias, eps, is_rms, memory_efficient,
                            out_dtype)
    key = (
        x.shape, x.stride(), x.dtype, x.device,
        None if weight is None else (weight.shape, weight.dtype, weight.device,
                                     weight.is_contiguous()),
        None if bias is None else (bias.shape, bias.dtype, bias.device, bias.is_contiguous()),
        tuple(normalized_shape), eps, is_rms, memory_efficient, out_dtype, _triton_on_cpu,
    )
    path = _PATHS.get(key)
    if path is None:
        if check is not None:
            _checks.check_inputs(check, x, tuple(normalized_shape), weight, bias, eps)
        n = math.prod(normalized_shape)
        if n == 0:  # nothing to normalize (a zero in normalized_shape)
            return _reference_norm(x, normalized_shape, weight, bias, eps, is_rms, out_dtype)
        path = _make_path(x, weight, bias, n, eps, is_rms, memory_efficient, out_dtype)
        if not _triton_on_cpu:
            if len(_PATHS) >= _MAX_PATHS:
                _PATHS.clear()
            _PATHS[key] = path
    if torch.is_grad_enabled() and (
        x.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    ):
        if path.returns_rstd:
            return _FromOutputNormFunction.apply(x, weight, bias, path)[0]
        if path.copies_rows:  # (see _GenericPath)
            rows = _rows(x, path.n)
            return fused_norm(rows, (path.n,), weight, bias, eps, is_rms, memory_efficient,
                              out_dtype).view(x.shape)
        return _FusedNormFunction.apply(x, weight, bias, path)
    return path.forward(x, weight, bias)[0]


def _reference_norm(x, normalized_shape, weight, bias, eps, is_rms, out_dtype) -> Tensor:
    """The plain-PyTorch reference's result (differentiable by every autograd mode): for a
    zero in ``normalized_shape`` (an empty result), and under torch.func / forward-mode AD."""
    if is_rms:
        return reference.rms_norm(x, list(normalized_shape), weight, eps, out_dtype)
    return reference.layer_norm(x, list(normalized_shape), weight, bias, eps, out_dtype)


def _jit_traced_norm(x, normalized_shape, weight, bias, eps, is_rms, output_like_weight):
    """Under ``torch.jit.trace``: PyTorch's own norm op, with every dtype taken from the
    tensors when the trace runs. A trace records ``.to(dtype)`` with the dtype of the tracing
    inputs, so the reference's casts fixed the output dtype: a model traced in fp32 and served
    with ``.bfloat16()`` gave fp32 out of its norms, and its next layer failed. ``type_as`` is
    recorded as an op on its argument. The computation is in the parameters' dtype (fp32 for
    the Mixed norms and for fp32 parameters, as eagerly), the result in the input's, or in
    the weight's with ``output_like_weight``."""
    shape = list(normalized_shape)
    param = weight if weight is not None else bias
    if param is None:
        return (F.rms_norm(x, shape, None, eps) if is_rms
                else F.layer_norm(x, shape, None, None, eps))
    # (A tensor of x's dtype that is not x: type_as returns x itself where the dtypes agree,
    # and the trace would then take the cast input for x.)
    like = None if output_like_weight else x.new_empty(())
    xp = x.type_as(param)
    y = F.rms_norm(xp, shape, weight, eps) if is_rms else F.layer_norm(xp, shape, weight, bias,
                                                                        eps)
    return y if like is None else y.type_as(like)


def _traced_norm(x, normalized_shape, weight, bias, eps, is_rms, memory_efficient,
                 out_dtype) -> Tensor:
    """Under ``torch.compile``: one opaque custom op for Dynamo and AOTAutograd."""
    n = math.prod(normalized_shape)
    if n == 0:
        return _reference_norm(x, normalized_shape, weight, bias, eps, is_rms, out_dtype)
    y2d = torch.ops.mixprec.fused_norm_fwd(
        _rows(x, n), _flat(weight), _flat(bias), eps, is_rms, memory_efficient, out_dtype
    )[0]
    return y2d.view(x.shape)
