"""The API around the kernels: errors, repr, state dicts, TorchScript, torch.compile, autocast."""

import contextlib
import copy
import subprocess
import sys
import warnings

import pytest
import torch

from mixprec.normalization import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
    _launch,
    _ops,
    apex_functional,
    fused_layer_norm,
    fused_rms_norm,
    reference,
)

from .helpers import (
    DEVICES,
    KERNEL_DEVICES,
    device_and_context,
    float64_reference,
    make_input,
    make_params,
    requires_interpreter,
    tolerance,
)


@pytest.mark.parametrize(
    "call",
    [
        lambda: fused_layer_norm(torch.randn(2, 3, 5), 4),
        lambda: fused_layer_norm(torch.randn(2, 3, 5), (3, 4)),
        lambda: fused_rms_norm(torch.randn(5), (2, 5)),
        lambda: FusedLayerNorm(4)(torch.randn(2, 5)),
        lambda: MixedFusedRMSNorm((3, 5))(torch.randn(2, 5, 3)),
    ],
    ids=["int", "tuple", "too-few-dims", "module", "mixed-module"],
)
def test_mismatched_trailing_shape_is_a_value_error(call):
    with pytest.raises(ValueError, match="does not end with normalized_shape"):
        call()


def test_mismatch_hint_suggests_as_many_trailing_dims_as_normalized_shape_has():
    # (4, 8) on a (3, 5, 8) input: the hint is the input's last two dims, not its last one.
    with pytest.raises(ValueError, match=r"normalized_shape \(e\.g\. \(5, 8\)\)"):
        FusedLayerNorm((4, 8))(torch.randn(3, 5, 8))
    with pytest.raises(ValueError, match=r"normalized_shape \(e\.g\. \(5,\)\)"):
        fused_rms_norm(torch.randn(5), (2, 5))  # fewer dims than normalized_shape: all of them
    with pytest.raises(ValueError, match=r"input of shape \(3, 4\) does not end with "
                                         r"normalized_shape \(2, 3, 4\); pass the input's last "
                                         r"dims as normalized_shape \(e\.g\. \(3, 4\)\)"):
        FusedLayerNorm((2, 3, 4))(torch.randn(3, 4))  # (all of a 2-D input's dims, C18)


def test_other_argument_errors():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="weight has shape"):
        fused_layer_norm(x, 4, torch.ones(5))
    with pytest.raises(ValueError, match="bias has shape"):
        fused_layer_norm(x, 4, torch.ones(4), torch.zeros(3))
    # The right number of elements in another shape (a transposed checkpoint tensor) would
    # scale the wrong positions: refused by name, as torch.nn.functional.layer_norm does. (C16)
    x3 = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match=r"fused_layer_norm: weight has shape \(4, 2\) but "
                                         r"normalized_shape is \(2, 4\); they must be equal"):
        fused_layer_norm(x3, (2, 4), torch.ones(4, 2), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"fused_layer_norm: bias has shape \(4, 2\)"):
        fused_layer_norm(x3, (2, 4), torch.ones(2, 4), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"fused_rms_norm: weight has shape \(4, 2\)"):
        fused_rms_norm(x3, (2, 4), torch.ones(4, 2))
    with pytest.raises(TypeError, match="input dtype torch.int64"):
        fused_rms_norm(torch.ones(2, 4, dtype=torch.long), 4)
    # float8 inputs too (the documented types are fp32, fp16, bf16, fp64), from the functions
    # and the modules alike. (C17)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for call, name in ((lambda t: fused_layer_norm(t, 4), "fused_layer_norm"),
                           (lambda t: fused_rms_norm(t, 4), "fused_rms_norm"),
                           (FusedLayerNorm(4), "FusedLayerNorm"),
                           (MixedFusedRMSNorm(4), "MixedFusedRMSNorm")):
            with pytest.raises(TypeError, match=rf"{name}: input dtype {dtype} is not supported"):
                call(x.to(dtype))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        fused_layer_norm([[1.0, 2.0]], 2)
    for module in (FusedLayerNorm(2), FusedRMSNorm(2), FusedLayerNorm(2, elementwise_affine=False)):
        # (the modules read the input's dtype first: an AttributeError about a list's dtype)
        with pytest.raises(TypeError, match=f"{type(module).__name__}: input must be a torch"):
            module([[1.0, 2.0]])
    with pytest.raises(TypeError, match="normalized_shape must be an int"):
        FusedLayerNorm("4")
    with pytest.raises(ValueError, match="eps must be a non-negative"):
        FusedRMSNorm(4, eps=-1.0)
    with pytest.raises(ValueError, match="eps must be a non-negative"):
        fused_layer_norm(x, 4, eps=-1e-5)


def test_eps_takes_any_finite_non_negative_real():
    # NumPy scalars (a config read with NumPy) work in the functions as in the modules and in
    # torch.nn.functional.layer_norm; bools, non-finite and negative values do not.
    import numpy as np

    x = torch.randn(3, 8)
    want = torch.nn.functional.layer_norm(x, (8,), eps=1e-3)
    want_rms = torch.nn.functional.rms_norm(x, (8,), eps=1e-3)
    for eps in (np.float32(1e-3), np.float64(1e-3), 1e-3):
        for got in (fused_layer_norm(x, 8, eps=eps), apex_functional.fused_layer_norm(x, 8, eps),
                    FusedLayerNorm(8, eps)(x)):
            torch.testing.assert_close(got, want)
        for got in (fused_rms_norm(x, 8, eps=eps), apex_functional.fused_rms_norm(x, 8, eps),
                    FusedRMSNorm(8, eps)(x)):
            torch.testing.assert_close(got, want_rms)
    assert fused_layer_norm(x, 8, eps=np.int64(0)).shape == x.shape
    assert FusedLayerNorm(8, eps=np.float32(1e-3)).eps == float(np.float32(1e-3))
    for bad in (True, float("nan"), float("inf"), -1e-5, np.float32(-1), None, "1e-5",
                torch.tensor(1e-5), 10**400):
        with pytest.raises(ValueError, match=r"fused_layer_norm: eps must be a non-negative"):
            fused_layer_norm(x, 8, eps=bad)
        with pytest.raises(ValueError, match=r"fused_rms_norm: eps must be a non-negative"):
            apex_functional.fused_rms_norm(x, 8, bad)
        with pytest.raises(ValueError, match=r"FusedLayerNorm: eps must be a non-negative"):
            FusedLayerNorm(8, eps=bad)


