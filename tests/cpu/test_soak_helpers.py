"""The GPU soak test's engine-free parts: traffic, the flat-memory rule, hang naming, lockstep, selection."""

import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = ROOT / "tests" / "gpu"


def _load_helpers():
    if "soak_helpers" in sys.modules:
        return sys.modules["soak_helpers"]
    spec = importlib.util.spec_from_file_location("soak_helpers", GPU_TESTS / "soak_helpers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak_helpers"] = module
    spec.loader.exec_module(module)
    return module


soak = _load_helpers()


def _waves(seed, n):
    return list(itertools.islice(soak.traffic(seed), n))


# -- traffic ---------------------------------------------------------------------------------------


def test_traffic_is_deterministic_per_seed():
    assert _waves(7, 20) == _waves(7, 20)
    assert _waves(7, 20) != _waves(8, 20)


def test_traffic_ranges_and_mix():
    waves = _waves(0, 200)
    requests = [r for w in waves for r in w.requests]
    lengths = [len(r.ids) for r in requests]
    assert [w.index for w in waves] == list(range(200))
    assert all(1 <= n <= soak.MAX_PROMPT for n in lengths)
    assert all(1 <= r.max_tokens <= soak.MAX_OUTPUT for r in requests)
    assert all(soak.TOKEN_IDS[0] <= t < soak.TOKEN_IDS[1] for r in requests for t in r.ids)
    assert all(1 <= len(w.requests) <= soak.MAX_WAVE for w in waves)
    # Log-uniform: small prompts dominate, long ones (chunked prefill) still come up.
    assert statistics.median(lengths) < 200
    assert sum(n <= 64 for n in lengths) > len(lengths) / 3
    assert sum(n > 4096 for n in lengths) >= 20
    assert {1, 2}.issubset(set(lengths))
    assert {r.max_tokens for r in requests} == set(range(1, soak.MAX_OUTPUT + 1))
    # Idle gaps of seconds and single-request waves (some DP ranks idle), but not most of the time.
    idle = [w.gap_s for w in waves if w.gap_s >= soak.IDLE_GAP_S[0]]
    assert 0.05 * len(waves) < len(idle) < 0.3 * len(waves)
    assert all(soak.IDLE_GAP_S[0] <= g <= soak.IDLE_GAP_S[1] for g in idle)
    assert all(0 <= w.gap_s <= soak.IDLE_GAP_S[1] for w in waves)
    assert 0.1 * len(waves) < sum(len(w.requests) == 1 for w in waves) < 0.4 * len(waves)
    # Some prompts extend a recent prompt's prefix (prefix-cache hits).
    recent = [tuple(r.ids[:8]) for w in waves for r in w.requests if len(r.ids) >= 8]
    assert len(recent) - len(set(recent)) > 10


def test_wave_token_totals():
    wave = soak.Wave(0, [soak.Request([1, 2, 3], 4), soak.Request([5], 2)], 0.1)
    assert (wave.prompt_tokens, wave.output_tokens) == (4, 6)


def test_probe_prompts_start_with_the_edges():
    prompts = soak.probe_prompts(1, 30, (1, 2, 2048, 8192))
    assert len(prompts) == 30
    assert [len(p) for p in prompts[:4]] == [1, 2, 2048, 8192]
    assert all(1 <= len(p) <= soak.MAX_PROMPT for p in prompts)
    assert prompts == soak.probe_prompts(1, 30, (1, 2, 2048, 8192))


def test_soak_seconds():
    assert soak.soak_seconds({}) == 600.0
    assert soak.soak_seconds({"BCG_SOAK_SECONDS": "90"}) == 90.0
    for bad in ("0", "-5", "ten", "inf"):
        with pytest.raises(ValueError, match="BCG_SOAK_SECONDS"):
            soak.soak_seconds({"BCG_SOAK_SECONDS": bad})


# -- memory ----------------------------------------------------------------------------------------


def _series(values, seconds=600.0):
    step = seconds / (len(values) - 1)
    return [(i * step, v if isinstance(v, list) else [v]) for i, v in enumerate(values)]


