"""bcg-plugin's SGLang adapter: prefill/mixed forwards replay bcg's breakable graphs.

Loaded by SGLang's ``load_plugins()`` through the ``sglang.srt.plugins`` entry point
(``bcg = bcg_plugin.adapters.sglang:register``) in the launching process and in every scheduler.
Enable with ``--cuda-graph-backend-prefill bcg`` / ``sglang.Engine(cuda_graph_backend_prefill="bcg")``
or ``BCG_ENABLE=1``; tune with ``BCG_MAX_TOKENS``, ``BCG_SIZES``, ``BCG_MAX_PADDING_RATIO``,
``BCG_CAPTURE_FAILURE`` (the core's keys) and ``BCG_STATS_INTERVAL_S``.
"""

from __future__ import annotations

import logging

from bcg_plugin.adapters.sglang import config as settings

logger = logging.getLogger("bcg_plugin.sglang")

_registered = False
_active = False


def is_active() -> bool:
    """Whether bcg's runtime patches are installed and in force in this process."""
    return _active


def sglang_version() -> str | None:
    from bcg_plugin.doctor import installed_version

    return installed_version("sglang")


def version_problem(found: str | None) -> str | None:
    """Why this SGLang version is not patched, or ``None`` if it is supported."""
    from packaging.version import InvalidVersion, Version

    if found is None:
        return "sglang is not installed"
    try:
        parsed = Version(found)
    except InvalidVersion:
        return f"sglang version {found!r} is not a valid version"
    if parsed not in settings.SUPPORTED_SGLANG:
        return f"sglang {found} is outside the supported range {settings.SUPPORTED_SGLANG}"
    return None


def _patch_set(runtime: bool) -> list:
    from bcg_plugin.patches.sglang import (
        backend_choices,
        capture_prefill_graph,
        radix_attention_breakable,
        radix_attention_breakable_extra,
        radix_attention_breakable_lse,
        server_args_post_init,
    )

    patches = [backend_choices.PATCH, server_args_post_init.PATCH]
    if runtime:
        patches += [
            capture_prefill_graph.PATCH,
            radix_attention_breakable.PATCH,
            radix_attention_breakable_lse.PATCH,
            radix_attention_breakable_extra.PATCH,
        ]
    return patches


def register() -> None:
    """SGLang plugin entry point: zero-argument, re-entrant, inert unless bcg is enabled.

    Always installs the two launch-side patches (the ``bcg`` flag value and its translation),
    which change nothing for other values. The runtime patches (runner and attention break) are
    installed only where ``BCG_ENABLE`` is on, i.e. in schedulers spawned by an enabled launch.
    Any problem (unsupported SGLang, a missing or changed target, a hook SGLang did not install)
    gives one warning and leaves bcg off; the engine runs as if the plugin were absent.
    """
    global _registered, _active
    if _registered:
        return
    _registered = True
    problem = version_problem(sglang_version())
    if problem is not None:
        logger.warning("bcg-plugin: %s; the plugin is off and SGLang runs unpatched", problem)
        return
    from bcg_plugin.patches.sglang import install
    from bcg_plugin import BcgConfigError

    try:
        config = settings.read_config()
    except BcgConfigError:
        # SGLang only logs exceptions raised here; the launch-side patch raises it again while
        # ServerArgs is built, which stops the launch with the key named.
        config = None
    report = install(_patch_set(runtime=config is not None and config.active))
    if not report.ok:
        logger.warning(
            "bcg-plugin: cannot patch sglang %s (%s); the plugin is off and SGLang's own prefill "
            "runner is used", sglang_version(), "; ".join(report.problems),
        )
        return
    _active = True
    if config is not None and config.active:
        logger.info("bcg-plugin: prefill CUDA graphs active (%s)", config.to_dict())


def diagnose():
    """``bcg doctor``'s view of this SGLang (see :mod:`bcg_plugin.adapters.sglang.doctor`)."""
    from bcg_plugin.adapters.sglang.doctor import diagnose as _diagnose

    return _diagnose()
