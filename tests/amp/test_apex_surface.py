"""The rest of Apex's amp surface, and modern PyTorch features, each on its own."""

import collections
import collections.abc
import copy
import dataclasses
import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixprec import amp
from tests._autograd import FailingBackward

from .helpers import (
    HALF_DTYPES,
    OPT_LEVELS,
    backward_and_step,
    batch,
    make_cnn,
    make_conv_net,
    make_mlp,
    scaled_backward,
    train_step,
)


# -- several models, optimizers and losses ------------------------------------------------------
def _gan(device):
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8)).to(device)
    disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
    return gen, disc


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_gan_two_models_three_losses(opt_level, device):
    gen, disc = _gan(device)
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    [gen, disc], [opt_g, opt_d] = amp.initialize([gen, disc], [opt_g, opt_d], opt_level=opt_level,
                                                 num_losses=3, loss_scale="dynamic", verbosity=0)
    bce = nn.functional.binary_cross_entropy_with_logits
    real = torch.randn(16, 8, device=device)
    noise = torch.randn(16, 4, device=device)
    g_before = copy.deepcopy(gen.state_dict())

    opt_d.zero_grad()
    with amp.scale_loss(bce(disc(real).float(), torch.ones(16, 1, device=device)), opt_d,
                        loss_id=0) as s:
        s.backward()
    fake = gen(noise)
    with amp.scale_loss(bce(disc(fake.detach()).float(), torch.zeros(16, 1, device=device)),
                        opt_d, loss_id=1) as s:
        (s * float("inf")).backward()  # D overflows on its second loss
    opt_d.step()
    assert amp.step_was_skipped(opt_d)

    opt_g.zero_grad()
    with amp.scale_loss(bce(disc(fake).float(), torch.ones(16, 1, device=device)), opt_g,
                        loss_id=2) as s:
        s.backward()
    opt_g.step()
    assert not amp.step_was_skipped(opt_g)  # G's step is its own
    assert any(not torch.equal(v, g_before[k]) for k, v in gen.state_dict().items())
    scales = {k: v["loss_scale"] for k, v in amp.state_dict().items()}
    assert scales == {"loss_scaler0": 2.0**16, "loss_scaler1": 2.0**15, "loss_scaler2": 2.0**16}


# -- gradient accumulation == one large batch ---------------------------------------------------
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_accumulation_equals_large_batch_step(opt_level):
    x, y = batch(n=16)
    big = make_cnn()
    big.eval()  # BatchNorm batch statistics differ between 8 and 16 samples; freeze them
    small = copy.deepcopy(big)
    opt_big = torch.optim.SGD(big.parameters(), lr=0.1)
    opt_small = torch.optim.SGD(small.parameters(), lr=0.1)
    kw = dict(opt_level=opt_level, dtype=torch.bfloat16, loss_scale=256.0, verbosity=0)
    if opt_level == "O1":
        kw["patch_torch_functions"] = False  # isolate accumulation from per-op rounding
    amp.initialize(big, opt_big, **kw)
    amp.initialize(small, opt_small, **kw)
    with amp.scale_loss(nn.functional.cross_entropy(big(x), y), opt_big) as s:
        s.backward()
    opt_big.step()
    for i, (xs, ys) in enumerate(((x[:8], y[:8]), (x[8:], y[8:]))):
        loss = nn.functional.cross_entropy(small(xs), ys) / 2
        with amp.scale_loss(loss, opt_small, delay_unscale=(i == 0)) as s:
            s.backward()
    opt_small.step()
    exact = opt_level in ("O0", "O1")
    for (k, a), b in zip(big.state_dict().items(), small.state_dict().values()):
        if exact:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)
        elif a.is_floating_point():
            rel = (b - a).norm() / a.norm().clamp_min(1e-12)
            assert rel < 1e-2, (k, rel)


