"""Kernel of the ``vllm::unified_attention_with_output`` op: attention becomes bcg's eager break.

vLLM calls attention through this custom op; the dispatcher holds the function registered at
import, so the break is installed as the op's kernel for the platform's dispatch key (rebinding the
module attribute would not reach the op). Unapplying registers the original function again.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings
from typing import Any

from bcg_plugin.patches.vllm._patch import PatchTargetError

MODULE = "vllm.model_executor.layers.attention.attention"
OP = "unified_attention_with_output"
PARAMS = ["query", "key", "value", "output", "layer_name", "output_scale", "output_block_scale",
          "kv_cache_dummy_dep"]


@dataclasses.dataclass
class KernelPatch:
    """Replaces the kernel of one ``torch.ops.vllm`` op; same interface as :class:`~bcg_plugin.patches.vllm._patch.Patch`."""

    module: str
    op: str
    params: list
    reason: str
    remove_when: str
    _original: Any = dataclasses.field(default=None, init=False, repr=False)

    @property
    def target(self) -> str:
        return f"torch.ops.vllm.{self.op} (kernel {self.module}.{self.op})"

    def _pieces(self) -> tuple[Any, Any, str]:
        import torch

        try:
            mod = importlib.import_module(self.module)
            from vllm.platforms import current_platform
            from vllm.utils.torch_utils import vllm_lib
        except Exception as e:
            raise PatchTargetError(f"{self.target}: cannot import ({e!r})") from e
        fn = getattr(mod, self.op, None)
        if fn is None or not hasattr(torch.ops.vllm, self.op):
            raise PatchTargetError(f"{self.target}: op or function not found")
        if "allow_override" not in inspect.signature(vllm_lib.impl).parameters:
            raise PatchTargetError(f"{self.target}: torch.library.Library.impl has no allow_override")
        return fn, vllm_lib, current_platform.dispatch_key

    def verify(self) -> None:
        fn, _, _ = self._pieces()
        found = list(inspect.signature(fn).parameters)
        if found != list(self.params):
            raise PatchTargetError(f"{self.target}: expected parameters {self.params}, found {found}")

    @property
    def applied(self) -> bool:
        return self._original is not None

    def _register(self, fn: Any) -> None:
        _, lib, key = self._pieces()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            lib.impl(self.op, fn, dispatch_key=key, allow_override=True)

    def apply(self) -> None:
        if self._original is not None:
            return
        from bcg_plugin.adapters.vllm.attention import make_attention_break

        original, _, _ = self._pieces()
        self._register(make_attention_break(original))
        self._original = original

    def unapply(self) -> None:
        if self._original is None:
            return
        self._register(self._original)
        self._original = None


PATCH = KernelPatch(
    module=MODULE,
    op=OP,
    params=PARAMS,
    reason="run vLLM's attention function as an eager break between bcg's graph segments, reading the step's forward context",
    remove_when="vLLM's attention op is a break for external capture without VLLM_USE_BREAKABLE_CUDAGRAPH",
)
