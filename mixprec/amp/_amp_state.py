"""The private Apex names that Apex scripts reach into, served over mixprec's own state.

Apex kept one process-wide object, ``apex.amp._amp_state``, and many training scripts of its
era read or set its fields directly (NVIDIA's BERT, ViT and their forks)::

    amp._amp_state.loss_scalers[0]._loss_scale = 2**20        # a larger initial scale
    if amp._amp_state.loss_scalers[0]._unskipped != 0:        # the step was taken
        scheduler.step()

and restored a checkpoint through two names Apex put on every optimizer::

    optimizer._lazy_init_maybe_master_weights()
    optimizer._amp_stash.lazy_init_called = True

mixprec has no process-wide state (``initialize`` may be called again for other models), so
these are views: ``_amp_state`` reads the loss scalers and properties of the most recent
``initialize`` given optimizers (the state module-level ``amp.state_dict()`` saves), and each
optimizer's ``_amp_stash`` reads that optimizer's amp bookkeeping. Only the names scripts use
are served; any other gives an ``AttributeError`` that names the public API to use instead.
"""

from __future__ import annotations

import operator
import weakref
from typing import List

import torch

__all__ = ["_amp_state", "attach_apex_optimizer_names", "master_params"]


def _latest():
    from mixprec.amp import frontend

    state = frontend.latest_state()
    if state is None:
        raise _before_initialize()
    return state


def _before_initialize() -> AttributeError:
    # An AttributeError, as in Apex, where these names did not exist before initialize:
    # `hasattr(amp._amp_state, "opt_properties")` is how scripts ask whether it has run.
    return AttributeError(
        "amp._amp_state was read before amp.initialize(): Apex's private state (loss "
        "scalers, opt properties) exists only once initialize has run. Call "
        "`model, optimizer = amp.initialize(model, optimizer, opt_level=...)` first."
    )


def _positive(what: str, value) -> float:
    try:
        number = float(value)
    except OverflowError:  # (an integer too large for a float)
        number = float("inf")
    except (TypeError, ValueError):
        number = float("nan")
    if not number > 0 or number == float("inf"):
        raise ValueError(
            f"amp._amp_state.loss_scalers[i].{what} = {value!r}: expected a finite number > 0 "
            "(a power of two such as 2**16 is usual)."
        )
    return number


def _count(what: str, value, minimum: int, meaning: str) -> int:
    # Any integer type (a numpy or 0-dim torch integer from a script's arithmetic) as a
    # Python int; a bool or a float is refused, as Apex's counters are whole numbers.
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise ValueError(
            f"amp._amp_state.loss_scalers[i].{what} = {value!r}: expected an int >= {minimum} "
            f"({meaning})."
        )
    return number


