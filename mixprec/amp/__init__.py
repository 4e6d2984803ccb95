"""mixprec.amp: Apex's ``amp`` API (O0-O3, fp16 and bf16) on ``torch.autocast``.

Example::

    >>> from mixprec import amp
    >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
    ...     scaled_loss.backward()
    >>> optimizer.step()
"""

from mixprec.amp._model import is_amp_model, restore_model
from mixprec.amp._properties import OPT_LEVELS, Properties
from mixprec.amp.frontend import (
    initialize,
    load_state_dict,
    master_params,
    scale_loss,
    state_dict,
    step_was_skipped,
)
from mixprec.amp.functions import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from mixprec.amp.scaler import LossScaler

# Apex's private process-wide state, as a view, for scripts that reach into it (this binds
# the name to the object, not to the submodule of the same name, as Apex's package did).
from mixprec.amp._amp_state import _amp_state  # noqa: E402, F401  isort: skip

__all__ = [
    "OPT_LEVELS",
    "LossScaler",
    "Properties",
    "disable_casts",
    "float_function",
    "half_function",
    "initialize",
    "is_amp_model",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "restore_model",
    "scale_loss",
    "state_dict",
    "step_was_skipped",
]


def __getattr__(name):
    if name in ("init", "AmpHandle", "NoOpHandle"):
        raise AttributeError(
            f"mixprec.amp.{name}: Apex's first amp API (2018: amp_handle = amp.init(), then "
            "amp_handle.scale_loss and amp_handle.wrap_optimizer) is not provided; Apex itself "
            "replaced it with amp.initialize. Use `model, optimizer = amp.initialize(model, "
            "optimizer, opt_level=\"O1\")` and `with amp.scale_loss(loss, optimizer) as "
            "scaled_loss: scaled_loss.backward()`."
        )
    raise AttributeError(f"module 'mixprec.amp' has no attribute {name!r}")
