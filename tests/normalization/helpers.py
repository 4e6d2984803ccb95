"""Cases, tolerances and the float64 reference shared by the normalization tests."""

import contextlib
import importlib.util
import math

import pytest
import torch

from mixprec.normalization import _launch
from tests._triton import interpreter_skip_reason

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_interpreter = pytest.mark.skipif(
    not HAS_TRITON or torch.cuda.is_available() or not _launch.interpreter_enabled()
    or interpreter_skip_reason() is not None,
    reason=(
        "requires triton >= 3.6 and TRITON_INTERPRET=1 without CUDA (on a GPU the CUDA tests "
        "run the same kernels)"
    ),
)

# CPU, CUDA, and CPU through the Triton kernels in Triton's interpreter ("cpu-triton").
KERNEL_DEVICES = pytest.mark.parametrize(
    "device", [*DEVICES, pytest.param("cpu-triton", marks=requires_interpreter)])


def device_and_context(device):
    """The tensors' device and a factory of the context that routes CPU calls to the kernels."""
    from mixprec.normalization import _ops

    if device == "cpu-triton":
        return "cpu", _ops.triton_on_cpu
    return device, contextlib.nullcontext


# (dtype, atol, rtol) against a float64 reference fed the same (rounded) inputs. One rounding of
# the result accounts for most of it; the rest is fp32 summation over rows of up to 65,536
# elements and, for memory_efficient, x_hat recovered from the rounded output y. Parameter
# gradients sum M rows of such errors, so their atol is scaled by sqrt(M) (see run_and_compare).
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float64: (1e-10, 1e-10),
}

# (input shape, normalized_shape): odd sizes, a 2-D normalized shape, and the longest row the
# fused kernels hold.
CASES = [
    ((1, 1), (1,)),
    ((3, 1023), (1023,)),
    ((5, 123, 123), (123,)),
    ((5, 123, 123), (123, 123)),
    ((7, 65536), (65536,)),
]
CASE_IDS = ["1x1", "3x1023", "5x123x123", "5x123x123-2d", "7x65536"]


def device_cases(cpu_ids=("1x1", "3x1023", "5x123x123")):
    """``(device, shape, normalized_shape)`` params: every case on CUDA, ``cpu_ids`` on CPU.

    The larger cases are slow on the CPU path (the CI machine has 2 cores); they run on CPU in
    their own, smaller tests.
    """
    params = []
    for case, case_id in zip(CASES, CASE_IDS):
        if case_id in cpu_ids:
            params.append(pytest.param("cpu", *case, id=f"{case_id}-cpu"))
        params.append(pytest.param("cuda", *case, id=f"{case_id}-cuda", marks=requires_cuda))
    return params


HALF_AND_FLOAT = [torch.float32, torch.float16, torch.bfloat16]


def tolerance(*dtypes):
    """The loosest (atol, rtol) among ``dtypes``."""
    atol = max(TOLERANCES[d][0] for d in dtypes)
    rtol = max(TOLERANCES[d][1] for d in dtypes)
    return {"atol": atol, "rtol": rtol}


def make_input(shape, dtype, device, layout="contiguous", seed=0):
    """Random input of ``shape``; ``layout`` 'row_strided' pads every last-dim row, 'transposed'
    makes the last dim non-unit-stride, so both stride paths of the wrapper are exercised."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(size, generator=gen).to(device=device, dtype=dtype)

    if layout == "contiguous":
        return randn(*shape)
    if layout == "row_strided":
        return randn(*shape[:-1], shape[-1] + 3)[..., : shape[-1]]
    if layout == "transposed":
        return randn(*reversed(shape)).permute(*reversed(range(len(shape))))
    raise ValueError(f"unknown layout {layout!r}")


def make_params(normalized_shape, dtype, device, affine, with_bias=True, seed=1):
    """Weight near 1 (never 0: memory_efficient divides by it) and a small bias, or Nones."""
    if not affine:
        return None, None
    gen = torch.Generator().manual_seed(seed)
    w = (1 + 0.2 * torch.randn(normalized_shape, generator=gen)).to(device=device, dtype=dtype)
    b = (0.2 * torch.randn(normalized_shape, generator=gen)).to(device=device, dtype=dtype)
    w.requires_grad_(True)
    b.requires_grad_(True)
    return w, (b if with_bias else None)


def float64_reference(kind, x, normalized_shape, weight, bias, dy, eps=1e-5):
    """Output and gradients (dx, dweight, dbias) of PyTorch's own norms in float64 (autograd),
    not mixprec's code."""
    x64 = x.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True) if weight is not None else None
    b64 = bias.detach().double().requires_grad_(True) if bias is not None else None
    if kind == "layer":
        y = torch.nn.functional.layer_norm(x64, list(normalized_shape), w64, b64, eps)
    else:
        y = torch.nn.functional.rms_norm(x64, list(normalized_shape), w64, eps)
    y.backward(dy.double())
    grads = [t.grad if t is not None else None for t in (x64, w64, b64)]
    return (y.detach(), *grads)


def run_and_compare(kind, fn, x, normalized_shape, weight, bias, memory_efficient, out_dtype,
                    seed=2):
    """Run ``fn`` forward and backward and compare everything with the float64 reference.

    ``out_dtype`` is the dtype the output must have. Returns nothing; raises on a mismatch.
    """
    x = x.detach().requires_grad_(True)
    y = fn(x)
    assert y.dtype == out_dtype
    assert y.shape == x.shape
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(tuple(x.shape), generator=gen).to(device=x.device, dtype=out_dtype)
    y.backward(dy)
    y_ref, dx_ref, dw_ref, db_ref = float64_reference(
        kind, x, normalized_shape, weight, bias, dy
    )
    # memory_efficient rebuilds x_hat from y, so every gradient inherits y's rounding.
    saved = (out_dtype,) if memory_efficient else ()
    torch.testing.assert_close(y.double(), y_ref, **tolerance(out_dtype))
    assert x.grad.dtype == x.dtype
    torch.testing.assert_close(x.grad.double(), dx_ref, **tolerance(x.dtype, *saved))
    rows_scale = math.sqrt(max(1, x.numel() // max(1, math.prod(normalized_shape))))
    if weight is not None:
        assert weight.grad.dtype == weight.dtype
        tol = tolerance(weight.dtype, *saved)
        tol["atol"] *= rows_scale
        torch.testing.assert_close(weight.grad.double(), dw_ref, **tol)
    if bias is not None:
        assert bias.grad.dtype == bias.dtype
        tol = tolerance(bias.dtype)
        tol["atol"] *= rows_scale
        torch.testing.assert_close(bias.grad.double(), db_ref, **tol)
