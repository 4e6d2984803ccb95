"""Run SyncBatchNorm's Triton reductions on CPU tensors when there is no GPU.

TRITON_INTERPRET is read when a ``@triton.jit`` function is created, i.e. when
``mixprec.parallel._syncbn_kernels`` is first imported (lazily, at first use), so setting it
here is early enough; the worker processes of the distributed tests inherit it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
