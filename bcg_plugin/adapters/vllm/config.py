"""Reading ``additional_config["bcg"]`` and deciding, from the engine config alone, whether bcg runs.

Every decision here is a pure function of the :class:`vllm.config.VllmConfig`, so the front-end
(which validates and logs once) and every worker (which only reads) reach the same answer without
talking to each other.
"""

from __future__ import annotations

import os
from typing import Any

from bcg_plugin import BcgConfig, BcgConfigError
from bcg_plugin.ladder import ladder_top

CONFIG_KEY = "bcg"
SOURCE = "additional_config['bcg']"
SUPPORTED_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")
# vLLM's switch for its own breakable graphs; vLLM sets it to 1 by itself for some architectures
# when it is unset (see :mod:`bcg_plugin.adapters.vllm.launch`).
BREAKABLE_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"
# additional_config key under which the front-end leaves what it changed when bcg runs (the config
# reaches every worker): its presence says the front-end set bcg's launch flags.
LAUNCH_RECORD_KEY = "bcg_launch"


def launch_record(vllm_config: Any) -> dict | None:
    """What the front-end recorded when it set bcg's launch flags, or ``None`` where it did not (bcg
    declined or not enabled; ``additional_config`` may be any hashable object, not only a dict)."""
    extra = getattr(vllm_config, "additional_config", None)
    record = extra.get(LAUNCH_RECORD_KEY) if isinstance(extra, dict) else None
    return record if isinstance(record, dict) else None


def raw_bcg_config(vllm_config: Any) -> Any:
    """The user's ``additional_config["bcg"]`` value, or ``None`` when the key is absent."""
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict):
        return None
    return additional.get(CONFIG_KEY)


# Where vLLM's defaults differ from the core's. ``first_bucket`` brings the whole capture under
# vLLM's own; the 200-prompt GPU tests and their negative control pass under it on both runners
# and both attention backends (docs/validation.md).
# ``torch_compile``: enabling bcg keeps the compilation vLLM is configured with (its default -O2
# compiles; -O0 does not), so bcg replays the compiler's fused kernels where prefill is GPU-bound;
# ``false`` turns it off for a shorter start. Its engine tests (one GPU, TP 2, DP 2), a 600 s soak
# and the benchmarks ran with it (docs/validation.md, docs/benchmarks.md).
VLLM_DEFAULTS = {"warmup": "first_bucket", "torch_compile": True}


def bcg_config(vllm_config: Any) -> BcgConfig:
    """The validated config (``VLLM_DEFAULTS`` under the user's keys); raises
    :class:`bcg_plugin.BcgConfigError` naming the bad key."""
    return validate(raw_bcg_config(vllm_config))


def validate(raw: Any) -> BcgConfig:
    """What engine start makes of ``raw`` as ``additional_config["bcg"]`` (also ``bcg doctor``'s check)."""
    if isinstance(raw, dict):
        raw = {**VLLM_DEFAULTS, **raw}
    return BcgConfig.from_mapping(raw, source=SOURCE)


