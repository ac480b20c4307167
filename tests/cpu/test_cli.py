"""The ``bcg`` command as a user runs it (a subprocess of ``python -m bcg_plugin.cli``).

Every bad input ends in exit status 2 and one line on stderr naming what is wrong; a command that
cannot run here (a missing package, host engine or GPU) in exit status 1 and one line; never a
traceback. Where a test needs this machine to look different (a package missing, a GPU present,
every mode failing), a few lines run first in the same interpreter and then the command's own
``__main__``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
ENGINE_RESULT = RESULTS / "sglang-qwen3-0.6b-2026-12-01T0314Z.json"
MICRO_RESULT = RESULTS / "micro-2026-11-29T1218Z.json"
INSTALL_BENCH = ('pip install "bcg-plugin[bench]"', 'pip install ".[bench]"')


def bcg(*args: str, prelude: str = "", env: dict[str, str] | None = None, cwd: Path = ROOT,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m bcg_plugin.cli ARGS``; with ``prelude``, those lines run first in the same interpreter."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("BCG_")}
    full.update(PYTHONPATH=str(ROOT), **(env or {}))
    if prelude:
        code = textwrap.dedent(prelude) + textwrap.dedent("""
            import runpy
            sys.argv = ["bcg", *sys.argv[1:]]
            runpy.run_module("bcg_plugin.cli", run_name="__main__", alter_sys=True)
        """)
        cmd = [sys.executable, "-c", code, *args]
    else:
        cmd = [sys.executable, "-m", "bcg_plugin.cli", *args]
    return subprocess.run(cmd, env=full, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def needs_engine(engine: str) -> None:
    """Skip where ``engine`` (a benchmark name) is a host engine not installed here: the command would
    stop at that first, before what the test checks (an install with one engine only)."""
    if engine in ("vllm", "sglang") and importlib.util.find_spec(engine) is None:
        pytest.skip(f"needs {engine} installed")


def one_line_error(proc: subprocess.CompletedProcess, status: int, *fragments: str) -> str:
    """The single stderr line of a command that failed with ``status``; it holds every fragment."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == status and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# -- help, version, reference ------------------------------------------------------------------------


def test_help_lists_the_commands():
    proc = bcg("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("usage: bcg ")
    for command in ("doctor", "config-reference", "bench"):
        assert f"    {command}" in proc.stdout


def test_version_is_the_installed_distributions():
    import bcg_plugin

    proc = bcg("--version")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout == f"bcg-plugin {importlib.metadata.version('bcg-plugin')}\n"
    assert bcg_plugin.__version__ in proc.stdout


def test_config_reference_prints_the_reference_and_has_its_own_help():
    from bcg_plugin.config import reference_markdown

    proc = bcg("config-reference")
    assert proc.returncode == 0 and proc.stdout == reference_markdown()
    helped = bcg("config-reference", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: bcg config-reference")
    assert reference_markdown() not in helped.stdout


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["config-reference"], ["bench", "--help"],
                                  ["bench", "vllm", "--help"], ["bench", "report", "--help"]])
def test_help_version_and_reference_run_without_torch(args):
    """torch is not imported: were it, its import would fail here (and, without numpy, warn)."""
    proc = bcg(*args, prelude="import sys; sys.modules['torch'] = None")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]


def test_help_prints_no_numpy_warning_where_numpy_is_missing():
    """torch's import warns 'Failed to initialize NumPy' when numpy is absent (it does not depend on it)."""
    proc = bcg("--help", prelude="import sys; sys.modules['numpy'] = None")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]


def test_the_top_level_command_does_not_load_the_benchmark():
    proc = bcg("--help", prelude="import sys; sys.modules['bcg_bench'] = None")
    assert proc.returncode == 0 and proc.stderr == ""


# -- bad input: exit 2, one line -------------------------------------------------------------------


def test_no_command():
    one_line_error(bcg(), 2, "bcg: error:", "COMMAND")


@pytest.mark.parametrize("args, fragment", [
    (["frob"], "invalid choice: 'frob'"),
    (["bench", "frob"], "invalid choice: 'frob'"),
    (["bench"], "BENCHMARK"),
])
def test_unknown_command(args, fragment):
    one_line_error(bcg(*args), 2, fragment)


def test_missing_result_file(tmp_path):
    one_line_error(bcg("bench", "report", str(tmp_path / "nope.json")), 2,
                   "bcg bench report: error:", f"no such result file: {tmp_path / 'nope.json'}")


