"""``FusedAdam``: Apex's fused Adam/AdamW, one Triton pass per step, writing amp O2's half model."""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
import numbers
import operator
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from mixprec._checks import check_flag
from mixprec.amp import _multi_tensor
from mixprec.normalization._launch import outside_the_compiler
from mixprec.optimizers import _adam_kernel

__all__ = ["FusedAdam"]

_log = logging.getLogger(__name__)

# Tests set this to run the kernel on CPU tensors through Triton's interpreter.
_KERNEL_ON_CPU = False

_HALF = (torch.float16, torch.bfloat16)


def _kernel_device_ok(device: torch.device) -> bool:
    if device.type == "cuda":
        return not _multi_tensor.interpreter_enabled() and _multi_tensor.verified_triton()
    return (device.type == "cpu" and _KERNEL_ON_CPU and _multi_tensor.interpreter_enabled()
            and _multi_tensor.verified_triton())


def _check_hyper(name: str, value, low: float, high: float = math.inf, *, high_open=False,
                 where: Optional[str] = None):
    # (numbers.Real: NumPy scalars too, as torch.optim takes them.)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        ok = low <= value < high if high_open else low <= value <= high
    if not ok:
        bound = f"in [{low}, {high})" if high_open else f">= {low}"
        what = f"FusedAdam({name}={value!r})" if where is None else f"{where}: {name}={value!r}"
        raise ValueError(f"{what}: {name} must be a number {bound}.")


def _check_options(options: dict, where: Optional[str] = None) -> None:
    """Raise ``ValueError`` for a bad ``eps``, ``weight_decay`` or ``betas`` among ``options``:
    the constructor's (``where`` None), or those of what ``where`` names (a parameter
    group)."""
    if "eps" in options:
        _check_hyper("eps", options["eps"], 0.0, where=where)
    if "weight_decay" in options:
        _check_hyper("weight_decay", options["weight_decay"], 0.0, where=where)
    if "betas" in options:
        betas = options["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            what = f"FusedAdam(betas={betas!r})" if where is None else f"{where}: betas={betas!r}"
            raise ValueError(f"{what}: betas must be a pair of numbers in [0, 1), e.g. "
                             "(0.9, 0.999).")
        for i, beta in enumerate(betas):
            if isinstance(beta, Tensor):
                _check_tensor_beta(i, beta, where)
            else:
                _check_hyper(f"betas[{i}]", beta, 0.0, 1.0, high_open=True, where=where)


def _tensor_beta_problem(beta: Tensor) -> Optional[str]:
    """What is wrong with a tensor beta, or None: one real floating element, in [0, 1) (its
    value checked only on the CPU: reading a GPU one would sync)."""
    if beta.numel() != 1:
        return "a tensor beta must hold one element: pass a 0-dim tensor such as torch.tensor(0.9)"
    if not beta.is_floating_point():
        return "a tensor beta must be floating point: pass e.g. torch.tensor(0.9) or a float"
    if beta.device.type == "cpu" and not 0.0 <= beta.item() < 1.0:
        return "a beta must be in [0.0, 1.0)"
    return None


def _check_tensor_beta(i: int, beta: Tensor, where: Optional[str]) -> None:
    problem = _tensor_beta_problem(beta)
    if problem is not None:
        what = "FusedAdam(" if where is None else f"{where}: "
        end = ")" if where is None else ""
        raise ValueError(f"{what}betas[{i}]={_describe_lr(beta)}{end}: {problem}.")


def _beta_value(beta, i: int, index: int) -> float:
    """A group's ``betas[i]`` as the routes take it, a float: a tensor is read on the host at
    each step, as PyTorch's fused Adam reads one (a GPU one: a sync)."""
    if not isinstance(beta, Tensor):
        if type(beta) is float and 0.0 <= beta < 1.0:
            return beta
        _check_hyper(f"betas[{i}]", beta, 0.0, 1.0, high_open=True,
                     where=f"FusedAdam param group {index}")  # (set by hand since the checks)
        return float(beta)
    where = f"FusedAdam param group {index}"
    _check_tensor_beta(i, beta, where)  # (set by hand since the checks)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{where}: betas[{i}] is a tensor ({_describe_lr(beta)}) and this step is being "
            "captured in a CUDA graph: FusedAdam reads tensor betas on the host, so the replays "
            "would keep the value read at the capture (and a GPU tensor cannot be read inside "
            "one). Pass floats, e.g. betas=(0.9, 0.999), and set group['betas'] between captures "
            "for another value.")
    value = beta.item()
    if not 0.0 <= value < 1.0:  # (a GPU tensor's value is read only here)
        raise ValueError(f"{where}: betas[{i}]={_describe_lr(beta)}: a beta must be in "
                         "[0.0, 1.0).")
    return value


def _describe_lr(lr) -> str:
    if not isinstance(lr, Tensor):
        return repr(lr)
    value = ""
    if lr.device.type == "cpu" and lr.numel() == 1:  # (a GPU tensor's value: a host sync)
        value = f" holding {lr.item()!r}"
    return f"a {lr.dtype} tensor of shape {tuple(lr.shape)} on {lr.device}{value}"


