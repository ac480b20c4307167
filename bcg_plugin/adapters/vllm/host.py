"""vLLM as a bcg host: the hooks the core calls to capture and replay one model runner's forward.

The payload of every :class:`~bcg_plugin.HostBatch` is a vLLM ``ForwardContext``: at capture the one
built for the dummy batch, at replay the one vLLM set for the step. Attention (the eager break,
:mod:`bcg_plugin.adapters.vllm.attention`) runs with that context bound, and so does the KV-cache write
captured inside each segment, which reads the slot-mapping buffer vLLM refills in place every step.

The two model runners differ only in how a dummy batch of ``N`` tokens is made, so each gets a
small subclass implementing :meth:`VllmHost.capture_context`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from bcg_plugin import BcgConfig, HostBatch, StaticInput, default_capture_stream, faults, hookimpl
from bcg_plugin.adapters.vllm.attention import refusing_marked_ops
from bcg_plugin.adapters.vllm.config import sequence_parallel_multiple
from bcg_plugin.adapters.vllm.log import logger
from bcg_plugin.ladder import sharded_buckets


class VllmHost:
    """Hooks shared by both runners.

    Attributes:
        model: the raw ``nn.Module`` (no vLLM graph wrapper).
        vllm_config: the engine config (DP size for the capture context).
        embeds_in_graph: whether the embedding lookup is captured in the first segment (text-only
            models: the graph starts from static token ids, and no eager lookup or embeds copy runs
            per step) or stays outside (models that take ``inputs_embeds``: multimodal merged
            embeddings, prompt embeddings), where :class:`EagerEmbedding` runs it before landing.
        hidden_size, dtype, device: shape of the static ``inputs_embeds`` rows.
        stream: the capture stream of the enclosing ``graph_capture`` (set for the capture only).
        persistent_inputs: the runner's own ``input_ids`` and ``positions`` buffers, which vLLM
            fills in place every step; the graphs read them directly, so no input is copied per step.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any, device: torch.device):
        self.model = model
        self.vllm_config = vllm_config
        self.device = device
        self.embeds_in_graph = takes_token_ids_only(model, vllm_config)
        self.hidden_size = vllm_config.model_config.get_hidden_size()
        self.dtype = vllm_config.model_config.dtype
        self.stream: torch.cuda.Stream | None = None
        self.capture_contexts: dict[int, Any] = {}
        self.capture_metadata: dict[int, dict[str, torch.Tensor]] = {}  # kept only for fault plugins
        self.persistent_inputs: dict[str, torch.Tensor] = {}

    @property
    def graph_input(self) -> str:
        """The model input the graph starts from: ``input_ids`` or ``inputs_embeds``."""
        return "input_ids" if self.embeds_in_graph else "inputs_embeds"

    def plugins(self) -> list[object]:
        """Every bcg plugin object of this host (the embedding one only when it runs eagerly)."""
        return [self] if self.embeds_in_graph else [self, EagerEmbedding(self.model)]

    # -- capture ---------------------------------------------------------------------------------

    def capture_context(self, num_tokens: int, graph_attention: bool = False) -> Any:
        """A vLLM ForwardContext for a dummy prefill of ``num_tokens`` (KV writes skipped: slots -1);
        ``graph_attention``: its metadata in vLLM's FULL-mode buffers (:class:`V2Host` only)."""
        raise NotImplementedError

    def graph_requests(self, bucket: int) -> int:
        """Requests a step of ``bucket`` is padded to when its attention is inside the graph."""
        raise NotImplementedError

    def graph_metadata_buffers(self) -> dict[str, torch.Tensor]:
        """The persistent metadata buffers a graph-attention replay reads, by name (for fault plugins)."""
        return {}

    def plans_one_token_steps_apart(self) -> bool:
        """Whether vLLM lays out a step of one-token requests for another launch than the one a
        graph-attention bucket captured, so such a step cannot replay one (:class:`V2Host`)."""
        return False

    def lower_graph_bound(self) -> None:
        """Put back the metadata builders' graph bound :meth:`bcg_graph_attention` raised, once no
        graph of this host will replay (a failed capture, or closed graphs)."""

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """vLLM's graph-capture context, with TP custom all-reduce buffers registered at exit.

        Where ``graph_capture`` takes a stream (through 0.30), on the one the V2 runner captures its
        decode graphs on (``torch.cuda.graph``'s default): a stream of its own would pin one more cuBLAS
        workspace (32 MiB on Hopper) for the process's life. From 0.31 it always makes a stream of its
        own, as it does for vLLM's own captures, and bcg captures on that one; 0.34 takes a stream again, but
        vLLM's own decode capture makes a fresh one there too, so there is none to share. Inside it, an op vLLM
        marks as an eager break fails the capture (:class:`~bcg_plugin.adapters.vllm.attention.MarkedOpRefusal`)."""
        from vllm.distributed.parallel_state import GraphCaptureContext, graph_capture

        if accepts(graph_capture, "graph_capture_context"):
            stream = default_capture_stream(self.device)
            context = graph_capture(device=self.device,
                                    graph_capture_context=GraphCaptureContext(stream) if stream is not None else None)
        else:
            context = graph_capture(device=self.device)
        with context as ctx, refusing_marked_ops():
            self.stream = ctx.stream
            try:
                yield
            finally:
                self.stream = None

    @hookimpl
    def bcg_prefill_buckets(self, config: BcgConfig) -> list[int] | None:
        # Under sequence parallelism V1 pads every step to a multiple of the TP size and asserts the
        # dispatched size is one: each bucket is rounded up to one (the top: down, within max_tokens).
        return sharded_buckets(config.max_tokens, config.sizes, sequence_parallel_multiple(self.vllm_config))

    @hookimpl
    def bcg_static_inputs(self) -> dict[str, StaticInput]:
        # Padded rows: token 0 (a real row of the embedding table), position 0.
        first = (StaticInput((), torch.int32, 0, self._persistent("input_ids", torch.int32)) if self.embeds_in_graph
                 else StaticInput((self.hidden_size,), self.dtype, 0.0))
        return {self.graph_input: first,
                "positions": StaticInput((), torch.int64, 0, self._persistent("positions", torch.int64))}

    def _persistent(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The runner's buffer for ``name`` if it is one the graphs can read in place, else ``None``
        (the core then allocates its own and copies the step's rows in)."""
        buf = self.persistent_inputs.get(name)
        return buf if buf is not None and not StaticInput((), dtype).buffer_problems(buf, self.device) else None

    @hookimpl
    def bcg_dummy_batch(self, num_tokens: int, graph_attention: bool) -> HostBatch:
        context = self.capture_context(num_tokens, graph_attention)
        self.capture_contexts[num_tokens] = context
        if graph_attention and faults.active():
            self.capture_metadata[num_tokens] = {k: v.clone() for k, v in self.graph_metadata_buffers().items()}
        ids = torch.zeros(num_tokens, dtype=torch.int32, device=self.device)
        first = ids if self.embeds_in_graph else self.model.embed_input_ids(ids)
        return HostBatch(
            num_tokens=num_tokens,
            inputs={self.graph_input: first,
                    "positions": torch.zeros(num_tokens, dtype=torch.int64, device=self.device)},
            payload=context,
        )

    @hookimpl
    def bcg_body_forward(self, inputs: dict[str, torch.Tensor], payload: Any) -> torch.Tensor:
        from vllm.forward_context import override_forward_context

        # Runs only at capture: code in the model that reads the forward context (the captured
        # KV-cache write, MoE DP metadata) sees the dummy batch's, whose buffers vLLM refills.
        with override_forward_context(payload):
            return self.model(input_ids=inputs.get("input_ids"), positions=inputs["positions"],
                              intermediate_tensors=None, inputs_embeds=inputs.get("inputs_embeds"))

    @hookimpl
    def bcg_world_group(self) -> Any:
        from vllm.distributed.parallel_state import get_world_group

        # The world group spans every TP, PP and DP rank (offline data parallelism included): one vote for all.
        return get_world_group().cpu_group

    @hookimpl
    def bcg_capture_stream(self) -> torch.cuda.Stream | None:
        return self.stream


class EagerEmbedding:
    """The embedding lookup run eagerly before landing, for graphs that start from ``inputs_embeds``."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @hookimpl
    def bcg_embed(self, batch: HostBatch) -> dict[str, torch.Tensor] | None:
        if batch.inputs.get("inputs_embeds") is not None:
            return None
        return {"inputs_embeds": self.model.embed_input_ids(batch.inputs["input_ids"][: batch.num_tokens])}


def accepts(fn: Any, name: str) -> bool:
    """Whether host function ``fn`` has a parameter ``name`` (the patch descriptors verify which
    parameters each vLLM release has; this picks the call that release takes)."""
    return name in inspect.signature(inspect.unwrap(fn)).parameters


def takes_token_ids_only(model: torch.nn.Module, vllm_config: Any) -> bool:
    """Whether every step feeds this model token ids (no multimodal or prompt embeddings)."""
    from vllm.model_executor.models.interfaces import supports_multimodal

    return not supports_multimodal(model) and not getattr(vllm_config.model_config, "enable_prompt_embeds", False)


class V2Host(VllmHost):
    """Dummy batches of the V2 runner (``vllm/v1/worker/gpu/model_runner.py``): its own capture helper."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, device: torch.device, *, model_state: Any,
                 input_buffers: Any, block_tables: Any, attn_groups: Any, kv_cache_config: Any):
        super().__init__(model, vllm_config, device)
        self.model_state = model_state
        self.input_buffers = input_buffers
        self.block_tables = block_tables
        self.attn_groups = attn_groups
        self.kv_cache_config = kv_cache_config
        self.persistent_inputs = {"input_ids": input_buffers.input_ids, "positions": input_buffers.positions}
        self._raised_bounds: list[tuple[Any, Any]] = []  # (builder, its bound before bcg raised it)

    def lower_graph_bound(self) -> None:
        # Without bcg's graphs, vLLM's eager steps above its own bound get FA3's split heuristic back.
        while self._raised_bounds:
            builder, previous = self._raised_bounds.pop()
            builder.max_cudagraph_size = previous

    def capture_context(self, num_tokens: int, graph_attention: bool = False) -> Any:
        from vllm.v1.worker.gpu.cudagraph_utils import prepare_inputs_to_capture

        # Where attention breaks: a bs=1 prefill of num_tokens, with piecewise metadata as the step's
        # own. Inside the graph: FULL-mode metadata for the bucket's padded request count, built into
        # the persistent buffers vLLM lands every FULL step's metadata in, exactly as vLLM's own FULL
        # capture builds it. Either way the whole slot-mapping buffer is -1, so no KV is written. From
        # 0.27 the metadata kind is a required argument; later optional arguments keep their defaults
        # (no prefill context parallelism, which bcg declines).
        requests = self.graph_requests(num_tokens) if graph_attention else 1
        extra = {"full_cudagraph": graph_attention} if accepts(prepare_inputs_to_capture, "full_cudagraph") else {}
        if graph_attention:  # a replay may hold one request of the whole bucket: the grid covers it
            extra["max_query_len"] = num_tokens
        attn_metadata, slot_mappings = prepare_inputs_to_capture(
            requests, num_tokens, self.model_state, self.input_buffers, self.block_tables, self.attn_groups,
            self.kv_cache_config, **extra,
        )
        self.input_buffers.is_padding.fill_(True)
        return _forward_context(self.vllm_config, attn_metadata, slot_mappings, num_tokens,
                                self.input_buffers.is_padding[:num_tokens])


    def graph_requests(self, bucket: int) -> int:
        # vLLM's own FULL graphs of mixed batches: one request per token, up to max_num_seqs.
        return min(bucket, self.vllm_config.scheduler_config.max_num_seqs)

    def graph_metadata_buffers(self) -> dict[str, torch.Tensor]:
        return {"seq_lens": self.input_buffers.seq_lens}

    def plans_one_token_steps_apart(self) -> bool:
        # vLLM plans FA3's scheduler metadata by the step's longest query: at a length of 1 (head
        # dim 64 or 256) FA3 launches non-causal without head swizzling, a layout the kernel
        # captured at the bucket's length does not read. Triton's kernel reads no such plan.
        return any(group.backend.get_name() == "FLASH_ATTN" for groups in self.attn_groups for group in groups)

    @hookimpl
    def bcg_graph_attention(self, buckets: list[int], attention: str) -> list[int] | None:
        # "graph": every bucket. "auto": buckets up to AUTO_GRAPH_ATTENTION_TOKENS, or up to
        # max_cudagraph_capture_size where vLLM's own FULL graphs reach further. Either way the
        # builders' graph bound is raised to the largest bucket chosen.
        reason = graph_attention_problem(self.vllm_config, self.attn_groups, self.embeds_in_graph)
        if reason is not None:
            _say_once(logger.warning if attention == "graph" else logger.info,
                      f"attention stays an eager break in every bucket: {reason}")
            return None
        configured = self.vllm_config.compilation_config.max_cudagraph_capture_size or 0
        limit = max(configured, AUTO_GRAPH_ATTENTION_TOKENS)
        chosen = list(buckets) if attention == "graph" else [b for b in buckets if b <= limit]
        if chosen:
            bound = raise_graph_bound(self.attn_groups, max(chosen), configured, self._raised_bounds)
            if attention == "graph" and bound < max(chosen):
                _say_once(logger.warning, f"attention stays an eager break above {bound} tokens (vLLM's "
                          "max_cudagraph_capture_size): a backend's builder bounds its graph steps there and bcg "
                          "cannot raise that bound")
            chosen = [b for b in chosen if b <= bound]
        return chosen


_SAID: set[str] = set()  # reasons already logged in this process (each runner's capture asks again)


def _say_once(say: Any, reason: str) -> None:
    if reason not in _SAID:
        _SAID.add(reason)
        say("bcg: %s", reason)


# The largest bucket "auto" keeps attention inside the graph for (unless vLLM's own FULL graphs reach
# further). Up to it one eager FA3 call per layer costs the host more than the step's GPU work hides;
# above it the captured grid, sized for the bucket's worst batch, costs more GPU time than a call
# sized for the live batch (docs/benchmarks.md, earlier runs: vllm-0.33.0-qwen3-0.6b-2026-12-03T0258Z,
# bcg_compile_graph against bcg_compile).
AUTO_GRAPH_ATTENTION_TOKENS = 2048


# Backends whose metadata builders graph a step of any size as they are (no size-bound graph path).
UNBOUNDED_GRAPH_BACKENDS = ("TRITON_ATTN",)


def raise_graph_bound(attn_groups: Any, num_tokens: int, configured: int,
                      raised: list[tuple[Any, Any]] | None = None) -> int:
    """Let every metadata builder treat steps of up to ``num_tokens`` as graph steps; return the
    largest step every builder now does (``configured``, vLLM's ``max_cudagraph_capture_size``,
    where a builder's bound cannot be raised).

    FA3's builder bounds a step's KV splits (and so the size of the split buffers a captured graph
    holds) only for steps up to its ``max_cudagraph_size``, vLLM's ``max_cudagraph_capture_size``;
    a larger step gets FA3's own split heuristic, whose buffers a graph captured at another batch
    mix does not hold. Raising the bound to bcg's largest graph bucket is what vLLM's FULL mode
    does with capture sizes that reach that far; its persistent schedule buffer is sized by
    request count (at least ``max_num_seqs``), which a bucket's padded batch does not exceed. A
    builder of another backend without that attribute holds every builder to ``configured``, unless
    its backend is known to graph any size.

    vLLM's own eager steps up to the raised bound then run FA3 with the same split bound as its
    graph steps (at most ``flash_attn_max_num_splits_for_cuda_graph`` splits, not FA3's heuristic);
    bcg serves every step in that range unless it declines one (padding, microbatching).
    ``raised`` collects ``(builder, previous bound)`` for each builder changed, for
    :meth:`V2Host.lower_graph_bound`.
    """
    builders = [(group, builder) for groups in attn_groups for group in groups
                for builder in getattr(group, "metadata_builders", None) or ()]
    bound = num_tokens
    for group, builder in builders:
        if not hasattr(builder, "max_cudagraph_size") and group.backend.get_name() not in UNBOUNDED_GRAPH_BACKENDS:
            bound = min(bound, configured)
    for _, builder in builders:
        if hasattr(builder, "max_cudagraph_size") and (builder.max_cudagraph_size or 0) < bound:
            if raised is not None:
                raised.append((builder, builder.max_cudagraph_size))
            builder.max_cudagraph_size = bound
    return bound


def graph_attention_problem(vllm_config: Any, attn_groups: Any, embeds_in_graph: bool) -> str | None:
    """Why no bucket of this V2 runner can keep attention inside the graph, or ``None`` if some can
    (which ones: :meth:`V2Host.bcg_graph_attention`).

    vLLM lands a FULL step's metadata in persistent buffers only where every attention group's
    builder supports FULL graphs of any batch mix (FA3, TRITON_ATTN) and ``cudagraph_mode`` has FULL
    graphs (the FA3 scheduler metadata is kept in a persistent buffer only then; its split bound
    reaches ``max_cudagraph_capture_size`` unless bcg raises it, :func:`raise_graph_bound`). A FULL
    step passes no model inputs, so the graph must start from the token ids (no inputs_embeds).
    """
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.worker.gpu.cudagraph_utils import prepare_inputs_to_capture

    if not accepts(prepare_inputs_to_capture, "max_query_len"):  # the capture's grid must cover a whole-bucket request
        return "vLLM releases before 0.28 cannot bound a FULL capture's query length by the bucket"
    if vllm_config.parallel_config.data_parallel_size > 1:
        return "data parallelism (not yet validated with attention inside the graph: docs/validation.md)"
    if not embeds_in_graph:
        return "the model takes inputs_embeds, which a FULL step does not pass"
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return f"cudagraph_mode {getattr(mode, 'name', mode)} has no FULL graphs"
    for groups in attn_groups:
        for group in groups:
            builder = group.get_metadata_builder(0) if hasattr(group, "get_metadata_builder") else None
            support = None if builder is None else builder.get_cudagraph_support(vllm_config, group.kv_cache_spec)
            if support != AttentionCGSupport.ALWAYS:
                return f"attention backend {group.backend.get_name()} has no FULL graphs of mixed batches"
    return None


class V1Host(VllmHost):
    """Dummy batches of the V1 runner (``vllm/v1/worker/gpu_model_runner.py``), built by its ``_dummy_run``.

    ``_dummy_run(N, NONE, force_attention=True)`` prepares metadata, slot mappings (all -1) and the
    forward context exactly as V1 does for its own warm-ups; a probe standing in for the model
    during that one call keeps the context it was given.

    ``_dummy_run`` spreads the N tokens over up to ``max_num_seqs`` requests but gives each the whole
    N as its sequence length, which attention reads through the block table: with N above
    ``max_model_len`` (a chunk larger than the context, e.g. vLLM's 16384 for ``LLM`` on an H200 with
    ``max_model_len=8192``) the last rows' reads run past the table, an illegal memory access that
    ends the process. The length is capped at ``max_model_len``, which each request's share of the
    batch fits in: bcg's buckets stop at ``max_num_seqs`` x ``max_model_len``
    (:func:`~bcg_plugin.adapters.vllm.replay.step_token_limit`); up to ``max_model_len`` nothing changes.
    """

    def __init__(self, runner: Any):
        super().__init__(runner.get_model(), runner.vllm_config, runner.device)
        self.runner = runner
        for name in ("input_ids", "positions"):
            buf = getattr(runner, name, None)
            buf = getattr(buf, "gpu", buf)  # input_ids is a CPU/GPU buffer pair, positions a tensor (0.26)
            if isinstance(buf, torch.Tensor):
                self.persistent_inputs[name] = buf

    def capture_context(self, num_tokens: int, graph_attention: bool = False) -> Any:
        from vllm.config.compilation import CUDAGraphMode

        probe = _ContextProbe(num_tokens, self.hidden_size, self.dtype, self.device)
        seq_len = min(num_tokens, self.vllm_config.model_config.max_model_len)
        saved = self.runner.model
        self.runner.model = probe
        try:
            self.runner._dummy_run(num_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE, force_attention=True,
                                   skip_eplb=True, remove_lora=False, profile_seq_lens=seq_len)
        finally:
            self.runner.model = saved
        if probe.context is None:
            raise RuntimeError("V1 _dummy_run did not call the model; cannot build a bcg capture batch")
        return probe.context


class _ContextProbe:
    """Replaces ``runner.model`` for one ``_dummy_run``: keeps the forward context, returns zeros."""

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.hidden, self.dtype, self.device = rows, hidden, dtype, device
        self.context: Any = None

    def __call__(self, **_: Any) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        self.context = get_forward_context()
        return torch.zeros(self.rows, self.hidden, dtype=self.dtype, device=self.device)


def _forward_context(vllm_config: Any, attn_metadata: Any, slot_mappings: Any, num_tokens: int,
                     is_padding: torch.Tensor) -> Any:
    """The ForwardContext vLLM's own capture would set for ``num_tokens`` (entered and left here: its
    exit may synchronise, which must not happen inside a capture)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context

    dp = vllm_config.parallel_config.data_parallel_size
    across_dp = torch.full((dp,), num_tokens, dtype=torch.int32, device="cpu") if dp > 1 else None
    with set_forward_context(attn_metadata, vllm_config, num_tokens=num_tokens,
                             cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE, num_tokens_across_dp=across_dp,
                             batch_descriptor=BatchDescriptor(num_tokens=num_tokens), slot_mapping=slot_mappings,
                             is_padding=is_padding):
        return get_forward_context()
