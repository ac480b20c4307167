"""Bench-only: ``ModelRunner.forward`` timed with CUDA events for extend forwards.

Installed only when ``BCG_BENCH_RECORD`` names a file (the benchmark script sets it for its own
engine); each extend forward, and an idle DP-attention rank's forward while another rank extends,
appends ``{"kind": "forward", "tokens", "ms", "host_ms", "rank", "graph", "across_dp"}`` to it (``host_ms``: host time spent issuing the forward; ``across_dp``: SGLang's
replicated per-DP-rank token counts, ``None`` without DP attention). The synchronisation it adds
makes it unfit for serving. With ``bcg bench --profile N``, the first N-token forward once the
bench arms the profiler (:func:`~bcg_plugin.adapters.sglang.config.profile_arm_path`) runs under
``torch.profiler`` and appends ``{"kind": "host_profile", "rank", ...}``
(:mod:`bcg_bench.profile`).
"""

from __future__ import annotations

import contextlib
import functools
import time

from bcg_plugin.patches import NOT_FILED, Patch
from bcg_plugin.patches.sglang import Hook

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"


@functools.cache
def _profiler(path: str):
    """This scheduler's profiler for the bench record ``path`` (``None`` without ``--profile``)."""
    import os

    from bcg_plugin.adapters.sglang.config import profile_arm_path
    from bcg_bench.profile import ForwardProfiler

    arm = profile_arm_path(path)
    return ForwardProfiler.from_env(armed=lambda: os.path.exists(arm))


def around_forward(original_fn, self, forward_batch, *args, **kwargs):
    import torch

    from bcg_plugin.adapters.sglang.config import append_bench_record, bench_record_path

    path = bench_record_path()
    mode = forward_batch.forward_mode
    # An idle DP-attention rank while another extends: SGLang pads it to a dummy extend that replays
    # the same bucket, so lockstep checks need its record too (``tokens`` 0).
    idle_in_extend = mode.is_idle() and bool(getattr(forward_batch, "is_extend_in_batch", False))
    if not path or not (mode.is_extend() or idle_in_extend):
        return original_fn(self, forward_batch, *args, **kwargs)
    tokens = len(forward_batch.input_ids)
    across = getattr(forward_batch, "global_num_tokens_cpu", None)  # read before the forward pads it
    across_dp = [int(n) for n in across] if across is not None else None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    profiler = _profiler(path)
    profiled_before = profiler is not None and profiler.summary is not None
    start.record()
    t0 = time.perf_counter()
    with profiler.around(tokens) if profiler else contextlib.nullcontext():
        out = original_fn(self, forward_batch, *args, **kwargs)
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if profiler is not None and profiler.summary is not None and not profiled_before:
        append_bench_record(path, {"kind": "host_profile", "rank": rank, **profiler.summary})
    record = {"kind": "forward", "tokens": tokens, "ms": start.elapsed_time(end), "host_ms": host_ms,
              "rank": rank, "graph": bool(getattr(out, "can_run_graph", False)), "across_dp": across_dp}
    append_bench_record(path, record)
    return out


def make():
    return around_forward


PATCH = Patch(
    target=TARGET,
    how=Hook("AROUND", params=("self", "forward_batch")),
    make=make,
    reason="benchmark only: model-forward time of prefill forwards (CUDA events)",
    hosts=">=0.5.17,<0.5.18",
    upstream=NOT_FILED,
    remove_when="SGLang's device timer exposes per-forward prefill times to clients",
)
