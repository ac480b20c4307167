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


def test_the_chunk_sets_the_expected_ladder_and_keeps_every_prompt_within_the_context(gpu_test_module, monkeypatch):
    # BCG_TEST_CHUNK=16384 is vLLM's default max_num_batched_tokens for LLM on an H200: above the
    # test's context, which the workload's prompts must still fit (a prompt of CHUNK tokens would not).
    monkeypatch.setenv("BCG_TEST_CHUNK", "16384")
    mod = gpu_test_module("test_vllm_gpu")
    assert mod.CHUNK == 16384 and mod.LADDER_BUCKETS == 72
    first, second = mod.workload()
    assert max(map(len, first)) == mod.MAX_LEN
    assert max(map(len, first + second)) + 4 <= mod.MAX_LEN + 512  # prompt and 4 output tokens in max_model_len
    monkeypatch.delenv("BCG_TEST_CHUNK")
    mod = gpu_test_module("test_vllm_gpu")
    assert mod.CHUNK == 2048 and mod.LADDER_BUCKETS == 40
    assert 2048 in map(len, mod.workload()[0])  # a prompt of exactly one chunk, an edge


def test_step_limit_workload_fills_the_top_bucket_and_fits_the_context(gpu_test_module):
    from bcg_plugin.ladder import reference_ladder

    mod = gpu_test_module("test_vllm_step_limit_gpu")
    assert mod.STEP_LIMIT == mod.MAX_NUM_SEQS * mod.MAX_MODEL_LEN < mod.CHUNK  # a chunk vLLM only warns about
    prompts = mod.workload()
    assert len(prompts) == mod.NUM_PROMPTS
    assert all(len(p) + mod.OUTPUT_TOKENS <= mod.MAX_MODEL_LEN for p in prompts)
    first_step = sum(map(len, prompts[:mod.MAX_NUM_SEQS]))  # the first two requests' prefills, together
    assert next(b for b in reference_ladder(mod.STEP_LIMIT) if b >= first_step) == mod.STEP_LIMIT
    assert len(reference_ladder(mod.STEP_LIMIT)) < len(reference_ladder(mod.CHUNK))
