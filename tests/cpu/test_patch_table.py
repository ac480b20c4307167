"""patches/README.md lists every host symbol the adapters patch, and nothing they do not."""

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "bcg_plugin" / "patches" / "README.md"


def _table_modules(section: str) -> set[str]:
    text = README.read_text().split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z0-9_]+\.py)` \|", text, re.M))


@pytest.mark.parametrize("host, section", [("vllm", "vLLM"), ("sglang", "SGLang")])
def test_every_patch_module_has_a_row_and_every_row_a_module(host, section):
    pytest.importorskip(host)
    package = importlib.import_module(f"bcg_plugin.patches.{host}")
    modules = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"bcg_plugin.patches.{host}.{info.name}")
        if hasattr(module, "PATCH"):
            modules.add(f"{info.name}.py")
    assert modules, f"no patch modules found in bcg_plugin.patches.{host}"
    assert _table_modules(section) == modules
