"""V2 ``CudaGraphManager.needs_capture``: capture even when vLLM itself has no graphs to capture.

With ``cudagraph_mode=NONE`` (no decode graphs) vLLM skips ``capture()``; bcg still needs it.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches.vllm._patch import Patch


def make(original):
    @functools.wraps(original)
    def needs_capture(self):
        if original(self):
            return True
        from bcg_plugin.adapters.vllm.plugin import runs_bcg
        from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

        return isinstance(self, ModelCudaGraphManager) and runs_bcg(self.vllm_config)

    return needs_capture


PATCH = Patch(
    module="vllm.v1.worker.gpu.cudagraph_utils",
    qualname="CudaGraphManager.needs_capture",
    params=["self"],
    make=make,
    reason="run the capture step for bcg's buckets when vLLM has no graphs of its own",
    remove_when="vLLM exposes a capture hook for external graph runners",
)
