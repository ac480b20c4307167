"""How a bucket's segments are opened and captured (CPU: ``torch.cuda.graph`` replaced by recording fakes)."""

import gc

import pytest
import torch
from breakable_cuda_graphs import BreakableCUDAGraph

from bcg_plugin import capture, eager_break
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


# -- a bucket's capture as a transaction, on fakes of torch.cuda's graphs and streams ---------------


class _Capturing:
    """Whether a fake graph segment is open: what ``torch.cuda.is_current_stream_capturing`` would say."""

    now = False


class _FakeSegmentContext:
    """``torch.cuda.graph`` (and the segment context that skips its cleanup) on a CPU."""

    def __init__(self, graph, pool=None, stream=None, capture_error_mode="global"):
        pass

    def __enter__(self):
        _Capturing.now = True

    def __exit__(self, *exc):
        _Capturing.now = False


class _FakeCudaGraph:
    def replay(self):
        pass

    def reset(self):
        pass


class _FakePool:
    handle = ("pool",)

    def contains(self, t):
        return False

    def end_failed_capture(self):
        pass


@pytest.fixture
def fake_segments(monkeypatch):
    """``capture.capture_segments`` runs on a CPU; ``_Capturing.now`` tells whether a segment is open."""
    import contextlib

    monkeypatch.setattr(capture.torch.cuda, "graph", _FakeSegmentContext)
    monkeypatch.setattr(capture, "_SegmentGraphContext", _FakeSegmentContext)
    monkeypatch.setattr(capture.torch.cuda, "CUDAGraph", _FakeCudaGraph)  # what BreakableCUDAGraph appends
    monkeypatch.setattr(capture.torch.cuda, "current_stream", lambda: "outer stream")
    monkeypatch.setattr(capture.torch.cuda, "set_stream", lambda stream: None)
    monkeypatch.setattr(capture.torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    _Capturing.now = False
    return lambda fn: capture.capture_segments(fn, pool=_FakePool(), stream="capture stream")


class _DeadGraph:
    """A graph left in a reference cycle (an abandoned capture's): collecting it calls ``reset()``,
    which must never happen while another graph is being captured."""

    def __init__(self, resets_while_capturing: list[bool]):
        self.cycle = self
        self.resets_while_capturing = resets_while_capturing

    def __del__(self):
        self.resets_while_capturing.append(_Capturing.now)


def _capture_with_cyclic_garbage(fake_segments) -> tuple[list[bool], list[bool]]:
    """Capture a body that makes cyclic garbage, with a dead graph in a cycle left from before. Returns
    whether each garbage collection that ran began inside a segment, and whether the dead graph's
    reset ran inside one (after the capture, a collection runs it outside)."""
    collections, resets = [], []
    gc.collect()  # no automatic collection is due before the capture opens its first segment

    def record(phase, info):
        if phase == "start":
            collections.append(_Capturing.now)

    def body():
        for _ in range(5 * max(gc.get_threshold()[0], 1)):  # enough allocations for automatic collections
            garbage = []
            garbage.append(garbage)

    _DeadGraph(resets)
    gc.callbacks.append(record)
    try:
        fake_segments(body)
    finally:
        gc.callbacks.remove(record)
    gc.collect()
    return collections, resets


class _GcLeftOn:
    """``capture``'s view of ``gc`` with ``disable`` doing nothing: the capture without pitfall 9's guard."""

    isenabled, enable = staticmethod(gc.isenabled), staticmethod(gc.enable)

    @staticmethod
    def disable():
        pass


def test_no_garbage_collection_runs_while_a_bucket_is_captured(fake_segments, monkeypatch):
    assert gc.isenabled() and gc.get_threshold()[0] > 0  # automatic collection is on to begin with
    collections, resets = _capture_with_cyclic_garbage(fake_segments)
    assert True not in collections, collections
    assert resets == [False]  # the dead graph was collected, after the capture
    assert gc.isenabled()
    # Negative control: with gc left on, the body's garbage starts collections inside the segment,
    # and one of them resets the dead graph there.
    monkeypatch.setattr(capture, "gc", _GcLeftOn)
    collections, resets = _capture_with_cyclic_garbage(fake_segments)
    assert True in collections and resets == [True], (collections, resets)


def test_gc_is_back_on_after_a_capture_that_raises(fake_segments):
    def body():
        raise ValueError("injected")

    with pytest.raises(ValueError, match="injected"):
        fake_segments(body)
    assert gc.isenabled() and not _Capturing.now


# -- pitfall 1: a break's CUDA tensor result is refused at capture --------------------------------------


class _CudaLooking(torch.Tensor):
    """A CPU tensor that says it is a CUDA one: what a break on a GPU would return."""

    @property
    def is_cuda(self):
        return True


def _returns(value):
    @eager_break
    def attention(x, out):
        out.copy_(x)
        return value

    return attention


@pytest.mark.parametrize("result", [
    torch.zeros(4).as_subclass(_CudaLooking),
    (1, {"lse": torch.zeros(4).as_subclass(_CudaLooking)}),  # nested in a container
])
def test_a_break_returning_a_cuda_tensor_raises_at_capture(fake_capture, result):
    out = torch.zeros(4)
    with fake_capture() as capture_ctx, pytest.raises(RuntimeError, match="attention.*returns one or more CUDA "
                                                                          "tensors.*pre-allocated buffer"):
        _returns(result)(torch.ones(4), out)
    assert capture_ctx.recorded == []  # nothing left for a replay


def test_a_break_may_return_host_values(fake_capture):
    out = torch.zeros(4)
    with fake_capture() as capture_ctx:
        assert _returns((7, torch.zeros(2)))(torch.ones(4), out)[0] == 7
    assert len(capture_ctx.recorded) == 1 and out.eq(1).all()


def test_the_cuda_result_check_is_what_refuses_the_break(fake_capture, monkeypatch):
    # Negative control of the test above: without the primitive's check the same break is recorded.
    import breakable_cuda_graphs

    monkeypatch.setattr(breakable_cuda_graphs, "_is_cuda_tensor", lambda x: False)
    with fake_capture() as capture_ctx:
        _returns(torch.zeros(4).as_subclass(_CudaLooking))(torch.ones(4), torch.zeros(4))
    assert len(capture_ctx.recorded) == 1


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
        assert problem.endswith("use an engine release built on a torch in that range"), problem


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
