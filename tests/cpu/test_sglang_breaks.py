"""bcg's breaks inside SGLang, on CPU: the attention break on a DP-padded batch, and SGLang's own
breaks (``eager_on_graph``) that bcg does not route, which must fail bcg's capture instead of being
captured inline."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("sglang")

pytestmark = pytest.mark.sglang

from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (  # noqa: E402
    breakable_cuda_graph as sglang_bcg,
)
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (  # noqa: E402
    eager_on_graph,
    is_in_breakable_cuda_graph,
)

from sglang.srt.layers import radix_attention  # noqa: E402

from bcg_plugin import (  # noqa: E402
    BcgCaptureError, BcgConfig, BcgStateError, Fallback, PrefillGraphRunner, live, plugin_manager,
)
from bcg_plugin.adapters.sglang import attention, version  # noqa: E402
from bcg_plugin.adapters.sglang.replay import _breakable_capture_flag  # noqa: E402
from bcg_plugin.patches import PatchTargetError, descriptors  # noqa: E402
from bcg_plugin.patches.sglang import breakable_capture_var, radix_attention_breakable, radix_attention_eager  # noqa: E402
import sglang_fa3  # noqa: E402
from capture_fakes import FakePool, script_captures  # noqa: E402

# SGLang 0.5.23 replaced the module-level breakable attention ops with RadixAttention's eager method.
EAGER_METHOD = not hasattr(radix_attention, "breakable_unified_attention_with_output")


def installed_descriptor(module):
    """The descriptor of patch ``module`` for the installed SGLang (one per release)."""
    found = [p for p in descriptors(module) if p.applies_to(version.installed())]
    assert len(found) == 1, (module.__name__, version.installed(), found)
    return found[0]

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
        self.seen_position_rows: list[int] = []

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.seen_cache_loc_rows.append(forward_batch.out_cache_loc.shape[0])
        self.seen_position_rows.append(forward_batch.positions.shape[0])
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
    # The real-token count under the name the installed SGLang's ForwardBatch uses (0.5.20 renamed it).
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    real_field = ("global_num_token_non_padded_cpu" if "global_num_token_non_padded_cpu" in ForwardBatch.__dataclass_fields__
                  else "num_token_non_padded_cpu")
    fb = types.SimpleNamespace(out_cache_loc=slots, token_to_kv_pool=_StoreCacheKV(128), _attn_output=None,
                               positions=torch.arange(landed), **{real_field: real})
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
    assert fb.positions.shape[0] == 12  # the batch's own again
    # Where SGLang's eager attention narrows the positions (0.5.23 on), the backend saw the real rows'.
    assert backend.seen_position_rows == [5 if attention._narrows_positions() else 12]


def test_an_idle_dp_rank_padded_to_its_peers_bucket_calls_no_backend_and_writes_zeros():
    """SGLang 0.5.23 pads an idle DP rank to the bucket with no real row; its own eager attention then
    only zeroes the output, and flashinfer refuses a call with no query row."""
    backend = _ExtendBackend()
    batch, fb, q, k, v = _padded_dp_batch(backend, real=0)
    out = torch.full((16, WIDTH), float("nan"))
    with live.bound(batch):
        attention.bcg_attention(q, k, v, out, True, 0)
    assert backend.seen_cache_loc_rows == []
    assert not out[:12].any()  # the landed rows; the bucket's rows past them are the graph's scrub
    assert not fb.token_to_kv_pool.k.any()


class _SlotsSeen(_ExtendBackend):
    """Keeps the cache-slot tensor each call was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.slots: list[torch.Tensor] = []

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.slots.append(forward_batch.out_cache_loc)
        return super().forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


def test_the_real_rows_are_narrowed_once_per_forward_and_again_when_the_batch_swaps_its_slots():
    """Every break of a forward narrows the same slots to the same rows: the first one does it, the
    rest reuse it. The capture swaps the bucket's static buffers into the batch, so a swap narrows anew."""
    backend = _SlotsSeen()
    batch, fb, q, k, v = _padded_dp_batch(backend)
    out = torch.zeros(16, WIDTH)
    with live.bound(batch):
        for _ in range(3):
            attention.bcg_attention(q, k, v, out, True, 0)
        assert backend.slots[0] is backend.slots[1] is backend.slots[2]
        swapped = fb.out_cache_loc = torch.arange(20, 32)
        attention.bcg_attention(q, k, v, out, True, 0)
    assert backend.slots[3] is not backend.slots[0]
    assert torch.equal(backend.slots[3], swapped[:5]) and torch.equal(backend.slots[0], torch.arange(100, 105))
    assert fb.out_cache_loc is swapped


