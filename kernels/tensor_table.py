"""A table of tensor addresses, so that one launch covers a whole list of tensors.

The elementwise kernels of loss scaling (unscale, the optimizer steps) run over every
gradient of a model. One launch per tensor would cost a launch each for hundreds of
small tensors; instead a launch gets an int64 table, on the device, laid out as

    [ addresses of list 0 (T) | ... | addresses of list L-1 (T) | (group (T))
      | numel (T) | first program (T) | tensor of each program (P) ]

for T tensors in each of L parallel lists (for example params, grads and moments) and
P programs; with ``groups``, a row of one integer per tensor after the lists (the
optimizer steps' row of hyperparameters for each tensor: its param group's), read as
list L's "address" (``table_address``). Program ``p`` handles a span of SPAN elements,
``(p - first_program[t]) * SPAN + arange(SPAN)`` of tensor ``t = program_tensor[p]`` in
every list (``table_span``), a block of BLOCK elements at a time: one block
(``table_block``), or several (the optimizer steps, where a program's reads of the
table, its hyperparameters and its step count are then paid once per span). The
tensors of a list share one dtype; a tensor is taken as its flat storage, so parallel
tensors must have equal strides and be dense (``mpgemm.scaling.is_flat``).

Building a table costs a host-to-device copy; tables are cached by address, and the
caching allocator hands a model's gradients the same addresses step after step. Each
list's numels and addresses are read in one pass (``mpgemm.native.list_facts``).
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mpgemm import graphs
from mpgemm.functional import PLAIN_TYPES
from mpgemm.kernels.gemm_common import cdiv, multiprocessors
from mpgemm.native import list_facts

# torch dtype -> element type of the table's pointers
TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

# Elements a block, by default (unscale's block, a program each): 16 per thread for 8
# warps, enough loads in flight per SM to stream at memory bandwidth.
BLOCK = 4096
_CACHE_SIZE = 16
_cache: OrderedDict[tuple, object] = OrderedDict()
# A launch whose programs take several blocks (``blocks_per_program`` None) gives each
# at most this many, and keeps at least this many programs an SM (8 waves of the
# optimizers' two programs an SM: the last wave, which leaves SMs idle, stays short).
_MOST_BLOCKS_PER_PROGRAM = 8
_LEAST_PROGRAMS_PER_SM = 16


class Table(NamedTuple):
    """A launch's table (``tensor_table``)."""

    table: torch.Tensor  # int64, on the tensors' device
    num_tensors: int
    num_programs: int  # the launch's grid
    aligned: tuple[bool, ...]  # per list: every tensor on a 16-byte boundary
    span: int  # the elements each program takes: a multiple of the block


def blocks_per_program_for(blocks: int, device: torch.device) -> int:
    """How many consecutive blocks of a tensor each program takes, for a launch of
    ``blocks`` blocks: doubled, up to 8, while the launch keeps at least 16 programs an
    SM. Each program waits on two dependent table reads before its first load, and an
    Adam program on its step count's arrival (an atomic's round trip) before its first
    store; in a span those waits, the hyperparameters' reads and the bias corrections
    come once. On an H200 (run8) the guide MLP's Adam, 20M parameters in 9,800
    programs of one block, took 230 to 255 us, where a kernel streaming the same four
    arrays a block a program, reading no table and arriving nowhere, took 160 to 164
    (``bench/results/h200-2026-11-26/run8-at-c0225a0/adam/probe.json``); that those
    waits make the difference is what ``bench/sweep_optim.py``'s rows of 1 to 16
    blocks a program time. The guide's Adam gets 4 (2,448 programs on 132 SMs); a
    small model's, 1."""
    least = _LEAST_PROGRAMS_PER_SM * multiprocessors(device)
    per_program = 1
    while per_program < _MOST_BLOCKS_PER_PROGRAM and blocks // (2 * per_program) >= least:
        per_program *= 2
    return per_program


