"""DistributedDataParallel, Reducer, and amp O2 / LARC under DDP, across processes.

CPU: 2 processes over gloo, one spawn for the whole group of checks (see ``_harness``).
GPU: the same checks over NCCL on 2 GPUs (skipped with "requires 2 GPUs" otherwise).
The reference for gradients is a single process running the concatenated global batch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import functools
import gc
import itertools
import pickle
import re
import subprocess
import sys
import time
import warnings
from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mixprec.parallel import LARC, DistributedDataParallel, Reducer, convert_syncbn_model
from tests._autograd import FailingBackward
from tests.parallel._harness import StopWorker, cuda_count, free_port, labelled, run_checks

PER_RANK = 4


def _tol(ctx):
    # fp32 everywhere; the GPU's matmuls reduce in a different order for the local and the
    # global batch, hence the looser GPU tolerance.
    return dict(rtol=1e-4, atol=1e-5) if ctx.is_cuda else dict(rtol=1e-5, atol=1e-6)


def _mlp(device, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)


def _global_batch(ctx, seed=1, per_rank=PER_RANK):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ctx.world_size * per_rank, 8, generator=g)
    y = torch.randn(ctx.world_size * per_rank, 4, generator=g)
    return x.to(ctx.device), y.to(ctx.device)


def _mine(ctx, t, per_rank=PER_RANK):
    return t[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]


def _groups_of_one(ctx):
    """A process group of each rank alone, indexed by rank. ``new_group`` is collective:
    every rank makes all of them, in the same order."""
    return [dist.new_group([r]) for r in range(ctx.world_size)]


def _gather(ctx, t):
    if ctx.is_cuda and ctx.backend == "gloo":  # (gloo all-gathers host tensors only)
        return [part.to(t.device) for part in _gather(dataclasses.replace(
            ctx, device=torch.device("cpu")), t.cpu())]
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t.contiguous())
    return parts


def _assert_same_on_all_ranks(ctx, tensors, what):
    for i, t in enumerate(tensors):
        for r, other in enumerate(_gather(ctx, t.detach())):
            if not torch.equal(other, t.detach()):
                raise AssertionError(f"{what} #{i} differs between rank {ctx.rank} and rank {r}")


def _reducer_bucket_cap(ddp):
    # What the C++ reducer was built with (PyTorch logs it at construction).
    return int(ddp._get_ddp_logging_data()["bucket_cap_bytes"])


class _Scale(nn.Module):
    """loss = sum(weight * x): the gradient of ``weight`` is exactly ``x``."""

    def __init__(self, n=3, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=dtype))

    def forward(self, x):
        return (self.weight * x).sum()


# ------------------------------------------------------------------------------------------------
# checks (run on every rank)
# ------------------------------------------------------------------------------------------------
def check_grads_match_single_process(ctx):
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, message_size=64)  # several small buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        _grads_match_global_batch(ctx, ddp, model, ref, step, f"step {step}")
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **_tol(ctx))


def _assert_same_grads(ctx, model, ref, what=""):
    """``model``'s gradients are ``ref``'s, parameter by parameter, within ``_tol(ctx)``."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **_tol(ctx), msg=labelled(f"{what} {name}"))


def _grads_match_global_batch(ctx, net, model, ref, seed, what):
    """One backward of ``net`` (wrapping ``model``) on this rank's slice and of ``ref`` on the
    whole batch: ``model``'s gradients must be ``ref``'s."""
    x, y = _global_batch(ctx, seed=seed)
    model.zero_grad()
    ref.zero_grad()
    F.mse_loss(net(_mine(ctx, x)), _mine(ctx, y)).backward()
    F.mse_loss(ref(x), y).backward()
    _assert_same_grads(ctx, model, ref, what)


def check_compiled_grads_match_single_process(ctx):
    # torch.compile of the wrapped model (PyTorch's DDP graph splitting at bucket boundaries),
    # with the built-in C++ hook and with the Python hook (a pre-divide factor that is neither
    # 1 nor the world size), and in the delay mode: gradients of the single-process global
    # batch. On CPU the quick aot_eager backend; on CUDA the real compiler.
    backend = "inductor" if ctx.is_cuda else "aot_eager"
    for factor, delay in ((1.0, False), (4.0, False), (1.0, True)):
        torch._dynamo.reset()
        model = _mlp(ctx.device)
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, message_size=64, gradient_predivide_factor=factor,
                                      delay_allreduce=delay)
        compiled = torch.compile(ddp, backend=backend)
        for step in range(2):
            _grads_match_global_batch(
                ctx, compiled, model, ref, 80 + step,
                f"compiled ({backend}), predivide {factor}, delay {delay}, step {step}")


def check_broadcast_from_rank0_and_state_dict(ctx):
    torch.manual_seed(100 + ctx.rank)  # different weights on every rank
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(ctx.device)
    model[1].running_mean.fill_(ctx.rank + 1.0)
    ddp = DistributedDataParallel(model)
    assert ddp.module is model
    state = ddp.state_dict()
    assert state and all(k.startswith("module.") for k in state), list(state)
    assert set(state) == {"module." + k for k in model.state_dict()}
    for key, value in model.state_dict().items():
        rank0 = _gather(ctx, value)[0]
        assert torch.equal(value, rank0), f"{key} was not broadcast from rank 0"
    assert torch.all(model[1].running_mean == 1.0)


def check_hook_only_where_apex_arithmetic_needs_it(ctx):
    # The plain average needs no communication hook (PyTorch's reducer divides while copying
    # into the buckets); Apex's other settings run the Python hook.
    def hook(ddp):
        return ddp._get_ddp_logging_data().get("comm_hook") or None

    assert hook(DistributedDataParallel(_mlp(ctx.device))) is None
    world = float(ctx.world_size)
    assert hook(DistributedDataParallel(_mlp(ctx.device), gradient_predivide_factor=world)) is None
    # (3.0: no world size of the suite; 4.0 was the world size at 4 ranks.)
    for kwargs in ({"gradient_predivide_factor": 3.0},
                   {"gradient_predivide_factor": 2.0 * world},
                   {"allreduce_always_fp32": True},
                   {"gradient_average": False}, {"prof": True}):
        assert hook(DistributedDataParallel(_mlp(ctx.device), **kwargs)) == "_apex_allreduce_hook", \
            kwargs


def check_pickle_roundtrip(ctx):
    ddp = DistributedDataParallel(_mlp(ctx.device), message_size=1000,
                                  gradient_predivide_factor=2.0)
    copy_ = pickle.loads(pickle.dumps(ddp))
    assert copy_.gradient_predivide_factor == 2.0 and copy_.module is not ddp.module
    # The copy's reducer has the original's buckets (4 bytes per fp32 element), and the copy
    # still compiles (the compiler's cap at least its 1 MiB first bucket).
    assert abs(_reducer_bucket_cap(copy_) - 4000) <= 1, _reducer_bucket_cap(copy_)
    assert copy_.bucket_bytes_cap == dist._DEFAULT_FIRST_BUCKET_BYTES, copy_.bucket_bytes_cap
    ref = copy.deepcopy(copy_.module)
    x, y = _global_batch(ctx, seed=70)
    F.mse_loss(copy_(_mine(ctx, x)), _mine(ctx, y)).backward()
    F.mse_loss(ref(x), y).backward()
    _assert_same_grads(ctx, copy_.module, ref)
    # The delay mode: the copies (pickled, deep-copied) all-reduce after backward, no reducer.
    ddp = DistributedDataParallel(_mlp(ctx.device), delay_allreduce=True, message_size=100)
    for copy_ in (pickle.loads(pickle.dumps(ddp)), copy.deepcopy(ddp)):
        assert copy_.delay_allreduce and copy_.reducer is None and copy_.message_size == 100
        ref = copy.deepcopy(copy_.module)
        F.mse_loss(copy_(_mine(ctx, x)), _mine(ctx, y)).backward()
        F.mse_loss(ref(x), y).backward()
        _assert_same_grads(ctx, copy_.module, ref, "delay copy")


def check_predivide_factor(ctx):
    ws = ctx.world_size
    x = torch.tensor([1.0, 2.0, 3.0], device=ctx.device) * (ctx.rank + 1)  # grad on this rank
    total = torch.tensor([1.0, 2.0, 3.0], device=ctx.device) * (ws * (ws + 1) // 2)  # their sum
    cases = [  # (predivide, average, expected): exactly representable for 2, 4 and 8 ranks
        (1.0, True, total / ws), (4.0, True, total / ws), (2.0, True, total / ws),
        (4.0, False, total / 4), (1.0, False, total),
        # Any factor > 0: one below 1 multiplies before the sum (Apex divided by it whatever
        # it was) and the average still comes out, the division after the sum being by
        # world_size / factor (r53B's C01).
        (0.5, True, total / ws), (0.5, False, total * 2), (0.25, True, total / ws),
    ]
    for (factor, average, expected), delay in itertools.product(cases, (False, True)):
        model = _Scale().to(ctx.device)
        ddp = DistributedDataParallel(model, gradient_predivide_factor=factor,
                                      gradient_average=average, delay_allreduce=delay)
        ddp(x).backward()
        torch.testing.assert_close(
            model.weight.grad, expected, rtol=0, atol=0,
            msg=labelled(f"predivide={factor} average={average} delay={delay}"))


def check_half_gradients_reduced_in_half(ctx):
    # Each rank's fp16 gradient is 40960 (every partial sum of the averaged cases is exact in
    # fp16 on 2, 4 or 8 ranks): their plain sum (81920 on 2 ranks) overflows fp16 (max 65504).
    # An inf therefore proves the all-reduce ran in fp16 (a plain sum: gradient_average=False); the
    # fp32 path and the pre-division (the default averages by pre-dividing by the world size)
    # do not overflow.
    x = torch.full((3,), 40960.0, dtype=torch.float16, device=ctx.device)
    cases = [({"gradient_average": False}, None), ({"allreduce_always_fp32": True}, 40960.0),
             ({"gradient_predivide_factor": float(ctx.world_size)}, 40960.0), ({}, 40960.0)]
    for (kwargs, expected), delay in itertools.product(cases, (False, True)):
        model = _Scale(dtype=torch.float16).to(ctx.device)
        ddp = DistributedDataParallel(model, delay_allreduce=delay, **kwargs)
        ddp(x).backward()
        grad = model.weight.grad
        assert grad.dtype == torch.float16, grad.dtype
        what = f"{kwargs}, delay_allreduce={delay}"
        if expected is None:
            assert torch.isinf(grad).all(), f"{what}: expected an fp16 overflow, got {grad}"
        else:
            torch.testing.assert_close(grad, torch.full_like(grad, expected), rtol=0, atol=0,
                                       msg=labelled(what))


def check_allreduce_always_fp32_averages_half_gradients(ctx):
    # allreduce_always_fp32: half gradients are summed in an fp32 copy, which must be copied
    # back into them. Rank-dependent gradients (each rank's own differs from the average), so
    # a result left in the fp32 copy shows up as this rank's unreduced gradient.
    ws = ctx.world_size
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16, device=ctx.device) * (ctx.rank + 1)
    mean = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16, device=ctx.device) * ((ws + 1) / 2)
    for delay, factor in itertools.product((False, True), (1.0, 2.0)):
        what = f"allreduce_always_fp32, delay_allreduce={delay}, predivide={factor}"
        model = _Scale(dtype=torch.float16).to(ctx.device)
        ddp = DistributedDataParallel(model, allreduce_always_fp32=True, delay_allreduce=delay,
                                      gradient_predivide_factor=factor)
        ddp(x).backward()
        grad = model.weight.grad
        assert grad.dtype == torch.float16, f"{what}: {grad.dtype}"
        # Exact: (1+...+ws)/ws times 1, 2, 3 is representable in fp16 for 2, 4 and 8 ranks.
        torch.testing.assert_close(grad, mean, rtol=0, atol=0, msg=labelled(what))
        # An fp16 MLP against the single-process fp32 global batch: fp16 rounding of the
        # forward, backward and result, hence rtol 1e-2 / atol 1e-3 (the unreduced gradient of
        # one rank's half-batch is off by tens of percent).
        model = _mlp(ctx.device).half()
        ref = copy.deepcopy(model).float()
        ddp = DistributedDataParallel(model, message_size=64, allreduce_always_fp32=True,
                                      delay_allreduce=delay, gradient_predivide_factor=factor)
        xb, yb = _global_batch(ctx, seed=90)
        F.mse_loss(ddp(_mine(ctx, xb).half()).float(), _mine(ctx, yb)).backward()
        F.mse_loss(ref(xb), yb).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad.dtype == torch.float16, f"{what} {name}: {p.grad.dtype}"
            torch.testing.assert_close(p.grad.float(), q.grad, rtol=1e-2, atol=1e-3,
                                       msg=labelled(f"{what} {name}"))


def check_apex_arithmetic_survives_the_first_step_rebuild(ctx):
    # G (r98C's M24). A first step that leaves a head out rebuilds the reducer at the second
    # forward; Apex's arithmetic (gradient_average=False: the sum; a pre-divide factor that
    # is neither 1 nor the world size: the sum over the factor, or the average) lives in a
    # communication hook, which the rebuilt reducer must get again: three steps against one
    # process's sum (or average) of the ranks' losses.
    for kwargs, divide in (({"gradient_average": False}, 1.0),
                           ({"gradient_average": False, "gradient_predivide_factor": 4.0}, 4.0),
                           ({"gradient_predivide_factor": 3.0}, ctx.world_size)):
        torch.manual_seed(0)
        model = _TwoHeads().to(ctx.device)  # (head b never used: left out by the first step)
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, message_size=64, **kwargs)
        for step in range(3):
            x, y = _global_batch(ctx, seed=10 + step)
            model.zero_grad()
            ref.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (rank 0's note on the head left out)
                F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
            sum(F.mse_loss(ref(part), target) for part, target
                in zip(x.split(PER_RANK), y.split(PER_RANK))).backward()
            assert model.b.weight.grad is None
            for name in ("a.weight", "a.bias"):
                torch.testing.assert_close(
                    model.get_parameter(name).grad, ref.get_parameter(name).grad / divide,
                    **_tol(ctx), msg=labelled(f"{kwargs} step {step} {name}"))


class _Float(nn.Module):
    def forward(self, x):
        return x.float()


def check_delay_allreduce_reduces_each_dtype_in_its_own_dtype(ctx):
    # G (r98C's N5). The delay mode all-reduces in buckets of one (device, dtype), as Apex
    # did: a model with fp16 and fp32 gradients all-reduces the fp16 ones in fp16 (never
    # promoted with the fp32 ones: twice the bytes). The calls are recorded; the averages
    # against one process on the global batch (fp32 within _tol; fp16 at its resolution).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8).half(), _Float(), nn.Linear(8, 4)).to(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    x, y = _global_batch(ctx, seed=5)
    seen, real = [], dist.all_reduce

    def recording(tensor, *args, **kwargs):
        seen.append((tensor.dtype, tensor.numel()))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        F.mse_loss(ddp(_mine(ctx, x).half()), _mine(ctx, y)).backward()
    finally:
        dist.all_reduce = real
    half_numel = sum(p.numel() for p in model[0].parameters())
    float_numel = sum(p.numel() for p in model[2].parameters())
    assert (torch.float16, half_numel) in seen, seen
    assert (torch.float32, float_numel) in seen, seen
    assert all(n <= max(half_numel, float_numel) for _, n in seen), seen
    F.mse_loss(ref(x.half()), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == p.dtype, (name, p.grad.dtype)
        tol = _tol(ctx) if p.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(p.grad.float(), q.grad.float(), **tol, msg=labelled(name))


def check_hook_options_all_reduce_over_the_process_group_only(ctx):
    # G (r98C's N26). With process_group=, the options that all-reduce through the
    # communication hook (gradient_average=False, a pre-divide factor other than 1 or the
    # world size, allreduce_always_fp32, prof) reduce over that group only: over groups of
    # one rank each, every rank's gradients are its own slice's (one process on it), in
    # both modes.
    singles = _groups_of_one(ctx)
    x, y = _global_batch(ctx, seed=7)
    for kwargs, delay in itertools.product(
            ({"gradient_average": False}, {"gradient_predivide_factor": 3.0},
             {"allreduce_always_fp32": True}, {"prof": True}), (False, True)):
        model = _mlp(ctx.device)
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, process_group=singles[ctx.rank],
                                      delay_allreduce=delay, **kwargs)
        F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
        F.mse_loss(ref(_mine(ctx, x)), _mine(ctx, y)).backward()
        _assert_same_grads(ctx, model, ref, f"{kwargs} delay={delay}")
    dist.barrier()


def check_buffers_broadcast_at_construction_only(ctx):
    # As Apex: the buffers are rank 0's after wrapping, then each rank's own (PyTorch's default
    # re-broadcasts them from rank 0 before every forward). BatchNorm's running statistics
    # after two training forwards on this rank's slices are those of a local copy run on them.
    for delay in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)).to(ctx.device)
        model[1].running_mean.fill_(ctx.rank + 1.0)  # rank 0's 1.0 after wrapping
        ddp = DistributedDataParallel(model, delay_allreduce=delay)
        assert torch.all(model[1].running_mean == 1.0)
        local = copy.deepcopy(model)
        for step in range(2):
            x, y = _global_batch(ctx, seed=95 + step)
            F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
            local(_mine(ctx, x))
        for name in ("running_mean", "running_var"):
            mine, want = getattr(model[1], name), getattr(local[1], name)
            torch.testing.assert_close(mine, want, rtol=0, atol=0,
                                       msg=labelled(f"delay={delay} {name}"))
            others = _gather(ctx, mine)
            assert not torch.equal(others[0], others[-1]), \
                f"delay={delay} {name}: the ranks' statistics should differ"


class _IgnoredFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.extra = None  # (added after wrapping, in the delay mode)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.extra is not None:
            h = h + self.extra(h)
        return self.b(h)


def check_ignored_parameters_stay_local(ctx):
    # Parameters set to be ignored (_set_params_and_buffers_to_ignore_for_model, as PyTorch's
    # DDP): not broadcast, not all-reduced, in either mode; also a layer under an ignored name
    # added after wrapping (the delay mode follows the module). The others' gradients are the
    # single-process global batch's; the ignored ones' this rank's own slice's.
    for delay, grow in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        model = _IgnoredFirst().to(ctx.device)
        names = ["a.weight", "a.bias"] + (["extra.weight", "extra.bias"] if grow else [])
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
        ddp = DistributedDataParallel(model, delay_allreduce=delay, message_size=64)
        if grow:  # a layer with this rank's own weights, under ignored names
            torch.manual_seed(500 + ctx.rank)
            model.extra = nn.Linear(16, 16).to(ctx.device)
        ref, local = copy.deepcopy(model), copy.deepcopy(model)
        x, y = _global_batch(ctx, seed=97)
        F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
        if grow:
            others = _gather(ctx, model.extra.weight.detach())
            assert not torch.equal(others[0], others[-1]), \
                "an added layer under ignored names was broadcast from rank 0"
        F.mse_loss(local(_mine(ctx, x)), _mine(ctx, y)).backward()
        if not grow:  # (with the rank's own `extra`, the global batch is no reference)
            F.mse_loss(ref(x), y).backward()
        for (name, p), mine, glob in zip(model.named_parameters(), local.parameters(),
                                         ref.parameters()):
            what = f"delay={delay} grow={grow} {name}"
            if name in names:
                torch.testing.assert_close(p.grad, mine.grad, **_tol(ctx), msg=labelled(what))
            elif not grow:
                torch.testing.assert_close(p.grad, glob.grad, **_tol(ctx), msg=labelled(what))
            else:  # all-reduced: the same on every rank, and not this rank's own
                _assert_same_on_all_ranks(ctx, [p.grad], what)
                assert not torch.allclose(p.grad, mine.grad), what


class _WithLabels(nn.Module):
    """An MLP that returns its predicted classes (no gradient) beside its output."""

    def __init__(self, device):
        super().__init__()
        self.net = _mlp(device)

    def forward(self, x):
        out = self.net(x)
        return out, out.argmax(dim=1)


def check_no_sync_accumulation(ctx):
    # Two micro-batches under no_sync(), then a synced one: the single-process gradients of
    # the whole global batch; also for a forward that returns tensors needing no gradient
    # beside its output (predicted classes), as it may outside no_sync().
    for delay, labels in itertools.product((False, True), (False, True)):
        model = _WithLabels(ctx.device) if labels else _mlp(ctx.device)
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, message_size=64, delay_allreduce=delay)
        for micro in range(3):
            x, y = _global_batch(ctx, seed=10 + micro)
            out = ref(x)
            F.mse_loss(out[0] if labels else out, y).backward()
            with ddp.no_sync() if micro < 2 else contextlib.nullcontext():
                out = ddp(_mine(ctx, x))
                if labels:
                    out, predicted = out
                    assert predicted.dtype == torch.int64 and not predicted.requires_grad
                F.mse_loss(out, _mine(ctx, y)).backward()
        _assert_same_grads(ctx, model, ref, f"delay_allreduce={delay}, {labels=}")


class _SimCLRNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.proj = nn.Sequential(nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(),
                                  nn.Linear(8, 4, bias=False), nn.BatchNorm1d(4, affine=False))

    def forward(self, x):
        return self.proj(self.body(x))


def _nt_xent(z1, z2, gather):
    z = torch.cat([gather(F.normalize(z1.float(), dim=1)),
                   gather(F.normalize(z2.float(), dim=1))])
    n = z.shape[0] // 2
    sim = (z @ z.T / 0.5).masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device),
                                      float("-inf"))
    return F.cross_entropy(sim, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(z.device))


def _simclr_groups(model):
    return [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 5e-2},
            {"params": [p for p in model.parameters() if p.ndim == 1], "weight_decay": 0.0}]


def _simclr_run(ctx, opt_level, steps=4, acc=2):
    """SimCLR as written for Apex: convert_syncbn_model, LARC(SGD) with BN/bias excluded from
    weight decay by groups (clip=False; trust 0.02, larger than SimCLR's 0.001, so that 4 steps
    move the weights measurably), a warm-up + cosine LambdaLR on larc.optim, two forwards (the
    two views) per backward, NT-Xent over embeddings gathered with gradients
    (torch.distributed.nn.all_gather), accumulation with no_sync(). opt_level None: the
    single-process float64 reference on the concatenated global batch, with plain BatchNorm and
    LARC's formula written out (Apex's)."""
    import math

    import torch.distributed.nn

    from mixprec import amp

    def lam(s):  # (two warm-up steps, then a cosine)
        return (s + 1) / 2 if s < 2 else 0.5 * (1 + math.cos(math.pi * (s - 2) / (steps - 2)))

    model = _SimCLRNet().to(ctx.device)
    if opt_level is None:
        model = model.double()
        opt = torch.optim.SGD(_simclr_groups(model), lr=1.0, momentum=0.9)
        inner, ddp, gather = opt, model, (lambda z: z)
    else:
        model = convert_syncbn_model(model)
        opt = LARC(torch.optim.SGD(_simclr_groups(model), lr=1.0, momentum=0.9),
                   trust_coefficient=0.02, clip=False)
        model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                    verbosity=0)
        inner, ddp = opt.optim, DistributedDataParallel(model)

        def gather(z):  # (deprecated in favour of functional collectives, which take no grad)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return torch.cat(torch.distributed.nn.all_gather(z))
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lam)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(acc):
            g = torch.Generator().manual_seed(100 * step + micro)
            x1, x2 = (torch.randn(ctx.world_size * PER_RANK, 3, 8, 8, generator=g)
                      .to(ctx.device) for _ in "12")
            if opt_level is None:
                loss = _nt_xent(ddp(x1.double()), ddp(x2.double()), gather) / acc
                loss.backward()
            else:
                x1, x2 = _mine(ctx, x1), _mine(ctx, x2)
                with ddp.no_sync() if micro < acc - 1 else contextlib.nullcontext():
                    loss = _nt_xent(ddp(x1), ddp(x2), gather) / acc
                    with amp.scale_loss(loss, opt) as scaled:
                        scaled.backward()
            total += loss.item()
        if opt_level is None:  # Apex's LARC, clip=False
            with torch.no_grad():
                for group in opt.param_groups:
                    wd = group["weight_decay"]
                    for p in group["params"]:
                        pn, gn = p.norm(), p.grad.norm()
                        if pn != 0 and gn != 0:
                            p.grad.add_(p, alpha=wd).mul_(0.02 * pn / (gn + pn * wd + 1e-8))
            saved = [group["weight_decay"] for group in opt.param_groups]
            for group in opt.param_groups:
                group["weight_decay"] = 0
            opt.step()
            for group, wd in zip(opt.param_groups, saved):
                group["weight_decay"] = wd
        else:
            opt.step()
        sched.step()
        losses.append(total)
    return losses, {k: v.double().cpu() for k, v in model.state_dict().items()}


def check_simclr_recipe_matches_the_single_process_float64_run(ctx):
    # (r91B G1) SimCLR's recipe as run with Apex (see _simclr_run) on two ranks: at O0 it
    # equals the single-process float64 run (LARC, SyncBatchNorm, the gathered NT-Xent, the
    # scheduler on larc.optim, no_sync() accumulation), at bf16 O2 it tracks it.
    ref_losses, ref = _simclr_run(ctx, None)
    losses, got = _simclr_run(ctx, "O0")
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=0, atol=1e-5,
                               msg=labelled("O0 losses"))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5, msg=labelled(f"O0 {k}"))
    # bf16 O2: the same recipe tracks the float64 run within bf16 noise (a few bf16 ulps,
    # 2**-8 each, amplified by LARS's normalised steps; observed ~1% on the loss).
    losses, got = _simclr_run(ctx, "O2")
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=3e-2, atol=0,
                               msg=labelled("O2 bf16 losses"))
    for k in ("body.0.weight", "proj.0.weight", "proj.3.weight"):
        rel = ((got[k] - ref[k]).norm() / ref[k].norm()).item()
        assert rel < 5e-2, (k, rel)


def check_delay_allreduce_no_sync_backward_stays_local_past_an_evaluation(ctx):
    # In the delay mode a forward without grad (an evaluation, a logged metric) between a
    # no_sync() micro-batch's forward and its backward leaves that backward local, as
    # no_sync() promises; the synced micro-batch after it all-reduces the sum: the
    # single-process gradients of both global batches.
    model = _mlp(ctx.device)
    ref, local = copy.deepcopy(model), copy.deepcopy(model)
    ddp = DistributedDataParallel(model, delay_allreduce=True, message_size=64)
    x, y = _global_batch(ctx, seed=760)
    with ddp.no_sync():
        loss = F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y))
    with torch.no_grad():
        ddp(_mine(ctx, x))
    loss.backward()
    F.mse_loss(local(_mine(ctx, x)), _mine(ctx, y)).backward()
    _assert_same_grads(ctx, model, local, "the no_sync() micro-batch")
    F.mse_loss(ref(x), y).backward()
    x, y = _global_batch(ctx, seed=761)
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    F.mse_loss(ref(x), y).backward()
    _assert_same_grads(ctx, model, ref, "after the synced micro-batch")


def check_delay_allreduce(ctx):
    # Apex's delay mode: no PyTorch reducer (the gradients stay autograd's own tensors); after
    # backward, one all-reduce of a flag per parameter, then the gradients in buckets of at
    # most message_size elements (the MLP's 128/16/64/4-element gradients: four buckets of 16).
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, message_size=16, delay_allreduce=True)
    assert ddp.reducer is None
    with _counting_all_reduces() as calls:
        _grads_match_global_batch(ctx, ddp, model, ref, 20, "delay_allreduce step 0")
    # Two flags per parameter (has a gradient, a sparse one), then the 4 buckets.
    assert calls == [8, 128, 16, 64, 4], calls
    _grads_match_global_batch(ctx, ddp, model, ref, 21, "delay_allreduce step 1")
    # Apex's delay mode reduced whatever gradients existed after backward: a parameter that
    # gets none keeps grad=None.
    _unused_head_is_skipped(ctx, seed=50, delay_allreduce=True)
    # What needs PyTorch's reducer is refused with the way out, before any collective.
    for call in (lambda: ddp.join(), lambda: ddp.register_comm_hook(None, _apex_hook)):
        try:
            call()
        except RuntimeError as err:
            assert "delay_allreduce=False" in str(err), str(err)
        else:
            raise AssertionError("join()/register_comm_hook() in the delay mode")


def _apex_hook(state, bucket):  # (never runs: registering it is refused)
    raise AssertionError("ran")


@contextlib.contextmanager
def _counting_all_reduces():
    """The number of elements of each ``dist.all_reduce`` call made inside the block."""
    calls, real = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = real


class _Output:
    """A model-output class that pytree does not know (as in many research codebases)."""

    def __init__(self, logits):
        self.logits = logits


class _Hidden:
    """An output holding its tensor two objects deep (pytree sees none)."""

    def __init__(self, logits):
        self.inner = {"head": _Output(logits)}


def _logits(out):
    if isinstance(out, _Hidden):
        return out.inner["head"].logits
    return out.logits if isinstance(out, _Output) else out


class _Checkpointed(nn.Module):
    """Graphs that PyTorch's reducer cannot follow with find_unused_parameters=True ("Expected
    to mark a variable ready only once"), which Apex's delay mode took: reentrant activation
    checkpointing per block (timm's checkpoint_seq), a block checkpointed twice (shared
    weights), a custom output object, the head's gradients first computed inside a nested
    backward (the callback queued there must wait for the outer one), checkpoints nested two
    deep, a checkpoint on rank 0 only, and a branch some ranks or steps skip."""

    def __init__(self, pattern):
        super().__init__()
        self.pattern = pattern
        self.inp = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.b1 = nn.Linear(8, 8)
        self.b2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def _blocks(self, h):
        return self.head(self.b2(torch.tanh(self.b1(h))))

    def forward(self, x, extra=False):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        if extra:
            h = h + self.extra(h)
        if self.pattern == "plain":
            return self._blocks(h)
        if self.pattern == "reentrant":
            h = checkpoint(self.b1, h, use_reentrant=True)
            h = checkpoint(self.b2, torch.tanh(h), use_reentrant=True)
            return self.head(h)
        if self.pattern == "twice":
            h = checkpoint(self.b1, h, use_reentrant=True)
            h = checkpoint(self.b1, torch.tanh(h), use_reentrant=True)
            return self.head(self.b2(h))
        if self.pattern == "object":
            return _Output(self._blocks(h))
        if self.pattern == "nested":
            return _Hidden(checkpoint(
                lambda z: self.head(checkpoint(self.b2, torch.tanh(self.b1(z)),
                                               use_reentrant=True)), h, use_reentrant=True))
        if self.pattern == "rank0":  # (every rank computes the same; rank 0 recomputes)
            if dist.get_rank() == 0:
                return _Hidden(checkpoint(self._blocks, h, use_reentrant=True))
            return _Hidden(self._blocks(h))
        assert self.pattern == "hidden", self.pattern
        return _Hidden(checkpoint(self._blocks, h, use_reentrant=True))


def _checkpointed_steps(ctx, pattern, steps=3, takes=None, **ddp_kwargs):
    """``steps`` steps of ``_Checkpointed(pattern)`` (in the delay mode unless told) against
    one process running every rank's slice (the extra branch taken as ``takes(step, rank)``
    says; by default by rank 0 only, then by all, then by none): the gradients must match, and
    a parameter no rank used keeps grad=None. Returns the wrapper."""
    torch.manual_seed(0)
    model = _Checkpointed(pattern).to(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, **{"delay_allreduce": True, **ddp_kwargs})
    average = ddp_kwargs.get("gradient_average", True)
    if takes is None:
        def takes(step, rank):
            return (rank == 0, True, False)[step % 3]
    for step in range(steps):
        takes_now = [takes(step, r) for r in range(ctx.world_size)]
        x, y = _global_batch(ctx, seed=300 + step)
        model.zero_grad()
        ref.zero_grad()
        F.mse_loss(_logits(ddp(_mine(ctx, x), extra=takes_now[ctx.rank])),
                   _mine(ctx, y)).backward()
        losses = [F.mse_loss(_logits(ref(x[r * PER_RANK:(r + 1) * PER_RANK],
                                         extra=takes_now[r])),
                             y[r * PER_RANK:(r + 1) * PER_RANK]) for r in range(ctx.world_size)]
        (sum(losses) / (ctx.world_size if average else 1)).backward()
        _assert_same_grads_or_none(ctx, model, ref, f"{pattern} step {step}")
    return ddp


def _backward_matches_the_whole_batch(ctx, ddp, model, ref, x, y, what):
    """Zero both, backpropagate an MSE loss through ``ddp`` on this rank's share of the global
    batch ``(x, y)`` and through ``ref`` on all of it: the gradients agree."""
    model.zero_grad()
    ref.zero_grad()
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    F.mse_loss(ref(x), y).backward()
    _assert_same_grads_or_none(ctx, model, ref, what)


def _assert_same_grads_or_none(ctx, model, ref, what):
    """As ``_assert_same_grads``, where a parameter may have no gradient (in both)."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), (what, name, p.grad, q.grad)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **_tol(ctx),
                                       msg=labelled(f"{what} {name}"))


def check_delay_allreduce_where_the_reducer_cannot(ctx):
    for pattern in ("reentrant", "twice", "object", "hidden", "nested", "rank0"):
        _checkpointed_steps(ctx, pattern)
    # Sums (gradient_average=False): all-reduced exactly once, wherever the first gradient came.
    for pattern in ("reentrant", "nested", "rank0"):
        _checkpointed_steps(ctx, pattern, steps=2, gradient_average=False)


def check_delay_allreduce_old_wrapper_stays_quiet(ctx):
    # A model wrapped again while the old wrapper is still referenced, its last forward's
    # backward never run: only the new wrapper all-reduces (a second sum would double it).
    model = _Scale().to(ctx.device)
    old = DistributedDataParallel(model, delay_allreduce=True, gradient_average=False)
    x = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    old(x)
    new = DistributedDataParallel(model, delay_allreduce=True, gradient_average=False)
    new(x).backward()
    total = float(ctx.world_size * (ctx.world_size + 1) // 2)
    torch.testing.assert_close(model.weight.grad, torch.full_like(model.weight.grad, total),
                               rtol=0, atol=0)
    # And once per forward: a second backward through the same forward is this rank's own
    # (as with PyTorch's reducer).
    model.zero_grad()
    loss = new(x)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(model.weight.grad, torch.full_like(model.weight.grad,
                                                                  total + ctx.rank + 1))
    # Across modes: an armed delay-mode wrapper stays quiet under a default-mode one (its
    # hooks summed the reducer's sum again), ...
    model = _Scale().to(ctx.device)
    old = DistributedDataParallel(model, delay_allreduce=True, gradient_average=False)
    old(x)
    new = DistributedDataParallel(model, gradient_average=False)
    new(x).backward()
    torch.testing.assert_close(model.weight.grad, torch.full_like(model.weight.grad, total),
                               rtol=0, atol=0)
    # ... and a default-mode wrapper's guards on the parameters its first step left out stay
    # off under a delay-mode one (they raised as the head came into use, though the new
    # wrapper all-reduces it).
    torch.manual_seed(0)
    model = _MaybeHead(ctx.device)
    ref = copy.deepcopy(model)
    old = DistributedDataParallel(model)
    for seed in (530, 531):  # (the second builds the reducer without the head)
        _grads_match_global_batch(ctx, old, model, ref, seed, "head unused")
    new = DistributedDataParallel(model, delay_allreduce=True)
    model.use_head = ref.use_head = True
    _grads_match_global_batch(ctx, new, model, ref, 532, "head used, wrapped again")
    # A forward without grad through the old wrapper (an evaluation) between the new one's
    # forward and its backward does not call off that backward's all-reduce.
    x, y = _global_batch(ctx, seed=533)
    model.zero_grad()
    ref.zero_grad()
    out = new(_mine(ctx, x))
    with torch.no_grad():
        old(_mine(ctx, x))
    F.mse_loss(out, _mine(ctx, y)).backward()
    F.mse_loss(ref(x), y).backward()
    _assert_same_grads_or_none(ctx, model, ref, "an evaluation through the old wrapper")
    # An old delay-mode wrapper that trained a step, still referenced: the new wrapper's
    # ordinary steps warn nothing on any rank (the late-gradient warning is for a second
    # backward through one forward of the wrapper that warns). (D23)
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    old = DistributedDataParallel(model, delay_allreduce=True)
    _grads_match_global_batch(ctx, old, model, ref, 785, "the old wrapper's step")
    new = DistributedDataParallel(model, delay_allreduce=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (786, 787):
            _grads_match_global_batch(ctx, new, model, ref, seed, f"the new wrapper, {seed}")
    texts = [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)]
    assert not texts, texts


def check_wrapped_again_after_a_dry_run(ctx):
    # A dry-run forward (grad enabled, no backward) through a default-mode wrapper, then the
    # model wrapped again with the old wrapper still referenced: the new wrapper trains (the
    # old one's PyTorch reducer, left waiting for that backward, took the new gradients and
    # raised "not the expected DDP bucket view"), in either mode, its unused head included;
    # and the old wrapper, run again, averages its gradients once more (PyTorch's own DDP
    # with its defaults trains through both).
    for delay in (False, True):
        torch.manual_seed(0)
        model = _MaybeHead(ctx.device)
        ref = copy.deepcopy(model)
        old = DistributedDataParallel(model)
        x, _ = _global_batch(ctx, seed=534)
        old(_mine(ctx, x))
        new = DistributedDataParallel(model, delay_allreduce=delay)
        model.use_head = ref.use_head = delay  # (unused in the delay mode's first step)
        for seed in (535, 536):
            _grads_match_global_batch(ctx, new, model, ref, seed, f"new wrapper, {delay=}")
        model.use_head = ref.use_head = False
        for seed in (537, 538):
            _grads_match_global_batch(ctx, old, model, ref, seed, f"old wrapper, {delay=}")
        _grads_match_global_batch(ctx, new, model, ref, 539, f"new wrapper again, {delay=}")


def check_no_sync_gradients_after_another_wrappers_forward(ctx):
    # A default-mode wrapper's no_sync() micro-batch reaches a head; another wrapper of the
    # same module (the model wrapped again, this one still referenced) runs a forward with
    # grad and no backward; the first wrapper's synced micro-batch leaves the head out. The
    # head keeps micro-batch 1's gradient, averaged, as one process on the global batches
    # gives it (it was dropped: grad None and "got no gradient on any rank"). A gradient
    # cleared in between (to None, or zeroed in place as another wrapper's step would) is no
    # longer the first wrapper's own: the head, unused from then on, is left out (None), not
    # given a zero.
    for clear in (None, "set_to_none", "in_place"):
        torch.manual_seed(0)
        model = _MaybeHead(ctx.device)
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model)  # (its first step not seen yet)
        model.use_head = ref.use_head = True
        x, y = _global_batch(ctx, seed=790)
        with ddp.no_sync():
            F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
        F.mse_loss(ref(x), y).backward()
        DistributedDataParallel(model, delay_allreduce=True)(_mine(ctx, x))
        if clear is not None:
            model.zero_grad(set_to_none=clear == "set_to_none")
            ref.zero_grad()
        model.use_head = ref.use_head = False
        x, y = _global_batch(ctx, seed=791)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
        F.mse_loss(ref(x), y).backward()
        _assert_same_grads(ctx, model, ref, f"{clear=}")
        left_out = [w for w in caught if "got no gradient on any rank" in str(w.message)]
        assert len(left_out) == (ctx.rank == 0 and clear is not None), (
            clear, [str(w.message) for w in caught])


class _MaybeHead(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.body = _mlp(device)
        self.head = nn.Linear(4, 4).to(device)
        self.use_head = False

    def forward(self, x):
        y = self.body(x)
        return self.head(y) if self.use_head else y


def check_gradient_penalty_through_autograd_grad(ctx):
    # WGAN-GP / R1: torch.autograd.grad through the wrapped model's output (create_graph),
    # then one backward of loss + penalty. autograd.grad accumulates no parameter gradient:
    # it must neither all-reduce nor use up the step's all-reduce.
    for delay in (False, True):
        torch.manual_seed(0)
        model = _mlp(ctx.device)
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, delay_allreduce=delay)
        x, y = _global_batch(ctx, seed=500)

        def loss_of(net, xs, ys):
            xs = xs.clone().requires_grad_(True)
            out = net(xs)
            (g,) = torch.autograd.grad(out.sum(), xs, create_graph=True)
            return F.mse_loss(out, ys) + g.pow(2).mean()

        loss_of(ddp, _mine(ctx, x), _mine(ctx, y)).backward()
        halves = [(x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK])
                  for r in range(ctx.world_size)]
        (sum(loss_of(ref, xs, ys) for xs, ys in halves) / ctx.world_size).backward()
        _assert_same_grads(ctx, model, ref, f"delay={delay}")


def check_delay_allreduce_after_a_backward_that_raised(ctx):
    # A backward that raises after some gradients arrived (an OOM caught to skip the batch):
    # the engine drops the queued callback, and the next steps must still all-reduce.
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    x, _ = _global_batch(ctx, seed=510)
    ddp(_mine(ctx, x))  # (arms the mode; its output is not used)
    h = model[2](FailingBackward.apply(model[1](model[0](_mine(ctx, x)))))
    try:
        h.sum().backward()  # model[2]'s gradients arrive, then the backward raises
    except RuntimeError as err:
        assert "simulated" in str(err), err
    else:
        raise AssertionError("the backward did not raise")
    for step in range(2):
        _grads_match_global_batch(ctx, ddp, model, ref, 511 + step, f"after the failure {step}")


class _FailingMiddle(nn.Module):
    """Two linear layers; with ``fail`` set, the backward raises between them (after the
    second's gradients arrived)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.fail = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(FailingBackward.apply(h) if self.fail else h)


def _error_after_a_failed_backward(ctx, ddp, model, x) -> str:
    """Run a backward of ``ddp`` that raises after the gradients of ``model.b`` arrived, then
    a forward: the text of the error that forward raises."""
    model.fail = True
    try:
        ddp(_mine(ctx, x)).sum().backward()
    except RuntimeError as err:
        assert "simulated" in str(err), err
    else:
        raise AssertionError("the backward did not raise")
    model.fail = False
    try:
        ddp(_mine(ctx, x))
    except RuntimeError as err:
        return str(err)
    raise AssertionError("the forward after a failed backward did not raise")


def check_reducer_after_a_backward_that_raised_says_what_to_do(ctx):
    # PyTorch's reducer cannot finish a step whose backward raised after some gradients
    # arrived: the next forward names the parameters the backward had not reached, and the
    # message says how to skip such batches (the delay mode, checked above, goes on). With
    # find_unused_parameters=True already set, that is not offered as the fix.
    torch.manual_seed(0)
    model = _FailingMiddle().to(ctx.device)
    x, _ = _global_batch(ctx, seed=514)
    ddp = DistributedDataParallel(model)
    ddp(_mine(ctx, x)).sum().backward()  # (a first step: every parameter gets a gradient)
    text = _error_after_a_failed_backward(ctx, ddp, model, x)
    for needle in ("a.weight", "a.bias", "previous backward raised", "delay_allreduce=True"):
        assert needle in text, f"{needle!r} missing from: {text}"
    assert "b.weight" not in text, text
    # (r100A U3) Both causes up front, the raised backward's remedy before the unused
    # parameters' (a user who caught an OOM read "make every parameter contribute" first).
    assert text.index("Two causes: the backward raised") < text.index("make every parameter")
    assert text.index("previous backward raised") < text.index("make every parameter")
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    text = _error_after_a_failed_backward(ctx, ddp, model, x)
    assert "find_unused_parameters=True is set" in text, text
    assert "pass find_unused_parameters=True" not in text, text
    assert "previous backward raised" in text, text


class _CheckpointThenFailing(nn.Module):
    """A reentrant checkpoint whose nested backward brings the first gradients (the callback
    queued there is deferred to a hook on the node after it), and, when ``fail`` is set, a
    branch whose backward raises after the checkpoint's and before that node runs: the
    deferred callback then stays unrun, held by the graph."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = nn.Linear(8, 4)
        self.fail = False

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        side = FailingBackward.apply(h) if self.fail else h  # (made first: its backward runs
        out = checkpoint(self.block, h, use_reentrant=True)  # after the checkpoint's)
        return out + 0 * side.sum()


def check_delay_allreduce_after_a_backward_that_raised_past_a_checkpoint(ctx):
    # A step whose backward raises (an OOM caught to skip the batch) after a checkpoint's
    # nested backward: its callback, deferred to the outer backward, never runs, and the
    # graph that holds it is still referenced (the failed step's loss, kept for logging) when
    # the next steps run. Those must still all-reduce.
    torch.manual_seed(0)
    model = _CheckpointThenFailing().to(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    x, y = _global_batch(ctx, seed=515)
    model.fail = True
    failed = F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y))
    try:
        failed.backward()
    except RuntimeError as err:
        assert "simulated" in str(err), err
    else:
        raise AssertionError("the backward did not raise")
    model.fail = False
    for step in range(2):
        _grads_match_global_batch(ctx, ddp, model, ref, 516 + step,
                                  f"after the failure, its loss kept, step {step}")
    del failed


class _EmbedOnRank0(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.lin = nn.Linear(4, 4)

    def forward(self, idx):
        h = torch.ones(len(idx), 4, device=idx.device)
        if dist.get_rank() == 0:
            h = h + self.emb(idx)
        return self.lin(h)


def check_delay_allreduce_recovers_inside_a_checkpoint(ctx):
    # The whole wrapper under a reentrant checkpoint (its forward, which arms the mode, runs
    # inside the backward) and one backward that raises: the dropped callback must not keep
    # the later steps from all-reducing.
    from torch.utils.checkpoint import checkpoint

    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    for step, fail in enumerate((True, False, False)):
        x, y = _global_batch(ctx, seed=530 + step)
        model.zero_grad()
        ref.zero_grad()

        def run(z, fail=fail):
            h = FailingBackward.apply(z) if fail else z  # (its backward runs last)
            return ddp(z) + 0 * h.sum()

        xs = _mine(ctx, x).clone().requires_grad_(True)
        loss = F.mse_loss(checkpoint(run, xs, use_reentrant=True), _mine(ctx, y))
        if fail:
            try:
                loss.backward()
            except RuntimeError as err:
                assert "simulated" in str(err), err
            else:
                raise AssertionError("the backward did not raise")
            continue
        loss.backward()
        F.mse_loss(ref(x), y).backward()
        _assert_same_grads(ctx, model, ref, f"step {step}")


def check_delay_allreduce_two_wrappers_and_the_python_reducer_setting(ctx):
    # Two live wrappers sharing a tied layer, both used in one loss: each all-reduces its own
    # parameters (the shared one's average twice, which leaves it as it is). And under
    # torch._dynamo.config.optimize_ddp="python_reducer" PyTorch's constructor adds all-reduce
    # hooks of its own, which must go: a second all-reduce per gradient (a collective
    # mismatch with a branch some ranks skip).
    torch.manual_seed(0)
    tied = nn.Linear(8, 8)
    enc = nn.Sequential(tied, nn.Linear(8, 8)).to(ctx.device)
    dec = nn.Sequential(nn.Linear(8, 8), tied).to(ctx.device)
    ref_enc = copy.deepcopy(enc)
    ref_dec = nn.Sequential(copy.deepcopy(dec[0]), ref_enc[0])
    a = DistributedDataParallel(enc, delay_allreduce=True)
    b = DistributedDataParallel(dec, delay_allreduce=True)
    x, _ = _global_batch(ctx, seed=540)
    (a(_mine(ctx, x)).pow(2).mean() + b(_mine(ctx, x)).pow(2).mean()).backward()
    halves = [x[r * PER_RANK:(r + 1) * PER_RANK] for r in range(ctx.world_size)]
    (sum(ref_enc(h).pow(2).mean() + ref_dec(h).pow(2).mean() for h in halves)
     / ctx.world_size).backward()
    for mine, ref in ((enc, ref_enc), (dec, ref_dec)):
        _assert_same_grads(ctx, mine, ref)
    import torch._dynamo as dynamo

    before = dynamo.config.optimize_ddp
    dynamo.config.optimize_ddp = "python_reducer"
    try:
        model = _Scale().to(ctx.device)
        ddp = DistributedDataParallel(model, delay_allreduce=True, gradient_average=False)
    finally:
        dynamo.config.optimize_ddp = before
    assert len(model.weight._post_accumulate_grad_hooks) == 1  # the delay mode's own
    ddp(torch.full((3,), float(ctx.rank + 1), device=ctx.device)).backward()
    total = float(ctx.world_size * (ctx.world_size + 1) // 2)
    torch.testing.assert_close(model.weight.grad, torch.full_like(model.weight.grad, total),
                               rtol=0, atol=0)


def check_delay_allreduce_refuses_sparse_gradients_on_every_rank(ctx):
    # A sparse gradient on rank 0 only: every rank raises (none waits in a collective alone).
    ddp = DistributedDataParallel(_EmbedOnRank0().to(ctx.device), delay_allreduce=True)
    try:
        ddp(torch.arange(3, device=ctx.device)).sum().backward()
    except RuntimeError as err:
        assert "emb.weight got a sparse gradient" in str(err), str(err)
    else:
        raise AssertionError("a sparse gradient was not refused")
    dist.barrier()  # (both ranks got here: the group is still in step)


class _GrowsAnEmbedding(nn.Module):
    """A linear layer, and the layers appended to ``extra`` after wrapping, each given the
    indices."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.extra = nn.ModuleList()

    def forward(self, idx):
        h = self.a(torch.ones(idx.numel(), 3, device=idx.device))
        for layer in self.extra:
            h = h + layer(idx)
        return h


def check_delay_allreduce_sparse_error_names_a_layer_added_later(ctx):
    # The delay mode follows the module's parameters as they are at each forward, their
    # names too: a sparse embedding added after wrapping is refused, on every rank, under its
    # own name (the name the user looks for), not one from the list the wrapper was built
    # with. Reference: the parameter's name in model.named_parameters().
    # (D12)
    torch.manual_seed(0)
    model = _GrowsAnEmbedding().to(ctx.device)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    idx = torch.arange(3, device=ctx.device)
    ddp(idx).sum().backward()  # (a first step over the linear layer alone)
    model.extra.append(nn.Embedding(5, 3, sparse=True).to(ctx.device))
    try:
        ddp(idx).sum().backward()
    except RuntimeError as err:
        assert "extra.0.weight got a sparse gradient" in str(err), str(err)
    else:
        raise AssertionError("a sparse gradient of a layer added later was not refused")
    dist.barrier()  # (both ranks got here: the group is still in step)


def check_amp_two_losses_under_the_reducers_bucket_views(ctx):
    # Two scale_loss backwards in one step (num_losses=2), amp O1 with a dynamic scale: amp
    # sets the first backward's gradients aside while the second runs. Under PyTorch's
    # reducer they are views of its buckets, which the second backward wrote into (the sum
    # came out 0.45 instead of 0.33 in norm). Both modes against one process.
    from mixprec import amp

    for delay in (False, True):
        torch.manual_seed(0)
        model = _mlp(ctx.device)
        ref = copy.deepcopy(model)
        opts = []
        for net in (model, ref):
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            amp.initialize(net, opt, opt_level="O1", dtype=torch.bfloat16, num_losses=2,
                           loss_scale="dynamic", verbosity=0)
            opts.append(opt)
        ddp = DistributedDataParallel(model, delay_allreduce=delay)
        x, y = _global_batch(ctx, seed=520)
        for net, opt, xs, ys in ((ddp, opts[0], _mine(ctx, x), _mine(ctx, y)),
                                 (ref, opts[1], x, y)):
            opt.zero_grad()
            with amp.scale_loss(F.mse_loss(net(xs).float(), ys), opt, loss_id=0) as scaled:
                scaled.backward()
            with amp.scale_loss(net(xs).float().abs().mean(), opt, loss_id=1) as scaled:
                scaled.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3,
                                       msg=labelled(f"delay={delay} {name}"))


def _BUCKET_ORDER_ATOL(ctx, atol):
    """``atol`` on 2 ranks; on more, room for half gradients summed in another order (gloo's
    sum of a bf16 element over 4 ranks depends on where the bucket puts it, and two wrappers
    bucket differently: a bf16 rounding of the gradient, times the learning rate)."""
    return atol if ctx.world_size <= 2 else max(atol, 1e-3)


def _same_after_resume(ctx, got, want, what):
    """Bit for bit on 2 ranks. On more, to the rounding of half gradients summed in another
    order (see :func:`_BUCKET_ORDER_ATOL`): a wrapper built at the resume takes its first step
    with a fresh bucket layout, where the uninterrupted one had rebuilt its own."""
    if ctx.world_size <= 2:
        assert torch.equal(got, want), what
    else:
        torch.testing.assert_close(got, want, rtol=1e-2, atol=_BUCKET_ORDER_ATOL(ctx, 0.0),
                                   msg=lambda report: f"{what}: {report}")


def _assert_resumed_run_matches(ctx, ddp, opt, resumed, resumed_opt):
    """The resumed wrapper's parameters and buffers, its optimizer's masters and amp state
    equal the uninterrupted run's (``_same_after_resume``)."""
    from mixprec import amp

    got = dict(resumed.module.named_parameters()) | dict(resumed.module.named_buffers())
    for name, want in [*ddp.module.named_parameters(), *ddp.module.named_buffers()]:
        _same_after_resume(ctx, got[name], want, f"rank {ctx.rank}: {name}")
    for i, (m, r) in enumerate(zip(amp.master_params(opt), amp.master_params(resumed_opt))):
        _same_after_resume(ctx, m, r, f"rank {ctx.rank}: master {i}")
    assert amp.state_dict(optimizer=resumed_opt) == amp.state_dict(optimizer=opt)


def check_delay_allreduce_amp_o2_with_checkpointing(ctx):
    # amp O2 (bf16 model, fp32 masters) under the delay mode with reentrant checkpointing:
    # the same training as the default mode on the same model without checkpointing.
    from mixprec import amp

    torch.manual_seed(0)
    model = _Checkpointed("reentrant").to(ctx.device)
    plain = _Checkpointed("plain").to(ctx.device)
    plain.load_state_dict(model.state_dict())
    model, opt, plain, plain_opt = _amp_o2_sgd_pair(model, plain)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    plain_ddp = DistributedDataParallel(plain, find_unused_parameters=True)  # (`extra`)
    for step in range(3):
        x, y = _global_batch(ctx, seed=400 + step)
        _amp_step_mse(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)
        _amp_step_mse(plain_ddp, plain_opt, _mine(ctx, x), _mine(ctx, y), amp)
    masters = list(amp.master_params(opt))
    _assert_same_on_all_ranks(ctx, masters, "fp32 master weight")
    for m, r in zip(masters, amp.master_params(plain_opt)):
        torch.testing.assert_close(m, r, rtol=0, atol=_BUCKET_ORDER_ATOL(ctx, 1e-6))


def check_disable_and_enable_allreduce(ctx):
    for delay in (False, True):
        _disable_and_enable_allreduce(ctx, delay)


def _disable_and_enable_allreduce(ctx, delay):
    # Apex's switches: two local micro-batches accumulate, the third all-reduces the sum.
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, message_size=64, delay_allreduce=delay)
    local = copy.deepcopy(model)  # this rank's batches alone: what disabled steps must give
    for micro in range(3):
        x, y = _global_batch(ctx, seed=60 + micro)
        F.mse_loss(ref(x), y).backward()
        if micro < 2:
            ddp.disable_allreduce()
        else:
            ddp.enable_allreduce()
        F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
        if micro < 2:
            # Not all-reduced: the rank's own (accumulated) gradient, different on each rank.
            F.mse_loss(local(_mine(ctx, x)), _mine(ctx, y)).backward()
            _assert_same_grads(ctx, model, local)
    _assert_same_grads(ctx, model, ref)
    if delay:
        _apex_switch_timing(ctx)
        return
    # Apex's timing (the switch flipped after the forward) cannot reach a backward whose
    # forward ran with the all-reduce off: that is an error, not a silently local gradient.
    # A forward without grad in between (a validation pass inside the window) has no
    # backward and changes nothing about the one still to come (r71C's C20).
    ddp.disable_allreduce()
    loss = F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y))
    with torch.no_grad():
        ddp(_mine(ctx, x))
    try:
        ddp.enable_allreduce()
    except RuntimeError as err:
        assert "before the forward" in str(err) and "delay_allreduce=True" in str(err), err
    else:
        raise AssertionError("enable_allreduce() between a local forward and its backward")
    assert not ddp.require_backward_grad_sync
    loss.backward()
    ddp.enable_allreduce()  # after the backward: fine
    with ddp.no_sync():
        loss = F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y))
    ok = False
    try:
        ddp.enable_allreduce()
    except RuntimeError:
        ok = True
    assert ok, "no_sync()'s forward is pending its backward too"
    loss.backward()
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()  # synced; nothing pending
    ddp.enable_allreduce()
    # A micro-batch skipped after its forward (its output dropped, no backward) leaves nothing
    # pending; the wrapper still pickles in between.
    ddp.disable_allreduce()
    loss = F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y))
    pickle.dumps(ddp)
    del loss
    ddp.enable_allreduce()


def _apex_switch_timing(ctx):
    # The delay mode reads Apex's switch when the backward ends, as Apex did (scripts flip it
    # between the forward and loss.backward()): a forward run with it off and a backward after
    # enable_allreduce() all-reduces; a synced forward and a backward after
    # disable_allreduce() does not.
    model = _mlp(ctx.device)
    ref, local = copy.deepcopy(model), copy.deepcopy(model)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    x, y = _global_batch(ctx, seed=66)
    ddp.disable_allreduce()
    loss = F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y))
    ddp.enable_allreduce()
    loss.backward()
    F.mse_loss(ref(x), y).backward()
    _assert_same_grads(ctx, model, ref, "enabled late")
    model.zero_grad()
    loss = F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y))
    ddp.disable_allreduce()
    loss.backward()
    F.mse_loss(local(_mine(ctx, x)), _mine(ctx, y)).backward()
    _assert_same_grads(ctx, model, local, "disabled late")
    ddp.enable_allreduce()
    # A backward run with the switch off leaves the forward's all-reduce to the next one: two
    # backwards through one forward (retain_graph), the first local, the second all-reduces
    # the accumulated sum.
    model.zero_grad()
    ref.zero_grad()
    loss = F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y))
    ddp.disable_allreduce()
    loss.backward(retain_graph=True)
    ddp.enable_allreduce()
    loss.backward()
    (2 * F.mse_loss(ref(x), y)).backward()
    _assert_same_grads(ctx, model, ref, "off, then on")


def check_delay_allreduce_amp_o2_apex_switch_timing(ctx):
    # A BERT-style accumulation loop at amp O2, the switch flipped between each forward and
    # its backward: the local micro-batch stays scaled in the half gradients, the last one's
    # backward all-reduces the sum, and the step is the one-process step on the global batch.
    from mixprec import amp

    model = _mlp(ctx.device)
    model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model))
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):
            x, y = _global_batch(ctx, seed=600 + 2 * step + micro)
            loss = F.mse_loss(ddp(_mine(ctx, x)).float(), _mine(ctx, y)) / 2
            if micro == 0:
                ddp.disable_allreduce()
            else:
                ddp.enable_allreduce()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            with amp.scale_loss(F.mse_loss(ref(x).float(), y) / 2, ref_opt) as scaled:
                scaled.backward()
        opt.step()
        ref_opt.step()
    _assert_masters_match_reference(ctx, opt, ref_opt)


def check_delay_allreduce_warns_on_a_second_backward(ctx):
    # SRGAN's step: the discriminator's loss backward (retain_graph) also reaches the
    # generator and spends its all-reduce; the generator's own backward then stays local.
    # Rank 0 warns, once.
    model = _Scale().to(ctx.device)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    x = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    for step in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = ddp(x)
            out.backward(retain_graph=True)
            out.backward()
        late = [w for w in caught if "after its forward's backward" in str(w.message)]
        expected = 1 if ctx.rank == 0 and step == 0 else 0
        assert len(late) == expected, [str(w.message) for w in late]


def check_default_mode_warns_on_a_second_backward_through_one_forward(ctx):
    # Apex's several losses (num_losses=2: one forward, a scale_loss block and a backward per
    # loss) under the default mode: PyTorch's reducer all-reduces the first backward of a
    # forward only, so the second's gradients stay this rank's own and the replicas drift
    # apart. Rank 0 warns once, naming the delay mode's switches; a gradient penalty
    # (torch.autograd.grad of the input through the same outputs) and a forward per loss are
    # no second backward. The recipe the warning names gives every rank the average of both
    # losses' gradients over the ranks, as one process computes it.
    torch.manual_seed(0)
    model = _HeadPair().to(ctx.device)
    ref = copy.deepcopy(model)
    x, _ = _global_batch(ctx, seed=710)
    mine = _mine(ctx, x).clone().requires_grad_(True)

    def losses(out_a, out_b):
        # (Each reaches every parameter, as the reducer's mode needs of every backward.)
        return (out_a.square().mean() + out_b.square().mean(),
                out_a.abs().mean() + 2 * out_b.abs().mean())

    def said(run):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        return [str(w.message) for w in caught if "second backward" in str(w.message)]

    ddp = DistributedDataParallel(model)

    def penalty_then_one_backward():
        out_a, out_b = ddp(mine)
        (g,) = torch.autograd.grad(out_a.sum(), mine, create_graph=True, retain_graph=True)
        (sum(losses(out_a, out_b)) + g.square().mean()).backward()

    def a_forward_per_loss():
        for i in range(2):
            losses(*ddp(mine))[i].backward()

    def two_backwards():
        first, second = losses(*ddp(mine))
        first.backward(retain_graph=True)
        second.backward()

    for run in (penalty_then_one_backward, a_forward_per_loss):
        assert said(run) == [], run.__name__
    for step in range(2):
        warned = said(two_backwards)
        assert len(warned) == (1 if ctx.rank == 0 and step == 0 else 0), warned
        if warned:
            assert "delay_allreduce=True and call disable_allreduce() before each " \
                "backward but the last" in warned[0]
    # The recipe: every rank ends with the average over the ranks of both losses' gradients.
    model.zero_grad()
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    first, second = losses(*ddp(mine))
    ddp.disable_allreduce()
    first.backward(retain_graph=True)
    ddp.enable_allreduce()
    assert said(second.backward) == []
    ref.load_state_dict(model.state_dict())
    for r in range(ctx.world_size):
        sum(losses(*ref(x[r * PER_RANK:(r + 1) * PER_RANK]))).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad / ctx.world_size, rtol=1e-5, atol=1e-6,
                                   msg=labelled(f"delay mode with the switches: {name}"))
    # (A head the first loss missed, left out in the first step, and the second loss's
    # gradient for it: check_left_out_guard_names_a_second_backward_after_the_warning.)


class _WithLogVar(nn.Module):
    """A prediction and a learnable log-variance returned as it is (the weight of an
    uncertainty-weighted loss): one of the outputs is a parameter, a leaf."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 4)
        self.log_var = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.net(x), self.log_var


def check_default_mode_steps_quietly_with_a_parameter_among_the_outputs(ctx):
    """A model that returns one of its parameters as it is (a learnable log-variance) trains
    with one backward per forward, step after step: that is no second backward, so nothing
    warns at any step (the second-backward watch must not leave a hook on the parameter,
    which every later step would run again), and the gradients are the global batch's,
    as one process computes them. (C04)"""
    torch.manual_seed(0)
    model = _WithLogVar().to(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)

    def loss_of(pred, log_var, y):
        return F.mse_loss(pred, y) * torch.exp(-log_var) + log_var

    for step in range(3):
        x, y = _global_batch(ctx, seed=720 + step)
        model.zero_grad()
        ref.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss_of(*ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
        warned = [str(w.message) for w in caught if "second backward" in str(w.message)]
        assert warned == [], (step, warned)
        loss_of(*ref(x), y).backward()
        _assert_same_grads(ctx, model, ref, f"step {step}")


def check_several_losses_inside_no_sync_accumulate_quietly(ctx):
    """Two losses through one forward inside no_sync() or disable_allreduce() (accumulation
    micro-batches of a several-loss script) only add to the local gradients, which the synced
    backward after them all-reduces whole: nothing is lost, so nothing warns about a second
    backward, and the gradients are the average over the ranks of every loss of every
    micro-batch, as one process computes it. (C06)"""
    torch.manual_seed(0)
    model = _HeadPair().to(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)

    def losses(out_a, out_b):
        return (out_a.square().mean() + out_b.square().mean(),
                out_a.abs().mean() + 2 * out_b.abs().mean())

    batches = [_global_batch(ctx, seed=730 + micro)[0] for micro in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ddp.no_sync():
            first, second = losses(*ddp(_mine(ctx, batches[0])))
            first.backward(retain_graph=True)
            second.backward()
        ddp.disable_allreduce()
        first, second = losses(*ddp(_mine(ctx, batches[1])))
        first.backward(retain_graph=True)
        second.backward()
        ddp.enable_allreduce()
        sum(losses(*ddp(_mine(ctx, batches[2])))).backward()
    warned = [str(w.message) for w in caught if "second backward" in str(w.message)]
    assert warned == [], warned
    for x in batches:
        for r in range(ctx.world_size):
            sum(losses(*ref(x[r * PER_RANK:(r + 1) * PER_RANK]))).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad / ctx.world_size, **_tol(ctx),
                                   msg=labelled(f"rank {ctx.rank}: {name}"))


def check_second_backward_warned_after_a_step_with_the_model_frozen(ctx):
    """A GAN's discriminator, wrapped alone, is frozen in the generator's step (whose loss
    runs back through it to the generator's output) and trains in its own: two backwards
    through one of its forwards in its own step are this rank's own gradients as for a model
    never frozen, so rank 0 warns about them as it does there; a generator's step run first
    must not decide for good that no backward reaches the parameters. The single backward of
    the discriminator's step is the global batch's. (bug r71C-1)"""
    torch.manual_seed(0)
    disc = nn.Linear(8, 1).to(ctx.device)
    ref = copy.deepcopy(disc)
    ddp = DistributedDataParallel(disc)
    x, _ = _global_batch(ctx, seed=740)
    fake = _mine(ctx, x).clone().requires_grad_(True)  # (the generator's output)
    disc.requires_grad_(False)
    ddp(fake).mean().backward()  # the generator's step: into the generator only
    assert fake.grad is not None and all(p.grad is None for p in disc.parameters())
    disc.requires_grad_(True)
    ddp(_mine(ctx, x)).square().mean().backward()  # the discriminator's step
    ref(x).square().mean().backward()
    _assert_same_grads(ctx, disc, ref, "discriminator's step")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ddp(_mine(ctx, x))
        out.mean().backward(retain_graph=True)
        out.square().mean().backward()
    warned = [str(w.message) for w in caught if "second backward" in str(w.message)]
    assert len(warned) == (1 if ctx.rank == 0 else 0), warned


def _raised(call) -> str:
    """The message of the RuntimeError ``call()`` raises, or "nothing raised"."""
    try:
        call()
    except RuntimeError as err:
        return str(err)
    return "nothing raised"


def check_left_out_guard_names_a_second_backward_after_the_warning(ctx):
    """The left-out guard's message says "second backward" (and the ways out of several
    losses, not find_unused_parameters=True, which fails there) whenever the gradient comes
    in a second backward through one forward, also after the once-per-wrapper warning about
    second backwards was given in an earlier step: a script with several losses gets that
    warning at its first second backward and this error at a later one. (C12)"""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_HeadPair().to(ctx.device))
    x, _ = _global_batch(ctx, seed=750)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The first step: head b gets no gradient (left out); a second loss through head a
        # is a second backward (warned on rank 0, nothing left out reached).
        out_a, out_b = ddp(_mine(ctx, x))
        out_a.sum().backward(retain_graph=True)
        out_a.square().sum().backward()
        warned = [str(w.message) for w in caught if "second backward" in str(w.message)]
        assert len(warned) == (1 if ctx.rank == 0 else 0), warned
        # A later step: the second loss reaches head b.
        out_a, out_b = ddp(_mine(ctx, x))
        out_a.sum().backward(retain_graph=True)
        message = _raised(out_b.sum().backward)
    assert re.match(r"DistributedDataParallel: b\.(weight|bias) got a gradient in a second "
                    r"backward through the outputs of one forward", message), message
    assert "delay_allreduce=True and call disable_allreduce()" in message, message


def check_left_out_guard_keeps_its_plain_message_after_a_second_backward(ctx):
    """The left-out guard names a second backward only for the backward that is one: after a
    second backward in an earlier step, a parameter left out by the first step that gets a
    gradient in a later step's only backward (a head added to the loss) is refused with the
    plain message, which points at find_unused_parameters=True and wrapping again, not at
    summing several losses. (C16)"""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_HeadPair().to(ctx.device))
    x, _ = _global_batch(ctx, seed=760)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the left-out and the second-backward warnings)
        out_a, out_b = ddp(_mine(ctx, x))
        out_a.sum().backward(retain_graph=True)  # the first step: head b left out
        out_a.square().sum().backward()  # a second backward, through head a only
        out_a, out_b = ddp(_mine(ctx, x))
        # (One backward, now through head b too.)
        message = _raised((out_a.sum() + out_b.sum()).backward)
    assert re.match(r"DistributedDataParallel: b\.(weight|bias) got a gradient, but it got "
                    r"none on any rank in the first step", message), message
    assert "find_unused_parameters=True" in message and "second backward" not in message, \
        message


def check_enable_allreduce_after_a_synced_forward_past_a_kept_local_output(ctx):
    """Only the latest forward's backward can be pending: after a no_sync() forward whose
    output is kept without a backward (a skipped micro-batch still referenced, e.g. logged)
    and a synced forward and backward after it, disable_allreduce() then enable_allreduce()
    (the next accumulation window) is taken, and the window's gradients are the rank's own,
    then the global batch's. (C19)"""
    model = _mlp(ctx.device)
    ref, local = copy.deepcopy(model), copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    x, y = _global_batch(ctx, seed=780)
    with ddp.no_sync():
        kept = ddp(_mine(ctx, x))  # skipped: no backward, the output kept
    model.zero_grad()
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    F.mse_loss(ref(x), y).backward()
    _assert_same_grads(ctx, model, ref, "synced step")
    model.zero_grad()
    ddp.disable_allreduce()
    ddp.enable_allreduce()  # (nothing pending: the latest forward was synced and ran back)
    assert ddp.require_backward_grad_sync
    ddp.disable_allreduce()
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    F.mse_loss(local(_mine(ctx, x)), _mine(ctx, y)).backward()
    _assert_same_grads(ctx, model, local, "local micro-batch")
    ddp.enable_allreduce()
    del kept


def check_wrapper_used_again_after_another_guards_what_it_left_out(ctx):
    """A wrapper whose module another wrapper ran since (a dry run through a second wrapper,
    or two wrappers of one model alternated) takes the module back at its next forward with
    grad: the parameters its first step left out are guarded again, so one that gets a
    gradient then is refused (it would stay this rank's own), as before the other wrapper
    ran. (C24)"""
    torch.manual_seed(0)
    model = _HeadPair().to(ctx.device)
    first = DistributedDataParallel(model)
    x, _ = _global_batch(ctx, seed=790)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the left-out warning)
        out_a, _ = first(_mine(ctx, x))
        out_a.sum().backward()  # the first step: head b left out
        other = DistributedDataParallel(model)
        other(_mine(ctx, x))  # another wrapper's forward (a dry run)
        out_a, out_b = first(_mine(ctx, x))  # the first wrapper again
        try:
            (out_a.sum() + out_b.sum()).backward()
        except RuntimeError as err:
            message = str(err)
        else:
            message = "nothing raised"
    assert re.match(r"DistributedDataParallel: b\.(weight|bias) got a gradient, but it got "
                    r"none on any rank in the first step", message), message
    del other


def check_module_without_trainable_parameters_passes_through(ctx):
    # A frozen perceptual-loss network wrapped as Apex scripts do (PyTorch's DDP refuses it:
    # "not needed"): broadcast from rank 0, then its forward as it is, gradients flowing
    # through it to the input.
    for delay in (False, True):
        torch.manual_seed(ctx.rank)  # different weights on every rank
        frozen = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(ctx.device)
        frozen.requires_grad_(False)
        frozen[1].running_mean.fill_(ctx.rank + 1.0)
        frozen[1].running_var.fill_(ctx.rank + 1.0)  # set to be ignored: stays this rank's
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            frozen, ["1.running_var"])
        ddp = DistributedDataParallel(frozen, delay_allreduce=delay)
        assert isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp.module is frozen
        assert set(ddp.state_dict()) == {"module." + k for k in frozen.state_dict()}
        _assert_same_on_all_ranks(
            ctx, [v for k, v in frozen.state_dict().items() if k != "1.running_var"],
            "frozen state")
        assert torch.all(frozen[1].running_mean == 1.0)
        assert torch.all(frozen[1].running_var == ctx.rank + 1.0)
        x = torch.randn(4, 8, device=ctx.device, requires_grad=True)
        out = ddp(x)
        torch.testing.assert_close(out, frozen(x), rtol=0, atol=0)
        out.sum().backward()
        assert x.grad is not None and all(p.grad is None for p in frozen.parameters())
        copy_ = pickle.loads(pickle.dumps(ddp))
        torch.testing.assert_close(copy_(x), frozen(x), rtol=0, atol=0)
        try:
            ddp.join()
        except RuntimeError as err:
            assert "without trainable parameters" in str(err), str(err)
        else:
            raise AssertionError("join() on a pass-through wrapper")


def check_message_size_sets_bucket_bytes(ctx):
    # (A float, 1e3 as a config gives it, is the same count of elements: r64A's A01.)
    for size in (1000, 1e3):
        ddp = DistributedDataParallel(_mlp(ctx.device), message_size=size)
        assert abs(_reducer_bucket_cap(ddp) - 4000) <= 1, (size, _reducer_bucket_cap(ddp))
    # The value torch.compile splits graphs by: at least its 1 MiB first bucket.
    assert ddp.bucket_bytes_cap == dist._DEFAULT_FIRST_BUCKET_BYTES, ddp.bucket_bytes_cap
    half = _mlp(ctx.device).to(torch.bfloat16)
    ddp = DistributedDataParallel(half, message_size=1000)
    assert abs(_reducer_bucket_cap(ddp) - 2000) <= 1, _reducer_bucket_cap(ddp)
    ddp = DistributedDataParallel(_mlp(ctx.device), message_size=10**6)
    assert abs(_reducer_bucket_cap(ddp) - 4 * 10**6) <= 1, _reducer_bucket_cap(ddp)
    assert abs(ddp.bucket_bytes_cap - 4 * 10**6) <= 1, ddp.bucket_bytes_cap


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)  # used while use_b is set
        self.use_b = False

    def forward(self, x):
        return self.a(x) + self.b(x) if self.use_b else self.a(x)


def _unused_parameters_error(ctx, ddp, stop_using) -> str:
    """A first step using every parameter (``use_b`` set), one after ``stop_using()``, then
    the next forward's error (the unused parameters')."""
    x, _ = _global_batch(ctx)
    ddp.module.use_b = True
    ddp(_mine(ctx, x)).sum().backward()
    ddp.module.use_b = False
    stop_using()
    ddp(_mine(ctx, x)).sum().backward()
    try:
        ddp(_mine(ctx, x))
    except RuntimeError as err:
        return str(err)
    raise AssertionError("expected a RuntimeError naming the unused parameters")


def check_unused_parameters_named_in_error(ctx):
    # Used in the first step, unused in the second: the reducer waits for them.
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_TwoHeads().to(ctx.device))
    text = _unused_parameters_error(ctx, ddp, lambda: None)
    for needle in ("b.weight", "b.bias", "find_unused_parameters=True", "these had one then"):
        assert needle in text, f"{needle!r} missing from: {text}"
    assert "a.weight" not in text, text


class _FrozenLater(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)  # used while use_b is set
        self.c = nn.Linear(8, 4)
        self.use_b = False

    def forward(self, x):
        h = self.a(x)
        return self.c(h) + self.b(h) if self.use_b else self.c(h)


def check_unused_parameters_named_as_the_reducer_was_built(ctx):
    # `a` frozen after the first step, `b` unused from then on: the forward refuses the
    # freeze, naming a's parameters by the list the reducer was built with (it named b's as
    # a's before), not b's or c's.
    torch.manual_seed(0)
    model = _FrozenLater().to(ctx.device)
    ddp = DistributedDataParallel(model)
    x, _ = _global_batch(ctx)
    model.use_b = True
    ddp(_mine(ctx, x)).sum().backward()
    model.use_b = False
    model.a.requires_grad_(False)
    try:
        ddp(_mine(ctx, x))
    except RuntimeError as err:
        text = str(err)
    else:
        raise AssertionError("expected a RuntimeError naming the frozen parameters")
    assert "a.weight, a.bias were frozen" in text and "since the all-reduce" in text, text
    assert "b.weight" not in text and "c.weight" not in text, text


def check_unfrozen_after_wrapping_is_refused(ctx):
    # Progressive fine-tuning: a layer frozen at wrapping is not in PyTorch's reducer;
    # unfrozen later, its gradients stayed this rank's own and the replicas drifted apart
    # silently. (The delay mode follows it: check_delay_allreduce_follows_the_module.)
    model = _mlp(ctx.device)
    model[0].requires_grad_(False)
    ddp = DistributedDataParallel(model)
    x, _ = _global_batch(ctx)
    ddp(_mine(ctx, x)).sum().backward()
    with torch.no_grad():
        ddp(_mine(ctx, x))  # (no backward: nothing to refuse)
    model[0].requires_grad_(True)
    try:
        ddp(_mine(ctx, x))
    except RuntimeError as err:
        assert "0.weight, 0.bias were frozen" in str(err), str(err)
        assert "delay_allreduce=True, which follows" in str(err), str(err)
    else:
        raise AssertionError("expected a RuntimeError naming the unfrozen parameters")
    # Re-wrapped, they are all-reduced: the gradients agree on every rank.
    ddp = DistributedDataParallel(model)
    model.zero_grad()
    ddp(_mine(ctx, x)).sum().backward()
    _assert_same_on_all_ranks(ctx, [model[0].weight.grad], "unfrozen 0.weight.grad")


def _expect_changed(ctx, ddp, x, *phrases):
    """``ddp``'s forward refuses the module's changed parameters, naming them."""
    try:
        ddp(_mine(ctx, x))
    except RuntimeError as err:
        text = str(err)
    else:
        raise AssertionError(f"a change to the wrapped module was taken: {phrases}")
    assert "parameters changed since the all-reduce was set up" in text, text
    for phrase in phrases:
        assert phrase in text, (phrase, text)


def check_replaced_layer_refused_by_the_reducer(ctx):
    # A head replaced after wrapping (ddp.module[2] = nn.Linear(...)): PyTorch's reducer
    # all-reduces the parameters it was built with, so the new ones trained on each rank's
    # gradients alone (and, before the first step, the first-step rule left the old ones
    # out and then named the new ones as left out). Refused at the next forward, with or
    # without a step before; a layer added and trained is too. Unrelated modules built
    # between steps (which move the structure counter) change nothing.
    x, _ = _global_batch(ctx)
    for steps_before in (0, 1):
        model = _mlp(ctx.device)
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model)
        for step in range(steps_before):
            nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # (not part of the model)
            _grads_match_global_batch(ctx, ddp, model, ref, 600 + step, "before the change")
        model[2] = nn.Linear(16, 4).to(ctx.device)
        _expect_changed(ctx, ddp, x, "2.weight, 2.bias are new parameter objects")
        _expect_changed(ctx, ddp, x, "2.weight, 2.bias")  # (until wrapped again)
        with torch.no_grad():
            ddp(_mine(ctx, x))  # (no backward: nothing to refuse)
    model = _mlp(ctx.device)
    ddp = DistributedDataParallel(model)
    model.append(nn.Linear(4, 4).to(ctx.device))
    _expect_changed(ctx, ddp, x, "3.weight, 3.bias are new to it", "delay_allreduce=True")
    # A layer removed is the reducer's to handle: with find_unused_parameters=True it trains
    # on (it was refused, also when an unrelated module built later moved the counter).
    torch.manual_seed(0)
    model = _MaybeHead(ctx.device)  # (its head unused)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    _grads_match_global_batch(ctx, ddp, model, ref, 605, "with the head")
    model.head = ref.head = None
    nn.Linear(2, 2)
    _grads_match_global_batch(ctx, ddp, model, ref, 606, "the head removed")
    # A layer the first step left out, replaced: new to the reducer too (the first step's
    # leave-out had exempted its name, and it trained on each rank's own gradients).
    torch.manual_seed(0)
    model = _MaybeHead(ctx.device)
    ddp = DistributedDataParallel(model)
    for seed in (607, 608):
        _train_steps(ctx, ddp, [seed])
    model.head = nn.Linear(4, 4).to(ctx.device)
    model.use_head = True
    _expect_changed(ctx, ddp, x, "head.weight, head.bias are new parameter objects")
    # A frozen layer added is no business of the reducer's; unfrozen later, it is refused as a
    # layer frozen at wrapping is.
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    model.add_module("spare", nn.Linear(4, 4).to(ctx.device).requires_grad_(False))
    ref.add_module("spare", copy.deepcopy(model.spare))
    _grads_match_global_batch(ctx, ddp, model, ref, 610, "a frozen layer added")
    model.spare.requires_grad_(True)
    try:
        ddp(_mine(ctx, x))
    except RuntimeError as err:
        assert "spare.weight, spare.bias were frozen" in str(err), str(err)
    else:
        raise AssertionError("a layer added frozen and unfrozen later was taken")


class _Growing(nn.Module):
    """An MLP whose head may be replaced, with an optional BatchNorm (eval mode) before it."""

    def __init__(self, device):
        super().__init__()
        self.body = _mlp(device)
        self.norm = nn.Identity()

    def forward(self, x):
        return self.norm(self.body(x))


def check_delay_allreduce_follows_the_module(ctx):
    # Apex's delay mode reduced whatever gradients the module's parameters held after
    # backward: a layer frozen at wrapping and unfrozen later (progressive fine-tuning), a
    # head replaced or a layer added (each rank building its own, differently initialised)
    # all train as one process. The new layers (and their buffers) take rank 0's values,
    # as the model did at wrapping; the replaced head's hooks are removed.
    torch.manual_seed(0)
    model = _Growing(ctx.device)
    ref = copy.deepcopy(model)
    model.body[0].requires_grad_(False)
    ref.body[0].requires_grad_(False)
    ddp = DistributedDataParallel(model, delay_allreduce=True, message_size=64)
    _grads_match_global_batch(ctx, ddp, model, ref, 620, "frozen at wrapping")
    assert model.body[0].weight.grad is None
    model.body[0].requires_grad_(True)
    ref.body[0].requires_grad_(True)
    _grads_match_global_batch(ctx, ddp, model, ref, 621, "unfrozen")
    old_head = model.body[2]
    torch.manual_seed(100 + ctx.rank)  # (each rank its own head and statistics)
    model.body[2] = nn.Linear(16, 4).to(ctx.device)
    model.norm = nn.BatchNorm1d(4).to(ctx.device).eval()
    with torch.no_grad():
        model.norm.running_mean.uniform_()
        model.norm.running_var.uniform_(0.5, 1.5)
    x, _ = _global_batch(ctx, seed=622)
    ddp(_mine(ctx, x))  # (a forward with grad: rank 0's values arrive here)
    _assert_same_on_all_ranks(
        ctx, [model.body[2].weight, model.body[2].bias, model.norm.weight,
              model.norm.running_mean, model.norm.running_var], "the new layers")
    ref.body[2] = copy.deepcopy(model.body[2])
    ref.norm = copy.deepcopy(model.norm)
    _grads_match_global_batch(ctx, ddp, model, ref, 623, "a head replaced, a layer added")
    assert not old_head.weight._post_accumulate_grad_hooks, "the old head's hook stayed"
    # A parameter frozen between steps stays in; a layer frozen and unfrozen again trains.
    model.body[0].requires_grad_(False)
    ref.body[0].requires_grad_(False)
    _grads_match_global_batch(ctx, ddp, model, ref, 624, "frozen again")
    model.body[0].requires_grad_(True)
    ref.body[0].requires_grad_(True)
    _grads_match_global_batch(ctx, ddp, model, ref, 625, "unfrozen again")


class _OptionalExtra(nn.Module):
    """A trunk and a head, and an ``extra`` head added to the output while ``use_extra``."""

    def __init__(self):
        super().__init__()
        self.trunk, self.head, self.extra = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        self.use_extra = True

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.head(h) + self.extra(h) if self.use_extra else self.head(h)


def check_delay_allreduce_layer_taken_out_and_put_back_within_a_window(ctx):
    # B (r98C's B1). The delay mode follows the module's parameters at each forward; a layer
    # used by a no_sync() micro-batch, taken out (model.extra = None) for the next one and
    # put back before the synced one (which does not use it) lost its fresh mark, so its
    # accumulated gradients stayed out of the window's all-reduce: each rank kept its own,
    # with no error. Reference: one process on the global micro-batches, within _tol.
    torch.manual_seed(0)
    model = _OptionalExtra().to(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    extra = model.extra
    for micro in range(3):
        x, y = _global_batch(ctx, seed=640 + micro)
        model.use_extra = ref.use_extra = micro == 0
        if micro == 1:
            model.extra = None
        elif micro == 2:
            model.extra = extra
        with contextlib.nullcontext() if micro == 2 else ddp.no_sync():
            F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
        F.mse_loss(ref(x), y).backward()
    _assert_same_grads(ctx, model, ref, "a layer out and back within a window")


def check_delay_allreduce_follows_a_progressive_unfreezing(ctx):
    """Gradual unfreezing (one more layer every few steps, as in ULMFiT-style fine-tuning)
    under the delay mode: each layer unfrozen joins the all-reduce from its next forward, the
    second one as the first (the wrapper keeps track of what is still frozen after following
    the module once), so after every step each trainable parameter holds the global batch's
    gradient, as one process computes it, and the frozen ones hold none. (D06)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4)).to(ctx.device)
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    for step, layer in enumerate((None, 2, 0)):
        if layer is not None:
            model[layer].requires_grad_(True)
            ref[layer].requires_grad_(True)
        x, y = _global_batch(ctx, seed=800 + step)
        _backward_matches_the_whole_batch(ctx, ddp, model, ref, x, y, f"step {step}")


def check_delay_allreduce_dropped_wrapper_takes_its_hooks_along(ctx):
    """A delay-mode wrapper that is dropped (the model wrapped again, a notebook cell that
    rebuilds the wrapper) removes its gradient hooks from the module, those on a layer added
    after wrapping included: hooks left behind keep the dropped wrapper's state alive and are
    called for every gradient of every later step, one more per wrapper ever built.
    Reference: a plain module, which carries no post-accumulate-grad hooks. (D11, D12)"""
    model = _mlp(ctx.device)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    x, y = _global_batch(ctx, seed=770)
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    model.append(nn.Linear(4, 4).to(ctx.device))  # (followed at the next forward)
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in model.parameters())
    del ddp
    gc.collect()
    left = [name for name, p in model.named_parameters() if p._post_accumulate_grad_hooks]
    assert not left, f"hooks left on {left} after the wrapper was dropped"


def check_delay_allreduce_second_backward_through_a_checkpoint_stays_local(ctx):
    """A second backward through a forward already all-reduced (retain_graph=True, then a
    second loss through the same forward) stays this rank's own in the delay mode also where
    the first gradients arrived inside a reentrant checkpoint's nested backward (the
    all-reduce deferred to the end of the outer one): each forward is all-reduced once, as
    with PyTorch's reducer. Reference: the global batch's gradients (the first backward)
    plus this rank's own (the second), in one process. (B04)"""
    torch.manual_seed(0)
    model = _Checkpointed("hidden").to(ctx.device)  # (the head inside the checkpoint)
    ref, local = copy.deepcopy(model), copy.deepcopy(model)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    x, y = _global_batch(ctx, seed=780)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (rank 0's late-gradient warning)
        loss = F.mse_loss(_logits(ddp(_mine(ctx, x))), _mine(ctx, y))
        loss.backward(retain_graph=True)
        loss.backward()
    F.mse_loss(_logits(ref(x)), y).backward()
    F.mse_loss(_logits(local(_mine(ctx, x))), _mine(ctx, y)).backward()
    for (name, p), q, r in zip(model.named_parameters(), ref.parameters(), local.parameters()):
        if q.grad is None:  # (`extra`: no forward uses it)
            assert p.grad is None, (name, p.grad)
            continue
        torch.testing.assert_close(p.grad, q.grad + r.grad, **_tol(ctx),
                                   msg=labelled(f"averaged, then local: {name}"))


def check_delay_allreduce_leaves_stale_gradients_alone(ctx):
    # Fine-tuning: the backbone trains, then is frozen with its gradient left in place (the
    # new optimizer holds the head only, so nothing zeroes it). Only gradients produced since
    # the last all-reduce are all-reduced, as with PyTorch's reducer: summed again at every
    # step (gradient_average=False) the stale one grew by the world size each time.
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, delay_allreduce=True, gradient_average=False)

    def step(seed, what):
        x, y = _global_batch(ctx, seed=seed)
        F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y), reduction="sum").backward()
        F.mse_loss(ref(x), y, reduction="sum").backward()  # (the sum over the ranks)
        _assert_same_grads(ctx, model, ref, what)

    step(630, "all trained")
    model[0].requires_grad_(False)
    ref[0].requires_grad_(False)
    for seed in (631, 632):
        model[2].zero_grad()
        ref[2].zero_grad()
        step(seed, f"backbone frozen, step {seed}")


def check_unused_parameters_named_with_ignored_ones_left_out(ctx):
    # Parameters set to be ignored (_set_params_and_buffers_to_ignore_for_model) are not in
    # the reducer's list: the unused `b` must be named, not the ignored `a`.
    torch.manual_seed(0)
    model = _FrozenLater().to(ctx.device)  # a -> c, b unused
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["a.weight", "a.bias"])
    text = _unused_parameters_error(ctx, DistributedDataParallel(model), lambda: None)
    assert "got no gradient: b.weight, b.bias," in text, text
    assert "a.weight" not in text, text


def check_amp_half_refuses_a_model_already_inside_torch_ddp(ctx):
    # Lightning 1.x wraps its module in torch's DDP (through a wrapper module) before its Apex
    # plugin runs amp.initialize: at O2/O3 the cast replaced the parameters' gradient
    # accumulators carrying DDP's hooks, and the ranks silently stopped averaging.
    from mixprec import amp

    for opt_level in ("O2", "O3", "O1"):
        model = _mlp(ctx.device)
        holder = nn.ModuleDict({"inner": model})  # (Lightning's wrapper module)
        ddp = nn.parallel.DistributedDataParallel(holder)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if opt_level == "O1":  # (fp32 parameters: the hooks stay)
            amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
            continue
        try:
            amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
        except ValueError as err:
            assert "inside a DistributedDataParallel built before initialize" in str(err), err
        else:
            raise AssertionError(f"{opt_level}: expected a refusal")
        assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing changed
        del ddp


def check_apex_flat_dist_call(ctx):
    # Apex's apex.parallel.distributed.flat_dist_call, imported by scripts from there.
    from mixprec.parallel.distributed import flat_dist_call

    rank = dist.get_rank()
    dtypes = (torch.float16, torch.float32) if ctx.is_cuda else (torch.float32, torch.float64)
    tensors = [torch.full((3, 2), float(rank + 1), dtype=dtypes[0], device=ctx.device),
               torch.full((5,), 10.0 * (rank + 1), dtype=dtypes[1], device=ctx.device),
               torch.full((4,), -float(rank), dtype=dtypes[0], device=ctx.device)]
    flat_dist_call(tensors, dist.broadcast, (0,))
    assert [float(t.float().mean()) for t in tensors] == [1.0, 10.0, 0.0]
    assert [t.dtype for t in tensors] == [dtypes[0], dtypes[1], dtypes[0]]
    for t in tensors:
        t.add_(rank)
    flat_dist_call(tensors, dist.all_reduce)  # the average over the ranks
    world = dist.get_world_size()
    shift = sum(range(world)) / world
    assert [float(t.float().mean()) for t in tensors] == [1.0 + shift, 10.0 + shift, shift]


def _unused_head_is_skipped(ctx, seed, **ddp_kwargs):
    """Two steps of a model with a head no forward uses: the used head's gradients are the
    single-process ones, the unused head gets none."""
    torch.manual_seed(0)
    model = _TwoHeads().to(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    for step in range(2):
        x, y = _global_batch(ctx, seed=seed + step)
        model.zero_grad()
        ref.zero_grad()
        F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
        F.mse_loss(ref(x), y).backward()
        torch.testing.assert_close(model.a.weight.grad, ref.a.weight.grad, **_tol(ctx))
        assert model.b.weight.grad is None and model.b.bias.grad is None


def check_unused_parameters_found(ctx):
    _unused_head_is_skipped(ctx, seed=30, find_unused_parameters=True)


# ------------------------------------------------------------------------------------------------
# Apex's first-step rule in the reducer's mode (mixprec.parallel._first_step)
# ------------------------------------------------------------------------------------------------
def _left_out_warnings(caught) -> List[str]:
    return [str(w.message) for w in caught if "left out of the all-reduce" in str(w.message)]


def check_first_step_leaves_out_what_no_rank_used(ctx):
    # A branch no rank takes in the first step (BERT's pooler under a question-answering head)
    # is left out of the all-reduce, as Apex's DDP did (PyTorch's reducer raised at the next
    # forward), wherever the other gradients come from: reentrant checkpoints (the watch's
    # callback queued inside a nested backward), custom output objects, a checkpoint on rank
    # 0 only. Every step's gradients are the single-process ones; warned once, on rank 0.
    for pattern in ("plain", "reentrant", "object", "hidden", "nested", "rank0"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = _checkpointed_steps(ctx, pattern, takes=lambda step, rank: False,
                                      delay_allreduce=False, message_size=64)
        left = _left_out_warnings(caught)
        assert len(left) == (ctx.rank == 0), (pattern, left)
        if left:
            assert left[0].startswith("DistributedDataParallel: extra.weight, extra.bias got "
                                      "no gradient on any rank in the first step"), left[0]
        assert "extra.weight" not in ddp._reducer_names, (pattern, ddp._reducer_names)
        assert "inp.weight" in ddp._reducer_names, (pattern, ddp._reducer_names)
    _unused_head_is_skipped(ctx, seed=32)  # (the default options)


def check_first_step_averages_what_some_ranks_used(ctx):
    # A branch only rank 0 takes in the first step is averaged with the other ranks' zeros
    # (as with find_unused_parameters=True) and stays in the all-reduce for the later steps,
    # which all take it.
    for pattern in ("plain", "reentrant", "rank0"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = _checkpointed_steps(ctx, pattern, takes=lambda step, rank: rank == 0 or step,
                                      delay_allreduce=False, message_size=64)
        assert not _left_out_warnings(caught), _left_out_warnings(caught)
        assert "extra.weight" in ddp._reducer_names, (pattern, ddp._reducer_names)


class _FirstBlockTwice(nn.Module):
    """The first block run twice through reentrant checkpointing (a weight-shared encoder),
    or (``tied``) once outside a reentrant checkpoint and once inside it (tied weights)."""

    def __init__(self, tied=False):
        super().__init__()
        self.tied = tied
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.b(x) if self.tied else checkpoint(self.b, x, use_reentrant=True)
        return self.head(checkpoint(self.b, torch.tanh(h), use_reentrant=True))


def check_first_step_refuses_a_block_checkpointed_twice(ctx):
    # A block run twice through reentrant checkpointing in one forward: its gradient arrives
    # in two nested backwards. Where its first part completed the bucket, PyTorch's reducer
    # all-reduced that part only and the second stayed local: the ranks' gradients differed
    # at every step without an error (PyTorch's own DDP too; r101A R2). (Where the bucket was
    # still waiting, PyTorch raised "marked as ready twice" itself.) Refused on every rank at
    # the end of the first backward, naming the block; the delay mode takes the pattern
    # (check_delay_allreduce_where_the_reducer_cannot).
    x, y = _global_batch(ctx, seed=300)
    for tied in (False, True):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(_FirstBlockTwice(tied).to(ctx.device))
        try:
            F.mse_loss(ddp(_mine(ctx, x).requires_grad_()), _mine(ctx, y)).backward()
        except RuntimeError as err:
            text = str(err)
            assert text.startswith("DistributedDataParallel: b.weight, b.bias got gradients "
                                   "from two backward passes nested in one backward"), text
            assert "use_reentrant=False" in text and "delay_allreduce=True" in text, text
        else:
            raise AssertionError(f"tied={tied}: trained in the reducer's mode")
        # The same model in the delay mode: the single-process gradients.
        torch.manual_seed(0)
        model = _FirstBlockTwice(tied).to(ctx.device)
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, delay_allreduce=True)
        F.mse_loss(ddp(_mine(ctx, x).requires_grad_()), _mine(ctx, y)).backward()
        F.mse_loss(ref(x.clone().requires_grad_()), y).backward()
        _assert_same_grads_or_none(ctx, model, ref, f"delay mode, tied={tied}")
    # Blocks checkpointed once each, nested checkpoints: not refused, and their gradients are
    # the single-process ones.
    for pattern in ("reentrant", "nested"):
        _checkpointed_steps(ctx, pattern, steps=1, takes=lambda step, rank: True,
                            delay_allreduce=False, message_size=64)


def check_first_step_after_no_sync_micro_batches(ctx):
    # Gradient accumulation before the first all-reduce: a branch taken in the no_sync()
    # micro-batch only holds an accumulated gradient, which the synced micro-batch must
    # all-reduce (it fires no hook there); a layer no micro-batch uses is left out.
    torch.manual_seed(0)
    model = _Checkpointed("reentrant").to(ctx.device)
    model.spare = nn.Linear(8, 8).to(ctx.device)  # (no forward uses it)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, message_size=64)
    for step in range(2):
        x, y = _global_batch(ctx, seed=400 + step)
        model.zero_grad()
        ref.zero_grad()
        with ddp.no_sync():
            F.mse_loss(ddp(_mine(ctx, x), extra=True), _mine(ctx, y)).backward()
        F.mse_loss(ddp(_mine(ctx, x).flip(0), extra=step > 0), _mine(ctx, y)).backward()
        for r in range(ctx.world_size):
            xs, ys = x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK]
            loss = F.mse_loss(ref(xs, extra=True), ys) + F.mse_loss(
                ref(xs.flip(0), extra=step > 0), ys)
            (loss / ctx.world_size).backward()
        _assert_same_grads_or_none(ctx, model, ref, f"step {step}")
    assert model.spare.weight.grad is None and "spare.weight" not in ddp._reducer_names
    assert "extra.weight" in ddp._reducer_names


def check_first_step_guards_what_it_left_out(ctx):
    # After the first step: communication hooks registered before it still run on the rebuilt
    # reducer; copies (pickled, deep-copied) keep the parameters out; a gradient reaching one
    # of them raises (it would stay this rank's own); one frozen after wrapping and trainable
    # again is refused at the forward.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    torch.manual_seed(0)
    model = _Checkpointed("plain").to(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, message_size=64)
    ddp.register_comm_hook(None, counting_hook)
    for step in range(3):
        x, y = _global_batch(ctx, seed=440 + step)
        _backward_matches_the_whole_batch(ctx, ddp, model, ref, x, y, f"step {step}")
        if step == 0:
            first = len(calls)
    assert first > 0 and len(calls) > first, (first, len(calls))
    for copy_ in (pickle.loads(pickle.dumps(ddp)), copy.deepcopy(ddp)):
        assert "extra.weight" not in copy_._reducer_names
        copy_.module.zero_grad()
        F.mse_loss(copy_(_mine(ctx, x)), _mine(ctx, y)).backward()
        assert copy_.module.extra.weight.grad is None
        _assert_same_on_all_ranks(ctx, [copy_.module.head.weight.grad], "copy's head grad")
    try:
        ddp(_mine(ctx, x), extra=True).sum().backward()
    except RuntimeError as err:
        assert "extra." in str(err) and "left out of the all-reduce" in str(err), str(err)
        assert "find_unused_parameters=True" in str(err), str(err)
    else:
        raise AssertionError("a gradient for a left-out parameter did not raise")
    # Frozen after wrapping (a fine-tuning script freezing the backbone through .module).
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, message_size=64)
    for net in (model, ref):
        net[0].requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            _grads_match_global_batch(ctx, ddp, model, ref, 460 + step, f"frozen, step {step}")
    assert not _left_out_warnings(caught), _left_out_warnings(caught)  # (frozen: meant so)
    assert model[0].weight.grad is None
    model[0].requires_grad_(True)
    try:
        ddp(_mine(ctx, x))
    except RuntimeError as err:
        assert "0.weight, 0.bias were frozen" in str(err) and "first step" in str(err), err
    else:
        raise AssertionError("a parameter left out when frozen, trainable again, was taken")


def check_first_step_watches_the_synced_backward_only(ctx):
    # A forward with grad enabled and no backward (a dry run), then a no_sync() micro-batch:
    # the watch waits for the synced backward (settling in the unsynced one, it all-reduced
    # nothing and left the branch that micro-batch alone took to go unreduced).
    torch.manual_seed(0)
    model = _Checkpointed("plain").to(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, message_size=64)
    x, y = _global_batch(ctx, seed=500)
    ddp(_mine(ctx, x))  # (no backward)
    with ddp.no_sync():
        F.mse_loss(ddp(_mine(ctx, x), extra=True), _mine(ctx, y)).backward()
    F.mse_loss(ddp(_mine(ctx, x).flip(0)), _mine(ctx, y)).backward()
    for r in range(ctx.world_size):
        xs, ys = x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK]
        loss = F.mse_loss(ref(xs, extra=True), ys) + F.mse_loss(ref(xs.flip(0)), ys)
        (loss / ctx.world_size).backward()
    _assert_same_grads_or_none(ctx, model, ref, "after a dry run and no_sync()")
    assert "extra.weight" in ddp._reducer_names


class _HeadPair(nn.Module):
    """A trunk and two heads, each output its own loss (``num_losses=2`` scripts)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.a(h), self.b(h)


def _train_steps(ctx, ddp, seeds, set_to_none=True, **forward_kwargs):
    for seed in seeds:
        x, y = _global_batch(ctx, seed=seed)
        ddp.module.zero_grad(set_to_none=set_to_none)
        F.mse_loss(_logits(ddp(_mine(ctx, x), **forward_kwargs)), _mine(ctx, y)).backward()


def check_first_step_rule_edges(ctx):
    # (1) A layer frozen after the first step while the rest trains (a backbone frozen
    # through .module after a few steps): refused at the forward, before a step on
    # unreduced gradients (it ran one, then the next forward raised; or, frozen before the
    # reducer's rebuild, it fell out silently and drifted apart when unfrozen). Wrapped
    # again, it trains as one process. The whole model frozen at once (a GAN's
    # discriminator during the generator's step) needs nothing.
    torch.manual_seed(0)
    model = _Checkpointed("plain").to(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, message_size=64)
    _train_steps(ctx, ddp, [520])
    for net in (model, ref):
        net.requires_grad_(False)
    x, y = _global_batch(ctx, seed=521)
    xs = _mine(ctx, x).requires_grad_(True)
    F.mse_loss(ddp(xs), _mine(ctx, y)).backward()  # (gradients for the input only)
    assert xs.grad is not None and model.inp.weight.grad is not None  # (step 520's)
    for net in (model, ref):
        net.requires_grad_(True)
        net.inp.requires_grad_(False)
    try:
        _train_steps(ctx, ddp, [522])
    except RuntimeError as err:
        assert "inp.weight, inp.bias were frozen (requires_grad=False) since the" in (
            str(err)) and "Wrap the model again" in str(err), str(err)
    else:
        raise AssertionError("a layer frozen after the first step was taken")
    ddp = DistributedDataParallel(model, message_size=64)
    for step in range(2):
        _train_steps(ctx, ddp, [523 + step])
        ref.zero_grad()
        x, y = _global_batch(ctx, seed=523 + step)
        F.mse_loss(ref(x), y).backward()
        _assert_same_grads_or_none(ctx, model, ref, f"wrapped again, step {step}")
    # Where the first step is not watched (inside join(); a model with sparse gradients) a
    # partial freeze is refused from the start (the ranks drifted apart for a step); a copy
    # of the wrapper made with a layer frozen through .module refuses unfreezing it, as the
    # original does (its gradients stayed each rank's own).
    model = _mlp(ctx.device)
    ddp = DistributedDataParallel(model, message_size=64)
    with ddp.join():
        _train_steps(ctx, ddp, [525])
        model[0].requires_grad_(False)
        try:
            _train_steps(ctx, ddp, [526])
        except RuntimeError as err:
            assert "0.weight, 0.bias were frozen" in str(err), str(err)
        else:
            raise AssertionError("a partial freeze inside join() was taken")
    model = _mlp(ctx.device)
    ddp = DistributedDataParallel(model, message_size=64)
    model[0].requires_grad_(False)
    for copy_ in (pickle.loads(pickle.dumps(ddp)), copy.deepcopy(ddp)):
        _train_steps(ctx, copy_, [526])
        copy_.module[0].requires_grad_(True)
        try:
            _train_steps(ctx, copy_, [527])
        except RuntimeError as err:
            assert "0.weight, 0.bias were frozen" in str(err), str(err)
        else:
            raise AssertionError("a copy took a layer frozen before it was made, unfrozen")
    # A CycleGAN step from the start: the discriminator's first forward runs frozen (the
    # generator's loss), its own step after; the first step watched is the latter.
    torch.manual_seed(0)
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, message_size=64)
    for step in range(2):
        model.requires_grad_(False)
        x, y = _global_batch(ctx, seed=527 + step)
        xs = _mine(ctx, x).requires_grad_(True)
        ddp(xs).sum().backward()
        model.requires_grad_(True)
        _grads_match_global_batch(ctx, ddp, model, ref, 527 + step, f"GAN step {step}")
    assert ddp._left_out_names == []
    # (2) Another wrapper built around the module but not run (an evaluation helper) leaves
    # the first one's guards in place; a wrapper that runs the module takes over (the old
    # one's guards then stay quiet).
    torch.manual_seed(0)
    model = _Checkpointed("plain").to(ctx.device)
    ddp = DistributedDataParallel(model, message_size=64)
    _train_steps(ctx, ddp, [530])
    DistributedDataParallel(model)
    try:
        _train_steps(ctx, ddp, [531], extra=True)
    except RuntimeError as err:
        assert "left out of the all-reduce" in str(err), str(err)
    else:
        raise AssertionError("a second wrapper switched the first one's guards off")
    torch.manual_seed(0)
    model = _Checkpointed("plain").to(ctx.device)
    ref = copy.deepcopy(model)
    old = DistributedDataParallel(model, message_size=64)
    _train_steps(ctx, old, [540])
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    _train_steps(ctx, ddp, [541], extra=True)
    ref.zero_grad()
    x, y = _global_batch(ctx, seed=541)
    F.mse_loss(ref(x, extra=True), y).backward()
    _assert_same_grads_or_none(ctx, model, ref, "wrapped again")
    # (3) Gradients zeroed in place (set_to_none=False) count as none: a model wrapped again
    # for a second phase that trains another head leaves the first head out.
    torch.manual_seed(0)
    model = _TwoHeads().to(ctx.device)
    model.use_b = True
    _train_steps(ctx, DistributedDataParallel(model), [550], set_to_none=False)
    model.use_b = False  # (now b is the unused head, with a zero gradient tensor)
    ddp = DistributedDataParallel(model)
    _train_steps(ctx, ddp, [551, 552, 553], set_to_none=False)
    assert "b.weight" not in ddp._reducer_names and model.b.weight.grad is None
    # (4) A model with sparse gradients (a sparse Embedding or EmbeddingBag: r53A's D31)
    # keeps PyTorch's rule (a zero gradient for an unused sparse layer would have to be
    # sparse): the unused layer is not left out, and the next forward's error says why.
    for sparse in (nn.Embedding(10, 4, sparse=True),
                   nn.EmbeddingBag(10, 4, mode="sum", sparse=True)):
        torch.manual_seed(0)
        model = nn.ModuleDict({"emb": sparse, "b": nn.Linear(4, 4)})
        model.forward = lambda x, model=model: model["emb"](x.view(1, -1)).sum()
        ddp = DistributedDataParallel(model.to(ctx.device))
        idx = torch.arange(4, device=ctx.device)
        ddp(idx).backward()
        try:
            ddp(idx)
        except RuntimeError as err:
            assert "b.weight" in str(err) and (
                "does not apply to a model with sparse" in str(err)), str(err)
        else:
            raise AssertionError(f"expected the unused-parameter error ({type(sparse)})")
    # (5) A second backward through the first step's forward (retain_graph, two losses)
    # reaching a parameter the first one left out raises before any optimizer step (its
    # gradient would stay this rank's own).
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_HeadPair().to(ctx.device))
    x, _ = _global_batch(ctx, seed=560)
    out_a, out_b = ddp(_mine(ctx, x))
    out_a.sum().backward(retain_graph=True)
    try:
        out_b.sum().backward()
    except RuntimeError as err:
        assert "b.weight got a gradient" in str(err) or "b.bias got a gradient" in str(err), err
    else:
        raise AssertionError("a second backward reaching a left-out parameter was taken")


def check_amp_o2_first_step_leaves_an_unused_head_out(ctx):
    # amp O2 under the rule: half gradients, an unused head (no master gradient, no step), the
    # same training as one process on the global batch.
    from mixprec import amp

    torch.manual_seed(0)
    model = _Checkpointed("reentrant").to(ctx.device)
    model.spare = nn.Linear(8, 4).to(ctx.device)
    model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model))
    ddp = DistributedDataParallel(model, message_size=64)
    spare = [float(m.double().sum()) for m in amp.master_params(opt)]
    _amp_steps_against_reference(ctx, ddp, opt, ref, ref_opt, seed=480)
    assert model.spare.weight.grad is None and "spare.weight" not in ddp._reducer_names
    masters = [float(m.double().sum()) for m in amp.master_params(opt)]
    assert masters[-2:] == spare[-2:] and masters[:2] != spare[:2], (masters, spare)


def check_arguments_validated_and_warned(ctx):
    def build(**kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = DistributedDataParallel(_mlp(ctx.device), **kwargs)
        return ddp, caught

    ddp, caught = build(shared_param=True)
    assert ddp.delay_allreduce is True
    # Apex's warnings come from rank 0 only (the constructor runs on every rank).
    assert any(issubclass(w.category, FutureWarning) and "delay_allreduce" in str(w.message)
               for w in caught) == (ctx.rank == 0), [str(w.message) for w in caught]
    ddp, _ = build(shared_param=False, delay_allreduce=True)  # never overrides an explicit True
    assert ddp.delay_allreduce is True
    ddp, caught = build(gradient_average_split_factor=2.0)
    assert ddp.gradient_predivide_factor == 2.0
    assert any("gradient_predivide_factor" in str(w.message) for w in caught) == (ctx.rank == 0)
    _, caught = build(allreduce_trigger_params=[], retain_allreduce_buffers=True,
                      num_allreduce_streams=2, allreduce_communicators=[None, None])
    text = " ".join(str(w.message) for w in caught if issubclass(w.category, UserWarning))
    for name in ("allreduce_trigger_params", "retain_allreduce_buffers",
                 "num_allreduce_streams", "allreduce_communicators"):
        assert (name in text) == (ctx.rank == 0), (name, ctx.rank, text)

    # A subclass customising Apex's internals (a sub-group all-reduce): its override would do
    # nothing here, silently; rank 0 warns.
    class _SubgroupDDP(DistributedDataParallel):
        def allreduce_bucket(self, bucket):
            raise AssertionError("never called")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _SubgroupDDP(_mlp(ctx.device))
    text = " ".join(str(w.message) for w in caught)
    assert ("_SubgroupDDP overrides allreduce_bucket" in text) == (ctx.rank == 0), text
    bad = [({"message_size": 0}, ValueError), ({"gradient_predivide_factor": 0.0}, ValueError),
           ({"num_allreduce_streams": 0}, ValueError),
           # (Under one element: not a bucket of a fraction of one. r98C's N24.)
           ({"message_size": 0.5}, ValueError),
           ({"message_size": 0.999, "delay_allreduce": True}, ValueError)]
    for kwargs, error in bad:
        try:
            DistributedDataParallel(_mlp(ctx.device), **kwargs)
        except error as err:
            assert list(kwargs)[0] in str(err), str(err)
        else:
            raise AssertionError(f"{kwargs} did not raise {error.__name__}")
    # PyTorch's DDP's arguments (a script moving over from it) are named as such.
    torch_ddp = "are arguments of torch.nn.parallel.DistributedDataParallel"
    for kwargs, words in (({"device_ids": [0]}, f"['device_ids'] {torch_ddp}"),
                          ({"static_graph": True, "bucket_cap_mb": 5},
                           f"['bucket_cap_mb', 'static_graph'] {torch_ddp}"),
                          ({"no_such_option": 1}, "unexpected keyword argument")):
        try:
            DistributedDataParallel(_mlp(ctx.device), **kwargs)
        except TypeError as err:
            assert words in str(err), str(err)
        else:
            raise AssertionError(f"{kwargs} did not raise TypeError")
    try:
        DistributedDataParallel(lambda x: x)
    except TypeError as err:
        assert "nn.Module" in str(err)
    else:
        raise AssertionError("a non-module did not raise TypeError")
    # prof=True labels the all-reduces and changes nothing else.
    ddp = DistributedDataParallel(_mlp(ctx.device), prof=True)
    x, y = _global_batch(ctx)
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    assert "gradient_predivide_factor=1.0" in repr(ddp)
    # print(model) shows the Apex options as given (a run's logged set-up).
    for kwargs, shown in (
            (dict(message_size=1000, delay_allreduce=True, gradient_average=False,
                  gradient_predivide_factor=2.0),
             "message_size=1000, delay_allreduce=True, allreduce_always_fp32=False, "
             "gradient_average=False, gradient_predivide_factor=2.0"),
            (dict(allreduce_always_fp32=True),
             "message_size=10000000, delay_allreduce=False, allreduce_always_fp32=True, "
             "gradient_average=True, gradient_predivide_factor=1.0")):
        text = repr(DistributedDataParallel(_mlp(ctx.device), **kwargs))
        assert shown in text, text
    # Not the arithmetic either: each fp16 gradient divided before the sum, as without prof
    # (summed first, gradients of 40000 on every rank averaged to inf).
    for kwargs in ({}, {"prof": True}):
        layer = nn.Linear(3, 1, bias=False).to(ctx.device).half()
        ddp = DistributedDataParallel(layer, **kwargs)
        ddp(torch.full((1, 3), 40000.0, dtype=torch.float16, device=ctx.device)).sum().backward()
        assert torch.equal(layer.weight.grad, torch.full_like(layer.weight, 40000.0)), kwargs


def _reducer_broadcasts_parameters_only(ctx):
    # Reducer(model) broadcasts rank 0's parameters (as Apex's did), not the module's
    # buffers: a BatchNorm's running statistics stay each rank's own (users who want them
    # equal broadcast them, or use SyncBatchNorm); a module of one parameter (a learned
    # scale) is broadcast like any other. Reference: rank 0's values and each rank's own.
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(ctx.device)
    scale = _Scale().to(ctx.device)
    with torch.no_grad():
        for p in [*model.parameters(), *scale.parameters()]:
            p.fill_(ctx.rank + 1.0)
        model[1].running_mean.fill_(10.0 * (ctx.rank + 1))
        model[1].running_var.fill_(ctx.rank + 2.0)
    Reducer(model)
    Reducer(scale)
    for name, p in [*model.named_parameters(), *scale.named_parameters()]:
        torch.testing.assert_close(p.detach(), torch.ones_like(p), rtol=0, atol=0,
                                   msg=labelled(f"rank {ctx.rank}: {name}"))
    bn = model[1]
    torch.testing.assert_close(bn.running_mean, torch.full_like(bn.running_mean,
                                                                10.0 * (ctx.rank + 1)),
                               rtol=0, atol=0, msg=labelled(f"rank {ctx.rank}: running_mean"))
    torch.testing.assert_close(bn.running_var, torch.full_like(bn.running_var, ctx.rank + 2.0),
                               rtol=0, atol=0, msg=labelled(f"rank {ctx.rank}: running_var"))


def check_reducer(ctx):
    model = _mlp(ctx.device, seed=200 + ctx.rank)  # different on every rank until broadcast
    reducer = Reducer(model)
    _assert_same_on_all_ranks(ctx, list(model.parameters()), "parameter after Reducer()")
    _reducer_broadcasts_parameters_only(ctx)
    ref = copy.deepcopy(model)
    x, y = _global_batch(ctx, seed=40)
    F.mse_loss(model(_mine(ctx, x)), _mine(ctx, y)).backward()
    reducer.reduce()
    F.mse_loss(ref(x), y).backward()
    _assert_same_grads(ctx, model, ref)
    tensors = [torch.full((3,), ctx.rank + 1.0, device=ctx.device),
               torch.full((2,), 10.0 * (ctx.rank + 1), dtype=torch.float64, device=ctx.device)]
    Reducer(tensors).reduce()
    mean = (ctx.world_size + 1) / 2
    torch.testing.assert_close(tensors[0], torch.full_like(tensors[0], mean), rtol=0, atol=0)
    torch.testing.assert_close(tensors[1], torch.full_like(tensors[1], 10 * mean), rtol=0, atol=0)
    # Any floating tensors, parameters included (replicas' weights averaged after local SGD
    # steps): averaged in place outside autograd, leaves that still require grad.
    w = torch.full((3,), ctx.rank + 1.0, device=ctx.device, requires_grad=True)
    layer = nn.Linear(2, 2, bias=False).to(ctx.device)
    with torch.no_grad():
        layer.weight.fill_(10.0 * (ctx.rank + 1))
    Reducer([w, *layer.parameters()]).reduce()
    torch.testing.assert_close(w.detach(), torch.full((3,), mean, device=ctx.device),
                               rtol=0, atol=0, msg=labelled(f"rank {ctx.rank}: w"))
    torch.testing.assert_close(layer.weight.detach(),
                               torch.full((2, 2), 10.0 * mean, device=ctx.device),
                               rtol=0, atol=0, msg=labelled(f"rank {ctx.rank}: weight"))
    assert w.is_leaf and w.requires_grad and w.grad_fn is None
    # Any iterable of tensors, nested or a generator, as Apex's Reducer took.
    a, b = (torch.full((2,), ctx.rank + 1.0, device=ctx.device) for _ in range(2))
    Reducer([[a], (t for t in [b])]).reduce()
    for t in (a, b):
        torch.testing.assert_close(t, torch.full_like(t, mean), rtol=0, atol=0)
    try:
        Reducer([a, [3]])
    except TypeError as err:
        assert "['int']" in str(err), str(err)
    else:
        raise AssertionError("a non-tensor leaf did not raise TypeError")
    # A sparse gradient (every rank alike, so every rank raises, before any collective): a
    # clear error, not PyTorch's "reshape is not implemented for sparse tensors".
    if ctx.device.type == "cpu":  # (CUDA sparse embedding backward: same rule, not needed)
        emb = nn.Embedding(5, 3, sparse=True)
        emb_reducer = Reducer(emb)
        emb(torch.tensor([ctx.rank])).sum().backward()
        try:
            emb_reducer.reduce()
        except TypeError as err:
            assert "['weight']" in str(err) and "sparse=False" in str(err), str(err)
        else:
            raise AssertionError("a sparse gradient did not raise TypeError")
    # A group without global rank 0: its first member is the broadcast source.
    last = ctx.world_size - 1
    groups = _groups_of_one(ctx)
    solo = _mlp(ctx.device, seed=300 + ctx.rank)
    before = [p.detach().clone() for p in solo.parameters()]
    if ctx.rank == last:
        Reducer(solo, process_group=groups[last])  # a group of one: nothing changes
        for p, q in zip(solo.parameters(), before):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    else:  # a group without this rank: refused when built (its broadcast did nothing, with a
        # warning from PyTorch only, and reduce() failed later)
        try:
            Reducer(solo, process_group=groups[last])
        except RuntimeError as err:
            assert "not a member" in str(err) and "new_group" in str(err), str(err)
        else:
            raise AssertionError("a Reducer over a group without this rank did not raise")


def check_reducer_broadcasts_frozen_parameters(ctx):
    # Reducer(model) broadcasts rank 0's parameters at construction, frozen ones included (a
    # backbone frozen for fine-tuning, initialised or loaded differently on each rank, must be
    # the same everywhere or the replicas' forwards differ), and leaves them frozen.
    # Reference: rank 0's values, exactly.
    # (R10)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)).to(ctx.device)
    model[0].requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(ctx.rank + 1.0)
    Reducer(model)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), torch.ones_like(p), rtol=0, atol=0,
                                   msg=labelled(f"rank {ctx.rank}: {name}"))
    assert not any(p.requires_grad for p in model[0].parameters())


def _amp_sgd_pairs(ctx, seed, ref_seed, opt_level, dtype):
    """(model, optimizer, reference model, its optimizer): two MLPs under amp with SGD."""
    from mixprec import amp

    out = []
    for s in (seed, ref_seed):
        net = _mlp(ctx.device, seed=s)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        out.extend(amp.initialize(net, opt, opt_level=opt_level, dtype=dtype, verbosity=0))
    return out


def _reducer_amp_step(amp, reducer, opt, loss, where):
    """One amp step whose gradients ``reducer`` averages inside or after the scale_loss block."""
    opt.zero_grad()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
        if where == "inside":
            reducer.reduce()
    if where == "after":
        reducer.reduce()
    opt.step()


def check_reducer_with_amp_o2(ctx):
    # Reducer on an amp O2 model with per-rank initial weights: the masters come from rank 0,
    # and reduce() averages whichever gradients exist, inside the scale_loss block (half
    # gradients) or after it (moved into the masters): both train as one process would.
    from mixprec import amp

    for where in ("inside", "after"):
        model, opt, ref, ref_opt = _amp_sgd_pairs(
            ctx, 220 + ctx.rank, 220, "O2", torch.bfloat16)  # the reference: rank 0's weights
        reducer = Reducer(model)
        for step in range(2):
            x, y = _global_batch(ctx, seed=230 + step)
            loss = F.mse_loss(model(_mine(ctx, x)).float(), _mine(ctx, y))
            _reducer_amp_step(amp, reducer, opt, loss, where)
            _amp_step_mse(ref, ref_opt, x, y, amp)
        masters = list(amp.master_params(opt))
        _assert_same_on_all_ranks(ctx, masters, f"master weight (reduce {where} scale_loss)")
        for m, r in zip(masters, amp.master_params(ref_opt)):
            torch.testing.assert_close(m, r, rtol=0, atol=2e-3)


def _assert_step_0_skipped_everywhere(ctx, amp, opt, ref_opt, skipped, what):
    """After two steps of which step 0 overflowed on rank 0 only: both were decided alike on
    every rank (step 0 skipped, the scale halved once), and the masters equal on every rank
    and those of ``ref_opt``'s one process that took step 1 alone on the whole batch."""
    assert skipped == [True, False], (what, skipped)
    scale = torch.tensor([amp.state_dict(optimizer=opt)["loss_scaler0"]["loss_scale"]])
    _assert_same_on_all_ranks(ctx, [scale], f"loss scale ({what})")
    assert scale.item() == 2.0 ** 15, (what, scale.item())
    params = list(amp.master_params(opt))
    _assert_same_on_all_ranks(ctx, params, f"master weight ({what})")
    for m, r in zip(params, amp.master_params(ref_opt)):
        torch.testing.assert_close(m, r, rtol=0, atol=2e-3, msg=lambda e: f"{what}: {e}")


def check_reducer_amp_overflow_on_one_rank(ctx):
    # fp16, dynamic loss scale, an overflow on rank 0 only (its loss x 1e4 at step 0). After
    # the scale_loss block each rank had decided alone: rank 0 dropped its gradients and
    # skipped reduce()'s all-reduce while the others waited in it (a hang). The overflow check
    # of a Reducer's model now agrees over the ranks: every rank skips step 0 and halves its
    # scale, then step 1 trains as one process would. Whichever came first, the Reducer or
    # amp.initialize, and whether the Reducer has the amp model, a part of it or a module
    # holding it: a Reducer built before initialize (or on a part) agreed on nothing, and the
    # rank that overflowed skipped while the other stepped on the averaged inf.
    from mixprec import amp

    cases = [("O2", "after", "model"), ("O1", "after", "model"), ("O2", "inside", "model"),
             ("O2", "after", "before initialize"), ("O1", "after", "before initialize"),
             ("O2", "inside", "before initialize"), ("O2", "after", "a part"),
             ("O2", "after", "a holder")]
    for opt_level, where, given in cases:
        model, opt, ref, ref_opt = _amp_sgd_pairs(ctx, 240, 240, opt_level, torch.float16)
        if given == "model":
            reducer = Reducer(model)
        elif given == "before initialize":
            model = _mlp(ctx.device, seed=240)
            reducer = Reducer(model)
            model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                        opt_level=opt_level, dtype=torch.float16, verbosity=0)
        elif given == "a part":  # (the amp model holds the MLP; the Reducer has the MLP)
            model = nn.Sequential(_mlp(ctx.device, seed=240))
            model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                        opt_level=opt_level, dtype=torch.float16, verbosity=0)
            reducer = Reducer(model[0])
        else:
            reducer = Reducer(nn.ModuleList([model]))
        skipped = []
        for step in range(2):
            x, y = _global_batch(ctx, seed=250 + step)
            blow_up = 1e4 if step == 0 and ctx.rank == 0 else 1.0
            loss = F.mse_loss(model(_mine(ctx, x)).float(), _mine(ctx, y)) * blow_up
            _reducer_amp_step(amp, reducer, opt, loss, where)
            skipped.append(amp.step_was_skipped(opt))
            if step == 1:  # the reference: step 0 skipped everywhere, step 1 on the batch
                _amp_step_mse(ref, ref_opt, x, y, amp)
        _assert_step_0_skipped_everywhere(
            ctx, amp, opt, ref_opt, skipped,
            f"{opt_level}, reduce {where} scale_loss, Reducer of {given}")
    # Half tensors are divided before the sum: finite values whose sum passes the dtype's
    # largest (65504 fp16, about 3.39e38 bf16) stay finite (bf16: r68B's C02).
    for dtype, value in ((torch.float16, 40000.0), (torch.bfloat16, 3.0e38)):
        half = torch.full((3,), value, dtype=dtype, device=ctx.device)
        Reducer([half]).reduce()
        torch.testing.assert_close(half, torch.full_like(half, value), rtol=1e-3, atol=0,
                                   msg=labelled(f"rank {ctx.rank}: {dtype}"))


def check_reducer_inside_an_accumulating_scale_loss_block(ctx):
    # Without master weights (O1, O3) a backward in scale_loss that accumulates onto gradients
    # an earlier block unscaled starts from grad=None: amp sets the earlier ones aside and adds
    # them back when the block exits. reduce() inside that block must average those too (as it
    # does the masters' gradients at O2), or this rank's earlier micro-batches come back
    # unaveraged and the ranks' gradients differ.
    from mixprec import amp

    for level in ("O1", "O2", "O3"):
        torch.manual_seed(0)
        model = nn.Linear(3, 1, bias=False).to(ctx.device)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model, opt = amp.initialize(model, opt, opt_level=level, dtype=torch.bfloat16,
                                    loss_scale=128.0, verbosity=0)
        reducer = Reducer(model)
        for micro in range(2):
            x = torch.tensor([[1.0, 2.0, 4.0]], device=ctx.device) * (ctx.rank + 1) * (micro + 1)
            with amp.scale_loss(model(x).float().sum(), opt) as scaled:
                scaled.backward()
                if micro == 1:
                    reducer.reduce()
        grad = next(iter(amp.master_params(opt))).grad.float()
        # x summed over the micro-batches, averaged over the ranks (exact in bf16 for 2, 4, 8)
        expected = torch.tensor([[3.0, 6.0, 12.0]], device=ctx.device) * (ctx.world_size + 1) / 2
        torch.testing.assert_close(grad, expected, rtol=0, atol=0, msg=labelled(level))


def check_hand_all_reduce_after_a_delayed_overflow_check_skips_on_every_rank(ctx):
    # BERT's post-accumulation reduction (r112B B1): scale_loss(..., delay_overflow_check=
    # True), then the master gradients all-reduced by hand, then step(). Each rank decided
    # alone at the block's exit: rank 0 (its loss x 1e4 at step 0, an fp16 overflow) skipped,
    # rank 1 stepped on the inf the reduction brought, and both went NaN. The decision now
    # waits for step(), which checks the reduced gradients: every rank skips step 0 and
    # halves its scale, then step 1 trains as one process on the whole batch would.
    from mixprec import amp
    from mixprec.parallel.distributed import flat_dist_call

    def by_hand(grads):
        for g in grads:
            dist.all_reduce(g)
            g /= ctx.world_size

    reductions = {"dist.all_reduce": by_hand,
                  "flat_dist_call": lambda grads: flat_dist_call(grads, dist.all_reduce),
                  "Reducer(list)": lambda grads: Reducer(grads).reduce()}
    for opt_level in ("O2", "O1"):
        for name, reduce in reductions.items():
            model, opt, ref, ref_opt = _amp_sgd_pairs(ctx, 260, 260, opt_level, torch.float16)
            skipped = []
            for step in range(2):
                x, y = _global_batch(ctx, seed=270 + step)
                blow_up = 1e4 if step == 0 and ctx.rank == 0 else 1.0
                opt.zero_grad()
                loss = F.mse_loss(model(_mine(ctx, x)).float(), _mine(ctx, y)) * blow_up
                with amp.scale_loss(loss, opt, delay_overflow_check=True) as scaled:
                    scaled.backward()
                reduce([p.grad for p in amp.master_params(opt)])
                opt.step()
                skipped.append(amp.step_was_skipped(opt))
                if step == 1:
                    _amp_step_mse(ref, ref_opt, x, y, amp)
            _assert_step_0_skipped_everywhere(ctx, amp, opt, ref_opt, skipped,
                                              f"{opt_level}, {name}")


def check_flat_dist_call_broadcast_after_initialize_syncs_the_masters(ctx):
    # BERT's replicas, seeded per rank, synced after amp.initialize with Apex's helper:
    # flat_dist_call([p.data for p in model.parameters()], dist.broadcast, (0,)) (r112B B2).
    # Rank 0 kept its fp32 masters while rank 1 took the broadcast half values into its own,
    # rounded: masters apart by half an ulp, replicas drifting. The masters now go along:
    # rank 0's exact fp32 values on every rank, and the ranks stay equal through training.
    from mixprec import amp
    from mixprec.parallel.distributed import flat_dist_call

    for dtype in (torch.float16, torch.bfloat16):
        model = _mlp(ctx.device, seed=280 + ctx.rank)
        fp32 = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0)
        # (A generator, as Apex's callers often pass, for bf16: read once, r113A G2.)
        halves = [p.data for p in model.parameters()]
        flat_dist_call(halves if dtype == torch.float16 else iter(halves), dist.broadcast, (0,))
        masters = list(amp.master_params(opt))
        _assert_same_on_all_ranks(ctx, masters, f"master after the broadcast ({dtype})")
        if ctx.rank == 0:  # (exact, not rounded to half on any rank)
            for m, w in zip(masters, fp32):
                assert torch.equal(m, w), dtype
        for step in range(3):
            x, y = _global_batch(ctx, seed=290 + step)
            opt.zero_grad()
            loss = F.mse_loss(model(_mine(ctx, x)).float(), _mine(ctx, y))
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            flat_dist_call([m.grad for m in masters], dist.all_reduce)
            opt.step()
        _assert_same_on_all_ranks(ctx, masters, f"master after three steps ({dtype})")
        _assert_same_on_all_ranks(ctx, list(model.parameters()), f"half weight ({dtype})")


def _amp_step_mse(model, opt, x, y, amp):
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    opt.step()


def _amp_steps_against_reference(ctx, ddp, opt, ref, ref_opt, seed, steps=3):
    """``steps`` amp steps of ``ddp`` on this rank's slice and of ``ref`` on the whole batch:
    the fp32 masters must then match (``_assert_masters_match_reference``)."""
    from mixprec import amp

    for step in range(steps):
        x, y = _global_batch(ctx, seed=seed + step)
        _amp_step_mse(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)
        _amp_step_mse(ref, ref_opt, x, y, amp)
    _assert_masters_match_reference(ctx, opt, ref_opt)


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        return self.head(h.mean((2, 3)))


def _images(ctx, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ctx.world_size * PER_RANK, 3, 6, 6, generator=g)
    y = torch.randint(0, 4, (ctx.world_size * PER_RANK,), generator=g)
    return x.to(ctx.device), y.to(ctx.device)


def _amp_step(model, opt, x, y, amp):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def _amp_o2_sgd_pair(model, ref, opt_level="O2", **amp_kwargs):
    """``model`` and its single-process reference ``ref``, each with SGD (momentum) through
    amp bf16 (O2 unless told): ``(model, opt, ref, ref_opt)``."""
    from mixprec import amp

    pairs = []
    for net in (model, ref):
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        pairs.extend(amp.initialize(net, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                    verbosity=0, **amp_kwargs))
    return tuple(pairs)


def _assert_masters_match_reference(ctx, opt, ref_opt):
    """The fp32 masters are bitwise the same on every rank and equal the single-process
    reference's up to bf16 rounding."""
    from mixprec import amp

    masters = list(amp.master_params(opt))
    _assert_same_on_all_ranks(ctx, masters, "fp32 master weight")
    for m, r in zip(masters, amp.master_params(ref_opt)):
        torch.testing.assert_close(m, r, rtol=0, atol=2e-3)


def check_amp_o2_ddp_masters_bitwise_identical(ctx):
    from mixprec import amp

    torch.manual_seed(0)
    model = convert_syncbn_model(_ConvNet()).to(ctx.device)
    ref = copy.deepcopy(model)
    ref.bn = nn.BatchNorm2d(8).to(ctx.device)
    ref.bn.load_state_dict(model.bn.state_dict())
    model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, ref)
    assert model.conv.weight.dtype == torch.bfloat16 and model.bn.weight.dtype == torch.float32
    ddp = DistributedDataParallel(model)
    for step in range(3):
        x, y = _images(ctx, seed=50 + step)
        _amp_step(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)
        _amp_step(ref, ref_opt, x, y, amp)
    assert all(m.dtype == torch.float32 for m in amp.master_params(opt))
    _assert_same_on_all_ranks(ctx, list(model.parameters()), "model parameter")
    _assert_same_on_all_ranks(ctx, list(model.buffers()), "model buffer")
    # And the same training as one process on the global batch, up to bf16 rounding.
    _assert_masters_match_reference(ctx, opt, ref_opt)


def check_amp_o2_ddp_checkpoint_resume_continues_bit_for_bit(ctx):
    """An Apex-style checkpoint of a DDP-wrapped O2 model (the wrapper's state_dict, keys
    prefixed "module.", with the optimizer's and amp's) taken after two steps and loaded into
    a freshly built, differently initialized wrapper continues as the uninterrupted run does,
    bit for bit on every rank: parameters, buffers (SyncBatchNorm's running statistics), fp32
    masters and amp's loss scaler. The model checkpoint holds fp32 tensors, as one process's
    does. Reference: the uninterrupted run. (r66B's replay: no check resumed through DDP)"""
    from mixprec import amp

    def build(seed):
        torch.manual_seed(seed)
        model = convert_syncbn_model(_ConvNet()).to(ctx.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                    loss_scale="dynamic", verbosity=0)
        return DistributedDataParallel(model), opt

    batches = [_images(ctx, seed=770 + i) for i in range(4)]
    ddp, opt = build(0)
    for x, y in batches[:2]:
        _amp_step(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)
    saved = copy.deepcopy({"model": ddp.state_dict(), "optimizer": opt.state_dict(),
                           "amp": amp.state_dict()})
    for x, y in batches[2:]:
        _amp_step(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)
    assert all(k.startswith("module.") for k in saved["model"]), list(saved["model"])
    assert all(t.dtype in (torch.float32, torch.int64) for t in saved["model"].values()), \
        {k: t.dtype for k, t in saved["model"].items()}
    resumed, resumed_opt = build(1)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    amp.load_state_dict(saved["amp"])
    for x, y in batches[2:]:
        _amp_step(resumed, resumed_opt, _mine(ctx, x), _mine(ctx, y), amp)
    _assert_resumed_run_matches(ctx, ddp, opt, resumed, resumed_opt)
    assert amp.state_dict(optimizer=opt)["loss_scaler0"]["unskipped"] == 4


class _ImageNetLikeNet(nn.Module):
    """Apex's ImageNet example in miniature: two conv + BatchNorm blocks, pooled, a classifier."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def _imagenet_like_batch(ctx, step):
    g = torch.Generator().manual_seed(880 + step)
    y = torch.randint(0, 5, (ctx.world_size * PER_RANK,), generator=g)
    x = torch.randn(ctx.world_size * PER_RANK, 3, 8, 8, generator=g) + y.view(-1, 1, 1, 1) * 0.3
    return (x.to(ctx.device).contiguous(memory_format=torch.channels_last), y.to(ctx.device))


def check_apex_imagenet_recipe_resumes_bit_for_bit_from_rank0s_file(ctx):
    """G1 (r85C). Apex's examples/imagenet/main_amp.py as ported scripts keep it: each rank
    seeded with its rank (torch.manual_seed(local_rank)), convert_syncbn_model, channels_last,
    SGD (momentum, weight decay) in LARC, amp O2 fp16 from argparse strings
    (keep_batchnorm_fp32="True", loss_scale="dynamic") with a raised start scale so that the
    first steps overflow and are skipped, DDP(delay_allreduce=True), the LR written into
    param_group['lr'] every iteration. Rank 0 alone torch.saves {'state_dict', 'optimizer',
    'amp'} right after a skipped step; every rank torch.loads the file (weights_only, the
    default) into a freshly built wrapper of other initial weights, in Apex's order (after
    initialize and DDP), and continues. Reference: the uninterrupted run, bit for bit on every
    rank (parameters, SyncBatchNorm running statistics, fp32 masters, momentum, loss scale);
    the file's state_dict loads strict=True into the plain fp32 model (nn.BatchNorm2d) and
    holds the masters exactly."""
    import os
    import tempfile

    from mixprec import amp

    steps, stop = 6, 2

    def build(seed):
        torch.manual_seed(seed)
        model = convert_syncbn_model(_ImageNetLikeNet()).to(ctx.device)
        model = model.to(memory_format=torch.channels_last)
        opt = LARC(torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4))
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16,
                                    keep_batchnorm_fp32="True", loss_scale="dynamic",
                                    verbosity=0)
        amp._amp_state.loss_scalers[0]._loss_scale = 2.0 ** 19
        return DistributedDataParallel(model, delay_allreduce=True), opt

    def train(ddp, opt, first, last):
        skipped = []
        ddp.train()
        for step in range(first, last):
            for group in opt.param_groups:  # Apex's per-iteration warm-up
                group["lr"] = 0.4 * (1 + step) / steps
            x, y = _imagenet_like_batch(ctx, step)
            loss = F.cross_entropy(ddp(_mine(ctx, x)), _mine(ctx, y))
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            if amp.step_was_skipped(opt):
                skipped.append(step)
        return skipped

    path = [None]
    if ctx.rank == 0:
        path[0] = os.path.join(tempfile.mkdtemp(prefix="mixprec_imagenet_"), "checkpoint.pth.tar")
    dist.broadcast_object_list(path, src=0)
    path = path[0]

    ddp, opt = build(ctx.rank)
    skipped = train(ddp, opt, 0, stop)
    assert stop - 1 in skipped, f"the step before the save was not skipped: {skipped}"
    masters_at_save = [m.detach().clone() for m in amp.master_params(opt)]
    if ctx.rank == 0:
        torch.save({"state_dict": ddp.state_dict(), "optimizer": opt.state_dict(),
                    "amp": amp.state_dict()}, path)
    dist.barrier()
    skipped += train(ddp, opt, stop, steps)
    assert len(skipped) < steps - 1, f"nearly every step skipped: {skipped}"

    resumed, resumed_opt = build(100 + ctx.rank)
    checkpoint = torch.load(path, map_location="cpu")
    resumed.load_state_dict(checkpoint["state_dict"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    train(resumed, resumed_opt, stop, steps)

    label = f"rank {ctx.rank}"
    got = dict(resumed.module.named_parameters()) | dict(resumed.module.named_buffers())
    for name, want in [*ddp.module.named_parameters(), *ddp.module.named_buffers()]:
        _same_after_resume(ctx, got[name], want, labelled(label)(f"{name} differs after the resume"))
    for i, (m, r) in enumerate(zip(amp.master_params(opt), amp.master_params(resumed_opt))):
        _same_after_resume(ctx, m, r, labelled(label)(f"master {i} differs after the resume"))
    for key, state in opt.state_dict()["state"].items():
        assert torch.equal(state["momentum_buffer"],
                           resumed_opt.state_dict()["state"][key]["momentum_buffer"]), key
    assert amp.state_dict(optimizer=resumed_opt) == amp.state_dict(optimizer=opt)
    _assert_same_on_all_ranks(ctx, [*ddp.module.parameters(), *ddp.module.buffers()],
                              "parameter/buffer (SyncBatchNorm statistics included)")

    saved = {k[len("module."):]: v for k, v in checkpoint["state_dict"].items()}
    plain = _ImageNetLikeNet()
    plain.load_state_dict(saved, strict=True)
    assert all(t.dtype in (torch.float32, torch.int64) for t in saved.values())
    for (name, _), m in zip(plain.named_parameters(), masters_at_save):
        assert torch.equal(saved[name], m), f"saved {name} is not the fp32 master"
    dist.barrier()
    if ctx.rank == 0:
        os.remove(path)
        os.rmdir(os.path.dirname(path))


def check_frozen_bn_statistics_fine_tuning_under_amp_o2_delay_allreduce(ctx):
    """G2 (r85C). The seed's fine-tuning as main_amp.py-style scripts write it under DDP:
    model.train(), then every BatchNorm put back in eval mode (statistics frozen) while its
    weight and bias still train, with convert_syncbn_model, channels_last, amp O2 bf16 and
    DDP(delay_allreduce=True). SyncBatchNorm then normalizes with its running statistics and
    its affine gradients are all-reduced like any other. Reference: one process fine-tuning
    nn.BatchNorm2d the same way (O2 bf16) on the concatenated batch: the masters within bf16
    rounding (atol 2e-3), the running statistics and batch counts bitwise unchanged, the ranks
    bitwise equal, and the BatchNorm weights did train."""
    from mixprec import amp

    torch.manual_seed(0)
    pretrained = _ImageNetLikeNet().to(ctx.device)
    with torch.no_grad():
        for bn in (pretrained.bn1, pretrained.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.num_batches_tracked.fill_(100)
    nets = []
    for net in (convert_syncbn_model(copy.deepcopy(pretrained)), copy.deepcopy(pretrained)):
        net = net.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        nets.append(amp.initialize(net, opt, opt_level="O2", dtype=torch.bfloat16,
                                   verbosity=0))
    (model, opt), (ref, ref_opt) = nets
    ddp = DistributedDataParallel(model, delay_allreduce=True)

    def freeze_statistics(net):
        net.train()
        for m in net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()

    for step in range(3):
        x, y = _imagenet_like_batch(ctx, 20 + step)
        for net, o, xs, ys in ((ddp, opt, _mine(ctx, x), _mine(ctx, y)), (ref, ref_opt, x, y)):
            freeze_statistics(net)
            o.zero_grad()
            with amp.scale_loss(F.cross_entropy(net(xs), ys), o) as scaled:
                scaled.backward()
            o.step()
    label = f"rank {ctx.rank}"
    for name in ("bn1", "bn2"):
        for buf in ("running_mean", "running_var", "num_batches_tracked"):
            got = getattr(getattr(model, name), buf)
            want = getattr(getattr(pretrained, name), buf)
            assert torch.equal(got, want), labelled(label)(f"frozen {name}.{buf} changed")
    assert not torch.equal(model.bn1.weight, pretrained.bn1.weight), "BatchNorm weight not trained"
    assert model.bn1.weight.dtype == torch.float32 and model.conv1.weight.dtype == torch.bfloat16
    _assert_same_on_all_ranks(ctx, [*model.parameters(), *amp.master_params(opt)],
                              "parameter/master")
    for m, r in zip(amp.master_params(opt), amp.master_params(ref_opt)):
        torch.testing.assert_close(m, r, rtol=0, atol=2e-3, msg=labelled(label))


def check_gan_three_losses_overflow_in_one_loss_on_one_rank_and_resume(ctx):
    """G1 (r82C). Apex's DCGAN example under DistributedDataParallel: G and D, two
    optimizers, ``num_losses=3`` (errD_real, errD_fake, errG, each its own forward and
    ``scale_loss(..., loss_id=i)``), fp16 O2 with dynamic scaling. An inf put into errD_fake on
    rank 1 only skips optD's step on every rank (optG steps) and halves scaler 1 only; an inf
    in errG on rank 0 only skips optG's step and halves scaler 2 only; the fp32 masters agree
    over the ranks after every step; and a checkpoint (the wrappers', both optimizers',
    amp.state_dict()) loaded into a freshly built run continues bit for bit. Reference: the
    uninterrupted run; the scales each scaler should hold."""
    from mixprec import amp

    def build(seed):
        torch.manual_seed(seed)
        G = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8),
                          nn.Tanh()).to(ctx.device)
        D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1),
                          nn.Sigmoid()).to(ctx.device)
        opt_d = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.5)
        opt_g = torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.5)
        [D, G], [opt_d, opt_g] = amp.initialize([D, G], [opt_d, opt_g], opt_level="O2",
                                                dtype=torch.float16, loss_scale="dynamic",
                                                num_losses=3, verbosity=0)
        for i in range(3):  # start well below overflow so that only the poisoned losses skip
            amp._amp_state.loss_scalers[i]._loss_scale = 2.0 ** 8
        return DistributedDataParallel(D), DistributedDataParallel(G), opt_d, opt_g

    def step(i, D, G, opt_d, opt_g, poison=None):
        g = torch.Generator().manual_seed(100 * i + ctx.rank)
        real = (torch.rand(4, 8, generator=g) * 2 - 1).to(ctx.device)
        noise = torch.randn(4, 4, generator=g).to(ctx.device)
        bce = nn.BCELoss()
        ones, zeros = torch.ones(4, device=ctx.device), torch.zeros(4, device=ctx.device)
        D.zero_grad()
        err_real = bce(D(real).view(-1), ones)
        with amp.scale_loss(err_real, opt_d, loss_id=0) as scaled:
            scaled.backward()
        fake = G(noise)
        err_fake = bce(D(fake.detach()).view(-1), zeros)
        if poison == ("fake", ctx.rank):
            err_fake = err_fake * float("inf")
        with amp.scale_loss(err_fake, opt_d, loss_id=1) as scaled:
            scaled.backward()
        opt_d.step()
        G.zero_grad()
        err_g = bce(D(fake).view(-1), ones)
        if poison == ("g", ctx.rank):
            err_g = err_g * float("inf")
        with amp.scale_loss(err_g, opt_g, loss_id=2) as scaled:
            scaled.backward()
        opt_g.step()

    def masters(opt_d, opt_g):
        return [m.detach().clone() for m in (*amp.master_params(opt_d), *amp.master_params(opt_g))]

    def scales(opt):
        state = amp.state_dict(optimizer=opt)
        return [state[f"loss_scaler{i}"]["loss_scale"] for i in range(3)]

    poisons = {1: ("fake", 1), 2: ("g", 0)}
    D, G, opt_d, opt_g = build(0)
    trajectory = []
    for i in range(4):
        before = masters(opt_d, opt_g)
        scales_before = scales(opt_d)
        step(i, D, G, opt_d, opt_g, poisons.get(i))
        after = masters(opt_d, opt_g)
        _assert_same_on_all_ranks(ctx, after, f"fp32 master after step {i}")
        n_d = len(list(amp.master_params(opt_d)))
        d_moved = not all(torch.equal(a, b) for a, b in zip(before[:n_d], after[:n_d]))
        g_moved = not all(torch.equal(a, b) for a, b in zip(before[n_d:], after[n_d:]))
        poisoned = poisons.get(i, (None,))[0]
        assert (d_moved, g_moved) == (poisoned != "fake", poisoned != "g"), (i, d_moved, g_moved)
        assert amp.step_was_skipped(opt_d) == (poisoned == "fake")
        assert amp.step_was_skipped(opt_g) == (poisoned == "g")
        want = list(scales_before)
        if poisoned is not None:
            want[{"fake": 1, "g": 2}[poisoned]] /= 2
        assert scales(opt_d) == want, (i, scales(opt_d), want)
        trajectory.append(after)
        if i == 1:
            saved = copy.deepcopy({"D": D.state_dict(), "G": G.state_dict(),
                                   "opt_d": opt_d.state_dict(), "opt_g": opt_g.state_dict(),
                                   "amp": amp.state_dict(optimizer=opt_d)})
    final_scales = scales(opt_d)
    D2, G2, opt_d2, opt_g2 = build(1)
    D2.load_state_dict(saved["D"])
    G2.load_state_dict(saved["G"])
    opt_d2.load_state_dict(saved["opt_d"])
    opt_g2.load_state_dict(saved["opt_g"])
    amp.load_state_dict(saved["amp"], optimizer=opt_d2)
    for i in range(2, 4):
        step(i, D2, G2, opt_d2, opt_g2, poisons.get(i))
        for k, (got, want) in enumerate(zip(masters(opt_d2, opt_g2), trajectory[i])):
            _same_after_resume(ctx, got, want, f"rank {ctx.rank}: resumed step {i}, master {k}")
    assert scales(opt_d2) == final_scales


def check_amp_o2_ddp_dcp_checkpoint_resume_continues_bit_for_bit(ctx):
    """G (r78B). The same resume through torch.distributed.checkpoint, as a DCP user writes it
    across ranks: the model by dcp.save/dcp.load of get_model_state_dict(ddp) (then
    set_model_state_dict) and, second route, of ddp.state_dict() (then ddp.load_state_dict);
    optimizer and amp state by torch.save's format. Continues bit for bit on every rank."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from mixprec import amp

    def build(seed):
        torch.manual_seed(seed)
        model = _mlp(ctx.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                    verbosity=0)
        return DistributedDataParallel(model), opt

    def steps(ddp, opt, seeds):
        for seed in seeds:
            x, y = _global_batch(ctx, seed=seed)
            _amp_step_mse(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)

    full, full_opt = build(0)
    steps(full, full_opt, [900, 901, 902, 903])
    where = [tempfile.mkdtemp(prefix="mixprec_dcp_") if ctx.rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    for route in ("get_model_state_dict", "state_dict"):
        ddp, opt = build(0)
        steps(ddp, opt, [900, 901])
        path = f"{where[0]}/{route}"
        msd = get_model_state_dict(ddp) if route == "get_model_state_dict" else ddp.state_dict()
        dcp.save({"model": msd}, checkpoint_id=path)
        others = copy.deepcopy({"optimizer": opt.state_dict(), "amp": amp.state_dict()})
        resumed, resumed_opt = build(1)
        target = (get_model_state_dict(resumed) if route == "get_model_state_dict"
                  else resumed.state_dict())
        dcp.load({"model": target}, checkpoint_id=path)
        if route == "get_model_state_dict":
            set_model_state_dict(resumed, target)
        else:
            resumed.load_state_dict(target)
        resumed_opt.load_state_dict(others["optimizer"])
        amp.load_state_dict(others["amp"])
        steps(resumed, resumed_opt, [902, 903])
        for i, (m, r) in enumerate(zip(amp.master_params(full_opt),
                                       amp.master_params(resumed_opt))):
            _same_after_resume(ctx, m, r, f"rank {ctx.rank} {route}: master {i}")
        for (name, want), got in zip(full.module.named_parameters(), resumed.module.parameters()):
            _same_after_resume(ctx, got, want, f"rank {ctx.rank} {route}: {name}")


def check_ddp_of_a_compiled_amp_model_trains_as_eager(ctx):
    """G (r78B). The other order a user writes: amp.initialize, torch.compile(model), then
    DistributedDataParallel around the compiled module (tests compile the wrapper only). At O1
    and O2 it trains as the eager wrapper: masters bit for bit on the CPU (aot_eager), within
    bf16 rounding on CUDA (inductor); the ranks agree."""
    from mixprec import amp

    backend = "inductor" if ctx.is_cuda else "aot_eager"
    # (On more than 2 ranks the compiled module's buckets differ from the eager one's: see
    # _BUCKET_ORDER_ATOL.)
    tol = dict(rtol=0, atol=2e-3) if ctx.is_cuda else dict(
        rtol=0, atol=_BUCKET_ORDER_ATOL(ctx, 0.0))
    for opt_level in ("O1", "O2"):
        runs = []
        for compiled in (False, True):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = _mlp(ctx.device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                        verbosity=0)
            net = DistributedDataParallel(
                torch.compile(model, backend=backend) if compiled else model)
            for seed in (910, 911, 912):
                x, y = _global_batch(ctx, seed=seed)
                _amp_step_mse(net, opt, _mine(ctx, x), _mine(ctx, y), amp)
            masters = [m.detach().clone() for m in amp.master_params(opt)]
            _assert_same_on_all_ranks(ctx, masters, f"{opt_level} masters (compiled={compiled})")
            runs.append(masters)
        for i, (got, want) in enumerate(zip(*runs)):
            torch.testing.assert_close(got, want, **tol,
                                       msg=labelled(f"{opt_level} compiled vs eager, master {i}"))


def check_amp_o2_apex_accumulation_with_every_micro_batch_all_reduced(ctx):
    """G (r78B). Apex's documented accumulation as ported scripts keep it: delay_unscale=True
    on all micro-batches but the last, no no_sync() (Apex's DDP all-reduced every backward),
    at O2 with a static and a dynamic scale. Each backward all-reduces the held, scaled half
    gradients; the sum must still be the global batch's accumulated gradient. Reference: one
    process on the global micro-batches (the existing checks run this recipe inside
    no_sync() only, or with delay_unscale=False at O1)."""
    from mixprec import amp

    for loss_scale in (64.0, "dynamic"):
        model = _mlp(ctx.device)
        model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model), "O2",
                                                    loss_scale=loss_scale)
        ddp = DistributedDataParallel(model, message_size=64)
        for step in range(2):
            _accumulation_step(ctx, ddp, opt, ref, ref_opt, 190 + 3 * step,
                               delay_unscale=True, synced=True)
        masters = list(amp.master_params(opt))
        _assert_same_on_all_ranks(ctx, masters, f"O2 {loss_scale} weight")
        for m, r in zip(masters, amp.master_params(ref_opt)):
            torch.testing.assert_close(m, r, rtol=0, atol=2e-3)


class _PoolBranchNet(nn.Module):
    """A DeepLab-style head in miniature: a conv path with BatchNorm and a global-pooling
    branch whose BatchNorm sees one value per channel and image, upsampled back."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(6)
        self.pool_conv = nn.Conv2d(6, 4, 1, bias=False)
        self.pool_bn = nn.BatchNorm2d(4)
        self.cls = nn.Conv2d(10, 3, 1)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        p = F.relu(self.pool_bn(self.pool_conv(F.adaptive_avg_pool2d(h, 1))))
        p = F.interpolate(p, size=h.shape[-2:], mode="bilinear", align_corners=False)
        return self.cls(torch.cat([h, p], 1))


def _seg_batch(ctx, seed, per_rank):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ctx.world_size * per_rank, 3, 6, 6, generator=g)
    y = torch.randint(0, 3, (ctx.world_size * per_rank, 6, 6), generator=g)
    y[torch.rand(y.shape, generator=g) < 0.2] = 255
    return x.to(ctx.device), y.to(ctx.device)


def _per_rank_mean_loss(ctx, out, y, per_rank):
    """What DDP's average of per-rank losses optimises, computed on the whole batch: each
    rank's share's own mean over its non-ignored pixels, averaged over the ranks."""
    return sum(F.cross_entropy(out[r * per_rank:(r + 1) * per_rank].float(),
                               y[r * per_rank:(r + 1) * per_rank], ignore_index=255)
               for r in range(ctx.world_size)) / ctx.world_size


def check_syncbn_pool_branch_with_one_image_per_rank_matches_batchnorm(ctx):
    """The classic SyncBatchNorm use: one image per rank, so the global-pooling branch's
    BatchNorm holds one value per channel on each rank (nn.BatchNorm2d would raise). Through
    convert_syncbn_model + DDP, three fp32 SGD steps of a segmentation loss with ignored
    pixels train as one process with nn.BatchNorm2d on the concatenated batch (loss: the
    mean of the per-rank losses): parameters and running statistics (unbiased over the
    group's two values) at _tol, and bitwise the same on every rank. (r73B's replay.)"""
    torch.manual_seed(0)
    ref = _PoolBranchNet().to(ctx.device)
    model = convert_syncbn_model(copy.deepcopy(ref))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    try:  # (the reference layer refuses the one-image batch the SyncBatchNorm takes)
        copy.deepcopy(ref).train()(_seg_batch(ctx, 400, 1)[0][:1])
    except ValueError as err:
        assert "more than 1 value per channel" in str(err), err
    else:
        raise AssertionError("nn.BatchNorm2d took a one-image batch in its pooling branch")
    for step in range(3):
        x, y = _seg_batch(ctx, 401 + step, 1)
        opt.zero_grad()
        F.cross_entropy(ddp(_mine(ctx, x, 1)), _mine(ctx, y, 1), ignore_index=255).backward()
        opt.step()
        ref_opt.zero_grad()
        _per_rank_mean_loss(ctx, ref(x), y, 1).backward()
        ref_opt.step()
    got = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, want in [*ref.named_parameters(), *ref.named_buffers()]:
        torch.testing.assert_close(got[name], want, **_tol(ctx),
                                   msg=labelled(f"rank {ctx.rank}: {name}"))
    _assert_same_on_all_ranks(ctx, [*model.parameters(), *model.buffers()], "parameter/buffer")


def check_frozen_syncbn_fine_tuning_under_amp_o2_ddp(ctx):
    """The seed's fine-tuning under SyncBatchNorm: every converted BatchNorm frozen (eval mode,
    requires_grad False, left out of the optimizer) while the rest trains at amp O2 (fp16
    with a static scale, and bf16) under DDP in its default mode. The frozen layers stay fp32
    and bitwise unchanged (weights, biases, running statistics, batch count), the ranks
    agree bitwise, and the masters match one process fine-tuning nn.BatchNorm2d frozen the
    same way on the concatenated batch, up to half rounding. (r73B's replay.)"""
    from mixprec import amp

    for dtype, scale in ((torch.float16, 128.0), (torch.bfloat16, None)):
        torch.manual_seed(0)
        pretrained = _PoolBranchNet().to(ctx.device)
        with torch.no_grad():  # "pretrained" statistics, not the defaults
            for bn in (pretrained.bn, pretrained.pool_bn):
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.uniform_(0.5, 1.5)
                bn.num_batches_tracked.fill_(100)
        frozen_before = copy.deepcopy(pretrained)
        nets = []
        for net in (convert_syncbn_model(copy.deepcopy(pretrained)), copy.deepcopy(pretrained)):
            for m in net.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.requires_grad_(False)
            opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.05,
                                  momentum=0.9, weight_decay=1e-4)
            nets.append(amp.initialize(net, opt, opt_level="O2", dtype=dtype, verbosity=0,
                                       loss_scale=scale))
        (model, opt), (ref, ref_opt) = nets
        ddp = DistributedDataParallel(model)

        def freeze_bn(net):
            net.train()
            for m in net.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()

        for step in range(3):
            x, y = _seg_batch(ctx, 420 + step, 2)
            freeze_bn(ddp)
            freeze_bn(ref)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(_mine(ctx, x, 2)), _mine(ctx, y, 2), ignore_index=255)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            ref_opt.zero_grad()
            with amp.scale_loss(_per_rank_mean_loss(ctx, ref(x), y, 2), ref_opt) as scaled:
                scaled.backward()
            ref_opt.step()
            assert not amp.step_was_skipped(opt), f"{dtype} step {step} skipped"
        label = f"rank {ctx.rank} {dtype}"
        for name, want in frozen_before.state_dict().items():
            if name.startswith(("bn.", "pool_bn.")):
                got = model.state_dict()[name]
                assert got.dtype == want.dtype and torch.equal(got, want), \
                    labelled(f"{label}: frozen {name} changed")(name)
        assert model.conv.weight.dtype == dtype and model.bn.weight.dtype == torch.float32
        assert any(not torch.equal(model.state_dict()[k], v) for k, v in
                   frozen_before.state_dict().items() if k.startswith("conv.")), "no step taken"
        _assert_masters_match_reference(ctx, opt, ref_opt)
        _assert_same_on_all_ranks(ctx, [*model.parameters(), *model.buffers()], label)


def check_amp_o2_under_torch_ddp(ctx):
    # mixprec.amp with PyTorch's own DDP (not ours): half gradients all-reduced by it, then
    # unscaled into the masters; the same training as one process on the global batch.

    model = _mlp(ctx.device)
    model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model))
    ddp = nn.parallel.DistributedDataParallel(model)
    _amp_steps_against_reference(ctx, ddp, opt, ref, ref_opt, seed=90)


def check_amp_o2_accumulation_with_no_sync(ctx):
    # Apex's gradient-accumulation recipe at O2 under DDP: micro-batches under no_sync() with
    # delay_unscale=True, the last one all-reduced and unscaled into the masters; two optimizer
    # steps (the second starts from the gradients amp released after the first). Reference:
    # the same accumulation in one process on the global micro-batches.
    model = _mlp(ctx.device)
    model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model), loss_scale=64.0)
    ddp = DistributedDataParallel(model, message_size=64)
    for step in range(2):
        _accumulation_step(ctx, ddp, opt, ref, ref_opt, 110 + 3 * step, delay_unscale=True)
    _assert_masters_match_reference(ctx, opt, ref_opt)


def _accumulation_step(ctx, ddp, opt, ref, ref_opt, seed, delay_unscale, zero_grad=None,
                       synced=False):
    """One optimizer step over three micro-batches, each in scale_loss: ``ref`` in one process
    on the global micro-batches, ``ddp`` on this rank's shares with the first two inside
    ``no_sync()`` (unless ``synced``: every one all-reduced) (and ``delay_unscale`` there, if
    asked). ``zero_grad``: default ``opt.zero_grad``."""
    from mixprec import amp

    (zero_grad or opt.zero_grad)()
    ref_opt.zero_grad()
    for micro in range(3):
        x, y = _global_batch(ctx, seed=seed + micro)
        last = micro == 2
        delay = delay_unscale and not last
        with amp.scale_loss(F.mse_loss(ref(x).float(), y), ref_opt, delay_unscale=delay) as s:
            s.backward()
        with contextlib.nullcontext() if last or synced else ddp.no_sync():
            loss = F.mse_loss(ddp(_mine(ctx, x)).float(), _mine(ctx, y))
            with amp.scale_loss(loss, opt, delay_unscale=delay) as s:
                s.backward()
    opt.step()
    ref_opt.step()


class _Branchy(nn.Module):
    """A trunk, and a branch ``c`` used only when asked (a window's micro-batch, say)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.c = nn.Linear(8, 4)

    def forward(self, x, use_c=False):
        return self.a(x) + self.c(x) if use_c else self.a(x)


def check_amp_o2_dropped_window_under_torch_ddp_with_unused_parameters(ctx):
    # A no_sync() window (delay_unscale=True) that used branch c, dropped at an epoch's end
    # with zero_grad(set_to_none=False) (the optimizer's, then the model's), then a synced
    # step without c: PyTorch's reducer, which saw c used in the window, needs its gradient
    # to be a tensor ("Encountered gradient which is undefined"). The step's gradients are
    # the synced batch's alone. Reference: one process on the global batch.
    from mixprec import amp

    torch.manual_seed(0)
    base = _Branchy().to(ctx.device)
    model, opt, ref, ref_opt = _amp_o2_sgd_pair(copy.deepcopy(base), copy.deepcopy(base),
                                                loss_scale=64.0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    for step, drop in enumerate((opt.zero_grad, model.zero_grad)):
        x, y = _global_batch(ctx, seed=300 + step)
        with ddp.no_sync():
            loss = F.mse_loss(ddp(_mine(ctx, x), use_c=True).float(), _mine(ctx, y))
            with amp.scale_loss(loss, opt, delay_unscale=True) as s:
                s.backward()
        drop(set_to_none=False)
        ref_opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(ddp(_mine(ctx, x)).float(), _mine(ctx, y))
        with amp.scale_loss(loss, opt) as s:
            s.backward()
        opt.step()
        with amp.scale_loss(F.mse_loss(ref(x).float(), y), ref_opt) as s:
            s.backward()
        ref_opt.step()
    _assert_masters_match_reference(ctx, opt, ref_opt)


class _AuxHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.aux = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_aux=True):
        h = self.body(x)
        return self.aux(h) if use_aux else h


def check_unheld_gradient_warning_under_torch_ddp_bucket_views(ctx):
    # r95A B2. amp's look for gradients no optimizer holds (scale_loss's unheld-gradient
    # warning) first compared gradient versions: under PyTorch's DDP with
    # gradient_as_bucket_view=True a stale gradient of a layer off this loss's path, in no
    # optimizer, is a view into the bucket, and the all-reduce of its neighbours bumped its
    # version, so rank 0 warned about it. It watches with hooks now: quiet there, and it still
    # warns, on rank 0 only, when the layer is on the path.
    from mixprec import amp

    for opt_level, on_path in itertools.product(("O1", "O2"), (False, True)):
        torch.manual_seed(0)
        model = _AuxHead().to(ctx.device)
        x = _mine(ctx, _global_batch(ctx, seed=7)[0])
        model(x).sum().backward()  # (stale gradients from a plain warm-up, before)
        model.body.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(model.body.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level=opt_level, loss_scale=128.0,
                                    verbosity=0)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, find_unused_parameters=True, gradient_as_bucket_view=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                with amp.scale_loss(ddp(x, use_aux=on_path).float().square().mean(),
                                    opt) as scaled:
                    scaled.backward()
                opt.step()
                opt.zero_grad()
        ours = [str(w.message) for w in caught
                if "no optimizer given to amp.initialize holds" in str(w.message)]
        want = 1 if on_path and ctx.rank == 0 else 0
        assert len(ours) == want, f"rank {ctx.rank} {opt_level} on_path={on_path}: {ours}"
        if want:
            assert "holds: aux.weight, aux.bias." in ours[0], ours[0]


def check_amp_accumulation_under_torch_ddp_no_sync_needs_no_delay_unscale(ctx):
    # B (r90D R1). PyTorch's own DDP's no_sync() with amp's plain scale_loss (no
    # delay_unscale), at O1 and O2: amp unscaled each micro-batch into the masters (O2) or set
    # it aside for the next backward (O1), so the synced backward all-reduced the last
    # micro-batch alone and each rank kept its own earlier ones: the masters differed between
    # the ranks by 5e-2 after one step, with no error (torch.autocast + GradScaler stays in
    # step there). amp now reads PyTorch's DDP's no_sync() as it reads mixprec's, and the
    # explicit delay_unscale=True route gives the same. Reference: one process on the global
    # micro-batches (bf16 rounding), and the masters bitwise equal on every rank.
    for opt_level in ("O1", "O2"):
        for delay_unscale in (False, True):
            _torch_ddp_accumulation_against_reference(ctx, opt_level, delay_unscale)


def _torch_ddp_accumulation_against_reference(ctx, opt_level, delay_unscale, hook=None,
                                              **ddp_kwargs):
    """Two accumulation steps (three micro-batches, the first two inside ``no_sync()``) of an
    amp bf16 MLP at ``opt_level`` under PyTorch's DDP built with ``ddp_kwargs`` (and the
    communication ``hook``), against one process on the global micro-batches."""
    model = _mlp(ctx.device)
    model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model),
                                                opt_level=opt_level, loss_scale=64.0)
    ddp = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    for step in range(2):
        _accumulation_step(ctx, ddp, opt, ref, ref_opt, 130 + 3 * step,
                           delay_unscale=delay_unscale)
    _assert_masters_match_reference(ctx, opt, ref_opt)


def check_amp_forward_outside_torch_ddp_after_no_sync_unscales(ctx):
    # The record that PyTorch's DDP's no_sync() left on the model (keep this backward's
    # gradients scaled for the synced one) holds for the next forward only: a forward of the
    # bare model afterwards (the window dropped, an evaluation loss backpropagated through
    # the model itself, one rank's extra batch) unscales into the masters as usual.
    # Reference: the same step on a model never wrapped, bit for bit. (PyTorch's DDP
    # broadcasts rank 0's half weights into the model at construction, an in-place write amp
    # takes into the masters, rounded to half: the reference's half weights are written in
    # place too.)
    from mixprec import amp

    model = _mlp(ctx.device)
    model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model), loss_scale=64.0)
    ddp = nn.parallel.DistributedDataParallel(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.clone())
    x, y = _global_batch(ctx, seed=150)
    with ddp.no_sync():
        ddp(_mine(ctx, x))  # (a forward whose backward never comes)
    _amp_step_mse(model, opt, x, y, amp)
    _amp_step_mse(ref, ref_opt, x, y, amp)
    for m, r in zip(amp.master_params(opt), amp.master_params(ref_opt)):
        torch.testing.assert_close(m, r, rtol=0, atol=0)


def check_amp_o2_resume_under_torch_ddp_loaded_after_wrapping_continues_bit_for_bit(ctx):
    # G (r90D). docs/amp.md: with PyTorch's own DDP, whose broadcast at construction writes
    # the half model in place, load the checkpoint after wrapping (ddp.module.load_state_dict).
    # The broadcast's write, still pending when the load comes, must not be taken into the
    # loaded masters. Reference: the uninterrupted run, bit for bit on 2 ranks
    # (_same_after_resume), masters and amp's scaler included.
    from mixprec import amp

    def build(seed):
        torch.manual_seed(seed)
        model = _ConvNet().to(ctx.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                    loss_scale="dynamic", verbosity=0)
        return nn.parallel.DistributedDataParallel(model), opt

    batches = [_images(ctx, seed=790 + i) for i in range(4)]
    ddp, opt = build(0)
    for x, y in batches[:2]:
        _amp_step(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)
    saved = copy.deepcopy({"model": ddp.module.state_dict(), "optimizer": opt.state_dict(),
                           "amp": amp.state_dict(optimizer=opt)})
    for x, y in batches[2:]:
        _amp_step(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)
    resumed, resumed_opt = build(1 + ctx.rank)  # (initialized differently on every rank)
    resumed.module.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    amp.load_state_dict(saved["amp"], optimizer=resumed_opt)
    for x, y in batches[2:]:
        _amp_step(resumed, resumed_opt, _mine(ctx, x), _mine(ctx, y), amp)
    _assert_resumed_run_matches(ctx, ddp, opt, resumed, resumed_opt)


class _CheckpointedOuter(nn.Module):
    """An outer module holding the amp model, which its forward runs under activation
    checkpointing (the recompute of the amp model's forward comes during the backward,
    outside DDP's forward)."""

    def __init__(self, net, reentrant):
        super().__init__()
        self.net, self.reentrant = net, reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        if self.reentrant:  # (a reentrant checkpoint needs an input that requires grad)
            x = x.detach().requires_grad_(True)
        return checkpoint(self.net, x, use_reentrant=self.reentrant)


def _torch_ddp_steps_match_reference(ctx, checkpoints, step):
    """At O1 and at O2: an amp bf16 MLP (``_mlp``) under PyTorch's DDP, inside activation
    checkpoints (``_CheckpointedOuter``, one per entry of ``checkpoints``, whether reentrant,
    innermost first), two optimizer steps of ``step(ddp, opt, ref, ref_opt, seed)``; the
    fp32 masters bitwise equal on every rank and equal to one process's on the global
    micro-batches (bf16 rounding)."""
    for opt_level in ("O1", "O2"):
        model = _mlp(ctx.device)
        model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model),
                                                    opt_level=opt_level, loss_scale=64.0)
        wrapped = model
        for reentrant in checkpoints:
            wrapped = _CheckpointedOuter(wrapped, reentrant)
        ddp = nn.parallel.DistributedDataParallel(wrapped)
        for n in range(2):
            step(ddp, opt, ref, ref_opt, 130 + 3 * n)
        _assert_masters_match_reference(ctx, opt, ref_opt)


def _plain_accumulation(ctx):
    """``_accumulation_step`` without delay_unscale, as a step of
    ``_torch_ddp_steps_match_reference``."""
    return functools.partial(_accumulation_step, ctx, delay_unscale=False)


def check_amp_accumulation_under_torch_ddp_no_sync_through_activation_checkpointing(ctx):
    # B (r90E B1). PyTorch's DDP over a module that runs the amp model under activation
    # checkpointing, accumulating with no_sync() and plain scale_loss (no delay_unscale): the
    # recompute of amp's forward during the backward ran outside any DDP and cleared the
    # record the no_sync() forward had left (non-reentrant), or the forward, under no_grad
    # (reentrant), left none: each rank's micro-batches were unscaled into the masters (O2)
    # or set aside (O1) and never all-reduced, 6e-2 between the ranks after two steps, with
    # no error. Reference: one process on the global micro-batches (bf16 rounding), and the
    # masters bitwise equal on every rank.
    for reentrant in (False, True):
        _torch_ddp_steps_match_reference(ctx, (reentrant,), _plain_accumulation(ctx))


def check_amp_model_in_another_thread_is_not_read_as_inside_torch_ddp_no_sync(ctx):
    # B (r90E B2). PyTorch's DDP marks itself active for the whole process
    # (DistributedDataParallel._active_ddp_module), not for its thread: an unrelated amp
    # model (its own initialize, never wrapped) trained in the main thread while another
    # thread's DDP forward ran inside no_sync() had its gradients held scaled, and its step
    # was refused with "a backward under DistributedDataParallel's no_sync()". Reference: the
    # same step of a copy with no DDP forward running, bit for bit.
    import threading

    from mixprec import amp

    started, go = threading.Event(), threading.Event()

    class Blocking(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            started.set()
            go.wait(30)
            return self.net(x)

    a = _mlp(ctx.device)
    a_opt = torch.optim.SGD(a.parameters(), lr=0.05)
    a, a_opt = amp.initialize(a, a_opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    ddp = nn.parallel.DistributedDataParallel(Blocking(a))
    b = _mlp(ctx.device, seed=5)
    b, b_opt, ref, ref_opt = _amp_o2_sgd_pair(b, copy.deepcopy(b), loss_scale=64.0)
    x, y = _global_batch(ctx, seed=9)

    def other_thread():
        with ddp.no_sync():
            ddp(_mine(ctx, x))

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert started.wait(30)
        with amp.scale_loss(F.mse_loss(b(x).float(), y), b_opt) as scaled:
            scaled.backward()
    finally:
        go.set()
        thread.join()
    b_opt.step()
    _amp_step_mse(ref, ref_opt, x, y, amp)
    for m, r in zip(amp.master_params(b_opt), amp.master_params(ref_opt)):
        torch.testing.assert_close(m, r, rtol=0, atol=0)


def check_amp_torch_ddp_join_uneven_no_sync_windows_match_delay_unscale(ctx):
    # G (r90E G1). ddp.join() with uneven inputs (rank 0 two accumulation windows, rank 1
    # one), micro-batches inside PyTorch's DDP's no_sync(): amp's automatic route (no
    # delay_unscale) gives bit for bit what the explicit delay_unscale=True route gives, at
    # O1 and O2, and join's broadcast leaves the same model on every rank. (At O2 a rank that
    # joined early takes the broadcast half weights into its masters at its next step.)
    from mixprec import amp

    for opt_level in ("O1", "O2"):
        got = {}
        for delay in (False, True):
            model = _mlp(ctx.device)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                        verbosity=0, loss_scale=64.0)
            ddp = nn.parallel.DistributedDataParallel(model)
            with ddp.join():
                for step in range(2 if ctx.rank == 0 else 1):
                    opt.zero_grad()
                    for micro in range(3):
                        x, y = _global_batch(ctx, seed=800 + 3 * step + micro)
                        last = micro == 2
                        with contextlib.nullcontext() if last else ddp.no_sync():
                            loss = F.mse_loss(ddp(_mine(ctx, x)).float(), _mine(ctx, y))
                            with amp.scale_loss(loss, opt,
                                                delay_unscale=delay and not last) as s:
                                s.backward()
                    opt.step()
            got[delay] = [m.detach().clone() for m in amp.master_params(opt)]
            _assert_same_on_all_ranks(ctx, list(model.parameters()), f"{opt_level} parameter")
        for i, (a, b) in enumerate(zip(got[False], got[True])):
            assert torch.equal(a, b), f"{opt_level} master {i}: {(a - b).abs().max()}"


def check_amp_accumulation_under_torch_ddp_options_needs_no_delay_unscale(ctx):
    # G (r90E G2). The automatic no_sync() route under PyTorch's DDP built with
    # find_unused_parameters, gradient_as_bucket_view (the gradients held scaled are views
    # of the buckets), broadcast_buffers=False, or an fp16_compress_hook (the scaled sum
    # compressed to fp16 for the all-reduce). Reference: one process on the global
    # micro-batches (bf16 rounding), the masters bitwise equal on every rank.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    for kwargs in (dict(find_unused_parameters=True), dict(gradient_as_bucket_view=True),
                   dict(broadcast_buffers=False), dict(hook=default_hooks.fp16_compress_hook)):
        for opt_level in ("O1", "O2"):
            _torch_ddp_accumulation_against_reference(ctx, opt_level, False, **kwargs)


def check_amp_compiled_torch_ddp_no_sync_with_delay_unscale(ctx):
    # G (r90E G3). docs/parallel.md: a model compiled inside PyTorch's DDP
    # (torch.compile(ddp)) is not seen by amp's no_sync() reading; delay_unscale=True on the
    # blocks inside no_sync() is the route. That route trains as one process on the global
    # micro-batches (bf16 rounding), the masters bitwise equal on every rank. (aot_eager:
    # Dynamo's tracing of amp's forward, no C++ compiler.)
    model = _mlp(ctx.device)
    model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model), loss_scale=64.0)
    ddp = torch.compile(nn.parallel.DistributedDataParallel(model), backend="aot_eager")
    for step in range(2):
        _accumulation_step(ctx, ddp, opt, ref, ref_opt, 130 + 3 * step, delay_unscale=True)
    _assert_masters_match_reference(ctx, opt, ref_opt)


def check_amp_two_loss_ids_inside_torch_ddp_no_sync(ctx):
    # G (r90E G4). num_losses=2 with the two dynamic scalers at different scales (1024, 8),
    # a backward of each loss_id per micro-batch, the first two micro-batches inside PyTorch's
    # DDP's no_sync() and no delay_unscale: the held gradients are rescaled between the two
    # scales and all-reduced by the synced micro-batch. Reference: one process on the global
    # micro-batches (bf16 rounding), the masters bitwise equal on every rank.
    from mixprec import amp

    for opt_level in ("O1", "O2"):
        built = []
        for net in (_mlp(ctx.device), _mlp(ctx.device)):
            opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
            net, opt = amp.initialize(net, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                      verbosity=0, num_losses=2, loss_scale="dynamic")
            state = amp.state_dict(optimizer=opt)
            state["loss_scaler0"]["loss_scale"] = 1024.0
            state["loss_scaler1"]["loss_scale"] = 8.0
            amp.load_state_dict(state, optimizer=opt)
            built += [net, opt]
        model, opt, ref, ref_opt = built
        ddp = nn.parallel.DistributedDataParallel(model)
        for step in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            for micro in range(3):
                x, y = _global_batch(ctx, seed=500 + 3 * step + micro)
                for loss_id in range(2):
                    loss = F.mse_loss(ref(x).float(), y) * (loss_id + 1)
                    with amp.scale_loss(loss, ref_opt, loss_id=loss_id) as s:
                        s.backward()
                with contextlib.nullcontext() if micro == 2 else ddp.no_sync():
                    for loss_id in range(2):
                        loss = F.mse_loss(ddp(_mine(ctx, x)).float(), _mine(ctx, y))
                        with amp.scale_loss(loss * (loss_id + 1), opt, loss_id=loss_id) as s:
                            s.backward()
            opt.step()
            ref_opt.step()
        _assert_masters_match_reference(ctx, opt, ref_opt)


def _accumulation_step_with_evaluation(ctx, ddp, opt, ref, ref_opt, seed, where="after"):
    """_accumulation_step (no delay_unscale) with an evaluation forward under no_grad through
    the DDP, outside no_sync(), after each micro-batch's backward (``where="after"``) or
    between its forward and its backward (``"mid"``)."""
    from mixprec import amp

    opt.zero_grad()
    ref_opt.zero_grad()
    for micro in range(3):
        x, y = _global_batch(ctx, seed=seed + micro)
        window = contextlib.nullcontext if micro == 2 else ddp.no_sync
        with amp.scale_loss(F.mse_loss(ref(x).float(), y), ref_opt) as s:
            s.backward()
        with window():
            loss = F.mse_loss(ddp(_mine(ctx, x)).float(), _mine(ctx, y))
        if where == "mid":
            with torch.no_grad():
                ddp(_mine(ctx, x))
        with window():
            with amp.scale_loss(loss, opt) as s:
                s.backward()
        if where == "after":
            with torch.no_grad():
                ddp(_mine(ctx, x))
    opt.step()
    ref_opt.step()


def _check_accumulation_with_evaluation(ctx, where):
    # (The amp model bare or under activation checkpointing, reentrant or not; O1 and O2.
    # Reference: one process on the global micro-batches (bf16 rounding), the masters bitwise
    # equal on every rank.)
    for checkpoints in ((), (False,), (True,)):
        _torch_ddp_steps_match_reference(
            ctx, checkpoints,
            functools.partial(_accumulation_step_with_evaluation, ctx, where=where))


def check_amp_torch_ddp_no_grad_evaluation_between_micro_batches(ctx):
    # G (r90F G1). An evaluation forward under no_grad through PyTorch's DDP after each
    # micro-batch's backward (outside no_sync()): the evaluation's record leaves the next
    # no_sync() micro-batch's alone.
    _check_accumulation_with_evaluation(ctx, "after")


def check_amp_torch_ddp_no_grad_evaluation_between_forward_and_backward(ctx):
    # B (r90F B2). An evaluation forward under no_grad through PyTorch's DDP (outside
    # no_sync()) between a no_sync() micro-batch's forward and its backward (inside
    # no_sync()): with the amp model under activation checkpointing, the recompute during the
    # backward took up the evaluation's record (synced) in place of the micro-batch's, which
    # was unscaled (O2) or set aside (O1) and never all-reduced, the ranks apart with no
    # error. scale_loss now also asks the DDP whether its backward all-reduces.
    _check_accumulation_with_evaluation(ctx, "mid")


def check_amp_torch_ddp_no_sync_through_nested_activation_checkpoints(ctx):
    # B (r90F B1). Nested activation checkpoints around the amp model inside PyTorch's DDP,
    # no_sync() accumulation with plain scale_loss: with a reentrant inner checkpoint, the
    # outer one's recompute ran the inner's forward under no_grad during the backward, which
    # took up (and dropped) the no_sync() forward's record, so the inner recompute found none
    # and the previous step's record held: micro-batches unscaled (O2) or set aside (O1) and
    # never all-reduced, the ranks' masters apart with no error. Reference: one process on
    # the global micro-batches (bf16 rounding), the masters bitwise equal on every rank.
    for outer, inner in ((True, True), (False, True), (True, False), (False, False)):
        _torch_ddp_steps_match_reference(ctx, (inner, outer), _plain_accumulation(ctx))


def _synced_forwards_step(ctx, ddp, opt, ref, ref_opt, seed, inside, evaluates=None):
    """One optimizer step of three micro-batches, each forward outside no_sync() (PyTorch
    all-reduces every one: it decides in the forward), the backwards of the micro-batches
    ``inside`` names inside no_sync(), and an evaluation under no_grad through the DDP between
    the first micro-batch's forward and its backward on the ranks ``evaluates`` names.
    ``ref`` in one process on the global micro-batches."""
    from mixprec import amp

    opt.zero_grad()
    ref_opt.zero_grad()
    for micro in range(3):
        x, y = _global_batch(ctx, seed=seed + micro)
        with amp.scale_loss(F.mse_loss(ref(x).float(), y), ref_opt) as s:
            s.backward()
        loss = F.mse_loss(ddp(_mine(ctx, x)).float(), _mine(ctx, y))
        if micro == 0 and evaluates is not None and evaluates(ctx.rank):
            with torch.no_grad():
                ddp(_mine(ctx, x))
        with ddp.no_sync() if micro in inside else contextlib.nullcontext():
            with amp.scale_loss(loss, opt) as s:
                s.backward()
    opt.step()
    ref_opt.step()


def check_amp_torch_ddp_synced_forward_with_its_backward_inside_no_sync_unscales(ctx):
    # PyTorch's DDP decides the all-reduce in the forward: a forward outside no_sync() whose
    # backward runs inside it is all-reduced, and amp unscales it as any synced micro-batch
    # (scale_loss's look at the DDP's no_sync() counts only after a forward without the
    # all-reduce), so a step right after it runs. Reference: one process on the global
    # micro-batches, every one all-reduced.
    _torch_ddp_steps_match_reference(
        ctx, (), functools.partial(_synced_forwards_step, ctx, inside=(0, 1, 2)))


def check_amp_torch_ddp_evaluation_on_one_rank_inside_a_synced_micro_batch(ctx):
    # B (r91A B1). A forward outside no_sync() is all-reduced by PyTorch's DDP even when its
    # backward runs inside no_sync(). An evaluation under no_grad through the DDP between
    # them (a metric, a sample logged) on rank 0 only made scale_loss's first backward-time
    # look (no_sync() and require_forward_param_sync False) hold rank 0's gradients scaled while
    # rank 1 unscaled its own: the next synced backward all-reduced rank 0's already
    # averaged gradients with nothing on rank 1, the masters 3e-2 apart between the ranks
    # with no error. (With the evaluation on every rank the held gradients are averaged
    # again, a no-op: that one trains right, and is checked too.) Reference: one process on
    # the global micro-batches (bf16 rounding), the masters bitwise equal on every rank.
    for evaluates in (lambda rank: True, lambda rank: rank == 0):
        _torch_ddp_steps_match_reference(
            ctx, (), functools.partial(_synced_forwards_step, ctx, inside=(0, 1),
                                       evaluates=evaluates))


def _forward_inside_no_sync_backward_outside(ctx, ddp, opt, ref, ref_opt, seed, evaluate,
                                             delay_unscale=False):
    """StyleGAN2-ADA's order: the first two micro-batches' forwards inside no_sync(), every
    backward outside it (PyTorch decides in the forward: those two are not all-reduced), and
    delay_unscale=True on those two if asked. ``evaluate``: False; True, an evaluation under
    no_grad through the DDP between each forward and its backward; or a pair (``"mid"`` or
    ``"before"`` each forward, ``call(ddp, x)``) for another place or another evaluation."""
    from mixprec import amp

    where, call = (("mid", lambda ddp, x: ddp(x)) if evaluate is True
                   else evaluate or (None, None))
    opt.zero_grad()
    ref_opt.zero_grad()
    for micro in range(3):
        x, y = _global_batch(ctx, seed=seed + micro)
        with amp.scale_loss(F.mse_loss(ref(x).float(), y), ref_opt) as s:
            s.backward()
        if where == "before":
            with torch.no_grad():
                call(ddp, _mine(ctx, x))
        with contextlib.nullcontext() if micro == 2 else ddp.no_sync():
            loss = F.mse_loss(ddp(_mine(ctx, x)).float(), _mine(ctx, y))
        if where == "mid":
            with torch.no_grad():
                call(ddp, _mine(ctx, x))
        with amp.scale_loss(loss, opt, delay_unscale=delay_unscale and micro < 2) as s:
            s.backward()
    opt.step()
    ref_opt.step()


def check_amp_torch_ddp_forward_inside_no_sync_with_its_backward_outside(ctx):
    # G (r91A G1). PyTorch's DDP decides the all-reduce in the forward: a forward inside
    # no_sync() whose backward runs after leaving it (StyleGAN2-ADA's training loop wraps
    # only the forwards in no_sync()) is not all-reduced, and amp must hold it scaled from
    # the forward's record alone (scale_loss's backward-time look sees no no_sync()): the
    # model bare (with and without an evaluation under no_grad between forward and
    # backward), under one activation checkpoint, reentrant or not, or under two nested with
    # a reentrant inner one (the outer recompute ran the inner's forward under no_grad and
    # dropped the no_sync() forward's record: the ranks drifted apart with no error); O1 and
    # O2. Reference: one process on the global micro-batches (bf16 rounding), the masters
    # bitwise equal.
    for checkpoints, evaluate in (((), False), ((), True), ((False,), False), ((True,), False),
                                  ((True, False), False), ((True, True), False)):
        _torch_ddp_steps_match_reference(
            ctx, checkpoints,
            functools.partial(_forward_inside_no_sync_backward_outside, ctx, evaluate=evaluate))


def check_amp_torch_ddp_forward_inside_no_sync_backward_outside_with_delay_unscale(ctx):
    # G (r91A G2). The route docs/parallel.md must give for the case amp's reading still
    # gets wrong when the backward runs outside no_sync() (an evaluation under no_grad
    # between a no_sync() forward and its backward, the amp model under activation
    # checkpointing: without it the ranks drift 6e-2 apart after two steps, with no error),
    # also taken by nested checkpoints (read right without it since r97A's D05):
    # delay_unscale=True on those micro-batches trains as one process. Reference: one
    # process on the global micro-batches (bf16 rounding), the masters bitwise equal on
    # every rank.
    for checkpoints, evaluate in (((True, False), False), ((True, True), False),
                                  ((False,), True), ((True,), True)):
        _torch_ddp_steps_match_reference(
            ctx, checkpoints,
            functools.partial(_forward_inside_no_sync_backward_outside, ctx, evaluate=evaluate,
                              delay_unscale=True))


def check_amp_gan_under_two_torch_ddps_with_no_sync_on_the_discriminator(ctx):
    # G (r91A G3). A GAN under PyTorch's DDP, generator and discriminator each wrapped,
    # one amp.initialize (num_losses=2): the discriminator accumulates two micro-batches
    # (the first inside ddp_d.no_sync(), the fakes from ddp_g under no_grad), and the
    # generator's loss runs through the discriminator inside ddp_d.no_sync() (its gradients
    # of that step not all-reduced, then dropped): amp's look at the DDPs in no_sync() must
    # not hold the generator's gradients, whose DDP all-reduces. Reference: one process on
    # the global batches (bf16 rounding), the masters bitwise equal on every rank.
    from mixprec import amp

    for opt_level in ("O1", "O2"):
        nets = []
        for _ in range(2):
            torch.manual_seed(3)
            g = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).to(ctx.device)
            d = _mlp(ctx.device)
            og = torch.optim.SGD(g.parameters(), lr=0.05, momentum=0.9)
            od = torch.optim.SGD(d.parameters(), lr=0.05, momentum=0.9)
            [g, d], [og, od] = amp.initialize([g, d], [og, od], opt_level=opt_level,
                                              dtype=torch.bfloat16, verbosity=0,
                                              num_losses=2, loss_scale=64.0)
            nets.append((g, d, og, od))
        (g, d, og, od), (rg, rd, rog, rod) = nets
        ddp_g = nn.parallel.DistributedDataParallel(g)
        ddp_d = nn.parallel.DistributedDataParallel(d)
        for step in range(2):
            od.zero_grad()
            rod.zero_grad()
            for micro in range(2):
                z, y = _global_batch(ctx, seed=600 + 4 * step + micro)
                with torch.no_grad():
                    ref_fake = rg(z)
                with amp.scale_loss(F.mse_loss(rd(ref_fake).float(), y), rod, loss_id=0) as s:
                    s.backward()
                with contextlib.nullcontext() if micro == 1 else ddp_d.no_sync():
                    with torch.no_grad():
                        fake = ddp_g(_mine(ctx, z))
                    loss = F.mse_loss(ddp_d(fake).float(), _mine(ctx, y))
                    with amp.scale_loss(loss, od, loss_id=0) as s:
                        s.backward()
            od.step()
            rod.step()
            og.zero_grad()
            rog.zero_grad()
            z, y = _global_batch(ctx, seed=600 + 4 * step + 3)
            with amp.scale_loss(F.mse_loss(rd(rg(z)).float(), -y), rog, loss_id=1) as s:
                s.backward()
            with ddp_d.no_sync():
                loss = F.mse_loss(ddp_d(ddp_g(_mine(ctx, z))).float(), -_mine(ctx, y))
                with amp.scale_loss(loss, og, loss_id=1) as s:
                    s.backward()
            og.step()
            rog.step()
        _assert_masters_match_reference(ctx, og, rog)
        _assert_masters_match_reference(ctx, od, rod)


def check_amp_accumulation_under_torch_ddp_static_graph_needs_no_delay_unscale(ctx):
    # G (r91A G4). PyTorch's DDP built with static_graph=True (the pairing PyTorch names for
    # reentrant activation checkpointing): no_sync() accumulation with plain scale_loss, the
    # amp model bare or under activation checkpointing (reentrant or not), O1 and O2. (Its
    # first iteration runs synced: PyTorch's reducer asserts on a first one inside
    # no_sync(), with or without amp.) Reference: one process on the global micro-batches
    # (bf16 rounding), the masters bitwise equal on every rank.
    from mixprec import amp

    for wrap in (None, True, False):
        for opt_level in ("O1", "O2"):
            model = _mlp(ctx.device)
            model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model),
                                                        opt_level=opt_level, loss_scale=64.0)
            ddp = nn.parallel.DistributedDataParallel(
                model if wrap is None else _CheckpointedOuter(model, wrap), static_graph=True)
            x, y = _global_batch(ctx, seed=2)
            _amp_step_mse(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)
            _amp_step_mse(ref, ref_opt, x, y, amp)
            for step in range(2):
                _accumulation_step(ctx, ddp, opt, ref, ref_opt, 130 + 3 * step,
                                   delay_unscale=False)
            _assert_masters_match_reference(ctx, opt, ref_opt)


class _PartlyCheckpointed(nn.Module):
    """_mlp's shape with its middle under activation checkpointing inside the amp model
    (amp's own forward is not recomputed), nested if asked."""

    def __init__(self, reentrant, nested):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.b = nn.Linear(16, 4)
        self.reentrant, self.nested = reentrant, nested

    def _middle(self, h):
        from torch.utils.checkpoint import checkpoint

        if self.nested:
            return checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.block(h)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.b(checkpoint(self._middle, self.a(x), use_reentrant=self.reentrant))


def check_amp_torch_ddp_no_sync_with_checkpoint_over_part_of_the_amp_model(ctx):
    # G (r90F G2). Activation checkpointing over a block inside the amp model (reentrant or
    # not, nested or not) under PyTorch's DDP's no_sync(), plain scale_loss: the recompute of
    # the block is no forward of amp's, the no_sync() record holds. Reference: one process on
    # the global micro-batches (bf16 rounding), the masters bitwise equal on every rank.
    for reentrant in (False, True):
        for nested in (False, True):
            for opt_level in ("O1", "O2"):
                net = _PartlyCheckpointed(reentrant, nested).to(ctx.device)
                model, opt, ref, ref_opt = _amp_o2_sgd_pair(
                    net, copy.deepcopy(net), opt_level=opt_level, loss_scale=64.0)
                ddp = nn.parallel.DistributedDataParallel(model)
                for step in range(2):
                    _accumulation_step(ctx, ddp, opt, ref, ref_opt, 130 + 3 * step,
                                       delay_unscale=False)
                _assert_masters_match_reference(ctx, opt, ref_opt)


def check_amp_torch_ddp_membership_cache_keeps_nothing_alive_and_takes_unhashable_ddp(ctx):
    # G (r90F G3). amp's cache of the modules of each PyTorch DDP it saw (_inside_torch_ddp)
    # holds neither the DDP nor the model: 5 wrappers, each with a no_sync() forward, all
    # collected once dropped. A DDP subclass that defines __eq__ without __hash__ (cannot key
    # the cache) is still followed: the no_sync() accumulation with plain scale_loss trains as
    # one process on the global micro-batches (bf16 rounding), masters equal on every rank.
    import gc
    import weakref

    refs = []
    for i in range(5):
        model = _mlp(ctx.device, seed=i)
        model, opt, _, _ = _amp_o2_sgd_pair(model, copy.deepcopy(model))
        ddp = nn.parallel.DistributedDataParallel(model)
        with ddp.no_sync():
            ddp(torch.randn(2, 8, device=ctx.device)).float().sum().backward()
        refs.append((weakref.ref(ddp), weakref.ref(model)))
        del model, opt, ddp
    gc.collect()
    alive = [i for i, (d, m) in enumerate(refs) if d() is not None or m() is not None]
    assert not alive, f"rank {ctx.rank}: wrappers {alive} kept alive"

    class EqualityDDP(nn.parallel.DistributedDataParallel):
        def __eq__(self, other):
            return self is other

        __hash__ = None

    model = _mlp(ctx.device)
    model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model), loss_scale=64.0)
    ddp = EqualityDDP(model)
    for step in range(2):
        _accumulation_step(ctx, ddp, opt, ref, ref_opt, 130 + 3 * step, delay_unscale=False)
    _assert_masters_match_reference(ctx, opt, ref_opt)


def check_amp_o2_masters_broadcast_from_rank0(ctx):
    # Every rank initialises its own weights (no common seed, as in the README's example): the
    # fp32 masters, which live in the optimizer and make the checkpoint, come from rank 0 too.
    from mixprec import amp

    torch.manual_seed(200 + ctx.rank)
    model = _mlp(ctx.device, seed=200 + ctx.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    ddp = DistributedDataParallel(model)
    masters = list(amp.master_params(opt))
    _assert_same_on_all_ranks(ctx, masters, "fp32 master weight after construction")
    _assert_same_on_all_ranks(ctx, list(ddp.state_dict().values()), "state_dict entry")
    for m, p in zip(masters, model.parameters()):
        assert torch.equal(m.to(p.dtype), p), "the half model is not its masters' rounding"
    x, y = _global_batch(ctx, seed=210)
    _amp_step(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)
    _assert_same_on_all_ranks(ctx, list(model.parameters()), "model parameter after a step")


def check_amp_o2_rank_dependent_init_under_either_ddp(ctx):
    # Weights initialised per rank, then amp O2, then a DDP wrapper, then one step at lr 0.
    # PyTorch's DDP broadcasts rank 0's half weights only (not the masters in the optimizer):
    # amp takes them into the masters before the step, so every rank goes on from rank 0's
    # weights (rounded to bf16) and the replicas stay one model. mixprec's DDP broadcasts the
    # fp32 masters too: there they stay rank 0's exact fp32 weights.
    from mixprec import amp

    rank0 = [p.detach().clone() for p in _mlp(ctx.device, seed=300).parameters()]
    for wrapper in (nn.parallel.DistributedDataParallel, DistributedDataParallel):
        model = _mlp(ctx.device, seed=300 + ctx.rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                    verbosity=0)
        ddp = wrapper(model)
        x, y = _global_batch(ctx, seed=310)
        _amp_step(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)
        masters = list(amp.master_params(opt))
        _assert_same_on_all_ranks(ctx, masters, f"fp32 master weight under {wrapper.__module__}")
        _assert_same_on_all_ranks(ctx, list(model.parameters()), "model parameter after a step")
        exact = wrapper is DistributedDataParallel
        for m, w in zip(masters, rank0):
            expected = w if exact else w.to(torch.bfloat16).float()
            assert torch.equal(m, expected), (
                f"{wrapper.__module__}: masters are not rank 0's weights"
                f"{'' if exact else ' rounded to bf16'}")
    # The same with LARC around SGD, at a rate that moves the weights: LARC's trust ratio and
    # weight decay read the masters before its inner optimizer's step (it read each rank's
    # own initial masters under PyTorch's DDP, so the replicas drifted apart).
    from mixprec.parallel import LARC

    for wrapper in (nn.parallel.DistributedDataParallel, DistributedDataParallel):
        model = _mlp(ctx.device, seed=300 + ctx.rank)
        opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                   weight_decay=1e-2))
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                    verbosity=0)
        ddp = wrapper(model)
        for step in range(2):
            x, y = _global_batch(ctx, seed=311 + step)
            _amp_step(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)
        _assert_same_on_all_ranks(ctx, list(amp.master_params(opt)),
                                  f"LARC's fp32 master weight under {wrapper.__module__}")


class _SlicedQKVHead(nn.Module):
    """q, k and v sliced from one tensor (one version counter before amp's cast), then a head."""

    def __init__(self, d=8):
        super().__init__()
        w = torch.randn(3 * d, d) * 0.3
        self.q = nn.Parameter(w[:d])
        self.k = nn.Parameter(w[d:2 * d])
        self.v = nn.Parameter(w[2 * d:])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head((x @ self.q.t()) * (x @ self.k.t()) + x @ self.v.t())


def check_sliced_parameters_initialized_per_rank_train_as_one_model_under_either_ddp(ctx):
    # G (r86A). q, k and v sliced from one tensor, initialized differently on every rank, then
    # amp O2 (whose cast gives each its own version counter by swapping its tensor), then a
    # DDP wrapper broadcasting rank 0's weights, then steps; then a write into q's half alone
    # on every rank. Reference: the masters and half parameters equal on all ranks after
    # construction and after the steps, and k's and v's masters left exact by the write
    # (plain PyTorch leaves them as they were).
    from mixprec import amp

    for wrapper in (nn.parallel.DistributedDataParallel, DistributedDataParallel):
        torch.manual_seed(400 + ctx.rank)
        model = _SlicedQKVHead().to(ctx.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                    verbosity=0)
        ddp = wrapper(model)
        for step in range(2):
            x, y = _global_batch(ctx, seed=410 + step)
            _amp_step_mse(ddp, opt, _mine(ctx, x), _mine(ctx, y), amp)
            _assert_same_on_all_ranks(ctx, list(amp.master_params(opt)),
                                      f"fp32 master under {wrapper.__module__}")
            _assert_same_on_all_ranks(ctx, list(model.parameters()), "half parameter")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            nn.init.zeros_(model.q)
        after = model.state_dict()
        assert torch.equal(after["q"], torch.zeros_like(after["q"]))
        for name in ("k", "v"):
            torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)


def check_amp_accumulation_with_no_sync_needs_no_delay_unscale(ctx):
    # The plain accumulation loop: micro-batches under no_sync(), every scale_loss with the
    # default delay_unscale=False. Unscaling into the masters inside no_sync() would keep each
    # rank's earlier micro-batches out of the final all-reduce (ranks then differ); amp keeps
    # them scaled in place for the synced backward. Zeroing goes through the DDP wrapper
    # (reaching the masters). O2 with a static and a dynamic scale, and O1 (fp32 parameters).
    from mixprec import amp

    for opt_level, loss_scale in (("O2", 64.0), ("O2", "dynamic"), ("O1", "dynamic")):
        model = _mlp(ctx.device)
        model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model), opt_level,
                                                    loss_scale=loss_scale)
        ddp = DistributedDataParallel(model, message_size=64)
        for step in range(2):
            _accumulation_step(ctx, ddp, opt, ref, ref_opt, 130 + 3 * step,
                               delay_unscale=False, zero_grad=ddp.zero_grad)
        masters = list(amp.master_params(opt))
        _assert_same_on_all_ranks(ctx, masters, f"{opt_level} {loss_scale} weight")
        for m, r in zip(masters, amp.master_params(ref_opt)):
            torch.testing.assert_close(m, r, rtol=0, atol=2e-2 if opt_level == "O1" else 2e-3)


def check_amp_o1_accumulates_all_reduced_micro_batches(ctx):
    # Accumulation with every micro-batch all-reduced (no no_sync()) and delay_unscale=False:
    # at O1 (fp32 parameters) and a loss scale other than 1, the gradients of the earlier
    # micro-batches are set aside while the next backward runs. They are views of the
    # reducer's buckets (mixprec's DDP; PyTorch's with gradient_as_bucket_view=True), which
    # that backward writes, so they are set aside as copies (r53C's C46). Reference: one
    # process on the global micro-batches.
    from mixprec import amp

    wrappers = {"mixprec": lambda m: DistributedDataParallel(m, message_size=64),
                "torch": lambda m: nn.parallel.DistributedDataParallel(
                    m, gradient_as_bucket_view=True)}
    for name, wrap in wrappers.items():
        model = _mlp(ctx.device)
        model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model), "O1",
                                                    loss_scale=64.0)
        ddp = wrap(model)
        start = torch.cat([w.detach().flatten() for w in amp.master_params(opt)])
        for step in range(2):
            _accumulation_step(ctx, ddp, opt, ref, ref_opt, 170 + 3 * step,
                               delay_unscale=False, synced=True)
        weights = list(amp.master_params(opt))
        _assert_same_on_all_ranks(ctx, weights, f"{name} DDP weight")
        # The updates agree within bf16 autocast's rounding (0.24% of their size here; with
        # the views set aside as they are, the next backward overwrote them: 103%).
        update = torch.cat([w.detach().flatten() for w in weights]) - start
        want = torch.cat([r.detach().flatten() for r in amp.master_params(ref_opt)]) - start
        error = ((update - want).norm() / want.norm()).item()
        assert error < 0.02, f"{name} DDP: updates {error:.1%} apart"


def check_no_sync_deferral_follows_the_models_that_ran(ctx):
    # (1) A container of two amp models (initialize([backbone, head]), then DDP of a
    # Sequential): the plain no_sync accumulation loop still all-reduces every micro-batch.
    # (2) A GAN with one initialize call: D's forward inside D.no_sync() during G's phase must
    # not hold G's optimizer's gradients scaled (G is not wrapped; its step must run).
    from mixprec import amp

    torch.manual_seed(0)
    backbone, head = nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 4)
    refs = copy.deepcopy([backbone, head])
    opt = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=0.05)
    ref_opt = torch.optim.SGD([*refs[0].parameters(), *refs[1].parameters()], lr=0.05)
    kw = dict(opt_level="O2", dtype=torch.bfloat16, loss_scale=64.0, verbosity=0)
    _, opt = amp.initialize([backbone, head], opt, **kw)
    _, ref_opt = amp.initialize(refs, ref_opt, **kw)
    ddp = DistributedDataParallel(nn.Sequential(backbone, head), message_size=64)
    _accumulation_step(ctx, ddp, opt, nn.Sequential(*refs), ref_opt, 150, delay_unscale=False)
    masters = list(amp.master_params(opt))
    _assert_same_on_all_ranks(ctx, masters, "container model's master weight")
    for m, r in zip(masters, amp.master_params(ref_opt)):
        torch.testing.assert_close(m, r, rtol=0, atol=2e-3)

    G, D = _mlp(ctx.device, seed=160), nn.Linear(4, 1).to(ctx.device)
    opt_g = torch.optim.SGD(G.parameters(), lr=0.05)
    opt_d = torch.optim.SGD(D.parameters(), lr=0.05)
    [G, D], [opt_g, opt_d] = amp.initialize([G, D], [opt_g, opt_d], num_losses=2, **kw)
    D_ddp = DistributedDataParallel(D)
    G_ddp = DistributedDataParallel(G)
    z = _mine(ctx, _global_batch(ctx, seed=170)[0])
    opt_g.zero_grad()
    with D_ddp.no_sync():  # D's gradients from G's loss are not wanted: no all-reduce
        err_g = D_ddp(G_ddp(z)).float().mean()
    with amp.scale_loss(err_g, opt_g, loss_id=1) as scaled:
        scaled.backward()
    opt_g.step()  # raised "still scaled" when D's no_sync forward deferred G's unscale too
    assert not amp.step_was_skipped(opt_g)
    _assert_same_on_all_ranks(ctx, list(G.parameters()), "G's parameter after its step")


def check_amp_o2_ddp_syncbn_compiled(ctx):
    # The whole Apex recipe under torch.compile: amp O2 (bf16), SyncBatchNorm (a graph break,
    # run eagerly), DDP, compiled; it must train as the same recipe run eagerly. On CPU the
    # quick aot_eager backend; on CUDA the real compiler.
    from mixprec import amp

    backend = "inductor" if ctx.is_cuda else "aot_eager"
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = convert_syncbn_model(_ConvNet()).to(ctx.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16,
                                    verbosity=0)
        ddp = DistributedDataParallel(model)
        net = torch.compile(ddp, backend=backend) if compiled else ddp
        for step in range(3):
            x, y = _images(ctx, seed=60 + step)
            _amp_step(net, opt, _mine(ctx, x), _mine(ctx, y), amp)
        masters = list(amp.master_params(opt))
        _assert_same_on_all_ranks(ctx, masters, f"fp32 master weight (compiled={compiled})")
        runs.append(masters + list(model.buffers()))
    for i, (got, want) in enumerate(zip(*runs)):
        # Compiled kernels may round bf16 activations differently from eager ones.
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-3,
                                   msg=labelled(f"compiled vs eager, tensor #{i}"))


def check_amp_o2_fp16_dynamic_scale_on_device_under_ddp(ctx):
    # fp16 O2 with a fused AdamW: the dynamic scale lives on each rank's device and kernels
    # update it. An overflow on one rank reaches every rank through the all-reduce, so all
    # ranks skip that step and halve their scale together, and the masters stay identical.
    from mixprec import amp
    from mixprec.amp._state import optimizer_state

    torch.manual_seed(0)
    model = _ConvNet().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16,
                                loss_scale="dynamic", verbosity=0)
    ddp = DistributedDataParallel(model)
    skipped, scales = [], []
    for step in range(4):
        x, y = _images(ctx, seed=70 + step)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(_mine(ctx, x)), _mine(ctx, y))
        poison = float("inf") if step == 2 and ctx.rank == 0 else 1.0
        with amp.scale_loss(loss, opt) as scaled:
            (scaled * poison).backward()
        opt.step()
        skipped.append(amp.step_was_skipped(opt))
        scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
    assert optimizer_state(opt).amp_state.scalers[0].on_device == torch.device(ctx.device)
    assert skipped[2] and not skipped[3], skipped
    assert scales[2] == scales[1] / 2, scales
    # (on the device: NCCL gathers no CPU tensors)
    _assert_same_on_all_ranks(
        ctx, [torch.tensor(scales, device=ctx.device),
              torch.tensor(skipped, dtype=torch.float32, device=ctx.device)],
        "loss scale / skipped steps")
    _assert_same_on_all_ranks(ctx, list(amp.master_params(opt)), "fp32 master weight")
    _assert_same_on_all_ranks(ctx, list(model.parameters()), "model parameter")


def check_larc_under_amp_o2_and_ddp(ctx):
    from mixprec import amp

    model = _mlp(ctx.device)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    larc = LARC(base)
    model, larc = amp.initialize(model, larc, opt_level="O2", dtype=torch.bfloat16,
                                 verbosity=0)
    assert larc.param_groups is base.param_groups
    masters = [p for g in larc.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    assert not any(m is p for m in masters for p in model.parameters())
    ddp = DistributedDataParallel(model)
    before = [m.detach().clone() for m in masters]
    for step in range(3):
        x, y = _global_batch(ctx, seed=60 + step)
        larc.zero_grad()
        loss = F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y))
        with amp.scale_loss(loss, larc) as scaled:
            scaled.backward()
        larc.step()
    assert all(g["weight_decay"] == 1e-4 for g in larc.param_groups)
    assert any(not torch.equal(a, b) for a, b in zip(before, masters)), "no step was taken"
    _assert_same_on_all_ranks(ctx, masters, "LARC fp32 master weight")
    _assert_same_on_all_ranks(ctx, list(model.parameters()), "model parameter")


def _larc_sgd_float64(p, g, buf, lr, wd, momentum, trust, clip, eps=1e-8):
    """Apex's LARC followed by SGD with momentum (no dampening), all in float64: the new
    weight and the new momentum buffer."""
    p_norm, g_norm = p.norm(), g.norm()
    if p_norm == 0 or g_norm == 0:
        d = g
    else:
        rate = trust * p_norm / (g_norm + wd * p_norm + eps)
        if clip:
            rate = min(rate / lr, 1.0)
        d = (g + wd * p) * rate
    buf = d if buf is None else momentum * buf + d
    return p - lr * buf, buf


def check_larc_under_amp_o2_and_ddp_matches_float64_larc(ctx):
    """LARC around SGD (momentum, weight decay) at amp O2 under DDP, with the learning rate
    changed every step through ``larc.optim`` (a poly schedule), clip on and off: every
    step of every fp32 master equals a float64 LARC + SGD step taken from the master, its
    all-reduced unscaled gradient and its momentum buffer as they were before the step (up
    to fp32 rounding of the result), and the masters are bitwise the same on every rank.
    (r73B's replay: check_larc_under_amp_o2_and_ddp checks that the ranks agree and a step
    was taken, not the step's value.)"""
    from mixprec import amp

    for clip in (True, False):
        model = _mlp(ctx.device)
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        model, larc = amp.initialize(model, LARC(base, trust_coefficient=0.02, clip=clip),
                                     opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        ddp = DistributedDataParallel(model)
        masters = [p for g in larc.param_groups for p in g["params"]]
        for step in range(3):
            for group in larc.optim.param_groups:  # poly learning rate, power 0.9
                group["lr"] = 0.1 * (1 - step / 4) ** 0.9
            x, y = _global_batch(ctx, seed=310 + step)
            larc.zero_grad()
            loss = F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y))
            with amp.scale_loss(loss, larc) as scaled:
                scaled.backward()
            lr = larc.param_groups[0]["lr"]
            before = [(m.detach().double().clone(), m.grad.double().clone(),
                       None if "momentum_buffer" not in larc.state.get(m, {})
                       else larc.state[m]["momentum_buffer"].double().clone())
                      for m in masters]
            larc.step()
            for i, (m, (p, g, buf)) in enumerate(zip(masters, before)):
                want, _ = _larc_sgd_float64(p, g, buf, lr, 1e-4, 0.9, 0.02, clip)
                step_size = (want - p).abs().max().item()
                torch.testing.assert_close(
                    m.detach().double(), want, rtol=0, atol=1e-5 * step_size + 2 * 2 ** -24 * p.abs().max().item(),
                    msg=labelled(f"rank {ctx.rank} clip={clip} step {step} master {i}"))
        assert all(g["weight_decay"] == 1e-4 for g in larc.param_groups)
        _assert_same_on_all_ranks(ctx, masters, f"LARC fp32 master (clip={clip})")


def check_join_divides_uneven_steps_as_asked(ctx):
    # Rank 1 runs out of data after one step. Step 1: the average of both ranks' gradients
    # (x = rank + 1: 1.5). Step 2, rank 0 alone: divided by the ranks still active (1.0) or by
    # the initial world size (0.5), as join() is asked. Options whose all-reduce runs in
    # mixprec's hook divide by the initial world size only: asking otherwise is refused on
    # every rank, before any collective, instead of silently halving the gradients.
    def run(ddp, divide_by_initial):
        grads = []
        # (None: PyTorch's generic Join([ddp, ...]), as with a ZeroRedundancyOptimizer, which
        # passes no divide_by_initial_world_size: PyTorch's default, True, holds.)
        context = (Join([ddp]) if divide_by_initial is None
                   else ddp.join(divide_by_initial_world_size=divide_by_initial))
        with context:
            for _ in range(2 if ctx.rank == 0 else 1):
                ddp.module.zero_grad()
                ddp(torch.full((3,), float(ctx.rank + 1), device=ctx.device)).backward()
                grads.append(ddp.module.weight.grad.clone())
        return grads

    from torch.distributed.algorithms.join import Join

    # (On W ranks: step 1 averages 1..W, (W + 1) / 2; step 2 is rank 0's 1 divided by 1 or W.)
    first, by_initial = (ctx.world_size + 1) / 2, 1 / ctx.world_size
    for kwargs, divide_by_initial, last in (({}, False, 1.0), ({}, True, by_initial),
                                            ({"prof": True}, True, by_initial),
                                            ({"prof": True}, None, by_initial),
                                            ({"gradient_predivide_factor": 3.0}, None,
                                             by_initial)):
        grads = run(DistributedDataParallel(_Scale().to(ctx.device), **kwargs), divide_by_initial)
        torch.testing.assert_close(grads[0], torch.full_like(grads[0], first))
        if ctx.rank == 0:
            torch.testing.assert_close(grads[1], torch.full_like(grads[1], last),
                                       msg=labelled(f"{kwargs} {divide_by_initial}"))
    for kwargs in ({"prof": True}, {"allreduce_always_fp32": True},
                   {"gradient_predivide_factor": 3.0}):
        ddp = DistributedDataParallel(_Scale().to(ctx.device), **kwargs)
        try:
            ddp.join(divide_by_initial_world_size=False)
        except ValueError as err:
            assert "divide_by_initial_world_size=False" in str(err) and "ranks still active" in (
                str(err)), str(err)
        else:
            raise AssertionError(f"join(divide_by_initial_world_size=False) with {kwargs}")
    # gradient_average=False divides by nothing: nothing to refuse.
    ddp = DistributedDataParallel(_Scale().to(ctx.device), gradient_average=False)
    grads = run(ddp, False)
    torch.testing.assert_close(grads[0], torch.full_like(grads[0], first * ctx.world_size))
    if ctx.rank == 0:
        torch.testing.assert_close(grads[1], torch.full_like(grads[1], 1.0))


def check_join_under_amp_keeps_fp32_masters_and_one_loss_scale(ctx):
    # Leaving join(): PyTorch broadcasts the half model from the last rank to join, which amp
    # took into every rank's masters as a write (rounded to half: small updates were lost
    # at each join); and an overflow on a rank still training halved its loss scale alone,
    # so the ranks then averaged gradients scaled differently. The masters and the scales
    # come from the last rank to join now.
    from mixprec import amp

    torch.manual_seed(0)
    model = nn.Linear(8, 2).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    ddp = DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(ctx.rank)
    last = ctx.world_size - 1
    with ddp.join():
        for i in range(1 + 2 * ctx.rank):  # the last rank's second batch overflows
            x = torch.randn(4, 8, generator=gen)
            if ctx.rank == last and i == 1:
                x[0, 0] = float("inf")
            opt.zero_grad()
            with amp.scale_loss(ddp(x.to(ctx.device)).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
        mine = torch.cat([m.detach().flatten() for m in amp.master_params(opt)])
    masters = torch.cat([m.detach().flatten() for m in amp.master_params(opt)])
    # Every rank's masters are the last rank's as it joined (not rank 0's: r53A's D35).
    torch.testing.assert_close(masters, _gather(ctx, mine)[last], rtol=0, atol=0)
    assert not torch.equal(masters, masters.half().float()), "masters rounded to half"
    scale = torch.tensor([amp.state_dict(optimizer=opt)["loss_scaler0"]["loss_scale"]],
                         device=ctx.device)
    scales = [p.item() for p in _gather(ctx, scale)]
    assert scales == [32768.0] * ctx.world_size, f"loss scales differ: {scales}"


def check_join_under_amp_over_a_process_group_without_rank_0(ctx):
    # Leaving join(), the last joiner's amp loss scales are broadcast with
    # broadcast_object_list, which takes a GLOBAL source rank: the wrapper converts the
    # group rank (_authoritative_rank) with dist.get_global_rank. Over a data-parallel
    # subgroup that does not hold global rank 0 (hybrid model/data parallelism), a group rank
    # used as it is names a rank outside the group and join() raises at its exit on that
    # group's ranks. With 2 ranks: each rank alone in its own group (rank 1's group rank 0 is
    # global rank 1). Reference: the masters/scale as the steps left them (one rank: join
    # changes nothing), and the loss scale kept at amp's initial 65536.
    from mixprec import amp

    groups = _groups_of_one(ctx)
    torch.manual_seed(0)
    model = nn.Linear(8, 2).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    ddp = DistributedDataParallel(model, process_group=groups[ctx.rank])
    gen = torch.Generator().manual_seed(ctx.rank)
    with ddp.join():
        for _ in range(2):
            opt.zero_grad()
            x = torch.randn(4, 8, generator=gen).to(ctx.device)
            with amp.scale_loss(ddp(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
        before = torch.cat([m.detach().flatten().clone() for m in amp.master_params(opt)])
        scale_before = amp.state_dict(optimizer=opt)["loss_scaler0"]["loss_scale"]
    after = torch.cat([m.detach().flatten() for m in amp.master_params(opt)])
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert amp.state_dict(optimizer=opt)["loss_scaler0"]["loss_scale"] == scale_before
    # (and the ranks trained apart, as their groups say: different data, different masters)
    others = _gather(ctx, after)
    assert not torch.equal(others[0], others[-1]), "groups of one should not average"


def check_module_without_trainable_parameters_checks_shapes(ctx):
    # A module with nothing to train is passed through (PyTorch's constructor is not run):
    # its broadcast of rank 0's state took, silently, part of rank 0's values into another
    # rank's differently shaped tensors. Every rank now refuses it. A trainable one went to
    # PyTorch's own check, which on gloo raised on the mismatched rank only and left rank 0
    # waiting for the process group's timeout (here the test's; 30 minutes by default).
    # Dtypes and names count as shapes do: a rank whose copy was cast (a stray .double()) or
    # whose buffer is registered under another name took rank 0's bytes into another dtype or
    # another buffer (r53A's D08, D09). Rank 1 alone differs, so the message names it on any
    # number of ranks (test_more_ranks.py runs this on 4 and 8).
    def shaped(trainable):
        out = 5 if ctx.rank == 1 else 4
        return nn.Linear(4, out).to(ctx.device).requires_grad_(trainable)

    def cast():
        dtype = torch.float64 if ctx.rank == 1 else torch.float32
        return nn.Linear(4, 4).to(ctx.device, dtype).requires_grad_(False)

    def renamed():
        layer = nn.Linear(4, 4).to(ctx.device).requires_grad_(False)
        layer.register_buffer("shift" if ctx.rank == 1 else "scale",
                              torch.ones(4, device=ctx.device))
        return layer

    cases = [("shape, frozen", shaped(False), {}), ("shape", shaped(True), {}),
             ("shape, delay_allreduce", shaped(True), {"delay_allreduce": True}),
             ("dtype", cast(), {}), ("buffer name", renamed(), {})]
    for what, layer, kwargs in cases:
        try:
            DistributedDataParallel(layer, **kwargs)
        except RuntimeError as err:
            assert "differ in name, dtype or shape between ranks (ranks [1]" in str(err), \
                str(err)
        else:
            raise AssertionError(f"models differing between the ranks were accepted ({what})")
    torch.manual_seed(ctx.rank)
    same = nn.Linear(4, 4).to(ctx.device).requires_grad_(False)
    DistributedDataParallel(same)  # (the same shapes: rank 0's values, as before)
    assert all(torch.equal(p, _gather(ctx, same.weight)[0]) for p in _gather(ctx, same.weight))


def check_first_step_inside_join_with_an_empty_rank(ctx):
    # A fresh wrapper whose very first step runs inside join() while the other ranks have no
    # batch at all: the first-step watch stays off there (its all-reduce would meet no
    # partner: gloo timed out). Each of rank 0's steps is its own gradient (x = 1) divided
    # by the ranks still active (1) or by the initial world size, as join() is asked.
    for divide_by_initial, expected in ((False, 1.0), (True, 1.0 / ctx.world_size)):
        ddp = DistributedDataParallel(_Scale().to(ctx.device))
        grads = []
        with ddp.join(divide_by_initial_world_size=divide_by_initial):
            for _ in range(2 if ctx.rank == 0 else 0):
                ddp.module.zero_grad()
                ddp(torch.ones(3, device=ctx.device)).backward()
                grads.append(ddp.module.weight.grad.clone())
        for i, g in enumerate(grads):
            torch.testing.assert_close(g, torch.full_like(g, expected), rtol=0, atol=0,
                                       msg=labelled(f"divide_by_initial={divide_by_initial} "
                                                    f"step {i}"))


def check_unused_parameters_inside_join_are_not_sent_to_the_delay_mode(ctx):
    # A first step inside join() (not watched) with a branch no rank takes: the next forward
    # raises naming the branch. Its remedies named delay_allreduce=True twice, which join()
    # refuses (r101C R5); inside join() they name find_unused_parameters=True alone.
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_Checkpointed("plain").to(ctx.device))
    x, y = _global_batch(ctx, seed=310)
    try:
        with ddp.join():
            for _ in range(2):
                F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    except RuntimeError as err:
        text = str(err)
        assert "these parameters got no gradient: extra.weight, extra.bias" in text, text
        assert "or pass find_unused_parameters=True to DistributedDataParallel." in text, text
        assert "delay_allreduce=True" not in text, text
        assert "the delay mode, which could, does not take join()" in text, text
    else:
        raise AssertionError("an unused branch inside join() trained")


def check_fsdp1_sharded_model_at_o1_skips_an_overflow_on_every_rank(ctx):
    # FSDP1 shards the gradients (reduced still scaled in its backward), so each rank checks
    # only its shard: an inf in rank 0's shard skipped the step there while rank 1 stepped,
    # and the loss scales parted (helper's measure: 0.27 of the weights' travel off, against
    # 0.024 for ShardedGradScaler). Sharded before initialize, the ranks now agree.
    from torch.distributed.fsdp import FullyShardedDataParallel

    from mixprec import amp

    torch.manual_seed(0)
    model = FullyShardedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(),
                                                   nn.Linear(16, 4)),
                                     use_orig_params=False, device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    _assert_every_rank_skips_a_shards_overflow(ctx, model, opt)


def check_fsdp2_sharded_model_at_o1_skips_an_overflow_on_every_rank(ctx):
    # FSDP2 (fully_shard, DTensor parameters): the agreement comes from PyTorch's DTensor
    # unscale-and-check op, which reduces the flag over the mesh; pinned here.
    from mixprec import amp

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # (PyTorch 2.4/2.5)
        from torch.distributed._composable.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    _assert_every_rank_skips_a_shards_overflow(ctx, model, opt)


def check_fsdp2_root_parameters_are_not_taken_for_gradients_no_optimizer_holds(ctx):
    # Between a forward and its backward FSDP2's root module holds unsharded stand-ins of its
    # parameters (the optimizer has the sharded ones): at O1 fp16 amp's look for gradients no
    # optimizer holds warned about them on rank 0 at the first scale_loss, following the
    # README's recipe (r101A R1). The layouts: the root alone, blocks and the root. Training
    # is an unsharded O1 run's (SGD: every rank's gradient averaged).
    from mixprec import amp

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # (PyTorch 2.4/2.5)
        from torch.distributed._composable.fsdp import fully_shard
    for layout in ("root", "blocks and root"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        ref = copy.deepcopy(model)
        if layout != "root":
            fully_shard(model[0])
        fully_shard(model)
        ref.to(next(model.parameters()).device)  # (a GPU, where fully_shard took the model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O1", dtype=torch.float16,
                                    verbosity=0)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        ref, ref_opt = amp.initialize(ref, ref_opt, opt_level="O1", dtype=torch.float16,
                                      verbosity=0)
        # (CPU tensors: on a machine with a GPU, fully_shard puts the model there, and its
        # output comes back there.)
        x, y = (t.cpu() for t in _global_batch(ctx, seed=320))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                opt.zero_grad()
                out = model(_mine(ctx, x))
                with amp.scale_loss(F.mse_loss(out.float(), _mine(ctx, y).to(out.device)),
                                    opt) as scaled:
                    scaled.backward()
                opt.step()
        stray = [str(w.message) for w in caught if "no optimizer given" in str(w.message)]
        assert not stray, (layout, stray)
        x, y = (t.to(next(ref.parameters()).device) for t in (x, y))
        for _ in range(2):
            ref_opt.zero_grad()
            losses = [F.mse_loss(ref(x[r * PER_RANK:(r + 1) * PER_RANK]).float(),
                                 y[r * PER_RANK:(r + 1) * PER_RANK])
                      for r in range(ctx.world_size)]
            with amp.scale_loss(sum(losses) / ctx.world_size, ref_opt) as scaled:
                scaled.backward()
            ref_opt.step()
        for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6,
                                       msg=labelled(f"{layout} {name}"))


def _assert_every_rank_skips_a_shards_overflow(ctx, model, opt) -> None:
    """Three steps; in the second an inf in rank 0's own gradient shard: every rank skips
    that step, and the loss scales stay equal."""
    from mixprec import amp

    g = torch.Generator().manual_seed(ctx.rank)
    skipped = []
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=g)
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
            if step == 1 and ctx.rank == 0:
                grad = next(model.parameters()).grad
                grad = grad.to_local() if hasattr(grad, "to_local") else grad  # (a DTensor)
                grad.view(-1)[0] = float("inf")  # (rank 0's shard only)
        opt.step()
        skipped.append(amp.step_was_skipped(opt))
    assert skipped == [False, True, False], f"skipped {skipped}"
    scale = torch.tensor([amp.state_dict(optimizer=opt)["loss_scaler0"]["loss_scale"]])
    scales = [t.item() for t in _gather(ctx, scale)]
    assert scales == [32768.0] * ctx.world_size, f"loss scales differ: {scales}"


def check_half_model_of_an_fsdp_sharded_model_is_refused(ctx):
    # O2/O3 of FSDP's shards: the forward failed on mixed dtypes (FSDP gathers its own
    # dtype), or trained with half checkpoints. Refused, naming FSDP's own mixed precision.
    from torch.distributed.fsdp import FullyShardedDataParallel

    from mixprec import amp

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # (PyTorch 2.4/2.5)
        from torch.distributed._composable.fsdp import fully_shard
    for shard in ("fully_shard", "FullyShardedDataParallel"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        if shard == "fully_shard":
            fully_shard(model)
        else:
            model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for level in ("O2", "O3"):
            try:
                amp.initialize(model, opt, opt_level=level, dtype=torch.bfloat16, verbosity=0)
            except ValueError as err:
                assert "the model is sharded by FSDP" in str(err), str(err)
                assert "MixedPrecisionPolicy" in str(err), str(err)
            else:
                raise AssertionError(f"{level} of a {shard} model was accepted")


def check_dead_peer_raises_quickly(ctx):
    # Last check of the CPU group: the last rank leaves; the others' next collective must raise
    # (gloo notices the closed connection) instead of hanging.
    if ctx.rank == ctx.world_size - 1:
        raise StopWorker()
    start = time.monotonic()
    try:
        for _ in range(3):
            dist.all_reduce(torch.ones(4))
    except Exception as err:  # gloo raises RuntimeError (DistNetworkError on newer torch)
        elapsed = time.monotonic() - start
        assert elapsed < 30, f"took {elapsed:.1f}s to notice the dead peer"
        assert str(err), "empty error message"
    else:
        raise AssertionError("a collective with a dead peer did not raise")
    raise StopWorker()


# Apex's first-step rule; also on the one-GPU machine (its callback, and the small backward
# that fires the reducer's hooks, then run on autograd's device thread).
FIRST_STEP_CHECKS = [
    "check_first_step_leaves_out_what_no_rank_used",
    "check_first_step_averages_what_some_ranks_used",
    "check_first_step_refuses_a_block_checkpointed_twice",
    "check_first_step_after_no_sync_micro_batches",
    "check_no_sync_gradients_after_another_wrappers_forward",
    "check_first_step_guards_what_it_left_out",
    "check_first_step_watches_the_synced_backward_only",
    "check_first_step_rule_edges",
    "check_amp_o2_first_step_leaves_an_unused_head_out",
    "check_replaced_layer_refused_by_the_reducer",
    "check_first_step_inside_join_with_an_empty_rank",
    "check_unused_parameters_inside_join_are_not_sent_to_the_delay_mode",
    "check_apex_arithmetic_survives_the_first_step_rebuild",
]
# The delay mode's checks, and those that run both modes. They also run on a machine with one
# GPU: two processes share it over gloo (the delay mode's callbacks then run on autograd's
# device thread).
DELAY_CHECKS = [
    "check_predivide_factor",
    "check_half_gradients_reduced_in_half",
    "check_allreduce_always_fp32_averages_half_gradients",
    "check_delay_allreduce_reduces_each_dtype_in_its_own_dtype",
    "check_delay_allreduce_layer_taken_out_and_put_back_within_a_window",
    "check_hook_options_all_reduce_over_the_process_group_only",
    "check_buffers_broadcast_at_construction_only",
    "check_ignored_parameters_stay_local",
    "check_no_sync_accumulation",
    "check_delay_allreduce_no_sync_backward_stays_local_past_an_evaluation",
    "check_delay_allreduce",
    "check_delay_allreduce_where_the_reducer_cannot",
    "check_delay_allreduce_old_wrapper_stays_quiet",
    "check_delay_allreduce_dropped_wrapper_takes_its_hooks_along",
    "check_delay_allreduce_second_backward_through_a_checkpoint_stays_local",
    "check_wrapped_again_after_a_dry_run",
    "check_delay_allreduce_amp_o2_with_checkpointing",
    "check_gradient_penalty_through_autograd_grad",
    "check_delay_allreduce_after_a_backward_that_raised",
    "check_delay_allreduce_after_a_backward_that_raised_past_a_checkpoint",
    "check_delay_allreduce_refuses_sparse_gradients_on_every_rank",
    "check_delay_allreduce_sparse_error_names_a_layer_added_later",
    "check_amp_two_losses_under_the_reducers_bucket_views",
    "check_delay_allreduce_amp_o2_apex_switch_timing",
    "check_delay_allreduce_warns_on_a_second_backward",
    "check_default_mode_warns_on_a_second_backward_through_one_forward",
    "check_default_mode_steps_quietly_with_a_parameter_among_the_outputs",
    "check_several_losses_inside_no_sync_accumulate_quietly",
    "check_second_backward_warned_after_a_step_with_the_model_frozen",
    "check_left_out_guard_names_a_second_backward_after_the_warning",
    "check_left_out_guard_keeps_its_plain_message_after_a_second_backward",
    "check_enable_allreduce_after_a_synced_forward_past_a_kept_local_output",
    "check_wrapper_used_again_after_another_guards_what_it_left_out",
    "check_module_without_trainable_parameters_passes_through",
    "check_delay_allreduce_recovers_inside_a_checkpoint",
    "check_delay_allreduce_two_wrappers_and_the_python_reducer_setting",
    "check_disable_and_enable_allreduce",
    "check_delay_allreduce_follows_the_module",
    "check_delay_allreduce_follows_a_progressive_unfreezing",
    "check_delay_allreduce_leaves_stale_gradients_alone",
]


class _Branches(nn.Module):
    """A trunk and three heads: ``b`` used on rank 0, ``c`` on the last rank, ``d`` never
    (``b`` and ``c`` have as many elements: mismatched they averaged one into the other)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x, heads):
        h = self.a(x)
        return sum(getattr(self, name)(h).sum() for name in heads) + h.sum()


def _heads_of_the_end_ranks(ctx, rank):
    """_Branches' heads a rank uses: ``b`` on rank 0 only, ``c`` on the last rank only."""
    return ["b"] if rank == 0 else (["c"] if rank == ctx.world_size - 1 else [])


def _assert_branch_grads(ctx, model, grads, ref, what, rtol, atol):
    """``grads`` (one per parameter of the _Branches ``model``) equal the gradients of its
    reference ``ref`` within the tolerances; head ``d``, used nowhere, has None."""
    for (name, _), grad, q in zip(model.named_parameters(), grads, ref.parameters()):
        if name.startswith("d."):
            assert grad is None and q.grad is None, (name, grad)
        else:
            assert grad is not None, name
            torch.testing.assert_close(grad.to(q.grad.dtype), q.grad, rtol=rtol, atol=atol,
                                       msg=labelled(f"rank {ctx.rank}{what}: {name}"))


def _reducer_under_amp(ctx, make_model, opt_level):
    """A seeded model on the rank's device, its float64 copy (the reference), and the model
    with an SGD optimizer through ``Reducer(find_unused_parameters=True)`` and amp at
    ``opt_level`` (bf16, a static scale of 128: earlier micro-batches' gradients wait aside)."""
    from mixprec import amp

    torch.manual_seed(0)
    model = make_model().to(ctx.device)
    ref = copy.deepcopy(model).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reducer = Reducer(model, find_unused_parameters=True)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16,
                                loss_scale=128.0, verbosity=0)
    return model, ref, opt, reducer


def check_reducer_find_unused_parameters(ctx):
    # A parameter used on some ranks only: Reducer(find_unused_parameters=True) gives it a
    # zero gradient where it has none, so it averages as DDP does; one used nowhere keeps
    # None. Reference: the sum over the ranks' batches in one process, over the world size.
    torch.manual_seed(0)
    model = _Branches().to(ctx.device)
    ref = copy.deepcopy(model)
    reducer = Reducer(model, find_unused_parameters=True)
    heads = functools.partial(_heads_of_the_end_ranks, ctx)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(3, 4, generator=g).to(ctx.device) for _ in range(ctx.world_size)]
    model(xs[ctx.rank], heads(ctx.rank)).backward()
    reducer.reduce()
    for rank in range(ctx.world_size):
        (ref(xs[rank], heads(rank)) / ctx.world_size).backward()
    _assert_branch_grads(ctx, model, [p.grad for p in model.parameters()], ref, "", 1e-5, 1e-6)
    try:
        Reducer([torch.zeros(2, device=ctx.device)], find_unused_parameters=True)
    except ValueError as err:
        assert "needs a module" in str(err), str(err)
    else:
        raise AssertionError("find_unused_parameters with a list of tensors did not raise")

    # amp O1 at a loss scale other than 1, two micro-batches without delay_unscale, reduce()
    # inside the second block: the first micro-batch's gradients wait aside, and the ranks
    # held different heads' aside (gloo aborted on the sizes, or with equal sizes one head's
    # gradient was averaged into the other's). Reference: the same float64 sum as above, the
    # second micro-batch through the trunk only; bf16 autocast's rounding as the tolerance.
    from mixprec import amp

    model, ref, opt, reducer = _reducer_under_amp(ctx, _Branches, "O1")
    for micro, chosen in enumerate((heads(ctx.rank), [])):
        with amp.scale_loss(model(xs[ctx.rank], chosen), opt) as scaled:
            scaled.backward()
            if micro == 1:
                reducer.reduce()
    for rank in range(ctx.world_size):
        for chosen in (heads(rank), []):
            (ref(xs[rank].double(), chosen) / ctx.world_size).backward()
    _assert_branch_grads(ctx, model, [p.grad for p in model.parameters()], ref,
                         ", O1 accumulated", 3e-2, 3e-2)


def check_reducer_find_unused_parameters_counts_a_frozen_parameters_leftover_gradient(ctx):
    # (r49A's R12: the agreement skipped parameters without requires_grad, while reduce()
    # averages every gradient present.) A parameter frozen after a backward on rank 0 only,
    # its gradient not zeroed since: rank 0's buffer held one gradient more, and gloo
    # aborted. It gets a zero one on the other rank, and every rank ends with the average.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(ctx.device)
    reducer = Reducer(model, find_unused_parameters=True)
    x = torch.full((3, 4), float(ctx.rank + 1), device=ctx.device)
    if ctx.rank == 0:
        model(x).sum().backward()
        leftover = model[1].weight.grad.clone()
    model[1].requires_grad_(False)
    for p in model[0].parameters():
        p.grad = None
    model[0](x).sum().backward()
    reducer.reduce()
    want = leftover / ctx.world_size if ctx.rank == 0 else torch.zeros(2, 4, device=ctx.device)
    dist.broadcast(want, src=0)  # (rank 0's leftover, averaged over the ranks)
    torch.testing.assert_close(model[1].weight.grad, want, rtol=1e-6, atol=1e-6,
                               msg=labelled(f"rank {ctx.rank}: frozen weight"))
    # (the trainable layer: the average of the ranks' gradients, rank r's input being r + 1)
    mean_input = (ctx.world_size + 1) / 2
    torch.testing.assert_close(model[0].bias.grad, torch.full((4,), 3.0, device=ctx.device),
                               rtol=0, atol=0)
    torch.testing.assert_close(model[0].weight.grad,
                               torch.full((4, 4), 3.0 * mean_input, device=ctx.device),
                               rtol=1e-6, atol=1e-6, msg=labelled(f"rank {ctx.rank}"))


class _O2Branches(nn.Module):
    """A Linear trunk (half at O2, with fp32 masters) and two BatchNorm heads (kept fp32 at
    O2: amp's plain parameters, whose earlier gradients a scale_loss block sets aside):
    ``nb`` used on rank 0 in the first micro-batch only, ``nd`` never."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.nb = nn.BatchNorm1d(4)
        self.nd = nn.BatchNorm1d(4)

    def forward(self, x, heads):
        h = self.a(x)
        out = h.float().sum()
        for name in heads:
            out = out + (getattr(self, name)(h).float() ** 2).sum()
        return out


def check_reducer_find_unused_at_o2_with_fp32_layers_set_aside(ctx):
    # Reducer(find_unused_parameters=True) on an amp O2 model that has both fp32 masters
    # (the Linear) and plain fp32 parameters (BatchNorm), two micro-batches at a loss scale
    # other than 1 without delay_unscale, reduce() inside the second block: the BatchNorm
    # head used on rank 0 only has its first micro-batch gradient set aside there, and needs
    # a zero one set aside on the other rank; the head used nowhere keeps None.
    # Reference: float64 copy, sum over the ranks' micro-batches divided by the world size;
    # bf16 rounding of the trunk as the tolerance.
    from mixprec import amp

    model, ref, opt, reducer = _reducer_under_amp(ctx, _O2Branches, "O2")

    def heads(rank, micro):
        return ["nb"] if (rank == 0 and micro == 0) else []

    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(3, 4, generator=g).to(ctx.device) for _ in range(ctx.world_size)]
    for micro in range(2):
        with amp.scale_loss(model(xs[ctx.rank].bfloat16(), heads(ctx.rank, micro)), opt) as s:
            s.backward()
            if micro == 1:
                reducer.reduce()
    for rank in range(ctx.world_size):
        for micro in range(2):
            (ref(xs[rank].double(), heads(rank, micro)) / ctx.world_size).backward()
    # The gradients the optimizer steps with: the Linear's masters, the BatchNorms' own.
    masters = dict(zip([id(p) for p in model.a.parameters()], amp.master_params(opt)))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        grad = masters[id(p)].grad if id(p) in masters else p.grad
        if name.startswith("nd."):
            assert grad is None and q.grad is None, (name, grad)
        else:
            assert grad is not None, name
            torch.testing.assert_close(grad.double(), q.grad, rtol=3e-2, atol=3e-2,
                                       msg=labelled(f"rank {ctx.rank}: {name}"))


def check_amp_and_norm_warnings_come_from_rank_zero(ctx):
    # Every rank builds the model and calls initialize: a warning there came once per rank
    # (a model .half()-ed before initialize at O2; a Megatron keyword dropped by a Mixed
    # norm). Rank 0 warns; the others say nothing.
    from mixprec import amp
    from mixprec.normalization import MixedFusedLayerNorm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _mlp(ctx.device).half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
        MixedFusedLayerNorm(8, sequence_parallel_enabled=False)
    text = " ".join(str(w.message) for w in caught)
    assert ("already torch.float16" in text) == (ctx.rank == 0), (ctx.rank, text)
    assert ("ignoring the keyword argument(s) sequence_parallel_enabled" in text) == \
        (ctx.rank == 0), (ctx.rank, text)


def check_prof_keeps_the_arithmetic_asked_for(ctx):
    # prof=True only labels the all-reduces in profiler traces: with gradient_average=False
    # the gradients are summed, and with allreduce_always_fp32 or a predivide factor they
    # are averaged as without prof. Rank r's gradient is exactly (r + 1): the sum over the
    # ranks is W(W+1)/2, the average (W+1)/2; exact in fp32. Both modes (the reducer's hook,
    # and delay_allreduce).
    world = ctx.world_size
    total = world * (world + 1) / 2
    cases = [(dict(gradient_average=False), total),
             (dict(gradient_predivide_factor=float(world) * 2), total / world),
             (dict(allreduce_always_fp32=True), total / world)]
    for kwargs, expected in cases:
        for delay in (False, True):
            model = _Scale().to(ctx.device)
            ddp = DistributedDataParallel(model, prof=True, delay_allreduce=delay, **kwargs)
            x = torch.full((3,), ctx.rank + 1.0, device=ctx.device)
            ddp(x).backward()
            torch.testing.assert_close(
                model.weight.grad, torch.full((3,), expected, device=ctx.device), rtol=0, atol=0,
                msg=labelled(f"prof=True, {kwargs}, delay_allreduce={delay}"))
    # What prof is for: the all-reduces found in a trace. The reducer's mode runs each
    # bucket's all-reduce in a "mixprec.ddp.allreduce_bucket" range (the MLP fits one bucket
    # or more), the delay mode the one after backward in a "mixprec.ddp.delayed_allreduce"
    # range; without prof neither appears. (PyTorch's legacy profiler: kineto starts in
    # seconds.)
    x, y = _global_batch(ctx, seed=720)
    for delay, label in ((False, "mixprec.ddp.allreduce_bucket"),
                         (True, "mixprec.ddp.delayed_allreduce")):
        for prof in (False, True):
            ddp = DistributedDataParallel(_mlp(ctx.device), prof=prof, delay_allreduce=delay)
            F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()  # (the first step)
            with torch.autograd.profiler.profile(use_kineto=False) as trace:
                F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
            count = sum(1 for event in trace.function_events if event.name == label)
            ok = count == 0 if not prof else count == 1 if delay else count >= 1
            assert ok, (label, prof, count)


def check_half_gradients_predivided_and_summed_in_half(ctx):
    # Apex's arithmetic for fp16 gradients without allreduce_always_fp32: divide by the
    # predivide factor in fp16, all-reduce the fp16 bucket, divide by world/factor in fp16.
    # (The existing overflow check cannot tell this from an fp32 sum copied back: 81920
    # copied into fp16 is inf too.) With a factor that is not a power of two each step
    # rounds in fp16: the result must be, bit for bit, the same fp16 operations done here on
    # every rank's gradient; an fp32 reduction rounds once and differs in some elements.
    world, factor = ctx.world_size, 3.0
    g = torch.Generator().manual_seed(21)
    grads = [(torch.randn(256, generator=g) * 10).half() for _ in range(world)]
    # (fp16 ops; on 2 ranks one addition, so the order of the sum does not matter: bit for
    # bit there. On more, gloo's order is not this one: to an fp16 rounding per addition.)
    expected = sum(x / factor for x in grads) / (world / factor)
    tol = dict(rtol=0, atol=0 if world <= 2 else (world - 1) * 2.0 ** -10
               * float(expected.abs().max()))
    for delay in (False, True):
        model = _Scale(256, dtype=torch.float16).to(ctx.device)
        ddp = DistributedDataParallel(model, delay_allreduce=delay,
                                      gradient_predivide_factor=factor)
        ddp(grads[ctx.rank].to(ctx.device)).backward()
        grad = model.weight.grad
        assert grad.dtype == torch.float16, grad.dtype
        torch.testing.assert_close(grad.cpu(), expected, **tol,
                                   msg=labelled(f"delay_allreduce={delay}"))


def check_delay_allreduce_steps_warn_nothing(ctx):
    # The late-gradient warning is for a second backward through a forward already
    # all-reduced. Plain training steps (forward, backward, step) with delay_allreduce=True,
    # whose models' several parameters each bring a gradient, warn nothing on any rank, and
    # their gradients are the global batch's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    g = torch.Generator().manual_seed(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x = torch.randn(2 * ctx.world_size, 8, generator=g).to(ctx.device)
            model.zero_grad()
            ref.zero_grad()
            ddp(x[2 * ctx.rank:2 * ctx.rank + 2]).square().mean().backward()
            ref(x).square().mean().backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                           msg=labelled(f"step {step}: {name}"))
    texts = [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)]
    assert not texts, texts


def check_arguments_refused_where_a_bool_or_nan_would_slip_through(ctx):
    """message_size, gradient_predivide_factor and num_allreduce_streams are numbers: a bool
    (True is 1 to Python), a NaN factor (every gradient NaN), an infinite one (every gradient
    divided to 0 before the sum and by world_size / inf = 0 after it: NaN averaged, 0 summed,
    silently), an infinite or NaN message_size (no number of elements; PyTorch's reducer
    failed without naming it) or a fractional stream count is refused with a ValueError
    naming the argument, as 0 is. (D15, D16, D17, D18, r64A's bug)"""
    for kwargs in ({"message_size": True}, {"gradient_predivide_factor": float("nan")},
                   {"gradient_predivide_factor": True}, {"num_allreduce_streams": 1.5},
                   {"gradient_predivide_factor": float("inf")},
                   {"message_size": float("inf")}, {"message_size": float("nan")}):
        try:
            DistributedDataParallel(_mlp(ctx.device), **kwargs)
        except ValueError as err:
            assert f"DistributedDataParallel({list(kwargs)[0]}=" in str(err), str(err)
        else:
            raise AssertionError(f"{kwargs} did not raise ValueError")


def check_default_construction_warns_nothing(ctx):
    """Wrapping with the defaults (num_allreduce_streams=1, retain_allreduce_buffers=False)
    warns nothing on any rank: the "ignoring Apex argument(s)" warning is for arguments the
    script set. (D19, D20)"""
    for delay in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DistributedDataParallel(_mlp(ctx.device), delay_allreduce=delay)
        texts = [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)]
        assert not texts, (delay, texts)


def check_constructor_warnings_point_at_the_callers_line(ctx):
    """Rank 0's warnings about Apex arguments are attributed to the line that constructs the
    wrapper (the script's), so that ``-W error::FutureWarning:train`` style filters and the
    printed location point at the user's code, not at mixprec. (D04)"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DistributedDataParallel(_mlp(ctx.device), shared_param=True)  # (this line)
    ours = [w for w in caught if "shared_param" in str(w.message)]
    if ctx.rank == 0:
        assert len(ours) == 1 and ours[0].filename == __file__, [
            (w.filename, w.lineno) for w in ours]
    else:
        assert not ours


def check_apex_internals_override_warned_through_a_base_class(ctx):
    """A project's subclass of DistributedDataParallel that overrides Apex's
    allreduce_bucket, further subclassed (a common layering: a base DDP with the override
    and a per-experiment subclass), still warns on rank 0 that the override does nothing,
    naming it. (D05)"""
    class _SubgroupDDP(DistributedDataParallel):
        def allreduce_bucket(self, bucket):
            raise AssertionError("never called")

    class _ExperimentDDP(_SubgroupDDP):
        pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ExperimentDDP(_mlp(ctx.device))
    text = " ".join(str(w.message) for w in caught)
    assert ("_ExperimentDDP overrides allreduce_bucket" in text) == (ctx.rank == 0), text


class _TiedHeads(nn.Module):
    """A language-model-style module: an embedding whose weight the output layer shares
    (tied weights), and a second head ``b`` used while ``use_b`` is set."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 8, bias=False)
        self.out.weight = self.emb.weight
        self.b = nn.Linear(8, 4)
        self.use_b = False

    def forward(self, x):
        h = self.out(torch.tanh(self.emb(x)))
        return h.sum() + (self.b(h).sum() if self.use_b else 0)


def check_unused_parameters_named_with_tied_weights(ctx):
    """With tied weights (the output layer sharing the embedding's weight), the parameter
    the reducer waits for is named by its own name: PyTorch's reducer counts a shared
    parameter once, and the error's indices must be read in that list. (D06)"""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_TiedHeads().to(ctx.device))
    text = _unused_parameters_error(ctx, ddp, lambda: None)
    assert "got no gradient: b.weight, b.bias" in text, text
    assert "emb.weight" not in text and "out.weight" not in text, text


class _MostlyHalf(nn.Module):
    """A bf16 trunk (most trainable elements) with a small fp32 layer (as amp O2 keeps
    norms in fp32), and a large frozen fp32 layer."""

    def __init__(self, device):
        super().__init__()
        self.trunk = nn.Linear(32, 32).to(device, torch.bfloat16)
        self.norm = nn.Linear(4, 4).to(device)
        self.frozen = nn.Linear(64, 64).to(device).requires_grad_(False)

    def forward(self, x):
        return self.trunk(x)


def check_message_size_counts_elements_of_the_trainable_majority_dtype(ctx):
    """message_size counts elements of the dtype that holds most of the trainable parameters
    (bf16 at amp O2, 2 bytes), whatever a few fp32 norms or frozen fp32 layers hold: the
    reducer's cap is message_size * 2 bytes here. (D10, D11)"""
    ddp = DistributedDataParallel(_MostlyHalf(ctx.device), message_size=1000)
    assert abs(_reducer_bucket_cap(ddp) - 2000) <= 1, _reducer_bucket_cap(ddp)


def check_gradients_are_views_of_the_reducers_buckets(ctx):
    """In the reducer's mode the gradients live in the reducer's flat buckets (Apex's
    buckets, no copy in or out, no second copy of the gradients in memory): after a
    backward, parameters of one bucket share one storage. (D22)"""
    model = _mlp(ctx.device)
    ddp = DistributedDataParallel(model)  # (the default message_size: one bucket)
    x, y = _global_batch(ctx)
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1, storages


def check_join_refusal_names_the_options_that_use_the_hook(ctx):
    """join(divide_by_initial_world_size=False) is refused with the options that route the
    all-reduce through mixprec's hook, and only those, so the user knows which to drop.
    (D34)"""
    ddp = DistributedDataParallel(_Scale().to(ctx.device), gradient_predivide_factor=3.0)
    try:
        ddp.join(divide_by_initial_world_size=False)
    except ValueError as err:
        text = str(err)
    else:
        raise AssertionError("join(divide_by_initial_world_size=False) was taken")
    assert "with gradient_predivide_factor=3:" in text, text
    for other in ("prof=True", "allreduce_always_fp32=True", "gradient_average=False"):
        assert other not in text, (other, text)


class _RaisesInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)

    def forward(self, x):
        if x.shape[-1] != 8:
            raise RuntimeError("input has the wrong number of features")
        return self.a(x)


def check_module_errors_reach_the_caller_unchanged(ctx):
    """A RuntimeError raised by the wrapped module's own forward (a shape check, an OOM)
    reaches the caller as it is: only PyTorch's unfinished-reduction error is rewritten into
    the unused-parameters message. (D40)"""
    ddp = DistributedDataParallel(_RaisesInForward().to(ctx.device))
    try:
        ddp(torch.ones(2, 5, device=ctx.device))
    except RuntimeError as err:
        assert str(err) == "input has the wrong number of features", str(err)
    else:
        raise AssertionError("the module's error did not propagate")


class _RootParams(nn.Module):
    """Parameters on the root module itself: ``w`` used, ``v`` never."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.v = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return (self.w * x).sum()


def check_first_step_leaves_out_a_root_parameter(ctx):
    """A parameter of the root module that no rank uses in the first step is left out as one
    of a submodule is: the following steps train (the rebuilt reducer does not wait for it)
    and it keeps grad=None. (D47)"""
    model = _RootParams().to(ctx.device)
    ddp = DistributedDataParallel(model)
    x = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    mean = (ctx.world_size + 1) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (rank 0's left-out warning)
        for step in range(3):
            model.zero_grad()
            ddp(x).backward()
            torch.testing.assert_close(model.w.grad, torch.full_like(model.w, mean),
                                       rtol=0, atol=0, msg=labelled(f"step {step}"))
            assert model.v.grad is None, step


def check_first_step_rebuild_keeps_message_size_and_names(ctx):
    """After the first step leaves a layer out, the rebuilt reducer keeps the buckets of
    message_size elements (not the compiler's 1 MiB), and a parameter it later waits for is
    named by the rebuilt reducer's list (the left-out layer comes first in the module).
    (D48, D49)"""
    class _SpareFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.spare = nn.Linear(8, 8)  # (never used)
            self.a = nn.Linear(8, 4)
            self.b = nn.Linear(8, 4)  # used while use_b is set
            self.use_b = False

        def forward(self, x):
            return self.a(x) + self.b(x) if self.use_b else self.a(x)

    torch.manual_seed(0)
    ddp = DistributedDataParallel(_SpareFirst().to(ctx.device), message_size=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (rank 0's left-out warning)
        text = _unused_parameters_error(ctx, ddp, lambda: None)
    assert abs(_reducer_bucket_cap(ddp) - 4000) <= 1, _reducer_bucket_cap(ddp)
    assert "got no gradient: b.weight, b.bias," in text, text
    assert "a.weight" not in text and "spare" not in text, text


def check_first_step_rebuild_keeps_the_wrapper_compilable(ctx):
    """After the first step leaves a head out and the reducer is rebuilt without it, the
    wrapper still offers torch.compile a bucket cap of at least the compiler's fixed 1 MiB
    first bucket (below it, with a small message_size, Dynamo's DDP splitter refuses the
    model), while the rebuilt reducer keeps message_size's buckets, and so does a pickled
    copy of the wrapper, as before the rebuild. (D14)"""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_HeadPair().to(ctx.device), message_size=1000)
    assert ddp.bucket_bytes_cap == dist._DEFAULT_FIRST_BUCKET_BYTES, ddp.bucket_bytes_cap
    x, _ = _global_batch(ctx, seed=820)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (rank 0's left-out warning)
        ddp(_mine(ctx, x))[0].sum().backward()  # the first step: head b left out
        ddp(_mine(ctx, x))[0].sum().backward()  # the reducer rebuilt at this forward
    assert abs(_reducer_bucket_cap(ddp) - 4000) <= 1, _reducer_bucket_cap(ddp)
    assert ddp.bucket_bytes_cap == dist._DEFAULT_FIRST_BUCKET_BYTES, ddp.bucket_bytes_cap
    copy_ = pickle.loads(pickle.dumps(ddp))
    assert abs(_reducer_bucket_cap(copy_) - 4000) <= 1, _reducer_bucket_cap(copy_)
    assert copy_.bucket_bytes_cap == dist._DEFAULT_FIRST_BUCKET_BYTES, copy_.bucket_bytes_cap


def check_enable_allreduce_after_a_synced_forward(ctx):
    """enable_allreduce() between a forward run with the all-reduce on and its backward is
    allowed (nothing is pending: that backward all-reduces anyway), and the step's gradients
    are the global batch's. (D51)"""
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    x, y = _global_batch(ctx, seed=700)
    loss = F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y))
    ddp.enable_allreduce()
    loss.backward()
    F.mse_loss(ref(x), y).backward()
    _assert_same_grads(ctx, model, ref)


def check_zero_grad_passes_set_to_none(ctx):
    """ddp.zero_grad(set_to_none=False) keeps the gradient tensors, zeroed in place (as
    Module.zero_grad does), for scripts that hold references to them. (D53)"""
    model = _mlp(ctx.device)
    ddp = DistributedDataParallel(model)
    x, y = _global_batch(ctx)
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    ddp.zero_grad(set_to_none=False)
    for name, p in model.named_parameters():
        assert p.grad is not None and not p.grad.any(), name
    ddp.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def check_message_size_of_one_element(ctx):
    """The smallest bucket, message_size=1 (every gradient in a bucket of its own), is a
    valid size: it is taken in both modes and the gradients are the single-process global
    batch's, as with any other size. (A02)"""
    for delay in (False, True):
        model = _mlp(ctx.device)
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, message_size=1, delay_allreduce=delay)
        _grads_match_global_batch(ctx, ddp, model, ref, 746, f"message_size=1, delay={delay}")


def check_predivide_factor_given_as_an_int(ctx):
    """gradient_predivide_factor=4 (an int, as Apex scripts often write it) is stored and
    shown as the float it is documented to be, so that print(model) logs the same set-up
    whichever way it was written; the average comes out as with 4.0 (rank r's gradient is
    r + 1: the average (W + 1) / 2, exact in fp32). (A11)"""
    model = _Scale().to(ctx.device)
    ddp = DistributedDataParallel(model, gradient_predivide_factor=4)
    assert type(ddp.gradient_predivide_factor) is float, type(ddp.gradient_predivide_factor)
    assert "gradient_predivide_factor=4.0" in repr(ddp), repr(ddp)
    ddp(torch.full((3,), ctx.rank + 1.0, device=ctx.device)).backward()
    torch.testing.assert_close(model.weight.grad,
                               torch.full((3,), (ctx.world_size + 1) / 2, device=ctx.device),
                               rtol=0, atol=0)


def check_amp_no_sync_micro_batch_past_an_evaluation_forward(ctx):
    """A forward without grad (a metric on the batch) run outside no_sync() between a
    no_sync() micro-batch's forward and its backward leaves that micro-batch's gradients
    held scaled for the synced backward: amp's deferral is set by the forwards that build a
    graph, and an evaluation has no backward. Reference: one process on the global
    micro-batches; fp32 masters equal on every rank and within bf16 rounding (atol 2e-3) of
    the reference's. (A25)"""
    from mixprec import amp

    model = _mlp(ctx.device)
    model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model), loss_scale=64.0)
    ddp = DistributedDataParallel(model, message_size=64)
    opt.zero_grad()
    ref_opt.zero_grad()
    for micro in range(2):
        x, y = _global_batch(ctx, seed=740 + micro)
        with amp.scale_loss(F.mse_loss(ref(x).float(), y), ref_opt) as scaled:
            scaled.backward()
        with contextlib.nullcontext() if micro == 1 else ddp.no_sync():
            loss = F.mse_loss(ddp(_mine(ctx, x)).float(), _mine(ctx, y))
        with torch.no_grad():
            ddp(_mine(ctx, x))  # (an evaluation, outside no_sync())
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    opt.step()
    ref_opt.step()
    _assert_masters_match_reference(ctx, opt, ref_opt)


def check_apex_flat_dist_call_over_model_parameters(ctx):
    """flat_dist_call takes a model's parameters themselves (leaves that require grad), as
    scripts pass list(model.parameters()) to broadcast rank 0's initial weights: they come
    out rank 0's, in place (the same tensors, still leaves requiring grad), with no autograd
    error about an in-place write to a leaf. Reference: rank 0's values, gathered. (A38)"""
    from mixprec.parallel.distributed import flat_dist_call

    model = _mlp(ctx.device, seed=750 + ctx.rank)  # different weights on every rank
    params = list(model.parameters())
    flat_dist_call(params, dist.broadcast, (0,))
    for (name, p), q in zip(model.named_parameters(), params):
        assert p is q and p.is_leaf and p.requires_grad, name
        torch.testing.assert_close(p.detach(), _gather(ctx, p.detach())[0], rtol=0, atol=0,
                                   msg=labelled(f"rank {ctx.rank}: {name}"))


def check_partly_frozen_model_evaluates_without_grad(ctx):
    """A layer frozen through .module after the first step while the rest trains is refused
    at the next forward with grad (the all-reduce would wait for its gradient), but an
    evaluation under torch.no_grad() has no backward and runs as the module would (a
    validation pass between freezing and re-wrapping). Reference: the module's own
    output, exactly. (A47)"""
    model = _mlp(ctx.device)
    ddp = DistributedDataParallel(model, message_size=64)
    _train_steps(ctx, ddp, [755])
    model[0].requires_grad_(False)
    x, _ = _global_batch(ctx, seed=756)
    with torch.no_grad():
        torch.testing.assert_close(ddp(_mine(ctx, x)), model(_mine(ctx, x)), rtol=0, atol=0)
    try:
        ddp(_mine(ctx, x))
    except RuntimeError as err:
        assert "0.weight, 0.bias were frozen (requires_grad=False) since the" in str(err), \
            str(err)
    else:
        raise AssertionError("a forward with grad of a partly frozen model was taken")


def check_process_group_refused_when_not_a_group(ctx):
    """process_group= takes a ProcessGroup: a group size (2, as create_syncbn_process_group
    takes) or a backend name ("gloo") is refused at construction with a TypeError naming
    the argument and the value, on every rank, before any collective (the Reducer refuses
    them the same way). (A54)"""
    for group, words in ((2, "a group size?"), ("gloo", "got a str")):
        try:
            DistributedDataParallel(_mlp(ctx.device), process_group=group)
        except TypeError as err:
            text = str(err)
        else:
            raise AssertionError(f"process_group={group!r} was taken")
        assert f"DistributedDataParallel(process_group={group!r}): expected None" in text, text
        assert words in text, text


def check_process_group_without_this_rank_refused(ctx):
    """A wrapper over a group that does not include this rank (new_group's answer on the
    other ranks) is refused at construction with a RuntimeError saying so and how to make
    one that does; on the group's own rank (a group of one) the wrapper trains on its own
    gradients. (A55)"""
    last = ctx.world_size - 1
    groups = _groups_of_one(ctx)
    model = _mlp(ctx.device, seed=760 + ctx.rank)
    if ctx.rank == last:
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, process_group=groups[last])
        x, y = _global_batch(ctx, seed=761)
        F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
        F.mse_loss(ref(_mine(ctx, x)), _mine(ctx, y)).backward()
        _assert_same_grads(ctx, model, ref, "a group of one")
        return
    try:
        DistributedDataParallel(model, process_group=groups[last])
    except RuntimeError as err:
        assert "is not a member of the process group" in str(err) and "new_group" in (
            str(err)), str(err)
    else:
        raise AssertionError("a wrapper over a group without this rank was built")


def check_shared_param_false_still_warns_deprecated(ctx):
    """shared_param is deprecated whatever its value: an Apex script passing
    shared_param=False is told on rank 0 (a FutureWarning naming delay_allreduce=False, its
    replacement), not only one passing True; the wrapper runs in the reducer's mode. (A57)"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DistributedDataParallel(_mlp(ctx.device), shared_param=False)
    assert ddp.delay_allreduce is False and ddp.reducer is not None
    ours = [str(w.message) for w in caught
            if issubclass(w.category, FutureWarning) and "shared_param" in str(w.message)]
    if ctx.rank == 0:
        assert len(ours) == 1 and "delay_allreduce=False" in ours[0], ours
    else:
        assert not ours, ours


def check_process_group_passed_by_position_is_refused(ctx):
    """DDP(model, 10000000, False, group): the fourth positional argument is Apex's
    shared_param, so a process group there turned delay mode on (with only the deprecation
    warning) and the group was dropped silently (r104A R2); in torch's order, the sixth, it
    lands in retain_allreduce_buffers. Refused on every rank before anything is built, naming
    the slot and process_group=... as the fix: in each of Apex's twelve positional slots (the
    last, prof, too: r107B G7), and passed by keyword to one of them (the message does not
    say it came by position then)."""
    import inspect

    group = dist.group.WORLD
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    slots = [n for n, p in params.items()
             if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][2:]
    assert slots[0] == "message_size" and slots[-1] == "prof" and len(slots) == 12, slots
    defaults = [params[n].default for n in slots]
    calls = [((*defaults[:i], group), {}, slot) for i, slot in enumerate(slots)]
    calls.append(((), {"shared_param": group}, "shared_param"))
    for args, kwargs, slot in calls:
        try:
            DistributedDataParallel(_mlp(ctx.device), *args, **kwargs)
        except TypeError as err:
            text = str(err)
            assert (f"DistributedDataParallel({slot}=<ProcessGroup>): a process group is not "
                    f"a {slot}") in text, text
            assert "process_group=group" in text, text
        else:
            raise AssertionError(f"a process group in {slot}'s place was taken")


def check_delay_allreduce_buckets_fill_to_message_size(ctx):
    """In the delay mode a bucket takes gradients up to exactly message_size elements: the
    MLP's 128/16/64/4-element gradients with message_size=80 go as 128, 16+64 and 4 (after
    the one all-reduce of the per-parameter flags); message_size=80.0 (a float from a config)
    the same. (L01, L05, r64A's A01)"""
    for size in (80, 80.0):
        model = _mlp(ctx.device)
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, message_size=size, delay_allreduce=True)
        with _counting_all_reduces() as calls:
            _grads_match_global_batch(ctx, ddp, model, ref, 710, f"message_size={size!r}")
        assert calls == [8, 128, 80, 4], (size, calls)


def check_delay_allreduce_follow_keeps_each_ranks_buffers(ctx):
    """The delay mode follows a layer added after wrapping with rank 0's values for the new
    layer only: the buffers of modules it already had stay each rank's own (broadcast at
    construction only, as Apex did), e.g. BatchNorm running statistics. (D44)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)).to(ctx.device)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    x, y = _global_batch(ctx, seed=720)
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()  # (each rank's own statistics)
    before = model[1].running_mean.clone()
    model.append(nn.Linear(4, 4).to(ctx.device))
    ddp(_mine(ctx, x))  # (the forward that follows the new layer, in train mode)
    local = copy.deepcopy(model[1])
    local.running_mean.copy_(before)
    # What this rank's statistics must be: its own, updated by this forward's batch.
    with torch.no_grad():
        local(model[0](_mine(ctx, x)))
    torch.testing.assert_close(model[1].running_mean, local.running_mean, rtol=0, atol=0)
    others = _gather(ctx, model[1].running_mean)
    assert not torch.equal(others[0], others[-1]), "the ranks' statistics should differ"


def check_delay_allreduce_follow_keeps_ignored_buffers_local(ctx):
    """In the delay mode a module added after wrapping gets rank 0's state at the next
    forward, except buffers under names set to be ignored
    (_set_params_and_buffers_to_ignore_for_model), which stay each rank's own as in
    PyTorch's DDP (a per-rank statistic kept out on purpose)."""
    torch.manual_seed(0)
    model = _IgnoredFirst().to(ctx.device)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["extra.running_mean"])
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    model.extra = nn.BatchNorm1d(16).to(ctx.device).eval()
    model.extra.running_mean.fill_(ctx.rank + 1.0)
    model.extra.running_var.fill_(ctx.rank + 1.0)
    x, y = _global_batch(ctx, seed=750)
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    torch.testing.assert_close(model.extra.running_mean,
                               torch.full((16,), ctx.rank + 1.0, device=ctx.device),
                               rtol=0, atol=0, msg="an ignored buffer was broadcast")
    torch.testing.assert_close(model.extra.running_var,
                               torch.full((16,), 1.0, device=ctx.device), rtol=0, atol=0,
                               msg="a new module's buffer did not get rank 0's value")


def check_apex_flat_dist_call_keeps_each_dtype(ctx):
    """flat_dist_call flattens per (device, dtype), as Apex's helper did: an int64 counter
    broadcast together with fp32 tensors arrives exact (flattened with them it went through
    a float and 2**40 + 1 came out 2**40). (D01)"""
    from mixprec.parallel.distributed import flat_dist_call

    big = 2 ** 40 + 1
    step = torch.tensor([big if ctx.rank == 0 else 0], dtype=torch.int64, device=ctx.device)
    weights = torch.full((3,), float(ctx.rank), device=ctx.device)
    flat_dist_call([weights, step], dist.broadcast, (0,))
    assert step.dtype == torch.int64 and int(step) == big, step
    assert torch.equal(weights, torch.zeros_like(weights)), weights


def check_pytorch_arguments_named_beside_unknown_ones(ctx):
    """A PyTorch DDP argument given together with a misspelt one is still named as
    PyTorch's (the script moving over from torch's DDP learns what to drop), and the misspelt
    one is named too, so one try shows both. (D02)"""
    try:
        DistributedDataParallel(_mlp(ctx.device), device_ids=[0], no_such_option=1)
    except TypeError as err:
        assert "['device_ids'] are arguments of torch.nn.parallel.DistributedDataParallel" in (
            str(err)), str(err)
        assert str(err).endswith(" Unknown to both: ['no_such_option']."), str(err)
    else:
        raise AssertionError("unknown keyword arguments were accepted")


def check_long_name_lists_shortened_exactly(ctx):
    """Messages list at most eight parameter names, then how many more: eight names are
    listed in full, ten as eight and "and 2 more". (D03)"""
    for layers, tail in ((4, "3.weight, 3.bias were frozen"),
                         (5, "3.weight, 3.bias and 2 more were frozen")):
        model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(layers)), nn.Linear(4, 1))
        model.to(ctx.device)
        for layer in model[:layers]:
            layer.requires_grad_(False)
        ddp = DistributedDataParallel(model)
        model.requires_grad_(True)
        try:
            ddp(torch.ones(2, 4, device=ctx.device))
        except RuntimeError as err:
            text = str(err)
        else:
            raise AssertionError("parameters unfrozen after wrapping were taken")
        assert text.startswith("DistributedDataParallel: 0.weight, 0.bias, 1.weight") and (
            tail in text), text


def check_delay_allreduce_reduces_what_a_layer_accumulated_before_its_freeze(ctx):
    """Gradient accumulation in the delay mode where a layer is frozen and another unfrozen
    between the micro-batches (a fine-tuning schedule switching at a micro-batch boundary):
    the frozen layer's gradient accumulated under no_sync() is still all-reduced by the
    synced backward, as is the newly unfrozen one's; both match one process on the global
    micro-batches. (D07)"""
    torch.manual_seed(0)
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    for net in (model, ref):
        net[0].requires_grad_(False)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    x, y = _global_batch(ctx, seed=730)
    with ddp.no_sync():
        F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    F.mse_loss(ref(x), y).backward()
    for net in (model, ref):
        net[2].requires_grad_(False)
        net[0].requires_grad_(True)
    x, y = _global_batch(ctx, seed=731)
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    F.mse_loss(ref(x), y).backward()
    _assert_same_grads(ctx, model, ref, "frozen and unfrozen between micro-batches")


def check_reducer_takes_a_layer_added_under_ignored_names(ctx):
    """In the reducer's mode a layer added after wrapping under names set to be ignored
    (_set_params_and_buffers_to_ignore_for_model) is the user's own business, as in the
    delay mode: not refused, and its gradients stay this rank's own while the others are
    the global batch's. (D46)"""
    torch.manual_seed(0)
    model = _IgnoredFirst().to(ctx.device)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["extra.weight", "extra.bias"])
    ddp = DistributedDataParallel(model)
    torch.manual_seed(600 + ctx.rank)
    model.extra = nn.Linear(16, 16).to(ctx.device)
    local = copy.deepcopy(model)
    x, y = _global_batch(ctx, seed=740)
    F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
    F.mse_loss(local(_mine(ctx, x)), _mine(ctx, y)).backward()
    torch.testing.assert_close(model.extra.weight.grad, local.extra.weight.grad, **_tol(ctx))
    _assert_same_on_all_ranks(ctx, [model.b.weight.grad], "b.weight.grad")


def check_reducer_averages_complex_tensors(ctx):
    # Documented: Reducer averages dense floating-point or complex tensors (a complex model's
    # gradients). Reference: the mean over the ranks of the values each rank holds (exact:
    # halves, quarters, eighths).
    # (R04)
    ws = ctx.world_size
    z = torch.full((3,), complex(ctx.rank + 1, -2.0 * (ctx.rank + 1)), dtype=torch.complex64,
                   device=ctx.device)
    Reducer([z]).reduce()
    mean = (ws + 1) / 2
    torch.testing.assert_close(z, torch.full_like(z, complex(mean, -2.0 * mean)), rtol=0, atol=0,
                               msg=labelled(f"rank {ctx.rank}"))


def check_reducer_over_a_group_averages_over_that_group(ctx):
    # Reducer(process_group=g) averages over g's ranks: the sum over them divided by g's size,
    # not the world's. Groups of one rank (every world size) and, from 4 ranks, pairs.
    # Reference: the mean of the values the group's members hold.
    # (R13)
    singles = _groups_of_one(ctx)
    t = torch.full((3,), ctx.rank + 1.0, device=ctx.device)
    Reducer([t], process_group=singles[ctx.rank]).reduce()
    torch.testing.assert_close(t, torch.full_like(t, ctx.rank + 1.0), rtol=0, atol=0,
                               msg=labelled(f"rank {ctx.rank}, a group of one: tensors"))
    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(ctx.device)
    reducer = Reducer(model, process_group=singles[ctx.rank])
    model(torch.full((1, 3), ctx.rank + 1.0, device=ctx.device)).sum().backward()
    want = torch.full((2, 3), ctx.rank + 1.0, device=ctx.device)  # d(sum(Wx + b))/dW = x
    reducer.reduce()
    torch.testing.assert_close(model.weight.grad, want, rtol=0, atol=0,
                               msg=labelled(f"rank {ctx.rank}, a group of one: a module"))
    if ctx.world_size >= 4 and ctx.world_size % 2 == 0:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, ctx.world_size, 2)]
        t = torch.full((3,), ctx.rank + 1.0, device=ctx.device)
        Reducer([t], process_group=pairs[ctx.rank // 2]).reduce()
        first = ctx.rank - ctx.rank % 2  # the pair's ranks hold first + 1 and first + 2
        torch.testing.assert_close(t, torch.full_like(t, first + 1.5), rtol=0, atol=0,
                                   msg=labelled(f"rank {ctx.rank}, a pair"))


def check_reducer_find_unused_gives_zeros_in_the_parameters_dtype(ctx):
    # find_unused_parameters on a bf16 model (no amp): the zero gradient given where a head
    # was not used has the parameter's dtype, as a real gradient would (an fp32 zero put the
    # head in another flat buffer: the ranks' buffers then differed, and the same-size heads
    # b and c were averaged into each other). Reference: the float64 model, the sum over the
    # ranks' batches divided by the world size; bf16 rounding as the tolerance.
    torch.manual_seed(0)
    model = _Branches().to(ctx.device, torch.bfloat16)
    ref = copy.deepcopy(model).double()
    reducer = Reducer(model, find_unused_parameters=True)
    heads = functools.partial(_heads_of_the_end_ranks, ctx)
    g = torch.Generator().manual_seed(17)
    xs = [torch.randn(3, 4, generator=g).to(ctx.device) for _ in range(ctx.world_size)]
    model(xs[ctx.rank].bfloat16(), heads(ctx.rank)).float().backward()
    reducer.reduce()
    for rank in range(ctx.world_size):
        (ref(xs[rank].double(), heads(rank)) / ctx.world_size).backward()
    for name, p in model.named_parameters():
        assert p.grad is None or p.grad.dtype == torch.bfloat16, (name, p.grad.dtype)
    _assert_branch_grads(ctx, model, [p.grad for p in model.parameters()], ref, ", bf16",
                         3e-2, 3e-2)


def check_reducer_find_unused_agrees_within_its_group(ctx):
    # With process_group=g, find_unused_parameters agrees over g's ranks only: over groups of
    # one rank, a head used on another rank is used on no rank of this group and keeps None
    # (a zero gradient there would make the optimizer decay or move it on this rank only).
    # Reference: the same model's backward on this rank's batch alone, in one process.
    singles = _groups_of_one(ctx)
    torch.manual_seed(0)
    model = _Branches().to(ctx.device)
    ref = copy.deepcopy(model)
    reducer = Reducer(model, process_group=singles[ctx.rank], find_unused_parameters=True)
    heads = _heads_of_the_end_ranks(ctx, ctx.rank)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
    model(x, heads).backward()
    reducer.reduce()
    ref(x, heads).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, (ctx.rank, name, p.grad)
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0,
                                       msg=labelled(f"rank {ctx.rank}: {name}"))


def check_reducer_overflow_agreement_stays_within_its_group(ctx):
    # Documented: with Reducers over several process groups the overflow check agrees within
    # each group. Over groups of one rank, an overflow on rank 0 skips rank 0's step only:
    # the other ranks step and keep their loss scale. Reference: amp's own skip flag and
    # loss scale (65536 unchanged where nothing overflowed, halved where it did).
    from mixprec import amp

    singles = _groups_of_one(ctx)
    model, opt, _, _ = _amp_sgd_pairs(ctx, 260, 260, "O2", torch.float16)
    reducer = Reducer(model, process_group=singles[ctx.rank])
    x, y = _global_batch(ctx, seed=261)
    blow_up = 1e4 if ctx.rank == 0 else 1.0
    loss = F.mse_loss(model(_mine(ctx, x)).float(), _mine(ctx, y)) * blow_up
    _reducer_amp_step(amp, reducer, opt, loss, "after")
    assert amp.step_was_skipped(opt) == (ctx.rank == 0), (ctx.rank, amp.step_was_skipped(opt))
    scale = amp.state_dict(optimizer=opt)["loss_scaler0"]["loss_scale"]
    assert scale == (2.0 ** 15 if ctx.rank == 0 else 2.0 ** 16), (ctx.rank, scale)


def check_ddp_agrees_on_gradients_within_its_group(ctx):
    # DistributedDataParallel(process_group=g) agrees over g's ranks only on which parameters
    # got a gradient: over groups of one rank, a head used on another rank only is used on no
    # rank of this group. The first step (the reducer's mode) leaves it out here and the
    # delay mode leaves it alone: its gradient stays None (a zero one would make the
    # optimizer decay or move it on this rank). Reference: the same model's backward on this
    # rank's batch alone, in one process.
    singles = _groups_of_one(ctx)
    heads = _heads_of_the_end_ranks(ctx, ctx.rank)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
    for delay in (False, True):
        torch.manual_seed(0)
        model = _Branches().to(ctx.device)
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, process_group=singles[ctx.rank],
                                      delay_allreduce=delay)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the first step's left-out note)
            ddp(x, heads).backward()
        ref(x, heads).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            what = f"rank {ctx.rank}, delay_allreduce={delay}: {name}"
            if q.grad is None:
                assert p.grad is None, (what, p.grad)
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=labelled(what))


def check_broadcasts_stay_within_the_process_group(ctx):
    # DistributedDataParallel(process_group=g) takes rank 0 OF g's state, in each of its own
    # broadcasts: amp O2's fp32 masters at construction, a module without trainable
    # parameters (passed through), and in the delay mode a layer added after wrapping. Over
    # groups of one rank each broadcast is a no-op, so every rank keeps its own (rank-
    # dependent) values; one sent over the default group would give rank 1 rank 0's values
    # (its masters then no longer match its model, and they are what the optimizer steps).
    # Reference: the values before wrapping / before the forward, exactly.
    from mixprec import amp

    singles = _groups_of_one(ctx)
    group = singles[ctx.rank]

    def snapshot(tensors):
        return [t.detach().clone() for t in tensors]

    def assert_kept(now, before, what):
        for i, (a, b) in enumerate(zip(now, before)):
            torch.testing.assert_close(a.detach(), b, rtol=0, atol=0,
                                       msg=labelled(f"rank {ctx.rank}, {what} #{i}"))
        mine = torch.cat([t.detach().float().flatten() for t in now])
        others = _gather(ctx, mine)
        assert not torch.equal(others[0], others[-1]), f"{what}: ranks should differ"

    # amp O2 masters at construction.
    torch.manual_seed(ctx.rank)
    model = nn.Linear(8, 2).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    masters = snapshot(amp.master_params(opt))
    DistributedDataParallel(model, process_group=group)
    assert_kept(list(amp.master_params(opt)), masters, "fp32 master")

    # A module without trainable parameters, passed through.
    torch.manual_seed(ctx.rank)
    frozen = nn.Linear(8, 2).to(ctx.device).requires_grad_(False)
    state = snapshot(frozen.parameters())
    DistributedDataParallel(frozen, process_group=group)
    assert_kept(list(frozen.parameters()), state, "passed-through parameter")

    # The delay mode following a layer added after wrapping.
    torch.manual_seed(0)
    grown = _IgnoredFirst().to(ctx.device)
    ddp = DistributedDataParallel(grown, delay_allreduce=True, process_group=group)
    torch.manual_seed(ctx.rank)
    grown.extra = nn.Linear(16, 16).to(ctx.device)
    added = snapshot(grown.extra.parameters())
    ddp(torch.randn(2, 8, device=ctx.device)).sum().backward()
    assert_kept(list(grown.extra.parameters()), added, "added layer's parameter")


def check_reducer_module_without_parameters_and_find_unused(ctx):
    # A module without parameters (an activation, a pooling stage built from a config) with
    # find_unused_parameters=True: reduce() has nothing to agree on or average and returns
    # without a collective on any rank. Reference: an all-reduce issued right after it pairs
    # up across the ranks and sums to W(W+1)/2.
    reducer = Reducer(nn.ReLU(), find_unused_parameters=True)
    reducer.reduce()
    t = torch.tensor([ctx.rank + 1.0], device=ctx.device)
    dist.all_reduce(t)
    assert t.item() == ctx.world_size * (ctx.world_size + 1) / 2, t.item()


def check_reducer_errors_while_averaging_reach_the_caller(ctx):
    # reduce() explains a sparse gradient; any other error while averaging reaches the
    # caller unchanged (it must not return as if the tensors were averaged). Tensors made
    # under torch.inference_mode() cannot be written in place outside it: PyTorch's
    # RuntimeError, raised on every rank after the all-reduce.
    with torch.inference_mode():
        t = torch.full((3,), ctx.rank + 1.0, device=ctx.device)
    reducer = Reducer([t])
    try:
        reducer.reduce()
    except RuntimeError as err:
        assert "inference" in str(err).lower(), str(err)
    else:
        raise AssertionError("an in-place write refused by PyTorch was not reported")


def check_reducer_list_of_gradients_replaced_by_zero_grad_warns(ctx):
    # Apex's list form, Reducer([p.grad for p in params]), holds the tensors themselves: once
    # zero_grad() with PyTorch's default set_to_none=True had dropped them, the next backward
    # made new gradients and reduce() averaged the old ones, so each rank stepped on its own
    # gradient without a word (r103B R1). reduce() now warns, once and on rank 0, when none of
    # its tensors has been written since the previous call; set_to_none=False keeps the
    # tensors and stays silent. Reference: the exact mean over the ranks.
    p = nn.Parameter(torch.ones(3, device=ctx.device))
    mean = (ctx.world_size + 1) / 2

    def backward_and_reduce(reducer):
        (p * (ctx.rank + 1.0)).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (reducer or Reducer([p.grad])).reduce()
        return [w for w in caught if issubclass(w.category, RuntimeWarning)]

    assert not backward_and_reduce(None)
    reducer = Reducer([p.grad])
    p.grad.zero_()  # zero_grad(set_to_none=False): the same tensor, written
    assert not backward_and_reduce(reducer), "a kept gradient was taken for a replaced one"
    torch.testing.assert_close(p.grad, torch.full_like(p, mean), rtol=0, atol=0)
    p.grad = None  # zero_grad() as PyTorch does by default
    caught = backward_and_reduce(reducer)
    torch.testing.assert_close(p.grad, torch.full_like(p, ctx.rank + 1.0), rtol=0, atol=0)
    if ctx.rank == 0:
        assert len(caught) == 1, [str(w.message) for w in caught]
        text = str(caught[0].message)
        assert "set_to_none" in text and "Reducer(model)" in text, text
    else:
        assert not caught, [str(w.message) for w in caught]
    p.grad = None
    assert not backward_and_reduce(reducer), "warned twice"
    # Tensors made and averaged under torch.inference_mode() have no version counter: two
    # calls average them, with nothing to read for the check (reading one raised).
    with torch.inference_mode():
        t = torch.full((3,), ctx.rank + 1.0, device=ctx.device)
        frozen = Reducer([t])
        for _ in range(2):
            frozen.reduce()
            torch.testing.assert_close(t, torch.full_like(t, mean), rtol=0, atol=0)
    # An expanded view cannot take its average in place: refused when built, by name.
    try:
        Reducer([p.detach().clone(), torch.zeros(1, device=ctx.device).expand(4)])
    except ValueError as err:
        assert "tensor 1" in str(err) and "expanded" in str(err) and "clone()" in str(err), err
    else:
        raise AssertionError("an expanded tensor was taken")


def check_reducer_averages_non_contiguous_gradients(ctx):
    # Gradients need not be contiguous: a channels_last convolution's weight gradient is
    # channels_last, and a list may hold transposed views. Reducer averages them in place
    # whatever their strides. Reference: the single-process global batch (the convolution),
    # and the exact mean over the ranks (the transposed view, through its base).
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).to(ctx.device).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(conv)
    reducer = Reducer(conv)
    g = torch.Generator().manual_seed(23)
    x = torch.randn(2 * ctx.world_size, 3, 5, 5, generator=g).to(ctx.device)
    x = x.to(memory_format=torch.channels_last)
    conv(x[2 * ctx.rank:2 * ctx.rank + 2]).square().mean().backward()
    assert not conv.weight.grad.is_contiguous()
    reducer.reduce()
    conv_ref_loss = sum(ref(x[2 * r:2 * r + 2]).square().mean() for r in range(ctx.world_size))
    (conv_ref_loss / ctx.world_size).backward()
    for name, p in conv.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad,
                                   rtol=1e-5, atol=1e-6, msg=labelled(f"rank {ctx.rank}: {name}"))
    base = torch.arange(6.0, device=ctx.device).reshape(2, 3) * (ctx.rank + 1)
    Reducer([base.t()]).reduce()
    mean = (ctx.world_size + 1) / 2
    torch.testing.assert_close(base, torch.arange(6.0, device=ctx.device).reshape(2, 3) * mean,
                               rtol=0, atol=0, msg=labelled(f"rank {ctx.rank}: a transposed view"))


def check_reducer_makes_one_flat_all_reduce_per_dtype(ctx):
    # Documented (Reducer's docstring, all_reduce_average_coalesced and broadcast_coalesced):
    # Reducer(model) broadcasts rank 0's parameters in one flat broadcast per (device, dtype),
    # and each reduce() makes one flat all-reduce per (device, dtype), whatever the number of
    # tensors, not one per tensor (Apex's flat_dist_call). The averages stay exact. A reference
    # for the averages: the values each rank set, averaged by hand.
    broadcasts, real_broadcast = [], dist.broadcast

    def counting_broadcast(tensor, *args, **kwargs):
        broadcasts.append(tensor.numel())
        return real_broadcast(tensor, *args, **kwargs)

    model = _mlp(ctx.device, seed=300 + ctx.rank)  # 4 fp32 parameters, different per rank
    numel = sum(p.numel() for p in model.parameters())
    dist.broadcast = counting_broadcast
    try:
        reducer = Reducer(model)
    finally:
        dist.broadcast = real_broadcast
    assert broadcasts == [numel], f"Reducer(model) broadcasts of sizes {broadcasts}, not [{numel}]"
    _assert_same_on_all_ranks(ctx, list(model.parameters()), "parameter after Reducer()")
    ref = copy.deepcopy(model)
    x, y = _global_batch(ctx, seed=41)
    F.mse_loss(model(_mine(ctx, x)), _mine(ctx, y)).backward()
    with _counting_all_reduces() as calls:
        reducer.reduce()
    assert calls == [numel], f"reduce() made all-reduces of sizes {calls}, not one of {numel}"
    F.mse_loss(ref(x), y).backward()
    _assert_same_grads(ctx, model, ref)
    # find_unused_parameters=True adds one all-reduce of the flags (documented: one flag per
    # parameter, and one per parameter for gradients a scale_loss block holds aside), then
    # the same single flat all-reduce of the gradients.
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    reducer = Reducer(model, find_unused_parameters=True)
    F.mse_loss(model(_mine(ctx, x)), _mine(ctx, y)).backward()
    with _counting_all_reduces() as calls:
        reducer.reduce()
    assert calls == [2 * 4, numel], f"find_unused reduce() made all-reduces of sizes {calls}"
    F.mse_loss(ref(x), y).backward()
    _assert_same_grads(ctx, model, ref)
    # A list of three tensors of two dtypes: one all-reduce per dtype (3 + 4 fp32, 2 fp64).
    tensors = [torch.full((3,), ctx.rank + 1.0, device=ctx.device),
               torch.full((2,), ctx.rank + 1.0, dtype=torch.float64, device=ctx.device),
               torch.full((4,), 10.0 * (ctx.rank + 1), device=ctx.device)]
    with _counting_all_reduces() as calls:
        Reducer(tensors).reduce()
    assert sorted(calls) == [2, 7], f"all-reduces of sizes {calls}, not one of 7 and one of 2"
    mean = (ctx.world_size + 1) / 2
    for t, value in zip(tensors, (mean, mean, 10 * mean)):
        torch.testing.assert_close(t, torch.full_like(t, value), rtol=0, atol=0)


class _SparseAndDense(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.emb = nn.Embedding(5, 3, sparse=True)

    def forward(self, idx):
        return self.fc(self.emb(idx)).sum()


def check_reducer_sparse_error_names_the_sparse_parameters_only(ctx):
    # reduce() on a model with a sparse embedding among dense layers: the error names the
    # parameters whose gradients are sparse (what the user must change), not every parameter
    # with a gradient. (CPU: the sparse embedding backward; the same on every rank, so every
    # rank raises before any collective.)
    # (R14)
    if ctx.device.type != "cpu":
        return
    torch.manual_seed(0)
    model = _SparseAndDense()
    reducer = Reducer(model)
    model(torch.tensor([ctx.rank])).backward()
    try:
        reducer.reduce()
    except TypeError as err:
        assert "['emb.weight']" in str(err) and "fc." not in str(err), str(err)
    else:
        raise AssertionError("a sparse gradient among dense ones did not raise TypeError")


def check_reducer_find_unused_at_o2_after_the_scale_loss_block(ctx):
    # Reducer(find_unused_parameters=True) at O2 with reduce() AFTER the scale_loss block
    # (the documented alternative to inside it): the gradients are then the fp32 masters'. The
    # head used on rank 0 only has a master gradient there and none on the last rank, and the
    # other way round for its twin (same size: mismatched, one was averaged into the other);
    # each needs a zero one where it has none; the head used nowhere keeps None. Reference:
    # the float64 model, the sum over the ranks' batches divided by the world size; bf16
    # rounding of the forward as the tolerance.
    # (R16)
    from mixprec import amp

    model, ref, opt, reducer = _reducer_under_amp(ctx, _Branches, "O2")
    heads = functools.partial(_heads_of_the_end_ranks, ctx)
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(3, 4, generator=g).to(ctx.device) for _ in range(ctx.world_size)]
    with amp.scale_loss(model(xs[ctx.rank].bfloat16(), heads(ctx.rank)).float(), opt) as s:
        s.backward()
    reducer.reduce()
    for rank in range(ctx.world_size):
        (ref(xs[rank].double(), heads(rank)) / ctx.world_size).backward()
    masters = dict(zip([id(p) for p in model.parameters()], amp.master_params(opt)))
    _assert_branch_grads(ctx, model, [masters[id(p)].grad for p in model.parameters()], ref,
                         ", masters", 3e-2, 3e-2)


class _Abandoned(Exception):
    """Raised inside a scale_loss block after reduce() (a later guard failing)."""


def check_reducer_find_unused_then_a_failed_scale_loss_block_gives_the_averages_back(ctx):
    # amp O1 at a loss scale other than 1, two micro-batches without delay_unscale: the first
    # micro-batch's gradients wait aside during the second block, and
    # Reducer(find_unused_parameters=True).reduce() inside it averages them in place (a zero
    # set aside where a rank had none). When the block then raises, amp gives back what was
    # set aside: every rank's parameters hold the averaged first micro-batch, each parameter
    # exactly once (a zero entry beside a real one must not replace it); the head used
    # nowhere keeps None. Reference: the float64 sum over the ranks' first micro-batches
    # divided by the world size; bf16 autocast's rounding as the tolerance.
    # (R17)
    from mixprec import amp

    model, ref, opt, reducer = _reducer_under_amp(ctx, _Branches, "O1")
    heads = functools.partial(_heads_of_the_end_ranks, ctx)
    g = torch.Generator().manual_seed(13)
    xs = [torch.randn(3, 4, generator=g).to(ctx.device) for _ in range(ctx.world_size)]
    with amp.scale_loss(model(xs[ctx.rank], heads(ctx.rank)), opt) as scaled:
        scaled.backward()
    try:
        with amp.scale_loss(model(xs[ctx.rank], []), opt) as scaled:
            scaled.backward()
            reducer.reduce()
            raise _Abandoned()
    except _Abandoned:
        pass
    for rank in range(ctx.world_size):
        (ref(xs[rank].double(), heads(rank)) / ctx.world_size).backward()
    _assert_branch_grads(ctx, model, [p.grad for p in model.parameters()], ref,
                         ", the block abandoned", 3e-2, 3e-2)


def check_allreduce_always_fp32_keeps_float64_gradients(ctx):
    # allreduce_always_fp32 sums HALF gradients in fp32 (its documented meaning): a float64
    # model's gradients are summed in float64, not rounded to fp32 on the way. Reference: the
    # float64 single-process global batch, to float64 precision (fp32 rounding is ~1e-8
    # relative: far outside the bound).
    # (C02)
    for delay in (False, True):
        model = _mlp(ctx.device).double()
        ref = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, allreduce_always_fp32=True, delay_allreduce=delay)
        x, y = _global_batch(ctx, seed=97)
        x, y = x.double(), y.double()
        F.mse_loss(ddp(_mine(ctx, x)), _mine(ctx, y)).backward()
        F.mse_loss(ref(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad.dtype == torch.float64, (name, p.grad.dtype)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14,
                                       msg=labelled(f"delay={delay} {name}"))


class _FrozenWithCounter(nn.Module):
    """No trainable parameters (DDP passes it through, broadcasting its state from rank 0):
    fp32 parameters and buffer, and an int64 counter past fp32's exact integers (2**24)."""

    def __init__(self, rank):
        super().__init__()
        self.fc = nn.Linear(2, 2).requires_grad_(False)
        self.register_buffer("scale", torch.full((2,), 1.0 + rank))
        self.register_buffer("step", torch.tensor([2 ** 40 + 1 + rank]))

    def forward(self, x):
        return self.fc(x) * self.scale


def check_state_of_every_dtype_broadcast_exactly(ctx):
    # Wrapping broadcasts rank 0's state, each tensor exactly in its own dtype: an int64
    # counter (a step count, a seed) beside fp32 tensors must not pass through fp32 on the
    # way (2**40 + 1 is not an fp32 value). Reference: rank 0's values, bit for bit.
    # (C08)
    model = _FrozenWithCounter(ctx.rank).to(ctx.device)
    DistributedDataParallel(model)
    assert model.step.dtype == torch.int64
    assert model.step.tolist() == [2 ** 40 + 1], (ctx.rank, model.step.tolist())
    torch.testing.assert_close(model.scale, torch.ones(2, device=ctx.device), rtol=0, atol=0)


def check_change_noticed_by_its_registration_alone(ctx):
    # The wrapper notices a change to its module through PyTorch's registration hooks (see
    # mixprec.parallel._structure): both kinds count alone. A layer built BEFORE the last
    # forward and only afterwards put in the model (its parameters' registrations came
    # earlier; only the submodule's registration moves the counter), and a parameter replaced
    # on a layer that stays (only the parameter's registration moves it): each is refused at
    # the next forward with its names, as a layer built after the forward is.
    # (S01 S02)
    x, _ = _global_batch(ctx)
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    spare = nn.Linear(16, 4).to(ctx.device)  # (built before the forward below)
    _grads_match_global_batch(ctx, ddp, model, ref, 630, "before the change")
    model[2] = spare
    _expect_changed(ctx, ddp, x, "2.weight, 2.bias are new parameter objects")
    model = _mlp(ctx.device)
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    _grads_match_global_batch(ctx, ddp, model, ref, 631, "before the change")
    model[2].weight = nn.Parameter(model[2].weight.detach().clone())
    _expect_changed(ctx, ddp, x, "2.weight")


# Tests from the mutation run r97A (sessions 49-51's following of PyTorch's DDP's
# no_sync(): records taken up, cleared and kept across checkpoint recomputes and
# evaluations; models run inside a DDP's forward that are not its modules).


def _written_in_place(ref):
    with torch.no_grad():  # (PyTorch's DDP broadcast writes the half model in place)
        for p in ref.parameters():
            p.copy_(p.clone())


def _bare_step_after_window(ctx, window_reentrant, bare, backward_in_window):
    """A PyTorch DDP over the amp model under one activation checkpoint (reentrant or not);
    one micro-batch forward inside no_sync() (its backward too if asked); the window dropped
    (zero_grad); then a step of the model outside any DDP, through ``bare`` (a callable
    wrapping the amp model). Reference: the same bare step on a copy never wrapped: bitwise."""
    from mixprec import amp

    model = _mlp(ctx.device)
    model, opt, ref, ref_opt = _amp_o2_sgd_pair(model, copy.deepcopy(model), loss_scale=64.0)
    ddp = nn.parallel.DistributedDataParallel(_CheckpointedOuter(model, window_reentrant))
    _written_in_place(ref)
    x, y = _global_batch(ctx, seed=150)
    with ddp.no_sync():
        out = ddp(_mine(ctx, x))
        if backward_in_window:
            with amp.scale_loss(F.mse_loss(out.float(), _mine(ctx, y)), opt) as s:
                s.backward()
    opt.zero_grad()
    _amp_step_mse(bare(model), opt, x, y, amp)
    _amp_step_mse(bare(ref), ref_opt, x, y, amp)
    for m, r in zip(amp.master_params(opt), amp.master_params(ref_opt)):
        torch.testing.assert_close(m, r, rtol=0, atol=0)


def check_bare_forward_after_a_reentrant_no_sync_micro_batch(ctx):
    # r97A-D07 (the recompute's record sets GRAD_SYNC_DEFERRED without _SET_BY_TORCH_DDP):
    # a reentrant-checkpointed no_sync() micro-batch (forward and backward), the window
    # dropped, then a plain step of the bare amp model: it must unscale as usual.
    _bare_step_after_window(ctx, True, lambda m: m, backward_in_window=True)


def check_bare_non_reentrant_checkpoint_after_a_reentrant_no_sync_micro_batch(ctx):
    # r97A-D06 (the recompute reads the no_grad record without popping it): as above, the
    # bare step running the amp model under a non-reentrant checkpoint: its recompute must
    # not take up the window's stale no_grad record.
    _bare_step_after_window(ctx, True, lambda m: _CheckpointedOuter(m, False),
                            backward_in_window=True)


def check_bare_model_evaluation_between_a_no_sync_forward_and_its_backward_outside(ctx):
    # r97A-D09 (a forward under no_grad outside any DDP clears the no_sync() record): the
    # bare amp model (ddp.module) evaluated under no_grad between a no_sync() forward and its
    # backward run after leaving no_sync() (StyleGAN2-ADA's order): the held micro-batches
    # must stay scaled for the synced one. O1/O2 against one process on the global batch.
    _torch_ddp_steps_match_reference(ctx, (), functools.partial(
        _forward_inside_no_sync_backward_outside, ctx,
        evaluate=("mid", lambda ddp, x: ddp.module(x))))


def check_evaluation_through_ddp_before_each_checkpointed_no_sync_forward(ctx):
    # r97A-D14 (a forward with grad inside the DDP leaves an earlier no_grad record pending):
    # an evaluation under no_grad through the DDP before each micro-batch (outside no_sync()),
    # the amp model under a non-reentrant checkpoint, forwards inside no_sync() and backwards
    # outside (StyleGAN2-ADA's order): the recompute must keep the no_sync() forward's record,
    # not the evaluation's.
    _torch_ddp_steps_match_reference(ctx, (False,), functools.partial(
        _forward_inside_no_sync_backward_outside, ctx,
        evaluate=("before", lambda ddp, x: ddp(x))))


class _WithTeacher(nn.Module):
    """A module whose forward also runs another amp model that is not one of its modules (a
    distillation teacher or a loss network, kept in a list)."""

    def __init__(self, net, teacher):
        super().__init__()
        self.net, self._teacher = net, [teacher]

    def forward(self, x):
        with torch.no_grad():
            self._teacher[0](x)
        return self.net(x)


def _ddp_and_a_model_beside(ctx, wrapper):
    """An amp O2 model a (its own optimizer) inside a PyTorch DDP over ``wrapper(a, b)``, where
    b is an amp model with its own optimizer that is not one of the DDP's modules, and a
    reference pair for b never near a DDP: (ddp, a's optimizer, b, b's optimizer, ref,
    ref's optimizer)."""
    from mixprec import amp

    a = _mlp(ctx.device)
    a_opt = torch.optim.SGD(a.parameters(), lr=0.05)
    a, a_opt = amp.initialize(a, a_opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    b = _mlp(ctx.device, seed=5)
    b, b_opt, ref, ref_opt = _amp_o2_sgd_pair(b, copy.deepcopy(b), loss_scale=64.0)
    return nn.parallel.DistributedDataParallel(wrapper(a, b)), a_opt, b, b_opt, ref, ref_opt


def check_model_run_inside_a_ddp_forward_but_not_its_module_trains_inside_no_sync(ctx):
    # r97A-D20 (torch_ddp_skips_this_backward ignores whether the model is the DDP's) and
    # r97A-D24 (a cached membership answer read as True): an amp model b with its own
    # optimizer, run (under no_grad) inside a PyTorch DDP's no_sync() forward without being
    # one of its modules, then trained on its own inside that no_sync() block, two
    # iterations: its steps run as for a model never near the DDP, bit for bit.
    from mixprec import amp

    ddp, _, b, b_opt, ref, ref_opt = _ddp_and_a_model_beside(ctx, _WithTeacher)
    for it in range(2):
        x, y = _global_batch(ctx, seed=9 + it)
        with ddp.no_sync():
            ddp(_mine(ctx, x))  # (a's micro-batch; its backward is beside the point)
            _amp_step_mse(b, b_opt, x, y, amp)
        _amp_step_mse(ref, ref_opt, x, y, amp)
        for m, r in zip(amp.master_params(b_opt), amp.master_params(ref_opt)):
            torch.testing.assert_close(m, r, rtol=0, atol=0)


class _WithSideModel(nn.Module):
    """A module whose forward also runs, with grad, another amp model that is not one of its
    modules (kept in a list: each rank's own, left out of the all-reduce), returning both."""

    def __init__(self, net, side):
        super().__init__()
        self.net, self._side = net, [side]

    def forward(self, x):
        return self.net(x), self._side[0](x)


def check_side_model_run_with_grad_inside_a_ddp_forward_trains_inside_no_sync(ctx):
    # r97A-D24 (a cached membership answer read as True): an amp model b with its own
    # optimizer, run with grad inside a PyTorch DDP's forward without being one of its
    # modules, trained from that output inside no_sync(), three iterations: each of b's steps
    # runs as for a model never near the DDP, bit for bit.
    from mixprec import amp

    ddp, _, b, b_opt, ref, ref_opt = _ddp_and_a_model_beside(ctx, _WithSideModel)
    for it in range(3):
        x, y = _global_batch(ctx, seed=9 + it)
        with ddp.no_sync():
            _, side = ddp(x)
            b_opt.zero_grad()
            with amp.scale_loss(F.mse_loss(side.float(), y), b_opt) as s:
                s.backward()
            b_opt.step()
        _amp_step_mse(ref, ref_opt, x, y, amp)
        for m, r in zip(amp.master_params(b_opt), amp.master_params(ref_opt)):
            torch.testing.assert_close(m, r, rtol=0, atol=0)


CHECKS = [
    "check_grads_match_single_process",
    "check_compiled_grads_match_single_process",
    "check_broadcast_from_rank0_and_state_dict",
    "check_hook_only_where_apex_arithmetic_needs_it",
    "check_pickle_roundtrip",
    *DELAY_CHECKS,
    *FIRST_STEP_CHECKS,
    "check_message_size_sets_bucket_bytes",
    "check_unused_parameters_found",
    "check_arguments_validated_and_warned",
    "check_amp_and_norm_warnings_come_from_rank_zero",
    "check_reducer",
    "check_reducer_broadcasts_frozen_parameters",
    "check_reducer_find_unused_parameters",
    "check_reducer_with_amp_o2",
    "check_reducer_amp_overflow_on_one_rank",
    "check_reducer_inside_an_accumulating_scale_loss_block",
    "check_amp_o2_ddp_masters_bitwise_identical",
    "check_amp_o2_ddp_checkpoint_resume_continues_bit_for_bit",
    "check_apex_imagenet_recipe_resumes_bit_for_bit_from_rank0s_file",
    "check_gan_three_losses_overflow_in_one_loss_on_one_rank_and_resume",
    "check_amp_o2_ddp_dcp_checkpoint_resume_continues_bit_for_bit",
    "check_ddp_of_a_compiled_amp_model_trains_as_eager",
    "check_amp_o2_apex_accumulation_with_every_micro_batch_all_reduced",
    "check_larc_under_amp_o2_and_ddp_matches_float64_larc",
    "check_syncbn_pool_branch_with_one_image_per_rank_matches_batchnorm",
    "check_frozen_syncbn_fine_tuning_under_amp_o2_ddp",
    "check_frozen_bn_statistics_fine_tuning_under_amp_o2_delay_allreduce",
    "check_amp_o2_under_torch_ddp",
    "check_amp_o2_accumulation_with_no_sync",
    "check_amp_o2_dropped_window_under_torch_ddp_with_unused_parameters",
    "check_amp_accumulation_under_torch_ddp_no_sync_needs_no_delay_unscale",
    "check_amp_forward_outside_torch_ddp_after_no_sync_unscales",
    "check_amp_o2_resume_under_torch_ddp_loaded_after_wrapping_continues_bit_for_bit",
    "check_amp_accumulation_under_torch_ddp_no_sync_through_activation_checkpointing",
    "check_amp_model_in_another_thread_is_not_read_as_inside_torch_ddp_no_sync",
    "check_amp_torch_ddp_join_uneven_no_sync_windows_match_delay_unscale",
    "check_amp_accumulation_under_torch_ddp_options_needs_no_delay_unscale",
    "check_amp_compiled_torch_ddp_no_sync_with_delay_unscale",
    "check_amp_two_loss_ids_inside_torch_ddp_no_sync",
    "check_amp_torch_ddp_no_grad_evaluation_between_micro_batches",
    "check_amp_torch_ddp_no_grad_evaluation_between_forward_and_backward",
    "check_amp_torch_ddp_no_sync_through_nested_activation_checkpoints",
    "check_amp_torch_ddp_synced_forward_with_its_backward_inside_no_sync_unscales",
    "check_amp_torch_ddp_evaluation_on_one_rank_inside_a_synced_micro_batch",
    "check_amp_torch_ddp_forward_inside_no_sync_with_its_backward_outside",
    "check_amp_torch_ddp_forward_inside_no_sync_backward_outside_with_delay_unscale",
    "check_amp_gan_under_two_torch_ddps_with_no_sync_on_the_discriminator",
    "check_amp_accumulation_under_torch_ddp_static_graph_needs_no_delay_unscale",
    "check_amp_torch_ddp_no_sync_with_checkpoint_over_part_of_the_amp_model",
    "check_amp_torch_ddp_membership_cache_keeps_nothing_alive_and_takes_unhashable_ddp",
    "check_amp_o2_masters_broadcast_from_rank0",
    "check_sliced_parameters_initialized_per_rank_train_as_one_model_under_either_ddp",
    "check_join_under_amp_keeps_fp32_masters_and_one_loss_scale",
    "check_join_under_amp_over_a_process_group_without_rank_0",
    "check_module_without_trainable_parameters_checks_shapes",
    "check_amp_o2_rank_dependent_init_under_either_ddp",
    "check_amp_accumulation_with_no_sync_needs_no_delay_unscale",
    "check_amp_o1_accumulates_all_reduced_micro_batches",
    "check_no_sync_deferral_follows_the_models_that_ran",
    "check_amp_o2_ddp_syncbn_compiled",
    "check_amp_o2_fp16_dynamic_scale_on_device_under_ddp",
    "check_larc_under_amp_o2_and_ddp",
    "check_unused_parameters_named_in_error",
    "check_reducer_after_a_backward_that_raised_says_what_to_do",
    "check_unused_parameters_named_as_the_reducer_was_built",
    "check_apex_flat_dist_call",
    "check_amp_half_refuses_a_model_already_inside_torch_ddp",
    "check_unused_parameters_named_with_ignored_ones_left_out",
    "check_unfrozen_after_wrapping_is_refused",
    "check_join_divides_uneven_steps_as_asked",
    "check_delay_allreduce_steps_warn_nothing",
    "check_half_gradients_predivided_and_summed_in_half",
    "check_prof_keeps_the_arithmetic_asked_for",
    "check_reducer_find_unused_at_o2_with_fp32_layers_set_aside",
    "check_reducer_find_unused_parameters_counts_a_frozen_parameters_leftover_gradient",
    "check_reducer_takes_a_layer_added_under_ignored_names",
    "check_delay_allreduce_reduces_what_a_layer_accumulated_before_its_freeze",
    "check_apex_flat_dist_call_keeps_each_dtype",
    "check_pytorch_arguments_named_beside_unknown_ones",
    "check_long_name_lists_shortened_exactly",
    "check_arguments_refused_where_a_bool_or_nan_would_slip_through",
    "check_default_construction_warns_nothing",
    "check_constructor_warnings_point_at_the_callers_line",
    "check_apex_internals_override_warned_through_a_base_class",
    "check_unused_parameters_named_with_tied_weights",
    "check_message_size_counts_elements_of_the_trainable_majority_dtype",
    "check_gradients_are_views_of_the_reducers_buckets",
    "check_join_refusal_names_the_options_that_use_the_hook",
    "check_module_errors_reach_the_caller_unchanged",
    "check_first_step_leaves_out_a_root_parameter",
    "check_first_step_rebuild_keeps_message_size_and_names",
    "check_first_step_rebuild_keeps_the_wrapper_compilable",
    "check_enable_allreduce_after_a_synced_forward",
    "check_zero_grad_passes_set_to_none",
    "check_message_size_of_one_element",
    "check_predivide_factor_given_as_an_int",
    "check_amp_no_sync_micro_batch_past_an_evaluation_forward",
    "check_apex_flat_dist_call_over_model_parameters",
    "check_partly_frozen_model_evaluates_without_grad",
    "check_process_group_refused_when_not_a_group",
    "check_process_group_without_this_rank_refused",
    "check_shared_param_false_still_warns_deprecated",
    "check_process_group_passed_by_position_is_refused",
    "check_delay_allreduce_buckets_fill_to_message_size",
    "check_delay_allreduce_follow_keeps_each_ranks_buffers",
    "check_delay_allreduce_follow_keeps_ignored_buffers_local",
    "check_reducer_averages_complex_tensors",
    "check_reducer_over_a_group_averages_over_that_group",
    "check_reducer_sparse_error_names_the_sparse_parameters_only",
    "check_reducer_find_unused_at_o2_after_the_scale_loss_block",
    "check_reducer_find_unused_then_a_failed_scale_loss_block_gives_the_averages_back",
    "check_allreduce_always_fp32_keeps_float64_gradients",
    "check_state_of_every_dtype_broadcast_exactly",
    "check_change_noticed_by_its_registration_alone",
    "check_reducer_find_unused_gives_zeros_in_the_parameters_dtype",
    "check_reducer_find_unused_agrees_within_its_group",
    "check_reducer_overflow_agreement_stays_within_its_group",
    "check_ddp_agrees_on_gradients_within_its_group",
    "check_broadcasts_stay_within_the_process_group",
    "check_reducer_module_without_parameters_and_find_unused",
    "check_reducer_errors_while_averaging_reach_the_caller",
    "check_reducer_list_of_gradients_replaced_by_zero_grad_warns",
    "check_reducer_averages_non_contiguous_gradients",
    "check_reducer_makes_one_flat_all_reduce_per_dtype",
    "check_simclr_recipe_matches_the_single_process_float64_run",
    "check_unheld_gradient_warning_under_torch_ddp_bucket_views",
    "check_bare_forward_after_a_reentrant_no_sync_micro_batch",
    "check_bare_non_reentrant_checkpoint_after_a_reentrant_no_sync_micro_batch",
    "check_bare_model_evaluation_between_a_no_sync_forward_and_its_backward_outside",
    "check_evaluation_through_ddp_before_each_checkpointed_no_sync_forward",
    "check_model_run_inside_a_ddp_forward_but_not_its_module_trains_inside_no_sync",
    "check_side_model_run_with_grad_inside_a_ddp_forward_trains_inside_no_sync",
    "check_hand_all_reduce_after_a_delayed_overflow_check_skips_on_every_rank",
    "check_flat_dist_call_broadcast_after_initialize_syncs_the_masters",
]
# FSDP2 (fully_shard) runs on the CPU from PyTorch 2.7 ("FSDP requires CUDA for streams"
# before 2.6; 2.6's CPU stream has no record_event): its training check is left out there.
_FSDP2_ON_CPU = hasattr(torch.cpu.Stream, "record_event")
CPU_ONLY = ["check_fsdp1_sharded_model_at_o1_skips_an_overflow_on_every_rank",
            *(["check_fsdp2_sharded_model_at_o1_skips_an_overflow_on_every_rank"]
              if _FSDP2_ON_CPU else []),
            # (Where there is no GPU: on the one-GPU machine fully_shard took the model to the
            # GPU both ranks share over gloo, and a launch of this check alone crashed there,
            # SIGSEGV, before it ran. Not yet made to run there.)
            *(["check_fsdp2_root_parameters_are_not_taken_for_gradients_no_optimizer_holds"]
              if _FSDP2_ON_CPU and not torch.cuda.is_available() else []),
            "check_half_model_of_an_fsdp_sharded_model_is_refused",
            "check_dead_peer_raises_quickly"]  # (last: it ends the workers)


@pytest.fixture(scope="module")
def gloo_results():
    return run_checks(__name__, CHECKS + CPU_ONLY, world_size=2)


@pytest.fixture(scope="module")
def nccl_results():
    if cuda_count() < 2:
        pytest.skip("requires 2 GPUs")
    return run_checks(__name__, CHECKS, world_size=2, backend="nccl", device_type="cuda")


@pytest.fixture(scope="module")
def one_gpu_gloo_results():
    if cuda_count() < 1:
        pytest.skip("requires CUDA")
    return run_checks(__name__, DELAY_CHECKS + FIRST_STEP_CHECKS, world_size=2,
                      device_type="cuda", shared_device=True)


@pytest.mark.parametrize("check", DELAY_CHECKS + FIRST_STEP_CHECKS)
def test_one_gpu_gloo(one_gpu_gloo_results, check):
    one_gpu_gloo_results.assert_ok(check)


@pytest.mark.parametrize("check", CHECKS + CPU_ONLY)
def test_cpu_gloo(gloo_results, check):
    gloo_results.assert_ok(check)


@pytest.mark.parametrize("check", CHECKS)
def test_gpu_nccl(nccl_results, check):
    nccl_results.assert_ok(check)


# ------------------------------------------------------------------------------------------------
# single process, no process group
# ------------------------------------------------------------------------------------------------
def test_ddp_requires_init_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["delay_allreduce", "gradient_average", "prof",
                                  "allreduce_always_fp32", "find_unused_parameters",
                                  "retain_allreduce_buffers"])
def test_ddp_flag_given_as_a_string_is_refused(name):
    # (gradient_average="no" stayed True; checked before the process group is looked for.)
    with pytest.raises(TypeError, match=rf"DistributedDataParallel\({name}='no'\): expected "
                                        r"True or False, got str"):
        DistributedDataParallel(nn.Linear(2, 2), **{name: "no"})


def test_reducer_errors_without_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(TypeError, match=r"Reducer\(module_or_grads_list=str\).*iterable of"):
        Reducer("weights")
    with pytest.raises(TypeError, match=r"holding \['float'\]"):
        Reducer([torch.ones(2), 3.0])
    with pytest.raises(TypeError, match="holding no tensors"):
        Reducer([])
    # Integers cannot be averaged in their dtype: refused when given (it failed in reduce()
    # with "result type Float can't be cast to the desired output type Long").
    with pytest.raises(TypeError, match=r"tensor 1 is torch.int64.*floating"):
        Reducer([torch.ones(2), torch.tensor([1, 2])])
    with pytest.raises(TypeError, match=r"tensor 1 is torch.bool.*floating"):  # (no mean)
        Reducer([torch.ones(2), torch.tensor([True, False])])
    with pytest.raises(TypeError, match=r"Reducer\(process_group=2\).*ProcessGroup"):
        Reducer(nn.Linear(2, 2), process_group=2)
    # The error says how to start a process group, not only that it is missing.
    with pytest.raises(RuntimeError, match=r"Reducer was used before torch.distributed."
                                           r"init_process_group\(\)\. Launch the script with "
                                           r"torchrun.*backend='nccl' on GPUs or 'gloo' on CPUs"):
        Reducer(nn.Linear(2, 2))


def test_rank_that_never_joins_raises_within_timeout():
    # The documented guarantee: with init_process_group(timeout=...), a rank whose peer never
    # arrives gets an error naming the wait, not a hang. (Rank 0 of 2, alone.)
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=2,
            timeout=datetime.timedelta(seconds=2),
        )
    elapsed = time.monotonic() - start
    assert elapsed < 20, f"took {elapsed:.1f}s"
    text = str(info.value).lower()
    assert "time" in text and "1/2" in text, text
    assert not dist.is_initialized()


def test_reducer_refuses_a_string_among_the_tensors():
    # A str is iterable (its characters are one-character strings, iterable again): the list
    # check must name it as a bad leaf, not recurse into it until Python's recursion limit.
    # Checked before the process group is looked for. (R01)
    with pytest.raises(TypeError, match=r"holding \['str'\]"):
        Reducer([torch.ones(2), ["weight"]])


def test_reducer_names_bytes_among_the_tensors():
    # bytes are iterable too (over their ints): the list check names the bytes object as the
    # bad leaf, not the ints inside it. Checked before the process group is looked for.
    # (mutation r80A R34: bytes dropped from the leaf types, the message said ['int'].)
    with pytest.raises(TypeError, match=r"holding \['bytes'\]"):
        Reducer([torch.ones(2), [b"weight"]])


@pytest.mark.parametrize("flag", ["no", 1, None])
def test_reducer_refuses_a_non_bool_find_unused_parameters(flag):
    # find_unused_parameters="no" would have switched the agreement on (any non-empty string
    # is truthy): refused with the value named, before the process group is looked for. (R05)
    with pytest.raises(TypeError, match=rf"Reducer\(find_unused_parameters={flag!r}\): "
                                        r"expected True or False"):
        Reducer(nn.Linear(2, 2), find_unused_parameters=flag)


def test_reducer_refuses_a_single_tensor():
    # A tensor is iterable (over its rows), but Reducer(t) is a mistake for Reducer([t]) or
    # for the module: refused with the type named and the list form shown, before the process
    # group is looked for. (R06)
    with pytest.raises(TypeError, match=r"Reducer\(module_or_grads_list=Tensor\).*"
                                        r"\[p\.grad for p in params\]"):
        Reducer(torch.ones(3, 2))


@pytest.mark.parametrize("group", [True, b"gloo", -100.0])
def test_a_bool_bytes_or_float_process_group_is_refused(group):
    # Where the process group goes, a number or a backend name (str or bytes) is a mistake:
    # refused when built, naming the value. The group-size hint is for integers only (True
    # is no group size), and torch's non-member sentinel is taken only as the int it is.
    # Checked before the process group is looked for.
    # (C03 C04 C05)
    with pytest.raises(TypeError, match=r"Reducer\(process_group=.*ProcessGroup") as info:
        Reducer(nn.Linear(2, 2), process_group=group)
    assert "group size" not in str(info.value), str(info.value)


def test_structure_version_moves_at_the_first_registration_and_hooks_install_once():
    # The wrappers' change tracking (mixprec.parallel._structure): in a fresh process, the
    # very first registration after watch() moves the version (a wrapper built first in a
    # script compares against it), and watch() called by every wrapper installs PyTorch's
    # process-wide hooks once (each extra pair would run at every registration for the rest
    # of the process). A fresh interpreter: the version starts at the process's start.
    code = (
        "import torch\n"
        "from torch.nn.modules import module as m\n"
        "from mixprec.parallel import _structure\n"
        "before = (len(m._global_parameter_registration_hooks),\n"
        "          len(m._global_module_registration_hooks))\n"
        "_structure.watch()\n"
        "seen = _structure.version()\n"
        "torch.nn.Module().register_parameter('w', torch.nn.Parameter(torch.ones(1)))\n"
        "assert _structure.version() != seen, ('first registration unseen', seen)\n"
        "seen = _structure.version()\n"
        "torch.nn.Module().add_module('child', torch.nn.Module())\n"
        "assert _structure.version() != seen, ('submodule registration unseen', seen)\n"
        "for _ in range(3):\n"
        "    _structure.watch()\n"
        "after = (len(m._global_parameter_registration_hooks),\n"
        "         len(m._global_module_registration_hooks))\n"
        "assert after == (before[0] + 1, before[1] + 1), (before, after)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