def test_attention_restores_the_cache_slots_when_the_backend_raises():
    backend = _ExtendBackend(fail=True)
    batch, fb, q, k, v = _padded_dp_batch(backend)
    slots = fb.out_cache_loc
    with live.bound(batch), pytest.raises(RuntimeError, match="backend failed after the store"):
        attention.bcg_attention(q, k, v, torch.zeros(16, WIDTH), True, 0)
    assert backend.seen_cache_loc_rows == [5]
    assert fb.out_cache_loc is slots and fb._attn_output is None


# -- the KV-cache store inside the captured segment ----------------------------------------------


class _ExtendAttention:
    """What the break hands SGLang's extend backend: each call's ``save_kv_cache`` (kept, nothing
    stored), the output written."""

    def __init__(self) -> None:
        self.saved: list[bool] = []

    def __call__(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.saved.append(save_kv_cache)
        out = forward_batch._attn_output
        out.copy_(q.reshape(out.shape))
        return out


def _backend_class(name):
    if name == "fa3":
        return sglang_fa3.backend_class()
    if name == "flashinfer":
        from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
        return FlashInferAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    return TritonAttnBackend


def _capture(backend_name="triton", *, bucket=16, real=5, **changes):
    """A capture-time forward on one of SGLang's own extend backends (``"triton"``, ``"flashinfer"`` or ``"fa3"``)
    and its MHA pool (CPU buffers; the backend's kernels replaced by :class:`_ExtendAttention`): the
    bucket's static slots hold ``real`` request slots and SGLang's padding slot 0 after them.
    ``changes`` set attributes of ``backend``/``pool``/``layer``/``metadata`` (``"layer.k_scale": 1.0``)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float32, head_num=HEADS, head_dim=HEAD_DIM,
                            layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    backend = object.__new__(_backend_class(backend_name))  # its __init__ wants a model runner; the break reads these
    backend.token_to_kv_pool, backend.dcp_size, backend.use_mla = pool, 1, False
    backend.prefill_uses_dequant_workspace = False
    backend.forward_metadata = types.SimpleNamespace(swa_out_cache_loc=None, out_cache_loc_full_physical=None)
    backend.forward = _ExtendAttention()
    layer = types.SimpleNamespace(layer_id=0, k_scale=None, v_scale=None, is_cross_attention=False,
                                  attn_type=radix_attention.AttentionType.DECODER)
    owners = {"backend": backend, "pool": pool, "layer": layer, "metadata": backend.forward_metadata}
    for name, value in changes.items():
        owner, attr = name.split(".")
        setattr(owners[owner], attr, value)
    slots = torch.zeros(bucket, dtype=torch.int64)
    slots[:real] = torch.arange(40, 40 + real)
    fb = types.SimpleNamespace(out_cache_loc=slots, token_to_kv_pool=pool, _attn_output=None,
                               positions=torch.arange(bucket), out_cache_loc_is_physical=False)
    fwd = attention.ForwardPass(forward_batch=fb, attn_backend=backend, attention_layers=[layer])
    gen = torch.Generator().manual_seed(0)
    # Strided views of one fused projection, as the model hands them over (flashinfer stores them so).
    q, k, v = torch.randn(bucket, 3, HEADS, HEAD_DIM, generator=gen).unbind(1)
    return live.LiveBatch(num_tokens=bucket, bucket=bucket, payload=fwd), pool, q, k, v


@pytest.mark.parametrize("backend_name", ["triton", "flashinfer", "other"])
def test_key_and_value_reach_the_break_contiguous_only_where_the_backend_would_copy_them(backend_name, monkeypatch):
    """triton copies strided keys and values on every call, so the segment does it instead; flashinfer
    (and any other backend) reads them strided, and a copy would be GPU work SGLang never runs."""
    seen = {}
    monkeypatch.setattr(attention, "bcg_attention", lambda q, k, v, out, *a, **kw: seen.update(k=k, v=v, rest=(a, kw)))
    qkv = torch.arange(4 * 12, dtype=torch.float32).view(4, 12)
    q, k, v = qkv.split([4, 4, 4], dim=-1)
    assert not k.is_contiguous() and not v.is_contiguous()
    # Only the backend's type is read before the store check.
    backend = object() if backend_name == "other" else object.__new__(_backend_class(backend_name))
    fwd = attention.ForwardPass(forward_batch=None, attn_backend=backend, attention_layers=[])
    with live.bound(live.LiveBatch(num_tokens=4, bucket=4, payload=fwd)):
        attention.captured_then_break(q, k, v, torch.empty(4, 4), False, 3, key_value_num_tokens=None)
    if backend_name == "triton":
        assert seen["k"].is_contiguous() and seen["v"].is_contiguous()
        assert torch.equal(seen["k"], k) and torch.equal(seen["v"], v)
    else:
        assert seen["k"] is k and seen["v"] is v
    assert seen["rest"] == ((False, 3), {"key_value_num_tokens": None})


@pytest.mark.parametrize("backend_name", ["triton", "flashinfer", "fa3"])
def test_the_segment_stores_the_kv_cache_at_the_buckets_slots_and_the_break_only_attends(backend_name):
    """On the triton, flashinfer and fa3 backends and SGLang's plain MHA pool the store runs in the
    captured segment, through SGLang's own pool, on every row of the bucket: the request rows reach
    their slots, the padded rows only SGLang's padding slot. The break is then told not to store again."""
    batch, pool, q, k, v = _capture(backend_name)
    out = torch.zeros(16, WIDTH)
    with live.bound(batch):
        attention.captured_then_break(q, k, v, out, True, 0)
    backend = batch.payload.attn_backend
    assert backend.forward.saved == [False] and batch.payload.stored_in_graph == {0}
    cache = pool.k_buffer[0]
    assert torch.equal(cache[40:45], k[:5]) and torch.equal(pool.v_buffer[0][40:45], v[:5])
    assert not cache[1:40].any() and not cache[45:].any()  # nothing else but the padding slot 0


def test_the_segment_writes_the_cache_fa3s_own_store_writes():
    """fa3's own ``forward_extend``, stopped right after its store, and bcg's store in the segment
    leave the same keys and values at the request rows' slots (the segment also writes the padded
    rows to SGLang's padding slot 0, which fa3 never reads)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    class Stored(Exception):
        pass

    theirs, q, k, v = _capture("fa3")[1:]
    backend = object.__new__(sglang_fa3.backend_class())
    backend.__dict__.update(token_to_kv_pool=theirs, fa_skip_kv_cache=False, use_mla=False, kv_cache_is_mxfp8=False,
                            attn_cp_size=1, use_sliding_window_kv_pool=False,
                            forward_metadata=types.SimpleNamespace(swa_out_cache_loc=None))
    store = theirs.set_kv_buffer

    def store_then_stop(*args, **kwargs):
        store(*args, **kwargs)
        raise Stored

    theirs.set_kv_buffer = store_then_stop
    layer = types.SimpleNamespace(layer_id=0, k_scale=None, v_scale=None, is_cross_attention=False)
    real = 5  # bcg's break hands fa3 the request rows only, and their slots
    fb = types.SimpleNamespace(out_cache_loc=torch.arange(40, 40 + real), out_cache_loc_is_physical=False,
                               forward_mode=ForwardMode.EXTEND, attn_cp_metadata=None)
    with pytest.raises(Stored):
        backend.forward_extend(q[:real], k[:real], v[:real], layer, fb, save_kv_cache=True)

    batch, ours, *_ = _capture("fa3", real=real)
    with live.bound(batch):
        attention.captured_then_break(q, k, v, torch.zeros(16, WIDTH), True, 0)
    assert batch.payload.stored_in_graph == {0}
    assert theirs.k_buffer[0][40:45].any()
    for mine, fa3s in ((ours.k_buffer[0], theirs.k_buffer[0]), (ours.v_buffer[0], theirs.v_buffer[0])):
        assert torch.equal(mine[1:], fa3s[1:])


@pytest.mark.parametrize("backend_name", ["triton", "flashinfer", "fa3"])
@pytest.mark.parametrize("change", [
    {"layer.k_scale": 1.0},  # scaled KV: the backend clones and scales before its store
    {"layer.is_cross_attention": True},  # stores at the encoder's slots
    {"metadata.swa_out_cache_loc": torch.zeros(16, dtype=torch.int64)},  # slots planned per forward
    {"metadata.out_cache_loc_full_physical": torch.zeros(16, dtype=torch.int64)},
    {"backend.dcp_size": 2},  # each rank stores its own tokens, masked per forward
    {"pool.quant_method": object()},  # a quantized KV cache (is_quantized_kv_cache)
    {"backend.prefill_uses_dequant_workspace": True},  # flashinfer reads the new keys beside the cache
    # flashinfer's second wrapper (sliding window): before 0.5.23 its cache pass also covers the new tokens
    {"backend.dispatch_reason": "sliding_window"},
    {"layer.attn_type": radix_attention.AttentionType.ENCODER_ONLY},  # flashinfer's ragged prefill does not store them
    {"backend.fa_impl_ver": 4},  # FlashAttention 4 under fa3's class
    {"backend.fa_skip_kv_cache": True},  # fa3 without a KV cache: nothing to store
    {"backend.attn_cp_size": 2},  # fa3 gathers each rank's keys before its store
    {"backend._kv_shard_pool": object()},  # fa3 stores through a sharded pool's plan
], ids=lambda change: next(iter(change)))
def test_a_store_that_reads_per_forward_state_stays_in_the_break(change, backend_name):
    batch, pool, q, k, v = _capture(backend_name, **change)
    with live.bound(batch):
        attention.captured_then_break(q, k, v, torch.zeros(16, WIDTH), True, 0)
    assert batch.payload.attn_backend.forward.saved == [True] and batch.payload.stored_in_graph == set()


class _OtherBackend:
    """Neither SGLang's triton nor its flashinfer backend, though it holds everything the store in
    the segment would read."""


def test_other_backends_store_in_the_break():
    batch, pool, q, k, v = _capture()
    triton = batch.payload.attn_backend
    other = _OtherBackend()
    other.__dict__.update(vars(triton))
    batch.payload.attn_backend = other
    with live.bound(batch):
        attention.captured_then_break(q, k, v, torch.zeros(16, WIDTH), True, 0)
    assert other.forward.saved == [True]
    assert not pool.k_buffer[0].any()  # nothing stored in the segment


def test_keys_of_another_row_count_than_the_slots_store_in_the_break():
    """SGLang's store takes one cache slot per key row; the segment stores only where they match."""
    batch, pool, q, k, v = _capture()
    batch.payload.forward_batch.out_cache_loc = torch.zeros(20, dtype=torch.int64)
    with live.bound(batch):
        attention.captured_then_break(q, k, v, torch.zeros(16, WIDTH), True, 0)
    assert batch.payload.attn_backend.forward.saved == [True]


def test_a_fault_plugin_may_leave_the_graphs_store_the_captures_slots_and_the_batch_keeps_its_own(
        fresh_faults, monkeypatch):
    from bcg_plugin import faults
    from bcg_plugin.adapters.sglang import replay

    monkeypatch.delenv(faults.FAULTS_ENV, raising=False)
    slots = torch.arange(40, 52)
    plugin = types.ModuleType("bcg_test_stale_slots")
    plugin.bcg_graph_metadata = faults.hookimpl(lambda live, earlier: live["out_cache_loc"].copy_(earlier["out_cache_loc"]))
    faults.plugins().register(plugin)
    landed = replay._graph_slots(16, slots)
    assert not landed.any() and torch.equal(slots, torch.arange(40, 52))


# -- SGLang's own breaks under bcg's capture -----------------------------------------------------


@pytest.fixture
def bound_patch(monkeypatch):
    """The patch applied as the SGLang patch set applies it (it binds SGLang's variable)."""
    monkeypatch.setattr(breakable_capture_var, "_capture_var", None)
    patch = installed_descriptor(breakable_capture_var)
    patch.unapply()
    patch.apply()
    assert patch.in_place()
    yield breakable_capture_var
    patch.unapply()


def _fake_sglang_break():
    calls = []

    def fake_mamba_mixer(x):
        calls.append(x)
        return x + 1

    return eager_on_graph(True)(fake_mamba_mixer), calls


def test_a_break_bcg_does_not_route_fails_its_capture_naming_the_op(bound_patch):
    op, calls = _fake_sglang_break()
    with _breakable_capture_flag():
        assert is_in_breakable_cuda_graph()  # model code still takes its breakable branches
        with pytest.raises(BcgCaptureError, match=r"graph break test_sglang_breaks\._fake_sglang_break\.<locals>\."
                                                  r"fake_mamba_mixer \(called from .*test_sglang_breaks\.py:\d+\)"):
            op(1)
    assert calls == []  # refused before it ran, so nothing was captured inline
    assert not is_in_breakable_cuda_graph() and sglang_bcg._current_capture_var.get() is None


def test_outside_bcg_capture_sglang_breaks_run_as_sglang_runs_them(bound_patch):
    op, calls = _fake_sglang_break()
    assert op(1) == 2 and calls == [1]
    with _breakable_capture_flag():
        pass
    assert op(2) == 3 and calls == [1, 2]  # nothing left behind by bcg's capture


_BREAK_MODULE = "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph"
if EAGER_METHOD:  # 0.5.23: SGLang's breaks are eager_on_graph methods
    OWN_BREAKS = [
        ("sglang.srt.layers.radix_linear_attention", "RadixLinearAttention._eager_linear_attention",
         "sglang.srt.layers.radix_linear_attention.RadixLinearAttention._eager_linear_attention"),
        ("sglang.srt.layers.radix_attention", "RadixAttention._eager_attention",  # without bcg's patch
         "sglang.srt.layers.radix_attention.RadixAttention._eager_attention"),
        (_BREAK_MODULE, "break_graph", f"{_BREAK_MODULE}.break_graph"),
    ]
else:
    OWN_BREAKS = [
        ("sglang.srt.layers.radix_linear_attention", "bcg_unified_linear_attention_with_output",
         "torch.ops.sglang.unified_linear_attention_with_output"),
        ("sglang.srt.layers.radix_attention", "breakable_unified_attention_with_output_and_lse",
         "torch.ops.sglang.unified_attention_with_output_and_lse"),
        ("sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla", "bcg_mla_bmm_then_unified_attention",
         "torch.ops.sglang.mla_bmm_then_unified_attention"),
        (_BREAK_MODULE, "break_graph", f"{_BREAK_MODULE}.break_graph"),
    ]
    if hasattr(radix_attention, "breakable_unified_sparse_attention_with_output"):  # 0.5.22
        OWN_BREAKS.append(("sglang.srt.layers.radix_attention", "breakable_unified_sparse_attention_with_output",
                           "torch.ops.sglang.unified_sparse_attention_with_output"))


def _resolve(module: str, attr: str):
    value = importlib.import_module(module)
    for part in attr.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("module, attr, op_name", OWN_BREAKS)
def test_sglang_own_breaks_are_refused_by_name(bound_patch, module, attr, op_name):
    op = _resolve(module, attr)
    with _breakable_capture_flag(), pytest.raises(BcgCaptureError) as caught:
        op()  # refused before its arguments are looked at
    message = str(caught.value)
    assert f"graph break {op_name} (called from " in message
    assert "breakable_cuda_graph.py" not in message.split("called from", 1)[1]  # the caller, not SGLang's wrapper


def test_the_break_bcg_routes_is_not_refused(bound_patch, monkeypatch):
    """RadixAttention's break goes to bcg's break, never reaching SGLang's wrapper: the module-level
    unified op through 0.5.22, the eager-attention method from 0.5.23."""
    if EAGER_METHOD:
        _eager_method_is_bcgs_break_and_its_variants_are_refused(monkeypatch)
    else:
        _unified_op_is_bcgs_break(monkeypatch)


def _unified_op_is_bcgs_break(monkeypatch):
    seen = []
    monkeypatch.setattr(attention, "bcg_attention", lambda *a, **kw: seen.append(a[4:]))
    fwd = attention.ForwardPass(forward_batch=None, attn_backend=None, attention_layers=[])
    q = torch.zeros(4, WIDTH)
    with _breakable_capture_flag(), live.bound(live.LiveBatch(4, 4, fwd)):
        around = radix_attention_breakable.make(capturing=attention.capturing,
                                                attention_break=attention.captured_then_break)
        around(radix_attention.breakable_unified_attention_with_output, q, q, q, q, True, 7)
        with pytest.raises(BcgCaptureError):  # the same wrapper, reached directly, is refused
            radix_attention.breakable_unified_attention_with_output(q, q, q, q, True, 7)
    assert seen == [(True, 7)]


def _eager_method_is_bcgs_break_and_its_variants_are_refused(monkeypatch):
    """0.5.23: the method's graph entry goes to bcg's break while bcg captures; its LSE, sparse and
    extra-kwargs forms fail the capture; its explicit eager entry stays SGLang's."""
    original = radix_attention.RadixAttention.__dict__["_eager_attention"]
    seen = []
    monkeypatch.setattr(attention, "bcg_attention", lambda *a, **kw: seen.append((a[4:], kw)))
    method = radix_attention_eager.make(original, capturing=attention.capturing,
                                        layer_attention_break=attention.layer_attention_break)
    assert method._eager_call is original._eager_call and callable(method.run_eager)
    layer = types.SimpleNamespace(layer_id=7)
    fwd = attention.ForwardPass(forward_batch=None, attn_backend=None, attention_layers=[])
    q = torch.zeros(4, WIDTH)
    with _breakable_capture_flag(), live.bound(live.LiveBatch(4, 4, fwd)):
        method(layer, q, q, q, q, True, None, None, None)
        assert seen == [((True, 7), {"key_value_num_tokens": None})]
        for args, kwargs, what in [((None, None, q), {}, "log-sum-exp"), ((None, q, None), {}, "sparse-indexer"),
                                   ((), {"return_lse": True}, "log-sum-exp"),
                                   ((), {"score_mod": lambda *a: a}, "score_mod")]:
            with pytest.raises(BcgStateError, match=what):
                method(layer, q, q, q, q, True, *args, **kwargs)
        with pytest.raises(BcgCaptureError):  # SGLang's own method, reached without bcg's patch, is refused
            original(layer, q, q, q, q, True)
    assert len(seen) == 1


def _runner_whose_body_reaches(op, capture_failure="eager"):
    """A runner on CPU whose every bucket's body calls ``op``: capture reduced to the body, the
    failure handling (agreement, fallback, raise) the core's own."""
    runner = PrefillGraphRunner(plugin_manager(), BcgConfig(enable=True, sizes=(16, 32), capture_failure=capture_failure),
                                chunk_size=32, device="cpu")
    runner._prepare_capture = lambda: runner.__setattr__("_pool", FakePool())

    def capture_bucket(bucket, stream, warm=True, variant=None):
        op(torch.zeros(bucket))
        return types.SimpleNamespace(release=lambda: None)

    script_captures(runner, capture_bucket)
    return runner


def test_the_capture_fails_loudly_and_prefill_runs_eagerly(bound_patch, caplog):
    op, calls = _fake_sglang_break()
    runner = _runner_whose_body_reaches(op)
    with caplog.at_level(logging.WARNING, logger="bcg_plugin"), _breakable_capture_flag():
        runner.capture(progress=False)
    assert not runner.captured and calls == []
    assert "cannot capture SGLang's graph break" in caplog.text and "fake_mamba_mixer" in caplog.text
    assert "every rank runs prefill eagerly" in caplog.text
    assert runner.bucket_for(16) is None and dict(runner.stats.fallbacks) == {Fallback.CAPTURE_FAILED.value: 1}

    control = _runner_whose_body_reaches(op)  # the same body outside bcg's capture context captures
    control.capture(progress=False)
    assert control.captured and len(calls) == 2


def test_the_capture_failure_raises_naming_the_op_when_asked_to(bound_patch):
    op, _ = _fake_sglang_break()
    runner = _runner_whose_body_reaches(op, capture_failure="raise")
    with _breakable_capture_flag(), pytest.raises(BcgCaptureError, match="fake_mamba_mixer"):
        runner.capture(progress=False)


# -- the patch's own checks ----------------------------------------------------------------------


def verify(patch) -> str | None:
    try:
        patch.verify()
    except PatchTargetError as e:
        return str(e)
    return None


def test_the_patch_verifies_against_the_installed_sglang():
    assert verify(installed_descriptor(breakable_capture_var)) is None


def test_each_descriptor_probes_its_own_decorator_form():
    def refuses(*args, **kwargs):
        raise TypeError("this form is not supported")

    switch_first, bare = breakable_capture_var.PATCHES
    assert "eager_on_graph(True) no longer decorates" in verify_with(switch_first, refuses)
    assert "eager_on_graph(fn) no longer decorates" in verify_with(bare, refuses)


def verify_with(patch, decorator) -> str:
    original = sglang_bcg.eager_on_graph
    sglang_bcg.eager_on_graph = decorator
    try:
        return verify(patch) or ""
    finally:
        sglang_bcg.eager_on_graph = original


def test_the_patch_refuses_an_sglang_whose_wrapper_runs_breaks_inline(monkeypatch):
    def inline_eager_on_graph(fn=None, capture_stub=None, **kw):
        decorate = lambda inner: inner  # noqa: E731  a wrapper that never consults the capture
        return decorate if fn is None or isinstance(fn, bool) else decorate(fn)

    monkeypatch.setattr(sglang_bcg, "eager_on_graph", inline_eager_on_graph)
    problem = verify(installed_descriptor(breakable_capture_var))
    assert problem is not None and "no longer ends the capture's segment" in problem
    assert sglang_bcg._current_capture_var.get() is None


def test_refusing_breaks_needs_the_patch_applied(monkeypatch):
    monkeypatch.setattr(breakable_capture_var, "_capture_var", None)
    with pytest.raises(RuntimeError, match="not bound"):
        with breakable_capture_var.refusing_breaks(BcgCaptureError):
            pass


# -- installed as SGLang installs plugins --------------------------------------------------------

INSTALLED = """
import json, torch
from sglang.srt.plugins import load_plugins
load_plugins()
from bcg_plugin import BcgCaptureError, live
from bcg_plugin.adapters.sglang import attention, is_active
from bcg_plugin.adapters.sglang.replay import _breakable_capture_flag
from bcg_plugin.patches.sglang import breakable_capture_var
from sglang.srt.layers import radix_attention, radix_linear_attention
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import breakable_cuda_graph
out = {"active": is_active(), "bound": breakable_capture_var._capture_var is breakable_cuda_graph._current_capture_var}
routed = []
attention.bcg_attention = lambda *a, **kw: routed.append(a[4:])
q = torch.zeros(4, 8)
if hasattr(radix_attention, "breakable_unified_attention_with_output"):
    attend = lambda: radix_attention.breakable_unified_attention_with_output(q, q, q, q, True, 3)
    linear = radix_linear_attention.bcg_unified_linear_attention_with_output
else:  # 0.5.23: RadixAttention's eager method, as RadixAttention.forward calls it
    layer = radix_attention.RadixAttention(num_heads=2, head_dim=4, scaling=1.0, num_kv_heads=2, layer_id=3)
    attend = lambda: layer._eager_attention(q, q, q, q, True, None, None, None)
    linear = radix_linear_attention.RadixLinearAttention._eager_linear_attention
try:
    with _breakable_capture_flag(), live.bound(live.LiveBatch(4, 4, attention.ForwardPass(None, None, []))):
        attend()
        try:
            linear()
        except BcgCaptureError as e:
            out["refused"] = str(e)
except Exception as e:
    out["error"] = repr(e)
out["routed"] = routed
print("INSTALLED " + json.dumps(out))
"""


def _run_installed(**env):
    """``INSTALLED`` in a fresh interpreter that loads plugins as SGLang's schedulers do."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("BCG_")}
    full.update(env, PYTHONWARNINGS="ignore", PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", INSTALLED], env=full, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("INSTALLED ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("INSTALLED "):])


def test_an_enabled_scheduler_routes_radix_attention_and_refuses_the_rest():
    out = _run_installed(BCG_ENABLE="1")
    assert out["active"] and out["bound"], out
    assert out["routed"] == [[True, 3]]  # RadixAttention's unified op: bcg's break, through the hook
    linear = ("sglang.srt.layers.radix_linear_attention.RadixLinearAttention._eager_linear_attention" if EAGER_METHOD
              else "torch.ops.sglang.unified_linear_attention_with_output")
    assert f"graph break {linear}" in out.get("refused", ""), out


def test_a_scheduler_without_bcg_leaves_the_variable_unbound():
    out = _run_installed()
    assert out["active"] and not out["bound"], out
