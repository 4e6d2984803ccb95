"""``DistributedDataParallel(delay_allreduce=True)``: Apex's all-reduce after backward.

Apex's delay mode waited for backward to finish, then all-reduced every gradient that existed.
It asked nothing of the graph, so it worked where an overlapping reducer cannot: reentrant
activation checkpointing (a parameter's gradient arrives inside a nested backward, or twice),
forwards that return custom objects, branches taken in some steps or on some ranks only, and
parameters that never get a gradient. PyTorch's reducer with ``find_unused_parameters=True``
fails on the first three ("Expected to mark a variable ready only once"), so this mode does
not use PyTorch's reducer at all:

* every trainable parameter gets a post-accumulate-grad hook. After a forward (with grad
  enabled) whose backward all-reduces, the first of them to fire queues one callback on the
  autograd engine, run when that backward ends;
* a reentrant checkpoint runs a nested backward inside a node of the outer one, and a callback
  queued there runs when the nested one ends, too early. The callback then defers itself: a
  one-shot hook that runs in the outer backward queues it again, until it runs at the end of
  the outermost one (:mod:`mixprec.parallel._backward_end`). So every rank all-reduces exactly
  once per backward, whichever of its parameters a rank used and wherever (as long as each
  rank's backward reaches at least one of them: a rank whose loss never reaches the model
  skips the collectives, and the others wait for it until the process group's timeout, as
  with Apex);
* there it agrees over the ranks which parameters hold a gradient produced since the last
  all-reduce (one small all-reduce of a flag per parameter, read on the host), gives a zero
  gradient to those that hold none here but do on another rank, and all-reduces the
  gradients in flat buckets of ``message_size`` elements per (device, dtype). A parameter
  without a new gradient on every rank keeps its gradient as it is (``None``, or a stale one
  of a layer frozen since), as with PyTorch's ``find_unused_parameters=True``.

Each forward's backward is all-reduced once: a second backward through the same forward (with
``retain_graph=True``) is not, as with PyTorch's reducer and Apex, and warns once (its
gradients stay this rank's own). ``torch.autograd.grad`` accumulates no parameter gradient and
so triggers nothing. Whether a backward all-reduces is ``sync`` when it ends: set by the
forward from ``require_backward_grad_sync`` (``no_sync()``, PyTorch's semantics), and by Apex's
``disable_allreduce()`` / ``enable_allreduce()`` at once (Apex's semantics).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from mixprec.amp._logging import is_rank_zero
from mixprec.normalization._launch import is_compiling, outside_the_compiler
from mixprec.parallel._backward_end import (
    current_task,
    defer_if_nested,
    queue_once,
    remove_hooks,
)
from mixprec.parallel._comm import (
    ReduceSpec,
    _by_device_and_dtype,
    _flatten,
    _unflatten_into,
    all_reduce_sum,
    any_rank,
    backend_of,
)

__all__ = ["DelayedAllReduce"]

# Apex's switches for several backwards through one forward (amp's per-loss scales kept):
# told by both modes' warnings about a second backward.
SWITCHES_ADVICE = (
    "disable_allreduce() before each backward but the last and enable_allreduce() before the "
    "last, which then all-reduces the gradients of all of them"
)


def _buckets(grads: Sequence[torch.Tensor], cap: int) -> List[List[torch.Tensor]]:
    """Split ``grads`` by (device, dtype), keeping their order, into buckets of at most ``cap``
    elements (a larger gradient gets a bucket of its own)."""
    buckets = []
    for items in _by_device_and_dtype(grads).values():
        bucket, size = [], 0
        for g in items:
            if bucket and size + g.numel() > cap:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(g)
            size += g.numel()
        buckets.append(bucket)
    return buckets


def _hook_for(ref: weakref.ReferenceType[DelayedAllReduce]):
    # The hooks hold the mode weakly: parameters must not keep an abandoned wrapper's state
    # alive (re-wrapping a model is common), and a dead one's hooks do nothing.
    def hook(param):
        mode = ref()
        if mode is not None:
            mode._gradient_arrived(param)

    return hook


def _warn_late_gradient() -> None:
    if is_rank_zero():
        warnings.warn(
            "DistributedDataParallel(delay_allreduce=True): a backward reached the model after "
            "its forward's backward had been all-reduced (e.g. loss.backward(retain_graph=True) "
            "then a second backward through the same forward, as an SRGAN step does from the "
            "discriminator's loss into the generator). Its gradients are this rank's own, not "
            "averaged (as with Apex and PyTorch's DDP). Sum the losses into one backward, or run "
            "the model's forward again before the second backward, or, to keep amp's per-loss "
            f"scales, call {SWITCHES_ADVICE}. (Warned once per wrapper.)",
            UserWarning, stacklevel=2)


class DelayedAllReduce:
    """The all-reduce after backward of one :class:`DistributedDataParallel` (see the module
    docstring). ``arm`` is called by each forward with grad enabled."""

    def __init__(self, names: Sequence[str], params: Sequence[nn.Parameter],
                 *, spec: ReduceSpec, message_size: int):
        self.names = list(names)
        self.params = list(params)
        self.spec = spec
        self.process_group = spec.process_group
        self.message_size = max(1, int(message_size))
        # gloo reduces CPU tensors (and CUDA ones through host memory, in the one-GPU tests);
        # NCCL and the others take tensors on the parameters' device.
        self._stage_on_host = backend_of(self.process_group) == "gloo"
        self.sync = True  # whether the backward's end all-reduces (see the module docstring)
        self._armed = False  # the last forward's backward has not ended yet
        self._spent = False  # ... it has: gradients arriving now stay local (warned once)
        self._warned = False
        self._queued = False  # a callback waits for the end of the running backward
        # Ids of the parameters whose gradient a backward produced since the last all-reduce:
        # a stale gradient (a layer frozen after training, its gradient never zeroed) is not
        # all-reduced again, as with PyTorch's reducer (with gradient_average=False it would
        # grow by the world size at every step).
        self._fresh = set()
        # Parameters that left the module (refresh) with a fresh gradient, by id: held until
        # the all-reduce so that their ids stay theirs (one put back in the window counts).
        self._departed = {}
        self._lock = threading.Lock()  # (hooks of a multi-device model run on several threads)
        self._hook = _hook_for(weakref.ref(self))
        self._handles = {id(p): p.register_post_accumulate_grad_hook(self._hook)
                         for p in self.params}
        # (the finalizer's list, kept in step with _handles by refresh)
        self._handle_list = list(self._handles.values())
        weakref.finalize(self, remove_hooks, self._handle_list)

    def refresh(self, names: Sequence[str], params: Sequence[nn.Parameter]) -> None:
        """Follow the module's trainable parameters as they are now (a layer replaced, added
        or unfrozen since the last forward): hooks on the new ones, none left on those gone.
        Called by the wrapper's forward, between backwards."""
        keep = {id(p) for p in params}
        for p in self.params:
            if id(p) not in keep:
                self._handles.pop(id(p)).remove()
                if id(p) in self._fresh:
                    self._departed[id(p)] = p
        for p in params:
            if id(p) not in self._handles:
                self._handles[id(p)] = p.register_post_accumulate_grad_hook(self._hook)
        self.names, self.params = list(names), list(params)
        self._handle_list[:] = self._handles.values()
        # (_fresh keeps the ids of those gone, held in _departed: a layer taken out and put
        # back within one no_sync() window must bring its gradients to the window's
        # all-reduce, or each rank keeps its own.)

    def arm(self, sync: bool) -> None:
        """Called by each forward with grad enabled: whether its backward all-reduces."""
        if is_compiling():  # (a graph break: flags of this object, set eagerly)
            return outside_the_compiler(DelayedAllReduce.arm)(self, sync)
        if current_task() == -1:
            # Outside any backward: a callback still marked queued belonged to a backward that
            # raised (the engine drops its callbacks then).
            self._queued = False
        self.sync = bool(sync)
        self._armed = True
        self._spent = False

    def disarm(self) -> None:
        """Another wrapper runs the module now (the model wrapped again, this one still
        referenced): this one's hooks do nothing until its own forward runs again."""
        self._armed = self._spent = False

    def _gradient_arrived(self, param: nn.Parameter) -> None:
        self._fresh.add(id(param))
        if not self._armed or self._queued:
            if self._spent and not self._warned:
                self._warned = True
                _warn_late_gradient()
            return
        queue_once(self)

    def _finish(self) -> None:
        if defer_if_nested(self):  # (the end of a nested backward: wait for the outer one)
            return
        self._queued = False
        if not self.sync:  # (Apex's switch off: a later backward may still all-reduce)
            return
        self._armed = False  # the outermost backward is done: once per forward
        self._spent = True
        if self.spec.prof:
            with torch.autograd.profiler.record_function("mixprec.ddp.delayed_allreduce"):
                self.all_reduce()
        else:
            self.all_reduce()

    # --------------------------------------------------------------------------------------
    def _agree_on_gradients(self) -> Tuple[List[bool], List[bool]]:
        """Whether each parameter has a gradient produced since the last all-reduce, and a
        sparse one, on any rank (one small all-reduce, read on the host: the buckets must be
        the same on every rank)."""
        fresh, self._fresh = self._fresh, set()
        self._departed.clear()
        local = [p.grad is not None and id(p) in fresh for p in self.params]
        local += [p.grad is not None and p.grad.is_sparse for p in self.params]
        device = self.params[0].device if self.params else torch.device("cpu")
        agreed = any_rank(local, self.process_group, device)
        return agreed[:len(self.params)], agreed[len(self.params):]

    def all_reduce(self) -> None:
        """All-reduce (average, or as configured) every gradient that a backward produced
        since the last all-reduce on any rank."""
        has, sparse = self._agree_on_gradients()
        if any(sparse):  # (raised on every rank alike, before any other collective)
            names = [n for n, s in zip(self.names, sparse) if s]
            raise RuntimeError(
                f"DistributedDataParallel(delay_allreduce=True): {', '.join(names)} got a "
                "sparse gradient (on some rank), which this mode does not all-reduce. Use "
                "delay_allreduce=False (with find_unused_parameters=True if some parameters go "
                "without gradients), or a dense embedding (sparse=False)."
            )
        grads = []
        with torch.no_grad():
            for p, used in zip(self.params, has):
                if not used:
                    continue
                if p.grad is None:  # used on another rank only: this rank adds nothing
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            pending = [self._launch(bucket) for bucket in _buckets(grads, self.message_size)]
            for bucket, flat, work in pending:
                if work is not None:
                    work.wait()
                if self.spec.postdivide != 1.0:
                    flat.div_(self.spec.postdivide)
                _unflatten_into(flat, bucket)

    def _launch(self, bucket: List[torch.Tensor]):
        flat = self.spec.summand(_flatten(bucket))
        if self._stage_on_host:  # (through host memory for CUDA tensors)
            return bucket, all_reduce_sum(flat, self.process_group), None
        return bucket, flat, dist.all_reduce(flat, group=self.process_group, async_op=True)
