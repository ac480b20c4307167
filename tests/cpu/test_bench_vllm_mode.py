"""The vLLM bench's mode process (bcg_bench.vllm_mode) against the real vllm package installed, on CPU."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("mode", ["eager", "native", "native_ladder", "compile", "full", "bcg", "bcg_compile"])
def test_bench_engine_kwargs_are_vllm_engine_args(mode):
    from vllm.engine.arg_utils import EngineArgs

    from bcg_bench.vllm_mode import engine_kwargs
    from bcg_plugin.adapters.vllm.metrics import WORKER_EXTENSION

    args = EngineArgs(**engine_kwargs(mode, "qwen3-8b", [16, 2048], tp=2))
    assert args.tensor_parallel_size == 2 and args.worker_extension_cls == WORKER_EXTENSION
    assert args.max_num_seqs is None  # vLLM's default, which sets native's default graph sizes
    moe = EngineArgs(**engine_kwargs(mode, "qwen3-30b-a3b", [16, 2048], dp=2))
    assert moe.enable_expert_parallel and not moe.disable_log_stats  # request metrics: time to first token


def test_bench_dp_ranks_send_one_request_per_step_in_lockstep(monkeypatch, tmp_path):
    """Under --dp every rank sends exactly one request per measured step, after the same barrier:
    rank 0 the N tokens it times, the others one token (vLLM pads them to rank 0's size)."""
    import threading

    import vllm

    from bcg_bench import vllm_mode as bench

    events, lock = [], threading.Lock()

    class FakeLLM:
        def __init__(self, **kwargs):
            self.rank = int(threading.current_thread().name)

        def generate(self, prompts, params, use_tqdm=False):
            n = len(prompts[0]["prompt_token_ids"])
            with lock:
                events.append((self.rank, len(prompts), n))
            return [types.SimpleNamespace(metrics=types.SimpleNamespace(first_token_latency=n / 1e3))]

        def collective_rpc(self, name):
            return [[]]

    monkeypatch.setattr(bench, "_env_for", lambda *a, **k: None)
    monkeypatch.setattr(bench.Timers, "install", lambda self: None)
    monkeypatch.setattr(bench.Timers, "last_forward", lambda self: None)
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    results = {}

    def rank_main(rank):
        results[rank] = bench.run("eager", "qwen3-30b-a3b", [16, 256], reps=3, warmup=1, dp=2, dp_rank=rank,
                                  barrier_dir=str(tmp_path))

    threads = [threading.Thread(target=rank_main, args=(r,), name=str(r)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    per_rank = {r: [n for rank, _, n in events if rank == r] for r in range(2)}
    steps = 2 * 1 + 2 * 3  # warm-up then measured, every size
    assert all(count == 1 for _, count, _ in events)
    assert len(per_rank[0]) == len(per_rank[1]) == steps
    assert per_rank[1] == [1] * steps and sorted(set(per_rank[0])) == [16, 256]
    assert set(results[0]["e2e_ms"]) == {"16", "256"} and results[0]["data_parallel_size"] == 2
    assert "forward_ms" not in results[0]  # timed in-process only, as at tp > 1
    # generate() also waits out the DP wave; the time to first token comes from vLLM's request metrics
    assert results[0]["ttft_ms"] == {"16": 16.0, "256": 256.0}


def test_first_token_ms_reads_vllms_request_metrics():
    from bcg_bench.vllm_mode import first_token_ms

    out = types.SimpleNamespace(metrics=types.SimpleNamespace(first_token_latency=0.0125))
    assert first_token_ms([out]) == 12.5
    assert first_token_ms([types.SimpleNamespace(metrics=None)]) is None  # stats off: no figure, not 0
    assert first_token_ms([]) is None


def test_dp_rank_envs_share_one_rendezvous_and_number_the_ranks():
    from bcg_bench.vllm_mode import dp_rank_envs

    envs = dp_rank_envs(2)
    assert [(e["VLLM_DP_RANK"], e["VLLM_DP_RANK_LOCAL"]) for e in envs] == [("0", "0"), ("1", "1")]
    assert {e["VLLM_DP_MASTER_PORT"] for e in envs} == {envs[0]["VLLM_DP_MASTER_PORT"]}
    assert all(e["VLLM_DP_SIZE"] == "2" for e in envs)


def test_bench_dp_launches_one_process_per_rank(monkeypatch):
    from bcg_bench import vllm_mode as bench

    calls = []
    monkeypatch.setattr(bench, "launch_dp_ranks", lambda argv, dp: calls.append((argv, dp)) or 0)
    argv = ["--mode", "bcg", "--model", "qwen3-30b-a3b", "--out", "x.json", "--dp", "2"]
    with pytest.raises(SystemExit) as done:
        bench.main(argv)
    assert done.value.code == 0 and calls == [(argv, 2)]


def test_bench_bcg_mode_takes_extra_keys_from_bcg_variables():
    from bcg_bench.vllm_mode import bench_bcg_config

    assert bench_bcg_config({}) == {"enable": True}
    assert bench_bcg_config({"BCG_WARMUP": "first_bucket", "BCG_MAX_TOKENS": "1024"}) == {
        "enable": True, "warmup": "first_bucket", "max_tokens": 1024}


@pytest.mark.parametrize("env_torch_compile", [None, "1", "0"])
def test_bench_bcg_mode_captures_the_plain_model_and_bcg_compile_the_compiled_one(monkeypatch, env_torch_compile):
    """The mode names what is measured: a BCG_TORCH_COMPILE in the environment does not move it."""
    from bcg_bench.vllm_mode import engine_kwargs

    if env_torch_compile is None:
        monkeypatch.delenv("BCG_TORCH_COMPILE", raising=False)
    else:
        monkeypatch.setenv("BCG_TORCH_COMPILE", env_torch_compile)
    assert engine_kwargs("bcg", "qwen3-0.6b", [16, 2048])["additional_config"]["bcg"]["torch_compile"] is False
    assert engine_kwargs("bcg_compile", "qwen3-0.6b", [16, 2048])["additional_config"]["bcg"]["torch_compile"] is True


def test_bench_timers_measure_the_kv_cache_vllm_allocates(monkeypatch):
    """The bench's KV-cache figure is the device memory vLLM's worker takes while allocating it."""
    import torch
    from vllm.v1.worker.gpu_worker import Worker

    from bcg_bench import vllm_mode as bench

    free = [80 * 2**30]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free[0], 140 * 2**30))

    def allocate(worker, kv_cache_config):
        free[0] -= kv_cache_config

    monkeypatch.setattr(Worker, "initialize_from_config", allocate)
    import vllm.v1.worker.gpu.model_runner as v2
    import vllm.v1.worker.gpu_model_runner as v1

    for module in (v1, v2):  # install() wraps these too; restored after the test
        monkeypatch.setattr(module.GPUModelRunner, "capture_model", module.GPUModelRunner.capture_model)
        monkeypatch.setattr(module, "set_forward_context", module.set_forward_context)
    timers = bench.Timers()
    timers.install()
    Worker.initialize_from_config(object(), 3 * 2**30)
    assert timers.kv_cache_bytes == 3 * 2**30
    assert bench.used_device_bytes() == (140 - 77) * 2**30


def test_bench_has_the_six_modes_and_full_graphs_every_batch_up_to_the_chunk():
    from vllm.engine.arg_utils import EngineArgs

    from bcg_bench import harness
    from bcg_bench.vllm_mode import MODES, engine_kwargs
    from bcg_plugin.ladder import reference_ladder

    assert {"eager", "compile", "native", "native_ladder", "full", "bcg"} <= set(MODES)
    assert harness.ENGINES["vllm"]["modes"] == list(MODES)
    cc = EngineArgs(**engine_kwargs("full", "qwen3-0.6b", [16, 4096])).compilation_config
    cc = cc if isinstance(cc, dict) else cc.__dict__
    assert str(cc["cudagraph_mode"]).endswith("FULL") and cc["max_cudagraph_capture_size"] == 4096
    assert cc["cudagraph_capture_sizes"] == reference_ladder(4096)
    assert "compilation_config" not in engine_kwargs("compile", "qwen3-0.6b", [16, 4096])  # vLLM's default


@pytest.mark.parametrize("mode, expected", [
    ("native", "1"), ("native_ladder", "1"), ("eager", "0"), ("compile", "0"), ("full", "0"),
    ("bcg", None), ("bcg_compile", None)])
def test_each_bench_mode_is_one_prefill_runtime_whatever_the_architecture(monkeypatch, mode, expected):
    """vLLM's breakable graphs on for the native modes (a dense model is not on vLLM's own list), off
    for the others, and left to bcg in the bcg modes."""
    from bcg_bench import vllm_mode as bench

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "stale")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    bench._env_for(mode)
    import os

    assert os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH") == expected
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


