"""The benchmark's models and synthetic data: a small CNN with BatchNorm, a GPT-style
transformer, and torchvision's ResNet-50.

Every model is built in fp32, on the device (the runner builds it under ``torch.device``:
initialising a large model on the CPU took seconds per mode); the runner seeds the RNG before
each build, so every mode starts from the same initial weights.

A :class:`Workload` bundles what one benchmark needs: how to build the model and its optimizer,
the loss, and a small pool of synthetic batches already on the device (shared by all modes, so
every mode sees the same data in the same order).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "GPTConfig",
    "SmallCNN",
    "Workload",
    "build_workload",
    "gpt_config",
    "resnet50",
    "MODEL_NAMES",
    "OPTIMIZERS",
    "SIZES",
]

#: Names accepted by :func:`build_workload` (and the CLI's ``--model``).
MODEL_NAMES = ("cnn", "gpt", "resnet50")
#: Sizes accepted by :func:`build_workload`: ``small`` runs in seconds on a laptop CPU,
#: ``large`` is the GPU benchmark configuration.
SIZES = ("small", "large")
#: The GPT's optimizer (:func:`build_workload`'s ``optimizer``, the CLI's ``--optimizer``):
#: ``torch.optim.AdamW`` or mixprec's ``FusedAdam``.
OPTIMIZERS = ("torch", "mixprec")

NormFactory = Callable[[int], nn.Module]


# --------------------------------------------------------------------------------------------
# Small CNN with BatchNorm: the seed's case (BatchNorm is what breaks mixed precision).
# --------------------------------------------------------------------------------------------
class SmallCNN(nn.Module):
    """Three conv-BatchNorm-ReLU stages, global average pooling and a linear classifier.

    Args:
        num_classes (int): outputs of the classifier. Default ``10``.
        width (int): channels of the first stage (the others use ``2 * width``). Default ``16``.
        in_channels (int): input channels. Default ``3``.

    Example::

        >>> model = SmallCNN(width=8)
        >>> model(torch.randn(2, 3, 16, 16)).shape
        torch.Size([2, 10])
    """

    def __init__(self, num_classes: int = 10, width: int = 16, in_channels: int = 3):
        super().__init__()
        for name, value in (("num_classes", num_classes), ("width", width),
                            ("in_channels", in_channels)):
            if not _is_count(value):
                raise ValueError(f"SmallCNN({name}={value!r}): must be an int >= 1.")
        w2 = 2 * width
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, w2, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(w2),
            nn.ReLU(inplace=True),
            nn.Conv2d(w2, w2, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(w2),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Linear(w2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.classifier(x)


# --------------------------------------------------------------------------------------------
# GPT-style decoder: pre-LN blocks, causal scaled_dot_product_attention, GELU MLP.
# --------------------------------------------------------------------------------------------
def _is_count(value) -> bool:
    """An int >= 1 (a bool is no count: True would read as 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    The default is the GPU benchmark's configuration (about 218 M parameters with the untied
    head): d_model 1024, 12 layers, 16 heads, sequence 1024, vocabulary 32000.

    Attributes:
        vocab_size (int): token vocabulary. Default ``32000``.
        seq_len (int): maximum sequence length (learned position embeddings). Default ``1024``.
        d_model (int): model width. Default ``1024``.
        n_layers (int): transformer blocks. Default ``12``.
        n_heads (int): attention heads; must divide ``d_model``. Default ``16``.
        mlp_ratio (int): MLP hidden width over ``d_model``. Default ``4``.
        tie_weights (bool): share the token embedding with the output head. Default ``False``:
            an untied head keeps every parameter owned by exactly one module, which every
            mixed-precision recipe handles the same way.
    """

    vocab_size: int = 32000
    seq_len: int = 1024
    d_model: int = 1024
    n_layers: int = 12
    n_heads: int = 16
    mlp_ratio: int = 4
    tie_weights: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            value = getattr(self, name)
            if not _is_count(value):
                raise ValueError(f"GPTConfig({name}={value!r}): must be an int >= 1.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig(d_model={self.d_model}, n_heads={self.n_heads}): n_heads must "
                f"divide d_model; pick e.g. n_heads={math.gcd(self.d_model, self.n_heads)}."
            )
        if not isinstance(self.tie_weights, bool):
            raise TypeError(
                f"GPTConfig(tie_weights={self.tie_weights!r}): must be True or False "
                "(any other value would be read by its truth, tie_weights='no' tying)."
            )


def gpt_config(size: str = "large") -> GPTConfig:
    """The benchmark's GPT configurations.

    Args:
        size (str): ``"large"`` (the GPU benchmark: d_model 1024, 12 layers, 16 heads, seq 1024,
            vocab 32000) or ``"small"`` (d_model 64, 2 layers, 4 heads, seq 64, vocab 512: a
            CPU smoke test). Default ``"large"``.

    Returns:
        GPTConfig

    Example::

        >>> gpt_config("small").d_model
        64
    """
    if size == "large":
        return GPTConfig()
    if size == "small":
        return GPTConfig(vocab_size=512, seq_len=64, d_model=64, n_layers=2, n_heads=4)
    raise ValueError(f"gpt_config(size={size!r}): size must be one of {SIZES}.")


class _CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # (B, T, D) -> (B, H, T, D/H): the layout scaled_dot_product_attention expects.
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig, norm_cls: NormFactory):
        super().__init__()
        self.ln1 = norm_cls(cfg.d_model)
        self.attn = _CausalSelfAttention(cfg)
        self.ln2 = norm_cls(cfg.d_model)
        hidden = cfg.mlp_ratio * cfg.d_model
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, hidden), nn.GELU(), nn.Linear(hidden, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-LN: normalise the input of each residual branch, not the residual stream.
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style decoder-only language model returning logits ``(B, T, vocab_size)``.

    Pre-LN blocks, causal ``F.scaled_dot_product_attention``, a GELU MLP of ``mlp_ratio`` times
    the width, learned position embeddings, a final norm and a linear head (untied unless
    ``config.tie_weights``). Weights are initialised N(0, 0.02), biases zero.

    Args:
        config (GPTConfig): the shape. Default ``GPTConfig()`` (the large benchmark model).
        norm_cls (callable): builds each norm layer from the width, e.g. ``nn.LayerNorm``
            (default) or ``mixprec.normalization.FusedLayerNorm``.

    Example::

        >>> model = GPT(gpt_config("small"))
        >>> tokens = torch.randint(0, 512, (2, 16))
        >>> model(tokens).shape
        torch.Size([2, 16, 512])
    """

    def __init__(self, config: Optional[GPTConfig] = None, norm_cls: NormFactory = nn.LayerNorm):
        super().__init__()
        cfg = config if config is not None else GPTConfig()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"GPT(config={type(cfg).__name__}): expected a GPTConfig.")
        if not callable(norm_cls):
            raise TypeError(
                f"GPT(norm_cls={norm_cls!r}): expected a callable taking the width, "
                "e.g. nn.LayerNorm."
            )
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg, norm_cls) for _ in range(cfg.n_layers))
        self.ln_f = norm_cls(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(
                f"GPT.forward: sequence length {t} exceeds config.seq_len="
                f"{self.config.seq_len}; build the model with a larger seq_len."
            )
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _torchvision_requirement() -> str:
    """The pip requirement of the torchvision release made with this torch (torch 2.N pairs
    with torchvision 0.(N+15)), with the CPU or CUDA index left to the user's pip setup."""
    try:
        major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return "pip install torchvision"
    if major != 2:
        return "pip install torchvision"
    return f"pip install 'torchvision==0.{minor + 15}.*'"


def resnet50(num_classes: int = 1000) -> nn.Module:
    """torchvision's ResNet-50, randomly initialised.

    Raises:
        RuntimeError: torchvision is not installed.
    """
    try:
        import torchvision
    except ImportError:
        raise RuntimeError(
            "--model resnet50 needs torchvision, which is not installed; install the "
            f"torchvision release matching your torch {torch.__version__} "
            f"({_torchvision_requirement()}: a plain `pip install torchvision` may replace "
            "torch with its newest build) or pick --model cnn / --model gpt."
        ) from None
    return torchvision.models.resnet50(weights=None, num_classes=num_classes)


# --------------------------------------------------------------------------------------------
# Workloads: model + optimizer + loss + synthetic data.
# --------------------------------------------------------------------------------------------
Batch = Tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class Workload:
    """One benchmark: what to build, what to feed, what to minimise.

    Attributes:
        name (str): ``"cnn"``, ``"gpt"`` or ``"resnet50"``.
        description (str): a one-line summary for reports.
        build_model (callable): ``() -> nn.Module``, a fresh fp32 model, on the default
            device (the runner calls it under ``torch.device(device)``).
        build_optimizer (callable): ``(params, device) -> torch.optim.Optimizer``.
        batches (list of (inputs, targets)): synthetic data on the device, cycled in order.
        loss_fn (callable): ``(outputs, targets) -> scalar loss``; computes in fp32 whatever
            the outputs' dtype, so every recipe's loss is comparable.
        image (bool): inputs are NCHW images (``--channels-last`` applies).
        batch_size (int): samples per batch.
    """

    name: str
    description: str
    build_model: Callable[[], nn.Module]
    build_optimizer: Callable[[Sequence[nn.Parameter], torch.device], torch.optim.Optimizer]
    batches: List[Batch]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    image: bool
    batch_size: int


def _classification_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Upcast so a half-precision output (pure .half(), O3) gets an fp32 log-softmax: the loss
    # is then the same quantity under every recipe.
    return F.cross_entropy(out.float(), target)


def _lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), target.flatten())


