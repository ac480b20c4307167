"""``bcg doctor`` against the real host packages (skipped where a host is not importable)."""

import importlib
import io
import json
import sys

import pytest

from bcg_plugin import doctor


# Each engine's case carries the engine's marker: the CI run of each host version selects by it.
ENGINES = [pytest.param(engine, marks=getattr(pytest.mark, engine)) for engine in ("vllm", "sglang")]


def _run(config=None, engines=("vllm", "sglang")):
    out = io.StringIO()
    rc = doctor.run(config, list(engines), out=out)
    return rc, out.getvalue()


@pytest.mark.parametrize("engine", ENGINES)
def test_installed_host_is_reported_compatible_with_every_target_checked(engine):
    pytest.importorskip(engine)
    rc, text = _run(engines=[engine])
    assert rc == 0, text
    assert f"{engine} " in text and ": compatible" in text
    assert "FAIL" not in text and text.count("  ok   ") >= 5
    assert "installed but off" in text


@pytest.mark.vllm
def test_enabled_config_says_what_the_plugin_will_do():
    pytest.importorskip("vllm")
    rc, text = _run('{"enable": true, "max_tokens": 4096}', engines=["vllm"])
    assert rc == 0 and "up to 4096 tokens replay bcg graphs" in text
    rc, text = _run('{"enable": true}', engines=["vllm"])  # the top bucket is the engine's to say
    assert rc == 0 and "up to the engine's chunk size (or the most tokens one step can hold, if less)" in text


@pytest.mark.vllm
@pytest.mark.parametrize("choice, says", [
    ("auto", "inside the graph in buckets up to 2048 tokens, or up to vLLM's max_cudagraph_capture_size if larger"),
    ("graph", "inside the graph in every bucket (FA3's graph bound raised to the top bucket)"),
    ("break", "an eager break in every bucket"),
])
def test_doctor_says_where_attention_runs_for_the_configured_choice(choice, says):
    pytest.importorskip("vllm")
    from packaging.version import Version

    from bcg_plugin.versions import installed_version

    # read from the release, not from the probe doctor uses: a probe that failed would pass unseen
    if choice != "break" and Version(installed_version("vllm")) < Version("0.28"):
        says = "an eager break in every bucket (this vLLM release cannot keep it inside the graph; 0.28 and later"
    rc, text = _run(f'{{"enable": true, "attention": "{choice}"}}', engines=["vllm"])
    assert rc == 0 and f'-> attention ("{choice}"): {says}' in text, text


@pytest.mark.vllm
def test_invalid_config_fails_and_names_the_key():
    pytest.importorskip("vllm")
    rc, text = _run('{"max_tokens": -1}', engines=["vllm"])
    assert rc == 1 and "INVALID" in text and "max_tokens" in text


@pytest.mark.vllm
def test_unsupported_host_version_is_incompatible(monkeypatch):
    pytest.importorskip("vllm")
    import bcg_plugin.adapters.vllm.version as version

    monkeypatch.setattr(version, "installed", lambda: "0.99.0")
    rc, text = _run(engines=["vllm"])
    assert rc == 1 and "INCOMPATIBLE" in text and "vllm 0.99.0 is outside the range bcg-plugin supports" in text
    assert "stays off" in text


@pytest.mark.parametrize("engine", ENGINES)
def test_a_host_that_fails_to_import_is_one_problem_and_the_other_host_is_still_reported(engine, monkeypatch):
    pytest.importorskip(engine)
    other = "sglang" if engine == "vllm" else "vllm"
    monkeypatch.setitem(sys.modules, engine, None)  # importing it now raises, as a broken install does
    rc, text = _run()
    assert rc == 1, text
    [problem] = [line for line in text.splitlines() if line.startswith("  problem:")]
    assert f"{engine} " in problem and "fails to import (ModuleNotFoundError" in problem
    assert "patch target changed" not in text and "FAIL" not in text
    assert f"\n{other}" in text  # reported, installed or not


@pytest.mark.parametrize("engine", ENGINES)
def test_a_host_whose_modules_fail_while_checked_is_one_problem(engine, monkeypatch):
    pytest.importorskip(engine)
    adapter = importlib.import_module(f"bcg_plugin.adapters.{engine}")

    def diagnose():
        raise RuntimeError("a kernel library failed to load")

    monkeypatch.setattr(adapter, "diagnose", diagnose)
    rc, text = _run(engines=[engine])
    assert rc == 1 and "Traceback" not in text
    assert f"problem: the check of {engine} " in text and "RuntimeError: a kernel library failed to load" in text
    assert "stays off" in text


