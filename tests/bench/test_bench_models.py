"""The benchmark's models: shapes, causality, the norm hook, the large GPT's size."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.bench.models import GPT, GPTConfig, SmallCNN, build_workload, gpt_config


def test_small_cnn_shapes_and_batchnorm():
    model = SmallCNN(width=4)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 3
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = GPT(gpt_config("small")).eval()
    tokens = torch.randint(0, 512, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 512
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 16, 512)
    # Positions before the change see the same prefix: identical logits.
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    # A sequence shorter than seq_len (16 of 64 here) takes positions 0..t-1: the first ten
    # tokens alone give the logits they have at the start of the longer sequence.
    with torch.no_grad():
        short = model(tokens[:, :10])
    torch.testing.assert_close(short, a[:, :10], rtol=1e-5, atol=1e-6)


def test_gpt_large_config_matches_the_benchmark():
    cfg = GPTConfig()
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len, cfg.vocab_size) == (
        1024,
        12,
        16,
        1024,
        32000,
    )
    with torch.device("meta"):  # no memory, no init cost
        model = GPT(cfg)
    d, v, t, h = 1024, 32000, 1024, 4096
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
    expected = v * d + t * d + 12 * block + 2 * d + v * d  # untied head
    assert sum(p.numel() for p in model.parameters()) == expected


def test_gpt_norm_cls_is_pluggable():
    made = []

    class MyNorm(nn.LayerNorm):
        def __init__(self, width):
            super().__init__(width, eps=1e-6)
            made.append(width)

    model = GPT(gpt_config("small"), norm_cls=MyNorm)
    assert made == [64] * (2 * 2 + 1)  # two per block, plus the final norm
    assert isinstance(model.ln_f, MyNorm)


def test_gpt_tied_weights():
    model = GPT(
        GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2, tie_weights=True)
    )
    assert model.head.weight is model.tok_emb.weight


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"d_model": 10, "n_heads": 3}, "n_heads must divide d_model"),
        # The hint names a head count that divides d_model (their gcd), not another miss.
        ({"d_model": 64, "n_heads": 6}, r"n_heads must divide d_model; pick e\.g\. n_heads=2\."),
        ({"d_model": 96, "n_heads": 64}, r"pick e\.g\. n_heads=32\."),
        ({"n_layers": 0}, "n_layers"),
    ],
)
def test_gpt_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_gpt_config_refuses_a_tie_weights_that_is_not_a_bool(value):
    """tie_weights is True or False: "no" (truthy) tied the head to the embedding and 0 / None
    untied it, each silently; now each is refused naming the value."""
    with pytest.raises(TypeError, match=rf"GPTConfig\(tie_weights={value!r}\): must be True "
                                        r"or False"):
        GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2, tie_weights=value)


def test_gpt_rejects_too_long_sequences():
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2))
    with pytest.raises(ValueError, match="exceeds config.seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_workloads_are_deterministic_and_learnable():
    a = build_workload("cnn", batch_size=4, seed=3)
    b = build_workload("cnn", batch_size=4, seed=3)
    for (xa, ya), (xb, yb) in zip(a.batches, b.batches):
        torch.testing.assert_close(xa, xb, rtol=0, atol=0)
        torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    torch.manual_seed(1)
    m1 = a.build_model()
    torch.manual_seed(1)
    m2 = b.build_model()
    for p1, p2 in zip(m1.state_dict().values(), m2.state_dict().values()):
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)
    # fp32 training on the synthetic data lowers the loss.
    opt = a.build_optimizer(m1.parameters(), torch.device("cpu"))
    losses = []
    for i in range(30):
        x, y = a.batches[i % len(a.batches)]
        opt.zero_grad()
        loss = a.loss_fn(m1(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4])


def test_gpt_workload_targets_are_shifted_inputs():
    wl = build_workload("gpt", batch_size=2, num_batches=1)
    x, y = wl.batches[0]
    assert x.shape == y.shape == (2, 64)
    torch.testing.assert_close(x[:, 1:], y[:, :-1], rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "vgg"}, "name must be one of"),
        ({"size": "huge"}, "size must be one of"),
        ({"batch_size": 0}, "batch_size"),
        ({"name": "gpt", "optimizer": "lamb"}, "optimizer must be one of"),
        ({"name": "resnet50", "optimizer": "mixprec"}, "train with SGD"),
    ],
)
def test_build_workload_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_workload(**kwargs)


def test_fused_batchnorm_workloads():
    from mixprec.normalization import FusedBatchNorm

    wl = build_workload("cnn", batch_size=4, fused_batchnorm=True)
    model = wl.build_model()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert bns and all(type(m) is FusedBatchNorm for m in bns)
    assert "FusedBatchNorm" in wl.description
    x, y = wl.batches[0]
    assert wl.loss_fn(model(x), y).isfinite()
    with pytest.raises(ValueError, match="GPT has no BatchNorm"):
        build_workload("gpt", fused_batchnorm=True)


def test_gpt_workload_with_mixprec_optimizer():
    """optimizer="mixprec": FusedAdam with the AdamW settings of the default workload, the same
    update (to fp32 rounding) on the same model and data."""
    from mixprec.optimizers import FusedAdam

    steps = []
    for optimizer in ("torch", "mixprec"):
        wl = build_workload("gpt", batch_size=2, num_batches=1, optimizer=optimizer)
        torch.manual_seed(0)
        model = wl.build_model()
        opt = wl.build_optimizer(model.parameters(), torch.device("cpu"))
        x, y = wl.batches[0]
        for _ in range(2):
            opt.zero_grad()
            wl.loss_fn(model(x), y).backward()
            opt.step()
        steps.append((model, opt, wl.description))
    (ref, ref_opt, _), (ours, opt, desc) = steps
    assert isinstance(opt, FusedAdam) and type(ref_opt) is torch.optim.AdamW
    assert "FusedAdam" in desc
    assert opt.defaults["adam_w_mode"] and opt.defaults["weight_decay"] == 0.1
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs", [
    {"d_model": 64.0, "n_heads": 4}, {"n_layers": True},
    *({name: 0} for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads",
                             "mlp_ratio"))])
def test_gpt_config_refuses_sizes_that_are_not_ints_of_at_least_1(kwargs):
    # A bool is no size: n_layers=True would build one layer (as build_workload and run_mode
    # refuse True for their counts). A zero is refused for every size, the MLP ratio (an MLP
    # of width 0) as the layer count.
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=rf"GPTConfig\({name}={value!r}\): must be an int >= 1"):
        GPTConfig(**kwargs)


def test_gpt_small_config_is_the_documented_one():
    cfg = gpt_config("small")
    assert (cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.n_layers, cfg.n_heads,
            cfg.mlp_ratio) == (512, 64, 64, 2, 4, 4)
    wl = build_workload("gpt", batch_size=1, num_batches=1)
    assert "GPT(d_model=64, layers=2, heads=4, seq=64, vocab=512" in wl.description


def test_gpt_initialisation_is_normal_0_02_with_zero_biases():
    torch.manual_seed(0)
    model = GPT(gpt_config("small"))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(not m.bias.any() for m in linears if m.bias is not None)
    w = model.tok_emb.weight.detach()  # 32768 samples: the std is known to about 1e-4
    assert abs(w.std().item() - 0.02) < 1e-3 and abs(w.mean().item()) < 1e-3
    # Every Linear weight too (>= 4096 samples: the std to about 3e-4; PyTorch's default
    # uniform init gives 0.04 to 0.07 here), and every LayerNorm starts as the identity.
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            w = m.weight.detach()
            assert abs(w.std().item() - 0.02) < 2e-3 and abs(w.mean().item()) < 2e-3, name
        if isinstance(m, nn.LayerNorm):
            assert torch.equal(m.weight, torch.ones_like(m.weight)), name
            assert torch.equal(m.bias, torch.zeros_like(m.bias)), name


def test_gpt_mlp_width_is_mlp_ratio_times_d_model():
    # The documented knob, for a ratio other than the default 4 too.
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2, mlp_ratio=2)
    fc1, _, fc2 = GPT(cfg).blocks[0].mlp
    assert (fc1.in_features, fc1.out_features) == (16, 32)
    assert (fc2.in_features, fc2.out_features) == (32, 16)


def test_gpt_blocks_are_pre_ln_residual_blocks():
    # x + attn(ln1(x)), then + mlp(ln2(.)): the residual stream itself is not normalised.
    torch.manual_seed(0)
    block = GPT(gpt_config("small")).eval().blocks[0]
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        h = x + block.attn(block.ln1(x))
        expected = h + block.mlp(block.ln2(h))
        torch.testing.assert_close(block(x), expected, rtol=1e-6, atol=1e-6)


def test_classification_loss_of_a_half_output_is_computed_in_fp32():
    # Every recipe's loss must be the same quantity: a bf16 output (pure .bfloat16(), O3) gets
    # an fp32 log-softmax, not a bf16 one.
    wl = build_workload("cnn", batch_size=4, num_batches=1)
    _, y = wl.batches[0]
    torch.manual_seed(0)
    out = torch.randn(4, 10).bfloat16()
    loss = wl.loss_fn(out, y)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(out.float(), y),
                               rtol=0, atol=0)


def test_image_batches_are_learnable_from_their_class_means():
    # Each class has its own mean image plus noise: class means taken from one batch tell the
    # labels of the next (nearest mean), far above chance (0.1).
    wl = build_workload("cnn", batch_size=256, num_batches=2)
    (x0, y0), (x1, y1) = wl.batches
    means = torch.stack([x0[y0 == c].mean(0) for c in range(10)]).flatten(1)
    predicted = torch.cdist(x1.flatten(1), means).argmin(1)
    assert (predicted == y1).float().mean().item() > 0.9


@pytest.mark.parametrize("kwargs", [{"batch_size": 2.5}, {"batch_size": True},
                                    {"num_batches": 2.5}, {"num_batches": True}])
def test_build_workload_refuses_counts_that_are_not_ints(kwargs):
    # (num_batches=2.5 failed later, with a TypeError from range(); True read as 1.)
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=rf"build_workload\({name}={value!r}\): must be an int >= 1"):
        build_workload("cnn", **kwargs)


def test_workload_seed_picks_the_data():
    a = build_workload("cnn", batch_size=4, seed=0)
    b = build_workload("cnn", batch_size=4, seed=1)
    assert not torch.equal(a.batches[0][0], b.batches[0][0])
    g0 = build_workload("gpt", batch_size=1, num_batches=1, seed=0)
    g1 = build_workload("gpt", batch_size=1, num_batches=1, seed=1)
    assert not torch.equal(g0.batches[0][0], g1.batches[0][0])
    # The data has a generator of its own: building a workload neither draws from nor
    # reseeds torch's global RNG (which seeds the weights), and the seed alone picks it.
    for name in ("cnn", "gpt"):
        torch.manual_seed(123)
        before = torch.get_rng_state()
        a = build_workload(name, batch_size=2, num_batches=1, seed=5)
        assert torch.equal(torch.get_rng_state(), before), name
        torch.manual_seed(456)
        b = build_workload(name, batch_size=2, num_batches=1, seed=5)
        assert torch.equal(a.batches[0][0], b.batches[0][0]), name


def test_gpt_adamw_is_fused_by_default_on_cuda_only():
    wl = build_workload("gpt", batch_size=1, num_batches=1)
    params = [nn.Parameter(torch.zeros(2))]
    assert not wl.build_optimizer(params, torch.device("cpu")).defaults.get("fused")
    assert wl.build_optimizer(params, torch.device("cuda")).defaults["fused"] is True
    off = build_workload("gpt", batch_size=1, num_batches=1, fused_adamw=False)
    assert not off.build_optimizer(params, torch.device("cuda")).defaults.get("fused")
    # Asked for, it is fused wherever it runs (PyTorch has a fused CPU AdamW).
    on = build_workload("gpt", batch_size=1, num_batches=1, fused_adamw=True)
    assert on.build_optimizer(params, torch.device("cpu")).defaults["fused"] is True


@pytest.mark.parametrize("kwargs", [
    {"width": 0}, {"num_classes": 0}, {"in_channels": 0}, {"width": 2.5},
    {"in_channels": 3.0}, {"num_classes": True}])
def test_small_cnn_refuses_sizes_that_are_not_ints_of_at_least_1(kwargs):
    """SmallCNN needs at least one channel and one class, each a whole number: a zero is an
    error naming the argument, not a model with empty layers (in_channels=0 built a model no
    input could pass through); a float width was PyTorch's error from inside Conv2d, and a
    bool would read as 1, as GPTConfig refuses them. (M01)"""
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=rf"SmallCNN\({name}={value!r}\): must be an int >= 1"):
        SmallCNN(**kwargs)


def test_small_cnn_takes_its_channels_and_classes():
    """in_channels and num_classes are honoured (1-channel images in, 5 logits out)."""
    model = SmallCNN(num_classes=5, width=4, in_channels=1)
    assert model.features[0].in_channels == 1
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 5)


def test_small_cnn_matches_its_documented_architecture():
    """SmallCNN is conv(3->w)-BN-ReLU, conv(w->2w, stride 2)-BN-ReLU, conv(2w->2w, stride
    2)-BN-ReLU, global average pooling, linear; bias-free convs (BatchNorm follows). Checked
    against the same computation written with torch.nn.functional, in eval mode. (M02, M03,
    M04, M05)"""
    torch.manual_seed(0)
    model = SmallCNN(width=4).eval()
    convs = [m for m in model.features if isinstance(m, nn.Conv2d)]
    bns = [m for m in model.features if isinstance(m, nn.BatchNorm2d)]
    assert [tuple(c.weight.shape) for c in convs] == [(4, 3, 3, 3), (8, 4, 3, 3), (8, 8, 3, 3)]
    assert all(c.bias is None for c in convs)
    assert model.classifier.in_features == 8
    for bn in bns:  # non-trivial statistics, so BatchNorm's place in the graph matters
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 16, 16)
    h = x
    for conv, bn, stride in zip(convs, bns, (1, 2, 2)):
        h = F.conv2d(h, conv.weight, None, stride=stride, padding=1)
        h = F.relu(F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                training=False, eps=bn.eps))
    assert h.shape == (2, 8, 4, 4)
    expected = F.linear(h.mean((2, 3)), model.classifier.weight, model.classifier.bias)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)


def test_gpt_config_rejects_an_unknown_size():
    """gpt_config knows "small" and "large" only: any other size is an error listing them,
    not silently the large model. (M10)"""
    with pytest.raises(ValueError, match=r"gpt_config\(size='huge'\): size must be one of"):
        gpt_config("huge")


def test_gpt_forward_matches_a_float64_reference():
    """The GPT is token + learned position embeddings, pre-LN blocks of causal multi-head
    attention (heads are contiguous d_model/n_heads slices, softmax(q k^T / sqrt(d_head))) and
    a GELU MLP, then the final LayerNorm and the bias-free head: checked against that
    computation written out in float64. (M11, M13, M14, M15, M39)"""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4)
    model = GPT(cfg).eval()
    for p in model.parameters():  # LayerNorm's ones/zeros and zero biases would hide mistakes
        p.data.add_(0.05 * torch.randn_like(p))
    tokens = torch.randint(0, 32, (2, 8))
    d, nh, t = 16, 4, 8
    dh = d // nh

    def w(p):
        return None if p is None else p.detach().double()

    def ln(mod, h):
        return F.layer_norm(h, (d,), w(mod.weight), w(mod.bias), mod.eps)

    def attention(blk, h):
        q, k, v = F.linear(h, w(blk.attn.qkv.weight), w(blk.attn.qkv.bias)).split(d, dim=-1)
        q, k, v = (z.reshape(2, t, nh, dh).permute(0, 2, 1, 3) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(dh)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(2, t, d)
        return F.linear(y, w(blk.attn.proj.weight), w(blk.attn.proj.bias))

    def mlp(blk, h):
        fc1, fc2 = blk.mlp[0], blk.mlp[2]
        return F.linear(F.gelu(F.linear(h, w(fc1.weight), w(fc1.bias))), w(fc2.weight),
                        w(fc2.bias))

    x = w(model.tok_emb.weight)[tokens] + w(model.pos_emb.weight)[:t]
    for blk in model.blocks:
        x = x + attention(blk, ln(blk.ln1, x))
        x = x + mlp(blk, ln(blk.ln2, x))
    expected = F.linear(ln(model.ln_f, x), w(model.head.weight))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"config": {"d_model": 64}}, r"GPT\(config=dict\): expected a GPTConfig"),
        ({"norm_cls": 3}, r"GPT\(norm_cls=3\): expected a callable taking the width"),
    ],
)
def test_gpt_argument_type_errors(kwargs, match):
    """GPT refuses a config that is not a GPTConfig and a norm_cls that is not callable with
    a TypeError naming the argument. (M20, M21)"""
    with pytest.raises(TypeError, match=match):
        GPT(**kwargs)


def test_lm_loss_of_a_half_output_is_computed_in_fp32():
    """The GPT's loss, like the classifier's, is an fp32 cross-entropy over all tokens
    whatever the logits' dtype, so every recipe's loss is the same quantity. (M23)"""
    wl = build_workload("gpt", batch_size=2, num_batches=1)
    _, y = wl.batches[0]
    torch.manual_seed(0)
    out = torch.randn(2, 64, 512).bfloat16()
    loss = wl.loss_fn(out, y)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(out.float().reshape(-1, 512), y.reshape(-1)),
                               rtol=0, atol=0)


def test_gpt_token_batches_cover_the_whole_vocabulary():
    """The synthetic token batches are uniform over [0, vocab_size): 2080 draws from the
    small GPT's 512 tokens hit nearly all of them (about 503 expected) and none outside. (M25)"""
    wl = build_workload("gpt")
    tokens = torch.cat([torch.cat([x.flatten(), y[:, -1:].flatten()]) for x, y in wl.batches])
    assert tokens.min() >= 0 and tokens.max() < 512
    assert len(torch.unique(tokens)) > 460


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_batches": 0}, r"build_workload\(num_batches=0\): must be an int >= 1"),
        ({"name": "cnn", "optimizer": "mixprec"}, "train with SGD"),
    ],
)
def test_more_build_workload_errors(kwargs, match):
    """An empty batch pool is refused up front (the runner cycles it), and so is mixprec's
    AdamW for the SGD-trained CNN. (M26, M27)"""
    with pytest.raises(ValueError, match=match):
        build_workload(**kwargs)


