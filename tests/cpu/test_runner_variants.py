"""Graph variants: a graph-attention bucket captured again from a capture batch the host plans
differently, and the variant the host names at replay is the one that runs."""

import types

import pytest
import torch
from capture_fakes import FakePool, script_captures

from bcg_plugin import BREAKING, BcgConfig, BcgStateError, HostBatch, PrefillGraphRunner, plugin_manager
from bcg_plugin.hookspecs import hookimpl
from bcg_plugin.runner import attention_summary

SIZES = (16, 32, 64)


class _Host:
    """Attention inside the graph in ``inside``; ``variants`` from bcg_graph_variants."""

    def __init__(self, inside=(16, 32), variants=None):
        self.inside, self.variants = list(inside), variants

    @hookimpl
    def bcg_graph_attention(self, buckets, attention):
        return self.inside

    @hookimpl
    def bcg_graph_variants(self, buckets):
        return self.variants

    @hookimpl
    def bcg_dummy_batch(self, num_tokens, graph_attention, variant):
        return HostBatch(num_tokens=num_tokens, inputs={})


class _NoVariantArg(_Host):
    @hookimpl
    def bcg_dummy_batch(self, num_tokens, graph_attention):
        return HostBatch(num_tokens=num_tokens, inputs={})


class _DefaultedVariantArg(_Host):
    @hookimpl
    def bcg_dummy_batch(self, num_tokens, graph_attention, variant=None):  # pluggy would never pass it
        return HostBatch(num_tokens=num_tokens, inputs={})


class _Graph:
    def __init__(self, log, key):
        self.log, self.key = log, key

    def replay(self, breaks_zero_padding=False):
        self.log.append(("replay", self.key))

    def release(self):
        self.log.append(("release", self.key))


def _runner(host, log, config=None, fails=None):
    """A runner over ``host`` whose captures are recorded in ``log``; the capture of ``fails``
    (``(bucket, variant)``) raises ``fails_with``."""
    config = config or BcgConfig(enable=True, sizes=SIZES, graph_variants=True)
    runner = PrefillGraphRunner(plugin_manager(host), config, chunk_size=max(config.sizes), device="cpu")

    def prepare():  # the setup's plans and pool, without static buffers or a stream off CUDA
        runner.graph_attention = runner._plan_attention()
        runner.graph_variants = runner._plan_variants()
        runner._pool = FakePool()

    def capture_bucket(bucket, stream, *, warm=True, variant=None):
        log.append(("capture", bucket, variant, warm))
        if fails is not None and (bucket, variant) == fails[0]:
            raise fails[1]
        return _Graph(log, (bucket, variant))

    runner._prepare_capture = prepare
    script_captures(runner, capture_bucket)
    return runner


def _replayable(runner):
    """The replay's landing and padded-row flags, which need the static buffers, stood in for."""
    runner._land = lambda batch, bucket: None
    runner._padded = types.SimpleNamespace(start=lambda bucket: bucket)
    runner._output = torch.zeros(64, 2)
    return runner


def test_each_variant_is_captured_after_its_bucket_and_warmed_up_the_first_time():
    log = []
    runner = _runner(_Host(variants={16: ["fresh"], 32: ["fresh"]}), log,
                     BcgConfig(enable=True, sizes=SIZES, warmup="first_bucket", graph_variants=True))
    runner.capture(progress=False)
    assert [entry[1:] for entry in log] == [
        (64, None, True),
        (32, None, True), (32, "fresh", True),  # the first bucket with attention inside, and of a variant,
        (16, None, False), (16, "fresh", False),  # runs its kernels eagerly first
    ]
    assert runner.graph_variants == {16: ("fresh",), 32: ("fresh",)}
    assert runner.stats.buckets_captured == 3 and runner.stats.variant_graphs == 2


@pytest.mark.parametrize("warmup", ["every_bucket", "first_bucket"])
def test_the_capture_summary_names_the_warmup_policy(warmup, caplog):
    runner = _runner(_Host(), [], BcgConfig(enable=True, sizes=SIZES, warmup=warmup))
    with caplog.at_level("INFO", logger="bcg_plugin"):
        runner.capture(progress=False)
    assert "captured 3 prefill buckets (16..64 tokens) in " in caplog.text and f"warmup: {warmup})" in caplog.text


