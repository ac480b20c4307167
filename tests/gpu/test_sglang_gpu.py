"""bcg inside SGLang on a GPU: logprobs of bcg replays match the host's (eager prefill, or with attention
inside the graph SGLang's full prefill graphs); a stale replay does not.

Run on the GPU host: ``python -m pytest tests/gpu/test_sglang_gpu.py -m gpu -s``. Five engines
start one after another in this process (each spawns its own scheduler): eager prefill
(``cuda_graph_backend_prefill="disabled"``), bcg, bcg with each of two faults (test plugins loaded in
the schedulers through ``BCG_TEST_FAULTS``), and eager prefill again. With attention inside bcg's
graph the reference is SGLang's own full prefill graphs instead (``REFERENCE``), run twice: six
engines, eager prefill once (the unit of the tolerance, and full's distance from it for the record).

Model: Qwen3-0.6B shape with random weights written once as a safetensors checkpoint that every
engine loads: norms 1, matrices N(0, 1/fan_in), embeddings N(0, 0.05^2). SGLang's own dummy
weights (uniform +-1e-3, norms included) flatten the logits to a spread of ~0.02 nats, which makes
any tolerance in units of that spread loose; these weights spread the logits over a few nats.

Check: for every request, |logprob_bcg - logprob_reference| over its input-token logprobs, its
per-position top-1 input logprobs and its output logprobs (up to the first differing output
token) must stay below ``TOL`` x the spread (std) of the eager run's input logprobs: at every
position for a dense model, at ``MOE_QUANTILE`` of the positions for a MoE model (see there).
bf16 GEMMs on a padded bucket may pick other kernels and reduction orders than the eager shapes:
the core's padded-replay error on hidden states is <= 2e-2 relative, well under TOL.

Two controls bracket the check: a replay with stale attention metadata must fail it (it is not too
loose), and the reference engine run a second time must pass it against the first (it is not stricter
than the host's own run-to-run reproducibility). A third engine stores the KV cache inside the graph
at the slots of the bucket's capture (``stale_graph_metadata.py``): it must fail the check too.

``BCG_TEST_CHUNK`` sets the chunked-prefill size (default 1024; SGLang's default on an H200 is 8192).
``BCG_TEST_ATTENTION_BACKEND`` sets SGLang's attention backend (default triton, where attention is
bcg's eager break). With flashinfer and ``BCG_ATTENTION=graph`` (``ci/gpu-tests.sh sglang-flashinfer``)
attention stays inside bcg's graphs in every bucket, so there the controls' stale plan and stale
store slots are read inside the graph. With flashinfer and ``auto`` (``sglang-flashinfer-auto``)
it stays inside the buckets up to the adapter's limit, the controls' buckets among them, and
breaks above; full's graphs then reach that limit only. Under ``auto`` two more engines (eager and
bcg with ``REROUTE_SLOTS`` request slots) take one wave of more prompts than slots at once: the step
must replay in a graph that breaks (with graph variants, the ``break`` variant of its bucket or a
larger one; else the next larger bucket) and match eager. By default
(``graph_variants``) the graph buckets' ``fresh`` variant is captured too (flashinfer 0.7.2 on): steps
without a cached prefix replay in it, the others in the bucket's own graph, and the check covers
both; some graph buckets larger than the request slots are also captured as the ``break`` variant; ``BCG_GRAPH_VARIANTS=0`` (``sglang-flashinfer-one-graph``) captures each bucket once. With flashinfer and ``BCG_ATTENTION=break``
(``sglang-flashinfer-break``) attention breaks and, as on triton, each layer's KV-cache store runs
in the segment before it. On fa3 (SGLang's default on Hopper) ``auto`` keeps attention inside the
buckets up to the adapter's limit for fa3 (1024 tokens, so ``sglang-fa3`` sets a chunk of 2048 for
some buckets to break), against SGLang's full prefill graphs on fa3 of those buckets, with the
``break`` variants as on flashinfer (the suite's main workload never sends the steps they serve); ``graph`` inside every bucket (``sglang-fa3-graph``), and ``break`` in none, the store in
the segment (``sglang-fa3-break``, against eager). Where attention stays inside, the comparison's
bcg engines and full's have ``SUITE_SLOTS`` request slots, more than the workload's steps hold
(``BCG_TEST_SLOTS=host``: SGLang's own count, as an engine gets it by default, so the graph
buckets and their ``break`` variants are those of that count; ``sglang-fa3-host-slots``). On a
backend whose break stores the KV cache the stale-store control has nothing to make stale and is
skipped.

Several GPUs: ``BCG_TEST_TP`` (tensor parallel) and ``BCG_TEST_DP`` (DP attention, ``dp_size`` with
``enable_dp_attention``), with ``BCG_TEST_MODEL`` naming a model of ``bcg_bench.models``.
Every rank must replay the same buckets in the same order. ``BCG_TEST_RESULTS_DIR`` keeps each
engine's outputs there and reuses them, so the engines can run in separate commands.

With two GPUs or more, two more engines (eager and bcg) run DP attention over two ranks on the dense
0.6B shape whatever the variables say, each rank sent prompts of other lengths in the same steps:
the check above, plus proof that bcg replayed steps in which a rank was padded to the DP-wide
bucket. They skip with fewer GPUs.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics
import tempfile
import types
from pathlib import Path

import pytest
import soak_helpers as soak

from bcg_plugin import BcgConfig
from bcg_plugin.config import TRUE_WORDS

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]
sglang = pytest.importorskip("sglang")

TOL = 0.1  # |delta logprob| per compared position, in units of the eager run's logprob spread
# MoE models: the share of a request's positions that must be within TOL. A token's top-k expert
# choice is discontinuous in its router logits, so a rounding difference anywhere upstream (kernels
# are chosen by row count, and bcg runs a padded bucket) can flip a token's experts and move that
# position by a large part of the spread. On 2 GPUs, TP 2 / DP 2, eager and bcg are each bit-identical
# across runs, and bcg matches eager bit for bit except in one forward: the 100-token probe, replayed
# in bucket 112, has the same 10 of its 201 compared logprobs beyond TOL (up to 0.29 x spread) in every run,
# and the probe extending its cached prefix inherits them. bcg_bench/padding_rows.py traced that to
# the attention output projection, whose GEMM rounds otherwise for 112 rows than for 100 (router and
# fused experts gave the same bits at every probe's padded size): any padded replay can meet such a
# row count. A stale replay puts 90% or more of a request's positions beyond TOL. Dense models:
# every position.
MOE_QUANTILE = 0.75
# Nats: flatter logits (SGLang's unscaled dummy weights give ~1e-5) leave a stale replay inside float
# noise, so the check could pass whatever bcg did.
MIN_SPREAD = 0.1
N_PROMPTS = 200
# Chunked-prefill size: prompts up to 2*CHUNK are split, bcg's top bucket is CHUNK. BCG_TEST_CHUNK=8192
# runs the check at SGLang's default for an H200 (the workload's prompts grow with it).
CHUNK = int(os.environ.get("BCG_TEST_CHUNK", "1024"))
SEED = 0
# (cached prefix K, new tokens N): P alone, then a fresh N-token prompt, then P + N new tokens.
# The last two are consecutive forwards of N tokens with different layouts (no prefix / prefix).
PROBES = [(40, 24), (100, 64), (300, 200)]
STALE_SIZES = "32,64,128,256"
STALE_FAULT = "stale_metadata"  # tests/gpu/stale_metadata.py: replays plan the previous replay's batch
# tests/gpu/stale_graph_metadata.py: the graphs store keys and values at the capture's cache slots
STALE_STORE_FAULT = "stale_graph_metadata"
# Multi-GPU runs of the same check: BCG_TEST_TP=2 [BCG_TEST_MODEL=qwen3-8b] (needs TP GPUs), and with
# DP attention BCG_TEST_TP=2 BCG_TEST_DP=2 [BCG_TEST_MODEL=qwen3-30b-a3b] (MoE: the expert layers'
# collectives span the DP ranks). Models other than the 0.6B one load SGLang's dummy weights (a scaled
# checkpoint of them is too large to write), rescaled in place on every rank once the engine is up.
TP = int(os.environ.get("BCG_TEST_TP", "1"))
DP = int(os.environ.get("BCG_TEST_DP", "1"))
MODEL = os.environ.get("BCG_TEST_MODEL", "qwen3-0.6b")
TOP_BUCKET = CHUNK // DP  # DP attention splits the chunked-prefill budget between the DP ranks
RESULTS_DIR = os.environ.get("BCG_TEST_RESULTS_DIR")
ATTENTION_BACKEND = os.environ.get("BCG_TEST_ATTENTION_BACKEND", "triton")
ATTENTION = os.environ.get("BCG_ATTENTION", "auto")
VARIANTS = os.environ.get("BCG_GRAPH_VARIANTS", "1" if BcgConfig().graph_variants else "0").lower() in TRUE_WORDS


def inside_tokens() -> int:
    """The largest bucket bcg captures with attention inside its graph (0 for none): on flashinfer or
    fa3 without DP attention, every bucket under ``graph``; under ``auto`` those up to the adapter's
    limit."""
    from bcg_plugin.adapters.sglang.graph_attention import AUTO_GRAPH_ATTENTION_TOKENS

    if ATTENTION_BACKEND not in AUTO_GRAPH_ATTENTION_TOKENS or DP != 1 or ATTENTION == "break":
        return 0
    if ATTENTION == "graph":
        return TOP_BUCKET
    return min(AUTO_GRAPH_ATTENTION_TOKENS[ATTENTION_BACKEND], TOP_BUCKET)


INSIDE_TOKENS = inside_tokens()
GRAPH_ATTENTION = INSIDE_TOKENS > 0
# Where the captured graph stores the KV cache: on triton's, flashinfer's and fa3's plain MHA pool, in
# the segment before each layer's attention (a break, or attention inside the graph). Elsewhere the
# break stores it eagerly, as SGLang does, so there is no captured store for the stale-store control to make stale.
SEGMENT_STORE = ATTENTION_BACKEND in ("triton", "flashinfer", "fa3")
STORE_IN_GRAPH = SEGMENT_STORE or GRAPH_ATTENTION
# What bcg is checked against: eager prefill, or with attention inside bcg's graph SGLang's own full
# prefill graphs, captured for the sizes bcg keeps attention inside (larger steps run eagerly in both).
# Those plan attention as bcg's graph does, a paged prefill over every token, where
# eager flashinfer runs a ragged prefill over the new tokens: other kernels, which round otherwise
# (the test prints how far full is from eager), so bcg is held to the host's own graph-attention mode,
# as bcg over vLLM's compiled model is held to vLLM's compiled engine.
REFERENCE = "full" if GRAPH_ATTENTION else "eager"
RESCALE_LOADER = "dummy_weights.rescale_loaded"  # SGLang imports it by name in every scheduler


def model_config(model: str = MODEL) -> dict:
    from bcg_bench.models import MODELS

    return dict(MODELS[model])


def write_scaled_checkpoint(path: Path, device: str = "cuda", seed: int = SEED, model: str = MODEL) -> Path:
    """A Qwen3-0.6B-shaped checkpoint with well-scaled random weights (names from transformers)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model_config(model), indent=2))
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if "norm" in name:
            t = torch.ones(shape, device=device)
        else:
            std = 0.05 if "embed_tokens" in name or "lm_head" in name else shape[-1] ** -0.5
            t = torch.randn(shape, generator=gen, device=device) * std
        tensors[name] = t.to(torch.bfloat16).cpu()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    import torch

    if torch.cuda.device_count() < TP:
        pytest.skip(f"BCG_TEST_TP={TP} needs {TP} GPUs, {torch.cuda.device_count()} visible")
    if DP > 1 and TP % DP:
        pytest.skip(f"SGLang's DP attention needs tp_size divisible by dp_size (BCG_TEST_TP={TP}, BCG_TEST_DP={DP})")
    if MODEL != "qwen3-0.6b":
        from bcg_bench.models import model_dir

        return str(model_dir(MODEL))  # config only: the engines load dummy weights
    return str(write_scaled_checkpoint(tmp_path_factory.mktemp("bcg-qwen3-0.6b-scaled")))


