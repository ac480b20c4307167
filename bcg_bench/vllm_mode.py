"""One vLLM benchmark mode in this process: ``python -m bcg_bench.vllm_mode --mode M ...``.

Modes: ``eager`` (enforce_eager), ``native`` (vLLM's breakable graphs, default sizes), ``native_ladder``
(the same with bcg's ladder as ``cudagraph_capture_sizes``), ``compile`` (default -O2: vLLM's piecewise
graphs over its compiled model), ``full`` (vLLM's FULL graphs, attention inside, at bcg's ladder up
to the chunk: the mode to beat where the attention backend graphs any batch mix), ``full_plain`` (the
same over the plain model, vLLM's compilation off: what FULL graphs give the model bcg captures),
``bcg`` (bcg over the plain model, ``torch_compile`` false, attention where the config's default puts
it), ``bcg_break`` and ``bcg_graph`` (the same with ``"attention"`` ``"break"`` and ``"graph"``: their
difference is what a break costs), ``bcg_compile`` (bcg with ``torch_compile``, the vLLM
adapter's default: its graphs capture vLLM's default piecewise compilation) and
``bcg_compile_graph`` (the same with attention inside the graph in every bucket: against
``bcg_compile`` it tells, above the largest bucket ``"auto"`` keeps attention inside, whether a
bucket would gain by keeping it inside too).

Each mode is one prefill runtime whatever the model: ``VLLM_USE_BREAKABLE_CUDAGRAPH`` is ``1`` for the
native modes (a dense model is not on the list of architectures vLLM graphs breakably by itself from
0.29) and ``0`` for eager, compile, full and full_plain (so a listed architecture does not switch
compile to breakable graphs); unset for the bcg modes, where bcg sets it. ``VLLM_USE_V2_MODEL_RUNNER``
is left as the caller sets it (``0`` selects the V1 runner through 0.33; 0.34 has only V2).
Per N: one request of N prompt tokens, one output token, prefix cache off; the end-to-end
``LLM.generate`` median and the model-forward median (CUDA events around the forward, through a
wrapper on the runners' ``set_forward_context`` and on the V2 runner's FULL-graph replay, which runs
outside it, that exists only in this process). Writes the JSON
contract of :mod:`bcg_bench.harness`: ``e2e_ms``, ``forward_ms`` (N -> ms), ``init_s``,
``capture_s``, ``graph_mem_gib``; plus ``forward_host_ms``, the host time spent issuing the
forward, which tells a launch-bound forward (host ~ device time) from a GPU-bound one, and
``graph_mem_allocator_gib``, the part of ``graph_mem_gib`` torch's caching allocator holds (graph
pools, cached blocks): the rest is held outside it, by the driver's graph objects and libraries;
``graph_mem_estimate_gib``, the graph memory vLLM's worker estimated before it sized the KV cache
(bcg's share included where bcg runs; 0 under 0.34's extensible KV cache, which measures after the
capture instead), against which ``graph_mem_gib`` is the capture's actual figure; and
``device_used_gib`` and ``kv_cache_gib``, the device memory in use once every N has been served and the
KV cache's part of it. What is left beyond the KV cache (weights, graphs, and the activation blocks
torch's allocator keeps cached after the largest eager forward) is what each mode costs a server at
the same workload, wherever its engine accounts for it. At tp=1, dp=1 also ``weight_bytes`` and
``vocab_weight_bytes`` (every parameter, and the part in the vocabulary tables: the embedding, read
by rows, and the LM head, applied after the timed forward) and ``copy_bandwidth_gbs``, what a 1 GiB
device-to-device copy moves per second (bytes read plus written) in the same process after the
timed requests: the report's weight-read floor of a forward. With
``bcg bench --profile N`` (tp=1, dp=1), ``host_profile``: the forward of one extra N-token request
under ``torch.profiler`` (:mod:`bcg_bench.profile`). The bcg modes also record ``bcg_stats`` (each
serving runner's summary line), ``bcg_resolved_config`` (the config the engine ran with, vLLM's
defaults under the bench's keys), ``bcg_buckets`` and ``bcg_capture_s`` (the buckets bcg captured
and the seconds it took, which the capture seconds per bucket target reads), ``bcg_warmup_s``
(the warm-up forwards' part of those seconds), ``bcg_graph_gib``
(the device memory bcg's own buckets took, the rest of ``graph_mem_gib`` being vLLM's decode
graphs) and, where the runtime reports them, ``graph_attention_buckets``.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the wrappers see it.

``--dp N`` (MoE models: vLLM's offline data parallelism serves no dense model) starts one process
per DP rank with vLLM's ``VLLM_DP_*`` variables and expert parallelism. A rank's engine loop starts
only when its own process sends a request, so the ranks move in step (:mod:`bcg_bench.ranks`):
at every measurement rank 0 sends the N-token request it times and every other rank a one-token
request, which vLLM pads to rank 0's size. Rank 0 writes the result. The engines then run in their
own processes, so only the end-to-end figures are recorded, as at tensor parallelism above 1.
Under data parallelism ``generate()`` returns only when the DP wave ends, at least
``DP_WAVE_MIN_STEPS`` engine steps after it began, most of them one-token dummy steps; so the run
also records ``ttft_ms``, the time to first token from vLLM's own request metrics, which ends with
the prefill step.
"""

