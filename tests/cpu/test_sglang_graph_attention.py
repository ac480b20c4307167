"""Attention inside bcg's graph on SGLang (flashinfer's full prefill graph plan), on CPU against the
installed sglang: which runners it declines, the request slots, the padded view every replay plans
from, the capture batch, and what the runner gives back after a failed capture (its choice between
a graph plan, an eager plan and eager is in test_sglang_plugin.py, beside its other votes)."""

from __future__ import annotations

import inspect
import logging
import types

import pytest

pytest.importorskip("sglang")

pytestmark = pytest.mark.sglang

import sglang_fa3  # noqa: E402
import torch  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from bcg_plugin import BcgConfig  # noqa: E402
from bcg_plugin.adapters.sglang import graph_attention as ga  # noqa: E402
from bcg_plugin.adapters.sglang.doctor import attention_scope  # noqa: E402
from bcg_plugin.adapters.sglang.replay import BcgPrefillRunner  # noqa: E402


def flashinfer_backend(**attrs):
    """SGLang's real ``FlashInferAttnBackend`` class, its instance built without a GPU."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    backend = FlashInferAttnBackend.__new__(FlashInferAttnBackend)
    made = []
    backend.full_cg_prefill_wrappers = None
    backend.dispatch_reason = None
    backend.use_sliding_window_kv_pool = False
    backend.prefill_uses_dequant_workspace = False
    backend.skip_prefill = False
    backend.token_to_kv_pool = types.SimpleNamespace()

    def create(num_slots, max_num_tokens):
        made.append((num_slots, max_num_tokens))
        backend.full_cg_prefill_req_slots = num_slots
        return ["wrapper"]

    backend._create_full_cg_prefill_wrappers = create
    backend.made = made
    for name, value in attrs.items():
        setattr(backend, name, value)
    return backend


def model_runner(backend=None, *, pool_rows=256, context_len=4096, max_req=None, is_generation=True, counter=None):
    prefill = types.SimpleNamespace(full_prefill_max_req=max_req)
    return types.SimpleNamespace(
        attn_backend=backend if backend is not None else flashinfer_backend(),
        req_to_token_pool=types.SimpleNamespace(size=pool_rows),
        model_config=types.SimpleNamespace(context_len=context_len, is_generation=is_generation),
        server_args=types.SimpleNamespace(cuda_graph_config=types.SimpleNamespace(prefill=prefill)),
        token_to_kv_pool=types.SimpleNamespace(layer_transfer_counter=counter),
    )


# -- which runners keep attention inside ---------------------------------------------------------


def test_flashinfer_without_dp_or_a_second_wrapper_keeps_attention_inside():
    assert ga.decline_reason(model_runner(), dp_ranks=None) is None


def test_other_backends_are_declined_by_their_class():
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    triton = TritonAttnBackend.__new__(TritonAttnBackend)
    assert "TritonAttnBackend" in ga.decline_reason(model_runner(triton), None)

    class Subclass(type(flashinfer_backend())):  # e.g. a draft or multi-step variant planning otherwise
        pass

    assert "Subclass" in ga.decline_reason(model_runner(Subclass.__new__(Subclass)), None)


@pytest.mark.parametrize(("runner", "dp_ranks", "named"), [
    (lambda: model_runner(), 1, "DP attention"),
    (lambda: model_runner(flashinfer_backend(dispatch_reason="sliding_window")), None, "sliding-window or cross"),
    (lambda: model_runner(flashinfer_backend(use_sliding_window_kv_pool=True)), None, "sliding-window KV pool"),
    (lambda: model_runner(flashinfer_backend(prefill_uses_dequant_workspace=True)), None, "dequantizing"),
    (lambda: model_runner(flashinfer_backend(skip_prefill=True)), None, "without prefill wrappers"),
    (lambda: model_runner(is_generation=False), None, "embedding"),
    (lambda: model_runner(flashinfer_backend(enable_mis=True)), None, "multi-item scoring"),
    (lambda: model_runner(flashinfer_backend(enable_deterministic=True)), None, "deterministic inference"),
    (lambda: model_runner(flashinfer_backend(full_cg_prefill_wrappers=["theirs"])), None, "made by another runner"),
    (lambda: model_runner(flashinfer_backend(token_to_kv_pool=types.SimpleNamespace(requires_physical_write_loc=True))),
     None, "translates cache slots"),
])
def test_each_runner_that_plans_per_forward_is_declined_by_name(runner, dp_ranks, named):
    assert named in ga.decline_reason(runner(), dp_ranks)


def test_a_flashinfer_backend_without_sglangs_full_graph_plan_is_declined(monkeypatch):
    backend = flashinfer_backend()
    del backend._create_full_cg_prefill_wrappers
    monkeypatch.delattr(type(backend), "_create_full_cg_prefill_wrappers")  # as in a release without it
    assert "no full prefill graph plan" in ga.decline_reason(model_runner(backend), None)


# -- request slots ------------------------------------------------------------------------------


def test_request_slots_follow_sglangs_setting_else_its_rule_raised_to_the_minimum():
    assert ga.request_slots(model_runner(max_req=24), chunk=8192, top=1024) == 24
    assert ga.request_slots(model_runner(), chunk=1024, top=1024) == ga.MIN_REQUEST_SLOTS[ga.FLASHINFER] == 64
    assert ga.request_slots(model_runner(), chunk=65536, top=1024) == 128
    # no more requests than the top bucket's rows (flashinfer's workspace is sized for that at most)
    assert ga.request_slots(model_runner(), chunk=8192, top=32) == 32
    assert ga.request_slots(model_runner(pool_rows=10), chunk=8192, top=1024) == 10  # the pool's rows
    # the capture batch of the top bucket needs ceil(1024 / 16) requests of 16 tokens
    assert ga.request_slots(model_runner(pool_rows=10, context_len=16), chunk=8192, top=1024) == 64


def batch(seq_lens, prefix_lens):
    seq = torch.tensor(seq_lens)
    prefix = torch.tensor(prefix_lens)
    return types.SimpleNamespace(
        batch_size=len(seq_lens), seq_lens=seq, seq_lens_cpu=seq.clone(), extend_prefix_lens=prefix,
        extend_seq_lens=seq - prefix, req_pool_indices=torch.arange(3, 3 + len(seq_lens)), seq_lens_sum=int(seq.sum()),
        forward_mode=ForwardMode.EXTEND, extend_seq_lens_cpu=(seq - prefix).tolist(),
        extend_prefix_lens_cpu=prefix.tolist())


def test_the_padded_view_lands_the_requests_before_zero_length_ones_and_leaves_the_batch_alone():
    slots = ga.RequestSlots(4, "cpu")
    slots.padded_view(batch([9, 7, 5], [2, 0, 1]))
    fb = batch([12], [4])
    view = slots.padded_view(fb)
    assert view.batch_size == 4 and fb.batch_size == 1
    assert view.seq_lens.tolist() == [12, 0, 0, 0]  # nothing left of the earlier, larger batch
    assert view.seq_lens_cpu.tolist() == [12, 0, 0, 0] and view.seq_lens_cpu.device.type == "cpu"
    assert view.extend_prefix_lens.tolist() == [4, 0, 0, 0] and view.extend_seq_lens.tolist() == [8, 0, 0, 0]
    assert view.req_pool_indices.tolist() == [3, 0, 0, 0]
    assert view.seq_lens_sum == 12 and fb.seq_lens.tolist() == [12]
    # every replay lands in the same buffers (the plan copies from them; nothing is allocated per step)
    assert view.seq_lens is slots.buffers["seq_lens"]


def test_more_requests_than_slots_are_refused():
    with pytest.raises(ValueError, match="5 requests do not fit 4"):
        ga.RequestSlots(4, "cpu").padded_view(batch([1] * 5, [0] * 5))


# -- the choice, once per runner ----------------------------------------------------------------


def test_graph_keeps_attention_inside_every_bucket_auto_the_small_ones_and_break_none():
    buckets = [16, 512, 576, 1024, 2048, 8192]
    assert ga.GraphAttention(model_runner(), None, 8192, "cpu").choose(buckets, "graph") == buckets
    runner = model_runner()
    assert ga.AUTO_GRAPH_ATTENTION_TOKENS[ga.FLASHINFER] == 512
    assert ga.GraphAttention(runner, None, 8192, "cpu").choose(buckets, "auto") == [16, 512]
    assert runner.attn_backend.made == [(64, 512)]  # the wrappers sized for the largest bucket chosen
    runner = model_runner()
    assert ga.GraphAttention(runner, None, 8192, "cpu").choose(buckets, "break") is None
    assert ga.GraphAttention(runner, None, 8192, "cpu").choose([576, 1024], "auto") is None
    assert runner.attn_backend.made == []  # nothing allocated where no bucket keeps attention inside


def test_a_declined_runner_is_warned_about_only_where_graph_was_asked_for(caplog):
    with caplog.at_level(logging.INFO, logger="bcg_plugin.sglang"):
        assert ga.GraphAttention(model_runner(), 1, 8192, "cpu").choose([16], "auto") is None  # DP: declined
    assert [r.levelname for r in caplog.records] == ["INFO"] and "DP attention" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bcg_plugin.sglang"):
        assert ga.GraphAttention(model_runner(), 1, 8192, "cpu").choose([16], "graph") is None
        assert ga.GraphAttention(model_runner(), 1, 8192, "cpu").choose([16], "break") is None
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_the_wrappers_are_made_once_for_the_largest_graph_bucket_and_the_request_slots():
    runner = model_runner(max_req=8)
    graph = ga.GraphAttention(runner, None, 8192, "cpu")
    first = graph.choose([16, 512, 1024], "graph")
    again = graph.choose([16, 512, 1024], "graph")  # each capture of the ladder asks again
    assert first == again == [16, 512, 1024]
    assert runner.attn_backend.made == [(8, 1024)] and runner.attn_backend.full_cg_prefill_wrappers == ["wrapper"]
    assert graph.request_slots == 8


def test_release_gives_back_what_bcg_made_and_a_later_capture_makes_it_again():
    runner = model_runner(max_req=8)
    backend = runner.attn_backend
    backend.full_cg_prefill_workspace_buffer = "workspace"
    graph = ga.GraphAttention(runner, None, 8192, "cpu")
    graph.choose([16, 64], "graph")
    graph.release()
    assert backend.full_cg_prefill_wrappers is None and backend.full_cg_prefill_workspace_buffer is None
    assert graph.request_slots == 0 and not graph.fits(batch([1], [0]))
    assert graph.choose([16, 64], "graph") == [16, 64] and backend.made == [(8, 64), (8, 64)]


def test_a_declined_runner_says_why_in_a_warning(caplog):
    with caplog.at_level(logging.INFO, logger="bcg_plugin.sglang"):
        assert ga.GraphAttention(model_runner(), 1, 8192, "cpu").choose([16], "graph") is None
    assert [r.levelno for r in caplog.records if "DP attention" in r.getMessage()] == [logging.WARNING]


def test_a_replay_waits_for_the_hierarchical_cache_to_load_every_layer_first():
    waited, planned = [], []
    counter = types.SimpleNamespace(consumer_index=0, num_layers=28, wait_until=waited.append)
    runner = model_runner(counter=counter)
    runner.attn_backend.init_forward_metadata_out_graph = lambda fb, in_capture=False: planned.append((fb, in_capture))
    graph = ga.GraphAttention(runner, None, 8192, "cpu")
    graph.choose([16], "graph")
    graph.plan_replay(batch([5], [0]))
    assert waited == [27] and planned[0][0].batch_size == graph.request_slots and planned[0][1] is False
    counter.consumer_index = -1  # no load in flight
    graph.plan_replay(batch([5], [0]))
    assert waited == [27] and len(planned) == 2


@pytest.fixture(autouse=True)
def no_expert_parallelism(monkeypatch):
    """SGLang's question whether it masks padded MoE rows, answered as without expert parallelism
    (it reads the parallel state, which no engine set up here)."""
    import sglang.srt.model_executor.forward_batch_info as info

    monkeypatch.setattr(info, "enable_num_token_non_padded", lambda: False)


def _capture_host(runner):
    """An SglangHost over ``runner`` without a device."""
    from bcg_plugin.adapters.sglang.host import SglangHost

    host = SglangHost.__new__(SglangHost)
    host.model_runner, host.device, host._dp, host._dp_counts = runner, torch.device("cpu"), None, {}
    host.stored_in_graph, host._real_rows, host._shared_count = set(), None, set()
    host.graph = ga.GraphAttention(runner, None, 8192, host.device)
    return host


@pytest.mark.parametrize("masks", [False, True])
def test_the_capture_batch_carries_the_real_row_count_sglang_masks_padded_moe_rows_by(monkeypatch, masks):
    runner = model_runner(context_len=100, max_req=6)
    runner.attention_layers = []
    runner.attn_backend.init_forward_metadata = lambda fb: None
    import sglang.srt.model_executor.forward_batch_info as info

    monkeypatch.setattr(info, "enable_num_token_non_padded", lambda: masks)
    host = _capture_host(runner)
    first = host.bcg_dummy_batch(256, graph_attention=False, variant=None).payload.forward_batch
    second = host.bcg_dummy_batch(64, graph_attention=False, variant=None).payload.forward_batch
    if not masks:  # no expert parallelism: SGLang masks nothing, and neither does bcg
        assert first.num_token_non_padded is None and host.land_real_rows(10, 64) is None
        return
    # one device scalar every graph reads, as SGLang's own graphs keep one
    assert second.num_token_non_padded is first.num_token_non_padded and int(first.num_token_non_padded) == 64
    assert host.land_real_rows(10, 64) is first.num_token_non_padded and int(first.num_token_non_padded) == 10


@pytest.mark.parametrize("rank, expected", [(0, 32), (1, 8), (2, 0), (3, 0)])
def test_where_sglang_splits_a_steps_rows_over_attention_tp_the_real_row_count_is_this_ranks_share(
        monkeypatch, rank, expected):
    """SGLang (0.5.20 on) with a step's rows split between the attention-TP ranks (its sequence
    sharding): each rank holds bucket / attn_tp rows, and its own graphs count each rank's real
    ones. 40 real rows in a 128-row bucket over 4 ranks: 32, 8, 0, 0; with the MoE input scattered
    too, the whole count would leave the trailing ranks' padding unmasked. The capture batch says
    the rows are split, so where the MoE gathers them instead it reads no count, as in SGLang's graphs."""
    import sglang.srt.model_executor.forward_batch_info as info

    if not hasattr(info, "compute_local_num_token_non_padded_cpu") or "sharded" not in inspect.signature(
            info.compute_local_num_token_non_padded_cpu).parameters:
        pytest.skip("this SGLang does not say per forward whether a step's rows are split (0.5.20 on)")
    runner = model_runner(context_len=100, max_req=6)
    runner.attention_layers = []
    runner.attn_backend.init_forward_metadata = lambda fb: None
    runner.attn_tp_sequence_sharded = lambda num_tokens: num_tokens == 128  # SGLang asks per bucket
    monkeypatch.setattr(info, "enable_num_token_non_padded", lambda: True)
    monkeypatch.setattr(info, "get_parallel", lambda: types.SimpleNamespace(attn_tp_size=4, attn_tp_rank=rank))
    host = _capture_host(runner)
    fb = host.bcg_dummy_batch(128, graph_attention=False, variant=None).payload.forward_batch
    # as SGLang's own capture batch says it: its MoE takes the share only with a scattered MoE input,
    # and with one DP group's rows gathered no count at all (ForwardBatch.moe_num_token_non_padded)
    assert fb.attn_tp_sequence_sharded is True
    assert int(host.land_real_rows(40, 128)) == expected
    fb = host.bcg_dummy_batch(64, graph_attention=False, variant=None).payload.forward_batch
    assert fb.attn_tp_sequence_sharded is False
    assert int(host.land_real_rows(40, 64)) == 40  # replicated rows: the whole count


