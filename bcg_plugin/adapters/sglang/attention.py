"""Attention as bcg's eager break: the one per-layer call that runs live at every replay.

At replay no model Python runs; only this break does. Everything batch-shaped it needs comes from
the live forward bound by the core (:func:`bcg_plugin.live.current`), never from capture-time
values: the SGLang ``ForwardBatch`` (its attention metadata already planned by the runner), the
real-row count, and the layer objects. The SGLang attention backend (triton, flashinfer, fa3 ...)
is called directly, skipping the torch-op dispatcher and SGLang's process-global context.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from bcg_plugin import BcgStateError, eager_break, live

# Per-token keyword arguments RadixAttention may pass through; narrowed to the real rows.
_PER_TOKEN_KWARGS = ("q_rope", "k_rope", "topk_indices")
# Per-row or callable attention arguments bcg's break does not narrow (SGLang 0.5.23 passes them to
# its eager attention method; earlier releases sent them to a separate op, refused the same way).
_UNNARROWED_KWARGS = ("score_mod", "aux_tensors", "rel_bias", "q_descale", "k_descale", "v_descale", "idx_q", "idx_k",
                      "idx_v", "mxfp8_norm_rope_positions", "mxfp8_norm_rope_temp_scale")


@dataclasses.dataclass
class ForwardPass:
    """What one captured or replayed forward hands to its breaks (the core's ``payload``).

    Attributes:
        forward_batch: SGLang's batch for this forward: the live one at replay (metadata
            planned on it), the dummy one at capture.
        attn_backend: the model runner's attention backend.
        attention_layers: ``layer_id -> RadixAttention`` as SGLang collected them.
        forward_kwargs: extra ``model.forward`` kwargs for the eager logits tail.
        stored_in_graph: the layers whose KV-cache store a capture put in the segment before their
            break (:func:`captured_then_break`); the host's own set, so it outlives the forward and
            the capture summary can say where the store runs.
        graph_variant: the graph variant a capture batch was planned for
            (:meth:`~bcg_plugin.adapters.sglang.graph_attention.GraphAttention.variants`); ``None``
            for a bucket's own graph and at replay.
    """

    forward_batch: Any
    attn_backend: Any
    attention_layers: list[Any]
    forward_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    stored_in_graph: set[int] = dataclasses.field(default_factory=set)
    graph_variant: str | None = None
    # What every break of this forward narrows alike, worked out by its first break: the rows
    # attention sees, and the batch's cache slots and positions cut to them; keyed by what they were
    # cut from, since the capture swaps the bucket's static buffers into the batch.
    _real: tuple[Any, ...] | None = dataclasses.field(default=None, init=False, repr=False)

    def real_rows(self, landed: int, slots: Any, positions: Any) -> tuple[int, Any, Any]:
        """``(rows, slots, positions)``: the real rows among the ``landed`` ones, and the batch's
        per-token cache ``slots`` and ``positions`` narrowed to them (positions only where SGLang's
        own eager attention narrows them too), computed once per forward."""
        real = self._real
        if real is None or real[0] != landed or real[1] is not slots or real[2] is not positions:
            n = step_real_rows(self.forward_batch, landed)
            narrowed = positions[:n] if positions is not None and _narrows_positions() else positions
            real = self._real = (landed, slots, positions, n, slots[:n], narrowed)
        return real[3:]


def capturing() -> bool:
    """True while bcg captures or replays an SGLang forward in this thread."""
    batch = live.get()
    return batch is not None and isinstance(batch.payload, ForwardPass)


def refuse(what: str) -> None:
    raise BcgStateError(f"bcg cannot capture {what}; this model runs prefill eagerly")


@eager_break(outputs=("output",), capturable=True)
def bcg_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    output: torch.Tensor,
    save_kv_cache: bool,
    layer_id: int,
    *,
    use_mha_companion: bool = False,
    key_value_num_tokens: int | None = None,
    **kwargs: Any,
) -> None:
    """RadixAttention's extend attention on the live batch's real rows, written into ``output``.

    In a bucket that keeps attention inside the graph (:mod:`~bcg_plugin.adapters.sglang.graph_attention`)
    this runs once, at capture, on the capture batch planned into the backend's graph wrappers, and
    the kernels it launches are recorded: replays read the wrappers each step refills.
    """
    if use_mha_companion or key_value_num_tokens is not None:
        refuse("MHA-companion / fixed-capacity prefix attention")
    batch = live.current()
    fwd: ForwardPass = batch.payload
    fb = fwd.forward_batch
    out_cache_loc, positions = fb.out_cache_loc, getattr(fb, "positions", None)
    # Rows the core landed (DP may pad the batch itself); attention sees only the real ones.
    n, real_cache_loc, real_positions = fwd.real_rows(batch.num_tokens, out_cache_loc, positions)
    if n == 0:  # an idle DP rank padded to its peers' bucket: as SGLang's eager attention, zeros only
        output[: batch.num_tokens].zero_()  # (flashinfer refuses a call with no query row)
        return
    if kwargs:
        for name in _PER_TOKEN_KWARGS:
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name][:n]
    # Backends that write in place (triton, fa3) take the output slot from the batch. The KV store
    # writes one cache slot per key row (SGLang's store_cache requires as many indices as rows), so
    # the slots are narrowed with the keys; the batch keeps its own tensor for the logits tail.
    fb._attn_output = output[:n]
    fb.out_cache_loc = real_cache_loc
    if positions is not None:
        fb.positions = real_positions
    try:
        ret = fwd.attn_backend.forward(
            query[:n],
            None if key is None else key[:n],
            None if value is None else value[:n],
            fwd.attention_layers[layer_id],
            fb,
            save_kv_cache,
            **kwargs,
        )
    finally:
        fb._attn_output = None
        fb.out_cache_loc = out_cache_loc
        if positions is not None:
            fb.positions = positions
    if ret.data_ptr() != output.data_ptr():
        output[:n].view(ret.shape).copy_(ret)
    if n < batch.num_tokens:  # DP padding rows inside the landed rows (the core scrubs the rest)
        output[n : batch.num_tokens].zero_()


def captured_then_break(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                        output: torch.Tensor, save_kv_cache: bool, layer_id: int, *args: Any,
                        **kwargs: Any) -> None:
    """What RadixAttention's breakable op becomes under bcg's capture: key and value made
    contiguous inside the captured segment where the backend would copy them anyway
    (:func:`copies_key_value`), the KV-cache store there too where it can be captured
    (:func:`stores_in_segment`), then the eager break.

    Key and value arrive as strided views of the fused QKV projection. The triton backend copies
    them to contiguous tensors on every call: two launches per layer at every replay, which the
    segment does instead (the backend's own ``contiguous()`` is then a no-op). flashinfer and fa3
    read and store them strided, so there they pass as they are: a copy would add two passes over
    the step's keys and values per layer that SGLang's own modes never run. In the segment the
    store leaves the break only the attention kernel.
    """
    fwd: ForwardPass = live.current().payload
    if copies_key_value(fwd.attn_backend):
        key = None if key is None else key.contiguous()
        value = None if value is None else value.contiguous()
    if save_kv_cache and key is not None and value is not None:
        if stores_in_segment(fwd, layer_id, key.shape[0]):
            layer = fwd.attention_layers[layer_id]
            fwd.attn_backend.token_to_kv_pool.set_kv_buffer(layer, _write_loc(fwd.forward_batch), key, value)
            fwd.stored_in_graph.add(layer_id)
            save_kv_cache = False
    return bcg_attention(query, key, value, output, save_kv_cache, layer_id, *args, **kwargs)


def copies_key_value(backend: Any) -> bool:
    """Whether ``backend``'s extend attention copies strided key and value to contiguous tensors on
    every call (SGLang's triton backend does; flashinfer and fa3 read them strided)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    return isinstance(backend, TritonAttnBackend)


# The backends whose extend attention stores the KV cache with nothing but the pool's store
# (:func:`stores_in_segment`), named so that checking them imports none (fa3's module needs sgl_kernel).
_SEGMENT_STORE_BACKENDS = frozenset({
    ("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend"),
    ("sglang.srt.layers.attention.flashinfer_backend", "FlashInferAttnBackend"),
    ("sglang.srt.layers.attention.flashattention_backend", "FlashAttentionBackend"),
})


def stores_in_segment(fwd: ForwardPass, layer_id: int, rows: int) -> bool:
    """Whether layer ``layer_id``'s KV-cache store of ``rows`` key rows can run inside the captured
    segment instead of the break.

    Only where the store reads nothing but the batch's cache slots and the pool's per-layer
    buffers: the slots are the bucket's static buffer (landed before every replay; padded and
    DP-padded rows hold SGLang's padding slot 0, which no request owns and the store kernel skips)
    and the buffers live as long as the pool (SGLang's own decode graphs hold the same addresses).
    That is the triton, flashinfer and fa3 backends on the plain MHA pool: no KV quantization or
    scales, no sliding-window or unified pool (their write slots are planned per forward), no
    decode- or attention-context parallelism, no cross-attention, no flashinfer dequantizing
    workspace (it reads the new keys beside the cache). fa3 stores first and then reads every key
    from the cache, the new ones included, as the store in the segment leaves them. flashinfer's
    ragged prefill stores after attention, but with one wrapper per layer its attention reads the
    new keys from the call and only the prefix from the cache, so storing first changes nothing.
    With a second wrapper (sliding-window or cross attention) SGLang before 0.5.23 plans the
    full-attention layers' cache pass over the new tokens too, so there the store stays in the break.
    Everything else stores in the break, as SGLang does.
    """
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    backend = fwd.attn_backend
    pool = getattr(backend, "token_to_kv_pool", None)
    cls = type(backend)
    if (cls.__module__, cls.__qualname__) not in _SEGMENT_STORE_BACKENDS or type(pool) is not MHATokenToKVPool:
        return False
    if (getattr(backend, "dcp_size", 1) != 1 or getattr(backend, "use_mla", False)
            or getattr(backend, "use_dense_fp8_chunked_prefill", False)
            or getattr(backend, "prefill_uses_dequant_workspace", False)
            or getattr(backend, "dispatch_reason", None) is not None  # flashinfer's second wrapper per layer
            or getattr(backend, "fa_impl_ver", 3) != 3 or getattr(backend, "fa_skip_kv_cache", False)
            or getattr(backend, "attn_cp_size", 1) != 1 or getattr(backend, "_kv_shard_pool", None) is not None):
        return False
    if getattr(pool, "is_quantized_kv_cache", False) or getattr(pool, "requires_physical_write_loc", False):
        return False
    layer = fwd.attention_layers[layer_id]
    if (layer.k_scale is not None or layer.v_scale is not None or getattr(layer, "is_cross_attention", False)
            or getattr(layer, "attn_type", None) == AttentionType.ENCODER_ONLY):  # flashinfer skips their store
        return False
    metadata = getattr(backend, "forward_metadata", None)
    if any(getattr(metadata, name, None) is not None for name in ("swa_out_cache_loc", "out_cache_loc_full_physical")):
        return False
    return fwd.forward_batch.out_cache_loc.shape[0] == rows  # the store takes one slot per key row


def layer_attention_break(layer: Any, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                          output: torch.Tensor, save_kv_cache: bool = True, key_value_num_tokens: int | None = None,
                          idx_output: torch.Tensor | None = None, lse_output: torch.Tensor | None = None,
                          **kwargs: Any) -> None:
    """What ``RadixAttention._eager_attention`` (SGLang 0.5.23 on) becomes under bcg's capture.

    The method carries every attention variant; the plain one is bcg's break, the rest are
    refused here, before anything runs, so the capture fails and every rank prefills eagerly.
    """
    if idx_output is not None:
        refuse("sparse-indexer attention")
    if lse_output is not None or kwargs.pop("return_lse", False):
        refuse("attention returning log-sum-exp (chunked-prefix MHA)")
    extra = sorted(name for name in _UNNARROWED_KWARGS if kwargs.get(name) is not None)
    if extra:
        refuse(f"attention with {'/'.join(extra)} kwargs")
    kwargs = {name: value for name, value in kwargs.items() if name not in _UNNARROWED_KWARGS}
    captured_then_break(q, k, v, output, save_kv_cache, layer.layer_id, key_value_num_tokens=key_value_num_tokens,
                        **kwargs)


@functools.cache
def _narrows_positions() -> bool:
    """Whether SGLang's own eager attention hands the backend the positions of the real rows only
    (0.5.23 on, ``attention_input_scope``); bcg's break then does the same, and before, as SGLang, not."""
    try:
        from sglang.srt.layers.attention.graph_utils import attention_input_scope  # noqa: F401
    except ImportError:
        return False
    return True


def _write_loc(fb: Any) -> Any:
    """The batch's cache slots as SGLang's backends hand them to the pool's store (0.5.23 marks them
    physical or not from the batch)."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    return KVWriteLoc.for_batch(fb) if hasattr(KVWriteLoc, "for_batch") else KVWriteLoc(fb.out_cache_loc)


def step_real_rows(fb: Any, landed: int) -> int:
    """The real rows among the ``landed`` ones of batch ``fb``: under DP attention SGLang pads a step
    to its peers' bucket before a graph runner sees it (an idle rank's whole step is padding) and
    keeps the count of its real tokens apart."""
    # SGLang 0.5.20 renamed the count (the real tokens before attention-TP sharding) to say it is global.
    real = getattr(fb, "global_num_token_non_padded_cpu", None)
    if real is None:
        real = getattr(fb, "num_token_non_padded_cpu", None)
    return landed if real is None else min(int(real), landed)
