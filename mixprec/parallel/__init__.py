"""mixprec.parallel: Apex's data-parallel tools on ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

* :class:`DistributedDataParallel` -- Apex's arguments on PyTorch's C++ gradient reducer;
  half gradients all-reduced in half, Apex's pre-divide averaging.
* :class:`SyncBatchNorm`, :func:`convert_syncbn_model`, :func:`create_syncbn_process_group` --
  batch statistics over all ranks, one small collective per layer and direction.
* :class:`Reducer` -- average gradients when you ask.
* :class:`LARC` -- layer-wise adaptive rate scaling around any optimizer.

Example::

    >>> from mixprec import amp
    >>> from mixprec.parallel import DistributedDataParallel, convert_syncbn_model
    >>> torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # launched by torchrun
    >>> torch.distributed.init_process_group("nccl")
    >>> model = convert_syncbn_model(model).cuda()  # an optimizer built before stays valid
    >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    >>> model = DistributedDataParallel(model)
"""

import torch

from mixprec.parallel.convert import convert_syncbn_model, create_syncbn_process_group
from mixprec.parallel.distributed import DistributedDataParallel
from mixprec.parallel.larc import LARC
from mixprec.parallel.reducer import Reducer
from mixprec.parallel.sync_batchnorm import SyncBatchNorm

# Apex's apex.parallel also gave torch's ReduceOp (scripts import it from there).
ReduceOp = torch.distributed.ReduceOp

__all__ = [
    "LARC",
    "DistributedDataParallel",
    "Reducer",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
]
