import contextlib
import copy
import functools
import io
import logging
import re
import warnings

import pytest
import torch
from torch import nn

from mixprec import amp
from tests._autograd import FailingBackward
from tests._triton import interpreter_skip_reason

from .helpers import (
    HALF_DTYPES,
    OPT_LEVELS,
    backward_and_step,
    batch,
    make_cnn,
    mse_step,
    scaled_backward,
    train_step,
)


def _micro_batch_reference(model, x, y):
    """A copy of ``model`` whose gradients are the sum over the two halves of the batch."""
    ref = copy.deepcopy(model)
    for xs, ys in ((x[:8], y[:8]), (x[8:], y[8:])):
        nn.functional.cross_entropy(ref(xs), ys).backward()
    return ref


def _sgd_at_static_512(model, opt_level):
    """``model`` through amp.initialize with SGD at a static scale 512 in bf16 (O1 keeping
    fp32 compute); returns the optimizer."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, loss_scale=512.0, dtype=torch.bfloat16,
                   patch_torch_functions=False if opt_level == "O1" else None, verbosity=0)
    return opt


def _two_micro_batches(opt_level):
    """A CNN, a batch of 16 to be taken as two micro-batches of 8, the fp32 reference of
    their summed gradients (:func:`_micro_batch_reference`) and the model's SGD at a static
    scale 512 (:func:`_sgd_at_static_512`)."""
    model = make_cnn()
    x, y = batch(n=16)
    ref = _micro_batch_reference(model, x, y)
    return model, x, y, ref, _sgd_at_static_512(model, opt_level)


def _master_grads_error(opt, ref):
    """Relative error of ``opt``'s master gradients, all together, against ``ref``'s."""
    got = torch.cat([m.grad.float().flatten() for m in amp.master_params(opt)])
    want = torch.cat([r.grad.flatten() for r in ref.parameters()])
    return (got - want).norm() / want.norm()


def _ref_grads(model, x, y):
    ref = copy.deepcopy(model).double()
    loss = nn.functional.cross_entropy(ref(x.double()), y)
    loss.backward()
    return [p.grad for p in ref.parameters()]


def test_scale_loss_before_initialize():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(batch()[0]).sum()
    with pytest.raises(RuntimeError, match="did not go through amp.initialize"):
        with amp.scale_loss(loss, opt):
            pass


@pytest.mark.parametrize("prepared_first", [True, False])
def test_scale_loss_over_a_list_with_an_optimizer_initialize_never_saw_says_so(prepared_first):
    # r98A G3: one optimizer of the list went through initialize, the other did not: the
    # error names the unprepared one's problem, in either order (not an AttributeError).
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    loss = model(torch.randn(3, 4)).sum()
    with pytest.raises(RuntimeError, match="did not go through amp.initialize"):
        with amp.scale_loss(loss, [opt, other] if prepared_first else [other, opt]) as scaled:
            scaled.backward()


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_dynamic_scaling_pinned_at_one_still_skips_an_overflowed_step(opt_level):
    # r98B: loss_scale="dynamic" with max_loss_scale=1.0 (skip-on-inf without scaling, for
    # bf16) holds the scale at 1.0: an inf in the gradients still skips the step, and the
    # weights stay as they were, bit for bit.
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                loss_scale="dynamic", max_loss_scale=1.0, verbosity=0)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 1.0
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(model(torch.randn(5, 4)).float().mean() * float("inf"), opt) as s:
        s.backward()
    opt.step()
    assert amp.step_was_skipped(opt)
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.detach(), q)


def test_step_was_skipped_of_a_plain_optimizer_says_it_did_not_go_through_initialize():
    """amp.step_was_skipped asked about an optimizer that amp.initialize never saw (one built
    after initialize, or a copy) raises a RuntimeError that says so, rather than answering or
    failing inside amp. (F94)"""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"^amp\.step_was_skipped\(optimizer=SGD\): this "
                                           r"optimizer did not go through amp\.initialize\. "
                                           r"Pass one that initialize returned"):
        amp.step_was_skipped(opt)


@pytest.mark.parametrize("optimizers,exc,match", [
    ([], ValueError, r"optimizers=\[\]\): no optimizer given"),
    (None, TypeError, r"got NoneType; expected the torch\.optim\.Optimizer"),
    ("sgd", TypeError, r"got str; expected the torch\.optim\.Optimizer"),
])
def test_scale_loss_names_what_it_was_given_instead_of_an_optimizer(optimizers, exc, match):
    model = make_cnn()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                   dtype=torch.bfloat16, verbosity=0)
    with pytest.raises(exc, match=match):
        with amp.scale_loss(model(batch()[0]).sum(), optimizers):
            pass


def test_master_params_and_restore_model_name_a_wrong_argument():
    with pytest.raises(TypeError, match=r"amp\.master_params\(optimizer=str\): expected an "
                                        r"optimizer"):
        amp.master_params("x")
    with pytest.raises(TypeError, match=r"amp\.restore_model\(module=NoneType\): expected"):
        amp.restore_model(None)


def test_scale_loss_with_a_copy_of_a_prepared_optimizer_says_how_to_duplicate():
    # copy.deepcopy / pickling of (model, optimizer) gives a plain optimizer: the error says
    # so, and how to duplicate a run instead.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    model2, opt2 = copy.deepcopy((model, opt))
    loss = model2(batch()[0]).float().sum()
    with pytest.raises(RuntimeError, match=r"copy\.deepcopy.*amp\.initialize them.*state dicts"):
        with amp.scale_loss(loss, opt2):
            pass


def _copied_pair(how, model, opt):
    """A copy of the amp pair (model, optimizer) made the way ``how`` says, as (model, opt)."""
    if how == "deepcopy":
        return copy.deepcopy((model, opt))
    if how == "deepcopy optimizer first":
        return tuple(reversed(copy.deepcopy((opt, model))))
    buf = io.BytesIO()
    torch.save({"model": model, "optimizer": opt}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    return loaded["model"], loaded["optimizer"]


@pytest.mark.parametrize("how", ["deepcopy", "deepcopy optimizer first", "torch.save"])
def test_a_plain_loop_on_a_copied_o2_pair_is_refused_not_silent(how):
    # The copied optimizer steps the copy's fp32 masters, and the copy's backward writes its
    # half parameters' gradients, which nothing moves into the masters: before, the step
    # trained the BatchNorm parameters alone (the ones without masters) and left the rest.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x, y = batch()
    train_step(model, opt, x, y, amp)
    model2, opt2 = _copied_pair(how, model, opt)
    opt2.zero_grad()
    nn.functional.cross_entropy(model2(x), y).backward()
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"SGD\.step\(\): .*master weights of a copy of a "
                       r"model prepared by amp\.initialize.*\(Conv2d\.weight\).*amp\.initialize "
                       r"them, and load the state dicts"):
        opt2.step()
    for k, v in model2.state_dict().items():  # (refused before anything moved)
        assert torch.equal(v, before[k]), k
    # The original pair trains on as before, beside the copy.
    w = model.features[0].weight.detach().clone()
    train_step(model, opt, x, y, amp)
    assert not torch.equal(model.features[0].weight, w)


def test_optimizers_over_a_copys_half_parameters_or_filled_masters_step():
    # Not refused: a new plain optimizer over the copy's half parameters (its parameters()),
    # and the copied optimizer once its masters have gradients (moved there by the user).
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x, y = batch()
    model2, opt2 = copy.deepcopy((model, opt))
    half_opt = torch.optim.SGD(model2.parameters(), lr=0.1)
    nn.functional.cross_entropy(model2(x), y).backward()
    w = model2.features[0].weight.detach().clone()
    half_opt.step()
    assert not torch.equal(model2.features[0].weight, w)
    start = {k: v.clone() for k, v in model2.state_dict().items()}
    for group in opt2.param_groups:
        for m in group["params"]:
            m.grad = torch.ones_like(m)
    opt2.step()
    after = model2.state_dict()
    for name, _ in model2.named_parameters():
        torch.testing.assert_close(after[name], start[name] - 0.1, rtol=0, atol=1e-6,
                                   msg=name)


def test_a_plain_optimizer_given_a_copys_masters_later_is_refused_too():
    """A plain optimizer that already stepped and is given a copy's fp32 masters afterwards
    (``add_param_group`` of the copied optimizer's parameters) is refused at its next step
    as one built over them is: the half gradients of the copy's backward never reach those
    masters, so the step would silently leave the copy's weights unchanged (C02)."""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x, y = batch()
    model2, opt2 = copy.deepcopy((model, opt))
    extra = nn.Parameter(torch.zeros(3))
    plain = torch.optim.SGD([extra], lr=0.1)
    extra.grad = torch.ones(3)
    plain.step()  # (a step before the masters join: nothing of a copy in it yet)
    torch.testing.assert_close(extra.detach(), torch.full((3,), -0.1))
    plain.add_param_group({"params": [m for g in opt2.param_groups for m in g["params"]]})
    plain.zero_grad()
    nn.functional.cross_entropy(model2(x), y).backward()
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"SGD\.step\(\): .*master weights of a copy of a "
                                           r"model prepared by amp\.initialize"):
        plain.step()
    for k, v in model2.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("loss,exc,match", [
    (torch.ones(3), ValueError, r"shape \(3,\).*scalar"),
    (torch.tensor(3), ValueError, "floating point"),
    (3.0, TypeError, "torch.Tensor"),
])
def test_bad_loss(loss, exc, match):
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(exc, match=match):
        with amp.scale_loss(loss, opt):
            pass


def test_bad_loss_id():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", num_losses=2, verbosity=0)
    with pytest.raises(ValueError, match=r"num_losses=2.*\[0, 1\]"):
        with amp.scale_loss(model(batch()[0]).sum(), opt, loss_id=2):
            pass


def test_a_half_loss_is_scaled_in_fp32_with_the_scale_on_the_device():
    """With the dynamic scale on the device (a fused optimizer), a half loss
    (``cast_model_outputs=torch.float16``) is scaled in fp32 as on the host path
    (test_apex_surface's test_scale_loss_yields_an_fp32_scaled_loss_for_a_half_loss): the
    yielded ``scaled_loss`` is ``loss.float() * scale``, finite where it passes fp16's 65504 (a
    loss of 8 at a scale of 2**14), also for a one-element loss of shape (1,), which type
    promotion would leave in fp16 against the 0-dim fp32 scale."""
    from .helpers import make_mlp

    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.float16,
                   cast_model_outputs=torch.float16, verbosity=0)
    # (2**14, not the starting 2**16: the backward's first gradient, the scale, is fp16 here)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**14, "unskipped": 0}})
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    # (small gradients: no fp16 overflow in the backward)
    loss = model(x).mean(0, keepdim=True)[:, 0] * 1e-3 + 8.0
    assert loss.dtype == torch.float16 and loss.shape == (1,)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.dtype == torch.float32
        assert scaled.detach().item() == float(loss.detach()) * 2.0**14
        scaled.backward()
    opt.step()
    assert not amp.step_was_skipped(opt)


def test_a_tuple_of_optimizers_is_taken_as_a_list():
    """scale_loss takes a tuple of optimizers as it takes a list (``amp.scale_loss(loss,
    (opt_enc, opt_dec))``): one loss, every optimizer's gradients unscaled once. At a static
    power-of-two scale with fp32 compute the unscaled gradients equal a plain fp32 backward's
    bit for bit. (F44)"""
    from .helpers import make_mlp

    model = make_mlp()
    ref = copy.deepcopy(model)
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model[2].parameters(), lr=0.1)
    amp.initialize(model, [opt_a, opt_b], opt_level="O1", loss_scale=512.0,
                   dtype=torch.bfloat16, patch_torch_functions=False, verbosity=0)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    with amp.scale_loss(model(x).square().mean(), (opt_a, opt_b)) as scaled:
        scaled.backward()
    ref(x).square().mean().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_nested_blocks_over_one_optimizer_are_refused(opt_level):
    # Two open blocks over one optimizer (two loss_ids, one joint backward) unscaled the
    # gradients by both scales or the wrong one: 240x off at O2, near zero at O1, silently.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, num_losses=2, verbosity=0)
    x, y = batch()
    out = model(x)
    with pytest.raises(RuntimeError, match="already open.*Sum the losses inside one block"):
        with amp.scale_loss(nn.functional.cross_entropy(out, y), opt, loss_id=0) as first:
            with amp.scale_loss(out.float().pow(2).mean(), opt, loss_id=1) as second:
                torch.autograd.backward([first, second])
    assert all(p.grad is None for p in amp.master_params(opt))
    # The refusal left nothing open: the next step's block runs, and agrees with a run that
    # never tried (one block, the two losses summed).
    reference = make_cnn()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference, ref_opt = amp.initialize(reference, ref_opt, opt_level=opt_level, num_losses=2,
                                        verbosity=0)
    for m, o in ((model, opt), (reference, ref_opt)):
        out = m(x)
        loss = nn.functional.cross_entropy(out, y) + out.float().pow(2).mean()
        with amp.scale_loss(loss, o) as scaled:
            scaled.backward()
    for a, b in zip(amp.master_params(opt), amp.master_params(ref_opt)):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


@pytest.mark.parametrize("nesting", ["both inside opt_g's", "opt_d's inside both"])
def test_a_nested_block_sharing_one_optimizer_of_several_is_refused(nesting):
    """A block over ``[opt_g, opt_d]`` opened inside a block over ``opt_g`` alone (a GAN loop
    with its blocks nested), or one over ``opt_d`` alone inside a block over both (every
    optimizer of the open block is busy, not only the first listed; r68A's E16), shares an
    optimizer: its gradients would be unscaled by both blocks, so the inner block is refused
    as for one optimizer, and nothing is left open: both optimizers' next blocks run."""
    from .helpers import make_mlp

    gen, disc = make_mlp(), make_mlp(seed=1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    amp.initialize([gen, disc], [opt_g, opt_d], opt_level="O1", dtype=torch.bfloat16,
                   loss_scale=512.0, patch_torch_functions=False, verbosity=0)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    outer, inner = (([opt_g], [opt_g, opt_d]) if nesting == "both inside opt_g's"
                    else ([opt_g, opt_d], [opt_d]))
    with pytest.raises(RuntimeError, match=r"a scale_loss block of this optimizer is already "
                                           r"open \(nested blocks\)"):
        with amp.scale_loss(gen(x).square().mean() + disc(x).square().mean(), outer):
            with amp.scale_loss(disc(x).square().mean(), inner):
                pass
    with amp.scale_loss(gen(x).square().mean() + disc(x).square().mean(),
                        [opt_g, opt_d]) as s:
        s.backward()
    assert all(p.grad is not None for p in [*gen.parameters(), *disc.parameters()])


class _Spectral(nn.Module):
    """A complex weight (as a Fourier layer's) beside a real linear layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, dtype=torch.cfloat))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        spectrum = torch.fft.fft(x.float(), dim=-1) * self.w
        return self.fc(x) + torch.fft.ifft(spectrum, dim=-1).real.to(x.dtype)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_complex_parameters_under_dynamic_scaling(opt_level):
    # PyTorch's unscale-and-check kernel takes real tensors only: a complex parameter's
    # gradient failed with NotImplementedError (GradScaler fails the same way). Unscaled as
    # its real view now, and its inf/NaN found.
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    reference = _Spectral()
    reference(x).pow(2).mean().backward()
    model = _Spectral()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.float16,
                                verbosity=0)
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 65536.0  # (no overflow)
    assert model.w.grad.dtype == torch.cfloat
    torch.testing.assert_close(model.w.grad, reference.w.grad, rtol=2e-2, atol=2e-3)
    opt.step()
    torch.testing.assert_close(model.w, reference.w - 0.1 * reference.w.grad, rtol=2e-3,
                               atol=2e-4)

    before = model.w.detach().clone()
    opt.zero_grad()
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
        model.w.grad[0] = complex(float("inf"), 0.0)  # an overflow in the complex gradient
    opt.step()  # skipped
    assert torch.equal(model.w.detach(), before)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 32768.0


@pytest.mark.parametrize("after_overflow", [False, True])
def test_closure_step_under_dynamic_scaling(after_overflow):
    # Refused, also right after an overflowed backward (whose skip must not swallow the
    # closure silently: the closure is never evaluated and nothing says why).
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    if after_overflow:
        with amp.scale_loss(model(batch()[0]).float().sum() * float("inf"), opt) as s:
            s.backward()
    with pytest.raises(RuntimeError, match=r"step\(closure\) was called .* dynamic loss"):
        opt.step(lambda: model(batch()[0]).sum())


def test_step_after_delay_unscale_is_an_error():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = batch()
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt, delay_unscale=True) as s:
        s.backward()
    with pytest.raises(RuntimeError, match="delay_unscale=True"):
        opt.step()


def test_backward_outside_scale_loss_at_o2_is_an_error():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x, y = batch()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="inside `with amp.scale_loss"):
        opt.step()


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_unscaled_grads_match_reference(opt_level):
    # O1 with fp32 inputs on CPU: keep everything fp32 by disabling autocast's effect via
    # patch_torch_functions=False, so the check isolates scaling.
    model = make_cnn()
    x, y = batch()
    ref = _ref_grads(model, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, patch_torch_functions=False,
                   loss_scale=1024.0, verbosity=0)
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as s:
        s.backward()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad.double(), r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_master_grads_are_fp32_and_close_to_reference(dtype, device):
    model = make_cnn(device)
    x, y = batch(device)
    ref = _ref_grads(model, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=dtype, loss_scale="dynamic", verbosity=0)
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as s:
        s.backward()
    masters = list(amp.master_params(opt))
    assert all(m.grad.dtype == torch.float32 for m in masters)
    assert all(p.grad is None for p in model.parameters() if p.dtype == dtype)
    # Relative error of all gradients together (a conv bias before BatchNorm has a true
    # gradient of zero, so per-tensor ratios are meaningless), half forward/backward vs float64.
    got = torch.cat([m.grad.double().flatten() for m in masters])
    want = torch.cat([r.flatten() for r in ref])
    rel = (got - want).norm() / want.norm()
    assert rel < (5e-2 if dtype == torch.bfloat16 else 1e-2), rel


def test_dynamic_scaling_rescues_fp16_gradients_that_underflow(device):
    # Gradients around 1e-8 are below fp16's smallest subnormal (6e-8): without scaling the
    # half gradients are zero; with the dynamic scale they reach the fp32 masters intact.
    x, y = batch(device)
    tiny = 1e-6
    results = {}
    for loss_scale in (1.0, "dynamic"):
        model = make_cnn(device)
        ref = _ref_grads(model, x, y)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, opt, opt_level="O2", loss_scale=loss_scale, verbosity=0)
        with amp.scale_loss(nn.functional.cross_entropy(model(x), y) * tiny, opt) as s:
            s.backward()
        head = list(amp.master_params(opt))[-2].grad.double()
        results[loss_scale] = (head - ref[-2] * tiny).norm() / (ref[-2] * tiny).norm()
    assert results[1.0] > 0.5  # mostly lost
    assert results["dynamic"] < 3e-2, results


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_overflow_skips_step_and_backs_off(opt_level, device):
    model = make_cnn(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic", verbosity=0)
    x, y = batch(device)
    train_step(model, opt, x, y, amp)
    # Parameters only: BatchNorm's running statistics move in the forward pass regardless.
    before = {k: v.detach().clone() for k, v in model.state_dict().items()
              if "running" not in k and "num_batches" not in k}
    momentum = {k: v["momentum_buffer"].clone() for k, v in enumerate(opt.state.values())}
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]

    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as s:
        (s * float("inf")).backward()
    opt.step()
    assert amp.step_was_skipped(opt)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scale / 2
    after = model.state_dict()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0)
    for k, v in enumerate(opt.state.values()):
        torch.testing.assert_close(v["momentum_buffer"], momentum[k], rtol=0, atol=0)

    train_step(model, opt, x, y, amp)
    assert not amp.step_was_skipped(opt)
    after = model.state_dict()
    assert any(not torch.equal(after[k], v) for k, v in before.items())


def _assert_stepped_like(model, opt, ref_model):
    """The last step ran, and left ``model`` as ``ref_model`` (a skipped step would leave
    AdamW's 1e-3 move undone)."""
    assert not amp.step_was_skipped(opt)
    got, want = model.state_dict(), ref_model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def _amp_adamw(device, opt_level, fused):
    """The small CNN with AdamW through amp at ``opt_level`` under a dynamic loss scale."""
    model = make_cnn(device)
    # (eps 1e-4: the default 1e-8 is 0 in fp16, and unfused AdamW on O3's fp16 model then
    # divides by zero at its first step.)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, fused=fused)
    return amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic", verbosity=0)


@pytest.mark.parametrize("reload", ["model+optimizer+amp", "model+optimizer"])
@pytest.mark.parametrize("fused", [False, True], ids=["host-skip", "device-skip"])
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_a_rollback_after_an_overflow_does_not_skip_the_next_step(opt_level, fused, reload,
                                                                  device):
    # Loops that reload their last checkpoint after a bad step (a loss spike, NaN) without
    # stepping: the overflow belonged to the gradients of the abandoned run. The first step
    # after the reload runs, exactly as the same step from the checkpoint in a fresh run; it
    # was skipped (as in Apex), losing a step. fused=True keeps the overflow flag on the
    # device (torch's fused AdamW takes found_inf); False reads it on the host.
    def build():
        return _amp_adamw(device, opt_level, fused)

    x, y = batch(device)
    model, opt = build()
    train_step(model, opt, x, y, amp)
    ckpt = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                          "amp": amp.state_dict(optimizer=opt)})
    ref_model, ref_opt = build()
    ref_model.load_state_dict(ckpt["model"])
    ref_opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
    amp.load_state_dict(ckpt["amp"], optimizer=ref_opt)
    train_step(ref_model, ref_opt, x, y, amp)

    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as s:
        (s * float("inf")).backward()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
    if reload == "model+optimizer+amp":
        amp.load_state_dict(ckpt["amp"], optimizer=opt)
    train_step(model, opt, x, y, amp)
    _assert_stepped_like(model, opt, ref_model)


@pytest.mark.parametrize("zero", ["optimizer", "optimizer-keep", "model"])
@pytest.mark.parametrize("fused", [False, True], ids=["host-skip", "device-skip"])
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_gradients_zeroed_after_an_overflow_without_a_step_do_not_skip_the_next_step(
        opt_level, fused, zero, device):
    # Loops ported from torch.amp or fp32 often drop a bad batch by themselves:
    # `if not torch.isfinite(grad_norm): optimizer.zero_grad(); continue`, never calling step()
    # for it. The zero_grad throws the overflowed gradients away, so the next batch's clean
    # gradients must be stepped, as in the same run that never saw the bad batch (up to the
    # halved scale, a power of two). Skipping it silently loses a good step (r72A's F1).
    def build():
        return _amp_adamw(device, opt_level, fused)

    x, y = batch(device)
    model, opt = build()
    ref_model, ref_opt = build()
    train_step(model, opt, x, y, amp)
    train_step(ref_model, ref_opt, x, y, amp)

    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as s:
        (s * float("inf")).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
    assert not torch.isfinite(grad_norm)
    if zero == "optimizer":
        opt.zero_grad()
    elif zero == "optimizer-keep":
        opt.zero_grad(set_to_none=False)
    else:
        model.zero_grad()
    # (no step() for the bad batch: the user's loop went on to the next one)
    ref_model(x)  # (the reference runs the dropped batch's forward too: BatchNorm's statistics)

    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as s:
        s.backward()
    opt.step()
    train_step(ref_model, ref_opt, x, y, amp)
    _assert_stepped_like(model, opt, ref_model)


def test_an_amp_rollback_after_an_overflow_lets_every_optimizer_of_the_loss_step():
    """amp.load_state_dict between an overflowed backward and its step is a rollback for
    every optimizer of the call, not just the first: with two optimizers stepped by one loss
    (body and head), the overflow is forgotten for both, and the next clean backward steps
    both (neither reports a skipped step, every weight moves). (A22)"""
    from .helpers import make_mlp

    model = make_mlp()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model[2].parameters(), lr=0.1)
    amp.initialize(model, [opt_a, opt_b], opt_level="O2", dtype=torch.float16, verbosity=0)
    saved = {"loss_scaler0": {"loss_scale": 128.0, "unskipped": 0}}
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    with amp.scale_loss(model(x).float().sum() * float("inf"), [opt_a, opt_b]) as s:
        s.backward()
    amp.load_state_dict(saved)
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(model(x).float().sum(), [opt_a, opt_b]) as s:
        s.backward()
    opt_a.step()
    opt_b.step()
    assert [amp.step_was_skipped(o) for o in (opt_a, opt_b)] == [False, False]
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 128.0, "unskipped": 1}}


@pytest.mark.parametrize("fused", [False, True], ids=["host-skip", "device-skip"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_load_between_a_clean_backward_and_its_step_keeps_the_gradients(opt_level, fused,
                                                                          device):
    # Only an overflow is forgotten on a load: clean gradients waiting for their step stay.
    def run(load):
        model = make_cnn(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic", verbosity=0)
        x, y = batch(device)
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, opt) as s:
            s.backward()
        if load:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            amp.load_state_dict(amp.state_dict(optimizer=opt), optimizer=opt)
        opt.step()
        assert not amp.step_was_skipped(opt)
        return model.state_dict()

    got, want = run(load=True), run(load=False)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)


def _overflowed_steps(model, opt, n, read_skips=True):
    """``n`` steps of ``make_cnn``'s batch whose scaled loss's backward is inf: whether each
    step was skipped (``read_skips``; else nothing read between the steps)."""
    x, y = batch()
    skipped = []
    for _ in range(n):
        with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as s:
            (s * float("inf")).backward()
        opt.step()
        if read_skips:
            skipped.append(amp.step_was_skipped(opt))
    return skipped


@pytest.mark.parametrize("verbosity", [1, 0])
def test_overflow_messages_are_rate_limited(caplog, monkeypatch, verbosity):
    """Overflow lines come from the ``mixprec.amp`` logger (docs/migrating.md names it for
    handlers and filters), rate-limited; verbosity=0 silences them (Apex's meaning: nothing
    printed) while the steps are still skipped and the scale still falls. (L03, L07)"""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", loss_scale="dynamic", verbosity=verbosity)
    with caplog.at_level(logging.DEBUG, logger="mixprec.amp"):
        assert _overflowed_steps(model, opt, 5) == [True] * 5
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**11
    if verbosity == 0:
        assert [r.getMessage() for r in caplog.records if "overflow" in r.getMessage()] == []
        return
    assert {r.name for r in caplog.records if "Gradient overflow" in r.getMessage()} == {
        "mixprec.amp"}
    # The 1st, 2nd and 4th overflows (then 8th, ..., 64th, and every 100th), with the scale
    # as it is then: one line only showed the first halving, 32768, as the scale went to 2048.
    messages = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert [("reduced to 32768" in m, "reduced to 16384" in m, "reduced to 4096" in m)
            for m in messages] == [(True, False, False), (False, True, False),
                                   (False, False, True)], messages
    import mixprec.amp._logging as amp_logging

    counts = []  # (the running count is the message's third argument)
    monkeypatch.setattr(amp_logging, "log_rank0",
                        lambda level, msg, *args: counts.append(args[2]))
    log = amp_logging.OverflowLog(verbosity=1)
    for _ in range(450):
        log.overflow(0, 1.0)
    assert counts == [1, 2, 4, 8, 16, 32, 64, 100, 200, 300, 400]


@pytest.mark.parametrize("fused", [False, True], ids=["host_scale", "device_scale"])
def test_overflows_at_min_loss_scale_say_the_scale_stays(caplog, fused):
    """(r99D R1) At min_loss_scale an overflow no longer lowers the scale: the line says the
    scale is at its floor, not "reduced to" the same value again (the back-off looked as if
    it still worked). The step down onto the floor says the same, and is right. With a fused
    optimizer the flag and scale are read back from the device."""
    model = make_cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic",
                   min_loss_scale=16384.0, verbosity=1)
    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        _overflowed_steps(model, opt, 4, read_skips=False)
        amp.state_dict()  # (reads the device-held flags back)
    messages = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert messages == [
        "Gradient overflow (loss_id 0): skipping step, loss scale reduced to 32768 (1 step(s) "
        "skipped so far).",
        "Gradient overflow (loss_id 0): skipping step, loss scale at min_loss_scale, 16384 (2 "
        "step(s) skipped so far).",
        "Gradient overflow (loss_id 0): skipping step, loss scale at min_loss_scale, 16384 (4 "
        "step(s) skipped so far).",
    ], messages


