"""The contract between the core runtime and a host adapter (pluggy project ``"bcg"``).

An adapter is a plugin object implementing these hooks for one host engine; the core never imports
a host. Every hook is ``firstresult``: exactly one adapter serves a runner, and a hook an adapter
does not implement returns ``None`` (the documented default applies).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from bcg_plugin.config import BcgConfig

PROJECT_NAME = "bcg"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

# The graph variant of a bucket whose attention stays inside the graph that is captured with its
# attention breaking instead: for the steps the bucket's fixed attention buffers cannot hold (more
# requests than they were sized for), which would otherwise pad to a larger breaking bucket or run
# eagerly.
BREAKING = "break"


@dataclasses.dataclass(frozen=True)
class StaticInput:
    """One per-row graph input: the core owns a ``[max_tokens, *row_shape]`` buffer for it,
    or reads the host's own persistent buffer in place.

    Attributes:
        row_shape: shape of one token's row (``()`` for ids/positions, ``(hidden,)`` for embeds).
        dtype: buffer dtype.
        pad: value written into padded rows at every replay (embeds 0, positions 0, a dummy KV
            slot for cache locations), so the padded tail is deterministic and finite.
        host_buffer: the host's persistent input buffer for this input, if it has one (rows of
            ``row_shape`` and ``dtype``, at least the top bucket's count, contiguous, allocated
            for the engine's lifetime). The graphs then read it in place, and a batch whose input
            is a view of its first rows lands with no copy, as the host's own graphs do. Its padded
            rows are still written with ``pad``. ``None``: the core allocates a buffer.
    """

    row_shape: tuple[int, ...]
    dtype: torch.dtype
    pad: float | int = 0
    host_buffer: torch.Tensor | None = dataclasses.field(default=None, compare=False, repr=False)

    def buffer_problems(self, buf: torch.Tensor, device: torch.device, rows: int = 0) -> list[str]:
        """Why ``buf`` cannot hold this input's first ``rows`` rows in place on ``device`` (empty if it can)."""
        checks = (
            (f"dtype {buf.dtype}, not {self.dtype}", buf.dtype != self.dtype),
            (f"rows of shape {tuple(buf.shape[1:])}, not {self.row_shape}", tuple(buf.shape[1:]) != self.row_shape),
            (f"{buf.shape[0] if buf.dim() else 0} rows, fewer than the top bucket's {rows}",
             buf.dim() == 0 or buf.shape[0] < rows),
            (f"device {buf.device}, not {device}", buf.device != device),
            ("not contiguous", not buf.is_contiguous()),
        )
        return [what for what, bad in checks if bad]


@dataclasses.dataclass
class HostBatch:
    """One forward handed to the core: its real rows and the adapter's per-batch state.

    Attributes:
        num_tokens: real rows (<= the bucket it replays in).
        inputs: per-row tensors keyed like ``bcg_static_inputs``, at least ``num_tokens`` rows.
        payload: whatever the adapter's breaks and logits tail read (attention metadata, the
            host's forward batch); bound as :attr:`bcg_plugin.live.LiveBatch.payload`.
        requested_tokens: the rows that carry requests, for the counters only, when fewer than
            ``num_tokens`` (an idle data-parallel rank's padded forward lands every row and
            carries none: 0); ``None`` means all ``num_tokens``.
    """

    num_tokens: int
    inputs: dict[str, torch.Tensor]
    payload: Any = None
    requested_tokens: int | None = None


