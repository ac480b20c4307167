"""Kernel of the ``vllm::unified_attention_with_output`` op: attention becomes bcg's eager break.

vLLM calls attention through this custom op; the dispatcher holds the function registered at
import, so the break is installed as the op's kernel for the platform's dispatch key (rebinding the
module attribute would not reach the op). Unapplying registers the original function again.
"""

from __future__ import annotations

from bcg_plugin.patches._patch import NOT_FILED, Patch
from bcg_plugin.patches.vllm._kernel import Kernel

PARAMS = ["query", "key", "value", "output", "layer_name", "output_scale", "output_block_scale",
          "kv_cache_dummy_dep"]


def make(original, *, attention_break):
    return attention_break(original)


PATCH = Patch(
    target="vllm.model_executor.layers.attention.attention.unified_attention_with_output",
    how=Kernel(op="unified_attention_with_output", params=PARAMS),
    make=make,
    reason="vLLM's own attention function as bcg's eager break, reading the forward context vLLM set for the "
           "step; a plain call outside bcg's capture (eager steps, vLLM's FULL decode capture)",
    hosts=">=0.26.0,<0.35",
    upstream=NOT_FILED,
    remove_when="vLLM's attention op is a break for external capture without `VLLM_USE_BREAKABLE_CUDAGRAPH`: its "
                "own `eager_break_during_capture` (on this op in every covered release) breaks only inside vLLM's "
                "`BreakableCUDAGraphCapture`, not in bcg's own capture (which scrubs padded rows at the break "
                "and holds its arguments); retired once that capture context accepts an external recorder",
)
