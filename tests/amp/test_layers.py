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

from .helpers import HALF_DTYPES, backward_and_step, cpu_autocast_lstm_error

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


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_casts_groupnorm_to_half_and_it_normalises_like_float64(dtype):
    # The README's table: at O2 only BatchNorm stays fp32; a GroupNorm (UNets, diffusion models)
    # is cast to half with the rest. Its statistics are still accurate on an input whose mean is
    # large against its spread: the output is within 4 half ulps (relative to its largest value)
    # of float64 GroupNorm on the same half input.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(2, 8))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.5, 0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0)
    norm = model[1]
    assert norm.weight.dtype == dtype and norm.bias.dtype == dtype
    x = (16.0 + torch.randn(4, 8, 6, 6)).to(dtype)
    with torch.no_grad():
        got = norm(x)
        ref = nn.functional.group_norm(x.double(), 2, norm.weight.double(), norm.bias.double(),
                                       norm.eps)
    assert got.dtype == dtype
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    assert (got.double() - ref).abs().max() <= 4 * ulp * ref.abs().max()


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


class _TiedLM(nn.Module):
    # word_language_model's shape: an embedding with a padding row, a 2-layer LSTM with dropout
    # between its layers, a decoder tied to the embedding; flatten_parameters() in the forward.
    # Its hidden state goes in and comes out as an argument and an output (TBPTT).
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, _D, padding_idx=0)
        self.rnn = nn.LSTM(_D, _D, 2, dropout=0.2)
        self.decoder = nn.Linear(_D, 20)
        self.decoder.weight = self.embed.weight
        self.seen = []  # the hidden state's dtypes inside the forward

    def forward(self, tokens, hidden):
        self.seen.append((hidden[0].dtype, hidden[1].dtype))
        self.rnn.flatten_parameters()
        out, hidden = self.rnn(self.embed(tokens), hidden)
        return self.decoder(out), hidden


def _lm_tokens(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(1, 20, (_T + 1, _B), generator=g)


def _tbptt(model, opt, steps, *, mode="amp", hidden=None, first=0):
    """TBPTT: the returned hidden state, detached, goes into the next step's forward.
    ``mode``: "amp", "autocast" (bf16, fp32 model) or a dtype (a plain half model)."""
    if hidden is None:
        hidden = (torch.zeros(2, _B, _D), torch.zeros(2, _B, _D))
        if isinstance(mode, torch.dtype):
            hidden = tuple(h.to(mode) for h in hidden)
    losses, returned = [], []
    for step in range(first, first + steps):
        data = _lm_tokens(step)
        hidden = tuple(h.detach() for h in hidden)
        opt.zero_grad()
        if mode == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits, hidden = model(data[:-1], hidden)
        else:
            logits, hidden = model(data[:-1], hidden)
        returned.append((hidden[0].dtype, hidden[1].dtype))
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 20), data[1:].reshape(-1))
        if mode == "amp":
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.25)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), hidden, returned


def _tied_lm(opt_level=None, dtype=torch.bfloat16, **kw):
    torch.manual_seed(0)
    model = _TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0, weight_decay=1e-4)
    if opt_level is not None:
        amp.initialize(model, opt, opt_level=opt_level, dtype=dtype, verbosity=0, **kw)
    return model, opt


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_a_carried_lstm_hidden_state_leaves_fp32_and_enters_in_the_models_dtype(opt_level):
    # Truncated BPTT carries the hidden state the model returned into its next forward. It
    # comes out fp32 at every level (amp's output cast) and goes in as fp32 at O1 (autocast
    # casts it per op) and as the model's half dtype at O2/O3 (amp's input cast, lossless for
    # an upcast half state). O1 equals torch.autocast carrying its own bf16 state, and O3 a
    # plain .bfloat16() model carrying a bf16 state, bit for bit (dropout included).
    if opt_level == "O1" and cpu_autocast_lstm_error():
        pytest.skip(f"PyTorch's LSTM under CPU bf16 autocast fails on this CPU: "
                    f"{cpu_autocast_lstm_error()}")
    model, opt = _tied_lm(opt_level)
    torch.manual_seed(1)
    losses, hidden, returned = _tbptt(model, opt, 3)
    assert returned == [(torch.float32, torch.float32)] * 3
    inside = torch.float32 if opt_level == "O1" else torch.bfloat16
    assert model.seen == [(inside, inside)] * 3
    if opt_level == "O2":
        # The tied weight has one master, saved under both names, with fp32 values.
        state = model.state_dict()
        assert len(list(amp.master_params(opt))) == len(list(model.parameters()))
        assert torch.equal(state["embed.weight"], state["decoder.weight"])
        assert not torch.equal(state["embed.weight"], state["embed.weight"].bfloat16().float())
        return
    if opt_level == "O1":
        reference, ref_opt = _tied_lm()
        mode = "autocast"
    else:
        reference, ref_opt = _tied_lm()
        reference.bfloat16()
        mode = torch.bfloat16
    torch.manual_seed(1)
    ref_losses, ref_hidden, _ = _tbptt(reference, ref_opt, 3, mode=mode)
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0)
    torch.testing.assert_close(hidden[0], ref_hidden[0].float(), rtol=0, atol=0)
    for (name, v), w in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(v, w.float(), rtol=0, atol=0, msg=name)


