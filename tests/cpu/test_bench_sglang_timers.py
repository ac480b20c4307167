"""The SGLang bench's timers (bcg_bench.sglang_timers) against the real sglang 0.5.17 package, on CPU.

Anything that installs hooks runs in a fresh interpreter, as SGLang's spawned schedulers do, so this
process stays unpatched.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import time
import types

import pytest
import torch

pytest.importorskip("sglang")

from bcg_bench import sglang_timers  # noqa: E402
from bcg_plugin import BcgConfig  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.fixture(autouse=True)
def _no_bcg_counters(monkeypatch):
    """Each test starts as a scheduler process whose capture is not recorded yet."""
    monkeypatch.setattr(sglang_timers, "_BCG_STATS", {})


@pytest.mark.parametrize("mode, extend_in_batch, recorded", [
    ("EXTEND", False, True),
    ("IDLE", True, True),  # an idle DP rank padded to the other rank's extend replays too
    ("IDLE", False, False),
    ("DECODE", False, False),
])
@pytest.mark.usefixtures("fake_cuda_events")
def test_forward_records_cover_an_idle_dp_rank_during_extends(monkeypatch, tmp_path, mode, extend_in_batch, recorded):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from bcg_bench.sglang_mode import step_tokens

    path = tmp_path / "forwards.jsonl"
    monkeypatch.setenv(sglang_timers.RECORD_ENV, str(path))
    fb = types.SimpleNamespace(forward_mode=getattr(ForwardMode, mode), is_extend_in_batch=extend_in_batch,
                               input_ids=[] if mode == "IDLE" else [1, 2, 3], global_num_tokens_cpu=[0, 3],
                               batch_size=0 if mode == "IDLE" else 2)
    out = sglang_timers.around_forward(lambda self, batch: types.SimpleNamespace(can_run_graph=True), None, fb)
    assert out.can_run_graph
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    assert len(records) == int(recorded)
    if recorded:
        assert records[0]["across_dp"] == [0, 3] and step_tokens(records[0]) == 3
        assert records[0]["requests"] == (0 if mode == "IDLE" else 2)


@pytest.mark.usefixtures("fake_cuda_events")
def test_forward_records_name_the_graph_variant_bcg_replayed_in(monkeypatch, tmp_path):
    import collections

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    path = tmp_path / "forwards.jsonl"
    monkeypatch.setenv(sglang_timers.RECORD_ENV, str(path))
    fb = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, input_ids=[1, 2, 3], global_num_tokens_cpu=None,
                               batch_size=1)
    stats = types.SimpleNamespace(replays_by_variant=collections.Counter({"fresh": 4}), pool_bytes=0, graph_bytes=0,
                                  capture_seconds=0.0, warmup_seconds=0.0, buckets_captured=1)
    core = types.SimpleNamespace(stats=stats, graph_attention=frozenset({16}), graph_variants={16: ("fresh",)},
                                 config=BcgConfig(enable=True))
    sglang_timers.after_capture_prefill_graph(types.SimpleNamespace(
        runner=type("BcgPrefillRunner", (), {"core": core, "host": types.SimpleNamespace(stored_in_graph=set())})()))

    def replay(variant):
        def forward(self, batch):
            if variant is not None:
                stats.replays_by_variant[variant] += 1
            return types.SimpleNamespace(can_run_graph=True)
        return forward

    sglang_timers.around_forward(replay("fresh"), None, fb)
    sglang_timers.around_forward(replay(None), None, fb)
    forwards = [json.loads(line) for line in path.read_text().splitlines() if '"forward"' in line]
    assert [f["variant"] for f in forwards] == ["fresh", None]


@pytest.mark.parametrize("mode, recorded", [("EXTEND", True), ("MIXED", True), ("DECODE", False),
                                            ("TARGET_VERIFY", False)])
def test_step_records_cover_extend_steps_to_their_sampled_tokens(monkeypatch, tmp_path, mode, recorded):
    """The worker's step around the forward: timed to the end of its device work (the stream is
    synchronised), recorded for extend steps only, with the step's new tokens."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    synced = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda: types.SimpleNamespace(synchronize=lambda: synced.append(True)))
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(sglang_timers.RECORD_ENV, str(path))
    batch = types.SimpleNamespace(forward_mode=getattr(ForwardMode, mode), extend_num_tokens=37)
    assert sglang_timers.around_step(lambda self, b, **kw: ("result", kw), None, batch, pp_proxy_tensors=None) == (
        "result", {"pp_proxy_tensors": None})
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    assert [(r["kind"], r["tokens"], r["rank"]) for r in records] == ([("step", 37, 0)] if recorded else [])
    assert all(r["t0"] <= r["t1"] and r["ms"] == pytest.approx((r["t1"] - r["t0"]) * 1e3) for r in records)
    assert synced == ([True] if recorded else [])
    # A worker called with a prepared ForwardBatch and no ScheduleBatch (speculative verify) passes
    # through, as does a step without a record file.
    assert sglang_timers.around_step(lambda self, b, **kw: "verify", None, None, forward_batch="fb") == "verify"
    monkeypatch.delenv(sglang_timers.RECORD_ENV)
    assert sglang_timers.around_step(lambda self, b: "plain", None, batch) == "plain"
    assert len(path.read_text().splitlines() if path.exists() else []) == int(recorded)


