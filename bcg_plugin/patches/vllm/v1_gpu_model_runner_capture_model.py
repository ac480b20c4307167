"""V1 ``GPUModelRunner.capture_model``: capture bcg's buckets, then vLLM's own graphs.

bcg goes first: the original returns early when ``cudagraph_mode`` is NONE and locks workspace
growth when it finishes. Dummy batches come from the runner's ``_dummy_run`` (see
:class:`bcg_plugin.adapters.vllm.host.V1Host`), itself patched and verified by ``v1_gpu_model_runner_dummy_run``.

The original returns the device memory its own capture took, and vLLM's worker logs that figure as
the graphs' memory and sizes its ``--kv-cache-memory`` advice with it. bcg's buckets are captured
outside the original's measurement, so the device memory bcg's capture took (the core measures it the
same way, free memory around the capture) is added to it. (The V2 runner measures around its graph
manager's capture, which bcg's capture runs inside.)
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def make(original, *, capture_v1):
    @functools.wraps(original)
    def capture_model(self, *args, **kwargs):
        graphs = capture_v1(self)
        self._bcg_graphs = graphs
        self.cudagraph_dispatcher._bcg_graphs = graphs
        bcg_bytes = graphs.runner.stats.graph_bytes if graphs is not None else 0
        return original(self, *args, **kwargs) + bcg_bytes

    return capture_model


TARGET = "vllm.v1.worker.gpu_model_runner.GPUModelRunner.capture_model"
REASON = ("V1: capture bcg's buckets (dummy batches from `_dummy_run`) before vLLM's graphs and its "
          "workspace lock, and add their device memory to the graph memory vLLM reports")
REMOVE_WHEN = "vLLM exposes a capture hook for external graph runners"
GRAPH_CAPTURE = "vllm.distributed.parallel_state.graph_capture"

PATCHES = (
    Patch(target=TARGET, how=Wrap(params=["self"], uses={GRAPH_CAPTURE: ["device", "graph_capture_context"]}),
          make=make, reason=REASON, hosts=">=0.26.0,<0.31", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
    Patch(target=TARGET, how=Wrap(params=["self"], uses={GRAPH_CAPTURE: ["device"]}), make=make,
          reason=REASON + " (captured on `graph_capture`'s own stream: no caller-chosen stream from 0.31)",
          hosts=">=0.31,<0.34", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
)