def _lr_problem(lr, check_value: bool = True) -> Optional[str]:
    """What is wrong with a learning rate, or None: it must be a number >= 0 or a one-element
    floating tensor (whose value is checked only on the CPU: reading a GPU one would sync)."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            return ("a tensor lr must hold one element (one rate per parameter group): pass a "
                    "0-dim tensor such as torch.tensor(1e-3, device='cuda')")
        if not lr.is_floating_point():
            return ("a tensor lr must be floating point: pass e.g. torch.tensor(1e-3) or "
                    "lr.float()")
        if check_value and lr.device.type == "cpu" and not lr.item() >= 0:
            return "lr must be >= 0"
        return None
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        return ("lr must be a number >= 0 or a one-element floating tensor (e.g. 1e-3, or "
                "torch.tensor(1e-3, device='cuda') for a rate that CUDA-graph replays read)")
    if not lr >= 0:
        return "lr must be a number >= 0.0"
    return None


def _check_lr(lr, where: Optional[str] = None) -> None:
    """Raise ``ValueError`` for a bad ``lr``: the constructor's argument, or the one of what
    ``where`` names (e.g. ``FusedAdam param group 1``)."""
    problem = _lr_problem(lr)
    if problem is not None:
        if where is None:
            raise ValueError(f"FusedAdam(lr={_describe_lr(lr)}): {problem}.")
        raise ValueError(f"{where}: lr={_describe_lr(lr)}: {problem}.")


def _unsupported_options(where: str, group: dict) -> str:
    return (f"{where}: amsgrad={group.get('amsgrad', False)!r}, maximize="
            f"{group.get('maximize', False)!r}: FusedAdam supports neither (nor did Apex's). "
            "Drop the option (set it to False), or use torch.optim.AdamW(amsgrad=..., "
            "maximize=..., fused=True) for these parameters.")


class _TrackedState(collections.defaultdict):
    """``optimizer.state`` that counts the entries set, replaced and deleted (``changes``), so
    that a cached plan sees a parameter's state reset by hand (``state[p] = {}``, ``del
    state[p]``) with one comparison per step instead of a lookup per parameter."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.changes = 0

    def __setitem__(self, key, value):
        self.changes += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.changes += 1
        super().__delitem__(key)

    def pop(self, *args):
        self.changes += 1
        return super().pop(*args)

    def popitem(self):
        self.changes += 1
        return super().popitem()

    def clear(self):
        self.changes += 1
        super().clear()

    def update(self, *args, **kwargs):
        self.changes += 1
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        self.changes += 1
        return super().setdefault(key, default)


def _tracked(state) -> _TrackedState:
    return state if isinstance(state, _TrackedState) else _TrackedState(dict, state)


