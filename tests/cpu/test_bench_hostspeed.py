"""The host-speed probe of each bench mode process, and how the report shows it."""

import json
import os
import sys

import pytest

from bcg_plugin.bench import harness, hostspeed


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

    def fake_run_mode(engine, mode, model, sizes, timeout_s, parallel, profile_tokens):
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
