"""Attention as bcg's eager break in vLLM: a kernel for ``vllm::unified_attention_with_output``.

vLLM's attention layer calls this op with q, k, v and an ``output`` out-parameter; the op reads
the batch's metadata, KV cache and layer from vLLM's forward context on every call. Registered as
the op's kernel, vLLM's own function, marked as an eager break, ends the current graph segment
under a bcg capture and re-runs at every replay; everywhere else (eager forwards, vLLM's own FULL
decode capture) it is a plain call, because bcg breaks only under bcg's own capture.

In a bucket whose attention bcg captures inside the graph (the V2 runner with a backend whose
metadata vLLM can build for its own FULL graphs: :meth:`~bcg_plugin.adapters.vllm.host.V2Host.bcg_graph_attention`),
the same function is recorded inline at capture, reading the FULL-mode metadata buffers that vLLM
refills in place before every replay of the bucket, and runs no Python at replay.

Where it breaks, the break reads whichever forward context is current when it runs: at capture the dummy batch's,
which :meth:`~bcg_plugin.adapters.vllm.host.VllmHost.bcg_body_forward` binds, and at replay the one vLLM
set for the step. A replay is a straight call of vLLM's function, as in vLLM's own breakable
graphs. The stale-metadata negative control of the GPU tests (a fault plugin, :mod:`bcg_plugin.faults`)
has :meth:`~bcg_plugin.adapters.vllm.replay.VllmPrefillGraphs.forward` bind the capture-time context
around the replay instead.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bcg_plugin import BcgStateError, eager_break


def make_attention_break(original: Callable[..., Any]) -> Callable[..., Any]:
    """The break kernel for vLLM's registered ``unified_attention_with_output`` function."""
    return eager_break(unmarked(original), outputs=("output",), capturable=True)


def unmarked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without vLLM's ``eager_break_during_capture`` wrapper, where it has one: under bcg's
    capture that wrapper meets :class:`MarkedOpRefusal`, and attention is bcg's own break."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    # Every wrapper the marker makes runs the one code object nested in the marker's own.
    code = getattr(fn, "__code__", None)
    if code is not None and hasattr(fn, "__wrapped__") and any(
            const is code for const in eager_break_during_capture.__code__.co_consts):
        return fn.__wrapped__
    return fn


class MarkedOpRefusal:
    """The breakable capture vLLM's marked ops find while bcg captures
    (:mod:`~bcg_plugin.patches.vllm.breakable_capture_current`).

    vLLM marks with ``eager_break_during_capture`` the ops whose host work must run every step
    (Mamba and linear-attention mixers, MLA, sparse indexers, a model's own). bcg breaks only at
    attention, so such an op met inside a segment fails the bucket's capture (every rank then runs
    prefill eagerly) instead of being recorded with its capture-time host work frozen in.
    ``_capturing`` and ``add_eager`` are the two attributes the marker reads.
    """

    @property
    def _capturing(self) -> bool:
        # Between segments (bcg's own break, the warm-up forwards) a marked op runs as a plain call.
        return torch.cuda.is_current_stream_capturing()

    def add_eager(self, step: Callable[[], Any]) -> Any:
        raise BcgStateError(f"bcg cannot capture {_marked_op(step)}, an op vLLM marks as an eager break: bcg breaks "
                            "only at attention; this model runs prefill eagerly")


def _marked_op(step: Callable[[], Any]) -> str:
    """The marked op's name: the marker hands over a closure that calls it."""
    for cell in getattr(step, "__closure__", None) or ():
        value = cell.cell_contents
        if callable(value) and hasattr(value, "__qualname__"):
            return value.__qualname__
    return "an op"


_REFUSAL = MarkedOpRefusal()
# Per thread, as vLLM keeps its own capture: model code that torch.compile traces asks for it
# (``is_active()``), and Dynamo traces a thread-local's attribute, not a context variable's get.
_capture = threading.local()


def capture_refusal() -> MarkedOpRefusal | None:
    """What ``BreakableCUDAGraphCapture.current()`` adds to vLLM's answer: the refusal during bcg's capture."""
    return _REFUSAL if getattr(_capture, "refusing", False) else None


@contextlib.contextmanager
def refusing_marked_ops() -> Iterator[None]:
    """For the length of bcg's capture (its warm-up forwards included)."""
    before = getattr(_capture, "refusing", False)
    _capture.refusing = True
    try:
        yield
    finally:
        _capture.refusing = before