def test_extra_repr_and_parameters():
    assert repr(FusedLayerNorm(8)) == (
        "FusedLayerNorm((8,), eps=1e-05, elementwise_affine=True, memory_efficient=False)"
    )
    assert "memory_efficient=True" in repr(MixedFusedRMSNorm((2, 3), memory_efficient=True))
    assert [n for n, _ in FusedLayerNorm(8).named_parameters()] == ["weight", "bias"]
    assert [n for n, _ in FusedRMSNorm(8).named_parameters()] == ["weight"]
    assert list(FusedLayerNorm(8, elementwise_affine=False).parameters()) == []
    assert FusedRMSNorm(8, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    assert MixedFusedLayerNorm(8).weight.dtype == torch.float32


def test_state_dict_is_interchangeable_with_torch_layer_norm():
    native = torch.nn.LayerNorm((3, 4))
    with torch.no_grad():
        native.weight.uniform_()
        native.bias.uniform_()
    ours = FusedLayerNorm((3, 4))
    ours.load_state_dict(native.state_dict())
    x = torch.randn(5, 3, 4)
    torch.testing.assert_close(ours(x), native(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm,
                                 MixedFusedRMSNorm])
def test_torchscript_falls_back_to_the_reference(cls):
    # (eps=0.5, far from the default: the scripted path must use the module's own, F01/F02)
    norm = cls((4, 6), eps=0.5)
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(0.5, 1.5)
    scripted = torch.jit.script(norm)
    x = torch.randn(3, 4, 6, dtype=torch.bfloat16)
    y, y_scripted = norm(x), scripted(x)
    assert y_scripted.dtype == y.dtype
    torch.testing.assert_close(y_scripted, y, **tolerance(y.dtype))


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_torchscript_checks_the_input_as_eager_does(cls):
    # The scripted path normalized over the input's own last dims (a (2, 7) input under
    # normalized_shape 8), truncated integer inputs and normalized a 0-dim one, silently.
    scripted = torch.jit.script(cls(8, elementwise_affine=False))
    for x, match in ((torch.randn(2, 7), r"input of shape \[2, 7\] does not end with "
                      r"normalized_shape \[8\]"),
                     (torch.randn(()), r"does not end with normalized_shape"),
                     (torch.ones(2, 8, dtype=torch.int64), r"TypeError: the input must be "
                      r"floating point")):
        with pytest.raises(torch.jit.Error, match=match):
            scripted(x)
    two = torch.jit.script(cls((4, 8), elementwise_affine=False))
    with pytest.raises(torch.jit.Error, match=r"does not end with normalized_shape \[4, 8\]"):
        two(torch.randn(3, 8))


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_torchscript_takes_an_input_of_exactly_the_normalized_shape(cls):
    # An input with no leading dims (a single (4, 6) sample under normalized_shape (4, 6), a
    # single vector under 8) is valid in eager mode as in torch.nn.LayerNorm; the scripted
    # module's input check must accept it too and give the eager result.
    for shape in ((4, 6), 8):
        norm = cls(shape)
        with torch.no_grad():
            for p in norm.parameters():
                p.uniform_(0.5, 1.5)
        x = torch.randn(norm.normalized_shape)
        torch.testing.assert_close(torch.jit.script(norm)(x), norm(x), **tolerance(x.dtype))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.ln = FusedLayerNorm(16, memory_efficient=True)
        self.rms = FusedRMSNorm(16)
        self.mixed = MixedFusedLayerNorm(16)

    def forward(self, x):
        h = self.ln(self.proj(x))
        h = self.rms(h) + h
        return self.mixed(h) + torch.nn.functional.layer_norm(h, (16,))


def test_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(3, 5, 16, requires_grad=True)
    eager = block(x)
    eager.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for got, want in zip([x.grad] + [p.grad for p in block.parameters()], grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_compile_fullgraph_dynamic_shapes_matches_eager():
    # dynamic=True makes the modules' float eps a symbolic input, which the eps check's
    # math.isfinite could not trace: fullgraph=True raised (a graph break without it).
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = _Block()
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (3, 2):
        x = torch.randn(rows, 5, 16)
        torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


class _TwoDimNorms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.rms = FusedLayerNorm((2, 8)), FusedRMSNorm((2, 8))

    def forward(self, x):
        return self.ln(x) + self.rms(x).square()


def test_compile_fullgraph_of_a_two_dim_normalized_shape_matches_pytorch():
    """Under torch.compile the norms take their parameters of a multi-dim normalized_shape
    ((2, 8): a weight and bias of that shape, as torch.nn.LayerNorm's) and give the output
    and gradients of PyTorch's norms. Against F.layer_norm / F.rms_norm (D29)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    model = _TwoDimNorms()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5, generator=gen)
    x = torch.randn(3, 2, 8, generator=gen, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    got = torch.autograd.grad(out.sum(), [x, *model.parameters()])
    f = torch.nn.functional
    want_out = (f.layer_norm(x, (2, 8), model.ln.weight, model.ln.bias)
                + f.rms_norm(x, (2, 8), model.rms.weight, model.rms.eps).square())
    want = torch.autograd.grad(want_out.sum(), [x, *model.parameters()])
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_compile_fullgraph_of_torch_func_matches_eager(transform):
    # Whether a torch.func transform is active is read when Dynamo traces the call (torch
    # 2.4's Dynamo had no rule for the check: fullgraph=True raised, even with no transform).
    # Against the eager transform of torch.nn.LayerNorm.
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 5, 8, generator=gen)
    fused, ref = FusedLayerNorm(8), torch.nn.LayerNorm(8)
    with torch.no_grad():
        fused.weight.uniform_(0.5, 1.5, generator=gen)
        fused.bias.normal_(generator=gen)
        ref.load_state_dict(fused.state_dict())

    def transformed(norm):
        if transform == "grad":
            return torch.func.grad(lambda t: norm(t).tanh().sum())
        return torch.func.vmap(lambda t: norm(t))  # (torch 2.4's Dynamo: no module here)

    got = torch.compile(transformed(fused), fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, transformed(ref)(x), atol=1e-5, rtol=1e-5)


def test_custom_ops_pass_opcheck():
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("requires torch.library.opcheck")
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    fwd = torch.ops.mixprec.fused_norm_fwd.default
    torch.library.opcheck(fwd, (x, w, b, 1e-5, False, False, torch.float32))
    torch.library.opcheck(fwd, (x, w, None, 1e-5, True, True, torch.float32))
    torch.library.opcheck(fwd, (x.detach().bfloat16(), w, b, 1e-5, False, True, torch.float32))
    y, mean, rstd = fwd(x.detach(), w.detach(), b.detach(), 1e-5, False, False, torch.float32)
    torch.library.opcheck(
        torch.ops.mixprec.fused_norm_bwd.default,
        (torch.randn(6, 8), x.detach(), w.detach(), b.detach(), mean, rstd, False, False,
         torch.float32, True, False),
    )
    # float64 runs the PyTorch path in float64, statistics included, as the fake promises. (O15)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    for is_rms in (False, True):
        torch.library.opcheck(fwd, (x64, w64, None, 1e-5, is_rms, False, torch.float64))
        _, mean, rstd = fwd(x64.detach(), w64.detach(), None, 1e-5, is_rms, False,
                            torch.float64)
        assert mean.dtype == rstd.dtype == torch.float64


@pytest.mark.parametrize("param_dtype", [torch.bfloat16], ids=str)  # (fp16: the same code)
def test_backward_op_passes_opcheck_with_half_parameters(param_dtype):
    """A model cast to half precision reaches torch.compile's backward graph with half
    weight and bias: the backward op's fake implementation must promise their gradients in
    the parameters' dtype, as the op computes them, or the compiled graph is planned for
    other dtypes than it receives. opcheck compares the two; the dtypes checked directly too
    (D33)."""
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("requires torch.library.opcheck")
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(6, 8, generator=gen).to(param_dtype)
    w = (torch.rand(8, generator=gen) + 0.5).to(param_dtype)
    b = torch.randn(8, generator=gen).to(param_dtype)
    dy = torch.randn(6, 8, generator=gen).to(param_dtype)
    _, mean, rstd = torch.ops.mixprec.fused_norm_fwd(x, w, b, 1e-5, False, False, param_dtype)
    args = (dy, x, w, b, mean, rstd, False, False, param_dtype, True, True)
    torch.library.opcheck(torch.ops.mixprec.fused_norm_bwd.default, args)
    dx, dw, db = torch.ops.mixprec.fused_norm_bwd(*args)
    assert dx.dtype == dw.dtype == db.dtype == param_dtype


@KERNEL_DEVICES
def test_rms_backward_op_gives_no_bias_gradient_on_any_path(device):
    """An RMSNorm has no bias: mixprec::fused_norm_bwd returns an empty [0] dbias for it even
    when a bias tensor is passed, on the PyTorch path as on the kernels, which is what its fake
    implementation promises torch.compile (O16)."""
    device, kernels_on_cpu = device_and_context(device)
    x, w, b = (torch.randn(6, 8, device=device), torch.rand(8, device=device) + 0.5,
               torch.randn(8, device=device))
    dy = torch.randn(6, 8, device=device)
    with kernels_on_cpu():
        _, mean, rstd = torch.ops.mixprec.fused_norm_fwd(x, w, None, 1e-5, True, False,
                                                         torch.float32)
        args = (dy, x, w, b, mean, rstd, True, False, torch.float32, True, True)
        dx, dw, db = torch.ops.mixprec.fused_norm_bwd(*args)
    assert db.shape == (0,)
    want = float64_reference("rms", x, (8,), w, None, dy)
    torch.testing.assert_close(dx.double(), want[1], atol=1e-5, rtol=1e-5)
    if hasattr(torch.library, "opcheck") and device == "cpu":
        torch.library.opcheck(torch.ops.mixprec.fused_norm_bwd.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_dtype_under_autocast(device):
    # Not on autocast's lists: the output dtype follows the module's rule, autocast or not.
    # (torch.nn.LayerNorm would return fp32 under autocast.)
    half = torch.bfloat16
    ln = FusedLayerNorm(32).to(device)
    rms = FusedRMSNorm(32).to(device)
    mixed = MixedFusedLayerNorm(32).to(device)
    x32 = make_input((4, 32), torch.float32, device)
    x16 = x32.to(half)
    with torch.autocast(device_type=device, dtype=half):
        out = {
            "ln32": ln(x32), "ln16": ln(x16), "rms16": rms(x16), "mixed16": mixed(x16),
            "after_linear": ln(torch.nn.functional.linear(x32, torch.eye(32, device=device))),
        }
    assert out["ln32"].dtype == torch.float32
    assert out["ln16"].dtype == half
    assert out["rms16"].dtype == half
    assert out["mixed16"].dtype == torch.float32
    assert out["after_linear"].dtype == half  # autocast's linear gave bf16
    torch.testing.assert_close(
        out["ln16"].double(), reference.layer_norm(x16.double(), [32]), **tolerance(half)
    )
    torch.testing.assert_close(
        out["mixed16"].double(), reference.layer_norm(x16.double(), [32]),
        **tolerance(torch.float32),
    )


def test_backward_under_autocast_matches_reference():
    x = make_input((6, 24), torch.bfloat16, "cpu").requires_grad_(True)
    w, b = make_params((24,), torch.float32, "cpu", True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        y = fused_layer_norm(x, 24, w, b)
    dy = torch.randn(6, 24).to(torch.bfloat16)
    y.backward(dy)
    _, dx_ref, dw_ref, db_ref = float64_reference("layer", x, (24,), w, b, dy)
    torch.testing.assert_close(x.grad.double(), dx_ref, **tolerance(torch.bfloat16))
    torch.testing.assert_close(w.grad.double(), dw_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.grad.double(), db_ref, atol=1e-4, rtol=1e-4)


def test_import_and_cpu_path_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, mixprec\n"
        "from mixprec.normalization import FusedLayerNorm, _launch\n"
        "assert not _launch.triton_available()\n"
        "x = torch.randn(3, 8, requires_grad=True)\n"
        "FusedLayerNorm(8)(x).sum().backward()\n"
        "assert 'mixprec.normalization._kernels' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_memory_efficient_saves_the_output_not_the_input(cls, memory_efficient, device):
    saved = []

    def pack(t):
        saved.append(t.data_ptr())
        return t

    norm = cls(64, memory_efficient=memory_efficient).to(device)
    x = torch.randn(8, 64, device=device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = norm(x)
    assert (y.data_ptr() in saved) == memory_efficient
    assert (x.data_ptr() in saved) != memory_efficient
    y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,normalized", [((2, 3, 16), (16,)), ((2, 3, 4, 8), (4, 8))])
def test_one_autograd_node_per_call(device, shape, normalized):
    # Every reshape happens inside the op: the graph goes straight from the norm's node to the
    # leaves (views added a node each, and host time per call, before).
    norm = FusedLayerNorm(normalized).to(device)
    x = torch.randn(*shape, device=device, requires_grad=True)
    y = norm(x)
    assert y.shape == x.shape and y.grad_fn is not None
    leaves = [fn for fn, _ in y.grad_fn.next_functions if fn is not None]
    assert [type(fn).__name__ for fn in leaves] == ["AccumulateGrad"] * 3
    assert {id(fn.variable) for fn in leaves} == {id(x), id(norm.weight), id(norm.bias)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_in_place_ops_on_the_output(device, memory_efficient):
    # The output is a fresh tensor, not a view made inside the op, so an in-place ReLU after
    # the norm is allowed; the gradients then equal those of the out-of-place graph.
    x = torch.randn(4, 6, 32, device=device, requires_grad=True)
    norm = FusedRMSNorm(32, memory_efficient=memory_efficient).to(device)
    if memory_efficient:
        # y itself is saved for backward: changing it in place must be caught, not used.
        y = norm(x)
        y.relu_()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        return
    norm(x).relu_().square().sum().backward()
    got = (x.grad.clone(), norm.weight.grad.clone())
    x.grad = norm.weight.grad = None
    norm(x).relu().square().sum().backward()
    torch.testing.assert_close(got[0], x.grad, rtol=0, atol=0)
    torch.testing.assert_close(got[1], norm.weight.grad, rtol=0, atol=0)


# -- eps, and torch's arguments ----------------------------------------------------------------
def _eps_case(kind, eps, device, triton):
    """A small-variance input (variance ~1e-6) where eps dominates: the result depends on it."""
    from mixprec.normalization import _ops

    torch.manual_seed(3)
    x = (1e-3 * torch.randn(6, 40, dtype=torch.float64)).float().to(device).requires_grad_()
    w = (1 + 0.1 * torch.randn(40)).to(device).requires_grad_()
    b = (0.1 * torch.randn(40)).to(device).requires_grad_()
    dy = torch.randn(6, 40, device=device)
    module = (FusedLayerNorm(40, eps=eps) if kind == "layer" else FusedRMSNorm(40, eps=eps))
    module = module.to(device)
    with torch.no_grad():
        module.weight.copy_(w)
        if kind == "layer":
            module.bias.copy_(b)
    with _ops.triton_on_cpu() if triton else torch.enable_grad():
        y = module(x)
        y.backward(dy)
    # Reference: PyTorch's own functions in float64.
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    if kind == "layer":
        ref = torch.nn.functional.layer_norm(x64, [40], w64, b64, eps)
    else:
        ref = torch.nn.functional.rms_norm(x64, [40], w64, eps)
    ref.backward(dy.double())
    tol = dict(rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(y.double(), ref.detach(), **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2e-4, atol=1e-2)
    torch.testing.assert_close(module.weight.grad.double(), w64.grad, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eps", [0.0, 1e-5, 1e-3, 1.0])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_eps_is_honoured(kind, eps, device):
    if eps == 0.0 and kind == "layer":
        eps = 1e-12  # (a variance of exactly 0 is not in this input; keep the case finite)
    _eps_case(kind, eps, device, triton=False)


@requires_interpreter
@pytest.mark.parametrize("eps", [1e-5, 1e-3, 1.0])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_eps_is_honoured_by_the_kernels(kind, eps):
    _eps_case(kind, eps, "cpu", triton=True)


def _ulp(exact, dtype):
    """Spacing of ``dtype``'s numbers at the magnitude of each element of float64 ``exact``."""
    _, e = torch.frexp(exact.abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(exact), e - 1) * torch.finfo(dtype).eps


def _assert_rounded_once(got, exact, scale, name):
    """Each element of ``got`` is ``exact`` (float64) correctly rounded to ``got.dtype``: at
    most half an ulp away, plus fp32 arithmetic slack (1e-5 of ``scale``, the magnitude of
    the terms summed), which only matters where the exact value is nearly a tie."""
    err = (got.detach().double() - exact).abs()
    bad = err > 0.5 * _ulp(exact, got.dtype) + 1e-5 * scale
    worst = float((err / _ulp(exact, got.dtype)).max())
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.numel()} elements more than half "
                           f"an ulp of {got.dtype} from the exact value (worst {worst:.2f} ulp)")


