"""The core runtime on a real GPU, against the reference decoder run eagerly.

Run on a CUDA machine: ``python -m pytest tests/gpu -m gpu -s``. Same-shape replays must be
bitwise equal to eager; padded replays within ``PADDED_REL_TOL`` (bf16: 8 mantissa bits, 28
layers, GEMMs of a different row count may pick other kernels and reduction orders).
"""

from __future__ import annotations

import dataclasses
import gc
import random

import pytest
import torch

import bcg_plugin.runner as runner_module
from bcg_plugin import BcgCaptureError, BcgCaptureOOM, BcgConfig, Fallback, PrefillGraphRunner, live, plugin_manager
from bcg_plugin import capture as capture_module
from bcg_plugin.breaks import BreakArgumentHolds, _capture_holds, eager_break
from bcg_plugin.capture import capture_segments, default_capture_stream
from bcg_plugin.hookspecs import BREAKING, HostBatch, hookimpl
from bcg_plugin.padding import BREAKS_ZERO_FROM_TOKENS
from bcg_plugin.pool import GraphPool, free_device_bytes
from bcg_plugin.testing import QWEN3_0_6B, GraphToyAdapter, ToyAdapter, ToyDecoder

pytestmark = pytest.mark.gpu

PADDED_REL_TOL = 2e-2  # relative Frobenius error of final hidden states, bf16, padded replay vs eager
# The same with attention inside the graph: its softmax also reduces over the bucket's fixed key
# columns, masked, which reorders every layer's sums; in bf16 that alone moves the reference
# decoder's final states by up to about 2e-2, and metadata not landed by about 1 (the test prints both).
GRAPH_REL_TOL = 5e-2
TOP = 2048
FIRST_REAL_SLOT = TOP  # slots [0, TOP) are the capture batches' dummy region
ESTIMATE_REL_TOL = 0.25  # graph-memory estimate from sampled buckets vs the whole ladder's capture
GRAPH_SIZES = (16, 32, 64, 128, 256, 512)  # attention inside the graph up to 256 tokens, breaking at 512
GRAPH_BREAKING = (64, 256)  # graph buckets also captured as the BREAKING variant
GRAPH_CONTEXT = 1024  # key columns a graph bucket's fixed metadata holds beyond its own rows
SHORT_CONTEXTS = (40, 60)  # random_mix's longest decode and prefix context: 16 + 4 of them fit GRAPH_CONTEXT


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def matches_eager(out: torch.Tensor, ref: torch.Tensor, same_shape: bool, tol: float = PADDED_REL_TOL) -> bool:
    """The correctness check every test uses (and the negative controls show can fail)."""
    if same_shape:
        return torch.equal(out, ref)
    return bool(torch.isfinite(out).all()) and rel_err(out, ref) <= tol


@pytest.fixture(scope="module")
def model():
    m = ToyDecoder(QWEN3_0_6B, kv_slots=FIRST_REAL_SLOT + 24_000, device="cuda")
    yield m
    del m
    torch.cuda.empty_cache()


@pytest.fixture(scope="module", params=["every_bucket", "first_bucket"])
def ladder_runner(model, request):
    config = BcgConfig(enable=True, warmup=request.param)
    runner = PrefillGraphRunner(plugin_manager(ToyAdapter(model)), config, chunk_size=TOP)
    runner.capture(progress=False)
    assert runner.captured and len(runner.buckets) == 40
    yield runner
    runner.close()


def random_mix(rng: random.Random, n: int, first_slot: int,
               contexts: tuple[int, int] = (300, 500)) -> list[tuple[int, int, int]]:
    """Split ``n`` new tokens into decodes (cached context, one new token) and prefills, some of
    them with cached context (prefix-cache hits, later chunks); ``contexts``: the longest context
    of a decode and of a prefill."""
    decodes = rng.randint(0, min(16, n - 1)) if n > 1 else 0
    left = n - decodes
    cuts = sorted(rng.sample(range(1, left), min(rng.randint(0, 3), left - 1))) if left > 1 else []
    prefills = [b - a for a, b in zip([0, *cuts], [*cuts, left])]
    seqs, slot = [], first_slot
    longest_decode, longest_prefix = contexts
    for new, ctx in ([(1, rng.randint(1, longest_decode)) for _ in range(decodes)]
                     + [(p, rng.choice([0, 0, rng.randint(1, longest_prefix)])) for p in prefills]):
        seqs.append((slot, ctx, new))
        slot += ctx + new
    rng.shuffle(seqs)
    return seqs


