"""Token-count buckets: which padded sizes get a graph, and which one a forward replays."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from bcg_plugin.errors import BcgConfigError

PREFILL_BUCKET_FLOOR = 16  # smallest bucket and smallest step: below it launches, not rows, dominate
PREFILL_BUCKET_STEP_DIVISOR = 8  # step <= size/8 keeps the padded tail <= ~12.5%
PREFILL_BUCKET_MAX_STEP = 512  # caps the step (and so the worst absolute padding) on long chunks


def bucket_step(size: int) -> int:
    """The ladder's step above ``size``: largest power of two <= size/8, within [floor, max step]."""
    target = max(size // PREFILL_BUCKET_STEP_DIVISOR, 1)
    step = 1 << (target.bit_length() - 1)
    return min(max(step, PREFILL_BUCKET_FLOOR), PREFILL_BUCKET_MAX_STEP)


def reference_ladder(max_tokens: int) -> list[int]:
    """The reference ladder up to ``max_tokens`` (its top clamped to exactly ``max_tokens``).

    2048 -> 40 buckets, 8192 -> 56 buckets; any N <= max_tokens pads by at most ~12.5% (16 tokens
    below 128).
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BcgConfigError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    sizes = []
    size = PREFILL_BUCKET_FLOOR
    while size < max_tokens:
        sizes.append(size)
        size += bucket_step(size)
    sizes.append(max_tokens)
    return sizes


def resolve_buckets(max_tokens: int, sizes: Iterable[int] | None = None) -> list[int]:
    """Explicit ``sizes`` (validated against ``max_tokens``) or the reference ladder, ascending."""
    if sizes is None:
        return reference_ladder(max_tokens)
    out = sorted(set(int(s) for s in sizes))
    if not out or out[0] < 1:
        raise BcgConfigError(f"sizes must be positive integers, got {list(sizes)!r}")
    if out[-1] > max_tokens:
        raise BcgConfigError(
            f"sizes {[s for s in out if s > max_tokens]} exceed max_tokens={max_tokens}, the top bucket (no "
            "host step runs more tokens: its chunk size, or what one step can hold if less, caps max_tokens); "
            "drop them, or raise max_tokens if it was set below that"
        )
    return out


def buckets_multiple_of(buckets: Sequence[int], multiple: int, max_tokens: int) -> list[int]:
    """``buckets`` each rounded up to a multiple of ``multiple``, for hosts that split a step's rows
    into equal shards; one above ``max_tokens`` becomes the largest multiple within it (a step padded
    past that runs eagerly, as above any top bucket), and none is left where ``max_tokens`` holds no
    multiple."""
    top = max_tokens - max_tokens % multiple
    rounded = {min(-(-b // multiple) * multiple, top) for b in buckets}
    return sorted(b for b in rounded if b > 0)


def sharded_buckets(max_tokens: int, sizes: Iterable[int] | None, multiple: int) -> list[int] | None:
    """The buckets (``sizes``, or the reference ladder) of a host that splits every step's rows into
    ``multiple`` equal shards, each rounded as :func:`buckets_multiple_of` rounds it; ``None`` where
    ``multiple`` is 1: the buckets stand as they are."""
    if multiple == 1:
        return None
    rounded = buckets_multiple_of(resolve_buckets(max_tokens, sizes), multiple, max_tokens)
    if not rounded:
        raise BcgConfigError(f"max_tokens={max_tokens} holds no bucket: the host splits each step into {multiple} "
                             f"equal shards, so a bucket is a multiple of {multiple}; raise max_tokens to at least "
                             f"{multiple}, or set it to 0 to disable prefill graphs")
    return rounded


def choose_bucket(buckets: Sequence[int], num_tokens: int) -> int | None:
    """Smallest bucket >= ``num_tokens`` (``buckets`` ascending); ``None`` above the top: eager."""
    if num_tokens < 1:
        return None
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None


def ladder_top(chunk: int, max_requests: int, context_len: int) -> int:
    """The most tokens one host step can schedule, and so the top bucket: the host's chunk (its
    most tokens per step), or ``max_requests`` x ``context_len`` where that is less.

    A request extends by at most its context length in a step and a step holds at most the host's
    request limit, whatever the chunk says (hosts accept a larger chunk with a warning at most).
    Buckets above the product would never replay, and their capture batches (as few requests as the
    bucket needs, each at most a context long) would hold more requests, or address more blocks,
    than the host sized its per-request state for: the capture of the top bucket failed there
    (SGLang) or read past the block table (vLLM's V2 runner, an illegal memory access).
    """
    return min(int(chunk), int(max_requests) * int(context_len))


def ladder_top_note(chunk: int, max_requests: int, context_len: int, names: tuple[str, str, str]) -> str | None:
    """The log line saying the request limit, not the chunk, sets the top bucket (``None`` when the
    chunk does). ``names``: what the host calls its chunk, request limit and context length."""
    top = ladder_top(chunk, max_requests, context_len)
    if top >= chunk:
        return None
    chunk_name, requests_name, context_name = names
    return (f"bcg: prefill graphs up to {top} tokens, what {max_requests} requests ({requests_name}) of "
            f"{context_len} tokens ({context_name}) hold; {chunk_name} ({chunk}) is more than a step can schedule")


def padding_allows(bucket: int, num_tokens: int, max_padding_ratio: float | None) -> bool:
    """Whether ``num_tokens`` may replay padded to ``bucket``: ``bucket <= ratio * num_tokens``
    (``None``: always); above it the padded tail costs more than the launches a graph saves."""
    return max_padding_ratio is None or bucket <= max_padding_ratio * num_tokens
