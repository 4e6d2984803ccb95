"""Shared test fixtures: the devices to run on, and quiet logging."""

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def requires_cuda(fn):
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")(fn)
