"""What bcg-plugin patches in SGLang, one module per patched SGLang symbol (table: patches/README.md).

Two sets, each verified in full before any of it is applied (:class:`~bcg_plugin.patches.PatchSet`):

* ``LAUNCH``, installed by ``register()`` in every process that loads plugins, also where the
  runtime is off (an unsupported SGLang): it accepts and translates the ``bcg`` flag value;
* ``RUNTIME``, installed with it where ``BCG_ENABLE`` is on (schedulers of an enabled launch).
"""

from __future__ import annotations

from bcg_plugin.patches._patch import PatchSet, descriptors
from bcg_plugin.versions import HostGate
from bcg_plugin.patches.sglang._hook import Hook
from bcg_plugin.patches.sglang import (
    backend_choices,
    breakable_capture_var,
    capture_prefill_graph,
    cli_backend_choices,
    dp_prefill_vote,
    radix_attention_breakable,
    radix_attention_breakable_extra,
    radix_attention_breakable_lse,
    radix_attention_eager,
    server_args_post_init,
    server_args_resolve_once,
)

HOST = "sglang"  # the distribution whose version the patches are checked against
# Every SGLang release the descriptors below cover; CI checks four of them against the real package.
GATE = HostGate(HOST, ">=0.5.17,<0.5.24", (
    "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"))
SUPPORTED = GATE.supported
TITLE = "SGLang"
NOTES = """\
Hooks go through SGLang's `HookRegistry`; after applying a set, the plugin checks that each hook
really is in place (SGLang only logs hook failures). Hooks cannot be removed: their bodies pass
through to SGLang unless the adapter says bcg runs, so a set that did not fully install is
switched off without unpatching. RadixAttention's eager-attention method (0.5.23) is wrapped in
place rather than hooked: a hook would replace SGLang's two-entry callable with a plain function
and lose the explicit eager entry (`run_eager`) MLA calls. On an SGLang outside the supported range the runtime stays off
with one warning, and only the launch set is installed, verified against the live symbols, so that
`--cuda-graph-backend-prefill bcg` and `Engine(cuda_graph_backend_prefill="bcg")` run SGLang's
default prefill backend instead of failing."""

LAUNCH = PatchSet("launch", descriptors(
    backend_choices, cli_backend_choices, server_args_post_init, server_args_resolve_once), select=GATE.nearest,
                  when="always, also on an unsupported SGLang")
RUNTIME = PatchSet("runtime", descriptors(
    capture_prefill_graph,
    breakable_capture_var,
    radix_attention_breakable,
    radix_attention_breakable_lse,
    radix_attention_breakable_extra,
    radix_attention_eager,
    dp_prefill_vote,
), select=GATE.selected, when="`BCG_ENABLE` on, with the launch set")
SETS = (LAUNCH, RUNTIME)
ALL = [*LAUNCH.patches, *RUNTIME.patches]

__all__ = ["ALL", "GATE", "HOST", "Hook", "LAUNCH", "RUNTIME", "SETS", "SUPPORTED"]
