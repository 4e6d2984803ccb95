"""One-pass cast + unscale + inf/NaN check of half gradients into fp32 master gradients.

At O2 the model holds fp16/bf16 parameters and the optimizer fp32 master copies. Every step
the half gradients must become fp32 master gradients divided by the loss scale, with a flag
raised when any of them holds an inf or NaN (the step is then skipped). PyTorch does that in
two multi-tensor passes::

    torch._foreach_copy_(fp32, half)                                  # read 2 B, write 4 B
    torch._amp_foreach_non_finite_check_and_unscale_(fp32, found, inv)  # read 4 B, write 4 B

14 bytes of memory traffic per gradient element. :func:`cast_unscale_check_` does all three
in one Triton launch over every tensor: it reads the half value (2 B) and writes the fp32
result (4 B), 6 bytes per element, for any mix of fp16 and bf16 sources.

Contract (see :func:`usable` and :func:`cast_unscale_check_`): ``dsts[i] = float(srcs[i]) *
inv_scale``, cast first, then multiplied in fp32 (a small half gradient must not underflow
before it is unscaled), bitwise equal to ``srcs[i].float() * inv_scale`` computed by PyTorch;
``found_inf`` set to 1.0 when a source holds an inf or NaN and left untouched otherwise.
Nothing here reads device memory from the host: no synchronization, and a call can be
captured in a CUDA graph.

How the kernel finds the tensors: a table of int64 rows ``(src address, dst address, element
count, 1 if bf16)``, one row per *chunk* of at most ``chunk`` elements of one tensor, built on
the host with NumPy into pinned memory and cached there by the addresses, sizes and dtypes it
was built from (the same gradients come back from PyTorch's caching allocator at the same
addresses step after step, so the steady state builds nothing). Each call copies its table to
a fresh device tensor without blocking (32 bytes per chunk, a few microseconds) that is freed
when the launch is queued: the cache holds no device memory, so it adds nothing to a training
step's peak (cached device tables cost ResNet-50's O2 step 0.2 MiB of peak memory over
autocast's). A table used in a CUDA graph capture stays on the device for good: the graph
reads it by address. Each Triton program turns its row's addresses into pointers (``int64 ->
pointer`` casts, which Triton's CPU interpreter supports too) and streams its chunk.
fp16 and bf16 share one launch: the kernel loads the raw 16 bits and decodes them by the row's
dtype flag (bf16 is the top half of an fp32, fp16 is converted), so a mixed list costs no second
launch and no grouping on the host.

The kernels are created on first use (``import mixprec`` needs no Triton);
``TRITON_INTERPRET=1`` set before that runs them on CPU tensors, which is how CI tests them.
"""

import functools
import importlib.util
import logging
from operator import attrgetter
from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from mixprec.normalization._launch import (
    _on_device,
    interpreter_enabled,
    triton_available,
    triton_version,
)

__all__ = ["cast_unscale_check_", "unusable_reason", "usable"]

_log = logging.getLogger(__name__)

_SRC_DTYPES = (torch.float16, torch.bfloat16)

# Elements per program (one table row) and per loop step inside it, on a GPU. Measured on an
# H200 over 194 tensors / 153M elements (fp16 -> fp32): 241 us = 3.8 TB/s of the 6 B/element,
# 2.7x faster than the two foreach passes and 1.2x faster than `torch._foreach_copy_` alone.
# Chunks of 8K-32K, blocks of 1K-4K and 4 or 8 warps all land within 3% of each other; larger
# chunks mean a smaller table (32 B per chunk) to build and upload on a cache miss.
_CHUNK = 16384
_BLOCK = 2048
_NUM_WARPS = 4
# The interpreter: small chunks and blocks, so that the tests' small tensors still span several
# chunks and several loop steps per chunk.
_INTERPRETER_CHUNK = 1024
_INTERPRETER_BLOCK = 256

# Host tables kept for reuse, oldest evicted first once there are more than _MAX_TABLES. A
# table used while a CUDA graph was being captured is never evicted (its key joins
# _GRAPH_KEYS), and the device copies uploaded in captures stay in _GRAPH_ROWS: each graph's
# replays refill its copy from the pinned buffer and read it, both by address.
_MAX_TABLES = 16
_TABLES: Dict[tuple, "_Table"] = {}
_GRAPH_KEYS: Set[tuple] = set()
_GRAPH_ROWS: Dict[tuple, List[Tensor]] = {}