def _image_batches(
    n: int, batch_size: int, image_size: int, num_classes: int, gen: torch.Generator
) -> List[Batch]:
    # Learnable synthetic data: each class has a fixed random mean image, plus noise. The loss
    # then falls steadily, so final-loss gaps between recipes mean something.
    means = torch.randn(num_classes, 3, image_size, image_size, generator=gen)
    batches = []
    for _ in range(n):
        y = torch.randint(0, num_classes, (batch_size,), generator=gen)
        x = means[y] + 2.0 * torch.randn(batch_size, 3, image_size, image_size, generator=gen)
        batches.append((x, y))
    return batches


def _token_batches(n: int, batch_size: int, cfg: GPTConfig, gen: torch.Generator) -> List[Batch]:
    # A small pool of fixed random sequences: the model learns the unigram statistics, then
    # memorises them, so the loss falls from ln(vocab) in a few dozen steps.
    batches = []
    for _ in range(n):
        seq = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return batches


def build_workload(
    name: str = "cnn",
    *,
    device="cpu",
    size: str = "small",
    batch_size: Optional[int] = None,
    seed: int = 0,
    num_batches: int = 4,
    norm_cls: Optional[NormFactory] = None,
    fused_adamw: Optional[bool] = None,
    fused_batchnorm: bool = False,
    optimizer: str = "torch",
) -> Workload:
    """Build a benchmark workload with its synthetic data on ``device``.

    Args:
        name (str): ``"cnn"`` (default), ``"gpt"`` or ``"resnet50"``.
        device (str or torch.device): where the data lives. Default ``"cpu"``.
        size (str): ``"small"`` (default; CPU-sized: CNN width 16 at 16x16, batch 16; GPT
            d_model 64/2 layers/seq 64, batch 8; ResNet-50 at 64x64, batch 8) or ``"large"``
            (GPU benchmark sizes: CNN width 64 at 64x64, batch 256; GPT d_model 1024/12
            layers/seq 1024, batch 8; ResNet-50 at 224x224, batch 128).
        batch_size (int, optional): override the size's default batch.
        seed (int): seeds the data generator. Default ``0``.
        num_batches (int): distinct batches in the pool, cycled. Default ``4``.
        norm_cls (callable, optional): the GPT's norm layer factory. Default ``nn.LayerNorm``.
        fused_adamw (bool, optional): the GPT's ``AdamW(fused=...)``. Default: on for CUDA.
        fused_batchnorm (bool): the image models' BatchNorm layers as mixprec's
            ``FusedBatchNorm`` (``convert_fused_batchnorm``). Default False.
        optimizer (str): the GPT's AdamW: ``"torch"`` (default; ``torch.optim.AdamW``) or
            ``"mixprec"`` (:class:`mixprec.optimizers.FusedAdam`, the same update; at amp O2
            it also writes the half model). The image models train with SGD and take
            ``"torch"`` only.

    Returns:
        Workload

    Example::

        >>> wl = build_workload("cnn", size="small", batch_size=4)
        >>> model = wl.build_model()
        >>> x, y = wl.batches[0]
        >>> wl.loss_fn(model(x), y).shape
        torch.Size([])
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"build_workload(name={name!r}): name must be one of {MODEL_NAMES}.")
    if size not in SIZES:
        raise ValueError(f"build_workload(size={size!r}): size must be one of {SIZES}.")
    if batch_size is not None and not _is_count(batch_size):
        raise ValueError(f"build_workload(batch_size={batch_size!r}): must be an int >= 1.")
    if not _is_count(num_batches):
        raise ValueError(f"build_workload(num_batches={num_batches!r}): must be an int >= 1.")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"build_workload(optimizer={optimizer!r}): optimizer must be one of "
                         f"{OPTIMIZERS}.")
    if optimizer == "mixprec" and name != "gpt":
        raise ValueError(f"build_workload(name={name!r}, optimizer='mixprec'): mixprec's "
                         "optimizer is an AdamW, which only the 'gpt' workload uses; the image "
                         "models train with SGD (optimizer='torch').")
    if fused_batchnorm and name == "gpt":
        raise ValueError("build_workload(name='gpt', fused_batchnorm=True): the GPT has no "
                         "BatchNorm; fused_batchnorm applies to 'cnn' and 'resnet50' (for the "
                         "GPT's norm layers pass norm_cls).")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    large = size == "large"

    if name == "cnn":
        width, image_size = (64, 64) if large else (16, 16)
        bs = batch_size or (256 if large else 16)
        batches = _image_batches(num_batches, bs, image_size, 10, gen)

        def build_model():
            return SmallCNN(num_classes=10, width=width)

        def build_optimizer(params, dev):
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)

        desc = f"SmallCNN(width={width}) on {image_size}x{image_size} images, batch {bs}, SGD"
        loss_fn, image = _classification_loss, True

    elif name == "resnet50":
        resnet50(num_classes=10)  # fail now, with the clear message, if torchvision is missing
        image_size = 224 if large else 64
        bs = batch_size or (128 if large else 8)
        num_classes = 1000 if large else 10
        batches = _image_batches(num_batches, bs, image_size, num_classes, gen)

        def build_model():
            return resnet50(num_classes=num_classes)

        def build_optimizer(params, dev):
            return torch.optim.SGD(params, lr=0.01, momentum=0.9)

        desc = f"ResNet-50 on {image_size}x{image_size} images, batch {bs}, SGD momentum 0.9"
        loss_fn, image = _classification_loss, True

    else:  # gpt
        cfg = gpt_config(size)
        bs = batch_size or 8
        batches = _token_batches(num_batches, bs, cfg, gen)
        norm = norm_cls if norm_cls is not None else nn.LayerNorm

        def build_model():
            return GPT(cfg, norm_cls=norm)

        def build_optimizer(params, dev):
            if optimizer == "mixprec":
                from mixprec.optimizers import FusedAdam

                return FusedAdam(params, lr=3e-4, weight_decay=0.1)  # AdamW (adam_w_mode)
            fused = fused_adamw if fused_adamw is not None else torch.device(dev).type == "cuda"
            kwargs = {"fused": True} if fused else {}
            return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, **kwargs)

        norm_name = getattr(norm, "__name__", type(norm).__name__)
        desc = (
            f"GPT(d_model={cfg.d_model}, layers={cfg.n_layers}, heads={cfg.n_heads}, "
            f"seq={cfg.seq_len}, vocab={cfg.vocab_size}, norm={norm_name}), batch {bs}, "
            + ("mixprec FusedAdam (AdamW)" if optimizer == "mixprec" else "AdamW")
        )
        loss_fn, image = _lm_loss, False

    if fused_batchnorm:
        from mixprec.normalization import convert_fused_batchnorm

        build_plain = build_model

        def build_model():
            return convert_fused_batchnorm(build_plain())

        desc += ", FusedBatchNorm"
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    return Workload(
        name=name,
        description=desc,
        build_model=build_model,
        build_optimizer=build_optimizer,
        batches=batches,
        loss_fn=loss_fn,
        image=image,
        batch_size=bs,
    )
