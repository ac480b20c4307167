"""``bcg bench --profile N``: the armed N-token request's forward is profiled, once, at the rows the mode
runs it, and reported."""

from __future__ import annotations

import pytest
import torch

from bcg_bench import harness, profile
from bcg_bench.profile import PROFILE_TOKENS_ENV, ForwardProfiler


def forward(profiler: ForwardProfiler, tokens: int) -> None:
    with profiler.around(tokens):
        torch.ones(tokens, 8).mul(2).sum()


def test_only_an_armed_forward_of_exactly_n_tokens_is_profiled_and_only_once():
    armed = [False]
    profiler = ForwardProfiler(16, armed=lambda: armed[0])
    forward(profiler, 16)
    assert profiler.summary is None  # not armed: the timed requests
    armed[0] = True
    forward(profiler, 15)
    assert profiler.summary is None  # fewer rows than the request: not its prefill
    forward(profiler, 16)
    summary = profiler.summary
    assert summary["tokens"] == 16 and summary["forward_rows"] == 16
    assert summary["host_ms"] > 0 and summary["aten_ops"] >= 3
    assert {"aten::ones", "aten::mul", "aten::sum"} <= {op["name"] for op in summary["top_self_cpu_us"]}
    forward(profiler, 16)
    assert profiler.summary is summary


def test_a_request_that_pads_to_a_bucket_is_profiled_at_the_bucket():
    # vLLM's forward timer sees the padded rows: a 17-token request replays the 32-token bucket.
    profiler = ForwardProfiler(17, armed=lambda: True)
    forward(profiler, 32)
    assert profiler.summary["tokens"] == 17 and profiler.summary["forward_rows"] == 32
    table = "\n".join(profile.markdown({"bcg": {"e2e_ms": {"17": 1.0}, "host_profile": profiler.summary}}))
    assert "forward of one 17-token request" in table and "| bcg | 32 | " in table


def _event(key, count, cpu_us, device_us=0.0, device="CPU"):
    import types

    return types.SimpleNamespace(key=key, count=count, self_cpu_time_total=cpu_us,
                                 self_device_time_total=device_us, device_type=types.SimpleNamespace(name=device))


def test_the_summary_ranks_kernels_by_device_time_without_counting_their_ops_twice():
    averages = [_event("aten::mm", 2, 30.0, device_us=80.0),  # the op's own device time repeats its kernel's
                _event("cudaGraphLaunch", 3, 12.0),
                _event("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<cute::tuple<int>, "
                       "128> > >(Params)", 2, 0.0, 50.0, "CUDA"),
                _event("nvjet_sm90_tst_64x8", 2, 0.0, 80.0, "CUDA")]
    summary = profile.summarize(averages, 1.5, ["CPU", "CUDA"], 1024, 1024)
    assert summary["device_us"] == 130.0
    assert [k["name"] for k in summary["top_device_us"]] == [
        "nvjet_sm90_tst_64x8", averages[2].key]
    modes = {"bcg": {"e2e_ms": {"1024": 1.0}, "host_profile": summary}}
    table = "\n".join(profile.markdown(modes))
    assert "- bcg: 130 µs on the device in all; nvjet_sm90_tst_64x8 x2: 80; flash::FlashAttnFwdSm90 x2: 50" in table


@pytest.mark.parametrize("value, error", [("abc", "expected a token count"), ("0", "must be a token count >= 1")])
def test_a_bad_profile_size_names_the_variable(value, error):
    with pytest.raises(ValueError, match=f"{PROFILE_TOKENS_ENV}.*{error}"):
        ForwardProfiler.from_env(armed=lambda: True, environ={PROFILE_TOKENS_ENV: value})
    assert ForwardProfiler.from_env(armed=lambda: True, environ={}) is None


def test_the_report_compares_the_profiled_modes_and_names_the_others():
    def summary(graph_launches: int, kernels: int) -> dict:
        return {"tokens": 16, "host_ms": 2.5, "aten_ops": 40, "activities": ["CPU", "CUDA"],
                "cuda_runtime_calls": {"cudaGraphLaunch": graph_launches, "cudaLaunchKernel": kernels},
                "top_self_cpu_us": [{"name": "aten::copy_", "count": 3, "self_cpu_us": 21.0}]}

    modes = {"native": {"e2e_ms": {"16": 1.0}, "host_profile": summary(29, 30)},
             "bcg": {"e2e_ms": {"16": 1.0}, "host_profile": summary(29, 61)},
             "eager": {"e2e_ms": {"16": 1.0}, "host_profile": None}}
    table = "\n".join(profile.markdown(modes))
    assert "| mode | rows | host ms | torch ops | Python calls | cudaLaunchKernel | cudaGraphLaunch | costliest op" in table
    assert "| bcg | 16 | 2.50 | 40 | - | 61 | 29 | aten::copy_ x3: 21 |" in table
    assert "Not profiled (no forward of 16 or more rows in this process): eager." in table
    assert profile.markdown({"bcg": {"e2e_ms": {"16": 1.0}}}) == []


