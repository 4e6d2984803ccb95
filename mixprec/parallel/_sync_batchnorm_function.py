"""The autograd function behind :class:`~mixprec.parallel.SyncBatchNorm`.

Numerics (every path): statistics and parameters in fp32 (fp64 for fp64 input), one cast of the
output to the input's dtype.

Forward, per layer, ONE collective: every rank packs ``[mean (C), invstd or var (C), count]``
into one tensor and all-gathers it; the ranks' statistics are then merged count-weighted (Chan's
parallel-variance formula), so per-rank batch sizes may differ::

    N    = sum_r n_r
    mean = sum_r n_r * mean_r / N
    var  = sum_r n_r * (var_r + (mean_r - mean)^2) / N          (biased; running_var is unbiased)

Backward, ONE collective: the all-reduce of ``[sum(dy), sum(dy * (x - mean))]`` (2C values), after
which each rank computes its slice of the input gradient::

    dx = (dy - sum_dy / N - (x - mean) * invstd^2 * sum_dy_xmu / N) * invstd * weight

Weight and bias gradients stay local (``sum_dy_xmu * invstd`` and ``sum_dy``): the data-parallel
wrapper averages them like any other parameter gradient.

Three implementations of the same maths:

* Dense channels-last input on CUDA (a ``channels_last`` tensor, a contiguous one with
  ``channel_last=True``, a contiguous ``(N, C)`` or ``(N, C, 1, ...)`` one) in fp32/fp16/bf16
  with more than one row on this rank, when Triton imports: mixprec's Triton kernels
  (``_syncbn_triton``), on the tensors themselves. This rank's ``[mean, invstd, count]`` row is
  written straight into the tensor the all-gather sends; the merge of the ranks' rows is fused
  into the normalization, which writes the global row the backward reads; the backward's
  reduction writes the tensor the all-reduce sends. PyTorch's channels-last kernels were the
  slow part of a SyncBatchNorm step on an H200. Each layer keeps, per input signature, the
  decision and the launch plan (``cache``), so a step's host work per layer is a four-argument
  autograd node, six launches, five to eight allocations and two collectives; parameters and
  running statistics are read in their own dtypes (no casts).
* Other CUDA inputs: PyTorch's fused kernels (``torch.batch_norm_stats``,
  ``batch_norm_gather_stats_with_counts``, ``batch_norm_elemt``, ``batch_norm_backward_reduce``,
  ``batch_norm_backward_elemt``), which read half input with fp32 parameters and have
  channels-last variants. Channels-last inputs are handed to them as a ``(M, C)`` view (no
  copy); the output is written into a tensor with the input's strides.
* Everything else (CPU over gloo): the same formulas in plain fp32 PyTorch, merged in fp64.

Nothing synchronises the host with the device (``torch.nn.SyncBatchNorm`` does, once per layer,
to drop empty ranks), so a rank with an empty batch sends a negligible count (``_EMPTY_COUNT``)
instead, which the merges weigh as nothing. An empty rank, or one with a single row (the whole
group's batch may then hold a single value, an error), takes PyTorch's kernels, whose rows and
sums have the Triton path's format, so ranks may take different paths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, Optional, Tuple

import torch

from mixprec.normalization._launch import (
    first_derivatives_only,
    interpreter_enabled,
    is_compiling,
    outside_the_compiler,
)
from mixprec.parallel import _syncbn_triton
from mixprec.parallel._comm import all_gather_rows, all_reduce_sum

__all__ = ["sync_batch_norm"]

# The process group of a one-process batch norm: the gather is the rank's own row and the
# all-reduce nothing (``FusedBatchNorm``'s backward uses it with ``_reference_backward`` for
# inputs a saved-tensor hook handed back in another layout).
LOCAL = object()


def _gather_rows(row: torch.Tensor, group, world_size: int) -> torch.Tensor:
    if group is LOCAL:
        return row.view(1, -1)
    return all_gather_rows(row, group, world_size)


def _reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    return t if group is LOCAL else all_reduce_sum(t, group)


# Count sent by a rank whose batch is empty. The merge kernel divides by (n + count), so an
# exact 0 at the first rank gives 0 * inf = NaN; 1e-30 weighs as nothing against any real count
# in fp32 (and truncates to 0 where the kernel keeps an integer running count).
_EMPTY_COUNT = 1e-30


# Who raises a second derivative's error, and what to do: a gradient penalty (R1, WGAN-GP)
# differentiates twice through a GAN's discriminator, where convert_syncbn_model put this.
_FIRST_ONLY = (
    "SyncBatchNorm (a gradient penalty such as R1 or WGAN-GP differentiates twice through "
    "it: keep torch.nn.BatchNorm*d in that model, e.g. convert only the generator with "
    "convert_syncbn_model, or use a norm without batch statistics there)"
)


@dataclasses.dataclass
class _FusedOps:
    """The fused batch-norm kernels the CUDA path calls (swappable for tests)."""

    stats: Callable = torch.batch_norm_stats
    gather_stats: Callable = torch.batch_norm_gather_stats_with_counts
    elemt: Callable = torch.batch_norm_elemt
    backward_reduce: Callable = torch.batch_norm_backward_reduce
    backward_elemt: Callable = torch.batch_norm_backward_elemt
    # Dense channels-last inputs: every pass in mixprec's Triton kernels (``_syncbn_triton``)
    # instead of the five above. (Also FusedBatchNorm's switch: it follows the same rule.)
    triton_channels_last: bool = True


_OPS = _FusedOps()


def _use_fused(x: torch.Tensor) -> bool:
    """Whether ``x`` goes through the fused kernels (they exist for CUDA only)."""
    return x.is_cuda


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_dtype(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` in ``dtype`` and contiguous (PyTorch's channels-last batch-norm kernels read a
    strided weight as if it were contiguous: wrong input gradients on CUDA)."""
    return t if t is None else t.to(dtype).contiguous()


