"""The SGLang adapter against the installed sglang package (any supported release), on CPU.

In-process tests only read SGLang (resolve targets, signatures); anything that installs hooks runs
in a fresh interpreter, as SGLang's own spawned schedulers do, so this process stays unpatched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import inspect
import textwrap
import types
from importlib.metadata import entry_points

import pytest
from packaging.specifiers import SpecifierSet

pytest.importorskip("sglang")

pytestmark = pytest.mark.sglang

from bcg_plugin.adapters import sglang as adapter  # noqa: E402
from bcg_plugin.adapters.sglang import config, eligibility, plugin, version  # noqa: E402
from bcg_plugin.adapters.sglang.replay import BcgPrefillRunner  # noqa: E402
from bcg_plugin.stats import StatsReporter  # noqa: E402
from bcg_plugin.patches import NOT_FILED, Patch, PatchSet, PatchTargetError  # noqa: E402
from bcg_plugin.patches.sglang import Hook  # noqa: E402
from bcg_plugin import BcgConfig, BcgConfigError, PrefillGraphRunner, plugin_manager  # noqa: E402

QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "attention_bias": False,
}
INSTALLED = version.installed()


def for_installed(table: list[tuple[str, set[str]]]) -> set[str]:
    """The targets of ``table`` (release range, targets), written from SGLang's sources, that the
    installed release has."""
    return set().union(*(targets for hosts, targets in table if SpecifierSet(hosts).contains(INSTALLED, prereleases=True)))


# Hooks (SGLang's HookRegistry), per release range.
RUNTIME_TARGETS = for_installed([
    (">=0.5.17", {"sglang.srt.model_executor.model_runner_components.cuda_graph_setup.capture_prefill_graph"}),
    (">=0.5.21", {"sglang.srt.managers.scheduler_components.dp_attn._local_prefill_cuda_graph_vote"}),
    ("<0.5.23", {  # the module-level breakable attention ops, gone in 0.5.23
        "sglang.srt.layers.radix_attention.breakable_unified_attention_with_output",
        "sglang.srt.layers.radix_attention.breakable_unified_attention_with_output_and_lse",
        "sglang.srt.layers.radix_attention.breakable_attention_with_output_extra_kwargs",
    }),
])
LAUNCH_TARGETS = for_installed([
    ("<0.5.19", {"sglang.srt.server_args.ServerArgs.__post_init__"}),
    (">=0.5.19", {"sglang.srt.server_args.ServerArgs.resolve_once"}),
    (">=0.5.20", {"sglang.srt.server_args.ServerArgs.add_cli_args"}),
])
# Rebinds and in-place wraps, not hooks.
BACKENDS_TARGETS = for_installed([("<0.5.20", {"sglang.srt.model_executor.cuda_graph_config.Backend.ALL"})])
RUNTIME_WRAPS = for_installed([
    (">=0.5.17", {"sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph."
                  "_current_capture_var"}),
    (">=0.5.23", {"sglang.srt.layers.radix_attention.RadixAttention._eager_attention"}),
])
# Through 0.5.19 the flag's argparse choices are Backend.ALL, read when the parser is built; from 0.5.20
# they are fixed at import and bcg extends the prefill option alone.
LAZY_CHOICES = bool(BACKENDS_TARGETS)


# -- discovery and targets ---------------------------------------------------------------------


def test_entry_point_is_declared_and_loads():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "bcg"]
    assert len(eps) == 1
    assert eps[0].value == "bcg_plugin.adapters.sglang:register"
    assert eps[0].load() is adapter.register


def test_installed_sglang_is_supported():
    assert version.installed() is not None and version.problem() is None


@pytest.mark.parametrize(
    "found, fragment",
    [("0.5.24", "outside the range bcg-plugin supports (>=0.5.17,<0.5.24)"), ("0.4.9", "outside"),
     ("0.5.17.post1", None), ("0.5.20", None), ("0.5.23", None), ("not-a-version", "not a valid"), (None, "not installed")],
)
def test_version_gate(monkeypatch, found, fragment):
    monkeypatch.setattr(version, "installed", lambda: found)
    problem = version.problem()
    assert problem is None if fragment is None else fragment in problem


def all_patches():
    return plugin._patch_set(runtime=True)


def test_every_target_resolves_with_the_expected_signature():
    patches = all_patches()
    assert {p.target for p in patches} == RUNTIME_TARGETS | LAUNCH_TARGETS | BACKENDS_TARGETS | RUNTIME_WRAPS
    assert PatchSet("sglang", patches).problems(plugin.calls()) == []


def test_changed_signature_is_reported_naming_the_target():
    target = "sglang.srt.model_executor.model_runner_components.cuda_graph_setup.capture_prefill_graph"
    changed = Patch(target=target, how=Hook("AROUND", params=("model_runner", "renamed_argument")),
                    make=lambda: None, reason="r", hosts=">=0.5.17", upstream=NOT_FILED, remove_when="w")
    with pytest.raises(PatchTargetError) as e:
        changed.verify()
    assert target in str(e.value) and "renamed_argument" in str(e.value)


def test_install_is_all_or_nothing():
    from sglang.srt.plugins.hook_registry import HookRegistry

    good = plugin._patch_set(runtime=True)[-1]
    bad = Patch(target="sglang.srt.no_such_module.fn", how=Hook("AROUND"), make=lambda: None, reason="r",
                hosts=">=0.5.17", upstream=NOT_FILED, remove_when="w")
    with pytest.raises(PatchTargetError, match="sglang.srt.no_such_module.fn"):
        PatchSet("t", [good, bad]).apply(plugin.calls())
    assert not good.applied and good.target not in HookRegistry._hooks  # nothing was registered


def test_a_hook_sglang_did_not_install_fails_the_set(monkeypatch):
    """SGLang only logs a hook it could not apply; the set checks each one is in the target's chain."""
    from collections import defaultdict

    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    toy = types.ModuleType("bcg_toy_sglang")
    toy.forward = lambda x: x
    toy.step = lambda x: x
    monkeypatch.setitem(sys.modules, toy.__name__, toy)

    def make():
        return lambda original_fn, *args, **kwargs: ("hooked", original_fn(*args, **kwargs))

    def hooked(target):
        return Patch(target=target, how=Hook("AROUND", params=("x",)), make=make, reason="r", hosts=">=0.5.17",
                     upstream=NOT_FILED, remove_when="w")

    taken = hooked("bcg_toy_sglang.forward")
    PatchSet("t", [taken]).apply()
    assert toy.forward(1) == ("hooked", 1) and taken.in_place()
    HookRegistry._patched.add("bcg_toy_sglang.step")  # SGLang treats the target as done: the hook never applies
    with pytest.raises(PatchTargetError, match="bcg_toy_sglang.step: applied but not in place"):
        PatchSet("t", [hooked("bcg_toy_sglang.step")]).apply()
    assert toy.step(1) == 1


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, key",
    [({"BCG_SIZES": "16,abc"}, "BCG_SIZES"), ({"BCG_MAX_TOKENS": "-4"}, "'max_tokens'"),
     ({"BCG_ENABLE": "maybe"}, "'enable'"), ({"BCG_MAX_PADDING_RATIO": "0.5"}, "'max_padding_ratio'"),
     ({"BCG_CAPTURE_FAILURE": "ignore"}, "'capture_failure'"),
     ({"BCG_STATS_INTERVAL_S": "soon"}, "'BCG_STATS_INTERVAL_S'"),
     ({"BCG_STATS_INTERVAL_S": "nan"}, "'BCG_STATS_INTERVAL_S'"), ({"BCG_STATS_INTERVAL_S": "inf"}, "0 turns"),
     ({"BCG_STATS_INTERVAL_S": "-1"}, "'BCG_STATS_INTERVAL_S'"),
     ({"BCG_SIZES": "16,4096", "BCG_MAX_TOKENS": "2048"}, "'sizes'"),
     ({"BCG_ENABLE": "1", "BCG_TORCH_COMPILE": "1"}, "'torch_compile' is supported with vLLM only"),
     ({"BCG_ENABLE": "1", "BCG_MAX_TOKEN": "512"}, "BCG_MAX_TOKEN is not a variable bcg reads; did you mean "
                                                   "BCG_MAX_TOKENS?"),
     ({"BCG_ENABLED": "1"}, "did you mean BCG_ENABLE?"),
     ({"BCG_STATS_INTERVAL": "5"}, "did you mean BCG_STATS_INTERVAL_S?")],
)
def test_config_errors_name_the_key(env, key):
    with pytest.raises(BcgConfigError) as e:
        config.read_config(env)
    assert key in str(e.value)


