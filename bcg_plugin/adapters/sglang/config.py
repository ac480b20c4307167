"""The SGLang adapter's switches: the flag value and its own env knobs.

bcg's runtime config (``BCG_ENABLE``, ``BCG_MAX_TOKENS``, ``BCG_SIZES``, ``BCG_MAX_PADDING_RATIO``,
``BCG_CAPTURE_FAILURE``) is the core's :class:`bcg_plugin.BcgConfig`, read from the environment
because SGLang rejects unknown flags and kwargs and spawned schedulers inherit the environment.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from bcg_plugin import BcgConfig, BcgConfigError
from bcg_plugin.config import check_env_spelling, config_env_names, env_name
from bcg_plugin.faults import FAULTS_ENV
from bcg_plugin.versions import UNTESTED_ENV

FLAG_VALUE = "bcg"  # --cuda-graph-backend-prefill bcg / Engine(cuda_graph_backend_prefill="bcg")

ENABLE_ENV = "BCG_ENABLE"
STATS_INTERVAL_ENV = "BCG_STATS_INTERVAL_S"  # seconds between stats log lines; 0 turns them off
DEFAULT_STATS_INTERVAL_S = 60.0

# Where SGLang's defaults differ from the core's, each overridden by its own ``BCG_*`` variable.
# ``first_bucket`` brings the capture's eager warm-ups from one per bucket to one per kind of graph
# (attention breaking, attention inside, each variant); the 200-prompt GPU tests and their negative
# controls pass under it on triton, on flashinfer at ``attention: "auto"``, and on fa3 at
# ``"auto"``, ``"graph"`` and ``"break"`` (docs/validation.md).
SGLANG_DEFAULTS = {"warmup": "first_bucket"}
SGLANG_DEFAULT_ENV = {env_name(key): value for key, value in SGLANG_DEFAULTS.items()}


def env_names() -> set[str]:
    """Every ``BCG_*`` variable a process of SGLang with bcg reads: the core's config, the stats
    interval, the fault plugins and the untested-host opt-in."""
    return config_env_names() | {STATS_INTERVAL_ENV, FAULTS_ENV, UNTESTED_ENV}


def read_config(environ: Mapping[str, str] | None = None) -> BcgConfig:
    """The validated core config from ``BCG_*`` (``SGLANG_DEFAULTS`` under the variables set); raises
    :class:`BcgConfigError` naming the key."""
    env = os.environ if environ is None else environ
    check_env_spelling(env, env_names())
    config = BcgConfig.from_env({**SGLANG_DEFAULT_ENV, **env}) or BcgConfig()
    if config.torch_compile:
        raise BcgConfigError(
            "environment (BCG_*): 'torch_compile' is supported with vLLM only; bcg on SGLang captures the "
            "model as SGLang runs it. Unset BCG_TORCH_COMPILE"
        )
    stats_interval(env)  # validate the adapter's own key alongside the core's
    return config


def stats_interval(environ: Mapping[str, str] | None = None) -> float:
    env = os.environ if environ is None else environ
    raw = env.get(STATS_INTERVAL_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_STATS_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        raise BcgConfigError(
            f"environment (BCG_*): {STATS_INTERVAL_ENV!r} must be a number of seconds >= 0, got {raw!r}"
        ) from None
    if not 0 <= value < math.inf:  # NaN and infinity too: 0 is how the lines are turned off
        raise BcgConfigError(f"environment (BCG_*): {STATS_INTERVAL_ENV!r} must be a number of seconds >= 0 "
                             f"(0 turns the stats lines off), got {raw!r}")
    return value
