"""BatchNorm kept in fp32 under a half model: train and eval, forward and backward.

The seed document's bug: fine-tuning with BatchNorm frozen in eval mode crashed with a dtype
mismatch under Apex O2, and keep_batchnorm_fp32 raised under O1.
"""


import copy

import pytest
import torch
from torch import nn

from mixprec import amp

from .helpers import HALF_DTYPES, backward_and_step, batch, make_cnn, train_step

KEEP_BN_CASES = [("O2", None), ("O3", True), ("O1", True)]


def _bns(model):
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]


@pytest.mark.parametrize("opt_level,keep", KEEP_BN_CASES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_fp32_batchnorm_forward_backward(opt_level, keep, dtype, mode, device):
    model = make_cnn(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, keep_batchnorm_fp32=keep, dtype=dtype,
                   verbosity=0)
    model.train(mode == "train")
    for bn in _bns(model):
        assert bn.weight.dtype == torch.float32 and bn.running_mean.dtype == torch.float32
    # Each BatchNorm's output and running statistics against PyTorch's batch_norm computed in
    # fp32 on the same input, parameters and statistics, the output rounded to its dtype (the
    # half activations go on to the next layer).
    seen = []

    def before(mod, args):
        seen.append({"input": args[0].detach(), "weight": mod.weight.detach().clone(),
                     "bias": mod.bias.detach().clone(), "mean": mod.running_mean.clone(),
                     "var": mod.running_var.clone()})

    def after(mod, args, out):
        seen[-1].update(out=out.detach(), mean_after=mod.running_mean.clone(),
                        var_after=mod.running_var.clone())

    for bn in _bns(model):
        bn.register_forward_pre_hook(before)
        bn.register_forward_hook(after)
    x, y = batch(device)
    loss = train_step(model, opt, x, y, amp)
    assert torch.isfinite(loss)
    assert len(seen) == len(_bns(model))
    ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    for bn, rec in zip(_bns(model), seen):
        assert rec["input"].dtype == dtype and rec["out"].dtype == dtype
        mean, var = rec["mean"].clone(), rec["var"].clone()
        expected = torch.nn.functional.batch_norm(
            rec["input"].float(), mean, var, rec["weight"], rec["bias"], mode == "train",
            bn.momentum, bn.eps)
        # (At most one rounding apart: PyTorch's kernel for half input with fp32 parameters
        # may order its fp32 arithmetic differently.)
        torch.testing.assert_close(rec["out"].float(), expected.to(dtype).float(),
                                   rtol=ulp, atol=ulp * 1e-2)
        torch.testing.assert_close(rec["mean_after"], mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rec["var_after"], var, rtol=1e-5, atol=1e-6)
    for bn in _bns(model):
        assert bn.weight.dtype == torch.float32
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("keep", [True, None])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o1_keep_batchnorm_fp32_computes_in_fp32(keep, dtype, device, monkeypatch):
    # Inside the O1 model the convolutions run in half (autocast), so BatchNorm receives half
    # activations: with keep_batchnorm_fp32=True it must compute on fp32 ones (and hand half
    # back to the next layer); without it, on the half ones as autocast gives them.
    seen = []
    batch_norm = torch.nn.functional.batch_norm

    def spy(input, *args, **kwargs):
        seen.append(input.dtype)
        return batch_norm(input, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "batch_norm", spy)
    model = make_cnn(device)
    amp.initialize(model, opt_level="O1", keep_batchnorm_fp32=keep, dtype=dtype, verbosity=0)
    bn = _bns(model)[0]
    outputs = []
    bn.register_forward_hook(lambda mod, args, out: outputs.append(out.dtype))
    x, _ = batch(device)
    model(x).float().sum().backward()
    assert seen == [torch.float32 if keep else dtype] * 2
    assert outputs == [dtype]
    assert all(p.grad.dtype == torch.float32 for bn in _bns(model) for p in bn.parameters())


def test_o1_fp32_batchnorm_keyword_input_and_float64_model():
    # The fp32 BatchNorm hands back the dtype it was given, by keyword too (bn(input=x) came
    # back fp32), and leaves float64 alone (a .double() model under O1 failed: its float64
    # parameters met an input cast down to fp32).
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(input=self.conv(x))

    bf16 = Net()
    amp.initialize(bf16, opt_level="O1", keep_batchnorm_fp32=True, dtype=torch.bfloat16,
                   cast_model_outputs=torch.bfloat16, verbosity=0)
    outputs = []
    bf16.bn.register_forward_hook(lambda mod, args, kwargs, out: outputs.append(out.dtype),
                                  with_kwargs=True)
    bf16(torch.randn(2, 3, 4, 4))
    assert outputs == [torch.bfloat16]

    torch.manual_seed(0)
    plain = Net().double()
    f64 = Net().double()
    f64.load_state_dict(plain.state_dict())
    amp.initialize(f64, opt_level="O1", keep_batchnorm_fp32=True, verbosity=0)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    out = f64(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, plain(x))


class _MaskedBatchNorm(nn.BatchNorm1d):
    """A BatchNorm subclass for padded sequences: a boolean mask zeroes the padded rows."""

    def forward(self, x, mask):
        return super().forward(x * mask.unsqueeze(-1))


def test_o1_fp32_batchnorm_hands_back_the_floating_inputs_dtype_after_a_boolean_argument():
    """The fp32 BatchNorm of O1 returns the dtype of its floating input, whatever other
    arguments come before it (here a boolean mask given first by keyword): callers' next
    layers run on that output, and a mask's dtype (bool) would turn the activations into
    booleans. Reference: the fp32 layer on the bf16 input upcast, rounded to bf16. (N13)"""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(4, 4), _MaskedBatchNorm(4)

        def forward(self, x, mask):
            return self.bn(mask=mask, x=self.lin(x))

    torch.manual_seed(0)
    model = Net()
    ref_bn = copy.deepcopy(model.bn)
    amp.initialize(model, opt_level="O1", keep_batchnorm_fp32=True, dtype=torch.bfloat16,
                   cast_model_outputs=torch.bfloat16, verbosity=0)
    x, mask = torch.randn(6, 4), torch.tensor([True, True, True, True, False, True])
    out = model(x, mask)
    assert out.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.lin(x)
    want = ref_bn(h.float(), mask).bfloat16()
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_seed_finetuning_with_frozen_batchnorm(opt_level, dtype, device):
    """The seed's scenario: BatchNorm frozen (eval mode, no grad) while the rest trains."""
    model = make_cnn(device)
    for bn in _bns(model):
        bn.requires_grad_(False)
    # eps=1e-4: Adam's default 1e-8 underflows in fp16 at O3 (pure half has no masters).
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                           eps=1e-4)
    keep = True if opt_level != "O2" else None
    amp.initialize(model, opt, opt_level=opt_level, keep_batchnorm_fp32=keep, dtype=dtype,
                   verbosity=0)
    stats = [(bn.running_mean.clone(), bn.running_var.clone(), bn.weight.clone())
             for bn in _bns(model)]
    x, y = batch(device, n=32)
    losses = []
    for _ in range(25):
        model.train()
        for bn in _bns(model):
            bn.eval()
        losses.append(float(train_step(model, opt, x, y, amp)))
    assert losses[-1] < 0.75 * losses[0], losses
    for bn, (mean, var, w) in zip(_bns(model), stats):
        assert bn.running_mean.dtype == torch.float32
        torch.testing.assert_close(bn.running_mean, mean, rtol=0, atol=0)
        torch.testing.assert_close(bn.running_var, var, rtol=0, atol=0)
        torch.testing.assert_close(bn.weight, w, rtol=0, atol=0)


