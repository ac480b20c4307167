"""``bcg doctor``: what is installed, whether each adapter can patch its host, what the plugin would do.

Adapters are found through the same entry points the hosts load plugins from (``bcg`` in
``vllm.general_plugins`` and ``sglang.srt.plugins``), so a broken installation shows here exactly
as the engine would see it. Each adapter module provides ``diagnose() -> AdapterReport``, whose
``check_config`` runs the validation that adapter runs at engine start on what doctor was given
(``--config`` JSON and the ``BCG_*`` environment), reading only what that engine reads and naming
every key it ignores. Works without a GPU; exits non-zero when something is incompatible or a
configuration would fail an engine's start.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from bcg_plugin.config import ENV_PREFIX, BcgConfig
from bcg_plugin.versions import UNTESTED_ENV, installed_version

HOST_ENTRY_POINTS = {"vllm": "vllm.general_plugins", "sglang": "sglang.srt.plugins"}


@dataclasses.dataclass
class ConfigCheck:
    """What one engine makes, at its start, of the configuration doctor was given.

    Attributes:
        source: where that engine reads bcg's configuration from.
        config: the validated configuration, or ``None`` when the engine would refuse to start.
        error: the engine's own error message when it would refuse.
        ignored: every key given to doctor that the engine does not read, each with what it reads instead.
    """

    source: str
    config: BcgConfig | None = None
    error: str | None = None
    ignored: list[str] = dataclasses.field(default_factory=list)


def unknown_env_key(name: str, known: set[str]) -> str:
    """``name`` as an ignored key, with the known name it is likely a misspelling of."""
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f"{name} (no such variable is read" + (f"; did you mean {close[0]}?)" if close else ")")


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
        check_config: ``check_config(raw, environ) -> ConfigCheck``: the adapter's engine-start
            validation of ``raw`` (the parsed ``--config`` JSON, ``None`` if not given) and ``environ``.
        replay_scope: what the adapter replays when the configuration enables bcg (eligibility the
            configuration alone cannot settle), said after the top bucket.
        attention_scope: ``attention_scope(config) -> str``: where each bucket's attention runs under
            ``config`` (the choice a capture then logs bucket by bucket), or ``None`` if the adapter
            always breaks.
        untested: the host release is newer than every validated one and the user opted in to run
            it untested (``BCG_ALLOW_UNTESTED_HOST``).
    """

    engine: str
    version: str | None
    supported: str
    targets: list[tuple[str, str | None]] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    enable_hint: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    check_config: Callable[[Any, Mapping[str, str]], ConfigCheck] | None = None
    replay_scope: str = ""
    attention_scope: Callable[[BcgConfig], str] | None = None
    untested: bool = False

    @property
    def installed(self) -> bool:
        return self.version is not None

    @property
    def compatible(self) -> bool:
        return self.installed and not self.problems

    def verify_targets(self, patches: Iterable[Any], calls: Mapping[str, Any]) -> None:
        """Check every patch's host target without patching it, recording each target and, for one that
        changed, a problem; ``calls`` is what the patches call in the adapter."""
        from bcg_plugin.patches import PatchTargetError

        for patch in patches:
            try:
                patch.verify(calls)
                self.targets.append((patch.target, None))
            except PatchTargetError as e:
                self.targets.append((patch.target, str(e)))
                self.problems.append(f"patch target changed: {e}")


def adapter_report(engine: str) -> AdapterReport:
    """Load the ``bcg`` entry point of ``engine``'s plugin group and ask its module to diagnose."""
    group = HOST_ENTRY_POINTS[engine]
    eps = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == "bcg"]
    if not eps:
        return AdapterReport(engine, installed_version(engine), "?", problems=[
            f"no 'bcg' entry point in {group}: bcg-plugin is not installed in this environment"])
    version = installed_version(engine)
    try:  # a host that does not import starts no engine: say so, not which targets it seems to lack
        importlib.import_module(engine)
    except Exception as e:
        return AdapterReport(engine, version, "?", problems=[
            f"{engine} {version} fails to import ({type(e).__name__}: {e}): until it imports, neither its engine "
            f"nor the plugin runs; repair or reinstall {engine}"])
    try:
        return importlib.import_module(eps[0].module).diagnose()
    except Exception as e:  # one host's broken install must not hide the other host's report
        return AdapterReport(engine, version, "?", problems=[
            f"the check of {engine} {version} stopped at {type(e).__name__}: {e} (a module of {engine} that bcg "
            f"reads did not load, or a fault in bcg-plugin's check: if {engine} itself starts, report this)"])


