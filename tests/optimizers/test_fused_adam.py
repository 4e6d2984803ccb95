"""mixprec.optimizers.FusedAdam against PyTorch's Adam/AdamW and a float64 reference.

Each of its paths is checked on every device: the Triton kernel (on CPU through Triton's
interpreter, small sizes), PyTorch's fused Adam kernel (for what the Triton kernel does not
take) and the plain-PyTorch arithmetic it falls back to last. The reference is
PyTorch's single-tensor Adam/AdamW run in float64 on the same gradients; after five steps the
fp32 results must agree to ``rtol=1e-5, atol=1e-6`` (fp32 rounding of an update of size
``lr``; PyTorch's own fp32 AdamW lands as far from the float64 run). The half copies written
for amp O2 must equal the masters cast by PyTorch bit for bit.
"""

import collections
import copy
import inspect
import pickle
import re

import pytest
import torch
from torch import nn

from mixprec import amp
from mixprec.amp import _state
from mixprec.optimizers import FusedAdam, fused_adam
from tests._triton import interpreter_skip_reason
from tests.conftest import requires_cuda

# Odd sizes that straddle the interpreter's 1,024-element chunks and 256-element blocks.
_SHAPES = [(1,), (3,), (1023,), (37, 29), (2050,), (2, 3, 5, 7)]
_TOL = dict(rtol=1e-5, atol=1e-6)
_PATHS = ["kernel", "torch_fused", "plain"]


@pytest.fixture(params=_PATHS)
def path(request, monkeypatch, device):
    """Route FusedAdam through its Triton kernel, PyTorch's fused Adam kernel (where this
    PyTorch runs it on the device), or its plain-PyTorch arithmetic."""
    if request.param == "kernel":
        if device.type == "cpu":
            reason = interpreter_skip_reason()
            if reason is not None:
                pytest.skip(reason)
            monkeypatch.setattr(fused_adam, "_KERNEL_ON_CPU", True)
        return request.param
    monkeypatch.setattr(fused_adam, "_kernel_device_ok", lambda device: False)
    if request.param == "torch_fused":
        if not fused_adam._torch_fused_ok(device):
            pytest.skip(f"this PyTorch has no fused Adam kernel for {device.type} tensors")
    else:
        monkeypatch.setattr(fused_adam, "_torch_fused_ok", lambda device: False)
    return request.param


@pytest.fixture
def amp_device(device, monkeypatch):
    """Where the amp tests train: on CPU the Triton kernel and amp's fused cast run through
    Triton's interpreter; on CUDA they are compiled."""
    if device.type == "cpu":
        reason = interpreter_skip_reason()
        if reason is not None:
            pytest.skip(reason)
        monkeypatch.setattr(fused_adam, "_KERNEL_ON_CPU", True)
        monkeypatch.setattr(_state, "_FUSED_CAST_ON_CPU", True)
    return device


def _params(device, gen, shapes=_SHAPES, memory_format=None):
    ps = []
    for s in shapes:
        p = torch.randn(s, generator=gen).to(device)
        if memory_format is not None and p.dim() == 4:
            p = p.contiguous(memory_format=memory_format)
        ps.append(p)
    return ps


def _run(make_opt, params, grads_per_step):
    opt = make_opt(params)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.to(dtype=p.dtype).clone()
        opt.step()
    return opt


def _step_both(grads, ours, ref, *optimizers):
    """Give ``ours`` the gradients ``grads`` and ``ref`` (float64) the same values, then step
    every optimizer given (FusedAdam first, its reference after)."""
    for p, r, g in zip(ours, ref, grads):
        p.grad, r.grad = g.clone(), g.double()
    for opt in optimizers:
        opt.step()


def _torch_reference(adam_w: bool, **kw):
    cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    return lambda params: cls(params, foreach=False, **kw)


def _grads(params, gen, steps=5):
    return [[torch.randn(p.shape, generator=gen).to(p.device) for p in params]
            for _ in range(steps)]


@pytest.mark.parametrize("adam_w", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("memory_format", [None, torch.channels_last])
def test_matches_pytorch_adam_in_float64(device, path, adam_w, weight_decay, memory_format):
    gen = torch.Generator().manual_seed(0)
    params = _params(device, gen, memory_format=memory_format)
    grads = _grads(params, gen)
    hyper = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay)
    ours = [p.clone() for p in params]
    opt = _run(lambda ps: FusedAdam(ps, adam_w_mode=adam_w, **hyper), ours, grads)
    ref = [p.double() for p in params]
    ref_opt = _run(_torch_reference(adam_w, **hyper), ref, grads)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)
        if memory_format is not None and p.dim() == 4:
            assert p.is_contiguous(memory_format=memory_format)
    for p, r in zip(ours, ref):
        state, ref_state = opt.state[p], ref_opt.state[r]
        torch.testing.assert_close(state["exp_avg"], ref_state["exp_avg"].float(), **_TOL)
        torch.testing.assert_close(state["exp_avg_sq"], ref_state["exp_avg_sq"].float(),
                                   rtol=1e-5, atol=1e-8)
        assert state["step"].item() == 5.0 and state["step"].device == p.device


def test_without_bias_correction(device, path):
    """Apex's ``bias_correction=False``: the moments are used as they are (float64 formula)."""
    gen = torch.Generator().manual_seed(1)
    params = _params(device, gen)
    grads = _grads(params, gen, steps=3)
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.05
    ours = [p.clone() for p in params]
    _run(lambda ps: FusedAdam(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                              bias_correction=False), ours, grads)
    for k, (p0, p) in enumerate(zip(params, ours)):
        r, m, v = p0.double(), torch.zeros_like(p0, dtype=torch.float64), 0
        for step in grads:
            g = step[k].double()
            r = r - lr * wd * r
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            r = r - lr * m / (v.sqrt() + eps)
        torch.testing.assert_close(p, r.float(), **_TOL)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_float64_parameters_update_in_float64(bias_correction):
    """fp64 parameters step in fp64 on every route that takes them (PyTorch's fused kernel,
    or the plain arithmetic, which ``bias_correction=False`` always takes): equal to
    PyTorch's float64 AdamW (with the moments as they are where there is no correction) to
    float64 rounding, not to fp32's. The plain route used to compute in fp32."""
    gen = torch.Generator().manual_seed(4)
    p = nn.Parameter(torch.randn(257, generator=gen, dtype=torch.float64))
    ref = p.detach().clone()
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.05
    opt = FusedAdam([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                    bias_correction=bias_correction)
    m = torch.zeros_like(ref)
    v = torch.zeros_like(ref)
    for step in range(1, 4):
        g = torch.randn(257, generator=gen, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        ref = ref - lr * wd * ref
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1 = 1 - b1 ** step if bias_correction else 1.0
        bc2 = (1 - b2 ** step) ** 0.5 if bias_correction else 1.0
        ref = ref - (lr / bc1) * m / (v.sqrt() / bc2 + eps)
    assert p.dtype == torch.float64
    torch.testing.assert_close(p.detach(), ref, rtol=1e-12, atol=1e-12)


def test_bias_correction_changed_between_steps_is_followed(device, path):
    """A group's ``bias_correction`` turned off after the first steps: later steps use the
    moments as they are (PyTorch's fused kernel, which always corrects, was kept for it)."""
    gen = torch.Generator().manual_seed(4)
    params = _params(device, gen, [(300,), (7, 11)])
    grads = _grads(params, gen, steps=4)
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    ours = [p.clone() for p in params]
    opt = FusedAdam(ours, lr=lr, betas=(b1, b2), eps=eps)
    for i, step in enumerate(grads):
        opt.param_groups[0]["bias_correction"] = i < 2
        for p, g in zip(ours, step):
            p.grad = g.clone()
        opt.step()
    for k, (p0, p) in enumerate(zip(params, ours)):
        r, m, v = p0.double(), 0, 0
        for i, step in enumerate(grads):
            g = step[k].double()
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            bc1, bc2 = (1 - b1 ** (i + 1), 1 - b2 ** (i + 1)) if i < 2 else (1.0, 1.0)
            r = r - lr / bc1 * m / (v.sqrt() / bc2 ** 0.5 + eps)
        torch.testing.assert_close(p, r.float(), **_TOL)


def test_groups_keep_their_own_options(device, path):
    gen = torch.Generator().manual_seed(2)
    a, b = _params(device, gen, [(300,), (7, 11)])
    grads = _grads([a, b], gen, steps=3)
    ours = [a.clone(), b.clone()]
    opt = FusedAdam([{"params": [ours[0]], "lr": 1e-1, "adam_w_mode": False,
                      "weight_decay": 0.3}, {"params": [ours[1]]}], lr=1e-3, weight_decay=0.1)
    ref = [a.double(), b.double()]
    ref_opt = [torch.optim.Adam([ref[0]], lr=1e-1, weight_decay=0.3, foreach=False),
               torch.optim.AdamW([ref[1]], lr=1e-3, weight_decay=0.1, foreach=False)]
    for step in grads:
        _step_both(step, ours, ref, opt, *ref_opt)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)


def test_a_groups_eps_given_or_set_later_is_the_one_used(device, path):
    """``eps`` is a per-group option, as in ``torch.optim.AdamW``: a group built with its own
    ``eps``, and a group whose ``eps`` is changed by hand between steps (a schedule on eps,
    as some fine-tuning recipes use), step with that value, not the constructor's. The eps
    values are large enough (0.5, 0.05) to change every update well past the tolerance;
    reference: ``torch.optim.AdamW`` (float64) with the same groups and the same change.
    (M03)"""
    gen = torch.Generator().manual_seed(71)
    a, b = _params(device, gen, [(300,), (7, 11)])
    grads = _grads([a, b], gen, steps=4)
    ours = [a.clone(), b.clone()]
    ref = [a.double(), b.double()]
    opt = FusedAdam([{"params": [ours[0]], "eps": 0.5}, {"params": [ours[1]]}], lr=1e-2,
                    weight_decay=0.1)
    ref_opt = torch.optim.AdamW([{"params": [ref[0]], "eps": 0.5}, {"params": [ref[1]]}],
                                lr=1e-2, weight_decay=0.1, foreach=False)
    for k, step in enumerate(grads):
        if k == 2:
            opt.param_groups[1]["eps"] = 0.05
            ref_opt.param_groups[1]["eps"] = 0.05
        _step_both(step, ours, ref, opt, ref_opt)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)


def test_parameters_without_gradients_are_left_alone(device, path):
    gen = torch.Generator().manual_seed(3)
    a, b = _params(device, gen, [(50,), (60,)])
    before = b.clone()
    opt = FusedAdam([a, b], lr=1e-2, weight_decay=0.5)
    a.grad = torch.randn_like(a)
    opt.step()
    assert torch.equal(b, before) and b not in opt.state


def test_a_gradient_of_another_layout_is_rerouted(device, path):
    """The route chosen at the first step is kept only while the gradients keep their layout:
    a transposed (strided) gradient later must not be read as if it were contiguous."""
    gen = torch.Generator().manual_seed(11)
    params = _params(device, gen, [(33, 17), (40,)])
    grads = _grads(params, gen, steps=3)
    ours = [p.clone() for p in params]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1)
    ref = [p.double() for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for k, step in enumerate(grads):
        for p, r, g in zip(ours, ref, step):
            if k == 1 and g.dim() == 2:  # the same values, laid out column-major
                p.grad = g.t().contiguous().t()
                assert not p.grad.is_contiguous()
            else:
                p.grad = g.clone()
            r.grad = g.double()
        opt.step()
        ref_opt.step()
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)


@pytest.mark.parametrize("flag", [1.0, 2.0], ids=["one_device", "two_devices_summed"])
def test_found_inf_skips_the_step_on_the_device(device, path, flag):
    """GradScaler's protocol: with ``found_inf`` set nothing moves, the step count included.
    GradScaler sums its devices' flags for a fused optimizer: 2 (two devices' gradients
    overflowed) is one skip too, not two step counts taken back nor, on PyTorch's fused
    kernel (which skips a flag of exactly 1), a step with inf gradients."""
    gen = torch.Generator().manual_seed(4)
    params = _params(device, gen)
    opt = _run(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1), params,
               _grads(params, gen, steps=2))
    snapshot = [(p.clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
        p.grad.view(-1)[0] = float("inf")
    opt.found_inf = torch.full((), flag, device=device)
    opt.grad_scale = None
    opt.step()
    for p, (p0, s0) in zip(params, snapshot):
        assert torch.equal(p, p0)
        for k, v in s0.items():
            assert torch.equal(opt.state[p][k], v), k
    opt.found_inf = torch.zeros((), device=device)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert all(opt.state[p]["step"].item() == 3.0 for p in params)
    assert not any(torch.equal(p, p0) for p, (p0, _) in zip(params, snapshot))


@pytest.mark.parametrize("scale", [1024.0, 0.25])
def test_grad_scale_divides_the_gradients(device, path, scale):
    """As GradScaler's scale, 1024, or below 1 after enough overflows (a scale rounded to an
    integer, 0, gave inf/NaN weights)."""
    gen = torch.Generator().manual_seed(5)
    params = _params(device, gen)
    grads = _grads(params, gen, steps=3)
    plain = [p.clone() for p in params]
    _run(lambda ps: FusedAdam(ps, lr=1e-2), plain, grads)
    scaled = [p.clone() for p in params]
    opt = FusedAdam(scaled, lr=1e-2)
    opt.grad_scale = torch.full((), scale, device=device)
    _run(lambda ps: opt, scaled, [[g * scale for g in step] for step in grads])
    # Dividing by a power of two is exact, but the compiled kernel with a grad_scale is another
    # specialization, whose fused multiply-adds may round differently: one fp32 ulp.
    for a, b in zip(scaled, plain):
        torch.testing.assert_close(a, b, rtol=2e-7, atol=2e-7)  # (H200: at most 6e-8)


def test_works_with_torch_grad_scaler(device, path):
    """``torch.amp.GradScaler`` hands FusedAdam its scale and flag, as to PyTorch's fused
    optimizers; a backward that overflows is skipped, the others match AdamW + GradScaler."""
    gen = torch.Generator().manual_seed(6)
    torch.manual_seed(0)
    model = nn.Linear(8, 3).to(device)
    ref_model = nn.Linear(8, 3).to(device)
    ref_model.load_state_dict(model.state_dict())
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1,
                                foreach=False)
    scalers = [torch.amp.GradScaler(device.type, init_scale=2.0**10) for _ in range(2)]
    for i in range(4):
        x = torch.randn(5, 8, generator=gen).to(device)
        if i == 2:
            x[0, 0] = float("inf")
        for m, o, s in ((model, opt, scalers[0]), (ref_model, ref_opt, scalers[1])):
            o.zero_grad()
            s.scale(m(x).square().mean()).backward()
            s.step(o)
            s.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**9
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, **_TOL)
    assert opt.state[model.weight]["step"].item() == 3.0


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_copies_are_the_masters_rounded_by_pytorch(device, path, half):
    """The copies written in the step equal ``master.to(half)`` bit for bit, ties (to even),
    the largest values (rounding to inf) and subnormals included. The specials sit in a group
    of rate 0, so every step leaves them exactly as they are and only their rounding is
    checked (with a rate, the decay moves them off the ties); the other masters step."""
    exact = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 5 * 2**-8, 1 + 2**-11,
                          1 + 3 * 2**-11, -(1 + 2**-11), 2 + 3 * 2**-10, 3.4e38, -3.4e38,
                          65519.0, 65520.0, 1e-40, 6e-8, 2**-25, -(2**-25)], device=device)
    gen = torch.Generator().manual_seed(7)
    others = _params(device, gen)
    specials = exact.clone()
    masters = [specials, *others]
    copies = [specials.to(half).zero_(), *(m.to(half) for m in others)]
    opt = FusedAdam([{"params": [specials], "lr": 0.0}, {"params": others}], lr=1e-2,
                    weight_decay=0.1)
    opt._link_half_copies(list(zip(copies, masters)))
    for _ in range(2):
        specials.grad = torch.zeros_like(specials)
        for m in others:
            m.grad = torch.randn(m.shape, generator=gen).to(device)
        opt.step()
        for m, c in zip(others, copies[1:]):
            assert torch.equal(c, m.to(half))
    assert torch.equal(specials.view(torch.int32), exact.view(torch.int32))
    assert torch.equal(copies[0].view(torch.int16), exact.to(half).view(torch.int16))
    assert {id(m) for m in opt._half_copies_written} == {id(m) for m in masters}


def test_state_dict_loads_into_torch_adamw_and_back(device, path):
    gen = torch.Generator().manual_seed(8)
    params = _params(device, gen)
    grads = _grads(params, gen, steps=6)
    ours = [p.clone() for p in params]
    opt = _run(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1), ours, grads[:3])
    theirs = [p.clone() for p in ours]
    torch_opt = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    # (Copies, as a checkpoint file gives: optimizers loading a live state dict share its
    # tensors.)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    # ... and a torch checkpoint (CPU step counts) back into a fresh FusedAdam.
    back = [p.clone() for p in ours]
    opt_back = FusedAdam(back, lr=123.0)
    opt_back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert opt_back.param_groups[0]["lr"] == 1e-2
    assert opt_back.param_groups[0]["adam_w_mode"] is True
    for step in grads[3:]:
        for group in (ours, theirs, back):
            for p, g in zip(group, step):
                p.grad = g.clone()
        opt.step()
        torch_opt.step()
        opt_back.step()
    for a, b, c in zip(ours, theirs, back):
        torch.testing.assert_close(a, b, **_TOL)
        torch.testing.assert_close(c, a, rtol=0, atol=0)
    assert opt_back.state[back[0]]["step"].device == back[0].device


