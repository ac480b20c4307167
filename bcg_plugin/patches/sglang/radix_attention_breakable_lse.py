"""``radix_attention.breakable_unified_attention_with_output_and_lse``: refused under bcg capture.

The LSE variant returns a CUDA tensor (chunked-prefix MHA); bcg's breaks write out-parameters
only. Models that reach it are kept off bcg by the eligibility check; this hook turns any that
slips through into a capture failure (eager on every rank) instead of attention baked into a graph.
"""

from __future__ import annotations

from bcg_plugin.patches.sglang._op_signature import check_op
from bcg_plugin.patches.sglang.base import Patch

TARGET = "sglang.srt.layers.radix_attention.breakable_unified_attention_with_output_and_lse"


def around_breakable_attention_lse(original_fn, *args, **kwargs):
    from bcg_plugin.adapters.sglang import attention

    if attention.capturing():
        attention.refuse("attention returning log-sum-exp (chunked-prefix MHA)")
    return original_fn(*args, **kwargs)


PATCH = Patch(
    target=TARGET,
    kind="AROUND",
    hook=around_breakable_attention_lse,
    check=check_op(TARGET, "unified_attention_with_output_and_lse", ("query", "output", "layer_id")),
    reason="fail bcg capture loudly for attention bcg cannot break (returns a CUDA tensor)",
    versions=">=0.5.17,<0.5.18",
    remove_when="bcg supports breaks with tensor results, or SGLang drops the LSE break",
)
