"""FusedBatchNorm: torch.nn.BatchNorm*d's results on every path, the kernels where they belong.

References: ``torch.nn.functional.batch_norm`` in float64 on the same (rounded) inputs, two
training steps (outputs, input and parameter gradients, running statistics, the batch counter).
Paths: PyTorch's (CPU, fp32, non-channels-last layouts); mixprec's Triton kernels on CPU through
Triton's interpreter (SyncBatchNorm's fused path routed to CPU tensors); the same on CUDA.
"""

import contextlib
import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import amp
from mixprec.normalization import FusedBatchNorm, batch_norm, convert_fused_batchnorm
from mixprec.parallel import SyncBatchNorm

from ..parallel._fused_emulation import emulated_fused_path
from .helpers import requires_cuda, requires_interpreter

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
       torch.float16: dict(rtol=4e-3, atol=4e-3)}

PATHS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cpu-triton", id="cpu-triton", marks=requires_interpreter),
    pytest.param("cuda", id="cuda", marks=requires_cuda),
]


def _path(path):
    """(device, context manager factory) of a test path."""
    if path == "cpu-triton":
        return "cpu", lambda: emulated_fused_path(triton=True)
    return path, contextlib.nullcontext


def _layout(x, dims):
    if dims == 4:
        return x.contiguous(memory_format=torch.channels_last)
    if dims == 5:
        return x.contiguous(memory_format=torch.channels_last_3d)
    return x.contiguous()


@contextlib.contextmanager
def _count_fused_calls():
    calls = []
    real = batch_norm._kernels_batch_norm

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    batch_norm._kernels_batch_norm = spy
    try:
        yield calls
    finally:
        batch_norm._kernels_batch_norm = real


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dims", [2, 4, 5, "4 (1x1)"])  # (N, C, 1, 1) contiguous is (N, C) memory
@pytest.mark.parametrize(
    "dtype,affine,track,momentum",
    [(torch.bfloat16, True, True, 0.1), (torch.float16, True, True, None),
     (torch.bfloat16, False, True, 0.3), (torch.bfloat16, True, False, 0.1),
     (torch.float32, True, True, 0.1)],
    ids=["bf16", "fp16-cumulative", "bf16-no-affine", "bf16-no-running-stats", "fp32"],
)
def test_matches_batchnorm(path, dims, dtype, affine, track, momentum):
    device, path_ctx = _path(path)
    channels = 6
    shape = {2: (20, channels), 4: (4, channels, 5, 3), 5: (2, channels, 3, 2, 4),
             "4 (1x1)": (20, channels, 1, 1)}[dims]
    gen = torch.Generator().manual_seed(11)
    ours = FusedBatchNorm(channels, momentum=momentum, affine=affine,
                          track_running_stats=track).to(device)
    ref = torch.nn.BatchNorm3d(channels, momentum=momentum, affine=affine,
                               track_running_stats=track).double()
    if affine:
        with torch.no_grad():
            ours.weight.copy_(torch.rand(channels, generator=gen) + 0.5)
            ours.bias.copy_(torch.randn(channels, generator=gen))
            ref.weight.copy_(ours.weight)
            ref.bias.copy_(ours.bias)
    with _count_fused_calls() as fused_calls:
        for step in range(2):
            x = (torch.randn(shape, generator=gen) * (1 + step) + 0.5).to(dtype)
            dy = torch.randn(shape, generator=gen).to(dtype)
            xr = x.double().requires_grad_(True)
            xo = _layout(x.to(device), dims).detach().requires_grad_(True)
            with path_ctx():
                y = ours(xo)
                y.backward(_layout(dy.to(device), dims))
            yr = F.batch_norm(xr, ref.running_mean, ref.running_var, ref.weight, ref.bias,
                              True, 1.0 / (step + 1) if momentum is None else momentum, ref.eps)
            yr.backward(dy.double())
            what = f"[{path} {dims}-D {dtype} step {step}]"
            assert y.dtype == dtype and y.shape == xo.shape, what
            torch.testing.assert_close(y.double().cpu(), yr, **TOL[dtype], msg=what + " output")
            torch.testing.assert_close(xo.grad.double().cpu(), xr.grad, **TOL[dtype],
                                       msg=what + " input grad")
            if affine:
                for p, r in ((ours.weight, ref.weight), (ours.bias, ref.bias)):
                    assert p.grad.dtype == torch.float32
                    torch.testing.assert_close(p.grad.double().cpu(), r.grad, **TOL[dtype],
                                               msg=what + " parameter grad")
                    p.grad = None
                    r.grad = None
            if track:
                for b, r in ((ours.running_mean, ref.running_mean),
                             (ours.running_var, ref.running_var)):
                    torch.testing.assert_close(b.double().cpu(), r, rtol=1e-4, atol=1e-5,
                                               msg=what + " running statistics")
                assert int(ours.num_batches_tracked) == step + 1
    # mixprec's kernels exactly for half inputs where PyTorch has no cuDNN path: everything
    # half on CPU (PyTorch's CPU kernels are not cuDNN) when the fused path is routed there
    # (cpu-triton); on CUDA bf16, and fp16 with fp32 parameters only for 2-D inputs (PyTorch
    # gives cuDNN inputs of 3 or more dims).
    expected = {
        "cpu": False,
        "cpu-triton": dtype != torch.float32,
        "cuda": dtype == torch.bfloat16 or (dtype == torch.float16 and dims == 2),
    }[path]
    assert bool(fused_calls) == expected, fused_calls


@pytest.mark.parametrize("path", PATHS[:2])
def test_momentum_zero_keeps_the_running_statistics(path):
    # momentum=0.0 is a momentum like any other number, not "no momentum" (None, the cumulative
    # average): as in torch's BatchNorm, training normalizes with the batch statistics, leaves
    # the running statistics where they are and counts the batches. Users freeze statistics
    # this way while fine-tuning.
    device, path_ctx = _path(path)
    ours, theirs = _pair(torch.bfloat16, momentum=0.0)
    with torch.no_grad():
        for m in (ours, theirs):
            m.running_mean.fill_(0.25)
            m.running_var.fill_(2.0)
    x = _x(torch.bfloat16)
    with path_ctx(), _count_fused_calls() as calls:
        for step in range(2):
            y = ours(x + step)
            torch.testing.assert_close(y.double(), theirs((x + step).double()),
                                       **TOL[torch.bfloat16], msg=f"step {step}")
    assert torch.all(ours.running_mean == 0.25) and torch.all(ours.running_var == 2.0)
    assert torch.all(theirs.running_mean == 0.25) and torch.all(theirs.running_var == 2.0)
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 2
    assert len(calls) == (2 if path == "cpu-triton" else 0)


def test_factory_arguments_place_parameters_and_buffers_as_batchnorm_does():
    # device= and dtype= are torch.nn's factory arguments: FusedBatchNorm makes its
    # parameters and running statistics in that dtype on that device, as BatchNorm2d does
    # (the meta device for deferred initialisation, a float64 or bf16 model built in place);
    # the batch counter stays an integer.
    ours = FusedBatchNorm(6, device="meta", dtype=torch.bfloat16)
    theirs = torch.nn.BatchNorm2d(6, device="meta", dtype=torch.bfloat16)
    got = {k: (v.dtype, v.device, v.shape) for k, v in ours.state_dict().items()}
    want = {k: (v.dtype, v.device, v.shape) for k, v in theirs.state_dict().items()}
    assert got == want and got["weight"][:2] == (torch.bfloat16, torch.device("meta"))
    ours = FusedBatchNorm(6, dtype=torch.float64)
    x = torch.randn(4, 6, 3, 3, dtype=torch.float64)
    y = ours(x)
    assert y.dtype == torch.float64 and ours.running_mean.dtype == torch.float64
    want = F.batch_norm(x, None, None, torch.ones(6, dtype=torch.float64),
                        torch.zeros(6, dtype=torch.float64), True, 0.1, 1e-5)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)


