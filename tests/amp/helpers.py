"""Small models and training steps shared by the amp tests."""

import functools
import io

import torch
from torch import nn

HALF_DTYPES = [torch.float16, torch.bfloat16]
OPT_LEVELS = ["O0", "O1", "O2", "O3"]


class SmallCNN(nn.Module):
    """Conv-BN-ReLU x2 and a linear head: the shape of the seed's fine-tuning model."""

    def __init__(self, classes=4, width=8):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        )
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x):
        return self.head(self.features(x))


class EmbeddingHead(nn.Module):
    """``Embedding(vocab, dim, max_norm=1.0)`` then ``Linear(dim, out)``: an embedding whose
    forward renormalises the rows it looks up, in place."""

    def __init__(self, vocab, dim, out):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, max_norm=1.0)
        self.head = nn.Linear(dim, out)

    def forward(self, idx):
        return self.head(self.embed(idx))


def make_cnn(device="cpu", seed=0, **kw):
    torch.manual_seed(seed)
    return SmallCNN(**kw).to(device)


def make_mlp(seed=0):
    """``Linear(4, 8), ReLU, Linear(8, 2)`` in fp32, seeded: no BatchNorm."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def make_conv_net(seed=0):
    """``Conv2d(3, 4, 3)`` for 8x8 inputs, then a linear head, in fp32, seeded: no BatchNorm."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))


def batch(device="cpu", n=16, seed=1, size=8, classes=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x.to(device), y.to(device)


def scaled_backward(loss, optimizer, amp, use_amp=True):
    """``loss.backward()``, inside ``amp.scale_loss(loss, optimizer)`` with ``use_amp`` (the
    plain one is the fp32 or float64 reference's)."""
    if use_amp:
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
    else:
        loss.backward()


def backward_and_step(loss, optimizer, amp, use_amp=True):
    """:func:`scaled_backward`, then the step."""
    scaled_backward(loss, optimizer, amp, use_amp)
    optimizer.step()


def train_step(model, optimizer, x, y, amp):
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    return loss.detach()


def mse_step(model, optimizer, amp, compiled=False):
    """A whole amp training step on an MSE loss, ``step(x, y) -> loss`` (the step, then
    ``zero_grad``), ``torch.compile``d with the eager backend if asked."""
    def step(x, y):
        loss = ((model(x).float() - y) ** 2).mean()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return torch.compile(step, backend="eager") if compiled else step


def check_conversion_after_initialize(convert, layer_type, dtype):
    """A Conv-BatchNorm-ReLU converted by ``convert`` (``convert_fused_batchnorm``,
    ``convert_syncbn_model``) after ``amp.initialize`` at O1 with ``keep_batchnorm_fp32``
    against the same model converted before it: the new layer is a ``layer_type`` that keeps
    amp's fp32 forward, and outputs, gradients and running statistics agree bit for bit (one
    process). Returns the model converted after."""
    from mixprec import amp
    from mixprec.amp._model import is_amp_model

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())

    kwargs = dict(opt_level="O1", keep_batchnorm_fp32=True, dtype=dtype, verbosity=0)
    before = amp.initialize(convert(build()), **kwargs)
    after = convert(amp.initialize(build(), **kwargs))
    assert isinstance(after[1], layer_type) and is_amp_model(after[1]), type(after[1]).__mro__
    x = torch.randn(2, 3, 6, 6)
    want, got = before(x), after(x)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name in ("weight", "running_mean", "running_var"):
        ours, ref = getattr(after[1], name), getattr(before[1], name)
        torch.testing.assert_close(ours, ref, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(after[1].weight.grad, before[1].weight.grad, rtol=0, atol=0)
    return after


def saved_whole(model):
    """``model`` through ``torch.save`` of the whole object and ``torch.load`` back (a model
    saved whole, as scripts ship a trained model)."""
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


class TinyDecoder(nn.Module):
    """One pre-norm decoder block of a GPT: token + learned position embeddings, causal SDPA
    attention with dropout, a SwiGLU MLP, a final norm, and an output head tied to the token
    embedding. ``norm`` builds the norm layers (``FusedRMSNorm``, ``nn.RMSNorm``, ...);
    ``ckpt`` None, or the ``use_reentrant`` value to run the block under
    ``torch.utils.checkpoint``."""

    def __init__(self, norm, vocab=16, dim=16, heads=2, seq=8, dropout=0.1, ckpt=None):
        super().__init__()
        self.heads, self.dropout, self.ckpt = heads, dropout, ckpt
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.n1, self.n2, self.nf = norm(dim), norm(dim), norm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.drop = nn.Dropout(dropout)

    def block(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        h = self.n2(x)
        return x + self.drop(self.w2(nn.functional.silu(self.w1(h)) * self.w3(h)))

    def forward(self, idx):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        if self.ckpt is None or not self.training:
            x = self.block(x)
        else:
            from torch.utils.checkpoint import checkpoint

            x = checkpoint(self.block, x, use_reentrant=self.ckpt)
        return self.head(self.nf(x))


def decay_groups(model, weight_decay=0.1):
    """GPT-style weight-decay groups by name: matrices decay; norms, biases and embeddings
    (the tied head among them, listed once) do not."""
    decay, rest, seen = [], [], set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            (decay if p.ndim >= 2 and not name.startswith(("tok", "pos")) else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def token_batch(seed, n=2, seq=8, vocab=16):
    """Token ids and next-token targets (a learnable ``7 * t + 3`` chain), seeded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq + 1), generator=g)
    for t in range(seq):
        ids[:, t + 1] = (ids[:, t] * 7 + 3) % vocab
    return ids[:, :-1], ids[:, 1:]


@functools.cache
def cpu_autocast_lstm_error():
    """PyTorch's own error for an ``nn.LSTM`` under CPU bf16 autocast on this CPU, or None.
    oneDNN's low-precision LSTM needs instructions some CPUs lack (an AMD EPYC without
    AVX-512: "could not create a primitive descriptor for the LSTM forward propagation
    primitive"), with or without amp."""
    lstm = nn.LSTM(4, 4)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lstm(torch.randn(2, 1, 4))
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None