@pytest.mark.parametrize("teacher_call", ["same", "own"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_distillation_teacher_with_eval_batchnorm_stays_exact(dtype, teacher_call):
    # Distillation (r74B): a frozen teacher in eval mode, given to initialize in the student's
    # call (no optimizer of its own) or in a call of its own after it. At O2 its BatchNorm
    # stays fp32 in eval mode, its other weights are the fp32 values cast to half, and nothing
    # of it changes while the student trains on its outputs (KL with temperature plus CE);
    # its logits stay within half precision of the fp32 teacher's; amp.state_dict() is still
    # the student's (two scalers).
    teacher = make_cnn(seed=5)
    teacher.train()
    with torch.no_grad():  # "pretrained" running statistics
        for i in range(3):
            teacher(batch(n=32, seed=20 + i)[0] * 2 + 0.5)
    teacher.eval().requires_grad_(False)
    fp32_teacher = copy.deepcopy(teacher)
    pretrained = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = make_cnn(seed=6, width=4)
    opt = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9)
    if teacher_call == "same":
        amp.initialize([student, teacher], opt, opt_level="O2", dtype=dtype, num_losses=2,
                       verbosity=0)
    else:
        amp.initialize(student, opt, opt_level="O2", dtype=dtype, num_losses=2, verbosity=0)
        amp.initialize(teacher, opt_level="O2", dtype=dtype, verbosity=0)
    for step in range(4):
        x, y = batch(seed=step)
        with torch.no_grad():
            t_logits = teacher(x)
            want = fp32_teacher(x)
        assert t_logits.dtype == torch.float32
        tol = 2e-2 if dtype == torch.float16 else 8e-2
        torch.testing.assert_close(t_logits, want, rtol=tol, atol=tol)
        opt.zero_grad()
        s_logits = student(x)
        kd = nn.functional.kl_div(nn.functional.log_softmax(s_logits / 4, -1),
                                  nn.functional.log_softmax(t_logits / 4, -1),
                                  reduction="batchmean", log_target=True) * 16
        loss = 0.7 * kd + 0.3 * nn.functional.cross_entropy(s_logits, y)
        with amp.scale_loss(loss, opt, loss_id=0) as scaled:
            scaled.backward()
        opt.step()
    assert not teacher.training
    for name, value in list(teacher.named_parameters()) + list(teacher.named_buffers()):
        is_bn = isinstance(teacher.get_submodule(name.rsplit(".", 1)[0]), nn.BatchNorm2d)
        want = pretrained[name]
        if not is_bn and want.is_floating_point():
            want = want.to(dtype)
        assert value.dtype == want.dtype and torch.equal(value, want), name
    saved = teacher.state_dict()
    for name, value in saved.items():
        is_bn = isinstance(teacher.get_submodule(name.rsplit(".", 1)[0]), nn.BatchNorm2d)
        want = pretrained[name] if is_bn or not value.is_floating_point() else \
            pretrained[name].to(dtype).float()
        assert torch.equal(value, want), name
    assert sorted(amp.state_dict(optimizer=opt)) == ["loss_scaler0", "loss_scaler1"]
    assert sorted(amp.state_dict()) == ["loss_scaler0", "loss_scaler1"]


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_eval_under_inference_mode_matches_no_grad_and_training_goes_on(opt_level, dtype):
    # Validation under torch.inference_mode() (instead of no_grad) in the middle of
    # training: the logits equal no_grad's bit for bit, BatchNorm keeps its dtype (fp32 at
    # O1/O2) and its running statistics, and the training that follows is bit for bit that of
    # a run that evaluated under no_grad (no inference tensor left in amp's state).
    def run(ctx):
        model = make_cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=dtype, verbosity=0)
        x, y = batch()
        train_step(model, opt, x, y, amp)
        stats = [bn.running_mean.clone() for bn in _bns(model)]
        model.eval()
        with ctx():
            out = model(x)
        model.train()
        for bn, mean in zip(_bns(model), stats):
            assert bn.weight.dtype == (dtype if opt_level == "O3" else torch.float32)
            torch.testing.assert_close(bn.running_mean, mean, rtol=0, atol=0)
        for _ in range(2):
            train_step(model, opt, x, y, amp)
        return out, model.state_dict()

    out_inf, sd_inf = run(torch.inference_mode)
    out_ref, sd_ref = run(torch.no_grad)
    torch.testing.assert_close(out_inf, out_ref, rtol=0, atol=0)
    for k, v in sd_ref.items():
        torch.testing.assert_close(sd_inf[k], v, rtol=0, atol=0, msg=k)


