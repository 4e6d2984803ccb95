"""CPU stand-ins for PyTorch's CUDA-only fused batch-norm kernels, for testing the fused path.

SyncBatchNorm's CUDA path calls ``torch.batch_norm_stats`` & co., which have no CPU kernels. These
functions follow the CUDA kernels' documented maths and their argument contracts (the dtype
checks their tensor accessors make, the integer running count of the merge kernel, int32 counts
in ``batch_norm_backward_elemt``), so the CPU suite exercises the fused path's plumbing: the
packing, the empty-rank count, the channels-last (M, C) views, the ``out=`` output.
:func:`emulated_fused_path` swaps them in for a block.
"""

from __future__ import annotations

import contextlib

import torch

from mixprec.parallel import _sync_batchnorm_function as fn
from mixprec.parallel import _syncbn_triton

__all__ = ["emulated_fused_path"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dims(x: torch.Tensor):
    return tuple(d for d in range(x.dim()) if d != 1)


def _cshape(x: torch.Tensor):
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)


def _check(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if t.dtype != dtype:
        raise RuntimeError(f"expected scalar type {dtype} for {what} but found {t.dtype}")


def _dense(what: str, *tensors) -> None:
    """The contract SyncBatchNorm states for the fused kernels: per-channel vectors (weight,
    bias, running statistics) handed over contiguous. PyTorch's channels-last kernels read a
    strided weight as if it were contiguous; these stand-ins would read it right, and a lost
    ``.contiguous()`` go unseen on the CPU (r98E's M75, M76)."""
    for t in tensors:
        if t is not None and not t.is_contiguous():
            raise AssertionError(f"{what} handed to the fused kernel strided: {t.stride()}")


def stats(x, eps):
    acc = _acc(x.dtype)
    var, mean = torch.var_mean(x.to(acc), dim=_dims(x), correction=0)
    return mean, torch.rsqrt(var + eps)


def gather_stats(input, mean, invstd, running_mean, running_var, momentum, eps, counts):
    _dense("running statistics", running_mean, running_var)
    scalar = running_mean.dtype if running_mean is not None else input.dtype
    acc = _acc(scalar)
    _check(counts, scalar, "counts")
    _check(mean, acc, "mean")
    _check(invstd, acc, "invstd")
    world, channels = mean.shape
    avg = torch.zeros(channels, dtype=acc)
    var_n = torch.zeros(channels, dtype=acc)
    n = 0  # the kernel keeps an integer running count
    for j in range(world):
        count = counts[j].to(acc)
        m = mean[j]
        v = 1.0 / invstd[j]
        v = (v * v - eps) * count
        factor = 1.0 / (n + count)
        var_n = var_n + v + (avg - m) * (avg - m) * n * count * factor
        avg = n * factor * avg + count * factor * m
        n += int(count)
    out_invstd = torch.rsqrt(var_n / n + eps)
    if running_mean is not None:
        running_mean.copy_(momentum * avg + (1 - momentum) * running_mean.to(acc))
        unbiased = var_n / (n - 1)
        running_var.copy_(momentum * unbiased + (1 - momentum) * running_var.to(acc))
    return avg, out_invstd


def elemt(x, weight, bias, mean, invstd, eps, *, out=None):
    _dense("weight or bias", weight, bias)
    acc = _acc(x.dtype)
    cs = _cshape(x)
    y = (x.to(acc) - mean.view(cs)) * invstd.view(cs)
    if weight is not None:
        y = y * weight.to(acc).view(cs)
    if bias is not None:
        y = y + bias.to(acc).view(cs)
    y = y.to(x.dtype)
    if out is None:
        return y
    if out.shape != x.shape:
        raise RuntimeError(f"out has shape {tuple(out.shape)}, input {tuple(x.shape)}")
    return out.copy_(y)


def backward_reduce(grad_out, x, mean, invstd, weight, input_g, weight_g, bias_g):
    if grad_out.shape != x.shape:
        raise RuntimeError("grad_out and input shapes differ")
    _dense("weight", weight)
    acc = mean.dtype
    cs = _cshape(x)
    g = grad_out.to(acc)
    sum_dy = g.sum(_dims(x))
    sum_dy_xmu = (g * (x.to(acc) - mean.view(cs))).sum(_dims(x))
    w_dtype = weight.dtype if weight is not None else acc
    grad_weight = (sum_dy_xmu * invstd).to(w_dtype) if weight_g else None
    grad_bias = sum_dy.to(w_dtype) if bias_g else None
    return (sum_dy if input_g else None, sum_dy_xmu if input_g else None, grad_weight, grad_bias)


def backward_elemt(grad_out, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    _check(count, torch.int32, "count")
    _dense("weight", weight)
    acc = mean.dtype
    cs = _cshape(x)
    total = count.sum().to(acc)
    g = grad_out.to(acc)
    gi = (g - (sum_dy / total).view(cs)
          - (x.to(acc) - mean.view(cs)) * (invstd * invstd * sum_dy_xmu / total).view(cs))
    scale = invstd if weight is None else invstd * weight.to(acc)
    return (gi * scale.view(cs)).to(grad_out.dtype)


@contextlib.contextmanager
def emulated_fused_path(triton: bool = False):
    """Route CPU tensors through SyncBatchNorm's fused path, with the stand-ins above.

    ``triton=True``: channels-last inputs take mixprec's Triton reductions, run by Triton's
    interpreter (TRITON_INTERPRET=1 must be set before they are first used), as on a GPU.
    """
    saved_ops, saved_use = fn._OPS, fn._use_fused
    saved_cpu = _syncbn_triton._cpu_testing
    fn._OPS = fn._FusedOps(stats=stats, gather_stats=gather_stats, elemt=elemt,
                           backward_reduce=backward_reduce, backward_elemt=backward_elemt,
                           triton_channels_last=triton)
    fn._use_fused = lambda x: True
    _syncbn_triton._cpu_testing = triton
    try:
        yield
    finally:
        fn._OPS, fn._use_fused = saved_ops, saved_use
        _syncbn_triton._cpu_testing = saved_cpu
