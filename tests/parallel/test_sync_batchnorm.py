"""SyncBatchNorm against BatchNorm on the global batch, across processes, and on its own.

Reference: ``F.batch_norm`` in float64 over the concatenation of every rank's batch (rounded to
the test dtype first), giving outputs, input gradients, weight/bias gradients (compared with the
SUM of the ranks' local parameter gradients) and running statistics.

Paths: on CPU every distributed case runs twice, through the plain-PyTorch path and through the
fused (CUDA) path with CPU stand-ins for PyTorch's CUDA-only kernels (``_fused_emulation``); on
CUDA through the real kernels. Groups: 2 processes (gloo), 4 processes (gloo: an empty rank,
process groups), and on GPUs 2 processes over NCCL, and 2 processes sharing one GPU over gloo.

Tolerances (outputs and input gradients; parameter gradients and running statistics are fp32
from the same rounded inputs, so tighter): fp32 1e-5, bf16 1.6e-2 relative / 1e-2 absolute
(one bf16 rounding of the output), fp16 2e-3.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import pickle
import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mixprec.parallel import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group
from mixprec.parallel import _sync_batchnorm_function as fn
from tests._triton import interpreter_skip_reason
from tests.parallel._fused_emulation import emulated_fused_path
from tests.parallel._harness import cuda_count, labelled, run_checks

OUT_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}
STAT_TOL = dict(rtol=1e-4, atol=1e-5)

# Workers of the CPU groups get TRITON_INTERPRET=1 (see the fixtures) where the interpreter
# computes the kernels correctly (tests/_triton.py).
_INTERPRETER = interpreter_skip_reason() is None
_CPU_ENV = {"TRITON_INTERPRET": "1"} if interpreter_skip_reason(require_env=False) is None else None


# The CPU paths: PyTorch's, and the fused path with CPU stand-ins for its kernels.
_CPU_PATHS = [("cpu-reference", contextlib.nullcontext), ("cpu-emulated-fused", emulated_fused_path)]
# The fused path with the Triton reductions for channels-last inputs, interpreted.
_TRITON_CPU_PATH = functools.partial(emulated_fused_path, triton=True)


def _cpu_paths():
    """The CPU paths, the interpreted Triton one too where Triton's interpreter runs."""
    return _CPU_PATHS + ([("cpu-emulated-fused-triton", _TRITON_CPU_PATH)] if _INTERPRETER
                         else [])


def _paths(ctx):
    return [("cuda-fused", contextlib.nullcontext)] if ctx.is_cuda else _cpu_paths()


def _close(actual, expected, tol, what):
    torch.testing.assert_close(actual.double(), expected.double().to(actual.device), **tol,
                               msg=labelled(what))


def _reference(x, weight, bias, dy, running_mean, running_var, momentum, eps, channel_dim):
    """BatchNorm of the whole batch ``x`` in float64: y, dx, dweight, dbias, running stats."""
    xd = x.double().movedim(channel_dim, 1).requires_grad_()
    w = weight.double().requires_grad_() if weight is not None else None
    b = bias.double().requires_grad_() if bias is not None else None
    rm = running_mean.double().clone() if running_mean is not None else None
    rv = running_var.double().clone() if running_var is not None else None
    y = F.batch_norm(xd, rm, rv, w, b, training=True, momentum=momentum, eps=eps)
    y.backward(dy.double().movedim(channel_dim, 1))
    return (y.detach().movedim(1, channel_dim), xd.grad.movedim(1, channel_dim),
            w.grad if w is not None else None, b.grad if b is not None else None, rm, rv)


def _run_case(ctx, sizes, *, channels=3, spatial=(4, 5), dtype=torch.float32,
              memory_format=None, channel_last=False, affine=True, track=True, momentum=0.1,
              group=None, members=None, steps=2, relu_inplace=False, grad_contiguous=False,
              compile_backend=None, input_grad=True, param_dtype=None, saved_hook=None,
              label=""):
    """Train ``steps`` steps of a SyncBatchNorm on per-rank slices of one global batch.

    ``sizes[i]`` is the batch of ``members[i]`` (default: every rank, in order); a list of
    such lists gives each step its own sizes (an epoch's last, smaller batch), one per step.
    ``compile_backend``: run the layer as ``torch.compile(layer, backend=...)`` (one path:
    the compiled one). ``input_grad=False``: the input does not require grad (only the
    parameters get gradients, and backward has no collective). ``relu_inplace``: a
    ``relu_()`` on the layer's output itself (ResNet's ``ReLU(inplace=True)``), and the
    reference is BatchNorm followed by ReLU. ``param_dtype``: parameters and running statistics
    in this dtype (O3 without keep_batchnorm_fp32); the reference uses the rounded values.
    """
    members = list(range(ctx.world_size)) if members is None else members
    me = members.index(ctx.rank)
    per_step = isinstance(sizes[0], list)
    if per_step:
        steps = len(sizes)
    g = torch.Generator().manual_seed(1234)
    weight = torch.rand(channels, generator=g) + 0.5
    bias = torch.randn(channels, generator=g)
    if param_dtype is not None:
        weight, bias = weight.to(param_dtype).float(), bias.to(param_dtype).float()
    stat_tol = STAT_TOL if param_dtype is None else OUT_TOL[param_dtype]
    paths = _paths(ctx)
    if compile_backend is not None:
        paths = [(f"compiled:{compile_backend}", contextlib.nullcontext)]
        torch._dynamo.reset()  # fresh compile caches: no recompile limit across cases
    for path, path_ctx in paths:
        m = SyncBatchNorm(channels, momentum=momentum, affine=affine, track_running_stats=track,
                          process_group=group, channel_last=channel_last).to(ctx.device)
        if param_dtype is not None:
            m = m.to(param_dtype)
        layer = m if compile_backend is None else torch.compile(m, backend=compile_backend)
        if affine:
            with torch.no_grad():
                m.weight.copy_(weight)
                m.bias.copy_(bias)
        ref_rm = torch.zeros(channels, dtype=torch.float64) if track else None
        ref_rv = torch.ones(channels, dtype=torch.float64) if track else None
        for step in range(steps):
            sizes_now = sizes[step] if per_step else sizes
            shape = (sum(sizes_now), channels, *spatial)
            x = (torch.randn(shape, generator=g, dtype=torch.float64) * (1.5 + step) + 0.7)
            dy = torch.randn(shape, generator=g, dtype=torch.float64)
            x, dy = x.to(dtype), dy.to(dtype)  # the reference sees the same rounded values
            channel_dim = 1
            if channel_last:  # Apex's flag: the tensor itself is (N, *, C)
                x, dy = x.movedim(1, -1).contiguous(), dy.movedim(1, -1).contiguous()
                channel_dim = x.dim() - 1
            start = sum(sizes_now[:me])
            xl = x[start:start + sizes_now[me]].to(ctx.device)
            dyl = dy[start:start + sizes_now[me]].to(ctx.device)
            if memory_format is not None:
                xl = xl.contiguous(memory_format=memory_format)
                # grad_contiguous: the gradient arrives in another layout than x's
                dyl = dyl.contiguous() if grad_contiguous else dyl.contiguous(
                    memory_format=memory_format)
            xl.requires_grad_(input_grad)
            if affine:
                m.weight.grad = m.bias.grad = None
            hooks = (contextlib.nullcontext() if saved_hook is None else
                     torch.autograd.graph.saved_tensors_hooks(saved_hook, lambda t: t))
            with path_ctx():
                with hooks:
                    y = layer(xl)
                if relu_inplace:
                    y.relu_()  # on the layer's own output: it must not be a view
                y.backward(dyl)
            what = f"[{path}{label} step {step} sizes {sizes_now} {dtype}]"
            assert y.dtype == dtype, f"{what} output dtype {y.dtype}"
            assert y.shape == xl.shape
            if memory_format is not None and sizes_now[me] > 0:
                assert y.is_contiguous(memory_format=memory_format), f"{what} output layout"
            ref_args = (x, weight if affine else None, bias if affine else None)
            ref_rest = (ref_rm, ref_rv, momentum if momentum is not None else 1.0 / (step + 1),
                        m.eps, channel_dim)
            if relu_inplace:  # the gradient reaching BatchNorm: dy where its output is > 0
                before_relu = _reference(*ref_args, dy, *ref_rest)[0]
                dy = dy.double() * (before_relu > 0)
            ry, rdx, rdw, rdb, ref_rm, ref_rv = _reference(*ref_args, dy, *ref_rest)
            sl = slice(start, start + sizes_now[me])
            if relu_inplace:
                ry = ry.clamp_min(0)
            if not input_grad:
                assert xl.grad is None, f"{what} input grad of an input without requires_grad"
            else:
                _close(xl.grad, rdx[sl], OUT_TOL[dtype], f"{what} input grad")
            _close(y.detach(), ry[sl], OUT_TOL[dtype], f"{what} output")
            if affine:
                for p, ref, name in ((m.weight, rdw, "weight"), (m.bias, rdb, "bias")):
                    total = _sum_over_ranks(p.grad, group)
                    assert p.grad.dtype == p.dtype, f"{what} {name} grad dtype"
                    # Half inputs: PyTorch's CUDA reduction kernels read dy and x in half,
                    # so the per-channel sums carry half-precision rounding.
                    tol = PARAM_GRAD_TOL.get(dtype, dict(rtol=1e-4, atol=1e-4))
                    _close(total, ref, tol, f"{what} {name} grad")
            if track:
                _close(m.running_mean, ref_rm, stat_tol, f"{what} running_mean")
                _close(m.running_var, ref_rv, stat_tol, f"{what} running_var")


PARAM_GRAD_TOL = {torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
                  torch.float16: dict(rtol=5e-3, atol=5e-3)}


def _sum_over_ranks(t, group=None):
    # gloo through host memory (it cannot reduce CUDA tensors everywhere, e.g. one-GPU runs);
    # NCCL on the device (it has no CPU backend). Summed in float64: a sum in the gradient's
    # own dtype adds the test's rounding at each rank's addition (bf16 at 8 ranks: 0.1 off a
    # bias gradient of -0.91), which grows with the world size and is not the layer's.
    if dist.get_backend(group) == "nccl":
        total = t.detach().to(torch.float64, copy=True)
    else:
        total = t.detach().cpu().to(torch.float64, copy=True)
    dist.all_reduce(total, group=group)
    return total.cpu()


def _uneven(ctx):
    return [3, 6, 2, 5, 4, 1, 7, 2][:ctx.world_size]


# ------------------------------------------------------------------------------------------------
# checks (every rank)
# ------------------------------------------------------------------------------------------------
def check_fp32_equal_batches(ctx):
    _run_case(ctx, [4] * ctx.world_size)


def check_fp32_unequal_batches(ctx):
    _run_case(ctx, _uneven(ctx))
    _run_case(ctx, _uneven(ctx), momentum=None, label=" momentum=None")


def check_shapes_2d_3d_5d(ctx):
    _run_case(ctx, _uneven(ctx), spatial=(), label=" 2d")
    _run_case(ctx, _uneven(ctx), spatial=(7,), label=" 3d")
    _run_case(ctx, _uneven(ctx), spatial=(2, 3, 2), label=" 5d")


def check_bf16_input_fp32_params(ctx):
    _run_case(ctx, _uneven(ctx), dtype=torch.bfloat16)


def check_fp16_input_fp32_params(ctx):
    _run_case(ctx, _uneven(ctx), dtype=torch.float16)


def check_dtype_pairs_batchnorm_refuses(ctx):
    # On the multi-rank path too (it computed any pair, and the trained model then failed in
    # eval): fp64 input with fp32 parameters is refused in training, before any collective.
    for training in (True, False):
        bn = SyncBatchNorm(3).to(ctx.device).train(training)
        try:
            bn(torch.randn(4, 3, dtype=torch.float64, device=ctx.device))
        except RuntimeError as err:
            assert "input is torch.float64" in str(err), str(err)
        else:
            raise AssertionError(f"fp64 input, fp32 layer, training={training}: not refused")
        assert int(bn.num_batches_tracked) == 0


def check_channels_last(ctx):
    _run_case(ctx, _uneven(ctx), memory_format=torch.channels_last, label=" channels_last")
    _run_case(ctx, _uneven(ctx), dtype=torch.bfloat16, memory_format=torch.channels_last,
              label=" channels_last")
    _run_case(ctx, _uneven(ctx), spatial=(2, 3, 2), memory_format=torch.channels_last_3d,
              label=" channels_last_3d")


def check_triton_kernels_run_for_channels_last(ctx):
    # Inputs whose memory is the (M, C) array take mixprec's four Triton passes (on the GPU,
    # and on CPU through the interpreter): channels_last tensors, and contiguous (N, C) and
    # (N, C, 1, 1) ones; the cases compare their results with float64 BatchNorm.
    from mixprec.parallel import _syncbn_triton

    if not ctx.is_cuda and not _INTERPRETER:
        return  # no Triton here: nothing to check
    names = ("stats", "normalize", "grad_sums", "grad_input")
    calls = []
    plan = _syncbn_triton.Plan
    saved = {name: getattr(plan, name) for name in names}

    def counted(name, f):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return f(*args, **kwargs)
        return wrapper

    cases = [(dict(memory_format=torch.channels_last), " channels_last"),
             (dict(spatial=()), " (N, C)"), (dict(spatial=(1, 1)), " (N, C, 1, 1)")]
    for name in names:
        setattr(plan, name, counted(name, saved[name]))
    try:
        paths = [p for p in _paths(ctx) if p[0] in ("cuda-fused", "cpu-emulated-fused-triton")]
        assert paths, [p[0] for p in _paths(ctx)]
        saved_paths = globals()["_paths"]
        globals()["_paths"] = lambda ctx: paths
        try:
            for kwargs, label in cases:
                calls.clear()
                _run_case(ctx, _uneven(ctx), steps=1, label=label + " (Triton kernels)",
                          **kwargs)
                # One call of each per step, unless this rank's batch holds at most one row
                # (then PyTorch's path).
                if _uneven(ctx)[ctx.rank] > 1:
                    assert sorted(calls) == sorted(names), (label, calls)
        finally:
            globals()["_paths"] = saved_paths
    finally:
        for name in names:
            setattr(plan, name, saved[name])


def check_plan_follows_parameter_changes(ctx):
    # A layer keeps its kernels' plan per call signature: parameters cast (m.to(bfloat16)) or
    # replaced by a strided tensor between steps must not reuse a plan made for the old ones.
    # Each changed layer must compute what a copy of it computes (the copy decides afresh).
    for path, path_ctx in _paths(ctx):
        torch.manual_seed(11 + ctx.rank)
        x = torch.randn(4, 6, 3, 3).to(ctx.device).contiguous(memory_format=torch.channels_last)

        def strided_weight(layer):
            base = torch.rand(12, device=ctx.device) + 0.5
            layer.weight = nn.Parameter(base[::2])  # (stride 2: a plan for unit stride misreads)
            return layer

        def strided_running_var(layer):
            layer.running_var = (torch.rand(12, device=ctx.device) + 0.5)[::2]
            return layer

        fp32 = dict(rtol=1e-5, atol=1e-5)
        changes = [("bf16 parameters", lambda layer: layer.to(torch.bfloat16),
                    OUT_TOL[torch.bfloat16]), ("strided weight", strided_weight, fp32),
                   ("strided running variance", strided_running_var, fp32)]
        x32 = x
        for what, change, tol in changes:
            # (bf16 input throughout the bf16 case: taken with the fp32 parameters first, then
            # with the cast ones; an fp32 input with bf16 parameters is refused, as BatchNorm)
            x = (x32.to(torch.bfloat16) if what == "bf16 parameters" else x32).detach()
            m = SyncBatchNorm(6).to(ctx.device)
            with path_ctx():
                m(x.requires_grad_()).sum().backward()  # a plan for fp32, contiguous parameters
                x.grad = None
                change(m)
                twin = copy.deepcopy(m)
                y, y_twin = m(x), twin(x)
                y.square().sum().backward()
                grad = x.grad.clone()
                x.grad = None
                y_twin.square().sum().backward()
            _close(y, y_twin, tol, f"[{path}] {what}: output")
            _close(grad, x.grad, tol, f"[{path}] {what}: input gradient")
            _close(m.running_mean, twin.running_mean, tol, f"[{path}] {what}: running mean")
            _close(m.running_var, twin.running_var, tol, f"[{path}] {what}: running variance")
            x.grad = None


