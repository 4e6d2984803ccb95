"""``apex.multi_tensor_apply`` under the Apex alias.

Apex's ``multi_tensor_applier`` launched kernels of Apex's compiled ``amp_C`` extension, which
mixprec does not ship. Scripts import it (Apex's ImageNet example does, unused) and test
``multi_tensor_applier.available`` before use: here it imports, reports ``available = False``
so such scripts take their plain-PyTorch path, and a call raises an error naming the
replacement.
"""

from __future__ import annotations

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


class MultiTensorApply:
    """Apex's launcher of ``amp_C`` multi-tensor kernels; never available here."""

    available = False
    warned = False

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Raise: the ``amp_C`` kernels are not available (Apex raised when they were not)."""
        self(None, None, None)

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        raise RuntimeError(
            "apex.multi_tensor_apply.multi_tensor_applier runs kernels of Apex's compiled "
            "amp_C extension, which mixprec's Apex alias does not provide "
            "(multi_tensor_applier.available is False). Use PyTorch's multi-tensor ops "
            "instead: torch._foreach_mul_/_foreach_add_/_foreach_norm, "
            "torch.nn.utils.clip_grad_norm_(..., foreach=True), or a fused=True optimizer."
        )


multi_tensor_applier = MultiTensorApply(2048 * 32)
