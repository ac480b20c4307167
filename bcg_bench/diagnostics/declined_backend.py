"""Diagnostic: an engine bcg declines runs as fast as vLLM without the plugin.

Run from the repository root on the GPU host, with the vLLM bundle's environment::

    python -m bcg_bench.diagnostics.declined_backend --out $OUT/declined-backend.json

Engines on one GPU, the same model (Qwen3-0.6B shape, dummy weights), the FLEX_ATTENTION backend
(pure PyTorch, which bcg does not break at) and vLLM's defaults otherwise (-O2: torch.compile,
FULL_AND_PIECEWISE graphs):

* ``plain``: vLLM with no plugin loaded (``VLLM_PLUGINS`` names none);
* ``bcg``: the plugin loaded and ``additional_config={"bcg": {"enable": true}}``; bcg declines the
  backend at the front-end, so the engine must compile and capture exactly as ``plain``;
* ``forced`` (the negative control, ``--no-control`` leaves it out): ``plain`` with
  ``cudagraph_mode=FULL_DECODE_ONLY``, the flags the front-end used to set before deciding whether bcg
  runs: prefill eager, vLLM's piecewise graphs gone. The ratio check must catch it.

Each engine lives in its own process (started one after another: each checks at its start that its
share of the GPU's memory is free) and serves the driver's requests; the driver measures every size in every engine, interleaved,
over ``--rounds`` rounds (the engine order rotates each round). One measurement: the median
end-to-end ``LLM.generate`` time of ``--reps`` requests of N prompt tokens and one output token
(prefix cache off). Per size and round the paired ratio mode/plain; the result is the median of those
ratios over rounds. Written as JSON: date, GPU, torch and vLLM versions, model shape, each engine's
final compilation config, every round's medians, the ratios and the verdict (``bcg`` within
``--tolerance`` of ``plain`` at every size; the control beyond it at some size, else the check could
not tell the two apart). Sized to finish within about 4 minutes on an H200, the three engines' start-ups
first among its costs (``--no-control`` drops one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

MARK = "@@bcg-declined@@ "  # prefixes the engine's replies on stdout, among vLLM's own log lines
MODES = {
    "plain": {"plugins": "", "kwargs": {}},
    "bcg": {"plugins": "bcg", "kwargs": {"additional_config": {"bcg": {"enable": True}}}},
    "forced": {"plugins": "", "kwargs": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}},
}
BACKEND = "FLEX_ATTENTION"
ENGINE_START_TIMEOUT_S = 300  # a cold torch.compile of the model plus FLEX's kernels
MEASURE_TIMEOUT_S = 120  # one size's requests, FLEX's kernels for a new shape included


# -- one engine (its own process) -----------------------------------------------------------------


def serve(mode: str, model: str, chunk: int, memory: float) -> None:
    """Start ``mode``'s engine, report its final config, then answer ``N reps warmup`` lines on stdin."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine runs here: its config is readable
    os.environ["VLLM_PLUGINS"] = MODES[mode]["plugins"]
    from vllm import LLM, SamplingParams

    from bcg_bench.models import model_dir

    if mode == "bcg":  # whether or not the entry point is installed in this environment
        from bcg_plugin.adapters.vllm import plugin

        plugin.register()
    llm = LLM(model=str(model_dir(model)), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=chunk + 64, max_num_batched_tokens=chunk, seed=0, enable_prefix_caching=False,
              gpu_memory_utilization=memory, attention_backend=BACKEND, **MODES[mode]["kwargs"])
    config = llm.llm_engine.vllm_config
    cc = config.compilation_config
    info = {"mode": cc.mode.name, "cudagraph_mode": cc.cudagraph_mode.name,
            "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or []),
            "attention_backend": getattr(config.attention_config.backend, "name", None),
            "additional_config": config.additional_config}
    ready = {"ready": True, "compilation": info}
    if mode == "bcg":  # declined at the front-end: the workers never install the runner patches
        from bcg_plugin.adapters.vllm import plugin

        ready["bcg_runner_patches_applied"] = bool(plugin.STATE.runner_patches)
    _reply(ready)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        n, reps, warmup = map(int, words)
        times = []
        for i in range(warmup + reps):
            prompt = {"prompt_token_ids": [rng.randint(100, 150_000) for _ in range(n)]}
            t0 = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        _reply({"n": n, "median_ms": statistics.median(times), "ms": times})


def _reply(payload: dict) -> None:
    print(MARK + json.dumps(payload), flush=True)


# -- the driver -----------------------------------------------------------------------------------


