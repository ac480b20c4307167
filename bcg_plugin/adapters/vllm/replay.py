"""One vLLM model runner's prefill graphs: what the patched runner methods call.

The runner patches stay one-liners that hand over to :class:`VllmPrefillGraphs`:
``dispatch`` -> :meth:`bucket_for`, the PIECEWISE forward -> :meth:`forward`, capture ->
:meth:`capture`. A replay then reads as one line: vLLM's dispatch picked the bucket (so DP ranks
agree through vLLM's own synchronisation), the core lands the inputs, replays segments and
attention breaks, and the hidden rows go back to vLLM's eager logits path.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from bcg_plugin import BcgStateError, Fallback, HostBatch, PrefillGraphRunner, faults, plugin_manager
from bcg_plugin.adapters.vllm.config import STEP_LIMIT_NAMES, SUPPORTED_BACKENDS, bcg_config, step_limits
from bcg_plugin.adapters.vllm.host import VllmHost
from bcg_plugin.adapters.vllm.launch import warn_declined
from bcg_plugin.adapters.vllm.log import logger
from bcg_plugin.adapters.vllm.metrics import METRICS_ENV, METRICS_NOTE, stats_reporter
from bcg_plugin.dist import first_rank
from bcg_plugin.ladder import ladder_top, ladder_top_note

_GRAPH_INPUTS = ("input_ids", "positions", "inputs_embeds")

# Every live instance in this process, for the stats RPC (metrics.py; weak: runners own them).
INSTANCES: weakref.WeakSet = weakref.WeakSet()


def step_token_limit(vllm_config: Any, *, log: bool = False) -> int:
    """bcg's top bucket (:func:`bcg_plugin.ladder.ladder_top`): ``max_num_batched_tokens``, or
    ``max_num_seqs`` x ``max_model_len`` where that is smaller (vLLM only warns about such a chunk)."""
    numbers = step_limits(vllm_config)
    note = ladder_top_note(*numbers, STEP_LIMIT_NAMES)
    if note is not None and log:
        logger.info("%s", note)
    return ladder_top(*numbers)


def runner_unsupported_reason(model: Any, attn_groups: Any, kv_cache_config: Any) -> str | None:
    """Features only a built runner reveals: attention backends, KV-cache kinds, model inputs."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    if not torch.cuda.is_available():
        return "no CUDA device"
    backends = {group.backend.get_name() for groups in attn_groups for group in groups}
    unsupported = sorted(backends - set(SUPPORTED_BACKENDS))
    if unsupported:
        return f"attention backend(s) {unsupported} (supported: {', '.join(SUPPORTED_BACKENDS)})"
    if any(not isinstance(g.kv_cache_spec, AttentionSpec) for g in kv_cache_config.kv_cache_groups):
        return "KV-cache groups other than attention (e.g. Mamba state)"
    if getattr(model, "requires_raw_input_tokens", False) or not hasattr(model, "embed_input_ids"):
        return "models that read raw token ids inside the body"
    return None