def test_an_overflow_line_names_its_loss(caplog):
    """With several losses the overflow line names the loss whose scaler overflowed (its
    loss_id) and carries that scaler's new scale and the running count: a user with one
    diverging loss of two finds which. (L04)"""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", num_losses=2, dtype=torch.bfloat16,
                   loss_scale="dynamic", verbosity=1)
    x, y = batch()
    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        out = model(x)
        with amp.scale_loss(nn.functional.cross_entropy(out, y), opt, loss_id=0) as s:
            s.backward(retain_graph=True)
        with amp.scale_loss(out.float().pow(2).mean(), opt, loss_id=1) as s:
            (s * float("inf")).backward()
        opt.step()
    messages = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert messages == ["Gradient overflow (loss_id 1): skipping step, loss scale reduced to "
                        "32768 (1 step(s) skipped so far)."]


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("delay", [False, True])
def test_accumulation_equals_sum_of_micro_batches(opt_level, delay):
    # static scale 512 in fp32 (or half at O2/O3): accumulating two micro-batches must give
    # the sum of their unscaled gradients, with or without delay_unscale.
    model, x, y, ref, opt = _two_micro_batches(opt_level)
    with amp.scale_loss(nn.functional.cross_entropy(model(x[:8]), y[:8]), opt,
                        delay_unscale=delay) as s:
        s.backward()
    with amp.scale_loss(nn.functional.cross_entropy(model(x[8:]), y[8:]), opt) as s:
        s.backward()
    if opt_level in ("O0", "O1"):  # fp32 throughout: only rounding of the sum
        for m, r in zip(amp.master_params(opt), ref.parameters()):
            torch.testing.assert_close(m.grad.float(), r.grad, rtol=1e-5, atol=1e-6)
    else:  # bf16 arithmetic in the model: relative error over all gradients together
        rel = _master_grads_error(opt, ref)
        assert rel < (3e-2 if opt_level == "O2" else 5e-2), rel  # O3: BatchNorm in bf16 too


@pytest.mark.parametrize("opt_level", ["O1", "O3"])
def test_accumulation_at_a_static_scale_below_one_equals_sum_of_micro_batches(opt_level):
    """A static loss scale below 1 (loss_scale=0.5: a loss that is large in half precision)
    is a scale like any other: a second backward onto gradients that an earlier block
    unscaled must not unscale them again, so two micro-batches accumulate to the sum of
    their gradients. Only a scale of exactly 1 may leave the earlier gradients where they
    are, since unscaling by 1 changes nothing. (A06)"""
    model = make_cnn()
    x, y = batch(n=16)
    ref = _micro_batch_reference(model, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, loss_scale=0.5, dtype=torch.bfloat16,
                   patch_torch_functions=False if opt_level == "O1" else None, verbosity=0)
    for xs, ys in ((x[:8], y[:8]), (x[8:], y[8:])):
        with amp.scale_loss(nn.functional.cross_entropy(model(xs), ys), opt) as s:
            s.backward()
    if opt_level == "O1":  # fp32 throughout: only rounding of the sum
        for m, r in zip(amp.master_params(opt), ref.parameters()):
            torch.testing.assert_close(m.grad.float(), r.grad, rtol=1e-5, atol=1e-6)
    else:  # bf16 model and BatchNorm: relative error over all gradients together
        rel = _master_grads_error(opt, ref)
        assert rel < 5e-2, rel


@pytest.mark.parametrize("loss_scale", ["dynamic", 512.0])
def test_delayed_micro_batches_count_no_step_and_do_not_warn(loss_scale):
    """A block with ``delay_unscale=True`` unscales nothing and decides nothing: the scaler
    counts one clean step for the block that unscales before ``step()``, not one per delayed
    micro-batch (else the dynamic scale would grow after 2000 micro-batches instead of 2000
    steps), and the "backward gave none
    of the optimizer's parameters a gradient" warning, about gradients that never arrived,
    stays silent for gradients held scaled."""
    from .helpers import make_mlp

    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16, loss_scale=loss_scale,
                   patch_torch_functions=False, verbosity=0)
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    x = torch.randn(4, 5, 4, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(4):
            with amp.scale_loss(model(x[i]).float().square().mean(), opt,
                                delay_unscale=i < 3) as s:
                s.backward()
            if i < 3:
                assert amp.state_dict()["loss_scaler0"] == {"loss_scale": scale,
                                                            "unskipped": 0}
    opt.step()
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": scale, "unskipped": 1}


def test_multiple_losses_have_separate_scalers():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", num_losses=2, dtype=torch.bfloat16,
                   loss_scale="dynamic", verbosity=0)
    x, y = batch()
    out = model(x)
    with amp.scale_loss(nn.functional.cross_entropy(out, y), opt, loss_id=0) as s:
        s.backward(retain_graph=True)
    with amp.scale_loss(out.float().pow(2).mean(), opt, loss_id=1) as s:
        (s * float("inf")).backward()
    sd = amp.state_dict()
    assert sd["loss_scaler0"]["loss_scale"] == 2.0**16
    assert sd["loss_scaler1"]["loss_scale"] == 2.0**15
    opt.step()
    assert amp.step_was_skipped(opt)  # one overflowing loss skips the optimizer's step


def test_a_static_scale_counts_each_losss_clean_steps_in_its_own_scaler():
    # A static scale never moves but counts its clean steps ("unskipped"), as Apex's did, per
    # loss: scripts read loss_scalers[i]._unskipped, and a resume carries the counts on.
    # Nothing checked that loss_id 1's steps land in loss_scaler1 (and not in loss_scaler0).
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", num_losses=2, dtype=torch.bfloat16,
                   loss_scale=128.0, verbosity=0)
    x, y = batch()
    for extra in (False, True):
        out = model(x)
        with amp.scale_loss(nn.functional.cross_entropy(out, y), opt, loss_id=0) as s:
            s.backward(retain_graph=True)
        with amp.scale_loss(out.float().pow(2).mean(), opt, loss_id=1) as s:
            s.backward(retain_graph=extra)
        if extra:
            with amp.scale_loss(out.float().abs().mean(), opt, loss_id=1) as s:
                s.backward()
        opt.step()
        opt.zero_grad()
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 128.0, "unskipped": 2},
                                "loss_scaler1": {"loss_scale": 128.0, "unskipped": 3}}


def test_bf16_o2_default_has_no_scaling_and_no_sync(monkeypatch):
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    calls = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append(1) or 0.0)
    x, y = batch()
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as s:
        assert s.dtype == torch.float32 and float(s.detach().sum().tolist()) == float(loss.detach().sum().tolist())
        s.backward()
    opt.step()
    assert calls == []


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fused_optimizer_skips_overflow_on_device_without_sync(opt_level, device, monkeypatch):
    # A fused optimizer takes the overflow flag on the device: neither scale_loss nor step()
    # reads anything back on the host, and the kernels keep the dynamic scale there.
    model = make_cnn(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic", verbosity=0)
    x, y = batch(device)
    train_step(model, opt, x, y, amp)
    before = [p.detach().clone() for p in amp.master_params(opt)]
    steps = [s["step"].clone() for s in opt.state.values()]
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]

    reads = []
    for name in ("item", "tolist", "__bool__", "__float__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original: reads.append(self.device) or _o(self, *a))
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as s:
        (s * float("inf")).backward()
    opt.step()
    assert reads == []  # no read of a device value in scale_loss or step
    monkeypatch.undo()

    for p, b in zip(amp.master_params(opt), before):
        torch.testing.assert_close(p, b, rtol=0, atol=0)
    for s, b in zip(opt.state.values(), steps):
        torch.testing.assert_close(s["step"], b, rtol=0, atol=0)  # the step count too
    assert amp.step_was_skipped(opt)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scale / 2
    train_step(model, opt, x, y, amp)
    assert not amp.step_was_skipped(opt)
    assert any(not torch.equal(p, b) for p, b in zip(amp.master_params(opt), before))


@pytest.mark.parametrize("split", ["optimizers", "groups"])
def test_an_overflow_in_a_block_not_fused_throughout_is_skipped_on_the_host(split):
    """A block whose optimizers are not all fused (a fused AdamW for the body beside a plain
    SGD for the head), or a fused AdamW with a group whose own "fused" flag is off, keeps its
    dynamic scale on the host: an unfused step cannot take the overflow flag (torch's
    per-tensor step refuses found_inf), so amp must skip an overflowed step for every part,
    and the run goes on as one with unfused optimizers. Compared with that run: the same
    skip, the same backed-off scale, the same weights after a clean step (rtol 1e-5,
    atol 1e-6: the fused and unfused AdamW kernels round differently). (A14, A15)"""
    from .helpers import make_mlp

    def run(fused):
        model = make_mlp()
        if split == "optimizers":
            opts = [torch.optim.AdamW(model[0].parameters(), lr=0.1, fused=fused),
                    torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)]
        else:
            opt = torch.optim.AdamW(model[0].parameters(), lr=0.1, fused=fused)
            opt.add_param_group({"params": list(model[2].parameters()), "fused": None})
            opts = [opt]
        amp.initialize(model, opts, opt_level="O2", dtype=torch.float16, verbosity=0)
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 0}})
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
        skipped = []
        for factor in (float("inf"), 1.0):
            with amp.scale_loss(model(x).float().square().mean() * factor, opts) as s:
                s.backward()
            for o in opts:
                o.step()
                o.zero_grad()
            skipped.append([amp.step_was_skipped(o) for o in opts])
        return skipped, amp.state_dict(), [m.detach().clone() for o in opts
                                           for m in amp.master_params(o)]

    want = run(fused=False)
    got = run(fused=True)
    assert want[0] == [[True] * len(want[0][0]), [False] * len(want[0][0])]
    assert got[0] == want[0]
    assert got[1] == want[1] == {"loss_scaler0": {"loss_scale": 64.0, "unskipped": 1}}
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_static_scale_with_a_fused_optimizer_counts_its_steps_as_with_an_unfused_one():
    """A static loss scale (loss_scale=128.0) stays on the host with a fused optimizer too:
    it never backs off, so nothing needs the device, and amp.state_dict() must count each
    clean step ("unskipped") as it does with an unfused optimizer, before and after a load,
    for a resume to carry the count on. Compared with AdamW(fused=False): the same state
    dicts, exactly. (A36)"""
    from .helpers import make_mlp

    def run(fused):
        model = make_mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
        amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, loss_scale=128.0,
                       verbosity=0)
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
        saved = []
        for i in range(4):
            if i == 3:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # (the static scale replaced: warned)
                    amp.load_state_dict({"loss_scaler0": {"loss_scale": 64.0, "unskipped": 5}})
            with amp.scale_loss(model(x).float().square().mean(), opt) as s:
                s.backward()
            opt.step()
            opt.zero_grad()
            saved.append(amp.state_dict())
        return saved

    want = run(fused=False)
    assert [s["loss_scaler0"]["unskipped"] for s in want] == [1, 2, 3, 6]
    assert run(fused=True) == want


def _dynamic_run(opt_level, scale_on_device, monkeypatch, overflow_steps=(2, 3, 7), steps=12,
                 fused_cast=False):
    from mixprec.amp import _state
    from mixprec.amp._state import AmpState, optimizer_state

    if not scale_on_device:
        monkeypatch.setattr(AmpState, "scale_device", lambda self, states, loss_id: None)
    calls = []
    if fused_cast:
        monkeypatch.setattr(_state, "_FUSED_CAST_ON_CPU", True)
        original = _state._multi_tensor.cast_unscale_check_
        monkeypatch.setattr(_state._multi_tensor, "cast_unscale_check_",
                            lambda *a, **k: calls.append(1) or original(*a, **k))
    torch.manual_seed(0)
    model = make_cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic", verbosity=1)
    scaler = optimizer_state(opt).amp_state.scalers[0]
    scaler._window = 3  # Apex's window is 2000 steps: let the scale grow within the test
    x, y = batch()
    trace = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, opt) as s:
            (s * (float("inf") if i in overflow_steps else 1.0)).backward()
        opt.step()
        trace.append((amp.step_was_skipped(opt), amp.state_dict()["loss_scaler0"]))
    where = scaler.on_device
    monkeypatch.undo()
    assert len(calls) == (steps if fused_cast else 0)
    return trace, [p.detach().clone() for p in amp.master_params(opt)], where


@pytest.mark.skipif(interpreter_skip_reason() is not None,
                    reason=str(interpreter_skip_reason()))
def test_fused_cast_unscale_gives_the_same_run(monkeypatch):
    # O2's half -> fp32 gradient cast, unscale and inf/NaN check in one Triton pass (GPUs; here
    # through the interpreter) against PyTorch's two passes: bitwise the same run.
    fused = _dynamic_run("O2", True, monkeypatch, steps=5, fused_cast=True)
    plain = _dynamic_run("O2", True, monkeypatch, steps=5)
    assert fused[0] == plain[0] and fused[0][2][0] and fused[0][3][0]
    for p, q in zip(fused[1], plain[1]):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_scale_on_the_device_follows_the_host_policy(opt_level, monkeypatch):
    # The same run with the dynamic scale kept on the device (updated by kernels) and forced
    # onto the host (read every step): same skipped steps, scales, counters and weights.
    dev_trace, dev_params, dev_where = _dynamic_run(opt_level, True, monkeypatch)
    host_trace, host_params, host_where = _dynamic_run(opt_level, False, monkeypatch)
    assert dev_where == torch.device("cpu") and host_where is None
    assert dev_trace == host_trace
    skipped = [t[0] for t in dev_trace]
    assert all(skipped[i] for i in (2, 3, 7))  # the injected overflows (O1 may add its own)
    # Apex's policy, replayed on the host from the skipped steps: an overflow halves the scale
    # and resets the count; the third clean step in a row doubles the scale.
    scale, clean, want = 2.0**16, 0, []
    for skip in skipped:
        if skip:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == 3:
                scale, clean = scale * 2, 0
        want.append({"loss_scale": scale, "unskipped": clean})
    assert [t[1] for t in dev_trace] == want
    for p, q in zip(dev_params, host_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_overflows_of_device_scaled_steps_are_logged(monkeypatch, caplog):
    with caplog.at_level("INFO", logger="mixprec.amp"):
        _dynamic_run("O2", True, monkeypatch, overflow_steps=(1,), steps=3)
    messages = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert len(messages) == 1 and "reduced to 32768" in messages[0]


def test_a_device_scaled_overflow_is_logged_when_the_next_block_opens(caplog):
    """With the scale on the device (a fused optimizer) an overflow's flag reaches the host
    later; the overflow message is logged by the next scale_loss, during training, not only
    when a checkpoint is taken (a run that never calls amp.state_dict still reports each
    skipped step). (F55)"""

    model = make_cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=1)
    x, y = batch()

    def overflow_messages():
        return [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        loss = nn.functional.cross_entropy(model(x), y) * float("inf")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        assert amp.step_was_skipped(opt)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            messages = overflow_messages()
            scaled.backward()
        opt.step()
    assert len(messages) == 1 and "reduced to 32768" in messages[0], messages


def test_load_state_dict_updates_a_device_scale_in_place():
    model = make_cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    x, y = batch()
    train_step(model, opt, x, y, amp)
    from mixprec.amp._state import optimizer_state

    scaler = optimizer_state(opt).amp_state.scalers[0]
    scale_tensor = scaler.device_state(torch.device("cpu")).scale
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 5}})
    assert scaler.device_state(torch.device("cpu")).scale is scale_tensor  # same tensor
    assert float(scale_tensor) == 1024.0
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as s:
        assert float(s.detach()) == pytest.approx(1024.0 * float(loss.detach()))
        s.backward()
    opt.step()
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1024.0, "unskipped": 6}


def test_o3_bf16_dynamic_scaling_skips_overflow_and_unscales(device):
    # bf16 gradients under a dynamic scale (O3 + loss_scale="dynamic") take their own check on
    # CUDA (PyTorch's fused check-and-unscale kernel has no bf16 variant): an injected inf
    # skips the step and halves the scale; a clean step's gradients equal the unscaled loss's
    # gradients (a power-of-two scale is exact in bf16, which has fp32's exponent range).
    model = make_cnn(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O3", dtype=torch.bfloat16, loss_scale="dynamic",
                   verbosity=0)
    ref = copy.deepcopy(model)
    x, y = batch(device)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    with amp.scale_loss(nn.functional.cross_entropy(model(x).float(), y), opt) as s:
        (s * float("inf")).backward()
    opt.step()
    assert amp.step_was_skipped(opt)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)

    opt.zero_grad()
    with amp.scale_loss(nn.functional.cross_entropy(model(x).float(), y), opt) as s:
        s.backward()
    nn.functional.cross_entropy(ref(x).float(), y).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.bfloat16
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-2, atol=1e-5)
    opt.step()
    assert not amp.step_was_skipped(opt)
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_scale_loss_over_optimizers_of_two_initialize_calls_is_an_error():
    # Each initialize call has its own loss scalers: one scale_loss cannot serve both.
    m1, m2 = make_cnn(), make_cnn(seed=1)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    amp.initialize(m1, o1, opt_level="O2", verbosity=0)
    amp.initialize(m2, o2, opt_level="O2", verbosity=0)
    x, _ = batch()
    loss = m1(x).float().sum() + m2(x).float().sum()
    with pytest.raises(ValueError, match="different amp.initialize calls"):
        with amp.scale_loss(loss, [o1, o2]):
            pass


def test_state_dict_into_a_destination():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", loss_scale=128.0, verbosity=0)
    dest = {"other": 1}
    out = amp.state_dict(dest)
    assert out is dest
    assert dest == {"other": 1, "loss_scaler0": {"loss_scale": 128.0, "unskipped": 0}}


def test_state_dict_into_a_mapping_that_is_not_a_dict():
    """``destination`` is any mutable mapping, as the docs' "a dict to update" allows in
    duck-typed Python: a ``collections.UserDict`` (or a checkpoint object built on
    ``MutableMapping``) is updated in place and returned."""
    import collections

    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", loss_scale=128.0, verbosity=0)
    dest = collections.UserDict(other=1)
    assert amp.state_dict(dest) is dest
    assert dict(dest) == {"other": 1, "loss_scaler0": {"loss_scale": 128.0, "unskipped": 0}}


def test_state_dict_follows_the_training_initialize_not_a_later_frozen_one():
    # Distillation: the student with its optimizer, then a teacher without one. The module-level
    # state_dict must keep saving the student's (backed-off) scale, not the teacher's unused
    # one; optimizer= picks a call explicitly, also across two calls with optimizers.
    student = make_cnn()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    student, opt = amp.initialize(student, opt, opt_level="O1", dtype=torch.bfloat16,
                                  loss_scale="dynamic", verbosity=0)
    amp.initialize(make_cnn(seed=1), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x, y = batch()
    with amp.scale_loss(nn.functional.cross_entropy(student(x), y), opt) as s:
        (s * float("inf")).backward()  # one overflow: 2**16 -> 2**15
    opt.step()
    student_sd = {"loss_scaler0": {"loss_scale": 2.0**15, "unskipped": 0}}
    assert amp.state_dict() == student_sd
    other = make_cnn(seed=2)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    amp.initialize(other, other_opt, opt_level="O1", dtype=torch.bfloat16, loss_scale=8.0,
                   verbosity=0)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 8.0  # the newest training call
    assert amp.state_dict(optimizer=opt) == student_sd
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 3}}, optimizer=opt)
    assert amp.state_dict(optimizer=opt)["loss_scaler0"] == {"loss_scale": 4.0, "unskipped": 3}
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 8.0
    plain = torch.optim.Adam(make_cnn().parameters())  # (named in the message, with the way)
    with pytest.raises(ValueError, match=r"amp\.state_dict\(optimizer=Adam\): this optimizer did "
                                         r"not go through amp\.initialize"):
        amp.state_dict(optimizer=plain)
    with pytest.raises(ValueError, match=r"amp\.load_state_dict\(optimizer=Adam\)"):
        amp.load_state_dict({}, optimizer=plain)


def _gan_run(opt_level, dtype, steps=3, zero_grad_via="optimizer"):
    """A GAN's loop (PyTorch's DCGAN example's order): D on real and fake, then G through D.
    G's backward leaves gradients on D's parameters that D's next step must not see.
    Returns the final weights (fp32 state dicts) and whether any step was skipped."""
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    G = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 4))
    if opt_level is None:  # the float64 reference, plain PyTorch
        D, G = D.double(), G.double()
    opt_d = torch.optim.SGD(D.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(G.parameters(), lr=0.1)
    if opt_level is not None:
        [D, G], [opt_d, opt_g] = amp.initialize([D, G], [opt_d, opt_g], opt_level=opt_level,
                                                dtype=dtype, num_losses=2, verbosity=0,
                                                max_loss_scale=2.0**10)  # (no real overflows)
    def backward(loss, opt, loss_id):
        if opt_level is None:
            loss.backward()
            return
        with amp.scale_loss(loss, opt, loss_id=loss_id) as s:
            s.backward()

    skipped = False
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        real, z = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        if opt_level is None:
            real, z = real.double(), z.double()
        (D if zero_grad_via == "model" else opt_d).zero_grad()
        backward(D(real).float().mean() - D(G(z).detach()).float().mean(), opt_d, 0)
        opt_d.step()
        (G if zero_grad_via == "model" else opt_g).zero_grad()
        backward(D(G(z)).float().mean(), opt_g, 1)  # through D: gradients land on D's too
        opt_g.step()
        if opt_level is not None:
            skipped |= amp.step_was_skipped(opt_d) or amp.step_was_skipped(opt_g)
    weights = [t.double() for m in (D, G) for t in m.state_dict().values()]
    return torch.cat([w.flatten() for w in weights]), skipped


@pytest.mark.parametrize("zero_grad_via", ["optimizer", "model"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_gan_loop_matches_float64(opt_level, dtype, zero_grad_via):
    # At O2 the optimizer holds the fp32 masters, so optimizer.zero_grad() cannot reach the
    # half gradients G's backward leaves on D: scale_loss starts D's backward from None (as
    # Apex did). model.zero_grad() (the DCGAN example's call) also clears the masters'
    # gradients. Before: D stepped on err_d + err_g's stale gradient (0.08 off after 3 steps;
    # at a scale of 2**16 the stale scaled fp16 values also overflowed and skipped steps).
    want, _ = _gan_run(None, None, zero_grad_via=zero_grad_via)
    got, skipped = _gan_run(opt_level, dtype, zero_grad_via=zero_grad_via)
    assert not skipped
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < (5e-3 if dtype == torch.bfloat16 else 1e-3), rel


def _r1_run(opt_level, dtype, steps=3):
    """A discriminator trained with an R1 penalty (StyleGAN's): the gradient of D's output with
    respect to its *input*, taken with create_graph=True, squared and added to the loss, then one
    ordinary backward. Returns D's final weights (float64) and whether a step was skipped."""
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    if opt_level is None:  # the float64 reference, plain PyTorch
        D = D.double()
    opt = torch.optim.SGD(D.parameters(), lr=0.05)
    if opt_level is not None:
        D, opt = amp.initialize(D, opt, opt_level=opt_level, dtype=dtype, verbosity=0,
                                max_loss_scale=2.0**10)  # (no real overflows)
    g = torch.Generator().manual_seed(1)
    skipped = False
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        if opt_level is None:
            x = x.double()
        x.requires_grad_(True)
        opt.zero_grad()
        out = D(x).float() if opt_level is not None else D(x)
        grad_x, = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = nn.functional.softplus(-out).mean() + 5.0 * grad_x.pow(2).sum(1).mean()
        backward_and_step(loss, opt, amp, use_amp=opt_level is not None)
        if opt_level is not None:
            skipped |= amp.step_was_skipped(opt)
    return torch.cat([t.double().flatten() for t in D.state_dict().values()]), skipped


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_input_gradient_penalty_trains_like_float64(opt_level, dtype):
    """A gradient penalty on the discriminator's *input* (R1, WGAN-GP: torch.autograd.grad of
    D's output with respect to the batch, create_graph=True, then one plain backward through
    scale_loss) trains at O1 and at O2 as in float64: only scaled_loss.backward(create_graph=True)
    is refused at O2, and GAN scripts ported from Apex rely on the input-gradient form working
    at every level (the O2 input cast must keep the batch in the graph, and the graph-carrying
    backward must not be taken for a refused create_graph one). (r71B)"""
    want, _ = _r1_run(None, None)
    got, skipped = _r1_run(opt_level, dtype)
    assert not skipped
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), rel


@pytest.mark.parametrize("fused", [False, True])  # fused: the scale lives on the device
def test_held_gradients_follow_another_loss_ids_scale(fused):
    # Gradients left scaled (delay_unscale, or inside DDP's no_sync()) carry one scaler's
    # scale; a backward at another loss_id's scale is added onto them rescaled (it gave a
    # silently wrong gradient: 68% off with scales 1024 and 128). Reference: the same two
    # losses' gradients, unscaled one by one.
    from mixprec.amp._state import optimizer_state

    def run(delay):
        model = make_cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
        amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, num_losses=2,
                       loss_scale="dynamic", verbosity=0)
        state = optimizer_state(opt).amp_state
        state.scalers[0].load_state_dict({"loss_scale": 1024.0, "unskipped": 0})
        state.scalers[1].load_state_dict({"loss_scale": 128.0, "unskipped": 0})
        x, y = batch()
        for micro in range(2):
            last = micro == 1
            out = model(x)
            with amp.scale_loss(nn.functional.cross_entropy(out, y), opt, loss_id=0,
                                delay_unscale=delay and not last) as s:
                s.backward(retain_graph=True)
            with amp.scale_loss(out.pow(2).mean(), opt, loss_id=1,
                                delay_unscale=delay and not last) as s:
                s.backward()
        assert (optimizer_state(opt).held_scaler is None) and (
            state.scale_device([optimizer_state(opt)], 0) is not None) == fused
        return [m.grad.clone() for m in amp.master_params(opt)]

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_held_sparse_gradients_follow_another_loss_ids_scale(opt_level):
    """Sparse gradients (``nn.Embedding(sparse=True)``) held scaled by ``delay_unscale`` are
    brought to another loss_id's scale before its backward adds onto them, as dense ones are:
    the accumulated gradient equals the one unscaled loss by loss (C45)."""
    from mixprec.amp._state import optimizer_state

    def run(delay):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, num_losses=2,
                       loss_scale="dynamic", verbosity=0)
        state = optimizer_state(opt).amp_state
        state.scalers[0].load_state_dict({"loss_scale": 1024.0, "unskipped": 0})
        state.scalers[1].load_state_dict({"loss_scale": 128.0, "unskipped": 0})
        idx = torch.tensor([[1, 2, 3], [3, 4, 5]])
        for micro in range(2):
            last = micro == 1
            out = model(idx).float()
            with amp.scale_loss(out.square().mean(), opt, loss_id=0,
                                delay_unscale=delay and not last) as s:
                s.backward(retain_graph=True)
            with amp.scale_loss(out.sum(), opt, loss_id=1,
                                delay_unscale=delay and not last) as s:
                s.backward()
        grads = [p.grad for group in opt.param_groups for p in group["params"]]
        assert grads[0].is_sparse
        return [g.to_dense() if g.is_sparse else g.clone() for g in grads]

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4)


def test_model_zero_grad_keeps_zeroed_master_gradients_without_set_to_none():
    # zero_grad(set_to_none=False) zeroes the masters' gradients in place, also gradients that
    # are views (a flat gradient buffer), as nn.Module.zero_grad does for parameters.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    train_step(model, opt, *batch(), amp)
    masters = list(amp.master_params(opt))
    flat = torch.ones(sum(m.numel() for m in masters))
    offset = 0
    for m in masters:
        m.grad = flat[offset:offset + m.numel()].view_as(m)
        offset += m.numel()
    model.zero_grad(set_to_none=False)
    assert all(m.grad is not None and not m.grad.any() for m in masters)
    assert not flat.any()  # zeroed in place, through the views


@pytest.mark.parametrize("as_keyword", [False, True], ids=["positional", "keyword"])
def test_closure_evaluations_see_the_current_masters_at_o2(as_keyword):
    # LBFGS evaluates its closure several times per step, updating the fp32 masters in place
    # in between: every evaluation must run the half model made from the masters as they are
    # then. (Before, the half model was refreshed after step() only: 4 of 8 evaluations ran on
    # stale weights, the loss did not move between them and LBFGS gave up early, ~30x worse.)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=gen)
    y = x @ torch.randn(4, 1, generator=gen)

    def fit(opt_level):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
        if opt_level is not None:
            model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                        verbosity=0)
        stale = []

        def closure():
            opt.zero_grad()
            if opt_level == "O2":
                masters = opt.param_groups[0]["params"]
                stale.append(not all(torch.equal(p, m.detach().to(p.dtype))
                                     for p, m in zip(model.parameters(), masters)))
            loss = nn.functional.mse_loss(model(x).float(), y)
            scaled_backward(loss, opt, amp, opt_level is not None)
            return loss

        for _ in range(4):
            opt.step(closure=closure) if as_keyword else opt.step(closure)
        with torch.no_grad():
            return nn.functional.mse_loss(model(x).float(), y).item(), stale

    fp32, _ = fit(None)
    o1, _ = fit("O1")
    o2, stale = fit("O2")
    assert len(stale) > 4 and not any(stale), stale
    assert fp32 < 1e-6
    # bf16 forwards bound both amp levels near 1e-3 (O1 measured 3.7e-4); stale evaluations
    # left O2 at 1.1e-2.
    assert o1 < 2e-3 and o2 < 2e-3, (o1, o2)