class _Layout:
    """How an input is laid out, and how the fused kernels are given it.

    ``flat``: channels are the innermost dimension in memory (``torch.channels_last`` /
    ``channels_last_3d`` strides, or Apex's ``channel_last=True`` with shape ``(N, ..., C)``).
    The kernels then get a ``(M, C)`` view, which their channels-last variants read without a
    copy. Otherwise the kernels get the ``(N, C, *)`` tensor, made contiguous.
    """

    strides: Optional[Tuple[int, ...]] = None  # (None in layouts pickled before it existed)

    def __init__(self, x: torch.Tensor, channel_last: bool):
        self.shape, self.strides = x.shape, x.stride()
        self.channel_dim = x.dim() - 1 if channel_last else 1
        self.perm: Optional[Tuple[int, ...]] = None
        self.flat = bool(channel_last)
        if not channel_last and x.dim() >= 3 and not x.is_contiguous():
            perm = (0, *range(2, x.dim()), 1)
            if x.permute(perm).is_contiguous():
                self.flat, self.perm = True, perm
        # ``dense``: x's memory IS the (M, C) array with row stride C (channels-last dense, or
        # contiguous with ``channel_last``), so kernels can take x itself, no view needed.
        self.dense = self.flat and (self.perm is not None or x.is_contiguous())
        c = self.shape[self.channel_dim] if x.dim() else 0
        self.rows = x.numel() // c if c else 0

    @property
    def num_channels(self) -> int:
        return self.shape[self.channel_dim]

    def to_kernel(self, t: torch.Tensor) -> torch.Tensor:
        if not self.flat:
            return t.contiguous()
        if self.perm is not None:
            t = t.permute(self.perm)
        return t.reshape(-1, self.num_channels)

    def new_output(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """An output tensor with ``x``'s layout, and the ``(M, C)`` view the kernel writes."""
        # The output must not be a view (autograd forbids in-place ops, such as a following
        # ReLU(inplace=True), on views returned by a custom Function), so allocate it with x's
        # strides and hand the kernel a view of it. ``flat`` with a permutation is only chosen
        # for dense x, so empty_like keeps x's strides exactly.
        if self.perm is not None:
            out = torch.empty_like(x, memory_format=torch.preserve_format)
            return out, out.permute(self.perm).reshape(-1, self.num_channels)
        out = torch.empty(self.shape, dtype=x.dtype, device=x.device)
        return out, out.view(-1, self.num_channels)

    def from_kernel(self, t: torch.Tensor) -> torch.Tensor:
        """Back from the kernel layout to ``x``'s (a view for ``flat``)."""
        if not self.flat:
            return t
        if self.perm is None:
            return t.view(self.shape)
        permuted = [self.shape[p] for p in self.perm]
        inverse = [0] * len(self.perm)
        for i, p in enumerate(self.perm):
            inverse[p] = i
        return t.view(permuted).permute(inverse)

    def reduce_dims(self, ndim: int) -> Tuple[int, ...]:
        return tuple(d for d in range(ndim) if d != self.channel_dim)

    def channel_view_shape(self, ndim: int) -> Tuple[int, ...]:
        shape = [1] * ndim
        shape[self.channel_dim] = self.num_channels
        return tuple(shape)


def _layout_of(x: torch.Tensor, channel_last: bool, cache: Optional[Dict]) -> _Layout:
    # A layer sees the same shapes step after step: keep its _Layout per geometry instead of
    # working it out on every call.
    if cache is None:
        return _Layout(x, channel_last)
    key = ("layout", x.shape, x.stride(), channel_last)
    layout = cache.get(key)
    if layout is None or layout.strides is None:
        layout = _Layout(x, channel_last)
        _cache_put(cache, key, layout)
    return layout


# The cache's one entry for the (channels, statistics dtype) pairs the ranks agreed on.
_AGREED = ("agreed",)


def _cache_put(cache: Dict, key, value) -> None:
    if len(cache) >= 16:  # a layer fed ever-changing shapes: start over
        # (Keeping what the ranks agreed on: when to clear depends on the shapes this rank
        # saw, so a re-check after it would be one rank's collective alone. One entry, so a
        # parameter-free layer fed many channel counts does not fill the cache with them.)
        agreed = cache.get(_AGREED)
        cache.clear()
        if agreed is not None:
            cache[_AGREED] = agreed
    cache[key] = value


def _check_ranks_agree(x: torch.Tensor, channel_last: bool, group, world_size: int,
                       cache: Optional[Dict]) -> None:
    """Raise on every rank when the ranks' inputs to one layer differ in their number of
    channels or statistics dtype: the gather of per-channel statistics would then exchange
    rows of different sizes, which gloo answers by aborting the process (and NCCL with
    undefined results), neither naming the layer.

    One all-gather of two integers per layer, the first time it sees a (channels, dtype)
    pair; every rank sees the same pairs in the same order when they agree, so the check's
    collectives line up.
    """
    if cache is None or group is LOCAL:
        return
    channels = x.shape[-1] if channel_last else x.shape[1]
    stat_dtype = _stat_dtype(x.dtype)
    agreed = cache.get(_AGREED)
    if agreed is not None and (channels, stat_dtype) in agreed:
        return
    mine = torch.tensor([channels, 8 * stat_dtype.itemsize], dtype=torch.int64,
                        device=x.device)
    rows = all_gather_rows(mine, group, world_size).tolist()
    if any(row != rows[0] for row in rows):
        seen = ", ".join(f"group rank {r}: {c} channels, float{bits} statistics"
                         for r, (c, bits) in enumerate(rows))
        raise ValueError(
            f"SyncBatchNorm: the ranks of its process group gave one layer different inputs "
            f"({seen}); the statistics it all-gathers must have one size and dtype on every "
            "rank. Build the same model on every rank, in the same dtype (not .double() on "
            "some ranks only), and feed every rank inputs with the same channels and dtype.")
    if agreed is None:
        agreed = cache[_AGREED] = set()
    agreed.add((channels, stat_dtype))


def _count_tensor(cache: Optional[Dict], count: float, like: torch.Tensor) -> torch.Tensor:
    # A one-element tensor holding this rank's count, kept per (value, device, dtype) so that
    # a steady batch size costs no fill kernel per layer per step.
    key = ("count", count, like.device, like.dtype)
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    t = torch.full((1,), count, dtype=like.dtype, device=like.device)
    if cache is not None:
        _cache_put(cache, key, t)
    return t


# ---------------------------------------------------------------------------------------------
# CUDA: fused kernels
# ---------------------------------------------------------------------------------------------
def _fused_forward(x, layout, weight, bias, running_mean, running_var, eps, momentum, group,
                   world_size, stat_dtype, cache):
    C = layout.num_channels
    xk = layout.to_kernel(x)
    count = layout.rows
    if count > 0:
        mean, invstd = _OPS.stats(xk, eps)
        count_t = _count_tensor(cache, float(count), mean)
    else:
        mean = torch.zeros(C, dtype=stat_dtype, device=x.device)
        invstd = torch.ones(C, dtype=stat_dtype, device=x.device)
        count_t = _count_tensor(cache, _EMPTY_COUNT, mean)
    rows = _gather_rows(torch.cat([mean, invstd, count_t]), group, world_size)
    counts = rows[:, 2 * C]  # every rank's row count (a strided view)

    # The merge kernel reads the counts in the running statistics' dtype (the input's when there
    # are none): give it fp32 running statistics so large counts stay exact.
    rm, rv = running_mean, running_var
    if rm is None:
        rm = torch.zeros(C, dtype=stat_dtype, device=x.device)
        rv = torch.ones(C, dtype=stat_dtype, device=x.device)
    elif rm.dtype != stat_dtype or not (rm.is_contiguous() and rv.is_contiguous()):
        rm, rv = _as_dtype(rm, stat_dtype), _as_dtype(rv, stat_dtype)
    mean, invstd = _OPS.gather_stats(xk, rows[:, :C], rows[:, C:2 * C], rm, rv, momentum, eps,
                                     counts)
    if running_mean is not None and (rm is not running_mean or rv is not running_var):
        running_mean.copy_(rm)
        running_var.copy_(rv)

    if layout.flat:
        out, out_k = layout.new_output(x)
        if count > 0:
            _OPS.elemt(xk, weight, bias, mean, invstd, eps, out=out_k)
    elif count > 0:
        out = _OPS.elemt(xk, weight, bias, mean, invstd, eps)
    else:
        out = torch.empty_like(x)
    return out, mean, invstd, counts


def _fused_backward(grad_out, x, layout, weight, mean, invstd, counts, group, needs):
    need_input, need_weight, need_bias = needs
    C = layout.num_channels
    xk = layout.to_kernel(x)
    gk = layout.to_kernel(grad_out)
    if xk.numel() > 0:
        sum_dy, sum_dy_xmu, grad_weight, grad_bias = _OPS.backward_reduce(
            gk, xk, mean, invstd, weight, need_input, need_weight, need_bias
        )
    else:
        zeros = torch.zeros(C, dtype=mean.dtype, device=mean.device)
        sum_dy, sum_dy_xmu, grad_weight, grad_bias = zeros, zeros, zeros, zeros
    grad_input = None
    if need_input:
        # The one collective of the backward pass: both per-channel sums in one tensor.
        packed = torch.cat([sum_dy, sum_dy_xmu]).to(mean.dtype)
        _reduce_sum(packed, group)
        if xk.numel() > 0:
            # PyTorch's kernel takes int32 counts (an empty rank's tiny count truncates to 0).
            gk_in = _OPS.backward_elemt(gk, xk, mean, invstd, weight, packed[:C], packed[C:],
                                        counts.to(torch.int32))
            grad_input = layout.from_kernel(gk_in)
        else:
            grad_input = torch.zeros_like(x)
    return grad_input, grad_weight, grad_bias


# ---------------------------------------------------------------------------------------------
# Everything else: plain PyTorch
# ---------------------------------------------------------------------------------------------
def _reference_forward(x, layout, weight, bias, running_mean, running_var, eps, momentum, group,
                       world_size, stat_dtype):
    C = layout.num_channels
    dims = layout.reduce_dims(x.dim())
    cshape = layout.channel_view_shape(x.dim())
    xs = x.to(stat_dtype)
    count = x.numel() // C if C else 0
    if count > 0:
        var, mean = torch.var_mean(xs, dim=dims, correction=0)
    else:
        var = mean = torch.zeros(C, dtype=stat_dtype, device=x.device)
    count_t = torch.full((1,), float(count), dtype=stat_dtype, device=x.device)
    rows = _gather_rows(torch.cat([mean, var, count_t]), group, world_size)
    # Merge in fp64 where that is cheap (these are (world_size, 2C + 1) tensors).
    merge = torch.float64 if rows.device.type == "cpu" else stat_dtype
    rows = rows.to(merge)
    n = rows[:, 2 * C:]
    total = n.sum()
    g_mean = (n * rows[:, :C]).sum(0) / total
    g_var = (n * (rows[:, C:2 * C] + (rows[:, :C] - g_mean) ** 2)).sum(0) / total
    if running_mean is not None:
        with torch.no_grad():
            unbiased = g_var * (total / (total - 1))
            running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    mean = g_mean.to(stat_dtype)
    invstd = torch.rsqrt(g_var + eps).to(stat_dtype)
    scale = invstd if weight is None else invstd * weight
    y = (xs - mean.view(cshape)) * scale.view(cshape)
    if bias is not None:
        y = y + bias.view(cshape)
    return y.to(x.dtype), mean, invstd, total.to(stat_dtype)


def _reference_backward(grad_out, x, layout, weight, mean, invstd, total, group, needs):
    need_input, need_weight, need_bias = needs
    stat_dtype = mean.dtype
    dims = layout.reduce_dims(x.dim())
    cshape = layout.channel_view_shape(x.dim())
    gs = grad_out.to(stat_dtype)
    xmu = x.to(stat_dtype) - mean.view(cshape)
    sum_dy = gs.sum(dims)
    sum_dy_xmu = (gs * xmu).sum(dims)
    grad_weight = None
    if need_weight:
        # An empty batch adds nothing to the weight's gradient (zeros, as BatchNorm and the
        # fused path give): not 0 * invstd, which is NaN when the whole group's batch is empty
        # (its variance 0 / 0).
        grad_weight = (sum_dy_xmu * invstd if x.numel() > 0
                       else torch.zeros_like(sum_dy_xmu))
    grad_bias = sum_dy if need_bias else None
    grad_input = None
    if need_input:
        packed = torch.cat([sum_dy, sum_dy_xmu])
        _reduce_sum(packed, group)
        C = layout.num_channels
        g_sum_dy, g_sum_dy_xmu = packed[:C], packed[C:]
        scale = invstd if weight is None else invstd * weight
        grad_input = (
            gs - (g_sum_dy / total).view(cshape)
            - xmu * (invstd * invstd * g_sum_dy_xmu / total).view(cshape)
        ) * scale.view(cshape)
        grad_input = grad_input.to(grad_out.dtype)
    return grad_input, grad_weight, grad_bias


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group,
                world_size, channel_last, cache):
        layout = _layout_of(x, channel_last, cache)
        stat_dtype = _stat_dtype(x.dtype)
        # Parameters in the statistics' dtype: fp32 weights with half input is what the fused
        # kernels' mixed-type variants read; half weights (O3) are upcast here, once.
        w = _as_dtype(weight, stat_dtype)
        b = _as_dtype(bias, stat_dtype)
        # Only when this rank holds at most one value per channel can the whole group's batch
        # hold a single one (then every rank takes this branch): the running statistics are
        # kept aside, and the global count read on the host (a sync only on this rare path).
        single = layout.rows <= 1
        kept = (None if not single or running_mean is None
                else (running_mean.clone(), running_var.clone()))
        if _use_fused(x):
            out, mean, invstd, counts = _fused_forward(
                x, layout, w, b, running_mean, running_var, eps, momentum, group, world_size,
                stat_dtype, cache,
            )
        else:
            out, mean, invstd, counts = _reference_forward(
                x, layout, w, b, running_mean, running_var, eps, momentum, group, world_size,
                stat_dtype,
            )
        if single:
            total = float(counts.sum())  # (an empty rank counts a tiny value: _EMPTY_COUNT)
            if total < 1.5 and kept is not None:
                running_mean.copy_(kept[0])
                running_var.copy_(kept[1])
            if 0.5 <= total < 1.5:  # (no values at all: an empty output, as BatchNorm gives)
                raise ValueError(
                    "SyncBatchNorm: expected more than 1 value per channel when training, got "
                    f"{round(total)} over the whole process group (every rank's batch "
                    f"together; this rank's input has shape {tuple(x.shape)}). A variance "
                    "needs two values: use larger batches, or eval mode for this layer."
                )
        ctx.save_for_backward(x, weight, mean, invstd, counts)
        ctx.param_dtypes = (None if weight is None else weight.dtype,
                            None if bias is None else bias.dtype)
        ctx.layout = layout
        ctx.channel_last = channel_last
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # (create_graph=True: no second derivative, an error if one is asked for.)
        return first_derivatives_only(_backward, ctx, grad_out, _FIRST_ONLY)


