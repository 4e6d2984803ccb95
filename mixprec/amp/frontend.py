"""``amp.initialize`` and ``amp.scale_loss``: Apex's entry points."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import numbers
import sys
import warnings
import weakref
from collections.abc import MutableMapping
from typing import Dict, Iterator, List, Optional, Set

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mixprec._checks import check_flag, first_forward_pending, listed
from mixprec.amp._logging import is_rank_zero, log_rank0
from mixprec.amp._model import (
    _standalone_masters,
    agree_on_overflow,
    cast_module_tensors,
    convert_model,
    converted_part_of,
    is_amp_model,
    register_masters,
    separate_shared_version_counters,
    set_live_masters,
)
from mixprec.amp._properties import describe_opt_level, resolve_properties
from mixprec.amp._state import (
    AmpState,
    BlockBackwards,
    SyncParamGroupsOnLoad,
    guard_inner_optimizers,
    hookable_optimizer,
    mastered_elsewhere,
    optimizer_state,
    refuse_inner_optimizer,
)
from mixprec.amp.scaler import check_scale_order
from mixprec.normalization._launch import is_compiling

__all__ = [
    "initialize",
    "load_state_dict",
    "master_params",
    "scale_loss",
    "state_dict",
    "step_was_skipped",
]

# The one documented default: module-level amp.state_dict()/load_state_dict() act on the most
# recent initialize. Everything else reaches its state through the optimizer it is given.
_latest: Optional[AmpState] = None
# The initialize calls given optimizers, oldest first, held weakly (see latest_state).
_calls: List[weakref.ref] = []


def _as_list(value, what: str, kind, kind_name: str):
    if isinstance(value, (list, tuple)):
        items, single = list(value), False
    else:
        items, single = [value], True
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(
                f"amp.initialize({what}=...): got {type(item).__name__}; expected a "
                f"{kind_name} or a list of them."
            )
    return items, single


def _sharded_modules(model: nn.Module) -> list:
    """The modules inside ``model`` that PyTorch's FSDP shards: ``FullyShardedDataParallel``
    (FSDP1) instances and modules given to ``fully_shard`` (FSDP2), outermost first."""
    if not torch.distributed.is_available():
        return []
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover (a build without FSDP)
        return []
    fsdp2 = _fsdp2_class()
    kinds = (FullyShardedDataParallel,) + ((fsdp2,) if fsdp2 is not None else ())
    return [m for m in model.modules() if isinstance(m, kinds)]


def _fsdp2_class():
    """FSDP2's module class (``fully_shard`` makes a module one), or None."""
    if not torch.distributed.is_available():
        return None
    try:
        import torch.distributed.fsdp as fsdp
    except ImportError:  # pragma: no cover (a build without FSDP)
        return None
    fsdp2 = getattr(fsdp, "FSDPModule", None)
    if fsdp2 is None:  # (PyTorch 2.4/2.5: not exported there yet)
        try:
            from torch.distributed._composable.fsdp import FSDPModule as fsdp2
        except ImportError:  # pragma: no cover
            fsdp2 = None
    return fsdp2


def _fsdp2_parameters(model: nn.Module) -> set:
    """Ids of the parameters ``model``'s ``fully_shard`` modules hold now: between a forward
    and its backward a root one holds unsharded stand-ins of the sharded parameters the
    optimizer has (their gradients are reduce-scattered into those)."""
    fsdp2 = _fsdp2_class()
    if fsdp2 is None:
        return set()
    return {id(p) for m in model.modules() if isinstance(m, fsdp2) for p in m.parameters()}


def _check_sharded(model: nn.Module, props) -> None:
    """A model sharded by FSDP before ``initialize``: O1 works (fp32 parameters, autocast in
    the forward; the ranks agree on each overflow, made so here for FSDP1); a half model
    with fp32 masters cannot be made of FSDP's sharded parameters (FSDP gathers its own dtype,
    keeps one flat parameter per wrapped module, and checkpoints those)."""
    sharded = _sharded_modules(model)
    if not sharded:
        return
    if props.cast_model_type is not None and props.cast_model_type != torch.float32:
        raise ValueError(
            f'amp.initialize(models={type(model).__name__}(...), opt_level="{props.opt_level}"): '
            f"the model is sharded by FSDP ({type(sharded[0]).__name__}), whose parameters "
            "are shards (or flat parameters) that FSDP gathers in its own dtype: amp cannot "
            "make a half model with fp32 master weights of them (the forward fails on mixed "
            "dtypes, or checkpoints come out half). Use FSDP's own mixed precision, O2's recipe "
            "with sharded fp32 masters: fully_shard(..., mp_policy=MixedPrecisionPolicy("
            "param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) for FSDP2, or "
            "FullyShardedDataParallel(..., mixed_precision=MixedPrecision(...)) with "
            "ShardedGradScaler for fp16; or amp's opt_level=\"O1\" on the sharded model "
            "(shard first, build the optimizer, then amp.initialize).")
    from torch.distributed.fsdp import FullyShardedDataParallel

    for m in sharded:
        if isinstance(m, FullyShardedDataParallel):
            # FSDP1 reduces the still-scaled gradients in its backward and each rank checks
            # only its shard: a skip must be every rank's (FSDP2's DTensor unscale agrees).
            agree_on_overflow(m, m.process_group)


def _check_model(model: nn.Module) -> None:
    wrapped = isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) or (
        type(model).__name__ == "DistributedDataParallel"
    )
    if wrapped:
        raise ValueError(
            f"amp.initialize(models={type(model).__name__}(...)): the model is already wrapped "
            "for data parallelism. Call amp.initialize on the bare model first, then wrap the "
            "returned model: `model, opt = amp.initialize(model, opt, ...); "
            "model = DistributedDataParallel(model)`."
        )
    if _is_compiled_module(model):
        raise ValueError(
            f"amp.initialize(models={type(model).__name__}(...)): the model was compiled "
            "with torch.compile before amp.initialize, so amp's casts would never run in "
            "it. Initialize the bare model, then compile the returned one: `model, opt = "
            "amp.initialize(model, opt, ...); model = torch.compile(model)`."
        )
    lazy = [name or type(model).__name__ for name, m in model.named_modules()
            if first_forward_pending(m)]
    if lazy:
        # The lazy hook turns the layer into its plain class at its first forward, dropping
        # the class amp gives it (an amp root model, O1's fp32 BatchNorm): that forward
        # failed with "object has no attribute '_mixprec_cast_forward'", also where
        # load_state_dict had given the layer its shapes; O2's masters cannot be made from
        # parameters without a shape.
        raise ValueError(
            f"amp.initialize(models={type(model).__name__}(...)): lazy layers that have not "
            f"seen an input yet ({', '.join(lazy[:5])}{', ...' if len(lazy) > 5 else ''}): "
            "their first forward turns them into their plain classes (LazyLinear into "
            "Linear), which undoes amp's preparation, and a layer without a shape has "
            "nothing to cast. Run one forward pass on a dummy batch before "
            "amp.initialize (and before building the optimizer, as PyTorch asks), or give "
            "the layers their sizes (nn.Linear, nn.BatchNorm2d)."
        )
    if is_amp_model(model):
        raise ValueError(
            f"amp.initialize(models={type(model).__name__}(...)): this model already went "
            "through amp.initialize. Initialize each model once; build a new model to try "
            "another opt level. An optimizer cannot be added to it by a second call: build "
            "the optimizer before amp.initialize and pass both in one call, `model, opt = "
            "amp.initialize(model, opt, ...)`. For a second training phase (layers "
            "unfrozen, another learning rate), give the optimizer the new parameters with "
            "opt.add_param_group(...) or change its groups' settings; for a new optimizer, "
            "build a new model, load model.state_dict() into it, and initialize both. The "
            "same for inference at another precision (a model unpickled from torch.save "
            "included): state_dict() holds the fp32 weights, so load it into a fresh model "
            "and initialize or cast that one."
        )


