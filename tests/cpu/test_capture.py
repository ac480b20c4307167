"""How a bucket's segments are opened (CPU: ``torch.cuda.graph`` replaced by recording fakes)."""

import gc

import pytest
import torch
from breakable_cuda_graphs import BreakableCUDAGraph

from bcg_plugin import capture
from bcg_plugin.errors import BcgVersionError


class _Recorder:
    made: list[str] = []

    def __init__(self, graph, pool=None, stream=None, capture_error_mode="global"):
        self.graph, self.pool, self.stream = graph, pool, stream
        _Recorder.made.append(type(self).__name__)


class FullCleanup(_Recorder):
    pass


class NoCleanup(_Recorder):
    pass


def test_only_a_buckets_first_segment_runs_torch_cuda_graphs_cleanup(monkeypatch):
    monkeypatch.setattr(capture.torch.cuda, "graph", FullCleanup)
    monkeypatch.setattr(capture, "_SegmentGraphContext", NoCleanup)
    _Recorder.made = []
    stream = object()
    for _ in range(2):  # two buckets, three segments each
        graph = BreakableCUDAGraph(pool=("pool",))
        ctx = capture._BucketCapture(graph, stream=stream)
        for _ in range(3):
            segment = object()  # what BreakableCUDAGraph._append_graph appends before opening it
            graph._segments.append(segment)
            ctx._new_graph_ctx(segment)
            assert ctx._graph_ctx.stream is stream and ctx._graph_ctx.pool == ("pool",)
    assert _Recorder.made == ["FullCleanup", "NoCleanup", "NoCleanup"] * 2


def test_later_segments_still_capture_through_torch_cuda_graph():
    assert issubclass(capture._SegmentGraphContext, capture.torch.cuda.graph)
    assert "__exit__" not in vars(capture._SegmentGraphContext)  # torch's capture_end and stream exit


class _FakeStream:
    def __init__(self, device_index: int):
        self.device_index = device_index


def _fake_cuda(monkeypatch, existing, current_device=1):
    import contextlib

    class _Graph:
        default_capture_stream = existing

    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    monkeypatch.setattr(capture.torch.cuda, "graph", _Graph)
    monkeypatch.setattr(capture.torch.cuda, "device", device)
    monkeypatch.setattr(capture.torch.cuda, "current_device", lambda: current_device)
    monkeypatch.setattr(capture.torch.cuda, "Stream", lambda: _FakeStream(entered[-1]))
    return _Graph


def test_default_capture_stream_is_torchs_own_made_as_torch_would_on_the_device(monkeypatch):
    import torch

    graph = _fake_cuda(monkeypatch, existing=None)
    made = capture.default_capture_stream(torch.device("cuda", 1))
    assert made is graph.default_capture_stream and made.device_index == 1  # later torch.cuda.graph uses it
    assert capture.default_capture_stream(torch.device("cuda")) is made  # no index: the current device (1)


def test_default_capture_stream_on_another_device_is_not_used(monkeypatch):
    import torch

    other = _FakeStream(0)
    graph = _fake_cuda(monkeypatch, existing=other)
    assert capture.default_capture_stream(torch.device("cuda", 1)) is None
    assert graph.default_capture_stream is other
    assert capture.default_capture_stream(torch.device("cuda", 0)) is other


class _FakePool:
    handle = ("pool",)

    def contains(self, t):
        return False

    def end_failed_capture(self):
        pass


# -- the torch releases the capture was checked against ------------------------------------------------


@pytest.mark.parametrize("version, supported", [
    ("2.11.0", True), ("2.11.0+cu130", True), ("2.13.0", True), ("2.14.0rc1", True), ("2.14.1", True),
    ("2.10.0", False), ("2.9.1", False), ("2.15.0", False), ("2.15.0a0+git1234", False), ("nightly", False),
])
def test_torch_outside_the_checked_range_is_named_with_the_range(version, supported):
    problem = capture.torch_version_problem(version)
    if supported:
        assert problem is None
    else:
        assert problem.startswith(f"torch {version} is outside the range bcg-plugin supports (>=2.11,<2.15)"), problem
        assert "'max_tokens' to 0" in problem


def test_the_installed_torch_is_in_the_checked_range():
    assert capture.torch_version_problem() is None, capture.torch_version_problem()


def test_a_capture_under_another_torch_raises_before_any_cuda_call(monkeypatch):
    monkeypatch.setattr(capture.torch, "__version__", "2.15.0")

    def cuda_call(*args, **kwargs):
        raise AssertionError("reached CUDA")

    monkeypatch.setattr(capture.torch.cuda, "current_stream", cuda_call)
    with pytest.raises(BcgVersionError, match=r"torch 2\.15\.0 is outside the range"):
        capture.capture_segments(cuda_call, pool=_FakePool(), stream=None)
    assert gc.isenabled()


def test_a_runner_under_another_torch_serves_eagerly_and_says_why_in_one_line(monkeypatch, caplog):
    from bcg_plugin import BcgCaptureError, BcgConfig, Fallback, PrefillGraphRunner, plugin_manager

    monkeypatch.setattr(capture.torch, "__version__", "2.15.0")
    runner = PrefillGraphRunner(plugin_manager(), BcgConfig(enable=True, sizes=(16, 32)), chunk_size=32, device="cpu")
    with caplog.at_level("WARNING", logger="bcg_plugin"):
        runner.capture(progress=False)
    [why, *_] = [r.getMessage() for r in caplog.records]
    assert why.startswith("bcg: prefill graph capture failed: torch 2.15.0 is outside the range") and "\n" not in why
    assert runner.bucket_for(16) is None and runner.stats.fallbacks == {Fallback.CAPTURE_FAILED.value: 1}
    strict = PrefillGraphRunner(plugin_manager(), BcgConfig(enable=True, sizes=(16,), capture_failure="raise"),
                                chunk_size=16, device="cpu")
    with pytest.raises(BcgCaptureError) as info:
        strict.capture(progress=False)
    assert isinstance(info.value.__cause__, BcgVersionError)
