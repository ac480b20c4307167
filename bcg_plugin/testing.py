"""A pure-PyTorch decoder and its adapter: the reference host for GPU tests and the micro-benchmark.

The decoder has the shape of a real dense model (Qwen3-0.6B by default: GQA, q/k RMSNorm, RoPE,
SwiGLU), random bf16 weights and a flat KV cache. Attention is an eager break that writes this
batch's keys and values into the cache and attends over each sequence's cached context, reading the
slot mapping, gather index and mask from the live batch: exactly what varies between batches that
share a token count (prefill, mixed prefill+decode, prefix hits). :class:`GraphToyAdapter` keeps that
attention inside the graph in some buckets, from metadata buffers fixed per bucket.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from bcg_plugin import live
from bcg_plugin.breaks import eager_break
from bcg_plugin.hookspecs import BREAKING, HostBatch, StaticInput, hookimpl


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """Model dimensions; defaults are Qwen3-0.6B's."""

    hidden: int = 1024
    layers: int = 28
    q_heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 3072
    vocab: int = 151936
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


QWEN3_0_6B = DecoderShape()


@dataclasses.dataclass
class AttentionMeta:
    """Per-batch attention state: where new K/V go and which cached keys each query sees.

    Attributes:
        slot_mapping: ``[n]`` cache slot of each new token.
        kv_index: ``[T * q_heads]`` flat (slot, kv-head) rows of every key the batch attends to,
            already expanded to query heads (GQA) so one gather feeds attention.
        mask: ``[1, 1, n, T]`` additive mask (0 visible, -inf hidden): causal within a sequence,
            nothing across sequences.
    """

    slot_mapping: torch.Tensor
    kv_index: torch.Tensor
    mask: torch.Tensor


@eager_break(outputs=("out",), capturable=True)
def toy_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
    batch = live.current()
    meta: AttentionMeta = batch.payload
    n = batch.num_tokens
    heads, dim = q.shape[1], q.shape[2]
    cache_k[meta.slot_mapping] = k[:n]
    cache_v[meta.slot_mapping] = v[:n]
    keys = cache_k.view(-1, dim)[meta.kv_index].view(-1, heads, dim)
    values = cache_v.view(-1, dim)[meta.kv_index].view(-1, heads, dim)
    o = F.scaled_dot_product_attention(
        q[:n].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0), attn_mask=meta.mask,
    )
    out[:n].view(n, heads, dim).copy_(o[0].transpose(0, 1))