def tensor_table(
    lists: Sequence[Sequence[torch.Tensor]],
    block: int = BLOCK,
    *,
    every_tensor: bool = False,
    groups: bytes = b"",
    blocks_per_program: int | None = 1,
) -> Table:
    """The launch table for parallel ``lists`` of tensors, in blocks of ``block``
    elements, ``blocks_per_program`` of them a program (None: as many as
    ``blocks_per_program_for`` gives the launch). ``aligned[l]``: whether every tensor
    of list ``l`` starts on a 16-byte boundary (the caching allocator's blocks do; views
    at an offset may not), what the kernels' ``ALIGNED`` flag may promise.

    ``lists[l][t]`` is tensor ``t`` of list ``l``; the numels come from list 0.
    Zero-size tensors get no program, or, ``every_tensor``, one with no element in it
    (for kernels that also do something once per tensor: ``table_programs``).
    ``groups``: none, or one int64 per tensor (native byte order), the row after the
    lists'. The table lives on the tensors' device."""
    tensors = lists[0]
    device = tensors[0].device
    # An in-place op passes one list twice: each distinct list is read once (its
    # numels and addresses, in one pass: mpgemm.native), and ``which`` says which of
    # them each of ``lists`` is.
    distinct = {id(lst): lst for lst in lists}
    order = list(distinct)
    which = tuple(order.index(id(lst)) for lst in lists)
    facts = [list_facts(lst, PLAIN_TYPES) for lst in distinct.values()]
    if not all(f.plain for f in facts):
        raise TypeError(
            "tensor_table: the kernels take plain tensors only (no subclasses, negative "
            "views or zero tensors)"
        )

    def build():
        # Read here, once per table (the key holds the addresses): one launch reads one
        # device's memory, and a pointer into another's would fault on the GPU.
        if len(set().union(*(f.devices for f in facts))) > 1:
            _raise_devices(distinct.values())
        numels = array("q", facts[0].numels)
        addresses = [array("q", f.addresses) for f in facts]
        per_program = blocks_per_program
        if per_program is None:
            per_program = blocks_per_program_for(sum(cdiv(n, block) for n in numels), device)
        span = block * per_program
        least = 1 if every_tensor else 0
        programs = [max(cdiv(numel, span), least) for numel in numels]
        first_programs = list(itertools.accumulate(programs, initial=0))
        rows = array("q")
        for i in which:
            rows += addresses[i]
        rows.frombytes(groups)
        rows += numels
        rows += array("q", first_programs[:-1])
        # The per-program column, one entry per program (2,448 for the guide MLP's 20M
        # parameters), repeated in C: a Python list of them took 290 us a table.
        for index, count in enumerate(programs):
            rows += array("q", [index]) * count
        # 15 & address is nonzero off a 16-byte boundary. Read here, once per table:
        # the cache key holds the addresses.
        aligned = tuple(not any(map((15).__and__, addresses[i])) for i in which)
        table = _to_device(torch.frombuffer(rows, dtype=torch.int64), device)
        return Table(table, len(tensors), first_programs[-1], aligned, span)

    # What determines the table, as bytes (they hash and compare as one block of
    # memory, where a tuple of 600 Python ints took 20 us a lookup).
    known = b"".join(f.addresses for f in facts) + facts[0].numels
    key = (device, block, blocks_per_program, every_tensor, which, known, groups)
    return _cached(key, build)


def _raise_devices(lists: Iterable[Sequence[torch.Tensor]]) -> None:
    """ValueError naming the devices of tensors that one launch would read."""
    devices = sorted({str(t.device) for lst in lists for t in lst})
    raise ValueError(
        f"mpgemm: one launch's tensors are on {', '.join(devices)}; a kernel reads one "
        "device's memory (split the tensors by device)"
    )


