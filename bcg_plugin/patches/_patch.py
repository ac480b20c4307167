"""One descriptor for every host patch, and the all-or-nothing set that applies them.

A :class:`Patch` holds the only copy of what bcg changes in a host: the target symbol, why, the host
versions it was written against, the upstream issue that would make it unnecessary, when it can go,
and how it is applied. ``patches/README.md`` is rendered from these descriptors and a host's supported
range is checked against them (:func:`coverage_problems`), so neither can drift from the code.

Where a host symbol differs between releases, its module holds one descriptor per range
(``PATCHES``); a set holds them all and applies, at start-up, those whose range holds the installed
release (:meth:`PatchSet.active`).

How a patch is applied is a small strategy: :class:`Wrap` (a wrapper built from the original, set in
its place) and :class:`Rebind` (a new value) here; the host-specific ones next to their host
(:class:`~bcg_plugin.patches.sglang._hook.Hook` over SGLang's ``HookRegistry``,
:class:`~bcg_plugin.patches.vllm._kernel.Kernel` for a torch op's kernel).

A patch is a leaf: it imports nothing of the adapters. Whatever it calls in the adapter reaches its
``make`` as keyword-only arguments (``make(original, *, capture_v1)``); the adapter hands them over
when it applies the set, and a missing one fails verification like a missing target.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import pkgutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from packaging.specifiers import SpecifierSet

# ``Patch.upstream`` when no issue or pull request has been filed with the host yet.
NOT_FILED = "none filed"


class PatchTargetError(RuntimeError):
    """A patch target is missing, changed, or did not take; nothing of its set stays applied."""


def resolve(target: str) -> tuple[Any, str]:
    """The owner (module or class) of a dotted ``target`` and the attribute name, importing as needed."""
    owner_path, _, name = target.rpartition(".")
    try:
        return pkgutil.resolve_name(owner_path), name
    except Exception as e:  # an import that fails is a missing target, whatever the reason
        raise PatchTargetError(f"{target}: cannot resolve {owner_path} ({type(e).__name__}: {e})") from e


def raw_attribute(target: str) -> Any:
    """The attribute ``target`` names as its owner holds it (a class's own ``__dict__`` entry)."""
    owner, name = resolve(target)
    value = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if value is None:
        raise PatchTargetError(f"{target}: attribute not found")
    return value


def check_params(target: str, fn: Any, params: Sequence[str], *, exact: bool) -> None:
    """Raise unless ``fn``'s parameters are ``params`` (``exact``) or include all of them."""
    try:
        found = list(inspect.signature(inspect.unwrap(fn)).parameters)
    except (TypeError, ValueError) as e:
        raise PatchTargetError(f"{target}: no inspectable signature ({e!r})") from e
    if exact and found != list(params):
        raise PatchTargetError(f"{target}: expected parameters {list(params)}, found {found}")
    missing = [p for p in params if p not in found]
    if missing:
        raise PatchTargetError(f"{target}: signature lacks {missing} (has {found})")


class Strategy:
    """How a patch is put in place.

    ``put(target, build)`` calls ``build(original)`` (or ``build()`` where the host supplies the
    original at call time, as hooks) and returns what ``in_place`` and ``remove`` need.
    ``removable``: whether :meth:`remove` restores the host; a strategy that cannot (a registered
    hook) relies on its bodies passing through while the adapter says bcg is off.
    """

    removable = True

    def verify(self, target: str) -> None:
        raise NotImplementedError

    def put(self, target: str, build: Callable[..., Any]) -> Any:
        raise NotImplementedError

    def in_place(self, target: str, state: Any) -> bool:
        return True

    def remove(self, target: str, state: Any) -> None:
        pass

    @staticmethod
    def settle() -> None:
        """Called once after a set's patches of this strategy are put (a registry applying them)."""

    def describe(self) -> str:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Wrap(Strategy):
    """Set a wrapper of the original function in its place (``setattr``); removing sets it back.

    Attributes:
        params: the target's parameter names, in order: the wrapper passes arguments positionally.
        uses: other host symbols the wrapper calls without patching them (dotted path -> parameter
            names), verified with the target.
    """

    params: Sequence[str]
    uses: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)

    def verify(self, target: str) -> None:
        for where, params in {target: self.params, **self.uses}.items():
            fn = raw_attribute(where)
            check_params(where, getattr(fn, "__bcg_patch__", fn), params, exact=True)

    def put(self, target: str, build: Callable[..., Any]) -> Any:
        owner, name = resolve(target)
        original = raw_attribute(target)
        replacement = build(original)
        replacement.__bcg_patch__ = original  # lets verify() and tests see through the patch
        setattr(owner, name, replacement)
        return original, replacement

    def in_place(self, target: str, state: Any) -> bool:
        return raw_attribute(target) is state[1]

    def remove(self, target: str, state: Any) -> None:
        owner, name = resolve(target)
        setattr(owner, name, state[0])

    def describe(self) -> str:
        uses = ", ".join(f"`{u.rpartition('.')[2]}`" for u in self.uses)
        return "wrapped in place" + (f" (calls, verified with it: {uses})" if uses else "")


