"""The version gate: the SGLang versions bcg-plugin patches, derived from its patch descriptors."""

from __future__ import annotations

from bcg_plugin.patches.sglang import HOST, SUPPORTED
from bcg_plugin.versions import format_range, host_problem, installed_version


def installed() -> str | None:
    """The installed SGLang version, or ``None`` when SGLang is not installed."""
    return installed_version(HOST)


def supported() -> str:
    return format_range(SUPPORTED)


def problem() -> str | None:
    """Why the installed SGLang is not patched, or ``None`` if it is supported."""
    return host_problem(HOST, SUPPORTED, installed())
