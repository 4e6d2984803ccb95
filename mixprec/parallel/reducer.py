"""``Reducer``: all-reduce-average gradients when you call it (Apex's manual alternative to DDP)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import List, Optional, Union

import torch
from torch import nn

from mixprec.amp._logging import is_rank_zero
from mixprec.amp._model import agree_on_overflow, master_weights
from mixprec.amp._state import set_aside_grads, set_aside_params, set_aside_zeros
from mixprec.parallel._comm import (
    all_reduce_average_coalesced,
    any_rank,
    broadcast_coalesced,
    check_process_group,
    group_world_size,
    require_initialized,
)

__all__ = ["Reducer"]


def _collect_tensors(items: Iterable, out: List[torch.Tensor], bad: List[str]) -> None:
    """Flatten nested iterables of tensors into ``out`` (as Apex's Reducer did); the type
    names of anything else go to ``bad``."""
    for item in items:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            _collect_tensors(item, out, bad)
        else:
            bad.append(type(item).__name__)


def _check_reducible(t: torch.Tensor, what: str) -> None:
    """Raise a TypeError naming ``what`` unless ``t`` is a dense floating (or complex) tensor,
    which an average keeps in its dtype."""
    if t.layout != torch.strided:
        raise TypeError(
            f"{what} is a {t.layout} tensor (e.g. from nn.Embedding(sparse=True)); Reducer "
            "averages dense tensors only. Build the layer with sparse=False, or reduce that "
            "gradient yourself (torch.distributed.all_reduce takes sparse tensors over gloo)."
        )
    if not (t.is_floating_point() or t.is_complex()):
        raise TypeError(
            f"{what} is {t.dtype}; Reducer averages floating-point tensors, and an average "
            "of integers is not one. Pass floating tensors (e.g. t.float()), or all-reduce "
            "integers with torch.distributed.all_reduce."
        )
    expanded = [d for d, (n, st) in enumerate(zip(t.shape, t.stride())) if st == 0 and n > 1]
    if expanded:
        raise ValueError(
            f"{what} is an expanded view (shape {tuple(t.shape)}, stride {t.stride()}: stride 0 "
            f"along dim {expanded[0]}), whose elements share memory, so their average cannot be "
            "written back in place. Pass a tensor that owns its elements (t.clone(), or the "
            "tensor it was expanded from)."
        )


class Reducer:
    """Average gradients (or any tensors) over all ranks, when :meth:`reduce` is called.

    Unlike :class:`DistributedDataParallel` nothing happens during backward: you decide when
    to communicate, e.g. once after several accumulation steps. Given a module, its parameters
    are broadcast from rank 0 at construction and :meth:`reduce` averages the gradients of its
    parameters that have one; given a list of tensors, :meth:`reduce` averages those in place
    (the tensors themselves: gradients that ``zero_grad()`` replaces, as PyTorch's default
    ``set_to_none=True`` does, are no longer them, and :meth:`reduce` warns once when it finds
    none of its tensors written since the previous call; pass the module instead).
    Each call makes one flat all-reduce per (device, dtype).

    With an amp O2 model the fp32 master weights are broadcast too (built before
    ``amp.initialize``, the masters are made from the broadcast weights), and :meth:`reduce`
    averages the masters' gradients as well as the half parameters', so it may be called
    inside the ``amp.scale_loss`` block after backward or after the block (where the gradients
    have moved into the masters) alike. Under dynamic loss scaling amp's overflow check of the
    module's parameters agrees over its ranks (one all-reduce of one flag per checked
    backward), whichever of the Reducer and ``amp.initialize`` came first: a step that
    overflowed on any rank is skipped on all, as when the inf is averaged in before the
    check. Half-precision tensors
    are divided by the number of ranks before they are summed, so a sum of finite fp16
    gradients cannot overflow.

    With Reducers over several process groups, the overflow check agrees within each group
    (one all-reduce per group, in the order the Reducers were built): a rank's decision
    reaches the ranks of its own groups, not those of a group it shares only through a third
    rank (Reducers of different parts over overlapping groups {0, 1} and {1, 2}: an overflow on
    rank 2 does not reach rank 0). Give such layouts one Reducer over a group that holds them
    all (or the default group).

    Every rank must hold gradients for the same parameters when :meth:`reduce` runs (as in
    Apex): the gradients are averaged as one flat buffer, so a parameter used on some ranks
    only (a branch taken by some batches) makes the buffers differ, and the all-reduce fails
    (gloo aborts the process, NCCL may hang) or, where the sizes happen to match, averages one
    parameter's gradient with another's. For such models pass ``find_unused_parameters=True``.

    Args:
        module_or_grads_list (nn.Module or iterable of Tensor): what to reduce (nested
            lists and generators of tensors are flattened); dense floating-point (or complex)
            tensors, as an average is one (integer and sparse tensors are refused).
        process_group (ProcessGroup, optional, keyword-only): default: all ranks.
        find_unused_parameters (bool, keyword-only): with a module, :meth:`reduce` first
            agrees over the ranks which parameters (frozen ones included) have a gradient (one
            all-reduce of one flag per parameter, read on the host: a sync); a parameter with
            a gradient on some ranks gets a zero one on the others, so its average is the sum
            over the ranks that used it divided by all of them, as in
            ``DistributedDataParallel``; one with a gradient on no rank keeps ``None``.
            Default False (Apex's Reducer).

    Example::

        >>> reducer = Reducer(model)
        >>> for x, y in loader:
        ...     loss = criterion(model(x), y)
        ...     loss.backward()
        ...     reducer.reduce()          # average the gradients over the ranks
        ...     optimizer.step()
        ...     optimizer.zero_grad()
    """

    def __init__(self, module_or_grads_list: Union[nn.Module, Iterable[torch.Tensor]], *,
                 process_group=None, find_unused_parameters: bool = False):
        self.process_group = process_group
        if not isinstance(find_unused_parameters, bool):
            raise TypeError(f"Reducer(find_unused_parameters={find_unused_parameters!r}): "
                            "expected True or False.")
        if find_unused_parameters and not isinstance(module_or_grads_list, nn.Module):
            raise ValueError(
                "Reducer(..., find_unused_parameters=True) needs a module (its parameters' "
                "gradients are what may be missing); a list of tensors is averaged as given. "
                "Pass the model, or drop the flag.")
        self.find_unused_parameters = find_unused_parameters
        self.module: Optional[nn.Module] = None
        self.grads: List[torch.Tensor] = []
        # The list form: the tensors' version counters after the last reduce(), to notice a
        # call that finds none of them written since (gradients replaced by zero_grad()).
        self._versions: Optional[List[int]] = None
        self._warned_stale = False
        if isinstance(module_or_grads_list, nn.Module):
            self.module = module_or_grads_list
        elif isinstance(module_or_grads_list, Iterable) and not isinstance(
                module_or_grads_list, (torch.Tensor, str, bytes)):
            tensors, bad = [], []
            _collect_tensors(module_or_grads_list, tensors, bad)
            if bad or not tensors:
                raise TypeError(
                    "Reducer(module_or_grads_list=...): expected an nn.Module or a non-empty "
                    "iterable of tensors (nested lists and generators are fine); got one "
                    f"holding {sorted(set(bad)) or 'no tensors'}."
                )
            for i, t in enumerate(tensors):
                _check_reducible(t, f"Reducer(module_or_grads_list=...): tensor {i}")
            self.grads = tensors
        else:
            raise TypeError(
                f"Reducer(module_or_grads_list={type(module_or_grads_list).__name__}): expected "
                "an nn.Module or an iterable of tensors (e.g. [p.grad for p in params])."
            )
        check_process_group("Reducer", process_group)
        require_initialized("Reducer")
        group_world_size(process_group)  # this rank must belong to the group (as for DDP)
        if self.module is not None:
            # After the scale_loss block each rank has already decided alone whether its
            # gradients overflowed (and dropped them if so): amp's check of this module's
            # parameters now agrees over the group, so every rank skips the same steps, keeps
            # the same loss scale, and holds gradients for the same parameters when reduce()
            # runs. Registered whether or not amp has the module yet: amp.initialize may come
            # after, or take a model holding this module, or a part of it.
            agree_on_overflow(self.module, process_group)
            params = [p.data for p in self.module.parameters()]
            params += [m.data for m in master_weights(self.module)]
            if params:
                broadcast_coalesced(params, src=0, group=process_group)

    def reduce(self) -> None:
        """Replace the gradients (or the tensors) by their average over the ranks, in place.

        Every rank must call it at the same point; with a module, every rank's parameters must
        have gradients for the same set of parameters (or the Reducer was built with
        ``find_unused_parameters=True``).
        """
        if self.module is not None:
            if self.find_unused_parameters:
                self._fill_missing_gradients()
            # (Averaging a gradient that is already the same on every rank leaves it as it is,
            # so half and master gradients can both be reduced whatever amp has moved where.)
            tensors = [p.grad for p in self.module.parameters() if p.grad is not None]
            tensors += [m.grad for m in master_weights(self.module) if m.grad is not None]
            # (and, without masters, the earlier micro-batches' gradients that a scale_loss
            # block holds aside until it exits: reduce() inside the block must average them)
            tensors += set_aside_grads(self.module.parameters())
        else:
            tensors = self.grads
            self._check_written()
        if not tensors:
            return
        try:
            all_reduce_average_coalesced(tensors, group=self.process_group,
                                         world_size=group_world_size(self.process_group))
        except RuntimeError:
            # A sparse gradient (nn.Embedding(sparse=True)) fails in the flattening, on every
            # rank alike (the ranks hold gradients for the same parameters): say so. Looked for
            # only here, off the per-call path.
            for t in tensors:
                if t.layout != torch.strided:
                    names = [n for n, p in self.module.named_parameters()
                             if p.grad is not None and p.grad.layout != torch.strided]
                    _check_reducible(t, f"Reducer.reduce(): the gradient of {names or 'a master'}")
            raise
        if self.module is None and not any(t.is_inference() for t in tensors):
            # (Tensors made under torch.inference_mode() keep no version counter.)
            self._versions = [t._version for t in tensors]

    def _check_written(self) -> None:
        """Warn (once, on rank 0) when none of the list's tensors has been written since the
        previous reduce(): they are no longer the gradients (zero_grad() with PyTorch's default
        set_to_none=True replaces them), so the ranks would go on with their own."""
        if self._versions is None or self._warned_stale:
            return
        if any(t._version != v for t, v in zip(self.grads, self._versions)):
            return
        self._warned_stale = True
        if is_rank_zero():
            warnings.warn(
                f"Reducer.reduce(): none of the {len(self.grads)} tensors this Reducer was "
                "built from has been written since the previous reduce(), so this call "
                "averages the same values again. If they are gradients, optimizer.zero_grad() "
                "(set_to_none=True, PyTorch's default) has replaced them with new tensors that "
                "this Reducer does not see, and each rank steps on its own gradients: build it "
                "from the module (Reducer(model)), or zero with zero_grad(set_to_none=False).",
                RuntimeWarning, stacklevel=3)

    def _fill_missing_gradients(self) -> None:
        """``find_unused_parameters``: a zero gradient for each parameter (and O2 master)
        that has none here but has one on another rank. Frozen parameters count too: reduce()
        averages every gradient present, and one left on a frozen parameter on some ranks only
        (set before it was frozen, not zeroed since) would make the ranks' buffers differ."""
        params = list(self.module.parameters())
        slots = params + master_weights(self.module)
        if not slots:
            return
        held = [s.grad is not None for s in slots]
        # (and the earlier micro-batches' gradients a scale_loss block holds aside, which
        # reduce() averages too: without delay_unscale, at a loss scale other than 1)
        aside = set_aside_params(params)
        anywhere = any_rank(held + aside, self.process_group, slots[0].device)
        for slot, here, somewhere in zip(slots, held, anywhere):
            if somewhere and not here:
                slot.grad = torch.zeros_like(slot)
        missing = [p for p, here, somewhere in zip(params, aside, anywhere[len(slots):])
                   if somewhere and not here]
        if missing:
            set_aside_zeros(missing)
