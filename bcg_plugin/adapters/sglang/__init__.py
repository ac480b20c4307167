"""bcg-plugin's SGLang adapter: prefill/mixed forwards replay bcg's breakable graphs.

Loaded by SGLang's ``load_plugins()`` through the ``sglang.srt.plugins`` entry point
(``bcg = bcg_plugin.adapters.sglang:register``) in the launching process and in every scheduler.
Enable with ``--cuda-graph-backend-prefill bcg`` / ``sglang.Engine(cuda_graph_backend_prefill="bcg")``
or ``BCG_ENABLE=1``; tune with ``BCG_MAX_TOKENS``, ``BCG_SIZES``, ``BCG_MAX_PADDING_RATIO``,
``BCG_CAPTURE_FAILURE`` (the core's keys) and ``BCG_STATS_INTERVAL_S``.
"""

from bcg_plugin.adapters.sglang.doctor import diagnose
from bcg_plugin.adapters.sglang.plugin import is_active, register

__all__ = ["diagnose", "is_active", "register"]
