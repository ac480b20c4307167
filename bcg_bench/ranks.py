"""Engine processes that must move in step without a process group of their own.

vLLM's offline data parallelism runs one engine per process, and a rank's engine loop starts only
when that rank's own process sends a request: a rank that stays silent while another sends leaves
the other waiting in the data-parallel collectives. The benchmark and the GPU tests therefore
advance every rank's process together, one step at a time, through files in a shared directory.
Processes that do rendezvous over TCP on one host get their port from :func:`free_port`.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

STEP_TIMEOUT_S = 300.0  # bounds one step's wait: an engine start-up on the slowest rank fits


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no process listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FileBarrier:
    """A reusable barrier for ``size`` processes on one host: :meth:`wait` returns once every rank
    has called it as many times as this one. Each rank writes its own step count to its own file,
    so no lock is needed."""

    def __init__(self, directory: str | Path, rank: int, size: int, timeout_s: float = STEP_TIMEOUT_S,
                 poll_s: float = 0.0005) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in 0..{size - 1}, got {rank}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank, self.size, self.timeout_s, self.poll_s = rank, size, timeout_s, poll_s
        self.step = 0

    def _path(self, rank: int) -> Path:
        return self.directory / f"rank{rank}.step"

    def _reached(self, rank: int) -> int:
        try:
            return int(self._path(rank).read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def wait(self) -> None:
        self.step += 1
        tmp = self._path(self.rank).with_suffix(".tmp")
        tmp.write_text(str(self.step))
        os.replace(tmp, self._path(self.rank))  # readers never see a half-written count
        deadline = time.monotonic() + self.timeout_s
        while True:
            behind = [r for r in range(self.size) if self._reached(r) < self.step]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: ranks {behind} did not reach step {self.step} "
                                   f"within {self.timeout_s:.0f} s")
            time.sleep(self.poll_s)
