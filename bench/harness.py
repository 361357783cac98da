"""What the benchmarks share: the device, the problem scale, the clocks, peak memory."""

from __future__ import annotations

import os

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# Problem sizes: a GPU's, or small ones for a CPU. MPGEMM_BENCH_SCALE=gpu asks for the
# GPU's anywhere: ``bench/gpu_check.sh plan`` records their launches on a CPU.
GPU_SCALE = os.environ.get("MPGEMM_BENCH_SCALE", "gpu" if ON_GPU else "cpu") == "gpu"
WARMUP_CALLS = 5 if ON_GPU else 1
ROUNDS = 30 if ON_GPU else 3
# Larger than any GPU's L2 (50 MB on an H100), as triton.testing.do_bench flushes.
L2_FLUSH_BYTES = 256 * 2**20
# What torch.cuda.set_sync_debug_mode("warn") says at each synchronising call (its first
# use also warns that the mode is a prototype: not a sync).
SYNC_WARNING = "called a synchronizing CUDA operation"


def synchronize() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


class DeviceClock:
    """A clock for pytest-benchmark that reads the GPU's time, as kernel authors time
    (``triton.testing.do_bench``): pytest-benchmark reads a clock before and after each
    round. Before, this writes a buffer larger than L2 (so the round starts from a cold
    cache, as a kernel in a training step does) and then records a CUDA event; after, it
    records another, waits for it, and advances by the time between the two events. The
    host's wait and the flush stay out of the round's time."""

    def __init__(self, device: torch.device) -> None:
        self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
        self._start: torch.cuda.Event | None = None
        self._now = 0.0

    def __call__(self) -> float:
        if self._start is None:
            self._flush.zero_()
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
            return self._now
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        self._now += self._start.elapsed_time(end) / 1e3
        self._start = None
        return self._now


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
