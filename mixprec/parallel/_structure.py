"""Notice, at almost no cost per forward, that a wrapped module's parameters may have changed.

A layer replaced or added after wrapping (``ddp.module.fc = nn.Linear(...)``) brings parameters
that the all-reduce was not set up for. Walking the module at every forward to find them costs
0.3-1.2 ms for a 150-parameter transformer on a slow host. Instead, PyTorch's process-wide
registration hooks (``register_module_parameter_registration_hook`` and
``register_module_module_registration_hook``, public since PyTorch 2.0) bump a counter whenever
any module gets a parameter or a submodule (attribute assignment, ``register_parameter``,
``add_module``, ``nn.Sequential.__setitem__``, ``ModuleList.append``); a wrapper compares the
counter with the value it saw last and walks its module only when it moved. The hooks are
installed once, by the first wrapper, and return ``None`` (they never alter what is
registered): their cost is one Python call per registration anywhere in the process.

Not seen: writes into a module's ``_parameters`` / ``_modules`` dictionaries directly (which
``nn.Sequential.insert`` and ``nn.ModuleList.insert`` make: a layer built before the last
forward and inserted so goes unnoticed until some other registration moves the counter),
buffers registered on a known module (``spectral_norm``'s ``weight_u``), a parametrization that
keeps the parameter object (PyTorch's DDP loses that parameter's hooks as well), and a
parameter deleted with ``del`` (a forward that still used it fails by itself).
"""

from __future__ import annotations

import itertools
import threading

from torch.nn.modules import module as _module

__all__ = ["version", "watch"]

_counter = itertools.count(1)  # (next() on it is atomic under the GIL)
_version = 0
_lock = threading.Lock()
_handles: list = []


def _bump(module, name, value) -> None:
    global _version
    _version = next(_counter)
    return None


def watch() -> None:
    """Install the registration hooks (once per process)."""
    if _handles:
        return
    with _lock:
        if not _handles:
            _handles.append(_module.register_module_parameter_registration_hook(_bump))
            _handles.append(_module.register_module_module_registration_hook(_bump))


def version() -> int:
    """A value that changes whenever any module got a parameter or submodule since
    :func:`watch`."""
    return _version