def make_case(model, adapter, rng, n):
    seqs = random_mix(rng, n, FIRST_REAL_SLOT)
    ids = torch.randint(0, model.shape.vocab, (n,), device="cuda")
    return seqs, ids, adapter.batch(ids, seqs)


def test_replay_matches_eager_for_random_token_counts_and_mixes(model, ladder_runner):
    adapter = ToyAdapter(model)
    rng = random.Random(1234)
    torch.manual_seed(1234)
    counts = [rng.choice(ladder_runner.buckets) for _ in range(12)] + [rng.randint(1, TOP) for _ in range(38)]
    worst, stale_errs, stale_caught = 0.0, [], 0
    for n in counts:
        seqs, ids, batch = make_case(model, adapter, rng, n)
        ref = model.forward_eager(ids, model.positions(seqs), batch.payload)
        bucket = ladder_runner.bucket_for(n)
        assert bucket is not None and bucket >= n
        out = ladder_runner.replay(bucket, batch).clone()
        same = bucket == n
        assert matches_eager(out, ref, same), (n, bucket, seqs, rel_err(out, ref))
        if not same:
            worst = max(worst, rel_err(out, ref))
        # Negative control: the same inputs replayed with another batch's metadata (what a break
        # reading state frozen at capture would see) must fail the same check.
        other = adapter.batch(ids, random_mix(rng, n, FIRST_REAL_SLOT + 12_000))
        stale = adapter.batch(ids, seqs)
        stale.payload = other.payload
        stale_out = ladder_runner.replay(bucket, stale).clone()
        stale_errs.append(rel_err(stale_out, ref))
        stale_caught += not matches_eager(stale_out, ref, same)
    print(f"\nworst padded rel err {worst:.2e} (tol {PADDED_REL_TOL}); stale-context rel err min {min(stale_errs):.2e}")
    assert stale_caught == len(counts), f"stale replays passed the check: {len(counts) - stale_caught}"
    assert sum(ladder_runner.stats.replays_by_bucket.values()) >= 2 * len(counts)


def test_same_shape_replay_is_bitwise_and_check_catches_one_flipped_value(model, ladder_runner):
    adapter = ToyAdapter(model)
    seqs = [(FIRST_REAL_SLOT, 0, 256)]
    ids = torch.arange(256, device="cuda")
    batch = adapter.batch(ids, seqs)
    ref = model.forward_eager(ids, model.positions(seqs), batch.payload)
    out = ladder_runner.replay(256, batch).clone()
    assert matches_eager(out, ref, True)
    out[7, 3] += 1
    assert not matches_eager(out, ref, True)
    # An idle data-parallel rank's padded forward: every row landed, none counted as requested.
    real, padded = ladder_runner.stats.real_tokens, ladder_runner.stats.padded_tokens
    ladder_runner.replay(256, dataclasses.replace(batch, requested_tokens=0))
    assert (ladder_runner.stats.real_tokens, ladder_runner.stats.padded_tokens) == (real, padded + 256)


@pytest.fixture(scope="module")
def graph_runner(model):
    adapter = GraphToyAdapter(model, inside=GRAPH_SIZES[:-1], context=GRAPH_CONTEXT, breaking=GRAPH_BREAKING)
    runner = PrefillGraphRunner(plugin_manager(adapter), BcgConfig(enable=True, sizes=GRAPH_SIZES), chunk_size=TOP)
    runner.capture(progress=False)
    assert runner.captured and runner.graph_attention == frozenset(GRAPH_SIZES[:-1])
    assert runner.graph_variants == {b: (BREAKING,) for b in GRAPH_BREAKING}
    yield adapter, runner
    runner.close()


