"""mixprec.normalization: fused LayerNorm and RMSNorm (Triton on CUDA, PyTorch elsewhere).

Apex-compatible modules and functions; :mod:`mixprec.normalization.reference` holds the
plain-PyTorch math they fall back to and are tested against.
"""

from mixprec.normalization import reference
from mixprec.normalization.layer_norm import FusedLayerNorm, MixedFusedLayerNorm, fused_layer_norm
from mixprec.normalization.rms_norm import FusedRMSNorm, MixedFusedRMSNorm, fused_rms_norm

__all__ = [
    "FusedLayerNorm",
    "MixedFusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm",
    "fused_rms_norm",
    "reference",
]
