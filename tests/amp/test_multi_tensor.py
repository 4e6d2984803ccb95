"""The fused cast + unscale + inf/NaN check of mixprec.amp._multi_tensor against PyTorch.

Exact checks throughout (``rtol=0, atol=0``): the kernel casts to fp32 and does one fp32
multiply, so it must match ``src.float() * inv_scale`` bit for bit; that in turn equals the
fp64 product rounded to fp32 (the product of two fp32 values is exact in fp64), which the
reference also checks. On CPU the kernel runs in Triton's interpreter (small tensors: the
interpreter is slow); on CUDA it is compiled.
"""

import logging

import pytest
import torch

from mixprec.amp import _multi_tensor as mt
from tests._triton import interpreter_skip_reason
from tests.conftest import requires_cuda

# (numel or shape, dtype): odd sizes that straddle the interpreter's 1,024-element chunks and
# 256-element loop steps, a 2-D tensor, an empty one, fp16 and bf16 mixed in one call.
_CASES = [
    (1, torch.float16),
    (3, torch.bfloat16),
    (1023, torch.float16),
    (4097, torch.bfloat16),
    ((37, 29), torch.float16),
    (0, torch.bfloat16),
    (2050, torch.float16),
]
_INV_SCALES = [1.0 / 65536, 1.0 / 3]


@pytest.fixture
def dev(device):
    if device.type == "cpu":
        reason = interpreter_skip_reason()
        if reason is not None:
            pytest.skip(reason)
    return device


def _reference(src, inv_scale):
    """``src * inv_scale`` in fp64, rounded once to fp32."""
    return (src.double() * inv_scale.double()).float()


def _assert_exact(dst, src, inv_scale):
    torch.testing.assert_close(dst, _reference(src, inv_scale), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(dst, src.float() * inv_scale, rtol=0, atol=0, equal_nan=True)


def _make(cases, device, gen, scale=1.0):
    srcs = [(torch.randn(size, generator=gen) * scale).to(device=device, dtype=dtype)
            for size, dtype in cases]
    dsts = [torch.full(s.shape, -7.0, dtype=torch.float32, device=device) for s in srcs]
    return srcs, dsts


def _scalars(device, inv, found=0.0):
    return (torch.tensor(inv, dtype=torch.float32, device=device),
            torch.tensor(found, dtype=torch.float32, device=device))


@pytest.mark.parametrize("check", [True, False], ids=["checked", "after_usable"])
@pytest.mark.parametrize("inv", _INV_SCALES)
def test_matches_reference(dev, inv, check):
    srcs, dsts = _make(_CASES, dev, torch.Generator().manual_seed(0), scale=1000.0)
    inv_scale, found_inf = _scalars(dev, inv)
    assert mt.usable(srcs, dsts), mt.unusable_reason(srcs, dsts)
    mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf, check=check)
    for src, dst in zip(srcs, dsts):
        _assert_exact(dst, src, inv_scale)
    assert found_inf.item() == 0.0


def test_unscale_after_cast_keeps_small_gradients(dev):
    # True gradients of 1e-4 down to 1e-9, scaled by 65,536 as the backward produces them.
    # Unscaled in half they would lose precision (fp16 subnormals) or flush to zero; cast
    # first, they come out as the fp32 product.
    true = torch.logspace(-4, -9, 1001, dtype=torch.float64)
    srcs = [(true * 65536).to(dtype=dtype, device=dev) for dtype in (torch.float16, torch.bfloat16)]
    dsts = [torch.empty(s.shape, dtype=torch.float32, device=dev) for s in srcs]
    inv_scale, found_inf = _scalars(dev, 1.0 / 65536)
    mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    for src, dst in zip(srcs, dsts):
        _assert_exact(dst, src, inv_scale)
        assert (dst > 0).all()
        torch.testing.assert_close(dst.double().cpu(), true, rtol=1e-2, atol=0)
    in_half = (srcs[0] * inv_scale.half()).float()
    assert (in_half == 0).any(), "the half-precision unscale this guards against no longer underflows"


def test_misaligned_views(dev):
    # Views one element into a buffer: 2-byte (src) and 4-byte (dst) aligned addresses take the
    # kernel's unaligned path.
    gen = torch.Generator().manual_seed(1)
    base_src = torch.randn(3000, generator=gen).to(device=dev, dtype=torch.float16)
    base_dst = torch.zeros(3000, dtype=torch.float32, device=dev)
    srcs = [base_src[1:1200], base_src[1203:2999]]
    dsts = [base_dst[1:1200], base_dst[1203:2999]]
    inv_scale, found_inf = _scalars(dev, 1.0 / 3)
    mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    for src, dst in zip(srcs, dsts):
        _assert_exact(dst, src, inv_scale)
    # Elements outside the views are not written.
    assert base_dst[0].item() == 0 and (base_dst[1200:1203] == 0).all()
    assert base_dst[2999].item() == 0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [(2, 5), (3, 4000)])  # (tensor, element): first and last chunk
