"""``DistributedDataParallel`` with Apex's arguments, on PyTorch's C++ gradient reducer.

Why PyTorch's reducer rather than home-made buckets: it already does what Apex's Python buckets
did (gradients bucketed in the order they become ready, recorded on the first iteration;
all-reduces launched from C++ autograd hooks while backward continues; ``no_sync``; unused
parameters found on request) and it is the code path every PyTorch user exercises, so the
subtle parts (CUDA stream ordering, gradient-layout contracts, ``set_to_none`` gradients,
checkpointing) are correct. What Apex added on top, this class adds through one documented
communication hook (:func:`_apex_allreduce_hook`), run once per bucket:

* the bucket is all-reduced in the gradients' own dtype: at amp O2 that is fp16/bf16, half the
  bytes of fp32 and no cast kernel (``allreduce_always_fp32=True`` upcasts instead);
* Apex's averaging: divide by ``gradient_predivide_factor`` before the all-reduce and by
  ``world_size / gradient_predivide_factor`` after (``gradient_average=False``: no division
  after);
* the gradients ARE the bucket (``gradient_as_bucket_view=True``): no copy in or out.

``delay_allreduce=True`` does not use the reducer (PyTorch's constructor builds one, which is
then dropped): :mod:`mixprec.parallel._delayed` all-reduces after backward, as Apex did.

The common case (``gradient_average=True``, ``gradient_predivide_factor`` 1 or the world size,
no fp32 upcast, no profiling) registers no hook at all: PyTorch's reducer then divides each
gradient by the world size while copying it into its bucket (one fused pass; with any hook,
PyTorch's built-in C++ one included, the copy is plain and the hook divides the bucket in a
second pass) and all-reduces the sum: Apex's ``gradient_predivide_factor=world_size``. The
averaged result is the same; the sum cannot overflow fp16; and no Python runs per bucket
(measured on two H200s, the Python hook cost about 1 ms per GPT-style step).

Parameters and buffers are broadcast from rank 0 once, at construction, and never again
(Apex broadcast the parameters only; PyTorch's default re-broadcasts the buffers in every
forward); at amp O2 the fp32 master weights are broadcast with them. With amp, a backward inside ``no_sync()`` keeps its
gradients scaled in place (as ``delay_unscale=True``), so that the synced backward after it
all-reduces the whole accumulated gradient.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import re
import warnings
import weakref
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils._pytree import tree_leaves

from mixprec._checks import check_flag, listed
from mixprec.amp._logging import is_rank_zero
from mixprec.amp._model import _SET_BY_TORCH_DDP, GRAD_SYNC_DEFERRED, is_amp_model, master_weights
from mixprec.amp._state import masters_of
from mixprec.amp.frontend import states_holding
from mixprec.normalization._launch import is_compiling, outside_the_compiler
from mixprec.parallel import _structure
from mixprec.parallel._backward_end import current_task, remove_hooks
from mixprec.parallel._comm import (
    ReduceSpec,
    all_gather_rows,
    backend_of,
    broadcast_coalesced,
    check_process_group,
    group_world_size,
    require_initialized,
)
from mixprec.parallel._delayed import SWITCHES_ADVICE, DelayedAllReduce
from mixprec.parallel._first_step import FirstStep

__all__ = ["DistributedDataParallel"]

# Apex's helpers of apex.parallel.distributed, which scripts import from there (this module
# is apex.parallel.distributed under the Apex alias): flatten/unflatten and flat_dist_call.
flatten = _flatten_dense_tensors
unflatten = _unflatten_dense_tensors


def flat_dist_call(tensors, call, extra_args=None) -> None:
    """Run the collective ``call`` (e.g. ``dist.broadcast`` with ``extra_args=(0,)``, or
    ``dist.all_reduce``) once per (device, dtype) over the flattened ``tensors``, then copy
    the results back into them, as Apex's helper did; after ``dist.all_reduce`` the result is
    divided by the world size (the average).

    A broadcast of amp O2 half parameters (or their ``.data``: BERT's replicas synced after
    ``amp.initialize``) broadcasts their fp32 masters too: else the ranks receiving took the
    half values into their masters, rounded, while the sending rank kept its fp32 ones, and
    the replicas drifted apart (by half a unit in the last place, at every element)."""
    tensors = list(tensors)
    buckets = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    for bucket in buckets.values():
        flat = flatten(bucket)
        call(flat, *(extra_args or ()))
        if call is dist.all_reduce:
            flat /= dist.get_world_size()
        with torch.no_grad():
            for t, synced in zip(bucket, unflatten(flat, bucket)):
                t.copy_(synced)
    if call is dist.broadcast:
        masters = masters_of(tensors)
        if masters:
            flat_dist_call(masters, call, extra_args)


_MB = 1024 * 1024
_TORCH_DDP_PARAMS = frozenset(
    inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
)
_UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"


def _refuse_other_arguments(kwargs) -> None:
    """A TypeError for keyword arguments the constructor does not take, saying which are
    PyTorch's DDP's (a script moving from ``torch.nn.parallel.DistributedDataParallel``)."""
    names = sorted(kwargs)
    torch_names = [n for n in names if n in _TORCH_DDP_PARAMS]
    others = [n for n in names if n not in _TORCH_DDP_PARAMS]
    if not torch_names:
        raise TypeError(
            f"DistributedDataParallel got unexpected keyword argument(s) {names}; it takes "
            "Apex's arguments (message_size, delay_allreduce, gradient_average, "
            "gradient_predivide_factor, allreduce_always_fp32, ...) plus process_group and "
            "find_unused_parameters."
        )
    raise TypeError(
        f"DistributedDataParallel({', '.join(n + '=...' for n in torch_names)}): "
        f"{torch_names} are arguments of torch.nn.parallel.DistributedDataParallel; "
        "mixprec's takes Apex's (message_size, delay_allreduce, gradient_predivide_factor, "
        "...) plus process_group and find_unused_parameters. device_ids / output_device are "
        "not needed: the module's own device is used (call torch.cuda.set_device(local_rank) "
        "and move the module there first). For PyTorch's other options use "
        "torch.nn.parallel.DistributedDataParallel itself, which works with amp too."
        + (f" Unknown to both: {others}." if others else "")
    )


def _apex_allreduce_hook(state, bucket):
    """All-reduce one gradient bucket with Apex's semantics (see the module docstring).

    (No annotations: PyTorch checks a hook's annotations and rejects string ones.)
    """
    if state.prof:
        with torch.autograd.profiler.record_function("mixprec.ddp.allreduce_bucket"):
            return _launch(state, bucket.buffer())
    return _launch(state, bucket.buffer())


def _launch(state: ReduceSpec, buffer: torch.Tensor) -> torch.futures.Future:
    work = state.summand(buffer)
    upcast = work is not buffer
    future = dist.all_reduce(work, group=state.process_group, async_op=True).get_future()
    postdivide = state.postdivide

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        if postdivide != 1.0:
            reduced.div_(postdivide)
        if upcast:
            buffer.copy_(reduced)
        # Returning the bucket itself tells the reducer the gradients are already in place.
        return buffer

    return future.then(finish)


class _Token:
    """A weakly referenced marker (see ``_watch_unsynced_backward``)."""


# Per module, the wrapper (in the reducer's mode) that ran its last forward: only that one
# watches the first step and guards the parameters it left out (a model wrapped again, the
# old wrapper still referenced, must not raise for the new one's gradients).
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# What to do about several backwards through one forward's outputs (Apex's several losses:
# one forward, a scale_loss block and a backward per loss_id), which the all-reduce of one
# backward per forward leaves partly this rank's own; said by both modes' warnings.
SEVERAL_BACKWARDS_ADVICE = (
    "Sum the losses into one backward; or run the forward again before each backward; or, to "
    "keep amp's per-loss scales, construct the wrapper with delay_allreduce=True and call "
    f"{SWITCHES_ADVICE}."
)


class _Passes:
    """The backwards that ran through one forward's outputs so far (see
    ``DistributedDataParallel._watch_second_backward``)."""

    __slots__ = ("tasks", "reached")

    def __init__(self):
        self.tasks = set()  # (graph task ids)
        self.reached = False  # (one of them reached the parameters)


def _second_backward_hook(ref, passes: _Passes):
    def hook(grad):
        task = current_task()
        if task in passes.tasks:  # (another output of the same backward)
            return None
        passes.tasks.add(task)
        ddp = ref()
        if ddp is None or not ddp._backward_reaches_parameters():
            return None  # (torch.autograd.grad of an input: a gradient penalty)
        if passes.reached:
            ddp._second_backward(task)
        passes.reached = True
        return None

    return hook


def _left_out_guard(ref, name: str):
    def hook(param):
        ddp = ref()
        if (ddp is not None and ddp._active
                and getattr(ddp, "_second_backward_task", None) == current_task()):
            raise RuntimeError(
                f"DistributedDataParallel: {name} got a gradient in a second backward through "
                "the outputs of one forward, but it got none on any rank in the first step, "
                "so (as in Apex) it was left out of the all-reduce, and this gradient would "
                "stay this rank's own while the replicas drift apart. PyTorch's reducer "
                "all-reduces the first backward of each forward only. "
                + SEVERAL_BACKWARDS_ADVICE
            )
        if ddp is not None and ddp._active:
            raise RuntimeError(
                f"DistributedDataParallel: {name} got a gradient, but it got none on any rank "
                "in the first step, so (as in Apex) it was left out of the all-reduce, and this "
                "gradient would stay this rank's own while the replicas drift apart. If some "
                "parameters are unused in some steps only, construct the wrapper with "
                "find_unused_parameters=True (or delay_allreduce=True); if the model changed "
                "(a head added to the loss), wrap it again."
            )

    return hook


def _warn_rank0(message: str, category) -> None:
    """Warn once per job, not once per rank (the constructor runs on every rank)."""
    if is_rank_zero():
        warnings.warn(message, category, stacklevel=3)


# Methods of Apex's DistributedDataParallel that subclasses overrode to customise it (a
# sub-group all-reduce, a compressed one): this class has no such methods, so an override
# would silently do nothing.
_APEX_INTERNALS = frozenset({
    "allreduce_bucket", "allreduce_maybe_retain", "allreduce_fallback", "allreduce_params",
    "comm_ready_buckets", "create_hooks", "sync_bucket_structure",
})


def _warn_on_apex_internals(cls: type) -> None:
    overridden = sorted({name for klass in cls.__mro__
                         if not issubclass(DistributedDataParallel, klass)
                         for name in vars(klass) if name in _APEX_INTERNALS})
    if overridden:
        _warn_rank0(
            f"{cls.__name__} overrides {', '.join(overridden)} of Apex's "
            "DistributedDataParallel, which mixprec's does not have or call: the override has "
            "no effect, and gradients are all-reduced over the wrapper's process_group as "
            "usual. Customise the all-reduce with register_comm_hook() (delay_allreduce=False) "
            "and pass process_group= to the constructor.",
            UserWarning,
        )


def _reducer_params(module: nn.Module, ignored=frozenset(),
                    also=frozenset()) -> List[Tuple[str, nn.Parameter]]:
    # The order in which PyTorch's DDP hands parameters to its reducer: per module (named_modules
    # order), its own trainable parameters not set to be ignored
    # (_set_params_and_buffers_to_ignore_for_model), shared ones once. Its unused-parameter
    # error speaks in indices into this list; the delay mode all-reduces these parameters (and,
    # as it follows the module, those frozen since it listed them: ids in ``also``).
    pairs, seen = [], set()
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if ((param.requires_grad or id(param) in also) and param not in seen
                    and name not in ignored):
                seen.add(param)
                pairs.append((name, param))
    return pairs


def _reducer_param_names(module: nn.Module, ignored=frozenset()) -> List[str]:
    return [name for name, _ in _reducer_params(module, ignored)]


def _compile_friendly_bucket_cap(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Let ``torch.compile`` take a model whose buckets are smaller than 1 MiB.

    Under ``torch.compile`` Dynamo splits the forward graph where DDP's buckets end, reading
    ``bucket_bytes_cap``, and its splitter refuses a cap below its fixed 1 MiB first bucket
    (``AssertionError: First bucket should be smaller/equal to other buckets``), which a small
    ``message_size`` (below 262,144 fp32 or 524,288 half elements) gives. The reducer got its
    cap at construction and keeps it, so raising the attribute to 1 MiB afterwards only makes
    the compiled graph's pieces coarser. The reducer's own cap is kept in
    ``_reducer_bucket_bytes_cap``: pickling puts it back where PyTorch rebuilds the reducer
    from (see ``__getstate__``).
    """
    first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None)
    cap = getattr(ddp, "bucket_bytes_cap", None)
    ddp._reducer_bucket_bytes_cap = cap
    if isinstance(first, int) and isinstance(cap, int) and cap < first:
        ddp.bucket_bytes_cap = first


