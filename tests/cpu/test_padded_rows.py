"""Padded rows scrubbed inside the graphs (``bcg_plugin.padding``), their host side on CPU: the flags a
replay sets, the scrub a capture records after each break, and the rows the breaks still zero."""

import pytest
import torch
from breakable_cuda_graphs import BreakableCUDAGraph, _EagerSegment

from bcg_plugin import BcgConfig, BcgStateError, HostBatch, PrefillGraphRunner, breaks, live, plugin_manager
from bcg_plugin.breaks import BreakArgumentHolds, _capture_scrub, eager_break
from bcg_plugin.capture import SegmentedGraph
from bcg_plugin.padding import PaddedRows

BUCKETS = [16, 32, 48, 64]


def test_a_replay_flags_the_padded_rows_of_its_buckets_range_once_per_padding(recorded_ops):
    rows = PaddedRows(BUCKETS, torch.device("cpu"))
    assert [rows.start(b) for b in BUCKETS] == [0, 16, 32, 48]  # the ranges tile [0, top)
    with recorded_ops() as ops:
        rows.flag(64, 50)
    assert [name for name in ops.names if name != "slice"] == ["ge"]  # one kernel
    assert rows._padded[48:].tolist() == [False, False] + [True] * 14
    assert not rows._padded[:48].any()  # other buckets' ranges untouched
    with recorded_ops() as ops:
        rows.flag(64, 50)  # the same padding again: nothing to launch
    assert ops.names == []
    rows.flag(64, 64)
    assert not rows._padded.any()
    rows.flag(64, 5)  # fewer rows than the range starts at: all of it padded
    assert rows._padded[48:].all() and not rows._padded[:48].any()


def test_the_recorded_scrub_zeroes_flagged_rows_even_of_nan_and_refuses_another_row_count():
    rows = PaddedRows(BUCKETS, torch.device("cpu"))
    rows.flag(64, 50)
    out = torch.full((64, 2, 3), float("nan"))
    rows.scrub(64).apply(out, "output")
    assert out[50:].eq(0).all()
    assert out[:50].isnan().all()  # rows the bucket's graph does not scrub, or not padded
    with pytest.raises(BcgStateError, match=r"output 'output' has 60 rows in the capture of the 64-token bucket"):
        rows.scrub(64).apply(torch.zeros(60, 4), "output")


def test_under_capture_the_scrub_follows_the_break_and_at_replay_the_break_zeroes_only_rows_below_it(
        fake_capture, recorded_ops):
    @eager_break(outputs=("out",))
    def attention(x, out):  # like flash attention, writes the real rows only
        n = live.current().num_tokens
        out[:n].copy_(x[:n])

    rows = PaddedRows(BUCKETS, torch.device("cpu"))
    x, out = torch.full((64, 4), 7.0), torch.full((64, 4), float("nan"))
    scrub_token = _capture_scrub.set(rows.scrub(64))
    try:
        with fake_capture() as capture, live.bound(live.LiveBatch(64, 64)), recorded_ops() as ops:
            attention(x, out)
    finally:
        _capture_scrub.reset(scrub_token)
    kernels = [name for name in ops.names if name not in ("slice", "view")]
    assert kernels == ["copy_", "masked_fill_"]  # the break, then the next segment's scrub
    [(replay, args, kwargs)] = capture.recorded

    out.fill_(float("nan"))
    with live.bound(live.LiveBatch(5, 64, graph_scrub_start=48)):
        replay(*args, **kwargs)
    assert out[:5].eq(7).all() and out[5:48].eq(0).all()
    assert out[48:].isnan().all()  # the graph's rows: the break leaves them to the recorded scrub

    out.fill_(float("nan"))
    with live.bound(live.LiveBatch(50, 64, graph_scrub_start=48)), recorded_ops() as ops:
        replay(*args, **kwargs)
    assert "zero_" not in ops.names and "fill_" not in ops.names  # padded only within the graph's rows

    out.fill_(float("nan"))
    with live.bound(live.LiveBatch(5, 64)):  # no rows scrubbed in the graph: the break zeroes every padded row
        replay(*args, **kwargs)
    assert out[:5].eq(7).all() and out[5:].eq(0).all()