def gpu_report() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
                            "breakable-cuda-graphs": installed_version("breakable-cuda-graphs"),
                            "cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


_INVALID = object()  # --config that is not JSON: no engine gets to read it


def run(config_json: str | None, engines: list[str], out=sys.stdout, environ: Mapping[str, str] | None = None) -> int:
    ok = True
    env = os.environ if environ is None else environ

    def say(line: str = "") -> None:
        print(line, file=out)

    gpu = gpu_report()
    say(f"torch {gpu['torch']} (CUDA build {gpu['cuda_build']}), breakable-cuda-graphs {gpu['breakable-cuda-graphs']}")
    say(f"GPU: {gpu.get('gpu', 'none visible')}" + (f" (sm {gpu['capability']})" if "capability" in gpu else ""))

    raw: Any = None
    if config_json is not None:
        try:
            raw = json.loads(config_json)
        except json.JSONDecodeError as e:
            say(f"configuration (--config): INVALID: not valid JSON ({e.msg} at column {e.colno}): {config_json!r}")
            raw, ok = _INVALID, False

    any_host = False
    for engine in engines:
        report = adapter_report(engine)
        say()
        if not report.installed:
            say(f"{engine}: not installed")
            continue
        any_host = True
        state = "compatible" if report.compatible else "INCOMPATIBLE"
        if report.compatible and report.untested:
            state = f"compatible, UNTESTED ({UNTESTED_ENV} is set: newer than every release bcg-plugin was validated on)"
        say(f"{engine} {report.version}: {state} (adapter verified against {report.supported})")
        for target, problem in report.targets:
            say(f"  {'ok  ' if problem is None else 'FAIL'} {target}" + ("" if problem is None else f": {problem}"))
        for problem in report.problems:
            say(f"  problem: {problem}")
        for note in report.notes:
            say(f"  note: {note}")
        check = None
        if raw is not _INVALID and report.check_config is not None:
            check = report.check_config(raw, env)
            if check.config is not None:
                say(f"  configuration ({check.source}): {json.dumps(check.config.to_dict())}")
            else:
                say(f"  configuration ({check.source}): INVALID: {check.error}")
            for key in check.ignored:
                say(f"  ignored: {key}")
        config = check.config if check is not None else None
        if not report.compatible:
            ok = False
            say(f"  -> the plugin stays off in {engine}; the engine runs unpatched")
        elif raw is _INVALID or (check is not None and config is None):
            ok = False
            say("  -> the engine refuses to start until the configuration is fixed")
        elif config is None:
            say("  -> the configuration is not checked: this adapter has no check")
        elif config.enable and not config.active:
            key = "BCG_MAX_TOKENS" if ENV_PREFIX in check.source else "'max_tokens'"
            say(f"  -> the plugin is enabled but captures nothing: {key} is 0; drop it (or raise it) to replay "
                "prefill graphs")
        elif not config.active:
            say(f"  -> the plugin is installed but off; enable it with {report.enable_hint}")
        else:
            top = (f"{config.max_tokens} tokens" if config.max_tokens is not None
                   else "the engine's chunk size (or the most tokens one step can hold, if less)")
            say(f"  -> prefill/extend forwards up to {top} replay bcg graphs" + (
                f" ({report.replay_scope})" if report.replay_scope else ""))
            where = (report.attention_scope(config) if report.attention_scope is not None
                     else "an eager break in every bucket (this adapter captures no attention inside the graph)")
            say(f"  -> attention ({json.dumps(config.attention)}): {where}")
    if not any_host:
        say()
        say(f"{engines[0]} is not installed: the plugin has nothing to do there" if len(engines) == 1
            else "no supported host engine (vLLM, SGLang) is installed: the plugin has nothing to do")
        ok = False
    return 0 if ok else 1
