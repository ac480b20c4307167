"""The soak test's engine-free parts (``test_soak_gpu.py``; unit-tested in ``tests/cpu/test_soak_helpers.py``).

- :func:`traffic`: a seeded, endless stream of request waves (log-uniform prompt lengths, random
  output lengths, random gaps, some of them idle for seconds).
- :func:`memory_flatness`: the flat-memory rule over per-wave device-memory samples.
- :class:`GpuMemory`: device memory used, from the process holding the GPU or from ``nvidia-smi``.
- :class:`Progress` and :class:`Watchdog`: every phase of the engine process is logged before it
  starts; one that outlives its deadline ends the process, so a hang is reported by name.
- :func:`lockstep_problem`: ranks that did not replay alike.
- :func:`run_in_groups` and :func:`dp_share`: engine processes (one per DP rank) under one deadline, and
  the requests each DP rank serves.

No torch or engine import at module level: the CPU tests import this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

SECONDS_ENV = "BCG_SOAK_SECONDS"
DEFAULT_SECONDS = 600.0

MAX_PROMPT = 8192
MAX_OUTPUT = 32
TOKEN_IDS = (100, 150_000)  # inside every Qwen3 vocabulary, clear of special tokens
MAX_WAVE = 24  # requests in one wave
SINGLE_REQUEST_P = 0.25  # waves of one request: with DP attention every other rank is idle
IDLE_GAP_P = 0.15  # the engine idles for IDLE_GAP_S after this share of waves
IDLE_GAP_S = (2.0, 8.0)
SHORT_GAP_S = (0.0, 0.3)
PREFIX_REUSE_P = 0.15  # requests that extend a prefix of a recent prompt (prefix-cache hits)
HISTORY = 64  # recent prompts a reused prefix is taken from

HANG_EXIT = 86  # exit status of an engine process whose watchdog fired
BACKSTOP_S = 30.0  # faulthandler ends the process this long after a deadline if the watchdog could not run


def with_tests_on_path(environ: Mapping[str, str]) -> str:
    """``PYTHONPATH`` of ``environ`` with this folder first: engine processes import the GPU tests'
    modules (``dummy_weights``, ``soak_helpers``, the test scripts) by name."""
    return os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), environ.get("PYTHONPATH")) if p)


def soak_seconds(environ: Mapping[str, str] | None = None) -> float:
    """The soak's traffic duration: ``BCG_SOAK_SECONDS`` (default 600), a number > 0."""
    env = os.environ if environ is None else environ
    raw = (env.get(SECONDS_ENV) or "").strip()
    if not raw:
        return DEFAULT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{SECONDS_ENV} must be a number of seconds > 0, got {raw!r}") from None
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{SECONDS_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


# -- traffic ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    ids: list[int]
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class Wave:
    """Requests submitted together, then ``gap_s`` seconds with nothing submitted."""

    index: int
    requests: list[Request]
    gap_s: float

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)


def prompt_length(rng: random.Random, max_len: int = MAX_PROMPT) -> int:
    """Log-uniform in 1..max_len: as many prompts below ~90 tokens as between ~90 and 8192."""
    return max(1, min(max_len, int(math.exp(rng.uniform(0.0, math.log(max_len + 1))))))


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_IDS) for _ in range(n)]


def traffic(seed: int, max_len: int = MAX_PROMPT) -> Iterator[Wave]:
    """Endless waves, the same for the same seed; the caller stops when its time is up."""
    rng = random.Random(seed)
    history: list[list[int]] = []
    for index in itertools.count():
        size = 1 if rng.random() < SINGLE_REQUEST_P else rng.randint(2, MAX_WAVE)
        requests = []
        for _ in range(size):
            n = prompt_length(rng, max_len)
            if n > 1 and history and rng.random() < PREFIX_REUSE_P:
                base = rng.choice(history)
                keep = rng.randint(1, min(len(base), n - 1))
                ids = base[:keep] + random_ids(rng, n - keep)
            else:
                ids = random_ids(rng, n)
            requests.append(Request(ids, rng.randint(1, MAX_OUTPUT)))
        history = (history + [r.ids for r in requests])[-HISTORY:]
        gap = rng.uniform(*IDLE_GAP_S) if rng.random() < IDLE_GAP_P else rng.uniform(*SHORT_GAP_S)
        yield Wave(index, requests, gap)


