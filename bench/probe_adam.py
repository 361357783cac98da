"""Where the fused Adam step's DRAM time goes, for issue 11's gap: on the H200 the guide
MLP's step (20M FP32 parameters, FP16 copies of the weights) ran at 56% of DRAM
bandwidth (``ncu``, run7), and at the same speed whatever the launch shape, from 8 to
32 warps an SM (``bench/sweep_optim.py``): not the latency one program waits out, then,
but something all of them share. Two suspects, each measured on the GPU's clock with L2
flushed (``harness.median_us``):

1. The access pattern itself: ``stream L/L`` rows read L FP32 arrays of the guide's
   size and write each back (in place, as an optimizer step updates its state), with
   one add an element: 1/1, 3/3 (SGD with momentum) and 4/4 (Adam). What a kernel
   with no math of its own reaches is Adam's ceiling.
2. Where the arrays lie: the allocator starts every large tensor on a 2 MiB boundary,
   so element i of p, g, m and v share their low 21 address bits, and a program's
   four streams may meet in one DRAM bank. Each row runs on the allocator's tensors
   (``allocator``) and on views of one buffer per list, list l starting l x S bytes in
   (``carved +S``; +0 keeps the allocator's alignment, so that carving alone is told
   apart from the stagger). Adam's rows (``mpgemm adam``: ``mpgemm.scaling.adam_step_``
   as the guide step launches it, copies written, no loss scale; ``torch fused adam``)
   must write the same bits on every placement.

    python3 bench/probe_adam.py [OUT.json]        # on a GPU
    python3 bench/probe_adam.py --smoke           # tiny shapes, wall clock, any machine
    python3 bench/probe_adam.py --ncu             # three Adam steps, then a 4/4 stream: for ncu

Each row: the placement, the bytes each list's largest tensor lies past a 2 MiB
boundary (``offsets``), microseconds and GB/s.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from harness import DEVICE, median_us, synchronize, write_rows
from sweep_optim import GUIDE, SMOKE, _ours, _state, _torch_fused

# The lists an Adam step streams.
LISTS = ("params", "grads", "exp_avgs", "exp_avg_sqs", "copies")
# Byte offsets of list l's start: l x S.
STAGGERS = (0, 4352, 2**20 + 4352)
# Elements a program streams (Adam's default): whole blocks, so that every load is
# 16 bytes wide.
BLOCK = 2048
# Tensors carved from one buffer start on 256-byte boundaries, as the allocator's do.
_ALIGN_BYTES = 256
_TWO_MIB = 2**21


@triton.jit
def _stream_kernel(a_ptr, b_ptr, c_ptr, d_ptr, LISTS: tl.constexpr, BLOCK: tl.constexpr):
    """Read block ``program_id`` of the first ``LISTS`` of four FP32 arrays, every load
    before any store (as Adam's), and write the block's sum over them back to each."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    total = tl.load(a_ptr + offsets)
    if LISTS > 1:
        total += tl.load(b_ptr + offsets)
    if LISTS > 2:
        total += tl.load(c_ptr + offsets)
    if LISTS > 3:
        total += tl.load(d_ptr + offsets)
    tl.store(a_ptr + offsets, total)
    if LISTS > 1:
        tl.store(b_ptr + offsets, total)
    if LISTS > 2:
        tl.store(c_ptr + offsets, total)
    if LISTS > 3:
        tl.store(d_ptr + offsets, total)


def stream(arrays: list[torch.Tensor], lists: int) -> None:
    """``_stream_kernel`` over the first ``lists`` of four flat arrays, whose length is a
    multiple of BLOCK."""
    _stream_kernel[(arrays[0].numel() // BLOCK,)](*arrays, LISTS=lists, BLOCK=BLOCK, num_warps=8)


def carve(tensors: list[torch.Tensor], stagger: int) -> list[torch.Tensor]:
    """Copies of ``tensors`` (one dtype) as views of one buffer, one after another, each
    start on a 256-byte boundary, the first ``stagger`` bytes in."""
    size = tensors[0].element_size()
    align = _ALIGN_BYTES // size
    lengths = [-(-t.numel() // align) * align for t in tensors]
    starts = list(itertools.accumulate(lengths, initial=stagger // size))
    buffer = torch.empty(starts[-1], dtype=tensors[0].dtype, device=tensors[0].device)
    return [
        buffer[start : start + t.numel()].view(t.shape).copy_(t)
        for start, t in zip(starts, tensors, strict=False)
    ]


def _arranged(tensors: list[torch.Tensor], stagger: int | None, index: int) -> list:
    """Copies of ``tensors``: the allocator's (``stagger`` None), or carved, ``index x
    stagger`` bytes into their buffer."""
    if stagger is None:
        return [t.clone() for t in tensors]
    return carve(tensors, index * stagger)


def placed(state: dict, stagger: int | None) -> dict:
    """``state``'s lists as they are (``stagger`` None: the allocator's) or carved, list
    l ``l x stagger`` bytes into its buffer; a bias stays its own copy."""
    names = LISTS[:-1]
    fresh = {name: _arranged(state[name], stagger, i) for i, name in enumerate(names)}
    own = [c.dtype != p.dtype for c, p in zip(state["copies"], state["params"], strict=True)]
    copies = [c for c, kept in zip(state["copies"], own, strict=True) if kept]
    it = iter(_arranged(copies, stagger, len(names)))
    fresh["copies"] = [
        next(it) if kept else p for kept, p in zip(own, fresh["params"], strict=True)
    ]
    fresh["steps"] = [s.clone() for s in state["steps"]]
    return fresh


def offsets(tensors: list[torch.Tensor]) -> list[int]:
    """How many bytes past a 2 MiB boundary each tensor starts."""
    return [t.data_ptr() % _TWO_MIB for t in tensors]


def _adam(state: dict, found_inf: torch.Tensor) -> None:
    """The guide step's launch: copies written, the flag read, no loss scale."""
    _ours("adam", state, None, found_inf)


def _torch_adam(state: dict) -> Callable[[], object]:
    """torch's fused Adam over ``state``'s tensors (``sweep_optim._torch_fused``), its own
    state ``state``'s moments and step counts (else it would allocate its moments
    itself)."""
    adam = _torch_fused("adam", state, None, None)
    for i, p in enumerate(adam.param_groups[0]["params"]):
        adam.state[p] = dict(
            step=state["steps"][i], exp_avg=state["exp_avgs"][i], exp_avg_sq=state["exp_avg_sqs"][i]
        )
    return adam.step


def _stepper(impl: str, state: dict, found_inf: torch.Tensor) -> Callable[[], object]:
    if impl == "mpgemm adam":
        return functools.partial(_adam, state, found_inf)
    return _torch_adam(state)


def main(argv: list[str]) -> int:
    smoke = "--smoke" in argv
    out = next((a for a in argv if not a.startswith("--")), None)
    shapes, calls = (SMOKE, 3) if smoke else (GUIDE, 30)
    state = _state(shapes)  # (gradients as scaled: no matter, none is unscaled here)
    found_inf = torch.zeros((), device=DEVICE)
    numel = sum(t.numel() for t in state["params"])
    copied = sum(
        c.numel() for c, p in zip(state["copies"], state["params"], strict=True) if c is not p
    )
    length = -(-numel // BLOCK) * BLOCK
    if "--ncu" in argv:
        for _ in range(3):
            _adam(placed(state, None), found_inf)
        stream([torch.ones(length, device=DEVICE) for _ in range(4)], 4)
        synchronize()
        return 0
    placements = [("allocator", None)] + [(f"carved +{s}", s) for s in STAGGERS]
    rows, ok = [], True
    expected: dict[str, dict] = {}
    for name, stagger in placements:
        arrays = [torch.ones(length, device=DEVICE) for _ in range(4)]
        if stagger is not None:
            arrays = [carve([a], i * stagger)[0] for i, a in enumerate(arrays)]
        for lists in (1, 3, 4):
            us = median_us(functools.partial(stream, arrays, lists), calls)
            nbytes = length * 4 * 2 * lists
            rows.append(
                dict(
                    impl=f"stream {lists}/{lists}",
                    placement=name,
                    offsets=offsets(arrays[:lists]),
                    us=us,
                    gb_per_s=nbytes / us / 1e3,
                )
            )
        # Adam moves p, g, m and v in, p, m and v out, and writes the copies (torch's
        # writes none).
        for impl in ("mpgemm adam", "torch fused adam"):
            once, work = placed(state, stagger), placed(state, stagger)
            _stepper(impl, once, found_inf)()
            want = expected.setdefault(impl, once)
            same = all(
                torch.equal(a, b)
                for k in ("params", "exp_avgs", "exp_avg_sqs", "copies", "steps")
                for a, b in zip(once[k], want[k], strict=True)
            )
            ok = ok and same
            us = median_us(_stepper(impl, work, found_inf), calls)
            nbytes = numel * 4 * 7 + (copied * 2 if impl == "mpgemm adam" else 0)
            rows.append(
                dict(
                    impl=impl,
                    placement=name,
                    offsets=offsets([max(once[k], key=torch.Tensor.numel) for k in LISTS]),
                    us=us,
                    gb_per_s=nbytes / us / 1e3,
                    same_bits_as_allocator=same,
                )
            )
    write_rows(rows, out, elements=numel)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
