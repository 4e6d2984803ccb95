"""The module machinery shared by FusedLayerNorm and FusedRMSNorm (and their Mixed variants)."""

import warnings
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from mixprec.amp._logging import is_rank_zero
from mixprec.normalization import _checks, _ops, reference

__all__ = []


def _require_affine(name: str, elementwise_affine, ignored: dict) -> None:
    """The Mixed variants are always affine; Apex's callers may still say so explicitly.
    Other keywords (``ignored``), which Apex's Mixed classes took and dropped (Megatron/NeMo
    callers pass ``sequence_parallel_enabled``), are dropped with a warning."""
    if ignored and is_rank_zero():  # (once per job: every rank builds the model)
        warnings.warn(
            f"{name}: ignoring the keyword argument(s) {', '.join(sorted(ignored))}, which it "
            "does not use (Apex's class dropped them too).", stacklevel=3)
    if not elementwise_affine:
        raise ValueError(
            f"{name}(elementwise_affine={elementwise_affine!r}): the Mixed variants always "
            "learn a weight (their output takes its dtype). Use the non-Mixed class for "
            "elementwise_affine=False."
        )


class _FusedNorm(nn.Module):
    """Parameters, forward and repr of a fused norm; ``_is_rms`` picks RMSNorm (no bias).

    The public subclasses carry the documentation and Apex's constructor signatures.
    """

    __constants__ = [
        "normalized_shape", "eps", "elementwise_affine", "memory_efficient",
        "_output_like_weight", "_is_rms",
    ]
    normalized_shape: Tuple[int, ...]
    eps: float
    elementwise_affine: bool
    memory_efficient: bool
    _output_like_weight: bool
    _is_rms: bool

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float,
        elementwise_affine: bool,
        memory_efficient: bool,
        *,
        is_rms: bool,
        output_like_weight: bool,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        name = type(self).__name__
        self.normalized_shape = _checks.normalize_shape(normalized_shape, name)
        if eps is None and is_rms:
            raise ValueError(
                f"{name}(eps=None): torch.nn.RMSNorm's eps=None (a machine epsilon chosen per "
                "input dtype) is not supported; pass a number, e.g. eps=1e-6."
            )
        self.eps = _checks.check_eps(eps, name)
        self.elementwise_affine = bool(elementwise_affine)
        self.memory_efficient = bool(memory_efficient)
        self._is_rms = is_rms
        # True in the Mixed variants: the output takes the weight's dtype, not the input's.
        self._output_like_weight = output_like_weight
        kw = {"device": device, "dtype": dtype}
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **kw))
        else:
            self.register_parameter("weight", None)
        if self.elementwise_affine and not is_rms and bias:
            self.bias = nn.Parameter(torch.empty(self.normalized_shape, **kw))
        else:
            # RMSNorm has none, nor LayerNorm(bias=False): not in the state dict either.
            self.register_parameter("bias", None)
        self.reset_parameters()

    # What an instance without its own value is (see __setstate__); set by each public class.
    _CLASS_IS_RMS = False
    _CLASS_OUTPUT_LIKE_WEIGHT = False

    def __setstate__(self, state) -> None:
        # A whole model saved under Apex (torch.save(model)) unpickles into these classes
        # through the Apex alias, with Apex's instance state: without mixprec's own attributes
        # (its forward failed on `_is_rms`), without `memory_efficient` before Apex added it,
        # and Apex's RMSNorm without a `bias`. Fill them in as the class makes them.
        super().__setstate__(state)
        self.__dict__.setdefault("_is_rms", self._CLASS_IS_RMS)
        self.__dict__.setdefault("_output_like_weight", self._CLASS_OUTPUT_LIKE_WEIGHT)
        self.__dict__.setdefault("memory_efficient", False)
        if "bias" not in self._parameters:
            self.register_parameter("bias", None)
        self.normalized_shape = tuple(self.normalized_shape)  # (Apex's is a torch.Size)

    def reset_parameters(self) -> None:
        """Weight to ones, bias (LayerNorm) to zeros."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        if torch.jit.is_scripting():
            # TorchScript cannot call the Triton launcher; run the plain-PyTorch math, after
            # the checks the eager path makes (the math would normalize over other dims, or
            # truncate an integer input, without a word).
            shape = list(self.normalized_shape)
            k = len(shape)
            if input.dim() < k or list(input.shape[input.dim() - k:]) != shape:
                raise ValueError(
                    "input of shape " + str(list(input.shape)) + " does not end with "
                    "normalized_shape " + str(shape) + "; pass the input's last dims as "
                    "normalized_shape or reshape the input")
            if not input.is_floating_point():
                # (TorchScript's str() of a dtype is its number: not named.)
                raise TypeError("the input must be floating point: float32, float16, "
                                "bfloat16 or float64")
            out_dtype = input.dtype
            if self._output_like_weight and self.weight is not None:
                out_dtype = self.weight.dtype
            if self._is_rms:
                return reference.rms_norm(input, shape, self.weight, self.eps, out_dtype)
            return reference.layer_norm(input, shape, self.weight, self.bias, self.eps, out_dtype)
        # One opaque call for torch.fx (see _fused_norm_forward).
        return _fused_norm_forward(
            input, self.weight, self.bias, self.normalized_shape, self.eps, self._is_rms,
            self.memory_efficient, self._output_like_weight, type(self).__name__,
        )

    def extra_repr(self) -> str:
        text = (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}, "
            f"memory_efficient={self.memory_efficient}"
        )
        if self.elementwise_affine and not self._is_rms and self.bias is None:
            text += ", bias=False"
        return text


@torch.jit.unused
def _fused_norm_forward(
    input: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    normalized_shape: Tuple[int, ...],
    eps: float,
    is_rms: bool,
    memory_efficient: bool,
    output_like_weight: bool,
    name: str,
) -> Tensor:
    """A module's forward outside TorchScript.

    Registered with ``torch.fx.wrap``: ``torch.fx.symbolic_trace`` records it as one
    ``call_function`` node (the parameters as ``get_attr`` inputs) instead of tracing into the
    launcher, which needs real tensors, as ``torch.nn.LayerNorm`` is one leaf module there.
    The arguments are checked once per input signature (shapes, strides, dtypes, devices),
    which is also what the launch plan is kept under: a norm runs twice per transformer layer
    and its host time is part of a step's.
    """
    # (A list or other non-tensor input gets the argument check's TypeError below. isinstance,
    # not getattr(input, "dtype"): the Dynamo of PyTorch 2.4 cannot trace that on a tensor.)
    out_dtype = (weight.dtype if output_like_weight and weight is not None
                 else input.dtype if isinstance(input, Tensor) else None)
    return _ops.fused_norm(input, normalized_shape, weight, bias, eps, is_rms, memory_efficient,
                           out_dtype, check=name, output_like_weight=output_like_weight)


torch.fx.wrap("_fused_norm_forward")
