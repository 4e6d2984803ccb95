"""Run the Triton kernels on CPU tensors when there is no GPU.

TRITON_INTERPRET is read when a ``@triton.jit`` function is created, i.e. when
``mixprec.normalization._kernels`` is first imported; the package imports that module lazily,
so setting the variable here, before any test runs, is early enough. With CUDA present the
kernels compile for the GPU instead and the interpreter tests skip.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