class FusedAdam(torch.optim.Optimizer):
    """Adam and AdamW (Apex's ``apex.optimizers.FusedAdam``), one fused pass per step.

    The same arguments and defaults as Apex's ``FusedAdam``: note ``adam_w_mode=True`` by
    default, so ``weight_decay`` is decoupled as in ``torch.optim.AdamW``; with
    ``adam_w_mode=False`` it is added to the gradient as in ``torch.optim.Adam``. The update is
    PyTorch's Adam/AdamW with ``amsgrad=False, maximize=False``, computed in fp32; the state
    (``step``, ``exp_avg``, ``exp_avg_sq``) has the layout of PyTorch's fused Adam, so
    ``state_dict()`` checkpoints load into ``torch.optim.AdamW`` and back.

    How it runs: fp32 parameters on a CUDA device (with Triton >= 3.6) are updated by one
    Triton kernel per parameter group over all of them. Under ``amp.initialize(...,
    opt_level="O2")`` that kernel also writes each fp32 master's half model copy, which amp
    otherwise copies in a second pass after the step: 30 bytes of memory traffic per parameter
    instead of 34, at 0.95 of the copy bandwidth (on an H200, for a 218M-parameter GPT, 1.67 ms
    of GPU time where ``torch.optim.AdamW(fused=True)`` plus amp's copy take 2.09;
    ``benchmarks/RESULTS.md``). Other parameters (half ones as at O3 or in a pure ``.half()``
    model, CPU tensors, no Triton) take PyTorch's fused Adam kernel where it runs, and the
    same arithmetic in plain PyTorch elsewhere (or with ``bias_correction=False``).

    Like PyTorch's fused optimizers it follows ``GradScaler``'s protocol
    (``_step_supports_amp_scaling``): an overflowed step is skipped on the device, with no host
    synchronization, under ``torch.amp.GradScaler`` and under amp's dynamic loss scaling alike,
    and a step can be captured in a CUDA graph. A flag above 1 (``GradScaler`` sums the flags
    of the devices the parameters are on) is one skipped step.

    The learning rate may be a tensor, as in ``torch.optim.AdamW(fused=True)``. A float ``lr``
    is passed to the kernels at each step, so a captured step keeps the rate it was captured
    with. A one-element floating tensor on the parameters' device is read on the device when
    the update runs: a CUDA graph's replays then follow a schedule that changes the tensor in
    place between them (PyTorch's LR schedulers do, ``group["lr"].fill_(new_lr)``, when
    ``lr`` is a tensor; a new tensor put in the group is not seen by a graph captured before).
    A CPU tensor is read on the host at each step, as PyTorch's fused Adam reads it (no device
    sync; inside a capture it raises, since a replay could not read it).

    Args:
        params (iterable): parameters or parameter groups (dicts).
        lr (float or Tensor): learning rate, a number >= 0 or a one-element floating tensor
            (see above). Default ``1e-3``.
        bias_correction (bool): Adam's bias correction of both moments. Default ``True``.
        betas (Tuple[float, float]): moment decay rates, each in [0, 1): numbers, or
            one-element floating tensors read on the host at each step (as PyTorch's fused
            Adam reads them; not inside a CUDA-graph capture). Default ``(0.9, 0.999)``.
        eps (float): added to the denominator. Default ``1e-8``.
        adam_w_mode (bool): decoupled weight decay (AdamW) when True, L2 (Adam) when False.
            Default ``True``.
        weight_decay (float): Default ``0.0``.
        amsgrad (bool): not supported (as in Apex); ``True`` raises ``ValueError``, as does
            a group's ``amsgrad`` or ``maximize`` set to True (at the next step if by hand).
        set_grad_none (bool): ``zero_grad()`` sets gradients to ``None`` (else zeros them).
            Default ``True``.
        capturable (bool): accepted for Apex compatibility; every step is capturable.
        master_weights (bool): Apex's own fp32 copies of half parameters are not offered:
            ``True`` raises ``ValueError`` (use ``amp.initialize(..., opt_level="O2")``).
        max_grad_norm (float, keyword-only), eps_inside_sqrt (bool, keyword-only): options of
            Apex's first FusedAdam, used with ``FP16_Optimizer``: accepted at their defaults
            (0 and False, which did nothing); otherwise ``ValueError`` says how to clip.

    Example::

        >>> from mixprec import amp
        >>> from mixprec.optimizers import FusedAdam
        >>> model = MyModel().cuda()  # any nn.Module; loader and loss_fn are yours too
        >>> optimizer = FusedAdam(model.parameters(), lr=3e-4, weight_decay=0.1)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
        ...                                   dtype=torch.bfloat16)
        >>> for x, y in loader:
        ...     optimizer.zero_grad()
        ...     loss = loss_fn(model(x), y)
        ...     with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...         scaled_loss.backward()
        ...     optimizer.step()  # updates the fp32 masters and writes the bf16 model
    """

    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, capturable: bool = False,
                 master_weights: bool = False, *, max_grad_norm: float = 0.0,
                 eps_inside_sqrt: bool = False):
        for name, flag in (("bias_correction", bias_correction), ("adam_w_mode", adam_w_mode),
                           ("amsgrad", amsgrad), ("set_grad_none", set_grad_none),
                           ("capturable", capturable), ("master_weights", master_weights),
                           ("eps_inside_sqrt", eps_inside_sqrt)):
            check_flag("FusedAdam", name, flag)  # ("False" was true: any string is)
        if max_grad_norm or eps_inside_sqrt:
            given = (f"max_grad_norm={max_grad_norm!r}" if max_grad_norm
                     else f"eps_inside_sqrt={eps_inside_sqrt!r}")
            raise ValueError(
                f"FusedAdam({given}): these options belong to Apex's first FusedAdam (2018-19), "
                "which clipped and unscaled inside FP16_Optimizer's step; Apex removed both "
                "with FP16_Optimizer. Drop the argument, build the model with amp.initialize("
                "model, optimizer, opt_level='O2') instead of FP16_Optimizer, and clip before "
                "step() with torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), "
                "max_norm) after the scale_loss block (eps is added outside the square root).")
        if amsgrad:
            raise ValueError("FusedAdam(amsgrad=True): the AMSGrad variant is not supported "
                             "(nor was it in Apex's FusedAdam). Use torch.optim.AdamW("
                             "amsgrad=True, fused=True) for it.")
        if master_weights:
            raise ValueError(
                "FusedAdam(master_weights=True): mixprec keeps fp32 master weights in amp, not "
                "in the optimizer. Build FusedAdam on the fp32 model and call amp.initialize("
                "model, optimizer, opt_level='O2'): the masters then live in the optimizer and "
                "FusedAdam writes the half model in the same pass.")
        _check_lr(lr)
        _check_options(dict(eps=eps, weight_decay=weight_decay, betas=betas))
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas),
                        eps=eps, weight_decay=weight_decay, adam_w_mode=bool(adam_w_mode))
        super().__init__(params, defaults)
        self.state = _tracked(self.state)
        self.set_grad_none = bool(set_grad_none)
        self.capturable = bool(capturable)
        # amp O2 (amp.initialize): fp32 master -> the half model parameter it is copied into.
        self._half_copies: Dict[Tensor, Tensor] = {}
        # The masters whose half copies the last step wrote (amp copies the others).
        self._half_copies_written: List[Tensor] = []
        # Routing plans per set of parameters with gradients; an epoch change retires them.
        self._plans: Dict[tuple, _Plan] = {}
        self._epoch = 0

    def __getstate__(self) -> dict:
        state = super().__getstate__()  # (PyTorch's: defaults, state and param_groups only)
        state.update(set_grad_none=self.set_grad_none, capturable=self.capturable)
        return state

    def __setstate__(self, state: dict) -> None:
        """PyTorch's (``copy.deepcopy``, pickling, a state replaced by hand); a copy starts
        with no routing plans and no half copies linked (amp's hooks stay with the original)."""
        super().__setstate__(state)
        self.state = _tracked(self.state)
        self.__dict__.setdefault("set_grad_none", True)
        self.__dict__.setdefault("capturable", False)
        self.__dict__.setdefault("_half_copies", {})
        self.__dict__.setdefault("_half_copies_written", [])
        self._plans = {}
        self._epoch = self.__dict__.get("_epoch", 0) + 1

    # -- amp's protocol --------------------------------------------------------------------
    def _link_half_copies(self, pairs) -> None:
        """amp O2: from now on write ``half`` whenever ``master`` is updated, for each
        ``(half, master)`` in ``pairs``; an empty ``pairs`` ends it. (amp links an O2
        optimizer's masters at ``initialize``, for the optimizer's life: ``amp.restore_model``
        unwraps the forward only, and amp's own post-step copy into the half model goes on too.)"""
        pairs = list(pairs)
        if not pairs:
            self._half_copies.clear()
        for half, master in pairs:
            self._half_copies[master] = half
        self._epoch += 1

    # -- torch.optim.Optimizer -------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """PyTorch's; the new group takes this optimizer's defaults for options it lacks."""
        if isinstance(param_group, dict):
            where = f"FusedAdam param group {len(self.param_groups)}"
            if "lr" in param_group:
                _check_lr(param_group["lr"], where)
            _check_options(param_group, where)
            # (A group's amsgrad/maximize was taken silently, ignored by the step, saved in
            # state_dict() and then refused by load_state_dict: refused here as the
            # constructor's amsgrad=True is.)
            if param_group.get("amsgrad") or param_group.get("maximize"):
                raise ValueError(_unsupported_options(where, param_group))
        super().add_param_group(param_group)
        if hasattr(self, "_plans"):  # (torch's __init__ adds the first groups)
            self._plans.clear()
            self._epoch += 1

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Clear the gradients: to ``None`` when ``set_to_none`` (default: ``set_grad_none``),
        else to zeros."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None
                          else set_to_none)

    def state_dict(self) -> dict:
        """PyTorch's, with each group also stating PyTorch's Adam options (``amsgrad=False``,
        ``maximize=False``, ``decoupled_weight_decay`` = ``adam_w_mode``), so that
        ``torch.optim.Adam``/``AdamW`` load it as the same update."""
        state = super().state_dict()
        for group in state["param_groups"]:
            group["decoupled_weight_decay"] = group["adam_w_mode"]
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """PyTorch's, accepting ``torch.optim.Adam``/``AdamW`` checkpoints too: a group saved
        by them, or by this optimizer and run by one of them since, takes ``adam_w_mode``
        from its ``decoupled_weight_decay`` where it has one (else from this optimizer's
        defaults) and this optimizer's other missing options; step counts move to their
        parameter's device as fp32. A checkpoint of Apex's FusedAdam
        (one step count per group, in ``group["step"]``) gives each parameter that count. A
        tensor ``lr`` is loaded as PyTorch loads it: a copy, on the device it was saved from
        (or mapped to)."""
        # Everything is checked before anything is loaded: a refused checkpoint leaves this
        # optimizer as it was.
        for i, group in enumerate(state_dict.get("param_groups", ())):
            where = f"FusedAdam.load_state_dict: param group {i}"
            if "lr" in group:
                _check_lr(group["lr"], where)
            _check_options(group, where)
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError(
                    f"{where}: the checkpoint's optimizer used amsgrad={group.get('amsgrad')}, "
                    f"maximize={group.get('maximize')}; FusedAdam supports neither. Keep that "
                    "checkpoint's optimizer (torch.optim.Adam/AdamW).")
        for key, entry in state_dict.get("state", {}).items():
            if isinstance(entry, dict) and entry and not {"exp_avg", "exp_avg_sq"} <= set(entry):
                raise ValueError(
                    f"FusedAdam.load_state_dict: the checkpoint's state of parameter {key} "
                    f"holds {', '.join(map(repr, entry))}, not Adam's 'exp_avg' and "
                    "'exp_avg_sq': it was saved by another optimizer (SGD's momentum_buffer, "
                    "Adagrad's sum, ...). Load the checkpoint of a FusedAdam or "
                    "torch.optim.Adam/AdamW, or leave the optimizer's state out to start "
                    "afresh.")
        super().load_state_dict(state_dict)
        self._epoch += 1
        for group in self.param_groups:
            # PyTorch's key wins where there is one: FusedAdam's own checkpoints state both
            # alike, and a torch optimizer that ran the checkpoint since updates only its own
            # (AdamW loading an L2 FusedAdam checkpoint sets decoupled_weight_decay=True, the
            # adam_w_mode=False beside it stale).
            if "decoupled_weight_decay" in group:
                group["adam_w_mode"] = bool(group["decoupled_weight_decay"])
            for key, value in self.defaults.items():
                if key != "differentiable":  # (put in the defaults by torch's __setstate__)
                    group.setdefault(key, value)
            # Apex's FusedAdam counted steps per group (group["step"], an int) and kept only
            # the moments per parameter: each parameter with moments takes the group's count.
            group_step = group.pop("step", None)
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" not in state and group_step is not None:
                    state["step"] = torch.tensor(float(group_step), device=p.device)
                if state and torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
                elif state and "step" in state:
                    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32,
                                                 device=p.device)

    def step(self, closure=None):
        """One update of every parameter with a gradient.

        Under ``torch.compile`` the step is a graph break and runs eagerly: its routing plans
        and tables of addresses are host logic that Dynamo cannot trace.

        Args:
            closure (callable, optional): re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.
        """
        if torch.compiler.is_compiling():
            # (Traced, the step failed inside Dynamo or Inductor: PyTorch's fused op an
            # internal functionalization assert, the kernel its address tables.)
            return outside_the_compiler(FusedAdam._step)(self, closure)
        return self._step(closure)

    @torch.no_grad()
    def _step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            # GradScaler hands a fused optimizer the sum of its devices' flags: 2 where the
            # gradients of two devices overflowed. That is one skipped step, whose one count
            # is taken back (the sum took the counts back twice, and PyTorch's fused kernel
            # skips only a flag of exactly 1: inf gradients stepped, NaN weights).
            found_inf = found_inf.clamp(max=1.0)
        written: List[Tensor] = []
        # Every group checked and planned before any is stepped: a refusal (an option set by
        # hand, moments of another shape) leaves the whole optimizer as it was.
        prepared = [self._prepare_group(i, group) for i, group in enumerate(self.param_groups)]
        for work in prepared:
            if work is not None:
                self._step_group(*work, grad_scale, found_inf, written)
        self._half_copies_written = written
        return loss

    def _state_of(self, p: Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _plan(self, group: dict, params: List[Tensor], grads: List[Tensor]) -> _Plan:
        """The route of each parameter (kernel, PyTorch's fused kernel, plain PyTorch), checked
        in full; kept while its parameters keep gradients (see ``_Plan.holds``)."""
        # (bias_correction=False takes parameters off PyTorch's fused kernel: part of the key.)
        key = (bool(group["bias_correction"]), *map(id, params))
        plan = self._plans.get(key)
        state_map = self.state
        if (plan is not None and plan.epoch == self._epoch and plan.state_map is state_map
                and plan.state_changes == state_map.changes and plan.holds(params, grads)):
            return plan
        if not isinstance(state_map, _TrackedState):  # (a new dict put in by hand)
            self.state = _tracked(state_map)
        for g in grads:
            if g.is_sparse:
                raise RuntimeError("FusedAdam does not support sparse gradients (e.g. "
                                   "nn.Embedding(sparse=True)); use torch.optim.SparseAdam for "
                                   "those parameters.")
        for p in params:
            if p.is_complex() or not p.is_floating_point():
                raise TypeError(
                    f"FusedAdam: a parameter of shape {tuple(p.shape)} is {p.dtype}; FusedAdam "
                    "steps real floating-point parameters (fp32, fp16, bf16, fp64)"
                    + (". Use torch.optim.Adam/AdamW for complex ones (or view_as_real them)."
                       if p.is_complex() else "; integer tensors are not trained by "
                       "gradient: register them as buffers, or leave them out of the "
                       "optimizer."))
        states = [self._state_of(p) for p in params]
        for p, s in zip(params, states):
            missing = [k for k in ("exp_avg", "exp_avg_sq", "step") if k not in s]
            if missing or not isinstance(s["step"], Tensor):
                problem = (f"has no {', '.join(missing)} in its state (it holds "
                           f"{', '.join(map(repr, s)) or 'nothing'})" if missing else
                           f"has a step count of type {type(s['step']).__name__} in its state "
                           "(a tensor is kept there, as torch.optim.Adam keeps it)")
                raise RuntimeError(
                    f"FusedAdam: a parameter of shape {tuple(p.shape)} {problem}. Put "
                    "back what was changed (e.g. state['step'] = torch.tensor(0.0)), or "
                    "reset that parameter's state (optimizer.state[p] = {}) to start its "
                    "moments afresh.")
            # Moments of another shape (a checkpoint of another model, a parameter resized or
            # reshaped through .data) must not reach a fused kernel: PyTorch's checks no sizes
            # on the CPU and read and wrote past the moments (heap corruption, segfaults), or
            # with as many elements paired them in memory order (a transposed parameter's
            # moments belong to other elements), where torch.optim.AdamW raises. Refused
            # before anything of this group is written.
            for name in ("exp_avg", "exp_avg_sq"):
                t = s.get(name)
                if isinstance(t, Tensor) and t.shape != p.shape:
                    raise RuntimeError(
                        f"FusedAdam: a parameter of shape {tuple(p.shape)} has an {name} of "
                        f"shape {tuple(t.shape)} in its state (a checkpoint of another model "
                        "loaded, or the parameter resized or reshaped through .data since its "
                        "last step). Load the matching checkpoint, or reset that parameter's "
                        "state (optimizer.state[p] = {}) to start its moments afresh.")
        copies = [self._half_copies.get(p) for p in params] if self._half_copies else [
            None] * len(params)
        kernel, fused, plain = [], [], []
        for i, (p, g, s, c) in enumerate(zip(params, grads, states, copies)):
            if _kernel_device_ok(p.device) and _adam_kernel.kernel_reason(
                    p, g, s["exp_avg"], s["exp_avg_sq"], s["step"], c) is None:
                kernel.append(i)
            elif (group["bias_correction"] and _torch_fused_ok(p.device)
                  and _same_layout(p, g, s["exp_avg"], s["exp_avg_sq"])
                  # (PyTorch's CUDA kernel reads a float64 step count as fp32: NaN weights.)
                  and s["step"].dtype == torch.float32):
                fused.append(i)
            else:
                plain.append(i)
        if len(self._plans) >= 64:  # (param sets come and go, e.g. with frozen layers)
            self._plans.clear()
        plan = _Plan(self._epoch, self.state, states, copies, kernel, fused, plain, params)
        self._plans[key] = plan
        return plan

    def _prepare_group(self, index: int, group: dict):
        """A group's checks, hyperparameters and plan, before anything is written: None when
        no parameter of it has a gradient."""
        params, grads = [], []
        for p in group["params"]:
            g = p.grad
            if g is not None:
                params.append(p)
                grads.append(g)
        if not params:
            return None
        if group.get("amsgrad") or group.get("maximize"):  # (set by hand since the checks)
            raise ValueError(_unsupported_options(f"FusedAdam param group {index}", group))
        lr = group["lr"]
        if isinstance(lr, Tensor):
            # (Set by hand or by a scheduler since the checks: its shape and dtype, read
            # without a sync; the routes read its value where it is, at each step.)
            problem = _lr_problem(lr, check_value=False)
            if problem is not None:
                raise ValueError(f"FusedAdam param group {index}: lr={_describe_lr(lr)}: "
                                 f"{problem}.")
            if lr.is_cuda and torch.cuda.is_current_stream_capturing():
                _CAPTURED_LRS.setdefault(id(lr), lr)  # replays read it by address
        elif not (type(lr) is float and lr >= 0.0):  # (the usual float: one comparison)
            _check_lr(lr, f"FusedAdam param group {index}")  # (set by hand since the checks)
            lr = float(lr)
        beta1, beta2 = group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        if not (type(eps) is float and eps >= 0.0 and type(weight_decay) is float
                and weight_decay >= 0.0):
            # (Set by hand since the constructor's checks: a negative eps gave -inf weights,
            # a string a bare "could not convert" error.) Ints and NumPy numbers pass too.
            _check_options(dict(eps=eps, weight_decay=weight_decay),
                           f"FusedAdam param group {index}")
        hyper = dict(beta1=_beta_value(beta1, 0, index), beta2=_beta_value(beta2, 1, index),
                     eps=float(eps), weight_decay=float(weight_decay),
                     adam_w=group["adam_w_mode"], bias_correction=group["bias_correction"])
        plan = self._plan(group, params, grads)
        # The rate for each device's parameters, before anything is launched (or captured).
        lrs = {dev: _lr_on(lr, dev) for dev in plan.devices}
        return params, grads, lrs, hyper, plan

    def _step_group(self, params: List[Tensor], grads: List[Tensor], lrs: dict, hyper: dict,
                    plan: _Plan, grad_scale, found_inf, written: List[Tensor]) -> None:
        states, steps, copies = plan.states, plan.steps, plan.copies
        torch._foreach_add_(steps, 1.0)
        for idx in plan.kernel_by_device:
            dev = params[idx[0]].device
            _adam_kernel.adam_step_(
                [params[i] for i in idx], [grads[i] for i in idx],
                [states[i]["exp_avg"] for i in idx], [states[i]["exp_avg_sq"] for i in idx],
                [steps[i] for i in idx], [copies[i] for i in idx], lr=lrs[dev],
                grad_scale=_on(grad_scale, dev), found_inf=_on(found_inf, dev), **hyper)
        for idx in plan.fused_by_device:
            dev_lr = lrs[params[idx[0]].device]
            if (isinstance(dev_lr, Tensor) and dev_lr.device.type != "cpu"
                    and not _torch_fused_takes_tensor_lr()):
                # (A PyTorch without the tensor-lr overload: the plain arithmetic reads it.)
                _reference_step(params, grads, states, idx, lrs, hyper, grad_scale, found_inf)
            else:
                _torch_fused_step(params, grads, states, steps, idx, dev_lr, hyper,
                                  grad_scale, found_inf)
        if plan.plain:
            _reference_step(params, grads, states, plan.plain, lrs, hyper, grad_scale,
                            found_inf)
        written.extend(plan.written_by_kernel)
        for i in plan.copied_after:
            copies[i].copy_(params[i])
            written.append(params[i])
        if found_inf is not None:
            for ss in plan.steps_by_device:
                torch._foreach_sub_(ss, [_on(found_inf, ss[0].device)] * len(ss))


class _Plan:
    """One parameter group's routing for one set of parameters with gradients.

    Built with every check (:func:`mixprec.optimizers._adam_kernel.kernel_reason`); a later
    step reuses it while :meth:`holds`: the optimizer's epoch is the same (no state loaded, no
    half copies linked since), ``optimizer.state`` is the same mapping with no entry set or
    deleted since (its change counter) and no parameter's state dict emptied, and the per-step
    facts the checks relied on still stand, read from cached flags (each parameter's dtype,
    shape and device, each fused-route parameter's and its gradient's layout, each plain-route
    gradient's being dense, each copy's device and dtype). So a state reset by hand
    (``optimizer.state[p] = {}``, ``.clear()``, ``del``) starts fresh moments, as in PyTorch's
    Adam, and a moment or step count replaced inside a kept dict (by identity) is checked as
    at the first step. The learning rate
    is no part of it: each step takes the group's ``lr`` as it is then (a float, a tensor
    changed in place, or a new tensor or float put in the group).
    """

    __slots__ = ("epoch", "state_map", "state_changes", "params", "states", "steps", "copies",
                 "plain", "kernel_by_device", "fused_by_device", "steps_by_device", "devices",
                 "written_by_kernel", "copied_after", "_take", "_dtype_shapes", "_devices",
                 "_take_contiguous", "_take_channels_last", "_take_plain", "_linked",
                 "_copy_facts", "_state_tensors")

    def __init__(self, epoch, state_map, states, copies, kernel, fused, plain, params):
        self.epoch = epoch
        # A state cleared or replaced since (optimizer.state.clear(), a new dict, `del
        # optimizer.state[p]`, `optimizer.state[p] = {}`: resets of the moments) is seen by
        # these two; a parameter's state dict emptied in place, by holds().
        self.state_map, self.state_changes = state_map, state_map.changes
        # Held, so that no other tensor can take one of their ids (the plan's key) meanwhile.
        self.params = params
        self.states = states
        self.steps = [s["step"] for s in states]
        self.copies = copies
        self.plain = plain
        self.kernel_by_device = _by_device(kernel, params)
        # (And by dtype: PyTorch's fused CUDA kernel takes one dtype per call, and a group
        # holding fp16 and bf16 parameters, or fp64 and half ones, raised "params, grads,
        # exp_avgs, and exp_avg_sqs must have same dtype, device, and layout" there.)
        self.fused_by_device = _by_device(fused, params, by_dtype=True)
        by_device: Dict[torch.device, List[Tensor]] = {}
        for step in self.steps:
            by_device.setdefault(step.device, []).append(step)
        self.steps_by_device = list(by_device.values())
        self.devices = list(by_device)  # (the parameters' devices: steps are on them)
        self.written_by_kernel = [params[i] for i in kernel if copies[i] is not None]
        self.copied_after = [i for i in fused + plain if copies[i] is not None]
        # What the checks of both fused routes saw, re-read cheaply every step (C-level maps
        # over the routed tensors: dtypes, shapes and layouts).
        routed = sorted(kernel + fused)
        # (Dtype and shape, read for every parameter: one converted through .data since (also
        # to a dtype of its size, fp16 -> bf16) would have a fused kernel read its moments as
        # its new dtype, or the kernel write its old dtype's bytes over the new storage; one
        # reshaped or resized would be stepped against moments of another shape, element by
        # element in memory order. Re-planned, the first takes a route of its dtype and the
        # plan refuses the second's moments before anything is written.)
        every = list(range(len(params)))
        self._take = _picker(every)
        self._dtype_shapes = [_DTYPE_SHAPE(params[i]) for i in every]
        self._devices = [params[i].get_device() for i in every]  # (moved through .data)
        self._take_contiguous = _picker([i for i in routed if params[i].is_contiguous()])
        self._take_channels_last = _picker([i for i in routed if not params[i].is_contiguous()])
        # (The plain route's gradients: checked to stay dense, as a sparse one is refused.)
        self._take_plain = _picker(plain)
        # The half copies' dtype, shape, device and strides: one re-laid out through .data
        # (model.to(memory_format=torch.channels_last) after amp.initialize) was written by the
        # kernel in the old layout's order, a silently scrambled half model.
        self._linked = [c for c in copies if c is not None]
        self._copy_facts = _layout_facts(self._linked)
        # Each state's moments and step count, the objects the checks saw: one replaced by
        # hand inside a kept state dict (a moment cast to bf16 or offloaded, a step count
        # reset) was handed to the fused kernels unchecked (heap corruption, segfaults, or
        # the old step count stepped while the new one stayed).
        self._state_tensors = list(itertools.chain.from_iterable(map(_STATE_TENSORS, states)))

    def holds(self, params: List[Tensor], grads: List[Tensor]) -> bool:
        if not all(map(len, self.states)):  # (a state dict emptied in place: .clear())
            return False
        try:
            now = itertools.chain.from_iterable(map(_STATE_TENSORS, self.states))
            if not all(map(operator.is_, now, self._state_tensors)):
                return False
        except KeyError:  # (one deleted by hand: the checks say what is missing)
            return False
        # (A gradient always has its parameter's dtype and size: PyTorch checks assignments.)
        taken = self._take(params)
        if (list(map(_DTYPE_SHAPE, taken)) != self._dtype_shapes
                or list(map(Tensor.get_device, taken)) != self._devices):
            return False
        take = self._take_contiguous
        if not (all(map(Tensor.is_contiguous, take(params)))
                and all(map(Tensor.is_contiguous, take(grads)))):
            return False
        take = self._take_channels_last
        if not (all(map(_is_channels_last, take(params)))
                and all(map(_is_channels_last, take(grads)))):
            return False
        if not all(map(_is_strided, self._take_plain(grads))):
            return False
        return _layout_facts(self._linked) == self._copy_facts


_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")


def _layout_facts(tensors):
    """What a plan relies on about the half copies it writes: dtypes and shapes, devices and
    strides (C-level maps: checked every step)."""
    return (list(map(_DTYPE_SHAPE, tensors)), list(map(Tensor.get_device, tensors)),
            list(map(Tensor.stride, tensors)))


_STATE_TENSORS = operator.itemgetter("exp_avg", "exp_avg_sq", "step")


def _is_strided(t: Tensor) -> bool:
    return t.layout is torch.strided


def _is_channels_last(t: Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last)


def _picker(indices: List[int]):
    """``seq -> (seq[i] for i in indices)`` as a tuple, at C speed (``itemgetter``)."""
    if not indices:
        return lambda seq: ()
    if len(indices) == 1:
        return lambda seq, i=indices[0]: (seq[i],)
    return operator.itemgetter(*indices)


def _same_layout(p: Tensor, *others: Tensor) -> bool:
    # PyTorch's fused kernels walk every tensor's memory in the same order: one dtype, one
    # device and one dense layout (a contiguous gradient of a channels-last parameter gave
    # wrong updates on the CPU).
    if not (p.is_contiguous() or (p.dim() == 4 and p.is_contiguous(
            memory_format=torch.channels_last))):
        return False
    return all(t.dtype == p.dtype and t.device == p.device and t.stride() == p.stride()
               for t in others)


def _on(t: Optional[Tensor], device: torch.device) -> Optional[Tensor]:
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=True)