def test_non_finite_sets_found_inf(dev, bad, where):
    srcs, dsts = _make(_CASES, dev, torch.Generator().manual_seed(2))
    t, i = where
    srcs[t].view(-1)[i] = bad
    inv_scale, found_inf = _scalars(dev, 1.0 / 65536)
    mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    assert found_inf.item() == 1.0
    for src, dst in zip(srcs, dsts):  # every value is still written, the bad one included
        _assert_exact(dst, src, inv_scale)


# (The interpreter's numpy multiplies inf/NaN/near-max values, as this test means it to.)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("seed", range(6))
def test_random_lists_match_reference(dev, seed):
    # Seeded generative lists: fp16 and bf16 mixed, sizes at the chunk and loop-step boundaries
    # (k * size - 1, k * size, k * size + 1), empty and tiny tensors, all sources views into
    # one buffer per dtype and all destinations views into one fp32 buffer at odd offsets,
    # raw 16-bit patterns (subnormals, the largest values, inf and NaN payloads), a bad value
    # in some tail chunk, and scales 2**k for k in [-24, 24] or not a power of two.
    on_gpu = dev.type == "cuda"
    chunk, block = ((mt._CHUNK, mt._BLOCK) if on_gpu
                    else (mt._INTERPRETER_CHUNK, mt._INTERPRETER_BLOCK))
    gen = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=gen))]

    edges = [k * m + d for m in (block, chunk) for k in (1, 2) for d in (-1, 0, 1)]
    sizes = [pick([0, 1, 2, 3, 7, 9, 33] + edges) for _ in range(pick([1, 3, 12, 40]))]
    dtypes = [pick([torch.float16, torch.bfloat16]) for _ in sizes]
    bits = torch.randint(-2**15, 2**15, (sum(sizes) + 2 * len(sizes),), generator=gen,
                         dtype=torch.int16)
    normal = torch.randn(bits.shape, generator=gen) * 2.0 ** pick(list(range(-12, 15)))
    raw = bool(seed % 2)  # raw bit patterns: inf/NaN almost surely somewhere
    srcs, offset = [], 1
    for size, dtype in zip(sizes, dtypes):
        buf = bits.view(dtype) if raw else normal.to(dtype)
        srcs.append(buf[offset:offset + size])
        offset += size + 1
    if not raw and seed % 4 == 0:
        last = [s for s in srcs if s.numel()][-1]
        last[-1] = pick([float("inf"), float("-inf"), float("nan")])  # last tensor, tail chunk
    base = torch.full((offset + 3,), -7.0, device=dev)
    srcs = [s.to(dev) for s in srcs]
    dsts, offset = [], 3
    for s in srcs:
        dsts.append(base[offset:offset + s.numel()])
        offset += s.numel() + 1
    inv = 2.0 ** pick(list(range(-24, 25))) if seed < 4 else 1.0 / (1 + 1000 * seed / 7)
    inv_scale, found_inf = _scalars(dev, inv)
    assert mt.usable(srcs, dsts), mt.unusable_reason(srcs, dsts)
    mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    bad = any(not s.isfinite().all() for s in srcs)
    assert found_inf.item() == float(bad)
    assert raw == bad or seed % 4 == 0
    for src, dst in zip(srcs, dsts):
        _assert_exact(dst, src, inv_scale)
    written = torch.zeros(base.shape, dtype=torch.bool, device=dev)
    for d in dsts:
        written[d.storage_offset():d.storage_offset() + d.numel()] = True
    assert (base[~written] == -7.0).all()  # nothing outside the destinations


def test_found_inf_already_set_stays_set(dev):
    srcs, dsts = _make(_CASES, dev, torch.Generator().manual_seed(3))
    inv_scale, found_inf = _scalars(dev, 1.0 / 65536, found=1.0)
    mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    assert found_inf.item() == 1.0
    for src, dst in zip(srcs, dsts):
        _assert_exact(dst, src, inv_scale)


def test_half_extremes_are_finite(dev):
    # The largest finite values and the subnormals must not be mistaken for inf/NaN.
    finfo16, finfob = torch.finfo(torch.float16), torch.finfo(torch.bfloat16)
    srcs = [
        torch.tensor([finfo16.max, -finfo16.max, finfo16.tiny, 2.0**-24, -0.0],
                     dtype=torch.float16, device=dev),
        torch.tensor([finfob.max, -finfob.max, finfob.tiny, 2.0**-133, -0.0],
                     dtype=torch.bfloat16, device=dev),
    ]
    dsts = [torch.empty(5, dtype=torch.float32, device=dev) for _ in srcs]
    inv_scale, found_inf = _scalars(dev, 1.0 / 3)
    mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    assert found_inf.item() == 0.0
    for src, dst in zip(srcs, dsts):
        _assert_exact(dst, src, inv_scale)


