"""The file barrier that moves data-parallel engine processes in step."""

import threading
import time

import pytest

from bcg_bench.ranks import FileBarrier


def test_each_step_waits_for_every_rank(tmp_path):
    size, steps = 3, 5
    log, lock = [], threading.Lock()

    def rank_loop(rank):
        barrier = FileBarrier(tmp_path, rank, size, timeout_s=10)
        for step in range(steps):
            time.sleep(0.002 * rank)  # ranks arrive at different times
            barrier.wait()
            with lock:
                log.append((step, rank))

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert len(log) == size * steps
    # No rank finishes step k+1 before every rank has passed step k's barrier.
    order = [step for step, _ in log]
    assert order == sorted(order), order


def test_a_missing_rank_is_named_after_the_timeout(tmp_path):
    barrier = FileBarrier(tmp_path, 0, 2, timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"rank 0: ranks \[1\] did not reach step 1"):
        barrier.wait()


def test_rank_outside_the_group_is_refused(tmp_path):
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        FileBarrier(tmp_path, 2, 2)
