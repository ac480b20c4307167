"""The mechanism behind every vLLM patch: verify a target, swap it in, swap it back.

A :class:`Patch` names one vLLM symbol, the parameters it must have on the host version we know,
and a factory that builds the replacement from the original. A :class:`PatchSet` verifies every
target before touching any of them and applies all or nothing, so an unknown or changed vLLM is
never left half patched.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class PatchTargetError(RuntimeError):
    """A patch target is missing or no longer has the signature the patch was written against."""


@dataclasses.dataclass
class Patch:
    """One patched vLLM attribute.

    Attributes:
        module: dotted module holding the owner (``vllm.config.vllm``).
        qualname: ``Owner.attr`` or a module-level ``attr``.
        params: the target's parameter names, in order, on the known host version.
        make: ``make(original) -> replacement``.
        reason: why the patch exists (shown in patches/README.md and in errors).
        remove_when: the condition under which the patch can be deleted.
        uses: other symbols of ``module`` the replacement calls but does not patch
            (qualname -> parameter names), verified with the target.
    """

    module: str
    qualname: str
    params: Sequence[str]
    make: Callable[[Callable[..., Any]], Callable[..., Any]]
    reason: str
    remove_when: str
    uses: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    _saved: tuple[Any, str, Any] | None = dataclasses.field(default=None, init=False, repr=False)

    @property
    def target(self) -> str:
        return f"{self.module}.{self.qualname}"

    def _owner_and_name(self, qualname: str | None = None) -> tuple[Any, str]:
        qualname = qualname or self.qualname
        where = f"{self.module}.{qualname}"
        try:
            owner: Any = importlib.import_module(self.module)
        except Exception as e:  # an import that fails is a missing target, whatever the reason
            raise PatchTargetError(f"{where}: cannot import {self.module} ({e!r})") from e
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part, None)
            if owner is None:
                raise PatchTargetError(f"{where}: {part} not found")
        return owner, name

    def original(self, qualname: str | None = None) -> Callable[..., Any]:
        qualname = qualname or self.qualname
        owner, name = self._owner_and_name(qualname)
        # The raw class attribute, so staticmethod/classmethod wrappers would be seen for what they are.
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if fn is None:
            raise PatchTargetError(f"{self.module}.{qualname}: attribute not found")
        return fn

    def verify(self) -> None:
        """Raise :class:`PatchTargetError` unless the target and every symbol in ``uses`` exist with
        exactly the parameters named."""
        for qualname, params in {self.qualname: self.params, **self.uses}.items():
            where = f"{self.module}.{qualname}"
            fn = self.original(qualname)
            if getattr(fn, "__bcg_patch__", None) is not None:
                fn = fn.__bcg_patch__
            try:
                found = list(inspect.signature(fn).parameters)
            except (TypeError, ValueError) as e:
                raise PatchTargetError(f"{where}: no inspectable signature ({e!r})") from e
            if found != list(params):
                raise PatchTargetError(f"{where}: expected parameters {list(params)}, found {found}")

    @property
    def applied(self) -> bool:
        return self._saved is not None

    def apply(self) -> None:
        if self._saved is not None:
            return
        owner, name = self._owner_and_name()
        original = self.original()
        replacement = self.make(original)
        replacement.__bcg_patch__ = original  # lets verify() and tests see through the patch
        self._saved = (owner, name, original)
        setattr(owner, name, replacement)

    def unapply(self) -> None:
        if self._saved is None:
            return
        owner, name, original = self._saved
        setattr(owner, name, original)
        self._saved = None


class PatchSet:
    """Patches applied together: every target is verified first, then all are applied or none."""

    def __init__(self, name: str, patches: Sequence[Any]):
        self.name = name
        self.patches = list(patches)

    def verify(self) -> None:
        problems = []
        for patch in self.patches:
            try:
                patch.verify()
            except PatchTargetError as e:
                problems.append(str(e))
        if problems:
            raise PatchTargetError("; ".join(problems))

    @property
    def applied(self) -> bool:
        return all(p.applied for p in self.patches)

    def apply(self) -> None:
        """Verify every target, then apply every patch; on any failure undo what was applied."""
        self.verify()
        done = []
        try:
            for patch in self.patches:
                patch.apply()
                done.append(patch)
        except BaseException:
            for patch in reversed(done):
                patch.unapply()
            raise

    def unapply(self) -> None:
        for patch in reversed(self.patches):
            patch.unapply()
