"""Turning bcg on from SGLang's own prefill-backend flag, in the launching process."""

from __future__ import annotations

import logging
import os

from bcg_plugin import BcgConfigError
from bcg_plugin.adapters.sglang import config
from bcg_plugin.adapters.sglang.eligibility import MEMORY_SAVER_GRAPHS_ENV, memory_saver_releases_graphs

logger = logging.getLogger("bcg_plugin.sglang")

# Whether this process set BCG_ENABLE itself (from the flag), and the value it replaced (``None``:
# unset): a later ServerArgs without the flag (a second Engine in the same script) gets that back,
# so it does not inherit the flag's switch, while a user's own export stays.
_set_by_flag = False
_replaced: str | None = None


def _refuse_decode(args) -> None:
    if getattr(args, "cuda_graph_backend_decode", None) == config.FLAG_VALUE:
        raise BcgConfigError(
            f"cuda_graph_backend_decode={config.FLAG_VALUE!r}: bcg captures prefill only; use "
            f"--cuda-graph-backend-prefill {config.FLAG_VALUE}"
        )


def translate_server_args(args) -> None:
    """Map ``cuda_graph_backend_prefill="bcg"`` to SGLang's auto choice and export ``BCG_ENABLE``.

    ``None`` (auto) rather than ``"breakable"`` keeps SGLang's compatibility cascade and memory
    headroom gate, which an explicit backend skips; bcg then serves prefill wherever SGLang would
    have used its breakable runner. ``BCG_*`` is validated here so a bad value stops the launch
    with the key named, before any scheduler starts.
    """
    global _set_by_flag, _replaced
    _refuse_decode(args)
    if getattr(args, "cuda_graph_backend_prefill", None) == config.FLAG_VALUE:
        config.read_config()  # the user's own BCG_ENABLE too, before the flag sets it
        # Every check runs before anything changes: a refused launch leaves no BCG_ENABLE behind
        # for the processes this one starts next.
        cfg = config.read_config({**os.environ, config.ENABLE_ENV: "1"})
        if memory_saver_releases_graphs(getattr(args, "enable_memory_saver", False)):
            raise BcgConfigError(
                f"--cuda-graph-backend-prefill {config.FLAG_VALUE} with --enable-memory-saver and "
                f"{MEMORY_SAVER_GRAPHS_ENV} set: the memory saver releases CUDA-graph memory only in its own "
                "regions, and bcg's graphs are outside them (SGLang's breakable runner refuses this too); use "
                f"--cuda-graph-backend-prefill full, or unset {MEMORY_SAVER_GRAPHS_ENV}"
            )
        if not cfg.active:
            raise BcgConfigError(
                f"--cuda-graph-backend-prefill {config.FLAG_VALUE} asks for bcg but BCG_MAX_TOKENS=0 "
                "disables it; drop one of the two"
            )
        args.cuda_graph_backend_prefill = None
        current = os.environ.get(config.ENABLE_ENV)
        if not (_set_by_flag and current == "1"):  # not the flag's own value: the user's
            _replaced = current
        os.environ[config.ENABLE_ENV] = "1"
        _set_by_flag = True
        logger.info("bcg: prefill CUDA graphs enabled (%s)", cfg.to_dict())
        return
    give_back_enable()
    config.read_config()


def give_back_enable() -> None:
    """``BCG_ENABLE`` as it was before the flag set it (unset, or the user's own value): for a launch
    without the flag, and for one whose resolution failed after the flag set it."""
    global _set_by_flag, _replaced
    if _set_by_flag:
        if _replaced is None:
            os.environ.pop(config.ENABLE_ENV, None)
        else:
            os.environ[config.ENABLE_ENV] = _replaced
        _set_by_flag, _replaced = False, None


def check_resolved_server_args(args) -> None:
    """After SGLang resolved the launch's arguments: refuse explicit ``BCG_SIZES`` above what
    SGLang's prefill graphs of this engine reach, before any scheduler starts (each scheduler's
    runner would refuse them too, but inside SGLang's start-up traceback).

    The bound is SGLang's prefill graph ceiling (the resolved prefill ``max_bs``, which
    ``--cuda-graph-max-bs-prefill`` sets and which defaults to the chunked-prefill size less what
    the layout caps; else the chunk itself) rounded up to twice the TP size, the most SGLang pads a
    step's rows to (two-batch overlap, times the attention-TP and attention-CP widths, which divide
    the TP size). The scheduler's top bucket is at most that
    (:func:`~bcg_plugin.adapters.sglang.replay.step_token_limit` rounds the ceiling up to the
    layout's exact multiple, and the request pool may lower it), so this check is never stricter.
    It skips where no ceiling is resolved: chunked prefill off without a prefill ``max_bs`` (SGLang
    then captures no prefill graph). Sizes that can never replay are refused even where SGLang then
    declines prefill graphs for other reasons. The launch hooks call it once SGLang has resolved the
    record (after ``resolve_once``, or before 0.5.19 after ``__post_init__``, which resolved it).
    """
    from sglang.srt.utils.common import ceil_align

    cfg = config.read_config()
    if not cfg.active or not cfg.sizes:
        return
    resolved = args.resolved_dict() if hasattr(args, "resolved_dict") else None  # 0.5.19 on

    def value(name: str):
        return resolved[name] if resolved is not None else getattr(args, name, None)

    def number(raw) -> int:
        return raw if isinstance(raw, int) and raw > 0 else 0

    graphs = value("cuda_graph_config")
    prefill = graphs.get("prefill") if isinstance(graphs, dict) else getattr(graphs, "prefill", None)
    ceiling = number(prefill.get("max_bs") if isinstance(prefill, dict) else getattr(prefill, "max_bs", None))
    chunk = number(value("chunked_prefill_size"))
    if not ceiling and not chunk:
        return
    bound = ceil_align(ceiling or chunk, 2 * int(value("tp_size") or 1))
    too_big = [s for s in cfg.sizes if s > bound]
    if too_big:
        if chunk:
            settings = f"--chunked-prefill-size {chunk}"
            raise_ = "--chunked-prefill-size (and --cuda-graph-max-bs-prefill where it is set)"
        else:
            settings, raise_ = "chunked prefill off", "--cuda-graph-max-bs-prefill"
        if ceiling:
            settings = f"prefill graphs up to {ceiling} tokens; {settings}"
        raise BcgConfigError(
            f"BCG_SIZES has {too_big} above {bound}, the most tokens SGLang's prefill graphs of this engine "
            f"reach ({settings}); drop those sizes, or raise {raise_}"
        )


def sglang_default(args) -> None:
    """With the plugin off (``register()`` warned why), ``bcg`` means SGLang's default prefill
    backend: the engine runs as it would without the flag."""
    _refuse_decode(args)
    if getattr(args, "cuda_graph_backend_prefill", None) == config.FLAG_VALUE:
        args.cuda_graph_backend_prefill = None
