"""``radix_attention.breakable_unified_attention_with_output``: attention as bcg's eager break.

RadixAttention picks this module global (at call time) when a breakable capture is on. SGLang's
wrapper only splits the graph under SGLang's own capture primitive; under bcg's capture it would
run inline and bake attention into the graph. The hook routes the call to bcg's break while bcg
captures and passes through otherwise.
"""

from __future__ import annotations

from bcg_plugin.patches._patch import NOT_FILED, Patch
from bcg_plugin.patches.sglang._hook import Hook
from bcg_plugin.patches.sglang._op_signature import check_op

TARGET = "sglang.srt.layers.radix_attention.breakable_unified_attention_with_output"
PARAMS = ("query", "key", "value", "output", "save_kv_cache", "layer_id", "use_mha_companion",
          "key_value_num_tokens")


def make(*, capturing, attention_break):
    def around_breakable_attention(original_fn, *args, **kwargs):
        if capturing():
            return attention_break(*args, **kwargs)
        return original_fn(*args, **kwargs)

    return around_breakable_attention


PATCH = Patch(
    target=TARGET,
    how=Hook("AROUND", check=check_op(TARGET, "unified_attention_with_output", PARAMS)),
    make=make,
    reason="route RadixAttention's breakable op to bcg's eager break (owned inputs, padded rows scrubbed, "
           "live batch) while bcg captures; SGLang's wrapper only splits under its own capture primitive",
    hosts=">=0.5.17,<0.5.23",
    upstream=NOT_FILED,
    remove_when="SGLang's breakable ops dispatch through a pluggable break primitive",
)
