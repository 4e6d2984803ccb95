"""Shared setup of the benchmark tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    # The workloads here are tiny: a second OpenMP thread only adds synchronisation, and on a
    # busy 2-core CI machine its spin-waits make each step several times slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
