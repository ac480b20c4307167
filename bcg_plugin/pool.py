"""The one private memory pool every prefill bucket captures into."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# What torch.cuda.use_mem_pool calls, taking a pool id rather than a MemPool (see GraphPool).
_begin_routing = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
_end_routing = getattr(torch._C, "_cuda_endAllocateToPool", None)
_release = getattr(torch._C, "_cuda_releasePool", None)
if _end_routing is None or _release is None:  # pragma: no cover - all three come together
    _begin_routing = None


def free_device_bytes(device: torch.device) -> int:
    """Free memory on ``device`` once its queued work is done and the allocator's idle cache is
    returned: what is left is what live tensors, pools and the driver hold."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


class GraphPool:
    """A CUDA-graph memory pool shared by all buckets of one runner.

    One pool for every bucket (never per segment: pitfall 5) and never the host's decode
    pool: kernels that cache raw workspace pointers from decode capture get corrupted when
    prefill captures re-carve those blocks. Buckets are self-contained graphs replayed one at a
    time, so blocks freed inside one bucket's capture may be reused by the next; whatever must
    outlive a bucket (inputs, outputs, out-of-pool break arguments) is held by a live reference.

    The runner's own long-lived buffers (the static inputs it allocates, the padded-row flags, the
    shared output) are allocated in the pool as well (:meth:`allocating`), as blocks that stay
    live: a capture never reuses a live block, and the free rest of their segments serves the
    captures' activations. Allocated outside, on the capture stream that nothing else allocates on,
    each would pin a segment of its own: a 4 MiB output holds a 20 MiB segment.

    Allocations are routed with the calls ``torch.cuda.use_mem_pool`` makes, not with a
    ``torch.cuda.MemPool``: a MemPool's destructor empties its pool under an internal assert
    that no capture is routing allocations anywhere, and torch 2.11 leaves such a routing behind
    after a capture that fails at ``cudaStreamEndCapture`` (:meth:`end_failed_capture` closes it,
    but any other routing left open would do the same). Closing a runner then would abort the
    process instead of falling back to eager. A graph pool is freed the way
    graphs free theirs: when its last user releases it, by the allocator's next ``empty_cache``.
    """

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self._device = torch.cuda.current_device()
        self._held = False  # the reference the first allocating() takes, released by release()
        self._ranges: list[tuple[int, int]] = []
        self._outside: set[int] = set()

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """This thread's allocations inside the block land in the pool: for buffers that outlive every
        bucket. Where torch lacks the routing calls, they land where they would have anyway."""
        if _begin_routing is None:
            yield
            return
        _begin_routing(self._device, self.handle)  # creates the pool, or takes a reference to it
        try:
            yield
        finally:
            _end_routing(self._device, self.handle)
            if self._held:
                _release(self._device, self.handle)
            self._held = True

    def release(self) -> None:
        """Drop the pool's reference that :meth:`allocating` holds; call once its buffers and graphs are gone."""
        if self._held:
            self._held = False
            _release(self._device, self.handle)

    def end_failed_capture(self) -> None:
        """Undo what a capture into this pool that failed in ``cudaStreamEndCapture`` left behind.

        torch 2.11 raises there before it stops routing the capture's allocations to the pool and
        before the capture counts as ended, so resetting the graph does not drop the reference its
        ``capture_begin`` took. The routing lingers, and while any routing is open the allocator's
        ``empty_cache`` returns nothing to the device, for the whole process (a freed 1 GiB tensor
        stayed cached); the pool, never released, keeps its segments. Each lingering routing of
        this pool is ended here and its reference dropped; a capture that failed elsewhere left none.
        """
        if _begin_routing is None:
            return
        while True:
            try:
                _end_routing(self._device, self.handle)
            except RuntimeError:  # "not currently recording to" this pool: nothing (more) lingers
                return
            _release(self._device, self.handle)

    def segments(self) -> list[dict]:
        return torch.cuda.memory_snapshot(self.handle, include_traces=False)

    def reserved_bytes(self) -> int:
        """Device memory the pool holds: the graphs' intermediates, as the allocator sees them. The
        driver's memory for the captured graphs themselves is not in it."""
        return sum(s["total_size"] for s in self.segments())

    def contains(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage lies in this pool.

        Snapshots are taken only when an address is unknown: the pool only grows while it is
        captured into, and an address once seen outside cannot join the pool while its tensor
        lives. A stale "outside" answer after the address is reused only makes a caller hold a
        tensor it did not need to: never the unsafe way round.
        """
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._outside:
            return False
        if self._within(ptr):
            return True
        self._ranges = [(s["address"], s["address"] + s["total_size"]) for s in self.segments()]
        if self._within(ptr):
            return True
        self._outside.add(ptr)
        return False

    def _within(self, ptr: int) -> bool:
        return any(lo <= ptr < hi for lo, hi in self._ranges)
