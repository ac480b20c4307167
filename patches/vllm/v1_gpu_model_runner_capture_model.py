"""V1 ``GPUModelRunner.capture_model``: capture bcg's buckets, then vLLM's own graphs.

bcg goes first: the original returns early when ``cudagraph_mode`` is NONE and locks workspace
growth when it finishes. Dummy batches come from the runner's ``_dummy_run`` (see
:class:`bcg_adapters.vllm.host.V1Host`), itself patched and verified by ``v1_gpu_model_runner_dummy_run``.
"""

from __future__ import annotations

import functools

from bcg_patches.vllm._patch import Patch


def make(original):
    @functools.wraps(original)
    def capture_model(self, *args, **kwargs):
        from bcg_adapters.vllm.plugin import capture_v1

        graphs = capture_v1(self)
        self._bcg_graphs = graphs
        self.cudagraph_dispatcher._bcg_graphs = graphs
        return original(self, *args, **kwargs)

    return capture_model


PATCH = Patch(
    module="vllm.v1.worker.gpu_model_runner",
    qualname="GPUModelRunner.capture_model",
    params=["self"],
    make=make,
    reason="capture bcg's prefill buckets (dummy batches from _dummy_run) before vLLM's own graphs",
    remove_when="vLLM exposes a capture hook for external graph runners",
)
