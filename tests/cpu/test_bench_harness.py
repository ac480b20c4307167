"""The engine benchmark harness without an engine: per-mode scripts replaced by a fake one."""

import json
import subprocess
import time
from pathlib import Path

import pytest

from bcg_bench import harness
from bcg_bench import report
from bcg_bench import targets
from bcg_bench.report import run_stamp


def test_rounds_alternate_order_and_keep_the_minimum(tmp_path, monkeypatch):
    calls = []

    def fake_run_mode(engine, mode, model, sizes, timeout_s, parallel, profile_tokens, attention_backend=None):
        calls.append(mode)
        k = len(calls)
        if mode == "native" and k > 2:
            return {"error": "exit code 1", "log_tail": "boom"}
        return {"e2e_ms": {str(n): float(n + k) for n in sizes}, "forward_ms": {str(n): float(k) for n in sizes},
                "init_s": 1.0 + k, "capture_s": 5.0 - k, "graph_mem_gib": 0.5 * k}

    monkeypatch.setattr(harness, "run_mode", fake_run_mode)
    monkeypatch.setattr(harness.importlib.metadata, "version", lambda name: "9.9.9")
    path = harness.run("sglang", "qwen3-0.6b", [16, 64], ["bcg", "native"], tmp_path, 10, rounds=2)
    assert calls == ["bcg", "native", "native", "bcg"]
    result = json.loads(path.read_text())
    assert path.name == f"sglang-{result['engine_version']}-qwen3-0.6b-{run_stamp(result['date'])}.json"
    assert result["order"] == calls and result["engine_version"] == "9.9.9"
    assert result["modes"]["bcg"]["e2e_ms"] == {"16": 17.0, "64": 65.0}  # round 1 (k=1) beats round 2 (k=4)
    assert result["modes"]["native"]["e2e_ms"] == {"16": 18.0, "64": 66.0}  # the failed round is skipped
    assert len(result["modes"]["native"]["rounds"]) == 2
    # durations are minima over rounds, each on its own; memory comes from the first good round
    assert (result["modes"]["bcg"]["init_s"], result["modes"]["bcg"]["capture_s"]) == (2.0, 1.0)
    assert result["modes"]["bcg"]["graph_mem_gib"] == 0.5
    md = (tmp_path / path.name.replace(".json", ".md")).read_text()
    assert "capture seconds are each mode's minimum over rounds" in md
    assert "2 rounds in alternating order" in md and "| 16 | 17.00 | 18.00 |" in md


def test_ratios_paired_by_round_are_not_swayed_by_one_lucky_process(tmp_path, monkeypatch):
    # native_ladder is fast in one of three processes; bcg is steady and faster in the other two.
    e2e = {"bcg": [9.0, 9.0, 9.0, 9.0], "native_ladder": [10.0, 5.0, 10.0]}  # bcg's fourth: the one-round run
    seen = {m: 0 for m in e2e}

    def fake_run_mode(engine, mode, model, sizes, timeout_s, parallel, profile_tokens, attention_backend=None):
        value = e2e[mode][seen[mode]]
        seen[mode] += 1
        return {"e2e_ms": {str(n): value for n in sizes}}

    monkeypatch.setattr(harness, "run_mode", fake_run_mode)
    monkeypatch.setattr(harness.importlib.metadata, "version", lambda name: "9.9.9")
    path = harness.run("vllm", "qwen3-0.6b", [16], ["native_ladder", "bcg"], tmp_path, 10, rounds=3)
    md = (tmp_path / path.name.replace(".json", ".md")).read_text()
    minimum, paired = md.split("## End-to-end ratios (below 1")[1].split("## End-to-end ratios paired by round")
    assert "| 16 | 1.800 | 1.800 |" in minimum  # per-N minimum: 9 against the one 5
    assert "| N | bcg / native_ladder |" in paired and "| 16 | 0.900 |" in paired  # median of 0.9, 1.8, 0.9
    one_round = harness.run("vllm", "qwen3-0.6b", [16], ["bcg"], tmp_path / "one", 10)
    assert "paired by round" not in (one_round.parent / one_round.name.replace(".json", ".md")).read_text()


