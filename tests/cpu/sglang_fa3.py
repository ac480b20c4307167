"""SGLang's fa3 attention backend class on a machine without CUDA, for the tests that plan with it.

Its module imports sgl_kernel's CUDA kernels by name, and sgl_kernel cannot load without a CUDA
driver, so CI leaves it out (ci/hosts/). The first import stops there, after every SGLang module it
needs has been imported for real; the second finds a stand-in for sgl_kernel, removed again at once,
so no other module sees it. The tests run SGLang's Python and torch; no sgl_kernel kernel is called.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types

MODULE = "sglang.srt.layers.attention.flashattention_backend"


class _KernelStandIn(types.ModuleType):
    """sgl_kernel as SGLang's fa3 module imports it: every name a function that refuses to run."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"sgl_kernel.{name}: a CUDA kernel, not run on CPU")

        return kernel


@functools.cache
def backend_class() -> type:
    """SGLang's ``FlashAttentionBackend``."""
    try:
        return importlib.import_module(MODULE).FlashAttentionBackend
    except ImportError as e:
        if "sgl_kernel" not in str(e):
            raise
    stand_ins = {name: _KernelStandIn(name) for name in ("sgl_kernel", "sgl_kernel.flash_attn")}
    stand_ins["sgl_kernel"].__path__ = []
    stand_ins["sgl_kernel"].flash_attn = stand_ins["sgl_kernel.flash_attn"]
    sys.modules.update(stand_ins)
    try:
        return importlib.import_module(MODULE).FlashAttentionBackend
    finally:
        for name in stand_ins:
            sys.modules.pop(name, None)
