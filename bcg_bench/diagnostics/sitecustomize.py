"""Diagnostics for bcg's graph memory and replay cost in ``bcg bench vllm``, loaded into every mode process.

Put this folder first on ``PYTHONPATH`` and set:

* ``EXP_POOL_DUMP=1``: after bcg's capture, write what it cost the device (free memory around it,
  both sides after ``empty_cache``), how much of that torch's caching allocator holds, and the
  pool's segments. The part the allocator does not hold is the driver's memory for the captured
  graphs themselves.
* ``EXP_SHARED_POOL=1``: bcg captures into vLLM's global graph pool instead of its own, to measure
  what sharing it would save. Not a supported setting: NOTES.md (section 1) explains why bcg keeps
  its own pool.
* ``EXP_POOL_RESERVE=1``: bcg's pool is a ``torch.cuda.MemPool`` and, after the first (largest)
  bucket's warm-up, one segment of that warm-up's peak activation size is reserved in it on the
  capture stream, so the captures split one block instead of adding a segment per tensor shape:
  measures what fragmentation costs. Not a supported setting.
* ``EXP_SEGMENT_DUMP=1``: record allocation stacks during bcg's capture and, after it and
  ``empty_cache``, list the segments it added outside its pool: size, stream, and each block still
  allocated in them with the code that allocated it. Says what keeps that memory from being released.
* ``EXP_NO_SCRUB=1``: bcg captures its buckets without the in-graph zeroing of padded rows after
  each break, to measure what those nodes cost a forward whose token count is a bucket's. Padded
  rows then carry garbage: not a supported setting, and only for timing batches that fit a bucket.
* ``EXP_REPLAY_TIMER=1``: time every ``torch.cuda.CUDAGraph.replay`` call on the host (both bcg's
  segments and vLLM's own breakable and FULL graphs replay through it) and, at exit, write the
  count and the per-call median, mean and 90th percentile in microseconds with the process's
  command line: how much of a forward's host time the graph launches take, mode by mode. The
  wrapper itself costs every graph mode the same few tenths of a microsecond a call.
* ``EXP_LOG=path``: append the lines to ``path`` as well (the bench keeps a mode's stderr only when
  it fails).
"""

import importlib.abc
import importlib.util
import os
import sys


def _say(msg):
    path = os.environ.get("EXP_LOG")
    if path:
        with open(path, "a") as f:
            print(msg, file=f)
    print(msg, file=sys.stderr, flush=True)


