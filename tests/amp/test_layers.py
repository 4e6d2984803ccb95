"""amp on the building blocks of real model families: attention with masks, recurrent layers
fed packed sequences, transposed/depthwise convolutions with GroupNorm, parametrized weights,
sparse embeddings."""

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from mixprec import amp
from mixprec.amp import _model as amp_model
from mixprec.amp._state import optimizer_state

from .helpers import HALF_DTYPES, backward_and_step

_B, _T, _D = 4, 6, 8
_LENGTHS = torch.tensor([6, 4, 3, 1])


class _Attention(nn.Module):
    # Masks passed in as inputs: float -inf masks, which the O2/O3 input cast brings to the
    # scores' dtype (PyTorch's attention with its weights refuses an fp32 mask beside half
    # scores), and bool ones.
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(_D, 2, batch_first=True)
        self.layer = nn.TransformerEncoderLayer(_D, 2, 16, dropout=0.0, batch_first=True,
                                                norm_first=True)

    def forward(self, x, padding, causal):
        h = self.attn(x, x, x, key_padding_mask=torch.zeros_like(causal[0]).expand(
            len(x), -1).masked_fill(padding, float("-inf")), attn_mask=causal)[0]
        return self.layer(h + x, src_mask=causal.isinf(), src_key_padding_mask=padding)


class _PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(_D, 6, num_layers=2, bidirectional=True, proj_size=3,
                           batch_first=True)

    def forward(self, packed):
        return pad_packed_sequence(self.rnn(packed)[0], batch_first=True)[0]


def _conv():
    return nn.Sequential(
        nn.Conv2d(_D, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.PReLU(8),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1),
        nn.Upsample(scale_factor=0.5, mode="bilinear"))


def _parametrized():
    return nn.Sequential(parametrizations.weight_norm(nn.Linear(_D, 8)), nn.Tanh(),
                         parametrizations.spectral_norm(nn.Linear(8, 4)))


def _inputs(block, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(_B, _T, _D, generator=g)
    if block == "attention":
        padding = torch.arange(_T) >= _LENGTHS[:, None]
        causal = torch.full((_T, _T), float("-inf")).triu(1)
        return x, padding, causal
    if block == "packed_lstm":
        return (pack_padded_sequence(x, _LENGTHS, batch_first=True),)
    if block == "conv":
        return (torch.randn(_B, _D, 6, 6, generator=g),)
    return (x,)


_BLOCKS = {"attention": _Attention, "packed_lstm": _PackedLSTM, "conv": _conv,
           "parametrized": _parametrized}


def _build(block):
    torch.manual_seed(0)
    return _BLOCKS[block]()


def _train(model, opt, block, steps, use_amp=True, dtype=None, inputs_of=None, loss_of=None):
    losses = []
    for step in range(steps):
        inputs = (inputs_of or _inputs)(block, step)
        if dtype is not None:  # (a plain half model: its inputs cast by hand)
            inputs = tuple(t.to(dtype) if block == "packed_lstm" or t.is_floating_point()
                           else t for t in inputs)
        opt.zero_grad()
        out = model(*inputs)
        loss = loss_of(out) if loss_of else out.float().pow(2).mean()
        backward_and_step(loss, opt, amp, use_amp)
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("block", list(_BLOCKS))
def test_o2_trains_real_blocks_like_fp32_with_fp32_checkpoints(block, dtype):
    reference = _build(block)
    ref_losses = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), block, 3,
                        use_amp=False)
    model = _build(block)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # (A static fp16 scale: no step skipped, so every step compares with fp32's.)
    scale = 128.0 if dtype == torch.float16 else None
    assert amp.initialize(model, opt, opt_level="O2", dtype=dtype, loss_scale=scale,
                          verbosity=0) == (model, opt)
    losses = _train(model, opt, block, 3)
    # Every layer runs in half with fp32 masters: a few roundings of 2**-8 (bf16) or 2**-11
    # (fp16) relative per layer, through at most four layers. Measured: 1e-3 (fp16) and 7e-3
    # (bf16) at most; the bound leaves about 3x.
    rtol = 3e-3 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=1e-5)
    # The checkpoint is the fp32 masters (parametrizations' original0/original1 included) and
    # loads strictly into the plain fp32 model.
    masters = {id(p): m for p, m in optimizer_state(opt).pairs}
    state = model.state_dict()
    named = dict(model.named_parameters())
    assert {k for k, p in named.items() if p.dtype == dtype} == {
        k for k, p in named.items() if id(p) in masters}
    for name, p in named.items():
        torch.testing.assert_close(state[name], masters[id(p)].detach(), rtol=0, atol=0)
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    plain = _build(block)
    plain.load_state_dict(state, strict=True)


