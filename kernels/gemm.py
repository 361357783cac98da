"""Mixed-precision GEMM: FP16/BF16 operands on the Tensor Cores, FP32 accumulation.

``triton_gemm`` serves the forward pass and both backward GEMMs of a linear layer, and
``matmul``'s batches of products, with one of two kernels of the same math: the TMA
persistent kernel (``mpgemm.kernels.gemm_tma``) for every launch whose A and B are
already 16-bit, 16-byte aligned and unsplit (a training step's GEMMs: weight copies,
rounded inputs, 16-bit activations), and the pointer kernel here for the rest (FP32 or
unaligned operands, split K). ``use_kernel`` forces one, for tests and benchmarks.

    C   = act(round(A) @ round(B) + bias)    round() = to the compute dtype
    G   = round(A) @ round(B) + bias          (optional, GELU and SiLU, in C's dtype: z, from
                                              which their backward takes act'(z))
    R   = sum_k A[:, k]                      (optional, FP32: the bias gradient)

or, for the input gradient at a ReLU's input (``relu_output`` y, the ReLU's output; C
being the gradient at y, its next layer's dX: ``functional._fusable_relu``):

    C   = 0 where y <= 0, else round(A) @ round(B)   (threshold_backward's rule)
    R   = sum_m C[m, :]                      (optional, FP32: the ReLU's bias gradient,
                                              partials per 32 rows, added by the last
                                              tile of each column to finish)

Operands may arrive as FP32 (master weights, a first layer's input), FP16 or BF16
and are rounded to the compute dtype in registers, so no cast kernel runs; but a large
product's FP32 operands are rounded by a cast beforehand, so that the TMA kernel runs
it (``ROUND_FP32_FLOPS``: in registers, such products ran at half of autocast's speed).
Every operand is addressed through its strides: a transposed view needs no copy.

A product of at most 16 rows and more columns (a classifier head's weight gradient: 10
classes by 4096 features) runs in the pointer kernel as C.T = B.T @ A.T on tiles 16
columns wide (``NARROW_N``): its tiles are at least 64 rows high (wgmma's M), so unswapped
all but 10 rows of each A tile would be padding. R is then B's column sums (``K_SUMS``).

Split-K: a launch with no epilogue (the backward GEMMs) whose tile grid would leave
most SMs idle splits K over ``split_k_for`` programs per tile; each writes its FP32
partial C (and sums), and ``_split_k_reduce_kernel`` adds them in split order and
rounds once, so the result is the same run to run.

Replays: every decision above, and every integer a launch passes, is a function of the
call's signature (``_signature``: shapes, strides, dtypes, alignment, epilogue), which
an eager training step repeats step after step. Once a signature's launches have run a
cached binary, later calls of it repeat them with their own tensors (``_Replay``,
``launches.relaunch``), skipping the decisions and the launch key: host time is what
an eager step on an H100 waits for.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mpgemm.kernels import gemm_tma, native_launch
from mpgemm.kernels.arrivals import counters
from mpgemm.kernels.dependent_launch import wait_for_prior_grid
from mpgemm.kernels.gemm_common import (
    COLUMN_SUM_ROWS,
    INTERPRET,
    NARROW_N,
    SINGLE_CONFIG,
    cdiv,
    dot_rounded,
    finish_column_sums,
    grouped_tile,
    multiprocessors,
    operands_aligned,
    size_bucket,
    store_column_partial,
    store_epilogue,
    tile,
    tile_configs,
)
from mpgemm.kernels.launches import (
    Launched,
    current,
    hooks_set,
    intercepting,
    launch,
    native_relaunch,
    relaunch,
    sources_of,
)
from mpgemm.kernels.rounding import cast_rne, widen


def _hopper_configs() -> list[triton.Config]:
    """Tiles for an H100; small tiles serve skinny problems such as a batch of 128
    rows. ``fits_registers`` says which each launch may use. Every (launch, config) the
    autotuner can pick compiles with wgmma and no register spills under Triton 3.6 and
    3.9 (``mpgemm.kernels.aot``); 128x256x64 (spills 624 bytes on a plain FP16 GEMM
    under 3.6) and 256x128x32 (spills with FP32 operands) were dropped for that
    reason."""
    tiles = [
        # BLOCK_M, BLOCK_N, BLOCK_K, stages, warps
        (128, 256, 32, 3, 8),
        (128, 128, 64, 4, 8),
        (128, 128, 32, 4, 8),
        (64, 256, 64, 3, 8),
        (128, 64, 64, 4, 8),
        (64, 128, 64, 4, 8),
        (128, 64, 32, 4, 4),
        (64, 64, 64, 4, 4),
        # for unaligned operands only (fits_registers)
        (128, 64, 32, 3, 8),
        (64, 128, 32, 3, 8),
        # for at most NARROW_N columns only
        (128, 16, 64, 4, 4),
        (64, 16, 64, 4, 4),
    ]
    return tile_configs(tiles)


def _single_config() -> list[triton.Config]:
    # One tile for every aligned launch kind, one for every unaligned one and one for
    # the narrow ones (``fits_registers``): pruning leaves each launch one, so none is
    # timed.
    return [
        config
        for config in _hopper_configs()
        if tile(config) in {(128, 128, 32, 8), (64, 128, 32, 8), (128, 16, 64, 4)}
    ]


def _interpreter_configs() -> list[triton.Config]:
    # Autotuning times each config on a GPU; the interpreter has none, so one config.
    return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4})]


# (BLOCK_M, BLOCK_N, BLOCK_K, warps) of the tiles that leave registers for sums over K
# (the summed operand passes through registers): the others spilled under Triton 3.6.
_SUMS_TILES = {(128, 128, 32, 8), (64, 128, 64, 8)}
# The tiles for unaligned operands: scalar loads and their 64-bit addresses take
# registers, and every other tile spills in some launch kind under Triton 3.9 (even
# 64x64x32 with 4 warps, with row sums). They serve unaligned launches
# only, so that aligned ones compile no more configs than before.
_UNALIGNED_TILES = {(128, 64, 32, 8), (64, 128, 32, 8)}
# A launch of at most NARROW_N columns takes tiles that wide, aligned or not; only such
# launches take them. (64x16x128 spilled with unaligned operands under Triton 3.6.)
_NARROW_TILES = {(128, 16, 64, 4), (64, 16, 64, 4)}


def fits_registers(
    config: triton.Config,
    *,
    store_preact: bool,
    k_sums: str | None,
    relu_grad: bool,
    aligned: bool,
    narrow: bool,
) -> bool:
    """Whether ``config`` suits such a launch on Hopper and compiles without register
    spills for it.

    A launch of at most ``NARROW_N`` columns (``narrow``) takes the narrow tiles, and
    only it does. Unaligned operands (``operands_aligned``) get their own tiles.
    Aligned launches with sums over K get the tiles that leave room for them; storing
    GELU's or SiLU's pre-activation beside the output is held to an accumulator of fewer
    than 128 registers per thread (the activation's erf or exp over more spilled: 56 to
    400 bytes for the TMA kernel's 128x256 and 64x256 tiles under 3.9), and reading a
    ReLU's output to mask the product by (``relu_grad``) is held to the same (128x256x32
    took 254 registers with it under 3.6 and 3.9: at the edge).
    Measured with ``python -m mpgemm.kernels.aot``, which compiles every
    launch kind aligned and unaligned."""
    shape = tile(config)
    if narrow or shape in _NARROW_TILES:
        return narrow and shape in _NARROW_TILES
    if not aligned or shape in _UNALIGNED_TILES:
        return not aligned and shape in _UNALIGNED_TILES
    if k_sums:
        return shape in _SUMS_TILES
    if store_preact or relu_grad:
        return shape[0] * shape[1] // (32 * shape[3]) < 128
    return True


# The launch flags fits_registers decides by, as the kernel names them, and the width it
# reads from the autotune key (``narrow``).
_PRUNE_FLAGS = ("STORE_PREACT", "K_SUMS", "RELU_GRAD", "ALIGNED")
_PRUNE_ARGS = ("N_BUCKET",)


def _prune_configs(configs, named_args, **kwargs):
    flags = {name.lower(): kwargs[name] for name in _PRUNE_FLAGS}
    narrow = named_args["N_BUCKET"] <= NARROW_N
    return [config for config in configs if fits_registers(config, narrow=narrow, **flags)]


# The configs a GPU autotunes over, and those this process does.
GPU_CONFIGS = _single_config() if SINGLE_CONFIG else _hopper_configs()
CONFIGS = _interpreter_configs() if INTERPRET else GPU_CONFIGS


# The size buckets are read by the autotuner only; specialising the binary on them would
# compile a new one per bucket.
@triton.jit(do_not_specialize=["M_BUCKET", "N_BUCKET", "K_BUCKET"])
def _gemm_kernel(
    # operands and outputs
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    g_ptr,
    r_ptr,
    p_ptr,
    counter_ptr,
    # problem size: A is (M, K), B is (K, N), C is (M, N)
    M,
    N,
    K,
    # the autotune key's sizes (size_bucket)
    M_BUCKET,
    N_BUCKET,
    K_BUCKET,
    # strides, in elements
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_gm,
    stride_gn,
    stride_bias,
    # what to compute
    COMPUTE_BF16: tl.constexpr,
    INTERPRETED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    # R: None, or the FP32 sums over K of "a" (A's rows: R is (M,)) or of "b" (B's
    # columns: R is (N,))
    K_SUMS: tl.constexpr,
    # C is the gradient at a ReLU's input, G the ReLU's output (store_epilogue)
    RELU_GRAD: tl.constexpr,
    # R is C's FP32 column sums, (N,): the tiles' partials in P, (cdiv(M,
    # COLUMN_SUM_ROWS), N) FP32 (store_column_partial), added by the last tile of each
    # column block to arrive on its counter (finish_column_sums; arrivals.counters)
    C_SUMS: tl.constexpr,
    # COLUMN_SUM_ROWS: the rows of C a row of P sums
    SUM_ROWS: tl.constexpr,
    # operands_aligned(): the JIT specialises on alignment anyway; as an argument it
    # lets the autotune key and pruning see it too
    ALIGNED: tl.constexpr,
    # programs per tile along K (split_k_for); above 1, C and R are FP32 partials,
    # (SPLIT_K, M, N) and (SPLIT_K, R's length), and there is no epilogue
    SPLIT_K: tl.constexpr,
    # tiling
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    # A batch of products (``matmul`` of batched operands: no sums, no epilogue, no
    # split of K), program_id(2) the batch index, given by keyword by batched launches
    # only (the defaults are one product, so that unbatched launches compile, and are
    # keyed on the host, as they would without a batch): the batch strides of
    # A, B and C in elements, 0 for an operand broadcast over the batch.
    stride_ab=0,
    stride_bb=0,
    stride_cb=0,
    BATCHED: tl.constexpr = False,
    # A batch over two dimensions whose strides do not merge into one (OUTER): product
    # p is at (p // INNER) * stride_*o + (p % INNER) * stride_*b, INNER products to
    # each outer index.
    INNER=1,
    stride_ao=0,
    stride_bo=0,
    stride_co=0,
    OUTER: tl.constexpr = False,
    # C is the sum of PRODUCTS products (the gradient of an operand broadcast over the
    # batch, ``_sum_batched``; no sums, no epilogue, no split of K, not BATCHED):
    # program_id(1) sums the PER_SPLIT products of its part (fewer at the batch's end)
    # into C's part program_id(1), stride_cb apart (FP32 partials where the batch is
    # split, or each outer index's sum: the kept batch dimensions). Products are
    # addressed as OUTER's are (one outer index, outer strides 0, where the whole
    # batch is summed).
    PER_SPLIT=1,
    PRODUCTS=1,
    SUM_BATCH: tl.constexpr = False,
    # programmatic dependent launch (mpgemm.kernels.dependent_launch)
    PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    if BATCHED:
        pid_b = tl.program_id(2).to(tl.int64)
        if OUTER:
            outer = pid_b // INNER
            pid_b -= outer * INNER
            a_ptr += outer * stride_ao
            b_ptr += outer * stride_bo
            c_ptr += outer * stride_co
        a_ptr += pid_b * stride_ab
        b_ptr += pid_b * stride_bb
        c_ptr += pid_b * stride_cb
    # N == 0 still gets one column of programs when A's row sums are wanted.
    pid_m, pid_n = grouped_tile(
        tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.maximum(tl.cdiv(N, BLOCK_N), 1), GROUP_M
    )

    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        # This program's share of K, in whole BLOCK_K steps (the last split takes the
        # rest), and its own partial C and R.
        pid_k = tl.program_id(1)
        k_share = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_share
        k_hi = tl.minimum(K, k_lo + k_share)
        c_ptr += pid_k.to(tl.int64) * M * N
        if K_SUMS == "b":
            r_ptr += pid_k.to(tl.int64) * N
        else:
            r_ptr += pid_k.to(tl.int64) * M

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # 64-bit row/column offsets: an operand may span more than 2**31 elements.
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    ks = k_lo + offs_k
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn

    compute_dtype = tl.bfloat16 if COMPUTE_BF16 else tl.float16
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if K_SUMS == "b":
        sums = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        sums = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if SUM_BATCH:
        part = tl.program_id(1)
        acc = _summed_products(
            acc,
            a_ptr + rows[:, None] * stride_am,
            b_ptr + cols[None, :] * stride_bn,
            mask_m,
            mask_n,
            K,
            stride_ak,
            stride_bk,
            stride_ab,
            stride_bb,
            INNER,
            stride_ao,
            stride_bo,
            part * PER_SPLIT,
            tl.minimum(PER_SPLIT, PRODUCTS - part * PER_SPLIT),
            compute_dtype,
            INTERPRETED,
            BLOCK_K,
        )
        c_ptr += part.to(tl.int64) * stride_cb
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            mask_k = offs_k < k_hi - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            # Only the first column of programs owns A's row sums, the first row B's
            # column sums (from the operand as loaded, before its rounding).
            if K_SUMS == "a":
                if pid_n == 0:
                    sums += tl.sum(widen(a, INTERPRETED), axis=1)
            elif K_SUMS == "b":
                if pid_m == 0:
                    sums += tl.sum(widen(b, INTERPRETED), axis=0)
            acc = dot_rounded(a, b, acc, compute_dtype, INTERPRETED)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

    stored = store_epilogue(
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
        HAS_BIAS,
        ACTIVATION,
        STORE_PREACT,
        INTERPRETED,
        RELU_GRAD,
    )
    if C_SUMS:
        store_column_partial(
            stored, pid_m * BLOCK_M, offs_n, M, N, p_ptr, BLOCK_M, SUM_ROWS, INTERPRETED
        )
        finish_column_sums(
            pid_n * BLOCK_N,
            N,
            pid_n,
            tl.cdiv(M, BLOCK_M),
            M,
            p_ptr,
            r_ptr,
            counter_ptr,
            BLOCK_N,
            SUM_ROWS,
        )
    if K_SUMS == "a":
        if pid_n == 0:
            tl.store(r_ptr + rows, sums, mask=mask_m)
    elif K_SUMS == "b":
        if pid_m == 0:
            tl.store(r_ptr + cols, sums, mask=mask_n)


@triton.jit
def _summed_products(
    acc,
    a_rows,
    b_cols,
    mask_m,
    mask_n,
    K,
    stride_ak,
    stride_bk,
    stride_ab,
    stride_bb,
    inner,
    stride_ao,
    stride_bo,
    first,
    count,
    compute_dtype: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``acc`` plus the sum of ``count`` products' tiles from product ``first`` on,
    round(A[p]) @ round(B[p]): ``a_rows`` and ``b_cols`` point at the tile's rows of A
    and columns of B in product 0, product p at (p // inner) * stride_*o +
    (p % inner) * stride_*b from there. One loop over every product's K steps, one
    product after another (as the TMA kernel's ``SUM_BATCH``), so that the sum is
    accumulated in FP32 and the loop is pipelined across products."""
    k_steps = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    for step in range(count * k_steps):
        product = (first + step // k_steps).to(tl.int64)
        outer = product // inner
        product -= outer * inner
        # 64-bit: a K step's offset times a transposed operand's stride may pass 2**31.
        ks = ((step % k_steps) * BLOCK_K + offs_k).to(tl.int64)
        mask_k = ks < K
        a = tl.load(
            a_rows + outer * stride_ao + product * stride_ab + ks[None, :] * stride_ak,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            b_cols + outer * stride_bo + product * stride_bb + ks[:, None] * stride_bk,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc = dot_rounded(a, b, acc, compute_dtype, INTERPRETED)
    return acc


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr,
    c_ptr,
    partial_sums_ptr,
    r_ptr,
    M,
    N,
    stride_cm,
    stride_cn,
    SPLIT_K: tl.constexpr,
    K_SUMS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    # programmatic dependent launch (mpgemm.kernels.dependent_launch)
    PDL: tl.constexpr = False,
):
    """C = sum over the splits of the FP32 partial products, in split order (so a result
    is the same run to run), rounded once to C's dtype; likewise R, A's row sums
    (``K_SUMS`` "a") or B's column sums ("b")."""
    wait_for_prior_grid(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    plane = M.to(tl.int64) * N  # one split's partial C
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(
            partial_ptr + split * plane + rows[:, None] * N + cols[None, :], mask=mask, other=0.0
        )
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, cast_rne(acc, c_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    if K_SUMS == "a":
        if pid_n == 0:
            _reduce_sums(partial_sums_ptr, r_ptr, rows, M, SPLIT_K)
    elif K_SUMS == "b":
        if pid_m == 0:
            _reduce_sums(partial_sums_ptr, r_ptr, cols, N, SPLIT_K)


@triton.jit
def _reduce_sums(partial_ptr, r_ptr, offs, length, SPLIT_K: tl.constexpr):
    """R[offs] = the sum of the (SPLIT_K, length) partial sums over the splits, in order."""
    total = tl.zeros(offs.shape, dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + split * length + offs, mask=offs < length, other=0.0)
    tl.store(r_ptr + offs, total, mask=offs < length)


def _reduction_blocks(N: int, splits: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of split-K's reduction: columns N's power of two from 16 to 64,
    and rows up to 64 while a thread of its 4 warps holds at most 128 partial elements
    (the splits' loads all go out at once: 64x64 tiles of 8 splits took 255 registers
    and spilled, sm_90a). The interpreter's: 32x32."""
    if INTERPRET:
        return 32, 32
    block_n = min(64, max(16, 1 << (N - 1).bit_length()))
    return min(64, 16384 // (splits * block_n)), block_n


# Every flag that changes the code or the pruned config list is part of the key
# (triton adds the tensors' dtypes itself).
_AUTOTUNE_KEY = [
    "M_BUCKET",
    "N_BUCKET",
    "K_BUCKET",
    "COMPUTE_BF16",
    "HAS_BIAS",
    "ACTIVATION",
    "STORE_PREACT",
    "K_SUMS",
    "RELU_GRAD",
    "C_SUMS",
    "ALIGNED",
    "SPLIT_K",
    "BATCHED",
    "SUM_BATCH",
]
# ``_gemm_kernel`` is the JIT function (its name is what launch records and the compile
# reports show); ``tuned_gemm_kernel`` the autotuner around it, which launches take.
# Tuned configs are kept on disk too (triton's cache): a new process reuses them.
tuned_gemm_kernel = triton.autotune(
    configs=CONFIGS,
    key=_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": _prune_configs},
    cache_results=True,
)(_gemm_kernel)


# A split gets at least this much of K, so that its partial is worth writing.
_MIN_SPLIT_K = 1024


def split_k_for(M: int, N: int, K: int, device: torch.device) -> int:
    """How many programs share each tile's K: doubled while the grid of 128x128 tiles
    has fewer programs than the GPU has SMs and each split keeps 1024 of K (at most 8),
    so that one to two programs run on each SM. The head's weight gradient of a
    10-class MLP (10 x 4096 over a batch of 8192: 32 tiles) gets 8, 256 programs of 4
    warps, two an SM (with 4, one an SM, it streamed the 64 MB of activations at 1.9
    TB/s on an H200, run8: 34.5 us where cuBLAS took 29.0 on 256 programs, split 16);
    a 4096-wide layer's GEMMs get 1."""
    tiles = cdiv(M, 128) * max(cdiv(N, 128), 1)
    sms = multiprocessors(device)
    splits = 1
    while splits < 8 and tiles * splits < sms and K // (2 * splits) >= _MIN_SPLIT_K:
        splits *= 2
    return splits


KERNELS = ("auto", "pointer", "tma")
_kernel = "auto"


@contextlib.contextmanager
def use_kernel(name: str) -> Iterator[None]:
    """Within the block, ``triton_gemm`` runs kernel ``name``: "auto" (the default: the
    TMA kernel for every launch ``gemm_tma.tma_layout`` admits, on a GPU with TMA, else
    the pointer kernel), "pointer" or "tma" (then a launch that does not qualify raises
    ValueError). Tests and benchmarks compare the two this way."""
    global _kernel
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")
    previous, _kernel = _kernel, name
    try:
        yield
    finally:
        _kernel = previous


def _has_tma(device: torch.device) -> bool:
    # Hopper's Tensor Memory Accelerator; the interpreter and a compile for an H100
    # (launches intercepted) emulate or target it.
    if device.type == "cuda" and not intercepting():
        return _capability(device) >= (9, 0)
    return True


@functools.lru_cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _tma_runs(device: torch.device, splits: int) -> bool:
    """Whether the TMA kernel may run a launch on ``device`` split ``splits`` ways,
    whatever its operands: not forced onto the pointer kernel, K unsplit, a GPU with
    TMA."""
    return _kernel != "pointer" and splits == 1 and _has_tma(device)


def _tma_eligible(a, b, compute_dtype, splits) -> tuple[bool, bool] | None:
    if not _tma_runs(a.device, splits):
        return None
    return gemm_tma.tma_layout(a, b, compute_dtype)


def _tma_layout(a, b, compute_dtype, splits) -> tuple[bool, bool] | None:
    """The TMA kernel's (A_T, B_T) for this launch, or None for the pointer kernel."""
    layout = _tma_eligible(a, b, compute_dtype, splits)
    if layout is None and _kernel == "tma":
        raise ValueError(
            "the TMA GEMM needs A and B in the compute dtype, 16-byte-aligned, each with a "
            "unit stride and no split of K; this launch does not qualify"
        )
    return layout


# An FP32 operand (a weight without a 16-bit copy, an FP32 input) is rounded to the
# compute dtype by a cast beforehand, into a 16-bit copy the TMA kernel reads, where the
# product is large and reads each of the operand's elements many times; else in the
# kernel, as the pointer kernel loads it (the same rounding, to nearest even). Rounded
# in the kernel (FP32 tiles converted in registers, each MMA waited for), products from
# 2048^3 up ran at 0.41 to 0.49x of autocast's casts and cuBLAS on the H200 (run6's
# bench, mpgemm_from_fp32), 0.96x at 1024^3 and 1.36x at 512^3, where a cast's launch
# costs more than it saves. Below: at least this many FLOPs (2048 x 2048 x 1024), and
# each element of a rounded operand used at least this many times (A's N, B's M).
ROUND_FP32_FLOPS = 2**33
ROUND_FP32_REUSE = 512


def _rounded_fp32(a, b, compute_dtype, *, rowsum_a: bool, epilogue: bool) -> tuple:
    """(A, B) for a product with an FP32 operand: as given, or each FP32 one rounded
    into a 16-bit copy (``_aligned_copy``) where the TMA kernel can then run the product
    and the casts pay (ROUND_FP32_FLOPS, ROUND_FP32_REUSE). Not A with its row sums,
    which are of its FP32 values."""
    M, K = a.shape
    N = b.shape[1]
    if 2 * M * N * K < ROUND_FP32_FLOPS or _kernel != "auto":
        return a, b
    if not _tma_runs(a.device, 1 if epilogue else split_k_for(M, N, K, a.device)):
        return a, b
    for t, uses, summed in ((a, N, rowsum_a), (b, M, False)):
        if t.dtype == torch.float32:
            if summed or uses < ROUND_FP32_REUSE:
                return a, b
        elif not gemm_tma.tma_operand(t, compute_dtype):
            return a, b
    return tuple(_aligned_copy(t, compute_dtype) if t.dtype == torch.float32 else t for t in (a, b))


def _aligned_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (2-D) rounded to ``dtype`` in a copy whose rows (or columns, for a
    column-major ``t``) start 16 bytes apart: a TMA descriptor's layout."""
    if t.stride(0) == 1 and t.stride(1) != 1:
        return _aligned_copy(t.t(), dtype).t()
    rows, cols = t.shape
    width = cdiv(cols, 8) * 8  # 16 bytes of 16-bit elements
    copy = torch.empty((rows, width), device=t.device, dtype=dtype)[:, :cols]
    return copy.copy_(t)


def _flags(
    compute_dtype: torch.dtype, bias, activation, store_preact: bool, relu_output, colsum_c: bool
) -> dict:
    """Both kernels' constexprs for what a launch computes."""
    return dict(
        COMPUTE_BF16=compute_dtype == torch.bfloat16,
        INTERPRETED=INTERPRET,
        HAS_BIAS=bias is not None,
        ACTIVATION=activation,
        STORE_PREACT=store_preact,
        RELU_GRAD=relu_output is not None,
        C_SUMS=colsum_c,
        SUM_ROWS=COLUMN_SUM_ROWS,
    )


def _column_sums(r: torch.Tensor, M: int, N: int) -> tuple[torch.Tensor, ...]:
    """(R, P, counters) for a launch that sums C's columns into R (``C_SUMS``): P, the
    FP32 partials the kernel writes (``store_column_partial``), and a counter per
    column of tiles, zero (``arrivals.counters``; the narrowest tiles are 16 wide)."""
    partials = torch.empty((cdiv(M, COLUMN_SUM_ROWS), N), device=r.device, dtype=torch.float32)
    return r, partials, counters(r.device, cdiv(N, NARROW_N))


def triton_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    store_preact: bool = False,
    rowsum_a: bool = False,
    out: torch.Tensor | None = None,
    sum_batch: bool = False,
    kept_dims: int = 0,
    relu_output: torch.Tensor | None = None,
    colsum_c: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the kernel; see the module docstring for the math.

    a: (M, K), b: (K, N), any strides, float32/float16/bfloat16. bias: (N,), any stride
    (an expanded scalar included). out: an (M, N) tensor of out_dtype to write C into
    (any strides), else a contiguous one is allocated. relu_output: (M, N), any strides
    and dtype, a ReLU's output y, C being the gradient at that ReLU's output: C is then
    the gradient at its input, 0 where y <= 0 (no bias or activation). colsum_c: R is
    C's column sums (as stored) instead (not with rowsum_a).
    Returns (C, G or None, R or None); G is (M, N) in out_dtype, R is FP32 of shape (M,), or
    (N,) with colsum_c.
    Batched: a (*batch, M, K) and b (*batch, K, N) of one batch shape, any strides (0
    where an operand is broadcast), with no bias, activation, G, R or out: C is
    (*batch, M, N), one product per batch entry (``_launch_batched``); with
    ``sum_batch``, C is (*batch[:kept_dims], M, N), the products summed over the other
    batch dimensions (``_sum_batched``).
    The caller has validated shapes, dtypes and devices.
    """
    epilogue = bias is not None or activation is not None or store_preact or relu_output is not None
    if a.dim() > 2:
        if epilogue or rowsum_a or colsum_c or out is not None:
            raise ValueError("a batch of products takes no bias, activation, G, R or out")
        if sum_batch:
            return _sum_batched(a, b, compute_dtype, out_dtype, kept_dims), None, None
        c = torch.empty((*a.shape[:-1], b.shape[-1]), device=a.device, dtype=out_dtype)
        signature = _signature(a, b, c, None, compute_dtype, None, False, False, None, False)
        if not _replayed(signature, a, b, c, None, None, None, None):
            _launch_batched(a, b, c, compute_dtype, signature)
        return c, None, None
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=out_dtype) if out is None else out
    # z in C's dtype, as torch keeps an activation's input: its backward takes act'(z).
    g = torch.empty((M, N), device=a.device, dtype=out_dtype) if store_preact else None
    r = None
    if rowsum_a or colsum_c:
        r = torch.empty((N if colsum_c else M,), device=a.device, dtype=torch.float32)
    if M == 0 or (N == 0 and not rowsum_a):
        return c, g, r.zero_() if colsum_c else r
    if torch.float32 in (a.dtype, b.dtype):
        a, b = _rounded_fp32(a, b, compute_dtype, rowsum_a=rowsum_a, epilogue=epilogue)
    # The epilogue's G: y to read (relu_output), or z to write (store_preact).
    read_or_written = relu_output if relu_output is not None else g
    column = _column_sums(r, M, N) if colsum_c else None

    signature = _signature(
        a, b, c, bias, compute_dtype, activation, store_preact, rowsum_a, relu_output, colsum_c
    )
    if _replayed(signature, a, b, c, bias, read_or_written, r, column):
        return c, g, r
    flags = _flags(compute_dtype, bias, activation, store_preact, relu_output, colsum_c)
    splits = 1 if epilogue else split_k_for(M, N, K, a.device)
    layout = _tma_layout(a, b, compute_dtype, splits)
    # C.T = B.T @ A.T: R, A's row sums, are then B.T's column sums.
    swapped = layout is None and M <= NARROW_N < N and not epilogue
    if layout is not None:
        if rowsum_a:
            _row_sums(a, r)
        replay = _launch_tma(
            a, b, c, bias=bias, g=read_or_written, column=column, layout=layout, flags=flags
        )
    else:
        k_sums = ("b" if swapped else "a") if rowsum_a else None
        replay = _launch_pointer(
            *_operands(a, b, c, swapped),
            bias=bias,
            g=read_or_written,
            r=r,
            column=column,
            k_sums=k_sums,
            splits=splits,
            flags=flags,
        )
    if replay is not None:
        _remember(signature, replay._replace(swapped=swapped))
    return c, g, r


def replayed_product(
    a: torch.Tensor, b: torch.Tensor, compute_dtype: torch.dtype, out_dtype: torch.dtype
) -> torch.Tensor | None:
    """``triton_gemm(a, b, compute_dtype=..., out_dtype=...)``'s C, where the launches
    of its signature are kept (``_replays``) and repeated on these tensors; else None,
    with nothing launched. a: (M, K), b: (K, N), 16-bit (an FP32 operand's rounding
    comes first in ``triton_gemm``), checked by the caller: ``mpgemm.matmul`` for a
    product it has made before (``functional._replayed_matmul``)."""
    c = torch.empty((a.shape[0], b.shape[1]), device=a.device, dtype=out_dtype)
    signature = _signature(a, b, c, None, compute_dtype, None, False, False, None, False)
    return c if _replayed(signature, a, b, c, None, None, None, None) else None


def _row_sums(a: torch.Tensor, r: torch.Tensor) -> None:
    # R for the TMA kernel, which fuses no sums: one pass over A beforehand.
    torch.sum(a, dim=1, dtype=torch.float32, out=r)


class _Replay(NamedTuple):
    """``triton_gemm``'s launches for a signature (``_signature``), repeated by
    ``_relaunch`` for its later calls: each launch (binary, config and grid: the
    kernel's, then split-K's reduction where it splits), the TMA kernel's layout of A
    and B (None: the pointer kernel), whether the pointer kernel computes C.T, the
    kernel's integer arguments, for a batch of products, the batch's size and A's,
    B's and C's stride over it (the merged batch dimensions of ``_launch_batched``'s one
    launch), and the tiles of the TMA kernel's config (``gemm_tma.tile_shapes``), which
    its replays' descriptors are made with; and, once a replay has run with
    ``native_launch.enabled()``, each launch's C++ plan (``native_launch.plan``), which
    later replays launch by (() where a launch could not be planned). Every decision
    ``triton_gemm`` makes for a launch (kernel, layout, split, config) and every integer
    argument is a function of the signature, and an eager training step repeats its
    signatures step after step: the decisions and ``launch``'s key took about 40% of
    ``mpgemm.matmul``'s host time (``bench/host_time.py --replays``)."""

    launches: tuple[Launched, ...]
    layout: tuple[bool, bool] | None
    swapped: bool
    integers: tuple[int, ...]
    batch: tuple[int, tuple[int, ...]] | None
    tiles: tuple[list[int], list[int]] | None
    native: tuple | None = None


def _replayed(signature: tuple, a, b, c, bias, g, r, column) -> bool:
    """Whether the launches kept for ``signature`` could be, and were, repeated on these
    tensors (``_relaunch``)."""
    replay = _replays.get(signature)
    if replay is None or not all(map(current, replay.launches)):
        return False
    plans = _relaunch(replay, a, b, c, bias, g, r, column)
    if plans is not None:
        _replays[signature] = replay._replace(native=plans)
    return True


def _remember(signature: tuple, replay: _Replay) -> None:
    if len(_replays) >= _MAX_REPLAYS:  # shapes without end: keep the newest
        _replays.clear()
    _replays[signature] = replay


def _relaunch(replay: _Replay, a, b, c, bias, g, r, column) -> tuple | None:
    """``triton_gemm``'s launches as ``replay`` made them, on these tensors: by its C++
    plans where it has them and ``native_launch.enabled()`` (and Triton's launch hooks
    are not set); else by the launch layer, returning, where enabled and not tried
    before, the plans of these launches for the replay to keep (``_launched_again``)."""
    if replay.batch is not None:
        count, strides = replay.batch
        a, b, c = _batch_views((a, b, c), count, strides)
    enabled = native_launch.enabled() and not hooks_set()
    plans = replay.native if enabled else None
    first, *reduction = replay.launches
    if replay.layout is not None:
        if r is not None and column is None:  # A's row sums, not C's column sums
            _row_sums(a, r)
        pointers = gemm_tma.tma_pointers(c, bias, g, column)
        if plans:
            gemm_tma.bind_context(a)
            native_relaunch(first, plans[0], (a, b, *pointers))
            return None
        descriptors = gemm_tma.tma_descriptors(a, b, replay.layout, tiles=replay.tiles)
        args = (*descriptors, *pointers, *replay.integers)
        return _launched_again([(first, args, (a, b))], plan=enabled and plans is None)
    a, b, c = _operands(a, b, c, replay.swapped)
    result, sums = c, r
    if reduction:  # split-K: into partials, then their sum (the grid's second axis)
        c, r = _partials(a, b, r, first.grid[1])
    tensors = _pointer_tensors(a, b, c, bias, g, r, column)
    if plans:
        native_relaunch(first, plans[0], tensors)
        if reduction:
            native_relaunch(reduction[0], plans[1], _reduction_tensors(c, result, r, sums))
        return None
    launches = [(first, (*tensors, *replay.integers), ())]
    if reduction:
        launches.append((reduction[0], _reduction_arguments(c, result, r, sums), ()))
    return _launched_again(launches, plan=enabled and plans is None)


def _launched_again(launches: list[tuple[Launched, tuple, tuple]], *, plan: bool) -> tuple | None:
    """Relaunch each (launched, args, described) by the launch layer; with ``plan``,
    return their plans (``native_launch.plan``), or () if any cannot be planned (so
    that no later replay tries again); else None. ``described``: the tensors that
    ``args``' leading descriptors describe (the sources of the plan's tensor maps),
    then ``args``' tensors are the rest of its sources."""
    for launched, args, _ in launches:
        relaunch(launched, args)
    if not plan:
        return None
    plans = []
    for launched, args, described in launches:
        planned = native_launch.plan(
            launched.binary, launched.grid, args, (*described, *sources_of(args))
        )
        if planned is None:
            return ()
        plans.append(planned)
    return tuple(plans)


def _operands(a, b, c, swapped: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The pointer kernel's A, B and C: C.T = B.T @ A.T where it computes the transpose.
    return (b.t(), a.t(), c.t()) if swapped else (a, b, c)


def _signature(
    a, b, c, bias, compute_dtype, activation, store_preact, rowsum_a, relu_output, colsum_c
) -> tuple:
    """What ``triton_gemm``'s decisions and launch arguments other than its tensors
    depend on, for one product or a batch: the operands' shapes, strides, dtypes and
    16-byte alignment (C's, the bias's and a ReLU output's too: G, R and the column
    sums' partials are allocated contiguous), what the epilogue computes, the device
    and the kernel ``use_kernel`` asks for."""
    return (
        a.shape,
        a.stride(),
        a.dtype,
        a.data_ptr() & 15 == 0,
        b.shape,
        b.stride(),
        b.dtype,
        b.data_ptr() & 15 == 0,
        c.stride(),
        c.dtype,
        c.data_ptr() & 15 == 0,
        None if bias is None else (bias.stride(0), bias.dtype, bias.data_ptr() & 15 == 0),
        None
        if relu_output is None
        else (relu_output.stride(), relu_output.dtype, relu_output.data_ptr() & 15 == 0),
        compute_dtype,
        activation,
        store_preact,
        rowsum_a,
        colsum_c,
        a.device,
        _kernel,
    )


# Replays by ``_signature``, at most so many.
_MAX_REPLAYS = 4096
_replays: dict[tuple, _Replay] = {}


# CUDA's limit on a grid's third dimension, the pointer kernel's batch.
_MAX_BATCH = 65535


def _launch_batched(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    compute_dtype: torch.dtype,
    signature: tuple | None = None,
) -> None:
    """C[i] = round(A[i]) @ round(B[i]) for every batch index i of (*batch, ., .)
    operands, by launches over 3-D views, each of the TMA kernel where it qualifies
    (``tma_layout``), else of the pointer kernel: batch dimensions are merged where the
    strides of all three allow (always for contiguous operands, and for an operand
    broadcast over every batch dimension); two that do not merge take one launch of
    the pointer kernel over both (``OUTER``), more are iterated on the host; each
    launch takes at most ``_MAX_BATCH`` products. With ``signature`` (``triton_gemm``'s),
    a batch done in one launch is kept to replay."""
    if c.numel() == 0:
        return
    flags = _flags(compute_dtype, None, None, False, None, False)
    operands = (a, b, c)
    *outer, (inner, *inner_strides) = _merged_batch(operands)
    if len(outer) == 1 and outer[0][0] * inner <= _MAX_BATCH and _kernel != "tma":
        # Two dimensions that do not merge (attention's (batch, heads) of a transposed
        # view): one launch of the pointer kernel over both (OUTER), not one per
        # outer index (which use_kernel("tma") keeps, for comparison).
        a3, b3, c3 = _batch_views(operands, inner, inner_strides)
        replay = _launch_pointer(
            a3, b3, c3, r=None, k_sums=None, splits=1, flags=flags, outer=outer[0]
        )
        # Its outer strides are keyword arguments of the binary, fixed by the signature.
        if signature is not None and replay is not None:
            _remember(signature, replay._replace(batch=(inner, tuple(inner_strides))))
        return
    for index in itertools.product(*(range(dim[0]) for dim in outer)):
        offsets = [
            t.storage_offset() + sum(i * dim[1 + j] for i, dim in zip(index, outer, strict=True))
            for j, t in enumerate(operands)
        ]
        for start in range(0, inner, _MAX_BATCH):
            count = min(inner - start, _MAX_BATCH)
            starts = [offset + start * s for offset, s in zip(offsets, inner_strides, strict=True)]
            a3, b3, c3 = _batch_views(operands, count, inner_strides, starts)
            layout = _tma_layout(a3, b3, compute_dtype, 1)
            if layout is not None:
                replay = _launch_tma(
                    a3, b3, c3, bias=None, g=None, column=None, layout=layout, flags=flags
                )
            else:
                replay = _launch_pointer(a3, b3, c3, r=None, k_sums=None, splits=1, flags=flags)
            if signature is not None and replay is not None and not outer and count == inner:
                _remember(signature, replay._replace(batch=(count, tuple(inner_strides))))


def _batch_views(
    operands: tuple[torch.Tensor, ...],
    count: int,
    strides: Sequence[int],
    starts: Sequence[int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """(count, ., .) views of (*batch, ., .) ``operands``: each one's matrices from
    element ``starts[i]`` of its storage on (default: where the operand starts),
    ``strides[i]`` apart."""
    if starts is None:
        starts = [t.storage_offset() for t in operands]
    return tuple(
        t.as_strided((count, *t.shape[-2:]), (s, *t.stride()[-2:]), start)
        for t, s, start in zip(operands, strides, starts, strict=True)
    )


def _merged_batch(
    operands: tuple[torch.Tensor, ...], first: int = 0, end: int | None = None
) -> list[tuple[int, ...]]:
    """The batch dimensions ``first`` to ``end`` (default: all) of (*batch, ., .)
    ``operands`` (one batch shape), merged where the strides of all of them allow,
    outermost first: (size, each operand's stride) per dimension left, one of size 1
    for none."""
    dims: list[tuple[int, ...]] = []
    batch = operands[0].shape[:-2]
    for i in range(first, len(batch) if end is None else end):
        size = batch[i]
        strides = tuple(t.stride(i) for t in operands)
        if size == 1:
            continue
        if dims and all(o == s * size for o, s in zip(dims[-1][1:], strides, strict=True)):
            dims[-1] = (dims[-1][0] * size, *strides)
        else:
            dims.append((size, *strides))
    return dims or [(1, *(0 for _ in operands))]


def _sum_batched(
    a: torch.Tensor,
    b: torch.Tensor,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
    kept_dims: int = 0,
) -> torch.Tensor:
    """C[k] = sum over i of round(A[k, i]) @ round(B[k, i]), summed in FP32 and rounded
    once, for (*kept, *summed, M, K) and (*kept, *summed, K, N) operands of one batch
    shape, ``kept_dims`` batch dimensions kept: the gradient of an operand broadcast
    over the summed ones; C is (*kept, M, N). Where the kept dimensions merge into one,
    and the summed ones too, a kernel sums in its K loop, which runs over the products
    one after another (``SUM_BATCH``): over the whole batch, the TMA kernel where the
    operands qualify (``tma_layout``), else the pointer kernel (FP32 or unaligned
    operands), with the batch split into as many parts as it takes to give every SM a
    tile (``sum_splits``): one launch into C, or into FP32 partials that are then
    added; with kept dimensions, the pointer kernel, a part per kept index. Else
    (dimensions that do not merge) the batch of products in FP32 (``_launch_batched``),
    then their sums."""
    M, N = a.shape[-2], b.shape[-1]
    shape = (*a.shape[:kept_dims], M, N)
    if a.numel() == 0 or b.numel() == 0:  # no products, or empty ones: C is zeros
        return torch.zeros(shape, device=a.device, dtype=out_dtype)
    kept = _merged_batch((a, b), 0, kept_dims)
    summed = _merged_batch((a, b), kept_dims)
    # (use_kernel("tma") makes kept indices' sums the TMA kernel's products, below.)
    if len(kept) == 1 and len(summed) == 1 and (kept[0][0] == 1 or _kernel != "tma"):
        ((parts, a_kept, b_kept),) = kept
        ((count, *strides),) = summed
        a3, b3 = _batch_views((a, b), count, strides)
        flags = _flags(compute_dtype, None, None, False, None, False)
        sms = multiprocessors(a.device)
        if parts > 1:  # a part per kept index, each sum rounded once: the pointer kernel
            splits, per_split, layout = 1, count, None
            c = torch.empty((parts, M, N), device=a.device, dtype=out_dtype)
        else:
            splits = sum_splits(M, N, count, sms)
            per_split = cdiv(count, splits)
            if splits == 1:
                c = torch.empty((M, N), device=a.device, dtype=out_dtype)
            else:
                c = torch.empty((splits, M, N), device=a.device, dtype=torch.float32)
            layout = _tma_layout(a3, b3, compute_dtype, 1)
        if layout is not None:
            gemm_tma.launch_tma_gemm(
                a3,
                b3,
                c,
                bias=None,
                g=None,
                layout=layout,
                sms=sms,
                flags=flags,
                per_split=per_split,
            )
        else:
            _launch_pointer(
                a3,
                b3,
                c,
                r=None,
                k_sums=None,
                splits=1,
                flags=flags,
                per_split=per_split,
                outer=(parts, a_kept, b_kept, 0),
            )
        return (c if splits == 1 else c.sum(dim=0).to(out_dtype)).view(shape)
    products = torch.empty((*a.shape[:-1], N), device=a.device, dtype=torch.float32)
    _launch_batched(a, b, products, compute_dtype)
    # (No dimension to sum: torch's sum over dim=() would reduce every one.)
    summed_dims = tuple(range(kept_dims, a.dim() - 2))
    return (products.sum(dim=summed_dims) if summed_dims else products).to(out_dtype)


def sum_splits(M: int, N: int, count: int, sms: int) -> int:
    """Into how many parts ``_sum_batched`` splits a sum of ``count`` (M, N) products:
    enough that C's 128x128 tiles, once per part, give every SM one (a tile's program
    runs its part's products one after another), no more parts than products, and
    none empty. A 4096x4096 gradient (1,024 tiles) takes 1; 196x196 over a batch of 256
    (4 tiles) on 132 SMs takes 32 parts of 8 products."""
    tiles = cdiv(M, 128) * cdiv(N, 128)
    splits = min(count, max(1, cdiv(sms, tiles)))
    return cdiv(count, cdiv(count, splits)) if count else 1


def _launch_pointer(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    r: torch.Tensor | None,
    k_sums: str | None,
    splits: int,
    flags: dict,
    bias: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    column: tuple[torch.Tensor, ...] | None = None,
    per_split: int | None = None,
    outer: tuple[int, int, int, int] | None = None,
) -> _Replay | None:
    """The pointer kernel's launch (and split-K's reduction) writing C, G and R, which
    ``triton_gemm`` has allocated; R has A's rows (``k_sums`` "a") or B's columns
    ("b"), or is C's column sums (``column``: ``_column_sums``'s R, P and counters).
    ``splits``: split_k_for's, which is the same for C.T = B.T @ A.T. With ``per_split``,
    (P, M, K) and (P, K, N) operands' products summed (``SUM_BATCH``, no sums, no epilogue,
    no split): C is (M, N), or (S, M, N) FP32 partials, C[i] the sum of products i *
    per_split on, per_split of them or fewer. ``outer``, (count, A's, B's and C's stride):
    the batch of 3-D views repeats over ``count`` outer indices, so many elements apart (a
    batch over two dimensions that do not merge); summed, C is (count, M, N), C[k] outer
    index k's sum (per_split is the views' batch).
    Returns the launches to replay where each called a cached binary (``launch``),
    else None."""
    M, K = a.shape[-2:]
    N = b.shape[-1]
    # (B, M, K) @ (B, K, N) -> (B, M, N): a batch of products (``_launch_batched``)
    batch, batch_strides = 1, ()
    if a.dim() == 3:
        c_stride = c.stride(0) if c.dim() == 3 else 0
        batch, batch_strides = a.shape[0], (a.stride(0), b.stride(0), c_stride)
    result, sums = c, r
    if splits > 1:  # the kernel writes FP32 partials; the reduction writes c and r
        c, r = _partials(a, b, r, splits)
    operands = [t for t in (a, b, c, bias, g, r) if t is not None]
    strides = [
        *a.stride(),
        *b.stride(),
        *c.stride()[-2:],
        *(g.stride() if g is not None else ()),
        *batch_strides,
        *(outer[1:] if outer is not None else ()),
    ]
    flags = dict(
        flags,
        K_SUMS=k_sums,
        ALIGNED=operands_aligned(operands, strides),
        SPLIT_K=splits,
    )
    # The grid: C's tiles, K's splits (summing: the batch's parts), the products.
    second, third = splits, batch
    if batch_strides:
        stride_ab, stride_bb, stride_cb = batch_strides
        flags.update(stride_ab=stride_ab, stride_bb=stride_bb, stride_cb=stride_cb)
        count, stride_ao, stride_bo, stride_co = (1, 0, 0, 0) if outer is None else outer
        addressed = dict(INNER=batch, stride_ao=stride_ao, stride_bo=stride_bo)
        if per_split is None:
            flags.update(BATCHED=True)
            if outer is not None:
                flags.update(addressed, stride_co=stride_co, OUTER=True)
                third = batch * count
        else:
            flags.update(addressed, PER_SPLIT=per_split, PRODUCTS=batch * count, SUM_BATCH=True)
            second, third = cdiv(batch * count, per_split), 1
    n_bucket = size_bucket(N)

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * max(cdiv(N, meta["BLOCK_N"]), 1), second, third)

    integers = _pointer_integers(a, b, c, bias, g)
    launched = launch(
        tuned_gemm_kernel,
        grid,
        *_pointer_tensors(a, b, c, bias, g, r, column),
        *integers,
        gpu_configs=lambda: _prune_configs(GPU_CONFIGS, {"N_BUCKET": n_bucket}, **flags),
        **flags,
    )
    launches = (launched,)
    if splits > 1:
        block_m, block_n = _reduction_blocks(N, splits)
        reduced = launch(
            _split_k_reduce_kernel,
            (cdiv(M, block_m), max(cdiv(N, block_n), 1)),
            *_reduction_arguments(c, result, r, sums),
            SPLIT_K=splits,
            K_SUMS=k_sums,
            INTERPRETED=INTERPRET,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=4,
        )
        launches += (reduced,)
    if None in launches:
        return None
    return _Replay(launches, None, False, integers, None, None)


def _launch_tma(
    a, b, c, *, bias, g, column, layout: tuple[bool, bool], flags: dict
) -> _Replay | None:
    """The TMA kernel's launch (``gemm_tma.launch_tma_gemm``), and the replay of it where
    it called a cached binary."""
    sms = multiprocessors(a.device)
    launched = gemm_tma.launch_tma_gemm(
        a, b, c, bias=bias, g=g, column=column, layout=layout, sms=sms, flags=flags
    )
    if launched is None:
        return None
    integers = gemm_tma.tma_integers(a, b, c, bias, g)
    meta = {**launched.binary.config.kwargs, "A_T": layout[0], "B_T": layout[1]}
    return _Replay((launched,), layout, False, integers, None, gemm_tma.tile_shapes(meta))


def _partials(a, b, r, splits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Split-K's FP32 partials of C, (splits, M, N), and of R, (splits, len(R)), or
    None without R: what the split launches write and the reduction adds."""
    M, N = a.shape[-2], b.shape[-1]
    c = torch.empty((splits, M, N), device=a.device, dtype=torch.float32)
    if r is not None:
        r = torch.empty((splits, r.shape[0]), device=a.device, dtype=torch.float32)
    return c, r


def _reduction_arguments(partials, result, partial_sums, sums) -> tuple:
    """``_split_k_reduce_kernel``'s arguments: it adds ``partials`` into ``result`` and
    ``partial_sums`` into ``sums`` (``_reduction_tensors``), then sizes and strides."""
    M, N = result.shape
    tensors = _reduction_tensors(partials, result, partial_sums, sums)
    return (*tensors, M, N, result.stride(0), result.stride(1))


def _reduction_tensors(partials, result, partial_sums, sums) -> tuple[torch.Tensor, ...]:
    # The partials where there are no sums: no null pointer is formed.
    return (
        partials,
        result,
        partial_sums if partial_sums is not None else partials,
        sums if sums is not None else partials,
    )


def _pointer_tensors(a, b, c, bias, g, r, column) -> tuple[torch.Tensor, ...]:
    """The pointer kernel's leading arguments: A, B, C, the bias, G, R, and the partials
    of C's column sums and their counters (``column``'s P and counters; C where absent:
    unused pointer arguments get a live tensor, so that no null pointer is formed)."""
    return (
        a,
        b,
        c,
        bias if bias is not None else c,
        g if g is not None else c,
        r if r is not None else c,
        *(column[1:] if column is not None else (c, c)),
    )


def _pointer_integers(a, b, c, bias, g) -> tuple[int, ...]:
    """The pointer kernel's integer arguments, after ``_pointer_tensors``'s: M, N, K,
    their size buckets, and the strides of A, B, C, G and the bias."""
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    return (
        M,
        N,
        K,
        size_bucket(M),
        size_bucket(N),
        size_bucket(K),
        a.stride(-2),
        a.stride(-1),
        b.stride(-2),
        b.stride(-1),
        c.stride(-2),
        c.stride(-1),
        *(g.stride() if g is not None else (0, 0)),
        bias.stride(0) if bias is not None else 0,
    )