# -- workload ----------------------------------------------------------------------------------


def workload(seed: int = SEED) -> list[list[dict]]:
    """Waves of requests; each wave is one concurrent ``generate`` call.

    Random lengths 1..2*CHUNK (chunked prefill above CHUNK), 1/4/16 output tokens (decodes mix
    into later prefills with ``enable_mixed_chunk``), and from the third wave on a third of the
    prompts extend an earlier prompt's prefix (radix-cache hits; logprobs start after the prefix
    so SGLang may reuse it).
    """
    rng = random.Random(seed)
    sizes = [1, 7, 32, 40, 60, N_PROMPTS - 140]
    done: list[list[int]] = []
    waves = []
    for w, size in enumerate(sizes):
        wave = []
        for _ in range(size):
            out = rng.choice([1, 4, 16])
            if w >= 2 and done and rng.random() < 1 / 3:
                base = rng.choice(done)
                k = rng.randint(1, len(base))
                ids = base[:k] + [rng.randrange(100, 150000) for _ in range(rng.randint(1, CHUNK))]
                wave.append({"ids": ids, "start": k, "out": out})
            else:
                ids = [rng.randrange(100, 150000) for _ in range(rng.randint(1, 2 * CHUNK))]
                wave.append({"ids": ids, "start": 0, "out": out})
        waves.append(wave)
        done += [r["ids"] for r in wave]
    assert sum(map(len, waves)) == N_PROMPTS
    return waves