def test_outside_a_bucket_capture_a_break_records_no_scrub(recorded_ops):
    @eager_break(outputs=("out",))
    def attention(x, out):
        out.copy_(x)

    x, out = torch.ones(16, 2), torch.zeros(16, 2)
    with live.bound(live.LiveBatch(16, 16)), recorded_ops() as ops:  # a warm-up forward: eager, nothing captured
        attention(x, out)
    assert ops.names == ["copy_"]


def test_a_replay_flags_its_padding_and_binds_the_rows_its_graph_scrubs():
    runner = PrefillGraphRunner(plugin_manager(), BcgConfig(enable=True, sizes=(8, 16)), chunk_size=16, device="cpu")
    runner._static = {"positions": torch.zeros(16, dtype=torch.int64)}
    runner._pads = {"positions": 0}
    runner._padded = PaddedRows(runner.buckets, runner.device)
    runner._output = torch.zeros(16, 4)
    seen = []

    def replay(self, *, breaks_zero_padding):
        seen.append((live.get(), breaks_zero_padding))

    runner._graphs = {16: type("Graph", (), {"replay": replay, "release": lambda self: None})()}
    runner.replay(16, HostBatch(num_tokens=11, inputs={"positions": torch.arange(11)}))
    assert [(b.num_tokens, b.bucket, b.graph_scrub_start, z) for b, z in seen] == [(11, 16, 8, False)]
    assert runner._padded._padded.tolist() == [False] * 11 + [True] * 5
    runner.replay(16, HostBatch(num_tokens=8, inputs={"positions": torch.arange(8)}))  # fills the graph's rows
    runner.replay(16, HostBatch(num_tokens=5, inputs={"positions": torch.arange(5)}))  # padded to a peer's bucket
    assert [(b.num_tokens, z) for b, z in seen[1:]] == [(8, False), (5, True)]  # only then do the breaks zero rows
    runner.close()
    assert runner._padded is None


def test_a_replay_calls_the_break_itself_unless_rows_below_the_graphs_scrub_are_padded(fake_capture, recorded_ops):
    calls = []

    @eager_break(outputs=("out",))
    def attention(x, out):
        calls.append(live.get().num_tokens)
        n = live.current().num_tokens
        out[:n].copy_(x[:n])

    x, out = torch.full((64, 4), 7.0), torch.full((64, 4), float("nan"))
    with fake_capture() as capture, live.bound(live.LiveBatch(64, 64)):
        attention(x, out)
    [(step, args, kwargs)] = capture.recorded
    graph = BreakableCUDAGraph()
    graph._segments = [_EagerSegment(step, args, kwargs)]
    segmented = SegmentedGraph(graph, BreakArgumentHolds(lambda t: False))

    with live.bound(live.LiveBatch(50, 64, graph_scrub_start=48)), recorded_ops() as ops:
        segmented.replay()
    assert calls[-1] == 50 and [name for name in ops.names if name != "slice"] == ["copy_"]
    assert breaks.plain_call(step) is attention.__wrapped__  # the host's own function, without the step around it

    out.fill_(float("nan"))
    with live.bound(live.LiveBatch(5, 64, graph_scrub_start=48)):
        segmented.replay(breaks_zero_padding=True)
    assert calls[-1] == 5 and out[:5].eq(7).all() and out[5:48].eq(0).all() and out[48:].isnan().all()

    out.fill_(float("nan"))
    with live.bound(live.LiveBatch(5, 64, graph_scrub_start=48)):
        segmented.replay()  # the wrong walk for this batch: rows below the scrub keep their garbage
    assert out[5:48].isnan().all()


def test_a_capturable_break_is_recorded_inline_only_in_buckets_that_ask_for_it(fake_capture, recorded_ops):
    """Graph-resident attention: the break's kernel runs under the capture (so it is recorded into the
    segment) and leaves no eager step; no scrub follows it, as none follows attention in the host's own
    full graphs (28 nodes a forward that cost the small buckets' forward time). Without the bucket
    asking, it breaks and the scrub follows."""
    from bcg_plugin.breaks import _capture_inline

    @eager_break(outputs=("out",), capturable=True)
    def attention(x, out):
        out.copy_(x)

    rows = PaddedRows(BUCKETS, torch.device("cpu"), whole=frozenset({16, 32}))
    x, out = torch.ones(32, 2), torch.zeros(32, 2)
    for inline, steps, kernels_seen in ((True, 0, ["copy_"]), (False, 1, ["copy_", "masked_fill_"])):
        tokens = (_capture_scrub.set(rows.scrub(32)), _capture_inline.set(inline))
        try:
            with fake_capture() as capture, live.bound(live.LiveBatch(32, 32)), recorded_ops() as ops:
                attention(x, out)
        finally:
            _capture_inline.reset(tokens[1])
            _capture_scrub.reset(tokens[0])
        assert len(capture.recorded) == steps
        kernels = [name for name in ops.names if name not in ("slice", "view")]
        assert kernels == kernels_seen  # inline: the kernel captured; else the break at capture, then the scrub


