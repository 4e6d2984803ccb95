"""Turn a model's BatchNorm layers into SyncBatchNorm, and build groups for them."""

from __future__ import annotations

import operator
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from mixprec._checks import listed
from mixprec.amp._logging import is_rank_zero
from mixprec.amp._model import carry_amp_forward
from mixprec.parallel._comm import check_process_group, require_initialized
from mixprec.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["convert_syncbn_model", "create_syncbn_process_group"]


def _convert_one(bn: _BatchNorm, where: str, process_group, channel_last: bool) -> SyncBatchNorm:
    what = f"convert_syncbn_model: layer {where!r} ({type(bn).__name__})"
    if isinstance(bn, LazyModuleMixin) and bn.has_uninitialized_params():
        raise ValueError(
            f"{what} has not seen an input yet, so its number of channels is unknown. Run one "
            "forward pass (e.g. on a dummy batch) before converting, or use BatchNorm with "
            "num_features. The model is unchanged."
        )
    try:
        return _build(bn, process_group, channel_last)
    except (ValueError, TypeError) as error:
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"{what}: {error} The model is unchanged.") from error


def _build(bn: _BatchNorm, process_group, channel_last: bool) -> SyncBatchNorm:
    ref = bn.weight if bn.weight is not None else bn.running_mean
    factory = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
    sync = SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine,
                         bn.track_running_stats, process_group=process_group,
                         channel_last=channel_last, **factory)
    # The same Parameter and buffer objects move over (as torch's convert_sync_batchnorm does),
    # so an optimizer built earlier still holds this layer's parameters, and their dtype,
    # device and requires_grad are kept.
    with torch.no_grad():
        if bn.affine:
            sync.weight = bn.weight
            sync.bias = bn.bias
        sync.running_mean = bn.running_mean
        sync.running_var = bn.running_var
        sync.num_batches_tracked = bn.num_batches_tracked
    sync.train(bn.training)
    if hasattr(bn, "qconfig"):
        sync.qconfig = bn.qconfig
    return sync


