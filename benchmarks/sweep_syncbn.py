"""Launch settings of SyncBatchNorm's Triton kernels, timed in the ResNet-50 step (tuning aid).

Each variant: ResNet-50 channels_last fp16 O2 (static loss scale 128) under mixprec DDP on all
ranks, the whole step captured in a CUDA graph (the GPU's time, not the host's), mixprec
SyncBatchNorm with one setting of ``_syncbn_triton``'s programs per SM (reductions, element-wise
passes), tile size and merge tile, against plain BatchNorm in the same run. Prints the slowest rank's median replay time.

    torchrun --standalone --nproc_per_node=2 benchmarks/sweep_syncbn.py
"""

import argparse
import os
import sys

os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # PyTorch's DDP-capture recipe
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_parallel import _all_ranks, _graphed_step, _time_steps  # noqa: E402

from mixprec import amp  # noqa: E402
from mixprec.parallel import (  # noqa: E402
    DistributedDataParallel,
    _syncbn_triton,
    convert_syncbn_model,
)

SETTINGS = [  # (reduction programs per SM, element-wise programs per SM, tile, merge rows)
    (4, 8, 4096, 256), (4, 4, 4096, 256), (4, 16, 4096, 256), (4, 2, 4096, 256),
    (4, 8, 8192, 256), (4, 8, 2048, 256),
]


def _graphed_step_ms(convert, device, x, y, steps=20):
    import torchvision

    torch.manual_seed(0)
    model = convert(torchvision.models.resnet50()).to(device)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    replay = _graphed_step(model, opt, x, y, lambda out, t: F.cross_entropy(out.float(), t),
                           DistributedDataParallel)
    # The slowest rank's median replay, in ms.
    return 1e3 * max(_all_ranks(_time_steps(replay, device, steps, warmup=3), device))


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            epilog="Launch: torchrun --standalone --nproc_per_node=2 "
                                   "benchmarks/sweep_syncbn.py").parse_args(argv)
    if not torch.cuda.is_available() or "RANK" not in os.environ:
        sys.exit("sweep_syncbn.py needs CUDA GPUs and a torchrun launch: torchrun --standalone "
                 "--nproc_per_node=2 benchmarks/sweep_syncbn.py")
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.backends.cudnn.benchmark = True
    x = torch.randn(64, 3, 224, 224, device=device).half()
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (64,), device=device)
    base = _graphed_step_ms(lambda m: m, device, x, y)
    if rank == 0:
        print(f"plain BatchNorm: {base:.2f} ms", flush=True)
    for per_sm, elemt_per_sm, tile, merge_rows in SETTINGS:
        _syncbn_triton._PROGRAMS_PER_SM = per_sm
        _syncbn_triton._ELEMT_PROGRAMS_PER_SM = elemt_per_sm
        _syncbn_triton._TILE = tile
        _syncbn_triton._MERGE_BLOCK_S = merge_rows
        _syncbn_triton.plan_for.cache_clear()
        ms = _graphed_step_ms(convert_syncbn_model, device, x, y)
        if rank == 0:
            print(f"programs/SM {per_sm} (element-wise {elemt_per_sm}), tile {tile}, merge rows "
                  f"{merge_rows}: {ms:.2f} ms "
                  f"= {ms / base:.3f}x plain", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
