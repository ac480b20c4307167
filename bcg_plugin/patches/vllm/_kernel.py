"""A torch op's kernel as a patch strategy: vLLM's custom ops dispatch to the function registered at
import, so rebinding the module attribute would not reach the op; the kernel is registered again."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from bcg_plugin.patches._patch import PatchTargetError, Strategy, check_params


@dataclasses.dataclass(frozen=True)
class Kernel(Strategy):
    """Registers ``make(original)`` as the kernel of ``torch.ops.vllm.<op>`` for the platform's
    dispatch key (``allow_override=True``); the target is the Python function vLLM registered.
    Removing registers the original function again.

    Attributes:
        op: the op's name in vLLM's ``torch.ops.vllm`` library.
        params: the registered function's parameter names, in order.
    """

    op: str
    params: Sequence[str]

    def _pieces(self, target: str) -> tuple[Any, Any, str]:
        import torch

        module, _, name = target.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), name, None)
            from vllm.platforms import current_platform
            from vllm.utils.torch_utils import vllm_lib
        except Exception as e:  # an import that fails is a missing target, whatever the reason
            raise PatchTargetError(f"{target}: cannot import ({e!r})") from e
        if fn is None or not hasattr(torch.ops.vllm, self.op):
            raise PatchTargetError(f"{target}: function or op torch.ops.vllm.{self.op} not found")
        if "allow_override" not in inspect.signature(vllm_lib.impl).parameters:
            raise PatchTargetError(f"{target}: torch.library.Library.impl has no allow_override")
        return fn, vllm_lib, current_platform.dispatch_key

    def verify(self, target: str) -> None:
        fn, _, _ = self._pieces(target)
        check_params(target, fn, self.params, exact=True)

    def _register(self, target: str, fn: Callable[..., Any]) -> None:
        _, lib, key = self._pieces(target)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            lib.impl(self.op, fn, dispatch_key=key, allow_override=True)

    def put(self, target: str, build: Callable[..., Any]) -> Any:
        original, _, _ = self._pieces(target)
        self._register(target, build(original))
        return original

    def remove(self, target: str, state: Any) -> None:
        self._register(target, state)

    def describe(self) -> str:
        return f"kernel of `torch.ops.vllm.{self.op}` (platform dispatch key, `allow_override=True`)"