class BcgHostSpec:
    """Hooks a host adapter implements."""

    @hookspec(firstresult=True)
    def bcg_prefill_buckets(self, config: BcgConfig) -> list[int] | None:
        """Return the token buckets to capture, or ``None`` for the core ladder.

        ``config.max_tokens`` is already resolved to the host's chunk size. An adapter returns a
        list only where its host constrains sizes (e.g. padding to a multiple of the TP size).
        """

    @hookspec(firstresult=True)
    def bcg_static_inputs(self) -> dict[str, StaticInput]:
        """Return the graph's per-row inputs by name; the core allocates and lands them.

        These are exactly the keys :meth:`bcg_body_forward` receives (as ``[bucket]``-row views).
        """

    @hookspec(firstresult=True)
    def bcg_graph_attention(self, buckets: list[int], attention: str) -> list[int] | None:
        """Return the buckets whose attention stays inside the captured graph.

        ``attention`` is the config's choice, ``"graph"`` or ``"auto"`` (``"break"`` never asks).
        For ``"graph"``: every bucket whose attention the host can run from buffers fixed per
        bucket, landing each batch's metadata into them before the replay; for ``"auto"``: the
        host's default among them (for example the sizes where keeping attention inside beats an
        eager call sized for the live batch). In those buckets every break made with
        ``eager_break(..., capturable=True)`` is captured inline, with no padded-row scrub after
        it, and :meth:`bcg_dummy_batch` is asked for graph-resident metadata: the host must land
        each step's metadata so that the kernel reads only real rows and padded rows write no KV,
        as its own full graphs require. The answer must be the same
        on every rank. ``None``: attention breaks in every bucket. Asked before every capture of
        the ladder (a host may capture once to measure memory and again to serve); a host may
        prepare its own state for the buckets it names (vLLM raises its metadata builders' graph
        bound), so the answer must not change between the asks of one engine.
        """

    @hookspec(firstresult=True)
    def bcg_graph_variants(self, buckets: list[int]) -> dict[int, list[str]] | None:
        """Return, per bucket, the names of the further graphs it is captured as, or ``None`` for none.

        ``buckets`` are those whose attention stays inside the graph (:meth:`bcg_graph_attention`),
        and only they may have variants. A variant is the same bucket captured again from a capture
        batch the host plans differently (:meth:`bcg_dummy_batch` with ``variant``), for example with
        another attention kernel that serves only some steps; the host picks it per step
        (:meth:`~bcg_plugin.PrefillGraphRunner.replay` with ``variant``) and lands that step's
        metadata as that variant reads it. The variant named :data:`BREAKING` is captured as a
        bucket whose attention breaks: its capture batch is asked with ``graph_attention=False``, its
        capturable breaks run eagerly and its padded rows are scrubbed, and the host plans each of
        its steps as for a breaking bucket. Asked once per capture, after
        :meth:`bcg_graph_attention`, and only where the config's ``graph_variants`` is on (a host
        makes what its variants need here, not before); the answer must be the same on every rank.
        """

    @hookspec(firstresult=True)
    def bcg_dummy_batch(self, num_tokens: int, graph_attention: bool, variant: str | None) -> HostBatch:
        """Return a capture batch of exactly ``num_tokens`` rows (bs=1 extend, KV to a dummy slot;
        with ``graph_attention``, as many requests as the host pads such a bucket's steps to).

        Its payload is bound as the live batch while the bucket is captured, so breaks run real
        attention on it once; nothing of it is read again at replay. ``graph_attention``: the
        bucket keeps attention inside the graph (:meth:`bcg_graph_attention`), so the batch's
        attention metadata must live in the buffers every replay of the bucket lands its own in.
        ``variant``: ``None`` for the bucket's graph, else the name of the variant being captured
        (:meth:`bcg_graph_variants`; for :data:`BREAKING`, ``graph_attention`` is ``False``); a host
        that names variants takes this argument, without a default (pluggy passes an implementation
        no argument that has one).
        """

    @hookspec(firstresult=True)
    def bcg_body_forward(self, inputs: dict[str, torch.Tensor], payload: Any) -> torch.Tensor:
        """Return hidden states ``[rows, ...]`` of the transformer body run on the static inputs.

        Called eagerly for warm-up and once under capture per bucket. Per-batch values must be
        read by eager breaks from :func:`bcg_plugin.live.current`, never from ``payload`` here:
        Python in this hook runs only at capture.
        """

    @hookspec(firstresult=True)
    def bcg_embed(self, batch: HostBatch) -> dict[str, torch.Tensor] | None:
        """Return graph inputs computed eagerly before replay (e.g. ``inputs_embeds`` from ids).

        The embedding stays outside the graph so merged multimodal embeddings replay the same
        graphs. ``None``: ``batch.inputs`` already holds every static input.
        """

    @hookspec(firstresult=True)
    def bcg_logits_tail(self, hidden: torch.Tensor, batch: HostBatch) -> Any:
        """Return what the host expects from a forward, computed eagerly on the real rows.

        ``hidden`` is ``[num_tokens, ...]``, a view of the shared output buffer valid until the
        next replay. ``None``: the runner returns ``hidden`` itself.
        """

    @hookspec(firstresult=True)
    def bcg_world_group(self) -> Any:
        """Return a CPU (gloo) process group spanning every rank that must agree, or ``None``.

        Used for the capture-success vote (MIN) so a failure on one rank leaves all ranks eager.
        """

    @hookspec(firstresult=True)
    def bcg_capture_stream(self) -> torch.cuda.Stream | None:
        """Return the stream to capture on (the host's graph stream), or ``None`` for the one
        ``torch.cuda.graph`` captures on when given none (see :func:`bcg_plugin.default_capture_stream`)."""


def plugin_manager(*adapters: object) -> pluggy.PluginManager:
    """A plugin manager with the spec registered and ``adapters`` registered in order."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(BcgHostSpec)
    for adapter in adapters:
        pm.register(adapter)
    pm.check_pending()
    return pm