class ToyDecoder:
    """Weights, rotary tables and KV cache of the reference decoder (no nn.Module: nothing to trace)."""

    def __init__(self, shape: DecoderShape = QWEN3_0_6B, *, kv_slots: int = 32768, max_positions: int = 65536,
                 device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        g = torch.Generator(device="cpu").manual_seed(seed)
        s = shape

        def w(*dims: int, std: float = 0.02) -> torch.Tensor:
            return (torch.randn(*dims, generator=g) * std).to(device=self.device, dtype=dtype)

        self.embed = w(s.vocab, s.hidden, std=1.0)
        qkv_out = (s.q_heads + 2 * s.kv_heads) * s.head_dim
        self.layers = [
            {
                "in_norm": 1 + w(s.hidden), "post_norm": 1 + w(s.hidden),
                "q_norm": 1 + w(s.head_dim), "k_norm": 1 + w(s.head_dim),
                "qkv": w(qkv_out, s.hidden), "o": w(s.hidden, s.q_heads * s.head_dim),
                "gate_up": w(2 * s.intermediate, s.hidden), "down": w(s.hidden, s.intermediate),
            }
            for _ in range(s.layers)
        ]
        self.final_norm = 1 + w(s.hidden)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        self.cos = torch.cat([freqs.cos()] * 2, dim=-1).to(self.device, dtype)
        self.sin = torch.cat([freqs.sin()] * 2, dim=-1).to(self.device, dtype)
        self.kv_slots = kv_slots
        self.cache_k = [
            (torch.randn(kv_slots, s.kv_heads, s.head_dim, generator=g)).to(self.device, dtype) for _ in range(s.layers)
        ]
        self.cache_v = [
            (torch.randn(kv_slots, s.kv_heads, s.head_dim, generator=g)).to(self.device, dtype) for _ in range(s.layers)
        ]

    # -- forward pieces ------------------------------------------------------------------------

    def embed_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def body(self, inputs_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The transformer body: embeds -> final-normed hidden states (attention is the break)."""
        s = self.shape
        rows = inputs_embeds.shape[0]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        h = inputs_embeds
        q_dim, kv_dim = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
        for i, p in enumerate(self.layers):
            x = F.rms_norm(h, (s.hidden,), p["in_norm"], s.eps)
            q, k, v = F.linear(x, p["qkv"]).split([q_dim, kv_dim, kv_dim], dim=-1)
            q = F.rms_norm(q.reshape(rows, s.q_heads, s.head_dim), (s.head_dim,), p["q_norm"], s.eps)
            k = F.rms_norm(k.reshape(rows, s.kv_heads, s.head_dim), (s.head_dim,), p["k_norm"], s.eps)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            out = torch.empty(rows, q_dim, device=h.device, dtype=h.dtype)
            toy_attention(q, k, v.reshape(rows, s.kv_heads, s.head_dim), out, self.cache_k[i], self.cache_v[i])
            h = h + F.linear(out, p["o"])
            x = F.rms_norm(h, (s.hidden,), p["post_norm"], s.eps)
            gate, up = F.linear(x, p["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, p["down"])
        return F.rms_norm(h, (s.hidden,), self.final_norm, s.eps)

    def forward_eager(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        n = input_ids.shape[0]
        with live.bound(live.LiveBatch(n, n, meta)):
            return self.body(self.embed_ids(input_ids), positions)

    # -- batches -------------------------------------------------------------------------------

    def attention_meta(self, seqs: Sequence[tuple[int, int, int]]) -> AttentionMeta:
        """Metadata for sequences given as ``(first_slot, context_len, new_len)``.

        Each sequence's keys live in slots ``[first_slot, first_slot + context_len + new_len)``;
        its new tokens are the last ``new_len`` of them (a decode is ``new_len == 1``).
        """
        s = self.shape
        slot_mapping, kv_slots, blocks = [], [], []
        for first, ctx, new in seqs:
            if first + ctx + new > self.kv_slots:
                raise ValueError(f"sequence needs slots up to {first + ctx + new}, cache has {self.kv_slots}")
            slot_mapping.append(torch.arange(first + ctx, first + ctx + new))
            kv_slots.append(torch.arange(first, first + ctx + new))
            q_pos = torch.arange(ctx, ctx + new).unsqueeze(1)
            blocks.append(torch.where(torch.arange(ctx + new).unsqueeze(0) <= q_pos, 0.0, -math.inf))
        slots = torch.cat(kv_slots)
        heads = torch.arange(s.q_heads) // (s.q_heads // s.kv_heads)
        kv_index = (slots.unsqueeze(1) * s.kv_heads + heads.unsqueeze(0)).reshape(-1)
        n = sum(new for _, _, new in seqs)
        off = torch.full((n, slots.numel()), -math.inf)
        row = col = 0
        for (first, ctx, new), block in zip(seqs, blocks):
            off[row : row + new, col : col + ctx + new] = block
            row, col = row + new, col + ctx + new
        return AttentionMeta(
            slot_mapping=torch.cat(slot_mapping).to(self.device),
            kv_index=kv_index.to(self.device),
            mask=off.to(self.device, self.dtype).view(1, 1, n, -1),
        )

    def positions(self, seqs: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        return torch.cat([torch.arange(ctx, ctx + new) for _, ctx, new in seqs]).to(self.device)


class ToyAdapter:
    """The reference decoder as a bcg host: what an engine adapter implements, in miniature."""

    def __init__(self, model: ToyDecoder, *, dummy_first_slot: int = 0):
        self.model = model
        self.dummy_first_slot = dummy_first_slot

    def batch(self, input_ids: torch.Tensor, seqs: Sequence[tuple[int, int, int]]) -> HostBatch:
        n = input_ids.shape[0]
        return HostBatch(
            num_tokens=n,
            inputs={"input_ids": input_ids, "positions": self.model.positions(seqs)},
            payload=self.model.attention_meta(seqs),
        )

    @hookimpl
    def bcg_static_inputs(self) -> dict[str, StaticInput]:
        return {
            "inputs_embeds": StaticInput((self.model.shape.hidden,), self.model.dtype, 0.0),
            "positions": StaticInput((), torch.int64, 0),
        }

    @hookimpl
    def bcg_dummy_batch(self, num_tokens: int) -> HostBatch:
        seqs = [(self.dummy_first_slot, 0, num_tokens)]
        ids = torch.ones(num_tokens, dtype=torch.int64, device=self.model.device)
        batch = self.batch(ids, seqs)
        batch.inputs["inputs_embeds"] = self.model.embed_ids(ids)
        return batch

    @hookimpl
    def bcg_embed(self, batch: HostBatch) -> dict[str, torch.Tensor]:
        return {"inputs_embeds": self.model.embed_ids(batch.inputs["input_ids"])}

    @hookimpl
    def bcg_body_forward(self, inputs: dict[str, torch.Tensor], payload: object) -> torch.Tensor:
        return self.model.body(inputs["inputs_embeds"], inputs["positions"])


class GraphToyAdapter(ToyAdapter):
    """The reference decoder with attention inside the graph in the buckets ``inside``, as an
    engine's full graphs keep it.

    Each such bucket's attention metadata lives in buffers fixed per bucket, sized for the bucket's
    rows and ``context`` more key columns (what a host sizes for its most requests and context), and
    :meth:`land` refills them before every replay. A step whose keys do not fit replays in a bucket
    that breaks: the ``breaking`` buckets are also captured as the :data:`~bcg_plugin.BREAKING`
    variant for that.
    """

    def __init__(self, model: ToyDecoder, *, inside: Sequence[int], context: int, breaking: Sequence[int] = (),
                 dummy_first_slot: int = 0):
        super().__init__(model, dummy_first_slot=dummy_first_slot)
        self.inside, self.context, self.breaking = frozenset(inside), context, tuple(breaking)
        self._fixed: dict[int, AttentionMeta] = {}

    def fits(self, bucket: int, seqs: Sequence[tuple[int, int, int]]) -> bool:
        """Whether ``seqs``' keys fit ``bucket``'s fixed metadata."""
        return sum(ctx + new for _, ctx, new in seqs) <= bucket + self.context

    def fixed_meta(self, bucket: int) -> AttentionMeta:
        """``bucket``'s fixed metadata buffers, made on first use."""
        meta = self._fixed.get(bucket)
        if meta is None:
            s, device, columns = self.model.shape, self.model.device, bucket + self.context
            meta = self._fixed[bucket] = AttentionMeta(
                slot_mapping=torch.zeros(bucket, dtype=torch.int64, device=device),
                kv_index=torch.zeros(columns * s.q_heads, dtype=torch.int64, device=device),
                mask=torch.zeros(1, 1, bucket, columns, dtype=self.model.dtype, device=device),
            )
        return meta

    def land(self, bucket: int, input_ids: torch.Tensor, seqs: Sequence[tuple[int, int, int]]) -> HostBatch:
        """``seqs``' batch with its attention metadata written into ``bucket``'s fixed buffers.

        Padded rows write their keys to the dummy slots, as the capture batch's do, and attend to
        one key only, so that they stay finite; real rows see no column past their batch's keys.
        """
        n = sum(new for _, _, new in seqs)
        if n > bucket:
            raise ValueError(f"a batch of {n} tokens does not fit bucket {bucket}")
        if not self.fits(bucket, seqs):
            raise ValueError(f"the batch's keys exceed bucket {bucket}'s {bucket + self.context} columns")
        dummy = range(self.dummy_first_slot, self.dummy_first_slot + bucket)
        if any(first < dummy.stop and first + ctx + new > dummy.start for first, ctx, new in seqs):
            raise ValueError(f"the batch's slots overlap the padded rows' {dummy}")
        batch = self.batch(input_ids, seqs)
        batch.payload = self._fill(bucket, batch.payload)
        return batch

    def _fill(self, bucket: int, step: AttentionMeta) -> AttentionMeta:
        """``bucket``'s fixed buffers, holding ``step``'s metadata and the padded rows'."""
        fixed, n, columns = self.fixed_meta(bucket), step.slot_mapping.numel(), step.mask.shape[-1]
        fixed.slot_mapping[:n].copy_(step.slot_mapping)
        fixed.slot_mapping[n:].copy_(torch.arange(n, bucket, device=self.model.device) + self.dummy_first_slot)
        fixed.kv_index.zero_()
        fixed.kv_index[: step.kv_index.numel()].copy_(step.kv_index)
        fixed.mask.fill_(-math.inf)
        fixed.mask[:, :, :n, :columns].copy_(step.mask)
        fixed.mask[:, :, n:, 0] = 0.0
        return fixed

    @hookimpl
    def bcg_graph_attention(self, buckets: list[int], attention: str) -> list[int] | None:
        return [b for b in buckets if b in self.inside]

    @hookimpl
    def bcg_graph_variants(self, buckets: list[int]) -> dict[int, list[str]] | None:
        return {b: [BREAKING] for b in self.breaking if b in buckets} or None

    @hookimpl
    def bcg_dummy_batch(self, num_tokens: int, graph_attention: bool, variant: str | None) -> HostBatch:
        batch = super().bcg_dummy_batch(num_tokens)  # its keys on the dummy slots
        if graph_attention:
            batch.payload = self._fill(num_tokens, batch.payload)
        return batch
