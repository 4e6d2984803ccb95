"""Apex's functional norm API (mixprec.normalization.apex_functional) and its alias layout.

References: PyTorch's own ``layer_norm`` / ``rms_norm`` in float64 with Apex's default eps
(1e-6), on the plain path, the CUDA kernels and the Triton interpreter.
"""

import warnings

import pytest
import torch

import mixprec
from mixprec.normalization import apex_functional as F
from mixprec.normalization import fused_layer_norm as mixprec_fused_layer_norm

from .helpers import KERNEL_DEVICES, device_and_context


def _ln(x, shape, w=None, b=None, eps=1e-6):
    return torch.nn.functional.layer_norm(x.double(), shape, None if w is None else w.double(),
                                          None if b is None else b.double(), eps)


def _rms(x, shape, w=None, eps=1e-6):
    return torch.nn.functional.rms_norm(x.double(), shape, None if w is None else w.double(),
                                        eps)


@KERNEL_DEVICES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apex_signatures_match_pytorch_with_apex_eps(device, dtype):
    device, ctx = device_and_context(device)
    gen = torch.Generator().manual_seed(0)
    # Small activations: Apex's default eps (1e-6) and PyTorch's (1e-5) give visibly
    # different results here, so the default is checked, not only the argument order.
    x = (torch.randn(6, 2, 8, generator=gen) * 3e-3).to(device, dtype)
    w = torch.randn(2, 8, generator=gen).to(device)
    b = torch.randn(2, 8, generator=gen).to(device)
    shape = (2, 8)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    with ctx():
        cases = [
            (F.fused_layer_norm(x, shape), _ln(x, shape), dtype),
            (F.fused_layer_norm(x, shape, 1e-6, True), _ln(x, shape), dtype),
            (F.fused_layer_norm_affine(x, w.to(dtype), b.to(dtype), shape),
             _ln(x, shape, w.to(dtype), b.to(dtype)), dtype),
            (F.mixed_dtype_fused_layer_norm_affine(x, w, b, shape), _ln(x, shape, w, b),
             torch.float32),
            (F.fused_rms_norm(x, shape), _rms(x, shape), dtype),
            (F.fused_rms_norm_affine(x, w.to(dtype), shape), _rms(x, shape, w.to(dtype)), dtype),
            (F.mixed_dtype_fused_rms_norm_affine(x, w, shape), _rms(x, shape, w),
             torch.float32),
            (F.FusedLayerNormAffineFunction.apply(x, w.to(dtype), b.to(dtype), shape, 1e-6),
             _ln(x, shape, w.to(dtype), b.to(dtype)), dtype),
            (F.FusedRMSNormAffineMixedDtypesFunction.apply(x, w, shape, 1e-6),
             _rms(x, shape, w), torch.float32),
            (F.FusedLayerNormFunction.apply(x.reshape(6, 16), 16, 0.5),
             _ln(x.reshape(6, 16), (16,), eps=0.5), dtype),
        ]
    for i, (got, want, out_dtype) in enumerate(cases):
        assert got.dtype == out_dtype, i
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m, i=i: f"case {i}: {m}")
    # The eps default matters at this scale: PyTorch's 1e-5 is far off.
    assert (_ln(x, shape, eps=1e-5) - _ln(x, shape)).abs().max() > 0.05


def test_apex_functional_gradients_match_pytorch():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(12, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(4, 12, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((F.fused_layer_norm_affine(x, w, b, 12) * dy).sum(), (x, w, b))
    want = torch.autograd.grad((_ln(x, (12,), w, b) * dy).sum(), (x, w, b))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10)
    got = torch.autograd.grad((F.fused_rms_norm_affine(x, w, 12) * dy).sum(), (x, w))
    want = torch.autograd.grad((_rms(x, (12,), w) * dy).sum(), (x, w))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10)


def test_jit_trace_has_no_tracer_warnings():
    # Under torch.jit.trace the argument checks would compare traced sizes (TracerWarning:
    # "might cause the trace to be incorrect"); the recorded PyTorch ops check there.
    w = torch.randn(8)
    b = torch.randn(8)

    def fn(x):
        return F.fused_rms_norm_affine(F.fused_layer_norm_affine(x, w, b, 8), w, (8,))

    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(fn, x)
    torch.testing.assert_close(traced(x), _rms(_ln(x, (8,), w, b), (8,), w).float())


