"""Bench-only: what ``capture_prefill_graph`` cost, whichever runner it built.

Installed only when ``BCG_BENCH_RECORD`` names a file. Appends ``{"kind": "capture", ...}`` with
SGLang's own accounting (free-memory delta and wall time around the runner's construction), the
same measurement for every prefill backend, plus bcg's pool size when bcg's runner was built.
"""

from __future__ import annotations

from bcg_plugin.patches import NOT_FILED, Patch
from bcg_plugin.patches.sglang import Hook

TARGET = "sglang.srt.model_executor.model_runner_components.cuda_graph_setup.capture_prefill_graph"


def after_capture_prefill_graph(result, *args, **kwargs):
    from bcg_plugin.adapters.sglang.config import append_bench_record, bench_record_path

    path = bench_record_path()
    if not path:
        return None
    runner = getattr(result, "runner", None)
    core = getattr(runner, "core", None)
    record = {
        "kind": "capture",
        "runner": type(runner).__name__,
        "memory_gib": float(getattr(result, "memory_usage_gb", 0.0) or 0.0),
        "seconds": float(getattr(result, "capture_time", 0.0) or 0.0),
        "bcg_pool_gib": core.stats.pool_bytes / 2**30 if core is not None else None,
        "bcg_graph_gib": core.stats.graph_bytes / 2**30 if core is not None else None,
        "bcg_capture_s": core.stats.capture_seconds if core is not None else None,
        "bcg_warmup_s": core.stats.warmup_seconds if core is not None else None,
    }
    append_bench_record(path, record)
    return None


def make():
    return after_capture_prefill_graph


PATCH = Patch(
    target=TARGET,
    how=Hook("AFTER", params=("model_runner", "eager_runner")),
    make=make,
    reason="benchmark only: capture time and graph memory per prefill backend",
    hosts=">=0.5.17,<0.5.18",
    upstream=NOT_FILED,
    remove_when="SGLang reports graph memory/time per phase through get_server_info",
)