def test_only_empty_tensors(dev):
    srcs = [torch.empty(0, dtype=torch.float16, device=dev)]
    dsts = [torch.empty(0, dtype=torch.float32, device=dev)]
    inv_scale, found_inf = _scalars(dev, 1.0 / 65536)
    assert mt.usable(srcs, dsts)
    mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    assert found_inf.item() == 0.0


def test_repeated_calls_read_current_values(dev):
    # The second call reuses the first call's pointer table: it must still see new values.
    srcs, dsts = _make(_CASES[:4], dev, torch.Generator().manual_seed(4))
    inv_scale, found_inf = _scalars(dev, 1.0 / 65536)
    mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    for src in srcs:
        src.mul_(-2)
    inv_scale.fill_(1.0 / 3)
    mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    for src, dst in zip(srcs, dsts):
        _assert_exact(dst, src, inv_scale)


def _unusable_cases(device):
    h = torch.zeros(4, 6, dtype=torch.float16, device=device)
    f = torch.zeros(4, 6, dtype=torch.float32, device=device)
    return {
        # (the offender's own shape and strides: how a user finds which gradient it was)
        "non-contiguous src": ([h.t()], [f], "srcs[0] is not contiguous (shape (6, 4), strides "
                                             "(1, 6)); pass contiguous tensors"),
        "non-contiguous dst": ([h, h], [f, f.t()], "dsts[1] is not contiguous (shape (6, 4), "
                                                   "strides (1, 6)); pass contiguous tensors"),
        "numel mismatch": ([h], [f[:3]], "same number of elements"),
        "fp32 src": ([f], [f.clone()], "srcs must be torch.float16 or torch.bfloat16"),
        "half dst": ([h], [h.clone()], "dsts must be torch.float32"),
        "length mismatch": ([h, h], [f], "same length"),
        "empty lists": ([], [], "at least one"),
    }


@pytest.mark.parametrize("case", list(_unusable_cases("cpu")))
def test_unusable_inputs_are_refused(dev, case):
    srcs, dsts, reason = _unusable_cases(dev)[case]
    assert not mt.usable(srcs, dsts)
    assert reason in mt.unusable_reason(srcs, dsts)
    inv_scale, found_inf = _scalars(dev, 1.0)
    with pytest.raises(ValueError, match="cast_unscale_check_: "):
        mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)


def test_bad_scalars_are_refused(dev):
    srcs, dsts = _make(_CASES[:2], dev, torch.Generator().manual_seed(5))
    inv_scale, found_inf = _scalars(dev, 1.0)
    with pytest.raises(ValueError, match="inv_scale must be a one-element float32 tensor"):
        mt.cast_unscale_check_(srcs, dsts, inv_scale.double(), found_inf)
    with pytest.raises(ValueError, match="found_inf must be a one-element float32 tensor"):
        mt.cast_unscale_check_(srcs, dsts, inv_scale, torch.zeros(2, device=dev))
    with pytest.raises(TypeError, match="inv_scale must be a one-element float32 tensor"):
        mt.cast_unscale_check_(srcs, dsts, 1.0, found_inf)


def test_wrong_device_for_mode_is_refused(monkeypatch):
    # The compiled kernel takes CUDA tensors only, the interpreter CPU tensors only.
    srcs, dsts = [torch.zeros(3, dtype=torch.float16)], [torch.zeros(3)]
    monkeypatch.setattr(mt, "interpreter_enabled", lambda: False)
    assert "CPU tensors only with TRITON_INTERPRET=1" in mt.unusable_reason(srcs, dsts)
    if torch.cuda.is_available():
        monkeypatch.setattr(mt, "interpreter_enabled", lambda: True)
        cuda = [srcs[0].cuda()], [dsts[0].cuda()]
        assert "runs Triton on CPU tensors only" in mt.unusable_reason(*cuda)
        mixed = [srcs[0].cuda()], dsts
        assert "several devices" in mt.unusable_reason(*mixed)


@pytest.mark.parametrize("meta", ["src", "dst"])
def test_meta_tensor_with_cpu_tensors_is_refused(monkeypatch, meta):
    # get_device() is -1 for CPU and meta tensors alike: a meta tensor among CPU ones passed
    # the one-device check and the interpreter's kernel went through its null data_ptr (a
    # segfault). Checked before any call, so that a regression fails instead of crashing.
    if not mt.triton_available():
        pytest.skip("requires triton")
    monkeypatch.setattr(mt, "interpreter_enabled", lambda: True)
    h = [torch.ones(5, dtype=torch.float16), torch.ones(5, dtype=torch.float16)]
    f = [torch.zeros(5), torch.zeros(5)]
    if meta == "src":
        h[1] = h[1].to("meta")
    else:
        f[1] = f[1].to("meta")
    assert "several devices (['cpu', 'meta'])" in mt.unusable_reason(h, f)
    assert not mt.usable(h, f)
    inv_scale, found_inf = _scalars("cpu", 1.0)
    with pytest.raises(ValueError, match="several devices"):
        mt.cast_unscale_check_(h, f, inv_scale, found_inf)


