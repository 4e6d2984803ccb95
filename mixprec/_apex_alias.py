"""``install_apex_alias()``: let unmodified Apex scripts import mixprec as ``apex``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__all__ = ["install_apex_alias"]

_SUBMODULES = ("amp", "optimizers", "parallel", "normalization")


def install_apex_alias() -> None:
    """Register ``apex``, ``apex.amp``, ``apex.optimizers``, ``apex.parallel``,
    ``apex.normalization`` and ``apex.normalization.fused_layer_norm`` as aliases of the
    mixprec modules, so ``from apex import amp``, ``from apex.optimizers import FusedAdam``,
    ``from apex.parallel import DistributedDataParallel`` and
    ``from apex.normalization.fused_layer_norm import fused_layer_norm_affine`` keep working
    after Apex's removal (of Apex's optimizers, mixprec has ``FusedAdam``). ``apex.normalization.fused_layer_norm`` is
    :mod:`mixprec.normalization.apex_functional`: the norm classes and Apex's functional API
    with Apex's signatures.

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
    # apex.normalization: a package of its own, as in Apex, whose `fused_layer_norm` is the
    # submodule where Apex defined its norms and its functional API (Megatron-style and timm
    # code import from there; Apex's functions take other arguments than mixprec's
    # fused_layer_norm, which is therefore not the package's `fused_layer_norm` here).
    mixprec_norm = importlib.import_module("mixprec.normalization")
    functional = importlib.import_module("mixprec.normalization.apex_functional")
    normalization = types.ModuleType(
        "apex.normalization", "Alias of mixprec.normalization (Apex's layout).")
    normalization.__path__ = []
    for name in mixprec_norm.__all__:
        if name not in ("fused_layer_norm", "fused_rms_norm"):
            setattr(normalization, name, getattr(mixprec_norm, name))
    for name in functional.__all__:
        if name.endswith("Function"):
            setattr(normalization, name, getattr(functional, name))
    normalization.fused_layer_norm = functional
    apex.normalization = normalization
    sys.modules["apex.normalization"] = normalization
    sys.modules["apex.normalization.fused_layer_norm"] = functional
    sys.modules["apex"] = apex
