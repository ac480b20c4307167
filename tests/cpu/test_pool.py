"""GraphPool's references to its pool: the calls it makes to torch's allocator, in order.

On a device a reference too few frees the pool under live graphs (an allocator assert at the next
capture), and one too many keeps a closed runner's memory for the life of the process.
"""

from __future__ import annotations

import pytest
import torch

from bcg_plugin import pool as pool_mod

HANDLE = (0, 7)


@pytest.fixture
def calls(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: HANDLE)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name, what in [("_begin_routing", "begin"), ("_end_routing", "end"), ("_release", "release")]:
        monkeypatch.setattr(pool_mod, name, lambda device, handle, what=what: seen.append(f"{what} {device} {handle}"))
    return seen


def _references(calls: list[str]) -> int:
    return sum(1 if c.startswith("begin") else -1 if c.startswith("release") else 0 for c in calls)


def test_the_first_allocating_block_keeps_one_reference_until_release(calls):
    pool = pool_mod.GraphPool()
    with pool.allocating():
        assert calls == [f"begin 0 {HANDLE}"]
    with pool.allocating():
        pass
    assert calls == [f"begin 0 {HANDLE}", f"end 0 {HANDLE}", f"begin 0 {HANDLE}", f"end 0 {HANDLE}",
                     f"release 0 {HANDLE}"]
    assert _references(calls) == 1  # the pool stays alive between capture setup and the graphs' captures
    pool.release()
    pool.release()  # close() after a failed capture may come twice: one release only
    assert _references(calls) == 0 and calls[-1] == f"release 0 {HANDLE}"


def test_routing_ends_when_the_block_raises(calls):
    pool = pool_mod.GraphPool()
    with pytest.raises(RuntimeError, match="out of memory"):
        with pool.allocating():
            raise RuntimeError("out of memory")
    assert calls == [f"begin 0 {HANDLE}", f"end 0 {HANDLE}"]
    pool.release()
    assert _references(calls) == 0


def test_a_pool_never_routed_into_releases_nothing(calls):
    pool_mod.GraphPool().release()
    assert calls == []


def test_without_torchs_routing_calls_allocations_stay_where_they_were(calls, monkeypatch):
    monkeypatch.setattr(pool_mod, "_begin_routing", None)
    pool = pool_mod.GraphPool()
    with pool.allocating():
        pass
    pool.release()
    assert calls == []


@pytest.mark.parametrize("lingering", [0, 1, 2])
def test_a_failed_captures_lingering_routings_are_ended_and_their_references_dropped(calls, monkeypatch, lingering):
    # Each capture that failed in cudaStreamEndCapture left one routing open and one reference held.
    open_routings = [lingering]

    def end(device, handle):
        if not open_routings[0]:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        open_routings[0] -= 1
        calls.append(f"end {device} {handle}")

    monkeypatch.setattr(pool_mod, "_end_routing", end)
    pool = pool_mod.GraphPool()
    pool.end_failed_capture()
    assert open_routings == [0]
    assert calls == [f"end 0 {HANDLE}", f"release 0 {HANDLE}"] * lingering