def check_channels_last_with_contiguous_gradient(ctx):
    # The output is channels-last; a gradient handed back in NCHW order must give the same.
    _run_case(ctx, _uneven(ctx), memory_format=torch.channels_last, grad_contiguous=True,
              label=" channels_last, NCHW gradient")


def check_saved_tensors_as_contiguous_copies(ctx):
    # A saved-tensor hook (activation offloading) hands the backward a contiguous (NCHW) copy
    # of a channels-last input: the backward must read the copy as it is laid out.
    _run_case(ctx, _uneven(ctx), memory_format=torch.channels_last,
              saved_hook=lambda t: t.contiguous().clone(),
              label=" channels_last, saved x as an NCHW copy")
    _run_case(ctx, _uneven(ctx), channel_last=True, spatial=(4,),
              saved_hook=lambda t: (t.transpose(0, 1).contiguous().transpose(0, 1)
                                    if t.dim() == 3 else t),
              label=" channel_last=True, saved x as a strided copy")


def check_copies_and_pickles_after_use(ctx):
    # After training steps a layer holds per-geometry scratch (layouts, launch plans, count
    # tensors); copying or pickling it must still work, and the copy must compute the same.
    for path, path_ctx in _paths(ctx):
        torch.manual_seed(7)
        m = SyncBatchNorm(5).to(ctx.device)
        x = torch.randn(3, 5, 4, 4).to(ctx.device).contiguous(memory_format=torch.channels_last)
        with path_ctx():
            m(x).sum().backward()
            twin = copy.deepcopy(m)
            loaded = pickle.loads(pickle.dumps(m))
            # a module pickled by an earlier version: its cached layouts have no strides
            old = pickle.loads(pickle.dumps(m))
            for value in old._count_cache.values():
                value.__dict__.pop("strides", None)
            outs = [layer(x) for layer in (m, twin, loaded)]
            y_old = old(x)
            y_old.sum().backward()
            outs.append(y_old)
        for other in outs[1:]:
            torch.testing.assert_close(other, outs[0], rtol=0, atol=0,
                                       msg=labelled(f"[{path}] copy after use"))
    # A layer with its own group: a deep copy keeps the group; pickling is refused with what
    # to do (PyTorch's message named only the ProcessGroup type).
    grouped = SyncBatchNorm(5, process_group=dist.new_group(list(range(ctx.world_size))))
    assert copy.deepcopy(grouped).process_group is grouped.process_group
    try:
        pickle.dumps(grouped)
    except TypeError as err:
        assert "cannot be pickled" in str(err) and "state_dict()" in str(err), str(err)
    else:
        raise AssertionError("a SyncBatchNorm with a process group pickled")
    grouped.process_group = None
    assert pickle.loads(pickle.dumps(grouped)).process_group is None


def check_under_torch_compile(ctx):
    # Under torch.compile the layer is a graph break that runs eagerly (tracing it gave zero
    # input gradients on torch 2.11 and an error on 2.4); the compiled module must match
    # float64 BatchNorm like the eager one: outputs, all gradients, running statistics. On CPU
    # the quick aot_eager backend (Dynamo and AOTAutograd); on CUDA the real compiler.
    backend = "inductor" if ctx.is_cuda else "aot_eager"
    for memory_format in (None, torch.channels_last):
        for dtype in (torch.float32, torch.bfloat16):
            _run_case(ctx, _uneven(ctx), dtype=dtype, memory_format=memory_format,
                      compile_backend=backend,
                      label=f" compiled {'channels_last' if memory_format else 'NCHW'}")


def check_input_without_grad(ctx):
    # A layer right on the data (input without requires_grad): the parameter gradients and
    # running statistics are still right, every layout and path.
    _run_case(ctx, _uneven(ctx), input_grad=False, label=" input without grad")
    _run_case(ctx, _uneven(ctx), memory_format=torch.channels_last, input_grad=False,
              label=" channels_last, input without grad")


def check_channel_last_flag(ctx):
    _run_case(ctx, _uneven(ctx), channel_last=True, label=" channel_last=True")
    _run_case(ctx, _uneven(ctx), spatial=(), channel_last=True, label=" channel_last=True 2d")


def check_no_affine_no_running_stats(ctx):
    _run_case(ctx, _uneven(ctx), affine=False, label=" affine=False")
    _run_case(ctx, _uneven(ctx), track=False, label=" track_running_stats=False")
    _run_case(ctx, _uneven(ctx), track=False, dtype=torch.bfloat16,
              label=" track_running_stats=False")


def check_inplace_op_on_output(ctx):
    # ResNet's ReLU(inplace=True) follows every BatchNorm: the output must not be a view.
    _run_case(ctx, _uneven(ctx), memory_format=torch.channels_last, relu_inplace=True,
              label=" relu_ after")
    _run_case(ctx, _uneven(ctx), channel_last=True, relu_inplace=True, label=" relu_ after")


def check_half_parameters(ctx):
    # O3 without keep_batchnorm_fp32: input, parameters and running statistics in half.
    for dtype in (torch.float16, torch.bfloat16):
        _run_case(ctx, _uneven(ctx), dtype=dtype, param_dtype=dtype, label=" half params")
        _run_case(ctx, _uneven(ctx), dtype=dtype, param_dtype=dtype,
                  memory_format=torch.channels_last, label=" half params, channels_last")


def check_single_value_per_channel_raises(ctx):
    # BatchNorm refuses a batch with one value per channel (no variance): so does the layer
    # when the whole group's batch holds one, on every rank, without touching its running
    # statistics (an unbiased variance of one value would poison them for good).
    sizes = [1] + [0] * (ctx.world_size - 1)
    for path, path_ctx in _paths(ctx):
        for memory_format in (None, torch.channels_last):
            m = SyncBatchNorm(3).to(ctx.device)
            x = torch.randn(sizes[ctx.rank], 3, 1, 1, device=ctx.device)
            if memory_format is not None:
                x = x.contiguous(memory_format=memory_format)
            try:
                with path_ctx():
                    m(x)
            except ValueError as err:
                assert "more than 1 value per channel" in str(err), f"[{path}] {err}"
            else:
                raise AssertionError(f"[{path}] a one-value batch did not raise")
            assert torch.equal(m.running_mean.cpu(), torch.zeros(3)), path
            assert torch.equal(m.running_var.cpu(), torch.ones(3)), path
    # eps=0 is refused in training on every rank too (the group's batch had a constant
    # channel's zero variance divided by zero: NaN), before any batch is counted.
    for path, path_ctx in _paths(ctx):
        m = SyncBatchNorm(3, eps=0.0).to(ctx.device)
        try:
            with path_ctx():
                m(torch.ones(2, 3, device=ctx.device))
        except ValueError as err:
            assert "eps=0.0 normalizing by batch statistics" in str(err), f"[{path}] {err}"
        else:
            raise AssertionError(f"[{path}] eps=0 trained")
        assert int(m.num_batches_tracked) == 0, path
    # One value on each of two ranks is a batch of two: fine.
    _run_case(ctx, [1] * ctx.world_size, spatial=(), label=" one sample per rank")
    # No values at all: an empty output, as BatchNorm gives, and the statistics untouched.
    for path, path_ctx in _paths(ctx):
        m = SyncBatchNorm(3).to(ctx.device)
        with path_ctx():
            y = m(torch.randn(0, 3, 2, 2, device=ctx.device))
        assert y.shape == (0, 3, 2, 2), path
        assert torch.equal(m.running_mean.cpu(), torch.zeros(3)), path
        assert torch.equal(m.running_var.cpu(), torch.ones(3)), path


def check_eval_mode_uses_running_stats_without_communication(ctx):
    m = SyncBatchNorm(3).to(ctx.device)
    with torch.no_grad():
        m.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        m.running_var.copy_(torch.tensor([2.0, 0.5, 1.5]))
        m.weight.copy_(torch.tensor([1.5, 0.5, 2.0]))
    m.eval()
    x = torch.randn(4, 3, 5, 5, device=ctx.device)
    saved = fn.all_gather_rows

    def no_communication(*args, **kwargs):
        raise AssertionError("eval mode communicated")

    fn.all_gather_rows = no_communication
    try:
        y = m(x)
    finally:
        fn.all_gather_rows = saved
    expected = F.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias, False, 0.1, m.eps)
    torch.testing.assert_close(y, expected)


def check_convert_syncbn_model_matches_batchnorm(ctx):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.Flatten(), nn.Linear(4 * 16, 6), nn.BatchNorm1d(6)).to(ctx.device)
    model = convert_syncbn_model(nn.Sequential(*[copy.deepcopy(m) for m in ref]))
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[5], SyncBatchNorm)
    sizes = _uneven(ctx)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(sum(sizes), 3, 4, 4, generator=g).to(ctx.device)
    start = sum(sizes[:ctx.rank])
    local = model(x[start:start + sizes[ctx.rank]])
    local.square().sum().backward()
    full = ref(x)
    full.square().sum().backward()
    torch.testing.assert_close(local, full[start:start + sizes[ctx.rank]], rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        total = _sum_over_ranks(p.grad)
        torch.testing.assert_close(total, q.grad.cpu().double(), rtol=1e-4, atol=1e-4,
                                   msg=labelled(name))
    for b, rb in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(b, rb, rtol=1e-4, atol=1e-5)


def check_deepcopy_with_process_group(ctx):
    # A model with a custom group deep-copied (an EMA of its weights, a frozen teacher): the
    # copy shares the group (a communicator handle cannot be copied), its tensors are its own,
    # and it computes what the original computes.
    group = create_syncbn_process_group(ctx.world_size)
    torch.manual_seed(3)
    model = convert_syncbn_model(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)),
                                 process_group=group).to(ctx.device)
    x = torch.randn(2 + ctx.rank, 3, 3, 3, device=ctx.device)
    model(x).sum().backward()  # after use: per-geometry scratch in the layer
    twin = copy.deepcopy(model)
    assert twin[1].process_group is group
    assert twin[1].weight is not model[1].weight
    assert twin[1].running_mean is not model[1].running_mean
    torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    torch.testing.assert_close(twin[1].running_var, model[1].running_var, rtol=0, atol=0)


