"""The ``bcg`` command: ``bcg doctor``, ``bcg bench micro|vllm|sglang``, ``bcg config-reference``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _bench(argv: list[str]) -> int:
    if argv and argv[0] == "report":
        from bcg_bench import harness

        ap = argparse.ArgumentParser(prog="bcg bench report",
                                     description="Redraw the markdown report and plots beside result JSON files.")
        ap.add_argument("results", nargs="+", type=Path, help="result JSON written by bcg bench vllm|sglang")
        a = ap.parse_args(argv[1:])
        missing = [str(p) for p in a.results if not p.is_file()]
        if missing:
            ap.error(f"no such result file: {', '.join(missing)}")
        for path in a.results:
            for written in harness.render(path):
                print(written)
        return 0
    if argv and argv[0] == "micro":
        from bcg_bench import micro

        return micro.main(argv[1:])
    from bcg_bench import harness

    ap = argparse.ArgumentParser(prog="bcg bench", description="Benchmark prefill graphs in a host engine.")
    ap.add_argument("engine", choices=["micro", *harness.ENGINES])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--sizes", default=",".join(map(str, harness.DEFAULT_SIZES)))
    ap.add_argument("--modes", default=None, help="comma-separated; default: every mode of the engine")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per mode")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every mode this many times, alternating the order; report the per-N minimum")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every mode's engine")
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel size (SGLang: DP attention, which needs --tp >= --dp; "
                         "vLLM: one process per DP rank, MoE models only)")
    ap.add_argument("--profile", type=int, default=None, metavar="N",
                    help="after the timed requests, profile the forward of one N-token request per mode with "
                         "torch.profiler, at the size the mode runs it (a padded N includes the padding's "
                         "work; vLLM: tp=1 and dp=1 only)")
    ap.add_argument("--rerun-slow", type=int, default=0, metavar="K",
                    help="run a mode process again, up to K times, when its host-speed probe is flagged slow "
                         "against the fastest process so far; the replaced processes stay in the result file")
    a = ap.parse_args(argv)
    modes = a.modes.split(",") if a.modes else harness.ENGINES[a.engine]["modes"]
    path = harness.run(a.engine, a.model, [int(s) for s in a.sizes.split(",")], modes, Path(a.out), a.timeout,
                       a.rounds, tp=a.tp, dp=a.dp, profile_tokens=a.profile, rerun_slow=a.rerun_slow)
    print(path.parent.joinpath(path.name[: -len(".json")] + ".md").read_text())  # written by render()
    return 0


def _config_reference(argv: list[str]) -> int:
    from bcg_plugin.config import reference_markdown

    sys.stdout.write(reference_markdown())
    return 0


def _doctor(argv: list[str]) -> int:
    from bcg_plugin import doctor

    ap = argparse.ArgumentParser(prog="bcg doctor", description="Check hosts, patch targets, GPU and configuration.")
    ap.add_argument("--config", default=None, help="the JSON given to vLLM as additional_config['bcg'] (default: none); "
                    "SGLang reads the BCG_* environment, which doctor checks for it")
    ap.add_argument("--engine", action="append", choices=sorted(doctor.HOST_ENTRY_POINTS),
                    help="check only this host (repeatable); default: all")
    a = ap.parse_args(argv)
    return doctor.run(a.config, a.engine or sorted(doctor.HOST_ENTRY_POINTS))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"bench": _bench, "config-reference": _config_reference, "doctor": _doctor}
    if not argv or argv[0] not in commands:
        print("usage: bcg {doctor | bench {micro,vllm,sglang} [options] | bench report RESULT.json... | config-reference}", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
