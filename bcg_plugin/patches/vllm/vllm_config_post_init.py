"""``VllmConfig.__post_init__``: validate ``additional_config["bcg"]`` and set bcg's launch flags.

Runs before the original, so decode keeps FULL graphs (and torch.compile is off where the bcg config
says ``"torch_compile": false``) before vLLM applies its optimisation-level defaults (see
:mod:`bcg_plugin.adapters.vllm.launch`). A pass-through when the config has no ``"bcg"`` key.

The original turns vLLM's own breakable graphs on by itself for some architectures (an inline list
through 0.28, ``_maybe_enable_breakable_cudagraph`` and its allow-list from 0.29) by setting
``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` when the variable is unset. Where bcg runs, it sets the variable
to ``0`` first, vLLM's documented opt-out: one runtime serves prefill, no graph is captured twice.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def make(original, *, configure_engine):
    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        configure_engine(self)
        return original(self, *args, **kwargs)

    return __post_init__


TARGET = "vllm.config.vllm.VllmConfig.__post_init__"
REASON = ("validate `additional_config['bcg']` at engine start (errors name the key); when enabled set "
          "`cudagraph_mode=FULL_DECODE_ONLY` (kept `NONE` if the user chose it), and "
          '`compilation_config.mode=NONE` only with `"torch_compile": false` (by default the mode stays '
          "as vLLM sets it), before optimisation-level defaults apply; log unsupported setups once. "
          "Where bcg runs and `VLLM_USE_BREAKABLE_CUDAGRAPH` is unset, set it to `0` (vLLM's opt-out) so "
          "the original does not turn vLLM's breakable graphs on for its listed architectures: bcg "
          "replaces them; `VLLM_USE_BREAKABLE_CUDAGRAPH=1` set by the user keeps bcg off")
REMOVE_WHEN = "vLLM lets a general plugin adjust the config before defaults (a config hook)"

PATCHES = (
    Patch(target=TARGET, how=Wrap(params=["self"]), make=make, reason=REASON + " (inline architecture list)",
          hosts=">=0.26.0,<0.29", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
    Patch(target=TARGET,
          how=Wrap(params=["self"], uses={
              "vllm.config.vllm.VllmConfig._maybe_enable_breakable_cudagraph": ["self"],
              "vllm.config.vllm.VllmConfig._uses_breakable_cudagraph_by_default": ["self"]}),
          make=make,
          reason=REASON + " (`_maybe_enable_breakable_cudagraph`, its allow-list asked through "
                          "`_uses_breakable_cudagraph_by_default` to say what bcg replaced)",
          hosts=">=0.29,<0.35", upstream=NOT_FILED, remove_when=REMOVE_WHEN),
)