def test_the_capture_batch_of_a_graph_bucket_holds_every_request_slot():
    captured = []
    runner = model_runner(context_len=100, max_req=6)
    runner.attention_layers = []
    runner.attn_backend.init_forward_metadata_out_graph = lambda fb, in_capture=False: captured.append(in_capture)
    runner.attn_backend.init_forward_metadata = lambda fb: captured.append("eager")
    host = _capture_host(runner)
    assert host.bcg_graph_attention([256], "graph") == [256]
    fb = host.bcg_dummy_batch(256, graph_attention=True, variant=None).payload.forward_batch
    assert fb.batch_size == 6 and fb.seq_lens.tolist() == [100, 100, 56, 0, 0, 0]
    assert fb.extend_start_loc.tolist() == [0, 100, 200, 256, 256, 256]
    assert fb.seq_lens_cpu.tolist() == [100, 100, 56, 0, 0, 0] and fb.extend_seq_lens_cpu == [100, 100, 56, 0, 0, 0]
    assert fb.positions.shape == (256,) and fb.positions[200:].tolist() == list(range(56))
    assert captured == [True]
    fb = host.bcg_dummy_batch(256, graph_attention=False, variant=None).payload.forward_batch
    assert fb.batch_size == 3 and captured == [True, "eager"]


