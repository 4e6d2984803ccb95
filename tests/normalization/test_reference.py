"""mixprec's plain-PyTorch norm path (``mixprec.normalization.reference``) against PyTorch's own
``layer_norm`` / ``rms_norm`` in float64 under autograd. The Triton kernels' tests compare with
this path's statistics-level interface (mean, rstd, a backward from the saved output), so it is
grounded here."""

import pytest
import torch

from mixprec.normalization import reference

from .helpers import float64_reference, make_input, make_params


@pytest.mark.parametrize("eps", [1e-5, 0.0, 0.5])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_module_level_functions_match_torch_in_float64(kind, affine, eps):
    # (eps 0.5 on inputs of scale 1e-2 changes every value: the eps given is the one used,
    # which the TorchScript path relies on; F01, F02)
    x = make_input((7, 3, 10), torch.float64, "cpu") * (1e-2 if eps == 0.5 else 1.0)
    w, b = make_params((3, 10), torch.float64, "cpu", affine)
    dy = make_input((7, 3, 10), torch.float64, "cpu", seed=4)
    want = float64_reference(kind, x, (3, 10), w, b, dy, eps)
    x = x.detach().requires_grad_(True)
    if kind == "layer":
        y = reference.layer_norm(x, [3, 10], w, b, eps)
    else:
        y = reference.rms_norm(x, [3, 10], w, eps)
    y.backward(dy)
    got = (y.detach(), x.grad, w.grad if affine else None,
           b.grad if affine and kind == "layer" else None)
    for g, r in zip(got, want):
        if r is None:
            continue
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_module_level_functions_return_the_input_dtype_by_default(kind, dtype):
    """Without out_dtype the result has the input's dtype (documented default), though the
    statistics are computed in fp32: benchmarks and user code comparing against this path
    expect a half input to give a half output, and given out_dtype wins. Values match
    PyTorch's norms in float64 to the output dtype's rounding. (F08, F09)"""
    x = make_input((4, 3, 8), dtype, "cpu")
    w, b = (t.detach() for t in make_params((8,), torch.float32, "cpu", True))
    if kind == "layer":
        got = reference.layer_norm(x, [8], w, b, 1e-5)
        wide = reference.layer_norm(x, [8], w, b, 1e-5, torch.float64)
        want = torch.nn.functional.layer_norm(x.double(), (8,), w.double(), b.double(), 1e-5)
    else:
        got = reference.rms_norm(x, [8], w, 1e-5)
        wide = reference.rms_norm(x, [8], w, 1e-5, torch.float64)
        want = torch.nn.functional.rms_norm(x.double(), (8,), w.double(), 1e-5)
    assert got.dtype == dtype and wide.dtype == torch.float64
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(wide, want, rtol=1e-5, atol=1e-5)  # (statistics in fp32)


@pytest.mark.parametrize("from_y", [False, True])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_statistics_interface_matches_torch_in_float64(kind, from_y):
    # norm_forward's y, mean and rstd, and norm_backward's dx, dweight, dbias from the saved
    # input or the saved output: what the kernels are checked against.
    is_rms = kind == "rms"
    m, n = 13, 24
    x = make_input((m, n), torch.float64, "cpu")
    dy = make_input((m, n), torch.float64, "cpu", seed=5)
    w, b = (t.detach() for t in make_params((n,), torch.float64, "cpu", True))
    b = None if is_rms else b
    y, mean, rstd = reference.norm_forward(x, w, b, 1e-5, is_rms, torch.float64)
    y_ref, dx_ref, dw_ref, db_ref = float64_reference(kind, x, (n,), w, b, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    var = (x * x).mean(-1) if is_rms else x.var(-1, unbiased=False)
    torch.testing.assert_close(rstd, (var + 1e-5).rsqrt(), rtol=1e-12, atol=1e-12)
    if not is_rms:
        torch.testing.assert_close(mean, x.mean(-1), rtol=1e-12, atol=1e-12)
    dx, dw, db = reference.norm_backward(dy, y if from_y else x, w, b, mean, rstd, is_rms,
                                         from_y, torch.float64, True, not is_rms)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-10, atol=1e-10)
    if not is_rms:
        torch.testing.assert_close(db, db_ref, rtol=1e-10, atol=1e-10)
        return
    # RMSNorm has no bias: a bias passed anyway gets the empty [0] the kernels and the op's
    # fake implementation give, on the recorded path (a second derivative) and off it (B1).
    bias = torch.randn(n, dtype=torch.float64)
    for recorded in (False, True):
        w_in = w.detach().requires_grad_(recorded)
        _, _, db = reference.norm_backward(dy, y if from_y else x, w_in, bias, mean, rstd,
                                           True, from_y, torch.float64, True, True)
        assert db.shape == (0,), recorded


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_half_results_are_rounded_once(kind, dtype):
    """The module-level functions (the TorchScript path) and norm_forward (the CPU path) compute
    in fp32 and round the result once, as the module docstring says: each output element is
    the float64 value of the same inputs correctly rounded to the half dtype (half an ulp, plus
    fp32 slack near ties). A second rounding (the bias added, or the weight applied, after the
    cast) stays inside the usual bf16 tolerance but differs from PyTorch's own norms, which
    round once (R01, R03)."""
    is_rms = kind == "rms"
    m, n = 16, 45
    x = make_input((m, n), dtype, "cpu", seed=11)
    w, b = (t.detach() for t in make_params((n,), dtype, "cpu", True))
    b = None if is_rms else b
    x64, w64 = x.double(), w.double()
    b64 = 0.0 if is_rms else b.double()
    xc = x64 if is_rms else x64 - x64.mean(-1, keepdim=True)
    x_hat = xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + 1e-5)
    exact = x_hat * w64 + b64
    scale = (x_hat * w64).abs() + abs(b64)
    _, e = torch.frexp(exact.abs())
    ulp = torch.ldexp(torch.ones_like(exact), e - 1) * torch.finfo(dtype).eps
    if is_rms:
        outs = {"rms_norm": reference.rms_norm(x, [n], w, 1e-5)}
    else:
        outs = {"layer_norm": reference.layer_norm(x, [n], w, b, 1e-5)}
    outs["norm_forward"] = reference.norm_forward(x, w, b, 1e-5, is_rms, dtype)[0]
    for name, got in outs.items():
        assert got.dtype == dtype, name
        err = (got.double() - exact).abs()
        bad = err > 0.5 * ulp + 1e-5 * scale
        assert not bad.any(), f"{name}: {int(bad.sum())} elements more than half an ulp off"


