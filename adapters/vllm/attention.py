"""Attention as bcg's eager break in vLLM: a kernel for ``vllm::unified_attention_with_output``.

vLLM's attention layer calls this op with q, k, v and an ``output`` out-parameter; the op reads
the batch's metadata, KV cache and layer from vLLM's forward context on every call. Registered as
the op's kernel, the wrapper below ends the current graph segment under a bcg capture and re-runs
at every replay; everywhere else (eager forwards, vLLM's own FULL decode capture) it is a plain
call, because bcg breaks only under bcg's own capture.

At capture and replay the wrapper runs the op with the forward context bound as the live batch's
payload. During a replay that is the context vLLM set for this step, so this is a no-op identity
check; it makes "which batch does attention read" a decision of the replay path alone, which is
what the stale-metadata negative control in the GPU tests flips.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bcg_plugin import eager_break, live


def make_attention_break(original: Callable[..., Any]) -> Callable[..., Any]:
    """The break kernel wrapping vLLM's registered ``unified_attention_with_output`` function."""
    import vllm.forward_context as fc

    @eager_break(outputs=("output",))
    def unified_attention_with_output(query, key, value, output, layer_name, output_scale=None,
                                      output_block_scale=None, kv_cache_dummy_dep=None) -> None:
        batch = live.get()
        context = batch.payload if batch is not None else None
        if context is None or context is fc._forward_context:
            original(query, key, value, output, layer_name, output_scale, output_block_scale, kv_cache_dummy_dep)
            return
        with fc.override_forward_context(context):
            original(query, key, value, output, layer_name, output_scale, output_block_scale, kv_cache_dummy_dep)

    return unified_attention_with_output
