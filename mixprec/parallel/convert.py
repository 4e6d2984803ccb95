"""Turn a model's BatchNorm layers into SyncBatchNorm, and build groups for them."""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from mixprec.amp._model import carry_amp_forward
from mixprec.parallel._comm import check_process_group, require_initialized
from mixprec.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["convert_syncbn_model", "create_syncbn_process_group"]


def _convert_one(bn: _BatchNorm, process_group, channel_last: bool) -> SyncBatchNorm:
    if isinstance(bn, LazyModuleMixin) and bn.has_uninitialized_params():
        raise ValueError(
            f"convert_syncbn_model: {type(bn).__name__} has not seen an input yet, so its "
            "number of channels is unknown. Run one forward pass (e.g. on a dummy batch) "
            "before converting, or use BatchNorm with num_features."
        )
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
    ``forward`` is not kept, as in Apex). Call it before wrapping the model in
    ``DistributedDataParallel``; before ``amp.initialize`` as Apex asked, or after it (a layer
    amp prepared, O1's fp32 BatchNorm, passes amp's forward on to its SyncBatchNorm).

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
    if isinstance(module, SyncBatchNorm):
        # Apex's function rebuilt every _BatchNorm, its own SyncBatchNorm included, with the
        # arguments given: the layer stays (the same object) and takes them too, so that a
        # group passed for layers a model builds as SyncBatchNorm itself is not ignored.
        module.process_group = process_group
        module.channel_last = channel_last
    elif isinstance(module, _BatchNorm):
        sync = _convert_one(module, process_group, channel_last)
        # (A layer amp.initialize prepared, e.g. O1's fp32 BatchNorm: the new one keeps amp's
        # forward. Before, it lost it without a word.)
        carry_amp_forward(module, sync)
        # A subclass's submodules (e.g. an activation) come along, converted, as in Apex and
        # torch's convert_sync_batchnorm: the model keeps their parameters and state_dict keys.
        for name, child in module.named_children():
            sync.add_module(name, convert_syncbn_model(child, process_group, channel_last))
        return sync
    for name, child in module.named_children():
        converted = convert_syncbn_model(child, process_group, channel_last)
        if converted is not child:
            setattr(module, name, converted)
    return module


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
