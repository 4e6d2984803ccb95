"""LARC against a hand-computed float64 reference (Apex's formula), and its optimizer surface."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.parallel import LARC

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="requires CUDA"))]


def _params():
    g = torch.Generator().manual_seed(0)
    p1 = torch.randn(3, 4, generator=g, dtype=torch.float64)
    p2 = torch.randn(5, generator=g, dtype=torch.float64) * 10
    p3 = torch.zeros(2, dtype=torch.float64)  # zero weight: left alone
    p4 = torch.randn(2, generator=g, dtype=torch.float64)  # zero gradient: left alone
    grads = [torch.randn(3, 4, generator=g, dtype=torch.float64) * 1e-3,
             torch.randn(5, generator=g, dtype=torch.float64) * 50,
             torch.randn(2, generator=g, dtype=torch.float64),
             torch.zeros(2, dtype=torch.float64)]
    return [p1, p2, p3, p4], grads


def _larc_gradient(p, g, lr, wd, trust, clip, eps):
    """Apex's LARC formula by hand: the gradient the inner optimizer is given."""
    pn, gn = p.norm().item(), g.norm().item()
    if pn == 0 or gn == 0:
        return g
    local = trust * pn / (gn + pn * wd + eps)
    if clip:
        local = min(local / lr, 1.0)
    return (g + wd * p) * local


def _expected(params, grads, lr, wd, trust, clip, eps):
    return [p - lr * _larc_gradient(p, g, lr, wd, trust, clip, eps)
            for p, g in zip(params, grads)]


@pytest.mark.parametrize("clip", [True, False])
# (1e-4, 5e-4: ImageNet recipes' small decays, folded into the scaled gradient once, the inner
# step running with weight_decay=0; r68B's L07)
@pytest.mark.parametrize("wd", [0.0, 1e-4, 5e-4, 1e-2])
def test_larc_matches_reference(clip, wd):
    params, grads = _params()
    expected = _expected(params, grads, lr=0.1, wd=wd, trust=0.02, clip=clip, eps=1e-8)
    tensors = [torch.nn.Parameter(p.clone()) for p in params]
    for t, g in zip(tensors, grads):
        t.grad = g.clone()
    larc = LARC(torch.optim.SGD(tensors, lr=0.1, weight_decay=wd), trust_coefficient=0.02,
                clip=clip)
    larc.step()
    for i, (t, e) in enumerate(zip(tensors, expected)):
        torch.testing.assert_close(t.detach(), e, rtol=1e-12, atol=1e-12,
                                   msg=f"param {i} differs from the reference")
    assert larc.param_groups[0]["weight_decay"] == wd  # restored after the inner step


def _sgd_reference(groups, grads_per_step, lrs_per_step, trust, clip, eps):
    """Several steps of LARC around SGD (momentum, dampening 0, nesterov per group) in float64,
    by hand: ``groups`` are dicts of params (tensors), lr, weight_decay, momentum, nesterov."""
    params = [[p.clone() for p in g["params"]] for g in groups]
    bufs = [[None] * len(g["params"]) for g in groups]
    for grads, lrs in zip(grads_per_step, lrs_per_step):
        for gi, group in enumerate(groups):
            lr, wd, mom = lrs[gi], group["weight_decay"], group["momentum"]
            for pi, p in enumerate(params[gi]):
                g = _larc_gradient(p, grads[gi][pi], lr, wd, trust, clip, eps)
                buf = g.clone() if bufs[gi][pi] is None else bufs[gi][pi] * mom + g
                bufs[gi][pi] = buf
                step = g + mom * buf if group["nesterov"] else buf
                params[gi][pi] = p - lr * step
    return params


