import builtins
import contextlib
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

SOAK_ENV = "BCG_SOAK_SECONDS"
TESTS = Path(__file__).resolve().parent
GPU_TESTS = TESTS / "gpu"
# The host engines; a test that imports one carries its marker, which is how the CI of each extra
# host version selects the tests to run against it (.ci/run: pytest -m vllm / -m sglang).
HOSTS = ("vllm", "sglang")
REQUIRED_HOSTS_ENV = "BCG_REQUIRED_HOSTS"


def soak_requested(markexpr: str, environ) -> bool:
    """Tests marked ``soak`` run only when asked for: ``BCG_SOAK_SECONDS`` set, or ``soak`` named
    (not negated) in the ``-m`` expression. ``-m gpu`` alone does not run them."""
    if (environ.get(SOAK_ENV) or "").strip():
        return True
    words = re.findall(r"\w+", markexpr or "")
    return any(w == "soak" and (i == 0 or words[i - 1] != "not") for i, w in enumerate(words))


def pytest_collection_modifyitems(config, items):
    if not soak_requested(config.getoption("markexpr", ""), os.environ):
        skip_soak = pytest.mark.skip(reason=f"soak test: runs with -m soak or {SOAK_ENV} set (README: GPU tests)")
        for item in items:
            if item.get_closest_marker("soak") is not None:
                item.add_marker(skip_soak)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run on the GPU host (README: GPU tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def required_hosts(environ) -> set[str]:
    """The hosts named in ``BCG_REQUIRED_HOSTS`` (comma-separated): in a CI environment built for a
    host, a test skipped because that host does not import is a broken environment, not a pass."""
    return {h.strip() for h in (environ.get(REQUIRED_HOSTS_ENV) or "").split(",") if h.strip()}


def _fail_required_skip(report, required: set[str]) -> None:
    if not report.skipped or not required:
        return
    reason = _skip_reason(report)
    missing = reason.removesuffix(" not installed")
    if missing != reason and missing.partition(".")[0] in required:
        report.outcome = "failed"
        report.longrepr = (f"{missing} does not import, and {REQUIRED_HOSTS_ENV} requires it in this run: "
                           f"the environment is broken; fix its package list (ci/hosts/)")


class _HostImports:
    """Records which host engines the tests' own code imports (an import statement in a test module
    or a fixture, ``pytest.importorskip``, ``importlib.import_module``) while a test module is
    collected or a test runs.

    Imports made by bcg_plugin or the host itself are not counted: a module's own imports run once,
    in whichever test first imports it, and the check must not depend on the order tests run in."""

    def __init__(self) -> None:
        self.real_import = builtins.__import__
        self.real_import_module = importlib.import_module
        self.seen: set[str] | None = None

    def _note(self, name: str, caller_globals) -> None:
        top = name.partition(".")[0]
        if self.seen is not None and top in HOSTS and _from_test_code(caller_globals):
            self.seen.add(top)

    def import_statement(self, name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0:
            self._note(name, globals)
        return self.real_import(name, globals, locals, fromlist, level)

    def import_module(self, name, package=None):
        if not name.startswith("."):
            self._note(name, sys._getframe(1).f_globals)
        return self.real_import_module(name, package)

    @contextlib.contextmanager
    def recording(self, seen: set[str]):
        outer, self.seen = self.seen, seen
        builtins.__import__, importlib.import_module = self.import_statement, self.import_module
        try:
            yield seen
        finally:
            self.seen = outer
            if outer is None:
                builtins.__import__, importlib.import_module = self.real_import, self.real_import_module


def _from_test_code(module_globals) -> bool:
    if not module_globals:
        return False
    if module_globals.get("__name__") == "_pytest.outcomes":  # pytest.importorskip
        return True
    file = module_globals.get("__file__")
    return bool(file) and TESTS in Path(file).resolve().parents


_HOST_IMPORTS = _HostImports()
_MODULE_HOSTS = pytest.StashKey[set]()
_TEST_HOSTS = pytest.StashKey[set]()
# Per fixture name: a fixture with a wider scope runs once, and every test using it needs what it imported.
_FIXTURE_HOSTS: dict[str, set[str]] = {}


def unmarked_host_imports(imported: set[str], markers: set[str]) -> list[str]:
    return sorted(h for h in imported if h not in markers)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    if not isinstance(collector, pytest.Module):
        outcome = yield
    else:
        with _HOST_IMPORTS.recording(set()) as seen:
            outcome = yield
        collector.stash[_MODULE_HOSTS] = seen
    _fail_required_skip(outcome.get_result(), required_hosts(os.environ))


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    with _HOST_IMPORTS.recording(_FIXTURE_HOSTS.setdefault(fixturedef.argname, set())):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    module = item.getparent(pytest.Module)
    seen = item.stash.setdefault(_TEST_HOSTS, set(module.stash.get(_MODULE_HOSTS, ())) if module else set())
    with _HOST_IMPORTS.recording(seen):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _HOST_IMPORTS.recording(item.stash.setdefault(_TEST_HOSTS, set())):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    _fail_required_skip(report, required_hosts(os.environ))
    # Checked once the test ran (or was skipped before it could): its own outcome comes first.
    if report.failed or call.when == "teardown" or (call.when == "setup" and not report.skipped):
        return
    if item.get_closest_marker("gpu") is not None:
        return
    imported = set(item.stash.get(_TEST_HOSTS, ()))
    for name in item.fixturenames:
        imported |= _FIXTURE_HOSTS.get(name, set())
    unmarked = unmarked_host_imports(imported, {m.name for m in item.iter_markers()})
    if unmarked:
        names = ", ".join(unmarked)
        marks = " and ".join(f"@pytest.mark.{h}" for h in unmarked)
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} imports {names} but is not marked {marks}: the CI run of each "
                           f"{names} version selects tests by that marker and would leave this one out")



