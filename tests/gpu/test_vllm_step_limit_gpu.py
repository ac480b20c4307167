"""bcg in vLLM when the chunk is more than a step can schedule: ``max_num_batched_tokens`` above
``max_num_seqs`` x ``max_model_len``, which vLLM accepts with a warning.

Run on the GPU host: ``python -m pytest tests/gpu/test_vllm_step_limit_gpu.py -m gpu -s``. Each engine
runs in its own process (this file re-invoked as a script), as in ``test_vllm_gpu.py``, whose
comparison and tolerance this file uses.

Engines: ``MAX_NUM_SEQS`` = 2 requests of at most ``MAX_MODEL_LEN`` = 1024 tokens, a chunk of
``CHUNK`` = 8192. No step can hold more than 2048 tokens, so bcg's ladder stops there
(:func:`bcg_plugin.adapters.vllm.replay.step_token_limit`) instead of at the chunk. The workload's first
two prompts fill that top bucket together; the rest (prompt lengths 1..1020) queue behind two
running requests, so steps mix one request's prefill with the other's decode. Checked against
the same engine run eagerly, on both model runners; the stale-metadata control of
``test_vllm_gpu.py`` shows the comparison fails on wrong outputs.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

import dummy_weights
import pytest
import soak_helpers as soak
import test_vllm_gpu as base

from bcg_plugin.ladder import reference_ladder

MAX_NUM_SEQS, MAX_MODEL_LEN, CHUNK = 2, 1024, 8192
STEP_LIMIT = MAX_NUM_SEQS * MAX_MODEL_LEN  # the most tokens one step can schedule here
NUM_PROMPTS, OUTPUT_TOKENS = 24, 4
LONGEST_PROMPT = MAX_MODEL_LEN - OUTPUT_TOKENS
ENGINE_TIMEOUT_S = 360  # from vLLM 0.29 the V2 runner also captures while it profiles graph memory

ENGINES = {
    "eager_fa": {"bcg": False},
    "bcg_fa": {"bcg": True},
    "eager_fa_v1": {"bcg": False, "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}},
    "bcg_fa_v1": {"bcg": True, "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}},
}


def workload(seed: int = 0) -> list[list[int]]:
    """Prompts (token ids): the two longest first, so the first step holds ``2 x LONGEST_PROMPT``."""
    rng = random.Random(seed)
    lengths = [LONGEST_PROMPT, LONGEST_PROMPT] + [rng.randint(1, LONGEST_PROMPT) for _ in range(NUM_PROMPTS - 2)]
    return [[rng.randint(100, 150_000) for _ in range(n)] for n in lengths]


def run_engine(name: str, out: Path) -> None:
    from vllm import LLM, SamplingParams

    from bcg_plugin.adapters.vllm.metrics import WORKER_EXTENSION
    from bcg_bench.models import model_dir

    kwargs = dict(
        model=str(model_dir("qwen3-0.6b")), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=CHUNK, max_num_seqs=MAX_NUM_SEQS, seed=0,
        gpu_memory_utilization=0.35, enable_prefix_caching=True, attention_backend="FLASH_ATTN",
        worker_extension_cls=WORKER_EXTENSION,
    )
    if ENGINES[name]["bcg"]:
        kwargs["additional_config"] = {"bcg": {"enable": True, "torch_compile": False}}
    else:
        kwargs["enforce_eager"] = True
    llm = LLM(**kwargs)
    llm.apply_model(dummy_weights.rescale)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, logprobs=base.TOP_K, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in workload()], params, use_tqdm=False)
    results = [{"tokens": list(o.outputs[0].token_ids),
                "top": [{str(t): lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]}
               for o in outs]
    stats = [s for worker in llm.collective_rpc("bcg_stats") for s in worker]
    out.write_text(json.dumps({"results": results, "bcg": stats}))


pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engines():
    pytest.importorskip("vllm")
    tmp = Path(tempfile.mkdtemp(prefix="bcg-vllm-step-limit-"))
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            out, log = tmp / f"{name}.json", tmp / f"{name}.log"
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **ENGINES[name].get("env", {}),
                   "PYTHONPATH": soak.with_tests_on_path(os.environ)}
            procs, timed_out = soak.run_in_groups([([sys.executable, __file__, name, str(out)], env, log)],
                                                  ENGINE_TIMEOUT_S)
            if timed_out or procs[0].returncode != 0 or not out.exists():
                pytest.fail(f"engine {name} failed (exit {procs[0].returncode}, timed out: {timed_out}):\n"
                            f"{log.read_text()[-6000:]}")
            cache[name] = json.loads(out.read_text())
        return cache[name]

    return get


@pytest.mark.parametrize("bcg_name, ref_name", [("bcg_fa", "eager_fa"), ("bcg_fa_v1", "eager_fa_v1")])
def test_ladder_stops_at_what_a_step_can_schedule_and_outputs_match_eager(engines, bcg_name, ref_name):
    base.skip_without_v1(bcg_name, ref_name)
    run = engines(bcg_name)
    (stats,) = run["bcg"]
    assert stats["buckets"] == len(reference_ladder(STEP_LIMIT)), stats  # not the chunk's 56
    assert stats["replays_by_bucket"].get(str(STEP_LIMIT), 0) > 0, stats  # the first step, two long prompts
    assert set(map(int, stats["replays_by_bucket"])) <= set(reference_ladder(STEP_LIMIT)), stats
    assert stats["fallbacks"] == {}, stats
    ref = engines(ref_name)
    assert ref["bcg"] == []
    bad = base.mismatches(run["results"], ref["results"])
    print(f"[bcg gpu] {bcg_name} vs {ref_name} (max_num_seqs {MAX_NUM_SEQS}, max_model_len {MAX_MODEL_LEN}, "
          f"chunk {CHUNK}): {stats['buckets']} buckets, {stats['replays']} replays "
          f"{stats['replays_by_bucket']}, {len(bad)}/{NUM_PROMPTS} prompts beyond tolerance, worst |d logprob| "
          f"{base.worst_logprob_diff(run['results'], ref['results']):.4f} (atol {base.LOGPROB_ATOL})")
    assert bad == [], f"{len(bad)}/{NUM_PROMPTS} prompts differ from {ref_name} beyond tolerance: {bad}"


if __name__ == "__main__":
    for key, value in ENGINES[sys.argv[1]].get("env", {}).items():
        os.environ.setdefault(key, value)
    run_engine(sys.argv[1], Path(sys.argv[2]))
