"""The vLLM GPU test's engine-free part under data parallelism: how prompts are dealt out to DP ranks
(the barrier between the ranks' processes is tested in test_bench_ranks.py)."""

import importlib.util
import os
from pathlib import Path

GPU_TEST = Path(__file__).resolve().parents[1] / "gpu" / "test_vllm_gpu.py"


def _load(dp: int):
    os.environ["BCG_TEST_DP"] = str(dp)
    try:
        spec = importlib.util.spec_from_file_location(f"vllm_gpu_test_dp{dp}", GPU_TEST)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        del os.environ["BCG_TEST_DP"]
    return module


def test_every_prompt_is_served_once_and_rank_0_serves_the_second_wave_alone():
    mod = _load(2)
    first, second = mod.workload()
    shares = [mod.dp_share(r, 2, first, second) for r in range(2)]
    served = sorted(i for ones, twos in shares for i in (*ones, *twos))
    assert served == list(range(mod.NUM_PROMPTS))
    assert shares[1][1] == [] and len(shares[0][1]) == len(second)
    assert abs(len(shares[0][0]) - len(shares[1][0])) <= 1  # the first wave is split evenly


def test_single_rank_layout_keeps_the_waves_whole():
    mod = _load(1)
    assert mod.DP == 1
    first, second = mod.workload()
    assert mod.dp_share(0, 1, first, second) == (list(range(len(first))),
                                                 list(range(len(first), len(first) + len(second))))
