"""bcg's prefill runner in SGLang's ``model_runner.prefill_cuda_graph_runner`` slot.

One replay is a straight line (:meth:`BcgPrefillRunner.execute`): SGLang asks ``can_run_graph``
(the adapter picks the bucket, honouring the DP vote), the live batch's attention metadata is
planned, and the core lands the inputs, replays segments and attention breaks, and runs the
logits tail (:class:`~bcg_plugin.adapters.sglang.host.SglangHost`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from bcg_plugin import BcgConfig, Fallback, HostBatch, PrefillGraphRunner, faults, plugin_manager
from bcg_plugin.adapters.sglang import config, eligibility
from bcg_plugin.adapters.sglang.attention import step_real_rows
from bcg_plugin.adapters.sglang.host import SglangHost, batch_forward_context, graph_size_multiple, tp_group
from bcg_plugin.adapters.sglang.metrics import stats_reporter
from bcg_plugin.dist import first_rank
from bcg_plugin.errors import BcgCaptureError
from bcg_plugin.ladder import choose_bucket, ladder_top, ladder_top_note, padding_allows

logger = logging.getLogger("bcg_plugin.sglang")


class BcgPrefillRunner:
    """Duck-typed stand-in for SGLang's ``PrefillCudaGraphRunner`` (not an ``EagerRunner``).

    Holds the core :class:`~bcg_plugin.PrefillGraphRunner` (graphs in its own private pool, one
    capture stream, owned inputs/outputs), the SGLang host hooks, the bucket chosen by the last
    ``can_run_graph`` for the ``execute`` that follows it, and the periodic stats reporter (log line, Prometheus when SGLang's metrics are on).
    SGLang's scheduler calls :meth:`can_replay_locally` for the DP vote; ``enable_lora``,
    ``enable_cp_v2_bcg_capture`` (``enable_cp_bcg_capture`` from 0.5.23), ``max_context_size`` and
    ``max_seq_len`` are read by SGLang and always off here (bcg's graphs bound no context length: the
    attention runs eagerly on the live batch).

    The methods SGLang calls take any further keyword arguments: one a later SGLang adds names a
    condition bcg does not know, so the forward runs eagerly (counted, named in one log line)
    instead of failing with a ``TypeError`` inside the scheduler.
    """

    enable_lora = False
    enable_cp_v2_bcg_capture = False
    enable_cp_bcg_capture = False
    max_context_size = None
    max_seq_len = None

    def __init__(self, model_runner: Any, cfg: BcgConfig, host: SglangHost):
        from sglang.srt.distributed.parallel_state import graph_capture

        self.model_runner = model_runner
        self.host = host
        prefill = prefill_graph_config(model_runner)
        self.core = PrefillGraphRunner(plugin_manager(host), cfg,
                                       chunk_size=step_token_limit(model_runner, log=_first_tp_rank(model_runner)))
        self.stats_reporter = stats_reporter(self.core.stats, model_runner.server_args)
        self._planned: tuple[Any, int] | None = None
        self._previous_replay: Any = None  # kept only for a fault plugin (bcg_plugin.faults)
        self._unknown_kwargs_logged = False
        tp_group(model_runner).barrier()
        host.stored_in_graph.clear()
        # SGLang's capture context: its stream, and custom all-reduce buffer registration for TP.
        with graph_capture() as ctx:
            host.capture_stream = ctx.stream
            with _breakable_capture_flag():
                self.core.capture(progress=_first_tp_rank(model_runner))
        host.capture_stream = None
        if self.core.captured:
            # SGLang's DP MAX_LEN padding compares against this list: keep it equal to bcg's ladder.
            prefill.bs = list(self.core.buckets)
            host.graph.release_variants(self.core.graph_variants)
            if _first_tp_rank(model_runner):
                logger.info("%s", store_summary(len(host.stored_in_graph), len(model_runner.attention_layers),
                                                len(self.core.graph_attention), len(self.core.buckets)))
        else:  # every rank prefills eagerly: nothing will plan into graph attention's wrappers
            host.graph.release()

    # -- SGLang's runner interface -------------------------------------------------------------

    def can_replay_locally(
        self,
        *,
        batch_size: int,
        num_tokens: int | None,
        input_embeds: Any,
        replace_embeds: Any,
        prefix_lens: Any,
        is_target_verify: bool,
        capture_hidden_mode: Any,
        return_logprob: bool,
        lora_ineligible: bool = False,
        chunked_prefix_uncapturable: bool = False,
        is_mixed: bool = False,
        batch_max_context_len: int | None = None,
        contains_mm_inputs: bool = False,
        **unknown: Any,
    ) -> bool:
        """This rank's vote: a pure function of the batch, so every rank votes alike for alike.

        Mixed batches and any context length replay (the attention break runs on the live batch);
        ``chunked_prefix_uncapturable`` (through 0.5.22) and ``contains_mm_inputs`` (0.5.23 on) mean eager.
        """
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        if (not self.core.captured or lora_ineligible or chunked_prefix_uncapturable or contains_mm_inputs
                or is_target_verify):
            return False
        if self._refuses_unknown(unknown, "can_replay_locally"):
            return False
        if input_embeds is not None or replace_embeds is not None:
            return False
        # The tail returns views of the shared output buffer as hidden states otherwise.
        if capture_hidden_mode is not None and capture_hidden_mode != CaptureHiddenMode.NULL:
            return False
        if num_tokens is None:
            return True
        bucket = choose_bucket(self.core.buckets, num_tokens)
        return bucket is not None and padding_allows(bucket, num_tokens, self.core.config.max_padding_ratio)

    def schedule_vote(self, *, local_batch: Any, coordinated_prefill: bool, num_tokens: int | None = None,
                      **_: Any) -> bool:
        """This rank's DP-attention vote on the step it schedules (SGLang 0.5.21 on, through
        :mod:`~bcg_plugin.patches.sglang.dp_prefill_vote`): :meth:`can_replay_locally` on its extend
        or mixed batch; an idle rank does not hold the others back; a decoding rank votes no."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        if local_batch is None or local_batch.forward_mode.is_idle():
            return True
        mode = local_batch.forward_mode
        if not coordinated_prefill or mode not in (ForwardMode.EXTEND, ForwardMode.MIXED):
            return False
        return self.can_replay_locally(
            batch_size=local_batch.batch_size(),
            num_tokens=local_batch.extend_num_tokens if num_tokens is None else num_tokens,
            input_embeds=local_batch.input_embeds,
            replace_embeds=local_batch.replace_embeds,
            prefix_lens=local_batch.prefix_lens,
            is_target_verify=mode.is_target_verify(),
            capture_hidden_mode=None,
            return_logprob=local_batch.return_logprob,
            lora_ineligible=self.enable_lora,
            is_mixed=mode == ForwardMode.MIXED,
        )

    def can_run_graph(self, forward_batch: Any, **unknown: Any) -> bool:
        self._planned = None
        self.stats_reporter.tick()
        if self._refuses_unknown(unknown, "can_run_graph") or not self.can_replay_locally(
            batch_size=forward_batch.batch_size,
            num_tokens=None,
            input_embeds=forward_batch.input_embeds,
            replace_embeds=forward_batch.replace_embeds,
            prefix_lens=forward_batch.extend_prefix_lens_cpu,
            is_target_verify=forward_batch.forward_mode.is_target_verify(),
            capture_hidden_mode=forward_batch.capture_hidden_mode,
            return_logprob=forward_batch.return_logprob,
        ):
            if self.core.captured:
                self.core.record_fallback(Fallback.FEATURE_NOT_CAPTURED)
            return False
        across_dp = forward_batch.global_num_tokens_cpu
        if across_dp is not None and len(across_dp) != (self.host.dp_ranks or 1):
            # The graphs gather over as many ranks as they were captured for; another width would
            # overrun their gather buffer. The width is replicated: every rank refuses alike.
            if self.core.captured:
                self.core.record_fallback(Fallback.FEATURE_NOT_CAPTURED)
            return False
        if across_dp is not None and len(across_dp) > 1:
            # SGLang's schedule-time vote (all ranks' can_replay_locally, min-reduced) plus every
            # rank holding tokens: replicated values, so every rank takes the same branch.
            agreed = _dp_vote(forward_batch) and all(int(n) > 0 for n in across_dp)
            bucket = self.core.bucket_for(
                len(forward_batch.input_ids),
                num_tokens_across_dp=[int(n) for n in across_dp],
                all_ranks_extend=agreed,
            )
        else:
            bucket = self.core.bucket_for(len(forward_batch.input_ids))
        if bucket is None:
            return False
        if bucket in self.core.graph_attention and not self.host.graph.fits(forward_batch):
            # More requests than the bucket's attention was captured for (a mixed step's decodes
            # count as requests): a graph whose attention breaks takes any count. Not under DP
            # attention (graph attention declines it), so no other rank waits on this one's choice.
            bucket, reason = self._breaking_graph_from(bucket, len(forward_batch.input_ids))
            if bucket is None:
                self.core.record_fallback(reason)
                return False
        self._planned = (forward_batch, bucket)
        return True

    def execute(self, forward_batch: Any, **kwargs: Any) -> Any:
        planned, self._planned = self._planned, None
        if planned is None or planned[0] is not forward_batch:
            raise RuntimeError("bcg: execute() without a matching can_run_graph() for this batch")
        bucket = planned[1]
        variant = self.host.graph.variant_for(forward_batch, self.core.graph_variants.get(bucket, ()))
        self._plan_attention(forward_batch, bucket, variant)
        self.host.land_real_rows(step_real_rows(forward_batch, len(forward_batch.input_ids)), bucket)
        slots = forward_batch.out_cache_loc
        if faults.active():
            slots = _graph_slots(bucket, slots)
        batch = HostBatch(
            num_tokens=len(forward_batch.input_ids),
            inputs={"input_ids": forward_batch.input_ids, "positions": forward_batch.positions, "out_cache_loc": slots},
            payload=self.host.forward_pass(forward_batch, kwargs),
        )
        return self.core.replay(bucket, batch, variant)

    # -- helpers -------------------------------------------------------------------------------

    def _breaking_graph_from(self, bucket: int, num_tokens: int) -> tuple[int | None, Fallback | None]:
        """The smallest bucket from ``bucket`` up with a graph whose attention breaks (its
        :data:`~bcg_plugin.BREAKING` variant, which :meth:`execute` then picks, or its own), or
        ``None`` and why not: there is none (every bucket under ``graph``, without variants), or the
        padding limit keeps ``num_tokens`` out of it."""
        core = self.core
        above = [b for b in core.buckets if b >= bucket and core.breaks_attention(b)]
        if not above:
            return None, Fallback.FEATURE_NOT_CAPTURED
        if not padding_allows(above[0], num_tokens, self.core.config.max_padding_ratio):
            return None, Fallback.PADDING_RATIO
        return above[0], None

    def _refuses_unknown(self, unknown: dict[str, Any], method: str) -> bool:
        """Whether SGLang passed keyword arguments this runner does not know (then: eager)."""
        if not unknown:
            return False
        if not self._unknown_kwargs_logged:
            self._unknown_kwargs_logged = True
            logger.warning("bcg: SGLang passes %s(%s), which bcg does not know; those forwards run eagerly",
                           method, ", ".join(sorted(unknown)))
        return True

    def _plan_attention(self, forward_batch: Any, bucket: int, variant: str | None = None) -> None:
        """Plan attention for the live batch (the one per-replay metadata step, outside the graph).

        A fault plugin (:mod:`bcg_plugin.faults`, tests only) may have the previous replay's batch
        planned instead, when that was an extend of the same token count (in bounds, but wrong).
        """
        backend = self.model_runner.attn_backend
        earlier = None
        if faults.active():
            previous, self._previous_replay = self._previous_replay, forward_batch
            if (
                previous is not None
                and previous.forward_mode.is_extend()  # an idle DP rank's padded forward is IDLE again by now
                and len(previous.input_ids) == len(forward_batch.input_ids)
            ):
                earlier = previous
        planned = faults.replay_metadata("sglang", bucket, live=forward_batch, earlier=earlier)
        if planned is forward_batch and hasattr(self.model_runner.model, "prepare_forward_batch"):
            self.model_runner.model.prepare_forward_batch(forward_batch)
        with batch_forward_context(self.model_runner, planned):
            if self.core.attention_inside(bucket, variant):  # into what the graph reads
                self.host.graph.plan_replay(planned, variant)
            else:
                backend.init_forward_metadata(planned)

    def close(self) -> None:
        self.core.close()
        self.host.graph.release()