@pytest.mark.parametrize("clip", [True, False])
def test_larc_groups_momentum_and_a_scheduler_match_reference(clip):
    # Each group's own lr (as a scheduler sets it between steps) and weight decay, momentum
    # with and without nesterov, over three steps: LARC must read the groups, not the
    # defaults, and scale every group.
    gen = torch.Generator().manual_seed(1)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    groups = [
        {"params": [rand(4, 3), rand(3)], "lr": 0.1, "weight_decay": 1e-2, "momentum": 0.9,
         "nesterov": False},
        {"params": [rand(5, scale=10)], "lr": 0.5, "weight_decay": 0.0, "momentum": 0.5,
         "nesterov": True},
        {"params": [rand(2, 2)], "lr": 0.01, "weight_decay": 5e-2, "momentum": 0.9,
         "nesterov": True},
    ]
    steps = 3
    grads = [[[rand(*p.shape, scale=s) for p, s in zip(g["params"], (1e-3, 50.0, 1.0))]
              for g in groups] for _ in range(steps)]
    gamma = 0.5
    lrs = [[g["lr"] * gamma ** k for g in groups] for k in range(steps)]
    expected = _sgd_reference(groups, grads, lrs, trust=0.02, clip=clip, eps=1e-8)

    tensors = [[torch.nn.Parameter(p.clone()) for p in g["params"]] for g in groups]
    inner = torch.optim.SGD(
        [{**{k: v for k, v in g.items() if k != "params"}, "params": ts}
         for g, ts in zip(groups, tensors)],
        lr=1.0, weight_decay=0.3, momentum=0.0)  # (defaults unlike every group)
    larc = LARC(inner, trust_coefficient=0.02, clip=clip)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(larc.optim, gamma=gamma)
    for k in range(steps):
        for ts, gs in zip(tensors, grads[k]):
            for t, g in zip(ts, gs):
                t.grad = g.clone()
        larc.step()
        scheduler.step()
    for gi, (ts, es) in enumerate(zip(tensors, expected)):
        for pi, (t, e) in enumerate(zip(ts, es)):
            torch.testing.assert_close(t.detach(), e, rtol=1e-12, atol=1e-12,
                                       msg=f"group {gi} param {pi} differs from the reference")
    assert [g["weight_decay"] for g in larc.param_groups] == [1e-2, 0.0, 5e-2]


def test_larc_clips_each_group_at_its_own_learning_rate():
    """With clip=True each group's rate is min(local_lr / lr, 1) with that group's own lr
    (users give a backbone and a head their own rates): two groups whose trust ratios lie
    below their rates, so no clipping saturates, step at lr 0.1 and 0.02 as the float64 hand
    formula gives per group. Reference: that formula, 1e-12. (L12)"""
    gen = torch.Generator().manual_seed(7)
    starts = [torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(2)]
    grads = [torch.randn(6, generator=gen, dtype=torch.float64) * 5 for _ in range(2)]
    lrs = [0.1, 0.02]
    for p, g, lr in zip(starts, grads, lrs):  # (the ratio below the rate: not clipped)
        assert 0.02 * p.norm().item() / g.norm().item() < lr
    tensors = [nn.Parameter(p.clone()) for p in starts]
    for t, g in zip(tensors, grads):
        t.grad = g.clone()
    inner = torch.optim.SGD([{"params": [t], "lr": lr} for t, lr in zip(tensors, lrs)], lr=1.0)
    LARC(inner, trust_coefficient=0.02, clip=True).step()
    for i, (t, p, g, lr) in enumerate(zip(tensors, starts, grads, lrs)):
        expected = p - lr * _larc_gradient(p, g, lr, 0.0, 0.02, True, 1e-8)
        torch.testing.assert_close(t.detach(), expected, rtol=1e-12, atol=1e-12,
                                   msg=f"group {i} (lr {lr}) differs from the reference")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_larc_under_amp_o2_matches_reference_on_the_masters(dtype):
    # amp O2: LARC steps the fp32 masters with the unscaled master gradients (a static loss
    # scale of 128 would show as a wrong trust ratio), and takes the half model's in-place
    # writes since initialize (nn.init, PyTorch's DDP broadcast) into the masters first (it
    # read the masters from before the write).
    from mixprec import amp

    if dtype == torch.float16 and not _cpu_half_matmul():
        pytest.skip("this CPU build has no fp16 matmul")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    larc = LARC(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1,
                                momentum=0.9), trust_coefficient=0.02)
    model, larc = amp.initialize(model, larc, opt_level="O2", dtype=dtype, loss_scale=128.0,
                                 verbosity=0)
    with torch.no_grad():
        model.weight.fill_(0.5)  # (exact in half)
        model.bias.fill_(0.25)
    x = torch.randn(4, 16)
    with amp.scale_loss(model(x).float().pow(2).mean(), larc) as scaled:
        scaled.backward()
    masters = list(amp.master_params(larc))
    grads = [m.grad.double().clone() for m in masters]
    larc.step()
    starts = [torch.full((8, 16), 0.5, dtype=torch.float64),
              torch.full((8,), 0.25, dtype=torch.float64)]
    expected = _expected(starts, grads, lr=0.1, wd=0.1, trust=0.02, clip=True, eps=1e-8)
    for i, (m, e) in enumerate(zip(masters, expected)):
        torch.testing.assert_close(m.double(), e, rtol=1e-6, atol=1e-7,
                                   msg=f"master {i} differs from the reference")
    # The unscaled gradient: the same model's loss in float64, by hand.
    w = starts[0].clone().requires_grad_(True)
    b = starts[1].clone().requires_grad_(True)
    (x.double() @ w.T + b).pow(2).mean().backward()
    tol = dict(rtol=2e-2, atol=1e-3)  # (the forward ran in half)
    torch.testing.assert_close(grads[0], w.grad, **tol)
    torch.testing.assert_close(grads[1], b.grad, **tol)


