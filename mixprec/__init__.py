"""mixprec: Apex-style mixed-precision training on today's PyTorch.

Three tools in one package:

* :mod:`mixprec.amp` -- ``amp.initialize`` / ``amp.scale_loss`` with opt levels O0-O3,
  fp16 and bf16, fp32 master weights and dynamic loss scaling.
* :mod:`mixprec.parallel` -- ``DistributedDataParallel``, ``SyncBatchNorm``, ``Reducer``
  and ``LARC`` on ``torch.distributed``.
* :mod:`mixprec.normalization` -- fused LayerNorm / RMSNorm (Triton on GPU, PyTorch on CPU).
"""

from mixprec import amp, normalization, parallel
from mixprec._apex_alias import install_apex_alias

__version__ = "0.1.0"

__all__ = ["amp", "install_apex_alias", "normalization", "parallel", "__version__"]
