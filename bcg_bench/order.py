"""The order an engine benchmark sends its requests in.

Sizes are interleaved rather than measured one block after another: a host that drifts (clock,
other processes, the engine's own background work) then moves every size's samples alike, instead
of landing on whichever sizes happened to run at the time. Each pass reverses the previous one, so
no size always follows the same neighbour.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence


def interleaved(sizes: Sequence[int], reps: int) -> Iterator[int]:
    """Every size ``reps`` times: one pass over ``sizes`` per repetition, alternating direction."""
    for rep in range(reps):
        yield from (sizes if rep % 2 == 0 else reversed(sizes))