def test_a_whole_pickle_of_an_amp_larc_from_an_older_mixprec_loads():
    # LARC keeps its instance attributes when pickled whole, amp's step among them; mixprec
    # before 629fb1b pickled that step as `_state._InstanceStep(optimizer, marks)`, a name
    # later renamed: such a checkpoint failed to load (AttributeError on the name). Written
    # here in that format. It loads with its state as saved (a plain optimizer, as every
    # unpickled amp optimizer is).
    import io
    import pickle

    from torch import nn

    from mixprec import amp
    from mixprec.amp import _state

    class _OldStep:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def __reduce__(self):
            return (_state._InstanceStep, (self.optimizer, ()))

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    larc = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model, larc = amp.initialize(model, larc, opt_level="O2", dtype=torch.bfloat16,
                                 verbosity=0)
    with amp.scale_loss(model(torch.randn(4, 8)).float().pow(2).mean(), larc) as scaled:
        scaled.backward()
    larc.step()
    larc.__dict__["step"] = _OldStep(larc)
    buffer = io.BytesIO()
    torch.save({"model": model, "optimizer": larc}, buffer)
    assert b"_InstanceStep" in buffer.getvalue()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)["optimizer"]
    want, got = larc.state_dict(), loaded.state_dict()
    assert pickle.dumps(got["param_groups"]) == pickle.dumps(want["param_groups"])
    for key in want["state"]:
        torch.testing.assert_close(got["state"][key]["momentum_buffer"],
                                   want["state"][key]["momentum_buffer"], rtol=0, atol=0)
    assert loaded.__dict__["step"].__self__ is loaded


def test_larc_made_after_initialize_trains_as_one_made_before():
    # LARC(optimizer) of the optimizer initialize returned: scale_loss(loss, larc) was refused
    # as "an optimizer that did not go through amp.initialize" (Apex's too). Now its inner
    # optimizer's state is used: the same masters, bit for bit, as LARC passed to initialize.
    from mixprec import amp

    def run(order):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1, momentum=0.9)
        kw = dict(opt_level="O2", dtype=torch.bfloat16, loss_scale=128.0, verbosity=0)
        if order == "before":
            larc = LARC(sgd, trust_coefficient=0.02)
            model, larc = amp.initialize(model, larc, **kw)
        else:
            model, sgd = amp.initialize(model, sgd, **kw)
            larc = LARC(sgd, trust_coefficient=0.02)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            larc.zero_grad()
            x = torch.randn(4, 16, generator=g)
            with amp.scale_loss(model(x).float().pow(2).mean(), larc) as scaled:
                scaled.backward()
            larc.step()
        return [m.detach().clone() for m in amp.master_params(larc)]

    before, after = run("before"), run("after")
    assert all(m.dtype == torch.float32 for m in after)
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_larc_made_after_initialize_is_taken_by_amps_other_optimizer_calls():
    """B1 (r85C). A LARC made after initialize stands for its inner optimizer in
    scale_loss (see the test above), but amp.step_was_skipped(larc),
    amp.state_dict(optimizer=larc) and amp.load_state_dict(..., optimizer=larc) raised "this
    optimizer did not go through amp.initialize" (now they look through .optim). Reference:
    the same calls on larc.optim, and a LARC passed to initialize (both answer)."""
    from mixprec import amp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, sgd = amp.initialize(model, sgd, opt_level="O2", dtype=torch.float16,
                                loss_scale="dynamic", verbosity=0)
    larc = LARC(sgd)
    for step in range(2):
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
        if step == 1:
            loss = loss * float("inf")
        with amp.scale_loss(loss, larc) as scaled:
            scaled.backward()
        larc.step()
        assert amp.step_was_skipped(larc) == amp.step_was_skipped(sgd) == (step == 1)
    assert amp.state_dict(optimizer=larc) == amp.state_dict(optimizer=sgd)
    other = {"loss_scaler0": {"loss_scale": 8.0, "unskipped": 3}}
    assert amp.state_dict(optimizer=sgd) != other
    amp.load_state_dict(other, optimizer=larc)
    assert amp.state_dict(optimizer=sgd) == other
    assert list(amp.master_params(larc)) == list(amp.master_params(sgd))


def _cpu_half_matmul() -> bool:
    try:
        torch.ones(2, 2, dtype=torch.float16) @ torch.ones(2, 2, dtype=torch.float16)
    except RuntimeError:
        return False
    return True


def test_larc_clip_bounds_the_rate():
    # Tiny gradient on a large weight: the trust ratio is huge, so LARC clips at lr exactly.
    p = torch.nn.Parameter(torch.full((4,), 10.0))
    p.grad = torch.full((4,), 1e-6)
    LARC(torch.optim.SGD([p], lr=0.5)).step()
    torch.testing.assert_close(p.detach(), torch.full((4,), 10.0 - 0.5 * 1e-6))


