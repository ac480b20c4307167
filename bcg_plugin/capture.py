"""One bucket's segmented capture, as a transaction.

Entering or leaving a capture either completes or leaves nothing behind: no changed current stream
(``torch.cuda.graph`` enters the stream context before ``capture_begin``, so a failing begin would
leak it), no bound context variable, no half-built graph, gc back on;
and the original exception propagates unmasked (pitfalls 4, 9, 10).

It leans on ``torch.cuda.graph``'s internals (below), so it captures only under the torch releases
whose source was checked, :data:`SUPPORTED_TORCH_RANGE`; under any other a capture raises at once.

Every segment is still captured through ``torch.cuda.graph`` (pitfall 13), but only a bucket's
first segment runs its pre-capture cleanup (device synchronise, ``empty_cache`` and the pinned-host
cache flush). Between two segments of one bucket only an eager break has run, so there is nothing
to free; repeating the cleanup before each of a bucket's ~30 segments was most of capture time,
and flushing the pinned-host cache hundreds of times makes the host's next steps re-pin memory.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from breakable_cuda_graphs import BreakableCUDAGraph, _EagerSegment, breakable_graph
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from bcg_plugin.breaks import BreakArgumentHolds, _capture_holds, _capture_inline, _capture_scrub, plain_call
from bcg_plugin.errors import BcgVersionError
from bcg_plugin.padding import RowScrub
from bcg_plugin.pool import GraphPool

T = TypeVar("T")

# The torch releases this module and :mod:`bcg_plugin.pool` were checked against, from their source.
# ``_SegmentGraphContext`` re-implements ``torch.cuda.graph.__enter__`` without its cleanup: the
# stream context, then ``capture_begin(*pool, capture_error_mode=)``, on the attributes
# ``stream_ctx``, ``cuda_graph``, ``pool`` and ``capture_error_mode``; torch's ``__exit__`` ends
# it. Through 2.14 the rest of torch's ``__enter__`` is cleanup, or annotations and input-liveness
# tracking, which ``breakable_graph`` leaves off. The pool needs ``memory_snapshot(...,
# include_traces=)``, new in 2.11. A later release may change any of it, so it is refused until
# checked.
SUPPORTED_TORCH_RANGE = ">=2.11,<2.15"
SUPPORTED_TORCH = SpecifierSet(SUPPORTED_TORCH_RANGE)


def torch_version_problem(found: str | None = None) -> str | None:
    """Why bcg cannot capture under torch ``found`` (default: the one imported), or ``None`` if it can."""
    found = torch.__version__ if found is None else found
    try:
        supported = SUPPORTED_TORCH.contains(Version(found), prereleases=True)
    except InvalidVersion:
        supported = False
    if supported:
        return None
    return (f"torch {found} is outside the range bcg-plugin supports ({SUPPORTED_TORCH_RANGE}); use an engine "
            "release built on a torch in that range")


def check_torch_version() -> None:
    """Raise :class:`~bcg_plugin.errors.BcgVersionError` unless the imported torch is in :data:`SUPPORTED_TORCH`."""
    problem = torch_version_problem()
    if problem is not None:
        raise BcgVersionError(problem)


class _SegmentGraphContext(torch.cuda.graph):
    """``torch.cuda.graph`` for a bucket's later segments: the same stream and begin/end, no cleanup."""

    def __enter__(self) -> None:
        self.stream_ctx.__enter__()
        try:
            self.cuda_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            self.stream_ctx.__exit__(None, None, None)
            raise


class _BucketCapture(breakable_graph):
    """``breakable_graph`` whose segments after the first skip ``torch.cuda.graph``'s cleanup."""

    def _new_graph_ctx(self, g: torch.cuda.CUDAGraph) -> None:
        first = self._cuda_graph._segments[0] is g
        factory = torch.cuda.graph if first else _SegmentGraphContext
        self._graph_ctx = factory(g, pool=self._cuda_graph.pool(), stream=self._stream,
                                  capture_error_mode=self._capture_error_mode)


if not callable(getattr(breakable_graph, "_new_graph_ctx", None)) or not {"fn", "args", "kwargs"} <= set(
        getattr(_EagerSegment, "__slots__", ())):  # pragma: no cover - pinned dependency
    raise ImportError("bcg_plugin needs breakable-cuda-graphs 0.1.0 (breakable_graph._new_graph_ctx or "
                      "_EagerSegment's fn/args/kwargs are missing)")