def _check_same_structure(named, group) -> None:
    """Every rank of ``group`` holds ``named`` tensors of the same names, dtypes and shapes as
    rank 0 (one all-gather of a digest of them); else every rank raises, naming the ranks
    that differ and what this one holds."""
    layout = [(name, str(t.dtype), tuple(t.shape)) for name, t in named]
    digest = int.from_bytes(hashlib.sha1(repr(layout).encode()).digest()[:7], "little")
    device = torch.device("cpu")
    if backend_of(group) != "gloo" and named:
        device = named[0][1].device
        if device.type == "cpu" and backend_of(group) == "nccl":
            return  # (PyTorch's constructor refuses CPU tensors on NCCL with its own error)
    row = torch.tensor([digest], dtype=torch.int64, device=device)
    gathered = all_gather_rows(row, group, group_world_size(group))[:, 0].tolist()
    differ = [rank for rank, theirs in enumerate(gathered) if theirs != gathered[0]]
    if differ:
        mine = {name: (dtype, shape) for name, dtype, shape in layout}
        raise RuntimeError(
            f"DistributedDataParallel: the module's parameters and buffers differ in name, "
            f"dtype or shape between ranks (ranks {differ} against rank 0 of the group); "
            f"this rank holds {mine}. Build the same model on every rank."
        )


