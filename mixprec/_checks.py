"""Argument checks shared by the package's public entry points, and a helper for messages."""

from __future__ import annotations

__all__ = ["check_flag", "first_forward_pending", "listed"]


def check_flag(where: str, name: str, value, *, strings: bool = False) -> bool:
    """``value`` as a bool; a string is refused with a ``TypeError`` naming it.

    Python's truthiness takes any non-empty string for True, ``"False"`` too, so a flag read
    from a config file or the command line would silently mean its opposite. With
    ``strings``, the strings ``"True"``/``"False"`` that argparse hands over are read as such
    (Apex accepted them for its properties). Anything else goes through ``bool()`` as before
    (``None``, NumPy's bools and ints, a one-element tensor).

    Args:
        where (str): the call, for the message (``"amp.initialize"``).
        name (str): the argument's name.
        value: what was passed.
        strings (bool): read ``"True"``/``"False"``. Default False.
    """
    if isinstance(value, (str, bytes)):
        if strings and value in ("True", "False"):
            return value == "True"
        allowed = 'True or False (or the strings "True"/"False")' if strings else "True or False"
        raise TypeError(
            f"{where}({name}={value!r}): expected {allowed}, got {type(value).__name__}. A "
            "string is not a flag (any non-empty one is true, \"False\" too): parse it first, "
            "e.g. value.lower() in ('1', 'true', 'yes').")
    return bool(value)


def first_forward_pending(module) -> bool:
    """Whether ``module`` is a lazy layer (``nn.LazyLinear``, ``nn.LazyBatchNorm2d``, ...)
    that has not run its first forward yet: its parameters without a shape, or given one by
    ``load_state_dict`` while its first-forward hook still waits. That hook turns the layer
    into its plain class (``Linear``, ``BatchNorm2d``), undoing a class set on it before."""
    from torch.nn.modules.lazy import LazyModuleMixin

    return isinstance(module, LazyModuleMixin) and (
        module.has_uninitialized_params() or hasattr(module, "_initialize_hook"))


def listed(names, most: int = 8) -> str:
    """``names`` for a message: the first ``most``, then how many more."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more