def test_same_sources_into_other_destinations(dev):
    """The same gradients cast into a second set of fp32 buffers (a new optimizer's masters
    over the same model) land in the new buffers; the first ones keep what the first call
    wrote. (M51)"""
    srcs, first = _make(_CASES[:4], dev, torch.Generator().manual_seed(9))
    second = [torch.full_like(d, -7.0) for d in first]
    inv_scale, found_inf = _scalars(dev, 1.0 / 8)
    mt.cast_unscale_check_(srcs, first, inv_scale, found_inf)
    kept = [d.clone() for d in first]
    inv_scale.fill_(1.0 / 3)
    mt.cast_unscale_check_(srcs, second, inv_scale, found_inf)
    for src, dst in zip(srcs, second):
        _assert_exact(dst, src, inv_scale)
    for dst, old in zip(first, kept):
        torch.testing.assert_close(dst, old, rtol=0, atol=0)
    assert found_inf.item() == 0.0


def test_tables_used_by_a_captured_graph_are_never_evicted():
    """A table uploaded in a CUDA graph capture is read by every replay, for good: eviction
    passes it over, however many newer tables come, while the other tables still go oldest
    first. (M44)"""
    import numpy as np

    saved, saved_graph = dict(mt._TABLES), set(mt._GRAPH_KEYS)
    mt._TABLES.clear()
    try:
        cpu = torch.device("cpu")

        def build():
            return np.zeros((1, 4), dtype=np.int64)

        captured = ("graph-test", "captured")
        mt.cached_table(captured, build, cpu, (0, 1))
        mt._GRAPH_KEYS.add(captured)
        keys = [("graph-test", i) for i in range(mt._MAX_TABLES + 5)]
        for key in keys:
            mt.cached_table(key, build, cpu, (0, 1))
        assert list(mt._TABLES) == [captured] + keys[-mt._MAX_TABLES:]
    finally:
        mt._TABLES.clear()
        mt._TABLES.update(saved)
        mt._GRAPH_KEYS.clear()
        mt._GRAPH_KEYS.update(saved_graph)


def test_a_table_uploaded_during_a_capture_is_pinned_with_its_rows():
    """device_rows under a CUDA graph capture pins the table (its key in _GRAPH_KEYS, which
    eviction passes over) and keeps its device rows alive (_GRAPH_ROWS): every replay reads
    them. Eagerly it pins nothing. Uploads never block the host. White box, on a stand-in
    host table whose .to() records the upload (r98D G5: the eviction test above pins by hand,
    so nothing checked that a capture does)."""

    class _Host:
        def __init__(self):
            self.uploads = []

        def to(self, device, non_blocking=False):
            self.uploads.append(non_blocking)
            return object()

    key = ("pin-test", "captured")
    table = mt._Table(_Host(), 1, True)
    saved_keys, saved_rows = set(mt._GRAPH_KEYS), dict(mt._GRAPH_ROWS)
    try:
        eager = mt.device_rows(key, table, torch.device("cuda", 0), capturing=False)
        assert key not in mt._GRAPH_KEYS and key not in mt._GRAPH_ROWS
        rows = mt.device_rows(key, table, torch.device("cuda", 0), capturing=True)
        assert rows is not eager
        assert key in mt._GRAPH_KEYS and mt._GRAPH_ROWS[key] == [rows]
        assert table.host.uploads and all(table.host.uploads)
    finally:
        mt._GRAPH_KEYS.clear()
        mt._GRAPH_KEYS.update(saved_keys)
        mt._GRAPH_ROWS.clear()
        mt._GRAPH_ROWS.update(saved_rows)


_CAPTURE_CASES = [(1, torch.float16), (3, torch.bfloat16), (1023, torch.float16),
                  (4097, torch.bfloat16), ((37, 29), torch.float16), (70000, torch.bfloat16)]


