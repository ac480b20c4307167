"""The core's graph pool and bucket capture without a device, for tests that run its capture loop on CPU."""

from __future__ import annotations

import contextlib


class FakePool:
    """:class:`~bcg_plugin.pool.GraphPool`'s surface the runner uses: nothing reserved, allocations
    left where they are, nothing to release."""

    def reserved_bytes(self) -> int:
        return 0

    def allocating(self):
        return contextlib.nullcontext()

    def release(self) -> None:
        pass


def script_captures(runner, capture):
    """Replace ``runner``'s staging and capture of one bucket by ``capture(bucket, stream, warm=,
    variant=)``; the runner's own loop (its votes, retries and drops) names the variant to both."""
    runner._stage_bucket = lambda bucket, variant=None: variant
    runner._capture_bucket = lambda bucket, batch, stream, *, warm=True, variant=None: capture(
        bucket, stream, warm=warm, variant=variant)
