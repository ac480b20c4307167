"""The vLLM bench's mode process (bcg_bench.vllm_mode) against the real vllm package installed, on CPU."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm


ALL_MODES = ["eager", "native", "native_ladder", "compile", "full", "full_plain", "bcg", "bcg_break", "bcg_graph",
             "bcg_compile"]
BCG_MODES = [m for m in ALL_MODES if m.startswith("bcg")]


@pytest.mark.parametrize("mode", ALL_MODES)
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

    for module in bench.runner_modules():  # install() wraps these too; restored after the test
        monkeypatch.setattr(module.GPUModelRunner, "capture_model", module.GPUModelRunner.capture_model)
        monkeypatch.setattr(module, "set_forward_context", module.set_forward_context)
    import vllm.v1.worker.gpu.cudagraph_utils as graphs

    monkeypatch.setattr(graphs.ModelCudaGraphManager, "run_fullgraph", graphs.ModelCudaGraphManager.run_fullgraph)
    timers = bench.Timers()
    timers.install()
    model = torch.nn.Linear(4, 8, dtype=torch.bfloat16)
    worker = types.SimpleNamespace(get_model=lambda: model, cudagraph_memory_estimate=2**29)
    Worker.initialize_from_config(worker, 3 * 2**30)
    assert timers.kv_cache_bytes == 3 * 2**30
    assert timers.graph_estimate_bytes == 2**29  # what the worker's memory profiling set before
    assert (timers.weight_bytes, timers.vocab_weight_bytes) == ((4 * 8 + 8) * 2, 0)  # the model loaded before it
    assert bench.used_device_bytes() == (140 - 77) * 2**30
    if hasattr(Worker, "extend_kv_cache"):
        # 0.34's extensible KV cache reserves address space above, commits the null block, and
        # commits the measured size only after capture: that part counts as KV cache too.
        monkeypatch.setattr(Worker, "extend_kv_cache", lambda worker, num_blocks: allocate(worker, num_blocks))
        timers.install()
        Worker.extend_kv_cache(worker, 2 * 2**30)
        assert timers.kv_cache_bytes == 5 * 2**30


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
    ("native", "1"), ("native_ladder", "1"), ("eager", "0"), ("compile", "0"), ("full", "0"), ("full_plain", "0"),
    ("bcg", None), ("bcg_break", None), ("bcg_graph", None), ("bcg_compile", None)])
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


def test_bench_graph_memory_leaves_out_the_cache_vllms_capture_empties_first(monkeypatch):
    """vLLM's ``capture_model`` empties torch's cache before it measures (0.33 runs its JIT warm-up
    forwards just before, and their activations sit in that cache): measured from before that
    release, every mode's graph memory came out negative."""
    import torch

    from bcg_bench import vllm_mode as bench

    gib = 2**30
    state = {"reserved": 2 * gib, "cached": gib // 2}  # the cached part is in reserved, free to torch only

    def empty_cache():
        state["reserved"] -= state["cached"]
        state["cached"] = 0

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (140 * gib - state["reserved"], 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: state["reserved"])

    def capture_model(runner, **kwargs):  # vLLM 0.33's order, both runners: empty, measure, capture
        empty_cache()
        state["reserved"] += 3 * gib // 10  # the graphs' pool
        return 3 * gib // 10

    timers = bench.Timers()
    timers._timed_capture(capture_model)(types.SimpleNamespace(cudagraph_manager=None))
    assert (timers.graph_bytes, timers.allocator_bytes) == (3 * gib // 10, 3 * gib // 10)


def test_bench_timers_leave_bcgs_runner_patches_verifiable(monkeypatch, vllm_plugin_off):
    """The bcg modes install the runner patches, then the timers over them; vLLM's front end then
    verifies the runner set before enabling bcg. A timer that hides the patched signature made it
    decline ("the vLLM model runner changed") and the bcg modes measured vLLM without bcg."""
    from vllm.v1.worker.gpu_worker import Worker

    from bcg_bench import vllm_mode as bench
    from bcg_plugin.adapters.vllm import plugin
    from bcg_plugin.patches.vllm import RUNNER

    import vllm.v1.worker.gpu.cudagraph_utils as graphs

    from bcg_plugin.patches import NOT_FILED, Patch, PatchSet, Wrap

    monkeypatch.setattr(Worker, "initialize_from_config", Worker.initialize_from_config)
    for module in bench.runner_modules():  # install() wraps these; restored after the test
        monkeypatch.setattr(module.GPUModelRunner, "capture_model", module.GPUModelRunner.capture_model)
        monkeypatch.setattr(module, "set_forward_context", module.set_forward_context)
    monkeypatch.setattr(graphs.ModelCudaGraphManager, "run_fullgraph", graphs.ModelCudaGraphManager.run_fullgraph)
    # bcg wraps the FULL replay where attention is inside its graphs; the timers then wrap that wrapper.
    replay = PatchSet("replay", [Patch(
        target="vllm.v1.worker.gpu.cudagraph_utils.ModelCudaGraphManager.run_fullgraph",
        how=Wrap(params=["self", "desc"]), make=lambda original: lambda self, desc: original(self, desc),
        reason="test", hosts=">=0", upstream=NOT_FILED, remove_when="test")])
    replay.apply({})
    assert plugin.apply_runner_patches()
    bench.Timers().install()
    assert RUNNER.problems() == []
    assert replay.problems() == []
    assert plugin.runner_patch_problem() is None


def _fake_engine(monkeypatch, stats: list):
    """The bench's vLLM mode module with an engine that serves every request at once and answers the
    ``bcg_stats`` RPC with ``stats`` (one list per worker), and no GPU work around it."""
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
    monkeypatch.setattr(bench.weights, "copy_bandwidth_gbs", lambda: 3000.0)
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    return bench


@pytest.mark.parametrize("mode", BCG_MODES)
@pytest.mark.parametrize("stats, engaged", [([[]], False), ([[{"summary": "replays=3 fallbacks=0"}]], True)])
def test_a_bcg_mode_in_which_bcg_captured_nothing_fails_instead_of_reporting_vllm(monkeypatch, mode, stats, engaged):
    bench = _fake_engine(monkeypatch, stats)
    if engaged:
        assert bench.run(mode, "qwen3-0.6b", [16], reps=1, warmup=0)["bcg_stats"] == ["replays=3 fallbacks=0"]
    else:
        with pytest.raises(SystemExit, match=f"bench {mode}: bcg captured nothing"):
            bench.run(mode, "qwen3-0.6b", [16], reps=1, warmup=0)


def test_full_plain_is_full_graphs_at_the_same_sizes_over_the_plain_model():
    """vLLM's FULL graphs over what bcg's torch_compile false captures: compilation mode NONE, the
    rest as ``full``. vLLM keeps FULL under NONE (it downgrades only modes needing its piecewise
    compilation), so the mode is not refused on any release the bench covers."""
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode

    from bcg_bench.vllm_mode import engine_kwargs

    full = engine_kwargs("full", "qwen3-0.6b", [16, 4096])["compilation_config"]
    plain = engine_kwargs("full_plain", "qwen3-0.6b", [16, 4096])["compilation_config"]
    assert "mode" not in full  # vLLM's default compilation
    assert {k: v for k, v in plain.items() if k != "mode"} == full
    cc = CompilationConfig(**plain)
    assert cc.mode == CompilationMode.NONE and cc.cudagraph_mode == CUDAGraphMode.FULL
    assert not cc.cudagraph_mode.requires_piecewise_compilation()


@pytest.mark.parametrize("mode, attention, torch_compile", [
    ("bcg", None, False), ("bcg_break", "break", False), ("bcg_graph", "graph", False), ("bcg_compile", None, True)])
def test_each_bcg_mode_pins_what_its_name_says_whatever_the_bcg_variables(monkeypatch, mode, attention, torch_compile):
    import dataclasses

    from bcg_bench.vllm_mode import engine_kwargs
    from bcg_plugin.config import BcgConfig

    knows_attention = "attention" in {f.name for f in dataclasses.fields(BcgConfig)}
    monkeypatch.setenv("BCG_TORCH_COMPILE", "0" if torch_compile else "1")
    if attention is not None:  # the other choice, which the mode must override
        monkeypatch.setenv("BCG_ATTENTION", "graph" if attention == "break" else "break")
    else:
        monkeypatch.delenv("BCG_ATTENTION", raising=False)
    bcg = engine_kwargs(mode, "qwen3-0.6b", [16, 2048])["additional_config"]["bcg"]
    assert bcg["enable"] is True and bcg["torch_compile"] is torch_compile
    assert bcg.get("attention") == attention  # bcg and bcg_compile: the config's default (auto)
    if knows_attention:
        assert BcgConfig.from_mapping(bcg).attention == (attention or "auto")


@pytest.mark.parametrize("mode, inline, problem", [
    ("bcg_graph", [[], []], "kept attention out of every graph"),
    ("bcg_graph", [[16, 32], []], None),
    ("bcg_break", [[16]], "captured attention inside some graphs"),
    ("bcg_break", [[], []], None),
    ("bcg", [[16]], None),
    ("bcg_graph", [], None),  # a runtime that does not report the buckets: nothing to check
])
def test_a_bcg_attention_mode_whose_graphs_do_not_match_its_name_fails(monkeypatch, mode, inline, problem):
    import vllm

    from bcg_bench import vllm_mode as bench
    from bcg_plugin.adapters.vllm import plugin

    stats = [[{"summary": "s", **({"graph_attention_buckets": b} if inline else {})} for b in inline or [[]]]]

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
    monkeypatch.setattr(bench.weights, "copy_bandwidth_gbs", lambda: 3000.0)
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    if problem is None:
        result = bench.run(mode, "qwen3-0.6b", [16], reps=1, warmup=0)
        assert result.get("graph_attention_buckets") == (sorted({b for x in inline for b in x}) if inline else None)
    else:
        with pytest.raises(SystemExit, match=f"bench {mode}: bcg .*{problem}"):
            bench.run(mode, "qwen3-0.6b", [16], reps=1, warmup=0)


@pytest.mark.parametrize("captured", [56, None])
def test_a_bcg_mode_records_how_many_buckets_bcg_captured(monkeypatch, captured):
    """``bcg_buckets``, ``bcg_capture_s`` and ``bcg_graph_gib`` come from the runtime's stats as the
    worker RPC returns them (the capture seconds per bucket target reads the first two; the report
    sets bcg's own graph memory beside the engine's); a runtime that does not report them leaves
    them out."""
    from bcg_plugin.adapters.vllm.metrics import stats_dict
    from bcg_plugin.stats import RuntimeStats

    runtime = stats_dict(RuntimeStats(buckets_captured=captured or 0, capture_seconds=1.5, warmup_seconds=0.25,
                                      graph_bytes=3 * 2**28))
    if captured is None:
        del runtime["buckets"], runtime["capture_seconds"], runtime["warmup_seconds"], runtime["graph_bytes"]
    bench = _fake_engine(monkeypatch, [[runtime]])
    result = bench.run("bcg", "qwen3-0.6b", [16], reps=1, warmup=0)
    assert result.get("bcg_buckets") == captured
    assert result.get("bcg_capture_s") == (1.5 if captured else None)  # bcg's part of the capture only
    assert result.get("bcg_warmup_s") == (0.25 if captured else None)  # and the warm-ups' part of that
    # the config the engine ran with: vLLM's defaults under the keys the bench gave
    assert result["bcg_resolved_config"]["warmup"] == "first_bucket" and result["bcg_resolved_config"]["enable"]
    assert result.get("bcg_graph_gib") == (0.75 if captured else None)  # and of the graph memory


@pytest.mark.usefixtures("fake_cuda_events")
def test_the_v2_full_graph_replay_is_timed_once_outside_a_forward_context_and_not_again_inside(monkeypatch):
    """The V2 runner replays FULL graphs (vLLM's, and bcg's buckets with attention inside) outside
    ``set_forward_context``: timing only the context left those forwards out of ``forward_ms``."""
    import contextlib

    import torch
    import vllm.v1.worker.gpu.cudagraph_utils as graphs
    import vllm.v1.worker.gpu.model_runner as v2
    from vllm.v1.worker.gpu_worker import Worker

    from bcg_bench import vllm_mode as bench

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(Worker, "initialize_from_config", Worker.initialize_from_config)
    for module in bench.runner_modules():  # install() wraps these; restored after the test
        monkeypatch.setattr(module.GPUModelRunner, "capture_model", module.GPUModelRunner.capture_model)
        monkeypatch.setattr(module, "set_forward_context", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(graphs.ModelCudaGraphManager, "run_fullgraph", lambda self, desc: f"hidden[{desc.num_tokens}]")
    timers = bench.Timers()
    timers.install()
    replay = graphs.ModelCudaGraphManager.run_fullgraph
    assert replay(None, types.SimpleNamespace(num_tokens=64)) == "hidden[64]"
    assert [f[0] for f in timers.forwards] == [64]
    assert timers.last_forward()[0] == 1.0 and timers.forwards == []
    with v2.set_forward_context(None, None, num_tokens=128):  # V1's FULL graphs replay inside the model call
        replay(None, types.SimpleNamespace(num_tokens=128))
    assert [f[0] for f in timers.forwards] == [128]


def test_parameter_bytes_count_a_tied_weight_once_and_name_the_vocabulary_tables():
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    def table(cls, rows, dim):
        class Table(cls):  # vLLM's layers without their tensor-parallel set-up
            def __init__(self):
                torch.nn.Module.__init__(self)
                self.weight = torch.nn.Parameter(torch.zeros(rows, dim, dtype=torch.bfloat16))

        return Table()

    from bcg_bench.vllm_mode import parameter_bytes

    body = torch.nn.Linear(4, 8, dtype=torch.bfloat16)  # 4 x 8 weight and 8 biases
    untied = torch.nn.ModuleDict({"embed": table(VocabParallelEmbedding, 10, 4), "body": body,
                                  "lm_head": table(ParallelLMHead, 10, 4)})
    assert parameter_bytes(untied) == ((2 * 40 + 40) * 2, 2 * 40 * 2)
    embed = torch.nn.Embedding(10, 4, dtype=torch.bfloat16)
    tied = torch.nn.ModuleDict({"embed": embed, "body": body, "lm_head": embed})  # vLLM's tie: the same module
    assert parameter_bytes(tied) == ((40 + 40) * 2, 40 * 2)


@pytest.mark.usefixtures("fake_cuda_events")
def test_copy_bandwidth_counts_the_bytes_read_and_written(monkeypatch):
    import torch

    from bcg_bench import weights

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: real_empty(*a, **k))  # on the CPU
    # The fake events read 1 ms per copy: 1 MB read and 1 MB written in 1 ms is 2 GB/s.
    assert weights.copy_bandwidth_gbs(reps=3, nbytes=10**6) == pytest.approx(2.0)


def test_a_mode_that_pins_attention_fails_where_bcg_put_it_elsewhere():
    from bcg_bench.vllm_mode import attention_problem

    for mode in ("bcg_graph", "bcg_compile_graph"):
        assert "kept attention out of every graph" in attention_problem(mode, [[]])
        assert attention_problem(mode, [[16, 32]]) is None
    assert "although the mode asks for breaks" in attention_problem("bcg_break", [[16]])
    assert attention_problem("bcg_break", [[]]) is None
    assert attention_problem("bcg", [[]]) is None and attention_problem("bcg_compile", [[16]]) is None
    assert attention_problem("bcg_graph", []) is None  # a runtime that does not report it