def test_the_variant_named_at_replay_is_the_graph_that_runs():
    log = []
    runner = _replayable(_runner(_Host(variants={16: ["fresh"]}), log))
    runner.capture(progress=False)
    log.clear()
    runner.replay(16, HostBatch(num_tokens=9, inputs={}), "fresh")
    runner.replay(16, HostBatch(num_tokens=9, inputs={}))
    assert log == [("replay", (16, "fresh")), ("replay", (16, None))]
    assert runner.stats.replays_by_variant == {"fresh": 1} and runner.stats.replays_by_bucket[16] == 2
    with pytest.raises(BcgStateError, match="bucket 32 has no graph variant 'fresh'"):
        runner.replay(32, HostBatch(num_tokens=20, inputs={}), "fresh")


def test_where_attention_runs_follows_the_bucket_and_the_variant():
    """Inside only in a graph-attention bucket's own graph or non-breaking variant; any batch fits a
    bucket that breaks or has the breaking variant."""
    runner = _runner(_Host(inside=(16, 32), variants={16: [BREAKING], 32: ["fresh"]}), [])
    runner.capture(progress=False)
    inside = {(b, v): runner.attention_inside(b, v) for b in SIZES for v in (None, "fresh", BREAKING)}
    assert {key for key, yes in inside.items() if yes} == {(16, None), (16, "fresh"), (32, None), (32, "fresh")}
    assert [b for b in SIZES if runner.breaks_attention(b)] == [16, 64]


def test_close_releases_the_variants_with_their_buckets():
    log = []
    runner = _runner(_Host(variants={16: ["fresh", "other"]}), log)
    runner.capture(progress=False)
    log.clear()
    runner.close()
    assert sorted(str(key) for what, key in log if what == "release") == sorted(
        str(key) for key in [(64, None), (32, None), (16, None), (16, "fresh"), (16, "other")])
    assert runner.graph_variants == {} and not runner.captured


@pytest.mark.parametrize("variants, config", [
    (None, BcgConfig(enable=True, sizes=SIZES, graph_variants=True)),
    ({16: ["fresh"]}, BcgConfig(enable=True, sizes=SIZES, graph_variants=False)),  # the host names one
])
def test_without_variants_every_bucket_is_captured_once(variants, config):
    log = []
    runner = _runner(_Host(variants=variants), log, config)
    runner.capture(progress=False)
    assert [entry[2] for entry in log] == [None, None, None] and runner.stats.variant_graphs == 0
    assert runner.graph_variants == {}


@pytest.mark.parametrize("host, message", [
    (_Host(variants={64: ["fresh"]}), "bucket 64, whose attention is not inside the graph"),
    (_Host(variants={16: ["fresh", "fresh"]}), "distinct, non-empty names"),
    (_Host(variants={16: [""]}), "distinct, non-empty names"),
    (_Host(variants=[16]), "a dict of bucket to names"),
    (_NoVariantArg(variants={16: ["fresh"]}), "takes no variant argument"),
    (_DefaultedVariantArg(variants={16: ["fresh"]}), "takes no variant argument"),
])
def test_variants_the_core_cannot_capture_are_refused_with_what_is_wrong(host, message):
    runner = _runner(host, [])
    runner.graph_attention = runner._plan_attention()
    with pytest.raises(BcgStateError, match=message):
        runner._plan_variants()


def test_the_memory_estimate_samples_buckets_with_variants_apart_from_those_without():
    runner = _runner(_Host(inside=(16, 32, 64), variants={16: ["fresh"], 32: ["fresh"]}),
                     [], BcgConfig(enable=True, sizes=(16, 32, 64, 128), graph_variants=True))
    runner.graph_attention = runner._plan_attention()
    runner.graph_variants = runner._plan_variants()
    # 128 breaks, 64 has attention inside and no variant, 32 and 16 have one each
    assert runner._estimate_sample() == {128: 1, 64: 1, 32: 2}