# -- add_param_group after initialize -----------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("zeroing", ["wrapper.zero_grad", "grad=None over parameters()"])
def test_o2_masters_grads_do_not_pile_up_when_zeroed_through_a_wrapper(zeroing, dtype):
    # HuggingFace-style loops wrap the amp model (DataParallel, torch DDP) and zero through the
    # wrapper, which reaches only the half parameters (nn.Module.zero_grad over its own
    # parameters(), as a plain container here does); NVIDIA's tip sets `p.grad = None` over
    # model.parameters(). The step consumes the masters' gradients (Apex freed them), so these
    # train exactly like optimizer.zero_grad(). Before, the masters' gradients accumulated over
    # all past steps.
    def run(zero):
        model = make_cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0)
        wrapped = nn.Sequential(model)  # (zero_grad as DataParallel's and torch DDP's)
        for step in range(4):
            x, y = batch(seed=step)
            loss = nn.functional.cross_entropy(wrapped(x), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            assert all(m.grad is None for m in opt._amp_stash.all_fp32_from_fp16_params)
            if zero == "optimizer":
                opt.zero_grad()
            elif zero == "wrapper.zero_grad":
                wrapped.zero_grad()
            else:
                for p in model.parameters():
                    p.grad = None
        return [m.detach().clone() for m in amp.master_params(opt)]

    for a, b in zip(run("optimizer"), run(zeroing)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_o2_model_zero_grad_without_set_to_none_zeroes_the_masters_grads():
    """``model.zero_grad(set_to_none=False)`` on an O2 model zeroes the gradients of the fp32
    masters as well as those of the half parameters, as ``nn.Module.zero_grad`` does for a
    plain model: loops that zero through the model between a backward and the step (gradient
    clipping experiments, a discarded micro-batch) expect the step to see no gradient. (M30)"""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x, y = batch()
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    masters = list(amp.master_params(opt))
    assert any(m.grad is not None and m.grad.abs().sum() > 0 for m in masters)
    model.zero_grad(set_to_none=False)
    for m in masters:
        assert m.grad is None or (m.grad == 0).all()
    for p in model.parameters():
        assert p.grad is None or (p.grad == 0).all()
    # A master's gradient that is part of a graph (set by hand from a computation requiring
    # grad) is cut from it and zeroed, as nn.Module.zero_grad does a plain parameter's. (A07)
    src = torch.ones_like(masters[0], requires_grad=True)
    masters[0].grad = src * 2
    model.zero_grad(set_to_none=False)
    assert masters[0].grad.grad_fn is None and not masters[0].grad.requires_grad
    assert torch.equal(masters[0].grad, torch.zeros_like(masters[0]))


class _SlowFastWrapper(torch.optim.Optimizer):
    """Lookahead/torchcontrib-SWA-shaped: an Optimizer subclass that never calls
    Optimizer.__init__, shares its inner optimizer's param_groups and, after the inner step,
    pulls every k-th step's weights half way back towards slow copies."""

    def __init__(self, inner, k=2):  # noqa: D107  (deliberately no super().__init__)
        self.inner, self.k = inner, k
        self.param_groups = inner.param_groups
        self.state = collections.defaultdict(dict)
        self.steps = 0

    def step(self, closure=None):
        loss = self.inner.step(closure)
        self.steps += 1
        if self.steps % self.k == 0:
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        slow = self.state[p].setdefault("slow", p.detach().clone())
                        slow += (p - slow) * 0.5
                        p.copy_(slow)
        return loss

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_optimizer_wrapper_without_optimizer_init(opt_level):
    # Such wrappers failed inside amp.initialize (PyTorch's hook tables were missing). amp's
    # hooks must run around the wrapper's whole step: at O2 the half model then holds the
    # masters after the pull-back too, and training equals the same loop run by hand on fp32
    # weights through the same wrapper (O2's masters at a static scale of 1, bf16 forward).
    def run(use_amp):
        model = make_mlp()
        start = [p.detach().clone() for p in model.parameters()]
        opt = _SlowFastWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
        if use_amp:
            model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                        verbosity=0)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(6, 4, generator=gen)
            opt.zero_grad()
            backward_and_step(model(x).float().pow(2).mean(), opt, amp, use_amp)
            if use_amp and opt_level == "O2":
                for half, master in zip(opt._amp_stash.all_fp16_params,
                                        opt._amp_stash.all_fp32_from_fp16_params):
                    assert torch.equal(half, master.to(half.dtype))
        return [p.detach().float() - p0 for p, p0 in zip(amp.master_params(opt), start)], \
            opt.steps

    (mixed, steps), (plain, _) = run(True), run(False)
    assert steps == 4
    for a, b in zip(mixed, plain):
        # The whole updates compared (some are ~1e-2: the weights themselves hid them): a
        # bf16 forward/backward's rounding, not a step missed or taken twice.
        assert b.abs().max() > 1e-3
        torch.testing.assert_close(a, b, rtol=0.05, atol=b.abs().max().item() * 0.05)
        assert not torch.equal(a, b) or opt_level == "O1"


class _SAM(torch.optim.Optimizer):
    """Shaped like the widely used SAM (sharpness-aware minimization): its own groups, shared
    with a base optimizer built over them, stepped by ``second_step()`` (or by
    ``step(closure)``, which runs first_step, the closure, second_step)."""

    def __init__(self, params, base, rho=0.05, **kw):  # noqa: D107
        super().__init__(params, dict(rho=rho, **kw))
        self.base_optimizer = base(self.param_groups, **kw)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.stack([g.norm() for g in grads]).norm()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.detach().clone()
                    p.add_(p.grad * group["rho"] / (norm + 1e-12))
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_(self.state[p]["old_p"])
        self.base_optimizer.step()
        self.zero_grad()

    @torch.no_grad()
    def step(self, closure):
        self.first_step()
        with torch.enable_grad():
            closure()
        self.second_step()


def _sam_run(opt_level, by_closure, steps=4):
    """Weights after ``steps`` SAM steps; ``opt_level=None``: the float64 reference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    if opt_level is None:
        model = model.double()
    opt = _SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.5)
    if opt_level is not None:
        model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                    verbosity=0)
    torch.manual_seed(1)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    if opt_level is None:
        x, y = x.double(), y.double()

    def backward():
        loss = nn.functional.mse_loss(model(x).to(y.dtype), y)
        scaled_backward(loss, opt, amp, opt_level is not None)

    for _ in range(steps):
        backward()
        if by_closure:
            opt.step(backward)
        else:
            opt.first_step()
            backward()
            opt.second_step()
    return {k: v.double() for k, v in model.state_dict().items()}, model


@pytest.mark.parametrize("opt_level,by_closure", [("O1", False), ("O1", True), ("O2", True)])
def test_sam_trains_like_float64(opt_level, by_closure):
    # SAM's gradient is taken at weights perturbed by first_step: at O2 the closure's forward
    # runs the half model made from the (perturbed) masters, and second_step's update reaches
    # the half model through amp's hooks around SAM.step().
    want, _ = _sam_run(None, by_closure)
    got, model = _sam_run(opt_level, by_closure)
    plain_sgd, _ = _sam_run(None, by_closure=False, steps=0)  # (the start)
    for k in want:
        moved = (want[k] - plain_sgd[k]).norm()
        assert (got[k] - want[k]).norm() <= 0.02 * moved + 1e-3, k  # (bf16 forward/backward)
    if opt_level == "O2":
        assert torch.equal(model[0].weight, model.state_dict()["0.weight"].to(torch.bfloat16))


def test_o2_sam_stepped_by_second_step_is_refused():
    # SAM's first_step()/second_step() step its base optimizer, not SAM: at O2 the masters
    # moved and the half model never did (nor saw the perturbation), silently. Refused at the
    # base optimizer's step, saying what works instead.
    with pytest.raises(RuntimeError, match=r"(?s)_SAM\.base_optimizer \(SGD\) was stepped "
                       r"directly.*_SAM\.step\(closure\).*opt_level='O1'"):
        _sam_run("O2", by_closure=False, steps=1)


def test_add_param_group_gets_masters_at_o2():
    model = make_cnn()
    frozen = list(model.head.parameters())
    opt = torch.optim.SGD(list(model.features.parameters()), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model.head.weight.dtype == torch.float16
    opt.add_param_group({"params": frozen, "lr": 0.05})
    x, y = batch()
    before = model.head.weight.detach().clone()
    train_step(model, opt, x, y, amp)
    group = opt.param_groups[-1]["params"]
    # fp32 masters, stepped (their gradients are freed by the step, as Apex did)
    assert all(p.dtype == torch.float32 and p.grad is None for p in group)
    assert not torch.equal(model.head.weight, before)  # master stepped, copied into the model
    torch.testing.assert_close(model.state_dict()["head.weight"], group[0].detach(), rtol=0, atol=0)


def test_a_group_added_at_o2_leaves_the_fp32_batchnorm_parameters_unscaled_once():
    # The parameters amp already knows (fp32 BatchNorm, kept out of the masters) are not taken
    # in again when a later group is adopted: listed twice, their gradients were unscaled
    # twice (by 128 twice here) and BatchNorm stopped training. Against float64.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    head = nn.Linear(2, 2)
    ref, ref_head = copy.deepcopy(model).double(), copy.deepcopy(head).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, loss_scale=128.0,
                   verbosity=0)
    x = torch.randn(8, 4)
    for i in range(3):
        if i == 1:
            opt.add_param_group({"params": list(head.parameters()), "lr": 0.05})
            ref_opt.add_param_group({"params": list(ref_head.parameters()), "lr": 0.05})
        out = model(x).float()
        with amp.scale_loss((head(out) if i else out).pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        out = ref(x.double())
        (ref_head(out) if i else out).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.testing.assert_close(model[1].weight.double(), ref[1].weight.detach(), rtol=0,
                               atol=1e-3)  # (bf16 compute: 9e-5 off; unscaled twice: 2e-2)
    torch.testing.assert_close(head.weight.double(), ref_head.weight.detach(), rtol=0,
                               atol=1e-3)


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_add_param_group_repeating_a_parameter_is_refused_at_every_level(opt_level):
    # PyTorch refuses a parameter in two groups; at O2 its check compared the half parameter
    # with the fp32 masters in the first group and let it in: the group's lr silently did
    # nothing (the half parameter is never stepped). Refused there too, group taken out.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    with pytest.raises(ValueError, match=r"more than one parameter group|2 of the new "
                                         r"group's 2 parameters .*already in another"):
        opt.add_param_group({"params": list(model.head.parameters()), "lr": 0.01})
        train_step(model, opt, *batch(), amp)  # (at O2 found where the group is adopted)
    assert len(opt.param_groups) == 1
    before = model.state_dict()["head.weight"].clone()
    train_step(model, opt, *batch(), amp)  # (the optimizer is usable again)
    assert not torch.equal(model.state_dict()["head.weight"], before)
    assert len(opt.state_dict()["param_groups"]) == 1


@pytest.mark.parametrize("bias, extra, shown", [
    (True, True, "4 of the new group's 5 parameters (shapes [(8, 4), (8,), (2, 8)], ...)"),
    (True, False, "4 of the new group's 4 parameters (shapes [(8, 4), (8,), (2, 8)], ...)"),
    (False, False, "3 of the new group's 3 parameters (shapes [(8, 4), (8,), (2, 8)])"),
])
def test_add_param_group_refusal_counts_and_shows_the_repeated_parameters(bias, extra, shown):
    """The O2 refusal of a late group repeating parameters already in the optimizer (as their
    fp32 masters) counts the repeated ones against the group's size and shows the first three
    shapes, then ', ...' only when more were repeated: a user unfreezing a backbone with a new
    head parameter in the same group can tell which to take out. Found where the optimizer
    adopts late groups (its state_dict()); the group is taken back out. (M02, M03, M39)"""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2, bias=bias))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    new = list(model.parameters()) + ([nn.Parameter(torch.zeros(3))] if extra else [])
    opt.add_param_group({"params": new, "lr": 0.01})
    with pytest.raises(ValueError) as info:
        opt.state_dict()
    assert f"{shown} are already in another of the optimizer's groups" in str(info.value)
    assert len(opt.param_groups) == 1


def test_a_new_head_added_after_initialize_saves_fp32_before_any_step():
    # A module put into an O2 model after initialize and given to the optimizer with
    # add_param_group: its checkpoint entries were half until the next step (or an
    # optimizer.state_dict()) made its masters. The model's own state_dict makes them now.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    model.add_module("head", nn.Linear(4, 2).half())
    opt.add_param_group({"params": list(model.head.parameters())})
    saved = model.state_dict()
    assert {k: v.dtype for k, v in saved.items()} == dict.fromkeys(saved, torch.float32)
    masters = opt.param_groups[1]["params"]
    assert all(m.dtype == torch.float32 for m in masters)
    assert torch.equal(saved["head.weight"], masters[0])
    assert torch.equal(saved["head.weight"], model.head.weight.float())


class _AccumulatorSGD(torch.optim.SGD):
    """SGD that makes per-parameter state as a group is added (Adagrad-style accumulators)."""

    def add_param_group(self, group):
        super().add_param_group(group)
        for p in self.param_groups[-1]["params"]:
            self.state[p]["sum"] = torch.full_like(p, 0.1)


def test_optimizer_state_dict_right_after_add_param_group_saves_the_masters_fp32_state():
    """An O2 optimizer's state_dict() taken right after add_param_group, before any scale_loss, comes
    from the late group's fp32 masters: the state the optimizer made for the half parameters
    is saved fp32 (as every other entry, and as a resume loads it), and the optimizer then
    holds the masters that amp.master_params gives, as it will when it trains. (M13)"""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = _AccumulatorSGD(model[0].parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    opt.add_param_group({"params": list(model[1].parameters())})
    saved = opt.state_dict()
    assert sorted(saved["state"]) == [0, 1, 2, 3]
    assert all(s["sum"].dtype == torch.float32 for s in saved["state"].values())
    late = opt.param_groups[1]["params"]
    assert all(p.dtype == torch.float32 for p in late)
    assert all(p is q for p, q in zip(late, list(amp.master_params(opt))[2:]))


def test_a_write_before_a_late_param_group_reaches_the_master():
    # An in-place write to the half model (a re-initialised layer) made before amp picks up a
    # later add_param_group holds, as it does without the new group: adopting the group
    # recorded every pair as in step, and the write was lost (the next step copied the old
    # master back). lr 0: only the write can move the weights; 0.5 is exact in fp16.
    model = nn.Linear(4, 4)
    extra = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    with torch.no_grad():
        model.weight.fill_(0.5)
    opt.add_param_group({"params": [extra], "lr": 0.0})
    loss = model(torch.randn(2, 4)).float().sum() + extra.sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert not amp.step_was_skipped(opt)
    expected = torch.full((4, 4), 0.5)
    torch.testing.assert_close(model.state_dict()["weight"], expected, rtol=0, atol=0)
    torch.testing.assert_close(model.weight.float(), expected, rtol=0, atol=0)
    torch.testing.assert_close(next(iter(amp.master_params(opt))), expected, rtol=0, atol=0)


# G1: kills M1 (adopt_params skipping take_model_writes() before adopting a later group).
def test_a_write_after_a_step_before_a_late_param_group_reaches_the_master():
    # As test_a_write_before_a_late_param_group_reaches_the_master, but after a first step:
    # there the write was also found by the first look's value comparison (every parameter
    # counts as registered since), which hid a lost take_model_writes before adopting the
    # group. After a step only the version counters see it. lr 0 after the first step: only
    # the write can move the weights; 0.5 is exact in fp16.
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    extra = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    x = torch.randn(2, 4)
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
    opt.param_groups[0]["lr"] = 0.0
    with torch.no_grad():
        model.weight.fill_(0.5)
    opt.add_param_group({"params": [extra], "lr": 0.0})
    expected = torch.full((4, 4), 0.5)
    # amp.master_params right after the group (an EMA or clip list taken there)
    torch.testing.assert_close(next(iter(amp.master_params(opt))).detach(), expected,
                               rtol=0, atol=0)
    with amp.scale_loss(model(x).float().sum() + extra.sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not amp.step_was_skipped(opt)
    torch.testing.assert_close(model.weight.float(), expected, rtol=0, atol=0)
    torch.testing.assert_close(model.state_dict()["weight"], expected, rtol=0, atol=0)


def test_a_write_before_a_late_param_group_holds_through_skipped_steps():
    # Dynamic scaling: the first steps overflow at 2**16 and are skipped (no post-step copy).
    # The half write made before the late group is picked up must be in the masters then, as
    # the forward runs it: amp.master_params and the state_dict agree with the model.
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    extra = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with torch.no_grad():
        model.weight.fill_(0.5)
    opt.add_param_group({"params": [extra], "lr": 0.0})
    x = torch.randn(2, 4)
    with amp.scale_loss(model(x).float().sum() * 1e4 + extra.sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.step_was_skipped(opt)  # (fp16 overflow at the starting scale)
    expected = torch.full((4, 4), 0.5)
    torch.testing.assert_close(model.weight.float(), expected, rtol=0, atol=0)
    torch.testing.assert_close(next(iter(amp.master_params(opt))).detach(), expected,
                               rtol=0, atol=0)


# -- clipping on master params ------------------------------------------------------------------
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_clip_grad_norm_on_master_params(opt_level):
    model = make_cnn()
    x, y = batch()
    ref = copy.deepcopy(model)
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, loss_scale=1024.0, dtype=torch.bfloat16,
                   verbosity=0)
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as s:
        s.backward()
    norm = nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm=0.1)
    # the norm is of the unscaled gradients, not of the scaled ones
    torch.testing.assert_close(norm.float(), ref_norm, rtol=5e-2, atol=0)
    clipped = torch.stack([p.grad.float().norm() for p in amp.master_params(opt)]).norm()
    assert clipped <= 0.1 * 1.01


def test_master_params_right_after_add_param_group_are_the_new_masters():
    # A clip list taken once after add_param_group (before any scale_loss) held the new
    # group's half parameters at O2, whose gradients amp moves away: the head went unclipped.
    model = make_cnn()
    opt = torch.optim.SGD(model.features.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, dtype=torch.float16,
                   verbosity=0)
    opt.add_param_group({"params": list(model.head.parameters())})
    clip_list = list(amp.master_params(opt))
    assert [p.dtype for p in clip_list] == [torch.float32] * len(clip_list)
    assert len(clip_list) == len(list(model.parameters()))
    x, y = batch()
    ref = copy.deepcopy(make_cnn())
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1e9)
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as s:
        s.backward()
    norm = nn.utils.clip_grad_norm_(clip_list, max_norm=1e9)
    torch.testing.assert_close(norm.float(), ref_norm, rtol=2e-2, atol=0)  # (fp16 compute)


# -- user functions and disable_casts -----------------------------------------------------------
def _probe(x, y):
    return x.dtype, y.dtype


def test_register_functions_and_decorators():
    ns = type("NS", (), {})()
    ns.half_fn, ns.float_fn, ns.promote_fn = _probe, _probe, _probe
    amp.register_half_function(ns, "half_fn")
    amp.register_float_function(ns, "float_fn")
    amp.register_promote_function(ns, "promote_fn")
    a = torch.randn(2)
    b = torch.randn(2, dtype=torch.bfloat16)
    # outside autocast: untouched
    assert ns.half_fn(a, b) == (torch.float32, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ns.half_fn(a, b) == (torch.bfloat16, torch.bfloat16)
        assert ns.float_fn(a, b) == (torch.float32, torch.float32)
        assert ns.promote_fn(a, b) == (torch.float32, torch.float32)
        assert amp.half_function(_probe)(a, b) == (torch.bfloat16, torch.bfloat16)
        assert amp.float_function(_probe)(a, b) == (torch.float32, torch.float32)
        assert amp.promote_function(_probe)(b, b) == (torch.bfloat16, torch.bfloat16)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        amp.register_half_function(ns, "nope")
    # The module as a string, and a decorator given no function: refused naming them (before,
    # "the module has no attribute", and a wrapper that failed only when called).
    with pytest.raises(TypeError, match=r"register_half_function\('torch', 'mm'\): the first "
                                        r"argument is the module object .*not str"):
        amp.register_half_function("torch", "mm")
    for bad in (5, None, "x"):
        with pytest.raises(TypeError, match=rf"amp\.float_function\({bad!r}\): expected a "
                                            r"function to decorate, got"):
            amp.float_function(bad)
    with pytest.raises(ValueError, match="already has the amp casting rule 'half'; it cannot "
                                         "also take 'float'"):
        amp.register_float_function(ns, "half_fn")
    # The same registration again changes nothing (Apex kept a set): a model builder that
    # registers its functions may run once per trial.
    registered = ns.half_fn
    amp.register_half_function(ns, "half_fn")
    assert ns.half_fn is registered
    assert amp.half_function(registered) is registered
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ns.half_fn(a, b) == (torch.bfloat16, torch.bfloat16)


# A function with a casting rule casts the tensors inside a namedtuple argument and rebuilds
# it from its fields.
def test_a_function_with_a_rule_casts_tensors_inside_a_namedtuple():
    Pair = collections.namedtuple("Pair", "x y")

    @amp.float_function
    def dtypes(pair):
        return pair.x.dtype, pair.y.dtype, type(pair)

    arg = Pair(torch.randn(2).bfloat16(), torch.randn(2).bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dtypes(arg) == (torch.float32, torch.float32, Pair)


def test_registered_function_inside_o1_model():
    ns = type("NS", (), {})()
    ns.matmul = torch.matmul
    amp.register_float_function(ns, "matmul")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)  # autocast: bf16
            out = ns.matmul(h, h.t())  # registered float: fp32
            seen.update(h=h.dtype, out=out.dtype)  # (O1's outputs leave the model in fp32)
            return out

    seen = {}
    model = Net()
    amp.initialize(model, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    model(torch.randn(3, 4))
    assert seen == {"h": torch.bfloat16, "out": torch.float32}


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_disable_casts_at_every_level(opt_level):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            with amp.disable_casts():
                return self.lin(x.to(self.lin.weight.dtype)), torch.mm(x.float(), x.float().t())

    model = Net()
    amp.initialize(model, opt_level=opt_level, dtype=torch.bfloat16, cast_model_outputs=None,
                   verbosity=0)
    lin_out, mm_out = model(torch.randn(3, 4))
    assert mm_out.dtype == torch.float32 or opt_level in ("O2", "O3")
    if opt_level in ("O0", "O1"):
        assert lin_out.dtype == torch.float32  # O1's autocast is off inside the block


class _Seen(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        h = self.lin(x)
        self.seen.append(h.dtype)
        return h


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_disable_casts_around_a_model_call(opt_level):
    # Apex's disable_casts turned casting off for everything run inside the block, a model
    # called there included; the O1 forward's own torch.autocast turned it back on.
    model = _Seen()
    amp.initialize(model, opt_level=opt_level, patch_torch_functions=True,
                   dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(2, 4)
    with amp.disable_casts():
        with amp.disable_casts():
            model(x)
        model(x)
    with pytest.raises(KeyError), amp.disable_casts():
        raise KeyError
    model(x)  # after the blocks (an exception included): casting again
    assert model.seen == [torch.float32, torch.float32, torch.bfloat16]


def test_register_static_and_class_methods():
    # An extension's ops gathered on a class: the registered static/class method stays one
    # (a bare wrapper set on the class turned into an instance method: TypeError).
    class Ops:
        @staticmethod
        def static(x):
            return x.dtype

        @classmethod
        def cls_method(cls, x):
            return cls, x.dtype

    amp.register_half_function(Ops, "static")
    amp.register_float_function(Ops, "cls_method")
    amp.register_half_function(Ops, "static")  # again: no change
    b = torch.randn(2, dtype=torch.bfloat16)
    assert Ops.static(b) == Ops().static(b) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert Ops.static(torch.randn(2)) == Ops().static(torch.randn(2)) == torch.bfloat16
        assert Ops.cls_method(b) == Ops().cls_method(b) == (Ops, torch.float32)


def test_registered_function_finds_tensors_in_mappings_and_on_meta():
    probe = amp.half_function(lambda *args, **kwargs: [
        t.dtype for t in list(args) + list(kwargs.values()) for t in t.values()])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # a function given only a dict of tensors was left uncast
        assert probe({"x": torch.randn(2)}) == [torch.bfloat16]
        assert probe(batch={"x": torch.randn(2)}) == [torch.bfloat16]
        # meta tensors (autocast knows no such device): run as they are, not a RuntimeError
        assert probe({"x": torch.empty(2, device="meta")}) == [torch.float32]
    assert probe({"x": torch.empty(2, device="meta")}) == [torch.float32]
    mm = amp.float_function(torch.mm)  # (as amp.register_float_function(torch, "mm") makes it)
    assert mm(*[torch.empty(2, 2, device="meta")] * 2).shape == (2, 2)


# -- outputs and nested inputs ------------------------------------------------------------------
Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Inputs:
    image: torch.Tensor
    label: torch.Tensor
    name: str = "x"


class Echo(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, inputs, extra=None):
        return {"inputs": inputs, "extra": extra, "y": self.lin(inputs[0].image)}


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("out_dtype", [None, torch.float16, torch.float32])
def test_cast_model_outputs_every_level(opt_level, out_dtype):
    model = Echo()
    amp.initialize(model, opt_level=opt_level, cast_model_outputs=out_dtype, verbosity=0)
    y = model([Inputs(torch.randn(3, 2), torch.arange(3))])["y"]
    if out_dtype is not None:
        assert y.dtype == out_dtype
    else:
        # Every level's floating outputs leave the model in fp32 unless told otherwise (O1:
        # the loss after the model runs outside its autocast region).
        assert y.dtype == torch.float32


def test_o2_casts_nested_inputs_only_floating():
    seen = {}

    class Spy(Echo):
        def forward(self, inputs, extra=None):
            seen["inputs"], seen["extra"] = inputs, extra
            return super().forward(inputs, extra)

    model = Spy()
    amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    data = [Inputs(torch.randn(3, 2), torch.arange(3)), Pair(torch.randn(1), 7)]
    model(data, extra={"mask": torch.ones(2, dtype=torch.bool), "w": (torch.randn(2), "s")})
    inputs, extra = seen["inputs"], seen["extra"]
    assert isinstance(inputs, list) and isinstance(inputs[0], Inputs)
    assert isinstance(inputs[1], Pair) and inputs[1].b == 7
    assert inputs[0].image.dtype == torch.bfloat16 and inputs[0].label.dtype == torch.int64
    assert inputs[0].name == "x" and inputs[1].a.dtype == torch.bfloat16
    assert extra["mask"].dtype == torch.bool and extra["w"][0].dtype == torch.bfloat16
    assert extra["w"][1] == "s"
    assert data[0].image.dtype == torch.float32  # the caller's objects are not modified


def test_o2_leaves_complex_and_every_integer_dtype_of_the_inputs_as_they_are():
    """amp's input cast touches real floating tensors only: complex inputs (an FFT
    feature, a complex mask) keep their imaginary part and dtype, and integer inputs of any
    width (int32 token ids from a tokenizer, uint8 images, int16 audio) stay integers, since
    indices and quantized data cast to half would be corrupted. Reference: the caller's own
    tensors, bit for bit. (N01, N02)"""
    seen = {}
    model = _o2_input_spy(seen, lambda batch: batch["x"])
    batch_ = {"x": torch.randn(3, 2),
              "spectrum": torch.randn(3, dtype=torch.complex64),
              "ids32": torch.arange(3, dtype=torch.int32),
              "pixels": torch.arange(3, dtype=torch.uint8),
              "audio": torch.arange(3, dtype=torch.int16)}
    model(batch_)
    got = seen["input"]
    assert got["x"].dtype == torch.bfloat16
    for key in ("spectrum", "ids32", "pixels", "audio"):
        assert got[key].dtype == batch_[key].dtype, key
        assert torch.equal(got[key], batch_[key]), key


def _o2_input_spy(seen, pick):
    """An O2 (bf16) model that records the input its forward receives in ``seen["input"]``
    and runs a Linear(2, 2) on ``pick(input)``."""

    class Spy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, arg):
            seen["input"] = arg
            return self.lin(pick(arg))

    return amp.initialize(Spy(), opt_level="O2", dtype=torch.bfloat16, verbosity=0)


def test_o2_output_cast_keeps_tuples_and_lists_as_they_were():
    """A model returning ``(logits, aux)`` gets a tuple back after amp's output cast, and a
    list stays a list: callers unpack, index and ``isinstance``-check these (torchvision's
    Inception returns a namedtuple, detection heads return lists, many losses take tuples), and
    a tuple turned into a list breaks hashing and ``==`` comparisons. Floating members come out
    fp32, the others as they were. (M02)"""

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            h = self.lin(x)
            return (h, torch.arange(2)), [h * 2, "tag"]

    model = TwoHeads()
    amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    pair, rest = model(torch.randn(3, 2))
    assert type(pair) is tuple and type(rest) is list
    assert pair[0].dtype == rest[0].dtype == torch.float32
    assert pair[1].dtype == torch.int64 and rest[1] == "tag"
    torch.testing.assert_close(rest[0], (pair[0].bfloat16() * 2).float(), rtol=0, atol=0)
    # Inputs too: a tuple handed to the forward arrives as a tuple of half tensors.
    seen = {}
    _o2_input_spy(seen, lambda pair: pair[0])((torch.randn(3, 2), torch.arange(3)))
    assert type(seen["input"]) is tuple and seen["input"][0].dtype == torch.bfloat16


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_torch_return_types_and_sizes_in_outputs_keep_their_types(opt_level):
    """A forward returning torch's structseq results (``topk``, ``max``: values and indices)
    and a ``torch.Size`` among its outputs: amp's output cast rebuilds them as the same types,
    casts their floating values to fp32 (the model's outputs at every level by default) and
    leaves the integer indices and sizes as they are."""

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 5)

        def forward(self, x):
            h = self.l(x)
            return {"top": h.topk(2, dim=1), "max": torch.max(h, 1), "shape": h.shape,
                    "ids": torch.arange(3), "pair": (h, x.shape[0])}

    torch.manual_seed(0)
    model = Heads()
    reference = Heads()
    reference.load_state_dict(model.state_dict())
    amp.initialize(model, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(3, 4)
    out, want = model(x), reference(x)
    for key in ("top", "max"):
        assert type(out[key]) is type(want[key]), key
        assert out[key].values.dtype == torch.float32
        assert out[key].indices.dtype == torch.int64
        # (bf16 weights and inputs at O2/O3: about 2**-8 relative per rounding.)
        torch.testing.assert_close(out[key].values, want[key].values, rtol=3e-2, atol=3e-2)
    assert type(out["shape"]) is torch.Size and out["shape"] == want["shape"]
    assert out["ids"].dtype == torch.int64 and type(out["pair"]) is tuple
    assert out["pair"][0].dtype == torch.float32 and out["pair"][1] == 3


@dataclasses.dataclass
class _Derived:
    x: torch.Tensor
    scale: dataclasses.InitVar[float]
    scaled: torch.Tensor = dataclasses.field(init=False)
    note: torch.Tensor = dataclasses.field(init=False, default=None)

    def __post_init__(self, scale):
        self.scaled = self.x * scale


def test_o2_casts_dataclass_fields_set_outside_init():
    # Fields with init=False (and an InitVar) survive the cast, in and out: rebuilding through
    # __init__ failed on the InitVar, dropped `note` and ran __post_init__ again.
    seen = {}

    class Spy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, d):
            seen["d"] = d
            out = _Derived(self.lin(d.x), 1.0)
            out.note = self.lin(d.note)
            return out

    model = Spy()
    amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    data = _Derived(torch.randn(3, 2), 2.0)
    data.note = torch.randn(3, 2)
    out = model(data)
    got = seen["d"]
    assert type(got) is _Derived and got is not data
    assert got.x.dtype == got.scaled.dtype == got.note.dtype == torch.bfloat16
    torch.testing.assert_close(got.scaled, data.scaled.bfloat16())  # not scaled twice
    assert data.note.dtype == torch.float32  # the caller's object is left alone
    assert out.note is not None and out.note.dtype == out.scaled.dtype == torch.float32


@dataclasses.dataclass
class _NotCopyable:
    """A batch dataclass that refuses to be copied or pickled (its ``__reduce_ex__`` raises),
    with a field set outside ``__init__``."""

    x: torch.Tensor
    ids: torch.Tensor
    note: str = dataclasses.field(init=False, default="default")

    def __reduce_ex__(self, protocol):
        raise TypeError("_NotCopyable cannot be copied")


def test_o2_casts_a_dataclass_that_cannot_be_copied_through_its_init():
    # copy.copy fails, so cast_floating rebuilds the instance through __init__
    # (dataclasses.replace with the init fields only). (Mutants DC04: the fallback is not
    # taken, the TypeError escapes; DC05: init=False fields passed to replace, ValueError.)
    seen = {}

    class Spy(Echo):
        def forward(self, d):
            seen["d"] = d
            return self.lin(d.x)

    model = amp.initialize(Spy(), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    data = _NotCopyable(torch.randn(3, 2), torch.arange(3))
    out = model(data)
    got = seen["d"]
    assert type(got) is _NotCopyable and got is not data
    assert got.x.dtype == torch.bfloat16 and got.ids.dtype == torch.int64
    torch.testing.assert_close(got.x, data.x.bfloat16(), rtol=0, atol=0)
    assert data.x.dtype == torch.float32  # the caller's object is left alone
    assert out.dtype == torch.float32


@dataclasses.dataclass
class _LazyField:
    """A batch dataclass whose ``init=False`` field is filled later (never here), and whose
    ``__post_init__`` transforms an input."""

    x: torch.Tensor
    cache: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):
        self.x = self.x * 2


def test_o2_casts_a_dataclass_with_an_unset_field_without_running_init_again():
    """A dataclass batch whose ``init=False`` field was never set is cast field by field: the
    field stays unset and ``__post_init__`` does not run a second time on values it already
    transformed (a rebuild through ``__init__`` would double ``x`` here). (A05)"""
    seen = {}
    data = _LazyField(torch.randn(3, 2))
    _o2_input_spy(seen, lambda d: d.x)(data)
    got = seen["input"]
    assert type(got) is _LazyField and got is not data
    assert not hasattr(got, "cache")
    torch.testing.assert_close(got.x, data.x.bfloat16(), rtol=0, atol=0)  # not doubled again


@dataclasses.dataclass(frozen=True)
class _FrozenBatch:
    """A frozen batch dataclass whose ``__post_init__`` derives a field (``init=False``) from
    an input, as frozen dataclasses must, through ``object.__setattr__``."""

    x: torch.Tensor
    total: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "x", self.x * 2)
        object.__setattr__(self, "total", self.x.sum(dim=1))


def test_o2_casts_a_frozen_dataclass_field_by_field():
    """A frozen dataclass batch is cast field by field like any other: frozen only forbids
    the user's assignments, and a rebuild through ``__init__`` would run ``__post_init__``
    again (``x`` doubled twice, ``total`` recomputed from the doubled values). Reference: the
    caller's instance, its fields rounded to bf16 once. (N05)"""
    seen = {}
    data = _FrozenBatch(torch.randn(3, 2))
    _o2_input_spy(seen, lambda d: d.x)(data)
    got = seen["input"]
    assert type(got) is _FrozenBatch and got is not data
    torch.testing.assert_close(got.x, data.x.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(got.total, data.total.bfloat16(), rtol=0, atol=0)
    assert data.x.dtype == torch.float32  # the caller's instance is left alone


class _OutputBase(collections.OrderedDict):
    """A model-output base class in the style of Hugging Face's ``ModelOutput``: a dataclass
    that is also an ``OrderedDict`` holding only the fields that are not None, whose items and
    attributes stay in step, and whose integer index reads the tuple of the items."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, key, value):
        if key in self.keys() and value is not None:
            super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __getitem__(self, key):
        return dict(self.items())[key] if isinstance(key, str) else self.to_tuple()[key]

    def to_tuple(self):
        return tuple(self[k] for k in self.keys())


@dataclasses.dataclass
class _ClassifierOutput(_OutputBase):
    loss: torch.Tensor = None
    logits: torch.Tensor = None
    hidden_states: tuple = None


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_model_output_that_is_a_dataclass_and_a_mapping_leaves_in_fp32_every_way_read(
        opt_level):
    """Fine-tuning scripts ported from Apex return transformers-style outputs (a dataclass that
    is also an OrderedDict) and read the logits as ``out.logits``, ``out["logits"]`` or
    ``out[0]``: all three must be the same fp32 tensor, the half logits upcast once, and the
    keys must stay those of the fields that were set (``loss`` absent in evaluation), or an
    argmax/metric in the script sees half values on one path and fp32 on another."""
    seen = {}

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            logits = self.lin(x)
            seen["logits"] = logits
            return _ClassifierOutput(logits=logits, hidden_states=(x, logits))

    torch.manual_seed(0)
    model = Head()
    amp.initialize(model, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    out = model(torch.randn(5, 4))
    assert type(out) is _ClassifierOutput and list(out.keys()) == ["logits", "hidden_states"]
    assert out.loss is None
    want = seen["logits"].float()
    for got in (out.logits, out["logits"], out[0], out.hidden_states[1]):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert out.logits is out["logits"]


class _ReducingOutputBase(_OutputBase):
    """_OutputBase with transformers' ``ModelOutput.__reduce__`` (pickling, copy.copy): the
    class is called again with every field's value, so ``__post_init__`` makes keys of them."""

    def __reduce__(self):
        fn, _args, *rest = super().__reduce__()
        return (fn, tuple(getattr(self, f.name) for f in dataclasses.fields(self)), *rest)


@dataclasses.dataclass
class _ReducingClassifierOutput(_ReducingOutputBase):
    loss: torch.Tensor = None
    logits: torch.Tensor = None


@pytest.mark.parametrize("output_class", [_ClassifierOutput, _ReducingClassifierOutput])
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_a_model_output_whose_loss_is_set_after_it_was_built_reads_as_in_fp32(
        opt_level, output_class):
    """A wrapper adding its loss to a backbone's transformers-style output (``out.loss = loss;
    return out``, a common fine-tuning pattern): ``loss`` was None when the output was built,
    so it is an attribute and not a key. Reference: the fp32 model, where the keys stay
    ``["logits"]`` and ``out[0]`` is the logits. amp's cast of the outputs must not make a key
    of it (``out[0]`` silently becoming the loss) and must leave it fp32 like the logits."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, y):
            out = output_class(logits=self.lin(x))
            out.loss = nn.functional.cross_entropy(out.logits, y)
            return out

    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    torch.manual_seed(0)
    ref = Wrapper()(x, y)
    torch.manual_seed(0)
    model = Wrapper()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level,
                   dtype=torch.bfloat16, verbosity=0)
    out = model(x, y)
    assert type(out) is output_class
    assert list(out.keys()) == list(ref.keys()) == ["logits"]
    assert out[0] is out.logits and out.logits.dtype == torch.float32
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref.loss, atol=0.05, rtol=0.05)


@dataclasses.dataclass
class _RequiredFieldOutput(_OutputBase):
    """A transformers-style output (a dataclass that is an OrderedDict) whose first field has
    no default: its class cannot be called without arguments."""
    logits: torch.Tensor
    aux: torch.Tensor = None


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_mapping_dataclass_output_with_a_required_field_keeps_its_type_and_attributes(
        opt_level):
    """r82A G1. amp's output cast rebuilds a dataclass-mapping output without calling its
    class (``__new__``); one built by calling the class with no arguments failed on a
    required field and fell back to a plain ``dict`` (``out.logits`` an AttributeError) or to
    a copy whose attribute kept the half tensor while its item was fp32. Reference: the fp32
    model's output, the same class, ``out.logits is out["logits"]``."""

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            logits = self.lin(x)
            return _RequiredFieldOutput(logits=logits, aux=logits.sum(1))

    x = torch.randn(5, 4)
    torch.manual_seed(0)
    ref = Head()(x)
    torch.manual_seed(0)
    model = Head()
    amp.initialize(model, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    out = model(x)
    assert type(out) is _RequiredFieldOutput
    assert list(out.keys()) == list(ref.keys()) == ["logits", "aux"]
    assert out.logits is out["logits"] and out.aux is out["aux"]
    for got, want in ((out.logits, ref.logits), (out.aux, ref.aux)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)  # (bf16 forward)


class _TokenBatch(collections.UserDict):
    """A tokenizer's batch (a ``UserDict`` with attributes of its own, like Hugging Face's)."""

    def __init__(self, data, n_sequences):
        super().__init__(data)
        self.n_sequences = n_sequences


class _CustomBatch:
    """A user's batch class with a ``to`` method that casts every tensor, labels included."""

    def __init__(self, image, label):
        self.image, self.label = image, label

    def to(self, what):
        return _CustomBatch(self.image.to(what), self.label.to(what))


class _Store(collections.abc.MutableMapping):
    """A mapping keeping its items in an inner dict (a shallow copy would share it)."""

    def __init__(self, data):
        self.data = dict(data)

    def __getitem__(self, key):
        return self.data[key]

    def __setitem__(self, key, value):
        self.data[key] = value

    def __delitem__(self, key):
        del self.data[key]

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)


def test_o2_casts_mappings_and_leaves_other_objects_alone():
    seen = {}

    class Spy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, feats, tokens, store, batch):
            seen.update(feats=feats, tokens=tokens, store=store, batch=batch)
            return self.lin(feats["x"]) + self.lin(store["x"])

    model = Spy()
    amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    feats = collections.defaultdict(list, x=torch.randn(3, 2))
    tokens = _TokenBatch({"ids": torch.arange(3), "scale": torch.ones(3)}, n_sequences=1)
    store = _Store({"x": torch.randn(3, 2)})
    batch = _CustomBatch(torch.randn(3, 2), torch.arange(3))
    out = model(feats, tokens, store, batch)
    assert out.dtype == torch.float32
    got = seen["feats"]
    assert type(got) is collections.defaultdict and got.default_factory is list
    assert got["x"].dtype == torch.bfloat16 and feats["x"].dtype == torch.float32
    got = seen["tokens"]
    assert type(got) is _TokenBatch and got.n_sequences == 1
    assert got["ids"].dtype == torch.int64 and got["scale"].dtype == torch.bfloat16
    assert tokens["scale"].dtype == torch.float32  # the caller's batch is left alone
    assert type(seen["store"]) is _Store and seen["store"]["x"].dtype == torch.bfloat16
    assert store["x"].dtype == torch.float32  # (a shallow copy would have cast it in place)
    # Other objects pass as they are: their .to() would cast the labels too (Apex called it;
    # flex attention's BlockMask, graph and tensordict batches cast their integer indices so).
    assert seen["batch"] is batch and batch.label.dtype == torch.int64


@dataclasses.dataclass
class _HeadConfig:
    """A dataclass used as a configuration class: the forward gets the class itself."""

    scale: float = 2.0
    bias: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(2))


