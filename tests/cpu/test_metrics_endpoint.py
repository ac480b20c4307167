"""bcg's counters, made in an engine process, read back from each host's own ``/metrics`` app.

The counters live where the runner lives: vLLM's engine-core (or worker) process and SGLang's
scheduler process. Both hosts serve ``/metrics`` from another process, so the counters travel
through ``prometheus_client``'s multiprocess mode. Each test runs two fresh interpreters, as the
hosts do: an "engine" that mirrors a runner's stats through :func:`bcg_plugin.metrics.host_exporter`
(and exits), then the host's real ``/metrics`` app (vLLM's ``attach_router``, SGLang's
``add_prometheus_middleware``) built on a FastAPI app and fetched over ASGI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from bcg_plugin.metrics import scraped_value

ENGINE = textwrap.dedent("""
    import sys
    from bcg_plugin.metrics import host_exporter
    from bcg_plugin.stats import Fallback, RuntimeStats

    stats = RuntimeStats()
    stats.record_replay(16, 12)
    stats.record_replay(512, 500)
    stats.record_fallback(Fallback.OVER_TOP_BUCKET)
    stats.capture_seconds, stats.graph_bytes, stats.buckets_captured = 2.5, 123456, 40
    host_exporter(sys.argv[1]).update(stats)
""")

SERVERS = {
    "vllm": textwrap.dedent("""
        from fastapi import FastAPI
        from starlette.testclient import TestClient
        from vllm.entrypoints.serve.instrumentator.metrics import attach_router

        app = FastAPI()
        attach_router(app)
        print(TestClient(app).get("/metrics").text)
    """),
    "sglang": textwrap.dedent("""
        from fastapi import FastAPI
        from starlette.testclient import TestClient
        from sglang.srt.utils.common import add_prometheus_middleware

        app = FastAPI()
        add_prometheus_middleware(app)
        print(TestClient(app).get("/metrics").text)
    """),
}


def _python(code: str, *args: str, env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _value(text: str, name: str, **labels: str) -> float:
    value = scraped_value(text, name, **labels)
    assert value is not None, f"{name}{labels or ''} is not on /metrics"
    return value


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    return {**env, "CUDA_VISIBLE_DEVICES": "", **extra}


@pytest.mark.parametrize("host", [pytest.param(h, marks=getattr(pytest.mark, h)) for h in ("vllm", "sglang")])
def test_engine_counters_reach_the_hosts_metrics_endpoint(host, tmp_path):
    pytest.importorskip(host)
    env = _env(PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    _python(ENGINE, f"{host}:", env=env)
    text = _python(SERVERS[host], env=env)
    assert _value(text, f"{host}:bcg_replays_total") == 2
    assert _value(text, f"{host}:bcg_replays_total", bucket="512") == 1
    assert _value(text, f"{host}:bcg_real_tokens_total") == 512
    assert _value(text, f"{host}:bcg_padded_tokens_total") == 16
    assert _value(text, f"{host}:bcg_eager_fallbacks_total", reason="over_top_bucket") == 1
    assert _value(text, f"{host}:bcg_eager_fallbacks_total", reason="capture_failed") == 0
    assert _value(text, f"{host}:bcg_graph_memory_bytes") == 123456
    assert _value(text, f"{host}:bcg_capture_seconds") == 2.5


@pytest.mark.vllm
def test_vllm_serves_engine_counters_only_in_multiprocess_mode():
    """Without PROMETHEUS_MULTIPROC_DIR vLLM's /metrics is its own process's registry: the engine
    process's counters are not there. This is why the README tells vLLM users to set it."""
    pytest.importorskip("vllm")
    env = _env()
    _python(ENGINE, "vllm:", env=env)
    text = _python(SERVERS["vllm"], env=env)
    assert "vllm:bcg_replays_total" not in text