def test_bad_input_errors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"mixed_dtype_fused_rms_norm_affine: weight is None"):
        F.mixed_dtype_fused_rms_norm_affine(x, None, 8)
    # Each Apex form names itself, not a sibling (A07), and a number in the weight's place
    # gets no argument-order hint: these forms take Apex's order already (C08).
    for name, call in (
            ("fused_layer_norm_affine", lambda w: F.fused_layer_norm_affine(x, w, None, 8)),
            ("mixed_dtype_fused_layer_norm_affine",
             lambda w: F.mixed_dtype_fused_layer_norm_affine(x, w, None, 8)),
            ("fused_rms_norm_affine", lambda w: F.fused_rms_norm_affine(x, w, 8)),
            ("mixed_dtype_fused_rms_norm_affine",
             lambda w: F.mixed_dtype_fused_rms_norm_affine(x, w, 8))):
        with pytest.raises(ValueError, match=rf"^{name}: weight has shape \(4,\) but "
                                             r"normalized_shape is \(8,\)"):
            call(torch.ones(4))
        with pytest.raises(TypeError) as info:
            call(2.0)
        assert str(info.value) == f"{name}: weight must be a Tensor or None, got float"
    with pytest.raises(TypeError, match="is not instantiated"):
        F.FusedLayerNormAffineFunction()
    # Apex's positional eps given to mixprec's own fused_layer_norm (weight's place): the
    # message says which signature is which and where Apex's lives.
    with pytest.raises(TypeError, match=r"weight must be a Tensor or None, got float\. "
                                        r"mixprec's fused_layer_norm\(x, normalized_shape, "
                                        r"weight, bias, eps\) .*apex_functional\.fused_layer_norm"):
        mixprec_fused_layer_norm(x, (8,), 1e-6)
    with pytest.raises(ValueError, match=r"a 0-dim input has no dims to normalize; it needs "
                                         r"trailing dims \(8,\)"):
        F.fused_layer_norm(torch.tensor(1.0), 8)


def test_argument_order_hint_for_mixprecs_own_rms_norm():
    """mixprec's own fused_rms_norm takes (x, normalized_shape, weight, eps), Apex's takes
    (input, normalized_shape, eps): an Apex-style positional eps given to mixprec's function
    lands in weight's place, and the TypeError says where Apex's form lives, as it does for
    fused_layer_norm. (C05)"""
    from mixprec.normalization import fused_rms_norm as mixprec_fused_rms_norm

    x = torch.randn(2, 8)
    # (and gives fused_rms_norm's own order: it had LayerNorm's, with a bias, r103C R1)
    with pytest.raises(TypeError, match=r"^fused_rms_norm: weight must be a Tensor or None, "
                                        r"got float\. mixprec's fused_rms_norm\(x, "
                                        r"normalized_shape, weight, eps\) follows .*"
                                        r"apex_functional\.fused_rms_norm"):
        mixprec_fused_rms_norm(x, (8,), 1e-6)
    torch.testing.assert_close(F.fused_rms_norm(x, (8,), 1e-6).double(), _rms(x, (8,)),
                               rtol=1e-5, atol=1e-5)


def test_a_non_tensor_weight_or_bias_is_named_without_the_order_hint():
    """The hint about Apex's (input, normalized_shape, eps) order is for a number landing in
    weight's place; a weight of another wrong type (a list of values, a string) gets the plain
    TypeError naming its type, without a hint that would send the user after the wrong
    mistake, and a non-tensor bias is called the bias, not the weight (C02, C03)."""
    from mixprec.normalization import fused_rms_norm as mixprec_fused_rms_norm

    x = torch.randn(2, 8)
    for call, name in ((mixprec_fused_layer_norm, "fused_layer_norm"),
                       (mixprec_fused_rms_norm, "fused_rms_norm")):
        for weight, type_name in (([1.0] * 8, "list"), ("ones", "str")):
            with pytest.raises(TypeError) as info:
                call(x, (8,), weight)
            assert str(info.value) == (f"{name}: weight must be a Tensor or None, got "
                                       f"{type_name}")
    for bias in ([0.0] * 8, "zeros"):
        with pytest.raises(TypeError) as info:
            mixprec_fused_layer_norm(x, (8,), torch.ones(8), bias)
        assert str(info.value) == (f"fused_layer_norm: bias must be a Tensor or None, got "
                                   f"{type(bias).__name__}")


