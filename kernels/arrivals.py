"""Arrival counters: how a kernel finishes a reduction in the launch that began it.

A group of programs each writes its partial result, then counts itself in with an
atomic add on the group's counter; the program that arrives last (the add returns the
group's size less one) reads every partial, in a fixed order, writes the result, and
puts the counter back to zero. So a reduction takes one launch where a second launch
(a torch op or a kernel of its own) would cost some 25 to 60 us of host time on an
H100's host, and its result is the same run to run.

The counters need to be zero when a launch begins, which an allocation would pay for
with a fill, itself a launch. Since every launch that counts leaves its counters at
zero, and launches on one stream run one after another, one buffer per stream serves
all of them (``counters``). Under CUDA graph capture each launch gets fresh zeros
instead (the fill is captured with it): a graph may be replayed on another stream than
it was captured on, beside eager launches on that one. A stream's buffer is made by a
helper thread, outside any memory pool the calling thread allocates from (torch
inductor's CUDA-graph warm-up, ``torch.cuda.use_mem_pool``): kept for the process, it
must not be one of a pool's blocks, which the pool's owner takes back.

The kernel's side, ``arrive``: a CTA barrier first, so that the stores of all the
program's threads precede the atomic (release, GPU scope; Triton's scalar atomic is
one thread's, its result shared with the others, as torch inductor's grid barrier has
it), and the acquiring add orders the last program's reads of the partials after
every other program's release.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl
from triton.runtime import driver

# Counters of each stream's buffer at least (a launch asks for one per group: a column
# block of an activation's backward).
_MIN_COUNTERS = 1024
# (device, stream) -> int32 zeros, left at zero by every launch that used them.
_buffers: dict[tuple, torch.Tensor] = {}


def counters(device: torch.device, count: int) -> torch.Tensor:
    """``count`` or more int32 counters, zero, on ``device`` for a launch on its current
    stream, which must leave them at zero (``arrive``, then the last program's reset).
    Outside a graph's capture, the same buffer for every launch on the stream."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(count, dtype=torch.int32, device=device)
        if device.index is None:  # the current device (the helper thread has its own)
            device = torch.device("cuda", torch.cuda.current_device())
        # The launcher's own reading of the stream (triton's driver: one C call).
        key: tuple = (device.index, driver.active.get_current_stream(device.index))
    else:  # the interpreter runs a launch's programs one at a time
        key = (device.type, None)
    buffer = _buffers.get(key)
    if buffer is None or buffer.numel() < count:
        buffer = _lasting_zeros(max(count, _MIN_COUNTERS), device)
        _buffers[key] = buffer
    return buffer


def _lasting_zeros(count: int, device: torch.device) -> torch.Tensor:
    """``count`` int32 zeros on ``device``, allocated outside any pool the calling
    thread's allocations go to: torch routes a thread's allocations to a private pool
    (inductor's CUDA-graph warm-up; ``torch.cuda.use_mem_pool``) for that thread only,
    and a buffer kept there would be a block in use that the pool's owner does not know
    of (inductor refuses the graph: "tensor(s) in the cudagraph pool not tracked")."""
    if device.type != "cuda":
        return torch.zeros(count, dtype=torch.int32, device=device)
    with ThreadPoolExecutor(max_workers=1) as helper:
        buffer = helper.submit(torch.empty, count, dtype=torch.int32, device=device).result()
    # The helper allocated on its own current stream, the device's default one: the
    # caller's stream zeroes and uses it, and must finish with it before the allocator
    # hands its memory out again (when a larger buffer replaces it).
    stream = torch.cuda.current_stream(device)
    buffer.record_stream(stream)
    return buffer.zero_()


@triton.jit
def arrive(counter_ptr, group_size):
    """Count this program in on ``counter_ptr``, after all its threads' stores; True in
    the last of the ``group_size`` programs to arrive, which may then read what the
    others stored, and must then ``leave`` the counter."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == group_size - 1


@triton.jit
def leave(counter_ptr):
    """Put the counter back to zero, for the stream's next launch."""
    tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit(noinline=True)
def add_partials(
    counter_ptr,
    group_size,
    partial_ptr,
    parts,
    result_ptr,
    off_n,
    N,
    BLOCK_N: tl.constexpr,
    STEP: tl.constexpr,
):
    """Count this program in on ``counter_ptr`` (``arrive``); in the last of the
    ``group_size`` programs to arrive, result[off_n:off_n + BLOCK_N] = the sums over the
    ``parts`` rows of the FP32 partials (parts, N), row-major, of those columns, in row
    order, STEP rows a load, and the counter back to zero (``leave``). Not inlined
    (scalar arguments only): inlined after the TMA GEMM's tile loop, its registers made
    the 3-stage 128x256 tile spill (16 bytes under triton 3.6, 76 under 3.9)."""
    if arrive(counter_ptr, group_size):
        cols = off_n + tl.arange(0, BLOCK_N)
        mask_n = cols < N
        totals = tl.zeros((STEP, BLOCK_N), dtype=tl.float32)
        for first in range(0, parts, STEP):
            rows = (first + tl.arange(0, STEP)).to(tl.int64)
            totals += tl.load(
                partial_ptr + rows[:, None] * N + cols[None, :],
                mask=(rows < parts)[:, None] & mask_n[None, :],
                other=0.0,
                cache_modifier=".cg",  # past L1, which another SM's stores do not update
            )
        tl.store(result_ptr + cols, tl.sum(totals, axis=0), mask=mask_n)
        leave(counter_ptr)