# -- the variant for steps without a cached prefix ---------------------------------------------


class _Ragged:
    """The ragged graph wrapper's plan, recorded."""

    def __init__(self):
        self.plans = []

    def begin_forward(self, qo_indptr, kv_indptr, *args, **kwargs):
        self.plans.append((qo_indptr.tolist(), kv_indptr.tolist(), args, kwargs))


def fresh_runner(monkeypatch, version="0.7.2", ragged_backend="auto", max_req=4):
    """A runner whose graph buckets get the fresh variant where ``version`` and the eager ragged
    wrapper's backend allow it; the graph wrapper itself is a recorder (flashinfer's needs a GPU)."""
    monkeypatch.setattr(ga.importlib.metadata, "version",
                        lambda name: version if name == "flashinfer-python" else "0")
    runner = model_runner(max_req=max_req)
    backend = runner.attn_backend
    backend.prefill_wrapper_ragged = types.SimpleNamespace(_requested_backend=ragged_backend)
    backend.indices_updater_prefill = types.SimpleNamespace(num_qo_heads=16, num_kv_heads=8, head_dim=128,
                                                           q_data_type=torch.bfloat16)
    monkeypatch.setattr(ga.GraphAttention, "_ragged_wrapper", lambda self, r: _Ragged())
    return runner


@pytest.mark.parametrize("version, ragged_backend, backend_attrs, why", [
    ("0.6.14", "auto", {}, "flashinfer 0.6.14 (its graph plans without split KV need 0.7.2"),
    ("0.7.2", "cutlass", {}, "runs 'cutlass', whose plan cannot be redone under a graph"),
    ("0.7.2", "auto", {"is_multimodal": True}, "a multimodal model"),  # SGLang plans its prefill paged
    ("0.7.2", "auto", {"use_paged": True}, "SGLANG_FLASHINFER_USE_PAGED"),
    ("0.7.2", "auto", {}, None),
    ("0.8.0", "fa2", {}, None),
])
def test_the_fresh_variant_needs_flashinfer_072_and_a_ragged_kernel_whose_plan_can_be_redone(
        monkeypatch, caplog, version, ragged_backend, backend_attrs, why):
    runner = fresh_runner(monkeypatch, version, ragged_backend)
    for name, value in backend_attrs.items():
        setattr(runner.attn_backend, name, value)
    reason = ga.fresh_decline_reason(runner.attn_backend)
    assert reason == why if why is None else why in reason
    graph = ga.GraphAttention(runner, None, 8192, "cpu")
    graph.choose([16, 64, 1024], "auto")
    assert graph.ragged is None  # nothing made unless the config asks for variants
    fresh = [] if why else [ga.FRESH]  # and the break variant of both buckets, above the 4 request slots
    with caplog.at_level(logging.INFO, logger="bcg_plugin.sglang"):
        assert graph.variants([16, 64]) == {16: [*fresh, ga.BREAKING], 64: [*fresh, ga.BREAKING]}
    assert (graph.ragged is None) == bool(why) and (why is None or why in caplog.text)