def test_bad_arguments_say_what_to_do():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="AMSGrad variant is not supported"):
        FusedAdam(p, amsgrad=True)
    with pytest.raises(ValueError, match="opt_level='O2'"):
        FusedAdam(p, master_weights=True)
    # Apex's first FusedAdam (BERT scripts' --fp16 path, with FP16_Optimizer): its options at
    # their defaults do nothing; set, they are refused with the way to clip.
    FusedAdam(p, lr=1e-3, bias_correction=False, max_grad_norm=0.0, eps_inside_sqrt=False)
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0.*clip_grad_norm_\(amp"):
        FusedAdam(p, lr=1e-3, bias_correction=False, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"eps_inside_sqrt=True"):
        FusedAdam(p, eps_inside_sqrt=True)
    with pytest.raises(ValueError, match=r"FusedAdam\(lr=-0.1\)"):
        FusedAdam(p, lr=-0.1)
    with pytest.raises(ValueError, match=r"betas\[1\]=1.0"):
        FusedAdam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="pair of numbers"):
        FusedAdam(p, betas=0.9)
    emb = nn.Embedding(10, 3, sparse=True)
    opt = FusedAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    amsgrad = torch.optim.AdamW(p, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        FusedAdam(p).load_state_dict(amsgrad.state_dict())


def test_zero_grad_follows_set_grad_none():
    p = nn.Parameter(torch.ones(3))
    for set_grad_none, expected in ((True, None), (False, torch.zeros(3))):
        opt = FusedAdam([p], set_grad_none=set_grad_none)
        p.grad = torch.ones(3)
        opt.zero_grad()
        assert (p.grad is None) if expected is None else torch.equal(p.grad, expected)
    p.grad = torch.ones(3)
    FusedAdam([p], set_grad_none=False).zero_grad(set_to_none=True)
    assert p.grad is None


def test_closure_is_evaluated_with_grad():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    x = torch.randn(6, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.requires_grad and opt.state[model.weight]["step"].item() == 1.0


def _train_pair(params, ref, gen, steps, between=None):
    """``FusedAdam`` on ``params`` and ``torch.optim.AdamW`` (float64) on ``ref``, the same
    gradients; ``between(optimizer, i)`` runs on both after step ``i``."""
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for i in range(steps):
        for p, r in zip(params, ref):
            g = torch.randn(p.shape, generator=gen).to(p.device)
            p.grad, r.grad = g, g.double()
        opt.step()
        ref_opt.step()
        if between is not None:
            between(opt, i)
            between(ref_opt, i)
    return opt, ref_opt


@pytest.mark.parametrize("reset", ["clear", "new_dict", "del"])
def test_a_reset_state_starts_the_moments_afresh(device, path, reset):
    """Clearing ``optimizer.state`` (a common reset of the moments) is seen by the next step,
    as by torch's optimizers: new moments, and ``state_dict()`` saves them. The cached routing
    plan kept stepping the old moments, and checkpoints came out with no state at all."""
    gen = torch.Generator().manual_seed(11)
    params = _params(device, gen, [(37, 29), (5,)])
    ref = [p.double() for p in params]

    def between(opt, i):
        if i == 1:
            if reset == "clear":
                opt.state.clear()
            elif reset == "new_dict":
                opt.state = collections.defaultdict(dict)
            else:
                for p in opt.param_groups[0]["params"]:
                    del opt.state[p]

    opt, ref_opt = _train_pair(params, ref, gen, 4, between)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)
        assert opt.state[p]["step"].item() == 2.0
    saved = opt.state_dict()["state"]
    assert sorted(saved) == [0, 1] and saved[0]["step"].item() == 2.0


@pytest.mark.parametrize("change", ["strided moment", "step count reset", "bf16 moment",
                                    "float64 step count", "strided second moment",
                                    "bf16 second moment"])
def test_a_state_tensor_replaced_in_a_kept_state_is_stepped_as_it_now_is(device, path, change):
    """One moment or step count replaced by hand inside a kept state dict after the first
    step (a moment re-laid out or cast to save memory, a step count reset, a count restored
    from an AdamW run under a float64 default dtype): the cached plan handed the new tensor
    to the fused kernels unchecked (non-finite weights, a process aborted by heap
    corruption), or stepped the old step count while the new one, read by the plain route,
    stayed 0 (NaN weights); PyTorch's CUDA fused kernel read a float64 count as fp32 (NaN
    weights). Reference: torch.optim.AdamW (float64) given the same change; a bf16 moment,
    which AdamW refuses, must train finite and near it."""
    gen = torch.Generator().manual_seed(13)
    params = _params(device, gen, [(37, 29), (5,)])
    ref = [p.double() for p in params]

    def between(opt, i):
        if i != 0:
            return
        # (The second moment as the first: re-laid out, or cast to bf16 as some
        # memory-saving recipes do with exp_avg_sq; r70A's M29.)
        key = "exp_avg_sq" if change.endswith("second moment") else "exp_avg"
        for p in opt.param_groups[0]["params"]:
            state = opt.state[p]
            if change.startswith("strided"):
                spread = torch.zeros(2 * p.numel(), dtype=p.dtype, device=p.device)
                state[key] = spread[::2].view(p.shape).copy_(state[key])
            elif change == "step count reset":
                state["step"] = torch.zeros_like(state["step"])
            elif change == "float64 step count":
                state["step"] = state["step"].to(torch.float64)
            elif p.dtype is torch.float32:  # (the float64 reference keeps its moment)
                state[key] = state[key].bfloat16()

    opt, ref_opt = _train_pair(params, ref, gen, 4, between)
    tol = dict(rtol=1e-2, atol=1e-3) if change.startswith("bf16") else _TOL
    for p, r in zip(params, ref):
        assert p.isfinite().all()
        torch.testing.assert_close(p, r.float(), **tol)
    if change == "step count reset":
        assert [opt.state[p]["step"].item() for p in params] == [3.0, 3.0]


@pytest.mark.parametrize("bad", ["moment of another size", "step count a float", "no moment"])
def test_a_state_tensor_replaced_badly_is_refused_before_anything_is_written(device, path, bad):
    """A moment of another size put in after the first step read and wrote past the moments
    (a segfault on the Triton kernel, heap corruption on PyTorch's fused CPU kernel): refused
    as at the first step, with what to do; so are a step count that is not a tensor and a
    moment deleted (a bare KeyError before)."""
    gen = torch.Generator().manual_seed(14)
    params = _params(device, gen, [(2050,), (5,)])
    opt = FusedAdam(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)
    opt.step()
    state = opt.state[params[0]]
    if bad == "moment of another size":
        state["exp_avg_sq"] = state["exp_avg_sq"][:16].clone()
        message = r"has an exp_avg_sq of shape \(16,\)"
    elif bad == "step count a float":
        state["step"] = 0.0
        message = "has a step count of type float"
    else:
        del state["exp_avg"]
        message = "has no exp_avg in its state"
    before = [p.clone() for p in params]
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    for p, b in zip(params, before):
        torch.testing.assert_close(p, b, rtol=0, atol=0)


def test_a_step_count_deleted_by_hand_is_named_with_the_way_out(device, path):
    """``del optimizer.state[p]["step"]`` (a script resetting the bias correction by hand):
    the step names what is missing and how to reset, as for a deleted moment (not a bare
    ``KeyError: 'step'``), before anything is written; the reset it names then works.
    (M12)"""
    gen = torch.Generator().manual_seed(72)
    params = _params(device, gen, [(2050,), (5,)])
    opt = FusedAdam(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)
    opt.step()
    del opt.state[params[0]]["step"]
    before = [p.clone() for p in params]
    with pytest.raises(RuntimeError, match=r"has no step in its state \(it holds 'exp_avg', "
                                           r"'exp_avg_sq'\).*optimizer.state\[p\] = \{\}"):
        opt.step()
    for p, b in zip(params, before):
        torch.testing.assert_close(p, b, rtol=0, atol=0)
    opt.state[params[0]] = {}
    opt.step()
    assert [opt.state[p]["step"].item() for p in params] == [1.0, 2.0]


def test_another_optimizers_checkpoint_is_refused_before_anything_is_loaded():
    # An SGD or Adagrad checkpoint loaded silently and the next step failed with a bare
    # KeyError: 'exp_avg'.
    params = [nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(3))]
    for cls, kw, held in ((torch.optim.SGD, dict(lr=0.1, momentum=0.9), "'momentum_buffer'"),
                          (torch.optim.Adagrad, dict(lr=0.1), "'sum'"),
                          # (Adamax: exp_avg, but exp_inf where Adam keeps exp_avg_sq)
                          (torch.optim.Adamax, dict(lr=0.1), "'exp_inf'")):
        other = cls(params, **kw)
        for p in params:
            p.grad = torch.ones_like(p)
        other.step()
        opt = FusedAdam(params, lr=1e-2)
        with pytest.raises(ValueError, match=f"parameter 0 holds .*{held}.*saved by another"):
            opt.load_state_dict(other.state_dict())
        assert not opt.state and opt.param_groups[0]["lr"] == 1e-2


@pytest.mark.parametrize("key, value, message", [
    ("lr", -1.0, r"lr=-1.0: lr must be a number >= 0"),
    ("lr", "abc", r"lr='abc': lr must be a number >= 0 or a one-element floating tensor"),
    ("eps", -1.0, r"eps=-1.0: eps must be a number >= 0"),
    ("weight_decay", -5.0, r"weight_decay=-5.0: weight_decay must be a number >= 0"),
    ("betas", (0.9, 1.5), r"betas\[1\]=1.5: betas\[1\] must be a number in \[0.0, 1.0\)"),
    ("betas", (-0.5, 0.999), r"betas\[0\]=-0.5: betas\[0\] must be a number in \[0.0, 1.0\)"),
    ("betas", (0.9, -0.25), r"betas\[1\]=-0.25: betas\[1\] must be a number in \[0.0, 1.0\)"),
    ("betas", (0.9, float("nan")), r"betas\[1\]=nan: betas\[1\] must be a number in \[0.0, 1.0\)"),
    # A beta of exactly 1 (a schedule ramping beta2 up to 1.0): its bias correction
    # 1 - 1 ** step is 0, and the step divides by it. (r64B's F02)
    ("betas", (0.9, 1.0), r"betas\[1\]=1.0: betas\[1\] must be a number in \[0.0, 1.0\)"),
    ("betas", (1.0, 0.999), r"betas\[0\]=1.0: betas\[0\] must be a number in \[0.0, 1.0\)"),
])
def test_hyperparameters_set_by_hand_are_checked_at_the_step(key, value, message):
    # Set in a group after the constructor's checks: lr=-1 stepped the wrong way, eps=-1 gave
    # -inf weights, betas[1]=1.5 and weight_decay=-5 NaN, "abc" a bare "could not convert";
    # the range of betas is checked below as above (a negative beta1 stepped without its bias
    # correction on the kernel's route, where torch.optim.AdamW uses 1 - beta1 ** step).
    p = nn.Parameter(torch.randn(4))
    opt = FusedAdam([p], lr=1e-2)
    opt.param_groups[0][key] = value
    p.grad = torch.ones(4)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="FusedAdam param group 0: " + message):
        opt.step()
    torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)
    opt.param_groups[0][key] = {"lr": 1, "eps": 0, "weight_decay": 0,
                                "betas": (0.5, 0.25)}[key]  # ints and 0 are fine
    opt.step()
    assert p.isfinite().all()


@pytest.mark.parametrize("name", ["bias_correction", "adam_w_mode", "set_grad_none",
                                  "capturable", "amsgrad", "master_weights"])
def test_a_flag_given_as_a_string_is_refused(name):
    # "False" was read as True, as any non-empty string is (set_grad_none, capturable); the
    # refusals of amsgrad=True / master_weights=True named True for a string.
    with pytest.raises(TypeError, match=rf"FusedAdam\({name}='False'\): expected True or False"):
        FusedAdam([nn.Parameter(torch.zeros(2))], **{name: "False"})


def test_an_integer_parameter_is_refused_with_advice_for_integers():
    p = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    p.grad = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"is torch\.int64; .*integer tensors are not trained "
                       r"by gradient: register them as buffers"):
        FusedAdam([p]).step()


@pytest.mark.parametrize("reset", ["new_dict", "clear", "del"])
def test_one_parameters_reset_state_starts_its_moments_afresh(device, path, reset):
    """One parameter's state reset by hand (``state[p] = {}``, ``state[p].clear()``, ``del
    state[p]``), here in the step where a parameter of an earlier group gets its first
    gradient (so the optimizer's state count is unchanged): that parameter starts fresh
    moments, as in PyTorch's AdamW, and the checkpoint saves them. The cached plan of its
    group used to keep stepping the old moments (or failed with a KeyError after
    ``clear()``)."""
    gen = torch.Generator().manual_seed(12)
    params = _params(device, gen, [(37, 29), (5,)])
    ref = [p.double() for p in params]
    # Group 0 holds the late parameter, group 1 the one reset.
    opt = FusedAdam([{"params": [params[1]]}, {"params": [params[0]]}], lr=1e-2,
                    weight_decay=0.1)
    ref_opt = torch.optim.AdamW([{"params": [ref[1]]}, {"params": [ref[0]]}], lr=1e-2,
                                weight_decay=0.1, foreach=False)
    for i in range(4):
        for j, (p, r) in enumerate(zip(params, ref)):
            if j == 1 and i < 2:  # the second parameter's first gradient comes at step 2
                p.grad = r.grad = None
                continue
            g = torch.randn(p.shape, generator=gen).to(p.device)
            p.grad, r.grad = g, g.double()
        # (A dict replaced or cleared keeps the state count: any step shows it. A deletion
        # does only where another parameter's first state makes up the count: step 2.)
        if i == (2 if reset == "del" else 3):
            for o, first in ((opt, params[0]), (ref_opt, ref[0])):
                if reset == "new_dict":
                    o.state[first] = {}
                elif reset == "clear":
                    o.state[first].clear()
                else:
                    del o.state[first]
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)
        assert opt.state[p]["step"].item() == ref_opt.state[r]["step"].item()
    assert ref_opt.state[ref[0]]["step"].item() == (2.0 if reset == "del" else 1.0)
    saved = opt.state_dict()["state"]
    assert sorted(saved) == [0, 1]
    assert saved[1]["step"].item() == ref_opt.state[ref[0]]["step"].item()


def test_a_parameter_converted_through_data_is_replanned(device, path):
    """``p.data = p.data.half()`` (what ``module.half()`` does) after a step: the cached plan
    sent the fp16 parameter to the fp32 kernel, which wrote 4-byte values into the 2-byte
    storage (heap corruption). The plan is rebuilt and the parameter takes a route of its
    dtype, or PyTorch's error for the fp32 moments beside it; never the fp32 kernel."""
    gen = torch.Generator().manual_seed(13)
    p = _params(device, gen, [(2050,)])[0]
    opt = FusedAdam([p], lr=1e-2)
    p.grad = torch.randn(p.shape, generator=gen).to(device)
    opt.step()
    p.data = p.data.half()
    before = p.detach().clone()
    p.grad = torch.randn(p.shape, generator=gen).to(device).half()
    calls = []
    real = fused_adam._adam_kernel.adam_step_
    fused_adam._adam_kernel.adam_step_ = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        opt.step()
    except RuntimeError as err:  # (PyTorch's fused kernel: fp16 parameter, fp32 moments)
        assert "Half" in str(err) or "dtype" in str(err), str(err)
    finally:
        fused_adam._adam_kernel.adam_step_ = real
    assert not calls, "an fp16 parameter went to the fp32 kernel"
    assert p.dtype == torch.float16 and torch.isfinite(p).all()
    assert (p.float() - before.float()).abs().max() <= 2e-2


def test_complex_and_integer_parameters_are_a_clear_error():
    for dtype in (torch.complex64, torch.int64):
        p = nn.Parameter(torch.zeros(2, dtype=dtype), requires_grad=dtype.is_complex)
        if not dtype.is_complex:
            p.grad = torch.zeros(2, dtype=dtype)
        else:
            p.grad = torch.ones(2, dtype=dtype)
        for kw in ({}, {"bias_correction": False}):
            with pytest.raises(TypeError, match=rf"is {dtype}; FusedAdam steps real "
                                                r"floating-point parameters"):
                FusedAdam([p], **kw).step()


def test_a_gradient_turned_sparse_after_the_first_step_is_refused(device, path):
    """A sparse gradient is refused on every route, also when the parameter's earlier
    gradients were dense (an embedding switched to ``sparse=True``): the cached route is not
    taken for it, and nothing is updated."""
    emb = nn.Embedding(10, 3).to(device)
    opt = FusedAdam(emb.parameters(), lr=1e-2)
    idx = torch.tensor([1, 2], device=device)
    emb(idx).sum().backward()
    opt.step()
    emb.sparse = True
    opt.zero_grad()
    emb(idx).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    assert torch.equal(emb.weight, before)


