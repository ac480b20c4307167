"""bcg_bench/padding_rows.py on a CPU: its comparison can tell row-independent maths from maths that
mixes rows, and the script writes the result file the GPU run will write."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bcg_bench" / "padding_rows.py"


def _module():
    spec = importlib.util.spec_from_file_location("padding_rows", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_compare_sees_padding_only_where_rows_interact():
    padding_rows = _module()
    x = torch.randn(24, 8, dtype=torch.float64)
    w = torch.randn(4, 8, dtype=torch.float64)
    same = padding_rows.rows_compare(lambda t: t @ w.T, x, 10, 24)
    assert same["bitwise_equal"] and same["rows_differing"] == 0
    mixed = padding_rows.rows_compare(lambda t: t - t.mean(dim=0), x, 10, 24)  # every row depends on all rows
    assert not mixed["bitwise_equal"] and mixed["rows_differing"] == 10 and mixed["max_abs_diff"] > 0


def test_the_script_writes_every_layer_and_probe_pair(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--device", "cpu"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.glob("padding-rows-*.json")
    result = json.loads(path.read_text())
    pairs = [(e["n"], e["m"]) for e in result["layers"]["router_gate"]]
    assert pairs == [(n, 2 * b) for n, b in _module().PROBES]  # the experts see both DP ranks' buckets
    assert [(e["n"], e["m"]) for e in result["layers"]["qkv_proj"]] == list(_module().PROBES)
    unpadded = next(e for e in result["layers"]["qkv_proj"] if e["n"] == e["m"])
    assert unpadded["bitwise_equal"]
    # No Triton on a CPU: the experts are reported as not measured, with the reason.
    assert result["layers"]["fused_experts"] == [] and result["fused_experts_error"]
