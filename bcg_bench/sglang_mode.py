"""One SGLang benchmark mode in its own process: ``python -m bcg_bench.sglang_mode --mode M ...``.

Modes: ``disabled`` (eager prefill), ``native`` (SGLang's breakable runner, its CUDA default),
``full`` (SGLang's full prefill graphs, attention inside the graph), ``tc_piecewise`` (torch.compile
piecewise graphs; SGLang removed it in 0.5.22), ``bcg`` (bcg's default, ``BCG_ATTENTION=auto``),
``bcg_break`` and ``bcg_graph`` (bcg with attention an eager break, or inside its graphs where the
backend allows it, in every bucket: ``BCG_ATTENTION=break`` and ``graph``), ``bcg_one_graph`` (the
default with each bucket one graph, its graph variants not captured, ``BCG_GRAPH_VARIANTS=0``). Per N: the median end-to-end
``Engine.generate`` time of one request of N prompt tokens and one output token (radix cache off),
the median CUDA-event time of its prefill forward, the median wall time of the worker's step
around it (forward and sampling, ``step_ms``), and the rest of the request's time in phases
(:data:`PHASES`). Writes ``e2e_ms``, ``forward_ms``
(N -> ms), ``init_s``, ``capture_s`` and ``graph_mem_gib`` (the contract of
:mod:`bcg_bench.harness`). Forward times and capture figures come from the bench's timers in the
schedulers of the engine this process starts (:mod:`bcg_bench.sglang_timers`); so does
``host_profile`` under ``bcg bench --profile N`` (the forward of one extra N-token request under torch.profiler).
At tp=1, dp=1 also the weight-read floor's figures, from the scheduler's capture record: ``weight_bytes``,
``vocab_weight_bytes`` and ``copy_bandwidth_gbs`` (a 1 GiB device copy timed in the scheduler).
A ``bcg`` engine in which some scheduler's capture record shows SGLang's own runner, or bcg's with no
bucket captured, ends the process with one line before any request: its figures would be SGLang's;
so does a ``bcg_graph`` engine whose buckets all kept attention an eager break (its figures would be
``bcg_break``'s), a ``bcg_break`` engine with a bucket that kept it inside, or a ``bcg_one_graph``
engine that captured a variant.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bcg_bench import sglang_timers
from bcg_bench.hostspeed import HostSpeed
from bcg_bench.order import interleaved
from bcg_bench.profile import PROFILE_TOKENS_ENV

MODES = {"disabled": "disabled", "native": "breakable", "full": "full", "tc_piecewise": "tc_piecewise", "bcg": "bcg",
         "bcg_break": "bcg", "bcg_graph": "bcg", "bcg_one_graph": "bcg"}
# bcg's ``attention`` setting per bcg mode (the environment its schedulers inherit).
ATTENTION = {"bcg": "auto", "bcg_break": "break", "bcg_graph": "graph", "bcg_one_graph": "auto"}
# The bcg modes that leave the graph buckets' variants out (``graph_variants`` off).
ONE_GRAPH = {"bcg_one_graph"}
# Modes an SGLang release no longer has: (first release without it, what to run instead).
RETIRED = {"tc_piecewise": ("0.5.22", "full or native")}


def mode_problem(mode: str, installed: str | None) -> str | None:
    """Why ``mode`` cannot run on SGLang ``installed``, or ``None``."""
    from packaging.version import InvalidVersion, Version

    if mode not in RETIRED or installed is None:
        return None
    gone, instead = RETIRED[mode]
    try:
        if Version(installed) < Version(gone):
            return None
    except InvalidVersion:
        return None
    return f"mode {mode!r}: SGLang removed it in {gone} (installed: {installed}); run {instead}"


def bcg_problem(captures: list[dict], attention: str = "auto", one_graph: bool = False) -> str | None:
    """Why a bcg engine's figures would not be its mode's (``captures``: its schedulers' capture
    records), or ``None``: every scheduler must have built bcg's runner and captured a bucket, and
    under ``attention`` ``"graph"`` kept attention inside the graph in at least one, under
    ``"break"`` in none; with ``one_graph``, captured no variant."""
    if not captures:
        return "no scheduler recorded a prefill-graph capture, so bcg's runner never ran"
    for c in captures:
        if c.get("bcg_buckets") is None:
            what = f"SGLang's own prefill runner ({c.get('runner')}) was built"
        elif c["bcg_buckets"] == 0:
            what = "bcg's runner captured no bucket"
        elif attention == "graph" and not c.get("bcg_graph_attention_buckets"):
            return (f"on rank {c.get('rank', 0)} every bucket kept attention an eager break, so the figures would "
                    "be bcg_break's; the scheduler log's 'bcg' warning says why")
        elif attention == "break" and c.get("bcg_graph_attention_buckets"):
            return (f"on rank {c.get('rank', 0)} some buckets kept attention inside the graph, so the figures "
                    "would not be bcg_break's")
        elif one_graph and c.get("bcg_graph_variants"):
            return (f"on rank {c.get('rank', 0)} some buckets were captured as a variant too, so the figures "
                    "would be bcg's")
        else:
            continue
        return (f"on rank {c.get('rank', 0)} {what}, so the figures would be SGLang's without bcg; the "
                "scheduler log's 'bcg' warning says why")
    return None


def step_tokens(record: dict) -> int:
    """The step's size: under DP attention the largest rank's tokens (rank 0 may idle through it)."""
    return max(record["across_dp"]) if record.get("across_dp") else record["tokens"]


# A request's end-to-end time in consecutive phases, each bounded by two stamps (see
# :mod:`bcg_bench.sglang_timers`): generate() -> waiting queue -> step start -> sampled token ->
# output sent -> generate() returns.
PHASES = ("queue_ms", "schedule_ms", "result_ms", "return_ms")


def request_phases(windows: list[tuple[int, float, float]], served: list[dict], steps: list[dict]) -> dict:
    """Per phase, N -> median ms over the timed requests (``windows``: N, sent and returned) whose
    scheduler record (``served``) and one extend step of N tokens (``steps``) of the same rank fall
    inside their window; the step itself is ``step_ms``. Requests run one at a time, so the window
    is what ties a request to its records; of a tensor-parallel group's ranks, which all record,
    the lowest stands for it. ``phase_requests`` counts the requests tied, per N: one without its
    records adds nothing."""
    per: dict[str, dict[int, list[float]]] = {k: {} for k in PHASES}
    tied: dict[int, int] = {}
    for n, sent, returned in windows:
        for out in sorted((r for r in served if r["tokens"] == n and sent <= r["queued"] <= r["sent"] <= returned),
                          key=lambda r: r.get("rank", 0)):
            step = next((r for r in steps if r["tokens"] == n and "t0" in r and r.get("rank", 0) == out.get("rank", 0)
                         and out["queued"] <= r["t0"] <= r["t1"] <= out["sent"]), None)
            if step is not None:
                break
        else:
            continue
        bounds = (sent, out["queued"], step["t0"], step["t1"], out["sent"], returned)
        edges = {"queue_ms": bounds[0:2], "schedule_ms": bounds[1:3], "result_ms": bounds[3:5],
                 "return_ms": bounds[4:6]}
        for key, (a, b) in edges.items():
            per[key].setdefault(n, []).append((b - a) * 1e3)
        tied[n] = tied.get(n, 0) + 1
    phases = {key: {str(n): statistics.median(v) for n, v in by_n.items()} for key, by_n in per.items()}
    return {**phases, "phase_requests": {str(n): c for n, c in tied.items()}}


def _records(path: Path, kind: str, skip: int = 0) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()[skip:]
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def _line_count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def run(mode: str, model: str, sizes: list[int], warmup: int, iters: int, seed: int, tp: int = 1,
        dp: int = 1, attention_backend: str = "triton") -> dict:
    # The schedulers append to a file under it; it goes once their engine is shut down and read.
    with tempfile.TemporaryDirectory(prefix="bcg-sglang-bench-") as tmp:
        return _measure(Path(tmp) / "record.jsonl", mode, model, sizes, warmup, iters, seed, tp, dp,
                        attention_backend)


def _measure(record: Path, mode: str, model: str, sizes: list[int], warmup: int, iters: int, seed: int, tp: int,
             dp: int, attention_backend: str) -> dict:
    from bcg_bench.models import model_dir

    chunk = max(max(sizes), 16)
    if mode in ATTENTION:  # this process runs one mode: its schedulers inherit the settings
        os.environ["BCG_ATTENTION"] = ATTENTION[mode]
        os.environ["BCG_GRAPH_VARIANTS"] = "0" if mode in ONE_GRAPH else "1"
    t0 = time.perf_counter()
    engine = sglang_timers.start_engine(
        record,
        model_path=str(model_dir(model)),
        load_format="dummy",
        skip_tokenizer_init=True,
        attention_backend=attention_backend,
        disable_radix_cache=True,
        chunked_prefill_size=chunk,
        cuda_graph_backend_prefill=MODES[mode],
        log_level="warning",
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=dp > 1,
    )
    init_s = time.perf_counter() - t0
    problem = (bcg_problem(_records(record, "capture"), ATTENTION[mode], mode in ONE_GRAPH)
               if mode in ATTENTION else None)
    if problem is not None:  # the schedulers wrote their capture records before the engine came up
        engine.shutdown()
        raise SystemExit(f"bench {mode}: {problem}")
    rng = random.Random(seed)
    params = {"max_new_tokens": 1, "temperature": 0.0}
    prompts = {n: [rng.randrange(100, 150000) for _ in range(n)] for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    windows: list[tuple[int, float, float]] = []  # (N, sent, returned) per timed request
    try:
        for n in sizes:
            for _ in range(warmup):
                engine.generate(input_ids=prompts[n], sampling_params=params)
        mark = _line_count(record)
        speed = HostSpeed()  # this process issues the requests; the schedulers run the forwards
        for n in interleaved(sizes, iters):
            speed.sample()
            s = time.perf_counter()
            engine.generate(input_ids=prompts[n], sampling_params=params)
            e = time.perf_counter()
            times[n].append((e - s) * 1e3)
            windows.append((n, s, e))
        # Every rank records its forwards; rank 0's stand for the step (ranks run in lockstep).
        measured = [r for r in _records(record, "forward", mark) if r.get("rank", 0) == 0]
        # Every rank that ran the step: under DP attention the rank that served a request records it.
        steps = _records(record, "step", mark)
        host_profile = None
        profile_tokens = os.environ.get(PROFILE_TOKENS_ENV)
        if profile_tokens:  # one extra request, in no median: the schedulers profile its forward
            Path(sglang_timers.profile_arm_path(str(record))).touch()
            engine.generate(input_ids=[rng.randrange(100, 150000) for _ in range(int(profile_tokens))],
                            sampling_params=params)
            host_profile = min(_records(record, "host_profile"), key=lambda r: r.get("rank", 0), default=None)
    finally:
        engine.shutdown()
    # Read once the schedulers are gone: each writes a request's record after sending its output.
    served = _records(record, "request", mark)
    e2e = {str(n): statistics.median(times[n]) for n in sizes}
    fwd, fwd_host, step = {}, {}, {}
    for n in sizes:
        forwards = [r for r in measured if step_tokens(r) == n]
        if forwards:
            fwd[str(n)] = statistics.median(r["ms"] for r in forwards)
            fwd_host[str(n)] = statistics.median(r["host_ms"] for r in forwards)
        worker = [r["ms"] for r in steps if r["tokens"] == n]
        if worker:
            step[str(n)] = statistics.median(worker)
    phases = request_phases(windows, served, steps)
    capture = (_records(record, "capture") or [{}])[-1]
    floor = {}  # the weight-read floor's figures, on one GPU only
    if tp == 1 and dp == 1 and capture.get("weight_bytes") and capture.get("copy_bandwidth_gbs"):
        floor = {key: capture.get(key) for key in ("weight_bytes", "vocab_weight_bytes", "copy_bandwidth_gbs")}
    return {
        "mode": mode,
        "size_order": "interleaved",
        "prefill_backend_flag": MODES[mode],
        "e2e_ms": e2e,
        "forward_ms": fwd,
        "forward_host_ms": fwd_host,
        "step_ms": step,
        **phases,
        "init_s": init_s,
        "capture_s": capture.get("seconds", 0.0),
        "graph_mem_gib": capture.get("memory_gib", 0.0),
        "host_profile": host_profile,
        "host_speed": speed.summary(),
        "prefill_runner": capture.get("runner"),
        "bcg_pool_gib": capture.get("bcg_pool_gib"),
        "bcg_graph_gib": capture.get("bcg_graph_gib"),
        "bcg_capture_s": capture.get("bcg_capture_s"),
        "bcg_warmup_s": capture.get("bcg_warmup_s"),
        "bcg_resolved_config": capture.get("bcg_config"),
        "bcg_buckets": capture.get("bcg_buckets"),
        "graph_attention_buckets": capture.get("bcg_graph_attention_buckets"),
        "graph_variants": capture.get("bcg_graph_variants"),
        **floor,
        "chunked_prefill_size": chunk,
        "tp_size": tp,
        "dp_size": dp,
        "warmup": warmup,
        "iters": iters,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", required=True, choices=sorted(MODES))
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--sizes", default="16,64,256,512,1024,2048,4096,8192")
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tp_size")
    p.add_argument("--dp", type=int, default=1, help="dp_size, with DP attention (SGLang needs tp_size >= dp_size)")
    p.add_argument("--attention-backend", default="triton", help="SGLang's attention_backend")
    a = p.parse_args(argv)
    from bcg_plugin.adapters.sglang.version import installed

    problem = mode_problem(a.mode, installed())
    if problem is not None:
        p.exit(2, f"bcg bench: {problem}\n")
    sizes = sorted({int(s) for s in a.sizes.split(",") if s.strip()})
    result = run(a.mode, a.model, sizes, a.warmup, a.iters, a.seed, a.tp, a.dp, a.attention_backend)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("mode", "e2e_ms", "forward_ms", "init_s", "capture_s", "graph_mem_gib")}))


if __name__ == "__main__":
    main()
