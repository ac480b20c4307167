"""The stale-graph-metadata fault: a replay's graph reads batch metadata of another batch.

Loaded in every engine process with ``BCG_TEST_FAULTS=stale_graph_metadata`` (see
:mod:`bcg_plugin.faults`). Once the host has landed the step's metadata where the graph reads it,
it is put back to what the bucket's capture put there. vLLM, attention inside the graph: the
per-request sequence lengths, so the captured attention kernels run on the step's queries with the
dummy batch's key lengths (in bounds: the capture sized every grid for the bucket's worst case).
SGLang, the KV-cache store inside the graph: the cache slots, all SGLang's padding slot, so the
step's keys and values never reach the cache and whatever reads them later (the next chunk, a
prefix hit, decode) reads other data.
"""

from __future__ import annotations

from bcg_plugin.faults import hookimpl


@hookimpl
def bcg_graph_metadata(live, earlier):
    for name, buf in live.items():
        stale = earlier.get(name)
        if stale is not None:
            buf[: stale.shape[0]].copy_(stale)
