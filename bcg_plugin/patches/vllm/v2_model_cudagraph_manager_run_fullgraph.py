"""V2 ``ModelCudaGraphManager.run_fullgraph``: replay a bcg bucket whose attention is inside the graph.

vLLM calls it for a FULL descriptor once it has landed the step's inputs and attention metadata in
its persistent buffers. Only a descriptor bcg's dispatch gives out (a bucket with attention inside
bcg's graph, padded to that bucket's request count, never one of vLLM's own graphs) goes to bcg;
any other, its FULL decode graphs included, to the original. vLLM's offloader is synchronised first,
as the original does before any FULL replay: its prefetch copies must land before a graph reads them.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def _bcg_shape(desc) -> bool:
    """Whether ``desc`` has the shape bcg's dispatch gives out: a mixed batch, neither a uniform nor a
    varlen decode (whose token and request counts can equal a bcg bucket's), in one microbatch."""
    return (getattr(desc, "uniform_token_count", None) is None and getattr(desc, "max_query_len", None) is None
            and getattr(desc, "num_ubatches", 1) == 1)


def make(original):
    @functools.wraps(original)
    def run_fullgraph(self, desc):
        graphs = getattr(self, "_bcg_graphs", None)
        requests = None
        if graphs is not None and desc not in self.graphs and _bcg_shape(desc):
            requests = graphs.graph_requests(desc.num_tokens)
        if requests is None or requests != desc.num_reqs:
            return original(self, desc)
        from vllm.model_executor.offloader.base import get_offloader

        get_offloader().sync_prev_onload()
        return graphs.forward_full(desc.num_tokens)

    return run_fullgraph


PATCH = Patch(
    target="vllm.v1.worker.gpu.cudagraph_utils.ModelCudaGraphManager.run_fullgraph",
    how=Wrap(params=["self", "desc"]),
    make=make,
    reason="V2: a FULL descriptor of a bcg bucket with attention captured inside the graph replays bcg's "
           "graph, which reads vLLM's persistent input and FULL-mode metadata buffers in place",
    hosts=">=0.26.0,<0.35",
    upstream=NOT_FILED,
    remove_when="vLLM's graph manager takes externally captured graphs for its FULL descriptors",
)
