"""V2 ``CudaGraphManager.run_pw_graph``: replay the bcg bucket vLLM's dispatch chose.

``execute_model`` calls it for every PIECEWISE step inside the live forward context, with inputs
already padded to the bucket in vLLM's persistent buffers.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def make(original):
    @functools.wraps(original)
    def run_pw_graph(self, model, model_inputs):
        graphs = getattr(self, "_bcg_graphs", None)
        if graphs is None:
            return original(self, model, model_inputs)
        return graphs.forward(model, model_inputs)

    return run_pw_graph


PATCH = Patch(
    target="vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.run_pw_graph",
    how=Wrap(params=["self", "model", "model_inputs"]),
    make=make,
    reason="V2: replay the dispatched bucket inside the live forward context; the original's own "
           "breakable runner (`VLLM_USE_BREAKABLE_CUDAGRAPH`, from 0.27) is never reached while bcg runs: bcg "
           "keeps that switch off (see `VllmConfig.__post_init__`)",
    hosts=">=0.26.0,<0.35",
    upstream=NOT_FILED,
    remove_when="vLLM exposes a forward hook for external graph runners. The nearest seam, the manager's "
                "`breakable_cg_runner` that `run_pw_graph` calls when `use_breakable_cg` (from 0.27; "
                "`BreakableCUDAGraphWrapper(runtime_mode=)` 0.30, `key_fn` 0.33), is not used: it is set only "
                "with `VLLM_USE_BREAKABLE_CUDAGRAPH=1` and a piecewise `cudagraph_mode`, which also switch vLLM's "
                "own piecewise capture and compilation; this wrap retires when that slot takes an external "
                "runner on its own switch",
)
