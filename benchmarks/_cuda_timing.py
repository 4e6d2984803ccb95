"""CUDA timing shared by the probe scripts: graph capture and median CUDA-event times.

Import it from a script in this folder (``python benchmarks/x.py`` puts the folder on
``sys.path``)::

    from _cuda_timing import capture_graph, median_ms

Both need a CUDA device; nothing here runs at import.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

__all__ = ["capture_graph", "median_ms"]


def capture_graph(fn: Callable[[], object], warmup: int = 3) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one ``fn()`` call, after ``warmup`` calls on a side stream.

    PyTorch's capture recipe: the warm-up runs on a side stream (lazy initialisation, cuBLAS
    workspaces and allocator pools must exist before capture), which the current stream then
    waits for. Replaying the graph times the GPU's work alone, without the host's launches.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def median_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 0) -> float:
    """Median over ``reps`` calls of ``fn()``'s time between two CUDA events, in ms.

    Each call is timed alone (the host waits for its end event before the next one), so a call
    whose launches outpace the GPU measures the GPU's time and one that does not measures the
    host's: pass ``graph.replay`` for the GPU alone. ``warmup`` untimed calls run first.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
