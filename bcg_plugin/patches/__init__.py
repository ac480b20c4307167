"""What bcg-plugin patches in each host engine version, one module per patched host symbol.

Every module under ``patches/<host>/`` exposes ``PATCH``, a :class:`Patch` (or ``PATCHES``, one per host range where the symbol
differs between releases): the one place that says
what is patched, why, for which host versions, which upstream change would remove it, and how it is
applied. ``patches/README.md`` is rendered from them (:func:`readme`; ``python -m bcg_plugin.patches
--write``). Patches are leaves: they import nothing of the adapters, which hand them what they call.
"""

from bcg_plugin.patches._patch import (
    NOT_FILED,
    Patch,
    PatchSet,
    PatchTargetError,
    Rebind,
    Strategy,
    Wrap,
    coverage_problems,
    descriptors,
)
from bcg_plugin.patches._table import HOST_PACKAGES, README_PATH, readme

__all__ = [
    "HOST_PACKAGES", "NOT_FILED", "Patch", "PatchSet", "PatchTargetError", "README_PATH", "Rebind", "Strategy",
    "Wrap", "coverage_problems", "descriptors", "readme",
]