@KERNEL_DEVICES
@pytest.mark.parametrize("param_dtype", ["input", torch.float32],
                         ids=["half-params", "fp32-params"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_half_results_are_rounded_once_from_fp32(kind, dtype, param_dtype, device):
    """Half-precision outputs and gradients are computed in fp32 and rounded once, as
    documented ("the result is cast once, on the way out"): y, dx, dweight and dbias are each
    the float64 value of the same (rounded) inputs correctly rounded to their dtype, to half
    an ulp. Users rely on this to get the same numbers as PyTorch's own norms, which also
    round once; an intermediate rounding (x_hat, weight * dy, a bias or a partial sum in half)
    costs up to a whole ulp and stays inside the bf16 tolerance of the float64 comparisons.
    Half parameters (a model cast with .half()) and fp32 ones (fp32 master norm weights with
    half activations) (R03, K02, K03, K04, K06, K07, K10)."""
    if device == "cpu-triton" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter truncates fp32 -> bf16 casts (GPUs round to nearest "
                    "even), so its bf16 results are not correctly rounded; fp16 covers it here")
    device, context = device_and_context(device)
    param_dtype = dtype if param_dtype == "input" else param_dtype
    is_rms = kind == "rms"
    m, n = 74, 45  # (on the kernels: 16-row tiles over 3 programs, whose partial sums add up)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(m, n, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)
    dy = torch.randn(m, n, generator=gen).to(device=device, dtype=dtype)
    w = (1 + 0.2 * torch.randn(n, generator=gen)).to(device=device, dtype=param_dtype)
    b = (0.2 * torch.randn(n, generator=gen)).to(device=device, dtype=param_dtype)
    w.requires_grad_(True)
    b = None if is_rms else b.requires_grad_(True)
    with context():
        y = fused_rms_norm(x, n, w) if is_rms else fused_layer_norm(x, n, w, b)
        y.backward(dy)
    # The norm's formulas in float64 on the same inputs.
    x64, dy64, w64 = x.detach().double(), dy.double(), w.detach().double()
    b64 = 0.0 if is_rms else b.detach().double()
    xc = x64 if is_rms else x64 - x64.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + 1e-5)
    x_hat = xc * rstd
    wdy = dy64 * w64
    c1 = (x_hat * wdy).mean(-1, keepdim=True)
    c2 = 0.0 if is_rms else wdy.mean(-1, keepdim=True)
    assert y.dtype == x.grad.dtype == dtype and w.grad.dtype == param_dtype
    _assert_rounded_once(y, x_hat * w64 + b64, (x_hat * w64).abs() + abs(b64), "y")
    _assert_rounded_once(x.grad, rstd * (wdy - c2 - x_hat * c1),
                         rstd * (wdy.abs() + abs(c2) + (x_hat * c1).abs()), "dx")
    _assert_rounded_once(w.grad, (dy64 * x_hat).sum(0), (dy64 * x_hat).abs().sum(0), "dweight")
    if not is_rms:
        _assert_rounded_once(b.grad, dy64.sum(0), dy64.abs().sum(0), "dbias")


@KERNEL_DEVICES
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save_x", "save_y"])
def test_layer_norm_of_rows_far_from_zero(memory_efficient, device):
    """Rows whose mean is far larger than their spread (activations with a large common
    offset, about 1000 +- 1 here) are normalized as accurately as fp32 holds the input: the
    variance is taken around the mean, not as mean(x**2) - mean**2, which cancels to a few
    percent here. y, dx, dweight and dbias against PyTorch's layer norm in float64 within
    2e-3, about 30 fp32 spacings at 1000 (the error of the fp32 mean) (K01)."""
    device, context = device_and_context(device)
    gen = torch.Generator().manual_seed(13)
    x = (1000.0 + torch.randn(6, 45, generator=gen)).to(device).requires_grad_(True)
    dy = torch.randn(6, 45, generator=gen).to(device)
    w = (1 + 0.2 * torch.randn(45, generator=gen)).to(device).requires_grad_(True)
    b = (0.2 * torch.randn(45, generator=gen)).to(device).requires_grad_(True)
    with context():
        y = fused_layer_norm(x, 45, w, b, memory_efficient=memory_efficient)
        y.backward(dy)
    want = float64_reference("layer", x, (45,), w, b, dy)
    for name, got, ref in zip(("y", "dx", "dweight", "dbias"), (y, x.grad, w.grad, b.grad), want):
        torch.testing.assert_close(got.detach().double(), ref, rtol=0, atol=2e-3, msg=name)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_zero_sized_normalized_shape_is_empty_as_in_torch(kind):
    x = torch.randn(3, 0, requires_grad=True)
    module = FusedLayerNorm(0) if kind == "layer" else FusedRMSNorm((0,))
    y = module(x)
    assert y.shape == (3, 0) and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == (3, 0) and module.weight.grad.shape == (0,)
    y = (fused_layer_norm if kind == "layer" else fused_rms_norm)(torch.randn(5, 2, 0), (2, 0))
    assert y.shape == (5, 2, 0)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_compile_of_a_zero_sized_normalized_shape_is_empty_as_in_torch(kind):
    """Under torch.compile, as eagerly, a zero in normalized_shape gives the empty result
    PyTorch's norms give (a model whose width is configured to 0 in a test or an ablation
    compiles). Against F.layer_norm / F.rms_norm's shape and dtype (D48)."""
    torch._dynamo.reset()
    fused = fused_layer_norm if kind == "layer" else fused_rms_norm
    ref = torch.nn.functional.layer_norm if kind == "layer" else torch.nn.functional.rms_norm
    x = torch.randn(5, 2, 0)
    compiled = torch.compile(lambda t: fused(t, (2, 0)), fullgraph=True, backend="aot_eager")
    got, want = compiled(x), ref(x, (2, 0))
    assert got.shape == want.shape == (5, 2, 0) and got.dtype == want.dtype
    torch._dynamo.reset()


_KERNEL_DEVICES = [
    pytest.param("cpu", marks=requires_interpreter, id="interpreter"),
    pytest.param("cuda", marks=DEVICES[1].marks, id="cuda"),
]


@pytest.mark.parametrize("device", _KERNEL_DEVICES)
@pytest.mark.parametrize("dy_kind", ["sum", "dense"])
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_zero_rows_through_the_kernels_as_in_torch(kind, shape, dy_kind, device):
    # An empty batch (an MoE expert that got no tokens) on the kernels' path: y.sum()'s
    # gradient is an expanded empty tensor whose (0, 0) strides .contiguous() keeps; the
    # backward once refused it for its column stride. Compared with PyTorch's own modules.
    torch.manual_seed(0)
    ours = (FusedLayerNorm(8) if kind == "layer" else FusedRMSNorm(8)).to(device)
    theirs = (torch.nn.LayerNorm(8) if kind == "layer" else torch.nn.RMSNorm(8)).to(device)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    results = []
    for module in (ours, theirs):
        x = torch.randn(*shape, device=device, requires_grad=True)
        with _ops.triton_on_cpu() if device == "cpu" else contextlib.nullcontext():
            y = module(x)
            if dy_kind == "sum":
                y.sum().backward()
            else:
                y.backward(torch.randn_like(y))
        results.append((y, x.grad, module.weight.grad))
    for got, want in zip(results[0], results[1]):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", _KERNEL_DEVICES)
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)])
def test_zero_rows_through_the_kernels_give_a_zero_bias_gradient(shape, device):
    """The test above compares y, x.grad and weight.grad with PyTorch's modules but not the
    LayerNorm bias gradient: an empty batch on the kernels' path must leave bias.grad zeros
    (torch.nn.LayerNorm's), not an uninitialized or NaN buffer (mutant: the launcher's
    zero-row branch filling db with NaN / torch.empty_like)."""
    torch.manual_seed(0)
    ours = FusedLayerNorm(8).to(device)
    theirs = torch.nn.LayerNorm(8).to(device)
    for module in (ours, theirs):
        x = torch.randn(*shape, device=device, requires_grad=True)
        with _ops.triton_on_cpu() if device == "cpu" else contextlib.nullcontext():
            module(x).backward(torch.randn(*shape, device=device))
    assert ours.bias.grad is not None and ours.bias.grad.dtype == theirs.bias.grad.dtype
    torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, rtol=0, atol=0)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=0, atol=0)


@KERNEL_DEVICES
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_zero_rows_with_a_strided_last_dim(kind, device):
    # An empty input whose last dim is not unit-stride (a column slice of an empty batch):
    # PyTorch counts every empty tensor contiguous, so .contiguous() kept its (16, 2) strides;
    # the PyTorch path's row copy then recursed forever (with grad) and the kernels' launcher
    # refused the strides. Compared with torch.nn.functional, with and without grad.
    device, context = device_and_context(device)
    fn = fused_layer_norm if kind == "layer" else fused_rms_norm
    theirs = (torch.nn.functional.layer_norm if kind == "layer"
              else torch.nn.functional.rms_norm)
    for grad in (False, True):
        x = torch.empty(0, 16, device=device)[:, ::2].requires_grad_(grad)
        w = torch.ones(8, device=device, requires_grad=grad)
        assert x.stride() == (16, 2)
        with context():
            y = fn(x, 8, w)
            if grad:
                y.sum().backward()
        assert y.shape == (0, 8) and y.dtype == x.dtype
        if grad:
            x_ref = x.detach().requires_grad_(True)
            w_ref = w.detach().requires_grad_(True)
            theirs(x_ref, (8,), w_ref).sum().backward()
            assert x.grad.shape == x_ref.grad.shape == (0, 8)
            torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=0)  # zeros