def test_larc_clipped_step_at_zero_learning_rate_stays_finite():
    """A warm-up schedule starting at lr=0 (LambdaLR with a factor 0 at step 0): with
    clip=True the rate is min(local_lr / lr, 1) = 1 there, so the inner optimizer gets the
    finite gradient ``g + wd * p`` (its momentum buffer starts from it) and the weights do not
    move; a NaN there would poison the momentum for good. Reference: that gradient in float64,
    exactly; then a step at lr=0.1 as the hand formula gives, 1e-12. (L10)"""
    gen = torch.Generator().manual_seed(5)
    start = torch.randn(6, generator=gen, dtype=torch.float64)
    grads = [torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(2)]
    p = nn.Parameter(start.clone())
    inner = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=1e-2)
    larc = LARC(inner, trust_coefficient=0.02)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda k: float(k))  # lr 0, then 0.1
    p.grad = grads[0].clone()
    larc.step()
    buf = inner.state[p]["momentum_buffer"]
    torch.testing.assert_close(buf, grads[0] + 1e-2 * start, rtol=0, atol=0)
    torch.testing.assert_close(p.detach(), start, rtol=0, atol=0)
    scheduler.step()
    p.grad = grads[1].clone()
    larc.step()
    g = _larc_gradient(start, grads[1], 0.1, 1e-2, 0.02, True, 1e-8)
    expected = start - 0.1 * (0.9 * (grads[0] + 1e-2 * start) + g)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)
    # A zero ratio (trust_coefficient=0, or one underflowed in fp32) at lr 0 gives the zero
    # gradient it gives at any lr > 0, not 0/0: the momentum buffer starts at zero, not NaN.
    for lr in (0.0, 0.1):
        q = nn.Parameter(torch.ones(3))
        q.grad = torch.ones(3)
        zero_inner = torch.optim.SGD([q], lr=lr, momentum=0.9)
        LARC(zero_inner, trust_coefficient=0).step()
        assert torch.equal(zero_inner.state[q]["momentum_buffer"], torch.zeros(3)), lr
        assert torch.equal(q.detach(), torch.ones(3)), lr


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_larc_step_on_float32_and_half_params_matches_float64(dtype, clip):
    # Half parameters (O3, a .half() model): the trust ratio from fp32 norms, the step in the
    # parameter's dtype, against the same step computed in float64 from the same values.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, dtype=dtype))
    p.grad = torch.randn(64, dtype=dtype) * 3
    p64, g64 = p.detach().double(), p.grad.double()
    lr, tc = 0.1, 0.02
    LARC(torch.optim.SGD([p], lr=lr), trust_coefficient=tc, clip=clip).step()
    ratio = tc * p64.norm() / (g64.norm() + 1e-8)
    scale = torch.clamp(ratio / lr, max=1.0) if clip else ratio
    expected = p64 - lr * scale * g64
    assert p.dtype == dtype
    # One rounding of the gradient's scaling and one of the update, in the parameter's dtype
    # (without LARC's scaling the update is ~5x larger than these bounds).
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(p.detach().double(), expected, rtol=2 * eps, atol=2 * eps)


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_larc_complex_parameter_matches_the_reference(dtype, clip):
    """A complex parameter (a Fourier layer's; amp keeps them complex, torch.optim.SGD takes
    them): the trust ratio from the real 2-norms, as Apex's torch.norm(p.data) gave. (B1: the
    fp32 norm dtype was refused by vector_norm, "dtype should be complex for complex inputs".)
    Reference: the hand formula in complex128, 1e-12 (1e-6 for complex64)."""
    gen = torch.Generator().manual_seed(31)
    start = torch.randn(6, generator=gen, dtype=dtype)
    grad = torch.randn(6, generator=gen, dtype=dtype)
    p = nn.Parameter(start.clone())
    p.grad = grad.clone()
    LARC(torch.optim.SGD([p], lr=0.1, weight_decay=1e-2, momentum=0.9), clip=clip).step()
    s, g = start.to(torch.complex128), grad.to(torch.complex128)
    expected = s - 0.1 * _larc_gradient(s, g, 0.1, 1e-2, 0.02, clip, 1e-8)
    tol = 1e-12 if dtype == torch.complex128 else 1e-6
    assert p.dtype == dtype
    torch.testing.assert_close(p.detach().to(torch.complex128), expected, rtol=tol, atol=tol)