def _request(tokens: int, finished: bool, queued: float, sent_before: bool = False):
    from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

    stats = SchedulerReqTimeStats()  # SGLang's own: the stamp must be the one it keeps
    stats.wait_queue_entry_time = queued
    return types.SimpleNamespace(origin_input_ids=[1] * tokens, finished=lambda: finished, time_stats=stats,
                                 finished_output=sent_before)


def _stream_output(self, reqs, return_logprob, skip_req=None):
    """What SGLang's ``stream_output`` does to the flag the timer reads: a finished request's final
    output is sent once, then marked, and skipped in later calls."""
    for req in reqs:
        if req is not skip_req and req.finished() and not req.finished_output:
            req.finished_output = True
    return "streamed"


def test_output_records_stamp_each_request_whose_final_output_the_call_sent(monkeypatch, tmp_path):
    path = tmp_path / "out.jsonl"
    monkeypatch.setenv(sglang_timers.RECORD_ENV, str(path))
    done, running, skipped = _request(16, True, 1.5), _request(64, False, 2.0), _request(32, True, 3.0)
    sent_earlier = _request(48, True, 0.5, sent_before=True)  # the overlap scheduler streams it again
    before = time.perf_counter()
    assert sglang_timers.around_stream_output(_stream_output, None, [done, running, skipped, sent_earlier],
                                              False, skipped) == "streamed"
    # The next call sees ``done`` again (already sent) and ``skipped`` by keyword: nothing new.
    sglang_timers.around_stream_output(_stream_output, None, [done, skipped], False, skip_req=skipped)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["kind"], r["tokens"], r["queued"]) for r in records] == [("request", 16, 1.5)]
    assert before <= records[0]["sent"] <= time.perf_counter()
    monkeypatch.delenv(sglang_timers.RECORD_ENV)
    assert sglang_timers.around_stream_output(_stream_output, None, [skipped], False) == "streamed"
    assert len(path.read_text().splitlines()) == 1


@pytest.mark.usefixtures("fake_cuda_events")
def test_without_a_record_file_the_forward_passes_through_unrecorded(monkeypatch, tmp_path):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    monkeypatch.delenv(sglang_timers.RECORD_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    fb = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, input_ids=[1, 2, 3])
    assert sglang_timers.around_forward(lambda self, batch: "out", None, fb) == "out"
    assert sglang_timers.after_capture_prefill_graph(types.SimpleNamespace(runner=None)) is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("fake_cuda_events")
