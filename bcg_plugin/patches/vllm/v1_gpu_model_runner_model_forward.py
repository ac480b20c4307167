"""V1 ``GPUModelRunner._model_forward``: replay the bcg bucket for PIECEWISE steps.

vLLM documents this method as the override point for model execution. Only steps the dispatch
patch sent to a bucket (runtime mode PIECEWISE) replay; everything else calls the original.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def make(original):
    @functools.wraps(original)
    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        graphs = getattr(self, "_bcg_graphs", None)
        if graphs is not None:
            from vllm.config.compilation import CUDAGraphMode
            from vllm.forward_context import get_forward_context

            if get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE:
                return graphs.forward(self.model, {
                    "input_ids": input_ids, "positions": positions, "intermediate_tensors": intermediate_tensors,
                    "inputs_embeds": inputs_embeds, **model_kwargs,
                })
        return original(self, input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs)

    return _model_forward


PATCH = Patch(
    target="vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward",
    how=Wrap(params=["self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs"]),
    make=make,
    reason="V1: replay the dispatched bucket for `PIECEWISE` steps",
    hosts=">=0.26.0,<0.34",
    upstream=NOT_FILED,
    remove_when="vLLM exposes a forward hook for external graph runners",
)
