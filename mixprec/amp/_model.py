"""What ``amp.initialize`` does to a model, all in this one file.

The model object the user passed is returned, changed in three visible, reversible ways:

1. Parameters and buffers are cast (O2/O3), BatchNorm excepted when ``keep_batchnorm_fp32``.
2. Its class is swapped for a thin subclass (``type(model).__mro__[2]`` is the original class)
   whose ``forward`` casts floating inputs (O2/O3), runs the original forward (under
   ``torch.autocast`` at O1) and casts floating outputs. A subclass rather than a patched
   ``model.forward`` attribute keeps ``DataParallel`` replicas, ``copy.deepcopy``, pickling and
   ``torch.compile(fullgraph=True)`` working (a ``with torch.autocast`` block in a forward is
   traceable; autocast entered from hooks is not). :func:`restore_model` undoes the swap.
3. State-dict hooks make ``state_dict()`` return fp32 tensors equal to the fp32 master weights,
   and ``load_state_dict`` of an fp32 state dict write the masters exactly.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import copyreg
import dataclasses
import functools
import inspect
import itertools
import re
import threading
import types
import warnings
import weakref
from collections import UserDict
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.fx import Proxy as _FxProxy
from torch.fx import _symbolic_trace as _fx_symbolic_trace
from torch.nn.modules.batchnorm import _BatchNorm

try:  # (absent from PyTorch builds without torch.distributed)
    from torch.nn.parallel import DistributedDataParallel as _TorchDDP
except ImportError:  # pragma: no cover
    _TorchDDP = None

from mixprec._checks import listed
from mixprec.amp._logging import is_rank_zero
from mixprec.amp._properties import _HALF_TYPES
from mixprec.normalization._launch import is_compiling, is_exporting, outside_the_compiler

__all__ = [
    "GRAD_SYNC_DEFERRED", "AmpForwardConfig", "agree_on_overflow", "carry_amp_forward",
    "cast_floating", "cast_module_tensors", "convert_model", "converted_part_of", "is_amp_model",
    "master_weights", "overflow_groups", "restore_model", "torch_ddp_skips_this_backward",
]

# Set on a model by mixprec.parallel.DistributedDataParallel's forward (and by amp's forward
# inside PyTorch's own DDP: _follow_torch_ddp): True when the backward of that forward will not
# all-reduce (inside no_sync() / after disable_allreduce()). amp's
# scale_loss then keeps the gradients scaled in place, as delay_unscale=True does, so that the
# next synced backward all-reduces the whole accumulated sum (unscaling into the masters would
# leave each rank's local micro-batches out of the all-reduce).
GRAD_SYNC_DEFERRED = "_mixprec_grad_sync_deferred"
# Set with it when PyTorch's own DistributedDataParallel set it (see _follow_torch_ddp): a
# later forward with grad outside any DDP (and outside a backward) clears both.
_SET_BY_TORCH_DDP = "_mixprec_grad_sync_deferred_by_torch_ddp"
# What PyTorch's DDP would have recorded for a forward inside it run without grad: taken up by
# a forward recomputed during the backward (a reentrant checkpoint's, whose first forward runs
# under no_grad), left alone by an evaluation (see _follow_torch_ddp).
_NO_GRAD_TORCH_DDP = "_mixprec_grad_sync_deferred_no_grad"

# Every module of a model that amp.initialize cast to half (O2/O3), with the model it went in
# with, held weakly both ways: a later initialize of one of its parts is refused (its casts
# would run inside the half model; initialize([outer, outer.part]) in one call handles that).
_PART_OF: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


def converted_part_of(module: nn.Module) -> Optional[nn.Module]:
    """The live amp model (O2/O3) that an earlier ``initialize`` converted with ``module``
    inside it, or None. (Only ``module`` itself is looked up: a model that merely shares a
    submodule with a half one, or holds a whole amp model, is not inside it.)"""
    ref = _PART_OF.get(module)
    outer = ref() if ref is not None else None
    return outer if outer is not None and is_amp_model(outer) else None


def _mark_parts(model: nn.Module) -> None:
    """Record ``model`` (just cast to half) as the model each of its submodules is inside:
    the outermost one of nested amp models, the first one of models sharing a submodule."""
    ref, inside = weakref.ref(model), {id(m) for m in model.modules()}
    for module in model.modules():
        if module is model:
            continue
        outer = converted_part_of(module)
        if outer is None or id(outer) in inside:
            _PART_OF[module] = ref


# Modules whose gradients' overflow decision must agree across ranks, with the process groups
# to agree over: a mixprec.parallel.Reducer registers its module here. (DDP needs none: its
# all-reduce runs inside the backward, so an inf on one rank reaches every rank's gradients
# before amp checks them. A Reducer may reduce after the scale_loss block, when each rank has
# decided.) Any module, amp model or not: a Reducer may be built before amp.initialize, or on a
# part of an amp model or a module holding one; amp looks up the modules holding an
# optimizer's parameters when it checks (overflow_groups). Weak keys: a deep copy or a pickled
# model is not registered, and no process group is pickled.
_OVERFLOW_GROUPS: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()
_overflow_registrations = 0  # (bumped at each registration: amp's cached lookups go stale)


def agree_on_overflow(module: nn.Module, group) -> None:
    """Make amp's inf/NaN check of the gradients of ``module``'s parameters agree over
    ``group`` (None: all ranks): every rank then skips a step that overflowed on any rank, and
    the loss scales stay equal. Costs one all-reduce of one flag per checked backward."""
    global _overflow_registrations
    groups = _OVERFLOW_GROUPS.setdefault(module, [])
    if not any(g is group for g in groups):
        groups.append(group)
        _overflow_registrations += 1


def overflow_registrations() -> int:
    """How many (module, group) pairs :func:`agree_on_overflow` has registered so far."""
    return _overflow_registrations


def overflow_groups(param_ids: Set[int]) -> list:
    """The process groups over which the overflow decision for the parameters with these
    ``id``s must agree: those of the registered modules holding any of them (see above)."""
    groups = []
    for module, module_groups in list(_OVERFLOW_GROUPS.items()):
        if any(id(p) in param_ids for p in module.parameters()):
            groups.extend(g for g in module_groups if not any(g is h for h in groups))
    return groups


def cast_floating(value: Any, dtype: torch.dtype, only: Optional[tuple] = None) -> Any:
    """Cast every floating-point tensor inside ``value`` to ``dtype`` (with ``only``, just the
    tensors of those dtypes).

    Walks lists, tuples, namedtuples, mappings (``dict``, ``OrderedDict``, ``defaultdict``,
    ``UserDict`` such as a tokenizer's batch) and dataclass instances; integer/bool tensors and
    other objects are returned untouched. A container is copied (rebuilt, never modified in
    place) only when something in it is cast: one with nothing to cast is the caller's own
    object, so what the forward writes into it (a KV cache dict filled at each decoding step,
    fairseq's ``incremental_state``, a list of auxiliary losses) reaches the caller, as in
    fp32 and under autocast. (A tensor cast is a copy: writes into it do not reach the
    caller's. A tuple or list subclass copied keeps the attributes set on the caller's
    instance, eagerly: not under ``torch.compile``.) Objects of other classes are not
    entered, nor is their ``to`` method called (Apex called ``value.to(dtype)``, its contract
    for custom batch classes; but objects whose ``to`` forwards its argument to every tensor,
    flex attention's ``BlockMask``, graph and tensordict batches, would have their integer
    indices cast, silently): a model that takes such an object gets it as it is, and casts
    what it needs itself.
    """
    # (Not traced with a memo: Dynamo guards on each id() read, and recompiled for every new
    # input tensor.)
    return _cast(value, dtype, only, None if is_compiling() else {})


def _cast(value: Any, dtype: torch.dtype, only: Optional[tuple], memo: Optional[dict]) -> Any:
    # (memo: id(tensor) -> its cast, within one call: a tensor found twice, {"q": x, "kv": x}
    # or a model output's key and attribute, is cast once, and the two stay one object.)
    if isinstance(value, torch.Tensor):
        if (not value.is_floating_point() or value.dtype == dtype
                or (only is not None and value.dtype not in only)):
            return value
        if memo is None:
            return value.to(dtype)
        cast = memo.get(id(value))
        if cast is None:
            cast = memo[id(value)] = (value, value.to(dtype))
        return cast[1]
    if type(value) is dict:  # the common case, kept cheap: this runs on every forward
        items = {k: _cast(v, dtype, only, memo) for k, v in value.items()}
        return value if _unchanged(items, value) else items
    if isinstance(value, Mapping):
        items = {k: _cast(v, dtype, only, memo) for k, v in value.items()}
        if _unchanged(items, value):
            return value
        return _rebuild_mapping(value, items, dtype, only, memo)
    if isinstance(value, (list, tuple)):
        cast = [_cast(v, dtype, only, memo) for v in value]
        if all(c is v for c, v in zip(cast, value)):
            return value
        # (A namedtuple takes its fields as arguments.)
        out = type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
        if type(value) not in (list, tuple) and not is_compiling():
            # (Not traced: Dynamo branching on a namedtuple's __dict__, which it has not,
            # broke the graph of every namedtuple input on PyTorch 2.11.)
            _keep_instance_attributes(value, out)
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _rebuild_dataclass(value, dtype, only, memo)
    return value


def _keep_instance_attributes(value: Any, out: Any) -> None:
    """Give ``out`` (a rebuilt tuple or list subclass) the attributes set on ``value``, in
    its ``__dict__`` and its classes' ``__slots__``, as they are (as a copy keeps them)."""
    extra = getattr(value, "__dict__", None)
    if extra:
        out.__dict__.update(extra)
    for cls in type(value).__mro__:
        slots = getattr(cls, "__slots__", ())  # (inherited ones again: harmless)
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                setattr(out, name, getattr(value, name))


def _unchanged(items: dict, original: Mapping) -> bool:
    """Whether ``items`` (``original``'s values, cast) holds ``original``'s own values."""
    return all(items[k] is v for k, v in original.items())


def _rebuild_dataclass(value: Any, dtype: torch.dtype, only: Optional[tuple],
                       memo: Optional[dict]) -> Any:
    """``value`` (a dataclass instance) itself when none of its fields has anything to cast,
    else a copy of it with its fields' tensors cast.

    A shallow copy with each field set (``object.__setattr__``: frozen ones too), not
    ``dataclasses.replace``: that calls ``__init__`` again, which drops the values of
    ``field(init=False)`` fields (reset to their defaults: a tensor set there vanished on its
    way into an O2 model, or out of any model), fails on an ``InitVar`` without a default, and
    runs ``__post_init__`` a second time on values it already processed.
    """
    fields = [f for f in dataclasses.fields(value) if hasattr(value, f.name)]
    cast = {f.name: _cast(getattr(value, f.name), dtype, only, memo) for f in fields}
    if all(cast[f.name] is getattr(value, f.name) for f in fields):
        return value
    try:
        out = copy.copy(value)
        for name, v in cast.items():
            object.__setattr__(out, name, v)
        return out
    except Exception:  # an instance that cannot be copied: rebuild it through __init__
        return dataclasses.replace(value, **{f.name: cast[f.name] for f in fields if f.init})


def _rebuild_mapping(original: Mapping, items: dict, dtype: Optional[torch.dtype] = None,
                     only: Optional[tuple] = None, memo: Optional[dict] = None) -> Mapping:
    """A mapping of ``original``'s type holding ``items``, ``original`` left as it was.

    For ``dict`` and ``UserDict`` subclasses a shallow copy with the items assigned keeps what
    a constructor call would lose (a ``defaultdict``'s factory, a subclass's attributes): their
    copies own their items. A ``dict`` subclass that is also a dataclass (transformers'
    ``ModelOutput``) is made without its class's ``__init__``, ``__reduce__`` or
    ``__setitem__``: its keys stay the original's (a field set after it was built, ``out.loss
    = loss``, is an attribute, not a key, as in fp32; its ``__reduce__`` made it one) and its
    attributes are cast as its items are (``out.loss`` came out half at O2). Other mappings
    (whose copy may share its storage with the original) are rebuilt from the items, and a
    type that cannot be becomes a plain ``dict``.
    """
    if (isinstance(original, dict) and dataclasses.is_dataclass(original)
            and hasattr(original, "__dict__")):
        try:
            out = type(original).__new__(type(original))
            # (The storage's own __setitem__: an OrderedDict's, which keeps its order.)
            store = next(c for c in type(out).__mro__ if c in (collections.OrderedDict, dict))
            for k, v in items.items():
                store.__setitem__(out, k, v)
            attrs = original.__dict__
            if dtype is not None:
                attrs = {k: _cast(v, dtype, only, memo) for k, v in attrs.items()}
            out.__dict__.update(attrs)
            return out
        except Exception:  # an exotic one: fall through to the copy below
            pass
    if isinstance(original, (dict, UserDict)):
        try:
            out = copy.copy(original)
            for k, v in items.items():
                out[k] = v
            return out
        except Exception:  # an exotic mapping: fall through to the constructor
            pass
    try:
        return type(original)(items)
    except Exception:
        return items


@dataclasses.dataclass(frozen=True)
class AmpForwardConfig:
    """What the swapped-in ``forward`` does around the original one.

    Attributes:
        input_dtype: cast floating inputs to this dtype (None: leave them).
        autocast_dtype: run the forward under ``torch.autocast(device_type, autocast_dtype)``.
        device_type: the autocast device type (``"cuda"``, ``"cpu"``, ...).
        output_dtype: cast floating outputs to this dtype (None: leave them).
        fp32_compute: run the forward in fp32 with autocast off, casting half inputs up and the
            outputs back to the input's dtype (BatchNorm under O1 with keep_batchnorm_fp32).
        half_outputs_to_fp32: cast fp16/bf16 outputs to fp32, leaving other dtypes (O1's
            default: autocast's half results, not a float64 output, come out fp32).
        renorm_master: an ``nn.Embedding``/``nn.EmbeddingBag`` with ``max_norm`` (O2): the rows
            looked up are renormalised in the fp32 master first (see
            :func:`_renorm_master_rows`).
        encloses: another model of the same ``initialize`` call is a submodule of this one
            (O2/O3): its forward counts itself in :data:`_ENCLOSING_FORWARDS`.
        enclosed: this model is a submodule of another model of the same call (O2/O3): called
            inside that model's forward it leaves its outputs half, as the enclosing model's
            next layers need; called on its own it casts them as usual.
    """

    input_dtype: Optional[torch.dtype] = None
    autocast_dtype: Optional[torch.dtype] = None
    device_type: str = "cpu"
    output_dtype: Optional[torch.dtype] = None
    fp32_compute: bool = False
    half_outputs_to_fp32: bool = False
    renorm_master: bool = False
    encloses: bool = False
    enclosed: bool = False


# How many ``amp.disable_casts()`` blocks are open. The O1 forward enters ``torch.autocast``
# itself, which would turn casting back on for a model called inside such a block; Apex's
# disable_casts switched its one casting handle off for everything run inside, models
# included. Process-wide, as Apex's handle was (DataParallel's worker threads run the replicas
# of a model called inside the block); a plain global, which torch.compile traces and guards.
_CASTS_DISABLED = [0]


class _EnclosingForwards(threading.local):
    """How many forwards of O2/O3 models that enclose another model of their initialize call
    are running in this thread (``initialize([outer, outer.sub])``). Inside one, an enclosed
    model is a layer of a half model and keeps its outputs half; Apex cast them to fp32 there,
    which broke the enclosing model's next layer. Per thread: a part called on its own in one
    thread while the outer runs in another is not inside it (a DataParallel replica's forward
    runs in one worker thread, its parts' included)."""

    def __init__(self):
        self.depth = 0  # (set per thread: Dynamo cannot guard a class attribute's default)


class _TracedEnclosingForwards:
    """The same count, process-wide, which is what a forward traced by ``torch.compile``
    reads: the Dynamo of PyTorch 2.4 and 2.5 cannot read a ``threading.local``'s attributes
    (nor mutate them). Eager forwards count in both (a part compiled on its own, called inside
    an eager outer forward, reads the outer's count); traced ones in this one only."""

    def __init__(self):
        self.depth = 0


_ENCLOSING_FORWARDS = _EnclosingForwards()
_TRACED_ENCLOSING_FORWARDS = _TracedEnclosingForwards()


class _DataWritesOfOneCall(threading.local):
    """Writes through ``.data`` into a whole model's half parameters, found once at the start
    of its ``state_dict()`` (``_AmpModule.state_dict``) for every module's save hook: one
    comparison pass and host sync per optimizer, not one per module (3.7 ms of a 4.4 ms
    ``state_dict()`` for 25M parameters in 49 modules on an H100 otherwise). Per thread;
    ``covered`` is None outside such a call (a submodule's own ``state_dict()``: its hooks
    look for themselves)."""

    def __init__(self):
        self.saved: Dict[int, torch.Tensor] = {}
        self.covered: Optional[Set[int]] = None
        # A copy's half parameters (their ids) found to differ from their masters rounded,
        # and those compared (see _Fp32StateDict.sync).
        self.copy_differs: Set[int] = set()
        self.copy_compared: Set[int] = set()

    def start(self, model: nn.Module) -> None:
        """Look at ``model``'s master-weighted half parameters, in one walk of its modules:
        the live ones' writes (per optimizer, ``saved``/``covered``) and which of a copy's
        own differ from their masters rounded (``copy_differs``/``copy_compared``, for every
        module's ``sync``)."""
        params: Dict[int, tuple] = {}
        copy_pairs: Dict[torch.device, list] = {}
        for module in model.modules():
            hooks = module.__dict__.get("_mixprec_state_dict")
            if hooks is None or not hooks.masters:
                continue
            if hooks.standalone:
                for name, master in hooks.masters.items():
                    param = module._parameters.get(name)
                    if (param is None or param.dtype not in _HALF_TYPES or param.is_meta
                            or param.shape != master.shape or param.device != master.device
                            or param.numel() == 0 or holds_no_values(param)):
                        continue
                    copy_pairs.setdefault(param.device, []).append((param, master))
            elif not hooks.orphaned():
                own = hooks.own_params(module)
                for keeper in hooks.keepers():
                    params.setdefault(id(keeper), (keeper, []))[1].extend(own)
        self.saved, self.covered = {}, set()
        for keeper, own in params.values():
            self.saved.update(keeper.written_through_data(own))
            self.covered.update(map(id, own))
        with torch.no_grad():
            for pairs in copy_pairs.values():
                for (param, _), changed in zip(pairs, halves_differ_from_masters(pairs)):
                    self.copy_compared.add(id(param))
                    if changed:
                        self.copy_differs.add(id(param))

    def end(self) -> None:
        """Forget what :meth:`start` found (the call is over)."""
        self.saved, self.covered = {}, None
        self.copy_differs, self.copy_compared = set(), set()

    def differs(self, param: torch.Tensor, master: torch.Tensor) -> bool:
        """Whether a copy's half ``param`` differs from its ``master`` rounded to half."""
        if self.covered is not None and id(param) in self.copy_compared:
            return id(param) in self.copy_differs
        return not torch.equal(param, master.to(param.dtype))

    def of(self, keeper, params: list) -> Dict[int, torch.Tensor]:
        """The writes into ``params`` (a module's, kept by ``keeper``)."""
        if self.covered is None:
            return keeper.written_through_data(params)
        rest = [p for p in params if id(p) not in self.covered]
        found = {id(p): self.saved[id(p)] for p in params if id(p) in self.saved}
        if rest:  # (registered by a rename in this call's hooks: looked at here)
            found.update(keeper.written_through_data(rest))
        return found


_DATA_WRITES = _DataWritesOfOneCall()


class _AmpModule:
    """Mixin placed first in the MRO of a model's swapped class. See the module docstring."""

    # Class-level defaults of what amp's forward reads from the instance (see forward): an
    # instance without them (not prepared by amp, or pickled by an earlier mixprec) reads
    # these, never its class's own __getattr__ (a wrapper forwarding unknown names to an
    # inner module would answer with the inner one's).
    _mixprec_forward: Optional[AmpForwardConfig] = None
    _mixprec_instance_forward = None
    _mixprec_in_instance_forward = False
    _mixprec_own_masters = False
    _mixprec_live_masters = ()

    def __prepare_scriptable__(self):
        # (torch.jit.script calls this first: without it, TorchScript failed on the
        # annotation above with an internal type name.)
        raise RuntimeError(
            f"torch.jit.script of a model prepared by amp.initialize "
            f"({_original_class(type(self)).__name__}): TorchScript cannot compile amp's "
            "forward (its input and output casts, O1's autocast). torch.jit.trace and "
            "torch.export work on it as it is; or script a copy without amp's forward, "
            "`torch.jit.script(amp.restore_model(copy.deepcopy(model)))`, whose parameters "
            "keep their dtypes (at O2 the caller casts inputs to the half type)."
        )

    def state_dict(self, *args, **kwargs):
        # (See _DataWritesOfOneCall. Not for keep_vars=True, whose entries are the module's
        # own tensors, nor inside another model's call, which looked already.)
        keep_vars = kwargs.get("keep_vars", args[2] if len(args) > 2 else False)
        if _DATA_WRITES.covered is not None or keep_vars or is_compiling():
            return super().state_dict(*args, **kwargs)
        try:
            _DATA_WRITES.start(self)
            return super().state_dict(*args, **kwargs)
        finally:
            _DATA_WRITES.end()

    def forward(self, *args, **kwargs):
        # The instance's amp attributes are read as attributes, not self.__dict__.get: Dynamo
        # (PyTorch 2.10 to 2.13 at least) does not guard a key missing from a module's
        # __dict__, so a second model of the same class compiled in the process ran the
        # first's graph (a deep copy without its master push, another instance forward).
        # _swap_class puts every one of them in the instance dict, and the class holds
        # defaults: a plain attribute lookup either way.
        cfg = self._mixprec_forward
        if cfg is None or (self._mixprec_in_instance_forward and _in_instance_forward(self)):
            # An instance of the swapped class that amp did not prepare (nn.Sequential's
            # slicing builds ``self.__class__(...)``; a registry an ``__init_subclass__`` filled
            # when amp made the class): the user's class's forward, as it is. Or this forward
            # reached again from a forward set on the instance, which wrapped it (a deep copy
            # re-binds such a wrapper to the class's forward): amp's casts ran outside.
            return super().forward(*args, **kwargs)
        if (type(args) is not tuple or (args and isinstance(args[0], _FxProxy))
                or (getattr(_fx_symbolic_trace, "_is_fx_tracing_flag", True)
                    and _holds_fx_proxy(args, kwargs))):
            # torch.fx: a symbolic trace of this model (fx hands the *args over as one
            # Proxy) or of a module it is inside (an input is a Proxy: every input is looked
            # at while fx traces), or a Proxy made by hand (fx's retracing pattern).
            raise _fx_trace_error(self)
        # Read before this forward counts itself: a model both enclosed and enclosing
        # ([a, a.b, a.b.c]) called on its own casts its outputs.
        traced = is_compiling()
        counts = _TRACED_ENCLOSING_FORWARDS if traced else _ENCLOSING_FORWARDS
        inside = cfg.enclosed and counts.depth > 0
        if cfg.encloses:
            _TRACED_ENCLOSING_FORWARDS.depth += 1
            if not traced:
                _ENCLOSING_FORWARDS.depth += 1
            try:
                return self._mixprec_cast_forward(cfg, inside, args, kwargs)
            finally:
                _TRACED_ENCLOSING_FORWARDS.depth -= 1
                if not traced:
                    _ENCLOSING_FORWARDS.depth -= 1
        return self._mixprec_cast_forward(cfg, inside, args, kwargs)

    def _mixprec_cast_forward(self, cfg: AmpForwardConfig, inside: bool, args, kwargs):
        original_forward = self._mixprec_instance_forward
        if original_forward is None:
            original_forward = super().forward  # the user's class's forward
        else:  # (a forward set on the instance before initialize: see _swap_class)
            original_forward = functools.partial(_run_instance_forward, self, original_forward)
        compiling = is_compiling()
        if not compiling:
            _follow_torch_ddp(self)
        if self._mixprec_own_masters:
            _push_written_masters(self)
        elif not compiling and self._mixprec_live_masters:
            _push_live_masters(self)
        elif (compiling and is_exporting() and not torch.compiler.is_dynamo_compiling()
              and self._mixprec_live_masters):  # (Dynamo never reads the weak references)
            _warn_if_export_misses_writes(self)
        if cfg.renorm_master:
            _renorm_master_rows(self, args[0] if args else kwargs.get("input"))
        if cfg.fp32_compute:
            return _fp32_forward(original_forward, cfg.device_type, args, kwargs)
        if cfg.input_dtype is not None:
            args = cast_floating(args, cfg.input_dtype)
            kwargs = cast_floating(kwargs, cfg.input_dtype)
        if cfg.autocast_dtype is not None and not _CASTS_DISABLED[0]:
            with torch.autocast(cfg.device_type, dtype=cfg.autocast_dtype):
                out = original_forward(*args, **kwargs)
        elif compiling or cfg.input_dtype not in _HALF_TYPES:
            out = original_forward(*args, **kwargs)
        else:  # (O2/O3 eager: no try block in what Dynamo traces, where a graph break costs)
            try:
                out = original_forward(*args, **kwargs)
            except RuntimeError as exc:
                _note_dtype_mismatch(self, cfg.input_dtype, exc)
                raise
        if cfg.output_dtype is not None and not inside:
            out = cast_floating(out, cfg.output_dtype)
        elif cfg.half_outputs_to_fp32:
            out = cast_floating(out, torch.float32, only=_HALF_TYPES)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, reaching the fp32 masters' gradients too (O2).

        The optimizer steps the masters, so clearing only the half parameters (all the base
        class sees) would let the masters' gradients pile up across iterations in a loop that
        zeroes through the model (PyTorch's DCGAN example: ``netD.zero_grad()``).
        """
        from mixprec.amp._state import model_zeroed_grads, model_zeroing_grads

        model_zeroing_grads(self)
        super().zero_grad(set_to_none)
        # (Its optimizers keep gradient tensors after their steps, or not: see
        # _OptimizerState.grad_tensors_kept.)

        model_zeroed_grads(self, set_to_none)
        for master in master_weights(self):
            if master.grad is None:
                continue
            if set_to_none:
                master.grad = None
            else:  # (as nn.Module.zero_grad does it: a view's graph is cut, not detached)
                if master.grad.grad_fn is not None:
                    master.grad.detach_()
                else:
                    master.grad.requires_grad_(False)
                master.grad.zero_()

    def _apply(self, fn, *args, **kwargs):
        # model.float() / .half() / .double() / .to(dtype) after initialize, where the forward
        # casts floating inputs to a fixed dtype (O0, O2, O3): a conversion to another dtype
        # is refused before anything changes, since the forward would then fail with a dtype
        # mismatch deep inside the model. Device moves, memory formats and a conversion to the
        # input dtype pass: each dtype held is tried on an empty tensor.
        # (One walk for the masters, used by the checks and by the move after it.)
        has_masters = bool(master_weights(self))
        if has_masters and _replaces_parameters():
            raise RuntimeError(
                f"{type(self).__name__}: converting a model whose parameters have fp32 master "
                "weights (amp O2) with torch.__future__.set_overwrite_module_params_on_conversion"
                "(True) would replace its Parameter objects with new ones that the optimizer and "
                "amp do not hold, and training would silently stop changing the model. Move or "
                "convert the model before amp.initialize, turn the flag off, or use "
                "torch.__future__.set_swap_module_params_on_conversion(True), which keeps the "
                "objects.")
        # (A copy's own masters, which no optimizer holds, are replaced along with its
        # parameters where a move cannot keep the tensor objects: see _copy_masters_follow.)
        copy_masters = _standalone_masters(self) if has_masters else None
        if has_masters and copy_masters is None:
            _refuse_a_move_masters_cannot_follow(self, fn)
        cfg = self.__dict__.get("_mixprec_forward")
        checked = cfg is not None and not cfg.fp32_compute and (
            cfg.input_dtype is not None or cfg.autocast_dtype is not None)  # (O0-O3's roots)
        conversions = _dtype_conversions(self, fn) if checked else {}
        if conversions and cfg.input_dtype is not None:
            for dtype, new_dtype in conversions.items():
                if dtype == torch.float32 and cfg.input_dtype != torch.float32:
                    # (A half model's fp32 tensors are the BatchNorm layers amp keeps fp32,
                    # which their optimizer steps without masters.)
                    raise RuntimeError(
                        f"{type(self).__name__}: converting a model prepared by amp.initialize "
                        f"from torch.float32 to {new_dtype} (model.half(), .to(dtype), ...). "
                        f"The model is already {cfg.input_dtype} except the BatchNorm layers "
                        "amp keeps in fp32 (keep_batchnorm_fp32=True), which the optimizer "
                        "steps in fp32: this would cast them too. Drop the call; for BatchNorm "
                        "in half, pass keep_batchnorm_fp32=False to amp.initialize. For an "
                        "all-half model to deploy, convert a plain copy: "
                        "amp.restore_model(copy.deepcopy(model)).half(), or a new model "
                        "loaded from model.state_dict() (the fp32 weights), then .half()."
                    )
                if new_dtype != cfg.input_dtype:
                    raise RuntimeError(
                        f"{type(self).__name__}: converting a model prepared by amp.initialize "
                        f"from {dtype} to {new_dtype} (model.float(), .half(), .to(dtype), "
                        f"...). Its forward casts floating inputs to {cfg.input_dtype}, so the "
                        "converted model could not run. For the weights in fp32, load "
                        "model.state_dict() (the fp32 master weights at O2) into a new model; "
                        "for another precision, pass opt_level/dtype to amp.initialize of a "
                        "new model; amp.restore_model(model) first removes amp's casts if you "
                        "mean to convert this one anyway."
                    )
        elif (conversions and cfg.autocast_dtype is not None
              and conversions.get(torch.float32) in _HALF_TYPES):
            raise _o1_cast_error(self, conversions[torch.float32], cfg.autocast_dtype)
        result = super()._apply(fn, *args, **kwargs)
        if copy_masters:
            _copy_masters_follow(self, fn, copy_masters)
        if has_masters:
            _masters_follow_their_parameters(self)
        # A device move after initialize (initialize on CPU, then model.cuda()): autocast and
        # BatchNorm's fp32 guard follow the tensors to their new device type, in this module
        # and in the swapped submodules that hold no tensor to tell (a BatchNorm with
        # affine=False and track_running_stats=False).
        device_type = _held_device_type(self)
        if device_type is not None:
            for module in self.modules():
                cfg = module.__dict__.get("_mixprec_forward")
                if cfg is None or cfg.device_type == device_type or device_type == "meta":
                    # (Meta: a skeleton, such as torch.func ensembling's base for
                    # functional_call with real tensors; autocast has no meta device type,
                    # so the forward keeps the one it had.)
                    continue
                if module is self or _held_device_type(module) is None:
                    module._mixprec_forward = dataclasses.replace(cfg, device_type=device_type)
        return result

    def share_memory(self):
        # (Hogwild with torch.multiprocessing: the fp32 masters stay in this process's
        # optimizer, so what other processes write into the shared half parameters never
        # reaches them, and this process's next step writes the masters back over it.)
        if master_weights(self) and is_rank_zero():
            warnings.warn(
                f"{type(self).__name__}.share_memory(): the model's parameters are half, with "
                "fp32 master weights held by this process's optimizer (amp O2), which shared "
                "memory does not share. Updates other processes write into the shared half "
                "parameters (Hogwild training) never reach the masters: model.state_dict() "
                "leaves them out, and this process's next optimizer step overwrites them. Use "
                "opt_level='O1' (fp32 parameters, shared as in plain PyTorch) for Hogwild; "
                "sharing for inference alone is fine.", UserWarning, stacklevel=2)
        return super().share_memory()

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.__dict__.get(_IN_INSTANCE_FORWARD):
            # (Copied or pickled while a call was inside the instance forward: no call of
            # the copy's is.)
            self.__dict__[_IN_INSTANCE_FORWARD] = False
        cfg = self.__dict__.get("_mixprec_forward")
        if cfg is not None and cfg.input_dtype in _HALF_TYPES:
            _mark_parts(self)  # (a deep copy's or unpickled model's parts, as initialize's)
        if self.__dict__.get(_OWN_MASTERS, False):
            # (An optimizer copied along steps these masters; see _state._COPY_MASTERS.)
            from mixprec.amp._state import register_copied_masters

            register_copied_masters(self)

    def __reduce_ex__(self, protocol):
        # The swapped class is made at run time, so pickle cannot find it by name: rebuild it
        # from the original class instead (which pickle can find).
        # The state is what the user's class says it is (its own __getstate__ may leave out
        # what cannot be pickled); object.__getstate__ exists from Python 3.11 on.
        follow_renames_in(self)  # (a copy's masters are found by name)
        if not is_compiling():
            # (The copy could not tell its stale half weights from a write into them.)
            _push_before_leaving(self)
        getstate = getattr(self, "__getstate__", None)
        state = getstate() if getstate is not None else dict(self.__dict__)
        if isinstance(state, dict) and master_weights(self):
            # The copy takes fp32 masters of its own (see _Fp32StateDict.__getstate__), which
            # its forward must keep the half parameters in step with.
            state = {**state, _OWN_MASTERS: True}
        if isinstance(state, dict) and state.get(_LIVE_MASTERS):
            # (The optimizers' checks stay with the live model: a copy has masters of its own,
            # or none.)
            state = {**state, _LIVE_MASTERS: ()}
        return (_rebuild_amp_module, (_original_class(type(self)),), state)


# Set on a deep-copied or unpickled amp model whose modules hold masters of their own (see
# _Fp32StateDict.sync).
_OWN_MASTERS = "_mixprec_own_masters"
# On a live O2 model (and each model of its initialize call): weak references to its
# optimizers' amp states' push_written_masters, which its forward calls (see
# _push_live_masters). Not copied.
_LIVE_MASTERS = "_mixprec_live_masters"
# A forward set on the instance before initialize (``model.forward = functools.partial(
# model.forward, ...)``, a library's output wrapper), which hid the class's forward that amp
# wraps: amp moves it here and calls it inside its casts (see _swap_class); and a flag counting
# the calls inside it (which threads: _IN_INSTANCE_FORWARDS).
_INSTANCE_FORWARD = "_mixprec_instance_forward"
_IN_INSTANCE_FORWARD = "_mixprec_in_instance_forward"


def _dtype_conversions(model: nn.Module, fn) -> Dict[torch.dtype, torch.dtype]:
    """What the ``_apply`` function ``fn`` (``model.half()``, ``.to(dtype)``, a device move)
    would make of each floating dtype ``model`` holds: ``{held dtype: new dtype}`` for those it
    changes, each tried on an empty tensor on a device holding it."""
    held = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.is_floating_point():
            held.setdefault(t.dtype, t.device)
    conversions = {}
    for dtype, device in held.items():
        new = fn(torch.empty(0, dtype=dtype, device=device))
        if isinstance(new, torch.Tensor) and new.dtype != dtype:
            conversions[dtype] = new.dtype
    return conversions


def _o1_cast_error(model: nn.Module, new_dtype: torch.dtype,
                   autocast_dtype: torch.dtype) -> RuntimeError:
    """An O1 model's fp32 tensors converted to a half type (``model.half()``,
    ``.bfloat16()``, ``.to(dtype)``) would leave O1: an fp16 model ``.half()``-ed trained as
    pure half (half checkpoints, no master weights), one ``.bfloat16()``-ed failed deep inside
    its BatchNorm. Refused before anything changes (``.double()``, a float64 reference copy,
    runs as such: autocast skips float64)."""
    return RuntimeError(
        f"{type(model).__name__}: converting a model prepared by amp.initialize at O1 from "
        f"torch.float32 to {new_dtype} (model.half(), .to(dtype), ...). O1 keeps the "
        f"parameters in fp32 and runs the forward's ops in {autocast_dtype} under "
        "torch.autocast; a converted model would train without fp32 weights (or fail in its "
        "BatchNorm). For a half model with fp32 master weights, pass opt_level='O2' to "
        "amp.initialize of the model as it was before; amp.restore_model(model) first removes "
        "amp's forward if you mean to convert this one anyway.")


def _holds_fx_proxy(args: tuple, kwargs: dict) -> bool:
    """Whether a positional or keyword input is a torch.fx Proxy (a symbolic trace). Asked
    only while fx traces (its flag, one read): the scan costs a microsecond per forward."""
    return (any(isinstance(a, _FxProxy) for a in args)
            or any(isinstance(v, _FxProxy) for v in kwargs.values()))


# float32 as PyTorch's errors name it ("float", "Float", "torch.float32"), not inside
# "bfloat16", "float16", "float64" or "c10::complex<float>" (complex64), nor sdpa's "attn_mask
# dtype to be bool or float" (a float64 mask meeting a half query); and a half type ("Half",
# "BFloat16", "torch.float16").
_NAMES_FLOAT32 = re.compile(r"(?<![a-z<])(?<!bool or )float(?!16|64)")
_NAMES_HALF = re.compile(r"half|bfloat16|(?<![a-z])float16")


def _note_dtype_mismatch(model: nn.Module, half: torch.dtype, exc: RuntimeError) -> None:
    """An O2/O3 forward failed: when the error reads like a float32/half mismatch, add a note
    to PyTorch's bare "mat1 and mat2 must have the same dtype". Where the model holds fp32
    parameters that amp did not leave fp32 (outside BatchNorm: layers added after initialize,
    hand-written LoRA adapters, say) it names them and the fix; else it names the usual
    sources of an fp32 tensor in a half forward (one made inside ``forward`` without a dtype,
    Swin's shifted-window mask built with ``torch.zeros`` in detection ports, say). Once per
    error (enclosing models see it again); Python < 3.11 has no notes, so there the message
    is extended."""
    text = str(exc).lower()
    if (getattr(exc, "_mixprec_noted", False) or not _NAMES_FLOAT32.search(text)
            or not _NAMES_HALF.search(text)):
        return
    names, converted = [], []
    for prefix, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            continue
        hooks = getattr(module, "_mixprec_state_dict", None)
        for name, p in module.named_parameters(recurse=False):
            if p.dtype == torch.float32:
                # (One with an fp32 master was half: converted since, by a submodule's
                # .float() or model.apply(...), which the model's own refusal does not see.)
                mastered = hooks is not None and name in hooks.masters
                (converted if mastered else names).append(
                    f"{prefix}{'.' if prefix else ''}{name}")
    where = (f"amp: this model ({_original_class(type(model)).__name__}) was cast to {half} by "
             f"amp.initialize and its forward casts floating inputs to {half}")
    if converted:
        note = (
            f"{where}, but {listed(converted, most=4)} {'was' if len(converted) == 1 else 'were'}"
            f" converted to float32 since (a submodule's .float(), or model.apply(...), which "
            "the refusal of model.float() on the model itself does not see). Convert them "
            f"back (.to({half})); for an fp32 model, convert them back first, then load "
            "model.state_dict() (the fp32 master weights) into a new model built in fp32. "
            "While converted, a parameter is saved as it now is, its half values upcast."
        )
    elif names:
        shown = listed(names, most=4)
        masters = ("; optimizer.add_param_group then keeps fp32 master weights for them"
                   if master_weights(model) else "")
        note = (
            f"{where}, but it holds float32 parameters amp did not make: {shown} (added after "
            f"initialize?). If the dtype mismatch is theirs, cast them to {half} (e.g. "
            f"module.to({half})) before giving them to the optimizer{masters}, or add them "
            "before amp.initialize."
        )
    else:
        note = (
            f"{where}; a float32 tensor met its {half} values here. At O2/O3 that is usually "
            "one made inside forward without a dtype (torch.zeros(...), torch.arange(...)"
            ".float(), an attention mask or position table: pass dtype=x.dtype), a buffer "
            "registered after initialize, or an input that reaches the model other than "
            "through its arguments. O1 casts per op instead and takes such tensors."
        )
    try:
        exc._mixprec_noted = True
    except AttributeError:  # (an exception type with __slots__)
        return
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)
    else:
        exc.args = (f"{exc.args[0]}\n{note}" if exc.args else note,) + exc.args[1:]


def _fx_trace_error(model: nn.Module) -> RuntimeError:
    return RuntimeError(
        f"torch.fx.symbolic_trace of a model prepared by amp.initialize "
        f"({_original_class(type(model)).__name__}): fx's graph would leave out amp's input and "
        "output casts and O1's autocast, so it is refused. torch.jit.trace and torch.export "
        "work on it as it is; for fx (torchvision's create_feature_extractor, fx "
        "quantization) trace a copy without amp's forward, "
        "`torch.fx.symbolic_trace(amp.restore_model(copy.deepcopy(model)))`, whose parameters "
        "keep their dtypes (at O2 the caller casts inputs to the half type).")


# (id(module), thread) -> how deep that thread is in the module's instance forward: a flag on
# the module alone made another thread's concurrent call (an inference server) skip amp's casts
# and the instance forward. The flag (the module's _IN_INSTANCE_FORWARD) counts the eager calls
# inside, so that amp's forward looks the thread up only while there are some. A
# torch.compile trace (one thread) marks its own call with _TRACED_INSIDE instead and asks
# only for that: an id() lookup there would tie each graph to one module object, Dynamo cannot
# trace threading.get_ident, and an eager call inside at trace time, or a count a copy carried
# over, is no call of the trace's.
_IN_INSTANCE_FORWARDS: Dict[Tuple[int, int], int] = {}
_IN_INSTANCE_FORWARDS_LOCK = threading.Lock()
_TRACED_INSIDE = "traced"


def _calls_inside(flag) -> int:
    """The eager calls the module's flag counts (a trace's mark, or False, is none)."""
    return flag if type(flag) is int else int(flag is True)


def _in_instance_forward(module: nn.Module) -> bool:
    """Whether this call comes from inside ``module``'s instance forward (amp's forward asks
    only while the module's flag is set: see _run_instance_forward)."""
    if is_compiling():
        return getattr(module, _IN_INSTANCE_FORWARD, False) == _TRACED_INSIDE
    return (id(module), threading.get_ident()) in _IN_INSTANCE_FORWARDS


def _run_instance_forward(module: nn.Module, forward: Callable, *args, **kwargs):
    if is_compiling():
        # (Attribute access, not the instance dict: Dynamo before 2.7 cannot trace a store
        # into a module's __dict__, which broke fullgraph=True.)
        already = getattr(module, _IN_INSTANCE_FORWARD, False)
        setattr(module, _IN_INSTANCE_FORWARD, _TRACED_INSIDE)
        try:
            return forward(*args, **kwargs)
        finally:
            setattr(module, _IN_INSTANCE_FORWARD, already)
    key = (id(module), threading.get_ident())
    with _IN_INSTANCE_FORWARDS_LOCK:
        depth = _IN_INSTANCE_FORWARDS.get(key, 0)
        _IN_INSTANCE_FORWARDS[key] = depth + 1
        module.__dict__[_IN_INSTANCE_FORWARD] = (
            _calls_inside(module.__dict__.get(_IN_INSTANCE_FORWARD, False)) + 1)
    try:
        return forward(*args, **kwargs)
    finally:
        with _IN_INSTANCE_FORWARDS_LOCK:
            if depth:
                _IN_INSTANCE_FORWARDS[key] = depth
            else:
                del _IN_INSTANCE_FORWARDS[key]
            inside = _calls_inside(module.__dict__.get(_IN_INSTANCE_FORWARD, False)) - 1
            module.__dict__[_IN_INSTANCE_FORWARD] = inside if inside > 0 else False


# Whether _push_written_masters is running behind outside_the_compiler (see there).
_PUSH_TRACED = [False]


def _push_written_masters(model: nn.Module) -> None:
    """Before a copy's forward: masters written since (through ``state_dict()``'s tensors, as
    an EMA of the state dict does) go into the half parameters the forward uses."""
    if is_exporting():
        # torch.export: the parameters are fake tensors there, and a non-strict export traces
        # the disabled call below as plain Python, which came back here without end. The
        # program takes the half parameters as the copy's last forward or state_dict() left
        # them (docs/amp.md).
        _warn_if_export_misses_writes(model)
        return None
    if is_compiling():
        if _PUSH_TRACED[0]:
            # Back here still tracing: the disabled call was traced as plain Python (a
            # non-strict export on a PyTorch before 2.7, which has no export flag).
            return None
        # Version counters cannot be traced: a compiled forward runs this eagerly (a graph
        # break).
        _PUSH_TRACED[0] = True
        try:
            return outside_the_compiler(_push_written_masters)(model)
        finally:
            _PUSH_TRACED[0] = False
    if getattr(model, "_is_replica", False):  # (a DataParallel replica's are broadcast copies)
        return None
    with _tracer_paused():
        for module in model.modules():
            hooks = module.__dict__.get("_mixprec_state_dict")
            if hooks is not None and hooks.standalone:
                hooks.sync(module, check_params=False)
    return None


@contextlib.contextmanager
def _tracer_paused():
    """Run amp's copies between masters and half parameters eagerly under ``torch.jit.trace``
    (recorded, they failed inserting the masters as constants; the trace then takes the half
    parameters as the copies left them)."""
    tracing = torch._C._get_tracing_state() if torch.jit.is_tracing() else None
    if tracing is None:
        yield
        return
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(tracing)


class _OrphanedMasters:
    """In a live O2 model's :data:`_LIVE_MASTERS` once its optimizers are gone (training
    done): their masters are the model's own from then on, kept in step as a copy's are
    (docs/amp.md), and a master written in place (a server's ``dcp.load`` into
    ``model.state_dict()``) goes into its half parameter before the next eager forward. Called
    as the weak references it replaces are, it gives its push. One version read per master
    when nothing was written; a compiled forward does not look (no graph break)."""

    def __init__(self, model: nn.Module):
        # (module, its hooks, the names of its masters to look at: see unattended)
        self.entries = []
        for module in model.modules():
            hooks = module.__dict__.get("_mixprec_state_dict")
            names = hooks.unattended() if hooks is not None else None
            if names:
                self.entries.append((weakref.ref(module), hooks, names))
        self._masters = [hooks.masters[n] for _, hooks, names in self.entries for n in names]
        self._seen: Optional[List[int]] = None

    def __call__(self):
        return self.push

    def push(self) -> None:
        now = [m._version for m in self._masters]
        if now == self._seen:
            return
        looked = True
        for ref, hooks, names in self.entries:
            module = ref()
            if module is not None:
                looked &= hooks.sync(module, check_params=False, names=names)
        # (The versions read before the syncs, which write no master: one written meanwhile
        # by another thread shows at the next forward. Not cached when a write waited, under
        # torch.func.functional_call: the next forward takes it.)
        self._seen = now if looked else None


def _written_masters_waiting(model: nn.Module) -> bool:
    """Whether a master of ``model`` was written in place (``dcp.load`` into
    ``model.state_dict()``, an EMA update of a copy's state dict) since amp last cast the
    masters into the half parameters: what the next eager forward's push would take."""
    for ref in model.__dict__.get(_LIVE_MASTERS, ()):
        written = getattr(ref(), "__self__", None)
        written = getattr(written, "masters_written", None)
        if written is not None and written():
            return True
    for module in model.modules():
        hooks = module.__dict__.get("_mixprec_state_dict")
        names = hooks.unattended() if hooks is not None else None
        if names and hooks.written(names):
            return True
    return False


def _warn_if_export_misses_writes(model: nn.Module) -> None:
    """Under a non-strict ``torch.export`` (also ``torch.onnx.export``'s default exporter),
    which traces on fake parameters, no write can reach the half parameters: warn when
    masters written in place wait for the next eager forward, as the program would silently
    hold the old half weights. A strict export (Dynamo, which cannot read version counters
    without a graph break) is not looked at."""
    if torch.compiler.is_dynamo_compiling() or not _written_masters_waiting(model):
        return
    if is_rank_zero():
        warnings.warn(
            f"amp: exporting {type(model).__name__} while fp32 master weights written in "
            "place (a dcp.load or copy_ into model.state_dict()'s tensors, an EMA update of a "
            "copy's state dict) have not reached its half parameters yet, which the exported "
            "program takes as they are: it would hold the old weights. "
            "Call model.state_dict() or run one eager forward (in eval mode, under "
            "torch.no_grad(): BatchNorm's statistics move in train mode) before exporting; "
            "both cast the masters into the half parameters.", UserWarning, stacklevel=3)


def set_live_masters(model: nn.Module, keepers) -> None:
    """Have ``model``'s forward look for masters written in place since the last step in the
    amp states ``keepers`` (its ``initialize`` call's optimizers with masters)."""
    model.__dict__[_LIVE_MASTERS] = tuple(
        weakref.WeakMethod(keeper.push_written_masters) for keeper in keepers)


def _push_live_masters(model: nn.Module) -> None:
    """Before the live model's forward: masters written in place since amp last set the half
    model (``copy_`` into ``amp.master_params(optimizer)`` or ``model.state_dict()``'s
    tensors, ``torch.distributed.checkpoint``'s in-place load) go into the half parameters
    the forward uses, as the next step's copy would put them (see
    ``_OptimizerState.push_written_masters``). Not in a ``DataParallel`` replica (its
    parameters are broadcast copies: such writes reach those at the next step). Once the
    optimizers are gone, the masters they left are the model's own, as a copy's."""
    if getattr(model, "_is_replica", False):
        return
    with _tracer_paused():
        alive, dead = [], False
        for ref in model._mixprec_live_masters:
            push = ref()
            if push is None:
                dead = True
            else:
                alive.append(ref)
                push()
        if dead:
            # (An optimizer gone, all or one of several, as a GAN's discriminator's: the
            # modules whose masters no live optimizer keeps are looked at as a copy's.)
            orphaned = _OrphanedMasters(model)
            model.__dict__[_LIVE_MASTERS] = tuple(
                ref for ref in alive if not isinstance(ref, _OrphanedMasters)
            ) + ((orphaned,) if orphaned.entries else ())
            orphaned.push()


def _push_before_leaving(model: nn.Module) -> None:
    """Masters written in place since ``model``'s last forward go into its half parameters
    now, the live model's or a copy's, before it is copied or restored (which would run
    or keep the stale half weights)."""
    if model.__dict__.get(_LIVE_MASTERS):
        _push_live_masters(model)
    elif model.__dict__.get(_OWN_MASTERS):
        _push_written_masters(model)


# PyTorch's DDPs seen active in a forward of amp's, each with the amp models found inside its
# module. (_active_ddp_module is one for the process: a forward in another thread while a DDP
# forward runs sees it too, as does a model called inside that forward but not part of it.)
_TORCH_DDP_MEMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Per DDP of those: whether its last forward that amp could read set up no all-reduce (see
# torch_ddp_skips_this_backward).
_TORCH_DDP_FORWARD_DEFERRED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _inside_torch_ddp(ddp, model: nn.Module) -> bool:
    """Whether ``model`` is a module of ``ddp``'s (looked up once per pair, then cached: PyTorch's
    DDP takes its modules at construction)."""
    # Answers are kept both ways: a model called inside a DDP's forward without being part of
    # it (a distillation teacher kept out of the DDP's modules) would walk them at every call.
    # (Models by id, with a weak reference: a module class may define __eq__ without
    # __hash__; a wrapper class that does so is walked at every call.)
    try:
        members = _TORCH_DDP_MEMBERS.get(ddp)
    except TypeError:
        return any(m is model for m in ddp.module.modules())
    seen = members.get(id(model)) if members is not None else None
    if seen is not None and seen[0]() is model:
        return seen[1]
    inside = any(m is model for m in ddp.module.modules())
    if members is None:
        members = _TORCH_DDP_MEMBERS[ddp] = {}
    members[id(model)] = (weakref.ref(model), inside)
    return inside


def _follow_torch_ddp(model: nn.Module) -> None:
    """Inside the forward of PyTorch's own ``DistributedDataParallel`` (which marks itself
    active around its module's forward: ``_active_ddp_module``, set for TorchDynamo), record
    on ``model`` whether the backward to come all-reduces (:data:`GRAD_SYNC_DEFERRED`), as
    mixprec's wrapper tells amp itself. Inside ``no_sync()`` amp's ``scale_loss`` then keeps
    the gradients scaled in place, as ``delay_unscale=True`` does, and the synced backward
    all-reduces every micro-batch's; unscaled into the masters (or, at O1, set aside for the
    next backward), each rank's earlier micro-batches stayed out of the all-reduce and the
    replicas drifted apart with no error. Only for a module of that DDP's (the flag is one
    for the process: a forward in another thread, or of a model called inside the DDP's
    forward but not part of it, is not its). A forward recomputed during the backward
    (activation checkpointing) keeps the record of the forward it repeats, taken under
    ``no_grad`` for a reentrant checkpoint (``scale_loss`` also asks the DDP itself, for
    the recomputes this misreads: :func:`torch_ddp_skips_this_backward`). Eager forwards
    only: under ``torch.compile`` pass ``delay_unscale=True`` inside ``no_sync()``."""
    ddp = getattr(_TorchDDP, "_active_ddp_module", None) if _TorchDDP is not None else None
    d, grad = model.__dict__, torch.is_grad_enabled()
    if (ddp is None or hasattr(ddp, "_tell_amp_models")  # (none, or mixprec's: it tells)
            or not _inside_torch_ddp(ddp, model)):
        if torch._C._current_graph_task_id() != -1:
            # A forward recomputed during a backward (activation checkpointing): the record
            # of the forward it recomputes holds; a reentrant checkpoint's ran under no_grad,
            # and so does its recompute when an outer checkpoint's recompute runs it (nested
            # checkpoints with a reentrant inner one): taken there, the inner recompute that
            # follows finds it.
            pending = d.pop(_NO_GRAD_TORCH_DDP, None)
            if pending is not None:
                d[GRAD_SYNC_DEFERRED] = d[_SET_BY_TORCH_DDP] = pending
            return
        if grad and d.get(_SET_BY_TORCH_DDP):
            d[GRAD_SYNC_DEFERRED] = d[_SET_BY_TORCH_DDP] = False
        return
    deferred = not getattr(ddp, "require_backward_grad_sync", True)
    if grad or deferred:
        # (For scale_loss's look at the DDP: a forward under no_grad outside no_sync(), an
        # evaluation or a reentrant checkpoint's first pass, leaves the record alone.)
        try:
            _TORCH_DDP_FORWARD_DEFERRED[ddp] = deferred
        except TypeError:  # (an unhashable DDP subclass: the forward's record alone)
            pass
    if grad:
        d[GRAD_SYNC_DEFERRED] = d[_SET_BY_TORCH_DDP] = deferred
        d.pop(_NO_GRAD_TORCH_DDP, None)
    else:  # (an evaluation, or a reentrant checkpoint's forward: see _NO_GRAD_TORCH_DDP)
        d[_NO_GRAD_TORCH_DDP] = deferred


def torch_ddp_skips_this_backward(model: nn.Module) -> bool:
    """Whether a PyTorch ``DistributedDataParallel`` seen holding ``model`` (see
    :func:`_follow_torch_ddp`) will not all-reduce the backward running now: it is inside
    ``no_sync()``, and its last forward that amp read set up no all-reduce. Read by
    ``scale_loss`` beside the forward's record on the model, which a forward recomputed by
    activation checkpointing can misread (an evaluation under ``no_grad`` between a
    ``no_sync()`` micro-batch's forward and its backward). A forward outside ``no_sync()``
    all-reduces its backward even when that runs inside it, and an evaluation under
    ``no_grad`` (on some ranks only, say) between a forward and its backward does not
    count."""
    if not _TORCH_DDP_FORWARD_DEFERRED:
        return False
    for ddp, deferred in list(_TORCH_DDP_FORWARD_DEFERRED.items()):
        if deferred and not getattr(ddp, "require_backward_grad_sync", True):
            members = _TORCH_DDP_MEMBERS.get(ddp)
            seen = members.get(id(model)) if members is not None else None
            if seen is not None and seen[1] and seen[0]() is model:
                return True
    return False


def _renorm_master_rows(module: nn.Module, indices) -> None:
    """``max_norm`` of an embedding whose weight has an fp32 master (O2), applied to the master.

    ``F.embedding(..., max_norm=...)`` rescales the looked-up rows of the weight in place, and
    in fp32 training that write is permanent. Left to the half weight, it would bump the
    weight's version at every forward, and amp would take the whole half weight into the
    master before each step (its in-place-write rule), rounding the embedding's master to half
    every step. Renormalising the master's rows first (exactly as fp32 training does) and
    copying those rows into the half weight keeps the master authoritative: a master written
    since amp's last copy wins over the half weight, so half-weight writes made before this
    forward are taken into the master first (its optimizer's ``take_model_writes``). The
    forward's own renorm of the half rows then only corrects their rounding.
    """
    hooks = module.__dict__.get("_mixprec_state_dict")
    master = hooks.masters.get("weight") if hooks is not None else None
    if (master is None or module.max_norm is None or not isinstance(indices, torch.Tensor)
            or getattr(module, "_is_replica", False)):  # (DataParallel: a broadcast copy)
        return
    if not is_compiling():
        # First the in-place-write rule, as at a step: a half weight written since amp's last
        # copy (nn.init, PyTorch's DDP broadcasting rank 0's weights) goes into the master,
        # which this renorm is about to write (and would then win). (Traced by torch.compile,
        # the renorm alone: version counters are not traceable, as at the step.)
        taker = hooks.take_writes.get("weight")
        take = taker() if taker is not None else None
        if take is not None:
            take()
    with torch.no_grad():
        rows = indices.reshape(-1).to(device=master.device, dtype=torch.long)
        torch.embedding_renorm_(master, rows, module.max_norm, module.norm_type)
        module.weight.index_copy_(0, rows, master.index_select(0, rows).to(module.weight.dtype))


def _masters_follow_their_parameters(model: nn.Module) -> None:
    """After a device move of ``model`` (``model.cuda()`` or ``model.to_empty(device=...)``
    after ``initialize``), move each fp32 master to its half parameter's new device.

    In place (``.data``, as ``nn.Module._apply`` moves parameters): the optimizer holds the
    master objects. Left behind, the masters were stepped on the old device and copied from
    there into the model, and on a GPU the first backward failed assigning a CUDA gradient to
    a CPU master. (A move that cannot keep the tensor objects, to or from the meta device, is
    refused first: see :func:`_refuse_a_move_masters_cannot_follow`.) The optimizer's
    per-parameter state stays where it is, as PyTorch leaves it for a moved model.
    """
    for module in model.modules():
        hooks = module.__dict__.get("_mixprec_state_dict")
        if hooks is None:
            continue
        hooks.follow_renames(module)
        for name, master in hooks.masters.items():
            param = module._parameters.get(name)
            if param is None or master.device == param.device:
                continue
            with torch.no_grad():
                grad, master.grad = master.grad, None
                master.data = master.data.to(param.device)
                if grad is not None:
                    master.grad = grad.to(param.device)
            taker = hooks.take_writes.get(name)
            take = taker() if taker is not None else None
            moved = getattr(getattr(take, "__self__", None), "params_moved", None)
            if moved is not None:
                moved()


def _standalone_masters(model: nn.Module) -> Optional[list]:
    """``[(module, hooks, name, master, half parameter)]`` when every master of ``model`` is a
    copy's own (a deep-copied or unpickled O2 model: no optimizer holds them), else None."""
    found = []
    for module in model.modules():
        hooks = module.__dict__.get("_mixprec_state_dict")
        if hooks is None or not hooks.masters:
            continue
        if not hooks.standalone:
            return None
        found.extend((module, hooks, name, master, module._parameters.get(name))
                     for name, master in hooks.masters.items())
    return found


def _copy_masters_follow(model: nn.Module, fn, before: list) -> None:
    """After a move of a copy (see :func:`_standalone_masters`) that gave its parameters new
    tensor objects (to or from the meta device: ``copy.deepcopy(model).to("meta")``, the base
    of torch.func's model ensembling; ``to_empty``), give its masters the same conversion:
    they are the copy's own, and would otherwise be dropped as masters of replaced
    parameters, the copy saving its half values from then on."""
    from mixprec.amp._state import register_copied_masters

    for module, hooks, name, master, old in before:
        new = module._parameters.get(name)
        if new is None or new is old:
            continue
        if new.device != master.device:
            moved = fn(master)
            if not isinstance(moved, torch.Tensor):
                continue
            hooks.masters[name] = moved.detach()
            hooks._versions.pop(name, None)
        hooks._halves[name] = id(new)  # (a new object on the same device too: a cast)
    register_copied_masters(model)


def _refuse_a_move_masters_cannot_follow(model: nn.Module, fn) -> None:
    """Refuse, before anything changes, a device move of a model with fp32 masters between
    device types whose tensors PyTorch cannot move in place (to or from the meta device:
    ``model.to_empty(device="cuda")`` of a model built on meta and initialized there).

    ``nn.Module._apply`` then gives the model new Parameter objects, which neither the
    optimizer nor amp hold: the masters stayed on the old device, the steps changed them
    alone, and the model silently never trained.
    """
    for device in {p.device for p in model.parameters()}:
        probe = torch.empty(0, device=device)
        new = fn(probe)
        if (isinstance(new, torch.Tensor) and new.device != device
                and not torch._has_compatible_shallow_copy_type(probe, new)):
            raise RuntimeError(
                f"{type(model).__name__}: moving a model whose parameters have fp32 master "
                f"weights (amp O2) from {device} to {new.device} after amp.initialize. PyTorch "
                "moves parameters between these device types by making new tensors, which the "
                "optimizer and its fp32 master weights would not follow, so training would "
                "silently stop changing the model. Move the model first (e.g. "
                f"model.to_empty(device=\"{new.device}\") and initialize its weights), then "
                "build the optimizer and call amp.initialize."
            )


def _replaces_parameters() -> bool:
    """Whether ``nn.Module._apply`` now gives converted parameters new Parameter objects."""
    swap = getattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: False)
    return torch.__future__.get_overwrite_module_params_on_conversion() and not swap()


def _fp32_forward(original_forward: Callable, device_type: str, args, kwargs):
    # The input's dtype, given positionally or by keyword (``bn(input=x)``: the output went
    # back as fp32 instead of the half the layer was given).
    in_dtype = next(
        (a.dtype for a in itertools.chain(args, kwargs.values())
         if isinstance(a, torch.Tensor) and a.is_floating_point()), None
    )
    # Only half inputs go up to fp32: a float64 input (a .double() model under O1) stays
    # float64, which its float64 parameters need (cast to fp32, batch_norm refused the mix).
    with torch.autocast(device_type, enabled=False):
        out = original_forward(*cast_floating(args, torch.float32, only=_HALF_TYPES),
                               **cast_floating(kwargs, torch.float32, only=_HALF_TYPES))
    return cast_floating(out, in_dtype) if in_dtype is not None else out


# (Original class -> its swapped class, both held weakly: a class defined per trial, or
# torch.fx's class per GraphModule, goes when its last model does.)
_SWAPPED_CLASSES: weakref.WeakKeyDictionary[type, weakref.ref] = weakref.WeakKeyDictionary()


def _amp_class(original: type) -> type:
    # A class cache (types, not state): every model of one class shares one swapped class.
    ref = _SWAPPED_CLASSES.get(original)
    cls = ref() if ref is not None else None
    if cls is None:
        cls = type(original.__name__, (_AmpModule, original), {
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
            "__doc__": original.__doc__,
            "forward": _forward_showing_the_signature_of(original),
        })
        _SWAPPED_CLASSES[original] = weakref.ref(cls)
    return cls


def _forward_showing_the_signature_of(original: type) -> Callable:
    """amp's forward (the same code, no extra call) showing the signature of ``original``'s
    forward to ``inspect.signature``: tools bind arguments by the forward's parameter names
    (``torch.export``'s ``dynamic_shapes={"x": ...}``, transformers' Trainer choosing the
    dataset columns the model takes), which ``(*args, **kwargs)`` refused or emptied."""
    amp_forward = _AmpModule.forward
    forward = types.FunctionType(amp_forward.__code__, amp_forward.__globals__,
                                 amp_forward.__name__, amp_forward.__defaults__,
                                 amp_forward.__closure__)
    forward.__qualname__ = amp_forward.__qualname__
    user_forward = inspect.getattr_static(original, "forward", None)
    if isinstance(user_forward, types.FunctionType):
        forward.__doc__ = user_forward.__doc__
    if isinstance(user_forward, (types.FunctionType, functools.partialmethod)):
        # (A method, whose self is bound alike. A staticmethod, a callable object, a C
        # function: amp's own signature shows; theirs would be bound one argument short.)
        try:
            signature = inspect.signature(original.forward)
        except (TypeError, ValueError):  # (one inspect cannot read)
            signature = None
        if signature is not None:
            forward.__signature__ = signature
    return forward


def _original_class(cls: type) -> type:
    return cls.__mro__[2] if cls.__mro__[1] is _AmpModule else cls


def _rebuild_amp_module(original: type):
    return _amp_class(original).__new__(_amp_class(original))


def is_amp_model(module: nn.Module) -> bool:
    """True when ``module`` went through ``amp.initialize`` (its class was swapped and amp
    set its forward; a new object of the swapped class, such as a slice ``model[:-1]`` of an
    amp ``nn.Sequential``, did not)."""
    return isinstance(module, _AmpModule) and "_mixprec_forward" in module.__dict__


def _swap_class(module: nn.Module, config: AmpForwardConfig) -> None:
    if not isinstance(module, _AmpModule):
        module.__class__ = _amp_class(type(module))
        own = module.__dict__.pop("forward", None)
        if own is not None:
            # A forward set on the instance hides the class's, amp's: nn.Module's __call__
            # would run it and none of amp's casts (O1 silently fp32, O2/O3 a dtype error).
            # amp runs it inside its casts instead, as Apex's patched instance forward did.
            module.__dict__[_INSTANCE_FORWARD] = own
    # (Every attribute amp's forward reads, in the instance dict: see _AmpModule.forward.)
    module.__dict__.setdefault(_INSTANCE_FORWARD, None)
    module.__dict__.setdefault(_IN_INSTANCE_FORWARD, False)
    module.__dict__.setdefault(_OWN_MASTERS, False)
    module._mixprec_forward = config


def carry_amp_forward(old: nn.Module, new: nn.Module) -> None:
    """Give ``new``, built to replace ``old`` after ``amp.initialize`` (``convert_syncbn_model``
    on a prepared model), what amp gave ``old``: its class's amp forward and configuration,
    and the model it is a part of. Nothing when ``old`` is not amp's."""
    if is_amp_model(old) and not is_amp_model(new):
        _swap_class(new, old._mixprec_forward)
    ref = _PART_OF.get(old)
    if ref is not None:
        _PART_OF[new] = ref
    if old.__dict__.get(_LIVE_MASTERS):
        new.__dict__[_LIVE_MASTERS] = old.__dict__[_LIVE_MASTERS]
    hooks = old.__dict__.get("_mixprec_state_dict")
    if hooks is not None and new.__dict__.get("_mixprec_state_dict") is None:
        # Its fp32 checkpoints: the masters of the parameters it took over (the same objects),
        # and upcasts of its other half tensors (O3), as the old module's hooks gave them.
        hooks.carry_to(_install_state_dict_hooks(new), new._parameters)


def restore_model(module: nn.Module) -> nn.Module:
    """Undo the forward wrapping of ``amp.initialize`` on ``module`` and its children.

    Dtypes are left as they are and the state-dict hooks stay: at O2 ``state_dict()`` still
    returns the exact fp32 masters while the parameters are half. Cast back with
    ``module.float()`` if wanted; the parameters then hold their half values upcast (not the
    masters'), and are what ``state_dict()`` returns from then on. For the exact fp32 weights,
    load ``module.state_dict()`` (taken before the cast) into the fp32 model. The hooks staying,
    a pickle of the restored module (``torch.save(module)``) needs mixprec to load; to ship a
    model without it, save a freshly built one loaded from ``module.state_dict()``.

    Returns:
        nn.Module: the same object.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"amp.restore_model(module={type(module).__name__}): expected the "
                        "torch.nn.Module amp.initialize returned.")
    restored = {id(m) for m in module.modules()}
    for m in module.modules():
        ref = _PART_OF.get(m)
        if ref is not None and id(ref()) in restored:  # (not a part of a model left as it is)
            del _PART_OF[m]
        if isinstance(m, _AmpModule):
            _push_before_leaving(m)  # (the restored model's forward and .float() take them)
            m.__class__ = _original_class(type(m))
            m.__dict__.pop("_mixprec_forward", None)
            m.__dict__.pop(_IN_INSTANCE_FORWARD, None)
            m.__dict__.pop(_OWN_MASTERS, None)
            m.__dict__.pop(_LIVE_MASTERS, None)
            own = m.__dict__.pop(_INSTANCE_FORWARD, None)
            if own is not None:
                m.__dict__["forward"] = own
    return module


# ---------------------------------------------------------------------------------------------
# fp32 state dicts
# ---------------------------------------------------------------------------------------------
def reshaped_parameter_error(name, master: torch.Tensor,
                             param: torch.Tensor) -> RuntimeError:
    """The error for a half parameter whose shape changed after ``initialize`` (its ``.data``
    replaced: transformers' ``resize_token_embeddings`` does so), which its fp32 master and
    the optimizer's state for it cannot follow. ``name``: its name, or every name of a tied
    parameter (an embedding shared with the output layer), in the model's order."""
    names = [name] if isinstance(name, str) else list(name)
    shown = repr(names[0]) + (
        f" (tied: also {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else "")
    return RuntimeError(
        f"amp: the parameter {shown} changed shape from {tuple(master.shape)} to "
        f"{tuple(param.shape)} after amp.initialize (its .data was replaced, as "
        "transformers' resize_token_embeddings() does, or FSDP flattening the model wrapped "
        "after amp.initialize), but its fp32 master weight and the optimizer's state for it "
        "keep the old shape: a checkpoint would hold the old weight and a step cannot run. "
        "Change the model's shapes before amp.initialize (resize the embeddings right after "
        "loading the model and tokenizer, then build the optimizer and initialize both; "
        "for FSDP see the README: shard first, then amp.initialize at O1).")


class _Fp32StateDict:
    """Module state-dict hooks: save fp32, and load fp32 values into the masters exactly.

    ``masters`` maps a direct parameter's name to its fp32 master tensor (O2). Parameters with
    no master (O3, or O2 without an optimizer) are saved upcast from half. The masters belong
    to the optimizer, which keeps the half parameters in step with them. A pickled or
    deep-copied model (an EMA copy, a snapshot) takes copies of the masters along: its
    ``state_dict()`` stays the exact fp32 values, and its tensors are the copy's own, so an
    EMA written into them in place (``ema.state_dict()[k].copy_(...)``) accumulates in fp32.
    With no optimizer to keep them in step, such a copy's masters are ``standalone`` and
    :meth:`sync` does it: a master written since is cast into its half parameter (before the
    copy's forward and state dict), and a half parameter changed since (an EMA over
    ``parameters()``, a plain optimizer stepping the copy) is upcast into its master before the
    state dict is read.
    """

    def __init__(self):
        self.masters: Dict[str, torch.Tensor] = {}
        # Per master, its optimizer's in-place-write check (weak: amp's state owns it), for
        # a forward that writes the master itself (an embedding's max_norm). Not copied.
        self.take_writes: Dict[str, weakref.WeakMethod] = {}
        self.standalone = False
        self._versions: Dict[str, int] = {}  # each standalone master's version when synced
        # The module whose hooks these are (weak; a load pre-hook is not given it), and every
        # optimizer amp state that kept a master here (weak). Not copied: a copy's masters
        # have no optimizer to find renames through.
        self.module: Optional[weakref.ref] = None
        self._keeper_refs: List[weakref.ref] = []
        # Per master, the id of the half parameter it was registered for (not copied): a name
        # that now holds another parameter (replaced, or tied after initialize) is found. An
        # id, not a weak reference: torch.utils.swap_tensors (swap_module_params_on_conversion)
        # refuses a tensor with weak references; the optimizer holds the half alive.
        self._halves: Dict[str, int] = {}
        # (The state dict and prefix of a load whose keys load() missed; see loaded().)
        self._pending_load = None

    def follow_renames(self, module: nn.Module, state_dict=None, prefix: str = "") -> None:
        """Move the masters of parameters renamed or moved since they were registered, found
        through the optimizers' (half, master) pairs by identity:

        * renamed on ``module``: torch's pruning (``torch.nn.utils.prune``) moves ``weight``,
          the same Parameter object, to ``weight_orig``, and ``prune.remove`` moves it back
          with the pruned values written through ``.data`` (which no version counter sees);
        * moved into a submodule: ``torch.nn.utils.parametrize.register_parametrization``
          moves ``weight`` to ``parametrizations.weight.original`` (that submodule gets these
          hooks too), and ``remove_parametrizations`` moves it back.

        Where the half parameter no longer equals its master rounded to half, those elements
        are taken into the master (the others keep their fp32 value). Without this,
        checkpoints held the half value (upcast, or as it was in a new submodule) and a load
        rounded the master to half; after ``prune.remove`` the next step or state dict
        brought the pruned weights back. With ``state_dict`` (a save, which runs after the
        submodules saved theirs), the moved master's entry there is written too.
        """
        params = module._parameters
        for name, half in list(self._halves.items()):
            param = params.get(name)
            if param is not None and half != id(param) and name in self.masters:
                # Replaced since (``layer.weight = nn.Parameter(...)``, or a weight tied after
                # initialize, as ``tie_weights()`` does): the old master no longer stands for
                # it. Dropped, the name is looked up below as any unmastered half parameter:
                # it takes the new parameter's own master if an optimizer keeps one (a tied
                # weight's), else it is saved as it is.
                self._forget(name)
        missing = [name for name in self.masters if name not in params]
        orphans = [name for name, p in params.items()
                   if p is not None and p.dtype in _HALF_TYPES and name not in self.masters]
        if not (missing or orphans):
            return
        for keeper in self.keepers():
            master_of = {id(half): master for half, master in keeper.pairs}
            for name in orphans:  # (renamed here, or moved back from a submodule)
                master = master_of.get(id(params[name]))
                if master is None or name in self.masters:
                    continue
                for stale in [n for n in missing if self.masters.get(n) is master]:
                    self._forget(stale)
                self._adopt(name, master, params[name], keeper)
            half_of = {id(master): half for half, master in keeper.pairs}
            for name in [n for n in missing if n in self.masters]:  # (moved to a submodule)
                master = self.masters[name]
                half = half_of.get(id(master))
                found = None if half is None else _find_in_submodules(module, half)
                if found is None:
                    continue
                path, owner, new = found
                target = _install_state_dict_hooks(owner)
                if new in target.masters:
                    continue
                self._forget(name)
                target._adopt(new, master, half, keeper)
                key = prefix + path + new
                if (state_dict is not None and key in state_dict
                        and state_dict[key] is not half):  # (keep_vars: the variable stays)
                    state_dict[key] = master.detach()

    def _adopt(self, name: str, master: torch.Tensor, half: torch.Tensor, keeper) -> None:
        """Hold ``master`` for the parameter ``name``, ``half``, kept by ``keeper``; take in
        the elements where the half parameter differs from it (see :meth:`follow_renames`)."""
        take_changed_elements(half, master)
        self.masters[name] = master
        self._halves[name] = id(half)
        self.take_writes[name] = weakref.WeakMethod(keeper.take_model_writes)
        self.remember(keeper)

    def _forget(self, name: str) -> None:
        """Hold no master for the parameter ``name`` any more."""
        del self.masters[name]
        self.take_writes.pop(name, None)
        self._halves.pop(name, None)

    def remember(self, keeper) -> None:
        """Count ``keeper`` (an optimizer's amp state) among :meth:`keepers`, for good."""
        if all(ref() is not keeper for ref in self._keeper_refs):
            self._keeper_refs.append(weakref.ref(keeper))

    def own_params(self, module: nn.Module) -> list:
        """``module``'s parameters that have masters here."""
        params = module._parameters
        return [params[name] for name in self.masters if params.get(name) is not None]

    def orphaned(self) -> bool:
        """Masters every optimizer keeping them let go of (deleted after training; a model
        restored and prepared again), not a copy's own: nothing keeps them in step with the
        model any more."""
        return not self.standalone and bool(self._keeper_refs) and not self.keepers()

    def standalone_now(self) -> bool:
        """Whether these masters are kept by no optimizer (a copy's, or ``orphaned``, which
        makes them standalone from now on: they keep their fp32 values and, as a copy's do,
        follow the half parameters written since, e.g. a head re-initialized)."""
        if self.orphaned():
            self.standalone = True
        return self.standalone

    def unattended(self) -> List[str]:
        """The names of the masters no live optimizer keeps in step, which :meth:`sync` keeps
        as a copy's: every one once :meth:`standalone_now`; else those whose optimizer is gone
        while another still keeps a master here (one module's weight and bias split across
        two optimizers, the first deleted)."""
        if self.standalone_now():
            return list(self.masters)
        if len(self._keeper_refs) < 2:
            return []
        return [name for name, ref in self.take_writes.items()
                if ref() is None and name in self.masters]

    def forget_all(self) -> None:
        """Hold no masters (a new ``initialize`` of the model registers its own)."""
        self.masters.clear()
        self.take_writes.clear()
        self._halves.clear()
        self._keeper_refs = []
        self._versions = {}

    def keepers(self) -> list:
        """The optimizers' amp states that keep these masters, each once, and those whose
        masters here moved away (a parameter may come back): every one remembered."""
        return [keeper for keeper in (ref() for ref in self._keeper_refs) if keeper is not None]

    def _push_before_copy(self) -> None:
        # (A submodule copied on its own, not through the root's __reduce_ex__: masters
        # written in place since go into the half parameters first, as the root's copy does;
        # else the copy took its stale half weights for a write and rounded the masters to them.)
        if is_compiling():
            return
        for keeper in self.keepers():
            keeper.push_written_masters()
        module = self.module() if self.module is not None else None
        if module is not None and (names := self.unattended()):
            self.sync(module, check_params=False, names=names)

    def __getstate__(self):
        self._push_before_copy()
        return {"masters": dict(self.masters)}

    def __setstate__(self, state):
        self.masters = dict(state["masters"])
        self._pending_load = None
        self.take_writes = {}
        self.module = None
        self._keeper_refs = []
        self._halves = {}
        self.standalone = bool(self.masters)
        self._versions = {}

    def __deepcopy__(self, memo):
        self._push_before_copy()
        module = self.module() if self.module is not None else None
        if module is not None:
            # (The module's parameters may have been copied already, before the push above:
            # bring those copies in step too.)
            with torch.no_grad():
                for name in self.masters:
                    param = module._parameters.get(name)
                    copied = None if param is None else memo.get(id(param))
                    if copied is not None and not torch.equal(copied, param):
                        copied.detach().copy_(param)
        masters = {}
        for name, master in self.masters.items():
            clone = memo.get(id(master))  # (a tied weight's one master stays one in the copy)
            if clone is None:
                # Without its gradient: the copy has no optimizer to step it.
                clone = master.detach().clone().requires_grad_(master.requires_grad)
                memo[id(master)] = clone
            masters[name] = clone
        new = _Fp32StateDict.__new__(_Fp32StateDict)
        new.__setstate__({"masters": masters})
        memo[id(self)] = new
        return new

    def sync(self, module: nn.Module, check_params: bool,
             names: Optional[List[str]] = None) -> bool:
        """Bring a standalone master and its half parameter in step (see the class doc); with
        ``names``, just those masters (:meth:`unattended`).

        A master written since the last sync wins (a load writes both); else, with
        ``check_params``, a half parameter that no longer equals its master cast to half was
        changed (in place, by ``.data`` too, which no version counter sees) and is upcast into
        the master. Whether every master was looked at (False: one waits, another tensor in
        its parameter's place).
        """
        looked = True
        masters = (self.masters.items() if names is None
                   else [(n, self.masters[n]) for n in names if n in self.masters])
        with torch.no_grad():
            for name, master in masters:
                param = module._parameters.get(name)
                if param is not None and param.is_meta:
                    continue  # (a skeleton on the meta device: no values to bring in step)
                if param is not None and param.shape != master.shape:
                    continue  # (resized through .data: the save hook names it, see save)
                if param is None or param.dtype not in _HALF_TYPES:
                    # (No longer half: amp.restore_model, then .float(). The parameter is the
                    # weight now and the master stopped with it (see save): upcast into it,
                    # the fp32 values of a state dict taken before the cast, which holds the
                    # master itself, were rounded to half.)
                    continue
                if self._halves.get(name, id(param)) != id(param):
                    # (Another tensor in its place: torch.func.functional_call's, the
                    # caller's, for this call, which a copy into it overwrote; or the
                    # parameter replaced, whose master save() drops. The write waits.)
                    looked = False
                    continue
                # (The master's version read first, and the master left alone if it moved
                # while compared: another thread updating an EMA copy in place while this
                # one takes its state_dict() had the stale half parameter copied over it.)
                version = master._version
                synced = self._versions.get(name)
                if synced is not None and version != synced:
                    param.detach().copy_(master)  # (an inference tensor outside inference_mode too)
                elif check_params and _DATA_WRITES.differs(param, master):
                    if master._version != version:
                        continue  # (written meanwhile: the next sync copies it over)
                    master.copy_(param)
                    version = master._version
                self._versions[name] = version
        return looked

    def written(self, names: Optional[List[str]] = None) -> bool:
        """Whether a master (of ``names``, if given) was written in place since the last sync
        (one ``sync`` would cast into its half parameter)."""
        versions = self._versions
        masters = self.masters if names is None else {n: self.masters[n] for n in names}
        return any(versions.get(name, master._version) != master._version
                   for name, master in masters.items())

    def carry_to(self, other: _Fp32StateDict, params: Dict[str, torch.Tensor]) -> None:
        """Give ``other`` (the hooks of a module built to replace this one's, holding the
        same parameter objects as ``params``) the masters of the parameters it took over."""
        for name, master in self.masters.items():
            param = params.get(name)
            if param is None or self._halves.get(name, id(param)) != id(param):
                continue
            other.masters[name] = master
            other._halves[name] = id(param)
            if name in self.take_writes:
                other.take_writes[name] = self.take_writes[name]
        other._keeper_refs = list(self._keeper_refs)
        other.standalone = self.standalone

    def save(self, module, state_dict, prefix, local_metadata):
        if self.module is None:  # (a copy's: its load pre-hook is not given the module)
            self.module = weakref.ref(module)
        self.follow_renames(module, state_dict, prefix)
        if names := self.unattended():
            self.sync(module, check_params=True, names=names)
        # A write into the half model since the last step (nn.init, a clamp, under no_grad) is
        # taken into its master now, as the next step would: else the checkpoint held the
        # masters from before it.
        # Writes through .data (seen in the values) are looked for first, against the versions
        # recorded when amp last set the half parameters: a master written alone since then
        # (amp.master_params) is newer than its stale half parameter, and take_model_writes
        # records it as in step. (A copy's sync above took such writes into its masters.)
        data_writes: Dict[int, torch.Tensor] = {}
        for keeper in self.keepers():
            own = self.own_params(module)
            if not self.standalone:
                data_writes.update(_DATA_WRITES.of(keeper, own))
            keeper.take_model_writes(only=own)
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            key = prefix + name
            if tensor is None or key not in state_dict:
                continue
            if state_dict[key] is tensor:
                # state_dict(keep_vars=True), which puts the module's tensor itself there (a
                # detached alias otherwise; the hook is not told keep_vars, so identity is the
                # sign): the caller asked for the module's variables, and gets them, as from
                # torch. torch.jit's tracing (legacy torch.onnx.export) maps them by identity
                # to the tensors the forward uses; a detached fp32 master or an upcast copy
                # in their place failed the trace ("Cannot insert a Tensor that requires grad
                # as a constant"), and the upcast was a non-leaf with a grad_fn that
                # copy.deepcopy of the state dict refused.
                continue
            master = self.masters.get(name)
            entry = state_dict[key]
            if (master is not None and master.shape != tensor.shape
                    and tensor.dtype in _HALF_TYPES):
                raise reshaped_parameter_error(key, master, tensor)
            if (master is not None and not _is_alias(entry, tensor)
                    and not _same_values(entry, tensor)):
                # The module's own _save_to_state_dict wrote something else under the name: a
                # view of the parameter (a transposed layout) is saved as the same view of
                # the master; anything else is kept as written (in fp32). (A copy of the
                # parameter's values is the parameter: its master.)
                written = data_writes.get(id(tensor))
                view = _same_view_of(master if written is None else written, entry, tensor)
                if view is not None and tensor.dtype in _HALF_TYPES:
                    state_dict[key] = view.detach()
                    continue
                master = None
            if master is not None and tensor.dtype not in _HALF_TYPES:
                # The parameter is no longer half (amp.restore_model, then model.float() or
                # .double()): it is the weight now, edited or trained as such, and saved as it
                # is, as torch saves it; the master stopped with it.
                continue
            if master is not None:
                written = data_writes.get(id(tensor))
                state_dict[key] = master.detach() if written is None else written
            elif tensor.dtype in _HALF_TYPES:
                # A half tensor without a master (a buffer) is saved in fp32; a wider one (a
                # float64 buffer registered after initialize) as it is, never rounded.
                state_dict[key] = state_dict[key].float()
        return state_dict

    def load(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if local_metadata.get("assign_to_params_buffers", False):
            if self.masters and self.standalone:
                raise RuntimeError(
                    "load_state_dict(..., assign=True) on a copy of a model prepared by "
                    "amp.initialize (O2: half parameters, with fp32 masters of its own): "
                    "assigning would put the checkpoint's fp32 tensors in place of the half "
                    "parameters, which amp's input casts expect. Load with assign=False (the "
                    "default); for a copy on the meta device, model.to_empty(device=...) "
                    "first.")
            if self.masters:
                raise RuntimeError(
                    "load_state_dict(..., assign=True) on a model prepared by amp.initialize: "
                    "assigning replaces the half parameter objects, which cuts them off from "
                    "the optimizer and its fp32 master weights. Load with assign=False (the "
                    "default); amp then writes the fp32 values into the masters exactly.")
            raise RuntimeError(
                "load_state_dict(..., assign=True) on a model prepared by amp.initialize with "
                "half parameters (O3, or O2 without an optimizer): assigning would put the "
                "checkpoint's tensors (fp32) in place of the half parameters, which amp's "
                "input casts and any optimizer holding them expect. Load with assign=False "
                "(the default): the values are cast into the half parameters.")
        module = self.module() if self.module is not None else None
        self.standalone_now()
        if module is not None:  # (a load pre-hook is not given its module)
            self.follow_renames(module)
        self._pending_load = None
        params = module._parameters if module is not None else {}
        # (Each parameter's tensor and version before the load: one the load did not write, a
        # key a strict=False load lacks, is left to take_model_writes in loaded().)
        self._versions_before_load = {name: (p._cdata, p._version) for name, p in params.items()
                                      if p is not None and not p.is_inference()}
        with torch.no_grad():
            for name, master in self.masters.items():
                param = params.get(name)
                if self.standalone and param is not None and param.dtype not in _HALF_TYPES:
                    continue  # (the master stopped with its parameter: see sync)
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and value.shape == master.shape:
                    master.copy_(value)
                elif value is None:
                    # Perhaps a load pre-hook registered after these renames the key on its
                    # way (old checkpoints' names): looked up again once every pre-hook ran.
                    self._pending_load = (state_dict, prefix)

    def loaded(self, module, incompatible_keys) -> None:
        """After ``load_state_dict``, which wrote the masters and their half parameters alike:
        record them as in step (taking a half parameter written alone). Else a write into the
        half model after the load (the usual fine-tuning order: load pretrained weights, then
        re-initialize the head) found both counters moved, and the load's master won over it
        at the next step."""
        # (Taken, not only recorded: a write to the half parameter alone, before the load to
        # a parameter a strict=False load leaves alone, or by a load pre-hook of the user's
        # that renames a key, must reach its master; a parameter loaded has its master
        # written too, and the load wins.)
        # A master must now hold what the module loaded into its parameter. It does where the
        # load wrote both from the entry under the parameter's name (load()). Else: the value
        # reached the parameter under another key (a load pre-hook registered after amp's
        # renamed it: taken from there, in full precision), or the module's own
        # _load_from_state_dict loaded something other than that entry (a transposed layout:
        # taken from the parameter, at half precision). (One comparison per parameter.)
        pending, self._pending_load = self._pending_load, None
        before = self.__dict__.pop("_versions_before_load", None) or {}
        unwritten = set()
        with torch.no_grad():
            for name, master in self.masters.items():
                param = module._parameters.get(name)
                if (param is not None and name in before and not param.is_inference()
                        and before[name] == (param._cdata, param._version)):
                    unwritten.add(name)
                    continue  # (the same tensor, not written by this load: see load())
                if (param is None or param.dtype not in _HALF_TYPES or param.is_meta
                        or param.shape != master.shape
                        or _equal_nan(param, master.to(param.dtype))):
                    continue  # (meta: a skeleton, nothing was loaded into it)
                value = None if pending is None else pending[0].get(pending[1] + name)
                if (isinstance(value, torch.Tensor) and value.shape == master.shape
                        and _equal_nan(param, value.to(device=param.device,
                                                       dtype=param.dtype))):
                    master.copy_(value)
                else:
                    master.copy_(param)
        for keeper in self.keepers():
            keeper.take_model_writes(only=self.own_params(module))
        synced = self.unattended()
        if synced:  # (a copy's masters, kept by sync(): the load wrote both sides)
            # (Not those it did not write: a master written in place before the load, a
            # copy's state_dict() entry updated as dcp.load does, still waits for sync() to
            # reach its half parameter, which else took it for a .data write and won.)
            self._versions.update({name: self.masters[name]._version for name in synced
                                   if name not in unwritten})


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, a NaN equal to a NaN (a checkpoint of a diverged run holds some: its
    other values must not be taken for a write into the half model and rounded)."""
    return torch.equal(a, b) or torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def holds_no_values(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no values (a fake tensor of torch.compile or torch.export)."""
    if type(t) is nn.Parameter or type(t) is torch.Tensor:  # (the usual case, at once)
        return False
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


# Elements of half temporaries per multi-tensor pass of halves_differ_from_masters (128 MB).
_COMPARE_CHUNK = 1 << 26


def halves_differ_from_masters(pairs) -> List[bool]:
    """For ``(half parameter, fp32 master)`` pairs on one device: whether the parameter holds
    anything but its master rounded to half. Per chunk of pairs, the masters are cast into
    half temporaries, the parameters subtracted, and the L1 norms taken, each one
    multi-tensor launch; one host sync for all. (Two distinct half values differ by at least
    the type's smallest subnormal, so their difference is never 0; a NaN or an infinity makes
    the norm NaN or inf: counted as a difference, which the caller's element-wise pick then
    settles.) On the CPU, where there is no sync to save and half arithmetic is slow, a
    ``torch.equal`` per pair instead."""
    if pairs and pairs[0][0].device.type == "cpu":
        return [not torch.equal(p, m.to(p.dtype)) for p, m in pairs]
    norms: List[torch.Tensor] = []
    start = 0
    while start < len(pairs):
        end, size = start, 0
        while end < len(pairs) and (end == start or size + pairs[end][0].numel() <= _COMPARE_CHUNK):
            size += pairs[end][0].numel()
            end += 1
        halves = [p for p, _ in pairs[start:end]]
        rounded = [torch.empty_like(p) for p in halves]
        torch._foreach_copy_(rounded, [m for _, m in pairs[start:end]])
        torch._foreach_sub_(rounded, halves)
        norms.extend(torch._foreach_norm(rounded, 1))
        del rounded
        start = end
    return [n != 0 for n in torch.stack(norms).tolist()] if norms else []


def take_changed_elements(half: torch.Tensor, master: torch.Tensor) -> None:
    """Copy into ``master`` the elements where ``half`` no longer equals it rounded to half
    (a write through ``.data``, which no version counter sees); the others keep their fp32
    values. No host sync."""
    with torch.no_grad():
        master.copy_(torch.where(half != master.to(half.dtype), half.to(master.dtype), master))


def _find_in_submodules(module: nn.Module, param: torch.Tensor):
    """Where ``param`` is registered below ``module`` (not on it): ``(path, owner, name)``,
    the path of the owning submodule ending in ".", or None."""
    for path, sub in module.named_modules():
        if sub is module:
            continue
        for name, p in sub._parameters.items():
            if p is param:
                return path + ".", sub, name
    return None


def _is_alias(entry, tensor: torch.Tensor) -> bool:
    """Whether a state-dict ``entry`` is ``tensor``'s data as nn.Module saves it (detached).
    A tensor whose memory cannot be read (a fake tensor) counts as one."""
    if not (isinstance(entry, torch.Tensor) and entry.dtype == tensor.dtype
            and entry.shape == tensor.shape and entry.device == tensor.device
            and entry.stride() == tensor.stride()):
        return False
    if holds_no_values(tensor):  # (its data_ptr() warns that it will raise)
        return True
    try:
        return entry.data_ptr() == tensor.data_ptr()
    except (RuntimeError, NotImplementedError):
        return True


def _same_values(entry, tensor: torch.Tensor) -> bool:
    """Whether ``entry`` is a copy of ``tensor``: same dtype, shape, device and values."""
    return (isinstance(entry, torch.Tensor) and entry.dtype == tensor.dtype
            and entry.shape == tensor.shape and entry.device == tensor.device
            and _equal_nan(entry, tensor))


def _span(t: torch.Tensor) -> int:
    """How many elements of its storage ``t`` reaches from its offset on."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)


def _same_view_of(master: torch.Tensor, entry, tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """``master``'s view that ``entry`` is of ``tensor`` (a transpose, a slice), or None where
    ``entry`` is not a view inside ``tensor``'s memory or the two are laid out differently."""
    if (not isinstance(entry, torch.Tensor) or entry.dtype != tensor.dtype
            or entry.device != tensor.device or master.stride() != tensor.stride()
            or master.shape != tensor.shape or tensor.numel() == 0 or entry.numel() == 0
            or any(s < 0 for s in entry.stride())):
        return None
    try:
        if entry.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
            return None
    except (RuntimeError, NotImplementedError):
        return None
    offset = entry.storage_offset() - tensor.storage_offset()
    if offset < 0 or offset + _span(entry) > _span(tensor):
        return None
    return master.as_strided(entry.shape, entry.stride(), master.storage_offset() + offset)


def _register_state_dict_hook_first(module: nn.Module, hook: Callable) -> None:
    """``hook`` first among ``module``'s state-dict hooks: one registered before (renaming keys
    for an old checkpoint layout) sees amp's fp32 entries, not the half tensors under their
    names."""
    handle = module._register_state_dict_hook(hook)
    if isinstance(module._state_dict_hooks, collections.OrderedDict):
        module._state_dict_hooks.move_to_end(handle.id, last=False)


def _install_state_dict_hooks(module: nn.Module) -> _Fp32StateDict:
    existing = getattr(module, "_mixprec_state_dict", None)
    if existing is not None:
        return existing
    hooks = _Fp32StateDict()
    hooks.module = weakref.ref(module)
    # First in the module's __dict__, which a copy (pickle, deepcopy) takes in order: the hooks'
    # push of masters written in place then runs before the parameters are copied. (A plain
    # pickle of the submodule copied the stale half parameters' bytes, the hooks after them.)
    # (A new dict, swapped in whole: a thread reading the module meanwhile finds all of it.)
    module.__dict__ = {"_mixprec_state_dict": hooks, **module.__dict__}
    _register_state_dict_hook_first(module, hooks.save)
    module._register_load_state_dict_pre_hook(hooks.load)
    module.register_load_state_dict_post_hook(hooks.loaded)
    return hooks


def _upcast_unhooked_halves(module: nn.Module, state_dict, prefix: str, local_metadata):
    """State-dict hook of an O2/O3 model's root: the half entries of modules that have no
    hooks of their own come out fp32 too (a half head put into the model after
    ``initialize`` that no optimizer holds): the checkpoint is an fp32 model throughout.
    Modules with hooks handle their own entries (masters, views); entries that are the
    module's own tensors (``keep_vars=True``) stay."""
    for path, sub in module.named_modules(remove_duplicate=False):
        if "_mixprec_state_dict" in sub.__dict__:
            continue
        base = f"{prefix}{path}." if path else prefix
        for name, tensor in itertools.chain(sub._parameters.items(), sub._buffers.items()):
            entry = state_dict.get(base + name) if tensor is not None else None
            if (isinstance(entry, torch.Tensor) and entry is not tensor
                    and entry.dtype in _HALF_TYPES):
                state_dict[base + name] = entry.float()
    return state_dict


def _install_root_upcast(model: nn.Module) -> None:
    if any(hook is _upcast_unhooked_halves for hook in model._state_dict_hooks.values()):
        return
    _register_state_dict_hook_first(model, _upcast_unhooked_halves)


def master_weights(model: nn.Module) -> List[torch.Tensor]:
    """The fp32 master weights standing for ``model``'s parameters (O2 with an optimizer),
    each once (a tied weight has one master), in the order of ``model.modules()``."""
    seen, out = set(), []
    for module in model.modules():
        hooks = getattr(module, "_mixprec_state_dict", None)
        for master in hooks.masters.values() if hooks is not None else ():
            if id(master) not in seen:
                seen.add(id(master))
                out.append(master)
    return out


# Parameters registered on any module since amp registered its first masters (torch's global
# registration hook): a step that sees the count moved looks for renamed parameters
# (follow_renames_in). prune.remove renames back without any state-dict call in between.
_parameter_registrations = 0
_counting_registrations = False


# (registration count, id of the parameter registered) of the latest registrations: ids, not
# references (swap_tensors refuses a tensor with weak references; a reused id costs one
# comparison, see registered_since).
_recent_registrations: collections.deque[tuple] = collections.deque(maxlen=4096)


def _count_registration(module, name, param) -> None:
    global _parameter_registrations
    _parameter_registrations += 1
    if param is not None:
        _recent_registrations.append((_parameter_registrations, id(param)))


def parameter_registrations() -> int:
    """How many parameters modules have registered since amp started counting."""
    return _parameter_registrations


def registered_since(count: int) -> Optional[Set[int]]:
    """The ids of the parameters registered after registration number ``count``; None when
    that is not known any more (too many since, or ``count`` is from before the counting)."""
    if count < 0 or _parameter_registrations - count > len(_recent_registrations):
        return None
    return {pid for n, pid in _snapshot_registrations() if n > count}


def _snapshot_registrations() -> tuple:
    """The recent registrations as one tuple. Another thread building a model appends to the
    deque meanwhile: a walk of the deque failed with "deque mutated during iteration", and so
    did ``tuple(deque)`` at times (the garbage collector, run by the tuple's allocation after
    the walk had begun, calls finalizers in Python, where the other thread may run). A walk
    that meets an append is taken again."""
    while True:
        try:
            return tuple(_recent_registrations)
        except RuntimeError:  # (deque mutated during iteration)
            continue


def follow_renames_in(model: nn.Module) -> None:
    """:meth:`_Fp32StateDict.follow_renames` for every module of ``model``."""
    for module in model.modules():
        hooks = module.__dict__.get("_mixprec_state_dict")
        if hooks is not None:
            hooks.follow_renames(module)


def register_masters(model: nn.Module, masters: Dict[torch.Tensor, torch.Tensor],
                     take_writes: Optional[Callable[[], None]] = None) -> None:
    """Tell ``model``'s state-dict hooks which fp32 master stands for which parameter, and
    which optimizer's ``take_model_writes`` (a bound method, held weakly) keeps them."""
    global _counting_registrations
    if masters and not _counting_registrations:
        nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        _counting_registrations = True
    for module in model.modules():
        hooks = getattr(module, "_mixprec_state_dict", None)
        if hooks is None:
            if not any(p is not None and p in masters for p in module._parameters.values()):
                continue
            # A module put into the model after initialize (a new task head), whose
            # parameters an add_param_group gave masters: its checkpoints hold them too.
            hooks = _install_state_dict_hooks(module)
        for name, param in module._parameters.items():
            if param is not None and param in masters:
                hooks.masters[name] = masters[param]
                hooks._halves[name] = id(param)
                if take_writes is not None:
                    hooks.take_writes[name] = weakref.WeakMethod(take_writes)
                    hooks.remember(take_writes.__self__)


# ---------------------------------------------------------------------------------------------
# conversion
# ---------------------------------------------------------------------------------------------
def cast_module_tensors(module: nn.Module, dtype: torch.dtype) -> bool:
    """Cast a module's own floating parameters and buffers (not its children's) in place.

    Parameter objects are kept (their ``.data`` is swapped) so an optimizer's references stay
    valid. Returns whether anything was cast.
    """
    changed = False
    for tensors in (module._parameters, module._buffers):
        for _name, t in tensors.items():
            if t is not None and t.is_floating_point() and t.dtype != dtype:
                sliced = (tensors is module._parameters and not t.is_meta
                          and t.layout == torch.strided and type(t.data) is torch.Tensor
                          and t.untyped_storage().nbytes() > t.numel() * t.element_size())
                with torch.no_grad():
                    t.data = t.data.to(dtype)
                if t.grad is not None:
                    t.grad = None
                if sliced:  # (a slice of a larger tensor: see separate_shared_version_counters)
                    _own_version_counter(t)
                changed = True
    return changed


def separate_shared_version_counters(models, skip=frozenset()) -> None:
    """Give each half parameter of ``models`` (one ``initialize`` call's, converted) that
    shares its version counter with another of them a counter of its own (the same Python
    objects, the optimizer's).

    Parameters made from slices of one tensor (``nn.Parameter(w[:d])``: the q, k and v of one
    fused initialization) share its counter, and keep sharing it across a cast (``.data``
    assignment keeps the counter; ``model.half()`` before ``initialize`` too): a write into
    one half parameter then moved its siblings' counters, and amp took them whole into their
    masters as written, rounding their fp32 weights to half. (Slices cast here are given
    their own at the cast, :func:`cast_module_tensors`, which also covers sharing with a
    tensor outside these parameters.) Sharing cannot be read off a tensor: each counter is
    moved by one (``torch.autograd.graph.increment_version``, no kernel), and a parameter
    whose counter moved by more shares it. Not moved: parameters in ``skip`` (ids of those
    an earlier call's optimizer keeps masters for, which would take the move as a write) and
    those an autograd graph holds (its backward would find them modified).
    """
    from torch.autograd.graph import increment_version

    params = [p for p in {id(p): p for m in models for p in m.parameters()}.values()
              if p.dtype in _HALF_TYPES and type(p.data) is torch.Tensor and not p.is_meta
              and not p.is_inference() and id(p) not in skip and p._use_count() == 1]
    if len(params) < 2:
        return
    before = [p._version for p in params]
    for p in params:
        increment_version(p)
    shared = [p._version - version != 1 for p, version in zip(params, before)]
    # Every counter put back: a parameter left out above may share one with these (an
    # autograd graph saved it, whose backward would find it modified; an earlier call's
    # optimizer keeps its master, and would take the move for a write).
    _set_versions(params, before)
    for p, is_shared in zip(params, shared):
        if is_shared:
            _own_version_counter(p)


def _set_versions(tensors: list, versions: list) -> None:
    """Set each tensor's version counter (PyTorch's private setter: all at once from 2.5 on,
    one tensor a call before); left moved where this PyTorch has neither."""
    setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if setter is None:
        return
    try:
        setter(tuple(tensors), tuple(versions))
    except TypeError:
        try:
            for tensor, version in zip(tensors, versions):
                setter(tensor, version)
        except (TypeError, RuntimeError):
            pass


def _own_version_counter(param: torch.Tensor) -> None:
    """Give ``param`` a version counter of its own through ``torch.utils.swap_tensors`` with
    a new tensor of the same class, values, attributes (``__dict__`` and ``__slots__``) and
    ``requires_grad``. Left sharing where the swap cannot be made (a weak reference to the
    parameter, hooks on it, an autograd graph holding it): docs/amp.md names the limit."""
    if (weakref.getweakrefcount(param) or getattr(param, "_backward_hooks", None)
            or getattr(param, "_post_accumulate_grad_hooks", None) or param._use_count() > 1):
        return  # (use count: an autograd graph holds it, whose backward the swap would break)
    fresh = torch.Tensor._make_subclass(type(param), param.data, param.requires_grad)
    fresh.__dict__.update(param.__dict__)
    for slot in copyreg._slotnames(type(param)):
        if hasattr(param, slot):
            setattr(fresh, slot, getattr(param, slot))
    if param.grad is not None:
        fresh.grad = param.grad
    try:
        torch.utils.swap_tensors(param, fresh)
    except RuntimeError:
        pass


def _holds_half(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters or buffers include a half-precision tensor."""
    return any(
        t is not None and t.dtype in (torch.float16, torch.bfloat16)
        for tensors in (module._parameters, module._buffers)
        for t in tensors.values()
    )


# ---------------------------------------------------------------------------------------------
# RNN weight packing (O2)
# ---------------------------------------------------------------------------------------------
# torch's own nn.RNNBase.flatten_parameters.
_TORCH_FLATTEN = nn.RNNBase.flatten_parameters


def _packs(rnn: nn.RNNBase) -> bool:
    """Whether torch's ``flatten_parameters()`` may move ``rnn``'s weights (CUDA only)."""
    weights = rnn._flat_weights
    return bool(weights) and all(isinstance(w, torch.Tensor) and w.is_cuda for w in weights)


def _flatten_keeping_masters(rnn: nn.RNNBase) -> None:
    hooks = rnn.__dict__["_mixprec_state_dict"]
    keepers = hooks.keepers()
    if keepers and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        keepers = []  # (take_model_writes does nothing inside a capture; nor may the record)
    # (The RNN's own parameters only: the packing moves their counters alone.)
    own = hooks.own_params(rnn) if keepers else None
    for keeper in keepers:
        keeper.take_model_writes(only=own)
    _TORCH_FLATTEN(rnn)
    for keeper in keepers:
        keeper.record_synced(only=own)


def _flatten_parameters(self) -> None:
    if "_mixprec_state_dict" not in self.__dict__ or not _packs(self):
        return _TORCH_FLATTEN(self)
    if is_compiling():  # (version counters cannot be traced: run eagerly, a graph break)
        return outside_the_compiler(_flatten_keeping_masters)(self)
    return _flatten_keeping_masters(self)


_flatten_parameters.__doc__ = _TORCH_FLATTEN.__doc__


def _watch_rnn_packing() -> None:
    """Route ``nn.RNNBase.flatten_parameters`` through amp (once per process, when amp first
    gives an RNN fp32 masters). On CUDA it packs the weights into one new cuDNN buffer
    (``set_``), which moves their version counters with their values unchanged, and many
    models call it in every forward (DataParallel's replicas want it). For an RNN whose
    parameters have masters, the writes made before it (a DDP broadcast, ``nn.init``) are
    taken into the masters first and the packing is recorded as no write after it: taken for
    a write, it rounded the fp32 masters to half at every step. Other RNNs run torch's method
    as it is (one dict lookup more). The method is wrapped rather than the RNN's class
    swapped, which would break ``type(m) is nn.LSTM`` checks, parametrizations and a
    subclass's own pickling."""
    if nn.RNNBase.flatten_parameters is not _flatten_parameters:
        nn.RNNBase.flatten_parameters = _flatten_parameters


def _held_device_type(model: nn.Module) -> Optional[str]:
    """The device type of the first tensor ``model`` holds, or None when it holds none."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device.type
    return None


def _device_type(model: nn.Module) -> str:
    return _held_device_type(model) or "cpu"


def convert_model(model: nn.Module, props, *, encloses: bool = False,
                  enclosed: bool = False) -> None:
    """Apply an opt level's properties to ``model`` in place (casts, class swap, hooks).

    Args:
        model: the user's model (already on its device).
        props (Properties): the resolved opt level.
        encloses, enclosed: another model of the same call is inside ``model``, or ``model``
            is inside another (see :class:`AmpForwardConfig`; O2/O3 only).
    """
    device_type = _device_type(model)
    keep_bn = props.keep_batchnorm_fp32 is True

    renorm_model = False
    if props.model_is_half:
        for module in model.modules():
            if (props.master_weights and isinstance(module, (nn.Embedding, nn.EmbeddingBag))
                    and module.max_norm is not None):
                if module is model:
                    renorm_model = True
                else:
                    _swap_class(module, AmpForwardConfig(device_type=device_type,
                                                         renorm_master=True))
            if keep_bn and isinstance(module, _BatchNorm):
                # Stays fp32 (initialize cast it back if the model came .half()-ed): PyTorch's
                # batch_norm takes half input with fp32 parameters (statistics in fp32, output
                # in the input's dtype), train and eval alike.
                continue
            cast = cast_module_tensors(module, props.cast_model_type)
            if isinstance(module, nn.RNNBase):
                if props.master_weights:
                    _watch_rnn_packing()
                if cast:
                    # Its weights back into one cuDNN buffer, as model.half() leaves them
                    # (the cast gave each its own): else cuDNN copies them at every call.
                    module.flatten_parameters()
            if _holds_half(module):
                # Every module holding half tensors, cast here or already half (a model
                # .half()-ed before initialize, the second owner of a tied weight): each of
                # its state-dict entries must come out fp32, the master where there is one.
                hooks = _install_state_dict_hooks(module)
                if hooks.orphaned() or hooks.standalone:
                    # Masters of an earlier initialize whose optimizer is gone (the model
                    # restored and prepared again): this call registers its own, or none (O3).
                    hooks.forget_all()
                    hooks.standalone = False
        _mark_parts(model)
        _install_root_upcast(model)
        output_dtype = props.cast_model_outputs or torch.float32
        config = AmpForwardConfig(input_dtype=props.cast_model_type, output_dtype=output_dtype,
                                  device_type=device_type, renorm_master=renorm_model,
                                  encloses=encloses, enclosed=enclosed)
    elif props.cast_model_type == torch.float32:
        # O0, as in Apex: an fp32 model whose floating inputs and outputs are cast to fp32
        # (e.g. float64 batches from NumPy); per-op casting only if asked for.
        for module in model.modules():
            cast_module_tensors(module, torch.float32)
        autocast_dtype = props.half_dtype if props.patch_torch_functions else None
        config = AmpForwardConfig(input_dtype=torch.float32, autocast_dtype=autocast_dtype,
                                  output_dtype=props.cast_model_outputs or torch.float32,
                                  device_type=device_type)
    else:  # O1: parameters as they are, per-op casting
        autocast_dtype = props.half_dtype if props.patch_torch_functions else None
        # Outputs come out fp32: the loss that follows the model runs outside its autocast
        # region, so half logits would give a half-precision loss (and an fp16 loss's gradient
        # at the 2**16 starting scale overflows); Apex's patched torch functions computed it
        # in fp32, and torch.autocast's loss inside the region does too.
        config = AmpForwardConfig(autocast_dtype=autocast_dtype, device_type=device_type,
                                  output_dtype=props.cast_model_outputs,
                                  half_outputs_to_fp32=autocast_dtype is not None)
        if keep_bn and autocast_dtype is not None:
            bn_config = AmpForwardConfig(device_type=device_type, fp32_compute=True)
            for module in model.modules():
                if isinstance(module, _BatchNorm) and module is not model:
                    _swap_class(module, bn_config)
    _swap_class(model, config)