@pytest.mark.parametrize("mode, fits", [("EXTEND", True), ("MIXED", True), ("DLLM_EXTEND", False)])
def test_a_graph_bucket_serves_extend_and_mixed_steps_only(mode, fits):
    """SGLang's graph plan takes a diffusion model's steps as its decode runner's, whose metadata bcg
    never captured: such a step replays in a bucket that breaks, as its eager plan."""
    graph = ga.GraphAttention(model_runner(max_req=8), None, 8192, "cpu")
    graph.choose([16, 64], "graph")
    step = batch([9, 7], [0, 0])
    step.forward_mode = getattr(ForwardMode, mode)
    assert graph.fits(step) == fits
    assert not graph.fits(batch([1] * 9, [0] * 9))  # more requests than the slots


@pytest.mark.parametrize("kept", [{}, {64: (ga.BREAKING,)}])
def test_releasing_the_variants_no_bucket_kept_fresh_gives_back_the_ragged_wrapper_and_keeps_the_buckets_plan(
        monkeypatch, kept):
    runner = fresh_runner(monkeypatch)
    graph = ga.GraphAttention(runner, None, 8192, "cpu")
    graph.choose([16, 64], "graph")
    graph.variants([16, 64])
    wrappers = runner.attn_backend.full_cg_prefill_wrappers
    ragged = graph.ragged
    graph.release_variants({16: (ga.FRESH,), 64: (ga.FRESH, ga.BREAKING)})  # every variant kept
    assert graph.ragged is ragged is not None
    graph.release_variants(kept)
    assert graph.ragged is None
    assert runner.attn_backend.full_cg_prefill_wrappers is wrappers and graph.request_slots > 0
    assert graph.fits(batch([9, 7], [0, 0]))


def test_steps_without_a_cached_prefix_replay_in_the_fresh_variant_and_the_others_in_the_bucket(monkeypatch):
    runner = fresh_runner(monkeypatch)
    graph = ga.GraphAttention(runner, None, 8192, "cpu")
    graph.choose([16, 64], "graph")
    captured = tuple(graph.variants([16, 64])[16])
    assert graph.variant_for(batch([9, 7], [0, 0]), captured) == ga.FRESH
    assert graph.variant_for(batch([9, 7], [0, 3]), captured) is None  # a cached prefix: the paged plan, split KV
    assert graph.variant_for(batch([9, 8], [0, 7]), captured) is None  # a mixed step's decode has one too
    assert graph.variant_for(batch([9, 7], [0, 0]), ()) is None  # a bucket captured without the variant
    assert graph.variant_for(batch([2] * 5, [0] * 5), captured) == ga.BREAKING  # more requests than the 4 slots


def test_a_fresh_replay_plans_the_ragged_prefill_of_its_new_tokens_without_split_kv(monkeypatch):
    runner = fresh_runner(monkeypatch)
    paged = []
    runner.attn_backend.init_forward_metadata_out_graph = lambda fb, in_capture=False: paged.append(fb)
    graph = ga.GraphAttention(runner, None, 8192, "cpu")
    graph.choose([16, 64], "graph")
    graph.variants([16, 64])
    graph.plan_replay(batch([9, 7, 5], [0, 0, 0]), ga.FRESH)
    graph.plan_replay(batch([12], [0]), ga.FRESH)
    first, second = graph.ragged.plans
    assert first[0] == first[1] == [0, 9, 16, 21, 21]  # zero-length requests after the real ones
    assert second[0] == [0, 12, 12, 12, 12]  # nothing left of the earlier, larger batch
    assert first[2] == (16, 8, 128)
    assert first[3] == {"causal": True, "q_data_type": torch.bfloat16, "disable_split_kv": True}
    assert paged == []  # the paged wrappers keep the plan of the last step that read them
    graph.plan_replay(batch([9, 7], [0, 3]))
    assert len(paged) == 1 and len(graph.ragged.plans) == 2


def test_a_fresh_capture_plans_the_ragged_wrapper_and_runs_its_body_on_it(monkeypatch):
    from sglang.srt.layers.attention.flashinfer_backend import PrefillMetadata

    runner = fresh_runner(monkeypatch)
    backend = runner.attn_backend
    eager = backend.prefill_wrapper_ragged
    graph = ga.GraphAttention(runner, None, 8192, "cpu")
    graph.choose([16], "graph")
    graph.variants([16])
    graph.plan_capture(batch([16, 0, 0, 0], [0, 0, 0, 0]), ga.FRESH)
    assert graph.ragged.plans[0][0] == [0, 16, 16, 16, 16]
    meta = backend.forward_metadata
    # SGLang's forward_extend reads these at capture: the ragged prefill with no prefix to merge
    assert isinstance(meta, PrefillMetadata) and meta.use_ragged and meta.extend_no_prefix
    assert meta.prefill_wrappers == ["wrapper"]
    with graph.body_scope(ga.FRESH):
        assert backend.prefill_wrapper_ragged is graph.ragged
    assert backend.prefill_wrapper_ragged is eager
    with pytest.raises(RuntimeError), graph.body_scope(ga.FRESH):
        raise RuntimeError("a failed capture")
    assert backend.prefill_wrapper_ragged is eager
    with graph.body_scope(None):  # the bucket's own graph runs the paged plan
        assert backend.prefill_wrapper_ragged is eager


