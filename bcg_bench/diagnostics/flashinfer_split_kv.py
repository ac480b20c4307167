"""Diagnostic: flashinfer's paged prefill in a CUDA graph, planned with and without split KV, and
its ragged prefill in a CUDA graph.

Run on the GPU host in SGLang 0.5.23's environment (flashinfer 0.7.2)::

    python3 -m bcg_bench.diagnostics.flashinfer_split_kv

SGLang's full prefill graphs, whose plan bcg's graph-attention buckets use, plan flashinfer's paged
prefill with split KV, and a split plan adds a merge kernel to every layer. This captures one
attention layer of the Qwen3-0.6B shape (16 query heads, 8 KV heads, head dim 128, page size 1) at a
512-token bucket with 64 request slots, as SGLang's plan pads them, once with split KV and once with
``disable_split_kv``, and replays each for fresh prompts and for short steps on long cached prefixes.
Then it captures the ragged prefill bcg's ``fresh`` variant runs (attention over the step's own keys
and values, the kernels SGLang's eager ragged wrapper asks for, planned without split KV) at the same
bucket and slots, and replays it for the fresh prompts. Per case it prints the replay's device time
(CUDA events, 50 replays), the same call planned eagerly, and the largest difference of the graph's
rows from the eager call's. Lines of JSON, also appended to ``$OUT/fi_split.jsonl``.
"""
import json
import os
import time

import torch

OUT = os.environ.get("OUT", "/tmp")
HQ, HK, D = 16, 8, 128  # query heads, KV heads and head dim of the Qwen3-0.6B shape
R, BUCKET = 64, 512  # request slots (bcg's floor for its graph buckets on flashinfer) and the captured bucket
PAGES = 70000  # KV cache pages of one token: room for every case's keys
# Case: (new tokens per request, KV length per request); a KV length above the new tokens is a cached prefix.
CASES = {"fresh512": ([512], [512]), "fresh16": ([16], [16]), "8x64": ([64] * 8, [64] * 8),
         "16_on_4080": ([16], [4096]), "256_on_3840": ([256], [4096]), "4x128_on_2k": ([128] * 4, [2176] * 4)}


def log(**fields) -> None:
    print(json.dumps(fields), flush=True)
    with open(os.path.join(OUT, "fi_split.jsonl"), "a") as f:
        f.write(json.dumps(fields) + "\n")


def indptrs(qlens, kvlens, slots):
    q, k = [0], [0]
    for i in range(slots):
        q.append(q[-1] + (qlens[i] if i < len(qlens) else 0))
        k.append(k[-1] + (kvlens[i] if i < len(kvlens) else 0))
    return torch.tensor(q, dtype=torch.int32, device="cuda"), torch.tensor(k, dtype=torch.int32, device="cuda")


def plan(w, qlens, kvlens, slots, split_off) -> None:
    qo, kv = indptrs(qlens, kvlens, slots)
    idx = torch.arange(int(kv[-1].item()), dtype=torch.int32, device="cuda") % PAGES
    last = torch.ones(slots, dtype=torch.int32, device="cuda")
    w.plan(qo, kv, idx, last, HQ, HK, D, 1, causal=True, q_data_type=torch.bfloat16,
           kv_data_type=torch.bfloat16, non_blocking=True, disable_split_kv=split_off)


def device_us(fn, iters: int = 50) -> float:
    """Device microseconds per call of ``fn``, over ``iters`` back-to-back calls (CUDA events)."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1000 / iters


def captured(run):
    """``run`` once eagerly on a side stream (lazy inits stay out of the graph), then captured:
    the graph and the output tensor its replays write."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    return g, out


def replay_case(g, out, n, reference, eager_run) -> dict:
    """One case on inputs and plans already landed: the graph's first ``n`` rows against
    ``reference()`` (an eager plan and call), then the device µs of a replay and of ``eager_run``."""
    g.replay()
    torch.cuda.synchronize()
    ref = reference()
    diff = (out[:n].float() - ref.float()).abs().max().item()
    for _ in range(5):
        g.replay()
    graph_us = device_us(g.replay)
    eager_us = device_us(eager_run)
    return dict(tokens=n, graph_us=round(graph_us, 2), eager_us=round(eager_us, 2), max_abs_diff=diff)


