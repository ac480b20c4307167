"""The plugin's process-wide state: which patch sets are in, and the calls the patches make.

``register()`` (the ``vllm.general_plugins`` entry point) runs in the API server, the engine core
and every worker, possibly more than once, before any config exists. It only checks the vLLM
version and installs the two cheap entry patches; everything else waits until a config that
enables bcg reaches a worker (:func:`arm_runner_patches`).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

from bcg_plugin import BcgCaptureError
from bcg_plugin.adapters.vllm import version
from bcg_plugin.adapters.vllm.config import bcg_config, launch_problem, launch_record, prefill_graphs_wanted
from bcg_plugin.adapters.vllm.log import logger, route_core_logs
from bcg_plugin.patches.vllm import GATE
from bcg_plugin.versions import UNTESTED_ENV


class _State:
    """What this process has done: registered, refused (and why), runner patches in or refused, and
    whether the runner patch set verifies here (checked once, in the front-end before any flag changes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.registered = False
        self.disabled_reason: str | None = None
        self.runner_patches: bool | None = None  # None: not tried yet
        self.runner_problem: str | None = None  # why the runner patch set does not verify here
        self.runner_verified = False


STATE = _State()


def register() -> None:
    """Entry point: zero-arg, re-entrant, cheap; installs pass-through patches only on a known vLLM.

    On a vLLM version these patches were not verified against, or when a target is missing or
    changed, it logs one warning, patches nothing and the engine runs as if bcg were not installed.
    """
    with STATE.lock:
        if STATE.registered or STATE.disabled_reason is not None:
            return
        reason = _refusal()
        if reason is not None:
            STATE.disabled_reason = reason
            logger.warning("bcg: prefill graphs are off: %s; vLLM runs unchanged", reason)
            return
        STATE.registered = True
        if version.untested():
            logger.warning("bcg: vLLM %s is newer than every release bcg-plugin was validated on; running UNTESTED "
                           "with the patches of vLLM %s (%s is set)", version.installed(), GATE.releases[-1],
                           UNTESTED_ENV)


def calls() -> dict[str, Any]:
    """What the patches call in the adapter, by the names their ``make`` takes."""
    from bcg_plugin.adapters.vllm.attention import capture_refusal, make_attention_break
    from bcg_plugin.adapters.vllm.launch import configure_engine

    return {
        "configure_engine": configure_engine,
        "arm_runner_patches": arm_runner_patches,
        "runs_bcg": runs_bcg,
        "capture_v1": capture_v1,
        "capture_v2": capture_v2,
        "estimate_v1": estimate_v1,
        "profile_v2": profile_v2,
        "attention_break": make_attention_break,
        "capture_refusal": capture_refusal,
    }


def _refusal() -> str | None:
    from bcg_plugin.patches import PatchTargetError
    from bcg_plugin.patches.vllm import ENTRY

    problem = version.problem()
    if problem is not None:
        return problem
    try:
        ENTRY.apply(calls())
    except PatchTargetError as e:
        return f"vLLM {version.installed()} does not have the expected patch targets ({e})"
    return None


def runner_patch_problem() -> str | None:
    """Why this vLLM's model runner cannot take bcg's patches, or ``None``; verified once per process,
    patching nothing, so the front-end can decline before it changes any launch flag."""
    from bcg_plugin.patches import PatchTargetError
    from bcg_plugin.patches.vllm import RUNNER

    with STATE.lock:
        if not STATE.runner_verified:
            try:
                RUNNER.verify()
            except PatchTargetError as e:
                STATE.runner_problem = f"the vLLM model runner changed ({e})"
            STATE.runner_verified = True
        return STATE.runner_problem


def runs_bcg(vllm_config: Any) -> bool:
    """Whether this process captures and replays bcg graphs for ``vllm_config``."""
    return bool(STATE.runner_patches) and prefill_graphs_wanted(vllm_config)


def arm_runner_patches(vllm_config: Any) -> bool:
    """Install the model-runner patch set once, if ``vllm_config`` enables bcg; False if it cannot.

    A worker whose final config declines what the front-end enabled (set bcg's launch flags for)
    says so once: vLLM changed the config after the front-end's check (a KV connector it derived,
    graphs it turned off), and the engine runs without prefill graphs.
    """
    if not prefill_graphs_wanted(vllm_config):
        if launch_record(vllm_config) is not None:
            reason = launch_problem(vllm_config, bcg_config(vllm_config))
            if reason is not None:
                from bcg_plugin.adapters.vllm.launch import warn_declined

                warn_declined(vllm_config, reason)
        return False
    return apply_runner_patches(vllm_config)


def apply_runner_patches(vllm_config: Any = None) -> bool:
    """Install the model-runner patch set once in this process (one warning if it cannot: the one
    that says what the engine of ``vllm_config`` runs instead, when given)."""
    from bcg_plugin.patches import PatchTargetError
    from bcg_plugin.patches.vllm import RUNNER

    problem = None
    with STATE.lock:
        if STATE.runner_patches is None:
            route_core_logs()  # this worker runs the core: its capture summary belongs in vLLM's log

            try:
                RUNNER.apply(calls())
                STATE.runner_patches = True
            except PatchTargetError as e:
                STATE.runner_patches = False
                problem = f"the vLLM model runner changed ({e})"
        applied = STATE.runner_patches
    if problem is not None:
        if vllm_config is not None:
            from bcg_plugin.adapters.vllm.launch import warn_declined

            warn_declined(vllm_config, problem)
        else:
            logger.warning("bcg: prefill graphs are off: %s", problem)
    return applied


def unregister() -> None:
    """Remove every patch this process installed (tests; engines never need it)."""
    from bcg_plugin.patches.vllm import ENTRY, RUNNER

    with STATE.lock:
        RUNNER.unapply()
        ENTRY.unapply()
        STATE.registered = False
        STATE.disabled_reason = None
        STATE.runner_patches = None
        STATE.runner_problem = None
        STATE.runner_verified = False


# -- called by the capture patches ---------------------------------------------------------------


# Set by :func:`profile_v2` for the profiling run it wraps: the estimates of bcg's buckets taken in it.
_V2_ESTIMATES: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("bcg_v2_estimates", default=None)


def profile_v2(profile: Callable[[], int]) -> int:
    """vLLM's V2 graph-memory estimate (``profile()``) plus bcg's, which :func:`capture_v2` takes inside it
    from a sample of its buckets (:meth:`~bcg_plugin.PrefillGraphRunner.estimate_graph_bytes`), released
    before vLLM measures, as vLLM extrapolates its own FULL graphs from the largest two."""
    estimates: list[int] = []
    token = _V2_ESTIMATES.set(estimates)
    try:
        measured = profile()
    finally:
        _V2_ESTIMATES.reset(token)
    return measured + sum(estimates)


def capture_v2(manager: Any, model: Any, model_state: Any, input_buffers: Any, block_tables: Any,
               attn_groups: Any, kv_cache_config: Any, pcp_manager: Any = None) -> Any:
    """Build and capture the V2 runner's prefill graphs; ``None`` when bcg does not run here.

    Inside vLLM's graph-memory profiling (from 0.29: only ``GPUModelRunner.profile_cudagraph_memory``
    runs it, which the same patch set wraps with :func:`profile_v2`) the buckets are sampled and
    released, and the estimate goes to :func:`profile_v2`. With prefill context parallelism
    (``pcp_manager``), which the front-end already declines, nothing is captured.
    """
    from bcg_plugin.adapters.vllm.replay import VllmPrefillGraphs
    from bcg_plugin.adapters.vllm.host import V2Host

    if not runs_bcg(manager.vllm_config) or pcp_manager is not None:
        return None
    estimates = _V2_ESTIMATES.get()
    graphs = VllmPrefillGraphs.build(
        lambda: V2Host(model, manager.vllm_config, manager.device, model_state=model_state,
                       input_buffers=input_buffers, block_tables=block_tables, attn_groups=attn_groups,
                       kv_cache_config=kv_cache_config),
        manager.vllm_config, model=model, attn_groups=attn_groups, kv_cache_config=kv_cache_config,
        reports=estimates is None,
    )
    if graphs is None:
        return None
    if estimates is not None:
        estimates.append(_estimate(graphs))
        return None
    graphs.capture()
    return graphs


def _estimate(graphs: Any) -> int:
    """``graphs``' estimate, then closed. The estimate is advice for vLLM's memory budget: a failure
    estimates nothing (one warning), unless it left the GPU unusable, when that error propagates with
    nothing more run on the GPU."""
    usable = True
    try:
        return graphs.estimate()
    except BcgCaptureError:
        usable = False
        raise
    except Exception as e:
        logger.warning(NO_ESTIMATE, e)
        return 0
    finally:
        if usable:
            graphs.close()


NO_ESTIMATE = ("bcg: could not estimate the prefill graphs' memory (%r); vLLM sizes the KV cache without them, "
               "so they come out of the headroom --gpu-memory-utilization leaves")


def estimate_v1(runner: Any) -> int:
    """bcg's graph memory for the V1 runner's KV-cache sizing, measured like vLLM's own estimate:
    on a minimal KV cache, released afterwards. 0 when bcg does not run here.

    The estimate is advice for vLLM's memory budget: if taking it fails, vLLM sizes the KV cache
    without it (one warning) and the capture, which decides whether bcg runs, still follows; unless
    the failure left the GPU unusable (the core's :class:`~bcg_plugin.BcgCaptureError`), when nothing
    can follow and the engine stops with that error.
    """
    from vllm.config import set_current_vllm_config

    if not runs_bcg(runner.vllm_config):
        return 0
    usable = True
    try:
        with set_current_vllm_config(runner.vllm_config):
            runner._init_minimal_kv_cache_for_profiling()
        try:
            graphs = _v1_graphs(runner, reports=False)
            return 0 if graphs is None else _estimate(graphs)
        except BcgCaptureError:
            usable = False  # nothing runs on the GPU any more, the clean-up included
            raise
        finally:
            if usable:
                runner._cleanup_profiling_kv_cache()
    except BcgCaptureError:
        raise
    except Exception as e:
        logger.warning(NO_ESTIMATE, e)
        return 0


def capture_v1(runner: Any) -> Any:
    """Build and capture the V1 runner's prefill graphs; ``None`` when bcg does not run here."""
    if not runs_bcg(runner.vllm_config):
        return None
    graphs = _v1_graphs(runner)
    if graphs is not None:
        graphs.capture()
    return graphs


def _v1_graphs(runner: Any, reports: bool = True) -> Any:
    from bcg_plugin.adapters.vllm.replay import VllmPrefillGraphs
    from bcg_plugin.adapters.vllm.host import V1Host

    return VllmPrefillGraphs.build(
        lambda: V1Host(runner), runner.vllm_config, model=runner.get_model(), attn_groups=runner.attn_groups,
        kv_cache_config=runner.kv_cache_config, reports=reports,
    )
