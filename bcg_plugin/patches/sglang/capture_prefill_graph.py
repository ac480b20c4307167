"""``cuda_graph_setup.capture_prefill_graph``: build bcg's runner in place of SGLang's.

While the original runs, its module global ``PrefillCudaGraphRunner`` is rebound to a factory of
bcg's runner, so SGLang's own gates (disabled backend, LoRA, EAGLE, memory headroom), the
attention-layer lists the break reads and the time/memory accounting stay SGLang's. The global is
restored in a ``finally``; SGLang's runner is used unchanged whenever the adapter declines.
"""

from __future__ import annotations

import sys

from bcg_plugin.patches._patch import NOT_FILED, Patch
from bcg_plugin.patches.sglang._hook import Hook


def make(*, prefill_runner_factory):
    """``prefill_runner_factory(model_runner)``: ``None`` to keep SGLang's runner, or
    ``factory(model_runner, native_cls) -> runner`` to build in its place."""

    def around_capture_prefill_graph(original_fn, *args, **kwargs):
        factory = prefill_runner_factory(kwargs.get("model_runner"))
        if factory is None:
            return original_fn(*args, **kwargs)
        module = sys.modules[original_fn.__module__]
        native_cls = module.PrefillCudaGraphRunner
        module.PrefillCudaGraphRunner = lambda model_runner: factory(model_runner, native_cls)
        try:
            return original_fn(*args, **kwargs)
        finally:
            module.PrefillCudaGraphRunner = native_cls

    return around_capture_prefill_graph


PATCH = Patch(
    target="sglang.srt.model_executor.model_runner_components.cuda_graph_setup.capture_prefill_graph",
    how=Hook("AROUND", params=("model_runner", "eager_runner", "force_for_draft_worker")),
    make=make,
    reason="build bcg's runner (private pool, owned break inputs, scrubbed padding) instead of SGLang's "
           "breakable runner (shared decode pool, weak break inputs), keeping SGLang's gates and accounting; "
           "rebinds the module global `PrefillCudaGraphRunner` only for the duration of the call",
    hosts=">=0.5.17,<0.5.24",
    upstream=NOT_FILED,
    remove_when="SGLang exposes a prefill-runner factory hook",
)
