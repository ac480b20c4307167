"""bcg-plugin for vLLM: breakable CUDA graphs for prefill and mixed batches.

Installed next to vLLM, it is discovered through the ``vllm.general_plugins`` entry point
(:func:`register`) and stays off until an engine is started with
``--additional-config '{"bcg": {"enable": true}}'`` (or ``LLM(additional_config={"bcg": {...}})``).
"""

from bcg_plugin.adapters.vllm.doctor import diagnose
from bcg_plugin.adapters.vllm.plugin import register

__all__ = ["diagnose", "register"]