def unsupported_reason(vllm_config: Any) -> str | None:
    """Why this engine cannot replay prefill graphs (a feature the graphs do not capture), or ``None``."""
    model = getattr(vllm_config, "model_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if model is None:
        return "no model config"
    if getattr(model, "enforce_eager", False):
        return "enforce_eager=True skips CUDA graph capture entirely"
    if os.environ.get(BREAKABLE_ENV, "0") == "1":
        return (f"{BREAKABLE_ENV}=1 selects vLLM's own breakable graphs for prefill (unset it: bcg then keeps "
                "vLLM's breakable graphs off and serves prefill)")
    checks = [
        (getattr(vllm_config, "lora_config", None) is not None, "LoRA (graphs are keyed by active adapters)"),
        (getattr(vllm_config, "speculative_config", None) is not None, "speculative decoding"),
        (getattr(vllm_config, "kv_transfer_config", None) is not None, "KV connectors"),
        (getattr(parallel, "pipeline_parallel_size", 1) > 1, "pipeline parallelism"),
        (getattr(parallel, "prefill_context_parallel_size", 1) > 1
         or getattr(parallel, "decode_context_parallel_size", 1) > 1, "context parallelism"),
        (bool(getattr(parallel, "enable_dbo", False)), "dual-batch overlap (micro-batching)"),
        (int(getattr(parallel, "ubatch_size", 0) or 0) > 1, "micro-batching (ubatch_size > 1)"),
        # A scale event frees and reallocates the MoE workspace and the groups every graph points at, and
        # vLLM recaptures its own graphs after it; bcg's would replay the freed ones.
        (bool(getattr(parallel, "enable_elastic_ep", False)), "elastic expert parallelism"),
        # vLLM turns it into a KV connector late in its config's start, after bcg's launch flags.
        (getattr(cache, "kv_offloading_size", None) is not None, "KV offloading (a KV connector)"),
        (_prefetch_offload(vllm_config), "prefetch weight offloading (its copy stream runs across forwards)"),
        # vLLM itself turns every CUDA graph off for this all-to-all (its kernels cannot be captured), on
        # the same condition: any data parallelism, expert parallelism or not.
        (getattr(parallel, "data_parallel_size", 1) > 1
         and getattr(parallel, "all2all_backend", None) == "deepep_high_throughput",
         "the DeepEP high-throughput all-to-all (not CUDA-graph capturable)"),
        # Eager-only in vLLM (0.33 on), which turns CUDA graphs off for it; where they were off already,
        # that step does not run and nothing else says so.
        (getattr(parallel, "all2all_backend", None) == "moonep" and bool(_attr(parallel, "use_all2all", False)),
         "the MoonEP all-to-all (eager-only in vLLM)"),
        (getattr(model, "runner_type", "generate") != "generate", "pooling / non-generate runners"),
        (_flag(model, "is_encoder_decoder"), "encoder-decoder models"),
        (_flag(model, "is_multimodal_model"), "multimodal models"),
        (_flag(model, "use_mla"), "MLA attention"),
        (_flag(model, "is_hybrid") or _flag(model, "is_attention_free"), "hybrid / attention-free models"),
        (_flag(model, "uses_mrope") or bool(_attr(model, "uses_xdrope_dim", 0)), "multi-dimensional RoPE positions"),
        (bool(getattr(cache, "calculate_kv_scales", False)), "calculate_kv_scales"),
        # The later layers then run on a subset of the step's tokens, dispatched again at that size.
        (bool(getattr(cache, "kv_sharing_fast_prefill", False)), "kv_sharing_fast_prefill"),
    ]
    for failed, what in checks:
        if failed:
            return f"{what} is not supported by bcg prefill graphs"
    return None


# With torch_compile: unset (vLLM's default, VLLM_COMPILE from -O1 up), NONE (-O0: nothing to
# compile) or VLLM_COMPILE (piecewise, split at attention); the other modes compile the whole body
# as one graph around the attention op.
COMPILE_MODES_CAPTURED = ("NONE", "VLLM_COMPILE")
ATTENTION_OP = "vllm::unified_attention_with_output"  # bcg's eager break: called between compiled pieces
OFF_HINT = '; or "torch_compile": false, and bcg captures the model without torch.compile'


def compile_problem(compilation_config: Any) -> str | None:
    """Why bcg cannot capture this compilation layout with ``torch_compile``, or ``None``."""
    cc = compilation_config
    mode = getattr(cc.mode, "name", cc.mode)
    if cc.mode is not None and mode not in COMPILE_MODES_CAPTURED:
        return f"compilation mode {mode} with torch_compile (use the default -O2 or -cc.mode=VLLM_COMPILE{OFF_HINT})"
    if getattr(cc, "use_inductor_graph_partition", False):
        return f"use_inductor_graph_partition with torch_compile (attention must stay a splitting op{OFF_HINT})"
    splitting = getattr(cc, "splitting_ops", None)
    if splitting is not None and mode == "VLLM_COMPILE" and ATTENTION_OP not in splitting:
        return f"splitting_ops without {ATTENTION_OP} with torch_compile (attention must stay a splitting op{OFF_HINT})"
    return None


def attention_backend_problem(vllm_config: Any) -> str | None:
    """An attention backend the user chose (``--attention-backend``, ``attention_config``) that bcg
    does not break at, or ``None``. vLLM 0.26 reads the backend from the config only (the
    ``VLLM_ATTENTION_BACKEND`` variable is gone); automatic selection is seen by the workers alone."""
    attention = getattr(vllm_config, "attention_config", None)
    chosen = [getattr(attention, "backend", None), *(getattr(attention, "backend_per_kind", None) or {}).values()]
    names = sorted({getattr(b, "name", str(b)) for b in chosen if b is not None} - set(SUPPORTED_BACKENDS))
    if names:
        return f"attention backend(s) {names} (supported: {', '.join(SUPPORTED_BACKENDS)})"
    return None


# The CUDA graph modes bcg runs under: none of vLLM's own piecewise graphs, which would serve (and be
# captured inside bcg's capture of) the same prefill batches. An unset mode is bcg's to choose.
GRAPH_MODES_WITH_BCG = ("NONE", "FULL_DECODE_ONLY")


def graph_mode_problem(compilation_config: Any) -> str | None:
    """A ``cudagraph_mode`` (the user's, or vLLM's final one in a worker) bcg cannot run under, or ``None``."""
    mode = getattr(compilation_config, "cudagraph_mode", None)
    if mode is None or getattr(mode, "name", mode) in GRAPH_MODES_WITH_BCG:
        return None
    return (f"cudagraph_mode={getattr(mode, 'name', mode)}, set explicitly: bcg runs only under "
            f"{' or '.join(GRAPH_MODES_WITH_BCG)}; leave cudagraph_mode unset (bcg then sets FULL_DECODE_ONLY) to run bcg")


def sequence_parallel_problem(vllm_config: Any, cfg: BcgConfig) -> str | None:
    """Sequence parallelism under ``torch_compile``: vLLM then compiles the body as one graph, with no
    split at attention for bcg to break at. ``None`` where that does not apply."""
    cc = getattr(vllm_config, "compilation_config", None)
    passes = getattr(cc, "pass_config", None)
    tp = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1)
    wants_sp = bool(getattr(passes, "enable_sp", False)) or bool(getattr(passes, "fuse_gemm_comms", False))
    mode = getattr(getattr(cc, "mode", None), "name", getattr(cc, "mode", None))
    compiles = mode == "VLLM_COMPILE" or (mode is None and int(getattr(vllm_config, "optimization_level", 2)) > 0)
    if cfg.torch_compile and compiles and wants_sp and tp > 1 and not getattr(cc, "use_inductor_graph_partition", False):
        return f"sequence parallelism with torch_compile (vLLM compiles the body whole, attention unsplit{OFF_HINT})"
    return None


