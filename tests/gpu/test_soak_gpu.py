"""Soak: minutes of mixed traffic through bcg with no hang, no mismatch and flat GPU memory.

Marked ``gpu`` and ``soak``; it never runs unless asked for (``tests/conftest.py`` skips it
otherwise): select it with ``-m soak`` or set ``BCG_SOAK_SECONDS`` (the traffic's duration,
default 600). One engine per test; ``-k`` picks it::

    python -m pytest tests/gpu/test_soak_gpu.py -m soak -s -k vllm
    BCG_TEST_TP=2 BCG_TEST_MODEL=qwen3-8b python -m pytest tests/gpu/test_soak_gpu.py -m soak -s -k vllm
    BCG_TEST_DP=2 BCG_TEST_MODEL=qwen3-30b-a3b python -m pytest tests/gpu/test_soak_gpu.py -m soak -s -k vllm
    python -m pytest tests/gpu/test_soak_gpu.py -m soak -s -k sglang
    BCG_TEST_TP=2 BCG_TEST_DP=2 BCG_TEST_MODEL=qwen3-8b python -m pytest tests/gpu/test_soak_gpu.py -m soak -s -k sglang

``BCG_TEST_TP``/``BCG_TEST_MODEL`` mean what they mean in the other engine tests. ``BCG_TEST_DP``:
SGLang's DP attention (``Engine(tp_size=TP, dp_size=DP, enable_dp_attention=True)``); vLLM's offline
data parallelism with a MoE model at TP 1, one engine process per DP rank with expert parallelism,
as in ``test_vllm_gpu``: each wave's requests are dealt round-robin, so in a wave of fewer requests
than ranks (a quarter of the waves hold one) the other ranks send a one-token placeholder and idle
through the wave in vLLM's dummy forwards. The ranks start every wave together and rank 0 decides
when the traffic ends (``DpSteps``); the probes run on rank 0 while the others idle.
``BCG_SOAK_OUT`` names the JSON summary (a file, or a directory to name it in, e.g.
``benchmarks/results/``; default a temporary directory). ``BCG_SOAK_WAVE_DEADLINE_S`` (120) and
``BCG_SOAK_MEMORY_BOUND_MIB`` (256) change the two limits below. ``BCG_SOAK_TORCH_COMPILE=1`` (vLLM)
soaks bcg with ``torch_compile`` and holds its probes to vLLM's own compiled engine instead of eager,
as ``test_vllm_gpu`` does: compilation alone moves outputs.

Each engine runs in its own process (this file re-invoked as a script, in its own process group so
the test can end it and its workers): first an eager reference (vLLM ``enforce_eager``, SGLang
``cuda_graph_backend_prefill="disabled"``) that only answers the probes, then bcg, which answers
the probes, serves the traffic for ``BCG_SOAK_SECONDS``, and answers the probes again.

Traffic (``soak_helpers.traffic``, seeded): waves of 1..24 requests submitted together (one
``LLM.generate`` / ``Engine.generate`` call, so prefills batch together, long prompts are chunked at
2048 tokens and decodes mix into later prefills), prompt lengths log-uniform in 1..8192 (small ones
dominate), 1..32 output tokens, some prompts extending a recent prompt's prefix. A quarter of the
waves hold one request (with DP attention the other ranks idle while one works); after a wave the
engine idles 0..0.3 s, or 2..8 s after 15% of them.

Checks:

1. No hang. Every phase (probe rounds, each wave) runs under a deadline (120 s); a phase that
   outlives it ends the engine process, which logged the phase before starting it, so the failure
   names the wave. The whole engine process also has a timeout (the soak's duration, one deadline,
   and 15 minutes for start-up, capture, probes and shutdown).
2. No mismatch. Every request gets exactly the output tokens it asked for (``ignore_eos``). 30 probe
   prompts (lengths 1, 2, 2047, 2048, 2049, 8192 and log-uniform), greedy with logprobs, before and
   after the traffic (prefix cache flushed first, so they are computed again), each compared with the
   eager reference by the same check functions as the engine tests: vLLM ``test_vllm_gpu.mismatches``
   (top-5 overlap and logprob tolerance, up to the first differing token), SGLang
   ``test_sglang_gpu.request_error`` (input and output logprobs within ``TOL`` x the eager spread;
   for a MoE model at ``MOE_QUANTILE`` of each request's positions).
   Those tests hold the negative control for these functions (a replay with stale attention metadata
   must fail them), which therefore covers this comparison too.
3. Flat GPU memory. Device memory used is sampled after every wave (vLLM on one GPU:
   ``torch.cuda.mem_get_info`` in the engine's process; engines of several processes: ``nvidia-smi``
   memory.used of their GPUs). After the first third of the run (pools and caches reach their working
   size), max - min per GPU must stay under 256 MiB.
4. bcg ran, in lockstep. vLLM: ``collective_rpc("bcg_stats")`` from every worker
   (``bcg_plugin.adapters.vllm.metrics``) shows replays, no eager fallback (under DP, only steps whose DP-wide
   size is no bucket), and every tensor- and data-parallel rank with the same replays per bucket. SGLang: the forward records (the bench's timers, :mod:`bcg_bench.sglang_timers`) show replays and
   every rank replaying the same sequence of buckets (under DP attention, of the DP-wide maximum
   token count); without DP no forward within the top bucket ran eagerly (with DP, steps in which
   one rank decodes while another extends run eagerly by design and are only counted; a rank with
   no requests replays its peers' bucket).

The summary (engine, versions, model, layout, traffic, replays, memory series, mismatches, date, GPU,
torch) is written even when a check fails, then the test fails with every problem found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dummy_weights
import pytest

import soak_helpers as soak
from test_vllm_gpu import TOP_K, fewest_shared, mismatches, worst_logprob_diff

pytestmark = [pytest.mark.gpu, pytest.mark.soak]

TP = int(os.environ.get("BCG_TEST_TP", "1"))
DP = int(os.environ.get("BCG_TEST_DP", "1"))
MODEL = os.environ.get("BCG_TEST_MODEL", "qwen3-0.6b")
SEED = 0
CHUNK = 2048  # both engines' chunked-prefill size (SGLang's DP attention gives each rank CHUNK // DP)
PROBES = 30
PROBE_EDGES = (1, 2, CHUNK - 1, CHUNK, CHUNK + 1, soak.MAX_PROMPT)
PROBE_TOKENS = 4
WAVE_DEADLINE_S = float(os.environ.get("BCG_SOAK_WAVE_DEADLINE_S", "120"))
MEMORY_BOUND_MIB = float(os.environ.get("BCG_SOAK_MEMORY_BOUND_MIB", "256"))
START_ALLOWANCE_S = 900  # engine start (capture included), two probe rounds, shutdown
TORCH_COMPILE = os.environ.get("BCG_SOAK_TORCH_COMPILE", "") not in ("", "0")  # vLLM only
DP_BARRIER_ENV = "BCG_SOAK_DP_BARRIER"  # the directory vLLM's DP rank processes step together through
SGLANG_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs")
HERE = Path(__file__).resolve().parent


# -- the engine process ----------------------------------------------------------------------------


def drive(role: str, probe, generate, memory, progress: Path, agree=lambda stop: stop) -> dict:
    """The reference answers the probes; the soak engine answers them, serves the traffic, answers again.

    ``generate`` returns, per request of the wave, the output tokens it got, or ``None`` for a
    request another data-parallel rank served. ``agree(stop)`` turns this process's wish to stop
    into the decision every rank takes (data-parallel ranks must run the same waves)."""
    watchdog = soak.Watchdog(soak.Progress(progress))
    if role == "reference":
        with watchdog.phase("probes", WAVE_DEADLINE_S):
            return {"probes": probe()}
    seconds = soak.soak_seconds()
    with watchdog.phase("probes before the traffic", WAVE_DEADLINE_S):
        first = probe()
    waves, series, short = [], [], []
    t0 = time.monotonic()
    series.append((0.0, memory()))
    for wave in soak.traffic(SEED):
        now = time.monotonic() - t0
        with watchdog.phase(f"agreeing on wave {wave.index}", WAVE_DEADLINE_S):
            if agree(now >= seconds):
                break
        with watchdog.phase(f"wave {wave.index}", WAVE_DEADLINE_S, requests=len(wave.requests),
                            prompt_tokens=wave.prompt_tokens, at_s=round(now, 1)):
            started = time.monotonic()
            produced = generate(wave.requests)
            took = time.monotonic() - started
        short += [{"wave": wave.index, "request": i, "asked": r.max_tokens, "got": n}
                  for i, (r, n) in enumerate(zip(wave.requests, produced)) if n is not None and n != r.max_tokens]
        series.append((time.monotonic() - t0, memory()))
        waves.append({"index": wave.index, "requests": len(wave.requests), "prompt_tokens": wave.prompt_tokens,
                      "output_tokens": sum(n for n in produced if n is not None), "seconds": round(took, 3),
                      "gap_s": round(wave.gap_s, 3)})
        print(f"[bcg soak] wave {wave.index} at {now:.0f} s: {len(wave.requests)} requests, "
              f"{wave.prompt_tokens} prompt tokens, {took:.2f} s, memory {series[-1][1]} MiB", flush=True)
        time.sleep(max(0.0, min(wave.gap_s, seconds - (time.monotonic() - t0))))
    run_s = time.monotonic() - t0
    with watchdog.phase("probes after the traffic", WAVE_DEADLINE_S):
        last = probe()
    return {"probes_start": first, "probes_end": last, "waves": waves, "short_outputs": short,
            "memory": series, "memory_source": memory.source, "seconds_run": run_s}


class DpSteps:
    """Keeps vLLM's data-parallel rank processes on the same wave: every rank sends requests in every
    step (vLLM's offline data parallelism steps a rank's engine only while its own process has a
    request, so a rank with nothing to do sends a one-token placeholder and then idles through the
    step in vLLM's dummy forwards), and rank 0 alone decides when the traffic stops."""

    def __init__(self, directory: Path, rank: int, size: int):
        from bcg_bench.ranks import FileBarrier

        self.rank, self.size = rank, size
        self.barrier = FileBarrier(directory, rank, size, timeout_s=WAVE_DEADLINE_S)
        self.stop_file = directory / "stop"

    def agree(self, stop: bool) -> bool:
        if self.rank == 0 and stop:
            self.stop_file.write_text("stop")  # before rank 0 reaches the barrier, so every rank sees it after
        self.barrier.wait()
        return self.stop_file.exists()


def vllm_engine(role: str, progress: Path) -> dict:
    from vllm import LLM, SamplingParams

    from bcg_plugin.adapters.vllm.metrics import WORKER_EXTENSION
    from bcg_bench.models import model_dir

    rank = int(os.environ.get("VLLM_DP_RANK", "0"))
    steps = DpSteps(Path(os.environ[DP_BARRIER_ENV]), rank, DP) if DP > 1 else None
    kwargs = dict(
        model=str(model_dir(MODEL)), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        max_model_len=soak.MAX_PROMPT + 512, max_num_batched_tokens=CHUNK, max_num_seqs=64, seed=0,
        gpu_memory_utilization=0.35 if MODEL == "qwen3-0.6b" else 0.7, enable_prefix_caching=True,
        attention_backend="FLASH_ATTN", tensor_parallel_size=TP, worker_extension_cls=WORKER_EXTENSION,
        enable_expert_parallel=DP > 1,  # the experts spread over the DP ranks, as in test_vllm_gpu
    )
    if role == "soak":
        kwargs["additional_config"] = {"bcg": {"enable": True, "torch_compile": TORCH_COMPILE}}
    else:  # with torch_compile the reference is vLLM's own compiled engine (-O2, its graphs)
        kwargs["enforce_eager"] = not TORCH_COMPILE
    llm = LLM(**kwargs)
    llm.apply_model(dummy_weights.rescale)  # as in test_vllm_gpu: logits spread over a few nats
    prompts = soak.probe_prompts(SEED + 1, PROBES, PROBE_EDGES)
    placeholder = ([{"prompt_token_ids": [100]}], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))

    def probe() -> list[dict]:  # on rank 0; the other ranks idle alongside
        if not llm.reset_prefix_cache():
            print("[bcg soak] vLLM did not reset its prefix cache before the probes", flush=True)
        if steps is not None:
            steps.barrier.wait()
            if rank != 0:
                llm.generate(*placeholder, use_tqdm=False)
                return []
        params = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0, logprobs=TOP_K, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [{"tokens": list(c.token_ids),
                 "top": [{str(t): lp.logprob for t, lp in pos.items()} for pos in c.logprobs]}
                for c in (o.outputs[0] for o in outs)]

    def generate(requests: list[soak.Request]) -> list[int | None]:
        mine = soak.dp_share(len(requests), rank, DP)
        produced: list[int | None] = [None] * len(requests)
        if not mine:
            llm.generate(*placeholder, use_tqdm=False)
            return produced
        params = [SamplingParams(max_tokens=requests[i].max_tokens, temperature=0.0, ignore_eos=True) for i in mine]
        outs = llm.generate([{"prompt_token_ids": requests[i].ids} for i in mine], params, use_tqdm=False)
        for i, o in zip(mine, outs):
            produced[i] = len(o.outputs[0].token_ids)
        return produced

    if rank != 0:  # rank 0 samples every GPU of the data-parallel group
        memory = soak.GpuMemory("sampled by DP rank 0", lambda: [])
    elif TP * DP == 1:
        memory = soak.GpuMemory.this_process()
    else:
        memory = soak.GpuMemory.nvidia_smi(TP * DP)
    result = drive(role, probe, generate, memory, progress, agree=steps.agree if steps else lambda stop: stop)
    result["bcg"] = [s for tp_rank in llm.collective_rpc("bcg_stats") for s in tp_rank]  # one per TP rank with bcg
    if steps is not None:  # an engine shut down while a peer still steps would leave the peer in a collective
        steps.barrier.wait()
    return result


