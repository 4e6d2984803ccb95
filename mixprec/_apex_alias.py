"""``install_apex_alias()``: let unmodified Apex scripts import mixprec as ``apex``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__all__ = ["install_apex_alias"]

_SUBMODULES = ("amp", "parallel", "normalization")


def install_apex_alias() -> None:
    """Register ``apex``, ``apex.amp``, ``apex.parallel`` and ``apex.normalization`` (also as
    ``apex.normalization.fused_layer_norm``) as aliases of the mixprec modules, so
    ``from apex import amp`` and ``from apex.parallel import DistributedDataParallel`` keep
    working after Apex's removal.

    Call it once, before the script's first ``import apex``. Calling it again is harmless.

    Raises:
        RuntimeError: when a real ``apex`` package is importable or already imported; the alias
            would shadow it. Uninstall Apex (``pip uninstall apex``) or import mixprec directly.

    Example::

        >>> import mixprec
        >>> mixprec.install_apex_alias()
        >>> from apex import amp          # mixprec.amp
    """
    existing = sys.modules.get("apex")
    if existing is not None:
        if getattr(existing, "__mixprec_alias__", False):
            return
        raise RuntimeError(
            f"install_apex_alias(): a real apex package is already imported (from "
            f"{getattr(existing, '__file__', '?')}). The alias would shadow it: uninstall Apex "
            "or import mixprec's modules directly (from mixprec import amp)."
        )
    if importlib.util.find_spec("apex") is not None:
        raise RuntimeError(
            "install_apex_alias(): a real apex package is installed and importable. The alias "
            "would shadow it: uninstall Apex (pip uninstall apex) or import mixprec's modules "
            "directly (from mixprec import amp)."
        )
    apex = types.ModuleType("apex", "Alias of mixprec installed by mixprec.install_apex_alias().")
    apex.__mixprec_alias__ = True
    apex.__path__ = []  # a package, so `import apex.amp` consults sys.modules
    for name in _SUBMODULES:
        module = importlib.import_module(f"mixprec.{name}")
        setattr(apex, name, module)
        sys.modules[f"apex.{name}"] = module
    # Where Apex defined its norms, and where Megatron-style code imports them from.
    normalization = sys.modules["apex.normalization"]
    sys.modules["apex.normalization.fused_layer_norm"] = normalization
    sys.modules["apex"] = apex