def test_flat_memory_passes_despite_warm_up_growth():
    # 3 GiB of growth in the first third (pools reach their working size), then +-40 MiB of noise.
    warm = [20_000 + 100 * i for i in range(30)]
    steady = [23_000 + (40 if i % 3 == 0 else -40 if i % 3 == 1 else 0) for i in range(60)]
    verdict = soak.memory_flatness(_series(warm + steady), bound_mib=256)
    assert verdict["problem"] is None, verdict
    assert verdict["gpus"][0]["span"] == 80
    assert verdict["gpus"][0]["overall_min"] == 20_000
    assert verdict["samples_after_warmup"] == 60


def test_growing_memory_fails_negative_control():
    # A slow leak, 8 MiB per wave: each step looks like noise, ~480 MiB over the last two thirds.
    values = [23_000 + 8 * i for i in range(90)]
    verdict = soak.memory_flatness(_series(values), bound_mib=256)
    assert verdict["problem"] is not None and "GPU 0" in verdict["problem"] and "bound 256 MiB" in verdict["problem"]
    assert verdict["gpus"][0]["span"] >= 256


def test_one_leaking_gpu_of_two_is_named():
    values = [[30_000, 30_000 + 10 * i] for i in range(90)]
    verdict = soak.memory_flatness(_series(values), bound_mib=256)
    assert verdict["problem"].startswith("GPU 1:")
    assert verdict["gpus"][0]["span"] == 0


def test_too_few_samples_after_warm_up_cannot_pass():
    verdict = soak.memory_flatness([(0.0, [1.0]), (10.0, [1.0]), (30.0, [1.0])], bound_mib=256)
    assert "too short" in verdict["problem"]
    assert soak.memory_flatness([], bound_mib=256)["problem"] == "no memory samples"


def test_nvidia_smi_rows_and_visible_gpus():
    rows = soak.parse_smi("0, GPU-aaaa-1111, 1024\n1, GPU-bbbb-2222, 2048\n2, GPU-cccc-3333, 512\n")
    assert rows == [(0, "GPU-aaaa-1111", 1024.0), (1, "GPU-bbbb-2222", 2048.0), (2, "GPU-cccc-3333", 512.0)]
    assert soak.select_gpus(rows, 2, None) == [0, 1]
    assert soak.select_gpus(rows, 2, "2,0") == [2, 0]
    assert soak.select_gpus(rows, 1, "GPU-bbbb") == [1]
    with pytest.raises(ValueError, match="2 GPUs needed, 1 visible"):
        soak.select_gpus(rows, 2, "1")
    with pytest.raises(ValueError, match="'7'"):
        soak.select_gpus(rows, 1, "7")


# -- hangs -----------------------------------------------------------------------------------------


def test_unfinished_phase_names_the_wave():
    events = [{"event": "start", "phase": "probes", "t": 1.0}, {"event": "done", "phase": "probes", "t": 2.0},
              {"event": "start", "phase": "wave 0", "t": 2.0, "requests": 3},
              {"event": "done", "phase": "wave 0", "t": 3},
              {"event": "start", "phase": "wave 1", "t": 3.5, "requests": 1, "prompt_tokens": 700},
              {"event": "hang", "phase": "wave 1", "t": 124.0}]
    start = soak.unfinished_phase(events)
    assert start["phase"] == "wave 1"
    assert soak.describe_phase(start) == "wave 1 (started 4 s after the engine was up, requests 1, prompt_tokens 700)"
    assert soak.unfinished_phase(events[:4]) is None
    assert soak.describe_phase(None).startswith("engine start-up")


def test_watchdog_ends_a_stuck_phase_and_logs_it(tmp_path):
    progress = tmp_path / "progress.jsonl"
    script = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import soak_helpers as s\n"
        "w = s.Watchdog(s.Progress(sys.argv[2]))\n"
        "with w.phase('wave 0', 5.0): pass\n"
        "with w.phase('wave 1', 0.3, requests=2): time.sleep(30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(GPU_TESTS), str(progress)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == soak.HANG_EXIT, proc.stderr
    assert "wave 1 did not finish within 0 s" in proc.stderr and "time.sleep" not in proc.stdout
    events = soak.read_progress(progress)
    assert [e["event"] for e in events] == ["start", "done", "start", "hang"]
    assert soak.unfinished_phase(events)["phase"] == "wave 1"