def test_other_tools_variables_under_the_prefix_are_left_alone():
    # the test and bench harness's own names, each further from a name bcg reads than a misspelling
    env = {"BCG_ENABLE": "1", "BCG_TEST_TP": "2", "BCG_TEST_MODEL": "qwen3-8b", "BCG_SOAK_TORCH_COMPILE": "1",
           "BCG_TEST_ATTENTION_BACKEND": "fa3", "BCG_BENCH_PROFILE_TOKENS": "16", "BCG_CI_VENV": "/tmp/v"}
    assert config.read_config(env).active


@pytest.mark.parametrize("env, warmup", [
    ({"BCG_ENABLE": "1"}, "first_bucket"),  # SGLang's default
    ({"BCG_ENABLE": "1", "BCG_WARMUP": "every_bucket"}, "every_bucket"),  # the user's variable wins
])
def test_sglang_warmup_default_sits_under_the_users_variables(env, warmup):
    cfg = config.read_config(env)
    assert cfg.warmup == warmup and cfg.active


def test_config_defaults_off_and_reads_env():
    assert not config.read_config({}).active
    cfg = config.read_config({"BCG_ENABLE": "1", "BCG_SIZES": "64,16,32", "BCG_MAX_TOKENS": "64"})
    assert cfg.active and cfg.sizes == (16, 32, 64) and cfg.max_tokens == 64
    assert config.stats_interval({"BCG_STATS_INTERVAL_S": "0"}) == 0.0


# -- runtime pieces that need no GPU ------------------------------------------------------------


def test_layers_reason_rejects_what_bcg_does_not_capture():
    class Body:
        def forward(self, input_ids, positions, forward_batch, input_embeds=None):
            return None

    class OtherSignature:
        def forward(self, hidden_states, forward_batch):
            return None

    args = types.SimpleNamespace(moe_a2a_backend="none")
    dense = types.SimpleNamespace(server_args=args, moe_layers=[None] * 2, dsa_indexers=None,
                                  mha_companion_layers=[None, None])
    assert eligibility.layers_reason(dense, Body()) is None
    moe = types.SimpleNamespace(server_args=args, moe_layers=[None, object()], dsa_indexers=None,
                                mha_companion_layers=None)
    assert eligibility.layers_reason(moe, Body()) is None  # captured inside the segments
    moe_a2a = types.SimpleNamespace(**{**vars(moe), "server_args": types.SimpleNamespace(moe_a2a_backend="deepep")})
    assert "all-to-all backend 'deepep'" in eligibility.layers_reason(moe_a2a, Body())
    dsa = types.SimpleNamespace(**{**vars(dense), "dsa_indexers": [object()]})
    assert "dsa indexers" in eligibility.layers_reason(dsa, Body())
    assert "is not (input_ids, positions, forward_batch" in eligibility.layers_reason(dense, OtherSignature())


def test_layers_reason_reads_the_a2a_backend_sglang_resolved(monkeypatch):
    """SGLang may resolve an all-to-all backend the operator did not name (MegaMoE); the launch
    record then still says "none", so the check must read SGLang's resolved value."""
    from sglang.srt.layers.moe import utils as moe_utils

    class Body:
        def forward(self, input_ids, positions, forward_batch):
            return None

    moe = types.SimpleNamespace(server_args=types.SimpleNamespace(moe_a2a_backend="none"),
                                moe_layers=[object()], dsa_indexers=None, mha_companion_layers=None)
    monkeypatch.setattr(moe_utils, "get_moe_a2a_backend", lambda: moe_utils.MoeA2ABackend("deepep"))
    assert "all-to-all backend 'deepep'" in eligibility.layers_reason(moe, Body())
    monkeypatch.setattr(moe_utils, "get_moe_a2a_backend", lambda: moe_utils.MoeA2ABackend.NONE)
    assert eligibility.layers_reason(moe, Body()) is None


def test_decode_context_parallelism_is_read_where_the_release_keeps_it(monkeypatch):
    """Through 0.5.22 the runner carries ``dcp_size``; 0.5.23 keeps it in the parallel context only."""
    from sglang.srt import runtime_context

    assert eligibility._dcp_size(types.SimpleNamespace(dcp_size=4)) == 4
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: types.SimpleNamespace(attn_dcp_size=2),
                        raising=False)
    assert eligibility._dcp_size(types.SimpleNamespace()) == 2
    # and the runner check reads it so: a 0.5.23 runner has no dcp_size of its own
    import sglang.srt.model_executor.cuda_graph_config as graph_config

    monkeypatch.setattr(graph_config, "check_cuda_graph_backend", lambda phase, backend: True)
    assert eligibility.runner_reason(_eligible_runner()) == "decode context parallelism"


def test_prefill_context_parallelism_keeps_sglangs_own_runner(monkeypatch):
    """SGLang runs no prefill graph runner under a context-parallel strategy but its own, which
    captured the context-parallel body: bcg's graphs would be captured and never replayed."""
    import sglang.srt.model_executor.cuda_graph_config as graph_config
    from sglang.srt.layers.cp import base
    from sglang.srt.model_executor import model_runner

    monkeypatch.setattr(graph_config, "check_cuda_graph_backend", lambda phase, backend: True)
    monkeypatch.setattr(eligibility, "_dcp_size", lambda runner: 1)
    runner = _eligible_runner()
    runner.model_config.is_multimodal = True  # the check after: what is named where CP is not
    monkeypatch.setattr(base, "get_cp_strategy", lambda: object())
    assert eligibility.runner_reason(runner) == "prefill context parallelism"
    # SGLang's own gate, as the installed release has it: no prefill graph for a runner without its capture
    monkeypatch.setattr(model_runner, "get_cp_strategy", base.get_cp_strategy)
    assert not model_runner._prefill_cuda_graph_allows_context_parallel(object(), None)
    monkeypatch.setattr(base, "get_cp_strategy", lambda: None)
    assert eligibility.runner_reason(runner) == "multimodal model"


def _eligible_runner(tp=1, **server_args):
    """A runner that passes every check of ``runner_reason`` before decode context parallelism."""
    settings = dict(enable_lora=False, enable_memory_saver=False, enable_return_hidden_states=False,
                    enable_symm_mem=False)
    return types.SimpleNamespace(
        server_args=types.SimpleNamespace(**{**settings, **server_args}),
        is_draft_worker=False, spec_algorithm=types.SimpleNamespace(is_none=lambda: True),
        pp_group=types.SimpleNamespace(world_size=1), model_config=types.SimpleNamespace(is_multimodal=False),
        tp_group=types.SimpleNamespace(world_size=tp))


def _runner_reason(monkeypatch, settings, *, tp=1, published):
    """``runner_reason`` for a runner whose server has ``settings``: as SGLang 0.5.19 on publishes them
    in ``get_exec()``'s sections, whose record may not show them (``published``), or in the record
    alone (0.5.17/0.5.18). Every other check passes, up to the embedding-model one, which fails."""
    from sglang.srt import runtime_context

    import sglang.srt.model_executor.cuda_graph_config as graph_config

    monkeypatch.setattr(graph_config, "check_cuda_graph_backend", lambda phase, backend: True)
    monkeypatch.setattr(eligibility, "_dcp_size", lambda runner: 1)
    if published:
        names = {"features": ("enable_return_hidden_states", "return_hidden_states_mode", "enable_memory_saver"),
                 "comm": ("enable_symm_mem",)}
        bag = types.SimpleNamespace(**{section: types.SimpleNamespace(**{n: settings.get(n) for n in fields})
                                       for section, fields in names.items()})
        monkeypatch.setattr(runtime_context, "get_exec", lambda: bag, raising=False)
        runner = _eligible_runner(tp=tp)
    else:
        monkeypatch.setattr(runtime_context, "get_exec", lambda: 1 / 0, raising=False)
        runner = _eligible_runner(tp=tp, **settings)
    runner.is_generation = False  # the check after: reached only where these settings let the runner through
    return eligibility.runner_reason(runner)


@pytest.mark.parametrize("settings, tp, reason", [
    ({"enable_return_hidden_states": True}, 1, "a server that returns hidden states"),
    ({"return_hidden_states_mode": "last"}, 1, "a server that returns hidden states"),  # 0.5.23's setting
    ({"enable_symm_mem": True}, 2, "NCCL symmetric memory (--enable-symm-mem)"),
    ({"enable_symm_mem": True}, 1, None),  # one rank: SGLang's allocator stays out of the way
    ({}, 2, None),
])
@pytest.mark.parametrize("published", [False, True])
def test_settings_under_which_bcgs_graphs_would_never_replay_or_capture_keep_it_off(monkeypatch, settings, tp,
                                                                                  reason, published):
    got = _runner_reason(monkeypatch, settings, tp=tp, published=published)
    assert got == "embedding/reward model" if reason is None else got.startswith(reason)