def test_an_armed_scheduler_profiles_one_forward_and_records_it(monkeypatch, tmp_path):
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from bcg_bench.profile import PROFILE_TOKENS_ENV

    path = tmp_path / "forwards.jsonl"
    monkeypatch.setenv(sglang_timers.RECORD_ENV, str(path))
    monkeypatch.setenv(PROFILE_TOKENS_ENV, "3")
    fb = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, is_extend_in_batch=True, input_ids=[1, 2, 3],
                               global_num_tokens_cpu=None)

    def forward(self, batch):
        torch.ones(3, 8).mul(2)
        return types.SimpleNamespace(can_run_graph=True)

    def kinds() -> list[str]:
        return [json.loads(line)["kind"] for line in path.read_text().splitlines()]

    sglang_timers.around_forward(forward, None, fb)
    assert kinds() == ["forward"]  # not armed yet: a timed request
    (tmp_path / "forwards.jsonl.profile-armed").touch()
    assert sglang_timers.profile_arm_path(str(path)) == str(tmp_path / "forwards.jsonl.profile-armed")
    sglang_timers.around_forward(forward, None, fb)
    sglang_timers.around_forward(forward, None, fb)
    assert kinds() == ["forward", "host_profile", "forward", "forward"]  # once
    profiled = json.loads(path.read_text().splitlines()[1])
    assert profiled["tokens"] == 3 and profiled["rank"] == 0 and profiled["aten_ops"] >= 2


def test_the_capture_record_names_the_runner_and_bcgs_figures(monkeypatch, tmp_path):
    path = tmp_path / "forwards.jsonl"
    monkeypatch.setenv(sglang_timers.RECORD_ENV, str(path))
    stats = types.SimpleNamespace(pool_bytes=2**30, graph_bytes=2**29, capture_seconds=1.5, warmup_seconds=0.5,
                                  buckets_captured=56)
    core = types.SimpleNamespace(stats=stats, graph_attention=frozenset({64, 16}), graph_variants={16: ("fresh",)},
                                 config=BcgConfig(enable=True, max_tokens=64, warmup="first_bucket"))
    host = types.SimpleNamespace(stored_in_graph={0, 1, 2})
    bcg = types.SimpleNamespace(runner=type("BcgPrefillRunner", (), {"core": core, "host": host})(),
                                memory_usage_gb=0.75, capture_time=2.0)
    native = types.SimpleNamespace(runner=type("PrefillCudaGraphRunner", (), {})(), memory_usage_gb=0.25,
                                   capture_time=1.0)
    sglang_timers.after_capture_prefill_graph(bcg)
    sglang_timers.after_capture_prefill_graph(native)
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first == {"kind": "capture", "rank": 0, "runner": "BcgPrefillRunner", "memory_gib": 0.75, "seconds": 2.0,
                     "bcg_pool_gib": 1.0, "bcg_graph_gib": 0.5, "bcg_capture_s": 1.5, "bcg_warmup_s": 0.5,
                     "bcg_config": BcgConfig(enable=True, max_tokens=64, warmup="first_bucket").to_dict(),
                     "bcg_buckets": 56, "bcg_graph_attention_buckets": [16, 64],
                     "bcg_graph_variants": {"16": ["fresh"]}, "bcg_store_in_graph_layers": 3,
                     "weight_bytes": None, "vocab_weight_bytes": None,  # no model runner: no weights
                     "copy_bandwidth_gbs": None}
    assert second["runner"] == "PrefillCudaGraphRunner" and second["bcg_pool_gib"] is second["bcg_buckets"] is None


def _tiny_model(tied: bool):
    """An embedding (10 x 4), one 4 x 4 layer and an LM head of SGLang's vocabulary-parallel type
    (built without a TP group), all float32; ``tied``: the head shares the embedding's weight."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.layer = torch.nn.Linear(4, 4, bias=False)
    model.lm_head = ParallelLMHead.__new__(ParallelLMHead)
    torch.nn.Module.__init__(model.lm_head)
    model.lm_head.weight = model.embed.weight if tied else torch.nn.Parameter(torch.zeros(10, 4))
    return model


@pytest.mark.parametrize("tied, total, vocab", [(False, 96 * 4, 40 * 4), (True, 56 * 4, 0)])
def test_the_capture_record_holds_the_weight_read_floors_figures(monkeypatch, tmp_path, tied, total, vocab):
    """The floor's numerator: every parameter once, the embedding table (of which the timed forward
    reads N rows) apart, but not SGLang's LM head, which its model forward reads whole for the last
    token's logits (a weight tied to the embedding is read whole too); its denominator: a device
    copy timed in the scheduler, after which the copy's memory goes back to the device. SGLang
    passes the model runner by name or by position."""
    path = tmp_path / "forwards.jsonl"
    monkeypatch.setenv(sglang_timers.RECORD_ENV, str(path))
    emptied = []
    monkeypatch.setattr(sglang_timers.weights, "copy_bandwidth_gbs", lambda: 3000.0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    runner = types.SimpleNamespace(model=_tiny_model(tied))
    sglang_timers.after_capture_prefill_graph(types.SimpleNamespace(runner=None), model_runner=runner, eager_runner=None)
    sglang_timers.after_capture_prefill_graph(types.SimpleNamespace(runner=None), runner, None)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["weight_bytes"], r["vocab_weight_bytes"], r["copy_bandwidth_gbs"]) for r in records] == [
        (total, vocab, 3000.0)] * 2
    assert emptied == [True, True]


@pytest.mark.parametrize("world, raises, expected", [(1, False, 3000.0), (2, False, None), (1, True, None)])
def test_the_copy_rate_is_timed_on_one_gpu_only_and_where_the_copy_fits(monkeypatch, world, raises, expected):
    """Across several GPUs a rank's share of the weights is no model's floor; a device without room
    for the copy records no rate rather than failing the engine's start."""
    def copy():
        if raises:
            raise torch.cuda.OutOfMemoryError("no room")
        return 3000.0

    monkeypatch.setattr(sglang_timers.weights, "copy_bandwidth_gbs", copy)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: world)
    assert sglang_timers._copy_bandwidth_gbs() == expected


