"""The prefill graph runner: capture every bucket once, replay any batch mix at that token count."""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import pluggy
import torch
from tqdm.auto import tqdm

from bcg_plugin import live
from bcg_plugin.capture import SegmentedGraph, capture_segments, check_torch_version, default_capture_stream
from bcg_plugin.config import BcgConfig
from bcg_plugin.dist import CaptureStatus, agree_capture_status, dp_bucket
from bcg_plugin.errors import BcgCaptureError, BcgCaptureOOM, BcgConfigError, BcgError, BcgStateError
from bcg_plugin.hookspecs import BREAKING, HostBatch, StaticInput
from bcg_plugin.ladder import choose_bucket, padding_allows, resolve_buckets
from bcg_plugin.padding import PaddedRows
from bcg_plugin.pool import GraphPool, free_device_bytes
from bcg_plugin.stats import Fallback, RuntimeStats

logger = logging.getLogger("bcg_plugin")
T = TypeVar("T")

# The least an estimate charges each further bucket: a captured graph's own driver memory, which free
# device memory shows only in whole pages, so a one-segment bucket can read as free. vLLM takes the
# same floor for its own graphs' estimate.
MIN_BUCKET_BYTES = 1 << 20


class _PeerCaptureFailure(Exception):
    """Another rank's capture failed (``status``); this rank stops at the same bucket."""

    def __init__(self, status: CaptureStatus) -> None:
        super().__init__(status.name)
        self.status = status


def _agreed(step: Callable[[], T], group: Any) -> tuple[T | None, CaptureStatus, BaseException | None]:
    """Run one capture step on this rank, then agree on its outcome with every rank: the step's
    result, the agreed status, and this rank's own error (``None`` if it succeeded here)."""
    result, status, error = None, CaptureStatus.OK, None
    try:
        result = step()
    except torch.OutOfMemoryError as e:
        status, error = CaptureStatus.OOM, e
    except Exception as e:
        status, error = CaptureStatus.FAILED, e
    return result, agree_capture_status(status, group), error