_dtype_of = attrgetter("dtype")

# triton.language, bound by _kernel() on first use. The kernel is defined inside _kernel() so
# that importing this module needs no Triton, and it reaches `tl` as a module global because
# Triton before 3.4 resolves a kernel's names in its globals only, not in closures.
tl = None


class _Table(NamedTuple):
    host: Tensor  # [n_chunks, 4] int64 on the host (pinned when the tensors are on a GPU)
    n_chunks: int
    aligned: bool  # every address is a multiple of 16 bytes (vector loads and stores)


@functools.cache
def _kernel():
    global tl
    import triton
    import triton.language as language

    tl = language

    @triton.jit
    def cast_unscale_check_kernel(
        Table,  # [n_chunks, 4] int64: src address, dst address, count (<= chunk), 1 if bf16
        InvScale,  # [] fp32: 1 / loss scale
        FoundInf,  # [] fp32: set to 1.0 when this chunk holds an inf or NaN, else untouched
        ALIGNED: tl.constexpr,  # every address in Table is a multiple of 16 bytes
        BLOCK: tl.constexpr,
    ):
        row = Table + tl.program_id(0).to(tl.int64) * 4
        # Raw 16-bit patterns: fp16 and bf16 sources share this kernel, decoded below.
        src = tl.load(row).to(tl.pointer_type(tl.uint16))
        dst = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            # Addresses cast from integers carry no alignment; without this hint every
            # element is its own 2-byte load instead of 16-byte vectors.
            src = tl.multiple_of(src, 16)
            dst = tl.multiple_of(dst, 16)
        count = tl.load(row + 2).to(tl.int32)
        is_bf16 = tl.load(row + 3) != 0
        inv_scale = tl.load(InvScale)
        # inf and NaN are the patterns whose exponent bits are all ones (8 bits in bf16,
        # 5 in fp16): an integer test, immune to any fast-math treatment of NaN compares.
        exponent = tl.where(is_bf16, 0x7F80, 0x7C00).to(tl.uint32)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        i = 0
        while i * BLOCK < count:  # (while: the CPU interpreter cannot take a runtime range())
            offs = i * BLOCK + tl.arange(0, BLOCK)
            # Full blocks load and store unmasked: a mask compared against a count read from
            # memory has no known alignment and would split the vectors into single elements.
            full = (i + 1) * BLOCK <= count
            if full:
                bits = tl.load(src + offs)
            else:
                bits = tl.load(src + offs, mask=offs < count, other=0)  # 0: finite
            wide = bits.to(tl.uint32)
            # Decode in fp32: bf16 is the top half of an fp32; fp16 converts exactly. Then one
            # fp32 multiply, so the result is the correctly rounded product, as PyTorch's.
            as_bf16 = (wide << 16).to(tl.float32, bitcast=True)
            as_fp16 = bits.to(tl.float16, bitcast=True).to(tl.float32)
            y = tl.where(is_bf16, as_bf16, as_fp16) * inv_scale
            bad = tl.maximum(bad, ((wide & exponent) == exponent).to(tl.int32))
            if full:
                tl.store(dst + offs, y)
            else:
                tl.store(dst + offs, y, mask=offs < count)
            i += 1
        # Every writer stores the same 1.0, so concurrent stores from several chunks are benign;
        # no chunk ever writes 0, so a flag already set stays set.
        tl.store(FoundInf, 1.0, mask=tl.max(bad, axis=0) > 0)

    return cast_unscale_check_kernel


def _first(items, predicate) -> int:
    return next(i for i, item in enumerate(items) if predicate(item))


