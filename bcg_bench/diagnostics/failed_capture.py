"""Diagnostic: what a capture failing at cudaStreamEndCapture leaves behind (torch 2.11).

Run from the repository root on a CUDA machine: ``python3 -m bcg_bench.diagnostics.failed_capture``.
Three runners whose body forks a side stream it never joins fail their capture at its end; after
each is closed, and after a good capture, it prints the device memory left behind against a
baseline, then whether the allocator's ``empty_cache`` still returns a freed 1 GiB tensor.
"""
import sys

import torch

sys.path.insert(0, "tests/gpu")
from test_runtime_gpu import FIRST_REAL_SLOT, TOP, _UnjoinedStreamAdapter  # noqa: E402

from bcg_plugin import BcgConfig, PrefillGraphRunner, plugin_manager  # noqa: E402
from bcg_plugin.pool import free_device_bytes  # noqa: E402
from bcg_plugin.testing import QWEN3_0_6B, ToyAdapter, ToyDecoder  # noqa: E402

m = ToyDecoder(QWEN3_0_6B, kv_slots=FIRST_REAL_SLOT + 24_000, device="cuda")
dev = torch.device("cuda", torch.cuda.current_device())
MiB = 2**20


def state(tag):
    free = free_device_bytes(dev)
    print(f"{tag}: free {free / MiB:.1f} MiB, reserved {torch.cuda.memory_reserved() / MiB:.1f} MiB, "
          f"segments {len(torch.cuda.memory_snapshot())}", flush=True)
    return free


def good():
    r = PrefillGraphRunner(plugin_manager(ToyAdapter(m)), BcgConfig(enable=True, sizes=(64, 256)), chunk_size=TOP)
    r.capture(progress=False)
    assert r.captured
    r.close()


good()
f0 = state("after one good capture+close")
for i in range(3):
    r = PrefillGraphRunner(plugin_manager(_UnjoinedStreamAdapter(m)), BcgConfig(enable=True, sizes=(64, 256)),
                           chunk_size=TOP)
    r.capture(progress=False)
    print(f"failed capture {i}: captured={r.captured} stats={r.stats.summary() if hasattr(r.stats, 'summary') else ''}")
    r.close()
    f = state(f"after failed capture {i} + close")
    print(f"  left behind vs baseline: {(f0 - f) / MiB:.1f} MiB")
good()
f = state("after another good capture+close")
print(f"  left behind vs baseline: {(f0 - f) / MiB:.1f} MiB")
x = torch.empty(1024 * MiB, dtype=torch.uint8, device=dev)
del x
f2 = state("after a 1 GiB tensor freed + empty_cache")
print(f"  global empty_cache returned the 1 GiB: {(f - f2) / MiB:.1f} MiB still held (0 = yes)")