def probe_requests(seed: int = SEED + 1) -> list[dict]:
    rng = random.Random(seed)
    reqs = []
    for k, n in PROBES:
        prefix = [rng.randrange(100, 150000) for _ in range(k)]
        fresh = [rng.randrange(100, 150000) for _ in range(n)]
        suffix = [rng.randrange(100, 150000) for _ in range(n)]
        reqs += [{"ids": prefix, "start": 0, "out": 1}, {"ids": fresh, "start": 0, "out": 1},
                 {"ids": prefix + suffix, "start": k, "out": 1, "probe": True}]
    return reqs


# -- engines -----------------------------------------------------------------------------------


def engine_kwargs(model_path: str, mode: str, chunk: int = CHUNK, *, tp: int = TP, dp: int = DP,
                  model: str = MODEL, prefill_graphs: dict | None = None) -> dict:
    """``sglang.Engine`` arguments for prefill mode ``mode`` in this layout (the soak's too);
    ``prefill_graphs``: SGLang's prefill graph settings (``full``'s are :func:`full_reference_graphs`)."""
    if mode == "full":
        prefill_graphs = full_reference_graphs(chunk)
    return dict(
        model_path=model_path,
        load_format="auto" if model == "qwen3-0.6b" else "dummy",
        custom_weight_loader=[] if model == "qwen3-0.6b" else [RESCALE_LOADER],
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=dp > 1,
        skip_tokenizer_init=True,
        attention_backend=ATTENTION_BACKEND,
        chunked_prefill_size=chunk,
        enable_mixed_chunk=True,
        cuda_graph_backend_prefill=mode,
        cuda_graph_backend_decode="disabled",
        mem_fraction_static=0.5,
        log_level="warning",
        **({"cuda_graph_config": {"prefill": prefill_graphs}} if prefill_graphs else {}),
    )


# The request slots of the suite's bcg and full engines where attention stays inside bcg's graphs:
# more than the workload's 60 requests at once, so that full replays every step bcg replays with
# attention inside. Defaults would not: fa3's slots are SGLang's chunk / 512 (4 at the fa3 suite's
# chunk), and SGLang's full runs a step of more requests eagerly. BCG_TEST_SLOTS=host leaves both
# engines SGLang's own count (``sglang-fa3-host-slots``), as an engine gets it by default: a step of
# more requests then runs eagerly in full and in a ``break`` variant in bcg.
SUITE_SLOTS = None if os.environ.get("BCG_TEST_SLOTS") == "host" else int(os.environ.get("BCG_TEST_SLOTS", "64"))


def request_slots() -> int:
    """The request slots of bcg's graph buckets in this run: ``SUITE_SLOTS``, or at SGLang's own count
    bcg's rule, SGLang's (chunk / 512) raised to the backend's floor (64 on flashinfer; fa3 keeps
    SGLang's); the suite's pool and context hold more, so no other bound applies."""
    from bcg_plugin.adapters.sglang.graph_attention import chunk_request_slots

    return SUITE_SLOTS if SUITE_SLOTS is not None else chunk_request_slots(CHUNK, ATTENTION_BACKEND)


def full_request_slots() -> int:
    """The request slots of the reference's (SGLang's full) prefill graphs: ``SUITE_SLOTS``, or
    SGLang's own rule."""
    from bcg_plugin.adapters.sglang.graph_attention import sglang_request_slots

    return SUITE_SLOTS if SUITE_SLOTS is not None else sglang_request_slots(CHUNK)


def slots_layout(slots: int | None) -> dict | None:
    """The engine layout that gives SGLang's prefill graphs ``slots`` request slots (``None``: its own)."""
    return None if slots is None else {"prefill_graphs": {"full_prefill_max_req": slots}}


def full_reference_graphs(chunk: int) -> dict:
    """SGLang's full prefill graphs as the reference of bcg's graph attention: ``SUITE_SLOTS``
    request slots, as bcg's engines here have, and bcg's buckets that keep attention inside
    (``INSIDE_TOKENS``), below its first bucket SGLang's smallest sizes (SGLang runs a step eagerly
    where its bucket more than doubles it), so full replays every step bcg replays with attention
    inside, padded to the same rows, and runs larger ones eagerly, where bcg breaks."""
    from bcg_plugin.ladder import reference_ladder

    assert INSIDE_TOKENS, "full is the reference only where bcg keeps attention inside some bucket"
    ladder = [n for n in reference_ladder(chunk) if n <= INSIDE_TOKENS]
    slots = {} if SUITE_SLOTS is None else {"full_prefill_max_req": SUITE_SLOTS}
    return {**slots, "bs": [n for n in (1, 2, 4, 8) if n < ladder[0]] + ladder}


