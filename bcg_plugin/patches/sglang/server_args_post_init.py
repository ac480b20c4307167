"""``ServerArgs.__post_init__``: turn ``cuda_graph_backend_prefill="bcg"`` into bcg's switch.

Runs in the launching process (CLI and ``sglang.Engine``) before schedulers are spawned, so the
``BCG_*`` environment the adapter's translation sets is inherited by every scheduler.
"""

from __future__ import annotations

from bcg_plugin.patches._patch import NOT_FILED, Patch
from bcg_plugin.patches.sglang._hook import Hook


def make(*, translate_server_args, check_resolved_server_args, launch_failed):
    def around_post_init(original_fn, self, *args, **kwargs):
        translate_server_args(self)
        try:
            result = original_fn(self, *args, **kwargs)
            check_resolved_server_args(self)
        except BaseException:
            launch_failed()
            raise
        return result

    return around_post_init


PATCH = Patch(
    target="sglang.srt.server_args.ServerArgs.__post_init__",
    how=Hook("AROUND", params=("self",)),
    make=make,
    reason="translate `bcg` to SGLang's auto prefill backend plus `BCG_ENABLE=1` (inherited by spawned "
           "schedulers), or to SGLang's default backend alone where the plugin is off (an unsupported "
           "SGLang); validate `BCG_*` before any process is spawned, and once resolved refuse "
           "`BCG_SIZES` above what the prefill graphs reach; a failed resolution gives `BCG_ENABLE` "
           "back; refuse `bcg` for decode",
    hosts=">=0.5.17,<0.5.19",
    upstream=NOT_FILED,
    remove_when="SGLang accepts plugin-defined prefill graph backends",
)
