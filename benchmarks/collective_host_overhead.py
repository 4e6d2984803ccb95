"""Host time of one small collective, the way SyncBatchNorm issues two per layer and step.

A diagnostic for the eager SyncBatchNorm step, which is host-bound (``RESULTS.md``: ~120 us of
host time per collective on the H200 machines). Times, per call, ``torch.distributed``'s
Python functions against the process group's own methods (what the Python functions call after
their argument checks), for an all-gather of ``2C + 1`` fp32 values and an all-reduce of ``2C``.
Host time only: the loop enqueues ``--calls`` collectives and synchronises once at the end.

    torchrun --standalone --nproc_per_node=1 benchmarks/collective_host_overhead.py
    torchrun --standalone --nproc_per_node=2 benchmarks/collective_host_overhead.py
"""

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist


def _time(fn, calls, repeats):
    results = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        results.append((t1 - t0) / calls * 1e6)
    return statistics.median(results)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=2),
                            device_id=torch.device("cuda", local))
    world = dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    c = args.channels
    row = torch.randn(2 * c + 1, device="cuda")
    out = torch.empty(world * row.numel(), device="cuda")
    sums = torch.randn(2 * c, device="cuda")
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    cases = {
        "dist.all_gather_into_tensor": lambda: gather(out, row),
        "pg._allgather_base": lambda: pg._allgather_base(out, row),
        "dist.all_reduce": lambda: dist.all_reduce(sums),
        "pg.allreduce([t])": lambda: pg.allreduce([sums]),
    }
    for fn in cases.values():  # warm-up: communicators, caches
        for _ in range(20):
            fn()
    rows = [(name, _time(fn, args.calls, args.repeats)) for name, fn in cases.items()]
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__}, world {world}, C={c}, "
              f"TORCH_NCCL_TRACE_BUFFER_SIZE={os.environ.get('TORCH_NCCL_TRACE_BUFFER_SIZE')}")
        for name, us in rows:
            print(f"  {name:<30} {us:7.1f} us per call (host)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