# Tensor learning rates read by captured steps: a replay reads them by address, so they are
# kept from being freed (and their memory reused) while the graph may still be replayed.
_CAPTURED_LRS: Dict[int, Tensor] = {}


def _lr_on(lr: Union[float, Tensor], device: torch.device) -> Union[float, Tensor]:
    """A group's learning rate for its parameters on ``device``: a float, or a tensor on
    ``device`` that the update reads there (at a CUDA-graph replay, its value then).

    PyTorch's rule for its fused Adam: a tensor on the parameters' device is read there, a CPU
    tensor is read on the host (no device sync) at each step, and one on another device is
    copied over first.
    """
    if not isinstance(lr, Tensor) or lr.device == device:
        return lr
    if lr.device.type == "cpu":
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"FusedAdam: this step is being captured in a CUDA graph and lr is a CPU "
                f"tensor, which a replay cannot read (the capture would keep its value now). "
                f"Put lr on the parameters' device before the capture, e.g. lr=torch.tensor("
                f"1e-3, device='{device}') or group['lr'] = group['lr'].to('{device}'), and "
                f"change it in place (fill_, as LR schedulers do); or pass a float for a "
                f"constant rate.")
        return lr.item()
    if device.type == "cpu":
        return lr.item()  # (a GPU rate for CPU parameters: a host sync, as in PyTorch)
    return lr.to(device, non_blocking=True)


