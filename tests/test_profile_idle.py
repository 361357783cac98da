"""bench/profile_gpu.py's ``idle_waits``: from a profile of GEMMs timed as the bench
times them from an idle GPU (a flush, then the call) and then back to back, each idle
round's wait between the flush and the call's kernels, and the calls' kernel spans."""

import pytest

from tests.bench_scripts import BENCH, load

FILL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<signed char>>"


@pytest.fixture
def idle_waits(monkeypatch):
    # The script imports its neighbours (harness, host_time) as a script run from
    # bench/ does.
    monkeypatch.syspath_prepend(str(BENCH))
    return load("profile_gpu").idle_waits


def test_waits_and_spans_of_idle_and_busy_calls_of_two_kernels(idle_waits):
    # Two idle rounds: a 90 us flush, then a call of two kernels after a wait of 40 us
    # (then 10); then two calls back to back.
    kernels = [
        (FILL, 0.0, 90.0),
        ("gemm", 130.0, 30.0),
        ("reduce", 162.0, 3.0),
        (FILL, 1000.0, 90.0),
        ("gemm", 1100.0, 31.0),
        ("reduce", 1133.0, 2.0),
        ("gemm", 2000.0, 29.0),
        ("reduce", 2030.0, 3.0),
        ("gemm", 2033.0, 28.0),
        ("reduce", 2062.0, 2.0),
    ]
    flushes, waits, idle, busy = idle_waits(kernels, rounds=2)
    assert flushes == [90.0, 90.0]
    assert waits == [40.0, 10.0]
    assert idle == [35.0, 35.0]
    assert busy == [33.0, 31.0]


def test_a_profile_that_is_not_the_rounds_is_refused(idle_waits):
    one_flush = [(FILL, 0.0, 90.0), ("gemm", 100.0, 30.0), ("gemm", 200.0, 30.0)]
    with pytest.raises(ValueError, match="expected 2 flushes"):
        idle_waits(one_flush, rounds=2)
    uneven = [(FILL, 0.0, 1.0), ("gemm", 2.0, 1.0), (FILL, 5.0, 1.0), ("gemm", 7.0, 1.0)]
    with pytest.raises(ValueError, match="do not make 2 idle and busy calls"):
        idle_waits([*uneven, ("gemm", 9.0, 1.0)], rounds=2)


@pytest.fixture
def api_calls_within(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return load("profile_gpu").api_calls_within


def _event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_api_calls_are_summed_within_each_labelled_call(api_calls_within):
    # Two idle calls: the flush's launch before the first range is left out, as is the
    # synchronize after each; a busy call's range is another label's.
    events = [
        _event("cuda_runtime", "cudaLaunchKernel", 0.0, 5.0),  # the flush's
        _event("user_annotation", "idle call", 10.0, 100.0),
        _event("cpu_op", "aten::empty", 12.0, 30.0),
        _event("cuda_runtime", "cudaMalloc", 15.0, 20.0),
        _event("cuda_driver", "cuLaunchKernelEx", 60.0, 8.0),
        _event("cuda_runtime", "cudaDeviceSynchronize", 120.0, 500.0),
        _event("user_annotation", "idle call", 700.0, 50.0),
        _event("cuda_driver", "cuLaunchKernelEx", 720.0, 9.0),
        _event("gpu_user_annotation", "idle call", 725.0, 300.0),  # the GPU's side
        _event("user_annotation", "busy call", 800.0, 40.0),
        _event("cuda_driver", "cuLaunchKernelEx", 810.0, 7.0),
    ]
    spans, totals, longest = api_calls_within(events, "idle call")
    assert spans == [100.0, 50.0]
    assert totals == [28.0, 9.0]
    assert longest == [("cudaMalloc", 20.0), ("cuLaunchKernelEx", 9.0)]
    assert api_calls_within(events, "busy call") == ([40.0], [7.0], [("cuLaunchKernelEx", 7.0)])
    with pytest.raises(ValueError, match="no 'other' ranges"):
        api_calls_within(events, "other")
