"""``bcg doctor``: what is installed, whether each adapter can patch its host, what the plugin would do.

Adapters are found through the same entry points the hosts load plugins from (``bcg`` in
``vllm.general_plugins`` and ``sglang.srt.plugins``), so a broken installation shows here exactly
as the engine would see it. Each adapter module provides ``diagnose() -> AdapterReport``. Works
without a GPU; exits non-zero when something is incompatible.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import sys
from typing import Any

from bcg_plugin.config import BcgConfig
from bcg_plugin.errors import BcgConfigError

HOST_ENTRY_POINTS = {"vllm": "vllm.general_plugins", "sglang": "sglang.srt.plugins"}


@dataclasses.dataclass
class AdapterReport:
    """One host engine as its adapter sees it.

    Attributes:
        engine: host package name.
        version: installed version, or ``None`` when the host is not installed.
        supported: the version range the adapter's patches were verified against.
        targets: ``(patch target, problem or None)`` for every host symbol the adapter patches.
        problems: why the adapter would stay off (version, missing or changed targets).
        enable_hint: how a user switches bcg on for this host.
        notes: advice that does not stop the plugin (e.g. what telemetry needs).
    """

    engine: str
    version: str | None
    supported: str
    targets: list[tuple[str, str | None]] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    enable_hint: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def installed(self) -> bool:
        return self.version is not None

    @property
    def compatible(self) -> bool:
        return self.installed and not self.problems


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or ``None`` if it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def adapter_report(engine: str) -> AdapterReport:
    """Load the ``bcg`` entry point of ``engine``'s plugin group and ask its module to diagnose."""
    group = HOST_ENTRY_POINTS[engine]
    eps = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == "bcg"]
    if not eps:
        return AdapterReport(engine, installed_version(engine), "?", problems=[
            f"no 'bcg' entry point in {group}: bcg-plugin is not installed in this environment"])
    module = importlib.import_module(eps[0].module)
    return module.diagnose()


def gpu_report() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
                            "breakable-cuda-graphs": installed_version("breakable-cuda-graphs"),
                            "cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


def run(config_json: str | None, engines: list[str], out=sys.stdout) -> int:
    ok = True

    def say(line: str = "") -> None:
        print(line, file=out)

    gpu = gpu_report()
    say(f"torch {gpu['torch']} (CUDA build {gpu['cuda_build']}), breakable-cuda-graphs {gpu['breakable-cuda-graphs']}")
    say(f"GPU: {gpu.get('gpu', 'none visible')}" + (f" (sm {gpu['capability']})" if "capability" in gpu else ""))

    try:
        if config_json is not None:
            config = BcgConfig.from_json(config_json, source="--config")
        else:
            config = BcgConfig.from_env(None) or BcgConfig()
        source = "--config" if config_json is not None else "BCG_* environment"
        say(f"configuration ({source}): {json.dumps(config.to_dict())}")
    except BcgConfigError as e:
        say(f"configuration: INVALID: {e}")
        config, ok = None, False

    any_host = False
    for engine in engines:
        report = adapter_report(engine)
        say()
        if not report.installed:
            say(f"{engine}: not installed")
            continue
        any_host = True
        state = "compatible" if report.compatible else "INCOMPATIBLE"
        say(f"{engine} {report.version}: {state} (adapter verified against {report.supported})")
        for target, problem in report.targets:
            say(f"  {'ok  ' if problem is None else 'FAIL'} {target}" + ("" if problem is None else f": {problem}"))
        for problem in report.problems:
            say(f"  problem: {problem}")
        for note in report.notes:
            say(f"  note: {note}")
        if not report.compatible:
            ok = False
            say(f"  -> the plugin stays off in {engine}; the engine runs unpatched")
        elif config is None:
            say(f"  -> the engine refuses to start until the configuration is fixed")
        elif not config.active:
            say(f"  -> the plugin is installed but off; enable it with {report.enable_hint}")
        else:
            top = (f"{config.max_tokens} tokens" if config.max_tokens is not None
                   else "the engine's chunk size (or the most tokens one step can hold, if less)")
            say(f"  -> prefill/extend forwards up to {top} replay bcg graphs")
    if not any_host:
        say()
        say("no supported host engine (vLLM, SGLang) is installed: the plugin has nothing to do")
        ok = False
    return 0 if ok else 1