def test_a_refused_checkpoint_leaves_the_optimizer_as_it_was():
    """A checkpoint FusedAdam cannot take (amsgrad, maximize, a bad option) is refused before
    anything is loaded: the optimizer keeps its options and state and steps on."""
    p = nn.Parameter(torch.ones(3))
    opt = FusedAdam([p], lr=1e-3)
    p.grad = torch.ones(3)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    other = nn.Parameter(torch.ones(3))
    for make in (lambda: torch.optim.Adam([other], lr=0.5, amsgrad=True),
                 lambda: torch.optim.Adam([other], lr=0.5, maximize=True)):
        src = make()
        other.grad = torch.ones(3)
        src.step()
        with pytest.raises(ValueError, match=r"param group 0: the checkpoint's optimizer used"):
            opt.load_state_dict(src.state_dict())
        after = opt.state_dict()
        assert after["param_groups"] == before["param_groups"]
        torch.testing.assert_close(after["state"], before["state"], rtol=0, atol=0)
    bad = copy.deepcopy(before)
    bad["param_groups"][0]["eps"] = -1.0
    with pytest.raises(ValueError, match=r"param group 0: eps=-1.0: eps must be a number"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["eps"] == 1e-8
    opt.step()
    assert opt.state[p]["step"].item() == 2.0


@pytest.mark.parametrize("spoil", ["amsgrad", "maximize", "eps"])
def test_a_checkpoint_refused_for_a_later_group_leaves_the_optimizer_as_it_was(spoil):
    """A checkpoint whose second group FusedAdam cannot take (``amsgrad``/``maximize`` of a
    ``torch.optim.Adam`` group, a negative ``eps``) is refused naming that group, before
    anything is loaded: the optimizer keeps its options and state and steps on. (Only the
    first group was checked; the rest loaded, and the step then refused the optimizer.)
    (M08)"""
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    opt = FusedAdam([{"params": [a]}, {"params": [b]}], lr=1e-3)
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(before)
    bad["param_groups"][1][spoil] = -1.0 if spoil == "eps" else True
    message = ("eps=-1.0: eps must be a number" if spoil == "eps"
               else f"the checkpoint's optimizer used .*{spoil}=True")
    with pytest.raises(ValueError, match=r"load_state_dict: param group 1: " + message):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    torch.testing.assert_close(after["state"], before["state"], rtol=0, atol=0)
    opt.step()
    assert opt.state[b]["step"].item() == 2.0


def test_a_checkpoint_of_apexs_fused_adam_resumes(device, path):
    # Apex's FusedAdam kept one step count per group (group["step"], an int) and only the
    # moments per parameter; loading such a checkpoint failed at the first step (KeyError).
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (3,)]
    weights = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    moments = [(torch.randn(s, generator=gen, dtype=torch.float64) * 0.1,
                torch.rand(s, generator=gen, dtype=torch.float64) * 0.01) for s in shapes]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    apex_checkpoint = {
        "state": {i: {"exp_avg": m.float(), "exp_avg_sq": v.float()}
                  for i, (m, v) in enumerate(moments)},
        "param_groups": [{"lr": 1e-2, "bias_correction": True, "betas": (0.9, 0.999),
                          "eps": 1e-8, "weight_decay": 0.01, "step": 3, "params": [0, 1]}],
    }
    # Reference: torch's AdamW in float64, resumed at step 3 from the same moments.
    ref_params = [nn.Parameter(w.clone()) for w in weights]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01)
    ref.load_state_dict({
        "state": {i: {"step": torch.tensor(3.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
                  for i, (m, v) in enumerate(moments)},
        "param_groups": [{**ref.state_dict()["param_groups"][0], "params": [0, 1]}]})
    params = [nn.Parameter(w.float().to(device)) for w in weights]
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.01)
    opt.load_state_dict(apex_checkpoint)
    assert "step" not in opt.param_groups[0]
    for p, r, g in zip(params, ref_params, grads):
        p.grad, r.grad = g.float().to(device), g.clone()
    opt.step()
    ref.step()
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.double().cpu(), r.detach(), rtol=1e-5, atol=1e-6)
        assert float(opt.state[p]["step"]) == 4.0


def test_numpy_hyperparameters_are_taken_as_torch_optim_takes_them(device):
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(0)
    params = _params(device, gen)
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedAdam(params, lr=np.float32(1e-2), betas=(np.float32(0.9), np.float64(0.99)),
                    eps=np.float32(1e-6), weight_decay=np.float32(0.01))
    ref = FusedAdam(ref_params, lr=float(np.float32(1e-2)), betas=(float(np.float32(0.9)), 0.99),
                    eps=float(np.float32(1e-6)), weight_decay=float(np.float32(0.01)))
    for p, r in zip(params, ref_params):
        p.grad = torch.randn(p.shape, generator=gen).to(device)
        r.grad = p.grad.clone()
    opt.step()
    ref.step()
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=0, atol=0)


def test_tensor_betas_are_read_at_each_step_as_pytorch_reads_them(device, path):
    """Tensor betas (``torch.optim.Adam`` takes them, e.g. for a momentum schedule that changes
    them in place) were refused as "not a number": each step reads their value, as PyTorch's
    fused Adam does, so a change in place is followed (float64 reference: PyTorch's AdamW with
    float betas set to the same values)."""
    gen = torch.Generator().manual_seed(21)
    params = _params(device, gen, [(37, 29), (2050,), (3,)])
    grads = _grads(params, gen, steps=5)
    ours = [p.clone() for p in params]
    betas = (torch.tensor(0.8, dtype=torch.float64), torch.tensor(0.99, dtype=torch.float64))
    opt = FusedAdam(ours, lr=1e-2, betas=betas, weight_decay=0.1)
    ref = [p.double() for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1,
                                foreach=False)
    for k, step in enumerate(grads):
        if k == 2:  # (a schedule's change, in place)
            betas[0].fill_(0.5)
            betas[1].fill_(0.9)
            ref_opt.param_groups[0]["betas"] = (0.5, 0.9)
        _step_both(step, ours, ref, opt, ref_opt)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)
    assert opt.param_groups[0]["betas"][0] is betas[0]  # (kept, not copied to a float)
    # Its state dict carries them; PyTorch's AdamW takes them as its own.
    torch.optim.AdamW([r.clone() for r in ref], foreach=False).load_state_dict(
        copy.deepcopy(opt.state_dict()))


def test_bad_tensor_betas_say_what_to_do(monkeypatch):
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"FusedAdam\(betas\[0\]=a torch.float32 tensor of "
                                         r"shape \(2,\) on cpu\): a tensor beta must hold one"):
        FusedAdam([p], betas=(torch.tensor([0.9, 0.9]), torch.tensor(0.999)))
    with pytest.raises(ValueError, match=r"betas\[1\]=a torch.int64 .* must be floating point"):
        FusedAdam([p], betas=(0.9, torch.tensor(0)))
    with pytest.raises(ValueError, match=r"holding 1.0\): a beta must be in \[0.0, 1.0\)"):
        FusedAdam([p], betas=(0.9, torch.tensor(1.0)))
    opt = FusedAdam([p], betas=(torch.tensor(0.9), torch.tensor(0.999)))
    with pytest.raises(ValueError, match=r"FusedAdam param group 1: betas\[0\]=.*holding -0.5"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))],
                             "betas": (torch.tensor(-0.5), 0.9)})
    p.grad = torch.ones(2)
    opt.step()
    # Set by hand (or filled in place) after the checks: refused before anything changes.
    opt.param_groups[0]["betas"][1].fill_(1.5)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"FusedAdam param group 0: betas\[1\]=.*holding 1.5"):
        opt.step()
    assert torch.equal(p, before) and opt.state[p]["step"].item() == 1.0
    # Inside a CUDA-graph capture a replay would keep the value read at the capture (and a
    # GPU tensor cannot be read there): refused with what to pass. (Simulated on the CPU.)
    opt.param_groups[0]["betas"][1].fill_(0.999)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"betas\[0\] is a tensor .* captured in a CUDA "
                                           r"graph.*Pass floats"):
        opt.step()
    assert torch.equal(p, before) and opt.state[p]["step"].item() == 1.0


def test_tensor_betas_of_zero_or_of_shape_one_step_as_their_floats(device, path):
    """Tensor betas are documented as one-element floating tensors in [0, 1): a
    ``torch.tensor(0.0)`` first-moment decay (GAN training's ``betas[0] = 0``, here driven
    by a momentum schedule's tensor) and a shape-(1,) tensor (what slicing a schedule's
    buffer gives) are taken, and the update is ``torch.optim.AdamW``'s (float64) with the
    same betas as floats. (M01, M02)"""
    gen = torch.Generator().manual_seed(70)
    params = _params(device, gen, [(3,), (37, 29), (2050,)])
    grads = _grads(params, gen, steps=3)
    ours = [p.clone() for p in params]
    betas = (torch.tensor(0.0, dtype=torch.float64), torch.tensor([0.99]))
    _run(lambda ps: FusedAdam(ps, lr=1e-2, betas=betas, weight_decay=0.1), ours, grads)
    ref = [p.double() for p in params]
    _run(_torch_reference(True, lr=1e-2, betas=(0.0, betas[1].item()), weight_decay=0.1),
         ref, grads)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)


@pytest.mark.parametrize("bad, message", [
    (lambda: torch.tensor([0.9, 0.9]), r"betas\[0\]=a torch.float32 tensor of shape \(2,\) "
                                       r"on cpu: a tensor beta must hold one element"),
    (lambda: torch.tensor(0), r"betas\[0\]=a torch.int64 tensor .*: a tensor beta must be "
                              r"floating point"),
], ids=["two elements", "integer"])
def test_a_tensor_beta_replaced_by_hand_is_checked_as_the_constructors(bad, message):
    """A tensor beta put into a group by hand after the constructor's checks (a schedule that
    swaps in a new tensor) is checked at the step as the constructor checks it: a tensor of
    two elements or an integer one is refused with the constructor's message (not PyTorch's
    bare "cannot be converted to Scalar", nor an integer 0 taken as a decay rate), before
    anything is written. (M11)"""
    p = nn.Parameter(torch.ones(4))
    opt = FusedAdam([p], lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.999)))
    p.grad = torch.ones(4)
    opt.step()
    opt.param_groups[0]["betas"] = (bad(), torch.tensor(0.999))
    before = p.detach().clone()
    with pytest.raises(ValueError, match="FusedAdam param group 0: " + message):
        opt.step()
    assert torch.equal(p.detach(), before) and opt.state[p]["step"].item() == 1.0


def test_a_param_groups_options_are_checked_as_the_constructors():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"FusedAdam param group 1: betas\[0\]=2.0: betas\[0\] "
                                         r"must be a number in \[0.0, 1.0\)"):
        FusedAdam([{"params": [a]}, {"params": [b], "betas": (2.0, 0.9)}])
    opt = FusedAdam([a])
    with pytest.raises(ValueError, match=r"FusedAdam param group 1: eps=-1: eps must be"):
        opt.add_param_group({"params": [b], "eps": -1})
    with pytest.raises(ValueError, match=r"FusedAdam param group 1: weight_decay=-0.1"):
        opt.add_param_group({"params": [b], "weight_decay": -0.1})
    assert len(opt.param_groups) == 1


def test_a_groups_amsgrad_or_maximize_is_refused_as_the_constructors():
    """A group's ``amsgrad=True``/``maximize=True`` was taken silently, ignored by the step
    (plain Adam, minimizing), saved in ``state_dict()`` and then refused by FusedAdam's own
    ``load_state_dict``: refused up front, as the constructor's ``amsgrad=True`` is."""
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    for key in ("amsgrad", "maximize"):
        with pytest.raises(ValueError, match=rf"FusedAdam param group 1: .*{key}=True.*: "
                                             r"FusedAdam supports neither"):
            FusedAdam([{"params": [a]}, {"params": [b], key: True}])
        opt = FusedAdam([a])
        with pytest.raises(ValueError, match=rf"param group 1: .*{key}=True"):
            opt.add_param_group({"params": [b], key: True})
        assert len(opt.param_groups) == 1
    # (False, as torch.optim.AdamW's state dicts say, is taken.)
    opt = FusedAdam([{"params": [a], "amsgrad": False, "maximize": False}])
    FusedAdam([b]).load_state_dict(copy.deepcopy(opt.state_dict()))


def test_moments_of_another_shape_are_refused_before_any_write(device, path):
    """Moments not of the parameter's shape (a checkpoint of another model, a parameter resized
    through ``.data``) reached PyTorch's fused kernel, which checks no sizes on the CPU: it
    read and wrote past the moments (segfaults, heap corruption, with larger sizes here) where
    ``torch.optim.AdamW`` raises. Now a clear error, before anything is written."""
    small = nn.Parameter(torch.ones(3, device=device))
    src = FusedAdam([small], lr=0.1)
    small.grad = torch.ones(3, device=device)
    src.step()
    for how in ("checkpoint", "resized"):
        p = nn.Parameter(torch.ones(3, device=device))
        opt = FusedAdam([p], lr=0.1)
        if how == "checkpoint":
            p.data = torch.ones(4, device=device)
            opt.load_state_dict(copy.deepcopy(src.state_dict()))
        else:
            p.grad = torch.ones(3, device=device)
            opt.step()
            p.data = torch.ones(4, device=device)
        p.grad = torch.ones(4, device=device)
        before = p.detach().clone()
        with pytest.raises(RuntimeError, match=r"shape \(4,\) has an exp_avg of shape \(3,\)"):
            opt.step()
        assert torch.equal(p, before), how
        assert opt.state[p]["step"].item() == 1.0, how
        opt.state[p] = {}  # the way out the error names
        opt.step()
        assert opt.state[p]["step"].item() == 1.0 and not torch.equal(p, before)


def test_amsgrad_or_maximize_set_on_a_group_by_hand_is_refused_at_the_step(device):
    """``group["amsgrad"] = True`` (or ``maximize``) set after construction was ignored: plain
    Adam ran, minimizing, where ``torch.optim.AdamW`` reads the option at each step (AMSGrad
    here changes the update: a large first gradient, then small ones). Now refused by the
    step before it changes anything."""
    for key in ("amsgrad", "maximize"):
        p = nn.Parameter(torch.ones(3, device=device))
        ref = nn.Parameter(torch.ones(3, device=device))
        opt = FusedAdam([p], lr=0.1, weight_decay=0.0)
        ref_opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0, foreach=False)
        opt.param_groups[0][key] = True
        ref_opt.param_groups[0][key] = True
        for scale in (10.0, 0.1):
            ref.grad = torch.full((3,), scale, device=device)
            ref_opt.step()
        unset = ref.detach().clone()
        ref_opt.param_groups[0][key] = False
        ref.data.fill_(1.0)
        ref_opt.state[ref] = {}
        for scale in (10.0, 0.1):
            ref.grad = torch.full((3,), scale, device=device)
            ref_opt.step()
        assert not torch.allclose(unset, ref), key  # (the option matters to PyTorch)
        p.grad = torch.ones(3, device=device)
        with pytest.raises(ValueError, match=rf"FusedAdam param group 0: .*{key}=True.*"
                                             r"supports neither.*set it to False"):
            opt.step()
        assert torch.equal(p, torch.ones(3, device=device)) and not opt.state[p]
        opt.param_groups[0][key] = False  # the way out the error names
        opt.step()
        assert opt.state[p]["step"].item() == 1.0


def test_a_refusal_in_a_later_group_leaves_earlier_groups_unstepped(device):
    """A refusal at the step (an option set by hand, a reshaped parameter, a bad tensor beta)
    in the second group came after the first group was stepped: retried, the first group then
    stepped twice. Every group is checked and planned before any is stepped."""
    def bad_option(opt, q):
        opt.param_groups[1]["amsgrad"] = True

    def reshaped(opt, q):
        q.data = q.data.reshape(2, 3)

    def bad_beta(opt, q):
        opt.param_groups[1]["betas"] = (torch.tensor(1.5), 0.999)

    for spoil in (bad_option, reshaped, bad_beta):
        p = nn.Parameter(torch.ones(4, device=device))
        q = nn.Parameter(torch.ones(3, 2, device=device))
        opt = FusedAdam([{"params": [p]}, {"params": [q]}], lr=0.1)
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        opt.step()
        before = p.detach().clone()
        spoil(opt, q)
        q.grad = torch.ones_like(q)
        with pytest.raises((ValueError, RuntimeError), match="FusedAdam"):
            opt.step()
        assert torch.equal(p, before) and opt.state[p]["step"].item() == 1.0, spoil.__name__