def test_mixed_dtype_layer_norm_affine_without_a_weight_is_a_value_error():
    """The mixed-dtype LayerNorm form takes its output dtype from the weight, so a None weight
    is refused by name with a ValueError (as the RMSNorm form does), not an AttributeError
    from deep inside; code that passes an optional weight through finds its mistake. The
    bias-less call with a weight still works and keeps the weight's dtype. (A03)"""
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(ValueError, match=r"^mixed_dtype_fused_layer_norm_affine: weight is "
                                         r"None; the mixed-dtype form needs a weight tensor"):
        F.mixed_dtype_fused_layer_norm_affine(x, None, None, 8)
    with pytest.raises(ValueError, match=r"^mixed_dtype_fused_layer_norm_affine: weight is None"):
        F.FusedLayerNormAffineMixedDtypesFunction.apply(x, None, torch.zeros(8), 8, 1e-6)
    w = torch.rand(8) + 0.5
    y = F.mixed_dtype_fused_layer_norm_affine(x, w, None, 8)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _ln(x, (8,), w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["fused_rms_norm", "mixed_dtype_fused_rms_norm_affine",
                                  "FusedRMSNormFunction",
                                  "FusedRMSNormAffineMixedDtypesFunction"])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_apex_rms_forms_pass_memory_efficient_on(name, memory_efficient):
    """Apex's RMSNorm forms take memory_efficient positionally after eps: with True the
    output, not the input, is kept for backward (the memory Megatron-style layers ask for),
    with False the input; the gradient matches PyTorch's in float64 either way. (A01, A02)"""
    w = torch.rand(16, dtype=torch.float64) + 0.5
    args = {"fused_rms_norm": (16,), "FusedRMSNormFunction": (16,),
            "mixed_dtype_fused_rms_norm_affine": (w, 16),
            "FusedRMSNormAffineMixedDtypesFunction": (w, 16)}[name]
    fn = getattr(F, name)
    fn = fn.apply if name[0].isupper() else fn
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x, *args, 1e-6, memory_efficient)
    assert (y.data_ptr() in saved) == memory_efficient
    assert (x.data_ptr() in saved) != memory_efficient
    dy = torch.randn(4, 16, dtype=torch.float64)
    got = torch.autograd.grad((y * dy).sum(), x)[0]
    want = torch.autograd.grad((_rms(x, (16,), w if len(args) == 2 else None) * dy).sum(), x)[0]
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-8)


def test_function_classes_pickle_by_reference():
    """Apex's autograd-function names are importable classes of this module: they pickle by
    reference and come back as the same class (a torch.fx graph or a config holding one is
    sent to worker processes with pickle). (A06)"""
    import pickle

    for name in F.__all__:
        if name.endswith("Function"):
            cls = getattr(F, name)
            assert cls.__module__ == "mixprec.normalization.apex_functional", name
            assert pickle.loads(pickle.dumps(cls)) is cls, name


def test_function_classes_show_apexs_forward_signature():
    # Megatron-LM's layer norm probes
    # inspect.getfullargspec(FusedLayerNormAffineFunction.forward).args for
    # "memory_efficient" in every forward, then calls apply: the classes had no forward
    # (AttributeError on the first forward of every such model).
    import inspect

    want = {
        "FusedLayerNormFunction": ["ctx", "input", "normalized_shape", "eps",
                                   "memory_efficient"],
        "FusedLayerNormAffineFunction": ["ctx", "input", "weight", "bias", "normalized_shape",
                                         "eps", "memory_efficient"],
        "FusedLayerNormAffineMixedDtypesFunction": ["ctx", "input", "weight", "bias",
                                                    "normalized_shape", "eps",
                                                    "memory_efficient"],
        "FusedRMSNormFunction": ["ctx", "input", "normalized_shape", "eps", "memory_efficient"],
        "FusedRMSNormAffineFunction": ["ctx", "input", "weight", "normalized_shape", "eps",
                                       "memory_efficient"],
        "FusedRMSNormAffineMixedDtypesFunction": ["ctx", "input", "weight", "normalized_shape",
                                                  "eps", "memory_efficient"],
    }
    for name, args in want.items():
        spec = inspect.getfullargspec(getattr(F, name).forward)
        assert spec.args == args, name
        assert spec.defaults == (False,), name  # (eps required, as in Apex's forward)
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    torch.testing.assert_close(F.FusedLayerNormAffineFunction.forward(None, x, w, b, (8,), 1e-6),
                               F.FusedLayerNormAffineFunction.apply(x, w, b, (8,), 1e-6),
                               rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"FusedRMSNormFunction\.backward is not called "
                                           r"directly.*apply"):
        F.FusedRMSNormFunction.backward(None, x)