def _by_device(indices: List[int], params: List[Tensor],
               by_dtype: bool = False) -> List[List[int]]:
    """``indices`` grouped by their parameter's device (and dtype), in order."""
    groups: Dict[tuple, List[int]] = {}
    for i in indices:
        p = params[i]
        groups.setdefault((p.device, p.dtype) if by_dtype else (p.device,), []).append(i)
    return list(groups.values())


@functools.cache
def _torch_fused_on(device_type: str) -> bool:
    # PyTorch's fused Adam runs on CUDA, and on the CPU from some release on: try it once.
    if device_type == "cuda":
        return True
    try:
        p = torch.zeros(2, device=device_type)
        step = torch.zeros((), device=device_type)
        torch._fused_adamw_([p], [p.clone()], [p.clone()], [p.clone()], [], [step], lr=0.0,
                            beta1=0.9, beta2=0.9, weight_decay=0.0, eps=1.0, amsgrad=False,
                            maximize=False, grad_scale=None, found_inf=None)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
        _log.debug("PyTorch's fused Adam is not available on %s: %s", device_type, exc)
        return False
    return True


def _torch_fused_ok(device: torch.device) -> bool:
    return device.type in ("cuda", "cpu") and _torch_fused_on(device.type)


@functools.cache
def _torch_fused_takes_tensor_lr() -> bool:
    # PyTorch's fused Adam takes a tensor lr through its `tensor_lr` overloads (2.13 has them;
    # without them a GPU tensor lr takes the plain arithmetic).
    try:
        return all("tensor_lr" in op.overloads()
                   for op in (torch.ops.aten._fused_adam_, torch.ops.aten._fused_adamw_))
    except (AttributeError, RuntimeError) as exc:
        _log.debug("PyTorch's fused Adam has no tensor-lr overload: %s", exc)
        return False


