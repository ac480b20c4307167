"""``ServerArgs.__post_init__``: turn ``cuda_graph_backend_prefill="bcg"`` into bcg's switch.

Runs in the launching process (CLI and ``sglang.Engine``) before schedulers are spawned, so the
``BCG_*`` environment it sets is inherited by every scheduler.
"""

from __future__ import annotations

from bcg_plugin.patches.sglang.base import Patch

TARGET = "sglang.srt.server_args.ServerArgs.__post_init__"


def around_post_init(original_fn, self, *args, **kwargs):
    from bcg_plugin.adapters import sglang as adapter
    from bcg_plugin.adapters.sglang import launch as enable

    if adapter.is_active():
        enable.translate_server_args(self)
    return original_fn(self, *args, **kwargs)


PATCH = Patch(
    target=TARGET,
    kind="AROUND",
    hook=around_post_init,
    params=("self",),
    reason="translate the 'bcg' prefill backend value to SGLang's auto choice plus BCG_ENABLE=1, "
    "and validate BCG_* before any process is spawned",
    versions=">=0.5.17,<0.5.18",
    remove_when="SGLang accepts plugin-defined prefill graph backends",
)
