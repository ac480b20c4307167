"""``bcg doctor`` for SGLang: the version and every patch target, checked without patching anything, and
the configuration as engine start reads it (the ``BCG_*`` environment only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bcg_plugin import BREAKING
from bcg_plugin.config import ENV_PREFIX, BcgConfig, env_name
from bcg_plugin.doctor import AdapterReport, ConfigCheck, unknown_env_key
from bcg_plugin.errors import BcgConfigError


def diagnose() -> AdapterReport:
    from bcg_plugin.adapters.sglang import config, version
    from bcg_plugin.adapters.sglang.plugin import _patch_set, calls

    report = AdapterReport("sglang", version.installed(), version.supported(),
                           enable_hint=f"--cuda-graph-backend-prefill {config.FLAG_VALUE} (or BCG_ENABLE=1)",
                           check_config=check_config, attention_scope=attention_scope)
    if not report.installed:
        return report
    problem = version.problem()
    if problem is not None:
        report.problems.append(problem)
    report.untested = version.untested()
    defaults = ", ".join(f"{name}={value}" for name, value in config.SGLANG_DEFAULT_ENV.items())
    report.notes.append(f"SGLang's defaults under the BCG_* variables you set: {defaults}")
    report.verify_targets(_patch_set(runtime=True), calls())
    note = memory_saver_note()
    if note is not None:
        report.notes.append(note)
    return report


def memory_saver_note() -> str | None:
    """What SGLang's memory saver, set to release graph memory, does to bcg (see
    :func:`~bcg_plugin.adapters.sglang.eligibility.runner_reason`)."""
    from bcg_plugin.adapters.sglang.eligibility import MEMORY_SAVER_GRAPHS_ENV, memory_saver_releases_graphs

    if not memory_saver_releases_graphs(enabled=True):  # the variable alone; the flag is the engine's
        return None
    return (f"{MEMORY_SAVER_GRAPHS_ENV} is set: with --enable-memory-saver SGLang releases CUDA-graph memory, and "
            "bcg does not run (its graphs are outside the saver's regions): a start with the bcg flag stops in one "
            "line, one with BCG_ENABLE=1 declines in a log line; SGLang's 'full' prefill graphs serve that setting")


def attention_scope(config: BcgConfig) -> str:
    """Where each bucket's attention runs under ``config``
    (:meth:`~bcg_plugin.adapters.sglang.graph_attention.GraphAttention.choose`)."""
    from bcg_plugin.adapters.sglang.graph_attention import (AUTO_GRAPH_ATTENTION_TOKENS, FA3, FLASHINFER, FRESH,
                                                            FRESH_MIN_FLASHINFER)

    if config.attention == "break":
        return "an eager break in every bucket"
    where = ("every bucket, where SGLang runs the flashinfer or fa3 attention backend" if config.attention == "graph"
             else f"buckets up to {AUTO_GRAPH_ATTENTION_TOKENS[FLASHINFER]} tokens on SGLang's flashinfer attention "
                  f"backend and up to {AUTO_GRAPH_ATTENTION_TOKENS[FA3]} on fa3 (an eager break in larger ones)")
    if config.graph_variants:
        over = (f"replaying in the {BREAKING!r} variant (attention breaking) of its bucket or a larger one, in a "
                "larger bucket that breaks, or eagerly")
        variants = (f"; with flashinfer {FRESH_MIN_FLASHINFER} or later each such bucket is also captured as a "
                    f"{FRESH!r} variant running the ragged prefill for steps without a cached prefix")
    else:
        over, variants = "replaying in the next bucket that breaks, or eagerly", ""
    return (f"inside the graph in {where}, without DP attention, sliding-window or cross attention, a step holding "
            f"more requests than the buckets were captured for {over}{variants}; an eager break on other backends; "
            "the capture logs its choice by bucket range")


def check_config(raw: Any, environ: Mapping[str, str]) -> ConfigCheck:
    """The environment validated as SGLang's start does (:func:`~bcg_plugin.adapters.sglang.config.read_config`,
    the adapter's own keys included); ``--config`` JSON, which SGLang cannot be given, and ``BCG_*``
    variables it does not read are named as ignored."""
    from bcg_plugin.adapters.sglang import config

    known = config.env_names()
    ignored = [unknown_env_key(name, known) for name in sorted(environ)
               if name.startswith(ENV_PREFIX) and name not in known]
    if isinstance(raw, dict):
        ignored += [f"--config key {key!r} (SGLang reads the environment: {env_name(str(key))})"
                    for key in raw]
    elif raw is not None:
        ignored.append("--config (SGLang reads BCG_* environment variables, not JSON)")
    source = "the BCG_* environment"
    try:
        return ConfigCheck(source, config=config.read_config(environ), ignored=ignored)
    except BcgConfigError as e:
        return ConfigCheck(source, error=str(e), ignored=ignored)
