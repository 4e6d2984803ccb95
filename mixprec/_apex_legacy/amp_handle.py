"""Apex's first amp API (2018), ``amp_handle = amp.init(...)``, for its one form that still
means something: ``amp.init(enabled=False)``, which Apex answered with a handle that does
nothing. Detection codebases (maskrcnn-benchmark and its forks) call it in every run with
``enabled`` taken from their config, fp32 by default. ``amp.init()`` with amp on patched the
torch namespace process-wide (Apex's old O1); mixprec refuses it, naming ``amp.initialize``.
"""

from __future__ import annotations

import contextlib

__all__ = ["NoOpHandle", "init", "refusal"]


def refusal(name: str) -> AttributeError:
    """The error for ``mixprec.amp.<name>`` of Apex's first API (``init()``, ``AmpHandle``)."""
    return AttributeError(
        f"mixprec.amp.{name}: Apex's first amp API (2018: amp_handle = amp.init(), then "
        "amp_handle.scale_loss and amp_handle.wrap_optimizer) is not provided, except "
        "amp.init(enabled=False), which returns a handle that does nothing, as Apex's did; "
        "Apex itself replaced it with amp.initialize. Use `model, optimizer = "
        "amp.initialize(model, optimizer, opt_level=\"O1\")` and `with amp.scale_loss(loss, "
        "optimizer) as scaled_loss: scaled_loss.backward()`; where the handle is not used "
        "(amp.init(allow_banned=True) right before amp.initialize), delete the call.")


class _NoOpOptimizer:
    """What ``NoOpHandle.wrap_optimizer`` returns: the optimizer, with Apex's wrapper's
    ``scale_loss`` (yields the loss as it is); everything else is the optimizer's."""

    def __init__(self, optimizer, num_loss: int = 1):
        self.__dict__["_optimizer"] = optimizer
        self.__dict__["_num_loss"] = num_loss

    @contextlib.contextmanager
    def scale_loss(self, loss):
        yield loss

    def step(self, closure=None):
        return self._optimizer.step(closure) if closure is not None else self._optimizer.step()

    def __getattr__(self, name):
        optimizer = self.__dict__.get("_optimizer")
        if optimizer is None:  # (copy and pickle ask before the instance is filled)
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __setattr__(self, name, value):
        setattr(self._optimizer, name, value)

    def __repr__(self):
        return f"NoOpHandle-wrapped {self._optimizer!r}"


class NoOpHandle:
    """Apex's handle for ``amp.init(enabled=False)``: every call leaves things as they are."""

    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self):
        yield

    def wrap_optimizer(self, optimizer, num_loss: int = 1) -> _NoOpOptimizer:
        return _NoOpOptimizer(optimizer, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer):
        yield loss

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False

    def _clear_cache(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass

    def __repr__(self):
        return "NoOpHandle()"


def init(enabled=True, loss_scale="dynamic", enable_caching=True, verbose=False,
         allow_banned=False) -> NoOpHandle:
    """Apex's ``amp.init``: with ``enabled=False`` a :class:`NoOpHandle`; otherwise refused
    (see the module doc)."""
    from mixprec._checks import check_flag

    if not check_flag("amp.init", "enabled", enabled):
        return NoOpHandle()
    raise refusal("init()")