@pytest.mark.parametrize("how", ["profile_only", "manager_flag", "real"])
def test_bench_capture_time_and_memory_leave_out_vllms_profiling_capture(monkeypatch, how):
    import torch

    from bcg_bench import vllm_mode as bench

    free = [80 * 2**30]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free[0], 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)

    def capture_model(runner, **kwargs):
        free[0] -= 2**30
        return 0

    timers = bench.Timers()
    timed = timers._timed_capture(capture_model)
    manager = types.SimpleNamespace(_capture_mem_samples=[] if how == "manager_flag" else None)
    runner = types.SimpleNamespace(cudagraph_manager=manager)
    timed(runner, **({"profile_only": True} if how == "profile_only" else {}))
    assert timers.graph_bytes == (2**30 if how == "real" else 0)
    assert (timers.capture_s > 0) == (how == "real")


def test_bench_timers_leave_bcgs_runner_patches_verifiable(monkeypatch, vllm_plugin_off):
    """The bcg modes install the runner patches, then the timers over them; vLLM's front end then
    verifies the runner set before enabling bcg. A timer that hides the patched signature made it
    decline ("the vLLM model runner changed") and the bcg modes measured vLLM without bcg."""
    import vllm.v1.worker.gpu.model_runner as v2
    import vllm.v1.worker.gpu_model_runner as v1
    from vllm.v1.worker.gpu_worker import Worker

    from bcg_bench import vllm_mode as bench
    from bcg_plugin.adapters.vllm import plugin
    from bcg_plugin.patches.vllm import RUNNER

    monkeypatch.setattr(Worker, "initialize_from_config", Worker.initialize_from_config)
    for module in (v1, v2):  # install() wraps these; restored after the test
        monkeypatch.setattr(module.GPUModelRunner, "capture_model", module.GPUModelRunner.capture_model)
        monkeypatch.setattr(module, "set_forward_context", module.set_forward_context)
    assert plugin.apply_runner_patches()
    bench.Timers().install()
    assert RUNNER.problems() == []
    assert plugin.runner_patch_problem() is None