@pytest.mark.parametrize("block", list(_BLOCKS))
def test_o3_trains_real_blocks_as_a_plain_half_model(block, dtype=torch.float16):
    # O3 (static scale 1.0) is model.to(dtype) with its inputs and outputs cast: bit for bit.
    model = _build(block)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O3", dtype=dtype, verbosity=0)
    plain = _build(block).to(dtype)
    losses = _train(model, opt, block, 2)
    plain_losses = _train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), block, 2,
                          use_amp=False, dtype=dtype)
    torch.testing.assert_close(losses, plain_losses, rtol=0, atol=0)
    for (name, v), w in zip(model.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(v, w.float(), rtol=0, atol=0, msg=name)


flattened = []  # the weights' dtype at each _flatten_as_cudnn call


def _flatten_as_cudnn(rnn):
    """What ``flatten_parameters()`` does on a GPU, here on the CPU (where it does nothing):
    the weights are copied into one new buffer and each parameter is ``set_()`` to a view of
    it, so their values stay as they were and their version counters move."""
    weights = rnn._flat_weights
    flattened.append(weights[0].dtype)
    with torch.no_grad():
        buffer = torch.empty(sum(w.numel() for w in weights), dtype=weights[0].dtype)
        start = 0
        for w in weights:
            view = buffer[start:start + w.numel()]
            view.copy_(w.reshape(-1))
            w.set_(view.view_as(w))
            start += w.numel()


def _pack_on_the_cpu(monkeypatch):
    # torch's method, which amp's wrapper calls, packs on the CPU too (as cuDNN does).
    monkeypatch.setattr(amp_model, "_TORCH_FLATTEN", _flatten_as_cudnn)
    monkeypatch.setattr(amp_model, "_packs", lambda rnn: True)


class _FlatteningLSTM(nn.Module):
    def __init__(self, flatten):
        super().__init__()
        self.rnn = nn.LSTM(_D, 6, batch_first=True)
        self.head = nn.Linear(6, 1)
        self.flatten = flatten

    def forward(self, x):
        if self.flatten:  # (the usual guard against cuDNN's non-contiguous weights warning)
            self.rnn.flatten_parameters()
        return self.head(self.rnn(x)[0])


def test_o2_rnn_weights_flattened_after_the_cast_and_flattening_is_no_write(monkeypatch):
    # model.half() re-packs an RNN's weights into one cuDNN buffer (RNNBase._apply); amp's cast
    # gave each weight a buffer of its own, and cuDNN then copied them together at every call.
    # And a forward that calls flatten_parameters() (set_() into a new buffer: the version
    # counters move, the values do not) was taken as an in-place write before each step:
    # the fp32 masters were rounded to half every step, and small updates were lost.
    _pack_on_the_cpu(monkeypatch)

    def run(flatten):
        torch.manual_seed(0)
        model = _FlatteningLSTM(flatten)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        flattened.clear()
        amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        assert flattened == [torch.bfloat16]  # (after the cast)
        _train(model, opt, "lstm", 4)
        return model.state_dict()

    expected = run(flatten=False)
    got = run(flatten=True)
    for name, v in expected.items():
        torch.testing.assert_close(got[name], v, rtol=0, atol=0, msg=name)
    # The masters hold fp32 values (bf16 alone could not hold these updates of 1e-3 x grad).
    assert not torch.equal(got["rnn.weight_ih_l0"], got["rnn.weight_ih_l0"].bfloat16().float())


def _o2_flattening_lstm(x, flatten, *, forwards=1, write=False, compiled=False):
    """Three O2 bf16 steps of a _FlatteningLSTM on ``x``, ``forwards`` accumulated forwards
    per step; with ``write``, the recurrent weight filled with 0.25 in place before the second
    step, which then runs at lr 0."""
    torch.manual_seed(0)
    model = _FlatteningLSTM(flatten)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    call = torch.compile(model, backend="eager") if compiled else model
    for step in range(3):
        if write and step == 1:
            with torch.no_grad():
                model.rnn.weight_hh_l0.fill_(0.25)  # (exact in bf16)
            for group in opt.param_groups:
                group["lr"] = 0.0
        opt.zero_grad()
        for _ in range(forwards):
            with amp.scale_loss(call(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
        opt.step()
    return model


def _assert_same_state(got, expected):
    for (name, v), w in zip(got.state_dict().items(), expected.state_dict().values()):
        torch.testing.assert_close(v, w, rtol=0, atol=0, msg=name)


def test_o2_rnn_write_before_a_flatten_is_taken_and_flattens_are_no_writes(monkeypatch):
    # flatten_parameters() is seen where it happens: a write made before it (PyTorch's DDP
    # broadcasting rank 0's weights, nn.init) is taken into the masters first, and the packing
    # itself is recorded as no write however many times a step flattens (two forwards per
    # step here; on a GPU the caching allocator may hand the same buffer back, so neither
    # the version counters nor the addresses alone could tell a move from a write).
    _pack_on_the_cpu(monkeypatch)
    x = torch.randn(_B, _T, _D, generator=torch.Generator().manual_seed(3))

    expected = _o2_flattening_lstm(x, flatten=False, forwards=2)
    _assert_same_state(_o2_flattening_lstm(x, flatten=True, forwards=2), expected)
    written = _o2_flattening_lstm(x, flatten=True, forwards=2, write=True)
    assert torch.equal(written.state_dict()["rnn.weight_hh_l0"],
                       torch.full_like(written.state_dict()["rnn.weight_hh_l0"], 0.25))
    assert torch.equal(written.rnn.weight_hh_l0, torch.full_like(written.rnn.weight_hh_l0, 0.25))


def test_o2_rnn_keeps_its_class_and_compiles_with_the_packing_seen(monkeypatch):
    # amp wraps nn.RNNBase.flatten_parameters instead of swapping the RNN's class: type
    # checks, copies and parametrizations see torch's class. Under torch.compile the wrapper
    # runs eagerly (a graph break), so the packing is still recorded as no write.
    _pack_on_the_cpu(monkeypatch)
    x = torch.randn(_B, _T, _D, generator=torch.Generator().manual_seed(3))

    got = _o2_flattening_lstm(x, flatten=True, compiled=True)
    assert type(got.rnn) is nn.LSTM
    _assert_same_state(got, _o2_flattening_lstm(x, flatten=False))
    for dup in (copy.deepcopy(got), pickle.loads(pickle.dumps(got))):
        torch.testing.assert_close(dup(x), got(x), rtol=0, atol=0)
        assert type(dup.rnn) is nn.LSTM


def test_o2_parametrized_rnn_weight_comes_off_after_initialize():
    # A parametrization on an RNN weight (registered before initialize) can still be removed.
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = _FlatteningLSTM(True)
    parametrizations.weight_norm(model.rnn, "weight_hh_l0")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(_B, _T, _D)
    before = model.rnn.weight_hh_l0.detach().clone()
    parametrize.remove_parametrizations(model.rnn, "weight_hh_l0")
    assert type(model.rnn) is nn.LSTM
    torch.testing.assert_close(model.rnn.weight_hh_l0.detach(), before, rtol=0, atol=0)
    assert model(x).dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA (cuDNN's RNN)")
def test_o2_cudnn_lstm_flattened_in_every_forward_keeps_fp32_masters(monkeypatch):
    # The same on cuDNN itself (fp16: cuDNN's RNN takes no bf16), flatten_parameters() in the
    # forward, as under DataParallel.
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    def run(flatten):
        torch.manual_seed(0)
        model = _FlatteningLSTM(flatten).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)  # fp16: cuDNN
        storages = {w.untyped_storage().data_ptr() for w in model.rnn._flat_weights}
        x = torch.randn(_B, _T, _D, generator=torch.Generator().manual_seed(1)).cuda()
        for _ in range(4):
            opt.zero_grad()
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
        return model.state_dict(), storages

    (expected, _), (got, storages) = run(flatten=False), run(flatten=True)
    for name, v in expected.items():
        torch.testing.assert_close(got[name], v, rtol=0, atol=0, msg=name)
    assert not torch.equal(got["rnn.weight_ih_l0"], got["rnn.weight_ih_l0"].half().float())
    assert len(storages) == 1  # (initialize packed the cast weights into one cuDNN buffer)


def test_o3_sparse_embedding_trains_as_a_plain_half_model():
    # O3 fp16 (static scale 1.0, no overflow check): the sparse gradient with duplicate
    # indices reaches SGD as in a plain .half() model. amp coalesced it first, summing the
    # duplicates in another order: not bit for bit with .half().
    idx = torch.tensor([[1, 2, 2, 7], [7, 7, 3, 1]])

    def run(use_amp):
        torch.manual_seed(0)
        model = nn.Embedding(10, 4, sparse=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if use_amp:
            amp.initialize(model, opt, opt_level="O3", verbosity=0)
        else:
            model.half()
        for _ in range(3):
            opt.zero_grad()
            backward_and_step(model(idx).float().pow(2).sum(), opt, amp, use_amp)
        return model.weight.detach()

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=0)


class _EmbeddingsWithPadding(nn.Module):
    # padding_idx rows (Embedding, EmbeddingBag) and a weighted bag over flat indices.
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, _D, padding_idx=0)
        self.bag = nn.EmbeddingBag(20, _D, mode="mean", padding_idx=0)
        self.weighted = nn.EmbeddingBag(20, _D, mode="sum")
        self.head = nn.Linear(_D, 3)

    def forward(self, idx, flat, offsets, weights):
        h = self.embed(idx).mean(1) + self.bag(idx) + self.weighted(
            flat, offsets, per_sample_weights=weights)
        return self.head(h)


class _Recurrent(nn.Module):
    # The other recurrent layers: a 2-layer GRU (time-major), a relu RNN, and cells stepped in
    # a Python loop (LSTMCell, GRUCell).
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(_D, 6, num_layers=2)
        self.rnn = nn.RNN(6, 5, nonlinearity="relu", batch_first=True)
        self.lstm_cell = nn.LSTMCell(5, 4)
        self.gru_cell = nn.GRUCell(4, 4)

    def forward(self, x):
        h = self.rnn(self.gru(x.transpose(0, 1))[0].transpose(0, 1))[0]
        state, g = None, None
        for t in range(h.shape[1]):
            state = self.lstm_cell(h[:, t], state)
            g = self.gru_cell(state[0], g)
        return g


class _Containers(nn.Module):
    # Parameters held in a ParameterList and a ParameterDict, layers in a ModuleDict, a PReLU
    # and a Bilinear fed two half activations.
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"a": nn.Linear(_D, 6), "act": nn.PReLU(6)})
        self.plist = nn.ParameterList([nn.Parameter(torch.randn(6, 6) * 0.3),
                                       nn.Parameter(torch.zeros(6))])
        self.pdict = nn.ParameterDict({"scale": nn.Parameter(torch.ones(6))})
        self.bilinear = nn.Bilinear(6, _D, 3)

    def forward(self, x):
        h = self.layers["act"](self.layers["a"](x))
        h = (h @ self.plist[0] + self.plist[1]) * self.pdict["scale"]
        return self.bilinear(h, x)


