"""Padded rows, scrubbed inside the graphs: a device flag per row that every bucket's graph reads.

Eager breaks leave the padded rows of their outputs as whatever the pool's memory held, and the next
segment must not read garbage there (pitfall 6). A zero kernel per break, launched from the host at
every padded replay, costs a launch per break; here instead the segment after each break starts by
zeroing the flagged rows of the break's outputs, replayed with the graph, and a replay updates the
flags in one launch, or none when its padding is the one the flags already hold.

The graph only covers the rows a bucket pads when the host picks the smallest bucket that fits:
``[start, bucket)``, ``start`` being the next smaller bucket. A batch with fewer rows still (a
data-parallel rank padded to its peers' bucket) has its rows ``[num_tokens, start)`` zeroed by the
breaks themselves, as before. A bucket whose attention is captured inline has no eager step left to
do that, so its graph covers all its rows, ``[0, bucket)``, with flags of its own, for the breaks
that still run eagerly there (and in its variant with attention breaking, which reads the same
flags); the inline attention itself is not followed by a scrub
(:mod:`bcg_plugin.breaks` says why). A bucket of :data:`BREAKS_ZERO_FROM_TOKENS` rows or more whose
attention breaks scrubs no row in its graph: its breaks zero its padded rows themselves.
"""

from __future__ import annotations

import torch

from bcg_plugin.errors import BcgStateError

# Buckets from this many rows up leave their padded rows to the breaks. Their forward is GPU-bound
# (Qwen3-0.6B on an H200, vLLM and SGLang's triton and flashinfer: 6.6-9.0 ms of device time to
# 2.6-4.5 ms of host time a forward at 2048 tokens), so a padded replay's zero launches hide behind
# device work, while a scrub in the graph costs device time on every replay, of batches that fill
# the bucket too (1.3% of it at 2048 tokens, 0.6% at 8192: docs/benchmarks.md, "Padded rows").
# Below it the forward is host-bound and the scrub in the graph is the cheaper.
BREAKS_ZERO_FROM_TOKENS = 2048


class RowScrub:
    """One bucket's scrub as its capture records it: zero the flagged rows in ``[start, stop)``.

    ``recorded``: how many times the capture recorded it (once per break with declared outputs
    that ran eagerly); zero where every break of the bucket was captured inline, or where the range
    is empty (its breaks zero every padded row), whose replays then have no flags to set.
    """

    __slots__ = ("start", "stop", "_padded", "recorded")

    def __init__(self, start: int, stop: int, padded: torch.Tensor) -> None:
        self.start, self.stop, self._padded = start, stop, padded
        self.recorded = 0

    def apply(self, out: torch.Tensor, name: str) -> None:
        """Captured into the segment after a break: its output ``out``'s padded rows become zeros."""
        if out.shape[0] != self.stop:
            raise BcgStateError(
                f"eager break output {name!r} has {out.shape[0]} rows in the capture of the {self.stop}-token "
                f"bucket; a declared output must have one row per token of the bucket"
            )
        if self.start == self.stop:
            return
        self.recorded += 1
        mask = self._padded.view(-1, *([1] * (out.dim() - 1)))
        out[self.start : self.stop].masked_fill_(mask, 0)  # masked_fill, not a multiply: garbage may be NaN


class PaddedRows:
    """The per-row flags every bucket's graph reads, and the rows each bucket's graph scrubs.

    Buckets' scrubbed ranges ``[start, bucket)`` do not overlap (each starts at or above the next
    smaller bucket), so each bucket owns its part of the flags and remembers the row count it last
    flagged for. ``whole``: buckets whose graph scrubs every row (no eager break is left to zero the
    rows below ``start``); each has flags of its own. Any other bucket of
    :data:`BREAKS_ZERO_FROM_TOKENS` rows or more scrubs none: its range is empty (``start == bucket``).
    """

    def __init__(self, buckets: list[int], device: torch.device, whole: frozenset[int] = frozenset()) -> None:
        top = buckets[-1]
        self._padded = torch.zeros(top, dtype=torch.bool, device=device)
        self._rows = torch.arange(top, dtype=torch.int32, device=device)
        self._start = {b: 0 if b in whole else b if b >= BREAKS_ZERO_FROM_TOKENS else s
                       for b, s in zip(buckets, [0, *buckets[:-1]])}
        self._flags = {b: torch.zeros(b, dtype=torch.bool, device=device) if b in whole else self._padded[self._start[b]:b]
                       for b in buckets}
        self._flagged_for = {bucket: bucket for bucket in buckets}  # all zeros: no row padded
        # The scrubs each bucket's captures recorded: its own graph's and its variants', which read
        # the same flags (a variant with attention breaking scrubs where the bucket's own graph does not).
        self._scrubs: dict[int, list[RowScrub]] = {}

    def start(self, bucket: int) -> int:
        """First row of ``bucket`` that its graph scrubs; the breaks zero padded rows below it."""
        return self._start[bucket]

    def scrub(self, bucket: int) -> RowScrub:
        """What a capture of ``bucket`` (its own graph or a variant) records after each break (where
        the range is empty, only the check of the break's output rows)."""
        scrub = RowScrub(self._start[bucket], bucket, self._flags[bucket])
        self._scrubs.setdefault(bucket, []).append(scrub)
        return scrub

    def flag(self, bucket: int, num_tokens: int) -> None:
        """Flag rows ``num_tokens`` and up of ``bucket``'s range as padding, before its replay
        (nothing to launch where none of its graphs reads a flag, or they already read these)."""
        scrubs = self._scrubs.get(bucket)
        if (self._start[bucket] == bucket or self._flagged_for[bucket] == num_tokens
                or (scrubs and not any(scrub.recorded for scrub in scrubs))):
            return
        torch.ge(self._rows[self._start[bucket]:bucket], num_tokens, out=self._flags[bucket])
        self._flagged_for[bucket] = num_tokens