@requires_cuda
def test_a_captured_graph_replays_right_after_eager_calls_filled_the_table_cache():
    """End to end on the GPU (r98D M69): a captured cast_unscale_check_ reads its pinned table
    at every replay; more than _MAX_TABLES eager calls on new addresses in between evict the
    other tables, not that one. The replay writes float(src) * inv_scale bitwise into the
    captured destinations, and nothing into the eager calls' tensors."""
    gen = torch.Generator().manual_seed(0)

    def make():
        srcs = [torch.randn(size, generator=gen).to("cuda", dt) for size, dt in _CAPTURE_CASES]
        return srcs, [torch.full(s.shape, -7.0, device="cuda") for s in srcs]

    srcs, dsts = make()
    inv = torch.full((), 1.0 / 1024, device="cuda")
    found = torch.zeros((), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mt.cast_unscale_check_(srcs, dsts, inv, found)  # (warm-up off the capture)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mt.cast_unscale_check_(srcs, dsts, inv, found)
    others = [make() for _ in range(mt._MAX_TABLES + 4)]
    for s2, d2 in others:
        mt.cast_unscale_check_(s2, d2, inv, found)
    torch.cuda.synchronize()
    for _, d2 in others:
        for d in d2:
            d.fill_(-7.0)
    for _ in range(2):
        for s, d in zip(srcs, dsts):
            s.normal_()
            d.fill_(-7.0)
        found.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert found.item() == 0.0
        for s, d in zip(srcs, dsts):
            assert torch.equal(d, s.float() * inv)
    assert all(bool((d == -7.0).all()) for _, d2 in others for d in d2)


def test_the_table_flags_addresses_not_16_byte_aligned():
    """The table records whether every address column is 16-byte aligned: only then may the
    compiled kernel use 16-byte vector loads and stores (a 4- or 8-byte aligned view read as
    vectors faults or reads the wrong bytes on the GPU). Columns not named as pointers are
    not checked. (M42, M43)"""
    import numpy as np

    saved = dict(mt._TABLES)
    try:
        cpu = torch.device("cpu")
        for offset, aligned in ((0, True), (4, False), (8, False), (2, False), (32, True)):
            rows = np.array([[4096, 8192 + offset, 5, 0], [4096 + 64, 8192, 5, 0]], dtype=np.int64)
            table = mt.cached_table(("align-test", offset), lambda rows=rows: rows, cpu, (0, 1))
            assert table.aligned is aligned, offset
            assert table.n_chunks == 2 and torch.equal(table.host, torch.from_numpy(rows))
        rows = np.array([[4096, 8192, 3, 1]], dtype=np.int64)  # (odd count: not an address)
        assert mt.cached_table(("align-test", "count"), lambda: rows, cpu, (0, 1)).aligned
        # The columns the caller names (FusedAdam's table has six): a misaligned third column
        # clears the flag, an odd count in a column between them does not.
        rows = np.array([[4096, 5, 8192, 0]], dtype=np.int64)
        assert mt.cached_table(("align-test", "cols"), lambda: rows, cpu, (0, 2)).aligned
        rows = np.array([[4096, 16, 8192 + 4, 0]], dtype=np.int64)
        assert not mt.cached_table(("align-test", "col2"), lambda: rows, cpu, (0, 2)).aligned
    finally:
        mt._TABLES.clear()
        mt._TABLES.update(saved)


def test_chunk_rows_matches_a_plain_loop():
    """chunk_rows splits each tensor into chunks of at most ``chunk`` elements in order, and
    an empty tensor gets no chunk (a zero-count row would be a launched program with nothing
    to do, and the kernels' tables are sized by it). Reference: a plain loop. (M35, M36)"""
    pytest.importorskip("numpy")
    numels = [0, 1, 7, 8, 9, 16, 0, 17, 24, 3]
    chunk = 8
    want = [(i, s, min(chunk, n - s)) for i, n in enumerate(numels) for s in range(0, n, chunk)]
    owner, start, count = mt.chunk_rows(numels, chunk)
    got = list(zip(owner.tolist(), start.tolist(), count.tolist()))
    assert got == want


@pytest.mark.parametrize("version,verified", [(None, False), ((3, 5), False), ((3, 6), True),
                                              ((3, 7), True), ((4, 0), True)])
def test_verified_triton_from_3_6_on(monkeypatch, version, verified):
    """The fused cast is taken from Triton 3.6 on (the release CI pins and the kernel was
    verified with), and not without a usable Triton (no version). (M27, M28)"""
    monkeypatch.setattr(mt, "triton_version", lambda: version)
    assert mt.verified_triton() is verified


def test_meta_tensors_alone_are_refused_under_the_interpreter(monkeypatch):
    """The interpreter runs on CPU tensors only, the compiled kernel on CUDA tensors only:
    lists all on the meta device (no memory behind their data_ptr) are refused either way, as
    is a meta scalar beside CPU lists, before any launch could write through a null pointer.
    (M26, M31, A04)"""
    if not mt.triton_available():
        pytest.skip("requires triton")
    h = [torch.empty(5, dtype=torch.float16, device="meta")]
    f = [torch.empty(5, device="meta")]
    monkeypatch.setattr(mt, "interpreter_enabled", lambda: False)
    assert mt.unusable_reason(h, f) == ("got meta tensors; the kernel needs CUDA tensors (CPU "
                                        "tensors only with TRITON_INTERPRET=1, for tests)")
    assert not mt.usable(h, f)
    monkeypatch.setattr(mt, "interpreter_enabled", lambda: True)
    assert "runs Triton on CPU tensors only, got meta tensors" in mt.unusable_reason(h, f)
    assert not mt.usable(h, f)
    srcs, dsts = [torch.ones(5, dtype=torch.float16)], [torch.zeros(5)]
    found_inf = torch.zeros(())
    with pytest.raises(ValueError, match=r"inv_scale must be a one-element float32 tensor on cpu, "
                                         r"got torch.float32 of shape \(\) on meta"):
        mt.cast_unscale_check_(srcs, dsts, torch.ones((), device="meta"), found_inf)
    assert found_inf.item() == 0.0 and (dsts[0] == 0).all()


def test_missing_triton_or_numpy_is_the_reason(monkeypatch):
    """Without Triton (or without NumPy, which builds the pointer table) the lists are not
    usable and the reason says which is missing, so callers take PyTorch's passes instead of
    failing at the launch. (M21, M25)"""
    srcs, dsts = [torch.zeros(3, dtype=torch.float16)], [torch.zeros(3)]
    monkeypatch.setattr(mt, "interpreter_enabled", lambda: True)
    monkeypatch.setattr(mt, "triton_available", lambda: False)
    assert mt.unusable_reason(srcs, dsts) == "Triton is not installed (or failed to import)"
    assert not mt.usable(srcs, dsts)
    monkeypatch.setattr(mt, "triton_available", lambda: True)
    monkeypatch.setattr(mt, "_numpy_available", lambda: False)
    assert mt.unusable_reason(srcs, dsts) == (
        "NumPy is not installed (the pointer table is built with it)")
    assert not mt.usable(srcs, dsts)


def test_fewer_srcs_than_dsts_and_float64_dsts_are_refused(dev):
    """The lists pair up one to one (a dst without its src would keep stale values) and every
    dst is fp32 (the kernel writes 4-byte values: a float64 dst would receive garbage): both
    are refused with their reason, and cast_unscale_check_ raises on them. (M15, M20)"""
    import re

    h = torch.zeros(8, dtype=torch.float16, device=dev)
    f = torch.zeros(8, dtype=torch.float32, device=dev)
    inv_scale, found_inf = _scalars(dev, 1.0)
    cases = [([h], [f, f.clone()], "got 1 srcs and 2 dsts; pass lists of the same length"),
             ([h], [f.double()], "dsts[0] is torch.float64; dsts must be torch.float32")]
    for srcs, dsts, reason in cases:
        assert not mt.usable(srcs, dsts)
        assert mt.unusable_reason(srcs, dsts) == reason
        with pytest.raises(ValueError, match=re.escape(f"cast_unscale_check_: {reason}")):
            mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)


