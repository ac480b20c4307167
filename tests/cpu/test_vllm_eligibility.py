"""Where bcg declines, vLLM runs as it would without the plugin: the launch flags, the late warning,
the buckets under sequence parallelism and the slot-mapping probe, against the real vllm 0.26.0 on CPU.

Engine configs are real ``VllmConfig`` objects. vLLM's CPU-only platform turns every CUDA graph off
at the end of ``__post_init__``; the fixture makes it keep its graph mode as on a CUDA host, so the
final ``cudagraph_mode`` is the one an engine would run with.
"""

from __future__ import annotations

import contextlib
import os
import dataclasses
import inspect
import logging
import types

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from bcg_plugin import BcgConfig, PrefillGraphRunner, plugin_manager  # noqa: E402
from bcg_plugin.adapters.vllm import launch, plugin  # noqa: E402
from bcg_plugin.adapters.vllm.config import (  # noqa: E402
    graphs_turned_off, prefill_graphs_wanted, sequence_parallel_multiple, unsupported_reason)
from bcg_plugin.patches.vllm import RUNNER  # noqa: E402

pytestmark = pytest.mark.vllm

UNSUPPORTED_BACKENDS = ["FLEX_ATTENTION", "FLASHINFER"]


@pytest.fixture(autouse=True)
def registered(vllm_plugin_off, vllm_graph_platform):
    plugin.register()


def engine_config(vllm_model_config, bcg=None, **kwargs):
    """The engine config vLLM builds for these arguments (``bcg``: additional_config['bcg'])."""
    from vllm.config import DeviceConfig, VllmConfig

    extra = {"additional_config": {"bcg": bcg}} if bcg is not None else {}
    return VllmConfig(model_config=vllm_model_config, device_config=DeviceConfig(device="cpu"), **extra, **kwargs)


def modes(vllm_config):
    cc = vllm_config.compilation_config
    return {"mode": cc.mode.name, "cudagraph_mode": cc.cudagraph_mode.name, "splitting_ops": list(cc.splitting_ops),
            "capture_sizes": list(cc.cudagraph_capture_sizes or [])}


def bcg_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "bcg" in r.getMessage()]


# -- the positive control: an engine bcg runs on gets its launch flags ----------------------------


@pytest.mark.parametrize("torch_compile, mode", [(True, "VLLM_COMPILE"), (False, "NONE")])
def test_an_eligible_engine_gets_decode_only_graphs_and_bcg_runs(vllm_model_config, torch_compile, mode):
    plain = engine_config(vllm_model_config)
    cfg = engine_config(vllm_model_config, {"enable": True, "torch_compile": torch_compile})
    assert modes(plain)["cudagraph_mode"] == "FULL_AND_PIECEWISE" and modes(plain)["mode"] == "VLLM_COMPILE"
    assert (modes(cfg)["mode"], modes(cfg)["cudagraph_mode"]) == (mode, "FULL_DECODE_ONLY")
    assert prefill_graphs_wanted(cfg)
    record = cfg.additional_config[launch.LAUNCH_RECORD_KEY]
    assert record["cudagraph_mode"] == ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"]
    assert ("mode" in record) == (not torch_compile)


# -- declined at the front-end: the engine compiles and captures exactly as without bcg ------------


def _attention(backend=None, per_kind=None):
    from vllm.config import AttentionConfig

    return {"attention_config": AttentionConfig(backend=backend, backend_per_kind=per_kind or {})}


def _graph_mode(name):
    from vllm.config import CompilationConfig

    return {"compilation_config": CompilationConfig(cudagraph_mode=name)}


def _has_sequence_parallel_pass() -> bool:
    from vllm.config.compilation import PassConfig

    return "enable_sp" in getattr(PassConfig, "__dataclass_fields__", {})


