"""``RadixAttention._eager_attention``: attention as bcg's eager break (SGLang 0.5.23 on).

SGLang 0.5.23 dropped the module-level breakable attention ops; RadixAttention's graph break is now
this method, decorated with ``eager_on_graph``, which RadixAttention calls for every extend inside a
prefill graph scope (breakable and full graphs alike). Under bcg's capture its segmenting wrapper
would run inline (bcg's capture is not SGLang's), so the method's graph entry is replaced by one
that routes to bcg's break while bcg captures and is SGLang's own otherwise. The method's explicit
eager entry (``run_eager``, which MLA calls inside its own eager region) is kept as SGLang built it.

One seam for what three patches did on earlier releases: the plain op
(:mod:`~bcg_plugin.patches.sglang.radix_attention_breakable`) becomes bcg's break, and the
log-sum-exp (:mod:`~bcg_plugin.patches.sglang.radix_attention_breakable_lse`) and extra-kwargs
(:mod:`~bcg_plugin.patches.sglang.radix_attention_breakable_extra`) variants, now arguments of the
same method, are refused by the adapter's break.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from bcg_plugin.patches._patch import NOT_FILED, Patch, PatchTargetError, Wrap, raw_attribute

TARGET = "sglang.srt.layers.radix_attention.RadixAttention._eager_attention"
PARAMS = ("self", "q", "k", "v", "output", "save_kv_cache", "key_value_num_tokens", "idx_output", "lse_output",
          "kwargs")


@dataclasses.dataclass(frozen=True)
class _EagerMethod(Wrap):
    """A :class:`~bcg_plugin.patches.Wrap` of a method SGLang decorated with ``eager_on_graph``: the
    class attribute must be SGLang's two-entry callable (graph entry, explicit eager entry)."""

    def verify(self, target: str) -> None:
        value = raw_attribute(target)
        value = getattr(value, "__bcg_patch__", value)
        missing = [a for a in ("_graph_call", "_eager_call", "run_eager") if not hasattr(value, a)]
        if missing:
            raise PatchTargetError(f"{target}: not an `eager_on_graph` method (it lacks {missing})")
        super().verify(target)

    def describe(self) -> str:
        return "graph entry wrapped in place (SGLang's explicit eager entry kept)"


def make(original: Any, *, capturing, layer_attention_break):
    graph_call = original._graph_call

    @functools.wraps(graph_call)
    def graph_or_bcg(layer, *args, **kwargs):
        if capturing():
            return layer_attention_break(layer, *args, **kwargs)
        return graph_call(layer, *args, **kwargs)

    replacement = type(original)(graph_or_bcg, original._eager_call)
    return functools.update_wrapper(replacement, original._eager_call)


PATCH = Patch(
    target=TARGET,
    how=_EagerMethod(params=PARAMS),
    make=make,
    reason="route RadixAttention's eager attention to bcg's break (owned inputs, padded rows scrubbed, live "
           "batch) while bcg captures; LSE, sparse-indexer and extra-kwargs attention fail bcg's capture. "
           "Retires, from 0.5.23 where SGLang folded them into this method, the hooks on "
           "`breakable_unified_attention_with_output`, `..._and_lse` and `breakable_attention_with_output_extra_kwargs`",
    hosts=">=0.5.23,<0.5.24",
    upstream=NOT_FILED,
    remove_when="SGLang's eager attention dispatches through a pluggable break primitive bcg can own",
)
