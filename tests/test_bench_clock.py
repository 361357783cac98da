"""The benchmark suite's device clock (bench/harness.py) reads the GPU's time of a
round, as CUDA events around the work measure it. Needs a GPU."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")


def _harness():
    spec = importlib.util.spec_from_file_location(
        "bench_harness", Path(__file__).resolve().parents[1] / "bench" / "harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_clock_times_a_round_like_cuda_events():
    clock = _harness().DeviceClock(torch.device("cuda"))
    start = clock()
    torch.cuda._sleep(100_000_000)  # about 50 ms of GPU time, whatever the host does
    measured = clock() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    reference = begin.elapsed_time(end) / 1e3
    assert 0.8 < measured / reference < 1.25, (measured, reference)
    # The next round starts where the last one ended: the flush is not counted.
    assert clock() == pytest.approx(start + measured)
