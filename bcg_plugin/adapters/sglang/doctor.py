"""``bcg doctor`` for SGLang: the version and every patch target, checked without patching anything."""

from __future__ import annotations

from bcg_plugin.doctor import AdapterReport


def diagnose() -> AdapterReport:
    from bcg_plugin.adapters.sglang import config, version
    from bcg_plugin.adapters.sglang.plugin import _patch_set, calls
    from bcg_plugin.patches import PatchTargetError

    report = AdapterReport("sglang", version.installed(), version.supported(),
                           enable_hint=f"--cuda-graph-backend-prefill {config.FLAG_VALUE} (or BCG_ENABLE=1)")
    if not report.installed:
        return report
    problem = version.problem()
    if problem is not None:
        report.problems.append(problem)
    handed = calls()
    for patch in _patch_set(runtime=True):
        try:
            patch.verify(handed)
            report.targets.append((patch.target, None))
        except PatchTargetError as e:
            report.targets.append((patch.target, str(e)))
            report.problems.append(f"patch target changed: {e}")
    return report