class _ApexLossScaler:
    """One of ``amp._amp_state.loss_scalers``: Apex's ``LossScaler`` names over a
    :class:`mixprec.amp.LossScaler`. Reading a dynamic scale kept on the GPU costs one sync."""

    __slots__ = ("_scaler",)
    _SETTABLE = frozenset(
        {"_loss_scale", "_unskipped", "_scale_seq_len", "_min_loss_scale", "_max_loss_scale"})

    def __init__(self, scaler):
        object.__setattr__(self, "_scaler", scaler)

    def loss_scale(self) -> float:
        """The current scale (a method, as in Apex)."""
        return self._scaler.loss_scale

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _has_overflow(self) -> bool:
        """Whether this loss's most recent backward overflowed (that step is skipped)."""
        return self._scaler.found_overflow

    @property
    def _loss_scale(self) -> float:
        return self._scaler.loss_scale

    @_loss_scale.setter
    def _loss_scale(self, value) -> None:
        self._scaler.set_state(loss_scale=_positive("_loss_scale", value))

    @property
    def _unskipped(self) -> int:
        self._scaler._pull()
        return self._scaler._unskipped

    @_unskipped.setter
    def _unskipped(self, value) -> None:
        self._scaler.set_state(unskipped=_count(
            "_unskipped", value, 0, "the clean steps since the scale last changed"))

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler._window

    @_scale_seq_len.setter
    def _scale_seq_len(self, value) -> None:
        self._scaler.set_window(_count(
            "_scale_seq_len", value, 1,
            "clean steps before a dynamic scale doubles; Apex's default is 2000"))

    @property
    def _min_loss_scale(self) -> float:
        return self._scaler._min

    @_min_loss_scale.setter
    def _min_loss_scale(self, value) -> None:
        value = _positive("_min_loss_scale", value)
        if value > self._scaler._max:
            raise ValueError(
                f"amp._amp_state.loss_scalers[i]._min_loss_scale = {value}: above the maximum "
                f"{self._scaler._max}. Set _max_loss_scale first."
            )
        self._scaler._min = value

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler._max

    @_max_loss_scale.setter
    def _max_loss_scale(self, value) -> None:
        value = _positive("_max_loss_scale", value)
        if value < self._scaler._min:
            raise ValueError(
                f"amp._amp_state.loss_scalers[i]._max_loss_scale = {value}: below the minimum "
                f"{self._scaler._min}. Set _min_loss_scale first."
            )
        self._scaler._max = value

    def __getattr__(self, name):
        raise AttributeError(
            f"amp._amp_state.loss_scalers[i].{name}: mixprec serves Apex's loss_scale(), "
            "dynamic, _has_overflow, _loss_scale, _unskipped, _scale_seq_len, "
            "_min_loss_scale and _max_loss_scale here. For the rest use the public API: "
            "amp.state_dict(), amp.step_was_skipped(optimizer)."
        )

    def __setattr__(self, name, value) -> None:
        if name not in self._SETTABLE:
            raise AttributeError(
                f"amp._amp_state.loss_scalers[i].{name} cannot be set; the settable names are "
                f"{', '.join(sorted(self._SETTABLE))}."
            )
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"<Apex view of {self._scaler!r}>"


class _ApexProperties:
    """``amp._amp_state.opt_properties``: the resolved opt level, read-only, with Apex's
    ``options`` dict and attribute access to the same names."""

    __slots__ = ("options",)

    def __init__(self, amp_state):
        props = amp_state.properties
        if props is None:  # (initialize(enabled=False))
            options = {"enabled": False, "opt_level": None, "cast_model_type": None,
                       "patch_torch_functions": False, "keep_batchnorm_fp32": None,
                       "master_weights": False, "loss_scale": 1.0}
        else:
            options = {"enabled": True, "opt_level": props.opt_level,
                       "cast_model_type": props.cast_model_type,
                       "patch_torch_functions": props.patch_torch_functions,
                       "keep_batchnorm_fp32": props.keep_batchnorm_fp32,
                       "master_weights": props.master_weights,
                       "loss_scale": props.loss_scale}
        object.__setattr__(self, "options", options)

    def __getattr__(self, name):
        options = object.__getattribute__(self, "options")
        if name in options:
            return options[name]
        raise AttributeError(
            f"amp._amp_state.opt_properties.{name}: not an amp property; the properties are "
            f"{', '.join(options)}."
        )

    def __setattr__(self, name, value) -> None:
        raise AttributeError(
            f"amp._amp_state.opt_properties.{name} cannot be set after amp.initialize: pass "
            f"{name}=... to amp.initialize instead."
        )

    def __repr__(self) -> str:
        return f"<amp opt_properties {self.options!r}>"


class _ApexAmpState:
    """``amp._amp_state``: Apex's process-wide object, as views over the most recent
    ``initialize`` given optimizers."""

    __slots__ = ()

    @property
    def loss_scalers(self) -> List[_ApexLossScaler]:
        return [_ApexLossScaler(s) for s in _latest().scalers]

    @property
    def opt_properties(self) -> _ApexProperties:
        return _ApexProperties(_latest())

    @property
    def verbosity(self) -> int:
        return _latest().verbosity

    def __getattr__(self, name):
        # (Python calls this also when a property above raised AttributeError.)
        if name in ("loss_scalers", "opt_properties", "verbosity"):
            raise _before_initialize()
        raise AttributeError(
            f"amp._amp_state.{name}: mixprec serves Apex's loss_scalers, opt_properties and "
            "verbosity here (views of the most recent amp.initialize). For the rest use the "
            "public API: amp.state_dict(), amp.master_params(optimizer), "
            "amp.step_was_skipped(optimizer)."
        )

    def __setattr__(self, name, value) -> None:
        raise AttributeError(
            f"amp._amp_state.{name} cannot be set: mixprec keeps no process-wide amp state. "
            "Set a loss scaler's fields instead (amp._amp_state.loss_scalers[0]._loss_scale = "
            "...), or pass options to amp.initialize."
        )

    def __repr__(self) -> str:
        return "<Apex-compatible view of mixprec's most recent amp.initialize>"


