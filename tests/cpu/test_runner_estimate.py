"""The graph-memory estimate for hosts that size their KV cache before capturing: sample, release, extrapolate."""

import logging

import pytest
import torch
from capture_fakes import FakePool, script_captures

from bcg_plugin import BcgCaptureError, BcgConfig, BcgStateError, PrefillGraphRunner, plugin_manager
from bcg_plugin import runner as runner_mod
from bcg_plugin.hookspecs import StaticInput, hookimpl

SIZES = (16, 32, 64, 128)
TOP_COST, FURTHER_COST = 1000, 10  # bytes the fake device loses to the top bucket and to each further one


class _FakeDevice:
    """Free memory that each captured bucket takes and each released one gives back, and a graph
    pool that grows by ``growth[bucket]`` when that bucket is captured (part of what it takes)."""

    def __init__(self, failing_bucket=None, cost=None, growth=None):
        self.free, self.failing_bucket = 50_000, failing_bucket
        self.cost, self.growth = cost or {}, growth or {}
        self.pool_bytes = 0
        self.captured, self.released, self.events = [], [], []

    def capture(self, bucket, stream, warm=True, variant=None):
        if bucket == self.failing_bucket:
            raise RuntimeError(f"injected failure at bucket {bucket}")
        cost = TOP_COST if not self.captured else self.cost.get(bucket, FURTHER_COST)
        self.free -= cost
        self.pool_bytes += self.growth.get(bucket, 0)
        self.captured.append(bucket)
        device = self

        class _Graph:
            def release(self):
                device.free += cost
                device.released.append(bucket)
                device.events.append("release")

        return _Graph()

    def measure(self, _device):
        self.events.append("measure")
        return self.free


class _DevicePool(FakePool):
    """The fake device's pool: as large as the device says."""

    def __init__(self, device):
        self._device = device

    def reserved_bytes(self) -> int:
        return self._device.pool_bytes


def _runner(monkeypatch, device, *plugins):
    runner = PrefillGraphRunner(plugin_manager(*plugins), BcgConfig(enable=True, sizes=SIZES), chunk_size=128,
                                device=torch.device("cuda", 0))
    monkeypatch.setattr(runner_mod, "free_device_bytes", device.measure)
    monkeypatch.setattr(runner_mod, "MIN_BUCKET_BYTES", 0)  # the fake's costs are a few bytes

    def prepare():  # the setup's plan and pool, without static buffers or a stream off CUDA
        runner.graph_attention = runner._plan_attention()
        runner._pool = _DevicePool(device)

    runner._prepare_capture = prepare
    script_captures(runner, device.capture)
    return runner


def test_estimate_is_the_top_bucket_plus_the_second_for_every_further_bucket(monkeypatch, caplog):
    device = _FakeDevice()
    runner = _runner(monkeypatch, device)
    with caplog.at_level(logging.INFO, logger="bcg_plugin"):
        estimate = runner.estimate_graph_bytes()
    assert estimate == TOP_COST + FURTHER_COST * (len(SIZES) - 1)
    assert device.captured == [128, 64]  # the two largest, largest first
    assert sorted(device.released) == [64, 128] and device.free == 50_000  # nothing left behind
    assert device.events[-3:] == ["release", "release", "measure"]  # the released pool handed back to the device
    assert not runner.captured and runner._pool is None
    assert "estimated at" in caplog.text and "4 buckets" in caplog.text


def test_capture_can_follow_the_estimate(monkeypatch):
    device = _FakeDevice()
    runner = _runner(monkeypatch, device)
    runner.estimate_graph_bytes()
    device.captured.clear()
    monkeypatch.setattr(runner_mod, "GraphPool", FakePool)
    runner._prepare_capture = lambda: runner.__setattr__("_pool", runner_mod.GraphPool())
    runner.capture(progress=False)
    assert runner.captured and device.captured == sorted(SIZES, reverse=True)
    assert runner.stats.graph_bytes == TOP_COST + FURTHER_COST * (len(SIZES) - 1)


def test_a_failed_sample_estimates_nothing_and_releases_what_it_captured(monkeypatch, caplog):
    device = _FakeDevice(failing_bucket=64)
    runner = _runner(monkeypatch, device)
    with caplog.at_level(logging.WARNING, logger="bcg_plugin"):
        assert runner.estimate_graph_bytes() == 0
    assert device.released == [128] and device.free == 50_000
    assert "could not estimate prefill graph memory" in caplog.text and "injected failure" in caplog.text


def _sticky_cuda_error(monkeypatch):
    """The device as after an illegal memory access: every later call fails, synchronising included."""

    def synchronize(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)


@pytest.mark.parametrize("sticky", [False, True])
def test_a_failure_that_leaves_the_device_unusable_fails_the_capture_instead_of_falling_back(monkeypatch, sticky):
    device = _FakeDevice(failing_bucket=64)
    runner = _runner(monkeypatch, device)
    monkeypatch.setattr(runner_mod, "GraphPool", FakePool)
    runner._prepare_capture = lambda: runner.__setattr__("_pool", runner_mod.GraphPool())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    if not sticky:  # capture_failure "eager" (the default): every rank runs prefill eagerly
        runner.capture(progress=False)
        assert not runner.captured and device.released == [128]
        return
    _sticky_cuda_error(monkeypatch)
    with pytest.raises(BcgCaptureError, match=r"GPU unusable \(RuntimeError\('injected failure.*cannot fall back"
                                              r".*'max_tokens' to 0"):
        runner.capture(progress=False)
    assert device.released == []  # nothing is released on a device that runs nothing


