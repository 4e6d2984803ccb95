"""Run groups of checks in several processes over torch.distributed, one spawn per group.

A *check* is a module-level function ``check_x(ctx: DistContext) -> None`` that every rank runs
at the same point and that raises on failure. :func:`run_checks` starts ``world_size``
processes once, runs the given checks in order on every rank, and returns a
:class:`GroupResult` from which each pytest test asserts its own check. A rank that fails a
check records the traceback and stops (its peers then fail fast on the broken collective), so
the checks after it are reported as not run rather than hanging; the whole group also has a
wall-clock deadline.

Processes: ``torch.multiprocessing`` with the spawn start method, rendezvous through a file in
the group's temporary directory (a TCP port found free could be taken by another test process
before the store bound it: EADDRINUSE under pytest-xdist), one intra-op thread each (the CPU
runners have two cores).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import os
import socket
import tempfile
import time
import traceback
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistContext", "GroupResult", "StopWorker", "free_port", "labelled", "run_checks"]


class StopWorker(Exception):
    """Raised by a check (after it passed) when the process group is no longer usable."""


@dataclasses.dataclass
class DistContext:
    rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def labelled(label: str):
    """An ``assert_close(msg=...)`` that prefixes torch's own mismatch report with ``label``."""
    return lambda report: f"{label}: {report}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write(path: str, results: Dict[str, str]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, path)


_T0 = time.perf_counter()


def _worker(rank, world_size, module_name, names, out_dir, backend, device_type,
            shared_device, pg_timeout_s, env=None):
    torch.set_num_threads(1)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.update(env or {})
    path = os.path.join(out_dir, f"rank{rank}.json")
    results: Dict[str, str] = {}
    if device_type == "cuda":
        device = torch.device("cuda", 0 if shared_device else rank)
        torch.cuda.set_device(device)
        # fp32 references must be fp32: no TF32 in convolutions or matmuls.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend, init_method="file://" + os.path.join(out_dir, "rendezvous"), rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    results["seconds:init"] = f"{time.perf_counter() - _T0:.2f}"
    module = importlib.import_module(module_name)
    ctx = DistContext(rank, world_size, device, backend)
    for name in names:
        start = time.perf_counter()
        try:
            getattr(module, name)(ctx)
            results[name] = "ok"
            results["seconds:" + name] = f"{time.perf_counter() - start:.2f}"
        except StopWorker:
            results[name] = "ok"
            _write(path, results)
            os._exit(0)
        except BaseException:  # noqa: B036 - record everything, then stop this rank
            results[name] = traceback.format_exc()
            _write(path, results)
            # Peers may be blocked in a collective this rank will never join: leave without
            # tearing the group down, so they fail fast instead of waiting for a timeout.
            os._exit(1)
        _write(path, results)
    dist.barrier()
    dist.destroy_process_group()


@dataclasses.dataclass
class GroupResult:
    names: List[str]
    per_rank: List[Dict[str, str]]
    launch_error: Optional[str]

    def assert_ok(self, name: str) -> None:
        failures, missing = [], []
        for rank, results in enumerate(self.per_rank):
            status = results.get(name)
            if status is None:
                missing.append(rank)
            elif status != "ok":
                failures.append(f"--- rank {rank} ---\n{status}")
        if failures:
            raise AssertionError(f"check {name} failed:\n" + "\n".join(failures))
        if missing:
            first_bad = next(
                (n for n in self.names for r in self.per_rank if r.get(n, "ok") != "ok"), None
            )
            why = (f"an earlier check ({first_bad}) failed" if first_bad
                   else f"the processes stopped: {self.launch_error}")
            raise AssertionError(f"check {name} did not run on ranks {missing}: {why}")


def run_checks(module_name: str, names: Sequence[str], world_size: int, *,
               backend: str = "gloo", device_type: str = "cpu", shared_device: bool = False,
               deadline_s: Optional[float] = None, pg_timeout_s: float = 60.0,
               env: Optional[Dict[str, str]] = None) -> GroupResult:
    """Run the checks ``names`` of ``module_name`` on ``world_size`` processes; see module doc.

    ``env`` is set in every worker before its process group is created. ``deadline_s`` bounds
    the whole group; by default 150 s or 2 s a check, whichever is more: it is there to end a
    hang, and test_distributed's group of 174 checks took over 150 s without one on a two-core
    machine busy with other jobs.
    """
    names = list(names)
    if deadline_s is None:
        deadline_s = max(150.0, 2.0 * len(names))
    with tempfile.TemporaryDirectory(prefix="mixprec_parallel_") as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, module_name, names, out_dir, backend, device_type,
                  shared_device, pg_timeout_s, env),
            nprocs=world_size, join=False, start_method="spawn",
        )
        launch_error = None
        deadline = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    launch_error = f"deadline of {deadline_s:.0f}s passed"
                    break
        except Exception as err:  # a process failed or died; the files say which check
            launch_error = f"{type(err).__name__}: {err}"
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
        per_rank = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.json")
            per_rank.append(json.load(open(path)) if os.path.exists(path) else {})
    return GroupResult(names, per_rank, launch_error)


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