def test_a_parameter_converted_to_a_dtype_of_its_size_is_replanned(device, path):
    """``p.data = p.data.bfloat16()`` on an fp16 parameter after some steps: its byte size is
    the same, so the cached route stayed: PyTorch's fused kernel then got a bf16 parameter
    with fp16 moments (its dtype error after the step counts were already raised). Now it is
    re-planned as any converted parameter: its moments, in their dtype, step it through the
    plain arithmetic (float64 reference: PyTorch's AdamW resumed from the same state)."""
    gen = torch.Generator().manual_seed(22)
    p = nn.Parameter(torch.randn(37, 29, generator=gen).half().to(device))
    opt = FusedAdam([p], lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        p.grad = torch.randn(p.shape, generator=gen).half().to(device)
        opt.step()
    p.data = p.data.bfloat16()
    state = opt.state[p]
    ref = nn.Parameter(p.detach().double().cpu())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    ref_opt.load_state_dict({
        "state": {0: {"step": torch.tensor(2.0), "exp_avg": state["exp_avg"].double().cpu(),
                      "exp_avg_sq": state["exp_avg_sq"].double().cpu()}},
        "param_groups": ref_opt.state_dict()["param_groups"]})
    g = torch.randn(p.shape, generator=gen)
    p.grad, ref.grad = g.bfloat16().to(device), g.bfloat16().double()
    opt.step()
    ref_opt.step()
    assert p.dtype == torch.bfloat16 and state["exp_avg"].dtype == torch.float16
    assert state["step"].item() == 3.0
    # (One bf16 rounding of the result; fp16 roundings of the moments.)
    torch.testing.assert_close(p.double().cpu(), ref.detach(), rtol=2 ** -8, atol=1e-6)
    ref_state = ref_opt.state[ref]
    torch.testing.assert_close(state["exp_avg"].double().cpu(), ref_state["exp_avg"],
                               rtol=2 ** -10, atol=1e-7)
    torch.testing.assert_close(state["exp_avg_sq"].double().cpu(), ref_state["exp_avg_sq"],
                               rtol=2 ** -10, atol=1e-7)


@pytest.mark.parametrize("how", ["transposed", "flattened"])
def test_a_parameter_reshaped_through_data_is_refused(device, path, how):
    """A parameter reshaped through ``.data`` to as many elements: the cached route stayed
    (same byte size) and the fused routes stepped it against its old moments in memory order,
    a transposed parameter's moments belonging to other elements, with the state left of the
    old shape. ``torch.optim.AdamW`` raises (broadcasting fails); FusedAdam now refuses as for
    moments of another shape, before anything is written."""
    gen = torch.Generator().manual_seed(23)
    p = _params(device, gen, [(37, 29)])[0]
    ref = p.detach().clone()
    opt = FusedAdam([p], lr=1e-2)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    for _ in range(2):
        p.grad = torch.randn(p.shape, generator=gen).to(device)
        ref.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for t in (p, ref):
        t.data = t.data.t().contiguous() if how == "transposed" else t.data.reshape(-1)
        t.grad = torch.randn(t.shape, generator=gen).to(device)
    with pytest.raises(RuntimeError):
        ref_opt.step()
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match=rf"shape {re.escape(str(tuple(p.shape)))} has an exp_avg of shape "
                                           r"\(37, 29\).*reshaped through .data"):
        opt.step()
    assert torch.equal(p, before) and opt.state[p]["step"].item() == 2.0
    opt.state[p] = {}  # the way out the error names
    opt.step()
    assert opt.state[p]["step"].item() == 1.0 and opt.state[p]["exp_avg"].shape == p.shape


def test_deepcopy_and_pickle_give_a_working_optimizer(device, path):
    """``copy.deepcopy`` and pickling keep the options and give an optimizer that steps as the
    original does (PyTorch's __getstate__ dropped FusedAdam's own attributes: AttributeError at
    the copy's first step)."""
    gen = torch.Generator().manual_seed(12)
    params = _params(device, gen, [(37, 29), (5,)])
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1, set_grad_none=False)
    grads = _grads(params, gen, steps=4)
    for step in grads[:2]:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    copies = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    for step in grads[2:]:
        for o in [opt, *copies]:
            for p, g in zip(o.param_groups[0]["params"], step):
                p.grad = g.clone()
            o.step()
    for o in copies:
        assert o.set_grad_none is False
        for p, q in zip(params, o.param_groups[0]["params"]):
            torch.testing.assert_close(q, p, rtol=0, atol=0)
            assert o.state[q]["step"].item() == 4.0
        o.zero_grad()
        assert torch.count_nonzero(o.param_groups[0]["params"][0].grad) == 0


def test_deepcopy_and_pickle_keep_capturable():
    """``capturable`` (Apex's option, taken for compatibility) is an attribute that scripts
    ported from Apex read back, e.g. to decide whether to capture the step in a CUDA graph:
    a copy or an unpickled optimizer (a checkpoint saved whole) keeps the value it was built
    with, as it keeps ``set_grad_none``. (F08)"""
    opt = FusedAdam([nn.Parameter(torch.zeros(2))], capturable=True, set_grad_none=False)
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert other.capturable is True and other.set_grad_none is False


def test_a_compiled_training_step_steps_eagerly(device, path):
    """``torch.compile`` of a function calling ``step()``: the step is a graph break, and the
    result is the eager one (traced, it died in Inductor with an internal assert)."""
    torch._dynamo.reset()
    torch.manual_seed(13)
    model = nn.Linear(8, 4).to(device)
    ref = copy.deepcopy(model).double()
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)

    @torch.compile(backend="aot_eager")
    def train_step(x):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        x = torch.randn(16, 8, device=device)
        train_step(x)
        ref(x.double()).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r.float(), **_TOL)
    torch._dynamo.reset()


@pytest.mark.parametrize("fused", ["mixprec", "torch"])
def test_compiled_step_under_amp_gets_the_overflow_flag(fused):
    """``torch.compile(opt.step)`` of a fused optimizer under amp O2 fp16, where amp hands its
    overflow flag over as ``grad_scale`` / ``found_inf`` attributes: Dynamo dropped those
    attributes, set in traced code, at the graph break before the kernel, and amp's post-step
    hook failed (AttributeError) deleting them. Trains as the eager one, the overflowed step
    skipped by the kernel."""
    def build():
        torch.manual_seed(0)
        model = nn.Linear(6, 3)
        opt = (FusedAdam(model.parameters(), lr=1e-2) if fused == "mixprec"
               else torch.optim.Adam(model.parameters(), lr=1e-2, fused=True))
        return amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)

    torch._dynamo.reset()
    (eager, eager_opt), (model, opt) = build(), build()
    compiled_step = torch.compile(opt.step, backend="eager")
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        x = torch.randn(4, 6, generator=g)
        for m, o, step in ((eager, eager_opt, eager_opt.step), (model, opt, compiled_step)):
            o.zero_grad()
            loss = m(x).float().square().mean() * (float("inf") if i == 1 else 1.0)
            with amp.scale_loss(loss, o) as scaled:
                scaled.backward()
            step()
        assert amp.step_was_skipped(opt) == amp.step_was_skipped(eager_opt) == (i == 1)
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    for a, b in zip(amp.master_params(eager_opt), amp.master_params(opt)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for a, b in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    torch._dynamo.reset()


# -- a tensor learning rate --------------------------------------------------------------------
@pytest.fixture
def kernel_device(device, monkeypatch):
    """Where FusedAdam's Triton kernel runs: on CPU through Triton's interpreter."""
    if device.type == "cpu":
        reason = interpreter_skip_reason()
        if reason is not None:
            pytest.skip(reason)
        monkeypatch.setattr(fused_adam, "_KERNEL_ON_CPU", True)
    return device


def _scheduler(name, optimizer):
    if name == "lambda":  # a warm-up, then a decay
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda epoch: (epoch + 1) / 3 if epoch < 2 else 0.6**epoch)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.3)


@pytest.mark.parametrize("adam_w", [True, False])
@pytest.mark.parametrize("schedule", ["lambda", "step"])
def test_tensor_lr_with_a_schedule_matches_pytorch_in_float64(device, path, adam_w, schedule):
    """A tensor ``lr`` that an LR scheduler changes in place after each step: FusedAdam follows
    it as PyTorch's Adam/AdamW (float64, a float64 copy of the tensor) does under the same
    schedule."""
    gen = torch.Generator().manual_seed(14)
    params = _params(device, gen)
    grads = _grads(params, gen, steps=6)
    hyper = dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    lr = torch.tensor(1e-2, device=device)
    ours = [p.clone() for p in params]
    opt = FusedAdam(ours, lr=lr, adam_w_mode=adam_w, **hyper)
    ref = [p.double() for p in params]
    ref_opt = _torch_reference(adam_w, lr=lr.double(), **hyper)(ref)
    schedulers = [_scheduler(schedule, o) for o in (opt, ref_opt)]
    rates = []
    for step in grads:
        rates.append(lr.item())
        _step_both(step, ours, ref, opt, ref_opt)
        for s in schedulers:
            s.step()
    assert opt.param_groups[0]["lr"] is lr  # changed in place by the scheduler, not replaced
    assert len(set(rates)) >= 3
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)


def test_lr_changed_in_place_or_replaced_is_followed(device, path):
    """Each step takes the group's ``lr`` as it is then: the tensor changed in place (with no
    new routing plan: its checks are not redone), another tensor (float64, shape (1,), on the
    CPU for parameters elsewhere), a float, and a tensor again; as PyTorch's AdamW (float64)
    stepped with those rates as floats."""
    gen = torch.Generator().manual_seed(15)
    params = _params(device, gen, [(1023,), (37, 29), (5,)])
    grads = _grads(params, gen, steps=8)
    first = torch.tensor(2e-2, device=device)
    changes = [
        lambda group: None,  # the tensor given to the constructor
        lambda group: group["lr"].fill_(5e-3),
        lambda group: group["lr"].mul_(3.0),
        lambda group: group.__setitem__("lr", torch.tensor(3e-3, dtype=torch.float64,
                                                           device=device)),
        lambda group: group.__setitem__("lr", 1e-2),
        lambda group: group.__setitem__("lr", torch.tensor([4e-3], device=device)),
        lambda group: group.__setitem__("lr", torch.tensor(7e-3)),  # on the CPU
        lambda group: group.__setitem__("lr", first),  # (holding 1.5e-2 since the third step)
    ]
    ours = [p.clone() for p in params]
    opt = FusedAdam(ours, lr=first, weight_decay=0.1)
    ref = [p.double() for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1.0, weight_decay=0.1, foreach=False)
    plans = []
    for change, step in zip(changes, grads):
        change(opt.param_groups[0])
        ref_opt.param_groups[0]["lr"] = float(opt.param_groups[0]["lr"])
        _step_both(step, ours, ref, opt, ref_opt)
        plans.append(list(opt._plans.values()))
    assert all(len(ps) == 1 and ps[0] is plans[0][0] for ps in plans)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)


@pytest.mark.parametrize("make_lr", [
    lambda device: torch.tensor(1e-2, device=device),
    lambda device: torch.tensor(1e-2, dtype=torch.float64, device=device),
    lambda device: torch.tensor([1e-2], device=device),
], ids=["float32", "float64", "shape_1"])
def test_the_kernel_reads_a_tensor_lr_itself(kernel_device, monkeypatch, make_lr):
    """The kernel is handed the group's tensor, which it loads when it runs (nothing reads it
    on the host), and rounds it to fp32 as a float ``lr`` is rounded: the same update."""
    seen = []
    original = fused_adam._adam_kernel.adam_step_

    def spy(*args, **kwargs):
        seen.append(kwargs["lr"])
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_adam._adam_kernel, "adam_step_", spy)
    gen = torch.Generator().manual_seed(16)
    params = _params(kernel_device, gen)
    grads = _grads(params, gen, steps=3)
    lr = make_lr(kernel_device)
    with_tensor = [p.clone() for p in params]
    _run(lambda ps: FusedAdam(ps, lr=lr, weight_decay=0.1), with_tensor, grads)
    with_float = [p.clone() for p in params]
    _run(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1), with_float, grads)
    assert len(seen) == 6 and all(s is lr for s in seen[:3]) and seen[3:] == [1e-2] * 3
    # (On the GPU two compiled specializations: one fp32 ulp allowed, as for grad_scale; the
    # H200 gave identical results.)
    tol = dict(rtol=0, atol=0) if kernel_device.type == "cpu" else dict(rtol=2e-7, atol=2e-7)
    for a, b in zip(with_tensor, with_float):
        torch.testing.assert_close(a, b, **tol)


def _adam_step_on_views(n, p, g, m, v, step, copy_):
    """One kernel update of the first ``n`` elements of each buffer (views at the buffers'
    own addresses)."""
    with torch.no_grad():
        fused_adam._adam_kernel.adam_step_(
            [p[:n]], [g[:n]], [m[:n]], [v[:n]], [step], [None if copy_ is None else copy_[:n]],
            lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adam_w=True,
            bias_correction=True)


def test_the_kernel_steps_tensors_at_reused_addresses_by_their_own_sizes(kernel_device):
    """The kernel's table of addresses is cached for the whole process (every optimizer shares
    it), and a rebuilt model can get the old one's addresses back from the allocator with other
    sizes: a step then updates exactly the tensors' elements, none past their end (another
    tensor's memory) and none left out. (K07)"""
    gen = torch.Generator().manual_seed(64)
    bufs = [torch.randn(3000, generator=gen).to(kernel_device) for _ in range(2)]
    bufs += [torch.zeros(3000, device=kernel_device) for _ in range(2)]
    step = torch.ones((), device=kernel_device)
    _adam_step_on_views(2500, *bufs, step, None)  # (three interpreter chunks)
    before = [b.clone() for b in bufs]
    fresh = [b.clone() for b in bufs]  # (other addresses: a table of its own)
    step.fill_(2.0)
    _adam_step_on_views(1500, *bufs, step, None)
    _adam_step_on_views(1500, *fresh, torch.full((), 2.0, device=kernel_device), None)
    for b, b0, f in zip(bufs, before, fresh):
        assert torch.equal(b[1500:], b0[1500:])  # past the end: untouched
        assert torch.equal(b[:1500], f[:1500])


def test_the_kernel_writes_a_half_copy_at_a_reused_address_in_its_own_dtype(kernel_device):
    """A half copy at the address an earlier step wrote as the other half dtype (an fp16 model
    rebuilt as bf16 in the same memory) is written in its own dtype: bf16 bits, not fp16 bits
    read as bf16. (K06)"""
    gen = torch.Generator().manual_seed(65)
    p, g = (torch.randn(700, generator=gen).to(kernel_device) for _ in range(2))
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    raw = torch.zeros(700, dtype=torch.int16, device=kernel_device)
    step = torch.ones((), device=kernel_device)
    _adam_step_on_views(700, p, g, m, v, step, raw.view(torch.float16))
    assert torch.equal(raw.view(torch.float16), p.to(torch.float16))
    step.fill_(2.0)
    _adam_step_on_views(700, p, g, m, v, step, raw.view(torch.bfloat16))
    assert torch.equal(raw.view(torch.bfloat16), p.to(torch.bfloat16))


def test_without_pytorchs_tensor_lr_overload_the_plain_arithmetic_reads_it(device, monkeypatch):
    """A PyTorch whose fused Adam has no tensor-lr overload: the parameters it would step with a
    GPU tensor ``lr`` take the plain arithmetic instead (a CPU tensor is read on the host and
    stays on PyTorch's kernel); the update is PyTorch's AdamW's (float64) either way."""
    if not fused_adam._torch_fused_ok(device):
        pytest.skip(f"this PyTorch has no fused Adam kernel for {device.type} tensors")
    monkeypatch.setattr(fused_adam, "_kernel_device_ok", lambda device: False)
    monkeypatch.setattr(fused_adam, "_torch_fused_takes_tensor_lr", lambda: False)
    plain_steps = []
    original = fused_adam._reference_step

    def spy(*args, **kwargs):
        plain_steps.append(args[3])
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_adam, "_reference_step", spy)
    gen = torch.Generator().manual_seed(21)
    params = _params(device, gen, [(37, 29), (5,)])
    grads = _grads(params, gen, steps=3)
    lr = torch.tensor(1e-2, device=device)
    ours = [p.clone() for p in params]
    _run(lambda ps: FusedAdam(ps, lr=lr, weight_decay=0.1), ours, grads)
    ref = [p.double() for p in params]
    _run(_torch_reference(True, lr=lr.double(), weight_decay=0.1), ref, grads)
    assert plain_steps == ([[0, 1]] * 3 if device.type == "cuda" else [])
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)


def test_bad_tensor_lrs_say_what_to_do():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"FusedAdam\(lr=a torch.float32 tensor of shape "
                                         r"\(2,\) on cpu\): a tensor lr must hold one element"):
        FusedAdam(p, lr=torch.tensor([1e-3, 2e-3]))
    with pytest.raises(ValueError, match=r"torch.int64 .* must be floating point"):
        FusedAdam(p, lr=torch.tensor(1))
    with pytest.raises(ValueError, match=r"holding -0.5\): lr must be >= 0"):
        FusedAdam(p, lr=torch.tensor(-0.5))
    with pytest.raises(ValueError, match="lr must be >= 0"):
        FusedAdam(p, lr=torch.tensor(float("nan")))
    with pytest.raises(ValueError, match="a number >= 0 or a one-element floating tensor"):
        FusedAdam(p, lr="1e-3")
    with pytest.raises(ValueError, match=r"FusedAdam param group 1: lr=.*one element"):
        FusedAdam([{"params": p}, {"params": [nn.Parameter(torch.zeros(1))],
                                   "lr": torch.ones(3)}])
    opt = FusedAdam(p, lr=torch.tensor(1e-3))
    with pytest.raises(ValueError, match=r"FusedAdam param group 1: lr=.*>= 0"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))], "lr": -1.0})
    assert len(opt.param_groups) == 1
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0]["lr"] = torch.tensor(3)
    with pytest.raises(ValueError, match=r"load_state_dict: param group 0: lr=a torch.int64"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"].dtype == torch.float32  # (not loaded)
    # Set by hand after the checks: the step refuses it before it changes anything.
    p[0].grad = torch.ones(2)
    opt.step()
    opt.param_groups[0]["lr"] = torch.tensor([1e-3, 1e-3])
    with pytest.raises(ValueError, match=r"FusedAdam param group 0: lr=.*one element"):
        opt.step()
    assert opt.state[p[0]]["step"].item() == 1.0


def test_a_tensor_lr_goes_through_state_dicts_and_copies(device, path):
    """A tensor ``lr`` is saved and loaded as PyTorch's AdamW saves and loads it (a tensor, a
    copy on its device); AdamW loads FusedAdam's and FusedAdam AdamW's, and deep copies and
    pickles get their own tensor: each steps as the original with the rate set in its own."""
    gen = torch.Generator().manual_seed(17)
    params = _params(device, gen, [(37, 29), (5,)])
    grads = _grads(params, gen, steps=5)
    lr = torch.tensor(1e-2, device=device)
    ours = [p.clone() for p in params]
    opt = _run(lambda ps: FusedAdam(ps, lr=lr, weight_decay=0.1), ours, grads[:2])
    theirs = [p.clone() for p in ours]
    torch_opt = torch.optim.AdamW(theirs, lr=1.0, weight_decay=0.1, foreach=False)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    back = [p.clone() for p in ours]
    opt_back = FusedAdam(back, lr=123.0)
    opt_back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    copies = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    others = [torch_opt, opt_back, *copies]
    lr.fill_(4e-3)
    for o in others:
        loaded = o.param_groups[0]["lr"]
        assert torch.is_tensor(loaded) and loaded is not lr and loaded.device == lr.device
        assert loaded.item() == pytest.approx(1e-2)  # (not the original's new value)
        loaded.fill_(4e-3)
    for step in grads[2:]:
        for o in [opt, *others]:
            for p, g in zip(o.param_groups[0]["params"], step):
                p.grad = g.clone()
            o.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(q, p, **_TOL)
    for o in [opt_back, *copies]:
        for p, q in zip(ours, o.param_groups[0]["params"]):
            torch.testing.assert_close(q, p, rtol=0, atol=0)


# -- with amp ----------------------------------------------------------------------------------
def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.BatchNorm1d(32), nn.Linear(32, 4))


