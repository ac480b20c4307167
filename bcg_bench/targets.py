"""The engine benchmarks' targets, checked against one result file (ratios within that run only).

The targets are the product's stated targets for the bcg configurations against the engines' own
graph modes. Each target reduces the run to one figure and a limit. A latency target's figure is,
at each size it covers, the median over rounds of the ratio of the two modes' end-to-end latencies
within one round (:mod:`bcg_bench.paired`), and its worst over those sizes; it needs at least
``MIN_PAIRS`` rounds in which both modes measured every size it covers. A scalar target (seconds,
memory) divides the two modes' figures as the result merged them over its rounds. A target whose
modes, sizes or rounds are missing from the run reads "not measured", never "met". The targets are
set for two model shapes on one GPU, the larger also against the weight-read floor: a run of another
model or layout is not checked against them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from bcg_bench import paired


@dataclasses.dataclass(frozen=True)
class Target:
    """One target: what is compared, the limit, and which way the figure must fall."""

    label: str
    limit: float
    figure: Callable[[dict], float | None]  # the run's worst case, or None if not measured
    at_most: bool = True
    subject: str = "bcg"  # the mode the figure is about

    def check(self, modes: dict) -> tuple[float | None, bool | None]:
        value = self.figure(modes)
        if value is None:
            return None, None
        return value, value <= self.limit if self.at_most else value >= self.limit


MIN_PAIRS = 3  # rounds both modes of a latency target must have measured in
SMALL_N = range(513)  # "N <= 512"
FLOOR_MAX_TOKENS = 128  # the sizes whose forward the weight reads bound (a dense model's target)
FLOOR_LIMIT = 1.25  # the forward over its weight-read floor, on the shape whose forward reads weights long enough


def _measured(data: dict) -> set[int]:
    """Every N the mode measured end to end, in any of its rounds."""
    runs = [data] + [r for r in data.get("rounds") or [] if "e2e_ms" in r]
    return {int(n) for r in runs for n in (r.get("e2e_ms") or {})}


def _paired_worst(modes: dict, mode: str, other: str, sizes: range | frozenset | None = None) -> float | None:
    """The largest over the sizes covered of the median over rounds of ``mode``'s e2e over
    ``other``'s in the same round. Sizes covered: every N ``mode`` measured (``sizes`` None), those
    of them in a ``range``, or exactly the N of a ``frozenset``. ``None`` unless at least
    ``MIN_PAIRS`` rounds pair the two modes and every pair has every covered N on both sides."""
    mine, theirs = modes.get(mode), modes.get(other)
    if not mine or not theirs:
        return None
    measured = _measured(mine)
    covered = sizes if isinstance(sizes, frozenset) else {n for n in measured if sizes is None or n in sizes}
    pairs = paired.round_pairs(mine, theirs)
    if not covered or len(pairs) < MIN_PAIRS:
        return None
    ratios = paired.medians(pairs, [str(n) for n in sorted(covered)])
    if any(r is None for r in ratios.values()):
        return None
    return max(ratios.values())


def _scalar_ratio(modes: dict, key: str, mode: str, other: str, positive: bool = False) -> float | None:
    """``mode``'s ``key`` over ``other``'s; ``None`` where either is missing, the divisor is zero,
    or (``positive``) either is zero or negative (a figure the harness could not measure)."""
    a, b = (modes.get(mode) or {}).get(key), (modes.get(other) or {}).get(key)
    if a is None or not b or (positive and (a <= 0 or b <= 0)):
        return None
    return a / b


def weight_bytes_read(data: dict) -> int | None:
    """The bytes of weight the mode's timed forward reads whole: every parameter but the vocabulary
    tables it does not read whole; ``None`` unless the mode recorded its weights and some are left."""
    weights = data.get("weight_bytes")
    read = weights - (data.get("vocab_weight_bytes") or 0) if weights else 0
    return read if read > 0 else None


def weight_floor(data: dict) -> float | None:
    """The mode's weight-read floor in ms: :func:`weight_bytes_read` at the fastest device-copy rate
    the mode's processes measured (the rate pairs with the fastest forwards the run merged); ``None``
    unless the mode measured both."""
    read = weight_bytes_read(data)
    rates = [r.get("copy_bandwidth_gbs") for r in (data, *(data.get("rounds") or []))]
    rate = max((r for r in rates if isinstance(r, (int, float)) and r > 0), default=None)
    if read is None or rate is None:
        return None
    return read / (rate * 1e9) * 1e3


def _over_floor(modes: dict, mode: str) -> float | None:
    """The worst N <= ``FLOOR_MAX_TOKENS`` of ``mode``'s forward (CUDA events, as the run merged its
    rounds) over its weight-read floor; ``None`` where the mode lacks the floor or any such N."""
    data = modes.get(mode) or {}
    floor, forward = weight_floor(data), data.get("forward_ms") or {}
    small = [n for n in _measured(data) if n <= FLOOR_MAX_TOKENS]
    if floor is None or not small or any(forward.get(str(n)) is None for n in small):
        return None
    return max(forward[str(n)] for n in small) / floor


def _per_bucket(modes: dict, mode: str) -> float | None:
    """bcg's own capture seconds in ``mode`` over the buckets it captured (``bcg_capture_s`` and
    ``bcg_buckets``, which results before they were recorded lack); ``capture_s`` also holds the
    host's own graphs."""
    data = modes.get(mode) or {}
    seconds, buckets = data.get("bcg_capture_s"), data.get("bcg_buckets")
    return seconds / buckets if seconds is not None and buckets else None


