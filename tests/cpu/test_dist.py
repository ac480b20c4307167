"""Rank agreement over a real 2-process gloo group: every rank makes the same replay decision."""

import os
import queue
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from capture_fakes import FakePool, script_captures

from bcg_plugin import BcgConfig, Fallback, PrefillGraphRunner, hookimpl, plugin_manager
from bcg_plugin.dist import CaptureStatus, agree_capture_status, dp_bucket
from bcg_plugin.errors import BcgCaptureError

LADDER = [16, 32, 64, 128]
RESULT_TIMEOUT_S = 300  # from start to every rank's result: spawn, gloo rendezvous and the test's collectives
EXIT_TIMEOUT_S = 60  # a rank that reported is gone after a flush and os._exit


def _run(world, fn, tmp_path, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, str(tmp_path / "rdv"), fn, q, args)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        exited_early = False  # a rank is gone without a result seen yet: one more look at the queue, then fail
        while len(results) < world:
            try:
                rank, value = q.get(timeout=1)
            except queue.Empty:
                died = {r: p.exitcode for r, p in enumerate(procs) if r not in results and p.exitcode is not None}
                assert not (died and exited_early), f"ranks exited without reporting a result (rank: exit code): {died}"
                exited_early = bool(died)
                assert time.monotonic() < deadline, f"no result from ranks {sorted(set(range(world)) - set(results))}"
                continue
            results[rank] = value
        for p in procs:
            p.join(timeout=EXIT_TIMEOUT_S)
    finally:
        for p in procs:  # only after a failure above: a rank stuck in a collective
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, v in results.items() if isinstance(v, str) and v.startswith("ERROR")}
    assert not errors, errors
    assert [p.exitcode for p in procs] == [0] * world
    return [results[r] for r in range(world)]


def _worker(rank, world, rdv, fn, q, args):
    try:
        dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)
        result = fn(rank, *args)
        dist.barrier()  # no peer is still inside a collective with this rank when it exits
    except Exception as e:  # reported to the parent, which fails the test
        result = f"ERROR {e!r}"
    q.put((rank, result))
    q.close()
    q.join_thread()  # the result is in the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    # Out without tearing gloo down: its teardown can abort the process ("terminate called without
    # an active exception", seen on a loaded two-core machine) after the result is delivered.
    os._exit(0)


def _capture_vote(rank, failing_rank):
    local = CaptureStatus.FAILED if rank == failing_rank else CaptureStatus.OK
    return int(agree_capture_status(local, dist.group.WORLD))


def _oom_vote(rank):
    local = CaptureStatus.OOM if rank == 1 else CaptureStatus.OK
    return int(agree_capture_status(local, dist.group.WORLD))


def _fails_on_rank_1(rank, how):
    if rank == 1 and how == "raises":
        raise RuntimeError("injected")
    if rank == 1 and how == "dies":
        os._exit(3)  # gone without a word, as an aborted process
    return rank


@pytest.mark.parametrize("how, reported", [("raises", "ERROR RuntimeError"), ("dies", "exited without reporting")])
def test_a_rank_that_fails_or_dies_fails_the_run(tmp_path, how, reported):
    with pytest.raises(AssertionError, match=reported):
        _run(2, _fails_on_rank_1, tmp_path, how)


@pytest.mark.parametrize("failing_rank", [0, 1, None])
def test_capture_vote_is_unanimous(tmp_path, failing_rank):
    votes = _run(2, _capture_vote, tmp_path, failing_rank)
    expected = CaptureStatus.OK if failing_rank is None else CaptureStatus.FAILED
    assert votes == [expected, expected]


def test_oom_on_one_rank_is_oom_everywhere(tmp_path):
    assert _run(2, _oom_vote, tmp_path) == [CaptureStatus.OOM, CaptureStatus.OOM]


class _InjectedFailure:
    """An adapter whose capture fails on one rank only."""

    def __init__(self, rank, failing_rank):
        self.rank, self.failing_rank = rank, failing_rank

    @hookimpl
    def bcg_world_group(self):
        return dist.group.WORLD


def _runner_after_injected_failure(rank, failing_rank):
    runner = PrefillGraphRunner(
        plugin_manager(_InjectedFailure(rank, failing_rank)),
        BcgConfig(enable=True, sizes=(16, 32)), chunk_size=32, device="cpu",
    )

    def capture_all(buckets, progress):  # the healthy rank "captures" nothing CUDA-side; the other raises
        if rank == failing_rank:
            raise RuntimeError("injected capture failure")

    runner._capture_all = capture_all
    runner.capture(progress=False)
    return [runner.captured, runner.bucket_for(16), dict(runner.stats.fallbacks)]