def test_the_capture_batch_of_a_variant_says_which_variant_it_was_planned_for(monkeypatch):
    runner = fresh_runner(monkeypatch)
    runner.attention_layers = []
    runner.attn_backend.init_forward_metadata_out_graph = lambda fb, in_capture=False: None
    host = _capture_host(runner)
    assert host.bcg_graph_attention([16, 64], "graph") == [16, 64]
    assert host.bcg_graph_variants([16, 64]) == {16: [ga.FRESH, ga.BREAKING], 64: [ga.FRESH, ga.BREAKING]}
    # through pluggy, as the core asks: an implementation gets only the arguments it takes without a default
    from bcg_plugin import plugin_manager

    hook = plugin_manager(host).hook
    assert hook.bcg_dummy_batch(num_tokens=64, graph_attention=True, variant=ga.FRESH).payload.graph_variant == ga.FRESH
    assert host.graph.ragged.plans[-1][0] == [0, 64, 64, 64, 64]
    assert hook.bcg_dummy_batch(num_tokens=64, graph_attention=True, variant=None).payload.graph_variant is None


# -- what bcg doctor says --------------------------------------------------------------------


def test_doctor_names_where_attention_runs_for_each_choice():
    assert attention_scope(BcgConfig(attention="break")) == "an eager break in every bucket"
    assert "'fresh' variant" in attention_scope(BcgConfig())
    assert "'fresh' variant" not in attention_scope(BcgConfig(graph_variants=False))
    assert "replaying in the 'break' variant (attention breaking) of its bucket" in attention_scope(BcgConfig())
    assert "'break' variant" not in attention_scope(BcgConfig(graph_variants=False))
    assert attention_scope(BcgConfig(attention="auto")).startswith(
        "inside the graph in buckets up to 512 tokens on SGLang's flashinfer attention backend and up to 1024 on fa3")
    assert attention_scope(BcgConfig(attention="graph")).startswith("inside the graph in every bucket")


# -- parity with SGLang's own full prefill graphs ------------------------------------------------


def sglangs_full_replay(fb, backend, r):
    """SGLang's own replay of ``fb`` (``PrefillCudaGraphRunner._prepare_forward_metadata_for_replay``
    under its full backend, its request buffers filled as its ``load_batch`` fills them) with
    ``r`` request slots, planned by ``backend``."""
    import inspect

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    fb.req_pool_indices_cpu = fb.req_pool_indices.clone()
    fb._pad_tensor_to_size = types.MethodType(ForwardBatch._pad_tensor_to_size, fb)
    fb.max_seq_len_override, fb.input_ids = None, torch.zeros(int(fb.extend_seq_lens.sum()), dtype=torch.int64)
    bs = fb.batch_size
    static = {name: torch.zeros(16, dtype=torch.int64) for name in
              ("seq_lens", "extend_seq_lens", "extend_prefix_lens", "extend_start_loc", "req_pool_indices",
               "orig_seq_lens")}
    for name in ("seq_lens", "extend_seq_lens", "extend_prefix_lens", "req_pool_indices"):
        static[name][:bs] = getattr(fb, name)  # load_batch: the live values, then zero-length sentinels
    theirs = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(attn_backend=backend), _is_full_backend=True, _capture_req_slots=r,
        _prefill_static_buffers=static, _full_cg_seq_lens_cpu=torch.zeros(r, dtype=torch.int64),
        use_captured_attn_metadata=False)
    static_fb = types.SimpleNamespace(max_seq_len_override=None, input_ids=fb.input_ids)
    params = list(inspect.signature(PrefillCudaGraphRunner._prepare_forward_metadata_for_replay).parameters)
    shape = types.SimpleNamespace(size=16)  # 0.5.23 passes a shape key, earlier releases the token count
    PrefillCudaGraphRunner._prepare_forward_metadata_for_replay(theirs, fb, static_fb, *[shape] * (len(params) - 3))


def test_the_padded_view_is_the_one_sglangs_full_graphs_plan_from():
    """SGLang's own full-graph replay (:func:`sglangs_full_replay`) and bcg's
    :meth:`RequestSlots.padded_view` hand the plan the same batch, field by field."""
    r, fb = 8, batch([9, 7, 5], [2, 0, 1])
    planned = []
    backend = types.SimpleNamespace(init_forward_metadata_out_graph=planned.append,
                                    resolve_prefill_shared_read_ends=lambda *a, **k: None)
    sglangs_full_replay(fb, backend, r)
    [sglang_view] = planned
    ours = ga.RequestSlots(r, "cpu").padded_view(fb)
    assert ours.batch_size == sglang_view.batch_size == r
    compared = ["seq_lens", "seq_lens_cpu", "req_pool_indices", "extend_seq_lens", "extend_prefix_lens"]
    if sglang_view.req_pool_indices_cpu is not fb.req_pool_indices_cpu:  # padded too from SGLang 0.5.23
        compared.append("req_pool_indices_cpu")
    for name in compared:
        assert getattr(ours, name).tolist() == getattr(sglang_view, name).tolist(), name
    assert ours.seq_lens_sum == sglang_view.seq_lens_sum and ours.forward_mode is sglang_view.forward_mode


def _capture_runner(monkeypatch, *, captured=True, first_rank=False, stored=(), graph=(), layers=28, variants=None):
    """bcg's SGLang runner around a core whose capture succeeds or not, stores the KV cache of
    ``stored`` layers in the segment and keeps ``variants``; returns the host, its ``released`` list
    naming the releases of graph attention (``"all"``) and of its variants (``"variants"``)."""
    import contextlib

    import sglang.srt.distributed.parallel_state as parallel_state

    from bcg_plugin.adapters.sglang import replay

    host = types.SimpleNamespace(stored_in_graph={99}, released=[])  # a layer left from an earlier capture
    host.graph = types.SimpleNamespace(release=lambda: host.released.append("all"),
                                       release_variants=lambda kept: host.released.append(("variants", kept)))

    class Core:
        def __init__(self, *args, **kwargs):
            self.captured, self.buckets, self.stats, self.graph_attention = False, [16, 32], None, frozenset(graph)
            self.graph_variants = dict(variants or {})

        def capture(self, progress):
            host.stored_in_graph.update(stored)
            self.captured = captured

    monkeypatch.setattr(replay, "PrefillGraphRunner", Core)
    monkeypatch.setattr(replay, "plugin_manager", lambda host: None)
    monkeypatch.setattr(replay, "step_token_limit", lambda runner, log=False: 16)
    monkeypatch.setattr(replay, "prefill_graph_config", lambda runner: types.SimpleNamespace(bs=[16]))
    monkeypatch.setattr(replay, "stats_reporter", lambda stats, server_args: None)
    monkeypatch.setattr(replay, "tp_group", lambda runner: types.SimpleNamespace(barrier=lambda: None))
    monkeypatch.setattr(replay, "_first_tp_rank", lambda runner: first_rank)
    monkeypatch.setattr(replay, "_breakable_capture_flag", contextlib.nullcontext)
    monkeypatch.setattr(parallel_state, "graph_capture", lambda: contextlib.nullcontext(types.SimpleNamespace(stream=None)))
    BcgPrefillRunner(types.SimpleNamespace(server_args=None, attention_layers=[None] * layers),
                     BcgConfig(enable=True), host)
    return host


