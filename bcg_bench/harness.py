"""``bcg bench vllm|sglang``: every mode in its own process, one result file for the run.

Each engine's per-mode script (:mod:`bcg_bench.vllm_mode`, :mod:`bcg_bench.sglang_mode`) takes
``--mode --model --sizes --out`` (and ``--tp``/``--dp`` above 1) and writes a JSON object with
``e2e_ms`` and ``forward_ms`` (N -> ms), ``init_s``, ``capture_s`` and ``graph_mem_gib``; where
the mode measured them, ``forward_host_ms``, ``step_ms`` and the request phases
(:data:`bcg_bench.sglang_mode.PHASES`), ``weight_bytes``, ``vocab_weight_bytes`` and
``copy_bandwidth_gbs`` (read by :func:`bcg_bench.targets.weight_floor` and :func:`break_cost`). This
module runs the modes back to back, stamps the run (engine version, model shape, parallel layout,
GPU, date) and writes
``<engine>-<model>[-tpN][-dpN]-<UTC date and time>.{json,md,png}``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bcg_bench import hostspeed, paired, profile, targets
from bcg_bench.models import shape_summary
from bcg_bench.report import (
    NO_PLOTS, can_plot, environment, plot_capture_memory, plot_latency, plot_speedup, run_stamp, write_markdown,
)

# ``profiles_workers``: whether ``--profile`` reaches forwards run in worker processes (tp or dp > 1).
# vLLM's forward timer wraps the runner in the bench's own process; SGLang's is a patch in every scheduler.
ENGINES = {
    "vllm": {"module": "bcg_bench.vllm_mode", "package": "vllm", "profiles_workers": False,
             "modes": ["eager", "native", "native_ladder", "compile", "full", "full_plain", "bcg", "bcg_break",
                       "bcg_graph", "bcg_compile", "bcg_compile_graph"]},
    "sglang": {"module": "bcg_bench.sglang_mode", "package": "sglang", "profiles_workers": True,
               "modes": ["disabled", "native", "full", "bcg", "bcg_break", "bcg_graph", "bcg_one_graph"],
               # bcg_break and bcg_graph are bcg with attention fixed in every bucket, bcg_one_graph bcg
               # without its graph variants: run when named.
               "default_modes": ["disabled", "native", "full", "bcg"],
               # Every mode of a run uses one: SGLang's full prefill graphs need a backend that can
               # capture plain extend batches (0.5.23's triton backend cannot; flashinfer and fa3 can).
               "attention_backends": ["triton", "flashinfer", "fa3"]},
}
DEFAULT_SIZES = [16, 64, 256, 512, 1024, 2048, 4096, 8192]


def run_mode(engine: str, mode: str, model: str, sizes: list[int], timeout_s: float,
             parallel: dict[str, int] | None = None, profile_tokens: int | None = None,
             attention_backend: str | None = None) -> dict:
    spec = ENGINES[engine]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "mode.json"
        cmd = [sys.executable, "-m", spec["module"], "--mode", mode, "--model", model,
               "--sizes", ",".join(map(str, sizes)), "--out", str(out)]
        if attention_backend is not None:
            cmd += ["--attention-backend", attention_backend]
        for flag, size in (parallel or {}).items():
            if size > 1:
                cmd += [f"--{flag}", str(size)]
        load = os.getloadavg()[0]  # a busy host shows in the run, not only in its spread
        t0 = time.perf_counter()
        # Its own process group: the engine's workers, schedulers and DP ranks end with the mode.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_mode_env(profile_tokens), start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            end_group(proc)
            _, stderr = proc.communicate()
            # The engines cache what they compile: only a machine's first starts pay for it.
            return {"error": f"timed out after {timeout_s:.0f} s (a first start on a machine can spend minutes "
                             "compiling attention kernels, flashinfer's or Triton's: raise --timeout)",
                    "log_tail": (stderr or "")[-3000:]}
        except BaseException:  # Ctrl-C: the engine's processes would go on holding the GPU
            end_group(proc)
            raise
        end_group(proc)  # whatever outlived the mode would hold GPU memory the next mode needs
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            return {"error": f"exit code {proc.returncode}", "log_tail": (stdout + stderr)[-4000:]}
        data = json.loads(out.read_text())
        data["wall_s"] = wall
        data["load_avg_at_start"] = load
        return data


def _mode_env(profile_tokens: int | None) -> dict[str, str]:
    env = os.environ.copy()
    env.pop(profile.PROFILE_TOKENS_ENV, None)  # only --profile arms the modes' profilers
    if profile_tokens:
        env[profile.PROFILE_TOKENS_ENV] = str(profile_tokens)
    return env


def end_group(proc: subprocess.Popen) -> None:
    """Kill what is left of ``proc``'s process group (started with ``start_new_session``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


