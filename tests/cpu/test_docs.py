from pathlib import Path

from bcg_plugin.config import reference_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_generated_from_the_schema():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == reference_markdown(), "docs/configuration.md is stale: run `bcg config-reference > docs/configuration.md`"
    for key in ("enable", "max_tokens", "sizes", "max_padding_ratio", "capture_failure"):
        assert f"| `{key}` |" in committed