def test_workload_sizes_are_the_documented_ones():
    """The documented sizes: small CNN width 16 at 16x16, batch 16; large CNN width 64 at
    64x64, batch 256; GPT batch 8 at either size (seq 64 small, 1024 large). (M28, M29, M30)"""
    small = build_workload("cnn", num_batches=1)
    assert small.batches[0][0].shape == (16, 3, 16, 16) and small.batch_size == 16
    assert small.description.startswith("SmallCNN(width=16) on 16x16 images, batch 16")
    large = build_workload("cnn", size="large", num_batches=1)
    assert large.batches[0][0].shape == (256, 3, 64, 64)
    assert large.description.startswith("SmallCNN(width=64) on 64x64 images, batch 256")
    assert build_workload("gpt", num_batches=1).batches[0][0].shape == (8, 64)
    assert build_workload("gpt", size="large", num_batches=1).batches[0][0].shape == (8, 1024)


def _fake_torchvision(monkeypatch):
    """Stand in for torchvision (not installed on the CPU CI): its resnet50 builds a small CNN
    and records the arguments; returns that record."""
    import sys
    import types

    calls = []

    def resnet50(**kwargs):
        calls.append(kwargs)
        return SmallCNN(num_classes=kwargs.get("num_classes", 1000), width=2)

    fake = types.ModuleType("torchvision")
    fake.models = types.SimpleNamespace(resnet50=resnet50)
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    return calls


