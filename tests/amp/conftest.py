import pytest
import torch


@pytest.fixture(autouse=True)
def _skip_unsupported(request):
    """Skip fp16/bf16 cases the device cannot run, with the reason."""
    dtype = request.node.callspec.params.get("dtype") if hasattr(request.node, "callspec") else None
    device = request.node.callspec.params.get("device") if hasattr(request.node, "callspec") else None
    if str(device) == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("requires a GPU with bfloat16")