class Engine:
    """One engine process, its request pipe, and a thread passing its stdout on (replies to the driver,
    vLLM's log lines to stderr), so a silent engine times out instead of blocking the driver."""

    def __init__(self, mode: str, args: argparse.Namespace, command: list[str] | None = None,
                 start_timeout_s: float = ENGINE_START_TIMEOUT_S):
        self.mode = mode
        command = command or [sys.executable, "-m", "bcg_bench.diagnostics.declined_backend", "--serve", mode,
                              "--model", args.model, "--chunk", str(args.chunk), "--memory", str(args.memory)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr,
                                     text=True, bufsize=1)
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self.ready = self._read(start_timeout_s)
            self.compilation = self.ready["compilation"]
        except BaseException:
            self.close()
            raise

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.replies.put(json.loads(line[len(MARK):]))
            else:
                sys.stderr.write(f"[{self.mode}] {line}")
        self.replies.put(None)  # the engine's stdout closed: it exited

    def _read(self, timeout_s: float) -> dict:
        try:
            reply = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            reply = None
        if reply is None:
            raise RuntimeError(f"engine {self.mode!r} did not answer within {timeout_s:.0f} s "
                               f"(exit code {self.proc.poll()})")
        return reply

    def measure(self, n: int, reps: int, warmup: int) -> float:
        self.proc.stdin.write(f"{n} {reps} {warmup}\n")
        self.proc.stdin.flush()
        return self._read(MEASURE_TIMEOUT_S)["median_ms"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def environment() -> dict:
    import torch

    from bcg_plugin.versions import installed_version

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "vllm": installed_version("vllm"),
            "bcg_plugin": installed_version("bcg-plugin")}


def verdict(ratios: dict[str, dict[str, float]], tolerance: float) -> dict:
    """``bcg`` within ``tolerance`` of ``plain`` at every size; the control beyond it somewhere."""
    worst = max(abs(r - 1.0) for r in ratios["bcg"].values())
    out = {"tolerance": tolerance, "bcg_worst_deviation": worst, "bcg_as_fast_as_plain": worst <= tolerance}
    if "forced" in ratios:
        slowest = max(ratios["forced"].values())
        out.update(control_slowest_ratio=slowest, control_detected=slowest > 1.0 + tolerance)
    return out


def drive(args: argparse.Namespace, engine=Engine) -> dict:
    sizes = [int(s) for s in args.sizes.split(",") if s]
    modes = ["plain", "bcg"] + ([] if args.no_control else ["forced"])
    from bcg_bench.models import shape_summary

    result = {**environment(), "model": shape_summary(args.model), "attention_backend": BACKEND,
              "max_num_batched_tokens": args.chunk, "sizes": sizes, "rounds": args.rounds, "reps": args.reps,
              "measure": "median end-to-end LLM.generate ms, N prompt tokens, 1 output token, prefix cache off"}
    engines: dict[str, Engine] = {}
    try:
        for mode in modes:  # one after another: each checks its share of memory is free as it starts
            engines[mode] = engine(mode, args)
        result["compilation"] = {m: e.compilation for m, e in engines.items()}
        result["bcg_runner_patches_applied"] = engines["bcg"].ready.get("bcg_runner_patches_applied")
        medians: list[dict[str, dict[str, float]]] = []
        for r in range(args.rounds):
            order = modes[r % len(modes):] + modes[: r % len(modes)]
            warmup = args.warmup * (2 if r == 0 else 1)  # round 0 also meets FLEX's kernels per shape
            this = {m: {} for m in modes}
            for n in sizes:
                for mode in order:
                    this[mode][str(n)] = engines[mode].measure(n, args.reps, warmup)
            medians.append(this)
            print(f"round {r}: " + json.dumps(this), file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    result["round_medians_ms"] = medians
    ratios = {m: {str(n): statistics.median(rnd[m][str(n)] / rnd["plain"][str(n)] for rnd in medians) for n in sizes}
              for m in modes if m != "plain"}
    result["ratio_to_plain"] = ratios
    result["same_compilation_as_plain"] = {
        m: {k: v for k, v in c.items() if k != "additional_config"}
        == {k: v for k, v in result["compilation"]["plain"].items() if k != "additional_config"}
        for m, c in result["compilation"].items() if m != "plain"}
    result["verdict"] = {**verdict(ratios, args.tolerance),
                         "bcg_same_compilation_as_plain": result["same_compilation_as_plain"]["bcg"]}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="the result JSON (required unless --serve)")
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--sizes", default="16,64,256,512,2048")
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--memory", type=float, default=0.25, help="gpu_memory_utilization of each engine")
    p.add_argument("--tolerance", type=float, default=0.05, help="how far bcg's ratio to plain may be from 1")
    p.add_argument("--no-control", action="store_true", help="leave out the forced-flags engine")
    p.add_argument("--serve", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.model, args.chunk, args.memory)
        return 0
    if args.out is None:
        p.error("--out is required")
    result = drive(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({"ratio_to_plain": result["ratio_to_plain"], "verdict": result["verdict"],
                      "same_compilation_as_plain": result["same_compilation_as_plain"]}, indent=2))
    v = result["verdict"]
    return 0 if v["bcg_as_fast_as_plain"] and v["bcg_same_compilation_as_plain"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