class _AdaptiveSoftmax(nn.Module):
    # AdaptiveLogSoftmaxWithLoss: a head and a ModuleList of tail Sequentials, returning a
    # namedtuple (output, loss).
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(_D, _D)
        self.asm = nn.AdaptiveLogSoftmaxWithLoss(_D, 20, cutoffs=[5, 10], div_value=2.0)

    def forward(self, x, target):
        return self.asm(self.proj(x.mean(1)), target)


def _conv_norms():
    # Conv1d/Conv3d with their BatchNorms, a ConvTranspose2d into an InstanceNorm2d that
    # learns an affine transform and tracks running statistics (a half layer: only
    # _BatchNorm stays fp32).
    return nn.ModuleDict({
        "c1": nn.Sequential(nn.Conv1d(_D, 4, 3, padding=1), nn.BatchNorm1d(4), nn.ReLU()),
        "c3": nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.BatchNorm3d(2), nn.ReLU()),
        "ct": nn.Sequential(nn.ConvTranspose2d(2, 2, 4, stride=2, padding=1),
                            nn.InstanceNorm2d(2, affine=True, track_running_stats=True)),
    })


class _ConvNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = _conv_norms()

    def forward(self, x):
        h = self.m["c1"](x.transpose(1, 2))                    # (B, 4, T)
        v = self.m["c3"](h[:, None, :, :, None].expand(-1, -1, -1, -1, 2))  # (B, 2, 4, T, 2)
        return self.m["ct"](v.mean(-1))                        # (B, 2, 8, 2T)


