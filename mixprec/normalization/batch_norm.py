"""``FusedBatchNorm``: BatchNorm whose half-precision training pass avoids PyTorch's slow path.

PyTorch runs a training BatchNorm on cuDNN only when the input is fp32 or the parameters are
fp32, and never in bf16; everything else (bf16 models, a model in pure fp16) takes PyTorch's own
CUDA batch-norm kernels, which on an H200 spent 12.6 ms per ResNet-50 step against cuDNN's 7.0
(``benchmarks/probe_half_bn.py``). ``FusedBatchNorm`` runs exactly those cases, for
channels-last inputs, on mixprec's Triton batch-norm kernels (SyncBatchNorm's, with no
collectives: 7.5 ms there), and everything else as ``torch.nn.BatchNorm*d`` does.

Host cost is part of the design: a layer's decision (kernels or PyTorch's, and the launch plan)
is made once per input signature and kept in the module; a call then runs a four-argument
autograd Function whose forward allocates three tensors and launches three kernels
(``mixprec.parallel._syncbn_triton.Plan``) and whose backward allocates up to five (six when
the output gradient arrives in another layout and is copied) and launches three.
"""

import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mixprec._checks import first_forward_pending
from mixprec.normalization._launch import (
    first_derivatives_only,
    in_functorch_or_forward_ad,
    is_batched_grad,
    is_compiling,
)
from mixprec.normalization._launch import interpreter_enabled as _launch_interpreter_enabled

__all__ = ["FusedBatchNorm", "convert_fused_batchnorm"]

_HALF = (torch.float16, torch.bfloat16)
# PyTorch's BatchNorm takes ``bias=False`` (a weight without a bias) in its 2026 releases.
_TORCH_BN_TAKES_BIAS = "bias" in inspect.signature(nn.modules.batchnorm._NormBase.__init__).parameters


def batch_norm_bias_kwargs(cls_name: str, bias: bool) -> dict:
    """The ``bias=`` keyword to pass on to PyTorch's ``_BatchNorm``: none for the default, and a
    clear error for ``bias=False`` on a PyTorch whose BatchNorm does not take it."""
    if not isinstance(bias, bool):
        raise TypeError(f"{cls_name}(bias={bias!r}): must be a bool.")
    if bias:
        return {}
    if not _TORCH_BN_TAKES_BIAS:
        raise TypeError(
            f"{cls_name}(bias=False): this PyTorch ({torch.__version__}) has no BatchNorm "
            "without a bias (torch.nn.BatchNorm2d takes `bias` in recent releases). Upgrade "
            "PyTorch, or keep the bias and freeze it: layer.bias.requires_grad_(False) (it starts at "
            "zero)."
        )
    return {"bias": False}


_select_backend = getattr(torch._C, "_select_batch_norm_backend", None)


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


