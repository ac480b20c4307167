"""The stale-metadata fault: every replay reads attention metadata that belongs to another batch.

Loaded in every engine process with ``BCG_TEST_FAULTS=stale_metadata`` (this folder on
``PYTHONPATH``; see :mod:`bcg_plugin.faults`). The metadata the adapter offers is in bounds for the
replay but wrong for its batch (vLLM: the forward context the bucket was captured with; SGLang: the
previous replay's batch of the same token count), so the outputs are wrong while nothing crashes:
the engine tests' correctness check must catch it.
"""

from __future__ import annotations

from bcg_plugin.faults import hookimpl


@hookimpl
def bcg_replay_metadata(earlier):
    return earlier