# -- mutation run r50A over mixprec/amp/_model.py: what the tests above let through --------

def test_o2_half_conversion_of_a_non_affine_fp32_batchnorm_is_refused():
    # A BatchNorm with affine=False holds fp32 running statistics (buffers) and no
    # parameters: model.half() after O2 in fp16 would cast those statistics too, and must be
    # refused before anything changes, as for an affine one. (Mutant DTC02: only parameters
    # were looked at, so the buffers were cast silently.)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, affine=False), nn.ReLU())
    amp.initialize(model, opt_level="O2", dtype=torch.float16, verbosity=0)
    assert model[1].running_mean.dtype == torch.float32
    with pytest.raises(RuntimeError, match=r"from torch\.float32 to torch\.float16"):
        model.half()
    assert model[1].running_mean.dtype == model[1].running_var.dtype == torch.float32
    assert model[0].weight.dtype == torch.float16


class _ProjectedBatchNorm(nn.BatchNorm1d):
    """A BatchNorm subclass whose forward also runs an op autocast would cast (a matmul)."""

    def __init__(self, n):
        super().__init__(n)
        self.proj = nn.Parameter(torch.randn(n, n))

    def forward(self, x):
        return super().forward(x) @ self.proj


class _LinearThenBatchNorm(nn.Module):
    def __init__(self, by_keyword):
        super().__init__()
        self.lin, self.bn, self.by_keyword = nn.Linear(16, 16), _ProjectedBatchNorm(16), by_keyword

    def forward(self, x):
        h = self.lin(x)
        return self.bn(x=h) if self.by_keyword else self.bn(h)


