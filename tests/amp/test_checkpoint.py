"""Checkpoints are true fp32 models, and resuming continues bit for bit."""

import io

import pytest
import torch

from mixprec import amp

from .helpers import HALF_DTYPES, OPT_LEVELS, batch, make_cnn, train_step


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_state_dict_is_the_fp32_masters(dtype, device):
    model = make_cnn(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0)
    x, y = batch(device)
    for _ in range(3):
        train_step(model, opt, x, y, amp)
    sd = model.state_dict()
    masters = list(amp.master_params(opt))
    params = dict(model.named_parameters())
    floating = [v for v in sd.values() if v.is_floating_point()]
    assert all(v.dtype == torch.float32 for v in floating)
    for (name, _p), master in zip(params.items(), masters):
        torch.testing.assert_close(sd[name], master.detach(), rtol=0, atol=0)
    # Masters carry more precision than the half weights (what Apex's upcast saved).
    conv = "features.0.weight"
    assert not torch.equal(sd[conv], params[conv].float())

    # Loads strict into the same architecture built in plain fp32.
    plain = make_cnn(device, seed=5)
    plain.load_state_dict(sd, strict=True)
    for name, v in plain.state_dict().items():
        torch.testing.assert_close(v, sd[name], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_loading_into_an_amp_model_restores_masters_exactly(dtype):
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0)
    source = make_cnn(seed=9)
    sd = source.state_dict()
    model.load_state_dict(sd, strict=True)
    for master, (name, p) in zip(amp.master_params(opt), model.named_parameters()):
        torch.testing.assert_close(master.detach(), sd[name], rtol=0, atol=0)
        assert p.dtype == (torch.float32 if ".1." in name or "features.4" in name else dtype)
        torch.testing.assert_close(p.detach(), sd[name].to(p.dtype), rtol=0, atol=0)


def test_o3_state_dict_is_upcast_fp32():
    model = make_cnn()
    amp.initialize(model, opt_level="O3", verbosity=0)
    sd = model.state_dict()
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())
    make_cnn().load_state_dict(sd, strict=True)


def _run(opt_level, dtype, steps, checkpoint=None):
    model = make_cnn()
    # eps=1e-4: Adam's default 1e-8 underflows in fp16 at O3 (pure half, no masters).
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)
    amp.initialize(model, opt, opt_level=opt_level, dtype=dtype, loss_scale="dynamic",
                   verbosity=0)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
    losses = []
    for i in range(steps):
        x, y = batch(seed=100 + i + (0 if checkpoint is None else checkpoint["step"]))
        losses.append(train_step(model, opt, x, y, amp))
    return model, opt, losses


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_resume_is_bit_for_bit(opt_level, dtype):
    torch.use_deterministic_algorithms(True)
    try:
        model, _, full = _run(opt_level, dtype, 8)
        m1, o1, first = _run(opt_level, dtype, 4)
        buf = io.BytesIO()
        torch.save({"model": m1.state_dict(), "optimizer": o1.state_dict(),
                    "amp": amp.state_dict(), "step": 4}, buf)
        buf.seek(0)
        ckpt = torch.load(buf)
        m2, _, second = _run(opt_level, dtype, 4, checkpoint=ckpt)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(torch.stack(first + second), torch.stack(full), rtol=0, atol=0)
    for (k, v), v2 in zip(model.state_dict().items(), m2.state_dict().values()):
        torch.testing.assert_close(v2, v, rtol=0, atol=0, msg=k)