@requires_cuda
@pytest.mark.parametrize(
    "case,expected",
    [("bf16 channels_last", True), ("fp16 channels_last, fp32 parameters", False),
     ("fp16 channels_last, fp16 parameters", True), ("bf16 NCHW", False),
     ("bf16 channels_last, eval", False), ("fp32 channels_last", False),
     ("fp16 2-D, fp32 parameters, no running stats", True)],
)
def test_kernels_where_pytorch_has_no_cudnn_path(case, expected):
    bn = FusedBatchNorm(8, track_running_stats="no running" not in case).cuda()
    dtype = torch.float16 if case.startswith("fp16") else (
        torch.float32 if case.startswith("fp32") else torch.bfloat16)
    if "fp16 parameters" in case:
        bn.half()
    if "eval" in case:
        bn.eval()
    x = torch.randn(4, 8, 6, 6, device="cuda", dtype=dtype)
    if "2-D" in case:
        x = torch.randn(16, 8, device="cuda", dtype=dtype)
    if "channels_last" in case:
        x = x.contiguous(memory_format=torch.channels_last)
    with _count_fused_calls() as calls:
        y = bn(x)
    assert bool(calls) == expected
    want = F.batch_norm(x.float(), None, None, bn.weight.float(), bn.bias.float(),
                        "eval" not in case, 0.0, bn.eps) if "eval" not in case else None
    if want is not None:
        torch.testing.assert_close(y.float(), want, **TOL[dtype])


@requires_interpreter
def test_where_pytorch_would_use_cudnn_it_is_pytorchs_batch_norm(monkeypatch):
    # The kernels only serve calls PyTorch would not give to cuDNN: when PyTorch's backend
    # query names cuDNN, the layer runs PyTorch's batch norm.
    monkeypatch.setattr(batch_norm, "_select_backend", lambda *args: "_BatchNormBackend.Cudnn")
    bn = FusedBatchNorm(6).to(torch.bfloat16)
    x = _x(torch.bfloat16)
    with emulated_fused_path(triton=True), _count_fused_calls() as calls:
        y = bn(x)
    assert not calls
    want = F.batch_norm(x.double(), None, None, bn.weight.double(), bn.bias.double(), True,
                        0.0, bn.eps)
    torch.testing.assert_close(y.double(), want, **TOL[torch.bfloat16])


@requires_interpreter
def test_no_running_statistics_fp16_with_fp32_parameters_takes_the_kernels():
    # Without running statistics PyTorch is asked about cuDNN all the same (training takes the
    # statistics or not alike): an fp16 batch with fp32 parameters where PyTorch has no cuDNN
    # (CPU here) takes the kernels and matches float64 batch norm.
    bn = FusedBatchNorm(6, track_running_stats=False)
    x = _x(torch.float16)
    with emulated_fused_path(triton=True), _count_fused_calls() as calls:
        y = bn(x)
    want = F.batch_norm(x.double(), None, None, bn.weight.double(), bn.bias.double(), True,
                        0.0, bn.eps)
    torch.testing.assert_close(y.double(), want, **TOL[torch.float16])
    assert len(calls) == 1


@pytest.mark.parametrize(
    "dims,x_dtype,w_dtype,expected",
    [(4, torch.float32, torch.float32, True), (3, torch.float16, torch.float32, True),
     (2, torch.float16, torch.float32, False), (4, torch.float16, torch.float16, False),
     (4, torch.bfloat16, torch.float32, False), (4, torch.float32, torch.bfloat16, False)],
)
def test_cudnn_rule_on_a_pytorch_without_the_backend_query(monkeypatch, dims, x_dtype, w_dtype,
                                                            expected):
    # On a PyTorch without torch._C._select_batch_norm_backend (or with another signature of
    # it) the layer judges by the documented rule of torch 2.4-2.13: cuDNN never for bf16, for
    # fp16 input only with fp32 parameters, and only for inputs of 3 or more dims. Layers rely
    # on it to leave cuDNN's cases to PyTorch and to take the others.
    x = torch.zeros((4, 3, 2, 2, 2)[:dims], dtype=x_dtype)
    w = torch.ones(3, dtype=w_dtype)
    monkeypatch.setattr(batch_norm, "_select_backend", None)
    assert batch_norm._pytorch_uses_cudnn(x, w, w.clone(), None, None, 1e-5) is expected

    def other_release(*args):
        raise TypeError("incompatible function arguments")

    monkeypatch.setattr(batch_norm, "_select_backend", other_release)
    assert batch_norm._pytorch_uses_cudnn(x, w, w.clone(), w, w, 1e-5) is expected
    assert batch_norm._pytorch_uses_cudnn(x, w, None, None, None, 1e-5) is False


def test_a_backend_query_that_refuses_with_a_runtime_error_falls_back_to_the_rule(monkeypatch):
    # PyTorch's backend query may refuse a call with a RuntimeError (a check of its own, a
    # release that wants other arguments). The layer then judges by the documented rule of
    # torch 2.4-2.13, as it does for a TypeError, instead of failing the training step.
    #
    def refuses(*args):
        raise RuntimeError("running_mean should contain 3 elements not 1")

    monkeypatch.setattr(batch_norm, "_select_backend", refuses)
    w = torch.ones(3)
    x = torch.zeros(4, 3, 2, 2)
    assert batch_norm._pytorch_uses_cudnn(x.half(), w, w.clone(), w, w, 1e-5) is True
    assert batch_norm._pytorch_uses_cudnn(x.bfloat16(), w, w.clone(), w, w, 1e-5) is False
    assert batch_norm._pytorch_uses_cudnn(x.half(), w.half(), w.half(), None, None,
                                          1e-5) is False


@requires_interpreter
def test_pytorchs_backend_is_asked_about_a_training_call(monkeypatch):
    # The layer asks where PyTorch would run this call, which is a training call. PyTorch's
    # answer takes `training` into account (its cuDNN rule has other batch-size limits in
    # evaluation), so the query must be told so. Here a query that would name cuDNN only for
    # an evaluation call stands in for PyTorch's on CUDA.
    asked = []

    def query(x, w, b, rm, rv, training, eps):
        asked.append(training)
        return "_BatchNormBackend.Native" if training else "_BatchNormBackend.Cudnn"

    monkeypatch.setattr(batch_norm, "_select_backend", query)
    bn = FusedBatchNorm(6).to(torch.bfloat16)
    x = _x(torch.bfloat16)
    with emulated_fused_path(triton=True), _count_fused_calls() as calls:
        y = bn(x)
    assert asked == [True] and len(calls) == 1
    want = F.batch_norm(x.double(), None, None, bn.weight.double(), bn.bias.double(), True,
                        0.0, bn.eps)
    torch.testing.assert_close(y.double(), want, **TOL[torch.bfloat16])


def test_convert_keeps_the_objects_and_the_state_dict():
    shared = torch.nn.BatchNorm2d(4)
    model = torch.nn.Sequential(
        torch.nn.BatchNorm1d(3), torch.nn.Sequential(shared),
        torch.nn.BatchNorm3d(5, affine=False, track_running_stats=False), SyncBatchNorm(6),
    )
    model.add_module("again", shared)  # one layer under two names
    shared.eval()
    shared.qconfig = "kept"
    fired = []
    shared.register_forward_hook(lambda m, args, out: fired.append("hook"))
    before = dict(model.state_dict(keep_vars=True))
    layers = list(model.modules())
    reference = copy.deepcopy(model)
    assert convert_fused_batchnorm(model) is model
    assert list(model.modules()) == layers  # the same objects, in place
    assert [type(m) for m in (model[0], shared, model[2])] == [FusedBatchNorm] * 3
    assert model.again is shared and type(model[3]) is SyncBatchNorm  # subclasses left alone
    assert not shared.training and shared.qconfig == "kept"
    shared(torch.randn(2, 4, 3, 3))
    assert fired == ["hook"]
    after = model.state_dict(keep_vars=True)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    reference.load_state_dict(model.state_dict(), strict=True)
    single = torch.nn.BatchNorm2d(2)
    assert convert_fused_batchnorm(single) is single and type(single) is FusedBatchNorm