def check_residual_z_and_fuse_relu(ctx):
    # Apex's optimized layer: forward(input, z) with fuse_relu=True is relu(bn(input) + z),
    # the statistics over every rank's batch; against nn.BatchNorm2d over the whole batch.
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(4).double().to(ctx.device)
    sync = SyncBatchNorm(4, fuse_relu=True).double().to(ctx.device)
    sizes = _uneven(ctx)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(sizes), 4, 3, 3, generator=g, dtype=torch.float64).to(ctx.device)
    z = torch.randn(x.shape, generator=g, dtype=torch.float64).to(ctx.device)
    sl = slice(sum(sizes[:ctx.rank]), sum(sizes[:ctx.rank + 1]))
    xl, zl = x[sl].clone().requires_grad_(), z[sl].clone().requires_grad_()
    xr, zr = x.clone().requires_grad_(), z.clone().requires_grad_()
    y = sync(xl, zl)
    want = F.relu(ref(xr) + zr)
    y.pow(2).sum().backward()
    want.pow(2).sum().backward()
    torch.testing.assert_close(y, want[sl], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(xl.grad, xr.grad[sl], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(zl.grad, zr.grad[sl], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sync.running_var, ref.running_var, rtol=1e-10, atol=1e-10)


# Joins GROUP_2 (after "check_residual_z_and_fuse_relu").
def check_the_layers_eps_reaches_the_multi_rank_path(ctx):
    """A layer's own eps (``BatchNorm2d(eps=1e-3)`` in many vision models, kept by
    convert_syncbn_model) normalizes on the multi-rank path as it does on one process: the
    layer hands it to the statistics merge, the normalization and the backward. eps 0.5 over
    inputs of variance ~0.5 makes any other eps show. Reference: nn.BatchNorm2d(eps=0.5) in
    float64 over the whole batch, on every path: output, input gradient, running
    statistics, 1e-10. (S25)"""
    eps = 0.5
    sizes = _uneven(ctx)
    g = torch.Generator().manual_seed(21)
    x = torch.randn(sum(sizes), 3, 2, 2, generator=g, dtype=torch.float64) * 0.7 + 1
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    sl = slice(sum(sizes[:ctx.rank]), sum(sizes[:ctx.rank + 1]))
    ref = nn.BatchNorm2d(3, eps=eps).double()
    xr = x.clone().requires_grad_()
    want = ref(xr)
    want.backward(dy)
    tol = OUT_TOL[torch.float64]
    for path, path_ctx in _paths(ctx):
        layer = SyncBatchNorm(3, eps=eps).double().to(ctx.device)
        xl = x[sl].to(ctx.device).requires_grad_()
        with path_ctx():
            y = layer(xl)
            y.backward(dy[sl].to(ctx.device))
        _close(y.detach(), want.detach()[sl], tol, f"[{path}] output, eps={eps}")
        _close(xl.grad, xr.grad[sl], tol, f"[{path}] input grad, eps={eps}")
        _close(layer.running_var, ref.running_var, tol, f"[{path}] running_var, eps={eps}")


def check_empty_rank(ctx):
    # One rank (the first, the hardest case for the merge kernel) has no samples at all.
    sizes = [0, 3, 5, 1, 2, 0, 4, 6][:ctx.world_size]
    _run_case(ctx, sizes, label=" empty rank 0")
    _run_case(ctx, list(reversed(sizes)), memory_format=torch.channels_last,
              label=" empty last rank")


def check_empty_global_batch(ctx):
    # Every rank's batch empty (no samples, or a zero spatial extent): BatchNorm gives an empty
    # output and zero parameter gradients; the layer must too, not NaN (the whole group's
    # variance is then 0 / 0), which would poison the weights at the optimizer step.
    for path, path_ctx in _paths(ctx):
        for shape in ((0, 3, 2, 2), (2, 3, 0, 2)):
            m = SyncBatchNorm(3).to(ctx.device)
            x = torch.randn(shape, device=ctx.device, requires_grad=True)
            with path_ctx():
                y = m(x)
                y.sum().backward()
            what = f"[{path}] empty global batch {shape}"
            assert y.shape == shape, what
            assert x.grad.shape == shape, what
            for name in ("weight", "bias"):
                grad = getattr(m, name).grad
                assert torch.equal(grad.cpu(), torch.zeros(3)), f"{what}: {name} grad {grad}"
            assert torch.equal(m.running_mean.cpu(), torch.zeros(3)), what
            assert torch.equal(m.running_var.cpu(), torch.ones(3)), what


def check_batch_size_changes_between_steps(ctx):
    # Each rank's batch size changes from step to step (an epoch's last, smaller batch; a
    # sampler with uneven shards): every step merges that step's counts, on every path (the
    # fused path caches its count tensors). One size per rank for up to 8 ranks (cycled
    # beyond; the first two columns are the 2-rank case): every rank's size changes at every
    # step and comes back to an earlier one (a cached count tensor reused).
    steps = [[4, 3, 2, 5, 1, 6, 3, 2], [2, 5, 6, 1, 4, 3, 2, 5], [4, 3, 2, 5, 1, 6, 3, 2],
             [1, 6, 3, 2, 5, 1, 4, 3]]
    _run_case(ctx, [[sizes[r % len(sizes)] for r in range(ctx.world_size)] for sizes in steps],
              label=" sizes per step")


def check_ranks_with_images_of_different_sizes(ctx):
    """Ranks whose images (or sequences) differ in size (multi-scale training, segmentation
    crops of each rank's own size, variable-length (N, L, C) batches): the statistics are
    those of every value of every rank, so each rank weighs in with its N * H * W values,
    not its N samples. Every other case gives all ranks the same spatial size, where a merge
    weighted by samples instead of values comes out the same. Cases: NCHW, channels_last,
    and (N, L, C) with channel_last=True. Reference: F.batch_norm in float64 over the
    (values, C) rows of every rank's batch together: output, input gradient (1e-5), the sum
    of the ranks' weight and bias gradients (1e-4) and the running statistics (STAT_TOL), on
    every path. (r87A F45)"""
    C = 3
    g = torch.Generator().manual_seed(31)
    weight, bias = torch.rand(C, generator=g) + 0.5, torch.randn(C, generator=g)
    cases = [("NCHW", None, False), ("channels_last", torch.channels_last, False),
             ("(N, L, C)", None, True)]
    for label, memory_format, channel_last in cases:
        if channel_last:
            shapes = [(3 - r % 2, 4 + 3 * r, C) for r in range(ctx.world_size)]
        else:
            shapes = [(3 - r % 2, C, 3 + 2 * r, 2 + r) for r in range(ctx.world_size)]
        xs = [(torch.randn(s, generator=g, dtype=torch.float64) * (1 + r) + 2 * r).float()
              for r, s in enumerate(shapes)]
        dys = [torch.randn(s, generator=g, dtype=torch.float64).float() for s in shapes]

        def rows(t, channel_last=channel_last):  # every value of a batch as (values, C) rows
            return (t if channel_last else t.movedim(1, -1)).double().reshape(-1, C)

        xr = torch.cat([rows(x) for x in xs]).requires_grad_()
        w, b = weight.double().requires_grad_(), bias.double().requires_grad_()
        rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
        want = F.batch_norm(xr, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)
        want.backward(torch.cat([rows(d) for d in dys]))
        start = sum(rows(x).shape[0] for x in xs[:ctx.rank])
        me = slice(start, start + rows(xs[ctx.rank]).shape[0])
        shape = shapes[ctx.rank]

        def back(t, channel_last=channel_last, me=me, shape=shape):  # this rank's, shaped
            if channel_last:
                return t[me].reshape(shape)
            return t[me].reshape(shape[0], *shape[2:], C).movedim(-1, 1)

        for path, path_ctx in _paths(ctx):
            m = SyncBatchNorm(C, channel_last=channel_last).to(ctx.device)
            with torch.no_grad():
                m.weight.copy_(weight)
                m.bias.copy_(bias)
            xl, dyl = xs[ctx.rank].clone().to(ctx.device), dys[ctx.rank].to(ctx.device)
            if memory_format is not None:
                xl, dyl = (t.contiguous(memory_format=memory_format) for t in (xl, dyl))
            xl.requires_grad_()
            with path_ctx():
                y = m(xl)
                y.backward(dyl)
            what = f"[{path}] {label}: rank {ctx.rank} batch {shape}"
            _close(y.detach(), back(want.detach()), OUT_TOL[torch.float32], f"{what} output")
            _close(xl.grad, back(xr.grad), OUT_TOL[torch.float32], f"{what} input grad")
            for p, ref, name in ((m.weight, w.grad, "weight"), (m.bias, b.grad, "bias")):
                _close(_sum_over_ranks(p.grad), ref, dict(rtol=1e-4, atol=1e-4),
                       f"{what} {name} grad")
            _close(m.running_mean, rm, STAT_TOL, f"{what} running_mean")
            _close(m.running_var, rv, STAT_TOL, f"{what} running_var")


def check_cpu_merge_in_fp64_keeps_the_variance_of_offset_inputs(ctx):
    # The CPU path merges the ranks' [mean, var, count] rows in fp64 (module docstring of
    # _sync_batchnorm_function). Inputs far from zero (raw, un-normalized features): here the
    # whole variance is the spread of the ranks' means around 1e6, where fp32's spacing is
    # 0.0625; merged in fp32 the global mean rounds by 0.02 and the unbiased variance comes out
    # 0.2% high (2 ranks). (The CUDA merge kernel works in fp32: the CPU path only.)
    if ctx.is_cuda:
        return
    sizes = [2 if r % 2 == 0 else 4 for r in range(ctx.world_size)]
    values = [1e6 + (r % 2) for r in range(ctx.world_size)]  # exact in fp32; each rank's var 0
    x = torch.cat([torch.full((n, 1), v, dtype=torch.float64) for n, v in zip(sizes, values)])
    rm, rv = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    F.batch_norm(x, rm, rv, training=True, momentum=1.0)  # rv: the unbiased global variance
    m = SyncBatchNorm(1, momentum=1.0).to(ctx.device)
    start = sum(sizes[:ctx.rank])
    m(x[start:start + sizes[ctx.rank]].float().to(ctx.device))
    _close(m.running_var, rv, STAT_TOL, "[cpu-reference] running_var of inputs offset by 1e6")
    _close(m.running_mean, rm, STAT_TOL, "[cpu-reference] running_mean of inputs offset by 1e6")


def check_syncbn_process_groups(ctx):
    group = create_syncbn_process_group(2)
    members = [r for r in range(ctx.world_size) if r // 2 == ctx.rank // 2]
    sizes = [2, 5] if ctx.rank < 2 else [4, 1]
    _run_case(ctx, sizes, group=group, members=members, label=" group of 2")


def check_syncbn_group_size_must_divide_the_world_size(ctx):
    # A group size that does not divide the world size (3 of 4 ranks) is refused with the
    # documented rule, on every rank, before any group is made (new_group is collective:
    # groups made by some ranks and not others leave them unmatched). Without the check the
    # ranks made the group [0, 1, 2] and then failed inside torch.distributed on rank 4.
    sizes = [s for s in range(2, ctx.world_size) if ctx.world_size % s]
    for size in sizes:
        try:
            create_syncbn_process_group(size)
        except ValueError as err:
            assert "must divide it" in str(err), str(err)
        else:
            raise AssertionError(f"create_syncbn_process_group({size}) of {ctx.world_size} "
                                 "ranks was taken")
    # The ranks still agree afterwards: a group of 2 works as before.
    check_syncbn_process_groups(ctx)


def check_syncbn_eval_without_running_stats_normalizes_by_the_local_batch(ctx):
    # Documented: in eval mode with track_running_stats=False each rank normalizes by its own
    # batch (as torch.nn.SyncBatchNorm), never communicating, so one rank may evaluate alone.
    # Ranks hold batches of different means and scales: the global statistics would differ
    # from each rank's own. Reference: nn.BatchNorm2d(track_running_stats=False) in eval on
    # this rank's batch, and a rank-0-only evaluation that must not wait for rank 1.
    torch.manual_seed(0)
    layer = SyncBatchNorm(3, track_running_stats=False).to(ctx.device)
    ref = nn.BatchNorm2d(3, track_running_stats=False).to(ctx.device)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
        ref.load_state_dict(layer.state_dict())
    layer.eval()
    ref.eval()
    g = torch.Generator().manual_seed(11 + ctx.rank)
    x = (torch.randn(4, 3, 2, 2, generator=g) * (1 + 3 * ctx.rank) + 5 * ctx.rank).to(ctx.device)
    torch.testing.assert_close(layer(x), ref(x), rtol=1e-5, atol=1e-5,
                               msg=labelled(f"rank {ctx.rank}"))
    if ctx.rank == 0:  # (alone: a collective here would wait for the group's timeout)
        torch.testing.assert_close(layer(x[:2]), ref(x[:2]), rtol=1e-5, atol=1e-5)


def check_a_layer_pickled_without_the_count_cache_trains_over_the_ranks(ctx):
    # A layer pickled by an earlier mixprec or by Apex's Python SyncBatchNorm has no
    # _count_cache: loaded, its multi-rank training forward must run (the per-module scratch
    # is made again), computing what a fresh layer computes. Reference: a fresh layer with the
    # same parameters, on the same per-rank batches.
    # (B06)
    torch.manual_seed(0)
    old = SyncBatchNorm(4).to(ctx.device)
    del old.__dict__["_count_cache"]
    loaded = pickle.loads(pickle.dumps(old))
    fresh = SyncBatchNorm(4).to(ctx.device)
    g = torch.Generator().manual_seed(3 + ctx.rank)
    x = (torch.randn(3 + ctx.rank, 4, 2, 2, generator=g) * (1 + ctx.rank)).to(ctx.device)
    torch.testing.assert_close(loaded(x), fresh(x), rtol=0, atol=0, msg=labelled("output"))
    torch.testing.assert_close(loaded.running_var, fresh.running_var, rtol=0, atol=0)


@contextlib.contextmanager
def _counting_gathers():
    """The dtype of each tensor fn.all_gather_rows gathers inside the block (int64: the
    ranks-agree check's; the statistics are floating)."""
    calls = []
    real = fn.all_gather_rows

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    fn.all_gather_rows = counting
    try:
        yield calls
    finally:
        fn.all_gather_rows = real


def check_ranks_disagreeing_on_channels_or_dtype_raise_on_every_rank(ctx):
    """A layer given inputs of different channel counts (or float32 on some ranks, float64
    on others) raises a ValueError on every rank naming what each rank gave, instead of
    gloo's abort or NCCL's garbage statistics. The check is one all-gather the first time a
    layer sees a (channels, dtype) pair, kept through the layer's cache resets and dropped
    by copies; once the ranks agree, the layer trains as on agreeing ranks from the start.
    Reference: the gathers counted around each forward; a fresh layer's output, exact."""
    # (r103A R1)
    last = ctx.world_size - 1
    for path, path_ctx in _paths(ctx):
        for channels, dtype, said in (
                (3 if ctx.rank < last else 4, torch.float32, "4 channels, float32"),
                (3, torch.float32 if ctx.rank < last else torch.float64,
                 "3 channels, float64")):
            m = SyncBatchNorm(channels).to(ctx.device, dtype)
            x = torch.randn(4, channels, 2, device=ctx.device, dtype=dtype)
            with path_ctx():
                _refused_naming(ctx, path, m, x,
                                "group rank 0: 3 channels, float32 statistics",
                                f"group rank {last}: {said} statistics")
            assert torch.equal(m.running_mean.cpu(), torch.zeros(channels, dtype=dtype)), path
    for path, path_ctx in _paths(ctx):
        torch.manual_seed(0)
        m, fresh = SyncBatchNorm(3).to(ctx.device), SyncBatchNorm(3).to(ctx.device)
        fresh.load_state_dict(m.state_dict())
        per_forward = []
        with _counting_gathers() as calls:
            for step in range(20):
                x = torch.randn(2 + step, 3, 2, device=ctx.device)  # a new geometry each step
                del calls[:]
                with path_ctx():
                    y = m(x)
                per_forward.append(calls.count(torch.int64))
                if step == 0:  # (the fresh layer's gathers come after the count is taken)
                    with path_ctx():
                        want = fresh(x)
                    torch.testing.assert_close(y, want, rtol=0, atol=0, msg=labelled(path))
        # (20 geometries fill the layer's cache of 16 entries at least once.)
        assert per_forward == [1] + [0] * 19, f"[{path}] agreement gathers: {per_forward}"
        copied = copy.deepcopy(m)
        assert not [k for k in copied._count_cache if k[0] == "agreed"], path
        assert m._count_cache[("agreed",)] == {(3, torch.float32)}, path
    # Agreed on (3, float32), the ranks then give a parameter-free layer (any channel count)
    # new pairs at the same step, different ones: each rank checks its own new pair, so every
    # rank raises. (One rank alone moving to a new pair after the check is not caught: see
    # docs/parallel.md.)
    for path, path_ctx in _paths(ctx):
        m = SyncBatchNorm(3, affine=False, track_running_stats=False)
        with path_ctx():
            m(torch.randn(4, 3, 2, device=ctx.device))
            x = (torch.randn(4, 3, 2, device=ctx.device, dtype=torch.float64) if ctx.rank == 0
                 else torch.randn(4, 5, 2, device=ctx.device))
            _refused_naming(ctx, path, m, x,
                            "group rank 0: 3 channels, float64 statistics",
                            f"group rank {last}: 5 channels, float32")


def _refused_naming(ctx, path, layer, x, *phrases):
    """``layer(x)`` raises a ValueError whose message holds each of ``phrases``."""
    try:
        layer(x)
    except ValueError as err:
        text = str(err)
        assert all(phrase in text for phrase in phrases), f"[{path}] {phrases}: {text}"
    else:
        raise AssertionError(f"[{path}] rank {ctx.rank}: no ValueError")


def check_all_gather_rows_puts_each_rank_at_its_index(ctx):
    """The all-gather of the statistics rows (``_comm.all_gather_rows``, SyncBatchNorm's
    forward collective, also DistributedDataParallel's structure check) returns, at index
    ``r``, the row of the group's rank ``r``: DistributedDataParallel names the ranks whose
    model differs by that index, and the SyncBatchNorm merge reads each rank's row and
    count from it. Over the default group and over create_syncbn_process_group(2)'s pairs
    (each pair's two rows in rank order). Reference: the rows every rank built, exact.
    (C01)"""
    from mixprec.parallel._comm import all_gather_rows

    def row_of(rank):
        return torch.tensor([float(rank), 10.0 * rank + 0.5], device=ctx.device)

    got = all_gather_rows(row_of(ctx.rank), None, ctx.world_size)
    want = torch.stack([row_of(r) for r in range(ctx.world_size)])
    torch.testing.assert_close(got, want, rtol=0, atol=0,
                               msg=labelled(f"rank {ctx.rank}: the default group"))
    pairs = create_syncbn_process_group(2)
    first = ctx.rank - ctx.rank % 2
    got = all_gather_rows(row_of(ctx.rank), pairs, 2)
    want = torch.stack([row_of(first), row_of(first + 1)])
    torch.testing.assert_close(got, want, rtol=0, atol=0,
                               msg=labelled(f"rank {ctx.rank}: a group of 2"))


def check_ranks_with_half_and_float_inputs_agree_on_float32_statistics(ctx):
    """The ranks-agree check compares the statistics dtype, float32 for half and float32
    inputs alike: a bf16 input on rank 0 and a float32 one elsewhere exchange float32 rows and
    train as one layer (r107B G5: a check of the input dtype refused them). Reference: the
    running mean over every rank's input as each rank gave it, float64."""
    torch.manual_seed(0)
    xs = [torch.randn(4, 3, 2) for _ in range(ctx.world_size)]
    given = [x.to(torch.bfloat16 if r == 0 else torch.float32) for r, x in enumerate(xs)]
    m = SyncBatchNorm(3).to(ctx.device)
    m(given[ctx.rank].to(ctx.device))
    want = 0.1 * torch.cat([g.double() for g in given]).mean(dim=(0, 2))
    torch.testing.assert_close(m.running_mean.cpu().double(), want, rtol=1e-5, atol=1e-6,
                               msg=labelled(f"rank {ctx.rank}"))


def check_a_parameter_free_layer_fed_many_channel_counts_keeps_its_cache_small(ctx):
    """A layer without parameters takes any channel count; the pairs the ranks agreed on are
    one cache entry, so 24 channel counts leave the cache within its 16 entries (+1) instead
    of growing it past them (which then cleared the layouts and plans at every put: r107B R2),
    and a second pass over the same counts gathers nothing more. Reference: the gathers
    counted; the outputs of the second pass equal the first's, exact."""
    m = SyncBatchNorm(1, affine=False, track_running_stats=False).to(ctx.device)
    xs = [torch.randn(4, c, 2, generator=torch.Generator().manual_seed(c)).to(ctx.device)
          for c in range(2, 26)]
    with _counting_gathers() as calls:
        first = [m(x) for x in xs]
        assert calls.count(torch.int64) == 24, calls
        assert len(m._count_cache) <= 17, sorted(map(str, m._count_cache))
        del calls[:]
        second = [m(x) for x in xs]
    assert calls.count(torch.int64) == 0, calls
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=labelled(f"rank {ctx.rank}"))


def check_the_functional_form_without_a_cache_runs_over_the_ranks(ctx):
    """fn.sync_batch_norm called without a cache (its default; the module passes its own)
    skips the ranks-agree check and normalizes over every rank (r107B G6: the check read the
    cache unguarded). Reference: the whole gathered batch in float64."""
    torch.manual_seed(0)
    xs = [torch.randn(4, 3, 2) for _ in range(ctx.world_size)]
    rm, rv = torch.zeros(3, device=ctx.device), torch.ones(3, device=ctx.device)
    y = fn.sync_batch_norm(xs[ctx.rank].to(ctx.device), None, None, rm, rv, 1e-5, 0.1, None,
                           ctx.world_size)
    whole = torch.cat(xs).double()
    mean, var = whole.mean(dim=(0, 2)), whole.var(dim=(0, 2), unbiased=False)
    want = (xs[ctx.rank].double() - mean[None, :, None]) / (var[None, :, None] + 1e-5).sqrt()
    torch.testing.assert_close(y.cpu().double(), want, rtol=1e-4, atol=1e-5,
                               msg=labelled(f"rank {ctx.rank}"))
    torch.testing.assert_close(rm.cpu().double(), 0.1 * mean, rtol=1e-4, atol=1e-6)


GROUP_2 = [
    "check_fp32_equal_batches",
    "check_dtype_pairs_batchnorm_refuses",
    "check_fp32_unequal_batches",
    "check_shapes_2d_3d_5d",
    "check_bf16_input_fp32_params",
    "check_fp16_input_fp32_params",
    "check_channels_last",
    "check_channel_last_flag",
    "check_triton_kernels_run_for_channels_last",
    "check_plan_follows_parameter_changes",
    "check_channels_last_with_contiguous_gradient",
    "check_copies_and_pickles_after_use",
    "check_under_torch_compile",
    "check_saved_tensors_as_contiguous_copies",
    "check_input_without_grad",
    "check_no_affine_no_running_stats",
    "check_inplace_op_on_output",
    "check_half_parameters",
    "check_single_value_per_channel_raises",
    "check_eval_mode_uses_running_stats_without_communication",
    "check_convert_syncbn_model_matches_batchnorm",
    "check_deepcopy_with_process_group",
    "check_residual_z_and_fuse_relu",
    "check_the_layers_eps_reaches_the_multi_rank_path",
    "check_empty_rank",
    "check_empty_global_batch",
    "check_batch_size_changes_between_steps",
    "check_ranks_with_images_of_different_sizes",
    "check_cpu_merge_in_fp64_keeps_the_variance_of_offset_inputs",
    "check_syncbn_eval_without_running_stats_normalizes_by_the_local_batch",
    "check_a_layer_pickled_without_the_count_cache_trains_over_the_ranks",
    "check_ranks_disagreeing_on_channels_or_dtype_raise_on_every_rank",
    "check_ranks_with_half_and_float_inputs_agree_on_float32_statistics",
    "check_the_functional_form_without_a_cache_runs_over_the_ranks",
    "check_a_parameter_free_layer_fed_many_channel_counts_keeps_its_cache_small",
]
GROUP_4 = ["check_fp32_unequal_batches", "check_ranks_with_images_of_different_sizes",
           "check_empty_rank", "check_batch_size_changes_between_steps",
           "check_syncbn_process_groups",
           "check_syncbn_group_size_must_divide_the_world_size",
           "check_all_gather_rows_puts_each_rank_at_its_index",
           "check_ranks_disagreeing_on_channels_or_dtype_raise_on_every_rank"]


@pytest.fixture(scope="module")
def gloo_2():
    return run_checks(__name__, GROUP_2, world_size=2, env=_CPU_ENV)


@pytest.fixture(scope="module")
def gloo_4():
    return run_checks(__name__, GROUP_4, world_size=4, env=_CPU_ENV)


@pytest.fixture(scope="module")
def nccl_2():
    if cuda_count() < 2:
        pytest.skip("requires 2 GPUs")
    return run_checks(__name__, GROUP_2, world_size=2, backend="nccl", device_type="cuda")


@pytest.fixture(scope="module")
def one_gpu_gloo_2():
    # Two processes on one GPU, statistics exchanged over gloo: the real CUDA kernels on a
    # machine with a single GPU.
    if cuda_count() < 1:
        pytest.skip("requires CUDA")
    return run_checks(__name__, GROUP_2, world_size=2, device_type="cuda", shared_device=True)


@pytest.fixture(scope="module")
def one_gpu_gloo_4():
    # Four processes on one GPU over gloo: the process-group checks (groups of 2, unequal and
    # empty ranks) on the CUDA kernels, which GROUP_2 runs with the default group only.
    if cuda_count() < 1:
        pytest.skip("requires CUDA")
    return run_checks(__name__, GROUP_4, world_size=4, device_type="cuda", shared_device=True)


@pytest.mark.parametrize("check", GROUP_2)
def test_cpu_gloo_2_ranks(gloo_2, check):
    gloo_2.assert_ok(check)


@pytest.mark.parametrize("check", GROUP_4)
def test_cpu_gloo_4_ranks(gloo_4, check):
    gloo_4.assert_ok(check)


@pytest.mark.parametrize("check", GROUP_2)
def test_gpu_nccl_2_gpus(nccl_2, check):
    nccl_2.assert_ok(check)


@pytest.mark.parametrize("check", GROUP_2)
def test_gpu_one_gpu_2_ranks(one_gpu_gloo_2, check):
    one_gpu_gloo_2.assert_ok(check)


@pytest.mark.parametrize("check", GROUP_4)
def test_gpu_one_gpu_4_ranks(one_gpu_gloo_4, check):
    one_gpu_gloo_4.assert_ok(check)


# ------------------------------------------------------------------------------------------------
# single process: not distributed, so it must be BatchNorm
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def not_distributed():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")


@pytest.mark.parametrize("counted", [True, False], ids=["counted", "no-count"])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_process_is_batchnorm(not_distributed, device, dtype, momentum, counted):
    # (no-count: num_batches_tracked set to None, as a layer from before the counter: with
    # momentum=None BatchNorm then leaves the running statistics as they are. r98E's M66)
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4, momentum=momentum).to(device)
    sync = convert_syncbn_model(copy.deepcopy(bn))
    assert isinstance(sync, SyncBatchNorm)
    if not counted:
        bn.num_batches_tracked = sync.num_batches_tracked = None
        with torch.no_grad():
            for layer in (bn, sync):
                layer.running_mean.copy_(torch.linspace(-1, 1, 4))
                layer.running_var.copy_(torch.linspace(0.5, 2, 4))
    for _ in range(2):
        x = torch.randn(6, 4, 5, 5, device=device, dtype=dtype)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = bn(x1), sync(x2)
        y1.square().sum().backward()
        y2.square().sum().backward()
        torch.testing.assert_close(y2, y1, rtol=0, atol=0)
        torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=0)
    torch.testing.assert_close(sync.running_mean, bn.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(sync.running_var, bn.running_var, rtol=0, atol=0)
    assert (int(sync.num_batches_tracked) == 2) if counted else sync.num_batches_tracked is None
    bn.eval()
    sync.eval()
    x = torch.randn(3, 4, 5, 5, device=device, dtype=dtype)
    torch.testing.assert_close(sync(x), bn(x), rtol=0, atol=0)


def test_single_process_channel_last_flag(not_distributed):
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4)
    sync = SyncBatchNorm(4, channel_last=True)
    x = torch.randn(6, 5, 5, 4)  # (N, H, W, C)
    y = sync(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, bn(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1))
    torch.testing.assert_close(sync.running_var, bn.running_var)
    # A 3-D (N, L, C) input (a sequence batch) normalizes over (N, L) per channel, input
    # gradient and statistics too; L equals C here, so the wrong dimension would still run.
    # (S18)
    x = torch.randn(5, 3, 3) * torch.tensor([1.0, 3.0, 0.5]) + torch.tensor([0.0, 2.0, -1.0])
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    layer, ref = SyncBatchNorm(3, channel_last=True), nn.BatchNorm1d(3)
    got, want = layer(x1), ref(x2.transpose(1, 2)).transpose(1, 2)
    dy = torch.randn(5, 3, 3)
    got.backward(dy)
    want.backward(dy)
    for a, b in ((got, want), (x1.grad, x2.grad), (layer.running_mean, ref.running_mean),
                 (layer.running_var, ref.running_var)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_syncbn_with_one_channel_is_batchnorm(not_distributed):
    """A one-channel layer (a single feature, a grayscale stem) is a valid BatchNorm
    (``nn.BatchNorm1d(1)``): it constructs and normalizes as BatchNorm does, output and
    running statistics bit for bit on one process. (S36)"""
    torch.manual_seed(0)
    x = torch.randn(8, 1, 5) * 3 + 2
    layer, ref = SyncBatchNorm(1), nn.BatchNorm1d(1)
    torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=0)
    torch.testing.assert_close(layer.running_var, ref.running_var, rtol=0, atol=0)


