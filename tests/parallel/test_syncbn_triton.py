"""SyncBatchNorm's Triton kernels against float64 references (CPU interpreter and CUDA).

``stats_row`` packs ``[mean, 1/sqrt(var + eps), M]`` for the all-gather, ``backward_reduce``
gives ``[sum(dy), sum(dy * (x - mean))]`` and the local weight/bias gradients. Tolerances: the
kernels compute in fp32 from the same rounded inputs the reference sees, so the errors are fp32
accumulation errors: relative 1e-5 (statistics) and 1e-4 of the sums' magnitude.
``forward_elemt`` (the ranks' statistics merged into the global row, then normalized) and
``backward_elemt`` (the input gradient) are compared with float64 formulas; their outputs are
rounded once to the input's dtype, so the tolerance is that dtype's rounding (plus fp32
arithmetic for fp32).
"""

import importlib.util

import pytest
import torch

from mixprec.parallel import _syncbn_triton
from tests._triton import interpreter_skip_reason

_HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICES = []
if _HAS_TRITON and torch.cuda.is_available():
    DEVICES.append("cuda")
elif interpreter_skip_reason() is None:
    DEVICES.append("cpu")

pytestmark = pytest.mark.skipif(
    not DEVICES,
    reason="requires triton and a GPU, or on CPU: "
    + str(interpreter_skip_reason() or "(unreachable)"),
)

