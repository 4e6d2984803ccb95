"""SyncBatchNorm's Triton reductions against float64 references (CPU interpreter and CUDA).

``stats_row`` packs ``[mean, 1/sqrt(var + eps), M]`` for the all-gather, ``backward_reduce``
gives ``[sum(dy), sum(dy * (x - mean))]`` and the local weight/bias gradients. Tolerances: the
kernels compute in fp32 from the same rounded inputs the reference sees, so the errors are fp32
accumulation errors: relative 1e-5 (statistics) and 1e-4 of the sums' magnitude.
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


@pytest.mark.parametrize("device", DEVICES)
def test_stats_row_reads_a_row_strided_view(device):
    # A channels-last NHWC tensor's (M, C) view is dense; a slice of channels is not.
    full = _input(600, 40, torch.float32, device)
    view = full[:, 5:29]
    assert view.stride() == (40, 1)
    row = _syncbn_triton.stats_row(view, 1e-5).cpu().double()
    ref = _syncbn_triton.stats_row(view.contiguous(), 1e-5).cpu().double()
    torch.testing.assert_close(row, ref, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,c", SHAPES)
@pytest.mark.parametrize("need_weight,need_bias", [(True, True), (False, False), (True, False)])
def test_backward_reduce_matches_float64(device, dtype, m, c, need_weight, need_bias):
    x = _input(m, c, dtype, device, offset=1.0)
    dy = _input(m, c, dtype, device, seed=1)
    mean = x.double().mean(0).float()
    invstd = (x.double().var(0, unbiased=False) + 1e-5).rsqrt().float()
    sums, gw, gb = _syncbn_triton.backward_reduce(dy, x, mean, invstd, need_weight, need_bias)
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


def test_usable_rejects_what_the_kernels_do_not_take():
    x = torch.randn(8, 4)
    assert not _syncbn_triton.usable(x.double())
    assert not _syncbn_triton.usable(x.t())  # channels not contiguous
    assert not _syncbn_triton.usable(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="unit column stride"):
        _syncbn_triton.stats_row(x.t(), 1e-5)
