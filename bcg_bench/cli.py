"""``bcg bench micro|vllm|sglang|report``: the benchmark's commands under the ``bcg`` command.

:func:`add_commands` fills in ``bcg bench``'s parser; the ``bcg`` command imports this module only
for ``bcg bench ...``. Importing it loads neither torch, matplotlib, psutil nor a host engine, so
``bcg bench --help`` works anywhere. Each command then checks what it needs before anything runs:
the bench extra's packages, the host engine, a GPU (enough of them for ``--tp``/``--dp``).
Bad input ends in one line on stderr and exit status 2 (argparse's), a command that cannot run here
in one line and exit status 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from bcg_bench import harness
from bcg_bench.models import MODELS
from bcg_bench.report import INSTALL_BENCH
from bcg_plugin.cli import CommandError

# The bench extra's packages each command imports (in its own process or in the mode processes).
EXTRA_NEEDS = {"micro": (), "vllm": ("matplotlib", "psutil"), "sglang": ("matplotlib", "psutil"),
               "report": ("matplotlib",)}
RESULT_KEYS = {  # what ``bcg bench report`` reads of each kind of result file
    "engine": ("engine", "engine_version", "model", "sizes", "modes", "date", "gpu", "env"),
    "micro": ("env", "model", "results"),
}


def add_commands(bench: argparse.ArgumentParser) -> None:
    """Add ``micro``, ``vllm``, ``sglang`` and ``report`` to ``bcg bench``'s parser."""
    sub = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")

    micro = sub.add_parser("micro", help="the core runtime on a pure-PyTorch Qwen3-0.6B-shaped decoder (one GPU)",
                           description="Micro-benchmark of the core runtime: eager vs bcg vs a full-graph floor, "
                                       "all in this process, on the reference decoder.")
    micro.add_argument("--sizes", type=_sizes, default=[16, 64, 256, 512, 1024, 2048],
                       help="prompt token counts, comma-separated (default: 16,64,256,512,1024,2048)")
    micro.add_argument("--iters", type=_at_least(1), default=30, help="timed forwards per size and mode")
    micro.add_argument("--out", type=Path, required=True, help="directory for micro-<date>.json and .md")
    micro.set_defaults(run=_micro, parser=micro)

    for engine, spec in harness.ENGINES.items():
        p = sub.add_parser(engine, help=f"modes {', '.join(spec['modes'])} of {engine}, each in its own process",
                           description=f"Benchmark prefill graphs in {engine}: every mode in its own process, "
                                       "one result file (JSON, markdown report, plots) for the run.")
        p.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.6b",
                       help="model shape (dummy weights, no download)")
        p.add_argument("--sizes", type=_sizes, default=list(harness.DEFAULT_SIZES),
                       help="prompt token counts, comma-separated (default: %s)"
                       % ",".join(map(str, harness.DEFAULT_SIZES)))
        defaults = list(spec.get("default_modes", spec["modes"]))
        p.add_argument("--modes", type=_modes(engine), default=defaults,
                       help=f"comma-separated, from {','.join(spec['modes'])} (default: "
                            f"{'all' if defaults == spec['modes'] else ','.join(defaults)})")
        p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="directory for the result files")
        # A machine's first engine starts may compile attention kernels for minutes, and the limit
        # is there to end a hung process, not a slow first start.
        p.add_argument("--timeout", type=_positive_seconds, default=900.0, help="seconds per mode process")
        p.add_argument("--rounds", type=_at_least(1), default=1,
                       help="run every mode this many times, alternating the order; report the per-N minimum")
        p.add_argument("--tp", type=_at_least(1), default=1, help="tensor-parallel size of every mode's engine")
        p.add_argument("--dp", type=_at_least(1), default=1,
                       help="data-parallel size (SGLang: DP attention, which needs --tp divisible by --dp; "
                            "vLLM: one process per DP rank, MoE models only)")
        p.add_argument("--profile", type=_at_least(1), default=None, metavar="N",
                       help="after the timed requests, profile the forward of one N-token request per mode with "
                            "torch.profiler, at the size the mode runs it (a padded N includes the padding's "
                            "work; vLLM: tp=1 and dp=1 only)")
        p.add_argument("--rerun-slow", type=_at_least(0), default=0, metavar="K",
                       help="run a mode process again, up to K times, when its host-speed probe is flagged slow "
                            "against the fastest process so far; the replaced processes stay in the result file")
        if spec.get("attention_backends"):
            backends = spec["attention_backends"]
            p.add_argument("--attention-backend", choices=backends, default=backends[0],
                           help=f"every mode's attention backend (default: {backends[0]}); SGLang's full prefill "
                                "graphs need one that captures extend batches, which 0.5.23's triton does not")
        p.set_defaults(run=_engine, parser=p, engine=engine, attention_backend=None)

    report = sub.add_parser("report", help="redraw the markdown report (and plots) of result files",
                            description="Redraw the markdown report and plots beside result JSON files written by "
                                        "bcg bench vllm|sglang|micro.")
    report.add_argument("results", nargs="+", type=Path, metavar="RESULT.json")
    report.set_defaults(run=_report, parser=report)