SHAPES = [(1, 1), (7, 3), (300, 64), (1000, 130), (4099, 17)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _cpu_allowed(monkeypatch):
    monkeypatch.setattr(_syncbn_triton, "_cpu_testing", True)


def _input(m, c, dtype, device, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, c, generator=g, dtype=torch.float64) * 2.5 + offset
    return x.to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,c", SHAPES)
def test_stats_row_matches_float64(device, dtype, m, c):
    x = _input(m, c, dtype, device)
    assert _syncbn_triton.usable(x)
    row = _syncbn_triton.stats_row(x, 1e-5).cpu().double()
    xd = x.cpu().double()
    mean = xd.mean(0)
    invstd = (xd.var(0, unbiased=False) + 1e-5).rsqrt()
    assert row.shape == (2 * c + 1,)
    torch.testing.assert_close(row[:c], mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row[c:2 * c], invstd, rtol=1e-5, atol=0)
    assert row[2 * c].item() == m


@pytest.mark.parametrize("device", DEVICES)
def test_stats_row_large_mean_does_not_cancel_the_variance(device):
    # mean 1000 std 0.01 in fp32: E[x^2] - E[x]^2 would lose every digit of the variance.
    g = torch.Generator().manual_seed(3)
    x = (1000 + 0.01 * torch.randn(4099, 5, generator=g, dtype=torch.float64)).float()
    row = _syncbn_triton.stats_row(x.to(device), 1e-12).cpu().double()
    var = x.double().var(0, unbiased=False)
    torch.testing.assert_close(row[5:10], (var + 1e-12).rsqrt(), rtol=1e-3, atol=0)


def _row(mean, invstd, n):
    # A global statistics row [mean (C), invstd (C), N], fp32, on mean's device.
    return torch.cat([mean.float(), invstd.float(),
                      torch.tensor([float(n)], device=mean.device)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,c", SHAPES)
@pytest.mark.parametrize("need_weight,need_bias", [(True, True), (False, False), (True, False)])
def test_backward_reduce_matches_float64(device, dtype, m, c, need_weight, need_bias):
    x = _input(m, c, dtype, device, offset=1.0)
    dy = _input(m, c, dtype, device, seed=1)
    mean = x.double().mean(0).float()
    invstd = (x.double().var(0, unbiased=False) + 1e-5).rsqrt().float()
    row = _row(mean, invstd, m)
    sums, gw, gb = _syncbn_triton.backward_reduce(dy, x, row, need_weight, need_bias)
    dyd, xmu = dy.cpu().double(), x.cpu().double() - mean.cpu().double()
    sum_dy, sum_dy_xmu = dyd.sum(0), (dyd * xmu).sum(0)
    scale = max(1.0, float(dyd.abs().sum(0).max()), float((dyd * xmu).abs().sum(0).max()))
    tol = dict(rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(sums[:c].cpu().double(), sum_dy, **tol)
    torch.testing.assert_close(sums[c:].cpu().double(), sum_dy_xmu, **tol)
    assert (gw is None) != need_weight and (gb is None) != need_bias
    if need_weight:
        torch.testing.assert_close(gw.cpu().double(), sum_dy_xmu * invstd.cpu().double(), **tol)
    if need_bias:
        assert gb.data_ptr() != sums.data_ptr()  # the collective overwrites sums in place
        torch.testing.assert_close(gb, sums[:c], rtol=0, atol=0)


def _rank_rows(parts, eps):
    # What the all-gather hands every rank: each part's [mean, invstd, count], stacked.
    rows = []
    for x in parts:
        xd = x.cpu().double()
        mean, var = xd.mean(0), xd.var(0, unbiased=False)
        rows.append(torch.cat([mean, (var + eps).rsqrt(), torch.tensor([float(len(x))])]))
    return torch.stack(rows).float()


def _out_tol(dtype):
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,c", [(1, 1), (300, 64), (1000, 130), (4099, 17)])
@pytest.mark.parametrize("affine,running", [(True, True), (False, False), (True, False)])
def test_forward_elemt_merges_the_ranks_and_normalizes(device, dtype, m, c, affine, running):
    # This rank holds `x`; two other "ranks" of other sizes and means are merged in from their
    # rows, as after the all-gather. Reference: BatchNorm of the concatenated batch in float64.
    eps, momentum = 1e-5, 0.1
    x = _input(m, c, dtype, device, offset=0.5)
    others = [_input(37, c, dtype, device, offset=-2.0, seed=5), _input(m + 3, c, dtype, device,
                                                                           offset=3.0, seed=6)]
    rows = _rank_rows([others[0], x, others[1]], eps).to(device)
    g = torch.Generator().manual_seed(9)
    weight = (torch.rand(c, generator=g) + 0.5).to(device) if affine else None
    bias = torch.randn(c, generator=g).to(device) if affine else None
    rm = torch.randn(c, generator=g).to(device) if running else None
    rv = (torch.rand(c, generator=g) + 0.5).to(device) if running else None
    rm0, rv0 = (rm.clone(), rv.clone()) if running else (None, None)
    out, row = _syncbn_triton.forward_elemt(x, rows, weight, bias, rm, rv, momentum, eps)

    every = torch.cat([o.cpu().double() for o in (others[0], x, others[1])])
    g_mean, g_var = every.mean(0), every.var(0, unbiased=False)
    g_invstd = (g_var + eps).rsqrt()
    assert row.shape == (2 * c + 1,) and row.dtype == torch.float32
    torch.testing.assert_close(row[:c].cpu().double(), g_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row[c:2 * c].cpu().double(), g_invstd, rtol=1e-4, atol=0)
    assert row[2 * c].item() == len(every)
    y = (x.cpu().double() - g_mean) * g_invstd
    if affine:
        y = y * weight.cpu().double() + bias.cpu().double()
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), y, **_out_tol(dtype))
    if running:
        n = len(every)
        torch.testing.assert_close(
            rm.cpu().double(), (1 - momentum) * rm0.cpu().double() + momentum * g_mean,
            rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            rv.cpu().double(),
            (1 - momentum) * rv0.cpu().double() + momentum * g_var * n / (n - 1),
            rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_elemt_weighs_an_empty_rank_as_nothing(device):
    # An empty rank sends mean 0, invstd 1 and a count of 1e-30 (see _sync_batchnorm_function).
    x = _input(300, 8, torch.float32, device, offset=4.0)
    rows = _rank_rows([x], 1e-5)
    empty = torch.cat([torch.zeros(8), torch.ones(8), torch.tensor([1e-30])]).unsqueeze(0)
    both = torch.cat([empty, rows]).to(device)
    out, row = _syncbn_triton.forward_elemt(x, both, None, None, None, None, 0.1, 1e-5)
    ref, ref_row = _syncbn_triton.forward_elemt(x, rows.to(device), None, None, None, None,
                                                0.1, 1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(row, ref_row, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_elemt_takes_eps_back_off_the_ranks_variances(device):
    """The ranks send ``1 / sqrt(var_r + eps)``; the merge must take eps back off each rank's
    variance before combining them, or a large eps (BatchNorm's eps is a user setting) would be
    counted twice in the normalization and once in running_var. Reference: BatchNorm of the
    concatenated batch in float64 (rtol 1e-4). (R01)"""
    eps, momentum = 0.5, 1.0
    parts = [_input(40, 4, torch.float32, device, offset=1.0, seed=s) for s in (2, 3)]
    rows = _rank_rows(parts, eps).to(device)
    rm, rv = torch.zeros(4, device=device), torch.ones(4, device=device)
    out, row = _syncbn_triton.forward_elemt(parts[0], rows, None, None, rm, rv, momentum, eps)
    every = torch.cat([p.cpu().double() for p in parts])
    var = every.var(0, unbiased=False)
    torch.testing.assert_close(row[4:8].cpu().double(), (var + eps).rsqrt(), rtol=1e-4, atol=0)
    torch.testing.assert_close(rv.cpu().double(), every.var(0, unbiased=True), rtol=1e-4,
                               atol=0)
    ref = (parts[0].cpu().double() - every.mean(0)) * (var + eps).rsqrt()
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_one_process_forward_matches_batchnorm_with_a_large_eps(device):
    """One process (FusedBatchNorm, a single-rank SyncBatchNorm) normalizes with its own row
    and derives the running variance from that row's invstd: eps must come back off it, so
    running_var is the unbiased batch variance whatever eps is. Reference: float64
    ``F.batch_norm`` (rtol 1e-4). (E01)"""
    eps, momentum = 0.5, 0.3
    x = _input(50, 4, torch.float32, device, offset=2.0)
    g = torch.Generator().manual_seed(7)
    weight, bias = (torch.rand(4, generator=g) + 0.5), torch.randn(4, generator=g)
    rm, rv = torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.5
    ref_rm, ref_rv = rm.double(), rv.double()
    ref = torch.nn.functional.batch_norm(x.cpu().double(), ref_rm, ref_rv, weight.double(), bias.double(),
                       training=True, momentum=momentum, eps=eps)
    rm, rv = rm.to(device), rv.to(device)
    plan = _syncbn_triton.plan_for(50, 4, x.device, torch.float32, torch.float32,
                                   torch.float32, (torch.float32, torch.float32))
    out, row = plan.forward(x, weight.to(device), bias.to(device), rm, rv, momentum, eps)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rm.cpu().double(), ref_rm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rv.cpu().double(), ref_rv, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("merged", [False, True], ids=["one-process", "merged-ranks"])
def test_running_var_of_a_constant_channel_is_not_negative(device, merged):
    """A channel with no spread has variance 0; recovering it from fp32 invstd as
    ``1 / invstd^2 - eps`` rounds to about -1e-12 at eps=1e-5, and running_var must not go
    negative from that (BatchNorm's running_var is 0 here; a negative variance is not a
    variance, and tools that take its square root or log fail). Reference: float64 BatchNorm
    gives exactly 0; the check is 0 <= running_var <= 1e-9. (E02, R03)"""
    x = torch.full((32, 3), 1.5, device=device)
    rm, rv = torch.zeros(3, device=device), torch.zeros(3, device=device)
    eps = 1e-5
    if merged:
        rows = torch.stack([_syncbn_triton.stats_row(x, eps)] * 2)
        out, _ = _syncbn_triton.forward_elemt(x, rows, None, None, rm, rv, 1.0, eps)
    else:
        plan = _syncbn_triton.plan_for(32, 3, x.device, torch.float32, None, None,
                                       (torch.float32, torch.float32))
        out, _ = plan.forward(x, None, None, rm, rv, 1.0, eps)
    assert float(rv.min()) >= 0.0, rv
    assert float(rv.max()) <= 1e-9, rv
    torch.testing.assert_close(rm.cpu(), torch.full((3,), 1.5), rtol=0, atol=0)
    torch.testing.assert_close(out.cpu(), torch.zeros(32, 3), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,c", [(1, 1), (300, 64), (1000, 130), (4099, 17)])
@pytest.mark.parametrize("affine", [True, False])
def test_backward_elemt_matches_float64(device, dtype, m, c, affine):
    x = _input(m, c, dtype, device, offset=1.0)
    dy = _input(m, c, dtype, device, seed=1)
    g = torch.Generator().manual_seed(4)
    mean = torch.randn(c, generator=g).to(device)
    invstd = (torch.rand(c, generator=g) + 0.5).to(device)
    weight = (torch.rand(c, generator=g) + 0.5).to(device) if affine else None
    sums = torch.randn(2 * c, generator=g, dtype=torch.float64).float().to(device) * m
    n = 9.0 + m  # the global count: other ranks held 9 rows
    out = _syncbn_triton.backward_elemt(dy, x, _row(mean, invstd, n), weight, sums)
    md, isd, sd = mean.cpu().double(), invstd.cpu().double(), sums.cpu().double()
    ref = (dy.cpu().double() - sd[:c] / n
           - (x.cpu().double() - md) * isd * isd * sd[c:] / n) * isd
    if affine:
        ref = ref * weight.cpu().double()
    assert out.dtype == dtype
    scale = max(1.0, float(ref.abs().max()))
    tol = _out_tol(dtype)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=tol["rtol"],
                               atol=tol["atol"] * scale)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_elemt_large_mean_does_not_cancel_the_gradient(device):
    # A channel at mean 100, spread 0.01-0.1 (fp32): the input's mean was folded into a
    # per-channel constant (dx = dy*k + x*a + b), so x*a cancelled against mean*a and the
    # gradient kept 7e-5 of its scale as error; with (x - mean) taken first it is fp32's
    # rounding of the result (same statistics and sums as the reference, in float64).
    g = torch.Generator().manual_seed(0)
    m, c = 8, 3
    x = (100 + torch.tensor([0.01, 0.05, 0.1], dtype=torch.float64)
         * torch.randn(m, c, generator=g, dtype=torch.float64)).float()
    dy = torch.randn(m, c, generator=g).float()
    xd, dyd = x.double(), dy.double()
    mean, invstd = xd.mean(0), (xd.var(0, unbiased=False) + 1e-5).rsqrt()
    sums = torch.cat([dyd.sum(0), (dyd * (xd - mean)).sum(0)])
    out = _syncbn_triton.backward_elemt(dy.to(device), x.to(device),
                                        _row(mean.to(device), invstd.to(device), m), None,
                                        sums.float().to(device))
    md, isd = mean.float().double(), invstd.float().double()  # (what the kernel is given)
    sd = sums.float().double()
    ref = (dyd - sd[:c] / m - (xd - md) * isd * isd * sd[c:] / m) * isd
    scale = float((dyd.abs().max(0).values * isd).max())
    assert float((out.cpu().double() - ref).abs().max()) < 1e-6 * scale


@pytest.mark.parametrize("device", DEVICES)
def test_usable_rejects_what_the_kernels_do_not_take(device):
    x = torch.randn(8, 4, device=device)
    assert _syncbn_triton.usable(x)
    assert not _syncbn_triton.usable(x.double())
    assert not _syncbn_triton.usable(x.t())  # channels not contiguous
    assert not _syncbn_triton.usable(torch.randn(8, 6, device=device)[:, :4])  # rows not dense
    assert not _syncbn_triton.usable(torch.randn(2, 3, 4, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        _syncbn_triton.stats_row(x.t(), 1e-5)
    with pytest.raises(ValueError, match=r"fp32 \(9,\) tensor"):
        _syncbn_triton.backward_reduce(x, x, torch.zeros(8, device=device), True, True)
    with pytest.raises(ValueError, match="same shape and dtype"):
        _syncbn_triton.backward_elemt(x.half(), x, torch.zeros(9, device=device), None,
                                      torch.zeros(8, device=device))
    row, sums = torch.zeros(9, device=device), torch.zeros(8, device=device)
    with pytest.raises(ValueError, match=r"sums must be a contiguous fp32 \(8,\)"):
        _syncbn_triton.backward_elemt(x, x, row, None, sums.double())
    strided = torch.ones(8, device=device)[::2]
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        _syncbn_triton.backward_elemt(x, x, row, strided, sums)
    rows = torch.zeros(2, 9, device=device)
    with pytest.raises(ValueError, match="running_var must be a contiguous"):
        _syncbn_triton.forward_elemt(x, rows, None, None, torch.zeros(4, device=device),
                                     strided, 0.1, 1e-5)
    with pytest.raises(ValueError, match="both running statistics or neither"):
        _syncbn_triton.forward_elemt(x, rows, None, None, None, strided, 0.1, 1e-5)
    # float64 parameters, running statistics or rows: refused, not read in another precision
    wide = torch.ones(4, device=device, dtype=torch.float64)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        _syncbn_triton.forward_elemt(x, rows, wide, None, None, None, 0.1, 1e-5)
    with pytest.raises(ValueError, match="running_mean must be a contiguous"):
        _syncbn_triton.forward_elemt(x, rows, None, None, wide, torch.ones(4, device=device),
                                     0.1, 1e-5)
    with pytest.raises(ValueError, match=r"rows must be a contiguous fp32 \(world, 9\)"):
        _syncbn_triton.forward_elemt(x, rows.double(), None, None, None, None, 0.1, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["3-D input", "fp64 row", "long weight",
                                  "short running mean", "weight on another device",
                                  "dy of another shape"])
def test_module_functions_refuse_what_the_kernels_would_misread(device, case):
    """The module-level passes check what they are given (the module docstring: "with
    checks"), because the kernels read raw memory with the sizes and dtypes they assume: a
    3-D input would be read as ``(M, C)`` with the wrong C, a float64 row as fp32 words (on
    the GPU the compiled kernel a plan keeps is specialized on the row's dtype), a
    per-channel tensor of another length past its end or short of the channels, one on
    another device not at all, and a ``dy`` of another shape with ``x``'s row count. Each is
    refused with a ValueError naming what is wrong, before any kernel runs.
    (T16 T17 T18 T19 T20)"""
    x = _input(8, 4, torch.float32, device)
    row = _syncbn_triton.stats_row(x, 1e-5)
    rows = torch.stack([row, row])
    elsewhere = "meta" if device == "cpu" else "cpu"
    if case == "3-D input":
        with pytest.raises(ValueError, match=r"stats_row: expected contiguous \(M, C\)"):
            _syncbn_triton.stats_row(x.view(8, 2, 2), 1e-5)
    elif case == "fp64 row":
        with pytest.raises(ValueError, match=r"row must be a contiguous fp32 \(9,\)"):
            _syncbn_triton.backward_reduce(x, x, row.double(), True, True)
    elif case == "long weight":
        with pytest.raises(ValueError, match=r"weight must be a contiguous \(4,\)"):
            _syncbn_triton.forward_elemt(x, rows, torch.ones(5, device=device), None, None,
                                         None, 0.1, 1e-5)
    elif case == "short running mean":
        with pytest.raises(ValueError, match=r"running_mean must be a contiguous \(4,\)"):
            _syncbn_triton.forward_elemt(x, rows, None, None, torch.zeros(3, device=device),
                                         torch.ones(3, device=device), 0.1, 1e-5)
    elif case == "weight on another device":
        with pytest.raises(ValueError, match=rf"weight must be a contiguous \(4,\) "
                                             rf"fp32/fp16/bf16 tensor on {x.device}"):
            _syncbn_triton.forward_elemt(x, rows, torch.ones(4, device=elsewhere), None,
                                         None, None, 0.1, 1e-5)
    else:
        dy = _input(16, 4, torch.float32, device, seed=1)
        with pytest.raises(ValueError, match="dy and x must have the same shape and dtype"):
            _syncbn_triton.backward_reduce(dy, x, row, True, True)
        with pytest.raises(ValueError, match="dy and x must have the same shape and dtype"):
            _syncbn_triton.backward_elemt(dy, x, row, None, torch.zeros(8, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_scalars_reach_the_kernels_as_floats(device):
    # The compiled kernels a plan keeps are shared by every call of its signature: an int
    # momentum or eps of 1 would be compiled in as a constant (Triton specializes ints equal
    # to 1) and then apply to every later call. The plan hands the kernels floats.
    x = _input(64, 4, torch.float32, device)
    plan = _syncbn_triton.plan_for(64, 4, x.device, torch.float32)
    seen = []

    class Recorder:
        def __init__(self, site):
            self.site = site

        def __call__(self, grid, args, variant):
            seen.append(args)
            return self.site(grid, args, variant)

    stats, finalize = plan._stats_sites
    saved = (plan._stats_sites, dict(plan._normalize_sites))
    plan._stats_sites = (stats, Recorder(finalize))
    for one_row in (False, True):
        plan._normalize_sites[one_row] = Recorder(plan._normalize_sites[one_row])
    try:
        plan.forward(x, None, None, None, None, 1, 1)
        plan.normalize(x, torch.stack([plan.stats(x, 1)] * 2), None, None, None, None, 1, 1)
    finally:
        plan._stats_sites = saved[0]
        plan._normalize_sites.update(saved[1])
    scalars = [args[-1] for args in seen] + [args[-2] for args in seen if len(args) > 6]
    assert len(seen) == 4 and all(type(v) is float for v in scalars), seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("elemt_splits", [1, 5], ids=["fewer", "more"])
def test_element_wise_passes_use_their_own_split_of_the_rows(device, elemt_splits):
    """A plan splits the rows twice: the reductions with ``reduce`` (fewer programs) and the
    element-wise passes with ``elemt`` (more programs, twice as many per SM on a GPU, 8
    against 4 in the interpreter). Where the two splits coincide, a pass launched on one
    split's grid with the other's rows_per_split goes unnoticed; it would leave rows of the
    output or of the input gradient unwritten. Here the element-wise split is set
    explicitly, with fewer splits than the reductions' and with more where the shape allows
    (block sizes depend only on (M, C), so the sites the plan keeps still fit: only the
    number of splits and rows_per_split change), and the forward and backward must still
    match float64 BatchNorm (rtol/atol 1e-4)."""
    m, c = 300, 64
    x = _input(m, c, torch.float32, device, offset=0.5)
    dy = _input(m, c, torch.float32, device, seed=1)
    g = torch.Generator().manual_seed(11)
    weight = (torch.rand(c, generator=g) + 0.5).to(device)
    bias = torch.randn(c, generator=g).to(device)
    plan = _syncbn_triton.Plan(m, c, x.device, torch.float32, torch.float32, torch.float32,
                               None)
    if elemt_splits == plan.reduce[2]:
        # (A GPU's reductions already take the most splits (300 rows, blocks of 64) allow.)
        pytest.skip(f"the reductions already use {elemt_splits} splits on this device")
    elemt = _syncbn_triton._split(m, c, elemt_splits)
    assert elemt[:2] == plan.elemt[:2] and elemt[2] == elemt_splits != plan.reduce[2]
    assert elemt[3] != plan.reduce[3] and elemt[2] * elemt[3] >= m
    plan.elemt, plan._elemt_grid = elemt, (plan._elemt_grid[0], elemt[2])
    out, row = plan.forward(x, weight, bias, None, None, 0.1, 1e-5)
    dx, dw, db = plan.backward(dy, x, row, weight, True, True, True)

    xr = x.cpu().double().requires_grad_(True)
    wr = weight.cpu().double().requires_grad_(True)
    br = bias.cpu().double().requires_grad_(True)
    ref = torch.nn.functional.batch_norm(xr, None, None, wr, br, training=True, eps=1e-5)
    ref.backward(dy.cpu().double())
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.cpu().double(), ref.detach(), **tol)
    torch.testing.assert_close(dx.cpu().double(), xr.grad, **tol)
    torch.testing.assert_close(dw.cpu().double(), wr.grad, **tol)
    torch.testing.assert_close(db.cpu().double(), br.grad, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["as saved", "x with other strides", "x in another dtype",
                                  "row in fp64", "row in bf16", "row strided",
                                  "weight in bf16", "weight strided", "no weight"])
def test_reads_saved_refuses_what_the_kernels_would_misread(device, case):
    """``Plan.reads_saved`` decides whether the backward may hand autograd's saved tensors to
    the kernels. A saved-tensor hook may return the fp32 statistics row or the weight in
    another dtype: the interpreter reads any pointer by its own dtype, so the end-to-end hook
    tests pass on CPU whatever this check says, while on a GPU the compiled kernels (fp32
    row, the plan's weight dtype) would read those bytes as the wrong type. Checked
    directly: True only for the forward's own tensors (and no weight)."""
    m, c = 16, 4
    x = _input(m, c, torch.float32, device)
    weight = torch.ones(c, device=device)
    plan = _syncbn_triton.Plan(m, c, x.device, torch.float32, torch.float32, torch.float32,
                               None)
    row = plan.stats(x, 1e-5)
    strides = x.stride()
    got = dict(x=x, strides=strides, weight=weight, row=row)
    if case == "x with other strides":
        got["x"] = x.t().contiguous().t()
    elif case == "x in another dtype":
        got["x"] = x.to(torch.bfloat16)
    elif case == "row in fp64":
        got["row"] = row.double()
    elif case == "row in bf16":
        got["row"] = row.to(torch.bfloat16)
    elif case == "row strided":
        got["row"] = torch.stack([row, row], 1)[:, 0]
    elif case == "weight in bf16":
        got["weight"] = weight.to(torch.bfloat16)
    elif case == "weight strided":
        got["weight"] = torch.ones(2 * c, device=device)[::2]
    elif case == "no weight":
        got["weight"] = None
    want = case in ("as saved", "no weight")
    assert plan.reads_saved(got["x"], got["strides"], got["weight"], got["row"]) is want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_sums_writes_the_parameter_gradients_in_the_parameters_dtype(device, dtype):
    """``Plan.grad_sums``: ``sums`` fp32 (what the all-reduce sends), ``grad_weight`` and
    ``grad_bias`` in the parameters' dtypes (half parameters of a pure .half() model), with
    the values of fp32 sums rounded once (float64 reference; tolerance: the dtype's
    rounding)."""
    m, c = 40, 6
    x = _input(m, c, torch.float32, device, offset=1.0)
    dy = _input(m, c, torch.float32, device, seed=1)
    plan = _syncbn_triton.Plan(m, c, x.device, torch.float32, dtype, dtype, None)
    row = plan.stats(x, 1e-5)
    sums, gw, gb = plan.grad_sums(dy, x, row, True, True)
    assert sums.dtype == torch.float32 and gw.dtype == dtype and gb.dtype == dtype
    xd, dyd = x.cpu().double(), dy.cpu().double()
    mean, invstd = row[:c].cpu().double(), row[c:2 * c].cpu().double()
    tol = dict(rtol=1.6e-2, atol=1.6e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3,
                                                                               atol=2e-3)
    torch.testing.assert_close(gw.cpu().double(), (dyd * (xd - mean)).sum(0) * invstd, **tol)
    torch.testing.assert_close(gb.cpu().double(), dyd.sum(0), **tol)


# The reductions at ResNet-50 sizes: hundreds of splits per channel block merged in a fixed
# order, so every run gives the same bits (and the right ones).
def _large_shapes(device):
    # On the GPU, ResNet-50-like layers: hundreds of splits per channel block; in the
    # interpreter a small shape (a few splits).
    if device == "cuda":
        return [(64 * 56 * 56, 64), (64 * 28 * 28, 512), (64 * 7 * 7, 2048)]
    return [(1000, 130)]


@pytest.mark.parametrize("device", DEVICES)
def test_reductions_give_the_same_bits_every_run(device):
    for m, c in _large_shapes(device):
        x = _input(m, c, torch.float16, device, offset=0.5)
        dy = _input(m, c, torch.float16, device, seed=1)
        first = _syncbn_triton.stats_row(x, 1e-5)
        first_sums = _syncbn_triton.backward_reduce(dy, x, first, True, True)
        for _ in range(20 if device == "cuda" else 2):
            again = _syncbn_triton.stats_row(x, 1e-5)
            torch.testing.assert_close(again, first, rtol=0, atol=0)
            sums = _syncbn_triton.backward_reduce(dy, x, first, True, True)
            for got, want in zip(sums, first_sums):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        # and they are right (float64 reference, as above)
        xd = x.double().cpu()
        torch.testing.assert_close(first[:c].double().cpu(), xd.mean(0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(first[c:2 * c].double().cpu(),
                                   (xd.var(0, unbiased=False) + 1e-5).rsqrt(), rtol=1e-4,
                                   atol=0)
        assert first[2 * c].item() == m
        dyd = dy.double().cpu()
        xmu = xd - first[:c].double().cpu()
        scale = float((dyd * xmu).abs().sum(0).max())
        torch.testing.assert_close(first_sums[0][c:].double().cpu(), (dyd * xmu).sum(0),
                                   rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.skipif("cuda" not in DEVICES, reason="requires CUDA graphs")
def test_reductions_captured_in_a_cuda_graph_match_eager():
    # The reductions as CUDA-graph nodes: each replay, on new data copied into the captured
    # input, gives the eager result bit for bit.
    m, c = 64 * 28 * 28, 128
    x = _input(m, c, torch.float16, "cuda")
    dy = _input(m, c, torch.float16, "cuda", seed=1)

    def reductions():
        row = _syncbn_triton.stats_row(x, 1e-5)
        sums, gw, gb = _syncbn_triton.backward_reduce(dy, x, row, True, True)
        return row, sums, gw, gb

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        reductions()  # compile and warm up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = reductions()
    for seed in range(2, 6):
        x.copy_(_input(m, c, torch.float16, "cuda", offset=seed, seed=seed))
        dy.copy_(_input(m, c, torch.float16, "cuda", seed=seed + 10))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, reductions()):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