def test_torch_layer_norm_arguments():
    import numpy as np

    # torch.nn.LayerNorm(bias=False): no bias, and the state dicts load both ways, strictly.
    ours, theirs = FusedLayerNorm(8, bias=False), torch.nn.LayerNorm(8, bias=False)
    assert ours.bias is None and "bias=False" in repr(ours)
    ours.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 8)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
    # NumPy integers as sizes (torch accepts any integral number).
    assert FusedLayerNorm(np.int64(8)).normalized_shape == (8,)
    assert FusedRMSNorm((np.int32(2), 4)).normalized_shape == (2, 4)
    # Apex's callers pass elementwise_affine=True to the Mixed classes.
    assert MixedFusedLayerNorm(8, elementwise_affine=True).weight.shape == (8,)
    assert MixedFusedRMSNorm(8, elementwise_affine=True).weight.shape == (8,)
    # Any false value (0 or None from a config) is the same request, refused the same way
    # rather than building an affine norm. (M09)
    for cls in (MixedFusedLayerNorm, MixedFusedRMSNorm):
        for flag in (False, 0, None):
            with pytest.raises(ValueError, match=rf"{cls.__name__}\(elementwise_affine={flag!r}"
                                                 r"\): the Mixed variants always learn a weight"):
                cls(8, elementwise_affine=flag)
    # Megatron/NeMo pass keywords Apex's Mixed classes took and dropped: dropped, with a warning.
    for cls in (MixedFusedLayerNorm, MixedFusedRMSNorm):
        with pytest.warns(UserWarning, match=r"ignoring the keyword argument\(s\) "
                                             r"sequence_parallel_enabled"):
            norm = cls(8, 1e-5, sequence_parallel_enabled=False)
        assert norm.weight.shape == (8,) and norm.eps == 1e-5
    # torch.nn.LayerNorm's bias=False is honoured by the Mixed class too (it was dropped with
    # an "ignoring" warning, and a bias kept), silently; RMSNorm has no bias to keep.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixed = MixedFusedLayerNorm(8, bias=False)
        mixed_rms = MixedFusedRMSNorm(8, bias=False)
        assert MixedFusedRMSNorm(8, bias=0).bias is None  # (an int config's false, R06)
    assert mixed.bias is None and list(mixed.state_dict()) == ["weight"]
    assert "bias=False" in repr(mixed)
    mixed.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(mixed.state_dict())
    torch.testing.assert_close(mixed(x.bfloat16()), theirs(x), rtol=1e-2, atol=1e-2)
    assert mixed(x.bfloat16()).dtype == torch.float32  # (the weight's dtype)
    assert list(mixed_rms.state_dict()) == ["weight"]
    with pytest.warns(UserWarning, match=r"ignoring the keyword argument\(s\) bias"):
        MixedFusedRMSNorm(8, bias=True)  # (dropped as Apex's class dropped it: scripts run)
    # torch.nn.RMSNorm(eps=None) means the dtype's machine epsilon: not supported, said so.
    with pytest.raises(ValueError, match=r"FusedRMSNorm\(eps=None\).*pass a number"):
        FusedRMSNorm(8, eps=None)
    with pytest.raises(ValueError, match=r"FusedLayerNorm: eps must be a non-negative float"):
        FusedLayerNorm(8, eps=None)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_positional_arguments_follow_apexs_order(cls):
    """Apex's FusedLayerNorm/FusedRMSNorm take (normalized_shape, eps, elementwise_affine,
    memory_efficient) positionally, and code written for Apex passes them so: the third
    positional is elementwise_affine, the fourth memory_efficient. The norm built from
    positionals then gives PyTorch's non-affine result with that eps (float64). (L06, R07)"""
    norm = cls(8, 1e-3, False, True)
    assert norm.elementwise_affine is False and norm.memory_efficient is True
    assert norm.eps == 1e-3 and list(norm.parameters()) == []
    assert repr(norm) == (f"{cls.__name__}((8,), eps=0.001, elementwise_affine=False, "
                          "memory_efficient=True)")
    affine = cls(8, 1e-3, True, False)
    assert affine.elementwise_affine is True and affine.memory_efficient is False
    x = make_input((3, 8), torch.float64, "cpu")
    want = (torch.nn.functional.rms_norm(x, (8,), None, 1e-3) if cls is FusedRMSNorm
            else torch.nn.functional.layer_norm(x, (8,), None, None, 1e-3))
    torch.testing.assert_close(norm(x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_the_ignored_keyword_warning_points_at_the_callers_line(cls):
    # Megatron/NeMo users find the keyword to drop from the warning's location: it names the
    # line that built the layer, not mixprec's own code.
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cls(8, 1e-5, sequence_parallel_enabled=False)
    ours = [w for w in seen if "ignoring the keyword" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__, [(w.filename, w.lineno) for w in ours]


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_the_ignored_keyword_warning_names_every_keyword_in_a_stable_order(cls):
    # Megatron/NeMo callers pass several of the keywords Apex's Mixed classes dropped: the
    # one warning names each of them, sorted, so the text is the same whatever order a
    # caller passed them in (log filters and warning filters match it).
    for kwargs in ({"sequence_parallel_enabled": False, "apply_layernorm_1p": False},
                   {"apply_layernorm_1p": False, "sequence_parallel_enabled": False}):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            cls(8, 1e-5, **kwargs)
        texts = [str(w.message) for w in seen if "ignoring the keyword" in str(w.message)]
        assert texts == [f"{cls.__name__}: ignoring the keyword argument(s) "
                         "apply_layernorm_1p, sequence_parallel_enabled, which it does not use "
                         "(Apex's class dropped them too)."], texts


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_the_ignored_keyword_warning_comes_from_rank_zero_only(cls, monkeypatch):
    """Every rank of a Megatron/NeMo job builds the same model: the warning about dropped
    keywords is given on rank 0 only (one line per job, not one per GPU), while the layer is
    built the same on every rank. (M01)"""
    from mixprec.normalization import _module

    monkeypatch.setattr(_module, "is_rank_zero", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norm = cls(8, 1e-5, sequence_parallel_enabled=False)
    assert norm.weight.shape == (8,) and norm.eps == 1e-5
    monkeypatch.setattr(_module, "is_rank_zero", lambda: True)
    with pytest.warns(UserWarning, match=r"ignoring the keyword argument\(s\) "
                                         r"sequence_parallel_enabled"):
        cls(8, 1e-5, sequence_parallel_enabled=False)


def _signature_inputs(device):
    """Inputs of one module call after another, each differing from the one before in what
    the cached checks and launch plans are kept under (shape, strides, alignment, dtype)."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(3, 5, 70, generator=gen).to(device)
    flat = torch.randn(3 * 5 * 64 + 1, generator=gen).to(device)
    return {
        "contiguous": base[..., :64].contiguous(),
        "same signature again": base[..., :64].contiguous() * 2,
        "row-strided (stride 70)": base[..., :64],
        "4-byte aligned data": flat[1:].view(3, 5, 64),
        "transposed (a row copy)": base[..., :64].transpose(0, 1),
        "one row": base[0, 0, :64],
        "2-D": base[0, :, :64].contiguous(),
        "bf16": base[..., :64].to(torch.bfloat16),
    }


@KERNEL_DEVICES
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_one_module_across_changing_inputs(kind, device):
    # A module keeps its argument checks and its launch plan per input signature: every change
    # between calls (and back) must give the float64 reference's output and gradients.
    # ("cpu-triton": the kernels' launch path in Triton's interpreter.)
    device, kernels_on_cpu = device_and_context(device)
    norm = (FusedLayerNorm(64) if kind == "layer" else FusedRMSNorm(64)).to(device)
    with torch.no_grad():
        norm.weight.copy_(make_params((64,), torch.float32, device, True)[0])
    params = [p for p in (norm.weight, norm.bias) if p is not None]
    for name, x in _signature_inputs(device).items():
        x = x.detach().requires_grad_(True)
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(x)
        with kernels_on_cpu():
            y = norm(x)
            got = torch.autograd.grad(y, [x, *params], dy)
        want = float64_reference(kind, x, (64,), norm.weight, norm.bias, dy)
        tol = tolerance(x.dtype)
        torch.testing.assert_close(y.double(), want[0], **tol, msg=f"{name}: output")
        for g, w in zip(got, want[1:]):
            torch.testing.assert_close(g.double(), w, **tol, msg=f"{name}: gradient")
            assert g.dtype == (x.dtype if g.shape == x.shape else torch.float32), name


@pytest.mark.parametrize("device", DEVICES)
def test_module_attribute_changes_between_calls_are_honoured(device):
    # eps, memory_efficient, the parameters' layout and their device may change after calls.
    x = make_input((6, 32), torch.float32, device).requires_grad_(True)
    norm = FusedLayerNorm(32).to(device)
    norm(x)
    norm.eps = 0.5
    torch.testing.assert_close(
        norm(x), torch.nn.functional.layer_norm(x, (32,), norm.weight, norm.bias, 0.5))
    norm.memory_efficient = True
    y = norm(x)
    assert y.grad_fn is not None
    y.sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    torch.nn.functional.layer_norm(ref, (32,), norm.weight.detach(), norm.bias.detach(),
                                   0.5).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, atol=1e-5, rtol=1e-5)
    # a weight whose memory is not one contiguous vector (every other element of a buffer)
    wide = torch.randn(64, device=device)
    norm.weight = torch.nn.Parameter(wide[::2])
    torch.testing.assert_close(
        norm(x), torch.nn.functional.layer_norm(x, (32,), wide[::2], norm.bias, 0.5))
    if device == "cuda":  # moved off the input's device: the device check still runs
        norm.to("cpu")
        with pytest.raises(ValueError, match="same device"):
            norm(x)
    # A weight replaced by one on another device (the meta device: a model built with
    # deferred initialization and never materialized) or a bias of another shape (one
    # element, which would broadcast without a word) is refused as on a first call: both are
    # part of the signature the module's checks are kept under. (C24, C25)
    norm = FusedLayerNorm(32).to(device)
    norm(x)
    norm.weight = torch.nn.Parameter(torch.ones(32, device="meta"))
    with pytest.raises(ValueError, match=r"^FusedLayerNorm: weight is on meta but the input "
                                         r"is on .*; move both to the same device"):
        norm(x)
    norm = FusedLayerNorm(32).to(device)
    norm(x)
    norm.bias = torch.nn.Parameter(torch.ones(1, device=device))
    with pytest.raises(ValueError, match=r"^FusedLayerNorm: bias has shape \(1,\) but "
                                         r"normalized_shape is \(32,\); they must be equal"):
        norm(x)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_an_input_on_another_device_after_calls_is_refused(cls):
    """A module checks its arguments per input signature; an input on another device than
    its parameters (here the meta device, after a call on the parameters' own) is refused as
    on a first call, with the device error, instead of running the path planned for the
    first device. The exact error and message start (D27)."""
    norm = cls(8)
    x = torch.randn(4, 8)
    norm(x)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: weight is on cpu but the input "
                                         r"is on meta; move both to the same device"):
        norm(x.to("meta"))


# The Triton kernels: on CUDA, or in Triton's interpreter on CPU.
_KERNELS_ONLY = pytest.mark.parametrize("device", [
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="requires CUDA")),
    pytest.param("cpu-triton", marks=requires_interpreter)])


@_KERNELS_ONLY
@pytest.mark.parametrize("how", ["backward", "grad wrt x", "grad wrt weight"])
@pytest.mark.parametrize("loss", ["square", "linear in the output"])
def test_second_derivative_through_the_kernels_is_a_clear_error(loss, how, device):
    # create_graph=True works for first derivatives; asking for a second one through the
    # kernels' backward (which has none) is an error, not a silent zero -- also when the loss
    # is linear in the output (its gradient still depends on x; grad_out then needs no grad),
    # and also through torch.autograd.grad with explicit inputs (a Hessian-vector product, a
    # gradient penalty on the parameters), which follows only paths that reach its inputs:
    # that once skipped the error node and returned the result without the norm's term.
    device, kernels_on_cpu = device_and_context(device)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    norm = FusedLayerNorm(16).to(device)
    c = torch.randn(4, 16, device=device)

    def out(y):
        return y.pow(2).sum() if loss == "square" else (y * c).sum()

    with kernels_on_cpu():
        (gx,) = torch.autograd.grad(out(norm(x)), x, create_graph=True)
    ref = x.detach().clone().requires_grad_(True)
    (want,) = torch.autograd.grad(
        out(torch.nn.functional.layer_norm(ref, (16,), norm.weight, norm.bias)), ref)
    torch.testing.assert_close(gx, want, atol=1e-5, rtol=1e-5)
    # x also reaches the second loss outside the norm, so autograd has a path to x (and the
    # weight) that does not need the norm's second derivative.
    second = (gx * c).sum() + (x ** 3).sum() + norm.weight.sum()
    with pytest.raises(RuntimeError, match="Triton kernels.*differentiate twice"):
        if how == "backward":
            second.backward()
        else:
            torch.autograd.grad(second, x if how == "grad wrt x" else norm.weight)


@_KERNELS_ONLY
@pytest.mark.parametrize("make", [
    lambda: FusedRMSNorm(16),
    lambda: FusedLayerNorm(16, elementwise_affine=False),
    lambda: FusedLayerNorm(16).requires_grad_(False),
], ids=["rms-no-bias", "layer-plain", "layer-frozen"])
def test_second_derivative_through_the_kernels_is_an_error_with_some_inputs_frozen(make, device):
    """The kernels' backward has no derivative of its own, so a second derivative through it
    is an error whenever any of its inputs needs a gradient, not only when the input, weight
    and bias all do: an RMS norm (no bias), a norm without parameters and one with frozen
    parameters (fine-tuning) would otherwise give a gradient penalty or Hessian-vector
    product without the norm's term, silently. The first derivative against PyTorch's
    (D14)."""
    device, kernels_on_cpu = device_and_context(device)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    norm = make().to(device)
    with kernels_on_cpu():
        (gx,) = torch.autograd.grad(norm(x).pow(2).sum(), x, create_graph=True)
    ref = x.detach().clone().requires_grad_(True)
    f = torch.nn.functional
    y = (f.rms_norm(ref, (16,), norm.weight, norm.eps) if isinstance(norm, FusedRMSNorm)
         else f.layer_norm(ref, (16,), norm.weight, norm.bias, norm.eps))
    (want,) = torch.autograd.grad(y.pow(2).sum(), ref)
    torch.testing.assert_close(gx, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="Triton kernels.*differentiate twice"):
        ((gx * gx).sum() + (x ** 3).sum()).backward()


@_KERNELS_ONLY
def test_second_derivative_through_the_kernels_wrt_the_output_gradient_is_an_error(device):
    """The norm's input gradient depends on the gradient reaching its output, so a second
    derivative with respect to what made that gradient (here c in the loss (y * c).sum(), as
    in a gradient penalty differentiated by an upstream tensor) passes through the kernels'
    backward, which has none: an error, not the result without the norm's term (c also reaches
    the second loss directly, so autograd has another path to it) (D45)."""
    device, kernels_on_cpu = device_and_context(device)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    c = torch.randn(4, 16, device=device, requires_grad=True)
    norm = FusedLayerNorm(16).to(device)
    with kernels_on_cpu():
        (gx,) = torch.autograd.grad((norm(x) * c).sum(), x, create_graph=True)
    ref = x.detach().clone().requires_grad_(True)
    (want,) = torch.autograd.grad(
        (torch.nn.functional.layer_norm(ref, (16,), norm.weight, norm.bias) * c).sum(), ref)
    torch.testing.assert_close(gx, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="Triton kernels.*differentiate twice"):
        torch.autograd.grad(gx.pow(2).sum() + c.sum(), c)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-x", "memory-efficient"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_second_derivatives_on_the_pytorch_path(cls, affine, memory_efficient):
    # The PyTorch path (CPU here; also float64 and over-long rows on CUDA) differentiates its
    # own backward, as torch.nn.LayerNorm does: gradgradcheck in float64, with respect to the
    # input and the parameters, on rows that are a view and on rows that must be copied.
    gen = torch.Generator().manual_seed(7)
    norm = cls((3, 4), elementwise_affine=affine, memory_efficient=memory_efficient,
               dtype=torch.float64)
    names = [name for name, _ in norm.named_parameters()]
    with torch.no_grad():
        for p in norm.parameters():  # (memory_efficient needs non-zero weights)
            p.uniform_(0.5, 1.5, generator=gen)

    def call(x, *params):
        return torch.func.functional_call(norm, dict(zip(names, params)), (x,))

    params = [p.detach().clone().requires_grad_(True) for p in norm.parameters()]
    inputs = {
        "rows": torch.randn(2, 3, 4, generator=gen, dtype=torch.float64),
        "transposed": torch.randn(3, 2, 4, generator=gen, dtype=torch.float64).transpose(0, 1),
    }
    for name, x in inputs.items():
        x = x.requires_grad_(True)
        assert torch.autograd.gradgradcheck(call, (x, *params)), name


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_pytorch_path_keeps_a_row_copy_of_a_strided_input_not_its_storage(cls):
    # An input whose memory is not rows (every other column of a wider tensor) is copied into
    # rows by autograd before the norm, which keeps that copy for backward, as the kernels'
    # path does: keeping the input itself (for second derivatives) held its whole storage,
    # twice the bytes here, and copied it again in every backward. Second derivatives still
    # reach the input through the copy.
    norm = cls(256)
    base = torch.randn(64, 512)
    x = (base * 1.0)[:, ::2].requires_grad_(True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = norm(x)
    storages = {t.untyped_storage().data_ptr() for t in kept}
    assert x.untyped_storage().data_ptr() not in storages
    torch.testing.assert_close(y, norm(x.detach().contiguous()), rtol=0, atol=0)
    small = cls((3, 4), dtype=torch.float64)
    wide = torch.randn(5, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda b: small(b[..., ::2]), (wide,))


@requires_interpreter
@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_kernels_keep_their_row_copy_of_a_strided_input_not_its_storage(cls):
    """On the kernels, an input whose memory is not rows (every other column of a wider
    tensor) is copied into rows for the forward, and that copy is what backward keeps: keeping
    the input itself held its whole storage (twice the bytes here) and copied it again in
    every backward. Results as for the same values in contiguous memory (O10)."""
    norm = cls(32)
    x = torch.randn(8, 64)[:, ::2].requires_grad_(True)
    dy = torch.randn(8, 32)
    kept = []
    with _ops.triton_on_cpu():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t,
                                                      lambda t: t):
            y = norm(x)
        (gx,) = torch.autograd.grad(y, x, dy)
        xc = x.detach().contiguous().requires_grad_(True)
        yc = norm(xc)
        (gxc,) = torch.autograd.grad(yc, xc, dy)
    assert x.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in kept}
    torch.testing.assert_close(y, yc, rtol=0, atol=0)
    torch.testing.assert_close(gx, gxc, rtol=0, atol=0)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_torch_func_and_forward_ad_match_pytorch(rms):
    # torch.func transforms and forward-mode AD run PyTorch's math (the kernels' autograd
    # Function has no setup_context or jvp: they raised before). Float64 references.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64)
    fused = (FusedRMSNorm(8) if rms else FusedLayerNorm(8)).double()
    ref = (torch.nn.RMSNorm(8, eps=1e-5) if rms else torch.nn.LayerNorm(8)).double()
    with torch.no_grad():
        fused.weight.uniform_(0.5, 1.5, generator=gen)
        ref.weight.copy_(fused.weight)
        if not rms:
            fused.bias.normal_(generator=gen)
            ref.bias.copy_(fused.bias)

    def loss(norm):
        return lambda t: norm(t).tanh().sum()

    tol = dict(atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(torch.func.vmap(fused)(x), torch.func.vmap(ref)(x), **tol)
    torch.testing.assert_close(torch.func.vmap(torch.func.grad(loss(fused)))(x),
                               torch.func.vmap(torch.func.grad(loss(ref)))(x), **tol)
    for a, b in zip(torch.func.jvp(fused, (x,), (v,)), torch.func.jvp(ref, (x,), (v,))):
        torch.testing.assert_close(a, b, **tol)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        got = fwAD.unpack_dual(fused(fwAD.make_dual(x, v))).tangent
        want = fwAD.unpack_dual(ref(fwAD.make_dual(x, v))).tangent
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_torch_func_and_forward_ad_keep_the_mixed_norms_output_dtype(cls):
    """A Mixed norm gives its output in the weight's dtype (fp32 parameters, bf16 activations)
    under torch.func transforms and forward-mode AD as it does eagerly: the layer after it is
    built for that dtype. Against the eager call, dtype exactly and values to bf16's rounding
    (D46)."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(13)
    norm = cls(8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    x = torch.randn(3, 5, 8, generator=gen).bfloat16()
    want = norm(x)
    assert want.dtype == torch.float32
    got = torch.func.vmap(norm)(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **tolerance(torch.bfloat16))
    with fwAD.dual_level():
        dual = norm(fwAD.make_dual(x, torch.ones_like(x)))
    assert fwAD.unpack_dual(dual).primal.dtype == torch.float32


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_torch_func_and_forward_ad_check_the_input_as_eager_does(cls):
    """Under torch.func transforms and forward-mode AD the modules run PyTorch's math after
    the argument checks eager mode makes: a norm over 8 elements given rows of 5 (vmap hands
    the module one (5,) row per sample) is refused with the eager error, not normalized over
    the wrong dim without a word, as a norm without parameters otherwise would be. A matching
    input gives PyTorch's result (C37)."""
    import torch.autograd.forward_ad as fwAD

    norm = cls(8, elementwise_affine=False)
    f = torch.nn.functional
    good = torch.randn(3, 8)
    want = f.layer_norm(good, (8,)) if cls is FusedLayerNorm else f.rms_norm(good, (8,), eps=1e-5)
    torch.testing.assert_close(torch.func.vmap(norm)(good), want)
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: input of shape \(5,\) does not "
                                         r"end with normalized_shape \(8,\)"):
        torch.func.vmap(norm)(x)
    with fwAD.dual_level():
        with pytest.raises(ValueError, match=rf"^{cls.__name__}: input of shape \(3, 5\) does "
                                             r"not end with normalized_shape \(8,\)"):
            norm(fwAD.make_dual(x, torch.ones_like(x)))


@KERNEL_DEVICES
@pytest.mark.parametrize("hook", ["contiguous copy", "bf16 copy"])
def test_backward_takes_what_autograd_hands_back(hook, device):
    # Saved-tensor hooks (activation offloading such as torch.autograd.graph.save_on_cpu,
    # compression) give the backward copies with other strides or dtypes (input, weight,
    # statistics) than the forward saw: the backward must read what it is given. The input
    # is a row-strided slice (a q of a fused qkv projection).
    device, kernels_on_cpu = device_and_context(device)
    norm = FusedRMSNorm(32).to(device)
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 5, 96, generator=gen).to(device).requires_grad_(True)
    dy = torch.randn(2, 5, 32, generator=gen).to(device)
    pack = {"contiguous copy": lambda t: t.contiguous().clone(),
            "bf16 copy": lambda t: t.to(torch.bfloat16)}.get(hook, lambda t: t)
    with kernels_on_cpu():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = norm(qkv[..., :32])
        gq, gw = torch.autograd.grad(y, [qkv, norm.weight], dy)
    want = float64_reference("rms", qkv[..., :32], (32,), norm.weight, None, dy)
    tol = tolerance(torch.float32 if hook == "contiguous copy" else torch.bfloat16)
    torch.testing.assert_close(gq[..., :32].double(), want[1], **tol)
    assert not gq[..., 32:].any()
    torch.testing.assert_close(gw.double(), want[2], atol=tol["atol"] * 4, rtol=tol["rtol"])


@_KERNELS_ONLY
def test_memory_efficient_backward_of_a_strided_input_stays_on_the_fast_path(device,
                                                                            monkeypatch):
    """With memory_efficient the backward reads the saved output, which the forward allocated
    contiguous whatever the input's strides: for a row-strided input (the q of a fused qkv
    projection) what autograd hands back is what was saved, so the backward takes the planned
    launch, not the generic fallback meant for tensors a saved-tensor hook changed (which
    costs host time on every step). Gradients against PyTorch's RMSNorm in float64 (C35)."""
    device, kernels_on_cpu = device_and_context(device)
    fallbacks = []
    generic = _ops._GenericPath.backward

    def spy(self, *args, **kwargs):
        fallbacks.append(self)
        return generic(self, *args, **kwargs)

    monkeypatch.setattr(_ops._GenericPath, "backward", spy)
    norm = FusedRMSNorm(32, memory_efficient=True).to(device)
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 5, 96, generator=gen).to(device).requires_grad_(True)
    dy = torch.randn(2, 5, 32, generator=gen).to(device)
    with kernels_on_cpu():
        gq, gw = torch.autograd.grad(norm(qkv[..., :32]), [qkv, norm.weight], dy)
    assert fallbacks == []
    want = float64_reference("rms", qkv[..., :32], (32,), norm.weight, None, dy)
    tol = tolerance(torch.float32)
    torch.testing.assert_close(gq[..., :32].double(), want[1], **tol)
    torch.testing.assert_close(gw.double(), want[2], **tol)


@KERNEL_DEVICES
@pytest.mark.parametrize("hook", ["column-major 2-D weight and bias", "strided 1-D tensors"])
def test_backward_takes_parameters_and_statistics_handed_back_otherwise(hook, device):
    # A saved-tensor hook may hand back the weight, bias or statistics (mean, rstd) laid out
    # otherwise too: the kernels read them as contiguous vectors, and gave dx off by ~1 (a
    # transposed weight) or ~2 (every other element of a buffer) without a word.
    device, kernels_on_cpu = device_and_context(device)
    gen = torch.Generator().manual_seed(9)
    shape = (3, 4) if hook.startswith("column") else (8,)
    norm = FusedLayerNorm(shape).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape, generator=gen) + 0.5)
        norm.bias.copy_(torch.randn(shape, generator=gen))
    x = torch.randn(5, *shape, generator=gen).to(device).requires_grad_(True)
    dy = torch.randn(5, *shape, generator=gen).to(device)

    def unpack(t):
        if hook.startswith("column"):  # same values, column-major memory
            return t.t().contiguous().t() if t.dim() == 2 and t.shape == shape else t
        if t.dim() != 1:
            return t
        spread = torch.zeros(2 * t.numel(), dtype=t.dtype, device=t.device)
        return spread[::2].copy_(t)

    with kernels_on_cpu():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            y = norm(x)
        gx, gw, gb = torch.autograd.grad(y, [x, norm.weight, norm.bias], dy)
    want = float64_reference("layer", x, shape, norm.weight, norm.bias, dy)
    tol = tolerance(torch.float32)
    for name, got, ref in (("dx", gx, want[1]), ("dweight", gw, want[2]), ("dbias", gb, want[3])):
        torch.testing.assert_close(got.double(), ref, **tol, msg=name)