def test_a_hang_is_recognised_from_either_exit():
    """The watchdog's exit status, or faulthandler's backstop (for a main thread stuck holding the GIL)."""
    script = "import faulthandler, time; faulthandler.dump_traceback_later(0.2, exit=True); time.sleep(30)"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert soak.hung(proc.returncode, proc.stdout + proc.stderr), (proc.returncode, proc.stderr)
    assert soak.hung(soak.HANG_EXIT, "")
    assert not soak.hung(1, "Traceback (most recent call last):\nRuntimeError: Timeout (in NCCL)")
    assert not soak.hung(0, "Timeout (0:02:00)!")


def test_read_progress_stops_at_a_cut_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"event": "start", "phase": "wave 0", "t": 0}) + "\n{\"event\": \"do")
    assert len(soak.read_progress(path)) == 1
    assert soak.read_progress(tmp_path / "missing.jsonl") == []


# -- lockstep --------------------------------------------------------------------------------------


def test_replay_sequences_use_the_dp_maximum():
    forwards = [
        {"rank": 0, "tokens": 100, "graph": True, "across_dp": [100, 300]},
        {"rank": 1, "tokens": 300, "graph": True, "across_dp": [100, 300]},
        {"rank": 0, "tokens": 50, "graph": False, "across_dp": [50, 0]},
        {"rank": 0, "tokens": 64, "graph": True, "across_dp": None},
    ]
    assert soak.replay_sequences(forwards) == {0: [300, 64], 1: [300]}


def test_lockstep_problem():
    assert soak.lockstep_problem({0: [16, 32], 1: [16, 32]}, 2) is None
    assert soak.lockstep_problem({0: {"16": 3}}, 1) is None
    assert "ranks [0]" in soak.lockstep_problem({0: [16]}, 2)
    assert "first difference at replay 1" in soak.lockstep_problem({0: [16, 32, 48], 1: [16, 64, 48]}, 2)
    assert "3 forwards, rank 0 2" in soak.lockstep_problem({0: [16, 32], 1: [16, 32, 48]}, 2)
    problem = soak.lockstep_problem({0: {"16": 3, "32": 1}, 1: {"16": 3, "64": 1}}, 2)
    assert "'32': (1, 0)" in problem and "'64': (0, 1)" in problem


def test_summary_path(tmp_path):
    layout = {"tp": 2, "dp": 2}
    name = "soak-sglang-qwen3-8b-tp2-dp2-2026-11-30T0102Z.json"
    assert soak.summary_path(None, "sglang", "qwen3-8b", layout, "2026-11-30T0102Z", str(tmp_path)) == \
        tmp_path / "bcg-soak" / name
    assert soak.summary_path(str(tmp_path), "sglang", "qwen3-8b", layout, "2026-11-30T0102Z", "/x") == tmp_path / name
    assert soak.summary_path("out/", "vllm", "qwen3-0.6b", {"tp": 1, "dp": 1}, "S", "/x") == \
        Path("out") / "soak-vllm-qwen3-0.6b-S.json"
    assert soak.summary_path(str(tmp_path / "f.json"), "vllm", "m", layout, "S", "/x") == tmp_path / "f.json"
    assert soak.summary_path("out/", "vllm", "m", {"tp": 1}, "S", "/x", variant="torch-compile") == \
        Path("out/soak-vllm-torch-compile-m-S.json")


# -- selection -------------------------------------------------------------------------------------


