"""bcg's host hooks for one SGLang ``ModelRunner``: inputs, capture batch, body, tail."""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch

from bcg_plugin.adapters.sglang.attention import ForwardPass
from bcg_plugin.adapters.sglang.graph_attention import GraphAttention
from bcg_plugin import BcgConfig, HostBatch, StaticInput, hookimpl
from bcg_plugin.ladder import sharded_buckets


class SglangHost:
    """The pieces of one SGLang model runner that bcg's core captures and replays.

    Holds the runner, the module owning the decoder layers and their input embedding (the
    captured body) and the capture stream SGLang's ``graph_capture()`` context provides.

    The graph's per-row inputs are ``input_ids``, ``positions`` and ``out_cache_loc``: every
    per-token tensor model Python may read inside the body, so nothing the segments read is frozen
    at a capture-time address (padded rows: token 0, position 0, cache slot 0 which SGLang
    reserves for padding writes). The embedding lookup is captured in the first segment: batches
    that bring their own embeddings (multimodal, ``input_embeds``) never replay
    (:meth:`~bcg_plugin.adapters.sglang.replay.BcgPrefillRunner.can_replay_locally`), so no step needs an
    eager lookup or an embeddings copy. Where attention stays inside the graph, its per-request
    metadata lives in the backend's wrappers instead (:class:`GraphAttention`, ``graph``).
    """

    def __init__(self, model_runner: Any, layer_model: Any, chunk: int | None = None):
        self.model_runner = model_runner
        self.layer_model = layer_model
        self.device = torch.device(model_runner.device, torch.cuda.current_device())
        self.capture_stream: torch.cuda.Stream | None = None
        self._dp = _dp_layout(model_runner)
        # Per bucket, the capture-time DP token counts on the device. Graphs whose body reads them
        # (DP scatter under attention tensor parallelism) keep their addresses: they must outlive
        # the dummy batch that brought them, as SGLang's own runner keeps its dummy batch.
        self._dp_counts: dict[int, torch.Tensor] = {}
        self.graph = GraphAttention(model_runner, self._dp, chunk, self.device)
        self.stored_in_graph: set[int] = set()  # layers whose captured segment stores the KV cache
        # SGLang's count of a step's real rows (num_token_non_padded), which its MoE routing masks the
        # padded rows by; one device scalar every graph reads, made at the first capture where SGLang
        # masks (expert parallelism), else None.
        self._real_rows: torch.Tensor | None = None
        # The buckets whose count is this attention-TP rank's share, decided at their capture.
        self._shared_count: set[int] = set()

    def land_real_rows(self, num_tokens: int, bucket: int) -> torch.Tensor | None:
        """Set the count of real rows the graphs' MoE routing reads to the ``num_tokens`` of a step
        replayed in ``bucket`` (its real tokens, not the rows SGLang padded it with under DP
        attention), so a padded replay routes no padding row to an expert (nor counts it
        for expert load balancing), as SGLang's own graphs do; ``None`` where SGLang masks no padded
        rows. Where the bucket's rows are split between the attention-TP ranks (SGLang's sequence
        sharding, 0.5.20 on; asked once, at the bucket's capture), the count is this rank's share of
        them, as SGLang's own graphs count it."""
        if self._real_rows is not None:
            if bucket in self._shared_count:
                from sglang.srt.model_executor.forward_batch_info import compute_local_num_token_non_padded_cpu

                num_tokens = compute_local_num_token_non_padded_cpu(num_tokens, bucket, sharded=True)
            self._real_rows.fill_(num_tokens)
        return self._real_rows

    def _real_rows_for_capture(self, num_tokens: int, split: bool | None) -> torch.Tensor | None:
        """The capture batch's count for a bucket of ``num_tokens`` rows, ``split`` between the
        attention-TP ranks or not (``None``: this SGLang does not say, before 0.5.20)."""
        from sglang.srt.model_executor.forward_batch_info import enable_num_token_non_padded

        if self._real_rows is None and enable_num_token_non_padded():
            self._real_rows = torch.zeros((), dtype=torch.int32, device=self.device)
        if split and self._real_rows is not None:
            self._shared_count.add(num_tokens)
        return self.land_real_rows(num_tokens, num_tokens)

    @property
    def dp_ranks(self) -> int | None:
        """Ranks whose token counts the captured body gathers over, or ``None`` without DP attention."""
        return self._dp

    def forward_pass(self, forward_batch: Any, forward_kwargs: dict | None = None,
                     graph_variant: str | None = None) -> ForwardPass:
        return ForwardPass(
            forward_batch=forward_batch,
            attn_backend=self.model_runner.attn_backend,
            attention_layers=self.model_runner.attention_layers,
            forward_kwargs=forward_kwargs or {},
            stored_in_graph=self.stored_in_graph,
            graph_variant=graph_variant,
        )

    # -- bcg hooks -----------------------------------------------------------------------------

    @hookimpl
    def bcg_prefill_buckets(self, config: BcgConfig) -> list[int] | None:
        # Where a step's rows are scattered between the attention-TP ranks, each rank takes an equal
        # share, or the ranks' collectives disagree on their sizes: every bucket is a multiple of
        # SGLang's own for graph sizes (its eager steps pad to it; its prefill graphs round to it
        # from 0.5.23).
        return sharded_buckets(config.max_tokens, config.sizes, graph_size_multiple(self.model_runner))

    @hookimpl
    def bcg_static_inputs(self) -> dict[str, StaticInput]:
        return {
            "input_ids": StaticInput((), torch.int64, 0),
            "positions": StaticInput((), torch.int64, 0),
            "out_cache_loc": StaticInput((), torch.int64, 0),
        }

    @hookimpl
    def bcg_graph_attention(self, buckets: list[int], attention: str) -> list[int] | None:
        return self.graph.choose(buckets, attention)

    @hookimpl
    def bcg_graph_variants(self, buckets: list[int]) -> dict[int, list[str]] | None:
        return self.graph.variants(buckets)

    @hookimpl
    def bcg_dummy_batch(self, num_tokens: int, graph_attention: bool, variant: str | None) -> HostBatch:
        """A plain extend of ``num_tokens`` new tokens, as few requests as the context allows; for a
        graph-attention bucket, followed by zero-length requests up to the request slots and planned
        into the wrappers every replay of the bucket (or of its ``variant``) refills
        (:meth:`GraphAttention.plan_capture`)."""
        from sglang.srt.layers.dp_attention import DpPaddingMode
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

        mr, dev = self.model_runner, self.device
        split = _rows_split(ForwardBatch, mr, num_tokens)
        ctx = mr.model_config.context_len
        seq_lens = [min(ctx, num_tokens - s) for s in range(0, num_tokens, ctx)]
        positions = torch.cat([torch.arange(n, dtype=torch.int64, device=dev) for n in seq_lens])
        if graph_attention:
            seq_lens += [0] * (self.graph.request_slots - len(seq_lens))
        bs = len(seq_lens)
        starts = [sum(seq_lens[:i]) for i in range(bs)]  # zero-length requests start at the end
        lens = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        out_cache_loc = torch.zeros(num_tokens, dtype=torch.int64, device=dev)  # SGLang's padding slot
        dp = self._dp_fields(num_tokens)
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=bs,
            input_ids=ids,
            req_pool_indices=torch.arange(bs, dtype=torch.int64, device=dev),
            seq_lens=lens,
            orig_seq_lens=lens.clone(),
            seq_lens_cpu=lens.cpu(),
            out_cache_loc=out_cache_loc,
            seq_lens_sum=num_tokens,
            return_logprob=False,
            extend_num_tokens=num_tokens,
            extend_seq_lens=lens.clone(),
            extend_prefix_lens=torch.zeros(bs, dtype=torch.int64, device=dev),
            extend_start_loc=torch.tensor(starts, dtype=torch.int64, device=dev),
            extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=list(seq_lens),
            extend_logprob_start_lens_cpu=list(seq_lens),
            positions=positions,
            dp_padding_mode=DpPaddingMode.get_default_mode_in_cuda_graph(),
            spec_algorithm=None,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            global_forward_mode=ForwardMode.EXTEND,
            **{_non_padded_field(ForwardBatch): num_tokens},
            **({} if split is None else {"attn_tp_sequence_sharded": split}),
            num_token_non_padded=self._real_rows_for_capture(num_tokens, split),
            **dp,
        )
        # Planned once per bucket; every replay plans its own live batch instead.
        with batch_forward_context(mr, fb):
            if graph_attention:
                self.graph.plan_capture(fb, variant)
            else:
                mr.attn_backend.init_forward_metadata(fb)
        inputs = {"input_ids": ids, "positions": positions, "out_cache_loc": out_cache_loc}
        return HostBatch(num_tokens=num_tokens, inputs=inputs, payload=self.forward_pass(fb, graph_variant=variant))

    @hookimpl
    def bcg_body_forward(self, inputs: dict[str, torch.Tensor], payload: ForwardPass) -> torch.Tensor:
        from sglang.srt.layers.dp_attention import set_dp_buffer_len, set_is_extend_in_batch

        fb = payload.forward_batch
        rows = inputs["input_ids"].shape[0]
        # Model Python reading per-token fields inside the body must see the static buffers.
        fb.input_ids, fb.positions, fb.out_cache_loc = inputs["input_ids"], inputs["positions"], inputs["out_cache_loc"]
        fb.dp_local_start_pos = fb.dp_local_num_tokens = None
        set_dp_buffer_len(fb.global_dp_buffer_len, rows, fb.dp_padding_mode.is_max_len(), fb.global_num_tokens_cpu)
        set_is_extend_in_batch(False)
        with contextlib.ExitStack() as scope, torch.no_grad():
            for context in self._body_contexts(fb, rows):
                scope.enter_context(context)
            scope.enter_context(self.graph.body_scope(payload.graph_variant))
            hidden = self.layer_model.forward(inputs["input_ids"], inputs["positions"], fb)
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(
                f"{type(self.layer_model).__name__}.forward returned {type(hidden).__name__}, not hidden "
                "states (aux hidden states / pipeline proxies are not captured by bcg)"
            )
        return hidden

    def _body_contexts(self, fb: Any, rows: int) -> list[Any]:
        """The SGLang scopes the captured body runs in, as SGLang's own prefill runner enters them.

        The tc-piecewise context (through 0.5.22) or the prefill graph scope (0.5.23 on) is what
        makes RadixAttention take its graph break, which bcg's patch routes to its own break; bcg's
        break itself reads none of them.
        """
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
        from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import (
            set_tc_piecewise_forward_context,
        )

        mr = self.model_runner
        contexts: list[Any] = []
        scoped = _prefill_graph_scopes()
        if scoped is not None:
            set_forward_batch, prefill_graph_scope = scoped
            contexts += [set_forward_batch(fb), prefill_graph_scope(full_graph=False)]
        ctx = ForwardContext(attn_backend=mr.attn_backend)
        contexts.append(forward_context(ctx, forward_batch=fb) if _takes_batch(forward_context)
                        else forward_context(ctx))
        contexts.append(set_tc_piecewise_forward_context(
            fb,
            mr.attention_layers,
            getattr(mr.model, "quant_config", None),
            mr.moe_layers,
            mr.moe_fusions,
            dsa_indexers=getattr(mr, "dsa_indexers", None),
            mha_companion_layers=mr.mha_companion_layers,
            num_tokens=rows,
            raw_num_tokens=rows,
        ))
        return contexts

    @hookimpl
    def bcg_logits_tail(self, hidden: torch.Tensor, batch: HostBatch) -> Any:
        """The outer ``model.forward`` run eagerly on the live batch, its body replaced by ``hidden``.

        Whatever the model does after its decoder (logits processor, input logprobs, pooling)
        runs exactly as in an eager forward, on the real rows only.
        """
        fwd: ForwardPass = batch.payload
        fb = fwd.forward_batch
        layer_model = self.layer_model
        shadowed = layer_model.__dict__.get("forward")
        layer_model.forward = lambda *args, **kwargs: hidden
        try:
            with batch_forward_context(self.model_runner, fb), torch.no_grad():
                return self.model_runner.model.forward(fb.input_ids, fb.positions, fb, **fwd.forward_kwargs)
        finally:
            if shadowed is None:
                del layer_model.forward
            else:
                layer_model.forward = shadowed

    @hookimpl
    def bcg_world_group(self) -> Any:
        return getattr(tp_group(self.model_runner), "cpu_group", None)

    @hookimpl
    def bcg_capture_stream(self) -> torch.cuda.Stream | None:
        return self.capture_stream

    # -- data-parallel attention ---------------------------------------------------------------

    def _dp_fields(self, num_tokens: int) -> dict[str, Any]:
        """Capture-time DP layout: every rank at ``num_tokens`` (SGLang pads replays to match)."""
        if self._dp is None:
            return {}
        counts = [num_tokens] * self._dp
        gpu = self._dp_counts.setdefault(num_tokens, torch.tensor(counts, dtype=torch.int32, device=self.device))
        return {
            "global_num_tokens_cpu": counts,
            "global_num_tokens_gpu": gpu,
            "global_num_tokens_for_logprob_gpu": gpu,
            "global_dp_buffer_len": sum(counts),
        }


