"""Host launchers for the Triton batch-norm kernels over channels-last ``(M, C)`` memory.

For dense channels-last inputs on CUDA, :class:`~mixprec.parallel.SyncBatchNorm` and
:class:`~mixprec.normalization.FusedBatchNorm` run these kernels instead of PyTorch's
``batch_norm_stats`` / ``batch_norm_gather_stats_with_counts`` / ``batch_norm_elemt`` /
``batch_norm_backward_reduce`` / ``batch_norm_backward_elemt``, whose channels-last kernels move
these tensors at a fraction of the memory bandwidth (on an H200 in a ResNet-50 step they took
about twice cuDNN's time for the same layers). A :class:`Plan` holds one input signature's
launches:

* :meth:`Plan.stats`: this rank's statistics row ``[mean (C), invstd (C), M]``, the tensor the
  all-gather sends;
* :meth:`Plan.normalize`: the count-weighted merge of every rank's rows (and the running
  statistics' update) fused into the normalization, one launch; it writes the global row,
  which is all the backward reads besides the input and the weight (in one process the
  rank's own row is used as it is);
* :meth:`Plan.grad_sums`: ``sum(dy)`` and ``sum(dy * (x - mean))``, written into the tensor the
  all-reduce sends, and the local weight/bias gradients;
* :meth:`Plan.grad_input`: the input gradient.

The reductions are two launches each (partial results per run of rows, then a merge in a fixed
order: no atomics, the same bits every run); the element-wise passes one each. The module-level
functions (:func:`stats_row`, :func:`forward_elemt`, :func:`backward_reduce`,
:func:`backward_elemt`) are the same passes on contiguous ``(M, C)`` tensors, with checks.
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
    triton_available,
    triton_next_power_of_2,
)

__all__ = ["Plan", "backward_elemt", "backward_reduce", "forward_elemt", "plan_for",
           "stats_row", "usable", "usable_dtype"]

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
    """Whether the Triton kernels take ``x2d``: a contiguous ``(M, C)`` tensor in
    fp32/fp16/bf16 on CUDA (CPU under the testing hook), with Triton importable."""
    if x2d.dim() != 2 or not x2d.is_contiguous():
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


def _aligned(*tensors: Optional[Tensor]) -> bool:
    """Whether every tensor given (None skipped) starts on a 16-byte boundary, as the compiled
    kernels a :class:`~mixprec.normalization._launch._Site` keeps assume."""
    ptr = 0
    for t in tensors:
        if t is not None:
            ptr |= t.data_ptr()
    return not ptr & 15


class Plan:
    """The kernels' launches for one input signature: a dense channels-last ``(M, C)`` input
    (its memory is the ``(M, C)`` array with row stride ``C``) of one dtype on one device, and
    parameters and running statistics of given dtypes (or none).

    What does not change from call to call (grids, constexprs, compiled kernels, scratch shapes,
    argument dtypes) is fixed here, so a call only allocates and launches. The methods check
    nothing: tensors must have the signature's shapes, dtypes and dense memory (the output
    gradient too: callers copy one with other strides). Launches with a tensor that is not
    16-byte aligned take the checked launcher. Reductions use ``_PROGRAMS_PER_SM`` programs per
    SM, element-wise passes ``_ELEMT_PROGRAMS_PER_SM``.
    """

    __slots__ = ("m", "c", "device", "x_dtype", "w_dtype", "b_dtype", "reduce", "elemt",
                 "_stats_partial", "_grad_partial", "_reduce_grid", "_elemt_grid", "_merge_grid",
                 "_stats_sites", "_normalize_sites", "_grad_sites", "_input_site")

    def __init__(self, m: int, c: int, device: torch.device, x_dtype: torch.dtype,
                 w_dtype: Optional[torch.dtype], b_dtype: Optional[torch.dtype],
                 running_dtypes: Optional[Tuple[torch.dtype, torch.dtype]]):
        # (The running statistics' dtypes are not read here, but the compiled kernels the sites
        # keep are specialized on them: they are part of plan_for's key.)
        self.m, self.c, self.device = m, c, device
        self.x_dtype, self.w_dtype, self.b_dtype = x_dtype, w_dtype, b_dtype
        if device.type == "cuda":
            sms = _sm_resources(device.index)[0]
            reduce_target, elemt_target = _PROGRAMS_PER_SM * sms, _ELEMT_PROGRAMS_PER_SM * sms
        else:
            # The interpreter: a few splits, so the tests cover the merges and the loops, and
            # the element-wise passes split the rows differently from the reductions, as on
            # a GPU (a launch pairing one split's grid with the other's rows then shows).
            reduce_target, elemt_target = 4, 8
        self.reduce = _split(m, c, reduce_target)
        self.elemt = _split(m, c, elemt_target)
        block_m, block_c, splits, _ = self.reduce
        e_block_m, e_block_c, e_splits, _ = self.elemt
        self._stats_partial, self._grad_partial = (splits, 3, c), (splits, 2, c)
        self._reduce_grid = (_cdiv(c, block_c), splits)
        self._elemt_grid = (_cdiv(c, e_block_c), e_splits)
        self._merge_grid = (_cdiv(c, _MERGE_BLOCK_C),)
        kernels = _kernels()

        def site(name, **consts):
            return _Site(getattr(kernels, name), dict(consts, num_warps=_NUM_WARPS), device)

        merge = dict(BLOCK_S=_MERGE_BLOCK_S, BLOCK_C=_MERGE_BLOCK_C)
        has_w, has_b = w_dtype is not None, b_dtype is not None
        self._stats_sites = (
            site("bn_partial_stats_kernel", BLOCK_M=block_m, BLOCK_C=block_c),
            site("bn_finalize_stats_kernel", **merge),
        )
        # one_row -> the normalization's site (True: one process, the row as it is; False:
        # the ranks' gathered rows, merged)
        self._normalize_sites = {
            one_row: site("bn_forward_elemt_kernel", HAS_W=has_w, HAS_B=has_b,
                          HAS_RUNNING=running_dtypes is not None, ONE_ROW=one_row,
                          BLOCK_M=e_block_m, BLOCK_C=e_block_c)
            for one_row in (False, True)
        }
        # (compute dw, compute db) -> the partial sums' site and the finalize's site
        partial = site("bn_partial_backward_kernel", BLOCK_M=block_m, BLOCK_C=block_c)
        self._grad_sites = {
            (dw, db): (partial, site("bn_finalize_backward_kernel", COMPUTE_DW=dw,
                                     COMPUTE_DB=db, **merge))
            for dw in (False, True) for db in (False, True)
        }
        self._input_site = site("bn_backward_elemt_kernel", HAS_W=has_w, BLOCK_M=e_block_m,
                                BLOCK_C=e_block_c)

    def reads_saved(self, x: Tensor, x_strides: Tuple[int, ...], weight: Optional[Tensor],
                    row: Tensor) -> bool:
        """Whether the tensors autograd hands a backward are still what the kernels read: ``x``
        with the forward's strides ``x_strides``, the weight and the fp32 statistics row, in
        the plan's dtypes, on its device, contiguous. (A saved-tensor hook, for activation
        offloading or compression, may hand back copies laid out or typed otherwise.)"""
        device = self.device
        return not (x.stride() != x_strides or x.dtype is not self.x_dtype
                    or x.device != device or row.dtype is not torch.float32
                    or row.device != device or not row.is_contiguous()
                    or (weight is not None and (weight.dtype is not self.w_dtype
                                                or weight.device != device
                                                or not weight.is_contiguous())))

    def stats(self, x: Tensor, eps: float) -> Tensor:
        """This rank's statistics row ``[mean (C), invstd (C), M]``, fp32 (the biased variance:
        ``invstd = 1 / sqrt(var + eps)``, as ``torch.batch_norm_stats``)."""
        m, c, device = self.m, self.c, self.device
        splits = self._reduce_grid[1]
        partial = torch.empty(self._stats_partial, dtype=torch.float32, device=device)
        row = torch.empty(2 * c + 1, dtype=torch.float32, device=device)
        stats, finalize = self._stats_sites
        with _on_device(x):
            stats(self._reduce_grid, (x, partial, m, c, c, self.reduce[3]),
                  () if _aligned(x) else None)
            # (eps and momentum as floats: Triton would compile an int 1 in as a constant, and
            # the sites' compiled kernels are shared by every call of the signature)
            finalize(self._merge_grid, (partial, row, splits, c, float(m), float(eps)), ())
        return row

    def normalize(self, x: Tensor, rows: Tensor, weight: Optional[Tensor],
                  bias: Optional[Tensor], running_mean: Optional[Tensor],
                  running_var: Optional[Tensor], momentum: float, eps: float
                  ) -> Tuple[Tensor, Tensor]:
        """``(out, row)``: ``x`` normalized with the statistics of ``rows`` (the running
        statistics, both or neither, updated in place with ``momentum``, the variance
        unbiased), and the global ``[mean, invstd, N]`` row the backward takes.

        ``rows``: the all-gather's contiguous ``(world, 2C + 1)`` fp32 tensor of every rank's
        :meth:`stats` row, merged count-weighted (ranks' batch sizes may differ); or, in one
        process, this rank's ``(2C + 1,)`` row itself, which is then the global row.
        """
        m, c, device = self.m, self.c, self.device
        one_row = rows.dim() == 1
        world = 1 if one_row else rows.shape[0]
        row = rows if one_row else torch.empty(2 * c + 1, dtype=torch.float32, device=device)
        out = torch.empty_like(x)
        aligned = _aligned(x, rows, weight, bias, running_mean, running_var)
        with _on_device(x):
            self._normalize_sites[one_row](
                self._elemt_grid,
                (x, out, rows, row if weight is None else weight, row if bias is None else bias,
                 row if running_mean is None else running_mean,
                 row if running_var is None else running_var, row,
                 m, c, c, c, world, self.elemt[3], float(momentum), float(eps)),
                (world,) if aligned else None)  # (world: Triton specializes 1 and 16k)
        return out, row

    def forward(self, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                running_mean: Optional[Tensor], running_var: Optional[Tensor],
                momentum: float, eps: float) -> Tuple[Tensor, Tensor]:
        """One process (no collectives): ``(out, row)``, :meth:`stats` then :meth:`normalize`
        with this process's own row."""
        return self.normalize(x, self.stats(x, eps), weight, bias, running_mean, running_var,
                              momentum, eps)

    def grad_sums(self, dy: Tensor, x: Tensor, row: Tensor, need_weight: bool,
                  need_bias: bool) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """``(sums, grad_weight, grad_bias)`` over this rank's rows.

        ``sums = [sum(dy) (C), sum(dy * (x - mean)) (C)]``, fp32, is the tensor the backward
        all-reduces; ``grad_weight = sum(dy * (x - mean)) * invstd`` and ``grad_bias = sum(dy)``
        (separate tensors, in the parameters' dtypes) where asked for, else None. ``row`` is
        :meth:`normalize`'s global row.
        """
        m, c, device = self.m, self.c, self.device
        splits = self._reduce_grid[1]
        partial = torch.empty(self._grad_partial, dtype=torch.float32, device=device)
        sums = torch.empty(2 * c, dtype=torch.float32, device=device)
        grad_weight = (torch.empty(c, dtype=self.w_dtype, device=device) if need_weight
                       else None)
        grad_bias = torch.empty(c, dtype=self.b_dtype, device=device) if need_bias else None
        reduce, finalize = self._grad_sites[(need_weight, need_bias)]
        with _on_device(x):
            reduce(self._reduce_grid, (dy, x, row, partial, m, c, c, c, self.reduce[3]),
                   () if _aligned(dy, x, row) else None)
            # (row too: a saved-tensor hook may hand back a copy at any address)
            finalize(self._merge_grid,
                     (partial, row, sums, sums if grad_weight is None else grad_weight,
                      sums if grad_bias is None else grad_bias, splits, c),
                     () if _aligned(row) else None)
        return sums, grad_weight, grad_bias

    def grad_input(self, dy: Tensor, x: Tensor, row: Tensor, weight: Optional[Tensor],
                   sums: Tensor) -> Tensor:
        """The input gradient ``(dy - sum_dy / N - (x - mean) * invstd^2 * sum_dy_xmu / N) *
        invstd * weight``, in ``x``'s dtype and memory layout, with ``sums`` (``[sum_dy,
        sum_dy_xmu]``) over every rank and ``mean, invstd, N`` from the global ``row``."""
        out = torch.empty_like(x)
        with _on_device(x):
            self._input_site(
                self._elemt_grid,
                (dy, x, out, row, row if weight is None else weight, sums,
                 self.m, self.c, self.c, self.c, self.c, self.elemt[3]),
                () if _aligned(dy, x, row, weight, sums) else None)
        return out

    def backward(self, dy: Tensor, x: Tensor, row: Tensor, weight: Optional[Tensor],
                 need_input: bool, need_weight: bool, need_bias: bool
                 ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """One process (no collectives): ``(grad_input, grad_weight, grad_bias)``, None where
        not asked for."""
        sums, grad_weight, grad_bias = self.grad_sums(dy, x, row, need_weight, need_bias)
        grad_input = self.grad_input(dy, x, row, weight, sums) if need_input else None
        return grad_input, grad_weight, grad_bias


@functools.lru_cache(maxsize=512)
def plan_for(m: int, c: int, device: torch.device, x_dtype: torch.dtype,
             w_dtype: Optional[torch.dtype] = None, b_dtype: Optional[torch.dtype] = None,
             running_dtypes: Optional[Tuple[torch.dtype, torch.dtype]] = None) -> Plan:
    """The :class:`Plan` of a signature (cached; tuning scripts that change the module's
    settings call ``plan_for.cache_clear()``)."""
    return Plan(m, c, device, x_dtype, w_dtype, b_dtype, running_dtypes)


def _check(what: str, *tensors: Tensor) -> None:
    for t in tensors:
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{what}: expected contiguous (M, C) tensors, got shape "
                             f"{tuple(t.shape)} with strides {t.stride()}; pass "
                             "t.contiguous()")
        if t.device.type == "cpu" and not interpreter_enabled():
            raise RuntimeError(f"{what}: CPU tensors need TRITON_INTERPRET=1 (tests only)")


def _dtype(t: Optional[Tensor]) -> Optional[torch.dtype]:
    return None if t is None else t.dtype


def _plan_of(x2d: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
             running_mean: Optional[Tensor] = None,
             running_var: Optional[Tensor] = None) -> Plan:
    running = None if running_mean is None else (running_mean.dtype, running_var.dtype)
    return plan_for(x2d.shape[0], x2d.shape[1], x2d.device, x2d.dtype, _dtype(weight),
                    _dtype(bias), running)


def _check_row(what: str, row: Tensor, c: int) -> None:
    if row.shape != (2 * c + 1,) or row.dtype != torch.float32 or not row.is_contiguous():
        raise ValueError(f"{what}: row must be a contiguous fp32 ({2 * c + 1},) tensor "
                         f"[mean, invstd, count], got {row.dtype} {tuple(row.shape)}")


def _check_vectors(what: str, x2d: Tensor, **vectors: Optional[Tensor]) -> None:
    """Per-channel tensors (parameters, running statistics) as the kernels read them."""
    c = x2d.shape[1]
    for name, t in vectors.items():
        if t is not None and (t.shape != (c,) or not t.is_contiguous() or t.device != x2d.device
                              or t.dtype not in _DTYPES):
            raise ValueError(f"{what}: {name} must be a contiguous ({c},) fp32/fp16/bf16 "
                             f"tensor on {x2d.device}, got {t.dtype} {tuple(t.shape)} with "
                             f"strides {t.stride()} on {t.device}")


def _check_same_dtype(what: str, dy2d: Tensor, x2d: Tensor) -> None:
    if dy2d.dtype != x2d.dtype or dy2d.shape != x2d.shape:
        raise ValueError(f"{what}: dy and x must have the same shape and dtype, got "
                         f"{dy2d.dtype} {tuple(dy2d.shape)} and {x2d.dtype} {tuple(x2d.shape)}")


def stats_row(x2d: Tensor, eps: float) -> Tensor:
    """This rank's statistics packed for the all-gather: ``[mean (C), invstd (C), M]``, fp32.

    ``invstd = 1 / sqrt(var + eps)`` with the biased variance, as ``torch.batch_norm_stats``.
    ``x2d`` must have at least one row.
    """
    _check("stats_row", x2d)
    return _plan_of(x2d).stats(x2d, eps)


def forward_elemt(x2d: Tensor, rows: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                  running_mean: Optional[Tensor], running_var: Optional[Tensor],
                  momentum: float, eps: float) -> Tuple[Tensor, Tensor]:
    """``(out, row)``: ``x2d`` normalized with the statistics of every rank, and the global
    ``[mean (C), invstd (C), N]`` fp32 row (see :meth:`Plan.normalize`).

    ``rows`` is the all-gather's ``(world, 2C + 1)`` fp32 tensor of every rank's
    :func:`stats_row`. ``running_mean`` / ``running_var`` (both or neither) are updated in place.
    ``x2d`` must have at least one row.
    """
    _check("forward_elemt", x2d)
    c = x2d.shape[1]
    world = rows.shape[0] if rows.dim() == 2 else 0
    if rows.shape != (world, 2 * c + 1) or rows.dtype != torch.float32 or not rows.is_contiguous():
        raise ValueError(f"forward_elemt: rows must be a contiguous fp32 (world, {2 * c + 1}) "
                         f"tensor, got {rows.dtype} {tuple(rows.shape)}")
    if (running_mean is None) != (running_var is None):
        raise ValueError("forward_elemt: pass both running statistics or neither")
    _check_vectors("forward_elemt", x2d, weight=weight, bias=bias, running_mean=running_mean,
                   running_var=running_var)
    return _plan_of(x2d, weight, bias, running_mean, running_var).normalize(
        x2d, rows, weight, bias, running_mean, running_var, momentum, eps)


def backward_reduce(dy2d: Tensor, x2d: Tensor, row: Tensor, need_weight: bool, need_bias: bool
                    ) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(sums, grad_weight, grad_bias)`` over this rank's rows, all fp32, with the global
    statistics ``row`` (see :meth:`Plan.grad_sums`). Both inputs must have at least one row
    and the same dtype."""
    _check("backward_reduce", dy2d, x2d)
    _check_row("backward_reduce", row, x2d.shape[1])
    _check_same_dtype("backward_reduce", dy2d, x2d)
    plan = plan_for(x2d.shape[0], x2d.shape[1], x2d.device, x2d.dtype, torch.float32,
                    torch.float32)
    return plan.grad_sums(dy2d, x2d, row, need_weight, need_bias)


def backward_elemt(dy2d: Tensor, x2d: Tensor, row: Tensor, weight: Optional[Tensor],
                   sums: Tensor) -> Tensor:
    """The input gradient (see :meth:`Plan.grad_input`): ``sums = [sum_dy, sum_dy_xmu]`` over
    every rank, ``row`` the global ``[mean, invstd, N]``. Both inputs must have at least one
    row and the same dtype."""
    _check("backward_elemt", dy2d, x2d)
    _check_row("backward_elemt", row, x2d.shape[1])
    _check_same_dtype("backward_elemt", dy2d, x2d)
    _check_vectors("backward_elemt", x2d, weight=weight)
    c = x2d.shape[1]
    if sums.shape != (2 * c,) or sums.dtype != torch.float32 or not sums.is_contiguous():
        raise ValueError(f"backward_elemt: sums must be a contiguous fp32 ({2 * c},) tensor "
                         f"[sum_dy, sum_dy_xmu], got {sums.dtype} {tuple(sums.shape)}")
    return _plan_of(x2d, weight).grad_input(dy2d, x2d, row, weight, sums)