@pytest.mark.parametrize("stats, engaged", [([[]], False), ([[{"summary": "replays=3 fallbacks=0"}]], True)])
def test_a_bcg_mode_in_which_bcg_captured_nothing_fails_instead_of_reporting_vllm(monkeypatch, stats, engaged):
    import vllm

    from bcg_bench import vllm_mode as bench
    from bcg_plugin.adapters.vllm import plugin

    class FakeLLM:
        def __init__(self, **kwargs):
            pass

        def generate(self, prompts, params, use_tqdm=False):
            return [types.SimpleNamespace(metrics=None)]

        def collective_rpc(self, name):
            return stats

    monkeypatch.setattr(bench, "_env_for", lambda *a, **k: None)
    monkeypatch.setattr(plugin, "register", lambda: None)
    monkeypatch.setattr(plugin, "apply_runner_patches", lambda *a: True)
    monkeypatch.setattr(bench.Timers, "install", lambda self: None)
    monkeypatch.setattr(bench.Timers, "last_forward", lambda self: None)
    monkeypatch.setattr(bench, "used_device_bytes", lambda: 0)
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    if engaged:
        assert bench.run("bcg", "qwen3-0.6b", [16], reps=1, warmup=0)["bcg_stats"] == ["replays=3 fallbacks=0"]
    else:
        with pytest.raises(SystemExit, match="bcg captured nothing"):
            bench.run("bcg", "qwen3-0.6b", [16], reps=1, warmup=0)
