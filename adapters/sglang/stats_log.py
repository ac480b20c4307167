"""The runtime's counters as a periodic line in SGLang's log (Prometheus is a separate exporter)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from bcg_plugin import RuntimeStats

logger = logging.getLogger("bcg_plugin.sglang")


class StatsLogger:
    """Logs :meth:`RuntimeStats.summary` at most once per ``interval_s``, only when it changed.

    Driven from the forward path (no thread): a scheduler that serves nothing logs nothing.
    """

    def __init__(self, stats: RuntimeStats, interval_s: float, *, clock: Callable[[], float] = time.monotonic):
        self.stats = stats
        self.interval_s = interval_s
        self._clock = clock
        self._last_time = clock()
        self._last_line: str | None = None

    def maybe_log(self) -> str | None:
        if self.interval_s <= 0:
            return None
        now = self._clock()
        if now - self._last_time < self.interval_s:
            return None
        self._last_time = now
        line = self.stats.summary()
        if line == self._last_line:
            return None
        self._last_line = line
        logger.info("bcg prefill graphs: %s", line)
        return line
