"""``SyncBatchNorm``: batch normalization with statistics over every rank (Apex's arguments)."""

from __future__ import annotations

import copy
import numbers
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from mixprec.normalization.batch_norm import batch_norm_bias_kwargs
from mixprec.parallel._comm import check_process_group, group_world_size, is_distributed
from mixprec.parallel._sync_batchnorm_function import sync_batch_norm

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics cover the batches of every rank.

    A drop-in for ``nn.BatchNorm1d/2d/3d`` (and Apex's ``apex.parallel.SyncBatchNorm``) in
    data-parallel training. In training mode the per-rank statistics (fp32, whatever the input
    dtype) are merged count-weighted, so ranks may hold batches of different sizes; the running
    variance uses the unbiased global variance. Each layer costs one small collective in forward
    (an all-gather of ``2C + 1`` numbers per rank) and one in backward (an all-reduce of ``2C``),
    and never synchronises the host with the GPU.

    It is a ``torch.nn.modules.batchnorm._BatchNorm``, so ``amp.initialize(opt_level="O2")``
    keeps it in fp32: half input, fp32 parameters and statistics, output in the input's dtype.

    Falls back to plain ``F.batch_norm`` (no communication) in eval mode, and when
    ``torch.distributed`` is not initialized or the group has one rank. In eval mode with
    ``track_running_stats=False`` each rank therefore normalizes by its own batch's
    statistics, as ``torch.nn.SyncBatchNorm`` does (Apex's layer synchronised them): evaluation
    never communicates, so evaluating on one rank alone cannot hang. A training batch with a
    single value per channel over the whole group raises ``ValueError``, as BatchNorm does,
    and leaves the running mean and variance untouched (``num_batches_tracked`` has counted
    the batch, as BatchNorm's does).

    Inputs: ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)`` in any memory
    format; ``torch.channels_last`` inputs are reduced in place over ``(N, H, W)`` (no NCHW copy)
    and the output keeps their strides. With ``channel_last=True`` (Apex's flag) the input is
    instead shaped ``(N, *, C)``: channels in the last dimension.

    Args:
        num_features (int): ``C``, the number of channels.
        eps (float): added to the variance; > 0 wherever batch statistics normalize (0 only
            for eval mode with running statistics, where the installed PyTorch's BatchNorm
            takes it: 2.4 and 2.13 do, 2.11 does not). Default ``1e-5``.
        momentum (float or None): running-statistics factor; None for a cumulative average.
            Default ``0.1``.
        affine (bool): learnable per-channel weight and bias. Default True.
        track_running_stats (bool): keep running mean/variance. Default True.
        process_group (ProcessGroup, optional): ranks whose statistics are merged, e.g. from
            :func:`~mixprec.parallel.create_syncbn_process_group`. Default None: all ranks.
        channel_last (bool): input is ``(N, *, C)``. Default False.
        fuse_relu (bool): a ReLU after the normalization (and after ``z``, see ``forward``), as
            Apex's optimized layer's flag. Default False.
        device, dtype (keyword-only, optional): factory arguments for parameters and buffers.
        bias (bool, keyword-only): with ``affine``, a learnable bias too; False for a weight
            alone, as ``nn.BatchNorm2d(bias=False)`` (on a PyTorch whose BatchNorm takes
            it). Default True.

    Example::

        >>> torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # launched by torchrun
        >>> torch.distributed.init_process_group("nccl")
        >>> model = nn.Sequential(nn.Conv2d(3, 64, 3), SyncBatchNorm(64), nn.ReLU()).cuda()
        >>> model = model.to(memory_format=torch.channels_last)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> model = DistributedDataParallel(model)
        >>> for x, y in loader:
        ...     loss = criterion(model(x.cuda()), y.cuda())
        ...     with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...         scaled_loss.backward()
        ...     optimizer.step()
        ...     optimizer.zero_grad()
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        channel_last: bool = False,
        fuse_relu: bool = False,
        *,
        device=None,
        dtype=None,
        bias: bool = True,
    ):
        # Any integer type BatchNorm takes (a NumPy one, e.g. from a model's channel
        # arithmetic), so that convert_syncbn_model converts every layer BatchNorm accepted.
        try:
            channels = None if isinstance(num_features, bool) else operator.index(num_features)
        except TypeError:
            channels = None
        if channels is None or channels < 1:
            raise ValueError(
                f"SyncBatchNorm(num_features={num_features!r}): must be a positive int (the "
                "number of channels C)."
            )
        num_features = int(channels)
        check_process_group("SyncBatchNorm", process_group)
        if not isinstance(channel_last, bool):
            raise TypeError(
                f"SyncBatchNorm(channel_last={channel_last!r}): must be a bool. True means the "
                "input is shaped (N, *, C); channels_last memory format needs no flag."
            )
        if not isinstance(fuse_relu, bool):
            raise TypeError(
                f"SyncBatchNorm(fuse_relu={fuse_relu!r}): must be a bool. True applies a ReLU "
                "to the output (after adding forward's z, if given)."
            )
        # (A string failed at the first forward with a bare TypeError; a negative eps gave NaN
        # for channels of small variance without a word.)
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
            raise ValueError(f"SyncBatchNorm(eps={eps!r}): must be a number >= 0 (added to the "
                             "variance; BatchNorm's default is 1e-5).")
        if momentum is not None and (isinstance(momentum, bool)
                                     or not isinstance(momentum, numbers.Real)
                                     or not 0 <= momentum <= 1):
            raise ValueError(f"SyncBatchNorm(momentum={momentum!r}): must be a number in [0, 1] "
                             "(the running statistics' update factor, default 0.1), or None "
                             "for a cumulative average.")
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype,
                         **batch_norm_bias_kwargs(type(self).__name__, bias))
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu
        # Per-module scratch of the CUDA path, not state: per input signature the Triton
        # kernels' launch plan (or that they do not take it), the layout of each input geometry
        # seen, a cached one-element count tensor. (The name predates the rest; kept so that
        # modules pickled earlier still load and run.)
        self._count_cache: dict = {}

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm: expected at least 2D input (N, C, *), got a {input.dim()}D "
                f"tensor of shape {tuple(input.shape)}."
            )
        channels = input.shape[-1] if self.channel_last else input.shape[1]
        # The first of the layer's weight, bias and running statistics, read from the module's
        # dicts (nn.Module.__getattr__ costs ~1 us a name: this runs per layer and forward).
        held = self._parameters.get("weight")
        for name in ("bias", "running_mean", "running_var"):
            if held is not None:
                break
            held = (self._parameters if name == "bias" else self._buffers).get(name)
        # (A layer with none of them normalizes any number of channels, as BatchNorm does:
        # convert_syncbn_model must not refuse what it took. Under torch.jit.trace, the ONNX
        # exporter's too, the sizes are traced tensors: F.batch_norm checks there.)
        if held is not None and not torch.jit.is_tracing() and channels != self.num_features:
            where = "last" if self.channel_last else "second (dim 1)"
            raise ValueError(
                f"SyncBatchNorm({self.num_features}): input of shape {tuple(input.shape)} has "
                f"{channels} channels in its {where} dimension; expected {self.num_features}."
                + (" It was built with channel_last=True, for (N, *, C) inputs: for (N, C, *) "
                   "ones (torch.channels_last tensors included) build it with "
                   "channel_last=False." if self.channel_last else
                   " For (N, *, C) inputs construct it with channel_last=True.")
            )
        # The dtypes BatchNorm takes, on every path (the multi-rank one computed any pair, so a
        # model trained there failed in eval): the layer's own, or half with fp32 ones. A
        # RuntimeError, as BatchNorm's for the same pairs.
        if held is not None and input.dtype != held.dtype and not (
                input.dtype in (torch.float16, torch.bfloat16) and held.dtype == torch.float32):
            half = input.dtype in (torch.float16, torch.bfloat16)
            if not input.is_floating_point():  # (no layer of an integer dtype normalizes)
                layer = ""
            else:
                layer = " or the layer (" + ("layer.float(), which takes half input" if half
                                             else f"layer.to({input.dtype})") + ")"
            raise RuntimeError(
                f"SyncBatchNorm({self.num_features}): input is {input.dtype}, the layer's "
                f"parameters and buffers {held.dtype}; it takes input of their dtype, or "
                f"float16/bfloat16 input with float32 ones. Cast the input "
                f"(input.to({held.dtype})){layer}."
            )

    def _average_factor(self) -> float:
        # As nn.BatchNorm: momentum, or 1/num_batches_tracked for a cumulative average.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    def _local_batch_norm(self, input, running_mean, running_var, training, factor):
        # (The last dim counted from the front: the TorchScript ONNX exporter writes an
        # invalid Transpose for a negative movedim dim, PyTorch's own bug.)
        last = input.dim() - 1
        x = input.movedim(last, 1) if (self.channel_last and last > 1) else input
        out = F.batch_norm(x, running_mean, running_var, self.weight, self.bias, training,
                           factor, self.eps)
        return out.movedim(1, last) if x is not input else out

    def forward(self, input: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Normalize ``input``; with ``z`` (Apex's optimized layer: a residual branch, shaped
        as the output) return ``bn(input) + z``, and with ``fuse_relu`` its ReLU."""
        out = self._normalize(input)
        if z is not None:
            if z.shape != out.shape:
                raise ValueError(
                    f"SyncBatchNorm.forward(input, z): z has shape {tuple(z.shape)}, the output "
                    f"{tuple(out.shape)}; z is added to the output, so give it the input's "
                    "shape."
                )
            out = out + z
        if self.fuse_relu:  # (set by __init__ and __setstate__)
            out = F.relu(out)
        return out

    def _normalize(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        if bn_training and not self.eps > 0:
            # (On every path: one process's BatchNorm refuses it on recent PyTorch, while the
            # multi-rank path divided a constant channel's zero variance by zero, NaN.)
            raise ValueError(
                f"SyncBatchNorm({self.num_features}): eps={self.eps!r} normalizing by batch "
                "statistics: a channel whose values are all equal has variance 0, and eps 0 "
                "divides by it. Set a positive eps (layer.eps = 1e-5, the default); eps 0 "
                "can serve only eval mode with running statistics, where this PyTorch's "
                "BatchNorm takes it.")
        factor = self._average_factor()
        # Running statistics are used in eval mode and updated in training mode when tracked.
        use_running = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_running else None
        running_var = self.running_var if use_running else None

        world_size = 1
        if self.training and bn_training and is_distributed():
            world_size = group_world_size(self.process_group)
        if world_size == 1:
            return self._local_batch_norm(input, running_mean, running_var, bn_training, factor)
        return sync_batch_norm(input, self.weight, self.bias, running_mean, running_var,
                               self.eps, factor, self.process_group, world_size,
                               self.channel_last, self._count_cache)

    def __setstate__(self, state):
        super().__setstate__(state)
        # A layer pickled before these attributes existed, or by Apex's Python SyncBatchNorm
        # (served under its module path by the Apex alias), which had none of them: each in
        # the instance dict, so that the forward reads it plainly (Dynamo does not guard a
        # key missing from a module's __dict__: a layer compiled after such a one ran its
        # graph, without its fused ReLU).
        self.__dict__.setdefault("channel_last", False)
        self.__dict__.setdefault("fuse_relu", False)
        self.__dict__.setdefault("_count_cache", {})

    def __getstate__(self):
        # Launch plans hold compiled kernels (not picklable, and tied to this process's GPU):
        # a copy or an unpickled module makes its own on first use.
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__")
                     else self.__dict__)
        cache = state.get("_count_cache")
        if cache:
            # (And what the ranks agreed on: a copy checks again, as its peers' copies do.)
            state["_count_cache"] = {k: v for k, v in cache.items()
                                     if k[0] not in ("plan", "agreed")}
        return state

    def __reduce_ex__(self, protocol):
        if self.__dict__.get("process_group") is not None:
            # (PyTorch's own message named only the ProcessGroup type, not the layer or a way.)
            raise TypeError(
                f"SyncBatchNorm({self.num_features}, process_group=<custom>) cannot be pickled "
                "(torch.save of the whole model, a multiprocessing queue): a process group is "
                "this process's handle on its ranks' communicator, not data. Save "
                "model.state_dict() instead; or set layer.process_group = None before saving "
                "and give the loaded layer its group again (copy.deepcopy keeps the group).")
        return super().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        # A process group is a handle on the ranks' communicator, not data, and cannot be
        # copied: a copy of the layer (of a model, e.g. for an EMA of its weights) syncs over
        # the same group. Everything else is copied as usual.
        group = self.__dict__.get("process_group")
        if group is not None:
            memo.setdefault(id(group), group)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.channel_last:
            text += ", channel_last=True"
        if self.fuse_relu:
            text += ", fuse_relu=True"
        if self.process_group is not None:
            text += ", process_group=<custom>"
        return text
