"""The host version gate every adapter applies before it patches anything."""

from __future__ import annotations

import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or ``None`` if it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def format_range(supported: SpecifierSet | str) -> str:
    """``supported`` with its lower bounds first (``>=0.5.17,<0.5.18``), as people write ranges."""
    spec = SpecifierSet(str(supported))

    def order(s):
        try:
            return (Version(s.version.rstrip(".*")), s.operator.startswith("<"))
        except InvalidVersion:
            return (Version("0"), False)

    return ",".join(str(s) for s in sorted(spec, key=order))


def version_problem(host: str, supported: SpecifierSet | str, found: str | None) -> str | None:
    """Why ``host`` at version ``found`` (``None``: not installed) is not patched, or ``None`` when
    ``supported`` contains it."""
    if found is None:
        return f"{host} is not installed"
    try:
        parsed = Version(found)
    except InvalidVersion:
        return f"{host} version {found!r} is not a valid version"
    if parsed not in SpecifierSet(str(supported)):
        return f"{host} {found} is outside the range bcg-plugin supports ({format_range(supported)})"
    return None


def host_problem(host: str, supported: SpecifierSet | str, found: str | None) -> str | None:
    """Why bcg-plugin does not patch ``host`` at version ``found``, or ``None`` when it does: the host's
    version first, then the torch it runs on (the capture relies on torch internals checked per release)."""
    from bcg_plugin.capture import torch_version_problem

    return version_problem(host, supported, found) or torch_version_problem()
