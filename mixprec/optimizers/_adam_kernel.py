"""One Triton pass of Adam/AdamW over many fp32 tensors, optionally writing half copies.

At amp O2 the optimizer steps fp32 master weights and the half model must then receive their
values. With PyTorch's fused AdamW that is two passes: the step (read p, g, m, v; write p, m,
v: 28 bytes per element) and ``torch._foreach_copy_`` of the masters into the model (read 4,
write 2). :func:`adam_step_` does both in one (30 bytes), and streams at close to the copy
bandwidth (see ``benchmarks/probe_adamw_bandwidth.py``).

The update, per element, in fp32 (PyTorch's fused Adam's order of operations)::

    g = grad / grad_scale                                   (when a grad_scale is given)
    p = p - lr * weight_decay * p     if ADAM_W  else  g = g + weight_decay * p   (wd != 0)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
    copy = half(p)                                          (rounded to nearest even)

with ``bc1 = 1 - beta1 ** step``, ``bc2 = 1 - beta2 ** step`` (both 1 without bias
correction) and ``step`` each tensor's step count, read on the device (already incremented).
``lr`` is a float passed with the launch, or a one-element floating tensor on the parameters'
device that the kernel reads (as fp32, the float's rounding) when it runs: a replay of a
captured step then uses the tensor's value at the replay. When ``found_inf`` is non-zero
nothing is written. Nothing here reads device memory from the host, so a step can be captured
in a CUDA graph.

How the kernel finds the tensors: a table of int64 rows, one per chunk of at most ``chunk``
elements of one tensor (see :mod:`mixprec.amp._multi_tensor`, whose table cache it shares)::

    param, grad, exp_avg, exp_avg_sq address, copy address (0: none), step address,
    element count, 1 if the copy is bf16 (0: fp16)
"""

from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from mixprec.amp import _multi_tensor
from mixprec.normalization._launch import _on_device

__all__ = ["adam_step_", "kernel_reason"]

# Elements per table row and per loop step on a GPU. 16K-element chunks and 1K blocks with 4
# warps stream the GPT's 218M parameters at 3.9 TB/s on an H200, 0.95 of its eager copy
# bandwidth (benchmarks/probe_adamw_bandwidth.py; not tuned further).
_CHUNK = 16384
_BLOCK = 1024
_NUM_WARPS = 4
_INTERPRETER_CHUNK = 1024
_INTERPRETER_BLOCK = 256
_COLUMNS = 8
_POINTER_COLUMNS = (0, 1, 2, 3, 4)
_HALF = (torch.float16, torch.bfloat16)

tl = None  # triton.language, bound by _kernel() (see mixprec.amp._multi_tensor)