class _FullTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(_D, 2, 1, 1, 16, dropout=0.0, batch_first=True)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.t(src, tgt, tgt_mask=mask)


_ZOO = {"embeddings": _EmbeddingsWithPadding, "recurrent": _Recurrent,
        "containers": _Containers, "adaptive_softmax": _AdaptiveSoftmax,
        "conv_norms": _ConvNorms, "transformer": _FullTransformer}


def _zoo_inputs(block, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(_B, _T, _D, generator=g)
    if block == "embeddings":
        idx = torch.randint(0, 20, (_B, _T), generator=g)
        idx[:, :2] = 0  # padding in every row
        return (idx, torch.randint(1, 20, (10,), generator=g), torch.tensor([0, 3, 3, 7]),
                torch.rand(10, generator=g))
    if block == "adaptive_softmax":
        return x, torch.randint(0, 20, (_B,), generator=g)
    if block == "transformer":
        return x, torch.randn(_B, 3, _D, generator=g)
    if block == "containers":
        return (x[:, 0],)
    return (x,)


def _zoo_loss(out):
    if isinstance(out, tuple) and hasattr(out, "loss"):  # AdaptiveLogSoftmaxWithLoss
        return out.loss.float()
    return out.float().pow(2).mean()


def _zoo_train(model, opt, block, steps, use_amp=True):
    return _train(model, opt, block, steps, use_amp, inputs_of=_zoo_inputs, loss_of=_zoo_loss)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("block", list(_ZOO))
def test_o2_trains_more_layer_kinds_like_fp32_with_fp32_checkpoints(block, dtype):
    """Layer kinds users train beyond the four real blocks above: Conv1d/Conv3d with
    BatchNorm1d/3d, ConvTranspose2d into a tracking affine InstanceNorm2d, Embedding and
    EmbeddingBag with padding_idx and per-sample weights, GRU/RNN and LSTM/GRU cells, PReLU,
    Bilinear, ParameterList/ParameterDict/ModuleDict, nn.Transformer with a causal mask, and
    AdaptiveLogSoftmaxWithLoss's namedtuple output. At O2 each trains as the fp32 model does,
    BatchNorm stays fp32 and nothing else does, the checkpoint is fp32 (integer buffers kept)
    and loads strictly into the plain model, and padding rows stay exactly zero."""
    torch.manual_seed(0)
    reference = _ZOO[block]()
    ref_losses = _zoo_train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), block,
                            3, use_amp=False)
    torch.manual_seed(0)
    model = _ZOO[block]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = 128.0 if dtype == torch.float16 else None  # (no skipped step: every step compares)
    amp.initialize(model, opt, opt_level="O2", dtype=dtype, loss_scale=scale, verbosity=0)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point():
            in_bn = isinstance(model.get_submodule(name.rpartition(".")[0]),
                               nn.modules.batchnorm._BatchNorm)
            assert t.dtype == (torch.float32 if in_bn else dtype), name
    losses = _zoo_train(model, opt, block, 3)
    # A few roundings per layer through at most ~6 layers. Measured over these blocks: 8.9e-4
    # (fp16) and 6.2e-3 (bf16) relative at most; the bounds leave about 3x.
    rtol = 3e-3 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=1e-4)
    state, ref_state = model.state_dict(), reference.state_dict()
    assert list(state) == list(ref_state)
    for k, v in state.items():
        assert v.dtype == ref_state[k].dtype, k  # fp32, and int64 num_batches_tracked
    plain = _ZOO[block]()
    plain.load_state_dict(state, strict=True)
    if block == "embeddings":
        for key in ("embed.weight", "bag.weight"):
            assert torch.equal(state[key][0], torch.zeros(_D)), key