def test_convert_refuses_a_lazy_batchnorm_before_its_first_forward_and_a_non_module():
    # A LazyBatchNorm2d is not a BatchNorm2d until its first forward: it was skipped without
    # a word (convert_syncbn_model refuses it so). After one forward it converts.
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.LazyBatchNorm2d())
    with pytest.raises(ValueError, match=r"the layer '1' \(LazyBatchNorm2d\) has not seen an "
                                         r"input yet.*Run one forward pass"):
        convert_fused_batchnorm(model)
    model(torch.randn(2, 3, 6, 6))
    convert_fused_batchnorm(model)
    assert type(model[1]) is FusedBatchNorm
    # Shapes from load_state_dict: still lazy until its first forward, which made it a plain
    # BatchNorm2d, silently unconverted.
    loaded = torch.nn.Sequential(torch.nn.LazyBatchNorm2d())
    loaded.load_state_dict(torch.nn.Sequential(torch.nn.BatchNorm2d(4)).state_dict())
    with pytest.raises(ValueError, match=r"the layer '0' \(LazyBatchNorm2d\) has not seen an"):
        convert_fused_batchnorm(loaded)
    with pytest.raises(TypeError, match=r"convert_fused_batchnorm\(module=NoneType\): expected "
                                        r"a torch\.nn\.Module"):
        convert_fused_batchnorm(None)
    # Only a lazy BatchNorm is refused: other lazy layers (LazyLinear) have nothing to
    # convert and stay to be shaped by the first forward; a lazy BatchNorm passed as the
    # model itself is named as such.
    model = nn.Sequential(nn.LazyLinear(4), nn.BatchNorm1d(4))
    assert convert_fused_batchnorm(model) is model
    assert type(model[1]) is FusedBatchNorm and isinstance(model[0], nn.LazyLinear)
    assert model(torch.randn(5, 3)).shape == (5, 4) and type(model[0]) is nn.Linear
    with pytest.raises(ValueError, match=r"convert_fused_batchnorm: the layer 'passed' "
                                         r"\(LazyBatchNorm2d\) has not seen an input yet"):
        convert_fused_batchnorm(nn.LazyBatchNorm2d())


def test_scripts_and_traces_like_batchnorm():
    torch.manual_seed(0)
    ours, ref = FusedBatchNorm(4), torch.nn.BatchNorm2d(4)
    x = torch.randn(3, 4, 2, 2)
    torch.testing.assert_close(torch.jit.script(ours)(x), ref(x))
    torch.testing.assert_close(ours.running_var, ref.running_var)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), FusedBatchNorm(4), torch.nn.ReLU())
    graph = torch.fx.symbolic_trace(net)  # one opaque call, as torch's BatchNorm is a leaf
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(graph(x), copy.deepcopy(net)(x))