def sglang_engine(role: str, progress: Path, model_path: str) -> dict:
    from test_sglang_gpu import engine_kwargs, rescale_dummy_weights  # the engine test's layout and weights

    from bcg_bench import sglang_timers

    record = progress.with_name(f"{role}.forwards.jsonl")
    os.environ.setdefault("BCG_STATS_INTERVAL_S", "30")
    # The bench's timers in every scheduler: the forward records the lockstep check reads.
    engine = sglang_timers.start_engine(record, **engine_kwargs(model_path, "bcg" if role == "soak" else "disabled",
                                                                chunk=CHUNK))
    rescale_dummy_weights(engine)
    prompts = soak.probe_prompts(SEED + 1, PROBES, PROBE_EDGES)
    try:
        def probe() -> list[dict]:
            flushed = engine.flush_cache()
            if not getattr(flushed, "success", True):
                print(f"[bcg soak] SGLang did not flush its cache before the probes: {flushed}", flush=True)
            params = {"max_new_tokens": PROBE_TOKENS, "temperature": 0.0, "ignore_eos": True}
            outs = engine.generate(
                input_ids=prompts,
                sampling_params=[params] * len(prompts),
                return_logprob=True,
                logprob_start_len=[0] * len(prompts),
                top_logprobs_num=1,
            )
            return [{k: o["meta_info"][k] for k in SGLANG_LOGPROB_KEYS} for o in outs]

        def generate(requests: list[soak.Request]) -> list[int]:
            outs = engine.generate(
                input_ids=[r.ids for r in requests],
                sampling_params=[{"max_new_tokens": r.max_tokens, "temperature": 0.0, "ignore_eos": True}
                                 for r in requests],
            )
            return [int(o["meta_info"]["completion_tokens"]) for o in outs]

        result = drive(role, probe, generate, soak.GpuMemory.nvidia_smi(TP), progress)
    finally:
        engine.shutdown()
    lines = record.read_text().splitlines() if record.exists() else []
    result["forwards"] = [r for r in map(json.loads, lines) if r.get("kind") == "forward"]
    return result


