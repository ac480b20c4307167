"""How a bucket's segments are opened (CPU: ``torch.cuda.graph`` replaced by recording fakes)."""

from breakable_cuda_graphs import BreakableCUDAGraph

from bcg_plugin import capture


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
