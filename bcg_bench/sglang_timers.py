"""The SGLang bench's timers: what each scheduler's prefill forwards, steps and capture cost, and
when each request passed through the scheduler.

They are four SGLang ``HookRegistry`` hooks, installed only in the schedulers of an engine that
:func:`start_engine` starts, never by bcg's plugin:

* ``ModelRunner.forward`` (AROUND): each extend forward, and an idle DP-attention rank's forward
  while another rank extends, appends ``{"kind": "forward", "tokens", "requests", "ms", "host_ms",
  "rank", "graph", "variant", "across_dp"}`` to the record file: ``requests`` the step's requests (a mixed
  step's decodes among them), ``ms`` from CUDA events, ``host_ms`` the host time
  spent issuing the forward, ``variant`` the bcg graph variant it replayed in (``None`` for a
  bucket's own graph and for other runners), ``across_dp`` SGLang's replicated per-DP-rank token
  counts (``None`` without DP attention). The synchronisation it adds makes it unfit for serving. With
  ``bcg bench --profile N``, the first N-token forward once the bench arms the profiler
  (:func:`profile_arm_path`) runs under ``torch.profiler`` and appends ``{"kind": "host_profile",
  "rank", ...}`` (:mod:`bcg_bench.profile`).
* ``TpModelWorker.forward_batch_generation`` (AROUND): each extend step the worker runs, the model
  forward and the sampling after it, appends ``{"kind": "step", "tokens", "ms", "t0", "t1", "rank"}``:
  ``ms`` the wall time from the call (``t0``) to its sampled tokens on the device (``t1``; it
  synchronises the stream); an idle DP-attention rank records none. A request's end-to-end time
  less its step is the scheduler's, the tokenizer manager's and the transport's; the step less the
  forward is the worker's own (sampling, its batch bookkeeping) and the forward timer's (its
  synchronisation and record).
* ``SchedulerOutputStreamer.stream_output`` (AROUND): each request whose final output the call sent
  appends ``{"kind": "request", "tokens", "queued", "sent", "rank"}``: ``queued`` SGLang's own time
  the request last entered the waiting queue (a retracted request enters it again), ``sent`` the
  time the call returned, its output sent (every rank of a tensor-parallel group records; its
  first rank's call is the one that sends). With the step's ``t0`` and ``t1`` these split a
  request's end-to-end time into its path to the queue, scheduling, the step, what the scheduler
  does until the output leaves (the rest of its loop turn, result processing, the step record's own
  write) and its way back. Every stamp is ``time.perf_counter()``, which on Linux reads the
  system-wide monotonic clock, so stamps of the bench's and the schedulers' processes compare.
* ``capture_prefill_graph`` (AFTER): appends ``{"kind": "capture", ...}`` with SGLang's own
  accounting of the runner it built (free-memory delta and wall time), the same measurement for
  every prefill backend, plus bcg's pool and graph sizes and its count of captured buckets when
  bcg's runner was built, and the weight-read floor's figures: the rank's weight bytes and, in a
  one-GPU engine, the rate of a device copy timed there.

How they reach the schedulers: SGLang starts each scheduler (and, under DP attention, the DP
controller that starts them) with multiprocessing *spawn*, calling ``Engine.run_scheduler_process_func``,
a class attribute SGLang provides for engines that customise their processes. The engine class of
:func:`start_engine` sets it to :func:`run_scheduler_process`, which spawn pickles by reference, so
each scheduler imports this module and runs that function: it registers the four hooks, then lets
SGLang load its plugins (bcg's among them) and apply every registered hook at once, then runs
SGLang's own scheduler. Registering before the plugins load matters: bcg's plugin hooks
``capture_prefill_graph`` too, and ``HookRegistry`` builds a target's chain once, so a hook applied
on its own before the plugin's would leave the plugin's out (bcg would turn itself off). The record
file is named by ``BCG_BENCH_RECORD`` in the environment, which the schedulers inherit.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

from bcg_bench import weights
from bcg_plugin.patches import NOT_FILED, Patch, PatchSet
from bcg_plugin.patches.sglang import GATE, Hook

RECORD_ENV = "BCG_BENCH_RECORD"  # the file every scheduler appends its records to, one JSON object a line
FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
STEP_TARGET = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
CAPTURE_TARGET = "sglang.srt.model_executor.model_runner_components.cuda_graph_setup.capture_prefill_graph"
OUTPUT_TARGET = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output"


def record_path() -> str | None:
    """This process's record file, or ``None`` outside an engine of :func:`start_engine`."""
    return os.environ.get(RECORD_ENV) or None


