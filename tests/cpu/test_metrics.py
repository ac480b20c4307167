import pytest

prom = pytest.importorskip("prometheus_client")

from bcg_plugin.metrics import PrometheusExporter  # noqa: E402
from bcg_plugin.stats import Fallback, RuntimeStats  # noqa: E402


def _value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_exporter_publishes_growth_of_the_counters():
    registry = prom.CollectorRegistry()
    exp = PrometheusExporter("test:", {"engine": "toy"}, registry=registry)
    stats = RuntimeStats(capture_seconds=1.5, graph_bytes=1024, buckets_captured=3)
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
    assert _value(registry, "test:bcg_capture_seconds", engine="toy") == 1.5
