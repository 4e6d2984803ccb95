"""mixprec.amp: Apex's ``amp`` API (O0-O3, fp16 and bf16) on ``torch.autocast``.

Example::

    >>> from mixprec import amp
    >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
    ...     scaled_loss.backward()
    >>> optimizer.step()
"""

from mixprec.amp._fp16_optimizer import load_fp16_optimizer_state_dict
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
    "load_fp16_optimizer_state_dict",
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
    # Apex's first API (2018): amp.init(enabled=False) and its NoOpHandle only (see there).
    if name in ("init", "NoOpHandle"):
        from mixprec._apex_legacy import amp_handle

        return getattr(amp_handle, name)
    if name == "AmpHandle":
        from mixprec._apex_legacy.amp_handle import refusal

        raise refusal(name)
    if name == "_initialize":
        # (catalyst and other multi-GPU scripts re-applied amp's input casts by hand to a
        # DataParallel replica through apex.amp._initialize.applier: Apex issue 503.)
        raise AttributeError(
            "mixprec.amp._initialize: Apex's internal module is not provided. Its use in "
            "DataParallel workarounds (re-applying amp's input casts to a model's replicas "
            "with _initialize.applier) is not needed: a model returned by amp.initialize runs "
            "under torch.nn.DataParallel as it is (amp's casts live in the model's class and "
            "travel with the replicas). Wrap the model itself, DataParallel(model), and drop "
            "the patched forward.")
    raise AttributeError(f"module 'mixprec.amp' has no attribute {name!r}")