def _inspect(srcs: Sequence[Tensor], dsts: Sequence[Tensor], check: bool
             ) -> Tuple[Optional[str], List[int], List[torch.dtype]]:
    """``(reason, numels, src_dtypes)``: why the lists are refused (None when they are not,
    or when ``check`` is False and only the last two are gathered), and what the launch
    needs of them anyway, so that a checked call reads each attribute once."""
    numel = Tensor.numel
    n = len(srcs)
    if n != len(dsts):
        return f"got {n} srcs and {len(dsts)} dsts; pass lists of the same length", [], []
    if n == 0:
        return "got empty lists; pass at least one (src, dst) pair", [], []
    numels = list(map(numel, srcs))
    src_dtypes = list(map(_dtype_of, srcs))
    if not check:
        return None, numels, src_dtypes
    if not triton_available():
        return "Triton is not installed (or failed to import)", numels, src_dtypes
    # Each test maps one attribute over a whole list (C-level loops, ~0.1 us per tensor);
    # only a failed test walks the list again to name the first offender.
    reason = None
    if not set(src_dtypes) <= set(_SRC_DTYPES):
        i = _first(srcs, lambda t: t.dtype not in _SRC_DTYPES)
        reason = f"srcs[{i}] is {srcs[i].dtype}; srcs must be torch.float16 or torch.bfloat16"
    elif set(map(_dtype_of, dsts)) != {torch.float32}:
        i = _first(dsts, lambda t: t.dtype != torch.float32)
        reason = f"dsts[{i}] is {dsts[i].dtype}; dsts must be torch.float32"
    elif numels != list(map(numel, dsts)):
        i = _first(range(n), lambda j: numels[j] != dsts[j].numel())
        reason = (f"srcs[{i}] has {numels[i]} elements and dsts[{i}] {dsts[i].numel()}; "
                  f"each pair must have the same number of elements")
    else:
        reason = _layout_reason(srcs, dsts)
    return reason, numels, src_dtypes


def _layout_reason(srcs: Sequence[Tensor], dsts: Sequence[Tensor]) -> Optional[str]:
    contiguous = Tensor.is_contiguous
    for name, ts in (("srcs", srcs), ("dsts", dsts)):
        if not all(map(contiguous, ts)):
            i = _first(ts, lambda t: not t.is_contiguous())
            return (f"{name}[{i}] is not contiguous (shape {tuple(ts[i].shape)}, strides "
                    f"{ts[i].stride()}); pass contiguous tensors")
    # Whole devices, not get_device()'s indices: those are -1 for CPU and meta tensors alike
    # (and 0 for cuda:0 and any other backend's device 0), so a CPU src with a meta dst passed
    # and the kernel wrote through the meta tensor's null data_ptr (a segfault).
    device_of = attrgetter("device")
    devices = set(map(device_of, srcs)) | set(map(device_of, dsts))
    if len(devices) != 1:
        return (f"the tensors span several devices ({sorted(map(str, devices))}); pass one "
                f"device's")
    first = srcs[0]
    if interpreter_enabled():
        if first.device.type != "cpu":
            return (f"TRITON_INTERPRET=1 runs Triton on CPU tensors only, got {first.device} "
                    f"tensors")
    elif not first.is_cuda:
        return (f"got {first.device} tensors; the kernel needs CUDA tensors (CPU tensors only "
                f"with TRITON_INTERPRET=1, for tests)")
    if not _numpy_available():
        return "NumPy is not installed (the pointer table is built with it)"
    return None


def verified_triton() -> bool:
    """Whether the installed Triton is one this kernel was verified with (3.6 and later: the
    GPU machine's and CI's). Callers take PyTorch's passes on older releases."""
    version = triton_version()
    return version is not None and version >= (3, 6)


@functools.cache
def _numpy_available() -> bool:
    return importlib.util.find_spec("numpy") is not None


def unusable_reason(srcs: Sequence[Tensor], dsts: Sequence[Tensor]) -> Optional[str]:
    """Why :func:`cast_unscale_check_` cannot take these lists, or None when it can.

    The reason names the first offending tensor, e.g. ``"srcs[3] is not contiguous ..."``, for
    a log line or an error message; :func:`usable` is ``unusable_reason(...) is None``.
    """
    return _inspect(srcs, dsts, check=True)[0]


def usable(srcs: Sequence[Tensor], dsts: Sequence[Tensor]) -> bool:
    """Whether :func:`cast_unscale_check_` can take ``srcs`` and ``dsts``.

    True when Triton imports and: ``len(srcs) == len(dsts) > 0``; every src is fp16 or bf16
    (mixed is fine) and every dst fp32; ``srcs[i].numel() == dsts[i].numel()``; all are
    contiguous; all sit on one CUDA device (or on the CPU with ``TRITON_INTERPRET=1``, for
    tests). When False, the reason is logged at DEBUG level; :func:`unusable_reason` returns it.

    Args:
        srcs (sequence of Tensor): half-precision gradients.
        dsts (sequence of Tensor): fp32 tensors to receive them.

    Returns:
        bool

    Example::

        >>> if usable(half_grads, fp32_grads):
        ...     cast_unscale_check_(half_grads, fp32_grads, inv_scale, found_inf)
        ... else:
        ...     torch._foreach_copy_(fp32_grads, half_grads)
        ...     torch._amp_foreach_non_finite_check_and_unscale_(fp32_grads, found_inf, inv_scale)
    """
    reason = unusable_reason(srcs, dsts)
    if reason is not None:
        _log.debug("fused cast + unscale not used: %s", reason)
        return False
    return True


