"""Whether this environment can run mixprec's Triton kernels in Triton's CPU interpreter.

The interpreter tests need Triton installed, ``TRITON_INTERPRET=1`` (tests/conftest.py sets
it when there is no GPU) and a Triton whose interpreter computes these kernels correctly:
Triton 3.0's and 3.1's (PyTorch 2.4's and 2.5's pins) do not with NumPy 2 (wrong values,
skipped stores), those before 3.3 ignore a masked scalar store (amp's overflow flag), and
mixprec runs its FusedAdam and fused-cast kernels from Triton 3.6 on (taking PyTorch's path
before). So the interpreter tests run from Triton 3.6 on, the version CI pins and the GPU
machine has. (Checked on PyTorch 2.4-2.7 CPU venvs: the normalization and SyncBatchNorm kernels
pass under Triton 3.2-3.5's interpreter, and under 3.0 with NumPy 1.)
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
        return (f"the interpreter tests need Triton >= 3.6 (CI pins 3.6), found "
                f"{version[0]}.{version[1]}: older interpreters miscompute some of these "
                "kernels (3.0/3.1 with NumPy 2; masked scalar stores before 3.3), and mixprec "
                "takes PyTorch's path for its FusedAdam and fused-cast kernels before 3.6")
    if require_env and not interpreter_enabled():
        return "requires TRITON_INTERPRET=1 (set by tests/conftest.py when there is no GPU)"
    return None
