"""The benchmark's models: shapes, causality, the norm hook, the large GPT's size."""

import pytest
import torch
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
        ({"n_layers": 0}, "n_layers"),
    ],
)
def test_gpt_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


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


def test_gpt_config_refuses_sizes_that_are_not_ints():
    with pytest.raises(ValueError, match=r"GPTConfig\(d_model=64.0\): must be an int >= 1"):
        GPTConfig(d_model=64.0, n_heads=4)


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


def test_build_workload_refuses_a_batch_size_that_is_not_an_int():
    with pytest.raises(ValueError, match=r"build_workload\(batch_size=2.5\): must be an int"):
        build_workload("cnn", batch_size=2.5)


def test_workload_seed_picks_the_data():
    a = build_workload("cnn", batch_size=4, seed=0)
    b = build_workload("cnn", batch_size=4, seed=1)
    assert not torch.equal(a.batches[0][0], b.batches[0][0])
    g0 = build_workload("gpt", batch_size=1, num_batches=1, seed=0)
    g1 = build_workload("gpt", batch_size=1, num_batches=1, seed=1)
    assert not torch.equal(g0.batches[0][0], g1.batches[0][0])


def test_gpt_adamw_is_fused_by_default_on_cuda_only():
    wl = build_workload("gpt", batch_size=1, num_batches=1)
    params = [nn.Parameter(torch.zeros(2))]
    assert not wl.build_optimizer(params, torch.device("cpu")).defaults.get("fused")
    assert wl.build_optimizer(params, torch.device("cuda")).defaults["fused"] is True
    off = build_workload("gpt", batch_size=1, num_batches=1, fused_adamw=False)
    assert not off.build_optimizer(params, torch.device("cuda")).defaults.get("fused")
