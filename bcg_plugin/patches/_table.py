"""``patches/README.md``, rendered from the patch descriptors so the table cannot drift from the code."""

from __future__ import annotations

import importlib
from pathlib import Path

from bcg_plugin.versions import UNTESTED_ENV, format_range

README_PATH = Path(__file__).resolve().parent / "README.md"
HOST_PACKAGES = ("bcg_plugin.patches.vllm", "bcg_plugin.patches.sglang")
COLUMNS = ("Module", "Target", "Set", "Reason", "Host versions", "Upstream", "Remove when")

_INTRO = """\
# What bcg-plugin patches in its host engines

Generated from the patch descriptors (`PATCH` in each `bcg_plugin/patches/<host>/<symbol>.py`) by
`python -m bcg_plugin.patches --write`; edit the descriptors, not this file.

One module per patched host symbol. Every target is verified (it resolves, its signature has the
parameters the patch relies on) before anything of its set is applied, and a set is applied all or
nothing: on any problem nothing of it stays in force and the plugin stays off with one warning.
Patches import nothing of the adapters; the adapter hands each one the functions it calls."""

_OUTRO = """\
The benchmark (`bcg_bench`) wraps further host symbols in its own mode processes only, never through
the plugin; they are not listed here."""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _section(package: str) -> list[str]:
    host = importlib.import_module(package)
    lines = [
        f"## {host.TITLE}",
        "",
        f"Supported: `{host.HOST}` `{format_range(host.GATE.supported)}` (releases {', '.join(host.GATE.releases)}), "
        "checked with `packaging` before anything is patched; each release gets the descriptors whose range holds it. "
        f"A newer release runs only with `{UNTESTED_ENV}=1`, with the newest release's descriptors, named untested "
        "in its warning.",
        "",
        host.NOTES,
        "",
        "Sets, each verified in full before any of it is applied:",
        "",
        *[f"* **{s.name}**: {s.when}" for s in host.SETS],
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for patch_set in host.SETS:
        for p in patch_set.patches:
            module = p.module.rpartition(".")[2]
            cells = [f"`{module}.py`", f"`{p.target}`; {p.how.describe()}", patch_set.name, p.reason, f"`{p.hosts}`",
                     p.upstream, p.remove_when]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def readme() -> str:
    """The whole of ``patches/README.md``."""
    lines = [_INTRO, ""]
    for package in HOST_PACKAGES:
        lines += [*_section(package), ""]
    lines.append(_OUTRO)
    return "\n".join(lines) + "\n"
