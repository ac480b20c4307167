"""The vLLM adapter against the real vllm package installed (any release the gate declares), on CPU
(no engine is started)."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import types

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from bcg_plugin.adapters.vllm import launch, plugin, version  # noqa: E402
from bcg_plugin.adapters.vllm.config import launch_record  # noqa: E402
from bcg_plugin.patches import NOT_FILED, Patch, PatchSet, PatchTargetError, Wrap  # noqa: E402
from bcg_plugin.patches._patch import raw_attribute  # noqa: E402
from bcg_plugin.patches.vllm import ALL, ENTRY, RUNNER  # noqa: E402
from bcg_plugin import BcgCaptureError, LiveBatch, live  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_plugin_off", "vllm_graph_platform")]


def _in_host(target):
    try:
        raw_attribute(target)
    except PatchTargetError:
        return False
    return True


V1_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
needs_v1 = pytest.mark.skipif(not _in_host(f"{V1_RUNNER}.execute_model"), reason="vLLM's V1 runner is gone from 0.34")
# What vLLM removed (0.34: the V1 runner and its dispatcher): their targets have no descriptor there.
# Any other target missing from the installed vLLM is a patch target that changed.
REMOVED_OWNERS = (f"{V1_RUNNER}.", "vllm.v1.cudagraph_dispatcher.CudagraphDispatcher.")


def _gone(target):
    return target.startswith(REMOVED_OWNERS) and not _in_host(target)


def make_config(vllm_model_config, **kwargs):
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(model_config=vllm_model_config, device_config=DeviceConfig(device="cpu"), **kwargs)


def bcg_records(caplog):
    return [r for r in caplog.records if "bcg" in r.getMessage()]


def is_patched(patch) -> bool:
    if _gone(patch.target):  # a symbol this release removed cannot carry a patch
        return False
    if isinstance(patch.how, Wrap):  # read from vLLM itself, not from the descriptor's state
        return getattr(patch.current(), "__bcg_patch__", None) is not None
    return patch.applied


def patch_of(target, params, **kwargs):
    return Patch(target=target, how=Wrap(params=params, **kwargs), make=lambda f: f, reason="test",
                 hosts="==0.26.0", upstream=NOT_FILED, remove_when="never")


# -- discovery and registration ------------------------------------------------------------------


def test_entry_point_is_declared_and_loads_register():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "bcg"]
    assert [ep.value for ep in ours] == ["bcg_plugin.adapters.vllm:register"]
    assert ours[0].load() is plugin.register


def test_register_is_reentrant_and_harmless_when_not_enabled(vllm_model_config, caplog):
    from vllm.config import VllmConfig

    before = make_config(vllm_model_config).compilation_config
    original_post_init = VllmConfig.__dict__["__post_init__"]
    with caplog.at_level(logging.DEBUG, logger="vllm.bcg"):
        plugin.register()
        plugin.register()
        after = make_config(vllm_model_config).compilation_config
    assert VllmConfig.__dict__["__post_init__"].__bcg_patch__ is original_post_init  # wrapped once
    assert (after.mode, after.cudagraph_mode) == (before.mode, before.cudagraph_mode)
    assert not RUNNER.applied and not any(is_patched(p) for p in RUNNER.patches)
    assert bcg_records(caplog) == []


def test_runner_patches_wait_for_a_config_that_enables_bcg(vllm_model_config):
    plugin.register()
    assert plugin.arm_runner_patches(make_config(vllm_model_config)) is False
    assert not any(is_patched(p) for p in RUNNER.patches)
    enabled = make_config(vllm_model_config, additional_config={"bcg": {"enable": True}})
    assert plugin.arm_runner_patches(enabled) is True
    assert all(is_patched(p) for p in RUNNER.active())
    assert plugin.runs_bcg(enabled) and not plugin.runs_bcg(make_config(vllm_model_config))


# -- patch targets -------------------------------------------------------------------------------


@pytest.mark.parametrize("patch", ALL, ids=lambda p: p.target)
def test_every_patch_target_has_the_expected_signature(patch):
    installed = version.installed()
    assert patch.reason and patch.remove_when
    if patch.applies_to(installed):
        patch.verify(plugin.calls())  # the adapter hands every patch all it calls
    else:  # another release's descriptor: this release's is verified in its own case, unless vLLM removed it
        assert _gone(patch.target) or [p for p in ALL if p.target == patch.target and p.applies_to(installed)], \
            patch.target


def test_a_changed_signature_is_refused_and_nothing_is_applied():
    bad = patch_of("vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.dispatch", ["self", "num_tokens"])
    missing = patch_of("vllm.v1.worker.gpu.cudagraph_utils.CudaGraphManager.no_such_method", ["self"])
    good = ENTRY.patches[0]
    for broken in (bad, missing):
        with pytest.raises(PatchTargetError, match="CudaGraphManager"):
            PatchSet("t", [good, broken]).apply(plugin.calls())
        assert not is_patched(good)


def test_symbols_a_patch_calls_are_verified_with_its_target():
    runner = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"  # the V2 runner: in every covered release
    target = (f"{runner}.profile_cudagraph_memory", ["self"])
    patch_of(*target, uses={f"{runner}.get_model": ["self"]}).verify()
    for uses, problem in [({f"{runner}._no_such_helper": ["self"]}, "attribute not found"),
                          ({f"{runner}.get_model": ["self", "x"]}, "expected parameters")]:
        with pytest.raises(PatchTargetError, match=f"GPUModelRunner\\.(_no_such_helper|get_model): {problem}"):
            patch_of(*target, uses=uses).verify()


def test_patch_sets_apply_and_unapply_cleanly():
    active = ENTRY.active() + RUNNER.active()  # this release's descriptor of every target
    assert active and sorted(p.target for p in active) == sorted({p.target for p in ALL if not _gone(p.target)})
    wrapped = [p for p in active if isinstance(p.how, Wrap)]
    originals = {p.target: p.current() for p in wrapped}
    ENTRY.apply(plugin.calls())
    RUNNER.apply(plugin.calls())
    assert all(is_patched(p) for p in active)
    assert not any(p.applied for p in ALL if p not in active)  # other releases' descriptors stay out
    RUNNER.apply(plugin.calls())  # idempotent: no double wrapping
    assert all(getattr(p.current(), "__bcg_patch__", None) is originals[p.target] for p in wrapped)
    RUNNER.unapply()
    ENTRY.unapply()
    assert all(p.current() is originals[p.target] for p in wrapped)
    assert not any(is_patched(p) for p in active)
    for p in active:  # still the same targets afterwards
        p.verify()


# -- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, key", [
    ({"max_tokenz": 512}, "max_tokenz"),
    ({"enable": "maybe"}, "enable"),
    ({"enable": True, "max_tokens": -1}, "max_tokens"),
    ({"enable": True, "sizes": [16, 4096], "max_tokens": 1024}, "sizes"),
    ({"enable": True, "capture_failure": "ignore"}, "capture_failure"),
    ({"enable": True, "warmup": "never"}, "warmup"),
    ({"enable": True, "torch_compile": "maybe"}, "torch_compile"),
])
def test_config_errors_name_the_key(vllm_model_config, raw, key):
    plugin.register()
    with pytest.raises(ValueError) as err:
        make_config(vllm_model_config, additional_config={"bcg": raw})
    assert "additional_config['bcg']" in str(err.value)
    assert key in str(err.value)


@pytest.mark.parametrize("max_num_seqs, max_model_len, sizes, too_big", [
    (256, 8192, [16, 2048, 4096], [4096]),  # above the chunk of 2048
    (2, 512, [16, 1024, 2048], [2048]),  # within the chunk, above what two requests of 512 tokens hold
])
def test_sizes_above_what_a_step_schedules_stop_the_front_end_before_any_flag_changes(
        vllm_model_config, monkeypatch, max_num_seqs, max_model_len, sizes, too_big):
    from vllm.config import SchedulerConfig

    plugin.register()
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    monkeypatch.setattr(vllm_model_config, "max_model_len", max_model_len)  # the model config is shared
    scheduler = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                is_encoder_decoder=False)
    with pytest.raises(ValueError) as err:
        make_config(vllm_model_config, scheduler_config=scheduler,
                    additional_config={"bcg": {"enable": True, "sizes": sizes}})
    assert f"'sizes' has {too_big} above" in str(err.value) and "additional_config['bcg']" in str(err.value)
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH" not in os.environ  # nothing half-applied
    fits = [s for s in sizes if s not in too_big]
    config = make_config(vllm_model_config, scheduler_config=scheduler,
                         additional_config={"bcg": {"enable": True, "sizes": fits}})
    assert launch_record(config) is not None  # the sizes that fit start bcg


BAD_VLLM_CONFIG = """
import json, sys
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.platforms import current_platform
type(current_platform).support_static_graph_mode = classmethod(lambda cls: True)
from vllm.config import DeviceConfig, ModelConfig, VllmConfig
model = ModelConfig(model=sys.argv[1], skip_tokenizer_init=True)
VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"), additional_config=json.loads(sys.argv[2]))
print("BUILT")
"""


@pytest.mark.parametrize("raw, message", [
    ({"enable": "maybe"}, "'enable' must be true or false"),
    ({"enable": True, "sizes": [16, 65536]}, "'sizes' has [65536] above"),  # above any default chunk
    ({"enable": True}, None),
])
def test_a_bad_config_ends_vllms_start_with_one_line(config_error_line, raw, message):
    from bcg_bench.models import model_dir

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("VLLM_USE_BREAKABLE_CUDAGRAPH", None)
    proc = subprocess.run([sys.executable, "-c", BAD_VLLM_CONFIG, str(model_dir("qwen3-0.6b")),
                           json.dumps({"bcg": raw})], env=env, capture_output=True, text=True, timeout=600)
    if message is None:
        assert proc.returncode == 0 and "BUILT" in proc.stdout, proc.stderr[-3000:]
        return
    line = config_error_line(proc, message)
    assert line.startswith("bcg: configuration error: additional_config['bcg']: ")


@pytest.mark.parametrize("raw, warmup", [
    ({"enable": True}, "first_bucket"),  # vLLM's default
    ({"enable": True, "warmup": "every_bucket"}, "every_bucket"),  # the user's key wins
])
def test_vllm_warmup_default_sits_under_the_users_keys(raw, warmup):
    from bcg_plugin.adapters.vllm.config import bcg_config

    cfg = bcg_config(types.SimpleNamespace(additional_config={"bcg": raw}))
    assert cfg.warmup == warmup and cfg.enable
    assert "warmup" not in raw or raw["warmup"] == warmup


def test_enabling_keeps_vllms_compilation_unless_torch_compile_is_false(vllm_model_config, caplog):
    from vllm.config.compilation import CompilationMode

    from bcg_plugin.adapters.vllm.config import prefill_graphs_wanted

    plugin.register()
    launch._logged.clear()
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        default = make_config(vllm_model_config, additional_config={"bcg": {"enable": True}})
    assert default.compilation_config.mode == make_config(vllm_model_config).compilation_config.mode
    assert default.compilation_config.mode == CompilationMode.VLLM_COMPILE and prefill_graphs_wanted(default)
    [line] = [r.getMessage() for r in bcg_records(caplog) if "prefill graphs enabled" in r.getMessage()]
    assert "-> NONE" not in line and "'torch_compile': True" in line
    launch._logged.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        off = make_config(vllm_model_config, additional_config={"bcg": {"enable": True, "torch_compile": False}})
    assert off.compilation_config.mode == CompilationMode.NONE and prefill_graphs_wanted(off)
    [line] = [r.getMessage() for r in bcg_records(caplog) if "prefill graphs enabled" in r.getMessage()]
    assert "-> NONE" in line and launch.COMPILE_HINT in line


def test_at_o0_bcg_captures_the_plain_model_whatever_torch_compile_says(vllm_model_config):
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode

    from bcg_plugin.adapters.vllm.config import prefill_graphs_wanted

    plugin.register()
    cfg = make_config(vllm_model_config, compilation_config=CompilationConfig(mode=CompilationMode.NONE),
                      additional_config={"bcg": {"enable": True}})
    assert cfg.compilation_config.mode == CompilationMode.NONE and prefill_graphs_wanted(cfg)


@pytest.mark.parametrize("user_mode, expected, runs", [
    (None, "FULL_DECODE_ONLY", True), ("NONE", "NONE", True), ("FULL_DECODE_ONLY", "FULL_DECODE_ONLY", True),
    # A mode the user set with graphs of vLLM's own for the batches bcg serves: kept, and bcg stays off.
    ("FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", False), ("PIECEWISE", "PIECEWISE", False), ("FULL", "FULL", False),
])
@pytest.mark.parametrize("torch_compile", [False, True])
def test_launch_flags_keep_decode_graphs_and_never_change_a_mode_the_user_set(vllm_model_config, user_mode, expected,
                                                                               runs, torch_compile):
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    cc = CompilationConfig(cudagraph_mode=None if user_mode is None else CUDAGraphMode[user_mode])
    cfg = types.SimpleNamespace(additional_config={"bcg": {"enable": True, "torch_compile": torch_compile}},
                                compilation_config=cc, model_config=vllm_model_config)
    launch.configure_engine(cfg)
    # vLLM's default compilation mode applies later; bcg sets NONE only where it runs without torch.compile.
    assert cc.mode == (CompilationMode.NONE if runs and not torch_compile else None)
    assert cc.cudagraph_mode == CUDAGraphMode[expected]


def test_torch_compile_keeps_vllms_piecewise_compilation(vllm_model_config):
    from vllm.config.compilation import CompilationMode

    from bcg_plugin.adapters.vllm.config import ATTENTION_OP, prefill_graphs_wanted

    plugin.register()
    cfg = make_config(vllm_model_config, additional_config={"bcg": {"enable": True, "torch_compile": True}})
    cc = cfg.compilation_config
    assert cc.mode == CompilationMode.VLLM_COMPILE  # (cudagraph_mode: vLLM's CPU platform turns graphs off)
    assert ATTENTION_OP in cc.splitting_ops  # attention stays a call between compiled pieces: the break
    assert prefill_graphs_wanted(cfg)
    plain = make_config(vllm_model_config, additional_config={"bcg": {"enable": True, "torch_compile": False}})
    assert plain.compilation_config.mode == CompilationMode.NONE and prefill_graphs_wanted(plain)


@pytest.mark.parametrize("compilation, reason", [
    ({"mode": 1}, "compilation mode STOCK_TORCH_COMPILE"),
    ({"mode": 3, "use_inductor_graph_partition": True}, "use_inductor_graph_partition"),
    ({"mode": 3, "splitting_ops": []}, "splitting_ops without vllm::unified_attention_with_output"),
])
def test_torch_compile_layouts_bcg_cannot_capture_stay_off(vllm_model_config, caplog, compilation, reason):
    from vllm.config import CompilationConfig

    from bcg_plugin.adapters.vllm.config import prefill_graphs_wanted

    plugin.register()
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        cfg = make_config(vllm_model_config, compilation_config=CompilationConfig(**compilation),
                          additional_config={"bcg": {"enable": True, "torch_compile": True}})
    records = bcg_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING and reason in records[0].getMessage()
    assert '"torch_compile": false' in records[0].getMessage()  # the way to run bcg on this engine anyway
    assert not prefill_graphs_wanted(cfg)


@pytest.mark.parametrize("extra, reason", [
    ({"enforce_eager": True}, "enforce_eager"),
    ({"lora_config": object()}, "LoRA"),
    ({"speculative_config": object()}, "speculative"),
    ({"parallel_config": types.SimpleNamespace(data_parallel_size=2, enable_expert_parallel=True,
                                               all2all_backend="deepep_high_throughput")}, "DeepEP high-throughput"),
])
def test_unsupported_setups_log_one_line_and_change_nothing(vllm_model_config, caplog, extra, reason):
    from vllm.config import CompilationConfig

    mc = types.SimpleNamespace(**{"enforce_eager": False, **{k: v for k, v in extra.items() if k == "enforce_eager"}})
    cfg = types.SimpleNamespace(additional_config={"bcg": {"enable": True}}, compilation_config=CompilationConfig(),
                                model_config=mc, **{k: v for k, v in extra.items() if k != "enforce_eager"})
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        launch.configure_engine(cfg)
        launch.configure_engine(cfg)
    records = bcg_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING and reason in records[0].getMessage()
    assert cfg.compilation_config.mode is None and cfg.compilation_config.cudagraph_mode is None


# -- unknown vLLM --------------------------------------------------------------------------------


def _nothing_patched() -> bool:
    return not any(is_patched(p) for p in ALL)


def test_unknown_version_warns_once_and_leaves_vllm_unpatched(monkeypatch, caplog, vllm_model_config):
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.platforms import current_platform

    # As on a CUDA host, vLLM keeps a graph mode (on this CPU-only platform it turns graphs off last).
    monkeypatch.setattr(type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True))
    monkeypatch.setattr(version, "installed", lambda: "0.35.0")
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        plugin.register()
        plugin.register()
        # torch_compile false: the config that, acted on, changes both modes (NONE, FULL_DECODE_ONLY).
        cfg = make_config(vllm_model_config, additional_config={"bcg": {"enable": True, "torch_compile": False}})
    records = bcg_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "0.35.0" in records[0].getMessage()
    assert _nothing_patched()
    # The bcg config was not acted on: vLLM's own -O2 modes, as without the plugin.
    cc = cfg.compilation_config
    assert (cc.mode, cc.cudagraph_mode) == (CompilationMode.VLLM_COMPILE, CUDAGraphMode.FULL_AND_PIECEWISE)
    assert "bcg_launch" not in cfg.additional_config


def test_changed_entry_target_warns_once_and_leaves_vllm_unpatched(monkeypatch, caplog):
    [init_device] = [p for p in ENTRY.active() if p.target.endswith(".init_device")]
    monkeypatch.setattr(init_device, "how", Wrap(params=["self", "local_rank"]))
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        plugin.register()
        plugin.register()
    records = bcg_records(caplog)
    assert len(records) == 1 and "expected patch targets" in records[0].getMessage()
    assert _nothing_patched()


# -- dispatch: bucket choice goes through vLLM's dispatch (and so its DP sync) ------------------------


class FakeGraphs:
    buckets = [16, 32, 48, 64]

    def bucket_for(self, n, num_reqs=None):
        return next((b for b in self.buckets if b >= n), None)

    def graph_requests(self, bucket):
        return None  # attention breaks in every bucket


def _v2_dispatch_descriptors():
    from bcg_plugin.patches.vllm import v2_cudagraph_manager_dispatch as mod

    return mod.PATCHES


@pytest.mark.parametrize("patch", _v2_dispatch_descriptors(), ids=lambda p: p.hosts)
def test_v2_dispatch_pads_eager_batches_to_a_bucket_and_keeps_full_decode(patch):
    """Every range's wrapper, called as vLLM's callers call it (trailing arguments by keyword)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor as Desc

    extra = patch.how.params[5:]  # max_query_len (0.28), num_ubatches (0.30)
    passed = []

    def original(self, num_reqs, num_tokens, uniform, loras, *rest):
        passed.append(rest)
        if uniform == 1 and num_tokens <= 8:
            return Desc(CUDAGraphMode.FULL, 8, 8, 1)
        return Desc(CUDAGraphMode.NONE, num_tokens, num_reqs)

    def call(target, num_reqs, num_tokens, uniform, **kw):
        return dispatch(target, num_reqs, num_tokens, uniform, num_active_loras=0, **kw)

    dispatch = patch.make(original)
    manager = types.SimpleNamespace(_bcg_graphs=FakeGraphs())
    assert call(manager, 5, 5, 1).cg_mode == CUDAGraphMode.FULL
    desc = call(manager, 3, 37, None)
    assert (desc.cg_mode, desc.num_tokens, desc.num_reqs) == (CUDAGraphMode.PIECEWISE, 48, None)
    assert call(manager, 3, 48, None).num_tokens == 48  # DP re-dispatch at the synced size
    assert call(manager, 3, 65, None).cg_mode == CUDAGraphMode.NONE  # above the top bucket
    assert call(types.SimpleNamespace(), 3, 37, None).cg_mode == CUDAGraphMode.NONE  # bcg off
    if extra:
        passed.clear()
        kw = {"max_query_len": 7, **({"num_ubatches": 1} if "num_ubatches" in extra else {})}
        assert call(manager, 3, 37, None, **kw).num_tokens == 48
        assert passed == [tuple(kw.values())]  # handed to vLLM's own dispatch unchanged
    if "num_ubatches" in extra and "num_ubatches" in Desc.__dataclass_fields__:
        def split(self, num_reqs, num_tokens, uniform, loras, max_query_len=None, num_ubatches=1):
            return Desc(CUDAGraphMode.NONE, num_tokens, num_reqs, num_ubatches=num_ubatches)

        dispatch = patch.make(split)
        desc = call(manager, 3, 37, None, num_ubatches=2)  # microbatched: vLLM's answer stands
        assert (desc.cg_mode, desc.num_tokens, desc.num_ubatches) == (CUDAGraphMode.NONE, 37, 2)
        assert call(manager, 3, 37, None, num_ubatches=1).cg_mode == CUDAGraphMode.PIECEWISE


