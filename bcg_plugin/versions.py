"""The host version gate every adapter applies before it patches anything."""

from __future__ import annotations

import importlib.metadata
import os

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
    if not SpecifierSet(str(supported)).contains(parsed, prereleases=True):
        return f"{host} {found} is outside the range bcg-plugin supports ({format_range(supported)})"
    if parsed.is_prerelease:
        # The patch descriptors' ranges meet at releases, so a pre-release of one (0.29.0rc1: below
        # ">=0.29", above "<0.29" for pre-releases) falls between them and would get only part of
        # the patches; packaging before 26 kept pre-releases out of every range, 26 lets them in.
        return (f"{host} {found} is a pre-release: bcg-plugin patches the releases in "
                f"{format_range(supported)}, each checked against its own code; install one of those")
    return None


def host_problem(host: str, supported: SpecifierSet | str, found: str | None) -> str | None:
    """Why bcg-plugin does not patch ``host`` at version ``found``, or ``None`` when it does: the host's
    version first, then the torch it runs on (the capture relies on torch internals checked per release)."""
    from bcg_plugin.capture import torch_version_problem

    return version_problem(host, supported, found) or torch_version_problem()


# Set to 1 to let the plugin run on a host release newer than every release it was validated on,
# with the patch descriptors of the newest validated release, when every target still verifies.
UNTESTED_ENV = "BCG_ALLOW_UNTESTED_HOST"


def _opted_in() -> bool | None:
    """Whether :data:`UNTESTED_ENV` says yes, read as the configuration's booleans are; ``None`` for a
    value that is neither."""
    from bcg_plugin.config import FALSE_WORDS, TRUE_WORDS

    value = os.environ.get(UNTESTED_ENV, "").strip().lower()
    if value in TRUE_WORDS:
        return True
    return False if value in ("", *FALSE_WORDS) else None


class HostGate:
    """The releases of one host engine that bcg-plugin patches, and which descriptors a version gets.

    Attributes:
        dist: the distribution whose installed version is checked (``"vllm"``).
        supported: the declared range; every release in it has a descriptor for each target it patches.
        releases: the host's releases inside ``supported``, oldest first; the patch tests check
            descriptor coverage on each, and the untested opt-in borrows the newest one's descriptors.
    """

    def __init__(self, dist: str, supported: str, releases: tuple[str, ...]):
        self.dist = dist
        self.supported = SpecifierSet(supported)
        self.releases = tuple(releases)
        outside = [r for r in self.releases if Version(r) not in self.supported]
        if outside or list(self.releases) != sorted(self.releases, key=Version):
            raise ValueError(f"{dist}: releases {self.releases} must be sorted and inside {supported}")

    def installed(self) -> str | None:
        return installed_version(self.dist)

    def _newer(self, found: str) -> bool:
        """Whether ``found`` is a version above every release bcg-plugin was validated on."""
        try:
            v = Version(found)
        except InvalidVersion:
            return False
        return v > Version(self.releases[-1]) and not self.supported.contains(v, prereleases=True)

    def untested(self, found: str | None) -> bool:
        """Whether ``found`` is newer than every release bcg-plugin was validated on and the user opted in."""
        return found is not None and _opted_in() is True and self._newer(found)

    def problem(self, found: str | None) -> str | None:
        """Why ``found`` is not patched (see :func:`host_problem`), or ``None``."""
        if self.untested(found):
            from bcg_plugin.capture import torch_version_problem

            return torch_version_problem()
        problem = host_problem(self.dist, self.supported, found)
        if problem is not None and found is not None and self._newer(found):
            if _opted_in() is None:
                problem += (f"; {UNTESTED_ENV}={os.environ[UNTESTED_ENV]!r} is neither true nor false: set it to 1 "
                            "to try a newer release untested")
            else:
                problem += f"; set {UNTESTED_ENV}=1 to try a newer release untested"
        return problem

    def nearest(self) -> str | None:
        """The validated release closest to the installed version (itself when validated): for patches
        that must install on any release, verified against the live symbols."""
        found = self.installed()
        if found is None:
            return None
        try:
            v = Version(found)
        except InvalidVersion:
            return self.releases[-1]
        older = [r for r in self.releases if Version(r) <= v]
        return older[-1] if older else self.releases[0]

    def selected(self) -> str | None:
        """The release whose descriptors apply to the installed version: itself, or under the untested
        opt-in the newest validated release; ``None`` when neither applies (nothing is selected)."""
        found = self.installed()
        if found is None:
            return None
        if self.untested(found):
            return self.releases[-1]
        return found if version_problem(self.dist, self.supported, found) is None else None