from __future__ import annotations

import argparse
import functools
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bcg_bench import weights
from bcg_bench.hostspeed import HostSpeed
from bcg_bench.order import interleaved
from bcg_bench.ranks import FileBarrier, free_port

MODES = ("eager", "native", "native_ladder", "compile", "full", "full_plain", "bcg", "bcg_break", "bcg_graph",
         "bcg_compile", "bcg_compile_graph")
# What each bcg mode pins in bcg's config, whatever BCG_* variables say: the mode names what it measures.
BCG_MODES = {
    "bcg": {"torch_compile": False},
    "bcg_break": {"torch_compile": False, "attention": "break"},
    "bcg_graph": {"torch_compile": False, "attention": "graph"},
    "bcg_compile": {"torch_compile": True},
    "bcg_compile_graph": {"torch_compile": True, "attention": "graph"},
}
# vLLM's data-parallel engine loop agrees that the wave is over only every this many steps
# (EngineCore._has_global_unfinished_reqs in 0.26): the floor of a DP request's generate() time.
DP_WAVE_MIN_STEPS = 32


def breakable_env(mode: str) -> str | None:
    """``VLLM_USE_BREAKABLE_CUDAGRAPH`` for ``mode`` (``None``: unset, bcg's to set)."""
    if mode in ("native", "native_ladder"):
        return "1"
    return None if mode in BCG_MODES else "0"


def _env_for(mode: str, in_process: bool = True) -> None:
    # Before vLLM is imported: through 0.26 the breakable-graph decorator is decided at import.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    value = breakable_env(mode)
    if value is None:
        os.environ.pop("VLLM_USE_BREAKABLE_CUDAGRAPH", None)
    else:
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = value


def runner_modules() -> list:
    """vLLM's model runner modules in this release: V2's, and V1's up to 0.33 (0.34 removed it)."""
    import importlib

    import vllm.v1.worker.gpu.model_runner as v2

    try:
        return [v2, importlib.import_module("vllm.v1.worker.gpu_model_runner")]
    except ImportError:
        return [v2]


