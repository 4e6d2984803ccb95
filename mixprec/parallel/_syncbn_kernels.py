"""Triton kernels for SyncBatchNorm over a channels-last ``(M, C)`` view.

Imported lazily by :mod:`mixprec.parallel._syncbn_triton` (it imports :mod:`triton` at the top),
so ``import mixprec`` never needs Triton; ``TRITON_INTERPRET=1`` set before the first import
runs the kernels on CPU tensors (the tests do that when there is no GPU).

Layout: channels are contiguous (unit column stride), rows ``M = N * H * W`` have stride
``stride_m``. Every program owns a ``BLOCK_C``-wide slice of channels and a contiguous run of
rows (a *split*); it streams the rows in ``[BLOCK_M, BLOCK_C]`` tiles (coalesced along C).

Reductions (the per-rank statistics; ``sum(dy)`` and ``sum(dy * (x - mean))``) write one partial
result per split and channel; a second, small kernel merges the splits, a ``[BLOCK_S, BLOCK_C]``
tile at a time in a fixed order, so results are bitwise reproducible run to run (no atomics).
Element-wise passes (normalize; input gradient) compute their per-channel coefficients once
per program: the forward merges the ranks' gathered statistics itself (a few loads per channel)
instead of a separate merge launch. Statistics travel as rows ``[mean (C), invstd (C), count]``
of fp32: a rank's own row is what the all-gather sends; the global row, written by the
normalization (or, in one process, the rank's own), is all the backward passes read.

Numerics: loads in the storage dtype, all arithmetic in fp32, accumulated element-wise in
registers and reduced across threads once per program. Each split's statistics come from sums
shifted by a sample of each channel, the splits are merged count-weighted around the global
mean (Chan's formula), so a large mean does not cancel the variance as ``E[x^2] - E[x]^2``
would.
"""

import triton
import triton.language as tl

__all__ = []


@triton.jit
def _channel_block(C, BLOCK_C: tl.constexpr):
    # This program's BLOCK_C channels (grid axis 0) and which of them exist.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    return cols, cols < C


@triton.jit
def _split_rows(M, rows_per_split):
    # This program's run of rows (grid axis 1): [start, end).
    start = tl.program_id(1) * rows_per_split
    return start, tl.minimum(start + rows_per_split, M)


@triton.jit
def _row_tile(r0, end, col_ok, BLOCK_M: tl.constexpr):
    # Rows r0 .. r0 + BLOCK_M (below end) as int64 row indices [BLOCK_M, 1], and the tile's mask:
    # the rows of a split in the passes over x, the splits' partial results in the merges.
    rows = r0 + tl.arange(0, BLOCK_M)
    mask = (rows < end)[:, None] & col_ok[None, :]
    return rows.to(tl.int64)[:, None], mask


