"""Diagnostic: SGLang with a chunk (8192) above the context length (4096).

Run from the repository root on a CUDA machine with SGLang:
``python3 -m bcg_bench.diagnostics.sglang_chunk_above_context``.
bcg's dummy batch for a bucket above 4096 tokens is two requests of at most 4096 (as few as the
context allows); those buckets are captured and then replayed by steps of several prompts. Prints
each batch's output lengths and ``OK``; the engine's log shows the capture and the replays.
"""
import random

import sglang

from bcg_bench.models import model_dir

if __name__ == "__main__":
    e = sglang.Engine(model_path=str(model_dir("qwen3-0.6b")), load_format="dummy", skip_tokenizer_init=True,
                      attention_backend="triton", chunked_prefill_size=8192, context_length=4096,
                      cuda_graph_backend_prefill="bcg", mem_fraction_static=0.5, log_level="info")
    rng = random.Random(0)
    for sizes in ([3000, 3000, 1500], [4000, 3500], [100] * 60):
        out = e.generate(input_ids=[[rng.randrange(100, 150000) for _ in range(n)] for n in sizes],
                         sampling_params={"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True})
        print("batch", sizes[:3], "->", [len(o["output_ids"]) for o in out], flush=True)
    e.shutdown()
    print("OK")