def _backward(ctx, grad_out):
    x, weight, mean, invstd, counts = ctx.saved_tensors
    layout = ctx.layout
    if x.stride() != layout.strides:
        # A saved-tensor hook (activation offloading) handed back a copy laid out
        # otherwise: the kernels must read it as it is.
        layout = _Layout(x, ctx.channel_last)
    grads = _pytorch_backward(grad_out, x, layout, weight, mean, invstd, counts, ctx.group,
                              ctx.needs_input_grad, ctx.param_dtypes)
    return (*grads, None, None, None, None, None, None, None, None)


def _pytorch_backward(grad_out, x, layout, weight, mean, invstd, counts, group,
                      needs_input_grad, param_dtypes):
    """``(grad_input, grad_weight, grad_bias)`` by PyTorch's fused kernels (CUDA) or plain
    PyTorch (CPU), the gradients in the parameters' dtypes at the forward (``param_dtypes``:
    a saved-tensor hook may hand back the weight in another dtype; the gradients are computed
    in the statistics' dtype all the same and only then cast)."""
    needs = (
        needs_input_grad[0],
        weight is not None and needs_input_grad[1],
        needs_input_grad[2],
    )
    w = _as_dtype(weight, mean.dtype)
    if _use_fused(x):
        grad_input, grad_weight, grad_bias = _fused_backward(
            grad_out, x, layout, w, mean, invstd, counts, group, needs
        )
    else:
        grad_input, grad_weight, grad_bias = _reference_backward(
            grad_out, x, layout, w, mean, invstd, counts, group, needs
        )
    weight_dtype, bias_dtype = param_dtypes
    if not needs[1]:
        grad_weight = None
    elif grad_weight is not None and grad_weight.dtype != weight_dtype:
        grad_weight = grad_weight.to(weight_dtype)
    if not needs[2]:
        grad_bias = None
    elif grad_bias is not None and bias_dtype is not None and grad_bias.dtype != bias_dtype:
        grad_bias = grad_bias.to(bias_dtype)
    return grad_input, grad_weight, grad_bias