def _closure_run(dtype, steps, model, opt, log):
    for s in steps:
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            log.append(loss.item())
            return loss

        opt.step(closure)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("make", ["SGD", "LBFGS"])
def test_a_closure_step_keeps_the_fp32_masters_at_o2(dtype, make):
    """optimizer.step(closure) at O2 rounded every fp32 master to half: the closure's copy of
    the masters into the half model was not recorded, so the forward's look (after a record
    that moved the masters' versions without it: the first step's, a model.load_state_dict)
    took it for a write into the half model and took the half values into the masters. Each
    of these steps has lr=0: reference, the masters before it, exact; at the first closure
    step and at the first after a load_state_dict of the model's own state. Then an LBFGS
    run resumed from the documented checkpoint (torch.save, fresh objects) matches the
    uninterrupted one exactly, every closure loss and weight (r105B B1)."""
    kw = {"loss_scale": 128.0} if dtype == torch.float16 else {}  # (closures: a static scale)

    def setup(lr):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = (torch.optim.SGD(model.parameters(), lr=lr) if make == "SGD" else
               torch.optim.LBFGS(model.parameters(), lr=lr, history_size=4, max_iter=3))
        return amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0, **kw)

    model, opt = setup(0.0)
    for reload in (False, True):
        if reload:
            model.load_state_dict(copy.deepcopy(model.state_dict()))
        before = [m.detach().clone() for m in amp.master_params(opt)]
        _closure_run(dtype, [0], model, opt, [])
        after = list(amp.master_params(opt))
        assert all(torch.equal(a, b) for a, b in zip(after, before)), (
            f"reload={reload}: " + ", ".join(f"{(a - b).abs().max():.3g}"
                                             for a, b in zip(after, before)))
    if make == "SGD":
        return
    straight, resumed = [], []
    model, opt = setup(0.5)
    _closure_run(dtype, range(6), model, opt, straight)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    model, opt = setup(0.5)
    _closure_run(dtype, range(3), model, opt, resumed)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "amp": amp.state_dict()}, buffer)
    del model, opt
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model, opt = setup(0.5)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    amp.load_state_dict(saved["amp"])
    _closure_run(dtype, range(3, 6), model, opt, resumed)
    assert resumed == straight
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), [
        k for k in want if not torch.equal(got[k], want[k])]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_optimizer_listed_twice_is_unscaled_once(opt_level):
    # scale_loss(loss, [opt, opt]) unscaled the directly stepped (fp32) gradients twice:
    # divided by the scale squared, silently.
    model = make_cnn()
    x, y = batch()
    ref = copy.deepcopy(model)
    nn.functional.cross_entropy(ref(x), y).backward()
    opt = _sgd_at_static_512(model, opt_level)
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), [opt, opt]) as s:
        s.backward()
    assert _master_grads_error(opt, ref) < 3e-2


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_optimizer_listed_twice_keeps_the_earlier_micro_batches_gradients(opt_level):
    # Gradient accumulation without delay_unscale, the second micro-batch's scale_loss given
    # [opt, opt]: each listing set aside the earlier (unscaled) gradients for the new backward,
    # the second finding none and replacing the first's, so the first micro-batch's gradients
    # were lost unless the duplicate is dropped. (test_an_optimizer_listed_twice_is_unscaled_once
    # has no earlier gradients, and its double unscale is also stopped further down.)
    model, x, y, ref, opt = _two_micro_batches(opt_level)
    with amp.scale_loss(nn.functional.cross_entropy(model(x[:8]), y[:8]), opt) as s:
        s.backward()
    with amp.scale_loss(nn.functional.cross_entropy(model(x[8:]), y[8:]), [opt, opt]) as s:
        s.backward()
    assert _master_grads_error(opt, ref) < 3e-2


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_failed_backward_gives_back_the_earlier_gradients(opt_level):
    # Gradient accumulation that skips a micro-batch whose backward raised (fairseq-style OOM
    # recovery without zeroing): the unscaled gradients of the earlier micro-batches were set
    # aside for the failed backward and lost with it, and the half-done backward's scaled
    # gradients stayed behind.
    model, x, y, ref, opt = _two_micro_batches(opt_level)
    with amp.scale_loss(nn.functional.cross_entropy(model(x[:8]), y[:8]), opt) as s:
        s.backward()
    inputs = x[:8].to(model.head.weight.dtype)  # (the submodules, called as they are)
    features = FailingBackward.apply(model.features(inputs))
    loss = nn.functional.cross_entropy(model.head(features).float(), y[:8])
    with pytest.raises(RuntimeError, match="simulated"):
        with amp.scale_loss(loss, opt) as s:
            s.backward()  # the head's gradients are written, then the backward fails
    with amp.scale_loss(nn.functional.cross_entropy(model(x[8:]), y[8:]), opt) as s:
        s.backward()
    assert _master_grads_error(opt, ref) < 3e-2


def test_a_keyboard_interrupt_in_the_block_gives_back_the_earlier_gradients():
    """A Ctrl-C (KeyboardInterrupt, not an Exception) inside a block, caught by a notebook
    that then goes on accumulating: the gradients of the earlier micro-batches, set aside for
    that block's backward, are given back as for any error, so the sum matches a plain fp32
    accumulation of the micro-batches that ran."""
    from .helpers import make_mlp

    model = make_mlp()
    ref = copy.deepcopy(model)
    opt = _sgd_at_static_512(model, "O1")  # (fp32 compute: the sums agree to rounding)
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    with amp.scale_loss(model(x1).float().square().mean(), opt) as s:
        s.backward()
    with pytest.raises(KeyboardInterrupt):
        with amp.scale_loss(model(x2).float().mean(), opt) as s:
            raise KeyboardInterrupt  # (before its backward)
    with amp.scale_loss(model(x2).float().square().mean(), opt) as s:
        s.backward()
    (ref(x1).square().mean() + ref(x2).square().mean()).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7)


def test_a_failed_block_leaves_nothing_aside_for_a_block_at_scale_one():
    """What a failed block set aside goes back to the parameters and nowhere else: a later
    block at a static scale of 1.0 (a checkpoint's scale loaded meanwhile), which sets
    nothing aside, must not add those gradients in a second time. The sum matches a plain
    fp32 accumulation of the micro-batches that ran (O1, fp32 compute: rounding only). (A39)"""
    from .helpers import make_mlp

    model = make_mlp()
    ref = copy.deepcopy(model)
    opt = _sgd_at_static_512(model, "O1")
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    with amp.scale_loss(model(x1).float().square().mean(), opt) as s:
        s.backward()
    loss = FailingBackward.apply(model(x2).float()).square().mean()
    with pytest.raises(RuntimeError, match="simulated"):
        with amp.scale_loss(loss, opt) as s:
            s.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the static scale replaced: warned)
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 1}})
    with amp.scale_loss(model(x2).float().square().mean(), opt) as s:
        s.backward()
    for x in (x1, x2):
        ref(x).square().mean().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)


def _two_models_one_loss(fused):
    """Two linear models at O2 (bf16, dynamic scale), each with its AdamW, for one loss."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    oa = torch.optim.AdamW(a.parameters(), lr=0.1, fused=fused)
    ob = torch.optim.AdamW(b.parameters(), lr=0.1, fused=fused)
    [a, b], [oa, ob] = amp.initialize([a, b], [oa, ob], opt_level="O2", dtype=torch.bfloat16,
                                      loss_scale="dynamic", verbosity=0)
    return a, b, oa, ob


@pytest.mark.parametrize("fused", [False, True])  # fused: the scale lives on the device
def test_one_overflowing_optimizer_skips_every_optimizer_of_its_loss(fused):
    # One loss over two optimizers (two models): an inf/NaN in one optimizer's gradients skips
    # both steps, as in Apex, and halves the scale once. The other's finite gradients must not
    # be stepped (the decision is the maximum of the per-optimizer flags).
    a, b, oa, ob = _two_models_one_loss(fused)
    before = [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]
    x = torch.randn(5, 4)
    loss = a(x.bfloat16()).float().pow(2).mean() + b(x.bfloat16()).float().mean() * float("inf")
    with amp.scale_loss(loss, [oa, ob]) as s:
        s.backward()
    oa.step()
    ob.step()
    assert amp.step_was_skipped(oa) and amp.step_was_skipped(ob)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 0}
    for p, q in zip([*a.parameters(), *b.parameters()], before):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True])  # fused: the scale lives on the device
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_held_gradients_follow_their_own_scalers_move(opt_level, fused):
    # Gradients held scaled (delay_unscale) carry the scale of their backward; when that same
    # scaler moves before their last micro-batch (another optimizer's overflow on loss 0 halves
    # it), they must be rescaled to the new scale, or the first micro-batch counts twice.
    # Reference: the two micro-batches' gradients summed in float64.
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    ref = copy.deepcopy(a).double()
    oa = torch.optim.AdamW(a.parameters(), lr=0.1, fused=fused)
    ob = torch.optim.AdamW(b.parameters(), lr=0.1, fused=fused)
    [a, b], [oa, ob] = amp.initialize([a, b], [oa, ob], opt_level=opt_level,
                                      dtype=torch.bfloat16, loss_scale="dynamic",
                                      patch_torch_functions=False if opt_level == "O1" else None,
                                      verbosity=0)
    gen = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    dtype = a.weight.dtype
    with amp.scale_loss(a(x1.to(dtype)).float().pow(2).mean(), oa, delay_unscale=True) as s:
        s.backward()  # held at 2**16
    with amp.scale_loss(b(x1.to(dtype)).float().mean() * float("inf"), ob) as s:
        s.backward()  # overflow: 2**16 -> 2**15
    ob.step()
    assert amp.step_was_skipped(ob)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15
    with amp.scale_loss(a(x2.to(dtype)).float().pow(2).mean(), oa) as s:
        s.backward()
    for x in (x1, x2):
        ref(x.double()).pow(2).mean().backward()
    got = torch.cat([m.grad.double().flatten() for m in amp.master_params(oa)])
    want = torch.cat([r.grad.flatten() for r in ref.parameters()])
    # fp32 throughout at O1 (rounding only); bf16 forward and backward at O2.
    assert (got - want).norm() / want.norm() < (1e-5 if opt_level == "O1" else 2e-2)


def test_overflowed_step_is_skipped_through_a_step_bound_before_initialize():
    # A training framework that took `optimizer.step` before amp.initialize calls the class's
    # step, not amp's: the step pre-hook still skips an overflowed step (parameters and
    # momentum untouched) and amp.step_was_skipped reports it; the next clean step runs.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = opt.step
    amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic",
                   verbosity=0)
    x, y = batch()
    for inf in (False, True, False):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, opt) as s:
            (s * (float("inf") if inf else 1.0)).backward()
        step()
        assert amp.step_was_skipped(opt) is inf
        unchanged = all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), before))
        assert unchanged is inf


def _sgd_after_an_overflowed_first_step(fused, opt_level, device, **sgd_options):
    """The parameters (fp32) and the SGD after three amp steps whose first overflows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused, **sgd_options)
    amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    x = torch.randn(8, 16, device=device)
    y = torch.randint(0, 4, (8,), device=device)
    for i, factor in enumerate([1e6, 1.0, 1.0]):  # the first step overflows
        opt.zero_grad()
        with amp.scale_loss(nn.functional.cross_entropy(model(x), y) * factor, opt) as s:
            s.backward()
        opt.step()
        assert amp.step_was_skipped(opt) == (i == 0)
    return [p.detach().float() for p in model.parameters()], opt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dampening", [0.0, 0.1])  # 0: zero buffers, no sync; else host read
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fused_sgd_whose_first_step_overflows_trains_as_unfused(opt_level, dampening, device):
    # fp16's first steps overflow at the 2**16 starting scale. PyTorch's fused SGD makes a
    # first momentum buffer with empty_like and its kernel, told found_inf, leaves it
    # unwritten: the uninitialised memory stayed in the state and the next step used it.
    options = dict(momentum=0.9, dampening=dampening, nesterov=False)
    plain, _ = _sgd_after_an_overflowed_first_step(False, opt_level, device, **options)
    fused, opt = _sgd_after_an_overflowed_first_step(True, opt_level, device, **options)
    for p, q in zip(fused, plain):
        torch.testing.assert_close(p, q)
    assert all(torch.isfinite(s["momentum_buffer"]).all() for s in opt.state.values())


# G3: kills M35 (_prime_fused_momentum reading the flag on the host instead of priming zeros).
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fused_sgd_first_step_overflow_without_dampening_is_skipped_by_the_kernel(opt_level):
    # dampening 0 (the default): amp gives each parameter a zero momentum buffer and lets the
    # fused kernel skip the overflowed step on the device (no host read of the flag, which
    # would stall a CUDA stream and break a captured graph). The skipped step leaves those
    # zero buffers, which then give the first real step's result bit for bit
    # (test_fused_sgd_whose_first_step_overflows_trains_as_unfused checks the numbers).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    x = torch.randn(8, 16)
    y = torch.randint(0, 4, (8,))
    reads = []
    item = torch.Tensor.item

    def counting_item(t):
        reads.append(t.dtype)
        return item(t)

    with amp.scale_loss(nn.functional.cross_entropy(model(x), y) * 1e6, opt) as s:
        s.backward()
    torch.Tensor.item = counting_item
    try:
        opt.step()
    finally:
        torch.Tensor.item = item
    assert amp.step_was_skipped(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(opt.state) == len(params)
    for p in params:
        buf = opt.state[p]["momentum_buffer"]
        assert buf.dtype == p.dtype
        torch.testing.assert_close(buf, torch.zeros_like(p), rtol=0, atol=0)
    assert reads == []  # (the step itself read no flag on the host)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fused_sgd_without_momentum_keeps_no_momentum_buffers(opt_level):
    """A fused SGD without momentum under amp's on-device overflow skipping keeps the state
    PyTorch's SGD keeps without momentum, none, and trains as the unfused one: a checkpoint
    of it holds no momentum buffers, and no memory goes to them (C20)."""
    plain, plain_opt = _sgd_after_an_overflowed_first_step(False, opt_level, "cpu", momentum=0.0)
    fused, opt = _sgd_after_an_overflowed_first_step(True, opt_level, "cpu", momentum=0.0)
    for p, q in zip(fused, plain):
        torch.testing.assert_close(p, q)
    assert opt.state_dict()["state"] == plain_opt.state_dict()["state"] == {}


# G4: kills M45 (_prime_fused_momentum priming a parameter that has no gradient).
class _UnusedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.unused = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        return self.trunk(x)


def _sgd_with_an_unused_head(fused, opt_level):
    torch.manual_seed(0)
    model = _UnusedHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    x = torch.randn(6, 8)
    for i, factor in enumerate([float("inf"), 1.0, 1.0]):  # the first step overflows (dynamic scale)
        opt.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean() * factor, opt) as scaled:
            scaled.backward()
        opt.step()
        assert amp.step_was_skipped(opt) == (i == 0)
    return [p.detach().float() for p in model.parameters()], opt


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fused_sgd_with_a_parameter_without_gradient_trains_as_unfused(opt_level):
    # A parameter with no gradient at the step (an unused head) gets no momentum buffer from
    # amp's priming before the fused kernel: it stays out of the state, as PyTorch's SGD
    # leaves it, and the used ones train as with the unfused SGD.
    plain, plain_opt = _sgd_with_an_unused_head(False, opt_level)
    fused, opt = _sgd_with_an_unused_head(True, opt_level)
    for p, q in zip(fused, plain):
        torch.testing.assert_close(p, q)
    assert len(opt.state) == len(plain_opt.state) == 2


class _TwoHeads(nn.Module):
    """Head ``b`` is used only when asked: a multi-task or mixture-of-experts shape."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x, use_b: bool):
        return self.a(x) + self.b(x) if use_b else self.a(x)


def _two_heads_step(model, opt, scaler, x, y, use_b, bad):
    """One step of a ``_TwoHeads`` model: amp's (``scaler`` None) or torch's autocast (bf16)
    with ``scaler``, a GradScaler; ``bad`` multiplies the loss by inf (an overflow)."""
    factor = float("inf") if bad else 1.0
    if scaler is None:
        loss = nn.functional.mse_loss(model(x, use_b), y)
        with amp.scale_loss(loss * factor, opt) as s:
            s.backward()
        opt.step()
        return
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, use_b)
    scaler.scale(nn.functional.mse_loss(out.float(), y) * factor).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("when", ["before the backward", "after the step"])
@pytest.mark.parametrize("zero_through", ["optimizer", "optimizer, positionally", "model"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_zero_grad_keeping_tensors_steps_unused_parameters_as_fp32_does(opt_level, zero_through,
                                                                         when):
    # zero_grad(set_to_none=False) keeps gradient tensors: a parameter with no gradient in a
    # later backward is stepped with a zero one, so momentum and weight decay go on moving it.
    # At O2 the masters' gradients were freed after each step, and head b stopped at the
    # last step that used it. One overflowed step in between (dynamic scale): after
    # GradScaler skips a step, its zero_grad(set_to_none=False) zeroes the gradients kept.
    # "after the step": a loop zeroing after its step (none before the first backward) left
    # head b, used at the first step only, unstepped at O2 from then on: which masters had
    # gradients was recorded only while the last zero_grad kept tensors (r101B B1).
    torch.manual_seed(0)
    base = _TwoHeads()
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g), i < 1)
            for i in range(6)]

    def run(use_amp):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        scaler = None
        if use_amp:
            amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                           loss_scale="dynamic", verbosity=0)
        else:
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)

        def zero_grad():
            if zero_through == "optimizer, positionally":
                opt.zero_grad(False)  # (torch's zero_grad takes set_to_none by position too)
            else:
                (opt if zero_through == "optimizer" else model).zero_grad(set_to_none=False)

        for i, (x, y, use_b) in enumerate(data):
            if when == "before the backward":
                zero_grad()
            _two_heads_step(model, opt, scaler, x, y, use_b, bad=i == 3)
            if when == "after the step":
                zero_grad()
        return {k: v.float() for k, v in model.state_dict().items()}

    want, got = run(False), run(True)
    assert not torch.equal(want["b.weight"], base.b.weight)  # (b moved after its last use)
    for k in want:  # (bf16 compute; before, head b at O2 stood where step 2 left it)
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-2, msg=k)


@pytest.mark.parametrize("opt_level,case", [("O1", "frozen"), ("O2", "frozen"),
                                             ("O2", "unfrozen while unused")])
def test_a_layer_frozen_mid_run_with_kept_gradient_tensors_stops_as_in_fp32(opt_level, case):
    # zero_grad(set_to_none=False), then a head frozen at step 3 the usual way
    # (requires_grad_(False) and grad = None): fp32's optimizer skips it from then on. At O2
    # its master went on getting a zero gradient, and momentum and weight decay moved it.
    # "unfrozen while unused": the head is unfrozen at step 4 while the loss no longer uses it
    # (a phase of training on the other task): fp32 still skips it (its gradient stays None
    # until a backward reaches it), and its master must not get a zero gradient again either
    # (r67A's A29).
    torch.manual_seed(0)
    base = _TwoHeads()
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(6)]
    unfreeze = case == "unfrozen while unused"

    def run(use_amp):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        if use_amp:
            amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
        frozen = None
        for i, (x, y) in enumerate(data):
            if i == 3:
                for p in model.b.parameters():
                    p.requires_grad_(False)
                    p.grad = None
                frozen = {k: v.float().clone() for k, v in model.b.state_dict().items()}
            if i == 4 and unfreeze:
                model.b.requires_grad_(True)
            opt.zero_grad(set_to_none=False)
            loss = nn.functional.mse_loss(model(x, i < 3 or not unfreeze), y)
            backward_and_step(loss, opt, amp, use_amp)
        return frozen, {k: v.float() for k, v in model.state_dict().items()}

    (frozen_want, want), (frozen_got, got) = run(False), run(True)
    for k in frozen_want:
        assert torch.equal(want[f"b.{k}"], frozen_want[k])  # (fp32: b stood still once frozen)
        assert torch.equal(got[f"b.{k}"], frozen_got[k]), f"b.{k} moved after it was frozen"
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-2, msg=k)


@pytest.mark.parametrize("when", ["before the backward", "after the step"])
def test_kept_gradient_tensors_of_a_sparse_embedding_stay_sparse_at_o2(when):
    # nn.Embedding(sparse=True) with SparseAdam, unused at every other step, under
    # zero_grad(set_to_none=False): fp32's zeroed gradient stays a sparse tensor. At O2 the
    # master got a dense zero one and SparseAdam raised "does not support dense gradients".
    # ("after the step": the zero given after the first zero_grad comes from what the step
    # before it recorded, the gradient's sparse dims included.)
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(20, 8, sparse=True)
            self.lin = nn.Linear(8, 3)

        def forward(self, ids, feats, use_e):
            return self.lin(self.e(ids).mean(1) if use_e else feats)

    torch.manual_seed(0)
    base = Net()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 20, (6, 4), generator=g), torch.randn(6, 8, generator=g),
             torch.randint(0, 3, (6,), generator=g)) for _ in range(6)]

    def run(use_amp):
        model = copy.deepcopy(base)
        opts = [torch.optim.SparseAdam(list(model.e.parameters()), lr=1e-2),
                torch.optim.SGD(model.lin.parameters(), lr=0.1)]
        if use_amp:
            amp.initialize(model, opts, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        for i, (ids, feats, y) in enumerate(data):
            if when == "before the backward":
                for o in opts:
                    o.zero_grad(set_to_none=False)
            loss = nn.functional.cross_entropy(model(ids, feats, i % 2 == 0), y)
            if use_amp:
                with amp.scale_loss(loss, opts) as scaled:
                    scaled.backward()
            else:
                loss.backward()
            for o in opts:
                o.step()
            if when == "after the step":
                for o in opts:
                    o.zero_grad(set_to_none=False)
        return {k: v.float() for k, v in model.state_dict().items()}, opts[0]

    (want, _), (got, sparse_opt) = run(False), run(True)
    master = sparse_opt.param_groups[0]["params"][0]
    assert master.dtype == torch.float32 and master.grad is None  # (freed after the step)
    for k in want:  # (bf16 compute)
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=3e-2, msg=k)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_step_post_hook_registered_before_initialize_sees_the_updated_model(opt_level):
    # An EMA or a logger in a step post-hook: at O2 amp's own post-hook (which writes the
    # stepped masters into the half model) ran after the hooks registered before
    # initialize, so they saw the weights of the step before.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    opt.register_step_post_hook(
        lambda *_: seen.append([p.detach().clone() for p in model.parameters()]))
    amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    after = []
    for seed in range(3):
        x, y = batch(seed=seed)
        train_step(model, opt, x, y, amp)
        after.append([p.detach().clone() for p in model.parameters()])
    assert len(seen) == 3
    for step, (hook_view, then) in enumerate(zip(seen, after)):
        for i, (a, b) in enumerate(zip(hook_view, then)):
            assert torch.equal(a, b), f"step {step}: parameter {i} differs in the hook"
    assert not torch.equal(after[0][0], after[2][0])


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_a_weight_writing_step_pre_hook_registered_after_initialize_holds(opt_level):
    # A clamp or projection of the weights in a step pre-hook registered after initialize
    # ran after amp's own pre-hook (which takes the half model's writes into the masters), so
    # at O2 the step's end wrote the masters back over it: the constraint silently never
    # held. Checked against the same loop in fp32 (bf16 compute: tolerance of its rounding).
    def run(level):
        model = make_cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        if level is not None:
            amp.initialize(model, opt, opt_level=level, dtype=torch.bfloat16, verbosity=0)

        def clamp(*_):
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.05, 0.05)

        opt.register_step_pre_hook(clamp)
        for seed in range(4):
            x, y = batch(seed=seed)
            if level is not None:
                train_step(model, opt, x, y, amp)
            else:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        return model.state_dict()

    want, got = run(None), run(opt_level)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-2, msg=k)
    # (Without the clamp the weights travel far past 0.05 + one step: the check can fail.)
    assert max(v.abs().max().item() for k, v in got.items() if "weight" in k) < 0.2


def _mlp_training_step(opt_level, make_optimizer, compiled, frozen_first=False):
    """A seeded bf16 MLP with a dynamic scale, its optimizer (``make_optimizer(params,
    lr=1e-2)``, over every parameter: the first layer frozen beforehand if asked) and a whole
    training step, ``torch.compile``d (eager backend) if asked."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if frozen_first:
        model[0].requires_grad_(False)
    opt = make_optimizer(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                   loss_scale="dynamic", verbosity=0)
    return model, opt, mse_step(model, opt, amp, compiled)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_compiled_training_step_whose_first_step_overflows_is_skipped(opt_level):
    # The whole step under torch.compile with a dynamic scale, the first step overflowing
    # (fp16's usual start): the skip branch, traced, failed inside Dynamo of PyTorch 2.10
    # (setattr on the optimizer). Checked against the same steps run eagerly.
    def run(compiled):
        model, opt, step = _mlp_training_step(opt_level, torch.optim.AdamW, compiled)
        g = torch.Generator().manual_seed(1)
        skipped = []
        for i in range(3):
            x = torch.randn(8, 16, generator=g)
            if i == 0:
                x[0, 0] = float("inf")
            step(x, torch.randn(8, 4, generator=g))
            skipped.append(amp.step_was_skipped(opt))
        return skipped, amp.state_dict(), model.state_dict()

    want, got = run(False), run(True)
    assert got[0] == want[0] == [True, False, False]
    assert got[1] == want[1]
    for k in want[2]:
        torch.testing.assert_close(got[2][k], want[2][k], rtol=0, atol=1e-6, msg=k)


def test_a_compiled_training_step_does_not_recompile_as_the_dynamic_scale_moves():
    # Traced, the inverse scale's cache test read the Python float scale, which Dynamo
    # guards by value: the unscale frame recompiled for every new scale (6 new graphs for
    # 10 scales here) until Dynamo's recompile limit, then ran eagerly. Results checked
    # against the same steps run eagerly (SGD: PyTorch's own AdamW differs by ~1e-6 when
    # traced, which bf16 rounding then amplifies; its SGD by ~1e-8 on torch 2.4 and 2.10).
    from torch._dynamo.utils import counters

    def run(compiled):
        model, opt, step = _mlp_training_step(
            "O2", functools.partial(torch.optim.SGD, momentum=0.9), compiled)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
                   for _ in range(12)]
        step(*batches[0])
        step(*batches[1])
        counters.clear()
        for i, xy in enumerate(batches[2:]):
            amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0 ** (3 + i),
                                                  "unskipped": 0}})
            step(*xy)
        return counters["stats"]["unique_graphs"], model.state_dict()

    (_, want), (new_graphs, got) = run(False), run(True)
    assert new_graphs == 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)


