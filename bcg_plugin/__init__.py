"""bcg-plugin: breakable CUDA graphs for prefill, one runtime for vLLM and SGLang.

The core (this package) imports no host engine. Host adapters implement the hooks in
:mod:`bcg_plugin.hookspecs`; :class:`PrefillGraphRunner` captures the transformer body once per
padded token bucket as CUDA-graph segments with attention as eager breaks, and replays any batch
mix at that token count.
"""

from bcg_plugin.breaks import eager_break
from bcg_plugin.capture import default_capture_stream
from bcg_plugin.config import BcgConfig
from bcg_plugin.errors import BcgCaptureError, BcgCaptureOOM, BcgConfigError, BcgError, BcgStateError
from bcg_plugin.hookspecs import HostBatch, StaticInput, hookimpl, plugin_manager
from bcg_plugin.ladder import choose_bucket, reference_ladder, resolve_buckets
from bcg_plugin.live import LiveBatch
from bcg_plugin.runner import PrefillGraphRunner
from bcg_plugin.stats import Fallback, RuntimeStats

__version__ = "0.1.0"

__all__ = [
    "BcgCaptureError", "BcgCaptureOOM", "BcgConfig", "BcgConfigError", "BcgError", "BcgStateError",
    "Fallback", "HostBatch", "LiveBatch", "PrefillGraphRunner", "RuntimeStats", "StaticInput",
    "choose_bucket", "default_capture_stream", "eager_break", "hookimpl", "plugin_manager", "reference_ladder",
    "resolve_buckets",
]