@functools.cache
def _kernel():
    global tl
    import triton
    import triton.language as language

    tl = language

    @triton.jit
    def adam_kernel(
        Table,  # [n_chunks, 8] int64: p, g, m, v (fp32), copy (fp16/bf16 or 0), step (fp32 []),
        #         count (<= chunk), 1 if the copy is bf16
        Lr,  # fp32 scalar, or (LR_IS_PTR) a pointer to the one-element lr tensor
        beta1, beta2, eps, weight_decay,  # fp32 scalars, the parameter group's
        one_minus_beta1, one_minus_beta2, log2_beta1, log2_beta2,  # computed in fp64 on the host
        GradScale,  # [] fp32: gradients are divided by it (HAS_GRAD_SCALE)
        FoundInf,  # [] fp32: nothing is written when it is non-zero (HAS_FOUND_INF)
        ADAM_W: tl.constexpr,  # decoupled weight decay (AdamW), else L2 added to the gradient
        BIAS_CORRECTION: tl.constexpr,
        HAS_GRAD_SCALE: tl.constexpr,
        HAS_FOUND_INF: tl.constexpr,
        LR_IS_PTR: tl.constexpr,  # Lr is a tensor, read here (a float lr: no load, as before)
        ALIGNED: tl.constexpr,  # every address in Table is a multiple of 16 bytes
        BLOCK: tl.constexpr,
    ):
        row = Table + tl.program_id(0).to(tl.int64) * 8
        p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        copy_address = tl.load(row + 4)
        # (A null copy address is never dereferenced: has_copy guards every store through it.)
        copy_ptr = copy_address.to(tl.pointer_type(tl.uint16))
        if ALIGNED:
            # Addresses cast from integers carry no alignment; without the hint every element
            # is its own load instead of 16-byte vectors.
            p_ptr = tl.multiple_of(p_ptr, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
            copy_ptr = tl.multiple_of(copy_ptr, 16)
        has_copy = copy_address != 0
        step = tl.load(tl.load(row + 5).to(tl.pointer_type(tl.float32)))
        count = tl.load(row + 6).to(tl.int32)
        copy_bf16 = tl.load(row + 7) != 0
        if HAS_FOUND_INF:
            count = tl.where(tl.load(FoundInf) != 0, 0, count)  # an overflowed step: no writes
        if BIAS_CORRECTION:
            # 1 - beta ** step as 1 - exp2(step * log2(beta)) in fp64: fp32's exp2 is an
            # approximation on the GPU, and 1 - 0.999 ** 1 would lose 4 digits to it.
            s64 = step.to(tl.float64)
            bc1 = (1.0 - tl.exp2(s64 * log2_beta1)).to(tl.float32)
            bc2_sqrt = tl.sqrt_rn((1.0 - tl.exp2(s64 * log2_beta2)).to(tl.float32))
        else:
            bc1 = 1.0
            bc2_sqrt = 1.0
        if LR_IS_PTR:
            # Rounded to fp32 as a float lr is when passed: both give the same update.
            lr = tl.load(Lr).to(tl.float32)
        else:
            lr = Lr
        step_size = tl.div_rn(lr, bc1)
        if HAS_GRAD_SCALE:
            grad_scale = tl.load(GradScale)
        i = 0
        while i * BLOCK < count:  # (while: the CPU interpreter cannot take a runtime range())
            offs = i * BLOCK + tl.arange(0, BLOCK)
            # Full blocks load and store unmasked: a mask against a count read from memory has
            # no known alignment and would split the vectors into single elements.
            full = (i + 1) * BLOCK <= count
            mask = offs < count  # (used by the partial block only)
            if full:
                p = tl.load(p_ptr + offs)
                g = tl.load(g_ptr + offs)
                m = tl.load(m_ptr + offs)
                v = tl.load(v_ptr + offs)
            else:
                p = tl.load(p_ptr + offs, mask=mask, other=0.0)
                g = tl.load(g_ptr + offs, mask=mask, other=0.0)
                m = tl.load(m_ptr + offs, mask=mask, other=0.0)
                v = tl.load(v_ptr + offs, mask=mask, other=0.0)
            # IEEE square roots and divisions (sqrt_rn, div_rn), as PyTorch's kernels compute:
            # Triton's defaults are the GPU's faster approximations.
            if HAS_GRAD_SCALE:
                g = tl.div_rn(g, grad_scale)
            # (Skipped at weight decay 0, as PyTorch's kernels do: 0 * inf is NaN, and an
            # infinite weight stays infinite in torch.optim.Adam/AdamW.)
            if weight_decay != 0.0:
                if ADAM_W:
                    p = p - lr * weight_decay * p
                else:
                    g = g + weight_decay * p
            # (1 - beta) comes from the host: in fp32, 1 - 0.999 is off by 1.3e-5 relative.
            m = beta1 * m + one_minus_beta1 * g
            v = beta2 * v + one_minus_beta2 * g * g
            p = p - tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
            # The half copy as raw 16 bits: one store path for fp16 and bf16 rows. bf16 is
            # rounded to nearest even with integer arithmetic (PyTorch's rule, NaN -> 0x7FC0),
            # which Triton's interpreter, unlike the GPU's conversion, would not give.
            wide = p.to(tl.uint32, bitcast=True)
            bf16 = ((wide + 0x7FFF + ((wide >> 16) & 1)) >> 16).to(tl.uint16)
            bf16 = tl.where((wide & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, bf16).to(tl.uint16)
            bits = tl.where(copy_bf16, bf16, p.to(tl.float16).to(tl.uint16, bitcast=True))
            if full:
                tl.store(p_ptr + offs, p)
                tl.store(m_ptr + offs, m)
                tl.store(v_ptr + offs, v)
                if has_copy:
                    tl.store(copy_ptr + offs, bits)
            else:
                tl.store(p_ptr + offs, p, mask=mask)
                tl.store(m_ptr + offs, m, mask=mask)
                tl.store(v_ptr + offs, v, mask=mask)
                if has_copy:
                    tl.store(copy_ptr + offs, bits, mask=mask)
            i += 1

    return adam_kernel


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else -math.inf


def _dense_like(t: Tensor, ref: Tensor) -> bool:
    return t.stride() == ref.stride() and t.shape == ref.shape


def kernel_reason(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor,
                  copy: Optional[Tensor]) -> Optional[str]:
    """Why the kernel cannot take this parameter, or None when it can: fp32 dense tensors of
    one layout on one device (a CUDA device, or the CPU under Triton's interpreter), a step
    tensor there, and a half copy of the same layout."""
    if p.dtype != torch.float32:
        return f"the parameter is {p.dtype}, the kernel steps fp32 parameters"
    if not (p.is_contiguous() or (p.dim() == 4 and p.is_contiguous(
            memory_format=torch.channels_last))):
        return f"the parameter is not dense (strides {p.stride()})"
    for name, t in (("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
        if t.dtype != torch.float32 or t.device != p.device or not _dense_like(t, p):
            return f"its {name} is not an fp32 tensor of the parameter's layout"
    if step.dtype != torch.float32 or step.device != p.device:
        return "its step count is not an fp32 tensor on the parameter's device"
    if copy is not None and (copy.dtype not in _HALF or copy.device != p.device
                             or not _dense_like(copy, p)):
        return "its half copy is not an fp16/bf16 tensor of the parameter's layout"
    return None


def _build_rows(columns: List[List[int]], numels: List[int], copy_bf16: List[int], chunk: int):
    import numpy as np

    owner, start, count = _multi_tensor.chunk_rows(numels, chunk)
    rows = np.zeros((len(owner), _COLUMNS), dtype=np.int64)
    for j in range(4):  # p, g, m, v: fp32
        rows[:, j] = np.asarray(columns[j], dtype=np.int64)[owner] + 4 * start
    copies = np.asarray(columns[4], dtype=np.int64)[owner]
    rows[:, 4] = np.where(copies != 0, copies + 2 * start, 0)
    rows[:, 5] = np.asarray(columns[5], dtype=np.int64)[owner]
    rows[:, 6] = count
    rows[:, 7] = np.asarray(copy_bf16, dtype=np.int64)[owner]
    return rows


def adam_step_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
               exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor],
               copies: Sequence[Optional[Tensor]], *, lr: Union[float, Tensor], beta1: float,
               beta2: float, eps: float, weight_decay: float, adam_w: bool,
               bias_correction: bool, grad_scale: Optional[Tensor] = None,
               found_inf: Optional[Tensor] = None) -> None:
    """One Adam/AdamW update of every parameter in one launch (see the module docs).

    Every tensor must pass :func:`kernel_reason` and all sit on one device; ``steps`` must
    already count this step; a tensor ``lr`` (one floating element) must be on that device
    too, and is read by the kernel. Writes go through raw pointers: call under
    ``torch.no_grad()``.
    """
    device = params[0].device
    lr_is_ptr = isinstance(lr, Tensor)
    if lr_is_ptr and (lr.device != device or lr.numel() != 1 or not lr.is_floating_point()):
        raise ValueError(f"adam_step_: a tensor lr must be one floating element on {device}, "
                         f"got {lr.dtype} of shape {tuple(lr.shape)} on {lr.device}")
    on_gpu = device.type == "cuda"
    chunk, block = (_CHUNK, _BLOCK) if on_gpu else (_INTERPRETER_CHUNK, _INTERPRETER_BLOCK)
    data_ptr = Tensor.data_ptr
    columns = [list(map(data_ptr, ts)) for ts in (params, grads, exp_avgs, exp_avg_sqs)]
    columns.append([0 if c is None else c.data_ptr() for c in copies])
    columns.append(list(map(data_ptr, steps)))
    numels = list(map(Tensor.numel, params))
    copy_bf16 = [int(c is not None and c.dtype is torch.bfloat16) for c in copies]
    with _on_device(params[0]):
        capturing = on_gpu and torch.cuda.is_current_stream_capturing()
        key = ("adam", device, chunk, *columns[0], *columns[1], *columns[2], *columns[3],
               *columns[4], *columns[5], *numels, *copy_bf16)
        table = _multi_tensor.cached_table(
            key, lambda: _build_rows(columns, numels, copy_bf16, chunk), device,
            _POINTER_COLUMNS)
        if table.n_chunks == 0:
            return
        rows = _multi_tensor.device_rows(key, table, device, capturing)
        _kernel()[(table.n_chunks,)](
            rows, lr if lr_is_ptr else float(lr), float(beta1), float(beta2), float(eps),
            float(weight_decay),
            1.0 - beta1, 1.0 - beta2, _log2(beta1), _log2(beta2),
            grad_scale if grad_scale is not None else rows,
            found_inf if found_inf is not None else rows,
            ADAM_W=bool(adam_w), BIAS_CORRECTION=bool(bias_correction),
            HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
            LR_IS_PTR=lr_is_ptr, ALIGNED=table.aligned, BLOCK=block, num_warps=_NUM_WARPS,
        )