def _amp_train(opt_cls, dtype, device, steps=5, opt_level="O2", inject_inf_at=None, **init):
    model = _net().to(device)
    opt = opt_cls(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=dtype, verbosity=0,
                                **init)
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(8, 16, generator=gen).to(device)
        y = torch.randint(0, 4, (8,), generator=gen).to(device)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if i == inject_inf_at:
            loss = loss * float("inf")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    return model, opt


def _spy_on_amp_copies(monkeypatch):
    """A list that gets, for each master-to-model copy amp makes after a step, how many
    parameters it copied."""
    copied = []
    original = _state._OptimizerState.copy_masters_to_model

    def spy(self, pairs=None):
        copied.append(len(self.pairs if pairs is None else pairs))
        return original(self, pairs)

    monkeypatch.setattr(_state._OptimizerState, "copy_masters_to_model", spy)
    return copied


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amp_o2_writes_the_half_model_in_the_step(amp_device, monkeypatch, dtype):
    """At O2 FusedAdam updates the fp32 masters as torch's AdamW does and writes the half
    model itself: amp's own master-to-model copy then copies nothing."""
    copied = _spy_on_amp_copies(monkeypatch)
    ours = lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    theirs = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)  # noqa
    model, opt = _amp_train(ours, dtype, amp_device)
    assert copied == []
    ref_model, _ = _amp_train(theirs, dtype, amp_device)
    assert copied == [4] * 5  # the two Linear layers' masters (BatchNorm stays fp32)
    pairs = _state.optimizer_state(opt).pairs
    assert len(pairs) == 4 and len(opt._half_copies_written) == 4
    for half, master in pairs:
        assert torch.equal(half, master.to(dtype))
    # The fp32 state dicts after one step: the same update within fp32 rounding. (Over more
    # steps fp16 amplifies it: a master one fp32 ulp away can round to another fp16 weight.)
    one, _ = _amp_train(ours, dtype, amp_device, steps=1)
    ref_one, _ = _amp_train(theirs, dtype, amp_device, steps=1)
    for (name, a), b in zip(one.state_dict().items(), ref_one.state_dict().values()):
        torch.testing.assert_close(a, b, **_TOL, msg=name)


def test_amp_o2_copies_what_the_step_did_not_write(amp_device):
    """A master the step did not update (no gradient) that was changed by hand still reaches
    the half model after the step, as with any optimizer under amp."""
    model, opt = _amp_train(lambda ps: FusedAdam(ps, lr=1e-2), torch.bfloat16, amp_device,
                            steps=1)
    pairs = _state.optimizer_state(opt).pairs
    frozen_half, frozen_master = pairs[0]
    with torch.no_grad():
        frozen_master.fill_(0.5)
    opt.zero_grad()
    loss = model(torch.randn(8, 16, device=amp_device)).sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    frozen_master.grad = None
    opt.step()
    assert len(opt._half_copies_written) == len(pairs) - 1
    assert torch.equal(frozen_half, torch.full_like(frozen_half, 0.5))


def _two_amp_steps(model, opt, device, seed):
    """Two amp training steps of a 16-feature model on random batches."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        x = torch.randn(8, 16, generator=gen).to(device)
        opt.zero_grad()
        with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()


def test_amp_o2_bf16_copies_are_written_when_the_first_parameter_stays_fp32(amp_device):
    """At O2 a model whose first parameter keeps fp32 with no half copy (a BatchNorm in front,
    an input normalization, kept fp32 by ``keep_batchnorm_fp32``) shares one kernel launch
    with the bf16 masters' parameters: each half copy is written in its own dtype, and the
    bf16 model equals its masters rounded by PyTorch (a per-launch dtype flag taken from the
    first parameter wrote fp16 bits into the bf16 weights). (M28)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 32), nn.GELU(),
                          nn.Linear(32, 4)).to(amp_device)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                verbosity=0)
    assert model[0].weight.dtype == torch.float32
    _two_amp_steps(model, opt, amp_device, seed=3)
    pairs = _state.optimizer_state(opt).pairs
    assert len(pairs) == 4 and len(opt._half_copies_written) == 4
    for half, master in pairs:
        assert half.dtype == torch.bfloat16 and torch.equal(half, master.to(torch.bfloat16))


def test_amp_o2_a_group_added_after_initialize_keeps_the_step_writing_every_half_copy(
        amp_device, monkeypatch):
    """``optimizer.add_param_group`` after ``amp.initialize`` (a head trained from the second
    epoch on): amp links the new group's masters to their half copies too, and the step goes
    on writing the first groups' half copies as well, so amp copies nothing after the step
    and the whole half model equals its masters rounded. (Each link replaced the earlier
    ones: the first groups fell back to amp's extra copy pass.) (M10)"""
    copied = _spy_on_amp_copies(monkeypatch)
    torch.manual_seed(0)
    body, head = nn.Linear(16, 8).to(amp_device), nn.Linear(8, 4).to(amp_device)
    opt = FusedAdam(body.parameters(), lr=1e-2)
    model = nn.Sequential(body, head)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    opt.add_param_group({"params": list(head.parameters())})
    _two_amp_steps(model, opt, amp_device, seed=2)
    pairs = _state.optimizer_state(opt).pairs
    assert len(pairs) == 4 and copied == []
    assert {id(m) for m in opt._half_copies_written} == {id(m) for _, m in pairs}
    for half, master in pairs:
        assert torch.equal(half, master.to(torch.bfloat16))


def test_amp_o2_fp16_overflow_is_skipped_on_the_device(amp_device):
    """Dynamic loss scaling with FusedAdam keeps the flag on the device (the optimizer skips
    the step itself): masters, moments and step counts stay, the scale halves."""
    model, opt = _amp_train(lambda ps: FusedAdam(ps, lr=1e-2), torch.float16, amp_device, steps=3,
                            inject_inf_at=2)
    ref_model, ref_opt = _amp_train(lambda ps: FusedAdam(ps, lr=1e-2), torch.float16,
                                    amp_device, steps=2)
    assert _state.optimizer_state(opt).skips_on_device().type == amp_device.type
    assert amp.step_was_skipped(opt)
    assert amp.state_dict(optimizer=opt)["loss_scaler0"]["loss_scale"] == 2.0**15
    for (half, master), (ref_half, ref_master) in zip(_state.optimizer_state(opt).pairs,
                                                       _state.optimizer_state(ref_opt).pairs):
        assert torch.equal(master, ref_master) and torch.equal(half, ref_half)
        assert opt.state[master]["step"].item() == 2.0


def test_amp_two_overflowed_losses_skip_one_step(amp_device):
    """Two losses (``num_losses=2``) that both overflow before one ``step()``: the step is
    skipped once and the step counts stay (the flags were summed to found_inf=2, which the
    fused step subtracted from its counts: step -1, then NaN weights from a zero bias
    correction)."""
    def train(opt_cls):
        model = _net().to(amp_device)
        opt = opt_cls(model.parameters())
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16,
                                    num_losses=2, verbosity=0)
        gen = torch.Generator().manual_seed(2)
        skipped = []
        for i in range(3):
            x = torch.randn(8, 16, generator=gen).to(amp_device)
            opt.zero_grad()
            for loss_id in (0, 1):
                loss = model(x).float().square().mean() * (float("inf") if i == 0 else 1.0)
                with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                    scaled.backward()
            opt.step()
            skipped.append(amp.step_was_skipped(opt))
        return model, opt, skipped

    model, opt, skipped = train(lambda ps: FusedAdam(ps, lr=1e-2))
    ref_model, _, ref_skipped = train(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0, foreach=False))
    assert _state.optimizer_state(opt).skips_on_device() is not None
    assert skipped == ref_skipped == [True, False, False]
    assert all(s["step"].item() == 2.0 for s in opt.state.values())
    for (name, a), b in zip(model.state_dict().items(), ref_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=name)


def test_amp_an_overflow_in_one_of_two_optimizers_skips_both(amp_device):
    """``scale_loss(loss, [opt1, opt2])`` with the scale on the device: an inf/NaN in the
    second optimizer's gradients skips both steps, as on the host (only the first optimizer's
    flag was read, and the second stepped its masters to NaN)."""
    def train(opt_cls):
        torch.manual_seed(0)
        first, second = nn.Linear(16, 4).to(amp_device), nn.Linear(16, 4).to(amp_device)
        opts = [opt_cls(first.parameters()), opt_cls(second.parameters())]
        models, opts = amp.initialize([first, second], opts, opt_level="O2",
                                      dtype=torch.float16, verbosity=0)
        gen = torch.Generator().manual_seed(3)
        skipped = []
        for i in range(3):
            x = torch.randn(8, 16, generator=gen).to(amp_device)
            bad = float("inf") if i == 1 else 1.0
            loss = models[0](x).float().square().mean() + models[1](
                x).float().square().mean() * bad
            with amp.scale_loss(loss, opts) as scaled:
                scaled.backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
            skipped.append([amp.step_was_skipped(opt) for opt in opts])
        return models, opts, skipped

    models, opts, skipped = train(lambda ps: FusedAdam(ps, lr=1e-2))
    ref_models, _, ref_skipped = train(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0, foreach=False))
    assert _state.optimizer_state(opts[1]).skips_on_device() is not None
    assert skipped == ref_skipped == [[False, False], [True, True], [False, False]]
    for model, ref_model in zip(models, ref_models):
        for (name, a), b in zip(model.state_dict().items(), ref_model.state_dict().values()):
            torch.testing.assert_close(a, b, **_TOL, msg=name)


def test_amp_o2_with_a_tensor_lr_steps_as_with_the_float(amp_device):
    """At O2 a tensor ``lr`` on the device gives the update of the same float ``lr``, and the
    half model is written from the masters in the step as ever."""
    model, opt = _amp_train(lambda ps: FusedAdam(ps, lr=torch.tensor(1e-2, device=amp_device)),
                            torch.bfloat16, amp_device, steps=3)
    ref_model, ref_opt = _amp_train(lambda ps: FusedAdam(ps, lr=1e-2), torch.bfloat16,
                                    amp_device, steps=3)
    assert torch.is_tensor(opt.param_groups[0]["lr"]) and len(opt._half_copies_written) == 4
    # (On the GPU two compiled specializations: one fp32 ulp allowed, as for grad_scale; the
    # H200 gave identical results.)
    tol = dict(rtol=0, atol=0) if amp_device.type == "cpu" else dict(rtol=2e-7, atol=2e-7)
    for (half, master), (_, ref_master) in zip(_state.optimizer_state(opt).pairs,
                                               _state.optimizer_state(ref_opt).pairs):
        assert torch.equal(half, master.to(torch.bfloat16))
        torch.testing.assert_close(master, ref_master, **tol)


def test_amp_o3_and_o1_step_the_model_directly(amp_device):
    for level, dtype in (("O3", torch.bfloat16), ("O1", torch.bfloat16)):
        model, opt = _amp_train(lambda ps: FusedAdam(ps, lr=1e-2), dtype, amp_device, steps=2,
                                opt_level=level)
        assert opt._half_copies == {} and opt._half_copies_written == []
        p = next(model.parameters())
        assert opt.state[p]["step"].item() == 2.0


def test_apex_alias_imports_fused_adam(clean_apex):
    import mixprec

    mixprec.install_apex_alias()
    from apex.optimizers import FusedAdam as AliasFusedAdam

    assert AliasFusedAdam is FusedAdam


# -- CUDA --------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_torch_fused_adamw(dtype):
    """On the GPU: the kernel against PyTorch's own fused AdamW (fp32), with half copies."""
    gen = torch.Generator().manual_seed(9)
    shapes = [(4096, 1024), (1024,), (32000, 64), (3, 5, 7, 11)]
    params = _params("cuda", gen, shapes)
    grads = _grads(params, gen, steps=4)
    ours = [p.clone() for p in params]
    copies = [p.to(dtype) for p in ours]
    opt = FusedAdam(ours, lr=1e-3, weight_decay=0.1)
    opt._link_half_copies(list(zip(copies, ours)))
    _run(lambda ps: opt, ours, grads)
    ref = [p.clone() for p in params]
    _run(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True), ref, grads)
    for p, r, c in zip(ours, ref, copies):
        torch.testing.assert_close(p, r, **_TOL)
        assert torch.equal(c, p.to(dtype))


@requires_cuda
def test_cuda_half_parameters_take_torch_fused_kernel():
    gen = torch.Generator().manual_seed(10)
    params = [p.to(torch.bfloat16) for p in _params("cuda", gen, [(300, 7), (11,)])]
    grads = _grads(params, gen, steps=3)
    ours = [p.clone() for p in params]
    _run(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1), ours, grads)
    ref = [p.clone() for p in params]
    _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), ref, grads)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_amp_o2_step_captured_in_a_graph(dtype):
    """A whole O2 step with FusedAdam (a static loss scale for fp16) captured after 3 eager
    steps: 4 replays equal 7 eager steps."""
    from tests._graphs import amp_step, warm_up_and_capture

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).cuda()
        opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
        return amp.initialize(model, opt, opt_level="O2", dtype=dtype, loss_scale=128.0,
                              verbosity=0)

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=gen).cuda()
    y = torch.randint(0, 10, (32,), generator=gen).cuda()
    model, opt = build()
    graph, static_loss = warm_up_and_capture(lambda: amp_step(model, opt, x, y), opt, 3)
    losses = []
    for _ in range(4):
        graph.replay()
        losses.append(static_loss.item())
    ref_model, ref_opt = build()
    ref_losses = []
    for _ in range(7):
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(amp_step(ref_model, ref_opt, x, y).item())
    assert losses == pytest.approx(ref_losses[3:], rel=1e-5, abs=1e-6)
    for a, b in zip(model.state_dict().values(), ref_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for (half, master), (ref_half, _) in zip(_state.optimizer_state(opt).pairs,
                                             _state.optimizer_state(ref_opt).pairs):
        assert torch.equal(half, master.to(dtype))
        torch.testing.assert_close(half, ref_half, rtol=0, atol=0)


@requires_cuda
def test_cuda_eager_step_between_capture_and_replay():
    """Eager steps and replays of a captured step mix: 3 eager, capture, 1 eager, 2 replays
    equal 6 eager steps (the eager step after the capture must not read the graph's table)."""
    gen = torch.Generator().manual_seed(12)
    params = _params("cuda", gen, [(4096, 33), (1000,), (3, 5, 7, 11)])
    grads = [g for g in _grads(params, gen, steps=1)[0]]
    ours, ref = [p.clone() for p in params], [p.clone() for p in params]
    copies = [p.to(torch.bfloat16) for p in ours]
    for p, r, g in zip(ours, ref, grads):
        p.grad, r.grad = g.clone(), g.clone()
    opt = FusedAdam(ours, lr=1e-3, weight_decay=0.1)
    opt._link_half_copies(list(zip(copies, ours)))
    ref_opt = FusedAdam(ref, lr=1e-3, weight_decay=0.1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    opt.step()
    graph.replay()
    graph.replay()
    for _ in range(6):
        ref_opt.step()
    torch.cuda.synchronize()
    for p, r, c in zip(ours, ref, copies):
        torch.testing.assert_close(p, r, rtol=0, atol=0)
        assert torch.equal(c, p.to(torch.bfloat16))
    assert opt.state[ours[0]]["step"].item() == 6.0


@requires_cuda
def test_cuda_graph_replays_read_a_tensor_lr_changed_in_place():
    """A step captured with the rate a GPU tensor: a LambdaLR changing it in place between
    replays changes each replay's update as it changes eager steps, on the kernel (fp32
    parameters, with half copies) and PyTorch's fused kernel (bf16 ones) alike. A replay at rate
    0 leaves the parameters as they are."""
    gen = torch.Generator().manual_seed(18)
    params = _params("cuda", gen, [(4096, 33), (1000,)]) + [
        p.to(torch.bfloat16) for p in _params("cuda", gen, [(300, 7)])]
    grads = _grads(params, gen, steps=1)[0]
    factors = [1.0, 1.0, 1.0, 0.5, 4.0, 0.0, 0.25, 1.0]  # steps 0-2 eager, 3-6 replays (, 7)

    def build():
        ps = [p.clone() for p in params]
        for p, g in zip(ps, grads):
            p.grad = g.to(p.dtype)
        opt = FusedAdam(ps, lr=torch.tensor(1e-3, device="cuda"), weight_decay=0.1)
        copies = [p.to(torch.bfloat16) for p in ps[:2]]
        opt._link_half_copies(list(zip(copies, ps[:2])))
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: factors[epoch])
        return ps, copies, opt, scheduler

    ours, copies, opt, scheduler = build()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.step()
            scheduler.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    moved = []
    for _ in range(4):
        before = [p.clone() for p in ours]
        graph.replay()
        scheduler.step()
        moved.append(not all(torch.equal(a, b) for a, b in zip(before, ours)))
    assert moved == [True, True, False, True]
    ref, _, ref_opt, ref_scheduler = build()
    for _ in range(7):
        ref_opt.step()
        ref_scheduler.step()
    torch.cuda.synchronize()
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r, rtol=0, atol=0)
    for c, p in zip(copies, ours):
        assert torch.equal(c, p.to(torch.bfloat16))
    assert opt.state[ours[0]]["step"].item() == 7.0


