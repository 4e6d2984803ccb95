"""Resuming a checkpoint of Apex's legacy ``FP16_Optimizer`` under amp O2.

``FP16_Optimizer.state_dict()`` held the inner optimizer's state, the fp32 masters of the half
parameters (``fp32_from_fp16``, one list per parameter group) and the loss scaler object
itself. Two layouts were written:

* Apex of 2018 (``apex.fp16_utils.loss_scaler``'s ``LossScaler`` / ``DynamicLossScaler``, with
  ``cur_scale``) rebuilt each group as the masters of its trainable half parameters, in order,
  followed by its trainable fp32 ones (BatchNorm's after ``BN_convert_float``), leaving frozen
  parameters out: the inner optimizer's state is not in the model's order where a group mixes
  the two.
* Apex of 2019 and later (``apex.amp.scaler.LossScaler``, with ``_loss_scale``) put each
  master in its half parameter's slot: the group's own order.
"""

from __future__ import annotations

import math
import warnings
from typing import List

import torch

from mixprec.amp._state import optimizer_state

_KEYS = ("optimizer_state_dict", "fp32_from_fp16", "loss_scaler")


def load_fp16_optimizer_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Resume, under O2, from the ``state_dict()`` of Apex's legacy ``FP16_Optimizer``.

    Loads the inner optimizer's state (its slots mapped to ``optimizer``'s parameters in
    either of Apex's layouts, see the module doc), the fp32 masters (``fp32_from_fp16``) into
    amp's masters exactly, and the loss scale with the clean steps counted toward its next
    growth (and the growth window) into the first loss scaler. Load the model's own
    checkpoint first (``model.load_state_dict(checkpoint["model"])``: its buffers and the
    parameters kept fp32); the masters loaded here then replace the half values it held.

    Args:
        optimizer: the optimizer ``amp.initialize(..., opt_level="O2")`` returned, built over
            the same parameter groups, in the same order, as the ``FP16_Optimizer``'s inner
            optimizer was, with the same parameters frozen.
        state_dict (dict): ``FP16_Optimizer.state_dict()``, as ``torch.load`` gives it back
            (``weights_only=False``, with ``mixprec.install_apex_alias()`` called first, so
            that Apex's pickled loss scaler finds a class).

    Raises:
        ValueError: ``optimizer`` is not an O2 optimizer of amp's, the dict is not an
            ``FP16_Optimizer``'s, or its groups, masters or loss scaling do not match.

    Example::

        >>> mixprec.install_apex_alias()
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> checkpoint = torch.load("old.pt", weights_only=False)
        >>> model.load_state_dict(checkpoint["model"])
        >>> amp.load_fp16_optimizer_state_dict(optimizer, checkpoint["optimizer"])
    """
    state = optimizer_state(optimizer)
    if state is None or not state.amp_state.enabled or not state.pairs:
        raise ValueError(
            f"amp.load_fp16_optimizer_state_dict(optimizer={type(optimizer).__name__}): "
            "expected an optimizer that amp.initialize(..., opt_level='O2') returned (fp32 "
            "master weights for its half parameters, as FP16_Optimizer kept); this one "
            + ("did not go through amp.initialize." if state is None else
               "has no master weights (O0, O1 or O3, or amp disabled)."))
    missing = [k for k in _KEYS if not isinstance(state_dict, dict) or k not in state_dict]
    if missing:
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"amp.load_fp16_optimizer_state_dict: expected FP16_Optimizer.state_dict() (the "
            f"keys {list(_KEYS)}), got {got}: missing {missing}. Pass checkpoint['optimizer'] "
            "(or wherever the script saved the FP16_Optimizer's state_dict()), not the model's.")
    scaler = state_dict["loss_scaler"]
    old_layout = "cur_scale" in getattr(scaler, "__dict__", {})
    saved = state_dict["optimizer_state_dict"]
    saved_groups, saved_masters = saved["param_groups"], state_dict["fp32_from_fp16"]
    groups = optimizer.param_groups
    if not len(groups) == len(saved_groups) == len(saved_masters):
        raise ValueError(
            f"amp.load_fp16_optimizer_state_dict: the checkpoint holds {len(saved_groups)} "
            f"parameter groups ({len(saved_masters)} of masters), the optimizer "
            f"{len(groups)}. Build the optimizer over the same groups as the FP16_Optimizer's "
            "inner one.")
    half_of = {id(m): h for h, m in state.pairs}
    ids_taken = [i for g in saved_groups for i in g["params"]]
    fresh_id = max(ids_taken, default=-1) + 1
    new_groups, writes, off = [], [], []
    for k, (group, saved_group, masters) in enumerate(zip(groups, saved_groups, saved_masters)):
        params = group["params"]
        # (A master's own flag stays as initialize found it: a half parameter frozen since is
        # frozen, as amp's step takes it.)
        trainable = [i for i, p in enumerate(params)
                     if (half_of[id(p)] if id(p) in half_of else p).requires_grad]
        half = [i for i in trainable if id(params[i]) in half_of]
        if len(masters) != len(half):
            raise ValueError(
                f"amp.load_fp16_optimizer_state_dict: group {k} of the checkpoint holds "
                f"{len(masters)} fp32 masters, but the optimizer's group {k} has {len(half)} "
                "trainable half parameters: build the model as the checkpoint's run did (the "
                "same layers, BatchNorm kept fp32, the same parameters frozen).")
        for i, master in zip(half, masters):
            if tuple(master.shape) != tuple(params[i].shape):
                raise ValueError(
                    f"amp.load_fp16_optimizer_state_dict: group {k}: a saved master of shape "
                    f"{tuple(master.shape)} falls on a parameter of shape "
                    f"{tuple(params[i].shape)}: the groups hold other parameters, or in "
                    "another order, than the checkpoint's.")
            # (FP16_Optimizer copied each master into its half parameter after every step,
            # and the model's checkpoint was saved beside it: a master that does not round to
            # the weight model.load_state_dict put there belongs to another parameter of the
            # same shape, or the model's checkpoint was not loaded first.)
            weight = half_of[id(params[i])].detach()
            if not torch.equal(master.detach().to(weight.device, torch.float16)
                               .to(weight.dtype), weight):
                off.append((k, i, tuple(params[i].shape)))
            writes.append((params[i], master))
        halves = set(half)
        order = (half + [i for i in trainable if i not in halves] if old_layout
                 else list(range(len(params))))
        if len(order) != len(saved_group["params"]):
            raise ValueError(
                f"amp.load_fp16_optimizer_state_dict: group {k} of the checkpoint's optimizer "
                f"state lists {len(saved_group['params'])} parameters, where this optimizer's "
                f"layout for it has {len(order)} ("
                + ("trainable ones, as FP16_Optimizer of 2018 kept" if old_layout else
                   "every parameter of the group, as FP16_Optimizer of 2019 and later kept")
                + "): the groups or the frozen parameters differ from the checkpoint's run.")
        slots: List[int] = [-1] * len(params)
        for i, saved_id in zip(order, saved_group["params"]):
            slots[i] = saved_id
        for i, slot in enumerate(slots):
            if slot == -1:  # (a frozen parameter 2018's FP16_Optimizer left out: no state)
                slots[i], fresh_id = fresh_id, fresh_id + 1
        new_groups.append({**saved_group, "params": slots})
    if off:
        shown = ", ".join(f"group {k} index {i} {shape}" for k, i, shape in off[:3])
        raise ValueError(
            f"amp.load_fp16_optimizer_state_dict: {len(off)} of the checkpoint's fp32 masters "
            f"do not round to the half weights the model holds ({shown}"
            f"{', ...' if len(off) > 3 else ''}): load the model's checkpoint first "
            "(model.load_state_dict(checkpoint['model'])), and build the optimizer over the "
            "same groups, with the same parameters frozen, as the checkpoint's run.")
    scale, unskipped, window, dynamic, bounds = _scale_state(scaler, old_layout)
    loss_scaler = state.amp_state.scalers[0]
    if dynamic != loss_scaler.dynamic:
        raise ValueError(
            "amp.load_fp16_optimizer_state_dict: the checkpoint's loss scale is "
            f"{'dynamic' if dynamic else f'static ({scale:g})'}, amp's "
            f"{'dynamic' if loss_scaler.dynamic else 'static'}: pass "
            + ("loss_scale='dynamic'" if dynamic else f"loss_scale={scale:g}")
            + " to amp.initialize.")
    if not dynamic and loss_scaler.loss_scale != scale:
        warnings.warn(
            f"amp.load_fp16_optimizer_state_dict: the checkpoint's static loss scale {scale:g} "
            f"replaces this run's {loss_scaler.loss_scale:g}.", UserWarning, stacklevel=2)
    optimizer.load_state_dict({"state": saved["state"], "param_groups": new_groups})
    with torch.no_grad():
        for master, value in writes:
            master.copy_(value)  # (amp brings the half parameter in step before the forward)
    loss_scaler.set_state(scale, unskipped)
    if dynamic:
        loss_scaler.set_window(window)
        # (The checkpoint's bounds too, or the scale sequence parts from FP16_Optimizer's:
        # 2018's floor of 1 and no ceiling, later Apex's min and max.)
        loss_scaler._min, loss_scaler._max = bounds


def _scale_state(scaler, old_layout: bool):
    """(scale, clean steps toward the next growth, growth window, dynamic, (floor,
    ceiling)) of an unpickled Apex loss scaler."""
    attrs = getattr(scaler, "__dict__", {})
    try:
        if old_layout:
            scale = float(attrs["cur_scale"])
            dynamic = "scale_window" in attrs
            if not dynamic:
                return scale, 0, 0, False, None
            window = int(attrs["scale_window"])
            # (DynamicLossScaler grew at (cur_iter - last_overflow_iter) % scale_window == 0:
            # the clean steps since the last overflow or growth, counted amp's way.)
            unskipped = (int(attrs["cur_iter"]) - int(attrs["last_overflow_iter"]) - 1) % window
            factor = float(attrs.get("scale_factor", 2.0))
            bounds = (1.0, math.inf)  # (DynamicLossScaler: max(cur_scale / factor, 1))
        else:
            scale, dynamic = float(attrs["_loss_scale"]), bool(attrs["dynamic"])
            unskipped, window = int(attrs["_unskipped"]), int(attrs["_scale_seq_len"])
            factor = float(attrs.get("_scale_factor", 2.0))
            low, high = attrs.get("_min_loss_scale"), attrs.get("_max_loss_scale", 2.0**24)
            bounds = (2.0**-24 if low is None else float(low), float(high))
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            "amp.load_fp16_optimizer_state_dict: the checkpoint's loss_scaler "
            f"({type(scaler).__name__}) has neither Apex 2018's attributes (cur_scale, "
            "cur_iter, last_overflow_iter, scale_window) nor later Apex's (_loss_scale, "
            f"_unskipped, _scale_seq_len, dynamic); it has {sorted(attrs)}.") from None
    if dynamic and factor != 2.0:
        warnings.warn(
            f"amp.load_fp16_optimizer_state_dict: the checkpoint's scaler grew and backed off "
            f"by {factor:g}; amp's dynamic scale uses 2.", UserWarning, stacklevel=3)
    return scale, unskipped, window, dynamic, bounds