@pytest.mark.parametrize("saver, graphs_env, declined", [
    (True, "1", True), (True, "true", True),
    (True, None, False),  # SGLang releases no graph memory: bcg's graphs stay resident, as SGLang's own do
    (False, "1", False),
])
@pytest.mark.parametrize("published", [False, True])
def test_a_memory_saver_that_releases_graph_memory_keeps_bcg_off(monkeypatch, saver, graphs_env, declined, published):
    """SGLang's memory saver pauses graph memory only in its own regions: bcg's graphs would stay resident."""
    if graphs_env is None:
        monkeypatch.delenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", raising=False)
    else:
        monkeypatch.setenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", graphs_env)
    reason = _runner_reason(monkeypatch, {"enable_memory_saver": saver}, published=published)
    if declined:
        assert "memory saver" in reason and "--cuda-graph-backend-prefill full" in reason
    else:
        assert reason == "embedding/reward model"


def vote_runner(sizes=(16, 32, 64), ratio=None, dp_ranks=None):
    """A BcgPrefillRunner whose core is a real, CPU-built core marked captured (no GPU work), its
    graphs captured for ``dp_ranks`` DP-attention ranks (``None``: no DP attention)."""
    cfg = BcgConfig(enable=True, sizes=sizes, max_padding_ratio=ratio)
    core = PrefillGraphRunner(plugin_manager(), cfg, chunk_size=max(sizes), device="cpu")
    core._graphs = {b: None for b in core.buckets}
    runner = object.__new__(BcgPrefillRunner)
    runner.core = core
    runner.host = types.SimpleNamespace(dp_ranks=dp_ranks, land_real_rows=lambda num_tokens, bucket: None)
    runner.stats_reporter = StatsReporter(core.stats, logger=logging.getLogger("bcg_plugin.sglang"), interval_s=0)
    runner._planned = None
    runner._unknown_kwargs_logged = False
    return runner


def vote(runner, **overrides):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    args = dict(batch_size=2, num_tokens=40, input_embeds=None, replace_embeds=None, prefix_lens=[0, 3],
                is_target_verify=False, capture_hidden_mode=CaptureHiddenMode.NULL, return_logprob=True)
    args.update(overrides)
    return runner.can_replay_locally(**args)


def test_vote_accepts_mixed_and_prefix_batches_and_rejects_uncaptured_features():
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    r = vote_runner()
    assert vote(r) and vote(r, num_tokens=None) and vote(r, num_tokens=64)
    assert not vote(r, num_tokens=65)  # above the top bucket
    assert not vote(r, input_embeds=object()) and not vote(r, replace_embeds=object())
    assert not vote(r, is_target_verify=True) and not vote(r, lora_ineligible=True)
    assert not vote(r, capture_hidden_mode=CaptureHiddenMode.FULL)
    assert not vote(vote_runner(ratio=1.5), num_tokens=40)  # 64 > 1.5 * 40
    uncaptured = vote_runner()
    uncaptured.core._graphs = {}
    assert not vote(uncaptured)


def fake_batch(n, across=None, agreed=True, requests=1):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    return types.SimpleNamespace(
        batch_size=requests, input_ids=[0] * n, input_embeds=None, replace_embeds=None,
        extend_prefix_lens_cpu=[0] * requests,
        forward_mode=ForwardMode.EXTEND, capture_hidden_mode=CaptureHiddenMode.NULL, return_logprob=False,
        global_num_tokens_cpu=across, **{DP_VOTE: agreed},
    )


# The ForwardBatch field carrying SGLang's DP vote (renamed in 0.5.19).
DP_VOTE = for_installed([("<0.5.19", {"can_run_dp_breakable_cuda_graph"}),
                         (">=0.5.19", {"can_run_dp_prefill_cuda_graph"})]).pop()


def test_dp_ranks_replay_together_or_not_at_all():
    r = vote_runner(dp_ranks=2)
    fb = fake_batch(30, across=[10, 30])
    assert r.can_run_graph(fb) and r._planned == (fb, 32)  # bucket from the max over ranks
    assert not r.can_run_graph(fake_batch(30, across=[10, 30], agreed=False))  # a rank voted no
    assert not r.can_run_graph(fake_batch(30, across=[0, 30]))  # an idle rank
    assert r.core.stats.fallbacks["dp_disagreement"] == 2
    assert not r.can_run_graph(fake_batch(65))
    assert r.core.stats.fallbacks["over_top_bucket"] == 1


def graph_attention_runner(inside, slots, sizes=(16, 32, 64), ratio=None):
    from bcg_plugin.adapters.sglang import graph_attention

    r = vote_runner(sizes, ratio=ratio)
    r.core.graph_attention = frozenset(inside)
    r.host.graph = graph_attention.GraphAttention.__new__(graph_attention.GraphAttention)
    r.host.graph.slots = graph_attention.RequestSlots(slots, "cpu")
    return r


def test_a_step_with_more_requests_than_a_graph_buckets_slots_replays_in_the_next_breaking_bucket():
    r = graph_attention_runner({16}, slots=2)  # "auto": the small bucket keeps attention inside
    assert r.can_run_graph(fake_batch(12, requests=2)) and r._planned[1] == 16
    assert r.can_run_graph(fake_batch(12, requests=3)) and r._planned[1] == 32  # padded further, breaking
    assert r.can_run_graph(fake_batch(30, requests=3)) and r._planned[1] == 32  # a breaking bucket takes any count
    assert r.core.stats.fallbacks["feature_not_captured"] == 0


def test_a_step_with_more_requests_than_the_slots_replays_in_the_nearest_bucket_with_a_breaking_variant():
    """The bucket itself where it has the variant, else the next larger one with it or that breaks."""
    from bcg_plugin import BREAKING

    r = graph_attention_runner({16, 32}, slots=2)
    r.core.graph_variants = {32: (BREAKING,)}
    assert r.can_run_graph(fake_batch(12, requests=3)) and r._planned[1] == 32  # 16 has none; 32 does
    assert r.can_run_graph(fake_batch(30, requests=3)) and r._planned[1] == 32
    assert r.can_run_graph(fake_batch(12, requests=2)) and r._planned[1] == 16  # fits: the bucket's own graph
    r = graph_attention_runner({16, 32, 64}, slots=2)  # "graph": no bucket breaks
    r.core.graph_variants = {16: (BREAKING,)}
    assert r.can_run_graph(fake_batch(12, requests=3)) and r._planned[1] == 16
    assert not r.can_run_graph(fake_batch(20, requests=3))  # nothing from bucket 32 up has a breaking graph
    assert r.core.stats.fallbacks["feature_not_captured"] == 1
    r = graph_attention_runner({16, 32}, slots=2, ratio=2.0)
    r.core.graph_variants = {32: (BREAKING,)}
    assert not r.can_run_graph(fake_batch(12, requests=3))  # 32 rows for 12 tokens is past the padding limit
    assert r.core.stats.fallbacks["padding_ratio"] == 1


def test_a_breaking_variants_replay_plans_attention_as_a_breaking_bucket_does(monkeypatch):
    """The breaking variant runs the eager plan (its breaks read it), not the graph plan the bucket's
    own graph reads; the other graphs of a graph bucket plan into their buffers."""
    from bcg_plugin import BREAKING
    from bcg_plugin.adapters.sglang import replay

    monkeypatch.setattr(replay, "batch_forward_context", lambda runner, fb: contextlib.nullcontext())
    r = graph_attention_runner({16}, slots=2)
    planned = []
    r.model_runner = types.SimpleNamespace(model=object(), attn_backend=types.SimpleNamespace(
        init_forward_metadata=lambda fb: planned.append(("eager", fb.batch_size))))
    r.host.graph.plan_replay = lambda fb, variant=None: planned.append(("graph", variant))
    fb = fake_batch(12, requests=3)
    r._plan_attention(fb, 16, BREAKING)
    r._plan_attention(fb, 16, None)
    r._plan_attention(fb, 16, "fresh")
    r._plan_attention(fb, 32, None)
    assert planned == [("eager", 3), ("graph", None), ("graph", "fresh"), ("eager", 3)]


def test_the_forward_context_signature_is_read_once_not_per_replay(monkeypatch):
    """Every replay enters the batch's forward context twice (attention plan, logits tail); whether
    SGLang's ``forward_context`` takes the batch is read from its signature once, not per replay."""
    from sglang.srt.model_executor.forward_context import forward_context

    from bcg_plugin.adapters.sglang import host

    reads = []
    signature = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda fn, *a, **k: reads.append(fn) or signature(fn, *a, **k))
    runner = types.SimpleNamespace(attn_backend=None)
    batch = types.SimpleNamespace(moe_num_token_non_padded=None)  # what SGLang 0.5.23's context reads
    for _ in range(3):
        with host.batch_forward_context(runner, batch):
            pass
    assert reads.count(forward_context) <= 1  # none where an earlier test's forward read it already


