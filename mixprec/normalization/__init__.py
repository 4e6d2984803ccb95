"""mixprec.normalization: fused LayerNorm and RMSNorm (Triton on CUDA, PyTorch elsewhere),
and a BatchNorm whose half-precision training pass avoids PyTorch's slow kernels.

Apex-compatible modules and functions; :mod:`mixprec.normalization.reference` holds the
plain-PyTorch math they fall back to and are tested against.
"""

from mixprec.normalization import reference
from mixprec.normalization.batch_norm import FusedBatchNorm, convert_fused_batchnorm
from mixprec.normalization.layer_norm import FusedLayerNorm, MixedFusedLayerNorm, fused_layer_norm
from mixprec.normalization.rms_norm import FusedRMSNorm, MixedFusedRMSNorm, fused_rms_norm

__all__ = [
    "FusedBatchNorm",
    "convert_fused_batchnorm",
    "FusedLayerNorm",
    "MixedFusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm",
    "fused_rms_norm",
    "reference",
]
