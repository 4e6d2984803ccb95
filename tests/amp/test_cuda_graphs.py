"""A whole amp training step captured in a CUDA graph replays like eager steps (GPU only).

With a static loss scale, or a dynamic one kept on the GPU (fused optimizers), nothing in amp
reads the device from the host, so forward, backward, the unscale into the fp32 masters, the
optimizer step and the master-to-model copy can all be captured; each replay must then equal
one eager step.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mixprec import amp
from tests._graphs import amp_step, warm_up_and_capture

from .helpers import batch, make_cnn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")


def _setup(opt_level, dtype, loss_scale, channels_last=True, fused_adamw=False):
    model = make_cnn("cuda", width=16)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if fused_adamw:  # (capturable: PyTorch's condition for capturing Adam's step)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=dtype,
                                loss_scale=loss_scale, verbosity=0)
    return model, opt


@pytest.mark.parametrize("opt_level,dtype,loss_scale", [
    ("O2", torch.float16, 128.0),
    ("O2", torch.bfloat16, None),
    ("O1", torch.bfloat16, None),
    ("O3", torch.float16, 64.0),
])
def test_captured_step_matches_eager_steps(opt_level, dtype, loss_scale):
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        _compare_captured_with_eager(opt_level, dtype, loss_scale)


def _compare_captured_with_eager(opt_level, dtype, loss_scale, fused_adamw=False):
    """Capture a step after 3 warm-up steps, replay it 4 times, and check losses, weights and
    masters against 7 eager steps. Returns everything the graph reads and writes by address
    (model, optimizer, inputs, targets, loss), which must outlive its replays, as a namespace;
    ``static_x`` may be changed between replays, ``x`` holds the original input."""
    x, y = batch("cuda", n=16, size=16)
    eager_model, eager_opt = _setup(opt_level, dtype, loss_scale, fused_adamw=fused_adamw)
    graph_model, graph_opt = _setup(opt_level, dtype, loss_scale, fused_adamw=fused_adamw)
    warmup, replays = 3, 4
    static_x = x.clone()

    graph, static_loss = warm_up_and_capture(
        lambda: amp_step(graph_model, graph_opt, static_x, y), graph_opt, warmup
    )
    losses = []
    for _ in range(replays):
        graph.replay()
        losses.append(static_loss.item())

    eager_losses = []
    for _ in range(warmup + replays):
        eager_opt.zero_grad(set_to_none=True)
        eager_losses.append(amp_step(eager_model, eager_opt, x, y).item())
    assert losses == pytest.approx(eager_losses[warmup:], rel=1e-5, abs=1e-6)
    for (name, p), q in zip(eager_model.state_dict().items(), graph_model.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    for p, q in zip(amp.master_params(eager_opt), amp.master_params(graph_opt)):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert amp.step_was_skipped(graph_opt) == amp.step_was_skipped(eager_opt)
    assert _scale_of(graph_opt) == _scale_of(eager_opt)
    return SimpleNamespace(graph=graph, model=graph_model, opt=graph_opt, static_x=static_x,
                           x=x, y=y, loss=static_loss)


def test_dynamic_loss_scale_needs_a_fused_optimizer_under_capture():
    # SGD without fused=True skips an overflowed step only if the host reads the flag.
    model, opt = _setup("O2", torch.float16, "dynamic")
    x, y = batch("cuda", n=16, size=16)
    with pytest.raises(RuntimeError, match="fused=True.*loss_scale=128.0"):
        warm_up_and_capture(lambda: amp_step(model, opt, x, y), opt, warmup=1)


def test_capturing_the_first_dynamic_step_is_a_clear_error():
    model, opt = _setup("O2", torch.float16, "dynamic", fused_adamw=True)
    x, y = batch("cuda", n=16, size=16)
    # Warm cuDNN and cuBLAS up without amp, so that the first scale_loss is the captured one.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        nn.functional.cross_entropy(model(x), y).backward()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="at least one step eagerly"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            amp_step(model, opt, x, y)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_dynamic_loss_scale_is_captured_with_a_fused_optimizer(opt_level):
    # The scale lives on the GPU and kernels update it: each replay equals an eager step, an
    # overflow in a replay skips that step and halves the scale, and the next replay trains on.
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        run = _compare_captured_with_eager(opt_level, torch.float16, "dynamic", fused_adamw=True)
        graph_scale = _scale_of(run.opt)
        before = [p.detach().clone() for p in amp.master_params(run.opt)]
        run.static_x.fill_(float("inf"))
        run.graph.replay()
        assert amp.step_was_skipped(run.opt)
        assert _scale_of(run.opt) == graph_scale / 2
        for p, b in zip(amp.master_params(run.opt), before):
            torch.testing.assert_close(p, b, rtol=0, atol=0)
        run.static_x.copy_(run.x)
        run.graph.replay()
        assert not amp.step_was_skipped(run.opt)
        assert any(not torch.equal(p, b) for p, b in zip(amp.master_params(run.opt), before))


def _scale_of(optimizer):
    from mixprec.amp._state import optimizer_state

    return optimizer_state(optimizer).amp_state.scalers[0].loss_scale