def test_a_replay_sets_no_flags_for_a_bucket_whose_capture_recorded_no_scrub(recorded_ops):
    """Every break of a graph-attention bucket captured inline: its graph reads no flag, so a replay
    launches nothing for them; a bucket whose capture recorded the scrub still gets its flags."""
    rows = PaddedRows(BUCKETS, torch.device("cpu"), whole=frozenset({16, 32}))
    rows.scrub(32)  # captured, every break inline: nothing recorded
    rows.scrub(48).apply(torch.zeros(48, 2), "output")
    with recorded_ops() as ops:
        rows.flag(32, 5)
    assert ops.names == []
    with recorded_ops() as ops:
        rows.flag(48, 40)
    assert [name for name in ops.names if name != "slice"] == ["ge"]
    assert rows._padded[32:48].tolist() == [False] * 8 + [True] * 8


def test_a_bucket_with_attention_in_the_graph_scrubs_all_its_rows_with_flags_of_its_own():
    rows = PaddedRows(BUCKETS, torch.device("cpu"), whole=frozenset({16, 32}))
    assert [rows.start(b) for b in BUCKETS] == [0, 0, 32, 48]  # no eager break is left to zero rows below
    rows.flag(32, 5)
    rows.flag(48, 40)
    out = torch.full((32, 3), float("nan"))
    rows.scrub(32).apply(out, "output")
    assert out[5:].eq(0).all() and out[:5].isnan().all()
    assert rows._padded[32:48].tolist() == [False] * 8 + [True] * 8  # the tiled flags untouched by bucket 32


def _wired_runner(monkeypatch, inside, variants=None):
    """A runner over a host whose buckets ``inside`` keep attention in the graph (and have
    ``variants``), set up for capture without a device: ``(runner, stream, asked, captured)``, what
    the dummy batches were asked for and what each capture recorded inline and scrubbed."""
    import contextlib

    from bcg_plugin import StaticInput, hookimpl
    from bcg_plugin import runner as runner_mod

    asked, captured = [], []

    class Host:
        @hookimpl
        def bcg_graph_attention(self, buckets, attention):
            return inside

        @hookimpl
        def bcg_graph_variants(self, buckets):
            return variants

        @hookimpl
        def bcg_static_inputs(self):
            return {"positions": StaticInput((), torch.int64)}

        @hookimpl
        def bcg_capture_stream(self):
            return "capture stream"

        @hookimpl
        def bcg_dummy_batch(self, num_tokens, graph_attention, variant):
            asked.append((num_tokens, graph_attention, variant))
            return HostBatch(num_tokens=num_tokens, inputs={"positions": torch.zeros(num_tokens, dtype=torch.int64)})

    class Pool:
        allocating = staticmethod(contextlib.nullcontext)

    def capture_segments(fn, *, pool, stream, scrub, inline_breaks):
        captured.append((scrub.start, scrub.stop, inline_breaks))
        return "graph", None

    monkeypatch.setattr(runner_mod, "check_torch_version", lambda: None)
    monkeypatch.setattr(runner_mod, "GraphPool", Pool)
    monkeypatch.setattr(runner_mod, "capture_segments", capture_segments)
    config = BcgConfig(enable=True, sizes=(16, 32), graph_variants=True)
    runner = PrefillGraphRunner(plugin_manager(Host()), config, chunk_size=32, device="cpu")
    stream = runner._prepare_capture()
    runner._output = torch.zeros(32, 4)
    return runner, stream, asked, captured


