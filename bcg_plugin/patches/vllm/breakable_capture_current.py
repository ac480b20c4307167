"""``BreakableCUDAGraphCapture.current``: under bcg's capture, vLLM's breakable ops find a capture that refuses them.

vLLM marks the ops that must not be frozen into a graph (Mamba and linear-attention mixers, MLA, sparse
indexers, a model's own) with ``eager_break_during_capture``, which ends a segment only where this
classmethod returns a capture. Under bcg's capture it returned none, so such an op was recorded inline,
its per-step host work frozen into the graph, and replays read the capture's batch. With this patch it
returns bcg's refusal for the length of bcg's capture: the op fails the bucket's capture, which every
rank then runs eagerly. Attention, bcg's own break, calls the function under vLLM's marker and is not
refused. Code that only asks whether a breakable capture is active (``is_active``) gets the answer it
gets under vLLM's own: Cohere2 MoE keeps its MLP, and ``maybe_execute_in_parallel`` its two calls, on
the one stream, where a side stream forked in a segment could span a break.

Through 0.32 the marker leaves an op unmarked where vLLM's breakable graphs are off, as bcg keeps
them, so the refusal meets marked ops from 0.33 on; ``is_active()`` answers true in every release.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def make(original, *, capture_refusal):
    current = original.__func__

    @functools.wraps(current)
    def wrapped(cls):
        active = current(cls)
        return capture_refusal() if active is None else active

    return classmethod(wrapped)


PATCH = Patch(
    target="vllm.compilation.breakable_cudagraph.BreakableCUDAGraphCapture.current",
    how=Wrap(params=["cls"]),
    make=make,
    reason="under bcg's capture, an op vLLM marks with `eager_break_during_capture` (other than attention, "
           "bcg's own break) fails the bucket's capture instead of being recorded inline with its host work "
           "frozen; `is_active()` is true there, as under vLLM's own breakable capture (no side stream that could "
           "span a break)",
    hosts=">=0.26.0,<0.35",
    upstream=NOT_FILED,
    remove_when="vLLM's breakable capture accepts an external recorder (the attention patch's removal "
                "condition): bcg then captures through it and every marked op breaks there",
)
