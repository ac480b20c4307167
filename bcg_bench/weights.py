"""What a forward's weight-read floor is made of: the bytes of the weights it reads, and the rate at
which the GPU streams memory. Both engines' mode scripts record them (:func:`bcg_bench.targets.weight_floor`)."""

from __future__ import annotations

import statistics
from typing import Any

COPY_BYTES = 2**30  # the device copy that measures the bandwidth of the weight-read floor


def parameter_bytes(model: Any, vocab_types: tuple[type, ...] = (),
                    read_types: tuple[type, ...] = ()) -> tuple[int, int]:
    """The bytes of ``model``'s parameters (a tied weight once), and the part held by vocabulary
    tables the timed forward does not read whole: modules of ``torch.nn.Embedding`` or of
    ``vocab_types`` (an engine's vocabulary-parallel embedding, of which the forward reads N rows,
    and the LM head derived from it, which an engine that applies it after the timed forward does
    not read there), unless they are of ``read_types`` (an LM head the engine applies inside the
    timed forward, read whole for the last token's logits; a weight it shares with the embedding is
    then read whole too)."""
    import torch

    vocab_types = (torch.nn.Embedding, *vocab_types)
    read = {id(p) for m in model.modules() if read_types and isinstance(m, read_types)
            for p in m.parameters(recurse=False)}
    vocab = {id(p) for m in model.modules() if isinstance(m, vocab_types)
             for p in m.parameters(recurse=False)} - read
    total = vocab_total = 0
    for p in model.parameters():  # each Parameter once, however many modules share it
        size = p.numel() * p.element_size()
        total += size
        vocab_total += size if id(p) in vocab else 0
    return total, vocab_total


def copy_bandwidth_gbs(reps: int = 5, nbytes: int = COPY_BYTES) -> float:
    """The median rate of a device-to-device copy of ``nbytes``, in GB/s of memory traffic (each
    byte is read and written): the rate at which this GPU streams weights."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # the first copy pays for lazy initialisation
    rates = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        rates.append(2 * nbytes / (start.elapsed_time(end) * 1e-3) / 1e9)
    del src, dst
    return statistics.median(rates)
