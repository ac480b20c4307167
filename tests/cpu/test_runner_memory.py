"""The graph memory a capture reports: the device's whole cost, with the pool's part beside it."""

import types

import torch

from bcg_plugin import BcgConfig, PrefillGraphRunner, plugin_manager
from bcg_plugin import runner as runner_mod


def _captured_runner(monkeypatch, free_bytes, pool_bytes):
    runner = PrefillGraphRunner(plugin_manager(), BcgConfig(enable=True, sizes=(16, 32)), chunk_size=32,
                                device=torch.device("cuda", 0))
    free = iter(free_bytes)
    monkeypatch.setattr(runner_mod, "free_device_bytes", lambda device: next(free))

    def capture_all(buckets, progress):  # stands in for the CUDA-side capture: one bucket and its pool
        runner._pool = types.SimpleNamespace(reserved_bytes=lambda: pool_bytes)
        runner._graphs = {32: object()}

    runner._capture_all = capture_all
    runner.capture(progress=False)
    return runner


def test_graph_memory_is_what_the_capture_took_from_the_device_not_just_the_pool(monkeypatch):
    # 300 bytes left the device, 120 of them in the pool: the rest is buffers and the graphs themselves.
    runner = _captured_runner(monkeypatch, [5000, 4700], 120)
    assert runner.stats.graph_bytes == 300 and runner.stats.pool_bytes == 120
    assert "graph_mem=0.000GiB (pool 0.000GiB)" in runner.stats.summary()


def test_graph_memory_never_goes_negative_when_other_memory_was_freed_meanwhile(monkeypatch):
    runner = _captured_runner(monkeypatch, [5000, 5100], 120)
    assert runner.stats.graph_bytes == 0 and runner.stats.pool_bytes == 120


def test_a_runner_off_cuda_measures_nothing(monkeypatch):
    monkeypatch.setattr(runner_mod, "free_device_bytes", lambda device: (_ for _ in ()).throw(AssertionError))
    runner = PrefillGraphRunner(plugin_manager(), BcgConfig(enable=True, sizes=(16,)), chunk_size=16, device="cpu")
    runner._capture_all = lambda buckets, progress: setattr(runner, "_pool", types.SimpleNamespace(reserved_bytes=lambda: 7))
    runner.capture(progress=False)
    assert runner.stats.graph_bytes == 0 and runner.stats.pool_bytes == 7
