"""V2 ``ModelCudaGraphManager.capture``: capture bcg's buckets, then vLLM's own (FULL decode) graphs.

Its arguments are everything a dummy batch needs (model state, persistent input buffers, block
tables, attention groups). bcg goes first: its largest bucket must fit before vLLM locks
workspaces, and its private pool never shares blocks with the decode graphs' pool.

From 0.29 vLLM also runs this method while it profiles graph memory, on a minimal KV cache it tears
down afterwards (the manager flags it with ``_capture_mem_samples``): there bcg samples a few buckets
and releases them, and the profile patch (``v2_gpu_model_runner_profile_cudagraph_memory``) adds
their extrapolated estimate to vLLM's, which sizes the KV cache.

The descriptors differ by what the method takes (``pcp_manager`` from 0.29, no ``has_lora`` from
0.34) and by the vLLM functions bcg's dummy batches call, verified with it: ``prepare_inputs_to_capture``
(its trailing parameters change in 0.27, 0.28, 0.29 and 0.34) and ``graph_capture`` (no caller-chosen
stream context from 0.31, an optional stream again from 0.34).
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


def make_pcp(original, *, capture_v2):
    @functools.wraps(original)
    def capture(self, model, model_state, input_buffers, intermediate_tensors, block_tables, attn_groups,
                kv_cache_config, pcp_manager=None, *args, **kwargs):
        self._bcg_graphs = capture_v2(self, model, model_state, input_buffers, block_tables, attn_groups,
                                      kv_cache_config, pcp_manager=pcp_manager)
        return original(self, model, model_state, input_buffers, intermediate_tensors, block_tables,
                        attn_groups, kv_cache_config, pcp_manager, *args, **kwargs)

    return capture


TARGET = "vllm.v1.worker.gpu.cudagraph_utils.ModelCudaGraphManager.capture"
PARAMS = ["self", "model", "model_state", "input_buffers", "intermediate_tensors", "block_tables", "attn_groups",
          "kv_cache_config"]
TAIL = ["has_lora", "use_aux_hidden_state_outputs", "lora_capture_hook", "progress_bar_desc"]
PREPARE = "vllm.v1.worker.gpu.cudagraph_utils.prepare_inputs_to_capture"
PREPARE_PARAMS = ["num_reqs", "num_tokens", "model_state", "input_buffers", "block_tables", "attn_groups",
                  "kv_cache_config"]
GRAPH_CAPTURE = "vllm.distributed.parallel_state.graph_capture"
FORWARD_CONTEXT = ("vllm.forward_context.set_forward_context",
                   ["attn_metadata", "vllm_config", "num_tokens", "num_tokens_across_dp", "cudagraph_runtime_mode",
                    "batch_descriptor", "ubatch_slices", "slot_mapping", "skip_compiled", "is_padding"])
REASON = ("V2: capture bcg's buckets (dummy batches from the runner's own helpers) before vLLM's FULL "
          "decode graphs")
REMOVE_WHEN = "vLLM exposes a capture hook for external graph runners"


def _how(params, prepare_tail, graph_capture):
    return Wrap(params=params, uses={PREPARE: [*PREPARE_PARAMS, *prepare_tail], GRAPH_CAPTURE: graph_capture,
                                     FORWARD_CONTEXT[0]: FORWARD_CONTEXT[1]})


_STREAM = ["device", "graph_capture_context"]
PATCHES = (
    Patch(target=TARGET, how=_how([*PARAMS, *TAIL], ["skip_attn"], _STREAM), make=make, reason=REASON,
          hosts=">=0.26.0,<0.27", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
    Patch(target=TARGET, how=_how([*PARAMS, *TAIL], ["full_cudagraph"], _STREAM), make=make,
          reason=REASON + " (dummy batches with `full_cudagraph=False`: piecewise metadata)",
          hosts=">=0.27,<0.28", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
    Patch(target=TARGET, how=_how([*PARAMS, *TAIL], ["full_cudagraph", "max_query_len"], _STREAM), make=make,
          reason=REASON + " (dummy batches with `full_cudagraph=False`: piecewise metadata)",
          hosts=">=0.28,<0.29", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
    Patch(target=TARGET, how=_how([*PARAMS, "pcp_manager", *TAIL], ["full_cudagraph", "max_query_len", "pcp_manager"],
                                  _STREAM), make=make_pcp,
          reason=REASON + "; also runs inside vLLM's graph-memory profiling (bcg samples its buckets there "
                          "for the profile patch's estimate); with prefill context parallelism (`pcp_manager`) bcg declines",
          hosts=">=0.29,<0.31", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
    Patch(target=TARGET, how=_how([*PARAMS, "pcp_manager", *TAIL], ["full_cudagraph", "max_query_len", "pcp_manager"],
                                  ["device"]), make=make_pcp,
          reason=REASON + "; also runs inside vLLM's graph-memory profiling (bcg samples its buckets there "
                          "for the profile patch's estimate); with prefill context parallelism (`pcp_manager`) bcg declines. Captured on "
                          "`graph_capture`'s own stream (no caller-chosen stream from 0.31). Not through vLLM's "
                          "`capture_pool` (0.32): under sleep mode it routes captures into vLLM's one cuMem graph "
                          "pool, shared with the decode graphs, which bcg's private pool exists to keep apart; "
                          "bcg's graphs are therefore not offloaded by sleep mode",
          hosts=">=0.31,<0.34", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
    Patch(target=TARGET, how=_how([*PARAMS, "pcp_manager", *TAIL[1:]],
                                  ["full_cudagraph", "max_query_len", "pcp_manager", "slot_mappings_buffer"],
                                  ["device", "stream"]), make=make_pcp,
          reason=REASON + " as from 0.31 (without `has_lora`, which vLLM dropped); captured on `graph_capture`'s "
                          "own stream, not the `capture_stream` vLLM's graphs leave for the graphs they replay in "
                          "their breaks: bcg's graphs keep their private pool",
          hosts=">=0.34,<0.35", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
)