def profile_arm_path(record: str) -> str:
    """The file whose presence arms the schedulers' forward profiler (``bcg bench --profile N``)."""
    return f"{record}.profile-armed"


def append_record(path: str, record: dict) -> None:
    """Append ``record`` to the record file as one JSON line (every scheduler appends to the same file)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


@functools.cache
def _profiler(path: str):
    """This scheduler's profiler for the record file ``path`` (``None`` without ``--profile``)."""
    from bcg_bench.profile import ForwardProfiler

    arm = profile_arm_path(path)
    return ForwardProfiler.from_env(armed=lambda: os.path.exists(arm))


def _rank() -> int:
    """This scheduler's rank in the engine's process group (0 without one)."""
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


# This scheduler process's bcg runtime counters, once its capture is recorded.
_BCG_STATS: dict[str, Any] = {}


def around_forward(original_fn, self, forward_batch, *args, **kwargs):
    import torch

    path = record_path()
    mode = forward_batch.forward_mode
    # An idle DP-attention rank while another extends: SGLang pads it to a dummy extend that replays
    # the same bucket, so lockstep checks need its record too (``tokens`` 0).
    idle_in_extend = mode.is_idle() and bool(getattr(forward_batch, "is_extend_in_batch", False))
    if not path or not (mode.is_extend() or idle_in_extend):
        return original_fn(self, forward_batch, *args, **kwargs)
    tokens = len(forward_batch.input_ids)
    requests = int(getattr(forward_batch, "batch_size", 0) or 0)
    across = getattr(forward_batch, "global_num_tokens_cpu", None)  # read before the forward pads it
    across_dp = [int(n) for n in across] if across is not None else None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    profiler = _profiler(path)
    profiled_before = profiler is not None and profiler.summary is not None
    variants = _BCG_STATS.get("stats")
    replays_before = dict(variants.replays_by_variant) if variants is not None else {}
    start.record()
    t0 = time.perf_counter()
    with profiler.around(tokens) if profiler else contextlib.nullcontext():
        out = original_fn(self, forward_batch, *args, **kwargs)
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    rank = _rank()
    if profiler is not None and profiler.summary is not None and not profiled_before:
        append_record(path, {"kind": "host_profile", "rank": rank, **profiler.summary})
    variant = None
    if variants is not None:
        variant = next((name for name, n in variants.replays_by_variant.items()
                        if n > replays_before.get(name, 0)), None)
    append_record(path, {"kind": "forward", "tokens": tokens, "requests": requests,
                         "ms": start.elapsed_time(end), "host_ms": host_ms,
                         "rank": rank, "graph": bool(getattr(out, "can_run_graph", False)), "variant": variant,
                         "across_dp": across_dp})
    return out


def around_step(original_fn, self, batch, *args, **kwargs):
    path = record_path()
    mode = getattr(batch, "forward_mode", None)  # None where the caller passed a ForwardBatch instead
    tokens = getattr(batch, "extend_num_tokens", None)  # a speculative verify step's may be stale: skipped
    if not path or mode is None or not mode.is_extend() or mode.is_target_verify() or tokens is None:
        return original_fn(self, batch, *args, **kwargs)
    import torch

    t0 = time.perf_counter()
    out = original_fn(self, batch, *args, **kwargs)
    torch.cuda.current_stream().synchronize()
    t1 = time.perf_counter()
    append_record(path, {"kind": "step", "tokens": int(tokens), "ms": (t1 - t0) * 1e3, "t0": t0, "t1": t1,
                         "rank": _rank()})
    return out


