"""V2 ``CudaGraphManager.needs_capture``: capture even when vLLM itself has no graphs to capture.

With ``cudagraph_mode=NONE`` (no decode graphs) vLLM skips ``capture()``; bcg still needs it.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def make(original, *, runs_bcg):
    @functools.wraps(original)
    def needs_capture(self):
        if original(self):
            return True
        from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

        return isinstance(self, ModelCudaGraphManager) and runs_bcg(self.vllm_config)

    return needs_capture


PATCH = Patch(
    target="vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.needs_capture",
    how=Wrap(params=["self"]),
    make=make,
    reason="V2: run the capture step for bcg's buckets when vLLM has no graphs of its own "
           "(`cudagraph_mode=NONE`)",
    hosts=">=0.26.0,<0.35",
    upstream=NOT_FILED,
    remove_when="vLLM exposes a capture hook for external graph runners",
)
