"""Small ``torch.distributed`` helpers shared by the parallel tools.

Everything here goes through ``torch.distributed``: NCCL for CUDA tensors, gloo for CPU ones.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mixprec.amp._properties import _HALF_TYPES

__all__ = [
    "ReduceSpec",
    "all_gather_rows",
    "any_rank",
    "all_reduce_average_coalesced",
    "all_reduce_sum",
    "backend_of",
    "broadcast_coalesced",
    "group_world_size",
    "is_distributed",
    "require_initialized",
]

# ``all_gather_into_tensor`` was renamed ``all_gather_single`` (the old name warns on new
# torch); use whichever this torch has.
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)

_INIT_HINT = (
    "Launch the script with torchrun (which sets RANK, WORLD_SIZE, MASTER_ADDR and "
    "MASTER_PORT) and call torch.distributed.init_process_group(backend='nccl' on GPUs or "
    "'gloo' on CPUs, timeout=datetime.timedelta(minutes=5)) first."
)


@dataclasses.dataclass(frozen=True)
class ReduceSpec:
    """How DistributedDataParallel all-reduces gradients with Apex's arithmetic, fixed at
    construction: over ``process_group``, divided by ``predivide`` before the sum and by
    ``postdivide`` after it, half tensors summed in fp32 when ``always_fp32``; ``prof``
    labels the all-reduces in profiler traces."""

    process_group: Optional[dist.ProcessGroup]
    predivide: float
    postdivide: float
    always_fp32: bool
    prof: bool

    def summand(self, buffer: torch.Tensor) -> torch.Tensor:
        """What to all-reduce for ``buffer``: ``buffer`` itself, or its fp32 copy (half with
        ``always_fp32``), divided by ``predivide`` in place."""
        work = buffer.float() if self.always_fp32 and buffer.dtype in _HALF_TYPES else buffer
        if self.predivide != 1.0:
            work.div_(self.predivide)
        return work


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def require_initialized(what: str) -> None:
    """Raise a RuntimeError naming ``what`` when there is no default process group."""
    if not dist.is_available():
        raise RuntimeError(
            f"{what} needs torch.distributed, which this PyTorch build does not include."
        )
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} was used before torch.distributed.init_process_group(). {_INIT_HINT}"
        )


def _non_member(group) -> bool:
    """Whether ``group`` is what ``torch.distributed.new_group`` returns on a rank outside it
    (an int sentinel)."""
    member = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    return member is not None and type(group) is type(member) and group == member


def check_process_group(where: str, group) -> None:
    """Raise a TypeError naming ``where`` when ``group`` is a number or a string: a group
    size or a backend name where the group goes. (Anything else passes, as torch.distributed
    takes it: a ProcessGroup, or a stand-in for one.)"""
    if not isinstance(group, (numbers.Number, str, bytes)) or _non_member(group):
        return  # (torch.distributed.new_group's answer on a rank outside it: refused where used)
    hint = (" (a group size? create_syncbn_process_group(group_size) returns the group)"
            if isinstance(group, numbers.Integral) and not isinstance(group, bool) else "")
    raise TypeError(
        f"{where}(process_group={group!r}): expected None (all ranks) or a "
        f"torch.distributed ProcessGroup{hint}; got a {type(group).__name__}. Pass e.g. "
        "torch.distributed.new_group(ranks)."
    )


def group_world_size(group) -> int:
    """World size of ``group`` (None: the default group); RuntimeError if this rank is not in it."""
    size = dist.get_world_size(group)
    if size < 1:
        raise RuntimeError(
            f"This rank ({dist.get_rank()}) is not a member of the process group it was given. "
            "Pass a group this rank belongs to (torch.distributed.new_group(ranks) with this "
            "rank among the ranks, or create_syncbn_process_group's group for it)."
        )
    return size


def backend_of(group) -> str:
    """The backend name (``"nccl"``, ``"gloo"``, ...) of ``group`` (None: the default group)."""
    return str(dist.get_backend(group)).lower()


def all_gather_rows(row: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """All-gather a 1-D tensor from every rank into a ``(world_size, len(row))`` tensor.

    NCCL gets one flat all-gather straight into the output. Other backends get the list form,
    through host memory for CUDA tensors (gloo cannot all-gather CUDA tensors), which is slow
    but lets two processes share one GPU, as the single-GPU tests do.
    """
    backend = backend_of(group)
    if backend == "nccl" and _ALL_GATHER_FLAT is not None:
        out = torch.empty(world_size * row.numel(), dtype=row.dtype, device=row.device)
        _ALL_GATHER_FLAT(out, row, group=group)
        return out.view(world_size, row.numel())
    staged = row.cpu() if (row.is_cuda and backend == "gloo") else row
    parts = [torch.empty_like(staged) for _ in range(world_size)]
    dist.all_gather(parts, staged, group=group)
    return torch.stack(parts).to(row.device)


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum ``t`` over the ranks in place (through host memory for CUDA tensors on gloo)."""
    if t.is_cuda and backend_of(group) == "gloo":
        staged = t.cpu()
        dist.all_reduce(staged, group=group)
        t.copy_(staged)
    else:
        dist.all_reduce(t, group=group)
    return t


def any_rank(flags: Sequence[bool], group, device: torch.device) -> List[bool]:
    """For each of ``flags``, whether it is set on any rank of ``group``: one all-reduce of
    int32 flags, on ``device`` (on the host for gloo), read back on the host."""
    if backend_of(group) == "gloo":
        device = torch.device("cpu")
    counts = torch.tensor([bool(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(counts, group=group)
    return [n > 0 for n in counts.tolist()]


def _by_device_and_dtype(
    tensors: Iterable[torch.Tensor],
) -> Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]]:
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = OrderedDict()
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _flatten(tensors: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: List[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def broadcast_coalesced(tensors: Iterable[torch.Tensor], src: int = 0, group=None) -> None:
    """Broadcast ``tensors`` in place from rank ``src`` of ``group`` (its rank within the
    group, as PyTorch's DDP counts: the group's first member by default): one flat broadcast
    per device/dtype."""
    if group is not None:
        src = dist.get_global_rank(group, src)  # dist.broadcast takes a global rank
    with torch.no_grad():
        for items in _by_device_and_dtype(tensors).values():
            flat = _flatten(items)
            dist.broadcast(flat, src=src, group=group)
            _unflatten_into(flat, items)


def all_reduce_average_coalesced(tensors: Iterable[torch.Tensor], group=None,
                                 world_size: Optional[int] = None) -> None:
    """Replace each tensor by its average over the ranks: one flat all-reduce per device/dtype.

    fp16/bf16 tensors are divided by the number of ranks before the sum (finite fp16 values
    whose sum passes 65504 would overflow it); wider types after it (one rounding less).
    """
    world = world_size if world_size is not None else group_world_size(group)
    with torch.no_grad():
        for items in _by_device_and_dtype(tensors).values():
            flat = _flatten(items)
            half = flat.dtype in _HALF_TYPES
            if half:
                flat.div_(world)
            dist.all_reduce(flat, group=group)
            if not half:
                flat.div_(world)
            _unflatten_into(flat, items)