def store_summary(stored: int, layers: int, graph_buckets: int, buckets: int) -> str:
    """Where the captured forward stores each layer's KV cache, as the line after bcg's capture
    summary says it: ``stored`` of the model's ``layers`` store in the segment before their break
    (:func:`~bcg_plugin.adapters.sglang.attention.stores_in_segment`); in ``graph_buckets`` of the
    ``buckets`` attention, and its store with it, stays inside the graph."""
    if buckets and graph_buckets == buckets:
        return "bcg: KV-cache store inside the graph with attention, in every bucket"
    if stored and stored == layers:
        where = "captured in the segment before each layer's break"
    elif stored:
        where = f"captured in the segment before the break in {stored} of {layers} layers, in the break in the others"
    else:
        where = ("in each layer's eager break, as SGLang stores it (captured in the segment only on the triton, "
                 "flashinfer and fa3 backends with SGLang's plain MHA pool)")
    if graph_buckets:
        where += f"; inside the graph with attention in the {graph_buckets} of {buckets} buckets that keep attention there"
    return f"bcg: KV-cache store {where}"


def step_token_limit(model_runner: Any, *, log: bool = False) -> int:
    """bcg's top bucket (:func:`bcg_plugin.ladder.ladder_top`): SGLang's prefill graph ceiling (its
    chunked-prefill size), or what its request pool's rows (``max_running_requests``, per DP worker)
    hold at ``context_len`` tokens each, where that is less.

    Where SGLang scatters a step's rows between attention-TP ranks it pads every step to a multiple
    of its graph sizes (:func:`~bcg_plugin.adapters.sglang.host.graph_size_multiple`) and rounds its
    own prefill graphs up to one: a full chunk then arrives that padding above the ceiling, and the
    top bucket is the ceiling rounded up likewise, so that the chunk replays as in SGLang's graphs.
    Not past the pool's tokens, which no capture batch can exceed."""
    from sglang.srt.utils.common import ceil_align

    prefill = prefill_graph_config(model_runner)
    chunk = published("schedule", "chunked_prefill_size", model_runner.server_args)
    if prefill.max_bs:
        ceiling = int(prefill.max_bs)
    elif chunk and chunk > 0:
        ceiling = int(chunk)
    else:
        ceiling = int(max(prefill.bs))
    padded = ceil_align(ceiling, graph_size_multiple(model_runner))  # SGLang's own padding of a step
    pool = getattr(model_runner, "req_to_token_pool", None)
    if pool is None:
        return padded
    context_len = int(model_runner.model_config.context_len)
    note = ladder_top_note(padded, int(pool.size), context_len,
                           ("SGLang's prefill ceiling", "the request pool's rows", "context_len"))
    if note is not None and log:
        logger.info("%s", note)
    return ladder_top(padded, int(pool.size), context_len)