@pytest.mark.parametrize("captured", [False, True])
def test_the_runner_gives_the_graph_buckets_memory_back_when_its_capture_failed(monkeypatch, captured):
    released = _capture_runner(monkeypatch, captured=captured, variants={16: ("fresh",)}).released
    assert released == ([("variants", {16: ("fresh",)})] if captured else ["all"])


@pytest.mark.parametrize("kept", [{}, {16: (ga.BREAKING,)}, {16: ("fresh", ga.BREAKING)}])
def test_after_its_capture_the_runner_hands_graph_attention_the_variants_the_core_kept(monkeypatch, kept):
    assert _capture_runner(monkeypatch, graph=[16], variants=kept).released == [("variants", kept)]


@pytest.mark.parametrize("stored, graph, says", [
    (range(28), (), "captured in the segment before each layer's break"),
    ((), (), "in each layer's eager break"),
    (range(4), (), "in 4 of 28 layers, in the break in the others"),
    ((), (16, 32), "inside the graph with attention, in every bucket"),
    ((), (16,), "in each layer's eager break, as SGLang stores it (captured in the segment only on the triton, "
                "flashinfer and fa3 backends with SGLang's plain MHA pool); inside the graph with attention in the 1 of 2 buckets"),
])
def test_after_its_capture_the_runner_says_where_the_kv_cache_store_runs(monkeypatch, caplog, stored, graph, says):
    with caplog.at_level(logging.INFO, logger="bcg_plugin.sglang"):
        host = _capture_runner(monkeypatch, first_rank=True, stored=stored, graph=graph)
    assert host.stored_in_graph == set(stored)  # this capture's layers only
    [line] = [r.getMessage() for r in caplog.records if "KV-cache store" in r.getMessage()]
    assert says in line


def test_only_the_first_tp_rank_says_it_and_a_failed_capture_says_nothing(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="bcg_plugin.sglang"):
        _capture_runner(monkeypatch, first_rank=False, stored=range(28))
        _capture_runner(monkeypatch, first_rank=True, captured=False, stored=range(28))
    assert "KV-cache store" not in caplog.text


# -- fa3: SGLang's full prefill metadata, planned on CPU by SGLang's own code ---------------------


def fa3_backend(pool_rows=8, context_len=64, **attrs):
    """SGLang's real ``FlashAttentionBackend`` class, its instance built without a GPU: what its full
    prefill plan (``_init_full_cg_prefill_metadata``) reads, with a request pool whose row ``i``
    holds cache slots ``1000 * i + position``."""
    cls = sglang_fa3.backend_class()
    backend = cls.__new__(cls)
    state = dict(fa_impl_ver=3, use_mla=False, skip_prefill=False, use_sliding_window_kv_pool=False, has_swa=False,
                 local_attn_builder=None, is_encoder_decoder=False, attn_cp_size=1, kv_cache_dtype_str="auto",
                 full_cg_prefill_metadata=None, forward_metadata=None, page_size=1, max_context_len=context_len,
                 max_num_pages=context_len, kv_index_translator=types.SimpleNamespace(is_translating=False),
                 token_to_kv_pool=types.SimpleNamespace(),
                 req_to_token=(1000 * torch.arange(pool_rows)[:, None] + torch.arange(context_len)).to(torch.int32))
    state.update(attrs)
    for name, value in state.items():
        setattr(backend, name, value)
    return backend


def fa3_runner(**attrs):
    backend = fa3_backend(**attrs)
    runner = model_runner(backend, pool_rows=backend.req_to_token.shape[0], context_len=backend.max_context_len,
                          max_req=4)
    runner.attention_layers = []
    return runner


def extend(seq_lens, prefix_lens, rows):
    """A live extend batch as SGLang's scheduler hands it to the runner, on CPU."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    fb = batch(seq_lens, prefix_lens)
    fb.forward_mode = ForwardMode.EXTEND
    fb.req_pool_indices = torch.tensor(rows)
    return fb


def test_fa3_keeps_attention_inside_where_its_own_full_graphs_do():
    assert ga.decline_reason(fa3_runner(), dp_ranks=None) is None
    assert ga.backend_kind(fa3_backend()) == ga.FA3 and ga.backend_kind(flashinfer_backend()) == ga.FLASHINFER


@pytest.mark.parametrize(("attrs", "named"), [
    ({"fa_impl_ver": 4}, "FlashAttention 4"),
    ({"use_mla": True}, "MLA"),
    ({"skip_prefill": True}, "without prefill"),
    ({"has_swa": True}, "sliding-window"),
    ({"use_sliding_window_kv_pool": True}, "sliding-window"),
    ({"local_attn_builder": object()}, "chunked local attention"),  # SGLang 0.5.23's name
    ({"has_local_attention": True}, "chunked local attention"),  # 0.5.17's
    ({"kv_cache_dtype_str": "fp8_e5m2"}, "fp8_e5m2 KV cache"),
    ({"is_encoder_decoder": True}, "cross attention"),
    ({"attn_cp_size": 2}, "context-parallel"),
    ({"_kv_shard_pool": object()}, "sharded"),
    ({"kv_cache_dtype_str": "fp8_e4m3"}, "fp8_e4m3 KV cache"),
    ({"full_cg_prefill_metadata": object()}, "made by another runner"),
    ({"kv_index_translator": types.SimpleNamespace(is_translating=True)}, "translates cache slots"),
])
def test_each_fa3_runner_that_plans_per_forward_is_declined_by_name(attrs, named):
    assert named in ga.decline_reason(fa3_runner(**attrs), None)


@pytest.mark.parametrize("dtype", ["bf16", "bfloat16", "auto"])
def test_fa3_keeps_attention_inside_with_an_unquantized_kv_cache_named_explicitly(dtype):
    assert ga.decline_reason(fa3_runner(kv_cache_dtype_str=dtype), None) is None


def fa3_slots(chunk, top=1024, **runner):
    return ga.request_slots(model_runner(fa3_backend(context_len=16384), pool_rows=256, context_len=16384,
                                         **runner), chunk=chunk, top=top)


def test_fa3_request_slots_follow_sglangs_rule_as_its_full_graphs_do():
    """fa3's split-KV combine runs over every request slot of a bucket where it splits, so fa3 plans
    for the slots SGLang's own full graphs have (chunk / 512, at least 1), not flashinfer's 64."""
    assert fa3_slots(8192) == 16
    assert fa3_slots(2048) == 4
    assert fa3_slots(256, top=256) == 1
    assert fa3_slots(8192, max_req=48) == 48  # the operator's setting, as on flashinfer
    assert fa3_slots(65536) == 128


def test_request_slots_keep_the_graph_plans_kv_index_within_its_budget():
    """SGLang allocates the index after it sized the KV cache: at a 1M-token context, 64 slots would
    take 256 MiB, fa3's block table and flashinfer's KV indices alike."""
    assert fa3_slots(32768, top=8192) == 64
    huge = model_runner(fa3_backend(pool_rows=2, context_len=1), pool_rows=256, context_len=1 << 20)
    huge.attn_backend.max_num_pages = 1 << 20
    assert ga.request_slots(huge, chunk=65536, top=8192) == ga.GRAPH_KV_INDEX_BYTES // (4 << 20) == 16
    assert ga.request_slots(model_runner(pool_rows=256, context_len=16384), chunk=8192, top=8192) == 64
    assert ga.request_slots(model_runner(pool_rows=256, context_len=1 << 20), chunk=8192, top=8192) == 16


def test_fa3_is_declined_under_dp_attention_and_for_embedding_models():
    assert "DP attention" in ga.decline_reason(fa3_runner(), 2)
    runner = fa3_runner()
    runner.model_config.is_generation = False
    assert "embedding" in ga.decline_reason(runner, None)


def test_on_fa3_graph_keeps_attention_inside_every_bucket_and_auto_in_the_small_ones(caplog):
    """fa3's limit is its own: up to 1024 tokens a forward that breaks is host-bound there."""
    buckets = [16, 512, 576, 1024, 1152, 2048]
    assert ga.AUTO_GRAPH_ATTENTION_TOKENS[ga.FA3] == 1024
    assert ga.GraphAttention(fa3_runner(), None, 8192, "cpu").choose(buckets, "auto") == [16, 512, 576, 1024]
    assert ga.GraphAttention(fa3_runner(), None, 8192, "cpu").choose(buckets, "break") is None
    runner = fa3_runner()
    graph = ga.GraphAttention(runner, None, 8192, "cpu")
    assert graph.choose([16, 32, 64], "graph") == [16, 32, 64] and graph.request_slots == 4
    assert not hasattr(runner.attn_backend, "full_cg_prefill_wrappers")  # fa3's plan makes its own buffers


