"""``bcg doctor`` for vLLM: the version and every patch target, checked without patching anything."""

from __future__ import annotations

import json
import os

from bcg_plugin.adapters.vllm.config import VLLM_DEFAULTS
from bcg_plugin.adapters.vllm.metrics import METRICS_ENV, METRICS_NOTE
from bcg_plugin.doctor import AdapterReport


def diagnose() -> AdapterReport:
    from bcg_plugin.adapters.vllm import version
    from bcg_plugin.adapters.vllm.plugin import calls
    from bcg_plugin.patches import PatchTargetError
    from bcg_plugin.patches.vllm import ALL

    report = AdapterReport("vllm", version.installed(), version.supported(),
                           enable_hint="--additional-config '{\"bcg\": {\"enable\": true}}'")
    if not report.installed:
        return report
    problem = version.problem()
    if problem is not None:
        report.problems.append(problem)
    report.notes.append(f"vLLM's defaults under the keys you set: {json.dumps(VLLM_DEFAULTS)} (torch_compile keeps "
                        "the compilation vLLM is configured with; -O0 or \"torch_compile\": false captures the "
                        "plain model)")
    if METRICS_ENV not in os.environ:
        report.notes.append(METRICS_NOTE)
    for patch in ALL:
        try:
            patch.verify(calls())
            report.targets.append((patch.target, None))
        except PatchTargetError as e:
            report.targets.append((patch.target, str(e)))
            report.problems.append(f"patch target changed: {e}")
    return report