# -- argument types (argparse turns their ArgumentTypeError into one line naming the option) --------


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected token counts >= 1 separated by commas, such as 16,64,2048; "
                                         f"got {text!r}")
    return sorted(set(sizes))


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}")
        return value

    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _modes(engine: str) -> Callable[[str], list[str]]:
    known = harness.ENGINES[engine]["modes"]

    def parse(text: str) -> list[str]:
        modes = [m.strip() for m in text.split(",") if m.strip()]
        unknown = [m for m in modes if m not in known]
        if unknown or not modes:
            raise argparse.ArgumentTypeError(f"unknown {engine} mode(s) {', '.join(unknown) or repr(text)}; "
                                             f"choose from {', '.join(known)}")
        twice = sorted({m for m in modes if modes.count(m) > 1})
        if twice:
            raise argparse.ArgumentTypeError(f"mode(s) {', '.join(twice)} given twice; use --rounds to repeat modes")
        return modes

    return parse


# -- what a command needs before it runs ----------------------------------------------------------


def require_extra(command: str) -> None:
    missing = [name for name in EXTRA_NEEDS[command] if importlib.util.find_spec(name) is None]
    if missing:
        raise CommandError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed "
                           f"(the bench extra): {INSTALL_BENCH}")


def require_engine(engine: str) -> None:
    if importlib.util.find_spec(harness.ENGINES[engine]["package"]) is None:
        raise CommandError(f"{engine} is not installed: pip install \".[{engine}]\" from a checkout "
                           f"(once published: pip install \"bcg-plugin[{engine}]\")")


def require_gpus(count: int, layout: str) -> None:
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise CommandError("no CUDA device is visible (torch.cuda.is_available() is false); the benchmark needs a GPU")
    if visible < count:
        raise CommandError(f"{layout} needs {count} GPUs, {visible} visible")


def _writable_dir(out: Path, parser: argparse.ArgumentParser) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"cannot create the output directory {out}: {e.strerror}")
    if not os.access(out, os.W_OK):
        parser.error(f"cannot write to the output directory {out}")


# -- the commands -----------------------------------------------------------------------------------


def _micro(args: argparse.Namespace) -> int:
    require_extra("micro")
    _writable_dir(args.out, args.parser)
    require_gpus(1, "bcg bench micro")
    from bcg_bench import micro

    print(micro.write(args.out, args.sizes, args.iters).read_text())
    return 0


