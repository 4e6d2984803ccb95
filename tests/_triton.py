"""Whether this environment can run mixprec's Triton kernels in Triton's CPU interpreter.

The interpreter tests need Triton installed, ``TRITON_INTERPRET=1`` (tests/conftest.py sets
it when there is no GPU) and a Triton whose interpreter computes these kernels correctly:
Triton 3.0's (PyTorch 2.4's pin) does not with NumPy 2 (wrong values, skipped stores), so the
interpreter tests run from Triton 3.6 on, the version CI pins and the GPU machine has.
"""

from mixprec.normalization._launch import interpreter_enabled, triton_version

__all__ = ["INTERPRETER_MIN_VERSION", "interpreter_skip_reason"]

INTERPRETER_MIN_VERSION = (3, 6)


def interpreter_skip_reason(require_env: bool = True):
    """None when the CPU interpreter tests can run here, else why not."""
    version = triton_version()  # the package's reader: None without a usable Triton
    if version is None:
        return "requires triton (importable, with a version string that parses)"
    if version < INTERPRETER_MIN_VERSION:
        return (f"Triton {version[0]}.{version[1]}'s interpreter miscomputes these kernels; "
                f"the interpreter tests need Triton >= 3.6 (CI pins 3.6)")
    if require_env and not interpreter_enabled():
        return "requires TRITON_INTERPRET=1 (set by tests/conftest.py when there is no GPU)"
    return None