# Each engine of one test process gets its own port range: under DP attention the process keeps a
# shut-down engine's ports bound, and SGLang derives every port of the next engine from ``port``.
_ENGINE_PORTS = itertools.count(31000, 1000)


def rescale_dummy_weights(engine, model: str = MODEL) -> None:
    """Spread the logits of a dummy-weight engine over a few nats (``dummy_weights``), on every rank.

    SGLang's dummy weights flatten the logits so much that a stale replay stays within float noise
    of eager: the check could not fail. CUDA graphs keep working, as the weights change in place.
    """
    if model == "qwen3-0.6b":
        return
    ok, message = engine.update_weights_from_tensor([], load_format=RESCALE_LOADER, flush_cache=True)
    assert ok, f"rescaling the dummy weights failed: {message}"


def start_engine(model_path: str, mode: str, env: dict[str, str], record: Path, **layout):
    """An engine in this test's layout, or in ``layout`` (``engine_kwargs``' tp, dp, model), its
    schedulers appending their forward records to ``record`` (the bench's timers)."""
    from bcg_bench import sglang_timers

    # The schedulers import dummy_weights (RESCALE_LOADER) and the fault plugins from this folder.
    env = {"PYTHONPATH": soak.with_tests_on_path(os.environ), **env}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        engine = sglang_timers.start_engine(record, **engine_kwargs(model_path, mode, **layout), port=next(_ENGINE_PORTS))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    rescale_dummy_weights(engine, layout.get("model", MODEL))
    return engine


def generate(engine, reqs: list[dict], **routing) -> list[dict]:
    out = engine.generate(
        input_ids=[r["ids"] for r in reqs],
        sampling_params=[{"max_new_tokens": r["out"], "temperature": 0.0, "ignore_eos": True} for r in reqs],
        return_logprob=True,
        logprob_start_len=[r["start"] for r in reqs],
        top_logprobs_num=1,
        **routing,
    )
    return [o["meta_info"] for o in out]