def test_o2_passes_a_dataclass_class_given_as_an_input_as_it_is():
    """A dataclass *class* among the inputs (a head's config type, a factory) is an object
    like any other, not a batch: it reaches the forward as the same class, its defaults
    untouched, while a dataclass instance beside it is cast. Reference: the class object
    itself (identity) and the instance's field rounded to bf16. (N37)"""
    seen = {}
    model = _o2_input_spy(seen, lambda pair: pair[1].bias.expand(3, 2))
    model((_HeadConfig, _HeadConfig(bias=torch.randn(2))))
    cls, instance = seen["input"]
    assert cls is _HeadConfig and cls.scale == 2.0
    assert instance.bias.dtype == torch.bfloat16


class _NamedStore(collections.abc.Mapping):
    """A read-only mapping whose constructor needs more than the items (a name), so that
    amp cannot rebuild it as its own type."""

    def __init__(self, name, data):
        self.name, self._data = name, dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


def test_o2_casts_a_mapping_it_cannot_rebuild_into_a_plain_dict():
    """A mapping whose type cannot be built from its items alone reaches the forward as a
    plain ``dict`` of the same keys with the floating values cast, rather than failing the
    call: the forward reads it by key as before. The caller's mapping is left alone.
    Reference: the caller's values rounded to bf16. (N07)"""
    seen = {}
    store = _NamedStore("feats", {"x": torch.randn(3, 2), "ids": torch.arange(3)})
    out = _o2_input_spy(seen, lambda m: m["x"])(store)
    got = seen["input"]
    assert type(got) is dict and sorted(got) == ["ids", "x"]
    torch.testing.assert_close(got["x"], store["x"].bfloat16(), rtol=0, atol=0)
    assert got["ids"].dtype == torch.int64 and store["x"].dtype == torch.float32
    assert out.dtype == torch.float32