@pytest.mark.parametrize("fuse_relu", [False, True])
def test_single_process_residual_z_and_fuse_relu(not_distributed, fuse_relu):
    # Apex's optimized SyncBatchNorm(fuse_relu=...) and forward(input, z): bn(input) + z, then
    # the ReLU if asked for.
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4)
    sync = SyncBatchNorm(4, fuse_relu=fuse_relu)
    x, z = torch.randn(6, 4, 5, 5), torch.randn(6, 4, 5, 5)
    want = bn(x) + z
    torch.testing.assert_close(sync(x, z), F.relu(want) if fuse_relu else want)
    assert ("fuse_relu=True" in repr(sync)) == fuse_relu
    sync.eval()
    bn.eval()
    torch.testing.assert_close(sync(x), F.relu(bn(x)) if fuse_relu else bn(x))
    with pytest.raises(ValueError, match=r"z has shape \(6, 4\)"):
        sync(x, torch.randn(6, 4))
    with pytest.raises(TypeError, match="fuse_relu"):
        SyncBatchNorm(4, fuse_relu=1)


def test_syncbn_residual_z_follows_type_promotion_as_batchnorm_plus_z(not_distributed):
    """``forward(input, z)`` is ``bn(input) + z`` (documented): a half input with an fp32
    residual gives what that expression gives in PyTorch, an fp32 output of the fp32 sum (an
    in-place add would round the sum to half). Reference: nn.BatchNorm1d(input) + z, with
    the same parameters; bit for bit on one process. (S12)"""
    torch.manual_seed(0)
    x = (torch.randn(6, 4) * 2 + 1).to(torch.bfloat16)
    z = torch.randn(6, 4) * 1e-3 + 1  # (a small change on 1: lost if the sum is bf16)
    layer, ref = SyncBatchNorm(4), nn.BatchNorm1d(4)
    got, want = layer(x, z), ref(x) + z
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_syncbn_residual_z_of_another_shape_is_refused_even_where_it_broadcasts(
        not_distributed):
    """``forward(input, z)`` takes ``z`` shaped as the output (documented; Apex's optimized
    layer reads it element by element): a ``z`` of another shape is refused with the layer's
    message even where PyTorch would broadcast it, since a broadcast sum silently changes
    the result (a per-channel ``z`` of shape ``(N, C, 1, 1)``) or the output's shape (a ``z``
    with a larger batch), and the code after the layer relies on the output having the
    input's shape. Reference: the documented message; a ``z`` of the output's shape is
    taken. (S20)"""
    torch.manual_seed(0)
    layer = SyncBatchNorm(4)
    x = torch.randn(6, 4, 5, 5)
    for shape in ((6, 4, 1, 1), (1, 4, 5, 5), (12, 4, 5, 5)):
        with pytest.raises(ValueError, match=re.escape(f"z has shape {shape}, the output "
                                                       f"{tuple(x.shape)}")):
            layer(x, torch.randn(shape))
    assert layer(x, torch.zeros_like(x)).shape == x.shape


