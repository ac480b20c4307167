"""The stale-graph-metadata fault: a replay whose attention is inside the graph reads metadata of another batch.

Loaded in every engine process with ``BCG_TEST_FAULTS=stale_graph_metadata`` (see
:mod:`bcg_plugin.faults`). After vLLM has landed the step's metadata in its persistent buffers, the
per-request sequence lengths are put back to what the bucket's capture wrote there, so the captured
attention kernels run on the step's queries with the dummy batch's key lengths: in bounds (the capture
sized every grid for the bucket's worst case), wrong for the batch.
"""

from __future__ import annotations

from bcg_plugin.faults import hookimpl


@hookimpl
def bcg_graph_metadata(live, earlier):
    for name, buf in live.items():
        stale = earlier.get(name)
        if stale is not None:
            buf[: stale.shape[0]].copy_(stale)
