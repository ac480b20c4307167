"""Attention inside bcg's graph on SGLang: the flashinfer or fa3 backend's paged prefill, planned as
SGLang's own ``full`` prefill graphs plan it.

A graph bucket is captured with a batch of ``r`` request slots (its real requests, then
zero-length ones) whose plan (the backend's ``init_forward_metadata_out_graph`` with
``in_capture``) writes into wrappers that keep their buffers for the engine's life. Before every
replay the live batch's per-request vectors land in ``r``-long buffers, zeros after its real
requests, and the same plan refills those wrappers from a view of the batch padded to ``r``: the
captured kernels read only what the plan wrote, so one graph serves any batch mix of up to ``r``
requests. A step with more requests replays in the smallest bucket, its own or larger, that has a
graph whose attention breaks: a bucket's :data:`~bcg_plugin.BREAKING` variant (with
``graph_variants``) or a bucket that breaks; where none does it runs eagerly (counted).

Its kernels are those of SGLang's full graphs, not eager's (on flashinfer a paged prefill over every
token where eager runs a ragged one over the new tokens; on fa3 eager's paged kernel over a grid
sized for the bucket and its request slots), so its outputs are held to full's, not to eager's.
``attention: graph`` (``BCG_ATTENTION=graph``) keeps attention inside every bucket; ``auto`` keeps it
inside the buckets up to the backend's :data:`AUTO_GRAPH_ATTENTION_TOKENS`.

With ``graph_variants`` (on by default) every flashinfer graph bucket is also captured as the
variant :data:`FRESH`, for steps whose requests have no cached prefix: there attention runs
flashinfer's ragged prefill over the step's own keys and values, as SGLang's eager forward runs it,
from a graph wrapper planned without split KV. The paged plan keeps split KV on (it is what lets a
short step on a long prefix spread over the GPU), and in the graph it runs its merge even when
nothing was split. On either backend some of the graph buckets that can hold more requests than the
slots (:func:`breaking_buckets`) are also captured as the :data:`~bcg_plugin.BREAKING` variant,
attention breaking as in a bucket above the limit, for the steps that do: fa3's slots are SGLang's
few, flashinfer's at least 64.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import logging
import math
from collections.abc import Iterator
from typing import Any

from packaging.version import Version

import torch

from bcg_plugin import BREAKING

logger = logging.getLogger("bcg_plugin.sglang")

# The backends whose full prefill graph plan bcg uses, named so that checking them imports nothing
# (flashinfer is not imported on a host that runs another backend); fa4 shares fa3's class.
FLASHINFER = "flashinfer"
FA3 = "fa3"
GRAPH_BACKENDS = {
    ("sglang.srt.layers.attention.flashinfer_backend", "FlashInferAttnBackend"): FLASHINFER,
    ("sglang.srt.layers.attention.flashattention_backend", "FlashAttentionBackend"): FA3,
}
# SGLang's names for the KV-cache dtypes fa3 reads unquantized.
FA3_UNQUANTIZED_KV = ("auto", "bf16", "bfloat16", "fp16", "float16")
# The most device memory a graph plan's per-request KV index may take: fa3's block table (r rows of
# context_len / page_size int32 pages), flashinfer's KV indices (r x context_len int32 tokens).
# SGLang allocates it at the first capture, after it has sized the KV cache, so a long context lowers
# r instead. 64 MiB hold 64 request slots at a 256K-token context.
GRAPH_KV_INDEX_BYTES = 64 << 20
# The fewest request slots a graph bucket plans for, per backend, where SGLang's own rule
# (chunked-prefill size / 512, at least 1) gives fewer: 2 at a 1024-token chunk, 16 at 8192. A step
# of more requests (every decode of a mixed step is one) replays padded further, in a graph whose
# attention breaks (:func:`breaking_buckets`), or runs eagerly, so flashinfer plans for at least 64.
# fa3 keeps SGLang's rule, as its full graphs do, and leaves such steps to the breaks: where fa3's
# heuristic splits KV its combine kernel runs over every slot, and 64 slots cost bcg's 512-token
# bucket 1.18x the forward GPU time of full's 16 (docs/benchmarks.md, SGLang 0.5.23 on fa3).
MIN_REQUEST_SLOTS = {FLASHINFER: 64, FA3: 1}
# The largest bucket "auto" keeps attention inside the graph for, per backend. Up to it the host time
# of the breaks (the backend's Python, once per layer) is not hidden behind the step's GPU work, and a
# graph without them is faster. Above it an eager call sized for the live batch wins: on flashinfer
# the ragged prefill beats the paged one the graph runs over the bucket's worst case from 768 tokens;
# on fa3, whose graph runs eager's paged kernel over a grid sized for the bucket, a forward that
# breaks stays host-bound through 1024 tokens (1.08x SGLang's full graphs there, 0.92x with
# attention inside) and is ahead from 2048 (docs/benchmarks.md: SGLang 0.5.23 on flashinfer and on
# fa3, the Qwen3-0.6B shape; a larger model's GPU work would hide the breaks from fewer tokens on).
AUTO_GRAPH_ATTENTION_TOKENS = {FLASHINFER: 512, FA3: 1024}
# The graph variant of a bucket for steps without a cached prefix (ragged prefill, no split KV).
FRESH = "fresh"
# How far a step of more requests than the request slots pads, at most, to reach a bucket also
# captured breaking (:func:`breaking_buckets`). Such steps are rare and host-bound up to the auto
# limit, so padding costs them little, and a factor of 2 captures about log2 of the graph buckets'
# span above the slots twice (5 of 31 buckets above 16 slots on the ladder to 1024), not every one.
# A breaking capture holds a graph segment per layer: one for each of those 31 buckets of the
# Qwen3-0.6B shape would take about 0.12 GiB of driver memory at the rate in RuntimeStats.graph_bytes'
# note (an H200), more than the 0.10 GiB by which bcg's graphs undercut full's on fa3 (an H100,
# docs/benchmarks.md); the 5 take about 0.02 GiB.
BREAKING_SPAN = 2
# The first flashinfer whose graph plans mask the captured grid's padded tiles without split KV
# (its scheduler writes the block-valid mask for every graph plan; earlier ones only for a split
# one, and a plan without the split re-runs attention over the capture's whole grid).
FRESH_MIN_FLASHINFER = Version("0.7.2")
# The ragged backends SGLang's eager wrapper may ask for whose plan can be redone before every
# replay of a graph (flashinfer's cutlass plan allocates new buffers on each call).
FRESH_BACKENDS = ("auto", "fa2", "fa3")


def backend_kind(backend: Any) -> str | None:
    """:data:`FLASHINFER` or :data:`FA3` for SGLang's own class of that backend (not a subclass, which
    may plan otherwise), else ``None``."""
    cls = type(backend)
    return GRAPH_BACKENDS.get((cls.__module__, cls.__qualname__))


def decline_reason(model_runner: Any, dp_ranks: int | None) -> str | None:
    """Why attention cannot stay inside bcg's graphs on this runner, or ``None`` where it can."""
    backend = model_runner.attn_backend
    kind = backend_kind(backend)
    if kind is None:
        return (f"the {type(backend).__name__} attention backend has no full prefill graph plan bcg uses "
                "(--attention-backend flashinfer or fa3 has)")
    plan = ("_create_full_cg_prefill_wrappers" if kind == FLASHINFER else "_init_full_cg_prefill_metadata")
    if not all(hasattr(backend, name) for name in ("init_forward_metadata_out_graph", plan)):
        return f"this SGLang's {kind} backend has no full prefill graph plan"
    if dp_ranks is not None:
        return "DP attention (its padded steps plan per rank)"
    if not getattr(model_runner.model_config, "is_generation", True):
        return "an embedding or encoder-only model"
    pool = getattr(backend, "token_to_kv_pool", None)
    if (getattr(pool, "requires_physical_write_loc", False)
            or getattr(getattr(backend, "kv_index_translator", None), "is_translating", False)):
        return "a KV pool that translates cache slots per forward"
    return _flashinfer_reason(backend) if kind == FLASHINFER else _fa3_reason(backend)


