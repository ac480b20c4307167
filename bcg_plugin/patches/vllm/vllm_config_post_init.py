"""``VllmConfig.__post_init__``: validate ``additional_config["bcg"]`` and set bcg's launch flags.

Runs before the original, so decode keeps FULL graphs (and torch.compile is off where the bcg config
says ``"torch_compile": false``) before vLLM applies its optimisation-level defaults (see
:mod:`bcg_plugin.adapters.vllm.launch`). A pass-through when the config has no ``"bcg"`` key.
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


PATCH = Patch(
    target="vllm.config.vllm.VllmConfig.__post_init__",
    how=Wrap(params=["self"]),
    make=make,
    reason="validate `additional_config['bcg']` at engine start (errors name the key); when enabled set "
           "`cudagraph_mode=FULL_DECODE_ONLY` (kept `NONE` if the user chose it), and "
           '`compilation_config.mode=NONE` only with `"torch_compile": false` (by default the mode stays '
           "as vLLM sets it), before optimisation-level defaults apply; log unsupported setups once",
    hosts="==0.26.0",
    upstream=NOT_FILED,
    remove_when="vLLM lets a general plugin adjust the config before defaults (a config hook)",
)