def test_alias_layout_is_apex_s(clean_apex):
    mixprec.install_apex_alias()
    import apex.normalization
    import apex.normalization.fused_layer_norm as fln
    from apex.normalization import FusedLayerNormAffineFunction, MixedFusedLayerNorm
    from apex.normalization.fused_layer_norm import fused_layer_norm, fused_rms_norm_affine

    # Both import forms bind the submodule (it was once the package's fused_layer_norm
    # function, so `fln.FusedLayerNorm` raised AttributeError).
    assert fln is F and apex.normalization.fused_layer_norm is F
    assert fln.FusedLayerNorm is mixprec.normalization.FusedLayerNorm
    assert apex.normalization.fused_layer_norm.MixedFusedLayerNorm is MixedFusedLayerNorm
    assert fused_layer_norm is F.fused_layer_norm and fused_rms_norm_affine is F.fused_rms_norm_affine
    assert FusedLayerNormAffineFunction is F.FusedLayerNormAffineFunction
    assert apex.normalization.FusedBatchNorm is mixprec.normalization.FusedBatchNorm
    # mixprec's own functions (torch.nn.functional's argument order) are not in Apex's
    # namespace, where those names have Apex's signatures.
    assert not hasattr(apex.normalization, "fused_rms_norm")


def test_each_function_class_applies_its_own_function():
    """Each Apex autograd-function name computes its own function, with its output dtype
    (the input's, or the weight's for the MixedDtypes classes), and apply passes keyword
    arguments on: Megatron-style layers call FusedLayerNormAffineFunction.apply and its
    siblings directly and rely on the output dtype matching the module they replace. A bf16
    input with an fp32 weight tells the mixed and plain forms apart (the plain forms keep the
    input's dtype, as documented, whatever the weight's). (A22, A23, A25, A4, A10)"""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 8, generator=gen).bfloat16()
    w = torch.randn(8, generator=gen) + 2.0
    b = torch.randn(8, generator=gen)
    cases = {
        "FusedLayerNormFunction": ((x, 8, 1e-6), F.fused_layer_norm, torch.bfloat16),
        "FusedLayerNormAffineFunction": ((x, w, b, 8, 1e-6), F.fused_layer_norm_affine,
                                         torch.bfloat16),
        "FusedLayerNormAffineMixedDtypesFunction": (
            (x, w, b, 8, 1e-6), F.mixed_dtype_fused_layer_norm_affine, torch.float32),
        "FusedRMSNormFunction": ((x, 8, 1e-6), F.fused_rms_norm, torch.bfloat16),
        "FusedRMSNormAffineFunction": ((x, w, 8, 1e-6), F.fused_rms_norm_affine, torch.bfloat16),
        "FusedRMSNormAffineMixedDtypesFunction": (
            (x, w, 8, 1e-6), F.mixed_dtype_fused_rms_norm_affine, torch.float32),
    }
    for name, (args, fn, out_dtype) in cases.items():
        got = getattr(F, name).apply(*args)
        assert got.dtype == out_dtype, name
        torch.testing.assert_close(got, fn(*args), rtol=0, atol=0, msg=name)
    # Keywords reach the function: memory_efficient=True keeps the output for backward.
    saved = []
    xg = x.float().requires_grad_()

    def pack(t):
        saved.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = F.FusedLayerNormAffineFunction.apply(xg, w, b, 8, 1e-6, memory_efficient=True)
    assert y.data_ptr() in saved and xg.data_ptr() not in saved


def test_jit_trace_of_a_mixed_dtype_functional_keeps_the_weight_dtype():
    """A traced model keeps the mixed-dtype forms' dtype rule: the output takes the weight's
    dtype (fp32 here) even for a bf16 input, as eagerly; a served trace whose norm output
    turned bf16 would feed its next fp32 layer the wrong dtype. (A7)"""
    w = torch.randn(8) + 2.0
    b = torch.randn(8)

    def fn(x):
        return (F.mixed_dtype_fused_layer_norm_affine(x, w, b, 8),
                F.mixed_dtype_fused_rms_norm_affine(x, w, 8))

    x = torch.randn(3, 8).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(fn, x)
    got_ln, got_rms = traced(x)
    assert got_ln.dtype == torch.float32 and got_rms.dtype == torch.float32
    torch.testing.assert_close(got_ln.double(), _ln(x, (8,), w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_rms.double(), _rms(x, (8,), w), rtol=1e-5, atol=1e-5)