# -- running an engine process ---------------------------------------------------------------------


def run_engine(engine: str, role: str, tmp: Path, timeout_s: float, model_path: str | None = None) -> dict:
    """This file as a script in its own process group (vLLM under data parallelism: one per DP rank);
    its result (rank 0's, with every rank's bcg counters), or ``{"error": ...}`` naming the phase."""
    env = {**os.environ, "PYTHONPATH": soak.with_tests_on_path(os.environ)}
    ranks = [{}]
    if engine == "vllm":
        # In this process: bcg_stats, memory and the weight rescaling; under DP the engine core is a
        # process of its own, as in vLLM's offline data-parallel recipe.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if DP == 1 else "1"
        if TP > 1 or DP > 1:  # apply_model ships the weight rescaling to the worker processes
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if DP > 1:
            from bcg_bench.vllm_mode import dp_rank_envs

            env[DP_BARRIER_ENV] = tempfile.mkdtemp(prefix=f"bcg-soak-{role}-dp-", dir=tmp)
            ranks = dp_rank_envs(DP)
    names = [role if len(ranks) == 1 else f"{role}.rank{r}" for r in range(len(ranks))]
    commands = []
    for name, rank_env in zip(names, ranks):
        out, progress, log = tmp / f"{name}.json", tmp / f"{name}.progress.jsonl", tmp / f"{name}.log"
        cmd = [sys.executable, __file__, engine, role, str(out), str(progress)] + ([model_path] if model_path else [])
        print(f"\n[bcg soak] {engine} {role} engine{'' if len(ranks) == 1 else f' (DP rank {name[-1]})'}: log {log}",
              flush=True)
        commands.append((cmd, {**env, **rank_env}, log))
    procs, timed_out = soak.run_in_groups(commands, timeout_s)
    results = [_engine_result(name, proc, tmp, timeout_s, timed_out) for name, proc in zip(names, procs)]
    failed = [r for r in results if "error" in r]
    if failed:  # every failing rank: the first to fail and the peers it left waiting
        return {"error": "; ".join(r["error"] for r in failed),
                "log": "\n".join(f"--- {r['name']} ---\n{r['log'][-6000 // len(failed):]}" for r in failed),
                "events": results[0].get("events", [])}
    run = results[0]
    for other in results[1:]:
        run["short_outputs"] = run.get("short_outputs", []) + other.get("short_outputs", [])
    if engine == "vllm":
        run["bcg_per_dp_rank"] = [r["bcg"] for r in results]
    return run


