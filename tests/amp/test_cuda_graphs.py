"""A whole amp training step captured in a CUDA graph replays like eager steps (GPU only).

With a static loss scale nothing in amp reads the device from the host, so forward, backward,
the unscale into the fp32 masters, the optimizer step and the master-to-model copy can all be
captured; each replay must then equal one eager step.
"""

import pytest
import torch
from torch import nn

from mixprec import amp
from tests._graphs import warm_up_and_capture

from .helpers import batch, make_cnn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")


def _setup(opt_level, dtype, loss_scale, channels_last=True):
    model = make_cnn("cuda", width=16)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=dtype,
                                loss_scale=loss_scale, verbosity=0)
    return model, opt


def _step(model, opt, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("opt_level,dtype,loss_scale", [
    ("O2", torch.float16, 128.0),
    ("O2", torch.bfloat16, None),
    ("O1", torch.bfloat16, None),
    ("O3", torch.float16, 64.0),
])
def test_captured_step_matches_eager_steps(opt_level, dtype, loss_scale):
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        _compare_captured_with_eager(opt_level, dtype, loss_scale)


def _compare_captured_with_eager(opt_level, dtype, loss_scale):
    x, y = batch("cuda", n=16, size=16)
    eager_model, eager_opt = _setup(opt_level, dtype, loss_scale)
    graph_model, graph_opt = _setup(opt_level, dtype, loss_scale)
    warmup, replays = 3, 4

    graph, static_loss = warm_up_and_capture(
        lambda: _step(graph_model, graph_opt, x, y), graph_opt, warmup
    )
    losses = []
    for _ in range(replays):
        graph.replay()
        losses.append(static_loss.item())

    eager_losses = []
    for _ in range(warmup + replays):
        eager_opt.zero_grad(set_to_none=True)
        eager_losses.append(_step(eager_model, eager_opt, x, y).item())
    assert losses == pytest.approx(eager_losses[warmup:], rel=1e-5, abs=1e-6)
    for (name, p), q in zip(eager_model.state_dict().items(), graph_model.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    for p, q in zip(amp.master_params(eager_opt), amp.master_params(graph_opt)):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_dynamic_loss_scale_under_capture_is_a_clear_error():
    model, opt = _setup("O2", torch.float16, "dynamic")
    x, y = batch("cuda", n=16, size=16)
    with pytest.raises(RuntimeError, match="loss_scale=128.0"):
        warm_up_and_capture(lambda: _step(model, opt, x, y), opt, warmup=1)
