"""The one seam through which tests make replays wrong on purpose (negative controls).

A correctness check counts only if it can fail, so the engine tests also run an engine whose
replays read attention metadata that belongs to another batch, and require the check to catch it.
No production module holds a switch for that. An adapter asks this seam which metadata a replay
reads, offering what it keeps of an earlier batch, and gets the live one back unless a test plugin
answers otherwise: a module named by ``BCG_TEST_FAULTS`` (importable in every engine process, e.g.
from ``PYTHONPATH``) whose functions implement the hooks of :class:`BcgFaultSpec`. Tests in one
process may register a plugin object on :func:`plugins` directly instead.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import pluggy

from bcg_plugin.errors import BcgConfigError

FAULTS_ENV = "BCG_TEST_FAULTS"  # a module name, e.g. stale_metadata (tests/gpu)
PROJECT_NAME = "bcg_faults"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class BcgFaultSpec:
    """Hooks a test plugin implements to inject a fault."""

    @hookspec(firstresult=True)
    def bcg_replay_metadata(self, host: str, bucket: int, live: Any, earlier: Any) -> Any:
        """Return the attention metadata this replay reads instead of ``live``, or ``None`` for ``live``.

        ``earlier``: what the adapter kept of another batch that is in bounds for this replay
        (vLLM: the forward context the bucket was captured with; SGLang: the previous replay's
        forward batch when it was an extend of the same token count), or ``None``.
        """


    @hookspec
    def bcg_graph_metadata(self, host: str, bucket: int, live: dict, earlier: dict) -> None:
        """Called before a replay whose graph reads batch metadata, once the host has landed it:
        ``live`` names the device buffers the graph reads (vLLM, attention inside the graph:
        ``seq_lens``; SGLang, the KV-cache store inside the graph: ``out_cache_loc``), ``earlier``
        holds what the bucket's capture put there. A plugin may write into ``live`` (e.g.
        ``earlier``'s values) so the graph reads metadata of another batch.
        """


_manager: pluggy.PluginManager | None = None


def plugins() -> pluggy.PluginManager:
    """This process's fault plugins: the ``BCG_TEST_FAULTS`` module, loaded on first use."""
    global _manager
    if _manager is None:
        pm = pluggy.PluginManager(PROJECT_NAME)
        pm.add_hookspecs(BcgFaultSpec)
        name = os.environ.get(FAULTS_ENV, "").strip()
        if name:
            try:
                pm.register(importlib.import_module(name), name=name)
            except ImportError as e:
                raise BcgConfigError(f"{FAULTS_ENV}={name!r}: cannot import the test plugin ({e}); put its "
                                     "folder on PYTHONPATH or unset the variable") from None
        _manager = pm
    return _manager


def active() -> bool:
    """Whether a fault plugin is loaded: adapters then keep what they may be asked to offer."""
    return bool(plugins().get_plugins())


def replay_metadata(host: str, bucket: int, live: Any, earlier: Any = None) -> Any:
    """The metadata a replay reads: ``live`` unless a fault plugin picks another."""
    if not active():
        return live
    chosen = plugins().hook.bcg_replay_metadata(host=host, bucket=bucket, live=live, earlier=earlier)
    return live if chosen is None else chosen


def graph_metadata(host: str, bucket: int, live: dict, earlier: dict) -> None:
    """Give fault plugins the landed metadata buffers a replay's graph reads (no-op without one)."""
    if active():
        plugins().hook.bcg_graph_metadata(host=host, bucket=bucket, live=live, earlier=earlier)
