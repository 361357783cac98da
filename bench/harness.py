"""What the benchmarks share: the device, the problem scale, the clocks, peak memory."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import time
from types import ModuleType
from typing import NamedTuple

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


def product_of(a: torch.Tensor, b: torch.Tensor, what: str):
    """A ``run_case`` check: its output is ``a @ b`` of these 16-bit operands (batched
    as ``torch.matmul`` batches them) within twice the error of torch's own product of
    them against FP64 (``tests.accuracy``'s bar)."""
    # (Imported here: the scripts that import this module run from bench/, where the
    # tests package is not importable; the benchmarks run from the repository's root.)
    from tests.accuracy import assert_within_torch_error

    def check(out: torch.Tensor) -> None:
        exact = torch.matmul(a.double(), b.double())
        assert_within_torch_error(out, exact, torch.matmul(a, b), what)

    return check


def synchronize() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


@functools.cache
def _flush_buffer(device: torch.device) -> torch.Tensor:
    """The buffer written to flush L2, one per device for the whole run. (A buffer per
    clock stayed allocated: pytest-benchmark keeps every case's fixture, and with it its
    clock, until the end; each device-timed case added 256 MB, which the later cases'
    peak memory counted.)"""
    return torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)


class DeviceClock:
    """A clock for pytest-benchmark that reads the GPU's time, as kernel authors time
    (``triton.testing.do_bench``): pytest-benchmark reads a clock before and after each
    round. Before, this writes a buffer larger than L2 (so the round starts from a cold
    cache, as a kernel in a training step does) and then records a CUDA event; after, it
    records another, waits for it, and advances by the time between the two events. The
    host's wait and the flush stay out of the round's time."""

    def __init__(self, device: torch.device) -> None:
        self._flush = _flush_buffer(device)
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
    """Peak GPU memory allocated while ``fn`` runs once (inputs included; the clocks'
    flush buffer not)."""
    if not ON_GPU:
        return None
    args = setup()[0] if setup else ()
    synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn(*args)
    synchronize()
    harness = L2_FLUSH_BYTES if _flush_buffer.cache_info().currsize else 0
    return (torch.cuda.max_memory_allocated() - harness) / 2**20


def _sleep_cycles_per_second() -> float:
    """The rate of ``torch.cuda._sleep``, which spins for a number of GPU clock cycles,
    timed by CUDA events (after a first sleep has brought the clock up)."""
    cycles = 20_000_000
    torch.cuda._sleep(cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


# The longest the GPU is kept waiting for a call's host work: a call that still has
# not finished enqueueing by then waits for the GPU itself (a sync), and gets no time.
_MAX_WAIT_S = 0.5


class KernelTime(NamedTuple):
    """``kernel_time``'s medians, in seconds: the GPU time of a call's work with its host
    latency hidden, and the host's time to enqueue it (the call's wall clock while the
    GPU is kept busy: the latency an idle GPU waits for, less what ``flush_time``
    overlaps)."""

    kernel: float
    host: float


def kernel_time(fn, setup=None, rounds: int = ROUNDS) -> KernelTime | None:
    """The median GPU time of ``fn``'s work (``fn(*setup()[0])``) with its host latency
    hidden, and the median host time of the call: L2 is flushed as by ``DeviceClock``,
    then the GPU is kept busy (``torch.cuda._sleep``) for twice the host time the call
    took, so that everything ``fn`` enqueues is queued before the start event runs.
    ``DeviceClock`` times the same round from an idle GPU (the eager latency: host and
    GPU). A round whose start event ran before the host had finished enqueueing is run
    again with a longer wait; None if even ``_MAX_WAIT_S`` is not enough."""
    flush = _flush_buffer(DEVICE)
    rate = _sleep_cycles_per_second()
    wait = 1e-3
    times, hosts = [], []
    while len(times) < rounds:
        if wait > _MAX_WAIT_S:
            return None
        args = setup()[0] if setup else ()
        flush.zero_()
        torch.cuda._sleep(int(rate * wait))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        begin = time.perf_counter()
        fn(*args)
        host = time.perf_counter() - begin
        started_early = start.query()  # the GPU reached the start event before fn queued
        end.record()
        end.synchronize()
        wait = max(wait, 2 * host)
        if started_early:
            wait *= 2
            continue
        times.append(start.elapsed_time(end) / 1e3)
        hosts.append(host)
    return KernelTime(median(times), median(hosts))


def flush_time(rounds: int = 10) -> float:
    """The median GPU time of one L2 flush (``DeviceClock``'s), in seconds. An idle
    round enqueues its call while the flush runs: the host's first ``flush_time`` of
    enqueueing is hidden, and the rest adds to the round's time."""
    flush = _flush_buffer(DEVICE)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        flush.zero_()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return median(times)


def median(values: list[float]) -> float:
    """The bench's median: the upper one of an even count (a time that was measured)."""
    return sorted(values)[len(values) // 2]


def median_us(fn, calls: int) -> float:
    """Median microseconds of a call of ``fn`` over ``calls`` calls: on the GPU's clock
    with L2 flushed before each (``DeviceClock``), else the wall clock."""
    times = []
    clock = DeviceClock(DEVICE) if ON_GPU else time.perf_counter
    for _ in range(calls):
        start = clock()
        fn()
        times.append(clock() - start)
    return median(times) * 1e6


def module_from(path: str, name: str, replacing: dict[str, str] | None = None) -> ModuleType:
    """The module in the file at ``path`` (an earlier revision's kernels: ``git show
    REV:kernels/X.py > OLD.py``), loaded as ``name`` beside the installed one, whose
    imports it shares: its Triton kernels are kernels of their own, compiled apart.
    ``replacing``: modules it imports (by their names) that it takes from earlier files
    too (by path), where the installed ones have changed their interface."""
    earlier = {
        module: module_from(file, f"{name}_{module.rpartition('.')[2]}")
        for module, file in (replacing or {}).items()
    }
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    installed = {m: sys.modules[m] for m in earlier if m in sys.modules}
    sys.modules.update(earlier)  # (for its imports only)
    try:
        spec.loader.exec_module(module)
    finally:
        for m in earlier:
            del sys.modules[m]
        sys.modules.update(installed)
    return module


def write_rows(rows: list[dict], out: str | None, **facts: object) -> None:
    """Print a bench script's rows, one JSON line each, and write them to ``out`` (if
    given) with the device, torch's and triton's versions and ``facts``."""
    import triton

    env = dict(
        device=torch.cuda.get_device_name() if ON_GPU else "cpu",
        torch=torch.__version__,
        triton=triton.__version__,
        **facts,
    )
    for row in rows:
        print(json.dumps(row))
    if out:
        with open(out, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