def published(group: str, name: str, server_args: Any, section: str = "graph") -> Any:
    """A resolved setting as SGLang publishes it (0.5.19 on: ``get_exec()``/``get_schedule()``; the
    ``ServerArgs`` record then keeps the operator's input), else as ``server_args`` holds it.
    ``section``: the part of ``get_exec()`` that holds it."""
    from sglang.srt import runtime_context

    try:
        bag = getattr(runtime_context, f"get_{group}")()
        value = getattr(getattr(bag, section), name) if group == "exec" else getattr(bag, name)
    except Exception:  # not published (0.5.17/0.5.18, a unit test, early start-up)
        value = None
    return getattr(server_args, name) if value is None else value


def prefill_graph_config(model_runner: Any) -> Any:
    """The prefill phase of the CUDA-graph config SGLang's own prefill runner reads."""
    return published("exec", "cuda_graph_config", model_runner.server_args).prefill


def _first_tp_rank(model_runner: Any) -> bool:
    def tp_rank() -> int:
        ps = getattr(model_runner, "ps", None)
        if ps is not None:
            return ps.tp_rank
        from sglang.srt.runtime_context import get_parallel  # SGLang 0.5.23 keeps it there only

        return get_parallel().tp_rank

    return first_rank(tp_rank)


def _graph_slots(bucket: int, slots: Any) -> Any:
    """The cache slots the graph's KV-cache store reads (:func:`~bcg_plugin.adapters.sglang.attention.stores_in_segment`),
    as a fault plugin (tests only) may leave them: a copy of the batch's, offered beside the slots the
    bucket was captured with (SGLang's padding slot, every row). The batch keeps its own tensor."""
    live = {"out_cache_loc": slots.clone()}
    faults.graph_metadata("sglang", bucket, live=live, earlier={"out_cache_loc": slots.new_zeros(slots.shape)})
    return live["out_cache_loc"]