def _conftest():
    spec = importlib.util.spec_from_file_location("bcg_tests_conftest", ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("markexpr, env, selected", [
    ("", {}, False),
    ("gpu", {}, False),
    ("gpu and not soak", {}, False),
    ("not soak", {}, False),
    ("soak", {}, True),
    ("gpu and soak", {}, True),
    ("not gpu or (soak)", {}, True),
    ("", {"BCG_SOAK_SECONDS": "60"}, True),
    ("gpu", {"BCG_SOAK_SECONDS": " "}, False),
])
def test_soak_selection_rule(markexpr, env, selected):
    assert _conftest().soak_requested(markexpr, env) is selected


@pytest.mark.parametrize("args, reason", [
    ([], "soak test: runs with -m soak"),
    (["-m", "soak"], "needs a CUDA device"),
])
def test_soak_runs_only_when_selected(args, reason):
    """The default command skips the soak; ``-m soak`` selects it (with no visible GPU it then stops at
    the usual CUDA skip). Also: the module collects without a GPU or engine-specific imports."""
    env = {k: v for k, v in os.environ.items() if k != "BCG_SOAK_SECONDS"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu/test_soak_gpu.py", "-rs", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT, env={**env, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0 and "2 skipped" in proc.stdout and reason in proc.stdout, proc.stdout + proc.stderr


# -- the soak's driver and summary with a fake engine ----------------------------------------------


def test_driver_runs_waves_until_time_and_records_everything(tmp_path, monkeypatch, gpu_test_module):
    gpu_test = gpu_test_module("test_soak_gpu")
    monkeypatch.setenv("BCG_SOAK_SECONDS", "1.5")
    probes, seen, used = [], [], iter(range(10_000, 100_000, 10))

    def generate(requests):
        seen.append(len(requests))
        return [r.max_tokens if i else r.max_tokens - 1 for i, r in enumerate(requests)]  # one short each wave

    memory = soak.GpuMemory("fake", lambda: [float(next(used))])
    run = gpu_test.drive("soak", lambda: probes.append(1) or ["answer"], generate, memory, tmp_path / "p.jsonl")
    assert len(probes) == 2 and run["probes_start"] == run["probes_end"] == ["answer"]
    assert len(run["waves"]) == len(seen) >= 1 and run["seconds_run"] >= 1.5
    assert len(run["memory"]) == len(seen) + 1 and run["memory_source"] == "fake"
    assert len(run["short_outputs"]) == len(seen)
    assert run["short_outputs"][0]["got"] == run["short_outputs"][0]["asked"] - 1
    events = soak.read_progress(tmp_path / "p.jsonl")
    assert events[0]["phase"] == "probes before the traffic" and events[-1]["phase"] == "probes after the traffic"
    assert soak.unfinished_phase(events) is None

    problems = []
    verdict = gpu_test.check_run(json.loads(json.dumps(run)), problems)
    assert any("another number of output tokens" in p for p in problems)
    out = tmp_path / "summary.json"
    monkeypatch.setenv("BCG_SOAK_OUT", str(out))
    gpu_test.write_summary("vllm", 1.5, run, verdict, {"replays_per_rank": [3]}, {"count": 30}, problems)
    summary = json.loads(out.read_text())
    assert summary["passed"] is False and summary["traffic"]["waves"] == len(seen)
    assert summary["parallel"] == {"tp": gpu_test.TP, "dp": gpu_test.DP} and summary["engine"] == "vllm"
    assert {"date", "gpu", "torch", "env", "memory", "probes", "bcg", "seconds_run"} <= summary.keys()


def test_summary_of_a_hung_engine_counts_the_waves_it_finished(tmp_path, monkeypatch, gpu_test_module):
    gpu_test = gpu_test_module("test_soak_gpu")
    run = {"error": "hang: wave 2 (...) did not finish within its deadline", "log": "stacks",
           "events": [{"event": "done", "phase": "wave 0"}, {"event": "done", "phase": "wave 1"},
                      {"event": "start", "phase": "wave 2", "t": 9.0}]}
    problems = []
    assert gpu_test.check_run(run, problems) == {}
    assert problems[0].startswith("hang: wave 2") and "stacks" in problems[0]
    monkeypatch.setenv("BCG_SOAK_OUT", str(tmp_path) + os.sep)
    path = gpu_test.write_summary("sglang", 600, run, {}, {}, {}, problems)
    summary = json.loads(path.read_text())
    assert path.parent == tmp_path and path.name.startswith(f"soak-sglang-{gpu_test.MODEL}-")
    assert summary["traffic"] == {"waves_completed": 2} and summary["problems"] == [run["error"]]


def test_dp_share_deals_round_robin_and_leaves_ranks_idle_in_small_waves():
    assert soak.dp_share(5, 0, 2) == [0, 2, 4] and soak.dp_share(5, 1, 2) == [1, 3]
    assert soak.dp_share(1, 0, 2) == [0] and soak.dp_share(1, 1, 2) == []  # rank 1 idles
    assert sorted(soak.dp_share(7, 0, 3) + soak.dp_share(7, 1, 3) + soak.dp_share(7, 2, 3)) == list(range(7))
    with pytest.raises(ValueError, match="rank"):
        soak.dp_share(3, 2, 2)


def _dp_drive(gpu_test, tmp_path, agree_of):
    """Two DP ranks' drivers in threads; rank 1 always wants to stop at once. Waves per rank."""
    import threading

    waves, errors = {0: [], 1: []}, []

    def rank_main(rank):
        steps = gpu_test.DpSteps(tmp_path / "dp", rank, 2)
        steps.barrier.timeout_s = 5.0

        def generate(requests):
            waves[rank].append(len(requests))
            mine = soak.dp_share(len(requests), rank, 2)
            return [r.max_tokens if i in mine else None for i, r in enumerate(requests)]

        def agree(stop):
            return agree_of(steps)(stop or rank == 1)

        try:
            run = gpu_test.drive("soak", lambda: [], generate, soak.GpuMemory("fake", lambda: [1.0]),
                                 tmp_path / f"p{rank}.jsonl", agree=agree)
            assert run["short_outputs"] == []  # another rank's requests (None) are not short outputs
        except Exception as e:  # noqa: BLE001  reported below
            errors.append((rank, e))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return waves, errors


def test_dp_ranks_run_the_same_waves_and_stop_when_rank_0_does(tmp_path, monkeypatch, gpu_test_module):
    gpu_test = gpu_test_module("test_soak_gpu")
    monkeypatch.setenv("BCG_SOAK_SECONDS", "1.0")
    waves, errors = _dp_drive(gpu_test, tmp_path, lambda steps: steps.agree)
    assert errors == []
    assert len(waves[0]) >= 1 and waves[0] == waves[1]


def test_dp_ranks_deciding_alone_fall_out_of_step_negative_control(tmp_path, monkeypatch, gpu_test_module):
    gpu_test = gpu_test_module("test_soak_gpu")
    monkeypatch.setenv("BCG_SOAK_SECONDS", "1.0")

    def alone(steps):  # each rank stops on its own wish, still meeting at the barrier
        def agree(stop):
            steps.barrier.wait()
            return stop
        return agree

    waves, errors = _dp_drive(gpu_test, tmp_path, alone)
    assert waves[1] == [] and len(waves[0]) >= 1  # rank 1 left at once while rank 0 served waves
    assert errors and errors[0][0] == 0 and isinstance(errors[0][1], TimeoutError)


FAKE_ENGINE = """
import json, os, sys
engine, role, out, progress = sys.argv[1:5]
rank = int(os.environ.get("VLLM_DP_RANK", "0"))
print("engine", engine, role, "rank", rank, "barrier", bool(os.environ.get("BCG_SOAK_DP_BARRIER")))
if os.environ.get("FAIL_RANK") == str(rank):
    sys.exit(3)
json.dump({"bcg": [{"rank": rank, "mp": os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]}],
           "short_outputs": [{"rank": rank}] if rank else []}, open(out, "w"))
"""


def test_dp_soak_starts_one_process_per_rank_and_merges_them(tmp_path, monkeypatch, gpu_test_module):
    gpu_test = gpu_test_module("test_soak_gpu")
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    monkeypatch.setattr(gpu_test, "__file__", str(script))
    monkeypatch.setattr(gpu_test, "DP", 2)
    monkeypatch.delenv("FAIL_RANK", raising=False)
    run = gpu_test.run_engine("vllm", "soak", tmp_path, timeout_s=60)
    assert "error" not in run, run
    assert run["bcg_per_dp_rank"] == [[{"rank": 0, "mp": "1"}], [{"rank": 1, "mp": "1"}]]
    assert run["short_outputs"] == [{"rank": 1}]  # every rank's short outputs reach the checks
    assert "barrier True" in (tmp_path / "soak.rank1.log").read_text()

    monkeypatch.setenv("FAIL_RANK", "1")
    failed = gpu_test.run_engine("vllm", "reference", tmp_path, timeout_s=60)
    assert "reference.rank1 engine process failed (exit 3)" in failed["error"]
    assert "reference.rank0" not in failed["error"] and "--- reference.rank1 ---" in failed["log"]
