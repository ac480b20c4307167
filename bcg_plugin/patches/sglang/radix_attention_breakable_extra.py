"""``radix_attention.breakable_attention_with_output_extra_kwargs``: refused under bcg capture.

Carries ``score_mod`` callables / aux tensors that bcg's break does not narrow; refusing it keeps
such models (Inkling and similar) eager instead of capturing their attention inline.
"""

from __future__ import annotations

from bcg_plugin.patches.sglang._op_signature import check_op
from bcg_plugin.patches.sglang.base import Patch

TARGET = "sglang.srt.layers.radix_attention.breakable_attention_with_output_extra_kwargs"


def around_breakable_attention_extra(original_fn, *args, **kwargs):
    from bcg_plugin.adapters.sglang import attention

    if attention.capturing():
        attention.refuse("attention with score_mod/aux_tensors/descale kwargs")
    return original_fn(*args, **kwargs)


PATCH = Patch(
    target=TARGET,
    kind="AROUND",
    hook=around_breakable_attention_extra,
    check=check_op(TARGET, "attention_with_output_extra_kwargs", ("query", "output", "extra_kwargs")),
    reason="fail bcg capture loudly for attention kwargs bcg's break does not handle",
    versions=">=0.5.17,<0.5.18",
    remove_when="bcg's break narrows per-token extra kwargs",
)