def test_a_step_with_more_requests_than_the_slots_runs_eagerly_where_no_larger_bucket_breaks():
    r = graph_attention_runner({16, 32, 64}, slots=2)  # "graph": every bucket
    assert not r.can_run_graph(fake_batch(12, requests=3))
    assert r.core.stats.fallbacks["feature_not_captured"] == 1
    r = graph_attention_runner({16}, slots=2, ratio=2.0)  # 32 rows for 12 tokens is past the padding limit
    assert not r.can_run_graph(fake_batch(12, requests=3))
    assert r.core.stats.fallbacks["padding_ratio"] == 1 and r.core.stats.fallbacks["feature_not_captured"] == 0
    assert r.can_run_graph(fake_batch(16, requests=3)) and r._planned[1] == 32  # 32 <= 2 x 16


def test_a_dp_width_other_than_the_captured_one_runs_eagerly():
    """The captured gather buffer holds the counts of the ranks it was captured for; a batch gathered
    over another number of ranks would overrun it."""
    assert not vote_runner(dp_ranks=2).can_run_graph(fake_batch(30, across=[10, 30, 30, 30]))
    r = vote_runner()  # captured without DP attention
    assert not r.can_run_graph(fake_batch(30, across=[10, 30]))
    assert r.core.stats.fallbacks["feature_not_captured"] == 1
    assert r.can_run_graph(fake_batch(30, across=[30]))


def test_the_dp_width_counts_sglang_0_5_23_attention_dp_ranks(monkeypatch):
    """SGLang 0.5.23 resolves DP attention to ``attn_dp_size`` ranks with ``dp_size`` 1; its
    ``num_dp_ranks`` counts every rank, as its own runner captures; earlier releases have ``dp_size``."""
    from sglang.srt import runtime_context, utils

    from bcg_plugin.adapters.sglang import host

    class Parallel:
        dp_size = 1

        @property
        def num_dp_ranks(self):
            return 4

    monkeypatch.setattr(utils, "require_mlp_tp_gather", lambda *a, **k: True)
    monkeypatch.setattr(runtime_context, "get_parallel", Parallel, raising=False)
    runner = types.SimpleNamespace(server_args=types.SimpleNamespace())
    assert host._dp_layout(runner) == 4
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: types.SimpleNamespace(dp_size=2), raising=False)
    assert host._dp_layout(runner) == 2
    if SpecifierSet(">=0.5.23").contains(INSTALLED, prereleases=True):  # the installed release has it so
        monkeypatch.undo()
        assert isinstance(getattr(runtime_context.ParallelContext, "num_dp_ranks", None), property)


def scattered_rows(monkeypatch, attn_tp_size):
    """SGLang's layout as its own graph-size multiple reads it: a step's rows scattered between
    ``attn_tp_size`` attention-TP ranks (``None``: not scattered), without two-batch overlap."""
    from sglang.srt.utils import common

    monkeypatch.setattr(common, "require_gathered_buffer", lambda *a, **k: attn_tp_size is not None)
    monkeypatch.setattr(common, "get_parallel", lambda: types.SimpleNamespace(
        attn_tp_size=attn_tp_size or 1, attn_cp_size=1))
    monkeypatch.setattr(common, "get_exec", lambda: types.SimpleNamespace(
        overlap=types.SimpleNamespace(enable_two_batch_overlap=False)), raising=False)
    return types.SimpleNamespace(server_args=types.SimpleNamespace(enable_two_batch_overlap=False))


@pytest.mark.parametrize("sizes", [None, (10, 20, 50, 100)])
def test_scattered_rows_give_every_bucket_a_multiple_of_the_attention_tp_width(monkeypatch, sizes):
    """Each attention-TP rank takes an equal share of a bucket's rows, as SGLang's own sizes (its
    eager padding, its 0.5.23 graphs) make them: asked of the installed release's own function."""
    from bcg_plugin.adapters.sglang.host import SglangHost

    host = SglangHost.__new__(SglangHost)
    host.model_runner = scattered_rows(monkeypatch, 3)
    config = BcgConfig(enable=True, sizes=sizes)
    buckets = PrefillGraphRunner(plugin_manager(host), config, chunk_size=100, device="cpu").buckets
    assert buckets and all(b % 3 == 0 and b <= 100 for b in buckets), buckets
    assert buckets[-1] == 99  # max_tokens 100 (as BCG_MAX_TOKENS=100 sets it): a step padded to 102 runs eagerly
    if sizes:
        assert buckets == [12, 21, 51, 99]
    host.model_runner = scattered_rows(monkeypatch, None)
    ladder = PrefillGraphRunner(plugin_manager(host), config, chunk_size=100, device="cpu").buckets
    assert ladder == (sorted(sizes) if sizes else PrefillGraphRunner(plugin_manager(), config, chunk_size=100,
                                                                      device="cpu").buckets)


@pytest.mark.parametrize("pool_rows, top", [
    (64, 102),  # the chunk sets the top: SGLang pads a full chunk of 100 to 102 rows, and replays it
    (1, 99),  # one request of 100 tokens: no capture batch holds 102, and a padded full step runs eagerly
])
def test_a_full_chunk_padded_to_the_attention_tp_width_replays_in_the_top_bucket(monkeypatch, pool_rows, top):
    """Where a step's rows are scattered between attention-TP ranks SGLang pads each step to a multiple
    of their width, a full chunk above the chunk size, and sizes its own top prefill graph the same
    way (asked here of the installed release's own functions)."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.utils import common

    from bcg_plugin.adapters.sglang.host import SglangHost
    from bcg_plugin.adapters.sglang.replay import step_token_limit
    from bcg_plugin.ladder import choose_bucket

    runner = scattered_rows(monkeypatch, 3)
    runner.server_args.cuda_graph_config = types.SimpleNamespace(prefill=types.SimpleNamespace(max_bs=100, bs=[16]))
    runner.server_args.chunked_prefill_size = 100
    runner.req_to_token_pool = ReqToTokenPool(size=pool_rows, max_context_len=104, device="cpu",
                                              enable_memory_saver=False)
    runner.model_config = types.SimpleNamespace(context_len=100)
    padded_chunk = common.ceil_align(100, 3)  # SGLang's padding of a step of 100 tokens under attention TP 3
    host = SglangHost.__new__(SglangHost)
    host.model_runner = runner
    buckets = PrefillGraphRunner(plugin_manager(host), BcgConfig(enable=True), chunk_size=step_token_limit(runner),
                                 device="cpu").buckets
    assert buckets[-1] == top and all(b % 3 == 0 for b in buckets)
    assert choose_bucket(buckets, padded_chunk) == (padded_chunk if top == padded_chunk else None)
    assert -(-buckets[-1] // 100) <= pool_rows  # the top bucket's capture batch fits the request pool


def test_a_keyword_a_later_sglang_adds_means_eager_not_a_crash(caplog):
    r = vote_runner()
    with caplog.at_level(logging.WARNING, logger="bcg_plugin.sglang"):
        assert not vote(r, some_new_condition=False)  # a condition bcg does not know: no replay
        assert not r.can_run_graph(fake_batch(30), some_new_context=object())
        assert r.can_run_graph(fake_batch(30)) and vote(r)  # without it, as before
    assert r.core.stats.fallbacks["feature_not_captured"] == 1  # the eager forward is counted
    named = [m for m in caplog.messages if "some_new_condition" in m]
    assert len(named) == 1 and len(caplog.messages) == 1  # one line names it; then quiet


def schedule_batch(mode_name: str, tokens: int = 40):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(forward_mode=getattr(ForwardMode, mode_name), batch_size=lambda: 2,
                                 extend_num_tokens=tokens, input_embeds=None, replace_embeds=None, prefix_lens=[0, 3],
                                 return_logprob=False, seq_lens_cpu=None, multimodal_inputs=None, reqs=[],
                                 has_grammar=False)


def test_bcg_runner_casts_its_own_dp_vote():
    """SGLang 0.5.21 on votes no for any prefill runner not of its own class; the hook asks bcg's."""
    from sglang.srt.managers.scheduler_components import dp_attn

    from bcg_plugin.adapters.sglang import replay
    from bcg_plugin.patches.sglang import dp_prefill_vote

    # The vote is a function of its own from 0.5.19 (inline in the DP sync before).
    original = getattr(dp_attn, "_local_prefill_cuda_graph_vote", None)
    r = vote_runner()
    vote = dp_prefill_vote.make(dp_prefill_vote=replay.dp_prefill_vote)

    def sglangs_vote(**kwargs):
        return "SGLang's own vote"

    def cast(batch, runner=r, fn=None, hook=True):
        fn = fn or original or sglangs_vote
        kwargs = dict(local_batch=batch, prefill_graph_runner=runner, coordinated_prefill=True,
                      breakable_prefill=True, spec_algorithm=None, model_config=None)
        if original is not None and "num_tokens" in inspect.signature(original).parameters:
            kwargs["num_tokens"] = batch.extend_num_tokens if batch is not None else 0
        return vote(fn, **kwargs) if hook else fn(**kwargs)

    assert cast(schedule_batch("EXTEND")) is True and cast(schedule_batch("MIXED")) is True and cast(None) is True
    assert cast(schedule_batch("EXTEND", tokens=65)) is False  # above the top bucket: the rule at forward time
    assert cast(schedule_batch("DECODE")) is False  # SGLang's decode-to-extend conversion is for its own runner
    assert cast(schedule_batch("EXTEND"), runner=object(), fn=sglangs_vote) == "SGLang's own vote"  # not bcg's
    if "dp_prefill_vote" in {p.module.rpartition(".")[2] for p in plugin._patch_set(runtime=True)}:
        assert cast(schedule_batch("EXTEND"), hook=False) is False  # what SGLang alone votes for bcg's runner


