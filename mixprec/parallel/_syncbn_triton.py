"""Host launchers for SyncBatchNorm's Triton kernels over a channels-last ``(M, C)`` view.

For channels-last inputs on CUDA, :class:`~mixprec.parallel.SyncBatchNorm` runs four Triton
passes per layer instead of PyTorch's ``batch_norm_stats`` / ``batch_norm_gather_stats_with_counts``
/ ``batch_norm_elemt`` / ``batch_norm_backward_reduce`` / ``batch_norm_backward_elemt``, whose
channels-last kernels move these tensors at a fraction of the memory bandwidth (on an H200 in a
ResNet-50 step they took about twice cuDNN's time for the same layers):

* :func:`stats_row`: this rank's statistics, written into the tensor the all-gather sends;
* :func:`forward_elemt`: the count-weighted merge of every rank's statistics (and the running
  statistics' update) fused into the normalization, one launch;
* :func:`backward_reduce`: ``sum(dy)`` and ``sum(dy * (x - mean))``, written into the tensor
  the all-reduce sends, and the local weight/bias gradients;
* :func:`backward_elemt`: the input gradient.

The reductions are two launches each (partial results per run of rows, then a merge in a fixed
order: no atomics, the same bits every run); the element-wise passes one each.
"""

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from mixprec.normalization._launch import (
    _cdiv,
    _on_device,
    _Site,
    _sm_resources,
    interpreter_enabled,
    site_variant,
    triton_available,
    triton_next_power_of_2,
)

