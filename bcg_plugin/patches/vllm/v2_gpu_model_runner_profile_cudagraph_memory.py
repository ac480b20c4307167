"""V2 ``GPUModelRunner.profile_cudagraph_memory``: bcg's graphs in the estimate, from a sample of its buckets.

vLLM's V2 worker estimates its graphs' memory before it allocates the KV cache: it runs the whole
capture once on a minimal KV cache, measures the free memory it takes, captures only the largest
two FULL graphs and extrapolates them to the rest. bcg's buckets are captured in that run too (the
V2 capture patch); inside this method they are sampled the same way instead, largest of each kind,
released, and their extrapolated total added to vLLM's figure, so the profiling run does not
capture every bucket a second time. Through 0.28 the V2 method estimates nothing and captures
nothing, and from 0.34 neither does it under the extensible KV cache (vLLM's default on CUDA), which
sizes itself from the free memory measured after the real capture, bcg's graphs included: the
wrapper passes its 0 through.
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def make(original, *, profile_v2):
    @functools.wraps(original)
    def profile_cudagraph_memory(self, *args, **kwargs):
        return profile_v2(lambda: original(self, *args, **kwargs))

    return profile_cudagraph_memory


PATCH = Patch(
    target="vllm.v1.worker.gpu.model_runner.GPUModelRunner.profile_cudagraph_memory",
    how=Wrap(params=["self"]),
    make=make,
    reason="V2: bcg's buckets sampled (the largest of each kind, released) and extrapolated inside vLLM's "
           "graph-memory profiling, as vLLM does its FULL graphs, instead of every bucket captured a second "
           "time there; the sum sizes the KV cache (a pass-through before 0.29, where vLLM's V2 method returns 0, "
           "and from 0.34 under the extensible KV cache, which measures the graphs after their capture)",
    hosts=">=0.26.0,<0.35",
    upstream=NOT_FILED,
    remove_when="vLLM lets external graph runners report their memory before the KV cache is sized",
)
