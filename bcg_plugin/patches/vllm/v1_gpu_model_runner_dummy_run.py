"""V1 ``GPUModelRunner._dummy_run``: an idle data-parallel rank's padded forward replays its bucket too.

Under data parallelism a rank with no requests runs ``_dummy_run`` while its peers run a real step,
padded by vLLM's DP synchronisation to the same size and dispatched through the same (patched)
dispatcher. ``_dummy_run`` calls ``self.model`` directly instead of ``_model_forward``, so without
this patch that rank would run its PIECEWISE step eagerly while its peers replay: correct (the
collectives match in size and order) but every step with an idle rank runs at eager speed. For the
length of the call, ``self.model`` answers PIECEWISE forwards through bcg; everything else (profile
runs, warm-ups, vLLM's FULL decode capture, bcg's own dummy batches) reaches the model as before.
"""

from __future__ import annotations

import functools
from typing import Any

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap

PARAMS = ["self", "num_tokens", "cudagraph_runtime_mode", "force_attention", "uniform_decode",
          "allow_microbatching", "skip_eplb", "is_profile", "create_mixed_batch", "remove_lora",
          "is_graph_capturing", "num_active_loras", "profile_seq_lens"]


class DummyForward:
    """Stands in for ``runner.model`` during one ``_dummy_run``: PIECEWISE forwards replay through bcg."""

    def __init__(self, graphs: Any, model: Any):
        self._bcg_graphs = graphs
        self._bcg_model = model

    def __call__(self, **model_inputs: Any) -> Any:
        from vllm.config.compilation import CUDAGraphMode
        from vllm.forward_context import get_forward_context

        if get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE:
            return self._bcg_graphs.forward(self._bcg_model, model_inputs, dummy=True)
        return self._bcg_model(**model_inputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bcg_model, name)


def make(original):
    @functools.wraps(original)
    def _dummy_run(self, num_tokens, *args, **kwargs):
        graphs = getattr(self, "_bcg_graphs", None)
        if graphs is None or isinstance(self.model, DummyForward):
            return original(self, num_tokens, *args, **kwargs)
        model = self.model
        self.model = DummyForward(graphs, model)
        try:
            return original(self, num_tokens, *args, **kwargs)
        finally:
            self.model = model

    return _dummy_run


TARGET = "vllm.v1.worker.gpu_model_runner.GPUModelRunner._dummy_run"
REASON = ("V1: bcg's capture builds its dummy batches with it (`profile_seq_lens` capped at "
          "`max_model_len`, which the block table's rows hold); an idle DP rank's padded dummy forward "
          "(which calls `self.model` directly) replays the bucket its peers replay instead of running "
          "eagerly")
REMOVE_WHEN = "`_dummy_run` calls `_model_forward` or another hook external graph runners reach"

PATCHES = (
    Patch(target=TARGET, how=Wrap(params=PARAMS), make=make, reason=REASON, hosts=">=0.26.0,<0.27",
          upstream=NOT_FILED, remove_when=REMOVE_WHEN),
    # randomize_inputs (a trailing keyword with a default) changes nothing the wrapper or bcg's own call uses.
    Patch(target=TARGET, how=Wrap(params=[*PARAMS, "randomize_inputs"]), make=make, reason=REASON,
          hosts=">=0.27,<0.34", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
)
