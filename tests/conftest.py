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
GPU_TESTS = Path(__file__).resolve().parent / "gpu"


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
    from bcg_plugin.adapters.vllm import launch, plugin

    plugin.unregister()
    launch._logged.clear()
    yield
    plugin.unregister()
    launch._logged.clear()


@pytest.fixture(scope="module")
def vllm_model_config():
    """vLLM's ``ModelConfig`` for the small test model (no tokenizer); shared by a module's tests."""
    from vllm.config import ModelConfig

    from bcg_bench.models import model_dir

    return ModelConfig(model=str(model_dir("qwen3-0.6b")), skip_tokenizer_init=True)


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