# vLLM's sequence-parallelism compile pass (PassConfig.enable_sp) is gone from 0.32.
HAS_SP_PASS = _has_sequence_parallel_pass()
needs_sp_pass = pytest.mark.skipif(not HAS_SP_PASS,
                                   reason="this vLLM has no sequence-parallelism pass (PassConfig.enable_sp, "
                                          "removed in 0.32); test_without_a_sequence_parallel_pass_* covers it")


def _sequence_parallel():
    from vllm.config import CompilationConfig, ParallelConfig

    # sp_min_token_num given: vLLM's own threshold needs its compiled ops, absent on this CPU install.
    return {"compilation_config": CompilationConfig(pass_config={"enable_sp": True, "sp_min_token_num": 64}),
            "parallel_config": ParallelConfig(tensor_parallel_size=2)}


DECLINED = {
    "flex-attention": (lambda: _attention("FLEX_ATTENTION"), "FLEX_ATTENTION"),
    "flashinfer": (lambda: _attention("FLASHINFER"), "FLASHINFER"),
    "flashinfer-per-kind": (lambda: _attention(per_kind={"full_attention": "FLASHINFER"}), "FLASHINFER"),
    "explicit-full-and-piecewise": (lambda: _graph_mode("FULL_AND_PIECEWISE"), "cudagraph_mode=FULL_AND_PIECEWISE"),
    "explicit-piecewise": (lambda: _graph_mode("PIECEWISE"), "cudagraph_mode=PIECEWISE"),
    "explicit-full": (lambda: _graph_mode("FULL"), "cudagraph_mode=FULL"),
}


@pytest.mark.parametrize("torch_compile", [True, False])
@pytest.mark.parametrize("cause", list(DECLINED))
def test_a_declined_engine_keeps_vllms_modes_and_says_so_once(vllm_model_config, caplog, cause, torch_compile):
    make, reason = DECLINED[cause]
    plain = engine_config(vllm_model_config, **make())
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        cfg = engine_config(vllm_model_config, {"enable": True, "torch_compile": torch_compile}, **make())
    assert modes(cfg) == modes(plain)
    assert modes(cfg)["cudagraph_mode"] != "FULL_DECODE_ONLY"  # vLLM's own graphs for prefill (or FULL)
    [warning] = bcg_warnings(caplog)
    assert reason in warning and "left as configured" in warning
    assert launch.LAUNCH_RECORD_KEY not in cfg.additional_config
    assert not prefill_graphs_wanted(cfg) and not plugin.arm_runner_patches(cfg)  # the workers agree
    assert not RUNNER.applied


@needs_sp_pass
def test_sequence_parallelism_with_torch_compile_declines_and_without_it_runs(vllm_model_config, caplog):
    plain = engine_config(vllm_model_config, **_sequence_parallel())
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        compiled = engine_config(vllm_model_config, {"enable": True}, **_sequence_parallel())
    assert modes(compiled) == modes(plain) and modes(plain)["splitting_ops"] == []  # the body compiled whole
    [warning] = bcg_warnings(caplog)
    assert "sequence parallelism with torch_compile" in warning and '"torch_compile": false' in warning
    assert not prefill_graphs_wanted(compiled)
    uncompiled = engine_config(vllm_model_config, {"enable": True, "torch_compile": False}, **_sequence_parallel())
    assert (modes(uncompiled)["mode"], modes(uncompiled)["cudagraph_mode"]) == ("NONE", "FULL_DECODE_ONLY")
    assert prefill_graphs_wanted(uncompiled) and sequence_parallel_multiple(uncompiled) == 2


def test_a_runner_patch_that_fails_verification_declines_before_any_flag_changes(vllm_model_config, caplog,
                                                                                 monkeypatch):
    first = RUNNER.active()[0]
    monkeypatch.setattr(first, "how", dataclasses.replace(first.how, params=["self", "no_such_parameter"]))
    plugin.unregister()
    plugin.register()  # the entry patches still verify: config hooks in, the runner set does not
    plain = engine_config(vllm_model_config)
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        cfg = engine_config(vllm_model_config, {"enable": True, "torch_compile": False})
    assert modes(cfg) == modes(plain)
    [warning] = bcg_warnings(caplog)
    assert "the vLLM model runner changed" in warning and "no_such_parameter" in warning