def test_no_host_installed_is_an_error(monkeypatch):
    monkeypatch.setattr(doctor, "adapter_report", lambda engine: doctor.AdapterReport(engine, None, "?"))
    rc, text = _run()
    assert rc == 1 and "nothing to do" in text


@pytest.mark.vllm
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


@pytest.mark.vllm
def test_vllm_report_names_the_defaults_vllm_sets_under_the_users_keys():
    pytest.importorskip("vllm")
    out = io.StringIO()
    doctor.run(json.dumps({"enable": True}), ["vllm"], out=out)
    assert 'note: vLLM\'s defaults under the keys you set: {"warmup": "first_bucket", "torch_compile": true}' in out.getvalue()


@pytest.mark.sglang
def test_sglang_report_names_the_defaults_sglang_sets_under_the_users_variables():
    pytest.importorskip("sglang")
    rc, text = _run_env({"BCG_ENABLE": "1"}, engines=["sglang"])
    sglang = _section(text, "sglang")
    assert rc == 0 and "note: SGLang's defaults under the BCG_* variables you set: BCG_WARMUP=first_bucket" in sglang
    assert '"warmup": "first_bucket"' in sglang
    rc, text = _run_env({"BCG_ENABLE": "1", "BCG_WARMUP": "every_bucket"}, engines=["sglang"])
    assert rc == 0 and '"warmup": "every_bucket"' in _section(text, "sglang")


# -- each engine's configuration, checked by that engine's own start-up validation ----------------


def _run_env(environ, config=None, engines=("vllm",)):
    out = io.StringIO()
    rc = doctor.run(config, list(engines), out=out, environ=environ)
    return rc, out.getvalue()


def _section(text, engine):
    """The lines doctor prints for ``engine``."""
    block = text.split(f"\n{engine} ", 1)[1]
    return block.split("\n\n", 1)[0]


@pytest.mark.vllm
def test_vllm_reads_no_bcg_variable_so_the_environment_enables_nothing_there():
    pytest.importorskip("vllm")
    rc, text = _run_env({"BCG_ENABLE": "1", "BCG_MAX_TOKENS": "4096", "PATH": "/bin"})
    vllm = _section(text, "vllm")
    assert rc == 0 and "replay bcg graphs" not in vllm and "installed but off" in vllm
    assert "ignored: BCG_ENABLE (vLLM reads only additional_config['bcg']: give \"enable\" in --config JSON)" in vllm
    assert "ignored: BCG_MAX_TOKENS" in vllm and "PATH" not in vllm
    # The same keys as --config JSON do enable it, with vLLM's defaults under them.
    rc, text = _run_env({}, config='{"enable": true, "max_tokens": 4096}')
    vllm = _section(text, "vllm")
    assert rc == 0 and "up to 4096 tokens replay bcg graphs" in vllm and "ignored" not in vllm
    assert '"warmup": "first_bucket", "torch_compile": true' in vllm
    rc, text = _run_env({}, config='{"enable": true, "graph_variants": false}')
    vllm = _section(text, "vllm")
    assert rc == 0 and "ignored: --config key 'graph_variants' (vLLM captures one graph per bucket" in vllm


@pytest.mark.parametrize("environ, key", [
    ({"BCG_ENABLE": "1", "BCG_TORCH_COMPILE": "1"}, "'torch_compile' is supported with vLLM only"),
    ({"BCG_ENABLE": "1", "BCG_STATS_INTERVAL_S": "abc"}, "'BCG_STATS_INTERVAL_S' must be a number of seconds"),
])
@pytest.mark.sglang
def test_sglang_configurations_its_start_refuses_are_invalid(environ, key):
    pytest.importorskip("sglang")
    rc, text = _run_env(environ, engines=["sglang"])
    sglang = _section(text, "sglang")
    assert rc == 1 and "INVALID" in sglang and key in sglang and "refuses to start" in sglang
    assert "replay bcg graphs" not in sglang


@pytest.mark.sglang
def test_sglang_names_variables_and_json_it_does_not_read_and_refuses_a_misspelling():
    pytest.importorskip("sglang")
    rc, text = _run_env({"BCG_ENABLE": "1", "BCG_BENCH_RECORD": "/tmp/r", "BCG_STATS_INTERVAL_S": "5"},
                        config='{"max_tokens": 1024}', engines=["sglang"])
    sglang = _section(text, "sglang")
    assert "ignored: BCG_BENCH_RECORD (no such variable is read)" in sglang
    assert "ignored: --config key 'max_tokens' (SGLang reads the environment: BCG_MAX_TOKENS)" in sglang
    assert "BCG_STATS_INTERVAL_S" not in sglang.split("configuration", 1)[1]  # a variable SGLang's adapter reads
    # What SGLang runs: the environment's config, the top bucket its chunk, not the ignored 1024.
    assert rc == 0 and "up to the engine's chunk size" in sglang
    # A misspelling of a variable it reads would leave that setting unread: SGLang's start refuses it.
    rc, text = _run_env({"BCG_ENABLE": "1", "BCG_MAX_TOKEN": "512"}, engines=["sglang"])
    sglang = _section(text, "sglang")
    assert rc == 1 and "INVALID: environment (BCG_*): BCG_MAX_TOKEN is not a variable bcg reads; did you mean " \
                       "BCG_MAX_TOKENS?" in sglang, sglang
    assert "refuses to start" in sglang


