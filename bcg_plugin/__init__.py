"""bcg-plugin: breakable CUDA graphs for prefill, one runtime for vLLM and SGLang.

The core (this package) imports no host engine. Host adapters implement the hooks in
:mod:`bcg_plugin.hookspecs`; :class:`PrefillGraphRunner` captures the transformer body once per
padded token bucket as CUDA-graph segments with attention as eager breaks, and replays any batch
mix at that token count.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from bcg_plugin.config import BcgConfig
from bcg_plugin.errors import BcgCaptureError, BcgCaptureOOM, BcgConfigError, BcgError, BcgStateError, BcgVersionError
from bcg_plugin.hookspecs import BREAKING, HostBatch, StaticInput, hookimpl, plugin_manager
from bcg_plugin.ladder import choose_bucket, reference_ladder, resolve_buckets
from bcg_plugin.live import LiveBatch
from bcg_plugin.stats import Fallback, RuntimeStats

if TYPE_CHECKING:
    from bcg_plugin.breaks import eager_break
    from bcg_plugin.capture import default_capture_stream
    from bcg_plugin.runner import PrefillGraphRunner

# The names whose modules import torch, loaded on first use: the `bcg` command (--help, --version,
# config-reference) then starts without torch, which is slow to import and warns where numpy is absent.
_TORCH_NAMES = {"eager_break": "bcg_plugin.breaks", "default_capture_stream": "bcg_plugin.capture",
                "PrefillGraphRunner": "bcg_plugin.runner"}

__version__ = "0.1.0"

__all__ = [
    "BREAKING", "BcgCaptureError", "BcgCaptureOOM", "BcgConfig", "BcgConfigError", "BcgError", "BcgStateError",
    "BcgVersionError",
    "Fallback", "HostBatch", "LiveBatch", "PrefillGraphRunner", "RuntimeStats", "StaticInput",
    "choose_bucket", "default_capture_stream", "eager_break", "hookimpl", "plugin_manager", "reference_ladder",
    "resolve_buckets",
]


def __getattr__(name: str):
    if name in _TORCH_NAMES:
        value = getattr(importlib.import_module(_TORCH_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'bcg_plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_TORCH_NAMES})
