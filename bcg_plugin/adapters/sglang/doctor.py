"""``bcg doctor`` for SGLang: the version and every patch target, checked without patching anything."""

from __future__ import annotations

from bcg_plugin.doctor import AdapterReport


def diagnose() -> AdapterReport:
    from bcg_plugin.adapters.sglang import _patch_set, sglang_version, version_problem
    from bcg_plugin.adapters.sglang import config as settings
    from bcg_plugin.patches.sglang import verify

    report = AdapterReport("sglang", sglang_version(), str(settings.SUPPORTED_SGLANG),
                           enable_hint=f"--cuda-graph-backend-prefill {settings.FLAG_VALUE} (or BCG_ENABLE=1)")
    if not report.installed:
        return report
    problem = version_problem(report.version)
    if problem is not None:
        report.problems.append(problem)
    for patch in _patch_set(runtime=True):
        message = verify(patch)
        report.targets.append((patch.target, message))
        if message is not None:
            report.problems.append(f"patch target changed: {message}")
    return report