@pytest.mark.parametrize("recorded", [False, True], ids=["unrecorded", "recorded"])
def test_layer_norm_of_rows_far_from_zero(recorded):
    """fp32 rows of about 1000 +- 1 (a large common offset): layer_norm and norm_forward take
    the variance around the mean, so the result is as accurate as fp32 holds the input, with
    autograd recording (the TorchScript path, create_graph's recomputation) or not. Against
    PyTorch's layer norm in float64 within 2e-3, about 30 fp32 spacings at 1000; a variance
    taken as mean(x**2) - mean**2 is off by several percent there (R02, R05)."""
    gen = torch.Generator().manual_seed(13)
    x = (1000.0 + torch.randn(6, 45, generator=gen)).requires_grad_(recorded)
    w, b = (t.detach() for t in make_params((45,), torch.float32, "cpu", True))
    want = torch.nn.functional.layer_norm(x.detach().double(), (45,), w.double(), b.double(),
                                          1e-5)
    y1 = reference.layer_norm(x, [45], w, b, 1e-5)
    y2, mean, rstd = reference.norm_forward(x, w, b, 1e-5, False, torch.float32)
    var = x.detach().double().var(-1, unbiased=False)
    for name, got in (("layer_norm", y1), ("norm_forward", y2)):
        torch.testing.assert_close(got.detach().double(), want, rtol=0, atol=2e-3, msg=name)
    torch.testing.assert_close(rstd.detach().double(), (var + 1e-5).rsqrt(), rtol=1e-3, atol=0)


@pytest.mark.parametrize("recorded", [False, True], ids=["unrecorded", "recorded"])
def test_rms_norm_ignores_a_bias_passed_to_the_statistics_interface(recorded):
    """RMSNorm has no bias: norm_forward ignores a bias tensor passed with is_rms (as its
    docstring says, and as the kernels do), and norm_backward from the saved output
    (memory_efficient) recovers x_hat as y / weight without subtracting it, whether autograd
    records the call or not (mixprec::fused_norm_fwd / fused_norm_bwd pass through whatever
    they are given). y, dx and dweight against PyTorch's rms_norm in float64 (R07, R08, R16)."""
    m, n = 9, 24
    x = make_input((m, n), torch.float64, "cpu").requires_grad_(recorded)
    dy = make_input((m, n), torch.float64, "cpu", seed=5)
    w, _ = (t.detach() for t in make_params((n,), torch.float64, "cpu", True))
    bias = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y_ref, dx_ref, dw_ref, _ = float64_reference("rms", x, (n,), w, None, dy)
    y, mean, rstd = reference.norm_forward(x, w, bias, 1e-5, True, torch.float64)
    torch.testing.assert_close(y.detach(), y_ref, rtol=1e-12, atol=1e-12)
    w_in = w.clone().requires_grad_(recorded)
    dx, dw, db = reference.norm_backward(dy, y.detach(), w_in, bias, mean.detach(),
                                         rstd.detach(), True, True, torch.float64, True, True)
    torch.testing.assert_close(dx.detach(), dx_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dw.detach(), dw_ref, rtol=1e-10, atol=1e-10)
    assert db.shape == (0,)


@pytest.mark.parametrize("recorded", [False, True], ids=["unrecorded", "recorded"])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_backward_on_half_rows_computes_in_fp32(kind, param_dtype, recorded):
    """norm_backward on bf16 rows computes in fp32 (the statistics' dtype) whether or not
    autograd records it (create_graph=True records it), and returns dweight / dbias in the
    parameters' own dtypes, as the custom op's fake implementation promises: dx asked for in
    fp32 matches the same formulas evaluated in float64 on the same inputs to fp32 accuracy."""
    is_rms = kind == "rms"
    m, n = 9, 24
    x = make_input((m, n), torch.bfloat16, "cpu")
    dy = make_input((m, n), torch.bfloat16, "cpu", seed=5)
    w, b = (t.detach() for t in make_params((n,), param_dtype, "cpu", True))
    b = None if is_rms else b
    _, mean, rstd = reference.norm_forward(x, w, b, 1e-5, is_rms, torch.bfloat16)
    assert rstd.dtype == torch.float32
    want = reference.norm_backward(
        dy.double(), x.double(), w.double(), None if b is None else b.double(),
        mean.double(), rstd.double(), is_rms, False, torch.float64, True, True)
    w_in = w.clone().requires_grad_(recorded)
    got = reference.norm_backward(dy, x, w_in, b, mean, rstd, is_rms, False, torch.float32,
                                  True, True)
    assert got[0].dtype == torch.float32
    assert got[1].dtype == param_dtype
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-5, atol=1e-5)
    ptol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[param_dtype]
    torch.testing.assert_close(got[1].double(), want[1], rtol=ptol, atol=ptol)
    if not is_rms:
        assert got[2].dtype == param_dtype
        torch.testing.assert_close(got[2].double(), want[2], rtol=ptol, atol=ptol)