def _dp_vote(forward_batch: Any) -> bool:
    """SGLang's min-reduced DP vote on this batch (renamed from the breakable to the prefill graph in 0.5.19)."""
    for name in ("can_run_dp_prefill_cuda_graph", "can_run_dp_breakable_cuda_graph"):
        if hasattr(forward_batch, name):
            return bool(getattr(forward_batch, name))
    return False


class _breakable_capture_flag:
    """SGLang's process-global 'in a breakable capture' flag, on while bcg captures, and SGLang's
    own graph breaks refused for as long.

    RadixAttention and the capture-mode checks key off the flag; its context manager is SGLang's own.
    Under it, model code takes its breakable branches: a break bcg routes to its own runs as bcg's
    eager break, any other would run inline with the capture batch's metadata, so it fails the
    capture instead (:mod:`bcg_plugin.patches.sglang.breakable_capture_var`) and every rank
    prefills eagerly.
    """

    def __enter__(self):
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
            enable_breakable_cuda_graph,
        )

        from bcg_plugin.patches.sglang.breakable_capture_var import refusing_breaks

        with contextlib.ExitStack() as stack:
            stack.enter_context(enable_breakable_cuda_graph())
            stack.enter_context(refusing_breaks(_unrouted_break))
            self._stack = stack.pop_all()
        return None

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


