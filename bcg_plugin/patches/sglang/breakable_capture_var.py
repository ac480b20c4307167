"""``breakable_cuda_graph._current_capture_var``: SGLang's own graph breaks fail bcg's capture.

SGLang marks a graph break by wrapping an op with ``eager_on_graph``. The wrapper reads this context
variable at every call: under SGLang's own breakable capture it holds that capture, whose current
segment the wrapper ends before running the op eagerly; otherwise it is ``None`` and the op runs
inline. bcg turns SGLang's breakable-capture flag on while it captures, so model code takes its
breakable branches, and routes RadixAttention's unified op to bcg's own break
(:mod:`~bcg_plugin.patches.sglang.radix_attention_breakable`). Any other break (linear attention,
MLA, DeepSeek-V4, NemotronH mamba, HPC-ops fp8 rope + KV store, MoE all-to-all ...) would run inline
and be captured with the capture batch's metadata. While bcg captures, the variable holds a
stand-in capture whose segment end raises the adapter's error naming the op, before the op runs:
the capture fails, the ranks agree on it, and prefill runs eagerly.

The variable is set (its own ``set``/``reset``) only for the duration of bcg's capture: SGLang's own
capture and every forward outside bcg's capture see it as SGLang left it. Applying the patch binds
the variable; :func:`refusing_breaks` sets it. A leaf module: the adapter passes in the error.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from bcg_plugin.patches._patch import NOT_FILED, Patch, Rebind

MODULE = "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph"
TARGET = f"{MODULE}._current_capture_var"

# SGLang's variable, bound when the patch is applied; refusing_breaks sets it.
_capture_var: contextvars.ContextVar | None = None


class _RefusingCapture:
    """Stands in for SGLang's active ``BreakableCUDAGraphCapture`` while bcg captures.

    Holds the adapter's error factory. SGLang's break wrapper ends the capture's current segment
    before it runs the op, so the op is refused there, before it runs.
    """

    def __init__(self, error: Callable[[str], BaseException]) -> None:
        self._error = error

    def _end_current_segment(self) -> None:
        raise self._error(break_name(sys._getframe(1)))


def break_name(frame: FrameType) -> str:
    """The op the ``eager_on_graph`` wrapper running in ``frame`` wraps, and where it was called from.

    The wrapper is a closure over the op (``inner``); if SGLang renames it, the wrapper's own name
    and the call site still say where the break is.
    """
    code = frame.f_code
    inner = frame.f_locals.get("inner") if "inner" in code.co_freevars else None
    op_name = getattr(inner, "_qualified_op_name", None)  # SGLang's breaks mostly wrap torch custom ops
    if isinstance(op_name, str):
        name = "torch.ops." + op_name.replace("::", ".")
    elif callable(inner):
        qualname = getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None) or repr(inner)
        module = getattr(inner, "__module__", None)
        name = f"{module}.{qualname}" if module else qualname
    else:
        name = f"{frame.f_globals.get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)}"
    caller = frame.f_back
    # From 0.5.23 a decorated method is reached through SGLang's callable object, in the wrapper's own
    # file: the call site is the first frame outside it.
    while caller is not None and caller.f_code.co_filename == code.co_filename:
        caller = caller.f_back
    if caller is None:
        return name
    path = caller.f_code.co_filename
    marker = f"site-packages{os.sep}"
    path = path.rsplit(marker, 1)[1] if marker in path else path
    return f"{name} (called from {path}:{caller.f_lineno})"


@contextlib.contextmanager
def refusing_breaks(error: Callable[[str], BaseException]) -> Iterator[None]:
    """Within the block, any SGLang break raises ``error(op)`` instead of running inline."""
    if _capture_var is None:
        raise RuntimeError(f"{TARGET} is not bound: install bcg's SGLang patch set before capturing")
    token = _capture_var.set(_RefusingCapture(error))
    try:
        yield
    finally:
        _capture_var.reset(token)


class _Refused(Exception):
    pass


def _probe(decorate: Callable[[Callable[[], None]], Callable[[], None]], form: str):
    """A check that the installed SGLang's break wrapper, made by ``decorate`` (``form`` names the
    call), still consults the variable and ends the capture's segment before it runs the op: probed
    with an op of our own, the variable restored after."""

    def check(value: Any) -> str | None:
        if not isinstance(value, contextvars.ContextVar):
            return f"{TARGET}: expected a ContextVar, found {type(value).__name__}"
        if not callable(getattr(importlib.import_module(MODULE), "eager_on_graph", None)):
            return f"{MODULE}.eager_on_graph: not found"
        ran: list[bool] = []

        def probe_op() -> None:
            ran.append(True)

        try:
            wrapped = decorate(probe_op)
        except Exception as e:
            return f"{MODULE}.{form} no longer decorates a function ({e!r})"
        refused = False
        token = value.set(_RefusingCapture(_Refused))
        try:
            wrapped()
        except _Refused:
            refused = True
        except Exception as e:
            return f"{MODULE}.eager_on_graph: its wrapper failed under a stand-in capture ({e!r})"
        finally:
            value.reset(token)
        if ran or not refused:
            return (f"{MODULE}.eager_on_graph: its wrapper no longer ends the capture's segment (read from "
                    f"{TARGET}) before it runs the op; bcg could not refuse the breaks it does not route")
        return None

    return check


def _eager_on_graph() -> Callable[..., Any]:
    return importlib.import_module(MODULE).eager_on_graph


# Through 0.5.21 the decorator takes the switch first (``eager_on_graph(True)(op)``); from 0.5.22 it
# decorates directly (``eager_on_graph(op)``, the switch keyword-only), as SGLang's own breaks do.
_check_switch_first = _probe(lambda op: _eager_on_graph()(True)(op), "eager_on_graph(True)")
_check_bare = _probe(lambda op: _eager_on_graph()(op), "eager_on_graph(fn)")


def make(var: contextvars.ContextVar) -> contextvars.ContextVar:
    """Binds SGLang's variable for :func:`refusing_breaks`; the host keeps the same object."""
    global _capture_var
    _capture_var = var
    return var


_REASON = ("while bcg captures, fail the capture naming the op at any SGLang graph break bcg does not "
           "route (it would run inline, its capture batch's metadata baked into the graph)")
_REMOVE_WHEN = "SGLang's breaks dispatch through a pluggable break primitive bcg can own"

PATCHES = (
    Patch(
        target=TARGET,
        how=Rebind(check=_check_switch_first),
        make=make,
        reason=_REASON,
        hosts=">=0.5.17,<0.5.22",
        upstream=NOT_FILED,
        remove_when=_REMOVE_WHEN,
    ),
    Patch(
        target=TARGET,
        how=Rebind(check=_check_bare),
        make=make,
        reason=_REASON + "; from 0.5.22 the break decorator is `eager_on_graph(fn=None, capture_stub=None, *, "
               "enable=None)` and is probed in that form",
        hosts=">=0.5.22,<0.5.24",
        upstream=NOT_FILED,
        remove_when=_REMOVE_WHEN,
    ),
)