class _FillsContainers(nn.Module):
    """A forward that writes into containers its caller passed (a KV cache dict, a list of
    collected hidden states / aux losses, a dataclass cache), as fairseq's incremental_state
    or hand-written generation loops do."""

    @dataclasses.dataclass
    class Cache:
        k: torch.Tensor = None

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, cache_dict, cache_list, cache_dc):
        h = self.lin(x)
        cache_dict["k"] = h
        cache_list.append(h)
        cache_dc.k = h
        return h


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_containers_with_nothing_to_cast_reach_the_forward_as_the_callers_own(opt_level, dtype):
    # Reference: plain PyTorch (and torch.autocast, and O1) fill the caller's objects. A
    # container holding nothing that needs a cast (empty, or half tensors the model made, as a
    # KV cache at O2) must not be rebuilt on the way in, or the forward's writes are lost and
    # a generation loop silently runs without its cache (r79C B1).
    torch.manual_seed(0)
    model = _FillsContainers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, dtype=dtype, verbosity=0)
    d, lst, dc = {}, [], _FillsContainers.Cache()
    with torch.no_grad():
        model(torch.randn(2, 4), d, lst, dc)
    assert "k" in d and len(lst) == 1 and dc.k is not None, (d, lst, dc)
    # A second call with the cache now holding the model's own (already cast) tensors.
    d2 = {"old": d["k"]}
    with torch.no_grad():
        model(torch.randn(2, 4), d2, lst, dc)
    assert "k" in d2 and len(lst) == 2


_PairNT = collections.namedtuple("_PairNT", "a b")


@dataclasses.dataclass(frozen=True)
class _FrozenIds:
    ids: torch.Tensor


@dataclasses.dataclass
class _NestedBatch:
    parts: list


