"""V2 ``ModelCudaGraphManager.capture``: capture bcg's buckets, then vLLM's own (FULL decode) graphs.

Its arguments are everything a dummy batch needs (model state, persistent input buffers, block
tables, attention groups). bcg goes first: its largest bucket must fit before vLLM locks
workspaces, and its private pool never shares blocks with the decode graphs' pool.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def make(original, *, capture_v2):
    @functools.wraps(original)
    def capture(self, model, model_state, input_buffers, intermediate_tensors, block_tables, attn_groups,
                kv_cache_config, *args, **kwargs):
        self._bcg_graphs = capture_v2(self, model, model_state, input_buffers, block_tables, attn_groups,
                                      kv_cache_config)
        return original(self, model, model_state, input_buffers, intermediate_tensors, block_tables,
                        attn_groups, kv_cache_config, *args, **kwargs)

    return capture


PATCH = Patch(
    target="vllm.v1.worker.gpu.cudagraph_utils.ModelCudaGraphManager.capture",
    how=Wrap(params=["self", "model", "model_state", "input_buffers", "intermediate_tensors", "block_tables",
            "attn_groups", "kv_cache_config", "has_lora", "use_aux_hidden_state_outputs",
            "lora_capture_hook", "progress_bar_desc"]),
    make=make,
    reason="V2: capture bcg's buckets (dummy batches from the runner's own helpers) before vLLM's FULL "
           "decode graphs",
    hosts="==0.26.0",
    upstream=NOT_FILED,
    remove_when="vLLM exposes a capture hook for external graph runners",
)
