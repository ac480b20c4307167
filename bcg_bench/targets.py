"""The engine benchmarks' targets, checked against one result file (ratios within that run only).

Each target reduces the run to one figure (a worst case over the sizes it covers) and a limit. A
target whose modes or sizes are missing from the run reads "not measured", never "met". The targets
are set for one model on one GPU: a run of another model or layout is not checked against them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Target:
    """One target: what is compared, the limit, and which way the figure must fall."""

    label: str
    limit: float
    figure: Callable[[dict], float | None]  # the run's worst case, or None if not measured
    at_most: bool = True
    group: str = ""  # targets sharing a group: meeting any one of them suffices
    subject: str = "bcg"  # the mode the figure is about

    def check(self, modes: dict) -> tuple[float | None, bool | None]:
        value = self.figure(modes)
        if value is None:
            return None, None
        return value, value <= self.limit if self.at_most else value >= self.limit


def _series(modes: dict, mode: str, key: str = "e2e_ms") -> dict[int, float]:
    return {int(n): v for n, v in (modes.get(mode, {}).get(key) or {}).items()}


def _worst_ratio(modes: dict, mode: str, others: list[str], key: str = "e2e_ms", sizes=None) -> float | None:
    """The largest over N of mode / best of ``others`` at that N; ``None`` unless every one of
    ``others`` was measured at every N the target covers."""
    mine = {n: v for n, v in _series(modes, mode, key).items() if sizes is None or n in sizes}
    theirs = [_series(modes, o, key) for o in others]
    if not mine or any(n not in t for t in theirs for n in mine):
        return None
    return max(mine[n] / min(t[n] for t in theirs) for n in mine)


def _scalar_ratio(modes: dict, key: str, mode: str, other: str) -> float | None:
    a, b = (modes.get(mode) or {}).get(key), (modes.get(other) or {}).get(key)
    return a / b if a is not None and b else None


def _inverse(x: float | None) -> float | None:
    return 1 / x if x else None


TARGET_MODEL = "qwen3-0.6b"  # the model shape the targets are set for, on one GPU

# The vLLM adapter's two configurations, each read against every target: plain ``bcg``
# (``torch_compile`` false, the short start) and ``bcg_compile`` (what enabling bcg gives at vLLM's
# default -O2: its graphs capture the compiled pieces, whose fused kernels win where the forward is
# GPU-bound, at the compile's start-up cost).
VLLM_CONFIGURATIONS = {"bcg": "torch_compile false", "bcg_compile": "torch_compile, the default under vLLM's -O2"}


def _vllm_targets(mode: str) -> list[Target]:
    return [
        Target(f"{mode} / best of native, native_ladder, compile (e2e, every N)", 1.02,
               lambda m: _worst_ratio(m, mode, ["native", "native_ladder", "compile"]), group="every N",
               subject=mode),
        Target(f"{mode} / native (e2e, N = 1024 and 2048)", 0.6,
               lambda m: _worst_ratio(m, mode, ["native"], sizes={1024, 2048}), subject=mode),
        Target(f"eager / {mode} (e2e, N <= 512)", 3.0,
               lambda m: _inverse(_worst_ratio(m, mode, ["eager"], sizes=range(513))), at_most=False, subject=mode),
        Target(f"{mode} / native (capture seconds)", 1.0, lambda m: _scalar_ratio(m, "capture_s", mode, "native"),
               subject=mode),
        Target(f"{mode} / native (graph memory)", 1.0, lambda m: _scalar_ratio(m, "graph_mem_gib", mode, "native"),
               subject=mode),
    ]


CONFIGURATIONS: dict[str, dict[str, str]] = {"vllm": VLLM_CONFIGURATIONS}

TARGETS: dict[str, list[Target]] = {
    "vllm": [t for mode in VLLM_CONFIGURATIONS for t in _vllm_targets(mode)],
    "sglang": [
        Target("bcg / native (e2e, every N)", 1.02, lambda m: _worst_ratio(m, "bcg", ["native"])),
        Target("bcg / native (capture seconds)", 0.75, lambda m: _scalar_ratio(m, "capture_s", "bcg", "native"),
               group="strictly better"),
        Target("bcg / native (graph memory)", 0.75, lambda m: _scalar_ratio(m, "graph_mem_gib", "bcg", "native"),
               group="strictly better"),
        Target("bcg / native (model forward, N <= 512)", 0.95,
               lambda m: _worst_ratio(m, "bcg", ["native"], key="forward_ms", sizes=range(513)),
               group="strictly better"),
    ],
}


def markdown(engine: str, modes: dict, model: str = TARGET_MODEL, parallel: dict | None = None) -> list[str]:
    """The targets table for a run of ``engine`` (empty if the engine has none).

    A run of another model, or on several GPUs (``parallel``: sizes by name, as in the result
    file), gets one line saying why it is not checked: a "yes" there would not be about the target.
    """
    targets = TARGETS.get(engine, [])
    if not targets:
        return []
    layout = {k: v for k, v in (parallel or {}).items() if v > 1}
    if model != TARGET_MODEL or layout:
        shape = ", ".join([model] + [f"{k} {v}" for k, v in layout.items()])
        return ["## Targets", "", f"The targets are set for the {TARGET_MODEL} shape on one GPU; this run ({shape}) "
                "is not checked against them.", ""]
    lines = ["## Targets (H200, Qwen3-0.6B shape)", "", "| target | limit | this run | met |", "|---|---|---|---|"]
    groups: dict[str, list[bool | None]] = {}
    by_subject: dict[str, list[tuple[Target, bool | None]]] = {}
    for t in targets:
        value, met = t.check(modes)
        by_subject.setdefault(t.subject, []).append((t, met))
        limit = f"{'<=' if t.at_most else '>='} {t.limit:g}" + (f" (any one of '{t.group}')" if t.group else "")
        shown = "not measured" if value is None else f"{value:.3f}"
        verdict = "-" if met is None else ("yes" if met else "no")
        lines.append(f"| {t.label} | {limit} | {shown} | {verdict} |")
        if t.group:
            groups.setdefault(t.group, []).append(met)
    for group, verdicts in groups.items():
        state = "met" if any(verdicts) else ("not measured" if all(v is None for v in verdicts) else "not met")
        lines += ["", f"'{group}': {state}."]
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