def _compiled_frozen_part_run(compiled, unfreeze_steps):
    """_mlp_training_step's model at O2 with SGD and its first layer frozen, that layer's bias
    moved by +0.5 through .data before each of 4 steps; then unfrozen for ``unfreeze_steps``
    steps. Returns the first layer's bias (live) after the frozen phase and at the end."""
    model, _, f = _mlp_training_step("O2", torch.optim.SGD, compiled, frozen_first=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        model[0].bias.data.add_(0.5)
        f(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
    frozen = model[0].bias.detach().float().clone()
    model[0].requires_grad_(True)
    for _ in range(unfreeze_steps):
        f(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
    return frozen, model[0].bias.detach().float().clone()


def test_a_compiled_training_step_keeps_a_frozen_parameters_write_through_data():
    # (G, r92A) 10da541's frozen rule under a compiled step: the post-step copy leaves a
    # frozen parameter's half values (moved through .data, MoCo's update) as they are, as the
    # eager step does. Tolerance: the +2.0 the writes add is the signal.
    eager, _ = _compiled_frozen_part_run(False, 0)
    compiled, _ = _compiled_frozen_part_run(True, 0)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    assert eager.min() > 1.5  # the writes held (they add 2.0 to a bias below 0.3 in size)


def test_a_compiled_training_step_takes_a_frozen_parameters_write_once_unfrozen():
    # (B3, r92A) At the first step after unfreezing, the master takes the elements its half
    # parameter changed while frozen (_take_writes_while_frozen), eagerly; traced (the whole
    # step under torch.compile: the requires_grad change retraces it) that take is skipped
    # and the post-step copy wrote the stale master over the half values: the bias fell back
    # by the whole 2.0 the writes added. Reference: the same steps run eagerly; tolerance:
    # bf16 rounding of values near 3 over one step.
    _, eager = _compiled_frozen_part_run(False, 1)
    _, compiled = _compiled_frozen_part_run(True, 1)
    assert eager.min() > 1.5
    torch.testing.assert_close(compiled, eager, atol=2e-2, rtol=0)


def test_a_compiled_training_step_with_a_frozen_part_does_not_recompile():
    # The frozen pairs a step leaves out (a list amp rebuilds at every step, read by the next
    # step's traced pre-step) must not make Dynamo trace the step again each time: no new
    # graph after three warm-up steps of a frozen first layer written through .data.
    from torch._dynamo.utils import counters

    model, _, f = _mlp_training_step("O2", torch.optim.SGD, compiled=True, frozen_first=True)
    g = torch.Generator().manual_seed(1)
    for i in range(8):
        if i == 3:
            counters.clear()
        model[0].bias.data.add_(0.5)
        f(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
    assert counters["stats"]["unique_graphs"] == 0
    assert model[0].bias.float().min() > 3.5  # (the eight writes held: +4.0 on a small bias)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("drop", ["opt", "opt-keep", "model", "model-keep", "none"])
def test_a_dropped_delay_unscale_window_lets_the_step_run(opt_level, drop):
    # A window held by delay_unscale=True, dropped (leftover micro-batches at the end of an
    # epoch) as docs/amp.md says it may be, then step(): only the optimizer's zero_grad()
    # with set_to_none=True let the step run; zero_grad(set_to_none=False), the model's
    # zero_grad and p.grad = None left it refused as "right after delay_unscale". The step
    # now equals the same run without the window (bf16, a static scale of 128).
    def run(window):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                    loss_scale=128.0, verbosity=0)
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(4, 6, generator=g) for _ in range(3)]
        for x in xs[:2]:  # (a step, so that momentum and the masters' gradients exist)
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
        opt.step()
        with amp.scale_loss(model(xs[2]).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        if window:
            with amp.scale_loss(model(xs[0]).float().pow(2).mean(), opt,
                                delay_unscale=True) as scaled:
                scaled.backward()
        else:
            with torch.no_grad():
                model(xs[0])  # (BatchNorm's running statistics move alike)
        if drop == "opt":
            opt.zero_grad()
        elif drop == "opt-keep":
            opt.zero_grad(set_to_none=False)
        elif drop == "model":
            model.zero_grad()
        elif drop == "model-keep":
            model.zero_grad(set_to_none=False)
        else:
            for p in [*model.parameters(), *amp.master_params(opt)]:
                p.grad = None
        opt.step()
        return model.state_dict()

    want, got = run(False), run(True)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


def _two_heads_trained_with_and_without_amp(make_optimizer):
    """The _TwoHeads model's state (fp32) after five steps of ``make_optimizer``'s optimizer
    with ``opt.zero_grad()`` between them, head ``b`` used in the first two only: the plain
    fp32 loop's, then amp O2's (bf16)."""
    torch.manual_seed(0)
    base = _TwoHeads()
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g), i < 2)
            for i in range(5)]

    def run(use_amp):
        model = copy.deepcopy(base)
        opt = make_optimizer(model.parameters())
        if use_amp:
            amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        for x, y, use_b in data:
            opt.zero_grad()
            backward_and_step(nn.functional.mse_loss(model(x, use_b).float(), y), opt, amp,
                              use_amp)
        return {k: v.float() for k, v in model.state_dict().items()}

    return run(False), run(True)


def test_fused_adam_set_grad_none_false_keeps_stepping_unused_parameters():
    # FusedAdam(set_grad_none=False).zero_grad() keeps gradient tensors by default: amp read
    # a zero_grad() without an argument as set_to_none=True and freed the masters' gradients.
    from mixprec.optimizers import FusedAdam

    want, got = _two_heads_trained_with_and_without_amp(
        lambda params: FusedAdam(params, lr=1e-2, set_grad_none=False))
    for k in want:  # (bf16 compute; with the gradients freed, head b was 2e-2 off)
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=5e-3, msg=k)


class _NoneDefaultSGD(torch.optim.SGD):
    """An SGD whose ``zero_grad`` takes ``set_to_none=None`` for "the default", freeing the
    gradients as PyTorch's default does (third-party optimizers type it ``Optional[bool]``)."""

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=set_to_none is not False)


def test_a_zero_grad_whose_set_to_none_default_is_not_a_bool_frees_the_gradients():
    """A ``zero_grad()`` without an argument on an optimizer whose ``set_to_none`` default is
    not a bool (``None`` meaning "the default") is read as PyTorch's default, freeing the
    gradients: a head unused at a step is then not moved by momentum or weight decay, as in
    the same loop without amp (C14)."""
    want, got = _two_heads_trained_with_and_without_amp(
        lambda params: _NoneDefaultSGD(params, lr=0.1, momentum=0.9, weight_decay=0.1))
    for k in want:  # (bf16 compute)
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=5e-3, msg=k)


@pytest.mark.parametrize("then", ["step", "zero_grad", "grad=None", "own scale_loss"])
def test_a_step_on_gradients_another_optimizers_scale_loss_left_scaled_is_refused(then):
    # A loss through two models, given to scale_loss with one of their optimizers: the other
    # one's gradients held the loss scale. At O2 the step was refused (its half gradients
    # never reached the masters); at O1 it stepped them, 65536 times too large. Unscaled as
    # they land now (see the test after this one), they are still unchecked for an overflow
    # under a dynamic scale: refused.
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    amp.initialize([a, b], [oa, ob], opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic",
                   verbosity=0)
    x = torch.randn(8, 4)
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), ob) as s:
        s.backward()
    ob.step()
    if then == "step":
        with pytest.raises(RuntimeError, match=r"SGD\.step\(\): 2 gradient\(s\) of this "
                           r"optimizer's parameters came from a backward inside "
                           r"amp\.scale_loss.*Pass this optimizer to that scale_loss too"):
            oa.step()
        oa.step()  # (refused once: the next step is the caller's)
        return
    if then == "zero_grad":
        oa.zero_grad()
    elif then == "grad=None":
        for p in a.parameters():
            p.grad = None
    if then != "own scale_loss":
        want = [p.detach().clone() for p in a.parameters()]
        oa.step()  # (nothing to step: no gradients)
        for p, w in zip(a.parameters(), want):
            assert torch.equal(p, w)
        return
    # Its own backward adds onto them: checked with its own, not refused (a gradient zeroed
    # through .data, which no version counter sees, is not told apart: zeros either way).
    with amp.scale_loss(a(x).float().pow(2).mean(), oa) as s:
        s.backward()
    oa.step()
    assert not amp.step_was_skipped(oa)


def _foreign_loop(opt_level, loss_scale, order, fused_b=False, device="cpu"):
    """a (a Linear, then a BatchNorm1d whose parameters O2 steps directly) and b, each with
    its optimizer; blocks in ``order``: "own" a loss through a alone given oa, "foreign" a
    loss through a and b given ob only, "window" an own block with delay_unscale=True and
    "foreign1" a foreign one at loss_id 1, "nested" an own block with a foreign one at
    loss_id 1 nested in it before its backward, "both" a foreign block and an own block opened
    inside it, one backward through both losses, "window-inside" an own window
    opened and closed inside a foreign block at loss_id 1 before its backward. ``fused_b``: ob
    a fused AdamW (a dynamic scale of its blocks then lives on the device, a tensor). Returns
    oa's gradients at its step and a's parameters after it."""
    torch.manual_seed(0)
    a, b = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(device), nn.Linear(4, 2).to(device)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = (torch.optim.AdamW(b.parameters(), lr=0.1, fused=True) if fused_b
          else torch.optim.SGD(b.parameters(), lr=0.1))
    [a, b], [oa, ob] = amp.initialize([a, b], [oa, ob], opt_level=opt_level, num_losses=2,
                                      dtype=torch.bfloat16, loss_scale=loss_scale, verbosity=0)
    if loss_scale != 1.0:  # (loss 1 at another scale than loss 0's)
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 0},
                             "loss_scaler1": {"loss_scale": 4096.0, "unskipped": 0}})
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).to(device)
    for i, kind in enumerate(order):
        xi = x * (i + 1)
        if kind == "both":  # (one loss_id: one backward mixes the two shares on a)
            with amp.scale_loss(b(a(xi)).float().pow(2).mean(), ob) as t, \
                    amp.scale_loss(a(xi).float().pow(2).mean(), oa) as s:
                (s + t).backward()
        elif kind == "window-inside":
            with amp.scale_loss(b(a(xi)).float().pow(2).mean(), ob, loss_id=1) as t:
                with amp.scale_loss(a(xi).float().pow(2).mean(), oa, delay_unscale=True) as s:
                    s.backward()
                t.backward()
        elif kind in ("own", "window", "nested"):
            with amp.scale_loss(a(xi).float().pow(2).mean(), oa,
                                delay_unscale=kind == "window") as s:
                if kind == "nested":
                    with amp.scale_loss(b(a(xi)).float().pow(2).mean(), ob, loss_id=1) as t:
                        t.backward()
                s.backward()
        else:
            with amp.scale_loss(b(a(xi)).float().pow(2).mean(), ob,
                                loss_id=int(kind == "foreign1")) as s:
                s.backward()
    grads = [torch.zeros((), device=device) if p.grad is None else p.grad.clone()
             for p in amp.master_params(oa)]
    oa.step()
    assert not amp.step_was_skipped(oa)
    return grads, [p.detach().clone() for p in amp.master_params(oa)]


def test_autograd_grad_inside_another_optimizers_block_returns_what_it_was_given():
    """torch.autograd.grad(scaled_loss, a's parameters) inside scale_loss(loss, ob) returns
    the gradient of the loss it was given (scaled), as it does for ob's parameters: only what
    accumulates into a's .grad is unscaled as it lands (a tensor hook, which autograd.grad
    runs too, divided its result). Powers of two: exact."""
    a, b, oa, ob = _two_linear("O1", loss_scale=512.0)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), ob) as s:
        got = torch.autograd.grad(s, list(a.parameters()), retain_graph=True)
        assert all(p.grad is None for p in a.parameters())
        s.backward()
    for g, p in zip(got, a.parameters()):
        torch.testing.assert_close(g, 512.0 * p.grad, rtol=0, atol=0)


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")


def _inf_into_a_through_obs_block(a, b, ob, x):
    """A backward inside scale_loss(loss, ob) through a and b whose share on a's parameters
    is inf (a hook on a's output), b's own gradients finite: ob's block sees no overflow."""
    h = a(x)
    h.register_hook(lambda g: g * float("inf"))
    with amp.scale_loss(b(h).float().pow(2).mean(), ob) as s:
        s.backward()
    ob.step()
    assert not amp.step_was_skipped(ob)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)])
@pytest.mark.parametrize("edit", ["clip_grad_norm_", "all_reduce-like div_"])
def test_gradients_another_block_left_unchecked_are_checked_at_a_step_after_an_edit(edit,
                                                                                    device):
    """s62 helper B's bug 2: an in-place edit between the foreign block and oa.step() (the
    usual clip_grad_norm_ over each optimizer's parameters, a hand all-reduce) changed the
    gradients' versions, which was taken for the caller's own zeroing or accumulation: the
    unchecked inf went into a's weights. Now they are checked at that step (one host sync):
    the step is skipped, a stays finite, and the scale of the loss that left them backs off,
    as GradScaler does for gradients it unscaled."""
    a, b, oa, ob = _two_linear("O1", device=device)
    w = a.weight.detach().clone()
    _inf_into_a_through_obs_block(a, b, ob, torch.randn(8, 4, device=device))
    if edit == "clip_grad_norm_":
        torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
    else:
        for p in a.parameters():
            p.grad.div_(1.0)
    oa.step()
    assert amp.step_was_skipped(oa)
    assert torch.equal(a.weight.detach(), w)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 0}
    # (Clean gradients after an edit: the step runs on them.)
    oa.zero_grad()
    x = torch.randn(8, 4, device=device)
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), ob) as s:
        s.backward()
    torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
    oa.step()
    assert not amp.step_was_skipped(oa)
    assert not torch.equal(a.weight.detach(), w)


def test_a_step_called_again_after_the_unchecked_refusal_checks_the_gradients():
    """The refusal of a step on gradients another block left unchecked (untouched) cleared
    its marks, so a step called again (the caller catching the error) stepped the inf into
    a's weights (s62 helper B). The marks stay for that step now, which checks them: skipped,
    a finite, the scale backed off."""
    a, b, oa, ob = _two_linear("O1")
    w = a.weight.detach().clone()
    _inf_into_a_through_obs_block(a, b, ob, torch.randn(8, 4))
    with pytest.raises(RuntimeError, match=r"A step called again checks them instead"):
        oa.step()
    oa.step()
    assert amp.step_was_skipped(oa)
    assert torch.equal(a.weight.detach(), w)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15


@pytest.mark.parametrize("scales", [(512.0, 1.0), (512.0, 4096.0), (1.0, 512.0)],
                         ids=["window-512-foreign-1", "window-512-foreign-4096",
                              "window-1-foreign-512"])
@pytest.mark.parametrize("inside", [False, True], ids=["window-first", "window-inside"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_foreign_block_into_a_window_lands_at_the_windows_scale(opt_level, scales, inside):
    """Models without BatchNorm, so that at O2 oa steps no parameter directly: a window oa
    holds (delay_unscale) at loss 0's scale, a block of ob at loss 1's reaching a, then oa's
    closing block. The foreign share must land at the window's scale. Unwatched, it did not:
    a foreign block at a static 1.0 opened no watch (s62 helper A), and at O2 an optimizer
    with no directly stepped parameter was never watched (its window's half gradients took
    the share at the other scale; nor when the window opened inside ob's block, before its
    backward: s62 helper D's bug 6). oa's gradients equal those of the loop at 1.0, 1.0."""
    def run(loss_scales):
        a, b, oa, ob = _two_linear(opt_level, loss_scale=1.0, num_losses=2)
        amp.load_state_dict({f"loss_scaler{i}": {"loss_scale": v, "unskipped": 0}
                             for i, v in enumerate(loss_scales)})
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        if not inside:
            with amp.scale_loss(a(x).float().pow(2).mean(), oa, delay_unscale=True) as s:
                s.backward()
        with amp.scale_loss(b(a(2 * x)).float().pow(2).mean(), ob, loss_id=1) as t:
            if inside:
                with amp.scale_loss(a(x).float().pow(2).mean(), oa, delay_unscale=True) as s:
                    s.backward()
            t.backward()
        with amp.scale_loss(a(3 * x).float().pow(2).mean(), oa) as s:
            s.backward()
        return [p.grad.clone() for p in amp.master_params(oa)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (static scales replaced by the load: warned)
        want, got = run((1.0, 1.0)), run(scales)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


_FOREIGN_ORDERS = {"foreign-own": ("foreign", "own"), "own-foreign-own": ("own", "foreign", "own"),
                   "window-foreign1-own": ("window", "foreign1", "own"),
                   "foreign-foreign1": ("foreign", "foreign1"), "nested": ("nested",),
                   "own-window-foreign-own": ("own", "window", "foreign", "own"),
                   "both": ("both",), "window-inside-own": ("window-inside", "own")}


# (A step right after foreign blocks is refused under a dynamic scale (the test above), and at
# O2, whose half gradients never reached the masters: that order runs at O1 and 512 only.)
@pytest.mark.parametrize("opt_level, loss_scale, order, fused_b, device", [
    *(pytest.param(level, scale, order, False, "cpu", id=f"{name}-{scale}-{level}")
      for name, order in _FOREIGN_ORDERS.items() for scale in (512.0, "dynamic")
      for level in ("O1", "O2")
      if order[-1] in ("own", "nested", "both") or (scale, level) == (512.0, "O1")),
    *(pytest.param(level, "dynamic", _FOREIGN_ORDERS[name], True, device,
                   id=f"{name}-device-scale-{level}-{device}",
                   marks=[_CUDA] if device == "cuda" else [])
      for name in ("own-foreign-own", "window-foreign1-own") for level in ("O1", "O2")
      for device in ("cpu", "cuda") if device == "cuda" or level == "O1")])
def test_another_blocks_gradients_land_unscaled_as_fp32_would_add_them(opt_level, loss_scale,
                                                                       order, fused_b, device):
    """r112A R1's remainder: a backward inside scale_loss(loss, ob) through a and b wrote a's
    gradients multiplied by that loss's scale, and a's next own block added them on as they
    were: oa.step() took 512 x g_foreign + g_own (65536 x under a dynamic scale; at O2 so did
    the BatchNorm's, directly stepped). A hook unscales them as they land now (into a window
    a holds scaled, at that window's scale, the half parameters' too): oa's gradients at its
    step, and a after it, equal those of the same loop with no scaling at all
    (loss_scale=1.0), bit for bit (powers of two). At O2 the foreign share of the half
    parameters outside a window is dropped at a's block in both, as in Apex. A foreign block
    nested in an open own block lands at the own block's scale (its exit unscales it: it was
    divided twice), and so does one whose backward runs after the own block opened, or its
    window, inside it (decided as the share lands: s62 helper C's bug A). One landing in a
    window that set earlier gradients aside keeps them (the closing block took its addition
    for a drop of the window and lost them: s62 helper B's bug 1, there before this change
    too)."""
    want_grads, want = _foreign_loop(opt_level, 1.0, order, fused_b, device)
    got_grads, got = _foreign_loop(opt_level, loss_scale, order, fused_b, device)
    # (With gradients set aside, the sums run in another order than at 1.0: an ulp apart.)
    tol = dict(rtol=1e-6, atol=1e-7) if "window" in order and order[0] == "own" else {}
    for g, w in zip(got_grads + got, want_grads + want):
        torch.testing.assert_close(g, w, **(tol or dict(rtol=0, atol=0)))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_two_losses_two_optimizers_overflow_in_one_loss_id_is_gradscalers_step(opt_level):
    # Distillation's two losses (r74B): loss 0 through the student (its optimizer), loss 1
    # through a projection head and the student (both optimizers, loss_id=1), fp16. An
    # overflow in loss 1 only halves scaler 1, leaves scaler 0 at 2**16, and skips both
    # optimizers' steps, as torch.autocast + one GradScaler over both losses does; the weights
    # then equal that recipe's (bit for bit at O1; at O2 within fp16 rounding, 4e-4 relative
    # seen, far below one skipped-or-not update of lr 0.1 / 1e-2).
    def run(use_amp):
        torch.manual_seed(0)
        student, head = nn.Linear(6, 5), nn.Linear(5, 3)
        opt_s = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)
        opt_p = torch.optim.AdamW(head.parameters(), lr=1e-2)
        if use_amp:
            amp.initialize([student, head], [opt_s, opt_p], opt_level=opt_level,
                           dtype=torch.float16, num_losses=2, verbosity=0)
        else:
            scaler = torch.amp.GradScaler("cpu")
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x, target = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            opt_s.zero_grad()
            opt_p.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=not use_amp):
                feat = student(x)
                proj = head(feat)
            loss0 = feat.float().pow(2).mean()
            loss1 = nn.functional.mse_loss(proj.float(), target)
            if step == 2:
                loss1 = loss1 * float("inf")
            if use_amp:
                with amp.scale_loss(loss0, opt_s, loss_id=0) as scaled:
                    scaled.backward(retain_graph=True)
                with amp.scale_loss(loss1, [opt_s, opt_p], loss_id=1) as scaled:
                    scaled.backward()
                opt_s.step()
                opt_p.step()
                if step == 2:
                    assert amp.step_was_skipped(opt_s) and amp.step_was_skipped(opt_p)
            else:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                scaler.step(opt_s)
                scaler.step(opt_p)
                scaler.update()
        return [p.detach().float().clone() for p in (*student.parameters(), *head.parameters())]

    want = run(False)
    got = run(True)
    state = amp.state_dict()
    assert state["loss_scaler0"]["loss_scale"] == 2.0**16
    assert state["loss_scaler1"]["loss_scale"] == 2.0**15
    for g, w in zip(got, want):
        if opt_level == "O1":
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        else:
            torch.testing.assert_close(g, w, rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_step_on_master_weighted_gradients_another_optimizers_block_left_is_refused_naming_it(
        dtype):
    # At O2 a backward inside scale_loss(loss, opt_b) that also reaches opt_a's
    # master-weighted (half) parameters leaves half gradients there that never reach opt_a's
    # masters; opt_a.step() is refused, and the message must not only say to run the backward
    # inside scale_loss (the user did) but name the fix, as the O1 refusal does: pass opt_a to
    # that scale_loss too.
    torch.manual_seed(0)
    body, head = nn.Linear(4, 4), nn.Linear(4, 2)
    oa = torch.optim.SGD(body.parameters(), lr=0.1)
    ob = torch.optim.SGD(head.parameters(), lr=0.1)
    amp.initialize([body, head], [oa, ob], opt_level="O2", dtype=dtype, num_losses=2,
                   verbosity=0)
    x = torch.randn(3, 4)
    feat = body(x)
    with amp.scale_loss(feat.float().square().mean(), oa, loss_id=0) as scaled:
        scaled.backward(retain_graph=True)
    with amp.scale_loss(head(feat).float().square().mean(), ob, loss_id=1) as scaled:
        scaled.backward()  # (reaches body's parameters too)
    with pytest.raises(RuntimeError, match=r"given other optimizers only.*pass this optimizer to that "
                                           r"scale_loss as well"):
        oa.step()


class _FreedAfterLooks:
    """An optimizer's weak reference that the garbage collector clears after ``looks`` looks:
    an optimizer left in a reference cycle, listed as alive, then freed by a collection at
    some allocation further on (torch 2.4's timing met it inside scale_loss)."""

    def __init__(self, obj, looks: int):
        self.obj, self.looks = obj, looks

    def __call__(self):
        if self.looks == 0:
            self.obj = None
        self.looks -= 1
        return self.obj


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_another_optimizer_freed_inside_a_scale_loss_block_is_passed_over(opt_level):
    # (mixprec/amp/_state.py: the foreign-backward watch synced the other optimizer's groups
    # through its weak reference, dead by then: AttributeError on None.param_groups.) Freed
    # after any number of looks, the block and the step go on as without that optimizer.
    def run(looks):
        torch.manual_seed(0)
        a, b = nn.Linear(4, 4), nn.Linear(4, 2)
        oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
        models, opts = ([a], [oa]) if looks is None else ([a, b], [oa, ob])
        amp.initialize(models, opts, opt_level=opt_level, loss_scale="dynamic", verbosity=0)
        if looks is not None:
            amp._state.optimizer_state(ob).optimizer_ref = _FreedAfterLooks(ob, looks)
        with amp.scale_loss(a(torch.randn(8, 4)).float().pow(2).mean(), oa) as s:
            s.backward()
        oa.step()
        return [p.detach().float().clone() for p in a.parameters()]

    want = run(None)
    for looks in range(6):
        for got, w in zip(run(looks), want):
            assert torch.equal(got, w), looks


def test_amp_load_state_dict_passes_over_an_optimizer_freed_meanwhile():
    # (mixprec/amp/_state.py: forget_overflow dropped the gradients of an overflowed optimizer
    # through its weak reference, dead by then.) Freed after any number of looks, the load
    # restores the scale all the same, and the live optimizer's overflow is forgotten.
    for looks in range(4):
        a, b = nn.Linear(4, 4), nn.Linear(4, 2)
        oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
        amp.initialize([a, b], [oa, ob], opt_level="O1", loss_scale="dynamic", verbosity=0)
        amp_a, amp_b = amp._state.optimizer_state(oa), amp._state.optimizer_state(ob)
        amp_a.overflow = amp_b.overflow = True  # (overflowed backwards, no step taken yet)
        amp_b.optimizer_ref = _FreedAfterLooks(ob, looks)
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}})
        assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}}
        assert not amp_a.overflow, looks


def _two_linear(opt_level, *, calls=1, loss_scale="dynamic", device="cpu", num_losses=1):
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4).to(device), nn.Linear(4, 2).to(device)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    kw = dict(opt_level=opt_level, dtype=torch.bfloat16, loss_scale=loss_scale, verbosity=0,
              num_losses=num_losses)
    if calls == 1:
        amp.initialize([a, b], [oa, ob], **kw)
    else:
        amp.initialize(a, oa, **kw)
        amp.initialize(b, ob, **kw)
    return a, b, oa, ob


@pytest.mark.parametrize("calls", [1, 2], ids=["one-call", "two-calls"])
def test_another_blocks_backward_onto_gradients_already_there_is_refused(calls):
    # O1: a's own loss backpropagated first (its gradients there, unscaled), then a loss
    # through a and b given only b's optimizer: it adds its share onto a's gradients (unscaled
    # as it lands, but checked for an overflow for ob only). Only gradients the block created
    # were marked: oa.step() ran on them (then g_a + 512 g_b).
    a, b, oa, ob = _two_linear("O1", calls=calls)
    x = torch.randn(8, 4)
    h = a(x)
    with amp.scale_loss(h.float().pow(2).mean(), oa) as s:
        s.backward(retain_graph=True)
    with amp.scale_loss(b(h).float().pow(2).mean(), ob) as s:
        s.backward()
    ob.step()
    with pytest.raises(RuntimeError, match=r"SGD\.step\(\): 2 gradient\(s\) .*one call"):
        oa.step()


@pytest.mark.parametrize("b_in_a_block", [True, False], ids=["b-block", "b-plain-backward"])
def test_another_threads_backward_during_a_block_is_not_taken_for_a_foreign_one(b_in_a_block):
    # Two independent jobs (an initialize call each) trained in two threads: while a's block
    # was open, b's own backward in the other thread was recorded as a backward inside a's
    # block, and b's step was refused ("came from a backward inside amp.scale_loss(loss,
    # <other optimizers>)"). Events order the threads: a's block opens, b's backward runs,
    # a's block closes, b steps.
    import threading

    def run(threaded):
        a, b, oa, ob = _two_linear("O1", calls=2, loss_scale=512.0)
        xa, xb = torch.randn(8, 4), torch.randn(8, 4)
        opened, b_backward, a_closed = threading.Event(), threading.Event(), threading.Event()
        errors = []

        def job_a():
            try:
                with amp.scale_loss(a(xa).float().pow(2).mean(), oa) as s:
                    opened.set()
                    b_backward.wait(timeout=60)
                    s.backward()
                oa.step()
            finally:
                a_closed.set()

        def job_b():
            opened.wait(timeout=60)
            try:
                loss = b(xb).float().pow(2).mean()
                if b_in_a_block:
                    with amp.scale_loss(loss, ob) as s:
                        s.backward()
                else:  # (a static scale: a plain backward is allowed)
                    loss.backward()
                b_backward.set()
                a_closed.wait(timeout=60)
                ob.step()
            except RuntimeError as e:
                errors.append(e)
            finally:
                b_backward.set()

        if threaded:
            threads = [threading.Thread(target=job_a), threading.Thread(target=job_b)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
        else:
            opened.set()
            a_closed.set()
            job_b()
            job_a()
        assert not errors, errors
        return [p.detach().clone() for p in (*a.parameters(), *b.parameters())]

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_loss_through_a_checkpointed_model_of_another_call_is_still_refused(reentrant):
    # (The backward's attribution to its block follows a reentrant checkpoint's inner
    # backward, a graph task of its own, on the block's thread.)
    from torch.utils.checkpoint import checkpoint

    a, b, oa, ob = _two_linear("O1", calls=2)
    h = checkpoint(a, torch.randn(8, 4, requires_grad=True), use_reentrant=reentrant)
    with amp.scale_loss(b(h).float().pow(2).mean(), ob) as s:
        s.backward()
    with pytest.raises(RuntimeError, match=r"checked only those optimizers' gradients"):
        oa.step()


@pytest.mark.parametrize("opt_level, dtype", [("O1", torch.bfloat16), ("O2", torch.bfloat16),
                                              ("O2", torch.float16)])
@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_with_dropout_gives_the_same_step_bit_for_bit(
        opt_level, dtype, reentrant):
    # torch.utils.checkpoint replays the forward under the saved RNG and autocast state: at
    # every level the masters' gradients, and the weights after two accumulated micro-batches
    # (delay_unscale) and a step, equal the run without checkpointing bit for bit.
    from mixprec.normalization import FusedRMSNorm

    from .helpers import TinyDecoder, token_batch

    def run(ckpt):
        torch.manual_seed(0)
        model = TinyDecoder(FusedRMSNorm, ckpt=ckpt)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        amp.initialize(model, opt, opt_level=opt_level, dtype=dtype, verbosity=0)
        torch.manual_seed(1)
        for micro in range(2):
            x, y = token_batch(seed=micro)
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            with amp.scale_loss(loss, opt, delay_unscale=micro == 0) as scaled:
                scaled.backward()
        grads = [p.grad.clone() for p in amp.master_params(opt)]
        opt.step()
        return grads, [p.detach().clone() for p in amp.master_params(opt)]

    want_grads, want = run(None)
    got_grads, got = run(reentrant)
    for g, w in zip(got_grads + got, want_grads + want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_loss_through_models_of_two_calls_leaves_the_other_calls_gradients_refused():
    # Two initialize calls (no hidden global state), one loss through both models: the
    # backward inside b's block wrote a's gradients at b's call's scale. Only optimizers of
    # the same call were watched: oa.step() stepped them 65536 times too large (unscaled as
    # they land now, they are still unchecked for a's overflow: refused). The refusal of
    # both in one block says to initialize them in one call (it said "one block per call",
    # which leaves the scale in too).
    a, b, oa, ob = _two_linear("O1", calls=2)
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"different amp\.initialize calls.*in one call"):
        with amp.scale_loss(b(a(x)).float().pow(2).mean(), [oa, ob]):
            pass
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), ob) as s:
        s.backward()
    with pytest.raises(RuntimeError, match=r"checked only those optimizers' gradients.*in "
                                           r"one call"):
        oa.step()
    # Zeroed, a's own block steps on its own gradient alone (float64 reference).
    ref = copy.deepcopy(a).double()
    oa.zero_grad()
    with amp.scale_loss(a(x).float().pow(2).mean(), oa) as s:
        s.backward()
    oa.step()
    ref(x.double()).pow(2).mean().backward()
    with torch.no_grad():
        for p, r in zip(a.parameters(), ref.parameters()):
            torch.testing.assert_close(p.double(), r - 0.1 * r.grad, rtol=0, atol=5e-3)