def test_larc_shares_the_inner_optimizer_state():
    p = torch.nn.Parameter(torch.randn(4))
    inner = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    larc = LARC(inner)
    assert larc.param_groups is inner.param_groups
    assert larc.state is inner.state
    assert larc.defaults is inner.defaults
    p.grad = torch.randn(4)
    larc.step()
    saved = larc.state_dict()
    assert saved["state"], "momentum buffer expected in the inner state"
    fresh = LARC(torch.optim.SGD([torch.nn.Parameter(p.detach().clone())], lr=0.1,
                                 momentum=0.9))
    fresh.load_state_dict(saved)
    torch.testing.assert_close(fresh.state_dict()["state"][0]["momentum_buffer"],
                               saved["state"][0]["momentum_buffer"])
    larc.zero_grad(set_to_none=True)
    assert p.grad is None
    extra = torch.nn.Parameter(torch.randn(2))
    larc.add_param_group({"params": [extra]})
    assert len(inner.param_groups) == 2
    scheduler = torch.optim.lr_scheduler.StepLR(larc.optim, step_size=1, gamma=0.5)
    p.grad = torch.randn(4)
    larc.step()
    scheduler.step()
    assert larc.param_groups[0]["lr"] == pytest.approx(0.05)
    assert "trust_coefficient=0.02" in repr(larc)


@pytest.mark.parametrize("clip", [True, False])
def test_larc_closure(clip):
    """``step(closure)``: the closure computes the gradients, then LARC scales them and the
    inner optimizer steps once with them (the closure is not run again inside the inner
    step, which would recompute unscaled gradients). Reference: the hand formula on the
    closure's gradient, float64, 1e-12. (L02 L06)"""
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(6, generator=gen, dtype=torch.float64) * 4
    target = torch.randn(6, generator=gen, dtype=torch.float64)
    p = nn.Parameter(start.clone())
    larc = LARC(torch.optim.SGD([p], lr=0.1, weight_decay=1e-2), trust_coefficient=0.02,
                clip=clip)

    def closure():
        larc.zero_grad()
        loss = (p - target).pow(2).sum()
        loss.backward()
        return loss

    loss = larc.step(closure)
    grad = 2 * (start - target)
    expected = _expected([start], [grad], lr=0.1, wd=1e-2, trust=0.02, clip=clip, eps=1e-8)[0]
    torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)
    assert loss.item() == pytest.approx((start - target).pow(2).sum().item())


def test_larc_closure_runs_with_grad_enabled_inside_no_grad():
    # torch.optim's own step(closure) runs the closure with gradients on, so a loop that
    # steps inside torch.no_grad() works; LARC's must too (it raised "element 0 of tensors
    # does not require grad"). Reference: the same LARC step outside no_grad, bit for bit.
    def closure_for(t, opt):
        def closure():
            opt.zero_grad()
            loss = (t * 2).sum()
            loss.backward()
            return loss
        return closure

    p, ref = (torch.nn.Parameter(torch.ones(3, dtype=torch.float64)) for _ in range(2))
    larc, ref_larc = (LARC(torch.optim.SGD([t], lr=0.1), trust_coefficient=0.02)
                      for t in (p, ref))
    with torch.no_grad():
        loss = larc.step(closure_for(p, larc))
    ref_larc.step(closure_for(ref, ref_larc))
    assert loss.item() == pytest.approx(6.0)
    assert not torch.equal(p.detach(), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=0)


def test_larc_restores_weight_decay_when_the_inner_step_raises():
    """LARC zeroes the groups' weight_decay for the inner step only: if that step raises (a
    custom optimizer's check, an interrupted step a training loop catches and retries), the
    groups get their weight decay back, or every later step would run without it. Reference:
    the values the groups held before. (L03)"""
    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("inner step failed")

    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    larc = LARC(Failing([{"params": [p], "weight_decay": 1e-2},
                         {"params": [q], "weight_decay": 5e-4}], lr=0.1))
    p.grad, q.grad = torch.ones(3), torch.ones(2)
    with pytest.raises(RuntimeError, match="inner step failed"):
        larc.step()
    assert [g["weight_decay"] for g in larc.param_groups] == [1e-2, 5e-4]