# ---------------------------------------------------------------------------------------------
# Dense channels-last input: mixprec's Triton kernels
# ---------------------------------------------------------------------------------------------
_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _triton_plan(x, weight, bias, running_mean, running_var, channel_last):
    """The Triton kernels' :class:`~mixprec.parallel._syncbn_triton.Plan` when they take this
    call as it is, else None (PyTorch's kernels or plain PyTorch then).

    They take dense channels-last ``x`` (its memory the ``(M, C)`` array: a ``channels_last``
    tensor, a contiguous one with ``channel_last``, and contiguous ``(N, C)`` or
    ``(N, C, 1, ...)`` tensors) in a dtype they read, with more than one row (an empty rank,
    or a single row that may make the whole group's batch a single value, takes the general
    path, which handles both), and parameters and running statistics that are 1-D,
    contiguous, ``C`` long and on ``x``'s device.
    """
    if not (_OPS.triton_channels_last and _use_fused(x) and _syncbn_triton.usable_dtype(x)):
        return None
    if (running_mean is None) != (running_var is None):
        return None
    layout = _Layout(x, channel_last)
    dense = layout.dense or (not channel_last and x.is_contiguous()
                             and math.prod(x.shape[2:]) == 1)
    if not dense or layout.rows <= 1:
        return None
    c = layout.num_channels
    for t in (weight, bias, running_mean, running_var):
        if t is not None and (t.dtype not in _PARAM_DTYPES or t.device != x.device
                              or t.dim() != 1 or t.numel() != c or not t.is_contiguous()):
            return None
    return _syncbn_triton.plan_for(
        layout.rows, c, x.device, x.dtype, None if weight is None else weight.dtype,
        None if bias is None else bias.dtype,
        None if running_mean is None else (running_mean.dtype, running_var.dtype))