def test_o2_containers_of_every_kind_with_nothing_to_cast_are_the_callers_own():
    # Reference: plain PyTorch hands the forward the caller's objects. At O2 a container
    # holding only integer or already-half tensors must reach it as the caller's own object
    # along every path of cast_floating (non-dict mappings, tuples, namedtuples, frozen
    # dataclasses), and a container with something cast is copied with its untouched
    # sub-containers shared, the caller's tensors left fp32.
    seen = {}

    class Spy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, *args):
            seen["args"] = args
            return self.lin(torch.zeros(1, 2, dtype=self.lin.weight.dtype))

    model = Spy()
    amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    ids, h = torch.arange(3), torch.randn(2, 2).bfloat16()
    own = [
        ((h, h.clone()), (h.clone(), h.clone())),  # past_key_values: half tensors the model made
        _PairNT(ids, h),
        _TokenBatch({"ids": ids, "mask": ids > 0}, n_sequences=1),
        collections.defaultdict(list, ids=ids),
        collections.OrderedDict(ids=ids),
        types.MappingProxyType({"ids": ids}),
        _FrozenIds(ids),
    ]
    model(*own)
    for passed, got in zip(own, seen["args"]):
        assert got is passed, type(passed)
    inner = {"ids": ids}
    nested = _NestedBatch([{"x": torch.randn(2, 2)}, inner])
    model(nested)
    got = seen["args"][0]
    assert got is not nested and got.parts is not nested.parts
    assert got.parts[0]["x"].dtype == torch.bfloat16 and nested.parts[0]["x"].dtype == torch.float32
    assert got.parts[1] is inner  # (nothing cast in it: the caller's own, its writes kept)


class _BatchNT(collections.namedtuple("_BatchNT", ["x", "ids"])):
    """A namedtuple subclass that carries an attribute on the instance (no __slots__)."""


class _TaggedList(list):
    pass


def test_o2_keeps_the_attributes_of_a_namedtuple_or_list_subclass_it_casts():
    # r81A R1. A tuple or list subclass rebuilt because something in it was cast came back
    # without the attributes set on the caller's instance (its constructor takes the items
    # only): the forward's `batch.source` raised AttributeError at O2, not in fp32.
    # Reference: the caller's instance (attributes kept as they are, the tensors cast).
    seen = {}
    model = _o2_input_spy(seen, lambda arg: arg[0].x)
    batch = _BatchNT(torch.randn(3, 2), torch.arange(3))
    batch.source, batch.weights = "shard-7", torch.ones(3)
    parts = _TaggedList([torch.randn(2, 2)])
    parts.name = "aux"
    model((batch, parts))
    got, got_parts = seen["input"]
    assert type(got) is _BatchNT and got is not batch
    assert got.x.dtype == torch.bfloat16 and batch.x.dtype == torch.float32
    assert got.ids is batch.ids
    assert got.source == "shard-7" and got.weights is batch.weights
    assert type(got_parts) is _TaggedList and got_parts.name == "aux"
    assert got_parts[0].dtype == torch.bfloat16


class _SlottedList(list):
    __slots__ = ("source",)


def test_o2_keeps_the_slot_attributes_of_a_list_subclass_it_casts():
    """B4 (r83A). b1d4a16 kept the instance __dict__ of a rebuilt tuple/list subclass, not
    its __slots__: a slotted batch class (a list subclass with __slots__ = ("source",)) lost
    `source`, and the forward's `batch.source` raised AttributeError at O2, not in fp32.
    Reference: the caller's instance (fp32 / O0 run the same forward)."""
    seen = {}
    model = _o2_input_spy(seen, lambda batch: batch[0] * (2.0 if batch.source == "shard-7"
                                                           else 1.0))
    batch = _SlottedList([torch.randn(3, 2)])
    batch.source = "shard-7"
    out = model(batch)
    assert out.dtype == torch.float32
    assert type(seen["input"]) is _SlottedList and seen["input"].source == "shard-7"


def test_o2_namedtuple_and_list_subclass_inputs_compile_fullgraph():
    """G1 (r83A). Inputs that are a plain namedtuple, a namedtuple subclass and a list
    subclass, something in each cast, compile with fullgraph=True: b1d4a16's attribute copy,
    traced, branched on the namedtuple's __dict__ and broke the graph on PyTorch 2.11 (the
    GPU machine's; 2.13 traced it). Under compile the attributes set on a subclass instance
    are not carried to the cast copy (docs/amp.md). Reference: the eager forward (bit for bit),
    for the subclasses that of the same items without the attribute."""
    if torch.__version__ < (2, 5):
        pytest.skip("PyTorch 2.4's Dynamo does not trace namedtuple or list-subclass inputs "
                    "through amp's input cast under fullgraph (docs/amp.md)")

    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, batch):
            scale = getattr(batch, "scale", 1.0)
            return self.lin(batch[0]) * scale

    torch.manual_seed(0)
    model = Reads()
    amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    x, ids = torch.randn(3, 2), torch.arange(3)
    plain = _PairNT(x, ids)
    sub = _BatchNT(x, ids)
    sub.scale = 3.0
    tagged = _TaggedList([x, ids])
    tagged.scale = 5.0
    torch.testing.assert_close(compiled(plain), model(plain), rtol=0, atol=0)
    for given in (sub, tagged):
        torch.testing.assert_close(compiled(given), model(type(given)(
            *given) if hasattr(given, "_fields") else type(given)(given)), rtol=0, atol=0)
    assert not torch.equal(model(sub), model(plain))  # (eager keeps the attribute)


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_an_output_container_the_model_keeps_is_never_cast_in_place(opt_level):
    # Reference: the fp32 model returns its own cache dict. With nothing to cast in it amp
    # returns the model's object too; with half tensors in it (O2/O3's KV cache, O1's autocast
    # results) the caller gets an fp32 copy and the model's cache stays half, so the next
    # decoding step still concatenates half keys.
    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.cache = {"steps": torch.zeros((), dtype=torch.int64)}

        def forward(self, x, keep):
            if keep:
                self.cache["k"] = self.lin(x)
            self.cache["steps"] += 1
            return self.cache

    torch.manual_seed(0)
    model = Cached()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level,
                   dtype=torch.bfloat16, verbosity=0)
    out = model(torch.randn(2, 4), False)
    assert out is model.cache  # nothing to cast: the model's own, as in fp32
    out = model(torch.randn(2, 4), True)
    assert out is not model.cache and out["k"].dtype == torch.float32
    assert model.cache["k"].dtype == torch.bfloat16  # not cast in place
    torch.testing.assert_close(out["k"], model.cache["k"].float(), rtol=0, atol=0)
    assert out["steps"] is model.cache["steps"] and int(model.cache["steps"]) == 2


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_a_tensor_given_twice_is_cast_once(dtype):
    # One fp32 tensor passed as two inputs (self-attention's query and key/value, a dict
    # holding it twice) reaches the forward as one half tensor, as fp32's forward sees one
    # object (multi_head_attention_forward's packed projection branches on `q is k is v`),
    # not two copies; the output's fields that are one tensor stay one.
    seen = {}

    class Attend(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, q, kv, extra):
            seen["same"] = q is kv is extra["x"]
            h = self.lin(q)
            return {"a": h, "b": h}

    model = Attend()
    amp.initialize(model, opt_level="O2", dtype=dtype, verbosity=0)
    x = torch.randn(2, 4)
    out = model(x, x, {"x": x})
    assert seen["same"]
    assert out["a"] is out["b"] and out["a"].dtype == torch.float32


class _KVDecoder(nn.Module):
    """Tied embedding/head, one causal self-attention layer with a KV cache dict per call."""

    def __init__(self, vocab=16, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx, cache=None):
        b, t, d = idx.shape[0], idx.shape[1], self.embed.embedding_dim
        x = self.embed(idx)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        return self.head(x + self.proj(a.transpose(1, 2).reshape(b, t, d)))


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_kv_cache_generation_matches_the_full_forward(opt_level, ctx):
    # Greedy decoding with a KV cache dict in eval mode: each step's logits equal the
    # full-sequence forward's at that position (reference: the same model without a cache),
    # within bf16 rounding of the different accumulation order.
    torch.manual_seed(0)
    model = _KVDecoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    model.eval()
    prompt = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(1))
    with ctx():
        cache = {}
        out = model(prompt, cache)
        toks, logits = [out[:, -1].argmax(-1)], [out[:, -1]]
        for _ in range(5):
            out = model(toks[-1][:, None], cache)
            toks.append(out[:, -1].argmax(-1))
            logits.append(out[:, -1])
        full = model(torch.cat([prompt, torch.stack(toks[:-1], 1)], 1))[:, prompt.shape[1] - 1:]
    assert cache["k"].shape[2] == prompt.shape[1] + 5
    torch.testing.assert_close(torch.stack(logits, 1), full, atol=0.05, rtol=0.05)