def _grads_through_a_bf16_saved_copy(norm, param, x, dy, kernels_on_cpu):
    """The gradients (x, weight, bias) of ``norm(x)`` against ``dy`` with a saved-tensor hook
    that hands the backward a bf16 copy of ``param`` (a compressing hook)."""

    def compress(t):
        return t.to(torch.bfloat16) if t.data_ptr() == param.data_ptr() else t

    with kernels_on_cpu():
        with torch.autograd.graph.saved_tensors_hooks(compress, lambda t: t):
            y = norm(x)
        return torch.autograd.grad(y, [x, norm.weight, norm.bias], dy)


@KERNEL_DEVICES
def test_a_weight_saved_as_bf16_leaves_the_parameter_gradients_fp32(device):
    # A compressing saved-tensor hook may hand the backward the fp32 weight as a bf16 copy.
    # With the input saved, the weight and bias gradients (sum(dy * x_hat), sum(dy)) do not
    # read the weight: they are computed in fp32 and come back in the parameters' own dtype,
    # not rounded to the copy's (they were: bf16-rounded by up to 0.3%). float64 reference,
    # fp32 tolerance. (memory_efficient recovers x_hat from the output through the weight, so
    # there the copy's rounding reaches the weight's gradient by design.) The input gradient
    # reads the copy's values (on a GPU the kernels, compiled for an fp32 weight, must not read
    # bf16 memory): against the reference with the bf16-rounded weight.
    device, kernels_on_cpu = device_and_context(device)
    gen = torch.Generator().manual_seed(11)
    norm = FusedLayerNorm(16).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=gen) + 0.5)
        norm.bias.copy_(torch.randn(16, generator=gen))
    x = (torch.randn(6, 16, generator=gen) * 2 + 1).to(device).requires_grad_(True)
    dy = (torch.randn(6, 16, generator=gen) * 3).to(device)

    gx, gw, gb = _grads_through_a_bf16_saved_copy(norm, norm.weight, x, dy, kernels_on_cpu)
    want = float64_reference("layer", x, (16,), norm.weight, norm.bias, dy)
    want_dx = float64_reference("layer", x, (16,), norm.weight.bfloat16(), norm.bias, dy)[1]
    for name, got, ref in (("dweight", gw, want[2]), ("dbias", gb, want[3]), ("dx", gx, want_dx)):
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got.double(), ref, **tolerance(torch.float32), msg=name)


@KERNEL_DEVICES
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves-x", "saves-y"])
def test_a_bias_saved_as_bf16_leaves_the_bias_gradient_fp32(memory_efficient, device):
    """The bias twin of the test above: a compressing saved-tensor hook hands the backward the
    fp32 bias as a bf16 copy. The bias gradient (sum(dy)) never needs the bias's value, so it
    must come back at fp32 accuracy in fp32, not rounded to the copy's bf16 (mutant: the
    PyTorch path's cast of a hook's bias copy back to the parameter's dtype dropped). With
    memory_efficient, x_hat = (y - b) / w reads the copy (by design, as for the weight), so
    only dbias is compared there; saving x, nothing in the backward reads the bias."""
    device, kernels_on_cpu = device_and_context(device)
    gen = torch.Generator().manual_seed(12)
    norm = FusedLayerNorm(16, memory_efficient=memory_efficient).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=gen) + 0.5)
        norm.bias.copy_(torch.randn(16, generator=gen) * 3 + 0.1)
    x = (torch.randn(6, 16, generator=gen) * 2 + 1).to(device).requires_grad_(True)
    dy = (torch.randn(6, 16, generator=gen) * 3 + 0.3).to(device)

    gx, gw, gb = _grads_through_a_bf16_saved_copy(norm, norm.bias, x, dy, kernels_on_cpu)
    want = float64_reference("layer", x, (16,), norm.weight, norm.bias, dy)
    assert gb.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(gb.double(), want[3], **tolerance(torch.float32), msg="dbias")
    if not memory_efficient:  # (saving y, x_hat = (y - b) / w reads the rounded copy by design)
        for name, got, ref in (("dx", gx, want[1]), ("dweight", gw, want[2])):
            torch.testing.assert_close(got.double(), ref, **tolerance(torch.float32), msg=name)


@KERNEL_DEVICES
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_batched_gradients(memory_efficient, device):
    # torch.autograd.grad(..., is_grads_batched=True), and jacobian(vectorize=True) built on
    # it, hand the backward batched gradients without storage: the kernels failed on them
    # ("Cannot access data pointer"). A first derivative, so the norms give it, on PyTorch's
    # arithmetic there.
    device, kernels_on_cpu = device_and_context(device)
    gen = torch.Generator().manual_seed(10)
    norm = FusedRMSNorm(6, memory_efficient=memory_efficient).to(device)
    x = torch.randn(3, 6, generator=gen).to(device).requires_grad_(True)
    vs = torch.randn(4, 3, 6, generator=gen).to(device)
    with kernels_on_cpu():
        (got,) = torch.autograd.grad(norm(x), x, vs, is_grads_batched=True)
        jac = torch.autograd.functional.jacobian(norm, x, vectorize=True)
    for i, v in enumerate(vs):
        want = float64_reference("rms", x, (6,), norm.weight, None, v)[1]
        torch.testing.assert_close(got[i].double(), want, **tolerance(torch.float32))
    x64 = x.detach().double()
    ref_jac = torch.autograd.functional.jacobian(
        lambda t: reference.rms_norm(t, [6], norm.weight.detach().double(), 1e-5), x64)
    torch.testing.assert_close(jac.double(), ref_jac, **tolerance(torch.float32))


class _FunctionalNorms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.b = torch.nn.Parameter(torch.linspace(-1, 1, 8))

    def forward(self, x):
        h = fused_layer_norm(x, 8, self.w, self.b) + fused_rms_norm(x, (8,), self.w)
        return h + apex_functional.fused_layer_norm_affine(x, self.w, self.b, 8)


@pytest.mark.parametrize("make,norm_calls", [
    (lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), FusedLayerNorm(8)), 1),
    (lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), FusedRMSNorm(8, memory_efficient=True)),
     1),
    (lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), MixedFusedLayerNorm(8)), 1),
    (lambda: MixedFusedRMSNorm((2, 8)), 1),
    (lambda: FusedLayerNorm(8, elementwise_affine=False), 1),
    (_FunctionalNorms, 3),
], ids=["layer_norm", "rms_norm", "mixed", "mixed-rms-root", "plain-root", "functional"])
def test_fx_symbolic_trace_records_one_call_per_norm(make, norm_calls):
    # torch.nn.LayerNorm is a leaf module under torch.fx; mixprec's norms (modules, also as
    # the traced root, and functions) are recorded as one call_function node each, which runs
    # the fused norm (the trace once failed: "input must be a torch.Tensor, got Proxy").
    import operator

    torch.manual_seed(0)
    model = make()
    traced = torch.fx.symbolic_trace(model)
    calls = [node.target for node in traced.graph.nodes if node.op == "call_function"]
    norms = [t for t in calls if t.__module__.startswith("mixprec.normalization")]
    assert len(norms) == norm_calls and len(calls) - len(norms) == calls.count(operator.add)
    x = torch.randn(3, 2, 8, requires_grad=True)
    want = model(x)
    got = traced(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    params = list(model.parameters())
    got_grads = torch.autograd.grad(got.square().sum(), [x, *params])
    want_grads = torch.autograd.grad(want.square().sum(), [x, *params])
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_jit_trace_of_the_functionals_has_no_tracer_warnings():
    # The functionals' argument checks compared traced sizes under torch.jit.trace
    # (TracerWarning: "might cause the trace to be incorrect"); the recorded ops check there.
    w, b = torch.randn(8), torch.randn(8)

    def fn(x):
        return fused_rms_norm(fused_layer_norm(x, 8, w, b), (8,), w)

    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(fn, x)
    y = reference.layer_norm(x.double(), (8,), w.double(), b.double(), 1e-5)
    y = reference.rms_norm(y, (8,), w.double(), 1e-5)
    torch.testing.assert_close(traced(x).double(), y, rtol=1e-5, atol=1e-5)


def test_internal_entry_takes_a_list_shape():
    x = torch.randn(3, 8)
    y = _ops.fused_norm(x, [8], None, None, 1e-5, False, False, torch.float32)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (8,)))


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm,
                                 MixedFusedRMSNorm])