__all__ = ["LocalPlan", "Plan", "backward_elemt", "backward_reduce", "forward_elemt",
           "local_plan", "plan_for", "stats_row", "usable", "usable_dtype"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE = 4096  # elements of x per [BLOCK_M, BLOCK_C] tile (32 per thread at 4 warps)
_PROGRAMS_PER_SM = 4  # partial programs; more splits would make the merge the slow part
_ELEMT_PROGRAMS_PER_SM = 8  # element-wise passes: no merge, so more programs in flight
_NUM_WARPS = 4
# The merges: [BLOCK_S, BLOCK_C] tiles of partial results, narrow in C so that a layer with few
# channels still gets a few programs.
_MERGE_BLOCK_C = 32
_MERGE_BLOCK_S = 256  # benchmarks/sweep_syncbn.py: 1.171-1.176x vs 1.186-1.188x at 128

# Testing hook: let CPU tensors through usable() (the kernels then run in Triton's interpreter,
# which needs TRITON_INTERPRET=1 before the kernels module is first imported).
_cpu_testing = False


_KERNELS = None


def _kernels():
    # Imported on first use (``import mixprec`` never needs Triton), then kept: an import
    # statement costs microseconds on every call.
    global _KERNELS
    if _KERNELS is None:
        from mixprec.parallel import _syncbn_kernels

        _KERNELS = _syncbn_kernels
    return _KERNELS


def usable_dtype(t: Tensor) -> bool:
    """Whether the kernels take ``t``'s dtype and device (CUDA with Triton importable; CPU
    only under the testing hook with the interpreter). Layout is the caller's to check."""
    if t.dtype not in _DTYPES:
        return False
    if t.is_cuda:
        return triton_available()
    return _cpu_testing and triton_available() and interpreter_enabled()


def usable(x2d: Tensor) -> bool:
    """Whether the Triton kernels take ``x2d``: a CUDA ``(M, C)`` view with unit column
    stride in fp32/fp16/bf16, with Triton importable."""
    if x2d.dim() != 2 or (x2d.shape[1] > 1 and x2d.stride(1) != 1):
        return False
    return usable_dtype(x2d)


def _split(m: int, c: int, target_programs: int) -> Tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_C, splits, rows_per_split)``: about ``target_programs`` programs over
    an ``(m, c)`` view, each a ``BLOCK_C``-wide slice of channels and a run of rows."""
    block_c = max(16, min(128, triton_next_power_of_2(c)))
    block_m = max(16, _TILE // block_c)
    c_blocks = _cdiv(c, block_c)
    splits = max(1, min(_cdiv(m, block_m), _cdiv(target_programs, c_blocks)))
    rows_per_split = _cdiv(_cdiv(m, splits), block_m) * block_m
    splits = _cdiv(m, rows_per_split)
    return block_m, block_c, splits, rows_per_split


class Plan:
    """Launch settings for one ``(M, C)`` geometry on one device, worked out once.

    Its methods launch the kernels on tensors whose memory holds that ``(M, C)`` array with
    unit column stride and the given row stride (a channels-last tensor itself, or a 2-D view):
    they check nothing, so callers hand them only what :func:`usable` accepts (the module-level
    functions below do the checks). Reductions use ``_PROGRAMS_PER_SM`` programs per SM,
    element-wise passes ``_ELEMT_PROGRAMS_PER_SM``. Each kernel (per set of constexprs) has a
    launch site that keeps its compiled kernels per variant of the arguments (the tensors'
    dtypes and the strides), so that a layer's launches skip the launcher's key.
    """

    __slots__ = ("m", "c", "device", "reduce", "elemt", "merge_grid", "_sites")

    def __init__(self, m: int, c: int, device: torch.device):
        self.m, self.c, self.device = m, c, device
        if device.type == "cuda":
            sms = _sm_resources(device.index)[0]
            reduce_target, elemt_target = _PROGRAMS_PER_SM * sms, _ELEMT_PROGRAMS_PER_SM * sms
        else:
            reduce_target = elemt_target = 4  # the interpreter: a few splits, so the tests
            #                                   cover the merges and the loops
        self.reduce = _split(m, c, reduce_target)
        self.elemt = _split(m, c, elemt_target)
        self.merge_grid = (_cdiv(c, _MERGE_BLOCK_C),)
        self._sites = {}

    def _site(self, name: str, flags: tuple, consts: dict) -> _Site:
        """The launch site of kernel ``name`` with these constexpr ``flags`` (``consts`` is
        read on the first call only)."""
        site = self._sites.get((name, flags))
        if site is None:
            site = self._sites[(name, flags)] = _Site(getattr(_kernels(), name), consts,
                                                      self.device)
        return site

    def stats_row(self, x: Tensor, stride_x: int, eps: float) -> Tensor:
        """``[mean (C), invstd (C), M]`` of ``x``, fp32 (see :func:`stats_row`)."""
        m, c, device = self.m, self.c, self.device
        block_m, block_c, splits, rows_per_split = self.reduce
        partial = torch.empty((splits, 3, c), dtype=torch.float32, device=device)
        row = torch.empty(2 * c + 1, dtype=torch.float32, device=device)
        with _on_device(x):
            self._site("bn_partial_stats_kernel", (), dict(
                BLOCK_M=block_m, BLOCK_C=block_c, num_warps=_NUM_WARPS,
            ))((_cdiv(c, block_c), splits), (x, partial, m, c, stride_x, rows_per_split),
               site_variant((x, partial), (stride_x,)))
            self._site("bn_finalize_stats_kernel", (), dict(
                BLOCK_S=_MERGE_BLOCK_S, BLOCK_C=_MERGE_BLOCK_C, num_warps=_NUM_WARPS,
            ))(self.merge_grid, (partial, row, splits, c, float(m), float(eps)),
               site_variant((partial, row)))
        return row

    def forward_elemt(self, x: Tensor, stride_x: int, out: Tensor, stride_out: int,
                      rows: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                      running_mean: Optional[Tensor], running_var: Optional[Tensor],
                      momentum: float, eps: float) -> Tuple[Tensor, Tensor]:
        """Merge ``rows`` and normalize ``x`` into ``out``; ``(mean, invstd)``."""
        m, c, device = self.m, self.c, self.device
        block_m, block_c, splits, rows_per_split = self.elemt
        mean = torch.empty(c, dtype=torch.float32, device=device)
        invstd = torch.empty(c, dtype=torch.float32, device=device)
        has_w, has_b, has_running = weight is not None, bias is not None, running_mean is not None
        tensors = (x, out, rows, weight if has_w else mean, bias if has_b else mean,
                   running_mean if has_running else mean, running_var if has_running else mean,
                   mean, invstd)
        with _on_device(x):
            self._site("bn_forward_elemt_kernel", (has_w, has_b, has_running), dict(
                HAS_W=has_w, HAS_B=has_b, HAS_RUNNING=has_running, ONE_ROW=False,
                BLOCK_M=block_m, BLOCK_C=block_c, num_warps=_NUM_WARPS,
            ))((_cdiv(c, block_c), splits),
               (*tensors, m, c, stride_x, stride_out, rows.shape[0], rows_per_split,
                float(momentum), float(eps)),
               site_variant(tensors, (stride_x, stride_out, rows.shape[0])))
        return mean, invstd

    def backward_reduce(self, dy: Tensor, stride_dy: int, x: Tensor, stride_x: int,
                        mean: Tensor, invstd: Tensor, need_weight: bool, need_bias: bool
                        ) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """``(sums, grad_weight, grad_bias)`` (see :func:`backward_reduce`)."""
        m, c, device = self.m, self.c, self.device
        block_m, block_c, splits, rows_per_split = self.reduce
        partial = torch.empty((splits, 2, c), dtype=torch.float32, device=device)
        sums = torch.empty(2 * c, dtype=torch.float32, device=device)
        grad_weight = torch.empty(c, dtype=torch.float32, device=device) if need_weight else None
        grad_bias = torch.empty(c, dtype=torch.float32, device=device) if need_bias else None
        with _on_device(x):
            tensors = (dy, x, mean, partial)
            self._site("bn_partial_backward_kernel", (), dict(
                BLOCK_M=block_m, BLOCK_C=block_c, num_warps=_NUM_WARPS,
            ))((_cdiv(c, block_c), splits),
               (*tensors, m, c, stride_dy, stride_x, rows_per_split),
               site_variant(tensors, (stride_dy, stride_x)))
            tensors = (partial, invstd, sums, grad_weight if need_weight else sums,
                       grad_bias if need_bias else sums)
            self._site("bn_finalize_backward_kernel", (need_weight, need_bias), dict(
                COMPUTE_DW=need_weight, COMPUTE_DB=need_bias, ONE_ROW=False,
                BLOCK_S=_MERGE_BLOCK_S,
                BLOCK_C=_MERGE_BLOCK_C, num_warps=_NUM_WARPS,
            ))(self.merge_grid, (*tensors, splits, c), site_variant(tensors))
        return sums, grad_weight, grad_bias

    def backward_elemt(self, dy: Tensor, stride_dy: int, x: Tensor, stride_x: int, out: Tensor,
                       stride_out: int, mean: Tensor, invstd: Tensor, weight: Optional[Tensor],
                       sums: Tensor, counts: Tensor) -> Tensor:
        """The input gradient into ``out`` (see :func:`backward_elemt`)."""
        m, c = self.m, self.c
        block_m, block_c, splits, rows_per_split = self.elemt
        has_w = weight is not None
        tensors = (dy, x, out, mean, invstd, weight if has_w else mean, sums, counts)
        extra = (stride_dy, stride_x, stride_out, counts.stride(0), counts.shape[0])
        with _on_device(x):
            self._site("bn_backward_elemt_kernel", (has_w,), dict(
                HAS_W=has_w, ONE_ROW=False, BLOCK_M=block_m, BLOCK_C=block_c,
                num_warps=_NUM_WARPS,
            ))((_cdiv(c, block_c), splits), (*tensors, m, c, *extra, rows_per_split),
               site_variant(tensors, extra))
        return out


class LocalPlan:
    """:class:`~mixprec.normalization.FusedBatchNorm`'s launches for one input signature: a
    dense channels-last ``(M, C)`` input of one dtype on one device, and parameters and running
    statistics of given dtypes (or none).

    One process, no collectives: the statistics row ``[mean, invstd, M]`` that SyncBatchNorm
    all-gathers is used as it is (the kernels' ``ONE_ROW``), and it is all the backward needs
    besides the input and the weight. What does not change from call to call (grids,
    constexprs, compiled kernels, scratch shapes, argument dtypes) is fixed here, so a call
    only allocates and launches: a forward three tensors (partials, row, output) and three
    kernels; a backward up to five tensors (partials, sums, the gradients, which come in the
    parameters' dtypes) and three kernels. Launches with an input, a parameter or a running
    statistic that is not 16-byte aligned take the checked launcher. The methods check
    nothing: tensors must have the signature's shapes, dtypes and dense channels-last memory.
    """

    __slots__ = ("m", "c", "device", "w_dtype", "b_dtype", "_stats_partial", "_grad_partial",
                 "_splits", "_reduce_rows", "_elemt_rows", "_reduce_grid", "_elemt_grid",
                 "_merge_grid", "_sites", "_grad_sites")

    def __init__(self, m: int, c: int, device: torch.device, x_dtype: torch.dtype,
                 w_dtype: Optional[torch.dtype], b_dtype: Optional[torch.dtype],
                 running_dtypes: Optional[Tuple[torch.dtype, torch.dtype]]):
        # (x_dtype and the running statistics' dtypes are not read here, but the compiled
        # kernels the sites keep are specialized on them: they are part of local_plan's key.)
        plan = plan_for(m, c, device)
        self.m, self.c, self.device = m, c, device
        self.w_dtype, self.b_dtype = w_dtype, b_dtype
        block_m, block_c, splits, self._reduce_rows = plan.reduce
        e_block_m, e_block_c, e_splits, self._elemt_rows = plan.elemt
        self._splits = splits
        self._stats_partial, self._grad_partial = (splits, 3, c), (splits, 2, c)
        self._reduce_grid = (_cdiv(c, block_c), splits)
        self._elemt_grid = (_cdiv(c, e_block_c), e_splits)
        self._merge_grid = plan.merge_grid
        kernels = _kernels()

        def site(name, **consts):
            return _Site(getattr(kernels, name), dict(consts, num_warps=_NUM_WARPS), device)

        merge = dict(BLOCK_S=_MERGE_BLOCK_S, BLOCK_C=_MERGE_BLOCK_C)
        self._sites = (
            site("bn_partial_stats_kernel", BLOCK_M=block_m, BLOCK_C=block_c),
            site("bn_finalize_stats_kernel", **merge),
            site("bn_forward_elemt_kernel", HAS_W=w_dtype is not None,
                 HAS_B=b_dtype is not None, HAS_RUNNING=running_dtypes is not None,
                 ONE_ROW=True, BLOCK_M=e_block_m, BLOCK_C=e_block_c),
            site("bn_partial_backward_kernel", BLOCK_M=block_m, BLOCK_C=block_c),
            site("bn_backward_elemt_kernel", HAS_W=w_dtype is not None, ONE_ROW=True,
                 BLOCK_M=e_block_m, BLOCK_C=e_block_c),
        )
        # (compute dw, compute db) -> the finalize's site
        self._grad_sites = {
            (dw, db): site("bn_finalize_backward_kernel", COMPUTE_DW=dw, COMPUTE_DB=db,
                           ONE_ROW=True, **merge)
            for dw in (False, True) for db in (False, True)
        }

    def forward(self, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                running_mean: Optional[Tensor], running_var: Optional[Tensor],
                momentum: float, eps: float) -> Tuple[Tensor, Tensor]:
        """``(out, row)``: ``x`` normalized with its own statistics (the running statistics
        updated in place), and the ``[mean (C), invstd (C), M]`` fp32 row the backward takes."""
        m, c, device, splits = self.m, self.c, self.device, self._splits
        partial = torch.empty(self._stats_partial, dtype=torch.float32, device=device)
        row = torch.empty(2 * c + 1, dtype=torch.float32, device=device)
        out = torch.empty_like(x)
        ptr = x.data_ptr()
        x_variant = None if ptr & 15 else ()
        for t in (weight, bias, running_mean, running_var):
            if t is not None:
                ptr |= t.data_ptr()
        variant = None if ptr & 15 else ()
        stats, finalize, elemt = self._sites[:3]
        with _on_device(x):
            stats(self._reduce_grid, (x, partial, m, c, c, self._reduce_rows), x_variant)
            finalize(self._merge_grid, (partial, row, splits, c, float(m), eps), ())
            elemt(self._elemt_grid,
                  (x, out, row, row if weight is None else weight, row if bias is None else bias,
                   row if running_mean is None else running_mean,
                   row if running_var is None else running_var, row, row,
                   m, c, c, c, 1, self._elemt_rows, momentum, eps), variant)
        return out, row

    def backward(self, dy: Tensor, x: Tensor, row: Tensor, weight: Optional[Tensor],
                 need_input: bool, need_weight: bool, need_bias: bool
                 ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """``(grad_input, grad_weight, grad_bias)`` (None where not asked for); ``dy`` has
        ``x``'s dtype and strides."""
        m, c, device, splits = self.m, self.c, self.device, self._splits
        partial = torch.empty(self._grad_partial, dtype=torch.float32, device=device)
        sums = torch.empty(2 * c, dtype=torch.float32, device=device)
        grad_weight = (torch.empty(c, dtype=self.w_dtype, device=device) if need_weight
                       else None)
        grad_bias = torch.empty(c, dtype=self.b_dtype, device=device) if need_bias else None
        # (row too: a saved-tensor hook may hand back a copy at any address)
        row_variant = None if row.data_ptr() & 15 else ()
        ptr = dy.data_ptr() | x.data_ptr() | row.data_ptr()
        variant = None if ptr & 15 else ()
        reduce, elemt = self._sites[3:]
        grad_input = None
        with _on_device(x):
            reduce(self._reduce_grid, (dy, x, row, partial, m, c, c, c, self._reduce_rows),
                   variant)
            self._grad_sites[(need_weight, need_bias)](
                self._merge_grid,
                (partial, row, sums, sums if grad_weight is None else grad_weight,
                 sums if grad_bias is None else grad_bias, splits, c), row_variant)
            if need_input:
                if weight is not None and weight.data_ptr() & 15:
                    variant = None
                grad_input = torch.empty_like(x)
                elemt(self._elemt_grid,
                      (dy, x, grad_input, row, row, row if weight is None else weight, sums,
                       row, m, c, c, c, c, 1, 1, self._elemt_rows), variant)
        return grad_input, grad_weight, grad_bias


@functools.lru_cache(maxsize=512)
def local_plan(m: int, c: int, device: torch.device, x_dtype: torch.dtype,
               w_dtype: Optional[torch.dtype], b_dtype: Optional[torch.dtype],
               running_dtypes: Optional[Tuple[torch.dtype, torch.dtype]]) -> LocalPlan:
    """The :class:`LocalPlan` of a signature (cached)."""
    return LocalPlan(m, c, device, x_dtype, w_dtype, b_dtype, running_dtypes)


@functools.lru_cache(maxsize=512)
def plan_for(m: int, c: int, device: torch.device) -> Plan:
    """The :class:`Plan` of an ``(m, c)`` geometry on ``device`` (cached; tuning scripts that
    change the module's settings call ``plan_for.cache_clear()``)."""
    return Plan(m, c, device)


def _check(x2d: Tensor, what: str) -> None:
    if x2d.dim() != 2 or (x2d.shape[1] > 1 and x2d.stride(1) != 1):
        raise ValueError(f"{what}: expected an (M, C) view with unit column stride, got shape "
                         f"{tuple(x2d.shape)} and strides {x2d.stride()}")
    if x2d.device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError(f"{what}: CPU tensors need TRITON_INTERPRET=1 (tests only)")


def _plan_of(x2d: Tensor) -> Plan:
    return plan_for(x2d.shape[0], x2d.shape[1], x2d.device)


def stats_row(x2d: Tensor, eps: float) -> Tensor:
    """This rank's statistics packed for the all-gather: ``[mean (C), invstd (C), M]``, fp32.

    ``invstd = 1 / sqrt(var + eps)`` with the biased variance, as ``torch.batch_norm_stats``.
    ``x2d`` must have at least one row.
    """
    _check(x2d, "stats_row")
    return _plan_of(x2d).stats_row(x2d, x2d.stride(0), eps)


def backward_reduce(dy2d: Tensor, x2d: Tensor, mean: Tensor, invstd: Tensor,
                    need_weight: bool, need_bias: bool
                    ) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(sums, grad_weight, grad_bias)`` over this rank's rows, all fp32.

    ``sums = [sum(dy) (C), sum(dy * (x - mean)) (C)]`` is the tensor the backward all-reduces;
    ``grad_weight = sum(dy * (x - mean)) * invstd`` when ``need_weight`` and
    ``grad_bias = sum(dy)`` when ``need_bias`` (separate tensors), else None. Both inputs must
    have at least one row.
    """
    _check(dy2d, "backward_reduce")
    _check(x2d, "backward_reduce")
    return _plan_of(x2d).backward_reduce(dy2d, dy2d.stride(0), x2d, x2d.stride(0), mean, invstd,
                                         need_weight, need_bias)


def forward_elemt(x2d: Tensor, rows: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                  running_mean: Optional[Tensor], running_var: Optional[Tensor],
                  momentum: float, eps: float, out2d: Tensor) -> Tuple[Tensor, Tensor]:
    """Normalize ``x2d`` into ``out2d`` with the statistics of every rank; ``(mean, invstd)``.

    ``rows`` is the all-gather's ``(world, 2C + 1)`` fp32 tensor of every rank's
    :func:`stats_row`. The merge is count-weighted (ranks' batch sizes may differ);
    ``running_mean`` / ``running_var`` (both or neither) are updated in place with ``momentum``
    (the variance unbiased). Returns the global mean and ``1 / sqrt(var + eps)``, fp32, which
    :func:`backward_elemt` takes. ``x2d`` must have at least one row.
    """
    _check(x2d, "forward_elemt")
    _check(out2d, "forward_elemt")
    c = x2d.shape[1]
    world = rows.shape[0]
    if rows.shape != (world, 2 * c + 1) or rows.dtype != torch.float32 or not rows.is_contiguous():
        raise ValueError(f"forward_elemt: rows must be a contiguous fp32 (world, {2 * c + 1}) "
                         f"tensor, got {rows.dtype} {tuple(rows.shape)}")
    return _plan_of(x2d).forward_elemt(x2d, x2d.stride(0), out2d, out2d.stride(0), rows,
                                       weight, bias, running_mean, running_var, momentum, eps)


def backward_elemt(dy2d: Tensor, x2d: Tensor, mean: Tensor, invstd: Tensor,
                   weight: Optional[Tensor], sums: Tensor, counts: Tensor,
                   out2d: Tensor) -> Tensor:
    """The input gradient into ``out2d``: ``(dy - sum_dy / N - (x - mean) * invstd^2 *
    sum_dy_xmu / N) * invstd * weight``, with ``sums = [sum_dy, sum_dy_xmu]`` over every rank
    and ``N = counts.sum()`` (``counts``: the ranks' row counts, fp32, any stride). Returns
    ``out2d``. Both inputs must have at least one row."""
    _check(dy2d, "backward_elemt")
    _check(x2d, "backward_elemt")
    _check(out2d, "backward_elemt")
    return _plan_of(x2d).backward_elemt(dy2d, dy2d.stride(0), x2d, x2d.stride(0), out2d,
                                        out2d.stride(0), mean, invstd, weight, sums, counts)