@pytest.mark.parametrize("patch", _v2_dispatch_descriptors(), ids=lambda p: p.hosts)
def test_v2_dispatch_gives_graph_attention_buckets_a_full_descriptor_padded_to_their_requests(patch):
    """vLLM builds FULL-mode metadata (into its persistent buffers, padded to ``num_reqs``) only for a
    FULL descriptor: a bucket whose attention is inside bcg's graph must get one, the others PIECEWISE."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor as Desc

    class GraphAttention(FakeGraphs):
        def graph_requests(self, bucket):
            return {16: 16, 32: 24}.get(bucket)  # attention inside the graph up to 32 tokens

    dispatch = patch.make(lambda self, num_reqs, num_tokens, *rest: Desc(CUDAGraphMode.NONE, num_tokens, num_reqs))
    manager = types.SimpleNamespace(_bcg_graphs=GraphAttention())
    small = dispatch(manager, 3, 20, None, num_active_loras=0)
    assert (small.cg_mode, small.num_tokens, small.num_reqs) == (CUDAGraphMode.FULL, 32, 24)
    large = dispatch(manager, 3, 40, None, num_active_loras=0)
    assert (large.cg_mode, large.num_tokens, large.num_reqs) == (CUDAGraphMode.PIECEWISE, 48, None)
    asked = []
    manager._bcg_graphs.bucket_for = lambda n, num_reqs=None: asked.append(num_reqs) or None
    assert dispatch(manager, 3, 20, None, num_active_loras=0).cg_mode == CUDAGraphMode.NONE  # bcg declined it
    assert asked == [3]  # the step's request count goes to bcg's choice with its token count


def test_run_fullgraph_replays_bcg_buckets_and_leaves_vllms_own_full_graphs_to_vllm(monkeypatch):
    import vllm.model_executor.offloader.base as offloader

    from bcg_plugin.patches.vllm import v2_model_cudagraph_manager_run_fullgraph as mod

    bcg, synced = [], []
    monkeypatch.setattr(offloader, "get_offloader", lambda: types.SimpleNamespace(
        sync_prev_onload=lambda: synced.append(len(bcg))))

    class Graphs:
        def graph_requests(self, bucket):
            return {32: 24}.get(bucket)  # attention inside bcg's graph in bucket 32 only

        def forward_full(self, bucket):
            bcg.append(bucket)
            return "bcg hidden"

    def desc(num_tokens, num_reqs, **shape):
        fields = {"uniform_token_count": None, "max_query_len": None, "num_ubatches": 1, **shape}
        return type("Desc", (), {"num_tokens": num_tokens, "num_reqs": num_reqs, **fields})()

    run = mod.PATCH.make(lambda self, desc: "vllm hidden")
    own = desc(32, 24)
    manager = types.SimpleNamespace(graphs={own: None}, _bcg_graphs=Graphs())
    assert run(manager, own) == "vllm hidden"  # a FULL graph vLLM captured itself
    assert run(manager, desc(48, None)) == "vllm hidden"  # a bucket where attention breaks: not bcg's FULL replay
    assert run(manager, desc(32, 32)) == "vllm hidden"  # padded to other than the bucket's requests
    # vLLM's decode descriptors can carry bcg's counts; one it did not capture is still vLLM's to answer
    assert run(manager, desc(32, 24, max_query_len=2)) == "vllm hidden"  # varlen decode
    assert run(manager, desc(32, 24, uniform_token_count=1)) == "vllm hidden"  # uniform decode
    assert run(manager, desc(32, 24, num_ubatches=2)) == "vllm hidden"  # microbatched
    assert run(manager, desc(32, 24)) == "bcg hidden" and bcg == [32]
    assert synced == [0]  # the offloader's copies are waited for before bcg's graph reads
    assert run(types.SimpleNamespace(graphs={}), desc(32, 24)) == "vllm hidden"  # bcg not running here


@needs_v1
def test_v1_dispatch_answers_the_dp_redispatch_without_tripping_vllms_assert():
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from bcg_plugin.patches.vllm import v1_cudagraph_dispatcher_dispatch as mod

    def original(self, n, uniform, has_lora, loras, valid, invalid):
        allowed = set(valid or CUDAGraphMode.valid_runtime_modes()) - set(invalid or ())
        if uniform and n <= 8 and CUDAGraphMode.FULL in allowed:
            return CUDAGraphMode.FULL, BatchDescriptor(8, num_reqs=8, uniform=True)
        assert CUDAGraphMode.NONE in allowed
        return CUDAGraphMode.NONE, BatchDescriptor(n)

    dispatch = mod.make(original)
    d = types.SimpleNamespace(_bcg_graphs=FakeGraphs())
    assert dispatch(d, 6, uniform_decode=True)[0] == CUDAGraphMode.FULL
    mode, desc = dispatch(d, 37)
    assert (mode, desc.num_tokens, desc.num_reqs, desc.uniform) == (CUDAGraphMode.PIECEWISE, 48, None, False)
    assert dispatch(d, 37, valid_modes={CUDAGraphMode.NONE})[0] == CUDAGraphMode.NONE  # forced eager
    # DP re-dispatch: only PIECEWISE allowed, the size must come back unchanged.
    assert dispatch(d, 48, valid_modes={CUDAGraphMode.PIECEWISE}) [1].num_tokens == 48
    mode, desc = dispatch(d, 40, valid_modes={CUDAGraphMode.PIECEWISE})
    assert (mode, desc.num_tokens) == (CUDAGraphMode.PIECEWISE, 40)
    assert dispatch(d, 100)[0] == CUDAGraphMode.NONE


# -- an idle DP rank's dummy forward replays the bucket its peers replay --------------------------


class RecordingGraphs:
    def __init__(self):
        self.calls = []

    def forward(self, model, inputs, *, dummy=False):
        self.calls.append((model, sorted(inputs), dummy))
        return "replayed"


@needs_v1
def test_v1_dummy_run_sends_piecewise_forwards_through_bcg_and_restores_the_model():
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import override_forward_context

    from bcg_plugin.patches.vllm import v1_gpu_model_runner_dummy_run as mod

    eager_calls = []
    model_fn = lambda **kw: eager_calls.append(sorted(kw)) or "eager"  # noqa: E731

    def original(self, num_tokens, cudagraph_runtime_mode=None, *args, **kwargs):
        # What V1's _dummy_run does: set the dispatched forward context, call self.model directly.
        with override_forward_context(types.SimpleNamespace(cudagraph_runtime_mode=cudagraph_runtime_mode)):
            assert self.model.name == "model"  # attributes still reach the model
            return self.model(input_ids=None, positions=num_tokens)

    dummy_run = mod.make(original)
    graphs = RecordingGraphs()
    raw = _CallableModel(model_fn)
    runner = types.SimpleNamespace(_bcg_graphs=graphs, model=raw)
    assert dummy_run(runner, 2048, CUDAGraphMode.PIECEWISE) == "replayed"
    assert graphs.calls == [(raw, ["input_ids", "positions"], True)]
    assert runner.model is raw
    assert dummy_run(runner, 8, CUDAGraphMode.FULL) == "eager"  # decode graphs, warm-ups: the model itself
    assert dummy_run(runner, 8, CUDAGraphMode.NONE) == "eager"
    assert len(graphs.calls) == 1 and len(eager_calls) == 2
    assert dummy_run(types.SimpleNamespace(model=raw), 2048, CUDAGraphMode.PIECEWISE) == "eager"  # bcg off

    def failing(self, *args, **kwargs):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        mod.make(failing)(runner, 16)
    assert runner.model is raw


@needs_v1
@pytest.mark.parametrize("captured, expected", [(True, 1000 + 300), (False, 1000)])
def test_v1_capture_reports_bcgs_graph_memory_with_vllms(monkeypatch, captured, expected):
    from bcg_plugin.patches.vllm import v1_gpu_model_runner_capture_model as mod
    from bcg_plugin.stats import RuntimeStats

    # What the core measured around bcg's capture (free device memory before minus after).
    graphs = types.SimpleNamespace(runner=types.SimpleNamespace(stats=RuntimeStats(graph_bytes=300, pool_bytes=120)))
    graphs = graphs if captured else None  # None: bcg does not run on this runner
    runner = types.SimpleNamespace(vllm_config=None, cudagraph_dispatcher=types.SimpleNamespace())
    # lambda self: 1000: what vLLM's own capture measured for its graphs
    capture_model = mod.make(lambda self: 1000, capture_v1=lambda runner: graphs)
    assert capture_model(runner) == expected
    assert runner._bcg_graphs is graphs and runner.cudagraph_dispatcher._bcg_graphs is graphs


@needs_v1
def test_v1_profile_adds_bcgs_estimate_to_the_one_vllm_sizes_the_kv_cache_with(monkeypatch):
    from bcg_plugin.patches.vllm import v1_gpu_model_runner_profile_cudagraph_memory as mod

    seen = []
    runner = object()
    profile = mod.make(lambda self: 1000, estimate_v1=lambda runner: seen.append(runner) or 300)
    assert profile(runner) == 1300  # vLLM's own estimate plus bcg's
    assert seen == [runner]


class _ProfilingRunner:
    """The V1 runner methods ``estimate_v1`` calls, recorded in order."""

    def __init__(self):
        self.vllm_config, self.calls = object(), []
        self.attn_groups, self.kv_cache_config = [], None

    def _init_minimal_kv_cache_for_profiling(self):
        self.calls.append("init minimal KV cache")

    def _cleanup_profiling_kv_cache(self):
        self.calls.append("clean up minimal KV cache")

    def get_model(self):
        return None


@needs_v1
@pytest.mark.parametrize("outcome", ["estimated", "unsupported", "raises", "unusable"])
def test_v1_estimate_runs_on_a_minimal_kv_cache_and_releases_it_while_the_gpu_runs(monkeypatch, caplog, outcome):
    from bcg_plugin.adapters.vllm.replay import VllmPrefillGraphs
    from bcg_plugin import BcgCaptureError

    runner = _ProfilingRunner()
    monkeypatch.setattr(plugin, "runs_bcg", lambda config: True)

    class _Graphs:
        def estimate(self):
            runner.calls.append("estimate")
            if outcome == "raises":
                raise RuntimeError("boom")
            if outcome == "unusable":  # the core's verdict after a sticky CUDA error
                raise BcgCaptureError("bcg prefill graph memory estimate left this rank's GPU unusable")
            return 700

        def close(self):
            runner.calls.append("close graphs")

    def build(host_factory, vllm_config, *, reports, **_):
        assert reports is False  # built to measure, not to serve: no stats lines, no metrics
        return None if outcome == "unsupported" else _Graphs()

    monkeypatch.setattr(VllmPrefillGraphs, "build", build)
    with caplog.at_level(logging.WARNING, logger="vllm.bcg"):
        if outcome == "unusable":  # nothing can follow on that GPU: the engine stops with the core's error
            with pytest.raises(BcgCaptureError, match="GPU unusable"):
                plugin.estimate_v1(runner)
        else:
            assert plugin.estimate_v1(runner) == (700 if outcome == "estimated" else 0)
    assert ("could not estimate" in caplog.text and "boom" in caplog.text) == (outcome == "raises")
    if outcome == "unusable":  # releasing on a GPU that runs nothing would raise over the error
        assert runner.calls == ["init minimal KV cache", "estimate"]
        return
    inner = {"estimated": ["estimate", "close graphs"], "unsupported": [], "raises": ["estimate", "close graphs"]}
    assert runner.calls == ["init minimal KV cache", *inner[outcome], "clean up minimal KV cache"]


@needs_v1
def test_v1_estimate_is_zero_without_touching_the_runner_where_bcg_does_not_run(monkeypatch):
    runner = _ProfilingRunner()
    monkeypatch.setattr(plugin, "runs_bcg", lambda config: False)
    assert plugin.estimate_v1(runner) == 0 and runner.calls == []


class _CallableModel:
    name = "model"

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, **kwargs):
        return self._fn(**kwargs)


def _graphs_with_bucket_64(capture_contexts: dict | None = None):
    """VllmPrefillGraphs past its capture (one bucket, 64), without a model runner behind it."""
    from bcg_plugin.adapters.vllm.replay import VllmPrefillGraphs

    graphs = object.__new__(VllmPrefillGraphs)
    graphs._buckets = frozenset({64})
    graphs._graph_requests = {}
    graphs._slot_mapping_probe = ()
    graphs.host = types.SimpleNamespace(embeds_in_graph=True, capture_contexts=capture_contexts or {})
    return graphs


def test_dummy_forward_without_attention_metadata_replays_every_row_as_padding():
    graphs = _graphs_with_bucket_64()
    context = types.SimpleNamespace(attn_metadata=None, slot_mapping={})
    inputs = {"input_ids": torch.zeros(64, dtype=torch.int32), "positions": torch.zeros(64, dtype=torch.int64),
              "inputs_embeds": None, "intermediate_tensors": None}
    batch = graphs._host_batch(context, inputs, 64, dummy=True)
    assert batch is not None and batch.num_tokens == 64 and batch.payload is context
    assert batch.requested_tokens == 0  # counted as padding, not as 64 real tokens
    assert graphs._host_batch(context, inputs, 64) is None  # a real step always has metadata
    assert graphs._host_batch(context, inputs, 48, dummy=True) is None  # no graph at that size
    graphs._graph_requests = {64: 8}  # the same bucket captured with attention inside
    assert graphs._host_batch(context, inputs, 64, dummy=True) is None  # never on PIECEWISE metadata


@pytest.mark.parametrize("takes_stream", [True, False])
@pytest.mark.parametrize("default_stream", ["shared", None])
def test_capture_enters_vllms_graph_capture_on_the_stream_torch_captures_on(monkeypatch, default_stream,
                                                                            takes_stream):
    """Through vLLM 0.30 ``graph_capture`` takes the stream (bcg's: torch's default one); from 0.31 it
    makes one of its own, which bcg captures on. Both shapes, whatever vLLM is installed."""
    import contextlib
    import inspect

    from packaging.version import Version

    import vllm.distributed.parallel_state as ps

    from bcg_plugin.adapters.vllm import host as host_module

    installed_takes = "graph_capture_context" in inspect.signature(ps.graph_capture).parameters
    assert installed_takes == (Version(version.installed()) < Version("0.31"))
    entered = []

    if takes_stream:
        @contextlib.contextmanager
        def graph_capture(device, graph_capture_context=None):
            entered.append(graph_capture_context)
            yield graph_capture_context or ps.GraphCaptureContext("fresh")
    else:
        @contextlib.contextmanager
        def graph_capture(device):
            entered.append("its own")
            yield ps.GraphCaptureContext("fresh")

    monkeypatch.setattr(ps, "graph_capture", graph_capture)
    monkeypatch.setattr(host_module, "default_capture_stream", lambda device: default_stream)
    host = object.__new__(host_module.VllmHost)
    host.device, host.stream = torch.device("cpu"), None
    with host.capturing():
        seen = host.bcg_capture_stream()
    assert host.stream is None  # named for the capture only
    if not takes_stream:
        assert entered == ["its own"] and seen == "fresh"
    elif default_stream is None:  # torch's is on another device: vLLM opens a stream of its own
        assert entered == [None] and seen == "fresh"
    else:
        assert [c.stream for c in entered] == ["shared"] and seen == "shared"


# -- ops vLLM marks as eager breaks, under bcg's capture -----------------------------------------


def marked(monkeypatch, fn):
    """``fn`` marked with vLLM's ``eager_break_during_capture``; through 0.32 the marker wraps only
    while vLLM's breakable graphs are on, read at the decoration, so they are on for it here."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    wrapped = eager_break_during_capture(fn)
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH")
    assert wrapped is not fn
    return wrapped


