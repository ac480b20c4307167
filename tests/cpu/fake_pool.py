"""The core's graph pool without a device, for tests that run its capture loop on CPU."""

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
