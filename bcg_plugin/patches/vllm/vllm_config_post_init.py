"""``VllmConfig.__post_init__``: validate ``additional_config["bcg"]`` and set bcg's launch flags.

Runs before the original, so decode keeps FULL graphs (and torch.compile is off where the bcg config
says ``"torch_compile": false``) before vLLM applies its optimisation-level defaults (see
:mod:`bcg_plugin.adapters.vllm.launch`). A pass-through when the config has no ``"bcg"`` key.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches.vllm._patch import Patch


def make(original):
    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        from bcg_plugin.adapters.vllm.launch import configure_engine

        configure_engine(self)
        return original(self, *args, **kwargs)

    return __post_init__


PATCH = Patch(
    module="vllm.config.vllm",
    qualname="VllmConfig.__post_init__",
    params=["self"],
    make=make,
    reason="validate additional_config['bcg'] at engine start; keep FULL decode graphs (and turn "
           "torch.compile off with torch_compile false) when bcg is enabled, before optimisation-level "
           "defaults apply",
    remove_when="vLLM lets a general plugin adjust the config before defaults (a config hook)",
)
