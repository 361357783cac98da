"""The benchmark suite's device clock (bench/harness.py) reads the GPU's time of a
round, as CUDA events around the work measure it. Needs a GPU."""

import pytest
import torch

from tests.bench_scripts import load

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
SLEEP_CYCLES = 100_000_000  # about 50 ms of GPU time, whatever the host does


def _harness():
    return load("harness")


def test_device_clock_times_a_round_like_cuda_events():
    def by_events():
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(SLEEP_CYCLES)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    clock = _harness().DeviceClock(torch.device("cuda"))
    # _sleep counts cycles, and an idle GPU clocks up while it runs: warm the clock up,
    # then compare with events timing the same sleep just before and just after.
    by_events()
    before = by_events()
    start = clock()
    torch.cuda._sleep(SLEEP_CYCLES)
    measured = clock() - start
    reference = (before + by_events()) / 2
    assert 0.8 < measured / reference < 1.25, (measured, before, reference)
    # The next round starts where the last one ended: the flush is not counted.
    assert clock() == pytest.approx(start + measured)


def test_kernel_time_hides_the_hosts_latency():
    """A call that spends 20 ms on the host before a kernel of about 5 ms: timed from an
    idle GPU (DeviceClock) it takes both; kernel_time gives the kernel's time alone,
    and the host's."""
    import time

    harness = _harness()
    cycles = SLEEP_CYCLES // 10

    def call():
        time.sleep(20e-3)
        torch.cuda._sleep(cycles)

    call()
    clock = harness.DeviceClock(torch.device("cuda"))
    start = clock()
    call()
    eager = clock() - start
    kernel, host = harness.kernel_time(call, rounds=3)
    alone, alone_host = harness.kernel_time(lambda: torch.cuda._sleep(cycles), rounds=3)
    assert eager > kernel + 15e-3, (eager, kernel)
    # (_sleep counts cycles, and the GPU's clock varies: the bounds of the test above.)
    assert 0.8 < kernel / alone < 1.25, (kernel, alone)
    # The host's time is the call's: its sleep, and then a launch.
    assert 20e-3 <= host < 20e-3 + 10e-3 and alone_host < 5e-3, (host, alone_host)


def test_flush_time_is_the_gpu_time_of_writing_the_flush_buffer():
    harness = _harness()
    seconds = harness.flush_time()
    # 256 MB written at between 50 GB/s and 10 TB/s: any GPU's memory.
    assert harness.L2_FLUSH_BYTES / 10e12 < seconds < harness.L2_FLUSH_BYTES / 50e9, seconds
