"""The vLLM GPU test's engine-free part under data parallelism: how prompts are dealt out to DP ranks
(the barrier between the ranks' processes is tested in test_bench_ranks.py)."""


def _load(gpu_test_module, monkeypatch, dp: int):
    monkeypatch.setenv("BCG_TEST_DP", str(dp))
    return gpu_test_module("test_vllm_gpu")


def test_every_prompt_is_served_once_and_rank_0_serves_the_second_wave_alone(gpu_test_module, monkeypatch):
    mod = _load(gpu_test_module, monkeypatch, 2)
    first, second = mod.workload()
    shares = [mod.dp_share(r, 2, first, second) for r in range(2)]
    served = sorted(i for ones, twos in shares for i in (*ones, *twos))
    assert served == list(range(mod.NUM_PROMPTS))
    assert shares[1][1] == [] and len(shares[0][1]) == len(second)
    assert abs(len(shares[0][0]) - len(shares[1][0])) <= 1  # the first wave is split evenly


def test_single_rank_layout_keeps_the_waves_whole(gpu_test_module, monkeypatch):
    mod = _load(gpu_test_module, monkeypatch, 1)
    assert mod.DP == 1
    first, second = mod.workload()
    assert mod.dp_share(0, 1, first, second) == (list(range(len(first))),
                                                 list(range(len(first), len(first) + len(second))))
