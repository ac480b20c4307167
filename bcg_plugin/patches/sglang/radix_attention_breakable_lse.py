"""``radix_attention.breakable_unified_attention_with_output_and_lse``: refused under bcg capture.

The LSE variant returns a CUDA tensor (chunked-prefix MHA); bcg's breaks write out-parameters
only. Models that reach it are kept off bcg by the eligibility check; this hook turns any that
slips through into a capture failure (eager on every rank) instead of attention baked into a graph.
"""

from __future__ import annotations

from bcg_plugin.patches._patch import NOT_FILED, Patch
from bcg_plugin.patches.sglang._hook import Hook, refusing_hook
from bcg_plugin.patches.sglang._op_signature import check_op

TARGET = "sglang.srt.layers.radix_attention.breakable_unified_attention_with_output_and_lse"


def make(*, capturing, refuse):
    return refusing_hook(capturing, refuse, "attention returning log-sum-exp (chunked-prefix MHA)")


PATCH = Patch(
    target=TARGET,
    how=Hook("AROUND", check=check_op(TARGET, "unified_attention_with_output_and_lse", ("query", "output", "layer_id"))),
    make=make,
    reason="fail bcg's capture (eager on every rank) rather than bake LSE attention, which returns a CUDA "
           "tensor, into a graph",
    hosts=">=0.5.17,<0.5.23",
    upstream=NOT_FILED,
    remove_when="bcg supports breaks with tensor results, or SGLang drops the LSE break",
)