def test_attention_inside_the_graph_matches_eager_and_fails_with_metadata_not_landed(model, graph_runner):
    adapter, runner = graph_runner
    rng = random.Random(2024)
    torch.manual_seed(2024)
    counts = [rng.choice(GRAPH_SIZES[:-1]) for _ in range(5)] + [rng.randint(1, GRAPH_SIZES[-2]) for _ in range(20)]
    worst, stale_errs, stale_caught = 0.0, [], 0
    for n in counts:
        seqs = random_mix(rng, n, FIRST_REAL_SLOT, contexts=SHORT_CONTEXTS)
        ids = torch.randint(0, model.shape.vocab, (n,), device="cuda")
        ref = model.forward_eager(ids, model.positions(seqs), model.attention_meta(seqs))
        bucket = runner.bucket_for(n)
        assert bucket in runner.graph_attention and adapter.fits(bucket, seqs), (n, bucket, seqs)
        out = runner.replay(bucket, adapter.land(bucket, ids, seqs)).clone()
        # Never bit for bit: the graph's attention reduces over the bucket's fixed columns.
        assert matches_eager(out, ref, False, GRAPH_REL_TOL), (n, bucket, seqs, rel_err(out, ref))
        worst = max(worst, rel_err(out, ref))
        # Negative control: the step's inputs landed, its metadata not: the fixed buffers still hold
        # another step's, as a graph whose persistent metadata is not refreshed would read them.
        adapter.land(bucket, ids, [(FIRST_REAL_SLOT + 12_000, 50, n)])
        stale = HostBatch(num_tokens=n, inputs={"input_ids": ids, "positions": model.positions(seqs)},
                          payload=adapter.fixed_meta(bucket))
        stale_out = runner.replay(bucket, stale).clone()
        stale_errs.append(rel_err(stale_out, ref))
        stale_caught += not matches_eager(stale_out, ref, False, GRAPH_REL_TOL)
    print(f"\nattention inside the graph: worst rel err {worst:.2e} (tol {GRAPH_REL_TOL}); "
          f"metadata not landed: min rel err {min(stale_errs):.2e}")
    assert stale_caught == len(counts), f"replays with metadata not landed passed the check: {len(counts) - stale_caught}"


def test_a_step_whose_keys_exceed_the_fixed_metadata_replays_in_a_graph_whose_attention_breaks(model, graph_runner):
    adapter, runner = graph_runner
    torch.manual_seed(7)
    # Eight decodes of 200 cached keys each outgrow every graph bucket's columns. 40 tokens: bucket
    # 64's BREAKING variant; 100: bucket 128 has none, so 256's; 300: bucket 512, which breaks.
    for n, expected in ((40, 64), (100, 256), (300, 512)):
        seqs = [(FIRST_REAL_SLOT + 201 * i, 200, 1) for i in range(8)] + [(FIRST_REAL_SLOT + 201 * 8, 0, n - 8)]
        ids = torch.randint(0, model.shape.vocab, (n,), device="cuda")
        assert not adapter.fits(runner.bucket_for(n), seqs)
        bucket = min(b for b in runner.buckets if b >= n and runner.breaks_attention(b))
        assert bucket == expected
        variant = BREAKING if bucket in runner.graph_attention else None
        ref = model.forward_eager(ids, model.positions(seqs), model.attention_meta(seqs))
        before = runner.stats.replays_by_variant[BREAKING]
        out = runner.replay(bucket, adapter.batch(ids, seqs), variant=variant).clone()
        # A variant that kept attention inside would read the bucket's fixed buffers, not this step.
        assert matches_eager(out, ref, same_shape=False), (n, bucket, rel_err(out, ref))
        assert runner.stats.replays_by_variant[BREAKING] - before == (variant is not None)
        # Negative control: another step's live metadata fails the same check.
        stale = adapter.batch(ids, seqs)
        stale.payload = adapter.batch(ids, [(FIRST_REAL_SLOT + 12_000, 50, n)]).payload
        assert not matches_eager(runner.replay(bucket, stale, variant=variant).clone(), ref, same_shape=False)


def test_capture_a_b_then_replay_a_b_a_with_allocator_churn(model):
    adapter = ToyAdapter(model)
    runner = PrefillGraphRunner(plugin_manager(adapter), BcgConfig(enable=True, sizes=(256, 512)), chunk_size=TOP)
    runner.capture(progress=False)
    assert 0 < runner.stats.warmup_seconds < runner.stats.capture_seconds
    rng = random.Random(7)
    try:
        cases = {b: make_case(model, adapter, rng, b) for b in (256, 512)}
        for step, b in enumerate((256, 512, 256)):
            churn = [torch.empty(rng.randint(1, 64) << 20, dtype=torch.uint8, device="cuda") for _ in range(16)]
            del churn[::2]
            torch.cuda.empty_cache()
            seqs, ids, batch = cases[b]
            ref = model.forward_eager(ids, model.positions(seqs), batch.payload)
            out = runner.replay(b, batch).clone()
            assert matches_eager(out, ref, True), (step, b)
            del churn
            gc.collect()
    finally:
        runner.close()


# -- the core's guards against the reference implementations' pitfalls, on capture_segments alone ------

ARG_ROWS, ARG_WIDTH = 64, 256  # a 64 KiB fp32 break argument: a block of the allocator's small pool
CHURN_TRIES = 4096  # same-size allocations (256 MiB at most) to land on a freed block of that pool


@pytest.fixture
def graph_pool():
    pool = GraphPool()
    yield pool
    pool.release()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _capture_stream() -> torch.cuda.Stream:
    return default_capture_stream(torch.device("cuda", torch.cuda.current_device()))


@eager_break
def _add_bias(y, bias, out):
    torch.add(y, bias, out=out)