def test_jit_trace_records_pytorchs_own_ops(cls, device, tmp_path):
    # HF-style code traces models built on Apex's FusedLayerNorm for TorchScript serving: the
    # trace must hold PyTorch's ops (it held mixprec's custom op, which a process without
    # mixprec, or libtorch, cannot load), and compute what the module computes.
    torch.manual_seed(0)
    norm = cls(16).to(device)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 16, device=device)
    traced = torch.jit.trace(norm, x)
    kinds = {node.kind() for node in traced.graph.nodes()}
    assert not any(kind.startswith("mixprec::") for kind in kinds), kinds
    path = tmp_path / "norm.pt"
    traced.save(str(path))
    loaded = torch.jit.load(str(path))
    y = loaded(x)
    expected = norm(x)
    assert y.dtype == expected.dtype
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    # The saved trace is self-contained: it runs in a fresh process without mixprec.
    script = ("import torch, sys; m = torch.jit.load(sys.argv[1]); "
              "assert 'mixprec' not in sys.modules; "
              "print(m(torch.ones(2, 16, device=sys.argv[2])).shape)")
    run = subprocess.run([sys.executable, "-c", script, str(path), str(device)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "torch.Size([2, 16])"


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm,
                                 MixedFusedRMSNorm])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")  # (PyTorch's own export.save)
def test_torch_export_records_pytorchs_own_ops(cls, device, tmp_path):
    # As for a trace: a program exported for deployment (torch.export.save/load, ONNX,
    # ExecuTorch, AOTInductor) held mixprec's custom op, kept by run_decompositions(), so
    # torch.export.load without mixprec imported failed with PyTorch's "error when
    # deserializing". It must hold PyTorch's ops and compute what the module computes, output
    # dtype included (the Mixed norms: the weight's). Reference: the module's forward.
    if not hasattr(torch.compiler, "_is_exporting_flag"):
        pytest.skip("torch.export tells a layer it is exporting from PyTorch 2.7 on")
    torch.manual_seed(0)
    norm = cls(16).to(device)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 16, device=device, dtype=torch.bfloat16)
    program = torch.export.export(norm, (x,))
    for prog in (program, program.run_decompositions()):
        targets = {str(n.target) for n in prog.graph.nodes if n.op == "call_function"}
        assert not any("mixprec" in t for t in targets), targets
    y, expected = program.module()(x), norm(x)
    assert y.dtype == expected.dtype
    torch.testing.assert_close(y, expected, rtol=1e-2, atol=1e-2)
    path = tmp_path / "norm.pt2"
    torch.export.save(program, path)
    script = ("import torch, sys; p = torch.export.load(sys.argv[1]); "
              "assert 'mixprec' not in sys.modules; "
              "y = p.module()(torch.ones(3, 5, 16, device=sys.argv[2], dtype=torch.bfloat16)); "
              "print(tuple(y.shape), y.dtype)")
    run = subprocess.run([sys.executable, "-c", script, str(path), str(device)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == f"(3, 5, 16) {expected.dtype}"


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm,
                                 MixedFusedRMSNorm])
def test_jit_trace_takes_dtypes_when_it_runs(cls):
    # A trace recorded the reference's .to(dtype) casts with the tracing input's dtype: a
    # model traced in fp32 and served with .bfloat16() got fp32 out of its norms (its next
    # Linear failed), and the other way round. Reference: the module's own forward on the
    # same input and parameters (the result's dtype exactly, values to bf16's rounding).
    torch.manual_seed(0)
    norm = cls(16)
    with torch.no_grad():
        norm.weight.normal_()
        if getattr(norm, "bias", None) is not None:
            norm.bias.normal_()
    x = torch.randn(3, 5, 16)

    def trace(dtype):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return torch.jit.trace(copy.deepcopy(norm).to(dtype), x.to(dtype))

    # Traced in fp32, then: bf16 inputs to the fp32 parameters (the Mixed norms' use), and the
    # whole trace cast to bf16; traced in bf16, then cast to fp32. (.to(dtype) of a module
    # converts it in place.)
    cases = [(trace(torch.float32), norm, x.bfloat16()),
             (trace(torch.float32).bfloat16(), copy.deepcopy(norm).bfloat16(), x.bfloat16()),
             (trace(torch.bfloat16).float(), norm, x)]
    for module, eager, inp in cases:
        want, got = eager(inp), module(inp)
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


def test_jit_trace_of_a_bias_only_layer_norm_keeps_the_bias():
    """torch.jit.trace of a layer norm with a bias and no weight (fused_layer_norm(x, n,
    None, bias), as Apex's functional form allows) records PyTorch's layer norm with that
    bias: the trace must compute what the eager call computes. Against F.layer_norm (D28)."""
    b = torch.linspace(-1, 1, 16)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(7))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(lambda t: fused_layer_norm(t, 16, None, b), x)
    want = torch.nn.functional.layer_norm(x, (16,), None, b)
    torch.testing.assert_close(traced(x), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_layer_norm(x, 16, None, b), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", [FusedLayerNorm, MixedFusedLayerNorm, FusedRMSNorm,
                                 MixedFusedRMSNorm])
def test_unpickles_apex_instance_state(cls):
    # A model saved whole under Apex (torch.save(model)) unpickles into these classes through
    # the Apex alias with Apex's instance state: a torch.Size shape, no mixprec attributes, no
    # memory_efficient (older Apex), and for RMSNorm no bias at all. Its forward failed on
    # `_is_rms`; it must run as the class built here does.
    import io

    built = cls(6)
    with torch.no_grad():
        built.weight.uniform_(0.5, 1.5)
    apex_like = cls.__new__(cls)
    state = {k: v for k, v in built.__dict__.items()
             if k not in ("_is_rms", "_output_like_weight", "memory_efficient")}
    state["normalized_shape"] = torch.Size(built.normalized_shape)
    state["_parameters"] = {k: v for k, v in built._parameters.items()
                            if not (k == "bias" and v is None)}
    apex_like.__dict__.update(state)
    buffer = io.BytesIO()
    torch.save(apex_like, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(3, 6, dtype=torch.bfloat16)
    assert loaded.normalized_shape == (6,) and type(loaded.normalized_shape) is tuple
    assert loaded.memory_efficient is False
    assert loaded.state_dict().keys() == built.state_dict().keys()
    out = loaded(x)
    assert out.dtype == built(x).dtype
    torch.testing.assert_close(out, built(x), rtol=0, atol=0)


@pytest.mark.parametrize("cls", [FusedLayerNorm, MixedFusedLayerNorm, FusedRMSNorm,
                                 MixedFusedRMSNorm])
def test_unpickling_keeps_the_saved_settings(cls):
    """A whole model saved and loaded (torch.save(model) / torch.load) keeps each norm's own
    settings: its eps and memory_efficient come back as saved (filling in attributes missing
    from Apex's state must not replace those present), and the loaded norm gives the saved
    one's output exactly. (M14)"""
    import io

    built = cls(6, eps=0.25, memory_efficient=True)
    with torch.no_grad():
        built.weight.uniform_(0.5, 1.5)
    buffer = io.BytesIO()
    torch.save(built, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.eps == 0.25 and loaded.memory_efficient is True
    assert repr(loaded) == repr(built)
    x = torch.randn(3, 6, dtype=torch.float64) * 0.1
    torch.testing.assert_close(loaded(x), built(x), rtol=0, atol=0)
    want = (torch.nn.functional.rms_norm(x, (6,), built.weight.double(), 0.25) if built._is_rms
            else torch.nn.functional.layer_norm(x, (6,), built.weight.double(),
                                                built.bias.double(), 0.25))
    torch.testing.assert_close(loaded(x).double(), want, rtol=1e-6, atol=1e-6)


# -- argument checks, dtype rules, defaults, weight-only gradients (mutation testing) -------------
@pytest.mark.parametrize("make", [
    lambda s: FusedLayerNorm(s),
    lambda s: FusedRMSNorm(s),
    lambda s: fused_layer_norm(torch.randn(2, 1), s),
    lambda s: fused_rms_norm(torch.randn(2, 1), s),
], ids=["FusedLayerNorm", "FusedRMSNorm", "fused_layer_norm", "fused_rms_norm"])
def test_bool_normalized_shape_is_a_type_error(make):
    # True is an int to Python; as a size it is a mistake (torch.nn.LayerNorm(True) makes a
    # norm over one element silently). mixprec refuses it, alone or inside a tuple.
    with pytest.raises(TypeError, match="normalized_shape must be an int or a tuple of ints, got a bool"):
        make(True)
    with pytest.raises(TypeError, match=r"normalized_shape must hold ints, got \(True, 1\)"):
        make((True, 1))


@pytest.mark.parametrize("make", [
    lambda s: FusedLayerNorm(s),
    lambda s: MixedFusedLayerNorm(s),
    lambda s: fused_rms_norm(torch.randn(2, 3), s),
], ids=["FusedLayerNorm", "MixedFusedLayerNorm", "fused_rms_norm"])
@pytest.mark.parametrize("shape", [(), [], torch.Size([])])
def test_empty_normalized_shape_is_a_value_error(make, shape):
    # No dims to normalize over (torch.nn.functional.layer_norm also refuses one).
    with pytest.raises(ValueError, match=r"normalized_shape must be one or more non-negative sizes, got \(\)"):
        make(shape)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
@pytest.mark.parametrize("which", ["weight", "bias"])
def test_unsupported_parameter_dtype_is_a_type_error(which, dtype):
    # An integer or complex weight/bias is refused by name, not silently cast to float.
    x = torch.randn(2, 4)
    p = torch.ones(4, dtype=dtype)
    kwargs = {"weight": torch.ones(4), "bias": torch.zeros(4)}
    kwargs[which] = p
    with pytest.raises(TypeError, match=f"fused_layer_norm: {which} dtype {dtype} is not supported"):
        fused_layer_norm(x, 4, **kwargs)
    if which == "weight":
        with pytest.raises(TypeError, match=f"fused_rms_norm: weight dtype {dtype} is not supported"):
            fused_rms_norm(x, 4, p)


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_parameter_on_another_device_is_a_value_error(which):
    # (The meta device stands for any other device on a CPU-only machine.)
    x = torch.randn(2, 4)
    kwargs = {"weight": torch.ones(4), "bias": torch.zeros(4)}
    kwargs[which] = torch.ones(4, device="meta")
    with pytest.raises(ValueError, match=f"fused_layer_norm: {which} is on meta but the input is on cpu"):
        fused_layer_norm(x, 4, **kwargs)
    module = FusedLayerNorm(4)
    setattr(module, which, torch.nn.Parameter(torch.ones(4, device="meta")))
    with pytest.raises(ValueError, match=f"FusedLayerNorm: {which} is on meta but the input is on cpu"):
        module(x)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("p_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fused_norm_output_takes_the_input_dtype_not_the_parameters(x_dtype, p_dtype, kind):
    # "Returns: same shape as x, dtype of x" (only the Mixed variants follow the weight).
    torch.manual_seed(0)
    x = torch.randn(4, 16, dtype=x_dtype)
    w = torch.rand(16, dtype=p_dtype) + 0.5
    b = torch.randn(16, dtype=p_dtype)
    if kind == "layer":
        y = fused_layer_norm(x, 16, w, b)
        want = torch.nn.functional.layer_norm(x.double(), (16,), w.double(), b.double(), 1e-5)
    else:
        y = fused_rms_norm(x, 16, w)
        want = torch.nn.functional.rms_norm(x.double(), (16,), w.double(), 1e-5)
    assert y.dtype == x_dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[x_dtype]
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("make", [MixedFusedRMSNorm, MixedFusedLayerNorm, "fused_rms_norm",
                                  "fused_layer_norm"])
def test_mixed_norm_default_eps_is_1e_5(make):
    # Documented default (as FusedRMSNorm's, FusedLayerNorm's and torch.nn.LayerNorm's):
    # eps=1e-5; models built without an explicit eps rely on it. On a small-variance input
    # (mean square ~1e-6) eps dominates, so another default gives visibly other values.
    # mixprec's own functions too (Apex's functional forms, with 1e-6, are apex_functional's).
    # (L18 for the LayerNorm; R03, L02 for the functions)
    torch.manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64) * 1e-3
    rms = make in (MixedFusedRMSNorm, "fused_rms_norm")
    want = (torch.nn.functional.rms_norm if rms else torch.nn.functional.layer_norm)(
        x, (8,), eps=1e-5)
    if isinstance(make, str):  # (float64 in and out: exact to float64 rounding)
        got = (fused_rms_norm if rms else fused_layer_norm)(x, 8)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        return
    norm = make(8)
    assert norm.eps == 1e-5
    torch.testing.assert_close(norm(x.float()).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [FusedRMSNorm, MixedFusedRMSNorm])
def test_a_bias_put_on_an_rms_norm_is_ignored_and_gets_no_gradient(cls):
    # RMSNorm has no bias: one set on the module by hand (a converted model, an Apex object)
    # takes no part in the forward, so it must not get a gradient either.
    torch.manual_seed(0)
    norm = cls(4)
    x = torch.randn(3, 4, requires_grad=True)
    want = norm(x)
    norm.bias = torch.nn.Parameter(torch.full((4,), 0.5))
    y = norm(x)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    y.sum().backward()
    assert norm.bias.grad is None


@KERNEL_DEVICES
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("kind", ["module", "function"])
def test_weight_gradient_when_the_input_does_not_require_grad(kind, memory_efficient, device):
    # A norm applied to data (or a detached activation): only the weight requires grad, and
    # RMSNorm has no bias to carry the autograd decision. The weight's gradient must match
    # torch.nn.functional.rms_norm's, computed in float64.
    device, context = device_and_context(device)
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    w0 = torch.rand(8) + 0.5
    with context():
        y, w = _rms_norm_of_data(kind, x.to(device), w0.to(device), memory_efficient)
    assert y.requires_grad
    dy = torch.randn(5, 8)
    (y * dy.to(device)).sum().backward()
    assert w.grad is not None
    w64 = w0.double().requires_grad_()
    (torch.nn.functional.rms_norm(x.double(), (8,), w64, 1e-5) * dy.double()).sum().backward()
    torch.testing.assert_close(w.grad.double().cpu(), w64.grad, rtol=1e-5, atol=1e-5)


def _rms_norm_of_data(kind, x, w0, memory_efficient):
    if kind == "module":
        norm = FusedRMSNorm(8, memory_efficient=memory_efficient).to(x.device)
        with torch.no_grad():
            norm.weight.copy_(w0)
        return norm(x), norm.weight
    w = w0.clone().requires_grad_()
    return fused_rms_norm(x, 8, w, memory_efficient=memory_efficient), w


def test_layer_norm_weight_only_requires_grad():
    # FusedLayerNorm with a frozen bias: the weight alone requires grad.
    torch.manual_seed(0)
    norm = FusedLayerNorm(8)
    norm.bias.requires_grad_(False)
    x = torch.randn(4, 8)
    norm(x).pow(2).sum().backward()
    ref = torch.nn.LayerNorm(8).double()
    ref.bias.requires_grad_(False)
    ref(x.double()).pow(2).sum().backward()
    assert norm.weight.grad is not None
    torch.testing.assert_close(norm.weight.grad.double(), ref.weight.grad, rtol=1e-5, atol=1e-5)


def test_module_rechecks_a_weight_whose_dtype_changed():
    # The module validates its arguments once per input signature; a weight replaced by one of
    # an unsupported dtype (same shape) is a new signature and must be refused, not computed.
    norm = FusedLayerNorm(4)
    x = torch.randn(2, 4)
    norm(x)
    norm.weight = torch.nn.Parameter(torch.ones(4, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match="FusedLayerNorm: weight dtype torch.int64 is not supported"):
        norm(x)


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64], ids=str)
def test_mixed_module_rechecks_an_input_whose_dtype_changed(cls, dtype):
    """A Mixed norm's output dtype is its weight's, whatever the input's: an input of an
    unsupported dtype after a float one (same shape and strides) is still refused as on a
    first call, not normalized silently. The exact error and message start (D25)."""
    norm = cls(8)
    x = torch.randn(4, 8)
    norm(x)
    with pytest.raises(TypeError, match=rf"^{cls.__name__}: input dtype {dtype} is not "
                                        r"supported; use float32, float16, bfloat16"):
        norm(x.to(dtype))


def test_module_rechecks_a_bias_whose_dtype_changed():
    """As for the weight: a bias replaced by one of an unsupported dtype (same shape) after
    calls is refused as on a first call, not added to the output. The exact error and message
    start (D26)."""
    norm = FusedLayerNorm(4)
    x = torch.randn(2, 4)
    norm(x)
    norm.bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match=r"^FusedLayerNorm: bias dtype torch.int64 is not "
                                        r"supported"):
        norm(x)


