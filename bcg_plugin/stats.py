"""Counters the runtime keeps; adapters export them through the host's own metrics and logs."""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from typing import Any


class Fallback(str, enum.Enum):
    """Why a forward ran eagerly instead of replaying a graph."""

    OVER_TOP_BUCKET = "over_top_bucket"
    DP_DISAGREEMENT = "dp_disagreement"
    CAPTURE_FAILED = "capture_failed"
    FEATURE_NOT_CAPTURED = "feature_not_captured"
    PADDING_RATIO = "padding_ratio"


@dataclasses.dataclass
class RuntimeStats:
    """Running totals since the runner was built (monotonic, so Prometheus counters can mirror them)."""

    replays_by_bucket: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    real_tokens: int = 0
    padded_tokens: int = 0
    buckets_captured: int = 0
    capture_seconds: float = 0.0
    warmup_seconds: float = 0.0  # the part of capture_seconds spent in eager warm-up forwards
    # Device memory the capture took: the pool, the static buffers and the driver's memory for the
    # captured graphs, which grows with buckets x segments (0.22 GiB of 0.56 for the Qwen3-0.6B
    # shape's 56 buckets x 29 segments on an H200).
    graph_bytes: int = 0
    pool_bytes: int = 0  # the part of graph_bytes in the graphs' memory pool
    # Buckets whose attention was captured inside the graph: their replays run no eager step at all
    # (except in a BREAKING variant).
    graph_attention_buckets: list[int] = dataclasses.field(default_factory=list)
    # Further graphs of those buckets (the host's variants) and the replays each variant served.
    variant_graphs: int = 0
    replays_by_variant: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def record_replay(self, bucket: int, num_tokens: int, variant: str | None = None) -> None:
        self.replays_by_bucket[bucket] += 1
        self.real_tokens += num_tokens
        self.padded_tokens += bucket - num_tokens
        if variant is not None:
            self.replays_by_variant[variant] += 1

    def record_fallback(self, reason: Fallback) -> None:
        self.fallbacks[reason.value] += 1

    @property
    def padding_waste(self) -> float:
        """Padded tokens per real token over every replay so far."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0

    def summary(self) -> str:
        return (
            f"replays={sum(self.replays_by_bucket.values())} "
            f"fallbacks={dict(self.fallbacks) or 0} padding_waste={self.padding_waste:.1%} "
            f"buckets={self.buckets_captured} graph_attention={len(self.graph_attention_buckets)} "
            + (f"variants={self.variant_graphs} variant_replays={dict(self.replays_by_variant) or 0} "
               if self.variant_graphs else "")
            + f"capture={self.capture_seconds:.2f}s "
            f"(warmup={self.warmup_seconds:.2f}s) "
            f"graph_mem={self.graph_bytes / 2**30:.3f}GiB (pool {self.pool_bytes / 2**30:.3f}GiB)"
        )


class StatsReporter:
    """Publishes one runner's stats from the forward path (no thread: an idle engine reports nothing).

    A summary line goes to the host's logger at most once per ``interval_s`` and only when it
    changed; a Prometheus exporter, if given, is refreshed at most once per ``export_interval_s``
    so a scrape never lags by more than that.
    """

    def __init__(self, stats: RuntimeStats, *, logger: logging.Logger, interval_s: float,
                 exporter: Any = None, export_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.stats, self.logger, self.interval_s = stats, logger, interval_s
        self.exporter, self.export_interval_s = exporter, export_interval_s
        self._clock = clock
        self._last_log = self._last_export = clock()
        self._last_line: str | None = None

    def tick(self) -> str | None:
        """Call after every forward; returns the line logged, if any."""
        now = self._clock()
        if self.exporter is not None and now - self._last_export >= self.export_interval_s:
            self._last_export = now
            self.exporter.update(self.stats)
        if self.interval_s <= 0 or now - self._last_log < self.interval_s:
            return None
        self._last_log = now
        line = self.stats.summary()
        if line == self._last_line:
            return None
        self._last_line = line
        self.logger.info("bcg prefill graphs: %s", line)
        return line
