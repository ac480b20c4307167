"""What bcg-plugin patches in vLLM, one module per patched vLLM symbol (table: patches/README.md).

Two sets, each verified in full before any of it is applied, and applied all or nothing:

* ``ENTRY``, installed by ``register()`` in every process: cheap targets in modules vLLM has
  already imported, pass-throughs unless the engine config enables bcg;
* ``RUNNER``, installed in a worker whose config enables bcg, before its model runner is built.
"""

from __future__ import annotations

from bcg_plugin.patches._patch import PatchSet, descriptors
from bcg_plugin.versions import HostGate
from bcg_plugin.patches.vllm._kernel import Kernel
from bcg_plugin.patches.vllm import (
    breakable_capture_current,
    unified_attention_with_output,
    v1_cudagraph_dispatcher_dispatch,
    v1_gpu_model_runner_capture_model,
    v1_gpu_model_runner_dummy_run,
    v1_gpu_model_runner_model_forward,
    v1_gpu_model_runner_profile_cudagraph_memory,
    v2_cudagraph_manager_dispatch,
    v2_cudagraph_manager_needs_capture,
    v2_cudagraph_manager_run_pw_graph,
    v2_gpu_model_runner_profile_cudagraph_memory,
    v2_model_cudagraph_manager_capture,
    v2_model_cudagraph_manager_run_fullgraph,
    vllm_config_post_init,
    worker_wrapper_init_device,
)

HOST = "vllm"  # the distribution whose version the patches are checked against
# Every vLLM release the descriptors below cover; CI checks four of them against the real package.
GATE = HostGate(HOST, ">=0.26.0,<0.35", (
    "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"))
SUPPORTED = GATE.supported
TITLE = "vLLM"
NOTES = """\
A wrapped target's parameter names must equal, in order, the ones the patch was written against
(the wrapper passes arguments positionally), and so must those of the vLLM methods a patch calls
without patching them. Sets are removable (`PatchSet.unapply`). Any other vLLM version: one
warning, vLLM unpatched, the engine runs as without bcg. If the runner set cannot be verified in a
worker: one warning, bcg off in that engine (torch.compile stays as the front-end set it)."""

ENTRY = PatchSet("entry", descriptors(vllm_config_post_init, worker_wrapper_init_device), select=GATE.selected,
                 when="`register()`, in every process that loads plugins; pass-throughs unless "
                      "`additional_config` has a `\"bcg\"` key")
RUNNER = PatchSet("runner", descriptors(
    v2_cudagraph_manager_dispatch,
    v2_cudagraph_manager_needs_capture,
    v2_model_cudagraph_manager_capture,
    v2_gpu_model_runner_profile_cudagraph_memory,
    v2_cudagraph_manager_run_pw_graph,
    v2_model_cudagraph_manager_run_fullgraph,
    v1_cudagraph_dispatcher_dispatch,
    v1_gpu_model_runner_profile_cudagraph_memory,
    v1_gpu_model_runner_capture_model,
    v1_gpu_model_runner_model_forward,
    v1_gpu_model_runner_dummy_run,
    unified_attention_with_output,
    breakable_capture_current,
), select=GATE.selected, when="a worker whose config enables bcg, from the `init_device` patch, before its model runner is built")
SETS = (ENTRY, RUNNER)
ALL = [*ENTRY.patches, *RUNNER.patches]

__all__ = ["ALL", "ENTRY", "GATE", "HOST", "Kernel", "RUNNER", "SETS", "SUPPORTED"]
