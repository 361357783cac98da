"""What both GEMM kernels share: the run mode, the flag encodings, the tile order, the
epilogue and the autotune key's size buckets (``mpgemm.kernels.gemm`` launches them).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from mpgemm.kernels.arrivals import add_partials
from mpgemm.kernels.rounding import cast_rne, saturated, widen

# The interpreter runs the kernels on the CPU through numpy; it must be chosen before
# triton is imported, so it is read once here.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Test-only: one config per launch, so the suite compiles each kernel once on a GPU
# instead of autotuning every shape it tries (``bench/gpu_check.sh tests``).
SINGLE_CONFIG = os.environ.get("MPGEMM_SINGLE_CONFIG", "0") == "1"

# An H100's SM count, for devices that have none to ask (the interpreter, recording).
_HOPPER_SMS = 132


@functools.lru_cache
def multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _HOPPER_SMS


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host (triton.cdiv is a constexpr function, slow to call)."""
    return -(-a // b)


# A launch of at most this many columns (a classifier head's 10 classes) may take tiles
# this wide (wgmma's N goes in steps of 8): the pointer kernel's product of at most
# this many rows runs as its transpose on them, and the TMA kernel's head forward.
NARROW_N = 16


def size_bucket(n: int) -> int:
    """A dimension's size as the autotune key sees it: the next power of two, so that a
    ragged last batch or a new batch size reuses a tuned config instead of timing every
    config again."""
    # Plain Python: triton's helpers are constexpr functions, several us a call.
    return 1 << (max(n, 1) - 1).bit_length()


def tile_configs(tiles, pre_hook=None) -> list[triton.Config]:
    """A config per (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) of ``tiles``, each with a
    group of 8 row-blocks for L2 reuse."""
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
            num_stages=stages,
            num_warps=warps,
            pre_hook=pre_hook,
        )
        for bm, bn, bk, stages, warps in tiles
    ]


def tile(config: triton.Config) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) of a config."""
    meta = config.kwargs
    return meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"], config.num_warps


def operands_aligned(tensors, strides) -> bool:
    """Whether the JIT will see every pointer 16-byte aligned and every stride 1 or a
    multiple of 16: the specialisation that vectorises loads and pipelines the loop
    (the GEMMs' ``ALIGNED``; the activation backward's pipelined loop)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors) and all(
        s == 1 or s % 16 == 0 for s in strides
    )


@triton.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a tile in grouped order: GROUP_M row-blocks share their B
    column-blocks while in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def gelu_and_derivative(z):
    """Exact (erf) GELU, as torch.nn.functional.gelu(approximate="none"), and its
    derivative, sharing the erf: gelu(z) = z Phi(z), gelu'(z) = Phi(z) + z phi(z)."""
    cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
    pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
    return z * cdf, cdf + z * pdf


@triton.jit
def _divide(x, y, IEEE: tl.constexpr):
    """x / y: IEEE's round to nearest, or the GPU's approximate division (2 ulp)."""
    if IEEE:
        return tl.div_rn(x, y)
    else:
        return x / y


@triton.jit
def gelu_tanh_and_derivative(z, IEEE: tl.constexpr):
    """GELU's tanh approximation, as torch.nn.functional.gelu(approximate="tanh"),
    0.5 z (1 + t) with t = tanh(u), u = sqrt(2 / pi) (z + 0.044715 z^3), and its
    derivative, by torch's formulas, so that inf and NaN come out where torch's do
    (gelu(-inf) and gelu'(+-inf) are NaN). 1 + t and 1 - t^2 are taken from
    e = exp(-2 |u|), without a cancellation: 1 + t = 2 / (1 + e) where u >= 0, else
    2 e / (1 + e), and 1 - t^2 = 4 e / (1 + e)^2. From t itself, 1 - t^2 lost 1 - t's
    relative accuracy as t nears 1: the derivative had twice torch's error against
    FP64, and has a sixth of it so (interpreted, z in [-12, 12]). ``IEEE``: the
    division rounded to nearest (``_divide``)."""
    z_sq = z * z
    u = 0.7978845608028654 * (z + 0.044715 * z_sq * z)
    e = tl.exp(-2.0 * tl.abs(u))
    inv = _divide(1.0, 1.0 + e, IEEE)
    right = tl.where(u >= 0.0, 2.0 * inv, 2.0 * e * inv)
    slope = 4.0 * e * inv * inv * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z_sq)
    return 0.5 * z * right, 0.5 * right + 0.5 * z * slope


@triton.jit
def silu_and_derivative(z, IEEE: tl.constexpr):
    """SiLU, as torch.nn.functional.silu, z s with s = 1 / (1 + exp(-z)), and its
    derivative s (1 + z (1 - s)), as torch's: inf and NaN come out where torch's do
    (silu(-inf) and silu'(+-inf) are NaN). The division: with ``IEEE`` rounded to
    nearest (the activation's backward), else the GPU's approximate one (2 ulp of FP32,
    as GELU's exp and erf are approximate too: far below the output's 16-bit rounding;
    IEEE divisions made the GEMMs' epilogues spill 80 to 264 bytes under triton 3.9)."""
    s = _divide(1.0, 1.0 + tl.exp(-z), IEEE)
    return z * s, s * (1.0 + z * (1.0 - s))


