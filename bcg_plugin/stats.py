"""Counters the runtime keeps; adapters export them through the host's own metrics and logs."""

from __future__ import annotations

import collections
import dataclasses
import enum


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
    graph_bytes: int = 0

    def record_replay(self, bucket: int, num_tokens: int) -> None:
        self.replays_by_bucket[bucket] += 1
        self.real_tokens += num_tokens
        self.padded_tokens += bucket - num_tokens

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
            f"buckets={self.buckets_captured} capture={self.capture_seconds:.2f}s "
            f"graph_mem={self.graph_bytes / 2**30:.3f}GiB"
        )
