"""Eager breaks: the calls (attention) that run outside the graph, between captured segments.

Built on ``breakable_cuda_graphs.no_graph``, which ends the current segment, runs the call, records
it as a replay step and begins the next segment, capturing each segment through ``torch.cuda.graph``
(so torch's own integrations stay on: pitfall 13). That primitive forbids CUDA tensors as
return values (break outputs must be out-parameters: pitfall 1) and raises on unjoined side streams
(pitfall 7). This module adds what a prefill runtime needs on top:

* padded rows of every declared output are zeroed after each replayed call, so garbage never flows
  into the next segment (pitfall 6): inside a bucket's graph by the segment that follows the break
  (:mod:`bcg_plugin.padding`), and by the break itself below the rows that segment covers, which
  in a GPU-bound bucket are all of them (a replay with no padded row there calls the break's own
  function, :func:`plain_call`);
* break arguments that live outside the runtime's pool are held strongly by the bucket, because
  the primitive replays with non-owning aliases (pitfall 2). Arguments inside the pool were
  written by an earlier segment of the same bucket, which replays right before the break;
* a break declared ``capturable`` (attention whose host can land each batch's metadata into
  buffers fixed per bucket) is captured inline, inside the segment, in the buckets whose capture
  asks for it (:func:`inline_breaks`): those buckets replay with no eager step there at all, and
  no scrub follows it. The host lands the step's metadata padded as for its own full graphs, whose
  padded rows nothing zeroes either: every op but attention is row-wise (a dynamic per-tensor
  activation scale, e.g. FP8 MoE input quantisation, reads them there too), attention reads only the
  rows its metadata names, and padded rows write no KV (their slots are the host's pad slot).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from breakable_cuda_graphs import no_graph

from bcg_plugin import live
from bcg_plugin.padding import RowScrub


class BreakArgumentHolds:
    """Strong references to the break arguments one bucket's replay needs, collected at capture."""

    def __init__(self, in_pool: Callable[[torch.Tensor], bool]) -> None:
        self._in_pool = in_pool
        self._held: dict[int, torch.Tensor] = {}

    def keep(self, args: tuple, kwargs: dict) -> None:
        leaves, _ = torch.utils._pytree.tree_flatten((args, kwargs))
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.is_cuda and id(t) not in self._held and not self._in_pool(t):
                self._held[id(t)] = t

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        self._held.clear()


_capture_holds: contextvars.ContextVar[BreakArgumentHolds | None] = contextvars.ContextVar(
    "bcg_capture_holds", default=None
)
_capture_scrub: contextvars.ContextVar[RowScrub | None] = contextvars.ContextVar("bcg_capture_scrub", default=None)
# Set for the capture of a bucket whose host lands attention metadata into fixed buffers: capturable
# breaks run inline there, so the kernel is recorded into the segment instead of ending it.
_capture_inline: contextvars.ContextVar[bool] = contextvars.ContextVar("bcg_capture_inline", default=False)
# A break's replay step -> the function it wraps: what replay calls when the graph zeroes every
# padded row itself, so the step's check of the live batch would find nothing to do.
_plain_calls: weakref.WeakKeyDictionary[Callable[..., Any], Callable[..., Any]] = weakref.WeakKeyDictionary()


def plain_call(step: Callable[..., Any]) -> Callable[..., Any]:
    """The call a replay may make in place of a break's recorded ``step`` when no padded row below
    the graph's scrub is left to zero: the break's own function (``step`` itself if it is not one of
    :func:`eager_break`'s)."""
    return _plain_calls.get(step, step)


def eager_break(fn: Callable[..., Any] | None = None, *, outputs: Sequence[str] = (),
                capturable: bool = False) -> Callable[..., Any]:
    """Mark ``fn`` as an eager break; outside a capture it is a plain call.

    Args:
        outputs: names of ``fn``'s out-parameters whose first dimension is the token row, one row
            per token of the bucket; rows at and past the live batch's ``num_tokens`` are zeroed
            after every call inside a padded bucket, before the next segment reads them.
        capturable: ``fn`` reads nothing per batch but device buffers whose addresses and shapes
            its host keeps fixed per bucket (and refills before each replay), so a bucket whose
            capture asks for it (the host's ``bcg_graph_attention``) records ``fn`` inline.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        params = list(inspect.signature(fn).parameters)
        missing = [name for name in outputs if name not in params]
        if missing:
            raise TypeError(f"eager_break({fn.__qualname__}): outputs {missing} are not parameters of it")
        positions = [(name, params.index(name)) for name in outputs]

        def declared(args: tuple, kwargs: dict) -> Iterator[tuple[str, torch.Tensor]]:
            """One call's declared outputs by name, passed by keyword or by position."""
            for name, pos in positions:
                yield name, kwargs[name] if name in kwargs else args[pos]

        @functools.wraps(fn)
        def step(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            batch = live.get()
            if batch is not None:
                n, graph_rows = batch.num_tokens, batch.graph_scrub_start  # the graph zeroes rows from there
                if n < (batch.bucket if graph_rows is None else graph_rows):
                    for _, out in declared(args, kwargs):
                        out[n:graph_rows].zero_()
            return result

        def capture_step(*args: Any, **kwargs: Any) -> Any:
            # Runs once, at capture, in place of ``step``; replays call ``step`` itself.
            result = step(*args, **kwargs)
            holds = _capture_holds.get()
            if holds is not None:
                holds.keep(args, kwargs)
            return result

        _plain_calls[step] = fn
        broken = no_graph(step, capture_stub=capture_step)
        if not positions and not capturable:
            return broken

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            inline = capturable and _capture_inline.get()
            if inline:  # padded rows as in the host's own full graphs, which leave them alone too
                return fn(*args, **kwargs)
            result = broken(*args, **kwargs)
            scrub = _capture_scrub.get()
            if scrub is not None:  # under a bucket's capture: the segment after the break begins here
                for name, out in declared(args, kwargs):
                    scrub.apply(out, name)
            return result

        return call

    return decorate(fn) if fn is not None else decorate