def mixer(calls):  # a list, not a tensor: the marker weak-refs tensors with a CUDA op
    calls.append("ran")


def test_under_bcgs_capture_an_op_vllm_marks_fails_the_capture_and_between_segments_runs(monkeypatch):
    """Without the refusal the marked op (a Mamba mixer, say) found no breakable capture and was
    recorded inline, its host work frozen into the graph."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    from bcg_plugin import BcgStateError
    from bcg_plugin.adapters.vllm.attention import MarkedOpRefusal, refusing_marked_ops

    op = marked(monkeypatch, mixer)
    assert plugin.apply_runner_patches() is True
    out = []
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    op(out)  # outside bcg's capture: vLLM's own answer (no capture), a plain call
    assert BreakableCUDAGraphCapture.current() is None and not BreakableCUDAGraphCapture.is_active()
    with refusing_marked_ops():
        assert isinstance(BreakableCUDAGraphCapture.current(), MarkedOpRefusal)
        assert BreakableCUDAGraphCapture.is_active()  # what Cohere2 MoE asks before forking a stream
        with pytest.raises(BcgStateError, match=r"bcg cannot capture .*mixer, an op vLLM marks as an eager break"):
            op(out)
        capturing[0] = False  # between segments: bcg's own break, a warm-up forward
        op(out)
    assert out == ["ran", "ran"]
    assert BreakableCUDAGraphCapture.current() is None


def test_bcgs_attention_break_calls_attention_past_vllms_marker(monkeypatch):
    """Attention is bcg's own break: inside a graph bucket it is recorded inline, where vLLM's
    marker (on vLLM's attention op from 0.33 whatever its breakable graphs) would meet the refusal
    and fail every graph-attention bucket's capture."""
    from bcg_plugin import breaks
    from bcg_plugin.adapters.vllm.attention import make_attention_break, refusing_marked_ops, unmarked

    def attention(query, output):  # lists, not tensors: the marker weak-refs tensors with a CUDA op
        output.append(query)

    kernel = make_attention_break(marked(monkeypatch, attention))
    assert unmarked(mixer) is mixer  # a function the marker left alone, as through 0.32
    assert plugin.apply_runner_patches() is True
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    out = []
    token = breaks._capture_inline.set(True)  # a bucket whose attention is captured inside the graph
    try:
        with refusing_marked_ops():
            kernel(["q"], out)
    finally:
        breaks._capture_inline.reset(token)
    assert out == [["q"]]


def test_no_marker_is_left_on_the_installed_attention_function_bcgs_break_calls():
    """From 0.33 vLLM marks its attention function whatever its breakable graphs; a marker bcg could not
    strip (vLLM reordering its decorators, say) would meet the refusal and fail every graph-attention
    capture. A marker wrapper is known by the file vLLM defines it in, not by how ``unmarked`` finds it."""
    import importlib

    from bcg_plugin.adapters.vllm.attention import unmarked
    from bcg_plugin.patches.vllm.unified_attention_with_output import PATCH

    def marker_wrappers(fn):
        found = []
        while fn is not None:
            code = getattr(fn, "__code__", None)  # functools.wraps copies the wrapped one's names
            if code is not None and code.co_filename.endswith(os.path.join("compilation", "breakable_cudagraph.py")):
                found.append(fn)
            fn = getattr(fn, "__wrapped__", None)
        return found

    module, _, name = PATCH.target.rpartition(".")
    original = getattr(importlib.import_module(module), name)
    assert marker_wrappers(unmarked(original)) == []
    if marker_wrappers(original):  # the check can fail: a marker under another wrapper is not stripped
        outer = functools.wraps(original)(lambda *a, **k: original(*a, **k))
        assert marker_wrappers(unmarked(outer))


def test_is_active_under_the_refusal_stays_traceable_by_torch_compile():
    """Model code vLLM compiles may ask ``is_active()`` (Cohere2 MoE, ``maybe_execute_in_parallel``):
    the patched answer must trace as vLLM's own thread-local one does, and be guarded on."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    from bcg_plugin.adapters.vllm.attention import refusing_marked_ops

    assert plugin.apply_runner_patches() is True

    def step(x):
        return x + 1 if BreakableCUDAGraphCapture.is_active() else x - 1

    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, fullgraph=True, backend="eager")
        x = torch.zeros(2)
        assert compiled(x).tolist() == [-1, -1]
        with refusing_marked_ops():
            assert compiled(x).tolist() == [1, 1]
        assert compiled(x).tolist() == [-1, -1]
    finally:
        torch._dynamo.reset()


def test_bcgs_capture_context_refuses_marked_ops_for_its_length(monkeypatch):
    import vllm.distributed.parallel_state as ps

    from bcg_plugin.adapters.vllm import host as host_module
    from bcg_plugin.adapters.vllm.attention import capture_refusal

    @contextlib.contextmanager
    def graph_capture(device, graph_capture_context=None):
        yield ps.GraphCaptureContext("stream")

    monkeypatch.setattr(ps, "graph_capture", graph_capture)
    monkeypatch.setattr(host_module, "default_capture_stream", lambda device: None)
    host = object.__new__(host_module.VllmHost)
    host.device, host.stream = torch.device("cpu"), None
    assert capture_refusal() is None
    with host.capturing():
        assert capture_refusal() is not None
    assert capture_refusal() is None


# -- the attention break reads the forward context the replay path leaves current ----------------


class RecordingImpl:
    def __init__(self):
        self.seen = []

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, **_):
        self.seen.append(attn_metadata)
        output.fill_(1.0)


def fake_context(metadata, impl):
    layer = types.SimpleNamespace(impl=impl, kv_cache=None)
    return types.SimpleNamespace(attn_metadata={"layer.0": metadata}, no_compile_layers={"layer.0": layer},
                                 slot_mapping={})


def test_attention_kernel_reads_the_current_context_and_scrubs_padded_rows():
    import vllm.forward_context as fc
    import vllm.model_executor.layers.attention.attention  # noqa: F401  registers the op

    impl = RecordingImpl()
    vllm_ctx, other_ctx = fake_context("vllm's", impl), fake_context("other", impl)
    op = torch.ops.vllm.unified_attention_with_output
    q = torch.zeros(8, 2, 4)
    out = torch.zeros(8, 2, 4)

    [kernel] = [p for p in RUNNER.active() if p.target.endswith(".unified_attention_with_output")]
    kernel.apply(plugin.calls())
    try:
        with fc.override_forward_context(vllm_ctx):
            op(q, q, q, out, "layer.0")  # no bcg batch bound: all rows written
            assert impl.seen[-1] == "vllm's" and out.eq(1).all()
            out.zero_()
            with live.bound(LiveBatch(num_tokens=5, bucket=8, payload=other_ctx)):
                op(q, q, q, out, "layer.0")
            assert impl.seen[-1] == "vllm's"  # the payload does not redirect attention; the context does
            assert out[:5].eq(1).all() and out[5:].eq(0).all()  # padded rows scrubbed
    finally:
        kernel.unapply()
    out.zero_()
    with fc.override_forward_context(vllm_ctx), live.bound(LiveBatch(5, 8, other_ctx)):
        op(q, q, q, out, "layer.0")
    assert out.eq(1).all()  # the original kernel is back: nothing scrubbed


class _ReplayRecorder:
    """The core runner's replay, recording the forward context current while it runs."""

    def __init__(self):
        self.contexts = []

    def replay(self, bucket, batch):
        from vllm.forward_context import get_forward_context

        self.contexts.append(get_forward_context())
        return "hidden"


@pytest.mark.parametrize("stale", [False, True])
def test_replay_runs_under_the_steps_context_unless_the_stale_fault_is_loaded(stale, request):
    from vllm.forward_context import override_forward_context

    if stale:
        request.getfixturevalue("stale_metadata_fault")
    captured = types.SimpleNamespace(name="captured")
    graphs = _graphs_with_bucket_64({64: captured})
    graphs.runner = _ReplayRecorder()
    step = types.SimpleNamespace(batch_descriptor=types.SimpleNamespace(num_tokens=64), slot_mapping={},
                                 attn_metadata={"layer.0": types.SimpleNamespace(num_actual_tokens=40)})
    inputs = {"input_ids": torch.zeros(64, dtype=torch.int32), "positions": torch.zeros(64, dtype=torch.int64)}
    with override_forward_context(step):
        assert graphs.forward(None, inputs) == "hidden"
    assert graphs.runner.contexts == [captured if stale else step]


# -- graph inputs ---------------------------------------------------------------------------------


class _TextModel(torch.nn.Module):
    def embed_input_ids(self, ids):
        return torch.ones(ids.shape[0], 1024)


class _Host:
    """VllmHost with a trivial capture context (the real ones need a built model runner)."""

    def __new__(cls, model, vllm_config):
        from bcg_plugin.adapters.vllm.host import VllmHost

        host = type("CpuHost", (VllmHost,), {"capture_context": lambda self, n, graph_attention=False: ("ctx", n)})(
            model, vllm_config, torch.device("cpu"))
        return host


@pytest.mark.parametrize("prompt_embeds", [False, True])
def test_graphs_start_from_token_ids_unless_the_host_feeds_embeddings(vllm_model_config, prompt_embeds, monkeypatch):
    from bcg_plugin.adapters.vllm.host import EagerEmbedding
    from bcg_plugin import HostBatch, plugin_manager

    config = make_config(vllm_model_config)
    monkeypatch.setattr(config.model_config, "enable_prompt_embeds", prompt_embeds)  # the model config is shared
    host = _Host(_TextModel(), config)
    statics = host.bcg_static_inputs()
    batch = host.bcg_dummy_batch(num_tokens=4, graph_attention=False)
    pm = plugin_manager(*host.plugins())
    embedders = [p for p in pm.get_plugins() if isinstance(p, EagerEmbedding)]
    if not prompt_embeds:
        assert host.embeds_in_graph and set(statics) == {"input_ids", "positions"}
        assert statics["input_ids"].dtype == torch.int32 and batch.inputs["input_ids"].dtype == torch.int32
        assert not pm.hook.bcg_embed.get_hookimpls() and not embedders  # nothing runs eagerly per step
    else:
        assert not host.embeds_in_graph and set(statics) == {"inputs_embeds", "positions"}
        assert batch.inputs["inputs_embeds"].shape == (4, 1024)
        live_batch = HostBatch(num_tokens=3, inputs={"input_ids": torch.zeros(8, dtype=torch.int32)})
        assert pm.hook.bcg_embed(batch=live_batch)["inputs_embeds"].shape == (3, 1024)
    assert batch.payload == ("ctx", 4) and host.capture_contexts[4] == ("ctx", 4)


def test_graphs_read_the_runners_persistent_input_buffers_in_place(vllm_model_config, monkeypatch):
    from bcg_plugin.adapters.vllm.host import V1Host

    config = make_config(vllm_model_config)
    monkeypatch.setattr(config.model_config, "enable_prompt_embeds", False)  # the model config is shared
    ids, positions = torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int64)
    # V1 0.26: input_ids is a CPU/GPU buffer pair, positions a plain tensor.
    runner = types.SimpleNamespace(get_model=_TextModel, vllm_config=config, device=torch.device("cpu"),
                                   input_ids=types.SimpleNamespace(gpu=ids, cpu=torch.zeros(64)), positions=positions)
    statics = V1Host(runner).bcg_static_inputs()
    assert statics["input_ids"].host_buffer is ids and statics["positions"].host_buffer is positions

    host = _Host(_TextModel(), config)
    host.persistent_inputs = {"input_ids": ids.long(), "positions": torch.zeros(3, 64, dtype=torch.int64)}
    statics = host.bcg_static_inputs()  # a buffer the graphs cannot read in place: the core copies into its own
    assert statics["input_ids"].host_buffer is None and statics["positions"].host_buffer is None

    monkeypatch.setattr(config.model_config, "enable_prompt_embeds", True)  # graphs start from embeddings
    host = _Host(_TextModel(), config)
    host.persistent_inputs = {"input_ids": ids, "positions": positions}
    statics = host.bcg_static_inputs()
    assert statics["inputs_embeds"].host_buffer is None and statics["positions"].host_buffer is positions


