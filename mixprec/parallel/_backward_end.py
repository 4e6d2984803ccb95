"""Run a callback once when the outermost backward ends, from parameter hooks.

Shared by ``DistributedDataParallel``'s delay mode (:mod:`mixprec.parallel._delayed`) and its
first-step rule (:mod:`mixprec.parallel._first_step`). A *watcher* is any object with a
``_queued`` flag, a ``_lock`` and a ``_finish()`` method: its parameter hooks call
:func:`queue_once`, and its ``_finish`` starts with ``if defer_if_nested(self): return``.

A reentrant checkpoint runs a nested backward inside a node of the outer one, and a callback
queued there runs when the nested one ends, too early. :func:`defer_if_nested` then queues it
again from a one-shot hook that runs in the outer backward, until it runs at the end of the
outermost one.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd import Variable

__all__ = ["current_task", "defer_if_nested", "queue_once", "remove_hooks"]

# The node autograd is running on this thread (None outside a node): a callback that runs
# inside a node runs at the end of a nested (reentrant) backward, not of the outermost one.
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
# The backward running on this thread (-1: none).
current_task = getattr(torch._C, "_current_graph_task_id", lambda: -1)


class _Pending:
    """The callback queued for the end of a backward. If the engine drops it unrun (the
    backward raised: an OOM caught to skip a batch), freeing it clears the watcher's queued
    mark, which would otherwise keep every later backward from queueing its callback."""

    __slots__ = ("ref", "ran")

    def __init__(self, ref: weakref.ReferenceType):
        self.ref = ref
        self.ran = False

    def __call__(self) -> None:
        self.ran = True
        watcher = self.ref()
        if watcher is not None:
            watcher._finish()

    def __del__(self):
        watcher = self.ref() if not self.ran else None
        if watcher is not None:
            watcher._queued = False


def _requeue(ref: weakref.ReferenceType):
    pending = [_Pending(ref)]  # (freed unrun with the graph if the hook never runs)

    def hook(*grads):
        if pending:  # (one-shot: the graph may be run again)
            Variable._execution_engine.queue_callback(pending.pop())

    return hook


def queue_once(watcher) -> None:
    """Queue ``watcher._finish`` for the end of the running backward, unless it is queued."""
    with watcher._lock:
        if watcher._queued:
            return
        watcher._queued = True
    Variable._execution_engine.queue_callback(_Pending(weakref.ref(watcher)))


def defer_if_nested(watcher) -> bool:
    """Called first in ``watcher._finish``: True (and ``_finish`` queued again for the end of
    the enclosing backward) when the backward ending now is a nested one."""
    node = _current_node()
    if node is None:
        return False
    # Queued again from a hook that runs in the backward around the nested one: a pre hook on
    # the node its gradients go to next (the checkpoint's inputs' grad_fn), or, if it has
    # none, a post hook on the node itself. (torch 2.4 does not run a post hook registered
    # while its node runs; a pre hook on a node yet to run, it does.)
    hook = _requeue(weakref.ref(watcher))
    after = next((fn for fn, _ in node.next_functions if fn is not None), None)
    if after is not None:
        after.register_prehook(hook)
    else:
        node.register_hook(hook)
    return True


def remove_hooks(handles: list) -> None:
    """Remove the hooks behind ``handles`` (a watcher's, when it ends or is freed) and forget
    them."""
    for handle in handles:
        handle.remove()
    handles.clear()