def _patch_runner():
    import bcg_plugin.pool as pool
    import bcg_plugin.runner as runner

    if os.environ.get("EXP_NO_SCRUB"):
        import bcg_plugin.padding as padding

        padding.PaddedRows.scrub = lambda self, bucket: None
        _say("EXP_NO_SCRUB: bcg's graphs do not zero padded rows")
    if os.environ.get("EXP_SHARED_POOL"):
        init = pool.GraphPool.__init__

        def shared_init(self):
            init(self)
            from vllm.platforms import current_platform

            self.handle = current_platform.get_global_graph_pool()
            _say("EXP_SHARED_POOL: bcg captures into vLLM's global pool")

        pool.GraphPool.__init__ = shared_init
    if os.environ.get("EXP_POOL_RESERVE"):
        import torch

        init, warm_up = pool.GraphPool.__init__, runner.PrefillGraphRunner._warm_up

        def mempool_init(self):
            init(self)
            self.mempool = torch.cuda.MemPool()
            self.handle = self.mempool.id

        def reserving_warm_up(self, forward, views, batch, stream):
            first = self._output is None
            if first:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            warm_up(self, forward, views, batch, stream)
            if first:
                peak = torch.cuda.max_memory_allocated() - base
                size = -(-peak // (2 << 20)) * (2 << 20)
                with torch.cuda.stream(stream), torch.cuda.use_mem_pool(self._pool.mempool):
                    block = torch.empty(size, dtype=torch.uint8, device=self.device)
                del block
                _say(f"EXP_POOL_RESERVE: warm-up peak {peak / 2**20:.1f} MiB; reserved one {size >> 20} MiB segment "
                     f"(pool segments MiB {[s['total_size'] >> 20 for s in self._pool.segments()]})")

        pool.GraphPool.__init__ = mempool_init
        runner.PrefillGraphRunner._warm_up = reserving_warm_up
    if os.environ.get("EXP_POOL_DUMP"):
        capture = runner.PrefillGraphRunner.capture

        def dumping_capture(self, *args, **kwargs):
            import torch

            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free0, res0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
            capture(self, *args, **kwargs)
            torch.cuda.synchronize()
            res1 = torch.cuda.memory_reserved()
            torch.cuda.empty_cache()
            free1, res2 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
            segs = self._pool.segments() if self._pool else []
            total = sum(s["total_size"] for s in segs)
            allocated = sum(s["allocated_size"] for s in segs)
            sizes = sorted((s["total_size"] >> 20 for s in segs), reverse=True)
            _say(f"EXP_POOL_DUMP: free-memory delta after empty_cache {(free0 - free1) / 2**30:.3f} GiB; "
                 f"allocator reserved +{(res1 - res0) / 2**30:.3f} GiB, after empty_cache +{(res2 - res0) / 2**30:.3f} GiB; "
                 f"pool {len(segs)} segments reserved {total / 2**30:.3f} GiB allocated {allocated / 2**30:.3f} GiB; "
                 f"segment MiB {sizes[:40]}; "
                 f"output {None if self._output is None else tuple(self._output.shape)}; "
                 f"static {[(n, tuple(b.shape), b.dtype) for n, b in self._static.items()]}")

        runner.PrefillGraphRunner.capture = dumping_capture
    if os.environ.get("EXP_SEGMENT_DUMP"):
        inner = runner.PrefillGraphRunner.capture

        def _where(frames):
            ours = [f for f in frames if any(k in f["filename"] for k in ("bcg_plugin", "adapters", "/vllm/"))]
            return " <- ".join(f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
                               for f in ours[:4]) or "?"

        def segment_dumping_capture(self, *args, **kwargs):
            import torch

            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = {s["address"] for s in torch.cuda.memory_snapshot()}
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                     max_entries=200000)
            try:
                inner(self, *args, **kwargs)
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                snap = torch.cuda.memory._snapshot()
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
            try:
                _dump_new_segments(self, snap, before)
            except Exception as e:  # a diagnostic must not fail the capture it reports on
                _say(f"EXP_SEGMENT_DUMP failed: {e!r}")

        def _dump_new_segments(self, snap, before):
            pool = tuple(self._pool.handle) if self._pool else None
            new = [s for s in snap["segments"] if s["address"] not in before]
            outside = [s for s in new if tuple(s.get("segment_pool_id", ())) != pool]
            _say(f"EXP_SEGMENT_DUMP: {len(new)} new segments, {len(outside)} outside bcg's pool "
                 f"({sum(s['total_size'] for s in outside) / 2**20:.1f} MiB; pool id {pool})")
            for s in sorted(outside, key=lambda s: -s["total_size"]):
                live = [b for b in s["blocks"] if b["state"] == "active_allocated"]
                _say(f"  segment {s['total_size'] / 2**20:.1f} MiB stream {s['stream']} pool {s.get('segment_pool_id')} "
                     f"allocated {s['allocated_size'] / 2**20:.2f} MiB in {len(live)} blocks; "
                     f"made by {_where(s.get('frames', []))}")
                for b in sorted(live, key=lambda b: -b["size"])[:6]:
                    _say(f"    block {b['size'] / 2**20:.3f} MiB (requested {b.get('requested_size', 0) / 2**20:.3f}) "
                         f"by {_where(b.get('frames', []))}")

        runner.PrefillGraphRunner.capture = segment_dumping_capture


def _patch_graph_replay(graphs):
    import atexit
    import time

    calls = []
    replay = graphs.CUDAGraph.replay

    def timed_replay(self):
        t0 = time.perf_counter_ns()
        replay(self)
        calls.append(time.perf_counter_ns() - t0)

    def report():
        if not calls:
            return
        us = sorted(c / 1e3 for c in calls)
        _say(f"EXP_REPLAY_TIMER: {' '.join(sys.argv[1:])!r}: {len(us)} replays, per call median "
             f"{us[len(us) // 2]:.2f} us, mean {sum(us) / len(us):.2f} us, p90 {us[int(len(us) * 0.9)]:.2f} us")

    graphs.CUDAGraph.replay = timed_replay
    atexit.register(report)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after module ``name`` is first imported (and then leaves the import path)."""

    def __init__(self, name, patch):
        self.name = name
        self.patch = patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


if any(os.environ.get(k) for k in ("EXP_SHARED_POOL", "EXP_POOL_DUMP", "EXP_POOL_RESERVE", "EXP_SEGMENT_DUMP",
                                        "EXP_NO_SCRUB")):
    sys.meta_path.insert(0, _AfterImport("bcg_plugin.runner", lambda module: _patch_runner()))
if os.environ.get("EXP_REPLAY_TIMER"):
    sys.meta_path.insert(0, _AfterImport("torch.cuda.graphs", _patch_graph_replay))
