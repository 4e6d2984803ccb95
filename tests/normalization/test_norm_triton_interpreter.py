"""The Triton kernels on CPU tensors, through Triton's interpreter (TRITON_INTERPRET=1).

Small sizes only: the interpreter runs each program in NumPy. On a CUDA machine these skip and
``test_norm_numerics.py`` runs the same kernels compiled.
"""

import pytest
import torch

from mixprec.normalization import (
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
    _launch,
    _ops,
    fused_layer_norm,
    fused_rms_norm,
    reference,
)

from .helpers import (
    CASE_IDS,
    CASES,
    HALF_AND_FLOAT,
    float64_reference,
    make_input,
    make_params,
    requires_interpreter,
    run_and_compare,
    tolerance,
)

pytestmark = requires_interpreter

# (2, 37, 45): 74 rows of 45 -> 16-row tiles, 5 row blocks over 3 backward programs, the last
# program's second block entirely past the end: exercises the tile masks and the partial sums.
SMALL = [CASES[0], CASES[1], ((2, 37, 45), (45,))]
SMALL_IDS = [CASE_IDS[0], CASE_IDS[1], "2x37x45"]


def _triton(fn):
    def run(x):
        with _ops.triton_on_cpu():
            return fn(x)

    return run


def _functional(kind, normalized_shape, weight, bias, memory_efficient):
    if kind == "layer":
        return lambda x: fused_layer_norm(
            x, normalized_shape, weight, bias, memory_efficient=memory_efficient
        )
    return lambda x: fused_rms_norm(x, normalized_shape, weight, memory_efficient=memory_efficient)


def _check(kind, shape, normalized_shape, dtype, affine, memory_efficient, layout="contiguous"):
    x = make_input(shape, dtype, "cpu", layout=layout)
    w, b = make_params(normalized_shape, dtype, "cpu", affine, with_bias=kind == "layer")
    fn = _functional(kind, normalized_shape, w, b, memory_efficient)
    # Backward must run inside triton_on_cpu() too: wrap forward and backward together.
    with _ops.triton_on_cpu():
        run_and_compare(kind, fn, x, normalized_shape, w, b, memory_efficient, dtype)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save_x", "save_y"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=str)
@pytest.mark.parametrize("shape,normalized_shape", SMALL, ids=SMALL_IDS)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_kernels_match_float64(kind, shape, normalized_shape, dtype, affine, memory_efficient):
    _check(kind, shape, normalized_shape, dtype, affine, memory_efficient)


@pytest.mark.parametrize(
    "kind,case_id,dtype,memory_efficient",
    [
        ("layer", "5x123x123", torch.bfloat16, False),
        ("rms", "5x123x123-2d", torch.float16, True),
        ("layer", "7x65536", torch.bfloat16, True),
        ("rms", "7x65536", torch.float32, False),
    ],
    ids=["layer-5x123x123-bf16", "rms-5x123x123-2d-fp16-save_y", "layer-7x65536-bf16-save_y",
         "rms-7x65536-fp32"],
)
def test_kernels_on_larger_cases(kind, case_id, dtype, memory_efficient, monkeypatch):
    shape, normalized_shape = CASES[CASE_IDS.index(case_id)]
    if case_id == "7x65536":
        # The interpreter runs each program of a grid in turn, ~6 ms apiece on the 2-core CI
        # machine: the default finish of the weight/bias gradients, 16 columns a program,
        # launches 4,096 per gradient here (over a minute for the two cases). Its logic runs
        # with the default tiling at the other sizes; here 1,024 columns a program (64).
        # The CUDA tests run this size with the default.
        monkeypatch.setattr(_launch, "default_finalize_config",
                            lambda num_partials, n: (8, 1024, 4))
        _launch.norm_plan.cache_clear()  # (a plan keeps its finish: none made before)
    try:
        _check(kind, shape, normalized_shape, dtype, True, memory_efficient)
    finally:
        _launch.norm_plan.cache_clear()  # (none kept for later tests)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save_x", "save_y"])
