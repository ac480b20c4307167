"""Parameter names of SGLang's attention ops, readable whether they are torch ops or functions."""

from __future__ import annotations

import importlib
import inspect
from typing import Any


def op_params(op: Any) -> set[str]:
    schema = getattr(getattr(op, "default", None), "_schema", None)
    if schema is not None:
        return {a.name for a in schema.arguments}
    return set(inspect.signature(inspect.unwrap(op)).parameters)


def check_op(target: str, inner_name: str, required: tuple[str, ...]):
    """A :class:`~bcg_plugin.patches.sglang._hook.Hook` check for a breakable wrapper whose
    signature is ``(*args, **kwargs)``.

    The wrapper itself tells nothing; the op it wraps (``inner_name`` in the same module) fixes
    the call convention RadixAttention uses, which is what bcg's break must accept.
    """

    def check(value: Any) -> str | None:
        if not callable(value):
            return f"expected a callable, found {type(value).__name__}"
        module = importlib.import_module(target.rsplit(".", 1)[0])
        inner = getattr(module, inner_name, None)
        if inner is None:
            return f"the wrapped op {inner_name} is gone"
        try:
            names = op_params(inner)
        except (TypeError, ValueError) as e:
            return f"signature of {inner_name} unreadable ({e})"
        missing = [p for p in required if p not in names]
        if missing:
            return f"{inner_name} lacks parameters {missing}"
        return None

    return check
