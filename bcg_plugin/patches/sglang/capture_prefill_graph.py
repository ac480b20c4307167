"""``cuda_graph_setup.capture_prefill_graph``: build bcg's runner in place of SGLang's.

While the original runs, its module global ``PrefillCudaGraphRunner`` is rebound to bcg's runner
class, so SGLang's own gates (disabled backend, LoRA, EAGLE, memory headroom), the attention-layer
lists the break reads and the time/memory accounting stay SGLang's. The global is restored in a
``finally``; SGLang's runner is used unchanged whenever bcg is off or the model is ineligible.
"""

from __future__ import annotations

from bcg_plugin.patches.sglang.base import Patch

TARGET = "sglang.srt.model_executor.model_runner_components.cuda_graph_setup.capture_prefill_graph"


def around_capture_prefill_graph(original_fn, *args, **kwargs):
    from bcg_plugin.adapters.sglang import replay as runner

    return runner.capture_prefill_graph(original_fn, *args, **kwargs)


PATCH = Patch(
    target=TARGET,
    kind="AROUND",
    hook=around_capture_prefill_graph,
    params=("model_runner", "eager_runner", "force_for_draft_worker"),
    reason="replace SGLang's breakable prefill runner (shared decode pool, weak break inputs) with "
    "bcg's (private pool, owned inputs, scrubbed padding); also rebinds the module global "
    "PrefillCudaGraphRunner for the duration of the call",
    versions=">=0.5.17,<0.5.18",
    remove_when="SGLang exposes a prefill-runner factory hook",
)
