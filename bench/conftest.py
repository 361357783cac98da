"""The benchmark suite's set-up: ``pytest bench/ --benchmark-only``.

Every case times mpgemm and its baselines with the same ``run_case`` fixture: warm-up
calls first (compilation, autotuning, allocator growth stay out), then
``benchmark.pedantic`` rounds of one call each. Kernels (the gemm, linear and unscale
groups) are timed on a GPU as kernel authors time them: CUDA events around each round,
L2 flushed before it (``harness.DeviceClock``); a whole training step (the step group)
by the wall clock, with the GPU synchronised inside the round. Each round of the
kernels starts from an idle GPU, so it adds the host's time to enqueue the call (an
eager call's latency); ``kernel_ms`` in ``extra_info`` is the same work's GPU time with
that latency hidden, and ``host_ms`` the host's time to enqueue it (``harness.kernel_time``;
the JSON's ``machine_info`` has ``l2_flush_ms``, the flush's GPU time, during which an
idle round's enqueue is hidden). A whole step's ``host_ms`` (GPU only) is its enqueue
time within the rounds: against the wall clock, how host-bound the step is. Each result carries
``case``, ``impl``, the work done (``flops``, ``bytes``), peak memory and the clock used
(``timing``) in ``extra_info``; the JSON hook below adds TFLOP/s, GB/s
and the ratio of mpgemm to each baseline measured in the same run
(``bench/report.py`` turns the JSON into a table and a figure). The device name and
the torch, triton and CUDA versions go into the JSON's ``machine_info``.

Without a GPU the same suite runs mpgemm's CPU path (its reference implementation) on
small shapes, so that it cannot rot; those numbers say nothing about GPUs.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from harness import (
    DEVICE,
    ON_GPU,
    ROUNDS,
    WARMUP_CALLS,
    DeviceClock,
    flush_time,
    kernel_time,
    median,
    peak_memory_mb,
    synchronize,
)
from report import add_derived_metrics

from mpgemm.app.report import environment
from mpgemm.kernels.launches import chosen_configs, intercepting


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def run_case(benchmark):
    """``run_case(fn, case=..., impl=..., flops=0, bytes=0, setup=None, wall_clock=False,
    check=None, **extra)`` times ``fn`` (``fn(*setup()[0])`` when a setup builds fresh
    arguments each round); ``wall_clock`` for whole steps, device time otherwise.
    ``check``: called with what one more call returns once the timing is done (the
    configs the autotuners chose included: the tests stage runs one config a launch).

    While launches are intercepted (recorded by ``gpu_check.sh plan``), mpgemm's cases call
    ``fn`` once (the baselines are skipped: ``_empty_data_while_intercepting``)."""

    def run(
        fn,
        *,
        case: str,
        impl: str,
        flops: float = 0,
        bytes: float = 0,
        setup=None,
        wall_clock: bool = False,
        check=None,
        **extra,
    ):
        if intercepting():  # a baseline was skipped before its set-up
            fn(*(setup()[0] if setup else ()))
            return
        for _ in range(WARMUP_CALLS):
            fn(*(setup()[0] if setup else ()))
        device_time = ON_GPU and not wall_clock
        benchmark.extra_info.update(
            case=case,
            impl=impl,
            flops=flops,
            bytes=bytes,
            peak_memory_mb=peak_memory_mb(fn, setup),
            timing="cuda events, L2 flushed" if device_time else "wall clock",
            **extra,
        )

        enqueue: list[float] = []  # a whole step's host time within each round

        def timed(*args):
            begin = time.perf_counter()
            fn(*args)
            enqueue.append(time.perf_counter() - begin)
            synchronize()

        if device_time:
            # pytest-benchmark reads its clock around each round (no public option
            # sets a clock per test).
            benchmark._timer = DeviceClock(DEVICE)
        benchmark.pedantic(
            fn if device_time else timed,
            setup=setup,
            rounds=ROUNDS,
            iterations=1,
            warmup_rounds=0 if setup else 1,
        )
        if device_time:
            # The same work's GPU time with the host's latency hidden (each round above
            # starts from an idle GPU, so it adds the host's time to enqueue the call).
            # Its host time too: what an idle round waits for, less the flush.
            timing = kernel_time(fn, setup)
            benchmark.extra_info["kernel_ms"] = None if timing is None else timing.kernel * 1e3
            benchmark.extra_info["host_ms"] = None if timing is None else timing.host * 1e3
        elif ON_GPU:
            # A step's time to enqueue, from a synchronised GPU (the rounds', less the
            # warm-up's): against its wall clock, how host-bound it is.
            benchmark.extra_info["host_ms"] = median(enqueue[-ROUNDS:]) * 1e3
        if check is not None:
            check(fn(*(setup()[0] if setup else ())))
        if benchmark.stats is not None:  # a line per case in the log as the suite runs
            kernel = benchmark.extra_info.get("kernel_ms")
            host = benchmark.extra_info.get("host_ms")
            print(
                f"\n{case} {impl}: median {benchmark.stats.stats.median * 1e3:.3f} ms"
                + ("" if kernel is None else f", kernel {kernel:.3f} ms")
                + ("" if host is None else f", host {host:.3f} ms")
            )

    return run


def pytest_collection_modifyitems(config, items):
    """With ``MPGEMM_BENCH_TARGETS=1``, only the cases that the issue's targets read
    (``bench/report.py``'s targets table): those whose case and impl (the parameters'
    id, ``case-impl``) are in their module's ``TARGET_CASES`` and ``TARGET_IMPLS``. The
    runbook's ``targets`` stage, which fits a device call beside others."""
    if os.environ.get("MPGEMM_BENCH_TARGETS") != "1":
        return
    kept, dropped = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        case, _, impl = params.id.rpartition("-") if params else ("", "", "")
        read = case in getattr(item.module, "TARGET_CASES", ()) and impl in getattr(
            item.module, "TARGET_IMPLS", ()
        )
        (kept if read else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["mpgemm"] = environment(DEVICE)
    if ON_GPU:
        machine_info["l2_flush_ms"] = flush_time() * 1e3


def pytest_benchmark_update_json(config, benchmarks, output_json):
    add_derived_metrics(output_json["benchmarks"])
    # The tile each launch kind ran, as the autotuners chose them in this run.
    output_json["autotuned"] = chosen_configs()


@pytest.fixture(autouse=True)
def _empty_data_while_intercepting(request, monkeypatch):
    """While launches are intercepted nothing runs, so values do not matter: empty
    tensors stand in for random ones, and recording GPU-sized cases on a CPU is quick.
    The baselines (an ``impl`` other than mpgemm's), which compile nothing of ours, are
    skipped before their set-up, which torch would compute on the CPU at the GPU's
    sizes (a batched FP16 product took 10 s so)."""
    if intercepting():
        impl = getattr(request.node, "callspec", None) and request.node.callspec.params.get("impl")
        if impl and not impl.startswith("mpgemm"):
            pytest.skip("recording launches: baselines compile no mpgemm kernel")
        monkeypatch.setattr(torch, "randn", lambda *size, **kw: torch.empty(*size, **kw))
