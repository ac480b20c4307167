"""What bcg-plugin patches in SGLang, one module per patched SGLang symbol.

Each module exposes ``PATCH``, a :class:`~bcg_plugin.patches.sglang.base.Patch` naming its target, the
reason, the SGLang versions it was written against and when it can be removed (the same facts as
the SGLang table in ``patches/README.md``). :func:`~bcg_plugin.patches.sglang.base.install` verifies every
target of a set before registering any hook, then checks that SGLang's ``HookRegistry`` really
installed them: SGLang only logs hook failures, so an unchecked plugin could fail silently.
"""

from bcg_plugin.patches.sglang.base import InstallReport, Patch, install, verify

__all__ = ["InstallReport", "Patch", "install", "verify"]