def run_engine(model_path: str, mode: str, waves: list[list[dict]], probes: list[dict], *,
               layout: dict | None = None, **env: str) -> dict:
    record = Path(tempfile.mkdtemp(prefix="bcg-sglang-gpu-")) / "forwards.jsonl"
    engine = start_engine(model_path, mode, env, record, **(layout or {}))
    try:
        results = [m for wave in waves for m in generate(engine, wave)]
        # One request per call: consecutive forwards in a known order, all on one DP rank (else
        # round-robin puts a probe's consecutive forwards on different ranks).
        routing = {"routed_dp_rank": 0} if DP > 1 else {}
        probe_results = [generate(engine, [r], **routing)[0] for r in probes]
    finally:
        engine.shutdown()
    records = [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []
    return {"results": results, "probes": probe_results, "forwards": [f for f in records if f["kind"] == "forward"],
            "captures": [c for c in records if c["kind"] == "capture"]}


# -- comparison --------------------------------------------------------------------------------


def values(meta: dict) -> dict[str, list[float]]:
    def first(xs):
        return [x[0][0] for x in xs if x]

    out_ids = [t[1] for t in meta["output_token_logprobs"]]
    return {
        "input": [t[0] for t in meta["input_token_logprobs"] if t[0] is not None],
        "input_top1": first([x for x in meta["input_top_logprobs"] if x]),
        "output": [t[0] for t in meta["output_token_logprobs"]],
        "output_top1": first(meta["output_top_logprobs"]),
        "output_ids": out_ids,
    }


def error_quantile(model: str = MODEL) -> float:
    """The quantile of a request's per-position errors that ``request_error`` returns (1.0: the max)."""
    from bcg_bench.models import MODELS

    return MOE_QUANTILE if "num_experts" in MODELS[model] else 1.0


def request_error(got: dict, ref: dict, spread: float, quantile: float | None = None,
                  also: dict | None = None) -> float:
    """|logprob difference| / spread at the ``quantile`` (default ``error_quantile()``) of the positions;
    with ``also``, each position's difference from the nearer of ``ref`` and ``also``."""
    a = values(got)
    per_ref = []
    for b in [values(r) for r in (ref, also) if r is not None]:
        diffs = []
        for key in ("input", "input_top1"):
            assert len(a[key]) == len(b[key]), f"{key}: {len(a[key])} vs {len(b[key])} positions"
            diffs += [abs(x - y) for x, y in zip(a[key], b[key])]
        agree = 0  # output positions compare like for like only while the greedy tokens agree
        while (agree < min(len(a["output_ids"]), len(b["output_ids"]))
               and a["output_ids"][agree] == b["output_ids"][agree]):
            agree += 1
        for key in ("output", "output_top1"):
            compared = [abs(x - y) for x, y in zip(a[key][: agree + 1], b[key][: agree + 1])]
            diffs += compared + [None] * (len(a[key]) - len(compared))  # beyond agreement: the other ref's, or none
        per_ref.append(diffs)
    diffs = [min(compared) for compared in ([d for d in position if d is not None] for position in zip(*per_ref))
             if compared]
    if not diffs:
        return 0.0
    q = error_quantile() if quantile is None else quantile
    diffs.sort()
    return diffs[max(math.ceil(q * len(diffs)) - 1, 0)] / spread  # nearest rank: q = 1 is the max


def spread_of(runs: list[dict]) -> float:
    vals = [v for m in runs for v in values(m)["input"]]
    spread = statistics.pstdev(vals)
    assert spread >= MIN_SPREAD, (
        f"eager logprobs spread only {spread:.3g} nats (at least {MIN_SPREAD} needed): the logits are too flat "
        "for the check to see a stale replay; rescale the model's weights (dummy_weights)")
    return spread


def errors(got: list[dict], ref: list[dict], spread: float, also: list[dict] | None = None) -> list[float]:
    assert len(got) == len(ref) and (also is None or len(also) == len(got))
    return [request_error(g, r, spread, also=None if also is None else also[i])
            for i, (g, r) in enumerate(zip(got, ref))]


# -- tests -------------------------------------------------------------------------------------


def kept(name: str, run) -> dict:
    """``run()``'s result through JSON, stored in ``BCG_TEST_RESULTS_DIR`` (when set) and reused from there.

    Eager engines do not read ``BCG_ATTENTION``, so runs with and without graph attention on one
    backend share them; full's are named by the buckets they capture (``INSIDE_TOKENS``), and both
    bcg's and full's by their request slots where attention stays inside."""
    graph = f"-{ATTENTION}" if GRAPH_ATTENTION and not name.startswith(("eager", "full")) else ""
    if graph and VARIANTS:
        graph += "-variants"
    if name.startswith("full") and INSIDE_TOKENS < TOP_BUCKET:
        graph = f"-to{INSIDE_TOKENS}"
    if GRAPH_ATTENTION and not name.startswith("eager"):
        graph += f"-slots{'host' if SUITE_SLOTS is None else SUITE_SLOTS}"
    chunk = ("" if CHUNK == 1024 else f"-chunk{CHUNK}") + ("" if ATTENTION_BACKEND == "triton" else f"-{ATTENTION_BACKEND}") + graph
    path = Path(RESULTS_DIR) / f"sglang-{name}-{MODEL}-tp{TP}-dp{DP}{chunk}.json" if RESULTS_DIR else None
    if path is not None and path.exists():
        return json.loads(path.read_text())
    text = json.dumps(run(), default=str)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(text)
        os.replace(path.with_suffix(".tmp"), path)  # never a half-written result to reuse
    return json.loads(text)


@pytest.fixture(scope="module")
def runs(checkpoint):
    waves, probes = workload(), probe_requests()
    slots = slots_layout(SUITE_SLOTS) if GRAPH_ATTENTION else None
    eager = kept("eager", lambda: run_engine(checkpoint, "disabled", waves, probes))
    bcg = kept("bcg", lambda: run_engine(checkpoint, "bcg", waves, probes, layout=slots, BCG_STATS_INTERVAL_S="1"))
    stale = kept("stale", lambda: run_engine(checkpoint, "bcg", [], probes, layout=slots, BCG_TEST_FAULTS=STALE_FAULT,
                                             BCG_SIZES=STALE_SIZES))
    stale_store = kept("stale-store", lambda: run_engine(checkpoint, "bcg", [], probes, layout=slots,
                                                         BCG_SIZES=STALE_SIZES,
                                                         BCG_TEST_FAULTS=STALE_STORE_FAULT)) if STORE_IN_GRAPH else None
    mode = "disabled" if REFERENCE == "eager" else REFERENCE
    reference = eager if REFERENCE == "eager" else kept(REFERENCE, lambda: run_engine(checkpoint, mode, waves, probes))
    again = kept(f"{REFERENCE}-again", lambda: run_engine(checkpoint, mode, waves, probes))
    spread = spread_of(eager["results"] + eager["probes"])
    print(f"[bcg gpu] eager logprob spread {spread:.4g}; tolerance {TOL} x spread "
          f"at quantile {error_quantile()} of each request's positions; reference: {REFERENCE}")
    runs = {"eager": eager, REFERENCE: reference, "bcg": bcg, "stale": stale,
            "stale_store": stale_store, f"{REFERENCE}_again": again, "spread": spread}
    if REFERENCE != "eager":  # how far the host's own mode is from eager, for the record
        compare(runs, REFERENCE, against="eager")
    return runs


def test_bcg_replayed_prefill_and_mixed_forwards(runs):
    """The comparison below is not vacuous: bcg really served prefill, mixed and chunked forwards."""
    eager_graph = [f for f in runs["eager"]["forwards"] if f["graph"]]
    assert not eager_graph, "the eager engine replayed prefill graphs"
    if REFERENCE != "eager":  # a step the reference ran eagerly would compare bcg with eager prefill again
        forwards = runs[REFERENCE]["forwards"]
        # At SGLang's own request slots full runs a step of more requests eagerly, as bcg breaks there.
        not_replayed = [f["tokens"] for f in forwards if not f["graph"] and f["tokens"] <= INSIDE_TOKENS
                        and f["requests"] <= full_request_slots()]
        print(f"[bcg gpu] {REFERENCE} engine: {sum(f['graph'] for f in forwards)} of {len(forwards)} extend "
              f"forwards replayed")
        assert forwards and not not_replayed, (f"SGLang's {REFERENCE} prefill graphs ran steps eagerly: "
                                               f"{not_replayed[:20]}")
    replayed = [f for f in runs["bcg"]["forwards"] if f["graph"]]
    eager_fallback = [f for f in runs["bcg"]["forwards"] if not f["graph"]]
    print(f"[bcg gpu] bcg engine: {len(replayed)} extend forwards replayed, {len(eager_fallback)} eager")
    assert len(replayed) >= 50
    assert max(f["tokens"] for f in replayed) > TOP_BUCKET // 2, "no large (chunked-prefill) forward replayed"
    in_range = [f["tokens"] for f in eager_fallback if f["tokens"] <= TOP_BUCKET]
    if DP == 1:  # under DP attention SGLang may leave a step eager on every rank (e.g. a rank decoding)
        assert not in_range, f"forwards within the top bucket ran eagerly: {in_range[:20]}"
    # Ranks replay in lockstep: the same buckets in the same order (under DP attention, each the
    # bucket of the DP-wide largest forward, whatever the rank's own share).
    problem = soak.lockstep_problem(soak.replay_sequences(replayed), TP)
    assert problem is None, problem


def captured_fresh(runs: dict) -> bool:
    """Whether the bcg engine's capture kept the ``fresh`` variant of some bucket (on any rank)."""
    from bcg_plugin.adapters.sglang.graph_attention import FRESH

    captures = (runs.get("bcg") or {}).get("captures") or []
    return any(FRESH in names for c in captures if c.get("runner") == "BcgPrefillRunner"
               for names in (c.get("bcg_graph_variants") or {}).values())


def bcg_capture(runs: dict) -> dict:
    """The bcg engine's capture record of rank 0 (exactly one)."""
    [capture] = [c for c in runs["bcg"]["captures"] if c["runner"] == "BcgPrefillRunner" and c["rank"] == 0]
    return capture


def test_attention_stays_inside_the_graph_where_the_backend_plans_it_there(runs):
    """flashinfer and fa3: every bucket captured attention inside its graph under ``BCG_ATTENTION=graph``;
    under ``auto`` every bucket up to ``INSIDE_TOKENS`` and none above, so the check below covers
    that path (and under ``auto`` the break above it); otherwise none did (``break``, or triton,
    which has no graph plan)."""
    capture = bcg_capture(runs)
    inside = capture["bcg_graph_attention_buckets"]
    print(f"[bcg gpu] {ATTENTION_BACKEND}: attention inside the graph in {len(inside)} of "
          f"{capture['bcg_buckets']} buckets")
    from bcg_plugin.ladder import reference_ladder

    assert inside == [n for n in reference_ladder(CHUNK) if n <= INSIDE_TOKENS]
    if INSIDE_TOKENS == TOP_BUCKET:
        assert len(inside) == capture["bcg_buckets"]
    else:  # the larger buckets break
        assert capture["bcg_buckets"] > len(inside)


def test_steps_without_a_cached_prefix_replay_in_the_fresh_variant_and_the_others_in_the_bucket(runs):
    """Graph variants (the default) on flashinfer 0.7.2 on: every graph bucket is also captured as the
    ``fresh`` variant (ragged prefill, no split KV), and the run served both it and the buckets' own
    graphs (steps on a cached prefix), so the check below covers both. Otherwise no such variant."""
    from bcg_plugin import BREAKING
    from bcg_plugin.adapters.sglang.graph_attention import FRESH, fresh_decline_reason

    capture = bcg_capture(runs)
    inside = capture["bcg_graph_attention_buckets"]
    if not VARIANTS or not inside or ATTENTION_BACKEND != "flashinfer":
        assert not any(FRESH in names for names in capture["bcg_graph_variants"].values())
        pytest.skip("graph variants are off, no bucket keeps attention inside the graph in this run, or the "
                    "backend has no fresh variant (flashinfer's only)")
    # SGLang's eager ragged wrapper asks flashinfer for "auto" on Hopper: only the version decides
    why_not = fresh_decline_reason(types.SimpleNamespace(prefill_wrapper_ragged=types.SimpleNamespace(
        _requested_backend="auto")))
    if why_not is not None:
        assert not any(FRESH in names for names in capture["bcg_graph_variants"].values())
        pytest.skip(f"no fresh variant: {why_not}")
    assert {b: [n for n in names if n != BREAKING] for b, names in capture["bcg_graph_variants"].items()} == {
        str(b): [FRESH] for b in inside}
    graph_steps = [f for f in runs["bcg"]["forwards"] if f["graph"] and f["tokens"] <= max(inside)]
    fresh = sum(f.get("variant") == FRESH for f in graph_steps)
    print(f"[bcg gpu] {len(graph_steps)} replays in graph-attention buckets, {fresh} of them in the {FRESH!r} variant")
    assert 0 < fresh < len(graph_steps), "the run did not serve both the fresh variant and the buckets' own graphs"


def test_graph_buckets_larger_than_the_request_slots_are_also_captured_breaking(runs):
    """Graph variants (the default): the graph buckets the adapter picks so that every one that can
    hold a step of more requests than the request slots (:func:`request_slots`) has one within reach
    are also captured as the ``break`` variant; with variants off, none is."""
    from bcg_plugin import BREAKING
    from bcg_plugin.adapters.sglang.graph_attention import breaking_buckets

    capture = bcg_capture(runs)
    inside = capture["bcg_graph_attention_buckets"]
    breaking = {b: names for b, names in capture["bcg_graph_variants"].items() if BREAKING in names}
    print(f"[bcg gpu] {ATTENTION_BACKEND}: {len(breaking)} of {len(inside)} graph buckets also captured breaking")
    if not VARIANTS or not inside:
        assert not breaking
        pytest.skip("graph variants are off, or no bucket keeps attention inside the graph in this run")
    assert sorted(int(b) for b in breaking) == breaking_buckets(inside, request_slots())
    assert breaking, "no graph bucket is larger than the request slots: the variant went untested"


def test_the_kv_cache_store_runs_in_the_segment_where_the_backend_allows_it(runs):
    """triton's, flashinfer's and fa3's plain MHA pool: every layer's store captured in the segment before
    its attention, a break or attention inside the graph (what the stale-store control makes stale)."""
    capture = bcg_capture(runs)
    layers = model_config()["num_hidden_layers"]
    print(f"[bcg gpu] {ATTENTION_BACKEND}: KV-cache store in the segment in {capture['bcg_store_in_graph_layers']} "
          f"of {layers} layers")
    assert capture["bcg_store_in_graph_layers"] == (layers if SEGMENT_STORE else 0)


def second_references(runs: dict, name: str, against: str = REFERENCE) -> dict[str, list]:
    """Per list of outputs (``results``, ``probes``), what each of run ``name``'s may match instead of
    ``against``'s: where the bcg engine captured the ``fresh`` variant, against ``full``, eager's,
    position by position (a step without a cached prefix runs that variant, eager's ragged prefill,
    and the others full's paged one; ``full`` against eager differs by up to about TOL, so neither
    alone is the exact reference); else nothing (``None`` each), so a run whose backend captured no
    such variant (fa3, an older flashinfer) is held to ``full`` alone. The reference's own repeat is held to it alone."""
    second = (runs["eager"] if captured_fresh(runs) and against == REFERENCE != "eager"
              and not name.endswith("_again") else None)
    return {run: second[run] if second is not None else [None] * len(runs[against][run])
            for run in ("results", "probes")}


def compare(runs: dict, name: str, against: str = REFERENCE) -> list[float]:
    """Every request's and probe's error of run ``name`` against run ``against`` (or, position by
    position, its :func:`second_references`), printed."""
    spread, ref = runs["spread"], runs[against]
    also = second_references(runs, name, against)
    errs = errors(runs[name]["results"], ref["results"], spread, also["results"])
    probe_errs = errors(runs[name]["probes"], ref["probes"], spread, also["probes"])
    worst_max = max(request_error(g, r, spread, quantile=1.0, also=also[run][i])
                    for run in ("results", "probes") for i, (g, r) in enumerate(zip(runs[name][run], ref[run])))
    label = (name if against == REFERENCE else f"{name} against {against}") + (
        " (or eager)" if any(also["results"]) else "")
    print(f"[bcg gpu] {label}: {len(errs)} requests + {len(probe_errs)} probes: worst {max(errs + probe_errs):.4f}, "
          f"median {statistics.median(errs):.4f}, beyond TOL {sum(e > TOL for e in errs + probe_errs)}; "
          f"worst single position {worst_max:.4f} (x spread)")
    return errs + probe_errs


def test_bcg_matches_the_reference_logprobs(runs):
    errs = compare(runs, "bcg")
    assert max(errs) <= TOL, sorted(errs)[-10:]


def test_reference_again_passes_the_same_check(runs):
    """Positive control: the check is not stricter than the reference (the host's eager prefill, or
    its full prefill graphs) against itself."""
    errs = compare(runs, f"{REFERENCE}_again")
    assert max(errs) <= TOL, (f"{REFERENCE} prefill run twice fails the check ({sorted(errs)[-10:]}): the check is "
                              "stricter than the host's own reproducibility, so a bcg failure would say nothing")


def stale_probe_errors(runs: dict, name: str) -> list[float]:
    """The probes' errors of the faulted run ``name`` against the reference; it must have replayed."""
    assert any(f["graph"] for f in runs[name]["forwards"]), f"the {name} engine never replayed"
    pairs = [(i, (g, r)) for i, (g, r, q) in enumerate(zip(runs[name]["probes"], runs[REFERENCE]["probes"],
                                                          probe_requests())) if q.get("probe")]
    also = second_references(runs, name)["probes"]  # as compare() holds bcg
    errs = [request_error(g, r, runs["spread"], also=also[i]) for i, (g, r) in pairs]
    print(f"[bcg gpu] {name} probe errors (x spread): {[round(e, 3) for e in errs]}")
    return errs


def test_stale_replay_fails_the_same_check(runs):
    """Negative control: the previous replay's attention plan must be caught by the same check."""
    errs = stale_probe_errors(runs, "stale")
    assert max(errs) > TOL, "a stale replay passed the correctness check: the check cannot see staleness"


def test_stale_store_slots_fail_the_same_check(runs):
    """Negative control of the KV-cache store inside the graph (before the break, or inside the
    graph's attention): graphs that store
    the step's keys and values at the slots the bucket was captured with, not the step's, must be
    caught by the same check (the probes that reuse a cached prefix read what was never stored)."""
    if runs["stale_store"] is None:
        pytest.skip(f"{ATTENTION_BACKEND} with attention breaking stores the KV cache in the break: no store in the graph")
    errs = stale_probe_errors(runs, "stale_store")
    assert max(errs) > TOL, ("graphs storing the KV cache at stale slots passed the correctness check: "
                             "the check cannot see where the graph stores")


# -- a step with more requests than graph attention's request slots -----------------------------

# The suite's workload sends at most 60 requests at once, under SUITE_SLOTS, so this test gives
# bcg REROUTE_SLOTS through SGLang's own full_prefill_max_req and sends
# REROUTE_PROMPTS short prompts at once: a step of more requests than slots, in few enough tokens for
# a bucket that keeps attention inside, which must replay in a graph that breaks: with graph
# variants a ``break`` variant (of its bucket or a larger one), else the next larger bucket.
REROUTE_SLOTS = 4
REROUTE_PROMPTS = 12


def reroute_wave(seed: int = SEED + 3) -> list[dict]:
    rng = random.Random(seed)
    return [{"ids": [rng.randrange(100, 150000) for _ in range(rng.randint(8, 32))], "start": 0, "out": 4}
            for _ in range(REROUTE_PROMPTS)]


@pytest.fixture(scope="module")
def reroute_runs(checkpoint, runs):
    if not GRAPH_ATTENTION or INSIDE_TOKENS == TOP_BUCKET:  # GRAPH_ATTENTION holds only without DP attention
        pytest.skip("needs buckets that keep attention inside and larger ones that break (flashinfer or fa3 "
                    "with BCG_ATTENTION=auto, no DP attention, a chunk above the backend's limit)")
    wave = reroute_wave()
    assert sum(len(r["ids"]) for r in wave) <= INSIDE_TOKENS
    eager = run_engine(checkpoint, "disabled", [wave], [])
    bcg = run_engine(checkpoint, "bcg", [wave], [], layout=slots_layout(REROUTE_SLOTS))
    return {"eager": eager, "bcg": bcg, "spread": runs["spread"]}


def test_a_step_with_more_requests_than_the_slots_replays_in_a_graph_that_breaks(reroute_runs):
    """Under ``auto``, a step whose requests outnumber graph attention's request slots replays, not
    eagerly, in a graph whose attention breaks: with graph variants the ``break`` variant of
    its bucket or a larger one, else the next larger bucket that breaks (a bucket that keeps
    attention inside cannot hold it, so a replay outside a variant is that reroute). Either runs eager's kernels, so it
    matches eager prefill within the module's tolerance; the module's stale controls show that
    check can fail."""
    from bcg_plugin import BREAKING

    forwards = reroute_runs["bcg"]["forwards"]
    rerouted = [f for f in forwards if f["requests"] > REROUTE_SLOTS and f["tokens"] <= INSIDE_TOKENS]
    print(f"[bcg gpu] reroute: {len(rerouted)} steps of more than {REROUTE_SLOTS} requests within "
          f"{INSIDE_TOKENS} tokens: {[(f['requests'], f['tokens'], f['graph'], f['variant']) for f in rerouted]}")
    assert rerouted, f"no step held more than {REROUTE_SLOTS} requests within {INSIDE_TOKENS} tokens: {forwards}"
    assert all(f["graph"] for f in rerouted), "a step of more requests than the slots ran eagerly"
    expected = BREAKING if VARIANTS else None
    assert all(f["variant"] == expected for f in rerouted), f"expected variant {expected!r}"
    errs = errors(reroute_runs["bcg"]["results"], reroute_runs["eager"]["results"], reroute_runs["spread"])
    print(f"[bcg gpu] reroute against eager: {len(errs)} requests: worst {max(errs):.4f} (x spread)")
    assert max(errs) <= TOL, sorted(errs)[-5:]


# -- DP attention on a dense model: a rank with fewer tokens than the DP-wide bucket ------------

# Attention TP 1 on each of two DP ranks (SGLang's tp_size is the GPU count, dp_size divides it), a
# dense model whatever BCG_TEST_MODEL says. Each DP rank's chunked-prefill share is CHUNK // 2.
DP_DENSE = {"tp": 2, "dp": 2, "model": "qwen3-0.6b"}
DP_DENSE_WAVES = 6


def dp_unequal_waves(seed: int = SEED + 2) -> list[list[list[dict]]]:
    """Waves of one batch per DP rank (``wave[r]`` goes to rank ``r``), submitted together.

    One rank gets a prompt of two to three of its chunked-prefill shares, so it extends over several
    steps; the other gets a few short prompts, which land in one of those steps whichever step they
    reach the scheduler in. In that step both ranks extend, the short side with fewer tokens than
    the DP-wide bucket, so its batch is padded (its query, key, value and cache slots trimmed to
    the real rows at the attention break). The long side alternates between the ranks.
    """
    rng = random.Random(seed)
    share = CHUNK // DP_DENSE["dp"]
    waves = []
    for w in range(DP_DENSE_WAVES):
        long = [{"ids": [rng.randrange(100, 150000) for _ in range(rng.randint(2 * share, 3 * share))],
                 "start": 0, "out": rng.choice([1, 4])}]
        short = [{"ids": [rng.randrange(100, 150000) for _ in range(rng.randint(1, share // 4))],
                  "start": 0, "out": rng.choice([1, 4])} for _ in range(rng.randint(1, 3))]
        waves.append([long, short] if w % 2 == 0 else [short, long])
    return waves


def generate_on_ranks(engine, per_rank: list[list[dict]]) -> list[list[dict]]:
    """``per_rank[r]`` routed to DP rank ``r``, every batch in flight at once."""
    import asyncio

    async def one(reqs: list[dict], rank: int) -> list[dict]:
        out = await engine.async_generate(
            input_ids=[r["ids"] for r in reqs],
            sampling_params=[{"max_new_tokens": r["out"], "temperature": 0.0, "ignore_eos": True} for r in reqs],
            return_logprob=True,
            logprob_start_len=[r["start"] for r in reqs],
            top_logprobs_num=1,
            routed_dp_rank=rank,
        )
        return [o["meta_info"] for o in out]

    async def every_rank() -> list[list[dict]]:
        return list(await asyncio.gather(*(one(reqs, r) for r, reqs in enumerate(per_rank))))

    return engine.loop.run_until_complete(every_rank())


def run_dp_dense_engine(model_path: str, mode: str, waves: list[list[list[dict]]], **env: str) -> dict:
    record = Path(tempfile.mkdtemp(prefix="bcg-sglang-dp-dense-")) / "forwards.jsonl"
    engine = start_engine(model_path, mode, dict(env), record, **DP_DENSE)
    try:
        results = [m for wave in waves for batch in generate_on_ranks(engine, wave) for m in batch]
    finally:
        engine.shutdown()
    forwards = [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []
    return {"results": results, "forwards": [f for f in forwards if f["kind"] == "forward"]}


@pytest.fixture(scope="module")
def dp_dense_runs(tmp_path_factory):
    import torch

    gpus = DP_DENSE["tp"]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"DP attention over {DP_DENSE['dp']} ranks needs {gpus} GPUs, {torch.cuda.device_count()} visible")
    checkpoint = str(write_scaled_checkpoint(tmp_path_factory.mktemp("bcg-dp-dense"), model=DP_DENSE["model"]))
    waves = dp_unequal_waves()
    eager = run_dp_dense_engine(checkpoint, "disabled", waves)
    bcg = run_dp_dense_engine(checkpoint, "bcg", waves, BCG_STATS_INTERVAL_S="1")
    return {"eager": eager, "bcg": bcg, "spread": spread_of(eager["results"])}


def test_dp_attention_dense_replays_ranks_padded_to_the_dp_wide_bucket(dp_dense_runs):
    """The comparison below covers the case: bcg replayed steps in which one rank held fewer tokens
    than the other (each such step used to kill the schedulers at the first attention break)."""
    replayed = [f for f in dp_dense_runs["bcg"]["forwards"] if f["graph"]]
    unequal = [f for f in replayed if f.get("across_dp") and min(f["across_dp"]) < max(f["across_dp"])]
    print(f"[bcg gpu] DP attention, dense: {len(replayed)} forwards replayed, {len(unequal)} with unequal ranks")
    assert unequal, "no replayed step had ranks with unequal token counts: the workload missed the case"
    problem = soak.lockstep_problem(soak.replay_sequences(replayed), DP_DENSE["tp"])
    assert problem is None, problem


def test_dp_attention_dense_matches_eager_logprobs(dp_dense_runs):
    """The same check as ``test_bcg_matches_the_reference_logprobs`` (its controls there), every position."""
    spread = dp_dense_runs["spread"]
    got, ref = dp_dense_runs["bcg"]["results"], dp_dense_runs["eager"]["results"]
    assert len(got) == len(ref)
    errs = [request_error(g, r, spread, quantile=1.0) for g, r in zip(got, ref)]
    print(f"[bcg gpu] DP attention, dense: {len(errs)} requests, worst {max(errs):.4f} x spread")
    assert max(errs) <= TOL, sorted(errs)[-10:]
