"""The version gate: the vLLM releases bcg-plugin patches (``GATE`` next to the patch descriptors)."""

from __future__ import annotations

from bcg_plugin.patches.vllm import GATE
from bcg_plugin.versions import format_range


def installed() -> str | None:
    """The installed vLLM version, or ``None`` when vLLM is not installed."""
    return GATE.installed()


def supported() -> str:
    return format_range(GATE.supported)


def untested() -> bool:
    """Whether the installed vLLM is newer than every validated release and the user opted in."""
    return GATE.untested(installed())


def problem() -> str | None:
    """Why the installed vLLM is not patched, or ``None`` if it is."""
    return GATE.problem(installed())