def _engine_result(name: str, proc: subprocess.Popen, tmp: Path, timeout_s: float, timed_out: bool) -> dict:
    out, progress, log = tmp / f"{name}.json", tmp / f"{name}.progress.jsonl", tmp / f"{name}.log"
    events = soak.read_progress(progress)
    phase = soak.describe_phase(soak.unfinished_phase(events))
    text = log.read_text(errors="replace")
    tail = text[-6000:]
    if soak.hung(proc.returncode, text):
        error = f"hang: {phase} of the {name} engine did not finish within its deadline"
    elif timed_out and not out.exists():
        error = f"hang: the {name} engine process was still running after {timeout_s:.0f} s, in {phase}"
    elif proc.returncode != 0 or not out.exists():
        error = f"the {name} engine process failed (exit {proc.returncode}) in {phase}"
    else:
        return json.loads(out.read_text())
    return {"error": error, "log": tail, "events": events, "name": name}


def _need_gpus(n: int) -> None:
    import torch

    if torch.cuda.device_count() < n:
        pytest.skip(f"{n} GPUs needed (BCG_TEST_TP={TP}), {torch.cuda.device_count()} visible")


@pytest.fixture
def soak_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="bcg-soak-"))


# -- checks and summary ----------------------------------------------------------------------------


def traffic_summary(run: dict) -> dict:
    waves = run.get("waves")
    if waves is None:  # the engine died: what its progress log says was completed
        done = [e for e in run.get("events", []) if e["event"] == "done" and e["phase"].startswith("wave ")]
        return {"waves_completed": len(done)}
    return {
        "waves": len(waves),
        "requests": sum(w["requests"] for w in waves),
        "prompt_tokens": sum(w["prompt_tokens"] for w in waves),
        "output_tokens": sum(w["output_tokens"] for w in waves),
        "single_request_waves": sum(w["requests"] == 1 for w in waves),
        "idle_gaps": sum(w["gap_s"] >= soak.IDLE_GAP_S[0] for w in waves),
        "idle_seconds": round(sum(w["gap_s"] for w in waves if w["gap_s"] >= soak.IDLE_GAP_S[0]), 1),
        "longest_wave_s": max((w["seconds"] for w in waves), default=0.0),
        "short_outputs": len(run["short_outputs"]),
    }


