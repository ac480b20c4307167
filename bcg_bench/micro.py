"""Micro-benchmark of the core runtime on the reference decoder: eager vs bcg vs the full-graph floor.

All modes run in one process on the same weights and batches, so the ratios are what to read:
``eager`` (no graphs), ``bcg`` (segments with attention as eager breaks, the 2048 ladder, one graph
per bucket serving any mix), ``floor`` (the whole forward captured as one CUDA graph with attention
inside, for one fixed batch: the best any prefill graph could do). Also reported: capture seconds
per bucket, graph memory, and the host cost of one eager break.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from bcg_plugin import BcgConfig, PrefillGraphRunner, live, plugin_manager
from bcg_bench.report import environment, run_stamp, write_markdown
from bcg_plugin.breaks import eager_break
from bcg_plugin.capture import capture_segments
from bcg_plugin.pool import GraphPool
from bcg_plugin.testing import QWEN3_0_6B, ToyAdapter, ToyDecoder

SIZES = [16, 64, 256, 512, 1024, 2048]
TOP = 2048
TARGETS = {
    "ours_over_floor_at_n_ge_512": 1.15,
    "eager_over_ours_at_16": 3.0,
    "host_us_per_break": 15.0,
    "capture_s_per_bucket": 0.1,
}


def _median_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _floor_graph(model: ToyDecoder, ids: torch.Tensor, positions: torch.Tensor, meta):
    """The whole forward (embedding, attention, everything) as one graph for this exact batch."""
    n = ids.shape[0]
    static_ids = ids.clone()
    with live.bound(live.LiveBatch(n, n, meta)):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model.body(model.embed_ids(static_ids), positions)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=pool):
            model.body(model.embed_ids(static_ids), positions)
    graph_bytes = sum(s["total_size"] for s in torch.cuda.memory_snapshot(pool, include_traces=False))

    def replay():
        static_ids.copy_(ids)
        graph.replay()

    return replay, graph_bytes


def host_cost_per_break(breaks: int = 64, kernels_per_segment: int = 4, iters: int = 200) -> dict:
    """Replay time of a graph with ``breaks`` trivial eager breaks minus the same graph with none."""
    x = torch.zeros(1024, device="cuda")

    @eager_break
    def trivial(t):
        pass

    def body(with_breaks: bool):
        for _ in range(breaks):
            for _ in range(kernels_per_segment):
                x.add_(1)
            if with_breaks:
                trivial(x)

    results = {}
    for label, with_breaks in (("none", False), ("breaks", True)):
        pool = GraphPool()
        graph, _ = capture_segments(lambda: body(with_breaks), pool=pool, stream=torch.cuda.Stream())
        with live.bound(live.LiveBatch(1, 1, None)):
            results[label] = _median_ms(graph.replay, iters)
        graph.release()
    per_break_us = (results["breaks"] - results["none"]) * 1e3 / breaks
    return {"breaks": breaks, "replay_ms_without_breaks": results["none"],
            "replay_ms_with_breaks": results["breaks"], "host_us_per_break": per_break_us}


def run(sizes: list[int], iters: int) -> dict:
    model = ToyDecoder(QWEN3_0_6B, kv_slots=2 * TOP + max(sizes), device="cuda")
    adapter = ToyAdapter(model)
    runner = PrefillGraphRunner(plugin_manager(adapter), BcgConfig(enable=True), chunk_size=TOP)
    runner.capture(progress=False)
    out: dict = {"eager_ms": {}, "bcg_ms": {}, "floor_ms": {}, "floor_graph_mem_gib": {}}
    for n in sizes:
        seqs = [(TOP, 0, n)]  # one fresh prefill of n tokens, outside the capture dummy region
        ids = torch.randint(0, model.shape.vocab, (n,), device="cuda")
        positions = model.positions(seqs)
        batch = adapter.batch(ids, seqs)
        bucket = runner.bucket_for(n)
        out["eager_ms"][n] = _median_ms(lambda: model.forward_eager(ids, positions, batch.payload), iters)
        out["bcg_ms"][n] = _median_ms(lambda: runner.replay(bucket, batch), iters)
        floor, floor_bytes = _floor_graph(model, ids, positions, batch.payload)
        out["floor_ms"][n] = _median_ms(floor, iters)
        out["floor_graph_mem_gib"][n] = floor_bytes / 2**30
        del floor
    out["buckets"] = len(runner.buckets)
    out["capture_s"] = runner.stats.capture_seconds
    out["capture_s_per_bucket"] = runner.stats.capture_seconds / len(runner.buckets)
    out["warmup_s"] = runner.stats.warmup_seconds
    out["bcg_graph_mem_gib"] = runner.stats.pool_bytes / 2**30  # pool to pool: the floor's figure is its pool
    runner.close()
    out["host_cost"] = host_cost_per_break()
    out["ours_over_floor"] = {n: out["bcg_ms"][n] / out["floor_ms"][n] for n in sizes}
    out["eager_over_ours"] = {n: out["eager_ms"][n] / out["bcg_ms"][n] for n in sizes}
    big = [n for n in sizes if n >= 512]
    out["targets"] = {
        "ours_over_floor_at_n_ge_512": {"target": TARGETS["ours_over_floor_at_n_ge_512"],
                                        "worst": max(out["ours_over_floor"][n] for n in big)},
        "eager_over_ours_at_16": {"target": TARGETS["eager_over_ours_at_16"], "value": out["eager_over_ours"].get(16)},
        "host_us_per_break": {"target": TARGETS["host_us_per_break"], "value": out["host_cost"]["host_us_per_break"]},
        "capture_s_per_bucket": {"target": TARGETS["capture_s_per_bucket"], "value": out["capture_s_per_bucket"]},
    }
    t = out["targets"]
    t["ours_over_floor_at_n_ge_512"]["met"] = t["ours_over_floor_at_n_ge_512"]["worst"] <= TARGETS["ours_over_floor_at_n_ge_512"]
    t["eager_over_ours_at_16"]["met"] = (t["eager_over_ours_at_16"]["value"] or 0) >= TARGETS["eager_over_ours_at_16"]
    t["host_us_per_break"]["met"] = t["host_us_per_break"]["value"] <= TARGETS["host_us_per_break"]
    t["capture_s_per_bucket"]["met"] = t["capture_s_per_bucket"]["value"] <= TARGETS["capture_s_per_bucket"]
    return out


def to_markdown(result: dict) -> str:
    r = result["results"]  # as read back from JSON: N keys are strings
    sizes = sorted(int(n) for n in r["bcg_ms"])
    lines = [
        f"# bcg micro-benchmark: reference decoder ({result['model']['name']}, bf16)",
        "",
        f"{result['env']['date']} on {result['env']['gpu']}, torch {result['env']['torch']} (CUDA {result['env']['cuda']}). "
        "Median wall ms per forward (host launch + GPU, synchronised), all modes in one process.",
        "",
        "| N | eager ms | bcg ms | floor ms | eager/bcg | bcg/floor |",
        "|---|---|---|---|---|---|",
    ]
    for n in sizes:
        k = str(n)
        lines.append(
            f"| {n} | {r['eager_ms'][k]:.3f} | {r['bcg_ms'][k]:.3f} | {r['floor_ms'][k]:.3f} | "
            f"{r['eager_over_ours'][k]:.2f} | {r['ours_over_floor'][k]:.3f} |"
        )
    hc = r["host_cost"]
    lines += [
        "",
        f"- bcg ladder: {r['buckets']} buckets to {TOP}, captured in {r['capture_s']:.2f} s "
        f"({r['capture_s_per_bucket'] * 1e3:.1f} ms per bucket), graph memory {r['bcg_graph_mem_gib'] * 1024:.1f} MiB "
        f"for all buckets (floor, one fixed N={sizes[-1]} batch: {r['floor_graph_mem_gib'][str(sizes[-1])] * 1024:.1f} MiB).",
        f"- host cost of one eager break: {hc['host_us_per_break']:.2f} us "
        f"({hc['breaks']} trivial breaks: {hc['replay_ms_with_breaks']:.3f} ms vs {hc['replay_ms_without_breaks']:.3f} ms without).",
        "",
        "| target | value | met |",
        "|---|---|---|",
    ]
    for name, t in r["targets"].items():
        value = t.get("worst", t.get("value"))
        lines.append(f"| {name} (target {t['target']}) | {value:.3f} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def write(out: Path, sizes: list[int], iters: int) -> Path:
    """Run the micro-benchmark on this process's GPU; write ``micro-<date>.json`` and ``.md`` under
    ``out``; return the markdown's path."""
    result = {"benchmark": "micro", "env": environment(),
              "model": {"name": "qwen3-0.6b-shaped", **QWEN3_0_6B.to_dict()}, "dtype": "bfloat16",
              "results": run(sizes, iters)}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"micro-{run_stamp(result['env']['date'])}.json"
    path.write_text(json.dumps(result, indent=2))
    return render(path)[0]


def render(path: Path) -> list[Path]:
    """Write the markdown report of a micro result JSON beside it; return what was written."""
    md = path.with_suffix(".md")
    write_markdown(md, to_markdown(json.loads(path.read_text())))
    return [md]
