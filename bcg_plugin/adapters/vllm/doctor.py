"""``bcg doctor`` for vLLM: the version and every patch target, checked without patching anything, and
the configuration as engine start reads it (``additional_config["bcg"]`` only)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from bcg_plugin.adapters.vllm.config import SOURCE, SUPPORTED_BACKENDS, VLLM_DEFAULTS, validate
from bcg_plugin.adapters.vllm.metrics import METRICS_ENV, METRICS_NOTE
from bcg_plugin.config import ENV_PREFIX, BcgConfig
from bcg_plugin.doctor import AdapterReport, ConfigCheck, unknown_env_key
from bcg_plugin.errors import BcgConfigError
from bcg_plugin.faults import FAULTS_ENV


def diagnose() -> AdapterReport:
    from bcg_plugin.adapters.vllm import version
    from bcg_plugin.adapters.vllm.plugin import calls
    from bcg_plugin.patches.vllm import ALL

    report = AdapterReport("vllm", version.installed(), version.supported(),
                           enable_hint="--additional-config '{\"bcg\": {\"enable\": true}}'",
                           check_config=check_config,
                           replay_scope=f"where the engine's model, parallel layout and attention backend "
                                        f"({', '.join(SUPPORTED_BACKENDS)}) are supported; otherwise one warning "
                                        "at start and vLLM runs unchanged")
    if not report.installed:
        return report
    problem = version.problem()
    if problem is not None:
        report.problems.append(problem)
    report.notes.append(f"vLLM's defaults under the keys you set: {json.dumps(VLLM_DEFAULTS)} (torch_compile keeps "
                        "the compilation vLLM is configured with; -O0 or \"torch_compile\": false captures the "
                        "plain model)")
    if METRICS_ENV not in os.environ:
        report.notes.append(METRICS_NOTE)
    report.verify_targets(ALL, calls())
    return report


def check_config(raw: Any, environ: Mapping[str, str]) -> ConfigCheck:
    """``raw`` as ``additional_config["bcg"]``, validated as engine start does; vLLM reads no ``BCG_*``
    variable for its configuration, so each one set is named as ignored."""
    keys = {ENV_PREFIX + f.name.upper(): f.name for f in dataclasses.fields(BcgConfig)}
    ignored = [(f"{name} (vLLM reads only {SOURCE}: give {json.dumps(keys[name])} in --config JSON)" if name in keys
                else unknown_env_key(name, set(keys)))
               for name in sorted(environ) if name.startswith(ENV_PREFIX) and name != FAULTS_ENV]
    source = f"{SOURCE}, from --config" if raw is not None else f"{SOURCE}, none given (--config)"
    try:
        return ConfigCheck(source, config=validate({} if raw is None else raw), ignored=ignored)
    except BcgConfigError as e:
        return ConfigCheck(source, error=str(e), ignored=ignored)
