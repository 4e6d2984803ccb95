"""A data-parallel amp step with SyncBatchNorm, captured in a CUDA graph (two GPUs, NCCL).

SyncBatchNorm never reads the device from the host and amp with a static loss scale neither,
so the whole step (forward with the statistics all-gathers, backward with their all-reduces
and DDP's gradient buckets, the unscale into the fp32 masters, SGD, the master-to-model copy)
can be captured, following PyTorch's recipe for DDP (built on a side stream, 11 eager
iterations before capture, TORCH_NCCL_ASYNC_ERROR_HANDLING=0). Each replay must equal an eager
step of an identical model.
"""

import pytest
import torch
from torch import nn

from tests._graphs import amp_step, warm_up_and_capture
from tests.parallel._harness import cuda_count, labelled, run_checks


def _model(device):
    from mixprec.parallel import convert_syncbn_model

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5),
    )
    return convert_syncbn_model(model).to(device).to(memory_format=torch.channels_last)


def _setup(ctx):
    from mixprec import amp
    from mixprec.parallel import DistributedDataParallel

    model = _model(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ddp = DistributedDataParallel(model)
    torch.cuda.current_stream().wait_stream(side)
    return model, ddp, opt


def check_captured_syncbn_ddp_step_matches_eager(ctx):
    from mixprec import amp

    g = torch.Generator().manual_seed(10 + ctx.rank)
    x = torch.randn(6 + 2 * ctx.rank, 3, 8, 8, generator=g).to(ctx.device)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 5, (x.shape[0],), generator=g).to(ctx.device)
    warmup, replays = 11, 3
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        eager_model, eager_ddp, eager_opt = _setup(ctx)
        for _ in range(warmup + replays):
            eager_opt.zero_grad(set_to_none=True)
            amp_step(eager_ddp, eager_opt, x, y)

        model, ddp, opt = _setup(ctx)
        graph, _ = warm_up_and_capture(lambda: amp_step(ddp, opt, x, y), opt, warmup)
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()

    for (name, p), q in zip(eager_model.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=labelled(name))
    for p, q in zip(amp.master_params(eager_opt), amp.master_params(opt)):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=labelled("master"))


GROUP = ["check_captured_syncbn_ddp_step_matches_eager"]


@pytest.fixture(scope="module")
def nccl_2():
    if cuda_count() < 2:
        pytest.skip("requires 2 GPUs")
    return run_checks(__name__, GROUP, world_size=2, backend="nccl", device_type="cuda",
                      env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})


@pytest.mark.parametrize("check", GROUP)
def test_gpu_nccl_2_gpus(nccl_2, check):
    nccl_2.assert_ok(check)