def test_a_graph_bucket_replays_the_variant_its_step_takes_planned_for_that_variant():
    r = graph_attention_runner({16}, slots=2)
    r.core.graph_variants = {16: ("fresh",)}  # the fresh variant was captured
    r.host.forward_pass = lambda fb, kwargs: None
    planned, replayed, real_rows = [], [], []
    r.host.land_real_rows = lambda num_tokens, bucket: real_rows.append((num_tokens, bucket))
    r._plan_attention = lambda fb, bucket, variant=None: planned.append((bucket, variant))
    r.core.replay = lambda bucket, batch, variant=None: replayed.append((bucket, variant))
    for prefixes, tokens in (([0, 0], 12), ([0, 5], 12), ([0, 0], 30)):
        fb = fake_batch(tokens, requests=2)
        fb.extend_prefix_lens_cpu, fb.positions, fb.out_cache_loc = prefixes, None, None
        assert r.can_run_graph(fb)
        r.execute(fb)
    # no cached prefix: the fresh variant; a prefix: the bucket's own graph; a breaking bucket: no variant
    assert planned == replayed == [(16, "fresh"), (16, None), (32, None)]
    r.core.graph_variants = {}  # graph_variants off: every step replays the bucket's own graph
    fb = fake_batch(12, requests=2)
    fb.positions = fb.out_cache_loc = None
    assert r.can_run_graph(fb)
    r.execute(fb)
    assert replayed[-1] == (16, None)
    # every replay lands its own count of real rows, and its bucket, for the MoE routing mask
    assert real_rows == [(12, 16), (12, 16), (30, 32), (12, 16)]


def test_a_step_of_more_requests_than_the_slots_replays_the_breaking_variant_of_the_bucket_it_is_sent_to():
    """From the vote to the replay: a larger bucket's breaking variant where the step's own bucket has
    none, its own where it has one; a step that fits replays its bucket's own graph."""
    from bcg_plugin import BREAKING

    r = graph_attention_runner({16, 32}, slots=2)
    r.core.graph_variants = {32: (BREAKING,)}
    r.host.forward_pass = lambda fb, kwargs: None
    r.host.land_real_rows = lambda num_tokens, bucket: None
    planned, replayed = [], []
    r._plan_attention = lambda fb, bucket, variant=None: planned.append((bucket, variant))
    r.core.replay = lambda bucket, batch, variant=None: replayed.append((bucket, variant))
    for tokens, requests in ((12, 3), (12, 2), (30, 3)):
        fb = fake_batch(tokens, requests=requests)
        fb.positions = fb.out_cache_loc = None
        assert r.can_run_graph(fb)
        r.execute(fb)
    assert planned == replayed == [(32, BREAKING), (16, None), (32, BREAKING)]


def test_a_dp_padded_step_lands_its_real_count_for_the_moe_mask_not_its_padded_rows():
    """Under DP attention SGLang pads each rank's step to its peers' bucket before the runner sees it,
    keeping the real count apart (an idle rank's step is all padding): the MoE routing mask reads
    that count, as in SGLang's own replay, or every padded row would be routed to an expert."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from bcg_plugin.adapters.sglang.host import _non_padded_field

    r = vote_runner(dp_ranks=2)
    landed = []
    r.host.land_real_rows = lambda num_tokens, bucket: landed.append((num_tokens, bucket))
    r.host.graph = types.SimpleNamespace(variant_for=lambda fb, names: None)
    r.host.forward_pass = lambda fb, kwargs: None
    r._plan_attention = lambda fb, bucket, variant=None: None
    r.core.replay = lambda bucket, batch, variant=None: None
    for real in (10, 0, None):  # a rank with 10 real tokens, an idle rank, a release without the count
        fb = fake_batch(32, across=[32, 32])
        fb.positions = fb.out_cache_loc = None
        setattr(fb, _non_padded_field(ForwardBatch), real)
        assert r.can_run_graph(fb)
        r.execute(fb)
    assert landed == [(10, 32), (0, 32), (32, 32)]


def test_execute_refuses_a_batch_it_did_not_plan():
    r = vote_runner()
    with pytest.raises(RuntimeError, match="can_run_graph"):
        r.execute(fake_batch(8))


# -- registration in a fresh interpreter (SGLang's spawn) ---------------------------------------


SCENARIO = textwrap.dedent(
    """
    import json, os, sys
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    load_plugins()
    import bcg_plugin.adapters.sglang as adapter
    from bcg_plugin.adapters.sglang import plugin, register
    register()  # re-entrant: must not register anything twice
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.model_executor.model_runner_components import cuda_graph_setup
    from sglang.srt.server_args import ServerArgs, prepare_server_args
    out = {"active": adapter.is_active(), "backends": list(Backend.ALL),
           "hooks": {t: len(h) for t, h in HookRegistry._hooks.items()},
           "installed": [p.target for p in plugin._patch_set(runtime=True) if p.in_place()],
           "capture_wrapped": hasattr(cuda_graph_setup.capture_prefill_graph, "__wrapped__")}
    model = sys.argv[1]
    base = ["--model-path", model, "--skip-tokenizer-init", "--load-format", "dummy", "--device", "cpu"]
    os.environ.pop("BCG_ENABLE", None)
    def prefill_backend(a):
        # From 0.5.19 resolution is a separate step, and from 0.5.20 the record keeps the input and
        # reports what resolution decided through resolved_dict().
        if hasattr(a, "resolve_once"):
            a.resolve_once()
        if hasattr(a, "resolved_dict"):
            return a.resolved_dict()["cuda_graph_config"]["prefill"]["backend"]
        return a.cuda_graph_config.prefill.backend
    def parse(extra):
        try:
            a = prepare_server_args(base + extra)
            return {"prefill": prefill_backend(a), "flag": a.cuda_graph_backend_prefill,
                    "env": os.environ.get("BCG_ENABLE")}
        except SystemExit as e:
            return {"exit": e.code}
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e)}
    out["cli_plain"] = parse([])
    out["cli_bcg"] = parse(["--cuda-graph-backend-prefill", "bcg"])
    out["cli_after"] = parse([])  # a later launch without the flag does not inherit it
    out["cli_decode_bcg"] = parse(["--cuda-graph-backend-decode", "bcg"])
    try:
        a = ServerArgs(model_path=model, skip_tokenizer_init=True, load_format="dummy", device="cpu",
                       cuda_graph_backend_prefill="bcg")
        prefill_backend(a)
        out["engine_kwargs"] = {"flag": a.cuda_graph_backend_prefill, "env": os.environ.get("BCG_ENABLE")}
    except Exception as e:
        out["engine_kwargs"] = {"error": type(e).__name__, "message": str(e)}
    os.environ.pop("BCG_ENABLE", None)
    try:
        a = ServerArgs(model_path=model, skip_tokenizer_init=True, load_format="dummy", device="cpu",
                       cuda_graph_backend_decode="bcg")
        prefill_backend(a)
        out["engine_decode_bcg"] = {"flag": a.cuda_graph_backend_decode}
    except Exception as e:
        out["engine_decode_bcg"] = {"error": type(e).__name__, "message": str(e)}
    os.environ["BCG_SIZES"] = "16,x"
    out["cli_bad_sizes"] = parse(["--cuda-graph-backend-prefill", "bcg"])
    print("SCENARIO " + json.dumps(out))
    """
)


# An SGLang outside the supported range (the version lookup faked before plugins load): the flag value
# and the Engine keyword must still mean SGLang's default prefill backend, with the one warning register() gives.
UNSUPPORTED_SCENARIO = textwrap.dedent(
    """
    import argparse, json, logging, os, sys
    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("bcg_plugin").addHandler(Keep())
    from bcg_plugin.adapters.sglang import version
    version.installed = lambda: sys.argv[2]
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    load_plugins()
    import bcg_plugin.adapters.sglang as adapter
    adapter.register()  # re-entrant: no second warning
    from sglang.srt.server_args import ServerArgs
    out = {"active": adapter.is_active(), "hooks": sorted(HookRegistry._hooks), "after_register": list(warnings)}
    os.environ.pop("BCG_ENABLE", None)
    model = sys.argv[1]
    base = ["--model-path", model, "--skip-tokenizer-init", "--load-format", "dummy", "--device", "cpu"]

    def described(args):
        if hasattr(args, "resolve_once"):
            args.resolve_once()
        if hasattr(args, "resolved_dict"):
            prefill = args.resolved_dict()["cuda_graph_config"]["prefill"]["backend"]
        else:
            prefill = args.cuda_graph_config.prefill.backend
        return {"flag": args.cuda_graph_backend_prefill, "prefill": prefill, "env": os.environ.get("BCG_ENABLE")}

    def cli(extra):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        try:
            return described(ServerArgs.from_cli_args(parser.parse_args(base + extra)))
        except SystemExit as e:
            return {"exit": e.code}
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e)}

    out["plain"] = cli([])
    out["cli_bcg"] = cli(["--cuda-graph-backend-prefill", "bcg"])
    out["after_cli"] = list(warnings)
    try:
        out["engine_kwargs"] = described(ServerArgs(model_path=model, skip_tokenizer_init=True, load_format="dummy",
                                                    device="cpu", cuda_graph_backend_prefill="bcg"))
    except Exception as e:
        out["engine_kwargs"] = {"error": type(e).__name__, "message": str(e)}
    out["warnings"] = list(warnings)
    print("SCENARIO " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3-0.6b-config")
    (d / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    return str(d)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_scenario(model_dir, *args, scenario=SCENARIO, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("BCG_")}
    full.update(env, PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                                                           if p))
    proc = subprocess.run([sys.executable, "-c", scenario, model_dir, *args], env=full, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SCENARIO ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("SCENARIO "):])


