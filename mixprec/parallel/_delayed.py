"""``DistributedDataParallel(delay_allreduce=True)``: Apex's all-reduce after backward.

Apex's delay mode waited for backward to finish, then all-reduced every gradient that existed.
It asked nothing of the graph, so it worked where an overlapping reducer cannot: reentrant
activation checkpointing (a parameter's gradient arrives inside a nested backward, or twice),
forwards that return custom objects, branches taken in some steps or on some ranks only, and
parameters that never get a gradient. PyTorch's reducer with ``find_unused_parameters=True``
fails on the first three ("Expected to mark a variable ready only once"), so this mode does
not use PyTorch's reducer at all:

* every trainable parameter gets a post-accumulate-grad hook, and each forward (with grad
  enabled) hooks its output tensors. The first of these to fire in a backward whose forward
  all-reduces queues one callback on the autograd engine, which runs when that backward ends.
  The output's hook fires first in the outermost backward, so the callback waits for any
  nested (reentrant checkpoint) backward inside it;
* the callback agrees over the ranks which parameters hold a gradient (one small all-reduce
  of a flag per parameter, read on the host), gives a zero gradient to those that hold none
  here but do on another rank, and all-reduces the gradients in flat buckets of
  ``message_size`` elements per (device, dtype). A parameter without a gradient on every
  rank keeps ``grad=None``, as with PyTorch's ``find_unused_parameters=True``.

Each forward's backward is all-reduced once (a second backward through the same forward, with
``retain_graph=True``, is not, as with PyTorch's reducer), with one exception. Where the output
holds no tensor this mode can find, the first parameter hook queues the callback; in a reentrant
checkpoint that is the nested backward's, which ends early. A gradient arriving in the rest of
that backward then queues another all-reduce at its end: averaging is linear and leaves
gradients that are already equal on every rank as they are, so the result is the same average.
A sum (``gradient_average=False``) is not: that case raises.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves

from mixprec.amp._properties import _HALF_TYPES

__all__ = ["DelayedAllReduce"]

# The node autograd is running on this thread (None outside a node): a callback that runs
# inside a node runs at the end of a nested (reentrant) backward, not of the outermost one.
_current_node = getattr(torch._C, "_current_autograd_node", None)

# The live delay modes: a forward disarms the others that share its parameters (a model
# wrapped again, the old wrapper still referenced), so their hooks do nothing.
_LIVE: weakref.WeakSet[DelayedAllReduce] = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class _Arithmetic:
    """How a bucket is averaged: divide by ``predivide`` before the sum and by ``postdivide``
    after it, optionally summing half gradients in fp32."""

    predivide: float
    postdivide: float
    always_fp32: bool
    average: bool  # the result is an average (linear and idempotent), not a sum
    prof: bool


def _output_tensors(out) -> List[torch.Tensor]:
    """Tensors requiring grad in a forward's output: inside containers (pytree), and one level
    into the attributes of other objects (e.g. a model-output class that pytree does not
    know)."""
    found = []
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif hasattr(leaf, "__dict__") and not isinstance(leaf, (type, nn.Module)):
            found.extend(x for x in tree_leaves(list(vars(leaf).values()))
                         if isinstance(x, torch.Tensor))
    return [t for t in found if t.requires_grad]


def _buckets(grads: Sequence[torch.Tensor], cap: int) -> List[List[torch.Tensor]]:
    """Split ``grads`` by (device, dtype), keeping their order, into buckets of at most ``cap``
    elements (a larger gradient gets a bucket of its own)."""
    by_kind: Dict[Tuple[torch.device, torch.dtype], List[List[torch.Tensor]]] = {}
    sizes: Dict[Tuple[torch.device, torch.dtype], int] = {}
    for g in grads:
        key = (g.device, g.dtype)
        buckets = by_kind.setdefault(key, [[]])
        if buckets[-1] and sizes[key] + g.numel() > cap:
            buckets.append([])
            sizes[key] = 0
        buckets[-1].append(g)
        sizes[key] = sizes.get(key, 0) + g.numel()
    return [b for buckets in by_kind.values() for b in buckets]


def _hook_for(ref: weakref.ReferenceType[DelayedAllReduce]):
    # The hooks hold the mode weakly: parameters must not keep an abandoned wrapper's state
    # alive (re-wrapping a model is common), and a dead one's hooks do nothing.
    def hook(param):
        mode = ref()
        if mode is not None:
            mode._gradient_arrived()

    return hook


def _remove(handles) -> None:
    for handle in handles:
        handle.remove()


class DelayedAllReduce:
    """The all-reduce after backward of one :class:`DistributedDataParallel` (see the module
    docstring). ``arm`` is called by each forward with grad enabled."""

    def __init__(self, names: Sequence[str], params: Sequence[nn.Parameter], *,
                 process_group: Optional[dist.ProcessGroup], message_size: int,
                 arithmetic: _Arithmetic):
        self.names = list(names)
        self.params = list(params)
        self.process_group = process_group
        self.message_size = max(1, int(message_size))
        self.arithmetic = arithmetic
        backend = str(dist.get_backend(process_group)).lower()
        # gloo reduces CPU tensors (and CUDA ones through host memory, in the one-GPU tests);
        # NCCL and the others take tensors on the parameters' device.
        self._stage_on_host = backend == "gloo"
        self._ids = frozenset(map(id, self.params))
        self._armed = False  # the last forward's backward is still to be all-reduced
        self._queued = False  # a callback is waiting for the end of the running backward
        self._reduced = False  # ... and ran at the end of a nested backward already
        hook = _hook_for(weakref.ref(self))
        handles = [p.register_post_accumulate_grad_hook(hook) for p in self.params]
        weakref.finalize(self, _remove, handles)
        _LIVE.add(self)

    @torch.compiler.disable
    def arm(self, sync: bool, out) -> None:
        """Called after each forward with grad enabled: whether its backward all-reduces, and
        its output, whose tensors' hooks queue the callback from the outermost backward."""
        self._armed = bool(sync)
        self._reduced = False
        for other in list(_LIVE):
            if other is not self and other._armed and not self._ids.isdisjoint(other._ids):
                other._armed = False
        if not sync:
            return
        for t in _output_tensors(out):
            t.register_hook(self._output_gradient)

    def _output_gradient(self, grad):
        self._gradient_arrived()

    def _gradient_arrived(self) -> None:
        if not self._armed or self._queued:
            return
        if self._reduced and not self.arithmetic.average:
            raise RuntimeError(
                "DistributedDataParallel(delay_allreduce=True, gradient_average=False): a "
                "gradient arrived after this step's all-reduce had run at the end of a nested "
                "backward (a reentrant activation checkpoint), because the forward's output "
                "held no tensor requiring grad to wait on. A sum cannot be all-reduced twice. "
                "Return the output tensors from forward (a tensor, or lists, tuples, dicts or "
                "objects holding them), use checkpoint(..., use_reentrant=False), or keep "
                "gradient_average=True."
            )
        self._queue()

    def _queue(self) -> None:
        if self._armed and not self._queued:
            Variable._execution_engine.queue_callback(self._finish)
            self._queued = True

    def _finish(self) -> None:
        self._queued = False
        if _current_node is not None and _current_node() is not None:
            self._reduced = True  # nested: gradients may still arrive in this backward
        else:
            self._armed = False  # the outermost backward is done
        if self.arithmetic.prof:
            with torch.autograd.profiler.record_function("mixprec.ddp.delayed_allreduce"):
                self.all_reduce()
        else:
            self.all_reduce()

    # --------------------------------------------------------------------------------------
    def _which_have_gradients(self) -> List[bool]:
        """Whether each parameter has a gradient on any rank (one small all-reduce, read on
        the host: the buckets must be the same on every rank)."""
        local = [p.grad is not None for p in self.params]
        device = (torch.device("cpu") if self._stage_on_host or not self.params
                  else self.params[0].device)
        flags = torch.tensor(local, dtype=torch.int32, device=device)
        dist.all_reduce(flags, group=self.process_group)
        return [bool(n) for n in flags.tolist()]

    def all_reduce(self) -> None:
        """All-reduce (average, or as configured) every gradient that exists on any rank."""
        grads = []
        with torch.no_grad():
            for name, p, has in zip(self.names, self.params, self._which_have_gradients()):
                if not has:
                    continue
                if p.grad is None:  # used on another rank only: this rank adds nothing
                    p.grad = torch.zeros_like(p)
                elif p.grad.is_sparse:
                    raise RuntimeError(
                        f"DistributedDataParallel(delay_allreduce=True): {name} has a sparse "
                        "gradient, which this mode does not all-reduce. Use "
                        "delay_allreduce=False (with find_unused_parameters=True if some "
                        "parameters go without gradients), or a dense embedding."
                    )
                grads.append(p.grad)
            pending = [self._launch(bucket) for bucket in _buckets(grads, self.message_size)]
            for bucket, flat, work in pending:
                if work is not None:
                    work.wait()
                if self.arithmetic.postdivide != 1.0:
                    flat.div_(self.arithmetic.postdivide)
                offset = 0
                for g in bucket:
                    n = g.numel()
                    g.copy_(flat[offset:offset + n].view_as(g))
                    offset += n

    def _launch(self, bucket: List[torch.Tensor]):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        if self.arithmetic.always_fp32 and flat.dtype in _HALF_TYPES:
            flat = flat.float()
        if self.arithmetic.predivide != 1.0:
            flat.div_(self.arithmetic.predivide)
        if self._stage_on_host and flat.device.type != "cpu":
            staged = flat.cpu()
            dist.all_reduce(staged, group=self.process_group)
            flat.copy_(staged)
            return bucket, flat, None
        return bucket, flat, dist.all_reduce(flat, group=self.process_group, async_op=True)
