"""``bcg doctor`` for vLLM: the version and every patch target, checked without patching anything, and
the configuration as engine start reads it (``additional_config["bcg"]`` only)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from bcg_plugin.adapters.vllm.config import BREAKABLE_ENV, SOURCE, SUPPORTED_BACKENDS, VLLM_DEFAULTS, validate
from bcg_plugin.adapters.vllm.metrics import METRICS_ENV, METRICS_NOTE
from bcg_plugin.config import ENV_PREFIX, BcgConfig, env_name
from bcg_plugin.doctor import AdapterReport, ConfigCheck, unknown_env_key
from bcg_plugin.errors import BcgConfigError
from bcg_plugin.faults import FAULTS_ENV
from bcg_plugin.versions import UNTESTED_ENV


def diagnose() -> AdapterReport:
    from bcg_plugin.adapters.vllm import version
    from bcg_plugin.adapters.vllm.plugin import calls
    from bcg_plugin.patches.vllm import ENTRY, RUNNER

    report = AdapterReport("vllm", version.installed(), version.supported(),
                           enable_hint="--additional-config '{\"bcg\": {\"enable\": true}}'",
                           check_config=check_config,
                           replay_scope=f"where the engine's model, parallel layout and attention backend "
                                        f"({', '.join(SUPPORTED_BACKENDS)}) are supported; otherwise one warning "
                                        "at start and vLLM runs unchanged",
                           attention_scope=attention_scope)
    if not report.installed:
        return report
    problem = version.problem()
    if problem is not None:
        report.problems.append(problem)
    report.untested = version.untested()
    report.notes.append(f"vLLM's defaults under the keys you set: {json.dumps(VLLM_DEFAULTS)} (torch_compile keeps "
                        "the compilation vLLM is configured with; -O0 or \"torch_compile\": false captures the "
                        "plain model)")
    if METRICS_ENV not in os.environ:
        report.notes.append(METRICS_NOTE)
    report.verify_targets(ENTRY.active() + RUNNER.active(), calls())
    report.notes.append(prefill_runtime(os.environ, bcg_ready=not report.problems,
                                        listed=breakable_architectures()))
    return report


def attention_scope(config: BcgConfig) -> str:
    """Where each bucket's attention runs under ``config`` on the installed vLLM
    (:meth:`~bcg_plugin.adapters.vllm.host.V2Host.bcg_graph_attention`)."""
    if config.attention == "break":
        return "an eager break in every bucket"
    if not graph_attention_release():
        return "an eager break in every bucket (this vLLM release cannot keep it inside the graph; 0.28 and later can)"
    from bcg_plugin.adapters.vllm.host import AUTO_GRAPH_ATTENTION_TOKENS

    where = ("in every bucket (FA3's graph bound raised to the top bucket)" if config.attention == "graph" else
             f"in buckets up to {AUTO_GRAPH_ATTENTION_TOKENS} tokens, or up to vLLM's max_cudagraph_capture_size "
             "if larger")
    return (f"inside the graph {where}, where the V2 model runner serves a text-only model with FLASH_ATTN "
            "(FA3) or TRITON_ATTN, cudagraph_mode has FULL graphs (bcg's default) and data parallelism is off; an "
            "eager break in the others (the V1 runner through vLLM 0.33, other backends"
            f"{'' if config.attention == 'graph' else ', larger buckets'}); the capture logs its choice by bucket range")


def graph_attention_release() -> bool:
    """Whether the installed vLLM lets a FULL capture bound its query length by the bucket (0.28+)."""
    from bcg_plugin.adapters.vllm.host import accepts

    try:
        from vllm.v1.worker.gpu.cudagraph_utils import prepare_inputs_to_capture
    except Exception:  # the V2 runner does not import here: bcg cannot keep attention inside its graphs
        return False
    return accepts(prepare_inputs_to_capture, "max_query_len")


# What serves prefill when bcg does not (vLLM's own runtimes, by its launch flags).
VLLM_OWN = ("vLLM's piecewise graphs (torch.compile with cudagraph_mode PIECEWISE or FULL_AND_PIECEWISE, vLLM's "
            "default), its FULL graphs (cudagraph_mode FULL), or eager (-O0 or enforce_eager, cudagraph_mode NONE)")


def prefill_runtime(environ: Mapping[str, str], *, bcg_ready: bool, listed: Any = None) -> str:
    """Which runtime serves prefill: bcg, vLLM's breakable graphs, vLLM's piecewise/FULL graphs, or eager.

    ``bcg_ready``: this vLLM takes bcg's patches; ``listed``: the architectures vLLM turns its breakable
    graphs on for by itself when ``VLLM_USE_BREAKABLE_CUDAGRAPH`` is unset (``None`` where vLLM keeps
    that list inline)."""
    value = environ.get(BREAKABLE_ENV)
    if value == "1":
        return (f"prefill runtime: vLLM's breakable graphs ({BREAKABLE_ENV}=1 is set; bcg stays off while it "
                "is: unset it to run bcg)")
    own = VLLM_OWN
    if value is None:
        which = (f"the {len(listed)} architectures it lists ({', '.join(sorted(listed)[:3])}, ...)" if listed
                 else "the architectures it lists")
        own += f"; vLLM's own breakable graphs for {which}"
    if not bcg_ready:
        return f"prefill runtime: {own} (bcg cannot run on this vLLM)"
    return (f"prefill runtime: bcg where {SOURCE} enables it and vLLM's model, parallel layout and attention "
            f"backend are supported (vLLM's breakable graphs kept off there: {BREAKABLE_ENV}=0 at engine "
            f"start); otherwise {own}")


def breakable_architectures() -> list[str] | None:
    """vLLM's allow-list of architectures it graphs breakably by itself (0.29+), or ``None``."""
    try:
        from vllm.config.vllm import default_breakable_cudagraph_architectures
    except ImportError:
        return None
    try:
        return sorted(default_breakable_cudagraph_architectures())
    except Exception:  # it asks the platform: unknown where that fails
        return None


def check_config(raw: Any, environ: Mapping[str, str]) -> ConfigCheck:
    """``raw`` as ``additional_config["bcg"]``, validated as engine start does; vLLM reads no ``BCG_*``
    variable for its configuration, so each one set is named as ignored, as is ``graph_variants``,
    which nothing on vLLM acts on."""
    keys = {env_name(f.name): f.name for f in dataclasses.fields(BcgConfig)}
    ignored = [(f"{name} (vLLM reads only {SOURCE}: give {json.dumps(keys[name])} in --config JSON)" if name in keys
                else unknown_env_key(name, set(keys)))
               for name in sorted(environ) if name.startswith(ENV_PREFIX) and name not in (FAULTS_ENV, UNTESTED_ENV)]
    if isinstance(raw, dict) and "graph_variants" in raw:
        ignored.append("--config key 'graph_variants' (vLLM captures one graph per bucket; the key acts on "
                       "SGLang's flashinfer backend)")
    source = f"{SOURCE}, from --config" if raw is not None else f"{SOURCE}, none given (--config)"
    try:
        return ConfigCheck(source, config=validate({} if raw is None else raw), ignored=ignored)
    except BcgConfigError as e:
        return ConfigCheck(source, error=str(e), ignored=ignored)
