"""``Reducer``: all-reduce-average gradients when you call it (Apex's manual alternative to DDP)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
from torch import nn

from mixprec.parallel._comm import (
    all_reduce_average_coalesced,
    broadcast_coalesced,
    group_world_size,
    require_initialized,
)

__all__ = ["Reducer"]


class Reducer:
    """Average gradients (or any tensors) over all ranks, when :meth:`reduce` is called.

    Unlike :class:`DistributedDataParallel` nothing happens during backward: you decide when
    to communicate, e.g. once after several accumulation steps. Given a module, its parameters
    are broadcast from rank 0 at construction and :meth:`reduce` averages the gradients of its
    parameters that have one; given a list of tensors, :meth:`reduce` averages those in place.
    Each call makes one flat all-reduce per (device, dtype).

    Args:
        module_or_grads_list (nn.Module or list[Tensor]): what to reduce.
        process_group (ProcessGroup, optional, keyword-only): default: all ranks.

    Example::

        >>> reducer = Reducer(model)
        >>> for x, y in loader:
        ...     loss = criterion(model(x), y)
        ...     loss.backward()
        ...     reducer.reduce()          # average the gradients over the ranks
        ...     optimizer.step()
        ...     optimizer.zero_grad()
    """

    def __init__(self, module_or_grads_list: Union[nn.Module, Sequence[torch.Tensor]], *,
                 process_group=None):
        self.process_group = process_group
        self.module: Optional[nn.Module] = None
        self.grads: List[torch.Tensor] = []
        if isinstance(module_or_grads_list, nn.Module):
            self.module = module_or_grads_list
        elif isinstance(module_or_grads_list, (list, tuple)):
            bad = [type(t).__name__ for t in module_or_grads_list
                   if not isinstance(t, torch.Tensor)]
            if bad or not module_or_grads_list:
                raise TypeError(
                    "Reducer(module_or_grads_list=...): expected an nn.Module or a non-empty "
                    f"list of tensors; got a list holding {bad or 'nothing'}."
                )
            self.grads = list(module_or_grads_list)
        else:
            raise TypeError(
                f"Reducer(module_or_grads_list={type(module_or_grads_list).__name__}): expected "
                "an nn.Module or a list of tensors."
            )
        require_initialized("Reducer")
        if self.module is not None:
            params = [p.data for p in self.module.parameters()]
            if params:
                broadcast_coalesced(params, src=0, group=process_group)

    def reduce(self) -> None:
        """Replace the gradients (or the tensors) by their average over the ranks, in place.

        Every rank must call it at the same point; with a module, every rank's parameters must
        have gradients for the same set of parameters.
        """
        if self.module is not None:
            tensors = [p.grad for p in self.module.parameters() if p.grad is not None]
        else:
            tensors = self.grads
        if tensors:
            all_reduce_average_coalesced(tensors, group=self.process_group,
                                         world_size=group_world_size(self.process_group))