@triton.jit
def activation_and_derivative(z, ACTIVATION: tl.constexpr, IEEE: tl.constexpr = False):
    """act(z) and act'(z) for the activations whose backward takes act'(z) from the
    stored z (ReLU's reads its output): "gelu", "gelu_tanh", "silu". The forward
    epilogue takes act(z), the activation's backward act'(z) (``mpgemm.kernels.activation``),
    with IEEE divisions (``IEEE``)."""
    if ACTIVATION == "gelu":
        return gelu_and_derivative(z)
    elif ACTIVATION == "gelu_tanh":
        return gelu_tanh_and_derivative(z, IEEE)
    else:
        return silu_and_derivative(z, IEEE)


@triton.jit
def store_epilogue(
    acc,
    offs_m,
    offs_n,
    M,
    N,
    c_ptr,
    bias_ptr,
    g_ptr,
    stride_cm,
    stride_cn,
    stride_gm,
    stride_gn,
    stride_bias,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    RELU_GRAD: tl.constexpr = False,
):
    """C[offs_m, offs_n] = act(acc + bias), rounded once to C's dtype, and, when
    STORE_PREACT, G = the pre-activation acc + bias rounded to G's dtype (C's: what
    GELU's and SiLU's backward takes act'(z) from, as torch's keep their input; finite
    values beyond its range clamped to its largest, ``saturated``); done while the
    accumulator is still FP32.
    RELU_GRAD: C is the gradient at a ReLU's input and G (read, not written) the ReLU's
    output y: C = 0 where y <= 0, else acc (threshold_backward's rule: a NaN y passes
    the gradient on), the same bits as rounding acc first and masking after (a zero
    rounds to itself). Returns the tile as stored, in C's dtype (with RELU_GRAD, zeros
    outside C)."""
    # 64-bit row/column offsets: an output may span more than 2**31 elements.
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    mask_n = offs_n < N
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_bias, mask=mask_n, other=0.0)
        acc += widen(bias, INTERPRETED)[None, :]
    if ACTIVATION == "relu":
        # torch.relu's: NaN stays NaN (never hidden from the inf/NaN check), -0.0 stays.
        acc = tl.where(acc < 0.0, 0.0, acc)
    elif ACTIVATION is not None:  # the others keep z for their backward
        if STORE_PREACT:
            g_ptrs = g_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn
            g_type = g_ptr.dtype.element_ty
            tl.store(g_ptrs, cast_rne(saturated(acc, g_type), g_type, INTERPRETED), mask=mask)
        acc, _ = activation_and_derivative(acc, ACTIVATION)
    if RELU_GRAD:
        g_ptrs = g_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn
        y = tl.load(g_ptrs, mask=mask, other=0.0)  # outside C: zeros, for the column sums
        # Compared in FP32: the interpreter compares a BF16 as its raw bits.
        acc = tl.where(widen(y, INTERPRETED) <= 0.0, 0.0, acc)
    stored = cast_rne(acc, c_ptr.dtype.element_ty, INTERPRETED)
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, stored, mask=mask)
    return stored


# Rows of C that each row of its column sums' partials sums (``store_column_partial``):
# a divisor of every tile's BLOCK_M, so that the partials are laid out alike whatever
# tile the autotuner picks, and the host adds them without knowing it.
COLUMN_SUM_ROWS = 32


@triton.jit
def store_column_partial(
    stored,
    off_m,
    offs_n,
    M,
    N,
    p_ptr,
    BLOCK_M: tl.constexpr,
    SUM_ROWS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The tile's part of C's column sums' FP32 partials, P (cdiv(M, SUM_ROWS), N):
    P[i, n] is the sum of C[i * SUM_ROWS + r, n] as stored over the r below SUM_ROWS
    (``store_epilogue``'s result: zeros outside C). SUM_ROWS is COLUMN_SUM_ROWS, given
    by the launch (a global the kernel read would be compiled in for good: triton's JIT
    refuses to run a binary whose globals have changed since)."""
    groups: tl.constexpr = BLOCK_M // SUM_ROWS
    width: tl.constexpr = stored.shape[1]
    values = tl.reshape(widen(stored, INTERPRETED), (groups, SUM_ROWS, width))
    sums = tl.sum(values, axis=1)
    rows = off_m // SUM_ROWS + tl.arange(0, groups)
    mask = (rows < tl.cdiv(M, SUM_ROWS))[:, None] & (offs_n < N)[None, :]
    tl.store(p_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :], sums, mask=mask)


@triton.jit
def finish_column_sums(
    off_n,
    N,
    pid_n,
    num_pid_m,
    M,
    p_ptr,
    r_ptr,
    counter_ptr,
    BLOCK_N: tl.constexpr,
    SUM_ROWS: tl.constexpr,
):
    """After a tile's ``store_column_partial``s: the last of the num_pid_m tiles of column
    block pid_n to arrive adds the partials of its columns, in row order, into
    R[off_n:off_n + BLOCK_N], C's FP32 column sums (the same bits run to run), so that
    no second launch sums them (``arrivals.add_partials``)."""
    parts = tl.cdiv(M, SUM_ROWS)
    add_partials(counter_ptr + pid_n, num_pid_m, p_ptr, parts, r_ptr, off_n, N, BLOCK_N, 8)


@triton.jit
def dot_rounded(a, b, acc, compute_dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``acc + round(a) @ round(b)``: the operands rounded to the compute dtype (nothing
    to do for one already in it), the product accumulated in FP32 on the Tensor Cores."""
    a = cast_rne(a, compute_dtype, INTERPRETED)
    b = cast_rne(b, compute_dtype, INTERPRETED)
    if INTERPRETED:
        # The interpreter multiplies BF16 as raw 16-bit integers; widening the rounded
        # operands to FP32 is exact, so the numerics stay 16-bit-operand/FP32-accumulate.
        acc = tl.dot(widen(a, INTERPRETED), widen(b, INTERPRETED), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