def test_some_graph_buckets_are_captured_breaking_too_each_step_of_more_requests_than_slots_in_reach():
    """A bucket of more tokens than request slots may get a step of more requests (fa3 plans SGLang's
    few slots, flashinfer at least 64), which a bucket at most twice its size also captured breaking
    serves; a bucket of no more tokens than slots never does, and the largest graph bucket always has
    the variant."""
    from bcg_plugin.ladder import reference_ladder

    ladder = [b for b in reference_ladder(8192) if b <= 1024]
    assert ga.breaking_buckets(ladder, 16) == [64, 160, 352, 768, 1024]
    assert ga.breaking_buckets(ladder, 4) == [32, 96, 224, 480, 1024]
    for slots in (1, 4, 16, 64, 512):
        chosen = ga.breaking_buckets(ladder, slots)
        assert all(any(b <= c <= ga.BREAKING_SPAN * b for c in chosen) for b in ladder if b > slots)
        assert chosen[-1] == ladder[-1] and min(chosen) > slots
    assert ga.breaking_buckets(ladder, 1024) == []
    graph = ga.GraphAttention(fa3_runner(), None, 8192, "cpu")
    graph.choose([16, 32, 64, 1152], "auto")
    graph.slots.r = 16
    assert graph.variants([16, 32, 64]) == {64: [ga.BREAKING]}  # 32 is within reach of 64
    graph.slots.r = 64
    assert graph.variants([16, 32, 64]) is None
    flashinfer = ga.GraphAttention(model_runner(max_req=4), None, 8192, "cpu")
    flashinfer.choose([16, 32, 64], "graph")
    with pytest.MonkeyPatch.context() as patch:  # flashinfer too old for its fresh variant: the break one only
        patch.setattr(ga.importlib.metadata, "version", lambda name: "0.6.14")
        assert flashinfer.variants([16, 32, 64]) == {32: [ga.BREAKING], 64: [ga.BREAKING]}
    flashinfer.slots.r = 64  # flashinfer's own floor: no graph bucket holds more requests
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ga.importlib.metadata, "version", lambda name: "0.6.14")
        assert flashinfer.variants([16, 32, 64]) is None


def test_on_fa3_a_step_of_more_requests_than_the_slots_replays_in_its_buckets_breaking_variant():
    graph = ga.GraphAttention(fa3_runner(), None, 8192, "cpu")
    graph.choose([16, 64], "graph")
    captured = tuple(graph.variants([16, 64])[64])
    assert graph.variant_for(extend([5] * 4, [0] * 4, rows=[1, 2, 3, 4]), captured) is None  # fits the 4 slots
    assert graph.variant_for(extend([5] * 5, [0] * 5, rows=[1, 2, 3, 4, 5]), captured) == ga.BREAKING
    assert graph.variant_for(extend([5] * 5, [0] * 5, rows=[1, 2, 3, 4, 5]), ()) is None  # captured without it


def test_fa3_capture_makes_sglangs_metadata_for_the_request_slots_and_replays_refill_it_in_place():
    runner = fa3_runner()
    backend = runner.attn_backend
    host = _capture_host(runner)
    assert host.bcg_graph_attention([16, 32], "graph") == [16, 32]
    for bucket in (32, 16):
        host.bcg_dummy_batch(bucket, graph_attention=True, variant=None)
        # the query bound each bucket's kernels are captured with: its own token count
        assert backend.full_cg_prefill_metadata.max_seq_len_q == bucket
    meta = backend.full_cg_prefill_metadata
    assert meta is not None and meta.cache_seqlens_int32.shape == (4,) and meta.page_table.shape == (4, 64)
    addresses = [t.data_ptr() for t in (meta.cache_seqlens_int32, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.page_table)]

    host.graph.plan_replay(extend([9, 7], [2, 0], rows=[3, 5]))
    assert backend.forward_metadata is meta  # the tensors the captured kernels read, refilled in place
    assert [t.data_ptr() for t in (meta.cache_seqlens_int32, meta.cu_seqlens_q, meta.cu_seqlens_k,
                                   meta.page_table)] == addresses
    assert meta.cache_seqlens_int32.tolist() == [9, 7, 0, 0]
    assert meta.cu_seqlens_q.tolist() == [0, 7, 14, 14, 14]  # the new tokens; zero-length requests after
    assert meta.cu_seqlens_k.tolist() == [0, 9, 16, 16, 16]
    assert meta.page_table[0, :9].tolist() == list(range(3000, 3009))
    assert meta.page_table[1, :7].tolist() == list(range(5000, 5007))

    host.graph.plan_replay(extend([12], [4], rows=[2]))  # fewer requests: nothing left of the earlier step
    assert meta.cache_seqlens_int32.tolist() == [12, 0, 0, 0] and meta.cu_seqlens_q.tolist() == [0, 8, 8, 8, 8]
    assert meta.page_table[0, :12].tolist() == list(range(2000, 2012))