def test_a_graph_attention_bucket_is_captured_inline_with_all_its_rows_scrubbed(monkeypatch):
    """The runner's wiring of the host's plan: the dummy batch is asked for graph-resident metadata,
    the capture records capturable breaks inline, and the bucket's scrub covers all its rows."""
    runner, stream, asked, captured = _wired_runner(monkeypatch, inside=[32])
    for bucket in (32, 16):
        runner._capture_bucket(bucket, runner._stage_bucket(bucket), stream, warm=False)
    assert asked == [(32, True, None), (16, False, None)]
    assert captured == [(0, 32, True), (0, 16, False)]  # the top bucket scrubs below the next bucket too


def test_the_breaking_variant_of_a_graph_attention_bucket_is_staged_and_captured_as_a_breaking_bucket(monkeypatch):
    """``BREAKING``: the dummy batch is asked without graph-resident metadata and the capture runs the
    capturable breaks eagerly, scrubbing all the bucket's rows, as its own graph's eager breaks would."""
    from bcg_plugin import BREAKING

    runner, stream, asked, captured = _wired_runner(monkeypatch, inside=[16, 32], variants={32: [BREAKING]})
    for variant in (None, BREAKING):
        runner._capture_bucket(32, runner._stage_bucket(32, variant), stream, warm=False, variant=variant)
    assert asked == [(32, True, None), (32, False, BREAKING)]
    assert captured == [(0, 32, True), (0, 32, False)]


def test_a_bucket_whose_variant_scrubs_is_flagged_whichever_of_its_graphs_was_captured_last():
    """The breaking variant's eager breaks read the bucket's flags where the bucket's own graph (and
    a variant with attention inside, captured after it) scrub nothing: a replay must still flag."""
    rows = PaddedRows(BUCKETS, torch.device("cpu"), whole=frozenset({32}))
    rows.scrub(32)  # the bucket's own graph: attention inline, no eager break scrubbed
    rows.scrub(32).apply(torch.zeros(32, 4), "output")  # its breaking variant's break
    rows.scrub(32)  # a variant with attention inside, captured last
    rows.flag(32, 5)
    assert rows._flags[32].tolist() == [False] * 5 + [True] * 27
    only_inline = PaddedRows(BUCKETS, torch.device("cpu"), whole=frozenset({32}))
    only_inline.scrub(32)
    only_inline.flag(32, 5)  # no graph of the bucket reads a flag: nothing to launch
    assert not only_inline._flags[32].any()


def test_a_breaking_bucket_from_breaks_zero_from_tokens_records_no_scrub_and_its_breaks_zero_its_padding(
        fake_capture, recorded_ops):
    """A GPU-bound bucket: no scrub in its graph, which every replay would pay for, a full one too; a
    padded replay zeroes the rows in its breaks. Smaller buckets and graph-attention ones keep theirs."""
    from bcg_plugin.padding import BREAKS_ZERO_FROM_TOKENS

    @eager_break(outputs=("out",))
    def attention(x, out):
        n = live.current().num_tokens
        out[:n].copy_(x[:n])

    big = BREAKS_ZERO_FROM_TOKENS
    buckets = [16, big - 16, big, big + 16]
    rows = PaddedRows(buckets, torch.device("cpu"), whole=frozenset({big + 16}))
    assert [rows.start(b) for b in buckets] == [0, 16, big, 0]
    with pytest.raises(BcgStateError, match=f"output 'output' has 60 rows in the capture of the {big}-token bucket"):
        rows.scrub(big).apply(torch.zeros(60, 4), "output")  # the row check stays without a scrub

    x, out = torch.full((big, 4), 7.0), torch.full((big, 4), float("nan"))
    scrub_token = _capture_scrub.set(rows.scrub(big))
    try:
        with fake_capture() as capture, live.bound(live.LiveBatch(big, big)), recorded_ops() as ops:
            attention(x, out)
    finally:
        _capture_scrub.reset(scrub_token)
    assert "masked_fill_" not in ops.names
    with recorded_ops() as ops:
        rows.flag(big, 100)  # no flag its graph reads
    assert ops.names == []
    [(replay, args, kwargs)] = capture.recorded
    out.fill_(float("nan"))
    with live.bound(live.LiveBatch(big - 100, big, graph_scrub_start=rows.start(big))):
        replay(*args, **kwargs)
    assert out[: big - 100].eq(7).all() and out[big - 100 :].eq(0).all()