@needs_v1
@pytest.mark.parametrize("num_tokens, seq_len", [(2048, 2048), (8192, 8192), (16384, 8192)])
def test_v1_capture_batches_keep_sequence_lengths_within_the_context(vllm_model_config, monkeypatch, num_tokens,
                                                                      seq_len):
    """V1's _dummy_run gives every request the whole batch as its sequence length unless told otherwise:
    above max_model_len, attention's reads overrun the block table (a chunk of 16384 at max_model_len
    8192 ended the process with an illegal memory access)."""
    import inspect

    import vllm.forward_context
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from bcg_plugin.adapters.vllm.host import V1Host

    config = make_config(vllm_model_config)
    monkeypatch.setattr(config.model_config, "max_model_len", 8192)  # the model config is shared
    assert "profile_seq_lens" in inspect.signature(GPUModelRunner._dummy_run).parameters
    calls = []

    def _dummy_run(num_tokens, **kwargs):  # what V1's does for bcg: a forward context, then the model
        calls.append((num_tokens, kwargs))
        runner.model()

    runner = types.SimpleNamespace(get_model=_TextModel, vllm_config=config, device=torch.device("cpu"),
                                   model=None, _dummy_run=_dummy_run)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: ("ctx", num_tokens))
    assert V1Host(runner).capture_context(num_tokens) == ("ctx", num_tokens)
    assert calls == [(num_tokens, {"cudagraph_runtime_mode": calls[0][1]["cudagraph_runtime_mode"],
                                   "force_attention": True, "skip_eplb": True, "remove_lora": False,
                                   "profile_seq_lens": seq_len})]