def launch_problem(vllm_config: Any, cfg: BcgConfig) -> str | None:
    """Why bcg will not run on this engine, from the config alone, or ``None``.

    The front-end asks before it changes any launch flag, so an engine bcg declines keeps vLLM's own
    compilation and graph modes; every worker asks again of the final config and gets the same answer
    (bcg's own flags pass the graph-mode check). The graph mode comes last: a copy of a config bcg
    declined (``dataclasses.replace``) carries vLLM's final mode, and the first reason is the one logged.
    """
    reason = (unsupported_reason(vllm_config) or attention_backend_problem(vllm_config)
              or graphs_turned_off(vllm_config))
    if reason is None and cfg.torch_compile:
        cc = getattr(vllm_config, "compilation_config", None)
        reason = (compile_problem(cc) if cc is not None else None) or sequence_parallel_problem(vllm_config, cfg)
    return reason or graph_mode_problem(getattr(vllm_config, "compilation_config", None))


# What vLLM calls the three numbers that bound one step's tokens (:func:`step_limits`).
STEP_LIMIT_NAMES = ("max_num_batched_tokens", "max_num_seqs", "max_model_len")


def step_limits(vllm_config: Any) -> tuple[Any, Any, Any]:
    """vLLM's chunk, request limit and context length (:data:`STEP_LIMIT_NAMES`), whose
    :func:`~bcg_plugin.ladder.ladder_top` is the most tokens one step schedules: bcg's top bucket."""
    scheduler = vllm_config.scheduler_config
    return (scheduler.max_num_batched_tokens, scheduler.max_num_seqs,
            getattr(vllm_config.model_config, "max_model_len", None))