def batch_forward_context(model_runner: Any, fb: Any) -> Any:
    """The forward context SGLang 0.5.23 plans attention and runs a prefill tail in (it carries the
    batch's MoE padding count; model code reads the attention backend from it); before 0.5.23 SGLang
    does neither inside one, and neither does bcg."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    if not _takes_batch(forward_context):
        return contextlib.nullcontext()
    return forward_context(ForwardContext(attn_backend=model_runner.attn_backend), forward_batch=fb)


@functools.cache
def _takes_batch(forward_context: Any) -> bool:
    """Whether SGLang's ``forward_context`` takes the batch (0.5.23 on). Asked twice in every replay
    (the attention plan and the logits tail): the signature is read once per process, not on the
    host path every small step waits on."""
    return "forward_batch" in inspect.signature(forward_context).parameters


def tp_group(model_runner: Any) -> Any:
    """The runner's tensor-parallel group (SGLang 0.5.23 keeps it in the parallel context only)."""
    group = getattr(model_runner, "tp_group", None)
    if group is not None:
        return group
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_group


def _rows_split(forward_batch_cls: type, model_runner: Any, num_tokens: int) -> bool | None:
    """Whether a bucket's rows are split between the attention-TP ranks, as SGLang's own capture
    batch says it (0.5.20 on; ``None`` before): its MoE reads the real-row count as this rank's share
    only where the MoE input is scattered too, and where it gathers a single DP group's rows, no
    count at all."""
    sharded = getattr(model_runner, "attn_tp_sequence_sharded", None)
    if sharded is None or "attn_tp_sequence_sharded" not in getattr(forward_batch_cls, "__dataclass_fields__", {}):
        return None
    return bool(sharded(num_tokens))