def _refuse_part_of_amp_model(model: nn.Module) -> None:
    outer = converted_part_of(model)
    if outer is not None:
        raise ValueError(
            f"amp.initialize(models={type(model).__name__}(...)): this model is inside a "
            f"model that an earlier amp.initialize cast to half ({type(outer).__name__}). "
            "Called inside it, this model's own casts would hand fp32 outputs to half layers. "
            "To call the part on its own as well, initialize the two together, on fresh fp32 "
            "models: "
            "`[outer, part], opt = amp.initialize([outer, outer.part], opt, ...)`; else call "
            "the part as it is (it is already half)."
        )


def _refuse_if_inside_ddp(models: List[nn.Module]) -> None:
    """Refuse to cast a model to half that a PyTorch ``DistributedDataParallel`` built earlier
    holds (directly or through wrapper modules: Lightning 1.x wraps before its Apex plugin
    calls ``initialize``). Changing a parameter's dtype replaces its gradient accumulator,
    which carries DDP's all-reduce hooks: the gradients would silently stop being averaged
    (Apex's O2 had the same trap). Looked up once, and only in a distributed run."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    import gc

    ddp_type = nn.parallel.DistributedDataParallel
    ids = {id(m): m for m in models}
    for owner in gc.get_objects():  # (one pass over the live objects; DDPs are few)
        if not issubclass(type(owner), ddp_type):  # (type(): a dead weak proxy cannot raise)
            continue
        model = next((ids[id(m)] for m in owner.module.modules() if id(m) in ids), None)
        if model is not None:
            raise ValueError(
                f"amp.initialize: the {type(model).__name__} passed is inside a "
                f"{type(owner).__name__} built before initialize. Casting it to half (this "
                "opt level) replaces the gradient hooks DistributedDataParallel installed on "
                "its parameters, so their gradients would silently never be averaged across "
                "ranks. Call amp.initialize on the bare model first and wrap the returned "
                "model afterwards, or use opt_level='O1' (parameters stay fp32)."
            )


def _is_compiled_module(model: nn.Module) -> bool:
    # Dynamo is only loaded once something was compiled: no import (over a second) just to ask.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    module_type = getattr(eval_frame, "OptimizedModule", None)
    return module_type is not None and isinstance(model, module_type)


def _warn_if_already_half(models: List[nn.Module], props) -> None:
    """Apex refused models whose parameters were already half; amp takes them, but where the
    level keeps fp32 weights the user's ``.half()`` loses them: at O2 the precision is gone
    before the master weights are made, and O1 (which keeps the parameters as given) would
    train the half parameters themselves, with no fp32 weights at all."""
    if props.master_weights:
        consequence = "the fp32 master weights (O2) start from the rounded half values"
    elif props.cast_model_type is None:
        consequence = ("O1, which keeps the parameters as they are given, trains them in half "
                       "precision with no fp32 weights (and saves half checkpoints)")
    else:
        return
    # (Not those of a part an earlier initialize took, e.g. an O2 model inside this O1 one:
    # they are half by that call, with their own masters.)
    taken = {id(p) for m in models for sub in m.modules()
             if sub is not m and is_amp_model(sub) for p in sub.parameters()}
    halves = [p for m in models for p in m.parameters()
              if p.dtype in (torch.float16, torch.bfloat16) and id(p) not in taken]
    if halves and is_rank_zero():  # (once per job: initialize runs on every rank)
        # (A deep or unpickled copy of an O2 model, restored: its own masters are still there.)
        kept = any(_standalone_masters(m) for m in models)
        warnings.warn(
            f"amp.initialize: {len(halves)} parameter(s) of the model are already "
            f"{halves[0].dtype} (e.g. model.half() before initialize). amp casts the model "
            f"itself: pass the fp32 model, or {consequence}."
            + (" This model, prepared at O2 before (restored, or a copy of such a model), "
               "still holds its fp32 weights: "
               "load its state_dict() into the model built in fp32 and initialize that one."
               if kept else ""),
            stacklevel=3,
        )


def _warn_if_fp16_adaptive_state(opt_list, props) -> None:
    """O3 in fp16 (or O2 with ``master_weights=False``) steps the fp16 parameters themselves,
    so the optimizer's own state is fp16 too. An adaptive optimizer (one with ``eps``: Adam,
    AdamW, RMSprop, Adagrad...) keeps a second-moment estimate that underflows to 0 in fp16 for
    small gradients (Adam's ``(1 - beta2) * grad**2`` below 2**-25: every gradient under about
    5e-3 at beta2=0.999; the warning works it out for the group's ``beta2``). Computed in fp16
    (PyTorch's foreach and for-loop implementations), its default ``eps=1e-8`` is 0 too: the
    update divides by zero, inf/NaN weights at the first step. Computed in fp32 from the stored
    fp16 state (``fused=True``, mixprec's FusedAdam), the estimate read back each step is 0 or
    too small: updates far too large, the loss climbs. An eps of 1e-4 or more keeps either
    finite and moderate (the first moment over eps where the estimate underflowed), as
    docs/migrating.md advises: the warning then says so instead.
    Apex's O3 did the same (its "speed baseline"); the warning says why and what trains
    instead. bf16 has fp32's range: no warning."""
    if props.master_weights or not props.model_is_half or props.half_dtype != torch.float16:
        return
    from mixprec.optimizers import FusedAdam

    for opt in opt_list:
        for group in opt.param_groups:
            eps = group.get("eps")
            if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
                continue
            if not any(p.dtype == torch.float16 for p in group["params"]):
                continue
            if not is_rank_zero():
                return
            fused = bool(group.get("fused")) or isinstance(opt, FusedAdam)
            if fused and eps < 1e-4:
                consequence = ("Computed in float32 from that state (a fused kernel), the "
                               "update divided by its square root comes out far too large: "
                               "the loss climbs instead of falling.")
            elif not fused and float(torch.tensor(float(eps), dtype=torch.float16)) == 0.0:
                consequence = (f"Its eps={eps!r} is 0.0 in float16, so where the "
                               "estimate underflowed the update divides by zero: inf/NaN "
                               "weights, usually at the first step.")
            else:
                consequence = (f"Its eps={eps!r} keeps the update finite, but where the "
                               "estimate underflowed the update is the first moment over eps "
                               "alone: " + ("steps far larger than Adam's for small gradients "
                                            "(eps=1e-4 or more keeps them moderate)."
                                            if eps < 1e-4 else
                                            "larger steps than Adam's for small gradients."))
            warnings.warn(
                f"amp.initialize(opt_level={props.opt_level!r}): {type(opt).__name__} "
                "steps float16 parameters with float16 state (no fp32 master weights). An "
                "adaptive optimizer's second-moment estimate underflows to 0 in float16 for "
                f"small gradients{_underflow_example(group)}. {consequence} To train, use "
                "opt_level='O2' (fp32 master weights, in float16 or bfloat16); O3 in float16 "
                "suits a speed baseline.",
                stacklevel=3,
            )
            return


def _underflow_example(group) -> str:
    """Where Adam's ``(1 - beta2) * grad**2`` rounds to 0 in fp16 (below 2**-25), for the
    group's own ``beta2``; nothing for an optimizer without Adam's two ``betas`` (Adan's
    three put the second moment's decay last: which one it is cannot be told)."""
    betas = group.get("betas")
    try:
        if len(betas) != 2:
            return ""
        beta2 = float(betas[1])
    except (TypeError, IndexError, ValueError, RuntimeError):
        return ""
    if not 0.0 <= beta2 < 1.0:
        return ""
    return (f" (Adam's (1 - beta2) * grad**2: gradients below "
            f"~{(2.0 ** -25 / (1.0 - beta2)) ** 0.5:.1g} at beta2={beta2:g})")


def _check_half_supported(models: List[nn.Module], props) -> None:
    """bf16 asked for a model with parameters on a GPU without it: every model's every GPU."""
    if props.half_dtype != torch.bfloat16 or props.opt_level == "O0":
        return
    devices = {p.device for model in models for p in model.parameters() if p.is_cuda}
    for device in sorted(devices, key=str):
        with torch.cuda.device(device):
            supported = torch.cuda.is_bf16_supported()
        if not supported:
            raise RuntimeError(
                f"amp.initialize(dtype=torch.bfloat16): {torch.cuda.get_device_name(device)} "
                f"({device}) does not support bfloat16. Use dtype=torch.float16 (with dynamic "
                "loss scaling) on this GPU."
            )


def initialize(
    models,
    optimizers=None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type=None,
    patch_torch_functions=None,
    keep_batchnorm_fp32=None,
    master_weights=None,
    loss_scale=None,
    cast_model_outputs=None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: Optional[float] = None,
    max_loss_scale: float = 2.0**24,
    *,
    dtype: Optional[torch.dtype] = None,
):
    """Prepare models and optimizers for mixed-precision training (Apex's signature).

    Call it once per set of models, after moving them to their device and before wrapping them
    for data parallelism. The same model and optimizer objects come back, changed in place (see
    ``mixprec/amp/_model.py`` for exactly how).

    Opt levels (overridable one property at a time, as in Apex):

    ======  ==========================  ===============  ===========  ===============
    level   model parameters            per-op casting   master fp32  loss scale
    ======  ==========================  ===============  ===========  ===============
    O0      fp32                        no               no           1.0
    O1      fp32                        torch.autocast   no           dynamic
    O2      half, BatchNorm fp32        no               yes          dynamic
    O3      half                        no               no           1.0
    ======  ==========================  ===============  ===========  ===============

    With ``dtype=torch.bfloat16`` the default loss scale is a static 1.0 (bf16 has fp32's
    range); ``loss_scale="dynamic"`` still turns scaling on. Under O2/O3 floating inputs are
    cast to half on entry and floating outputs to fp32 (or ``cast_model_outputs``).
    ``model.state_dict()`` of an fp32 model holds fp32 tensors at every level: the master
    weights at O2 (``state_dict(keep_vars=True)`` returns the module's own tensors, as in
    torch). Pass the fp32 model: one made half beforehand (``model.half()``) is taken with a
    warning at O1, which keeps the parameters as given (they would train, and be saved, in
    half), and at O2, whose masters would start from the rounded values.

    Args:
        models (nn.Module or list[nn.Module]): the model(s), already on their device.
        optimizers (Optimizer or list[Optimizer], optional): their optimizer(s). Default None.
        enabled (bool): False turns every amp call into a no-op. Default True.
        opt_level (str): ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (letter O). Default ``"O1"``.
        cast_model_type (torch.dtype, optional): override: dtype of the model's parameters.
        patch_torch_functions (bool, optional): override: per-op casting (autocast).
        keep_batchnorm_fp32 (bool or "True"/"False", optional): override: BatchNorm in fp32.
            Honoured at O1 as well (BatchNorm then runs in fp32 with autocast off).
        master_weights (bool, optional): override: fp32 master weights in the optimizer.
        loss_scale (float, str, optional): override: a number, a string holding one, or
            ``"dynamic"``.
        cast_model_outputs (torch.dtype, optional): dtype of the models' floating outputs.
        num_losses (int): number of losses, each with its own scaler (``loss_id``). Default 1.
        verbosity (int): 0 silences amp's log messages. Default 1.
        min_loss_scale (float, optional): floor of the dynamic loss scale. Default None.
        max_loss_scale (float): ceiling of the dynamic loss scale. Default ``2.**24``.
        dtype (torch.dtype, optional, keyword-only): the half type, ``torch.float16``
            (default) or ``torch.bfloat16``.

    Returns:
        ``models`` if ``optimizers`` is None, else ``(models, optimizers)``, each in the shape
        it was given (one object or a list).

    Example::

        >>> model = Net().cuda()
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> for x, y in loader:
        ...     optimizer.zero_grad()
        ...     loss = F.cross_entropy(model(x.cuda()), y.cuda())
        ...     with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...         scaled_loss.backward()
        ...     optimizer.step()
        >>> torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
        ...             "amp": amp.state_dict()}, "checkpoint.pt")
    """
    model_list, single_model = _as_list(models, "models", nn.Module, "torch.nn.Module")
    if isinstance(optimizers, str):
        hint = (f" It looks like an opt level: pass it by name, amp.initialize(model, optimizer, "
                f"opt_level={optimizers!r})." if optimizers.strip().upper() in
                ("O0", "O1", "O2", "O3", "00", "01", "02", "03") else "")
        raise TypeError(f"amp.initialize(optimizers={optimizers!r}): expected a "
                        f"torch.optim.Optimizer, a list of them, or None.{hint}")
    enabled = check_flag("amp.initialize", "enabled", enabled, strings=True)
    if optimizers is None:
        opt_list, single_opt = [], True
    else:
        opt_list, single_opt = _as_list(optimizers, "optimizers", object, "torch.optim.Optimizer")
        for opt in opt_list:
            inner = hookable_optimizer(opt)  # raises TypeError for non-optimizers
            if inner is opt:
                continue
            # A wrapper (LARC-style) stands for the optimizer it wraps.
            if not hasattr(opt, "__dict__"):
                raise TypeError(
                    f"amp.initialize(optimizers=...): {type(opt).__name__} wraps a "
                    f"{type(inner).__name__} but has no instance __dict__ (its class defines "
                    "__slots__), so amp cannot put its step hook on the wrapper. Add "
                    "'__dict__' to its __slots__, or pass the wrapped optimizer itself.")
            missing = [name for name in ("step", "zero_grad", "state") if not hasattr(opt, name)]
            if missing:
                raise TypeError(
                    f"amp.initialize(optimizers=...): {type(opt).__name__} wraps a "
                    f"{type(inner).__name__} but has no {', '.join(missing)}. amp uses a "
                    "wrapper as the optimizer it stands for: its step, zero_grad and state "
                    "(the wrapped optimizer's state, as LARC's `state` property gives it), "
                    "beside param_groups. Define the missing ones on "
                    f"{type(opt).__name__}, delegating to its .optim, or pass the wrapped "
                    "optimizer itself.")
    if not isinstance(num_losses, int) or isinstance(num_losses, bool) or num_losses < 1:
        raise ValueError(f"amp.initialize(num_losses={num_losses!r}): must be an int >= 1.")
    if not isinstance(verbosity, int) or isinstance(verbosity, bool) or verbosity < 0:
        raise (ValueError if isinstance(verbosity, int) and verbosity < 0 else TypeError)(
            f"amp.initialize(verbosity={verbosity!r}): must be an int >= 0, 0 to silence "
            "amp's log messages or 1 (the default) for them.")
    for name, value in (("min_loss_scale", min_loss_scale), ("max_loss_scale", max_loss_scale)):
        if value is None and name == "min_loss_scale":
            continue
        if (not isinstance(value, numbers.Real) or isinstance(value, bool)
                or not value > 0 or (name == "min_loss_scale" and value == float("inf"))):
            raise ValueError(
                f"amp.initialize({name}={value!r}): must be a positive number (the dynamic "
                f"loss scale's {'floor' if name == 'min_loss_scale' else 'ceiling'})"
                + (", or None for the default floor, 2**-24." if name == "min_loss_scale"
                   else "; the default is 2.**24."))
    check_scale_order("amp.initialize", min_loss_scale, max_loss_scale)

    def result():
        if optimizers is None:
            return models
        return models, optimizers

    seen = set()
    for opt in opt_list:
        if id(opt) in seen:
            raise ValueError(
                f"amp.initialize(optimizers=[...]): the same {type(opt).__name__} appears "
                "twice in the list. Pass each optimizer once."
            )
        seen.add(id(opt))
        if optimizer_state(opt) is not None:
            raise ValueError(
                f"amp.initialize: the optimizer {type(opt).__name__} already went through "
                "amp.initialize. Pass each optimizer once; to add models, initialize them "
                "together in one call (lists of models and optimizers). To try another opt "
                "level or dtype (a notebook cell run again), build a new model and optimizer "
                "(or load model.state_dict(), which holds fp32 weights, into fresh ones) and "
                "initialize those: amp.initialize cannot be undone."
            )

    if not enabled:
        state = AmpState(None, False, model_list, num_losses, min_loss_scale, max_loss_scale,
                         verbosity)
        for opt in opt_list:
            state.add_optimizer(opt)
        _set_latest(state, opt_list)
        return result()

    props = resolve_properties(
        opt_level, dtype=dtype, cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions, keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights, loss_scale=loss_scale,
        cast_model_outputs=cast_model_outputs,
    )
    for i, model in enumerate(model_list):
        _check_model(model)
        _check_sharded(model, props)
        _refuse_part_of_amp_model(model)
        if any(model is other for other in model_list[:i]):
            raise ValueError(
                f"amp.initialize(models=[...]): the same {type(model).__name__} appears twice "
                "in the list. Pass each model once."
            )
    _check_half_supported(model_list, props)
    if props.model_is_half:
        _refuse_if_inside_ddp(model_list)
    # Which parameters the conversion will cast to half (their fp32 values become masters).
    cast_ids = set()
    if props.model_is_half:
        keep_bn = props.keep_batchnorm_fp32 is True
        for model in model_list:
            for module in model.modules():
                if keep_bn and isinstance(module, _BatchNorm):
                    continue
                cast_ids.update(id(p) for p in module.parameters(recurse=False)
                                if p.is_floating_point())
    model_param_ids = {id(p) for m in model_list for p in m.parameters()}
    for opt in opt_list:
        for p in (p for g in opt.param_groups for p in g["params"]):
            if id(p) not in model_param_ids:
                raise ValueError(
                    f"amp.initialize: {type(opt).__name__} holds a parameter of shape "
                    f"{tuple(p.shape)} that belongs to none of the models passed. Pass every "
                    "model whose parameters the optimizers update (a list is fine). A bare "
                    "nn.Parameter (a learnable loss weight, say) can go in a module passed "
                    "with the models (cast to half with them at O2/O3), or be added after "
                    "initialize with optimizer.add_param_group (stepped in fp32 as it is)."
                )

    elsewhere = frozenset()  # (half parameters an earlier call's optimizer keeps masters for)
    if props.master_weights:
        mastered = list(mastered_elsewhere())
        _refuse_shared_masters(opt_list, model_list, cast_ids, mastered)
        elsewhere = {id(h) for h, _ in mastered}
    _warn_if_already_half(model_list, props)
    if props.model_is_half and props.keep_batchnorm_fp32 is True:
        # BatchNorm stays fp32: cast back now a model .half()-ed by the user, so that its
        # parameters are stepped as they are (no masters), before the optimizers are set up.
        for model in model_list:
            for module in model.modules():
                if isinstance(module, _BatchNorm):
                    cast_module_tensors(module, torch.float32)

    if props.master_weights:
        for opt in opt_list:  # (before any optimizer is changed)
            refuse_inner_optimizer(opt, cast_ids)
    state = AmpState(props, True, model_list, num_losses, min_loss_scale, max_loss_scale,
                     verbosity)
    masters = []  # (the optimizer's amp state, its {half parameter: master})
    for opt in opt_list:
        opt_state = state.add_optimizer(opt)
        masters.append((opt_state, opt_state.adopt_params(props.master_weights, cast_ids)))
        opt_state.install_hooks(hookable_optimizer(opt))
        opt_state.install_skipping_step(opt)
        if props.master_weights:
            guard_inner_optimizers(opt, opt_state)
    # A model and its own submodule in one call (``[outer, outer.sub]``, to call the part on
    # its own too): inside the enclosing forward the part is a half layer (no fp32 outputs).
    # (How many of the others each model is inside: the enclosing ones convert first.)
    depth = {id(m): sum(any(m is sub for sub in other.modules()) for other in model_list
                        if other is not m) for m in model_list}
    inside = {i for i, d in depth.items() if d}
    encloses = {id(other) for other in model_list
                if any(id(sub) in inside for sub in other.modules() if sub is not other)}
    for model in model_list:
        # Before convert_model's own hooks (an enclosing model's reach its parts), so that a
        # checkpoint loaded after a late optimizer.add_param_group finds the new group's
        # masters in place. (Those of an earlier call on a model restored since go: each
        # restore_model + initialize cycle added one.)
        for table in (model._load_state_dict_pre_hooks,
                      getattr(model, "_state_dict_pre_hooks", {})):
            for key, hook in list(table.items()):
                if isinstance(getattr(hook, "hook", hook), SyncParamGroupsOnLoad):
                    del table[key]
        model._register_load_state_dict_pre_hook(SyncParamGroupsOnLoad(state))
        register = getattr(model, "register_state_dict_pre_hook", None)
        if props.master_weights and register is not None:
            register(SyncParamGroupsOnLoad(state))  # (a state dict taken before a step too)
    # Enclosing models first: a part's own conversion comes last and sets its forward (an
    # enclosing model's would replace it with a layer's: an embedding's max_norm, O1's
    # BatchNorm).
    for model in sorted(model_list, key=lambda m: depth[id(m)]):
        convert_model(model, props, encloses=id(model) in encloses,
                      enclosed=id(model) in inside)
        for opt_state, its_masters in masters:
            register_masters(model, its_masters, opt_state.take_model_writes)
        if props.master_weights and masters:
            set_live_masters(model, [opt_state for opt_state, _ in masters])
    if props.master_weights and props.model_is_half:
        separate_shared_version_counters(model_list, elsewhere)
    for model in model_list:
        for p in model.parameters():
            if p.dtype == torch.float32:
                state.fp32_params.add(id(p))
    for opt_state, _ in masters:
        opt_state.match_plain_state_dtypes()
        opt_state.record_synced()  # (the half parameters as the conversion left them)
    _warn_if_fp16_adaptive_state(opt_list, props)
    _set_latest(state, opt_list)
    if verbosity > 0:
        log_rank0(logging.INFO, "amp: opt_level %s (%s): %s", props.opt_level,
                  describe_opt_level(props.opt_level), props.describe())
    return result()


def _loss_error(loss) -> Optional[str]:
    if not isinstance(loss, torch.Tensor):
        return f"got {type(loss).__name__}; expected a torch.Tensor."
    if not loss.is_floating_point():
        return f"got a {loss.dtype} tensor; the loss must be floating point."
    if loss.numel() != 1:
        return (f"got a tensor of shape {tuple(loss.shape)}; the loss must be a scalar. "
                "Reduce it first, e.g. loss.mean().")
    return None


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers,
    loss_id: int = 0,
    model=None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """Context manager: yield ``loss * loss_scale``; on exit, unscale the gradients.

    On exit the gradients of the optimizers' parameters (the fp32 masters at O2) hold the
    unscaled gradient, accumulated onto what they held before, and are checked for inf/NaN in
    the same fused pass. With dynamic scaling an overflow halves the scale and makes the next
    ``optimizer.step()`` a no-op. Where every optimizer is fused (takes ``found_inf`` in its
    kernel, as ``GradScaler`` uses it) and holds its parameters on one device, the scale lives on
    that device and kernels update it: no host-device sync at all, and the step can be captured
    in a CUDA graph (after at least one eager step). Otherwise the flag is read on the host, the
    step's one sync, and an overflow frees the gradients. Static scaling (bf16's default) never
    syncs.

    Args:
        loss (Tensor): a floating scalar.
        optimizers (Optimizer or list[Optimizer]): optimizer(s) returned by ``initialize``.
        loss_id (int): which loss scaler to use, in ``[0, num_losses)``. Default 0.
        model: accepted for Apex compatibility; unused.
        delay_unscale (bool): leave the gradients scaled (inner micro-batches of gradient
            accumulation); the last backward before ``step()`` must not delay. Default False.
            A backward under :class:`mixprec.parallel.DistributedDataParallel`'s ``no_sync()``
            (or after its ``disable_allreduce()``), or under PyTorch's own DDP's ``no_sync()``
            in an eager forward, is always delayed so: the synced backward that follows then
            all-reduces every micro-batch's gradient, not its own alone.
        delay_overflow_check (bool): leave the inf/NaN decision (the skip and the scale's
            update) to the next ``optimizer.step()`` (or ``zero_grad()``), which checks the
            gradients as they are then: for gradients all-reduced by hand after the block
            (BERT's post-accumulation reduction), so that every rank skips the same steps.
            Apex left that check to the script. Default False.

    Yields:
        Tensor: the scaled loss, to call ``.backward()`` on.

    Example::

        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
    """
    del model
    delay_unscale = check_flag("amp.scale_loss", "delay_unscale", delay_unscale)
    delay_overflow_check = check_flag("amp.scale_loss", "delay_overflow_check",
                                      delay_overflow_check)
    opt_list = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not opt_list:
        raise ValueError(
            f"amp.scale_loss(loss, optimizers={optimizers!r}): no optimizer given. Pass the "
            "optimizer (or a list of the optimizers) that amp.initialize returned.")
    for opt in opt_list:
        if not (isinstance(opt, torch.optim.Optimizer)
                or isinstance(getattr(opt, "optim", None), torch.optim.Optimizer)):
            raise TypeError(
                f"amp.scale_loss(loss, optimizers=...): got {type(opt).__name__}; expected "
                "the torch.optim.Optimizer (or a list of them) that amp.initialize returned, "
                "as the second argument: amp.scale_loss(loss, optimizer).")
    # (A wrapper made after initialize, LARC(optimizer): its inner optimizer's state.)
    states = [_state_through_wrapper(opt) for opt in opt_list]
    if any(s is None for s in states):
        raise RuntimeError(
            "amp.scale_loss was given an optimizer that did not go through amp.initialize. "
            "Call `model, optimizer = amp.initialize(model, optimizer, opt_level=...)` first "
            "and pass the returned optimizer (an optimizer built after amp.initialize of its "
            "model cannot join it later: build the optimizer first, then initialize both in "
            "one call). A copy of a prepared optimizer (copy.deepcopy, or torch.save of the "
            "object) is a plain optimizer: to duplicate a run, build a new model and "
            "optimizer, amp.initialize them, and load the state dicts (model, optimizer, "
            "amp.state_dict())."
        )
    # Each optimizer's gradients unscaled once: the same optimizer listed twice (or a wrapper
    # such as LARC beside its inner optimizer, which share one state) would divide them twice.
    states = list({id(s): s for s in states}.values())
    amp_state = states[0].amp_state
    if any(s.amp_state is not amp_state for s in states):
        raise ValueError(
            "amp.scale_loss: the optimizers come from different amp.initialize calls, which "
            "have separate loss scalers, so no one scale can be unscaled for all of them. A "
            "loss whose backward runs through the models of both calls needs them in one "
            "call: amp.initialize([model_a, model_b], [opt_a, opt_b], ...). Separate losses "
            "of separate calls go through one scale_loss block each."
        )
    if not amp_state.enabled:  # (Apex's no-op: the loss goes through as it is)
        yield loss
        return
    amp_state.last_block = next(_EVENTS)  # (see _warn_if_several_calls)
    error = _loss_error(loss)
    if error is not None:
        raise (TypeError if not isinstance(loss, torch.Tensor) else ValueError)(
            f"amp.scale_loss(loss=...): {error}"
        )
    loss_id = amp_state.loss_index(loss_id)
    scaler = amp_state.scalers[loss_id]
    device = amp_state.scale_device(states, loss_id)
    if device is not None and loss.device != device:
        device = None  # (a loss computed on another device than the parameters': host scale)
    if device is None:
        if scaler.dynamic and loss.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "amp.scale_loss inside CUDA graph capture with dynamic loss scaling, but an "
                "optimizer cannot skip an overflowed step on the GPU, so the overflow flag "
                "would have to be read on the host, which a captured graph cannot do. Use a "
                "fused optimizer with all its parameters on one GPU (e.g. torch.optim.AdamW(..., "
                "fused=True)), or pass a fixed scale to amp.initialize (e.g. loss_scale=128.0 "
                "for fp16; bf16 already defaults to a static 1.0)."
            )
        scaler.release_device()
    amp_state.resolve_pending()
    # The dynamic scale stays on the device where it can: no host sync, capturable.
    scale = scaler.device_state(device).scale if device is not None else scaler.loss_scale
    if any(s.scale_loss_open for s in states):
        raise RuntimeError(
            "amp.scale_loss: a scale_loss block of this optimizer is already open (nested "
            "blocks). Each block scales one loss for the backward inside it and unscales its "
            "gradients on exit: nested over one optimizer, a backward inside would be unscaled "
            "by both (or by the wrong loss's scale). Sum the losses inside one block, or close "
            "each block (its backward done) before the next one opens."
        )
    for s in states:
        s.scale_loss_open = True
    try:
        # (Made before any gradient is set aside: its failure leaves nothing to give back.)
        if device is not None:
            scaled = loss.float() * scale
        else:
            scaled = loss.float() if scale == 1.0 else loss.float() * scale
        for s in states:
            s.before_backward(scaler, scale)
        # (Until an unscaling block after this loss's first: which parameters no optimizer
        # holds its backward writes; see UnheldWatch.)
        unheld = (UnheldWatch(amp_state) if loss_id not in amp_state.looked_for_unheld
                  and (scaler.dynamic or scaler.loss_scale != 1.0
                       or amp_state.properties.master_weights) else None)
        # Other optimizers (this call's, or another call's), whose parameters this backward
        # may reach too (a loss through two models given one optimizer here): what it
        # writes there is unscaled as it lands; under a dynamic scale, checked at their next
        # block, and their step() before one is refused (see ForeignBackwardWatch).
        # (At a static 1.0, only those holding a window or an open block at another scale.)
        # (A loss that needs no gradient, under torch.inference_mode say, has no backward.)
        watches, block, block_hook = [], None, None
        others = _other_optimizer_states(amp_state, states) if scaled.requires_grad else []
        if others:
            own = {id(p) for s in states for p in s.plain}
            if not is_compiling():
                # (Which backwards are this block's: those through its scaled loss.)
                block = BlockBackwards()
                block_hook = scaled.register_hook(block)
                for s in states:  # (see ForeignBackwardWatch: one backward, two scales)
                    s.open_block = block
            unscaled: Set[int] = set()  # (a parameter two of them hold: unscaled once)
            try:
                for o in others:
                    watches.append(o.watch_foreign_backward(own, block, scale, unscaled,
                                                            scaler))
            except BaseException:
                for watch in watches:  # (none left hooked for a block that never opened)
                    watch.close()
                if block_hook is not None:
                    block_hook.remove()
                raise
        try:
            yield scaled
        except BaseException:
            # The block raised (a caller skipping an out-of-memory backward goes on training):
            # the gradients of earlier backwards, set aside for this one, are given back.
            for s in states:
                s.abandon_backward()
            if unheld is not None:
                unheld.discard()
            raise
        finally:
            if block_hook is not None:
                block_hook.remove()
            for watch in watches:
                watch.close()
            if unheld is not None:
                unheld.close(loss_id, scale)

        # Per optimizer: one whose model ran this forward inside DDP's no_sync() keeps its
        # gradients scaled for the synced backward to all-reduce; the others unscale as usual.
        unscale = []
        for s in states:
            if delay_unscale or s.grad_sync_deferred():
                s.hold_scaled(scaler, scale)
            else:
                unscale.append(s)
        if not unscale:
            return
        flags, done = [], set()
        for s in unscale:
            # (A parameter two of them hold, a layer shared by two models: unscaled once.)
            flags.extend(s.unscale(scaler, skip=done))
            if len(unscale) > 1:
                done.update(id(p) for p in s.plain)
        if delay_overflow_check:
            amp_state.defer_overflow(unscale, loss_id, flags)
        else:
            amp_state.record_overflow(unscale, loss_id, flags)
            for watch in watches:
                if watch.noted:  # (its marks: this block's own decision, for the back-off)
                    watch.state.foreign_decided(scaler)
        reached = any(s.reached for s in unscale)
        if not reached and not amp_state.warned_unreached:
            amp_state.warned_unreached = True
            if is_rank_zero():
                warnings.warn(
                    "amp.scale_loss: the backward gave none of the optimizer's parameters a "
                    "gradient, so its step changes nothing. If the model was given new "
                    "parameter objects after amp.initialize (sharded by FSDP's fully_shard or "
                    "FullyShardedDataParallel, parameters replaced), the optimizer still "
                    "holds the old ones: shard first, build the optimizer on the sharded "
                    "model, then amp.initialize it (opt_level='O1'). (Warned once.)",
                    UserWarning, stacklevel=3)
        if amp_state.unheld_pending:
            _warn_unheld_grads(amp_state, report=reached)  # (else the warning above says more)
    finally:
        for s in states:
            s.scale_loss_open = False
            s.open_block = None


class UnheldWatch:
    """For one ``scale_loss`` block: a post-accumulate-grad hook on each of the call's models'
    parameters that requires grad but that no optimizer of any live ``initialize`` call holds,
    noting those its backward accumulates into (hooks, not gradient versions: a stale
    gradient that is a view into PyTorch's DDP bucket changes version with its neighbours'
    all-reduce). Their gradients stay multiplied by the loss scale, and at O2 a half one has
    no master: an optimizer that steps them outside amp (NVIDIA's Transformer-XL passed its
    dense Adam to initialize but not the SparseAdam over its sparse embedding; at O2 fp16
    that embedding went NaN at the second step, and every later step was skipped as an
    overflow) applies them so. Apex said nothing. A loss's blocks are watched until an
    unscaling block (its own, or another loss's that unscales what it held), so a few times
    per loss; a learnable loss module outside the models is not looked at."""

    def __init__(self, amp_state: AmpState):
        self.amp_state = amp_state
        held = set()
        for ref in _calls:
            call = ref()
            if call is None or not call.enabled:
                continue
            for s in call.optimizer_states():
                held.update(id(h) for h, _ in s.pairs)
                optimizer = s.optimizer_ref()  # (a group added since, no masters yet, too)
                if optimizer is not None:
                    held.update(id(p) for g in optimizer.param_groups for p in g["params"])
        self.hit: Dict[int, tuple] = {}
        self.handles = []
        models = amp_state.models
        for i, model in enumerate(models):
            prefix = f"models[{i}]." if len(models) > 1 else ""
            sharded = _fsdp2_parameters(model)  # (their optimizer holds the shards)
            for name, p in model.named_parameters():
                if p.requires_grad and id(p) not in held and id(p) not in sharded:
                    held.add(id(p))  # (a parameter two models share: once)
                    self.handles.append(p.register_post_accumulate_grad_hook(
                        functools.partial(self._accumulated, len(self.handles),
                                          prefix + name)))

    def _accumulated(self, order: int, name: str, param: torch.Tensor) -> None:
        self.hit[id(param)] = (order, name, param.dtype)

    def discard(self) -> None:
        """The block raised: its backward's gradients were given back; nothing to note."""
        for handle in self.handles:
            handle.remove()
        self.handles = None

    def close(self, loss_id: int, scale) -> None:
        if self.handles is None:
            return
        self.discard()
        _, earlier = self.amp_state.unheld_pending.get(loss_id, (None, {}))
        self.amp_state.unheld_pending[loss_id] = (scale, {**earlier, **self.hit})


def _warn_unheld_grads(amp_state: AmpState, report: bool) -> None:
    """After an unscaling block: what the blocks watched since the last one found (see
    :class:`UnheldWatch`), warned about once per loss; those losses are not watched again."""
    pending, amp_state.unheld_pending = amp_state.unheld_pending, {}
    amp_state.looked_for_unheld.update(pending)
    props = amp_state.properties
    found, half, scales = {}, False, set()
    for scale, hit in pending.values():
        if not hit:
            continue
        scale_value = float(scale)  # (a device scale: one sync, for a few blocks per loss)
        for key, (order, name, dtype) in hit.items():
            is_half = dtype in (torch.float16, torch.bfloat16)
            if key in found or not (scale_value != 1.0 or (is_half and props.master_weights)):
                continue
            found[key] = (order, name)
            half = half or is_half
            if scale_value != 1.0:
                scales.add(scale_value)
    stray = [name for _, name in sorted(found.values())]  # (in the models' order)
    if not stray or not report or not is_rank_zero():
        return
    shown = listed(stray, most=4)
    what = []
    if scales:
        shown_scales = "/".join(f"{v:g}" for v in sorted(scales))
        what.append(f"their gradients stay multiplied by the loss scale ({shown_scales})")
    if half and props.master_weights:
        what.append("the half ones have no fp32 master weights")
    several = len(amp_state.models) > 1
    warnings.warn(
        f"amp.scale_loss: {len(stray)} parameter(s) of the model{'s' if several else ''} got "
        f"gradients in this backward that no optimizer given to amp.initialize holds: "
        f"{shown}. " + _sentence("; ".join(what)) + ", which an optimizer stepping them "
        "outside amp (a second optimizer, say a SparseAdam over a sparse embedding) does not "
        "know. Pass every optimizer to amp.initialize (a list: amp.initialize(model, [opt, "
        "opt_sparse], ...)) and a loss's optimizers to its scale_loss; freeze parameters that "
        "should not train (requires_grad_(False)). (Looked for once per loss_id, up to its "
        "first unscaling scale_loss block.)",
        UserWarning, stacklevel=4)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _other_optimizer_states(amp_state: AmpState, states) -> list:
    """The live optimizer states of ``amp_state``'s call and of the other live (enabled)
    calls, that are not in ``states`` and hold parameters (under a block at a static 1.0,
    only those holding, or opening during the block, a ``delay_unscale`` window or a block
    of their own get hooks: their gradients there are at a scale of their own)."""
    others = amp_state.other_optimizer_states(states)
    if len(_calls) > 1:
        for ref in _calls:
            call = ref()
            if call is not None and call is not amp_state and call.enabled:
                others.extend(call.optimizer_states())
    for o in others:
        # (A group added since initialize may hold the only directly stepped parameters:
        # picked up before the filter, or a backward into them would go unwatched.)
        o.sync_param_groups()
    # (With master weights only, O2 without BatchNorm, or under a block at a static 1.0:
    # watched for a block or a window it may open while this block is open, the hooks put on
    # then: see ForeignBackwardWatch.hook_half.)
    return [o for o in others if o.plain or o.pairs]


def _set_latest(state: AmpState, opt_list) -> None:
    # An initialize without optimizers (a frozen teacher, an EMA copy, inference) has loss
    # scalers that no scale_loss can use: it does not displace the training call's state.
    global _latest
    if opt_list:
        _calls[:] = [ref for ref in _calls if ref() is not None]
        _calls.append(weakref.ref(state))
    if opt_list or _latest is None:
        _latest = state
    state.created = next(_EVENTS)


def states_holding(module: nn.Module) -> List[AmpState]:
    """The live ``initialize`` calls (given optimizers) that prepared ``module`` or a module
    inside it, oldest first."""
    inside = {id(m) for m in module.modules()}
    states = [ref() for ref in _calls]
    return [s for s in states
            if s is not None and any(id(m) in inside for m in s.models)]


def latest_state() -> Optional[AmpState]:
    """The state module-level calls act on: the most recent ``initialize`` given optimizers
    whose optimizers are still alive (a later call whose optimizers are all gone, a trial or
    an LR finder run meanwhile, does not displace a live one); else the most recent one."""
    if _latest is None or _latest.optimizer_states():
        return _latest
    for ref in reversed(_calls):
        state = ref()
        if state is not None and state.optimizer_states():
            return state
    return _latest


# Module-level amp.state_dict()/load_state_dict() warned that several live calls have scalers
# of their own (once per process).
_WARNED_SEVERAL_CALLS = [False]
# Orders initialize calls and scale_loss blocks: AmpState.created, AmpState.last_block.
_EVENTS = itertools.count(1)


def _warn_if_several_calls(what: str, state: AmpState) -> None:
    """Module-level ``amp.state_dict()`` / ``load_state_dict()`` act on one ``initialize``
    call's loss scalers; where another call with live optimizers has run a ``scale_loss``
    block since ``state`` was made (a GAN ported with one call per model, training both), a
    checkpoint saved that way silently restarts the other call's scales on resume, where
    Apex's one global list held them all. (A call that trained before, an uninterrupted
    reference run kept beside a resumed one, does not count.)"""
    if _WARNED_SEVERAL_CALLS[0]:
        return
    live = [s for s in (ref() for ref in _calls)
            if s is not None and s is not state and s.last_block > state.created
            and s.optimizer_states()]
    if not live or not is_rank_zero():
        return
    _WARNED_SEVERAL_CALLS[0] = True
    warnings.warn(
        f"amp.{what}() without optimizer=: {len(live) + 1} amp.initialize calls with live "
        "optimizers each have their own loss scalers, and this acts on the most recent "
        "call's only, so the others' loss scales would restart from their initial values on "
        "resume (Apex kept one list for all). Save and load each call's with "
        "amp.state_dict(optimizer=opt) and amp.load_state_dict(..., optimizer=opt), or "
        "prepare the models in one call, amp.initialize([model_a, model_b], [opt_a, opt_b]). "
        "(Warned once.)", UserWarning, stacklevel=4)


def _state_through_wrapper(optimizer):
    """The amp state of ``optimizer``, or of the optimizer it wraps (``.optim``: a
    ``LARC(optimizer)`` made after ``initialize``, as ``scale_loss`` takes it); None if
    neither went through ``initialize``."""
    state = optimizer_state(optimizer)
    inner = getattr(optimizer, "optim", None)
    if state is None and inner is not None and inner is not optimizer:
        state = optimizer_state(inner)
    return state


def _current(what: str, optimizer=None) -> AmpState:
    if optimizer is not None:
        state = _state_through_wrapper(optimizer)
        if state is None:
            raise ValueError(
                f"amp.{what}(optimizer={type(optimizer).__name__}): this optimizer did not go "
                "through amp.initialize. Pass one that initialize returned (or a wrapper of "
                "it, such as LARC)."
            )
        return state.amp_state
    state = latest_state()
    if state is None:
        raise RuntimeError(f"amp.{what}() was called before amp.initialize().")
    _warn_if_several_calls(what, state)
    return state


def state_dict(destination=None, *, optimizer=None) -> dict:
    """The loss scalers of the most recent ``initialize`` given optimizers, in Apex's format.

    Args:
        destination (dict, optional): update this dict and return it. Default None.
        optimizer (Optimizer, optional, keyword-only): save the scalers of the ``initialize``
            call this optimizer went through instead (for several calls with optimizers).
            Default None.

    Returns:
        dict: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``.

    Example::

        >>> torch.save({"amp": amp.state_dict(), ...}, "checkpoint.pt")
    """
    if destination is not None and not isinstance(destination, MutableMapping):
        raise TypeError(
            f"amp.state_dict(destination={type(destination).__name__}): the positional "
            "argument is a dict to update (Apex's signature); got "
            + ("an optimizer. Pass it by keyword: amp.state_dict(optimizer=opt)."
               if hasattr(destination, "param_groups")
               else "something else. Pass a dict, or nothing.")
        )
    result = _current("state_dict", optimizer).state_dict()
    if destination is not None:
        destination.update(result)
        return destination
    return result


def load_state_dict(state_dict: dict, *, optimizer=None) -> None:
    """Restore loss scalers saved by :func:`state_dict`, into the most recent ``initialize``
    given optimizers (or, with ``optimizer=``, the one that optimizer went through).

    Example::

        >>> amp.load_state_dict(torch.load("checkpoint.pt")["amp"])
    """
    _current("load_state_dict", optimizer).load_state_dict(state_dict)


def _refuse_shared_masters(opt_list, model_list, cast_ids, mastered) -> None:
    """Refuse a parameter that would get fp32 masters in two optimizers (two in this call, or
    one here and one of an earlier ``initialize``): each would step its own master and write
    the half parameter from it, and the other would take that write in at half precision, so
    the two masters drift apart and checkpoints hold either. ``mastered``: the ``(half
    parameter, optimizer)`` pairs of earlier calls (``_state.mastered_elsewhere``)."""
    holder = {id(half): opt for half, opt in mastered}
    for opt in opt_list:
        for p in {id(p): p for g in opt.param_groups for p in g["params"]}.values():
            if id(p) not in cast_ids:  # (no master: BatchNorm kept fp32, a non-float)
                continue
            other = holder.setdefault(id(p), opt)
            if other is opt:
                continue
            name = next((f"'{n}'" for m in model_list for n, q in m.named_parameters()
                         if q is p), f"of shape {tuple(p.shape)}")
            raise ValueError(
                f"amp.initialize: the parameter {name} is in two optimizers "
                f"({type(other).__name__} and {type(opt).__name__}). With master weights "
                "(O2) each optimizer would keep an fp32 master of its own and the two would "
                "drift apart. Put each parameter in one optimizer (a parameter group gives it "
                "its own hyper-parameters), or use opt_level=\"O1\"."
            )


def master_params(optimizer) -> Iterator[torch.Tensor]:
    """The parameters ``optimizer`` steps: fp32 masters at O2, the model's otherwise.

    Clip gradients on these, after ``scale_loss`` and before ``step()``. Each once, in the
    order of the optimizer's groups: a parameter listed twice (a tied weight through two
    modules' ``parameters()``) is yielded once, so a gradient norm over them counts it once,
    as one over ``model.parameters()`` does.

    Example::

        >>> torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=1.0)
    """
    if not isinstance(getattr(optimizer, "param_groups", None), list):
        raise TypeError(
            f"amp.master_params(optimizer={type(optimizer).__name__}): expected an optimizer "
            "(a torch.optim.Optimizer, as amp.initialize returned it).")
    state = _state_through_wrapper(optimizer)
    if state is not None and state.amp_state.enabled:
        # (A group added since initialize gets its masters now, not at the next scale_loss:
        # a list taken here for clipping would hold its half parameters.)
        state.sync_param_groups()
    return _each_once(p for group in optimizer.param_groups for p in group["params"])


def _each_once(params) -> Iterator[torch.Tensor]:
    seen = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def step_was_skipped(optimizer) -> bool:
    """Whether ``optimizer``'s most recent ``step()`` was skipped for a gradient overflow.

    Use it to keep a learning-rate scheduler in step with the weights::

        >>> optimizer.step()
        >>> if not amp.step_was_skipped(optimizer):
        ...     scheduler.step()
    """
    state = _state_through_wrapper(optimizer)
    if state is None:
        raise RuntimeError(
            f"amp.step_was_skipped(optimizer={type(optimizer).__name__}): this optimizer did "
            "not go through amp.initialize. Pass one that initialize returned (or a wrapper "
            "of it, such as LARC).")
    return state.step_was_skipped()