def around_stream_output(original_fn, self, reqs, *args, **kwargs):
    path = record_path()
    if not path:
        return original_fn(self, reqs, *args, **kwargs)
    skip = kwargs.get("skip_req", args[1] if len(args) > 1 else None)
    # SGLang marks a request's final output as sent (``finished_output``) and skips it in later
    # calls (the overlap scheduler streams a finished request again): only this call's count.
    pending = [req for req in reqs if req is not skip and not getattr(req, "finished_output", False)]
    out = original_fn(self, reqs, *args, **kwargs)
    sent = time.perf_counter()
    for req in pending:
        if req.finished() and getattr(req, "finished_output", False):
            append_record(path, {"kind": "request", "tokens": len(req.origin_input_ids),
                                 "queued": req.time_stats.wait_queue_entry_time, "sent": sent, "rank": _rank()})
    return out


def _copy_bandwidth_gbs() -> float | None:
    """:func:`bcg_bench.weights.copy_bandwidth_gbs` in a scheduler of a one-GPU engine, the process
    that runs the forwards, right after its capture, while the device is busy with nothing else; the
    2 GiB the 1 GiB copy holds (source and destination) go back to the device at once. ``None``
    across several GPUs (a rank's share of the weights is no model's floor) or where the device has
    no room for the copy."""
    import torch

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return None
    try:
        return weights.copy_bandwidth_gbs()
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        torch.cuda.empty_cache()


def _weight_bytes(model_runner: Any) -> tuple[int | None, int | None]:
    """This rank's weight bytes and the part in the embedding table (:func:`bcg_bench.weights.parameter_bytes`
    with SGLang's ``VocabParallelEmbedding``); the LM head counts as read, since SGLang's model forward,
    which the forward timer times, computes the last token's logits. ``None`` where the runner holds
    no model."""
    model = getattr(model_runner, "model", None)
    if model is None or not callable(getattr(model, "parameters", None)):
        return None, None
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return weights.parameter_bytes(model, (VocabParallelEmbedding,), read_types=(ParallelLMHead,))


def after_capture_prefill_graph(result, *args, **kwargs):
    path = record_path()
    if not path:
        return None
    weight_bytes, vocab_weight_bytes = _weight_bytes(kwargs.get("model_runner", args[0] if args else None))
    runner = getattr(result, "runner", None)
    core = getattr(runner, "core", None)
    if core is not None:  # the forward timer reads which variant each replay ran in from its counters
        _BCG_STATS["stats"] = core.stats
    append_record(path, {
        "kind": "capture",
        "rank": _rank(),
        "runner": type(runner).__name__,
        "memory_gib": float(getattr(result, "memory_usage_gb", 0.0) or 0.0),
        "seconds": float(getattr(result, "capture_time", 0.0) or 0.0),
        "bcg_pool_gib": core.stats.pool_bytes / 2**30 if core is not None else None,
        "bcg_graph_gib": core.stats.graph_bytes / 2**30 if core is not None else None,
        "bcg_capture_s": core.stats.capture_seconds if core is not None else None,
        "bcg_warmup_s": core.stats.warmup_seconds if core is not None else None,
        "bcg_config": core.config.to_dict() if core is not None else None,
        # bcg's runner is built before it captures; one whose capture failed serves eagerly.
        "bcg_buckets": core.stats.buckets_captured if core is not None else None,
        "bcg_graph_attention_buckets": sorted(core.graph_attention) if core is not None else None,
        "bcg_graph_variants": {str(b): list(v) for b, v in core.graph_variants.items()} if core is not None else None,
        # Layers whose KV-cache store the capture put in the segment before their break.
        "bcg_store_in_graph_layers": len(runner.host.stored_in_graph) if core is not None else None,
        "weight_bytes": weight_bytes,
        "vocab_weight_bytes": vocab_weight_bytes,
        "copy_bandwidth_gbs": _copy_bandwidth_gbs() if weight_bytes else None,
    })
    return None