@requires_cuda
def test_cuda_cpu_tensor_lr_is_read_on_the_host_and_refused_in_a_capture():
    """PyTorch's rule: a CPU tensor ``lr`` for GPU parameters is read on the host at each step
    (the update of that float); a replay could not read it, so a capture raises, saying what to
    do, before anything is captured."""
    gen = torch.Generator().manual_seed(19)
    params = _params("cuda", gen, [(1000,), (3, 5, 7, 11)])
    grads = _grads(params, gen, steps=2)
    ours = [p.clone() for p in params]
    opt = _run(lambda ps: FusedAdam(ps, lr=torch.tensor(1e-2, dtype=torch.float64)), ours, grads)
    ref = [p.clone() for p in params]
    _run(lambda ps: FusedAdam(ps, lr=1e-2), ref, grads)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"lr is a CPU tensor.*device='cuda:0'"):
        with torch.cuda.graph(graph):
            opt.step()
    assert opt.state[ours[0]]["step"].item() == 2.0


@requires_cuda
def test_cuda_tensor_lr_steps_with_no_host_sync():
    """With the rate a GPU tensor nothing reads it on the host: the constructor's checks (which
    leave a GPU tensor's value unchecked for that reason), both fused routes' steps and a
    scheduler's in-place changes run under ``torch.cuda.set_sync_debug_mode("error")``."""
    gen = torch.Generator().manual_seed(20)
    params = _params("cuda", gen, [(1000,)]) + [
        p.to(torch.bfloat16) for p in _params("cuda", gen, [(300, 7)])]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device="cuda", dtype=p.dtype)
    lr, negative = torch.tensor(1e-2, device="cuda"), torch.tensor(-1.0, device="cuda")
    FusedAdam(params, lr=lr).step()  # (compiles the kernel and builds its table)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        FusedAdam(params, lr=negative)
        opt = FusedAdam(params, lr=lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
        for _ in range(3):
            opt.step()
            scheduler.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.param_groups[0]["lr"].item() == pytest.approx(1e-2 * 0.5**3)


# -- lr 0, weight-decay modes and step dtypes across torch checkpoints (mutation testing) ---------
_TORCH_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(params=["torch_fused", "plain"])
def cpu_route(request, monkeypatch):
    """FusedAdam's CPU routes other than the Triton kernel: PyTorch's fused Adam kernel
    (where this PyTorch runs it on CPU) and the plain-PyTorch arithmetic."""
    monkeypatch.setattr(fused_adam, "_kernel_device_ok", lambda device: False)
    if request.param == "torch_fused":
        if not fused_adam._torch_fused_ok(torch.device("cpu")):
            pytest.skip("this PyTorch has no fused Adam kernel for CPU tensors")
    else:
        monkeypatch.setattr(fused_adam, "_torch_fused_ok", lambda device: False)
    return request.param


def _two_params(n=2):
    torch.manual_seed(0)
    return [torch.randn(7, 3) for _ in range(n)]


def _run_steps(opt, params, grads):
    for g in grads:
        for p, gp in zip(params, g):
            p.grad = gp.to(p.dtype).clone()
        opt.step()


def test_zero_learning_rate_is_accepted_as_by_torch_optim(cpu_route):
    # lr=0 (a warm-up schedule's first value) is a valid rate, as torch.optim.AdamW takes it:
    # the parameters stay, the moments and step counts advance.
    init = _two_params()
    ours = [p.clone() for p in init]
    ref = [p.double().clone() for p in init]
    opt = FusedAdam(ours, lr=0.0, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(ref, lr=0.0, weight_decay=0.1)
    grads = [[torch.randn(7, 3) for _ in init] for _ in range(3)]
    _run_steps(opt, ours, grads)
    _run_steps(torch_opt, ref, grads)
    for p, r, p0 in zip(ours, ref, init):
        torch.testing.assert_close(p, p0, rtol=0, atol=0)
        torch.testing.assert_close(opt.state[p]["exp_avg"].double(), torch_opt.state[r]["exp_avg"], **_TORCH_TOL)
        assert float(opt.state[p]["step"]) == 3
    # A group of rate 0 added later, and a checkpoint holding one, are taken too.
    extra = torch.randn(4)
    opt.add_param_group({"params": [extra], "lr": 0.0})
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups[1]["lr"] == 0.0


def _grads_for(params, n):
    torch.manual_seed(1)
    return [[torch.randn_like(p) for p in params] for _ in range(n)]


# torch.optim.Adam's decoupled_weight_decay arrived in PyTorch 2.7: before it, Adam ignores
# the key in a loaded group (a FusedAdam adam_w_mode checkpoint continues there as L2 decay;
# load it into torch.optim.AdamW on those releases).
_TORCH_ADAM_DECOUPLES = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters
_needs_decoupled_adam = pytest.mark.skipif(
    not _TORCH_ADAM_DECOUPLES, reason="torch.optim.Adam has no decoupled_weight_decay before "
    "PyTorch 2.7 (a FusedAdam adam_w_mode checkpoint goes to torch.optim.AdamW there)")


@_needs_decoupled_adam
@pytest.mark.parametrize("adam_w", [True, False])
def test_checkpoint_continues_in_torch_adam_with_the_same_update(cpu_route, adam_w):
    # state_dict() states decoupled_weight_decay = adam_w_mode, so torch.optim.Adam (whose own
    # default is L2 decay) loads a FusedAdam checkpoint as the same update.
    init = _two_params()
    ours = [p.clone() for p in init]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w)
    grads = _grads_for(init, 4)
    _run_steps(opt, ours, grads[:2])
    # (A deep copy: the live state dict shares the step tensors, which both would advance.)
    saved = copy.deepcopy(opt.state_dict())
    assert all(g["decoupled_weight_decay"] is adam_w for g in saved["param_groups"])
    ref = [p.detach().double().clone() for p in ours]
    torch_opt = torch.optim.Adam(ref, lr=1e-2, weight_decay=0.1)
    torch_opt.load_state_dict(saved)
    _run_steps(opt, ours, grads[2:])
    _run_steps(torch_opt, ref, grads[2:])
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.double(), r, **_TORCH_TOL)


_ADAMW_STATES_DECOUPLING = "decoupled_weight_decay" in torch.optim.AdamW(
    [torch.zeros(1, requires_grad=True)]).defaults


@pytest.mark.skipif(
    not _ADAMW_STATES_DECOUPLING,
    reason="this PyTorch's AdamW does not state decoupled_weight_decay in its checkpoint (a "
    "separate class before Adam took the option), so nothing there tells that AdamW ran it")
def test_an_l2_checkpoint_run_by_torch_adamw_comes_back_decoupled(cpu_route):
    # An L2 FusedAdam checkpoint (adam_w_mode=False) loaded into torch.optim.AdamW runs there
    # with decoupled decay (AdamW sets decoupled_weight_decay=True, keeping the adam_w_mode
    # key as it was); AdamW's checkpoint loaded back into FusedAdam continued with L2, the
    # stale key preferred (r102A R2: 3.6e-3 apart after one step). Reference: AdamW going on.
    init = _two_params()
    ours = [p.clone() for p in init]
    first = FusedAdam(ours, lr=1e-2, weight_decay=0.1, adam_w_mode=False)
    grads = _grads_for(init, 5)
    _run_steps(first, ours, grads[:2])
    ref = [p.detach().double().clone() for p in ours]
    adamw = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    adamw.load_state_dict(copy.deepcopy(first.state_dict()))
    _run_steps(adamw, ref, grads[2:3])
    saved = copy.deepcopy(adamw.state_dict())
    back = [p.detach().float().clone() for p in ref]
    opt = FusedAdam(back, lr=1e-2, weight_decay=0.1, adam_w_mode=False)
    opt.load_state_dict(saved)
    assert all(g["adam_w_mode"] is True for g in opt.param_groups)
    _run_steps(opt, back, grads[3:])
    _run_steps(adamw, ref, grads[3:])
    for p, r in zip(back, ref):
        torch.testing.assert_close(p.double(), r, **_TORCH_TOL)


@_needs_decoupled_adam
@pytest.mark.parametrize("decoupled", [False, True])
def test_torch_adam_checkpoint_keeps_its_weight_decay_mode(cpu_route, decoupled):
    # A torch.optim.Adam checkpoint (decoupled_weight_decay in each group) loaded into a
    # FusedAdam built with the other mode continues with the checkpoint's mode.
    init = _two_params()
    ref = [p.double().clone() for p in init]
    torch_opt = torch.optim.Adam(ref, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=decoupled)
    grads = _grads_for(init, 4)
    _run_steps(torch_opt, ref, grads[:2])
    ours = [r.detach().float().clone() for r in ref]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1, adam_w_mode=not decoupled)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert opt.param_groups[0]["adam_w_mode"] is decoupled
    _run_steps(opt, ours, grads[2:])
    _run_steps(torch_opt, ref, grads[2:])
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.double(), r, **_TORCH_TOL)


def _two_groups(params, adam_w_modes):
    return [{"params": [p], "adam_w_mode": mode} for p, mode in zip(params, adam_w_modes)]


@_needs_decoupled_adam
def test_each_groups_weight_decay_mode_goes_through_checkpoints_both_ways(cpu_route):
    """A FusedAdam of two groups with different weight-decay modes (AdamW for the weights, L2
    for the rest) saves each group's mode, so ``torch.optim.Adam`` continues each group as the
    same update; and a ``torch.optim.Adam`` checkpoint of two such groups loads into a
    FusedAdam built with the other modes, each group continuing with its own mode. Reference:
    the other optimizer continuing from the same checkpoint (float64). (M05, M07)"""
    init = _two_params()
    grads = _grads_for(init, 4)
    ours = [p.clone() for p in init]
    opt = FusedAdam(_two_groups(ours, [True, False]), lr=1e-2, weight_decay=0.1)
    _run_steps(opt, ours, grads[:2])
    saved = copy.deepcopy(opt.state_dict())
    assert [g["decoupled_weight_decay"] for g in saved["param_groups"]] == [True, False]
    ref = [p.detach().double().clone() for p in ours]
    torch_opt = torch.optim.Adam([{"params": [r]} for r in ref], lr=1e-2, weight_decay=0.1)
    torch_opt.load_state_dict(saved)
    _run_steps(opt, ours, grads[2:])
    _run_steps(torch_opt, ref, grads[2:])
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.double(), r, **_TORCH_TOL)
    # ... and back: a torch.optim.Adam checkpoint of two groups of other modes.
    ref = [p.double().clone() for p in init]
    torch_opt = torch.optim.Adam([{"params": [ref[0]], "decoupled_weight_decay": False},
                                  {"params": [ref[1]], "decoupled_weight_decay": True}],
                                 lr=1e-2, weight_decay=0.1)
    _run_steps(torch_opt, ref, grads[:2])
    ours = [r.detach().float().clone() for r in ref]
    opt = FusedAdam(_two_groups(ours, [True, False]), lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert [g["adam_w_mode"] for g in opt.param_groups] == [False, True]
    _run_steps(opt, ours, grads[2:])
    _run_steps(torch_opt, ref, grads[2:])
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.double(), r, **_TORCH_TOL)


@_needs_decoupled_adam
def test_a_weight_decay_mode_changed_after_a_resume_is_the_one_saved(cpu_route):
    """A group's ``adam_w_mode`` changed by hand after ``load_state_dict`` (the loaded group
    also holds the checkpoint's ``decoupled_weight_decay``, as loaded groups keep every saved
    key): the next ``state_dict()`` states the mode the group now steps with, so ``torch.optim.Adam`` resumes the same update
    rather than the checkpoint's old mode, and the step itself follows the new mode.
    Reference: ``torch.optim.Adam`` (float64) resumed from that state dict. (M06, M31)"""
    init = _two_params()
    grads = _grads_for(init, 5)
    ours = [p.clone() for p in init]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1)  # AdamW mode
    _run_steps(opt, ours, grads[:1])
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.param_groups[0]["adam_w_mode"] = False  # L2 decay from here on
    _run_steps(opt, ours, grads[1:2])
    saved = copy.deepcopy(opt.state_dict())
    assert saved["param_groups"][0]["decoupled_weight_decay"] is False
    ref = [p.detach().double().clone() for p in ours]
    torch_opt = torch.optim.Adam(ref, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    torch_opt.load_state_dict(saved)
    _run_steps(opt, ours, grads[2:])
    _run_steps(torch_opt, ref, grads[2:])
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.double(), r, **_TORCH_TOL)


def test_a_checkpoint_with_float64_step_counts_continues_as_torch_adamw(cpu_route):
    # torch.optim.AdamW keeps its step counts in the default dtype (float64 when that is the
    # default): FusedAdam takes them as fp32 on the parameter's device, as its own, and
    # continues the same update.
    init = _two_params()
    ref = [p.double().clone() for p in init]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
        grads = _grads_for(init, 4)
        _run_steps(torch_opt, ref, grads[:2])
    finally:
        torch.set_default_dtype(previous)
    saved = copy.deepcopy(torch_opt.state_dict())
    assert saved["state"][0]["step"].dtype == torch.float64
    ours = [r.detach().float().clone() for r in ref]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(saved)
    for p in ours:
        step = opt.state[p]["step"]
        assert step.dtype == torch.float32 and step.device == p.device and float(step) == 2
    _run_steps(opt, ours, grads[2:])
    _run_steps(torch_opt, ref, grads[2:])
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.double(), r, **_TORCH_TOL)
        assert opt.state[p]["step"].dtype == torch.float32


def test_an_instance_state_without_mixprecs_attributes_zero_grads_to_none():
    # An optimizer pickled with PyTorch's instance state only (defaults, state, param_groups:
    # what torch.optim.Optimizer.__getstate__ gives, e.g. Apex's FusedAdam saved whole) is
    # restored with Apex's default set_grad_none=True: zero_grad() sets gradients to None.
    p = torch.nn.Parameter(torch.randn(3))
    built = FusedAdam([p], lr=1e-3)
    torch_state = torch.optim.Optimizer.__getstate__(built)
    assert "set_grad_none" not in torch_state
    restored = FusedAdam.__new__(FusedAdam)
    restored.__setstate__(dict(torch_state))
    assert restored.set_grad_none is True and restored.capturable is False
    p.grad = torch.ones(3)
    restored.zero_grad()
    assert p.grad is None


def test_a_resumed_state_dict_equals_the_uninterrupted_ones():
    # torch's load_state_dict puts "differentiable" into the defaults (its __setstate__), and
    # filling the groups' missing options from them gave every resumed group that key too.
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(3))]
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1)
    grads = _grads_for(params, 2)
    _run_steps(opt, params, grads)
    resumed = FusedAdam([nn.Parameter(p.detach().clone()) for p in params], lr=1e-2,
                        weight_decay=0.1)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    saved, again = opt.state_dict(), resumed.state_dict()
    assert saved["param_groups"] == again["param_groups"]
    assert saved["state"].keys() == again["state"].keys()


# -- mutation run r50C: what the checks above let through ---------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(eps=True), r"FusedAdam\(eps=True\): eps must be a number"),
    (dict(weight_decay=True), r"FusedAdam\(weight_decay=True\): weight_decay must be a number"),
    (dict(lr=True), r"FusedAdam\(lr=True\): lr must be a number >= 0 or"),
    (dict(lr=float("nan")), r"FusedAdam\(lr=nan\): lr must be a number >= 0"),
    (dict(lr=torch.tensor([])), r"shape \(0,\) on cpu\): a tensor lr must hold one element"),
])
def test_bool_nan_and_empty_hyperparameters_are_refused(kwargs, message):
    """``True`` is a ``numbers.Real`` (it was taken as 1.0), NaN fails ``lr < 0`` (NaN
    weights), and an empty tensor lr reached ``.item()`` (a bare RuntimeError)."""
    with pytest.raises(ValueError, match=message):
        FusedAdam([nn.Parameter(torch.zeros(2))], **kwargs)


def test_a_nan_learning_rate_set_by_hand_is_refused_at_the_step():
    p = nn.Parameter(torch.ones(2))
    opt = FusedAdam([p], lr=1e-2)
    opt.param_groups[0]["lr"] = float("nan")
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"FusedAdam param group 0: lr=nan: lr must be"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(2))


