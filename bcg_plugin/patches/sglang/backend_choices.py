"""``Backend.ALL`` gains ``"bcg"`` so ``--cuda-graph-backend-prefill bcg`` passes argparse.

SGLang builds the flag's ``choices`` from ``Backend.ALL`` when the parser is built (the annotation
is evaluated lazily), which is after plugins load on both CLI paths. The value never reaches
SGLang's backend resolution: :mod:`bcg_plugin.patches.sglang.server_args_post_init` translates it first.
"""

from __future__ import annotations

from typing import Any

from bcg_plugin.adapters.sglang.config import FLAG_VALUE
from bcg_plugin.patches.sglang.base import Patch

TARGET = "sglang.srt.model_executor.cuda_graph_config.Backend.ALL"


def _check(value: Any) -> str | None:
    if not isinstance(value, tuple) or "breakable" not in value:
        return f"{TARGET}: expected a tuple of backend names containing 'breakable', got {value!r}"
    return None


def _apply():
    from sglang.srt.model_executor.cuda_graph_config import Backend

    if FLAG_VALUE not in Backend.ALL:
        Backend.ALL = (*Backend.ALL, FLAG_VALUE)
    return lambda: FLAG_VALUE in Backend.ALL


PATCH = Patch(
    target=TARGET,
    kind="VALUE",
    check=_check,
    apply=_apply,
    reason="accept 'bcg' as a value of --cuda-graph-backend-prefill (argparse choices)",
    versions=">=0.5.17,<0.5.18",
    remove_when="SGLang lets plugins register prefill graph backends or extra flags",
)
