"""bcg's counters in SGLang: a periodic log line, and Prometheus counters where SGLang's metrics are on
(``--enable-metrics``: SGLang's own registry, so they appear on its ``/metrics``)."""

from __future__ import annotations

import logging
from typing import Any

from bcg_plugin.adapters.sglang import config
from bcg_plugin.metrics import host_exporter
from bcg_plugin.stats import RuntimeStats, StatsReporter

logger = logging.getLogger("bcg_plugin.sglang")
METRICS_PREFIX = "sglang:"


def stats_reporter(stats: RuntimeStats, server_args: Any) -> StatsReporter:
    """The reporter of one runner's counters: every ``BCG_STATS_INTERVAL_S`` seconds of traffic."""
    exporter = host_exporter(METRICS_PREFIX, logger) if server_args.enable_metrics else None
    return StatsReporter(stats, logger=logger, interval_s=config.stats_interval(), exporter=exporter)
