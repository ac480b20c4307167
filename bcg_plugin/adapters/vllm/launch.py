"""What ``additional_config={"bcg": {"enable": true}}`` changes in the engine config, and nothing else.

Runs at the top of ``VllmConfig.__post_init__`` (in the front-end, where the config is built), so
the launch flags bcg needs are in place before vLLM applies its optimisation-level defaults:

* the compilation mode stays as vLLM sets it (``torch_compile``, the vLLM default): at the default
  ``-O2`` that is ``VLLM_COMPILE``, whose piecewise compilation splits the body at attention and the
  KV-cache write; bcg captures the compiled pieces and the write, and attention stays the eager
  break. At ``-O0`` nothing is compiled and bcg captures the plain model. With
  ``"torch_compile": false`` the plugin sets ``compilation_config.mode = NONE`` (the same as ``-O0``)
  for a shorter start, without the compiler's fused kernels;
* ``compilation_config.cudagraph_mode = FULL_DECODE_ONLY`` unless the user chose ``NONE``: vLLM keeps
  its own FULL graphs for uniform decode batches, and every other batch is dispatched to bcg.
  Modes with piecewise graphs would be downgraded to ``NONE`` by vLLM without torch.compile, which
  would silently drop the decode graphs too.
"""

from __future__ import annotations

from typing import Any

from bcg_plugin.adapters.vllm.config import bcg_config, compile_problem, raw_bcg_config, unsupported_reason
from bcg_plugin.adapters.vllm.log import logger

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
    """Validate the bcg config (errors name the key) and set the launch flags when bcg is on."""
    if raw_bcg_config(vllm_config) is None:
        return
    cfg = bcg_config(vllm_config)
    if not cfg.active:
        return
    reason = unsupported_reason(vllm_config)
    if reason is not None:
        _log_once("warning", "bcg: prefill graphs stay off for this engine: %s", reason)
        return
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    cc = vllm_config.compilation_config
    changed = []
    if cfg.torch_compile:
        problem = compile_problem(cc)
        if problem is not None:
            _log_once("warning", "bcg: prefill graphs stay off for this engine: %s", problem)
            return
    elif cc.mode != CompilationMode.NONE:
        changed.append(f"compilation mode {getattr(cc.mode, 'name', 'default')} -> NONE ({COMPILE_HINT})")
        cc.mode = CompilationMode.NONE
    if cc.cudagraph_mode not in (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY):
        changed.append(f"cudagraph_mode {getattr(cc.cudagraph_mode, 'name', 'default')} -> FULL_DECODE_ONLY")
        cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    _log_once(
        "info", "bcg: prefill graphs enabled (%s); %s", cfg.to_dict(),
        "; ".join(changed) if changed else "launch flags already as needed",
    )

