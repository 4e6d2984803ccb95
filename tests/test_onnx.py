"""ONNX export of mixprec models, run in onnxruntime on the CPU.

Each case exports a mixprec model and, where one exists, the same architecture built from plain
``torch.nn`` modules (the reference), runs the graphs in onnxruntime's CPU provider and compares:

* fp32: onnxruntime vs PyTorch's eval output within atol = rtol = 1e-5 (seen <= 1e-6);
* fp16 amp models: within atol = rtol = 4e-3, about two fp16 steps below 4 (onnxruntime runs
  some fp16 nodes in fp32 between casts of its own, so its roundings differ from PyTorch's);
  mixprec's graph and the plain half model's give the same values (1e-6).

bf16 is not run: onnxruntime's CPU provider has no bf16 kernels (for plain models too). Skipped
without onnx and onnxruntime; the ``dynamo=True`` exporter (``torch.export``) also needs
onnxscript. Few cases use it: each takes seconds on a CPU.
"""
import copy
import warnings

import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import mixprec.normalization as mn  # noqa: E402
from mixprec import amp  # noqa: E402
from mixprec.parallel import SyncBatchNorm, convert_syncbn_model  # noqa: E402

try:
    import onnxscript  # noqa: F401
except ImportError:
    onnxscript = None

_NEEDS_ONNXSCRIPT = pytest.mark.skipif(
    onnxscript is None or not hasattr(torch.compiler, "_is_exporting_flag"),
    reason="torch.onnx.export(dynamo=True) needs onnxscript, and mixprec's norms are "
           "recorded as PyTorch's in torch.export from PyTorch 2.7")


def dynamo(*values):
    """A parameter row exported with ``dynamo=True`` (``torch.export``)."""
    return pytest.param(*values, True, marks=_NEEDS_ONNXSCRIPT,
                        id="-".join([*map(str, values), "dynamo"]))


def torchscript(*values):
    """A parameter row exported with ``dynamo=False`` (the TorchScript exporter)."""
    return pytest.param(*values, False, id="-".join([*map(str, values), "torchscript"]))


FP32_TOL = dict(atol=1e-5, rtol=1e-5)
FP16_TOL = dict(atol=4e-3, rtol=4e-3)


@pytest.fixture(autouse=True)
def _quiet():
    ort.set_default_logger_severity(3)
    with warnings.catch_warnings():
        # (The exporters' own deprecation and tracer notes; not mixprec's.)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        yield


class CNN(nn.Module):
    def __init__(self, bn=None):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = bn if bn is not None else nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class MLP(nn.Module):
    def __init__(self, norm=nn.LayerNorm):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.n1 = norm(32)
        self.fc2 = nn.Linear(32, 16)
        self.n2 = norm(16)

    def forward(self, x):
        h = nn.functional.gelu(self.n1(self.fc1(x)))
        return self.n2(x + self.fc2(h))


def _built(kind, norm=None):
    """A model with non-trivial norm parameters and running statistics, and its input."""
    torch.manual_seed(0)
    if kind == "cnn":
        model, x = CNN(norm(8) if norm is not None else None), torch.randn(2, 3, 8, 8)
    else:
        model, x = (MLP(norm) if norm is not None else MLP()), torch.randn(2, 5, 16)
    with torch.no_grad():
        for name, t in model.named_buffers():
            if name.endswith("running_var"):
                t.uniform_(0.5, 2.0)
            elif name.endswith("running_mean"):
                t.uniform_(-0.5, 0.5)
        for name, p in model.named_parameters():
            if name.startswith(("bn", "n1", "n2")):
                p.uniform_(0.5, 1.5)
    return model, x


def _run_exported(model, args, path, dynamo, **kw):
    """Export ``model`` in eval mode, check its graph holds standard ops only, run it."""
    model.eval()
    with torch.no_grad():
        torch.onnx.export(model, args, str(path), dynamo=dynamo, **kw)
    graph = onnx.load(str(path)).graph
    custom = {f"{n.domain}::{n.op_type}" for n in graph.node if n.domain not in ("", "ai.onnx")}
    assert not custom, f"non-standard ops in the exported graph: {custom}"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    return torch.from_numpy(session.run(None, feeds)[0])