def test_runtime_calls_with_equal_counts_are_columns_in_name_order():
    calls = {"cudaStreamIsCapturing": 29, "cudaGraphLaunch": 29, "cudaLaunchKernelExC": 28, "cudaFuncSetAttribute": 28,
             "cudaLaunchKernel": 28}
    modes = {"bcg": {"e2e_ms": {"16": 1.0}, "host_profile": {
        "tokens": 16, "host_ms": 2.5, "aten_ops": 40, "cuda_runtime_calls": calls, "top_self_cpu_us": []}}}
    header = "| mode | rows | host ms | torch ops | Python calls | cudaGraphLaunch | cudaStreamIsCapturing | cudaFuncSetAttribute | " \
             "cudaLaunchKernel | costliest op"
    assert header in "\n".join(profile.markdown(modes))


def test_only_the_profile_flag_arms_the_modes(monkeypatch):
    monkeypatch.setenv(PROFILE_TOKENS_ENV, "64")  # left over in the caller's shell
    assert PROFILE_TOKENS_ENV not in harness._mode_env(None)
    assert harness._mode_env(16)[PROFILE_TOKENS_ENV] == "16"
    with pytest.raises(SystemExit, match="--profile takes a token count"):
        harness.run("vllm", "qwen3-0.6b", [16], ["bcg"], None, 1.0, profile_tokens=0)


@pytest.mark.parametrize("tp, dp", [(2, 1), (1, 2)])
def test_vllm_profile_across_processes_is_refused_before_any_mode_runs(monkeypatch, tmp_path, tp, dp):
    """vLLM's profiler lives in the engine's process: with tp or dp > 1 it would profile nothing."""
    monkeypatch.setattr(harness, "run_mode", lambda *a, **k: pytest.fail("a mode ran"))
    with pytest.raises(SystemExit, match=f"--profile with vllm needs --tp 1 --dp 1 \\(got tp={tp} dp={dp}\\)"):
        harness.run("vllm", "qwen3-0.6b", [16], ["bcg"], tmp_path, 1.0, tp=tp, dp=dp, profile_tokens=16)


@pytest.mark.usefixtures("fake_cuda_events")
def test_the_vllm_forward_timer_profiles_the_armed_forward(monkeypatch):
    import contextlib

    from bcg_bench import vllm_mode as bench

    monkeypatch.setenv(PROFILE_TOKENS_ENV, "4")
    timers = bench.Timers()
    timed = timers._timed_context(lambda *a, **k: contextlib.nullcontext())
    for armed in (False, True):
        timers.profile_armed = armed
        with timed(None, num_tokens=4):
            torch.ones(4, 8).mul(2)
    assert len(timers.forwards) == 2  # both forwards timed as before
    assert timers.profiler.summary["tokens"] == 4 and "aten::mul" in {
        op["name"] for op in timers.profiler.summary["top_self_cpu_us"]}


def _layer(x: torch.Tensor) -> torch.Tensor:
    return x.mul(2)


def test_the_profile_counts_the_python_calls_of_the_forward_by_package_and_function():
    profiler = ForwardProfiler(16, armed=lambda: True)
    with profiler.around(16):
        x = torch.ones(16, 8)
        for _ in range(28):
            x = _layer(x)
    summary = profiler.summary
    assert summary["python_calls"] >= 28
    mine = next(f for f in summary["top_python_calls"] if f["name"].endswith("test_bench_profile._layer"))
    assert mine["count"] == 28  # counted once per call, not per line or return
    assert sum(summary["python_calls_by_package"].values()) == summary["python_calls"]
    table = "\n".join(profile.markdown({"bcg": {"e2e_ms": {"16": 1.0}, "host_profile": summary}}))
    assert f"| bcg | 16 | {summary['host_ms']:.2f} | {summary['aten_ops']} | {summary['python_calls']} |" in table
    assert "test_bench_profile._layer x28" in table


def test_python_calls_are_named_by_the_package_below_the_longest_path_root(tmp_path):
    site = tmp_path / "site"
    roots = sorted([str(tmp_path), str(site)], key=len, reverse=True)
    assert profile.package_of(str(site / "vllm" / "forward_context.py"), roots) == "vllm"
    assert profile.package_of(str(site / "contextlib.py"), roots) == "contextlib"
    assert profile.package_of(str(tmp_path / "adapters" / "vllm" / "graphs.py"), roots) == "bcg_plugin.adapters"
    assert profile.package_of("/elsewhere/repo/bcg_plugin/runner.py", roots) == "bcg_plugin"
    assert profile.package_of("<frozen importlib._bootstrap>", roots) == "<frozen importlib._bootstrap>"
