"""V2 ``CudaGraphManager.dispatch``: send batches vLLM would run eagerly to a bcg bucket.

vLLM's own answer wins first (FULL decode graphs). Otherwise a PIECEWISE descriptor of the bucket
size, without request padding; vLLM's DP synchronisation calls this same method with the synced
token count, so every rank gets the same bucket. Bucket sizes are fixed points (bucket(b) == b).
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def make(original):
    @functools.wraps(original)
    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras):
        desc = original(self, num_reqs, num_tokens, uniform_token_count, num_active_loras)
        graphs = getattr(self, "_bcg_graphs", None)
        if graphs is None or desc.cg_mode.value != 0 or num_tokens <= 0:
            return desc
        bucket = graphs.bucket_for(num_tokens)
        if bucket is None:
            return desc
        from vllm.config.compilation import CUDAGraphMode

        return type(desc)(cg_mode=CUDAGraphMode.PIECEWISE, num_tokens=bucket, num_reqs=None,
                          num_active_loras=desc.num_active_loras)

    return dispatch


PATCH = Patch(
    target="vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.dispatch",
    how=Wrap(params=["self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"]),
    make=make,
    reason="V2: batches vLLM would run eagerly get `PIECEWISE` at the bcg bucket (no request padding); "
           "vLLM's DP sync calls the same method with the synced count",
    hosts="==0.26.0",
    upstream=NOT_FILED,
    remove_when="vLLM dispatches mixed batches to an external prefill-graph runner",
)