def check_run(run: dict, problems: list[str]) -> dict:
    """Hang, output-length and memory checks shared by both engines; the memory verdict."""
    if "error" in run:
        problems.append(f"{run['error']}\n--- engine log (tail) ---\n{run['log']}")
        return {}
    if run["short_outputs"]:
        problems.append(f"{len(run['short_outputs'])} requests got another number of output tokens than asked "
                        f"for: {run['short_outputs'][:10]}")
    verdict = soak.memory_flatness(run["memory"], MEMORY_BOUND_MIB)
    if verdict["problem"]:
        problems.append(f"GPU memory not flat: {verdict['problem']}")
    return {**verdict, "source": run["memory_source"], "series": [[round(t, 2), m] for t, m in run["memory"]]}


def write_summary(engine: str, seconds: float, run: dict, memory: dict, counters: dict, probes: dict,
                  problems: list[str]) -> Path:
    from bcg_bench.models import shape_summary
    from bcg_bench.report import environment, run_stamp
    from bcg_plugin.versions import installed_version

    env = environment()
    variant = "torch-compile" if TORCH_COMPILE and engine == "vllm" else ""
    summary = {
        "test": "soak",
        "engine": engine,
        "engine_version": installed_version(engine),
        "bcg_plugin_version": installed_version("bcg-plugin"),
        "commit": _commit(),
        "model": shape_summary(MODEL),
        "parallel": {"tp": TP, "dp": DP},
        "variant": variant or "default",
        "date": env["date"],
        "gpu": env["gpu"],
        "torch": env["torch"],
        "env": env,
        "seed": SEED,
        "seconds_requested": seconds,
        "seconds_run": run.get("seconds_run"),
        "wave_deadline_s": WAVE_DEADLINE_S,
        "traffic": traffic_summary(run),
        "bcg": counters,
        "memory": memory,
        "probes": probes,
        "passed": not problems,
        "problems": [p.split("\n--- engine log")[0] for p in problems],
    }
    path = soak.summary_path(os.environ.get("BCG_SOAK_OUT"), engine, MODEL, {"tp": TP, "dp": DP},
                             run_stamp(env["date"]), tempfile.gettempdir(), variant)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2))
    t = summary["traffic"]
    print(f"[bcg soak] {engine}{' ' + variant if variant else ''} {MODEL} tp={TP} dp={DP}: {t.get('waves', t.get('waves_completed'))} waves, "
          f"{t.get('requests', '?')} requests, {t.get('prompt_tokens', '?')} prompt tokens in "
          f"{summary['seconds_run'] or 0:.0f} s; memory "
          + ", ".join(f"GPU {g}: {m['span']:.0f} MiB span after warm-up ({m['min']:.0f}..{m['max']:.0f}; overall "
                      f"{m['overall_min']:.0f}..{m['overall_max']:.0f})" for g, m in enumerate(memory.get("gpus", [])))
          + f" (bound {MEMORY_BOUND_MIB:.0f} MiB, {memory.get('samples_after_warmup', 0)} samples after "
            f"{memory.get('warmup_s', 0):.0f} s); {'passed' if not problems else f'{len(problems)} problem(s)'}",
          flush=True)
    print(f"[bcg soak] summary: {path}", flush=True)
    return path