def test_resnet50_workload_sizes_and_optimizer_are_the_documented_ones(monkeypatch):
    """The ResNet-50 workload: small is 10 classes at 64x64, batch 8; large is ImageNet's
    1000 classes at 224x224, batch 128; a randomly initialised torchvision ResNet-50 (no
    downloaded weights) trained with SGD lr 0.01, momentum 0.9, on images."""
    from mixprec.bench import models

    calls = _fake_torchvision(monkeypatch)
    small = build_workload("resnet50", num_batches=1)
    x, y = small.batches[0]
    assert x.shape == (8, 3, 64, 64) and small.batch_size == 8 and small.image
    assert 0 <= y.min() and y.max() < 10
    assert small.description.startswith("ResNet-50 on 64x64 images, batch 8")
    calls.clear()
    small.build_model()
    assert calls == [{"weights": None, "num_classes": 10}]
    opt = small.build_optimizer([nn.Parameter(torch.zeros(2))], torch.device("cpu"))
    assert type(opt) is torch.optim.SGD
    assert (opt.defaults["lr"], opt.defaults["momentum"]) == (0.01, 0.9)
    made = []  # the large data would take 600 MB: record what is asked for instead
    monkeypatch.setattr(models, "_image_batches", lambda *args: made.append(args[:4]) or [])
    large = build_workload("resnet50", size="large", num_batches=1)
    assert made == [(1, 128, 224, 1000)] and large.batch_size == 128
    calls.clear()
    large.build_model()
    assert calls == [{"weights": None, "num_classes": 1000}]


def test_gpt_workload_builds_its_norm_layers_with_norm_cls():
    """build_workload(norm_cls=...) is how the benchmark swaps the GPT's LayerNorm (e.g. for
    mixprec's FusedLayerNorm): every norm of the built model is of that class and the
    description names it. (M31)"""
    class MyNorm(nn.LayerNorm):
        pass

    wl = build_workload("gpt", batch_size=1, num_batches=1, norm_cls=MyNorm)
    model = wl.build_model()
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 5 and all(type(m) is MyNorm for m in norms)
    assert "norm=MyNorm" in wl.description


def test_cnn_workload_trains_with_sgd_momentum():
    """The CNN workload's optimizer is SGD, lr 0.05, momentum 0.9: the benchmark's loss
    curves and final-loss gaps are comparable across releases only with a fixed recipe. (M38)"""
    wl = build_workload("cnn", batch_size=4, num_batches=1)
    opt = wl.build_optimizer([nn.Parameter(torch.zeros(2))], torch.device("cpu"))
    assert type(opt) is torch.optim.SGD
    assert (opt.defaults["lr"], opt.defaults["momentum"]) == (0.05, 0.9)