def _replay_after_the_creator_drops_a_break_argument(pool: GraphPool) -> tuple[bool, bool]:
    """Capture ``out = 2x + bias + 1`` with ``bias`` passed to an eager break: allocated eagerly,
    outside the pool, by a creator that drops it after the capture. Then allocate blocks of its size
    (filled with 1e4) until one lands on its address or ``CHURN_TRIES`` run out, and replay.
    Returns whether the replay matched eager and whether an allocation landed on ``bias``."""
    with pool.allocating():
        x = torch.randn(ARG_ROWS, ARG_WIDTH, device="cuda")
        out = torch.empty_like(x)
    creator = {"bias": torch.full((ARG_ROWS, ARG_WIDTH), 3.0, device="cuda")}
    assert not pool.contains(creator["bias"])
    start = creator["bias"].data_ptr()
    ref = x * 2 + creator["bias"] + 1

    def body():
        y = x * 2
        _add_bias(y, creator["bias"], out)
        out.add_(1)

    graph, _ = capture_segments(body, pool=pool, stream=_capture_stream())
    del creator["bias"]  # the creator is done with it; nothing but the runtime may keep it now
    churn, landed = [], False
    for _ in range(CHURN_TRIES):
        churn.append(torch.full((ARG_ROWS, ARG_WIDTH), 1e4, device="cuda"))
        if churn[-1].data_ptr() == start:
            landed = True
            break
    try:
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return torch.equal(out, ref), landed
    finally:
        graph.release()


def test_a_break_argument_from_outside_the_pool_outlives_its_creator(graph_pool, monkeypatch):
    # Pitfall 2 where the A/B/A test above cannot reach it: the reference decoder's break arguments
    # are all in the pool or owned by the model, and its churn never lands in the pool.
    right, landed = _replay_after_the_creator_drops_a_break_argument(graph_pool)
    assert right and not landed, (right, landed)
    # Negative control: without the runtime's holds the freed block is handed out again, and the
    # replayed break reads whatever its new owner wrote there.
    with monkeypatch.context() as m:
        m.setattr(BreakArgumentHolds, "keep", lambda self, args, kwargs: None)
        right, landed = _replay_after_the_creator_drops_a_break_argument(graph_pool)
    assert landed and not right, (right, landed)


class _GcLeftOn:
    """``capture``'s view of ``gc`` with ``disable`` doing nothing: a capture without pitfall 9's guard."""

    isenabled, enable = staticmethod(gc.isenabled), staticmethod(gc.enable)

    @staticmethod
    def disable():
        pass


def _collections_during_a_capture_making_cyclic_garbage(pool: GraphPool) -> list[bool]:
    """Per garbage collection that started while the body ran: whether the stream was capturing."""
    with pool.allocating():
        x = torch.randn(ARG_ROWS, ARG_WIDTH, device="cuda")
    started = []

    def record(phase, info):
        if phase == "start":
            started.append(torch.cuda.is_current_stream_capturing())

    def body():
        y = x * 2
        for _ in range(5 * max(gc.get_threshold()[0], 1)):  # enough allocations for automatic collections
            garbage = []
            garbage.append(garbage)
        return y + 1

    gc.collect()  # nothing older is left to collect inside the capture (a dead graph would reset there)
    gc.callbacks.append(record)
    try:
        graph, _ = capture_segments(body, pool=pool, stream=_capture_stream())
    finally:
        gc.callbacks.remove(record)
    graph.release()
    return started


def test_no_garbage_collection_runs_inside_a_capture(graph_pool, monkeypatch):
    assert gc.isenabled() and gc.get_threshold()[0] > 0
    started = _collections_during_a_capture_making_cyclic_garbage(graph_pool)
    assert True not in started and gc.isenabled(), started
    # Negative control: with gc left on, the same body's garbage is collected while capturing.
    monkeypatch.setattr(capture_module, "gc", _GcLeftOn)
    started = _collections_during_a_capture_making_cyclic_garbage(graph_pool)
    assert True in started, started


@eager_break
def _doubled(x):
    return x * 2  # a new CUDA tensor: nothing owns its block once the break returns


def test_a_break_returning_a_cuda_tensor_fails_the_capture(graph_pool, monkeypatch):
    with graph_pool.allocating():
        x = torch.randn(ARG_ROWS, ARG_WIDTH, device="cuda")
    stream_before = torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match="_doubled.*returns one or more CUDA tensors"):
        capture_segments(lambda: _doubled(x + 1) + 1, pool=graph_pool, stream=_capture_stream())
    assert not torch.cuda.is_current_stream_capturing() and torch.cuda.current_stream() == stream_before
    # Negative control: without the primitive's check the same body captures.
    import breakable_cuda_graphs

    monkeypatch.setattr(breakable_cuda_graphs, "_is_cuda_tensor", lambda t: False)
    graph, _ = capture_segments(lambda: _doubled(x + 1) + 1, pool=graph_pool, stream=_capture_stream())
    graph.release()