def test_betas_of_another_length_are_refused_up_front():
    """Three betas were taken by the constructor, ``add_param_group`` and
    ``load_state_dict``, and failed only at the step ("too many values to unpack")."""
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError,
                       match=r"FusedAdam\(betas=\(0.9, 0.99, 0.999\)\): betas must be a pair"):
        FusedAdam(p, betas=(0.9, 0.99, 0.999))
    opt = FusedAdam(p)
    with pytest.raises(ValueError, match=r"param group 1: betas=\[0.9, 0.99, 0.999\]: .*pair"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))],
                             "betas": [0.9, 0.99, 0.999]})
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0]["betas"] = (0.9, 0.99, 0.999)
    with pytest.raises(ValueError, match=r"load_state_dict: param group 0: betas=.*pair"):
        opt.load_state_dict(bad)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["betas"] == (0.9, 0.999)


def test_a_zero_tensor_learning_rate_is_accepted_as_by_torch_optim():
    """A tensor rate of 0 (a warm-up schedule's first value), as ``torch.optim.AdamW`` takes
    it: the parameters stay, the step counts advance, a checkpoint of it loads."""
    p = nn.Parameter(torch.ones(3))
    opt = FusedAdam([p], lr=torch.tensor(0.0), weight_decay=0.1)
    p.grad = torch.ones(3)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and opt.state[p]["step"].item() == 1.0
    opt.add_param_group({"params": [nn.Parameter(torch.ones(1))], "lr": torch.tensor(0.0)})
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt.param_groups[1]["lr"].item() == 0.0


def test_flags_and_betas_are_stored_as_bools_and_a_tuple():
    """An int flag and a list of betas are stored as booleans and a tuple, which
    ``state_dict()`` saves (with PyTorch's Adam options stated)."""
    opt = FusedAdam([nn.Parameter(torch.zeros(2))], bias_correction=1, adam_w_mode=0,
                    betas=[0.8, 0.99])
    group = opt.param_groups[0]
    assert group["bias_correction"] is True and group["adam_w_mode"] is False
    assert group["betas"] == (0.8, 0.99) and isinstance(group["betas"], tuple)
    saved = opt.state_dict()["param_groups"][0]
    assert saved["decoupled_weight_decay"] is False and saved["bias_correction"] is True
    assert saved["amsgrad"] is False and saved["maximize"] is False


def test_the_defaults_are_apexs_and_step_as_torch_adams_defaults():
    """Scripts ported from Apex build ``FusedAdam(model.parameters())`` and rely on its
    defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, no weight decay, bias correction on,
    AdamW mode, ``set_grad_none=True``, ``capturable=False``. With no weight decay that is
    ``torch.optim.Adam()``'s update with its own defaults (float64 reference, 3 steps).
    (M34, M35)"""
    gen = torch.Generator().manual_seed(75)
    p = nn.Parameter(torch.randn(37, 29, generator=gen))
    ref = nn.Parameter(p.detach().double().clone())
    opt = FusedAdam([p])
    ref_opt = torch.optim.Adam([ref], foreach=False)
    group = opt.param_groups[0]
    assert {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "bias_correction",
                                  "adam_w_mode")} == dict(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True,
        adam_w_mode=True)
    assert opt.set_grad_none is True and opt.capturable is False
    for _ in range(3):
        g = torch.randn(37, 29, generator=gen)
        p.grad, ref.grad = g.clone(), g.double()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(p.detach(), ref.detach().float(), **_TOL)


def _step_with_random_grads(opt, masters, gen):
    for m in masters:
        m.grad = torch.randn(m.shape, generator=gen).to(m.device)
    opt.step()


def _stepped_with_linked_bf16_copies(device, gen):
    """Two masters, their bf16 copies linked as amp O2 links them, and one step taken."""
    masters = _params(device, gen, [(37, 29), (5,)])
    copies = [m.to(torch.bfloat16) for m in masters]
    opt = FusedAdam(masters, lr=1e-2)
    opt._link_half_copies(list(zip(copies, masters)))
    _step_with_random_grads(opt, masters, gen)
    return masters, copies, opt


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_copies_linked_after_steps_and_relinked_are_written(device, path, half):
    """Copies linked after the optimizer stepped (``amp.initialize`` of an optimizer that
    already stepped, or a second one with a new half model): the plan cached at the earlier
    steps knew no copies (or the old ones), so the step wrote none while reporting them
    written."""
    gen = torch.Generator().manual_seed(31)
    masters = _params(device, gen, [(37, 29), (5,)])
    opt = FusedAdam(masters, lr=1e-2, weight_decay=0.1)
    _step_with_random_grads(opt, masters, gen)
    for _ in range(2):  # linked after a step; then relinked to a new half model
        copies = [torch.zeros(m.shape, dtype=half, device=device) for m in masters]
        opt._link_half_copies(list(zip(copies, masters)))
        _step_with_random_grads(opt, masters, gen)
        for m, c in zip(masters, copies):
            assert torch.equal(c, m.to(half))
        assert {id(m) for m in opt._half_copies_written} == {id(m) for m in masters}


def test_unlinked_half_copies_are_no_longer_written(device, path):
    """``amp.restore_model`` links no pairs: the step stops writing the copies and reports
    none written."""
    gen = torch.Generator().manual_seed(32)
    masters, copies, opt = _stepped_with_linked_bf16_copies(device, gen)
    assert len(opt._half_copies_written) == 2
    opt._link_half_copies([])
    for c in copies:
        c.fill_(7.0)
    _step_with_random_grads(opt, masters, gen)
    assert all(torch.equal(c, torch.full_like(c, 7.0)) for c in copies)
    assert opt._half_copies_written == [] and not opt._half_copies


def test_half_copies_stay_linked_through_load_state_dict(device, path):
    """A resume under amp O2 (``optimizer.load_state_dict``, through ``__setstate__``) keeps
    the step writing the half model (else amp's own copy pass silently took over again)."""
    gen = torch.Generator().manual_seed(42)
    masters, copies, opt = _stepped_with_linked_bf16_copies(device, gen)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _step_with_random_grads(opt, masters, gen)
    assert {id(m) for m in opt._half_copies_written} == {id(m) for m in masters}
    for m, c in zip(masters, copies):
        assert torch.equal(c, m.to(torch.bfloat16))


@pytest.mark.parametrize("other", [torch.bfloat16, torch.float32])
def test_a_half_copy_converted_through_data_is_written_in_its_new_dtype(device, path, other):
    """A model parameter re-cast after the copies were linked (its ``.data`` swapped, as
    ``module.to(dtype)`` does) is re-checked and holds the master rounded to its new dtype:
    with the cached plan the kernel wrote 2-byte values into an fp32 copy's storage."""
    gen = torch.Generator().manual_seed(40)
    masters = _params(device, gen, [(37, 29), (2050,)])
    copies = [m.to(torch.float16) for m in masters]
    opt = FusedAdam(masters, lr=1e-2, weight_decay=0.1)
    opt._link_half_copies(list(zip(copies, masters)))
    _step_with_random_grads(opt, masters, gen)
    for c in copies:
        c.data = c.data.to(other)
    _step_with_random_grads(opt, masters, gen)
    for m, c in zip(masters, copies):
        assert c.dtype == other and torch.equal(c, m.to(other))


def test_a_checkpoint_with_an_empty_state_entry_loads():
    """``optimizer.state`` is a defaultdict: reading ``state[p]`` of a parameter that never
    had a gradient leaves an empty entry, which ``state_dict()`` saves. It loads (as into
    ``torch.optim.AdamW``) and that parameter starts fresh moments."""
    gen = torch.Generator().manual_seed(33)
    a = nn.Parameter(torch.randn(4, generator=gen))
    b = nn.Parameter(torch.randn(3, generator=gen))
    opt = FusedAdam([a, b], lr=1e-2)
    a.grad = torch.randn(4, generator=gen)
    opt.step()
    assert opt.state[b] == {}  # (the read leaves the empty entry)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"][1] == {}
    fresh = FusedAdam([a, b], lr=1.0)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["lr"] == 1e-2 and fresh.state[a]["step"].item() == 1.0
    b.grad = torch.randn(3, generator=gen)
    fresh.step()
    assert fresh.state[b]["step"].item() == 1.0 and fresh.state[a]["step"].item() == 2.0


def test_an_old_pytorch_checkpoint_with_integer_step_counts_continues_as_torch_adamw():
    """PyTorch before 1.12 saved Adam's step count as an int: loaded, it becomes an fp32
    tensor on the parameter's device, and the next update is ``torch.optim.AdamW``'s resumed
    from the same state (float64 reference)."""
    gen = torch.Generator().manual_seed(34)
    w, g = (torch.randn(7, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    m = torch.randn(7, 3, generator=gen, dtype=torch.float64) * 0.1
    v = torch.rand(7, 3, generator=gen, dtype=torch.float64) * 0.01
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
             "amsgrad": False, "params": [0]}
    p = nn.Parameter(w.float())
    opt = FusedAdam([p], lr=1.0)
    opt.load_state_dict({"state": {0: {"step": 4, "exp_avg": m.float(),
                                       "exp_avg_sq": v.float()}},
                         "param_groups": [dict(group)]})
    step = opt.state[p]["step"]
    assert torch.is_tensor(step) and step.dtype == torch.float32 and step.item() == 4.0
    ref = nn.Parameter(w.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1.0, foreach=False)
    ref_opt.load_state_dict({"state": {0: {"step": torch.tensor(4.0), "exp_avg": m.clone(),
                                           "exp_avg_sq": v.clone()}},
                             "param_groups": [dict(group)]})
    p.grad, ref.grad = g.float(), g.clone()
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(p.detach(), ref.detach().float(), **_TOL)
    assert opt.state[p]["step"].item() == 5.0


def test_a_parameters_own_step_count_wins_over_a_groups():
    """Apex's per-group ``step`` goes only to parameters without their own count."""
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    opt = FusedAdam([p, q], lr=1e-2)
    z3, z2 = torch.zeros(3), torch.zeros(2)
    opt.load_state_dict({
        "state": {0: {"step": torch.tensor(7.0), "exp_avg": z3, "exp_avg_sq": z3.clone()},
                  1: {"exp_avg": z2, "exp_avg_sq": z2.clone()}},
        "param_groups": [{"lr": 1e-2, "bias_correction": True, "betas": (0.9, 0.999),
                          "eps": 1e-8, "weight_decay": 0.0, "step": 3, "params": [0, 1]}]})
    assert opt.state[p]["step"].item() == 7.0 and opt.state[q]["step"].item() == 3.0
    assert "step" not in opt.param_groups[0]


@pytest.mark.parametrize("reset", ["pop", "update", "popitem"])
def test_a_state_reset_through_any_dict_method_starts_the_moments_afresh(device, path, reset):
    """``state.pop(p)``, ``state.update({p: {}})`` and ``state.popitem()`` are resets as
    ``del`` and ``state[p] = {}`` are (the cached plan kept stepping the old moments)."""
    gen = torch.Generator().manual_seed(35)
    params = _params(device, gen, [(37, 29)])
    ref = [p.double() for p in params]

    def between(opt, i):
        if i == 1:
            p = opt.param_groups[0]["params"][0]
            if reset == "pop":
                opt.state.pop(p)
            elif reset == "update":
                opt.state.update({p: {}})
            else:
                opt.state.popitem()

    opt, _ = _train_pair(params, ref, gen, 4, between)
    torch.testing.assert_close(params[0], ref[0].float(), **_TOL)
    assert opt.state[params[0]]["step"].item() == 2.0


@pytest.mark.parametrize("shape", [(), (2, 3, 4, 5)], ids=["0-dim", "channels_last"])
def test_a_group_of_one_parameter_keeps_its_plan(device, path, shape):
    """A parameter alone in its group (a 0-dim logit scale, one conv weight): its plan is
    built once and reused, and the steps match AdamW's. (An ``itemgetter`` of one index
    returns the item itself, not a tuple: a 0-dim parameter failed its second step.)"""
    gen = torch.Generator().manual_seed(36)
    params = _params(device, gen, [shape], memory_format=torch.channels_last)
    ref = [p.double() for p in params]
    plans = []

    def between(opt, i):
        if isinstance(opt, FusedAdam):
            plans.append(list(opt._plans.values()))

    _train_pair(params, ref, gen, 4, between)
    assert all(len(ps) == 1 and ps[0] is plans[0][0] for ps in plans)
    torch.testing.assert_close(params[0], ref[0].float(), **_TOL)


@pytest.mark.parametrize("changed", ["gradient", "parameter"])
def test_a_channels_last_parameters_gradient_of_another_layout_is_rerouted(device, path,
                                                                          changed):
    """A channels-last parameter whose gradient comes contiguous (NCHW) at a later step, or
    which is made contiguous through ``.data`` (``model.to(memory_format=
    torch.contiguous_format)`` between steps) while its gradient tensor is kept channels-last
    (``zero_grad(set_to_none=False)`` keeps and accumulates into it): the route planned for
    matching layouts is not kept (PyTorch's fused kernels walk every tensor in the
    parameter's memory order); the update is ``torch.optim.AdamW``'s (float64)."""
    gen = torch.Generator().manual_seed(37)
    ours = _params(device, gen, [(3, 4, 5, 6)], memory_format=torch.channels_last)
    ref = [p.double() for p in ours]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for k in range(4):
        if k == 1 and changed == "parameter":
            ours[0].data = ours[0].data.contiguous()  # (its moments stay channels-last)
        g = torch.randn(3, 4, 5, 6, generator=gen).to(device)
        nchw = k == 2 and changed == "gradient"
        ours[0].grad = g.clone() if nchw else g.contiguous(memory_format=torch.channels_last)
        ref[0].grad = g.double()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(ours[0], ref[0].float(), **_TOL)
    assert ours[0].is_contiguous(memory_format=torch.channels_last if changed == "gradient"
                                 else torch.contiguous_format)


def test_a_float32_tensor_lr_steps_float64_parameters_in_float64(device):
    """fp64 parameters are computed in fp64 with a tensor lr too (the plain route, where
    ``bias_correction=False`` sends them): ``lr * weight_decay`` is not rounded to fp32."""
    gen = torch.Generator().manual_seed(39)
    p = nn.Parameter(torch.randn(257, generator=gen, dtype=torch.float64).to(device))
    expected = p.detach().clone()
    lr_t = torch.tensor(1e-2, device=device)  # float32
    lr, b1, b2, eps, wd = lr_t.item(), 0.9, 0.999, 1e-8, 0.05
    opt = FusedAdam([p], lr=lr_t, betas=(b1, b2), eps=eps, weight_decay=wd,
                    bias_correction=False)
    m, v = torch.zeros_like(expected), torch.zeros_like(expected)
    for _ in range(3):
        g = torch.randn(257, generator=gen, dtype=torch.float64).to(device)
        p.grad = g.clone()
        opt.step()
        expected = expected - lr * wd * expected
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        expected = expected - lr * m / (v.sqrt() + eps)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)


def test_cpu_parameters_do_not_take_the_interpreted_kernel_unless_asked(monkeypatch):
    """With ``TRITON_INTERPRET=1`` in the environment (to debug some other kernel), CPU
    parameters still take PyTorch's kernels, not the Triton kernel under the interpreter:
    only tests ask for that (``_KERNEL_ON_CPU``)."""
    from mixprec.amp import _multi_tensor
    monkeypatch.setattr(_multi_tensor, "interpreter_enabled", lambda: True)
    monkeypatch.setattr(_multi_tensor, "verified_triton", lambda: True)
    calls = []
    monkeypatch.setattr(fused_adam._adam_kernel, "adam_step_", lambda *a, **k: calls.append(a))
    assert fused_adam._KERNEL_ON_CPU is False
    p = nn.Parameter(torch.ones(5))
    opt = FusedAdam([p], lr=1e-2)
    p.grad = torch.ones(5)
    opt.step()
    assert not calls and opt.state[p]["step"].item() == 1.0
    assert not torch.equal(p.detach(), torch.ones(5))


# -- mutation run r55B: the kernel's arithmetic, its half copies, and its routes ---------------


@pytest.mark.parametrize("scale", [1024.0, 0.25])
def test_l2_weight_decay_is_added_to_the_unscaled_gradient(device, path, scale):
    """With ``adam_w_mode=False`` and a loss scale handed over (amp's dynamic scaling,
    ``GradScaler``), the L2 term ``weight_decay * p`` joins the gradient after the gradient is
    divided by the scale: the update is ``torch.optim.Adam``'s (float64) on the unscaled
    gradients, so Apex-style Adam-mode users training in fp16 keep the decay they set rather
    than one divided by the loss scale. (K02, F02)"""
    gen = torch.Generator().manual_seed(51)
    params = _params(device, gen, [(3,), (1023,), (37, 29), (2050,)])
    grads = _grads(params, gen, steps=3)
    ours = [p.clone() for p in params]
    opt = FusedAdam(ours, lr=1e-2, adam_w_mode=False, weight_decay=0.1)
    opt.grad_scale = torch.full((), scale, device=device)
    _run(lambda ps: opt, ours, [[g * scale for g in step] for step in grads])
    ref = [p.double() for p in params]
    _run(_torch_reference(False, lr=1e-2, weight_decay=0.1), ref, grads)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)


