"""Patch descriptors and the all-or-nothing installer over SGLang's ``HookRegistry``."""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Patch:
    """One patched SGLang symbol.

    Attributes:
        target: dotted path of the symbol (``module.attr`` or ``module.Class.attr``).
        kind: ``"AROUND"``/``"BEFORE"``/``"AFTER"`` (a ``HookRegistry`` hook) or ``"VALUE"``
            (a plain attribute rebind that ``HookRegistry`` cannot express, done by ``apply``).
        hook: the hook callable (hook kinds) or ``None``.
        params: parameter names the target's signature must have, checked before anything is
            patched, so an SGLang refactor turns into one clear warning instead of a broken hook.
        reason: why bcg needs it.
        versions: the SGLang versions it was written and checked against.
        remove_when: the condition under which the patch can be deleted.
        check: extra verification for ``VALUE`` patches (returns an error message or ``None``).
        apply: performs a ``VALUE`` patch; returns a predicate telling whether it is in place.
    """

    target: str
    kind: str
    reason: str
    versions: str
    remove_when: str
    hook: Callable[..., Any] | None = None
    params: tuple[str, ...] = ()
    check: Callable[[Any], str | None] | None = None
    apply: Callable[[], Callable[[], bool]] | None = None


@dataclasses.dataclass
class InstallReport:
    """Outcome of :func:`install`: ``ok`` only if every patch of the set is in place."""

    ok: bool
    problems: list[str] = dataclasses.field(default_factory=list)
    installed: list[str] = dataclasses.field(default_factory=list)


def _resolve(target: str) -> tuple[Any, str, Any]:
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    value = getattr(owner, attr)
    if isinstance(raw, (classmethod, staticmethod)):
        value = raw.__func__
    return owner, attr, value


def verify(patch: Patch) -> str | None:
    """Why ``patch`` cannot be applied to the installed SGLang, or ``None`` if it can."""
    try:
        _, _, value = _resolve(patch.target)
    except (ImportError, AttributeError, ValueError) as e:
        return f"{patch.target}: not found ({type(e).__name__}: {e})"
    if patch.check is not None:
        return patch.check(value)
    if not callable(value):
        return f"{patch.target}: expected a callable, found {type(value).__name__}"
    if patch.params:
        try:
            names = set(inspect.signature(inspect.unwrap(value)).parameters)
        except (TypeError, ValueError) as e:
            return f"{patch.target}: signature unreadable ({e})"
        missing = [p for p in patch.params if p not in names]
        if missing:
            return f"{patch.target}: signature lacks {missing} (has {sorted(names)})"
    return None


def _chain_has(fn: Any, hook: Callable[..., Any]) -> bool:
    # HookRegistry wrappers keep the hook in their closure and the wrapped callable in __wrapped__.
    seen = 0
    while fn is not None and seen < 64:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:
                continue
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def is_installed(patch: Patch) -> bool:
    try:
        _, _, value = _resolve(patch.target)
    except (ImportError, AttributeError, ValueError):
        return False
    return _chain_has(value, patch.hook)


def install(patches: Sequence[Patch]) -> InstallReport:
    """Verify every patch, then register and apply them all, then check each one took.

    Nothing is registered if any target fails verification. Hook bodies must pass through to
    the original unless the plugin is active, so a set that verified but did not fully take
    is switched off by the caller without unpatching.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    problems = [msg for msg in (verify(p) for p in patches) if msg]
    if problems:
        return InstallReport(ok=False, problems=problems)
    value_checks: dict[str, Callable[[], bool]] = {}
    for p in patches:
        if p.kind == "VALUE":
            value_checks[p.target] = p.apply()
        else:
            HookRegistry.register(p.target, p.hook, HookType[p.kind])
    # load_plugins() applies hooks only after every plugin ran and merely logs failures; apply
    # now (idempotent per target) so installation can be checked before the engine relies on it.
    HookRegistry.apply_hooks()
    report = InstallReport(ok=True)
    for p in patches:
        took = value_checks[p.target]() if p.kind == "VALUE" else is_installed(p)
        (report.installed if took else report.problems).append(
            p.target if took else f"{p.target}: hook registered but not installed (see SGLang's log)"
        )
    report.ok = not report.problems
    return report
