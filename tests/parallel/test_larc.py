"""LARC against a hand-computed float64 reference (Apex's formula), and its optimizer surface."""

from __future__ import annotations

import pytest
import torch

from mixprec.parallel import LARC


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


def _expected(params, grads, lr, wd, trust, clip, eps):
    out = []
    for p, g in zip(params, grads):
        pn, gn = p.norm().item(), g.norm().item()
        if pn != 0 and gn != 0:
            local = trust * pn / (gn + pn * wd + eps)
            if clip:
                local = min(local / lr, 1.0)
            g = (g + wd * p) * local
        out.append(p - lr * g)
    return out


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("wd", [0.0, 1e-2])
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


def test_larc_clip_bounds_the_rate():
    # Tiny gradient on a large weight: the trust ratio is huge, so LARC clips at lr exactly.
    p = torch.nn.Parameter(torch.full((4,), 10.0))
    p.grad = torch.full((4,), 1e-6)
    LARC(torch.optim.SGD([p], lr=0.5)).step()
    torch.testing.assert_close(p.detach(), torch.full((4,), 10.0 - 0.5 * 1e-6))


def test_larc_float32_and_bfloat16_params():
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(torch.randn(8, dtype=dtype))
        p.grad = torch.randn(8, dtype=dtype)
        before = p.detach().clone()
        LARC(torch.optim.SGD([p], lr=0.1)).step()
        assert p.dtype == dtype and not torch.equal(p.detach(), before)


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


def test_larc_closure():
    p = torch.nn.Parameter(torch.ones(3))
    larc = LARC(torch.optim.SGD([p], lr=0.1))

    def closure():
        larc.zero_grad()
        loss = (p * 2).sum()
        loss.backward()
        return loss

    assert larc.step(closure).item() == pytest.approx(6.0)
    assert not torch.equal(p.detach(), torch.ones(3))


def test_larc_errors():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        LARC([p])
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARC(torch.optim.SGD([p], lr=0.1), trust_coefficient=-1.0)
    with pytest.raises(TypeError, match="clip"):
        LARC(torch.optim.SGD([p], lr=0.1), clip="yes")