def test_sizes_are_compared_pair_by_pair(dev):
    """Each src must have its own dst's number of elements: lists whose sizes only add up to
    the same total (4 and 6 elements into 6 and 4) are refused with the first offending pair
    named, since the kernel writes each src into its own dst and would write past the end of
    the smaller one. (T06)"""
    h4, h6 = (torch.zeros(n, dtype=torch.float16, device=dev) for n in (4, 6))
    f4, f6 = (torch.zeros(n, dtype=torch.float32, device=dev) for n in (4, 6))
    srcs, dsts = [h4, h6], [f6, f4]
    assert not mt.usable(srcs, dsts)
    assert mt.unusable_reason(srcs, dsts) == (
        "srcs[0] has 4 elements and dsts[0] 6; each pair must have the same number of elements")
    inv_scale, found_inf = _scalars(dev, 1.0)
    with pytest.raises(ValueError, match=r"srcs\[0\] has 4 elements and dsts\[0\] 6"):
        mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)


def test_the_reason_names_the_first_offending_pair():
    """unusable_reason names the first offending tensor by its index (documented: "srcs[3] is
    not contiguous ..."), so that a log line points at the right gradient: here the second
    pair is the bad one. (M17, M18, M19)"""
    if not mt.triton_available():
        pytest.skip("requires triton")
    h = torch.zeros(4, 6, dtype=torch.float16)
    f = torch.zeros(4, 6, dtype=torch.float32)
    assert mt.unusable_reason([h, f], [f, f]).startswith(
        "srcs[1] is torch.float32; srcs must be torch.float16 or torch.bfloat16")
    assert mt.unusable_reason([h, h], [f, h]).startswith(
        "dsts[1] is torch.float16; dsts must be torch.float32")
    assert mt.unusable_reason([h, h], [f, f[:3]]).startswith(
        "srcs[1] has 24 elements and dsts[1] 18; each pair must have the same number")


