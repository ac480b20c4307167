"""What bcg-plugin patches in vLLM, one module per patched vLLM symbol (table: patches/README.md).

Two sets, each verified in full before any of it is applied, and applied all or nothing:

* ``ENTRY``, installed by ``register()`` in every process: cheap targets in modules vLLM has
  already imported, pass-throughs unless the engine config enables bcg;
* ``RUNNER``, installed in a worker whose config enables bcg, before its model runner is built.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

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
from bcg_plugin.patches.vllm._patch import Patch, PatchSet, PatchTargetError

# The vLLM releases these patches were written and verified against.
SUPPORTED_VLLM = SpecifierSet("==0.26.0")

ENTRY = PatchSet("vllm-entry", [vllm_config_post_init.PATCH, worker_wrapper_init_device.PATCH])
RUNNER = PatchSet("vllm-runner", [
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
])
ALL = [*ENTRY.patches, *RUNNER.patches]

__all__ = ["ALL", "ENTRY", "RUNNER", "SUPPORTED_VLLM", "Patch", "PatchSet", "PatchTargetError"]
