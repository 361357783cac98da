"""A fused activation's backward in one launch over dZ, for ``ActivationFunction``
(``mpgemm.functional``): the derivative and the bias gradient.

    ReLU (S = y):           dZ = 0 where y <= 0, else dY        (threshold_backward's rule:
                                                                 a NaN y passes dY on)
    GELU, SiLU (S = z):     dZ = round(dY * act'(z))            (act'(z) and the product in
                                                                 FP32, rounded once:
                                                                 ROUND_DTYPE)
    P[c, n] = sum over the rows of chunk c of dZ[:, n], before its rounding (FP32)
    db[n]   = sum over the chunks c of P[c, n]                   (FP32, in a fixed order)

so the bias gradient is the same run to run. torch's ops take two passes over dZ, the
derivative and then a reduction that reads dZ again: 60 + 42 us for an 8192 x 4096
FP16 layer on the H100 (``bench/results/h100-2026-11-22/run5-at-4d25c67/prof``); here
dZ is written once and summed from registers. Each program walks a chunk of rows for
one block of columns; the last chunk of a column block to finish adds the chunks'
partials (``mpgemm.kernels.arrivals``), so no second launch sums them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpgemm.kernels.arrivals import add_partials, counters
from mpgemm.kernels.dependent_launch import wait_for_prior_grid
from mpgemm.kernels.gemm_common import (
    INTERPRET,
    activation_and_derivative,
    cdiv,
    multiprocessors,
    operands_aligned,
)
from mpgemm.kernels.launches import launch
from mpgemm.kernels.rounding import cast_rne, widen
from mpgemm.kernels.tensor_table import TRITON_DTYPES
from mpgemm.reference import dz_rounding

# Columns per program (a row of a block is 256 bytes of FP16: whole 16-byte loads) and
# rows per step of its loop; 4 warps hold an 8 KB block of each operand.
BLOCK_N = 128
BLOCK_M = 32
# Programs per SM to aim for: enough loads in flight to stream at memory bandwidth.
_PROGRAMS_PER_SM = 4
# Row steps in flight per program: triton's pipeliner issues the loads of the next
# stages - 1 steps (cp.async into shared memory: 16 KB a step of 16-bit operands)
# while a step is computed and stored. Without it (1: 989d877's loop) a program's
# next loads waited for its stores to issue, and run6's guide step streamed at 2.96 TB/s
# (the H100's at 76.6 us against torch's threshold_backward's 60.7). The counts compile
# without spills on sm_90a under Triton 3.6 and 3.9 (ReLU at 3 spilled 12 bytes under
# 3.6, at 80 registers; GELU at 4 would take 72 KB, three programs an SM where the
# launch asks for four). Aligned launches only: with scalar loads GELU's pipelined loop
# took 255 registers and spilled (Triton 3.9).
_STAGES = {"relu": 4, "gelu": 3, "gelu_tanh": 3, "silu": 3}
# Warps a program: GELU's and SiLU's act'(z) (an erf, or an exp and a division) on the
# block's 32 elements a thread of 4 warps took 167 registers pipelined and 255, spilling
# 72 bytes, unpipelined (unaligned) under triton 3.9; 8 warps hold 16 a thread.
_WARPS = {"relu": 4, "gelu": 8, "gelu_tanh": 8, "silu": 8}


@triton.jit
def _activation_backward_kernel(
    dy_ptr,
    s_ptr,
    dz_ptr,
    partial_ptr,
    bias_grad_ptr,
    counter_ptr,
    M,
    N,
    rows_per_program,
    stride_dym,
    stride_dyn,
    stride_sm,
    stride_sn,
    # "relu", "gelu", "gelu_tanh" or "silu"
    ACTIVATION: tl.constexpr,
    # GELU's and SiLU's rounding of the product, where coarser than dZ's dtype (which
    # then holds its value exactly): mpgemm.reference.dz_rounding; else None
    ROUND_DTYPE: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    # programmatic dependent launch (mpgemm.kernels.dependent_launch)
    PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    # 64-bit offsets: a layer's output may span more than 2**31 elements.
    cols64 = cols.to(tl.int64)
    chunk = tl.program_id(1)
    first = chunk * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    # Each row of the block keeps its own running sums, added across the rows once
    # after the loop: a reduction over the rows inside the loop crossed the warps
    # (shared memory and 8 barriers a step), holding every step's next loads back.
    sums = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for row in tl.range(first, last, BLOCK_M, num_stages=STAGES):
        rows = (row + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < last)[:, None] & mask_n[None, :]
        dy = tl.load(
            dy_ptr + rows[:, None] * stride_dym + cols64[None, :] * stride_dyn, mask=mask, other=0.0
        )
        s = tl.load(
            s_ptr + rows[:, None] * stride_sm + cols64[None, :] * stride_sn, mask=mask, other=0.0
        )
        if ACTIVATION == "relu":
            # Compared in FP32: the interpreter compares a BF16 as its raw bits.
            exact = tl.where(widen(s, INTERPRETED) <= 0, 0.0, widen(dy, INTERPRETED))
        else:
            # (IEEE divisions: a streaming kernel has the registers for them)
            _, derivative = activation_and_derivative(widen(s, INTERPRETED), ACTIVATION, True)
            exact = widen(dy, INTERPRETED) * derivative
        rounded = exact
        if ROUND_DTYPE is not None:
            rounded = widen(cast_rne(exact, ROUND_DTYPE, INTERPRETED), INTERPRETED)
        dz = cast_rne(rounded, dz_ptr.dtype.element_ty, INTERPRETED)
        tl.store(dz_ptr + rows[:, None] * N + cols64[None, :], dz, mask=mask)
        if BIAS_GRAD:
            sums += exact
    if BIAS_GRAD:
        tl.store(partial_ptr + chunk * N + cols, tl.sum(sums, axis=0), mask=mask_n)
        # The last chunk of the column block adds the chunks' partials, BLOCK_M at a time
        # (one step for up to BLOCK_M chunks).
        chunks = tl.num_programs(1)
        block = tl.program_id(0)
        add_partials(
            counter_ptr + block, chunks, partial_ptr, chunks, bias_grad_ptr, block * BLOCK_N, N,
            BLOCK_N, BLOCK_M,
        )  # fmt: skip


def triton_activation_backward(
    grad_y: torch.Tensor,
    saved: torch.Tensor,
    activation: str,
    compute_dtype: torch.dtype,
    *,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dZ, bias gradient or None), ``mpgemm.reference.activation_backward_ref``'s math.

    grad_y: (M, N) in y's dtype, any strides; saved: (M, N), any strides: y for "relu"
    (dY's dtype), z for "gelu", "gelu_tanh" and "silu" (as the forward stored it, in y's
    dtype, or any float dtype). dZ: (M, N), contiguous, in dY's
    dtype (exact for ReLU; GELU's and SiLU's rounded as ``dz_rounding`` says); the bias
    gradient: (N,), FP32."""
    M, N = grad_y.shape
    dz = torch.empty((M, N), device=grad_y.device, dtype=grad_y.dtype)
    rounding = dz_rounding(grad_y.dtype, compute_dtype)
    round_dtype = None if activation == "relu" or rounding == dz.dtype else TRITON_DTYPES[rounding]
    if M == 0 or N == 0:
        return dz, torch.zeros(N, device=grad_y.device) if bias_grad else None
    column_blocks = cdiv(N, BLOCK_N)
    # Chunks of rows, whole BLOCK_M steps each, enough for the programs to fill the GPU.
    wanted = cdiv(_PROGRAMS_PER_SM * multiprocessors(grad_y.device), column_blocks)
    rows_per_program = cdiv(cdiv(M, wanted), BLOCK_M) * BLOCK_M
    chunks = cdiv(M, rows_per_program)
    if bias_grad:
        partial = torch.empty((chunks, N), device=grad_y.device, dtype=torch.float32)
        grad_b = torch.empty(N, device=grad_y.device, dtype=torch.float32)
        counter = counters(grad_y.device, column_blocks)
    else:
        partial = grad_b = counter = dz  # placeholders, not read
    # (the strides the kernel walks, dZ's row stride N among them)
    strides = (*grad_y.stride(), *saved.stride(), N)
    stages = _STAGES[activation] if operands_aligned((grad_y, saved, dz), strides) else 1
    launch(
        _activation_backward_kernel,
        (column_blocks, chunks),
        grad_y,
        saved,
        dz,
        partial,
        grad_b,
        counter,
        M,
        N,
        rows_per_program,
        grad_y.stride(0),
        grad_y.stride(1),
        saved.stride(0),
        saved.stride(1),
        ACTIVATION=activation,
        ROUND_DTYPE=round_dtype,
        BIAS_GRAD=bias_grad,
        INTERPRETED=INTERPRET,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        STAGES=stages,
        num_warps=_WARPS[activation],
    )
    return (dz, grad_b) if bias_grad else (dz, None)
