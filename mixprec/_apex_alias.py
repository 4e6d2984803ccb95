"""``install_apex_alias()``: let unmodified Apex scripts import mixprec as ``apex``."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import pathlib
import pkgutil
import sys
import types
import warnings
from typing import Tuple

__all__ = ["install_apex_alias"]

_SUBMODULES = ("amp", "optimizers", "parallel", "normalization", "fp16_utils",
               "multi_tensor_apply")
# Where mixprec keeps each (default: mixprec.<name>). These serve only the alias: the import
# blocks of Apex-era scripts (Apex's ImageNet example: `from apex.fp16_utils import *`,
# `from apex.multi_tensor_apply import multi_tensor_applier`; `from apex.optimizers import
# FusedAdam, FusedSGD, FusedLAMB`: mixprec.optimizers, FusedSGD as PyTorch's SGD, and
# stand-ins for Apex's other optimizers).
_MIXPREC_MODULES = {"optimizers": "mixprec._apex_legacy.optimizers",
                    "fp16_utils": "mixprec._apex_legacy.fp16_utils",
                    "multi_tensor_apply": "mixprec._apex_legacy.multi_tensor_apply"}


def install_apex_alias() -> Tuple[str, ...]:
    """Make ``import apex`` and its submodules resolve to mixprec where Apex does not provide
    them, so scripts written for Apex run unmodified.

    Without Apex installed, ``apex``, ``apex.amp``, ``apex.optimizers``, ``apex.parallel``,
    ``apex.normalization`` and ``apex.normalization.fused_layer_norm`` all become aliases of
    the mixprec modules: ``from apex import amp``, ``from apex.optimizers import FusedAdam``,
    ``from apex.parallel import DistributedDataParallel`` and
    ``from apex.normalization.fused_layer_norm import fused_layer_norm_affine`` keep working.
    (``apex.normalization.fused_layer_norm`` is :mod:`mixprec.normalization.apex_functional`:
    the norm classes and Apex's functional API with Apex's signatures. Of Apex's optimizers
    mixprec has ``FusedAdam``, and ``FusedSGD`` is PyTorch's SGD with Apex's signature; Apex's
    others (``FusedLAMB``, ``FusedNovoGrad``, ``FusedAdagrad``, ``FusedMixedPrecisionLamb``,
    ``FusedLANS``, 2019's ``FP16_Optimizer``) import, from ``apex.optimizers`` and their own
    module paths, and constructing one raises an error naming its replacement.) Apex's module
    paths give the same objects:
    ``from apex.parallel.LARC import LARC``, ``apex.parallel.sync_batchnorm``,
    ``apex.parallel.optimized_sync_batchnorm``, ``apex.parallel.distributed``,
    ``apex.amp.handle``, ``apex.amp.frontend``, ``apex.amp._amp_state`` (a view of the
    latest ``initialize`` for scripts that set ``_loss_scale`` or read ``_unskipped``; see
    docs/migrating.md), ``apex.optimizers.fused_adam``. ``from apex.amp.scaler import
    LossScaler`` gives Apex's interface of that class (``loss_scale()``, ``unscale``,
    ``update_scale``), for scripts that built their own fp16 optimizer on it, and
    ``from apex.amp import __version__`` Apex's version module. Apex's legacy ``apex.fp16_utils``
    (``to_python_float``, ``network_to_half``, the hand-made master-weight helpers) and an
    ``apex.multi_tensor_apply`` whose ``multi_tensor_applier.available`` is False are served
    too, so the import block of Apex's ImageNet example and its copies runs.

    With Apex installed, the alias never shadows it: it fills in only the submodules that the
    installed Apex lacks. Apex releases from 2025 on removed ``apex.amp`` and
    ``apex.parallel`` but keep ``apex.optimizers`` and ``apex.normalization`` (NGC containers
    ship such an Apex), so there ``apex.amp``, ``apex.parallel`` and ``apex.fp16_utils``
    become mixprec's while
    ``FusedLAMB``, ``FusedLayerNorm`` and the rest stay Apex's own. An older Apex whose
    ``apex.amp`` still works is left as it is (with a warning when the alias then serves
    nothing at all; it still fills in a submodule that Apex lacks); an ``apex.amp`` that fails
    to import (an old Apex on a newer PyTorch) is replaced by mixprec's, with a warning, and so
    is an ``apex.parallel`` without ``DistributedDataParallel``.

    Call it once, before the script imports ``apex`` (for example in a launcher or
    ``sitecustomize.py``). Calling it again is harmless and returns the same names.

    Returns:
        tuple of str: the module names now served by mixprec, e.g. ``("apex.amp",
        "apex.parallel", "apex.fp16_utils")`` beside an Apex of 2025 or later; empty when the
        installed Apex has every submodule.

    Raises:
        RuntimeError: an installed Apex that fails to import (a broken build): the message
            carries its error. Fix or uninstall it (``pip uninstall apex``), or import mixprec's
            modules directly (``from mixprec import amp``).

    Example::

        >>> import mixprec
        >>> mixprec.install_apex_alias()
        ('apex', 'apex.amp', 'apex.optimizers', 'apex.parallel', 'apex.normalization', 'apex.normalization.fused_layer_norm', 'apex.fp16_utils', 'apex.multi_tensor_apply')
        >>> from apex import amp          # mixprec.amp
    """
    existing = sys.modules.get("apex")
    if existing is not None:
        served = getattr(existing, "__mixprec_alias__", None)
        if served is not None:
            return served
        return _fill_in(existing)
    spec = importlib.util.find_spec("apex")
    # A directory named apex without an __init__.py (the root of an Apex source checkout,
    # whose package is apex/apex/, left beside a script) is found as a namespace package: no
    # Apex is installed, and filling it in would leave out the metadata libraries check for.
    if spec is not None and spec.origin is not None:
        try:
            real = importlib.import_module("apex")
        except Exception as err:
            raise RuntimeError(
                f"install_apex_alias(): an apex package is installed but fails to import "
                f"({type(err).__name__}: {err}). The alias fills in only what a working Apex "
                "lacks: fix or uninstall that Apex (pip uninstall apex), or import mixprec's "
                "modules directly (from mixprec import amp).") from err
        return _fill_in(real)
    apex = _stand_in("apex", "Alias of mixprec installed by mixprec.install_apex_alias().")
    served = ("apex",) + _serve(apex, _SUBMODULES)
    apex.__mixprec_alias__ = served
    sys.modules["apex"] = apex
    if not any(isinstance(f, _AliasDistributionFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasDistributionFinder())
    return served


def _stand_in(name: str, doc: str) -> types.ModuleType:
    """A package module made here (no file), with a spec: `importlib.util.find_spec("apex")`,
    which libraries call to ask whether Apex is installed (transformers at import time,
    Lightning), raises ValueError for a module in sys.modules without one."""
    module = types.ModuleType(name, doc)
    module.__path__ = []  # a package, so `import apex.amp` consults sys.modules
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    return module


class _AliasDistribution(importlib.metadata.Distribution):
    """The installed-package metadata of the stand-in ``apex``: libraries that check for Apex
    by its version (``importlib.metadata.version("apex")``: transformers' Trainer with
    ``half_precision_backend="apex"``) find one, ``0.1+mixprec.<mixprec's version>``."""

    def read_text(self, filename):
        if filename == "METADATA":
            from mixprec import __version__

            return (f"Metadata-Version: 2.1\nName: apex\nVersion: 0.1+mixprec.{__version__}\n"
                    "Summary: mixprec's Apex alias (mixprec.install_apex_alias())\n")
        return None

    def locate_file(self, path):
        return pathlib.Path(__file__).parent / path


