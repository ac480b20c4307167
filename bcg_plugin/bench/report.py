"""What every benchmark result file records, and how it is shown (markdown tables, PNG plots)."""

from __future__ import annotations

import datetime
import platform
from pathlib import Path

import torch


def environment() -> dict:
    """Date, GPU, torch/CUDA versions: stamped into every result file."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def write_markdown(path: Path, text: str) -> None:
    path.write_text(text)


def plot_latency(path: Path, title: str, series: dict[str, dict], ylabel: str = "ms") -> bool:
    """One line per mode (N -> value, log-log); returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, points in series.items():
        xs = sorted(int(n) for n in points)
        ys = [points[str(n)] if str(n) in points else points[n] for n in xs]
        ax.plot(xs, ys, marker="o", label=mode)
    ax.set_xscale("log", base=2)
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
