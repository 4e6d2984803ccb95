"""``FusedBatchNorm``: BatchNorm whose half-precision training pass avoids PyTorch's slow path.

PyTorch runs a training BatchNorm on cuDNN only when the input is fp32 or the parameters are
fp32, and never in bf16; everything else (bf16 models, a model in pure fp16) takes PyTorch's own
CUDA batch-norm kernels, which on an H200 spent 12.6 ms per ResNet-50 step against cuDNN's 7.0
(``benchmarks/probe_half_bn.py``). ``FusedBatchNorm`` runs exactly those cases, for
channels-last inputs, on mixprec's Triton batch-norm kernels (SyncBatchNorm's, in a group of
one: 7.5 ms there), and everything else as ``torch.nn.BatchNorm*d`` does.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.normalization._launch import is_compiling

__all__ = ["FusedBatchNorm", "convert_fused_batchnorm"]

_HALF = (torch.float16, torch.bfloat16)
_select_backend = getattr(torch._C, "_select_batch_norm_backend", None)


def _pytorch_uses_cudnn(x, weight, bias, running_mean, running_var, eps) -> bool:
    """Whether PyTorch's own training batch norm would run this call on cuDNN."""
    if _select_backend is not None:
        try:
            backend = _select_backend(x, weight, bias, running_mean, running_var, True, eps)
            return "cudnn" in str(backend).lower()
        except (RuntimeError, TypeError):  # (a signature from another release)
            pass
    # The rule of torch 2.4-2.13: never bf16; half input only with fp32 parameters.
    w_dtype = None if weight is None else weight.dtype
    return x.dtype != torch.bfloat16 and w_dtype != torch.bfloat16 and (
        x.dtype != torch.float16 or w_dtype == torch.float32)


class FusedBatchNorm(nn.modules.batchnorm._BatchNorm):
    r"""Batch normalization over ``(N, C, *)`` inputs, a drop-in for ``torch.nn.BatchNorm1d``,
    ``BatchNorm2d`` and ``BatchNorm3d`` (same arguments, parameters, buffers and state dict).

    In training, on CUDA, a channels-last input (``torch.channels_last`` /
    ``channels_last_3d`` memory format, or a contiguous ``(N, C)`` batch) in fp16/bf16 for
    which PyTorch would not use cuDNN (bf16 input or parameters; fp16 input with fp16
    parameters) runs mixprec's Triton kernels: the per-channel statistics, the normalization
    with the running-statistics update, and the two backward passes, statistics in fp32, the
    output in the input's dtype. Every other call (fp32, fp16 with fp32 parameters, which
    cuDNN serves well, other layouts, eval mode, CPU, ``torch.compile``) is
    ``torch.nn.functional.batch_norm``.

    It is a ``_BatchNorm``, so ``amp.initialize`` keeps it fp32 at O2 as any BatchNorm.

    Use it where the GPU is the limit, or with the step captured in a CUDA graph: its layers
    cost the host several times PyTorch's (six launches, ten allocations and a Python autograd
    node each). Measured on an H200, ResNet-50 bf16 at amp O2, batch 128: 0.81x the step time
    with ``BatchNorm2d`` as CUDA-graph replays (23.2 vs 28.4 ms), but 1.39x launched eagerly,
    where that step is bound by the host (``benchmarks/RESULTS.md``).

    Example::

        >>> model = convert_fused_batchnorm(torchvision.models.resnet50())  # doctest: +SKIP
        >>> model = model.cuda().to(memory_format=torch.channels_last)  # doctest: +SKIP
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None,
                 dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        # Per-module scratch: the layout and launch plan of each input geometry seen.
        self._cache: dict = {}

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"FusedBatchNorm: expected an (N, C, *) input of at least 2 dims, got shape "
                f"{tuple(input.shape)}"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"FusedBatchNorm({self.num_features}): input of shape {tuple(input.shape)} has "
                f"{input.shape[1]} channels in dim 1; expected {self.num_features}."
            )

    def _fused(self, input: torch.Tensor, training: bool, running_mean, running_var) -> bool:
        if not training or input.dtype not in _HALF or is_compiling():
            return False
        from mixprec.parallel import _sync_batchnorm_function as sbf
        from mixprec.parallel import _syncbn_triton

        if not (sbf._use_fused(input) and _syncbn_triton.usable_dtype(input)):
            return False
        if input.dim() == 2:
            dense = input.is_contiguous()
        elif input.dim() in (4, 5):
            fmt = torch.channels_last if input.dim() == 4 else torch.channels_last_3d
            dense = input.is_contiguous(memory_format=fmt) and not input.is_contiguous()
        else:
            dense = input.dim() >= 3 and input.movedim(1, -1).is_contiguous()
        if not dense or input.numel() <= input.shape[1]:
            return False  # (one value per channel or none: PyTorch's own error or result)
        return not _pytorch_uses_cudnn(input, self.weight, self.bias, running_mean, running_var,
                                       self.eps)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as torch's BatchNorm
                factor = 1.0 / float(self.num_batches_tracked)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_running = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_running else None
        running_var = self.running_var if use_running else None
        if self._fused(input, bn_training, running_mean, running_var):
            from mixprec.parallel import _sync_batchnorm_function as sbf

            return sbf.sync_batch_norm(input, self.weight, self.bias, running_mean, running_var,
                                       self.eps, factor, sbf.LOCAL, 1,
                                       channel_last=input.dim() == 2, cache=self._cache)
        return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                            bn_training, factor, self.eps)

    def __getstate__(self):
        # The cached layouts hold launch plans; a copy makes its own.
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__")
                     else self.__dict__)
        state["_cache"] = {}
        return state


def convert_fused_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` in ``module`` by a :class:`FusedBatchNorm` holding the
    same Parameter and buffer objects (an optimizer built earlier stays valid), mode and
    ``requires_grad``; returns the converted module (a new one when ``module`` itself is a
    BatchNorm). Subclasses of those layers (SyncBatchNorm, user-defined) are left alone."""
    plain = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    if type(module) in plain:
        new = FusedBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats)
        # The same objects, not copies: parameters, buffers (None where the layer has none).
        for name in ("weight", "bias"):
            setattr(new, name, getattr(module, name))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            new._buffers[name] = module._buffers.get(name)
        new.train(module.training)
        return new
    for name, child in module.named_children():
        converted = convert_fused_batchnorm(child)
        if converted is not child:
            setattr(module, name, converted)
    return module
