"""The ``bcg`` command: ``bcg doctor``, ``bcg config-reference`` and ``bcg bench ...``.

``bcg bench`` is the benchmark, a package of its own (the ``bench`` extra) that adds its commands
through the ``bcg.commands`` entry-point group, loaded only when ``bcg bench`` is asked for: the
runtime never imports the benchmark, and ``bcg --help``, ``bcg --version`` and ``bcg
config-reference`` import neither it nor torch.

Bad input ends in one line on stderr, ``PROG: error: ...``, and exit status 2 (argparse's); a
command that cannot run here (a missing package, no GPU) in one line and exit status 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys


COMMANDS_GROUP = "bcg.commands"  # entry points adding subcommands: name -> add_commands(subparser)


class Parser(argparse.ArgumentParser):
    """argparse's parser, reporting bad input on one line (argparse's own prints the usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class CommandError(Exception):
    """Why a command cannot run here (a missing package or GPU): printed as one line, exit status 1."""


def version() -> str:
    """The installed distribution's version; the package's own when run from a checkout not installed."""
    try:
        return importlib.metadata.version("bcg-plugin")
    except importlib.metadata.PackageNotFoundError:
        from bcg_plugin import __version__

        return __version__


def build_parser(argv: list[str]) -> Parser:
    """The ``bcg`` parser; ``bcg bench``'s own commands are added only when ``argv`` asks for them."""
    from bcg_plugin.doctor import HOST_ENTRY_POINTS

    parser = Parser(prog="bcg", description="Breakable CUDA graphs for prefill in vLLM and SGLang.")
    parser.add_argument("--version", action="version", version=f"bcg-plugin {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    doctor = sub.add_parser("doctor", help="check hosts, patch targets, GPU and configuration",
                            description="Check the installed hosts, every patch target, the GPU and the "
                                        "configuration bcg would run with.")
    doctor.add_argument("--config", default=None, help="the JSON given to the engine (vLLM additional_config['bcg']); "
                        "default: the BCG_* environment")
    doctor.add_argument("--engine", action="append", choices=sorted(HOST_ENTRY_POINTS),
                        help="check only this host (repeatable); default: all")
    doctor.set_defaults(run=_doctor, parser=doctor)

    reference = sub.add_parser("config-reference", help="print the configuration reference (markdown)",
                               description="Print every configuration key, its type, default, environment "
                                           "variable and meaning, as markdown (docs/configuration.md).")
    reference.set_defaults(run=_config_reference, parser=reference)

    bench = sub.add_parser("bench", help="benchmark bcg: micro, vllm, sglang, report (the bench extra)",
                           description="Benchmark bcg against each host's own modes (needs the bench extra: "
                                       "pip install \".[bench]\" from a checkout).")
    if argv[:1] == ["bench"]:
        add_commands = [ep for ep in importlib.metadata.entry_points(group=COMMANDS_GROUP) if ep.name == "bench"]
        if not add_commands:
            parser.exit(1, "bcg bench: error: the benchmark is not installed; install it with "
                           "pip install \".[bench]\" from a checkout (once published: pip install \"bcg-plugin[bench]\")\n")
        add_commands[0].load()(bench)
    return parser


def _doctor(args: argparse.Namespace) -> int:
    from bcg_plugin import doctor
    from bcg_plugin.config import BcgConfig
    from bcg_plugin.errors import BcgConfigError

    if args.config is not None:
        try:
            BcgConfig.from_json(args.config, source="--config")
        except BcgConfigError as e:
            args.parser.error(str(e))
    return doctor.run(args.config, args.engine or sorted(doctor.HOST_ENTRY_POINTS))


def _config_reference(args: argparse.Namespace) -> int:
    from bcg_plugin.config import reference_markdown

    sys.stdout.write(reference_markdown())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return args.run(args)
    except CommandError as e:
        print(f"{args.parser.prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{args.parser.prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Through the imported module, not this __main__ copy of it: the bench raises bcg_plugin.cli's CommandError.
    from bcg_plugin.cli import main as _main

    raise SystemExit(_main())
