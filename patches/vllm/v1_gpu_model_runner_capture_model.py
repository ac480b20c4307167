"""V1 ``GPUModelRunner.capture_model``: capture bcg's buckets, then vLLM's own graphs.

bcg goes first: the original returns early when ``cudagraph_mode`` is NONE and locks workspace
growth when it finishes. Dummy batches come from the runner's ``_dummy_run`` (see
:class:`bcg_adapters.vllm.host.V1Host`), whose parameters this patch depends on as well.
"""

from __future__ import annotations

import functools

from bcg_patches.vllm._patch import Patch

DUMMY_RUN_PARAMS = ["self", "num_tokens", "cudagraph_runtime_mode", "force_attention", "uniform_decode",
                    "allow_microbatching", "skip_eplb", "is_profile", "create_mixed_batch", "remove_lora",
                    "is_graph_capturing", "num_active_loras", "profile_seq_lens"]


def make(original):
    @functools.wraps(original)
    def capture_model(self, *args, **kwargs):
        from bcg_adapters.vllm.plugin import capture_v1

        graphs = capture_v1(self)
        self._bcg_graphs = graphs
        self.cudagraph_dispatcher._bcg_graphs = graphs
        return original(self, *args, **kwargs)

    return capture_model


class _CaptureModelPatch(Patch):
    def verify(self) -> None:
        super().verify()
        Patch(self.module, "GPUModelRunner._dummy_run", DUMMY_RUN_PARAMS, make, self.reason,
              self.remove_when).verify()


PATCH = _CaptureModelPatch(
    module="vllm.v1.worker.gpu_model_runner",
    qualname="GPUModelRunner.capture_model",
    params=["self"],
    make=make,
    reason="capture bcg's prefill buckets (dummy batches from _dummy_run) before vLLM's own graphs",
    remove_when="vLLM exposes a capture hook for external graph runners",
)