def _signature(t: Optional[torch.Tensor]) -> Optional[tuple]:
    return None if t is None else (t.dtype, t.device, t.shape, t.stride())


def _cached_triton_plan(x, weight, bias, running_mean, running_var, channel_last, cache):
    """:func:`_triton_plan`, decided once per call signature and kept in ``cache``."""
    if cache is None:
        return _triton_plan(x, weight, bias, running_mean, running_var, channel_last)
    # Everything the decision depends on: the tensors' dtypes, devices and geometry (a
    # parameter replaced by a strided or resized one must not reuse the plan), and the
    # routing switches the tests flip.
    key = ("plan", x.shape, x.stride(), x.dtype, x.device, _signature(weight),
           _signature(bias), _signature(running_mean), _signature(running_var), channel_last,
           _OPS.triton_channels_last, _use_fused)
    if not x.is_cuda:
        key += (_syncbn_triton._cpu_testing, interpreter_enabled())
    plan = cache.get(key)
    if plan is None:
        plan = _triton_plan(x, weight, bias, running_mean, running_var, channel_last) or False
        _cache_put(cache, key, plan)
    return plan or None


class _TritonSyncBatchNorm(torch.autograd.Function):
    """The Triton path's autograd node: saves the input, the weight and the global statistics
    row. (What autograd needs not look at travels as one argument: each argument of a Python
    Function costs host time.)"""

    @staticmethod
    def forward(ctx, x, weight, bias, rest):
        running_mean, running_var, momentum, eps, group, world_size, channel_last, plan = rest
        rows = _gather_rows(plan.stats(x, eps), group, world_size)  # the forward's collective
        out, row = plan.normalize(x, rows, weight, bias, running_mean, running_var, momentum,
                                  eps)
        ctx.save_for_backward(x, weight, row)
        ctx.plan, ctx.group, ctx.channel_last, ctx.x_strides = plan, group, channel_last, \
            x.stride()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # (create_graph=True: no second derivative, an error if one is asked for.)
        return first_derivatives_only(_triton_backward, ctx, grad_out, _FIRST_ONLY)