class _PlainHalf(nn.Module):
    """What amp O2/O3 computes, in plain PyTorch: the model in ``dtype`` (BatchNorm fp32 where
    ``keep_bn_fp32``), inputs cast to it, outputs to fp32."""

    def __init__(self, model, dtype, keep_bn_fp32):
        super().__init__()
        self.dtype = dtype
        bns = [m for m in model.modules()
               if keep_bn_fp32 and isinstance(m, nn.modules.batchnorm._BatchNorm)]
        kept = [copy.deepcopy(m.state_dict()) for m in bns]
        self.inner = model.to(dtype)
        for m, state in zip(bns, kept):  # (fp32 again, with their values never rounded)
            m.float().load_state_dict(state)

    def forward(self, x):
        return self.inner(x.to(self.dtype)).float()


NORMS = {
    "FusedLayerNorm": (mn.FusedLayerNorm, nn.LayerNorm),
    "MixedFusedLayerNorm": (mn.MixedFusedLayerNorm, nn.LayerNorm),
    "FusedLayerNorm_memory_efficient": (
        lambda n: mn.FusedLayerNorm(n, memory_efficient=True), nn.LayerNorm),
    "FusedRMSNorm": (lambda n: mn.FusedRMSNorm(n, eps=1e-5), lambda n: nn.RMSNorm(n, eps=1e-5)),
}