@pytest.mark.parametrize("max_num_seqs, max_model_len, chunk, top", [
    (2, 1024, 8192, 2048),  # vLLM only warns: no step holds more than two requests of 1024 tokens
    (1, 4096, 16384, 4096),
    (64, 8704, 16384, 16384),  # the GPU test's engines at vLLM's default chunk for LLM on an H200
    (256, 8192, 2048, 2048),
])
def test_the_ladder_stops_at_the_most_tokens_a_step_can_schedule(vllm_model_config, monkeypatch, caplog,
                                                                max_num_seqs, max_model_len, chunk, top):
    from vllm.config import SchedulerConfig

    from bcg_plugin.adapters.vllm import replay as graphs

    monkeypatch.setattr(vllm_model_config, "max_model_len", max_model_len)  # the model config is shared
    scheduler = SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len, is_encoder_decoder=False)
    config = make_config(vllm_model_config, scheduler_config=scheduler, additional_config={"bcg": {"enable": True}})
    assert (config.scheduler_config.max_num_batched_tokens, config.scheduler_config.max_num_seqs) == (chunk,
                                                                                                       max_num_seqs)
    chunk_sizes = []

    class _Runner:  # the core runner, as far as the adapter hands it the host's chunk
        def __init__(self, pm, cfg, *, chunk_size, device):
            chunk_sizes.append(chunk_size)
            self.stats = types.SimpleNamespace()

    monkeypatch.setattr(graphs, "PrefillGraphRunner", _Runner)
    monkeypatch.setattr(graphs, "stats_reporter", lambda *a, **k: None)
    monkeypatch.setattr(graphs, "_first_tp_rank", lambda: True)
    host = types.SimpleNamespace(plugins=lambda: [], device=torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="vllm.bcg"):
        graphs.VllmPrefillGraphs(host, config)
    assert chunk_sizes == [top]
    capped = [r.getMessage() for r in bcg_records(caplog) if "more than a step can schedule" in r.getMessage()]
    assert len(capped) == (top < chunk)
    if capped:
        assert f"up to {top} tokens" in capped[0] and str(chunk) in capped[0]