def test_fa3_auto_plans_its_graph_buckets_apart_from_the_breaking_ones_it_captures_first(monkeypatch):
    """Under ``auto`` the breaking buckets above the limit are captured first (largest first), each
    staged with SGLang's eager plan; fa3's graph metadata is made by the largest graph bucket and
    read by the smaller ones, and replays that alternate with eager steps refill it in place."""
    import sglang.srt.model_executor.forward_batch_info as info

    monkeypatch.setattr(info, "enable_num_token_non_padded", lambda: False)
    runner = fa3_runner(context_len=2048)  # room for the 1024-token graph bucket's capture batch
    backend = runner.attn_backend
    eager_plans = []

    def eager_plan(fb):
        eager_plans.append(fb.batch_size)
        backend.forward_metadata = types.SimpleNamespace(eager=fb.batch_size)

    backend.init_forward_metadata = eager_plan
    host = _capture_host(runner)
    buckets = [16, 64, 1024, 1152, 2048]
    assert host.bcg_graph_attention(buckets, "auto") == [16, 64, 1024]
    made = []
    for bucket in sorted(buckets, reverse=True):
        host.bcg_dummy_batch(bucket, graph_attention=bucket <= 1024, variant=None)
        meta = backend.full_cg_prefill_metadata
        if bucket > 1024:
            assert meta is None  # a breaking bucket's staging plans eagerly, making no graph buffers
            continue
        assert meta.max_seq_len_q == bucket and meta.cache_seqlens_int32.shape == (host.graph.request_slots,)
        made.append(meta)
    assert len(eager_plans) == 2 and all(m is made[0] for m in made)

    meta = made[0]
    buffers = [t.data_ptr() for t in (meta.cache_seqlens_int32, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.page_table)]
    host.graph.plan_replay(extend([9, 7], [2, 0], rows=[3, 5]))
    assert backend.forward_metadata is meta
    eager_plan(extend([60] * 9, [0] * 9, rows=list(range(9))))  # a step in a breaking bucket
    assert backend.forward_metadata is not meta
    host.graph.plan_replay(extend([12], [4], rows=[2]))
    slots = host.graph.request_slots
    assert backend.forward_metadata is meta and meta.cache_seqlens_int32.tolist() == [12] + [0] * (slots - 1)
    assert buffers == [t.data_ptr() for t in (meta.cache_seqlens_int32, meta.cu_seqlens_q, meta.cu_seqlens_k,
                                                meta.page_table)]
    # more requests than the slots: not a graph bucket's step (the replay takes a breaking one)
    assert host.graph.fits(extend([5] * slots, [0] * slots, rows=list(range(slots))))
    assert not host.graph.fits(extend([5] * (slots + 1), [0] * (slots + 1), rows=list(range(slots + 1))))


def test_fa3_plan_refuses_a_live_batch_not_padded_to_the_request_slots():
    """Control: SGLang's plan checks the request count it was captured for, so planning the live
    batch as it comes (not :meth:`RequestSlots.padded_view`) fails instead of misreading rows."""
    runner = fa3_runner()
    host = _capture_host(runner)
    host.bcg_graph_attention([16], "graph")
    host.bcg_dummy_batch(16, graph_attention=True, variant=None)
    with pytest.raises(AssertionError, match="fixed request-slot count"):
        runner.attn_backend.init_forward_metadata_out_graph(extend([9, 7], [2, 0], rows=[3, 5]))


def test_fa3_release_drops_the_metadata_so_a_later_capture_makes_it_again():
    runner = fa3_runner()
    backend = runner.attn_backend
    host = _capture_host(runner)
    host.bcg_graph_attention([16], "graph")
    host.bcg_dummy_batch(16, graph_attention=True, variant=None)
    first = backend.full_cg_prefill_metadata
    host.graph.release()
    assert backend.full_cg_prefill_metadata is None and backend.full_cg_prefill_strided_indices is None
    assert ga.decline_reason(runner, None) is None  # no longer "made by another runner"
    host.graph.choose([16], "graph")
    host.bcg_dummy_batch(16, graph_attention=True, variant=None)
    assert backend.full_cg_prefill_metadata is not None and backend.full_cg_prefill_metadata is not first


def test_fa3_replays_plan_what_sglangs_own_full_graphs_plan():
    """SGLang's own full-graph replay (:func:`sglangs_full_replay`) and bcg's, each on a real fa3
    backend captured with the same batch, leave the same metadata for the kernels to read."""
    runner = fa3_runner()
    host = _capture_host(runner)
    host.bcg_graph_attention([16], "graph")
    r = host.graph.request_slots
    capture = host.bcg_dummy_batch(16, graph_attention=True, variant=None).payload.forward_batch
    sglangs = fa3_backend()
    sglangs.init_forward_metadata_out_graph(capture, in_capture=True)
    sglangs.resolve_prefill_shared_read_ends = lambda *args, **kwargs: None

    for seq_lens, prefix_lens, rows in (([9, 7, 5], [2, 0, 1], [3, 5, 6]), ([12], [4], [2])):
        fb = extend(seq_lens, prefix_lens, rows)
        host.graph.plan_replay(fb)
        sglangs_full_replay(fb, sglangs, r)
        ours, expected = runner.attn_backend.full_cg_prefill_metadata, sglangs.full_cg_prefill_metadata
        for name in ("cache_seqlens_int32", "cu_seqlens_q", "cu_seqlens_k", "page_table", "max_seq_len_q",
                     "max_seq_len_k"):
            mine, sglang_value = getattr(ours, name), getattr(expected, name)
            assert (torch.equal(mine, sglang_value) if isinstance(mine, torch.Tensor) else mine == sglang_value), name
        assert ours.cache_seqlens_int32[:len(seq_lens)].tolist() == seq_lens  # not two plans that both did nothing
