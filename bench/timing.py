"""Timing shared by the benchmark scripts.

On a GPU a timing is the median of ``triton.testing.do_bench`` (CUDA events around
each call, warm-up first so autotuning and compilation stay out). Without one, a few
wall-clock calls on the CPU, which only show that the code runs.
"""

from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")
    fn()  # warm-up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
