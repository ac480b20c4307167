"""``WorkerWrapperBase.init_device``: install the model-runner patches in a worker that runs bcg.

Plugins load in each worker before its config is known to them; this is the first call that has
the config and precedes the model runner's construction. Installing the runner patches only here
keeps ``register()`` cheap in processes that never build a runner (the API server).
"""

from __future__ import annotations

import functools

from bcg_plugin.patches.vllm._patch import Patch


def make(original):
    @functools.wraps(original)
    def init_device(self, *args, **kwargs):
        from bcg_plugin.adapters.vllm.plugin import arm_runner_patches

        if self.vllm_config is not None:
            arm_runner_patches(self.vllm_config)
        return original(self, *args, **kwargs)

    return init_device


PATCH = Patch(
    module="vllm.v1.worker.worker_base",
    qualname="WorkerWrapperBase.init_device",
    params=["self"],
    make=make,
    reason="install the runner patches lazily, only in workers whose config enables bcg",
    remove_when="the runner patches move upstream, or vLLM passes the config to general plugins",
)
