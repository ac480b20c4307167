"""``radix_attention.breakable_attention_with_output_extra_kwargs``: refused under bcg capture.

Carries ``score_mod`` callables / aux tensors that bcg's break does not narrow; refusing it keeps
such models (Inkling and similar) eager instead of capturing their attention inline.
"""

from __future__ import annotations

from bcg_plugin.patches._patch import NOT_FILED, Patch
from bcg_plugin.patches.sglang._hook import Hook, refusing_hook
from bcg_plugin.patches.sglang._op_signature import check_op

TARGET = "sglang.srt.layers.radix_attention.breakable_attention_with_output_extra_kwargs"


def make(*, capturing, refuse):
    return refusing_hook(capturing, refuse, "attention with score_mod/aux_tensors/descale kwargs")


PATCH = Patch(
    target=TARGET,
    how=Hook("AROUND", check=check_op(TARGET, "attention_with_output_extra_kwargs", ("query", "output", "extra_kwargs"))),
    make=make,
    reason="fail bcg's capture for attention with `score_mod`/`aux_tensors`/descale kwargs, which bcg's "
           "break does not narrow",
    hosts=">=0.5.17,<0.5.23",
    upstream=NOT_FILED,
    remove_when="bcg's break narrows per-token extra kwargs",
)