def default_capture_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream ``torch.cuda.graph`` captures on when it is given none, or ``None`` if that one is on
    another device. Where torch has not made it yet, it is made here, as torch would make it.

    Every stream that runs a matmul pins a cuBLAS workspace of its own (32 MiB on Hopper) for the
    life of the process. A host whose own graphs are captured without naming a stream (vLLM's V2
    decode graphs) captures them there, so bcg capturing there too shares one workspace with them.
    Graphs captured on one stream are independent: only the capture, not the replay, uses it.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    graph_class: Any = torch.cuda.graph
    stream = getattr(graph_class, "default_capture_stream", None)
    if stream is None:
        with torch.cuda.device(index):
            stream = graph_class.default_capture_stream = torch.cuda.Stream()
    return stream if stream.device_index == index else None


def _replay_step(segment: torch.cuda.CUDAGraph | _EagerSegment, *, plain: bool) -> Callable[[], None]:
    # An eager segment's call bound up front: replay then calls the break directly, as vLLM's own
    # breakable graphs do, instead of through the segment's replay method (one frame per break).
    if isinstance(segment, _EagerSegment):
        fn = plain_call(segment.fn) if plain else segment.fn
        return functools.partial(fn, *segment.args, **segment.kwargs)
    return segment.replay


class SegmentedGraph:
    """A captured bucket: its graph segments and eager breaks, and what its breaks must keep alive.

    Replay walks one flat tuple of calls (segment replays and bound breaks) built once at capture.
    There are two such tuples. In the usual replay the graph zeroes every padded row itself
    (:mod:`bcg_plugin.padding`), so each break is the host's own call, as in the host's breakable
    graphs. A batch padded below the graph's scrub (a data-parallel rank padded to its peers'
    bucket, or any padded batch of a bucket whose graph scrubs no row) replays the breaks' recorded
    steps instead, which zero those rows after each call.
    """

    def __init__(self, graph: BreakableCUDAGraph, holds: BreakArgumentHolds) -> None:
        self._graph = graph
        self._holds = holds
        self._steps = tuple(_replay_step(segment, plain=True) for segment in graph._segments)
        self._zeroing_steps = tuple(_replay_step(segment, plain=False) for segment in graph._segments)

    @property
    def num_segments(self) -> int:
        return len(self._graph._segments)

    def replay(self, *, breaks_zero_padding: bool = False) -> None:
        """Replay segments and breaks; ``breaks_zero_padding``: the batch has padded rows below the
        graph's scrub, which the breaks zero (the live batch bound around the replay names them)."""
        for step in self._zeroing_steps if breaks_zero_padding else self._steps:
            step()

    def release(self) -> None:
        # Graphs first, then the blocks they point at (pitfall 10).
        self._steps = self._zeroing_steps = ()
        self._graph.reset()
        self._holds.clear()


def capture_segments(
    fn: Callable[[], T], *, pool: GraphPool, stream: torch.cuda.Stream, scrub: RowScrub | None = None,
    inline_breaks: bool = False,
) -> tuple[SegmentedGraph, T]:
    """Capture ``fn()`` into segments on ``stream`` in ``pool``; return the graph and ``fn``'s result.

    ``scrub``: the padded rows the segment after each break zeroes in the breaks' outputs.
    ``inline_breaks``: record the breaks declared capturable inside the segments.
    """
    check_torch_version()
    holds = BreakArgumentHolds(pool.contains)
    graph = BreakableCUDAGraph(pool=pool.handle)
    outer_stream = torch.cuda.current_stream()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collected graph calling reset() mid-capture invalidates it (pitfall 9)
    token = _capture_holds.set(holds)
    scrub_token = _capture_scrub.set(scrub)
    inline_token = _capture_inline.set(inline_breaks)
    completed = False
    try:
        with torch.cuda.stream(stream), _BucketCapture(graph, stream=stream):
            result = fn()
        completed = True
        return SegmentedGraph(graph, holds), result
    finally:
        _capture_inline.reset(inline_token)
        _capture_scrub.reset(scrub_token)
        _capture_holds.reset(token)
        if not completed:
            graph.reset()
            holds.clear()
            pool.end_failed_capture()
            torch.cuda.set_stream(outer_stream)
        if gc_was_enabled:
            gc.enable()