class FusedBatchNorm(nn.modules.batchnorm._BatchNorm):
    r"""Batch normalization over ``(N, C, *)`` inputs, a drop-in for ``torch.nn.BatchNorm1d``,
    ``BatchNorm2d`` and ``BatchNorm3d`` (same arguments, parameters, buffers and state dict).

    In training (and in eval mode without running statistics, which normalizes with the batch's
    as training does), on CUDA, a channels-last input (``torch.channels_last`` /
    ``channels_last_3d`` memory format, or a contiguous ``(N, C)`` or ``(N, C, 1, 1)`` batch) in
    fp16/bf16 for which PyTorch would not use cuDNN (bf16 input or parameters; fp16 input with
    fp16 parameters) runs mixprec's Triton kernels: the per-channel statistics, the normalization
    with the running-statistics update, and the two backward passes, statistics in fp32, the
    output in the input's dtype. Every other call (fp32, fp16 with fp32 parameters, which
    cuDNN serves well, other layouts, eval mode with running statistics, CPU,
    ``torch.compile``, ``torch.jit.trace``) is
    ``torch.nn.functional.batch_norm``.

    It is a ``_BatchNorm``, so ``amp.initialize`` keeps it fp32 at O2 as any BatchNorm. It
    scripts (``torch.jit.script``: PyTorch's batch norm) and is one call under ``torch.fx``.
    On the kernels' path it gives first derivatives only, as SyncBatchNorm: a second
    derivative through such a layer (a gradient penalty) is an error; keep ``BatchNorm*d``
    there. ``torch.func`` transforms and forward-mode AD take PyTorch's batch norm.

    Its layers cost the host more than PyTorch's (a Python autograd node and six launches per
    layer: about 190 against 110 us per layer forward and backward on an H200's host), so the
    gain shows where the GPU, not the host, is the limit, or with the step captured in a CUDA
    graph. Measured on an H200, ResNet-50 bf16 at amp O2, batch 128: 0.81x the step time of
    torch autocast as CUDA-graph replays (23.2 vs 28.5 ms), and eagerly 0.81-0.86x on machine
    instances whose host keeps up, 1.16x on one whose host did not (``benchmarks/RESULTS.md``).

    Example::

        >>> model = convert_fused_batchnorm(torchvision.models.resnet50())  # doctest: +SKIP
        >>> model = model.cuda().to(memory_format=torch.channels_last)  # doctest: +SKIP
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None,
                 dtype=None, *, bias: bool = True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype,
                         **batch_norm_bias_kwargs(type(self).__name__, bias))
        # Per-module scratch: per input signature, the kernels' launch plan or False (PyTorch's
        # batch norm).
        self._cache: dict = {}

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"FusedBatchNorm: expected an (N, C, *) input of at least 2 dims, got "
                f"{input.dim()} dims"
            )
        # (Without parameters or running statistics, as torch's BatchNorm, any channel count.
        # Under torch.jit.trace the sizes are traced tensors: F.batch_norm checks there.)
        if (self.weight is not None or self.running_mean is not None) and (
                not torch.jit.is_tracing()) and input.shape[1] != self.num_features:
            raise ValueError(
                f"FusedBatchNorm({self.num_features}): the input has {input.shape[1]} channels "
                f"in dim 1 (shape {list(input.shape)}); expected {self.num_features}."
            )

    @torch.jit.unused
    def _fused_call(self, input: torch.Tensor, training: bool,
                    running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                    factor: float) -> Optional[torch.Tensor]:
        """The kernels' result, or None when this call is PyTorch's (see the class
        documentation). The decision is made once per input signature and kept."""
        if not training or input.dtype not in _HALF or is_compiling():
            return None
        if torch.jit.is_tracing():
            # torch.jit.trace records PyTorch's batch norm, so that the trace saves and runs
            # without mixprec (a Python autograd Function is no TorchScript op).
            return None
        if in_functorch_or_forward_ad():  # PyTorch's batch norm there
            return None
        weight, bias = self.weight, self.bias
        # Everything the plan depends on: the tensors' dtypes, devices and geometry (a
        # parameter replaced by a strided or resized one must not reuse the plan), and the
        # routing switches SyncBatchNorm's rule reads.
        sbf = _sbf()
        sig = sbf._signature
        key = (input.shape, input.stride(), input.dtype, input.device, sig(weight), sig(bias),
               sig(running_mean), sig(running_var),
               self.eps, torch.backends.cudnn.enabled, sbf._OPS.triton_channels_last,
               sbf._use_fused)
        if not input.is_cuda:  # (CPU tensors take the kernels only under the tests' routing)
            key += _cpu_routing()
        plan = self._cache.get(key)
        if plan is None:
            plan = self._plan_for(input, weight, bias, running_mean, running_var)
            if len(self._cache) >= 16:  # a layer fed ever-changing shapes: start over
                self._cache.clear()
            self._cache[key] = plan
        if plan is False:
            return None
        return _kernels_batch_norm(input, weight, bias, running_mean, running_var,
                                   float(factor), float(self.eps), plan)

    @torch.jit.unused
    def _plan_for(self, input, weight, bias, running_mean, running_var):
        """The kernels' :class:`~mixprec.parallel._syncbn_triton.Plan` for this call's
        signature, or False where PyTorch's batch norm serves it (or raises its own error)."""
        # SyncBatchNorm's rule (dense channels-last memory: a channels_last /
        # channels_last_3d tensor, or a contiguous (N, C) or (N, C, 1, ...) one; a dtype the
        # kernels read; parameters and running statistics they take; more than one row, else
        # PyTorch's own error or result), then only where PyTorch would not use cuDNN.
        plan = _sbf()._triton_plan(input, weight, bias, running_mean, running_var, False)
        if plan is None or _pytorch_uses_cudnn(input, weight, bias, running_mean, running_var,
                                               self.eps):
            return False
        return plan

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
        # The cache holds launch plans; a copy makes its own.
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__")
                     else self.__dict__)
        state["_cache"] = {}
        return state


@torch.jit.unused
def _fused_batch_norm_forward(module: FusedBatchNorm, input: torch.Tensor) -> torch.Tensor:
    return module._forward_impl(input)


torch.fx.wrap("_fused_batch_norm_forward")

_SBF = None


def _sbf():
    """``mixprec.parallel._sync_batchnorm_function`` (the kernels' rule and plans), imported on
    first use (it imports this package), then kept."""
    global _SBF
    if _SBF is None:
        from mixprec.parallel import _sync_batchnorm_function

        _SBF = _sync_batchnorm_function
    return _SBF


def _cpu_routing() -> tuple:
    """What else decides whether CPU tensors take the kernels (the tests route them there,
    through Triton's interpreter): part of a CPU call's cache key."""
    from mixprec.parallel import _syncbn_triton

    return (_syncbn_triton._cpu_testing, _launch_interpreter_enabled())


def _kernels_batch_norm(x, weight, bias, running_mean, running_var, momentum: float, eps: float,
                        plan) -> torch.Tensor:
    """Training batch norm of ``x`` on mixprec's kernels, as planned by ``plan``."""
    # (What autograd needs not look at travels as one argument: each argument of a Python
    # Function costs host time. The running statistics are buffers, updated in place.)
    return _KernelsBatchNorm.apply(x, weight, bias, (running_mean, running_var, momentum, eps,
                                                     plan))