def test_injected_failure_on_one_rank_leaves_every_rank_eager(tmp_path):
    results = _run(2, _runner_after_injected_failure, tmp_path, 1)
    for captured, bucket, fallbacks in results:
        assert captured is False and bucket is None
        assert fallbacks == {Fallback.CAPTURE_FAILED.value: 1}


class _FakeGraph:
    def __init__(self, log, bucket):
        self.log, self.bucket = log, bucket

    def release(self):
        self.log.append(("released", self.bucket))


def _capture_script(rank, failing_rank, fail_bucket, fail_when, error, config):
    """Run the real capture loop (setup vote, per-bucket votes) with a scripted setup and
    ``_capture_bucket``; return what happened.

    ``fail_when``: ``"always"``, ``"direct"`` (only a capture without a warm-up fails), ``"stage"``
    (the bucket's dummy batch fails, before its warm-up) or ``"setup"`` (the failing rank's setup
    raises before any bucket).
    """
    runner = PrefillGraphRunner(plugin_manager(_InjectedFailure(rank, failing_rank)),
                                BcgConfig(enable=True, sizes=(16, 32, 64), **config), chunk_size=64, device="cpu")
    log = []

    def capture_bucket(bucket, stream, *, warm=True, variant=None):
        log.append((bucket, warm))
        if rank == failing_rank and bucket == fail_bucket and (fail_when == "always" or not warm):
            raise error
        return _FakeGraph(log, bucket)

    def prepare_capture():  # no CUDA buffers, pool or stream
        if rank == failing_rank and fail_when == "setup":
            raise error
        runner._pool = FakePool()
        return None

    def stage_bucket(bucket, variant=None):
        if bucket == fail_bucket and fail_when == "stage":
            log.append(("staged", bucket))
            if rank == failing_rank:
                raise error
        return variant

    runner._prepare_capture = prepare_capture
    script_captures(runner, capture_bucket)
    runner._stage_bucket = stage_bucket
    try:
        runner.capture(progress=False)
        outcome = "captured" if runner.captured else "eager"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    return [outcome, log]


def test_failure_on_one_rank_stops_every_rank_at_that_bucket(tmp_path):
    # Rank 1 fails bucket 32; rank 0 must not go on to warm up bucket 16 (its collectives would hang).
    results = _run(2, _capture_script, tmp_path, 1, 32, "always", RuntimeError("injected"), {})
    expected_log = [(64, True), (32, True), ("released", 32), ("released", 64)]
    assert results[0] == ["eager", expected_log]
    assert results[1] == ["eager", [(64, True), (32, True), ("released", 64)]]


@pytest.mark.parametrize("warmup", ["every_bucket", "first_bucket"])
@pytest.mark.parametrize("error", [RuntimeError("plan failed"), torch.OutOfMemoryError("block table")])
def test_a_dummy_batch_failing_on_one_rank_stops_every_rank_before_that_buckets_warm_up(tmp_path, error, warmup):
    # Rank 1's dummy batch for bucket 32 (its attention plan allocates) fails: rank 0 must not start
    # bucket 32's warm-up, whose collectives rank 1 would never join; nor is the bucket retried after a
    # warm-up, which cannot mend a dummy batch.
    results = _run(2, _capture_script, tmp_path, 1, 32, "stage", error, {"warmup": warmup})
    for outcome, log in results:
        assert [entry for entry in log if entry[0] != "released"] == [(64, True), ("staged", 32)]
    expected = "BcgCaptureOOM" if isinstance(error, torch.OutOfMemoryError) else "eager"
    assert [outcome.split(":")[0] for outcome, _ in results] == [expected, expected]


def test_oom_on_one_rank_names_the_other_rank_everywhere_else(tmp_path):
    oom = torch.OutOfMemoryError("injected")
    results = _run(2, _capture_script, tmp_path, 1, 32, "always", oom, {})
    assert results[0][0].startswith("BcgCaptureOOM: out of memory on another rank")
    assert results[1][0].startswith("BcgCaptureOOM: out of memory on this rank")
    assert [b for b, *_ in results[0][1] if b != "released"] == [64, 32]  # nobody went on to bucket 16


def test_direct_capture_failing_on_one_rank_is_retried_after_a_warm_up_by_every_rank(tmp_path):
    results = _run(2, _capture_script, tmp_path, 1, 32, "direct", RuntimeError("lazy init"),
                   {"warmup": "first_bucket"})
    calls = [(64, True), (32, False), (32, True), (16, False)]
    assert results[0] == ["captured", calls[:2] + [("released", 32)] + calls[2:]]
    assert results[1] == ["captured", calls]


