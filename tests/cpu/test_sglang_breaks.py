"""bcg's breaks inside SGLang, on CPU: the attention break on a DP-padded batch."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("sglang")

from bcg_plugin import live  # noqa: E402
from bcg_plugin.adapters.sglang import attention  # noqa: E402

HEADS, HEAD_DIM = 2, 4
WIDTH = HEADS * HEAD_DIM


# -- the attention break on a DP-padded batch ----------------------------------------------------


class _StoreCacheKV:
    """A KV pool whose store keeps SGLang's ``store_cache`` contract: one cache slot per key row
    (the CUDA kernel rejects ``indices`` and ``k`` of different row counts)."""

    def __init__(self, slots: int) -> None:
        self.k = torch.zeros(slots, WIDTH)
        self.v = torch.zeros(slots, WIDTH)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v) -> None:
        if loc.shape[0] != cache_k.shape[0] or loc.shape[0] != cache_v.shape[0]:
            raise RuntimeError(f"store_cache: indices has {loc.shape[0]} rows, k {cache_k.shape[0]}, "
                               f"v {cache_v.shape[0]}")
        self.k[loc] = cache_k.reshape(-1, WIDTH)
        self.v[loc] = cache_v.reshape(-1, WIDTH)


class _ExtendBackend:
    """An extend backend as SGLang's triton one behaves: K/V stored at the batch's cache slots,
    the result written into the batch's output slot. ``fail`` raises after the store."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen_cache_loc_rows: list[int] = []

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.seen_cache_loc_rows.append(forward_batch.out_cache_loc.shape[0])
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        if self.fail:
            raise RuntimeError("backend failed after the store")
        out = forward_batch._attn_output
        out.copy_(q.reshape(out.shape) * 2 + 1)
        return out


def _padded_dp_batch(backend, *, bucket=16, landed=12, real=5):
    """A DP rank's replay: ``landed`` rows (SGLang padded this rank to the DP-wide count), of which
    ``real`` are its own tokens; the graph's bucket holds ``bucket`` rows."""
    slots = torch.arange(100, 100 + landed)
    slots[real:] = 0  # SGLang's padding slot
    fb = types.SimpleNamespace(out_cache_loc=slots, num_token_non_padded_cpu=real,
                               token_to_kv_pool=_StoreCacheKV(128), _attn_output=None)
    fwd = attention.ForwardPass(forward_batch=fb, attn_backend=backend, attention_layers=[object()])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(bucket, WIDTH, generator=gen) for _ in range(3))
    return live.LiveBatch(num_tokens=landed, bucket=bucket, payload=fwd), fb, q, k, v


def test_attention_stores_the_real_rows_of_a_dp_padded_batch_and_restores_its_cache_slots():
    backend = _ExtendBackend()
    batch, fb, q, k, v = _padded_dp_batch(backend)
    slots = fb.out_cache_loc
    out = torch.full((16, WIDTH), float("nan"))
    with live.bound(batch):
        attention.bcg_attention(q, k, v, out, True, 0)
    assert backend.seen_cache_loc_rows == [5]
    pool = fb.token_to_kv_pool
    assert torch.equal(pool.k[100:105], k[:5]) and torch.equal(pool.v[100:105], v[:5])
    assert not pool.k[105:].any() and not pool.k[:100].any()  # nothing for padded rows, nor at slot 0
    assert torch.equal(out[:5], q[:5] * 2 + 1)
    assert not out[5:].any()  # DP-padded and bucket-padded rows zeroed
    assert fb.out_cache_loc is slots and fb._attn_output is None  # the logits tail sees the batch's own


def test_attention_restores_the_cache_slots_when_the_backend_raises():
    backend = _ExtendBackend(fail=True)
    batch, fb, q, k, v = _padded_dp_batch(backend)
    slots = fb.out_cache_loc
    with live.bound(batch), pytest.raises(RuntimeError, match="backend failed after the store"):
        attention.bcg_attention(q, k, v, torch.zeros(16, WIDTH), True, 0)
    assert backend.seen_cache_loc_rows == [5]
    assert fb.out_cache_loc is slots and fb._attn_output is None
