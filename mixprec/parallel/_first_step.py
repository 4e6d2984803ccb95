"""Apex's first-step rule for the parameters of ``DistributedDataParallel``'s reducer.

Apex's DDP recorded, during the first backward, which parameters produced gradients, and built
its buckets from those: a parameter no forward used (BERT's pooler under a question-answering
head, a layer frozen after the model was wrapped) was never all-reduced, and training went on.
PyTorch's reducer, built before any step, waits for every parameter: an unused one keeps its
bucket from being all-reduced, and the next forward raises. This module gives the reducer's
mode Apex's rule.

* The first backward that all-reduces is watched: from the first forward until that backward
  ends, each trainable parameter of the reducer has a post-accumulate-grad hook (in no_sync()
  micro-batches before it, the hooks only note which parameters got a gradient). In that
  backward the first hook to fire queues a callback for the end of the outermost backward
  (past the nested backwards of reentrant checkpoints; see
  :mod:`mixprec.parallel._backward_end`).
* There, the parameters whose hook did not fire get a zero gradient through a small backward of
  their own, which fires the reducer's hooks too. Every rank then completes every bucket, in
  the same order, so the step's gradients are all-reduced as with
  ``find_unused_parameters=True``: a parameter used on some ranks only is averaged with zeros.
* Then one small all-reduce, read on the host, tells which parameters got no gradient on any
  rank, in that backward or the micro-batches before it (a gradient tensor merely left over,
  or zeroed in place, does not count: Apex's rule was the hook's firing). Those get
  ``grad=None`` back and are left out: the wrapper rebuilds its reducer without them before
  the next forward, and a gradient that reaches one of them later raises (it would never be
  averaged across the ranks).
* The same all-reduce tells whether any parameter's hook fired twice in that backward: its
  gradient came from two backwards nested in it (a block run twice through reentrant
  checkpointing, a tied weight used inside such a checkpoint and outside it). PyTorch's
  reducer all-reduces what the first brought and keeps the rest local (it raises "marked as
  ready twice" only while the bucket waits for other gradients), so the ranks would drift
  apart without a word: every rank raises, naming those parameters and the remedies.

A model whose parameters all get gradients in the first step pays one hook call per parameter
and one small all-reduce, once.
"""

from __future__ import annotations

import threading
import weakref
from typing import List, Sequence, Tuple

import torch
from torch import nn

from mixprec.normalization._launch import is_compiling, outside_the_compiler
from mixprec.parallel._backward_end import (
    current_task,
    defer_if_nested,
    queue_once,
    remove_hooks,
)
from mixprec.parallel._comm import any_rank

__all__ = ["FirstStep"]


def _fired(ref: weakref.ReferenceType[FirstStep], index: int):
    # Held weakly, as the delay mode's hooks: a dropped wrapper's watch does nothing.
    def hook(param):
        watch = ref()
        if watch is None:
            return
        if watch.armed:
            if watch.fired[index]:  # (a second backward inside this one reached it)
                watch.twice[index] = True
            watch.fired[index] = True
            queue_once(watch)
        else:  # (a no_sync() micro-batch before the watched backward)
            watch.accumulated[index] = True

    return hook


