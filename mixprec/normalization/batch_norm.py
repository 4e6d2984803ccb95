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
_peek_functorch = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def _pytorch_uses_cudnn(x, weight, bias, running_mean, running_var, eps) -> bool:
    """Whether PyTorch's own training batch norm would run this call on cuDNN."""
    if weight is None or bias is None:
        return False  # (cuDNN needs both)
    if _select_backend is not None:
        # Running statistics only need to be there or not (training accepts both), so a
        # missing pair is stood in for by the weight.
        if running_mean is None or running_var is None:
            running_mean = running_var = weight
        try:
            backend = _select_backend(x, weight, bias, running_mean, running_var, True, eps)
            return "cudnn" in str(backend).lower()
        except (RuntimeError, TypeError):  # (a signature from another release)
            pass
    # The rule of torch 2.4-2.13: never bf16; half input only with fp32 parameters; 3+ dims.
    return (x.dim() >= 3 and x.dtype != torch.bfloat16 and weight.dtype != torch.bfloat16
            and (x.dtype != torch.float16 or weight.dtype == torch.float32))


def _in_functorch_or_forward_ad() -> bool:
    """torch.func transforms and forward-mode AD: the kernels' autograd Function has neither
    ``setup_context`` nor ``jvp``, so these calls take PyTorch's batch norm."""
    if _peek_functorch is not None and _peek_functorch() is not None:
        return True
    return getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


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

    It is a ``_BatchNorm``, so ``amp.initialize`` keeps it fp32 at O2 as any BatchNorm. It
    scripts (``torch.jit.script``: PyTorch's batch norm) and is one call under ``torch.fx``.
    On the kernels' path it gives first derivatives only, as SyncBatchNorm: a second
    derivative through such a layer (a gradient penalty) is an error; keep ``BatchNorm*d``
    there. ``torch.func`` transforms and forward-mode AD take PyTorch's batch norm.

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
                f"FusedBatchNorm: expected an (N, C, *) input of at least 2 dims, got "
                f"{input.dim()} dims"
            )
        # (Without parameters or running statistics, as torch's BatchNorm, any channel count.)
        if (self.weight is not None or self.running_mean is not None) and (
                input.shape[1] != self.num_features):
            raise ValueError(
                f"FusedBatchNorm({self.num_features}): the input has {input.shape[1]} channels "
                f"in dim 1 (shape {list(input.shape)}); expected {self.num_features}."
            )

    @torch.jit.unused
    def _fused(self, input: torch.Tensor, training: bool, running_mean: Optional[torch.Tensor],
               running_var: Optional[torch.Tensor]) -> bool:
        """Whether this call takes mixprec's kernels (see the class documentation)."""
        if not training or input.dtype not in _HALF or is_compiling():
            return False
        if _in_functorch_or_forward_ad():
            return False
        from mixprec.parallel import _sync_batchnorm_function as sbf
        from mixprec.parallel import _syncbn_triton

        if not (sbf._use_fused(input) and _syncbn_triton.usable_dtype(input)):
            return False
        # The layout SyncBatchNorm's function works out (and keeps in this module's cache for
        # the call that follows): the kernels take channels-last memory as it is.
        layout = sbf._layout_of(input, input.dim() == 2, self._cache)
        if not layout.dense or layout.rows <= 1:
            return False  # (one value per channel or none: PyTorch's own error or result)
        return not _pytorch_uses_cudnn(input, self.weight, self.bias, running_mean, running_var,
                                       self.eps)

    @torch.jit.unused
    def _fused_call(self, input: torch.Tensor, training: bool,
                    running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                    factor: float) -> Optional[torch.Tensor]:
        """The kernels' result, or None when this call is PyTorch's."""
        if not self._fused(input, training, running_mean, running_var):
            return None
        from mixprec.parallel import _sync_batchnorm_function as sbf

        return sbf.sync_batch_norm(input, self.weight, self.bias, running_mean, running_var,
                                   self.eps, factor, sbf.LOCAL, 1,
                                   channel_last=input.dim() == 2, cache=self._cache)

    def _forward_impl(self, input: torch.Tensor) -> torch.Tensor:
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
        if not torch.jit.is_scripting():
            out = self._fused_call(input, bn_training, running_mean, running_var, factor)
            if out is not None:
                return out
        return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                            bn_training, factor, self.eps)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            return self._forward_impl(input)  # (PyTorch's batch norm: the kernels are Python)
        else:
            # One opaque call for torch.fx, as torch's BatchNorm is a leaf module there.
            return _fused_batch_norm_forward(self, input)

    def __getstate__(self):
        # The cached layouts hold launch plans; a copy makes its own.
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__")
                     else self.__dict__)
        state["_cache"] = {}
        return state


@torch.jit.unused
def _fused_batch_norm_forward(module: FusedBatchNorm, input: torch.Tensor) -> torch.Tensor:
    return module._forward_impl(input)


torch.fx.wrap("_fused_batch_norm_forward")


def convert_fused_batchnorm(module: nn.Module) -> nn.Module:
    """Turn every ``BatchNorm1d/2d/3d`` in ``module`` into a :class:`FusedBatchNorm`, in place:
    the same module objects (their parameters, buffers, hooks, mode and attributes stay, and a
    layer registered under several names stays one layer), only their class changes. Returns
    ``module``. Subclasses of those layers (SyncBatchNorm, user-defined ones, and the classes
    ``amp.initialize`` gives BatchNorm at O1 with ``keep_batchnorm_fp32``: convert before
    ``amp.initialize``, as for ``convert_syncbn_model``) are left alone."""
    plain = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    for layer in module.modules():
        if type(layer) in plain:
            layer.__class__ = FusedBatchNorm
            layer._cache = {}
    return module
