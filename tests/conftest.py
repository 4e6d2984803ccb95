"""Shared test fixtures: the devices to run on, and quiet logging.

Without a GPU the Triton kernels (normalization, SyncBatchNorm's reductions) run on CPU tensors
in Triton's interpreter. TRITON_INTERPRET is read when a ``@triton.jit`` function is created,
i.e. when a kernels module is first imported (lazily, at first use), so setting it here, before
any test runs, is early enough; the worker processes of the distributed tests inherit it. With
CUDA present the kernels compile for the GPU instead and the interpreter tests skip.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def requires_cuda(fn):
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")(fn)


@pytest.fixture
def clean_apex(monkeypatch):
    """No ``apex`` modules in ``sys.modules`` during the test (the alias's tests install it)."""
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path
                        if type(f).__name__ != "_AliasDistributionFinder"]
