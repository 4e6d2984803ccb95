"""Triton kernels for LayerNorm and RMSNorm, forward and backward.

This module imports :mod:`triton` at the top, so it is only ever imported lazily, by
:mod:`mixprec.normalization._launch`, when a fused path is about to run: ``import mixprec``
works without Triton. ``TRITON_INTERPRET=1`` must be set before this module is first imported
for the kernels to run on CPU tensors (the tests do that in their ``conftest.py``).

Layout: a program owns a ``[BLOCK_M, BLOCK_N]`` tile of whole rows (``BLOCK_N >= N``), so the
row statistics are register reductions and each element is read from memory exactly once. The
forward runs one program per tile; the backward is persistent (one program per resident slot,
each looping over a contiguous run of row blocks) so that the weight/bias gradient partial
sums stay in registers.
Numerics: everything is loaded and computed in fp32, mean and rstd are stored in fp32, and each
output is cast once, on store.
"""

import triton
import triton.language as tl

__all__ = []


# M only bounds the row masks: not specializing on it (M == 1, M % 16 == 0) avoids recompiling
# when the number of rows changes.
@triton.jit(do_not_specialize=["M"])
def norm_fwd_kernel(
    X,  # [M, N] input, any float dtype; row stride stride_x_row, unit column stride
    Y,  # [M, N] output in the output dtype; row stride stride_y_row, unit column stride
    W,  # [N] weight, any float dtype; read only when HAS_WEIGHT
    B,  # [N] bias, any float dtype; read only when HAS_BIAS
    Mean,  # [M] fp32 row means; written only when not IS_RMS
    Rstd,  # [M] fp32 row 1 / sqrt(var + eps) (1 / sqrt(mean(x^2) + eps) when IS_RMS)
    stride_x_row,
    stride_y_row,
    M,
    N,
    eps,
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    # int64 row offsets: M * N can pass 2**31 elements.
    rows64 = rows.to(tl.int64)

    x = tl.load(X + rows64[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        # The sum's rounding leaves the mean off by up to a few ulps of the row's values; for a
        # row of near-equal values that error is the whole deviation, and 1 / sqrt(var + eps)
        # would blow it up (a constant row of 12345.678 normalized to +-1 instead of 0). One
        # correction on the row already in registers, the mean of the residuals, brings the
        # mean to the nearest float of a constant row and costs no extra read.
        xc = tl.where(mask, x - mean[:, None], 0.0)
        mean = mean + tl.sum(xc, axis=1) / N
        tl.store(Mean + rows, mean, mask=row_ok)
        # Two-pass variance on the row already in registers: no cancellation, no extra read.
        xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / N
    rstd = tl.rsqrt(var + eps)
    tl.store(Rstd + rows, rstd, mask=row_ok)

    y = xc * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = y + b[None, :]
    tl.store(Y + rows64[:, None] * stride_y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


# Backward, per row, with N the row length and sums over the row's N columns:
#
#   x_hat = (xy - mean) * rstd          (LayerNorm; x_hat = xy * rstd for RMSNorm)
#   y     = x_hat * w + b
#   wdy   = dy * w                      (= dL/dx_hat)
#
# LayerNorm: x_hat_j depends on x_i through mean and rstd,
#   d x_hat_j / d x_i = rstd * (delta_ij - 1/N - x_hat_i * x_hat_j / N),
# so dx_i = sum_j wdy_j * d x_hat_j / d x_i
#         = rstd * (wdy_i - c2 - x_hat_i * c1),   c1 = sum(x_hat * wdy) / N,  c2 = sum(wdy) / N.
# RMSNorm has no mean: d x_hat_j / d x_i = rstd * (delta_ij - x_hat_i * x_hat_j / N), so
#   dx_i = rstd * (wdy_i - x_hat_i * c1).
# Parameters: dw = sum over rows of dy * x_hat, db = sum over rows of dy.
#
# FROM_Y (memory_efficient): the forward saved y instead of x, and x_hat = (y - b) / w, which
# needs every w != 0. rstd is still saved; mean is not needed.
#
# dw/db without atomics: program p walks its own contiguous run of blocks_per_program row
# blocks, keeps fp32 running sums in registers, and writes one row of DW_partial / DB_partial;
# the host sums the [num_programs, N] partials in fp32. The result is deterministic.


@triton.jit
def _bwd_load(
    DY,  # [M, N] gradient of y; row stride stride_dy_row
    XY,  # [M, N] saved x or y; row stride stride_xy_row
    Mean,  # [M] fp32; read only when NEED_MEAN
    Rstd,  # [M] fp32
    block,
    end_block,
    stride_dy_row,
    stride_xy_row,
    M,
    N,
    NEED_MEAN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Row block `block` of dy and x (or y), in their storage dtypes, and its statistics.

    Blocks at or past `end_block` (another program's, or the end) load nothing.
    """
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = (rows < M) & (block < end_block)
    mask = row_ok[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    dy = tl.load(DY + rows64[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0)
    xy = tl.load(XY + rows64[:, None] * stride_xy_row + cols[None, :], mask=mask, other=0.0)
    rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
    if NEED_MEAN:
        mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
    else:
        mean = rstd  # placeholder, never read
    return dy, xy, mean, rstd


@triton.jit
def _bwd_block(
    dy,  # [BLOCK_M, BLOCK_N] gradient of y, storage dtype
    xy,  # [BLOCK_M, BLOCK_N] saved x or y, storage dtype
    mean,  # [BLOCK_M] fp32 (unused unless LayerNorm from x)
    rstd,  # [BLOCK_M] fp32
    w,  # [BLOCK_N] fp32 weight (1 in padding columns), or a placeholder scalar
    b,  # [BLOCK_N] fp32 bias, or a placeholder scalar
    dw_acc,  # [BLOCK_M, BLOCK_N] fp32 running sum of dy * x_hat
    db_acc,  # [BLOCK_M, BLOCK_N] fp32 running sum of dy
    DX,  # [M, N] gradient of x, contiguous
    block,
    M,
    N,
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FROM_Y: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dx for one row block (stored), and the updated dw/db running sums."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dy = dy.to(tl.float32)
    xy = xy.to(tl.float32)

    if FROM_Y:
        x_hat = xy
        if HAS_BIAS:
            x_hat = x_hat - b[None, :]
        if HAS_WEIGHT:
            x_hat = x_hat / w[None, :]
    elif IS_RMS:
        x_hat = xy * rstd[:, None]
    else:
        x_hat = (xy - mean[:, None]) * rstd[:, None]
    # Padding must not enter the row sums below.
    x_hat = tl.where(mask, x_hat, 0.0)

    if HAS_WEIGHT:
        wdy = dy * w[None, :]
    else:
        wdy = dy
    c1 = tl.sum(x_hat * wdy, axis=1) / N
    if IS_RMS:
        dx = (wdy - x_hat * c1[:, None]) * rstd[:, None]
    else:
        c2 = tl.sum(wdy, axis=1) / N
        dx = (wdy - (x_hat * c1[:, None] + c2[:, None])) * rstd[:, None]
    rows64 = rows.to(tl.int64)
    tl.store(DX + rows64[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

    if COMPUTE_DW:
        dw_acc += dy * x_hat
    if COMPUTE_DB:
        db_acc += dy
    return dw_acc, db_acc


@triton.jit(do_not_specialize=["M", "blocks_per_program"])
def norm_bwd_kernel(
    DY,  # [M, N] gradient of y, output dtype; row stride stride_dy_row, unit column stride
    XY,  # [M, N] saved x, or saved y when FROM_Y; row stride stride_xy_row, unit column stride
    W,  # [N] weight, any float dtype; read only when HAS_WEIGHT
    B,  # [N] bias, any float dtype; read only when FROM_Y and HAS_BIAS
    Mean,  # [M] fp32 row means; read only when neither IS_RMS nor FROM_Y
    Rstd,  # [M] fp32 row 1 / sqrt(var + eps)
    DX,  # [M, N] gradient of x, input dtype, contiguous
    DW_partial,  # [num_programs, N] fp32 partial sums of dy * x_hat; written when COMPUTE_DW
    DB_partial,  # [num_programs, N] fp32 partial sums of dy; written when COMPUTE_DB
    stride_dy_row,
    stride_xy_row,
    M,
    N,
    blocks_per_program,
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FROM_Y: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    NEED_MEAN: tl.constexpr,  # LayerNorm from x: not IS_RMS and not FROM_Y
    PREFETCH: tl.constexpr,
    PIPELINE_STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_WEIGHT:
        # Padding columns read 1, not 0, so (y - b) / w stays finite there.
        w = tl.load(W + cols, mask=col_ok, other=1.0).to(tl.float32)
    else:
        w = 0.0  # placeholder, never read
    if FROM_Y and HAS_BIAS:
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        b = 0.0  # placeholder, never read
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    block = pid * blocks_per_program
    end_block = block + blocks_per_program
    if PIPELINE_STAGES > 0:
        # Let Triton's loop pipeliner stage the next blocks' loads through shared memory.
        # Compiled GPUs only: the CPU interpreter cannot take a runtime tl.range bound.
        for blk in tl.range(block, end_block, num_stages=PIPELINE_STAGES):
            dy, xy, mean, rstd = _bwd_load(
                DY, XY, Mean, Rstd, blk, end_block, stride_dy_row, stride_xy_row, M, N,
                NEED_MEAN, BLOCK_M, BLOCK_N,
            )
            dw_acc, db_acc = _bwd_block(
                dy, xy, mean, rstd, w, b, dw_acc, db_acc, DX, blk, M, N, IS_RMS, HAS_WEIGHT,
                HAS_BIAS, FROM_Y, COMPUTE_DW, COMPUTE_DB, BLOCK_M, BLOCK_N,
            )
    elif PREFETCH:
        # Register double buffering: the next block's loads are issued before this block's
        # reductions, so their memory latency hides behind this block's arithmetic.
        # (while, not range(): Triton's CPU interpreter cannot take a runtime range() bound
        # with NumPy >= 2, and the tests run this kernel there.)
        dy, xy, mean, rstd = _bwd_load(
            DY, XY, Mean, Rstd, block, end_block, stride_dy_row, stride_xy_row, M, N,
            NEED_MEAN, BLOCK_M, BLOCK_N,
        )
        while block < end_block:
            dy_next, xy_next, mean_next, rstd_next = _bwd_load(
                DY, XY, Mean, Rstd, block + 1, end_block, stride_dy_row, stride_xy_row, M, N,
                NEED_MEAN, BLOCK_M, BLOCK_N,
            )
            dw_acc, db_acc = _bwd_block(
                dy, xy, mean, rstd, w, b, dw_acc, db_acc, DX, block, M, N, IS_RMS, HAS_WEIGHT,
                HAS_BIAS, FROM_Y, COMPUTE_DW, COMPUTE_DB, BLOCK_M, BLOCK_N,
            )
            dy, xy, mean, rstd = dy_next, xy_next, mean_next, rstd_next
            block += 1
    else:
        while block < end_block:
            dy, xy, mean, rstd = _bwd_load(
                DY, XY, Mean, Rstd, block, end_block, stride_dy_row, stride_xy_row, M, N,
                NEED_MEAN, BLOCK_M, BLOCK_N,
            )
            dw_acc, db_acc = _bwd_block(
                dy, xy, mean, rstd, w, b, dw_acc, db_acc, DX, block, M, N, IS_RMS, HAS_WEIGHT,
                HAS_BIAS, FROM_Y, COMPUTE_DW, COMPUTE_DB, BLOCK_M, BLOCK_N,
            )
            block += 1

    if COMPUTE_DW:
        tl.store(DW_partial + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    if COMPUTE_DB:
        tl.store(DB_partial + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_ok)


# The backward's weight/bias gradients, finished: column sums of the [num_programs, N] fp32
# partials, cast once to the parameters' dtypes. One launch for dw and db (grid axis 1 picks the
# partial set) instead of a PyTorch column reduction and two casts; rows are summed in a fixed
# order, so the result is reproducible.
@triton.jit(do_not_specialize=["P"])
def norm_bwd_finalize_kernel(
    Partials,  # [n_partials, P, N] fp32, contiguous
    Out0,  # [N] sums of partial set 0 (dw, or db when only db is computed), parameter dtype
    Out1,  # [N] sums of partial set 1 (db); read only when grid axis 1 has two programs
    P,
    N,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_c = tl.program_id(0)
    which = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < N
    base = Partials + which.to(tl.int64) * P * N
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    # (while, not range(): the CPU interpreter cannot take a runtime range() bound.)
    p0 = 0
    while p0 < P:
        rows = p0 + tl.arange(0, BLOCK_P)
        mask = (rows < P)[:, None] & col_ok[None, :]
        acc += tl.load(base + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask,
                       other=0.0)
        p0 += BLOCK_P
    total = tl.sum(acc, axis=0)
    if which == 0:
        tl.store(Out0 + cols, total.to(Out0.dtype.element_ty), mask=col_ok)
    else:
        tl.store(Out1 + cols, total.to(Out1.dtype.element_ty), mask=col_ok)
