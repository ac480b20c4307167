"""The host-speed probe of each bench mode process, and how the report shows it."""

import json
import os
import sys

import pytest

from bcg_bench import harness, hostspeed


def test_current_cpu_is_psutils_cpu_of_this_process(monkeypatch):
    import psutil

    monkeypatch.setattr(psutil.Process, "cpu_num", lambda self: 7, raising=False)
    assert hostspeed.current_cpu() == 7
    monkeypatch.delattr(psutil.Process, "cpu_num")  # a platform where psutil does not say
    assert hostspeed.current_cpu() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="psutil reports the CPU on Linux")
def test_samples_record_the_probe_and_the_cpus_the_thread_ran_on():
    speed = hostspeed.HostSpeed()
    assert speed.summary() is None
    for _ in range(3):
        speed.sample()
    s = speed.summary()
    assert s["samples"] == 3 and 0 < s["min_us"] <= s["probe_us"] <= s["max_us"]
    assert s["cpus"] and set(s["cpus"]) <= set(range(os.cpu_count()))


def test_the_probe_is_the_best_of_its_repeats(monkeypatch):
    # One preempted repeat (5 ms) must not make the host look slow: the probe keeps the fastest (2 ms).
    clock = iter([0.0, 0.005, 1.0, 1.002, 2.0, 2.004])
    monkeypatch.setattr(hostspeed.time, "perf_counter", lambda: next(clock))
    assert hostspeed.probe_us() == pytest.approx(2000.0)


def _speed(us):
    return {"probe_us": us, "min_us": us - 1, "max_us": us + 1, "samples": 10, "cpus": [3]}


def test_report_flags_only_processes_slower_than_the_factor():
    lines = "\n".join(hostspeed.markdown([("native", 1, _speed(1000.0)), ("bcg", 1, _speed(1050.0)),
                                          ("bcg", 2, _speed(1300.0)), ("native", 2, None)]))
    assert "| 1 | native | 1 | 1000 (999-1001) | 1.00 | 3 |" in lines
    assert "| 3 | bcg | 2 | 1300 (1299-1301) | 1.30 | 3 |" in lines
    assert "Slower than 1.10x the fastest: bcg (round 2)." in lines
    assert "bcg (round 1)" not in lines.split("Slower than")[1]
    even = "\n".join(hostspeed.markdown([("native", 1, _speed(1000.0)), ("bcg", 1, _speed(1090.0))]))
    assert "No process slower than 1.10x the fastest." in even
    assert hostspeed.markdown([("native", 1, None)]) == []


def test_the_run_report_lists_processes_in_run_order_with_their_round(tmp_path, monkeypatch):
    probes = iter([900.0, 1400.0, 980.0, 950.0])  # bcg, native, native, bcg

    def fake_run_mode(engine, mode, model, sizes, timeout_s, parallel, profile_tokens, attention_backend=None):
        return {"e2e_ms": {str(n): 5.0 for n in sizes}, "host_speed": _speed(next(probes))}

    monkeypatch.setattr(harness, "run_mode", fake_run_mode)
    monkeypatch.setattr(harness.importlib.metadata, "version", lambda name: "9.9.9")
    path = harness.run("vllm", "qwen3-0.6b", [16], ["bcg", "native"], tmp_path, 10, rounds=2)
    md = path.with_name(path.name.replace(".json", ".md")).read_text()
    section = md.split("## Host speed of each mode process")[1]
    rows = [line for line in section.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[1:3] for r in rows] == [["bcg", "1"], ["native", "1"], ["native", "2"], ["bcg", "2"]]
    assert "Slower than 1.10x the fastest: native (round 1)." in section
    assert json.loads(path.read_text())["modes"]["bcg"]["rounds"][1]["host_speed"]["probe_us"] == 950.0
    assert harness.summary_line({"e2e_ms": {"16": 5.0}, "host_speed": _speed(900.0)}) == (
        "e2e 16:5.00 (host probe 900 µs)")


def _run_with(tmp_path, monkeypatch, e2e, probes, rounds):
    seen = {m: 0 for m in e2e}

    def fake_run_mode(engine, mode, model, sizes, timeout_s, parallel, profile_tokens, attention_backend=None):
        k = seen[mode]
        seen[mode] += 1
        return {"e2e_ms": {str(n): e2e[mode][k] for n in sizes}, "host_speed": _speed(probes[mode][k])}

    monkeypatch.setattr(harness, "run_mode", fake_run_mode)
    monkeypatch.setattr(harness.importlib.metadata, "version", lambda name: "9.9.9")
    path = harness.run("vllm", "qwen3-0.6b", [16], ["native", "bcg"], tmp_path, 10, rounds=rounds)
    return path.with_name(path.name.replace(".json", ".md")).read_text()