def test_a_layer_pickled_without_the_newer_attributes_runs_and_compiles(not_distributed):
    # A layer pickled by Apex's Python SyncBatchNorm (loaded through the alias) or by an
    # earlier mixprec has no channel_last / fuse_relu / _count_cache: its eager forward failed
    # (AttributeError), and compiled first it lent its graph, without the ReLU, to a
    # fuse_relu=True layer compiled after it (Dynamo guards no key missing from __dict__).
    import io

    torch.manual_seed(0)
    old = SyncBatchNorm(4)
    for key in ("channel_last", "fuse_relu", "_count_cache"):
        del old.__dict__[key]
    buf = io.BytesIO()
    torch.save(old, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(6, 4, 3, 3)
    bn = nn.BatchNorm2d(4)
    torch.testing.assert_close(loaded(x), bn(x))
    torch.compile(loaded, backend="eager")(x)
    fused = SyncBatchNorm(4, fuse_relu=True)
    got = torch.compile(fused, backend="eager")(x)
    torch.testing.assert_close(got, F.relu(nn.BatchNorm2d(4)(x)))
    assert got.min() >= 0


def test_syncbn_is_a_batchnorm_for_amp():
    from torch.nn.modules.batchnorm import _BatchNorm

    assert isinstance(SyncBatchNorm(3), _BatchNorm)
    assert "channel_last=True" in repr(SyncBatchNorm(3, channel_last=True))


def test_syncbn_input_errors():
    with pytest.raises(ValueError, match="at least 2D"):
        SyncBatchNorm(3)(torch.randn(3))
    with pytest.raises(ValueError, match="has 4 channels"):
        SyncBatchNorm(3)(torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match="channel_last=True"):
        SyncBatchNorm(3)(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="num_features"):
        SyncBatchNorm(0)
    with pytest.raises(TypeError, match="channel_last"):
        SyncBatchNorm(3, channel_last="yes")
    # A group size where the group goes: refused at construction (it failed in the first
    # training forward, with an AttributeError from inside torch.distributed).
    with pytest.raises(TypeError, match=r"SyncBatchNorm\(process_group=2\).*ProcessGroup.*"
                                        r"create_syncbn_process_group"):
        SyncBatchNorm(3, process_group=2)
    with pytest.raises(TypeError, match=r"convert_syncbn_model\(process_group='all'\)"):
        convert_syncbn_model(nn.Sequential(nn.Linear(2, 2)), process_group="all")
    # What torch.distributed.new_group(ranks) returns on a rank outside the ranks (an int
    # sentinel): a model built alike on every rank still constructs there.
    outside = torch.distributed.GroupMember.NON_GROUP_MEMBER
    assert SyncBatchNorm(3, process_group=outside).process_group == outside


@pytest.mark.parametrize("input_dtype, layer_dtype", [(torch.float64, torch.float32),
                                                      (torch.float32, torch.float64),
                                                      (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("training", [True, False])
def test_syncbn_refuses_the_dtype_pairs_batchnorm_refuses(input_dtype, layer_dtype, training):
    # The multi-rank path computed any pair of dtypes, so a model trained there failed in eval
    # (or alone) with PyTorch's "mixed dtype" error. Every path now takes what BatchNorm takes:
    # the layer's dtype, or half input with fp32 parameters.
    bn = SyncBatchNorm(3).to(layer_dtype).train(training)
    with pytest.raises(RuntimeError, match=f"input is {input_dtype}.*{layer_dtype}"):
        bn(torch.randn(4, 3, dtype=input_dtype))
    assert int(bn.num_batches_tracked) == 0  # (refused before anything was counted)
    for half in (torch.float16, torch.bfloat16):  # half input, fp32 layer: taken, as in O2
        out = SyncBatchNorm(3).train(training)(torch.randn(4, 3).to(half))
        assert out.dtype == half
    ref = nn.BatchNorm1d(3).to(layer_dtype).train(training)
    with pytest.raises(RuntimeError, match="(?i)dtype|scalar type|datatype"):  # (PyTorch's own)
        ref(torch.randn(4, 3, dtype=input_dtype))


@pytest.mark.parametrize("input_dtype, layer_dtype, affine", [
    (torch.bfloat16, torch.float64, True), (torch.float16, torch.float64, True),
    (torch.float64, torch.float32, False),
    (torch.bfloat16, torch.float16, True), (torch.float16, torch.bfloat16, True)])
def test_syncbn_refuses_the_other_dtype_pairs_with_its_own_message(input_dtype, layer_dtype,
                                                                     affine):
    """Half input is taken with float32 parameters or its own dtype's only (not float64
    ones, nor the other half dtype's: bf16 input into an fp16 layer), and a layer
    without affine parameters checks its running statistics' dtype: SyncBatchNorm refuses
    these pairs with its own message naming both dtypes, on every path, as BatchNorm refuses
    them (the multi-rank path would otherwise compute them and the model fail in eval).
    Reference: nn.BatchNorm1d refuses the same pairs. (S06 S07, r63B's S06)"""
    layer = SyncBatchNorm(3, affine=affine).to(layer_dtype)
    x = torch.randn(4, 3).to(input_dtype)
    with pytest.raises(RuntimeError, match=f"input is {input_dtype}, the layer's parameters "
                                           f"and buffers {layer_dtype}"):
        layer(x)
    assert int(layer.num_batches_tracked) == 0
    with pytest.raises(RuntimeError):
        nn.BatchNorm1d(3, affine=affine).to(layer_dtype)(x)


@pytest.mark.parametrize("kwargs, message", [
    (dict(momentum="0.1"), r"momentum='0.1'\): must be a number in \[0, 1\]"),
    (dict(momentum=1.5), r"momentum=1.5\): must be a number in \[0, 1\]"),
    (dict(eps=-1.0), r"eps=-1.0\): must be a number >= 0"),
    # A negative momentum (a running average moving away from the batch statistics) and a
    # NaN momentum or eps (NaN running statistics or outputs from the first step). (S01-S03)
    (dict(momentum=-0.1), r"momentum=-0.1\): must be a number in \[0, 1\]"),
    (dict(momentum=float("nan")), r"momentum=nan\): must be a number in \[0, 1\]"),
    (dict(eps=float("nan")), r"eps=nan\): must be a number >= 0"),
    (dict(eps="1e-5"), r"eps='1e-5'\): must be a number >= 0"),
])
def test_bad_eps_and_momentum_are_refused_at_construction(kwargs, message):
    # A string failed at the first forward with a bare TypeError; a negative eps was taken.
    with pytest.raises(ValueError, match=message):
        SyncBatchNorm(4, **kwargs)
    SyncBatchNorm(4, momentum=None, eps=0.0)  # a cumulative average; eps 0 as BatchNorm takes


def test_eps_zero_is_refused_where_batch_statistics_normalize(not_distributed):
    """eps=0 constructs, as BatchNorm's does, and in eval mode with running statistics does
    what the installed PyTorch's BatchNorm does (torch 2.4 and 2.13 normalize with it, 2.11
    refuses it there too); normalizing by batch statistics with it (training, or eval without
    running statistics) is refused with the layer's own message before any batch is counted,
    on every version: a channel whose values are all equal has variance 0 (one process's
    BatchNorm refuses it on recent PyTorch; the multi-rank path gave NaN). Reference:
    nn.BatchNorm1d(eps=0) in eval, its output or its error."""
    x = torch.randn(5, 4)
    layer = SyncBatchNorm(4, eps=0.0)
    with pytest.raises(ValueError, match=r"^SyncBatchNorm\(4\): eps=0\.0 normalizing by batch "
                                         r"statistics.*Set a positive eps"):
        layer(x)
    assert int(layer.num_batches_tracked) == 0
    ref = nn.BatchNorm1d(4, eps=0.0).eval()
    try:
        expected = ref(x)
    except ValueError as refused:  # torch 2.11: eps must be positive in eval mode too
        with pytest.raises(ValueError, match=re.escape(str(refused))):
            layer.eval()(x)
    else:
        torch.testing.assert_close(layer.eval()(x), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"eps=0\.0 normalizing by batch statistics"):
        SyncBatchNorm(4, eps=0.0, track_running_stats=False).eval()(x)


def test_integer_eps_and_momentum_are_taken_as_batchnorm_takes_them(not_distributed):
    """eps and momentum written as Python ints (``eps=1``, ``momentum=1``, ``momentum=0``) are
    numbers in range: the layer takes them, as nn.BatchNorm1d does, and computes what
    nn.BatchNorm1d with the same ints computes. Reference: nn.BatchNorm1d (one process:
    SyncBatchNorm is BatchNorm, bit for bit): output and running statistics. (S04)"""
    torch.manual_seed(0)
    x = torch.randn(6, 3) * 0.5 + 1
    for kwargs in (dict(eps=1, momentum=1), dict(eps=1, momentum=0)):
        layer, ref = SyncBatchNorm(3, **kwargs), nn.BatchNorm1d(3, **kwargs)
        torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=0, msg=str(kwargs))
        torch.testing.assert_close(layer.running_mean, ref.running_mean, rtol=0, atol=0)
        torch.testing.assert_close(layer.running_var, ref.running_var, rtol=0, atol=0)


def test_integer_input_is_told_to_cast_the_input_only():
    # The advice for an integer batch was "or the layer (layer.to(torch.int64))": BatchNorm
    # parameters cannot be integers.
    with pytest.raises(RuntimeError) as err:
        SyncBatchNorm(4)(torch.ones(3, 4, dtype=torch.long))
    message = str(err.value)
    assert "Cast the input (input.to(torch.float32))." in message and "layer" not in \
        message.split("Cast the input")[1], message


def test_parameter_free_syncbn_takes_any_channel_count():
    # BatchNorm without weight, bias or running statistics normalizes any number of channels;
    # converted, it raised "has 7 channels ... expected 3".
    bn = nn.BatchNorm2d(3, affine=False, track_running_stats=False)
    x = torch.randn(4, 7, 5, 5, dtype=torch.float64)
    sync = convert_syncbn_model(bn)
    assert isinstance(sync, SyncBatchNorm)
    torch.testing.assert_close(sync(x), bn(x), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="has 7 channels"):  # with statistics it is checked
        SyncBatchNorm(3, affine=False)(x.float())


@pytest.mark.parametrize("affine", [True, False])
def test_eval_without_running_stats_normalizes_by_the_batch(not_distributed, affine):
    # track_running_stats=False: eval mode normalizes by the batch's own statistics, as
    # BatchNorm does (it raised from F.batch_norm). Reference: nn.BatchNorm2d, bit for bit.
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4, affine=affine, track_running_stats=False).eval()
    sync = SyncBatchNorm(4, affine=affine, track_running_stats=False).eval()
    if affine:
        with torch.no_grad():
            sync.weight.copy_(torch.rand(4) + 0.5)
            sync.bias.copy_(torch.randn(4))
            bn.load_state_dict(sync.state_dict())
    x = torch.randn(6, 4, 5, 5) * 3 + 1
    torch.testing.assert_close(sync(x), bn(x), rtol=0, atol=0)


def test_convert_syncbn_model_keeps_the_batch_count(not_distributed):
    # A trained BatchNorm's num_batches_tracked goes over with it: with momentum=None (a
    # cumulative average) the converted layer goes on averaging where BatchNorm stopped, and
    # its checkpoint keeps the count. Reference: the BatchNorm training on (one process:
    # SyncBatchNorm is BatchNorm, bit for bit).
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4, momentum=None)
    for _ in range(3):
        bn(torch.randn(6, 4, 3, 3) * 2 + 1)
    ref = copy.deepcopy(bn)
    tracked = bn.num_batches_tracked
    sync = convert_syncbn_model(bn)
    assert isinstance(sync, SyncBatchNorm) and sync.num_batches_tracked is tracked
    x = torch.randn(6, 4, 3, 3)
    sync(x)
    ref(x)
    assert sync.state_dict()["num_batches_tracked"].item() == 4
    torch.testing.assert_close(sync.running_mean, ref.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(sync.running_var, ref.running_var, rtol=0, atol=0)


def test_convert_syncbn_model_keeps_parameters_mode_and_requires_grad():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4),
                          nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False)))
    model[1].weight.requires_grad_(False)
    model[1].running_mean.fill_(0.25)
    model[1].eval()
    weight, running_mean = model[1].weight, model[1].running_mean
    converted = convert_syncbn_model(model, channel_last=False)
    assert converted is model
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[2][1], SyncBatchNorm)
    assert model[1].weight is weight and not model[1].weight.requires_grad
    assert model[1].running_mean is running_mean
    assert not model[1].training and model[2][1].training
    assert model[2][1].weight is None
    assert set(model.state_dict()) == {
        "0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
        "1.num_batches_tracked", "2.0.weight", "2.0.bias", "2.1.running_mean",
        "2.1.running_var", "2.1.num_batches_tracked",
    }
    already = SyncBatchNorm(4)
    assert convert_syncbn_model(already) is already
    with pytest.raises(TypeError, match="torch.nn.Module"):
        convert_syncbn_model("resnet")


def test_convert_syncbn_model_existing_layers_take_the_arguments():
    # As Apex's function (which rebuilt every _BatchNorm, its own SyncBatchNorm included): a
    # model that builds SyncBatchNorm layers itself, converted with a group, uses the group.
    group = object()  # (stands in for a ProcessGroup: nothing communicates here)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), SyncBatchNorm(4), nn.BatchNorm2d(4))
    layer = model[1]
    assert convert_syncbn_model(model, process_group=group, channel_last=True) is model
    assert model[1] is layer
    for bn in (model[1], model[2]):
        assert bn.process_group is group and bn.channel_last, bn
    convert_syncbn_model(model)
    assert model[1].process_group is None and not model[1].channel_last


def test_convert_syncbn_model_reaches_module_lists_and_dicts():
    """BatchNorm layers held in ``nn.ModuleList`` / ``nn.ModuleDict`` containers (stages of
    ResNet-like models, heads by name) are converted like those in ``nn.Sequential``, with
    the same parameter objects, so no layer is left syncing nothing. (C07)"""
    bns = [nn.BatchNorm2d(4), nn.BatchNorm1d(3)]
    weights = [bn.weight for bn in bns]
    model = nn.Module()
    model.stages = nn.ModuleList([bns[0]])
    model.heads = nn.ModuleDict({"a": bns[1]})
    convert_syncbn_model(model)
    assert isinstance(model.stages[0], SyncBatchNorm) and isinstance(model.heads["a"],
                                                                     SyncBatchNorm)
    assert model.stages[0].weight is weights[0] and model.heads["a"].weight is weights[1]


class _BatchNormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d pattern: a BatchNorm subclass with submodules."""

    def __init__(self, num_features):
        super().__init__(num_features)
        self.act = nn.PReLU(num_features)
        self.extra = nn.Sequential(nn.BatchNorm1d(num_features))

    def forward(self, x):
        return self.act(super().forward(x))


def test_convert_syncbn_model_keeps_a_subclass_submodules():
    # Their parameters stay in the model (an optimizer built earlier, a checkpoint loaded with
    # strict=True), converted too, as Apex and torch's convert_sync_batchnorm keep them.
    model = nn.Sequential(nn.Conv2d(3, 4, 1), _BatchNormAct(4))
    state = model.state_dict()
    act = model[1].act
    convert_syncbn_model(model)
    assert isinstance(model[1], SyncBatchNorm) and model[1].act is act
    assert isinstance(model[1].extra[0], SyncBatchNorm)
    assert set(model.state_dict()) == set(state)
    model.load_state_dict(state, strict=True)


def test_convert_syncbn_model_numpy_num_features():
    # BatchNorm takes any integer type (a NumPy one from a model's channel arithmetic), as does
    # torch's convert_sync_batchnorm: such a layer must convert, not raise.
    np = pytest.importorskip("numpy")
    model = convert_syncbn_model(nn.Sequential(nn.BatchNorm2d(np.int64(4))))
    assert isinstance(model[0], SyncBatchNorm)
    assert model[0].num_features == 4 and type(model[0].num_features) is int
    for bad in (0, -2, 2.0, True, "3", None, np.int64(0)):
        with pytest.raises(ValueError, match="num_features"):
            SyncBatchNorm(bad)


def test_convert_syncbn_model_lazy_batchnorm():
    lazy = nn.Sequential(nn.Conv2d(3, 4, 1), nn.LazyBatchNorm2d())
    with pytest.raises(ValueError, match=r"layer '1' \(LazyBatchNorm2d\) has not seen an "
                                         r"input.*forward pass.*The model is unchanged"):
        convert_syncbn_model(lazy)
    assert type(lazy[1]) is nn.LazyBatchNorm2d
    lazy(torch.randn(2, 3, 2, 2))  # materialized: a BatchNorm2d(4) now
    converted = convert_syncbn_model(lazy)
    assert isinstance(converted[1], SyncBatchNorm) and converted[1].num_features == 4


def test_convert_syncbn_model_running_statistics_are_the_same_objects():
    # (r99C G1) Every buffer moves over, not only running_mean.
    bn = nn.BatchNorm2d(4)
    bn(torch.randn(5, 4, 3, 3))
    buffers = dict(bn.named_buffers())
    sync = convert_syncbn_model(bn)
    assert set(dict(sync.named_buffers())) == set(buffers)
    for name, buf in buffers.items():
        assert getattr(sync, name) is buf, name


class _BatchNormWithDropout(nn.BatchNorm1d):
    def __init__(self, num_features):
        super().__init__(num_features)
        self.drop = nn.Dropout(0.5)


def test_convert_syncbn_model_subclass_submodules_keep_their_own_mode():
    # (r99C G2) A subclass layer's submodules keep the mode each had, not the layer's.
    layer = _BatchNormWithDropout(3)
    layer.drop.eval()
    frozen = _BatchNormWithDropout(3).eval()
    frozen.drop.train()
    model = convert_syncbn_model(nn.Sequential(layer, frozen))
    assert model[0].training and not model[0].drop.training
    assert not model[1].training and model[1].drop.training


class _TwoNames(nn.Module):
    """One BatchNorm registered under two names of one module (``self.norm = self.bn``); the
    forward uses the second."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.norm = self.bn

    def forward(self, x):
        return self.norm(x)