def probe_prompts(seed: int, count: int, edges: Sequence[int] = (), max_len: int = MAX_PROMPT) -> list[list[int]]:
    """``count`` prompts: the ``edges`` lengths first, then log-uniform lengths."""
    rng = random.Random(seed)
    lengths = list(edges)[:count] + [prompt_length(rng, max_len) for _ in range(count - len(edges))]
    return [random_ids(rng, n) for n in lengths]


# -- memory ----------------------------------------------------------------------------------------


def memory_flatness(series: Sequence[tuple[float, Sequence[float]]], bound_mib: float,
                    warmup_fraction: float = 1 / 3, min_samples: int = 3) -> dict:
    """Per GPU, max - min of device memory used (MiB) over the samples after the warm-up.

    ``series``: ``(seconds since the traffic started, [MiB used per GPU])``, one per wave. The
    warm-up is the first ``warmup_fraction`` of the time the series covers (allocator pools and
    caches grow to their working size there). ``problem`` names every GPU whose span reaches
    ``bound_mib``, or says the run is too short to judge; ``None`` when memory stayed flat.
    """
    if not series:
        return {"problem": "no memory samples", "gpus": [], "samples": 0, "samples_after_warmup": 0,
                "warmup_s": 0.0, "bound_mib": bound_mib}
    warmup_s = max(t for t, _ in series) * warmup_fraction
    kept = [list(mibs) for t, mibs in series if t >= warmup_s]
    n_gpus = len(series[0][1])
    gpus = []
    for g in range(n_gpus):
        every = [mibs[g] for _, mibs in series]
        after = [mibs[g] for mibs in kept]
        lo, hi = (min(after), max(after)) if after else (float("nan"), float("nan"))
        gpus.append({"min": lo, "max": hi, "span": hi - lo, "overall_min": min(every), "overall_max": max(every),
                     "first": every[0], "last": every[-1]})
    problems = []
    if len(kept) < min_samples:
        problems.append(f"only {len(kept)} memory samples after the {warmup_s:.0f} s warm-up (need {min_samples}): "
                        f"the run is too short to judge memory")
    else:
        for g, s in enumerate(gpus):
            if s["span"] >= bound_mib:
                problems.append(f"GPU {g}: device memory used moved by {s['span']:.0f} MiB after the {warmup_s:.0f} s "
                                f"warm-up (min {s['min']:.0f}, max {s['max']:.0f} MiB; bound {bound_mib:.0f} MiB)")
    return {"problem": "; ".join(problems) or None, "gpus": gpus, "samples": len(series),
            "samples_after_warmup": len(kept), "warmup_s": warmup_s, "bound_mib": bound_mib}


SMI_QUERY = ["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"]


def parse_smi(text: str) -> list[tuple[int, str, float]]:
    """``index, uuid, memory.used`` lines of ``nvidia-smi`` as ``(index, uuid, MiB)``."""
    rows = []
    for line in text.strip().splitlines():
        index, uuid, used = (x.strip() for x in line.split(","))
        rows.append((int(index), uuid, float(used)))
    return rows


def select_gpus(rows: Sequence[tuple[int, str, float]], count: int, visible: str | None) -> list[int]:
    """nvidia-smi indices of the first ``count`` GPUs the engine sees (``CUDA_VISIBLE_DEVICES``:
    indices or UUIDs; unset: every GPU in nvidia-smi's order)."""
    if visible is None:
        chosen = [index for index, _, _ in rows][:count]
    else:
        chosen = []
        for token in (t.strip() for t in visible.split(",") if t.strip()):
            match = [i for i, uuid, _ in rows
                     if token == str(i) or (token.startswith("GPU-") and uuid.startswith(token))]
            if not match:
                raise ValueError(f"CUDA_VISIBLE_DEVICES entry {token!r} is not a GPU nvidia-smi lists")
            chosen.append(match[0])
        chosen = chosen[:count]
    if len(chosen) < count:
        raise ValueError(f"{count} GPUs needed, {len(chosen)} visible")
    return chosen


