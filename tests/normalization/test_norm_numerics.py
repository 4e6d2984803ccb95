"""Outputs and all gradients against a float64 reference, through the public API.

On CPU this exercises the PyTorch path; on CUDA the same tests run the Triton kernels.
"""

import pytest
import torch

from mixprec.normalization import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
    fused_layer_norm,
    fused_rms_norm,
)

from .helpers import (
    CASE_IDS,
    CASES,
    DEVICES,
    HALF_AND_FLOAT,
    KERNEL_DEVICES,
    device_and_context,
    device_cases,
    float64_reference,
    make_input,
    make_params,
    run_and_compare,
)


def _functional(kind, normalized_shape, weight, bias, memory_efficient):
    if kind == "layer":
        return lambda x: fused_layer_norm(
            x, normalized_shape, weight, bias, memory_efficient=memory_efficient
        )
    return lambda x: fused_rms_norm(x, normalized_shape, weight, memory_efficient=memory_efficient)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save_x", "save_y"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=str)
@pytest.mark.parametrize("device,shape,normalized_shape", device_cases())
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_functional_matches_float64(kind, device, shape, normalized_shape, dtype, affine,
                                    memory_efficient):
    x = make_input(shape, dtype, device)
    w, b = make_params(normalized_shape, dtype, device, affine, with_bias=kind == "layer")
    fn = _functional(kind, normalized_shape, w, b, memory_efficient)
    run_and_compare(kind, fn, x, normalized_shape, w, b, memory_efficient, dtype)