class _KernelsBatchNorm(torch.autograd.Function):
    """The kernels' autograd node: saves the input, the weight and the statistics row."""

    @staticmethod
    def forward(ctx, x, weight, bias, rest):
        running_mean, running_var, momentum, eps, plan = rest
        out, row = plan.forward(x, weight, bias, running_mean, running_var, momentum, eps)
        ctx.save_for_backward(x, weight, row)
        ctx.plan, ctx.x_strides = plan, x.stride()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # (create_graph=True: the gradients are not differentiable again; an error if asked.)
        return first_derivatives_only(
            _backward, ctx, grad_out,
            "FusedBatchNorm (its Triton kernels; use torch.nn.BatchNorm*d for double backward)")


def _backward(ctx, grad_out):
    x, weight, row = ctx.saved_tensors
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    plan = ctx.plan
    if not plan.reads_saved(x, ctx.x_strides, weight, row) or is_batched_grad(grad_out):
        # A saved-tensor hook (activation offloading, compression) handed back copies laid
        # out or typed otherwise, or the gradients are batched (is_grads_batched=True): PyTorch
        # arithmetic on what came back.
        # (each gradient in its tensor's dtype at the forward, the plan's: not the copy's)
        grads = _generic_backward(grad_out, x, weight, row, need_input, need_weight, need_bias,
                                  (plan.x_dtype, plan.w_dtype, plan.b_dtype))
    else:
        if grad_out.dtype is not x.dtype or grad_out.stride() != x.stride():
            grad_out = torch.empty_like(x).copy_(grad_out)  # (x's dense channels-last memory)
        grads = plan.backward(grad_out, x, row, weight, need_input, need_weight, need_bias)
    return (*grads, None)


def _generic_backward(grad_out, x, weight, row, need_input, need_weight, need_bias, dtypes):
    """The gradients by PyTorch arithmetic (in fp32) from what the saved-tensor hooks handed
    back, each cast to its tensor's dtype at the forward (``dtypes``: input, weight, bias)."""
    sbf = _sbf()
    c = (row.numel() - 1) // 2
    # (a hook may hand the row or the weight back on another device, e.g. offloaded to CPU)
    row = row.to(device=x.device, dtype=torch.float32)
    w = None if weight is None else weight.to(device=x.device, dtype=torch.float32)
    grad_input, grad_weight, grad_bias = sbf._reference_backward(
        grad_out, x, sbf._Layout(x, x.dim() == 2), w, row[:c], row[c:2 * c], row[2 * c],
        sbf.LOCAL, (need_input, need_weight, need_bias))
    x_dtype, weight_dtype, bias_dtype = dtypes
    if grad_input is not None:
        grad_input = grad_input.to(x_dtype)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight_dtype)
    if grad_bias is not None and bias_dtype is not None:
        grad_bias = grad_bias.to(bias_dtype)
    return grad_input, grad_weight, grad_bias


def convert_fused_batchnorm(module: nn.Module) -> nn.Module:
    """Turn every ``BatchNorm1d/2d/3d`` in ``module`` into a :class:`FusedBatchNorm`, in place:
    the same module objects (their parameters, buffers, hooks, mode and attributes stay, and a
    layer registered under several names stays one layer), only their class changes. Returns
    ``module``. Subclasses of those layers (SyncBatchNorm, user-defined ones) are left alone.
    A plain layer that ``amp.initialize`` already prepared (O1's fp32 BatchNorm with
    ``keep_batchnorm_fp32``, a BatchNorm passed as the model) is converted too and keeps amp's
    forward."""
    from mixprec.amp._model import _amp_class, _original_class, is_amp_model

    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_fused_batchnorm(module={type(module).__name__}): expected a "
                        "torch.nn.Module.")
    # (Also one whose shapes came from load_state_dict: still lazy until its first forward,
    # where it became a plain BatchNorm, silently unconverted.)
    lazy = [name for name, layer in module.named_modules()
            if isinstance(layer, _BatchNorm) and first_forward_pending(layer)]
    if lazy:
        raise ValueError(
            f"convert_fused_batchnorm: the layer {lazy[0] or 'passed'!r} "
            f"({type(module.get_submodule(lazy[0])).__name__}) has not seen an input yet, so "
            "it is not a BatchNorm1d/2d/3d (it becomes one at its first forward, its "
            "parameters loaded or not) and would be left unconverted. Run one forward pass "
            "(e.g. on a dummy batch) before converting, or use BatchNorm with num_features.")
    plain = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    for layer in module.modules():
        if type(layer) in plain:
            layer.__class__ = FusedBatchNorm
        elif is_amp_model(layer) and _original_class(type(layer)) in plain:
            # (Before, left alone without a word: the conversion did nothing after initialize.)
            layer.__class__ = _amp_class(FusedBatchNorm)
        else:
            continue
        layer._cache = {}
    return module
