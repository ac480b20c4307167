"""``bcg doctor`` for vLLM: the version and every patch target, checked without patching anything."""

from __future__ import annotations

from bcg_plugin.doctor import AdapterReport


def diagnose() -> AdapterReport:
    from packaging.version import InvalidVersion, Version

    from bcg_adapters.vllm.plugin import vllm_version
    from bcg_patches.vllm import ALL, SUPPORTED_VLLM, PatchTargetError

    report = AdapterReport("vllm", vllm_version(), str(SUPPORTED_VLLM),
                           enable_hint="--additional-config '{\"bcg\": {\"enable\": true}}'")
    if not report.installed:
        return report
    try:
        if Version(report.version) not in SUPPORTED_VLLM:
            report.problems.append(f"vLLM {report.version} is outside {SUPPORTED_VLLM}")
    except InvalidVersion:
        report.problems.append(f"vLLM version {report.version!r} is not a valid version")
    for patch in ALL:
        try:
            patch.verify()
            report.targets.append((patch.target, None))
        except PatchTargetError as e:
            report.targets.append((patch.target, str(e)))
            report.problems.append(f"patch target changed: {e}")
    return report
