"""SGLang's own patching mechanism as a patch strategy: hooks registered with its ``HookRegistry``."""

from __future__ import annotations

import dataclasses
import pkgutil
from collections.abc import Callable
from typing import Any

from bcg_plugin.patches._patch import PatchTargetError, Strategy, check_params

HOOK_KINDS = ("AROUND", "BEFORE", "AFTER")
_CHAIN_LIMIT = 64  # hooks on one target; a longer __wrapped__ chain is a cycle, not a chain


def resolve_value(target: str) -> Any:
    """The callable ``target`` names, as ``HookRegistry`` wraps it (classmethod/staticmethod unwrapped)."""
    owner_path, _, attr = target.rpartition(".")
    try:
        owner = pkgutil.resolve_name(owner_path)
        value = getattr(owner, attr)
    except Exception as e:  # an import that fails is a missing target, whatever the reason
        raise PatchTargetError(f"{target}: not found ({type(e).__name__}: {e})") from e
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else value


def _chain_has(fn: Any, hook: Callable[..., Any]) -> bool:
    # HookRegistry wrappers keep the hook in their closure and the wrapped callable in __wrapped__.
    for _ in range(_CHAIN_LIMIT):
        if fn is None:
            return False
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False


def refusing_hook(capturing: Callable[[], bool], refuse: Callable[[str], Any], what: str) -> Callable[..., Any]:
    """An AROUND hook that fails bcg's capture (``refuse(what)``) while ``capturing()``, and otherwise
    passes the call through: for host ops bcg's break cannot route, which must not be baked into a graph."""

    def around_refused_op(original_fn, *args, **kwargs):
        if capturing():
            refuse(what)
        return original_fn(*args, **kwargs)

    return around_refused_op


@dataclasses.dataclass(frozen=True)
class Hook(Strategy):
    """A hook registered with SGLang's ``HookRegistry`` (``make(**calls)`` returns the hook).

    SGLang applies registered hooks itself and only logs a failure; :meth:`in_place` finds the hook
    in the target's wrapper chain, so a hook that did not take fails the set instead of passing
    silently. A hook cannot be unregistered: its body passes through while the adapter says bcg is off.

    Attributes:
        kind: ``"AROUND"``, ``"BEFORE"`` or ``"AFTER"`` (``HookType``).
        params: parameter names the target must have (the hook passes ``*args, **kwargs`` through).
        check: ``check(value) -> problem or None`` in place of ``params``, for targets whose own
            signature tells nothing (``(*args, **kwargs)`` wrappers).
    """

    kind: str
    params: tuple[str, ...] = ()
    check: Callable[[Any], str | None] | None = None
    removable = False

    def __post_init__(self) -> None:
        if self.kind not in HOOK_KINDS:
            raise ValueError(f"hook kind must be one of {HOOK_KINDS}, got {self.kind!r}")

    def verify(self, target: str) -> None:
        value = resolve_value(target)
        if self.check is not None:
            problem = self.check(value)
            if problem is not None:
                raise PatchTargetError(f"{target}: {problem}")
            return
        if not callable(value):
            raise PatchTargetError(f"{target}: expected a callable, found {type(value).__name__}")
        check_params(target, value, self.params, exact=False)

    def put(self, target: str, build: Callable[..., Any]) -> Any:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        hook = build()
        HookRegistry.register(target, hook, HookType[self.kind])
        return hook

    @staticmethod
    def settle() -> None:
        # load_plugins() applies hooks only after every plugin ran and merely logs failures; apply
        # now (once per set: hooks of one target must all be registered before it is wrapped) so
        # the set can check its hooks took before the engine relies on them.
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()

    def in_place(self, target: str, state: Any) -> bool:
        try:
            return _chain_has(resolve_value(target), state)
        except PatchTargetError:
            return False

    def describe(self) -> str:
        return f"{self.kind} hook (SGLang's `HookRegistry`)"
