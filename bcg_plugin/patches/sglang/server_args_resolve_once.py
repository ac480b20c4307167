"""``ServerArgs.resolve_once``: turn ``cuda_graph_backend_prefill="bcg"`` into bcg's switch.

From SGLang 0.5.19 resolution is a step of its own, after construction, and from 0.5.20
``ServerArgs`` is a ``msgspec`` struct, which binds ``__post_init__`` when the class is built: a
hook on it (:mod:`bcg_plugin.patches.sglang.server_args_post_init`, which this retires from 0.5.19)
would see the record unresolved, and from 0.5.20 is never called. Resolution is where SGLang turns
the operator's record into a configuration, once per engine in the launching process (CLI and
``sglang.Engine``) before any scheduler is spawned, so the ``BCG_*`` environment the adapter's
translation sets is inherited by every scheduler. The translation runs before SGLang seals the
record for resolution.
"""

from __future__ import annotations

from bcg_plugin.patches._patch import NOT_FILED, Patch
from bcg_plugin.patches.sglang._hook import Hook


def make(*, translate_server_args, check_resolved_server_args, launch_failed):
    def around_resolve_once(original_fn, self, *args, **kwargs):
        if getattr(self, "_resolution_finished", False):
            return original_fn(self, *args, **kwargs)
        translate_server_args(self)
        try:
            result = original_fn(self, *args, **kwargs)
            try:
                check_resolved_server_args(self)
            except BaseException:
                # A failed resolution, as SGLang marks its own: the record cannot launch or resolve again.
                self._resolution_finished, self._resolution_failed = False, True
                raise
        except BaseException:
            launch_failed()
            raise
        return result

    return around_resolve_once


PATCH = Patch(
    target="sglang.srt.server_args.ServerArgs.resolve_once",
    how=Hook("AROUND", params=("self",)),
    make=make,
    reason="translate `bcg` to SGLang's auto prefill backend plus `BCG_ENABLE=1` (inherited by spawned "
           "schedulers), or to SGLang's default backend alone where the plugin is off; validate `BCG_*` "
           "before any process is spawned, and once resolved refuse `BCG_SIZES` above what the prefill "
           "graphs reach (a refused record is marked failed, as SGLang marks its own); a failed "
           "resolution gives `BCG_ENABLE` back; refuse `bcg` for decode (retires the `__post_init__` hook from "
           "0.5.19, whose `__post_init__` leaves the record unresolved; from 0.5.20 `ServerArgs` is a msgspec "
           "struct that never calls a patched `__post_init__`)",
    hosts=">=0.5.19,<0.5.24",
    upstream=NOT_FILED,
    remove_when="SGLang accepts plugin-defined prefill graph backends",
)