def _triton_backward(ctx, grad_out):
    x, weight, row = ctx.saved_tensors
    plan = ctx.plan
    if not plan.reads_saved(x, ctx.x_strides, weight, row):
        # A saved-tensor hook (activation offloading, compression) handed back copies laid
        # out or typed otherwise: PyTorch's kernels (or plain PyTorch) on what came back.
        c = plan.c
        # (the row or the weight may come back on another device, e.g. offloaded to CPU)
        row = row.to(device=x.device, dtype=torch.float32)
        weight = None if weight is None else weight.to(x.device)
        grads = _pytorch_backward(grad_out, x, _Layout(x, ctx.channel_last), weight, row[:c],
                                  row[c:2 * c], row[2 * c:], ctx.group, ctx.needs_input_grad,
                                  (plan.w_dtype, plan.b_dtype))
        return (*grads, None)
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    if grad_out.dtype is not x.dtype or grad_out.stride() != x.stride():
        grad_out = torch.empty_like(x).copy_(grad_out)  # (x's dense channels-last memory)
    sums, grad_weight, grad_bias = plan.grad_sums(grad_out, x, row,
                                                  need_weight and weight is not None, need_bias)
    grad_input = None
    if need_input:
        _reduce_sum(sums, ctx.group)  # the one collective of the backward pass
        grad_input = plan.grad_input(grad_out, x, row, weight, sums)
    return grad_input, grad_weight, grad_bias, None


