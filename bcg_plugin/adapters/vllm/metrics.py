"""bcg's counters in vLLM: a periodic log line and Prometheus counters from the first TP rank, and
every worker's counters over vLLM's collective RPC.

With tensor or pipeline parallelism the model runners (and bcg's graphs) live in vLLM's worker
processes, not in the process that holds the ``LLM``. vLLM's own extension point for asking
workers things is ``worker_extension_cls``; with it set to this class,
``llm.collective_rpc("bcg_stats")`` returns one list per worker::

    llm = LLM(model, tensor_parallel_size=2, additional_config={"bcg": {"enable": True}},
              worker_extension_cls="bcg_plugin.adapters.vllm.metrics.BcgWorkerExtension")
    llm.collective_rpc("bcg_stats")  # [[{...rank 0...}], [{...rank 1...}]]
"""

from __future__ import annotations

from bcg_plugin.adapters.vllm.log import logger
from bcg_plugin.metrics import host_exporter
from bcg_plugin.stats import RuntimeStats, StatsReporter

WORKER_EXTENSION = "bcg_plugin.adapters.vllm.metrics.BcgWorkerExtension"
STATS_LOG_INTERVAL_S = 30.0
METRICS_PREFIX = "vllm:"
# vLLM serves /metrics from the API server's own registry unless prometheus_client runs in
# multiprocess mode; the runner's counters live in the engine process.
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
METRICS_NOTE = (f"bcg's Prometheus counters reach vLLM's /metrics only with {METRICS_ENV} set to an empty "
                "directory before `vllm serve` starts (prometheus_client's multiprocess mode); the periodic "
                "log line works without it")


def stats_reporter(stats: RuntimeStats, *, reports: bool) -> StatsReporter:
    """The reporter of one runner's counters; silent where ``reports`` is off (other TP ranks, and
    graphs built only to estimate memory)."""
    return StatsReporter(stats, logger=logger, interval_s=STATS_LOG_INTERVAL_S if reports else 0,
                         exporter=host_exporter(METRICS_PREFIX, logger) if reports else None)


class BcgWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``: one RPC method, no state."""

    def bcg_stats(self) -> list[dict]:
        """This worker's bcg runners' counters (plain values, so vLLM can serialise them)."""
        from bcg_plugin.adapters.vllm.replay import INSTANCES

        return [stats_dict(graphs.runner.stats) for graphs in list(INSTANCES)]


def stats_dict(stats) -> dict:
    """A :class:`~bcg_plugin.stats.RuntimeStats` as plain values."""
    return {
        "replays": sum(stats.replays_by_bucket.values()),
        "replays_by_bucket": {str(b): n for b, n in stats.replays_by_bucket.items()},
        "fallbacks": dict(stats.fallbacks),
        "real_tokens": stats.real_tokens,
        "padded_tokens": stats.padded_tokens,
        "buckets": stats.buckets_captured,
        "capture_seconds": stats.capture_seconds,
        "warmup_seconds": stats.warmup_seconds,
        "graph_bytes": stats.graph_bytes,
        "graph_attention_buckets": list(stats.graph_attention_buckets),
        "summary": stats.summary(),
    }