# Tests from the r49B mutation run over mixprec/normalization: each fails on the mutant named.
# --- _checks.normalize_shape: negative sizes (mutant C03: `d < 0` -> `d < -1`) --------------
@pytest.mark.parametrize("make", [
    lambda: FusedLayerNorm((4, -1), elementwise_affine=False),
    lambda: FusedRMSNorm(-1, elementwise_affine=False),
    lambda: FusedLayerNorm(-1),
    lambda: fused_layer_norm(torch.randn(2, 4), -1),
], ids=["ln-no-affine", "rms-no-affine", "ln-affine", "functional"])
def test_negative_normalized_shape_is_a_value_error(make):
    with pytest.raises(ValueError, match="non-negative sizes"):
        make()


# --- _checks.check_inputs: bias checked when weight is None (mutant C18: continue -> break) --
@pytest.mark.parametrize("call", [
    lambda x: fused_layer_norm(x, 4, None, torch.zeros(3)),
    lambda x: apex_functional.fused_layer_norm_affine(x, None, torch.zeros(3), 4),
], ids=["fused_layer_norm", "apex-affine"])
def test_bias_shape_is_checked_without_a_weight(call):
    with pytest.raises(ValueError, match="bias has shape"):
        call(torch.randn(2, 4))


def test_bias_dtype_is_checked_without_a_weight():
    with pytest.raises(TypeError, match="bias dtype torch.int64"):
        fused_layer_norm(torch.randn(2, 4), 4, None, torch.zeros(4, dtype=torch.long))