def test_an_estimate_that_leaves_the_device_unusable_raises_instead_of_estimating_nothing(monkeypatch):
    device = _FakeDevice(failing_bucket=64)
    runner = _runner(monkeypatch, device)
    _sticky_cuda_error(monkeypatch)
    with pytest.raises(BcgCaptureError, match=r"estimate left this rank's GPU unusable.*'max_tokens' to 0"):
        runner.estimate_graph_bytes()
    assert device.released == []


def test_estimate_after_capture_is_refused(monkeypatch):
    device = _FakeDevice()
    runner = _runner(monkeypatch, device)
    runner._graphs = {128: object()}
    with pytest.raises(BcgStateError, match="must come before capture"):
        runner.estimate_graph_bytes()


def test_an_inactive_runner_estimates_nothing(monkeypatch):
    runner = PrefillGraphRunner(plugin_manager(), BcgConfig(enable=False), chunk_size=128, device="cpu")
    monkeypatch.setattr(runner_mod, "free_device_bytes", lambda _: pytest.fail("measured an inactive runner"))
    assert runner.estimate_graph_bytes() == 0


class _NoStreamHost:
    """A host that declares its inputs but names no capture stream (``bcg_capture_stream`` unimplemented)."""

    @hookimpl
    def bcg_static_inputs(self):
        return {"positions": StaticInput((), torch.int64, 0)}


@pytest.mark.parametrize("torch_default", [True, False])
def test_estimate_and_capture_share_one_stream_when_the_host_names_none(monkeypatch, torch_default):
    # Each stream pins its own cuBLAS workspace for the process's life: torch.cuda.graph's default
    # capture stream (where a host's own unnamed-stream graphs capture), else one stream per runner.
    made, seen = [], []

    class _Stream:
        def __init__(self, device=None):
            made.append(self)

    torch_stream = object() if torch_default else None
    device = _FakeDevice()
    runner = PrefillGraphRunner(plugin_manager(_NoStreamHost()), BcgConfig(enable=True, sizes=SIZES),
                                chunk_size=128, device="cpu")
    monkeypatch.setattr(runner_mod, "free_device_bytes", lambda _: device.free)
    monkeypatch.setattr(runner_mod, "GraphPool", FakePool)
    monkeypatch.setattr(runner_mod, "default_capture_stream", lambda _: torch_stream)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    script_captures(runner, lambda bucket, stream, warm=True, variant=None: (
        seen.append(stream), device.capture(bucket, stream))[1])
    runner.estimate_graph_bytes()
    runner.capture(progress=False)
    assert runner.captured and len(seen) == 2 + len(SIZES)
    assert len(made) == (0 if torch_default else 1), made
    expected = torch_stream or made[0]
    assert all(s is expected for s in seen), (expected, seen)


class _InlineSmall:
    """A host that captures attention inside the graph in the two smallest buckets."""

    INLINE = (16, 32)

    @hookimpl
    def bcg_graph_attention(self, buckets, attention):
        return [b for b in buckets if b in self.INLINE]


class _InlineAll:
    @hookimpl
    def bcg_graph_attention(self, buckets, attention):
        return list(buckets)


def test_estimate_samples_the_largest_further_bucket_of_each_kind_and_charges_pool_growth_once(monkeypatch):
    """A bucket with attention inside the graph is one segment, one with breaks a segment per layer:
    each kind's further buckets are extrapolated from the largest of that kind. The first bucket
    with attention inside grows the pool by attention's buffers, which every later one reuses."""
    inline_cost, inline_growth = 2, 50
    device = _FakeDevice(cost={32: inline_growth + inline_cost}, growth={32: inline_growth})
    runner = _runner(monkeypatch, device, _InlineSmall())
    estimate = runner.estimate_graph_bytes()
    assert device.captured == [128, 64, 32]  # the top bucket, then the largest further one of each kind
    assert estimate == TOP_COST + FURTHER_COST * 1 + inline_growth + inline_cost * 2
    assert device.free == 50_000


@pytest.mark.parametrize("sizes, captured, expected", [
    ((16, 32, 64, 128), [128, 64], TOP_COST + FURTHER_COST * 3),  # the top bucket inline too: one kind
    ((128,), [128], TOP_COST),  # nothing further to sample
])
def test_estimate_with_one_kind_or_one_bucket(monkeypatch, sizes, captured, expected):
    device = _FakeDevice()
    runner = _runner(monkeypatch, device, _InlineAll())
    runner.buckets = list(sizes)
    assert runner.estimate_graph_bytes() == expected
    assert device.captured == captured


def test_a_further_bucket_that_reads_as_free_is_charged_the_floor(monkeypatch):
    """Free device memory moves in whole pages: a one-segment bucket's own memory can read as none."""
    device = _FakeDevice(cost={64: 0})
    runner = _runner(monkeypatch, device)
    monkeypatch.setattr(runner_mod, "MIN_BUCKET_BYTES", 7)
    assert runner.estimate_graph_bytes() == TOP_COST + 7 * (len(SIZES) - 1)
