"""``Backend.ALL`` gains ``"bcg"`` so ``--cuda-graph-backend-prefill bcg`` passes argparse.

SGLang builds the flag's ``choices`` from ``Backend.ALL`` when the parser is built (the annotation
is evaluated lazily), which is after plugins load on both CLI paths. The value never reaches
SGLang's backend resolution: :mod:`bcg_plugin.patches.sglang.server_args_post_init` translates it first.
"""

from __future__ import annotations

from typing import Any

from bcg_plugin.patches._patch import NOT_FILED, Patch, Rebind


def _check(value: Any) -> str | None:
    if not isinstance(value, tuple) or "breakable" not in value:
        return f"expected a tuple of backend names containing 'breakable', got {value!r}"
    return None


def make(backends: tuple[str, ...], *, flag_value: str) -> tuple[str, ...]:
    return backends if flag_value in backends else (*backends, flag_value)


PATCH = Patch(
    target="sglang.srt.model_executor.cuda_graph_config.Backend.ALL",
    how=Rebind(check=_check),
    make=make,
    reason="accept `bcg` as a `--cuda-graph-backend-prefill` value (argparse reads the tuple when the parser "
           "is built)",
    hosts=">=0.5.17,<0.5.20",
    upstream=NOT_FILED,
    remove_when="SGLang lets plugins register prefill graph backends or extra flags",
)
