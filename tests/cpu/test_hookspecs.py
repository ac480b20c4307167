import inspect

import pluggy
import pytest

from bcg_plugin import BcgConfig, BcgStateError, Fallback, PrefillGraphRunner, hookimpl, plugin_manager
from bcg_plugin.hookspecs import BcgHostSpec, PROJECT_NAME

EXPECTED_HOOKS = {
    "bcg_prefill_buckets", "bcg_static_inputs", "bcg_dummy_batch", "bcg_body_forward", "bcg_embed",
    "bcg_logits_tail", "bcg_world_group", "bcg_capture_stream", "bcg_graph_attention",
    "bcg_graph_variants",
}


def test_spec_names_and_docstrings():
    hooks = {n for n in dir(BcgHostSpec) if n.startswith("bcg_")}
    assert hooks == EXPECTED_HOOKS
    for name in hooks:
        doc = inspect.getdoc(getattr(BcgHostSpec, name))
        assert doc and doc.startswith("Return"), name


def test_unknown_hook_in_adapter_is_rejected():
    class Typo:
        @hookimpl
        def bcg_dummy_bach(self, num_tokens):
            return None

    with pytest.raises(pluggy.PluginValidationError, match="bcg_dummy_bach"):
        plugin_manager(Typo())


def test_wrong_argument_name_is_rejected():
    class WrongArgs:
        @hookimpl
        def bcg_dummy_batch(self, tokens):
            return None

    with pytest.raises(pluggy.PluginValidationError):
        plugin_manager(WrongArgs())


class _Buckets:
    @hookimpl
    def bcg_prefill_buckets(self, config):
        return [s for s in (8, 24, 40) if s <= config.max_tokens]


def test_adapter_buckets_override_the_ladder_and_unimplemented_hooks_return_none():
    pm = plugin_manager(_Buckets())
    assert pm.project_name == PROJECT_NAME
    runner = PrefillGraphRunner(pm, BcgConfig(enable=True), chunk_size=32, device="cpu")
    assert runner.buckets == [8, 24]
    assert pm.hook.bcg_world_group() is None


def test_default_buckets_follow_chunk_size_and_disabled_runner_captures_nothing():
    pm = plugin_manager()
    assert PrefillGraphRunner(pm, BcgConfig(enable=True), chunk_size=256, device="cpu").buckets[-1] == 256
    off = PrefillGraphRunner(pm, BcgConfig(enable=False), chunk_size=256, device="cpu")
    off.capture()
    assert off.buckets == [] and off.bucket_for(16) is None and not off.stats.fallbacks


def test_bucket_for_counts_fallback_reasons():
    runner = PrefillGraphRunner(plugin_manager(), BcgConfig(enable=True, sizes=(16, 64), max_padding_ratio=2),
                                chunk_size=64, device="cpu")
    runner._graphs = {16: object(), 64: object()}  # decisions only: no replay happens here
    assert runner.bucket_for(10) == 16
    assert runner.bucket_for(40) == 64
    assert runner.bucket_for(17) is None  # 64 > 2 * 17
    assert runner.bucket_for(65) is None
    assert runner.bucket_for(10, num_tokens_across_dp=[10, 30], all_ranks_extend=False) is None
    assert runner.bucket_for(10, num_tokens_across_dp=[10, 40]) == 64
    assert runner.stats.fallbacks == {
        Fallback.PADDING_RATIO.value: 1, Fallback.OVER_TOP_BUCKET.value: 1, Fallback.DP_DISAGREEMENT.value: 1,
    }


class _GraphAttention:
    def __init__(self, answer):
        self.answer, self.asked = answer, []

    @hookimpl
    def bcg_graph_attention(self, buckets, attention):
        self.asked.append(attention)
        return self.answer


@pytest.mark.parametrize("attention", ["auto", "graph", "break"])
def test_the_attention_plan_is_the_hosts_answer_unless_the_config_says_break(attention):
    host = _GraphAttention([16, 32])
    runner = PrefillGraphRunner(plugin_manager(host), BcgConfig(enable=True, sizes=(16, 32, 64), attention=attention),
                                chunk_size=64, device="cpu")
    plan = runner._plan_attention()
    assert plan == (frozenset() if attention == "break" else {16, 32})
    assert host.asked == ([] if attention == "break" else [attention])


def test_an_attention_plan_naming_no_bucket_of_the_runner_is_refused():
    runner = PrefillGraphRunner(plugin_manager(_GraphAttention([16, 48])), BcgConfig(enable=True, sizes=(16, 32, 64)),
                                chunk_size=64, device="cpu")
    with pytest.raises(BcgStateError, match=r"bcg_graph_attention returned \[48\]"):
        runner._plan_attention()


class _DummyBatchOf:
    """A dummy-batch hook that does, or (like hooks written before graph attention) does not, take
    ``graph_attention``."""

    def __init__(self, takes_graph_attention):
        if takes_graph_attention:
            self.bcg_dummy_batch = hookimpl(lambda num_tokens, graph_attention: None)
        else:
            self.bcg_dummy_batch = hookimpl(lambda num_tokens: None)


@pytest.mark.parametrize("takes", [True, False])
def test_a_plan_for_graph_attention_needs_a_dummy_batch_hook_that_can_build_its_capture_batch(takes):
    """A hook that cannot be asked for graph-resident metadata builds a break's batch; captured inline,
    attention would replay the capture's metadata. Refused before any bucket is captured."""
    runner = PrefillGraphRunner(plugin_manager(_GraphAttention([16]), _DummyBatchOf(takes)),
                                BcgConfig(enable=True, sizes=(16, 32)), chunk_size=32, device="cpu")
    if takes:
        assert runner._plan_attention() == {16}
    else:
        with pytest.raises(BcgStateError, match="takes no graph_attention argument"):
            runner._plan_attention()
    runner = PrefillGraphRunner(plugin_manager(_GraphAttention(None), _DummyBatchOf(False)),
                                BcgConfig(enable=True, sizes=(16, 32)), chunk_size=32, device="cpu")
    assert runner._plan_attention() == frozenset()  # no graph attention asked of it: nothing to refuse


@pytest.mark.parametrize("answer", [True, "16", 16])
def test_an_attention_plan_that_is_not_a_list_of_buckets_is_refused_with_what_was_returned(answer):
    runner = PrefillGraphRunner(plugin_manager(_GraphAttention(answer)), BcgConfig(enable=True, sizes=(16, 32)),
                                chunk_size=32, device="cpu")
    with pytest.raises(BcgStateError, match="a list of buckets or None was expected"):
        runner._plan_attention()


def test_a_host_without_graph_attention_breaks_everywhere_and_the_summary_says_where_attention_runs():
    from bcg_plugin.runner import attention_summary

    runner = PrefillGraphRunner(plugin_manager(_Buckets()), BcgConfig(enable=True, attention="graph"),
                                chunk_size=64, device="cpu")
    assert runner._plan_attention() == frozenset()
    assert attention_summary([16, 32, 64], {16, 32}) == (
        "attention inside the graph: 16..32 (2 buckets); eager break: 64 (1 bucket)")
    assert attention_summary([16, 32], set()) == "attention inside the graph: none; eager break: 16..32 (2 buckets)"