def sync_batch_norm(x, weight, bias, running_mean, running_var, eps: float, momentum: float,
                    group, world_size: int, channel_last: bool = False,
                    cache: Optional[Dict] = None) -> torch.Tensor:
    """Batch normalization of ``x`` with statistics over every rank of ``group`` (training).

    Args:
        x (Tensor): ``(N, C, *)`` (any strides), or ``(N, *, C)`` with ``channel_last``.
        weight, bias (Tensor, optional): per-channel affine parameters.
        running_mean, running_var (Tensor, optional): updated in place with ``momentum`` (the
            running variance with the unbiased global variance).
        eps (float): added to the variance.
        momentum (float): running-average factor.
        group: the process group (None: the default group; ``LOCAL``: this process alone,
            no collectives).
        world_size (int): its size.
        channel_last (bool): channels are ``x``'s last dimension. Default False.
        cache (dict, optional): per-module scratch: per input signature, the Triton kernels'
            plan (or that they do not take it), the layout of each input geometry, the count
            tensor of PyTorch's kernels' path.

    Returns:
        Tensor: normalized ``x``, same shape, dtype and layout.
    """
    if is_compiling():
        return _outside_the_compiler()(x, weight, bias, running_mean, running_var, eps,
                                       momentum, group, world_size, channel_last, cache)
    return _sync_batch_norm(x, weight, bias, running_mean, running_var, eps, momentum, group,
                            world_size, channel_last, cache)