def test_new_sources_into_the_same_destinations(dev):
    """Other gradients (a second model's, or the same model's after its gradients were set to
    None and re-allocated elsewhere) cast into the same fp32 buffers: the destinations receive
    the new sources' values, not the first sources' (the cached table must be keyed by where
    it reads as well as where it writes). (C01)"""
    gen = torch.Generator().manual_seed(11)
    first, dsts = _make(_CASES[:4], dev, gen)
    second, _ = _make(_CASES[:4], dev, gen)
    inv_scale, found_inf = _scalars(dev, 1.0 / 8)
    mt.cast_unscale_check_(first, dsts, inv_scale, found_inf)
    mt.cast_unscale_check_(second, dsts, inv_scale, found_inf)
    for src, dst in zip(second, dsts):
        _assert_exact(dst, src, inv_scale)
    assert found_inf.item() == 0.0
    assert first[2].data_ptr() != second[2].data_ptr()  # (both alive: distinct addresses)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [300, 1024 + 5])  # a tail loop step; a tail chunk
def test_the_tail_reads_nothing_past_its_source(dev, dtype, n):
    """A source is read for its own elements only: an inf or NaN right after it in memory (the
    next gradient in a flat buffer, or the rest of a larger storage) must neither raise
    found_inf nor reach the destination, or a finite step would be skipped. (K01)"""
    buf = torch.randn(n + 2, generator=torch.Generator().manual_seed(12)).to(dev, dtype)
    buf[n] = float("inf")
    buf[n + 1] = float("nan")
    src = buf[:n]
    dst = torch.full((n + 2,), -7.0, device=dev)
    inv_scale, found_inf = _scalars(dev, 1.0 / 4)
    mt.cast_unscale_check_([src], [dst[:n]], inv_scale, found_inf)
    assert found_inf.item() == 0.0
    _assert_exact(dst[:n], src, inv_scale)
    assert (dst[n:] == -7.0).all()


def test_one_element_scalars_of_shape_1_are_taken_as_pytorch_takes_them(dev):
    """inv_scale and found_inf of shape (1,) (the shape older GradScalers keep their scale
    and flag in) are accepted, as torch._amp_foreach_non_finite_check_and_unscale_ accepts
    them, and give its results: a caller swapping the PyTorch passes for this function keeps
    its scalars. (B02)"""
    srcs, dsts = _make(_CASES[:3], dev, torch.Generator().manual_seed(13), scale=100.0)
    srcs[1][2] = float("inf")
    inv_scale = torch.full((1,), 1.0 / 16, device=dev)
    found_inf = torch.zeros(1, device=dev)
    mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    want = [s.float() for s in srcs]
    want_found = torch.zeros(1, device=dev)
    torch._amp_foreach_non_finite_check_and_unscale_(want, want_found, inv_scale)
    assert found_inf.shape == (1,) and torch.equal(found_inf, want_found)
    for dst, ref in zip(dsts, want):
        torch.testing.assert_close(dst, ref, rtol=0, atol=0)


def test_usable_logs_why_not_at_debug_only(caplog):
    """usable() logs its reason for refusing at DEBUG level (documented), under this module's
    logger, once per call: a user enabling DEBUG sees why the fused path was not taken, and a
    run at INFO (amp's verbosity=1) gets no line every step. (A07, A08)"""
    if not mt.triton_available():
        pytest.skip("requires triton")
    h = torch.zeros(4, 6, dtype=torch.float16)
    f = torch.zeros(4, 6, dtype=torch.float32)
    reason = mt.unusable_reason([h.t()], [f])
    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        assert not mt.usable([h.t()], [f])
    assert [r for r in caplog.records if r.name == mt.__name__] == []
    with caplog.at_level(logging.DEBUG, logger=mt.__name__):
        assert not mt.usable([h.t()], [f])
    records = [r for r in caplog.records if r.name == mt.__name__]
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.DEBUG, f"fused cast + unscale not used: {reason}")]


@requires_cuda
def test_cuda_large_tensor():
    # Past 2**31 bytes of fp32 output: addresses must not wrap in 32-bit arithmetic.
    n = (1 << 29) + 12345
    free, _ = torch.cuda.mem_get_info()
    if free < 10 * n:
        pytest.skip("requires ~6 GB of free GPU memory")
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").uniform_(-4, 4)
    src[-1] = float("inf")
    dst = torch.empty(n, dtype=torch.float32, device="cuda")
    inv_scale, found_inf = _scalars("cuda", 1.0 / 3)
    mt.cast_unscale_check_([src], [dst], inv_scale, found_inf)
    assert found_inf.item() == 1.0
    assert torch.equal(dst, src.float() * inv_scale)
    del src, dst