@pytest.mark.parametrize("engine", ENGINES)
def test_a_host_run_untested_is_named_so_and_its_opt_in_is_not_called_unread(monkeypatch, engine):
    pytest.importorskip(engine)
    from bcg_plugin.versions import UNTESTED_ENV

    version = importlib.import_module(f"bcg_plugin.adapters.{engine}.version")
    newer = {"vllm": "0.35.0", "sglang": "0.5.24"}[engine]
    monkeypatch.setattr(version, "installed", lambda: newer)
    monkeypatch.setenv(UNTESTED_ENV, "1")
    rc, text = _run_env({UNTESTED_ENV: "1", "BCG_ENABLE": "1"}, engines=[engine])
    section = _section(text, engine)
    assert section.startswith(f"{newer}: compatible, UNTESTED ({UNTESTED_ENV} is set"), section
    assert UNTESTED_ENV not in section.split("configuration", 1)[1]  # not listed as ignored
    monkeypatch.delenv(UNTESTED_ENV)
    rc, text = _run_env({}, engines=[engine])
    assert _section(text, engine).startswith(f"{newer}: INCOMPATIBLE") and rc == 1


@pytest.mark.parametrize("engine", ENGINES)
def test_max_tokens_zero_is_named_as_what_keeps_an_enabled_plugin_idle(engine):
    pytest.importorskip(engine)
    if engine == "vllm":
        rc, text = _run_env({}, config='{"enable": true, "max_tokens": 0}', engines=[engine])
    else:
        rc, text = _run_env({"BCG_ENABLE": "1", "BCG_MAX_TOKENS": "0"}, engines=[engine])
    section = _section(text, engine)
    key = {"vllm": "'max_tokens'", "sglang": "BCG_MAX_TOKENS"}[engine]  # what each engine reads
    assert f"enabled but captures nothing: {key} is 0" in section and "installed but off" not in section


@pytest.mark.parametrize("engine", ENGINES)
def test_one_engine_asked_for_and_missing_is_named(monkeypatch, engine):
    pytest.importorskip(engine)
    version = importlib.import_module(f"bcg_plugin.adapters.{engine}.version")
    monkeypatch.setattr(version, "installed", lambda: None)
    rc, text = _run_env({}, engines=[engine])
    assert rc == 1 and f"{engine} is not installed: the plugin has nothing to do there" in text
    assert "(vLLM, SGLang)" not in text


@pytest.mark.sglang
@pytest.mark.parametrize("value, noted", [("1", True), ("true", True), ("0", False), (None, False)])
def test_sglang_notes_that_a_memory_saver_releasing_graph_memory_keeps_bcg_off(monkeypatch, value, noted):
    pytest.importorskip("sglang")
    if value is None:
        monkeypatch.delenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", raising=False)
    else:
        monkeypatch.setenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", value)
    _, text = _run_env({"BCG_ENABLE": "1"}, engines=["sglang"])
    assert ("with --enable-memory-saver SGLang releases CUDA-graph memory, and bcg does not run"
            in _section(text, "sglang")) == noted


@pytest.mark.parametrize("engine, module, function", [
    pytest.param("vllm", "bcg_plugin.adapters.vllm.doctor", "validate", marks=pytest.mark.vllm),
    pytest.param("sglang", "bcg_plugin.adapters.sglang.config", "read_config", marks=pytest.mark.sglang),
])
def test_doctor_runs_the_adapters_own_validation(monkeypatch, engine, module, function):
    import importlib

    from bcg_plugin.errors import BcgConfigError

    pytest.importorskip(engine)

    def refuse(*args, **kwargs):
        raise BcgConfigError(f"{engine}'s own check refused it")

    monkeypatch.setattr(importlib.import_module(module), function, refuse)
    rc, text = _run_env({"BCG_ENABLE": "1"}, config='{"enable": true}', engines=[engine])
    assert rc == 1 and f"INVALID: {engine}'s own check refused it" in text
