"""``ServerArgs.add_cli_args``: the ``--cuda-graph-backend-prefill`` option accepts ``bcg``.

From SGLang 0.5.20 the option's ``choices`` are fixed when ``sglang.srt.server_args`` is imported
(its field annotations are resolved at import, before plugins load), so rebinding ``Backend.ALL``
(:mod:`bcg_plugin.patches.sglang.backend_choices`, which this retires there) no longer reaches
argparse. The parser SGLang builds is the seam instead: after SGLang added its options, the value
is appended to the choices of every option that stores into ``cuda_graph_backend_prefill``. The
value never reaches SGLang's backend resolution:
:mod:`bcg_plugin.patches.sglang.server_args_resolve_once` translates it first.
"""

from __future__ import annotations

from typing import Any

from bcg_plugin.patches._patch import NOT_FILED, Patch
from bcg_plugin.patches.sglang._hook import Hook

DEST = "cuda_graph_backend_prefill"


def accept(parser: Any, flag_value: str) -> int:
    """Append ``flag_value`` to the choices of the options storing into :data:`DEST`; how many."""
    touched = 0
    for action in getattr(parser, "_actions", ()):
        if action.dest != DEST or action.choices is None:
            continue
        if flag_value not in action.choices:
            action.choices = (*action.choices, flag_value)
        touched += 1
    return touched


def make(*, flag_value: str):
    def around_add_cli_args(original_fn, parser, *args, **kwargs):
        result = original_fn(parser, *args, **kwargs)
        accept(parser, flag_value)
        return result

    return around_add_cli_args


PATCH = Patch(
    target="sglang.srt.server_args.ServerArgs.add_cli_args",
    how=Hook("AROUND", params=("parser",)),
    make=make,
    reason="accept `bcg` as a `--cuda-graph-backend-prefill` value: the option's choices are fixed when "
           "`server_args` is imported, so the parser SGLang builds is extended instead (retires the "
           "`Backend.ALL` rebind from 0.5.20)",
    hosts=">=0.5.20,<0.5.24",
    upstream=NOT_FILED,
    remove_when="SGLang lets plugins register prefill graph backends or extra flags",
)
