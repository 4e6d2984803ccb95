"""Argument checks shared by the package's public entry points."""

from __future__ import annotations

__all__ = ["check_flag"]


def check_flag(where: str, name: str, value, *, strings: bool = False) -> bool:
    """``value`` as a bool, or a ``TypeError`` naming it.

    Accepted: ``True``/``False`` (NumPy's too, and the ints 0/1); with ``strings``, also the strings
    ``"True"``/``"False"`` that argparse hands over (Apex accepted them for its properties).
    Any other value raises: Python's truthiness would take the string ``"False"`` for True,
    and a flag read from a config file would silently mean its opposite.

    Args:
        where (str): the call, for the message (``"amp.initialize"``).
        name (str): the argument's name.
        value: what was passed.
        strings (bool): accept ``"True"``/``"False"`` too. Default False.
    """
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)  # (a flag read from an array or a NumPy-backed config)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if strings and isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    allowed = 'True or False (or the strings "True"/"False")' if strings else "True or False"
    hint = ""
    if isinstance(value, str):
        hint = (" A string is not a flag (any non-empty one is true, \"False\" too): parse it "
                "first, e.g. value.lower() in ('1', 'true', 'yes').")
    raise TypeError(f"{where}({name}={value!r}): expected {allowed}, got "
                    f"{type(value).__name__}.{hint}")
