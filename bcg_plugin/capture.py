"""One bucket's segmented capture, as a transaction.

Entering or leaving a capture either completes or leaves nothing behind: no changed current stream
(``torch.cuda.graph`` enters the stream context before ``capture_begin``, so a failing begin would
leak it), no bound context variable, no half-built graph, gc back on;
and the original exception propagates unmasked (pitfalls 4, 9, 10).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from breakable_cuda_graphs import BreakableCUDAGraph, breakable_graph

from bcg_plugin.breaks import BreakArgumentHolds, _capture_holds
from bcg_plugin.pool import GraphPool

T = TypeVar("T")


class SegmentedGraph:
    """A captured bucket: its graph segments and eager breaks, and what its breaks must keep alive."""

    def __init__(self, graph: BreakableCUDAGraph, holds: BreakArgumentHolds) -> None:
        self._graph = graph
        self._holds = holds

    @property
    def num_segments(self) -> int:
        return len(self._graph._segments)

    def replay(self) -> None:
        self._graph.replay()

    def release(self) -> None:
        # Graphs first, then the blocks they point at (pitfall 10).
        self._graph.reset()
        self._holds.clear()


def capture_segments(
    fn: Callable[[], T], *, pool: GraphPool, stream: torch.cuda.Stream
) -> tuple[SegmentedGraph, T]:
    """Capture ``fn()`` into segments on ``stream`` in ``pool``; return the graph and ``fn``'s result."""
    holds = BreakArgumentHolds(pool.contains)
    graph = BreakableCUDAGraph(pool=pool.handle)
    outer_stream = torch.cuda.current_stream()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collected graph calling reset() mid-capture invalidates it (pitfall 9)
    token = _capture_holds.set(holds)
    completed = False
    try:
        with torch.cuda.stream(stream), breakable_graph(graph, stream=stream):
            result = fn()
        completed = True
        return SegmentedGraph(graph, holds), result
    finally:
        _capture_holds.reset(token)
        if not completed:
            graph.reset()
            holds.clear()
            torch.cuda.set_stream(outer_stream)
        if gc_was_enabled:
            gc.enable()
