"""Do a layer's first n output rows change when it runs on more rows than n?

bcg replays a batch of n tokens in a bucket of M >= n rows (and under SGLang's DP attention the
expert layers see every rank's bucket, M = bucket x DP, where eager sees the sum of the real
tokens). Row-independent maths gives the same first n rows either way; the kernels a library picks
for M rows need not round alike. This script asks that question of the layers of the
Qwen3-30B-A3B shape at SGLang TP 2 / DP attention 2 (attention projections local, experts split
over TP 2), for the token counts of the SGLang engine test's probes, and writes one JSON:
per layer and (n, M) pair, whether the first n rows are bitwise equal, their largest difference,
and for the router how many of the n tokens get another top-8 expert set.

    python -m bcg_bench.padding_rows --out DIR     # on a GPU; SGLang installed for the experts
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bcg_bench.ranks import free_port
from bcg_bench.report import environment, run_stamp
from bcg_plugin.versions import installed_version

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, EXPERT_INTERMEDIATE, TP = 128, 8, 768, 2
# (real tokens, bucket) of the probes in tests/gpu/test_sglang_gpu.py; DP attention 2 doubles the
# bucket for the expert layers, eager's expert layers see the real tokens only (the peer is idle).
PROBES = [(24, 32), (40, 48), (64, 64), (100, 112), (200, 208), (300, 320)]
DP = 2
SEED = 0


def rows_compare(fn, x: torch.Tensor, n: int, m: int) -> dict:
    """``fn`` on the first n rows alone and on all m rows: are the first n output rows the same?"""
    return _compared(fn(x[:n]), fn(x[:m])[:n], n, m)


def _compared(small: torch.Tensor, large: torch.Tensor, n: int, m: int) -> dict:
    diff = (small.float() - large.float()).abs()
    return {"n": n, "m": m, "bitwise_equal": bool(torch.equal(small, large)), "max_abs_diff": float(diff.max()),
            "rows_differing": int((diff.amax(dim=-1) > 0).sum())}


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=gen.device)


def linear(k: int, n_out: int, gen: torch.Generator):
    w = (_randn(gen, n_out, k) / k**0.5).to(torch.bfloat16)
    return lambda x: torch.nn.functional.linear(x, w)


def router_flips(gate, x: torch.Tensor, n: int, m: int) -> dict:
    """:func:`rows_compare` of the router, plus how many of the n tokens get another top-k expert set."""
    small, large = gate(x[:n]), gate(x[:m])[:n]
    entry = _compared(small, large, n, m)
    entry["tokens_with_other_experts"] = int((_top_experts(small) != _top_experts(large)).any(dim=-1).sum())
    return entry


def _top_experts(logits: torch.Tensor) -> torch.Tensor:
    return torch.topk(logits.float(), TOP_K, dim=-1).indices.sort(dim=-1).values


def experts(gen: torch.Generator):
    """SGLang's fused MoE (Triton) on this rank's half of every expert, or the reason it is unavailable."""
    try:
        from sglang.srt.distributed import parallel_state
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts_impl
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import ServerArgs

        from bcg_bench.models import model_dir

        # The kernels read SGLang's process-wide config and parallel groups, which an engine sets up
        # at start; one process stands in for this rank (its expert halves are local maths).
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                backend="nccl" if gen.device.type == "cuda" else "gloo")
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        publish(ServerArgs(model_path=str(model_dir("qwen3-30b-a3b")), load_format="dummy", skip_tokenizer_init=True,
                           device=gen.device.type), role="test")
    except Exception as e:  # reported in the JSON: the dense layers are still answered
        return None, f"{type(e).__name__}: {e}"
    inter = EXPERT_INTERMEDIATE // TP
    w1 = (_randn(gen, EXPERTS, 2 * inter, HIDDEN) / HIDDEN**0.5).to(torch.bfloat16)
    w2 = (_randn(gen, EXPERTS, HIDDEN, inter) / inter**0.5).to(torch.bfloat16)
    gate_w = (_randn(gen, EXPERTS, HIDDEN) / HIDDEN**0.5).to(torch.bfloat16)

    def run(x: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(x, gate_w).float()
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).float()
        return fused_experts_impl(x, w1, w2, weights, ids.to(torch.int32))

    return run, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", help="cpu only checks the script itself")
    args = parser.parse_args()
    gen = torch.Generator(device=args.device).manual_seed(SEED)
    top = max(b for _, b in PROBES) * DP
    x = _randn(gen, top, HIDDEN).to(torch.bfloat16)
    attn_in = _randn(gen, top, HEADS * HEAD_DIM).to(torch.bfloat16)
    qkv = linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, gen)
    o_proj = linear(HEADS * HEAD_DIM, HIDDEN, gen)
    gate = linear(HIDDEN, EXPERTS, gen)
    moe, moe_error = experts(gen)
    layers: dict[str, list[dict]] = {"qkv_proj": [], "o_proj": [], "router_gate": [], "fused_experts": []}
    for n, bucket in PROBES:
        layers["qkv_proj"].append(rows_compare(qkv, x, n, bucket))
        layers["o_proj"].append(rows_compare(o_proj, attn_in, n, bucket))
        layers["router_gate"].append(router_flips(gate, x, n, bucket * DP))
        if moe is not None:
            try:
                layers["fused_experts"].append(rows_compare(moe, x, n, bucket * DP))
            except Exception as e:  # SGLang's runtime state outside an engine: reported, not fatal
                moe, moe_error = None, f"{type(e).__name__}: {e}"
    env = environment()
    result = {
        "benchmark": "padding_rows",
        **{k: v for k, v in env.items() if k in ("gpu", "date")},
        "env": env,
        "device": args.device,
        "sglang": installed_version("sglang"),
        "triton": installed_version("triton"),
        "shape": {"hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "experts": EXPERTS,
                  "top_k": TOP_K, "expert_intermediate_per_rank": EXPERT_INTERMEDIATE // TP, "dtype": "bfloat16"},
        "layout": "SGLang TP 2 / DP attention 2: attention projections local (attention TP 1); experts see "
                  "bucket x DP rows under bcg, the real rows under eager (SUM_LEN, idle peer)",
        "fused_experts_error": moe_error,
        "layers": layers,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"padding-rows-{run_stamp(result['date'])}.json"
    path.write_text(json.dumps(result, indent=2))
    for name, entries in layers.items():
        for e in entries:
            flips = e.get("tokens_with_other_experts")
            extra = "" if flips is None else f", tokens with other experts {flips}"
            print(f"{name:14s} n={e['n']:4d} M={e['m']:4d}: equal {e['bitwise_equal']}, max diff "
                  f"{e['max_abs_diff']:.3g}, rows differing {e['rows_differing']}{extra}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
