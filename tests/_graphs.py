"""PyTorch's whole-step CUDA-graph capture recipe, shared by the amp and parallel tests."""

import torch

__all__ = ["amp_step", "warm_up_and_capture"]


def warm_up_and_capture(step, optimizer, warmup: int):
    """Run ``warmup`` eager steps on a side stream, then capture one ``step()`` in a graph.

    Gradients are set to None before every step and before the capture, so the captured
    backward allocates them and each replay overwrites them (a replay is a whole step).

    Returns:
        (torch.cuda.CUDAGraph, object): the graph and what the captured ``step()`` returned.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            optimizer.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def amp_step(model, optimizer, x, y):
    """One training step through amp: cross-entropy, ``scale_loss``, backward, ``step()``;
    returns the loss (``model`` may be a DDP wrapper)."""
    from mixprec import amp  # here, not at the top: the parallel tests' workers import lazily

    loss = torch.nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    return loss
