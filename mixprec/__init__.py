"""mixprec: Apex-style mixed-precision training on today's PyTorch.

Three tools in one package:

* :mod:`mixprec.amp` -- ``amp.initialize`` / ``amp.scale_loss`` with opt levels O0-O3,
  fp16 and bf16, fp32 master weights and dynamic loss scaling.
* :mod:`mixprec.parallel` -- ``DistributedDataParallel``, ``SyncBatchNorm``, ``Reducer``
  and ``LARC`` on ``torch.distributed``.
* :mod:`mixprec.normalization` -- fused LayerNorm / RMSNorm and a BatchNorm whose half
  training pass avoids PyTorch's slow path (Triton on GPU, PyTorch on CPU).

And :mod:`mixprec.optimizers`: Apex's ``FusedAdam``, whose step also writes amp O2's half model.
"""

from mixprec import amp, normalization, optimizers, parallel
from mixprec._apex_alias import install_apex_alias

__version__ = "0.1.0"

__all__ = ["amp", "install_apex_alias", "normalization", "optimizers", "parallel",
           "__version__"]