def _trace_noting_tracer_warnings(net, x):
    """``torch.jit.trace`` of ``net``, and the TracerWarnings it gave (their texts, sorted)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", torch.jit.TracerWarning)
        traced = torch.jit.trace(net, x, check_trace=False)
    return traced, sorted(str(w.message) for w in seen
                          if issubclass(w.category, torch.jit.TracerWarning))


@pytest.mark.parametrize("path", PATHS[:2])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_jit_trace_records_pytorchs_batch_norm(path, mode):
    # torch.jit.trace sees traced sizes (tensors) and can save no Python autograd Function:
    # the trace records PyTorch's batch norm (it used to launch the kernels with tensor sizes
    # and fail), saves, loads and matches; the channel check adds no TracerWarning: the trace
    # gives those of BatchNorm2d's (none in eval; in training, PyTorch's own batch-size check
    # in F.batch_norm gives one, for both).
    device, path_ctx = _path(path)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), FusedBatchNorm(4)).bfloat16()
    getattr(net, mode)()
    ref = copy.deepcopy(net)
    plain = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4)).bfloat16()
    getattr(plain, mode)()
    x = torch.randn(2, 3, 5, 5).bfloat16().contiguous(memory_format=torch.channels_last)
    with path_ctx(), _count_fused_calls() as calls:
        traced, warned = _trace_noting_tracer_warnings(net, x)
    assert not calls
    _, plain_warned = _trace_noting_tracer_warnings(plain, x)
    assert warned == plain_warned
    assert bool(warned) == (mode == "train")
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    torch.testing.assert_close(loaded(x), ref(x))
    torch.testing.assert_close(net[1].running_var, ref[1].running_var)


@requires_interpreter
def test_functorch_transforms_take_pytorchs_batch_norm():
    bn = FusedBatchNorm(4, track_running_stats=False)
    ref = torch.nn.BatchNorm2d(4, track_running_stats=False)
    x = torch.randn(2, 4, 3, 3).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)

    def loss(module):
        return lambda p: torch.func.functional_call(module, p, (x,)).float().pow(2).sum()

    with emulated_fused_path(triton=True), _count_fused_calls() as calls:
        got = torch.func.grad(loss(bn))(dict(bn.named_parameters()))
        batched = torch.func.vmap(bn)(torch.randn(3, 2, 4, 3, 3).to(torch.bfloat16))
        assert not calls
        bn(x)
        assert calls  # a plain call still takes the kernels
    want = torch.func.grad(loss(ref))(dict(ref.named_parameters()))
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    assert batched.shape == (3, 2, 4, 3, 3)


@requires_interpreter
@pytest.mark.parametrize("how", ["backward", "grad wrt x"])
@pytest.mark.parametrize("loss", ["square", "linear in the output"])
def test_second_derivative_on_the_kernels_path_is_a_clear_error(loss, how):
    bn = FusedBatchNorm(4)
    x = torch.randn(4, 4, 3, 3).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    with emulated_fused_path(triton=True):
        x.requires_grad_(True)
        y = bn(x).float()
        # A loss linear in y still has a gradient that depends on x: dropping its derivative
        # silently would be wrong, so that case is an error too.
        out = y.pow(2).sum() if loss == "square" else (y * torch.randn_like(y)).sum()
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        # (x also reaches the second loss directly: autograd.grad(..., x) then has a path that
        # skips the norm; the error node must lie on the norm's path to x all the same.)
        second = g.float().pow(2).sum() + x.float().pow(3).sum()
        with pytest.raises(RuntimeError, match="differentiate twice"):
            if how == "backward":
                second.backward()
            else:
                torch.autograd.grad(second, x)


def test_amp_keeps_it_fp32_and_it_copies_after_use():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), FusedBatchNorm(4), torch.nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    x = torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    loss = model(x).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    twin, loaded = copy.deepcopy(model), pickle.loads(pickle.dumps(model))
    for m in (model, twin, loaded):
        m.eval()
    y = model(x)
    for other in (twin, loaded):
        torch.testing.assert_close(other(x), y, rtol=0, atol=0)


def test_bad_input_is_a_clear_error():
    bn = FusedBatchNorm(4)
    with pytest.raises(ValueError, match="at least 2 dims"):
        bn(torch.randn(4))
    with pytest.raises(ValueError, match="has 3 channels in dim 1"):
        bn(torch.randn(2, 3, 5))
    # without parameters or running statistics any channel count goes, as in torch
    assert FusedBatchNorm(4, affine=False, track_running_stats=False)(
        torch.randn(2, 3, 5)).shape == (2, 3, 5)
    # one value per channel in training: PyTorch's own error, on every path
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        bn(torch.randn(1, 4))
    with emulated_fused_path(triton=False), pytest.raises(ValueError, match="more than 1 value"):
        bn(torch.randn(1, 4, 1, 1).to(torch.bfloat16))


def test_a_channel_mismatch_without_affine_parameters_is_a_clear_error():
    # Running statistics fix the channel count even without weight and bias: the layer names
    # the wrong dim, as for affine layers (not PyTorch's message about running_mean's size).
    with pytest.raises(ValueError, match=r"FusedBatchNorm\(4\): the input has 3 channels in dim 1"):
        FusedBatchNorm(4, affine=False)(torch.randn(2, 3, 5))


def test_under_torch_compile_it_is_pytorchs_batch_norm():
    # Dynamo traces torch's batch norm (the compiler makes its own kernels); same results.
    torch.manual_seed(0)
    eager = FusedBatchNorm(4)
    compiled_bn = copy.deepcopy(eager)
    layer = torch.compile(compiled_bn, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(layer(x), eager(x))
    torch.testing.assert_close(compiled_bn.running_var, eager.running_var)


@requires_interpreter
def test_under_torch_compile_half_channels_last_is_pytorchs_batch_norm():
    # Dynamo must not trace into the kernels' Python launcher: a compiled bf16 channels-last
    # layer, which eagerly takes the kernels, compiles in one graph to PyTorch's batch norm.
    ours, theirs = _pair(torch.bfloat16)
    x = _x(torch.bfloat16)
    torch._dynamo.reset()
    with emulated_fused_path(triton=True):
        layer = torch.compile(ours, backend="aot_eager", fullgraph=True)
        y = layer(x)
    torch.testing.assert_close(y.double(), theirs(x.double()), **TOL[torch.bfloat16])
    torch.testing.assert_close(ours.running_var.double(), theirs.running_var,
                               **TOL[torch.bfloat16])


def _reference_step(bn, x, dy, momentum):
    """float64 batch norm of ``x`` with ``bn``'s parameters and running statistics (copies):
    ``(y, dx, dweight, dbias, running_mean, running_var)``."""
    xr = x.detach().double().cpu().requires_grad_(True)
    w = bn.weight.detach().double().cpu().requires_grad_(True)
    b = bn.bias.detach().double().cpu().requires_grad_(True)
    rm, rv = bn.running_mean.double().cpu(), bn.running_var.double().cpu()
    y = F.batch_norm(xr, rm, rv, w, b, True, momentum, bn.eps)
    y.backward(dy.double().cpu())
    return y, xr.grad, w.grad, b.grad, rm, rv


def _check_step(bn, x, dy, dtype, what, momentum=0.1):
    """One training step of ``bn`` on ``x`` against :func:`_reference_step`."""
    ref = _reference_step(bn, x, dy, momentum)
    bn.weight.grad = bn.bias.grad = None
    xo = x.detach().requires_grad_(True)
    y = bn(xo)
    y.backward(dy)
    got = (y, xo.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var)
    names = ("output", "input grad", "weight grad", "bias grad", "running mean", "running var")
    for name, g, r in zip(names, got, ref):
        torch.testing.assert_close(g.double().cpu(), r, **TOL[dtype], msg=f"{what}: {name}")
    assert bn.weight.grad.dtype == bn.weight.dtype and bn.bias.grad.dtype == bn.bias.dtype
    assert xo.grad.dtype == x.dtype and xo.grad.stride() == xo.stride(), what


@pytest.mark.parametrize("path", PATHS[1:])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_parameters_and_changing_signatures(path, dtype):
    # Parameters in half (a pure .bfloat16()/.half() model, O3): the kernels read them as they
    # are and write their gradients in that dtype. The module keeps one plan per signature
    # (shapes, strides, dtypes, devices): .to() between calls and new batch sizes are followed.
    device, path_ctx = _path(path)
    gen = torch.Generator().manual_seed(5)
    bn = FusedBatchNorm(6).to(device)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(6, generator=gen) + 0.5)
        bn.bias.copy_(torch.randn(6, generator=gen))

    def batch(n):
        x = torch.randn(n, 6, 3, 5, generator=gen).to(dtype).to(device)
        dy = torch.randn(n, 6, 3, 5, generator=gen).to(dtype).to(device)
        return _layout(x, 4), _layout(dy, 4)

    with path_ctx(), _count_fused_calls() as calls:
        _check_step(bn, *batch(4), dtype, "fp32 parameters")
        fp32_calls = len(calls)
        bn.to(dtype)
        for n in (4, 7, 4):
            _check_step(bn, *batch(n), dtype, f"{dtype} parameters, batch {n}")
    assert len(calls) == fp32_calls + 3  # every half-parameter call on the kernels
    assert bn.running_var.dtype == dtype and int(bn.num_batches_tracked) == 4


@requires_interpreter
def test_a_layer_fed_ever_changing_shapes_keeps_a_bounded_cache():
    # Plans are kept per input signature; a layer fed many shapes (variable-length batches)
    # must not keep one per shape for ever: at most 16 are kept.
    bn = FusedBatchNorm(2).to(torch.bfloat16)
    with emulated_fused_path(triton=True):
        for n in range(2, 22):
            bn(torch.randn(n, 2).to(torch.bfloat16))
            assert len(bn._cache) <= 16
    assert len(bn._cache) >= 1


@requires_interpreter
def test_a_layer_fed_two_batch_sizes_in_turn_plans_each_once(monkeypatch):
    """The layer's decision (kernels or PyTorch's batch norm, and the launch plan) is made once
    per input signature and kept, because planning costs host time on every call that makes
    it: a layer fed two batch sizes in turn (a short last batch, training and validation
    batches alternating) plans each size once, not again at every switch, and every step
    matches float64 batch norm on the kernels. (B15)"""
    planned = []
    real = FusedBatchNorm._plan_for

    def spy(self, x, *args):
        planned.append(tuple(x.shape))
        return real(self, x, *args)

    monkeypatch.setattr(FusedBatchNorm, "_plan_for", spy)
    gen = torch.Generator().manual_seed(21)
    bn = FusedBatchNorm(6).to(torch.bfloat16)
    with emulated_fused_path(triton=True), _count_fused_calls() as calls:
        for n in (4, 3, 4, 3):
            x = _layout(torch.randn(n, 6, 3, 3, generator=gen).to(torch.bfloat16), 4)
            dy = _layout(torch.randn(n, 6, 3, 3, generator=gen).to(torch.bfloat16), 4)
            _check_step(bn, x, dy, torch.bfloat16, f"batch {n}")
    assert planned == [(4, 6, 3, 3), (3, 6, 3, 3)]
    assert len(calls) == 4 and len(bn._cache) == 2


@pytest.mark.parametrize("path", PATHS[1:])
@pytest.mark.parametrize("handed_back", ["NCHW copy", "fp32 copy", "row at an odd address",
                                         "row as a strided view"])
def test_saved_tensor_hooks_that_hand_back_other_copies(path, handed_back):
    # Activation offloading / compression hooks may return the saved input laid out or typed
    # otherwise, and an arena packing saved tensors may hand the statistics row back at an odd
    # address or as a strided view of interleaved ones: the backward must read what it gets,
    # not assume the forward's memory.
    device, path_ctx = _path(path)
    gen = torch.Generator().manual_seed(8)
    bn = FusedBatchNorm(5).to(device)
    x = _layout(torch.randn(3, 5, 4, 2, generator=gen).to(torch.bfloat16).to(device), 4)
    dy = _layout(torch.randn(3, 5, 4, 2, generator=gen).to(torch.bfloat16).to(device), 4)

    def unpack(t):
        if handed_back.startswith("row"):
            if t.dim() != 1 or t.numel() != 2 * 5 + 1:
                return t
            if handed_back == "row as a strided view":
                base = torch.full((2 * t.numel(),), float("nan"), dtype=t.dtype,
                                  device=t.device)
                base[::2].copy_(t)
                return base[::2]
            base = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
            base[1:].copy_(t)
            return base[1:]
        if t.dim() != 4:
            return t
        return t.contiguous() if handed_back == "NCHW copy" else t.float()

    ref = _reference_step(bn, x, dy, 0.1)
    xo = x.detach().requires_grad_(True)
    with path_ctx(), _count_fused_calls() as calls:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            y = bn(xo)
        y.backward(dy)
    assert calls
    for name, g, r in (("output", y, ref[0]), ("input grad", xo.grad, ref[1]),
                       ("weight grad", bn.weight.grad, ref[2]),
                       ("bias grad", bn.bias.grad, ref[3])):
        torch.testing.assert_close(g.double().cpu(), r, **TOL[torch.bfloat16], msg=name)


@pytest.mark.parametrize("path", PATHS[1:])
def test_a_weight_saved_as_bf16_leaves_the_parameter_gradients_fp32(path):
    # A compressing saved-tensor hook may hand the backward the fp32 weight (amp keeps batch
    # norm's parameters fp32) as a bf16 copy. The weight and bias gradients do not read the
    # weight: they are computed in fp32 and come back in the parameters' own dtype, not
    # rounded to the copy's. Reference: float64 batch norm of the same bf16 input, 1e-5 of
    # each gradient's scale (bf16 rounding would be ~4e-3). The input gradient reads the copy
    # by its own dtype (on a GPU the kernels, compiled for an fp32 weight, must not read bf16
    # memory): against the reference with the bf16-rounded weight, to bf16's tolerance.
    device, path_ctx = _path(path)
    gen = torch.Generator().manual_seed(9)
    bn = FusedBatchNorm(5).to(device)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(5, generator=gen) + 0.5)
        bn.bias.copy_(torch.randn(5, generator=gen))
    x = _layout((torch.randn(3, 5, 4, 2, generator=gen) * 2 + 1).to(torch.bfloat16), 4)
    dy = _layout((torch.randn(3, 5, 4, 2, generator=gen) * 3).to(torch.bfloat16), 4)
    x, dy = x.to(device), dy.to(device)
    ref = _reference_step(bn, x, dy, 0.1)
    rounded = copy.deepcopy(bn)
    with torch.no_grad():
        rounded.weight.copy_(bn.weight.bfloat16())
    ref_dx = _reference_step(rounded, x, dy, 0.1)[1]

    def compress(t):
        return t.to(torch.bfloat16) if t.data_ptr() == bn.weight.data_ptr() else t

    xr = x.detach().requires_grad_(True)
    with path_ctx(), _count_fused_calls() as calls:
        with torch.autograd.graph.saved_tensors_hooks(compress, lambda t: t):
            y = bn(xr)
        y.backward(dy)
    assert calls
    torch.testing.assert_close(xr.grad.double().cpu(), ref_dx, **TOL[torch.bfloat16],
                               msg="input grad")
    for name, g, r in (("weight grad", bn.weight.grad, ref[2]),
                       ("bias grad", bn.bias.grad, ref[3])):
        assert g.dtype == torch.float32, (name, g.dtype)
        torch.testing.assert_close(g.double().cpu(), r, rtol=0,
                                   atol=1e-5 * float(r.abs().max()), msg=name)


@requires_interpreter
def test_a_gradient_in_another_layout_than_the_input():
    # The output gradient may arrive in another memory layout than the input (a consumer that
    # made an NCHW copy of the output): the backward reads it as laid out and matches float64
    # batch norm.
    gen = torch.Generator().manual_seed(6)
    bn = FusedBatchNorm(6).to(torch.bfloat16)
    x = _layout(torch.randn(4, 6, 3, 5, generator=gen).to(torch.bfloat16), 4)
    dy = torch.randn(4, 6, 3, 5, generator=gen).to(torch.bfloat16).contiguous()
    with emulated_fused_path(triton=True), _count_fused_calls() as calls:
        _check_step(bn, x, dy, torch.bfloat16, "NCHW gradient")
    assert len(calls) == 1


@pytest.mark.parametrize("path", PATHS[1:])
def test_batched_gradients(path):
    # torch.autograd.grad(..., is_grads_batched=True) hands the backward batched gradients
    # without storage: the kernels' backward failed on them ("vmap: aten::copy_(self, src)
    # is not possible"). PyTorch's arithmetic takes them, per gradient as a plain backward.
    device, path_ctx = _path(path)
    gen = torch.Generator().manual_seed(12)
    bn = FusedBatchNorm(4).to(device)
    x = _layout(torch.randn(3, 4, 2, 2, generator=gen).to(torch.bfloat16).to(device), 4)
    vs = torch.randn(2, 3, 4, 2, 2, generator=gen).to(torch.bfloat16).to(device)
    xo = x.detach().requires_grad_(True)
    with path_ctx(), _count_fused_calls() as calls:
        y = bn(xo)
        gx, gw = torch.autograd.grad(y, [xo, bn.weight], vs, is_grads_batched=True)
    assert calls  # (the forward ran on the kernels)
    for i in range(len(vs)):
        ref = _reference_step(bn, x, vs[i], 0.1)
        torch.testing.assert_close(gx[i].double().cpu(), ref[1], **TOL[torch.bfloat16])
        torch.testing.assert_close(gw[i].double().cpu(), ref[2], **TOL[torch.bfloat16])


@pytest.mark.parametrize("path", PATHS[1:])
def test_batched_gradients_of_a_layer_without_affine_parameters(path):
    # is_grads_batched=True takes PyTorch's arithmetic in the backward (see
    # test_batched_gradients); a layer without weight and bias (affine=False) has only the
    # input's gradient to give there, per gradient as a plain backward gives it.
    device, path_ctx = _path(path)
    gen = torch.Generator().manual_seed(23)
    bn = FusedBatchNorm(4, affine=False).to(device)
    x = _layout(torch.randn(3, 4, 2, 2, generator=gen).to(torch.bfloat16).to(device), 4)
    vs = torch.randn(2, 3, 4, 2, 2, generator=gen).to(torch.bfloat16).to(device)
    xo = x.detach().requires_grad_(True)
    with path_ctx(), _count_fused_calls() as calls:
        y = bn(xo)
        (gx,) = torch.autograd.grad(y, [xo], vs, is_grads_batched=True)
    assert calls
    xr = x.double().cpu().requires_grad_(True)
    yr = F.batch_norm(xr, None, None, None, None, True, 0.1, bn.eps)
    for i in range(len(vs)):
        (want,) = torch.autograd.grad(yr, xr, vs[i].double().cpu(), retain_graph=True)
        torch.testing.assert_close(gx[i].double().cpu(), want, **TOL[torch.bfloat16])


@requires_cuda
@pytest.mark.parametrize("dims", [2, 4])
def test_unaligned_inputs_and_gradients(dims):
    # Views at odd offsets: Triton specializes kernels on 16-byte alignment, so such tensors
    # take the checked launcher, not the plan's compiled kernels.
    gen = torch.Generator().manual_seed(3)
    bn = FusedBatchNorm(8).cuda()
    shape = (32, 8) if dims == 2 else (4, 8, 3, 3)

    def unaligned(t):
        base = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
        view = base[1:].view(t.shape if dims == 2 else (t.shape[0], *t.shape[2:], t.shape[1]))
        if dims == 4:
            view = view.permute(0, 3, 1, 2)  # channels_last strides
        view.copy_(t)
        return view

    for step, make in enumerate((unaligned, lambda t: _layout(t, dims), unaligned)):
        x = make(torch.randn(shape, generator=gen).to(torch.bfloat16).cuda())
        dy = make(torch.randn(shape, generator=gen).to(torch.bfloat16).cuda())
        assert step == 1 or x.data_ptr() % 16
        with _count_fused_calls() as calls:
            _check_step(bn, x, dy, torch.bfloat16, f"step {step}")
        assert calls


@pytest.mark.parametrize("path", PATHS[1:])
def test_a_parameter_replaced_by_a_strided_one_is_not_read_with_the_old_plan(path):
    # The plan is kept per signature, parameters' and running statistics' geometry included:
    # a weight, a bias or a running variance replaced by a strided view of the same dtype
    # (every other element of a larger tensor: tied parameters, statistics kept interleaved)
    # takes PyTorch's path (the kernels read unit strides), which updates the statistics in
    # place where they lie and leaves the neighbouring elements alone.
    device, path_ctx = _path(path)
    gen = torch.Generator().manual_seed(2)
    x = _layout(torch.randn(4, 6, 3, 3, generator=gen).to(torch.bfloat16).to(device), 4)
    dy = _layout(torch.randn(4, 6, 3, 3, generator=gen).to(torch.bfloat16).to(device), 4)
    for name in ("weight", "bias", "running_var"):
        bn = FusedBatchNorm(6).to(device)
        shared = (torch.rand(6, 2, generator=gen) + 0.5).to(device)
        neighbours = shared[:, 1].clone()
        with path_ctx(), _count_fused_calls() as calls:
            _check_step(bn, x, dy, torch.bfloat16, f"contiguous {name}")
            strided = shared.view(-1)[::2]
            setattr(bn, name, strided if name == "running_var" else nn.Parameter(strided))
            _check_step(bn, x, dy, torch.bfloat16, f"strided {name}")
        assert len(calls) == 1, name
        assert torch.equal(shared[:, 1], neighbours), name


@requires_interpreter
def test_one_layer_fed_channels_last_then_nchw_batches_of_one_shape():
    # The kernels read dense channels-last memory: after a channels-last batch, an NCHW batch
    # of the same shape and dtype takes PyTorch's batch norm and gives the same results.
    gen = torch.Generator().manual_seed(4)
    bn = FusedBatchNorm(6).to(torch.bfloat16)
    x = torch.randn(4, 6, 3, 5, generator=gen).to(torch.bfloat16)
    dy = torch.randn(4, 6, 3, 5, generator=gen).to(torch.bfloat16)
    with emulated_fused_path(triton=True), _count_fused_calls() as calls:
        _check_step(bn, _layout(x, 4), _layout(dy, 4), torch.bfloat16, "channels_last")
        _check_step(bn, x.contiguous(), dy.contiguous(), torch.bfloat16, "NCHW")
    assert len(calls) == 1


@requires_interpreter
def test_one_layer_fed_bf16_then_fp16_batches_of_one_layout(monkeypatch):
    # One layer (fp32 parameters) may see bf16 and fp16 batches of the same shape and strides
    # (a model run under autocast of either dtype). PyTorch gives the fp16 batch to cuDNN and
    # not the bf16 one, so the choice is made per input dtype: the fp16 batch, after a bf16
    # one, runs PyTorch's batch norm. The documented rule (no backend query) stands in for
    # PyTorch's on CUDA.
    monkeypatch.setattr(batch_norm, "_select_backend", None)
    gen = torch.Generator().manual_seed(13)
    bn = FusedBatchNorm(6)
    base = torch.randn(4, 6, 3, 5, generator=gen)
    dy = torch.randn(4, 6, 3, 5, generator=gen)
    with emulated_fused_path(triton=True), _count_fused_calls() as calls:
        for dtype in (torch.bfloat16, torch.float16):
            x = _layout(base.to(dtype), 4)
            _check_step(bn, x, _layout(dy.to(dtype), 4), dtype, str(dtype))
    assert len(calls) == 1  # (the bf16 batch)


@requires_interpreter
def test_a_layer_follows_the_kernels_switch_after_use():
    # The decision is kept per signature; flipping SyncBatchNorm's switch for the kernels
    # (which FusedBatchNorm's rule reads too) must reach layers that already ran.
    from mixprec.parallel import _sync_batchnorm_function as sbf

    gen = torch.Generator().manual_seed(3)
    bn = FusedBatchNorm(6).to(torch.bfloat16)
    x = _layout(torch.randn(4, 6, 3, 3, generator=gen).to(torch.bfloat16), 4)
    dy = _layout(torch.randn(4, 6, 3, 3, generator=gen).to(torch.bfloat16), 4)
    with emulated_fused_path(triton=True):
        with _count_fused_calls() as on:
            _check_step(bn, x, dy, torch.bfloat16, "kernels on")
        saved = sbf._OPS.triton_channels_last
        sbf._OPS.triton_channels_last = False
        try:
            with _count_fused_calls() as off:
                _check_step(bn, x, dy, torch.bfloat16, "kernels off")
        finally:
            sbf._OPS.triton_channels_last = saved
    assert len(on) == 1 and not off, (on, off)


@pytest.mark.skipif(not batch_norm._TORCH_BN_TAKES_BIAS,
                    reason="this PyTorch's BatchNorm has no bias argument")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cls", [FusedBatchNorm, SyncBatchNorm])
def test_bias_false_matches_batchnorm_without_a_bias(cls, path):
    # nn.BatchNorm2d(C, bias=False): a weight and no bias. Both layers take the argument, and
    # match PyTorch's layer on each path (bf16 channels-last: the kernels where they run).
    device, path_ctx = _path(path)
    ours = cls(6, bias=False).to(device)
    ref = torch.nn.BatchNorm2d(6, bias=False).double()
    assert ours.bias is None and "bias" not in ours.state_dict()
    assert list(ours.state_dict()) == list(ref.state_dict())
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(6, generator=gen) + 0.5)
        ref.weight.copy_(ours.weight)
    x = torch.randn(4, 6, 5, 3, generator=gen).bfloat16()
    dy = torch.randn(4, 6, 5, 3, generator=gen).bfloat16()
    xo = _layout(x.to(device), 4).requires_grad_(True)
    xr = x.double().requires_grad_(True)
    with path_ctx():
        y = ours(xo)
        y.backward(_layout(dy.to(device), 4))
    yr = ref(xr)
    yr.backward(dy.double())
    torch.testing.assert_close(y.double().cpu(), yr.detach(), **TOL[torch.bfloat16])
    torch.testing.assert_close(xo.grad.double().cpu(), xr.grad, **TOL[torch.bfloat16])
    torch.testing.assert_close(ours.weight.grad.double().cpu(), ref.weight.grad,
                               **TOL[torch.bfloat16])
    torch.testing.assert_close(ours.running_mean.double().cpu(), ref.running_mean,
                               rtol=1e-4, atol=1e-5)


def test_bias_false_on_a_pytorch_without_it_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(batch_norm, "_TORCH_BN_TAKES_BIAS", False)
    for cls in (FusedBatchNorm, SyncBatchNorm):
        with pytest.raises(TypeError, match=rf"{cls.__name__}\(bias=False\): this PyTorch .* "
                                            r"no BatchNorm without a bias.*requires_grad_"):
            cls(4, bias=False)
        assert cls(4, bias=True).bias is not None
    with pytest.raises(TypeError, match=r"FusedBatchNorm\(bias='no'\): must be a bool"):
        FusedBatchNorm(4, bias="no")


# -- which gradients the backward gives: frozen parameters, an input without grad -------------
_TRAINED = {
    "frozen weight": (True, False, True),
    "frozen bias": (True, True, False),
    "input without grad": (False, True, True),
    "only the bias": (False, False, True),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("saved", ["as saved", "NCHW copy"])
@pytest.mark.parametrize("trained", list(_TRAINED))
def test_each_tensor_that_requires_grad_gets_batchnorms_gradient(path, saved, trained):
    # Fine-tuning freezes one affine parameter and trains the other (a frozen scale with a
    # trained shift), and a layer right on the data or after a frozen backbone gets an input
    # without requires_grad: every tensor that requires grad gets float64 BatchNorm's gradient
    # and the others none, on the kernels' backward and on the PyTorch arithmetic it takes when
    # a saved-tensor hook hands the input back as an NCHW copy. bf16 channels-last input, so
    # cpu-triton runs the kernels. (A01 A04 A08 A09 A11 B02 B03 B04 B05)
    device, path_ctx = _path(path)
    x_grad, w_grad, b_grad = _TRAINED[trained]
    gen = torch.Generator().manual_seed(31)
    bn = FusedBatchNorm(6).to(device)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(6, generator=gen) + 0.5)
        bn.bias.copy_(torch.randn(6, generator=gen))
    bn.weight.requires_grad_(w_grad)
    bn.bias.requires_grad_(b_grad)
    x = (torch.randn(4, 6, 3, 5, generator=gen) * 1.5 + 0.5).to(torch.bfloat16)
    dy = torch.randn(4, 6, 3, 5, generator=gen).to(torch.bfloat16)
    xr = x.double().requires_grad_(x_grad)
    wr = bn.weight.detach().double().cpu().requires_grad_(w_grad)
    br = bn.bias.detach().double().cpu().requires_grad_(b_grad)
    yr = F.batch_norm(xr, None, None, wr, br, True, 0.1, bn.eps)
    yr.backward(dy.double())
    xo = _layout(x.to(device), 4).requires_grad_(x_grad)

    def unpack(t):
        return t.contiguous() if saved == "NCHW copy" and t.dim() == 4 else t

    with path_ctx(), _count_fused_calls() as calls:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            y = bn(xo)
        y.backward(_layout(dy.to(device), 4))
    assert bool(calls) == (path != "cpu"), calls
    torch.testing.assert_close(y.detach().double().cpu(), yr.detach(), **TOL[torch.bfloat16])
    for name, got, want in (("input", xo, xr), ("weight", bn.weight, wr), ("bias", bn.bias, br)):
        if want.requires_grad:
            assert got.grad is not None, f"[{path} {trained}] no {name} gradient"
            torch.testing.assert_close(got.grad.double().cpu(), want.grad, **TOL[torch.bfloat16],
                                       msg=f"[{path} {trained} {saved}] {name} grad")
        else:
            assert got.grad is None, f"[{path} {trained}] {name} got a gradient"


# -- BatchNorm modes, copies, subclasses left alone (mutation testing) ----------------------------
DTYPES = [torch.float32, torch.bfloat16]


def _pair(dtype, **kwargs):
    torch.manual_seed(0)
    ours = FusedBatchNorm(6, **kwargs)
    theirs = torch.nn.BatchNorm2d(6, **kwargs)
    if ours.weight is not None:
        with torch.no_grad():
            ours.weight.uniform_(0.5, 1.5)
            ours.bias.uniform_(-0.5, 0.5)
    theirs.load_state_dict(ours.state_dict())
    return ours.to(dtype), theirs.double()


def _x(dtype):
    torch.manual_seed(1)
    x = (torch.randn(4, 6, 5, 3) * 2 + 1).to(dtype)
    return x.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", DTYPES)
def test_eval_without_running_statistics_uses_the_batch(dtype):
    # track_running_stats=False: no buffers, so eval normalizes with the batch statistics too
    # (torch's bn_training rule).
    ours, theirs = _pair(dtype, track_running_stats=False)
    ours.eval()
    theirs.eval()
    x = _x(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours(x).double(), theirs(x.double()), rtol=tol, atol=tol)


def test_eval_with_one_running_statistic_removed_is_batchnorms_error():
    """Evaluation normalizes with the batch only when the layer has no running statistics at
    all (torch's rule). A layer with one of the two removed (running_var set to None) is
    broken, not statistics-free: torch's BatchNorm refuses it in eval, and the layer must
    refuse it the same way rather than silently normalize with the batch. The reference's
    error (type and message) is taken from the installed PyTorch. (B23)"""
    ours, theirs = _pair(torch.float32)
    x = _x(torch.float32)
    for m in (ours, theirs):
        m.eval()
        m.running_var = None
    with pytest.raises(Exception) as want:
        theirs(x.double())
    with pytest.raises(want.type) as got:
        ours(x)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_track_running_stats_switched_off_leaves_the_buffers(dtype):
    # A built layer whose track_running_stats is set to False (a common way to train on batch
    # statistics alone): training must neither read nor update the running statistics, and
    # eval uses them.
    ours, theirs = _pair(dtype)
    with torch.no_grad():
        for m in (ours, theirs):
            m.running_mean.fill_(0.25)
            m.running_var.fill_(2.0)
    for m in (ours, theirs):
        m.track_running_stats = False
    x = _x(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours(x).double(), theirs(x.double()), rtol=tol, atol=tol)
    torch.testing.assert_close(ours.running_mean.double(), theirs.running_mean)
    torch.testing.assert_close(ours.running_var.double(), theirs.running_var)
    assert torch.all(ours.running_mean == 0.25) and torch.all(ours.running_var == 2.0)
    # In eval it still normalizes with those kept buffers, as torch's BatchNorm (a way to
    # freeze statistics). (B33)
    for m in (ours, theirs):
        m.eval()
    torch.testing.assert_close(ours(x).double(), theirs(x.double()), rtol=tol, atol=tol)


@requires_interpreter
def test_copies_of_a_layer_that_ran_the_kernels():
    # The layer keeps launch plans per input signature; copies (deepcopy, pickle, torch.save)
    # start without them and give the same results.
    bn = FusedBatchNorm(6).to(torch.bfloat16)
    x = _x(torch.bfloat16)
    with emulated_fused_path(triton=True):
        bn(x)
        assert bn._cache  # (the kernels' plan is kept)
        buffer = io.BytesIO()
        torch.save(bn, buffer)
        buffer.seek(0)
        copies = [copy.deepcopy(bn), pickle.loads(pickle.dumps(bn)),
                  torch.load(buffer, weights_only=False)]
        for c in copies:
            assert c._cache == {}
        bn.eval()
        want = bn(x)
        for c in copies:
            c.eval()
            torch.testing.assert_close(c(x), want, rtol=0, atol=0)


class ScaledBatchNorm(nn.BatchNorm2d):
    """A user's BatchNorm2d subclass with its own forward."""

    def forward(self, x):
        return super().forward(x) * 2


def test_subclasses_are_left_alone_and_plain_layers_converted():
    model = nn.Sequential(nn.BatchNorm2d(3), ScaledBatchNorm(3), SyncBatchNorm(3),
                          nn.BatchNorm1d(3))
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4)
    want = model[1](x)
    converted = convert_fused_batchnorm(model)
    assert converted is model
    assert [type(m) for m in model] == [FusedBatchNorm, ScaledBatchNorm, SyncBatchNorm,
                                        FusedBatchNorm]
    # The subclass keeps its own forward (the doubled output), as it had before.
    torch.testing.assert_close(model[1](x), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_convert_after_initialize_converts_amp_fp32_batchnorm(dtype):
    # O1 with keep_batchnorm_fp32 gives each BatchNorm amp's class; converting afterwards left
    # them plain BatchNorm without a word. Now they become FusedBatchNorm and keep amp's fp32
    # forward: the same outputs and gradients as converting before initialize.
    from mixprec.amp._model import is_amp_model

    from ..amp.helpers import check_conversion_after_initialize

    after = check_conversion_after_initialize(convert_fused_batchnorm, FusedBatchNorm, dtype)
    assert type(amp.restore_model(after)[1]) is FusedBatchNorm

    root = amp.initialize(nn.BatchNorm2d(3), opt_level="O2", dtype=dtype, verbosity=0)
    convert_fused_batchnorm(root)  # a BatchNorm passed as the model: amp's class too
    assert isinstance(root, FusedBatchNorm) and is_amp_model(root)
    assert root(torch.randn(2, 3, 4, 4)).dtype == torch.float32


@requires_interpreter
def test_eval_after_kernel_training_uses_the_running_statistics():
    # Evaluation normalizes with the running statistics (never the batch), on the path where
    # training ran the kernels too, and leaves the statistics and the batch counter as they are.
    ours, theirs = _pair(torch.bfloat16)
    x = _x(torch.bfloat16)
    with emulated_fused_path(triton=True):
        ours(x)
        theirs(x.double())
        ours.eval()
        theirs.eval()
        x2 = (x.float() * 3 + 2).to(torch.bfloat16)
        mean_before = ours.running_mean.clone()
        with _count_fused_calls() as calls:
            y = ours(x2)
    torch.testing.assert_close(y.double(), theirs(x2.double()), **TOL[torch.bfloat16])
    assert torch.equal(ours.running_mean, mean_before) and int(ours.num_batches_tracked) == 1
    assert not calls


@pytest.mark.parametrize("path", PATHS[:2])
def test_training_with_tracking_switched_off_keeps_the_batch_counter(path):
    # torch's BatchNorm counts batches only while it tracks running statistics. A layer trained
    # a while on batch statistics alone (track_running_stats set to False after building) keeps
    # its counter, so that with momentum=None the cumulative average resumes where it stopped
    # once tracking is switched back on. (B10)
    device, path_ctx = _path(path)
    ours, theirs = _pair(torch.bfloat16, momentum=None)
    x = _x(torch.bfloat16)
    with path_ctx():
        for m, inp in ((ours, x), (theirs, x.double())):
            m(inp)
            m.track_running_stats = False
            m(inp * 2)
            m.track_running_stats = True
            m(inp + 1)
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 2
    torch.testing.assert_close(ours.running_mean.double(), theirs.running_mean,
                               **TOL[torch.bfloat16])
    torch.testing.assert_close(ours.running_var.double(), theirs.running_var,
                               **TOL[torch.bfloat16])


@pytest.mark.parametrize("path", PATHS[:2])
def test_tracking_switched_on_in_a_layer_built_without_it(path):
    # A layer built with track_running_stats=False has no running statistics and no batch
    # counter. Setting the flag to True afterwards (a config applied to a built model) changes
    # nothing in torch's BatchNorm: training still normalizes with the batch statistics and
    # nothing is counted. The layer must do the same, not fail on the missing counter.
    device, path_ctx = _path(path)
    ours, theirs = _pair(torch.bfloat16, track_running_stats=False)
    for m in (ours, theirs):
        m.track_running_stats = True
    x = _x(torch.bfloat16)
    with path_ctx():
        y = ours(x)
    torch.testing.assert_close(y.double(), theirs(x.double()), **TOL[torch.bfloat16])
    assert ours.running_mean is None and ours.running_var is None
    assert ours.num_batches_tracked is None and theirs.num_batches_tracked is None


@pytest.mark.parametrize("path", PATHS[:2])
def test_cumulative_average_without_a_batch_counter_leaves_the_statistics(path):
    """momentum=None averages over the batches counted so far. A layer whose batch counter is
    unregistered (the buffer set to None, which torch's BatchNorm accepts) has no count: torch's
    BatchNorm then updates with a factor of 0, leaving the running statistics where they are,
    and the layer must do the same on each path rather than fall back to some default
    momentum. Output against torch's layer in float64. (B22)"""
    device, path_ctx = _path(path)
    ours, theirs = _pair(torch.bfloat16, momentum=None)
    for m in (ours, theirs):
        m.register_buffer("num_batches_tracked", None)
        with torch.no_grad():
            m.running_mean.fill_(0.25)
            m.running_var.fill_(2.0)
    x = _x(torch.bfloat16)
    with path_ctx():
        y = ours(x)
    torch.testing.assert_close(y.double(), theirs(x.double()), **TOL[torch.bfloat16])
    assert torch.all(theirs.running_mean == 0.25) and torch.all(theirs.running_var == 2.0)
    assert torch.all(ours.running_mean == 0.25) and torch.all(ours.running_var == 2.0)
    assert ours.num_batches_tracked is None


@requires_interpreter
def test_eval_without_running_statistics_takes_the_kernels_as_training_does():
    # A layer without running statistics normalizes with the batch statistics in eval too,
    # which is PyTorch's training batch norm, with its slow half-precision path. So a bf16
    # channels-last batch takes the kernels there as in training (models evaluated with
    # track_running_stats=False keep the speed), with float64 batch norm's output and input
    # gradient.
    ours, _ = _pair(torch.bfloat16, track_running_stats=False)
    ours.eval()
    gen = torch.Generator().manual_seed(24)
    x = _x(torch.bfloat16)
    dy = _layout(torch.randn(4, 6, 5, 3, generator=gen).to(torch.bfloat16), 4)
    xo = x.detach().requires_grad_(True)
    with emulated_fused_path(triton=True), _count_fused_calls() as calls:
        y = ours(xo)
        y.backward(dy)
    assert len(calls) == 1
    xr = x.double().requires_grad_(True)
    yr = F.batch_norm(xr, None, None, ours.weight.detach().double(),
                      ours.bias.detach().double(), True, 0.1, ours.eps)
    yr.backward(dy.double())
    torch.testing.assert_close(y.double(), yr.detach(), **TOL[torch.bfloat16])
    torch.testing.assert_close(xo.grad.double(), xr.grad, **TOL[torch.bfloat16])


@requires_interpreter
def test_a_layer_follows_its_eps_into_pytorchs_cudnn_rule(monkeypatch):
    # PyTorch gives a call to cuDNN only for eps of at least cuDNN's minimum (1e-5), so the
    # layer's choice between the kernels and PyTorch's batch norm depends on eps, and a layer
    # whose eps is changed after use (fine-tuning recipes set it) must ask again, not reuse
    # the choice made for the old eps. Here a backend query that answers by eps stands in for
    # PyTorch's on CUDA. (B07)
    monkeypatch.setattr(batch_norm, "_select_backend",
                        lambda x, w, b, rm, rv, training, eps:
                        "_BatchNormBackend.Cudnn" if eps >= 1e-5 else "_BatchNormBackend.Native")
    bn = FusedBatchNorm(6, eps=1e-6).to(torch.bfloat16)
    x = _x(torch.bfloat16)
    with emulated_fused_path(triton=True), _count_fused_calls() as calls:
        bn(x)
        assert len(calls) == 1
        bn.eps = 1e-3
        y = bn(x)
    assert len(calls) == 1  # the second call is PyTorch's
    want = F.batch_norm(x.double(), None, None, bn.weight.double(), bn.bias.double(), True,
                        0.0, 1e-3)
    torch.testing.assert_close(y.double(), want, **TOL[torch.bfloat16])


@requires_interpreter
def test_tracking_switched_off_after_kernel_training_gives_batch_norms_gradients():
    # A layer that trained on the kernels with running statistics, then has
    # track_running_stats set to False (fine-tuning on batch statistics alone), is a new call
    # signature for the kernels (no running statistics to update): its output and gradients
    # are float64 batch norm's without running statistics, its buffers stay as they were, and
    # the kernels still serve it. (B24)
    ours, _ = _pair(torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    x = _x(torch.bfloat16)
    x2 = _layout((torch.randn(4, 6, 5, 3, generator=gen) * 3 + 2).to(torch.bfloat16), 4)
    dy = _layout(torch.randn(4, 6, 5, 3, generator=gen).to(torch.bfloat16), 4)
    with emulated_fused_path(triton=True), _count_fused_calls() as calls:
        ours(x)
        mean, var = ours.running_mean.clone(), ours.running_var.clone()
        ours.track_running_stats = False
        xo = x2.detach().requires_grad_(True)
        y = ours(xo)
        y.backward(dy)
    xr = x2.double().requires_grad_(True)
    w = ours.weight.detach().double().requires_grad_(True)
    b = ours.bias.detach().double().requires_grad_(True)
    yr = F.batch_norm(xr, None, None, w, b, True, 0.1, ours.eps)
    yr.backward(dy.double())
    for name, got, want in (("output", y, yr), ("input grad", xo.grad, xr.grad),
                            ("weight grad", ours.weight.grad, w.grad),
                            ("bias grad", ours.bias.grad, b.grad)):
        torch.testing.assert_close(got.double(), want.detach(), **TOL[torch.bfloat16], msg=name)
    assert torch.equal(ours.running_mean, mean) and torch.equal(ours.running_var, var)
    assert len(calls) == 2 and int(ours.num_batches_tracked) == 1


@requires_interpreter
def test_a_layer_follows_cudnn_being_switched_off_after_use(monkeypatch):
    # With torch.backends.cudnn.enabled = False PyTorch's batch norm leaves cuDNN, so calls a
    # layer gave to PyTorch for cuDNN's sake take the kernels from then on, in layers that
    # already ran (and back again). Here a backend query that reads the switch stands in for
    # PyTorch's on CUDA. (B26)
    monkeypatch.setattr(batch_norm, "_select_backend",
                        lambda *args: "_BatchNormBackend.Cudnn" if torch.backends.cudnn.enabled
                        else "_BatchNormBackend.Native")
    bn = FusedBatchNorm(6).to(torch.bfloat16)
    x = _x(torch.bfloat16)
    want = F.batch_norm(x.double(), None, None, bn.weight.double(), bn.bias.double(), True,
                        0.0, bn.eps)
    with emulated_fused_path(triton=True), _count_fused_calls() as calls:
        with torch.backends.cudnn.flags(enabled=True):
            bn(x)
        assert not calls
        with torch.backends.cudnn.flags(enabled=False):
            y = bn(x)
        assert len(calls) == 1
        with torch.backends.cudnn.flags(enabled=True):
            bn(x)
    assert len(calls) == 1
    torch.testing.assert_close(y.double(), want, **TOL[torch.bfloat16])