def test_convert_syncbn_model_reaches_a_layer_under_every_name(not_distributed):
    # (r99C B1) named_children() lists a module once, under its first name: the layer the
    # forward used (`norm`) stayed a BatchNorm1d, so it normalised over one rank's batch
    # without a word. Now one SyncBatchNorm under both names, and a layer shared by two
    # blocks stays one layer (one object) too; on one process it is BatchNorm, bit for bit.
    torch.manual_seed(0)
    shared = nn.BatchNorm1d(3)
    ref = nn.Sequential(_TwoNames(), nn.Sequential(shared), nn.Sequential(shared))
    model = convert_syncbn_model(copy.deepcopy(ref))
    assert isinstance(model[0].bn, SyncBatchNorm) and model[0].norm is model[0].bn
    assert isinstance(model[1][0], SyncBatchNorm) and model[1][0] is model[2][0]
    assert list(model.state_dict()) == list(ref.state_dict())
    x = torch.randn(6, 3) * 2 + 1
    outs = [(net(x), net[1](x - 3)) for net in (ref, model)]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for got, want in zip(model.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert int(model[2][0].num_batches_tracked) == 3  # (the shared layer ran three times)


def test_convert_syncbn_model_error_names_the_layer_and_changes_nothing():
    # (r99C R4) torch's BatchNorm takes momentum=1.5; SyncBatchNorm refuses it. The error
    # names the layer, and the layers converted before it are not left swapped in.
    model = nn.Sequential(nn.Sequential(nn.BatchNorm2d(4)), nn.BatchNorm2d(4, momentum=1.5))
    existing = SyncBatchNorm(4)
    model.append(existing)
    with pytest.raises(ValueError, match=r"layer '1' \(BatchNorm2d\): SyncBatchNorm\("
                                         r"momentum=1.5\).*The model is unchanged"):
        convert_syncbn_model(model, channel_last=True)
    assert [type(m) for m in (model[0][0], model[1])] == [nn.BatchNorm2d, nn.BatchNorm2d]
    assert model[2] is existing and not existing.channel_last
    # (A root layer is named by its class.)
    with pytest.raises(ValueError, match=r"layer 'BatchNorm1d' \(BatchNorm1d\)"):
        convert_syncbn_model(nn.BatchNorm1d(2, momentum=-1.0))


def test_convert_syncbn_model_warns_about_hooks_it_does_not_carry(not_distributed):
    # (r99C R3) As torch's convert_sync_batchnorm, hooks stay on the old layer; a warning
    # names the layers, and none comes for a model without such hooks.
    seen = []
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm1d(3)))
    model[0].register_forward_hook(lambda *args: seen.append("linear"))
    model[2][0].register_forward_pre_hook(lambda *args: seen.append("bn"))
    with pytest.warns(UserWarning, match=r"hooks registered on 2\.0 are not carried"):
        convert_syncbn_model(model)
    model(torch.randn(4, 3))
    assert seen == ["linear"] and isinstance(model[2][0], SyncBatchNorm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_syncbn_model(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))


def test_create_syncbn_process_group_errors(not_distributed):
    assert create_syncbn_process_group(0) is None
    with pytest.raises(ValueError, match=">= 0"):
        create_syncbn_process_group(-1)
    with pytest.raises(ValueError, match=">= 0"):
        create_syncbn_process_group(2.0)
    for flag in (True, False):  # (not a size: True would be groups of one rank, C04)
        with pytest.raises(ValueError, match=rf"group_size={flag}\): must be an int >= 0"):
            create_syncbn_process_group(flag)
    np = pytest.importorskip("numpy")
    assert create_syncbn_process_group(np.int64(0)) is None  # (any integer type, as Apex)
    with pytest.raises(RuntimeError, match="init_process_group"):
        create_syncbn_process_group(2)


@pytest.mark.parametrize("loss", ["square", "linear in the output"])
def test_second_derivative_is_a_clear_error(loss):
    # The function's backward gives first derivatives only: a second one through it raises,
    # also for a loss linear in the output (whose gradient still depends on x).
    x = torch.randn(6, 3, 4, requires_grad=True)
    w = torch.rand(3, requires_grad=True)
    y = fn.sync_batch_norm(x, w, torch.zeros(3), None, None, 1e-5, 0.1, fn.LOCAL, 1)
    out = y.pow(2).sum() if loss == "square" else (y * torch.randn_like(y)).sum()
    (gx,) = torch.autograd.grad(out, x, create_graph=True)
    # (The message says what to do: a GAN's gradient penalty is where users meet it.)
    with pytest.raises(RuntimeError, match=r"^SyncBatchNorm \(a gradient penalty .* keep "
                                           r"torch\.nn\.BatchNorm\*d in that model.*: trying "
                                           r"to differentiate twice"):
        gx.pow(2).sum().backward()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_convert_syncbn_model_after_initialize_keeps_amp_fp32_batchnorm(not_distributed, dtype):
    # At O1 with keep_batchnorm_fp32, amp gives each BatchNorm its fp32 forward. Converted
    # afterwards, the new SyncBatchNorm lost it without a word (it ran as autocast left it:
    # half input, on CUDA a half computation). Reference: the model converted before
    # initialize (one process: bit for bit).
    from mixprec import amp
    from mixprec.amp._model import converted_part_of
    from tests.amp.helpers import check_conversion_after_initialize, make_cnn

    check_conversion_after_initialize(convert_syncbn_model, SyncBatchNorm, dtype)

    # At O2 the new layer is a part of the model, as the old one was: initialize refuses it.
    model = amp.initialize(make_cnn(), opt_level="O2", dtype=dtype, verbosity=0)
    model = convert_syncbn_model(model)
    layer = next(m for m in model.modules() if isinstance(m, SyncBatchNorm))
    assert converted_part_of(layer) is model
    with pytest.raises(ValueError, match="part"):
        amp.initialize(layer, opt_level="O2", dtype=dtype, verbosity=0)


@pytest.mark.parametrize("opt_level,keep_bn", [("O3", None), ("O2", False)])
def test_convert_syncbn_model_after_initialize_keeps_fp32_checkpoints(not_distributed,
                                                                       opt_level, keep_bn):
    # With BatchNorm in half (O3; O2 with keep_batchnorm_fp32=False) the new SyncBatchNorm
    # layers saved half tensors (at O2 the half copy, not the fp32 master) and a load wrote
    # the masters rounded to half: amp's state-dict hooks were not carried over. Reference:
    # the model converted before initialize, after the same step.
    from mixprec import amp

    def run(after):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if not after:
            model = convert_syncbn_model(model)
        model, opt = amp.initialize(model, opt, opt_level=opt_level, keep_batchnorm_fp32=keep_bn,
                                    dtype=torch.float16, loss_scale=1.0, verbosity=0)
        if after:
            model = convert_syncbn_model(model)
        assert isinstance(model[1], SyncBatchNorm)
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        return model, opt

    (want_model, _), (model, opt) = run(after=False), run(after=True)
    want, got = want_model.state_dict(), model.state_dict()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    assert got["1.weight"].dtype == torch.float32
    if opt_level == "O2":
        masters = dict(zip((id(p) for p in model.parameters()), amp.master_params(opt)))
        assert torch.equal(got["1.bias"], masters[id(model[1].bias)])
        # A load writes the exact fp32 values into the masters (not rounded to half).
        loaded = {k: v + 1e-4 if v.is_floating_point() else v for k, v in got.items()}
        model.load_state_dict(loaded)
        assert torch.equal(masters[id(model[1].bias)], loaded["1.bias"])


def test_convert_syncbn_model_keeps_the_qconfig():
    # As torch.nn.SyncBatchNorm.convert_sync_batchnorm does: a layer prepared for quantization
    # (its qconfig set, e.g. by torch.ao.quantization.propagate_qconfig_) keeps it, so that a
    # quantization-aware-training flow still finds it on the converted layer.
    qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    model[1].qconfig = qconfig
    plain = nn.BatchNorm2d(4)  # (no qconfig: none appears)
    converted = convert_syncbn_model(nn.Sequential(model, plain))
    assert isinstance(converted[0][1], SyncBatchNorm)
    assert converted[0][1].qconfig is qconfig
    assert not hasattr(converted[1], "qconfig")


@pytest.mark.parametrize("flag", [1, None, "False"])
def test_convert_syncbn_model_refuses_a_non_bool_channel_last(flag):
    # Checked by convert_syncbn_model itself, whatever the model holds: an existing
    # SyncBatchNorm takes the flag as given (no constructor to check it), and a model without
    # BatchNorm converts nothing; 1 / None / "False" there set the layout silently.
    for model in (nn.Sequential(SyncBatchNorm(4)), nn.Sequential(nn.Linear(2, 2)),
                  nn.Sequential(nn.BatchNorm2d(4))):
        with pytest.raises(TypeError, match=r"convert_syncbn_model\(channel_last="):
            convert_syncbn_model(model, channel_last=flag)
    layer = SyncBatchNorm(4)
    with pytest.raises(TypeError, match=r"convert_syncbn_model\(channel_last="):
        convert_syncbn_model(layer, channel_last=flag)
    assert layer.channel_last is False


def test_syncbn_momentum_zero_keeps_the_running_statistics(not_distributed):
    # momentum=0 is a valid BatchNorm setting (running statistics frozen while the batch
    # statistics still normalize): accepted, and the layer matches nn.BatchNorm1d (to 1e-6; the
    # running statistics exactly).
    torch.manual_seed(0)
    x = torch.randn(6, 3) * 2 + 1
    layer, ref = SyncBatchNorm(3, momentum=0.0), nn.BatchNorm1d(3, momentum=0.0)
    out, expected = layer(x), ref(x)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.running_mean, torch.zeros(3), rtol=0, atol=0)
    torch.testing.assert_close(layer.running_var, torch.ones(3), rtol=0, atol=0)


@pytest.mark.parametrize("pause", ["eval", "tracking off"])
def test_syncbn_counts_training_batches_only(not_distributed, pause):
    # As nn.BatchNorm: num_batches_tracked counts the training batches with tracking on. An
    # evaluation pass, or a training batch while track_running_stats is switched off on the
    # built layer, must not advance it (with momentum=None it sets the next training step's
    # average weight 1/num_batches_tracked, and it is saved in checkpoints). Reference:
    # nn.BatchNorm1d. (The tracking-off case: r53B's B05.)
    torch.manual_seed(0)
    x = torch.randn(6, 3)
    for momentum in (0.1, None):
        layer, ref = SyncBatchNorm(3, momentum=momentum), nn.BatchNorm1d(3, momentum=momentum)
        for net in (layer, ref):
            net(x)
            if pause == "eval":
                net.eval()
            else:
                net.track_running_stats = False
            net(x * 2)
            net.train()
            net.track_running_stats = True
            net(x * 2 + 1)
        assert int(layer.num_batches_tracked) == int(ref.num_batches_tracked) == 2, (
            momentum, int(layer.num_batches_tracked))
        torch.testing.assert_close(layer.running_mean, ref.running_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(layer.running_var, ref.running_var, rtol=1e-6, atol=1e-6)


def test_syncbn_tracking_turned_off_after_construction_is_batchnorm(not_distributed):
    # nn.BatchNorm lets track_running_stats be switched off on a built layer (its buffers
    # stay): training then normalizes by the batch and leaves the running statistics alone,
    # and eval still normalizes by them. SyncBatchNorm (single process: plain batch norm)
    # must do the same, output and buffers.
    torch.manual_seed(0)
    x = torch.randn(6, 3) * 3 + 2
    layer, ref = SyncBatchNorm(3), nn.BatchNorm1d(3)
    for net in (layer, ref):
        net(x)  # (running statistics away from their initial values)
        net.track_running_stats = False
    for training in (True, False):
        layer.train(training)
        ref.train(training)
        torch.testing.assert_close(layer(x * 0.5), ref(x * 0.5), rtol=1e-6, atol=1e-6,
                                   msg=labelled(f"training={training}"))
        torch.testing.assert_close(layer.running_mean, ref.running_mean, rtol=0, atol=0)
        torch.testing.assert_close(layer.running_var, ref.running_var, rtol=0, atol=0)


@pytest.mark.parametrize("track", [True, False])
def test_convert_syncbn_model_keeps_eps_momentum_and_tracking(not_distributed, track):
    # The converted layer takes the BatchNorm's settings, not the defaults: a large eps (over
    # a small-variance batch it changes the output), the momentum, track_running_stats.
    # Reference: the BatchNorm itself (one process: SyncBatchNorm is BatchNorm, bit for bit).
    # (V02 V03)
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4, eps=0.1, momentum=0.3, track_running_stats=track)
    ref = copy.deepcopy(bn)
    sync = convert_syncbn_model(bn)
    assert (sync.eps, sync.momentum, sync.track_running_stats) == (0.1, 0.3, track)
    x = torch.randn(6, 4, 3, 3) * 0.1
    torch.testing.assert_close(sync(x), ref(x), rtol=0, atol=0)
    if track:
        torch.testing.assert_close(sync.running_var, ref.running_var, rtol=0, atol=0)


class _SyncBatchNormAct(SyncBatchNorm):
    """The same pattern on a model's own SyncBatchNorm subclass (timm's SyncBatchNormAct)."""

    def __init__(self, num_features):
        super().__init__(num_features)
        self.act = nn.PReLU(num_features)
        self.extra = nn.Sequential(nn.BatchNorm1d(num_features))


@pytest.mark.parametrize("cls", [_BatchNormAct, _SyncBatchNormAct])
def test_convert_syncbn_model_subclass_submodules_take_the_arguments(cls):
    # A BatchNorm subclass's own submodules are converted with the group and the flag given
    # (as the rest of the model is): a BatchNorm inside it syncs over the same group. So are
    # those of a SyncBatchNorm subclass, which itself stays the same object with the group
    # and flag given (a BatchNorm inside it would otherwise normalize over this rank's batch
    # alone). (V08, C05)
    group = object()  # (stands in for a ProcessGroup: nothing communicates here)
    layer = cls(4)
    act = layer.act
    model = convert_syncbn_model(nn.Sequential(layer), process_group=group,
                                 channel_last=True)
    inner = model[0].extra[0]
    assert isinstance(inner, SyncBatchNorm)
    assert inner.process_group is group and inner.channel_last is True
    assert model[0].act is act
    if cls is _SyncBatchNormAct:
        assert model[0] is layer
        assert layer.process_group is group and layer.channel_last is True