class GpuMemory:
    """Device memory used per GPU, in MiB: a callable returning one value per GPU."""

    def __init__(self, source: str, sample):
        self.source = source
        self._sample = sample

    def __call__(self) -> list[float]:
        return self._sample()

    @classmethod
    def this_process(cls) -> GpuMemory:
        """``torch.cuda.mem_get_info`` of this process's device (the engine runs in this process)."""

        def sample() -> list[float]:
            import torch

            free, total = torch.cuda.mem_get_info()
            return [(total - free) / 2**20]

        return cls("torch.cuda.mem_get_info", sample)

    @classmethod
    def nvidia_smi(cls, count: int) -> GpuMemory:
        """``nvidia-smi``'s memory.used of the engine's ``count`` GPUs (engines of several processes)."""
        indices = select_gpus(parse_smi(_smi()), count, os.environ.get("CUDA_VISIBLE_DEVICES"))

        def sample() -> list[float]:
            used = {i: mib for i, _, mib in parse_smi(_smi())}
            return [used[i] for i in indices]

        return cls(f"nvidia-smi memory.used, GPUs {indices}", sample)


def _smi() -> str:
    return subprocess.run(SMI_QUERY, capture_output=True, text=True, timeout=60, check=True).stdout


# -- progress and hangs ----------------------------------------------------------------------------


