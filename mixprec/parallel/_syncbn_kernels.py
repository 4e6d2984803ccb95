"""Triton kernels for SyncBatchNorm's per-rank reductions over a channels-last ``(M, C)`` view.

Imported lazily by :mod:`mixprec.parallel._syncbn_triton` (it imports :mod:`triton` at the top),
so ``import mixprec`` never needs Triton; ``TRITON_INTERPRET=1`` set before the first import
runs the kernels on CPU tensors (the tests do that when there is no GPU).

Layout: channels are contiguous (unit column stride), rows ``M = N * H * W`` have stride
``stride_m``. Every program owns a ``BLOCK_C``-wide slice of channels and a contiguous run of
rows (a *split*); it streams the rows in ``[BLOCK_M, BLOCK_C]`` tiles (coalesced along C) and
writes one partial result per channel. A second, small kernel merges the splits, a
``[BLOCK_S, BLOCK_C]`` tile at a time in a fixed order, so results are bitwise reproducible run
to run (no atomics).

Numerics: loads in the storage dtype, all arithmetic in fp32, accumulated element-wise in
registers and reduced across threads once per program. Each split's statistics come from sums
shifted by a sample of each channel, the splits are merged count-weighted around the global
mean (Chan's formula), so a large mean does not cancel the variance as ``E[x^2] - E[x]^2``
would.
"""

import triton
import triton.language as tl

__all__ = []


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
    pid_c = tl.program_id(0)
    pid_s = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    start = pid_s * rows_per_split
    end = tl.minimum(start + rows_per_split, M)
    shift = tl.load(X + start.to(tl.int64) * stride_m + cols, mask=col_ok, other=0.0)
    shift = shift.to(tl.float32)
    s1 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    r0 = start
    while r0 < end:  # (while: the CPU interpreter cannot take a runtime range() bound)
        rows = r0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & col_ok[None, :]
        ptrs = X + rows.to(tl.int64)[:, None] * stride_m + cols[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - shift[None, :], 0.0)
        s1 += d
        s2 += d * d
        r0 += BLOCK_M
    n = (end - start).to(tl.float32)
    sum1 = tl.sum(s1, axis=0)
    mean = shift + sum1 / n
    m2 = tl.maximum(tl.sum(s2, axis=0) - sum1 * sum1 / n, 0.0)
    base = Partial + pid_s * 3 * C
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
    pid = tl.program_id(0)
    cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    n = tl.zeros([BLOCK_C], dtype=tl.float32)
    weighted = tl.zeros([BLOCK_C], dtype=tl.float32)
    s0 = 0
    while s0 < S:
        splits = s0 + tl.arange(0, BLOCK_S)
        mask = (splits < S)[:, None] & col_ok[None, :]
        base = Partial + splits[:, None] * (3 * C) + cols[None, :]
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
        splits = s0 + tl.arange(0, BLOCK_S)
        mask = (splits < S)[:, None] & col_ok[None, :]
        base = Partial + splits[:, None] * (3 * C) + cols[None, :]
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
    if pid == 0:
        tl.store(Row + 2 * C, count)


@triton.jit(do_not_specialize=["M", "rows_per_split"])
def bn_partial_backward_kernel(
    DY,  # [M, C] output gradient, unit column stride
    X,  # [M, C] input, unit column stride
    Mean,  # [C] fp32 global mean
    Partial,  # [S, 2, C] fp32: per split, sum(dy) and sum(dy * (x - mean))
    M,
    C,
    stride_dy_m,
    stride_x_m,
    rows_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_s = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    mean = tl.load(Mean + cols, mask=col_ok, other=0.0)
    start = pid_s * rows_per_split
    end = tl.minimum(start + rows_per_split, M)
    acc_dy = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    acc_dy_xmu = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    r0 = start
    while r0 < end:
        rows = r0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        dy = tl.load(DY + rows64 * stride_dy_m + cols[None, :], mask=mask, other=0.0)
        x = tl.load(X + rows64 * stride_x_m + cols[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        xmu = tl.where(mask, x.to(tl.float32) - mean[None, :], 0.0)
        acc_dy += dy
        acc_dy_xmu += dy * xmu
        r0 += BLOCK_M
    sum_dy = tl.sum(acc_dy, axis=0)
    sum_dy_xmu = tl.sum(acc_dy_xmu, axis=0)
    base = Partial + pid_s * 2 * C
    tl.store(base + cols, sum_dy, mask=col_ok)
    tl.store(base + C + cols, sum_dy_xmu, mask=col_ok)


@triton.jit
def bn_finalize_backward_kernel(
    Partial,  # [S, 2, C] fp32 from bn_partial_backward_kernel
    Invstd,  # [C] fp32
    Sums,  # [2C] fp32 out: sum(dy), sum(dy * (x - mean)) over this rank's rows
    GradW,  # [C] fp32 out: sum(dy * x_hat), written when COMPUTE_DW
    GradB,  # [C] fp32 out: sum(dy), written when COMPUTE_DB (apart from Sums, which the
    #         collective then overwrites with the sum over ranks)
    S,
    C,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    sum_dy = tl.zeros([BLOCK_C], dtype=tl.float32)
    sum_dy_xmu = tl.zeros([BLOCK_C], dtype=tl.float32)
    s0 = 0
    while s0 < S:
        splits = s0 + tl.arange(0, BLOCK_S)
        mask = (splits < S)[:, None] & col_ok[None, :]
        base = Partial + splits[:, None] * (2 * C) + cols[None, :]
        sum_dy += tl.sum(tl.load(base, mask=mask, other=0.0), axis=0)
        sum_dy_xmu += tl.sum(tl.load(base + C, mask=mask, other=0.0), axis=0)
        s0 += BLOCK_S
    tl.store(Sums + cols, sum_dy, mask=col_ok)
    tl.store(Sums + C + cols, sum_dy_xmu, mask=col_ok)
    if COMPUTE_DW:
        invstd = tl.load(Invstd + cols, mask=col_ok, other=0.0)
        tl.store(GradW + cols, sum_dy_xmu * invstd, mask=col_ok)
    if COMPUTE_DB:
        tl.store(GradB + cols, sum_dy, mask=col_ok)