class _FailingAdapter(ToyAdapter):
    """Raises during capture: inside an eager break, inside a segment, or as OOM."""

    def __init__(self, model, where: str):
        super().__init__(model)
        self.where = where

    @hookimpl
    def bcg_body_forward(self, inputs, payload):
        from breakable_cuda_graphs import is_in_breakable_graph

        if not is_in_breakable_graph():
            return super().bcg_body_forward(inputs, payload)
        x = inputs["inputs_embeds"] * 2
        if self.where == "segment":
            raise ValueError("injected failure inside a segment")
        out = torch.empty_like(x)

        @eager_break(outputs=("out",))
        def failing_break(x, out):
            if self.where == "oom":
                raise torch.OutOfMemoryError("injected OOM")
            raise ValueError("injected failure inside a break")

        failing_break(x, out)
        return out


@pytest.fixture
def recorded_pools(monkeypatch):
    pools = []
    original = runner_module.GraphPool

    def record():
        pool = original()
        pools.append(pool.handle)
        return pool

    monkeypatch.setattr(runner_module, "GraphPool", record)
    return pools


@pytest.mark.parametrize("where", ["break", "segment"])
def test_failing_capture_leaves_nothing_behind(model, recorded_pools, where):
    from breakable_cuda_graphs import is_in_breakable_graph

    stream_before = torch.cuda.current_stream()
    runner = PrefillGraphRunner(plugin_manager(_FailingAdapter(model, where)),
                                BcgConfig(enable=True, sizes=(64, 128), capture_failure="raise"), chunk_size=TOP)
    with pytest.raises(BcgCaptureError) as info:
        runner.capture(progress=False)
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and "injected failure" in str(cause)
    del info, cause  # the traceback's frames hold tensors from the aborted capture
    gc.collect()
    assert live.get() is None and _capture_holds.get() is None and not is_in_breakable_graph()
    assert gc.isenabled() and torch.cuda.current_stream() == stream_before
    assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert recorded_pools and torch.cuda.memory_snapshot(recorded_pools[-1], include_traces=False) == []
    assert not runner.captured and runner.bucket_for(64) is None
    # The default policy serves eagerly instead, and says so in its counters.
    eager_runner = PrefillGraphRunner(plugin_manager(_FailingAdapter(model, where)),
                                      BcgConfig(enable=True, sizes=(64,)), chunk_size=TOP)
    eager_runner.capture(progress=False)
    assert eager_runner.bucket_for(64) is None
    assert eager_runner.stats.fallbacks[Fallback.CAPTURE_FAILED.value] == 1
    # And the GPU is still usable for a normal forward.
    seqs = [(FIRST_REAL_SLOT, 0, 8)]
    assert torch.isfinite(model.forward_eager(torch.arange(8, device="cuda"), model.positions(seqs),
                                              model.attention_meta(seqs))).all()


def test_oom_during_capture_raises_with_advice(model):
    runner = PrefillGraphRunner(plugin_manager(_FailingAdapter(model, "oom")), BcgConfig(enable=True, sizes=(64,)),
                                chunk_size=TOP)
    with pytest.raises(BcgCaptureOOM, match="lower bcg 'max_tokens'.*0 to disable"):
        runner.capture(progress=False)
    assert live.get() is None and not runner.captured


def test_graph_memory_of_full_ladder_vs_largest_bucket(model):
    def graph_bytes(config):
        r = PrefillGraphRunner(plugin_manager(ToyAdapter(model)), config, chunk_size=TOP)
        r.capture(progress=False)
        try:
            # The capture's device cost holds the pool and the graphs themselves, whose driver
            # memory may be what an earlier runner's graphs left to reuse.
            assert r.stats.graph_bytes >= r.stats.pool_bytes == r.pool_bytes > 0, r.stats
            print(f"\n{len(r.buckets)} buckets: device {r.stats.graph_bytes / 2**20:.1f} MiB, "
                  f"pool {r.pool_bytes / 2**20:.1f} MiB")
            return r.pool_bytes, len(r.buckets)
        finally:
            r.close()
            torch.cuda.empty_cache()

    full, n_full = graph_bytes(BcgConfig(enable=True))
    top_only, _ = graph_bytes(BcgConfig(enable=True, sizes=(TOP,)))
    ratio = full / top_only
    print(f"\ngraph memory: {n_full} buckets {full / 2**20:.1f} MiB, top bucket alone {top_only / 2**20:.1f} MiB, "
          f"ratio {ratio:.2f}")
    assert n_full == 40 and ratio <= 1.5


