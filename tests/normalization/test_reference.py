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