def test_o2_tied_lstm_lm_with_packing_resumes_mid_run_with_its_hidden_state_bit_for_bit(
        monkeypatch):
    # A checkpoint taken mid-run (model, optimizer, amp's scaler, the RNG, and the carried
    # hidden state, which is fp32) resumes bit for bit, fp16 with the dynamic scale, while
    # flatten_parameters() packs the weights at every forward (simulated cuDNN packing), and
    # the run with packing equals the one without.
    import io

    def run(pack, resume):
        if pack:
            _pack_on_the_cpu(monkeypatch)
        else:
            monkeypatch.undo()
        model, opt = _tied_lm("O2", torch.float16)
        torch.manual_seed(1)
        losses, hidden, _ = _tbptt(model, opt, 2)
        if resume:
            saved = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "amp": amp.state_dict(), "rng": torch.get_rng_state(),
                        "hidden": hidden}, saved)
            saved.seek(0)
            ckpt = torch.load(saved, weights_only=False)
            assert ckpt["hidden"][0].dtype == torch.float32
            model, opt = _tied_lm("O2", torch.float16)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            amp.load_state_dict(ckpt["amp"])
            torch.set_rng_state(ckpt["rng"])
            hidden = ckpt["hidden"]
        more, _, _ = _tbptt(model, opt, 2, hidden=hidden, first=2)
        return torch.cat([losses, more]), model.state_dict()

    want_losses, want = run(pack=False, resume=False)
    for pack, resume in [(True, False), (True, True)]:
        losses, got = run(pack, resume)
        torch.testing.assert_close(losses, want_losses, rtol=0, atol=0)
        for name, v in want.items():
            torch.testing.assert_close(got[name], v, rtol=0, atol=0, msg=name)
    assert not torch.equal(want["rnn.weight_hh_l1"], want["rnn.weight_hh_l1"].half().float())