# -- stats over collective RPC ----------------------------------------------------------------------


def test_worker_extension_resolves_and_reports_this_workers_runners(monkeypatch):
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from bcg_plugin.adapters.vllm import replay as graphs, metrics as rpc
    from bcg_plugin.stats import Fallback, RuntimeStats

    ext = resolve_obj_by_qualname(rpc.WORKER_EXTENSION)
    assert ext is rpc.BcgWorkerExtension
    assert [a for a in dir(ext) if not a.startswith("__")] == ["bcg_stats"]  # vLLM refuses name clashes

    stats = RuntimeStats()
    stats.record_replay(16, 10)
    stats.record_fallback(Fallback.OVER_TOP_BUCKET)
    fake = types.SimpleNamespace(runner=types.SimpleNamespace(stats=stats))
    monkeypatch.setattr(graphs, "INSTANCES", [fake])
    (got,) = ext().bcg_stats()
    assert got["replays"] == 1 and got["replays_by_bucket"] == {"16": 1}
    assert got["fallbacks"] == {"over_top_bucket": 1} and got["padded_tokens"] == 6


def test_dp_expert_parallel_is_served_with_capturable_all2all():
    from bcg_plugin.adapters.vllm.config import unsupported_reason

    def cfg(backend, ep=True):
        parallel = types.SimpleNamespace(data_parallel_size=2, enable_expert_parallel=ep, all2all_backend=backend)
        return types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=False), parallel_config=parallel)

    assert unsupported_reason(cfg("allgather_reducescatter")) is None
    assert "DeepEP high-throughput" in unsupported_reason(cfg("deepep_high_throughput"))
    # vLLM turns graphs off for it under any data parallelism, so bcg declines without EP too
    assert "DeepEP high-throughput" in (unsupported_reason(cfg("deepep_high_throughput", ep=False)) or "")


@pytest.mark.parametrize("parallel, offload, reason", [
    ({"enable_elastic_ep": True}, None, "elastic expert parallelism"),
    ({"ubatch_size": 2}, None, "micro-batching (ubatch_size > 1)"),
    ({"ubatch_size": 1}, None, None),
    ({}, {"offload_backend": "auto", "group": 2}, "prefetch weight offloading"),
    ({}, {"offload_backend": "uva", "group": 2}, None),  # vLLM ignores the prefetch fields under UVA
    ({}, {"offload_backend": "auto", "group": 0}, None),
])
def test_features_that_recapture_or_span_forwards_are_declined(parallel, offload, reason):
    from bcg_plugin.adapters.vllm.config import unsupported_reason

    config = types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=False),
                                   parallel_config=types.SimpleNamespace(**parallel))
    if offload is not None:
        config.offload_config = types.SimpleNamespace(
            offload_backend=offload["offload_backend"],
            prefetch=types.SimpleNamespace(offload_group_size=offload["group"]))
    got = unsupported_reason(config)
    assert got is None if reason is None else got.startswith(reason)


@pytest.mark.parametrize("fast_prefill", [False, True])
def test_kv_sharing_fast_prefill_is_declined(fast_prefill):
    from bcg_plugin.adapters.vllm.config import unsupported_reason

    config = types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=False),
                                   cache_config=types.SimpleNamespace(kv_sharing_fast_prefill=fast_prefill))
    reason = unsupported_reason(config)
    assert reason == ("kv_sharing_fast_prefill is not supported by bcg prefill graphs" if fast_prefill else None)


def test_the_cores_log_lines_reach_vllms_handlers_once_the_runner_set_is_applied(monkeypatch):
    """vLLM's logging config covers only ``vllm.*``: the core's capture summary is routed there."""
    import logging

    from bcg_plugin.adapters.vllm import log, plugin

    core = logging.getLogger("bcg_plugin")
    monkeypatch.setattr(core, "handlers", [h for h in core.handlers if not isinstance(h, log._ToVllm)])
    monkeypatch.setattr(core, "level", core.level)
    monkeypatch.setattr(core, "propagate", True)  # as before any test in this process routed it
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    vllm_logger = logging.getLogger("vllm")
    keep = Keep()
    vllm_logger.addHandler(keep)
    # vLLM's logging not configured yet (from 0.33 an engine configures it when it starts, which may
    # come after the route is made): a level above INFO, as the root's WARNING of an unconfigured process.
    levels = {name: logging.getLogger(name).level for name in ("vllm", "vllm.bcg")}
    vllm_logger.setLevel(logging.WARNING)
    logging.getLogger("vllm.bcg").setLevel(logging.NOTSET)
    try:
        logging.getLogger("bcg_plugin").info("bcg: captured before")
        assert seen == []  # negative control: not routed yet
        monkeypatch.setattr(plugin.STATE, "runner_patches", None)
        monkeypatch.setattr("bcg_plugin.patches.vllm.RUNNER.apply", lambda calls=None: None)
        plugin.apply_runner_patches()
        logging.getLogger("bcg_plugin").info("bcg: below vLLM's level")
        assert seen == []  # vLLM's level holds for routed records
        vllm_logger.setLevel(logging.INFO)  # vLLM configures its logging after the route was made
        logging.getLogger("bcg_plugin").info("bcg: captured %d buckets", 56)
        assert seen == ["bcg: captured 56 buckets"]
        log.route_core_logs()
        logging.getLogger("bcg_plugin").info("bcg: again")
        assert seen[1:] == ["bcg: again"]  # once, however often it is routed
    finally:
        vllm_logger.removeHandler(keep)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


# -- doctor: which runtime serves prefill ----------------------------------------------------------


@pytest.mark.parametrize("environ, ready, expected, absent", [
    ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}, True, "prefill runtime: vLLM's breakable graphs", "bcg where"),
    ({}, True, "prefill runtime: bcg where", "bcg cannot run"),
    ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}, True, "prefill runtime: bcg where", "own breakable"),
    ({}, False, "bcg cannot run on this vLLM", "bcg where"),
])
def test_doctor_says_which_runtime_serves_prefill(environ, ready, expected, absent):
    from bcg_plugin.adapters.vllm.doctor import prefill_runtime

    line = prefill_runtime(environ, bcg_ready=ready, listed=["B", "A"])
    assert line.startswith("prefill runtime: ") and expected in line and absent not in line
    if environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH") != "1":
        assert "piecewise graphs" in line and "FULL graphs" in line and "eager" in line
    if "VLLM_USE_BREAKABLE_CUDAGRAPH" not in environ:
        assert "vLLM's own breakable graphs for the 2 architectures it lists (A, B, ...)" in line