class Timers:
    """Capture time and memory around ``capture_model``, CUDA events around each model forward: the
    body of the runners' ``set_forward_context``, and the V2 runner's FULL-graph replay
    (``ModelCudaGraphManager.run_fullgraph``), which it issues outside any forward context (vLLM's
    FULL graphs, and bcg's buckets with attention inside the graph)."""

    def __init__(self) -> None:
        from bcg_bench.profile import ForwardProfiler

        self.capture_s = 0.0
        self.profile_capture_s = 0.0
        self.kv_cache_bytes = 0
        self.graph_bytes = 0
        self.allocator_bytes = 0
        self.graph_estimate_bytes: int | None = None
        self.weight_bytes: int | None = None
        self.vocab_weight_bytes: int | None = None
        self.forwards: list = []
        self.timing = 0  # forwards being timed now: a replay inside a timed forward context is not another
        self.profile_armed = False
        self.profiler = ForwardProfiler.from_env(armed=lambda: self.profile_armed)  # bcg bench --profile N

    def install(self) -> None:
        import vllm.v1.worker.gpu.cudagraph_utils as graphs
        from vllm.v1.worker.gpu_worker import Worker

        Worker.initialize_from_config = self._timed_kv_cache(Worker.initialize_from_config)
        if hasattr(Worker, "extend_kv_cache"):  # 0.34's extensible KV cache commits its size after capture
            Worker.extend_kv_cache = self._timed_kv_extension(Worker.extend_kv_cache)
        for module in runner_modules():
            runner = module.GPUModelRunner
            runner.capture_model = self._timed_capture(runner.capture_model)
            module.set_forward_context = self._timed_context(module.set_forward_context)
        manager = graphs.ModelCudaGraphManager
        manager.run_fullgraph = self._timed_fullgraph(manager.run_fullgraph)

    def _timed_capture(self, original):
        import torch

        # functools.wraps keeps what bcg's runner-patch verification reads (signature, the patch's
        # original): without it the front-end sees a changed runner and leaves bcg off.
        @functools.wraps(original)
        def capture_model(runner, *args, **kwargs):
            if profiling_capture(runner, kwargs):  # vLLM's graph-memory estimate: released, not the capture
                start = time.perf_counter()
                result = original(runner, *args, **kwargs)
                self.profile_capture_s += time.perf_counter() - start
                return result
            torch.cuda.synchronize()
            # vLLM's capture_model first empties torch's cache, where 0.33's JIT warm-up forwards,
            # run just before it, leave their activations: emptied here, that release is not
            # counted against the graphs (it made every mode's graph memory negative).
            torch.cuda.empty_cache()
            free_before, start = torch.cuda.mem_get_info()[0], time.perf_counter()
            reserved_before = torch.cuda.memory_reserved()
            result = original(runner, *args, **kwargs)
            torch.cuda.synchronize()
            self.capture_s += time.perf_counter() - start
            self.graph_bytes += free_before - torch.cuda.mem_get_info()[0]
            self.allocator_bytes += torch.cuda.memory_reserved() - reserved_before
            return result

        return capture_model

    def _timed_kv_cache(self, original):
        allocating = self._timed_kv_extension(original)

        @functools.wraps(original)
        def initialize_from_config(worker, *args, **kwargs):
            if self.weight_bytes is None:  # the model is loaded before its KV cache is sized
                self.weight_bytes, self.vocab_weight_bytes = parameter_bytes(worker.get_model())
            # Set by the worker's memory profiling, which runs before the KV cache is sized here.
            self.graph_estimate_bytes = getattr(worker, "cudagraph_memory_estimate", None)
            return allocating(worker, *args, **kwargs)

        return initialize_from_config

    def _timed_kv_extension(self, original):
        """``original`` with the device memory it takes counted as KV cache."""
        @functools.wraps(original)
        def allocating(worker, *args, **kwargs):
            used_before = used_device_bytes()
            result = original(worker, *args, **kwargs)
            self.kv_cache_bytes += used_device_bytes() - used_before
            return result

        return allocating

    @contextlib.contextmanager
    def _timed(self, num_tokens: int):
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        self.timing += 1
        try:
            with self.profiler.around(num_tokens) if self.profiler else contextlib.nullcontext():
                yield
        finally:
            self.timing -= 1
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        self.forwards.append((num_tokens, start, end, host_ms))

    def _timed_context(self, original):
        @contextlib.contextmanager
        def set_forward_context(*args, **kwargs):
            num_tokens = kwargs.get("num_tokens")
            with original(*args, **kwargs):
                if num_tokens is None:
                    yield
                    return
                with self._timed(num_tokens):
                    yield

        return set_forward_context

    def _timed_fullgraph(self, original):
        # functools.wraps: bcg's own wrapper of this method stays verifiable, as for capture_model.
        @functools.wraps(original)
        def run_fullgraph(manager, desc, *args, **kwargs):
            if self.timing:
                return original(manager, desc, *args, **kwargs)
            with self._timed(desc.num_tokens):
                return original(manager, desc, *args, **kwargs)

        return run_fullgraph

    def last_forward(self) -> tuple[float, float] | None:
        """The largest forward since the last call (the prefill of the request just served):
        its device time (CUDA events) and the host time spent issuing it."""
        import torch

        torch.cuda.synchronize()
        if not self.forwards:
            return None
        _, start, end, host_ms = max(self.forwards, key=lambda f: f[0])
        self.forwards.clear()
        return start.elapsed_time(end), host_ms