def test_the_second_moment_keeps_one_minus_beta2_to_fp32_rounding(device, path):
    """With ``beta2=0.999`` (the default) ``exp_avg_sq`` after three steps equals PyTorch's
    float64 AdamW's to a few fp32 roundings (rtol 2e-6; every route lands within 3e-7 on the
    CPU). ``1 - 0.999`` taken in fp32 is 1.3e-5 off relative, a bias in every second moment
    that a checkpoint carries into ``torch.optim.AdamW`` and that the weights' tolerance
    (rtol 1e-5, through a square root) does not show. (K03: only the compiled GPU kernel
    computes a scalar expression in fp32; the CPU interpreter does it in float64)"""
    if path == "torch_fused" and device.type == "cuda":
        pytest.skip("PyTorch's CUDA fused Adam computes these in fp32 (1.3e-5 off on an H100)")
    gen = torch.Generator().manual_seed(52)
    params = _params(device, gen, [(3,), (1023,), (37, 29), (2050,)])
    grads = _grads(params, gen, steps=3)
    ours = [p.clone() for p in params]
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    opt = _run(lambda ps: FusedAdam(ps, **hyper), ours, grads)
    ref = [p.double() for p in params]
    ref_opt = _run(_torch_reference(True, **hyper), ref, grads)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"].double(),
                                   ref_opt.state[r]["exp_avg_sq"], rtol=2e-6, atol=0)


def test_a_first_moment_decay_of_zero_matches_pytorch(device, path):
    """``betas=(0.0, 0.99)`` (GAN training's usual setting, e.g. StyleGAN's; ``betas[0]`` may
    be 0) steps as ``torch.optim.AdamW`` (float64) does: no first-moment bias correction
    (``1 - 0 ** step`` is 1), and no error from ``log2(0)``. (K10, K11)"""
    gen = torch.Generator().manual_seed(53)
    params = _params(device, gen, [(3,), (37, 29), (2050,)])
    grads = _grads(params, gen, steps=3)
    hyper = dict(lr=1e-2, betas=(0.0, 0.99), weight_decay=0.1)
    ours = [p.clone() for p in params]
    _run(lambda ps: FusedAdam(ps, **hyper), ours, grads)
    ref = [p.double() for p in params]
    _run(_torch_reference(True, **hyper), ref, grads)
    for p, r in zip(ours, ref):
        assert p.isfinite().all()
        torch.testing.assert_close(p, r.float(), **_TOL)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (interpreter)
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_a_nan_master_gives_a_nan_half_copy(device, path, half):
    """A master that went NaN (a diverged run, whatever its payload and sign) gives a NaN in
    the half model, as ``master.to(half)`` does, so the failure shows in the model's outputs
    instead of a finite weight (a NaN whose payload fills the mantissa rounded up to -0.0 in
    bf16 when its rounding ignored NaN). (K07)"""
    bits = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000, -0x00400000, 0x7F800001, 0x7FBFFFFF],
                        dtype=torch.int32)
    master = bits.view(torch.float32).to(device)
    assert master.isnan().all()
    copy_ = torch.zeros(master.shape, dtype=half, device=device)
    opt = FusedAdam([master], lr=0.0)
    opt._link_half_copies([(copy_, master)])
    master.grad = torch.zeros_like(master)
    opt.step()
    assert master.isnan().all() and copy_.isnan().all(), copy_


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (interpreter)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_a_master_that_overflows_gives_an_infinite_half_copy(device, path, half):
    """A master pushed past fp32's range by the step (a rate far too large) is +-inf, and the
    half model holds the same +-inf, as ``master.to(half)`` gives: an overflowed weight reads
    as an infinity in the model (not as a NaN), so the half model tells the same story as the
    masters when a user looks for where a run diverged. (K02)"""
    master = torch.tensor([3e38, -3e38, 1.0, -2.0], device=device)
    copy_ = torch.zeros(master.shape, dtype=half, device=device)
    opt = FusedAdam([master], lr=1e38)
    opt._link_half_copies([(copy_, master)])
    master.grad = torch.tensor([-1.0, 1.0, 0.5, -0.5], device=device)
    opt.step()
    assert master.isinf().all()
    assert torch.equal(copy_.view(torch.int16), master.to(half).view(torch.int16)), copy_


@pytest.mark.parametrize("adam_w", [True, False])
def test_an_infinite_weight_stays_infinite_without_weight_decay(device, path, adam_w):
    """An infinite weight (an overflowed layer being inspected, a -inf mask kept as a
    parameter) stays infinite at weight_decay=0, as torch.optim.AdamW / Adam keep it on each
    of their routes: the decay term is skipped there, not computed as 0 * inf = NaN (the
    kernel and the plain route gave NaN). Reference: torch.optim.AdamW / Adam
    (single-tensor, fp32) on the same values for two steps; the infinities exactly, the
    rest within _TOL. (r64B's bug)"""
    values = torch.tensor([float("inf"), -float("inf"), 1.0, -2.0])
    grads = torch.tensor([0.5, -0.5, 0.5, 0.25])
    ours = values.clone().to(device).requires_grad_()
    ref = values.clone().requires_grad_()
    opt = FusedAdam([ours], lr=1e-3, adam_w_mode=adam_w)
    ref_cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    ref_opt = ref_cls([ref], lr=1e-3, weight_decay=0.0, foreach=False)
    for _ in range(2):
        ours.grad, ref.grad = grads.to(device), grads.clone()
        opt.step()
        ref_opt.step()
    assert ours[:2].isinf().all()
    torch.testing.assert_close(ours.detach().cpu(), ref.detach(), **_TOL)


def test_a_half_copy_of_another_layout_is_written_in_its_own_layout(device, path):
    """A half model parameter laid out otherwise than its master (a channels-last conv weight
    whose master was made contiguous, a transposed view) holds ``master.to(half)`` element for
    element after the step: the copy is not written in the master's memory order. (K14)"""
    gen = torch.Generator().manual_seed(55)
    masters = _params(device, gen, [(3, 4, 5, 6), (33, 17)])
    copies = [masters[0].to(torch.bfloat16).contiguous(memory_format=torch.channels_last),
              masters[1].t().to(torch.float16).contiguous().t()]
    assert not any(c.is_contiguous() for c in copies)
    opt = FusedAdam(masters, lr=1e-2, weight_decay=0.1)
    opt._link_half_copies(list(zip(copies, masters)))
    for _ in range(2):
        for m in masters:
            m.grad = torch.randn(m.shape, generator=gen).to(device)
        opt.step()
        for m, c in zip(masters, copies):
            assert torch.equal(c, m.to(c.dtype))
    assert {id(m) for m in opt._half_copies_written} == {id(m) for m in masters}


def test_amp_o2_half_model_made_channels_last_after_initialize_holds_the_masters(amp_device):
    """``model.to(memory_format=
    torch.channels_last)`` after ``amp.initialize(..., opt_level="O2")`` (a common order: the
    layout set just before training) re-lays out the half conv weights through ``.data`` while
    their fp32 masters stay contiguous. The cached plan re-read only the copies' dtype and
    device, so the kernel kept writing each master into its half weight in the master's
    memory order: the half model trained on scrambled conv weights, silently. After the step
    every half parameter must equal its master rounded, as at the first steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)).to(amp_device)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    gen = torch.Generator().manual_seed(1)
    for i in range(3):
        if i == 1:
            model.to(memory_format=torch.channels_last)
        x = torch.randn(2, 3, 6, 6, generator=gen).to(amp_device)
        opt.zero_grad()
        with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    for half, master in _state.optimizer_state(opt).pairs:
        assert torch.equal(half, master.to(half.dtype)), tuple(half.shape)


def _channels_last_steps_match_adamw(device, seed):
    """Two AdamW steps of a channels-last conv weight (channels-last gradients) and a bias:
    the moments are created channels-last, as ``torch.optim.AdamW`` creates them, and the
    weights are AdamW's (float64)."""
    gen = torch.Generator().manual_seed(seed)
    params = _params(device, gen, [(3, 4, 5, 6), (7,)], memory_format=torch.channels_last)
    assert not params[0].is_contiguous()
    ours = [p.clone() for p in params]
    grads = [[g.contiguous(memory_format=torch.channels_last) if g.dim() == 4 else g
              for g in step] for step in _grads(params, gen, steps=2)]
    opt = _run(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1), ours, grads)
    for name in ("exp_avg", "exp_avg_sq"):
        assert opt.state[ours[0]][name].is_contiguous(memory_format=torch.channels_last)
    ref = [p.double() for p in params]
    _run(_torch_reference(True, lr=1e-2, weight_decay=0.1), ref, grads)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)


def test_channels_last_parameters_take_the_kernel_with_moments_of_their_layout(kernel_device,
                                                                               monkeypatch):
    """A channels-last conv weight (4-D) takes the Triton kernel, as a contiguous parameter
    does, with its moments created channels-last (as ``torch.optim.AdamW`` creates them): at
    O2 its half copy is then written in the same pass rather than by a second copy. (K15,
    F04)"""
    calls = []
    original = fused_adam._adam_kernel.adam_step_

    def spy(params, *args, **kwargs):
        calls.append([tuple(p.shape) for p in params])
        return original(params, *args, **kwargs)

    monkeypatch.setattr(fused_adam._adam_kernel, "adam_step_", spy)
    _channels_last_steps_match_adamw(kernel_device, 56)
    assert calls == [[(3, 4, 5, 6), (7,)]] * 2


def test_the_first_updates_match_float64_to_a_few_fp32_roundings(device, path):
    """The first steps' updates (``p_after - p_before``, of weights small enough that fp32
    holds the difference to about 2e-9) equal PyTorch's float64 AdamW's to rtol 2e-6 with
    ``betas=(0.9, 0.999)``: both bias corrections, ``1 - 0.999 ** step`` above all, are taken
    to fp32 rounding. Computed in fp32 ``0.999 ** 1`` alone is 1.3e-5 off relative, and a
    GPU's approximate exp2 more: a bias of the first steps' sizes (warm-up, where Adam's
    correction matters most) that the weights' usual tolerance cannot see. (K06)"""
    if path == "torch_fused" and device.type == "cuda":
        pytest.skip("PyTorch's CUDA fused Adam computes these in fp32 (1.3e-5 off on an H100)")
    gen = torch.Generator().manual_seed(58)
    params = [p * 1e-3 for p in _params(device, gen, [(3,), (1023,), (37, 29), (2050,)])]
    grads = _grads(params, gen, steps=3)
    ours = [p.clone() for p in params]
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    opt = FusedAdam(ours, **hyper)
    ref = [p.double() for p in params]
    ref_opt = _torch_reference(True, **hyper)(ref)
    for step in grads:
        before, ref_before = [p.double() for p in ours], [r.clone() for r in ref]
        _step_both(step, ours, ref, opt, ref_opt)
        for p, b, r, rb in zip(ours, before, ref, ref_before):
            torch.testing.assert_close(p.double() - b, r - rb, rtol=2e-6, atol=4e-9)


def test_each_group_keeps_its_plan_across_steps(device, path):
    """Two parameter groups stepped together each keep a routing plan from the second step on
    (the checks and the address tables are not redone every step: a model with a no-decay
    group, the usual split, must not pay the first step's cost at each step), and step as
    ``torch.optim.AdamW`` (float64) with the groups' options. (The first group's plan is
    rebuilt once, at the second step: the second group's first states, created after it was
    planned, count as a change of the state.) (F06)"""
    gen = torch.Generator().manual_seed(59)
    params = _params(device, gen, [(37, 29), (5,)])
    grads = _grads(params, gen, steps=4)
    ours = [p.clone() for p in params]
    groups = lambda ps: [{"params": [ps[0]], "weight_decay": 0.1},  # noqa: E731
                         {"params": [ps[1]], "weight_decay": 0.0}]
    opt = FusedAdam(groups(ours), lr=1e-2)
    ref = [p.double() for p in params]
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, foreach=False)
    plans = []
    for step in grads:
        _step_both(step, ours, ref, opt, ref_opt)
        plans.append(list(opt._plans.values()))
    assert len(plans[1]) == 2
    assert all(len(ps) == 2 and all(a is b for a, b in zip(ps, plans[1])) for ps in plans[1:])
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r.float(), **_TOL)


def test_an_integer_step_count_loads_as_fp32_whatever_the_default_dtype():
    """An old checkpoint's integer
    step count (PyTorch < 1.12) loaded while ``torch.get_default_dtype()`` is float64 becomes
    an fp32 count, as ``load_state_dict`` documents: a float64 count on a GPU sent the
    parameter to PyTorch's fused CUDA kernel, which reads it as fp32 (NaN weights)."""
    p = nn.Parameter(torch.ones(3))
    opt = FusedAdam([p], lr=1e-2)
    z = torch.zeros(3)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        opt.load_state_dict({"state": {0: {"step": 4, "exp_avg": z, "exp_avg_sq": z.clone()}},
                             "param_groups": [{**opt.state_dict()["param_groups"][0]}]})
    finally:
        torch.set_default_dtype(previous)
    step = opt.state[p]["step"]
    assert step.dtype == torch.float32 and step.device == p.device and step.item() == 4.0


@pytest.mark.parametrize("scale", [3.0, 1000.0])
def test_a_loss_scale_not_a_power_of_two_divides_each_gradient_exactly(device, path, scale):
    """A loss scale need not be a power of two (``GradScaler(init_scale=1000.0)``, a static
    ``loss_scale`` given to amp): each route divides every gradient by it, one fp32 rounding,
    as ``grad / scale`` does, rather than multiplying by a rounded reciprocal (two roundings,
    a one-ulp bias in the moments that a power-of-two scale hides). With ``betas[0] == 0`` the
    first moment after one step is that quotient exactly. The reference quotient is taken on
    the CPU: on CUDA, PyTorch divides a tensor by a Python number as a multiplication by its
    reciprocal, the very rounding this test tells apart."""
    gen = torch.Generator().manual_seed(61)
    params = _params(device, gen, [(3,), (1023,), (2050,)])
    opt = FusedAdam(params, lr=1e-2, betas=(0.0, 0.99))
    opt.grad_scale = torch.full((), scale, device=device)
    scaled = [g * scale for g in _grads(params, gen, steps=1)[0]]
    _run(lambda ps: opt, params, [scaled])
    for p, g in zip(params, scaled):
        assert torch.equal(opt.state[p]["exp_avg"].cpu(), g.cpu() / scale)


def test_channels_last_parameters_take_pytorchs_fused_kernel_off_the_triton_kernel(
        monkeypatch):
    """Where the Triton kernel does not run (CPU parameters by default; half parameters on
    CUDA), a channels-last conv weight with a channels-last gradient takes PyTorch's fused
    Adam kernel with the contiguous parameters, not the plain per-parameter arithmetic (many
    small launches per conv layer), and its moments stay channels-last. The update is
    ``torch.optim.AdamW``'s (float64)."""
    monkeypatch.setattr(fused_adam, "_kernel_device_ok", lambda device: False)
    if not fused_adam._torch_fused_ok(torch.device("cpu")):
        pytest.skip("this PyTorch has no fused Adam kernel for CPU tensors")
    routes = {"fused": [], "plain": []}
    for name, route in (("_torch_fused_step", "fused"), ("_reference_step", "plain")):
        original = getattr(fused_adam, name)

        def spy(params, grads, states, *args, _route=route, _original=original):
            idx = args[1] if _route == "fused" else args[0]  # (after steps / first)
            routes[_route].append(sorted(tuple(params[i].shape) for i in idx))
            return _original(params, grads, states, *args)

        monkeypatch.setattr(fused_adam, name, spy)
    _channels_last_steps_match_adamw(torch.device("cpu"), 62)
    assert routes == {"fused": [[(3, 4, 5, 6), (7,)]] * 2, "plain": []}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="requires CUDA"))])
def test_a_group_of_several_dtypes_calls_torchs_fused_kernel_once_per_dtype(device,
                                                                           monkeypatch):
    # One group holding fp16, bf16 and fp64 parameters (the kernel takes none of them): the
    # routing grouped PyTorch's fused calls by device only, and its CUDA kernel, which takes
    # one dtype per call, raised "params, grads, exp_avgs, and exp_avg_sqs must have same
    # dtype, device, and layout" (r102A's fuzzer on the H100). Each call has one dtype now,
    # and every parameter is stepped as torch.optim.AdamW(fused=True) steps it alone, to
    # the bit.
    if not fused_adam._torch_fused_ok(torch.device(device)):
        pytest.skip(f"this PyTorch has no fused Adam kernel for {device} tensors")
    calls = []
    real = torch._fused_adamw_

    def recording(params, *args, **kwargs):
        calls.append({p.dtype for p in params})
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", recording)
    torch.manual_seed(0)
    dtypes = [torch.float16, torch.bfloat16, torch.float64, torch.float16]
    ours = [torch.randn(33, device=device).to(dt) for dt in dtypes]
    refs = [[p.clone()] for p in ours]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1)
    ref_opts = [torch.optim.AdamW(r, lr=1e-2, weight_decay=0.1, fused=True) for r in refs]
    for _ in range(3):
        grads = [torch.randn(33, device=device).to(p.dtype) for p in ours]
        for p, r, g in zip(ours, refs, grads):
            p.grad, r[0].grad = g.clone(), g.clone()
        opt.step()
        for o in ref_opts:
            o.step()
    assert calls and all(len(dts) == 1 for dts in calls), calls  # (the references' too)
    for p, (r,) in zip(ours, refs):
        torch.testing.assert_close(p, r, rtol=0, atol=0)