# The model shapes the targets are set for, on one GPU, by name as the bench knows them; the
# weight-read floor target is set for the larger only (the smaller's forward at a few tokens is
# bound by kernel launches, not by its 1.2 GB of weights).
TARGET_MODELS = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-8b": "Qwen3-8B"}
FLOOR_MODELS = ("qwen3-8b",)
TARGET_GPU = "H200"  # the GPU the limits are set on: a run elsewhere is read against them, and says so

# The vLLM adapter's configurations, each read against every latency and capture target: plain
# ``bcg`` (``torch_compile`` false, the short start), ``bcg_compile`` (what enabling bcg gives at
# vLLM's default -O2: its graphs capture the compiled pieces, whose fused kernels win where the
# forward is GPU-bound, at the compile's start-up cost) and ``bcg_compile_graph`` (the same with
# attention inside the graph in every bucket).
VLLM_CONFIGURATIONS = {"bcg": "torch_compile false", "bcg_compile": "torch_compile, the default under vLLM's -O2",
                       "bcg_compile_graph": "torch_compile, attention inside the graph in every bucket"}


def _vllm_targets(mode: str) -> list[Target]:
    targets = [
        Target(f"{mode} / full (e2e, every N)", 1.0, lambda m: _paired_worst(m, mode, "full"), subject=mode),
        Target(f"{mode} / native (e2e, N <= 512)", 0.9, lambda m: _paired_worst(m, mode, "native", SMALL_N),
               subject=mode),
        Target(f"{mode} / native_ladder (e2e, every N)", 1.0, lambda m: _paired_worst(m, mode, "native_ladder"),
               subject=mode),
        Target(f"{mode} / compile (e2e, N = 1024 and 2048)", 0.6,
               lambda m: _paired_worst(m, mode, "compile", frozenset({1024, 2048})), subject=mode),
        Target(f"{mode} / native_ladder (capture seconds)", 1.0,
               lambda m: _scalar_ratio(m, "capture_s", mode, "native_ladder"), subject=mode),
    ]
    return targets + (_plain_targets(mode) if mode == "bcg" else [])


def _plain_targets(mode: str) -> list[Target]:
    """What bcg without torch.compile owes the host's ``full`` mode: a start no slower, capture fast per
    bucket, and no more graph memory."""
    return [
        Target(f"{mode} / full (init seconds)", 1.0, lambda m: _scalar_ratio(m, "init_s", mode, "full"),
               subject=mode),
        Target(f"{mode} capture seconds per bucket", 0.05, lambda m: _per_bucket(m, mode), subject=mode),
        Target(f"{mode} / full (graph memory)", 1.0,
               lambda m: _scalar_ratio(m, "graph_mem_gib", mode, "full", positive=True), subject=mode),
    ]


# The SGLang adapter's configurations: ``bcg`` (the default, attention ``auto``: inside the graph in
# small buckets where the backend allows it), ``bcg_graph`` (inside the graph in every bucket) and
# ``bcg_one_graph`` (the default without the graph buckets' variants). bcg on SGLang captures the
# model as it is (no torch.compile), so each also answers to the plain-bcg targets.
SGLANG_CONFIGURATIONS = {"bcg": "attention auto, the default", "bcg_graph": "BCG_ATTENTION=graph",
                         "bcg_one_graph": "BCG_GRAPH_VARIANTS=0"}