def bench_bcg_config(environ: dict | None = None) -> dict:
    """The ``bcg`` mode's config: enabled, plus any key set as a ``BCG_*`` variable (as SGLang reads them)."""
    from bcg_plugin.config import BcgConfig, env_name

    env = os.environ if environ is None else environ
    chosen = BcgConfig.from_env(env)
    values = chosen.to_dict() if chosen is not None else {}
    return {**{k: v for k, v in values.items() if env_name(k) in env}, "enable": True}


def engine_kwargs(mode: str, model: str, sizes: list[int], tp: int = 1, dp: int = 1) -> dict:
    from bcg_plugin.adapters.vllm.metrics import WORKER_EXTENSION
    from bcg_bench.models import model_dir
    from bcg_plugin.ladder import reference_ladder

    chunk = max(max(sizes), 2048)
    # max_num_seqs stays vLLM's default: it sets the default graph sizes (native's, and the FULL
    # decode graphs bcg keeps) as users get them, up to 512 tokens on H200-class GPUs.
    kwargs = dict(model=str(model_dir(model)), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=chunk + 64, max_num_batched_tokens=chunk, seed=0,
                  enable_prefix_caching=False, gpu_memory_utilization=0.5,
                  tensor_parallel_size=tp, worker_extension_cls=WORKER_EXTENSION)
    if dp > 1:  # the experts spread over the DP ranks: their dispatch is a collective of all of them
        kwargs["enable_expert_parallel"] = True
        kwargs["disable_log_stats"] = False  # the request metrics that hold the time to first token
    if mode == "eager":
        kwargs["enforce_eager"] = True
    elif mode == "native_ladder":
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": reference_ladder(chunk),
                                        "max_cudagraph_capture_size": chunk}
    elif mode in ("full", "full_plain"):  # FULL graphs of every batch to the chunk (FLASH_ATTN/TRITON_ATTN: any mix)
        kwargs["compilation_config"] = {"cudagraph_mode": "FULL", "cudagraph_capture_sizes": reference_ladder(chunk),
                                        "max_cudagraph_capture_size": chunk}
        if mode == "full_plain":  # -O0's compilation mode: the plain model, as bcg's torch_compile false captures it
            kwargs["compilation_config"]["mode"] = "NONE"
    elif mode in BCG_MODES:
        kwargs["additional_config"] = {"bcg": {**bench_bcg_config(), **BCG_MODES[mode]}}
    return kwargs