def graph_wrapper(split_off, kv_cache):
    """A CUDA-graph wrapper planned for one 512-token request in ``R`` slots, and its captured run."""
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    bufs = dict(qo_indptr_buf=torch.zeros(R + 1, dtype=torch.int32, device="cuda"),
                paged_kv_indptr_buf=torch.zeros(R + 1, dtype=torch.int32, device="cuda"),
                paged_kv_indices_buf=torch.zeros(R * 4200, dtype=torch.int32, device="cuda"),
                paged_kv_last_page_len_buf=torch.zeros(R, dtype=torch.int32, device="cuda"))
    w = BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, backend="fa2", **bufs)
    q = torch.randn(BUCKET, HQ, D, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(BUCKET, HQ, D, dtype=torch.bfloat16, device="cuda")
    plan(w, [BUCKET], [BUCKET], R, split_off)
    g, _ = captured(lambda: w.run(q, kv_cache, out=out))
    return w, g, q, out


def ragged_plan(w, qlens, slots, split_off) -> None:
    qo, _ = indptrs(qlens, qlens, slots)
    qo = qo.cpu()
    w.plan(qo, qo, HQ, HK, D, causal=True, q_data_type=torch.bfloat16, disable_split_kv=split_off)


def ragged_cases() -> None:
    """The ragged prefill captured at the bucket and replayed for each fresh case, against an eager call."""
    from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

    t = time.time()
    bufs = dict(qo_indptr_buf=torch.zeros(R + 1, dtype=torch.int32, device="cuda"),
                kv_indptr_buf=torch.zeros(R + 1, dtype=torch.int32, device="cuda"))
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                             use_cuda_graph=True, backend="auto", **bufs)
    eager = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                                 backend="auto")
    q = torch.randn(BUCKET, HQ, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(BUCKET, HK, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(BUCKET, HK, D, dtype=torch.bfloat16, device="cuda")
    ragged_plan(w, [BUCKET], R, True)
    g, out = captured(lambda: w.run(q, k, v))
    log(event="captured", kernel="ragged", backend=w._backend, seconds=round(time.time() - t, 1))
    for name, (ql, kl) in CASES.items():
        if ql != kl:  # a cached prefix: the paged plan's case
            continue
        n = sum(ql)
        ragged_plan(w, ql, R, True)
        for t_ in (q, k, v):
            t_.copy_(torch.randn_like(t_))

        def reference(ql=ql, n=n):
            ragged_plan(eager, ql, len(ql), False)
            return eager.run(q[:n].contiguous(), k[:n].contiguous(), v[:n].contiguous())

        log(event="case", kernel="ragged", case=name,
            **replay_case(g, out, n, reference, lambda: eager.run(q[:n], k[:n], v[:n])))


def main() -> None:
    import flashinfer
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    torch.manual_seed(0)
    kv_cache = (torch.randn(PAGES, 1, HK, D, dtype=torch.bfloat16, device="cuda"),
                torch.randn(PAGES, 1, HK, D, dtype=torch.bfloat16, device="cuda"))
    eager = BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                                backend="fa2")
    log(event="start", flashinfer=flashinfer.__version__, torch=torch.__version__, gpu=torch.cuda.get_device_name())
    for split_off in (False, True):
        t = time.time()
        w, g, q, out = graph_wrapper(split_off, kv_cache)
        log(event="captured", split_off=split_off, seconds=round(time.time() - t, 1))
        for name, (ql, kl) in CASES.items():
            n = sum(ql)
            plan(w, ql, kl, R, split_off)
            q.copy_(torch.randn_like(q))

            def reference(ql=ql, kl=kl, n=n):
                plan(eager, ql, kl, len(ql), False)  # flashinfer's own eager plan: its defaults, split KV allowed
                return eager.run(q[:n].contiguous(), kv_cache)

            log(event="case", split_off=split_off, case=name,
                **replay_case(g, out, n, reference, lambda: eager.run(q[:n], kv_cache)))
    ragged_cases()
    log(event="done")


if __name__ == "__main__":
    main()