def _sglang_targets(mode: str) -> list[Target]:
    return [
        Target(f"{mode} / native (e2e, N <= 512)", 0.9, lambda m: _paired_worst(m, mode, "native", SMALL_N),
               subject=mode),
        Target(f"{mode} / native (e2e, every N)", 1.0, lambda m: _paired_worst(m, mode, "native"), subject=mode),
        Target(f"{mode} / full (e2e, every N)", 1.0, lambda m: _paired_worst(m, mode, "full"), subject=mode),
        Target(f"{mode} / native (capture seconds)", 1.0, lambda m: _scalar_ratio(m, "capture_s", mode, "native"),
               subject=mode),
        *_plain_targets(mode),
    ]


def _floor_target(mode: str) -> Target:
    return Target(f"{mode} forward / weight-read floor (N <= {FLOOR_MAX_TOKENS})", FLOOR_LIMIT,
                  lambda m: _over_floor(m, mode), subject=mode)


CONFIGURATIONS: dict[str, dict[str, str]] = {"vllm": VLLM_CONFIGURATIONS, "sglang": SGLANG_CONFIGURATIONS}

_ENGINE_TARGETS = {"vllm": _vllm_targets, "sglang": _sglang_targets}


def targets_for(engine: str, model: str) -> list[Target]:
    """``engine``'s targets for ``model``, each configuration's rows together; none for a model the
    targets are not set for."""
    if engine not in _ENGINE_TARGETS or model not in TARGET_MODELS:
        return []
    floor = model in FLOOR_MODELS
    return [t for mode in CONFIGURATIONS[engine]
            for t in (*_ENGINE_TARGETS[engine](mode), *([_floor_target(mode)] if floor else []))]


FIGURES = (f"Latency figures: the worst N of the median over rounds of per-round paired ratios (at least "
           f"{MIN_PAIRS} rounds); scalar figures: each mode's minimum over rounds (seconds) or its first "
           "complete round (graph memory).")
FLOOR_FIGURE = ("The weight-read floor's figure: the worst N of the forward (each N's fastest round) over the "
                "floor at the fastest copy rate the mode's processes measured.")


def markdown(engine: str, modes: dict, model: str = "qwen3-0.6b", parallel: dict | None = None,
             gpu: str | None = None) -> list[str]:
    """The targets table for a run of ``engine`` (empty if the engine has none).

    A run of a model the targets are not set for, or on several GPUs (``parallel``: sizes by name,
    as in the result file), gets one line saying why it is not checked: a "yes" there would not be
    about the target. A run on another GPU than the one the limits are set on is checked, its
    heading naming both.
    """
    if engine not in _ENGINE_TARGETS:
        return []
    layout = {k: v for k, v in (parallel or {}).items() if v > 1}
    targets = [] if layout else targets_for(engine, model)
    if not targets:
        shape = ", ".join([model] + [f"{k} {v}" for k, v in layout.items()])
        return ["## Targets", "", f"The targets are set for the {' and '.join(TARGET_MODELS)} shapes on one GPU; "
                f"this run ({shape}) is not checked against them.", ""]
    name = TARGET_MODELS[model]
    heading = f"## Targets ({TARGET_GPU}, {name} shape)"
    if gpu and TARGET_GPU not in gpu:
        heading = f"## Targets (set for the {TARGET_GPU} and the {name} shape; this run: {gpu})"
    figures = f"{FIGURES} {FLOOR_FIGURE}" if model in FLOOR_MODELS else FIGURES
    lines = [heading, "", figures, "", "| target | limit | this run | met |",
             "|---|---|---|---|"]
    by_subject: dict[str, list[tuple[Target, bool | None]]] = {}
    for t in targets:
        value, met = t.check(modes)
        by_subject.setdefault(t.subject, []).append((t, met))
        limit = f"{'<=' if t.at_most else '>='} {t.limit:g}"
        shown = "not measured" if value is None else f"{value:.3f}"
        verdict = "-" if met is None else ("yes" if met else "no")
        lines.append(f"| {t.label} | {limit} | {shown} | {verdict} |")
    if len(by_subject) > 1:
        lines += ["", "Each configuration against its own rows:", ""]
        lines += [_subject_summary(subject, rows, CONFIGURATIONS.get(engine, {}).get(subject))
                  for subject, rows in by_subject.items()]
    return lines + [""]


def _subject_summary(subject: str, rows: list[tuple[Target, bool | None]], what: str | None) -> str:
    measured = [(t, met) for t, met in rows if met is not None]
    if not measured:
        return f"- {subject}: not measured"
    missed = [t.label for t, met in measured if not met]
    name = f"{subject} ({what})" if what else subject
    tail = f"; not met: {'; '.join(missed)}" if missed else ""
    unmeasured = len(rows) - len(measured)
    return (f"- {name}: {len(measured) - len(missed)} of {len(measured)} measured targets met"
            + (f" ({unmeasured} not measured)" if unmeasured else "") + tail)
