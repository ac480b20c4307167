"""The replay path's host side on CPU: breaks recorded for replay, the flat segment walk, inputs landed
in place (``torch.cuda`` graphs replaced by recording fakes)."""

import pytest
import torch
from breakable_cuda_graphs import BreakableCUDAGraph, _EagerSegment

from bcg_plugin import BcgConfig, BcgConfigError, HostBatch, PrefillGraphRunner, StaticInput, live, plugin_manager
from bcg_plugin.breaks import _capture_holds, eager_break
from bcg_plugin.capture import SegmentedGraph
from bcg_plugin.padding import PaddedRows

# -- eager breaks: capture-only work stays out of replay --------------------------------------------


class _RecordingHolds:
    def __init__(self):
        self.kept = []

    def keep(self, args, kwargs):
        self.kept.append((args, kwargs))


def test_a_break_keeps_its_arguments_at_capture_and_only_runs_and_scrubs_at_replay(fake_capture):
    calls = []

    @eager_break(outputs=("out",))
    def attention(x, out):
        calls.append(x)
        out.fill_(1.0)

    out = torch.zeros(8)
    holds = _RecordingHolds()
    holds_token = _capture_holds.set(holds)
    try:
        with fake_capture() as capture, live.bound(live.LiveBatch(8, 8)):
            attention("captured", out)
    finally:
        _capture_holds.reset(holds_token)
    assert calls == ["captured"] and len(holds.kept) == 1
    [(replay, args, kwargs)] = capture.recorded

    holds_token = _capture_holds.set(holds)  # even with holds bound, a replay keeps nothing
    try:
        out.zero_()
        with live.bound(live.LiveBatch(5, 8)):
            replay("replayed", *args[1:], **kwargs)
    finally:
        _capture_holds.reset(holds_token)
    assert calls == ["captured", "replayed"] and len(holds.kept) == 1
    assert out[:5].eq(1).all() and out[5:].eq(0).all()  # the padded rows of the output scrubbed


# -- one flat walk over segments and breaks ----------------------------------------------------------


class _FakeGraph:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def replay(self):
        self.log.append(self.name)

    def reset(self):
        self.log.append(f"reset {self.name}")


def test_replay_walks_segments_and_bound_breaks_in_capture_order_and_release_drops_them():
    log = []
    graph = BreakableCUDAGraph()
    graph._segments = [_FakeGraph("g0", log), _EagerSegment(lambda a, *, b: log.append(f"break {a} {b}"), (1,),
                                                            {"b": 2}), _FakeGraph("g1", log)]
    held = []
    holds = type("Holds", (), {"clear": lambda self: held.append("cleared")})()
    segmented = SegmentedGraph(graph, holds)
    segmented.replay()
    segmented.replay()
    assert log == ["g0", "break 1 2", "g1"] * 2
    assert segmented.num_segments == 3
    segmented.release()
    assert log[6:] == ["reset g0", "reset g1"] and held == ["cleared"]
    segmented.replay()  # nothing left to run
    assert len(log) == 8


# -- landing: in place when the host's persistent buffer already holds the rows ---------------------


def _runner(host_ids, top=16):
    runner = PrefillGraphRunner(plugin_manager(), BcgConfig(enable=True, sizes=(8, top)), chunk_size=top,
                                device="cpu")
    specs = {"input_ids": StaticInput((), torch.int32, 0, host_ids), "positions": StaticInput((), torch.int64, 0)}
    runner._static = {name: runner._static_buffer(name, spec, top) for name, spec in specs.items()}
    runner._pads = {name: spec.pad for name, spec in specs.items()}
    runner._padded = PaddedRows(runner.buckets, runner.device)
    return runner


def _copies(ops):
    return [name for name in ops.names if name in ("copy_", "fill_")]


def test_inputs_already_in_the_hosts_buffer_land_without_a_copy(recorded_ops):
    host_ids = torch.arange(32, dtype=torch.int32)
    runner = _runner(host_ids)
    assert runner._static["input_ids"].data_ptr() == host_ids.data_ptr()
    positions = torch.arange(100, 108)
    with recorded_ops() as ops:
        runner._land(HostBatch(num_tokens=5, inputs={"input_ids": host_ids[:8], "positions": positions}), 8)
    # input_ids: in place (its padded rows still filled); positions: copied into the core's buffer
    assert sorted(_copies(ops)) == ["copy_", "fill_", "fill_"]
    assert host_ids[:5].tolist() == [0, 1, 2, 3, 4] and host_ids[5:8].eq(0).all() and host_ids[8:].tolist() == list(
        range(8, 32))
    assert runner._static["positions"][:8].tolist() == [100, 101, 102, 103, 104, 0, 0, 0]

    fresh = torch.arange(50, 58, dtype=torch.int32)  # not the host's buffer: copied like any input
    with recorded_ops() as ops:
        runner._land(HostBatch(num_tokens=8, inputs={"input_ids": fresh, "positions": positions}), 8)
    assert _copies(ops) == ["copy_", "copy_"] and host_ids[:8].tolist() == list(range(50, 58))


@pytest.mark.parametrize("buffer, problem", [
    (torch.zeros(32, dtype=torch.int64), "dtype torch.int64, not torch.int32"),
    (torch.zeros(8, dtype=torch.int32), "8 rows, fewer than the top bucket's 16"),
    (torch.zeros(32, 2, dtype=torch.int32), r"rows of shape \(2,\), not \(\)"),
    (torch.zeros(64, dtype=torch.int32)[::2], "not contiguous"),
])
def test_a_host_buffer_that_does_not_fit_is_refused_by_name(buffer, problem):
    with pytest.raises(BcgConfigError, match=rf"input 'input_ids' has .*{problem}"):
        _runner(buffer)