def _non_padded_field(forward_batch_cls: type) -> str:
    """The ForwardBatch field holding the real-token count (renamed with a ``global_`` prefix in 0.5.20)."""
    fields = getattr(forward_batch_cls, "__dataclass_fields__", {})
    return "global_num_token_non_padded_cpu" if "global_num_token_non_padded_cpu" in fields else "num_token_non_padded_cpu"


def _prefill_graph_scopes() -> tuple[Any, Any] | None:
    """SGLang's prefill-graph scopes (0.5.23 on): the current batch and the runner-owned graph
    scope RadixAttention checks before it takes its eager attention; ``None`` before 0.5.23."""
    try:
        from sglang.srt.model_executor.runner_utils.forward_batch import set_forward_batch
        from sglang.srt.model_executor.runner_utils.prefill_graph import prefill_graph_scope
    except ImportError:
        return None
    return set_forward_batch, prefill_graph_scope


def _sglang_call(fn: Any, server_args: Any) -> Any:
    # SGLang's layout helpers took server_args until 0.5.19 made them read the process-wide configuration.
    positional = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return fn(server_args) if positional else fn()


def graph_size_multiple(model_runner: Any) -> int:
    """The multiple SGLang sizes its graphs' token counts to (``get_cuda_graph_batch_size_alignment``):
    the attention-TP width where a step's rows are scattered between those ranks, doubled under
    two-batch overlap, a multiple of the attention context-parallel width; 1 in a plain layout."""
    from sglang.srt.utils.common import get_cuda_graph_batch_size_alignment

    return int(_sglang_call(get_cuda_graph_batch_size_alignment, model_runner.server_args))


def _dp_layout(model_runner: Any) -> int | None:
    """Ranks whose token counts the body gathers over, or ``None`` without DP attention."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils import require_attn_tp_gather, require_mlp_tp_gather

    if _sglang_call(require_mlp_tp_gather, model_runner.server_args):
        parallel = get_parallel()
        # SGLang 0.5.23 resolves DP attention to attn_dp_size ranks with dp_size 1 (replicas); its
        # num_dp_ranks counts both, as its own runner captures with.
        return parallel.num_dp_ranks if hasattr(type(parallel), "num_dp_ranks") else parallel.dp_size
    if _sglang_call(require_attn_tp_gather, model_runner.server_args):
        return 1
    return None
