"""What ``additional_config={"bcg": {"enable": true}}`` changes in the engine config, and nothing else.

Runs at the top of ``VllmConfig.__post_init__`` (in the front-end, where the config is built), so
the launch flags bcg needs are in place before vLLM applies its optimisation-level defaults. First it
decides whether bcg can run at all (:func:`~bcg_plugin.adapters.vllm.config.launch_problem`: the
model, the parallel layout, the attention backend the user chose, the compilation, the graph mode,
and whether this vLLM's model runner takes bcg's patches). If not, it logs one warning and changes
nothing: the engine compiles and captures exactly as it would without the plugin. If so:

* the compilation mode stays as vLLM sets it (``torch_compile``, the vLLM default): at the default
  ``-O2`` that is ``VLLM_COMPILE``, whose piecewise compilation splits the body at attention and the
  KV-cache write; bcg captures the compiled pieces and the write, and attention stays the eager
  break. At ``-O0`` nothing is compiled and bcg captures the plain model. With
  ``"torch_compile": false`` the plugin sets ``compilation_config.mode = NONE`` (the same as ``-O0``)
  for a shorter start, without the compiler's fused kernels;
* ``cudagraph_mode``, the rule: bcg never changes a mode the user set. Unset, it becomes
  ``FULL_DECODE_ONLY``: vLLM keeps its own FULL graphs for uniform decode batches, and every other
  batch is dispatched to bcg (modes with piecewise graphs would be downgraded to ``NONE`` by vLLM
  without torch.compile, dropping the decode graphs too, and with it their graphs would serve the
  batches bcg captures). Set to ``NONE`` or ``FULL_DECODE_ONLY``, it is kept and bcg runs. Set to
  any other mode (``PIECEWISE``, ``FULL``, ``FULL_AND_PIECEWISE``), it is kept and bcg stays off,
  with one warning.

vLLM's own breakable graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH``): vLLM turns them on by itself for a
list of architectures (and, from 0.31, for some batch-invariant setups) when the variable is unset,
which would give prefill two runtimes. Where bcg runs and the variable is unset, bcg sets it to ``0``,
vLLM's documented opt-out, before vLLM reads it: the variable reaches the engine core and the workers
(spawned from this process; Ray copies it explicitly), so no worker builds vLLM's breakable runner
and bcg serves prefill alone. Set to ``1`` by the user, bcg stays off (one warning).

A worker can still decline later, on what only a built model runner shows (an attention backend vLLM
chose itself, KV-cache groups other than attention, a capture that fails with
``capture_failure: "eager"``). The flags above are then in place for good: :func:`warn_declined`
says once what the engine runs instead, and that a restart without bcg gets vLLM's own graphs back.
"""

from __future__ import annotations

import os
from typing import Any

from bcg_plugin.adapters.vllm.config import (
    BREAKABLE_ENV,
    LAUNCH_RECORD_KEY,
    bcg_config,
    check_sizes,
    graphs_turned_off,
    launch_problem,
    launch_record,
    raw_bcg_config,
)
from bcg_plugin.adapters.vllm.log import logger
from bcg_plugin.errors import BcgConfigError, one_line_if_uncaught

# Said where bcg turns torch.compile off: the compiler's fused kernels are what a GPU-bound prefill
# loses (Qwen3's per-head q/k norm and rotary run as separate eager kernels).
COMPILE_HINT = ('"torch_compile": false: a shorter start, without vLLM\'s compiled kernels, which are faster '
                "where prefill is GPU-bound")

_logged: set[str] = set()


def _log_once(level: str, msg: str, *args: Any) -> None:
    # __post_init__ also runs on copies of the config (drafter, replace()): say each thing once.
    key = msg % args
    if key not in _logged:
        _logged.add(key)
        getattr(logger, level)(msg, *args)


def configure_engine(vllm_config: Any) -> None:
    """Validate the bcg config (errors name the key); set the launch flags only if bcg will run."""
    _warn_unread_environment()
    if raw_bcg_config(vllm_config) is None:
        return
    try:
        _configure(vllm_config)
    except BcgConfigError:
        one_line_if_uncaught()  # vLLM's command line then ends with it, not with pydantic's traceback
        raise


