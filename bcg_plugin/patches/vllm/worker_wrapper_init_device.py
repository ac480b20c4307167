"""``WorkerWrapperBase.init_device``: install the model-runner patches in a worker that runs bcg.

Plugins load in each worker before its config is known to them; this is the first call that has
the config and precedes the model runner's construction. Installing the runner patches only here
keeps ``register()`` cheap in processes that never build a runner (the API server).
"""

from __future__ import annotations

import functools

from bcg_plugin.patches._patch import NOT_FILED, Patch, Wrap


def make(original, *, arm_runner_patches):
    @functools.wraps(original)
    def init_device(self, *args, **kwargs):
        if self.vllm_config is not None:
            arm_runner_patches(self.vllm_config)
        return original(self, *args, **kwargs)

    return init_device


PATCH = Patch(
    target="vllm.v1.worker.worker_base.WorkerWrapperBase.init_device",
    how=Wrap(params=["self"]),
    make=make,
    reason="first call in a worker that has the config and precedes the model runner: install the runner "
           "set there only, in workers whose config enables bcg",
    hosts=">=0.26.0,<0.35",
    upstream=NOT_FILED,
    remove_when="the runner patches move upstream, or vLLM passes the config to general plugins",
)