@pytest.mark.parametrize("by_keyword", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_o1_keep_batchnorm_fp32_runs_the_whole_layer_in_fp32(dtype, by_keyword):
    # O1 with keep_batchnorm_fp32: a BatchNorm layer's forward runs in fp32 with autocast off
    # (its half input, positional or keyword, cast up; its output cast back to the input's
    # dtype), so every op of a BatchNorm subclass runs in fp32, not only batch_norm.
    # Reference: the same layer run by hand in fp32 on the upcast input. (Mutants FP02:
    # autocast left on inside the layer, the matmul ran in a half type; FP04: a keyword input
    # left half, the fp32 matmul met a half operand.)
    torch.manual_seed(0)
    model = _LinearThenBatchNorm(by_keyword)
    ref = copy.deepcopy(model)
    amp.initialize(model, opt_level="O1", keep_batchnorm_fp32=True, dtype=dtype, verbosity=0)
    x = torch.randn(8, 16)
    out = model(x)
    with torch.autocast("cpu", dtype=dtype):
        h = ref.lin(x)
    assert h.dtype == dtype
    want = ref.bn(h.float()).to(dtype).float()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_o1_fp32_batchnorm_leaves_a_positional_float64_input_alone():
    # The fp32 BatchNorm forward of O1 casts only half inputs up: a float64 model's BatchNorm
    # called positionally (nn.Sequential) keeps its float64 input, as by keyword. Reference:
    # the plain float64 model. (Mutant FP05: positional inputs cast to fp32 whatever their
    # dtype.)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).double()
    model = copy.deepcopy(plain)
    amp.initialize(model, opt_level="O1", keep_batchnorm_fp32=True, verbosity=0)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    out = model(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, plain(x))


class _MyBatchNorm(nn.BatchNorm2d):
    """A user's BatchNorm subclass (frozen-statistics and group variants are written so)."""


def test_o2_keeps_batchnorm_subclasses_in_fp32():
    # keep_batchnorm_fp32 (O2's default) applies to every _BatchNorm, a subclass and
    # nn.SyncBatchNorm included, not only to the three nn.BatchNormNd classes.
    # (Mutant CV04: an exact type check cast the subclass to half.)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), _MyBatchNorm(4), nn.SyncBatchNorm(4), nn.ReLU())
    amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert model[0].weight.dtype == torch.bfloat16
    for bn in (model[1], model[2]):
        assert {t.dtype for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var)} == {
            torch.float32}, type(bn).__name__


