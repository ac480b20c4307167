"""The reference decoder's graph-attention adapter on CPU: what it lands into a bucket's fixed
metadata must give the real rows eager's attention (the GPU suite then captures it inline)."""

from __future__ import annotations

import pytest
import torch

from bcg_plugin import BREAKING, live
from bcg_plugin.testing import DecoderShape, GraphToyAdapter, ToyDecoder

TINY = DecoderShape(hidden=64, layers=2, q_heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=500)
DUMMY_SLOTS = 64  # slots [0, 64) take the padded rows' keys; real sequences start above
MIX = [(DUMMY_SLOTS, 7, 1), (DUMMY_SLOTS + 20, 0, 9), (DUMMY_SLOTS + 40, 5, 3)]  # a decode, a prefill, a prefix hit
OTHER = [(DUMMY_SLOTS + 100, 0, 13)]


@pytest.fixture
def adapter():
    model = ToyDecoder(TINY, kv_slots=256, max_positions=128, device="cpu", dtype=torch.float32)
    return GraphToyAdapter(model, inside=(16, 32), context=24, breaking=(32,))


def padded_forward(adapter: GraphToyAdapter, bucket: int, ids: torch.Tensor, positions: torch.Tensor,
                   payload) -> torch.Tensor:
    """The bucket's forward as its graph runs it: inputs padded as the core pads them, the whole
    bucket's rows through attention that reads ``payload``."""
    model, n = adapter.model, ids.shape[0]
    embeds = torch.zeros(bucket, TINY.hidden)
    embeds[:n] = model.embed_ids(ids)
    padded_positions = torch.zeros(bucket, dtype=torch.int64)
    padded_positions[:n] = positions
    with live.bound(live.LiveBatch(bucket, bucket, payload)):
        return model.body(embeds, padded_positions)


def test_landed_metadata_gives_the_real_rows_eagers_attention_and_stale_metadata_does_not(adapter):
    model = adapter.model
    ids = torch.randint(0, TINY.vocab, (13,))
    positions = model.positions(MIX)
    ref = model.forward_eager(ids, positions, model.attention_meta(MIX))
    batch = adapter.land(16, ids, MIX)
    assert batch.num_tokens == 13 and batch.payload is adapter.fixed_meta(16)
    out = padded_forward(adapter, 16, ids, batch.inputs["positions"], batch.payload)
    assert torch.allclose(out[:13], ref, rtol=1e-4, atol=1e-4)
    padded = batch.payload.mask[0, 0, 13:]
    assert ((padded == 0).sum(-1) == 1).all() and (padded[:, 0] == 0).all()  # padded rows attend to one key
    assert torch.isfinite(out[13:]).all()
    # Negative control: another step's metadata left in the buffers fails the same check.
    adapter.land(16, ids, OTHER)
    stale = padded_forward(adapter, 16, ids, positions, adapter.fixed_meta(16))
    assert not torch.allclose(stale[:13], ref, rtol=1e-4, atol=1e-4)


def test_padded_rows_write_their_keys_to_the_dummy_slots_only(adapter):
    model = adapter.model
    ids = torch.randint(0, TINY.vocab, (13,))
    batch = adapter.land(16, ids, MIX)
    before = model.cache_k[0].clone()
    padded_forward(adapter, 16, ids, batch.inputs["positions"], batch.payload)
    changed = (model.cache_k[0] != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    real = model.attention_meta(MIX).slot_mapping.tolist()
    assert sorted(changed) == sorted(real + [13, 14, 15])


def test_a_step_that_does_not_fit_the_buckets_buffers_is_refused(adapter):
    assert adapter.fits(16, [(DUMMY_SLOTS, 30, 1), (DUMMY_SLOTS + 40, 0, 9)])  # 40 keys: 16 rows + 24 columns
    wide = [(DUMMY_SLOTS, 40, 1)]  # 41 keys
    assert not adapter.fits(16, wide)
    with pytest.raises(ValueError, match="exceed bucket 16's 40 columns"):
        adapter.land(16, torch.ones(1, dtype=torch.int64), wide)
    with pytest.raises(ValueError, match="17 tokens does not fit bucket 16"):
        adapter.land(16, torch.ones(17, dtype=torch.int64), [(DUMMY_SLOTS, 0, 17)])
    with pytest.raises(ValueError, match="overlap the padded rows"):  # their keys would race the padding's
        adapter.land(16, torch.ones(2, dtype=torch.int64), [(10, 0, 2)])


def test_its_hooks_name_the_inside_buckets_the_breaking_variants_and_plan_the_capture_batch(adapter):
    assert adapter.bcg_graph_attention(buckets=[16, 32, 64], attention="auto") == [16, 32]
    assert adapter.bcg_graph_variants(buckets=[16, 32]) == {32: [BREAKING]}
    assert adapter.bcg_graph_variants(buckets=[16]) is None
    inside = adapter.bcg_dummy_batch(num_tokens=16, graph_attention=True, variant=None)
    assert inside.payload is adapter.fixed_meta(16) and inside.num_tokens == 16
    breaking = adapter.bcg_dummy_batch(num_tokens=32, graph_attention=False, variant=BREAKING)
    assert breaking.payload is not adapter.fixed_meta(32) and breaking.payload.mask.shape == (1, 1, 32, 32)