def _check_scalar(t, name: str, device: torch.device) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"cast_unscale_check_: {name} must be a one-element float32 tensor "
                        f"on {device}, got {type(t).__name__}")
    if t.dtype != torch.float32 or t.numel() != 1 or t.device != device:
        raise ValueError(f"cast_unscale_check_: {name} must be a one-element float32 tensor "
                         f"on {device}, got {t.dtype} of shape {tuple(t.shape)} on {t.device}")


def chunk_rows(numels: Sequence[int], chunk: int):
    """Split tensors of ``numels`` elements into chunks of at most ``chunk``: NumPy arrays
    ``(owner, start, count)`` with one entry per chunk (the tensor's index, the chunk's first
    element, its element count). Empty tensors get no chunk."""
    import numpy as np

    n = np.asarray(numels, dtype=np.int64)
    per_tensor = (n + (chunk - 1)) // chunk  # 0 for an empty tensor: no rows, skipped
    total = int(per_tensor.sum())
    owner = np.repeat(np.arange(len(numels)), per_tensor)
    first_row = np.cumsum(per_tensor) - per_tensor
    start = (np.arange(total, dtype=np.int64) - first_row[owner]) * chunk  # element offset
    return owner, start, np.minimum(n[owner] - start, chunk)


def _build_rows(src_ptrs: List[int], dst_ptrs: List[int], numels: List[int],
                src_dtypes: List[torch.dtype], chunk: int):
    """The table's rows as a NumPy ``[n_chunks, 4]`` int64 array; empty tensors get none."""
    import numpy as np

    owner, start, count = chunk_rows(numels, chunk)
    rows = np.empty((len(owner), 4), dtype=np.int64)
    rows[:, 0] = np.asarray(src_ptrs, dtype=np.int64)[owner] + 2 * start
    rows[:, 1] = np.asarray(dst_ptrs, dtype=np.int64)[owner] + 4 * start
    rows[:, 2] = count
    bf16 = np.asarray([dtype is torch.bfloat16 for dtype in src_dtypes], dtype=np.int64)
    rows[:, 3] = bf16[owner]
    return rows


def cached_table(key: tuple, build, device: torch.device, pointer_columns: Sequence[int]
                 ) -> _Table:
    """The cached host table for ``key``; on a miss ``build()`` makes its rows, a NumPy
    ``[n_chunks, k]`` int64 array whose ``pointer_columns`` hold addresses (checked for 16-byte
    alignment). Shared by every multi-tensor kernel of mixprec: the key must name the kernel."""
    entry = _TABLES.get(key)  # (one lookup: hashing the key costs ~5 us at 200 tensors)
    if entry is None:
        rows = build()
        # Chunk starts are multiples of 8 elements, so a 16-byte aligned tensor has 16-byte
        # aligned chunks.
        aligned = True
        if len(rows):
            addresses = rows[:, list(pointer_columns)]
            aligned = not bool((addresses & 15).any())
        host = torch.from_numpy(rows)
        if device.type == "cuda":
            host = host.pin_memory()  # never written again: uploads need no host sync
        entry = _Table(host, len(rows), aligned)
        _TABLES[key] = entry
        evictable = [k for k in _TABLES if k not in _GRAPH_KEYS]  # oldest first
        for old in evictable[:max(0, len(evictable) - _MAX_TABLES)]:
            del _TABLES[old]
    return entry