@dataclasses.dataclass(frozen=True)
class Rebind(Strategy):
    """Set a new value in place of the target's (``make(current) -> new``); removing sets it back.

    Attributes:
        check: ``check(value) -> problem or None`` on the current value, before anything changes.
    """

    check: Callable[[Any], str | None]

    def verify(self, target: str) -> None:
        owner, name = resolve(target)
        if not hasattr(owner, name):
            raise PatchTargetError(f"{target}: attribute not found")
        problem = self.check(getattr(owner, name))
        if problem is not None:
            raise PatchTargetError(f"{target}: {problem}")

    def put(self, target: str, build: Callable[..., Any]) -> Any:
        owner, name = resolve(target)
        original = getattr(owner, name)
        new = build(original)
        setattr(owner, name, new)
        return original, new

    def in_place(self, target: str, state: Any) -> bool:
        owner, name = resolve(target)
        return getattr(owner, name, None) is state[1]

    def remove(self, target: str, state: Any) -> None:
        owner, name = resolve(target)
        setattr(owner, name, state[0])

    def describe(self) -> str:
        return "value rebound"


@dataclasses.dataclass(eq=False)
class Patch:
    """One patched host symbol: the only copy of what is changed, why, for which versions, until when.

    Attributes:
        target: dotted path of the host symbol (``module.attr`` or ``module.Class.attr``).
        how: the strategy that applies it (:class:`Wrap`, :class:`Rebind`, or a host's own).
        make: builds what is put in place: ``make(original, **calls)``, or ``make(**calls)`` for
            hooks (the host hands them the original at each call). Its keyword-only parameters
            name what the adapter hands the patch (:attr:`needs`).
        reason: why bcg needs it (Markdown; shown in ``patches/README.md``).
        hosts: the host versions it was written and verified against (a ``packaging`` specifier set).
        upstream: the host issue or pull request that would make it unnecessary, or :data:`NOT_FILED`.
        remove_when: the condition under which it can be deleted.
    """

    target: str
    how: Strategy
    make: Callable[..., Any]
    reason: str
    hosts: str
    upstream: str
    remove_when: str
    _state: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        SpecifierSet(self.hosts)  # a malformed range fails at import, not at a user's launch
        if not self.upstream:
            raise ValueError(f"{self.target}: upstream must name an issue or pull request, or be NOT_FILED")

    def applies_to(self, version: str) -> bool:
        """Whether this descriptor was written for host ``version``."""
        return SpecifierSet(self.hosts).contains(version, prereleases=True)

    @property
    def module(self) -> str:
        """The patch's own module (where ``make`` is defined)."""
        return self.make.__module__

    @property
    def needs(self) -> tuple[str, ...]:
        """What the adapter must hand ``make``: its keyword-only parameter names."""
        return tuple(p.name for p in inspect.signature(self.make).parameters.values()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY)

    @property
    def applied(self) -> bool:
        return self._state is not None

    def current(self) -> Any:
        """The target as the host holds it now (patched or not)."""
        return raw_attribute(self.target)

    def verify(self, calls: Mapping[str, Any] | None = None) -> None:
        """Raise :class:`PatchTargetError` unless the target is as the patch expects and, when
        ``calls`` is given, it holds everything :attr:`needs` names."""
        self.how.verify(self.target)
        if calls is not None:
            missing = [n for n in self.needs if n not in calls]
            if missing:
                raise PatchTargetError(f"{self.target}: the adapter hands the patch no {missing}")

    def apply(self, calls: Mapping[str, Any] | None = None) -> None:
        """Verify and apply this patch alone (see :meth:`PatchSet.apply`)."""
        PatchSet(self.target, [self]).apply(calls)

    def in_place(self) -> bool:
        return self._state is not None and self.how.in_place(self.target, self._state)

    def unapply(self) -> None:
        if self._state is not None and self.how.removable:
            self.how.remove(self.target, self._state)
            self._state = None

    def _put(self, calls: Mapping[str, Any]) -> None:
        build = functools.partial(self.make, **{n: calls[n] for n in self.needs})
        self._state = self.how.put(self.target, build)