# Per-N latency maps a mode may report (N -> ms), with their report headings.
LATENCY_KEYS = {
    "e2e_ms": "End-to-end generate() median ms",
    "ttft_ms": "Time to first token median ms (the engine's request metrics)",
    "forward_ms": "Model forward median ms (CUDA events)",
    "forward_host_ms": "Host time issuing the model forward, median ms",
    "step_ms": "Worker step (model forward and sampling, to the sampled token), median ms",
    "queue_ms": "From generate() to the scheduler's waiting queue (tokenizer manager, transport), median ms",
    "schedule_ms": "From the waiting queue to the worker's step (scheduling the batch), median ms",
    "result_ms": "From the sampled token to the output leaving the scheduler (the rest of its loop turn, result "
                 "processing), median ms",
    "return_ms": "From the output leaving the scheduler to generate() returning (tokenizer manager, transport), "
                 "median ms",
}


def _merge_rounds(rounds: list[dict]) -> dict:
    """One mode's figures over rounds: per-N minimum of the latencies and the minimum of each
    duration in seconds (the least disturbed run; durations drift with the host like latencies do),
    other scalars (memory, stats) from the first good round, every round kept under ``rounds``."""
    good = [r for r in rounds if "e2e_ms" in r]
    if not good:
        return rounds[0]
    merged = dict(good[0])
    for key in LATENCY_KEYS:
        if key in good[0]:
            merged[key] = {n: min(r[key][n] for r in good if n in (r.get(key) or {}))
                           for n in (good[0].get(key) or {})}
    for key, value in good[0].items():
        if key.endswith("_s") and isinstance(value, (int, float)):
            merged[key] = min(r[key] for r in good if isinstance(r.get(key), (int, float)))
    if len(rounds) > 1:
        merged["rounds"] = rounds
    return merged