class _UnsortedPackedGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(_D, 6, batch_first=True, bidirectional=True)

    def forward(self, packed, h0=None):
        self.seen = (type(packed), packed.data.dtype, h0.dtype)
        return self.rnn(packed, h0)


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_an_unsorted_packed_sequence_goes_in_and_comes_out_with_its_indices(opt_level):
    # pack_padded_sequence(..., enforce_sorted=False) carries sorted/unsorted indices beside
    # batch_sizes: amp's input cast casts only the data (and the hidden state given by
    # keyword), and the output cast gives back a PackedSequence with fp32 data and the same
    # integer fields, which pad_packed_sequence restores to the original order.
    from torch.nn.utils.rnn import PackedSequence

    x = torch.randn(_B, _T, _D, generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([3, 6, 1, 4])
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    h0 = torch.randn(2, _B, 6, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    reference = _UnsortedPackedGRU()
    torch.manual_seed(0)
    model = _UnsortedPackedGRU()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level,
                   dtype=torch.bfloat16, verbosity=0)
    out, h = model(packed, h0=h0)
    inside = torch.float32 if opt_level == "O1" else torch.bfloat16
    assert model.seen == (PackedSequence, inside, inside)
    assert type(out) is PackedSequence and out.data.dtype == torch.float32
    assert h.dtype == torch.float32
    for field in ("batch_sizes", "sorted_indices", "unsorted_indices"):
        assert torch.equal(getattr(out, field), getattr(packed, field)), field
        assert getattr(out, field).dtype == torch.int64
    padded, got_lengths = pad_packed_sequence(out, batch_first=True)
    want, _ = pad_packed_sequence(reference(packed, h0)[0], batch_first=True)
    assert torch.equal(got_lengths, lengths)
    # bf16 through one bidirectional layer of 6 steps: measured 5e-3 (O1, CPU autocast runs
    # the GRU's matmuls in bf16), 8e-3 (O2), 1e-2 (O3); the bound leaves 3x.
    torch.testing.assert_close(padded, want, rtol=0, atol=3e-2)


class _CTCNet(nn.Module):
    # A speech front end: Conv1d + BatchNorm1d, a bidirectional LSTM over packed frames,
    # log-probabilities; CTCLoss(zero_infinity=True) inside the forward when asked.
    def __init__(self, loss_inside):
        super().__init__()
        self.conv = nn.Conv1d(_D, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.lstm = nn.LSTM(8, 8, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(16, 5)
        self.loss_inside = loss_inside

    def forward(self, x, lengths, targets, target_lengths):
        h = torch.relu(self.bn(self.conv(x))).transpose(1, 2)
        self.lstm.flatten_parameters()
        out, _ = self.lstm(pack_padded_sequence(h, lengths, batch_first=True,
                                                enforce_sorted=False))
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[-1])
        log_probs = self.fc(out).log_softmax(-1).transpose(0, 1)
        if self.loss_inside:
            return nn.functional.ctc_loss(log_probs, targets, lengths, target_lengths,
                                          zero_infinity=True)
        return log_probs


def _ctc_batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(_B, _D, 10, generator=g)
    # The last utterance cannot hold its 5 labels in 2 frames: an infinite loss, zeroed.
    return (x, torch.tensor([10, 8, 6, 2]), torch.randint(1, 5, (_B, 5), generator=g),
            torch.tensor([3, 2, 2, 5]))


def _ctc_train(model, opt, steps, mode):
    losses = []
    for step in range(steps):
        x, lengths, targets, target_lengths = _ctc_batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            out = model(x, lengths, targets, target_lengths)
            loss = out if model.loss_inside else nn.functional.ctc_loss(
                out, targets, lengths, target_lengths, zero_infinity=True)
        assert loss.dtype == torch.float32
        if mode == "amp":
            assert out.dtype == torch.float32  # (log-probs or the loss: fp32 out of the model)
        backward_and_step(loss, opt, amp, use_amp=mode == "amp")
        losses.append(loss.detach())
    return torch.stack(losses)


def _ctc_net(loss_inside, opt_level=None):
    torch.manual_seed(0)
    model = _CTCNet(loss_inside)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    if opt_level is not None:
        amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    return model, opt


@pytest.mark.parametrize("loss_inside", [False, True])
def test_ctc_model_at_o1_is_autocast_and_at_o2_trains_like_fp32(loss_inside):
    # O1: CTC loss in fp32 (autocast's fp32 list) inside the forward or after it, bit for bit
    # with torch.autocast. O2 (loss after the model, which hands out fp32 log-probs): close to
    # fp32, BatchNorm1d and its running statistics fp32, and zero_infinity's zeroed
    # utterance leaves everything finite.
    model, opt = _ctc_net(loss_inside, "O1")
    reference, ref_opt = _ctc_net(loss_inside)
    torch.testing.assert_close(_ctc_train(model, opt, 3, "amp"),
                               _ctc_train(reference, ref_opt, 3, "autocast"), rtol=0, atol=0)
    for (name, v), w in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(v, w, rtol=0, atol=0, msg=name)
    if loss_inside:
        return
    model, opt = _ctc_net(False, "O2")
    fp32, fp32_opt = _ctc_net(False)
    losses = _ctc_train(model, opt, 3, "amp")
    # bf16 activations, fp32 masters: measured 2.5e-4 relative at most; the bound leaves ~20x.
    torch.testing.assert_close(losses, _ctc_train(fp32, fp32_opt, 3, "fp32"), rtol=5e-3,
                               atol=0)
    assert model.bn.weight.dtype == model.bn.running_var.dtype == torch.float32
    assert model.lstm.weight_ih_l0.dtype == torch.bfloat16
    assert all(torch.isfinite(v).all() for v in model.state_dict().values()
               if v.is_floating_point())


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


class _Rotary(nn.Module):
    def __init__(self, head_dim=16, base=10000.0):
        super().__init__()
        self.lin = nn.Linear(head_dim, head_dim)
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x, pos):
        f = torch.outer(pos.float(), self.inv_freq.float())
        x = self.lin(x).float()
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.cat([x1 * f.cos() - x2 * f.sin(), x1 * f.sin() + x2 * f.cos()], -1)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_rope_inv_freq_registered_after_initialize_stays_fp32(dtype):
    # README: O2 casts floating buffers, a RoPE inv_freq too (rounded, absent from the
    # state dict as non-persistent); registered again after initialize it stays fp32 through
    # forward, step, state_dict, a device move and a deep copy. Reference: the fp32 table.
    torch.manual_seed(0)
    model = _Rotary()
    exact = model.inv_freq.clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0)
    assert model.inv_freq.dtype == dtype and not torch.equal(model.inv_freq.float(), exact)
    assert "inv_freq" not in model.state_dict()
    model.register_buffer("inv_freq", exact.clone(), persistent=False)
    pos = torch.arange(100, 108)
    for _ in range(2):
        loss = model(torch.randn(8, 16), pos).square().mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    model.to("cpu")
    for m in (model, copy.deepcopy(model)):
        assert m.inv_freq.dtype == torch.float32 and torch.equal(m.inv_freq, exact)
        assert "inv_freq" not in m.state_dict()
