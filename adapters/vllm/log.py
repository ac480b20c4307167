"""The adapter's logger: a child of vLLM's, so lines carry vLLM's format and honour its level."""

from __future__ import annotations

import logging

try:
    from vllm.logger import init_logger

    logger = init_logger("vllm.bcg")
except Exception:  # vllm missing or broken: register() must still import and stay quiet
    logger = logging.getLogger("vllm.bcg")