class PatchSet:
    """Patches applied together: every target is verified first, then all are applied or none.

    Attributes:
        name: the set's name, as ``patches/README.md`` shows it.
        patches: the patches, in the order they are applied.
        when: where and when the adapter installs the set (shown in ``patches/README.md``).
    """

    def __init__(self, name: str, patches: Iterable[Patch], when: str = "",
                 select: Callable[[], str | None] | None = None):
        self.name = name
        self.patches = list(patches)
        self.when = when
        self.select = select

    def active(self, version: str | None = None) -> list[Patch]:
        """The patches whose host range holds ``version`` (default: the release ``select`` names; every
        patch where the set has no ``select``). Descriptors of one target have disjoint ranges, so a
        version gets at most one of each."""
        if version is None:
            if self.select is None:
                return list(self.patches)
            version = self.select()
            if version is None:
                return []
        return [p for p in self.patches if p.applies_to(version)]

    def problems(self, calls: Mapping[str, Any] | None = None) -> list[str]:
        return _problems(self.active(), calls)

    def verify(self, calls: Mapping[str, Any] | None = None) -> None:
        _raise(_problems(self.active(), calls))

    @property
    def applied(self) -> bool:
        active = self.active()
        return bool(active) and all(p.applied for p in active)

    def apply(self, calls: Mapping[str, Any] | None = None) -> None:
        """Verify every patch, apply each one not yet applied, then check each one took.

        On any failure the removable patches applied here are undone and :class:`PatchTargetError`
        names every problem. Re-entrant: an applied patch is not applied twice.
        """
        calls = {} if calls is None else calls
        active = self.active()
        if not active:
            raise PatchTargetError(f"{self.name}: no patch descriptor covers this host version")
        _raise(_problems(active, calls))
        done: list[Patch] = []
        try:
            for patch in active:
                if not patch.applied:
                    patch._put(calls)
                    done.append(patch)
            for settle in dict.fromkeys(type(p.how).settle for p in done):
                settle()
        except BaseException:
            for patch in reversed(done):
                patch.unapply()
            raise
        missing = [p for p in active if not p.in_place()]
        if missing:
            for patch in reversed(done):
                patch.unapply()
            raise PatchTargetError("; ".join(
                f"{p.target}: applied but not in place ({p.how.describe()}; see the host's log)" for p in missing))

    def unapply(self) -> None:
        for patch in reversed(self.patches):
            patch.unapply()


def _problems(patches: Iterable[Patch], calls: Mapping[str, Any] | None) -> list[str]:
    problems = []
    for patch in patches:
        try:
            patch.verify(calls)
        except PatchTargetError as e:
            problems.append(str(e))
    return problems


def _raise(problems: list[str]) -> None:
    if problems:
        raise PatchTargetError("; ".join(problems))


def coverage_problems(patches: Iterable[Patch], releases: Iterable[str]) -> list[str]:
    """What is wrong with the descriptor ranges over a host's ``releases``: a release two descriptors
    of one target claim, or a descriptor no release uses."""
    patches = list(patches)
    releases = list(releases)
    problems = []
    for release in releases:
        seen: dict[str, Patch] = {}
        for p in patches:
            if p.applies_to(release):
                if p.target in seen:
                    problems.append(f"{release}: {p.target} has two descriptors ({seen[p.target].hosts} and {p.hosts})")
                seen[p.target] = p
    for p in patches:
        if not any(p.applies_to(r) for r in releases):
            problems.append(f"{p.target} ({p.hosts}): no release in range uses it")
    return problems


def descriptors(*modules: Any) -> list[Patch]:
    """The descriptors of patch ``modules``: each one's ``PATCH``, or every entry of its ``PATCHES``."""
    found: list[Patch] = []
    for module in modules:
        found += list(getattr(module, "PATCHES", None) or [module.PATCH])
    return found
