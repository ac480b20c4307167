"""A profile of one model forward (``bcg bench --profile N``), benchmark only.

Where a mode's host time goes when a forward is launch-bound: how many CUDA runtime calls (graph
launches, kernel launches, copies) and which torch ops it issues, under ``torch.profiler``. Where
it is GPU-bound, which kernels take the device time (kernels replayed from CUDA graphs included).
Where two modes issue the same runtime calls and ops but one takes longer on the host, the Python
functions each one calls in that forward (``sys.setprofile``, counted by package and by function) show
what else it runs. Every mode of a run profiles the forward of the same N-token request the same way,
so they compare with each other; the profilers' overhead makes its host time no match for the timed
ones. The profiled forward comes from one extra request after the timed ones, so no median includes it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

PROFILE_TOKENS_ENV = "BCG_BENCH_PROFILE_TOKENS"
TOP_OPS = 25  # ops kept per profile, by host time spent in the op itself
TOP_KERNELS = 12  # kernels kept per profile, by device time: a few per layer type of a transformer
CUDA_RUNTIME_PREFIX = "cuda"  # the runtime API calls (cudaGraphLaunch, cudaLaunchKernel, ...) torch records
TOP_PYTHON = 12  # Python functions kept per profile, by calls: the per-layer ones of a 28-layer model and more


class ForwardProfiler:
    """Profiles the first forward of at least ``tokens`` rows once ``armed()`` is true; holds its summary.

    The engines' bench timers call :meth:`around` for every forward with the rows it runs; other
    forwards pass straight through. The bench arms the profiler for one extra request of ``tokens``
    prompt tokens after the timed ones, so the forward profiled is that request's prefill at the size
    the mode runs it: N rows eagerly, or the bucket N pads to (``forward_rows`` in the summary), whose
    padded-row work is then part of the profile.
    """

    def __init__(self, tokens: int, armed: Callable[[], bool]) -> None:
        if tokens < 1:
            raise ValueError(f"{PROFILE_TOKENS_ENV} must be a token count >= 1, got {tokens}")
        self.tokens = tokens
        self.armed = armed
        self.summary: dict | None = None

    @classmethod
    def from_env(cls, armed: Callable[[], bool], environ: Mapping[str, str] | None = None) -> ForwardProfiler | None:
        value = (os.environ if environ is None else environ).get(PROFILE_TOKENS_ENV)
        if not value:
            return None
        try:
            tokens = int(value)
        except ValueError:
            raise ValueError(f"{PROFILE_TOKENS_ENV}={value!r}: expected a token count such as 16") from None
        return cls(tokens, armed)

    @contextlib.contextmanager
    def around(self, num_tokens: int) -> Iterator[None]:
        if self.summary is not None or num_tokens < self.tokens or not self.armed():
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, supported_activities

        # CUDA activity (CUPTI) adds the runtime calls; without it only torch ops are seen.
        activities = [a for a in (ProfilerActivity.CPU, ProfilerActivity.CUDA) if a in supported_activities()]
        calls = PythonCalls()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            with calls.counting():
                yield
            host_ms = (time.perf_counter() - start) * 1e3
            if torch.cuda.is_available():  # the forward's kernels end inside the profile
                torch.cuda.synchronize()
        self.summary = summarize(prof.key_averages(), host_ms, [a.name for a in activities], self.tokens, num_tokens)
        self.summary.update(calls.summary())


class PythonCalls:
    """The Python functions one thread calls inside :meth:`counting`, by file and name (``sys.setprofile``).

    Counts, not times: the hook itself costs more than most of the calls it counts, but every mode
    pays it per call alike, so the counts say which mode runs more Python per forward, and where.
    """

    def __init__(self) -> None:
        self.by_function: collections.Counter = collections.Counter()

    def _hook(self, frame, event: str, arg) -> None:
        if event == "call":  # Python frames only: builtins ("c_call") are not counted
            code = frame.f_code
            self.by_function[(code.co_filename, code.co_name)] += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        previous = sys.getprofile()
        sys.setprofile(self._hook)
        try:
            yield
        finally:
            sys.setprofile(previous)

    def summary(self, roots: list[str] | None = None) -> dict:
        """``python_calls`` (all), ``python_calls_by_package`` and the most called ``top_python_calls``."""
        roots = sorted({str(Path(r).resolve()) for r in (sys.path if roots is None else roots) if r},
                       key=len, reverse=True)
        by_package: collections.Counter = collections.Counter()
        named: collections.Counter = collections.Counter()
        for (filename, name), count in self.by_function.items():
            package = package_of(filename, roots)
            by_package[package] += count
            named[f"{package}:{Path(filename).stem}.{name}"] += count
        return {
            "python_calls": sum(by_package.values()),
            "python_calls_by_package": dict(by_package.most_common()),
            "top_python_calls": [{"name": k, "count": c} for k, c in named.most_common(TOP_PYTHON)],
        }


def package_of(filename: str, roots: list[str]) -> str:
    """The top-level package (or module) ``filename`` belongs to: the first path part below the
    first of ``roots`` that holds it; this project's adapters as ``bcg_plugin.adapters``.

    ``roots``: ``sys.path``'s entries, resolved and longest first (as :meth:`PythonCalls.summary`
    passes them), so a file is named below the deepest root that holds it.
    """
    if filename.startswith("<"):
        return filename  # <frozen importlib._bootstrap>, <string>: no file
    path = Path(filename)
    resolved = str(path.resolve())
    for root in roots:
        if resolved.startswith(root + os.sep):
            top = Path(resolved[len(root) + 1:]).parts[0].removesuffix(".py")
            return "bcg_plugin.adapters" if top == "adapters" else top
    # Not below sys.path (an editable install's import hook): this project's own parts by their directory.
    for mine, package in (("bcg_plugin", "bcg_plugin"), ("adapters", "bcg_plugin.adapters")):
        if mine in path.parts[:-1]:
            return package
    return path.parent.name or path.stem


def summarize(averages, host_ms: float, activities: list[str], tokens: int, forward_rows: int) -> dict:
    """The profile as plain data: counts of runtime calls and torch ops, the costliest ops."""
    events = [(e.key, int(e.count), float(e.self_cpu_time_total)) for e in averages]
    runtime = {k: c for k, c, _ in events if k.startswith(CUDA_RUNTIME_PREFIX)}
    ops = [(k, c, us) for k, c, us in events if k.startswith("aten::")]
    top = sorted(events, key=lambda e: -e[2])[:TOP_OPS]
    # Device-side events only: a torch op's own device time repeats its kernels'.
    kernels = [(e.key, int(e.count), float(e.self_device_time_total)) for e in averages
               if getattr(getattr(e, "device_type", None), "name", None) == "CUDA"]
    return {
        "tokens": tokens,
        "forward_rows": forward_rows,
        "host_ms": host_ms,
        "activities": activities,
        "cuda_runtime_calls": dict(sorted(runtime.items(), key=lambda kv: -kv[1])),
        "aten_ops": sum(c for _, c, _ in ops),
        "top_self_cpu_us": [{"name": k, "count": c, "self_cpu_us": round(us, 1)} for k, c, us in top],
        "device_us": round(sum(us for *_, us in kernels), 1),
        "top_device_us": [{"name": k, "count": c, "device_us": round(us, 1)}
                          for k, c, us in sorted(kernels, key=lambda e: -e[2])[:TOP_KERNELS]],
    }


def markdown(modes: dict) -> list[str]:
    """A table of the profiled modes (empty when none was profiled)."""
    profiled = {m: d["host_profile"] for m, d in modes.items() if d.get("host_profile")}
    if not profiled:
        return []
    tokens = next(iter(profiled.values()))["tokens"]
    calls = sorted({k for p in profiled.values() for k in p["cuda_runtime_calls"]},
                   key=lambda k: (-max(p["cuda_runtime_calls"].get(k, 0) for p in profiled.values()), k))[:4]
    title = f"## Host profile of the forward of one {tokens}-token request (torch.profiler, its overhead included)"
    lines = [title, "",
             "Rows: the forward's rows as the engine's forward timer saw them (vLLM's: the bucket N pads to).", "",
             "| mode | rows | host ms | torch ops | Python calls | " + " | ".join(calls) + (" | " if calls else "")
             + "costliest op (self CPU µs) |",
             "|---|---|---|---|---|" + "---|" * len(calls) + "---|"]
    for m, p in profiled.items():
        top = p["top_self_cpu_us"][0] if p["top_self_cpu_us"] else None
        cells = [str(p.get("forward_rows", tokens)), f"{p['host_ms']:.2f}", str(p["aten_ops"]),
                 str(p.get("python_calls", "-")),
                 *(str(p["cuda_runtime_calls"].get(k, 0)) for k in calls),
                 f"{top['name']} x{top['count']}: {top['self_cpu_us']:.0f}" if top else "-"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    python = {m: p for m, p in profiled.items() if p.get("python_calls_by_package")}
    if python:
        lines += ["", "Python function calls in that forward, by package, and the most called functions:", ""]
        for m, p in python.items():
            packages = ", ".join(f"{k} {c}" for k, c in list(p["python_calls_by_package"].items())[:6])
            top = "; ".join(f"{f['name']} x{f['count']}" for f in p.get("top_python_calls", [])[:6])
            lines.append(f"- {m}: {packages}. Most called: {top}")
    kernels = {m: p for m, p in profiled.items() if p.get("top_device_us")}
    if kernels:
        lines += ["", "Kernels with the most device time in that forward (µs, summed over their calls):", ""]
        for m, p in kernels.items():
            lines.append(f"- {m}: {p['device_us']:.0f} µs on the device in all; " + "; ".join(
                f"{_short(k['name'])} x{k['count']}: {k['device_us']:.0f}" for k in p["top_device_us"][:5]))
    skipped = [m for m, d in modes.items() if "e2e_ms" in d and not d.get("host_profile")]
    if skipped:
        lines += ["", f"Not profiled (no forward of {tokens} or more rows in this process): {', '.join(skipped)}."]
    return lines + [""]


_KERNEL_WRAPPERS = ("cutlass::device_kernel", "flash::enable_sm90_or_later")  # templates that only wrap the kernel


def _short(kernel: str, width: int = 60) -> str:
    """A kernel's name without its template arguments or wrappers, cut to ``width`` characters."""
    parts = [p.strip() for p in kernel.removeprefix("void ").split("<")]
    name = next((p for p in parts if p not in _KERNEL_WRAPPERS), parts[0])
    return name if len(name) <= width else name[: width - 1] + "…"