def _skip_reason(report) -> str:
    """A skip's reason, shortened to what the summary line needs ("vllm not installed")."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    missing = re.match(r"could not import '([^']+)'", reason)
    if missing:
        return f"{missing.group(1)} not installed"
    return reason.split(";")[0].split(" (")[0]


def skipped_modules_line(skipped_reports) -> str | None:
    """One line naming the test modules skipped, grouped by reason: a run on a machine without a
    host engine or a GPU says what it left out, rather than passing quietly with less coverage."""
    by_reason: dict[str, dict[str, int | None]] = {}
    for report in skipped_reports:
        if getattr(report, "when", "collect") not in ("collect", "setup", "call"):
            continue
        module = report.nodeid.split("::")[0] or str(report.fspath)
        modules = by_reason.setdefault(_skip_reason(report), {})
        if "::" not in report.nodeid:
            modules[module] = None  # skipped at import: the whole module
        elif modules.get(module, 0) is not None:
            modules[module] = (modules.get(module) or 0) + 1
    if not by_reason:
        return None
    parts = []
    for reason, modules in sorted(by_reason.items()):
        named = [f"{m} (whole module)" if n is None else f"{m} ({n} test{'s' if n > 1 else ''})"
                 for m, n in sorted(modules.items())]
        parts.append(f"{reason}: {', '.join(named)}")
    return "skipped modules, by reason: " + "; ".join(parts)


def pytest_terminal_summary(terminalreporter):
    line = skipped_modules_line(terminalreporter.stats.get("skipped", []))
    if line:
        terminalreporter.write_line(line)


@pytest.fixture
def vllm_plugin_off():
    """The vLLM adapter unregistered, with no launch warning remembered, before the test and after it."""
    import logging

    from bcg_plugin.adapters.vllm import launch, plugin

    # Arming the runner patches routes the core's logger into vLLM's (process state, kept by design
    # in an engine); later tests that capture the core's records must find it as it was.
    core = logging.getLogger("bcg_plugin")
    saved = (list(core.handlers), core.propagate, core.level)
    plugin.unregister()
    launch._logged.clear()
    yield
    plugin.unregister()
    launch._logged.clear()
    core.handlers[:], core.propagate, core.level = saved


@pytest.fixture
def vllm_graph_platform(monkeypatch):
    """vLLM's CPU platform made to keep its CUDA graph mode, as a CUDA host does: it otherwise turns
    every graph off at the end of the config's start, which bcg reads as vLLM turning graphs off for
    something that cannot be captured."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True))