# -- declined in a worker, after the front-end set the flags: one warning that says what runs --------


def _attention_groups(backend):
    group = types.SimpleNamespace(backend=types.SimpleNamespace(get_name=lambda: backend))
    return [[group]]


def _kv_cache_config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return types.SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)])


def _full_attention():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)


def _mamba():
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,))


class _Model(torch.nn.Module):
    def embed_input_ids(self, ids):
        return ids


@pytest.mark.parametrize("backend, specs, reason", [
    ("FLEX_ATTENTION", [_full_attention], "['FLEX_ATTENTION']"),  # chosen by vLLM itself: only a runner shows it
    ("FLASH_ATTN", [_full_attention, _mamba], "KV-cache groups other than attention"),
])
@pytest.mark.parametrize("torch_compile", [True, False])
def test_a_runner_bcg_cannot_serve_warns_once_with_what_the_engine_runs(vllm_model_config, caplog, monkeypatch, backend,
                                                                         specs, reason, torch_compile):
    from bcg_plugin.adapters.vllm import replay

    monkeypatch.setattr(replay.torch.cuda, "is_available", lambda: True)
    cfg = engine_config(vllm_model_config, {"enable": True, "torch_compile": torch_compile})
    assert prefill_graphs_wanted(cfg)  # the front-end could not see it
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        for reports in (False, True, True):  # V1: the memory estimate, then the capture (twice: said once)
            built = replay.VllmPrefillGraphs.build(
                lambda: pytest.fail("no host is built for a runner bcg declines"), cfg, model=_Model(),
                attn_groups=_attention_groups(backend), kv_cache_config=_kv_cache_config(*(s() for s in specs)),
                reports=reports)
            assert built is None
    [warning] = bcg_warnings(caplog)
    assert reason in warning
    assert "prefill and mixed batches run eagerly" in warning
    assert ("without torch.compile" in warning) == (not torch_compile)
    assert "decode keeps vLLM's FULL graphs" in warning
    restart = "restart without bcg (no additional_config['bcg']) to get vLLM's FULL_AND_PIECEWISE graphs"
    assert restart in warning and ("and torch.compile back" in warning) == (not torch_compile)


def _kv_offloading():
    from vllm.config import CacheConfig

    return {"cache_config": CacheConfig(kv_offloading_size=1.0)}


def _prefetch_offloading():
    from vllm.config import OffloadConfig

    return {"offload_config": OffloadConfig(prefetch={"offload_group_size": 2})}


@pytest.mark.parametrize("make, reason", [
    # vLLM derives a KV connector from it at the end of its config's start, after bcg's launch flags.
    (_kv_offloading, "KV offloading (a KV connector)"),
    (_prefetch_offloading, "prefetch weight offloading"),
])
def test_offloading_is_declined_before_any_launch_flag_changes(vllm_model_config, caplog, make, reason):
    plain = engine_config(vllm_model_config, **make())
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        cfg = engine_config(vllm_model_config, {"enable": True}, **make())
    assert modes(cfg) == modes(plain) and launch.LAUNCH_RECORD_KEY not in cfg.additional_config
    [warning] = bcg_warnings(caplog)
    assert reason in warning and "left as configured" in warning
    assert not plugin.arm_runner_patches(cfg) and not RUNNER.applied