def run(mode: str, model: str, sizes: list[int], reps: int, warmup: int, tp: int = 1,
        dp: int = 1, dp_rank: int = 0, barrier_dir: str | None = None) -> dict:
    _env_for(mode, in_process=dp == 1)
    from vllm import LLM, SamplingParams

    if mode in BCG_MODES:
        # Installed now (the engine would install them at worker start) so the timers wrap them.
        from bcg_plugin.adapters.vllm import plugin

        plugin.register()
        plugin.apply_runner_patches()
    timers = Timers()
    timers.install()

    start = time.perf_counter()
    kwargs = engine_kwargs(mode, model, sizes, tp, dp)
    llm = LLM(**kwargs)
    init_s = time.perf_counter() - start
    barrier = FileBarrier(barrier_dir, dp_rank, dp) if dp > 1 else None

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    times, forwards, hosts, ttfts = ({n: [] for n in sizes} for _ in range(4))

    def generate(n: int) -> tuple[float, tuple[float, float] | None, float | None]:
        if barrier is not None:
            barrier.wait()
            n = n if dp_rank == 0 else 1
        prompt = {"prompt_token_ids": [rng.randint(100, 150_000) for _ in range(n)]}
        timers.forwards.clear()
        t0 = time.perf_counter()
        outputs = llm.generate([prompt], params, use_tqdm=False)
        elapsed = (time.perf_counter() - t0) * 1e3
        return elapsed, timers.last_forward(), first_token_ms(outputs)

    for n in sizes:
        for _ in range(warmup):
            generate(n)
    speed = HostSpeed()
    for n in interleaved(sizes, reps):
        speed.sample()
        elapsed, f, ttft = generate(n)
        times[n].append(elapsed)
        if f is not None:
            forwards[n].append(f[0])
            hosts[n].append(f[1])
        if ttft is not None:
            ttfts[n].append(ttft)
    device_used = used_device_bytes() if tp == 1 and dp == 1 else None  # before the profiled request
    bandwidth = weights.copy_bandwidth_gbs() if tp == 1 and dp == 1 else None  # after device_used: not the mode's memory
    if timers.profiler is not None and tp == 1 and dp == 1:  # one extra request, in no median
        timers.profile_armed = True
        generate(timers.profiler.tokens)
    e2e = {str(n): statistics.median(times[n]) for n in sizes}
    fwd = {str(n): statistics.median(forwards[n]) for n in sizes if forwards[n]}
    fwd_host = {str(n): statistics.median(hosts[n]) for n in sizes if hosts[n]}
    for n in sizes:
        print(f"[{mode}] N={n}: e2e {e2e[str(n)]:.2f} ms, forward {fwd.get(str(n), float('nan')):.2f} ms", flush=True)

    result = {"mode": mode, "size_order": "interleaved", "e2e_ms": e2e, "init_s": init_s, "tensor_parallel_size": tp,
              "vllm_version": _vllm_version(), "breakable_env": os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH"),
              "v2_model_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
              "data_parallel_size": dp, "host_speed": speed.summary()}
    if tp == 1 and dp == 1:
        result.update(forward_ms=fwd, forward_host_ms=fwd_host, capture_s=timers.capture_s,
                      profile_capture_s=timers.profile_capture_s,
                      graph_mem_gib=timers.graph_bytes / 2**30, graph_mem_allocator_gib=timers.allocator_bytes / 2**30,
                      graph_mem_estimate_gib=(None if timers.graph_estimate_bytes is None
                                              else timers.graph_estimate_bytes / 2**30),
                      device_used_gib=device_used / 2**30, kv_cache_gib=timers.kv_cache_bytes / 2**30,
                      weight_bytes=timers.weight_bytes, vocab_weight_bytes=timers.vocab_weight_bytes,
                      copy_bandwidth_gbs=bandwidth,
                      host_profile=timers.profiler.summary if timers.profiler else None)
    else:  # the model runners live in vLLM's worker processes, out of these timers' reach
        result["note"] = "forward, capture and memory figures are timed in-process and so only at tp=1, dp=1"
    if dp > 1:
        if not all(ttfts[n] for n in sizes):
            raise RuntimeError("vLLM returned no request metrics (first_token_latency) under data parallelism")
        result["ttft_ms"] = {str(n): statistics.median(ttfts[n]) for n in sizes}
        result["note"] += (f". Under data parallelism generate() returns when the DP wave ends, at least "
                           f"{DP_WAVE_MIN_STEPS} engine steps after it began, most of them one-token dummy steps: "
                           "end-to-end time measures those steps more than the prefill; time to first token "
                           "(vLLM's request metrics) ends with the prefill step")
    if mode in BCG_MODES:
        result["bcg_config"] = kwargs["additional_config"]["bcg"]
        from bcg_plugin.adapters.vllm.config import validate

        # What the engine ran with: the adapter's defaults under the keys the bench gave.
        result["bcg_resolved_config"] = validate(result["bcg_config"]).to_dict()
        stats = [s for rank in llm.collective_rpc("bcg_stats") for s in rank]
        result["bcg_stats"] = [s["summary"] for s in stats]
        if not result["bcg_stats"]:
            # Without bcg's graphs this process measured vLLM alone; its figures must not pass as bcg's.
            raise SystemExit(f"bench {mode}: bcg captured nothing in this engine, so its figures would be vLLM's "
                             "without bcg; the engine log's 'bcg:' warning says why")
        counts = [s["buckets"] for s in stats if s.get("buckets") is not None]
        if counts:  # the buckets bcg captured (each serving runner captures the same ladder)
            result["bcg_buckets"] = max(counts)
        seconds = [s["capture_seconds"] for s in stats if s.get("capture_seconds") is not None]
        if seconds:  # bcg's own part of capture_s (vLLM's decode graphs are the rest)
            result["bcg_capture_s"] = max(seconds)
        warm = [s["warmup_seconds"] for s in stats if s.get("warmup_seconds") is not None]
        if warm:  # the part of bcg_capture_s spent in eager warm-up forwards
            result["bcg_warmup_s"] = max(warm)
        graph = [s["graph_bytes"] for s in stats if s.get("graph_bytes") is not None]
        if graph:  # bcg's own part of graph_mem_gib, as its capture summary measured it
            result["bcg_graph_gib"] = max(graph) / 2**30
        inline = [s["graph_attention_buckets"] for s in stats if "graph_attention_buckets" in s]
        if inline:
            result["graph_attention_buckets"] = sorted({b for buckets in inline for b in buckets})
        problem = attention_problem(mode, inline)
        if problem is not None:
            raise SystemExit(f"bench {mode}: {problem}")
    if barrier is not None:  # a rank's engine that shut down early would leave the others in a collective
        barrier.wait()
    return result