def test_a_directory_given_as_the_result_file(tmp_path):
    one_line_error(bcg("bench", "report", str(tmp_path)), 2,
                   "bcg bench report: error:", f"{tmp_path} is a directory: name one result file in it")


def test_malformed_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"benchmark": "engine",')
    one_line_error(bcg("bench", "report", str(bad)), 2, f"{bad} is not valid JSON")


@pytest.mark.parametrize("content, fragment", [
    ({"modes": {}}, "it has no 'benchmark' field"),
    ([1, 2], "it has no 'benchmark' field"),
    ({"benchmark": "padding_rows"}, "has 'benchmark': 'padding_rows', which bcg bench does not write"),
    ({"benchmark": "vllm"}, "its results say 'engine' or 'micro'"),
    ({"benchmark": "engine", "engine": "vllm"}, "it lacks engine_version, model, sizes, modes"),
])
def test_json_that_is_not_a_bench_result(tmp_path, content, fragment):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(content))
    one_line_error(bcg("bench", "report", str(path)), 2, f"{path} ", fragment)


@pytest.mark.parametrize("source, change", [
    (ENGINE_RESULT, lambda r: r["modes"].update(bcg=5)),
    (ENGINE_RESULT, lambda r: r.update(sizes="x")),
    (MICRO_RESULT, lambda r: r.update(results=None)),
])
def test_a_result_changed_since_bcg_bench_wrote_it(tmp_path, source, change):
    pytest.importorskip("matplotlib")
    result = json.loads(source.read_text())
    change(result)
    path = tmp_path / source.name
    path.write_text(json.dumps(result))
    one_line_error(bcg("bench", "report", str(path)), 2, f"cannot draw {path} (",
                   "a field may have a shape bcg bench does not write")


@pytest.mark.parametrize("sizes", ["16,abc", "0,16", "-4", ""])
def test_bad_sizes(tmp_path, sizes):
    one_line_error(bcg("bench", "vllm", "--sizes", sizes, "--modes", "eager", "--timeout", "5",
                       "--out", str(tmp_path)), 2,
                   "bcg bench vllm: error: argument --sizes:", "token counts >= 1", repr(sizes))


@pytest.mark.parametrize("engine, modes, fragment", [
    ("vllm", "eager,frob", "unknown vllm mode(s) frob; choose from eager, native"),
    ("sglang", "eager", "unknown sglang mode(s) eager; choose from disabled"),
    ("sglang", "bcg,bcg", "mode(s) bcg given twice"),
])
def test_unknown_mode(tmp_path, engine, modes, fragment):
    one_line_error(bcg("bench", engine, "--modes", modes, "--timeout", "5", "--out", str(tmp_path)), 2,
                   f"bcg bench {engine}: error: argument --modes:", fragment)


@pytest.mark.parametrize("args, fragment", [
    (["--tp", "0"], "argument --tp: expected a whole number >= 1, got '0'"),
    (["--rounds", "x"], "argument --rounds: expected a whole number >= 1"),
    (["--timeout", "0"], "argument --timeout: expected seconds > 0"),
    (["--dp", "2"], "vLLM's data parallelism serves MoE models only"),
    (["--profile", "16", "--tp", "2"], "--profile with vllm needs --tp 1 --dp 1"),
    (["--model", "gpt2"], "argument --model: invalid choice: 'gpt2'"),
])
def test_bad_engine_options(tmp_path, args, fragment):
    one_line_error(bcg("bench", "vllm", *args, "--modes", "eager", "--out", str(tmp_path)), 2, fragment)


def test_an_attention_backend_the_sglang_bench_does_not_set(tmp_path):
    one_line_error(bcg("bench", "sglang", "--attention-backend", "torch_native", "--out", str(tmp_path)), 2,
                   "argument --attention-backend: invalid choice: 'torch_native'")
    one_line_error(bcg("bench", "vllm", "--attention-backend", "triton", "--out", str(tmp_path)), 2,
                   "unrecognized arguments: --attention-backend triton")


def test_an_output_directory_that_cannot_be_made(tmp_path):
    needs_engine("vllm")
    blocker = tmp_path / "file"
    blocker.write_text("")
    one_line_error(bcg("bench", "vllm", "--modes", "eager", "--out", str(blocker / "results")), 2,
                   f"cannot create the output directory {blocker / 'results'}")


def test_doctor_with_a_config_that_is_not_json():
    one_line_error(bcg("doctor", "--config", "{bad"), 2, "bcg doctor: error: --config: not valid JSON")


# -- a command that cannot run here: exit 1, one line ------------------------------------------------