def run(engine: str, model: str, sizes: list[int], modes: list[str], out_dir: Path, timeout_s: float,
        rounds: int = 1, tp: int = 1, dp: int = 1, profile_tokens: int | None = None, rerun_slow: int = 0,
        attention_backend: str | None = None) -> Path:
    """Run every mode in its own process, ``rounds`` times; write and render the result file.

    ``attention_backend``: every mode's attention backend, for engines that list theirs (the first
    listed where ``None``); a backend other than that default is part of the result's name.

    With ``rerun_slow`` K a mode process whose host-speed probe is flagged slow against the fastest
    process so far is run again, up to K times, in its place in the round: the decision reads the
    probe, never the latencies, and every replaced process is kept under ``replaced``.
    """
    spec = ENGINES[engine]
    unknown = [m for m in modes if m not in spec["modes"]]
    if unknown:
        raise SystemExit(f"unknown {engine} mode(s) {unknown}; choose from {spec['modes']}")
    if tp < 1 or dp < 1:
        raise SystemExit(f"--tp and --dp must be >= 1, got tp={tp} dp={dp}")
    if profile_tokens is not None and profile_tokens < 1:
        raise SystemExit(f"--profile takes a token count >= 1 (16, say), got {profile_tokens}")
    if rerun_slow < 0:
        raise SystemExit(f"--rerun-slow takes a count >= 0, got {rerun_slow}")
    if profile_tokens and not spec["profiles_workers"] and (tp > 1 or dp > 1):
        raise SystemExit(f"--profile with {engine} needs --tp 1 --dp 1 (got tp={tp} dp={dp}): the profiler runs "
                         "in the engine's own process; profile on one GPU, or use sglang, which profiles every rank")
    backends = spec.get("attention_backends")
    if attention_backend is not None and attention_backend not in (backends or ()):
        raise SystemExit(f"{engine}: attention backend {attention_backend!r} is not one the bench sets; "
                         f"choose from {', '.join(backends or ()) or 'none (the engine picks its own)'}")
    if backends and attention_backend is None:
        attention_backend = backends[0]
    parallel = {"tp": tp, "dp": dp}
    result = {
        "benchmark": "engine",
        "engine": engine,
        "engine_version": importlib.metadata.version(spec["package"]),
        "model": shape_summary(model),
        **{k: v for k, v in environment().items() if k in ("gpu", "date")},
        "env": environment(),
        "sizes": sizes,
        "parallel": parallel,
        **({"attention_backend": attention_backend} if attention_backend else {}),
        "rounds": rounds,
        "modes": {},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = "".join(f"-{k}{v}" for k, v in parallel.items() if v > 1)
    if backends and attention_backend != backends[0]:
        layout += f"-{attention_backend}"
    # The engine's version is in the name: results are kept per engine, version, model and layout.
    path = out_dir / f"{engine}-{result['engine_version']}-{model}{layout}-{run_stamp(result['date'])}.json"  # model names hold dots: no with_suffix
    # Later rounds reverse the order, so no mode always runs first on a cold machine.
    per_mode: dict[str, list[dict]] = {m: [] for m in modes}
    order = []
    replaced: list[dict] = []
    if rerun_slow:
        result["replaced"] = replaced
    for r in range(rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            order.append(mode)
            for attempt in range(rerun_slow + 1):
                print(f"[bcg bench] {engine} {mode} (round {r + 1}/{rounds}"
                      + (f", rerun {attempt}" if attempt else "") + ") ...", flush=True)
                data = run_mode(engine, mode, model, sizes, timeout_s, parallel, profile_tokens, attention_backend)
                print(f"[bcg bench] {engine} {mode}: {summary_line(data)}", flush=True)
                seen = [d.get("host_speed") for runs in per_mode.values() for d in runs] + [
                    d.get("host_speed") for d in replaced] + [data.get("host_speed")]
                if attempt == rerun_slow or not hostspeed.is_slow(data.get("host_speed"),
                                                                   hostspeed.fastest_probe_us(seen)):
                    break
                replaced.append({"mode": mode, "round": r + 1, **data})
                print(f"[bcg bench] {engine} {mode}: host probe flagged slow; running it again", flush=True)
            per_mode[mode].append(data)
            # Written after every mode: a run stopped from outside keeps the processes it finished.
            _write(path, result, per_mode, order, planned=rounds * len(modes))
    render(path)
    return path


def _write(path: Path, result: dict, per_mode: dict[str, list[dict]], order: list[str], *, planned: int) -> None:
    result["order"] = list(order)
    result["processes"] = {"finished": len(order), "planned": planned}
    result["modes"] = {m: _merge_rounds(runs) for m, runs in per_mode.items() if runs}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)  # never a half-written file, whenever the run is stopped


def _layout(result: dict) -> str:
    names = {"tp": "tensor parallel", "dp": "data parallel"}
    backend = result.get("attention_backend")
    return ("".join(f", {names[k]} {v}" for k, v in (result.get("parallel") or {}).items() if v > 1)
            + (f", attention backend {backend}" if backend else ""))


BASELINE_MODE = {"vllm": "eager", "sglang": "disabled"}


def render(path: Path) -> list[Path]:
    """Write the markdown report and PNG plots of a result JSON beside it; return what was written."""
    result = json.loads(path.read_text())
    stem = path.name[: -len(".json")]
    good = {m: d for m, d in result["modes"].items() if "e2e_ms" in d}
    title = f"{result['engine']} {result['engine_version']}, {result['model']['name']}"
    baseline = BASELINE_MODE.get(result["engine"], "eager")
    e2e = {m: d["e2e_ms"] for m, d in good.items()}
    costs = {m: (d.get("capture_s") or 0.0, d.get("graph_mem_gib") or 0.0) for m, d in good.items()}
    plotted = can_plot()
    plots = {
        f"{stem}.png": plot_latency(path.parent / f"{stem}.png", f"{title}: end-to-end prefill", e2e),
        f"{stem}-speedup.png": plot_speedup(path.parent / f"{stem}-speedup.png",
                                            f"{title}: speed-up over {baseline}", e2e, baseline),
        f"{stem}-capture.png": plot_capture_memory(path.parent / f"{stem}-capture.png", f"{title}: capture cost",
                                                   costs),
    } if plotted else {}
    written = [path.parent / name for name, ok in plots.items() if ok]
    md = path.parent / f"{stem}.md"
    write_markdown(md, to_markdown(result, [p.name for p in written])
                   + ("" if plotted else f"\nPlots not drawn: {NO_PLOTS}.\n"))
    return [md, *written]


def first_failure(result: dict) -> str | None:
    """The first mode process of the run that failed, as ``mode: error: cause`` (``cause``: the last
    line of its log that names an exception, else its last line), or ``None`` when none failed."""
    started: dict[str, int] = {}
    for mode in result.get("order") or list(result["modes"]):
        data = result["modes"].get(mode) or {}
        k = started[mode] = started.get(mode, -1) + 1
        runs = data.get("rounds") or [data]
        failed = runs[k] if k < len(runs) else {}
        if "error" in failed:
            cause = _cause(failed.get("log_tail") or "")
            return f"{mode}: {failed['error']}" + (f": {cause}" if cause else "")
    return None


_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b")
_CAUSE_CHARS = 300  # a cause is one line of a terminal, not a log


def _cause(log: str) -> str | None:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    named = [line for line in lines if _EXCEPTION_LINE.match(line)]
    line = (named or lines or [None])[-1]
    return line if line is None or len(line) <= _CAUSE_CHARS else line[: _CAUSE_CHARS - 1] + "…"


def summary_line(d: dict) -> str:
    if "error" in d:
        return f"FAILED ({d['error']})"
    speed = d.get("host_speed")
    return "e2e " + " ".join(f"{n}:{v:.2f}" for n, v in d["e2e_ms"].items()) + (
        f" (host probe {speed['probe_us']:.0f} µs)" if speed else "")


def to_markdown(result: dict, images: list[str] = ()) -> str:
    modes = result["modes"]
    good = {m: d for m, d in modes.items() if "e2e_ms" in d}
    sizes = [str(n) for n in result["sizes"]]
    lines = [
        f"# {result['engine']} {result['engine_version']}: {result['model']['name']} (dummy weights, bf16)",
        "",
        f"{result['date']} on {result['gpu']}, torch {result['env']['torch']}{_layout(result)}.{_source(result)} "
        "One request of N prompt tokens, "
        "one output token; every mode in its own process, same run"
        + (", sizes interleaved within each mode" if any(d.get("size_order") == "interleaved"
                                                        for d in result["modes"].values()) else "")
        + (f", {result['rounds']} rounds in alternating order, per-N minimum; "
           "init and capture seconds are each mode's minimum over rounds." if result.get("rounds", 1) > 1 else "."),
        "",
    ]
    loads = [r["load_avg_at_start"] for d in good.values() for r in (d.get("rounds") or [d]) if "load_avg_at_start" in r]
    if loads:
        lines += [f"Host load (1-minute average) when each mode process started: {min(loads):.1f} to {max(loads):.1f}, "
                  f"on {result['env'].get('cpus', '?')} CPUs.", ""]
    processes = result.get("processes") or {}
    if processes.get("finished", 0) < processes.get("planned", 0):
        lines += [f"Incomplete run: {processes['finished']} of {processes['planned']} mode processes finished before "
                  f"it was stopped ({', '.join(result['order'])}).", ""]
    notes = [f"Note ({', '.join(m for m, d in good.items() if d.get('note') == note)}): {note}."
             for note in dict.fromkeys(d["note"] for d in good.values() if d.get("note"))]
    if notes:
        lines += [*notes, ""]
    for key, heading in LATENCY_KEYS.items():
        if any(d.get(key) for d in good.values()):
            lines += [f"## {heading}", "", *_table(sizes, {m: d.get(key) or {} for m, d in good.items()}), ""]
    run_order = _processes(result)
    fastest = hostspeed.fastest_probe_us([s for *_, s in run_order])
    for mine in dict.fromkeys(("bcg", *targets.CONFIGURATIONS.get(result["engine"], {}))):
        lines += _ratio_sections(good, sizes, mine, run_order, fastest)
    lines += hostspeed.markdown(run_order)
    if result.get("replaced"):
        lines += ["Run again because the probe flagged them slow when they ended (kept in the result file under "
                  "`replaced`, out of every table above): " + ", ".join(
                      f"{d['mode']} (round {d['round']}, probe {d['host_speed']['probe_us']:.0f} µs)"
                      for d in result["replaced"]) + ".", ""]
    lines += targets.markdown(result["engine"], good, result["model"]["name"], result.get("parallel"),
                              result.get("gpu"))
    lines += profile.markdown(good)
    # Columns shown where some mode recorded them. bcg's own buckets only on vLLM, whose bcg mode keeps
    # vLLM's decode graphs beside them.
    columns = [(key, heading) for key, heading in (
        ("graph_mem_allocator_gib", "of which torch's allocator GiB"),
        ("bcg_graph_gib", "of which bcg's buckets GiB"),
        ("graph_mem_estimate_gib", "vLLM's estimate before capture GiB"),
    ) if (key != "bcg_graph_gib" or result["engine"] == "vllm") and any(d.get(key) is not None for d in good.values())]
    lines += ["| mode | init s | capture s | graph memory GiB" + "".join(f" | {h}" for _, h in columns) + " |",
              "|---|---|---|---|" + "---|" * len(columns)]
    for m, d in good.items():
        cells = [_fmt(d.get("init_s")), _fmt(d.get("capture_s")), _fmt(d.get("graph_mem_gib"), 3)]
        cells += [_fmt(d.get(key), 3) for key, _ in columns]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += [""] + _footprint(good)
    lines += _break_cost_section(result["engine"], inline_mode(good),
                                 break_cost(good, result["model"].get("num_hidden_layers"), sizes))
    lines += _weight_floor_section(good, sizes)
    lines += [f"![{name}]({name})" for name in images]
    failed = {m: d for m, d in modes.items() if "error" in d}
    if failed:
        lines += ["", "Modes that failed: " + ", ".join(f"{m} ({d['error']})" for m, d in failed.items())]
    return "\n".join(lines) + "\n"


def _source(result: dict) -> str:
    """" bcg-plugin 0.1.0 at <commit>." where the result records them (older results do not)."""
    env = result.get("env") or {}
    if not env.get("bcg_plugin") and not env.get("commit"):
        return ""
    return f" bcg-plugin {env.get('bcg_plugin') or '?'} at {env.get('commit') or 'an unrecorded commit'}."


def _footprint(good: dict) -> list[str]:
    """The device memory each mode holds beyond its KV cache once every N was served, and bcg's
    over each mode's; empty unless some mode measured it."""
    measured = {m: d for m, d in good.items() if d.get("device_used_gib") is not None
                and d.get("kv_cache_gib") is not None}
    if not measured:
        return []
    beyond = {m: d["device_used_gib"] - d["kv_cache_gib"] for m, d in measured.items()}
    lines = ["## Device memory once every N was served", "",
             "In use on the GPU after the last measured request, and what is left beyond the KV cache: weights, "
             "graphs, and the activation blocks torch's allocator keeps cached after the largest eager forward. "
             "Engines count these under different names (a graph pool, or the profiled activation peak); here "
             "every mode is measured alike, after the same requests.", "",
             "| mode | in use GiB | KV cache GiB | beyond the KV cache GiB | bcg / mode (beyond the KV cache) |",
             "|---|---|---|---|---|"]
    for m, d in measured.items():
        ratio = _ratio(beyond.get("bcg"), beyond[m]) if m != "bcg" else None
        lines.append(f"| {m} | {_fmt(d['device_used_gib'], 3)} | {_fmt(d['kv_cache_gib'], 3)} | "
                     f"{_fmt(beyond[m], 3)} | {_fmt(ratio, 3)} |")
    return lines + [""]


def inline_mode(good: dict) -> str | None:
    """The mode that kept attention inside the graph to set against ``bcg_break``: ``bcg_graph``, or
    else ``bcg`` where its default did so in some buckets; ``None`` if neither did."""
    for mode in ("bcg_graph", "bcg"):
        if (good.get(mode) or {}).get("graph_attention_buckets"):
            return mode
    return None


def break_cost(good: dict, layers: int | None, sizes: list[str]) -> dict[str, float]:
    """Per N, the host time one attention break costs (ms): ``bcg_break``'s host time issuing the
    forward less the :func:`inline_mode`'s, over the model's layers (one attention break each in the
    dense models the bench runs), at the sizes whose bucket that mode captured with attention inside
    (``graph_attention_buckets``; above them both modes break and the difference is noise); empty
    unless both modes measured it."""
    mode = inline_mode(good)
    if not layers or mode is None:
        return {}
    brk, inline = ((good.get(m) or {}).get("forward_host_ms") or {} for m in ("bcg_break", mode))
    top = max(good[mode]["graph_attention_buckets"])
    return {n: (brk[n] - inline[n]) / layers for n in sizes if n in brk and n in inline and int(n) <= top}


def _break_cost_section(engine: str, mode: str | None, per_break: dict[str, float]) -> list[str]:
    if not per_break:
        return []
    timer = {"vllm": f" `{mode}`'s timer starts after vLLM landed the step's metadata (its FULL replay), "
                     "`bcg_break`'s around the model call, which includes bcg's input landing: the difference "
                     "holds that landing too.",
             "sglang": " Both timers hold the whole forward, the graph bucket's planning of the live batch "
                       "included."}.get(engine, "")
    return ["## Host time per attention break", "",
            f"The host time issuing the forward in `bcg_break` less `{mode}`'s, over the model's layers: what "
            f"each eager attention step costs the host, at the sizes where `{mode}` kept attention inside the "
            f"graph.{timer}", "",
            *_table(list(per_break), {"µs per break": {n: v * 1e3 for n, v in per_break.items()}}, 1), ""]


def _weight_floor_section(good: dict, sizes: list[str]) -> list[str]:
    floors = {m: f for m, d in good.items() if (f := targets.weight_floor(d)) is not None and d.get("forward_ms")}
    small = [n for n in sizes if int(n) <= targets.FLOOR_MAX_TOKENS]
    if not floors or not small:
        return []
    lines = ["## Model forward over the weight-read floor", "",
             "At a few tokens a forward is bound by reading the weights once: the floor is the bytes of every "
             "weight the timed forward reads whole (the embedding table left out, and the LM head where the "
             "engine applies it after that forward, as vLLM does) at the fastest rate a 1 GiB device-to-device "
             "copy moved memory (read plus written) in the mode's processes. Target on the 8B "
             f"shape: <= {targets.FLOOR_LIMIT:g} at every N <= {targets.FLOOR_MAX_TOKENS}.", "",
             "| mode | weights read GB | copy GB/s | floor ms |", "|---|---|---|---|"]
    for m, floor in floors.items():
        read = targets.weight_bytes_read(good[m])
        lines.append(f"| {m} | {_fmt(read / 1e9, 3)} | {_fmt(read / floor / 1e6, 0)} | {_fmt(floor, 3)} |")
    columns = {f"{m} forward / floor": {n: _ratio(good[m]["forward_ms"].get(n), f) for n in small}
               for m, f in floors.items()}
    return lines + ["", *_table(small, columns, 3), ""]


def _processes(result: dict) -> list[tuple[str, int, dict | None]]:
    """(mode, round, host speed) of every mode process, in the order the run started them."""
    seen: dict[str, int] = {}
    processes = []
    for mode in result.get("order") or []:
        data = result["modes"].get(mode) or {}
        k = seen.get(mode, 0)
        seen[mode] = k + 1
        runs = data.get("rounds") or [data]
        if k < len(runs):
            processes.append((mode, k + 1, runs[k].get("host_speed")))
    return processes


def _ratio_sections(good: dict, sizes: list[str], mine: str, run_order: list, fastest: float | None) -> list[str]:
    """The ratio tables of bcg mode ``mine`` against the other modes (``bcg_compile``: against the
    host's own modes only): per-N minimum, paired by round, and paired over unflagged rounds."""
    if mine not in good or len(good) < 2:
        return []
    only = None if mine == "bcg" else {m for m in good if not m.startswith("bcg")}
    title = "" if mine == "bcg" else f" of {mine}"
    lines = []
    for key, heading in (("e2e_ms", "End-to-end ratios"), ("ttft_ms", "Time-to-first-token ratios")):
        ratios = _bcg_ratios(good, key, sizes, mine, only) if good[mine].get(key) else {}
        if ratios:
            lines += [f"## {heading}{title} (below 1: {mine} faster)", "", *_table(sizes, ratios, 3), ""]
    paired = _paired_ratios(good, sizes, mine=mine, only=only)
    if paired:
        lines += [f"## End-to-end ratios{title} paired by round (median over rounds of {mine} / mode within one "
                  "round)", "",
                  "Each round runs every mode once, in alternating order, so a host that drifts over the run moves "
                  "both sides of a pair alike; the per-N minimum above instead favours the mode whose rounds spread "
                  "wider.", "", *_table(sizes, paired, 3), ""]
    if paired and any(hostspeed.is_slow(s, fastest) for *_, s in run_order):
        both_fast = _paired_ratios(good, sizes, min_pairs=1, mine=mine, only=only,
                                   keep=lambda a, b: not (hostspeed.is_slow(a.get("host_speed"), fastest)
                                                          or hostspeed.is_slow(b.get("host_speed"), fastest)))
        lines += [f"## The same{title}, over the rounds in which neither process was flagged slow (host speed "
                  "below)", "",
                  "Small-N latencies are host-bound: a pair with one slow process compares the host, not the "
                  "modes. Columns name how many rounds were kept.", ""]
        lines += [*_table(sizes, both_fast, 3), ""] if both_fast else ["No round is free of a slow process.", ""]
    return lines


def _bcg_ratios(good: dict, key: str, sizes: list[str], mine: str = "bcg",
                only: set[str] | None = None) -> dict[str, dict]:
    """``mine``'s ``key`` latency over each other mode's (those in ``only``, if given), and over the
    best of them, per N; empty when there is no other mode."""
    bcg = good[mine][key]
    others = {m: d.get(key) or {} for m, d in good.items() if m != mine and (only is None or m in only)}
    if not others:
        return {}
    ratios = {f"{mine} / {m}": {n: _ratio(bcg.get(n), e.get(n)) for n in sizes} for m, e in others.items()}
    ratios[f"{mine} / best other"] = {
        n: _ratio(bcg.get(n), min((e[n] for e in others.values() if n in e), default=None)) for n in sizes}
    return ratios


def _paired_ratios(good: dict, sizes: list[str], *, min_pairs: int = 2, mine: str = "bcg",
                   only: set[str] | None = None,
                   keep: Callable[[dict, dict], bool] | None = None) -> dict[str, dict]:
    """Per other mode (those in ``only``, if given), the median over rounds of ``mine``'s e2e over
    that mode's in the same round; only over rounds in which both ran (and ``keep(mine_round,
    other_round)`` holds), and only with ``min_pairs`` such rounds or more. With ``keep`` the column
    names how many rounds it kept."""
    columns = {}
    for mode, data in good.items():
        if mode == mine or (only is not None and mode not in only):
            continue
        rounds = paired.round_pairs(good.get(mine) or {}, data)
        kept = [(a, b) for a, b in rounds if keep is None or keep(a, b)]
        if len(kept) >= min_pairs:
            name = f"{mine} / {mode}" if keep is None else f"{mine} / {mode} ({len(kept)} of {len(rounds)})"
            columns[name] = paired.medians(kept, sizes)
    return columns


def _table(sizes: list[str], columns: dict[str, dict], digits: int = 2) -> list[str]:
    """A markdown table with one row per N and one column per series."""
    return ["| N | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns),
            *(f"| {n} | " + " | ".join(_fmt(c.get(n), digits) for c in columns.values()) + " |" for n in sizes)]


def _ratio(a, b):
    return None if a is None or not b else a / b


def _fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