def _fa3_reason(backend: Any) -> str | None:
    """What of the fa3 backend's own features plans per forward or is not fa3's paged MHA prefill."""
    if getattr(backend, "fa_impl_ver", 3) != 3:
        return f"FlashAttention {backend.fa_impl_ver} (bcg keeps only fa3's attention inside the graph)"
    if getattr(backend, "use_mla", False):
        return "MLA attention"
    if getattr(backend, "skip_prefill", False):
        return "a backend without prefill"
    if getattr(backend, "use_sliding_window_kv_pool", False) or getattr(backend, "has_swa", False):
        return "sliding-window attention (its window's block table and write slots are planned per forward)"
    if getattr(backend, "has_local_attention", False) or getattr(backend, "local_attn_builder", None) is not None:
        return "chunked local attention (its blocks are planned per forward)"
    if getattr(backend, "is_encoder_decoder", False):
        return "cross attention"
    if getattr(backend, "_kv_shard_pool", None) is not None or getattr(backend, "attn_cp_size", 1) > 1:
        return "a sharded or context-parallel KV cache (gathered per forward)"
    if str(getattr(backend, "kv_cache_dtype_str", "auto")).lower() not in FA3_UNQUANTIZED_KV:
        return f"a {backend.kv_cache_dtype_str} KV cache (fa3 inside bcg's graph reads an unquantized one only)"
    if getattr(backend, "full_cg_prefill_metadata", None) is not None:
        return "the backend's full prefill metadata was made by another runner"
    return None


