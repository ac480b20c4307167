"""What every benchmark result file records, and how it is shown (markdown tables, PNG plots)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

INSTALL_BENCH = 'pip install ".[bench]" from a checkout (once published: pip install "bcg-plugin[bench]")'
NO_PLOTS = f"matplotlib is not installed, so no plots were drawn; to draw them: {INSTALL_BENCH}"


def _checkout_head(start: Path) -> str | None:
    """The commit a git checkout holding ``start`` has checked out, read from its files (a linked
    worktree's ``.git`` is a file naming its folder, whose ``commondir`` holds the shared refs)."""
    for folder in (start, *start.parents):
        git = folder / ".git"
        if git.is_file():
            text = git.read_text().strip()
            if not text.startswith("gitdir: "):
                return None
            git = folder / text[8:]
        elif not git.is_dir():
            continue
        common = git / (git / "commondir").read_text().strip() if (git / "commondir").is_file() else git
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        for refs in dict.fromkeys((git, common)):
            if (refs / ref).is_file():
                return (refs / ref).read_text().strip()
        packed = common / "packed-refs"
        for line in packed.read_text().splitlines() if packed.is_file() else []:
            if line.endswith(" " + ref):
                return line.split()[0]
        return None
    return None


def _tracked_files_changed(start: Path) -> bool:
    """Whether ``git status`` reports changes to tracked files in the checkout holding ``start``
    (``False`` where git is missing or cannot say): such a tree is not the commit its ``HEAD`` names."""
    git = shutil.which("git")
    if git is None:
        return False
    try:
        status = subprocess.run([git, "-C", str(start), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return status.returncode == 0 and bool(status.stdout.strip())


def plugin_source() -> dict:
    """The bcg-plugin release and the commit of the tree that ran: ``GIT_COMMIT`` where the tree
    was copied without its git folder (as onto a GPU host), else the checkout's own ``HEAD``,
    marked ``-dirty`` where tracked files differ from it; ``None`` where neither is known."""
    try:
        version = importlib.metadata.version("bcg-plugin")
    except importlib.metadata.PackageNotFoundError:
        version = None
    commit = os.environ.get("GIT_COMMIT")
    if not commit:
        here = Path(__file__).resolve().parent
        commit = _checkout_head(here)
        if commit and _tracked_files_changed(here):
            return {"bcg_plugin": version, "commit": commit[:12] + "-dirty"}
    return {"bcg_plugin": version, "commit": commit[:12] if commit else None}


def environment() -> dict:
    """Date, GPU, torch/CUDA versions and the plugin's source: stamped into every result file."""
    import torch  # here, not at import: `bcg bench --help` runs without torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        **plugin_source(),
    }


def run_stamp(date: str) -> str:
    """``2026-11-29T14:07:42Z`` -> ``2026-11-29T1407Z``: file names of two runs on one day never collide."""
    return f"{date[:10]}T{date[11:13]}{date[14:16]}Z"


def write_markdown(path: Path, text: str) -> None:
    path.write_text(text)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def can_plot() -> bool:
    """Whether matplotlib is importable; where it is not, say so once on stderr (no plot is drawn)."""
    if _pyplot() is not None:
        return True
    print(f"[bcg bench] {NO_PLOTS}", file=sys.stderr)
    return False


def _line_plot(path: Path, title: str, series: dict[str, dict], ylabel: str, *, log_y: bool,
               reference: float | None = None) -> bool:
    """One line per mode (N -> value, log2 x axis); returns False when there is none or matplotlib is missing."""
    plt = _pyplot()
    if plt is None or not series:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, points in series.items():
        xs = sorted(points, key=int)
        ax.plot([int(n) for n in xs], [points[n] for n in xs], marker="o", label=mode)
    if reference is not None:
        ax.axhline(reference, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("prompt tokens N")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_latency(path: Path, title: str, series: dict[str, dict], ylabel: str = "ms") -> bool:
    """Latency per mode against N, log-log."""
    return _line_plot(path, title, series, ylabel, log_y=True)


def plot_speedup(path: Path, title: str, series: dict[str, dict], baseline: str) -> bool:
    """Each mode's speed-up over ``baseline`` (baseline ms / mode ms) against N."""
    if baseline not in series:
        return False
    base = series[baseline]
    ratios = {m: {n: base[n] / v for n, v in points.items() if n in base and v}
              for m, points in series.items() if m != baseline}
    return _line_plot(path, title, ratios, f"x faster than {baseline}", log_y=False, reference=1.0)


def plot_capture_memory(path: Path, title: str, costs: dict[str, tuple[float, float]]) -> bool:
    """Capture seconds and graph memory (GiB) per mode, side by side."""
    plt = _pyplot()
    if plt is None or not costs:
        return False
    modes = list(costs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    left.bar(modes, [costs[m][0] for m in modes], color="tab:blue")
    left.set_ylabel("capture s")
    right.bar(modes, [costs[m][1] for m in modes], color="tab:orange")
    right.set_ylabel("graph memory GiB")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
