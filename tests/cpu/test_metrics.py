import pytest

prom = pytest.importorskip("prometheus_client")

from bcg_plugin.metrics import PrometheusExporter  # noqa: E402
from bcg_plugin.stats import Fallback, RuntimeStats  # noqa: E402


def _value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_exporter_publishes_growth_of_the_counters():
    registry = prom.CollectorRegistry()
    exp = PrometheusExporter("test:", {"engine": "toy"}, registry=registry)
    stats = RuntimeStats(capture_seconds=1.5, graph_bytes=1024, pool_bytes=512, buckets_captured=3)
    assert _value(registry, "test:bcg_eager_fallbacks_total", engine="toy", reason="over_top_bucket") == 0
    stats.record_replay(64, 50)
    stats.record_replay(64, 60)
    stats.record_fallback(Fallback.OVER_TOP_BUCKET)
    exp.update(stats)
    stats.record_replay(128, 100)
    exp.update(stats)
    exp.update(stats)  # nothing new: nothing added
    assert _value(registry, "test:bcg_replays_total", engine="toy", bucket="64") == 2
    assert _value(registry, "test:bcg_replays_total", engine="toy", bucket="128") == 1
    assert _value(registry, "test:bcg_real_tokens_total", engine="toy") == 210
    assert _value(registry, "test:bcg_padded_tokens_total", engine="toy") == 14 + 4 + 28
    assert _value(registry, "test:bcg_eager_fallbacks_total", engine="toy", reason="over_top_bucket") == 1
    assert _value(registry, "test:bcg_graph_memory_bytes", engine="toy") == 1024
    assert _value(registry, "test:bcg_graph_pool_bytes", engine="toy") == 512
    assert _value(registry, "test:bcg_capture_seconds", engine="toy") == 1.5


def test_reporter_logs_on_interval_only_when_changed_and_refreshes_the_exporter(caplog):
    import logging

    from bcg_plugin.stats import StatsReporter

    now = [0.0]
    registry = prom.CollectorRegistry()
    stats = RuntimeStats()
    exp = PrometheusExporter("rep:", registry=registry)
    rep = StatsReporter(stats, logger=logging.getLogger("bcg.test"), interval_s=10, exporter=exp,
                        export_interval_s=1, clock=lambda: now[0])
    stats.record_replay(16, 10)
    assert rep.tick() is None and _value(registry, "rep:bcg_replays_total", bucket="16") is None
    now[0] = 1.5
    with caplog.at_level(logging.INFO, logger="bcg.test"):
        assert rep.tick() is None  # exported, not yet logged
        assert _value(registry, "rep:bcg_replays_total", bucket="16") == 1
        now[0] = 11
        assert "replays=1" in rep.tick()
        now[0] = 22
        assert rep.tick() is None  # nothing changed: no repeated line
        stats.record_replay(16, 16)
        now[0] = 33
        assert "replays=2" in rep.tick()
    assert sum("bcg prefill graphs" in r.message for r in caplog.records) == 2