@pytest.mark.parametrize("name,dynamo", [
    torchscript("FusedLayerNorm"), torchscript("MixedFusedLayerNorm"),
    torchscript("FusedLayerNorm_memory_efficient"),
    # (The TorchScript exporter has no aten::rms_norm up to opset 20: nn.RMSNorm fails too.)
    dynamo("FusedLayerNorm"), dynamo("FusedRMSNorm"),
])
def test_norms_export_as_pytorchs_norms(tmp_path, name, dynamo):
    make, plain = NORMS[name]
    model, x = _built("mlp", make)
    reference, _ = _built("mlp", plain)
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = reference.eval()(x)
        torch.testing.assert_close(model.eval()(x), want, **FP32_TOL)
    got = _run_exported(model, (x,), tmp_path / "m.onnx", dynamo)
    torch.testing.assert_close(got, want, **FP32_TOL)
    torch.testing.assert_close(
        got, _run_exported(reference, (x,), tmp_path / "ref.onnx", dynamo), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("convert", ["FusedBatchNorm", "convert_syncbn_model"])
def test_batch_norms_export_as_batchnorm(tmp_path, convert):
    model, x = _built("cnn")
    reference = copy.deepcopy(model).eval()
    if convert == "FusedBatchNorm":
        bn = mn.FusedBatchNorm(8)
        bn.load_state_dict(model.bn.state_dict())
        model.bn = bn
    else:  # (no process group: a SyncBatchNorm in eval mode normalizes with its statistics)
        model = convert_syncbn_model(model)
    with torch.no_grad():
        want = reference(x)
    torch.testing.assert_close(_run_exported(model, (x,), tmp_path / "m.onnx", False), want,
                               **FP32_TOL)


def test_channel_last_sync_batchnorm_exports_with_torchscript(tmp_path):
    # movedim(-1, 1) came out of the TorchScript exporter as a Transpose with an invalid perm
    # (PyTorch's bug), which onnxruntime refused to load; the channel check traced a warning.
    reference = nn.BatchNorm2d(8)
    with torch.no_grad():
        reference.running_mean.uniform_(-0.5, 0.5)
        reference.running_var.uniform_(0.5, 2.0)
        reference.weight.uniform_(0.5, 1.5)
    bn = SyncBatchNorm(8, channel_last=True)
    bn.load_state_dict(reference.state_dict())
    y = torch.randn(2, 6, 6, 8)  # (N, H, W, C)
    with torch.no_grad():
        want = reference.eval()(y.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        got = _run_exported(bn, (y,), tmp_path / "bn.onnx", False)
    torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("kind,opt_level,dynamo", [
    torchscript("cnn", "O2"), dynamo("cnn", "O2"), torchscript("cnn", "O3"),
    torchscript("mlp", "O2"), torchscript("mlp", "O3"),
])
def test_amp_fp16_models_export_as_the_plain_half_model(tmp_path, kind, opt_level, dynamo):
    model, x = _built(kind)
    reference = _PlainHalf(copy.deepcopy(model), torch.float16, keep_bn_fp32=opt_level == "O2")
    model = amp.initialize(model, opt_level=opt_level, dtype=torch.float16, verbosity=0).eval()
    with torch.no_grad():
        want = model(x)
    # O2 keeps BatchNorm fp32 after a half convolution: both exporters fold the BatchNorm into
    # the convolution and give an fp16 Conv fp32 weights, which onnxruntime refuses (a plain
    # model so cast too; docs/amp.md): exported without the folding.
    kw = {}
    if kind == "cnn" and opt_level == "O2":
        kw = dict(optimize=False) if dynamo else dict(do_constant_folding=False)
    got = _run_exported(model, (x,), tmp_path / "amp.onnx", dynamo, **kw)
    torch.testing.assert_close(got, want, **FP16_TOL)
    torch.testing.assert_close(
        got, _run_exported(reference.eval(), (x,), tmp_path / "ref.onnx", dynamo, **kw),
        atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_amp_fp16_model_with_fused_layer_norm_exports(tmp_path, opt_level):
    # (At O1 a plain nn.LayerNorm exports as a LayerNormalization of an fp16 input with fp32
    # weights, which onnxruntime refuses; mixprec's norm runs fp32 between casts there.)
    model, x = _built("mlp", mn.FusedLayerNorm)
    model = amp.initialize(model, opt_level=opt_level, dtype=torch.float16, verbosity=0).eval()
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(_run_exported(model, (x,), tmp_path / "amp.onnx", False), want,
                               **FP16_TOL)


@pytest.mark.parametrize("dynamo", [torchscript(), dynamo()])
def test_the_documented_fp32_deploy_route_exports_an_fp32_graph(tmp_path, dynamo):
    # README / docs/amp.md: deploy by loading model.state_dict() (the fp32 masters) into the
    # architecture built in plain fp32.
    model, x = _built("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    for _ in range(2):
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    fresh = CNN()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = fresh.eval()(x)
    torch.testing.assert_close(_run_exported(fresh, (x,), tmp_path / "fp32.onnx", dynamo), want,
                               **FP32_TOL)
    halves = [i.name for i in onnx.load(str(tmp_path / "fp32.onnx")).graph.initializer
              if i.data_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)]
    assert not halves


@pytest.mark.parametrize("dynamo", [torchscript(), dynamo()])
def test_masters_written_in_place_reach_the_export(tmp_path, dynamo):
    # dcp.load's pattern: a write into model.state_dict()'s tensors (the masters). The
    # TorchScript exporter runs the eager forward, which casts them into the half parameters;
    # torch.export (dynamo=True) traces on fake parameters and cannot: it warns, and after one
    # eager forward the program holds them.
    model, x = _built("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    model.eval()
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if key.startswith("fc") and key.endswith("weight"):
                t.mul_(-1.0)
    if dynamo:
        with pytest.warns(UserWarning, match="master weights written in place"):
            _run_exported(model, (x,), tmp_path / "stale.onnx", dynamo)
        with torch.no_grad():
            model(x)
    got = _run_exported(model, (x,), tmp_path / "amp.onnx", dynamo)
    fresh = MLP()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = _PlainHalf(fresh, torch.float16, keep_bn_fp32=False).eval()(x)
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    torch.testing.assert_close(got, want, **FP16_TOL)