class _FakeEngine:
    """An engine whose requests return at once."""

    def generate(self, input_ids, sampling_params):
        return {}

    def shutdown(self):
        pass


def _engine_that_captured(monkeypatch, captured, model=None) -> None:
    """Make the mode script's engine start run the capture hook once on ``captured`` (what SGLang's
    capture returned) with a runner holding ``model``, as a scheduler does, then serve instantly."""
    def start_engine(path, **kwargs):
        monkeypatch.setenv(sglang_timers.RECORD_ENV, str(path))
        sglang_timers.after_capture_prefill_graph(captured, model_runner=types.SimpleNamespace(model=model))
        return _FakeEngine()

    monkeypatch.setattr(sglang_timers, "start_engine", start_engine)


def test_a_one_gpu_mode_reports_the_weight_read_floor_and_a_multi_gpu_one_does_not(monkeypatch, tmp_path):
    """The capture record's weight bytes and copy rate reach a one-GPU mode's result; at tp > 1 a
    rank's share of the weights is no model's floor."""
    from bcg_bench import sglang_mode

    _engine_that_captured(monkeypatch, types.SimpleNamespace(runner=None), _tiny_model(False))
    monkeypatch.setattr(sglang_timers.weights, "copy_bandwidth_gbs", lambda: 3000.0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = sglang_mode.run("native", "qwen3-0.6b", [16], warmup=0, iters=1, seed=0)
    assert (result["weight_bytes"], result["vocab_weight_bytes"], result["copy_bandwidth_gbs"]) == (384, 160, 3000.0)
    result = sglang_mode.run("native", "qwen3-0.6b", [16], warmup=0, iters=1, seed=0, tp=2)
    assert "weight_bytes" not in result and "copy_bandwidth_gbs" not in result


def test_a_bcg_mode_reports_its_own_capture_seconds_and_bucket_count(monkeypatch, tmp_path):
    """The capture per bucket target divides bcg's capture seconds by the buckets its runner captured:
    both reach the mode's result from the scheduler's capture record."""
    from bcg_bench import sglang_mode

    captured = _capture_result("BcgPrefillRunner", 56)
    captured.runner.core.stats.capture_seconds = 2.5
    _engine_that_captured(monkeypatch, captured)
    for key in ("BCG_ATTENTION", "BCG_GRAPH_VARIANTS"):  # the mode process sets them for its schedulers
        monkeypatch.setenv(key, "")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = sglang_mode.run("bcg", "qwen3-0.6b", [16], warmup=0, iters=1, seed=0)
    assert (result["bcg_capture_s"], result["bcg_buckets"]) == (2.5, 56)


def _capture_result(runner: str, buckets: int | None, graph_attention=(), variants=None):
    """What SGLang's ``capture_prefill_graph`` returns: bcg's runner (its core's stats, the buckets
    keeping attention inside the graph and their variants) or SGLang's own."""
    stats = types.SimpleNamespace(pool_bytes=0, graph_bytes=0, capture_seconds=0.0, warmup_seconds=0.0,
                                  buckets_captured=buckets)
    core = types.SimpleNamespace(stats=stats, graph_attention=frozenset(graph_attention), graph_variants=variants or {},
                                 config=BcgConfig(enable=True))
    attrs = {} if buckets is None else {"core": core, "host": types.SimpleNamespace(stored_in_graph=set())}
    return types.SimpleNamespace(runner=type(runner, (), attrs)(), memory_usage_gb=0.0, capture_time=0.0)


@pytest.mark.parametrize("mode, captured, problem", [
    ("bcg", [("BcgPrefillRunner", 56)], None),
    ("bcg", [], "no scheduler recorded a prefill-graph capture"),
    ("bcg", [("PrefillCudaGraphRunner", None)], r"SGLang's own prefill runner \(PrefillCudaGraphRunner\) was built"),
    ("bcg", [("BcgPrefillRunner", 0)], "bcg's runner captured no bucket"),
    ("bcg", [("BcgPrefillRunner", 56), ("PrefillCudaGraphRunner", None)], "own prefill runner"),  # one rank of two
    ("native", [("PrefillCudaGraphRunner", None)], None),
    ("bcg_break", [("BcgPrefillRunner", 56)], None),
    ("bcg_break", [("BcgPrefillRunner", 56, [16, 32])], "some buckets kept attention inside the graph"),
    ("bcg_graph", [("BcgPrefillRunner", 56, [16, 32])], None),
    ("bcg_graph", [("BcgPrefillRunner", 56)], "every bucket kept attention an eager break"),
    ("bcg", [("BcgPrefillRunner", 56, [16, 32], {16: ("fresh",), 32: ("fresh",)})], None),
    ("bcg_one_graph", [("BcgPrefillRunner", 56, [16, 32])], None),
    ("bcg_one_graph", [("BcgPrefillRunner", 56, [16, 32], {16: ("fresh",)})], "captured as a variant too"),
])
def test_a_bcg_mode_in_which_bcg_captured_nothing_fails_instead_of_reporting_sglang(monkeypatch, tmp_path, mode,
                                                                                     captured, problem):
    """The schedulers' capture records (the bench's own hook on SGLang's capture) say whether bcg's
    runner serves prefill; without it the bcg mode would time SGLang alone and call it bcg."""
    from bcg_bench import sglang_mode

    shut = []

    class FakeEngine:
        def generate(self, input_ids, sampling_params):
            return {}

        def shutdown(self):
            shut.append(True)

    attention, variants = [], []

    def start_engine(record, **kwargs):
        attention.append(os.environ.get("BCG_ATTENTION"))  # what the schedulers would inherit
        variants.append(os.environ.get("BCG_GRAPH_VARIANTS"))
        monkeypatch.setenv(sglang_timers.RECORD_ENV, str(record))  # as in each scheduler
        for runner, *figures in captured:
            sglang_timers.after_capture_prefill_graph(_capture_result(runner, *figures))
        return FakeEngine()

    monkeypatch.setattr(sglang_timers, "start_engine", start_engine)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("BCG_ATTENTION", "break")  # restored after the test; a bcg mode sets its own
    monkeypatch.setenv("BCG_GRAPH_VARIANTS", "maybe")
    if problem is None:
        assert sglang_mode.run(mode, "qwen3-0.6b", [16], warmup=0, iters=1, seed=0)["mode"] == mode
    else:
        with pytest.raises(SystemExit, match=f"bench {mode}: on rank 0 .*{problem}|bench {mode}: {problem}"):
            sglang_mode.run(mode, "qwen3-0.6b", [16], warmup=0, iters=1, seed=0)
    assert shut == [True]  # the engine ends either way
    assert attention == [{"bcg": "auto", "bcg_graph": "graph", "bcg_one_graph": "auto"}.get(mode, "break")]
    assert variants == [{"bcg_one_graph": "0", "native": "maybe"}.get(mode, "1")]
    assert not list(tmp_path.glob("bcg-sglang-bench-*"))  # nor does the schedulers' record folder outlive it


def test_a_mode_reports_the_median_step_per_size_of_the_ranks_that_ran_it(monkeypatch, tmp_path):
    """Under DP attention each request's step is recorded by the rank that served it (rank 1 here
    for the second); the warm-up request's step is left out with its forward."""
    from bcg_bench import sglang_mode

    record = {}
    steps = iter([(0, 5.0), (0, 9.0), (1, 6.0), (0, 7.0)])  # (serving rank, step ms) per request

    class FakeEngine:
        def generate(self, input_ids, sampling_params):  # what the schedulers append while serving it
            n = len(input_ids)
            rank, wall = next(steps)
            sglang_timers.append_record(record["path"], {"kind": "forward", "tokens": n, "ms": 1.0,
                                                         "host_ms": 0.5, "rank": rank, "across_dp": None})
            sglang_timers.append_record(record["path"], {"kind": "step", "tokens": n, "ms": wall, "rank": rank})
            return {}

        def shutdown(self):
            pass

    def start_engine(path, **kwargs):
        record["path"] = str(path)
        return FakeEngine()

    monkeypatch.setattr(sglang_timers, "start_engine", start_engine)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = sglang_mode.run("native", "qwen3-0.6b", [16], warmup=1, iters=3, seed=0)
    assert result["step_ms"] == {"16": 7.0}  # 9, 6 and 7: not the warm-up's 5


def test_request_phases_split_each_request_at_its_own_stamps():
    """Two 16-token requests and two of 64: each phase runs between two stamps, the phases and the
    step add up to the request's time, and the second 64-token request, whose step record is
    missing (a 16-token step lies in its window), adds nothing rather than a wrong split."""
    from bcg_bench.sglang_mode import PHASES, request_phases

    windows = [(16, 0.000, 0.010), (16, 0.020, 0.032), (64, 0.040, 0.050), (64, 0.060, 0.070)]
    served = [{"tokens": 16, "queued": 0.001, "sent": 0.008}, {"tokens": 16, "queued": 0.022, "sent": 0.030},
              {"tokens": 64, "queued": 0.042, "sent": 0.049}, {"tokens": 64, "queued": 0.061, "sent": 0.069}]
    steps = [{"tokens": 16, "t0": 0.002, "t1": 0.006}, {"tokens": 16, "t0": 0.024, "t1": 0.028},
             {"tokens": 64, "t0": 0.043, "t1": 0.047}, {"tokens": 16, "t0": 0.062, "t1": 0.066}]
    phases = request_phases(windows, served, steps)
    assert set(phases) == {*PHASES, "phase_requests"}
    expect = {"queue_ms": {"16": 1.5, "64": 2.0}, "schedule_ms": {"16": 1.5, "64": 1.0},
              "result_ms": {"16": 2.0, "64": 2.0}, "return_ms": {"16": 2.0, "64": 1.0}}
    assert {k: phases[k] for k in PHASES} == {k: {n: pytest.approx(v) for n, v in by_n.items()}
                                              for k, by_n in expect.items()}
    assert phases["phase_requests"] == {"16": 2, "64": 1}
    # The third request: its phases and its 4 ms step make up its 10 ms.
    assert sum(phases[k]["64"] for k in PHASES) + 4.0 == pytest.approx(10.0)
    assert request_phases(windows, [], steps) == {**{k: {} for k in PHASES}, "phase_requests": {}}


def test_request_phases_take_one_tensor_parallel_rank_and_its_own_step():
    """Every rank of a TP group records the request and the step; only the first rank sends. A
    request is split at one rank's stamps, the lowest, never at one rank's output and another's step."""
    from bcg_bench.sglang_mode import request_phases

    windows = [(16, 0.000, 0.010)]
    served = [{"tokens": 16, "queued": 0.0015, "sent": 0.0085, "rank": 1},
              {"tokens": 16, "queued": 0.001, "sent": 0.008, "rank": 0}]
    steps = [{"tokens": 16, "t0": 0.0025, "t1": 0.0075, "rank": 1}, {"tokens": 16, "t0": 0.002, "t1": 0.006, "rank": 0}]
    phases = request_phases(windows, served, steps)
    assert (phases["schedule_ms"]["16"], phases["result_ms"]["16"]) == (pytest.approx(1.0), pytest.approx(2.0))
    # Rank 0's step missing: rank 1's own stamps, not rank 1's output with rank 0's step.
    phases = request_phases(windows, served, steps[:1])
    assert (phases["schedule_ms"]["16"], phases["result_ms"]["16"]) == (pytest.approx(1.0), pytest.approx(1.0))


# -- how the timers reach the schedulers --------------------------------------------------------------


def test_the_engine_runs_the_benchs_scheduler_function_which_spawn_pickles_by_reference():
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.data_parallel_controller import run_data_parallel_controller_process

    engine = sglang_timers.engine_class()
    assert issubclass(engine, Engine) and engine.run_scheduler_process_func is sglang_timers.run_scheduler_process
    # The spawned child imports this module by name to find the function: nothing else travels.
    assert pickle.loads(pickle.dumps(engine.run_scheduler_process_func)) is sglang_timers.run_scheduler_process
    # SGLang's own path to the schedulers under DP attention: its controller takes the function too.
    assert "run_scheduler_process_func" in inspect.signature(run_data_parallel_controller_process).parameters


def test_the_record_file_is_named_while_the_engine_starts_and_not_after(monkeypatch, tmp_path):
    seen = {}

    class FakeEngine:
        def __init__(self, **kwargs):
            seen.update(kwargs, record=os.environ.get(sglang_timers.RECORD_ENV))

    monkeypatch.setattr(sglang_timers, "engine_class", lambda: FakeEngine)
    monkeypatch.setenv(sglang_timers.RECORD_ENV, "earlier")
    sglang_timers.start_engine(tmp_path / "r.jsonl", model_path="m")
    assert seen == {"model_path": "m", "record": str(tmp_path / "r.jsonl")}
    assert os.environ[sglang_timers.RECORD_ENV] == "earlier"


SCHEDULER = textwrap.dedent(
    """
    import json, sys
    from sglang.srt.managers import scheduler
    from sglang.srt.model_executor.model_runner import ModelRunner
    from bcg_plugin.patches.sglang import capture_prefill_graph

    seen = {}

    def probe(*args, **kwargs):  # stands in for SGLang's scheduler, which runs next
        from bcg_plugin.adapters import sglang as adapter
        timers = sys.modules.get("bcg_bench.sglang_timers")  # its hooks cannot be in place unless it was imported
        seen.update(args=list(args), active=adapter.is_active(), bench_imported="bcg_bench" in sys.modules,
                    timers=sorted(p.target for p in timers.TIMERS if timers.is_installed(p)) if timers else [],
                    bcg_capture=capture_prefill_graph.PATCH.in_place())

    scheduler.run_scheduler_process = probe
    if sys.argv[1] == "timed":
        from bcg_bench import sglang_timers
        sglang_timers.run_scheduler_process("server_args", "port_args")
    else:  # a plain engine's scheduler: SGLang loads its plugins, bcg's among them
        from sglang.srt.plugins import load_plugins
        load_plugins()
        probe()
    seen["forward_wrapped"] = hasattr(ModelRunner.forward, "__wrapped__")
    print("SCENARIO " + json.dumps(seen))
    """
)


def run_scheduler(kind: str, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BCG_")}
    env.update(BCG_ENABLE="1", PYTHONWARNINGS="ignore", **{sglang_timers.RECORD_ENV: str(tmp_path / "r.jsonl")})
    proc = subprocess.run([sys.executable, "-c", SCHEDULER, kind], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SCENARIO ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("SCENARIO "):])


def test_a_bench_scheduler_has_the_timers_and_bcg_both_on_the_capture_it_shares(tmp_path):
    """The timers are registered before SGLang loads its plugins, so bcg's hook on the same target
    goes into the same chain: bcg stays active and the capture is timed."""
    seen = run_scheduler("timed", tmp_path)
    assert seen["args"] == ["server_args", "port_args"]  # SGLang's scheduler runs, with its arguments
    assert seen["timers"] == sorted([sglang_timers.FORWARD_TARGET, sglang_timers.STEP_TARGET,
                                     sglang_timers.OUTPUT_TARGET, sglang_timers.CAPTURE_TARGET])
    assert seen["bcg_capture"] and seen["active"]


def test_the_plugin_installs_no_bench_timer_even_with_a_record_file_named(tmp_path):
    seen = run_scheduler("plain", tmp_path)
    assert seen["active"] and seen["bcg_capture"]  # bcg itself is in place
    assert seen["timers"] == [] and not seen["forward_wrapped"] and not seen["bench_imported"]