@pytest.mark.parametrize("user_mode", [None, "FULL_DECODE_ONLY"])
def test_graphs_vllm_turned_off_after_bcg_set_its_mode_keep_bcg_off_with_one_warning(vllm_model_config, caplog,
                                                                                      user_mode):
    """vLLM turns every CUDA graph off late in its config's start for something eager-only (0.33 did
    for the MoonEP all-to-all, which bcg now also declines up front), after bcg's launch under
    FULL_DECODE_ONLY (its own or the user's)."""
    from vllm.config.compilation import CUDAGraphMode

    cfg = engine_config(vllm_model_config, {"enable": True}, **(_graph_mode(user_mode) if user_mode else {}))
    assert prefill_graphs_wanted(cfg)
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.NONE  # what vLLM's later step leaves
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        assert not plugin.arm_runner_patches(cfg)
        assert not plugin.arm_runner_patches(cfg)  # a second worker in the process: said once
    [warning] = bcg_warnings(caplog)
    assert "vLLM turned CUDA graphs off for this engine after bcg's launch under cudagraph_mode=FULL_DECODE_ONLY" \
        in warning
    assert "prefill and mixed batches run eagerly" in warning and not RUNNER.applied
    assert "FULL_AND_PIECEWISE graphs back" not in warning  # vLLM would turn those off without bcg too
    # A copy runs vLLM's config start again on the same compilation config, now NONE, which empties
    # the capture sizes: it stays declined, and so does the original.
    copy = dataclasses.replace(cfg)
    assert graphs_turned_off(copy) and graphs_turned_off(cfg)


def test_the_moonep_all_to_all_is_declined_even_where_graphs_were_off_already(vllm_model_config):
    """vLLM turns graphs off for MoonEP only where they are on, so under graphs already off (no decode
    graph asked for) its later step would not keep bcg from capturing the eager-only all-to-all: bcg
    declines it by name."""
    cfg = engine_config(vllm_model_config, {"enable": True})
    if not hasattr(type(cfg.parallel_config), "use_all2all"):
        pytest.skip("this vLLM has no MoonEP all-to-all")
    assert unsupported_reason(cfg) is None
    cfg.parallel_config.all2all_backend = "moonep"
    cfg.parallel_config.data_parallel_size = 2  # MoonEP's all-to-all runs where vLLM uses one
    assert "MoonEP" in (unsupported_reason(cfg) or "")


@pytest.mark.parametrize("no_decode_graphs", [{"decode_cudagraph_capture_request_sizes": []},
                                              {"max_decode_cudagraph_capture_requests": 0}])
def test_graphs_vllm_turned_off_for_want_of_capture_sizes_keep_bcg_on(vllm_model_config, caplog, no_decode_graphs):
    """No capture size left for vLLM's decode graphs (none asked for) makes vLLM set cudagraph_mode
    NONE; that is vLLM's own graphs, not something in the engine that must run eagerly, and bcg
    captures without them as under a NONE the user chose."""
    from vllm.config import CompilationConfig

    if "decode_cudagraph_capture_request_sizes" not in CompilationConfig.__dataclass_fields__:
        pytest.skip("vLLM sizes its decode graphs apart from its prefill graphs from 0.34")
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        cfg = engine_config(vllm_model_config, {"enable": True},
                            compilation_config=CompilationConfig(**no_decode_graphs))
    assert cfg.compilation_config.cudagraph_mode.name == "NONE"  # vLLM's doing, after bcg's launch
    assert cfg.additional_config[launch.LAUNCH_RECORD_KEY].get("graphs") == "FULL_DECODE_ONLY"
    assert plugin.arm_runner_patches(cfg) and not bcg_warnings(caplog)


def test_a_config_copy_keeps_what_the_first_start_recorded(vllm_model_config):
    cfg = engine_config(vllm_model_config, {"enable": True, "torch_compile": False})
    first = dict(cfg.additional_config[launch.LAUNCH_RECORD_KEY])
    launch.configure_engine(cfg)  # __post_init__ of a copy: nothing left to change
    assert cfg.additional_config[launch.LAUNCH_RECORD_KEY] == first and "cudagraph_mode" in first


def test_a_worker_with_additional_config_of_another_type_is_left_alone(vllm_model_config):
    cfg = engine_config(vllm_model_config)
    cfg.additional_config = types.SimpleNamespace(compute_hash=lambda: "h")  # vLLM takes dict | SupportsHash
    assert not plugin.arm_runner_patches(cfg) and not RUNNER.applied