def test_two_calls_alone_still_watch_each_others_gradients(monkeypatch):
    """The cross-call watch holds whatever else is alive: with exactly the two initialize calls
    of this test registered (no calls left over from other tests, as in a fresh training
    process), a loss through both models inside b's block still marks a's gradients as
    unchecked (they were scaled then), and oa.step() is refused rather than stepping them
    65536 times too large (or, now, unchecked for an overflow). (F73)"""
    from mixprec.amp import frontend

    monkeypatch.setattr(frontend, "_calls", [])
    monkeypatch.setattr(frontend, "_latest", None)
    a, b, oa, ob = _two_linear("O1", calls=2)
    assert len(frontend._calls) == 2
    x = torch.randn(8, 4)
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), ob) as s:
        s.backward()
    w = a.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"checked only those optimizers' gradients.*in "
                                           r"one call"):
        oa.step()
    assert torch.equal(a.weight, w)


@pytest.mark.parametrize("calls", [1, 2], ids=["one-call", "two-calls"])
def test_a_gan_loop_zeroing_through_data_is_not_refused(calls):
    # Scripts of Apex's day zero gradients with p.grad.data.zero_(), which no version counter
    # sees: G's block wrote onto D's gradients (marked), the loop zeroed them through .data,
    # and D's own block added its gradient: D's step was refused (the mark was carried
    # through D's block). It runs, on D's own gradient (float64 reference).
    torch.manual_seed(0)
    d, g = nn.Linear(4, 1), nn.Linear(3, 4)
    od, og = torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1)
    ref = copy.deepcopy(d).double()
    kw = dict(opt_level="O1", dtype=torch.bfloat16, loss_scale=512.0, verbosity=0)
    if calls == 1:
        amp.initialize([d, g], [od, og], **kw)
    else:
        amp.initialize(d, od, **kw)
        amp.initialize(g, og, **kw)
    x, z = torch.randn(8, 4), torch.randn(8, 3)
    with amp.scale_loss(d(x).float().mean(), od) as s:  # (D has gradients from here on)
        s.backward()
    od.step()
    with amp.scale_loss(-d(g(z)).float().mean(), og) as s:  # (through D)
        s.backward()
    og.step()
    for p in d.parameters():
        p.grad.data.zero_()
    with torch.no_grad():
        for p, r in zip(d.parameters(), ref.parameters()):
            r.copy_(p)
    with amp.scale_loss(d(x).float().mean(), od) as s:
        s.backward()
    od.step()
    ref(x.double()).mean().backward()
    for p, r in zip(d.parameters(), ref.parameters()):  # (bf16 compute)
        torch.testing.assert_close(p.double(), r.detach() - 0.1 * r.grad, rtol=0, atol=2e-2)


def test_the_foreign_gradient_marks_stay_one_per_parameter():
    # An optimizer never stepped while another's blocks write onto its gradients (a backbone
    # idle in a first fine-tuning phase): a mark per accumulation piled up, each holding a
    # gradient tensor alive.
    from mixprec.amp._state import optimizer_state

    a, b, oa, ob = _two_linear("O1", calls=2)  # (dynamic: marks taken)
    state = optimizer_state(oa)
    x = torch.randn(8, 4)
    for _ in range(20):
        a.zero_grad()
        with amp.scale_loss(b(a(x)).float().pow(2).mean(), ob) as s:
            s.backward()
        ob.step()
    assert len(state.foreign_unchecked) == 2
    assert all(ref() is None or ref() is p.grad
               for p, ref, *_ in state.foreign_unchecked.values())


@pytest.mark.parametrize("rank_zero", [True, False], ids=["rank0", "other_rank"])
def test_a_backward_reaching_none_of_the_optimizers_parameters_warns_once(monkeypatch,
                                                                         rank_zero):
    # A model whose parameters were replaced after initialize (FSDP's fully_shard or
    # FullyShardedDataParallel applied afterwards gives it new parameter objects): the
    # optimizer holds the old ones, and every step changed nothing, silently. Every rank hits
    # the same cause: rank 0 alone warns.
    monkeypatch.setattr("mixprec.amp.frontend.is_rank_zero", lambda: rank_zero)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic",
                   verbosity=0)
    model.weight = nn.Parameter(model.weight.detach().clone())
    model.bias = nn.Parameter(model.bias.detach().clone())

    def block():
        with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
            scaled.backward()

    if rank_zero:
        with pytest.warns(UserWarning, match=r"the backward gave none of the optimizer's "
                                             r"parameters a gradient.*shard first.*\(Warned "
                                             r"once\.\)"):
            block()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block()  # (warned once on rank 0; never on another rank)


def test_a_backward_reaching_one_of_two_optimizers_does_not_warn():
    """The "gave none of the optimizer's parameters a gradient" warning is for a backward that
    reached no optimizer of the block: a GAN-style block over [opt_g, opt_d] whose loss only
    reaches the generator is normal and stays silent, and opt_g's gradients are unscaled.
    (F69)"""
    from .helpers import make_mlp

    gen, disc = make_mlp(), make_mlp(seed=1)
    ref = copy.deepcopy(gen)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    amp.initialize([gen, disc], [opt_g, opt_d], opt_level="O1", loss_scale=512.0,
                   dtype=torch.bfloat16, patch_torch_functions=False, verbosity=0)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp.scale_loss(gen(x).square().mean(), [opt_g, opt_d]) as scaled:
            scaled.backward()
    ref(x).square().mean().backward()
    for p, r in zip(gen.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0)
    assert all(p.grad is None for p in disc.parameters())


def test_the_unreached_warning_points_at_the_callers_with_statement():
    """The "gave none of the optimizer's parameters a gradient" warning names the user's own
    file (the scale_loss block in their training loop), not contextlib or mixprec, so that
    the user can find which block it is about. (E17)"""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic",
                   verbosity=0)
    model.weight = nn.Parameter(model.weight.detach().clone())  # (replaced: none reached)
    model.bias = nn.Parameter(model.bias.detach().clone())
    with pytest.warns(UserWarning, match="the backward gave none of the optimizer's") as record:
        with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
            scaled.backward()
    ours = [w for w in record if "gave none of the optimizer's" in str(w.message)]
    assert len(ours) == 1
    assert ours[0].filename == __file__, ours[0].filename


def test_a_loss_that_needs_no_gradient_goes_through_with_two_initialize_calls_alive():
    """A loss computed without a graph (an evaluation pass that reuses the training step's
    scale_loss, under torch.no_grad()) goes through the block as it does with one initialize
    call: the block yields loss * scale and closes without error, and no gradient appears,
    while another call's optimizer (a second model trained beside it) is alive, because users
    run such passes in jobs that train two models. (E14)"""
    from .helpers import make_mlp

    student, other = make_mlp(), make_mlp(seed=1)
    opt_s = torch.optim.SGD(student.parameters(), lr=0.1)
    opt_o = torch.optim.SGD(other.parameters(), lr=0.1)
    amp.initialize(student, opt_s, opt_level="O1", loss_scale=128.0, verbosity=0)
    amp.initialize(other, opt_o, opt_level="O1", loss_scale=8.0, verbosity=0)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = student(x).float().square().mean()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the "gave none ... a gradient" warning)
        with amp.scale_loss(loss, opt_s) as scaled:
            assert not scaled.requires_grad
            torch.testing.assert_close(scaled, loss * 128.0, rtol=0, atol=0)
    assert all(p.grad is None for p in student.parameters())
    assert all(p.grad is None for p in other.parameters())
    opt_s.step()  # (nothing to apply: no error)


def test_a_layer_shared_by_two_optimizers_is_unscaled_once_in_one_block():
    # O1 (no masters: both optimizers hold the one fp32 parameter): scale_loss(loss, [oa, ob])
    # unscaled the shared layer's gradient once per optimizer, 1/512 of its value. One block
    # per optimizer is not refused (the shared layer is the block's own optimizer's).
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    a, b = nn.Sequential(shared, nn.Linear(4, 2)), nn.Sequential(shared, nn.Linear(4, 2))
    ref = copy.deepcopy(nn.ModuleList([a, b])).double()
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    amp.initialize([a, b], [oa, ob], opt_level="O1", dtype=torch.bfloat16, loss_scale=512.0,
                   verbosity=0)
    x = torch.randn(8, 4)
    (ref[0](x.double()).pow(2).mean() + ref[1](x.double()).pow(2).mean()).backward()
    for blocks in ("one", "per optimizer"):
        oa.zero_grad()
        ob.zero_grad()
        if blocks == "one":
            with amp.scale_loss(a(x).float().pow(2).mean() + b(x).float().pow(2).mean(),
                                [oa, ob]) as s:
                s.backward()
        else:
            for model, opt in ((a, oa), (b, ob)):
                with amp.scale_loss(model(x).float().pow(2).mean(), opt) as s:
                    s.backward()
        # (bf16 compute: 1e-2 relative; unscaled twice: 1/512)
        torch.testing.assert_close(shared.weight.grad.double(), ref[0][0].weight.grad,
                                   rtol=2e-2, atol=1e-3, msg=blocks)
    oa.step()
    ob.step()


def test_a_layer_shared_with_an_optimizer_outside_the_block_is_unscaled_for_it_too():
    """A layer held by the block's second optimizer and by a third optimizer outside the
    block (an optimizer for the shared encoder alone, stepped in another phase): the block
    unscales its gradient through the second optimizer, so the third one's step applies the
    true gradient and is not refused as holding a foreign scale, as a plain fp32 SGD on the
    same gradient (float64 reference) does. (E13)"""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    a, b = nn.Linear(4, 2), nn.Sequential(shared, nn.Linear(4, 2))
    ref = copy.deepcopy(nn.ModuleList([a, b])).double()
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    o_shared = torch.optim.SGD(shared.parameters(), lr=0.5)
    amp.initialize([a, b], [oa, ob, o_shared], opt_level="O1", loss_scale="dynamic",
                   patch_torch_functions=False, verbosity=0)
    x = torch.randn(8, 4)
    (ref[0](x.double()).pow(2).mean() + ref[1](x.double()).pow(2).mean()).backward()
    with amp.scale_loss(a(x).pow(2).mean() + b(x).pow(2).mean(), [oa, ob]) as s:
        s.backward()
    before = shared.weight.detach().clone()
    o_shared.step()
    want = before.double() - 0.5 * ref[1][0].weight.grad
    torch.testing.assert_close(shared.weight.detach().double(), want, rtol=1e-6, atol=1e-6)


def test_a_late_group_reached_by_another_optimizers_block_is_refused_before_any_sync():
    """A learnable loss weight given to an O2 optimizer (all of whose parameters have masters)
    by add_param_group after initialize, and reached by a backward inside another optimizer's
    block, held that block's loss scale: that optimizer's step is refused (the gradient is
    unscaled as it lands now, but unchecked for an overflow under a dynamic scale), as it is
    once something (master_params, a scale_loss) synced its groups, because users would
    otherwise step a gradient 65536 times too large without a word (it was: the optimizer, none
    of whose parameters were directly stepped when the block opened, went unwatched). (E18)"""
    from .helpers import make_mlp

    a, b = make_mlp(), make_mlp(seed=1)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    amp.initialize([a, b], [oa, ob], opt_level="O2", dtype=torch.bfloat16, loss_scale="dynamic",
                   verbosity=0)
    w = nn.Parameter(torch.tensor(2.0))
    ob.add_param_group({"params": [w]})
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    with amp.scale_loss(a(x).float().square().mean() * w, oa) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match=r"SGD\.step\(\): 1 gradient\(s\) of this "
                                           r"optimizer's parameters came from a backward"):
        ob.step()
    assert w.item() == 2.0


def test_amps_zero_grad_keeps_the_signature_and_copies():
    # Code that inspects zero_grad's signature (accelerate's AcceleratedOptimizer passes
    # set_to_none only where it is a parameter) saw (*args, **kwargs); a copy of the bound
    # method alone held its copied optimizer weakly and failed when called.
    import inspect
    import pickle
    from functools import partial

    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = inspect.signature(opt.zero_grad)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert "set_to_none" in want.parameters
    assert inspect.signature(opt.zero_grad) == want
    assert inspect.signature(opt.step) == inspect.signature(torch.optim.SGD([nn.Parameter(
        torch.ones(1))]).step)
    copied = copy.deepcopy(opt.zero_grad)
    copied()
    again = pickle.loads(pickle.dumps(partial(opt.zero_grad, set_to_none=False)))
    again()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_one_zero_grad_keeping_tensors_then_zeroing_through_a_wrapper_trains_the_same(opt_level):
    # After one optimizer.zero_grad(set_to_none=False), a loop zeroing through a wrapper of
    # the model (DataParallel's or torch DDP's zero_grad, nn.Module's, reaches the half
    # parameters only): the masters' gradients were kept after every step and each backward
    # added into them.
    model = make_cnn()
    ref = copy.deepcopy(model).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    opt.zero_grad(set_to_none=False)
    # (A container stands for the wrapper: nn.DataParallel would scatter to a GPU if any.)
    wrapped = nn.Sequential(model)
    for i in range(8):
        x, y = batch(seed=10 + i)
        wrapped.zero_grad()
        ref_opt.zero_grad()
        with amp.scale_loss(nn.functional.cross_entropy(wrapped(x), y), opt) as s:
            s.backward()
        opt.step()
        nn.functional.cross_entropy(ref(x.double()), y).backward()
        ref_opt.step()
    for (k, v), w in zip(model.state_dict().items(), ref.state_dict().values()):
        if v.is_floating_point():  # (bf16 compute: 1e-3 off; piled-up gradients: 8e-2)
            torch.testing.assert_close(v.double(), w, rtol=0, atol=1e-2, msg=k)


@pytest.mark.parametrize("drop", ["optimizer.zero_grad()", "optimizer.zero_grad(False)",
                                  "model.zero_grad", "p.grad = None"])
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_a_dropped_delay_unscale_window_leaves_the_next_steps_gradients_its_own(opt_level, drop):
    # Step, then leftover micro-batches at an epoch's end (a backward held with
    # delay_unscale, which sets aside the gradients before it), then the window dropped:
    # the next step's gradients are its own batch's. At O2 the held gradients sit on the half
    # parameters, which the optimizer (holding the masters) cannot see, and were added into
    # the next backward's; dropped through the model, what the window set aside came back at
    # the next unscale.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, loss_scale=512.0, dtype=torch.bfloat16,
                   verbosity=0)
    x, y = batch()
    train_step(model, opt, x, y, amp)  # (leaves the step's gradients at O0/O1/O3)
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt, delay_unscale=True) as s:
        s.backward()
    if drop == "optimizer.zero_grad()":
        opt.zero_grad()
    elif drop == "optimizer.zero_grad(False)":
        opt.zero_grad(set_to_none=False)
    elif drop == "model.zero_grad":
        model.zero_grad()
    else:
        for p in model.parameters():
            p.grad = None
    x2, y2 = batch(seed=2)
    ref = make_cnn()
    ref.load_state_dict(model.state_dict())  # (the fp32 weights: masters at O2)
    ref.double()
    with amp.scale_loss(nn.functional.cross_entropy(model(x2), y2), opt) as s:
        s.backward()
    nn.functional.cross_entropy(ref(x2.double()), y2).backward()
    # (bf16, O3's BatchNorm too; with the window's gradients in: ~1)
    assert _master_grads_error(opt, ref) < 5e-2


def test_a_dropped_window_leaves_nothing_aside_for_a_block_at_scale_one():
    """A delay_unscale window dropped by optimizer.zero_grad() takes with it the earlier
    gradients its backward set aside: a later block's gradients are its own batch's alone,
    also when that block runs at a static scale of 1.0 (a checkpoint's scale loaded since),
    where nothing is set aside again that would hide a stale entry. Compared with the same
    batch's fp32 gradients (exact: O1 without patching computes in fp32) (M02)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", loss_scale=128.0, dtype=torch.bfloat16,
                   patch_torch_functions=False, verbosity=0)
    x, x2 = torch.randn(8, 4), torch.randn(8, 4)
    with amp.scale_loss(model(x).pow(2).mean(), opt) as scaled:
        scaled.backward()
    with amp.scale_loss(model(x).pow(2).mean(), opt, delay_unscale=True) as scaled:
        scaled.backward()
    opt.zero_grad()
    with pytest.warns(UserWarning, match="replaces this run's static one"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})
    with amp.scale_loss(model(x2).pow(2).mean(), opt) as scaled:
        scaled.backward()
    ref = copy.deepcopy(model)
    ref.zero_grad()
    ref(x2).pow(2).mean().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0)


def test_two_overflowed_losses_skip_a_fused_step_once():
    """Two losses (num_losses=2) backpropagated before one step, both overflowing, with the
    loss scales on the device (torch's fused AdamW takes amp's found_inf): the step is
    skipped once, as on the host. Fused kernels subtract found_inf from their step counts
    (GradScaler's protocol), so the flags of several losses combine to 1, not 2: a fused run
    keeps the same step counts and weights as the unfused one through a skipped step (M38)."""
    def run(fused):
        model = make_cnn()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        amp.initialize(model, opt, opt_level="O1", loss_scale="dynamic", num_losses=2,
                       verbosity=0)
        x, y = batch()
        for poison in (False, True, False):
            opt.zero_grad()
            for loss_id in (0, 1):
                loss = nn.functional.cross_entropy(model(x), y)
                with amp.scale_loss(loss * (float("inf") if poison else 1.0), opt,
                                    loss_id=loss_id) as scaled:
                    scaled.backward()
            opt.step()
            assert amp.step_was_skipped(opt) is poison
        steps = [float(opt.state[p]["step"]) for p in model.parameters()]
        return steps, model.state_dict()

    (want_steps, want), (got_steps, got) = run(False), run(True)
    assert got_steps == want_steps == [2.0] * len(want_steps)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_another_blocks_in_place_average_of_unscaled_gradients_is_not_refused():
    # Apex's two-loss loop with a Reducer.reduce() inside each block: the second block's
    # reduce averages the first optimizer's gradients (unscaled already) in place. Not
    # gradients that block's backward wrote scaled: oa.step() runs, on the right values.
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    ref_a = copy.deepcopy(a)
    amp.initialize([a, b], [oa, ob], opt_level="O1", dtype=torch.bfloat16, loss_scale=512.0,
                   patch_torch_functions=False, verbosity=0)
    x = torch.randn(8, 4)
    with amp.scale_loss(a(x).pow(2).mean(), oa, loss_id=0) as s:
        s.backward()
    with amp.scale_loss(b(x).pow(2).mean(), ob) as s:
        s.backward()
        for p in a.parameters():  # (a one-rank "average")
            p.grad.mul_(1.0)
    oa.step()
    ob.step()
    ref_a(x).pow(2).mean().backward()
    with torch.no_grad():
        for p in ref_a.parameters():
            p -= 0.1 * p.grad
    for p, r in zip(a.parameters(), ref_a.parameters()):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-6)


def _conv_run(device, make_opt, channels_last, monkeypatch, fused_cast):
    from mixprec.amp import _state

    if fused_cast:
        monkeypatch.setattr(_state, "_FUSED_CAST_ON_CPU", True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten()).to(device)
    if channels_last == "before":
        model.to(memory_format=torch.channels_last)
    opt = make_opt(model.parameters())
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    if channels_last == "after":
        model.to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 4, generator=g)
        opt.zero_grad()
        loss = (model(x.to(device)).float() - y.to(device)).square().mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        for master in amp.master_params(opt):
            assert master.grad.stride() == master.stride()  # (autograd's layout contract)
        opt.step()
    monkeypatch.undo()
    return model.state_dict()


@pytest.mark.parametrize("fused_cast", [False, True], ids=["torch-cast", "fused-cast"])
@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, fused=True),
], ids=["AdamW", "SGD"])
def test_a_model_moved_to_channels_last_after_initialize_trains_as_one_moved_before(
        device, make_opt, fused_cast, monkeypatch):
    # The masters keep the layout they were made with; their gradients were cast from the half
    # gradients, channels-last after the move, and a fused optimizer (pairing elements by
    # memory offset) trained wrong weights on the CPU (0.055 off after 3 AdamW steps) and
    # failed inside PyTorch on CUDA. Now each master's gradient is laid out as the master.
    # Reference: the model moved before initialize, bit for bit (elementwise optimizer math).
    if fused_cast and device.type == "cpu" and interpreter_skip_reason() is not None:
        pytest.skip(str(interpreter_skip_reason()))
    if fused_cast and device.type == "cuda":
        pytest.skip("on CUDA the fused cast is the default path: the torch-cast case runs it")
    before = _conv_run(device, make_opt, "before", monkeypatch, fused_cast)
    after = _conv_run(device, make_opt, "after", monkeypatch, fused_cast)
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.skipif(interpreter_skip_reason() is not None,
                    reason=str(interpreter_skip_reason()))
def test_the_fused_cast_takes_only_gradients_laid_out_as_their_masters(monkeypatch):
    # The kernel walks both tensors in memory order: strides must agree, but for size-1
    # dimensions (which address nothing: a depthwise conv's weight, (C, 1, k, k)).
    from mixprec.amp import _state

    monkeypatch.setattr(_state, "_FUSED_CAST_ON_CPU", True)
    ok = _state._fused_cast_ok
    half = torch.empty(8, 4, 3, 3, dtype=torch.bfloat16)
    last = half.to(memory_format=torch.channels_last)
    assert ok([half], [torch.empty(8, 4, 3, 3)])
    assert ok([last], [torch.empty_like(last, dtype=torch.float32)])
    assert not ok([last], [torch.empty(8, 4, 3, 3)])
    assert not ok([half], [torch.empty_like(last, dtype=torch.float32)])
    depthwise = torch.empty(8, 1, 3, 3, dtype=torch.bfloat16)
    assert ok([depthwise], [torch.empty_strided((8, 1, 3, 3), (9, 1, 3, 1))])
    assert not ok([half.transpose(2, 3)], [torch.empty(8, 4, 3, 3)])
    assert not ok([half, half.float()], [torch.empty(8, 4, 3, 3)] * 2)  # (not half)


@pytest.mark.skipif(interpreter_skip_reason() is not None,
                    reason=str(interpreter_skip_reason()))
def test_the_fused_cast_takes_only_gradients_of_their_masters_shape(monkeypatch):
    """The fused cast walks each fp32 gradient for its half gradient's element count: a half
    gradient whose shape differs from its master's (a parameter replaced by one of another
    shape after initialize) goes to the PyTorch pass, which raises amp's error naming the
    parameter, even where the strides agree (one more row: the kernel would write past the
    master's gradient) (C22)."""
    from mixprec.amp import _state

    monkeypatch.setattr(_state, "_FUSED_CAST_ON_CPU", True)
    ok = _state._fused_cast_ok
    assert ok([torch.empty(8, 4, 3, 3, dtype=torch.bfloat16)], [torch.empty(8, 4, 3, 3)])
    assert not ok([torch.empty(9, 4, 3, 3, dtype=torch.bfloat16)], [torch.empty(8, 4, 3, 3)])
    assert not ok([torch.empty(8, 4, 3, 3, dtype=torch.float16)], [torch.empty(8, 4, 3, 2)])


def test_the_fused_cast_is_not_taken_with_a_triton_it_was_not_verified_with(monkeypatch):
    """The fused cast + unscale runs only on a Triton it was verified with (3.6 on): with an
    older one the PyTorch passes serve, so that a user on an older Triton gets PyTorch's
    well-tested results rather than an unverified kernel's. The same gradients are taken with
    a verified one. (S03)"""
    from mixprec.amp import _multi_tensor, _state

    monkeypatch.setattr(_state, "_FUSED_CAST_ON_CPU", True)
    half, fp32 = [torch.empty(8, 4, dtype=torch.bfloat16)], [torch.empty(8, 4)]
    monkeypatch.setattr(_multi_tensor, "verified_triton", lambda: True)
    assert _state._fused_cast_ok(half, fp32)
    monkeypatch.setattr(_multi_tensor, "verified_triton", lambda: False)
    assert not _state._fused_cast_ok(half, fp32)


@pytest.mark.parametrize("shape", [(0,), (2,), (1, 0)])
def test_a_loss_of_other_than_one_element_is_refused_on_entry(shape):
    # (a mutation of frontend.py: `loss.numel() != 1` -> `> 1`): an empty loss (a reduction over an
    # empty dimension) went through, scaled, and failed later in backward with torch's "grad can be
    # implicitly created only for scalar outputs" instead of amp's "must be a scalar".
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x, _ = batch()
    loss = model(x).float().sum() * torch.ones(shape)
    with pytest.raises(ValueError, match=r"amp\.scale_loss\(loss=\.\.\.\): got a tensor of "
                                         r"shape .*; the loss must be a scalar"):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    assert all(p.grad is None for p in model.parameters())


def test_delay_unscale_given_as_a_string_is_refused():
    """delay_unscale read from a config file as the string "False" would be truthy and keep the
    gradients scaled for a step; scale_loss refuses any string with a TypeError naming the
    argument, before the backward, and the gradients are left untouched. (F43)"""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x, y = batch()
    loss = nn.functional.cross_entropy(model(x), y)
    with pytest.raises(TypeError, match=r"amp\.scale_loss\(delay_unscale='False'\): expected "
                                        r"True or False, got str"):
        with amp.scale_loss(loss, opt, delay_unscale="False") as scaled:
            scaled.backward()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_a_one_element_loss_of_any_shape_trains_as_its_scalar(shape):
    """A loss with one element but a shape, (1,) or (1, 1) (a loss gathered from one replica,
    or kept with keepdim=True, as Apex accepted), goes through scale_loss as the 0-dim loss of
    the same value does: the same scaled value and bit-identical gradients. (F41)"""
    x, y = batch(n=8)
    grads = []
    for view in ((), shape):
        model = make_cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, loss_scale=128.0,
                       verbosity=0)
        loss = nn.functional.cross_entropy(model(x), y).reshape(view)
        with amp.scale_loss(loss, opt) as scaled:
            assert scaled.shape == loss.shape
            torch.testing.assert_close(scaled, loss.float() * 128.0, rtol=0, atol=0)
            scaled.backward()
        grads.append([p.grad.clone() for p in amp.master_params(opt)])
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- mutation run r50B over mixprec/amp/_state.py: what the tests above let through --------

def _bf16(model, opt, opt_level, **kw):
    kw.setdefault("loss_scale", 128.0)
    return amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0,
                          **kw)


# zero_grad(set_to_none=False) over a held delay_unscale window zeroes the half gradients in
# place, as fp32 training zeroes every gradient tensor.
def test_zero_grad_keeping_tensors_over_a_held_window_zeroes_the_half_gradients_in_place():
    # fp32 training's zero_grad(set_to_none=False) leaves every gradient a zero tensor (the same
    # object); at O2 the half gradients a delay_unscale window holds must be zeroed likewise
    # (torch DDP with find_unused_parameters=True needs them to be tensors).
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = _bf16(model, opt, "O2")
    with amp.scale_loss(model(torch.randn(2, 4).bfloat16()).float().sum(), opt,
                        delay_unscale=True) as scaled:
        scaled.backward()
    held = [p.grad for p in model.parameters()]
    assert all(g is not None for g in held)
    opt.zero_grad(set_to_none=False)
    for p, g in zip(model.parameters(), held):
        assert p.grad is g  # zeroed in place, not replaced or dropped
        assert torch.count_nonzero(p.grad) == 0