def _flashinfer_reason(backend: Any) -> str | None:
    """What of the flashinfer backend's own features plans per forward or needs a second wrapper."""
    if getattr(backend, "dispatch_reason", None) is not None:
        return "sliding-window or cross attention (a second flashinfer wrapper per layer)"
    if getattr(backend, "use_sliding_window_kv_pool", False):
        return "a sliding-window KV pool (its write slots are planned per forward)"
    if getattr(backend, "prefill_uses_dequant_workspace", False):
        return "a dequantizing KV workspace (filled per forward on the host)"
    if getattr(backend, "skip_prefill", False):
        return "a backend without prefill wrappers"
    if getattr(backend, "enable_mis", False):
        return "multi-item scoring (its masks are planned per forward)"
    if getattr(backend, "enable_deterministic", False):
        return "deterministic inference (its eager plan fixes the split size the graph's plan drops)"
    if getattr(backend, "full_cg_prefill_wrappers", None) is not None:
        return "the backend's full prefill wrappers were made by another runner"
    return None


def fresh_decline_reason(backend: Any) -> str | None:
    """Why graph buckets get no :data:`FRESH` variant on this backend, or ``None`` where they do:
    where SGLang's eager forward plans a step without a cached prefix paged, not ragged, so does bcg."""
    if getattr(backend, "is_multimodal", False):
        return "a multimodal model (SGLang's flashinfer backend plans its prefill paged)"
    if getattr(backend, "use_paged", False):
        return "SGLANG_FLASHINFER_USE_PAGED (SGLang plans every prefill paged)"
    try:
        version = Version(importlib.metadata.version("flashinfer-python"))
    except importlib.metadata.PackageNotFoundError:
        return "flashinfer-python's version is unknown"
    if version < FRESH_MIN_FLASHINFER:
        return f"flashinfer {version} (its graph plans without split KV need {FRESH_MIN_FLASHINFER} or later)"
    ragged = getattr(backend, "prefill_wrapper_ragged", None)
    requested = getattr(ragged, "_requested_backend", None)
    if requested not in FRESH_BACKENDS:
        return f"the backend's ragged prefill runs {requested!r}, whose plan cannot be redone under a graph"
    return None


