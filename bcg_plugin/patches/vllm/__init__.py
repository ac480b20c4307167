"""What bcg-plugin patches in vLLM, one module per patched vLLM symbol (table: patches/README.md).

Two sets, each verified in full before any of it is applied, and applied all or nothing:

* ``ENTRY``, installed by ``register()`` in every process: cheap targets in modules vLLM has
  already imported, pass-throughs unless the engine config enables bcg;
* ``RUNNER``, installed in a worker whose config enables bcg, before its model runner is built.
"""

from __future__ import annotations

from bcg_plugin.patches._patch import PatchSet, supported_versions
from bcg_plugin.patches.vllm._kernel import Kernel
from bcg_plugin.patches.vllm import (
    unified_attention_with_output,
    v1_cudagraph_dispatcher_dispatch,
    v1_gpu_model_runner_capture_model,
    v1_gpu_model_runner_dummy_run,
    v1_gpu_model_runner_model_forward,
    v1_gpu_model_runner_profile_cudagraph_memory,
    v2_cudagraph_manager_dispatch,
    v2_cudagraph_manager_needs_capture,
    v2_cudagraph_manager_run_pw_graph,
    v2_model_cudagraph_manager_capture,
    vllm_config_post_init,
    worker_wrapper_init_device,
)

HOST = "vllm"  # the distribution whose version the patches are checked against
TITLE = "vLLM"
NOTES = """\
A wrapped target's parameter names must equal, in order, the ones the patch was written against
(the wrapper passes arguments positionally), and so must those of the vLLM methods a patch calls
without patching them. Sets are removable (`PatchSet.unapply`). Any other vLLM version: one
warning, vLLM unpatched, the engine runs as without bcg. If the runner set cannot be verified in a
worker: one warning, bcg off in that engine (torch.compile stays as the front-end set it)."""

ENTRY = PatchSet("entry", [vllm_config_post_init.PATCH, worker_wrapper_init_device.PATCH],
                 when="`register()`, in every process that loads plugins; pass-throughs unless "
                      "`additional_config` has a `\"bcg\"` key")
RUNNER = PatchSet("runner", [
    v2_cudagraph_manager_dispatch.PATCH,
    v2_cudagraph_manager_needs_capture.PATCH,
    v2_model_cudagraph_manager_capture.PATCH,
    v2_cudagraph_manager_run_pw_graph.PATCH,
    v1_cudagraph_dispatcher_dispatch.PATCH,
    v1_gpu_model_runner_profile_cudagraph_memory.PATCH,
    v1_gpu_model_runner_capture_model.PATCH,
    v1_gpu_model_runner_model_forward.PATCH,
    v1_gpu_model_runner_dummy_run.PATCH,
    unified_attention_with_output.PATCH,
], when="a worker whose config enables bcg, from the `init_device` patch, before its model runner is built")
SETS = (ENTRY, RUNNER)
ALL = [*ENTRY.patches, *RUNNER.patches]
SUPPORTED = supported_versions(ALL)

__all__ = ["ALL", "ENTRY", "HOST", "Kernel", "RUNNER", "SETS", "SUPPORTED"]