class _HostStreamAdapter(ToyAdapter):
    """A host that names its capture stream, as both engines do (their graph-capture stream)."""

    def __init__(self, model: ToyDecoder, stream: torch.cuda.Stream):
        super().__init__(model)
        self.stream = stream

    @hookimpl
    def bcg_capture_stream(self):
        return self.stream


def _used_stream(model) -> torch.cuda.Stream:
    """A stream that has run a matmul, so its cuBLAS workspace is already held (a used host stream)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        w = model.layers[0]["o"]
        w @ w.T
    stream.synchronize()
    return stream


def test_graph_memory_estimate_leaves_nothing_behind_and_is_near_the_capture(model):
    adapter = _HostStreamAdapter(model, _used_stream(model))
    runner = PrefillGraphRunner(plugin_manager(adapter), BcgConfig(enable=True), chunk_size=TOP)
    # Counted by the allocator: the driver keeps memory for graphs and loaded kernels after their
    # first use, which a later capture reuses, so free device memory depends on what ran before.
    free_device_bytes(runner.device)
    held_before = torch.cuda.memory_reserved(runner.device)
    estimate = runner.estimate_graph_bytes()
    free_device_bytes(runner.device)
    left_behind = torch.cuda.memory_reserved(runner.device) - held_before
    runner.capture(progress=False)
    try:
        actual = runner.stats.graph_bytes
        print(f"\ngraph memory estimate {estimate / 2**20:.1f} MiB, capture {actual / 2**20:.1f} MiB, "
              f"left behind by the estimate {left_behind / 2**20:.1f} MiB")
        assert runner.captured and len(runner.buckets) == 40
        assert left_behind <= 2**20, left_behind  # the sampled buckets and their pool are gone
        assert abs(estimate - actual) <= ESTIMATE_REL_TOL * actual, (estimate, actual)
    finally:
        runner.close()
        torch.cuda.empty_cache()


def test_runners_buffers_share_the_pools_segments_instead_of_pinning_their_own(model):
    # Hosts capture with their graph-capture stream current, a stream nothing else allocates on:
    # a buffer allocated there outside the pool pins a whole segment (a 4 MiB output, 20 MiB).
    stream = _used_stream(model)
    runner = PrefillGraphRunner(plugin_manager(_HostStreamAdapter(model, stream)),
                                BcgConfig(enable=True, sizes=(256, TOP)), chunk_size=TOP)
    free_device_bytes(runner.device)
    before = {s["address"] for s in torch.cuda.memory_snapshot()}
    with torch.cuda.stream(stream):
        runner.capture(progress=False)
    try:
        free_device_bytes(runner.device)
        known = before | {s["address"] for s in runner._pool.segments()}
        outside = [s for s in torch.cuda.memory_snapshot() if s["address"] not in known]
        outside_bytes = sum(s["total_size"] for s in outside)
        print(f"\ncapture added {outside_bytes / 2**20:.1f} MiB of segments outside its pool "
              f"{sorted(s['total_size'] >> 20 for s in outside)} MiB; output {runner._output.nbytes / 2**20:.1f} MiB")
        assert runner.captured
        core_buffers = {"output": runner._output, "padded-row flags": runner._padded._padded,
                        **{f"static input {n}": b for n, b in runner._static.items()}}
        assert all(runner._pool.contains(b) for b in core_buffers.values()), \
            [n for n, b in core_buffers.items() if not runner._pool.contains(b)]
        assert outside_bytes < runner._output.nbytes, [(s["total_size"], s["allocated_size"]) for s in outside]
    finally:
        runner.close()
        torch.cuda.empty_cache()


def test_recapture_on_the_runners_own_stream_pins_no_memory(model):
    # Control: the measurement sees what a new stream's first matmul pins (its cuBLAS workspace).
    device = torch.device("cuda", torch.cuda.current_device())
    free_before = free_device_bytes(device)
    stream = _used_stream(model)
    pinned_by_new_stream = free_before - free_device_bytes(device)
    assert pinned_by_new_stream > 2**20, (f"a new stream's matmul pinned {pinned_by_new_stream} bytes: no per-stream "
                                          f"cuBLAS workspace to see here (CUBLAS_WORKSPACE_CONFIG?)")
    del stream

    runner = PrefillGraphRunner(plugin_manager(ToyAdapter(model)), BcgConfig(enable=True, sizes=(256, TOP)),
                                chunk_size=TOP)
    try:
        runner.capture(progress=False)
        runner.close()
        free_between = free_device_bytes(runner.device)
        runner.capture(progress=False)
        runner.close()
        pinned = free_between - free_device_bytes(runner.device)
        print(f"\na new stream's matmul pins {pinned_by_new_stream / 2**20:.1f} MiB; a recapture pins "
              f"{pinned / 2**20:.1f} MiB")
        assert pinned <= 2**20, pinned  # the second capture reuses the first one's stream
    finally:
        runner.close()
        torch.cuda.empty_cache()


def test_host_graphs_captured_after_bcg_share_its_streams_cublas_workspace(model, monkeypatch):
    # A host's own graphs captured without naming a stream (vLLM's V2 decode graphs) run on torch's
    # default capture stream; made fresh here, so no earlier test has pinned a workspace for it.
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    runner = PrefillGraphRunner(plugin_manager(ToyAdapter(model)), BcgConfig(enable=True, sizes=(256, TOP)),
                                chunk_size=TOP)
    w = model.layers[0]["o"][:256]
    try:
        runner.capture(progress=False)
        free_device_bytes(runner.device)
        held_before = torch.cuda.memory_reserved(runner.device)
        host_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(host_graph):
            y = w @ w.T
        pinned = torch.cuda.memory_reserved(runner.device) - held_before
        print(f"\na host graph captured after bcg's took {pinned / 2**20:.1f} MiB for a {y.nbytes / 2**10:.0f} "
              "KiB output")
        # The output takes one small-block segment (2 MiB); a workspace of the host graph's own
        # would come out of its pool as well (32 MiB on Hopper).
        assert pinned <= 2 * 2**20, pinned
        assert runner._fallback_capture_stream is torch.cuda.graph.default_capture_stream
    finally:
        runner.close()
        torch.cuda.empty_cache()


class _UnjoinedStreamAdapter(ToyAdapter):
    @hookimpl
    def bcg_body_forward(self, inputs, payload):
        from breakable_cuda_graphs import is_in_breakable_graph

        if not is_in_breakable_graph():
            return inputs["inputs_embeds"].clone()
        x = inputs["inputs_embeds"]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 3
        out = torch.empty_like(x)

        @eager_break(outputs=("out",))
        def consume(y, out):
            out.copy_(y)

        consume(y, out)  # no current_stream().wait_stream(side): the fork is never joined
        return out


_DEVICE_ASSERT_SCRIPT = """
import torch
from bcg_plugin import BcgCaptureError, BcgConfig, PrefillGraphRunner, plugin_manager
from bcg_plugin.hookspecs import hookimpl
from bcg_plugin.testing import QWEN3_0_6B, ToyAdapter, ToyDecoder

