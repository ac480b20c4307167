"""The adapter's logger: a child of vLLM's, so lines carry vLLM's format and honour its level.

The core logs under ``bcg_plugin``, which vLLM's logging config does not cover: without a route its
INFO lines (the capture summary) are dropped and its warnings printed unformatted.
"""

from __future__ import annotations

import logging

try:
    from vllm.logger import init_logger

    logger = init_logger("vllm.bcg")
except Exception:  # vllm missing or broken: register() must still import and stay quiet
    logger = logging.getLogger("vllm.bcg")


class _ToVllm(logging.Handler):
    """Hands the core's records to the adapter's logger, so they reach vLLM's handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)


def route_core_logs() -> None:
    """Send the core's ``bcg_plugin`` records through vLLM's logging (once per process).

    vLLM's level is read at each record, not when the route is made: from 0.33 vLLM configures its
    logging when an engine starts rather than at import, possibly after this runs."""
    core = logging.getLogger("bcg_plugin")
    if not any(isinstance(h, _ToVllm) for h in core.handlers):
        core.addHandler(_ToVllm())
        core.setLevel(logging.DEBUG)
        core.propagate = False  # vLLM's handlers print it; the root's would print it twice