def test_a_mode_process_records_the_host_load_it_started_under(tmp_path, monkeypatch):
    (tmp_path / "fake_mode.py").write_text(
        "import json, sys\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "json.dump({'e2e_ms': {'16': 1.0}}, open(out, 'w'))\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setitem(harness.ENGINES, "fake", {**harness.ENGINES["vllm"], "module": "fake_mode"})
    monkeypatch.setattr(harness.os, "getloadavg", lambda: (7.5, 1.0, 1.0))
    data = harness.run_mode("fake", "bcg", "qwen3-0.6b", [16], 60)
    assert data["e2e_ms"] == {"16": 1.0} and data["load_avg_at_start"] == 7.5 and data["wall_s"] > 0
    result = {"engine": "vllm", "engine_version": "9", "model": {"name": "qwen3-0.6b"}, "date": "d", "gpu": "g",
              "env": {"torch": "t", "cpus": 16}, "sizes": [16], "rounds": 2,
              "modes": {"bcg": {**data, "rounds": [data, {**data, "load_avg_at_start": 2.0}]}}}
    assert "Host load (1-minute average) when each mode process started: 2.0 to 7.5, on 16 CPUs." in (
        harness.to_markdown(result))


def test_a_mode_process_past_its_timeout_is_ended_and_the_error_says_to_raise_it(tmp_path, monkeypatch):
    (tmp_path / "slow_mode.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setitem(harness.ENGINES, "fake", {**harness.ENGINES["vllm"], "module": "slow_mode"})
    start = time.perf_counter()
    data = harness.run_mode("fake", "bcg", "qwen3-0.6b", [16], 1)
    assert time.perf_counter() - start < 30
    assert data["error"].startswith("timed out after 1 s (a first start on a machine can spend minutes compiling")
    assert data["error"].endswith("raise --timeout)")


class _Stopped(BaseException):
    """What a run killed from outside looks like to the harness: nothing after this point runs."""


def test_a_run_stopped_from_outside_keeps_every_mode_process_it_finished(tmp_path, monkeypatch):
    calls = []

    def fake_run_mode(engine, mode, model, sizes, timeout_s, parallel, profile_tokens, attention_backend=None):
        calls.append(mode)
        if len(calls) == 4:
            raise _Stopped
        return {"e2e_ms": {str(n): float(n + len(calls)) for n in sizes}}

    monkeypatch.setattr(harness, "run_mode", fake_run_mode)
    monkeypatch.setattr(harness.importlib.metadata, "version", lambda name: "9.9.9")
    try:
        harness.run("vllm", "qwen3-0.6b", [16], ["native_ladder", "bcg"], tmp_path, 10, rounds=3)
    except _Stopped:
        pass
    [path] = tmp_path.glob("*.json")  # no temporary file left beside it
    result = json.loads(path.read_text())
    assert result["order"] == ["native_ladder", "bcg", "bcg"] and result["processes"] == {"finished": 3, "planned": 6}
    assert result["modes"]["bcg"]["e2e_ms"] == {"16": 18.0} and len(result["modes"]["bcg"]["rounds"]) == 2
    assert result["modes"]["native_ladder"]["e2e_ms"] == {"16": 17.0}
    md = harness.to_markdown(result)
    assert "Incomplete run: 3 of 6 mode processes finished before it was stopped (native_ladder, bcg, bcg)" in md
    complete = harness.run("vllm", "qwen3-0.6b", [16], ["bcg"], tmp_path / "full", 10)
    assert "Incomplete" not in (complete.parent / complete.name.replace(".json", ".md")).read_text()


def test_a_failing_mode_is_reported_not_fatal(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "run_mode", lambda *a: {"error": "timed out after 10 s", "log_tail": ""})
    monkeypatch.setattr(harness.importlib.metadata, "version", lambda name: "9.9.9")
    path = harness.run("vllm", "qwen3-0.6b", [16], ["bcg"], tmp_path, 10)
    md = (tmp_path / path.name.replace(".json", ".md")).read_text()
    assert "Modes that failed: bcg (timed out after 10 s)" in md


def test_parallel_layout_reaches_every_mode_and_names_the_result(tmp_path, monkeypatch):
    cmds, ended = [], []

    class Failed:
        returncode, pid = 1, -1

        def __init__(self, cmd, **kwargs):
            cmds.append(cmd)
            assert kwargs["start_new_session"]  # so end_group can reach the engine's own processes

        def communicate(self, timeout=None):
            return "", "no engine here"

    monkeypatch.setattr(harness.subprocess, "Popen", Failed)
    monkeypatch.setattr(report, "_tracked_files_changed", lambda start: False)  # spawns git
    monkeypatch.setattr(harness, "end_group", ended.append)
    monkeypatch.setattr(harness.importlib.metadata, "version", lambda name: "9.9.9")
    path = harness.run("sglang", "qwen3-8b", [16], ["native", "bcg"], tmp_path, 10, tp=2)
    assert all(c[-2:] == ["--tp", "2"] and "--dp" not in c for c in cmds) and len(cmds) == 2
    assert len(ended) == 2  # every mode's process group is ended, also after a normal exit
    result = json.loads(path.read_text())
    assert result["parallel"] == {"tp": 2, "dp": 1}
    assert path.name == f"sglang-{result['engine_version']}-qwen3-8b-tp2-{run_stamp(result['date'])}.json"
    assert ", tensor parallel 2, attention backend triton. " in (tmp_path / path.name.replace(".json", ".md")).read_text()
    cmds.clear()
    path = harness.run("vllm", "qwen3-30b-a3b", [16], ["bcg"], tmp_path, 10, dp=2)
    assert cmds[0][-2:] == ["--dp", "2"] and path.name.startswith("vllm-9.9.9-qwen3-30b-a3b-dp2-")


def test_an_attention_backend_reaches_every_mode_and_a_non_default_one_names_the_result(tmp_path, monkeypatch):
    cmds = []

    class Failed:
        returncode, pid = 1, -1

        def __init__(self, cmd, **kwargs):
            cmds.append(cmd)

        def communicate(self, timeout=None):
            return "", "no engine here"

    monkeypatch.setattr(harness.subprocess, "Popen", Failed)
    monkeypatch.setattr(report, "_tracked_files_changed", lambda start: False)  # spawns git
    monkeypatch.setattr(harness, "end_group", lambda proc: None)
    monkeypatch.setattr(harness.importlib.metadata, "version", lambda name: "9.9.9")
    path = harness.run("sglang", "qwen3-0.6b", [16], ["full", "bcg"], tmp_path, 10)
    assert all(c[c.index("--attention-backend") + 1] == "triton" for c in cmds) and len(cmds) == 2
    assert json.loads(path.read_text())["attention_backend"] == "triton"
    assert path.name.startswith("sglang-9.9.9-qwen3-0.6b-2")  # the default backend: no suffix
    cmds.clear()
    path = harness.run("sglang", "qwen3-0.6b", [16], ["full"], tmp_path, 10, attention_backend="flashinfer")
    assert cmds[0][cmds[0].index("--attention-backend") + 1] == "flashinfer"
    assert path.name.startswith("sglang-9.9.9-qwen3-0.6b-flashinfer-")
    assert ", attention backend flashinfer. " in (tmp_path / path.name.replace(".json", ".md")).read_text()
    cmds.clear()
    harness.run("vllm", "qwen3-0.6b", [16], ["bcg"], tmp_path, 10)
    assert "--attention-backend" not in cmds[0]  # vLLM's modes keep the backend vLLM picks
    with pytest.raises(SystemExit, match="vllm: attention backend 'triton' is not one the bench sets"):
        harness.run("vllm", "qwen3-0.6b", [16], ["bcg"], tmp_path, 10, attention_backend="triton")


def test_render_writes_report_and_three_plots(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    result = {
        "engine": "sglang", "engine_version": "0.5.17", "model": {"name": "qwen3-0.6b"}, "gpu": "GPU",
        "date": "2026-11-29T00:00:00Z", "env": {"torch": "2.11.0"}, "sizes": [16, 64],
        "modes": {
            "disabled": {"e2e_ms": {"16": 20.0, "64": 22.0}, "capture_s": 0.0, "graph_mem_gib": 0.0},
            "bcg": {"e2e_ms": {"16": 10.0, "64": 11.0}, "capture_s": 4.0, "graph_mem_gib": 0.5},
        },
    }
    path = tmp_path / "sglang-qwen3-0.6b-2026-11-29.json"
    path.write_text(json.dumps(result))
    written = {p.name for p in harness.render(path)}
    stem = "sglang-qwen3-0.6b-2026-11-29"
    assert written == {f"{stem}.md", f"{stem}.png", f"{stem}-speedup.png", f"{stem}-capture.png"}
    md = (tmp_path / f"{stem}.md").read_text()
    assert f"![{stem}-speedup.png]({stem}-speedup.png)" in md and "| 16 | 20.00 | 10.00 |" in md


def test_report_shows_time_to_first_token_and_mode_notes_when_present():
    note = "generate() waits out the DP wave"
    result = {
        "engine": "vllm", "engine_version": "0.26.0", "model": {"name": "qwen3-30b-a3b"}, "gpu": "GPU",
        "date": "2026-11-30T00:00:00Z", "env": {"torch": "2.11.0"}, "sizes": [16], "parallel": {"tp": 1, "dp": 2},
        "modes": {
            "eager": {"e2e_ms": {"16": 2000.0}, "ttft_ms": {"16": 40.0}, "note": note},
            "bcg": {"e2e_ms": {"16": 200.0}, "ttft_ms": {"16": 10.0}, "note": note},
        },
    }
    md = harness.to_markdown(result)
    assert f"Note (eager, bcg): {note}." in md
    ttft = md.split("## Time to first token median ms", 1)[1]
    assert "| 16 | 40.00 | 10.00 |" in ttft
    assert "| 16 | 0.250 | 0.250 |" in md.split("## Time-to-first-token ratios", 1)[1]
    assert "| 16 | 0.100 | 0.100 |" in md.split("## End-to-end ratios", 1)[1]
    del result["modes"]["bcg"]["ttft_ms"], result["modes"]["eager"]["ttft_ms"]
    assert "Time to first token" not in harness.to_markdown(result)


def test_rounds_keep_the_minimum_time_to_first_token():
    rounds = [{"e2e_ms": {"16": 5.0}, "ttft_ms": {"16": 3.0}}, {"e2e_ms": {"16": 4.0}, "ttft_ms": {"16": 3.5}}]
    assert harness._merge_rounds(rounds)["ttft_ms"] == {"16": 3.0}


def _mode(*rounds: dict, **figures) -> dict:
    """One mode's figures as the harness merges them: ``rounds``, one {N: e2e ms} per round in run
    order; ``figures`` a scalar per round (a list) or the same in every round."""
    runs = [{"e2e_ms": {str(n): ms for n, ms in r.items()},
             **{k: v[i] if isinstance(v, list) else v for k, v in figures.items()}} for i, r in enumerate(rounds)]
    return harness._merge_rounds(runs)


def _targets(engine: str, modes: dict, *args) -> str:
    from bcg_bench import targets

    return "\n".join(targets.markdown(engine, modes, *args))


def _sglang_modes(bcg_16=(8.0, 8.5, 9.5), rounds: int = 3) -> dict:
    bcg = [{16: a, 1024: b} for a, b in zip(bcg_16, (19.0, 21.0, 22.0))]
    return {"native": _mode(*[{16: 10.0, 1024: 20.0}] * rounds, capture_s=[4.0, 4.0, 5.0][:rounds]),
            "full": _mode(*[{16: 9.0, 1024: 22.0}] * rounds),
            "bcg": _mode(*bcg[:rounds], capture_s=[4.0, 3.0, 5.0][:rounds])}


def test_sglang_latency_targets_read_the_worst_n_of_the_paired_median_over_rounds():
    table = _targets("sglang", _sglang_modes())
    assert "Latency figures: the worst N of the median over rounds of per-round paired ratios" in table
    assert "| bcg / native (e2e, N <= 512) | <= 0.9 | 0.850 | yes |" in table  # median of 0.8, 0.85, 0.95
    # 1024 tokens: 0.95, 1.05 and 1.1 by round; the per-N minimum (19 against 20) would read 0.95
    assert "| bcg / native (e2e, every N) | <= 1 | 1.050 | no |" in table
    assert "| bcg / full (e2e, every N) | <= 1 | 0.955 | yes |" in table  # 21 / 22 at 1024 over 8.5 / 9 at 16
    assert "| bcg / native (capture seconds) | <= 1 | 0.750 | yes |" in table  # each mode's minimum, 3 / 4
    # bcg_graph is read against its own figures, and says so where the run did not measure it
    assert "- bcg (attention auto, the default): 3 of 4 measured targets met" in table
    assert "| bcg_graph / full (e2e, every N) | <= 1 | not measured | - |" in table
    assert "- bcg_graph: not measured" in table
    modes = _sglang_modes()
    modes["bcg_graph"] = modes["full"]  # as fast as SGLang's full graphs: level with them
    table = _targets("sglang", modes)
    assert "| bcg_graph / full (e2e, every N) | <= 1 | 1.000 | yes |" in table
    assert "| bcg / full (e2e, every N) | <= 1 | 0.955 | yes |" in table  # bcg's rows read bcg's figures still
    # negative controls: one round's 16 tokens past the limit moves the median; two rounds; no full
    table = _targets("sglang", _sglang_modes((8.0, 9.5, 9.5)))
    assert "| bcg / native (e2e, N <= 512) | <= 0.9 | 0.950 | no |" in table
    table = _targets("sglang", _sglang_modes(rounds=2))
    assert "| bcg / native (e2e, N <= 512) | <= 0.9 | not measured | - |" in table
    assert "| bcg / full (e2e, every N) | <= 1 | not measured | - |" in table
    assert "| bcg / native (capture seconds) | <= 1 | 0.750 | yes |" in table  # scalars need no pairs
    modes = _sglang_modes()
    del modes["full"]
    assert "| bcg / full (e2e, every N) | <= 1 | not measured | - |" in _targets("sglang", modes)


def test_sglang_configurations_answer_to_the_plain_bcg_targets():
    """bcg on SGLang captures the model without torch.compile: each configuration owes SGLang's full
    graphs a start no slower, 0.05 s of capture per bucket and no more graph memory."""
    modes = _sglang_modes()
    modes["full"].update(init_s=80.0, graph_mem_gib=1.25)
    modes["bcg"].update(init_s=70.0, graph_mem_gib=1.2, bcg_buckets=60, bcg_capture_s=2.4)
    table = _targets("sglang", modes)
    rows = ["| bcg / full (init seconds) | <= 1 | 0.875 | yes |",
            "| bcg capture seconds per bucket | <= 0.05 | 0.040 | yes |",
            "| bcg / full (graph memory) | <= 1 | 0.960 | yes |",
            "| bcg_graph / full (init seconds) | <= 1 | not measured | - |"]
    assert [line for line in table.splitlines() if line in rows] == rows
    assert "- bcg (attention auto, the default): 6 of 7 measured targets met" in table
    # negative controls: each figure past its limit; a result without the bucket count
    modes["bcg"].update(init_s=84.0, graph_mem_gib=1.5, bcg_capture_s=3.6)
    table = _targets("sglang", modes)
    assert "| bcg / full (init seconds) | <= 1 | 1.050 | no |" in table
    assert "| bcg capture seconds per bucket | <= 0.05 | 0.060 | no |" in table
    assert "| bcg / full (graph memory) | <= 1 | 1.200 | no |" in table
    del modes["bcg"]["bcg_buckets"]
    assert "| bcg capture seconds per bucket | <= 0.05 | not measured | - |" in _targets("sglang", modes)


def _vllm_modes() -> dict:
    """Three rounds of each mode; round 2 runs on a host 20% slower, which pairing cancels."""
    def mode(sizes: dict, **figures) -> dict:
        return _mode(*({n: ms * k for n, ms in sizes.items()} for k in (1.0, 1.2, 1.0)), **figures)

    return {
        "full": mode({16: 4.0, 1024: 6.0, 2048: 9.0}, init_s=[10.0, 11.0, 12.0], capture_s=3.0, graph_mem_gib=0.5),
        "native": mode({16: 5.0, 1024: 12.0, 2048: 18.0}),
        "native_ladder": mode({16: 5.0, 1024: 7.0, 2048: 10.0}, capture_s=4.0),
        "compile": mode({16: 6.0, 1024: 12.0, 2048: 16.0}),
        "bcg": mode({16: 4.0, 1024: 6.6, 2048: 9.0}, init_s=9.0, capture_s=[2.5, 2.0, 2.2], graph_mem_gib=0.4,
                    bcg_buckets=56, bcg_capture_s=[2.4, 2.0, 2.1]),
        "bcg_compile": mode({16: 4.4, 1024: 5.4, 2048: 8.1}, capture_s=5.0),
    }


def test_vllm_targets_are_read_for_each_bcg_configuration_from_its_own_figures():
    table = _targets("vllm", _vllm_modes())
    rows = ["| bcg / full (e2e, every N) | <= 1 | 1.100 | no |",  # 1024 tokens; 16 and 2048 at 1.0
            "| bcg / native (e2e, N <= 512) | <= 0.9 | 0.800 | yes |",
            "| bcg / native_ladder (e2e, every N) | <= 1 | 0.943 | yes |",
            "| bcg / compile (e2e, N = 1024 and 2048) | <= 0.6 | 0.562 | yes |",
            "| bcg / native_ladder (capture seconds) | <= 1 | 0.500 | yes |",
            "| bcg / full (init seconds) | <= 1 | 0.900 | yes |",  # each mode's fastest start, 9 / 10
            "| bcg capture seconds per bucket | <= 0.05 | 0.036 | yes |",  # bcg's fastest 2.0 s over 56 buckets
            "| bcg / full (graph memory) | <= 1 | 0.800 | yes |",
            "| bcg_compile / full (e2e, every N) | <= 1 | 1.100 | no |",
            "| bcg_compile / native (e2e, N <= 512) | <= 0.9 | 0.880 | yes |",
            "| bcg_compile / native_ladder (e2e, every N) | <= 1 | 0.880 | yes |",
            "| bcg_compile / compile (e2e, N = 1024 and 2048) | <= 0.6 | 0.506 | yes |",
            "| bcg_compile / native_ladder (capture seconds) | <= 1 | 1.250 | no |",
            "| bcg_compile_graph / full (e2e, every N) | <= 1 | not measured | - |"]
    lines = table.splitlines()
    assert [line for line in lines if line in rows] == rows  # every row, in this order
    assert sum(line.startswith("| bcg_compile_graph /") for line in lines) == 5
    assert not any(line.startswith("| bcg_compile") and "per bucket" in line for line in lines)  # plain bcg only
    assert "- bcg (torch_compile false): 7 of 8 measured targets met; not met: bcg / full (e2e, every N)" in table
    assert ("- bcg_compile (torch_compile, the default under vLLM's -O2): 3 of 5 measured targets met; not met: "
            "bcg_compile / full (e2e, every N); bcg_compile / native_ladder (capture seconds)") in table
    assert "- bcg_compile_graph: not measured" in table


@pytest.mark.parametrize("change, row", [
    # a figure past its limit flips the verdict
    (lambda m: m["bcg"].update(graph_mem_gib=0.6), "| bcg / full (graph memory) | <= 1 | 1.200 | no |"),
    (lambda m: m["bcg"].update(bcg_capture_s=3.0), "| bcg capture seconds per bucket | <= 0.05 | 0.054 | no |"),
    (lambda m: m["bcg"].update(init_s=10.5), "| bcg / full (init seconds) | <= 1 | 1.050 | no |"),
    (lambda m: [r["e2e_ms"].update({"2048": 10.8 * k}) for r, k in zip(m["bcg"]["rounds"], (1.0, 1.2, 1.0))],
     "| bcg / compile (e2e, N = 1024 and 2048) | <= 0.6 | 0.675 | no |"),
    # a graph-memory figure the harness could not measure (zero or negative) is no figure
    (lambda m: m["full"].update(graph_mem_gib=-0.1), "| bcg / full (graph memory) | <= 1 | not measured | - |"),
    (lambda m: m["bcg"].update(graph_mem_gib=0.0), "| bcg / full (graph memory) | <= 1 | not measured | - |"),
    # a result without the bucket count; a missing mode; a size a compared mode lacks in one round
    (lambda m: m["bcg"].pop("bcg_buckets"), "| bcg capture seconds per bucket | <= 0.05 | not measured | - |"),
    # the host's graphs in the harness's capture seconds are not bcg's: without bcg's own, no figure
    (lambda m: m["bcg"].pop("bcg_capture_s"), "| bcg capture seconds per bucket | <= 0.05 | not measured | - |"),
    (lambda m: m.pop("compile"), "| bcg / compile (e2e, N = 1024 and 2048) | <= 0.6 | not measured | - |"),
    (lambda m: m["full"]["rounds"][2]["e2e_ms"].pop("2048"), "| bcg / full (e2e, every N) | <= 1 | not measured | - |"),
    (lambda m: [r["e2e_ms"].pop("2048") for r in m["compile"]["rounds"]],
     "| bcg / compile (e2e, N = 1024 and 2048) | <= 0.6 | not measured | - |"),
    # fewer than three rounds in which both modes ran
    (lambda m: m["bcg"]["rounds"].__setitem__(1, {"error": "exit code 1"}),
     "| bcg / native_ladder (e2e, every N) | <= 1 | not measured | - |"),
    (lambda m: m["native_ladder"].pop("rounds"), "| bcg / native_ladder (e2e, every N) | <= 1 | not measured | - |"),
])
def test_vllm_target_negative_controls(change, row):
    modes = _vllm_modes()
    change(modes)
    assert row in _targets("vllm", modes)


def test_every_n_is_every_n_the_configuration_measured():
    modes = _vllm_modes()
    for r in modes["bcg"]["rounds"]:  # bcg alone ran 8192 tokens: full's rounds lack it
        r["e2e_ms"]["8192"] = 30.0
    table = _targets("vllm", modes)
    assert "| bcg / full (e2e, every N) | <= 1 | not measured | - |" in table
    assert "| bcg_compile / full (e2e, every N) | <= 1 | 1.100 | no |" in table  # bcg_compile's own sizes
    for r in modes["full"]["rounds"]:
        r["e2e_ms"]["8192"] = 29.0
    assert "| bcg / full (e2e, every N) | <= 1 | 1.100 | no |" in _targets("vllm", modes)


def test_targets_are_not_checked_for_another_model_or_several_gpus():
    modes = _vllm_modes()
    assert "| bcg / native (e2e, N <= 512) | <= 0.9 | 0.800 | yes |" in _targets("vllm", modes)
    for model, parallel, shape in (("qwen3-30b-a3b", None, "qwen3-30b-a3b"),
                                   ("qwen3-0.6b", {"tp": 2, "dp": 1}, "qwen3-0.6b, tp 2"),
                                   ("qwen3-8b", {"tp": 2, "dp": 1}, "qwen3-8b, tp 2"),
                                   ("qwen3-30b-a3b", {"tp": 2, "dp": 2}, "qwen3-30b-a3b, tp 2, dp 2")):
        table = _targets("vllm", modes, model, parallel)
        assert "| yes |" not in table and "| target |" not in table
        assert f"this run ({shape}) is not checked against them" in table


def _with_floor(modes: dict, forward: dict[str, float]) -> dict:
    """``modes`` whose bcg configurations measured ``forward`` and a 3.5 ms floor (14 GB at 4 TB/s)."""
    for mode in ("bcg", "bcg_compile"):
        modes[mode].update(forward_ms=dict(forward), weight_bytes=16 * 10**9, vocab_weight_bytes=2 * 10**9,
                           copy_bandwidth_gbs=4000.0)
    return modes


def test_the_8b_shape_is_checked_against_the_same_targets_and_the_weight_read_floor():
    modes = _with_floor(_vllm_modes(), {"16": 4.2, "1024": 9.0})  # 1024 is past the floor's sizes
    small = _targets("vllm", modes)
    large = _targets("vllm", modes, "qwen3-8b")
    assert large.startswith("## Targets (H200, Qwen3-8B shape)\n")
    assert "| bcg / native (e2e, N <= 512) | <= 0.9 | 0.800 | yes |" in large  # the same rows as the 0.6B shape
    assert "| bcg forward / weight-read floor (N <= 128) | <= 1.25 | 1.200 | yes |" in large
    assert "| bcg_compile forward / weight-read floor (N <= 128) | <= 1.25 | 1.200 | yes |" in large
    assert ("| bcg_compile_graph forward / weight-read floor (N <= 128) | <= 1.25 | not measured | - |"
            in large)
    assert "weight-read floor" not in small and "weight-read floor" in large.split("| target |")[0]
    assert "- bcg (torch_compile false): 8 of 9 measured targets met" in large


def test_the_floor_takes_the_fastest_copy_rate_of_the_modes_processes():
    """The run merges each N's fastest forward over rounds, and the floor pairs it with the fastest
    copy the mode's processes measured, not with the first round's alone."""
    data = {"weight_bytes": 16 * 10**9, "vocab_weight_bytes": 2 * 10**9, "copy_bandwidth_gbs": 3500.0,
            "rounds": [{"copy_bandwidth_gbs": 3500.0}, {"copy_bandwidth_gbs": 4000.0}, {"error": "exit code 1"}]}
    assert targets.weight_floor(data) == pytest.approx(3.5)  # 14 GB at 4 TB/s
    assert targets.weight_floor({**data, "vocab_weight_bytes": 16 * 10**9}) is None  # nothing left to read


@pytest.mark.parametrize("change, figure", [
    (lambda m: m["bcg"]["forward_ms"].update({"16": 4.9}), "1.400 | no"),  # past the limit
    (lambda m: m["bcg"].update(vocab_weight_bytes=16 * 10**9), "not measured | -"),  # no weight left to read
    (lambda m: m["bcg"]["forward_ms"].pop("16"), "not measured | -"),  # an N measured end to end only
    (lambda m: m["bcg"].update(copy_bandwidth_gbs=None), "not measured | -"),  # no bandwidth: no floor
])
def test_weight_read_floor_target_negative_controls(change, figure):
    modes = _with_floor(_vllm_modes(), {"16": 4.2, "1024": 9.0})
    change(modes)
    assert f"| bcg forward / weight-read floor (N <= 128) | <= 1.25 | {figure} |" in _targets("vllm", modes,
                                                                                               "qwen3-8b")


def test_the_targets_heading_names_the_gpu_of_a_run_on_another_gpu_than_the_limits_are_set_on():
    modes = _vllm_modes()
    on_h200 = _targets("vllm", modes, "qwen3-0.6b", None, "NVIDIA H200")
    on_h100 = _targets("vllm", modes, "qwen3-0.6b", None, "NVIDIA H100 80GB HBM3")
    assert on_h200.startswith("## Targets (H200, Qwen3-0.6B shape)\n")
    assert on_h100.startswith("## Targets (set for the H200 and the Qwen3-0.6B shape; this run: NVIDIA H100 80GB HBM3)\n")
    assert on_h100.split("\n", 1)[1] == on_h200.split("\n", 1)[1]  # read against the same limits


def test_report_shows_memory_beyond_the_kv_cache_only_when_measured():
    result = {
        "engine": "vllm", "engine_version": "0.26.0", "model": {"name": "qwen3-0.6b"}, "gpu": "GPU",
        "date": "2026-11-30T00:00:00Z", "env": {"torch": "2.11.0"}, "sizes": [16],
        "modes": {
            "native": {"e2e_ms": {"16": 5.0}, "device_used_gib": 70.0, "kv_cache_gib": 66.0},
            "bcg": {"e2e_ms": {"16": 5.0}, "device_used_gib": 69.5, "kv_cache_gib": 66.5},
        },
    }
    table = harness.to_markdown(result).split("## Device memory once every N was served", 1)[1]
    assert "| native | 70.000 | 66.000 | 4.000 | 0.750 |" in table  # bcg: 69.5 - 66.5 = 3 of native's 4
    assert "| bcg | 69.500 | 66.500 | 3.000 | - |" in table
    for d in result["modes"].values():
        del d["kv_cache_gib"]
    assert "Device memory once every N" not in harness.to_markdown(result)


def test_report_sets_bcgs_own_graph_memory_and_the_estimate_beside_the_capture_only_when_recorded():
    """bcg mode keeps vLLM's decode graphs beside its buckets: the report shows bcg's own share, and
    the graph memory vLLM's worker estimated before sizing the KV cache."""
    result = {
        "engine": "vllm", "engine_version": "0.33.0", "model": {"name": "qwen3-0.6b"}, "gpu": "GPU",
        "date": "2026-11-30T00:00:00Z", "env": {"torch": "2.14.1"}, "sizes": [16],
        "modes": {
            "full": {"e2e_ms": {"16": 5.0}, "init_s": 10.0, "capture_s": 3.0, "graph_mem_gib": 0.7,
                     "graph_mem_estimate_gib": 0.75},
            "bcg": {"e2e_ms": {"16": 5.0}, "init_s": 11.0, "capture_s": 2.0, "graph_mem_gib": 0.9,
                    "bcg_graph_gib": 0.65},
        },
    }
    md = harness.to_markdown(result)
    assert ("| mode | init s | capture s | graph memory GiB | of which bcg's buckets GiB "
            "| vLLM's estimate before capture GiB |") in md
    assert "| full | 10.00 | 3.00 | 0.700 | - | 0.750 |" in md
    assert "| bcg | 11.00 | 2.00 | 0.900 | 0.650 | - |" in md
    del result["modes"]["full"]["graph_mem_estimate_gib"]
    md = harness.to_markdown(result)
    assert "vLLM's estimate before capture" not in md and "| bcg | 11.00 | 2.00 | 0.900 | 0.650 |" in md
    del result["modes"]["bcg"]["bcg_graph_gib"]
    md = harness.to_markdown(result)
    assert "of which bcg's buckets" not in md and "| bcg | 11.00 | 2.00 | 0.900 |" in md


def test_bcg_compile_gets_its_own_ratios_against_the_hosts_modes_only():
    rounds = {"native_ladder": [5.0, 4.0], "bcg": [5.0, 5.0], "bcg_compile": [6.0, 4.4]}
    modes = {m: {"e2e_ms": {"16": min(v)}, "rounds": [{"e2e_ms": {"16": x}} for x in v]} for m, v in rounds.items()}
    result = {"engine": "vllm", "engine_version": "0.26.0", "model": {"name": "qwen3-0.6b"}, "gpu": "GPU",
              "date": "2026-11-30T00:00:00Z", "env": {"torch": "2.11.0"}, "sizes": [16], "modes": modes}
    md = harness.to_markdown(result)
    minimum, paired = md.split("## End-to-end ratios of bcg_compile (below 1: bcg_compile faster)")[1].split(
        "## End-to-end ratios of bcg_compile paired by round")
    assert "| N | bcg_compile / native_ladder | bcg_compile / best other |" in minimum  # not against bcg
    assert "| 16 | 1.100 | 1.100 |" in minimum  # 4.4 / 4.0
    assert "| 16 | 1.150 |" in paired.split("##")[0]  # median of 6/5 and 4.4/4
    assert "bcg / bcg_compile" in md.split("## End-to-end ratios of bcg_compile")[0]  # bcg's tables unchanged


def test_render_without_matplotlib_says_so_on_stderr_and_in_the_report(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = {
        "engine": "sglang", "engine_version": "0.5.17", "model": {"name": "qwen3-0.6b"}, "gpu": "GPU",
        "date": "2026-11-29T00:00:00Z", "env": {"torch": "2.11.0"}, "sizes": [16],
        "modes": {"bcg": {"e2e_ms": {"16": 10.0}, "capture_s": 4.0, "graph_mem_gib": 0.5}},
    }
    path = tmp_path / "sglang-qwen3-0.6b-2026-11-29.json"
    path.write_text(json.dumps(result))
    assert [p.name for p in harness.render(path)] == ["sglang-qwen3-0.6b-2026-11-29.md"]
    err = capsys.readouterr().err
    assert "matplotlib is not installed, so no plots were drawn" in err and 'pip install "bcg-plugin[bench]"' in err
    md = (tmp_path / "sglang-qwen3-0.6b-2026-11-29.md").read_text()
    assert "Plots not drawn: matplotlib is not installed" in md and "![" not in md


def test_the_first_failure_is_the_first_failed_process_in_run_order_with_its_cause():
    tail = "Traceback (most recent call last):\n  File x\nValueError: bad size\nINFO shutting down\n"
    result = {"order": ["bcg", "native", "native", "bcg"], "modes": {
        "bcg": {"e2e_ms": {}, "rounds": [{"e2e_ms": {}}, {"error": "timed out after 10 s", "log_tail": "hung"}]},
        "native": {"e2e_ms": {}, "rounds": [{"e2e_ms": {}}, {"error": "exit code 1", "log_tail": tail}]},
    }}
    assert harness.first_failure(result) == "native: exit code 1: ValueError: bad size"
    result["modes"]["native"]["rounds"][1] = {"e2e_ms": {}}
    assert harness.first_failure(result) == "bcg: timed out after 10 s: hung"  # no exception named: the last line
    result["modes"]["bcg"]["rounds"][1] = {"e2e_ms": {}}
    assert harness.first_failure(result) is None


def test_a_bench_stopped_while_a_mode_runs_ends_that_modes_processes(monkeypatch):
    import pytest

    ended = []

    class Running:
        pid, returncode = 4321, None

        def __init__(self, cmd, **kwargs):
            pass

        def communicate(self, timeout=None):
            raise KeyboardInterrupt

    monkeypatch.setattr(harness.subprocess, "Popen", Running)
    monkeypatch.setattr(report, "_tracked_files_changed", lambda start: False)  # spawns git
    monkeypatch.setattr(harness, "end_group", lambda proc: ended.append(proc.pid))
    with pytest.raises(KeyboardInterrupt):
        harness.run_mode("vllm", "bcg", "qwen3-0.6b", [16], 60)
    assert ended == [4321]


def _vllm_result(modes: dict, sizes: list[int], layers: int | None = 28) -> dict:
    model = {"name": "qwen3-0.6b", **({"num_hidden_layers": layers} if layers else {})}
    return {"engine": "vllm", "engine_version": "0.33.0", "model": model, "gpu": "GPU",
            "date": "2026-11-30T00:00:00Z", "env": {"torch": "2.11.0"}, "sizes": sizes, "modes": modes}


def test_report_gives_the_host_time_per_attention_break_when_both_attention_modes_ran():
    modes = {"bcg_break": {"e2e_ms": {"16": 5.0, "256": 6.0}, "forward_host_ms": {"16": 3.0, "256": 3.5}},
             "bcg_graph": {"e2e_ms": {"16": 4.0, "256": 6.0}, "forward_host_ms": {"16": 1.6, "256": 3.5},
                           "graph_attention_buckets": [16, 32, 64, 128]}}
    section = harness.to_markdown(_vllm_result(modes, [16, 256])).split("## Host time per attention break", 1)[1]
    assert "| 16 | 50.0 |" in section  # (3.0 - 1.6) ms over 28 layers
    assert "| 256 |" not in section.split("##")[0]  # a bucket where bcg_graph breaks too
    assert harness.break_cost(modes, 28, ["16", "256"]) == pytest.approx({"16": 0.05})
    assert "per attention break" not in harness.to_markdown(_vllm_result(modes, [16, 256], layers=None))
    inside = modes["bcg_graph"].pop("graph_attention_buckets")  # a bcg_graph that captured none inside
    assert harness.break_cost(modes, 28, ["16", "256"]) == {}
    modes["bcg_graph"]["graph_attention_buckets"] = inside
    del modes["bcg_graph"]
    assert "per attention break" not in harness.to_markdown(_vllm_result(modes, [16, 256]))


def test_on_sglang_the_default_stands_in_for_bcg_graph_where_it_kept_attention_inside():
    modes = {"bcg_break": {"e2e_ms": {"16": 5.0, "1024": 6.0}, "forward_host_ms": {"16": 3.0, "1024": 3.5}},
             "bcg": {"e2e_ms": {"16": 4.0, "1024": 6.0}, "forward_host_ms": {"16": 1.6, "1024": 3.5},
                     "graph_attention_buckets": [16, 32, 512]}}
    result = {**_vllm_result(modes, [16, 1024]), "engine": "sglang", "engine_version": "0.5.23"}
    section = harness.to_markdown(result).split("## Host time per attention break", 1)[1].split("##")[0]
    assert "`bcg_break` less `bcg`'s" in section and "| 16 | 50.0 |" in section and "| 1024 |" not in section
    assert "vLLM" not in section
    modes["bcg"]["graph_attention_buckets"] = []  # the default broke in every bucket (another backend)
    assert harness.break_cost(modes, 28, ["16", "1024"]) == {}


def test_the_weight_read_floor_reaches_the_report_through_the_harness(tmp_path, monkeypatch):
    """The mode process's weight bytes and copy bandwidth survive the harness's merge of rounds; the
    report divides the forward by the floor at N <= 128 only."""
    def fake_run_mode(engine, mode, model, sizes, timeout_s, parallel, profile_tokens, attention_backend=None):
        return {"e2e_ms": {str(n): 9.0 for n in sizes}, "forward_ms": {"16": 4.2, "128": 7.0, "256": 9.0},
                "weight_bytes": 16 * 10**9, "vocab_weight_bytes": 2 * 10**9, "copy_bandwidth_gbs": 4000.0}

    monkeypatch.setattr(harness, "run_mode", fake_run_mode)
    monkeypatch.setattr(harness.importlib.metadata, "version", lambda name: "9.9.9")
    path = harness.run("vllm", "qwen3-8b", [16, 128, 256], ["bcg_graph", "full"], tmp_path, 10, rounds=2)
    result = json.loads(path.read_text())
    data = result["modes"]["bcg_graph"]
    assert (data["weight_bytes"], data["vocab_weight_bytes"], data["copy_bandwidth_gbs"]) == (16e9, 2e9, 4000.0)
    assert targets.weight_floor(data) == pytest.approx(3.5)  # 14 GB read at 4 TB/s
    section = harness.to_markdown(result).split("## Model forward over the weight-read floor", 1)[1]
    assert "| bcg_graph | 14.000 | 4000 | 3.500 |" in section
    assert "| 16 | 1.200 | 1.200 |" in section and "| 128 | 2.000 | 2.000 |" in section
    assert "| 256 |" not in section.split("\n##")[0]
    for r in (data, *data["rounds"]):  # a mode that did not measure it (tp > 1) has no floor
        r["copy_bandwidth_gbs"] = None
    assert targets.weight_floor(data) is None


def test_a_result_names_the_plugin_release_and_the_commit_that_ran(monkeypatch):
    """A copied tree without git (a GPU host) is named by GIT_COMMIT; the report's header carries it."""
    monkeypatch.setenv("GIT_COMMIT", "0123abcd")
    monkeypatch.setattr(report.importlib.metadata, "version", lambda name: "9.9.9")
    assert report.plugin_source() == {"bcg_plugin": "9.9.9", "commit": "0123abcd"}
    result = _vllm_result({"bcg": {"e2e_ms": {"16": 4.0}}}, [16])
    monkeypatch.delenv("GIT_COMMIT")
    monkeypatch.setattr(report, "_tracked_files_changed", lambda start: False)  # an edited tree: its own test
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(report.__file__).parent, capture_output=True,
                          text=True).stdout.strip()
    assert head and report.plugin_source()["commit"] == head[:12]  # read from the checkout's own files
    assert "bcg-plugin" not in harness.to_markdown(result)  # results written before the stamp existed
    monkeypatch.setenv("GIT_COMMIT", "0123abcd")
    result["env"].update(report.plugin_source())
    assert ", torch 2.11.0. bcg-plugin 9.9.9 at 0123abcd. One request" in harness.to_markdown(result).splitlines()[2]


@pytest.mark.skipif(not __import__("shutil").which("git"), reason="needs the git command")
def test_a_tree_whose_tracked_files_differ_from_its_commit_is_marked_dirty(tmp_path, monkeypatch):
    """A result names the commit of the tree that ran; a checkout whose HEAD is not that tree (edited
    files, or a copied tree beside an older git folder) must not pass for it."""
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "bcg_bench").mkdir()
    (tmp_path / "bcg_bench" / "report.py").write_text("a = 1\n")
    git("add", "-A")
    git("commit", "-q", "-m", "c")
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    monkeypatch.setattr(report, "__file__", str(tmp_path / "bcg_bench" / "report.py"))
    head = report._checkout_head(tmp_path)
    assert report.plugin_source()["commit"] == head[:12]
    (tmp_path / "bcg_bench" / "report.py").write_text("a = 2\n")
    assert report.plugin_source()["commit"] == head[:12] + "-dirty"
    monkeypatch.setenv("GIT_COMMIT", "f" * 40)  # the tree was named by whoever copied it
    assert report.plugin_source()["commit"] == "f" * 12


def test_the_commit_is_read_from_a_linked_worktree_as_from_a_plain_checkout(tmp_path):
    """``git worktree add`` leaves a ``.git`` file naming the worktree's folder under the main
    checkout's ``.git``, whose ``commondir`` holds the branches."""
    main = tmp_path / "main" / ".git"
    (main / "refs" / "heads").mkdir(parents=True)
    (main / "refs" / "heads" / "topic").write_text("a" * 40 + "\n")
    (main / "packed-refs").write_text("b" * 40 + " refs/heads/old\n")
    linked = main / "worktrees" / "wt"
    linked.mkdir(parents=True)
    (linked / "commondir").write_text("../..\n")
    (linked / "HEAD").write_text("ref: refs/heads/topic\n")
    tree = tmp_path / "wt" / "pkg"
    tree.mkdir(parents=True)
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {linked}\n")
    assert report._checkout_head(tree) == "a" * 40
    (linked / "HEAD").write_text("ref: refs/heads/old\n")  # a branch git packed
    assert report._checkout_head(tree) == "b" * 40
    (linked / "HEAD").write_text("c" * 40 + "\n")  # detached
    assert report._checkout_head(tree) == "c" * 40


def test_sglang_runs_bcg_graph_only_when_named():
    """bcg with attention inside every bucket needs flashinfer on SGLang: a default run leaves it out."""
    import argparse

    from bcg_bench import cli

    parser = argparse.ArgumentParser()
    cli.add_commands(parser)
    assert "bcg_graph" not in parser.parse_args(["sglang"]).modes
    assert parser.parse_args(["sglang", "--modes", "full,bcg,bcg_graph"]).modes == ["full", "bcg", "bcg_graph"]
    assert "bcg_graph" in parser.parse_args(["vllm"]).modes  # vLLM's default run is every mode