class _AliasDistributionFinder(importlib.abc.MetaPathFinder):
    """Finds no modules (the alias's are in sys.modules), only the stand-in's metadata."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if name is None or name.replace("-", "_").lower() == "apex":
            yield _AliasDistribution()


def _fill_in(apex: types.ModuleType) -> Tuple[str, ...]:
    """Attach mixprec's modules to a real Apex package for the submodules it does not have."""
    missing = tuple(name for name in _SUBMODULES if not _apex_provides(apex, name))
    served = _serve(apex, missing)
    apex.__mixprec_alias__ = served
    public = getattr(apex, "__all__", None)
    if public is not None:
        # `from apex import *` gave Apex's amp (its __all__ listed it); Apex's 2025 __all__
        # names only what it kept, so the star import would leave the served modules out.
        top = [name.split(".")[1] for name in served if name.count(".") == 1]
        apex.__all__ = list(public) + [name for name in top if name not in public]
    if not served:
        warnings.warn(
            f"install_apex_alias(): the installed Apex ({getattr(apex, '__file__', '?')}) has "
            f"all of {', '.join('apex.' + n for n in _SUBMODULES)}, so nothing was aliased and "
            "`apex.amp` is Apex's own. To use mixprec, uninstall that Apex (pip uninstall apex) "
            "or import mixprec's modules directly (from mixprec import amp).", stacklevel=3)
    return served


# What the submodules Apex removed in 2025 must hold to count as Apex's own: a release that
# kept an `apex.parallel` without its DistributedDataParallel still gets mixprec's.
_MARKERS = {"amp": "initialize", "parallel": "DistributedDataParallel"}


def _apex_provides(apex: types.ModuleType, name: str) -> bool:
    if not _has_submodule(apex, name):
        return False
    marker = _MARKERS.get(name)
    if marker is None:
        return True
    try:
        module = importlib.import_module(f"apex.{name}")
    except Exception as err:  # (an old apex.amp on a newer PyTorch, say)
        warnings.warn(
            f"install_apex_alias(): the installed Apex's apex.{name} fails to import "
            f"({type(err).__name__}: {err}); mixprec.{name} serves as apex.{name} instead.",
            stacklevel=5)
        return False
    if hasattr(module, marker):
        return True
    warnings.warn(
        f"install_apex_alias(): the installed Apex's apex.{name} has no {marker}; "
        f"mixprec.{name} serves as apex.{name} instead.", stacklevel=5)
    return False


