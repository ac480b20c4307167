"""Decisions every rank must make identically, taken from replicated values only."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bcg_plugin.ladder import choose_bucket


class CaptureStatus(enum.IntEnum):
    """Capture outcome of one rank, ordered so the MIN over ranks is the world's outcome."""

    OOM = 0
    FAILED = 1
    OK = 2


def _world_size(group: Any) -> int:
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)


def agree_capture_status(local: CaptureStatus, group: Any) -> CaptureStatus:
    """MIN of every rank's status over a CPU group: one rank's failure leaves every rank eager."""
    if _world_size(group) == 1:
        return local
    t = torch.tensor([int(local)], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=group)
    return CaptureStatus(int(t.item()))


def dp_bucket(
    buckets: Sequence[int], num_tokens_across_dp: Sequence[int], all_ranks_extend: bool
) -> int | None:
    """The bucket every DP rank replays, or ``None`` for eager on every rank.

    Taken from replicated values only: the max token count over ranks (so the layout can be pinned
    to ``[bucket] * world``) and whether every rank runs an extend. An idle rank runs a decode or
    a dummy forward, so no rank may replay: the collectives inside the graphs would deadlock.
    """
    if not all_ranks_extend or not num_tokens_across_dp:
        return None
    return choose_bucket(buckets, max(num_tokens_across_dp))


def first_rank(read_rank: Callable[[], int | None]) -> bool:
    """Whether this process is its tensor-parallel group's first rank, the one that logs, shows
    progress and exports metrics for the group. ``read_rank`` reads the host's rank in the group;
    where it cannot (no group yet, ``None``, an error) the process counts as a group of one."""
    try:
        rank = read_rank()
    except Exception:  # the host's group accessors raise before its distributed state exists
        return True
    return rank is None or int(rank) == 0