# -- sparse gradients -----------------------------------------------------------------------------
class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.lin = nn.Linear(8, 1)

    def forward(self, idx):
        # (/ 64: no fp16 overflow at the initial 2**16 scale, so the first step is taken)
        return self.lin(self.emb(idx)).float().mean() / 64


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_sparse_gradients_under_dynamic_scaling(opt_level, dtype):
    torch.manual_seed(0)
    model, reference = _Bag(), _Bag()
    reference.load_state_dict(model.state_dict())
    idx = torch.tensor([[1, 2, 2, 7], [7, 7, 3, 1]])  # duplicate indices: uncoalesced grads
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, dtype=dtype, loss_scale="dynamic",
                   verbosity=0)
    with amp.scale_loss(model(idx), opt) as scaled:
        scaled.backward()
    reference(idx).backward()
    grad = next(p for p in amp.master_params(opt) if p.shape == (50, 8)).grad
    assert grad.is_sparse
    expected = reference.emb.weight.grad.to_dense()
    # O0 is fp32 throughout: exact. Elsewhere the gradient flows through half layers (one
    # rounding of ~2**-8 relative in bf16, less in fp16, per op).
    rtol, atol = (0, 0) if opt_level == "O0" else (2e-2, 1e-7)
    torch.testing.assert_close(grad.to_dense().float(), expected, rtol=rtol, atol=atol)
    if not (opt_level == "O3" and dtype == torch.float16):  # (no fp16 sparse add in CPU SGD)
        opt.step()
        assert not amp.step_was_skipped(opt)
    opt.zero_grad()
    # An inf in the sparse gradient skips the step, and the scale backs off.
    before = amp.state_dict()["loss_scaler0"]["loss_scale"]
    weights = model.emb.weight.detach().clone()
    with amp.scale_loss(model(idx) * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.step_was_skipped(opt)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == before / 2
    torch.testing.assert_close(model.emb.weight.detach(), weights, rtol=0, atol=0)


# -- DataParallel ---------------------------------------------------------------------------------
def test_data_parallel_around_o2_model(device):
    if device.type == "cpu" and torch.cuda.is_available():
        pytest.skip("DataParallel requires the module on GPU 0 when CUDA is visible")
    def run(wrap):
        model = make_cnn(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        # (One device: two GPUs' replicas would each see half the batch in BatchNorm.)
        ids = [0] if device.type == "cuda" else None
        net = nn.DataParallel(model, device_ids=ids) if wrap else model
        x, y = batch(device, n=8)
        losses = torch.stack([train_step(net, opt, x, y, amp) for _ in range(3)])
        assert net(x).dtype == torch.float32
        return losses, [m.detach().clone() for m in amp.master_params(opt)]

    # The same as the model alone (one device: DataParallel calls the module itself).
    (losses, masters), (ref_losses, ref_masters) = run(True), run(False)
    assert torch.isfinite(losses).all()
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0)
    for mine, ref in zip(masters, ref_masters):
        torch.testing.assert_close(mine, ref, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="requires 2 GPUs")
def test_data_parallel_replicas_on_two_gpus():
    model = make_cnn("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    dp = nn.DataParallel(model, device_ids=[0, 1])
    x, y = batch("cuda", n=8)
    ref = copy.deepcopy(model)
    # eval: in train mode each replica's BatchNorm would use its own half of the batch
    dp.eval()
    ref.eval()
    torch.testing.assert_close(dp(x), ref(x), rtol=1e-2, atol=1e-2)
    dp.train()
    assert torch.isfinite(train_step(dp, opt, x, y, amp))


# -- schedulers -------------------------------------------------------------------------------------
def test_scheduler_recipe_with_step_was_skipped():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic",
                   verbosity=0)
    x, y = batch()
    for overflow in (False, True, False):
        opt.zero_grad()
        with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as s:
            (s * (float("inf") if overflow else 1.0)).backward()
        opt.step()
        if not amp.step_was_skipped(opt):
            sched.step()
    assert opt.param_groups[0]["lr"] == 0.25  # two real steps


class _CountingSGD(torch.optim.SGD):
    """XLM-style: the optimizer's own step keeps an update count (and sets the rate from it)."""

    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            group["num_updates"] = group.get("num_updates", 0) + 1
        return loss


@pytest.mark.parametrize("scheduler_first", [True, False])
@pytest.mark.parametrize("make", ["counting", "wrapper"])
def test_an_overflowed_step_skips_the_whole_step(make, scheduler_first, recwarn):
    # Apex replaced step() for the overflowed step, so nothing of the user's step ran. Before,
    # amp only dropped the gradients: a counter in step() counted skipped steps, and a
    # Lookahead-style wrapper pulled the weights back on one. An LR scheduler built before or
    # after initialize keeps working, without PyTorch's warnings about step() being replaced.
    model = make_cnn()
    if make == "counting":
        opt = _CountingSGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = _SlowFastWrapper(torch.optim.SGD(model.parameters(), lr=0.1), k=1)
    if scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(opt.inner if make == "wrapper" else opt, 1, 0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    if not scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(opt.inner if make == "wrapper" else opt, 1, 0.5)
    x, y = batch()
    for poison in (True, False, True, False, False):
        before = [m.detach().clone() for m in amp.master_params(opt)]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss * (float("inf") if poison else 1.0), opt) as scaled:
            scaled.backward()
        opt.step()
        assert amp.step_was_skipped(opt) is poison
        unchanged = all(torch.equal(b, m) for b, m in zip(before, amp.master_params(opt)))
        assert unchanged is poison
        if not amp.step_was_skipped(opt):
            sched.step()
    if make == "counting":
        assert opt.param_groups[0]["num_updates"] == 3
    else:
        assert opt.steps == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / 8)
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)], \
        [str(w.message) for w in recwarn]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_one_cycle_with_skipped_steps_follows_gradscaler_and_resumes(opt_level, order):
    """G3 (r82C). A GradScaler script's loop ported as is (the scheduler stepped every
    iteration, skipped steps included), fp16 with dynamic scaling, OneCycleLR built before or
    after initialize, overflows at steps 0 and 3: the learning rates are autocast +
    GradScaler's and so are the weights (bit for bit at O1; O2 within fp16 rounding, far
    below one update), and a checkpoint of model, optimizer, scheduler and amp taken right
    after the second skip resumes bit for bit. (GradScaler warns "lr_scheduler.step() before
    optimizer.step()" on the skipped first step; amp, by design, does not.)"""
    def build(use_amp):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def make(opt=opt):
            return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)

        sched = make() if order == "before" else None
        if use_amp:
            amp.initialize(model, opt, opt_level=opt_level, dtype=torch.float16,
                           loss_scale="dynamic", verbosity=0)
        sched = sched or make()
        return model, opt, sched, None if use_amp else torch.amp.GradScaler("cpu")

    def run(use_amp, start=0, saved=None):
        model, opt, sched, scaler = build(use_amp)
        if saved is not None:
            saved = copy.deepcopy(saved)  # (Optimizer.load_state_dict keeps the tensors)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
            amp.load_state_dict(saved["amp"])
        lrs, ckpt = [], None
        for i in range(start, 8):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            poison = float("inf") if i in (0, 3) else 1.0
            if use_amp:
                loss = nn.functional.cross_entropy(model(x), y) * poison
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
                assert amp.step_was_skipped(opt) is (i in (0, 3))
            else:
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                scaler.scale(nn.functional.cross_entropy(out.float(), y) * poison).backward()
                scaler.step(opt)
                scaler.update()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
            if use_amp and i == 3:
                ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                                      "sched": sched.state_dict(), "amp": amp.state_dict()})
        weights = [p.detach().float().clone() for p in
                   (amp.master_params(opt) if use_amp else model.parameters())]
        return lrs, weights, ckpt

    import warnings as _w
    with _w.catch_warnings():
        _w.simplefilter("ignore")  # (GradScaler's warning about the skipped first step)
        want_lrs, want, _ = run(False)
    got_lrs, got, ckpt = run(True)
    assert got_lrs == want_lrs
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0 if opt_level == "O1" else 1e-3)
    resumed_lrs, resumed, _ = run(True, start=4, saved=ckpt)
    assert resumed_lrs == got_lrs[4:]
    for r, g in zip(resumed, got):
        assert torch.equal(r, g)


def test_a_step_replaced_on_the_instance_before_initialize_still_runs():
    """A ``step`` that user code put on the optimizer object before ``amp.initialize`` (a
    plain function wrapping the bound one: logging, a step counter, a clipping pass) keeps
    running at every step amp lets through, and the update still happens, because amp's own
    step sits above whatever the object had and calls it (C11)."""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    original, calls = opt.step, []

    def counted_step(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    opt.step = counted_step
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x, y = batch()
    for _ in range(2):
        before = [m.detach().clone() for m in amp.master_params(opt)]
        train_step(model, opt, x, y, amp)
        assert not amp.step_was_skipped(opt)
        assert not all(torch.equal(b, m) for b, m in zip(before, amp.master_params(opt)))
    assert len(calls) == 2


@pytest.mark.parametrize("make", ["sgd", "wrapper", "larc"])
def test_amps_step_keeps_no_reference_to_its_optimizer(make):
    # amp's step on the optimizer object must not hold the optimizer: a sweep that drops its
    # models and optimizers frees them (fp32 masters, moments) at once, not at the next full
    # garbage collection; a deep copy's step steps the copy.
    import gc
    import weakref

    from mixprec.parallel import LARC

    def build():
        model = make_cnn()
        if make == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        elif make == "wrapper":
            opt = _SlowFastWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
        else:
            opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1))
        inner = {"sgd": opt, "wrapper": getattr(opt, "inner", None),
                 "larc": getattr(opt, "optim", None)}[make]
        torch.optim.lr_scheduler.StepLR(inner, 1)
        return amp.initialize(model, opt, opt_level="O2", verbosity=0)

    build()  # (a process's first optimizer is kept by PyTorch's own first-call caches)
    gc.collect()
    gc.disable()
    try:
        model, opt = build()
        train_step(model, opt, *batch(), amp)
        ref = weakref.ref(opt)
        del model, opt
        assert ref() is None, gc.get_referrers(ref())
    finally:
        gc.enable()
    if make == "larc":  # (torch optimizers deep-copy without their instance attributes)
        model, opt = build()
        x, y = batch()
        twin = copy.deepcopy(opt)
        assert twin.step.__self__ is twin
        before = [p.detach().clone() for p in amp.master_params(opt)]
        for p in (p for g in twin.param_groups for p in g["params"]):
            p.grad = torch.ones_like(p)
        twin.step()
        assert all(torch.equal(b, p) for b, p in zip(before, amp.master_params(opt)))
        assert not all(torch.equal(b, p) for b, p in zip(
            before, (p for g in twin.param_groups for p in g["params"])))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_overflowed_backward_leaves_its_gradients_for_the_norm(opt_level):
    # Tacotron2-style loops take the gradient norm before step() to spot an overflow
    # (`is_overflow = math.isnan(grad_norm)`) and log it: the gradients stay, non-finite, until
    # the skipped step frees them, as in Apex. They were freed at once (the norm read 0).
    import math

    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    x, y = batch()
    loss = nn.functional.cross_entropy(model(x), y) * float("nan")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
    assert math.isnan(float(norm))
    before = [p.detach().clone() for p in amp.master_params(opt)]
    opt.step()
    assert amp.step_was_skipped(opt)
    assert all(p.grad is None for p in amp.master_params(opt))
    assert all(torch.equal(b, p) for b, p in zip(before, amp.master_params(opt)))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_backward_with_create_graph(opt_level):
    # timm's second-order path: scaled_loss.backward(create_graph=True). O1 keeps the model's
    # own gradients with their graph; at O2 the fp32 master gradients are copies without one,
    # so the Hessian term dropped out silently: refused now, as Apex failed there too.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, loss_scale=1.0, verbosity=0)
    x, y = batch()
    loss = nn.functional.cross_entropy(model(x), y)
    if opt_level == "O2":
        with pytest.raises(RuntimeError, match="create_graph=True.*opt_level='O1'"):
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward(create_graph=True)
        return
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward(create_graph=True)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.requires_grad for g in grads)
    # The gradient-norm penalty differentiates through them (a second derivative exists).
    penalty = sum(g.float().pow(2).sum() for g in grads)
    second = torch.autograd.grad(penalty, model.head.weight)[0]
    assert torch.isfinite(second).all() and second.abs().sum() > 0
    model.zero_grad()  # (breaks the parameter <-> gradient cycle create_graph makes)


def _penalty_second_derivative(model, x, y, backward):
    """d(sum of the squared parameter gradients)/d(first layer's weight), the gradients taken
    with create_graph=True by ``backward(loss)``."""
    backward(nn.functional.mse_loss(model(x).to(y.dtype), y))
    penalty = sum(p.grad.float().pow(2).sum() for p in model.parameters())
    second = torch.autograd.grad(penalty, model[0].weight)[0]
    model.zero_grad()
    return second


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("opt_level,loss_scale", [
    ("O1", None), ("O1", 1024.0), ("O3", "dynamic")])
@pytest.mark.parametrize("fused", [False, True])
def test_create_graph_second_derivative_is_unscaled(opt_level, loss_scale, fused):
    # The gradients' graph gives the unscaled gradient's derivative: the unscale is recorded
    # by autograd (the fused unscale-and-check kernel of dynamic scaling was not: a gradient
    # penalty's second derivative came out 65536x too large).
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    torch.manual_seed(1)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    want = _penalty_second_derivative(
        make().double(), x.double(), y.double(), lambda loss: loss.backward(create_graph=True))
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    kw = {} if loss_scale is None else {"loss_scale": loss_scale}
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.float16,
                                verbosity=0, **kw)

    def backward_with_graph(loss):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward(create_graph=True)

    got = _penalty_second_derivative(model, x, y, backward_with_graph)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == (1024.0 if loss_scale == 1024.0 else 65536.0)
    # fp16 forward: within 2% of the float64 derivative (the bug was a factor of the scale)
    assert (got.double() - want).norm() <= 0.02 * want.norm()


@pytest.mark.parametrize("call", ["step()", "step(None)", "step(closure=None)"])
def test_an_overflowed_step_is_skipped_however_it_is_called(call):
    model = make_cnn()
    opt = _CountingSGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = batch()
    loss = nn.functional.cross_entropy(model(x), y) * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    {"step()": lambda: opt.step(), "step(None)": lambda: opt.step(None),
     "step(closure=None)": lambda: opt.step(closure=None)}[call]()
    assert amp.step_was_skipped(opt)
    assert "num_updates" not in opt.param_groups[0]  # the user's step never ran