def check_sizes(vllm_config: Any, cfg: BcgConfig) -> None:
    """Refuse explicit ``sizes`` above the most tokens a step of this engine schedules (the top bucket),
    in the front-end: the worker's runner would refuse them too, but only once the engine has started."""
    if not cfg.sizes:
        return
    numbers = step_limits(vllm_config)
    if not all(isinstance(n, int) and n > 0 for n in numbers):  # not resolved yet: the worker checks
        return
    top = ladder_top(*numbers)
    too_big = [s for s in cfg.sizes if s > top]
    if too_big:
        chunk, requests, context = numbers
        held = "" if top == chunk else (f", what {requests} requests (max_num_seqs) of {context} tokens "
                                        "(max_model_len) hold")
        raise BcgConfigError(
            f"{SOURCE}: 'sizes' has {too_big} above {top}, the most tokens one step of this engine schedules "
            f"(max_num_batched_tokens={chunk}{held}); drop those sizes, or raise max_num_batched_tokens"
        )


def sequence_parallel_multiple(vllm_config: Any) -> int:
    """What every step's token count is a multiple of: the TP size under sequence parallelism (V1 pads
    each step to it and asserts the dispatched size is one), else 1."""
    cc = getattr(vllm_config, "compilation_config", None)
    tp = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1)
    return tp if tp > 1 and bool(getattr(getattr(cc, "pass_config", None), "enable_sp", False)) else 1


def prefill_graphs_wanted(vllm_config: Any) -> bool:
    """Enabled, not declined (:func:`launch_problem`), and the front-end put the launch flags in place
    (torch.compile off, or vLLM's piecewise compilation with ``torch_compile``).

    The last two keep a worker from capturing around a compiled model or under vLLM's piecewise graphs
    when the config was built in a process where the plugin was not loaded (e.g. filtered out by
    ``VLLM_PLUGINS``).
    """
    cfg = bcg_config(vllm_config)
    if not cfg.active or launch_problem(vllm_config, cfg) is not None:
        return False
    from vllm.config.compilation import CompilationMode

    cc = vllm_config.compilation_config
    if cc.mode == CompilationMode.NONE:
        return True
    return cfg.torch_compile and cc.mode == CompilationMode.VLLM_COMPILE and compile_problem(cc) is None


def _prefetch_offload(vllm_config: Any) -> bool:
    """Whether vLLM offloads weights with its prefetching offloader (``offload_group_size``), which
    forks a copy stream in one forward that only the next joins."""
    offload = getattr(vllm_config, "offload_config", None)
    if offload is None or getattr(offload, "offload_backend", "auto") == "uva":
        return False
    return int(getattr(getattr(offload, "prefetch", None), "offload_group_size", 0) or 0) > 0


def graphs_turned_off(vllm_config: Any) -> str | None:
    """Where bcg was launched under CUDA graphs (``FULL_DECODE_ONLY``, its own or the user's) and
    vLLM's final mode is ``NONE``: vLLM turned every CUDA graph off itself, later in its config's
    start, for something in this engine that must run eagerly; bcg's graphs would capture it. The
    cases known (the MoonEP and DeepEP high-throughput all-to-alls) are declined up front by
    :func:`unsupported_reason`; this catches the ones a later vLLM adds. Not where the user asked for
    no decode graph (0.34: ``decode_cudagraph_capture_request_sizes=[]`` or
    ``max_decode_cudagraph_capture_requests=0``), which leaves vLLM no capture size under
    ``FULL_DECODE_ONLY``: that concerns vLLM's graphs only, and bcg captures without them as under a
    ``NONE`` the user chose."""
    started = (launch_record(vllm_config) or {}).get("graphs")
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    no_decode_graphs = (getattr(cc, "decode_cudagraph_capture_request_sizes", None) == []
                        or getattr(cc, "max_decode_cudagraph_capture_requests", None) == 0)
    if started not in (None, "NONE") and getattr(mode, "name", mode) == "NONE" and not no_decode_graphs:
        return (f"vLLM turned CUDA graphs off for this engine after bcg's launch under cudagraph_mode={started} "
                "(something in it runs eagerly only)")
    return None


def _attr(obj: Any, name: str, default: Any) -> Any:
    try:
        return getattr(obj, name, default)
    except Exception:  # some ModelConfig properties need the HF config; absent means "not that"
        return default


def _flag(obj: Any, name: str) -> bool:
    return bool(_attr(obj, name, False))
