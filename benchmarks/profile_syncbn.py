"""Where the time of a ResNet-50 SyncBatchNorm step goes (diagnostic; torchrun, 2 GPUs).

Times, on every variant, the step by CUDA events and the host's enqueue time (equal when the
host is the bottleneck): plain BatchNorm, mixprec SyncBatchNorm, and mixprec SyncBatchNorm with
its collectives replaced by local copies (the layers' own host and GPU cost without
communication). ``--profile`` adds PyTorch profiler tables (top kernels, top CPU ops); it is off
by default because the profiler slows every variant timed after it.

    torchrun --standalone --nproc_per_node=2 benchmarks/profile_syncbn.py [--profile]

With one process (``torchrun --standalone --nproc_per_node=1 ...``, one GPU) SyncBatchNorm is
told the world has two ranks and only the local-collectives variant runs beside plain
BatchNorm: the layers' own host and GPU cost, measurable without a second GPU. ``--graphs``
also times every variant's step as a CUDA graph replay (static loss scale 128): the GPU's
share without the host's.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mixprec.parallel._sync_batchnorm_function as sbf  # noqa: E402
from mixprec import amp  # noqa: E402
from mixprec.parallel import DistributedDataParallel, convert_syncbn_model  # noqa: E402


def _local_gather(row, group, world_size):
    return row.unsqueeze(0).expand(world_size, -1).contiguous()


def _local_reduce(t, group):
    return t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--graphs", action="store_true",
                   help="also time each variant's step as a CUDA graph replay")
    p.add_argument("--cprofile", action="store_true",
                   help="also run 5 steps of each variant under cProfile (host functions by "
                        "own time)")
    args = p.parse_args(argv)
    import torchvision

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.backends.cudnn.benchmark = True
    x = torch.randn(args.batch, 3, 224, 224, device=device).half()
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device=device)

    def setup(convert, loss_scale=None):
        torch.manual_seed(0)
        model = convert(torchvision.models.resnet50()).to(device)
        model = model.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return amp.initialize(model, opt, opt_level="O2", loss_scale=loss_scale, verbosity=0)

    def graphed(convert):
        from bench_parallel import _graphed_step

        model, opt = setup(convert, loss_scale=128.0)
        return _graphed_step(model, opt, x, y, lambda out, t: F.cross_entropy(out.float(), t),
                             DistributedDataParallel)

    def build(convert):
        model, opt = setup(convert)
        model = DistributedDataParallel(model)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        return step

    real = (sbf.all_gather_rows, sbf.all_reduce_sum)
    variants = [("plain BatchNorm", lambda m: m, False),
                ("mixprec SyncBatchNorm", convert_syncbn_model, False),
                ("mixprec SyncBatchNorm, collectives local", convert_syncbn_model, True)]
    if dist.get_world_size() == 1:  # pretend to be one of two ranks; no real collectives
        import mixprec.parallel.sync_batchnorm as sbm

        sbm.group_world_size = lambda group: 2
        del variants[1]
    for name, convert, local in variants:
        sbf.all_gather_rows, sbf.all_reduce_sum = (_local_gather, _local_reduce) if local else real
        step = build(convert)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.steps)]
        host = []
        for start, end in events:
            t0 = time.perf_counter()
            start.record()
            step()
            end.record()
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        gpu_ms = statistics.median(s.elapsed_time(e) for s, e in events)
        if rank == 0:
            print(f"{name}: {gpu_ms:.2f} ms/step (CUDA events), host enqueue "
                  f"{1e3 * statistics.median(host):.2f} ms/step", flush=True)
        if args.cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            prof.disable()
            if rank == 0:
                pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            if rank == 0:
                table = prof.key_averages()
                print(table.table(sort_by="self_cuda_time_total", row_limit=20))
                print(table.table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
        del step
        if args.graphs:
            from bench_parallel import _time_steps

            replay = graphed(convert)
            ms = 1e3 * _time_steps(replay, device, args.steps, warmup=3)
            if rank == 0:
                print(f"{name}: {ms:.2f} ms/step as a CUDA graph replay", flush=True)
            del replay
        torch.cuda.empty_cache()
    sbf.all_gather_rows, sbf.all_reduce_sum = real
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