# A sparse gradient set aside by one block is added onto the dense gradient of the next
# block's backward.
def test_a_sparse_gradient_set_aside_is_added_onto_a_dense_one_of_the_next_backward():
    # O1 (no masters) at a static scale 512: the first backward's gradient of an embedding
    # weight is sparse (F.embedding(sparse=True)); the second backward uses the weight densely.
    # At the second block's exit the sum must be the fp32 reference's.
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    ref = copy.deepcopy(emb)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb, opt = amp.initialize(emb, opt, opt_level="O1", dtype=torch.bfloat16, loss_scale=512.0,
                              patch_torch_functions=False, verbosity=0)
    idx = torch.tensor([1, 3, 3])

    def losses(m):
        return (nn.functional.embedding(idx, m.weight, sparse=True).pow(2).sum(),
                (m.weight * torch.arange(4.0)).sum())

    for loss in losses(emb):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    for loss in losses(ref):
        loss.backward()
    torch.testing.assert_close(emb.weight.grad.to_dense(), ref.weight.grad.to_dense(),
                               rtol=1e-6, atol=1e-6)


# The foreign-backward watch does not count an optimizer's own backward, run in a block
# nested inside another optimizer's open block.
def test_a_block_nested_inside_another_optimizers_block_steps_its_own_gradients():
    # Two models of one initialize (O1, static scale 512): B's block opened inside A's, after
    # A's backward. B's own backward is B's, not a foreign one: both steps run, and the
    # gradients are the fp32 reference's.
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3), nn.Linear(4, 2)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    amp.initialize([a, b], [oa, ob], opt_level="O1", dtype=torch.bfloat16, loss_scale=512.0,
                   patch_torch_functions=False, verbosity=0)
    x = torch.randn(5, 4)
    with amp.scale_loss(a(x).pow(2).mean(), oa) as sa:
        sa.backward()
        with amp.scale_loss(b(x).pow(2).mean(), ob) as sb:
            sb.backward()
    ref_a(x).pow(2).mean().backward()
    ref_b(x).pow(2).mean().backward()
    for m, r in ((a, ref_a), (b, ref_b)):
        for p, q in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    ob.step()  # (refused under the mutant: "still hold that loss's scale")
    oa.step()


# One loss over several optimizers whose scale lives on the device: their overflow flags
# combine as a maximum (a sum of 2 left step counts at -1).
def test_a_loss_overflowing_in_two_fused_optimizers_leaves_their_step_counts_alone():
    # GradScaler's protocol: the fused kernel adds 1 to the step count and subtracts found_inf.
    # Both optimizers overflow in one backward: found_inf must be 1, not 2, or the skipped
    # step leaves step = -1 and the next one divides by 1 - beta**0 = 0.
    a, b, oa, ob = _two_models_one_loss(fused=True)
    x = torch.randn(5, 4).bfloat16()
    with amp.scale_loss((a(x).float().sum() + b(x).float().sum()) * float("inf"),
                        [oa, ob]) as s:
        s.backward()
    oa.step()
    ob.step()
    assert amp.step_was_skipped(oa) and amp.step_was_skipped(ob)
    for opt in (oa, ob):
        assert all(float(st["step"]) == 0 for st in opt.state.values()), opt.state
    with amp.scale_loss((a(x).float().sum() + b(x).float().sum()), [oa, ob]) as s:
        s.backward()
    oa.step()
    ob.step()
    for opt in (oa, ob):
        assert all(float(st["step"]) == 1 for st in opt.state.values())
    assert all(torch.isfinite(p).all() for p in [*a.parameters(), *b.parameters()])


# A step right after delay_unscale=True is refused without master weights too (O1, O3), not
# only at O2: the gradients still hold the scale.
@pytest.mark.parametrize("opt_level", ["O1", "O3"])
def test_step_after_delay_unscale_is_an_error_without_master_weights(opt_level):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = _bf16(model, opt, opt_level)
    x = torch.randn(3, 4).to(model.weight.dtype)
    with amp.scale_loss(model(x).float().sum(), opt, delay_unscale=True) as scaled:
        scaled.backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="delay_unscale=True"):
        opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


# A failed backward's partial (scaled) gradients are taken off the parameters that had none
# before the block, as the set-aside ones are given back.
@pytest.mark.parametrize("opt_level", ["O1", "O3"])
def test_a_failed_first_backward_leaves_no_scaled_gradient_behind(opt_level):
    # The first micro-batch's backward fails after the head received its (scaled) gradient;
    # the caller skips it. The next micro-batch's gradients alone must reach the step: the
    # fp32 reference's, not 512 times the failed head gradient added.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ref = copy.deepcopy(model).to(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                loss_scale=512.0, verbosity=0,
                                patch_torch_functions=False if opt_level == "O1" else None)
    dtype = model[0].weight.dtype
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    with pytest.raises(RuntimeError, match="simulated"):
        with amp.scale_loss(model[1](FailingBackward.apply(model[0](x1.to(dtype))))
                            .float().sum(), opt) as scaled:
            scaled.backward()  # the head's gradients are written, then it fails
    with amp.scale_loss(model(x2.to(dtype)).float().sum(), opt) as scaled:
        scaled.backward()
    ref(x2.double()).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double(), r.grad,
                                   rtol=2e-2 if opt_level == "O3" else 1e-5, atol=1e-2)


def test_a_block_that_fails_before_its_backward_keeps_a_held_window_at_o2():
    """At O2, gradients held scaled by ``delay_unscale=True`` (an earlier micro-batch of the
    window) stay on the half model when a later block raises before its backward (a caller
    skipping a bad micro-batch): the window's last backward then brings them to the masters
    with its own, as the fp32 reference sums them (C47)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ref = copy.deepcopy(model).to(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                loss_scale=512.0, verbosity=0)
    g = torch.Generator().manual_seed(1)
    x1, x2, x3 = (torch.randn(3, 4, generator=g) for _ in range(3))
    with amp.scale_loss(model(x1.bfloat16()).float().sum(), opt, delay_unscale=True) as s:
        s.backward()
    with pytest.raises(ValueError, match="bad micro-batch"):
        with amp.scale_loss(model(x2.bfloat16()).float().sum(), opt) as s:
            raise ValueError("bad micro-batch")
    with amp.scale_loss(model(x3.bfloat16()).float().sum(), opt) as s:
        s.backward()
    (ref(x1.double()).sum() + ref(x3.double()).sum()).backward()
    for m, r in zip(amp.master_params(opt), ref.parameters()):
        torch.testing.assert_close(m.grad.double(), r.grad, rtol=2e-2, atol=1e-2)


# A gradient scaled by another optimizer's block and zeroed in place since (the model's
# zero_grad(set_to_none=False)) no longer counts as foreign: the step runs.
def test_gradients_of_another_blocks_backward_zeroed_in_place_through_the_model_step():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    [a, b], [oa, ob] = amp.initialize([a, b], [oa, ob], opt_level="O1", dtype=torch.bfloat16,
                                      loss_scale=512.0, verbosity=0)
    x = torch.randn(8, 4)
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), ob) as s:
        s.backward()  # a's gradients: scaled by 512, never unscaled for oa
    ob.step()
    a.zero_grad(set_to_none=False)  # zeroed in place: nothing scaled is left
    want = [p.detach().clone() for p in a.parameters()]
    oa.step()
    for p, w in zip(a.parameters(), want):
        assert torch.equal(p, w)


# A reload after an overflowed backward (a rollback) forgets the overflow and its non-finite
# gradients.
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_rollback_in_a_loop_that_zeroes_after_the_step_trains_on_from_the_checkpoint(
        opt_level):
    # A loop of forward, backward, step, zero_grad (zeroing after the step), that reloads its
    # checkpoint after an overflowed backward: the next step is the checkpoint's next step,
    # not skipped again on the abandoned run's inf gradients.
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                              loss_scale="dynamic", verbosity=0)

    def step(model, opt, x, scale=1.0):
        with amp.scale_loss(model(x.to(model[0].weight.dtype)).float().pow(2).mean() * scale,
                            opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()

    x = torch.randn(6, 4)
    model, opt = build()
    step(model, opt, x)
    ckpt = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    ref_model, ref_opt = build()
    ref_model.load_state_dict(ckpt["model"])
    ref_opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
    step(ref_model, ref_opt, x)

    with amp.scale_loss(model(x.to(model[0].weight.dtype)).float().pow(2).mean()
                        * float("inf"), opt) as s:
        s.backward()  # a loss spike: the loop rolls back instead of stepping
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
    step(model, opt, x)
    assert not amp.step_was_skipped(opt)
    got, want = model.state_dict(), ref_model.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


# An optimizer class whose zero_grad() takes no set_to_none drops the gradients, as torch's
# default does: an unused master gets no zero gradient for momentum to move it with.
def _head_b_at_o2(optimizer_class, steps, **options):
    """``_TwoHeads`` at O2 (bf16, scale 1) stepped by ``optimizer_class(params, lr=0.1,
    **options)``; ``steps`` holds ``(zero_grad, use_b)`` per step, ``zero_grad(opt)`` run
    first. Returns head b's parameters after the first step, and the parameters themselves."""
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = optimizer_class(model.parameters(), lr=0.1, **options)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                loss_scale=1.0, verbosity=0)
    x = torch.randn(3, 8)
    after_first = None
    for zero_grad, use_b in steps:
        zero_grad(opt)
        with amp.scale_loss(model(x, use_b).float().pow(2).mean(), opt) as s:
            s.backward()
        opt.step()
        if after_first is None:
            after_first = [p.detach().clone() for p in model.b.parameters()]
    return after_first, list(model.b.parameters())


def test_an_optimizer_whose_zero_grad_takes_no_argument_sets_to_none_as_torch_does():
    class OldSGD(torch.optim.SGD):
        def zero_grad(self):  # (an older signature: drops the gradients)
            super().zero_grad(set_to_none=True)

    def zero_grad(opt):
        opt.zero_grad()

    # b unused at the second step.
    after_first, b = _head_b_at_o2(OldSGD, [(zero_grad, True), (zero_grad, False)],
                                   momentum=0.9)
    # As fp32 SGD after zero_grad(set_to_none=True): a parameter without a gradient is
    # skipped, its momentum does not move it.
    for p, q in zip(b, after_first):
        assert torch.equal(p, q)


# The device-side overflow flags of two backwards before one step combine as a maximum.
@pytest.mark.parametrize("clean_first", [False, True])
def test_an_overflow_in_either_micro_batch_skips_a_fused_step(clean_first):
    # Accumulation over two scale_loss blocks (no delay_unscale) with the scale on the device
    # (fused AdamW, one device): one overflowed micro-batch skips the step, whichever it was,
    # as on the host; the parameters stay finite and unchanged.
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(5, 4).bfloat16()
    for bad in ((False, True) if clean_first else (True, False)):
        loss = model(x).float().pow(2).mean() * (float("inf") if bad else 1.0)
        with amp.scale_loss(loss, opt) as s:
            s.backward()
    opt.step()
    assert amp.step_was_skipped(opt)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


# A step skipped for an overflow while zero_grad keeps gradient tensors: a master unused at
# a later step gets a zero gradient, as fp32's kept tensor (weight decay goes on moving it).
def test_kept_gradient_tensors_through_a_skipped_first_step_step_unused_masters_as_fp32():
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    x = torch.randn(3, 8)
    opt.zero_grad(set_to_none=False)
    with amp.scale_loss(model(x, True).float().pow(2).mean() * float("inf"), opt) as s:
        s.backward()  # the first step overflows (as fp16's first steps at 2**16 do)
    opt.step()
    assert amp.step_was_skipped(opt)
    masters = dict(zip((id(p) for p in model.parameters()), amp.master_params(opt)))
    b_masters = [masters[id(p)] for p in model.b.parameters()]
    before = [m.detach().clone() for m in b_masters]
    opt.zero_grad(set_to_none=False)
    with amp.scale_loss(model(x, False).float().pow(2).mean(), opt) as s:
        s.backward()  # b unused
    opt.step()
    # fp32 with kept tensors: b's gradient is a zero tensor, and weight decay moves it.
    for m, b in zip(b_masters, before):
        torch.testing.assert_close(m.detach(), b * (1 - 0.1 * 0.5), rtol=1e-6, atol=0)


# A delay_unscale window opened again after one dropped by zero_grad(set_to_none=False):
# a step right after it is refused (it would run on nothing, dropping the new window).
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_step_right_after_a_window_opened_again_after_a_dropped_one_is_an_error(opt_level):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = _bf16(model, opt, opt_level,
                       patch_torch_functions=False if opt_level == "O1" else None)
    x = torch.randn(3, 4).to(model.weight.dtype)
    for _ in range(2):
        with amp.scale_loss(model(x).float().sum(), opt, delay_unscale=True) as scaled:
            scaled.backward()
        if _ == 0:
            opt.zero_grad(set_to_none=False)  # the first window dropped
    with pytest.raises(RuntimeError, match="delay_unscale=True"):
        opt.step()


# A skipped step records what the LR scheduler's wrapper of step() records: a scheduler
# stepped after an overflowed first step does not warn it came before optimizer.step(). The
# same for a scheduler built on a wrapper's inner optimizer (LARC's .optim): amp's skipped
# step counts as the inner optimizer's step too (r53C's C38).
@pytest.mark.parametrize("larc", [False, True])
@pytest.mark.parametrize("scheduler_first", [True, False])
def test_a_scheduler_stepped_after_an_overflowed_first_step_does_not_warn(scheduler_first,
                                                                          larc):
    from mixprec.parallel import LARC

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if larc:
        opt = LARC(opt)
    inner = opt.optim if larc else opt
    if scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(inner, 1, 0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    inner = opt.optim if larc else opt
    if not scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(inner, 1, 0.5)
    with amp.scale_loss(model(torch.randn(3, 4).bfloat16()).float().sum() * float("inf"),
                        opt) as s:
        s.backward()
    opt.step()
    assert amp.step_was_skipped(opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step()
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], \
        [str(w.message) for w in caught]
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize("case", ["group added", "skipped step"])
def test_zeroing_after_the_step_follows_fp32_past_a_group_added_and_a_skipped_step(case):
    # A loop zeroing with set_to_none=False after its step (none before the first backward),
    # SGD with weight decay. "group added": head b, never used, gets its group after the
    # first step: fp32's b.grad stays None, so b must not be stepped (weight decay) once the
    # zeroing starts keeping tensors. "skipped
    # step": the first step (b used) overflows and is skipped; GradScaler's skip leaves fp32's
    # gradients, the zero_grad after it keeps them as zeros, and b, unused from then on, is
    # stepped with them.
    torch.manual_seed(0)
    base = _TwoHeads()
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]

    def run(use_amp):
        model = copy.deepcopy(base)
        first = model.a.parameters() if case == "group added" else model.parameters()
        opt = torch.optim.SGD(first, lr=0.1, momentum=0.9, weight_decay=0.1)
        scaler = None
        if use_amp:
            amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                           loss_scale="dynamic", verbosity=0)
        else:
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        b_from = model.state_dict()["b.weight"].float().clone()  # (b's fp32 value: O2's master)
        for i, (x, y) in enumerate(data):
            use_b = bad = case == "skipped step" and i == 0
            _two_heads_step(model, opt, scaler, x, y, use_b, bad)
            if i == 0 and case == "group added":
                opt.add_param_group({"params": list(model.b.parameters())})
                # (at O2, b's master now: b was cast to half with the model, not in a group)
                b_from = model.state_dict()["b.weight"].float().clone()
            opt.zero_grad(set_to_none=False)
        return {k: v.float() for k, v in model.state_dict().items()}, b_from

    (want, want_from), (got, got_from) = run(False), run(True)
    moved = not torch.equal(want["b.weight"], want_from)
    assert moved == (case == "skipped step")
    assert (not torch.equal(got["b.weight"], got_from)) == moved
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-2, msg=k)


@pytest.mark.parametrize("opt_level, loss_scale, fused, want", [
    ("O1", "dynamic", False, r"the block unscales the gradients and checks them for inf/NaN "
                             r"when it exits, so here they are still multiplied by the loss "
                             r"scale\. Call optimizer\.step\(\) after the block"),
    ("O1", 128.0, True, r"still multiplied by the loss scale\. Call"),
    ("O2", "dynamic", False, r"unscales the gradients into the fp32 master weights and checks "
                             r"them for inf/NaN when it exits, so here they are still "
                             r"multiplied by the loss scale and not yet on the fp32 master "
                             r"weights\."),
    ("O2", 1.0, False, r"into the fp32 master weights when it exits, so here they are not yet "
                       r"on the fp32 master weights\."),
    ("O3", 1.0, False, None),  # (nothing differs: the step runs)
    ("O1", 1.0, False, None),
])
def test_a_step_inside_the_scale_loss_block_is_refused(opt_level, loss_scale, fused, want):
    # An Apex-era slip: optimizer.step() indented into the block. At O1 it stepped on
    # gradients still multiplied by 65536, silently (a weight moved 1478 instead of 0.023);
    # at O2 it raised that the backward had not run inside scale_loss, which it had (r102C
    # R1). Refused before the optimizer steps, the parameters untouched; under a static 1.0
    # without masters nothing differs and it runs, as after the block.
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                loss_scale=loss_scale, verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(5, 4)
    loss = model(x.bfloat16() if opt_level != "O1" else x).float().pow(2).mean()
    if want is None:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            opt.step()
        assert not torch.equal(before[0], model.weight)
        return
    with pytest.raises(RuntimeError, match=r"optimizer\.step\(\) was called inside `with "
                                           r"amp\.scale_loss\(\.\.\.\)`: .*" + want):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    opt.zero_grad()  # (and the loop goes on as it should have been written)
    with amp.scale_loss(model(x.bfloat16() if opt_level != "O1" else x).float().pow(2).mean(),
                        opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(before[0], model.weight)


# zero_grad(set_to_none=True) forgets which masters had gradients under an earlier
# zero_grad(set_to_none=False): a master unused since keeps no gradient, as in fp32.
def test_switching_zero_grad_modes_does_not_revive_an_unused_masters_gradient():
    def zero_grad(set_to_none):
        return lambda opt: opt.zero_grad(set_to_none=set_to_none)

    after_first, b = _head_b_at_o2(
        torch.optim.SGD,
        [(zero_grad(False), True), (zero_grad(True), False), (zero_grad(False), False)],
        weight_decay=0.5)
    # fp32: b's gradient is None from the set_to_none=True zero_grad on, and stays None through
    # the later zero_grad(set_to_none=False): SGD never moves b again.
    for p, q in zip(b, after_first):
        assert torch.equal(p, q)


# An overflowed step reached through a step bound before initialize copies nothing into the
# half model (a write made to it since the last step stays).
def test_an_overflowed_step_through_a_bound_step_keeps_a_write_to_the_half_model():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = opt.step  # (bound before initialize: the class's step, amp's hooks around it)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    x = torch.randn(3, 4).bfloat16()
    with amp.scale_loss(model(x).float().sum() * float("inf"), opt) as s:
        s.backward()
    with torch.no_grad():
        model.weight.fill_(0.5)  # (nn.init, a re-initialised layer: amp takes such writes)
    step()
    assert amp.step_was_skipped(opt)
    assert torch.all(model.weight == 0.5)  # (the skipped step wrote nothing into the model)


@pytest.mark.parametrize("fused", [False, True])  # fused: the scale lives on the device
def test_held_gradients_follow_a_scale_loaded_inside_the_window(fused):
    """Gradients held scaled (delay_unscale) carry the scale of their backward; a scale set
    before the window's last micro-batch (amp.load_state_dict, or an Apex script writing
    loss_scalers[0]._loss_scale) must rescale them to the new one, or the first micro-batch
    counts new/old times. Reference: both micro-batches' gradients summed in float64. (S15)"""
    torch.manual_seed(0)
    a = nn.Linear(4, 3)
    ref = copy.deepcopy(a).double()
    opt = torch.optim.AdamW(a.parameters(), lr=0.1, fused=fused)
    a, opt = amp.initialize(a, opt, opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic",
                            patch_torch_functions=False, verbosity=0)
    gen = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    with amp.scale_loss(a(x1).pow(2).mean(), opt, delay_unscale=True) as s:
        s.backward()  # held at 2**16
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 0}})
    loss = a(x2).pow(2).mean()
    with amp.scale_loss(loss, opt) as s:
        assert float(s.detach()) == pytest.approx(1024.0 * float(loss.detach()))
        s.backward()
    for x in (x1, x2):
        ref(x.double()).pow(2).mean().backward()
    got = torch.cat([p.grad.double().flatten() for p in a.parameters()])
    want = torch.cat([r.grad.flatten() for r in ref.parameters()])
    assert (got - want).norm() / want.norm() < 1e-5


@pytest.mark.parametrize("loss_id", [-1, 2, 1.0, True])
def test_loss_id_outside_num_losses_is_refused_with_the_range(loss_id):
    """``loss_id`` must be an int in ``[0, num_losses)``: a negative one (which would pick the
    last scaler from the end), one equal to ``num_losses``, a float and a bool (True is not loss 1) are refused, before any
    backward, with the range and how to get more. (M28, M31)"""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", num_losses=2, verbosity=0)
    with pytest.raises(ValueError, match=rf"loss_id={loss_id!r}\) \({type(loss_id).__name__}\): "
                                         r"amp\.initialize was called with num_losses=2, so "
                                         r"loss_id must be a Python or NumPy integer in "
                                         r"\[0, 1\] \(not a tensor: use \.item\(\)\)\. Raise "
                                         r"num_losses"):
        with amp.scale_loss(model(batch()[0]).sum(), opt, loss_id=loss_id):
            pass
    assert all(p.grad is None for p in model.parameters())


class _SparseLM(nn.Module):
    """A sparse embedding (stepped by a SparseAdam) under a dense projection, as NVIDIA's
    Transformer-XL with sampled softmax."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 8, sparse=True)
        self.proj = nn.Linear(8, 4)

    def forward(self, tokens):
        return self.proj(self.emb(tokens))


def _sparse_lm_blocks(opt_level, dtype, steps=2, both=False, **kw):
    """Train _SparseLM with Adam over the projection and SparseAdam over the embedding,
    passing amp both optimizers (``both``) or, as Transformer-XL did, the dense one alone."""
    model = _SparseLM()
    dense = torch.optim.Adam(model.proj.parameters(), lr=1e-2)
    sparse = torch.optim.SparseAdam(model.emb.parameters(), lr=1e-2)
    opts = [dense, sparse] if both else dense
    model, opts = amp.initialize(model, opts, opt_level=opt_level, dtype=dtype, verbosity=0,
                                 **kw)
    for step in range(steps):
        tokens = torch.randint(0, 20, (16,), generator=torch.Generator().manual_seed(step))
        loss = model(tokens).float().square().mean()
        with amp.scale_loss(loss, opts) as scaled:
            scaled.backward()
        dense.step()
        sparse.step()
        dense.zero_grad()
        sparse.zero_grad()
    return model


@pytest.mark.parametrize("opt_level, dtype, want", [
    ("O2", torch.float16, r"their gradients stay multiplied by the loss scale \(65536\); the "
                          r"half ones have no fp32 master weights"),
    ("O2", torch.bfloat16, r"The half ones have no fp32 master weights, which"),
    ("O1", torch.float16, r"Their gradients stay multiplied by the loss scale \(65536\), which"),
], ids=["O2-fp16", "O2-bf16", "O1-fp16"])
def test_gradients_no_amp_optimizer_holds_are_warned_about_once(opt_level, dtype, want):
    """NVIDIA's Transformer-XL (sampled softmax) gave amp.initialize its dense Adam but not
    the SparseAdam over its sparse embedding, and stepped both: at O2 fp16 the embedding's
    gradient left the block multiplied by 65536 and SparseAdam's fp16 state overflowed, the
    embedding went NaN at the second step and every step after was skipped (r93A). amp now
    warns at the first block, at the user's with statement, naming the parameter, the scale
    where it is not 1 and the missing masters at O2; once."""
    with pytest.warns(UserWarning, match=r"1 parameter\(s\) of the model got gradients in "
                                         r"this backward that no optimizer given to "
                                         r"amp.initialize holds: emb.weight\. ") as record:
        _sparse_lm_blocks(opt_level, dtype, steps=3)
    ours = [w for w in record if "no optimizer given to amp.initialize holds" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__, [str(w.message) for w in ours]
    text = str(ours[0].message)
    assert re.search(want, text, flags=re.IGNORECASE), text
    assert ("Pass every optimizer to amp.initialize (a list: amp.initialize(model, [opt, "
            "opt_sparse], ...))") in text
    if opt_level == "O1":
        assert "master" not in text


@pytest.mark.parametrize("case", ["both-optimizers", "frozen", "O0", "O3-bf16",
                                  "held-by-another-call", "stale-teacher", "stale-unreached"])
def test_no_unheld_gradient_warning_where_every_gradient_is_amps(case):
    """No warning where every gradient the backward writes is an amp optimizer's (both
    optimizers passed: the Transformer-XL fix, which trains), where the parameter no
    optimizer holds is frozen, where nothing is scaled and there are no masters (O0, O3
    bf16), where another initialize call's optimizer holds it (a GAN's generator, reached
    by the discriminator's loss), or where the gradient no optimizer holds is an old one
    this backward did not write: a teacher trained in fp32 earlier in the script, then
    frozen and given to initialize with the student (PyTorch's distillation tutorial; r94B
    B1), or a layer not frozen but not on this loss's path."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if case == "both-optimizers":
            model = _sparse_lm_blocks("O2", torch.float16, steps=3, both=True)
            assert torch.isfinite(model.emb.weight).all()
        elif case in ("O0", "O3-bf16"):
            _sparse_lm_blocks(case[:2], torch.bfloat16, steps=2)
        elif case == "frozen":
            model = _SparseLM()
            model.emb.requires_grad_(False)
            opt = torch.optim.Adam(model.proj.parameters(), lr=1e-2)
            model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
            with amp.scale_loss(model(torch.arange(6)).float().sum(), opt) as scaled:
                scaled.backward()
        elif case in ("stale-teacher", "stale-unreached"):
            from .helpers import make_mlp

            student, teacher = make_mlp(), make_mlp(seed=1)
            teacher(torch.randn(4, 4)).sum().backward()  # (its own fp32 training, before)
            if case == "stale-teacher":
                teacher.requires_grad_(False)
            opt = torch.optim.SGD(student.parameters(), lr=0.1)
            [student, teacher], opt = amp.initialize([student, teacher], opt, opt_level="O1",
                                                     verbosity=0)
            x = torch.randn(4, 4)
            with torch.no_grad():
                soft = teacher(x).softmax(-1)
            loss = -(soft * student(x).log_softmax(-1)).sum(-1).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            assert all(p.grad is not None for p in teacher.parameters())
        else:
            from .helpers import make_mlp

            gen, disc = make_mlp(), nn.Linear(2, 1)
            opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
            opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
            gen, opt_g = amp.initialize(gen, opt_g, opt_level="O2", verbosity=0)
            disc, opt_d = amp.initialize(disc, opt_d, opt_level="O2", verbosity=0)
            fake = gen(torch.randn(4, 4))
            with amp.scale_loss(disc(fake).float().mean(), opt_d) as scaled:
                scaled.backward()  # (through the generator too: its gradients, opt_g's)
            assert all(p.grad is not None for p in gen.parameters())


def test_the_unheld_gradient_look_runs_at_each_losss_first_block():
    """num_losses=2, the dense loss first: the Transformer-XL case reached through the second
    loss alone is still found, at that loss's first block (r94B R3), and the parameter is
    named with its model's place where initialize took several models."""
    model = _SparseLM()
    other = nn.Linear(2, 2)
    dense = torch.optim.Adam(list(model.proj.parameters()) + list(other.parameters()), lr=1e-2)
    # (The SparseAdam over model.emb, left out of initialize, would step it after the block.)
    [model, other], dense = amp.initialize([model, other], dense, opt_level="O2", num_losses=2,
                                           verbosity=0)
    tokens = torch.arange(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        feats = model.emb(tokens).detach()
        with amp.scale_loss(model.proj(feats).float().sum(), dense, loss_id=0) as scaled:
            scaled.backward()
    with pytest.warns(UserWarning, match=r"1 parameter\(s\) of the models got gradients in "
                                         r"this backward that no optimizer given to "
                                         r"amp.initialize holds: models\[0\]\.emb\.weight\. "):
        with amp.scale_loss(model(tokens).float().sum(), dense, loss_id=1) as scaled:
            scaled.backward()


def test_a_loss_whose_gradients_another_losss_block_unscales_is_looked_at_there():
    """num_losses=2, loss 0's blocks always delay_unscale=True (loss 1's block unscales both):
    loss 0's backward into an embedding no optimizer holds is reported at loss 1's block, and
    the watch ends there instead of running at every loss-0 block (r95A B3: 21 walks in 20
    steps and no warning)."""
    from mixprec.amp import frontend

    model = _SparseLM()
    model.emb = nn.Embedding(20, 8)  # (dense; its optimizer would be elsewhere)
    dense = torch.optim.Adam(model.proj.parameters(), lr=1e-3)
    model, dense = amp.initialize(model, dense, opt_level="O2", loss_scale=128.0, num_losses=2,
                                  verbosity=0)
    watches = []
    real = frontend.UnheldWatch

    def counted(state):
        watches.append(1)
        return real(state)

    tokens = torch.arange(6)
    with pytest.warns(UserWarning, match=r"holds: emb\.weight\. Their gradients stay "
                                         r"multiplied by the loss scale \(128\)") as record:
        frontend.UnheldWatch = counted
        try:
            for _ in range(5):
                with amp.scale_loss(model.proj(model.emb(tokens)).float().sum(), dense,
                                    loss_id=0, delay_unscale=True) as scaled:
                    scaled.backward()
                feats = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)).half()
                with amp.scale_loss(model.proj(feats).float().sum(), dense,
                                    loss_id=1) as scaled:
                    scaled.backward()
                dense.step()
                dense.zero_grad()
                model.emb.zero_grad()
        finally:
            frontend.UnheldWatch = real
    assert len([w for w in record if "no optimizer given" in str(w.message)]) == 1
    assert len(watches) == 2  # (each loss's first block)