def _has_submodule(apex: types.ModuleType, name: str) -> bool:
    if f"apex.{name}" in sys.modules or isinstance(getattr(apex, name, None), types.ModuleType):
        return True
    try:
        return importlib.util.find_spec(f"apex.{name}") is not None
    except (ImportError, ValueError):
        return False


def _serve(apex: types.ModuleType, names) -> Tuple[str, ...]:
    """Register ``apex.<name>`` as mixprec's module for each name; the names registered."""
    served = []
    for name in names:
        if name == "normalization":
            served += _serve_normalization(apex)
            continue
        module = importlib.import_module(_MIXPREC_MODULES.get(name, f"mixprec.{name}"))
        setattr(apex, name, module)
        sys.modules[f"apex.{name}"] = module
        served.append(f"apex.{name}")
        _register_submodules(name, module)
    return tuple(served)


# Apex's own submodule paths that scripts import from, and the mixprec module holding the same
# names (SwAV/DINO-style code: `from apex.parallel.LARC import LARC`).
_APEX_ONLY_SUBMODULES = {
    # (`apex.amp.scaler`: Apex's LossScaler, whose interface differs from mixprec's; Apex's
    # amp kept its version in the submodule `apex.amp.__version__`.)
    "amp": {"amp": "mixprec.amp", "frontend": "mixprec.amp", "handle": "mixprec.amp",
            "scaler": "mixprec._apex_legacy.amp_scaler",
            "__version__": "mixprec._apex_legacy.amp_version"},
    "parallel": {"LARC": "mixprec.parallel.larc",
                 "optimized_sync_batchnorm": "mixprec.parallel.sync_batchnorm"},
    # (BERT-era scripts: `from apex.fp16_utils.fp16_optimizer import FP16_Optimizer` inside a
    # try whose except says "install apex": the module must import for its message to show.)
    "fp16_utils": {"fp16_optimizer": "mixprec._apex_legacy.fp16_utils",
                   "fp16util": "mixprec._apex_legacy.fp16_utils",
                   "loss_scaler": "mixprec._apex_legacy.fp16_utils"},
    "multi_tensor_apply": {"multi_tensor_apply": "mixprec._apex_legacy.multi_tensor_apply"},
    # (`from apex.optimizers.fused_lamb import FusedLAMB`: the stand-ins, whose construction
    # names the replacement.)
    "optimizers": {"fused_adam": "mixprec.optimizers.fused_adam",
                   **{sub: "mixprec._apex_legacy.optimizers" for sub in (
                       "fused_sgd", "fused_lamb", "fused_mixed_precision_lamb", "fused_lans",
                       "fused_novograd", "fused_adagrad", "fp16_optimizer")}},
}


def _register_submodules(name: str, package: types.ModuleType) -> None:
    """``apex.<name>.<sub>`` for mixprec's imported submodules and Apex's paths above, as the
    same module objects. (``apex.<name>`` is mixprec's package, whose ``__path__`` would
    otherwise run mixprec's files again under the ``apex`` name: copies of every class, which
    fail ``isinstance`` against the originals.) Submodules left behind by an Apex package
    this one replaces (an ``apex.amp`` that failed halfway through its imports) go."""
    for stale in [key for key in sys.modules if key.startswith(f"apex.{name}.")]:
        del sys.modules[stale]
    for info in pkgutil.iter_modules(getattr(package, "__path__", ())):
        module = sys.modules.get(f"{package.__name__}.{info.name}")
        if module is not None:
            sys.modules[f"apex.{name}.{info.name}"] = module
    for sub, target in _APEX_ONLY_SUBMODULES.get(name, {}).items():
        module = sys.modules[f"apex.{name}.{sub}"] = importlib.import_module(target)
        if not hasattr(package, sub):  # (`import apex.fp16_utils.fp16_optimizer as m`)
            setattr(package, sub, module)


def _serve_normalization(apex: types.ModuleType) -> list:
    # apex.normalization: a package of its own, as in Apex, whose `fused_layer_norm` is the
    # submodule where Apex defined its norms and its functional API (Megatron-style and timm
    # code import from there; Apex's functions take other arguments than mixprec's
    # fused_layer_norm, which is therefore not the package's `fused_layer_norm` here).
    mixprec_norm = importlib.import_module("mixprec.normalization")
    functional = importlib.import_module("mixprec.normalization.apex_functional")
    normalization = _stand_in(
        "apex.normalization", "Alias of mixprec.normalization (Apex's layout).")
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
    return ["apex.normalization", "apex.normalization.fused_layer_norm"]
