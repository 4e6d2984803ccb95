import copy

import pytest
import torch
from torch import nn

from mixprec import amp

from .helpers import HALF_DTYPES, OPT_LEVELS, batch, make_cnn, train_step


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


def test_closure_step_under_dynamic_scaling():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="closure"):
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


def test_overflow_messages_are_rate_limited(caplog):
    import logging
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", loss_scale="dynamic", verbosity=1)
    x, y = batch()
    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        for _ in range(5):
            with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as s:
                (s * float("inf")).backward()
            opt.step()
    assert caplog.text.count("Gradient overflow") == 1


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("delay", [False, True])
def test_accumulation_equals_sum_of_micro_batches(opt_level, delay):
    # static scale 512 in fp32 (or half at O2/O3): accumulating two micro-batches must give
    # the sum of their unscaled gradients, with or without delay_unscale.
    model = make_cnn()
    x, y = batch(n=16)
    ref = copy.deepcopy(model)
    for xs, ys in ((x[:8], y[:8]), (x[8:], y[8:])):
        nn.functional.cross_entropy(ref(xs), ys).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, loss_scale=512.0, dtype=torch.bfloat16,
                   patch_torch_functions=False if opt_level == "O1" else None, verbosity=0)
    with amp.scale_loss(nn.functional.cross_entropy(model(x[:8]), y[:8]), opt,
                        delay_unscale=delay) as s:
        s.backward()
    with amp.scale_loss(nn.functional.cross_entropy(model(x[8:]), y[8:]), opt) as s:
        s.backward()
    if opt_level in ("O0", "O1"):  # fp32 throughout: only rounding of the sum
        for m, r in zip(amp.master_params(opt), ref.parameters()):
            torch.testing.assert_close(m.grad.float(), r.grad, rtol=1e-5, atol=1e-6)
    else:  # bf16 arithmetic in the model: relative error over all gradients together
        got = torch.cat([m.grad.float().flatten() for m in amp.master_params(opt)])
        want = torch.cat([r.grad.flatten() for r in ref.parameters()])
        rel = (got - want).norm() / want.norm()
        assert rel < (3e-2 if opt_level == "O2" else 5e-2), rel  # O3: BatchNorm in bf16 too


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fused_optimizer_skips_overflow_on_device_without_sync(opt_level, monkeypatch):
    model = make_cnn("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic", verbosity=0)
    x, y = batch("cuda")
    train_step(model, opt, x, y, amp)
    before = [p.detach().clone() for p in amp.master_params(opt)]
    steps = [s["step"].clone() for s in opt.state.values()]
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]

    cuda_reads = []
    original_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item",
                        lambda self: cuda_reads.append(self.is_cuda) or original_item(self))
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as s:
        (s * float("inf")).backward()
    opt.step()
    assert not any(cuda_reads)  # no device-to-host read in scale_loss or step
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