def _unheld_warnings(run):
    """The unheld-gradient warnings ``run()`` gives (every warning recorded)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in record
            if "no optimizer given to amp.initialize holds" in str(w.message)]


def _dense_emb_lm(opt_level, **kw):
    """_SparseLM with a dense embedding that no optimizer given to amp holds."""
    model = _SparseLM()
    model.emb = nn.Embedding(20, 8)
    dense = torch.optim.SGD(model.proj.parameters(), lr=1e-2)
    return amp.initialize(model, dense, opt_level=opt_level, verbosity=0, **kw)


def test_an_optimizer_of_a_call_with_amp_disabled_holds_no_gradient_of_amps():
    """A SparseAdam given to a second initialize call with enabled=False is no amp optimizer:
    it steps the embedding's gradient as the first call's block left it, scaled, so the block
    still names it. (r96D S5)"""
    model = _SparseLM()
    dense = torch.optim.Adam(model.proj.parameters(), lr=1e-2)
    sparse = torch.optim.SparseAdam(model.emb.parameters(), lr=1e-2)
    model, dense = amp.initialize(model, dense, opt_level="O2", verbosity=0)
    amp.initialize(model.emb, sparse, enabled=False, verbosity=0)

    def run():
        with amp.scale_loss(model(torch.arange(6)).float().sum(), dense) as scaled:
            scaled.backward()

    got = _unheld_warnings(run)
    assert len(got) == 1 and "holds: emb.weight." in got[0], got


def test_a_layer_shared_by_two_models_is_named_once_through_the_first():
    """A layer in both models given to one initialize call is one parameter pair, named once,
    under the first model that holds it. (r96D S6)"""
    first, second, shared = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    model_a, model_b = nn.Sequential(first, shared), nn.Sequential(second, shared)
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    [model_a, model_b], opt = amp.initialize([model_a, model_b], opt, opt_level="O2",
                                             verbosity=0)

    def run():
        x = torch.randn(2, 4)
        with amp.scale_loss(model_a(x).float().sum() + model_b(x).float().sum(), opt) as scaled:
            scaled.backward()

    got = _unheld_warnings(run)
    assert len(got) == 1, got
    assert "2 parameter(s) of the models" in got[0]
    assert "holds: models[0].1.weight, models[0].1.bias." in got[0], got


def test_a_block_that_raised_keeps_its_exception_and_leaves_nothing_to_report():
    """A block left by an exception after its backward (a batch skipped on out-of-memory, the
    gradients zeroed by the handler) keeps the user's exception, and what its backward reached
    is not reported at the next block, which does not reach the embedding. (r96D S7, S8)"""
    model, dense = _dense_emb_lm("O2")

    def run():
        with pytest.raises(MemoryError, match="skip this batch"):
            with amp.scale_loss(model(torch.arange(6)).float().sum(), dense) as scaled:
                scaled.backward()
                raise MemoryError("skip this batch")
        model.zero_grad()
        feats = torch.randn(6, 8).half()
        with amp.scale_loss(model.proj(feats).float().sum(), dense) as scaled:
            scaled.backward()

    assert _unheld_warnings(run) == []


def test_an_earlier_micro_batchs_unheld_gradient_is_reported_at_the_unscaling_block():
    """Accumulation: the first micro-batch (delay_unscale=True) reaches the embedding, the
    second, which unscales, does not; the embedding's scaled gradient is reported there.
    (r96D S9)"""
    model, dense = _dense_emb_lm("O2", loss_scale=128.0)

    def run():
        with amp.scale_loss(model(torch.arange(6)).float().sum(), dense,
                            delay_unscale=True) as scaled:
            scaled.backward()
        feats = torch.randn(6, 8).half()
        with amp.scale_loss(model.proj(feats).float().sum(), dense) as scaled:
            scaled.backward()

    got = _unheld_warnings(run)
    assert len(got) == 1 and "holds: emb.weight. Their gradients stay multiplied by the loss " \
                             "scale (128)" in got[0], got


def test_a_backward_that_reached_no_optimizer_parameter_gets_only_that_warning():
    """Parameters replaced after initialize (the optimizer holds the old ones): the block's
    one warning is that its backward reached none of the optimizer's parameters; the new ones
    are not reported a second time as held by no optimizer. (r96D S10)"""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", loss_scale=128.0, verbosity=0)
    model.weight = nn.Parameter(model.weight.detach().clone())
    model.bias = nn.Parameter(model.bias.detach().clone())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
            scaled.backward()
    texts = [str(w.message) for w in record]
    assert len(texts) == 1 and "no optimizer given" not in texts[0], texts


@pytest.mark.parametrize("case", ["half-before-fp32", "six-names", "O3-dynamic", "O2-bf16"])
def test_the_unheld_gradient_warning_says_what_applies(case):
    """The message's parts each apply or are left out: "the half ones have no fp32 master
    weights" stays when a half parameter comes before an fp32 BatchNorm one in the walk
    (r96D S11), never at O3, where no parameter has a master (S14); no loss scale at bf16's 1
    (S12); past four names, "and K more" (S13)."""
    torch.manual_seed(0)
    if case == "half-before-fp32":
        model = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 2))
        opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        x = torch.randn(4, 8)
    elif case == "six-names":
        model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)), nn.Linear(4, 2))
        opt = torch.optim.SGD(model[3].parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale=128.0, verbosity=0)
        x = torch.randn(3, 4)
    else:
        model, opt = _dense_emb_lm("O3", loss_scale="dynamic") if case == "O3-dynamic" else \
            _dense_emb_lm("O2", dtype=torch.bfloat16)
        x = torch.arange(6)

    def run():
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()

    got = _unheld_warnings(run)
    assert len(got) == 1, got
    text = got[0]
    if case == "half-before-fp32":
        assert "holds: 0.weight, 0.bias, 1.weight, 1.bias." in text, text
        assert "the half ones have no fp32 master weights" in text, text
    elif case == "six-names":
        assert "6 parameter(s)" in text, text
        assert "holds: 0.weight, 0.bias, 1.weight, 1.bias and 2 more. " in text, text
    elif case == "O3-dynamic":
        assert "loss scale (65536)" in text and "master" not in text, text
    else:
        assert "holds: emb.weight. The half ones have no fp32 master weights" in text, text
        assert "loss scale" not in text, text


_NEVER_MOVED = (r"gradients were never moved to the fp32 master weights\. Run the backward "
                r"pass inside")


def _closure_backward_outside_scale_loss(model, opt, x):
    """A step closure whose backward runs outside amp.scale_loss (a loop ported without it)."""
    def closure():
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("with_closure", [False, True], ids=["step", "closure"])
def test_a_backward_outside_scale_loss_is_refused_at_the_step_at_o2(with_closure):
    """At O2 a backward outside amp.scale_loss leaves its gradients on the half model, where
    no optimizer reads them: the step raises, naming scale_loss, with or without a closure
    (a closure's step checks after each evaluation)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    closure = _closure_backward_outside_scale_loss(model, opt, torch.randn(6, 4))
    with pytest.raises(RuntimeError, match=_NEVER_MOVED):
        if with_closure:
            opt.step(closure)
        else:
            closure()
            opt.step()


@pytest.mark.parametrize("sync_first", [False, True])
def test_a_closure_loop_runs_after_a_layer_with_a_stale_half_gradient_joins(sync_first):
    """A head no optimizer held took part in a closure step (its half .grad keeps that
    backward's scaled gradient, as documented), then joined with add_param_group; once its
    masters existed (amp.master_params(), opt.state_dict()) the next step(closure), whose
    closure zeroes the gradients itself, was refused as if its gradients had never reached
    the masters. Reference: the same step with the stale gradient dropped by hand first,
    exact. (r106A B1)"""
    def run(drop_stale):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0,
                                    verbosity=0)
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))

        def closure():
            opt.zero_grad()
            loss = model(x).float().pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            return loss

        with pytest.warns(UserWarning, match="no optimizer given to amp.initialize holds"):
            opt.step(closure)  # (the head's gradient stays on it, scaled, and amp says so)
        opt.add_param_group({"params": list(model[2].parameters())})
        if drop_stale:
            for p in model[2].parameters():
                p.grad = None
        if sync_first:
            list(amp.master_params(opt))
        opt.step(closure)
        return [m.detach().clone() for m in amp.master_params(opt)]

    got, want = run(False), run(True)
    assert len(got) == 4
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _count_full_looks(monkeypatch):
    """Each call of amp's look for writes into the model, True where it read every pair."""
    from mixprec.amp import _state

    calls = []
    real = _state._OptimizerState._take_model_writes

    def counting(self, only):
        calls.append(only is None)
        return real(self, only)

    monkeypatch.setattr(_state._OptimizerState, "_take_model_writes", counting)
    return calls


def test_closure_evaluations_and_loads_leave_nothing_for_the_forwards_look(monkeypatch):
    """After an LBFGS closure's own copy into the half model, and after a load_state_dict, amp
    has the masters recorded as in step: the next forwards' quick look (one version read per
    master) finds nothing and reads no pair in full. (The values are right either way; a
    record left behind made every evaluation and the forward after a load scan them all.)"""
    calls = _count_full_looks(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=5)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    x = torch.randn(3, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).float().pow(2).sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        return loss

    opt.step(closure)
    del calls[:]
    opt.step(closure)  # (up to 5 evaluations: one full look, the step's own)
    assert calls.count(True) <= 1, calls
    model.load_state_dict({k: v.clone() + 0.5 for k, v in model.state_dict().items()})
    del calls[:]
    model(x)
    model(x)
    assert calls.count(True) == 0, calls


@pytest.mark.parametrize("late", [False, True], ids=["joined_holding_it", "grad_after_join"])
def test_the_step_names_a_gradient_that_predates_its_layer_joining_at_o2(late):
    """A head no optimizer held took part in a scaled backward, then joined through
    add_param_group and a plain step() followed with no new backward: its half gradient
    (scaled) reached no master. The refusal says the gradient predates the layer joining and
    how to drop it (it used to tell the user to run the backward inside scale_loss, which they
    had). A gradient a backward outside scale_loss gave the layer after it joined gets the
    general message. optimizer.zero_grad() drops the stale gradient (the message's advice), and
    the step then runs."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    x = torch.randn(6, 4)
    loss = model(x).float().pow(2).mean()
    with pytest.warns(UserWarning, match="no optimizer given to amp.initialize holds"):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    opt.step()
    if late:
        for p in model[2].parameters():
            p.grad = None
    opt.add_param_group({"params": list(model[2].parameters())})
    list(amp.master_params(opt))  # (the group's masters are made here)
    if late:
        model(x).float().pow(2).mean().backward()
    with pytest.raises(RuntimeError) as info:
        opt.step()
    text = str(info.value)
    if late:
        assert "gradients were never moved to the fp32 master weights" in text, text
    else:
        assert ("2 half parameter(s) (shapes (3, 8), (3,)) joined this optimizer through "
                "add_param_group holding a gradient from a backward before they joined") in text
        assert "p.grad = None for those parameters" in text, text
    before = [m.detach().clone() for m in amp.master_params(opt)]
    # (The message's way for the stale gradient; the model's for a backward's, which reached
    # every parameter and which a scale_loss block would drop.)
    model.zero_grad() if late else opt.zero_grad()
    opt.step()  # (no gradient anywhere: nothing moves, and nothing is refused)
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))


class _TwoEvaluations(torch.optim.SGD):
    """An optimizer whose step evaluates the closure twice (as SAM-style optimizers do)."""

    def step(self, closure=None):
        closure()
        loss = closure()
        super().step()
        return loss


def test_a_master_write_between_closure_evaluations_reaches_a_frozen_layer_at_o2():
    """A closure evaluation records only the pairs it copied, not those of the frozen layer
    the last step left as they were: a write into such a layer's master between two
    evaluations of one step (through model.state_dict()'s tensor) reaches the half layer and
    stays in the master (r107B G1: recording every pair took it as in step, and the next
    state_dict() lost it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    for p in model[2].parameters():
        p.requires_grad_(False)
    opt = _TwoEvaluations(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    x = torch.randn(6, 4)
    new = torch.randn(3, 8)
    evals = []

    def closure():
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if len(evals) == 2:  # (after the first evaluation of the second step)
            with torch.no_grad():
                model.state_dict()["2.weight"].copy_(new)
        evals.append(loss.item())
        return loss

    opt.step(closure)
    opt.step(closure)
    assert len(evals) == 4
    assert torch.equal(model[2].weight, new.half())
    assert torch.equal(model.state_dict()["2.weight"], new)


def test_a_state_dict_inside_a_closure_keeps_the_fp32_masters_at_o2():
    """The closure's copy of the masters into the half model is recorded after the copy:
    recorded before it, the copy's version bumps looked like writes into the half model, and
    a model.state_dict() inside the closure (a checkpoint or a log there) rounded the masters
    to bf16 (r107B G2). lr=0: reference, the masters before, exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        model.state_dict()
        return loss

    before = [m.detach().clone() for m in amp.master_params(opt)]
    for _ in range(2):
        opt.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(amp.master_params(opt), before))


@pytest.mark.parametrize("with_closure", [False, True], ids=["step", "closure"])
def test_a_half_gradient_on_the_last_parameter_alone_is_refused_at_o2(with_closure):
    """The O2 step refuses a half gradient left on any master-weighted parameter, the
    optimizer's last one too: a penalty on the last layer's bias alone, backpropagated outside
    amp.scale_loss (r107B G9)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)

    def closure():
        opt.zero_grad()
        model[2].bias.float().pow(2).sum().backward()  # (outside scale_loss)
        return torch.zeros(())

    with pytest.raises(RuntimeError, match="gradients were never moved to the fp32 master"):
        if with_closure:
            opt.step(closure)
        else:
            closure()
            opt.step()


def _joined_with_a_stale_gradient(first_fp32=False, step_first=True, make_masters=True):
    """An O2 model whose last Linear (the head) took part in a scaled backward outside the
    optimizer (its half gradient left, multiplied by 128), then joined with add_param_group:
    after the step (``step_first``), its masters made by master_params (``make_masters``). The
    optimizer first held the first Linear, or (``first_fp32``) a BatchNorm's fp32 parameters
    only. Returns (model, optimizer, input)."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(8)] if first_fp32 else []
    model = nn.Sequential(nn.Linear(4, 8), *norm, nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model[1 if first_fp32 else 0].parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    x = torch.randn(6, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the head's gradient is no optimizer's: amp says so)
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
    if step_first:
        opt.step()
    opt.add_param_group({"params": list(model[-1].parameters())})
    if make_masters:
        list(amp.master_params(opt))
    return model, opt, x


def test_dropping_the_stale_gradients_by_hand_lets_the_step_run():
    """The refusal's own advice, `p.grad = None for those parameters`: the step then runs
    (r108B G12). Dropping one
    of the two: the refusal counts the one left."""
    model, opt, x = _joined_with_a_stale_gradient()
    model[2].weight.grad = None
    with pytest.raises(RuntimeError, match=r"1 half parameter\(s\) \(shapes \(3,\)\) joined"):
        opt.step()
    model[2].bias.grad = None
    opt.step()


@pytest.mark.parametrize("then", ["zero_grad", "scaled_step"])
def test_after_the_stale_gradient_goes_a_backward_outside_scale_loss_gets_the_general_refusal(
        then):
    """opt.zero_grad() drops the stale gradients and forgets them (r108B G11), and a scaled
    backward unscales them and forgets the record (G10): a backward outside scale_loss
    afterwards is refused with the general message, not the joined one."""
    model, opt, x = _joined_with_a_stale_gradient()
    if then == "zero_grad":
        opt.zero_grad()
    else:
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    model(x).float().pow(2).mean().backward()
    with pytest.raises(RuntimeError) as info:
        opt.step()
    assert "never moved to the fp32 master weights" in str(info.value)
    assert "joined this optimizer" not in str(info.value)


def test_a_stale_gradient_joining_an_optimizer_of_fp32_parameters_only_is_named_and_dropped():
    """The optimizer given to initialize held BatchNorm's fp32 parameters only (no pairs yet):
    a Linear joining with a stale scaled gradient is the same case as after a first half group
    (the refusal names it; opt.zero_grad() drops it). It got the general message and kept the
    gradient through zero_grad() (r108B B1)."""
    model, opt, x = _joined_with_a_stale_gradient(first_fp32=True)
    with pytest.raises(RuntimeError, match="joined this optimizer through add_param_group"):
        opt.step()
    opt.zero_grad()
    opt.step()


@pytest.mark.parametrize("when", ["after_its_step", "between_backward_and_step"])
def test_a_step_right_after_add_param_group_gives_the_group_its_masters_first(when):
    """A group added after initialize got its masters only at the next scale_loss or
    master_params: a step() right after add_param_group stepped its half parameters directly,
    on their half gradients still multiplied by the loss scale (r109A B1). The step makes the
    masters first: the stale gradient is refused, naming the layer, and the half layer is
    left as it was; after zero_grad() the next scaled step trains it through its masters."""
    model, opt, x = _joined_with_a_stale_gradient(step_first=when == "after_its_step",
                                                  make_masters=False)
    before = model[2].bias.detach().clone()
    with pytest.raises(RuntimeError, match=r"2 half parameter\(s\) \(shapes \(3, 8\), \(3,\)\) "
                                           "joined this optimizer through add_param_group"):
        opt.step()
    assert torch.equal(model[2].bias, before)
    assert all(p.dtype == torch.float32 for p in opt.param_groups[1]["params"])
    opt.zero_grad()
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(model[2].bias, before)
    assert torch.equal(model[2].bias, opt.param_groups[1]["params"][1].detach().half())


def test_a_closure_backward_outside_scale_loss_is_refused_right_after_add_param_group():
    """As test_a_backward_outside_scale_loss_is_refused_at_the_step_at_o2[closure], with the
    half layers joining an optimizer of fp32 (BatchNorm) parameters only right before the
    step: the step gives them masters first, so its closure is checked after evaluation and
    the backward outside scale_loss is refused, not silently dropped (the half layers left
    untrained while the BatchNorm trains) (r110A G1)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    opt.add_param_group({"params": list(model[0].parameters()) + list(model[2].parameters())})
    closure = _closure_backward_outside_scale_loss(model, opt, torch.randn(16, 4))
    with pytest.raises(RuntimeError, match=_NEVER_MOVED):
        opt.step(closure)


@pytest.mark.parametrize("heads", [2, 3])
def test_the_joined_refusal_lists_four_shapes_then_an_ellipsis(heads):
    """Two heads joining (4 half parameters) are all shown; three (6) show the first four and
    ', ...', with the count of all (r110A G2)."""
    torch.manual_seed(0)
    body = nn.Linear(4, 8)
    outs = [nn.Linear(8, 3 + i) for i in range(heads)]
    model = nn.ModuleList([body, *outs])
    opt = torch.optim.SGD(body.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    x = torch.randn(6, 4).half()  # (a ModuleList has no forward for amp to cast the input)
    h = model[0](x)
    loss = sum(m(h).float().pow(2).mean() for m in model[1:])
    with pytest.warns(UserWarning, match="no optimizer given to amp.initialize holds"):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    opt.step()
    opt.add_param_group({"params": [p for m in model[1:] for p in m.parameters()]})
    shapes = [s for i in range(heads) for s in (f"({3 + i}, 8)", f"({3 + i},)")]
    shown = ", ".join(shapes[:4]) + (", ..." if len(shapes) > 4 else "")
    with pytest.raises(RuntimeError) as info:
        opt.step()
    want = f"{len(shapes)} half parameter(s) (shapes {shown}) joined this optimizer through"
    assert want in str(info.value), str(info.value)


@pytest.mark.parametrize("kept", [0, -1])
def test_a_half_gradient_left_on_one_parameter_only_is_refused(kept):
    """A backward outside scale_loss whose gradient is left on one half parameter only (the
    first or the last the optimizer holds): the step refuses it, as for all of them (r110A
    G3)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    model(torch.randn(6, 4)).float().pow(2).mean().backward()
    params = list(model.parameters())
    for i, p in enumerate(params):
        if i != kept % len(params):
            p.grad = None
    with pytest.raises(RuntimeError, match="gradients were never moved to the fp32 master"):
        opt.step()


@contextlib.contextmanager
def _no_host_reads():
    """Fail on any tensor read into a Python bool or number (a host sync on a GPU)."""
    def refuse(self, *args):
        raise AssertionError("a tensor was read on the host")

    with pytest.MonkeyPatch.context() as mp:
        for name in ("__bool__", "item"):
            mp.setattr(torch.Tensor, name, refuse)
        yield


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("overflowed", ["other_model", "zeroed_model"])
def test_a_models_zero_grad_keeps_a_skip_that_other_models_gradients_still_need(overflowed,
                                                                               fused):
    """One optimizer over models a and b; a loss through both overflows in one model's
    gradients; then ``a.zero_grad()``, a clean block through a, and the step. Where b's
    gradients overflowed they are still there: the step is skipped (it ran, and wrote inf
    into b's weights: r110C B1). Where a's did, the zero_grad dropped them and the skip with
    them: the step runs, b taking its finite gradient (reference: SGD's update computed from
    the master and its gradient, exact). A fused SGD keeps the overflow flag on the device:
    the zero_grad takes it again there over b's gradients, with no host sync."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1, fused=fused)
    [a, b], opt = amp.initialize([a, b], opt, opt_level="O2", dtype=torch.float16,
                                 verbosity=0)
    x = torch.randn(2, 4)
    inf_a = float("inf") if overflowed == "zeroed_model" else 1.0
    inf_b = float("inf") if overflowed == "other_model" else 1.0
    with amp.scale_loss(a(x).float().pow(2).mean() * inf_a
                        + b(x).float().pow(2).mean() * inf_b, opt) as scaled:
        scaled.backward()
    masters_b = list(amp.master_params(opt))[2:]
    before = [m.detach().clone() for m in masters_b]
    grads_b = [m.grad.clone() for m in masters_b]
    if fused:
        with _no_host_reads():
            a.zero_grad()
    else:
        a.zero_grad()
    with amp.scale_loss(a(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in [*a.parameters(), *b.parameters()])
    if overflowed == "other_model":
        assert amp.step_was_skipped(opt)
        assert all(torch.equal(m, m0) for m, m0 in zip(masters_b, before))
    else:
        assert not amp.step_was_skipped(opt)
        for m, m0, g in zip(masters_b, before, grads_b):
            assert torch.equal(m, m0.add(g, alpha=-0.1))


def test_a_device_overflow_flag_goes_with_the_step_the_host_skipped():
    """A fused optimizer's overflow flag on the device (loss 0, its block alone), then a block
    of loss 1 over it and a plain optimizer (the host's path) overflowing: the host skips the
    step. The device flag went with it no more, and skipped the next clean step (r110C B2);
    loss 0's scaler counted that step clean (unskipped 1)."""
    torch.manual_seed(0)
    f, p = nn.Linear(4, 4), nn.Linear(4, 4)
    opt_f = torch.optim.Adam(f.parameters(), lr=1e-2, fused=True)
    opt_p = torch.optim.SGD(p.parameters(), lr=0.1)
    [f, p], [opt_f, opt_p] = amp.initialize([f, p], [opt_f, opt_p], opt_level="O2",
                                            dtype=torch.float16, num_losses=2, verbosity=0)
    x = torch.randn(2, 4)
    with amp.scale_loss(f(x).float().pow(2).mean() * float("inf"), opt_f, loss_id=0) as s:
        s.backward()
    with amp.scale_loss(f(x).float().pow(2).mean() * float("inf") + p(x).float().pow(2).mean(),
                        [opt_f, opt_p], loss_id=1) as s:
        s.backward()
    opt_f.step()
    opt_p.step()
    assert amp.step_was_skipped(opt_f) and amp.step_was_skipped(opt_p)
    for prm in [*f.parameters(), *p.parameters()]:  # (zeroed by hand: documented the same)
        prm.grad = None
    w0 = f.weight.detach().clone()
    with amp.scale_loss(f(x).float().pow(2).mean(), opt_f, loss_id=0) as s:
        s.backward()
    opt_f.step()
    assert not amp.step_was_skipped(opt_f)
    assert not torch.equal(f.weight, w0)
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_fused_sgd_first_momentum_skip_records_gradients_as_other_skips(opt_level):
    """Fused SGD with dampening: a first momentum step that overflows is skipped by the host
    (see _prime_fused_momentum); then zero_grad(set_to_none=False) and a step with no
    backward. Every other skip gives the masters zero gradients there (weight decay and
    momentum act, as in fp32); this one left them none (r110C B3; at O1 the step body must
    still see none, and the zeroed tensors come back after it). Reference: the same run with
    the unfused SGD, exact."""
    def run(fused):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1,
                              weight_decay=0.01, fused=fused)
        model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.float16,
                                    verbosity=0)
        x = torch.randn(3, 4)
        opt.zero_grad(set_to_none=False)  # (a loop keeping gradient tensors throughout)
        with amp.scale_loss(model(x).float().sum() * float("inf"), opt) as scaled:
            scaled.backward()
        opt.step()
        assert amp.step_was_skipped(opt)
        before = [m.detach().clone() for m in amp.master_params(opt)]
        opt.zero_grad(set_to_none=False)
        opt.step()
        return before, [m.detach().clone() for m in amp.master_params(opt)]

    (start, unfused), (_, fused) = run(False), run(True)
    assert not any(torch.equal(a, b) for a, b in zip(unfused, start))  # (weight decay acted)
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_gan_discriminators_zero_grad_then_a_step_without_backward_runs_as_fp32(set_to_none):
    """As below, with weight decay, against the same loop in plain fp32 (reference, exact: the
    masters start as the fp32 weights and the update is fp32 arithmetic on them): with
    set_to_none=False fp32 keeps D's gradients from G's loss, zeroed, and the step decays
    D; the masters get zero gradients there too (r111B R3). With True nothing moves."""
    def run(use_amp):
        torch.manual_seed(0)
        g, d = nn.Linear(4, 4), nn.Linear(4, 1)
        opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
        opt_d = torch.optim.SGD(d.parameters(), lr=0.1, weight_decay=0.1)
        if use_amp:
            [g, d], [opt_g, opt_d] = amp.initialize(
                [g, d], [opt_g, opt_d], opt_level="O2", dtype=torch.float16, num_losses=2,
                verbosity=0)
        x = torch.randn(8, 4)
        for _ in range(2):
            loss = d(g(x)).float().mean()
            if use_amp:
                with amp.scale_loss(loss, opt_g, loss_id=1) as scaled:
                    scaled.backward()
            else:
                loss.backward()
            opt_g.step()
            opt_g.zero_grad(set_to_none=set_to_none)
            opt_d.zero_grad(set_to_none=set_to_none)
            opt_d.step()
        return [p.detach().clone() for p in
                (amp.master_params(opt_d) if use_amp else d.parameters())]

    start = [p.detach().clone() for p in (lambda: (torch.manual_seed(0), nn.Linear(4, 4),
                                                   nn.Linear(4, 1))[2])().parameters()]
    fp32, o2 = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(o2, fp32))
    assert all(torch.equal(a, b) for a, b in zip(fp32, start)) == set_to_none


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_gan_discriminators_zero_grad_drops_the_generator_losss_half_gradients(set_to_none):
    """G's loss runs through D inside scale_loss(loss_g, opt_g): D's half parameters hold
    gradients scaled by that loss. ``opt_d.zero_grad()`` drops them (Apex's O2 zero_grad
    cleared the half model's gradients), so a D step with no backward of its own runs as in
    fp32 (no gradient: SGD leaves the weights; it was refused, "never moved": r110C R1)."""
    torch.manual_seed(0)
    g, d = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    [g, d], [opt_g, opt_d] = amp.initialize([g, d], [opt_g, opt_d], opt_level="O2",
                                            dtype=torch.float16, num_losses=2, verbosity=0)
    with amp.scale_loss(d(g(torch.randn(2, 4))).float().mean(), opt_g, loss_id=1) as scaled:
        scaled.backward()
    opt_g.step()
    assert d.weight.grad is not None
    before = [m.detach().clone() for m in amp.master_params(opt_d)]
    opt_d.zero_grad(set_to_none=set_to_none)
    assert d.weight.grad is None and d.bias.grad is None
    opt_d.step()
    assert all(torch.equal(m, m0) for m, m0 in zip(amp.master_params(opt_d), before))


def test_a_numpy_integer_loss_id_picks_that_losss_scaler():
    """``for loss_id in np.arange(n)``: a NumPy integer is a loss id, as in Apex (which indexed
    a list with it); it was refused as out of range. An overflow under loss 1 backs off
    scaler 1 only. A float or a bool is still refused, naming its type."""
    np = pytest.importorskip("numpy")
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16,
                                num_losses=2, verbosity=0)
    x = torch.randn(3, 4)
    for loss_id in np.arange(2):
        factor = float("inf") if loss_id == 1 else 1e-3
        with amp.scale_loss(model(x).float().sum() * factor, opt, loss_id=loss_id) as scaled:
            scaled.backward()
    state = amp.state_dict()
    assert state["loss_scaler0"]["loss_scale"] == 2.0**16
    assert state["loss_scaler1"]["loss_scale"] == 2.0**15
    for bad in (1.0, True):
        with pytest.raises(ValueError, match=rf"loss_id={bad!r}\) \({type(bad).__name__}\)"):
            with amp.scale_loss(model(x).float().sum(), opt, loss_id=bad):
                pass


def test_a_models_zero_grad_after_an_overflow_reads_another_models_sparse_gradients():
    """(r111A G2) One SGD over a dense model a
    and a sparse nn.Embedding b; a loss through both overflows in a's part only; a.zero_grad()
    (looks at b's master gradient, sparse); a clean block through a; the step. Expected (fp32
    semantics, exact): the skip goes with a's dropped gradients, the step runs, b's master
    takes SGD's update from its own (finite, sparse) gradient: m - 0.1 * g, exact."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Embedding(6, 4, sparse=True)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    [a, b], opt = amp.initialize([a, b], opt, opt_level="O2", dtype=torch.float16,
                                 verbosity=0)
    x, idx = torch.randn(2, 4), torch.tensor([1, 3])
    with amp.scale_loss(a(x).float().pow(2).mean() * float("inf")
                        + b(idx).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    master_b = list(amp.master_params(opt))[2]
    assert master_b.shape == (6, 4) and master_b.grad.is_sparse
    before = master_b.detach().clone()
    grad_b = master_b.grad.to_dense().clone()
    a.zero_grad()
    with amp.scale_loss(a(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not amp.step_was_skipped(opt)
    assert torch.equal(master_b.detach(), before.add(grad_b, alpha=-0.1))


def test_a_tensor_loss_id_is_refused_naming_its_type():
    """(r111A G3) loss_id=torch.tensor(1) is refused with the range message naming its type
    (operator.index would take an integer tensor, with a host sync per block)."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16,
                                num_losses=2, verbosity=0)
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"\(Tensor\): amp\.initialize was called with "
                                         r"num_losses=2"):
        with amp.scale_loss(model(x).float().sum(), opt, loss_id=torch.tensor(1)):
            pass