# -- torch.compile and activation checkpointing -----------------------------------------------------
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_torch_compile_fullgraph_matches_eager(opt_level, device):
    eager = make_cnn(device)
    compiled_src = copy.deepcopy(eager)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled_src.parameters(), lr=0.1)
    kw = dict(opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    amp.initialize(eager, opt_e, **kw)
    amp.initialize(compiled_src, opt_c, **kw)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(compiled_src, fullgraph=True, backend=backend)
    x, y = batch(device)
    for _ in range(3):
        le = train_step(eager, opt_e, x, y, amp)
        lc = train_step(compiled, opt_c, x, y, amp)
        torch.testing.assert_close(lc.float(), le.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(eager.state_dict().values(), compiled_src.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_a_compiled_amp_model_does_not_recompile_for_each_new_input(opt_level):
    # OPTIONAL (r82A): mutant C20 is also killed, indirectly, by test_scale_loss.py::
    # test_a_compiled_training_step_does_not_recompile_as_the_dynamic_scale_moves.
    """r82A G5. amp's input/output casts keep a per-call memo (a tensor found twice is cast
    once) only in eager mode: traced, Dynamo guards on each id() the memo reads, and the
    compiled forward recompiled for every new input tensor (4 frames for 4 batches, then
    Dynamo's recompile limit and eager). Reference: one frame for the four batches, as for a
    plain compiled model; outputs equal to the eager amp model's."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level,
                   dtype=torch.bfloat16, verbosity=0)
    torch._dynamo.reset()
    try:
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        with torch.no_grad():
            for seed in range(4):
                x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
                torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
        assert counter.frame_count == 1
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_torch_compile_fullgraph_keeps_the_forwards_writes_into_the_callers_containers(
        opt_level):
    # Reference: the same amp model run eagerly. A compiled forward (fullgraph) that writes
    # into the dict, dataclass and list its caller passed (nothing in them to cast) must make
    # the same writes reach the caller, with the same values.
    @dataclasses.dataclass
    class Cache:
        store: dict = dataclasses.field(default_factory=dict)

    class Writer(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.lin = nn.Linear(4, 4)

        def forward(self, batch, cache, aux):
            h = self.lin(self.emb(batch["ids"]))
            batch["h"] = h
            cache.store["k"] = h
            aux.append(h.float().pow(2).mean())
            return h

    torch.manual_seed(0)
    model = Writer()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level,
                   dtype=torch.bfloat16, verbosity=0)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    ids = torch.tensor([1, 2, 3])
    got = []
    for fn in (model, compiled):
        batch, cache, aux = {"ids": ids}, Cache(), []
        try:
            out = fn(batch, cache, aux)
        except torch._dynamo.exc.Unsupported as err:
            if "is_dataclass" not in str(err):
                raise
            # (PyTorch 2.4's Dynamo does not trace dataclasses.is_dataclass, which amp's input
            # cast asks of a dataclass input at O2: docs/amp.md.)
            pytest.skip("this PyTorch's Dynamo cannot trace dataclasses.is_dataclass")
        assert set(batch) == {"ids", "h"} and set(cache.store) == {"k"} and len(aux) == 1
        got.append((out, batch["h"], cache.store["k"], aux[0]))
    for eager, comp in zip(*got):
        assert eager.dtype == comp.dtype
        torch.testing.assert_close(comp, eager, rtol=0, atol=0)


class Checkpointed(nn.Module):
    def __init__(self, use_checkpoint):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.block = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        if self.use_checkpoint:
            return self.head(checkpoint(self.block, x, use_reentrant=False))
        return self.head(self.block(x))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_activation_checkpointing_matches_plain_forward(opt_level, dtype, device):
    grads = []
    x = torch.randn(4, 8, device=device)
    for use_checkpoint in (True, False):
        torch.manual_seed(0)
        model = Checkpointed(use_checkpoint).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, opt, opt_level=opt_level, dtype=dtype, verbosity=0)
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as s:
            s.backward()
        grads.append([p.grad for p in amp.master_params(opt)])
    # The recomputation runs under the same autocast state, so the results are identical.
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- stale gradients, model.zero_grad, LARC reading the masters (found by mutation testing) ------
def test_o3_cast_drops_a_gradient_left_from_before_initialize():
    # A backward on the fp32 model before initialize (a warm-up, a sanity check) leaves fp32
    # gradients, stale and of the wrong dtype once the model is half: the first amp backward
    # gives exactly its loss's gradient, not a sum. Reference: float64 (fp16 backward: 1e-2).
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(8, 4)
    model(x).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O3", verbosity=0)
    w = model.weight.detach().double().requires_grad_(True)
    (x.double() @ w.T + model.bias.detach().double()).pow(2).mean().backward()
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    assert model.weight.grad.dtype == torch.float16
    torch.testing.assert_close(model.weight.grad.double(), w.grad, rtol=1e-2, atol=1e-2)


def test_o2_model_zero_grad_clears_the_masters_gradients():
    # model.zero_grad() between a backward and the step (a discarded micro-batch, a GAN's
    # netD.zero_grad()) drops what the masters' gradients hold, as for an fp32 model.
    # Reference: the fp32 run (fp16 backward: gradients 1e-2 / 1e-3, weights 1e-3).
    model = make_conv_net()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    torch.manual_seed(1)
    x1, x2, y = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8), torch.randn(4, 2)
    for x in (x1, x2):
        model.zero_grad()
        ref.zero_grad()
        with amp.scale_loss((model(x) - y).pow(2).mean(), opt) as scaled:
            scaled.backward()
        (ref(x) - y).pow(2).mean().backward()
    for master, p in zip(amp.master_params(opt), ref.parameters()):
        assert master.grad is not None
        torch.testing.assert_close(master.grad, p.grad, rtol=1e-2, atol=1e-3)
    opt.step()
    ref_opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=1e-3)
    # With no argument (set_to_none=True, nn.Module's default) every gradient is freed, the
    # half parameters' and the masters' alike, as the fp32 model's are: an optimizer then
    # skips a parameter a later step leaves unused. (M11)
    with amp.scale_loss((model(x1) - y).pow(2).mean(), opt) as scaled:
        scaled.backward()
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for m in amp.master_params(opt))


def test_o2_larc_trust_ratio_sees_a_write_into_the_half_model():
    # LARC reads the masters (their norm, the trust ratio) before its inner optimizer's step
    # hooks run: a write into the half model since amp last set it (nn.init, a DDP broadcast)
    # reaches the masters first. Reference: the fp32 LARC run; x4 is exact in fp16.
    from mixprec.parallel import LARC

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    ref = copy.deepcopy(model)
    opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = LARC(torch.optim.SGD(ref.parameters(), lr=0.1))
    amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    for m in (model, ref):
        with torch.no_grad():
            m.weight.mul_(4.0)
    with amp.scale_loss((model(x) - y).pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    (ref(x) - y).pow(2).mean().backward()
    ref_opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-3, atol=1e-4)


# -- failed micro-batches, restored parts, half losses, sparse overflow, LARC (mutation testing) --
def _o2_mlp_run(fail_last: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", loss_scale=512.0, verbosity=0)
    with amp.scale_loss(nn.functional.cross_entropy(model(x[:4]).float(), y[:4]), opt) as s:
        s.backward()
    if fail_last:
        hidden = FailingBackward.apply(model[1](model[0](x[4:].half())))
        loss = nn.functional.cross_entropy(model[2](hidden).float(), y[4:])
        try:
            with amp.scale_loss(loss, opt) as s:
                s.backward()  # the last layer's gradients are written, then the backward fails
        except RuntimeError as e:
            assert "simulated" in str(e)
        else:
            raise AssertionError("the backward did not fail")
    opt.step()
    return [m.detach().clone() for m in amp.master_params(opt)]


def test_o2_step_after_a_failed_last_micro_batch_steps_the_earlier_gradients():
    # Accumulation whose last micro-batch's backward raised (caught, fairseq-style, to skip
    # it), then step(): the step uses the earlier micro-batches' gradients, as in fp32 torch;
    # the failed backward's partial half gradients are dropped, not an error. Reference: the
    # same run without the failed micro-batch, whose masters must come out exactly equal.
    expected = _o2_mlp_run(fail_last=False)
    got = _o2_mlp_run(fail_last=True)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_restored_o2_model_reinitialized_at_o1_does_not_hold_its_parts():
    # restore_model undoes an O2 initialize, and the model, cast back with .float() and
    # initialized again at O1, casts nothing to half: a part of it initialized on its own
    # is accepted, as a part of any O1 model is (only parts of half models are refused).
    model = make_mlp()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                   verbosity=0)
    amp.restore_model(model)
    model.float()
    amp.initialize(model, opt_level="O1", verbosity=0)
    part = model[2]
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    amp.initialize(part, opt, opt_level="O2", verbosity=0)
    assert part.weight.dtype == torch.float16
    fresh = make_mlp(seed=1)  # the same check, fresh
    amp.initialize(fresh, opt_level="O1", verbosity=0)
    amp.initialize(fresh[2], torch.optim.SGD(fresh[2].parameters(), lr=0.1), opt_level="O2",
                   verbosity=0)
    assert fresh[2].weight.dtype == torch.float16


def test_scale_loss_yields_an_fp32_scaled_loss_for_a_half_loss():
    # As Apex (``loss.float() * loss_scale``): a loss computed in half (a model's half output,
    # cast_model_outputs=torch.float16) is scaled in fp32, so the yielded tensor is fp32 and
    # exact (an fp16 loss of 2.0 times the 2**16 starting scale is 131072, past fp16's
    # largest finite value); at a static scale of 1.0 it is the loss upcast, whose gradient
    # reaches the model unchanged.
    for loss_scale, scale in (("dynamic", 2.0**16), (1.0, 1.0)):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, opt, opt_level="O3", loss_scale=loss_scale,
                       cast_model_outputs=torch.float16, verbosity=0)
        with torch.no_grad():
            model.weight.zero_()
            model.bias.fill_(2.0)
        loss = model(torch.randn(3, 4)).mean()  # fp16, exactly 2.0
        assert loss.dtype == torch.float16
        with amp.scale_loss(loss, opt) as s:
            assert s.dtype == torch.float32
            torch.testing.assert_close(s, torch.tensor(2.0 * scale), rtol=0, atol=0)
            s.backward()
        if scale == 1.0:
            torch.testing.assert_close(model.bias.grad, torch.ones(1, dtype=torch.float16),
                                       rtol=0, atol=0)


def _o3_embedding_overflow(sparse):
    torch.manual_seed(0)
    emb = nn.Embedding(4, 2, sparse=sparse)
    opt = torch.optim.SGD(emb.parameters(), lr=1e-6)
    amp.initialize(emb, opt, opt_level="O3", loss_scale="dynamic", verbosity=0)
    with pytest.warns(UserWarning, match="becomes this fp16 run's dynamic scale"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})
    before = emb.weight.detach().clone()
    idx = torch.ones(100, dtype=torch.long)  # one row, looked up 100 times
    with amp.scale_loss(emb(idx).float().sum() * 1000.0, opt) as s:
        s.backward()  # the row's gradient: 100 * 1000, past fp16's largest finite value
    opt.step()
    return amp.step_was_skipped(opt), torch.equal(emb.weight, before), amp.state_dict()


def test_o3_sparse_embedding_gradient_whose_sum_overflows_skips_like_a_dense_one():
    # The overflow check of a sparse fp16 gradient sees its duplicate indices summed, as the
    # optimizer will use them (and as a dense embedding's gradient holds them): a row whose
    # summed gradient is inf in fp16 skips the step and halves the scale, as the dense
    # embedding does. Reference: the same run with sparse=False.
    dense = _o3_embedding_overflow(sparse=False)
    assert dense == (True, True, {"loss_scaler0": {"loss_scale": 0.5, "unskipped": 0}})
    assert _o3_embedding_overflow(sparse=True) == dense


def test_o2_larc_inner_optimizer_is_the_same_amp_optimizer():
    # amp.initialize(model, LARC(SGD)): the inner optimizer (larc.optim, the one LR schedulers
    # are given) stands for the same amp optimizer: step_was_skipped and scale_loss accept it,
    # and a backward through it reaches the masters as through the wrapper. Reference: the
    # float64 gradients of the same loss (tolerance for the fp16 forward).
    from mixprec.parallel import LARC

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ref = copy.deepcopy(model).double()
    larc = LARC(torch.optim.SGD(model.parameters(), lr=0.1))
    model, larc = amp.initialize(model, larc, opt_level="O2", loss_scale=128.0, verbosity=0)
    x = torch.randn(3, 4)
    with amp.scale_loss(model(x).float().sum() * float("inf"), larc) as s:
        s.backward()
    assert amp.step_was_skipped(larc.optim) is False  # (static scale: never skipped)
    larc.optim.zero_grad()
    for m in amp.master_params(larc):
        m.grad = None
    with amp.scale_loss(model(x).float().sum(), larc.optim) as s:
        s.backward()
    ref(x.double()).sum().backward()
    for m, r in zip(amp.master_params(larc), ref.parameters()):
        torch.testing.assert_close(m.grad.double(), r.grad, rtol=1e-3, atol=1e-3)


def test_accumulation_under_ddp_gradient_as_bucket_view_sums_the_micro_batches(tmp_path):
    # Two micro-batches without delay_unscale under torch DDP(gradient_as_bucket_view=True)
    # (world size 1, gloo, CPU), O1 with dynamic scaling: the first micro-batch's unscaled
    # gradients, set aside during the second backward, live in DDP's bucket, which that
    # backward writes again. The result must be the sum of both (float64 reference).
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        ref = copy.deepcopy(model).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O1", patch_torch_functions=False,
                                    verbosity=0)
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        x = torch.randn(8, 4)
        for xb in (x[:4], x[4:]):
            with amp.scale_loss(ddp(xb).float().pow(2).sum(), opt) as s:
                s.backward()
            ref(xb.double()).pow(2).sum().backward()
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.double(), r.grad, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_registered_function_finds_a_tensor_after_a_list_without_one():
    # The device comes from the first tensor among the arguments, even when a list or tuple
    # holding no tensor (sizes, indices) comes before it.
    probe = amp.half_function(lambda sizes, x: x.dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert probe([2, 3], torch.randn(2)) == torch.bfloat16
        assert probe((), torch.randn(2)) == torch.bfloat16
    assert probe([2, 3], torch.randn(2)) == torch.float32


@dataclasses.dataclass
class _KVCache:
    k: torch.Tensor

    @amp.half_function
    def append(self, x):
        self.k = torch.cat([self.k, x.float()])
        return x.dtype


def test_a_function_with_a_rule_writes_into_its_callers_objects():
    # Arguments were cast as the model's inputs are, dataclasses entered and every container
    # copied: a half_function method of a dataclass (a KV cache) got a copy as self and its
    # write was lost, and an output list or dict the function filled stayed empty, only under
    # autocast. Now a dataclass (self among them) is passed as it is, as Apex passed any object
    # that was not a tensor, list or tuple, and a container is copied only to cast something in it.
    cache = _KVCache(torch.zeros(1, 4))
    sink, store = [], {}

    @amp.half_function
    def collect(x, out: list, results: dict, pair=None):
        out.append(x)
        results["last"] = x
        return [t.dtype for t in pair] if pair is not None else None

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cache.append(torch.randn(2, 4)) == torch.bfloat16
        assert collect(torch.randn(2), sink, store) is None
        mixed = [torch.randn(2), torch.randn(2, dtype=torch.bfloat16)]
        assert collect(torch.randn(2), sink, store, pair=mixed) == [torch.bfloat16] * 2
    assert cache.k.shape == (3, 4) and cache.k.dtype == torch.float32
    assert [t.dtype for t in sink] == [torch.bfloat16] * 2 and store["last"] is sink[-1]
    assert mixed[0].dtype == torch.float32  # (the list with something to cast was a copy)


def test_promote_function_without_floating_arguments_runs_under_autocast():
    # No floating tensor to promote (integer indices only): the function runs as it is,
    # with autocast still on inside it, as an unregistered function would.
    weight = torch.randn(4, 3)

    @amp.promote_function
    def lookup(idx):
        return idx.dtype, torch.mm(weight[idx], weight.t()).dtype

    idx = torch.tensor([0, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lookup(idx) == (torch.int64, torch.bfloat16)
    assert lookup(idx) == (torch.int64, torch.float32)


def test_promote_function_promotes_keyword_arguments():
    a = torch.randn(2)
    b = torch.randn(2, dtype=torch.bfloat16)
    promoted = amp.promote_function(_probe)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert promoted(x=b, y=a) == (torch.float32, torch.float32)
        assert promoted(b, y=a) == (torch.float32, torch.float32)
    assert promoted(x=b, y=a) == (torch.bfloat16, torch.float32)  # outside autocast: as is


def test_promote_function_takes_the_widest_dtype_wherever_it_stands():
    # The widest floating dtype among all the arguments, not the first argument's.
    a = torch.randn(2)
    b = torch.randn(2, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert amp.promote_function(_probe)(b, a) == (torch.float32, torch.float32)
        assert amp.promote_function(_probe)(a, b) == (torch.float32, torch.float32)


def test_registering_a_non_function_is_refused():
    ns = type("NS", (), {})()
    ns.table = {"a": 1}
    with pytest.raises(TypeError, match="'table' is a dict, not a function"):
        amp.register_half_function(ns, "table")
    assert ns.table == {"a": 1}  # left as it was


def test_disable_casts_inside_the_users_own_autocast_block():
    # disable_casts turns off the user's own torch.autocast too (the CPU one here), and the
    # autocast block casts again after it.
    a = torch.randn(3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(a, a).dtype == torch.bfloat16
        with amp.disable_casts():
            assert torch.mm(a, a).dtype == torch.float32
        assert torch.mm(a, a).dtype == torch.bfloat16


def test_register_function_with_a_non_string_name_is_refused_clearly():
    # Passing the function itself instead of its name: Apex's API takes the name as a string.
    ns = type("NS", (), {})()
    ns.half_fn = _probe
    with pytest.raises(AttributeError, match="function's name as a string"):
        amp.register_half_function(ns, _probe)
    assert ns.half_fn is _probe


# -- mutation run r50A over mixprec/amp/_model.py: what the tests above let through --------

_Pair = collections.namedtuple("_Pair", "half double")


class _MixedOutputs(nn.Module):
    """Returns a linear layer's output (half under O1's autocast) next to a float64 tensor, in
    every container amp's output cast walks."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h, d = self.lin(x), x.double().sum(1)
        return {"tuple": (h, d), "list": [h, d], "namedtuple": _Pair(h, d),
                "ordered": collections.OrderedDict(half=h, double=d)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_o1_output_cast_leaves_float64_alone_in_every_container(dtype):
    # O1 casts only autocast's half results to fp32 (half_outputs_to_fp32): a float64 output
    # stays float64 wherever it sits, not only at the top of a dict. (Mutants CF11, CF12,
    # CF13: the recursion into namedtuples / lists and tuples / other mappings forgot `only`.)
    model = amp.initialize(_MixedOutputs(), opt_level="O1", dtype=dtype, verbosity=0)
    out = model(torch.randn(2, 4))
    assert type(out["namedtuple"]) is _Pair and type(out["ordered"]) is collections.OrderedDict
    for key in ("tuple", "list", "namedtuple"):
        assert (out[key][0].dtype, out[key][1].dtype) == (torch.float32, torch.float64), key
    assert (out["ordered"]["half"].dtype, out["ordered"]["double"].dtype) == (
        torch.float32, torch.float64)


class _HalfHead(nn.Module):
    """A model that returns half tensors itself (its last op casts), in a tuple and a dict."""

    def __init__(self, dtype):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.dtype = dtype

    def forward(self, x):
        h = self.lin(x).to(self.dtype)
        return h, {"logits": h}


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o1_without_patch_torch_functions_returns_the_models_outputs_as_they_are(dtype):
    """O1 with patch_torch_functions=False is loss scaling alone: no autocast, so amp has no
    half results of its own to undo, and a model that returns half tensors itself gets them
    back as it returned them, as without amp (Apex's O1 leaves outputs alone when it does not
    patch). Reference: the same model without amp, bit for bit. (M08)"""
    torch.manual_seed(0)
    ref = _HalfHead(dtype)
    model = copy.deepcopy(ref)
    amp.initialize(model, opt_level="O1", dtype=dtype, patch_torch_functions=False,
                   verbosity=0)
    x = torch.randn(3, 4)
    out, want = model(x), ref(x)
    assert out[0].dtype == dtype and out[1]["logits"].dtype == dtype
    torch.testing.assert_close(out[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1]["logits"], want[1]["logits"], rtol=0, atol=0)


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
@pytest.mark.parametrize("by_keyword", [False, True])
def test_o2_embedding_max_norm_renormalises_the_master_as_fp32_does(by_keyword, norm_type):
    # The looked-up rows of an O2 embedding's fp32 master are renormalised exactly as an fp32
    # nn.Embedding(max_norm, norm_type) renormalises its weight in place, whether the indices
    # come positionally or as `input=` (nn.Embedding.forward's parameter name), and with the
    # layer's norm_type. (Mutants M03: keyword indices ignored; RN04: norm_type taken as 2.)
    torch.manual_seed(0)
    ref = nn.Embedding(20, 6, max_norm=1.0, norm_type=norm_type)
    model = copy.deepcopy(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    idx = torch.tensor([[1, 4, 7], [4, 9, 12]])
    out = model(input=idx) if by_keyword else model(idx)
    want = ref(input=idx) if by_keyword else ref(idx)
    master = next(iter(amp.master_params(opt)))
    assert ref.weight[1].norm(p=norm_type) < 1.0 + 1e-6  # (the reference renormalised)
    torch.testing.assert_close(master, ref.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(model.state_dict()["weight"], ref.weight.detach(), rtol=0, atol=0)
    assert out.dtype == torch.float32
    # The rows looked up are the fp32 renormalised ones rounded to bf16 once (renormalising
    # the half rows on their own rounds twice: an ulp or two off). (M10)
    torch.testing.assert_close(out, want.detach().to(torch.bfloat16).float(), rtol=0, atol=0)


def test_a_function_with_a_rule_keeps_the_type_of_a_mapping_it_casts():
    """A mapping argument whose tensors a rule casts reaches the function as a mapping of its
    own type (an OrderedDict stays one, a defaultdict keeps its factory), as the model's own
    inputs are cast: extension code that checks the type or relies on the factory's default
    behaves the same under O1 as outside it. Only the copy is cast; the caller's mapping keeps
    its tensors. (F05)"""
    @amp.float_function
    def look(batch):
        default = batch["missing"] if hasattr(batch, "default_factory") else None
        return type(batch), batch["x"].dtype, default

    ordered = collections.OrderedDict(x=torch.randn(2, dtype=torch.bfloat16))
    counts = collections.defaultdict(int, x=torch.randn(2, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert look(ordered) == (collections.OrderedDict, torch.float32, None)
        assert look(counts) == (collections.defaultdict, torch.float32, 0)
    assert ordered["x"].dtype == counts["x"].dtype == torch.bfloat16
    assert "missing" not in counts


def test_a_function_with_a_rule_casts_only_floating_tensors():
    """A rule casts floating tensors only: an index tensor, a bool mask and a count next to
    them reach the function with their own dtypes (gather/index_select and masked ops refuse
    floating indices and masks), under every rule. (F15)"""
    def probe(x, idx, mask):
        return x.dtype, idx.dtype, mask.dtype, x[idx].masked_fill(mask[idx], 0.0).dtype

    x = torch.randn(4)
    idx, mask = torch.tensor([0, 2]), torch.tensor([True, False, True, False])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for rule, want in ((amp.half_function, torch.bfloat16), (amp.float_function, torch.float32),
                           (amp.promote_function, torch.float32)):
            assert rule(probe)(x, idx, mask) == (want, torch.int64, torch.bool, want)


def test_master_params_of_something_not_an_optimizer_is_refused_naming_it():
    """amp.master_params takes the optimizer: given the model or a list of parameters (the
    argument torch's clip_grad_norm_ takes, a common slip) it is refused at the call with a
    TypeError saying what it expects, not an AttributeError from inside amp, and not a
    generator that fails only when the clipping iterates it."""
    model = make_mlp()
    for bad, name in ((model, type(model).__name__), (list(model.parameters()), "list")):
        with pytest.raises(TypeError, match=rf"^amp\.master_params\(optimizer={name}\): expected "
                                            r"an optimizer \(a torch\.optim\.Optimizer"):
            amp.master_params(bad)


def test_a_function_with_a_rule_keeps_a_tuple_argument_a_tuple():
    """A plain tuple argument whose tensors a rule casts reaches the function as a tuple (a
    list stays a list), as outside autocast: extension code that checks isinstance(kv, tuple),
    uses it as a dict key or unpacks a (key, value) pair behaves the same under O1. Only the
    copy is cast; the caller's tuple keeps its fp32 tensors. (F02)"""
    @amp.half_function
    def look(kv, parts):
        return type(kv), [t.dtype for t in kv], type(parts), [t.dtype for t in parts]

    kv, parts = (torch.randn(2), torch.randn(2)), [torch.randn(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert look(kv, parts) == (tuple, [torch.bfloat16] * 2, list, [torch.bfloat16])
    assert kv[0].dtype == kv[1].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_function_casts_to_the_autocast_blocks_own_dtype(dtype):
    """The half rule casts to the dtype the enclosing autocast runs in (O1's dtype=, or the
    user's own torch.autocast(dtype=...)), fp16 as well as bf16, so that a registered op gets
    the same half type as the autocast ops around it (mixing fp16 and bf16 in one op fails or
    rounds twice). Reference: what torch.mm gives in the same block. (F03)"""
    probe = amp.half_function(lambda x: x.dtype)
    a = torch.randn(2, 2)
    with torch.autocast("cpu", dtype=dtype):
        assert probe(a) == torch.mm(a, a).dtype == dtype


def test_registering_on_a_module_that_is_none_is_refused_naming_it():
    """A module variable left None (an optional extension whose import failed:
    `try: import fused_ops except ImportError: fused_ops = None`) is refused with the TypeError
    that says the first argument is the module object, naming NoneType, not an
    AttributeError about a missing attribute that sends the user looking for a typo. (F04)"""
    with pytest.raises(TypeError, match=r"register_float_function\(None, 'gelu'\): the first "
                                        r"argument is the module object .*not NoneType"):
        amp.register_float_function(None, "gelu")


def test_a_function_with_a_rule_keeps_its_name_docstring_and_original():
    """A function given a rule keeps its __name__ and docstring (tracebacks, profiler rows and
    help() name the user's op, not "wrapper"), and the original stays reachable as
    __wrapped__, as the module's documentation promises (to call it uncast, or to unregister
    by setting it back), for the decorators and for register_*_function alike. (F13)"""
    def fused_gelu(x):
        """GELU from the extension."""
        return x

    wrapped = amp.half_function(fused_gelu)
    assert (wrapped.__name__, wrapped.__doc__) == ("fused_gelu", "GELU from the extension.")
    assert wrapped.__wrapped__ is fused_gelu
    ns = type("NS", (), {})()
    ns.op = fused_gelu
    amp.register_float_function(ns, "op")
    assert ns.op.__name__ == "fused_gelu" and ns.op.__wrapped__ is fused_gelu
