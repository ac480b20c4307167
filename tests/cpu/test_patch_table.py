"""patches/README.md is the rendering of the patch descriptors, and the patches are leaves."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import bcg_plugin.patches as patches
from bcg_plugin.patches import README_PATH, readme

PATCHES_DIR = Path(patches.__file__).resolve().parent
FORBIDDEN = "bcg_plugin.adapters"


def test_committed_readme_is_the_rendering_of_the_descriptors():
    assert README_PATH.read_text() == readme(), (
        "bcg_plugin/patches/README.md is stale: run `python -m bcg_plugin.patches --write`")


def test_the_rendering_follows_a_changed_descriptor(monkeypatch):
    from bcg_plugin.patches.sglang import backend_choices

    monkeypatch.setattr(backend_choices.PATCH, "remove_when", "never, say the descriptors")
    assert "never, say the descriptors" in readme() and README_PATH.read_text() != readme()


@pytest.mark.parametrize("host", ["vllm", "sglang"])
def test_every_patch_module_is_in_a_set_and_every_patch_in_the_table(host):
    package = importlib.import_module(f"bcg_plugin.patches.{host}")
    modules = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"bcg_plugin.patches.{host}.{info.name}")
        if hasattr(module, "PATCH") or hasattr(module, "PATCHES"):
            modules[module.__name__] = patches.descriptors(module)
    assert modules, f"no patch modules found in bcg_plugin.patches.{host}"
    in_sets = [p for s in package.SETS for p in s.patches]
    # every descriptor of every module once, none left out
    assert sorted(p.module for p in in_sets) == sorted(m for m, found in modules.items() for _ in found)
    assert all(any(p is d for d in modules[p.module]) for p in in_sets)
    text = README_PATH.read_text()
    for name, found in modules.items():
        for patch in found:
            assert f"| `{name.rpartition('.')[2]}.py` | `{patch.target}`" in text


@pytest.mark.parametrize("host", ["vllm", "sglang"])
def test_every_patch_states_reason_range_upstream_and_removal(host):
    package = importlib.import_module(f"bcg_plugin.patches.{host}")
    for p in package.ALL:
        assert p.reason and p.remove_when and p.upstream


@pytest.mark.parametrize("host", ["vllm", "sglang"])
def test_every_release_gets_one_descriptor_per_target_and_every_set_covers_it(host):
    package = importlib.import_module(f"bcg_plugin.patches.{host}")
    assert patches.coverage_problems(package.ALL, package.GATE.releases) == []
    for patch_set in package.SETS:
        for release in package.GATE.releases:
            assert patch_set.active(release), f"{patch_set.name}: nothing covers {host} {release}"


def test_coverage_finds_overlapping_and_unused_descriptors():
    from bcg_plugin.patches.sglang import backend_choices

    base = backend_choices.PATCH
    overlap = patches.Patch(base.target, base.how, base.make, base.reason, ">=0.5.17,<0.5.19", base.upstream,
                            base.remove_when)
    unused = patches.Patch(base.target, base.how, base.make, base.reason, ">=9", base.upstream, base.remove_when)
    problems = patches.coverage_problems([base, overlap, unused], ["0.5.17", "0.5.20"])
    assert any("0.5.17" in p and "two descriptors" in p for p in problems)
    assert any(">=9" in p and "no release" in p for p in problems)


def adapter_imports(source: str) -> list[str]:
    """Every import of ``bcg_plugin.adapters`` in ``source``, at module level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == FORBIDDEN or a.name.startswith(FORBIDDEN + ".")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == FORBIDDEN or node.module.startswith(FORBIDDEN + "."):
                found.append(node.module)
            elif node.module == "bcg_plugin":
                found += [f"bcg_plugin.{a.name}" for a in node.names if a.name == "adapters"]
    return found


def test_the_import_scan_finds_lazy_and_aliased_adapter_imports():
    source = (
        "import bcg_plugin.ladder\n"
        "from bcg_plugin import live, adapters\n"
        "def hook():\n"
        "    from bcg_plugin.adapters.sglang import replay as runner\n"
        "    import bcg_plugin.adapters.vllm.plugin\n"
    )
    assert adapter_imports(source) == ["bcg_plugin.adapters", "bcg_plugin.adapters.sglang",
                                       "bcg_plugin.adapters.vllm.plugin"]


def test_patches_import_nothing_of_the_adapters():
    offenders = {}
    for path in sorted(PATCHES_DIR.rglob("*.py")):
        found = adapter_imports(path.read_text())
        if found:
            offenders[str(path.relative_to(PATCHES_DIR))] = found
    assert len(list(PATCHES_DIR.rglob("*.py"))) > 15  # the scan saw the patch modules
    assert offenders == {}, f"patches must be leaves; the adapter hands them what they call: {offenders}"
