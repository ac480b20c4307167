"""The runtime ships only the runtime: bcg_plugin never imports the benchmark (bcg_bench).

No edge is allowed: the ``bcg`` command finds ``bcg bench``'s commands through the ``bcg.commands``
entry-point group, which the benchmark declares.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "bcg_plugin"
BENCH = "bcg_bench"
ALLOWED: set[tuple[str, str | None, str]] = set()  # (file, enclosing function, module)


def bench_imports(path: Path, root: Path = ROOT) -> list[tuple[str, str | None, str]]:
    """Every import of bcg_bench in ``path``: (file below ``root``, enclosing function or None, module).
    ``importlib.import_module``/``__import__`` of a constant name count as imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]  # relative imports stay inside the importing package
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if callee in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        for name in names:
            if name.split(".")[0] == BENCH:
                found.append((path.relative_to(root).as_posix(), function, name))
        inner = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, None)
    return found


def test_no_runtime_module_imports_the_benchmark():
    found = [edge for path in sorted(RUNTIME.rglob("*.py")) for edge in bench_imports(path)]
    assert [edge for edge in found if edge not in ALLOWED] == []
    assert set(found) == ALLOWED  # the bench subcommand still reaches the bench, and only that way


def test_the_import_reader_sees_every_form_of_import(tmp_path):
    """The check above can fail: each way of importing the bench is found, wherever it is."""
    module = tmp_path / "bcg_plugin" / "probe.py"
    module.parent.mkdir()
    module.write_text(
        "import bcg_bench\n"
        "from bcg_bench.harness import run\n"
        "def f():\n"
        "    import bcg_bench.sglang_timers as t\n"
        "    from bcg_bench import sglang_mode\n"
        "    importlib.import_module('bcg_bench.report')\n"
        "import bcg_plugin.cli\n"
        "from bcg_plugin import cli\n"
    )
    found = bench_imports(module, tmp_path)
    name = "bcg_plugin/probe.py"
    assert found == [(name, None, "bcg_bench"), (name, None, "bcg_bench.harness"),
                     (name, "f", "bcg_bench.sglang_timers"), (name, "f", "bcg_bench"), (name, "f", "bcg_bench.report")]


IMPORTS = """
import json, sys
import bcg_plugin, bcg_plugin.cli, bcg_plugin.adapters.vllm, bcg_plugin.adapters.sglang
from bcg_plugin.adapters.vllm import register as vllm_register
vllm_register()
from sglang.srt.plugins import load_plugins
load_plugins()  # SGLang's plugin loading, which calls bcg's register()
from bcg_plugin.adapters import sglang
print("LAYERING " + json.dumps({"sglang_active": sglang.is_active(),
                                 "bench": sorted(m for m in sys.modules if m.split('.')[0] == 'bcg_bench')}))
"""


def test_importing_and_registering_the_runtime_does_not_import_the_benchmark(tmp_path):
    missing = [host for host in ("vllm", "sglang") if importlib.util.find_spec(host) is None]
    if missing:
        pytest.skip(f"needs both hosts importable; missing {missing}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BCG_")}
    # What the benchmark itself would set: still no reason for the plugin to reach for it.
    env.update(BCG_ENABLE="1", BCG_BENCH_RECORD=str(tmp_path / "r.jsonl"), PYTHONWARNINGS="ignore",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", IMPORTS], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("LAYERING ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    seen = json.loads(lines[-1][len("LAYERING "):])
    assert seen["sglang_active"]  # the register that ran is the one whose imports are checked
    assert seen["bench"] == []