def _timer(target: str, how: Hook, hook, reason: str, remove_when: str) -> Patch:
    """A bench timer, placed wherever the plugin itself runs."""
    return Patch(target=target, how=how, make=lambda: hook, reason=f"benchmark only: {reason}",
                 hosts=str(GATE.supported), upstream=NOT_FILED, remove_when=remove_when)


FORWARD = _timer(FORWARD_TARGET, Hook("AROUND", params=("self", "forward_batch")), around_forward,
                 "model-forward time of prefill forwards (CUDA events)",
                 "SGLang's device timer exposes per-forward prefill times to clients")
STEP = _timer(STEP_TARGET, Hook("AROUND", params=("self", "batch")), around_step,
              "wall time of the worker's extend steps, model forward and sampling",
              "SGLang's request metrics split a request's time into scheduler, forward and sampling")
CAPTURE = _timer(CAPTURE_TARGET, Hook("AFTER", params=("model_runner", "eager_runner")), after_capture_prefill_graph,
                 "capture time and graph memory per prefill backend",
                 "SGLang reports graph memory/time per phase through get_server_info")
OUTPUT = _timer(OUTPUT_TARGET, Hook("AROUND", params=("self", "reqs", "return_logprob", "skip_req")),
                around_stream_output,
                "when each finished request's output left the scheduler, beside SGLang's own queue-entry time",
                "SGLang's request metrics reach clients without enabling its metrics exporter")
TIMERS = (FORWARD, STEP, OUTPUT, CAPTURE)


def is_installed(patch: Patch) -> bool:
    """Whether ``patch``'s hook is in its target's wrapper chain (SGLang only logs a hook that failed)."""
    return patch.how.in_place(patch.target, patch.make())


def install() -> None:
    """Register the timers and apply them with every plugin's hooks, in a process about to run a scheduler.

    Raises ``RuntimeError`` naming the target when a timer cannot be placed: a bench whose timers
    are missing would report no forward times rather than fail.
    """
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    problems = PatchSet("bench timers", TIMERS).problems()
    if problems:
        raise RuntimeError(f"bcg bench: cannot time this SGLang: {'; '.join(problems)}")
    # Registered, not applied: load_plugins() builds each target's chain once with the plugins'
    # hooks (bcg's on capture_prefill_graph included); applying these first would leave those out.
    source = HookSource(plugin_name="bcg-bench", dist_name=None)
    for patch in TIMERS:
        if not is_installed(patch):
            HookRegistry.register(patch.target, patch.make(), HookType[patch.how.kind], source=source)
    load_plugins()  # applies every registered hook, the plugins' and these, one chain per target
    HookRegistry.apply_hooks()  # where the plugins were loaded before: no-op for targets already built
    missing = [p.target for p in TIMERS if not is_installed(p)]
    if missing:
        raise RuntimeError(f"bcg bench: SGLang did not install the bench timers on {missing} (see SGLang's log)")


def run_scheduler_process(*args, **kwargs):
    """SGLang's scheduler process, with the bench's timers installed first (spawn target)."""
    from sglang.srt.managers import scheduler

    install()
    return scheduler.run_scheduler_process(*args, **kwargs)


@functools.cache
def engine_class() -> type:
    """``sglang.Engine`` whose schedulers run :func:`run_scheduler_process`."""
    from sglang.srt.entrypoints.engine import Engine  # what sglang.Engine lazily stands for

    class TimedEngine(Engine):
        """An SGLang engine whose schedulers record their forwards and capture (see the module)."""

        run_scheduler_process_func = staticmethod(run_scheduler_process)

    return TimedEngine


def start_engine(record: str | Path, **engine_kwargs):
    """An SGLang engine (``engine_kwargs`` as ``sglang.Engine`` takes them) whose schedulers append
    their records to ``record``."""
    previous = os.environ.get(RECORD_ENV)
    os.environ[RECORD_ENV] = str(record)  # read by every scheduler, which inherits the environment at spawn
    try:
        return engine_class()(**engine_kwargs)
    finally:
        if previous is None:
            os.environ.pop(RECORD_ENV, None)
        else:
            os.environ[RECORD_ENV] = previous