@triton.jit(do_not_specialize=["M", "rows_per_split"])
def bn_partial_stats_kernel(
    X,  # [M, C] input, any float dtype, unit column stride
    Partial,  # [S, 3, C] fp32: per split, mean / centred sum of squares / row count
    M,
    C,
    stride_m,
    rows_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Shifted sums: every element adds (x - shift) and (x - shift)^2 to register accumulators
    # (no reduction across threads inside the loop); shift is the split's first row, a sample
    # of each channel, so |mean - shift| is a few standard deviations and the centred sum of
    # squares S2 - S1^2 / n does not cancel the way E[x^2] - E[x]^2 would.
    cols, col_ok = _channel_block(C, BLOCK_C)
    start, end = _split_rows(M, rows_per_split)
    shift = tl.load(X + start.to(tl.int64) * stride_m + cols, mask=col_ok, other=0.0)
    shift = shift.to(tl.float32)
    s1 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    r0 = start
    while r0 < end:  # (while: the CPU interpreter cannot take a runtime range() bound)
        rows64, mask = _row_tile(r0, end, col_ok, BLOCK_M)
        ptrs = X + rows64 * stride_m + cols[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - shift[None, :], 0.0)
        s1 += d
        s2 += d * d
        r0 += BLOCK_M
    n = (end - start).to(tl.float32)
    sum1 = tl.sum(s1, axis=0)
    mean = shift + sum1 / n
    m2 = tl.maximum(tl.sum(s2, axis=0) - sum1 * sum1 / n, 0.0)
    base = Partial + tl.program_id(1) * 3 * C
    tl.store(base + cols, mean, mask=col_ok)
    tl.store(base + C + cols, m2, mask=col_ok)
    tl.store(base + 2 * C + cols, tl.zeros([BLOCK_C], dtype=tl.float32) + n, mask=col_ok)


@triton.jit
def bn_finalize_stats_kernel(
    Partial,  # [S, 3, C] fp32 from bn_partial_stats_kernel
    Row,  # [2C + 1] fp32 out: mean (C), invstd (C), this rank's row count
    S,
    C,
    count,
    eps,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Two passes over the splits, each a [BLOCK_S, BLOCK_C] tile at a time: the count-weighted
    # mean, then the centred sum of squares sum_s(m2_s + n_s * (mean_s - mean)^2).
    cols, col_ok = _channel_block(C, BLOCK_C)
    n = tl.zeros([BLOCK_C], dtype=tl.float32)
    weighted = tl.zeros([BLOCK_C], dtype=tl.float32)
    s0 = 0
    while s0 < S:
        splits, mask = _row_tile(s0, S, col_ok, BLOCK_S)  # a tile of the partials' rows
        base = Partial + splits * (3 * C) + cols[None, :]
        p_mean = tl.load(base, mask=mask, other=0.0)
        p_n = tl.load(base + 2 * C, mask=mask, other=0.0)
        n += tl.sum(p_n, axis=0)
        weighted += tl.sum(p_n * p_mean, axis=0)
        s0 += BLOCK_S
    n_safe = tl.where(n > 0, n, 1.0)
    mean = weighted / n_safe
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    s0 = 0
    while s0 < S:
        splits, mask = _row_tile(s0, S, col_ok, BLOCK_S)  # a tile of the partials' rows
        base = Partial + splits * (3 * C) + cols[None, :]
        p_mean = tl.load(base, mask=mask, other=0.0)
        p_m2 = tl.load(base + C, mask=mask, other=0.0)
        p_n = tl.load(base + 2 * C, mask=mask, other=0.0)
        delta = p_mean - mean[None, :]
        m2 += tl.sum(p_m2 + p_n * delta * delta, axis=0)
        s0 += BLOCK_S
    var = m2 / n_safe  # biased, as the batch statistics of BatchNorm
    invstd = 1.0 / tl.sqrt(var + eps)
    tl.store(Row + cols, mean, mask=col_ok)
    tl.store(Row + C + cols, invstd, mask=col_ok)
    if tl.program_id(0) == 0:
        tl.store(Row + 2 * C, count)


@triton.jit(do_not_specialize=["M", "rows_per_split"])
def bn_partial_backward_kernel(
    DY,  # [M, C] output gradient, unit column stride
    X,  # [M, C] input, unit column stride
    Row,  # [2C + 1] fp32: the global [mean, invstd, count] row (the mean read)
    Partial,  # [S, 2, C] fp32: per split, sum(dy) and sum(dy * (x - mean))
    M,
    C,
    stride_dy_m,
    stride_x_m,
    rows_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    cols, col_ok = _channel_block(C, BLOCK_C)
    mean = tl.load(Row + cols, mask=col_ok, other=0.0)
    start, end = _split_rows(M, rows_per_split)
    acc_dy = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    acc_dy_xmu = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    r0 = start
    while r0 < end:
        rows64, mask = _row_tile(r0, end, col_ok, BLOCK_M)
        dy = tl.load(DY + rows64 * stride_dy_m + cols[None, :], mask=mask, other=0.0)
        x = tl.load(X + rows64 * stride_x_m + cols[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        xmu = tl.where(mask, x.to(tl.float32) - mean[None, :], 0.0)
        acc_dy += dy
        acc_dy_xmu += dy * xmu
        r0 += BLOCK_M
    sum_dy = tl.sum(acc_dy, axis=0)
    sum_dy_xmu = tl.sum(acc_dy_xmu, axis=0)
    base = Partial + tl.program_id(1) * 2 * C
    tl.store(base + cols, sum_dy, mask=col_ok)
    tl.store(base + C + cols, sum_dy_xmu, mask=col_ok)


@triton.jit
def bn_finalize_backward_kernel(
    Partial,  # [S, 2, C] fp32 from bn_partial_backward_kernel
    Row,  # [2C + 1] fp32: the global [mean, invstd, count] row (invstd read at C)
    Sums,  # [2C] fp32 out: sum(dy), sum(dy * (x - mean)) over this rank's rows
    GradW,  # [C] out: sum(dy * x_hat), written when COMPUTE_DW
    GradB,  # [C] out: sum(dy), written when COMPUTE_DB (apart from Sums, which the
    #         collective then overwrites with the sum over ranks)
    S,
    C,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # GradW / GradB may be any float dtype (the parameters'): stores convert.
    cols, col_ok = _channel_block(C, BLOCK_C)
    sum_dy = tl.zeros([BLOCK_C], dtype=tl.float32)
    sum_dy_xmu = tl.zeros([BLOCK_C], dtype=tl.float32)
    s0 = 0
    while s0 < S:
        splits, mask = _row_tile(s0, S, col_ok, BLOCK_S)  # a tile of the partials' rows
        base = Partial + splits * (2 * C) + cols[None, :]
        sum_dy += tl.sum(tl.load(base, mask=mask, other=0.0), axis=0)
        sum_dy_xmu += tl.sum(tl.load(base + C, mask=mask, other=0.0), axis=0)
        s0 += BLOCK_S
    tl.store(Sums + cols, sum_dy, mask=col_ok)
    tl.store(Sums + C + cols, sum_dy_xmu, mask=col_ok)
    if COMPUTE_DW:
        invstd = tl.load(Row + C + cols, mask=col_ok, other=0.0)
        tl.store(GradW + cols, sum_dy_xmu * invstd, mask=col_ok)
    if COMPUTE_DB:
        tl.store(GradB + cols, sum_dy, mask=col_ok)


@triton.jit
def _merge_rank_stats(Rows, C, world, cols, col_ok, eps, BLOCK_C: tl.constexpr):
    # Count-weighted merge of the ranks' [mean (C), invstd (C), count] rows, each 2C + 1 long
    # (Chan's formula): mean = sum_r n_r mean_r / N, var = sum_r n_r (var_r + (mean_r - mean)^2)
    # / N, with var_r = 1 / invstd_r^2 - eps. Returns (mean, biased var, N), fp32. Two passes
    # over the ranks (a few loads each), in rank order: every rank computes the same bits.
    n = tl.zeros([BLOCK_C], dtype=tl.float32)
    weighted = tl.zeros([BLOCK_C], dtype=tl.float32)
    r = 0
    while r < world:  # (while: the CPU interpreter cannot take a runtime range() bound)
        base = Rows + r * (2 * C + 1)
        n_r = tl.load(base + 2 * C).to(tl.float32)
        n += n_r
        weighted += n_r * tl.load(base + cols, mask=col_ok, other=0.0).to(tl.float32)
        r += 1
    mean = weighted / n
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    r = 0
    while r < world:
        base = Rows + r * (2 * C + 1)
        n_r = tl.load(base + 2 * C).to(tl.float32)
        mean_r = tl.load(base + cols, mask=col_ok, other=0.0).to(tl.float32)
        invstd_r = tl.load(base + C + cols, mask=col_ok, other=1.0).to(tl.float32)
        delta = mean_r - mean
        m2 += n_r * (1.0 / (invstd_r * invstd_r) - eps + delta * delta)
        r += 1
    return mean, tl.maximum(m2 / n, 0.0), n


@triton.jit(do_not_specialize=["M", "rows_per_split"])
def bn_forward_elemt_kernel(
    X,  # [M, C] input, unit column stride
    Y,  # [M, C] output (the input's dtype), unit column stride
    Rows,  # [world, 2C + 1] fp32: every rank's [mean, invstd, count] (the all-gather's result;
    #        ONE_ROW: this process's own row, the statistics as they are)
    W,  # [C] weight (any float dtype), read when HAS_W
    B,  # [C] bias, read when HAS_B
    RunMean,  # [C] running mean, updated when HAS_RUNNING (any float dtype)
    RunVar,  # [C] running variance (unbiased), updated when HAS_RUNNING
    RowOut,  # [2C + 1] fp32 out: the global [mean, invstd, count] row, which the backward
    #          reads (not written when ONE_ROW: Rows is that row already)
    M,
    C,
    stride_x_m,
    stride_y_m,
    world,
    rows_per_split,
    momentum,
    eps,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_RUNNING: tl.constexpr,
    ONE_ROW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Every program merges the ranks' statistics for its channels (world x 3 loads of BLOCK_C
    # values: nothing next to its tiles), the first split of each channel block also writes
    # them out (the global row) and updates the running statistics; then y = x * scale + shift,
    # tile by tile. ONE_ROW (one process: FusedBatchNorm): the row's statistics are used as
    # they are, and the row itself is what the backward reads.
    cols, col_ok = _channel_block(C, BLOCK_C)
    if ONE_ROW:
        mean = tl.load(Rows + cols, mask=col_ok, other=0.0)
        invstd = tl.load(Rows + C + cols, mask=col_ok, other=1.0)
        n = tl.load(Rows + 2 * C)
        var = tl.maximum(1.0 / (invstd * invstd) - eps, 0.0)
    else:
        mean, var, n = _merge_rank_stats(Rows, C, world, cols, col_ok, eps, BLOCK_C)
        invstd = 1.0 / tl.sqrt(var + eps)
    if tl.program_id(1) == 0:  # the first split of each channel block
        if not ONE_ROW:
            tl.store(RowOut + cols, mean, mask=col_ok)
            tl.store(RowOut + C + cols, invstd, mask=col_ok)
            if tl.program_id(0) == 0:
                tl.store(RowOut + 2 * C, tl.max(n, axis=0))  # (every lane holds N)
        if HAS_RUNNING:
            unbiased = var * (n / (n - 1.0))
            rm = tl.load(RunMean + cols, mask=col_ok, other=0.0).to(tl.float32)
            rv = tl.load(RunVar + cols, mask=col_ok, other=0.0).to(tl.float32)
            rm = momentum * mean + (1.0 - momentum) * rm
            rv = momentum * unbiased + (1.0 - momentum) * rv
            tl.store(RunMean + cols, rm.to(RunMean.dtype.element_ty), mask=col_ok)
            tl.store(RunVar + cols, rv.to(RunVar.dtype.element_ty), mask=col_ok)
    scale = invstd
    if HAS_W:
        scale = scale * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    shift = -mean * scale
    if HAS_B:
        shift += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    start, end = _split_rows(M, rows_per_split)
    r0 = start
    while r0 < end:
        rows64, mask = _row_tile(r0, end, col_ok, BLOCK_M)
        x = tl.load(X + rows64 * stride_x_m + cols[None, :], mask=mask, other=0.0)
        y = x.to(tl.float32) * scale[None, :] + shift[None, :]
        tl.store(Y + rows64 * stride_y_m + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        r0 += BLOCK_M


@triton.jit(do_not_specialize=["M", "rows_per_split"])
def bn_backward_elemt_kernel(
    DY,  # [M, C] output gradient, unit column stride
    X,  # [M, C] input, unit column stride
    DX,  # [M, C] input gradient out (DY's dtype), unit column stride
    Row,  # [2C + 1] fp32: the global [mean, invstd, count] row
    W,  # [C] weight, read when HAS_W
    Sums,  # [2C] fp32: sum(dy), sum(dy * (x - mean)) over every rank (all-reduced)
    M,
    C,
    stride_dy_m,
    stride_x_m,
    stride_dx_m,
    rows_per_split,
    HAS_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # dx = (dy - sum_dy / N - (x - mean) * invstd^2 * sum_dy_xmu / N) * invstd * w
    #    = (dy - mean_dy) * k + (x - mean) * a, with per-channel k, a computed once per
    # program. The mean is taken off x first, as PyTorch does: folded into a constant
    # (x * a + b), x * a cancelled against mean * a, which lost the gradient's low bits in a
    # channel whose mean is large against its spread (7e-5 of it at mean/std 1e4 in fp32).
    cols, col_ok = _channel_block(C, BLOCK_C)
    n = tl.load(Row + 2 * C)
    mean = tl.load(Row + cols, mask=col_ok, other=0.0)
    invstd = tl.load(Row + C + cols, mask=col_ok, other=0.0)
    mean_dy = tl.load(Sums + cols, mask=col_ok, other=0.0) / n
    mean_dy_xmu = tl.load(Sums + C + cols, mask=col_ok, other=0.0) / n
    k = invstd
    if HAS_W:
        k = k * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    a = -k * invstd * invstd * mean_dy_xmu
    start, end = _split_rows(M, rows_per_split)
    r0 = start
    while r0 < end:
        rows64, mask = _row_tile(r0, end, col_ok, BLOCK_M)
        dy = tl.load(DY + rows64 * stride_dy_m + cols[None, :], mask=mask, other=0.0)
        x = tl.load(X + rows64 * stride_x_m + cols[None, :], mask=mask, other=0.0)
        dx = ((dy.to(tl.float32) - mean_dy[None, :]) * k[None, :]
              + (x.to(tl.float32) - mean[None, :]) * a[None, :])
        tl.store(DX + rows64 * stride_dx_m + cols[None, :], dx.to(DX.dtype.element_ty),
                 mask=mask)
        r0 += BLOCK_M