@pytest.fixture(scope="module")
def vllm_model_config():
    """vLLM's ``ModelConfig`` for the small test model (no tokenizer); shared by a module's tests."""
    from vllm.config import ModelConfig

    from bcg_bench.models import model_dir

    return ModelConfig(model=str(model_dir("qwen3-0.6b")), skip_tokenizer_init=True)


@pytest.fixture
def config_error_line():
    """Checks that an engine's start ended with bcg's one configuration-error line, not a traceback:
    status 1, one ``bcg:`` line on stderr (the engine's own log lines may surround it), holding
    ``message``; returns that line."""

    def check(proc, message: str) -> str:
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("bcg:")]
        assert line.startswith("bcg: configuration error: ") and message in line, line
        return line

    return check


@pytest.fixture
def gpu_test_module():
    """Loads ``tests/gpu/<name>.py`` as a module for CPU tests of its engine-free parts (its
    neighbours importable while it loads, as under pytest)."""

    def load(name: str):
        sys.path.insert(0, str(GPU_TESTS))
        try:
            spec = importlib.util.spec_from_file_location(f"bcg_{name}_module", GPU_TESTS / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(GPU_TESTS))
        return module

    return load


@pytest.fixture
def stale_metadata_fault(gpu_test_module):
    """The GPU tests' stale-metadata fault plugin (``tests/gpu/stale_metadata.py``), loaded in this
    process for one test, as ``BCG_TEST_FAULTS=stale_metadata`` loads it in an engine's."""
    from bcg_plugin import faults

    plugin = gpu_test_module("stale_metadata")
    faults.plugins().register(plugin)
    yield plugin
    faults.plugins().unregister(plugin)


class _FakeCudaEvent:
    """``torch.cuda.Event`` on a CPU: records nothing; every interval is 1 ms."""

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "_FakeCudaEvent") -> float:
        return 1.0


@pytest.fixture
def fake_cuda_events(monkeypatch):
    """The benchmarks' forward timers run on a CPU: ``torch.cuda.Event`` is a no-op for the test."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)


class _FakeBreakableCapture:
    """Stands in for an open ``breakable_graph``: records the steps eager breaks ask it to replay."""

    _barrier_fn = None

    def __init__(self) -> None:
        self.recorded = []

    def _end_segment(self) -> None:
        pass

    def _begin_segment(self) -> None:
        pass

    def _insert_eager(self, fn, args, kwargs) -> None:
        self.recorded.append((fn, args, kwargs))


@pytest.fixture
def fake_capture():
    """``with fake_capture() as capture:`` breaks called inside run as under a capture (on a CPU);
    ``capture.recorded`` holds the (step, args, kwargs) each one left for replay."""
    import breakable_cuda_graphs

    @contextlib.contextmanager
    def open_capture():
        capture = _FakeBreakableCapture()
        token = breakable_cuda_graphs._current_breakable_graph_ctx.set(capture)
        try:
            yield capture
        finally:
            breakable_cuda_graphs._current_breakable_graph_ctx.reset(token)

    return open_capture


class _RecordedOps(TorchDispatchMode):
    """Records the aten ops run inside it, by name (``copy_``, ``masked_fill_``, ...), in order."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.fixture
def recorded_ops():
    """``with recorded_ops() as ops:``: ``ops.names`` lists the aten ops run inside the block."""
    return _RecordedOps


@pytest.fixture
def fresh_faults(monkeypatch):
    """No fault plugin loaded yet (:mod:`bcg_plugin.faults` loads its plugins once per process), and
    none left loaded for the next test."""
    from bcg_plugin import faults

    monkeypatch.setattr(faults, "_manager", None)
    yield
    monkeypatch.setattr(faults, "_manager", None)