def _unrouted_break(op: str) -> BcgCaptureError:
    return BcgCaptureError(
        f"bcg cannot capture SGLang's graph break {op}: bcg has no break of its own for it, and run inline it "
        "would be captured with the capture batch's metadata; serve this model with SGLang's own prefill "
        "graphs (--cuda-graph-backend-prefill breakable)"
    )


def build_runner(model_runner: Any, native_cls: type, cfg: BcgConfig) -> Any:
    """bcg's runner for ``model_runner``, or SGLang's ``native_cls`` runner if bcg cannot serve it."""
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import _resolve_transformer_layer_model

    layer_model = _resolve_transformer_layer_model(model_runner.model)
    reason = eligibility.layers_reason(model_runner, layer_model)
    if reason is not None:
        logger.warning("bcg: not serving prefill for this model (%s); SGLang's own runner is used", reason)
        return native_cls(model_runner)
    host = SglangHost(model_runner, layer_model,
                      chunk=published("schedule", "chunked_prefill_size", model_runner.server_args))
    return BcgPrefillRunner(model_runner, cfg, host)


def dp_prefill_vote(runner: Any) -> Any:
    """What the DP-vote patch asks: bcg's vote for ``runner`` when it is bcg's, else ``None``."""
    return runner.schedule_vote if isinstance(runner, BcgPrefillRunner) else None


def prefill_runner_factory(model_runner: Any) -> Any:
    """What the ``capture_prefill_graph`` patch builds in place of SGLang's prefill runner:
    ``factory(model_runner, native_cls)``, or ``None`` to keep SGLang's (bcg off, not enabled, or
    a runner bcg does not serve, named in one warning)."""
    from bcg_plugin.adapters.sglang.plugin import is_active

    if not is_active() or model_runner is None:
        return None
    cfg = config.read_config()
    if not cfg.active:
        return None
    reason = eligibility.runner_reason(model_runner)
    if reason is not None:
        if not model_runner.is_draft_worker:
            logger.warning("bcg: not serving prefill (%s); SGLang's own runner is used", reason)
        return None
    return lambda runner, native_cls: build_runner(runner, native_cls, cfg)