def test_a_graph_mode_of_none_the_user_chose_keeps_bcg_on(vllm_model_config, caplog):
    cfg = engine_config(vllm_model_config, {"enable": True}, **_graph_mode("NONE"))
    assert "cudagraph_mode" not in cfg.additional_config[launch.LAUNCH_RECORD_KEY]
    assert prefill_graphs_wanted(cfg) and not bcg_warnings(caplog)


def test_bcg_variables_in_the_environment_are_named_as_unread_by_vllm(vllm_model_config, caplog, monkeypatch):
    monkeypatch.setenv("BCG_ENABLE", "1")
    monkeypatch.setenv("BCG_MAX_TOKENS", "4096")
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        cfg = engine_config(vllm_model_config)
    [warning] = bcg_warnings(caplog)
    assert "additional_config['bcg'] only; BCG_ENABLE, BCG_MAX_TOKENS are ignored" in warning
    assert not prefill_graphs_wanted(cfg)  # nothing enabled from them


def test_the_late_warning_names_only_what_bcg_changed(vllm_model_config, caplog):
    from vllm.config import CompilationConfig

    # The user chose FULL_DECODE_ONLY: a restart without bcg would not bring piecewise graphs back.
    cfg = engine_config(vllm_model_config, {"enable": True},
                        compilation_config=CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY"))
    assert cfg.additional_config[launch.LAUNCH_RECORD_KEY] == {"graphs": "FULL_DECODE_ONLY"}  # changed nothing
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        launch.warn_declined(cfg, "something only a runner shows")
    [warning] = bcg_warnings(caplog)
    assert "decode keeps vLLM's FULL graphs" in warning and "restart" not in warning


def test_a_failed_capture_with_eager_fallback_warns_once_with_what_the_engine_runs(vllm_model_config, caplog):
    from bcg_plugin.adapters.vllm.replay import VllmPrefillGraphs

    cfg = engine_config(vllm_model_config, {"enable": True, "torch_compile": False})
    graphs = object.__new__(VllmPrefillGraphs)
    graphs._reports = True
    graphs.host = types.SimpleNamespace(vllm_config=cfg, capturing=contextlib.nullcontext, capture_contexts={},
                                        lower_graph_bound=lambda: None)
    # What the core leaves after a capture failed on some rank with capture_failure "eager".
    graphs.runner = types.SimpleNamespace(capture=lambda progress: None, captured=False, buckets=[16, 32])
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        graphs.capture()
    [warning] = bcg_warnings(caplog)
    assert "the prefill graph capture failed" in warning and "without torch.compile" in warning
    assert "restart without bcg" in warning and "FULL_AND_PIECEWISE graphs and torch.compile back" in warning


def test_runner_patches_that_fail_in_a_worker_warn_with_what_the_engine_runs(vllm_model_config, caplog, monkeypatch):
    cfg = engine_config(vllm_model_config, {"enable": True})
    first = RUNNER.active()[0]
    monkeypatch.setattr(first, "how", dataclasses.replace(first.how, params=["self", "no_such_parameter"]))
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        assert plugin.arm_runner_patches(cfg) is False
    [warning] = bcg_warnings(caplog)
    assert "the vLLM model runner changed" in warning and "prefill and mixed batches run eagerly" in warning
    assert not RUNNER.applied


# -- sequence parallelism: every bucket a multiple of the TP size ----------------------------------


def _host(vllm_config):
    from bcg_plugin.adapters.vllm.host import VllmHost

    host = object.__new__(VllmHost)
    host.vllm_config = vllm_config
    return host


def _sp_config(tp, enable_sp):
    return types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(pass_config=types.SimpleNamespace(enable_sp=enable_sp)),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp))


