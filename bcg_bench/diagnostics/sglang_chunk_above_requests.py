"""Diagnostic: SGLang with a chunk (8192) above what its request pool can hold in one step
(``max_running_requests`` 2 x ``context_length`` 2048 = 4096 tokens).

Run from the repository root on a CUDA machine with SGLang, with ``BCG_STATS_INTERVAL_S=1`` to see
bcg's stats lines: ``python3 -m bcg_bench.diagnostics.sglang_chunk_above_requests``.
bcg's ladder stops at 4096 (48 buckets, not the chunk's 56): a bucket above it would never replay,
and its capture batch (as few requests of 2048 tokens as it needs) needs more requests than the
pool holds: with the ladder built to the chunk, the 8192-token bucket's capture fails in the triton
backend's attention metadata and every prefill runs eagerly. The first batch, two prompts of 2000
tokens, is one step at the 4096-token bucket. Prints each batch's output lengths and ``OK``; a smoke
run, no comparison against eager (SGLang's log says ``cuda graph: True`` for each replayed step).
"""
import random

import sglang

from bcg_bench.models import model_dir

if __name__ == "__main__":
    e = sglang.Engine(model_path=str(model_dir("qwen3-0.6b")), load_format="dummy", skip_tokenizer_init=True,
                      attention_backend="triton", chunked_prefill_size=8192, context_length=2048,
                      max_running_requests=2, cuda_graph_backend_prefill="bcg", mem_fraction_static=0.5,
                      log_level="info")
    rng = random.Random(0)
    for sizes in ([2000, 2000], [1500, 900, 700, 300], [100] * 6):
        out = e.generate(input_ids=[[rng.randrange(100, 150000) for _ in range(n)] for n in sizes],
                         sampling_params={"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True})
        print("batch", sizes, "->", [len(o["output_ids"]) for o in out], flush=True)
    e.shutdown()
    print("OK")