class VllmPrefillGraphs:
    """The core runner and the vLLM host hooks for one model runner.

    Attributes:
        host: the hooks (:class:`~bcg_plugin.adapters.vllm.host.VllmHost`) the core calls.
        runner: the core :class:`~bcg_plugin.PrefillGraphRunner` (ladder up to the chunk size, or
            :func:`step_token_limit` where a step can hold fewer tokens).
        reporter: the periodic stats line and Prometheus counters (:mod:`~bcg_plugin.adapters.vllm.metrics`).
    """

    def __init__(self, host: VllmHost, vllm_config: Any, *, reports: bool = True):
        self.host = host
        self._reports = reports and _first_tp_rank()
        self.runner = PrefillGraphRunner(
            plugin_manager(*host.plugins()), bcg_config(vllm_config),
            chunk_size=step_token_limit(vllm_config, log=self._reports), device=host.device,
        )
        self._buckets = frozenset()
        self._graph_requests: dict[int, int] = {}
        self._one_token_steps_apart = False  # such steps run eagerly, not in a graph-attention bucket
        self._dispatched: dict[int, int] = {}  # bucket -> the token count vLLM last dispatched to it
        self._slot_mapping_probe: tuple[tuple[str, int], ...] = ()
        self.reporter = stats_reporter(self.runner.stats, reports=self._reports)
        if self._reports and METRICS_ENV not in os.environ:
            logger.info("bcg: %s", METRICS_NOTE)
        if reports:  # graphs built only to measure memory are no engine's runners: the stats RPC skips them
            INSTANCES.add(self)

    @classmethod
    def build(cls, host_factory: Any, vllm_config: Any, *, model: Any, attn_groups: Any,
              kv_cache_config: Any, reports: bool = True) -> VllmPrefillGraphs | None:
        """The graphs for a runner, or ``None`` (logged once) if the runner has a feature bcg skips.

        ``reports=False``: graphs built only to estimate memory; they log no stats, export no
        metrics and leave the unsupported-feature warning to the graphs that capture.
        """
        reason = runner_unsupported_reason(model, attn_groups, kv_cache_config)
        if reason is not None:
            if reports and _first_tp_rank():
                warn_declined(vllm_config, f"{reason} is not supported")
            return None
        return cls(host_factory(), vllm_config, reports=reports)

    # -- capture ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        with self.host.capturing():
            self.runner.capture(progress=self._reports)
        if not self.runner.captured:
            self.host.lower_graph_bound()
            if self.runner.buckets and self._reports:  # the capture failed, with capture_failure "eager"
                warn_declined(self.host.vllm_config, "the prefill graph capture failed")
            return
        self._buckets = frozenset(self.runner.buckets)
        self._graph_requests = {b: self.host.graph_requests(b) for b in self.runner.graph_attention}
        self._one_token_steps_apart = bool(self._graph_requests) and self.host.plans_one_token_steps_apart()
        self._slot_mapping_probe = slot_mapping_probe(self.host.capture_contexts[self.runner.buckets[-1]])
        if not faults.active():  # a fault plugin may have replays read them (bcg_plugin.faults)
            self.host.capture_contexts.clear()
            self.host.capture_metadata.clear()

    @torch.inference_mode()
    def estimate(self) -> int:
        """The device memory :meth:`capture` will take (see :meth:`PrefillGraphRunner.estimate_graph_bytes`);
        the caller then closes these graphs, which drops the sampled buckets' capture contexts."""
        with self.host.capturing():
            return self.runner.estimate_graph_bytes()

    # -- per step --------------------------------------------------------------------------------

    def bucket_for(self, num_tokens: int, num_reqs: int | None = None) -> int | None:
        """The padded size vLLM should run ``num_tokens`` (of ``num_reqs`` requests, where known) at,
        or ``None`` (eager; reason counted)."""
        bucket = self.runner.bucket_for(num_tokens)
        self.reporter.tick()
        if bucket is None:
            return None
        if (self._one_token_steps_apart and bucket in self._graph_requests
                and num_reqs is not None and num_reqs >= num_tokens):
            self.runner.record_fallback(Fallback.FEATURE_NOT_CAPTURED)
            return None
        self._dispatched[bucket] = num_tokens
        return bucket

    def graph_requests(self, bucket: int) -> int | None:
        """The request count vLLM pads a step to for ``bucket``, whose attention is captured inside
        the graph (its FULL-mode metadata is built for that many); ``None`` where attention breaks."""
        return self._graph_requests.get(bucket)

    def forward_full(self, bucket: int) -> Any:
        """Replay ``bucket``, whose attention is inside the graph, for the step vLLM just landed in its
        persistent buffers (V2 ``run_fullgraph``: no forward context is set, none is read).

        The step's real token count is the one vLLM last dispatched to this bucket: this rank's own,
        as graph attention is declined under data parallelism (where the dispatched count would be
        the count synced across ranks, and the rows past this rank's batch would go unscrubbed).
        """
        num_tokens = self._dispatched.pop(bucket, None)
        if num_tokens is None:
            raise BcgStateError(f"vLLM replays bucket {bucket} with no token count dispatched to it")
        inputs = {name: buf[:bucket] for name, buf in self.host.persistent_inputs.items()}
        if faults.active():  # a test plugin may make the graph read metadata of another batch
            faults.graph_metadata("vllm", bucket, live=self.host.graph_metadata_buffers(),
                                  earlier=self.host.capture_metadata.get(bucket, {}))
        return self.runner.replay(bucket, HostBatch(num_tokens=num_tokens, inputs=inputs))

    def forward(self, model: Any, model_inputs: dict[str, Any], *, dummy: bool = False) -> Any:
        """Run one PIECEWISE-dispatched forward: replay its bucket, or eager if it cannot.

        ``dummy``: V1's ``_dummy_run`` (an idle DP rank padded to its peers' bucket). vLLM builds no
        attention metadata for it, so attention writes zeros and every row is padding.
        """
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        bucket = context.batch_descriptor.num_tokens
        batch = self._host_batch(context, model_inputs, bucket, dummy)
        if batch is None:
            self.runner.record_fallback(Fallback.FEATURE_NOT_CAPTURED)
            return model(**model_inputs)
        if batch.payload is not context:  # a fault plugin's choice: attention reads that context
            from vllm.forward_context import override_forward_context

            with override_forward_context(batch.payload):
                return self.runner.replay(bucket, batch)
        return self.runner.replay(bucket, batch)

    def _host_batch(self, context: Any, model_inputs: dict[str, Any], bucket: int,
                    dummy: bool = False) -> HostBatch | None:
        if bucket not in self._buckets:
            return None  # a size vLLM padded to on its own (V1 DP re-dispatch): no graph for it
        if bucket in self._graph_requests:
            return None  # its kernels read FULL-mode metadata padded to its request count; this step's is not
        if any(v is not None for k, v in model_inputs.items() if k not in _GRAPH_INPUTS):
            return None  # extra model inputs (intermediate tensors, model kwargs) are not captured
        requested = None
        if dummy and context.attn_metadata is None:
            num_tokens, requested = bucket, 0
        else:
            num_tokens = _num_actual_tokens(context.attn_metadata)
        if num_tokens is None or not 0 < num_tokens <= bucket:
            return None
        if self._slot_mapping_probe:
            live = context.slot_mapping or {}
            for layer, ptr in self._slot_mapping_probe:
                slots = live.get(layer)
                if slots is None or slots.data_ptr() != ptr:
                    return None
        if self.host.embeds_in_graph and model_inputs.get("inputs_embeds") is not None:
            return None  # the graph embeds token ids itself; embeddings from the host were not captured
        payload = faults.replay_metadata("vllm", bucket, live=context, earlier=self.host.capture_contexts.get(bucket))
        inputs = {k: model_inputs.get(k) for k in _GRAPH_INPUTS if model_inputs.get(k) is not None}
        return HostBatch(num_tokens=num_tokens, inputs=inputs, payload=payload, requested_tokens=requested)

    def close(self) -> None:
        self.runner.close()
        self.host.lower_graph_bound()
        self.host.capture_contexts.clear()
        self.host.capture_metadata.clear()
        self._buckets = frozenset()
        self._graph_requests = {}
        self._dispatched = {}


def slot_mapping_probe(context: Any) -> tuple[tuple[str, int], ...]:
    """One ``(layer, buffer address)`` per slot-mapping buffer of a capture context: one per KV-cache
    group (a sliding-window + full model has two). The captured KV-cache writes read each buffer at its
    capture-time address, so a replay checks vLLM still fills every one of them in place."""
    probe: dict[int, str] = {}
    for layer, slots in (context.slot_mapping or {}).items():
        probe.setdefault(slots.data_ptr(), layer)
    return tuple((layer, ptr) for ptr, layer in probe.items())


def _num_actual_tokens(attn_metadata: Any) -> int | None:
    """Real rows of the step: PIECEWISE metadata is built unpadded by both runners."""
    if not isinstance(attn_metadata, dict) or not attn_metadata:
        return None
    n = getattr(next(iter(attn_metadata.values())), "num_actual_tokens", None)
    return int(n) if n is not None else None


def _first_tp_rank() -> bool:
    def rank() -> int:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().rank_in_group

    return first_rank(rank)