def device_rows(key: tuple, table: _Table, device: torch.device, capturing: bool) -> Tensor:
    """``table``'s rows where the kernel reads them: on the device for a GPU launch.

    A fresh device tensor, uploaded on the current stream from the pinned host table. Eagerly
    it is released once the launch is queued (the caching allocator orders its reuse after the
    kernel on that stream). Under graph capture the upload is a node of the graph, run by each
    replay before the kernel, and the device copy is kept for good: the replays read it.
    Captured rows are never handed to an eager launch: their memory holds the table only once
    a replay has run (an eager step between the capture and the first replay read garbage
    addresses: an illegal memory access).
    """
    if device.type != "cuda":
        return table.host
    rows = table.host.to(device, non_blocking=True)
    if capturing:
        _GRAPH_KEYS.add(key)  # (the pinned source of the captured upload is never evicted)
        _GRAPH_ROWS.setdefault(key, []).append(rows)
    return rows


def cast_unscale_check_(srcs: Sequence[Tensor], dsts: Sequence[Tensor], inv_scale: Tensor,
                        found_inf: Tensor, *, check: bool = True) -> None:
    """``dsts[i].copy_(srcs[i].float() * inv_scale)`` for every ``i``, flagging inf/NaN.

    One Triton launch over all tensors, reading each source once and writing each destination
    once. The product is computed in fp32 after the cast, so small half values do not
    underflow, and it is bitwise equal to PyTorch's ``srcs[i].float() * inv_scale``. Empty
    tensors are skipped. Does not synchronize with the device and does not read device memory
    from the host, so it can be captured in a CUDA graph (run it once eagerly on the same
    tensors first, as graph capture recipes do, and its host table is reused).

    Writes go through raw pointers: autograd does not see them (call under ``torch.no_grad()``
    on tensors that need no version-counter tracking) and ``dsts`` must not overlap ``srcs``
    or each other.

    Args:
        srcs (sequence of Tensor): fp16 and/or bf16 gradients, read only.
        dsts (sequence of Tensor): fp32 tensors of the same sizes, overwritten.
        inv_scale (Tensor): one-element fp32 tensor (0-dim, or of shape ``(1,)`` as
            PyTorch's unscale also takes) on the tensors' device, ``1 / loss_scale``; read on
            the device.
        found_inf (Tensor): one-element fp32 tensor on the device; set to 1.0 when any source
            element is inf or NaN, else left as it was.
        check (bool): validate the lists as :func:`usable` does. Default ``True``. Pass
            ``False`` only right after :func:`usable` returned True for the same lists: the
            validation costs about 0.5 us of host time per (src, dst) pair, and a tensor that
            fails it (wrong dtype, size, device, non-contiguous) is written out of bounds.

    Raises:
        ValueError, TypeError: when :func:`usable` would say False (the message says why) or
            ``inv_scale`` / ``found_inf`` are not one-element fp32 tensors on the device.

    Example::

        >>> found_inf = torch.zeros((), device="cuda")
        >>> inv_scale = torch.full((), 1.0 / 65536, device="cuda")
        >>> masters = [torch.empty_like(p.grad, dtype=torch.float32) for p in half_params]
        >>> cast_unscale_check_([p.grad for p in half_params], masters, inv_scale, found_inf)
        >>> if found_inf.item():  # the caller's one sync per step
        ...     skip_step()
    """
    reason, numels, src_dtypes = _inspect(srcs, dsts, check)
    if reason is not None:
        raise ValueError(f"cast_unscale_check_: {reason}")
    device = srcs[0].device
    _check_scalar(inv_scale, "inv_scale", device)
    _check_scalar(found_inf, "found_inf", device)

    data_ptr = Tensor.data_ptr
    src_ptrs = list(map(data_ptr, srcs))
    dst_ptrs = list(map(data_ptr, dsts))
    on_gpu = device.type == "cuda"
    chunk, block = (_CHUNK, _BLOCK) if on_gpu else (_INTERPRETER_CHUNK, _INTERPRETER_BLOCK)
    with _on_device(srcs[0]):
        capturing = on_gpu and torch.cuda.is_current_stream_capturing()
        key = ("cast", device, chunk, *src_ptrs, *dst_ptrs, *numels, *src_dtypes)
        table = cached_table(
            key, lambda: _build_rows(src_ptrs, dst_ptrs, numels, src_dtypes, chunk), device,
            (0, 1))
        if table.n_chunks == 0:
            return  # only empty tensors
        _kernel()[(table.n_chunks,)](
            device_rows(key, table, device, capturing), inv_scale, found_inf,
            ALIGNED=table.aligned, BLOCK=block, num_warps=_NUM_WARPS,
        )