def test_bias_only_layer_norm_matches_pytorch():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = fused_layer_norm(x, 4, None, b)
    want = torch.nn.functional.layer_norm(x, (4,), None, b, 1e-5)
    torch.testing.assert_close(y, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("transform", ["vmap", "jvp"])
def test_bias_only_layer_norm_under_transforms_keeps_the_bias(transform):
    """A LayerNorm with a bias and no weight (fused_layer_norm(x, shape, None, b), Apex's
    fused_layer_norm_affine(x, None, b, shape)) keeps its bias where mixprec runs the
    plain-PyTorch functions, under torch.func.vmap and forward-mode AD (torch.func.jvp).
    Output and tangent against torch.nn.functional.layer_norm in float64 (R15)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    b = torch.randn(4, generator=gen, dtype=torch.float64)
    t = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    want = torch.nn.functional.layer_norm(x, (4,), None, b, 1e-5)
    if transform == "vmap":
        got = torch.func.vmap(lambda r: fused_layer_norm(r, 4, None, b))(x)
    else:
        got, tangent = torch.func.jvp(lambda r: fused_layer_norm(r, 4, None, b), (x,), (t,))
        _, want_tangent = torch.func.jvp(
            lambda r: torch.nn.functional.layer_norm(r, (4,), None, b, 1e-5), (x,), (t,))
        torch.testing.assert_close(tangent, want_tangent, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@KERNEL_DEVICES
def test_bias_gradient_when_only_the_bias_requires_grad(device):
    """Fine-tuning only the biases (BitFit) freezes the input's producer and the weights: the
    norm still records autograd when the bias alone requires grad, and the bias gradient is
    PyTorch's (O22)."""
    device, kernels_on_cpu = device_and_context(device)
    torch.manual_seed(0)
    x = torch.randn(5, 8, device=device)
    w = torch.rand(8, device=device) + 0.5
    b = torch.randn(8, device=device, requires_grad=True)
    dy = torch.randn(5, 8, device=device)
    with kernels_on_cpu():
        y = fused_layer_norm(x, (8,), w, b)
    assert y.requires_grad
    (gb,) = torch.autograd.grad(y, b, dy)
    want = float64_reference("layer", x, (8,), w, b, dy)
    torch.testing.assert_close(y.double(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gb.double(), want[3], atol=1e-5, rtol=1e-5)


# --- memory_efficient reaches the op from every entry point (mutants L03, L08, A05, A07, ...) --
def _saved_ptrs(fn, x):
    saved = []

    def pack(t):
        saved.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    return y, saved


_ME_WEIGHT = torch.ones(16)
_ME_BIAS = torch.zeros(16)

MEMORY_EFFICIENT_CALLS = {
    "fused_layer_norm": lambda me: lambda x: fused_layer_norm(x, 16, memory_efficient=me),
    "fused_rms_norm": lambda me: lambda x: fused_rms_norm(x, 16, memory_efficient=me),
    "MixedFusedLayerNorm": lambda me: MixedFusedLayerNorm(16, memory_efficient=me),
    "MixedFusedRMSNorm": lambda me: MixedFusedRMSNorm(16, memory_efficient=me),
    "apex.fused_layer_norm": lambda me: lambda x: apex_functional.fused_layer_norm(
        x, 16, 1e-6, me),
    "apex.fused_layer_norm_affine": lambda me: lambda x: apex_functional.fused_layer_norm_affine(
        x, _ME_WEIGHT, _ME_BIAS, 16, 1e-6, me),
    "apex.mixed_dtype_fused_layer_norm_affine":
        lambda me: lambda x: apex_functional.mixed_dtype_fused_layer_norm_affine(
            x, _ME_WEIGHT, _ME_BIAS, 16, 1e-6, me),
    "apex.fused_rms_norm_affine": lambda me: lambda x: apex_functional.fused_rms_norm_affine(
        x, _ME_WEIGHT, 16, 1e-6, me),
}


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("name", list(MEMORY_EFFICIENT_CALLS))
def test_memory_efficient_saves_the_output_from_every_entry_point(name, memory_efficient):
    fn = MEMORY_EFFICIENT_CALLS[name](memory_efficient)
    x = torch.randn(8, 16, requires_grad=True)
    y, saved = _saved_ptrs(fn, x)
    assert (y.data_ptr() in saved) == memory_efficient
    assert (x.data_ptr() in saved) != memory_efficient
    y.sum().backward()


# --- _module: flags stored as bools (mutant M05: bool(elementwise_affine) dropped) -----------
def test_truthy_flags_are_stored_as_bools():
    norm = FusedLayerNorm(8, elementwise_affine=1, memory_efficient=1)
    assert norm.elementwise_affine is True and norm.memory_efficient is True
    assert repr(norm) == (
        "FusedLayerNorm((8,), eps=1e-05, elementwise_affine=True, memory_efficient=True)")


# --- _module.extra_repr: "bias=False" only for an affine LayerNorm without bias (mutant M13) ---
def test_extra_repr_of_non_affine_and_bias_free_norms():
    assert repr(FusedLayerNorm(8, elementwise_affine=False)) == (
        "FusedLayerNorm((8,), eps=1e-05, elementwise_affine=False, memory_efficient=False)")
    assert repr(FusedLayerNorm(8, bias=False)) == (
        "FusedLayerNorm((8,), eps=1e-05, elementwise_affine=True, memory_efficient=False, "
        "bias=False)")
    assert repr(FusedRMSNorm(8)) == (
        "FusedRMSNorm((8,), eps=1e-05, elementwise_affine=True, memory_efficient=False)")


def test_rms_norm_without_elementwise_affine_matches_torch():
    """FusedRMSNorm(elementwise_affine=False) learns nothing, as torch.nn.RMSNorm with the same
    flag: no weight, an empty state dict that loads both ways, and the output is the plain
    normalization (PyTorch's rms_norm without a weight, in float64). Models that normalize
    without a scale (e.g. QK-norm variants) rely on it. (R01)"""
    norm = FusedRMSNorm((2, 4), eps=1e-5, elementwise_affine=False)
    theirs = torch.nn.RMSNorm((2, 4), eps=1e-5, elementwise_affine=False)
    assert norm.weight is None and list(norm.parameters()) == []
    assert list(norm.state_dict()) == [] and norm.elementwise_affine is False
    norm.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(norm.state_dict())
    x = make_input((3, 2, 4), torch.float64, "cpu")
    want = torch.nn.functional.rms_norm(x, (2, 4), None, 1e-5)
    torch.testing.assert_close(norm(x), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(norm(x.float()).double(), want, rtol=1e-5, atol=1e-5)


# --- _ops._use_triton: the testing hook takes rows up to MAX_FUSED_N inclusive (mutant O03) ----
def test_triton_on_cpu_path_choice_at_the_row_limit(monkeypatch):
    from mixprec.normalization import _launch

    # (Path choice only: no kernel runs, so the interpreter is not needed.)
    monkeypatch.setattr(_launch, "triton_available", lambda: True)
    monkeypatch.setattr(_launch, "interpreter_enabled", lambda: True)
    limit = _launch.MAX_FUSED_N
    x = torch.empty(1, limit + 1)
    with _ops.triton_on_cpu():
        assert _ops._use_triton(x[:, :limit], limit)
        assert not _ops._use_triton(x, limit + 1)
        assert not _ops._use_triton(x[:, :limit].double(), limit)
        assert not _ops._use_triton(x[:, :8], 8, torch.ones(8, dtype=torch.float64))
    assert not _ops._use_triton(x[:, :8], 8)  # (hook off: CPU takes the PyTorch path)


# --- _ops.norm_bwd_impl: an expanded incoming gradient reaches the kernels as rows (mutant O06) --
@requires_interpreter
def test_fused_norm_bwd_op_takes_an_expanded_gradient_on_the_kernels():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    dy = torch.ones(1, 1).expand(4, 8)  # the gradient of y.sum(): column stride 0
    with _ops.triton_on_cpu():
        y, mean, rstd = torch.ops.mixprec.fused_norm_fwd(x, None, None, 1e-5, False, False,
                                                         torch.float32)
        dx, _, _ = torch.ops.mixprec.fused_norm_bwd(dy, x, None, None, mean, rstd, False, False,
                                                    torch.float32, False, False)
    xd = x.double().requires_grad_(True)
    torch.nn.functional.layer_norm(xd, (8,), eps=1e-5).sum().backward()
    torch.testing.assert_close(dx.double(), xd.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_mixed_norms_create_parameters_in_the_requested_dtype(cls):
    """The Mixed classes take torch.nn's dtype= factory argument: the parameters are created
    in it and, since the output takes the weight's dtype, a half input gives an output of
    that dtype. Users building a float64 (or bf16-parameter) model rely on it. (L19, R20)"""
    norm = cls(8, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in norm.parameters())
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.float64
    ref = (torch.nn.functional.rms_norm(x.double(), (8,), eps=1e-5) if cls is MixedFusedRMSNorm
           else torch.nn.functional.layer_norm(x.double(), (8,), eps=1e-5))
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", [FusedLayerNorm, MixedFusedLayerNorm, FusedRMSNorm,
                                 MixedFusedRMSNorm])
def test_reset_parameters_restores_ones_and_zeros_after_deferred_init(cls):
    """reset_parameters sets the weight to ones and (LayerNorm) the bias to zeros, whatever
    the parameters held: deferred initialisation (build on the meta device, to_empty, then
    reset_parameters, as FSDP and torchdistx do) and re-initialising a trained model rely on
    it. The result must then equal torch's own norm with default parameters. (M3, M1, M2;
    the suite kills M3 only through whatever torch.empty happened to hold)"""
    norm = cls((2, 4), device="meta")
    assert all(p.device.type == "meta" for p in norm.parameters())
    norm = norm.to_empty(device="cpu")
    with torch.no_grad():
        for p in norm.parameters():
            p.fill_(5.0)
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(2, 4))
    if cls in (FusedLayerNorm, MixedFusedLayerNorm):
        assert torch.equal(norm.bias, torch.zeros(2, 4))
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    want = (torch.nn.functional.rms_norm(x, (2, 4), eps=1e-5) if norm._is_rms
            else torch.nn.functional.layer_norm(x, (2, 4), eps=1e-5))
    torch.testing.assert_close(norm(x.float()).double(), want, rtol=1e-5, atol=1e-5)


@KERNEL_DEVICES
@pytest.mark.parametrize("kind, strided", [("layer", "weight"), ("rms", "weight"),
                                           ("layer", "bias")])
def test_kernels_take_a_parameter_that_is_every_other_element(kind, strided, device):
    """A weight or bias whose memory is not one contiguous vector (every other element of a
    buffer, e.g. a parameter tied to a slice of a packed tensor) must be read as its values,
    with and without grad, also where the kernels run. Output and gradients against
    PyTorch's norms in float64 (O02, C22)."""
    device, context = device_and_context(device)
    gen = torch.Generator().manual_seed(11)
    wide_w = (torch.rand(64, generator=gen) + 0.5).to(device)
    wide_b = (0.2 * torch.randn(64, generator=gen)).to(device)
    w = (wide_w[::2] if strided == "weight" else wide_w[:32]).requires_grad_(True)
    b = (wide_b[::2] if strided == "bias" else wide_b[:32]).requires_grad_(True)
    assert not (w if strided == "weight" else b).is_contiguous()
    x = torch.randn(6, 32, generator=gen).to(device).requires_grad_(True)
    dy = torch.randn(6, 32, generator=gen).to(device)
    with context():
        if kind == "layer":
            y = fused_layer_norm(x, 32, w, b)
            got = torch.autograd.grad(y, [x, w, b], dy)
        else:
            y = fused_rms_norm(x, 32, w)
            got = torch.autograd.grad(y, [x, w], dy)
    want = float64_reference(kind, x, (32,), w, b if kind == "layer" else None, dy)
    tol = tolerance(torch.float32)
    torch.testing.assert_close(y.double(), want[0], **tol, msg="output")
    for name, g, r in zip(("dx", "dweight", "dbias"), got, want[1:]):
        torch.testing.assert_close(g.double(), r, **tol, msg=name)


@requires_interpreter
def test_fused_norm_bwd_op_gives_dx_in_the_input_dtype_on_the_kernels():
    """The backward op returns dx in x_dtype (what its fake implementation promises, so what
    torch.compile's graph expects) also when the output's dtype differs, as for the Mixed norms
    (bf16 input, fp32 output and parameters); the parameter gradients keep the parameters'
    dtype. Values against PyTorch's layer norm in float64 (L12)."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4, 8, generator=gen).bfloat16()
    w = torch.rand(8, generator=gen) + 0.5
    b = torch.randn(8, generator=gen)
    dy = torch.randn(4, 8, generator=gen)
    with _ops.triton_on_cpu():
        y, mean, rstd = torch.ops.mixprec.fused_norm_fwd(x, w, b, 1e-5, False, False,
                                                         torch.float32)
        dx, dw, db = torch.ops.mixprec.fused_norm_bwd(dy, x, w, b, mean, rstd, False, False,
                                                      torch.bfloat16, True, True)
    assert y.dtype == torch.float32
    assert dx.dtype == torch.bfloat16 and dw.dtype == db.dtype == torch.float32
    want = float64_reference("layer", x, (8,), w, b, dy)
    torch.testing.assert_close(dx.double(), want[1], **tolerance(torch.bfloat16))
    torch.testing.assert_close(dw.double(), want[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(db.double(), want[3], atol=1e-4, rtol=1e-4)


@_KERNELS_ONLY
def test_second_derivative_through_the_kernels_on_a_row_copy_is_a_clear_error(device):
    """memory_efficient on an input whose memory is not rows (a transposed activation) runs the
    kernels on a row copy; their backward still has no second derivative, so asking for one
    under create_graph=True is an error, not a result silently missing the norm's term. The
    first derivative matches PyTorch's layer norm (O11)."""
    device, kernels_on_cpu = device_and_context(device)
    gen = torch.Generator().manual_seed(13)
    base = torch.randn(16, 4, generator=gen).to(device).requires_grad_(True)
    norm = FusedLayerNorm(16, memory_efficient=True).to(device)
    c = torch.randn(4, 16, generator=gen).to(device)
    with kernels_on_cpu():
        (gx,) = torch.autograd.grad(norm(base.t()).pow(2).sum(), base, create_graph=True)
    ref = base.detach().clone().requires_grad_(True)
    (want,) = torch.autograd.grad(
        torch.nn.functional.layer_norm(ref.t(), (16,), norm.weight, norm.bias).pow(2).sum(), ref)
    torch.testing.assert_close(gx, want, atol=1e-5, rtol=1e-5)
    second = (gx.t() * c).sum() + (base ** 3).sum()
    with pytest.raises(RuntimeError, match="Triton kernels.*differentiate twice"):
        second.backward()


@_KERNELS_ONLY
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_forward_kernel_writes_no_row_past_the_last(kind, device):
    """The forward writes its output's rows and nothing after them: the output is often a view
    of a larger buffer (out=, e.g. the rows of a preallocated activation), whose next rows
    belong to someone else. 21 rows of 45 leave the last 16-row tile 11 rows past the end. The
    rows written match PyTorch's norms in float64; the rest of the buffer keeps its NaNs."""
    device, kernels_on_cpu = device_and_context(device)
    m, n = 21, 45
    x = make_input((m, n), torch.float32, device)
    w, b = (None if t is None else t.detach()
            for t in make_params((n,), torch.float32, device, True, with_bias=kind == "layer"))
    buf = torch.full((m + 16, n), float("nan"), device=device)
    with kernels_on_cpu():
        _launch.forward(x, w, b, 1e-5, kind == "rms", torch.float32, out=buf[:m])
    assert buf[m:].isnan().all(), "the forward wrote past the output's last row"
    want = float64_reference(kind, x, (n,), w, b, torch.ones_like(x))[0]
    torch.testing.assert_close(buf[:m].double(), want, **tolerance(torch.float32))


def test_the_path_cache_is_bounded(monkeypatch):
    """The per-signature path cache is bounded: a model fed ever-new shapes (variable sequence
    lengths) must not grow host memory without limit. Past the bound it starts over, and each
    call's result stays PyTorch's (O21)."""
    monkeypatch.setattr(_ops, "_PATHS", {})
    monkeypatch.setattr(_ops, "_MAX_PATHS", 3)
    for rows in range(1, 9):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(fused_layer_norm(x, (8,)),
                                   torch.nn.functional.layer_norm(x, (8,)))
        assert 1 <= len(_ops._PATHS) <= 3, rows


@requires_interpreter
def test_a_signature_first_seen_off_the_hook_takes_the_kernels_on_it(monkeypatch):
    """triton_on_cpu() routes CPU calls to the kernels even for an input signature already
    seen on the PyTorch path: the tests that use the hook compare the kernels, and a cached
    PyTorch path would compare the reference with itself (O20)."""
    planned = []
    real = _launch.NormPlan.forward

    def spy(self, *args):
        planned.append(self.m)
        return real(self, *args)

    monkeypatch.setattr(_launch.NormPlan, "forward", spy)
    x, w = torch.randn(3, 8), torch.rand(8) + 0.5
    want = torch.nn.functional.layer_norm(x, (8,), w, eps=1e-5)
    torch.testing.assert_close(fused_layer_norm(x, (8,), w), want)  # the PyTorch path
    assert planned == []
    with _ops.triton_on_cpu():
        got = fused_layer_norm(x, (8,), w)
    assert planned == [3]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_module_eps_is_kept_as_a_python_float(cls):
    """A module's eps given as an int or a NumPy scalar (a config read with NumPy) is kept as a
    Python float: TorchScript refuses an int or a NumPy constant for the float eps, so the
    scripted module must still build and give PyTorch's result in float64 with that eps."""
    import numpy as np

    x = make_input((3, 8), torch.float64, "cpu")
    for eps in (0, np.float32(1e-3)):
        norm = cls(8, eps=eps, dtype=torch.float64)
        assert type(norm.eps) is float and norm.eps == float(eps)
        if cls is FusedLayerNorm:
            want = torch.nn.functional.layer_norm(x, (8,), norm.weight, norm.bias, float(eps))
        else:
            want = torch.nn.functional.rms_norm(x, (8,), norm.weight, float(eps))
        got = torch.jit.script(norm)(x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_normalized_shape_of_numpy_ints_is_kept_as_python_ints(cls):
    """normalized_shape given as a list of NumPy integers (shapes read from an array) is kept
    as a tuple of Python ints, as torch.nn.LayerNorm keeps it: the repr shows plain sizes and
    TorchScript, which refuses NumPy constants, scripts the module, giving PyTorch's result
    in float64."""
    import numpy as np

    norm = cls([np.int64(2), np.int32(4)], dtype=torch.float64)
    assert norm.normalized_shape == (2, 4)
    assert all(type(d) is int for d in norm.normalized_shape)
    assert f"{cls.__name__}((2, 4), eps=1e-05" in repr(norm)
    x = make_input((3, 2, 4), torch.float64, "cpu")
    if cls is FusedLayerNorm:
        want = torch.nn.functional.layer_norm(x, (2, 4), norm.weight, norm.bias, 1e-5)
    else:
        want = torch.nn.functional.rms_norm(x, (2, 4), norm.weight, 1e-5)
    torch.testing.assert_close(torch.jit.script(norm)(x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_first_derivative_under_create_graph_matches_torch(cls):
    """With create_graph=True the PyTorch path recomputes the statistics from the saved input
    under autograd; that recomputation must place eps inside the square root like the forward
    (eps 0.5 on inputs of scale 0.1, where placement matters), so a gradient penalty sees the
    same first derivative as without create_graph: both against PyTorch's norm in float64."""
    x = (make_input((5, 8), torch.float64, "cpu") * 0.1).requires_grad_(True)
    dy = make_input((5, 8), torch.float64, "cpu", seed=3)
    norm = cls(8, eps=0.5, dtype=torch.float64)
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    bias = norm.bias if cls is FusedLayerNorm else None
    kind = "layer" if cls is FusedLayerNorm else "rms"
    _, dx_ref, _, _ = float64_reference(kind, x, (8,), norm.weight, bias, dy, eps=0.5)
    for create_graph in (False, True):
        (dx,) = torch.autograd.grad(norm(x), x, dy, create_graph=create_graph)
        torch.testing.assert_close(dx, dx_ref, rtol=1e-10, atol=1e-10,
                                   msg=f"create_graph={create_graph}")


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_third_derivative_on_the_memory_efficient_pytorch_path(cls):
    """memory_efficient keeps y and rstd connected to x so higher derivatives flow through
    them; a third derivative (the second backward itself recorded) must match the norm's
    formula differentiated by autograd in float64."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    v, u, t = (torch.randn(3, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    norm = cls(6, memory_efficient=True, dtype=torch.float64)
    with torch.no_grad():
        for p in norm.parameters():  # (memory_efficient needs non-zero weights)
            p.uniform_(0.5, 1.5, generator=gen)
    w = norm.weight.detach()
    b = norm.bias.detach() if cls is FusedLayerNorm else None

    def third(fn):
        xr = x.clone().requires_grad_(True)
        (g1,) = torch.autograd.grad((fn(xr) * v).sum(), xr, create_graph=True)
        (g2,) = torch.autograd.grad((g1 * u).sum(), xr, create_graph=True)
        (g3,) = torch.autograd.grad((g2 * t).sum(), xr)
        return g1, g2, g3

    # The reference is the norm's formula in plain float64 ops, differentiated by autograd:
    # torch.nn.functional.layer_norm's own third derivative disagrees with finite differences
    # (torch 2.13, CPU), so it cannot serve here.
    def plain(xr):
        xc = xr - xr.mean(-1, keepdim=True) if cls is FusedLayerNorm else xr
        y = xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + 1e-5) * w
        return y + b if b is not None else y

    want = third(plain)
    got = third(norm)
    for order, (g, r) in enumerate(zip(got, want), 1):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-9, msg=f"derivative {order + 1}")
