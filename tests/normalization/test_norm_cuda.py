"""CUDA-only behaviour: the Triton path is taken, inductor, determinism, large and long rows.

The numerics matrix (every case, dtype, affine, memory_efficient) runs on CUDA from
``test_norm_numerics.py``.
"""

import pytest
import torch

from mixprec.normalization import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedRMSNorm,
    _launch,
    _ops,
    fused_layer_norm,
    fused_rms_norm,
    reference,
)

from .helpers import make_input, make_params, requires_cuda, run_and_compare, tolerance

pytestmark = requires_cuda


def test_cuda_takes_the_triton_path(monkeypatch):
    calls = {"forward": 0, "backward": 0}

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    for name in calls:
        monkeypatch.setattr(_launch.NormPlan, name, count(name, getattr(_launch.NormPlan, name)))
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    FusedLayerNorm(256).cuda()(x).float().sum().backward()
    fused_rms_norm(x, 256).float().sum().backward()
    assert calls == {"forward": 2, "backward": 2}


def test_repeated_calls_launch_without_the_launch_key(monkeypatch):
    # After the first call of an input signature, the module's launches go straight to the
    # compiled kernels (the plan's sites), not through launch() and its specialization key.
    if not _launch._fast_launch_supported():
        pytest.skip(f"direct launches are verified on Triton 3.6 only, not {_launch.triton_version()}")
    monkeypatch.setattr(_ops, "_PATHS", {})  # (a fresh plan: its first launches are keyed)
    _launch.norm_plan.cache_clear()
    keyed = []
    launch = _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda *a: keyed.append(a[0]) or launch(*a))
    norm = FusedLayerNorm(384).cuda()
    x = torch.randn(7, 5, 384, device="cuda", requires_grad=True)
    norm(x).sum().backward()
    assert len(keyed) == 3  # forward, backward, the weight/bias gradient finish
    want = [t.grad.clone() for t in (x, norm.weight, norm.bias)]
    for t in (x, norm.weight, norm.bias):
        t.grad = None
    norm(x).sum().backward()
    assert len(keyed) == 3
    for t, w in zip((x, norm.weight, norm.bias), want):
        torch.testing.assert_close(t.grad, w, atol=0, rtol=0)


@pytest.mark.parametrize(
    "m,n,dtype",
    [(8192, 1024, torch.bfloat16), (1000, 8192, torch.float32), (300, 4096, torch.float16)],
)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_benchmark_sized_rows(kind, m, n, dtype):
    # Many rows per backward program (the persistent grid) and the learnt occupancy: the second
    # call runs with the program count measured on the first.
    x = make_input((m, n), dtype, "cuda")
    w, b = make_params((n,), dtype, "cuda", True, with_bias=kind == "layer")
    for _ in range(2):
        for p in (w, b):
            if p is not None:
                p.grad = None
        if kind == "layer":
            def fn(t):
                return fused_layer_norm(t, n, w, b)
        else:
            def fn(t):
                return fused_rms_norm(t, n, w)
        run_and_compare(kind, fn, x, (n,), w, b, False, dtype)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_backward_is_deterministic(kind):
    x = make_input((4096, 512), torch.bfloat16, "cuda").requires_grad_(True)
    norm = (FusedLayerNorm if kind == "layer" else FusedRMSNorm)(512).cuda()
    dy = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    grads = []
    for _ in range(3):
        x.grad = None
        norm.zero_grad(set_to_none=True)
        norm(x).backward(dy)
        grads.append([x.grad.clone()] + [p.grad.clone() for p in norm.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)


def test_rows_longer_than_the_fused_limit_fall_back_with_a_warning():
    n = _launch.MAX_FUSED_N + 4464
    x = make_input((2, n), torch.float32, "cuda")
    w, b = make_params((n,), torch.float32, "cuda", True)
    with pytest.warns(UserWarning, match="reference path"):
        run_and_compare("layer", lambda t: fused_layer_norm(t, n, w, b), x, (n,), w, b, False,
                        torch.float32)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_inductor_fullgraph_matches_eager(kind):
    torch.manual_seed(0)
    norm_cls = FusedLayerNorm if kind == "layer" else MixedFusedRMSNorm
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), norm_cls(256), torch.nn.GELU(), torch.nn.Linear(256, 64)
    ).cuda()
    x = torch.randn(8, 32, 256, device="cuda", requires_grad=True)
    model(x).square().mean().backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, fullgraph=True)
    compiled(x).square().mean().backward()
    got = [x.grad] + [p.grad for p in model.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="requires 2 GPUs")