class FirstStep:
    """The watch over the first all-reducing backward of one ``DistributedDataParallel`` (see
    the module docstring). ``arm`` is called by each forward with grad enabled, saying whether
    its backward all-reduces, until such a backward has ended; then the wrapper's
    ``_leave_out`` gets the parameters without a gradient on any rank (possibly none), and
    the watch is over."""

    def __init__(self, ddp: nn.Module, pairs: Sequence[Tuple[str, nn.Parameter]]):
        self.ddp = weakref.ref(ddp)
        self.names = [name for name, _ in pairs]  # the reducer's parameters, in its order
        self.params = [p for _, p in pairs]
        self.fired = [False] * len(self.params)  # in the watched backward
        self.twice = [False] * len(self.params)  # fired again in it (see _twice_error)
        self.accumulated = [False] * len(self.params)  # in no_sync() backwards before it
        self.armed = False  # the last forward's backward all-reduces
        self.done = False
        self._handles: List = []
        self._queued = False  # a callback waits for the end of the running backward
        self._kept = None  # (suspend's record of the gradients behind `accumulated`)
        self._lock = threading.Lock()  # (hooks of a multi-device model run on several threads)
        weakref.finalize(self, remove_hooks, self._handles)

    def arm(self, sync: bool) -> None:
        if is_compiling():  # (a graph break: hooks and flags, set eagerly)
            return outside_the_compiler(FirstStep.arm)(self, sync)
        if self.done:
            return
        if self._kept is not None:  # (run again after another wrapper: see suspend)
            self.accumulated = [
                kept is not None and p.grad is not None and kept[0]() is p.grad
                and p.grad._version == kept[1] for kept, p in zip(self._kept, self.params)]
            self._kept = None
        # (A no_sync() micro-batch's backward is not the step watched: its hooks only note
        # the gradients it accumulates.)
        self.armed = bool(sync)
        if sync and current_task() == -1:
            # Outside any backward: a callback still marked queued belonged to a backward that
            # raised (the engine drops its callbacks then); start the watch afresh.
            self._queued = False
            self.fired = [False] * len(self.params)
            self.twice = [False] * len(self.params)
        if not self._handles:
            ref = weakref.ref(self)
            self._handles.extend(p.register_post_accumulate_grad_hook(_fired(ref, i))
                                 for i, p in enumerate(self.params) if p.requires_grad)

    def suspend(self) -> None:
        """Another wrapper runs the module now (the model wrapped again, this one still
        referenced): stop watching until this wrapper's next forward with grad, which arms
        the watch afresh.

        What the hooks noted of this wrapper's no_sync() micro-batches still counts then
        where those gradients are still there: the parameter holds the same gradient tensor,
        unchanged (the other wrapper only ran forwards). A gradient the other wrapper's steps
        took along (set to None, zeroed, or added to) is no longer this wrapper's: its note is
        dropped, so a parameter unused from then on is left out rather than given a zero."""
        self.armed = False
        self.fired = [False] * len(self.params)
        self.twice = [False] * len(self.params)
        if self._kept is None:  # (a second suspend keeps the first record)
            self._kept = [
                (weakref.ref(p.grad), p.grad._version) if noted and p.grad is not None
                else None for p, noted in zip(self.params, self.accumulated)]
        remove_hooks(self._handles)

    def _finish(self) -> None:
        if defer_if_nested(self):  # (the end of a nested backward: wait for the outer one)
            return
        self._queued = False
        ddp = self.ddp()
        if ddp is None or self.done or not self.armed:
            return
        self.close()
        # Whether each parameter got a gradient: in this backward, or in no_sync() micro-batches
        # before it (a gradient tensor left from before the wrapper, or zeroed in place, does
        # not count: Apex's rule was the gradient hook's firing).
        held = [f or a for f, a in zip(self.fired, self.accumulated)]
        silent = [p for p, fired in zip(self.params, self.fired) if not fired]
        if silent:
            _fire_with_zeros(silent)
        # (One all-reduce for both: whether each parameter got a gradient, whether twice.)
        n = len(self.params)
        agreed = any_rank(held + self.twice, ddp.process_group, self._device())
        unused = [i for i in range(n) if not agreed[i]]
        for i in unused:  # (their all-reduced zeros)
            self.params[i].grad = None
        ddp._leave_out([(self.names[i], self.params[i]) for i in unused])
        twice = [self.names[i] for i in range(n) if agreed[n + i]]
        if twice:  # (on every rank: the flags are agreed)
            raise RuntimeError(_twice_error(twice))

    def close(self) -> None:
        """End the watch (its backward has ended, or the graph turned static)."""
        self.done = True
        self.armed = False
        remove_hooks(self._handles)

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")


def _twice_error(names: List[str]) -> str:
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (
        f"DistributedDataParallel: {shown} got gradients from two backward passes nested in "
        "one backward in the first step: a block run twice in one forward through reentrant "
        "activation checkpointing (checkpoint(..., use_reentrant=True), timm's "
        "checkpoint_seq), or a weight used inside such a checkpoint and outside it (an "
        "embedding tied to the output projection). PyTorch's reducer all-reduces such a "
        "gradient when its first part arrives and leaves the rest local, so every rank would "
        "step on a gradient of its own and the replicas would drift apart without an error. "
        "Use checkpoint(..., use_reentrant=False), or construct the wrapper with "
        "delay_allreduce=True (all-reduces once the whole backward has ended), or PyTorch's "
        "torch.nn.parallel.DistributedDataParallel with static_graph=True."
    )


def _fire_with_zeros(params: List[nn.Parameter]) -> None:
    """Accumulate a zero gradient into each of ``params`` through autograd, so that the hooks
    on their gradient accumulators (the reducer's) fire as if backward had reached them. A
    parameter frozen after the reducer was built takes requires_grad for that moment: its
    accumulator, kept by the reducer, is the one its hooks are on."""
    frozen = [p for p in params if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        torch.autograd.backward(params, [torch.zeros_like(p) for p in params])
    finally:
        for p in frozen:
            p.requires_grad_(False)
