#!/usr/bin/env bash
# The GPU suites, on a machine with a CUDA device and the host engine importable (CI has no GPU, so
# these run by hand; GIT_COMMIT names the commit where the tree has no git). Each suite's output
# goes to LOGDIR/<suite>.log, headed by what ran where.
#   ci/gpu-tests.sh LOGDIR SUITE [SUITE...]
#   suites: core, vllm, vllm-graph, vllm-compile, vllm-step-limit, sglang, sglang-flashinfer,
#           sglang-flashinfer-auto, sglang-flashinfer-one-graph, sglang-flashinfer-break, sglang-fa3,
#           sglang-fa3-host-slots, sglang-fa3-graph, sglang-fa3-break, metrics
# (sglang runs SGLang's triton backend, where attention breaks; sglang-flashinfer its flashinfer
# backend with attention inside bcg's graphs, BCG_ATTENTION=graph, against SGLang's own full prefill
# graphs; sglang-flashinfer-auto the same backend with the defaults, BCG_ATTENTION=auto, inside the
# small buckets and breaking above, against full graphs of those buckets, and the graph buckets'
# variants; sglang-flashinfer-one-graph the same without the variants, BCG_GRAPH_VARIANTS=0;
# sglang-flashinfer-break the same backend with attention breaking, BCG_ATTENTION=break; sglang-fa3
# the fa3 backend, SGLang's default on Hopper, with the default BCG_ATTENTION=auto, inside the
# buckets up to 1024 tokens and breaking above (a chunk of 2048, so that some break), against full
# graphs of those buckets, and some graph buckets' break variants (a step of more requests than the
# slots); sglang-fa3-host-slots the same at SGLang's own request slots (4 at that chunk), the
# count an engine gets by default; sglang-fa3-graph fa3 with attention inside
# every bucket, against SGLang's own full prefill graphs; sglang-fa3-break fa3 with attention
# breaking, against eager)
set -uo pipefail
cd "$(dirname "$0")/.."
logdir="$1"; shift
mkdir -p "$logdir"
commit="${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
rc=0
for suite in "$@"; do
    env=()
    case "$suite" in
        core)            args=(tests/gpu/test_runtime_gpu.py -m gpu) ;;
        vllm)            args=(tests/gpu/test_vllm_gpu.py -m gpu -k "not compile and not graph") ;;
        vllm-graph)      args=(tests/gpu/test_vllm_gpu.py -m gpu -k "graph") ;;
        vllm-compile)    args=(tests/gpu/test_vllm_gpu.py -m gpu -k compile) ;;
        vllm-step-limit) args=(tests/gpu/test_vllm_step_limit_gpu.py -m gpu) ;;
        sglang)          args=(tests/gpu/test_sglang_gpu.py -m gpu) ;;
        sglang-flashinfer) args=(tests/gpu/test_sglang_gpu.py -m gpu); env=(BCG_TEST_ATTENTION_BACKEND=flashinfer BCG_ATTENTION=graph) ;;
        sglang-flashinfer-auto) args=(tests/gpu/test_sglang_gpu.py -m gpu); env=(BCG_TEST_ATTENTION_BACKEND=flashinfer BCG_ATTENTION=auto) ;;
        sglang-flashinfer-one-graph) args=(tests/gpu/test_sglang_gpu.py -m gpu); env=(BCG_TEST_ATTENTION_BACKEND=flashinfer BCG_ATTENTION=auto BCG_GRAPH_VARIANTS=0) ;;
        sglang-flashinfer-break) args=(tests/gpu/test_sglang_gpu.py -m gpu); env=(BCG_TEST_ATTENTION_BACKEND=flashinfer BCG_ATTENTION=break) ;;
        sglang-fa3)      args=(tests/gpu/test_sglang_gpu.py -m gpu); env=(BCG_TEST_ATTENTION_BACKEND=fa3 BCG_ATTENTION=auto BCG_TEST_CHUNK=2048) ;;
        sglang-fa3-host-slots) args=(tests/gpu/test_sglang_gpu.py -m gpu); env=(BCG_TEST_ATTENTION_BACKEND=fa3 BCG_ATTENTION=auto BCG_TEST_CHUNK=2048 BCG_TEST_SLOTS=host) ;;
        sglang-fa3-graph) args=(tests/gpu/test_sglang_gpu.py -m gpu); env=(BCG_TEST_ATTENTION_BACKEND=fa3 BCG_ATTENTION=graph) ;;
        sglang-fa3-break) args=(tests/gpu/test_sglang_gpu.py -m gpu); env=(BCG_TEST_ATTENTION_BACKEND=fa3 BCG_ATTENTION=break) ;;
        metrics)         args=(tests/gpu/test_metrics_gpu.py -m gpu) ;;
        *) echo "gpu-tests: unknown suite '$suite' (core, vllm, vllm-graph, vllm-compile, vllm-step-limit, sglang, sglang-flashinfer, sglang-flashinfer-auto, sglang-flashinfer-one-graph, sglang-flashinfer-break, sglang-fa3, sglang-fa3-host-slots, sglang-fa3-graph, sglang-fa3-break, metrics)" >&2; exit 2 ;;
    esac
    log="$logdir/$suite.log"
    {
        echo "# ${env[*]+${env[*]} }python3 -m pytest ${args[*]} -s"
        python3 - "$commit" <<'PY'
import importlib.metadata as md, sys, datetime, torch
def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "absent"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}, {gpu}, torch {torch.__version__}, "
      f"vllm {v('vllm')}, sglang {v('sglang')}, bcg-plugin {v('bcg-plugin')} at {sys.argv[1]}")
PY
    } > "$log"
    env ${env[@]+"${env[@]}"} python3 -m pytest "${args[@]}" -s -p no:cacheprovider >> "$log" 2>&1
    status=$?
    echo "== $suite: exit $status ($(grep -E '(passed|failed|error)' "$log" | tail -1))"
    [ "$status" -eq 0 ] || rc=1
done
exit "$rc"
