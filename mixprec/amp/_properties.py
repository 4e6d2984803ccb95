"""Opt levels O0-O3 as frozen property sets, and the validation of user overrides.

An opt level is a named preset of :class:`Properties`; any keyword passed to
``amp.initialize`` overrides one property, exactly as in Apex. Resolution happens once, in
:func:`resolve_properties`, which is the only place that decides what a combination means and
rejects the nonsensical ones.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from typing import Optional, Union

import torch

from mixprec.amp.scaler import _as_number

__all__ = ["OPT_LEVELS", "Properties", "resolve_properties"]

_HALF_TYPES = (torch.float16, torch.bfloat16)
_DTYPE_NAMES = {
    torch.float16: "torch.float16",
    torch.bfloat16: "torch.bfloat16",
    torch.float32: "torch.float32",
}


@dataclasses.dataclass(frozen=True)
class Properties:
    """The resolved behaviour of one ``amp.initialize`` call.

    Attributes:
        opt_level (str): ``"O0"``..``"O3"``.
        half_dtype (torch.dtype): the reduced precision in use (``float16`` or ``bfloat16``).
        cast_model_type (torch.dtype or None): dtype the model's parameters are cast to
            (None: left as they are).
        patch_torch_functions (bool): per-op casting through ``torch.autocast`` inside the
            model's forward (O1).
        keep_batchnorm_fp32 (bool or None): BatchNorm parameters and arithmetic in fp32.
        master_weights (bool): the optimizer steps fp32 copies of half parameters.
        loss_scale (float or "dynamic"): the (initial) loss scale policy.
        cast_model_outputs (torch.dtype or None): dtype of the model's floating outputs.
    """

    opt_level: str
    half_dtype: torch.dtype
    cast_model_type: Optional[torch.dtype]
    patch_torch_functions: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: bool
    loss_scale: Union[float, str]
    cast_model_outputs: Optional[torch.dtype]

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == "dynamic"

    @property
    def model_is_half(self) -> bool:
        return self.cast_model_type in _HALF_TYPES

    def describe(self) -> str:
        """One line naming every property, for the log."""
        parts = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            parts.append(f"{field.name}={_DTYPE_NAMES.get(value, value)!s}")
        return ", ".join(parts)


# Apex's table. ``"half"`` stands for the half dtype chosen by the user (fp16 or bf16).
# Read-only (exported as ``amp.OPT_LEVELS`` for reading the presets): a script that changed an
# entry silently changed every later initialize; override a property by initialize's keyword.
OPT_LEVELS = types.MappingProxyType({level: types.MappingProxyType(preset) for level, preset in {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale="dynamic"),
    "O2": dict(cast_model_type="half", patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type="half", patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}.items()})
_DESCRIPTIONS = {
    "O0": "pure fp32 training",
    "O1": "per-op casting through torch.autocast, parameters fp32",
    "O2": "half model (BatchNorm fp32), fp32 master weights",
    "O3": "pure half training",
}


def _check_opt_level(opt_level) -> str:
    allowed = ", ".join(f'"{k}"' for k in OPT_LEVELS)
    if not isinstance(opt_level, str):
        raise TypeError(
            f"amp.initialize(opt_level={opt_level!r}): opt_level must be a string, one of "
            f"{allowed}."
        )
    if opt_level in OPT_LEVELS:
        return opt_level
    hint = ""
    if len(opt_level) == 2 and opt_level[1:] in "0123" and opt_level[0] in "0oO":
        hint = (
            f' Did you mean "O{opt_level[1]}"? The prefix is the capital letter O, '
            "not the digit zero or a lower-case o."
        )
    raise ValueError(
        f"amp.initialize(opt_level={opt_level!r}): unknown opt_level. Allowed: {allowed}."
        + hint
    )


def _parse_bool(name: str, value) -> Optional[bool]:
    # Apex accepted the strings "True"/"False" (from argparse); so do we.
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    raise TypeError(
        f"amp.initialize({name}={value!r}): expected True, False, None or the strings "
        f'"True"/"False".'
    )


def _parse_loss_scale(value) -> Union[float, str, None]:
    if value is None:
        return None
    if isinstance(value, str):
        if value == "dynamic":
            return value
        try:
            number = float(value)
        except ValueError:
            raise ValueError(
                f"amp.initialize(loss_scale={value!r}): a string loss_scale must be "
                f'"dynamic" or a number such as "128.0".'
            ) from None
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        # (NumPy's numbers too, as min/max_loss_scale take them; inf for an integer too large
        # for a float, refused below.)
        number = _as_number(value)
    else:
        raise TypeError(
            f"amp.initialize(loss_scale={value!r}): expected a positive number, a string "
            f'holding one, or "dynamic".'
        )
    if not math.isfinite(number) or number <= 0:
        raise ValueError(
            f"amp.initialize(loss_scale={value!r}): the loss scale must be a finite number "
            f'> 0, or "dynamic".'
        )
    return number


def _check_dtype(name: str, value, allowed) -> None:
    if value is not None and value not in allowed:
        names = ", ".join(_DTYPE_NAMES[d] for d in allowed)
        hint = ""
        if name == "cast_model_type" and value is False:
            # (Apex's own tests' "leave the model's dtypes alone, master weights for the
            # parameters already half".)
            hint = (" False (leave the model's dtypes as they are) is not supported: for fp32 "
                    'parameters with per-op casting use opt_level="O1"; for a model you made '
                    'half yourself use opt_level="O2" (its half parameters get fp32 masters) '
                    'or "O3".')
        raise ValueError(
            f"amp.initialize({name}={value!r}): allowed values are None, {names}.{hint}")


def resolve_properties(
    opt_level,
    *,
    dtype=None,
    cast_model_type=None,
    patch_torch_functions=None,
    keep_batchnorm_fp32=None,
    master_weights=None,
    loss_scale=None,
    cast_model_outputs=None,
) -> Properties:
    """Turn an opt level plus Apex-style overrides into :class:`Properties`.

    Args:
        opt_level (str): ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"``.
        dtype (torch.dtype, optional): ``torch.float16`` (default) or ``torch.bfloat16``.
        cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights,
        loss_scale, cast_model_outputs: Apex's property overrides; ``None`` keeps the
            opt level's default.

    Returns:
        Properties: the frozen, validated result.

    Raises:
        ValueError / TypeError: for an unknown opt level or a value or combination that has
            no meaning, with the allowed values in the message.
    """
    opt_level = _check_opt_level(opt_level)
    _check_dtype("dtype", dtype, _HALF_TYPES)
    _check_dtype("cast_model_type", cast_model_type, (torch.float32,) + _HALF_TYPES)
    _check_dtype("cast_model_outputs", cast_model_outputs, (torch.float32,) + _HALF_TYPES)
    patch_torch_functions = _parse_bool("patch_torch_functions", patch_torch_functions)
    keep_batchnorm_fp32 = _parse_bool("keep_batchnorm_fp32", keep_batchnorm_fp32)
    master_weights = _parse_bool("master_weights", master_weights)
    user_loss_scale = _parse_loss_scale(loss_scale)

    # The half dtype: `dtype`, else a half `cast_model_type`, else fp16 (Apex's only choice).
    if dtype is not None and cast_model_type in _HALF_TYPES and cast_model_type != dtype:
        raise ValueError(
            f"amp.initialize(dtype={_DTYPE_NAMES[dtype]}, cast_model_type="
            f"{_DTYPE_NAMES[cast_model_type]}): the two disagree. Pass only one of them, or "
            "the same half type to both."
        )
    half = dtype or (cast_model_type if cast_model_type in _HALF_TYPES else torch.float16)

    preset = dict(OPT_LEVELS[opt_level])
    if preset["cast_model_type"] == "half":
        preset["cast_model_type"] = half
    # bf16 has fp32's exponent range: gradients do not underflow, so no scaling by default.
    if half == torch.bfloat16 and preset["loss_scale"] == "dynamic":
        preset["loss_scale"] = 1.0

    overrides = dict(
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=user_loss_scale,
    )
    for key, value in overrides.items():
        if value is not None:
            preset[key] = value

    props = Properties(
        opt_level=opt_level,
        half_dtype=half,
        cast_model_type=preset["cast_model_type"],
        patch_torch_functions=bool(preset["patch_torch_functions"]),
        keep_batchnorm_fp32=preset["keep_batchnorm_fp32"],
        master_weights=bool(preset["master_weights"]),
        loss_scale=preset["loss_scale"],
        cast_model_outputs=cast_model_outputs,
    )
    _check_combination(props, {k for k, v in overrides.items() if v is not None})
    return props


def _check_combination(p: Properties, passed=frozenset()) -> None:
    """Reject meaningless combinations; ``passed`` names the properties the user overrode
    (the others come from the opt level), so that the message blames the right one."""
    where = f'amp.initialize(opt_level="{p.opt_level}", ...)'
    if p.patch_torch_functions and p.model_is_half:
        raise ValueError(
            f"{where}: patch_torch_functions=True (per-op casting, O1) cannot be combined with "
            f"cast_model_type={_DTYPE_NAMES[p.cast_model_type]} (a half model, O2/O3). Use "
            'opt_level="O1" for per-op casting or "O2"/"O3" for a half model.'
        )
    if p.master_weights and not p.model_is_half:
        cast = _DTYPE_NAMES.get(p.cast_model_type, p.cast_model_type)
        if "master_weights" in passed:
            if "cast_model_type" in passed:  # (the cast passed is what keeps them fp32)
                fix = ("pass a half cast_model_type (torch.float16 or torch.bfloat16"
                       + (", or none: O2's own is half" if p.opt_level == "O2" else "") + ")")
            else:
                fix = 'use opt_level="O2"'
            raise ValueError(
                f"{where}: master_weights=True keeps fp32 copies of half parameters, but with "
                f"cast_model_type={cast} the parameters stay fp32. To train a half model with "
                f"fp32 masters, {fix}; else drop master_weights=True."
            )
        raise ValueError(
            f'amp.initialize(opt_level="{p.opt_level}", cast_model_type={cast}): '
            f"{p.opt_level} keeps fp32 master weights of half parameters, and this "
            'cast_model_type leaves the parameters fp32. For an fp32 model use opt_level="O0" '
            'or "O1"; to keep O2 with fp32 parameters anyway, pass master_weights=False too.'
        )
    if (p.keep_batchnorm_fp32 is False and p.cast_model_type == torch.float32
            and "keep_batchnorm_fp32" not in passed):
        raise ValueError(
            f"{where}: cast_model_type=torch.float32 leaves the model fp32, and "
            f"{p.opt_level} is a model in half precision, BatchNorm included (its "
            'keep_batchnorm_fp32=False). For fp32 training use opt_level="O0"; for a half '
            "model drop cast_model_type (or pass torch.float16 / torch.bfloat16)."
        )
    if p.keep_batchnorm_fp32 is False and p.cast_model_type == torch.float32:
        raise ValueError(
            f"{where}: keep_batchnorm_fp32=False would cast BatchNorm to half in an fp32 "
            'model. Use opt_level="O3" for a half model, or drop keep_batchnorm_fp32.'
        )


def describe_opt_level(opt_level: str) -> str:
    return _DESCRIPTIONS[opt_level]