@requires_cuda
def test_cuda_tables_hold_no_device_memory():
    # The cached tables live on the host; each launch uploads a transient copy, freed once the
    # launch is queued. Cached device tables (the old design) stayed allocated across steps and
    # raised a training step's peak memory above autocast's.
    srcs, dsts = _make(_CASES, "cuda", torch.Generator().manual_seed(8))
    inv_scale, found_inf = _scalars("cuda", 1.0 / 8)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for step in range(3):  # a miss, then cache hits
        mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
        assert torch.cuda.memory_allocated() == before, step
    torch.cuda.synchronize()
    for src, dst in zip(srcs, dsts):
        _assert_exact(dst, src, inv_scale)
    assert found_inf.item() == 0.0


@requires_cuda
@pytest.mark.parametrize("warm", [True, False], ids=["table_cached", "table_built_in_capture"])
def test_cuda_graph_capture(warm):
    srcs, dsts = _make(_CASES, "cuda", torch.Generator().manual_seed(6))
    inv_scale, found_inf = _scalars("cuda", 1.0 / 65536)
    if warm:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
        torch.cuda.current_stream().wait_stream(side)
    else:
        for key in [k for k in mt._TABLES if k not in mt._GRAPH_KEYS]:
            del mt._TABLES[key]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    for step in range(3):
        for src in srcs:
            src.normal_()
        if step == 1:
            srcs[3][7] = float("nan")
        found_inf.zero_()
        inv_scale.fill_(1.0 / (step + 3))
        graph.replay()
        torch.cuda.synchronize()
        assert found_inf.item() == float(step == 1)
        for src, dst in zip(srcs, dsts):
            _assert_exact(dst, src, inv_scale)


@requires_cuda
def test_cuda_eager_call_between_capture_and_replay():
    """A captured call's device table is filled by the graph's replays only: an eager call with
    the same tensors right after the capture (before any replay) must upload its own (reading
    the captured one gave an illegal memory access), and both then compute correctly."""
    srcs, dsts = _make(_CASES, "cuda", torch.Generator().manual_seed(7))
    inv_scale, found_inf = _scalars("cuda", 1.0 / 1024)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf)
    for run in (lambda: mt.cast_unscale_check_(srcs, dsts, inv_scale, found_inf), graph.replay):
        for src, dst in zip(srcs, dsts):
            src.normal_()
            dst.fill_(-7.0)
        run()
        torch.cuda.synchronize()
        assert found_inf.item() == 0.0
        for src, dst in zip(srcs, dsts):
            _assert_exact(dst, src, inv_scale)


def test_same_addresses_with_another_dtype_are_decoded_by_their_dtype(dev):
    # The same memory read first as fp16, then as bf16 (same addresses and sizes): the second
    # call must decode bf16, not reuse the first call's table.
    gen = torch.Generator().manual_seed(3)
    src = (torch.randn(300, generator=gen)).to(device=dev, dtype=torch.float16)
    dst = torch.empty(300, dtype=torch.float32, device=dev)
    for view in (src, src.view(torch.bfloat16)):
        inv, found = _scalars(dev, 1.0 / 4)
        mt.cast_unscale_check_([view], [dst], inv, found)
        finite = view.float().isfinite().all()
        assert float(found) == (0.0 if finite else 1.0)
        _assert_exact(dst, view, inv)


def test_same_addresses_with_other_sizes_cover_every_element(dev):
    # Views starting at the same addresses with more elements than before (a gradient bucket
    # reused for larger tensors): the second call must cover all of them.
    gen = torch.Generator().manual_seed(4)
    src = torch.randn(3000, generator=gen).to(device=dev, dtype=torch.bfloat16)
    dst = torch.full((3000,), -7.0, dtype=torch.float32, device=dev)
    inv, found = _scalars(dev, 1.0 / 8)
    for n in (1000, 3000):
        mt.cast_unscale_check_([src[:n]], [dst[:n]], inv, found)
        _assert_exact(dst[:n], src[:n], inv)
    assert float(found) == 0.0


def test_the_host_table_cache_evicts_its_oldest_entries():
    # (a mutation of _multi_tensor.py: eviction removed): tensors at new addresses every step
    # (changing shapes, a re-created optimizer) grew the cache of host tables without bound.
    import numpy as np

    from mixprec.amp import _multi_tensor as mt

    saved = dict(mt._TABLES)
    mt._TABLES.clear()
    try:
        keys = [("r48A-test", i) for i in range(mt._MAX_TABLES + 5)]
        for key in keys:
            mt.cached_table(key, lambda: np.zeros((1, 4), dtype=np.int64), torch.device("cpu"),
                            (0, 1))
        assert len(mt._TABLES) == mt._MAX_TABLES
        assert list(mt._TABLES) == keys[-mt._MAX_TABLES:]  # the oldest went first
    finally:
        mt._TABLES.clear()
        mt._TABLES.update(saved)
