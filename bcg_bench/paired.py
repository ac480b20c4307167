"""Two modes' end-to-end latencies paired by round.

Each round of a run starts every mode once, in alternating order, so a host that drifts over the run
moves both sides of a pair alike: the median over rounds of the ratio within each round reads the
modes rather than which of their processes landed on a fast host, which the per-N minimum over
rounds does not. The report's paired tables (:mod:`bcg_bench.harness`) and the latency targets
(:mod:`bcg_bench.targets`) both read these.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def round_pairs(mine: dict, other: dict) -> list[tuple[dict, dict]]:
    """Round i of ``mine`` with round i of ``other`` (each a mode's merged figures, whose ``rounds``
    list every round in run order), over the rounds in which both measured end-to-end latencies."""
    return [(a, b) for a, b in zip(mine.get("rounds") or [], other.get("rounds") or [])
            if "e2e_ms" in a and "e2e_ms" in b]


def medians(pairs: list[tuple[dict, dict]], sizes: Iterable[str]) -> dict[str, float | None]:
    """Per N (a string, as the result file keys it), the median over ``pairs`` of the first round's
    e2e over the second's; ``None`` at an N some pair lacks on either side (or with no pair)."""
    return {n: statistics.median(a["e2e_ms"][n] / b["e2e_ms"][n] for a, b in pairs)
            if pairs and all(n in a["e2e_ms"] and n in b["e2e_ms"] for a, b in pairs) else None
            for n in sizes}
