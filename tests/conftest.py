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

# Under pytest-xdist (-n N) each worker's CPU ops would use every core: N x cores threads
# thrash (at -n 16 on the 16-core GPU host, tests/amp's CPU cases took 371 s, the CPU parity
# test alone 234 s). Each worker takes its share, unless OMP_NUM_THREADS says otherwise.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS))


@pytest.fixture(autouse=True)
def _no_initialize_calls_from_other_tests():
    """Each test starts as a fresh process does: no live ``amp.initialize`` calls. Module-level
    ``amp.state_dict()`` and the checks across calls (one call's gradients seen in another's
    ``scale_loss``) then see only the test's own calls, whatever ran before it on this worker
    and in whatever order pytest-xdist hands the tests out. (Not through ``monkeypatch``: a
    test that calls ``monkeypatch.undo()`` midway would bring the other tests' calls back.)"""
    from mixprec.amp import frontend

    saved = frontend._calls, frontend._latest
    frontend._calls, frontend._latest = [], None
    yield
    frontend._calls, frontend._latest = saved


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