def test_convert_syncbn_model_converts_torchs_own_syncbatchnorm():
    # A model built with torch's nn.SyncBatchNorm (a norm_layer argument, or torch's own
    # convert_sync_batchnorm run earlier) is converted too, as the docstring says of every
    # _BatchNorm: the layer becomes mixprec's SyncBatchNorm with the group given, keeping its
    # Parameter and buffer objects (an optimizer built earlier holds them) and its settings.
    # Reference: nn.BatchNorm2d with the layer's state (one process: bit for bit). (C23)
    group = object()  # (stands in for a ProcessGroup: nothing communicates here)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.SyncBatchNorm(4, momentum=0.3))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].running_mean.uniform_()
    weight, running_mean = model[1].weight, model[1].running_mean
    ref = nn.BatchNorm2d(4, momentum=0.3)
    ref.load_state_dict(model[1].state_dict())
    convert_syncbn_model(model, process_group=group, channel_last=False)
    layer = model[1]
    assert type(layer) is SyncBatchNorm, type(layer)
    assert layer.weight is weight and layer.running_mean is running_mean
    assert layer.process_group is group and layer.momentum == 0.3
    layer.process_group = None  # (one process: run it as BatchNorm)
    x = torch.randn(6, 4, 3, 3)
    torch.testing.assert_close(layer(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(momentum=True), r"momentum=True\): must be a number in \[0, 1\]"),
    (dict(eps=True), r"eps=True\): must be a number >= 0"),
])
def test_bool_eps_and_momentum_are_refused_at_construction(kwargs, message):
    # A bool is a number to Python (True == 1) but never a meant eps or momentum (a flag
    # passed in the wrong position): refused, as the other non-numbers are. (B02 B03)
    with pytest.raises(ValueError, match=message):
        SyncBatchNorm(4, **kwargs)


def test_syncbn_without_bias_is_batchnorm_without_bias(not_distributed):
    # SyncBatchNorm(bias=False): a learnable weight and no bias, as nn.BatchNorm2d(bias=False):
    # the same parameters and state-dict keys, the same output (one process: bit for bit).
    # (B04)
    if "bias" not in inspect.signature(nn.BatchNorm2d).parameters:
        pytest.skip("this PyTorch's BatchNorm has no bias argument")
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(4, bias=False)
    sync = SyncBatchNorm(4, bias=False)
    assert sync.bias is None and sync.weight is not None
    assert set(sync.state_dict()) == set(ref.state_dict())
    x = torch.randn(5, 4, 3, 3) * 2 + 1
    torch.testing.assert_close(sync(x), ref(x), rtol=0, atol=0)
    # convert_syncbn_model of one keeps its weight object and no bias (C08).
    bn = copy.deepcopy(ref)
    converted = convert_syncbn_model(bn)
    assert converted.weight is bn.weight and converted.bias is None
    assert set(converted.state_dict()) == set(ref.state_dict())
    ref.train()
    torch.testing.assert_close(converted(x), ref(x), rtol=0, atol=0)


def test_syncbn_custom_group_shows_in_repr():
    # A layer with its own process group says so in its repr (printing a model shows which
    # layers sync over a subgroup); the default group adds nothing. (B13)
    group = object()  # (stands in for a ProcessGroup)
    assert "process_group=<custom>" in repr(SyncBatchNorm(3, process_group=group))
    assert "process_group" not in repr(SyncBatchNorm(3))


def test_syncbn_fewer_channels_than_num_features_is_refused():
    # An input with fewer channels than the layer has is refused by the layer's own check,
    # naming the channel counts (as one with more channels is), in training and eval. (B14)
    for training in (True, False):
        layer = SyncBatchNorm(3).train(training)
        with pytest.raises(ValueError, match=r"has 2 channels .* expected 3"):
            layer(torch.randn(4, 2, 5))
        with pytest.raises(ValueError, match=r"has 2 channels in its last dimension; expected 3"):
            SyncBatchNorm(3, channel_last=True).train(training)(torch.randn(4, 5, 2))
        # An NCHW input to a channel_last=True layer: the message names the flag (r103A R3).
        with pytest.raises(ValueError, match=r"has 5 channels in its last dimension; expected 3\. "
                                             r"It was built with channel_last=True, .* build it "
                                             r"with channel_last=False"):
            SyncBatchNorm(3, channel_last=True).train(training)(torch.randn(2, 3, 4, 5))


class _SelfHooked(SyncBatchNorm):
    """A layer that registers one of its own methods as a forward hook."""

    def __init__(self, num_features):
        super().__init__(num_features)
        self.calls = 0
        self.register_forward_hook(self._count)

    def _count(self, module, args, output):
        self.calls += 1


def test_syncbn_deepcopy_keeps_references_to_itself():
    # A layer whose state refers back to the layer (a bound method of its own as a hook, as
    # subclasses register): deep-copied (an EMA model, a frozen teacher), the copy's
    # references are to the copy, and the copy runs. Reference: the original's behaviour.
    # (B15)
    layer = _SelfHooked(3)
    twin = copy.deepcopy(layer)
    x = torch.randn(4, 3)
    twin(x)
    assert twin.calls == 1 and layer.calls == 0
    torch.testing.assert_close(twin(x), layer(x), rtol=0, atol=0)


def test_convert_syncbn_model_keeps_a_syncbn_subclass():
    """A model's own SyncBatchNorm subclass (a layer with extra state or hooks) is an existing
    SyncBatchNorm: convert_syncbn_model keeps the same object, with its hooks and attributes,
    and gives it the group and flag, as it does for SyncBatchNorm itself. (C06)"""
    group = object()  # (stands in for a ProcessGroup: nothing communicates here)
    layer = _SelfHooked(3)
    model = convert_syncbn_model(nn.Sequential(layer), process_group=group)
    assert model[0] is layer
    assert layer.process_group is group
    model(torch.randn(4, 3))
    assert layer.calls == 1


def test_syncbn_factory_arguments_place_parameters_and_buffers_as_batchnorm():
    """``SyncBatchNorm(..., device=, dtype=)`` makes its parameters and buffers where and as
    ``nn.BatchNorm1d`` with the same arguments does: models built on the meta device (deferred
    initialization of large models) or directly in float64 rely on it. Reference: BatchNorm's
    own state dict, entry by entry (device and dtype). (S04 S05)"""
    for kwargs in (dict(device="meta"), dict(dtype=torch.float64),
                   dict(device="meta", dtype=torch.float16)):
        got = SyncBatchNorm(3, **kwargs).state_dict()
        want = nn.BatchNorm1d(3, **kwargs).state_dict()
        assert list(got) == list(want)
        for key in want:
            assert (got[key].device, got[key].dtype) == (want[key].device, want[key].dtype), (
                kwargs, key, got[key].device, got[key].dtype)


# ------------------------------------------------------------------------------------------------
# the autograd function itself, one process (fn.LOCAL: no collectives)
# ------------------------------------------------------------------------------------------------
_LOCAL_PATHS = dict(_CPU_PATHS)


def _local_case(x, dy, weight, bias, running_mean, running_var, eps, momentum, *,
                channel_last=False, cache=None, path_ctx=contextlib.nullcontext):
    """``fn.sync_batch_norm`` on one process: (output, input gradient)."""
    xr = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    with path_ctx():
        y = fn.sync_batch_norm(xr, weight, bias, running_mean, running_var, eps, momentum,
                               fn.LOCAL, 1, channel_last=channel_last, cache=cache)
        y.backward(dy)
    return y.detach(), xr.grad


@pytest.mark.parametrize("path", sorted(_LOCAL_PATHS))
def test_sync_batch_norm_keeps_the_layout_of_a_3d_input_with_channels_innermost(
        not_distributed, path):
    """A 3-D ``(N, C, L)`` input whose memory is ``(N, L, C)`` (a transposed sequence batch)
    gives an output with the input's strides, as documented ("same shape, dtype and layout")
    and as for 4-D/5-D channels-last inputs: code after the layer relies on the layout (a
    following ``.view``, kernels picked by layout). Values: float64 BatchNorm, 1e-5. (M03)"""
    torch.manual_seed(0)
    x = torch.randn(5, 7, 3).transpose(1, 2)  # (N, C, L), channels innermost in memory
    dy = torch.randn(5, 7, 3).transpose(1, 2)
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    y, dx = _local_case(x, dy, w, b, None, None, 1e-5, 0.1, path_ctx=_LOCAL_PATHS[path])
    assert y.stride() == x.stride(), f"[{path}] output strides {y.stride()}, input {x.stride()}"
    ry, rdx = _reference(x, w, b, dy, None, None, 0.1, 1e-5, 1)[:2]
    _close(y, ry, OUT_TOL[torch.float32], f"[{path}] output")
    _close(dx, rdx, OUT_TOL[torch.float32], f"[{path}] input grad")


@pytest.mark.skipif(not _INTERPRETER, reason="needs Triton's interpreter (tests/_triton.py)")
def test_contiguous_channel_last_input_takes_the_triton_kernels(not_distributed, monkeypatch):
    """A contiguous ``(N, H, W, C)`` input with ``channel_last=True`` (Apex's flag) is dense
    channels-last memory and takes mixprec's four Triton passes, as the module docstring
    states (the fast path users of Apex's flag expect), and they compute BatchNorm: float64
    reference, 1e-5. (M04)"""
    from mixprec.parallel import _syncbn_triton

    calls = []
    names = ("stats", "normalize", "grad_sums", "grad_input")

    def counting(name, method):
        def counted(*args, **kwargs):
            calls.append(name)
            return method(*args, **kwargs)
        return counted

    for name in names:
        monkeypatch.setattr(_syncbn_triton.Plan, name,
                            counting(name, getattr(_syncbn_triton.Plan, name)))
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 6)  # (N, H, W, C), contiguous
    dy = torch.randn(4, 3, 5, 6)
    w, b = torch.rand(6) + 0.5, torch.randn(6)
    rm, rv = torch.zeros(6), torch.ones(6)
    y, dx = _local_case(x, dy, w, b, rm, rv, 1e-5, 0.1, channel_last=True,
                        path_ctx=_TRITON_CPU_PATH)
    assert sorted(calls) == sorted(names), calls
    ry, rdx, _, _, rrm, rrv = _reference(x, w, b, dy, torch.zeros(6), torch.ones(6), 0.1, 1e-5,
                                         3)
    _close(y, ry, OUT_TOL[torch.float32], "output")
    _close(dx, rdx, OUT_TOL[torch.float32], "input grad")
    _close(rm, rrm, STAT_TOL, "running_mean")
    _close(rv, rrv, STAT_TOL, "running_var")


@pytest.mark.parametrize("first", [torch.channels_last, torch.contiguous_format])
def test_a_layer_cache_tells_layouts_of_one_shape_apart(not_distributed, first):
    """A layer's cache (``SyncBatchNorm._count_cache``) keeps one layout per input geometry:
    inputs of one shape in two memory formats (a model switched to channels_last between
    steps, a data loader handing either) each get their own, so each output has its input's
    layout and BatchNorm's values (float64 reference, 1e-5). Fused path, where the layout
    decides the kernels' views. (M06)"""
    torch.manual_seed(0)
    w, b = torch.rand(4) + 0.5, torch.randn(4)
    cache = {}
    formats = [first, ({torch.channels_last, torch.contiguous_format} - {first}).pop()]
    for fmt in formats:
        x = torch.randn(3, 4, 2, 5).contiguous(memory_format=fmt)
        dy = torch.randn(3, 4, 2, 5)
        y, dx = _local_case(x, dy, w, b, None, None, 1e-5, 0.1, cache=cache,
                            path_ctx=emulated_fused_path)
        assert y.is_contiguous(memory_format=fmt), f"{fmt}: output strides {y.stride()}"
        ry, rdx = _reference(x, w, b, dy, None, None, 0.1, 1e-5, 1)[:2]
        _close(y, ry, OUT_TOL[torch.float32], f"{fmt} output")
        _close(dx, rdx, OUT_TOL[torch.float32], f"{fmt} input grad")


@pytest.mark.parametrize("triton", [False, True], ids=["nchw", "channels-last-triton"])
def test_fused_path_updates_a_strided_running_variance(not_distributed, triton):
    """Running statistics that are strided views (a buffer sliced out of a larger one, a
    checkpoint loaded into a view) are updated in place on the fused path, where the kernels
    get contiguous copies (mixprec's Triton kernels too, for a channels-last input: they write
    per-channel vectors with unit stride): both the mean and the variance are written back,
    and nothing else in the base buffer changes. A strided weight and bias (parameters sliced
    from one tensor) reach the kernels contiguous too (the emulation refuses strided ones:
    r98E's M75, M76). Reference: float64 BatchNorm, running statistics 1e-4, output and input
    gradient 1e-5. (M10, F27)"""
    if triton and not _INTERPRETER:
        pytest.skip("needs Triton's interpreter (tests/_triton.py)")
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4, 4) * 2 + 1
    dy = torch.randn_like(x)
    if triton:
        x, dy = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))
    w, b = (torch.rand(6) + 0.5)[::2], torch.randn(6)[::2]
    rm = torch.zeros(6)[1::2]
    base = torch.ones(6)
    rv = base[::2]
    y, dx = _local_case(x, dy, w, b, rm, rv, 1e-5, 0.1,
                        path_ctx=_TRITON_CPU_PATH if triton else emulated_fused_path)
    ry, rdx, _, _, rrm, rrv = _reference(x, w, b, dy, torch.zeros(3), torch.ones(3), 0.1, 1e-5,
                                         1)
    _close(y, ry, OUT_TOL[torch.float32], "output")
    _close(dx, rdx, OUT_TOL[torch.float32], "input grad")
    _close(rm, rrm, STAT_TOL, "running_mean")
    _close(rv, rrv, STAT_TOL, "running_var")
    assert torch.equal(base[1::2], torch.ones(3)), base