@pytest.mark.parametrize("layout", ["row_strided", "transposed"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_kernels_on_non_contiguous_input(kind, layout, memory_efficient):
    """A row-strided slice (the q of a fused qkv projection) or a transposed activation: with
    memory_efficient the backward reads the saved output at the output's own row stride, not
    the input's. Against PyTorch's norms in float64."""
    _check(kind, (2, 37, 45), (45,), torch.float32, True, memory_efficient, layout=layout)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["save_x", "save_y"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_kernels_mixed_dtypes(kind, memory_efficient):
    cls = MixedFusedLayerNorm if kind == "layer" else MixedFusedRMSNorm
    norm = cls(45, memory_efficient=memory_efficient)
    with torch.no_grad():
        w, b = make_params((45,), torch.float32, "cpu", True)
        norm.weight.copy_(w)
        if kind == "layer":
            norm.bias.copy_(b)
    x = make_input((2, 37, 45), torch.bfloat16, "cpu")
    bias = norm.bias if kind == "layer" else None
    with _ops.triton_on_cpu():
        run_and_compare(
            kind, norm, x, (45,), norm.weight, bias, memory_efficient, torch.float32
        )


@pytest.mark.parametrize(
    "block_m,num_warps,num_programs,prefetch",
    [(1, 4, 5, True), (4, 4, 2, False), (4, 8, 3, True), (64, 4, 1, False)],
)
@pytest.mark.parametrize("finalize", [None, (2, 16, 1)], ids=["finalize_default", "finalize_2x16"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_launchers_with_explicit_configs(kind, block_m, num_warps, num_programs, prefetch,
                                         finalize):
    # Any tile height, program count and finish tiling must give the same numbers: the
    # heuristics only pick among correct configurations. (2, 16, 1) walks the partial rows two
    # at a time, past their end, over three column tiles, the last one partly masked.
    is_rms = kind == "rms"
    m, n = 21, 45
    x = make_input((m, n), torch.float32, "cpu")
    dy = make_input((m, n), torch.float32, "cpu", seed=5)
    w, b = make_params((n,), torch.float32, "cpu", True)
    w, b = w.detach(), (None if is_rms else b.detach())
    cfg = _launch.KernelConfig(block_m=block_m, block_n=64, num_warps=num_warps,
                               prefetch=prefetch)

    y, mean, rstd = _launch.forward(x, w, b, 1e-5, is_rms, torch.float32, config=cfg)
    y_ref, mean_ref, rstd_ref = reference.norm_forward(x, w, b, 1e-5, is_rms, torch.float32)
    tol = tolerance(torch.float32)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(rstd, rstd_ref, **tol)
    torch.testing.assert_close(mean, mean_ref, **tol)

    for from_y in (False, True):
        xy = y if from_y else x
        got = _launch.backward(
            dy, xy, w, b, mean, rstd, is_rms, from_y, torch.float32, True, True,
            config=cfg, num_programs=num_programs, finalize=finalize,
        )
        want = reference.norm_backward(
            dy, xy, w, b, mean_ref, rstd_ref, is_rms, from_y, torch.float32, True, True
        )
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("need_dw,need_db", [(False, True), (True, False)])
def test_backward_with_one_parameter_gradient(need_dw, need_db):
    # The finish writes only the requested gradient (set 0 is db when dw is not wanted).
    m, n = 21, 45
    x = make_input((m, n), torch.bfloat16, "cpu")
    dy = make_input((m, n), torch.bfloat16, "cpu", seed=5)
    w, b = (t.detach() for t in make_params((n,), torch.float32, "cpu", True))
    y, mean, rstd = _launch.forward(x, w, b, 1e-5, False, torch.bfloat16)
    dx, dw, db = _launch.backward(dy, x, w, b, mean, rstd, False, False, torch.bfloat16,
                                  need_dw, need_db, num_programs=3)
    ref = reference.norm_backward(dy, x, w, b, mean, rstd, False, False, torch.bfloat16,
                                  True, True)
    torch.testing.assert_close(dx, ref[0], **tolerance(torch.bfloat16))
    assert (dw.numel() > 0) == need_dw and (db.numel() > 0) == need_db
    for got, want, wanted in ((dw, ref[1], need_dw), (db, ref[2], need_db)):
        if wanted:
            assert got.dtype == torch.float32 and got.shape == (n,)
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_interpreter_backward_spreads_rows_over_several_programs():
    """The SMALL case 2x37x45 is there to cover the backward's multi-block loop, its fully
    masked trailing block and the partial-sum finish (74 rows -> 5 row blocks of 16 over 3
    programs of 2 blocks). Those paths only run if the interpreter launches more than one
    program with more than one block each: a program count of 1 on CPU still passes every
    numeric test while covering none of them (mutant: backward_num_programs returns 1 off
    CUDA). Also checks dw/db from that launch against float64."""
    m, n = 74, 45
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, n, generator=gen)
    w = 1 + 0.2 * torch.randn(n, generator=gen)
    b = 0.2 * torch.randn(n, generator=gen)
    dy = torch.randn(m, n, generator=gen)
    with _ops.triton_on_cpu():
        _, mean, rstd = _launch.forward(x, w, b, 1e-5, False, torch.float32)
        dx, dw, db = _launch.backward(dy, x, w, b, mean, rstd, False, False, torch.float32,
                                      True, True)
    plan = _launch.norm_plan(x.device, m, n, torch.float32, torch.float32, torch.float32,
                             torch.float32, 0.0, False, False, xy_dtype=torch.float32,
                             dy_dtype=torch.float32, backward_config=None, num_programs=None,
                             finalize=None)
    _, grid, blocks_per_program, n_partials, _, _ = plan._backward_setups[(True, True)]
    assert grid[0] > 1 and blocks_per_program > 1 and n_partials == 2
    want = float64_reference("layer", x, (n,), w, b, dy)
    torch.testing.assert_close(dx.double(), want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw.double(), want[2], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(db.double(), want[3], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_backward_op_gives_half_parameters_gradients_in_their_dtype(param_dtype):
    """A model cast to half precision (.half() / .bfloat16(), parameters included) gets its
    weight and bias gradients from the kernels' backward op in the parameters' own dtype: the
    op's fake implementation promises that dtype to torch.compile, whose graph would otherwise
    receive fp32 tensors where it planned half ones. Values against PyTorch's layer norm in
    float64, to the parameter dtype's tolerance scaled for the 21-row sum (C02, C03)."""
    m, n = 21, 45
    x = make_input((m, n), param_dtype, "cpu")
    dy = make_input((m, n), param_dtype, "cpu", seed=5)
    w, b = (t.detach() for t in make_params((n,), param_dtype, "cpu", True))
    with _ops.triton_on_cpu():
        y, mean, rstd = torch.ops.mixprec.fused_norm_fwd(x, w, b, 1e-5, False, False,
                                                         param_dtype)
        dx, dw, db = torch.ops.mixprec.fused_norm_bwd(dy, x, w, b, mean, rstd, False, False,
                                                      param_dtype, True, True)
    assert dx.dtype == dw.dtype == db.dtype == param_dtype
    want = float64_reference("layer", x, (n,), w, b, dy)
    tol = tolerance(param_dtype)
    torch.testing.assert_close(dx.double(), want[1], **tol)
    tol["atol"] *= m ** 0.5
    torch.testing.assert_close(dw.double(), want[2], **tol)
    torch.testing.assert_close(db.double(), want[3], **tol)


def test_layers_of_one_geometry_with_and_without_a_frozen_bias():
    """Layers of one geometry share a launch plan (a transformer's norms all do), and some of
    them may train their bias while others freeze it (partial fine-tuning), in any order: each
    backward must give the gradients asked for, not reuse the launch set up for another
    choice. dweight and dbias against PyTorch's layer norm in float64 (C04)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(21, 45, generator=gen)
    dy = torch.randn(21, 45, generator=gen)
    w = torch.rand(45, generator=gen) + 0.5
    b = torch.randn(45, generator=gen)
    want = float64_reference("layer", x, (45,), w, b, dy)
    tol = tolerance(torch.float32)
    for train_w, train_b in ((True, True), (True, False), (False, True), (True, True)):
        xr = x.clone().requires_grad_(True)
        wr, br = w.clone().requires_grad_(train_w), b.clone().requires_grad_(train_b)
        with _ops.triton_on_cpu():
            y = fused_layer_norm(xr, 45, wr, br)
            gx, *grads = torch.autograd.grad(y, [xr] + [t for t in (wr, br) if t.requires_grad],
                                             dy)
        torch.testing.assert_close(gx.double(), want[1], **tol)
        expected = [want[2]] * train_w + [want[3]] * train_b
        for got, ref in zip(grads, expected):
            torch.testing.assert_close(got.double(), ref, **tol,
                                       msg=f"weight trained {train_w}, bias trained {train_b}")


def test_forcing_triton_without_the_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with _ops.triton_on_cpu():
            fused_layer_norm(torch.randn(2, 8), 8)


@pytest.mark.parametrize("n", [45, 1])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_kernels_with_expanded_gradient(kind, n):
    # y.sum() hands backward a stride-0 gradient (for one column, stride-0 in both dims).
    x = make_input((3, n), torch.float32, "cpu").requires_grad_(True)
    w, b = make_params((n,), torch.float32, "cpu", True, with_bias=kind == "layer")
    with _ops.triton_on_cpu():
        _functional(kind, (n,), w, b, False)(x).sum().backward()
    _, dx_ref, dw_ref, _ = float64_reference(kind, x, (n,), w, b, torch.ones(3, n))
    torch.testing.assert_close(x.grad.double(), dx_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(w.grad.double(), dw_ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n", [17, 65])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_kernels_on_rows_one_past_a_power_of_two(kind, n):
    """Rows of 2**k + 1 elements need the next tile width up: their last column must be
    normalized and get its gradients like the others. Output, dx, dweight and dbias against
    PyTorch's norms in float64 (L01)."""
    _check(kind, (5, n), (n,), torch.float32, True, False)


def test_backward_reads_a_fp32_weight_at_fp32_with_half_gradients():
    """Parameters are read at their own precision (the kernels compute in fp32): with bf16
    activations and gradients but fp32 weights (master weights kept in fp32), the input
    gradient asked for in fp32 matches the PyTorch reference's fp32 arithmetic on the same
    inputs to fp32 accuracy, not to bf16's. Both saved-x and saved-y backwards (K25)."""
    m, n = 21, 45
    x = make_input((m, n), torch.bfloat16, "cpu")
    dy = make_input((m, n), torch.bfloat16, "cpu", seed=5)
    w, b = (t.detach() for t in make_params((n,), torch.float32, "cpu", True))
    y, mean, rstd = _launch.forward(x, w, b, 1e-5, False, torch.bfloat16)
    for from_y, xy in ((False, x), (True, y)):
        got = _launch.backward(dy, xy, w, b, mean, rstd, False, from_y, torch.float32,
                               True, True)
        want = reference.norm_backward(dy, xy, w, b, mean, rstd, False, from_y,
                                       torch.float32, True, True)
        for name, g, r in zip(("dx", "dweight", "dbias"), got, want):
            assert g.dtype == torch.float32, name
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=f"from_y={from_y} {name}")