def test_second_gpu():
    x = make_input((64, 1000), torch.bfloat16, "cuda:1")
    w, b = make_params((1000,), torch.bfloat16, "cuda:1", True)
    assert torch.cuda.current_device() == 0
    run_and_compare("layer", lambda t: fused_layer_norm(t, 1000, w, b), x, (1000,), w, b, False,
                    torch.bfloat16)


@pytest.mark.parametrize("prefetch,stages", [(False, 0), (True, 0), (False, 2), (False, 3)])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_backward_loop_variants(kind, prefetch, stages):
    # Every loop variant the tuning sweep may pick must give the reference numbers.
    is_rms = kind == "rms"
    m, n = 2000, 1024
    x = make_input((m, n), torch.bfloat16, "cuda")
    dy = make_input((m, n), torch.bfloat16, "cuda", seed=7)
    w, b = make_params((n,), torch.bfloat16, "cuda", True)
    w, b = w.detach(), (None if is_rms else b.detach())
    y, mean, rstd = _launch.forward(x, w, b, 1e-5, is_rms, torch.bfloat16)
    base = _launch.default_backward_config(n, 2, 2)
    cfg = _launch.KernelConfig(base.block_m, base.block_n, base.num_warps, prefetch=prefetch,
                               pipeline_stages=stages)
    for from_y in (False, True):
        xy = y if from_y else x
        got = _launch.backward(dy, xy, w, b, mean, rstd, is_rms, from_y, torch.bfloat16, True,
                               True, config=cfg)
        want = reference.norm_backward(dy, xy, w, b, mean, rstd, is_rms, from_y,
                                       torch.bfloat16, True, True)
        # dx: one bf16 rounding apart; dw, db: fp32 sums over 2000 rows of order 1 (~45).
        torch.testing.assert_close(got[0].float(), want[0].float(), **tolerance(torch.bfloat16))
        for g, r in zip(got[1:], want[1:]):
            torch.testing.assert_close(g.float(), r.float(), atol=0.1, rtol=2e-2)


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_a_strided_parameter_after_a_contiguous_one_of_its_shape(which):
    """The cached path of an input signature is keyed by whether the weight and bias are
    contiguous: a transposed parameter of the same shape (a checkpoint's weight loaded as a
    view) after a contiguous one must not reach the kernels as if it were rows, which would
    scale the wrong positions. Against PyTorch's layer_norm in float64. (r59B's O17)"""
    x = torch.randn(6, 16, 16, device="cuda")
    params = {"weight": torch.rand(16, 16, device="cuda") + 0.5,
              "bias": torch.randn(16, 16, device="cuda")}
    for strided in (False, True):
        if strided:
            params[which] = params[which].t().contiguous().t()  # (same values, transposed)
            assert not params[which].is_contiguous()
        got = fused_layer_norm(x, (16, 16), params["weight"], params["bias"])
        want = torch.nn.functional.layer_norm(x.double(), (16, 16), params["weight"].double(),
                                              params["bias"].double(), 1e-5)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=str(strided))


def _off_boundary(rows, n, dtype):
    """(rows, n) contiguous rows that start off a 16-byte boundary (a view into a buffer)."""
    buf = torch.randn(rows * n + 8, dtype=dtype, device="cuda")
    off = next(k for k in range(1, 8) if (buf.data_ptr() + k * buf.element_size()) % 16)
    return buf[off:off + rows * n].view(rows, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_misaligned_input_after_an_aligned_one_of_the_same_strides(dtype):
    # (r99B M32/M54) The second call has the first's strides (the same cached launch variant)
    # but starts off a 16-byte boundary: it must not reuse the kernel compiled for aligned
    # pointers (a misaligned-address fault or wrong values). Forward and backward against
    # float64.
    n, rows = 1024, 64
    norm = FusedLayerNorm(n).cuda().to(dtype)
    with torch.no_grad():
        w, b = make_params((n,), dtype, "cuda", True)
        norm.weight.copy_(w)
        norm.bias.copy_(b)
    aligned = make_input((rows, n), dtype, "cuda")
    for x in (aligned, _off_boundary(rows, n, dtype)):
        assert (x.data_ptr() % 16 == 0) == (x is aligned)
        norm.zero_grad(set_to_none=True)
        run_and_compare("layer", norm, x, (n,), norm.weight, norm.bias, False, dtype)
