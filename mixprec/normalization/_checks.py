"""Argument checks shared by the norm functions and modules; errors name what was passed."""

import math
import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = []

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# mixprec functions named as Apex functions with another argument order (see check_inputs).
_APEX_FUNCTIONAL = ("fused_layer_norm", "fused_rms_norm")


def normalize_shape(normalized_shape: Union[int, Sequence[int]], where: str) -> Tuple[int, ...]:
    """``int`` or sequence of ints -> tuple of ints, rejecting anything else with a clear error."""
    if isinstance(normalized_shape, bool):
        raise TypeError(f"{where}: normalized_shape must be an int or a tuple of ints, got a bool")
    if isinstance(normalized_shape, numbers.Integral):  # int, NumPy integers, ...
        shape = (int(normalized_shape),)
    elif isinstance(normalized_shape, (tuple, list, torch.Size)):
        if not all(isinstance(d, numbers.Integral) and not isinstance(d, bool)
                   for d in normalized_shape):
            raise TypeError(
                f"{where}: normalized_shape must hold ints, got {normalized_shape!r}"
            )
        shape = tuple(int(d) for d in normalized_shape)
    else:
        raise TypeError(
            f"{where}: normalized_shape must be an int or a tuple of ints, "
            f"got {type(normalized_shape).__name__}"
        )
    if len(shape) == 0 or any(d < 0 for d in shape):
        raise ValueError(
            f"{where}: normalized_shape must be one or more non-negative sizes, got {shape}"
        )
    return shape


def check_inputs(
    where: str,
    x: Tensor,
    normalized_shape: Tuple[int, ...],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
) -> None:
    """Validate the functional arguments; raise TypeError/ValueError naming the bad argument."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{where}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{where}: input dtype {x.dtype} is not supported; use float32, float16, bfloat16 "
            "(fused) or float64 (PyTorch path)"
        )
    k = len(normalized_shape)
    if x.dim() < k or tuple(x.shape[x.dim() - k:]) != normalized_shape:
        if x.dim() == 0:
            fix = f"a 0-dim input has no dims to normalize; it needs trailing dims {normalized_shape}"
        else:
            # (as many trailing dims as normalized_shape has, not only the last one)
            fix = (f"pass the input's last dims as normalized_shape (e.g. "
                   f"{tuple(x.shape[max(x.dim() - k, 0):])}) or reshape the input")
        raise ValueError(
            f"{where}: input of shape {tuple(x.shape)} does not end with normalized_shape "
            f"{normalized_shape}; {fix}"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, Tensor):
            hint = ""
            if isinstance(p, numbers.Real) and where in _APEX_FUNCTIONAL:
                # Apex's fused_layer_norm(input, normalized_shape, eps): an eps in weight's place.
                params = "weight, eps" if "rms" in where else "weight, bias, eps"
                hint = (f". mixprec's {where}(x, normalized_shape, {params}) follows "
                        f"torch.nn.functional's order; Apex's {where}(input, normalized_shape, "
                        f"eps) is mixprec.normalization.apex_functional.{where} (also "
                        f"apex.normalization.fused_layer_norm.{where} through the Apex alias)")
            raise TypeError(
                f"{where}: {name} must be a Tensor or None, got {type(p).__name__}{hint}")
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{where}: {name} dtype {p.dtype} is not supported; use float32, float16, "
                "bfloat16 or float64"
            )
        if tuple(p.shape) != normalized_shape:
            raise ValueError(
                f"{where}: {name} has shape {tuple(p.shape)} but normalized_shape is "
                f"{normalized_shape}; they must be equal"
            )
        if p.device != x.device:
            raise ValueError(
                f"{where}: {name} is on {p.device} but the input is on {x.device}; move both "
                "to the same device"
            )
    check_eps(eps, where)


def check_eps(eps, where: str) -> float:
    """``eps`` as a float: any real number (``float``, ``int``, NumPy scalars such as
    ``np.float32``, as ``torch.nn.LayerNorm`` takes), finite and non-negative; not a bool."""
    value = None
    if isinstance(eps, numbers.Real) and not isinstance(eps, bool):
        try:
            value = float(eps)
        except (TypeError, OverflowError):  # (an int too large for a float)
            value = None
    # Comparisons, not math.isfinite: under torch.compile(dynamic=True) a module's float eps
    # is a symbolic float, which Dynamo cannot pass to math.isfinite (fullgraph=True raised);
    # a comparison is traced (a guard). NaN fails both.
    if value is None or not 0.0 <= value < math.inf:
        raise ValueError(
            f"{where}: eps must be a non-negative float (a finite real number >= 0, not a "
            f"bool), got {eps!r}; pass e.g. eps=1e-5"
        )
    return value