class Progress:
    """An append-only JSON-lines log of phases, read by the test when the engine process dies."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._t0 = time.monotonic()

    def event(self, event: str, phase: str, **info: Any) -> None:
        record = {"event": event, "phase": phase, "t": round(time.monotonic() - self._t0, 3), **info}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def read_progress(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    events = []
    for line in p.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by the process dying
            break
    return events


def unfinished_phase(events: Sequence[dict]) -> dict | None:
    """The last phase that started and never finished (its start record), or ``None``."""
    open_phases: dict[str, dict] = {}
    for e in events:
        if e["event"] == "start":
            open_phases.pop(e["phase"], None)
            open_phases[e["phase"]] = e
        elif e["event"] == "done":
            open_phases.pop(e["phase"], None)
    return list(open_phases.values())[-1] if open_phases else None


def describe_phase(start: dict | None) -> str:
    if start is None:
        return "engine start-up (no phase had started)"
    info = {k: v for k, v in start.items() if k not in ("event", "phase", "t")}
    details = ", ".join(f"{k} {v}" for k, v in info.items())
    return f"{start['phase']} (started {start['t']:.0f} s after the engine was up{', ' + details if details else ''})"


class Watchdog:
    """Runs phases under a deadline: a phase that outlives it logs ``hang``, dumps every thread's
    stack to stderr and ends the process with :data:`HANG_EXIT` (an engine stuck in a collective
    cannot be interrupted any other way). Should the main thread hold the GIL while stuck, so that
    the watchdog thread cannot run, faulthandler's own thread (no GIL needed) dumps the stacks and
    exits :data:`BACKSTOP_S` later; :func:`hung` recognises both."""

    def __init__(self, progress: Progress):
        self.progress = progress

    @contextlib.contextmanager
    def phase(self, name: str, deadline_s: float, **info: Any):
        self.progress.event("start", name, deadline_s=deadline_s, **info)
        timer = threading.Timer(deadline_s, self._fire, (name, deadline_s))
        timer.daemon = True
        timer.start()
        faulthandler.dump_traceback_later(deadline_s + BACKSTOP_S, exit=True)
        try:
            yield
        finally:
            timer.cancel()
            faulthandler.cancel_dump_traceback_later()
        self.progress.event("done", name)

    def _fire(self, name: str, deadline_s: float) -> None:
        self.progress.event("hang", name, deadline_s=deadline_s)
        print(f"[bcg soak] {name} did not finish within {deadline_s:.0f} s; stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(HANG_EXIT)


_FAULTHANDLER_TIMEOUT = re.compile(r"^Timeout \(\d+:\d\d:\d\d(\.\d+)?\)!$", re.MULTILINE)


def hung(returncode: int | None, log_text: str) -> bool:
    """Whether an engine process ended because a phase outlived its deadline (either way above)."""
    return returncode == HANG_EXIT or (returncode != 0 and bool(_FAULTHANDLER_TIMEOUT.search(log_text)))


# -- lockstep --------------------------------------------------------------------------------------


def replay_sequences(forwards: Sequence[dict]) -> dict[int, list[int]]:
    """Per rank, in order, the token count each replayed forward's bucket was chosen from: the DP
    maximum under DP attention (every DP rank replays the bucket of that maximum), else the rank's
    own count (SGLang's forward records, :mod:`bcg_bench.sglang_timers`)."""
    per_rank: dict[int, list[int]] = {}
    for f in forwards:
        if f.get("graph"):
            across = f.get("across_dp")
            per_rank.setdefault(int(f.get("rank", 0)), []).append(max(across) if across else int(f["tokens"]))
    return per_rank


def lockstep_problem(per_rank: Mapping[int, Any], world: int) -> str | None:
    """Why the ranks did not replay alike (``per_rank``: each rank's replays as a sequence or a
    bucket -> count mapping), or ``None``."""
    if sorted(per_rank) != list(range(world)):
        return f"replays recorded on ranks {sorted(per_rank)}, expected ranks 0..{world - 1}"
    reference = per_rank[0]
    for rank in range(1, world):
        other = per_rank[rank]
        if other == reference:
            continue
        if isinstance(reference, Mapping):
            diff = {b: (reference.get(b, 0), other.get(b, 0)) for b in sorted(set(reference) | set(other), key=str)
                    if reference.get(b, 0) != other.get(b, 0)}
            return f"rank {rank} replayed other buckets than rank 0 (bucket: (rank 0, rank {rank})): {diff}"
        first = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
        return (f"rank {rank} replayed {len(other)} forwards, rank 0 {len(reference)}; first difference at replay "
                f"{first}: rank 0 {list(reference[first:first + 3])}, rank {rank} {list(other[first:first + 3])}")
    return None


def run_in_groups(commands: Sequence[tuple[list[str], Mapping[str, str], Path]],
                  timeout_s: float) -> tuple[list[subprocess.Popen], bool]:
    """Start every command (argv, environment, log file) in a process group of its own, wait for all
    of them under one deadline, then end every group, so the workers an engine process started end
    with it. The finished processes, and whether the deadline passed."""
    from bcg_bench.harness import end_group

    procs = []
    for cmd, env, log in commands:
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, env=dict(env), stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for proc in procs:
        end_group(proc)
        proc.wait()
    return procs, timed_out


def dp_share(count: int, rank: int, size: int) -> list[int]:
    """The requests (indices into a wave of ``count``) that data-parallel rank ``rank`` of ``size``
    serves: round-robin, so a wave of fewer requests than ranks leaves the last ranks idle."""
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in 0..{size - 1}, got {rank}")
    return list(range(rank, count, size))


# -- result file -----------------------------------------------------------------------------------


def summary_path(out: str | None, engine: str, model: str, parallel: Mapping[str, int], stamp: str,
                 tmpdir: str, variant: str = "") -> Path:
    """Where the soak's JSON summary goes: ``BCG_SOAK_OUT`` (a file, or a directory to name the file
    in, like the benchmark results), else a temporary directory. ``variant`` (``torch-compile``)
    names a bcg configuration other than the default."""
    layout = "".join(f"-{k}{v}" for k, v in parallel.items() if v > 1)
    name = f"soak-{engine}{'-' + variant if variant else ''}-{model}{layout}-{stamp}.json"
    if not out:
        return Path(tmpdir) / "bcg-soak" / name
    path = Path(out)
    if out.endswith(("/", os.sep)) or path.is_dir():
        return path / name
    return path