def test_the_summary_names_the_buckets_each_variant_covers():
    summary = attention_summary([16, 32, 64], frozenset({16, 32}), {16: ("fresh",), 32: ("fresh",)})
    assert summary == ("attention inside the graph: 16..32 (2 buckets); eager break: 64 (1 bucket); "
                       "also as 'fresh': 16..32 (2 buckets)")
    assert attention_summary([16, 32], frozenset({16})) == \
        "attention inside the graph: 16 (1 bucket); eager break: 32 (1 bucket)"
    assert attention_summary([16, 32], frozenset({16, 32}), {32: (BREAKING,)}) == (
        "attention inside the graph: 16..32 (2 buckets); eager break: none; "
        "also with attention breaking 'break': 32 (1 bucket)")
    # buckets that are not a run of the ladder are named one by one
    assert attention_summary([16, 32, 48, 64], frozenset({16, 32, 48, 64}), {32: (BREAKING,), 64: (BREAKING,)}) == (
        "attention inside the graph: 16..64 (4 buckets); eager break: none; also with attention breaking 'break': 32, 64")


def test_a_variant_that_fails_to_capture_drops_the_variants_and_the_buckets_still_capture(caplog):
    log = []
    runner = _replayable(_runner(_Host(variants={16: ["fresh"], 32: ["fresh"]}), log,
                                 BcgConfig(enable=True, sizes=SIZES, warmup="first_bucket", graph_variants=True),
                                 fails=((16, "fresh"), RuntimeError("plan refused"))))
    with caplog.at_level("WARNING", logger="bcg_plugin"):
        runner.capture(progress=False)
    assert runner.captured and runner.stats.buckets_captured == 3
    assert runner.graph_variants == {} and runner.stats.variant_graphs == 0
    assert ("release", (32, "fresh")) in log  # the variant captured before the failure is given back
    assert [entry[1:] for entry in log if entry[0] == "capture"][-2:] == [(16, "fresh", False), (16, "fresh", True)]
    assert "graph variant 'fresh' of bucket 16 did not capture (RuntimeError('plan refused'))" in caplog.text
    runner.replay(16, HostBatch(num_tokens=9, inputs={}))  # the bucket's own graph serves the step
    with pytest.raises(BcgStateError, match="bucket 16 has no graph variant 'fresh'"):
        runner.replay(16, HostBatch(num_tokens=9, inputs={}), "fresh")


def test_a_variant_that_fails_to_capture_is_dropped_from_every_bucket_and_the_other_variant_still_captures(caplog):
    log = []
    both = ["fresh", BREAKING]
    runner = _replayable(_runner(_Host(variants={16: both, 32: both}), log,
                                 BcgConfig(enable=True, sizes=SIZES, warmup="first_bucket", graph_variants=True),
                                 fails=((16, "fresh"), RuntimeError("plan refused"))))
    with caplog.at_level("WARNING", logger="bcg_plugin"):
        runner.capture(progress=False)
    assert runner.captured and runner.stats.buckets_captured == 3
    assert runner.graph_variants == {16: (BREAKING,), 32: (BREAKING,)} and runner.stats.variant_graphs == 2
    assert ("release", (32, "fresh")) in log and ("release", (32, BREAKING)) not in log
    assert [entry[1:] for entry in log if entry[0] == "capture"][-3:] == [
        (16, "fresh", False), (16, "fresh", True), (16, BREAKING, False)]  # after the drop, as before it
    assert "drops that variant from every bucket" in caplog.text
    assert runner.breaks_attention(16) and runner.breaks_attention(32)  # steps too many for the slots still replay
    runner.replay(16, HostBatch(num_tokens=9, inputs={}), BREAKING)
    assert log[-1] == ("replay", (16, BREAKING))
    with pytest.raises(BcgStateError, match="bucket 32 has no graph variant 'fresh'"):
        runner.replay(32, HostBatch(num_tokens=9, inputs={}), "fresh")


def test_a_variant_that_runs_out_of_memory_still_fails_the_boot():
    from bcg_plugin import BcgCaptureOOM

    runner = _runner(_Host(variants={16: ["fresh"]}), [], fails=((16, "fresh"), torch.OutOfMemoryError("injected")))
    with pytest.raises(BcgCaptureOOM):
        runner.capture(progress=False)


def test_a_variant_failure_that_leaves_the_device_unusable_fails_the_capture():
    from bcg_plugin.errors import BcgCaptureError

    runner = _runner(_Host(variants={16: ["fresh"]}), [], fails=((16, "fresh"), RuntimeError("illegal memory access")))
    runner._device_lost = lambda error, during: BcgCaptureError(f"lost during {during}")
    with pytest.raises(BcgCaptureError, match="lost during capture"):
        runner.capture(progress=False)
