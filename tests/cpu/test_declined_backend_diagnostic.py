"""The driver of ``bcg_bench.diagnostics.declined_backend`` (its GPU engines replaced by fakes)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

import pytest

from bcg_bench.diagnostics import declined_backend as diag

FAKE_ENGINE = textwrap.dedent(f"""
    import json, sys
    MARK = {diag.MARK!r}
    print("INFO vLLM log line", flush=True)
    if sys.argv[1] == "silent":
        sys.stdin.readline()
        sys.exit(0)
    print(MARK + json.dumps({{"ready": True, "compilation": {{"cudagraph_mode": "FULL_AND_PIECEWISE"}}}}), flush=True)
    for line in sys.stdin:
        if line.split()[0] == "quit":
            break
        n, reps, warmup = map(int, line.split())
        print("INFO another log line", flush=True)
        print(MARK + json.dumps({{"n": n, "median_ms": n * 0.5}}), flush=True)
""")


def _args(**kw):
    base = dict(model="qwen3-0.6b", chunk=2048, memory=0.25, sizes="16,512", rounds=3, reps=2, warmup=1,
                tolerance=0.05, no_control=False)
    return argparse.Namespace(**{**base, **kw})


def test_an_engine_process_answers_between_vllms_log_lines_and_a_silent_one_times_out():
    engine = diag.Engine("plain", _args(), command=[sys.executable, "-c", FAKE_ENGINE, "answers"])
    try:
        assert engine.compilation == {"cudagraph_mode": "FULL_AND_PIECEWISE"}
        assert engine.measure(64, 2, 1) == 32.0
    finally:
        engine.close()
    assert engine.proc.returncode == 0
    with pytest.raises(RuntimeError, match="'silent' did not answer within 1 s"):
        diag.Engine("silent", _args(), command=[sys.executable, "-c", FAKE_ENGINE, "silent"], start_timeout_s=1)


class _FakeEngine:
    """ms per size and mode; ``bcg`` equal to plain, ``forced`` 30% slower at 16 tokens only."""

    calls: list = []

    def __init__(self, mode, args):
        self.mode = mode
        self.compilation = {"cudagraph_mode": "FULL_DECODE_ONLY" if mode == "forced" else "FULL_AND_PIECEWISE",
                            "additional_config": {"bcg": {}} if mode == "bcg" else {}}
        self.ready = {"ready": True, "compilation": self.compilation,
                      **({"bcg_runner_patches_applied": False} if mode == "bcg" else {})}

    def measure(self, n, reps, warmup):
        _FakeEngine.calls.append((self.mode, n))
        return n * (1.3 if self.mode == "forced" and n == 16 else 1.0) * (1.02 if self.mode == "bcg" else 1.0)

    def close(self):
        pass


def test_the_driver_interleaves_engines_pairs_ratios_and_flags_the_control():
    _FakeEngine.calls = []
    result = diag.drive(_args(), engine=_FakeEngine)
    assert json.loads(json.dumps(result)) == result  # the result file is plain JSON
    assert result["ratio_to_plain"]["bcg"] == {"16": pytest.approx(1.02), "512": pytest.approx(1.02)}
    assert result["ratio_to_plain"]["forced"]["16"] == pytest.approx(1.3)
    assert result["verdict"]["bcg_as_fast_as_plain"] and result["verdict"]["control_detected"]
    assert result["verdict"]["bcg_same_compilation_as_plain"]
    assert result["same_compilation_as_plain"] == {"bcg": True, "forced": False}
    assert result["bcg_runner_patches_applied"] is False
    assert len(result["round_medians_ms"]) == 3
    first_per_round = [_FakeEngine.calls[i * 6][0] for i in range(3)]
    assert first_per_round == ["plain", "bcg", "forced"]  # the order rotates each round
    # A bcg engine as slow as the control fails the verdict.
    slow = diag.verdict({"bcg": {"16": 1.3, "512": 1.0}}, 0.05)
    assert not slow["bcg_as_fast_as_plain"] and "control_detected" not in slow