def _torch_fused_step(params, grads, states, steps, idx, lr, hyper, grad_scale,
                      found_inf) -> None:
    """Parameters the kernel does not take (half ones, on CUDA; on CPU any): PyTorch's fused
    Adam/AdamW kernel (fp32 arithmetic inside), where it runs. ``lr`` is a float or a tensor on
    the parameters' device (a CPU one is read on the host, as PyTorch's CPU kernel does)."""
    op = torch._fused_adamw_ if hyper["adam_w"] else torch._fused_adam_
    dev = params[idx[0]].device
    if isinstance(lr, Tensor):
        if lr.device.type == "cpu":
            lr = lr.item()
        else:  # (read as fp32 by PyTorch's GPU kernel, which takes no other dtype)
            lr = lr.reshape(()).to(torch.float32)
    op([params[i] for i in idx], [grads[i] for i in idx],
       [states[i]["exp_avg"] for i in idx], [states[i]["exp_avg_sq"] for i in idx], [],
       [steps[i] for i in idx], lr=lr, beta1=hyper["beta1"], beta2=hyper["beta2"],
       weight_decay=hyper["weight_decay"], eps=hyper["eps"], amsgrad=False, maximize=False,
       grad_scale=_on(grad_scale, dev), found_inf=_on(found_inf, dev))