class DeviceAssertAdapter(ToyAdapter):
    @hookimpl
    def bcg_body_forward(self, inputs, payload):
        x = inputs["inputs_embeds"]
        return x[torch.full((x.shape[0],), 1 << 40, device=x.device)]  # out of bounds: a device-side assert

model = ToyDecoder(QWEN3_0_6B, kv_slots=4096, device="cuda")
runner = PrefillGraphRunner(plugin_manager(DeviceAssertAdapter(model)), BcgConfig(enable=True, sizes=(64,)),
                            chunk_size=64)  # capture_failure "eager", the default
try:
    runner.capture(progress=False)
except BcgCaptureError as e:
    print("RAISED:", e, flush=True)
else:
    print("FELL BACK TO EAGER: captured =", runner.captured, flush=True)
"""


def test_a_capture_that_breaks_the_device_fails_the_boot_instead_of_falling_back_to_eager():
    # A device-side assert is sticky: every later CUDA call in the process fails, an eager prefill's
    # too. It runs in a process of its own, whose CUDA context it ends.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _DEVICE_ASSERT_SCRIPT], capture_output=True, text=True, timeout=300)
    print(done.stdout[-2000:])
    assert "RAISED: bcg prefill graph capture left this rank's GPU unusable" in done.stdout, done.stderr[-4000:]
    assert "cannot fall back to eager prefill" in done.stdout and "'max_tokens' to 0" in done.stdout


def test_unjoined_side_stream_raises_a_clear_error(model, recorded_pools):
    runner = PrefillGraphRunner(plugin_manager(_UnjoinedStreamAdapter(model)),
                                BcgConfig(enable=True, sizes=(64,), capture_failure="raise"), chunk_size=TOP)
    with pytest.raises(BcgCaptureError) as info:
        runner.capture(progress=False)
    assert "side stream was not joined" in str(info.value.__cause__)
    assert not torch.cuda.is_current_stream_capturing() and live.get() is None
    del info
    gc.collect()
    # The capture failed in cudaStreamEndCapture, where torch 2.11 leaves the pool's routing open:
    # the allocator's empty_cache would then return nothing, and the pool would keep its segments.
    freed = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    del freed
    torch.cuda.synchronize()
    held = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    assert held - torch.cuda.memory_reserved() >= 256 * 2**20, "empty_cache returned no memory after the failure"
    assert torch.cuda.memory_snapshot(recorded_pools[-1], include_traces=False) == []
    # Had that routing stayed open, closing a pool with live buffers after it must still not empty
    # the pool under the allocator's assert that no routing is open (a MemPool does: abort).
    after = PrefillGraphRunner(plugin_manager(ToyAdapter(model)), BcgConfig(enable=True, sizes=(64,)), chunk_size=TOP)
    after.capture(progress=False)
    assert after.captured and after._pool.contains(after._output)
    after.close()


class _NanRowsAdapter(ToyAdapter):
    """A body whose one break writes only the real rows of an output that every forward first fills
    with NaN, as attention kernels leave a pool block's padded rows as they found them."""

    def __init__(self, model: ToyDecoder, *, declared: bool):
        super().__init__(model)

        @eager_break(outputs=("out",) if declared else ())
        def real_rows(x, out):
            n = live.current().num_tokens
            out[:n].copy_(x[:n] * 2)

        self._break = real_rows

    @hookimpl
    def bcg_body_forward(self, inputs, payload):
        x = inputs["inputs_embeds"]
        out = torch.full_like(x, float("nan"))
        self._break(x, out)
        return out + 1


