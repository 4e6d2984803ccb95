"""The DDP and SyncBatchNorm checks on 4 and 8 ranks (opt-in: 8 processes take a while).

    MIXPREC_TEST_WORLD_SIZES=4,8 python -m pytest -q tests/parallel/test_more_ranks.py

Over gloo on the CPU; over NCCL as well where the machine has that many GPUs.
"""

import os

import pytest

from . import test_distributed, test_sync_batchnorm
from ._harness import cuda_count, run_checks

_SIZES = [int(s) for s in os.environ.get("MIXPREC_TEST_WORLD_SIZES", "").split(",") if s.strip()]
_GROUPS = [(test_distributed, test_distributed.CHECKS),
           (test_sync_batchnorm, test_sync_batchnorm.GROUP_2)]

pytestmark = pytest.mark.skipif(
    not _SIZES, reason="set MIXPREC_TEST_WORLD_SIZES=4,8 to run the checks on more ranks"
)


@pytest.mark.parametrize("world_size", _SIZES or [4])
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("group", range(len(_GROUPS)), ids=["ddp", "syncbn"])
def test_checks_on_more_ranks(world_size, backend, group):
    if backend == "nccl" and cuda_count() < world_size:
        pytest.skip(f"requires {world_size} GPUs")
    module, checks = _GROUPS[group]
    device_type = "cuda" if backend == "nccl" else "cpu"
    result = run_checks(module.__name__, checks, world_size=world_size, backend=backend,
                        device_type=device_type, deadline_s=600.0, pg_timeout_s=300.0)
    for name in checks:
        result.assert_ok(name)