def _reference_step(params, grads, states, idx, lrs, hyper, grad_scale, found_inf) -> None:
    """The update in plain PyTorch, in fp32 (half tensors are upcast and written back), or in
    fp64 for fp64 parameters as PyTorch's Adam; ``lrs`` maps each device to the rate of its
    parameters, a float or a tensor there (read in the update's dtype)."""
    if found_inf is not None and bool(found_inf.item()):  # (a host sync: not the fast path)
        return
    beta1, beta2 = hyper["beta1"], hyper["beta2"]
    eps, wd = hyper["eps"], hyper["weight_decay"]
    for i in idx:
        p, state = params[i], states[i]
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        lr = lrs[p.device]
        if isinstance(lr, Tensor):
            lr = lr.reshape(()).to(dtype)
        p32, g = p.to(dtype), grads[i].to(dtype)
        m, v = state["exp_avg"].to(dtype), state["exp_avg_sq"].to(dtype)
        if grad_scale is not None:
            g = g / grad_scale.to(g.device)
        if wd != 0:  # (as PyTorch's Adam: at 0 an infinite weight stays so, not 0 * inf = NaN)
            if hyper["adam_w"]:
                p32 = p32 - lr * wd * p32
            else:
                g = g + wd * p32
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        if hyper["bias_correction"]:
            # In fp64 (on the device: no sync): 1 - beta2 ** step in fp32 is off by ~1e-5.
            step = state["step"].to(device=p.device, dtype=torch.float64)
            bc1 = (1 - torch.pow(beta1, step)).to(dtype)
            bc2_sqrt = torch.sqrt(1 - torch.pow(beta2, step)).to(dtype)
        else:
            bc1 = bc2_sqrt = torch.ones((), dtype=dtype, device=p.device)
        p32 = p32 - (lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps)
        p.copy_(p32)
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
