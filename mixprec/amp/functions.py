"""O1 casting rules for user functions, and a way to turn casting off for a block.

O1 runs the model under ``torch.autocast``, which knows PyTorch's own ops. A user function
(a custom CUDA extension, a hand-written op) can be given a rule as in Apex:

* half: floating tensor arguments are cast to the half dtype, the function runs uncast;
* float: they are cast to fp32;
* promote: they are cast to the widest floating dtype among them.

Arguments are tensors, or lists, tuples and mappings of them (see ``_cast_args``); other
objects, dataclass instances and a method's ``self`` among them, are passed as they are.

A rule acts only while autocast is on for the arguments' device (inside an O1 model's
forward, or the user's own ``torch.autocast`` block); elsewhere the function runs untouched,
so the same code serves every opt level. ``register_*_function(module, name)`` replaces
``module.name`` with the wrapped function (the user asked for it by name; the original is kept
as ``wrapped.__wrapped__``); the decorators wrap a function where it is defined.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Mapping
from typing import Callable, Iterator, Optional

import torch

from mixprec.amp import _model
from mixprec.amp._model import cast_floating

__all__ = [
    "disable_casts",
    "float_function",
    "half_function",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
]


def _first_device_type(args, kwargs) -> Optional[str]:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
        # (Mappings too, as cast_floating and _floating_dtypes walk them: a function given
        # only a dict of tensors ran uncast under autocast.)
        if isinstance(value, Mapping):
            value = list(value.values())
        if isinstance(value, (list, tuple)):
            found = _first_device_type(value, {})
            if found is not None:
                return found
    return None


def _floating_dtypes(value, out):
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            out.append(value.dtype)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _floating_dtypes(v, out)
    elif isinstance(value, Mapping):
        for v in value.values():
            _floating_dtypes(v, out)
    return out


def _cast_args(value, dtype: torch.dtype):
    """The arguments of a function with a rule, their floating tensors cast to ``dtype``.

    Tensors, and those inside lists, tuples, namedtuples and mappings (as Apex cast them,
    mappings too), the ones :func:`_first_device_type` and :func:`_floating_dtypes` look at.
    A container is copied only when something in it is cast: one the function fills in (an
    output list, a dict of results) is the caller's own object, as outside O1. Dataclass
    instances and other objects are passed as they are: a method's ``self`` (a dataclass KV
    cache) was copied, and the method's writes to it lost.
    """
    if isinstance(value, torch.Tensor):
        return cast_floating(value, dtype)
    if isinstance(value, Mapping):
        items = {k: _cast_args(v, dtype) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value
        return items if type(value) is dict else _model._rebuild_mapping(value, items)
    if isinstance(value, (list, tuple)):
        cast = [_cast_args(v, dtype) for v in value]
        if all(c is v for c, v in zip(cast, value)):
            return value
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    return value


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    # A device type autocast does not know (meta tensors: shape inference, a model built on
    # the meta device) has no autocast to be on: torch.is_autocast_enabled("meta") raises, so
    # a registered torch function failed on meta tensors everywhere, casting or not.
    available = getattr(torch.amp, "is_autocast_available", None)
    if available is not None and not available(device_type):
        return None
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _wrap(fn: Callable, rule: str) -> Callable:
    if not callable(fn):
        raise TypeError(
            f"amp.{rule}_function({fn!r}): expected a function to decorate, got "
            f"{type(fn).__name__}. Use it as @amp.{rule}_function above a def, or "
            f"amp.register_{rule}_function(module, 'name') for a function of a module.")
    existing = getattr(fn, "_mixprec_cast_rule", None)
    if existing == rule:
        # The same registration again (a model builder run once per trial, a re-run notebook
        # cell): Apex kept registrations in a set, so a repeat changed nothing. Nor here.
        return fn
    if existing is not None:
        raise ValueError(
            f"{getattr(fn, '__qualname__', fn)!r} already has the amp casting rule "
            f"{existing!r}; it cannot also take {rule!r}. A function has one rule: register "
            "it once, with the rule it needs."
        )

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device_type = _first_device_type(args, kwargs)
        half = _autocast_dtype(device_type) if device_type is not None else None
        if half is None:
            return fn(*args, **kwargs)
        if rule == "half":
            target = half
        elif rule == "float":
            target = torch.float32
        else:  # promote: the widest floating dtype among the arguments
            dtypes = _floating_dtypes((args, kwargs), [])
            if not dtypes:
                return fn(*args, **kwargs)
            target = functools.reduce(torch.promote_types, dtypes)
        with torch.autocast(device_type, enabled=False):
            return fn(*_cast_args(args, target), **_cast_args(kwargs, target))

    wrapper._mixprec_cast_rule = rule
    return wrapper


def half_function(fn: Callable) -> Callable:
    """Decorator: under O1 casting, run ``fn`` on half-precision arguments.

    Example::

        >>> @amp.half_function
        ... def fused_gelu(x):
        ...     return my_extension.gelu(x)
    """
    return _wrap(fn, "half")


def float_function(fn: Callable) -> Callable:
    """Decorator: under O1 casting, run ``fn`` on fp32 arguments."""
    return _wrap(fn, "float")


def promote_function(fn: Callable) -> Callable:
    """Decorator: under O1 casting, run ``fn`` on arguments cast to their widest dtype."""
    return _wrap(fn, "promote")


def _register(module, name: str, rule: str) -> None:
    if module is None or isinstance(module, str):
        raise TypeError(
            f"amp.register_{rule}_function({module!r}, {name!r}): the first argument is the "
            f"module object holding the function, not {type(module).__name__}, e.g. "
            f"amp.register_{rule}_function(torch, 'bmm') after `import torch`.")
    if not isinstance(name, str) or not hasattr(module, name):
        raise AttributeError(
            f"amp.register_{rule}_function({getattr(module, '__name__', module)!r}, {name!r}): "
            f"the module has no attribute {name!r}. Pass the module object and the function's "
            "name as a string, e.g. amp.register_half_function(torch, 'bmm')."
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(
            f"amp.register_{rule}_function(..., {name!r}): {name!r} is a "
            f"{type(fn).__name__}, not a function."
        )
    # A static or class method of a class (an extension's ops gathered as
    # ``class Ops: @staticmethod def gelu(x)``): wrap the function inside and keep the
    # descriptor. The bare wrapper set on the class became an instance method, so
    # ``Ops().gelu(x)`` passed the instance along (and ``Ops.g(x)`` of a classmethod the class
    # twice): TypeError. (Apex had the same bug.)
    raw = inspect.getattr_static(module, name, None) if isinstance(module, type) else None
    if isinstance(raw, (staticmethod, classmethod)):
        wrapped = _wrap(raw.__func__, rule)
        if wrapped is not raw.__func__:
            setattr(module, name, type(raw)(wrapped))
        return
    wrapped = _wrap(fn, rule)
    if wrapped is not fn:
        setattr(module, name, wrapped)


def register_half_function(module, name: str) -> None:
    """Make ``module.name`` run on half-precision arguments under O1 casting (Apex's API).

    Args:
        module: the module (or class, or object) holding the function.
        name (str): the function's attribute name.

    Example::

        >>> amp.register_half_function(my_extension, "fused_attention")
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    """
    _register(module, name, "half")


def register_float_function(module, name: str) -> None:
    """Make ``module.name`` run on fp32 arguments under O1 casting (Apex's API)."""
    _register(module, name, "float")


def register_promote_function(module, name: str) -> None:
    """Make ``module.name`` run on its arguments' widest dtype under O1 casting (Apex's API)."""
    _register(module, name, "promote")


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Context manager: no per-op casting inside the block, at every opt level.

    Ops run in the dtype of their inputs (fp32 master-level numerics where the inputs are
    fp32), in an O1 model called inside the block too (as under Apex). Outside O1 there is no
    casting to disable and the block runs as it is.

    Example::

        >>> with amp.disable_casts():
        ...     logits = head(features.float())  # stays fp32 under O1
    """
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        # An O1 model called inside the block (its forward enters torch.autocast itself) runs
        # uncast too, as under Apex, whose disable_casts turned its casting off for all code
        # in the block; without this the model's forward re-enabled casting.
        _model._CASTS_DISABLED[0] += 1
        stack.callback(_casts_enabled_again)
        yield


def _casts_enabled_again() -> None:
    _model._CASTS_DISABLED[0] -= 1
