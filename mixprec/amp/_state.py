"""The state of one ``amp.initialize`` call, and of each optimizer it manages.

``AmpState`` is an ordinary object: its scalers, properties and optimizers. Optimizers find their
state through :func:`optimizer_state`, a weak registry, so ``amp.scale_loss(loss, optimizer)``
needs no process-wide "current" amp and several ``initialize`` calls can live side by side.

Where amp intercepts the optimizer: two step hooks (``Optimizer.register_step_pre_hook`` /
``register_step_post_hook``) and two state-dict pre-hooks (which give a parameter group added
after ``initialize`` its masters before the state is saved or loaded), and nothing else. The
step pre-hook makes a step with overflowed gradients a no-op by setting the gradients to
``None`` (every ``torch.optim`` optimizer skips such parameters, so neither the parameters nor
the moment estimates move); the post-hook copies the fp32 master weights into the half model
(O2); the hooks last as long as the optimizer. Before a step the pre-hook also takes into
the masters any half parameter written in place since amp last set it (version counters; see
:meth:`_OptimizerState.take_model_writes`): PyTorch's DDP broadcasting rank 0's weights, say.
Fused optimizers (which take ``found_inf`` in their kernel, as ``GradScaler`` uses them) skip an
overflowed step on the device instead, and the dynamic loss scale then lives on the device too
(``AmpState.scale_device``): no host sync per step.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import logging
import math
import operator
import re
import sys
import threading
import warnings
import weakref
from typing import Dict, List, Optional, Set, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from mixprec.amp import _multi_tensor
from mixprec.amp._amp_state import attach_apex_optimizer_names
from mixprec.amp._logging import OverflowLog, is_rank_zero, log_rank0
from mixprec.amp._model import (
    GRAD_SYNC_DEFERRED,
    follow_renames_in,
    halves_differ_from_masters,
    holds_no_values,
    overflow_groups,
    overflow_registrations,
    parameter_registrations,
    register_masters,
    registered_since,
    reshaped_parameter_error,
    take_changed_elements,
    torch_ddp_skips_this_backward,
)
from mixprec.amp.scaler import (
    LossScaler,
    any_flag_set,
    flag_non_finite_grads,
    unscale_grads_,
)
from mixprec.normalization._launch import is_compiling, outside_the_compiler

__all__ = ["AmpState", "SyncParamGroupsOnLoad", "optimizer_state", "set_aside_grads"]

_OPTIMIZER_STATES: weakref.WeakKeyDictionary[object, _OptimizerState] = (
    weakref.WeakKeyDictionary()
)


def _live_states() -> List[_OptimizerState]:
    """The states of the live optimizers, as a list taken at once: WeakKeyDictionary's own
    ``values()`` is a generator, which another thread's ``initialize`` (an insertion) made
    fail with "dictionary changed size during iteration" (a ``zero_grad`` of an unrelated
    model). ``dict.copy`` of the underlying dict is one step under the GIL and allocates
    nothing while it walks it (``list(d.items())`` makes a tuple per entry, at which the
    garbage collector can run a dead optimizer's removal callback in mid-walk)."""
    return [state for ref, state in _OPTIMIZER_STATES.data.copy().items()
            if ref() is not None]


def optimizer_state(optimizer) -> Optional[_OptimizerState]:
    """The amp state of ``optimizer``, or None if it never went through ``amp.initialize``."""
    try:
        return _OPTIMIZER_STATES.get(optimizer)
    except TypeError:  # not weak-referenceable, so it cannot have been registered
        return None


# The fp32 masters of deep-copied or unpickled O2 models (standalone, see
# mixprec.amp._model._Fp32StateDict), each with the module and name of its half parameter. An
# optimizer copied along with its model (``copy.deepcopy((model, optimizer))``, one pickle of
# both) is a plain optimizer over these masters, and nothing moves the copy's half gradients
# into them (amp.scale_loss refuses a copy): a plain training loop on the pair would silently
# train only the parameters without masters (BatchNorm). A global step pre-hook, installed with
# the first such copy, refuses that step instead.
_COPY_MASTERS = WeakIdKeyDictionary()
_copies_registered = 0
_COPY_LINKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (key, links)
_copy_hook_installed = False


def register_copied_masters(model: torch.nn.Module) -> None:
    """Note the standalone masters of ``model`` (a deep copy or an unpickled amp model) for
    :func:`_refuse_copied_step`."""
    global _copies_registered, _copy_hook_installed
    clones = {}  # (id of an inference master -> (it, its clone): a tied weight's stays one)
    for module in model.modules():
        hooks = module.__dict__.get("_mixprec_state_dict")
        if hooks is None or not hooks.standalone:
            continue
        ref = weakref.ref(module)
        for name, master in hooks.masters.items():
            if master.is_inference():
                # (Copied or loaded under torch.inference_mode: an inference tensor has no
                # version counter, which the copy's look for writes into its masters reads.
                # A plain tensor of the same values instead, written in place under that mode
                # too; the half parameters' changes are found by their values.)
                if id(master) not in clones:
                    with torch.inference_mode(False):
                        clones[id(master)] = (master, master.clone().requires_grad_(
                            master.requires_grad))
                master = clones[id(master)][1]
                hooks.masters[name] = master
            _COPY_MASTERS[master] = (ref, name)
            param = module._parameters.get(name)
            if param is not None:  # (whose master it is: see _Fp32StateDict.sync)
                hooks._halves.setdefault(name, id(param))
    _copies_registered += 1
    if not _copy_hook_installed:
        register_optimizer_step_pre_hook(_refuse_copied_step)
        _copy_hook_installed = True


def _refuse_copied_step(optimizer, args, kwargs) -> None:
    """Every optimizer's step pre-hook (once a copy exists): refuse a step of an optimizer
    that amp does not manage over a copy's masters whose half parameters have gradients and
    they none (see _COPY_MASTERS)."""
    if is_compiling() or not _COPY_MASTERS or optimizer_state(optimizer) is not None:
        return None
    groups = optimizer.param_groups
    key = (_copies_registered, len(groups), sum(len(g["params"]) for g in groups))
    cached = _COPY_LINKS.get(optimizer)
    if cached is None or cached[0] != key:
        links = [(p, *_COPY_MASTERS[p]) for g in groups for p in g["params"]
                 if p in _COPY_MASTERS]
        cached = _COPY_LINKS[optimizer] = (key, links)
    for master, module_ref, name in cached[1]:
        module = module_ref()
        half = module._parameters.get(name) if module is not None else None
        if half is not None and half.grad is not None and master.grad is None:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(): this optimizer steps the fp32 master "
                f"weights of a copy of a model prepared by amp.initialize (copy.deepcopy, or "
                f"one pickle / torch.save of the model and optimizer together), and the "
                f"gradients of the copy's backward are on its half parameters "
                f"({type(module).__name__}.{name}), which only an optimizer that went through "
                f"amp.initialize moves into the masters: this step would leave every "
                f"master-weighted parameter of the copy unchanged. A copy of a prepared "
                f"optimizer is a plain optimizer. To duplicate a run, build a new model and "
                f"optimizer, amp.initialize them, and load the state dicts (model, optimizer, "
                f"amp.state_dict())."
            )
    return None


def masters_of(tensors) -> List[torch.Tensor]:
    """The fp32 masters that live optimizers keep for the half parameters among ``tensors``
    (the parameters or their ``.data``: the same memory, looked up by it), in their order,
    each once."""
    def memory(t):
        return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(),
                tuple(t.shape), tuple(t.stride()))

    halves = [t for t in tensors if t.dtype in (torch.float16, torch.bfloat16)
              and t.layout is torch.strided]
    if not halves:
        return []
    by_memory = {}
    for state in _live_states():
        if state.amp_state.enabled:
            for half, master in state.pairs:
                by_memory.setdefault(memory(half), master)
    return _found_once((memory(t) for t in halves), by_memory)


def _found_once(keys, table: dict) -> list:
    """``table``'s values for ``keys``, in their order, each object once, missing ones left
    out."""
    out, seen = [], set()
    for key in keys:
        value = table.get(key)
        if value is not None and id(value) not in seen:
            seen.add(id(value))
            out.append(value)
    return out


def mastered_elsewhere():
    """``(half parameter, optimizer)`` for every fp32 master an optimizer alive now keeps."""
    for state in _live_states():
        optimizer = state.optimizer_ref()
        if optimizer is not None and state.amp_state.enabled:
            for half, _ in state.pairs:
                yield half, optimizer


def model_zeroing_grads(model: torch.nn.Module) -> None:
    """Before an amp model's ``zero_grad``: the overflow decisions its optimizers' blocks left
    for the step (``delay_overflow_check=True``) are taken first, on the gradients it drops."""
    run_deferred_checks([state for state in _live_states() if state.deferred is not None
                         and any(m is model for m in state.owner_models())])


def model_zeroed_grads(model: torch.nn.Module, set_to_none: bool) -> None:
    """An amp model's ``zero_grad(set_to_none)`` ran: its optimizers now treat gradients as
    kept tensors, or not (see ``_OptimizerState.grad_tensors_kept``)."""
    for state in _live_states():
        if any(m is model for m in state.owner_models()):
            # (A window held by delay_unscale that this drops: what its first backward set
            # aside goes at the next backward, its gradients having changed: before_backward.)
            state.keeps_grads(not set_to_none)
            if state.grads_scaled:
                # (Either way: set to None over one model of several, the others' window is
                # not gone, and a step after it runs on what is left, as after a full drop.)
                state._held_zeroed = True
                state.window_partly_zeroed(model)
            if state.overflow or state.pending_found is not None:
                state.overflow_dropped_with(model)


def set_aside_grads(params) -> List[torch.Tensor]:
    """The gradients of ``params`` that a ``scale_loss`` block holds aside, in their order.

    Without master weights, a backward inside ``scale_loss`` that accumulates onto gradients
    an earlier block unscaled starts from ``grad=None``: the earlier gradients wait aside
    (``_OptimizerState._stash``) and are added back when the block exits. Code that averages
    gradients inside such a block (``mixprec.parallel.Reducer``) must average these too.
    """
    aside = _set_aside_by_id()
    return _found_once((id(p) for p in params), aside) if aside else []


def _set_aside_by_id() -> Dict[int, torch.Tensor]:
    """The gradients ``scale_loss`` blocks hold aside, by their parameter's ``id``."""
    aside = {}
    for state in _live_states():  # (an optimizer and its hook target share one state:
        for p, g in state._stash:     # setdefault)
            if g is not None:
                aside.setdefault(id(p), g)
    return aside


def set_aside_params(params) -> List[bool]:
    """For each of ``params``, whether a ``scale_loss`` block holds a gradient of it aside
    (see :func:`set_aside_grads`)."""
    aside = _set_aside_by_id()
    return [id(p) in aside for p in params]


def set_aside_zeros(params) -> None:
    """Hold a zero gradient aside for each of ``params`` (none held yet), in the state of the
    optimizer that steps it and set its gradients aside in this block: a Reducer over ranks
    that held different parameters' earlier gradients aside needs the same ones on every
    rank (added back at the block's exit, a zero changes nothing)."""
    wanted = {id(p): p for p in params}
    for state in _live_states():
        if not state._set_aside:
            continue
        for p in state.plain:
            if id(p) in wanted:
                state._stash.append((p, torch.zeros_like(wanted.pop(id(p)))))
    # (One no state set aside for: its earlier gradients were not held aside anywhere here;
    # left, and reduce() averages what the ranks hold as before.)


