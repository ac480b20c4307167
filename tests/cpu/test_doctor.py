"""``bcg doctor`` against the real host packages (skipped where a host is not importable)."""

import io
import json

import pytest

from bcg_plugin import doctor


def _run(config=None, engines=("vllm", "sglang")):
    out = io.StringIO()
    rc = doctor.run(config, list(engines), out=out)
    return rc, out.getvalue()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_installed_host_is_reported_compatible_with_every_target_checked(engine):
    pytest.importorskip(engine)
    rc, text = _run(engines=[engine])
    assert rc == 0, text
    assert f"{engine} " in text and ": compatible" in text
    assert "FAIL" not in text and text.count("  ok   ") >= 5
    assert "installed but off" in text


def test_enabled_config_says_what_the_plugin_will_do():
    pytest.importorskip("vllm")
    rc, text = _run('{"enable": true, "max_tokens": 4096}', engines=["vllm"])
    assert rc == 0 and "up to 4096 tokens replay bcg graphs" in text
    rc, text = _run('{"enable": true}', engines=["vllm"])  # the top bucket is the engine's to say
    assert rc == 0 and "up to the engine's chunk size (or the most tokens one step can hold, if less)" in text


def test_invalid_config_fails_and_names_the_key():
    pytest.importorskip("vllm")
    rc, text = _run('{"max_tokens": -1}', engines=["vllm"])
    assert rc == 1 and "INVALID" in text and "max_tokens" in text


def test_unsupported_host_version_is_incompatible(monkeypatch):
    pytest.importorskip("vllm")
    import bcg_plugin.adapters.vllm.version as version

    monkeypatch.setattr(version, "installed", lambda: "0.99.0")
    rc, text = _run(engines=["vllm"])
    assert rc == 1 and "INCOMPATIBLE" in text and "vllm 0.99.0 is outside the range bcg-plugin supports" in text
    assert "stays off" in text


def test_no_host_installed_is_an_error(monkeypatch):
    monkeypatch.setattr(doctor, "adapter_report", lambda engine: doctor.AdapterReport(engine, None, "?"))
    rc, text = _run()
    assert rc == 1 and "nothing to do" in text


def test_vllm_report_says_what_metrics_need(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    out = io.StringIO()
    doctor.run(None, ["vllm"], out=out)
    assert "note: bcg's Prometheus counters reach vLLM's /metrics only with PROMETHEUS_MULTIPROC_DIR" in out.getvalue()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp/prom")
    out = io.StringIO()
    doctor.run(None, ["vllm"], out=out)
    assert "PROMETHEUS_MULTIPROC_DIR" not in out.getvalue()


def test_vllm_report_names_the_defaults_vllm_sets_under_the_users_keys():
    pytest.importorskip("vllm")
    out = io.StringIO()
    doctor.run(json.dumps({"enable": True}), ["vllm"], out=out)
    assert 'note: vLLM\'s defaults under the keys you set: {"warmup": "first_bucket", "torch_compile": true}' in out.getvalue()
