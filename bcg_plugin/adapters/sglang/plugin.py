"""The SGLang adapter's process state: which patch sets are in, and what the patches call.

``register()`` (the ``sglang.srt.plugins`` entry point) runs in the launching process and in every
scheduler, before SGLang builds ``ServerArgs`` or a model runner. It checks the SGLang version and
installs the patch sets (:mod:`bcg_plugin.patches.sglang`): the launch set everywhere, the runtime
set where ``BCG_ENABLE`` is on. Where bcg cannot run (an unsupported SGLang, a target that changed)
it warns once and installs the launch set alone, so the ``bcg`` flag value still parses and means
SGLang's default prefill backend.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from bcg_plugin import BcgConfigError
from bcg_plugin.adapters.sglang import config, launch, version
from bcg_plugin.errors import one_line_if_uncaught
from bcg_plugin.patches.sglang import GATE
from bcg_plugin.versions import UNTESTED_ENV

logger = logging.getLogger("bcg_plugin.sglang")


class _State:
    """What this process installed.

    Attributes:
        registered: ``register()`` ran (it is re-entrant: later calls do nothing).
        mode: ``None`` (nothing installed), ``"off"`` (the launch set alone: bcg cannot run here)
            or ``"on"`` (the sets this process's config asks for, in force).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.registered = False
        self.mode: str | None = None


STATE = _State()


def is_active() -> bool:
    """Whether bcg's patches for this process's configuration are installed and in force."""
    return STATE.mode == "on"


def _patch_set(runtime: bool) -> list:
    from bcg_plugin.patches.sglang import LAUNCH, RUNTIME

    patches = LAUNCH.active()
    if runtime:
        patches += RUNTIME.active()
    return patches


def calls() -> dict[str, Any]:
    """What the patches call in the adapter, by the names their ``make`` takes."""
    from bcg_plugin.adapters.sglang import attention, replay

    return {
        "flag_value": config.FLAG_VALUE,
        "translate_server_args": translate_server_args,
        "check_resolved_server_args": check_resolved_server_args,
        "launch_failed": launch.give_back_enable,
        "prefill_runner_factory": replay.prefill_runner_factory,
        "dp_prefill_vote": replay.dp_prefill_vote,
        "capturing": attention.capturing,
        "attention_break": attention.captured_then_break,
        "layer_attention_break": attention.layer_attention_break,
        "refuse": attention.refuse,
    }


def translate_server_args(args: Any) -> None:
    """What the launch hooks (``ServerArgs.resolve_once``, ``__post_init__`` before 0.5.19) do with
    the flag: bcg's switch where bcg runs, SGLang's default prefill backend where the plugin is off.
    A bad value stops SGLang's command line with one line
    (:func:`~bcg_plugin.errors.one_line_if_uncaught`)."""
    try:
        if is_active():
            launch.translate_server_args(args)
        else:
            launch.sglang_default(args)
    except BcgConfigError:
        one_line_if_uncaught()
        raise


def check_resolved_server_args(args: Any) -> None:
    """What the launch hooks do once SGLang resolved the arguments: refuse ``BCG_SIZES`` that no
    prefill graph of this engine reaches, with one line on SGLang's command line."""
    try:
        if is_active():
            launch.check_resolved_server_args(args)
    except BcgConfigError:
        one_line_if_uncaught()
        raise


def register() -> None:
    """SGLang plugin entry point: zero-argument, re-entrant, inert unless bcg is enabled.

    Any problem (unsupported SGLang, a missing or changed target, a hook SGLang did not install)
    gives one warning and leaves bcg off; SGLang runs its own prefill backend.
    """
    from bcg_plugin.patches import PatchSet, PatchTargetError

    with STATE.lock:
        if STATE.registered:
            return
        STATE.registered = True
        problem = version.problem()
        if problem is not None:
            logger.warning("bcg-plugin: %s; the plugin is off and SGLang runs its own prefill backend, also "
                           "where --cuda-graph-backend-prefill %s asks for bcg", problem, config.FLAG_VALUE)
            _install_launch_set_only()
            return
        try:
            cfg = config.read_config()
        except BcgConfigError:
            # SGLang only logs exceptions raised here; the launch-side patch raises it again while
            # ServerArgs is built, which stops the launch with the key named.
            cfg = None
        runtime = cfg is not None and cfg.active
        try:
            PatchSet("sglang", _patch_set(runtime=runtime)).apply(calls())
        except PatchTargetError as e:
            logger.warning("bcg-plugin: cannot patch sglang %s (%s); the plugin is off and SGLang's own prefill "
                           "runner is used", version.installed(), e)
            _install_launch_set_only()
            return
        STATE.mode = "on"
        if version.untested():
            logger.warning("bcg-plugin: sglang %s is newer than every release bcg-plugin was validated on; running "
                           "UNTESTED with the patches of sglang %s (%s is set)", version.installed(),
                           GATE.releases[-1], UNTESTED_ENV)
        if runtime:
            logger.info("bcg-plugin: prefill CUDA graphs active (%s)", cfg.to_dict())


def _install_launch_set_only() -> None:
    from bcg_plugin.patches import PatchTargetError
    from bcg_plugin.patches.sglang import LAUNCH

    try:
        LAUNCH.apply(calls())
    except PatchTargetError as e:
        # The warning already said the plugin is off; SGLang then rejects the flag value itself.
        logger.debug("bcg-plugin: the launch patches do not fit this SGLang either (%s)", e)
        return
    STATE.mode = "off"
