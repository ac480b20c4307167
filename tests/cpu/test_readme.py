"""The README promises only what works: every ``bcg`` command it names exists, every relative link
resolves (anchors included), every Python and JSON snippet parses, CI runs its set-up commands,
and it stays short enough for a newcomer to read through.

The markdown helpers here are shared with ``test_docs.py``, which applies them to ``docs/*.md``."""

from __future__ import annotations

import ast
import contextlib
import io
import itertools
import json
import re
import shlex
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI_SCRIPT = ROOT / ".ci" / "run"
# A newcomer reads the README top to bottom; detail belongs in docs/.
MAX_README_LINES = 200

_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|<img\b[^>]*\bsrc=\"([^\"]+)\"")
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
_SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
# A subcommand word, or a brace group naming several (`bench {micro,vllm}`).
_WORD = re.compile(r"^(?:[a-z][a-z0-9-]*|\{[a-z0-9,-]+\})$")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text outside fenced code blocks, where links and headings live."""
    return _FENCE.sub("", text)


def slug(title: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to '-'."""
    title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "")
    title = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return title.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(prose(text)):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(text: str) -> list[str]:
    targets = [a or b for a, b in _LINK.findall(prose(text))]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def broken_links(path: Path) -> list[str]:
    """Each relative link of a markdown file whose file, or whose anchor in a markdown file, is missing."""
    text = path.read_text()
    broken = []
    for target in relative_links(text):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return broken


def snippet_errors(text: str) -> list[str]:
    """Each Python block that does not parse, and each JSON block or quoted JSON argument that does not load."""
    errors = []
    for lang, body in code_blocks(text):
        if lang in ("python", "py"):
            try:
                ast.parse(body)
            except SyntaxError as e:
                errors.append(f"python snippet, line {e.lineno}: {e.msg}: {body.strip()[:60]!r}")
        elif lang == "json":
            errors.extend(_json_error(body))
        elif lang in _SHELL_LANGS:
            for arg in re.findall(r"'(\{.*?\})'", body):
                errors.extend(_json_error(arg))
    for span in _INLINE_CODE.findall(prose(text)):
        if span.startswith("{") and span.endswith("}") and '"' in span:
            errors.extend(_json_error(span))
    return errors


def _json_error(snippet: str) -> list[str]:
    try:
        json.loads(snippet)
    except json.JSONDecodeError as e:
        return [f"JSON snippet {snippet.strip()[:60]!r}: {e}"]
    return []


def bcg_commands(text: str) -> list[tuple[str, ...]]:
    """The ``bcg`` invocations a page names, in code blocks and inline code, reduced to what the CLI
    must know: the subcommand words (brace groups expanded), or a lone top-level flag. Arguments
    after the words (paths, options, placeholders) are the subcommand's own business."""
    lines = [line for lang, body in code_blocks(text) if lang in _SHELL_LANGS for line in body.splitlines()]
    lines += _INLINE_CODE.findall(prose(text))
    found: list[tuple[str, ...]] = []
    for line in lines:
        for segment in re.split(r"&&|\|\||;|\|", line):
            try:
                tokens = shlex.split(segment, comments=True)
            except ValueError:
                continue
            if tokens[:1] == ["$"]:
                tokens = tokens[1:]
            if tokens[:1] != ["bcg"]:
                continue
            rest = tokens[1:]
            if not rest:
                continue  # a bare `bcg` names the program (or the benchmark mode), not a command
            if rest[0].startswith("-"):
                found.append((rest[0],))
                continue
            words = list(itertools.takewhile(_WORD.match, rest))
            choices = [w[1:-1].split(",") if w.startswith("{") else [w] for w in words]
            found.extend(tuple(path) for path in itertools.product(*choices))
    return sorted(set(found))


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``bcg ARGV`` in this process, the checkout's CLI: (exit status, what it printed)."""
    from bcg_plugin import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = cli.main(list(argv))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return int(rc or 0), out.getvalue()


def cli_check(command: tuple[str, ...]) -> str | None:
    """None when the CLI knows the command, else why not. Subcommands must answer ``--help``."""
    argv = list(command) if command[0].startswith("-") else [*command, "--help"]
    rc, output = run_cli(argv)
    if rc != 0:
        return f"`bcg {' '.join(argv)}` exited {rc}: {output.strip()[-300:]}"
    if command == ("--version",):
        from bcg_plugin import __version__

        if __version__ not in output:
            return f"`bcg --version` printed {output.strip()!r}, not the version {__version__}"
    return None


