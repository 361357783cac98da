"""The benchmark suite's set-up: ``pytest bench/ --benchmark-only``.

Every case times mpgemm and its baselines with the same ``run_case`` fixture: warm-up
calls first (compilation, autotuning, allocator growth stay out), then
``benchmark.pedantic`` rounds of one call each, with the GPU synchronised inside the
timed function. Each result carries ``case``, ``impl`` and the work done (``flops``,
``bytes``) and peak memory in ``extra_info``; the JSON hook below adds TFLOP/s, GB/s
and the ratio of mpgemm to each baseline measured in the same run
(``bench/report.py`` turns the JSON into a table and a figure). The device name and
the torch, triton and CUDA versions go into the JSON's ``machine_info``.

Without a GPU the same suite runs mpgemm's CPU path (its reference implementation) on
small shapes, so that it cannot rot; those numbers say nothing about GPUs.
"""

from __future__ import annotations

import pytest
import torch
from harness import DEVICE, ROUNDS, WARMUP_CALLS, peak_memory_mb, synchronize
from report import add_derived_metrics

from mpgemm.report import environment


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def run_case(benchmark):
    """``run_case(fn, case=..., impl=..., flops=0, bytes=0, setup=None, **extra)`` times
    ``fn`` (``fn(*setup()[0])`` when a setup builds fresh arguments each round)."""

    def run(fn, *, case: str, impl: str, flops: float = 0, bytes: float = 0, setup=None,
            **extra):
        for _ in range(WARMUP_CALLS):
            fn(*(setup()[0] if setup else ()))
        benchmark.extra_info.update(
            case=case, impl=impl, flops=flops, bytes=bytes,
            peak_memory_mb=peak_memory_mb(fn, setup), **extra,
        )

        def timed(*args):
            fn(*args)
            synchronize()

        benchmark.pedantic(timed, setup=setup, rounds=ROUNDS, iterations=1,
                           warmup_rounds=0 if setup else 1)

    return run


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["mpgemm"] = environment(DEVICE)


def pytest_benchmark_update_json(config, benchmarks, output_json):
    add_derived_metrics(output_json["benchmarks"])