def _configure(vllm_config: Any) -> None:
    cfg = bcg_config(vllm_config)
    if not cfg.active:
        return
    from bcg_plugin.adapters.vllm.plugin import runner_patch_problem

    reason = runner_patch_problem() or launch_problem(vllm_config, cfg)
    if reason is not None:
        _log_once("warning", "bcg: prefill graphs stay off for this engine: %s; vLLM's compilation and CUDA graph "
                  "modes are left as configured", reason)
        return
    check_sizes(vllm_config, cfg)  # before any flag changes
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    cc = vllm_config.compilation_config
    changed = []
    record: dict[str, list[str]] = {}
    if BREAKABLE_ENV not in os.environ:
        if vllm_breakable_default(vllm_config):
            changed.append(f"{BREAKABLE_ENV}=0 (vLLM turns its breakable graphs on for "
                           f"{'/'.join(architectures(vllm_config)) or 'this model'}; bcg serves prefill instead)")
            record["breakable"] = ["on", "off"]
        os.environ[BREAKABLE_ENV] = "0"
    if not cfg.torch_compile and cc.mode != CompilationMode.NONE:
        before = _name(cc.mode) or _default_name(vllm_config, "mode")
        if before != "NONE":
            changed.append(f"compilation mode {before or 'default'} -> NONE ({COMPILE_HINT})")
            record["mode"] = [before or "default", "NONE"]
        cc.mode = CompilationMode.NONE
    if cc.cudagraph_mode is None:
        before = _default_name(vllm_config, "cudagraph_mode")
        if before != "FULL_DECODE_ONLY":
            changed.append(f"cudagraph_mode {before or 'default'} (vLLM's default) -> FULL_DECODE_ONLY")
            record["cudagraph_mode"] = [before or "default", "FULL_DECODE_ONLY"]
        cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    record["graphs"] = _name(cc.cudagraph_mode)
    # A copy of the config (dataclasses.replace) starts again with nothing left to change: keep what
    # the first start recorded.
    vllm_config.additional_config = {**vllm_config.additional_config,
                                     LAUNCH_RECORD_KEY: {**(launch_record(vllm_config) or {}), **record}}
    _log_once(
        "info", "bcg: prefill graphs enabled (%s); %s", cfg.to_dict(),
        "; ".join(changed) if changed else "launch flags already as needed",
    )


def _warn_unread_environment() -> None:
    """vLLM takes bcg's configuration from ``additional_config`` only; ``BCG_*`` variables that
    configure SGLang's bcg would otherwise be ignored here without a word."""
    from bcg_plugin.config import config_env_names

    unread = sorted(name for name in config_env_names() if name in os.environ)
    if unread:
        _log_once("warning", "bcg: vLLM reads bcg's configuration from additional_config['bcg'] only; %s %s "
                  "ignored (SGLang reads them)", ", ".join(unread), "is" if len(unread) == 1 else "are")


def warn_declined(vllm_config: Any, reason: str) -> None:
    """One warning where a worker declines after the front-end set bcg's launch flags: why, what the
    engine runs instead, and what a restart without bcg gives back."""
    cc = getattr(vllm_config, "compilation_config", None)
    graphs = _name(getattr(cc, "cudagraph_mode", None))
    compiled = _name(getattr(cc, "mode", None)) not in (None, "NONE")
    runs = "prefill and mixed batches run eagerly" + ("" if compiled else ", without torch.compile")
    if graphs == "FULL_DECODE_ONLY":
        runs += "; decode keeps vLLM's FULL graphs"
    else:
        runs += f"; decode runs under cudagraph_mode={graphs}" + (" (eagerly)" if graphs == "NONE" else "")
    record = launch_record(vllm_config) or {}
    back = []
    # Graphs vLLM turned off itself would stay off without bcg too.
    if record.get("cudagraph_mode") and record["cudagraph_mode"][0] != "NONE" and graphs_turned_off(vllm_config) is None:
        back.append(f"{record['cudagraph_mode'][0]} graphs")
    if record.get("mode"):
        back.append("torch.compile")
    if record.get("breakable"):
        back.append("breakable graphs")
    restart = (f"; restart without bcg (no additional_config['bcg']) to get vLLM's {' and '.join(back)} back"
               if back else "")
    _log_once("warning", "bcg: prefill graphs are off in this engine: %s; %s%s", reason, runs, restart)


def vllm_breakable_default(vllm_config: Any) -> bool | None:
    """Whether vLLM would turn its breakable graphs on by itself for this config with
    ``VLLM_USE_BREAKABLE_CUDAGRAPH`` unset (asked of vLLM's own allow-list from 0.29), or ``None``
    where this vLLM keeps that decision inline."""
    ask = getattr(type(vllm_config), "_uses_breakable_cudagraph_by_default", None)
    if ask is None or getattr(vllm_config, "model_config", None) is None:
        return None
    try:
        return bool(ask(vllm_config))
    except Exception:  # a vLLM internal that needs more of the config than this one has: unknown
        return None


def architectures(vllm_config: Any) -> list[str]:
    return list(getattr(getattr(vllm_config, "model_config", None), "architectures", None) or [])


def _name(mode: Any) -> str | None:
    return None if mode is None else getattr(mode, "name", str(mode))


def _default_name(vllm_config: Any, key: str) -> str | None:
    """What vLLM's optimisation level will set ``compilation_config.<key>`` to (``None`` if unknown)."""
    try:
        from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG, OptimizationLevel

        level = OptimizationLevel(int(getattr(vllm_config, "optimization_level", OptimizationLevel.O2)))
        if key == "mode":
            return "VLLM_COMPILE" if level > OptimizationLevel.O0 else "NONE"
        return _name(OPTIMIZATION_LEVEL_TO_CONFIG[level]["compilation_config"].get(key))
    except Exception:  # a vLLM internal: without it the log and the record say "default"
        return None