def test_a_syncbn_layer_converted_in_an_o2_model_is_still_inside_it():
    """``convert_syncbn_model`` on an O2 model builds new SyncBatchNorm layers; each is a
    part of the half model as the layer it replaced was, so ``amp.initialize`` of it alone is
    refused with the "inside a model" error (its own casts would run inside the half model's
    forward), exactly as for the layer before conversion. (M33)"""
    from mixprec.parallel import SyncBatchNorm, convert_syncbn_model

    model = make_cnn()
    amp.initialize(model, opt_level="O2", verbosity=0)
    with pytest.raises(ValueError, match="inside a model"):
        amp.initialize(model.features[1], opt_level="O2", verbosity=0)
    model = convert_syncbn_model(model)
    bn = model.features[1]
    assert isinstance(bn, SyncBatchNorm) and bn.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="inside a model"):
        amp.initialize(bn, opt_level="O2", verbosity=0)


def _bn_variants():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6),
        nn.BatchNorm1d(6, momentum=None),            # cumulative average (num_batches_tracked)
        nn.BatchNorm1d(6, track_running_stats=False),  # batch statistics in eval too
        nn.BatchNorm1d(6, affine=False),
        nn.Unflatten(1, (1, 6, 1, 1)),
        nn.BatchNorm3d(1),
        nn.Flatten(),
        nn.Linear(6, 2))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_batchnorm_variants_stay_fp32_and_track_as_fp32(dtype):
    """keep_batchnorm_fp32 (O2's default) covers every BatchNorm configuration users build:
    momentum=None (a cumulative average driven by the int64 num_batches_tracked),
    track_running_stats=False, affine=False, and BatchNorm3d. Their parameters and statistics
    stay fp32 through training and eval, and the statistics follow the fp32 model's within the
    rounding of their half inputs; the batch counter counts exactly."""
    reference, model = _bn_variants(), _bn_variants()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(8, 6, generator=g) * 2 + 1
        for m, o, use_amp in ((model, opt, True), (reference, ref_opt, False)):
            o.zero_grad()
            backward_and_step(m(x).float().pow(2).mean(), o, amp, use_amp)
    model.eval()
    reference.eval()
    with torch.no_grad():
        out, ref_out = model(x), reference(x)
    # Measured: statistics 3.9e-4 (fp16) and 3.4e-3 (bf16) apart at most, outputs 2.5e-4 and
    # 3.2e-3 (of 0.5); the bounds leave about 4x.
    tol = 2e-3 if dtype == torch.float16 else 1.5e-2
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    ref_bns = [m for m in reference.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(bns) == 4
    for bn, ref in zip(bns, ref_bns):
        for name, t in list(bn.named_parameters()) + list(bn.named_buffers()):
            want = getattr(ref, name)
            assert t.dtype == want.dtype, name  # fp32, int64 counter
            if t.is_floating_point():
                torch.testing.assert_close(t, want, rtol=tol, atol=tol, msg=name)
            else:
                assert torch.equal(t, want), name
    assert bns[1].running_mean is None and bns[1].running_var is None
    torch.testing.assert_close(out.float(), ref_out, rtol=tol, atol=tol)