def test_setup_failing_on_one_rank_leaves_every_rank_eager_before_any_bucket(tmp_path):
    # Rank 0 must not start bucket 64's warm-up: its collectives would wait for rank 1 forever.
    results = _run(2, _capture_script, tmp_path, 1, None, "setup", RuntimeError("injected"), {})
    assert results == [["eager", []], ["eager", []]]


class _VariantHost(_InjectedFailure):
    """Attention inside the graph of buckets 16 and 32, each also captured as variant ``"fresh"``."""

    @hookimpl
    def bcg_graph_attention(self, buckets, attention):
        return [16, 32]

    @hookimpl
    def bcg_graph_variants(self, buckets):
        return {16: ["fresh"], 32: ["fresh"]}


def _variant_capture_script(rank, errors, fail_at, lost, warmup, direct_only=False):
    """The real capture loop with variants: the capture of ``fail_at`` (bucket, variant) raises
    ``errors[rank]`` on the ranks named there (``direct_only``: only without a warm-up); ``lost``:
    those failures leave the device unusable. Returns what happened."""
    runner = PrefillGraphRunner(plugin_manager(_VariantHost(rank, None)),
                                BcgConfig(enable=True, sizes=(16, 32, 64), graph_variants=True, warmup=warmup),
                                chunk_size=64, device="cpu")
    log = []

    def capture_bucket(bucket, stream, *, warm=True, variant=None):
        log.append((bucket, variant, warm))
        if rank in errors and (bucket, variant) == fail_at and not (direct_only and warm):
            raise errors[rank]
        return _FakeGraph(log, (bucket, variant))

    def prepare_capture():
        runner.graph_attention = runner._plan_attention()
        runner.graph_variants = runner._plan_variants()
        runner._pool = FakePool()

    def device_lost(error, during):
        return BcgCaptureError("device lost") if lost and rank in errors else None

    runner._prepare_capture, runner._device_lost = prepare_capture, device_lost
    script_captures(runner, capture_bucket)
    try:
        runner.capture(progress=False)
        outcome = "captured" if runner.captured else "eager"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    return [outcome, log, {str(b): list(v) for b, v in runner.graph_variants.items()}]


def test_a_variant_failing_on_one_rank_drops_the_variants_on_every_rank_and_both_go_on(tmp_path):
    results = _run(2, _variant_capture_script, tmp_path, {1: RuntimeError("injected")}, (32, "fresh"), False,
                   "every_bucket")
    captured = [(64, None, True), (32, None, True), (32, "fresh", True)]
    assert results[0] == ["captured", captured + [("released", (32, "fresh")), (16, None, True)], {}]
    assert results[1] == ["captured", captured + [(16, None, True)], {}]


@pytest.mark.parametrize("variant", ["fresh", None])
def test_a_capture_failure_that_loses_a_device_stops_every_rank_before_any_retry(tmp_path, variant):
    # bucket 16 and its variant are captured without a warm-up: a retry would run the warm-up's collectives
    results = _run(2, _variant_capture_script, tmp_path, {1: RuntimeError("injected")}, (16, variant), True,
                   "first_bucket")
    assert results[0][0] == "eager" and results[1][0] == "BcgCaptureError: device lost"
    for _, log, _ in results:
        assert (16, variant, False) in log and (16, variant, True) not in log


def test_a_variant_failing_without_a_warm_up_on_one_rank_is_retried_after_one_by_every_rank(tmp_path):
    results = _run(2, _variant_capture_script, tmp_path, {1: RuntimeError("lazy init")}, (16, "fresh"), False,
                   "first_bucket", True)
    for outcome, log, variants in results:
        assert outcome == "captured" and variants == {"16": ["fresh"], "32": ["fresh"]}
        assert [entry for entry in log if entry[:2] == (16, "fresh")] == [(16, "fresh", False), (16, "fresh", True)]


def test_a_variant_out_of_memory_on_one_rank_and_failing_otherwise_on_the_other_fails_the_boot_on_both(tmp_path):
    errors = {0: torch.OutOfMemoryError("injected"), 1: RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")}
    results = _run(2, _variant_capture_script, tmp_path, errors, (32, "fresh"), False, "every_bucket")
    assert results[0][0].startswith("BcgCaptureOOM: out of memory on this rank")
    assert results[1][0].startswith("BcgCaptureOOM: out of memory on another rank")


@pytest.mark.parametrize(
    "tokens, extend, expected",
    [
        ([10, 40], True, 64),  # bucket from the max over ranks: the same on every rank
        ([100, 3], True, 128),
        ([5, 17], True, 32),
        ([10, 40], False, None),  # an idle/decoding rank: nobody replays
        ([10, 500], True, None),  # one rank above the top bucket: nobody replays
        ([], True, None),
    ],
)
def test_dp_bucket_from_replicated_counts(tokens, extend, expected):
    assert dp_bucket(LADDER, tokens, extend) == expected