# Per ladder: its buckets, the first row its top bucket's graph scrubs, then the replays (tokens,
# bucket). In the 64-token bucket the graph scrubs rows 32-63: padding inside them, an unpadded replay
# after a padded one (stale flags would zero real rows), and 5 tokens, whose rows 5-31 the break
# zeroes. A bucket of BREAKS_ZERO_FROM_TOKENS rows scrubs none: its break zeroes every padded row.
_BIG = BREAKS_ZERO_FROM_TOKENS  # at most TOP, the toy model's top bucket
PADDING_LADDERS = {
    "graph-scrub": ((32, 64), 32, [(40, 64), (64, 64), (40, 64), (5, 64), (17, 32), (32, 32), (50, 64)]),
    "breaks-zero": ((_BIG - 64, _BIG), _BIG, [(_BIG - 48, _BIG), (_BIG, _BIG), (_BIG - 48, _BIG), (5, _BIG),
                                              (_BIG - 148, _BIG - 64), (_BIG - 64, _BIG - 64), (_BIG - 8, _BIG)]),
}


def _padded_rows_after_replays(model, *, declared: bool, ladder: str) -> list[tuple[int, int, bool, bool]]:
    """Per replay (tokens, bucket): whether the real rows are the break's and the padded rows zeros
    (read from the runner's whole-bucket output, padded rows included)."""
    sizes, scrub_start, replays = PADDING_LADDERS[ladder]
    adapter = _NanRowsAdapter(model, declared=declared)
    runner = PrefillGraphRunner(plugin_manager(adapter), BcgConfig(enable=True, sizes=sizes), chunk_size=TOP)
    runner.capture(progress=False)
    try:
        assert runner._padded.start(sizes[-1]) == scrub_start
        seen = []
        for n, bucket in replays:
            ids = torch.randint(0, model.shape.vocab, (n,), device="cuda")
            runner.replay(bucket, adapter.batch(ids, [(FIRST_REAL_SLOT, 0, n)]))
            rows = runner._output[:bucket]
            real = torch.equal(rows[:n], model.embed_ids(ids) * 2 + 1)
            padded = bool(rows[n:].eq(1).all())
            seen.append((n, bucket, real, padded))
        return seen
    finally:
        runner.close()


@pytest.mark.parametrize("ladder", sorted(PADDING_LADDERS))
def test_padded_rows_of_break_outputs_are_zeros_at_every_replay(model, ladder):
    seen = _padded_rows_after_replays(model, declared=True, ladder=ladder)
    print(f"\n(tokens, bucket, real rows right, padded rows zeroed): {seen}")
    assert all(real and padded for *_, real, padded in seen), seen
    # Negative control: the same break without its output declared leaves the NaN in the padded rows.
    control = _padded_rows_after_replays(model, declared=False, ladder=ladder)
    assert all(real for *_, real, _ in control), control
    assert [padded for n, bucket, _, padded in control] == [n == bucket for n, bucket, *_ in control], control
