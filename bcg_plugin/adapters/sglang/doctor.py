"""``bcg doctor`` for SGLang: the version and every patch target, checked without patching anything, and
the configuration as engine start reads it (the ``BCG_*`` environment only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bcg_plugin.config import ENV_PREFIX
from bcg_plugin.doctor import AdapterReport, ConfigCheck, config_env_names, unknown_env_key
from bcg_plugin.errors import BcgConfigError


def diagnose() -> AdapterReport:
    from bcg_plugin.adapters.sglang import _patch_set, sglang_version, version_problem
    from bcg_plugin.adapters.sglang import config as settings
    from bcg_plugin.patches.sglang import verify

    report = AdapterReport("sglang", sglang_version(), str(settings.SUPPORTED_SGLANG),
                           enable_hint=f"--cuda-graph-backend-prefill {settings.FLAG_VALUE} (or BCG_ENABLE=1)",
                           check_config=check_config)
    if not report.installed:
        return report
    problem = version_problem(report.version)
    if problem is not None:
        report.problems.append(problem)
    for patch in _patch_set(runtime=True):
        message = verify(patch)
        report.targets.append((patch.target, message))
        if message is not None:
            report.problems.append(f"patch target changed: {message}")
    return report


def check_config(raw: Any, environ: Mapping[str, str]) -> ConfigCheck:
    """The environment validated as SGLang's start does (:func:`~bcg_plugin.adapters.sglang.config.read_config`,
    the adapter's own keys included); ``--config`` JSON, which SGLang cannot be given, and ``BCG_*``
    variables it does not read are named as ignored."""
    from bcg_plugin.adapters.sglang import config as settings

    known = config_env_names() | {settings.STATS_INTERVAL_ENV, settings.STALE_METADATA_ENV, settings.BENCH_RECORD_ENV}
    ignored = [unknown_env_key(name, known) for name in sorted(environ)
               if name.startswith(ENV_PREFIX) and name not in known]
    if isinstance(raw, dict):
        ignored += [f"--config key {key!r} (SGLang reads the environment: {ENV_PREFIX}{str(key).upper()})"
                    for key in raw]
    elif raw is not None:
        ignored.append("--config (SGLang reads BCG_* environment variables, not JSON)")
    source = "the BCG_* environment"
    try:
        return ConfigCheck(source, config=settings.read_config(environ), ignored=ignored)
    except BcgConfigError as e:
        return ConfigCheck(source, error=str(e), ignored=ignored)