def _commit() -> str | None:
    """``GIT_COMMIT`` where set (a copied tree whose git data may lag its files, as the bench and
    ci/gpu-tests.sh read it), else HEAD, with ``-dirty`` appended when the tree that ran differs from it."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"], cwd=HERE,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _finish(engine: str, seconds: float, run: dict, memory: dict, counters: dict, probes: dict,
            problems: list[str]) -> None:
    write_summary(engine, seconds, run, memory, counters, probes, problems)
    assert not problems, f"{engine} soak: {len(problems)} problem(s):\n" + "\n".join(f"- {p}" for p in problems)


# -- tests -----------------------------------------------------------------------------------------


def test_vllm_soak(soak_dir):
    pytest.importorskip("vllm")
    from bcg_bench.models import MODELS

    if DP > 1 and (TP > 1 or "num_experts" not in MODELS[MODEL]):
        pytest.skip(f"the vLLM data-parallel soak runs a MoE model at TP 1 per DP rank (vLLM's offline data "
                    f"parallelism serves MoE models only); got BCG_TEST_MODEL={MODEL}, BCG_TEST_TP={TP}")
    _need_gpus(TP * DP)
    seconds = soak.soak_seconds()
    ref = run_engine("vllm", "reference", soak_dir, START_ALLOWANCE_S)
    if "error" in ref:
        pytest.fail(f"reference: {ref['error']}\n{ref['log']}")
    assert ref["bcg"] == [], "the reference ran with bcg"
    run = run_engine("vllm", "soak", soak_dir, seconds + START_ALLOWANCE_S + WAVE_DEADLINE_S)
    problems: list[str] = []
    memory = check_run(run, problems)
    counters: dict = {}
    probes: dict = {"count": PROBES, "tokens": PROBE_TOKENS, "top_k": TOP_K}
    if "error" not in run:
        for when in ("start", "end"):
            got = run[f"probes_{when}"]
            bad = mismatches(got, ref["probes"])
            probes[when] = {"beyond_tolerance": bad, "worst_logprob_diff": worst_logprob_diff(got, ref["probes"]),
                            "fewest_shared_top_k": fewest_shared(got, ref["probes"])}
            print(f"[bcg soak] probes {when}: {len(bad)}/{PROBES} beyond tolerance, worst |d logprob| "
                  f"{probes[when]['worst_logprob_diff']:.4f}, fewest shared top-k "
                  f"{probes[when]['fewest_shared_top_k']}", flush=True)
            if bad:
                problems.append(f"probes {'before' if when == 'start' else 'after'} the traffic: {len(bad)}/{PROBES} "
                                f"differ from eager beyond tolerance: {bad}")
        stats = [s for dp_rank in run["bcg_per_dp_rank"] for s in dp_rank]  # DP-major, then TP
        world = TP * DP
        counters = {"replays_per_rank": [s["replays"] for s in stats],
                    "replays_by_bucket": stats[0]["replays_by_bucket"] if stats else {},
                    "fallbacks": [s["fallbacks"] for s in stats], "buckets": [s["buckets"] for s in stats],
                    "padded_tokens": [s["padded_tokens"] for s in stats],
                    "real_tokens": [s["real_tokens"] for s in stats],
                    "graph_bytes": [s["graph_bytes"] for s in stats]}
        if len(stats) != world or not all(s["replays"] > 0 for s in stats):
            problems.append(f"bcg did not replay on every one of {world} ranks: {[s['summary'] for s in stats]}")
        # No forward exceeds the chunk and no feature forces eager. Under DP a step whose DP-wide size
        # is no bucket (one rank's FULL decode padded past another's bucket) runs eagerly on every rank.
        allowed = set() if DP == 1 else {"feature_not_captured"}
        if any(set(s["fallbacks"]) - allowed for s in stats):
            problems.append(f"eager fallbacks: {[s['fallbacks'] for s in stats]}")
        # Every TP and DP rank replays the same buckets the same number of times: an idle DP rank's
        # dummy forward replays the bucket its peers replay.
        lockstep = soak.lockstep_problem({i: s["replays_by_bucket"] for i, s in enumerate(stats)}, world)
        counters["lockstep"] = lockstep or "ok"
        if lockstep and len(stats) == world:
            problems.append(f"ranks out of lockstep: {lockstep}")
    _finish("vllm", seconds, run, memory, counters, probes, problems)


def test_sglang_soak(soak_dir):
    pytest.importorskip("sglang")
    from bcg_bench.models import model_dir

    if TORCH_COMPILE:
        pytest.skip("BCG_SOAK_TORCH_COMPILE soaks vLLM only: bcg's torch_compile key is vLLM's")
    if DP > 1 and TP % DP:
        pytest.skip(f"SGLang's DP attention needs tp_size divisible by dp_size (BCG_TEST_TP={TP}, BCG_TEST_DP={DP})")
    _need_gpus(TP)
    import test_sglang_gpu as reference_check  # its check functions; imports sglang

    if reference_check.GRAPH_ATTENTION:
        pytest.skip("the soak's reference is eager prefill, which flashinfer's attention inside bcg's graph does "
                    "not match bit for bit (other kernels; the engine suite holds it to SGLang's full graphs): "
                    "soak flashinfer with BCG_ATTENTION=break")

    seconds = soak.soak_seconds()
    if MODEL == "qwen3-0.6b":  # scaled random weights, as in test_sglang_gpu (written on the CPU)
        model_path = str(reference_check.write_scaled_checkpoint(soak_dir / "qwen3-0.6b-scaled", device="cpu"))
    else:
        model_path = str(model_dir(MODEL))  # config only: SGLang's dummy weights, rescaled once loaded
    ref = run_engine("sglang", "reference", soak_dir, START_ALLOWANCE_S, model_path)
    if "error" in ref:
        pytest.fail(f"eager reference: {ref['error']}\n{ref['log']}")
    assert not any(f["graph"] for f in ref["forwards"]), "the eager reference replayed prefill graphs"
    run = run_engine("sglang", "soak", soak_dir, seconds + START_ALLOWANCE_S + WAVE_DEADLINE_S, model_path)
    problems: list[str] = []
    memory = check_run(run, problems)
    counters: dict = {}
    probes: dict = {"count": PROBES, "tokens": PROBE_TOKENS, "tol_x_spread": reference_check.TOL}
    if "error" not in run:
        spread = reference_check.spread_of(ref["probes"])
        probes["eager_spread"] = spread
        for when in ("start", "end"):
            try:
                errs = reference_check.errors(run[f"probes_{when}"], ref["probes"], spread)
            except AssertionError as e:  # outputs not comparable position by position
                problems.append(f"probes {when}: not comparable with the eager reference: {e}")
                continue
            bad = [i for i, e in enumerate(errs) if e > reference_check.TOL]
            probes[when] = {"beyond_tolerance": bad, "worst_x_spread": max(errs)}
            print(f"[bcg soak] probes {when}: {len(bad)}/{PROBES} beyond tolerance, worst {max(errs):.4f} x spread "
                  f"(tol {reference_check.TOL})", flush=True)
            if bad:
                problems.append(f"probes {'before' if when == 'start' else 'after'} the traffic: {len(bad)}/{PROBES} "
                                f"differ from eager beyond tolerance: {bad} (errors x spread "
                                f"{[round(errs[i], 3) for i in bad]})")
        forwards = run["forwards"]
        per_rank = soak.replay_sequences(forwards)
        eager = [f for f in forwards if not f["graph"]]
        counters = {"replays_per_rank": {r: len(s) for r, s in sorted(per_rank.items())},
                    "eager_extend_forwards_per_rank": _count_by_rank(eager),
                    "replayed_max_tokens": max((max(s) for s in per_rank.values() if s), default=0)}
        if not per_rank:
            problems.append(f"bcg never replayed ({len(forwards)} extend forwards, all eager)")
        lockstep = soak.lockstep_problem(per_rank, TP) if per_rank else "no replays"
        counters["lockstep"] = lockstep or "ok"
        if per_rank and lockstep:
            problems.append(f"ranks out of lockstep: {lockstep}")
        top = CHUNK // DP if DP > 1 else CHUNK
        in_range = [f["tokens"] for f in eager if f["tokens"] <= top]
        counters["eager_within_top_bucket"] = len(in_range)
        if DP == 1 and in_range:
            problems.append(f"{len(in_range)} forwards within the top bucket ({top}) ran eagerly: {in_range[:20]}")
    _finish("sglang", seconds, run, memory, counters, probes, problems)


def _count_by_rank(forwards: list[dict]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for f in forwards:
        counts[int(f.get("rank", 0))] = counts.get(int(f.get("rank", 0)), 0) + 1
    return dict(sorted(counts.items()))


if __name__ == "__main__":
    engine_name, role_name, out_path, progress_path = sys.argv[1:5]
    if engine_name == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        outcome = vllm_engine(role_name, Path(progress_path))
    else:
        outcome = sglang_engine(role_name, Path(progress_path), sys.argv[5])
    Path(out_path).write_text(json.dumps(outcome))
