"""V1 ``GPUModelRunner.profile_cudagraph_memory``: add bcg's graphs to the estimate the KV cache is sized with.

vLLM's V1 worker estimates its graphs' memory before it allocates the KV cache, by capturing two
graphs per mode on a minimal KV cache and extrapolating, and takes the estimate out of the KV
budget (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, on by default). bcg's buckets are captured
later, outside that estimate; without this patch they come on top of ``--gpu-memory-utilization``.
bcg estimates them the same way (its two largest buckets on a minimal KV cache, released again)
and the sum is returned. After the capture vLLM logs the actual figure against this estimate: the
capture patch adds bcg's measured memory to the actual one.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def make(original, *, estimate_v1):
    @functools.wraps(original)
    def profile_cudagraph_memory(self, *args, **kwargs):
        return original(self, *args, **kwargs) + estimate_v1(self)

    return profile_cudagraph_memory


PATCH = Patch(
    target="vllm.v1.worker.gpu_model_runner.GPUModelRunner.profile_cudagraph_memory",
    how=Wrap(params=["self"],
             uses={"vllm.v1.worker.gpu_model_runner.GPUModelRunner._init_minimal_kv_cache_for_profiling": ["self"],
                       "vllm.v1.worker.gpu_model_runner.GPUModelRunner._cleanup_profiling_kv_cache": ["self"]}),
    make=make,
    reason="V1: add bcg's graph memory, estimated like vLLM's own (its two largest buckets captured on a "
           "minimal KV cache, released, extrapolated to the ladder), to the estimate the worker takes "
           "out of the KV-cache budget; without it bcg's graphs come on top of "
           "`--gpu-memory-utilization`",
    hosts=">=0.26.0,<0.34",
    upstream=NOT_FILED,
    remove_when="vLLM lets external graph runners report their memory before the KV cache is sized",
)