def _dominant_itemsize(module: nn.Module) -> int:
    # Bytes per element of the dtype holding most of the trainable parameters (2 at amp O2).
    by_size = {}
    for p in module.parameters():
        if p.requires_grad:
            by_size[p.element_size()] = by_size.get(p.element_size(), 0) + p.numel()
    return max(by_size, key=by_size.get) if by_size else 4


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """Data-parallel training over ``torch.distributed`` with Apex's constructor and semantics.

    A subclass of ``torch.nn.parallel.DistributedDataParallel`` (so ``no_sync()``, ``join()``,
    ``.module`` and ``module.``-prefixed state-dict keys behave as in both PyTorch and Apex), set
    up as Apex's DDP was: parameters broadcast from rank 0 at construction only (buffers too,
    where Apex left them alone); gradients all-reduced in buckets of ``message_size`` elements
    while backward runs, in their own dtype (half at amp O2); averaged with the pre-divide
    factor applied before the all-reduce and the rest after.
    ``join(divide_by_initial_world_size=False)`` (divide the uneven steps' gradients by the
    ranks still active) works with the default averaging; with
    ``prof``, ``allreduce_always_fp32`` or a pre-divide factor other than 1 or the world size,
    whose all-reduce runs in a communication hook that divides by the initial world size, it
    is refused (PyTorch's own hooks ignore it).

    Works on CPU modules (gloo) and single-device CUDA modules (NCCL); inputs are passed to the
    module as they are (move them to the device yourself, as with Apex). Use it after
    ``amp.initialize``, as Apex required.

    Failure modes: a rank that never joins makes ``init_process_group`` raise after its
    ``timeout``; a rank that dies makes the others' next collective raise (gloo: at once;
    NCCL: after the process group's ``timeout``). Pass ``timeout=`` to ``init_process_group``
    to bound the wait. Parameters that get no gradient on any rank in the first all-reducing
    backward are left out of the all-reduce from then on, as Apex's DDP did (see
    :mod:`mixprec.parallel._first_step`; rank 0 warns once with the trainable ones' names):
    they keep ``grad=None``, and one that gets a gradient later raises (not for a first step
    inside ``join()``, nor for a model with sparse gradients: there PyTorch's rule holds). A
    parameter that got a gradient in the first step and none in a later one makes the next
    forward raise a RuntimeError naming it, unless ``find_unused_parameters=True`` (then any
    parameter may go without a gradient in any step: one unused on every rank keeps
    ``grad=None``, but inside ``join()`` one that a rank which has joined used in its last step
    gets a zero gradient, as with PyTorch's DDP, whose join hook all-reduces that rank's last
    map of used parameters; with momentum or Adam the zero still moves it). A parameter frozen
    when the model was wrapped (or in the first step) and set to require gradients later makes
    the next forward raise: it is not in the all-reduce, so wrap the model again after changing
    ``requires_grad``; so does freezing some of the parameters (not all) after the first step,
    which the all-reduce would wait for, and a layer replaced or added after wrapping (its
    parameters are not in PyTorch's reducer).
    With ``delay_allreduce=True`` any parameter may go without a gradient, and the wrapper
    follows the module as Apex's delay mode did: parameters unfrozen, replaced or added are
    all-reduced from the next backward on, and layers new to the module get rank 0's state at
    the next forward with grad enabled (every rank must make the same change). A module without
    trainable parameters (a frozen loss network) is broadcast and passed through, as in Apex.

    Apex arguments that no longer apply are accepted with a warning and ignored:
    ``allreduce_trigger_params`` (buckets follow gradient readiness), ``num_allreduce_streams``
    > 1 and ``allreduce_communicators`` (one communicator; NCCL already spreads an all-reduce
    over many channels), ``retain_allreduce_buffers`` (gradients always live in the flat
    buckets). ``shared_param`` (deprecated in Apex) means ``delay_allreduce=shared_param``, and
    ``gradient_average_split_factor`` (renamed in Apex) means ``gradient_predivide_factor``;
    both warn (on rank 0). Apex's ``disable_allreduce()`` / ``enable_allreduce()`` switch the
    all-reduce off and on, as ``no_sync()`` does for a block.

    Args:
        module (nn.Module): the model, on its device (after ``amp.initialize``).
        message_size (int): bucket size in elements (of the gradients' dtype). Default ``1e7``.
        delay_allreduce (bool): Apex's delay mode: all-reduce every gradient that exists
            after backward (buckets of ``message_size``), instead of overlapping with it, and
            without PyTorch's reducer (see :mod:`mixprec.parallel._delayed`): it works with
            reentrant activation checkpointing, blocks run twice, custom output objects and
            parameters without gradients, which the reducer cannot follow. One small
            all-reduce read on the host per backward; ``join()`` and ``register_comm_hook()``
            are refused. Default False.
        shared_param: deprecated alias of ``delay_allreduce``. Default None.
        allreduce_trigger_params: ignored (warns). Default None.
        retain_allreduce_buffers (bool): ignored (warns). Default False.
        allreduce_always_fp32 (bool): all-reduce half gradients in fp32. Default False.
        num_allreduce_streams (int): ignored above 1 (warns). Default 1.
        allreduce_communicators: ignored (warns). Default None.
        gradient_average (bool): average over ranks (else sum). Default True.
        gradient_predivide_factor (float): divide by this before the all-reduce and by
            ``world_size / factor`` after (Apex's arithmetic; every factor gives the same
            average). Default 1.0, which runs like a factor of ``world_size``: each gradient
            is divided by the world size before the sum, which then cannot overflow fp16.
        gradient_average_split_factor (float, optional): old name of the above (warns).
        prof (bool): label each bucket's all-reduce in profiler traces. Default False.
        process_group (ProcessGroup, optional, keyword-only): default: all ranks.
        find_unused_parameters (bool, keyword-only): let parameters go without gradients in
            any step, not only from the first one on (costs a graph traversal per forward).
            Default False.

    Example::

        >>> torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        >>> torch.distributed.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
        >>> model = Net().cuda()
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> model = DistributedDataParallel(model)
        >>> for x, y in loader:
        ...     optimizer.zero_grad()
        ...     loss = criterion(model(x.cuda()), y.cuda())
        ...     with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...         scaled_loss.backward()
        ...     optimizer.step()
        >>> torch.save(model.module.state_dict(), "model.pt")   # keys without "module."
    """

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 10000000,
        delay_allreduce: bool = False,
        shared_param=None,
        allreduce_trigger_params=None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators=None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: Optional[float] = None,
        prof: bool = False,
        *,
        process_group: Optional[dist.ProcessGroup] = None,
        find_unused_parameters: bool = False,
        **torch_kwargs,
    ):
        if torch_kwargs:
            _refuse_other_arguments(torch_kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"DistributedDataParallel(module={type(module).__name__}): expected a "
                "torch.nn.Module."
            )
        given = locals()
        for name in _APEX_POSITIONAL:
            if dist.is_available() and isinstance(given[name], dist.ProcessGroup):
                # (DDP(model, 10000000, False, group): the fourth positional is Apex's
                # shared_param, which turned delay mode on and dropped the group silently.)
                raise TypeError(
                    f"DistributedDataParallel({name}=<ProcessGroup>): a process group is not "
                    f"a {name} (one passed by position lands in Apex's {name} argument). Pass "
                    "it by keyword, process_group=group (keyword-only, as in torch's "
                    "DistributedDataParallel).")
        where = "DistributedDataParallel"  # (a string "False" was true: any string is)
        delay_allreduce = check_flag(where, "delay_allreduce", delay_allreduce)
        retain_allreduce_buffers = check_flag(where, "retain_allreduce_buffers",
                                              retain_allreduce_buffers)
        allreduce_always_fp32 = check_flag(where, "allreduce_always_fp32", allreduce_always_fp32)
        gradient_average = check_flag(where, "gradient_average", gradient_average)
        prof = check_flag(where, "prof", prof)
        find_unused_parameters = check_flag(where, "find_unused_parameters",
                                            find_unused_parameters)
        require_initialized("DistributedDataParallel")
        if (not isinstance(message_size, (int, float)) or isinstance(message_size, bool)
                or not 1 <= message_size < math.inf):
            raise ValueError(
                f"DistributedDataParallel(message_size={message_size!r}): must be a finite "
                "number >= 1 of elements per bucket (Apex's default is 10000000)."
            )
        if gradient_average_split_factor is not None:
            _warn_rank0(
                "DistributedDataParallel(gradient_average_split_factor=...) was renamed "
                "gradient_predivide_factor in Apex; using it as gradient_predivide_factor.",
                FutureWarning,
            )
            gradient_predivide_factor = gradient_average_split_factor
        if (not isinstance(gradient_predivide_factor, (int, float))
                or isinstance(gradient_predivide_factor, bool)
                or not 0 < gradient_predivide_factor < math.inf):
            raise ValueError(
                "DistributedDataParallel(gradient_predivide_factor="
                f"{gradient_predivide_factor!r}): must be a finite number > 0 (an infinite one "
                "makes every gradient 0 or NaN), e.g. 1.0 (the default) or "
                "the world size; both divide every gradient by the world size before the "
                "all-reduce."
            )
        if shared_param is not None:
            _warn_rank0(
                "DistributedDataParallel(shared_param=...) is deprecated (as in Apex); use "
                f"delay_allreduce={bool(shared_param)} instead.",
                FutureWarning,
            )
            # (Never turns off an explicit delay_allreduce=True.)
            delay_allreduce = bool(delay_allreduce) or bool(shared_param)
        ignored = []
        if allreduce_trigger_params is not None:
            ignored.append("allreduce_trigger_params (buckets follow gradient readiness)")
        if retain_allreduce_buffers:
            ignored.append("retain_allreduce_buffers (gradients always live in the flat "
                           "all-reduce buckets)")
        if not isinstance(num_allreduce_streams, int) or num_allreduce_streams < 1:
            raise ValueError(
                f"DistributedDataParallel(num_allreduce_streams={num_allreduce_streams!r}): "
                "must be an int >= 1."
            )
        if num_allreduce_streams > 1:
            ignored.append("num_allreduce_streams > 1 (one communicator is used)")
        if allreduce_communicators is not None:
            ignored.append("allreduce_communicators (the process group's communicator is used)")
        if ignored:
            _warn_rank0(
                "DistributedDataParallel: ignoring Apex argument(s) that no longer apply: "
                + "; ".join(ignored) + ".",
                UserWarning,
            )

        check_process_group("DistributedDataParallel", process_group)
        group_world_size(process_group)  # this rank must belong to the group
        delay_allreduce = bool(delay_allreduce)
        buffer_kwargs = (
            {"forward_sync_buffers": False} if "forward_sync_buffers" in _TORCH_DDP_PARAMS
            else {"broadcast_buffers": False}
        )
        ignored = frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        reducer_names = _reducer_param_names(module, ignored)
        pass_through = not reducer_names
        # The module's state but what it sets to be ignored (what PyTorch checks and
        # broadcasts), the same on every rank: checked before PyTorch's own check, which on
        # gloo leaves the ranks that match waiting for the process group's timeout (30
        # minutes) while the others raise; a module passed through has no check of PyTorch's
        # (its broadcast took part of rank 0's values into a mismatched model, silently).
        named = [(name, t) for name, t in [*module.named_parameters(), *module.named_buffers()]
                 if t is not None and name not in ignored]
        _check_same_structure(named, process_group)
        if pass_through:
            # Nothing to all-reduce (a frozen perceptual-loss network, which Apex scripts wrap
            # too): PyTorch's constructor refuses it; Apex broadcast it and passed it through.
            self._pass_through(module, process_group, buffer_kwargs, ignored, named)
        else:
            # PyTorch's constructor checks the parameters' shapes across the ranks and
            # broadcasts the module's state from rank 0; in the delay mode its reducer is then
            # dropped (see mixprec.parallel._delayed): the gradients stay autograd's own.
            super().__init__(
                module,
                device_ids=None,
                process_group=process_group,
                bucket_cap_mb=float(message_size) * _dominant_itemsize(module) / _MB,
                find_unused_parameters=find_unused_parameters and not delay_allreduce,
                gradient_as_bucket_view=not delay_allreduce,
                **buffer_kwargs,
            )
            self._no_reducer = delay_allreduce
            if delay_allreduce:
                self.reducer = None  # (its destructor removes its autograd hooks)
                self.logger = None
                # Under torch._dynamo.config.optimize_ddp="python_reducer" PyTorch all-reduces
                # from hooks of its own instead of the reducer: none of those either.
                for handle in getattr(self, "_accum_grad_hooks", ()):
                    handle.remove()
                self._accum_grad_hooks = []
                self._use_python_reducer = False
            else:
                _compile_friendly_bucket_cap(self)
        if "forward_sync_buffers" not in _TORCH_DDP_PARAMS and not pass_through:
            # Older PyTorch skips the buffers at construction with broadcast_buffers=False
            # (those set to be ignored stay each rank's own, as PyTorch broadcasts).
            buffers = [b for name, b in module.named_buffers()
                       if b is not None and name not in ignored]
            if buffers:
                broadcast_coalesced(buffers, src=0, group=process_group)

        # amp O2's fp32 master weights live in the optimizer, out of PyTorch's broadcast of the
        # module's state: without this each rank would keep its own initial masters and copy
        # them into the (broadcast) half model at its first step.
        masters = master_weights(module)
        if masters:
            broadcast_coalesced(masters, src=0, group=process_group)
        # The reducer's parameters by name, in its order (its unused-parameter error gives
        # indices into the list it was built with, whatever requires_grad says later).
        self._reducer_names = reducer_names
        # Parameters frozen at wrapping are not in the reducer: one unfrozen later
        # (progressive fine-tuning) would train on this rank's gradient alone.
        self._frozen_at_wrap = [p for p in module.parameters() if not p.requires_grad]
        # The amp models inside (the module itself, or e.g. a container of several): each
        # forward tells them whether its backward all-reduces.
        self._amp_models = [m for m in module.modules() if is_amp_model(m)]

        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.allreduce_always_fp32 = bool(allreduce_always_fp32)
        self.gradient_average = bool(gradient_average)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.prof = bool(prof)
        self._install_hook()
        _warn_on_apex_internals(type(self))

    def _install_hook(self) -> None:
        # The module's parameters now (held, so that their ids stay theirs): a forward after a
        # change to any module's parameters or submodules (see _structure) compares them with
        # the module's own then (see _check_parameters).
        self._active = True  # (until another wrapper runs the module; see _note_forward)
        _structure.watch()
        self._structure_seen = _structure.version()
        self._known_params = list(self.module.named_parameters())
        # The communication hooks registered on the reducer, to register again on a rebuilt
        # one (see _rebuild_reducer).
        self._comm_hook_record = []
        world_size = group_world_size(self.process_group)
        post = (world_size / self.gradient_predivide_factor if self.gradient_average else 1.0)
        self._hook_state = ReduceSpec(
            process_group=self.process_group,
            predivide=self.gradient_predivide_factor,
            postdivide=post,
            always_fp32=self.allreduce_always_fp32,
            prof=self.prof,
        )
        averages = (self.gradient_average and not self.allreduce_always_fp32
                    and self.gradient_predivide_factor in (1.0, float(world_size)))
        if averages and self.prof:
            # prof's hook (a label per bucket in profiler traces) keeps the default path's
            # arithmetic, each gradient divided by the world size before the sum: summed
            # first, two fp16 gradients of 40000 averaged to inf.
            self._hook_state = dataclasses.replace(
                self._hook_state, predivide=float(world_size), postdivide=1.0)
        plain_average = averages and not self.prof
        if self._no_reducer:
            self._divides_in_hook = False
            # The plain average divides before the sum, as PyTorch's reducer does above.
            spec = (dataclasses.replace(self._hook_state, predivide=float(world_size),
                                        postdivide=1.0)
                    if plain_average else self._hook_state)
            pairs = _reducer_params(
                self.module, frozenset(getattr(self, "parameters_to_ignore", ())))
            # (and its submodules: new ones get rank 0's buffers too; see _follow_module)
            self._known_modules = list(self.module.modules())
            self._delayed = DelayedAllReduce(
                [name for name, _ in pairs], [p for _, p in pairs],
                spec=spec, message_size=int(self.message_size))
            return
        self._delayed = None
        self._divides_in_hook = not plain_average and (
            self._hook_state.predivide != 1.0 or self._hook_state.postdivide != 1.0)
        if not plain_average:  # else the reducer's own path (see the module docstring)
            self.register_comm_hook(self._hook_state, _apex_allreduce_hook)
        self._watch_first_step()

    def _watch_first_step(self) -> None:
        """Apex's first-step rule (see :mod:`mixprec.parallel._first_step`), unless the
        reducer handles unused parameters itself, or the first step has been seen (then guard
        the parameters it left out)."""
        self._first_step = None
        self._left_out_guards = []
        weakref.finalize(self, remove_hooks, self._left_out_guards)
        # (The reducer's parameters: after the first step, freezing some of them and not the
        # rest is refused at the forward; see _partly_frozen.)
        pairs = _reducer_params(
            self.module, frozenset(getattr(self, "parameters_to_ignore", ())))
        self._reducer_param_list = [p for _, p in pairs]
        if self.find_unused_parameters or self.static_graph:
            return
        if getattr(self, "_left_out_names", None) is None:
            sparse = any(getattr(m, "sparse", False) for m in self.module.modules()
                         if isinstance(m, (nn.Embedding, nn.EmbeddingBag)))
            if not sparse:  # (a zero gradient for those would have to be a sparse one)
                self._first_step = FirstStep(self, pairs)
            return
        self._guard_left_out()

    def _pass_through(self, module: nn.Module, process_group, buffer_kwargs, ignored,
                      named) -> None:
        """Set up without PyTorch's constructor, for a module without trainable parameters:
        its state broadcast from rank 0, its forward run as it is (the delay mode's path, with
        nothing to all-reduce), and the attributes PyTorch's methods read."""
        nn.Module.__init__(self)
        self.module = module
        self.process_group = (process_group if process_group is not None
                              else dist.distributed_c10d._get_default_group())
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.device_ids = self.output_device = None
        self.dim = 0
        self.static_graph = self.find_unused_parameters = self.gradient_as_bucket_view = False
        self.parameters_to_ignore = set(ignored)
        self.reducer = self.logger = None
        for name, value in buffer_kwargs.items():
            if not isinstance(getattr(type(self), name, None), property):
                setattr(self, name, value)
        self.forward_sync_buffers = False
        self._no_reducer = True
        # Rank 0's state (``named``: what PyTorch would broadcast, checked by the caller).
        state = [t for _, t in named]
        self.device = state[0].device if state else torch.device("cpu")
        self.device_type = self.device.type
        if state:
            broadcast_coalesced(state, src=0, group=process_group)

    def join_hook(self, **kwargs):
        """PyTorch's join hook; ``divide_by_initial_world_size=False`` is refused where the
        gradients are divided in mixprec's all-reduce hook (see the class documentation)."""
        if getattr(self, "_delayed", None) is not None:
            raise RuntimeError(
                "DistributedDataParallel.join(): uneven inputs are handled by PyTorch's "
                "reducer, which this wrapper does not use (delay_allreduce=True, or a module "
                "without trainable parameters; Apex had no join either). Construct with "
                "delay_allreduce=False (and "
                "find_unused_parameters=True if some parameters go without gradients) to use "
                "join(), or give every rank the same number of batches."
            )
        if (not kwargs.get("divide_by_initial_world_size", True)
                and getattr(self, "_divides_in_hook", False)):
            options = ", ".join(
                name for name, on in (
                    ("prof=True", self.prof),
                    ("allreduce_always_fp32=True", self.allreduce_always_fp32),
                    ("gradient_average=False", not self.gradient_average),
                    (f"gradient_predivide_factor={self.gradient_predivide_factor:g}",
                     self.gradient_predivide_factor != 1.0)) if on)
            raise ValueError(
                "DistributedDataParallel.join(divide_by_initial_world_size=False) with "
                f"{options}: these options all-reduce through mixprec's communication hook, "
                "which divides by the world size fixed at construction (as PyTorch's own "
                "hooks do), not by the ranks still active, so the gradients of the uneven "
                "steps would come out smaller than asked. Use join() with the default "
                "divide_by_initial_world_size=True, or construct without those options."
            )
        return super().join_hook(**kwargs)

    def _sync_final_model(self, is_last_joiner):
        """At the end of ``join()``: PyTorch's broadcast of the module's state from the last
        rank to join, then amp O2's fp32 masters and amp's loss scales from the same rank
        (else every rank took the broadcast half weights into its masters as a write: rounded
        to half, an update smaller than half's resolution lost at each join)."""
        super()._sync_final_model(is_last_joiner)
        masters = master_weights(self.module)
        if masters:
            broadcast_coalesced(masters, src=self._authoritative_rank, group=self.process_group)
        # And amp's loss scales: an overflow on a rank still training halved its scale while
        # the ranks that had joined never saw it; with scales that differ, the ranks' scaled
        # gradients would be averaged and each unscaled by its own scale.
        states = states_holding(self.module)
        if states:
            scalers = [[s.state_dict() for s in states]]
            src = dist.get_global_rank(self.process_group, self._authoritative_rank)
            dist.broadcast_object_list(scalers, src=src, group=self.process_group)
            for state, saved in zip(states, scalers[0]):
                if saved:
                    state.load_state_dict(saved)

    def register_comm_hook(self, state, hook) -> None:
        """PyTorch's ``register_comm_hook``; refused in the delay mode, whose all-reduce runs
        after backward outside PyTorch's reducer."""
        if getattr(self, "_delayed", None) is not None:
            raise RuntimeError(
                "DistributedDataParallel.register_comm_hook(): PyTorch's reducer runs "
                "communication hooks, and this wrapper does not use it (delay_allreduce=True "
                "all-reduces after backward; a module without trainable parameters has nothing "
                "to all-reduce). Construct with delay_allreduce=False to use a hook."
            )
        super().register_comm_hook(state, hook)
        self._comm_hook_record.append((state, hook))

    # Pickling/deep-copying (default process group only, as for PyTorch's DDP): the hook state
    # holds the process group, so it is rebuilt on the other side with the new reducer.
    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_hook_state", None)
        state.pop("_delayed", None)
        state.pop("_unsynced_backward", None)  # (a weak reference)
        state.pop("_accumulators", None)  # (autograd nodes; found again)
        for name in ("_comm_hook_record", "_first_step", "_left_out_guards"):
            state.pop(name, None)  # (hooks and their process group; set up again)
        # The unpickled reducer is rebuilt from bucket_bytes_cap: give it the reducer's cap
        # (__setstate__ then raises the compiler's copy again).
        cap = state.pop("_reducer_bucket_bytes_cap", None)
        if cap is not None:
            state["bucket_bytes_cap"] = cap
        if "_comm_hooks" in state:  # PyTorch's record of registered hooks (and their states)
            state["_comm_hooks"] = []
        return state

    def __setstate__(self, state):
        if state.get("_no_reducer"):
            # No reducer to rebuild (PyTorch's __setstate__ would build one).
            self.process_group = dist.distributed_c10d._get_default_group()
            nn.Module.__setstate__(self, state)
            self.reducer = None
            self.logger = None
        else:
            # (PyTorch rebuilds the reducer without the parameters set to be ignored, those
            # the first step left out included.)
            self._reducer_stale = False
            super().__setstate__(state)
            _compile_friendly_bucket_cap(self)
        self._install_hook()
        # The copy's all-reduce is set up for the parameters trainable now: one frozen since
        # wrapping (through .module) is out of it too, and refused if unfrozen.
        self._frozen_at_wrap.extend(
            p for p in self.module.parameters()
            if not p.requires_grad and all(p is not q for q in self._frozen_at_wrap))

    def forward(self, *inputs, **kwargs):
        grad = torch.is_grad_enabled()
        self._before_forward(grad)
        if grad and getattr(self, "_reducer_param_list", None) is not None:
            partly = self._partly_frozen()
            if partly:
                raise RuntimeError(self._partly_frozen_message(partly))
        if grad:
            # Tells amp.scale_loss whether this forward's backward all-reduces (see
            # mixprec.amp._model.GRAD_SYNC_DEFERRED): inside no_sync() it keeps the gradients
            # scaled in place for the synced backward to reduce.
            self._tell_amp_models(deferred=not self.require_backward_grad_sync)
        delayed = getattr(self, "_delayed", None)
        if delayed is not None:
            with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
                out = self.module(*inputs, **kwargs)
            if grad:
                delayed.arm(self.require_backward_grad_sync)
            return out
        if getattr(self, "_reducer_stale", False) and any(
                p.requires_grad for p in self._reducer_param_list):
            # (Not while the whole model is frozen, as a GAN's discriminator is during the
            # generator's step: there is nothing to build a reducer of, nor to all-reduce.)
            self._rebuild_reducer()
        first = getattr(self, "_first_step", None)
        if first is not None and grad:
            # (Not under join(): the ranks that ran out of batches would not match the watch's
            # all-reduce. Not with a static graph, set after construction: it finds the unused
            # parameters itself.)
            if self.static_graph:
                first.close()
                self._first_step = None
            else:
                first.arm(self.require_backward_grad_sync and not self._joining())
        try:
            out = super().forward(*inputs, **kwargs)
        except RuntimeError as err:
            if _UNFINISHED_REDUCTION not in str(err):
                raise
            raise RuntimeError(self._unused_parameters_message(str(err))) from err
        if grad:
            self._watch_unsynced_backward(out)
        return out

    def _before_forward(self, grad: bool) -> None:
        """Each forward's bookkeeping with grad enabled, done eagerly (one graph break under
        ``torch.compile``): this wrapper becomes the one that runs the module (see
        _note_forward), and the module's parameters are checked (see _check_parameters). (Not
        for a forward without grad, such as an evaluation through an older wrapper: that must
        not call off the all-reduce of a backward still to come.)"""
        if not grad or getattr(self, "_active", None) is None:  # (or still being built)
            return
        if is_compiling():
            return outside_the_compiler(DistributedDataParallel._before_forward)(self, grad)
        self._note_forward()
        self._check_parameters()

    def _check_parameters(self) -> None:
        """At a forward with grad enabled: a parameter unfrozen, or the module's parameters
        changed (a layer replaced or added), since the all-reduce was set up. The delay mode
        (and a module passed through) follows the module; PyTorch's reducer cannot, so that
        raises (see the messages)."""
        frozen = self._frozen_at_wrap
        unfrozen = any(p.requires_grad for p in frozen)
        if not unfrozen and self._structure_seen == _structure.version():
            return
        if getattr(self, "_delayed", None) is not None:
            self._follow_module()
        elif unfrozen:
            raise RuntimeError(self._unfrozen_message())
        else:
            self._check_structure()

    def _follow_module(self) -> None:
        """The delay mode all-reduces what the module holds now, as Apex's delay mode reduced
        whatever gradients the module's parameters held: parameters unfrozen, added or
        replaced since the last forward join the all-reduce. Modules and parameters new to the
        module get rank 0's values (and the new modules' buffers), as the whole model did at
        wrapping: every rank must make the same change before the same forward."""
        ignored = frozenset(self.parameters_to_ignore)
        known = {id(p) for _, p in self._known_params}
        known_modules = {id(m) for m in self._known_modules}
        state = [p for name, p in self.module.named_parameters()
                 if id(p) not in known and name not in ignored]
        for module_name, sub in self.module.named_modules():
            if id(sub) in known_modules:
                continue
            prefix = f"{module_name}." if module_name else ""
            state.extend(b for name, b in sub.named_buffers(recurse=False)
                         if b is not None and prefix + name not in ignored)
        if state:
            broadcast_coalesced(state, src=0, group=self.process_group)
        delayed = self._delayed
        pairs = _reducer_params(self.module, ignored, also={id(p) for p in delayed.params})
        delayed.refresh([name for name, _ in pairs], [p for _, p in pairs])
        self._known_params = list(self.module.named_parameters())
        self._known_modules = list(self.module.modules())
        self._frozen_at_wrap = [p for _, p in self._known_params if not p.requires_grad]
        self._structure_seen = _structure.version()

    def _check_structure(self) -> None:
        """PyTorch's reducer all-reduces the parameters it was built with: a trainable
        parameter new to the module (a layer replaced or added after wrapping) would train on
        this rank's gradients alone. (One gone from it is left to the reducer: it waits for
        its gradient and names it at the next forward, unless find_unused_parameters=True,
        which takes it. The names ignored here are the user's own, not those the first step
        left out: a left-out layer replaced is new.)"""
        ignored = frozenset(getattr(self.module, "_ddp_params_and_buffers_to_ignore", ()))
        known = {id(p) for _, p in self._known_params}
        current = list(self.module.named_parameters())
        new = [name for name, p in current
               if p.requires_grad and id(p) not in known and name not in ignored]
        if new:
            here = {id(p) for _, p in current}
            gone = [name for name, p in self._known_params if id(p) not in here]
            raise RuntimeError(self._changed_message(new, gone))
        # (A frozen one is refused when unfrozen, as those frozen at wrapping are.)
        self._frozen_at_wrap.extend(p for name, p in current
                                    if not p.requires_grad and id(p) not in known)
        self._known_params = current
        self._structure_seen = _structure.version()

    def _changed_message(self, new: List[str], gone: List[str]) -> str:
        replaced = [name for name in new if name in gone]
        what = []
        if replaced:
            what.append(f"{listed(replaced)} are new parameter objects")
        new = [name for name in new if name not in replaced]
        if new:
            what.append(f"{listed(new)} are new to it")
        return (
            f"DistributedDataParallel: the wrapped module's parameters changed since the "
            f"all-reduce was set up: {' and '.join(what)} (a layer replaced or added after "
            "wrapping, e.g. ddp.module.fc = nn.Linear(...)). PyTorch's reducer all-reduces the "
            "parameters it was built with, so the new ones would train on this rank's "
            "gradients alone and the replicas would drift apart. Wrap the model again after "
            "changing it (ddp = DistributedDataParallel(ddp.module); the new wrapper "
            "broadcasts rank 0's weights), and give the optimizer the new parameters; or "
            "construct the wrapper with delay_allreduce=True, which follows the module's "
            "parameters at every forward, as Apex's delay mode did."
        )

    def _leave_out(self, pairs: List[Tuple[str, nn.Parameter]]) -> None:
        """Called when the first all-reducing backward ends, with the parameters that got no
        gradient on any rank: leave them out of the all-reduce from the next forward on, as
        Apex's DDP did."""
        self._first_step = None
        self._left_out_names = [name for name, _ in pairs]
        if not pairs:
            return
        # Every name PyTorch's reducer builder may look them up by: each alias of a shared
        # parameter, and PyTorch's spelling of a root parameter's (".weight").
        ids = {id(p) for _, p in pairs}
        aliases = set()
        for module_name, sub in self.module.named_modules(remove_duplicate=False):
            for param_name, p in sub.named_parameters(recurse=False):
                if id(p) in ids:
                    aliases.add(f"{module_name}.{param_name}")
                    aliases.add(f"{module_name}.{param_name}" if module_name else param_name)
        self.parameters_to_ignore = set(self.parameters_to_ignore) | aliases
        self._reducer_stale = True  # (rebuilt by the next forward: this backward's is running)
        self._reducer_param_list = [p for p in self._reducer_param_list if id(p) not in ids]
        self._guard_left_out()  # (from now: a second backward of this step may come)
        # (Named: the trainable ones. Those frozen after wrapping were meant to get none.)
        unused = [name for name, p in pairs if p.requires_grad]
        if not unused:
            return
        shown = listed(unused)
        _warn_rank0(
            f"DistributedDataParallel: {shown} got no gradient on any rank in the first step, "
            "so, as in Apex, they are left out of the all-reduce from now on (and keep "
            "grad=None). If they should train, make the loss depend on them; if they are "
            "unused in some steps only, construct the wrapper with "
            "find_unused_parameters=True (or delay_allreduce=True).",
            UserWarning,
        )

    def _rebuild_reducer(self) -> None:
        """PyTorch's reducer again, without the parameters left out (the calls PyTorch makes
        when it unpickles a DDP), with the communication hooks registered so far."""
        if is_compiling():  # (a graph break: the reducer is built eagerly)
            return outside_the_compiler(DistributedDataParallel._rebuild_reducer)(self)
        self._reducer_stale = False
        cap = getattr(self, "_reducer_bucket_bytes_cap", None)
        if cap is not None:  # (what the reducer was built with; see _compile_friendly...)
            self.bucket_bytes_cap = cap
        parameters, expect_sparse_gradient = self._build_params_for_reducer()
        self._reducer_param_list = list(parameters)
        self._ddp_init_helper(
            parameters,
            expect_sparse_gradient,
            self._build_debug_param_to_name_mapping(parameters),
            self.static_graph,
        )
        _compile_friendly_bucket_cap(self)
        if hasattr(self, "_comm_hooks"):  # (PyTorch's record, of the old reducer's hooks)
            self._comm_hooks = []
        hooks, self._comm_hook_record = self._comm_hook_record, []
        for state, hook in hooks:
            self.register_comm_hook(state, hook)
        self._reducer_names = _reducer_param_names(
            self.module, frozenset(self.parameters_to_ignore))

    def _guard_left_out(self) -> None:
        """Raise when a parameter left out by the first step gets a gradient after all (it
        would stay this rank's own): from its gradient hook, or, for one frozen then, from the
        forward that finds it trainable (as for parameters frozen at wrapping)."""
        names = set(self._left_out_names)
        ref = weakref.ref(self)
        for name, p in self.module.named_parameters():
            if name not in names:
                continue
            if p.requires_grad:
                self._left_out_guards.append(
                    p.register_post_accumulate_grad_hook(_left_out_guard(ref, name)))
            elif all(p is not q for q in self._frozen_at_wrap):
                self._frozen_at_wrap.append(p)

    def _note_forward(self) -> None:
        """This wrapper runs its module now: an older wrapper of the same module (the model
        wrapped again, the old wrapper still referenced), in either mode, stops watching and
        guarding it, its delay mode's all-reduce is called off, and its PyTorch reducer, which
        a forward without its backward (a dry run) left waiting, is reset."""
        ref = _ACTIVE.get(self.module)
        previous = ref() if ref is not None else None
        if previous is self:
            return
        _ACTIVE[self.module] = weakref.ref(self)
        self._active = True
        if previous is not None:
            previous._active = False
            if getattr(previous, "_first_step", None) is not None:
                previous._first_step.suspend()
            if getattr(previous, "_delayed", None) is not None:
                previous._delayed.disarm()
            reducer = getattr(previous, "reducer", None)
            if reducer is not None:
                # Its reducer, armed by a forward whose backward never came (a dry run), would
                # take this wrapper's gradients too (not its bucket views: PyTorch's error).
                # Reset as PyTorch does for a new process group; the old wrapper, run again,
                # rebuilds its buckets from its next backward.
                previous._has_rebuilt_buckets = False
                reducer._reset_state()

    def _watch_unsynced_backward(self, out) -> None:
        """Remember whether a backward of a forward run with the all-reduce off may still come
        (enable_allreduce() then would not reach it): until its first gradient arrives, or
        until its output and graph are freed without one (a skipped micro-batch). The hooks on
        the output tensors hold a token; their graph nodes hold the hooks. With the all-reduce
        on, watch for a second backward instead (see _watch_second_backward)."""
        self._unsynced_backward = None
        if self.require_backward_grad_sync:
            self._watch_second_backward(out)
            return
        tensors = [t for t in tree_leaves(out)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        token = _Token()
        self._unsynced_backward = weakref.ref(token)

        def started(grad, token=token):
            self._unsynced_backward = None
            return grad

        for t in tensors:
            t.register_hook(started)

    def _watch_second_backward(self, out) -> None:
        """Warn (rank 0, once per wrapper) when a second backward through this forward's
        outputs reaches the parameters: PyTorch's reducer all-reduces the first backward of
        a forward only, so the second one's gradients stay this rank's own and the replicas
        drift apart silently (the delay mode warns about its own case in _delayed). A hook on
        each output notes the backwards (graph tasks) that run through it; one that reaches no
        parameter (``torch.autograd.grad`` of the input, a gradient penalty) does not count.
        Not under ``torch.compile``, where the hooks would be traced."""
        if is_compiling():
            return
        # (Not on a leaf, a parameter returned as it is: its hooks would stay for good.)
        tensors = [t for t in tree_leaves(out)
                   if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not tensors:
            return
        hook = _second_backward_hook(weakref.ref(self), _Passes())
        for t in tensors:
            t.register_hook(hook)

    def _backward_reaches_parameters(self) -> bool:
        """Whether the backward running now accumulates into any all-reduced parameter."""
        params = getattr(self, "_reducer_param_list", None)
        if not params:
            return False
        cached = self.__dict__.get("_accumulators")
        if cached is None or cached[0] is not params:
            nodes = [torch.autograd.graph.get_gradient_edge(p).node
                     for p in params if p.requires_grad]
            if not nodes:
                # The whole model frozen for now (a GAN's discriminator in the generator's
                # step): nothing to reach, and nothing to keep, or the watch would stay blind
                # once it trains again. (Freezing only some of them after wrapping is refused
                # at the next forward: see _partly_frozen.)
                return False
            cached = self.__dict__["_accumulators"] = (params, nodes)
        return any(map(torch._C._will_engine_execute_node, cached[1]))

    def _second_backward(self, task: int) -> None:
        self._second_backward_task = task  # (for the left-out guard's message)
        if self.__dict__.get("_warned_second_backward") or not self._active:
            return
        self._warned_second_backward = True
        _warn_rank0(
            "DistributedDataParallel: a second backward reached the model's parameters through "
            "the outputs of one forward (loss.backward(retain_graph=True), then another "
            "backward: Apex's several losses, a scale_loss block and a backward per loss_id "
            "after one forward). PyTorch's reducer all-reduces the first backward of each "
            "forward only, so this backward's gradients are this rank's own and the replicas "
            "drift apart. " + SEVERAL_BACKWARDS_ADVICE + " (Warned once per wrapper.)",
            UserWarning,
        )

    def _unsynced_backward_pending(self) -> bool:
        ref = getattr(self, "_unsynced_backward", None)
        return ref is not None and ref() is not None

    def _unfrozen_message(self) -> str:
        unfrozen = {id(p) for p in self._frozen_at_wrap if p.requires_grad}
        names = [n for n, p in self.module.named_parameters() if id(p) in unfrozen]
        shown = listed(names)
        return (
            f"DistributedDataParallel: {shown} were frozen (requires_grad=False) when the model "
            "was wrapped (or in its first step, which left them out of the all-reduce, as "
            "Apex did) and require gradients now. The all-reduce is set up then, so their "
            "gradients would never be averaged across ranks and the replicas would drift "
            "apart. Wrap the model again after changing requires_grad (e.g. model = "
            "DistributedDataParallel(model.module)), or wrap it with every parameter you will "
            "train unfrozen and keep the frozen ones out of the optimizer, or construct it "
            "with delay_allreduce=True, which follows the module's trainable parameters at "
            "every forward, as Apex's delay mode did."
        )

    def _partly_frozen(self) -> List[str]:
        """The reducer's parameters frozen since it was built, if others still train (the
        reducer would wait for their gradients: that step would run on unreduced ones). All
        of them frozen (a GAN's discriminator during the generator's step) is fine: the
        reducer then sees no gradient at all."""
        if self.find_unused_parameters or self.static_graph:
            return []
        if self._first_step is not None and not self._joining():
            return []  # (the first step's watch takes them: see _fire_with_zeros)
        params = self._reducer_param_list
        frozen = [p for p in params if not p.requires_grad]
        if not frozen or len(frozen) == len(params):
            return []
        ids = {id(p) for p in frozen}
        return [name for name, p in self.module.named_parameters() if id(p) in ids]

    def _joining(self) -> bool:
        """Inside ``join()`` (uneven inputs)."""
        return bool(getattr(getattr(self, "_join_config", None), "enable", False))

    def _partly_frozen_message(self, names: List[str]) -> str:
        shown = listed(names)
        return (
            f"DistributedDataParallel: {shown} were frozen (requires_grad=False) since the "
            "all-reduce was set up (after the first step, or in a model or join() where that "
            "step is not watched) while other parameters still train. The all-reduce is set up for "
            "them and would wait for their gradients, so this step would run on unreduced "
            "gradients. Wrap the model again after changing requires_grad (model = "
            "DistributedDataParallel(model.module)), or construct the wrapper with "
            "find_unused_parameters=True or delay_allreduce=True. (Apex re-recorded its "
            "buckets when the trainable parameters changed; freezing before the first step, or "
            "all of a wrapped model at once, needs nothing.)"
        )

    def _unused_parameters_message(self, torch_message: str) -> str:
        names = getattr(self, "_reducer_names", None) or _reducer_param_names(self.module)
        match = re.search(r"did not receive grad for rank \d+:\s*([\d\s,]+)", torch_message)
        unused = []
        if match:
            for index in re.findall(r"\d+", match.group(1)):
                i = int(index)
                unused.append(names[i] if i < len(names) else f"#{i}")
        which = (f"these parameters got no gradient: {', '.join(unused)}" if unused
                 else "some parameters got no gradient")
        # (Inside join(), which the delay mode does not take, its remedies are no way out.)
        joining = self._joining()
        raised = (
            "If the previous backward raised (an out-of-memory error caught to skip the "
            "batch), it stopped before reaching them, and the reducer cannot finish that step "
            "(PyTorch's cannot either)" + (
                "; the delay mode, which could, does not take join()." if joining else
                ": construct the wrapper with delay_allreduce=True, whose all-reduce starts "
                "only after the backward, so a backward that raised on every rank leaves "
                "nothing half done."))
        if self.find_unused_parameters:
            # (Set already, so unused parameters are not it: the backward raised.)
            causes = ("find_unused_parameters=True is set, so the likely cause is a backward "
                      "that raised. " + raised)
        else:
            causes = (
                "Two causes: the backward raised, or these parameters took no part in the "
                "loss. " + raised + " Otherwise make every parameter contribute to the loss in "
                "every step, freeze the unused ones (requires_grad_(False)) before wrapping, "
                "or pass find_unused_parameters=True " + (
                    "" if joining else "(or delay_allreduce=True) ")
                + "to DistributedDataParallel.")
        return (
            f"DistributedDataParallel: in the previous backward pass on rank "
            f"{dist.get_rank()}, {which}, so their gradients were never all-reduced (and that "
            "step may have used unreduced gradients). " + causes + (
                " (Parameters without a gradient on every rank in the first step are left "
                "out, as in Apex; these had one then.)"
                if getattr(self, "_left_out_names", None) is not None else
                " (Apex's rule, leaving out the parameters without a gradient in the first "
                "step, does not apply to a model with sparse gradients or to a first step run "
                "inside join().)")
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped module's ``zero_grad`` (an amp model's reaches its fp32 masters)."""
        self.module.zero_grad(set_to_none)

    def disable_allreduce(self) -> None:
        """Stop all-reducing gradients in backward until :meth:`enable_allreduce` (Apex's
        method; the same as being inside ``no_sync()``): gradients accumulate locally. As with
        ``no_sync()``, it applies from the next forward pass on (Apex's took effect in the
        backward already running; called between a forward and its backward, that backward
        still all-reduces, which leaves the accumulated average right). With
        ``delay_allreduce=True`` it acts as Apex's did: on the backwards that end after it."""
        self.require_backward_grad_sync = False
        self._switch_delayed(False)

    def enable_allreduce(self) -> None:
        """All-reduce gradients in backward again (the default; Apex's method), from the next
        forward pass on; with ``delay_allreduce=True``, as in Apex, from the backward running
        or next to run.

        Raises:
            RuntimeError: called between a forward run with the all-reduce off and its backward
                (Apex's switch acted on that backward; PyTorch's reducer is set up in the
                forward, so that backward would silently not be all-reduced). Not in the delay
                mode, which reads the switch when the backward ends.
        """
        if self._switch_delayed(True):
            self.require_backward_grad_sync = True
            return
        if self._unsynced_backward_pending():
            raise RuntimeError(
                "DistributedDataParallel.enable_allreduce() was called after a forward pass run "
                "with the all-reduce off (disable_allreduce() or no_sync()) and before its "
                "backward: that backward would not be all-reduced, since the all-reduce is set "
                "up in the forward. Call enable_allreduce() before the forward of the "
                "micro-batch whose backward should all-reduce, or construct the wrapper with "
                "delay_allreduce=True, where the switches act on the backward as in Apex."
            )
        self.require_backward_grad_sync = True

    def _switch_delayed(self, sync: bool) -> bool:
        """Apex's switch in the delay mode (False in the reducer's mode): it decides the
        all-reduce at the end of the next backward, and whether amp keeps that backward's
        gradients scaled for a later synced one (see GRAD_SYNC_DEFERRED)."""
        delayed = getattr(self, "_delayed", None)
        if delayed is None:
            return False
        delayed.sync = sync
        self._tell_amp_models(deferred=not sync)
        return True

    def _tell_amp_models(self, deferred: bool) -> None:
        # Whether the backward to come leaves its gradients local (see GRAD_SYNC_DEFERRED).
        for m in getattr(self, "_amp_models", ()):
            setattr(m, GRAD_SYNC_DEFERRED, deferred)
            m.__dict__.pop(_SET_BY_TORCH_DDP, None)  # (ours now, not PyTorch's DDP's)

    def extra_repr(self) -> str:
        return (
            f"message_size={self.message_size}, delay_allreduce={self.delay_allreduce}, "
            f"allreduce_always_fp32={self.allreduce_always_fp32}, "
            f"gradient_average={self.gradient_average}, "
            f"gradient_predivide_factor={self.gradient_predivide_factor}"
        )


# The arguments after `module` that Apex's signature takes by position (a process group passed
# among them is refused in __init__), read off the signature so that the two cannot drift.
_APEX_POSITIONAL = tuple(
    name for name, param in inspect.signature(DistributedDataParallel.__init__).parameters.items()
    if param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and name not in ("self", "module"))

# Apex defined its Reducer in this module; scripts import it from here too.
from mixprec.parallel.reducer import Reducer  # noqa: E402, F401  (after the class: no cycle)