README_TEXT = README.read_text()


def test_readme_is_short():
    lines = len(README_TEXT.splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_readme_links_resolve():
    assert relative_links(README_TEXT), "no relative links found: the link parser is broken"
    assert broken_links(README) == []


def test_readme_snippets_parse():
    langs = [lang for lang, _ in code_blocks(README_TEXT)]
    assert "python" in langs, "the README's Python snippets were not found"
    assert snippet_errors(README_TEXT) == []


@pytest.mark.parametrize("command", bcg_commands(README_TEXT), ids=" ".join)
def test_readme_bcg_command_exists(command):
    assert cli_check(command) is None


def test_readme_names_the_cli_it_documents():
    named = set(bcg_commands(README_TEXT))
    for command in [("doctor",), ("config-reference",), ("--help",), ("--version",), ("bench", "micro"),
                    ("bench", "vllm"), ("bench", "sglang"), ("bench", "report")]:
        assert command in named, f"the README does not name `bcg {' '.join(command)}`"


def _setup_commands() -> list[str]:
    """The README's install and test commands: the code block of its Tests section."""
    section = README_TEXT.split("\n## Tests", 1)[1].split("\n## ", 1)[0]
    body = next(body for lang, body in code_blocks(section) if lang in _SHELL_LANGS)
    return [line.split("#", 1)[0].strip() for line in body.splitlines() if line.strip()]


def test_ci_runs_the_readme_setup_commands_in_order():
    commands = _setup_commands()
    assert any(c.startswith("pip install") for c in commands) and any("pytest" in c for c in commands)
    ci = [line.strip() for line in CI_SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#")]
    positions = [next((i for i, line in enumerate(ci) if command in line), None) for command in commands]
    assert None not in positions, f".ci/run does not run every README set-up command: {commands}"
    assert positions == sorted(positions), ".ci/run runs the README's set-up commands out of order"


def test_a_run_names_the_modules_it_skipped_in_one_line(pytester):
    """The README promises that a run without a host engine says what it skipped, and why."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(
        test_whole="import pytest\npytest.importorskip('bcg_no_such_host')\ndef test_a(): pass\n",
        test_part="import pytest\ndef test_b():\n    pytest.importorskip('bcg_no_such_host')\n"
                  "def test_c():\n    pytest.importorskip('bcg_no_such_host')\ndef test_d(): pass\n",
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=3)
    lines = [line for line in result.outlines if line.startswith("skipped modules")]
    assert lines == ["skipped modules, by reason: bcg_no_such_host not installed: "
                     "test_part.py (2 tests), test_whole.py (whole module)"]


# The checkers above must be able to fail: each one is shown a page with the fault it looks for.
BAD_PAGE = """# Title

See [missing](no/such/file.md), [bad anchor](#nowhere) and [good](#title).

```python
LLM(model=..., additional_config={"bcg": {"enable": True}
```

```json
{"bcg": {"enable": true,}}
```

```bash
vllm serve MODEL --additional-config '{"bcg": {enable: true}}'
bcg no-such-command --flag
bcg bench {micro,nope} --out x
```

Then `bcg --version`.
"""


def test_checkers_catch_what_they_look_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(BAD_PAGE)
    assert broken_links(page) == ["no/such/file.md: no such file", "#nowhere: no heading with anchor #nowhere in page.md"]
    errors = snippet_errors(BAD_PAGE)
    assert len(errors) == 3 and errors[0].startswith("python snippet")
    assert bcg_commands(BAD_PAGE) == [("--version",), ("bench", "micro"), ("bench", "nope"), ("no-such-command",)]
    assert cli_check(("no-such-command",)) is not None
    assert cli_check(("bench", "nope")) is not None


def test_slugs_follow_githubs_rules():
    assert slug("vLLM 0.26.0, Qwen3-0.6B shape") == "vllm-0260-qwen3-06b-shape"
    assert slug("Pitfalls the runtime guards against") == "pitfalls-the-runtime-guards-against"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