# One short mode each, so that a command which wrongly went on to run its modes still ends soon.
ONE_MODE = {"vllm": ["--modes", "eager", "--timeout", "5"], "sglang": ["--modes", "disabled", "--timeout", "5"],
            "micro": []}


@pytest.mark.parametrize("benchmark", ["vllm", "sglang", "micro"])
def test_no_gpu_fails_fast_before_any_mode_runs(tmp_path, benchmark):
    needs_engine(benchmark)
    proc = bcg("bench", benchmark, *ONE_MODE[benchmark], "--out", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})
    one_line_error(proc, 1, f"bcg bench {benchmark}: error: no CUDA device is visible")
    assert "[bcg bench]" not in proc.stdout and list(tmp_path.iterdir()) == []  # no mode process started


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_missing_host_engine(tmp_path, engine):
    proc = bcg("bench", engine, *ONE_MODE[engine], "--out", str(tmp_path),
               prelude=f"import sys; sys.modules[{engine!r}] = None")
    one_line_error(proc, 1, f"{engine} is not installed", f'pip install "bcg-plugin[{engine}]"',
                   f'pip install ".[{engine}]"')


@pytest.mark.parametrize("blocked, args", [
    (["matplotlib", "psutil"], ["bench", "vllm"]),
    (["psutil"], ["bench", "sglang"]),
    (["matplotlib"], ["bench", "report", str(ENGINE_RESULT)]),
])
def test_the_bench_extra_missing(tmp_path, blocked, args):
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    out = [*ONE_MODE[args[1]], "--out", str(tmp_path)] if args[1] != "report" else []
    line = one_line_error(bcg(*args, *out, prelude=prelude), 1, *INSTALL_BENCH)
    assert all(name in line for name in blocked)


FAKE_GPU_AND_MODES = """
import sys
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_name = lambda *a: "fake GPU"
from bcg_bench import harness

def run_mode(engine, mode, model, sizes, *args, **kwargs):
    if mode in FAILING:
        return {"error": "exit code 1", "log_tail": "Traceback (most recent call last):\\n  File x\\n"
                f"RuntimeError: {mode} could not start\\nINFO: shutting down\\n"}
    return {"e2e_ms": {str(n): 1.0 for n in sizes}}

harness.run_mode = run_mode
"""


def test_a_bench_whose_modes_all_failed_exits_non_zero_with_the_first_cause(tmp_path):
    needs_engine("vllm")
    prelude = "FAILING = {'eager', 'bcg'}\n" + FAKE_GPU_AND_MODES
    proc = bcg("bench", "vllm", "--modes", "bcg,eager", "--sizes", "16", "--out", str(tmp_path), prelude=prelude)
    one_line_error(proc, 1, "bcg bench vllm: error: every mode failed",
                   "the first: bcg: exit code 1: RuntimeError: bcg could not start")
    assert len(list(tmp_path.glob("vllm-*-qwen3-0.6b-*.json"))) == 1  # the result file still records the causes


def test_a_bench_with_some_modes_failed_names_the_first_and_succeeds(tmp_path):
    needs_engine("vllm")
    prelude = "FAILING = {'eager'}\n" + FAKE_GPU_AND_MODES
    proc = bcg("bench", "vllm", "--modes", "bcg,eager", "--sizes", "16", "--out", str(tmp_path), prelude=prelude)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "bcg bench vllm: some modes failed (see the report); the first: eager: exit code 1: "
        "RuntimeError: eager could not start"]
    assert "Modes that failed: eager (exit code 1)" in proc.stdout  # the report, printed


# -- what works -------------------------------------------------------------------------------------


def test_report_redraws_engine_and_micro_results(tmp_path):
    pytest.importorskip("matplotlib")
    for source in (ENGINE_RESULT, MICRO_RESULT):
        (tmp_path / source.name).write_text(source.read_text())
    proc = bcg("bench", "report", *(str(tmp_path / s.name) for s in (ENGINE_RESULT, MICRO_RESULT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = {Path(line).name for line in proc.stdout.splitlines()}
    assert {ENGINE_RESULT.stem + ".md", ENGINE_RESULT.stem + ".png", MICRO_RESULT.stem + ".md"} <= written
    engine_md = (tmp_path / (ENGINE_RESULT.stem + ".md")).read_text()
    assert engine_md.startswith("# sglang 0.5.17: qwen3-0.6b") and f"![{ENGINE_RESULT.stem}.png]" in engine_md
    assert (tmp_path / (MICRO_RESULT.stem + ".md")).read_text().startswith("# bcg micro-benchmark")
