"""An autograd Function whose backward fails, shared by the amp and parallel tests."""

import torch

__all__ = ["FailingBackward"]


class FailingBackward(torch.autograd.Function):
    """Identity whose backward raises (an out-of-memory error in the middle of a backward,
    after the layers above it already received their gradients)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("out of memory (simulated)")