@pytest.mark.parametrize("tp, sizes, chunk, expected", [
    (4, None, 2050, "ladder"),  # the reference ladder (multiples of 16) but its top: 2050 -> 2048, already one
    (4, (10, 100, 1000, 2050), 2050, [12, 100, 1000, 2048]),
    (3, (16, 17, 18, 40), 100, [18, 42]),
])
def test_buckets_are_multiples_of_the_tp_size_under_sequence_parallelism(tp, sizes, chunk, expected):
    from bcg_plugin.ladder import reference_ladder

    runner = PrefillGraphRunner(plugin_manager(_host(_sp_config(tp, True))), BcgConfig(enable=True, sizes=sizes),
                                chunk_size=chunk, device="cpu")
    assert runner.buckets and all(b % tp == 0 for b in runner.buckets) and runner.buckets[-1] <= chunk
    assert runner.buckets == (reference_ladder(chunk)[:-1] if expected == "ladder" else expected)
    # Without sequence parallelism (or at TP 1) the core's buckets stand.
    for config in (_sp_config(tp, False), _sp_config(1, True)):
        plain = PrefillGraphRunner(plugin_manager(_host(config)), BcgConfig(enable=True, sizes=sizes),
                                   chunk_size=chunk, device="cpu")
        assert plain.buckets == (list(sizes) if sizes else reference_ladder(chunk))


@needs_sp_pass
def test_sequence_parallelism_is_read_where_vllm_enables_it(vllm_model_config):
    cfg = engine_config(vllm_model_config, {"enable": True, "torch_compile": False}, **_sequence_parallel())
    assert cfg.compilation_config.pass_config.enable_sp and cfg.parallel_config.tensor_parallel_size == 2
    assert _host(cfg).bcg_prefill_buckets(config=BcgConfig(enable=True, max_tokens=101, sizes=(15, 33, 101))) == [16, 34, 100]
    assert _host(engine_config(vllm_model_config, {"enable": True})).bcg_prefill_buckets(
        config=BcgConfig(enable=True, max_tokens=101, sizes=(15, 33))) is None


# -- the slot-mapping probe covers every KV-cache group ---------------------------------------------


def test_replay_checks_every_kv_cache_groups_slot_mapping_buffer():
    from bcg_plugin.adapters.vllm.replay import VllmPrefillGraphs, slot_mapping_probe

    full, window = torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64)  # two groups' buffers
    layers = {"full.0": full, "window.1": window, "full.2": full, "window.3": window}
    captured = types.SimpleNamespace(slot_mapping=layers)
    probe = slot_mapping_probe(captured)
    assert sorted(layer for layer, _ in probe) == ["full.0", "window.1"]

    graphs = object.__new__(VllmPrefillGraphs)
    graphs._buckets, graphs._slot_mapping_probe, graphs._graph_requests = frozenset({64}), probe, {}
    graphs.host = types.SimpleNamespace(embeds_in_graph=True, capture_contexts={})
    inputs = {"input_ids": torch.zeros(64, dtype=torch.int32), "positions": torch.zeros(64, dtype=torch.int64)}

    def step(slot_mapping):
        return types.SimpleNamespace(slot_mapping=slot_mapping,
                                     attn_metadata={"full.0": types.SimpleNamespace(num_actual_tokens=40)})

    assert graphs._host_batch(step(layers), inputs, 64) is not None
    moved = torch.zeros(64, dtype=torch.int64)  # the sliding-window group's buffer, re-allocated
    for changed in ({**layers, "window.1": moved, "window.3": moved}, {**layers, "full.0": moved, "full.2": moved}):
        assert graphs._host_batch(step(changed), inputs, 64) is None  # eager: a captured write would miss


@pytest.mark.skipif(HAS_SP_PASS, reason="this vLLM has the sequence-parallelism pass")
def test_without_a_sequence_parallel_pass_no_step_is_padded_to_the_tp_size(vllm_model_config):
    from pydantic import ValidationError
    from vllm.config import CompilationConfig, ParallelConfig

    with pytest.raises(ValidationError, match="enable_sp"):  # the pass bcg reads is gone from this vLLM
        CompilationConfig(pass_config={"enable_sp": True})
    cfg = engine_config(vllm_model_config, {"enable": True}, parallel_config=ParallelConfig(tensor_parallel_size=2))
    assert sequence_parallel_multiple(cfg) == 1 and prefill_graphs_wanted(cfg)
    assert _host(cfg).bcg_prefill_buckets(config=BcgConfig(enable=True, max_tokens=101, sizes=(15, 33))) is None