def _engine(args: argparse.Namespace) -> int:
    engine, parser = args.engine, args.parser
    if engine == "sglang" and args.dp > 1 and args.tp % args.dp:
        parser.error(f"SGLang's DP attention needs --tp divisible by --dp (got --tp {args.tp} --dp {args.dp})")
    if engine == "vllm" and args.dp > 1 and "num_experts" not in MODELS[args.model]:
        parser.error(f"vLLM's data parallelism serves MoE models only; --model {args.model} is dense "
                     f"(use one of {', '.join(m for m, c in MODELS.items() if 'num_experts' in c)}, or --dp 1)")
    if engine == "vllm" and args.profile and (args.tp > 1 or args.dp > 1):
        parser.error(f"--profile with vllm needs --tp 1 --dp 1 (got --tp {args.tp} --dp {args.dp}): the profiler "
                     "runs in the engine's own process; profile on one GPU, or use sglang, which profiles every rank")
    require_extra(engine)
    require_engine(engine)
    _writable_dir(args.out, parser)
    # SGLang's DP attention splits the tensor-parallel group; vLLM's DP ranks each hold a TP group.
    gpus = args.tp * (args.dp if engine == "vllm" else 1)
    require_gpus(gpus, f"--tp {args.tp} --dp {args.dp}")
    path = harness.run(engine, args.model, args.sizes, args.modes, args.out, args.timeout, args.rounds,
                       tp=args.tp, dp=args.dp, profile_tokens=args.profile, rerun_slow=args.rerun_slow,
                       attention_backend=args.attention_backend)
    print(path.with_name(path.name[: -len(".json")] + ".md").read_text())  # written by render()
    result = json.loads(path.read_text())
    failure = harness.first_failure(result)
    if not any("e2e_ms" in d for d in result["modes"].values()):
        raise CommandError(f"every mode failed (results: {path}); the first: {failure}")
    if failure:
        print(f"{parser.prog}: some modes failed (see the report); the first: {failure}", file=sys.stderr)
    return 0


def _report(args: argparse.Namespace) -> int:
    kinds = [load_result(path, args.parser) for path in args.results]  # every file checked before any is drawn
    if "engine" in kinds:  # a micro result's report has no plots
        require_extra("report")
    for path, kind in zip(args.results, kinds):
        try:
            if kind == "micro":
                from bcg_bench import micro

                written = micro.render(path)
            else:
                written = harness.render(path)
        except KeyError as e:
            args.parser.error(f"{path} is not a complete bcg bench result: it lacks the key {e}")
        except (TypeError, ValueError, AttributeError, IndexError) as e:  # a field of another shape, most likely
            args.parser.error(f"cannot draw {path} ({type(e).__name__}: {e}); a field may have a shape bcg bench "
                              "does not write: was the file changed?")
        for p in written:
            print(p)
    return 0


def load_result(path: Path, parser: argparse.ArgumentParser) -> str:
    """``path``'s kind of bench result (``engine`` or ``micro``); any other file is a usage error."""
    if path.is_dir():
        parser.error(f"{path} is a directory: name one result file in it (bcg bench writes <engine>-...-<date>.json)")
    if not path.is_file():
        parser.error(f"no such result file: {path}")
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        parser.error(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})")
    except (UnicodeDecodeError, OSError) as e:
        parser.error(f"cannot read {path}: {e}")
    written_by = "bcg bench report reads the files bcg bench vllm|sglang|micro write"
    if not isinstance(result, dict) or "benchmark" not in result:
        parser.error(f"{path} is not a bcg bench result: it has no 'benchmark' field ({written_by})")
    kind = result["benchmark"]
    if kind not in RESULT_KEYS:
        parser.error(f"{path} has 'benchmark': {kind!r}, which bcg bench does not write (its results say "
                     f"{' or '.join(repr(k) for k in RESULT_KEYS)}; {written_by})")
    missing = [k for k in RESULT_KEYS[kind] if k not in result]
    if missing or (kind == "engine" and not isinstance(result["modes"], dict)):
        parser.error(f"{path} is not a complete bcg bench result: it lacks {', '.join(missing) or 'its modes'}")
    return kind