def test_doctor_checks_this_releases_descriptors_and_names_the_prefill_runtime(monkeypatch):
    import io

    from bcg_plugin import doctor

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    out = io.StringIO()
    doctor.run(None, ["vllm"], out=out)
    text = out.getvalue()
    assert f"vllm {version.installed()}: compatible" in text and "FAIL" not in text
    assert sum(line.startswith("  ok   ") for line in text.splitlines()) == len({p.target for p in ALL if not _gone(p.target)})
    assert "note: prefill runtime: vLLM's breakable graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1 is set" in text
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH")
    out = io.StringIO()
    doctor.run(None, ["vllm"], out=out)
    assert "note: prefill runtime: bcg where" in out.getvalue()


# -- V2 capture inside vLLM's graph-memory profiling (0.29+) ---------------------------------------


def test_v2_capture_outside_profiling_keeps_its_graphs_and_declines_context_parallelism(monkeypatch):
    from bcg_plugin.adapters.vllm import replay

    built = []

    class Graphs:
        def __init__(self, reports):
            self.reports, self.captured, self.closed = reports, False, False

        def capture(self):
            self.captured = True

        def close(self):
            self.closed = True

    def build(host_factory, vllm_config, *, model, attn_groups, kv_cache_config, reports=True):
        built.append(Graphs(reports))
        return built[-1]

    monkeypatch.setattr(plugin, "runs_bcg", lambda cfg: True)
    monkeypatch.setattr(replay.VllmPrefillGraphs, "build", build)
    args = ("model", "state", "buffers", "tables", "groups", "kv")
    real = types.SimpleNamespace(vllm_config="cfg", device="cpu")

    kept = plugin.capture_v2(real, *args)
    assert kept.captured and kept.reports and not kept.closed
    assert plugin.capture_v2(real, *args, pcp_manager=object()) is None  # prefill context parallelism
    assert len(built) == 1 and not kept.closed


@pytest.mark.parametrize("outcome", ["estimated", "failed", "gpu_lost"])
def test_v2_profiling_samples_bcgs_buckets_and_adds_their_estimate_to_vllms(monkeypatch, caplog, outcome):
    """Inside vLLM's V2 graph-memory profiling, as the profile patch wraps it, bcg's buckets are
    sampled and released (``estimate``), not all captured, and the estimate joins vLLM's figure."""
    from bcg_plugin.adapters.vllm import replay
    from bcg_plugin.patches.vllm import v2_gpu_model_runner_profile_cudagraph_memory as mod

    built = []

    class Graphs:
        def __init__(self):
            self.captured = self.closed = False

        def capture(self):
            self.captured = True

        def estimate(self):
            if outcome == "failed":
                raise RuntimeError("no minimal KV cache")
            if outcome == "gpu_lost":
                raise BcgCaptureError("device-side assert")
            return 300

        def close(self):
            self.closed = True

    def build(host_factory, vllm_config, *, model, attn_groups, kv_cache_config, reports=True):
        built.append(Graphs())
        return built[-1]

    monkeypatch.setattr(plugin, "runs_bcg", lambda cfg: True)
    monkeypatch.setattr(replay.VllmPrefillGraphs, "build", build)
    manager = types.SimpleNamespace(vllm_config="cfg", device="cpu")

    def vllm_profile(runner):  # vLLM's profiling run: its capture calls the capture patch's capture_v2
        assert plugin.capture_v2(manager, "model", "state", "buffers", "tables", "groups", "kv") is None
        return 1000

    profile = mod.make(vllm_profile, profile_v2=plugin.profile_v2)
    with caplog.at_level(logging.WARNING, logger="vllm.bcg"):
        if outcome == "gpu_lost":
            with pytest.raises(BcgCaptureError):
                profile("runner")
        else:
            assert profile("runner") == (1300 if outcome == "estimated" else 1000)
    (graphs,) = built
    assert not graphs.captured  # sampled by estimate(), not captured in full
    assert graphs.closed == (outcome != "gpu_lost")  # nothing more runs on a GPU that is lost
    assert ("could not estimate the prefill graphs' memory" in caplog.text) == (outcome == "failed")
    assert plugin._V2_ESTIMATES.get() is None  # the profiling run's scope is closed
    assert plugin.capture_v2(manager, "model", "state", "buffers", "tables", "groups", "kv").captured  # outside profile_v2's run: the real capture


def test_only_graphs_that_serve_an_engine_answer_the_stats_rpc(vllm_model_config, monkeypatch):
    """Graphs built to measure memory (V1's estimate, V2's capture inside vLLM's profiling) report
    nothing: one runner per worker answers ``bcg_stats``."""
    from bcg_plugin.adapters.vllm import replay as graphs

    class _Runner:
        def __init__(self, pm, cfg, *, chunk_size, device):
            self.stats = types.SimpleNamespace()

    monkeypatch.setattr(graphs, "PrefillGraphRunner", _Runner)
    monkeypatch.setattr(graphs, "stats_reporter", lambda *a, **k: None)
    monkeypatch.setattr(graphs, "_first_tp_rank", lambda: True)
    monkeypatch.setattr(graphs, "INSTANCES", __import__("weakref").WeakSet())
    host = types.SimpleNamespace(plugins=lambda: [], device=torch.device("cpu"))
    config = make_config(vllm_model_config, additional_config={"bcg": {"enable": True}})
    serving = graphs.VllmPrefillGraphs(host, config)
    measuring = graphs.VllmPrefillGraphs(host, config, reports=False)
    assert serving in graphs.INSTANCES and measuring not in graphs.INSTANCES


def _v2_host(vllm_config, support, embeds_in_graph=True):
    """A V2 host as far as the attention plan reads it: one attention group whose builder reports ``support``."""
    from bcg_plugin.adapters.vllm.host import V2Host

    builder = types.SimpleNamespace(get_cudagraph_support=lambda config, spec: support,
                                    max_cudagraph_size=vllm_config.compilation_config.max_cudagraph_capture_size)
    group = types.SimpleNamespace(get_metadata_builder=lambda i=0: builder, metadata_builders=[builder],
                                  kv_cache_spec=None, backend=types.SimpleNamespace(get_name=lambda: "SOME_ATTN"))
    host = object.__new__(V2Host)
    host.vllm_config, host.attn_groups, host.embeds_in_graph = vllm_config, [[group]], embeds_in_graph
    host._raised_bounds = []
    return host