# -- vLLM's own breakable graphs: switched on by vLLM itself for listed architectures ---------------

# In vLLM's own list on every release bcg covers (inline through 0.28, the allow-list from 0.29).
LISTED_ARCHITECTURE = "DeepseekV4ForCausalLM"
BREAKABLE_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"


@pytest.fixture
def listed_model_config(vllm_model_config):
    """The test model's config under an architecture vLLM turns its breakable graphs on for."""
    import copy

    listed = copy.copy(vllm_model_config)
    listed.model_arch_config = copy.copy(vllm_model_config.model_arch_config)
    listed.model_arch_config.architectures = [LISTED_ARCHITECTURE]
    return listed


def test_bcg_replaces_the_breakable_graphs_vllm_turns_on_by_itself(listed_model_config, monkeypatch, caplog):
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    plugin.register()
    monkeypatch.delenv(BREAKABLE_ENV, raising=False)
    per_config = "compilation_config" in inspect.signature(is_breakable_cudagraph_enabled).parameters

    def vllm_breakable_on(cfg):  # 0.34 records the switch in the config; earlier releases in the environment
        return is_breakable_cudagraph_enabled(cfg.compilation_config) if per_config else is_breakable_cudagraph_enabled()

    plain = engine_config(listed_model_config)
    # Negative control: without bcg, vLLM switches its breakable graphs on for this architecture
    # (and with them torch.compile off).
    assert vllm_breakable_on(plain) and modes(plain)["mode"] == "NONE"
    monkeypatch.delenv(BREAKABLE_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        cfg = engine_config(listed_model_config, {"enable": True})
    assert os.environ.get(BREAKABLE_ENV) == "0" and not vllm_breakable_on(cfg)  # vLLM's path off
    assert prefill_graphs_wanted(cfg) and modes(cfg)["mode"] == "VLLM_COMPILE"  # bcg's path armed
    assert not bcg_warnings(caplog)
    if launch.vllm_breakable_default(cfg) is not None:  # vLLM's allow-list (0.29+) says what bcg replaced
        assert cfg.additional_config["bcg_launch"]["breakable"] == ["on", "off"]
        assert any(f"{BREAKABLE_ENV}=0" in r.getMessage() for r in caplog.records)


def test_breakable_graphs_the_user_asked_for_keep_bcg_off(listed_model_config, vllm_model_config, monkeypatch,
                                                          caplog):
    plugin.register()
    for model_config in (listed_model_config, vllm_model_config):
        monkeypatch.setenv(BREAKABLE_ENV, "1")
        plain = engine_config(model_config)
        launch._logged.clear()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm.bcg"):
            cfg = engine_config(model_config, {"enable": True})
        assert os.environ[BREAKABLE_ENV] == "1" and modes(cfg) == modes(plain)
        [warning] = bcg_warnings(caplog)
        assert f"{BREAKABLE_ENV}=1" in warning and not prefill_graphs_wanted(cfg)


def test_an_architecture_vllm_does_not_list_leaves_the_switch_as_vllm_would(vllm_model_config, monkeypatch):
    plugin.register()
    monkeypatch.delenv(BREAKABLE_ENV, raising=False)
    engine_config(vllm_model_config)
    assert BREAKABLE_ENV not in os.environ  # dense Qwen3: vLLM leaves its breakable graphs off
    cfg = engine_config(vllm_model_config, {"enable": True})
    assert os.environ.get(BREAKABLE_ENV) == "0" and prefill_graphs_wanted(cfg)
    assert launch.vllm_breakable_default(cfg) in (False, None)
    assert "breakable" not in cfg.additional_config.get("bcg_launch", {})