FAST_ONLY = "## The same, over the rounds in which neither process was flagged slow"


def test_paired_ratios_over_rounds_without_a_slow_process(tmp_path, monkeypatch):
    # Round 1: bcg's process is slow (probe 1.4x) and so is its latency; rounds 2 and 3 are fair.
    md = _run_with(tmp_path, monkeypatch, {"bcg": [7.0, 4.8, 5.0], "native": [5.0, 5.0, 5.0]},
                   {"bcg": [1400.0, 1000.0, 1020.0], "native": [1000.0, 1010.0, 990.0]}, rounds=3)
    everything, fast_only = md.split(FAST_ONLY)
    assert "| 16 | 1.000 |" in everything.split("paired by round")[1]  # median of 1.4, 0.96, 1.0
    assert "| N | bcg / native (2 of 3) |" in fast_only and "| 16 | 0.980 |" in fast_only  # median of 0.96, 1.0


def test_no_fast_only_table_when_no_process_was_slow_and_a_line_when_every_round_had_one(tmp_path, monkeypatch):
    even = _run_with(tmp_path / "even", monkeypatch, {"bcg": [4.8, 5.0], "native": [5.0, 5.0]},
                     {"bcg": [1000.0, 1020.0], "native": [1000.0, 1010.0]}, rounds=2)
    assert "paired by round" in even and FAST_ONLY not in even
    every = _run_with(tmp_path / "every", monkeypatch, {"bcg": [7.0, 5.0], "native": [5.0, 7.0]},
                      {"bcg": [1400.0, 1000.0], "native": [1000.0, 1400.0]}, rounds=2)
    assert "No round is free of a slow process." in every.split(FAST_ONLY)[1].split("## Host speed")[0]


def test_rerun_slow_runs_a_flagged_process_again_in_its_place_and_keeps_the_replaced_one(tmp_path, monkeypatch):
    # Run order: native r1, bcg r1 (slow, rerun: slow again, rerun: fast), bcg r2, native r2 (slow, no reruns left).
    runs = iter([(5.0, 1000.0), (7.0, 1500.0), (6.5, 1400.0), (4.8, 1010.0), (4.9, 1000.0), (6.0, 1300.0),
                 (5.9, 1290.0), (5.8, 1280.0)])
    calls = []

    def fake_run_mode(engine, mode, model, sizes, timeout_s, parallel, profile_tokens, attention_backend=None):
        e2e, probe = next(runs)
        calls.append(mode)
        return {"e2e_ms": {str(n): e2e for n in sizes}, "host_speed": _speed(probe)}

    monkeypatch.setattr(harness, "run_mode", fake_run_mode)
    monkeypatch.setattr(harness.importlib.metadata, "version", lambda name: "9.9.9")
    path = harness.run("vllm", "qwen3-0.6b", [16], ["native", "bcg"], tmp_path, 10, rounds=2, rerun_slow=2)
    result = json.loads(path.read_text())
    assert calls == ["native", "bcg", "bcg", "bcg", "bcg", "native", "native", "native"]
    assert [r["e2e_ms"]["16"] for r in result["modes"]["bcg"]["rounds"]] == [4.8, 4.9]  # the reruns' places
    assert [r["e2e_ms"]["16"] for r in result["modes"]["native"]["rounds"]] == [5.0, 5.8]  # last try kept
    assert [(d["mode"], d["round"], d["host_speed"]["probe_us"]) for d in result["replaced"]] == [
        ("bcg", 1, 1500.0), ("bcg", 1, 1400.0), ("native", 2, 1300.0), ("native", 2, 1290.0)]
    md = path.with_name(path.name.replace(".json", ".md")).read_text()
    assert "Run again because the probe flagged them slow" in md and "bcg (round 1, probe 1500 µs)" in md
    runs = iter([(5.0, 1000.0), (7.0, 1500.0)])
    calls.clear()
    plain = harness.run("vllm", "qwen3-0.6b", [16], ["native", "bcg"], tmp_path / "plain", 10)
    assert "replaced" not in json.loads(plain.read_text()) and calls == ["native", "bcg"]  # default: no reruns