def breaking_buckets(buckets: list[int], slots: int) -> list[int]:
    """The graph buckets (of ``buckets``) also captured as the :data:`~bcg_plugin.BREAKING` variant,
    for ``slots`` request slots: from the smallest bucket that can hold more requests than
    the slots (more tokens than slots) up, each time the largest bucket within :data:`BREAKING_SPAN`
    of the first one not yet covered. Every bucket of more tokens than slots then has one at or
    above it within that factor, and the largest always is one."""
    larger = sorted(b for b in buckets if b > slots)
    chosen: list[int] = []
    for bucket in larger:
        if not chosen or bucket > chosen[-1]:
            chosen.append(max(b for b in larger if b <= BREAKING_SPAN * bucket))
    return chosen


def sglang_request_slots(chunk: int | None) -> int:
    """The request slots SGLang's own full prefill graphs plan for where the operator set no
    ``full_prefill_max_req``: chunked-prefill size / 512, at least 1."""
    return max((chunk or 0) // 512, 1)


def chunk_request_slots(chunk: int | None, kind: str) -> int:
    """``r`` on backend ``kind`` where the operator set no ``full_prefill_max_req``: SGLang's rule
    (:func:`sglang_request_slots`) raised to the backend's :data:`MIN_REQUEST_SLOTS`."""
    return max(sglang_request_slots(chunk), MIN_REQUEST_SLOTS[kind])


def request_slots(model_runner: Any, chunk: int | None, top: int) -> int:
    """``r``: the requests one graph-attention step may hold.

    SGLang's ``full_prefill_max_req`` where the operator set it, else its rule (chunk / 512) raised
    to the backend's :data:`MIN_REQUEST_SLOTS`; at most the request pool's rows and ``top`` (a step
    holds no more requests than tokens, and flashinfer sizes its graph workspace for at most one
    request per row), at most what :data:`GRAPH_KV_INDEX_BYTES` holds of the plan's per-request KV
    index, and at least the requests the ``top`` bucket's capture batch needs at ``context_len``
    tokens each.
    """
    from bcg_plugin.adapters.sglang.replay import prefill_graph_config

    kind = backend_kind(model_runner.attn_backend)
    assert kind is not None, "request slots are planned only on a backend whose graph plan bcg uses"
    configured = getattr(prefill_graph_config(model_runner), "full_prefill_max_req", None)
    r = int(configured) if configured else chunk_request_slots(chunk, kind)
    r = min(r, int(model_runner.req_to_token_pool.size), top)
    # int32 entries per request slot: fa3's pages, flashinfer's tokens
    index_len = {FA3: getattr(model_runner.attn_backend, "max_num_pages", None),
                 FLASHINFER: model_runner.model_config.context_len}[kind]
    if index_len:
        r = min(r, max(1, GRAPH_KV_INDEX_BYTES // (4 * int(index_len))))
    return max(r, math.ceil(top / int(model_runner.model_config.context_len)))


# What SGLang's full prefill plan leaves on the backend, made for bcg's graph buckets: flashinfer's
# wrappers and their buffers, fa3's metadata and the buffers its plan fills.
_PLAN_ATTRIBUTES = ("full_cg_prefill_wrappers", "full_cg_prefill_workspace_buffer", "full_cg_prefill_qo_indptr",
                    "full_cg_prefill_kv_indptr", "full_cg_prefill_kv_indices", "full_cg_prefill_metadata",
                    "full_cg_prefill_strided_indices", "full_cg_prefill_swa_out_cache_loc")


class RequestSlots:
    """The ``r``-long per-request vectors a graph bucket's plan reads, padded with zero-length requests.

    Holds device buffers for the request vectors SGLang's full prefill plans read (sequence and
    extend lengths, prefix lengths, request-pool rows) and the host copy of the sequence lengths;
    slots past a batch's requests hold zeros, which the plan turns into empty requests (row 0 of
    the request pool is never read for them: their length is zero).
    """

    FIELDS = ("seq_lens", "req_pool_indices", "extend_seq_lens", "extend_prefix_lens")

    def __init__(self, r: int, device: Any):
        self.r = r
        self.buffers = {name: torch.zeros(r, dtype=torch.int64, device=device) for name in self.FIELDS}
        self.seq_lens_cpu = torch.zeros(r, dtype=torch.int64)
        self.qo_indptr_cpu = torch.zeros(r + 1, dtype=torch.int32)

    def extend_indptr(self, fb: Any) -> torch.Tensor:
        """The ``r + 1`` offsets of ``fb``'s new tokens per request, from the host's lengths (no
        device read), zero-length requests after its real ones: a ragged plan's ``qo_indptr``."""
        bs = self._requests(fb)
        lens = torch.as_tensor(fb.extend_seq_lens_cpu[:bs], dtype=torch.int32)
        self.qo_indptr_cpu.zero_()
        torch.cumsum(lens, 0, out=self.qo_indptr_cpu[1:bs + 1])
        self.qo_indptr_cpu[bs + 1:] = self.qo_indptr_cpu[bs]
        return self.qo_indptr_cpu

    def _requests(self, fb: Any) -> int:
        """``fb``'s request count, refused where it exceeds the slots."""
        bs = int(fb.batch_size)
        if bs > self.r:
            raise ValueError(f"{bs} requests do not fit {self.r} request slots")
        return bs

    def padded_view(self, fb: Any) -> Any:
        """A shallow copy of ``fb`` whose request vectors are this object's, ``fb``'s landed in
        front of zeros, and whose batch size is ``r``: what SGLang's full graphs plan from."""
        bs = self._requests(fb)
        for name, buf in self.buffers.items():
            buf[bs:].zero_()
            buf[:bs].copy_(getattr(fb, name)[:bs])
        self.seq_lens_cpu.zero_()
        self.seq_lens_cpu[:bs].copy_(torch.as_tensor(fb.seq_lens_cpu)[:bs])
        view = copy.copy(fb)
        view.batch_size = self.r
        for name, buf in self.buffers.items():
            setattr(view, name, buf)
        view.seq_lens_cpu = self.seq_lens_cpu
        if getattr(fb, "req_pool_indices_cpu", None) is not None:  # SGLang 0.5.23 plans from it too
            cpu = torch.zeros(self.r, dtype=fb.req_pool_indices_cpu.dtype)
            cpu[:bs].copy_(fb.req_pool_indices_cpu[:bs])
            view.req_pool_indices_cpu = cpu
        return view


class GraphAttention:
    """Attention inside the graph for one SGLang runner: the buckets that keep it there, the request
    slots their steps are padded to, and the backend's wrappers those buckets were captured with.

    Decided once per runner (every capture of the ladder asks again and gets the same answer).
    """

    def __init__(self, model_runner: Any, dp_ranks: int | None, chunk: int | None, device: Any):
        self.model_runner = model_runner
        self.device = device
        self.reason = decline_reason(model_runner, dp_ranks)
        self.kind = backend_kind(model_runner.attn_backend)
        self.chunk = chunk
        self.buckets: list[int] = []
        self.slots: RequestSlots | None = None
        self.ragged: Any = None  # the FRESH variant's graph wrapper, once the core asks for variants
        self._made_plan = False

    def choose(self, buckets: list[int], attention: str) -> list[int] | None:
        """The buckets whose attention stays inside the graph where the runner allows it: every
        bucket for ``"graph"``; for ``"auto"`` those up to the backend's
        :data:`AUTO_GRAPH_ATTENTION_TOKENS`; none for ``"break"``."""
        if attention == "break":
            return None
        if self.reason is not None:
            # A warning only where "graph" was asked for: under "auto" breaking is the expected outcome.
            (logger.warning if attention == "graph" else logger.info)(
                "bcg: attention stays an eager break in every bucket: %s", self.reason)
            return None
        limit = AUTO_GRAPH_ATTENTION_TOKENS[self.kind]
        chosen = list(buckets) if attention == "graph" else [b for b in buckets if b <= limit]
        if not chosen:
            return None
        if self.slots is None:
            top = max(chosen)
            r = request_slots(self.model_runner, self.chunk, top)
            backend = self.model_runner.attn_backend
            if self.kind == FLASHINFER:
                # Sized for the largest graph bucket and r requests, as SGLang sizes its own. fa3 makes
                # its buffers in the first capture's plan, sized by its r requests.
                backend.full_cg_prefill_wrappers = backend._create_full_cg_prefill_wrappers(r, top)
            self._made_plan = True
            self.slots = RequestSlots(r, self.device)
            self.buckets = chosen
        return list(self.buckets)

    def variants(self, buckets: list[int]) -> dict[int, list[str]] | None:
        """The variants graph buckets are also captured as. Asked only where the config captures
        variants, so what they need is made here, once.

        On flashinfer, :data:`FRESH` for every graph bucket, where the backend allows it. On both,
        :data:`~bcg_plugin.BREAKING` for :func:`breaking_buckets`: a step of more requests than the
        slots would otherwise pad to the next breaking bucket, above
        :data:`AUTO_GRAPH_ATTENTION_TOKENS` (none under ``graph``), or run eagerly. fa3's slots are
        SGLang's few (chunk / 512); flashinfer's at least 64, which leave its graph buckets up to 512
        tokens such steps only of 8 tokens a request or fewer (every decode of a mixed step is one).
        """
        if self.slots is None:
            return None
        graph = [b for b in buckets if b in self.buckets]
        chosen: dict[int, list[str]] = {b: [] for b in graph}
        if self.kind == FLASHINFER and self._makes_fresh():
            for bucket in graph:
                chosen[bucket].append(FRESH)
        for bucket in breaking_buckets(graph, self.slots.r):
            chosen[bucket].append(BREAKING)
        return {bucket: names for bucket, names in chosen.items() if names} or None

    def _makes_fresh(self) -> bool:
        """Whether graph buckets get the :data:`FRESH` variant, its wrapper made on the first ask."""
        if self.ragged is None:
            reason = fresh_decline_reason(self.model_runner.attn_backend)
            if reason is not None:
                logger.info("bcg: graph buckets have no %r variant: %s", FRESH, reason)
                return False
            self.ragged = self._ragged_wrapper(self.slots.r)
        return True

    def variant_for(self, fb: Any, captured: tuple[str, ...]) -> str | None:
        """The graph variant a step replays in, of those its bucket was ``captured`` as:
        :data:`~bcg_plugin.BREAKING` where the step does not fit the request slots (:meth:`fits`),
        :data:`FRESH` where no request has a cached prefix (a mixed step's decodes have one), else
        the bucket's own graph (``None``)."""
        if BREAKING in captured and not self.fits(fb):
            return BREAKING
        if FRESH not in captured:
            return None
        prefixes = fb.extend_prefix_lens_cpu
        return FRESH if prefixes is not None and not any(prefixes[: int(fb.batch_size)]) else None

    def _ragged_wrapper(self, r: int) -> Any:
        """A ragged prefill wrapper in graph mode for ``r`` requests, on the kernels SGLang's eager
        ragged wrapper asks for. Its split-KV scratch is the paged graph wrappers' workspace: it
        plans without the split, and the two never run in one replay."""
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

        backend = self.model_runner.attn_backend
        return BatchPrefillWithRaggedKVCacheWrapper(
            backend.full_cg_prefill_workspace_buffer,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(r + 1, dtype=torch.int32, device=self.device),
            kv_indptr_buf=torch.zeros(r + 1, dtype=torch.int32, device=self.device),
            backend=backend.prefill_wrapper_ragged._requested_backend,
        )

    def release_variants(self, kept: dict[int, tuple[str, ...]]) -> None:
        """Give back the :data:`FRESH` variant's wrapper where no bucket ``kept`` it (the core's
        captured variants: one that failed to capture, every rank dropped): no step will plan into it."""
        if not any(FRESH in names for names in kept.values()):
            self.ragged = None

    def release(self) -> None:
        """Give back the wrappers (flashinfer) or metadata buffers (fa3), the workspace and the request
        slots made for graph buckets: after a failed capture the runner serves eagerly, and they
        would only hold device memory."""
        if self._made_plan:
            backend = self.model_runner.attn_backend
            for name in _PLAN_ATTRIBUTES:
                if hasattr(backend, name):
                    setattr(backend, name, None)
            self._made_plan = False
        self.slots = None
        self.ragged = None
        self.buckets = []

    @property
    def request_slots(self) -> int:
        return 0 if self.slots is None else self.slots.r

    def fits(self, fb: Any) -> bool:
        """Whether ``fb`` is a step a graph bucket's plan serves: an extend or mixed step (SGLang's
        graph plan takes a diffusion model's steps as its decode runner's) whose requests fit the
        request slots."""
        return (self.slots is not None and getattr(fb.forward_mode, "name", None) in ("EXTEND", "MIXED")
                and int(fb.batch_size) <= self.slots.r)

    def plan_capture(self, fb: Any, variant: str | None = None) -> None:
        """Plan a graph bucket's capture batch into the wrappers its replays refill: the paged
        graph wrappers, or for :data:`FRESH` the ragged one, with the backend's metadata saying
        ragged and no prefix so that its forward runs the ragged prefill."""
        backend = self.model_runner.attn_backend
        if variant is None:
            backend.init_forward_metadata_out_graph(fb, in_capture=True)
            return
        from sglang.srt.layers.attention.flashinfer_backend import PrefillMetadata

        self._plan_ragged(fb)
        backend.forward_metadata = PrefillMetadata(backend.full_cg_prefill_wrappers, use_ragged=True,
                                                   extend_no_prefix=True)

    @contextlib.contextmanager
    def body_scope(self, variant: str | None) -> Iterator[None]:
        """While a :data:`FRESH` capture batch runs, the backend's ragged prefill is the graph wrapper
        (SGLang's forward reads it from the backend, and the graph keeps what it captured)."""
        backend = self.model_runner.attn_backend
        if variant != FRESH:
            yield
            return
        eager = backend.prefill_wrapper_ragged
        backend.prefill_wrapper_ragged = self.ragged
        try:
            yield
        finally:
            backend.prefill_wrapper_ragged = eager

    def plan_replay(self, fb: Any, variant: str | None = None) -> None:
        """Land ``fb``'s requests into the slots and refill the wrappers the graph (or its
        ``variant``) reads from them.

        The captured kernels skip SGLang's per-layer waits for layers the hierarchical cache still
        loads, so the whole load is waited for first (as SGLang's full graphs do).
        """
        assert self.slots is not None
        counter = getattr(self.model_runner.token_to_kv_pool, "layer_transfer_counter", None)
        if counter is not None and getattr(counter, "consumer_index", 0) >= 0:
            counter.wait_until(counter.num_layers - 1)
        if variant == FRESH:
            self._plan_ragged(fb)
        else:
            self.model_runner.attn_backend.init_forward_metadata_out_graph(self.slots.padded_view(fb))

    def _plan_ragged(self, fb: Any) -> None:
        """Plan the ragged wrapper for ``fb``'s new tokens, as SGLang plans its eager one but without
        split KV: keys are the step's own, so no request's are long enough to need it."""
        assert self.slots is not None and self.ragged is not None
        upd = self.model_runner.attn_backend.indices_updater_prefill
        indptr = self.slots.extend_indptr(fb)
        self.ragged.begin_forward(indptr, indptr, upd.num_qo_heads, upd.num_kv_heads, upd.head_dim,
                                  causal=True, q_data_type=upd.q_data_type, disable_split_kv=True)