# The large cases on the CPU path, a few configurations each (all of them run on CUDA above).
@pytest.mark.parametrize(
    "kind,case_id,dtype,affine,memory_efficient",
    [
        ("layer", "7x65536", torch.bfloat16, True, True),
        ("rms", "7x65536", torch.float32, True, False),
        ("layer", "5x123x123-2d", torch.float32, True, False),
        ("rms", "5x123x123-2d", torch.float16, False, True),
    ],
)
def test_large_cases_on_cpu(kind, case_id, dtype, affine, memory_efficient):
    shape, normalized_shape = CASES[CASE_IDS.index(case_id)]
    x = make_input(shape, dtype, "cpu")
    w, b = make_params(normalized_shape, dtype, "cpu", affine, with_bias=kind == "layer")
    fn = _functional(kind, normalized_shape, w, b, memory_efficient)
    run_and_compare(kind, fn, x, normalized_shape, w, b, memory_efficient, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["row_strided", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,normalized_shape", [CASES[1], CASES[2]], ids=CASE_IDS[1:3])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_non_contiguous_input(kind, shape, normalized_shape, dtype, layout, device):
    x = make_input(shape, dtype, device, layout=layout)
    assert not x.is_contiguous()
    w, b = make_params(normalized_shape, dtype, device, True, with_bias=kind == "layer")
    fn = _functional(kind, normalized_shape, w, b, False)
    run_and_compare(kind, fn, x, normalized_shape, w, b, False, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save_x", "save_y"])
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_mixed_modules_output_the_weight_dtype(kind, x_dtype, memory_efficient, device):
    shape, normalized_shape = (4, 9, 96), (96,)
    cls = MixedFusedLayerNorm if kind == "layer" else MixedFusedRMSNorm
    norm = cls(normalized_shape, memory_efficient=memory_efficient).to(device)
    with torch.no_grad():
        w, b = make_params(normalized_shape, torch.float32, device, True)
        norm.weight.copy_(w)
        if kind == "layer":
            norm.bias.copy_(b)
    x = make_input(shape, x_dtype, device)
    bias = norm.bias if kind == "layer" else None
    run_and_compare(
        kind, norm, x, normalized_shape, norm.weight, bias, memory_efficient, torch.float32
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save_x", "save_y"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_half_input_with_fp32_params_outputs_the_input_dtype(kind, memory_efficient, device):
    # The non-Mixed modules keep the activation dtype: e.g. fp32 norm weights kept by an
    # optimizer while the activations are bf16.
    shape, normalized_shape = (6, 200), (200,)
    cls = FusedLayerNorm if kind == "layer" else FusedRMSNorm
    norm = cls(200, memory_efficient=memory_efficient).to(device)
    with torch.no_grad():
        w, b = make_params(normalized_shape, torch.float32, device, True)
        norm.weight.copy_(w)
        if kind == "layer":
            norm.bias.copy_(b)
    x = make_input(shape, torch.bfloat16, device)
    bias = norm.bias if kind == "layer" else None
    run_and_compare(
        kind, norm, x, normalized_shape, norm.weight, bias, memory_efficient, torch.bfloat16
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_modules_match_torch_native(kind, device):
    torch.manual_seed(0)
    if kind == "layer":
        ours, native = FusedLayerNorm(64).to(device), torch.nn.LayerNorm(64).to(device)
    else:
        if not hasattr(torch.nn, "RMSNorm"):
            pytest.skip("requires torch.nn.RMSNorm (torch >= 2.4)")
        ours, native = FusedRMSNorm(64).to(device), torch.nn.RMSNorm(64, eps=1e-5).to(device)
    with torch.no_grad():
        for p in ours.parameters():
            p.uniform_(0.5, 1.5)
    native.load_state_dict(ours.state_dict())
    x = torch.randn(10, 64, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    dy = torch.randn(10, 64, device=device)
    ours(x).backward(dy)
    native(x2).backward(dy)
    torch.testing.assert_close(ours(x), native(x2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)
    for p, q in zip(ours.parameters(), native.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [40, 1])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_sum_backward_with_expanded_gradient(kind, n, device):
    # y.sum() hands backward a stride-0 gradient; it must be read correctly.
    x = make_input((3, n), torch.float32, device)
    w, b = make_params((n,), torch.float32, device, True, with_bias=kind == "layer")
    fn = _functional(kind, (n,), w, b, False)
    x.requires_grad_(True)
    fn(x).sum().backward()
    _, dx_ref, dw_ref, _ = float64_reference(kind, x, (n,), w, b, torch.ones(3, n, device=device))
    torch.testing.assert_close(x.grad.double(), dx_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(w.grad.double(), dw_ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_only_parameter_gradients(device):
    x = make_input((5, 33), torch.float32, device)  # no requires_grad
    w, b = make_params((33,), torch.float32, device, True)
    fused_layer_norm(x, 33, w, b).square().sum().backward()
    assert w.grad is not None and b.grad is not None and x.grad is None


@pytest.mark.parametrize("device", DEVICES)
def test_float64_input_takes_the_exact_path(device):
    x = make_input((4, 17), torch.float64, device)
    w, b = make_params((17,), torch.float64, device, True)
    fn = _functional("layer", (17,), w, b, True)
    run_and_compare("layer", fn, x, (17,), w, b, True, torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_leading_dims(device):
    x = torch.randn(0, 3, 8, device=device, requires_grad=True)
    w, b = make_params((8,), torch.float32, device, True)
    y = fused_layer_norm(x, 8, w, b)
    assert y.shape == (0, 3, 8)
    y.sum().backward()
    assert x.grad.shape == x.shape
    torch.testing.assert_close(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_empty_batch_output_has_torchs_strides(kind):
    """An empty batch (a zero in the leading dims, e.g. no tokens routed to an expert) gives
    an output laid out as PyTorch's own norm gives it (torch.empty's strides, a zero size
    counting as one), so that code that views or compares strides treats both alike. Shape,
    dtype and strides against torch.nn.functional's norms (C17)."""
    x = torch.randn(2, 0, 8)
    if kind == "layer":
        got, want = fused_layer_norm(x, 8), torch.nn.functional.layer_norm(x, (8,))
    else:
        got, want = fused_rms_norm(x, 8), torch.nn.functional.rms_norm(x, (8,))
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.stride() == want.stride() == (8, 8, 1)


@KERNEL_DEVICES
@pytest.mark.parametrize("eps", [1e-12, 1e-5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [45, 768, 3000])
def test_layer_norm_of_constant_rows_is_the_bias(n, dtype, eps, device):
    """A row of equal values has zero variance: its output is exactly the bias whatever eps.
    A mean off by one ulp of the values (the rounding of a plain fp32 sum) would come back
    multiplied by 1 / sqrt(eps): a row of 12345.678 normalized to +-1 at the default eps, and
    rows of 0.1 to noise of 0.01-0.4 at BERT's eps of 1e-12. The gradients stay finite and
    match PyTorch's LayerNorm in float64 (where x_hat is exactly 0)."""
    device, context = device_and_context(device)
    values = [0.1, -0.7, 1.7, 12345.678, 3e-3, -2.5e4]
    x = torch.tensor(values).repeat_interleave(n).view(len(values), n).to(device, dtype)
    w, b = (t.detach() for t in make_params((n,), torch.float32, device, True))
    dy = make_input(x.shape, dtype, device, seed=5)
    xg = x.clone().requires_grad_(True)
    wg, bg = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    with context():
        y = fused_layer_norm(xg, (n,), wg, bg, eps=eps)
        y.backward(dy)
    # fp32 exactly; bf16 within one rounding (Triton's interpreter truncates to bf16).
    rtol = 0 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(y.float(), b.expand_as(y), atol=0, rtol=rtol)
    y64, dx64, dw64, db64 = float64_reference("layer", x, (n,), w, b, dy, eps=eps)
    # dx = rstd * (w*dy - mean(w*dy)) with rstd = 1 / sqrt(eps): up to 1e6 times dy at 1e-12.
    scale = dx64.abs().amax().item()
    torch.testing.assert_close(xg.grad.double(), dx64, atol=1e-5 * scale, rtol=2e-2)
    torch.testing.assert_close(wg.grad.double(), dw64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bg.grad.double(), db64, atol=1e-5, rtol=1e-5)
