"""V2 ``CudaGraphManager.run_pw_graph``: replay the bcg bucket vLLM's dispatch chose.

``execute_model`` calls it for every PIECEWISE step inside the live forward context, with inputs
already padded to the bucket in vLLM's persistent buffers.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches.vllm._patch import Patch


def make(original):
    @functools.wraps(original)
    def run_pw_graph(self, model, model_inputs):
        graphs = getattr(self, "_bcg_graphs", None)
        if graphs is None:
            return original(self, model, model_inputs)
        return graphs.forward(model, model_inputs)

    return run_pw_graph


PATCH = Patch(
    module="vllm.v1.worker.gpu.cudagraph_utils",
    qualname="CudaGraphManager.run_pw_graph",
    params=["self", "model", "model_inputs"],
    make=make,
    reason="replay bcg's segmented graph for PIECEWISE-dispatched steps",
    remove_when="vLLM exposes a forward hook for external graph runners",
)