_amp_state = _ApexAmpState()


def master_params(optimizer):
    """Apex's ``apex.amp._amp_state.master_params``: see :func:`mixprec.amp.master_params`."""
    from mixprec.amp.frontend import master_params as public

    return public(optimizer)


class _AmpStash:
    """``optimizer._amp_stash``: the Apex names scripts read off an optimizer that went through
    ``initialize``, over mixprec's bookkeeping of that optimizer.

    ``lazy_init_called`` is True from the start: mixprec makes the fp32 masters in
    ``initialize``, not at the first step, so a checkpoint can be loaded at once.
    """

    def __init__(self, optimizer):
        self._optimizer = weakref.ref(optimizer)
        self.lazy_init_called = True

    def _state(self):
        from mixprec.amp._state import optimizer_state

        optimizer = None if self._optimizer is None else self._optimizer()
        state = None if optimizer is None else optimizer_state(optimizer)
        if state is None:
            raise RuntimeError("optimizer._amp_stash: this optimizer's amp state is gone.")
        return state

    @property
    def already_patched(self) -> bool:
        """Whether the next ``step()`` will be skipped for an overflow (Apex patched ``step``
        to skip it). With the loss scale on the GPU, reading this costs one sync."""
        state = self._state()
        if state.overflow:
            return True
        return state.pending_found is not None and bool(state.pending_found.item())

    @property
    def params_have_scaled_gradients(self) -> bool:
        return self._state().grads_scaled

    @property
    def all_fp16_params(self) -> List[torch.Tensor]:
        """The model's half parameters that have fp32 masters (O2)."""
        return [p for p, _ in self._state().pairs]

    @property
    def all_fp32_from_fp16_params(self) -> List[torch.Tensor]:
        """Their fp32 masters, which the optimizer steps."""
        return [m for _, m in self._state().pairs]

    @property
    def all_fp32_from_fp32_params(self) -> List[torch.Tensor]:
        """The parameters the optimizer steps as they are (no master)."""
        return list(self._state().plain)

    def __getattr__(self, name):
        raise AttributeError(
            f"optimizer._amp_stash.{name}: mixprec serves Apex's lazy_init_called, "
            "already_patched, params_have_scaled_gradients, all_fp16_params, "
            "all_fp32_from_fp16_params and all_fp32_from_fp32_params here. For the rest use "
            "the public API: amp.master_params(optimizer), amp.step_was_skipped(optimizer)."
        )

    def __getstate__(self):
        return {"lazy_init_called": self.lazy_init_called}

    def __setstate__(self, state):
        # A copied optimizer has no amp state of its own: its stash answers nothing but this.
        self._optimizer = None
        self.lazy_init_called = state.get("lazy_init_called", True)


def _no_lazy_init(*args, **kwargs) -> None:
    """Apex made the fp32 masters lazily, at the first step, and scripts restoring a checkpoint
    first forced that with ``optimizer._lazy_init_maybe_master_weights()``. mixprec makes them
    in ``initialize``: there is nothing left to do."""
    return None


def attach_apex_optimizer_names(optimizer) -> None:
    """Give ``optimizer`` the names Apex put on every optimizer that scripts use:
    ``_amp_stash``, ``_lazy_init_maybe_master_weights()`` and ``_amp_lazy_init()``."""
    try:
        optimizer._amp_stash = _AmpStash(optimizer)
        optimizer._lazy_init_maybe_master_weights = _no_lazy_init
        optimizer._amp_lazy_init = _no_lazy_init
    except AttributeError:  # (an optimizer class with __slots__: nothing to attach to)
        pass
