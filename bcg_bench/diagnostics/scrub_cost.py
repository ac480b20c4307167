"""Diagnostic: what the in-graph zeroing of padded rows costs a vLLM forward that fits a bucket.

Run from the repository root on a CUDA machine with vLLM installed:
``python3 -m bcg_bench.diagnostics.scrub_cost [--rounds 3] [--sizes 16,64,256,512] [--mode bcg]``.
Each bcg bucket whose attention breaks zeroes the padded rows of every attention output after the
break (28 small ``masked_fill`` nodes a forward for Qwen3-0.6B), even when the batch fills the
bucket and nothing is padded; buckets that keep attention inside the graph have no such nodes. This
runs a bench bcg mode process (``bcg_bench.vllm_mode``; ``--mode``, plain ``bcg`` by default, or
e.g. ``bcg_compile``) alternately as it is and with ``EXP_NO_SCRUB`` (``sitecustomize.py`` in this
folder: buckets captured without those nodes), ``--rounds`` times, the order reversed every round,
and prints each process's forward device time (CUDA events), forward host time and end-to-end
latency per N, then the median over rounds of the paired ratio without / with the zeroing. Every N
given must be a bucket size: without the zeroing, padded rows would carry garbage.
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from bcg_bench import harness, hostspeed
from bcg_bench.report import environment
from bcg_bench.vllm_mode import BCG_MODES

HERE = Path(__file__).resolve().parent
VARIANTS = ("scrub", "no_scrub")
KEYS = ("forward_ms", "forward_host_ms", "e2e_ms")


def run_variant(variant: str, sizes: list[int], model: str, timeout_s: float, mode: str = "bcg") -> dict:
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    if variant == "no_scrub":
        os.environ["EXP_NO_SCRUB"] = "1"
    try:
        return harness.run_mode("vllm", mode, model, sizes, timeout_s)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="16,64,256,512")
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--mode", default="bcg", choices=sorted(BCG_MODES), help="the bench's bcg mode to run")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    env = environment()
    print(f"# {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}: bcg with and without "
          f"the in-graph zeroing of padded rows, {args.mode} mode, {args.model}, N = {sizes}, "
          f"{args.rounds} rounds", flush=True)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            data = run_variant(variant, sizes, args.model, args.timeout, args.mode)
            if "error" in data:
                print(f"round {r + 1} {variant}: {data['error']}\n{data.get('log_tail', '')}", flush=True)
                sys.exit(1)
            runs[variant].append(data)
            probe = (data.get("host_speed") or {}).get("probe_us")
            cells = "; ".join(f"{key} " + " ".join(f"{data[key][str(n)]:.2f}" for n in sizes) for key in KEYS)
            print(f"round {r + 1} {variant}: host probe {probe} us; {cells}", flush=True)
    fastest = hostspeed.fastest_probe_us([d.get("host_speed") for v in VARIANTS for d in runs[v]])
    flagged = [(v, i + 1) for v in VARIANTS for i, d in enumerate(runs[v])
               if hostspeed.is_slow(d.get("host_speed"), fastest)]
    print(f"processes flagged slow by the host probe: {flagged or 'none'}")
    print("\n| N | " + " | ".join(f"{key} no_scrub / scrub (median of {args.rounds} pairs)" for key in KEYS) + " |")
    print("|---|" + "---|" * len(KEYS))
    for n in sizes:
        cells = []
        for key in KEYS:
            ratios = [b[key][str(n)] / a[key][str(n)] for a, b in zip(runs["scrub"], runs["no_scrub"])]
            cells.append(f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
        print(f"| {n} | " + " | ".join(cells) + " |")
    print(json.dumps({"env": env, "sizes": sizes, "runs": {v: [{k: d.get(k) for k in (*KEYS, "host_speed")}
                                                              for d in runs[v]] for v in VARIANTS}}))


if __name__ == "__main__":
    main()