def attention_problem(mode: str, inline: list[list[int]]) -> str | None:
    """Why a bcg mode's figures would not be what its name says: ``inline``, per runner, the buckets
    whose attention bcg captured inside the graph (empty where the runtime does not report them)."""
    if not inline:
        return None
    pinned = BCG_MODES.get(mode, {}).get("attention")
    if pinned == "graph" and not any(inline):
        return ("bcg kept attention out of every graph (no bucket's attention backend could run inside it), so "
                "its figures would be bcg_break's; the engine log's capture summary names the backend")
    if pinned == "break" and any(inline):
        return "bcg captured attention inside some graphs although the mode asks for breaks"
    return None


def parameter_bytes(model: Any) -> tuple[int, int]:
    """:func:`bcg_bench.weights.parameter_bytes` with vLLM's vocabulary tables (``ParallelLMHead``
    derives from ``VocabParallelEmbedding``): vLLM applies the LM head after the timed forward."""
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    except ImportError:
        return weights.parameter_bytes(model)
    return weights.parameter_bytes(model, (VocabParallelEmbedding,))


def profiling_capture(runner: Any, kwargs: dict) -> bool:
    """Whether this ``capture_model`` call is vLLM's graph-memory profiling (V2 runner, 0.29+), whose
    graphs are released before the real capture: ``profile_only`` (0.30+), or the profiling flag on
    the runner's graph manager (0.29 passes no argument)."""
    manager = getattr(runner, "cudagraph_manager", None)
    return bool(kwargs.get("profile_only")) or getattr(manager, "_capture_mem_samples", None) is not None


def used_device_bytes() -> int:
    """Device memory in use on this process's GPU (the engine's, at tp=1: one mode runs at a time)."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def first_token_ms(outputs: Any) -> float | None:
    """Time to first token of the one request, from vLLM's request metrics (``None`` without them)."""
    metrics = getattr(outputs[0], "metrics", None) if outputs else None
    latency = getattr(metrics, "first_token_latency", None)
    return latency * 1e3 if latency else None


def _vllm_version() -> str | None:
    from bcg_plugin.versions import installed_version

    return installed_version("vllm")


def dp_rank_envs(dp: int) -> list[dict[str, str]]:
    """Per DP rank, the variables of vLLM's offline data-parallel recipe (one host, one free
    rendezvous port shared by the ranks)."""
    group = {"VLLM_DP_SIZE": str(dp), "VLLM_DP_MASTER_IP": "127.0.0.1", "VLLM_DP_MASTER_PORT": str(free_port())}
    return [{**group, "VLLM_DP_RANK": str(r), "VLLM_DP_RANK_LOCAL": str(r)} for r in range(dp)]


def launch_dp_ranks(argv: list[str], dp: int) -> int:
    """Run this script once per DP rank (``argv`` plus the rank); the exit code of the first
    rank that failed, else 0. Rank 0 writes ``--out``."""
    barrier_dir = tempfile.mkdtemp(prefix="bcg-bench-dp-")
    procs = [subprocess.Popen([sys.executable, "-m", __spec__.name, *argv, "--dp-rank", str(r),
                               "--dp-barrier", barrier_dir], env={**os.environ, **rank_env})
             for r, rank_env in enumerate(dp_rank_envs(dp))]
    codes = [p.wait() for p in procs]  # the harness bounds the mode's time and ends its process group
    return next((c for c in codes if c != 0), 0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--sizes", default="16,64,256,512,1024,2048,4096,8192")
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks, one process each (MoE models)")
    p.add_argument("--dp-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--dp-barrier", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.dp > 1 and args.dp_rank is None:
        raise SystemExit(launch_dp_ranks(sys.argv[1:] if argv is None else argv, args.dp))
    result = run(args.mode, args.model, sizes, args.reps, args.warmup, args.tp,
                 args.dp, args.dp_rank or 0, args.dp_barrier)
    if (args.dp_rank or 0) == 0:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
