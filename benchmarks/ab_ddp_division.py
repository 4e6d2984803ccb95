"""Where DDP divides the gradients by the world size: A/B on the GPT-style step (diagnostic).

mixprec's DistributedDataParallel registers no communication hook in the common case, so
PyTorch's reducer divides each gradient while copying it into its bucket (one fused pass).
Variant B registers PyTorch's built-in C++ all-reduce hook on the same wrapper, as mixprec did
before: a plain copy into the bucket, then a division of every bucket (a second pass over the
gradients). Same model, data and amp O2 bf16 recipe as ``bench_parallel.py``; the variants
alternate in rounds in one process. Prints each round's median step time (slowest rank).

    torchrun --standalone --nproc_per_node=2 benchmarks/ab_ddp_division.py
    torchrun --standalone --nproc_per_node=1 benchmarks/ab_ddp_division.py   # the pass alone
"""

import argparse
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_parallel import (  # noqa: E402
    _all_ranks,
    _gpt_setup,
    _lm_loss,
    _time_steps,
    _train_step,
)

from mixprec.parallel import DistributedDataParallel  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gpt-batch", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="tiny model (a functional check)")
    args = p.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    device = torch.device("cuda", local)

    def build(builtin_hook):
        model, opt, x, y = _gpt_setup(device, args)
        ddp = DistributedDataParallel(model)
        if builtin_hook:
            ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        if dist.get_rank() == 0:
            hook = ddp._get_ddp_logging_data().get("comm_hook") or "none"
            print(f"built with comm hook: {hook}", flush=True)
        return _train_step(ddp, opt, x, y, _lm_loss)

    steps = {"no hook (division in the bucket copy)": build(False),
             "built-in all-reduce hook (copy, then divide)": build(True)}
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__}, world {dist.get_world_size()}, GPT-style amp O2 "
              f"bf16, batch {args.gpt_batch} per GPU, {args.steps} timed steps", flush=True)
    for rnd in range(args.rounds):
        for name, step in steps.items():
            ms = 1e3 * max(_all_ranks(_time_steps(step, device, args.steps, warmup=3), device))
            if dist.get_rank() == 0:
                print(f"round {rnd}: {name}: {ms:.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