def _sync_batch_norm(x, weight, bias, running_mean, running_var, eps, momentum, group,
                     world_size, channel_last, cache):
    _check_ranks_agree(x, channel_last, group, world_size, cache)
    plan = _cached_triton_plan(x, weight, bias, running_mean, running_var, channel_last, cache)
    if plan is not None:
        return _TritonSyncBatchNorm.apply(x, weight, bias, (
            running_mean, running_var, float(momentum), float(eps), group, world_size,
            channel_last, plan))
    return _SyncBatchNormFunction.apply(x, weight, bias, running_mean, running_var, eps,
                                        momentum, group, world_size, channel_last, cache)


def _outside_the_compiler():
    """``_sync_batch_norm`` behind ``torch.compiler.disable`` (see
    :func:`mixprec.normalization._launch.outside_the_compiler`).

    Under ``torch.compile`` each SyncBatchNorm layer is a graph break and runs as in eager mode
    (its Triton kernels included); the compiler takes the rest of the model. Letting Dynamo
    trace the layer instead went wrong on two of the PyTorch releases we test: on torch 2.11
    the compiled layer's input gradient came out zero, silently (H200 machine, CPU and CUDA
    alike), and torch 2.4 refuses to trace it (a mutation outside the traced function's
    scope).
    """
    return outside_the_compiler(_sync_batch_norm)