def test_a_third_loss_id_scales_by_its_own_scaler():
    """(r111A G4) num_losses=3 (the rest of the suite uses at most 2): loss 1 overflows (scaler 1 backs off
    to 2**15); then loss_id=np.int64(2) with half gradients of 1.5 and 1.0: times scaler 2's
    2**16 they overflow fp16 (max 65504), times 2**15 they would not. Expected, exact: the
    step is skipped and scaler 2 backs off: scales 2**16, 2**15, 2**15."""
    np = pytest.importorskip("numpy")
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16,
                                num_losses=3, verbosity=0)
    x = torch.full((1, 1), 1.5)
    with amp.scale_loss(model(x).float().sum() * float("inf"), opt, loss_id=1) as scaled:
        scaled.backward()
    opt.step()
    assert amp.step_was_skipped(opt)
    opt.zero_grad()
    with amp.scale_loss(model(x).float().sum(), opt, loss_id=np.int64(2)) as scaled:
        scaled.backward()
    opt.step()
    assert amp.step_was_skipped(opt)
    state = amp.state_dict()
    assert [state[f"loss_scaler{i}"]["loss_scale"] for i in range(3)] == [
        2.0**16, 2.0**15, 2.0**15]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_device_skipped_steps_stale_inf_gradients_skip_the_next_step_again(opt_level):
    """A fused optimizer's step skipped on the device leaves the gradients in place (inf at
    O1, and O2's fp32 BatchNorm ones); a loop that does not zero them and runs a clean block
    through another model set them aside and added them back unchecked: the next step wrote
    inf into b. They are looked at again, as GradScaler's unscale_ looks at every gradient:
    the step is skipped, and every weight stays finite and unchanged."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW([*a.parameters(), *b.parameters()], lr=1e-2, fused=True)
    [a, b], opt = amp.initialize([a, b], opt, opt_level=opt_level, dtype=torch.float16,
                                 verbosity=0)
    x = torch.randn(2, 4)
    with amp.scale_loss(b(x).float().mean() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.step_was_skipped(opt)
    before = [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]
    with amp.scale_loss(a(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.step_was_skipped(opt)
    after = [*a.parameters(), *b.parameters()]
    assert all(torch.equal(p, q) for p, q in zip(after, before))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_stale_inf_gradients_skip_the_step_after_a_block_that_reached_none_of_them(opt_level):
    """The same stale gradients, but the clean block's loss reaches none of the fused
    optimizer's parameters (two optimizers in one block, its loss through the other's model):
    that optimizer got no flag of its own from the block, and its step ran on the inf
    gradients left (a's weights went non-finite). Expected: the step is skipped and a stays
    finite and unchanged; the block's other optimizer skips with it (one loss, one decision
    for all its optimizers, as Apex's), and the scale backs off."""
    torch.manual_seed(0)
    a, c = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Linear(4, 4)
    opt1 = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    opt2 = torch.optim.SGD(c.parameters(), lr=1e-2)
    [a, c], [opt1, opt2] = amp.initialize([a, c], [opt1, opt2], opt_level=opt_level,
                                          dtype=torch.float16, verbosity=0)
    x = torch.randn(2, 4)
    with amp.scale_loss(a(x).float().mean() * float("inf"), opt1) as scaled:
        scaled.backward()
    opt1.step()
    assert amp.step_was_skipped(opt1)
    before_a = [p.detach().clone() for p in a.parameters()]
    before_c = [p.detach().clone() for p in c.parameters()]
    with amp.scale_loss(c(x).float().pow(2).mean(), [opt1, opt2]) as scaled:
        scaled.backward()
    opt1.step()
    opt2.step()
    assert amp.step_was_skipped(opt1) and amp.step_was_skipped(opt2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before_a))
    assert all(torch.equal(p, q) for p, q in zip(c.parameters(), before_c))
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**14


def _delayed_check_setup(opt_level, fused=False, two=False, device="cpu"):
    torch.manual_seed(0)
    models = [nn.Linear(4, 4).to(device) for _ in range(2 if two else 1)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused) for m in models]
    models, opts = amp.initialize(models, opts, opt_level=opt_level, dtype=torch.float16,
                                  verbosity=0)
    return models, opts, torch.randn(2, 4).to(device)


def _poison(opt):
    """What a hand all-reduce brings from a rank that overflowed: an inf in a gradient."""
    next(iter(amp.master_params(opt))).grad[0, 0] = float("inf")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["host", "fused"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_delay_overflow_check_decides_at_the_step_on_the_gradients_then(opt_level, fused,
                                                                        device):
    """scale_loss(..., delay_overflow_check=True) (BERT's post-accumulation all-reduce, r112B
    B1): the block's own check found nothing, an inf reached the gradients after it (as a hand
    all-reduce brings one from a rank that overflowed), and the step applied it. The decision
    now waits for step(): the scale is untouched between the block and the step, the step is
    skipped (on the device for a fused optimizer), the weights stay as they were, and the scale
    halves once. Reference: the same loop without the inf steps and counts a clean step."""
    [model], [opt], x = _delayed_check_setup(opt_level, fused, device=device)
    for poison in (True, False):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), opt,
                            delay_overflow_check=True) as scaled:
            scaled.backward()
        before = [p.detach().clone() for p in model.parameters()]
        scale = amp.state_dict()["loss_scaler0"]
        if poison:
            assert scale == {"loss_scale": 2.0**16, "unskipped": 0}
            _poison(opt)
        opt.step()
        moved = [not torch.equal(p, q) for p, q in zip(model.parameters(), before)]
        if poison:
            assert amp.step_was_skipped(opt) and not any(moved)
            assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 0}
        else:
            assert not amp.step_was_skipped(opt) and all(moved)
            assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 1}
        assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("zero", ["optimizer", "model"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_delay_overflow_check_a_zero_grad_before_the_step_decides_first(opt_level, zero):
    """A loop that drops an overflowed batch itself (zero_grad, no step) after a delayed
    block: the decision is taken at the zero_grad, on the gradients it drops, so the scale
    still backs off (else every batch overflowed again, dropped, at the same scale), and the
    next clean step runs, as without the delay."""
    [model], [opt], x = _delayed_check_setup(opt_level)
    with amp.scale_loss(model(x).float().mean() * float("inf"), opt,
                        delay_overflow_check=True) as scaled:
        scaled.backward()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**16
    (opt if zero == "optimizer" else model).zero_grad()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(model(x).float().pow(2).mean(), opt,
                        delay_overflow_check=True) as scaled:
        scaled.backward()
    opt.step()
    assert not amp.step_was_skipped(opt)
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_delay_overflow_check_over_accumulated_blocks_and_two_optimizers_decides_once(opt_level):
    """Two delayed blocks (accumulation) over two optimizers, an inf reaching the second
    optimizer's gradients after them: one decision at the first step, for both optimizers
    (one loss decides for all its optimizers), the scale halved once; then a clean pair of
    blocks counts one clean step, not two."""
    models, opts, x = _delayed_check_setup(opt_level, two=True)
    for poison in (True, False):
        for opt in opts:
            opt.zero_grad()
        for _ in range(2):
            loss = sum(m(x).float().pow(2).mean() for m in models)
            with amp.scale_loss(loss, opts, delay_overflow_check=True) as scaled:
                scaled.backward()
        if poison:
            _poison(opts[1])
        for opt in opts:
            opt.step()
        assert [amp.step_was_skipped(o) for o in opts] == [poison, poison]
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 1}


def test_delay_overflow_check_refuses_a_string():
    [model], [opt], x = _delayed_check_setup("O2")
    with pytest.raises(TypeError, match=r"delay_overflow_check='False'.*expected True or False"):
        with amp.scale_loss(model(x).float().mean(), opt, delay_overflow_check="False"):
            pass


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_second_step_after_a_device_skipped_one_with_no_block_between_is_skipped(opt_level):
    """r112A B1: a fused optimizer's step skipped on the device leaves its inf gradients (O1,
    and O2's fp32 BatchNorm ones); a second step() with no scale_loss block between handed the
    kernel no flag and wrote the inf into the weights. The gradients left are looked at again
    (on the device, no sync): the second step is skipped too, every weight finite and
    unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.float16,
                                verbosity=0)
    with amp.scale_loss(model(torch.randn(2, 4)).float().mean() * float("inf"), opt) as scaled:
        scaled.backward()
    before = [p.detach().clone() for p in amp.master_params(opt)]
    for _ in range(2):
        opt.step()
        assert amp.step_was_skipped(opt)
    assert all(torch.equal(p, q) for p, q in zip(amp.master_params(opt), before))


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("level_bn", [("O1", False), ("O2", True)], ids=["O1", "O2-bn"])
def test_a_model_zero_grad_dropping_part_of_a_held_window_leaves_no_scaled_gradient(
        level_bn, set_to_none):
    """r112A B2: one optimizer over models a and b; a clean block (g1), a delay_unscale block
    (held scaled), then a.zero_grad(set_to_none=False), which drops the window, then the
    step. b's directly stepped parameters stepped on the window's gradient still multiplied by
    the loss scale (65536 x g2), g1 lost. Expected, as O2's masters do: b steps on g1 (the
    step of the same run without the window; SGD lr 1, so the update is the gradient). With
    a.zero_grad() setting to None (r113A R2) the step was refused as one right after a
    delay_unscale block, where docs/amp.md says it runs on what is left."""
    opt_level, bn = level_bn
    torch.manual_seed(0)
    a = nn.Linear(4, 4)
    b = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) if bn else nn.Linear(4, 4)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=1.0)
    [a, b], opt = amp.initialize([a, b], opt, opt_level=opt_level, dtype=torch.float16,
                                 verbosity=0)
    x = torch.randn(2, 4)
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    b_params = list(amp.master_params(opt))[-len(list(b.parameters())):]
    g1 = [p.grad.clone() for p in b_params]
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), opt, delay_unscale=True) as scaled:
        scaled.backward()
    a.zero_grad(set_to_none=set_to_none)
    before = [p.detach().clone() for p in b_params]
    opt.step()
    for p, q, g in zip(b_params, before, g1):
        torch.testing.assert_close(q - p, g, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True], ids=["host", "fused"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_model_zero_grad_keeps_the_skip_for_inf_gradients_a_held_window_set_aside(
        opt_level, fused):
    """r112A B3: block 1 overflows in b's part; block 2 (delay_unscale) sets its inf
    gradients aside; a.zero_grad(set_to_none=False) dropped the waiting skip, looking at b's
    held (finite) gradients only; a clean block 3 added the inf back and the step wrote NaN
    into b. The set-aside gradients count as left: the step is skipped, weights finite."""
    torch.manual_seed(0)
    a = nn.Linear(4, 4)
    b = nn.BatchNorm1d(4) if opt_level == "O2" else nn.Linear(4, 4)  # (O2: stepped directly)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1, fused=fused)
    [a, b], opt = amp.initialize([a, b], opt, opt_level=opt_level, dtype=torch.float16,
                                 verbosity=0)
    x = torch.randn(2, 4)

    def loss(k=1.0):
        return a(x).float().pow(2).mean() + b(x).float().pow(2).mean() * k

    with amp.scale_loss(loss(float("inf")), opt) as scaled:
        scaled.backward()
    with amp.scale_loss(loss(), opt, delay_unscale=True) as scaled:
        scaled.backward()
    a.zero_grad(set_to_none=False)
    with amp.scale_loss(loss(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.step_was_skipped(opt)
    assert all(torch.isfinite(p).all() for p in amp.master_params(opt))


def test_fused_sgd_first_momentum_skipped_on_the_device_after_a_kept_zero_grad_is_primed():
    """r112A B4 (fuzzer seed 73450): O2, a fused SGD with momentum whose first step was
    skipped on the host; zero_grad(set_to_none=False); then a device-path block that overflows
    through another fused optimizer only. amp owes the first one's masters zero gradients
    (kept tensors) but primed the momentum buffers before giving them: the kernel made the
    buffers with empty_like and skipped, leaving garbage that a later clean step on a zero
    gradient moved the weights by. Expected: no garbage (a zero buffer), the weights unmoved."""
    torch.manual_seed(0)
    a, c, d = nn.Linear(64, 64, bias=False), nn.Linear(4, 4), nn.Linear(4, 4)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9, fused=True)
    opt_c = torch.optim.Adam(c.parameters(), lr=1e-3, fused=True)
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    [a, c, d], [opt_a, opt_c, opt_d] = amp.initialize(
        [a, c, d], [opt_a, opt_c, opt_d], opt_level="O2", dtype=torch.float16, verbosity=0)
    x64, x4 = torch.randn(2, 64), torch.randn(2, 4)
    inf = float("inf")
    with amp.scale_loss(a(x64).float().mean() * inf + d(x4).float().mean(),
                        [opt_a, opt_d]) as scaled:
        scaled.backward()  # (host path: opt_d is not fused)
    opt_a.step()
    opt_d.step()
    opt_a.zero_grad(set_to_none=False)
    with amp.scale_loss(c(x4).float().mean() * inf, [opt_a, opt_c]) as scaled:
        scaled.backward()  # (device path; the loss reaches c only)
    w0 = a.weight.detach().clone()
    junk = torch.full((64, 64), 7.0)  # (freed right before the step: what empty_like may get)
    del junk
    opt_a.step()
    opt_c.step()
    assert amp.step_was_skipped(opt_a)
    (master,) = amp.master_params(opt_a)
    buf = opt_a.state.get(master, {}).get("momentum_buffer")
    assert buf is None or not bool(buf.any())
    with amp.scale_loss(a(x64).float().pow(2).mean() * 0.0, opt_a) as scaled:
        scaled.backward()
    opt_a.step()
    assert torch.equal(a.weight.detach(), w0)


@pytest.mark.parametrize("fused", [False, True], ids=["host", "fused"])
def test_an_optimizers_own_block_checks_gradients_another_block_left_scaled_there(fused):
    """r112A R1: a backward inside scale_loss(loss, opt_a) that overflowed also reached
    opt_c's parameters, leaving NaN there (scaled, never checked for opt_c). opt_c's own
    block set them aside and added them back unchecked, and opt_c.step() wrote NaN into c.
    They are checked with that block's gradients now: its step is skipped, c finite and
    unchanged. (Their magnitude stays the caller's accumulation: docs/amp.md.)"""
    torch.manual_seed(0)
    a, c = nn.Linear(4, 4), nn.Linear(4, 4)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_c = torch.optim.AdamW(c.parameters(), lr=0.1, fused=fused)
    [a, c], [opt_a, opt_c] = amp.initialize([a, c], [opt_a, opt_c], opt_level="O1",
                                            dtype=torch.float16, verbosity=0)
    x = torch.randn(2, 4)
    with amp.scale_loss(c(a(x)).float().pow(2).mean() * float("nan"), opt_a) as scaled:
        scaled.backward()
    opt_a.step()
    before = [p.detach().clone() for p in c.parameters()]
    with amp.scale_loss(c(x).float().pow(2).mean(), opt_c) as scaled:
        scaled.backward()
    opt_c.step()
    assert amp.step_was_skipped(opt_c)
    assert all(torch.equal(p, q) for p, q in zip(c.parameters(), before))


# r113A's kill tests of this file's delay_overflow_check, held-window and B1 code (mutation
# run over the sixty-first session's diff): each failed on its mutant.
_INF = float("inf")


def _delayed_backward(loss, optimizers, **kwargs):
    """One scale_loss block with delay_overflow_check=True around loss's backward."""
    with amp.scale_loss(loss, optimizers, delay_overflow_check=True, **kwargs) as scaled:
        scaled.backward()


def _sgd_models(n, num_losses=1, level="O2"):
    torch.manual_seed(0)
    models = [nn.Linear(4, 4) for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    models, opts = amp.initialize(models, opts, opt_level=level, dtype=torch.float16,
                                  verbosity=0, num_losses=num_losses)
    return models, opts, torch.randn(2, 4)


def _loss_scales():
    return {k: v["loss_scale"] for k, v in amp.state_dict().items()}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_joined_pending_checks_keep_the_absorbed_loss(level):
    """(S7) Block A: loss 0 over opt1; block B: loss 1 over opt2, overflowing; block C: loss 0
    over both (joins the two pending checks). Loss 1's scale halves at the step, as it does
    without the delay; the steps are skipped."""
    (a, b), (o1, o2), x = _sgd_models(2, num_losses=2, level=level)
    _delayed_backward(a(x).float().mean(), o1, loss_id=0)
    _delayed_backward(b(x).float().mean() * _INF, o2, loss_id=1)
    _delayed_backward(a(x).float().mean() + b(x).float().mean(), [o1, o2], loss_id=0)
    o1.step()
    o2.step()
    assert amp.step_was_skipped(o1) and amp.step_was_skipped(o2)
    assert _loss_scales()["loss_scaler1"] == 2.0**15


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_joined_pending_checks_decide_once_whichever_optimizer_steps_first(level):
    """(S9) Block B over opt2 and opt3 overflows; block A over opt1; block C over opt1 and
    opt2 joins them. opt3 steps first: one decision for all, the scale halved once."""
    (a, b, c), (o1, o2, o3), x = _sgd_models(3, level=level)
    _delayed_backward(b(x).float().mean() * _INF + c(x).float().mean(), [o2, o3])
    _delayed_backward(a(x).float().mean(), o1)
    _delayed_backward(a(x).float().mean() + b(x).float().mean(), [o1, o2])
    for o in (o3, o1, o2):
        o.step()
        assert amp.step_was_skipped(o)
    assert _loss_scales()["loss_scaler0"] == 2.0**15


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_pending_check_over_two_losses_updates_each(level):
    """(S14) Two delayed blocks of two losses over one optimizer, the second overflowing:
    the step is skipped and the overflowing loss's scale halves."""
    (a,), (o1,), x = _sgd_models(1, num_losses=2, level=level)
    _delayed_backward(a(x).float().mean(), o1, loss_id=0)
    _delayed_backward(a(x).float().mean() * _INF, o1, loss_id=1)
    o1.step()
    assert amp.step_was_skipped(o1)
    assert _loss_scales()["loss_scaler1"] == 2.0**15


def _o1_pair_one_sgd():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=1.0)
    [a, b], opt = amp.initialize([a, b], opt, opt_level="O1", dtype=torch.float16, verbosity=0)
    return a, b, opt, torch.randn(2, 4)


def test_a_model_zero_grad_over_part_of_a_held_window_leaves_its_own_gradients_zero():
    """(S31) As r112A B2's test, but looking at the model the zero_grad reached: a's
    gradients were zeroed in place, so a's step (SGD, lr 1, no momentum) changes nothing."""
    a, b, opt, x = _o1_pair_one_sgd()
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), opt) as s:
        s.backward()
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), opt, delay_unscale=True) as s:
        s.backward()
    a.zero_grad(set_to_none=False)
    before = [p.detach().clone() for p in a.parameters()]
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before))


def test_gradients_of_an_ended_held_window_are_not_kept_alive():
    """(S29) zero_grad(None); a delay_unscale block; an unscaling block; step; then
    zero_grad(set_to_none=True): the window's gradient tensors are freed (nothing of amp's
    keeps them)."""
    import gc
    import weakref
    a, b, opt, x = _o1_pair_one_sgd()
    opt.zero_grad(set_to_none=True)
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), opt, delay_unscale=True) as s:
        s.backward()
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), opt) as s:
        s.backward()
    opt.step()
    refs = [weakref.ref(p.grad) for p in [*a.parameters(), *b.parameters()]]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in refs)


def test_gradients_of_a_dropped_held_window_are_not_kept_alive():
    """(S30) A delay_unscale window dropped by zero_grad(set_to_none=True), then a step:
    the window's gradient tensors are freed."""
    import gc
    import weakref
    a, b, opt, x = _o1_pair_one_sgd()
    opt.zero_grad(set_to_none=True)
    with amp.scale_loss(b(a(x)).float().pow(2).mean(), opt, delay_unscale=True) as s:
        s.backward()
    refs = [weakref.ref(p.grad) for p in [*a.parameters(), *b.parameters()]]
    opt.zero_grad(set_to_none=True)
    opt.step()
    gc.collect()
    assert all(r() is None for r in refs)


def _clean_master_grads(opt):
    for p in amp.master_params(opt):
        if p.grad is not None:
            p.grad.nan_to_num_(0.0, 0.0, 0.0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_later_delayed_blocks_own_flag_counts_after_its_gradients_are_cleaned(level):
    """(S11) docs/amp.md: the gradients are checked at the step "together with the block's own
    flag". Two delayed blocks, the second overflowing; the caller then cleans the gradients
    (nan_to_num_): the second block's flag still skips the step."""
    (a,), (o1,), x = _sgd_models(1, level=level)
    _delayed_backward(a(x).float().mean(), o1)
    _delayed_backward(a(x).float().mean() * _INF, o1)
    _clean_master_grads(o1)
    o1.step()
    assert amp.step_was_skipped(o1)
    assert _loss_scales()["loss_scaler0"] == 2.0**15


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_absorbed_pending_checks_block_flags_count(level):
    """(S8) Block B over opt2 overflows; block A over opt1; block C over both joins the two
    pending checks; the caller cleans opt2's gradients: B's own flag still skips both steps."""
    (a, b), (o1, o2), x = _sgd_models(2, level=level)
    _delayed_backward(b(x).float().mean() * _INF, o2)
    _delayed_backward(a(x).float().mean(), o1)
    _delayed_backward(a(x).float().mean() + b(x).float().mean(), [o1, o2])
    _clean_master_grads(o2)
    o1.step()
    o2.step()
    assert amp.step_was_skipped(o1) and amp.step_was_skipped(o2)


@pytest.mark.parametrize("zero", ["optimizer", "model"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_zero_grad_after_a_delayed_block_decides_on_the_gradients_it_drops(level, zero):
    """(S18, S12b) The inf arrives after the block (a hand all-reduce), the loop then drops
    the batch with zero_grad(): the decision is taken on the gradients before they go, so the
    scale backs off (docs/amp.md: "on the gradients it drops")."""
    (a,), (o1,), x = _sgd_models(1, level=level)
    _delayed_backward(a(x).float().pow(2).mean(), o1)
    next(iter(amp.master_params(o1))).grad[0, 0] = _INF
    (o1 if zero == "optimizer" else a).zero_grad()
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 0}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_static_scale_counts_a_delayed_block_as_any_block(level):
    """(S21) Under a static scale nothing is deferred (nothing can be skipped): the block is
    counted at its exit, as without the delay."""
    def count(delay):
        torch.manual_seed(0)
        m = nn.Linear(4, 4)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        m, o = amp.initialize(m, o, opt_level=level, dtype=torch.float16, loss_scale=128.0,
                              verbosity=0)
        with amp.scale_loss(m(torch.randn(2, 4)).float().mean(), o,
                            delay_overflow_check=delay) as s:
            s.backward()
        return amp.state_dict()
    assert count(True) == count(False)


def test_a_second_step_after_a_device_skip_looks_at_every_gradient_left():
    """(S41) r112A B1's scenario with the inf left in one gradient only (the first the
    optimizer holds): the second step is still skipped, no weight goes non-finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = amp.initialize(model, opt, opt_level="O1", dtype=torch.float16, verbosity=0)
    with amp.scale_loss(model(torch.randn(2, 4)).float().mean() * _INF, opt) as s:
        s.backward()
    opt.step()
    assert amp.step_was_skipped(opt)
    params = list(model.parameters())
    with torch.no_grad():
        for p in params[1:]:
            p.grad.zero_()
    opt.step()
    assert amp.step_was_skipped(opt)
    assert all(torch.isfinite(p).all() for p in params)


def test_gradients_of_a_window_with_set_aside_gradients_are_freed_after_it():
    """r113A R3: a delay_unscale window over gradients an earlier block left (set aside)
    recorded the window's gradient tensors to see a drop; the record outlived the window, so
    one window's gradients per optimizer stayed alive after its step and zero_grad. Freed
    now (weak references, after gc)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", dtype=torch.float16, verbosity=0)
    x = torch.randn(2, 64)
    with amp.scale_loss(model(x).float().mean(), opt) as scaled:
        scaled.backward()
    with amp.scale_loss(model(x).float().mean(), opt, delay_unscale=True) as scaled:
        scaled.backward()
    refs = [weakref.ref(p.grad) for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    with amp.scale_loss(model(x).float().mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("load", ["amp", "optimizer"])
@pytest.mark.parametrize("bad", [True, False], ids=["inf", "finite"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_checkpoint_loaded_between_a_delayed_block_and_its_step_is_an_undelayed_ones(
        level, bad, load):
    """r113A R4: a checkpoint loaded (amp's state or the optimizer's) after a
    delay_overflow_check=True block and before its step: the decision left for the step was
    taken on the loaded state (amp's scale, loaded, backed off for the abandoned gradients).
    It is taken at the load now, as an undelayed block took it at its exit: the loop ends as
    the undelayed one's does (scale, gradients dropped for a rollback after an overflow, weights
    bit for bit)."""
    def run(delay):
        (a,), (o1,), x = _sgd_models(1, level=level)
        saved_opt = copy.deepcopy(o1.state_dict())
        with amp.scale_loss(a(x).float().pow(2).mean() * (_INF if bad else 1.0), o1,
                            delay_overflow_check=delay) as s:
            s.backward()
        if load == "amp":
            amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}})
        else:
            o1.load_state_dict(saved_opt)
        o1.step()
        return amp.state_dict(), [p.detach().clone() for p in amp.master_params(o1)]

    want_scale, want = run(False)
    got_scale, got = run(True)
    assert got_scale == want_scale
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
