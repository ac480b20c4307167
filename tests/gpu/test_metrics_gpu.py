"""bcg's counters read back from a running server's ``/metrics`` (the hosts' own Prometheus endpoints).

Run on the GPU host with the engine's bundle sourced:
``python -m pytest tests/gpu/test_metrics_gpu.py -m gpu -s -k sglang`` (or ``-k vllm``).
Each server test starts the engine's OpenAI-compatible server on a loopback port with a dummy-weight
Qwen3-0.6B-shaped model, sends prefill requests of a few sizes, and reads ``/metrics``. Installs
without the server's packages skip those; the offline vLLM test checks the engine's half of the
path there: counters made in vLLM's engine process, read from prometheus_client's multiprocess
files the way vLLM's ``/metrics`` handler reads them (its server half is tested on CPU,
``tests/cpu/test_metrics_endpoint.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from bcg_bench.models import model_dir
from bcg_bench.ranks import free_port
from bcg_plugin.metrics import scraped_value

pytestmark = pytest.mark.gpu


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _serve(cmd: list[str], env: dict, health: str, timeout_s: float = 240) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{proc.stdout.read()[-4000:]}")
        try:
            _get(health, timeout=2)
            return proc
        except OSError:
            time.sleep(2)
    proc.kill()
    raise AssertionError(f"server not healthy after {timeout_s} s:\n{proc.stdout.read()[-4000:]}")


def _metric(text: str, name: str) -> float:
    value = scraped_value(text, name)
    assert value is not None, f"{name} not on /metrics"
    return value


def _server_importable(module: str) -> None:
    """Engine installs without the HTTP server's packages (slim or offline copies) cannot serve:
    import the server module in a fresh interpreter and skip, naming the missing package, if it
    lacks one. Any other import error fails the test."""
    import re

    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return
    missing = re.findall(r"ModuleNotFoundError: No module named '([^']+)'", proc.stderr)
    if missing:
        pytest.skip(f"{module} needs {missing[-1]!r}, which this environment lacks")
    raise AssertionError(f"{module} does not import:\n{proc.stderr[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_sglang_metrics_show_bcg_replays():
    pytest.importorskip("sglang")
    _server_importable("sglang.srt.entrypoints.http_server")
    port = free_port()
    env = {**os.environ, "BCG_STATS_INTERVAL_S": "1"}
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir("qwen3-0.6b")),
           "--load-format", "dummy", "--skip-tokenizer-init", "--attention-backend", "triton",
           "--cuda-graph-backend-prefill", "bcg", "--enable-metrics", "--chunked-prefill-size", "2048",
           "--mem-fraction-static", "0.5", "--host", "127.0.0.1", "--port", str(port)]
    proc = _serve(cmd, env, f"http://127.0.0.1:{port}/health")
    try:
        for i, n in enumerate((16, 300, 1500)):  # no shared prefix: a radix-cache hit would shorten the prefill
            start = 100 + 2000 * i
            _post(f"http://127.0.0.1:{port}/generate",
                  {"input_ids": list(range(start, start + n)), "sampling_params": {"max_new_tokens": 1}})
        time.sleep(2)  # the reporter refreshes counters at most once per second
        _post(f"http://127.0.0.1:{port}/generate", {"input_ids": [5] * 20, "sampling_params": {"max_new_tokens": 1}})
        text = _get(f"http://127.0.0.1:{port}/metrics")
        assert _metric(text, "sglang:bcg_replays_total") >= 3
        assert _metric(text, "sglang:bcg_real_tokens_total") >= 16 + 300 + 1500
        assert _metric(text, "sglang:bcg_graph_memory_bytes") > 0
        assert _metric(text, "sglang:bcg_capture_seconds") > 0
        assert "sglang:bcg_eager_fallbacks_total" in text
    finally:
        _stop(proc)


def test_vllm_metrics_show_bcg_replays():
    pytest.importorskip("vllm")
    _server_importable("vllm.entrypoints.openai.api_server")
    port = free_port()
    # Counters made in vLLM's engine process reach the API server's /metrics through
    # prometheus_client's multiprocess mode.
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="bcg-prom-")}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir("qwen3-0.6b")),
           "--load-format", "dummy", "--skip-tokenizer-init", "--max-num-batched-tokens", "2048",
           "--gpu-memory-utilization", "0.5", "--max-model-len", "4096",
           "--additional-config", json.dumps({"bcg": {"enable": True}}), "--host", "127.0.0.1", "--port", str(port)]
    proc = _serve(cmd, env, f"http://127.0.0.1:{port}/health")
    try:
        for n in (16, 300, 1500):
            _post(f"http://127.0.0.1:{port}/v1/completions",
                  {"model": str(model_dir("qwen3-0.6b")), "prompt": list(range(100, 100 + n)), "max_tokens": 1})
        time.sleep(2)
        _post(f"http://127.0.0.1:{port}/v1/completions",
              {"model": str(model_dir("qwen3-0.6b")), "prompt": [5] * 20, "max_tokens": 1})
        text = _get(f"http://127.0.0.1:{port}/metrics")
        assert _metric(text, "vllm:bcg_replays_total") >= 3
        assert _metric(text, "vllm:bcg_graph_memory_bytes") > 0
        assert "vllm:bcg_eager_fallbacks_total" in text
    finally:
        _stop(proc)


OFFLINE_VLLM = """
import json, sys, time
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], load_format="dummy", skip_tokenizer_init=True, max_num_batched_tokens=2048,
              gpu_memory_utilization=0.5, max_model_len=4096, additional_config={"bcg": {"enable": True}})
    params = SamplingParams(max_tokens=1)
    for n in (16, 300, 1500):
        llm.generate([{"prompt_token_ids": list(range(100, 100 + n))}], params, use_tqdm=False)
    time.sleep(2)  # the exporter refreshes at most once a second, from the forward path
    llm.generate([{"prompt_token_ids": [5] * 20}], params, use_tqdm=False)
"""


def test_vllm_engine_exports_bcg_counters_without_the_http_server(tmp_path):
    pytest.importorskip("vllm")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    prom = tmp_path / "prom"
    prom.mkdir()
    script = tmp_path / "engine.py"
    script.write_text(OFFLINE_VLLM)
    proc = subprocess.run([sys.executable, str(script), str(model_dir("qwen3-0.6b"))], capture_output=True, text=True,
                          timeout=420, env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(prom))
    text = generate_latest(registry).decode()
    assert _metric(text, "vllm:bcg_replays_total") >= 3
    assert _metric(text, "vllm:bcg_graph_memory_bytes") > 0
    assert "vllm:bcg_eager_fallbacks_total" in text
