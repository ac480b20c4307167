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

from collections.abc import Callable
from typing import Any

from bcg_plugin import eager_break


def make_attention_break(original: Callable[..., Any]) -> Callable[..., Any]:
    """The break kernel for vLLM's registered ``unified_attention_with_output`` function."""
    return eager_break(original, outputs=("output",), capturable=True)
