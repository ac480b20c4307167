"""docs/: the configuration reference is generated from the schema, and every page's relative
links, anchors, snippets and ``bcg`` commands hold (the checkers live in ``test_readme.py``)."""

from pathlib import Path

import pytest

from bcg_plugin.config import reference_markdown
from test_readme import bcg_commands, broken_links, cli_check, relative_links, snippet_errors

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_configuration_reference_is_generated_from_the_schema():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == reference_markdown(), "docs/configuration.md is stale: run `bcg config-reference > docs/configuration.md`"
    for key in ("enable", "max_tokens", "sizes", "max_padding_ratio", "capture_failure"):
        assert f"| `{key}` |" in committed


def test_docs_pages_are_found():
    assert {p.name for p in DOCS} >= {"architecture.md", "benchmarks.md", "configuration.md", "usage.md", "validation.md"}


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_links_resolve(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_snippets_parse(page):
    assert snippet_errors(page.read_text()) == []


DOC_COMMANDS = sorted({c for page in DOCS for c in bcg_commands(page.read_text())})


@pytest.mark.parametrize("command", DOC_COMMANDS, ids=" ".join)
def test_docs_bcg_command_exists(command):
    assert cli_check(command) is None


def test_docs_link_to_each_other():
    # Pages reachable only by knowing their file name are not documentation anyone finds.
    linked = {(page.parent / link.partition("#")[0]).resolve().name
              for page in [ROOT / "README.md", *DOCS] for link in relative_links(page.read_text())}
    assert {p.name for p in DOCS} <= linked