def scalar_table(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """``values`` as an FP64 tensor on ``device``, cached by value.

    Kernels take their float hyperparameters from such a table, not as arguments: the
    interpreter passes a float argument through as a Python float, which triton's
    arithmetic then rounds to FP32, where torch computes these scalars in double."""
    key = (device, "fp64", *values)
    return _cached(key, lambda: _to_device(torch.tensor(values, dtype=torch.float64), device))


def cached_bytes() -> int:
    """The bytes of every table in the cache (each entry's tensor, or its first item)."""
    tables = (v if isinstance(v, torch.Tensor) else v[0] for v in _cache.values())
    return sum(t.numel() * t.element_size() for t in tables)


def _cached(key: tuple, build):
    # Least recently used out. The keys hold every tensor's address, so each lookup
    # hashes and compares them: taken out and put back, one entry is looked up twice.
    value = _cache.pop(key, None)
    if value is None:
        value = build()
        if len(_cache) >= _CACHE_SIZE:
            _cache.popitem(last=False)
    _cache[key] = value
    # A table a capture used (each key's first entry is its device) must outlive it
    # whatever the cache drops: the replays read it again. One made before the capture
    # (a hyperparameter table from the warm-up steps) is otherwise the allocator's once
    # dropped, and a replay would read what took its place.
    if graphs.capturing(key[0]):
        graphs.keep_for_replays((value,))
    return value


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # Pinned memory lets the copy run asynchronously: no wait for the GPU.
        if graphs.capturing(device):
            # Each replay copies from it again (a few KB), so it is kept. Memory set
            # aside before the capture where there is some (GraphedStep's): asking
            # torch's pinned allocator during a capture fails in some torch versions.
            pinned = graphs.staged_for_capture(host)
            if pinned is None:
                pinned = host.pin_memory()
            graphs.keep_for_replays((pinned,))
        else:
            pinned = host.pin_memory()
        return pinned.to(device, non_blocking=True)
    return host.to(device)


@triton.jit
def table_span(table_ptr, num_tensors, NUM_LISTS: tl.constexpr, span):
    """This program's span of elements: ``(tensor index, start, remaining)``. ``start``
    (int64) is the span's first element in its tensor, for ``table_pointer``;
    ``remaining`` (int32, at most ``span``), how many of the tensor's elements the span
    holds: 0 for a zero-size tensor's program (``every_tensor``)."""
    pid = tl.program_id(0)
    tensor = tl.load(table_ptr + (NUM_LISTS + 2) * num_tensors + pid)
    numel = tl.load(table_ptr + NUM_LISTS * num_tensors + tensor)
    first = tl.load(table_ptr + (NUM_LISTS + 1) * num_tensors + tensor)
    start = (pid - first) * span
    return tensor, start, tl.minimum(numel - start, span).to(tl.int32)


@triton.jit
def table_block(table_ptr, num_tensors, NUM_LISTS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's block, for a table of one block a program: ``(tensor index,
    start, offsets, mask, full)``. ``offsets`` (int32, ``arange(BLOCK)``) and ``mask``
    are relative to ``start`` (``table_span``'s), so that each element's index costs
    one 32-bit register whatever the tensor's size. ``full`` when the whole block lies
    inside the tensor, so that it can go unmasked."""
    tensor, start, remaining = table_span(table_ptr, num_tensors, NUM_LISTS, BLOCK)
    # Blocks start at multiples of BLOCK: with aligned bases, loads can be 16 bytes wide.
    start = tl.multiple_of(start, BLOCK)
    offsets = tl.arange(0, BLOCK)
    return tensor, start, offsets, offsets < remaining, remaining == BLOCK


@triton.jit
def table_programs(table_ptr, num_tensors, tensor, NUM_LISTS: tl.constexpr, span):
    """How many programs tensor ``tensor`` has, in a table made with ``every_tensor``."""
    numel = tl.load(table_ptr + NUM_LISTS * num_tensors + tensor)
    return tl.maximum(tl.cdiv(numel, span), 1)


@triton.jit
def table_address(table_ptr, num_tensors, tensor, list_index: tl.constexpr):
    """The address of tensor ``tensor`` of list ``list_index`` (int64)."""
    return tl.load(table_ptr + list_index * num_tensors + tensor)


@triton.jit
def table_pointer(
    table_ptr,
    num_tensors,
    tensor,
    start,
    list_index: tl.constexpr,
    DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """The address of element ``start`` of tensor ``tensor`` of list ``list_index``, as a
    ``DTYPE`` pointer; ``ALIGNED`` promises that the tensor's address is a multiple of 16
    bytes (``tensor_table``'s ``aligned``), and so is the span's (``start`` is a
    multiple of the span, which is of the block's 16 or more elements)."""
    address = table_address(table_ptr, num_tensors, tensor, list_index)
    pointer = address.to(tl.pointer_type(DTYPE), bitcast=True) + start
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def narrow_pointers(pointer, offsets, WIDE_DTYPE: tl.constexpr):
    """``pointer + offsets`` for a list whose dtype is narrower than the launch's widest
    stored list, ``WIDE_DTYPE`` (a 16-bit gradient or compute copy beside FP32
    parameters), each thread taking no more of it than 16 bytes of ``WIDE_DTYPE``.
    Triton gives every access of a block as many elements a thread as the widest
    16-byte access among them takes (8 of a 16-bit list) but a store at most 16 bytes
    (4 FP32), and changed the layout of every FP32 value stored through shared memory
    (8 KB and some 16 barriers a program; Adam writing a 16-bit copy took 100
    registers, 84 without them, sm_90a). At 4 a thread the narrow list's accesses are 8
    bytes wide, still whole 256-byte runs a warp."""
    return tl.max_contiguous(pointer + offsets, 128 // WIDE_DTYPE.primitive_bitwidth)


@triton.jit
def load_block(pointer, mask):
    """``pointer``'s block, masked (zeros outside) unless ``mask`` is None."""
    if mask is None:
        x = tl.load(pointer)
    else:
        x = tl.load(pointer, mask=mask, other=0.0)
    return x


@triton.jit
def load_part(pointer, offsets, rest):
    """``pointer``'s block (``offsets`` from its first element) where only its first
    ``rest`` elements are the tensor's, zeros past them: unmasked when all are, which
    lets the compiler vectorise the load (a span's whole blocks)."""
    # (tl.load itself: the interpreter pays for each jit function called)
    if rest >= offsets.shape[0]:
        x = tl.load(pointer)
    else:
        x = tl.load(pointer, mask=offsets < rest, other=0.0)
    return x


@triton.jit
def store_part(pointer, value, offsets, rest):
    """Store ``value`` into the first ``rest`` elements of ``pointer``'s block, as
    ``load_part`` reads them."""
    if rest >= offsets.shape[0]:
        tl.store(pointer, value)
    else:
        tl.store(pointer, value, mask=offsets < rest)
