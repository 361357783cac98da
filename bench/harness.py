"""What the benchmarks share: the device, and how to synchronise and read peak memory."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
WARMUP_CALLS = 5 if ON_GPU else 1
ROUNDS = 30 if ON_GPU else 3


def synchronize() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def peak_memory_mb(fn, setup=None) -> float | None:
    """Peak GPU memory allocated while ``fn`` runs once (inputs included)."""
    if not ON_GPU:
        return None
    args = setup()[0] if setup else ()
    synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn(*args)
    synchronize()
    return torch.cuda.max_memory_allocated() / 2**20