@pytest.mark.parametrize("path", [
    *sorted(_LOCAL_PATHS),
    pytest.param("cpu-emulated-fused-triton", marks=pytest.mark.skipif(
        not _INTERPRETER, reason="needs Triton's interpreter (tests/_triton.py)")),
])
def test_an_input_saved_as_bf16_gives_the_input_gradient_in_fp32_precision(not_distributed,
                                                                           path):
    """A saved-tensor hook that compresses activations (the fp32 input kept as a bf16 copy)
    hands the backward an input of another dtype than the forward's and the output
    gradient's: the input gradient is computed from the copy and the fp32 output gradient
    and keeps fp32 precision (users compress activations to save memory, not to round the
    gradients to bf16), on the plain-PyTorch path and the fused one (an NCHW input; r69A's
    F07) and on the Triton kernels' (channels-last): their plan is for the forward's dtype,
    so the backward reads the copy by PyTorch's arithmetic (on the kernels the gradient
    would be rounded to the copy's dtype, and on a GPU the plan's compiled kernels would read
    bf16 memory as fp32; r65C's T06). Reference: the input-gradient formula in float64 with
    the bf16-rounded saved input and the fp32 input's batch statistics (what the backward is
    given), 1e-5 of the gradient's scale; the gradient is fp32."""
    torch.manual_seed(0)
    triton = path == "cpu-emulated-fused-triton"
    fmt = torch.channels_last if triton else torch.contiguous_format
    x = (torch.randn(6, 3, 4, 4) * 2 + 1).contiguous(memory_format=fmt)
    dy = torch.randn(6, 3, 4, 4).contiguous(memory_format=fmt)
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    xr = x.clone().requires_grad_()

    def compress(t):
        return t.to(torch.bfloat16) if t.dim() == 4 else t

    with (_TRITON_CPU_PATH if triton else _LOCAL_PATHS[path])():
        with torch.autograd.graph.saved_tensors_hooks(compress, lambda t: t):
            y = fn.sync_batch_norm(xr, w, b, None, None, 1e-5, 0.1, fn.LOCAL, 1)
        y.backward(dy)
    dims, n = (0, 2, 3), x.numel() // 3
    xd, dyd = x.double(), dy.double()
    mean = xd.mean(dims, keepdim=True)
    invstd = (xd.var(dims, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    xmu = x.to(torch.bfloat16).double() - mean  # the copy the hook handed back
    ref = (dyd - dyd.sum(dims, keepdim=True) / n
           - xmu * invstd ** 2 * (dyd * xmu).sum(dims, keepdim=True) / n) * invstd
    ref = ref * w.double().view(1, 3, 1, 1)
    assert xr.grad.dtype == torch.float32, f"[{path}] {xr.grad.dtype}"
    scale = float(ref.abs().max())
    _close(xr.grad, ref, dict(rtol=0, atol=1e-5 * scale),
           f"[{path}] input grad from the bf16 copy")


@pytest.mark.parametrize("layout", ["NCHW", "channels-last"])
def test_a_weight_saved_as_bf16_leaves_the_parameter_gradients_fp32(not_distributed, layout):
    """A saved-tensor hook that compresses what autograd keeps may hand the backward the fp32
    weight as a bf16 copy. The weight and bias gradients (``sum(dy * xhat)``, ``sum(dy)``) do
    not read the weight: they are computed in fp32 on every path and come back in the
    parameters' own dtype, not rounded to the copy's (they were, by up to 0.3%: the fallback
    cast them to the dtype of what the hook handed back). The input gradient reads the copy,
    by its own dtype (on a GPU the kernels, compiled for an fp32 weight, must not read bf16
    memory). Reference: float64 BatchNorm of the same input (with the bf16-rounded weight
    for the input gradient), 1e-5 of each gradient's scale; on CUDA too."""
    torch.manual_seed(0)
    fmt = torch.channels_last if layout == "channels-last" else torch.contiguous_format
    x = (torch.randn(6, 3, 4, 4) * 2 + 1).contiguous(memory_format=fmt)
    dy = (torch.randn(6, 3, 4, 4) * 3).contiguous(memory_format=fmt)
    w0, b0 = torch.rand(3) + 0.5, torch.randn(3)
    ref = _reference(x, w0, b0, dy, None, None, 0.1, 1e-5, 1)
    ref_dx = _reference(x, w0.bfloat16().float(), b0, dy, None, None, 0.1, 1e-5, 1)[1]
    paths = _cpu_paths() + ([("cuda", contextlib.nullcontext)] if torch.cuda.is_available()
                            else [])
    for name, path_ctx in paths:
        device = "cuda" if name == "cuda" else "cpu"
        w = w0.to(device, copy=True).requires_grad_()
        b = b0.to(device, copy=True).requires_grad_()

        def compress(t, w=w):
            return t.to(torch.bfloat16) if t.data_ptr() == w.data_ptr() else t

        xr = x.to(device, copy=True).requires_grad_()
        with path_ctx():
            with torch.autograd.graph.saved_tensors_hooks(compress, lambda t: t):
                y = fn.sync_batch_norm(xr, w, b, None, None, 1e-5, 0.1, fn.LOCAL, 1)
            y.backward(dy.to(device))
        for what, got, want in (("weight grad", w.grad, ref[2]), ("bias grad", b.grad, ref[3]),
                                ("input grad", xr.grad, ref_dx)):
            assert got.dtype == torch.float32, (name, what, got.dtype)
            scale = float(want.abs().max())
            _close(got, want, dict(rtol=0, atol=1e-5 * scale), f"{name} {layout} {what}")


def test_channel_last_flag_with_a_strided_input_is_batchnorm(not_distributed):
    """Apex's ``channel_last=True`` with an ``(N, H, W, C)`` input that is a strided view (every
    other row of a larger batch, a crop) is not dense ``(M, C)`` memory: every path must read it
    as it is laid out (the Triton kernels take only dense memory; the fused path needs a copy).
    Output, input gradient and running statistics against float64 BatchNorm, 1e-5 / 1e-4.
    (F05)"""
    torch.manual_seed(0)
    base = torch.randn(4, 6, 5, 3)
    dy = torch.randn(4, 3, 5, 3)
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    for path, path_ctx in _cpu_paths():
        rm, rv = torch.zeros(3), torch.ones(3)
        leaf = base.clone().requires_grad_()
        x = leaf[:, ::2]  # (N, H, W, C), channels innermost, rows not evenly spaced
        with path_ctx():
            y = fn.sync_batch_norm(x, w, b, rm, rv, 1e-5, 0.1, fn.LOCAL, 1, channel_last=True)
            y.backward(dy)
        ry, rdx, _, _, rrm, rrv = _reference(x.detach(), w, b, dy, torch.zeros(3),
                                             torch.ones(3), 0.1, 1e-5, 3)
        _close(y.detach(), ry, OUT_TOL[torch.float32], f"[{path}] output")
        _close(leaf.grad[:, ::2], rdx, OUT_TOL[torch.float32], f"[{path}] input grad")
        assert torch.equal(leaf.grad[:, 1::2], torch.zeros(4, 3, 5, 3)), path
        _close(rm, rrm, STAT_TOL, f"[{path}] running_mean")
        _close(rv, rrv, STAT_TOL, f"[{path}] running_var")


_REQUIRES_GRAD = {
    "frozen weight": (True, False, True),
    "frozen bias": (True, True, False),
    "input without grad": (False, True, True),
    "only the bias": (False, False, True),
}


@pytest.mark.parametrize("saved", ["as saved", "NCHW copy"])
@pytest.mark.parametrize("trained", list(_REQUIRES_GRAD))
def test_sync_batch_norm_gives_batchnorms_gradients_whatever_requires_grad(not_distributed,
                                                                           trained, saved):
    """Fine-tuning freezes one affine parameter and trains the other, and a layer right on the
    data (or after a frozen backbone) gets an input without requires_grad: every tensor that
    requires grad gets float64 BatchNorm's gradient, the input's included (a frozen weight
    still scales it), and the others none, on every path, also when a saved-tensor hook hands
    the input back as an NCHW copy (the Triton path then computes with PyTorch). Channels-last
    fp32 input, 1e-5 (input) / 1e-4 (parameters). (F09, r66A's S03 S04 S06)"""
    torch.manual_seed(0)
    x = (torch.randn(5, 3, 4, 2) * 0.7 + 1).contiguous(memory_format=torch.channels_last)
    dy = torch.randn(5, 3, 4, 2).contiguous(memory_format=torch.channels_last)
    w0, b0 = torch.rand(3) + 0.5, torch.randn(3)
    x_grad, w_grad, b_grad = _REQUIRES_GRAD[trained]
    xd = x.double().requires_grad_(x_grad)
    wd, bd = w0.double().requires_grad_(w_grad), b0.double().requires_grad_(b_grad)
    F.batch_norm(xd, None, None, wd, bd, training=True, eps=1e-5).backward(dy.double())

    def unpack(t):
        return t.contiguous() if saved == "NCHW copy" and t.dim() == 4 else t

    for path, path_ctx in _cpu_paths():
        xr = x.clone(memory_format=torch.preserve_format).requires_grad_(x_grad)
        w, b = w0.clone().requires_grad_(w_grad), b0.clone().requires_grad_(b_grad)
        with path_ctx():
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
                y = fn.sync_batch_norm(xr, w, b, None, None, 1e-5, 0.1, fn.LOCAL, 1)
            y.backward(dy)
        for name, got, want, tol in (("input", xr, xd, OUT_TOL[torch.float32]),
                                     ("weight", w, wd, dict(rtol=1e-4, atol=1e-4)),
                                     ("bias", b, bd, dict(rtol=1e-4, atol=1e-4))):
            what = f"[{path} {trained} {saved}] {name}"
            if want.requires_grad:
                assert got.grad is not None, f"{what}: no gradient"
                _close(got.grad, want.grad, tol, f"{what} grad")
            else:
                assert got.grad is None, f"{what}: got a gradient"


def test_sync_batch_norm_reads_a_strided_nchw_input_as_it_is_laid_out(not_distributed):
    """An ``(N, C, H, W)`` input that is a strided view (every other row of a larger feature
    map, a crop), neither contiguous nor channels-last, is read as it is laid out on every
    path: the fused kernels' ``(M, C)`` view and the Triton kernels are for channels-innermost
    memory only. Output, input gradient (zero where the view does not reach) and running
    statistics against float64 BatchNorm, 1e-5 / 1e-4. (F11)"""
    torch.manual_seed(0)
    base = torch.randn(4, 3, 6, 5) * 2 + 1
    dy = torch.randn(4, 3, 3, 5)
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    for path, path_ctx in _cpu_paths():
        rm, rv = torch.zeros(3), torch.ones(3)
        leaf = base.clone().requires_grad_()
        x = leaf[:, :, ::2]
        with path_ctx():
            y = fn.sync_batch_norm(x, w, b, rm, rv, 1e-5, 0.1, fn.LOCAL, 1)
            y.backward(dy)
        ry, rdx, _, _, rrm, rrv = _reference(x.detach(), w, b, dy, torch.zeros(3),
                                             torch.ones(3), 0.1, 1e-5, 1)
        _close(y.detach(), ry, OUT_TOL[torch.float32], f"[{path}] output")
        _close(leaf.grad[:, :, ::2], rdx, OUT_TOL[torch.float32], f"[{path}] input grad")
        assert torch.equal(leaf.grad[:, :, 1::2], torch.zeros(4, 3, 3, 5)), path
        _close(rm, rrm, STAT_TOL, f"[{path}] running_mean")
        _close(rv, rrv, STAT_TOL, f"[{path}] running_var")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sync_batch_norm_sums_half_gradients_in_fp32(not_distributed, dtype):
    """Half input (O1/O2): the backward's per-channel sums (the bias gradient ``sum(dy)``, the
    weight gradient ``sum(dy * (x - mean)) * invstd``) are accumulated and returned in fp32,
    as the module docstring states for every path, not rounded to the half dtype: the fp32
    masters of an O2 model take these gradients as they are, and a bf16-rounded ``sum(dy)``
    over a large batch is off by up to 2**-9 of itself. dy is offset from zero so that the
    sums are large. NCHW and channels-last input (the Triton kernels take only the latter).
    Reference: float64 BatchNorm on the same rounded values, relative 1e-5 (fp32
    accumulation of 512 values). (F21, r66A's A05 A06)"""
    torch.manual_seed(0)
    x = (torch.randn(8, 3, 8, 8) * 1.5 + 0.7).to(dtype)
    dy = (torch.randn(8, 3, 8, 8) + 3).to(dtype)
    w0, b0 = torch.rand(3) + 0.5, torch.randn(3)
    _, _, rdw, rdb, _, _ = _reference(x, w0, b0, dy, None, None, 0.1, 1e-5, 1)
    for layout in (torch.contiguous_format, torch.channels_last):
        xl, dyl = (t.contiguous(memory_format=layout) for t in (x, dy))
        for path, path_ctx in _cpu_paths():
            what = f"[{path} {layout}] {dtype}"
            w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
            _local_case(xl, dyl, w, b, None, None, 1e-5, 0.1, path_ctx=path_ctx)
            assert w.grad.dtype == b.grad.dtype == torch.float32, what
            _close(b.grad, rdb, dict(rtol=1e-5, atol=1e-4), f"{what} bias grad")
            _close(w.grad, rdw, dict(rtol=1e-5, atol=1e-4), f"{what} weight grad")


def test_a_layer_cache_fed_ever_changing_shapes_stays_bounded(not_distributed):
    """A layer fed a new shape every step (variable-length sequences, multi-scale training)
    keeps a bounded per-layer scratch (``SyncBatchNorm._count_cache``: layouts, plans, count
    tensors), not one entry per shape ever seen, and every step still computes BatchNorm
    (float64 reference, 1e-5). The bound is the 16 entries the cache starts over at. (F02)"""
    torch.manual_seed(0)
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    cache = {}
    for length in range(2, 42):
        x = torch.randn(2, 3, length)
        dy = torch.randn(2, 3, length)
        y, dx = _local_case(x, dy, w, b, None, None, 1e-5, 0.1, cache=cache,
                            path_ctx=emulated_fused_path)
        assert len(cache) <= 16, (length, len(cache))
    ry, rdx = _reference(x, w, b, dy, None, None, 0.1, 1e-5, 1)[:2]
    _close(y, ry, OUT_TOL[torch.float32], "output")
    _close(dx, rdx, OUT_TOL[torch.float32], "input grad")


@pytest.mark.parametrize("path", ["cpu-reference", "cpu-emulated-fused",
                                  "cpu-emulated-fused-triton"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_sync_batch_norm_uses_the_eps_it_is_given(not_distributed, path, memory_format):
    """``eps`` is a user setting (BatchNorm(eps=1e-3) in many vision models, larger in some):
    every path adds the eps it is given to the variance, in the normalization and in no other
    place (the running variance is the unbiased batch variance whatever eps is). eps 0.5
    makes any other eps show. Output, input gradient and running statistics against float64
    BatchNorm with that eps, 1e-5 / 1e-4. (F18, F19, F20)"""
    if path.endswith("triton") and not _INTERPRETER:
        pytest.skip("needs Triton's interpreter (tests/_triton.py)")
    paths = dict(_cpu_paths())
    torch.manual_seed(0)
    eps = 0.5
    x = torch.randn(5, 3, 4, 2).contiguous(memory_format=memory_format) * 0.7 + 1
    dy = torch.randn(5, 3, 4, 2).contiguous(memory_format=memory_format)
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    rm, rv = torch.zeros(3), torch.ones(3)
    y, dx = _local_case(x, dy, w, b, rm, rv, eps, 0.1, path_ctx=paths[path])
    ry, rdx, _, _, rrm, rrv = _reference(x, w, b, dy, torch.zeros(3), torch.ones(3), 0.1, eps,
                                         1)
    _close(y, ry, OUT_TOL[torch.float32], f"[{path}] output")
    _close(dx, rdx, OUT_TOL[torch.float32], f"[{path}] input grad")
    _close(rm, rrm, STAT_TOL, f"[{path}] running_mean")
    _close(rv, rrv, STAT_TOL, f"[{path}] running_var")


@pytest.mark.parametrize("path", sorted(_LOCAL_PATHS))
def test_sync_batch_norm_with_a_weight_and_no_bias_is_batchnorm_without_bias(not_distributed,
                                                                             path):
    """``SyncBatchNorm(bias=False)`` (a learnable weight, no bias, as
    ``nn.BatchNorm2d(bias=False)``) hands the multi-rank function a weight and ``bias=None``:
    the weight must still scale the output and the input gradient, the weight get its
    gradient, and no bias be added, on the plain-PyTorch path and on the fused one (one
    process's layer is F.batch_norm, so only the function itself reaches these paths here).
    Reference: float64 BatchNorm with the same weight and no bias; output and input gradient
    1e-5, weight gradient 1e-4, running statistics 1e-4. (F23 F24b F25)"""
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, 2) * 0.7 + 1
    dy = torch.randn(5, 3, 4, 2)
    w0 = torch.tensor([0.5, 1.75, 3.0])  # (far from 1: a weight left out shows)
    w = w0.clone().requires_grad_()
    rm, rv = torch.zeros(3), torch.ones(3)
    y, dx = _local_case(x, dy, w, None, rm, rv, 1e-5, 0.1, path_ctx=_LOCAL_PATHS[path])
    ry, rdx, rdw, _, rrm, rrv = _reference(x, w0, None, dy, torch.zeros(3), torch.ones(3), 0.1,
                                           1e-5, 1)
    _close(y, ry, OUT_TOL[torch.float32], f"[{path}] output")
    _close(dx, rdx, OUT_TOL[torch.float32], f"[{path}] input grad")
    _close(w.grad, rdw, dict(rtol=1e-4, atol=1e-4), f"[{path}] weight grad")
    _close(rm, rrm, STAT_TOL, f"[{path}] running_mean")
    _close(rv, rrv, STAT_TOL, f"[{path}] running_var")