def convert_syncbn_model(module: nn.Module, process_group=None,
                         channel_last: bool = False) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` by a :class:`SyncBatchNorm` (Apex's function).

    Every ``torch.nn.modules.batchnorm._BatchNorm`` (``BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm``)
    is swapped; existing :class:`SyncBatchNorm` layers stay (the same objects) but take
    ``process_group`` and ``channel_last``, as Apex's rebuilt ones did. The new layers take
    over the old ones' parameters and running-statistics buffers (the same objects), train/eval
    mode and ``requires_grad``, and a BatchNorm subclass's submodules (converted too; its own
    ``forward`` and other methods, e.g. a ``train()`` that keeps it in eval mode, are not kept,
    as in Apex; hooks registered on a layer are not carried either, and a warning names the
    layers that had any). A layer reached under several names (shared by two blocks, or
    registered twice in one) becomes one SyncBatchNorm under all of them. If a layer cannot be
    converted, the error names it and the model is left as it was. Call it before wrapping the
    model in ``DistributedDataParallel``; before ``amp.initialize`` as Apex asked, or after it
    (a layer amp prepared, O1's fp32 BatchNorm, passes amp's forward on to its SyncBatchNorm).

    Args:
        module (nn.Module): the model (or a single BatchNorm layer).
        process_group (ProcessGroup, optional): group whose statistics are merged. Default None:
            all ranks.
        channel_last (bool): the layers' inputs are shaped ``(N, *, C)``. Default False
            (``torch.channels_last`` tensors need no flag).

    Returns:
        nn.Module: ``module`` with its children replaced (a new SyncBatchNorm if ``module``
        itself is a BatchNorm layer).

    Example::

        >>> model = torchvision.models.resnet50().cuda()
        >>> model = convert_syncbn_model(model)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> model = DistributedDataParallel(model)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"convert_syncbn_model(module={type(module).__name__}): expected a torch.nn.Module."
        )
    if not isinstance(channel_last, bool):
        raise TypeError(f"convert_syncbn_model(channel_last={channel_last!r}): must be a bool.")
    check_process_group("convert_syncbn_model", process_group)
    # Two passes: every new layer is built first (an error leaves the model untouched), then
    # the model takes them.
    plan = _Plan(process_group, channel_last)
    result = plan.visit(module, "")
    for layer in plan.existing:
        # Apex's function rebuilt every _BatchNorm, its own SyncBatchNorm included, with the
        # arguments given: the layer stays (the same object) and takes them too, so that a
        # group passed for layers a model builds as SyncBatchNorm itself is not ignored.
        layer.process_group = process_group
        layer.channel_last = channel_last
    for parent, name, new in plan.swaps:
        setattr(parent, name, new)
    if plan.hooked and is_rank_zero():
        warnings.warn(
            "convert_syncbn_model: hooks registered on " + listed(plan.hooked) + " are not "
            "carried to their SyncBatchNorm (as in torch's convert_sync_batchnorm); register "
            "them on the converted layers if they are still wanted.", stacklevel=2)
    return result


class _Plan:
    """The first pass: what replaces each module, built but not yet put in place."""

    def __init__(self, process_group, channel_last: bool):
        self.process_group, self.channel_last = process_group, channel_last
        # A module's id -> what replaces it (itself if nothing), so that a layer met again
        # under another name or parent gets the same SyncBatchNorm.
        self.memo: dict = {}
        self.swaps: list = []  # (parent, name, new child) to set
        self.existing: list = []  # SyncBatchNorm layers already there, to update
        self.hooked: list = []  # paths of layers whose hooks are not carried

    def visit(self, module: nn.Module, path: str) -> nn.Module:
        key = id(module)
        if key in self.memo:
            return self.memo[key]
        if isinstance(module, SyncBatchNorm):
            self.existing.append(module)
            result = module
        elif isinstance(module, _BatchNorm):
            where = path or type(module).__name__
            result = _convert_one(module, where, self.process_group, self.channel_last)
            # (A layer amp.initialize prepared, e.g. O1's fp32 BatchNorm: the new one keeps
            # amp's forward. Before, it lost it without a word.)
            carry_amp_forward(module, result)
            if _has_hooks(module):
                self.hooked.append(where)
        else:
            result = module
        self.memo[key] = result
        # (_modules, not named_children(): that skips a child registered under a second name.)
        for name, child in module._modules.items():
            if child is None:
                continue
            new = self.visit(child, f"{path}.{name}" if path else name)
            if result is not module:
                # A subclass's submodules (e.g. an activation) come along, converted, as in
                # Apex and torch's convert_sync_batchnorm: the model keeps their parameters
                # and state_dict keys.
                result.add_module(name, new)
            elif new is not child:
                self.swaps.append((module, name, new))
        return result


def _has_hooks(module: nn.Module) -> bool:
    return any(getattr(module, attr, None) for attr in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def create_syncbn_process_group(group_size: int) -> Optional[dist.ProcessGroup]:
    """Split the ranks into groups of ``group_size`` consecutive ranks for SyncBatchNorm.

    Every rank must call it (it creates every group, collectively) with the same value. Ranks
    ``[k * group_size, (k + 1) * group_size)`` form group ``k``; the group of the calling rank is
    returned, to pass as ``SyncBatchNorm(process_group=...)`` or to :func:`convert_syncbn_model`.

    Args:
        group_size (int): ranks per group; must divide the world size. ``0`` means one group of
            all ranks and returns None (the default group), as in Apex.

    Returns:
        ProcessGroup or None.

    Example::

        >>> group = create_syncbn_process_group(4)   # 8 GPUs: ranks 0-3 and 4-7
        >>> model = convert_syncbn_model(model, process_group=group)
    """
    try:  # (any integer type, e.g. NumPy's from a world-size computation; not a bool)
        size = None if isinstance(group_size, bool) else operator.index(group_size)
    except TypeError:
        size = None
    if size is None or size < 0:
        raise ValueError(
            f"create_syncbn_process_group(group_size={group_size!r}): must be an int >= 0 "
            "(ranks per group; 0 for one group of all ranks)."
        )
    group_size = int(size)
    if group_size == 0:
        return None
    require_initialized("create_syncbn_process_group")
    world_size = dist.get_world_size()
    if group_size > world_size or world_size % group_size:
        raise ValueError(
            f"create_syncbn_process_group(group_size={group_size}): the world size is "
            f"{world_size}; group_size must divide it (and be at most it)."
        )
    rank = dist.get_rank()
    mine = None
    for start in range(0, world_size, group_size):
        # new_group is collective: every rank creates every group, in the same order.
        group = dist.new_group(ranks=list(range(start, start + group_size)))
        if start <= rank < start + group_size:
            mine = group
    return mine
