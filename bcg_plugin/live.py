"""The live forward context that eager breaks read at every replay.

Python inside a captured segment runs once, at capture; only eager breaks run again at replay. Any
per-batch value a break needs (sequence lengths, slot mapping, the valid-row count) must therefore
come from here, rebound by the runner around every replay, never from a variable frozen at capture
(pitfall 8).
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

from bcg_plugin.errors import BcgStateError


@dataclasses.dataclass(frozen=True)
class LiveBatch:
    """One forward as the breaks see it.

    Attributes:
        num_tokens: real rows; rows ``[num_tokens, bucket)`` are padding that breaks must neither
            attend to nor leave as garbage for the next segment.
        bucket: padded row count the graph was captured for.
        payload: the adapter's per-batch state (attention metadata, host forward context ...).
        graph_scrub_start: the first row the bucket's graph zeroes itself after each break when
            padded (:mod:`bcg_plugin.padding`); breaks zero the padded rows below it. ``None``:
            the graph zeroes none, the breaks every padded row.
    """

    num_tokens: int
    bucket: int
    payload: Any = None
    graph_scrub_start: int | None = None

    @property
    def padded(self) -> bool:
        return self.num_tokens < self.bucket


_live: contextvars.ContextVar[LiveBatch | None] = contextvars.ContextVar("bcg_live_batch", default=None)


def current() -> LiveBatch:
    """The batch being captured or replayed; raises if a break runs outside one."""
    batch = _live.get()
    if batch is None:
        raise BcgStateError(
            "no live batch is bound: an eager break that reads per-batch state ran outside a bcg "
            "capture or replay; bind one with bcg_plugin.live.bound(LiveBatch(...))"
        )
    return batch


def get() -> LiveBatch | None:
    """The bound batch, or ``None`` during a plain eager forward."""
    return _live.get()


class bound:
    """``with bound(batch):`` binds ``batch`` as the live batch for the block.

    A plain class rather than a generator context manager: it is entered on every replay.
    """

    __slots__ = ("_batch", "_token")

    def __init__(self, batch: LiveBatch) -> None:
        self._batch = batch

    def __enter__(self) -> LiveBatch:
        self._token = _live.set(self._batch)
        return self._batch

    def __exit__(self, *exc: object) -> None:
        _live.reset(self._token)
