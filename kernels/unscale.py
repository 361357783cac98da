"""Fused unscale and inf/NaN check over a list of gradients, in one launch.

    found_inf = 1.0   if any element of any src[t] is inf or NaN (else left as it was)
    dst[t]    = round(float(src[t]) * inv_scale)        for every t (unless check only)

the semantics of ``torch._amp_foreach_non_finite_check_and_unscale_`` (which is the
in-place case ``dst is src``), bit for bit: the product is taken in FP32 and rounded to
nearest even into ``dst``'s dtype, and the check looks at ``src`` before scaling.
``found_inf`` and ``inv_scale`` are FP32 tensors of one element on the device, so
nothing waits for the host. ``dst`` may differ from ``src`` in dtype: FP16 gradients
unscale straight into FP32 master gradients. Without ``dst`` writes, the kernel only
checks (a fused optimizer step unscales as it reads).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from mpgemm.kernels.dependent_launch import wait_for_prior_grid
from mpgemm.kernels.gemm_common import INTERPRET
from mpgemm.kernels.launches import launch
from mpgemm.kernels.rounding import cast_rne, widen
from mpgemm.kernels.tensor_table import (
    BLOCK,
    TRITON_DTYPES,
    load_block,
    narrow_pointers,
    table_block,
    table_pointer,
    tensor_table,
)


@triton.jit
def _unscale_block(
    src,
    dst,
    mask,
    found_inf_ptr,
    inv_scale_ptr,
    DST_DTYPE: tl.constexpr,
    WRITE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    x = widen(load_block(src, mask), INTERPRETED)
    non_finite = (x != x) | (tl.abs(x) == float("inf"))
    if tl.max(non_finite.to(tl.int32), axis=0) > 0:
        tl.store(found_inf_ptr, 1.0)
    if WRITE:
        y = x * tl.load(inv_scale_ptr)
        tl.store(dst, cast_rne(y, DST_DTYPE, INTERPRETED), mask=mask)


@triton.jit
def _unscale_kernel(
    # table of [src, dst] tensors (tensor_table) and its size
    table_ptr,
    num_tensors,
    # one-element FP32 tensors
    found_inf_ptr,
    inv_scale_ptr,
    # element types
    SRC_DTYPE: tl.constexpr,
    DST_DTYPE: tl.constexpr,
    # False: check only, nothing written
    WRITE: tl.constexpr,
    # every tensor starts on a 16-byte boundary
    ALIGNED: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK: tl.constexpr,
    # programmatic dependent launch (mpgemm.kernels.dependent_launch)
    PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    tensor, start, offsets, mask, full = table_block(table_ptr, num_tensors, 2, BLOCK)
    src = table_pointer(table_ptr, num_tensors, tensor, start, 0, SRC_DTYPE, ALIGNED)
    src = narrow_pointers(src, offsets, DST_DTYPE)
    dst = table_pointer(table_ptr, num_tensors, tensor, start, 1, DST_DTYPE, ALIGNED) + offsets
    # Whole blocks go unmasked, which lets the compiler vectorise their loads.
    if full:
        _unscale_block(src, dst, None, found_inf_ptr, inv_scale_ptr, DST_DTYPE, WRITE, INTERPRETED)
    else:
        _unscale_block(src, dst, mask, found_inf_ptr, inv_scale_ptr, DST_DTYPE, WRITE, INTERPRETED)


def triton_unscale_(
    src: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor | None,
    *,
    dst: Sequence[torch.Tensor] | None = None,
) -> None:
    """Check ``src`` for inf/NaN into ``found_inf`` and write ``src * inv_scale`` to
    ``dst`` (in place when ``dst`` is ``src``; nothing when ``inv_scale`` is None).

    ``src``: tensors of one dtype and device, each flat (``mpgemm.scaling.is_flat``);
    ``dst``: tensors of one dtype with ``src``'s shapes and strides. ``found_inf``,
    ``inv_scale``: FP32, one element, same device."""
    if not src:
        return
    write = inv_scale is not None
    dst = src if dst is None else dst
    lists = [src, dst]
    table, num_tensors, num_blocks, aligned, _ = tensor_table(lists)
    if num_blocks == 0:
        return
    launch(
        _unscale_kernel,
        (num_blocks,),
        table,
        num_tensors,
        found_inf,
        inv_scale if write else found_inf,
        SRC_DTYPE=TRITON_DTYPES[src[0].dtype],
        DST_DTYPE=TRITON_DTYPES[dst[0].dtype],
        WRITE=write,
        ALIGNED=all(aligned),
        INTERPRETED=INTERPRET,
        BLOCK=BLOCK,
        num_warps=8,
    )
