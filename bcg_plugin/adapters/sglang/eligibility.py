"""Which SGLang model runners bcg serves; the rest keep SGLang's own prefill runner.

Only what bcg's capture reproduces faithfully is accepted: a dense decoder whose attention goes
through ``RadixAttention``'s unified breakable op, on a backend whose extend path reads the live
batch. Everything else is named in one log line and left to SGLang.
"""

from __future__ import annotations

import inspect
from typing import Any

# Backends whose forward_extend reads per-batch state only from the ForwardBatch and from
# init_forward_metadata (which bcg calls on the live batch before every replay).
SUPPORTED_ATTENTION_BACKENDS = ("TritonAttnBackend", "FlashInferAttnBackend", "FlashAttentionBackend")

# SGLang's switch that puts its graphs' memory in the memory saver's regions.
MEMORY_SAVER_GRAPHS_ENV = "SGLANG_MEMORY_SAVER_CUDA_GRAPH"


def runner_reason(model_runner: Any) -> str | None:
    """Why bcg must not serve this runner (checked before SGLang's gates run), or ``None``."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend

    server_args = model_runner.server_args
    if not check_cuda_graph_backend(Phase.PREFILL, Backend.BREAKABLE):
        from bcg_plugin.adapters.sglang.replay import prefill_graph_config

        backend = prefill_graph_config(model_runner).backend
        return f"SGLang resolved the prefill graph backend to {backend!r}; bcg replaces 'breakable' only"
    if memory_saver_releases_graphs(_setting(server_args, "enable_memory_saver", "features")):
        return ("SGLang's memory saver releases CUDA-graph memory (enable_memory_saver with "
                "SGLANG_MEMORY_SAVER_CUDA_GRAPH) and bcg's graphs are not in its regions; run prefill graphs with "
                "--cuda-graph-backend-prefill full, or unset SGLANG_MEMORY_SAVER_CUDA_GRAPH")
    if _setting(server_args, "enable_return_hidden_states", "features") or \
            _setting(server_args, "return_hidden_states_mode", "features"):
        # Every batch then asks for hidden states, which bcg's graphs do not return: none would replay.
        return "a server that returns hidden states (--enable-return-hidden-states, --return-hidden-states-mode)"
    from bcg_plugin.adapters.sglang.host import tp_group

    if _setting(server_args, "enable_symm_mem", "comm") and tp_group(model_runner).world_size > 1:
        # Its allocator, entered by every row-parallel layer, needs SGLang's own graph pool while capturing.
        return "NCCL symmetric memory (--enable-symm-mem) at tensor parallelism above 1"
    if model_runner.is_draft_worker:
        return "speculative draft worker"
    if not model_runner.spec_algorithm.is_none():
        return "speculative decoding (target hidden-state capture)"
    from bcg_plugin.adapters.sglang.replay import published

    if published("lora", "enable_lora", server_args):  # resolved (the record keeps the input from 0.5.20)
        return "LoRA adapters"
    if model_runner.pp_group.world_size > 1:
        return "pipeline parallelism"
    if _dcp_size(model_runner) > 1:
        return "decode context parallelism"
    if _prefill_context_parallel():
        # SGLang replays a prefill graph under it only from its own runner's context-parallel capture.
        return "prefill context parallelism"
    if model_runner.model_config.is_multimodal:
        return "multimodal model"
    if not model_runner.is_generation:
        return "embedding/reward model"
    name = type(model_runner.attn_backend).__name__
    if name not in SUPPORTED_ATTENTION_BACKENDS:
        return f"attention backend {name} (bcg supports {', '.join(SUPPORTED_ATTENTION_BACKENDS)})"
    return None


def layers_reason(model_runner: Any, layer_model: Any) -> str | None:
    """Why the collected layers are not bcg-capturable (checked once SGLang collected them).

    MoE layers are captured inside the segments like any other layer (their collectives included,
    so every rank replays in lockstep), except with an all-to-all MoE backend: SGLang runs that
    dispatch as an eager node of its own breakable graphs, a break bcg does not own.
    """
    a2a = _moe_a2a_backend(model_runner.server_args)
    if a2a not in (None, "none") and any(x is not None for x in getattr(model_runner, "moe_layers", None) or ()):
        return f"MoE all-to-all backend {a2a!r} (its dispatch is a break bcg does not own)"
    for name in ("dsa_indexers", "mha_companion_layers"):
        if any(x is not None for x in getattr(model_runner, name, None) or ()):
            return f"model has {name.replace('_', ' ')} (breaks bcg does not own)"
    params = list(inspect.signature(layer_model.forward).parameters)
    if params[:3] != ["input_ids", "positions", "forward_batch"]:
        return f"{type(layer_model).__name__}.forward{tuple(params)} is not (input_ids, positions, forward_batch, ...)"
    return None


def _setting(server_args: Any, name: str, section: str) -> Any:
    """A resolved setting of ``get_exec()``'s ``section`` (as :func:`published` reads it), or ``None``
    where this SGLang has no such setting."""
    from bcg_plugin.adapters.sglang.replay import published

    try:
        return published("exec", name, server_args, section=section)
    except AttributeError:
        return None


def memory_saver_releases_graphs(enabled: Any) -> bool:
    """Whether SGLang's memory saver, where ``enabled``, releases CUDA-graph memory
    (``release_memory_occupation`` with the ``cuda_graph`` tag), as SGLang's own graph backends read
    it. bcg's graphs live in its own pool, outside the saver's regions, so such a release would leave
    them resident; SGLang's own breakable runner refuses that setting too."""
    from sglang.srt.utils import get_bool_env_var

    return bool(enabled) and get_bool_env_var(MEMORY_SAVER_GRAPHS_ENV)


def _dcp_size(model_runner: Any) -> int:
    """The decode-context-parallel width: the runner's own through 0.5.22; SGLang 0.5.23 keeps it in
    the parallel context only (the runner has no ``dcp_size``, and the triton backend reads
    ``attn_dcp_size`` from there)."""
    size = getattr(model_runner, "dcp_size", None)
    if size is not None:
        return int(size)
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return int(getattr(parallel, "attn_dcp_size", None) or getattr(parallel, "dcp_size", 1) or 1)


def _prefill_context_parallel() -> bool:
    """Whether SGLang runs a prefill context-parallel strategy (every release bcg supports gates its
    prefill graph runners on this in ``_prefill_cuda_graph_allows_context_parallel``)."""
    try:
        from sglang.srt.layers.cp.base import get_cp_strategy
    except ImportError:
        return False
    return get_cp_strategy() is not None


def _moe_a2a_backend(server_args: Any) -> str | None:
    """The MoE all-to-all backend as SGLang resolved it (its resolution may pick one the operator did
    not name, e.g. MegaMoE, and the ``ServerArgs`` record keeps the operator's input from 0.5.20),
    else as the record holds it."""
    try:
        from sglang.srt.layers.moe.utils import get_moe_a2a_backend

        resolved = get_moe_a2a_backend()
    except Exception:  # no published runtime context (a unit test, early start-up)
        resolved = None
    if resolved is not None:
        value = getattr(resolved, "value", resolved)
        if value not in (None, "none"):
            return str(value)
    return getattr(server_args, "moe_a2a_backend", "none")
