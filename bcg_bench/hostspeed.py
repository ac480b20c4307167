"""How fast the host ran a mode's bench process: a fixed CPU workload timed between its requests.

On a shared or virtualised host one process can run its host-side work (launches, allocator,
Python) a third slower than the next, with the same calls and ops. Small-N latencies are
host-bound, so such a process decides a small-N comparison by itself. The probe makes
that visible in the result file: every mode process times the same pure-Python workload between its
timed requests, on the main thread, which issues them, and records which CPUs that thread ran on.
The report flags a slow process, shows the paired ratios again without the rounds it spoiled, and
``--rerun-slow`` runs it again in its place; targets are read on the paired ratios alone.
"""

from __future__ import annotations

import statistics
import time

PROBE_LOOPS = 20_000  # about 1 ms of pure Python on a current server core: cheap between requests
PROBE_REPEATS = 3  # best of three: a single preemption is not a slow host
SLOW_FACTOR = 1.10  # a process whose median probe is this much above the run's fastest is flagged


def probe_us() -> float:
    """Microseconds this thread takes for the fixed workload, best of ``PROBE_REPEATS``."""
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        acc = 0
        for i in range(PROBE_LOOPS):
            acc += i * i
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def current_cpu() -> int | None:
    """The CPU this process's main thread last ran on, ``None`` where the platform does not say."""
    import psutil

    cpu_num = getattr(psutil.Process(), "cpu_num", None)  # Linux, FreeBSD, SunOS
    return cpu_num() if cpu_num is not None else None


class HostSpeed:
    """The probes one mode process took between its timed requests, and the CPUs it took them on."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.cpus: set[int] = set()

    def sample(self) -> None:
        self.samples.append(probe_us())
        cpu = current_cpu()
        if cpu is not None:
            self.cpus.add(cpu)

    def summary(self) -> dict | None:
        """Median, min and max probe (µs), the sample count and the CPUs seen; ``None`` before any sample."""
        if not self.samples:
            return None
        return {"probe_us": round(statistics.median(self.samples), 1), "min_us": round(min(self.samples), 1),
                "max_us": round(max(self.samples), 1), "samples": len(self.samples), "cpus": sorted(self.cpus)}


def fastest_probe_us(summaries: list[dict | None]) -> float | None:
    """The lowest median probe among ``summaries`` (``host_speed`` entries; ``None`` ones skipped)."""
    return min((s["probe_us"] for s in summaries if s), default=None)


def is_slow(summary: dict | None, fastest: float | None) -> bool:
    """Whether a process's probe median is more than ``SLOW_FACTOR`` above the run's fastest; a
    process without a probe is not called slow."""
    return bool(summary and fastest and summary["probe_us"] / fastest > SLOW_FACTOR)


def markdown(processes: list[tuple[str, int, dict | None]]) -> list[str]:
    """A table of the run's processes in run order, (mode, round, host_speed summary) each; empty
    when no process recorded a probe."""
    probed = [(m, r, s) for m, r, s in processes if s]
    if not probed:
        return []
    fastest = fastest_probe_us([s for *_, s in probed])
    lines = ["## Host speed of each mode process (a fixed Python workload, timed between the timed requests)", "",
             "The same workload on the thread that issues the requests; lower is faster. Host-bound (small-N) "
             "latencies of a process flagged slow say more about the host than about the mode.", "",
             "| process | mode | round | probe µs, median (min-max) | / fastest | CPUs |", "|---|---|---|---|---|---|"]
    slow = []
    for i, (mode, rnd, s) in enumerate(probed, 1):
        factor = s["probe_us"] / fastest
        if is_slow(s, fastest):
            slow.append(f"{mode} (round {rnd})")
        cpus = ",".join(map(str, s.get("cpus") or [])) or "-"
        lines.append(f"| {i} | {mode} | {rnd} | {s['probe_us']:.0f} ({s['min_us']:.0f}-{s['max_us']:.0f}) "
                     f"| {factor:.2f} | {cpus} |")
    lines += ["", f"Slower than {SLOW_FACTOR:.2f}x the fastest: {', '.join(slow)}." if slow
              else f"No process slower than {SLOW_FACTOR:.2f}x the fastest.", ""]
    return lines