@pytest.mark.parametrize("clip", [True, False])
def test_larc_sparse_gradient_matches_the_dense_reference(clip):
    # nn.Embedding(sparse=True): an uncoalesced COO gradient (index 2 twice), whose norm is
    # that of the summed rows, as for the same gradient dense.
    weight = torch.randn(10, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    emb = torch.nn.Embedding(10, 4, sparse=True, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.copy_(weight)
    idx = torch.tensor([1, 2, 2, 7])
    (emb(idx) * torch.arange(1.0, 5.0, dtype=torch.float64)).sum().backward()
    assert emb.weight.grad.is_sparse and not emb.weight.grad.is_coalesced()
    dense_grad = emb.weight.grad.to_dense()
    expected = _expected([weight], [dense_grad], lr=0.1, wd=0.0, trust=0.02, clip=clip,
                         eps=1e-8)[0]
    LARC(torch.optim.SGD(emb.parameters(), lr=0.1), clip=clip).step()
    torch.testing.assert_close(emb.weight.detach(), expected, rtol=1e-12, atol=1e-12)


def test_larc_sparse_gradient_with_weight_decay_is_refused_before_any_change():
    # (A dense parameter listed first keeps its gradient too.)
    dense = torch.nn.Parameter(torch.ones(3))
    emb = torch.nn.Embedding(10, 4, sparse=True)
    (emb(torch.tensor([3])).sum() + dense.sum()).backward()
    before = [emb.weight.detach().clone(), dense.detach().clone()]
    grads = [emb.weight.grad.to_dense(), dense.grad.clone()]
    larc = LARC(torch.optim.SGD([dense, emb.weight], lr=0.1, weight_decay=1e-4))
    with pytest.raises(ValueError, match=r"shape \(10, 4\) has a sparse gradient.*"
                                         r"weight_decay=0\.0001.*group with weight_decay=0"):
        larc.step()
    assert torch.equal(emb.weight.detach(), before[0]) and torch.equal(dense.detach(), before[1])
    assert torch.equal(emb.weight.grad.to_dense(), grads[0])
    assert torch.equal(dense.grad, grads[1])


def test_larc_errors():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        LARC([p])
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARC(torch.optim.SGD([p], lr=0.1), trust_coefficient=-1.0)
    with pytest.raises(TypeError, match="clip"):
        LARC(torch.optim.SGD([p], lr=0.1), clip="yes")
    with pytest.raises(ValueError, match="trust_coefficient=nan"):
        LARC(torch.optim.SGD([p], lr=0.1), trust_coefficient=float("nan"))
    with pytest.raises(TypeError, match=r"LARC\(LBFGS\).*closure.*first-order"):
        LARC(torch.optim.LBFGS([p]))  # (its step recomputes the gradients LARC scaled)

    class LoggedLBFGS(torch.optim.LBFGS):  # (a project's own LBFGS, L09)
        pass

    with pytest.raises(TypeError, match=r"LARC\(LBFGS\).*closure.*first-order"):
        LARC(LoggedLBFGS([p]))
    # Both numbers finite and >= 0 (documented): a negative eps can zero the denominator, an
    # infinite one or an infinite trust coefficient makes every step 0 or inf. A bool is no
    # number here (True is 1 to Python): LARC(optimizer, True), a flag for clip in the wrong
    # place, would run with a trust coefficient fifty times the default. (L01, L05, L03)
    for name, value in (("eps", -1e-8), ("eps", float("nan")), ("eps", float("inf")),
                        ("trust_coefficient", float("inf")), ("eps", True), ("eps", False),
                        ("trust_coefficient", True), ("trust_coefficient", False)):
        with pytest.raises(ValueError, match=rf"LARC\({name}={value}\): must be a finite "
                                             r"number >= 0"):
            LARC(torch.optim.SGD([p], lr=0.1), **{name: value})
    with pytest.raises(ValueError, match=r"LARC\(trust_coefficient=True\)"):
        LARC(torch.optim.SGD([p], lr=0.1), True)  # (the positional slot after the optimizer)
    # The repr shows every setting (how a run's configuration is checked). (L04)
    assert repr(LARC(torch.optim.SGD([p], lr=0.1), trust_coefficient=0.001, clip=False,
                     eps=1e-6)).startswith("LARC(trust_coefficient=0.001, clip=False, "
                                           "eps=1e-06) wrapping SGD")
    # What Apex took: any number, a truthy int or NumPy bool for clip.
    np = pytest.importorskip("numpy")
    larc = LARC(torch.optim.SGD([p], lr=0.1), trust_coefficient=np.float32(0.01),
                clip=np.bool_(False), eps=np.float64(1e-6))
    assert larc.clip is False and larc.trust_coefficient == pytest.approx(0.01)
    assert LARC(torch.optim.SGD([p], lr=0.1), clip=1).clip is True


@pytest.mark.parametrize("kwargs", [dict(eps=0.0), dict(trust_coefficient=0)])
def test_larc_takes_zero_eps_and_trust_coefficient(kwargs):
    # (a mutation of larc.py: `value < 0` -> `<= 0`): the documented range is ">= 0"; eps=0 is a
    # common setting (no denominator guard), and was refused at the boundary by the mutant.
    p = nn.Parameter(torch.ones(3))
    larc = LARC(torch.optim.SGD([p], lr=0.1), **kwargs)
    assert getattr(larc, next(iter(kwargs))) == 0.0


@pytest.mark.parametrize("clip", [True, False])
def test_larc_uses_the_eps_it_is_given(clip):
    """eps is the denominator's term as given (users raise it to damp the ratio of layers
    with tiny gradients): with eps=1e-3 and gradient norms near 1e-3 it halves the ratio, and
    the step is the float64 hand formula with that eps (clip=True at lr 100, where the ratio
    stays below the rate and is not clipped to 1). Reference: that formula, 1e-12. (L17)"""
    gen = torch.Generator().manual_seed(11)
    start = torch.randn(6, generator=gen, dtype=torch.float64)
    grad = torch.randn(6, generator=gen, dtype=torch.float64)
    grad *= 1e-3 / grad.norm()
    lr = 100.0 if clip else 0.1
    p = nn.Parameter(start.clone())
    p.grad = grad.clone()
    LARC(torch.optim.SGD([p], lr=lr), trust_coefficient=0.02, clip=clip, eps=1e-3).step()
    expected = start - lr * _larc_gradient(start, grad, lr, 0.0, 0.02, clip, 1e-3)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)


def test_larc_norms_of_half_parameters_do_not_overflow():
    # (a mutation of larc.py: norms taken in the parameter's dtype): a half parameter (O3) whose
    # norm passes fp16's 65504 got an inf trust ratio and an inf gradient (LARS, clip=False).
    p = nn.Parameter(torch.full((10000,), 1000.0, dtype=torch.float16))  # ||p|| = 1e5
    p.grad = torch.ones_like(p)  # ||g|| = 100
    larc = LARC(torch.optim.SGD([p], lr=0.1), trust_coefficient=0.02, clip=False, eps=0.0)
    larc._scale_gradients()
    # local_lr = 0.02 * 1e5 / 100 = 20
    assert torch.equal(p.grad, torch.full_like(p, 20.0))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_larc_refuses_a_gradient_of_another_sparse_layout_by_name():
    # (a mutation of larc.py: the layout test removed): a CSR gradient reached coalesce() and failed
    # there with PyTorch's own error instead of LARC's TypeError naming the layout. (`p.grad = csr`
    # is refused by PyTorch itself, so the helper is called directly.)
    p = nn.Parameter(torch.ones(3, 3))
    with pytest.raises(TypeError, match=r"a gradient of layout torch.sparse_csr"):
        LARC._grad_values(p, torch.eye(3).to_sparse_csr(), 0.0)


def test_larc_leaves_a_group_without_weight_decay_without_one():
    # (a mutation of larc.py: `if value is not None` -> always): a group of an optimizer that has no
    # weight_decay (a custom one) got weight_decay=None written in, and LARC's next step failed on
    # float(None).
    class PlainSGD(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    p = nn.Parameter(torch.ones(3))
    larc = LARC(PlainSGD([p], lr=0.1))
    for _ in range(2):
        p.grad = torch.ones(3)
        larc.step()
    assert "weight_decay" not in larc.param_groups[0]


def test_larc_zero_grad_passes_set_to_none_on():
    # LARC.zero_grad takes the inner optimizer's arguments: set_to_none=False zeroes the
    # gradients in place (code that holds the gradient tensors, e.g. gradient buffers of a
    # CUDA graph, relies on it); the default sets them to None. Reference: SGD's own
    # zero_grad. (L01)
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    larc, ref = LARC(torch.optim.SGD([p], lr=0.1)), torch.optim.SGD([q], lr=0.1)
    p.grad, q.grad = torch.ones(3), torch.ones(3)
    held = p.grad
    larc.zero_grad(set_to_none=False)
    ref.zero_grad(set_to_none=False)
    assert p.grad is held and torch.equal(p.grad, q.grad) and torch.equal(p.grad, torch.zeros(3))
    larc.zero_grad()
    assert p.grad is None


def test_larc_assigning_param_groups_or_state_reaches_the_inner_optimizer():
    # The wrapper shares the inner optimizer's param_groups and state: assigning them through
    # the wrapper (as code written for a torch.optim.Optimizer does, e.g. to restore a
    # snapshot) replaces the inner optimizer's, so LARC and its inner step see the same.
    # (L02 L03)
    p = nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    larc = LARC(inner)
    groups = [dict(inner.param_groups[0], lr=0.5)]
    larc.param_groups = groups
    assert inner.param_groups is groups and larc.param_groups is groups
    state = {p: {"momentum_buffer": torch.full((3,), 2.0)}}
    larc.state = state
    assert inner.state is state and larc.state is state


def test_larc_refuses_a_tensor_clip():
    # clip must be a bool (or what Apex took: an int, a NumPy bool); a tensor flag (from a
    # config computed with torch) is refused with the argument named. (L07)
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match=r"LARC\(clip=tensor\(True\)\): must be a bool"):
        LARC(torch.optim.SGD([p], lr=0.1), clip=torch.tensor(True))


def test_larc_state_dict_is_the_inner_optimizers():
    # LARC has no state of its own: its state dict is the inner optimizer's, key for key, so a
    # checkpoint saved through LARC loads into the bare optimizer and the other way round.
    # (L12)
    p = nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    larc = LARC(inner)
    p.grad = torch.ones(3)
    larc.step()
    saved, want = larc.state_dict(), inner.state_dict()
    assert saved.keys() == want.keys(), (saved.keys(), want.keys())
    assert saved["param_groups"] == want["param_groups"]
    torch.testing.assert_close(saved["state"][0]["momentum_buffer"],
                               want["state"][0]["momentum_buffer"], rtol=0, atol=0)


def test_larc_step_leaves_no_graph_on_the_gradients():
    """LARC's scaling runs without autograd: a step called with gradients enabled (every
    training loop) leaves p.grad a plain tensor, no grad_fn and no graph holding the parameter
    (which kept the norm's graph alive and made ``p.grad.numpy()`` raise). (mutation r80A L17:
    ``@torch.no_grad()`` dropped from ``_scale_gradients``.) Reference: the hand formula on the
    same values, float64, 1e-12."""
    gen = torch.Generator().manual_seed(21)
    start = torch.randn(5, generator=gen, dtype=torch.float64)
    grad = torch.randn(5, generator=gen, dtype=torch.float64)
    p = nn.Parameter(start.clone())
    p.grad = grad.clone()
    assert torch.is_grad_enabled()
    LARC(torch.optim.SGD([p], lr=0.1, weight_decay=1e-2, momentum=0.9)).step()
    assert p.grad.grad_fn is None and not p.grad.requires_grad
    p.grad.numpy()  # (raised "Can't call numpy() on Tensor that requires grad")
    expected = start - 0.1 * _larc_gradient(start, grad, 0.1, 1e-2, 0.02, True, 1e-8)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("clip", [True, False])
def test_larc_scales_the_gradient_in_place(clip):
    """As Apex (``p.grad.data *= adaptive_lr``), LARC writes the scaled gradient, weight decay
    folded in, into the gradient tensor itself: code that holds the gradient tensors (DDP's
    gradient_as_bucket_view, CUDA-graph buffers, zero_grad(set_to_none=False) loops) sees it,
    and p.grad is still that tensor after the step. (mutation r80A L33: p.grad replaced by a
    scaled copy.) Reference: the hand formula in float64, 1e-12."""
    gen = torch.Generator().manual_seed(22)
    start = torch.randn(6, generator=gen, dtype=torch.float64)
    grad = torch.randn(6, generator=gen, dtype=torch.float64)
    p = nn.Parameter(start.clone())
    held = grad.clone()
    p.grad = held
    LARC(torch.optim.SGD([p], lr=0.1, weight_decay=1e-2), clip=clip).step()
    assert p.grad is held
    torch.testing.assert_close(held, _larc_gradient(start, grad, 0.1, 1e-2, 0.02, clip, 1e-8),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_larc_ratio_past_fp16s_range_scales_half_gradients_in_fp32(dtype, device):
    """LARS (clip=False) on half parameters (O3, a .half() model) with a small gradient: the
    trust ratio passes fp16's 65504 (0.02 * 64 / 6e-6 ~ 2e5) while the scaled gradient stays
    small (its norm is trust * ||p||). Rounding the ratio to fp16 before the product made the
    gradient inf, and every zero entry NaN (r103B B1); in bf16 it kept 8 bits of the ratio.
    Against float64: one rounding of the scaled gradient to the parameter's dtype."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64, 64, dtype=dtype, device=device))
    g = (torch.randn(64, 64, device=device) * 1e-7).to(dtype)
    g[0, :8] = 0  # zero entries stay exactly 0 (inf * 0 was NaN)
    p.grad = g.clone()
    tc, eps = 0.02, 1e-8
    ratio = tc * p.detach().double().norm() / (g.double().norm() + eps)
    assert ratio > 65504
    larc = LARC(torch.optim.SGD([p], lr=0.1), trust_coefficient=tc, clip=False, eps=eps)
    larc._scale_gradients()
    expected = g.double() * ratio
    assert torch.isfinite(p.grad).all()
    assert torch.equal(p.grad[0, :8], torch.zeros(8, dtype=dtype, device=device))
    tiny = torch.finfo(dtype).tiny  # fp16 subnormal gradients: absolute bound near zero
    # One rounding (half an ulp), plus fp32's norms and product (~1e-7 relative).
    rtol = torch.finfo(dtype).eps / 2 + 1e-6
    torch.testing.assert_close(p.grad.double(), expected, rtol=rtol, atol=tiny)