class PrefillGraphRunner:
    """Engine-agnostic prefill/extend graphs keyed by padded token count.

    Holds one :class:`~bcg_plugin.capture.SegmentedGraph` per bucket (and one per variant the host
    names for it, :meth:`~bcg_plugin.hookspecs.BcgHostSpec.bcg_graph_variants`), the static per-row input
    buffers (its own, or views of the host's persistent ones where the adapter declares them), the
    padded-row flags the graphs read (:class:`~bcg_plugin.padding.PaddedRows`) and one shared
    output buffer (all sized for the top bucket and allocated outside capture, so no bucket's inputs
    or outputs can be aliased by a later allocation: pitfalls 2 and 3), and the one pool and stream
    all buckets capture into.

    One replay is a straight line: the adapter picks the bucket (:meth:`bucket_for`), the core
    lands the inputs and replays segments and breaks with the live batch bound
    (:meth:`replay`), and the adapter's logits tail runs on the real rows.
    """

    def __init__(self, pm: pluggy.PluginManager, config: BcgConfig, *, chunk_size: int, device: Any = None):
        self.config = config.with_chunk_size(chunk_size)
        self._hook = pm.hook
        # Bound once: replay calls them every forward, and an unimplemented hook is skipped.
        self._embed = pm.hook.bcg_embed if pm.hook.bcg_embed.get_hookimpls() else None
        self._logits_tail = pm.hook.bcg_logits_tail if pm.hook.bcg_logits_tail.get_hookimpls() else None
        self.device = torch.device("cuda" if device is None else device)
        if self.device.type == "cuda" and self.device.index is None:  # comparable with tensors' devices
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.buckets: list[int] = []
        if self.config.active:
            from_host = self._hook.bcg_prefill_buckets(config=self.config)
            self.buckets = resolve_buckets(self.config.max_tokens, self.config.sizes if from_host is None else from_host)
        self.stats = RuntimeStats()
        self._graphs: dict[int, SegmentedGraph] = {}
        self._variant_graphs: dict[tuple[int, str], SegmentedGraph] = {}
        self._pool: GraphPool | None = None
        self._static: dict[str, torch.Tensor] = {}
        self._pads: dict[str, float | int] = {}
        self._padded: PaddedRows | None = None
        self.graph_attention: frozenset[int] = frozenset()
        self.graph_variants: dict[int, tuple[str, ...]] = {}
        self._output: torch.Tensor | None = None
        self._capture_failed = False
        self._fallback_capture_stream: torch.cuda.Stream | None = None

    # -- capture -------------------------------------------------------------------------------

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def capture(self, *, progress: bool = True) -> None:
        """Capture every bucket, largest first; agree on the outcome with every rank.

        A non-OOM failure on any rank leaves every rank eager (or raises if the config says
        so); OOM on any rank fails the boot on every rank with advice. A failure that leaves this
        rank's device unusable (a sticky CUDA error: eager prefill would fail too) raises here,
        after the ranks have agreed, with advice.
        """
        if not self.config.active or not self.buckets:
            return
        if self._graphs:
            raise BcgStateError("capture() was already called on this runner; build a new runner to recapture")
        status, error = CaptureStatus.OK, None
        free_before = self._free_device_bytes()
        start = time.perf_counter()
        try:
            self._capture_all(self.buckets, progress)
        except _PeerCaptureFailure as e:
            status = e.status
        except torch.OutOfMemoryError as e:
            status, error = CaptureStatus.OOM, e
        except BcgError as e:  # raised on purpose: its message says what is wrong and what to do
            status, error = CaptureStatus.FAILED, e
            logger.warning("bcg: prefill graph capture failed: %s", e)
        except Exception as e:
            status, error = CaptureStatus.FAILED, e
            # Logged as text: a record holding exc_info would keep the failed frames, and with
            # them blocks of the pool being torn down, alive in whatever handler keeps records.
            logger.warning("bcg: prefill graph capture failed:\n%s", "".join(traceback.format_exception(e)))
        world = agree_capture_status(status, self._hook.bcg_world_group())
        lost = self._device_lost(error, "capture") if error is not None else None
        if lost is not None:
            raise lost from error
        if world is CaptureStatus.OK:
            self.stats.capture_seconds = time.perf_counter() - start
            self.stats.buckets_captured = len(self._graphs)
            self.stats.pool_bytes = self._pool.reserved_bytes()
            # The pool is only part of it: the driver holds memory for every captured segment.
            self.stats.graph_bytes = max(free_before - self._free_device_bytes(), 0)
            self.stats.graph_attention_buckets = sorted(self.graph_attention)
            self.stats.variant_graphs = len(self._variant_graphs)
            logger.info(
                "bcg: captured %d prefill buckets (%d..%d tokens) in %.2f s (warm-up forwards %.2f s, "
                "warmup: %s), graph memory %.3f GiB (pool %.3f GiB); %s",
                len(self._graphs), self.buckets[0], self.buckets[-1], self.stats.capture_seconds,
                self.stats.warmup_seconds, self.config.warmup, self.stats.graph_bytes / 2**30,
                self.stats.pool_bytes / 2**30,
                attention_summary(self.buckets, self.graph_attention, self.graph_variants),
            )
            return
        self.close()
        self._capture_failed = True
        if world is CaptureStatus.OOM:
            where = "on this rank" if error is not None and status is CaptureStatus.OOM else "on another rank"
            raise BcgCaptureOOM(
                f"out of memory {where} while capturing bcg prefill graphs up to {self.buckets[-1]} "
                "tokens; lower bcg 'max_tokens' (or the engine's memory utilisation), or set "
                "'max_tokens' to 0 to disable prefill graphs"
            ) from error
        if self.config.capture_failure == "raise":
            what = repr(error) if error is not None else "it failed on another rank"
            raise BcgCaptureError(f"bcg prefill graph capture failed: {what}") from error
        if error is not None:
            traceback.clear_frames(error.__traceback__)
        logger.warning("bcg: prefill graph capture failed on at least one rank; every rank runs prefill eagerly")

    def estimate_graph_bytes(self) -> int:
        """Device memory :meth:`capture` will take, from capturing a sample of buckets and releasing them.

        For hosts that size their KV cache before any capture. The top bucket's capture takes the
        pool (the activations every smaller bucket reuses), the static buffers and its own
        segments; each further bucket adds little more than its own segments, which the next
        bucket of its kind samples: a bucket with attention inside the graph is one segment (one
        more per variant, a segment per layer for :data:`~bcg_plugin.hookspecs.BREAKING`), one with
        eager breaks a segment per layer, so the largest further bucket of each kind is sampled.
        What a sample grows the pool by (the first graph-resident attention's buffers, say) is
        charged once, the rest (at least :data:`MIN_BUCKET_BYTES`) once per bucket of its kind: the
        extrapolation vLLM makes for its own graphs. Every rank samples the same buckets and agrees
        on the outcome as in :meth:`capture`. The runner is left as it was and its pool
        returned to the device, so :meth:`capture` can follow and a host measuring free memory sees
        none of the sample; if the sample fails on any rank the estimate is 0 (logged): it is advice
        for the host, and the capture itself decides later. A failure that leaves the device
        unusable raises instead, as in :meth:`capture`.
        """
        if not self.config.active or not self.buckets:
            return 0
        if self._graphs:
            raise BcgStateError("estimate_graph_bytes() must come before capture(): it captures and releases buckets")
        stands_for: dict[int, int] = {}
        order: list[int] = []  # the sample, in the order _capture_buckets captures it
        taken: list[tuple[int, int]] = []  # (free device bytes, pool bytes) after each sampled bucket

        def sample() -> list[int]:  # chosen once the setup has planned which buckets keep attention inside
            stands_for.update(self._estimate_sample())
            order.extend(sorted(stands_for, reverse=True))
            return order

        free_before = self._free_device_bytes()
        warmup_seconds = self.stats.warmup_seconds
        usable = True
        try:
            self._capture_all(sample, progress=False,
                              after_each=lambda: taken.append((self._free_device_bytes(), self._pool.reserved_bytes())))
        except Exception as e:  # OOM or a failure on any rank alike: the estimate is advisory
            lost = self._device_lost(e, "memory estimate")
            if lost is not None:  # ...unless nothing can run after it, capture nor eager
                usable = False
                raise lost from e
            traceback.clear_frames(e.__traceback__)  # frames would keep blocks of the pool alive
            logger.warning("bcg: could not estimate prefill graph memory (%r); the host sizes its memory "
                           "without bcg's graphs", e)
            return 0
        finally:
            if usable:  # releasing graphs on a device that runs nothing would raise over the error above
                self.close()
                self._free_device_bytes()  # the released pool back to the device, not cached by torch
            self.stats.warmup_seconds = warmup_seconds
        estimate, per_bucket = 0, []
        for i, bucket in enumerate(order):
            cost = max((taken[i - 1][0] if i else free_before) - taken[i][0], 0)
            if not i:
                estimate += cost
                continue
            once = min(max(taken[i][1] - taken[i - 1][1], 0), cost)
            each = max(cost - once, MIN_BUCKET_BYTES)
            estimate += once + each * stands_for[bucket]
            per_bucket.append(f"{each / 2**20:.1f} MiB for {stands_for[bucket]}")
        logger.info("bcg: prefill graph memory estimated at %.3f GiB for %d buckets (top bucket %.3f GiB, "
                    "further ones %s)", estimate / 2**30, len(self.buckets),
                    (free_before - taken[0][0]) / 2**30 if taken else 0.0, ", ".join(per_bucket) or "none")
        return estimate

    def _estimate_sample(self) -> dict[int, int]:
        """The buckets :meth:`estimate_graph_bytes` captures, each with how many buckets it stands for:
        the top bucket for itself, then the largest further bucket of each kind (attention inside the
        graph or broken out, and the variants it is also captured as) for every further bucket of
        that kind."""

        def kind(bucket: int) -> tuple[bool, tuple[str, ...]]:
            return bucket in self.graph_attention, self.graph_variants.get(bucket, ())

        top, *rest = sorted(self.buckets, reverse=True)
        sample = {top: 1}
        groups: dict[tuple[bool, tuple[str, ...]], list[int]] = {}
        for bucket in rest:  # largest first, so each group's first bucket is its largest
            groups.setdefault(kind(bucket), []).append(bucket)
        for group in groups.values():
            sample[group[0]] = len(group)
        return sample

    def _device_lost(self, error: BaseException, during: str) -> BcgCaptureError | None:
        """The error to fail the boot with if ``error``, raised during ``during``, left the device
        unusable: a sticky CUDA error (an illegal memory access, a device-side assert) makes every
        later call on the device fail, eager ones too. ``None`` while the device still runs work."""
        if self.device.type != "cuda" or not torch.cuda.is_initialized():  # no device work ran, none broke
            return None
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # torch.AcceleratorError in torch 2.11; RuntimeError before it
            return BcgCaptureError(
                f"bcg prefill graph {during} left this rank's GPU unusable ({error!r}): after an error of this "
                "kind (an illegal memory access, a device-side assert) every later CUDA call fails, eager ones "
                "too, so the engine cannot fall back to eager prefill; start it without bcg (set 'max_tokens' "
                "to 0) and report this log"
            )
        return None

    def _free_device_bytes(self) -> int:
        return free_device_bytes(self.device) if self.device.type == "cuda" else 0

    def _capture_all(self, buckets: list[int] | Callable[[], list[int]], progress: bool,
                     after_each: Callable[[], None] | None = None) -> None:
        """Set up, agree on the setup with every rank, then capture ``buckets`` one by one, largest first.

        ``buckets`` may be a function, called after the setup (which plans the buckets' attention).
        The setup vote comes before any warm-up: a rank whose setup failed must not leave the
        others waiting in the first warm-up's collectives, which it would never join.
        """
        group = self._hook.bcg_world_group()
        stream, world, error = _agreed(self._prepare_capture, group)
        if error is not None:
            raise error
        if world is not CaptureStatus.OK:
            raise _PeerCaptureFailure(world)
        self._capture_buckets(buckets() if callable(buckets) else buckets, stream, group, progress, after_each)

    def _prepare_capture(self) -> torch.cuda.Stream:
        """Static input buffers at the top bucket's size, the padded-row flags, the graph pool, the capture stream."""
        check_torch_version()  # before any buffer or warm-up: no bucket could capture
        specs: dict[str, StaticInput] = self._hook.bcg_static_inputs()
        if not specs:
            raise BcgConfigError("the adapter declared no static inputs (bcg_static_inputs returned nothing)")
        top = self.buckets[-1]
        self.graph_attention = self._plan_attention()
        self.graph_variants = self._plan_variants()
        self._pool = GraphPool()
        with self._pool.allocating():  # live blocks in the pool's segments, not segments of their own
            self._static = {name: self._static_buffer(name, spec, top) for name, spec in specs.items()}
            self._padded = PaddedRows(self.buckets, self.device, whole=self.graph_attention)
        self._pads = {name: spec.pad for name, spec in specs.items()}
        return self._hook.bcg_capture_stream() or self._fallback_stream()

    def _plan_attention(self) -> frozenset[int]:
        """The buckets whose attention is captured inside the graph: none under ``attention: "break"``,
        else the host's answer (:meth:`~bcg_plugin.hookspecs.BcgHostSpec.bcg_graph_attention`)."""
        if self.config.attention == "break":
            return frozenset()
        chosen = self._hook.bcg_graph_attention(buckets=list(self.buckets), attention=self.config.attention)
        if chosen is None:
            return frozenset()
        if isinstance(chosen, (str, bytes)) or not isinstance(chosen, Iterable):
            raise BcgStateError(f"bcg_graph_attention returned {chosen!r}: a list of buckets or None was expected")
        chosen = frozenset(chosen)
        unknown = sorted(chosen - set(self.buckets))
        if unknown:
            raise BcgStateError(f"bcg_graph_attention returned {unknown}, which are not buckets of this runner")
        # A dummy-batch hook that cannot be asked for graph-resident metadata would build a break's
        # batch, and the inline attention would replay reading the capture's metadata forever.
        blind = self._dummy_batch_without("graph_attention")
        if chosen and blind:
            raise BcgStateError(f"bcg_graph_attention chose {len(chosen)} buckets, but bcg_dummy_batch of "
                                f"{', '.join(blind)} takes no graph_attention argument, so it cannot build their "
                                "capture batch; take it, or return None from bcg_graph_attention")
        return chosen

    def _dummy_batch_without(self, argument: str) -> list[str]:
        """The adapters whose ``bcg_dummy_batch`` pluggy never passes ``argument``: they do not take it,
        or give it a default."""
        return [impl.plugin_name for impl in self._hook.bcg_dummy_batch.get_hookimpls()
                if argument not in impl.argnames]

    def _plan_variants(self) -> dict[int, tuple[str, ...]]:
        """The further graphs each graph-attention bucket is captured as: the host's answer
        (:meth:`~bcg_plugin.hookspecs.BcgHostSpec.bcg_graph_variants`), checked."""
        if (not self.config.graph_variants or not self.graph_attention
                or not self._hook.bcg_graph_variants.get_hookimpls()):
            return {}
        chosen = self._hook.bcg_graph_variants(buckets=sorted(self.graph_attention))
        if not chosen:
            return {}
        if not isinstance(chosen, dict):
            raise BcgStateError(f"bcg_graph_variants returned {chosen!r}: a dict of bucket to names or None "
                                "was expected")
        variants: dict[int, tuple[str, ...]] = {}
        for bucket, names in chosen.items():
            if bucket not in self.graph_attention:
                raise BcgStateError(f"bcg_graph_variants named bucket {bucket!r}, whose attention is not inside "
                                    "the graph; only those buckets may have variants")
            names = tuple(names)
            if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
                raise BcgStateError(f"bcg_graph_variants gave bucket {bucket} {list(names)!r}: distinct, "
                                    "non-empty names were expected")
            if names:
                variants[bucket] = names
        blind = self._dummy_batch_without("variant")
        if variants and blind:
            raise BcgStateError(f"bcg_graph_variants named variants, but bcg_dummy_batch of {', '.join(blind)} "
                                "takes no variant argument (pluggy passes none that has a default), so it cannot "
                                "build their capture batch")
        return variants

    def _fallback_stream(self) -> torch.cuda.Stream:
        """The capture stream for hosts that name none: ``torch.cuda.graph``'s own, else one for the runner's life.

        Every stream that runs a matmul pins its own cuBLAS workspace (32 MiB on Hopper) until the
        process ends, so a stream per capture would leave one behind for each estimate or recapture,
        and a stream beside the one the host's own graphs are captured on pins one more.
        """
        if self._fallback_capture_stream is None:
            self._fallback_capture_stream = default_capture_stream(self.device) or torch.cuda.Stream(device=self.device)
        return self._fallback_capture_stream

    def _static_buffer(self, name: str, spec: StaticInput, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of the host's buffer for input ``name``, or a new padded one."""
        buf = spec.host_buffer
        if buf is None:
            return torch.full((rows, *spec.row_shape), spec.pad, dtype=spec.dtype, device=self.device)
        problems = spec.buffer_problems(buf, self.device, rows)
        if problems:
            raise BcgConfigError(f"bcg_static_inputs: host_buffer of input {name!r} has {'; '.join(problems)}; "
                                 "declare a matching buffer or none (the core then allocates one)")
        return buf[:rows]

    def _capture_buckets(self, buckets: list[int], stream: torch.cuda.Stream, group: Any, progress: bool,
                         after_each: Callable[[], None] | None) -> None:
        ordered = sorted(buckets, reverse=True)
        every = self.config.warmup == "every_bucket"
        # The first capture of each kind runs its kernels eagerly first: of buckets with attention
        # breaking and with it inside the graph (other kernels and plans; under "auto" the largest
        # buckets, captured first, break), and of each variant.
        inside_warmed: set[bool] = set()
        warmed: set[str] = set()
        for bucket in tqdm(ordered, desc="bcg capture", unit="bucket", disable=not progress, leave=False):
            inside = bucket in self.graph_attention
            self._graphs[bucket] = self._capture_agreed(bucket, stream, group,
                                                        warm=inside not in inside_warmed or every)
            inside_warmed.add(inside)
            for name in self.graph_variants.get(bucket, ()):
                graph = self._capture_variant(bucket, name, stream, group, warm=name not in warmed or every)
                if graph is not None:
                    self._variant_graphs[(bucket, name)] = graph
                    warmed.add(name)
            if after_each is not None:
                after_each()

    def _capture_variant(self, bucket: int, name: str, stream: torch.cuda.Stream, group: Any, *,
                         warm: bool) -> SegmentedGraph | None:
        """Capture variant ``name`` of ``bucket`` as :meth:`_capture_agreed` captures a bucket, or, where
        that failed on any rank for a reason other than out of memory, drop variant ``name`` from
        every bucket on every rank and return ``None``: a variant serves some of a bucket's steps,
        which without it replay as they would without that variant, so its failure must not leave
        prefill eager. Another variant plans another kernel (or none, :data:`BREAKING`), so it stays."""
        graph = self._capture_agreed(bucket, stream, group, warm=warm, variant=name)
        if graph is not None:
            return graph
        for key in [key for key in self._variant_graphs if key[1] == name]:
            self._variant_graphs.pop(key).release()
        kept = {b: tuple(n for n in names if n != name) for b, names in self.graph_variants.items()}
        self.graph_variants = {b: names for b, names in kept.items() if names}
        return None

    def _capture_agreed(self, bucket: int, stream: torch.cuda.Stream, group: Any, *, warm: bool,
                        variant: str | None = None) -> SegmentedGraph | None:
        """Capture one bucket (or its ``variant``), then agree on the outcome with every rank before the next one.

        A warm-up runs the body's collectives eagerly, so no rank may start one that another rank
        (stopped by a failure) will never join: the ranks agree on the dummy batch (whose attention
        plan may allocate) before any warm-up, and every rank stops at the same bucket. A capture that
        failed on any rank, not for want of memory, is retried by every rank after a warm-up where
        it had none, and a variant's is given up (``None``), once the ranks have agreed that every
        device still runs work: after a sticky CUDA error a rank cannot join the warm-up's
        collectives or the next bucket's. Every branch follows the statuses the ranks agreed on, so
        every rank makes the same collective calls.
        """
        batch, world, error = _agreed(lambda: self._stage_bucket(bucket, variant), group)
        graph = None
        staged = world is CaptureStatus.OK
        if staged:
            graph, world, error = _agreed(lambda: self._capture_bucket(bucket, batch, stream, warm=warm,
                                                                       variant=variant), group)
        if world is CaptureStatus.OK:
            return graph
        if graph is not None:
            graph.release()
        retry = staged and not warm  # a warm-up can mend a capture, not a dummy batch that failed
        if world is CaptureStatus.FAILED and (variant is not None or retry):
            lost = error is not None and self._device_lost(error, "capture") is not None
            if agree_capture_status(CaptureStatus.FAILED if lost else CaptureStatus.OK, group) is CaptureStatus.OK:
                why = repr(error) if error is not None else "on another rank"
                if error is not None:
                    traceback.clear_frames(error.__traceback__)
                if retry:
                    logger.info("bcg: bucket %d%s did not capture without a warm-up (%s); recapturing it after one",
                                bucket, "" if variant is None else f" (variant {variant!r})", why)
                    return self._capture_agreed(bucket, stream, group, warm=True, variant=variant)
                logger.warning("bcg: graph variant %r of bucket %d did not capture (%s); every rank drops that "
                               "variant from every bucket, and the steps it would serve replay as without it",
                               variant, bucket, why)
                return None
        if error is not None:
            raise error
        raise _PeerCaptureFailure(world)

    def _stage_bucket(self, bucket: int, variant: str | None = None) -> HostBatch:
        """The host's dummy batch for ``bucket`` (or its ``variant``), landed in the static inputs."""
        batch: HostBatch = self._hook.bcg_dummy_batch(
            num_tokens=bucket, graph_attention=self.attention_inside(bucket, variant), variant=variant)
        if batch is None or batch.num_tokens != bucket:
            raise BcgStateError(f"bcg_dummy_batch(num_tokens={bucket}) must return a HostBatch of {bucket} rows")
        self._land(batch, bucket)
        return batch

    def attention_inside(self, bucket: int, variant: str | None = None) -> bool:
        """Whether ``bucket``'s graph (or its ``variant``) is captured with attention inside it: the
        host lands such a step's attention metadata into the buffers that graph reads, and plans
        any other for the live break."""
        return bucket in self.graph_attention and variant != BREAKING

    def breaks_attention(self, bucket: int) -> bool:
        """Whether ``bucket`` has a graph whose attention breaks (its own, or its
        :data:`~bcg_plugin.hookspecs.BREAKING` variant): one that replays any batch of its token
        count, whatever the graph-resident metadata was sized for."""
        return bucket not in self.graph_attention or BREAKING in self.graph_variants.get(bucket, ())

    def _capture_bucket(self, bucket: int, batch: HostBatch, stream: torch.cuda.Stream, *,
                        warm: bool = True, variant: str | None = None) -> SegmentedGraph:
        inline = self.attention_inside(bucket, variant)
        views = {name: buf[:bucket] for name, buf in self._static.items()}
        forward = self._hook.bcg_body_forward
        with live.bound(live.LiveBatch(bucket, bucket, batch.payload)):
            if warm:
                self._warm_up(forward, views, batch, stream)
            elif self._output is None:
                raise BcgStateError("the first bucket must be captured after a warm-up (it sizes the output)")
            out = self._output[:bucket]
            graph, _ = capture_segments(
                lambda: out.copy_(forward(inputs=views, payload=batch.payload)), pool=self._pool, stream=stream,
                scrub=self._padded.scrub(bucket), inline_breaks=inline,
            )
        return graph

    def _warm_up(self, forward: Any, views: dict[str, torch.Tensor], batch: HostBatch,
                 stream: torch.cuda.Stream) -> None:
        start = time.perf_counter()
        with torch.cuda.stream(stream):  # lazy inits and autotuning stay out of the graph
            warm = forward(inputs=views, payload=batch.payload)
        stream.synchronize()  # timed to completion: a GPU-bound warm-up would bill the capture
        self.stats.warmup_seconds += time.perf_counter() - start
        if self._output is None:
            with self._pool.allocating():
                self._output = torch.empty((self.buckets[-1], *warm.shape[1:]), dtype=warm.dtype, device=self.device)

    # -- replay --------------------------------------------------------------------------------

    def bucket_for(
        self,
        num_tokens: int,
        *,
        num_tokens_across_dp: list[int] | None = None,
        all_ranks_extend: bool = True,
    ) -> int | None:
        """The bucket to replay ``num_tokens`` in, or ``None`` (eager; the reason is counted).

        With data parallelism pass the host's replicated ``num_tokens_across_dp`` and whether
        every rank runs an extend: every rank then gets the same answer.
        """
        if not self._graphs:
            if self._capture_failed:
                self.stats.record_fallback(Fallback.CAPTURE_FAILED)
            return None
        if num_tokens_across_dp is not None:
            bucket = dp_bucket(self.buckets, num_tokens_across_dp, all_ranks_extend)
            if bucket is None:
                reason = Fallback.DP_DISAGREEMENT if not all_ranks_extend else Fallback.OVER_TOP_BUCKET
                self.stats.record_fallback(reason)
                return None
            num_tokens = max(num_tokens_across_dp)
        else:
            bucket = choose_bucket(self.buckets, num_tokens)
            if bucket is None:
                self.stats.record_fallback(Fallback.OVER_TOP_BUCKET)
                return None
        if not padding_allows(bucket, num_tokens, self.config.max_padding_ratio):
            self.stats.record_fallback(Fallback.PADDING_RATIO)
            return None
        return bucket

    def record_fallback(self, reason: Fallback) -> None:
        """Count an eager forward the adapter decided on (e.g. a feature the graphs do not capture)."""
        self.stats.record_fallback(reason)

    def replay(self, bucket: int, batch: HostBatch, variant: str | None = None) -> Any:
        """Land ``batch`` in ``bucket``'s inputs, replay its segments and breaks (or those of its
        graph ``variant``), run the logits tail."""
        graph = self._graphs.get(bucket)
        if graph is None:
            raise BcgStateError(f"no graph for bucket {bucket}; pick buckets with bucket_for()")
        if variant is not None:
            graph = self._variant_graphs.get((bucket, variant))
            if graph is None:
                raise BcgStateError(f"bucket {bucket} has no graph variant {variant!r} "
                                    f"(it has {list(self.graph_variants.get(bucket, ())) or 'none'})")
        if not 0 < batch.num_tokens <= bucket:
            raise BcgStateError(f"a batch of {batch.num_tokens} tokens cannot replay in bucket {bucket}")
        if self._embed is not None:
            embedded = self._embed(batch=batch)
            if embedded:
                batch.inputs = {**batch.inputs, **embedded}
        self._land(batch, bucket)
        scrub_start = self._padded.start(bucket)
        with live.bound(live.LiveBatch(batch.num_tokens, bucket, batch.payload, scrub_start)):
            graph.replay(breaks_zero_padding=batch.num_tokens < scrub_start)
        requested = batch.num_tokens if batch.requested_tokens is None else batch.requested_tokens
        self.stats.record_replay(bucket, requested, variant)
        hidden = self._output[: batch.num_tokens]
        tail = self._logits_tail(hidden=hidden, batch=batch) if self._logits_tail is not None else None
        return hidden if tail is None else tail

    def _land(self, batch: HostBatch, bucket: int) -> None:
        n = batch.num_tokens
        for name, buf in self._static.items():
            src = batch.inputs.get(name)
            if src is None:
                raise BcgStateError(f"batch has no input {name!r}; the adapter declared it in bcg_static_inputs")
            if src.data_ptr() != buf.data_ptr() or src.stride() != buf.stride():  # else already in place
                buf[:n].copy_(src[:n], non_blocking=True)
            if n < bucket:
                buf[n:bucket].fill_(self._pads[name])
        self._padded.flag(bucket, n)

    # -- teardown ------------------------------------------------------------------------------

    @property
    def pool_bytes(self) -> int:
        """What the graphs' pool holds now (the capture's whole device cost is ``stats.graph_bytes``)."""
        return self._pool.reserved_bytes() if self._pool is not None else 0

    def close(self) -> None:
        """Drop graphs, then the buffers they point at, then the pool (pitfall 10)."""
        self.graph_attention = frozenset()
        self.graph_variants = {}
        for graph in (*self._variant_graphs.values(), *self._graphs.values()):
            graph.release()
        self._variant_graphs.clear()
        self._graphs.clear()
        self._static.clear()
        self._padded = None
        self._output = None
        if self._pool is not None:
            self._pool.release()
        self._pool = None


def attention_summary(buckets: list[int], graph_attention: frozenset[int] | set[int],
                      variants: dict[int, tuple[str, ...]] | None = None) -> str:
    """Where each bucket's attention runs, and the variants graph buckets are also captured as,
    as the capture summary and ``bcg doctor`` print it."""

    def sizes(group: list[int]) -> str:
        if not group:
            return "none"
        if len(group) == 1:
            return f"{group[0]} (1 bucket)"
        start = buckets.index(group[0])
        run = buckets[start:start + len(group)] == group  # else a range would claim the buckets between
        return f"{group[0]}..{group[-1]} ({len(group)} buckets)" if run else ", ".join(map(str, group))

    inside = [b for b in buckets if b in graph_attention]
    broken = [b for b in buckets if b not in graph_attention]
    summary = f"attention inside the graph: {sizes(inside)}; eager break: {sizes(broken)}"
    variants = variants or {}
    for name in sorted({n for names in variants.values() for n in names}):
        also = "also with attention breaking" if name == BREAKING else "also as"
        summary += f"; {also} {name!r}: {sizes([b for b in buckets if name in variants.get(b, ())])}"
    return summary
