"""V1 ``CudagraphDispatcher.dispatch``: the V1 runner's counterpart of the V2 dispatch patch.

Answers PIECEWISE with the bucket where vLLM would run eagerly. On the DP re-dispatch
(``valid_modes={PIECEWISE}``) vLLM asserts the returned size equals its synced padded count, so a
count that is not a bucket comes back unchanged and that step runs eagerly on every rank.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def make(original):
    @functools.wraps(original)
    def dispatch(self, num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0,
                 valid_modes=None, invalid_modes=None):
        graphs = getattr(self, "_bcg_graphs", None)
        if graphs is None:
            return original(self, num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes)
        from vllm.config.compilation import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor

        allowed = set(valid_modes or CUDAGraphMode.valid_runtime_modes()) - set(invalid_modes or ())
        if CUDAGraphMode.PIECEWISE not in allowed or num_tokens <= 0:
            return original(self, num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes)
        if CUDAGraphMode.FULL in allowed:
            mode, desc = original(self, num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes,
                                  invalid_modes | {CUDAGraphMode.PIECEWISE} if invalid_modes else {CUDAGraphMode.PIECEWISE})
            if mode == CUDAGraphMode.FULL:
                return mode, desc
        bucket = graphs.bucket_for(num_tokens)
        if CUDAGraphMode.NONE not in allowed and bucket != num_tokens:
            bucket = num_tokens  # DP re-dispatch at a size vLLM chose: keep it, run it eagerly
        if bucket is None:
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)
        return CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=bucket, num_reqs=None, uniform=False,
                                                        has_lora=has_lora, num_active_loras=num_active_loras)

    return dispatch


PATCH = Patch(
    target="vllm.v1.cudagraph_dispatcher.CudagraphDispatcher.dispatch",
    how=Wrap(params=["self", "num_tokens", "uniform_decode", "has_lora", "num_active_loras", "valid_modes",
            "invalid_modes"]),
    make=make,
    reason="V1: same as the V2 dispatch; answers the DP re-dispatch (`valid_modes={PIECEWISE}`) with "
           "vLLM's size so its assert holds",
    hosts=">=0.26.0,<0.34",
    upstream=NOT_FILED,
    remove_when="vLLM dispatches mixed batches to an external prefill-graph runner",
)