LAUNCH_WITH_BCG = textwrap.dedent(
    """
    import sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    args = prepare_server_args(["--model-path", sys.argv[1], "--skip-tokenizer-init", "--load-format", "dummy",
                                "--device", "cpu", "--cuda-graph-backend-prefill", "bcg", *sys.argv[2:]])
    if hasattr(args, "resolve_once"):  # from 0.5.19 the launch resolves the arguments in a step of its own
        args.resolve_once()
    print("LAUNCHED")
    """
)


@pytest.mark.parametrize("env, args, message", [
    ({"BCG_SIZES": "16,,x"}, [], "BCG_SIZES must be positive integers separated by commas"),
    ({"BCG_MAX_TOKENS": "0"}, [], "BCG_MAX_TOKENS=0 disables it"),
    ({"BCG_ENABLE": "maybe"}, [], "'enable' must be true or false, got 'maybe'"),  # before the flag sets it
    # SGLang's own breakable runner refuses this too, later, with a traceback
    ({"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}, ["--enable-memory-saver"], "--cuda-graph-backend-prefill full"),
    ({}, ["--enable-memory-saver"], None),  # no graph memory released: bcg runs
    # sizes no prefill step reaches: refused before any scheduler starts, not inside its traceback
    ({"BCG_SIZES": "16,4096"}, ["--chunked-prefill-size", "2048"], "BCG_SIZES has [4096] above 2048"),
    ({"BCG_SIZES": "16,4096"}, ["--chunked-prefill-size", "2048", "--tp-size", "3"], "BCG_SIZES has [4096] above 2052"),
    ({"BCG_SIZES": "16,2048"}, ["--chunked-prefill-size", "2048"], None),
    ({"BCG_SIZES": "16,4096"}, ["--chunked-prefill-size", "-1"], None),  # chunked prefill off: no ceiling
    ({"BCG_SIZES": "16,4096"}, ["--chunked-prefill-size", "-1", "--cuda-graph-max-bs-prefill", "1024"],
     "above 1024, the most tokens SGLang's prefill graphs of this engine reach (prefill graphs up to 1024 tokens; "
     "chunked prefill off); drop those sizes, or raise --cuda-graph-max-bs-prefill"),
    ({}, [], None),
])
def test_a_bad_value_stops_sglangs_command_line_with_one_line(model_dir, config_error_line, env, args, message):
    full = {k: v for k, v in os.environ.items() if not k.startswith("BCG_")}
    full.update(env, PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                                                           if p))
    full.pop("SGLANG_MEMORY_SAVER_CUDA_GRAPH", None)
    full.update(env)
    proc = subprocess.run([sys.executable, "-c", LAUNCH_WITH_BCG, model_dir, *args], env=full, capture_output=True,
                          text=True, timeout=600)
    if message is None:
        assert proc.returncode == 0 and "LAUNCHED" in proc.stdout, proc.stderr[-3000:]
        return
    config_error_line(proc, message)


def _flag_args(flag):
    return types.SimpleNamespace(cuda_graph_backend_prefill=flag, cuda_graph_backend_decode=None,
                                 enable_memory_saver=False)


@pytest.fixture
def fresh_launch(monkeypatch):
    from bcg_plugin.adapters.sglang import launch

    monkeypatch.setattr(launch, "_set_by_flag", False)
    monkeypatch.setattr(launch, "_replaced", None, raising=False)
    for name in [n for n in os.environ if n.startswith("BCG_")]:
        monkeypatch.delenv(name)
    yield launch
    os.environ.pop("BCG_ENABLE", None)  # what the launches set; monkeypatch then puts back what was there


@pytest.mark.parametrize("env, message", [
    ({"BCG_MAX_TOKENS": "0"}, "BCG_MAX_TOKENS=0 disables it"),
    ({"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}, "--enable-memory-saver"),
])
def test_a_refused_launch_leaves_no_bcg_enable_behind(fresh_launch, monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = _flag_args("bcg")
    args.enable_memory_saver = "SGLANG_MEMORY_SAVER_CUDA_GRAPH" in env
    with pytest.raises(BcgConfigError, match=message):
        fresh_launch.translate_server_args(args)
    assert "BCG_ENABLE" not in os.environ  # the processes this one starts next would inherit it
    assert args.cuda_graph_backend_prefill == "bcg"


FAILED_LAUNCH = textwrap.dedent(
    """
    import json, os, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    argv = ["--model-path", sys.argv[1], "--skip-tokenizer-init", "--load-format", "dummy", "--device", "cpu",
            "--cuda-graph-backend-prefill", "bcg", *sys.argv[2:]]
    out, args = {}, None
    try:
        args = prepare_server_args(argv)
        if hasattr(args, "resolve_once"):
            args.resolve_once()
        out["error"] = None
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["env"] = os.environ.get("BCG_ENABLE")
    if args is not None and out["error"] is not None:  # the record a refused resolution leaves (0.5.19 on)
        try:
            args.resolve_once()
            out["again"] = "resolved"
        except Exception as e:
            out["again"] = str(e)
    print("SCENARIO " + json.dumps(out))
    """
)


@pytest.mark.parametrize("user", [None, "0"])
@pytest.mark.parametrize("env, args, error", [
    ({"BCG_SIZES": "16,4096"}, ["--chunked-prefill-size", "2048"], "BcgConfigError: BCG_SIZES has [4096] above 2048"),
    ({}, ["--tp-size", "3", "--dp-size", "2", "--enable-dp-attention"], "AssertionError"),  # SGLang's own refusal
])
def test_a_launch_whose_resolution_fails_gives_bcg_enable_back(model_dir, user, env, args, error):
    """After the flag set ``BCG_ENABLE``, a resolution that fails (bcg's sizes check, or SGLang's
    own) gives it back as the flag found it, for the processes this one starts next; a record
    bcg refused is marked failed, as SGLang marks its own, so it cannot launch without bcg later."""
    out = run_scenario(model_dir, *args, scenario=FAILED_LAUNCH, **env, **({"BCG_ENABLE": user} if user else {}))
    assert out["error"] is not None and out["error"].startswith(error), out
    assert out["env"] == user, out
    if "again" in out:
        assert "already failed" in out["again"], out


@pytest.mark.parametrize("user", [None, "1", "0"])
def test_a_launch_without_the_flag_gets_the_users_own_bcg_enable_back(fresh_launch, monkeypatch, user):
    if user is not None:
        monkeypatch.setenv("BCG_ENABLE", user)
    fresh_launch.translate_server_args(_flag_args("bcg"))
    fresh_launch.translate_server_args(_flag_args("bcg"))  # a second Engine with the flag
    assert os.environ.get("BCG_ENABLE") == "1"
    fresh_launch.translate_server_args(_flag_args(None))
    assert os.environ.get("BCG_ENABLE") == user


def test_a_value_the_user_sets_between_launches_is_the_one_given_back(fresh_launch):
    fresh_launch.translate_server_args(_flag_args("bcg"))
    os.environ["BCG_ENABLE"] = "0"  # the user's own, between two engines
    fresh_launch.translate_server_args(_flag_args("bcg"))
    assert os.environ.get("BCG_ENABLE") == "1"
    fresh_launch.translate_server_args(_flag_args(None))
    assert os.environ.get("BCG_ENABLE") == "0"


@pytest.fixture(scope="module")
def enabled(model_dir):
    return run_scenario(model_dir, BCG_ENABLE="1")


@pytest.fixture(scope="module")
def not_enabled(model_dir):
    return run_scenario(model_dir)


@pytest.fixture(scope="module")
def unsupported(model_dir):
    return run_scenario(model_dir, "0.6.0", scenario=UNSUPPORTED_SCENARIO, BCG_ENABLE="1")


def test_unsupported_sglang_warns_once_and_installs_only_the_launch_patches(unsupported):
    assert len(unsupported["after_register"]) == 1, unsupported["after_register"]
    assert "sglang 0.6.0 is outside the range" in unsupported["after_register"][0]
    assert not unsupported["active"]
    assert not RUNTIME_TARGETS & set(unsupported["hooks"])  # BCG_ENABLE=1 or not: bcg's runtime stays out
    assert LAUNCH_TARGETS <= set(unsupported["hooks"])


def test_unsupported_sglang_cli_flag_runs_sglangs_default_prefill_backend(unsupported):
    plain, bcg = unsupported["plain"], unsupported["cli_bcg"]
    assert "prefill" in plain, plain
    assert bcg == {"flag": None, "prefill": plain["prefill"], "env": None}, bcg  # argparse accepted it
    assert unsupported["after_cli"] == unsupported["after_register"]  # no warning beyond register()'s one


def test_unsupported_sglang_engine_keyword_runs_sglangs_default_prefill_backend(unsupported):
    assert unsupported["engine_kwargs"] == {"flag": None, "prefill": unsupported["plain"]["prefill"], "env": None}
    assert len(unsupported["warnings"]) == 1, unsupported["warnings"]


def test_enabled_scheduler_installs_every_hook_once(enabled):
    assert enabled["active"]
    assert set(enabled["installed"]) == RUNTIME_TARGETS | LAUNCH_TARGETS | BACKENDS_TARGETS | RUNTIME_WRAPS
    assert all(enabled["hooks"][t] == 1 for t in RUNTIME_TARGETS | LAUNCH_TARGETS)
    assert not RUNTIME_WRAPS & set(enabled["hooks"])  # wrapped or rebound by bcg, not through HookRegistry
    assert ("bcg" in enabled["backends"]) == LAZY_CHOICES  # from 0.5.20 Backend.ALL stays SGLang's


def test_not_enabled_is_harmless(not_enabled):
    assert not_enabled["active"]
    assert set(not_enabled["installed"]) == LAUNCH_TARGETS | BACKENDS_TARGETS  # the flag and its translation only
    assert not not_enabled["capture_wrapped"]  # SGLang's prefill runner untouched
    assert not RUNTIME_TARGETS & set(not_enabled["hooks"])
    plain = not_enabled["cli_plain"]
    assert plain["flag"] is None and plain["env"] is None


@pytest.mark.parametrize("scenario", ["enabled", "not_enabled"])
def test_cli_and_engine_flag_enable_bcg(scenario, request):
    out = request.getfixturevalue(scenario)
    bcg, plain = out["cli_bcg"], out["cli_plain"]
    # "bcg" parses, becomes SGLang's auto choice (same resolved backend as no flag) + BCG_ENABLE.
    assert bcg == {"flag": None, "prefill": plain["prefill"], "env": "1"}, bcg
    assert out["cli_after"]["env"] is None
    assert out["engine_kwargs"] == {"flag": None, "env": "1"}
    if LAZY_CHOICES:  # the decode option shares Backend.ALL, so argparse passes the value to the translation
        assert out["cli_decode_bcg"]["error"] == "BcgConfigError" and "prefill" in out["cli_decode_bcg"]["message"]
    else:  # the decode option keeps SGLang's choices: argparse rejects it
        assert out["cli_decode_bcg"] == {"exit": 2}, out["cli_decode_bcg"]
    decode = out["engine_decode_bcg"]
    assert decode.get("error") == "BcgConfigError" and "prefill" in decode["message"], decode
    assert out["cli_bad_sizes"]["error"] == "BcgConfigError" and "BCG_SIZES" in out["cli_bad_sizes"]["message"]


def test_dp_token_counts_outlive_the_dummy_batch_that_brought_them():
    import gc
    import weakref

    import torch

    from bcg_plugin.adapters.sglang.host import SglangHost

    host = SglangHost.__new__(SglangHost)
    host._dp, host.device, host._dp_counts = 2, torch.device("cpu"), {}
    first = host._dp_fields(64)
    alive = weakref.ref(first["global_num_tokens_gpu"])
    del first
    gc.collect()
    # A graph captured with that dummy batch may read the tensor by address at every replay.
    assert alive() is not None and alive().tolist() == [64, 64]
    assert host._dp_fields(64)["global_num_tokens_gpu"] is alive()


def planning_runner(planned: list, graph_planned: list | None = None, graph_buckets: frozenset = frozenset()):
    """A runner whose eager plans go to ``planned``, and graph buckets' plans to ``graph_planned``."""
    r = BcgPrefillRunner.__new__(BcgPrefillRunner)
    r.model_runner = types.SimpleNamespace(attn_backend=types.SimpleNamespace(init_forward_metadata=planned.append),
                                           model=object())
    r.core = PrefillGraphRunner.__new__(PrefillGraphRunner)  # the core's own rule of where attention runs
    r.core.graph_attention, r.core.graph_variants = graph_buckets, {}
    graph_planned = graph_planned if graph_planned is not None else []
    r.host = types.SimpleNamespace(graph=types.SimpleNamespace(
        plan_replay=lambda fb, variant=None: graph_planned.append(fb if variant is None else (fb, variant))))
    r._previous_replay = None
    return r


def extend_batch(n: int = 8):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, input_ids=[0] * n, moe_num_token_non_padded=None)


def test_attention_is_planned_in_the_forward_context_sglang_plans_it_in():
    """0.5.23 plans a batch's attention inside a forward context carrying the batch; before, outside any."""
    import inspect as inspect_

    from sglang.srt.model_executor import forward_context

    seen = []
    r = planning_runner([])
    r.model_runner.attn_backend.init_forward_metadata = lambda fb: seen.append(forward_context._current)
    r._plan_attention(extend_batch(), 8)
    if "forward_batch" in inspect_.signature(forward_context.forward_context).parameters:
        assert seen[0] is not None and seen[0].attn_backend is r.model_runner.attn_backend
    else:
        assert seen == [None]
    assert forward_context._current is None  # left as found


def test_replays_plan_their_own_batch_without_a_fault_plugin():
    planned = []
    r = planning_runner(planned)
    first, second = extend_batch(), extend_batch()
    r._plan_attention(first, 8)
    r._plan_attention(second, 8)
    assert planned == [first, second] and r._previous_replay is None  # nothing kept for a fault


def test_graph_attention_buckets_plan_into_the_graphs_wrappers_and_the_others_eagerly():
    planned, graph_planned = [], []
    r = planning_runner(planned, graph_planned, graph_buckets=frozenset({8}))
    small, large = extend_batch(8), extend_batch(16)
    r._plan_attention(small, 8)
    r._plan_attention(large, 16)
    assert graph_planned == [small] and planned == [large]


def test_stale_metadata_fault_plans_the_earlier_batch_into_a_graph_buckets_wrappers(stale_metadata_fault):
    """The negative control reaches attention inside the graph: its wrappers get the earlier batch's plan."""
    planned, graph_planned = [], []
    r = planning_runner(planned, graph_planned, graph_buckets=frozenset({8}))
    first = extend_batch()
    r._plan_attention(first, 8)
    r._plan_attention(extend_batch(), 8)
    assert graph_planned == [first, first] and planned == []
    r._plan_attention(extend_batch(), 8, "fresh")  # and the wrapper of the variant the live step replays in
    assert graph_planned[-1] == (first, "fresh") and planned == []


def test_stale_metadata_fault_never_plans_from_an_idle_dp_forward(stale_metadata_fault):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    planned = []
    r = planning_runner(planned)
    idle = types.SimpleNamespace(forward_mode=ForwardMode.IDLE, input_ids=[0] * 8)
    extend = extend_batch()
    r._previous_replay = idle
    r._plan_attention(extend, 8)
    assert planned == [extend]  # an idle forward's metadata is decode-shaped: never reused
    r._plan_attention(extend_batch(), 8)
    assert planned[-1] is extend  # the negative control reuses a previous extend's plan
    r._plan_attention(extend_batch(16), 16)
    assert len(planned[-1].input_ids) == 16  # another token count: out of bounds, so the live plan


def test_engine_results_are_kept_and_reused_across_commands(tmp_path, monkeypatch, gpu_test_module):
    """BCG_TEST_RESULTS_DIR: an engine that finished in one command is not run again in the next."""
    gpu_test = gpu_test_module("test_sglang_gpu")
    calls = []

    def run():
        calls.append(1)
        return {"results": [{"input_token_logprobs": [(-1.5, 7, None)]}], "forwards": []}

    monkeypatch.setattr(gpu_test, "RESULTS_DIR", None)
    assert gpu_test.kept("eager", run) == gpu_test.kept("eager", run) and len(calls) == 2  # no dir: runs each time
    monkeypatch.setattr(gpu_test, "RESULTS_DIR", str(tmp_path))
    first = gpu_test.kept("eager", run)
    again = gpu_test.kept("eager", run)
    assert len(calls) == 3 and first == again == {"results": [{"input_token_logprobs": [[-1.5, 7, None]]}],
                                                  "forwards": []}
    layout = f"{gpu_test.MODEL}-tp{gpu_test.TP}-dp{gpu_test.DP}"
    assert [p.name for p in tmp_path.iterdir()] == [f"sglang-eager-{layout}.json"]


def _meta(logprobs: list[float]) -> dict:
    """SGLang's ``meta_info`` of a request whose only logprobs are its input tokens'."""
    return {"input_token_logprobs": [(x, 7, None) for x in logprobs], "input_top_logprobs": [],
            "output_token_logprobs": [], "output_top_logprobs": []}


def test_the_check_refuses_logits_too_flat_to_see_a_stale_replay(gpu_test_module):
    """SGLang's unscaled dummy weights spread logprobs ~1e-5 nats: a stale replay hid in that noise."""
    gpu_test = gpu_test_module("test_sglang_gpu")

    assert gpu_test.spread_of([_meta([-12.0, -10.0, -11.0])]) == pytest.approx(0.8165, rel=1e-3)
    with pytest.raises(AssertionError, match="too flat"):
        gpu_test.spread_of([_meta([-11.93, -11.93002, -11.93001])])


def test_moe_check_tolerates_a_few_perturbed_positions_and_still_sees_a_stale_replay(gpu_test_module):
    """MoE: a few tokens whose experts flipped pass; a request moved almost everywhere fails, as dense does."""
    gpu_test = gpu_test_module("test_sglang_gpu")

    ref = [-10.0 - 0.01 * i for i in range(100)]
    flipped = [x + (0.6 if i % 20 == 0 else 0.02) for i, x in enumerate(ref)]  # 5% moved by 0.6
    stale = [x + (0.01 if i % 10 == 0 else 2.0) for i, x in enumerate(ref)]  # 90% moved by 2
    moe, dense = gpu_test.error_quantile("qwen3-30b-a3b"), gpu_test.error_quantile("qwen3-0.6b")
    assert (moe, dense) == (gpu_test.MOE_QUANTILE, 1.0)
    assert gpu_test.request_error(_meta(flipped), _meta(ref), 1.0, moe) == pytest.approx(0.02)
    assert gpu_test.request_error(_meta(flipped), _meta(ref), 1.0, dense) == pytest.approx(0.6)  # fails dense
    for q in (moe, dense):
        assert gpu_test.request_error(_meta(stale), _meta(ref), 1.0, q) == pytest.approx(2.0)
    assert gpu_test.TOL < 0.6


def test_with_graph_variants_each_position_is_held_to_the_nearer_of_two_references(gpu_test_module):
    """A fresh step's positions match eager's ragged prefill, a prefix step's full's paged one: each
    position passes against either; a stale replay, far from both, still fails."""
    gpu_test = gpu_test_module("test_sglang_gpu")

    full = [-10.0 - 0.01 * i for i in range(20)]
    eager = [x + 0.5 for x in full]  # the two host modes apart by more than the tolerance
    bcg = eager[:10] + full[10:]  # a fresh first chunk, then a chunk on its cached prefix
    stale = [x + 2.0 for x in full]
    assert gpu_test.request_error(_meta(bcg), _meta(full), 1.0, 1.0) == pytest.approx(0.5)  # full alone: fails
    assert gpu_test.request_error(_meta(bcg), _meta(full), 1.0, 1.0, also=_meta(eager)) == pytest.approx(0.0)
    assert gpu_test.request_error(_meta(stale), _meta(full), 1.0, 1.0, also=_meta(eager)) == pytest.approx(1.5)
    assert gpu_test.TOL < 0.5


@pytest.mark.parametrize("variants, second", [({"16": ["fresh"]}, True), ({}, False)])
def test_only_a_run_that_captured_a_variant_is_held_to_eager_beside_full(gpu_test_module, monkeypatch, variants,
                                                                          second):
    """Variants are on by default, but fa3 and older flashinfer capture none: such a run is held
    to ``full`` alone, as before variants existed."""
    gpu_test = gpu_test_module("test_sglang_gpu")
    monkeypatch.setattr(gpu_test, "REFERENCE", "full")  # a suite with attention inside the graph
    out = {"results": [_meta([-1.0])], "probes": [_meta([-2.0])]}
    runs = {"eager": out, "full": out, "bcg": {**out, "captures": [
        {"runner": "BcgPrefillRunner", "rank": 0, "bcg_graph_variants": variants}]}}
    also = gpu_test.second_references(runs, "bcg", against="full")
    assert (also["results"] == out["results"]) is second and (also["probes"] == out["probes"]) is second
    assert gpu_test.second_references(runs, "full_again", against="full")["results"] == [None]


@pytest.mark.parametrize("max_bs, pool_rows, context_len, top", [
    (8192, 2, 2048, 4096),  # --max-running-requests 2 --context-length 2048, SGLang's 8192 chunk on an H200
    (8192, 1, 4096, 4096),
    (8192, 2048, 4096, 8192),  # SGLang's own pool sizes (2048-4096 rows) never bind
    (None, 4, 256, 1024),  # no prefill max_bs: the chunked-prefill size, then the pool
])
def test_the_ladder_stops_at_what_the_request_pool_can_hold(monkeypatch, caplog, max_bs, pool_rows, context_len,
                                                            top):
    """bcg's capture batch for a bucket is as few requests of context_len as it needs, at request rows
    0, 1, ...: past the pool's rows for a bucket no step can reach."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from bcg_plugin.adapters.sglang.replay import step_token_limit

    scattered_rows(monkeypatch, None)
    pool = ReqToTokenPool(size=pool_rows, max_context_len=context_len + 4, device="cpu", enable_memory_saver=False)
    prefill = types.SimpleNamespace(max_bs=max_bs, bs=[16, 32, 64])
    runner = types.SimpleNamespace(
        server_args=types.SimpleNamespace(cuda_graph_config=types.SimpleNamespace(prefill=prefill),
                                          chunked_prefill_size=8192, enable_two_batch_overlap=False),
        req_to_token_pool=pool, model_config=types.SimpleNamespace(context_len=context_len),
        ps=types.SimpleNamespace(tp_rank=0),
    )
    with caplog.at_level(logging.INFO, logger="bcg_plugin.sglang"):
        assert step_token_limit(runner, log=True) == top
    capped = [r.getMessage() for r in caplog.records if "more than a step can schedule" in r.getMessage()]
    assert len(capped) == (top < 8192)
    buckets = PrefillGraphRunner(plugin_manager(), BcgConfig(enable=True), chunk_size=top, device="cpu").buckets
    rows_needed = -(-buckets[-1] // context_len)  # the top bucket's capture batch, in request rows
    assert buckets[-1] == top and rows_needed <= pool.req_to_token.shape[0]


def test_the_bench_runs_the_modes_the_installed_sglang_has():
    from bcg_bench import sglang_mode

    assert sglang_mode.MODES["full"] == "full" and sglang_mode.MODES["native"] == "breakable"
    assert sglang_mode.mode_problem("tc_piecewise", "0.5.21") is None
    problem = sglang_mode.mode_problem("tc_piecewise", "0.5.22")
    assert problem is not None and "removed it in 0.5.22" in problem and "full" in problem
    assert all(sglang_mode.mode_problem(m, "0.5.23") is None for m in ("disabled", "native", "full", "bcg"))
    with pytest.raises(SystemExit) as e:  # one line and exit 2 where the installed SGLang lacks the mode
        sglang_mode.main(["--mode", "tc_piecewise", "--out", os.devnull]) if sglang_mode.mode_problem(
            "tc_piecewise", version.installed()) else sglang_mode.main(["--mode", "no-such-mode", "--out", os.devnull])
    assert e.value.code == 2