def hookable_optimizer(optimizer) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` whose step hooks amp uses (a wrapper's ``.optim``)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer) and hasattr(optimizer, "param_groups"):
        return inner
    raise TypeError(
        f"amp.initialize(optimizers=...): got {type(optimizer).__name__}; expected a "
        "torch.optim.Optimizer (or a wrapper such as LARC exposing it as `.optim`), or a list "
        "of them."
    )


_HOOK_TABLES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def _ensure_hook_tables(optimizer: torch.optim.Optimizer) -> bool:
    """Give an ``Optimizer`` subclass that never ran ``Optimizer.__init__`` (Lookahead- and
    torchcontrib-SWA-style wrappers that share their inner optimizer's ``param_groups``) the
    hook tables that ``__init__`` would have set up. Returns whether its ``step`` must run
    the step hooks itself (its class's ``step`` was never hooked by PyTorch, and patching
    the class would break its other instances, which have no tables)."""
    if all(hasattr(optimizer, name) for name in _HOOK_TABLES):
        return False
    for name in _HOOK_TABLES:
        if not hasattr(optimizer, name):
            setattr(optimizer, name, collections.OrderedDict())
    return not getattr(type(optimizer).step, "hooked", False)


class _InstanceMethod:
    """``optimizer.step`` or ``optimizer.zero_grad`` as amp sets it on the object (see
    :func:`_amp_step`, :func:`_amp_zero_grad`): bound to the optimizer weakly, so the optimizer
    holds no reference to itself (freed on ``del``, not at the next garbage collection), and
    re-bound to the copy by ``copy.deepcopy``. It carries ``__func__`` as a bound method does,
    which PyTorch's LR schedulers wrap."""

    def __init__(self, func, optimizer, marks=(), signature=None, own=False):
        self.__func__ = func
        self._ref = weakref.ref(optimizer)
        # The replaced method's signature, for code that inspects it (accelerate's
        # AcceleratedOptimizer passes set_to_none only where zero_grad's signature has it).
        self.__signature__ = signature
        if own:
            # A copy of the method alone (copy.deepcopy(opt.zero_grad), a pickled
            # functools.partial of it): nothing else holds its copied optimizer.
            self._own = optimizer
        for name, value in marks:  # (an LR scheduler's mark on the step it wrapped)
            setattr(self, name, value)

    @property
    def __self__(self):
        return self._ref()

    def __call__(self, *args, **kwargs):
        return self.__func__(self._ref(), *args, **kwargs)

    def _marks(self) -> tuple:
        return tuple((k, v) for k, v in self.__dict__.items()
                     if k not in ("__func__", "_ref", "__signature__", "_own"))

    def __deepcopy__(self, memo):
        import copy

        return _InstanceMethod(self.__func__, copy.deepcopy(self._ref(), memo), self._marks(),
                               self.__signature__, own=True)

    def __reduce__(self):
        return (_InstanceMethod, (self.__func__, self._ref(), self._marks(), self.__signature__,
                                  True))


def _InstanceStep(optimizer, marks=()) -> _InstanceMethod:  # noqa: N802  (a pickled name)
    """amp's ``step`` on an optimizer as pickled before ``_InstanceMethod`` had this name (a
    whole pickle of a LARC, which keeps its instance attributes): the same method, owning its
    optimizer as an unpickled ``_InstanceMethod`` does."""
    return _InstanceMethod(_amp_step, optimizer, marks, None, True)


def _install_instance_method(optimizer, name: str, func) -> bool:
    """Put ``func`` on ``optimizer`` itself as its method ``name``, over whatever it has now:
    its class's, or an instance-level one (an LR scheduler's wrapper of ``step``), which is
    kept in ``_mixprec_<name>_below`` for ``func`` to call. False if it is there already."""
    current = optimizer.__dict__.get(name)
    if isinstance(current, _InstanceMethod) and current.__func__ is func:
        return False
    if current is None:
        below = None  # the class's
    elif getattr(current, "__self__", None) is optimizer:
        below = (current.__func__, True)  # (kept unbound: no reference to the optimizer)
    else:
        below = (current, False)
    setattr(optimizer, f"_mixprec_{name}_below", below)
    marks = [(k, v) for k, v in getattr(current, "__dict__", {}).items()
             if k == "_wrapped_by_lr_sched"]
    try:
        signature = inspect.signature(getattr(optimizer, name))
    except (TypeError, ValueError):
        signature = None
    setattr(optimizer, name, _InstanceMethod(func, optimizer, marks, signature))
    return True


def _call_below(this, name: str, args, kwargs):
    """The ``name`` method that amp's instance-level one replaced (see above)."""
    below = this.__dict__.get(f"_mixprec_{name}_below")
    if below is None:
        return getattr(type(this), name)(this, *args, **kwargs)
    if below[1]:
        return below[0](this, *args, **kwargs)
    return below[0](*args, **kwargs)


def _install_amp_step(optimizer, run_hooks: bool) -> None:
    """Put amp's ``step`` on ``optimizer`` itself (see :func:`_amp_step`)."""
    if _install_instance_method(optimizer, "step", _amp_step):
        optimizer._mixprec_step_runs_hooks = run_hooks
    else:
        optimizer._mixprec_step_runs_hooks = (
            run_hooks or optimizer.__dict__.get("_mixprec_step_runs_hooks", False))


def _amp_zero_grad(this, *args, **kwargs):
    """amp's ``zero_grad`` on an optimizer: the optimizer's own, then what it cannot reach
    (see :meth:`_OptimizerState.grads_zeroed`)."""
    state = optimizer_state(this)
    if state is not None and state.deferred is not None:
        run_deferred_checks([state])  # (before the gradients it looks at go)
    out = _call_below(this, "zero_grad", args, kwargs)
    if state is not None and state.amp_state.enabled:
        set_to_none = kwargs.get("set_to_none", args[0] if args else None)
        state.grads_zeroed(_default_set_to_none(this) if set_to_none is None
                           else bool(set_to_none))
    return out


_SET_TO_NONE_DEFAULTS: Dict[type, bool] = {}


def _default_set_to_none(optimizer) -> bool:
    """What ``optimizer.zero_grad()`` without an argument does: Apex's and mixprec's
    ``FusedAdam(set_grad_none=...)`` choose per object; otherwise the default of the class's
    ``set_to_none`` (True for PyTorch's optimizers)."""
    own = getattr(optimizer, "set_grad_none", None)
    if isinstance(own, bool):
        return own
    cls = type(optimizer)
    if cls not in _SET_TO_NONE_DEFAULTS:
        try:
            param = inspect.signature(cls.zero_grad).parameters.get("set_to_none")
        except (TypeError, ValueError):
            param = None
        default = param.default if param is not None else True
        _SET_TO_NONE_DEFAULTS[cls] = default if isinstance(default, bool) else True
    return _SET_TO_NONE_DEFAULTS[cls]


def _amp_step(this, *args, **kwargs):
    """amp's ``step`` on an optimizer (installed by :func:`_install_amp_step`).

    After an overflow seen on the host it returns at once, as Apex's patched step did, so that
    nothing of the user's step runs (a wrapper's pull-back, an update counter, a rate set
    inside ``step``), not just the parameter updates; a step whose overflow flag is on the
    device runs, and its fused kernel skips the update. An optimizer whose class never ran
    ``Optimizer.__init__`` also has the step hooks run here, around its whole step."""
    state = optimizer_state(this)
    closure = kwargs.get("closure", args[0] if args else None)
    if state is not None and state.deferred is not None and not state.scale_loss_open:
        run_deferred_checks([state])
    if (state is not None and state.overflow and state.amp_state.enabled
            and closure is None):
        if is_compiling():
            # (Traced, the attributes it sets on the optimizer and the state failed inside
            # Dynamo of PyTorch 2.10 when the first compiled step overflowed: run eagerly.)
            outside_the_compiler(_OptimizerState.skip_step)(state)
        else:
            state.skip_step()
        return None
    if state is not None:
        state.keep_pre_hook_last()
    if (state is not None and state.pairs and state.amp_state.enabled
            and not isinstance(this, torch.optim.Optimizer)):
        # A wrapper such as LARC reads the masters (its trust ratio, its weight decay) before
        # its inner optimizer's step hooks run: in-place writes to the half model since amp
        # last set it (PyTorch's DDP broadcasting rank 0's weights, nn.init) go into the
        # masters first, as they do for the inner optimizer's own step.
        state.take_model_writes()
    runs_hooks = this.__dict__.get("_mixprec_step_runs_hooks", False)
    if runs_hooks:
        for hook in list(this._optimizer_step_pre_hooks.values()):
            result = hook(this, args, kwargs)
            if result is not None:
                args, kwargs = result
    if state is not None:
        state.stepping += 1
    try:
        out = _call_below(this, "step", args, kwargs)
    finally:
        if state is not None:
            state.stepping -= 1
    if runs_hooks:
        for hook in list(this._optimizer_step_post_hooks.values()):
            hook(this, args, kwargs)
    return out


def refuse_inner_optimizer(optimizer, cast_param_ids, known=frozenset()) -> None:
    """Refuse, before anything changes, an optimizer that steps an inner optimizer built over
    the parameters themselves (``torch.distributed.optim.ZeroRedundancyOptimizer``'s ``optim``
    holds its shard): amp O2 puts fp32 masters into the outer ``param_groups`` only, so the
    inner one would step half parameters whose gradients amp moved away, and the model would
    silently never train. A wrapper whose ``param_groups`` are its inner optimizer's (LARC)
    passes."""
    inner = getattr(optimizer, "optim", None)
    if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
        return
    outer_groups = {id(g) for g in optimizer.param_groups}
    for group in inner.param_groups:
        if id(group) in outer_groups:
            continue
        for p in group["params"]:
            if id(p) not in known and (id(p) in cast_param_ids
                                       or p.dtype in (torch.float16, torch.bfloat16)):
                raise ValueError(
                    f"amp.initialize: {type(optimizer).__name__} steps an inner "
                    f"{type(inner).__name__} (its `.optim`) over parameters of its own, so the "
                    "fp32 master weights of this opt level (master_weights=True: O2) would never "
                    "be stepped and the model would not train. Use opt_level='O1' (fp32 "
                    "parameters, per-op casting), or O2 with master_weights=False, or an "
                    "optimizer that steps its own param_groups."
                )


def guard_inner_optimizers(optimizer, state: _OptimizerState) -> None:
    """Make an inner optimizer over the masters raise when it is stepped other than from
    ``optimizer.step()`` (SAM's ``base_optimizer``, stepped by its ``second_step()``).

    Under master weights ``optimizer``'s groups hold the fp32 masters; an optimizer that keeps
    another one over the same groups (SAM's ``base_optimizer``, Lookahead's) may step it from
    its own ``step()``, around which amp's hooks run (Lookahead: fine), or directly: then the
    masters are updated and the half model that runs the forward never is, silently (and a
    perturbation written into the masters, SAM's ``first_step()``, never reaches the forward
    either). A wrapper whose hooks amp uses (LARC's ``.optim``) is not guarded."""
    hooked = hookable_optimizer(optimizer)
    masters = {id(m) for _, m in state.pairs}
    for name, inner in list(vars(optimizer).items()):
        if (not isinstance(inner, torch.optim.Optimizer) or inner is optimizer
                or inner is hooked or not hasattr(inner, "_optimizer_step_pre_hooks")):
            continue
        if not any(id(p) in masters for g in inner.param_groups for p in g["params"]):
            continue
        outer_name, inner_name = type(optimizer).__name__, type(inner).__name__

        def refuse_direct_step(_inner, _args, _kwargs, name=name, outer_name=outer_name,
                               inner_name=inner_name):
            if state.stepping or not state.amp_state.enabled:
                return None
            raise RuntimeError(
                f"{outer_name}.{name} ({inner_name}) was stepped directly, not from "
                f"{outer_name}.step(), on an optimizer that amp gave fp32 master weights "
                "(master_weights=True: O2). amp copies the stepped masters into the half model "
                f"around {outer_name}.step() only: stepped this way (SAM's first_step() / "
                "second_step()) the model that runs the forward would never change, nor see a "
                f"perturbation written into the masters. Call {outer_name}.step(closure) "
                "(amp puts the masters into the half model before each evaluation of the "
                "closure; closures need a static loss scale: bf16's default, or "
                "loss_scale=<number>), or use opt_level='O1'."
            )

        state._handles.append(inner.register_step_pre_hook(refuse_direct_step))


def _prime_fused_momentum(optimizer, found_inf: torch.Tensor) -> bool:
    """Before a fused ``torch.optim.SGD`` step that ``found_inf`` may skip: give every
    parameter about to take its first momentum step a momentum buffer of zeros.

    PyTorch's fused SGD makes a parameter's first momentum buffer with ``torch.empty_like``
    and lets its kernel fill it; with ``found_inf`` set the kernel skips the parameter, and the
    uninitialised buffer stays in the optimizer's state for every later step to use (a fp16
    run's first steps overflow at the 2**16 starting scale, so this is the usual start of
    training: the weights came out inf). With ``dampening == 0`` (the default) a zero buffer
    gives the first step's result bit for bit (``0.9 * 0 + g == g``) and a skipped step leaves
    it zero, so no sync is needed. With dampening the first step differs from a step from
    zeros, as it does for a parameter listed twice in its group (a tied weight: PyTorch's
    first step gives each entry a buffer of its own, where one zero buffer would be shared):
    the flag is read on the host for that one step (not inside a CUDA-graph capture), and
    True is returned when it is set, for the step to be skipped as on the host.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    read_flag = False
    for group in optimizer.param_groups:
        if not group.get("fused") or group["momentum"] == 0:
            continue
        params = group["params"]
        if len({id(p) for p in params}) != len(params) and any(
                p.grad is not None and "momentum_buffer" not in optimizer.state.get(p, ())
                for p in params):  # (one without a gradient, frozen, takes no first step)
            # (None primed in this group: PyTorch's fused first step makes every buffer or
            # none, and fails on a group holding some.)
            read_flag = True
            continue
        for p in params:
            if p.grad is None or "momentum_buffer" in optimizer.state.get(p, ()):
                continue
            if group["dampening"] == 0:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            else:
                read_flag = True
    if not read_flag or (found_inf.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    return bool(found_inf.item())


def _params_of(optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


# Tests set this to run the fused cast on CPU tensors through Triton's interpreter.
_FUSED_CAST_ON_CPU = False


def _fused_cast_ok(half_grads: List[torch.Tensor], fresh: List[torch.Tensor]) -> bool:
    """Whether the fused cast + unscale + check may take these half gradients into ``fresh``.

    The kernel walks each tensor as its ``numel()`` elements from ``data_ptr()``, so each fp32
    gradient must have its half gradient's strides. The fp32 ones are ``empty_like`` the
    masters, always dense (contiguous, channels-last, any dense order), so equal strides make
    the half one dense too (strides of size-1 dimensions aside, which address nothing);
    autograd lays out a gradient as its parameter, and the masters were cloned from the
    parameters, so they agree. Other strides (a model moved to
    channels-last after ``initialize``, its masters not), several devices, or no Triton (or
    one older than 3.6, which this kernel was not verified with) take the PyTorch passes.
    """
    device = half_grads[0].device
    if device.type == "cuda":
        if _multi_tensor.interpreter_enabled():
            return False
    elif not (_FUSED_CAST_ON_CPU and device.type == "cpu"):
        return False
    if not _multi_tensor.verified_triton():  # (False without a usable Triton too)
        return False
    index, halves = half_grads[0].get_device(), (torch.float16, torch.bfloat16)
    for g, f in zip(half_grads, fresh):  # (get_device: an int, cheaper than a device object)
        if g.get_device() != index or g.dtype not in halves or g.shape != f.shape:
            return False  # (a shape changed after initialize: the PyTorch pass raises)
        if g.stride() != f.stride() and any(  # (a size-1 dimension's stride is free)
                n > 1 and a != b for n, a, b in zip(g.shape, g.stride(), f.stride())):
            return False
    return True


def _state_cast(key, value, dtype: torch.dtype, scalars: bool):
    """An optimizer's state entry ``key`` with its floating tensors cast to ``dtype``, inside
    lists, tuples and dicts too (LBFGS keeps its history in lists), as
    ``Optimizer.load_state_dict`` casts them. ``step`` counts stay as they are, and 0-dim
    tensors too unless ``scalars`` (NAdam's ``mu_product`` follows a half parameter, as in
    ``load_state_dict``). Returns ``value`` itself when nothing changes."""
    if torch.is_tensor(value):
        if (key != "step" and value.is_floating_point() and value.dtype != dtype
                and (scalars or value.dim() > 0)):
            return value.to(dtype)
        return value
    if isinstance(value, dict):
        return {k: _state_cast(k, v, dtype, scalars) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        cast = [_state_cast(key, v, dtype, scalars) for v in value]
        if all(c is v for c, v in zip(cast, value)):
            return value
        return type(value)(cast)
    return value


def _coalesced_if_fp16(g: torch.Tensor) -> torch.Tensor:
    # A sparse fp16 gradient's duplicate indices, summed only after the inf/NaN check, could
    # still overflow: sum them first (GradScaler coalesces fp16 sparse gradients for the same
    # reason).
    if g.layout is not torch.strided and g.dtype == torch.float16 and not g.is_coalesced():
        return g.coalesce()
    return g


_SCALER_CODES: Optional[frozenset] = None


def _enabled_grad_scaler_calling():
    """PyTorch's ``GradScaler`` whose ``step`` is on the stack above this step pre-hook (its
    ``step`` or ``_maybe_opt_step`` calls ``optimizer.step()``), if it is enabled; else None.
    Looked for a few frames up by code object, so a subclass that inherits those methods
    counts too; a disabled one (``GradScaler(enabled=use_amp)`` left off) only calls step."""
    global _SCALER_CODES
    if _SCALER_CODES is None:
        classes = [getattr(getattr(torch, "amp", None), "GradScaler", None),
                   getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)]
        sharded = sys.modules.get("torch.distributed.fsdp.sharded_grad_scaler")
        classes.append(getattr(sharded, "ShardedGradScaler", None))
        codes = set()
        for cls in classes:
            for name in ("step", "_maybe_opt_step"):
                code = getattr(getattr(cls, "__dict__", {}).get(name), "__code__", None)
                if code is not None:
                    codes.add(code)
        _SCALER_CODES = frozenset(codes)
    frame = sys._getframe(1)
    for _ in range(8):  # (the hook, torch's step wrapper, then the caller of step())
        if frame is None:
            return None
        if frame.f_code in _SCALER_CODES:
            scaler = frame.f_locals.get("self")
            return scaler if getattr(scaler, "_enabled", True) else None
        frame = frame.f_back
    return None


def flag_by_device(grads, flags: Optional[Dict[torch.device, torch.Tensor]] = None
                   ) -> Dict[torch.device, torch.Tensor]:
    """:func:`flag_non_finite_grads` over ``grads`` on several devices: one 0-dim flag per
    device in ``flags`` (made where missing; a new dict if None), returned. No host sync."""
    flags = {} if flags is None else flags
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, on_device in by_device.items():
        flag = flags.get(device)
        if flag is None:
            flag = flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        flag_non_finite_grads(on_device, flag)
    return flags


class BlockBackwards:
    """A tensor hook on a ``scale_loss`` block's scaled loss, noting the autograd graph tasks
    (and the threads) of the backwards through it."""

    def __init__(self):
        self.tasks: Set[int] = set()
        self.threads: Set[int] = set()

    def __call__(self, grad):
        self.tasks.add(torch._C._current_graph_task_id())
        self.threads.add(threading.get_ident())


class ForeignBackwardWatch:
    """Which of an optimizer's directly stepped parameters a backward accumulates into while
    the watch is open: the backward inside another optimizer's ``scale_loss`` block, whose
    values there come scaled by that loss's scale. A pre-hook on each parameter's gradient
    accumulator (it runs on the incoming gradient, before autograd adds it onto the one
    there; unlike a tensor hook, not for a ``torch.autograd.grad`` that returns it) unscales
    them, so that what lands adds onto the optimizer's own gradients as fp32 training's would
    (Apex left them scaled: the optimizer's next block added them on as they were, 65536 times
    too large under a dynamic scale). Into a window this optimizer holds scaled
    (``delay_unscale``) they come at that window's scale instead.

    Hooks, not gradient version counters: a gradient changed in place during the block may be
    that optimizer's own, unscaled, averaged by a ``Reducer.reduce()`` inside the block
    (Apex's two-loss loop), while a backward adding onto a gradient already there (the
    optimizer's own loss backpropagated first) changes it in place as well.

    ``block``: the backwards through the block's scaled loss (:class:`BlockBackwards`, the
    loss's tensor hook). Their gradients count; so do those of another autograd graph task
    run on one of their threads while this optimizer has no ``scale_loss`` block open (the
    inner backward of a reentrant activation checkpoint). Another thread's backward at the same
    moment (an independent training job with its own ``initialize``, inside its own block) is
    no concern of this block. None: every gradient counts (under ``torch.compile``, where
    the loss's tensor hook is not set).

    ``scale``: the block's loss scale (a float, or a 0-dim device tensor). ``unscaled``: ids of
    parameters another watch of the same block unscales already (a layer two other optimizers
    hold), updated with this one's. ``scaler``: the block's loss scaler; under a dynamic
    scale the gradients that land are remembered as unchecked for an overflow (see
    ``_OptimizerState.note_foreign_backward``).
    """

    def __init__(self, state: _OptimizerState, skip: Set[int],
                 block: Optional[BlockBackwards], scale=1.0,
                 unscaled: Optional[Set[int]] = None, scaler: Optional[LossScaler] = None):
        self.state = state
        self.block = block
        self.scale = scale
        self.scaler = scaler
        self.skip = skip
        self.unscaled = unscaled
        self.hit: Dict[int, torch.Tensor] = {}
        self.noted = False  # (whether close() left marks or flags: see foreign_decided)
        # The shares that landed (under a dynamic scale only), flagged for inf/NaN in one
        # multi-tensor pass at close (held until then), and whether one landed in an open block
        # or a window of the optimizer: see _OptimizerState.check_foreign.
        self.landed: List[torch.Tensor] = []
        self.flags: Dict[torch.device, torch.Tensor] = {}
        self.into_held = False
        # (Held-window marks still intact where this block adds onto a window's gradients:
        # moved with the addition at close, or the block closing the window took it for a
        # drop and lost what the window set aside.)
        self.moved: Dict[int, torch.Tensor] = {}
        self.handles = []
        self.plain_hooked = self.half_hooked = False
        # (At a static 1.0 what lands on a parameter no block or window holds needs nothing.)
        if torch.is_tensor(scale) or scale != 1.0:
            self._hook([(p, True) for p in state.plain])
            self.plain_hooked = True
        if state.scale_loss_open or state.grads_scaled:
            self.hook_half()
        state.active_watches.append(self)

    def _hook(self, params) -> None:
        for p, plain in params:
            if not p.requires_grad or id(p) in self.skip:
                continue
            own = self.unscaled is None or id(p) not in self.unscaled
            if self.unscaled is not None:
                self.unscaled.add(id(p))
            self.handles.append(self.state.grad_accumulator(p).register_prehook(
                functools.partial(self._incoming, p, own, plain)))

    def hook_half(self) -> None:
        """Watch the half parameters too (and the others, under a block at a static 1.0):
        the optimizer opened a block, or holds a window, whose gradients take what lands at
        its scale. (Outside those, its next block or zero_grad drops what lands on the half
        ones, as in Apex: no optimizer reads a half gradient at O2, so they are not watched.)"""
        if not self.plain_hooked:
            self.plain_hooked = True
            self._hook([(p, True) for p in self.state.plain])
        if not self.half_hooked:
            self.half_hooked = True
            self._hook([(p, False) for p, _ in self.state.pairs])

    def _incoming(self, param: torch.Tensor, own: bool, plain: bool, grads):
        block, state = self.block, self.state
        if not (block is None or torch._C._current_graph_task_id() in block.tasks
                or (not state.scale_loss_open and threading.get_ident() in block.threads)):
            return None
        # Decided as it lands (the optimizer may have opened a block or a window since the
        # watch began): into its open block, at that block's scale (its exit unscales and
        # checks it); into a window it holds, at the window's (its closing block does); else
        # unscaled, and remembered as unchecked for it.
        if state.scale_loss_open:
            self.into_held = True
            held = state.open_scale
            both = state.open_block
            if (both is not None and torch._C._current_graph_task_id() in both.tasks
                    and state.open_scaler is not self.scaler):
                raise RuntimeError(
                    "amp.scale_loss: one backward runs through the losses of two open "
                    "scale_loss blocks of different loss scalers (their loss_ids differ) and "
                    "reaches parameters of both blocks' optimizers: autograd sums the two "
                    "scaled shares there before amp sees them, so they cannot be unscaled. "
                    "Give both blocks one loss_id, or run one backward per block."
                )
        elif state.grads_scaled:
            self.into_held = True
            held = state.held_scale
            mark = state._held_marks.get(id(param)) if plain else None
            if (mark is not None and param.grad is mark[0]
                    and (param.grad is None or param.grad._version == mark[1])):
                self.moved[id(param)] = param
        else:
            if not plain:
                return None  # (a half gradient no block or window holds: dropped later)
            held = None
            self.hit[id(param)] = param
        factor = (1.0 if held is None else held) / self.scale if own else 1.0
        grad, out = grads[0], None
        if torch.is_tensor(factor) or factor != 1.0:
            if torch.is_tensor(factor) and factor.device != grad.device:
                factor = factor.to(grad.device)
            out = (grad * factor,)
        if self.scaler is not None and self.scaler.dynamic:
            if out is not None:
                # (The incoming tensor, kept until close, not the one autograd then takes as
                # the gradient: a second reference to that one would make autograd copy it.)
                self.landed.append(grad)
            else:  # (rare: a share at the scale of the block or window it lands in)
                flag_by_device([grad], self.flags)
        return out

    def close(self) -> None:
        """Stop watching; mark what the backward wrote (see ``note_foreign_backward``)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        state = self.state
        state.active_watches = [w for w in state.active_watches if w is not self]
        if self.moved and state.grads_scaled:
            marks = state._held_marks
            for p in self.moved.values():
                marks[id(p)] = (p.grad, None if p.grad is None else p.grad._version)
        if self.scaler is not None and self.scaler.dynamic and (self.hit or self.landed
                                                                or self.flags):
            flags = flag_by_device(self.landed, self.flags)
            state.note_foreign_backward(self.hit.values(), self.scaler, list(flags.values()),
                                        self.into_held)
            self.noted = True
        self.hit, self.moved, self.landed, self.flags = {}, {}, [], {}


class DeferredCheck:
    """The overflow decision of ``scale_loss(..., delay_overflow_check=True)`` blocks, left
    for the step: their optimizers' gradients are checked as they are then, after what the
    loop did to them in between (a hand all-reduce across ranks, BERT's post-accumulation
    reduction), so that every rank decides on the same reduced values. Apex left that check
    to the script (its ``update_scale()``, private); here it runs at the first of the
    optimizers' ``step()`` or ``zero_grad()`` (or their model's), for all of them at once,
    and each loss's scale is updated once. The blocks' own flags count too (device tensors,
    not read: no sync at the block's exit)."""

    def __init__(self, amp_state: AmpState):
        self.amp_state = amp_state
        self.loss_ids: List[int] = []
        self.states: list = []
        self.flags: List[torch.Tensor] = []

    def add(self, states, loss_id: int, flags) -> None:
        """One more block's optimizers, loss and flags. Another pending check of any of them
        (a block over optimizers of two pending checks) is taken over: one decision for all."""
        for state in states:
            other = state.deferred
            if other is not None and other is not self:
                self._join(other.loss_ids, other.states, other.flags)
        self._join([loss_id], states, flags)

    def _join(self, loss_ids, states, flags) -> None:
        for loss_id in loss_ids:
            if loss_id not in self.loss_ids:
                self.loss_ids.append(loss_id)
        for state in states:
            if all(state is not s for s in self.states):
                self.states.append(state)
            state.deferred = self
        self.flags.extend(flags)

    def run(self) -> None:
        """Decide now: flag the optimizers' gradients where any is inf/NaN (device ops),
        merged with the blocks' flags, and act on it for each loss as a block's exit does."""
        states = self.states
        for state in states:
            state.deferred = None
        found: Dict[torch.device, torch.Tensor] = {}
        for flag in self.flags:
            kept = found.get(flag.device)
            found[flag.device] = flag.clone() if kept is None else torch.maximum(kept, flag)
        flag_by_device([g for state in states for g in state.grads_now()], found)
        for loss_id in self.loss_ids:
            self.amp_state.record_overflow(states, loss_id, list(found.values()))


def run_deferred_checks(states) -> None:
    """Before a step or a zero_grad of ``states``' optimizers: the overflow decisions that
    ``delay_overflow_check=True`` blocks left for it (see :class:`DeferredCheck`)."""
    for state in states:
        deferred = state.deferred
        if deferred is not None and state.amp_state.enabled:
            if is_compiling():
                outside_the_compiler(deferred.run)()
            else:
                deferred.run()


class _OptimizerState:
    """Per-optimizer amp bookkeeping.

    Attributes:
        pairs: (half model parameter, fp32 master) for every master-weighted parameter.
        plain: parameters the optimizer steps directly (their grads are unscaled in place).
        grads_scaled: the grads still hold scaled values (``delay_unscale=True`` last time).
        overflow: an inf/NaN was found since the last step: the next step is skipped.
        last_step_skipped: whether the most recent ``step()`` was skipped.
    """

    # (A state unpickled from an older mixprec, without the attribute, checks no steps.)
    _scaler_checks_left = 0

    def __init__(self, amp_state: AmpState, optimizer):
        self.amp_state = amp_state
        # Held while the half parameters and their recorded versions disagree by amp's own
        # doing (a post-step copy before its record), and by take_model_writes, which may run
        # in another thread (a state_dict() there).
        self._sync_lock = threading.RLock()
        self.optimizer_ref = weakref.ref(optimizer)
        # The first steps are looked at for a GradScaler left from PyTorch's recipe calling
        # them (see _pre_step); later ones are not, so the check costs nothing per step
        # (a GradScaler that skips the first steps for overflows is caught at one it runs).
        self._scaler_checks_left = 2
        self.pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.plain: List[torch.Tensor] = []
        # The directly stepped parameters' dtypes are to be checked at the next unscale (the
        # first after initialize, and after a group is added): see refuse_plain_made_half.
        self.check_plain_dtypes = False
        self.known_params = 0
        self.grads_scaled = False
        # A held window (grads_scaled) zeroed in place since by a zero_grad(set_to_none=False),
        # the optimizer's or the model's: dropped, as the zero_grad meant (see _pre_step).
        self._held_zeroed = False
        # The last zero_grad (the optimizer's, or an amp model's) kept gradient tensors
        # (set_to_none=False): a master that had a gradient since the last zero_grad that
        # set them to None (or since the start) and has none at a step is given a zero one
        # (momentum, weight decay go on moving it), as fp32 training's kept gradient
        # tensors are, whether the loop zeroes before its backward or after its step. (Its
        # gradients are still freed after each step, so zeroing through a wrapper cannot let
        # them pile up.)
        self.grad_tensors_kept = False
        # (The masters given a gradient since: id -> (master, the gradient's sparse and
        # dense dims when it was a sparse one, else None); recorded at each step while the
        # last zero_grad kept tensors, cleared by one setting them to None.)
        self._had_grads: Dict[int, Tuple[torch.Tensor, Optional[Tuple[int, int]]]] = {}
        # While the last zero_grad set gradients to None (or none ran yet): the ids of the
        # masters that had no gradient at any step since, None before the first such step.
        # A zero_grad keeping tensors after a step then seeds _had_grads from it (the usual
        # loop pays nothing per master: the set is empty after the first full step).
        self._no_grad_since: Optional[Set[int]] = None
        self._noted_pairs = 0  # (how many pairs there were at that last step)
        # id(master) -> (sparse_dim, dense_dim) of its last sparse gradient (an
        # nn.Embedding(sparse=True)): the zero gradient given to it must be sparse too.
        self._sparse_dims: Dict[int, Tuple[int, int]] = {}
        self._held_marks: Dict[int, tuple] = {}  # (see hold_scaled)
        # id(param) -> (param, its gradient (weakly), the gradient's version) for this
        # optimizer's directly stepped parameters whose gradients a backward inside another
        # optimizer's scale_loss wrote (unscaled, but checked for an overflow for that block's
        # optimizers only: see note_foreign_backward). One entry per parameter; a gradient
        # dropped since is not kept alive by it.
        self.foreign_unchecked: Dict[int, Tuple[torch.Tensor, weakref.ref, int, int]] = {}
        self._grad_accumulators: dict = {}  # (see grad_accumulator)
        # By id(scaler), for the losses whose blocks brought shares here: (scaler, those
        # blocks' own overflow decisions, the flags of shares that landed free, and of those
        # that landed in this optimizer's open block or window); whether a step was refused
        # on the marks already, and whether a share landed in a block or window (see
        # _settle_foreign, check_foreign).
        self._foreign_scalers: Dict[int, Tuple[LossScaler, list, list, list]] = {}
        self._foreign_refused = self._landed_in_held = False
        # The watches of other optimizers' blocks open on this one's parameters now.
        self.active_watches: List[ForeignBackwardWatch] = []
        # The scale and scaler of this optimizer's open block (see before_backward).
        self.open_scale, self.open_scaler = None, None
        self.open_block: Optional[BlockBackwards] = None  # (that block's backwards, if noted)
        # The loss scaler, and its scale (a float, or a 0-dim tensor for a scale on the
        # device), that the held (still scaled) gradients carry.
        self.held_scaler: Optional[LossScaler] = None
        self.held_scale = None
        self.held_changes = 0
        self.overflow = False
        self.last_step_skipped = False
        # The models (weak) holding this optimizer's parameters, for grad_sync_deferred(); and
        # the parameter count they were found for.
        self._owners: List[weakref.ref] = []
        self._owners_for = -1
        # Each half parameter's index in pairs (by id), and the pair count it was built for.
        self._pair_index: Dict[int, int] = {}
        self._pair_index_for = -1
        # The process groups its overflow decisions must agree over (overflow_groups()), and
        # the (parameter count, registration count) they were found for.
        self._agree_over: list = []
        self._agree_over_for = (-1, -1)
        # Sync-free skipping (fused optimizers on one CUDA device): the overflow flag stays on
        # the device and the optimizer's fused kernel skips the update itself.
        self.pending_found: Optional[torch.Tensor] = None
        # The overflow decision of delay_overflow_check=True blocks, waiting for the step.
        self.deferred: Optional[DeferredCheck] = None
        # Gradients a step skipped in _pre_step zeroed in place (kept tensors), set back by
        # _post_step once the step body has run without them.
        self._zeroed_in_skip: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._last_step_flag: Optional[torch.Tensor] = None
        # Whether a block unscaled into this optimizer's gradients since its last step: a
        # step after a device-skipped one with none between looks at what that one left.
        self._unscaled_since_step = True
        # A held window (delay_unscale) that a model's zero_grad dropped in part: the directly
        # stepped gradients it left, still scaled, as (tensor, version) by id, and the ids it
        # zeroed or set to None (see window_partly_zeroed).
        self._window_marks: Dict[int, Tuple[torch.Tensor, int]] = {}
        self._window_zeroed: Set[int] = set()
        self._flag_handed_over = False
        # Cached skips_on_device(): the device, False, or None (not known yet; reset when
        # parameters are adopted).
        self._skips_on_device = None
        self._stash: List[Tuple[torch.Tensor, torch.Tensor]] = []
        # Whether the backward in progress set the plain parameters' gradients aside (then
        # every plain parameter missing from _stash had none).
        self._set_aside = False
        self._handles = []
        # amp's step pre-hook: the optimizer's hook table and the hook's key (see
        # keep_pre_hook_last).
        self._pre_hooks = None
        self._pre_hook_id = None
        # How many calls of the optimizer's step() are running (see guard_inner_optimizers).
        self.stepping = 0
        # Inside an amp.scale_loss block of this optimizer (nested blocks are refused).
        self.scale_loss_open = False
        self.reached = True  # (see unscale)
        # Each pair's half parameter's version counter, its master's, and the half parameter's
        # TensorImpl, when amp last put the two in step (take_model_writes); None until the
        # pairs are adopted.
        self._synced_versions: Optional[List[Tuple[int, int, int]]] = None
        # The masters' version counters at the last point every pair was known in step (a
        # cache for the forward's check, push_written_masters), and the masters in pair order.
        self._masters_in_step: Optional[List[int]] = None
        self._masters: List[torch.Tensor] = []
        self._writes_logged = False
        self._data_writes_logged = False
        # The pairs (indices) the last step left as they were, frozen (see _post_step), and
        # the pairs its copy took then (made again when those change).
        self._left_frozen: List[int] = []
        # Ids of half parameters that joined through add_param_group holding a gradient (one
        # from a backward before they joined, which no scale_loss of this optimizer moved):
        # named by the step's refusal. Emptied by each unscale.
        self._joined_with_grad: Set[int] = set()
        self._copied_pairs: Tuple[tuple, list] = ((), [])
        self._registrations_seen = -1  # (parameter_registrations() when renames were looked for)

    # -- set-up ------------------------------------------------------------------------------
    def adopt_params(self, make_masters: bool, cast_param_ids) -> Dict[torch.Tensor, torch.Tensor]:
        """Sort the optimizer's parameters into ``pairs`` and ``plain``.

        Parameters in ``cast_param_ids`` (about to be cast to half) get fp32 masters that replace
        them in ``param_groups`` (and in the optimizer's per-parameter state).
        """
        optimizer = self.optimizer_ref()
        if self.pairs:
            # A later group: writes to the half model since amp last set it go into the
            # masters first, as adopting ends by recording every pair as in step.
            self.take_model_writes()
        masters = {}
        later = bool(self.pairs or self.plain)  # (a group added after initialize's)
        known = {id(p) for p, _ in self.pairs} | {id(m) for _, m in self.pairs}
        known |= {id(p) for p in self.plain}
        if self.pairs:  # (a later group)
            self._refuse_regrouped(optimizer)
        if make_masters:
            refuse_inner_optimizer(optimizer, cast_param_ids, known)
            if self.pairs:  # (a later group: initialize checked the first ones)
                self._refuse_mastered_elsewhere(optimizer, known)
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if id(p) in known:
                    # (Listed twice in its group, a tied weight through two modules'
                    # parameters(): PyTorch warns, and steps it twice; it keeps one master,
                    # in both places, as fp32's one tensor; once among the plain ones, whose
                    # gradients are unscaled in place.)
                    if p in masters:
                        params[i] = masters[p]
                    continue
                if make_masters and (id(p) in cast_param_ids or p.dtype in (
                        torch.float16, torch.bfloat16)):
                    # Cloned before the model is cast, so the master is the exact fp32 value.
                    master = p.detach().clone().float().requires_grad_(p.requires_grad)
                    params[i] = master
                    if p in optimizer.state:
                        optimizer.state[master] = {
                            k: _state_cast(k, v, torch.float32, scalars=False)
                            for k, v in optimizer.state.pop(p).items()
                        }
                    self.pairs.append((p, master))
                    if later and p.grad is not None:
                        self._joined_with_grad.add(id(p))
                    masters[p] = master
                    known.add(id(master))
                else:
                    self.plain.append(p)
                known.add(id(p))
        self.known_params = sum(len(g["params"]) for g in optimizer.param_groups)
        self._skips_on_device = None
        # (The model's cast to half swaps each parameter's .data: no version change follows.)
        self.record_synced()
        link = getattr(hookable_optimizer(optimizer), "_link_half_copies", None)
        if link is not None and masters:
            # An optimizer that writes the half model itself (mixprec.optimizers.FusedAdam):
            # the post-step copy then skips the masters it wrote.
            link(list(masters.items()))
        return masters

    def _refuse_regrouped(self, optimizer) -> None:
        """A group added with ``add_param_group`` holding a half parameter whose fp32 master
        is already in one of this optimizer's groups: PyTorch's own check ("some parameters
        appear in more than one parameter group") compared it with the masters and let it
        in, where the half parameter would never be stepped and the group's settings (a new
        lr for an unfreezing phase) silently did nothing. Refused as PyTorch refuses it, and
        taken back out of ``param_groups``."""
        halves = {id(p) for p, _m in self.pairs}
        for index, group in enumerate(optimizer.param_groups):
            repeated = [p for p in group["params"] if id(p) in halves]
            if repeated:
                del optimizer.param_groups[index]
                raise ValueError(
                    f"optimizer.add_param_group(...) after amp.initialize: {len(repeated)} of "
                    f"the new group's {len(group['params'])} parameters (shapes "
                    f"{[tuple(p.shape) for p in repeated[:3]]}"
                    f"{', ...' if len(repeated) > 3 else ''}) are already in another of the "
                    "optimizer's groups, there as their fp32 master weights "
                    "(amp.master_params(optimizer)): as PyTorch does, a parameter may be in "
                    "one group only. The group was taken back out. To change the settings of "
                    "parameters already there, set them in their group "
                    "(optimizer.param_groups[i]['lr'] = ...), or put them in groups of "
                    "their own before amp.initialize.")

    def _refuse_mastered_elsewhere(self, optimizer, known) -> None:
        """A group added with ``add_param_group`` holding a half parameter that another
        optimizer keeps an fp32 master of: refused before anything changes (two masters
        would drift apart; see frontend._refuse_shared_masters), and taken back out of
        ``param_groups``, as ``add_param_group`` itself refuses a bad group. Left there, it
        refused every later step, and the optimizer could not be used again."""
        elsewhere = {id(h): o for h, o in mastered_elsewhere() if o is not optimizer}
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                other = elsewhere.get(id(p)) if id(p) not in known else None
                if other is not None:
                    del optimizer.param_groups[index]
                    raise ValueError(
                        f"{type(optimizer).__name__}.add_param_group: a parameter of shape "
                        f"{tuple(p.shape)} in the new group already has an fp32 master in "
                        f"another optimizer ({type(other).__name__}); with two, each would "
                        "step its own and they would drift apart. The group was taken back "
                        "out of param_groups. Put each parameter in one optimizer (a "
                        "parameter group gives it its own hyper-parameters)."
                    )

    def match_plain_state_dtypes(self) -> None:
        """Cast the floating state an optimizer already holds for a parameter it steps directly
        (no master) to that parameter's dtype, after the model's cast.

        ``torch.optim.Adagrad`` makes its ``sum`` in its constructor: left fp32 beside a half
        parameter (O3), a fused Adagrad fails at its first step and a checkpoint round trip
        (``load_state_dict`` casts state to the parameter's dtype) would resume from other
        values. The step count stays as it is, as in ``Optimizer.load_state_dict``.
        """
        state = self.optimizer_ref().state
        self.check_plain_dtypes = True
        for p in self.plain:
            values = state.get(p)
            if not values:
                continue
            for key, v in values.items():
                values[key] = _state_cast(key, v, p.dtype, scalars=True)

    def sync_param_groups(self) -> None:
        """Pick up ``optimizer.add_param_group`` calls made after ``initialize``.

        An optimizer freed since it was listed as alive (one left in a reference cycle, which
        the garbage collector can free at any allocation, such as inside another optimizer's
        ``scale_loss``) has no groups left to pick up: nothing to do.
        """
        optimizer = self.optimizer_ref()
        if optimizer is None:
            return
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        if count != self.known_params:
            masters = self.adopt_params(self.amp_state.properties.master_weights, set())
            self.check_plain_dtypes = True
            for model in self.amp_state.models:
                register_masters(model, masters, self.take_model_writes)

    def skips_on_device(self) -> Optional[torch.device]:
        """The device on which an overflow can skip the step without a host sync, or None.

        That needs an optimizer whose fused kernel takes ``found_inf`` (as with ``GradScaler``:
        ``fused=True`` Adam, AdamW, SGD, ...) and all its parameters on one device.
        """
        if self._skips_on_device is None:
            target = hookable_optimizer(self.optimizer_ref())
            devices = {m.device for _, m in self.pairs} | {p.device for p in self.plain}
            # (A group's own "fused" flag too: PyTorch's load_state_dict puts the
            # checkpoint's there, e.g. None from a plain AdamW run loaded into
            # AdamW(fused=True), whose step then refuses found_inf: the host path serves.
            # mixprec's FusedAdam has no such flag.)
            fused = bool(getattr(target, "_step_supports_amp_scaling", False)) and all(
                group.get("fused", True) for group in target.param_groups)
            self._skips_on_device = (next(iter(devices)) if fused and len(devices) == 1
                                     else False)
        return self._skips_on_device or None

    def params_moved(self) -> None:
        """Some masters moved to another device (with their model), or an optimizer load put
        other "fused" flags in its groups: look the skipping path up again."""
        self._skips_on_device = None

    def step_was_skipped(self) -> bool:
        if self._last_step_flag is not None:
            # Read every time, not cached: a CUDA-graph replay rewrites the captured flag.
            self.last_step_skipped = bool(self._last_step_flag.item())
        return self.last_step_skipped

    def install_hooks(self, hook_target: torch.optim.Optimizer) -> None:
        if _ensure_hook_tables(hook_target):
            _install_amp_step(hook_target, run_hooks=True)
        pre = hook_target.register_step_pre_hook(self._pre_step)
        self._handles.append(pre)
        pre_hooks = getattr(hook_target, "_optimizer_step_pre_hooks", None)
        if isinstance(pre_hooks, collections.OrderedDict):
            self._pre_hooks, self._pre_hook_id = pre_hooks, pre.id
        post = hook_target.register_step_post_hook(self._post_step)
        self._handles.append(post)
        # First among the post-hooks, those registered before initialize too: an EMA or a
        # logger run there sees the half model with this step's update (torch runs the
        # global post-hooks after these). (The pre-hook stays last, see keep_pre_hook_last.)
        hooks = getattr(hook_target, "_optimizer_step_post_hooks", None)
        if isinstance(hooks, collections.OrderedDict) and post.id in hooks:
            hooks.move_to_end(post.id, last=False)
        # A group added after initialize gets its masters before the optimizer's state is
        # saved or loaded, not only at the next scale_loss: a resume loads the checkpoint's
        # fp32 moments into fp32 masters (loaded into the half parameters, torch would cast
        # them to half).
        self._handles.append(hook_target.register_state_dict_pre_hook(self._sync_hook))
        self._handles.append(hook_target.register_load_state_dict_pre_hook(self._sync_hook))
        self._handles.append(hook_target.register_load_state_dict_post_hook(self._loaded))

    def keep_pre_hook_last(self) -> None:
        """Move amp's step pre-hook behind the optimizer's others, those registered after
        initialize too (called as each step begins): a pre-hook that writes the weights (a
        clamp, a projection) must run before amp takes the model's writes into the masters;
        run after it, the write was overwritten by the masters when the step ended."""
        hooks, key = self._pre_hooks, self._pre_hook_id
        if hooks and key in hooks and next(reversed(hooks)) != key:
            hooks.move_to_end(key)

    def _loaded(self, optimizer) -> None:
        # A load may change the groups' "fused" flags: decide the skipping path again. And a
        # load between an overflowed backward and its step is a rollback (see forget_overflow).
        self.params_moved()
        self.forget_overflow()

    def forget_overflow(self) -> None:
        """A checkpoint reloaded (the optimizer's or amp's state) after an overflowed backward
        and before its step: a rollback. The overflow belonged to the abandoned run's
        gradients, which are dropped now, as the skipped step would have dropped them, and the
        next step runs (Apex skipped it). A device-side flag is read (one sync, on a load).
        A decision ``delay_overflow_check=True`` left for the step is taken first, as an
        undelayed block's exit took it (r113A R4: the step took it on the loaded state)."""
        run_deferred_checks([self])
        pending = self.pending_found
        if pending is not None and not bool(pending.item()):
            pending = None  # (clean gradients on their way to the step: they stay)
        if not self.overflow and pending is None:
            return
        optimizer = self.optimizer_ref()
        if optimizer is not None:  # (freed since it was listed: see sync_param_groups)
            self._drop_grads(optimizer)
        self.overflow = False
        self.pending_found = None

    def install_skipping_step(self, optimizer) -> None:
        """Make an overflowed step skip ``optimizer.step()`` as a whole, as Apex did (see
        :func:`_amp_step`), on this object only; and give it (and the optimizer whose hooks
        amp uses, a wrapper's inner one) amp's ``zero_grad`` (see :meth:`grads_zeroed`)."""
        _install_amp_step(optimizer, run_hooks=False)
        for target in {id(o): o for o in (optimizer, hookable_optimizer(optimizer))}.values():
            _install_instance_method(target, "zero_grad", _amp_zero_grad)

    def grads_zeroed(self, set_to_none: bool) -> None:
        """After ``optimizer.zero_grad()``, which reaches the parameters in its groups (the
        fp32 masters at O2), what it cannot reach:

        * the half parameters' gradients, which a backward inside ``scale_loss(...,
          delay_unscale=True)`` or DDP's ``no_sync()`` holds there, scaled, for the next
          backward to add onto (leftover micro-batches at the end of an epoch): dropped, or
          the next step's gradients included them, as Apex's O2 ``zero_grad`` zeroed them
          (with ``set_to_none=False`` zeroed in place, as the optimizer zeroes its own);
        * with ``set_to_none=False``, a master that had a gradient since the last
          ``zero_grad`` setting gradients to None gets a zero one at a later step where its
          parameter got none (see ``grad_tensors_kept``);
        * the half gradients that parameters joining through ``add_param_group`` held from
          a backward before they joined (see ``_joined_with_grad``): dropped, either way (no
          optimizer reads a half gradient at O2).
        """
        if self._joined_with_grad:
            for p, _ in self.pairs:
                if id(p) in self._joined_with_grad:
                    p.grad = None
            self._joined_with_grad.clear()
        if self.grads_scaled and set_to_none:
            self._drop_held_window()  # (the optimizer cleared its own parameters' too)
        elif not self.grads_scaled:
            # A half gradient a backward outside this optimizer's scale_loss left (a GAN's
            # generator loss through the discriminator): stale, scaled by the other loss, and
            # read by no optimizer at O2; dropped, as Apex's O2 zero_grad cleared the half
            # model's, so that a step with no backward of its own runs as fp32's would (with
            # set_to_none=False on zero gradients of the masters: see _had_grads).
            for p, master in self.pairs:
                g = p.grad
                if g is None:
                    continue
                if not set_to_none:
                    # (fp32 keeps that gradient, zeroed, and steps it: weight decay and
                    # momentum act on it. So does the master, at the next step.)
                    self._had_grads[id(master)] = (
                        master, (g.sparse_dim(), g.dense_dim()) if g.is_sparse else None)
                p.grad = None
        else:
            # Zeroed in place, as the optimizer zeroed its own: still tensors, which torch's
            # DDP with find_unused_parameters=True needs for a parameter used in the dropped
            # no_sync() window. (The next backward adds onto zeros; what the window set aside
            # is dropped there, its parameters' gradients having changed: before_backward.)
            with torch.no_grad():
                for p, _ in self.pairs:
                    if p.grad is None:
                        continue
                    if p.grad.layout is torch.strided:
                        p.grad.zero_()
                    else:
                        p.grad = None
            self._held_zeroed = True
        self.keeps_grads(not set_to_none)
        self.forget_foreign()
        self.overflow_dropped()

    def overflow_dropped(self) -> None:
        """A ``zero_grad`` (the optimizer's or an amp model's) after an overflowed backward
        and before its step: the loop dropped the bad batch itself (``if not
        isfinite(grad_norm): optimizer.zero_grad(); continue``), so the skip waiting for the
        next ``step()`` goes with the gradients it was for, and the next batch's clean step
        runs (it was skipped silently; Apex's waiting skip did the same). The scale backed
        off already, at the overflowed block's exit."""
        self.overflow = False
        self.pending_found = None

    def overflow_dropped_with(self, model: torch.nn.Module) -> None:
        """``model.zero_grad()`` dropped its gradients after an overflowed backward: the skip
        goes with them (:meth:`overflow_dropped`) unless this optimizer holds other models'
        parameters whose gradients are left and not all finite (the overflow may be theirs:
        stepping on them would write inf/NaN into the weights). Looks at the values only
        where such gradients are left: with a host sync after an overflow the host knows of,
        on the device where the flag waits there (a fused optimizer's, no sync)."""
        optimizer = self.optimizer_ref()
        own = {id(p) for p in model.parameters()}
        own |= {id(m) for p, m in self.pairs if id(p) in own}
        left = [] if optimizer is None else [p.grad for p in _params_of(optimizer)
                                             if id(p) not in own and p.grad is not None]
        # (r112A B3: what a held window set aside of the other models' parameters is left
        # too: it comes back at the window's unscale.)
        left += [g for p, g in self._stash if id(p) not in own]
        flag = self.pending_found
        if (left and not self.overflow and flag is not None
                and all(g.device == flag.device for g in left)):
            # A flag on the device (a fused optimizer's, set at every block): taken again over
            # the gradients left, on the device, with no host sync.
            self.pending_found = torch.zeros_like(flag)
            flag_non_finite_grads(left, self.pending_found)
        elif all(bool(torch.isfinite(g if g.layout is torch.strided
                                     else g.coalesce()._values()).all()) for g in left):
            self.overflow_dropped()

    def keeps_grads(self, keep: bool) -> None:
        """A zero_grad kept gradient tensors (``set_to_none=False``), or not."""
        if keep and not self.grad_tensors_kept and self._no_grad_since is not None:
            # The first zero keeping tensors since gradients were last set to None (a loop
            # zeroing after its step): fp32 now holds a zeroed tensor for every parameter
            # that had a gradient at a step since then.
            never, sparse = self._no_grad_since, self._sparse_dims
            self._had_grads.update((id(m), (m, sparse.get(id(m))))
                                   for _, m in self.pairs[:self._noted_pairs]
                                   if id(m) not in never)
        self.grad_tensors_kept = keep
        if not keep:
            self._had_grads = {}
            self._no_grad_since = None

    def _note_no_grads(self, missing) -> None:
        """After a step (run or skipped) while the last zero_grad set gradients to None: the
        ids of the masters without a gradient at it (see ``_no_grad_since``)."""
        count = len(self.pairs)
        if self._no_grad_since is None:
            self._no_grad_since = set(missing)
        else:
            if self._no_grad_since:
                self._no_grad_since.intersection_update(missing)
            if count > self._noted_pairs:  # (masters added since, a group added: theirs too)
                added = {id(m) for _, m in self.pairs[self._noted_pairs:]}
                self._no_grad_since.update(added.intersection(missing))
        self._noted_pairs = count

    def watch_foreign_backward(self, skip: Set[int], block: Optional[BlockBackwards] = None,
                               scale=1.0, unscaled: Optional[Set[int]] = None,
                               scaler: Optional[LossScaler] = None) -> ForeignBackwardWatch:
        """Watch (and unscale) what a backward inside another optimizer's ``scale_loss`` block
        at ``scale`` accumulates into the directly stepped parameters but those in ``skip``
        (ids of the block's own optimizers' parameters); ``block``, ``unscaled``, ``scaler``:
        see :class:`ForeignBackwardWatch`. :meth:`ForeignBackwardWatch.close` after it. The
        caller syncs the parameter groups first (``scale_loss`` does, for every other
        optimizer, before it picks those with directly stepped parameters), so that a group
        added since is watched too."""
        return ForeignBackwardWatch(self, skip, block, scale, unscaled, scaler)

    def grad_accumulator(self, p: torch.Tensor):
        """``p``'s gradient accumulator (autograd's AccumulateGrad node), held here so that
        every graph reuses it (as DDP holds them): found once, not at every block."""
        node = self._grad_accumulators.get(id(p))
        if node is None or node.variable is not p:
            with torch.enable_grad():
                node = p.view_as(p).grad_fn.next_functions[0][0]
            self._grad_accumulators[id(p)] = node
        return node

    def note_foreign_backward(self, params, scaler: LossScaler, flags=(),
                              into_held: bool = False) -> None:
        """A backward inside a dynamically scaled ``scale_loss`` not given this optimizer
        (``scaler``'s loss) accumulated into ``params``' gradients (onto what they held, or
        new): unscaled, but checked for an overflow for that block's optimizers only.
        Remembered (marks), with ``flags``, whether what landed (there, or in a block or a
        window of this optimizer's, ``into_held``) held an inf or NaN: this optimizer's next
        block checks them apart from its own (:meth:`unscale`), and a step before one
        settles them (:meth:`_settle_foreign`)."""
        for p in params:
            g = p.grad
            if g is not None:
                self.foreign_unchecked[id(p)] = (p, weakref.ref(g), g._version, id(scaler))
        entry = self._foreign_scalers.setdefault(id(scaler), (scaler, [], [], []))
        entry[3 if into_held else 2].extend(flags)
        self._landed_in_held = self._landed_in_held or into_held

    def foreign_decided(self, scaler: LossScaler) -> None:
        """A block that just left marks or flags here (``scaler``'s loss) took its own
        overflow decision: remembered (a bool, or its device flag, not read now), so that
        :meth:`check_foreign` does not back that scale off twice for one event."""
        entry = self._foreign_scalers.get(id(scaler))
        if entry is not None:
            entry[1].append(scaler._last_found)

    def _settle_foreign(self, optimizer) -> None:
        """At a step: the gradients another block left unchecked (see
        :meth:`note_foreign_backward`). Untouched since, the first step on them is refused
        (the fix is the caller's: pass this optimizer to that block). Changed since (clipped,
        all-reduced by hand, added onto by a plain backward, zeroed, replaced), or at the step
        after a refusal, they are checked here (:meth:`check_foreign`). A gradient set to None
        since is the caller's."""
        untouched = [p for p, ref, v, _ in self.foreign_unchecked.values()
                     if p.grad is not None and p.grad is ref() and p.grad._version == v]
        if untouched and not self._foreign_refused:
            self._foreign_refused = True  # (the marks stay: the next step checks them)
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(): {len(untouched)} gradient(s) of this "
                "optimizer's parameters came from a backward inside amp.scale_loss(loss, "
                "<other optimizers>), which checked only those optimizers' gradients for an "
                "inf or NaN: under a dynamic loss scale (where an overflow now and then is "
                "expected) this step would apply them unchecked. Pass this optimizer to that "
                "scale_loss too (a list: amp.scale_loss(loss, [opt_a, opt_b])), or zero its "
                "gradients before the backward meant for it. Optimizers of separate "
                "amp.initialize calls cannot share a scale_loss block (each call has its own "
                "loss scalers): a loss whose backward runs through models of two calls needs "
                "them in one call, amp.initialize([model_a, model_b], [opt_a, opt_b], ...). "
                "(A step called again checks them instead: an overflow skips it.)"
            )
        self.check_foreign({})

    def check_foreign(self, aside: Dict[int, torch.Tensor], own_flags=None):
        """Settle what other blocks brought this optimizer's parameters (see
        :meth:`note_foreign_backward`) and forget it, a host sync or two in these loops only.
        The gradients decide, the flags taken as the shares landed only tell whose loss
        overflowed (a share dropped since, by a model's ``zero_grad()`` or ``p.grad = None``,
        left a flag but no gradient). The marked gradients (a parameter's ``aside`` entry
        where a block set it aside, else its ``.grad``) are looked at: an inf or NaN there
        skips this optimizer's next step and backs off the scale of the losses whose shares
        landed with one, else (it came since: a hand all-reduce brings one from another rank)
        of the losses that left the marks. ``own_flags``: the flags of this optimizer's own
        closing block, which saw the shares that landed in its open block or its window: an
        overflow there, where such a share landed with one, is that share's loss's, and the
        flags come back cleared. Not this optimizer's own loss, which did not overflow there:
        GradScaler backs off for any optimizer's gradients it unscales. Once per event: not
        again where the block that brought the share backed off at its own exit already."""
        marks, scalers, into_held = (self.foreign_unchecked, self._foreign_scalers,
                                     self._landed_in_held)
        self.forget_foreign()
        blamed = set()
        by_key: Dict[int, List[torch.Tensor]] = {}
        for p, _, _, key in marks.values():
            g = aside.get(id(p), p.grad)
            if g is not None:
                by_key.setdefault(key, []).append(g)
        found = {key for key, grads in by_key.items()
                 if any_flag_set(list(flag_by_device(grads).values()))}
        if found:
            blamed = {key for key, e in scalers.items() if any_flag_set(e[2])} or found
        if into_held and own_flags:
            held = {key for key, e in scalers.items() if any_flag_set(e[3])}
            if held and any_flag_set(own_flags):
                blamed |= held
                own_flags = [torch.zeros_like(f) for f in own_flags]
        if blamed:
            self.overflow = True
        for key in blamed:
            scaler, decided = scalers[key][:2]
            if any(bool(f.item()) if torch.is_tensor(f) else f for f in decided):
                continue  # (backed off at that block's exit, for the same backward)
            if scaler.update(True):
                loss_id = next((i for i, s in enumerate(self.amp_state.scalers)
                                if s is scaler), None)
                if loss_id is not None:  # (another call's scaler: its own log stays quiet)
                    self.amp_state.overflow_log.overflow(loss_id, scaler.loss_scale,
                                                         scaler._min)
        return own_flags

    def forget_foreign(self) -> None:
        """Drop the marks and flags other blocks left (gradients zeroed, or checked)."""
        self.foreign_unchecked, self._foreign_scalers = {}, {}
        self._foreign_refused = self._landed_in_held = False

    def _drop_grads(self, optimizer) -> None:
        """The gradients of a step that is skipped: set to None; those of the parameters it
        steps directly zeroed in place while ``grad_tensors_kept`` (as they are after
        GradScaler skips a step, then zero_grad; masters get theirs back at the next step)."""
        masters = {id(m) for _, m in self.pairs}
        had = set()
        for p in _params_of(optimizer):
            if p.grad is None:
                continue
            if id(p) in masters:
                if self.grad_tensors_kept:
                    self._had_grads[id(p)] = _grad_record(p)
                had.add(id(p))
                p.grad = None
            elif self.grad_tensors_kept and p.grad.layout is torch.strided:
                with torch.no_grad():
                    p.grad.zero_()
            else:
                p.grad = None
        if not self.grad_tensors_kept and self.pairs:
            self._note_no_grads(masters - had)

    def skip_step(self) -> None:
        """The step after an overflow, skipped: what the step hooks do for it, without it."""
        optimizer = self.optimizer_ref()
        self._drop_grads(optimizer)
        self._last_step_flag = None
        self.last_step_skipped = True
        self.overflow = False
        # (A device flag of another block of this step's gradients goes with them: kept, it
        # skipped the next clean step.)
        self.pending_found = None
        # What an LR scheduler's wrapper of step() records (it was not called): no warning
        # that the scheduler stepped before the optimizer (one built on a wrapper's inner
        # optimizer included).
        optimizer._opt_called = True
        hookable_optimizer(optimizer)._opt_called = True

    def _sync_hook(self, optimizer, *state_dict):
        if self.amp_state.enabled:
            self.sync_param_groups()

    # -- scale_loss ----------------------------------------------------------------------------
    def grad_sync_deferred(self) -> bool:
        """Whether a model holding this optimizer's parameters ran its last forward inside
        ``no_sync()`` of ``mixprec.parallel.DistributedDataParallel`` or of PyTorch's own DDP
        (see GRAD_SYNC_DEFERRED), or is inside PyTorch's DDP whose backward now does not
        all-reduce (torch_ddp_skips_this_backward)."""
        return any(getattr(m, GRAD_SYNC_DEFERRED, False) or torch_ddp_skips_this_backward(m)
                   for m in self.owner_models())

    def owner_models(self) -> list:
        """The models holding this optimizer's parameters (looked up again after a new group)."""
        if self._owners_for != self.known_params:
            ids = {id(p) for p, _ in self.pairs} | {id(p) for p in self.plain}
            self._owners = [weakref.ref(m) for m in self.amp_state.models
                            if any(id(p) in ids for p in m.parameters())]
            self._owners_for = self.known_params
        return [m for m in (ref() for ref in self._owners) if m is not None]

    def grads_now(self) -> List[torch.Tensor]:
        """The gradients this optimizer would step on now (the masters' at O2), but those
        another block left unchecked, which the step checks apart (:meth:`_settle_foreign`:
        their overflow is that block's loss's)."""
        marks = self.foreign_unchecked
        return ([m.grad for _, m in self.pairs if m.grad is not None]
                + [p.grad for p in self.plain if p.grad is not None and id(p) not in marks])

    def overflow_groups(self) -> list:
        """The process groups over which this optimizer's overflow decisions must agree: those
        of the modules given to a ``mixprec.parallel.Reducer`` that hold any of its parameters
        (looked up again after a new group or a new Reducer)."""
        key = (self.known_params, overflow_registrations())
        if self._agree_over_for != key:
            ids = {id(p) for p, _ in self.pairs} | {id(p) for p in self.plain}
            self._agree_over = overflow_groups(ids)
            self._agree_over_for = key
        return self._agree_over

    def window_partly_zeroed(self, model: torch.nn.Module) -> None:
        """``model.zero_grad()`` (either ``set_to_none``) inside a held window: note the
        directly stepped gradients it left (other models' of this optimizer), still scaled, so
        that a step right after gives them back what the window set aside (``_pre_step``)."""
        if not self.plain:
            return
        own = {id(p) for p in model.parameters()}
        self._window_zeroed |= {id(p) for p in self.plain if id(p) in own}
        for p in self.plain:
            if id(p) in self._window_zeroed:
                self._window_marks.pop(id(p), None)
            elif id(p) not in self._window_marks and p.grad is not None:
                self._window_marks[id(p)] = (p.grad, p.grad._version)

    def hold_scaled(self, scaler: LossScaler, scale) -> None:
        """Leave this backward's gradients scaled in place (delay_unscale, or no_sync())."""
        for watch in self.active_watches:
            watch.hook_half()
        self.grads_scaled = True
        self._held_zeroed = False
        if self._stash:
            # What each parameter set aside has now, to see at the next backward whether the
            # caller dropped the window meanwhile (p.grad = None, a zero_ in place).
            self._held_marks = {id(p): (p.grad, None if p.grad is None else p.grad._version)
                                for p, _ in self._stash}
        self._window_marks, self._window_zeroed = {}, set()
        self.held_scaler, self.held_changes = scaler, scaler.changes
        # (A device scale is updated in place when another optimizer's gradients unscale.)
        self.held_scale = scale.clone() if torch.is_tensor(scale) else scale

    def _rescale_held(self, scaler: LossScaler, scale) -> None:
        """Bring held gradients from the scale they carry to ``scale`` (another loss_id's, or
        this one's after it moved), so that this backward adds onto gradients of its scale."""
        if self.held_scaler is scaler and self.held_changes == scaler.changes:
            return
        old = self.held_scale
        self.hold_scaled(scaler, scale)
        if not (torch.is_tensor(old) or torch.is_tensor(scale)) and old == scale:
            return
        grads = [p.grad for p, _ in self.pairs if p.grad is not None]
        grads += [p.grad for p in self.plain if p.grad is not None]
        grads = [g._values() if g.layout is not torch.strided else g for g in grads]
        if grads:
            with torch.no_grad():  # powers of two for dynamic scales: exact unless inf
                torch._foreach_mul_(grads, scale / old)

    def before_backward(self, scaler: LossScaler, scale) -> None:
        """Before a backward at ``scale`` (``scaler``'s: a float, or a 0-dim device tensor)."""
        # (For a block nested in this one, or open beside it: see ForeignBackwardWatch.)
        self.open_scale, self.open_scaler = scale, scaler
        for watch in self.active_watches:  # (another block open around this one: its half
            watch.hook_half()              # parameters' gradients now take what lands)
        self.sync_param_groups()
        if self.grads_scaled:
            if self._stash:
                # A gradient dropped since the held backward (the caller discarding a window
                # of leftover micro-batches through p.grad = None or a zero_ in place): what
                # was set aside before the window goes with it, as in fp32 training.
                marks = self._held_marks
                self._stash = [(p, g) for p, g in self._stash
                               if id(p) in marks and p.grad is marks[id(p)][0]
                               and (p.grad is None or p.grad._version == marks[id(p)][1])]
            self._rescale_held(scaler, scale)
            return
        # A half parameter's gradient left from a backward outside this optimizer's scale_loss
        # (a GAN's generator loss run through the discriminator) is stale, and scaled by
        # another loss's scale: the optimizer cannot see it to zero it, since it holds the
        # masters. This backward's gradients start from None, as in Apex; what earlier
        # backwards contributed through scale_loss is already in the masters' gradients.
        for p, _ in self.pairs:
            p.grad = None
        if not scaler.dynamic and scaler.loss_scale == 1.0:
            return
        # Grads already hold unscaled values from an earlier backward (accumulation without
        # delay_unscale): set them aside so the new scaled grads can be unscaled alone, then
        # add them back. Masters accumulate on their own, so only plain params need this.
        # A gradient that is a view (a bucket of DDP's reducer, gradient_as_bucket_view=True)
        # is set aside as a copy: the reducer writes the next gradient into the same memory.
        self._stash = [(p, p.grad.clone() if p.grad._is_view() else p.grad)
                       for p in self.plain if p.grad is not None]
        for p, _ in self._stash:
            p.grad = None
        self._set_aside = True

    def abandon_backward(self) -> None:
        """The ``scale_loss`` block raised (a backward out of memory, say, which the caller skips
        to go on with the next micro-batch): give back the gradients as they were before it.

        The unscaled gradients of earlier backwards, set aside by :meth:`before_backward`,
        return to their parameters, and what the failed backward left (partial and scaled) is
        dropped; without this they were lost. Gradients held scaled (``delay_unscale``) were
        not set aside, and a partial backward's share of them cannot be told apart: left as
        they are.
        """
        if not self.grads_scaled:
            for p, _ in self.pairs:  # (None before the block: before_backward set them so)
                p.grad = None
        if self._set_aside:
            stashed = {id(p): g for p, g in self._stash}
            for p in self.plain:
                p.grad = stashed.get(id(p))
        self._stash = []
        self._set_aside = False

    def _parameter_names(self) -> Dict[int, List[str]]:
        """Every name of each parameter of this call's models (several for a tied one), in
        the models' order, by id: for error messages only (a walk over the models)."""
        names: Dict[int, List[str]] = {}
        for model in self.amp_state.models:
            for name, p in model.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(name)
        return names

    def refuse_plain_made_half(self, skip: Set[int] = frozenset()) -> None:
        """Raise, before this backward's gradients are moved, when a parameter the optimizer
        steps directly in fp32 (all of them at O1, the BatchNorm layers amp keeps fp32 at
        O2/O3) got a gradient in a half dtype: a cast of one layer after ``initialize``
        (``model.apply(fix_bn)``, the old workaround for Apex's eval-mode BatchNorm error;
        ``layer.half()``) made it half, so it would train with no fp32 copy and be saved
        half. The whole model's conversion is refused where it is made (see the amp model's
        ``_apply``); a layer's cannot be seen there. Checked at the first unscale after
        ``initialize`` and after each ``add_param_group`` (where a ported script's setup
        casts), not at every step: a dtype read per parameter and step would cost the host
        ~0.1 us each."""
        fp32 = self.amp_state.fp32_params
        made_half = [p for p in self.plain if p.grad is not None and id(p) not in skip
                     and p.dtype in (torch.float16, torch.bfloat16) and id(p) in fp32]
        if not made_half:
            self.check_plain_dtypes = False
            return
        names = self._parameter_names()
        shown = [names.get(id(p), [f"a parameter of shape {tuple(p.shape)}"])[0]
                 for p in made_half[:4]]
        more = f" and {len(made_half) - 4} more" if len(made_half) > 4 else ""
        raise RuntimeError(
            f"amp: {', '.join(shown)}{more} "
            f"{'is' if len(made_half) == 1 else 'are'} {made_half[0].dtype} now, but amp."
            "initialize left them fp32 for the optimizer to step directly, without master "
            "weights: a cast after initialize (model.apply(fix_bn), layer.half(), "
            ".to(dtype)) made them half, and they would train in half precision with no "
            "fp32 copy and be saved half. amp keeps BatchNorm in fp32 in train and eval mode, "
            "so the old workaround for Apex's eval-mode BatchNorm dtype error (casting the "
            "BatchNorm layers to half) is not needed: drop the cast. For half parameters "
            "with fp32 master weights use opt_level='O2'; for BatchNorm in half pass "
            "keep_batchnorm_fp32=False.")

    def unscale(self, scaler: LossScaler, skip: Set[int] = frozenset()) -> List[torch.Tensor]:
        """Move this backward's gradients, unscaled, to where the optimizer reads them.

        ``skip``: ids of directly stepped parameters another optimizer of the same block
        unscaled already (a layer shared by two models, each with its optimizer)."""
        if self.check_plain_dtypes:
            self.refuse_plain_made_half(skip)
        check = scaler.dynamic
        self._joined_with_grad.clear()
        # Master-weighted params: half grad -> fp32, unscaled, added into the master's grad.
        # The cast happens before the unscale so small gradients do not underflow in half.
        half_grads, targets, sparse_fresh, sparse_targets = [], [], [], []
        for p, master in self.pairs:
            g = p.grad
            if g is None:
                continue
            p.grad = None
            if g.layout is torch.strided:
                half_grads.append(g)
                targets.append(master)
            else:  # sparse (e.g. nn.Embedding(sparse=True)): cast, then sum duplicate indices
                sparse_fresh.append(g.float().coalesce())
                sparse_targets.append(master)
                self._sparse_dims[id(master)] = (g.sparse_dim(), g.dense_dim())
        if half_grads and half_grads[0].requires_grad:
            # backward(create_graph=True) (second-order optimizers, gradient penalties through
            # .grad): the fp32 masters' gradients are a copy, with no graph back to the model,
            # so a second derivative taken from them would silently miss every term.
            raise RuntimeError(
                "amp.scale_loss: the backward ran with create_graph=True, but under "
                "master_weights (O2) the gradients the optimizer reads are fp32 copies of the "
                "half model's, with no graph back to it, so a second derivative through them "
                "would silently come out wrong. Use opt_level='O1' (the model's own gradients, "
                "graph kept), or compute the higher-order term with torch.autograd.grad on the "
                "model's parameters before scale_loss exits."
            )
        # Laid out as the masters, as autograd lays out a parameter's gradient: the model
        # moved to channels-last after initialize gave a contiguous master a channels-last
        # gradient, which fused optimizers (pairing elements by memory offset) misread.
        fresh = [torch.empty_like(master) for master in targets]
        plain_params = [p for p in self.plain if p.grad is not None and id(p) not in skip]
        plain_grads = [p.grad for p in plain_params]
        if sparse_fresh or any(g.layout is not torch.strided for g in plain_grads):
            # Sparse gradients (rare; the dense case pays one layout check per gradient) are
            # unscaled and checked through their values, a dense view. Only a check needs
            # them coalesced: unchecked, they reach the optimizer as in a plain half model.
            for p in plain_params if check else ():
                p.grad = _coalesced_if_fp16(p.grad)
            plain_grads = [
                g if g.layout is torch.strided else g._values()
                for g in [p.grad for p in plain_params] + sparse_fresh
            ]
        found = {}
        if fresh and (check or scaler.loss_scale != 1.0) and _fused_cast_ok(half_grads, fresh):
            # One Triton pass casts, unscales and checks (6 bytes per element instead of 14).
            device = half_grads[0].device
            found[device] = torch.zeros((), dtype=torch.float32, device=device)
            _multi_tensor.cast_unscale_check_(half_grads, fresh, scaler.inv_scale(device),
                                              found[device], check=False)
            flags = unscale_grads_(plain_grads, scaler, check, found=found)
        else:
            if fresh:
                try:  # (one multi-tensor cast where supported)
                    torch._foreach_copy_(fresh, half_grads)
                except RuntimeError:
                    self._refuse_reshaped()
                    raise
            flags = unscale_grads_(fresh + plain_grads, scaler, check)
        flags = flags or []
        stash = self._stash
        if self.foreign_unchecked or self._foreign_scalers:
            # Gradients another optimizer's block left here (unscaled as they landed, never
            # checked for this one), set aside for this block: checked apart from its own, so
            # that an inf among them backs off that block's loss, not this one's (which would
            # then keep overflowing there, every step skipped).
            marks = self.foreign_unchecked
            flags = self.check_foreign({id(p): g for p, g in stash if id(p) in marks}, flags)
            stash = [(p, g) for p, g in stash if id(p) not in marks]
        if (check and stash and len(flags) <= 1 and self._last_step_flag is not None):
            # The gradients set aside were checked at their own block; but after a step the
            # device skipped (a fused optimizer's kernel, the flag never read) they stay, inf
            # or NaN, and this block's flag alone let the next step apply them. Looked at
            # again, as GradScaler's unscale_ looks at every gradient (device ops, no sync);
            # a block that reached none of this optimizer's parameters gets a flag of its own.
            device = flags[0].device if flags else stash[0][1].device
            if all(g.device == device for _, g in stash):
                if not flags:
                    flags = [torch.zeros((), dtype=torch.float32, device=device)]
                flag_non_finite_grads([g for _, g in stash], flags[0])
        self._unscaled_since_step = True
        # (Whether this backward gave any of the optimizer's parameters a gradient.)
        self.reached = bool(half_grads or sparse_fresh or plain_params)
        del half_grads
        accumulate_into, accumulate = [], []
        for master, g in zip(targets, fresh):
            if master.grad is None:
                master.grad = g
            else:
                accumulate_into.append(master.grad)
                accumulate.append(g)
        for param, g in [*zip(sparse_targets, sparse_fresh), *self._stash]:
            if param.grad is None:
                param.grad = g
            elif param.grad.layout is torch.strided and g.layout is torch.strided:
                accumulate_into.append(param.grad)
                accumulate.append(g)
            elif param.grad.layout is torch.strided:
                param.grad.add_(g)  # dense += sparse, in place
            else:
                param.grad = param.grad + g  # sparse + sparse or dense
        if accumulate:
            torch._foreach_add_(accumulate_into, accumulate)
        self._stash = []
        self._set_aside = False
        self._end_window_marks()  # (the window, if any, ends here: none of its grads kept)
        self.grads_scaled = False
        self.held_scaler = self.held_scale = None
        return flags

    def _drop_held_window(self) -> None:
        """Forget a window held scaled (delay_unscale, no_sync()): the half parameters'
        gradients go, and what its first backward set aside goes with them."""
        for p, _ in self.pairs:
            p.grad = None
        self.grads_scaled = False
        self._held_zeroed = False
        self._stash = []
        self._set_aside = False
        self._end_window_marks()
        self.held_scaler = self.held_scale = None

    def _end_window_marks(self) -> None:
        """A held window ends (unscaled, or dropped): its marks go, and no gradient of it is
        kept alive by them (r113A R3)."""
        self._window_marks, self._window_zeroed, self._held_marks = {}, set(), {}

    def _held_grads_gone(self) -> bool:
        """Whether every gradient a held window kept scaled is gone (``p.grad = None``)."""
        return (all(p.grad is None for p, _ in self.pairs)
                and all(p.grad is None for p in self.plain))

    def _refuse_reshaped(self) -> None:
        """Raise the clear error for a half parameter whose shape changed after
        ``initialize``, if there is one (the error path only: named through the models)."""
        names = self._parameter_names()  # (a tied one's: the resized embedding's own first)
        for p, master in self.pairs:
            if p.shape != master.shape:
                raise reshaped_parameter_error(names.get(id(p), ["?"]), master, p)

    def discard_grads(self) -> None:
        """An overflow: the next step will be skipped, and frees the gradients. Until then
        they stay as unscaled (non-finite) as Apex left them, so that a gradient norm taken
        before ``step()`` reads inf/NaN (Tacotron2-style ``is_overflow = isnan(grad_norm)``,
        a logged norm), not 0."""
        self.overflow = True
        self._stash = []

    # -- step hooks ----------------------------------------------------------------------------
    def _refuse_step_inside_the_block(self) -> None:
        """``optimizer.step()`` inside this optimizer's ``scale_loss`` block (an Apex-era slip:
        the step indented into it): its gradients are still multiplied by the loss scale and
        unchecked (O1 stepped 65536 times too far, silently), or not yet on the fp32 masters
        (O2). Under a static scale of 1.0 without masters nothing differs: let it run."""
        scaled = any(s.dynamic or s.loss_scale != 1.0 for s in self.amp_state.scalers)
        if not scaled and not self.pairs:
            return
        where = " and ".join(
            (["still multiplied by the loss scale"] if scaled else [])
            + (["not yet on the fp32 master weights"] if self.pairs else []))
        raise RuntimeError(
            "optimizer.step() was called inside `with amp.scale_loss(...)`: the block "
            "unscales the gradients" + (" into the fp32 master weights" if self.pairs else "")
            + (" and checks them for inf/NaN" if scaled else "") + " when it exits, so "
            f"here they are {where}. Call optimizer.step() after the block: `with "
            "amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`, then, "
            "dedented, `optimizer.step()`.")

    def _pre_step(self, optimizer, args, kwargs):
        if not self.amp_state.enabled:
            return
        if not is_compiling():
            # (A group added since the last scale_loss gets its masters now: stepped before,
            # its half parameters took the optimizer's update directly, from half gradients
            # still multiplied by the loss scale. One count over the groups per step.)
            self.sync_param_groups()
        if self._scaler_checks_left and not is_compiling():  # (no frame walks in a trace)
            self._scaler_checks_left -= 1
            scaler = _enabled_grad_scaler_calling()
            if scaler is not None:
                raise RuntimeError(
                    f"{type(scaler).__name__}.step() was called on the "
                    f"{type(optimizer).__name__} that amp.initialize prepared: amp.scale_loss "
                    "already scales the loss, unscales the gradients and skips the steps that "
                    "overflow, so a GradScaler kept from PyTorch's recipe scales them a second "
                    "time (in fp16: more overflows, steps lost, both scales settling lower; "
                    "with a fused optimizer the two hand it conflicting flags). Drop "
                    "scaler.scale(), scaler.step() and scaler.update(): `with "
                    "amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`, "
                    "then `optimizer.step()` (docs/migrating.md, 'From torch.amp').")
        if self.scale_loss_open:
            self._refuse_step_inside_the_block()
        # torch passes the step's positional args with the optimizer itself first.
        rest = args[1:] if args and args[0] is optimizer else args
        closure = kwargs.get("closure", rest[0] if rest else None)
        if closure is not None and any(s.dynamic for s in self.amp_state.scalers):
            raise RuntimeError(
                "optimizer.step(closure) was called on an optimizer managed by amp with dynamic "
                "loss scaling. The optimizer evaluates the closure inside step(), after amp "
                "decided whether to skip it (LBFGS evaluates it several times), so an overflow "
                "there could not be skipped. Use a plain optimizer.step() after "
                'amp.scale_loss, or pass loss_scale=<number> to amp.initialize.'
            )
        replaced = None
        if closure is not None and self.pairs:
            # An optimizer may evaluate its closure several times in one step (LBFGS),
            # updating the fp32 masters in between: each evaluation must see the half model
            # made from the masters as they are then, not as they were when step() began.
            replaced = self._synced_closure(closure)
        if self.grads_scaled and (self._held_zeroed or self._held_grads_gone()):
            # The held window was dropped (zero_grad, set_to_none=False included, the model's
            # zero_grad, p.grad = None): nothing scaled is left to step on. The step runs on
            # what the optimizer holds, as after a zero_grad in fp32 training.
            if self._held_zeroed and self.plain:
                # (r112A B2: a model's zero_grad over part of the window, one model's of
                # several: the window's gradients it did not reach are still scaled; they go,
                # and what the window set aside comes back, as the masters keep theirs.)
                marks = self._window_marks
                aside = {id(p): g for p, g in self._stash}
                for p in self.plain:
                    mark = marks.get(id(p))
                    if (p.grad is not None and mark is not None and p.grad is mark[0]
                            and p.grad._version == mark[1]):
                        p.grad = aside.get(id(p))
            self._drop_held_window()
        if self.grads_scaled:
            raise RuntimeError(
                "optimizer.step() was called right after amp.scale_loss(..., delay_unscale=True) "
                "or a backward under DistributedDataParallel's no_sync()/disable_allreduce(): "
                "the gradients are still scaled and not all-reduced. Use these only for the "
                "inner micro-batches; run the last backward before step() with the all-reduce "
                "on and delay_unscale=False."
            )
        if self.foreign_unchecked or self._foreign_scalers:
            self._settle_foreign(optimizer)
        if (not self.overflow and self.pending_found is not None and self.grad_tensors_kept
                and self._had_grads and self.pairs):
            # (r112A B4: the zero gradients a kept-tensor zero_grad owes the masters first, so
            # that their first momentum buffers are primed too: else the fused kernel makes
            # them with empty_like and skips, leaving garbage.)
            self._zero_grads_for_unused_masters()
        if (not self.overflow and self.pending_found is not None
                and _prime_fused_momentum(optimizer, self.pending_found)):
            # (A first momentum step that overflowed, which only the host could skip cleanly.)
            self.pending_found = None
            self.overflow = True
        if self.overflow:
            # (Recorded, or zeroed where kept, as any skipped step's gradients are: see
            # _drop_grads. The step body then sees none; the zeroed tensors come back after
            # it, in _post_step.)
            self._drop_grads(optimizer)
            params = _params_of(optimizer)
            self._zeroed_in_skip = [(p, p.grad) for p in params if p.grad is not None]
            for p in params:
                p.grad = None
            return
        if (self.pending_found is None and self._last_step_flag is not None
                and not self._unscaled_since_step and self.plain):
            # (r112A B1: the last step was the device's and no block unscaled since: its
            # gradients, inf where it skipped, are still there; looked at again, no sync.)
            left = [p.grad for p in self.plain if p.grad is not None]
            if left and all(g.device == left[0].device for g in left):
                self.pending_found = torch.zeros((), dtype=torch.float32, device=left[0].device)
                flag_non_finite_grads(left, self.pending_found)
        if self.pending_found is not None:
            # GradScaler's protocol for fused optimizers: the kernel leaves parameters, moments
            # and step counts alone where found_inf is set. Gradients are already unscaled.
            if is_compiling():
                # Inside torch.compile(optimizer.step): Dynamo (torch 2.13) drops attributes
                # set on an Optimizer in traced code when a graph break follows (the fused
                # kernel call is one), so the kernel saw no flag and amp's post-step hook
                # failed deleting it. Set them eagerly there (a graph break; the step breaks
                # there anyway).
                outside_the_compiler(_hand_over_flag)(optimizer, self.pending_found)
            else:
                _hand_over_flag(optimizer, self.pending_found)
            self._last_step_flag = self.pending_found
            self.pending_found = None
            self._flag_handed_over = True
        if self.pairs:
            self.take_model_writes()
            if self._left_frozen:
                if not is_compiling():
                    self._take_writes_while_frozen()
                elif any(self.pairs[i][0].requires_grad for i in self._left_frozen
                         if i < len(self.pairs)):
                    # (Traced: an unfreezing retraces the step; the writes are taken eagerly.)
                    outside_the_compiler(self._take_writes_while_frozen)()
        if self.grad_tensors_kept and self._had_grads:
            self._zero_grads_for_unused_masters()
        if replaced is None:
            # (A closure's step is checked after each evaluation, in _synced_closure: the
            # closure zeroes the gradients itself, so a half gradient left from before the
            # step, one of a layer that joined the optimizer since, say, is not its own.)
            self._refuse_half_grads()
            return None
        if "closure" in kwargs:
            return args, {**kwargs, "closure": replaced}
        first = 1 if args and args[0] is optimizer else 0
        return (*args[:first], replaced, *args[first + 1:]), kwargs

    def _refuse_half_grads(self) -> None:
        # (One pass over the pairs each step; the names only where something is left.)
        left = [p for p, _ in self.pairs if p.grad is not None]
        if not left:
            return
        joined = [p for p in left if id(p) in self._joined_with_grad]
        if joined:
            shapes = ", ".join(str(tuple(p.shape)) for p in joined[:4])
            raise RuntimeError(
                f"optimizer.step(): {len(joined)} half parameter(s) (shapes {shapes}"
                f"{', ...' if len(joined) > 4 else ''}) joined this optimizer through "
                "add_param_group holding a gradient from a backward before they joined, which "
                "no amp.scale_loss of this optimizer has moved to their fp32 master weights "
                "(from a backward inside amp.scale_loss it is still multiplied by the loss "
                "scale). "
                "Drop it before the step (optimizer.zero_grad(), or p.grad = None for those "
                "parameters), or run the backward again inside `with amp.scale_loss(loss, "
                "optimizer) as scaled_loss: scaled_loss.backward()`."
            )
        raise RuntimeError(
            "optimizer.step(): the half model's gradients were never moved to the fp32 "
            "master weights. Run the backward pass inside `with amp.scale_loss(loss, "
            "optimizer) as scaled_loss: scaled_loss.backward()`. If it ran inside an "
            "amp.scale_loss given other optimizers only (a second loss reaching this "
            "optimizer's parameters too), pass this optimizer to that scale_loss as "
            "well (a list: amp.scale_loss(loss, [opt_a, opt_b]))."
        )

    def _zero_grads_for_unused_masters(self) -> None:
        """Give a zero gradient to each master that had one since the last ``zero_grad``
        setting gradients to None (or since the start) and got none at this step (its
        parameter unused), as fp32's kept, zeroed tensor would be: a sparse one where its
        gradients were sparse (SparseAdam takes no dense gradient). A parameter frozen since
        (``requires_grad_(False)``, the usual ``p.grad = None`` beside it) is left out from
        then on: fp32's optimizer skips it once its gradient is gone, and at O2 its half
        gradient is already None, so the freeze is what can be seen."""
        had = self._had_grads
        for p, master in self.pairs:
            record = had.get(id(master))
            if record is None or master.grad is not None:
                continue
            if not p.requires_grad:
                del had[id(master)]
                continue
            dims = record[1]
            if dims is None:
                master.grad = torch.zeros_like(master)
            else:
                sparse_dim, dense_dim = dims
                # (Made empty and given its dims, not through torch.sparse_coo_tensor, whose
                # check_invariants=False still warned "Sparse invariant checks are implicitly
                # disabled" on PyTorch 2.11 with CUDA.)
                grad = torch.zeros(master.shape, dtype=master.dtype, device=master.device,
                                   layout=torch.sparse_coo)
                grad.sparse_resize_and_clear_(master.shape, sparse_dim, dense_dim)
                master.grad = grad._coalesced_(True)

    def _versions(self) -> List[Tuple[int, int, int]]:
        return [(p._version, m._version, p._cdata) for p, m in self.pairs]

    def _pair_indices(self, params) -> List[int]:
        """The indices in ``pairs`` of those of ``params`` that have masters."""
        if self._pair_index_for != len(self.pairs):
            self._pair_index = {id(p): i for i, (p, _) in enumerate(self.pairs)}
            self._pair_index_for = len(self.pairs)
        index = self._pair_index
        return [index[id(p)] for p in params if id(p) in index]

    def record_synced(self, only=None) -> None:
        """Note the version counters of every pair (or of the pairs of the half parameters in
        ``only``): the half parameters now hold their masters' values (or the masters were
        just made from them)."""
        synced = self._synced_versions
        if only is None or synced is None or len(synced) != len(self.pairs):
            self._synced_versions = synced = self._versions()
            self._masters_in_step = [mv for _, mv, _ in synced]
            return
        indices = self._pair_indices(only)
        for i in indices:
            p, m = self.pairs[i]
            synced[i] = (p._version, m._version, p._cdata)
        # (The masters of these pairs are in step now: a forward's quick look must not take
        # their newer versions for writes, or a later unrecorded copy into the half model,
        # a closure's, would be taken back into the masters at half precision.)
        self._masters_now_in_step(indices, synced)

    def _masters_now_in_step(self, indices, synced) -> None:
        """Note the recorded master versions of the pairs at ``indices`` as in step (those
        entries only: the state-dict hooks record one module's pairs at a time, and a whole
        list per call would cost every ``state_dict()`` modules x pairs reads)."""
        in_step = self._masters_in_step
        if in_step is None or len(in_step) != len(synced):
            self._masters_in_step = [mv for _, mv, _ in synced]
            return
        for i in indices:
            in_step[i] = synced[i][1]

    def take_model_writes(self, only=None) -> None:
        """Copy into its fp32 master every half parameter written in place since amp last set
        it, so that the write holds instead of being overwritten by the next post-step copy.

        Seen through the version counters, which every in-place write bumps (under
        ``torch.no_grad()`` too) and amp's own copies are recorded after:
        ``torch.nn.parallel.DistributedDataParallel`` broadcasting rank 0's weights into the
        half model at construction (without this each rank would go on from its own masters,
        and replicas initialized differently would train apart), ``nn.init`` or
        ``reset_parameters()`` after ``initialize``, an update under ``no_grad``. A master
        written since as well (``model.load_state_dict`` writes both; PyTorch's DDP
        broadcasting the half model after a resume wrote the masters in place) wins, and is
        cast into its half parameter, as is a master written alone (``copy_`` under
        ``no_grad`` into ``amp.master_params(optimizer)`` or into ``model.state_dict()``'s
        tensors, which are the masters, as ``torch.distributed.checkpoint.load`` does), as
        the next step's copy would (the model's forward looks for those first: see
        :meth:`push_written_masters`). A parameter whose
        tensor was swapped for another (``model.to(...)`` under PyTorch's
        ``swap_module_params_on_conversion``, whose new tensor has a version counter of its
        own) was moved, not written. Writes through ``.data`` bump no counter and are not
        seen. An RNN's ``flatten_parameters()``, which many models call in every forward,
        packs its weights into one new cuDNN buffer (``set_``, values unchanged): amp's
        wrapper of it takes the writes before it and records the versions after it (see
        ``mixprec.amp._model._watch_rnn_packing``), or the masters would be rounded to half
        at every step. Not inside a CUDA-graph capture or a ``torch.compile`` trace (a
        captured copy would replay at every step).

        With ``only`` (half parameters, e.g. one module's), just their pairs are looked at:
        a module's state-dict hooks call it for their own parameters, so that a whole
        ``state_dict()`` reads each counter once, not once per module.
        """
        if is_compiling() or (self.pairs[0][1].is_cuda
                              and torch.cuda.is_current_stream_capturing()):
            return
        with self._sync_lock:
            self._take_model_writes(only)

    def push_written_masters(self) -> None:
        """Before a forward of the live model: if any master was written in place since amp
        last put the pairs in step, run :meth:`take_model_writes`, which casts written masters
        into their half parameters (and takes half parameters written alone into their
        masters), so the forward runs the weights ``model.state_dict()`` holds. Else the
        written masters reached the forward only after the next step's copy: an evaluation
        right after ``dcp.load(model.state_dict())`` ran the old weights, and the first
        step's gradient was taken at them.

        The common case, nothing written, reads each master's version counter once (about
        10 us of host time per 150 masters on a slow 2-core CPU, 24 us for 149 on an H100
        machine's host: ``benchmarks/probe_forward_master_check.py``). Not inside a
        ``torch.compile`` trace or a CUDA-graph capture (as take_model_writes)."""
        pairs = self.pairs
        if not self.masters_written():
            return
        masters = self._masters
        if is_compiling() or (masters[0].is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        with self._sync_lock:
            self._take_model_writes(None)
            synced = self._synced_versions
            if synced is not None and len(synced) == len(pairs):
                self._masters_in_step = [mv for _, mv, _ in synced]

    def masters_written(self) -> bool:
        """Whether a master was written in place since amp last put the pairs in step (what
        :meth:`push_written_masters` takes; true before any record). Reads each master's
        version counter."""
        pairs = self.pairs
        if not pairs:
            return False
        masters = self._masters
        if len(masters) != len(pairs):
            self._masters = masters = [m for _, m in pairs]
        return [m._version for m in masters] != self._masters_in_step

    def hand_masters_to_models(self) -> None:
        """When the optimizer is gone (deleted after training; its finalizer calls this): its
        masters are their models' own from then on, kept in step by the modules' state-dict
        hooks as a copy's are. Give those hooks each master's version counter at the last
        point amp put it in step with its half parameter, so that a master written in place
        since (``copy_`` into ``amp.master_params(optimizer)`` or ``model.state_dict()``'s
        tensors, ``dcp.load``, just before or after ``del optimizer``) is seen as written and
        cast into its half parameter at the next forward or ``state_dict()``. Without the
        record the hooks took the first look as the in-step point: the next forward ran the
        old half weights, and ``state_dict()`` took them back into the masters over the
        write. Records only: no tensor is touched here (a collection may run anywhere, a
        CUDA-graph capture included)."""
        synced = self._synced_versions
        if synced is None or len(synced) != len(self.pairs):
            return
        at_sync = {id(m): sm for (p, m), (_, sm, sc) in zip(self.pairs, synced)
                   if p._cdata == sc}
        if not at_sync:
            return
        for model in self.amp_state.models:
            for module in model.modules():
                hooks = module.__dict__.get("_mixprec_state_dict")
                if hooks is None or hooks.standalone:
                    continue
                for name, master in hooks.masters.items():
                    version = at_sync.get(id(master))
                    if version is not None:
                        hooks._versions[name] = version

    def _take_model_writes(self, only) -> None:
        synced = self._synced_versions
        if self._registrations_seen != parameter_registrations():
            # A parameter registered somewhere since: perhaps one of ours renamed (prune, and
            # prune.remove, whose .data write only a rename check finds), or registered again
            # after a write through .data (prune.remove at once after prune: by now back
            # under its name, so no rename shows).
            since = registered_since(self._registrations_seen)
            self._registrations_seen = parameter_registrations()
            for model in self.amp_state.models:
                follow_renames_in(model)
            self._take_data_writes(since)
        if only is not None and synced is not None and len(synced) == len(self.pairs):
            indices = self._pair_indices(only)
            records = self._bring_in_step([self.pairs[i] for i in indices],
                                          [synced[i] for i in indices])
            for i, record in zip(indices, records):
                synced[i] = record  # (a moved parameter's too: nothing to copy)
            self._masters_now_in_step(indices, synced)
            return
        now = self._versions()
        if now == synced:
            return
        if synced is not None and len(synced) == len(now):
            now = self._bring_in_step(self.pairs, synced, now)
        self._synced_versions = now  # (moved parameters': nothing to copy)
        self._masters_in_step = [mv for _, mv, _ in now]

    def _bring_in_step(self, pairs, synced, now=None) -> List[Tuple[int, int, int]]:
        """Of ``pairs`` against their records ``synced``: cast each master written since into
        its half parameter (written too or not: the master wins), and take each half
        parameter written alone into its master. A parameter moved since (another TensorImpl)
        is left. The pairs' new records.

        A master amp did not write keeps the version read before the copies (``now``, read
        here if not given), not one read after: a master written by another thread while
        this one copied (a server loading new weights while a forward runs) then still shows
        as written at the next look, where a record read afterwards took it as in step, and
        the forward and ``state_dict()`` kept the old weights. (Masters have counters of
        their own; half parameters may share one, and are read after.)"""
        if now is None:
            now = [(p._version, m._version, p._cdata) for p, m in pairs]
        written, stale = [], []
        for i, ((sp, sm, sc), (vp, vm, vc)) in enumerate(zip(synced, now)):
            if vc != sc:
                continue
            if vm != sm:
                stale.append(i)
            elif vp != sp:
                written.append(i)
        if not written and not stale:
            return now
        if written:
            self._take([pairs[i] for i in written])
        if stale:
            self.copy_masters_to_model([pairs[i] for i in stale])
        # (Half parameters read again: amp's copy into one moves the counter of every half
        # parameter sharing it, slices of one fp32 tensor, which are not written.)
        taken = set(written)
        return [(p._version, m._version if i in taken else vm, vc)
                for i, ((p, m), (_, vm, vc)) in enumerate(zip(pairs, now))]

    def _take_writes_while_frozen(self) -> None:
        """For each parameter left frozen at the last step (its half parameter kept what it
        held: see _post_step) and trainable now, take into its master the elements where the
        half parameter no longer equals the master rounded to half (written through ``.data``
        while frozen), so that the step goes on from what the forward ran. A master written
        in place since wins (take_model_writes). No host sync."""
        synced = self._synced_versions
        if synced is None or len(synced) != len(self.pairs):
            return
        still = []
        for i in self._left_frozen:
            if i >= len(self.pairs):
                continue
            (p, m), (sp, sm, sc) = self.pairs[i], synced[i]
            if not p.requires_grad:
                still.append(i)
            elif (p._version == sp and m._version == sm and p._cdata == sc
                    and p.shape == m.shape and p.dtype in (torch.float16, torch.bfloat16)):
                take_changed_elements(p, m)
                synced[i] = (p._version, m._version, p._cdata)
        self._left_frozen = still

    def _take_data_writes(self, since: Optional[Set[int]]) -> None:
        """For the half parameters registered again since the last look (``since``, their
        ids; None: any), and not written in place since amp set them (those are taken whole),
        take into the master the elements where the half parameter no longer equals the
        master rounded to half: a write through ``.data``, which no version counter sees
        (``prune.remove``); the other elements keep their fp32 values. No host sync."""
        synced = self._synced_versions
        if synced is None or len(synced) != len(self.pairs):
            return
        for i, ((p, m), (sp, sm, sc)) in enumerate(zip(self.pairs, synced)):
            # (A master written since, in place, wins, as in take_model_writes: a resume that
            # copies saved masters in under no_grad right after initialize had them replaced
            # by the half model's values at the first step.)
            if ((since is not None and id(p) not in since) or p._version != sp
                    or m._version != sm or p._cdata != sc or p.shape != m.shape
                    or p.dtype not in (torch.float16, torch.bfloat16)):
                continue
            take_changed_elements(p, m)
            synced[i] = (p._version, m._version, p._cdata)

    def written_through_data(self, only) -> Dict[int, torch.Tensor]:
        """What ``state_dict()`` saves for the half parameters in ``only`` (one module's) that
        were written through ``.data`` since amp last set them: ``{id(param): fp32 tensor}``,
        the half values upcast where they no longer equal the master rounded to half, the
        master's elsewhere. ``.data`` writes bump no version counter, so only values show
        them: torch_ema's ``copy_to()`` (an EMA swapped in to evaluate, then saved, or kept
        at the end of training). The checkpoint is then the model the forward runs, as a
        copy's is (Apex saved the half weights upcast); the master is left alone, so the
        next step overwrites the write as before, and swapping back through ``.data``
        (torch_ema's ``restore()``) continues training exactly.

        Only pairs whose version counters both stand where amp recorded them: a master
        written since (``amp.master_params`` written as well, a step under way in another
        thread) or a half parameter written in place (taken whole by ``take_model_writes``)
        is not compared. One host sync per device holding such parameters, and a few
        multi-tensor launches (a ``state_dict()`` of the whole model asks once for all of
        them: see ``_model._DataWritesOfOneCall``).
        """
        synced = self._synced_versions
        if (not self.pairs or is_compiling() or synced is None or len(synced) != len(self.pairs)
                or (self.pairs[0][1].is_cuda and torch.cuda.is_current_stream_capturing())):
            return {}
        saved: Dict[int, torch.Tensor] = {}
        with self._sync_lock, torch.no_grad():
            by_device: Dict[torch.device, list] = {}
            frozen = set(self._left_frozen)
            for i in self._pair_indices(only):
                (p, m), (sp, sm, sc) = self.pairs[i], synced[i]
                if (p._version != sp or m._version != sm or p._cdata != sc
                        or p.shape != m.shape or p.numel() == 0 or p.is_meta
                        or p.dtype not in (torch.float16, torch.bfloat16) or holds_no_values(p)):
                    continue
                by_device.setdefault(p.device, []).append((i, p, m))
            for found in by_device.values():
                differ = halves_differ_from_masters([(p, m) for _, p, m in found])
                for (i, p, m), changed in zip(found, differ):
                    if not changed:
                        continue
                    if i in frozen:
                        # (A frozen parameter the last step left as it was: its half value
                        # counts, and the master takes it, so that the entry stays the
                        # master, which a load in place reaches.)
                        take_changed_elements(p, m)
                        synced[i] = (p._version, m._version, p._cdata)
                    else:  # (laid out as the master: a saved view of it maps alike)
                        out = torch.empty_like(m)
                        saved[id(p)] = torch.where(p != m.to(p.dtype), p.to(m.dtype), m, out=out)
        if saved and self.amp_state.verbosity > 0:
            # (Which side was written, nothing records: a write through .data into the
            # masters, torch_ema's copy_to() over amp.master_params, looks the same. A
            # warning the first time, for that case's sake; then a debug line.)
            message = (
                f"amp: state_dict(): {len(saved)} half parameter(s) differ from their fp32 "
                "master weights with no write recorded since the last step (a write through "
                ".data, e.g. torch_ema's copy_to() over model.parameters()): saved as the half "
                "values the forward runs where they differ. A write through .data into "
                "amp.master_params(optimizer) reaches neither the forward nor these entries: "
                "write the masters with copy_() under torch.no_grad(), or swap weights in with "
                "model.load_state_dict.")
            if self._data_writes_logged:
                log_rank0(logging.DEBUG, "%s", message)
            elif is_rank_zero():
                warnings.warn(message, stacklevel=2)
            self._data_writes_logged = True
        return saved

    def _take(self, written) -> None:
        """Copy the half parameters of the ``(param, master)`` pairs ``written`` into their
        masters, and say so (once at INFO, then at DEBUG)."""
        with torch.no_grad():
            torch._foreach_copy_([m for _, m in written], [p for p, _ in written])
        level = logging.DEBUG if self._writes_logged else logging.INFO
        self._writes_logged = True
        if self.amp_state.verbosity > 0:
            log_rank0(
                level, "amp: %d of the half model's %d master-weighted parameters were written "
                "in place since amp last set them (e.g. by PyTorch's DistributedDataParallel "
                "broadcasting rank 0's weights, or nn.init): their fp32 master weights were set "
                "from them (at half precision). To keep full precision, write "
                "amp.master_params(optimizer) as well, or load weights with "
                "model.load_state_dict.", len(written), len(self.pairs))

    def _synced_closure(self, closure):
        def synced_closure():
            # (Not into the frozen parameters the last step left as they were: see _post_step.)
            pairs = self._pairs_but(self._left_frozen) if self._left_frozen else self.pairs
            self.copy_masters_to_model(pairs)
            # (Recorded: else the forward's look took this copy for a write into the half
            # model, after any record that moved the masters' versions without it (a
            # model.load_state_dict, a first step's look for .data writes), and rounded the
            # fp32 masters to half.)
            self.record_synced(only=[p for p, _ in pairs])
            loss = closure()
            self._refuse_half_grads()
            return loss

        return synced_closure

    def _post_step(self, optimizer, args, kwargs):
        if not self.amp_state.enabled:
            return
        compiling = is_compiling()
        self._unscaled_since_step = False
        if self._flag_handed_over:
            if compiling:  # (see _pre_step: written eagerly, so taken back eagerly)
                outside_the_compiler(_take_back_flag)(optimizer)
            else:
                _take_back_flag(optimizer)
            self._flag_handed_over = False
        else:
            self._last_step_flag = None
        self.last_step_skipped = self.overflow
        if self.overflow:
            self.overflow = False
            for p, g in self._zeroed_in_skip:
                if p.grad is None:
                    p.grad = g
            self._zeroed_in_skip = []
            return
        if compiling and any(not p.requires_grad for p, _ in self.pairs):
            # Which frozen pairs the step left alone is read from the masters' version
            # counters, and a traced branch on a version counter is decided once, at the
            # trace (no guard): an optimizer writing a frozen parameter's master without a
            # gradient (a decay over every parameter) had its write kept from the half
            # model under torch.compile. Decided eagerly (a graph break, only where the
            # model holds frozen parameters: requires_grad is guarded).
            outside_the_compiler(_OptimizerState._copy_after_step)(self, optimizer, False)
        else:
            self._copy_after_step(optimizer, compiling)

    def _copy_after_step(self, optimizer, compiling: bool) -> None:
        """After a step that ran: free the masters' gradients and copy the masters into the
        half parameters, but for those the optimizer wrote itself and the frozen pairs the
        step left as they were."""
        written = getattr(optimizer, "_half_copies_written", None)
        frozen = []
        if self.pairs:
            # The step consumed the masters' gradients: free them, as Apex did. A loop that
            # zeroes through a wrapper (``DataParallel(model).zero_grad()``, torch DDP's, a
            # ``p.grad = None`` pass over ``model.parameters()``) reaches only the half
            # parameters, and the masters' gradients would pile up across steps.
            # A parameter the optimizer holds but did not step (frozen: requires_grad=False,
            # no gradient, its master not written by the step; MoCo's key encoder in an
            # optimizer built over model.parameters()) keeps what its half parameter holds,
            # as under Apex for a parameter frozen before the first scale_loss (it made no
            # master for it): a momentum update written through .data holds. Its master
            # takes such a write at state_dict() or at the first step after it is unfrozen
            # (_take_writes_while_frozen).
            synced = self._synced_versions
            if synced is None or len(synced) != len(self.pairs):
                synced = None
            if self.grad_tensors_kept:
                self._had_grads.update((id(m), _grad_record(m)) for _, m in self.pairs
                                       if m.grad is not None)
            missing = []  # (the masters without a gradient: usually none; see _no_grad_since)
            for i, (p, master) in enumerate(self.pairs):
                if master.grad is not None:
                    master.grad = None
                else:
                    missing.append(id(master))
                    if not p.requires_grad and (synced is None
                                                or master._version == synced[i][1]):
                        frozen.append(i)
            if not self.grad_tensors_kept:
                self._note_no_grads(missing)
        self._left_frozen = frozen
        # (The copy and its record at once: a state_dict() in another thread between them, an
        # async checkpointer, took the copy for a write into the half model and rounded the
        # masters to half.)
        with contextlib.nullcontext() if compiling else self._sync_lock:
            if not written and not frozen:
                self.copy_masters_to_model()
            elif written:
                if len(written) < len(self.pairs):  # (the optimizer wrote some half copies)
                    done, left = set(map(id, written)), set(frozen)
                    self.copy_masters_to_model([
                        pair for i, pair in enumerate(self.pairs)
                        if id(pair[1]) not in done and i not in left])
            else:
                self.copy_masters_to_model(self._pairs_but(frozen))
            if self.pairs:
                self.record_synced()

    def _pairs_but(self, left_out: List[int]) -> list:
        """The pairs but those at the indices ``left_out`` (kept while they stay the same)."""
        key = (len(self.pairs), *left_out)
        if self._copied_pairs[0] != key:
            skip = set(left_out)
            self._copied_pairs = (key, [pair for i, pair in enumerate(self.pairs)
                                        if i not in skip])
        return self._copied_pairs[1]

    def copy_masters_to_model(self, pairs=None) -> None:
        """Copy the fp32 master weights into the half model's parameters (cast to half), for
        ``pairs`` (default: all of this optimizer's)."""
        pairs = self.pairs if pairs is None else pairs
        if pairs:
            with torch.no_grad():
                model_params = [p for p, _ in pairs]
                masters = [m for _, m in pairs]
                torch._foreach_copy_(model_params, masters)


def _grad_record(master: torch.Tensor) -> Tuple[torch.Tensor, Optional[Tuple[int, int]]]:
    """``master`` and, where its gradient is sparse, that gradient's sparse and dense dims
    (what a zero gradient like it needs; see ``_OptimizerState._had_grads``)."""
    g = master.grad
    return master, ((g.sparse_dim(), g.dense_dim()) if g is not None and g.is_sparse else None)


def _hand_over_flag(optimizer, found_inf: torch.Tensor) -> None:
    """Give a fused optimizer's kernel amp's overflow flag (``GradScaler``'s attributes)."""
    optimizer.grad_scale = None
    optimizer.found_inf = found_inf


def _take_back_flag(optimizer) -> None:
    del optimizer.grad_scale
    del optimizer.found_inf


def _agreed_flag(flags, states, groups) -> torch.Tensor:
    """One overflow flag, the maximum of ``flags`` over this rank and over every rank of
    ``groups`` (a rank whose backward left no gradient still takes part, with 0)."""
    import torch.distributed as dist

    if flags:
        flag = flags[0].float() if len(flags) == 1 else torch.stack(
            [f.to(flags[0].device).float() for f in flags]).amax()
        flag = flag.clone()
    else:
        params = [m for s in states for _, m in s.pairs] + [p for s in states for p in s.plain]
        flag = torch.zeros((), dtype=torch.float32,
                           device=params[0].device if params else "cpu")
    for group in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag


class SyncParamGroupsOnLoad:
    """A model's load-state-dict and state-dict pre-hook: adopt late ``add_param_group``
    calls first.

    Registered on each model by ``initialize`` before the fp32 state-dict hooks, so that a
    checkpoint loaded into the model reaches the masters of a group added after
    ``initialize``, and one saved from it holds them (a new task head's entries fp32 before
    any step). Holds its ``AmpState`` weakly; a pickled or deep-copied model's copy holds
    none (the optimizers stay with the original).
    """

    def __init__(self, amp_state: AmpState):
        self._amp_state = weakref.ref(amp_state)

    def __call__(self, *args, **kwargs):
        amp_state = self._amp_state() if self._amp_state is not None else None
        if amp_state is not None:
            amp_state.sync_param_groups()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self._amp_state = None


class AmpState:
    """Everything one ``amp.initialize`` call set up.

    Attributes:
        properties (Properties): the resolved opt level.
        enabled (bool): False makes every amp call a no-op.
        models (list[nn.Module]): the models still alive, as returned.
        scalers (list[LossScaler]): one per ``loss_id``.
    """

    def __init__(self, properties, enabled: bool, models, num_losses: int,
                 min_loss_scale, max_loss_scale, verbosity: int):
        self.properties = properties
        self.enabled = enabled
        # Weak references: module-level amp.state_dict() keeps the latest AmpState alive, and
        # that must not keep the user's models, optimizers and master weights alive with it.
        self._models = [weakref.ref(m) for m in models]
        self._optimizer_states: List[weakref.ref] = []
        self.verbosity = verbosity
        loss_scale = properties.loss_scale if properties is not None else 1.0
        self.scalers = [
            LossScaler(loss_scale, min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale)
            for _ in range(num_losses)
        ]
        self.overflow_log = OverflowLog(verbosity)
        # When initialize made it and when its last scale_loss block ran (frontend._EVENTS).
        self.created = self.last_block = 0
        # ids of the models' parameters that were fp32 once initialize had cast them (not
        # weak references, which would keep torch.utils.swap_tensors from converting them):
        # see _OptimizerState.refuse_plain_made_half.
        self.fp32_params: Set[int] = set()
        # A backward that reached none of its block's optimizers' parameters was warned about.
        self.warned_unreached = False
        # The loss ids whose blocks were watched, up to an unscaling block, for gradients
        # their backwards wrote into the models' parameters that no optimizer holds; and, for
        # those watched since the last unscale, what they found: loss id -> (the block's
        # scale, {id: (registration order, name, dtype)}) (see frontend.UnheldWatch).
        self.looked_for_unheld: Set[int] = set()
        self.unheld_pending: Dict[int, tuple] = {}
        # Overflow flags and new scales of device-scaled steps, copied to the host without
        # waiting, for the overflow log: (loss_id, host [flag, scale], event or None).
        self._pending: List[Tuple[int, torch.Tensor, Optional[torch.cuda.Event]]] = []

    @property
    def models(self) -> list:
        return [m for m in (ref() for ref in self._models) if m is not None]

    def sync_param_groups(self) -> None:
        """Give every parameter group added since ``initialize`` its masters now."""
        if not self.enabled:
            return
        for opt_state in self.optimizer_states():
            opt_state.sync_param_groups()

    def optimizer_states(self) -> list:
        """The amp states of this call's optimizers that are still alive."""
        states = (ref() for ref in self._optimizer_states)
        return [s for s in states if s is not None and s.optimizer_ref() is not None]

    def other_optimizer_states(self, states) -> list:
        """The live states of this call's optimizers that are not in ``states`` (built only
        when there can be one: the common one-optimizer ``scale_loss`` pays one compare)."""
        if len(self._optimizer_states) <= len(states):
            return []
        return [o for o in self.optimizer_states() if all(o is not s for s in states)]

    def add_optimizer(self, optimizer) -> _OptimizerState:
        state = _OptimizerState(self, optimizer)
        self._optimizer_states.append(weakref.ref(state))
        _OPTIMIZER_STATES[optimizer] = state
        # (Holds the state, not the optimizer: run when the optimizer is collected.)
        weakref.finalize(optimizer, state.hand_masters_to_models).atexit = False
        attach_apex_optimizer_names(optimizer)
        hook_target = hookable_optimizer(optimizer)
        if hook_target is not optimizer:
            _OPTIMIZER_STATES[hook_target] = state
        return state

    def loss_index(self, loss_id) -> int:
        """``loss_id`` as an int (an integer of another type too, ``numpy.int64`` from
        ``np.arange``, as Apex's list indexing took), checked against ``num_losses``."""
        index = None
        if not isinstance(loss_id, (bool, torch.Tensor)):  # (True is not loss 1)
            try:
                index = operator.index(loss_id)
            except TypeError:
                pass
        if index is None or not 0 <= index < len(self.scalers):
            raise ValueError(
                f"amp.scale_loss(loss_id={loss_id!r}) ({type(loss_id).__name__}): "
                f"amp.initialize was called with num_losses={len(self.scalers)}, so loss_id "
                f"must be a Python or NumPy integer in [0, {len(self.scalers) - 1}] (not a "
                "tensor: use .item()). Raise num_losses in amp.initialize to use more."
            )
        return index

    def scale_device(self, states, loss_id: int) -> Optional[torch.device]:
        """Where loss ``loss_id``'s dynamic scale should live for a backward that steps
        ``states``: their common device when every optimizer skips overflowed steps on it
        (see ``_OptimizerState.skips_on_device``), else None (the host, with one sync per step)."""
        if not self.scalers[loss_id].dynamic:
            return None
        devices = {s.skips_on_device() for s in states}
        return devices.pop() if len(devices) == 1 and None not in devices else None

    def defer_overflow(self, states, loss_id: int, flags) -> None:
        """``scale_loss(..., delay_overflow_check=True)``: leave the decision on this block's
        flags to the optimizers' step (see :class:`DeferredCheck`). A static scale never
        skips: counted now, as at any block."""
        if not self.scalers[loss_id].dynamic:
            self.record_overflow(states, loss_id, flags)
            return
        deferred = next((s.deferred for s in states if s.deferred is not None), None)
        (deferred or DeferredCheck(self)).add(states, loss_id, flags or [])

    def record_overflow(self, states, loss_id: int, flags) -> None:
        """Act on one backward's overflow flags.

        With the scale on the device (``scale_device``) nothing waits: the flag goes to the
        optimizers' fused kernels, which skip the step themselves, and a kernel updates the
        scale; a copy of the flag and the new scale travels to the host, to be logged by a later
        ``resolve_pending`` once it has arrived. Else the flag is read now, the step's one
        host-device sync, and the gradients of a skipped step are dropped.
        """
        scaler = self.scalers[loss_id]
        if not scaler.dynamic:
            scaler.update(False)  # (counts the step; a static scale never skips one)
            return
        # The process groups over which the decision must agree: those of the modules under a
        # mixprec.parallel.Reducer holding these parameters (see _model.agree_on_overflow).
        groups = []
        for group in (g for s in states for g in s.overflow_groups()):
            if not any(group is h for h in groups):
                groups.append(group)
        if groups or len(flags) > 1:
            # (Several flags: one per optimizer stepped by this loss. Any overflow skips them
            # all, as on the host.)
            flags = [_agreed_flag(flags, states, groups)]
        device = scaler.on_device
        if device is None:
            self._apply(loss_id, any_flag_set(flags), states)
            return
        flag = flags[0] if flags else torch.zeros((), dtype=torch.float32, device=device)
        for state in states:
            # The maximum, not the sum: fused kernels subtract found_inf from the step counts
            # (GradScaler's protocol), so two overflowed losses must not give 2.
            state.pending_found = (flag if state.pending_found is None
                                   else torch.maximum(state.pending_found, flag))
        scaler.update_on_device(flag)
        on_gpu = device.type == "cuda"
        if on_gpu and torch.cuda.is_current_stream_capturing():
            return  # replays run no host code: nothing to log
        host, event = torch.stack((flag, scaler.device_state(device).scale)), None
        if on_gpu:
            host = host.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._pending.append((loss_id, host, event))

    def _apply(self, loss_id: int, found: bool, states) -> None:
        scaler = self.scalers[loss_id]
        if scaler.update(found):
            for state in states:
                state.discard_grads()
            self.overflow_log.overflow(loss_id, scaler.loss_scale, scaler._min)

    def resolve_pending(self, block: bool = False) -> None:
        """Log the overflows of device-scaled steps whose flags have reached the host.

        Without ``block`` this never waits: flags still in flight stay pending. Inside a CUDA
        graph capture it does nothing (events cannot be queried there).
        """
        if (not block and self._pending and self._pending[0][2] is not None
                and torch.cuda.is_current_stream_capturing()):
            return
        while self._pending:
            loss_id, host, event = self._pending[0]
            if event is not None and not block and not event.query():
                return
            if event is not None:
                event.synchronize()
            self._pending.pop(0)
            found, scale = host.tolist()
            if found:
                self.overflow_log.overflow(loss_id, scale, self.scalers[loss_id]._min)

    def state_dict(self) -> Dict[str, dict]:
        """Apex's format: ``{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}``;
        ``{}`` with amp disabled (``enabled=False``), which scales nothing: a scale of 1.0 saved
        there would replace an fp16 run's dynamic scale on a resume (fp16 gradients underflow
        at 1.0, and the scale takes 16 growth windows, 32000 steps, to come back)."""
        if not self.enabled:
            return {}
        self.resolve_pending(block=True)
        return {f"loss_scaler{i}": s.state_dict() for i, s in enumerate(self.scalers)}

    def load_state_dict(self, state_dict: Dict[str, dict]) -> None:
        """Apex's rules: keys other than ``loss_scaler<i>`` are an error; a checkpoint saved
        with another ``num_losses`` loads the scalers both have, with a warning (a loss added
        since starts from the default scale). Nothing loads unless every entry is valid."""
        if not isinstance(state_dict, dict):
            raise ValueError(
                f"amp.load_state_dict: expected the dict saved by amp.state_dict() "
                f"({{'loss_scaler0': {{'loss_scale': ..., 'unskipped': ...}}, ...}}), got "
                f"{type(state_dict).__name__}."
            )
        unexpected = sorted(str(k) for k in state_dict
                            # (loss_scaler01 is not amp's: it would load into no scaler)
                            if not re.fullmatch(r"loss_scaler(0|[1-9]\d*)", str(k)))
        if {"scale", "_growth_tracker"} <= set(unexpected):
            # torch.amp.GradScaler's state dict (a run migrated from autocast + GradScaler):
            # the generic advice below ("not the whole checkpoint") would mislead. Say what it
            # is and how to carry its scale over; not converted silently, since its growth
            # and backoff settings may not be amp's.
            raise ValueError(
                "amp.load_state_dict: this is torch.amp.GradScaler's state dict (keys "
                f"{unexpected}), not amp's. amp's dynamic scaling has GradScaler's default "
                "settings (x2 growth every 2000 clean steps, /2 backoff); to carry its scale "
                "over: amp.load_state_dict({'loss_scaler0': {'loss_scale': sd['scale'], "
                "'unskipped': sd['_growth_tracker']}})."
            )
        if unexpected:
            raise ValueError(
                f"amp.load_state_dict: unexpected key(s) {unexpected}; amp.state_dict() holds "
                "only 'loss_scaler0', 'loss_scaler1', ... Pass checkpoint['amp'] (what "
                "amp.state_dict() returned), not the whole checkpoint."
            )
        if not self.enabled:  # (every amp call is a no-op: nothing to load into)
            return
        if not state_dict:
            if is_rank_zero():
                warnings.warn(
                    "amp.load_state_dict: the checkpoint holds no loss scale (it was saved by "
                    "a run with amp disabled, enabled=False); this run's loss scaler(s) keep "
                    "their initial scale.", stacklevel=3)
            return
        entries = {}
        for i in range(len(self.scalers)):
            entry = state_dict.get(f"loss_scaler{i}")
            if entry is not None:
                LossScaler().load_state_dict(entry)  # (validates it before anything loads)
                entries[i] = entry
        kept = len(self.scalers) - len(entries)
        dropped = sorted(k for k in state_dict
                         if int(str(k)[len("loss_scaler"):]) >= len(self.scalers))
        if (kept or dropped) and is_rank_zero():
            what = []
            if kept:
                what.append(f"{kept} of this run's scaler(s) had no entry and keep their "
                            "initial scale")
            if dropped:
                what.append(f"the checkpoint's {', '.join(dropped)} had no scaler here: "
                            "dropped")
            warnings.warn(
                f"amp.load_state_dict: the checkpoint holds {len(state_dict)} loss scaler(s) "
                f"and this run has num_losses={len(self.scalers)}: loaded {len(entries)}; "
                + "; ".join(what) + " (as Apex did).", stacklevel=3)
        self.resolve_pending(block=True)
        replaced = [(i, self.scalers[i].loss_scale, float(entry["loss_scale"]))
                    for i, entry in entries.items() if not self.scalers[i].dynamic
                    and float(entry["loss_scale"]) != self.scalers[i].loss_scale]
        if replaced and is_rank_zero():
            # (Apex's rule, kept: the checkpoint's scale wins. But a static scale never backs
            # off, so a dynamic run's 65536 loaded into it overflows to NaN weights unnoticed.)
            warnings.warn(
                "amp.load_state_dict: the checkpoint's loss scale replaces this run's static "
                "one (" + ", ".join(f"loss_scaler{i}: {new:g} for {old:g}"
                                    for i, old, new in replaced)
                + "), as in Apex; a static scale never backs off on an overflow. To keep "
                "this run's, set checkpoint['amp']['loss_scaler<i>']['loss_scale'] before "
                "loading, or use loss_scale='dynamic'.", stacklevel=3)
        props = self.properties
        fp16_run = (props is not None and props.opt_level != "O0"
                    and props.half_dtype == torch.float16)
        lowered = [i for i, entry in entries.items()
                   if fp16_run and self.scalers[i].dynamic and float(entry["loss_scale"]) == 1.0
                   and self.scalers[i].loss_scale > 1.0]
        if lowered and is_rank_zero():
            # (Apex's rule again. A bf16 run's checkpoint (static 1.0) resumed in fp16 starts
            # the dynamic scale at 1: it grows only after scale_window clean steps, and small
            # fp16 gradients underflow to zero meanwhile, with no overflow to say so.)
            scaler = self.scalers[lowered[0]]
            own, window = scaler.loss_scale, scaler._window
            warnings.warn(
                "amp.load_state_dict: the checkpoint's loss scale 1 (a bf16 or static-scale "
                "run saves that) becomes this fp16 run's dynamic scale ("
                + ", ".join(f"loss_scaler{i}" for i in lowered) + f", for {own:g}), as in "
                f"Apex. It doubles once per {window:,} clean steps, so small fp16 gradients "
                f"underflow to zero for the {window * math.ceil(math.log2(own)):,} steps it "
                "takes to grow back. If the checkpoint came from a bf16 or O0 run, leave "
                f"checkpoint['amp'] out (the scale then stays at {own:g}) or set its loss_scale "
                "before loading.", stacklevel=3)
        # (The decisions delay_overflow_check=True blocks left for the step: taken on the
        # scales they were made under, which the checkpoint's then replace.)
        run_deferred_checks(self.optimizer_states())
        for i, entry in entries.items():
            self.scalers[i].load_state_dict(entry)
        for opt_state in self.optimizer_states():
            opt_state.forget_overflow()
        log_rank0(logging.DEBUG, "amp: loaded loss scalers %s", self.state_dict())
