"""Runtime counters as Prometheus metrics, registered in the host's own registry.

Hosts expose ``prometheus_client``'s default registry on ``/metrics`` (vLLM through its API
server, SGLang with ``--enable-metrics``); metrics created here land there with the host's
prefix (``vllm:bcg_...``, ``sglang:bcg_...``). Counters only move forward, so :meth:`update`
publishes the growth of :class:`~bcg_plugin.stats.RuntimeStats` since the last call.
"""

from __future__ import annotations

from typing import Any

from bcg_plugin.stats import Fallback, RuntimeStats


class PrometheusExporter:
    """Mirrors one runner's :class:`RuntimeStats` into Prometheus counters and gauges."""

    def __init__(self, prefix: str, labels: dict[str, str] | None = None, registry=None):
        import prometheus_client as prom

        self._labels = dict(labels or {})
        names = sorted(self._labels)
        kw = {"registry": registry} if registry is not None else {}
        self.replays = prom.Counter(f"{prefix}bcg_replays", "Prefill forwards replayed from bcg graphs, by bucket",
                                    [*names, "bucket"], **kw)
        self.fallbacks = prom.Counter(f"{prefix}bcg_eager_fallbacks", "Prefill forwards run eagerly, by reason",
                                      [*names, "reason"], **kw)
        self.real_tokens = prom.Counter(f"{prefix}bcg_real_tokens", "Real tokens in replayed forwards", names, **kw)
        self.padded_tokens = prom.Counter(f"{prefix}bcg_padded_tokens", "Padding tokens in replayed forwards",
                                          names, **kw)
        self.capture_seconds = prom.Gauge(f"{prefix}bcg_capture_seconds", "Seconds spent capturing bcg graphs",
                                          names, **kw)
        self.graph_bytes = prom.Gauge(f"{prefix}bcg_graph_memory_bytes",
                                      "Device memory bcg's capture took (pool, buffers, the graphs themselves)",
                                      names, **kw)
        self.pool_bytes = prom.Gauge(f"{prefix}bcg_graph_pool_bytes", "The part of bcg's graph memory in its pool",
                                     names, **kw)
        self.buckets = prom.Gauge(f"{prefix}bcg_buckets_captured", "bcg buckets captured", names, **kw)
        self._seen = RuntimeStats()
        for reason in Fallback:  # every reason visible at 0 from the start
            self.fallbacks.labels(**self._labels, reason=reason.value)

    def _plain(self, metric):
        return metric.labels(**self._labels) if self._labels else metric

    def update(self, stats: RuntimeStats) -> None:
        for bucket, count in stats.replays_by_bucket.items():
            delta = count - self._seen.replays_by_bucket[bucket]
            if delta:
                self.replays.labels(**self._labels, bucket=str(bucket)).inc(delta)
        for reason, count in stats.fallbacks.items():
            delta = count - self._seen.fallbacks[reason]
            if delta:
                self.fallbacks.labels(**self._labels, reason=reason).inc(delta)
        self._plain(self.real_tokens).inc(stats.real_tokens - self._seen.real_tokens)
        self._plain(self.padded_tokens).inc(stats.padded_tokens - self._seen.padded_tokens)
        self._plain(self.capture_seconds).set(stats.capture_seconds)
        self._plain(self.graph_bytes).set(stats.graph_bytes)
        self._plain(self.pool_bytes).set(stats.pool_bytes)
        self._plain(self.buckets).set(stats.buckets_captured)
        self._seen = RuntimeStats(
            replays_by_bucket=stats.replays_by_bucket.copy(), fallbacks=stats.fallbacks.copy(),
            real_tokens=stats.real_tokens, padded_tokens=stats.padded_tokens,
        )


def host_exporter(prefix: str, logger: Any = None) -> PrometheusExporter | None:
    """An exporter in the host's default registry, or ``None`` (logged once) if it cannot be made."""
    try:
        return PrometheusExporter(prefix)
    except Exception as e:  # metrics are an aid: never stop an engine over them
        if logger is not None:
            logger.warning("bcg: Prometheus metrics are off (%r)", e)
        return None


def scraped_value(text: str, sample: str, **labels: str) -> float | None:
    """The sum of ``sample``'s values in a ``/metrics`` scrape over series whose labels include
    ``labels``, or ``None`` if no such series is there."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples
              if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(values) if values else None
