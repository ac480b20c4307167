"""V2 ``CudaGraphManager.dispatch``: send batches vLLM would run eagerly to a bcg bucket.

vLLM's own answer wins first (FULL decode graphs). Otherwise a descriptor of the bucket size:
PIECEWISE without request padding where attention breaks, so vLLM builds the step's metadata for
the live batch and bcg's forward runs inside its forward context; FULL with the bucket's request
count where bcg captured attention inside the graph, so vLLM lands the step's metadata into its
persistent FULL-mode buffers, padded to that count, as for its own FULL graphs, and hands the
replay to ``ModelCudaGraphManager.run_fullgraph``. The step's request count goes to bcg's bucket
choice with its token count: a step of one-token requests does not match the FA3 launch a
graph-attention bucket captured, and keeps vLLM's answer. vLLM's DP synchronisation calls this same
method with the synced token count, so every rank gets the same bucket and mode. Bucket sizes are fixed
points (bucket(b) == b).
A microbatched dispatch (``num_ubatches > 1``, dual-batch overlap) keeps vLLM's answer: bcg's graphs
are not split into microbatches.

The method gained ``max_query_len`` (0.28) and ``num_ubatches`` (0.30), both passed by keyword by
vLLM's callers: one wrapper per signature, the bucket choice shared.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap

BASE = ["self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"]


def _bucketed(self, desc, num_reqs, num_tokens):
    graphs = getattr(self, "_bcg_graphs", None)
    if graphs is None or desc.cg_mode.value != 0 or num_tokens <= 0 or getattr(desc, "num_ubatches", 1) != 1:
        return desc
    bucket = graphs.bucket_for(num_tokens, num_reqs)
    if bucket is None:
        return desc
    from vllm.config.compilation import CUDAGraphMode

    requests = graphs.graph_requests(bucket)  # None: attention breaks in this bucket
    mode = CUDAGraphMode.PIECEWISE if requests is None else CUDAGraphMode.FULL
    return type(desc)(cg_mode=mode, num_tokens=bucket, num_reqs=requests, num_active_loras=desc.num_active_loras)


def make(original):
    @functools.wraps(original)
    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras):
        return _bucketed(self, original(self, num_reqs, num_tokens, uniform_token_count, num_active_loras),
                         num_reqs, num_tokens)

    return dispatch


def make_max_query_len(original):
    @functools.wraps(original)
    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len=None):
        return _bucketed(self, original(self, num_reqs, num_tokens, uniform_token_count, num_active_loras,
                                        max_query_len), num_reqs, num_tokens)

    return dispatch


def make_ubatches(original):
    @functools.wraps(original)
    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len=None,
                 num_ubatches=1):
        return _bucketed(self, original(self, num_reqs, num_tokens, uniform_token_count, num_active_loras,
                                        max_query_len, num_ubatches), num_reqs, num_tokens)

    return dispatch


TARGET = "vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.dispatch"
REASON = ("V2: batches vLLM would run eagerly get the bcg bucket: `PIECEWISE` (no request padding) where "
          "attention breaks, `FULL` with the bucket's request count where it is captured inside the graph "
          "(vLLM then lands the step's metadata in its FULL-mode buffers); vLLM's DP sync calls the same "
          "method with the synced count")
REMOVE_WHEN = "vLLM dispatches mixed batches to an external prefill-graph runner"

PATCHES = (
    Patch(target=TARGET, how=Wrap(params=BASE), make=make, reason=REASON, hosts=">=0.26.0,<0.28",
          upstream=NOT_FILED, remove_when=REMOVE_WHEN),
    Patch(target=TARGET, how=Wrap(params=[*BASE, "max_query_len"]), make=make_max_query_len,
          reason=REASON + " (`max_query_len` passed through: it only narrows vLLM's varlen decode graphs)",
          hosts=">=0.28,<0.30", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
    Patch(target=TARGET, how=Wrap(params=[*BASE, "max_query_len", "num_ubatches"]), make=make_ubatches,
          reason=REASON + "; a microbatched dispatch (`num_ubatches > 1`, FULL graphs only) keeps vLLM's answer",
          hosts=">=0.30,<0.35", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
)