def test_v2_attention_stays_in_the_graph_only_where_vllm_lands_full_metadata(vllm_model_config):
    """The plan follows vLLM's own FULL-graph rules: a backend graphing any batch mix, FULL graphs in
    cudagraph_mode; "auto" keeps attention inside up to 2048 tokens (further where
    max_cudagraph_capture_size is larger), "graph" in every bucket; the builders' graph bound (FA3's
    split bound) is raised to the top bucket chosen."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.worker.gpu.cudagraph_utils import prepare_inputs_to_capture

    from bcg_plugin.adapters.vllm.host import accepts

    config = make_config(vllm_model_config)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    config.compilation_config.max_cudagraph_capture_size = 2048
    buckets = [16, 512, 1024, 1536, 2048, 4096]
    host = _v2_host(config, AttentionCGSupport.ALWAYS)
    if not accepts(prepare_inputs_to_capture, "max_query_len"):  # 0.26 / 0.27: every bucket breaks
        assert host.bcg_graph_attention(buckets, "graph") is None
        return
    config.compilation_config.max_cudagraph_capture_size = 512
    host = _v2_host(config, AttentionCGSupport.ALWAYS)
    builder = host.attn_groups[0][0].metadata_builders[0]
    assert host.bcg_graph_attention(buckets, "auto") == [16, 512, 1024, 1536, 2048]
    assert builder.max_cudagraph_size == 2048  # a larger step would get FA3's split heuristic
    assert host.bcg_graph_attention(buckets, "graph") == buckets
    assert builder.max_cudagraph_size == 4096
    config.compilation_config.max_cudagraph_capture_size = 4096  # vLLM's own FULL graphs reach further
    assert host.bcg_graph_attention(buckets, "auto") == buckets
    # a builder with no bound bcg knows how to raise keeps graph attention to vLLM's own bound,
    # unless its backend graphs any size; the builders bcg can raise are then left at that bound
    config.compilation_config.max_cudagraph_capture_size = 512
    host = _v2_host(config, AttentionCGSupport.ALWAYS)
    other = _v2_host(config, AttentionCGSupport.ALWAYS).attn_groups[0][0]
    del other.metadata_builders[0].max_cudagraph_size
    host.attn_groups[0].append(other)
    assert host.bcg_graph_attention(buckets, "graph") == [16, 512]
    assert host.attn_groups[0][0].metadata_builders[0].max_cudagraph_size == 512
    other.backend.get_name = lambda: "TRITON_ATTN"
    assert host.bcg_graph_attention(buckets, "graph") == buckets
    assert host.attn_groups[0][0].metadata_builders[0].max_cudagraph_size == 4096
    assert _v2_host(config, AttentionCGSupport.UNIFORM_BATCH).bcg_graph_attention(buckets, "graph") is None
    assert _v2_host(config, AttentionCGSupport.ALWAYS, embeds_in_graph=False).bcg_graph_attention(
        buckets, "graph") is None
    config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    assert host.bcg_graph_attention(buckets, "graph") is None
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    config.parallel_config.data_parallel_size = 2
    assert host.bcg_graph_attention(buckets, "auto") is None


def test_every_attention_groups_every_builder_gets_the_raised_graph_bound():
    """Each KV-cache group has attention groups, each with a builder per microbatch: a graph step
    reads any of them."""
    from bcg_plugin.adapters.vllm.host import raise_graph_bound

    def group(name, builders):
        return types.SimpleNamespace(backend=types.SimpleNamespace(get_name=lambda: name),
                                     metadata_builders=[types.SimpleNamespace(max_cudagraph_size=128)
                                                        for _ in range(builders)])

    groups = [[group("FLASH_ATTN", 2)], [group("FLASH_ATTN", 1), group("FLASH_ATTN", 2)]]
    raised = []
    assert raise_graph_bound(groups, 2048, 128, raised) == 2048
    assert [b.max_cudagraph_size for gs in groups for g in gs for b in g.metadata_builders] == [2048] * 5
    assert len(raised) == 5 and {previous for _, previous in raised} == {128}
    assert raise_graph_bound(groups, 1024, 128, raised) == 1024 and len(raised) == 5  # already above: kept


def test_a_failed_capture_or_closed_graphs_put_the_builders_bound_back():
    """Without bcg's graphs vLLM's eager steps above its own bound get FA3's split heuristic back,
    not the graph bound bcg raised for its buckets."""
    from bcg_plugin.adapters.vllm.host import V2Host, raise_graph_bound
    from bcg_plugin.adapters.vllm.replay import VllmPrefillGraphs

    builder = types.SimpleNamespace(max_cudagraph_size=128)
    host = object.__new__(V2Host)
    host.attn_groups = [[types.SimpleNamespace(backend=types.SimpleNamespace(get_name=lambda: "FLASH_ATTN"),
                                               metadata_builders=[builder])]]
    host._raised_bounds = []
    host.capturing = contextlib.nullcontext
    raise_graph_bound(host.attn_groups, 2048, 128, host._raised_bounds)
    graphs = object.__new__(VllmPrefillGraphs)
    graphs.host, graphs._reports = host, False
    graphs.runner = types.SimpleNamespace(capture=lambda progress: None, captured=False, buckets=[16])
    graphs.capture()  # the capture failed (capture_failure "eager")
    assert builder.max_cudagraph_size == 128
    raise_graph_bound(host.attn_groups, 2048, 128, host._raised_bounds)
    graphs.runner = types.SimpleNamespace(close=lambda: None)
    graphs._dispatched, graphs._graph_requests, graphs._buckets = {}, {}, frozenset()
    host.capture_contexts, host.capture_metadata = {}, {}
    graphs.close()
    assert builder.max_cudagraph_size == 128


def test_the_installed_backends_bound_their_graph_steps_where_bcg_raises_it():
    """raise_graph_bound relies on FA3's builder keeping its graph bound in ``max_cudagraph_size``
    (set at init, read by ``build``) and on TRITON_ATTN's builder having no size bound at all."""
    import inspect

    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionMetadataBuilder

    from bcg_plugin.adapters.vllm.host import UNBOUNDED_GRAPH_BACKENDS

    assert "self.max_cudagraph_size =" in inspect.getsource(FlashAttentionMetadataBuilder.__init__)
    assert "self.max_cudagraph_size" in inspect.getsource(FlashAttentionMetadataBuilder.build)
    assert "max_cudagraph" not in inspect.getsource(TritonAttentionMetadataBuilder)
    assert TritonAttentionBackend.get_name() in UNBOUNDED_GRAPH_BACKENDS  # the name the groups report


def test_where_attention_cannot_stay_in_the_graph_the_reason_is_logged_once(vllm_model_config, monkeypatch):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    from bcg_plugin.adapters.vllm import host as host_mod

    said = []
    monkeypatch.setattr(host_mod, "_SAID", set())
    monkeypatch.setattr(host_mod, "logger", types.SimpleNamespace(
        warning=lambda fmt, *a: said.append(("warning", fmt % a)), info=lambda fmt, *a: said.append(("info", fmt % a))))
    config = make_config(vllm_model_config)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    host = _v2_host(config, AttentionCGSupport.UNIFORM_BATCH)
    assert host.bcg_graph_attention([16], "graph") is None and host.bcg_graph_attention([16], "graph") is None
    assert len(said) == 1 and said[0][0] == "warning"  # asked for explicitly: a warning, once
    assert said[0][1].startswith("bcg: attention stays an eager break in every bucket: ")


def test_a_graph_attention_bucket_is_captured_with_vllms_full_metadata_for_its_padded_requests(
        vllm_model_config, monkeypatch):
    """Attention captured inside the graph reads what vLLM's FULL path lands at every step: the capture
    must build that metadata (FULL kind, the bucket's request count, the bucket's query length)."""
    import vllm.v1.worker.gpu.cudagraph_utils as cg

    from bcg_plugin.adapters.vllm import host as host_mod
    from bcg_plugin.adapters.vllm.host import V2Host, accepts

    if not accepts(cg.prepare_inputs_to_capture, "max_query_len"):
        pytest.skip("this vLLM builds no FULL capture metadata bcg uses")
    calls = []

    def prepare(num_reqs, num_tokens, model_state, input_buffers, block_tables, attn_groups, kv_cache_config,
                full_cudagraph, max_query_len=None):  # the signature the release's descriptors verify
        calls.append((num_reqs, num_tokens, full_cudagraph, max_query_len))
        return {}, {}

    monkeypatch.setattr(cg, "prepare_inputs_to_capture", prepare)
    monkeypatch.setattr(host_mod, "_forward_context", lambda *args: "ctx")
    config = make_config(vllm_model_config)
    host = object.__new__(V2Host)
    host.vllm_config = config
    host.model_state = host.block_tables = host.attn_groups = host.kv_cache_config = None
    host.input_buffers = types.SimpleNamespace(is_padding=torch.zeros(4096, dtype=torch.bool))
    max_seqs = config.scheduler_config.max_num_seqs
    host.capture_context(2048, graph_attention=True)
    host.capture_context(16, graph_attention=True)
    host.capture_context(2048)
    assert calls == [(min(2048, max_seqs), 2048, True, 2048), (16, 16, True, 16), (1, 2048, False, None)]


def test_a_step_of_one_token_requests_keeps_out_of_a_graph_attention_bucket_whose_fa3_launch_it_misses():
    """vLLM plans FA3's scheduler metadata by the step's longest query: at 1 (decodes above vLLM's own
    decode graphs) FA3 lays its launch out otherwise than the kernel the bucket captured at the
    bucket's length. Such a step runs as vLLM runs it, counted; Triton's kernel reads no such plan."""
    from bcg_plugin import RuntimeStats
    from bcg_plugin.adapters.vllm.host import V2Host
    from bcg_plugin.adapters.vllm.replay import VllmPrefillGraphs

    def backends(*names):
        return [[types.SimpleNamespace(backend=types.SimpleNamespace(get_name=lambda n=n: n)) for n in names]]

    host = object.__new__(V2Host)
    host.attn_groups = backends("FLASH_ATTN")
    assert host.plans_one_token_steps_apart()
    host.attn_groups = backends("TRITON_ATTN")
    assert not host.plans_one_token_steps_apart()

    stats = RuntimeStats()
    graphs = object.__new__(VllmPrefillGraphs)
    graphs.runner = types.SimpleNamespace(bucket_for=lambda n: 32 if n <= 32 else 48, record_fallback=stats.record_fallback)
    graphs.reporter = types.SimpleNamespace(tick=lambda: None)
    graphs._graph_requests, graphs._dispatched, graphs._one_token_steps_apart = {32: 24}, {}, True
    assert graphs.bucket_for(20, 20) is None and graphs._dispatched == {}  # eager, and nothing left dispatched
    assert stats.fallbacks["feature_not_captured"] == 1
    assert graphs.bucket_for(20, 19) == 32  # one request of two tokens: the launch the bucket captured
    assert graphs.bucket_for(40, 40) == 48  # attention breaks there: vLLM plans the live batch
    assert graphs.bucket_for(20) == 32  # no request count (V1, which keeps attention out of the graph)
    graphs._one_token_steps_apart = False  # Triton
    assert graphs.bucket_for(20, 20) == 32


def test_a_full_replay_lands_the_count_last_dispatched_to_its_bucket_and_refuses_one_never_dispatched():
    """A FULL step passes no batch: the real rows are those vLLM last dispatched to the bucket (a
    dispatch that was not replayed is overwritten by the step's own); a replay with none dispatched
    is refused, not guessed (rows cut below vLLM's logits indices would be lost)."""
    from bcg_plugin import BcgStateError
    from bcg_plugin.adapters.vllm.replay import VllmPrefillGraphs

    replays = []
    graphs = object.__new__(VllmPrefillGraphs)
    graphs.runner = types.SimpleNamespace(bucket_for=lambda n: 32 if n <= 32 else 48,
                                          replay=lambda bucket, batch: replays.append((bucket, batch)) or "hidden")
    graphs.reporter = types.SimpleNamespace(tick=lambda: None)
    graphs.host = types.SimpleNamespace(persistent_inputs={"input_ids": torch.arange(64), "positions": torch.arange(64)})
    graphs._dispatched, graphs._graph_requests, graphs._one_token_steps_apart = {}, {}, False
    graphs.bucket_for(20)  # dispatched, never replayed
    graphs.bucket_for(30)  # the step's count, same bucket
    graphs.bucket_for(40)
    assert graphs.forward_full(32) == "hidden"
    bucket, batch = replays[0]
    assert (bucket, batch.num_tokens) == (32, 30) and batch.inputs["positions"].shape == (32,)
    assert graphs.forward_full(48) == "hidden" and replays[1][1].num_tokens == 40
    with pytest.raises(BcgStateError, match="bucket 32 with no token count dispatched"):
        graphs.forward_full(32)  # the count was the previous step's
