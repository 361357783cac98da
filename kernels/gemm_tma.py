"""TMA persistent GEMM for Hopper: the math of ``mpgemm.kernels.gemm`` for 16-bit
operands, read by the Tensor Memory Accelerator.

    C   = act(A @ B + bias)            A, B already in the compute dtype, FP32 accumulation
    G   = A @ B + bias                 (optional, GELU and SiLU: z, in C's dtype)
    C   = 0 where y <= 0, else A @ B   (a ReLU's input gradient, with C's column sums'
                                        partials: ``mpgemm.kernels.gemm``)
    C[i] = A[i] @ B[i]                 a batch of products (``matmul``), no epilogue

The bias gradient's row sums are not fused here: ``triton_gemm`` sums A beforehand (on
an H100, pulling each A tile through registers for a derivative prologue and the sums
made these launches 2.7x to 8x slower than cuBLAS, where the plain launches matched it:
bench/results/h100-2026-11-22/profile).

A and B are read through tensor descriptors: each tile is one bulk copy
(``cp.async.bulk.tensor``) into shared memory, out-of-bounds elements arrive as zeros
(no masks in the main loop), and no register holds an address. The grid is one program
per SM, each walking tiles in grouped order, a batch's products one after another
(``tl.range(..., flatten=True)`` asks the compiler to pipeline the tile loop and the K
loop as one, so that the next tile's loads need not wait for this tile's epilogue).

A descriptor needs a unit stride in its last dimension and 16-byte-aligned base and
other strides. An operand whose unit stride runs down its columns (the weight
gradient's dY.T, the forward's W.T) is described as the transpose it views and
transposed back in shared memory, which wgmma reads either way for 16-bit types:
``A_T``, ``B_T``. ``tma_layout`` says which launches qualify; the others take the
pointer kernel.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mpgemm.kernels.dependent_launch import wait_for_prior_grid
from mpgemm.kernels.gemm_common import (
    INTERPRET,
    NARROW_N,
    SINGLE_CONFIG,
    cdiv,
    dot_rounded,
    finish_column_sums,
    grouped_tile,
    operands_aligned,
    size_bucket,
    store_column_partial,
    store_epilogue,
    tile,
    tile_configs,
)
from mpgemm.kernels.launches import Launched, launch


def tile_shapes(meta: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """The tiles A's and B's descriptors read for a config, ``meta`` (its BLOCK_M,
    BLOCK_N and BLOCK_K, and the launch's A_T and B_T: an operand described as its
    transpose reads its tile transposed)."""
    bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    a_tile = [bk, bm] if meta["A_T"] else [bm, bk]
    b_tile = [bn, bk] if meta["B_T"] else [bk, bn]
    return a_tile, b_tile


def _block_shape(rank: int, tile: list[int]) -> list[int]:
    # A batch's descriptor (rank 3) reads one matrix's tile.
    return [1, *tile] if rank == 3 else tile


def _set_block_shapes(nargs: dict) -> None:
    """Give the descriptors the config's tile shapes (triton runs this before each
    launch of a config, timed or not; a replay makes its descriptors with them:
    ``tma_descriptors``' ``tiles``)."""
    a_desc, b_desc = nargs["a_desc"], nargs["b_desc"]
    a_tile, b_tile = tile_shapes(nargs)
    a_desc.block_shape = _block_shape(len(a_desc.shape), a_tile)
    b_desc.block_shape = _block_shape(len(b_desc.shape), b_tile)


def _hopper_configs() -> list[triton.Config]:
    """Tiles for an H100, BLOCK_K 64 (one 128-byte swizzled row of 16-bit operands per
    bulk copy); ``fits`` says which each launch may use."""
    tiles = [
        # BLOCK_M, BLOCK_N, BLOCK_K, stages, warps
        (128, 256, 64, 3, 8),
        # The tile the autotuner chose for the guide's large GEMMs (run6), one stage deeper,
        # as cuBLAS's kernels for these shapes run it (229,408 bytes of shared memory
        # compiled; 229,440 with an FP32 output, which stores it in quarters).
        (128, 256, 64, 4, 8),
        # cuBLAS's tile for the guide's input gradients (nvjet 256x128_64x4 on an H100:
        # 311.6 us where run8's 128x256 in 4 stages took 330.6): the same accumulator,
        # two m64n128 wgmmas a warpgroup where 128x256 has one m64n256.
        (256, 128, 64, 4, 8),
        (128, 128, 64, 4, 8),
        (64, 256, 64, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 64, 64, 4, 4),
        # for at most NARROW_N columns only (a 10-class head's forward): beside the
        # tiles above, 16-wide ones whose stages are mostly A, 8 of them in flight (the
        # 128x64x64 tile run6 chose read x at 2.1 TB/s on 64 programs)
        (128, 16, 64, 8, 4),
        (64, 16, 64, 8, 4),
    ]
    return tile_configs(tiles, pre_hook=_set_block_shapes)


def _single_config() -> list[triton.Config]:
    # The tile every launch kind keeps (``fits``: an unaligned C's GELU among them), so
    # that none is timed.
    return [c for c in _hopper_configs() if tile(c) == (64, 64, 64, 4)]


def _interpreter_configs() -> list[triton.Config]:
    return [
        triton.Config(
            {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, pre_hook=_set_block_shapes
        )
    ]


# Shared memory a block may have on an H100 (227 KB).
SMEM_BYTES = 232448
# The most shared memory the epilogue's layout conversion may take at once: a larger
# tile of C (128x256 of FP32: 128 KB, which with 3 stages of 48 KB would not fit) is
# stored in parts of EPILOGUE_PART bytes.
EPILOGUE_SCRATCH = 64 * 1024
# Such a part: 128x256 of FP32 goes in quarters of 128x64, so that it fits beside 4
# stages of 48 KB (229,440 bytes compiled under triton 3.6 and 3.9), as cuBLAS's kernels
# pipeline their weight gradients; in halves of 64 KB only 3 stages fit.
EPILOGUE_PART = 32 * 1024
# Triton converts a larger part a piece at a time: no binary of the AOT check (triton
# 3.6 and 3.9) took more than this many elements of C for it (a
# 128x256 tile of FP16 took half of its 64 KB), and the check fails any binary whose
# shared memory exceeds SMEM_BYTES, should a triton take more.
CONVERSION_ELEMENTS = 16384


@triton.constexpr_function
def epilogue_bytes(block_m: int, block_n: int, c_bytes: int) -> int:
    """The bytes of a whole tile of C (and of GELU's or SiLU's pre-activation, in C's
    dtype), which the stores take through shared memory for their layout conversion.
    Called by the kernel at compile time and by the host's pruning: one rule for both."""
    return block_m * block_n * c_bytes


@triton.constexpr_function
def epilogue_parts(block_m: int, block_n: int, c_bytes: int) -> int:
    """In how many parts of BLOCK_N / parts columns the kernel stores a tile: 1, or,
    where a whole tile's conversion would take more than EPILOGUE_SCRATCH bytes, parts
    of EPILOGUE_PART bytes: 4 (the kernel stores in 1 or 4; only 128x256 of FP32 takes
    parts)."""
    whole = epilogue_bytes(block_m, block_n, c_bytes)
    return 1 if whole <= EPILOGUE_SCRATCH else whole // EPILOGUE_PART


def stores_in_parts(config: triton.Config, *, c_bytes: int) -> bool:
    """Whether the kernel stores each tile of ``config`` in parts."""
    bm, bn, _, _ = tile(config)
    return epilogue_parts(bm, bn, c_bytes) > 1


def smem_estimate(config: triton.Config, *, c_bytes: int, c_aligned: bool) -> int:
    """An upper bound on the shared memory ``config`` takes: each stage holds a tile of
    A and B (16-bit), and the epilogue converts the accumulator's layout through at most
    BLOCK_M x BLOCK_N elements of C, a part of them where it stores in parts
    (``epilogue_parts``), and, where C (and G) are aligned (``C_ALIGNED``), at most
    CONVERSION_ELEMENTS of them; 1 KB for the barriers. (Unaligned, the conversion may
    take the whole part: 256x128 of FP16 in 4 stages took 262,176 bytes with C's rows
    264 elements apart, on an H200 under triton 3.6 and compiled here under 3.9, and
    229,408 with them 512 apart.) Checked against the compiled binaries by ``python -m
    mpgemm.kernels.aot`` (a binary over SMEM_BYTES is a defect there)."""
    bm, bn, bk, _ = tile(config)
    stage = (bm + bn) * bk * 2
    part = epilogue_bytes(bm, bn, c_bytes) // epilogue_parts(bm, bn, c_bytes)
    conversion = min(part, CONVERSION_ELEMENTS * c_bytes) if c_aligned else part
    return config.num_stages * stage + conversion + 1024


def fits(
    config: triton.Config,
    *,
    c_bytes: int,
    c_aligned: bool,
    store_preact: bool,
    epilogue: bool,
    relu_grad: bool,
    narrow: bool,
) -> bool:
    """Whether ``config`` suits such a launch on Hopper and compiles for it within the
    shared memory and without register spills (the binaries of ``python -m
    mpgemm.kernels.aot``, under Triton 3.6 and 3.9): tiles at most NARROW_N wide serve
    launches of at most that many columns (``narrow``) only;
    storing GELU's or SiLU's pre-activation beside the output is held to an accumulator
    of fewer than 128 registers per thread (the activation's erf or exp over more made
    128x256 and 64x256 spill 56 to 400 bytes under 3.9), and a tile stored in parts
    leaves no registers for a bias or an activation or a ReLU's mask (``epilogue``:
    128x256 of FP32 logits plus a bias spilled 24 bytes under Triton 3.6); weight
    gradients, FP32 and without either, take it. An input gradient masked by a ReLU's
    output and summed by column (``relu_grad``) takes tiles of at most 64x256: 128x256
    and 256x128 spilled 8 to 56 bytes under 3.9 (254 and 255 registers; 199 to 246, no
    spills, under 3.6). An epilogue storing an FP32 or unaligned C takes no 8-warp
    tile: 128x128 spilled 48 bytes with FP32 logits plus a bias, 8 with an unaligned C
    plus a bias and a ReLU, under 3.9 (255 registers).
    An unaligned C (``c_aligned`` false: its stores element by element) halves those
    budgets: with a bias and a ReLU 128x256 and 64x256 spilled 140 and 32 bytes under
    3.9, and storing GELU's pre-activation 128x128, 128x64 and 64x128 208 to 568
    (SiLU's 16 to 72); 64x64 none, nor any tile of a plain product."""
    bm, bn, _, warps = tile(config)
    if bn <= NARROW_N and not narrow:
        return False
    accumulator = bm * bn // (32 * warps)  # FP32 registers a thread
    if store_preact and accumulator >= (128 if c_aligned else 64):
        return False
    if epilogue and not c_aligned and accumulator >= 128:
        return False
    if relu_grad and bm * bn > 64 * 256:
        return False
    if epilogue and (c_bytes == 4 or not c_aligned) and warps == 8:
        return False
    if epilogue and stores_in_parts(config, c_bytes=c_bytes):
        return False
    return smem_estimate(config, c_bytes=c_bytes, c_aligned=c_aligned) <= SMEM_BYTES


def _prune_configs(configs, named_args, **kwargs):
    return [
        config
        for config in configs
        if fits(
            config,
            c_bytes=named_args["c_ptr"].element_size(),
            c_aligned=kwargs["C_ALIGNED"],
            store_preact=kwargs["STORE_PREACT"],
            epilogue=kwargs["HAS_BIAS"] or kwargs["ACTIVATION"] is not None or kwargs["RELU_GRAD"],
            relu_grad=kwargs["RELU_GRAD"],
            narrow=named_args["N_BUCKET"] <= NARROW_N,
        )
    ]


GPU_CONFIGS = _single_config() if SINGLE_CONFIG else _hopper_configs()
CONFIGS = _interpreter_configs() if INTERPRET else GPU_CONFIGS


@triton.jit
def _load_tile(desc, batch, off_rows, off_cols, TRANSPOSED: tl.constexpr, BATCHED: tl.constexpr):
    """The tile at (off_rows, off_cols) of a matrix ``desc`` describes, or, when
    TRANSPOSED, describes the transpose of; when BATCHED, ``desc`` describes a batch of
    them, and the tile is matrix ``batch``'s."""
    if TRANSPOSED:
        if BATCHED:
            block = desc.load([batch, off_cols, off_rows])
            block = tl.reshape(block, (block.shape[1], block.shape[2])).T
        else:
            block = desc.load([off_cols, off_rows]).T
    else:
        if BATCHED:
            block = desc.load([batch, off_rows, off_cols])
            block = tl.reshape(block, (block.shape[1], block.shape[2]))
        else:
            block = desc.load([off_rows, off_cols])
    return block


@triton.jit(do_not_specialize=["M_BUCKET", "N_BUCKET", "K_BUCKET"])
def _gemm_tma_kernel(
    # operands (descriptors) and outputs (pointers)
    a_desc,
    b_desc,
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
    stride_cm,
    stride_cn,
    stride_gm,
    stride_gn,
    stride_bias,
    # what to compute, as in the pointer kernel
    COMPUTE_BF16: tl.constexpr,
    INTERPRETED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    RELU_GRAD: tl.constexpr,
    C_SUMS: tl.constexpr,
    # COLUMN_SUM_ROWS, as in the pointer kernel
    SUM_ROWS: tl.constexpr,
    # operands_aligned() of C and G, their pointers and strides: the JIT specialises
    # on it anyway; as an argument the autotune key and pruning see it too (the
    # epilogue's shared memory: smem_estimate)
    C_ALIGNED: tl.constexpr,
    # a_desc describes A.T; b_desc describes B.T
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    # programs in the grid: one per SM
    NUM_SMS: tl.constexpr,
    # tiling
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    # A batch of products (BATCHED), given by keyword by batched launches only (the
    # defaults are one product, so that unbatched launches compile, and are keyed
    # on the host, as they would without a batch): C is (BATCH, M, N), C's batch
    # stride stride_cb; a_desc (b_desc) describes a batch of matrices, batch first
    # (A_BATCHED), or one matrix that every product reads.
    BATCH=1,
    stride_cb=0,
    BATCHED: tl.constexpr = False,
    A_BATCHED: tl.constexpr = False,
    B_BATCHED: tl.constexpr = False,
    # C is the sum of PRODUCTS products (the gradient of an operand broadcast over the
    # batch): each tile's K loop runs over their K tiles one product after another, so
    # the sum is accumulated in FP32 and rounded once. Split over the programs, when
    # BATCHED: C[i] is the sum of the i-th PER_SPLIT of them (FP32 partials).
    PER_SPLIT=1,
    PRODUCTS=1,
    SUM_BATCH: tl.constexpr = False,
    # programmatic dependent launch (mpgemm.kernels.dependent_launch)
    PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if BATCHED:  # the batch's products' tiles, one product after another
        num_tiles *= BATCH
    k_tiles = tl.cdiv(K, BLOCK_K)
    compute_dtype = tl.bfloat16 if COMPUTE_BF16 else tl.float16
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        if BATCHED:
            batch = tile_id // (num_pid_m * num_pid_n)
            pid_m, pid_n = grouped_tile(
                tile_id % (num_pid_m * num_pid_n), num_pid_m, num_pid_n, GROUP_M
            )
            c_tile = c_ptr + batch.to(tl.int64) * stride_cb
        else:
            batch = 0
            pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
            c_tile = c_ptr
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The products this tile's K loop reads: its own, or, summing, PER_SPLIT (fewer
        # at the batch's end) from part ``batch``'s first on.
        if SUM_BATCH:
            first = batch * PER_SPLIT
            k_steps = tl.minimum(PER_SPLIT, PRODUCTS - first) * k_tiles
        else:
            first = batch
            k_steps = k_tiles
        for kt in range(k_steps):
            product = first + kt // k_tiles if SUM_BATCH else first
            off_k = (kt % k_tiles if SUM_BATCH else kt) * BLOCK_K
            a = _load_tile(a_desc, product, off_m, off_k, A_T, A_BATCHED)
            b = _load_tile(b_desc, product, off_k, off_n, B_T, B_BATCHED)
            acc = dot_rounded(a, b, acc, compute_dtype, INTERPRETED)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        # The stores take the accumulator through shared memory (a layout conversion),
        # a whole tile or quarters of BLOCK_N / 4 columns (epilogue_parts): quarter h is
        # columns [h * BLOCK_N / 4, (h + 1) * BLOCK_N / 4), split off a reshaped view's
        # last axis by the bits of h, its high bit first.
        parts: tl.constexpr = epilogue_parts(
            BLOCK_M, BLOCK_N, c_ptr.dtype.element_ty.primitive_bitwidth // 8
        )
        tl.static_assert(parts == 1 or parts == 4)
        if parts == 4:
            high_0, high_1 = tl.split(
                tl.permute(tl.reshape(acc, (BLOCK_M, 2, 2, BLOCK_N // 4)), (0, 3, 2, 1))
            )
            p0, p1 = tl.split(high_0)
            p2, p3 = tl.split(high_1)
        for h in tl.static_range(parts):
            if parts == 1:
                part = acc
            elif h == 0:
                part = p0
            elif h == 1:
                part = p1
            elif h == 2:
                part = p2
            else:
                part = p3
            offs_n = off_n + h * (BLOCK_N // parts) + tl.arange(0, BLOCK_N // parts)
            stored = store_epilogue(
                part,
                offs_m,
                offs_n,
                M,
                N,
                c_tile,
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
                    stored, off_m, offs_n, M, N, p_ptr, BLOCK_M, SUM_ROWS, INTERPRETED
                )
    if C_SUMS:
        # The arrivals after the tile loop: an atomic inside it stopped triton 3.9
        # pipelining the loop (no wgmma in flight, one stage of shared memory).
        for tile_id in range(tl.program_id(0), num_tiles, NUM_SMS):
            pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
            finish_column_sums(
                pid_n * BLOCK_N,
                N,
                pid_n,
                num_pid_m,
                M,
                p_ptr,
                r_ptr,
                counter_ptr,
                BLOCK_N,
                SUM_ROWS,
            )


_AUTOTUNE_KEY = [
    "M_BUCKET",
    "N_BUCKET",
    "K_BUCKET",
    "COMPUTE_BF16",
    "HAS_BIAS",
    "ACTIVATION",
    "STORE_PREACT",
    "RELU_GRAD",
    "C_SUMS",
    "C_ALIGNED",
    "A_T",
    "B_T",
    "BATCHED",
    "A_BATCHED",
    "B_BATCHED",
    "SUM_BATCH",
]
# (triton adds C's dtype, which pruning reads, to the key itself.)
# ``_gemm_tma_kernel`` is the JIT function (its name is what launch records and the compile
# reports show); ``tuned_gemm_tma_kernel`` the autotuner around it, which launches take.
tuned_gemm_tma_kernel = triton.autotune(
    configs=CONFIGS,
    key=_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": _prune_configs},
    cache_results=True,
)(_gemm_tma_kernel)


def _describable(t: torch.Tensor, transposed: bool) -> bool:
    """Whether a TMA descriptor can describe ``t`` (or t.T when ``transposed``): a unit
    stride last, the other strides and the base 16-byte aligned, no empty dimension. A
    batch of matrices, (B, rows, cols), is described batch first, or as its first
    matrix where its batch stride is 0 (one matrix for every product)."""
    strides = t.stride()
    if len(strides) == 2:
        rows, cols = strides
        batch = 0
    else:
        batch, rows, cols = strides
    if transposed:
        rows, cols = cols, rows
    size = t.element_size()
    return (
        cols == 1
        and (rows * size) % 16 == 0
        and (batch * size) % 16 == 0
        and t.data_ptr() % 16 == 0
        and t.numel() > 0
    )


def tma_operand(t: torch.Tensor, compute_dtype: torch.dtype) -> bool:
    """Whether the TMA kernel can read ``t`` as an operand: already in the compute dtype
    (it converts nothing), and describable as itself or, where its last stride is not 1,
    as its transpose."""
    return t.dtype == compute_dtype and _describable(t, t.stride(-1) != 1)


def tma_layout(
    a: torch.Tensor, b: torch.Tensor, compute_dtype: torch.dtype
) -> tuple[bool, bool] | None:
    """(A_T, B_T) for a launch the TMA kernel can run, else None: A and B each a
    ``tma_operand``. A and B: (M, K) and (K, N), or batches of them, (B, M, K) and
    (B, K, N)."""
    if not (tma_operand(a, compute_dtype) and tma_operand(b, compute_dtype)):
        return None
    return a.stride(-1) != 1, b.stride(-1) != 1


_bound = threading.local()


def bind_context(t: torch.Tensor) -> None:
    """Bind the primary CUDA context of ``t``'s device to this thread, once per thread
    (nothing for a tensor not on a GPU). Triton encodes the descriptors with the driver
    before its launcher binds a context: on an H100, a first backward whose first GEMM
    was this kernel's failed in autograd's device thread with "Failed to create tensor
    map descriptor: invalid device context" (bench/results/h100-2026-11-22; not
    reproduced in a fresh process since). Torch's inductor calls set_device before its
    Triton launches for the same reason."""
    if t.is_cuda and getattr(_bound, "device", None) != t.device:
        torch.cuda.set_device(t.device)
        _bound.device = t.device


def _batched(t: torch.Tensor) -> bool:
    # Whether the descriptor of ``t`` describes a batch (_descriptor), not one matrix.
    return t.dim() == 3 and t.stride(0) != 0


class _Vouched(TensorDescriptor):
    """A descriptor made without ``TensorDescriptor``'s checks (its ``__post_init__``: the
    rank, the base's and the strides' 16-byte alignment, a unit last stride, positive
    sizes), each a function of what ``triton_gemm``'s signature holds (shapes, strides,
    dtypes, alignment): a replay's, whose signature's first launch passed them. They
    took about 2 of the 21 us of host time of a replayed ``mpgemm.matmul``
    (``bench/host_time.py``). The launcher reads it as it reads triton's."""

    def __post_init__(self) -> None:
        pass


def _descriptor(
    t: torch.Tensor, transposed: bool, kind: type[TensorDescriptor], tile: list[int] | None
) -> TensorDescriptor:
    """``t``'s descriptor (its transpose's where ``transposed``), reading ``tile``; None:
    a placeholder, which the config's pre-hook replaces (_set_block_shapes)."""
    tile = tile or [16, 16]
    if t.dim() == 2:
        view = t.t() if transposed else t
        return kind(view, list(view.shape), list(view.stride()), tile)
    view = t.transpose(1, 2) if transposed else t
    if not _batched(view):  # one matrix, read by every product
        view = view[0]
    return kind(view, list(view.shape), list(view.stride()), _block_shape(view.dim(), tile))


def launch_tma_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    g: torch.Tensor | None,
    layout: tuple[bool, bool],
    sms: int,
    flags: dict,
    column: tuple[torch.Tensor, ...] | None = None,
    per_split: int | None = None,
) -> Launched | None:
    """Launch the TMA kernel (``triton_gemm`` has allocated the outputs and checked
    ``tma_layout``, which gave ``layout``); ``flags``: the epilogue's constexprs.
    A batch of products: a, b and c are (B, M, K), (B, K, N) and (B, M, N) views (a
    batch stride of 0 where an operand is broadcast), with no bias or G. With
    ``per_split``, their sum instead (``SUM_BATCH``): c is (M, N), or (S, M, N), FP32
    partials, C[i] the sum of products i * per_split on, per_split of them or fewer.
    Returns what ``launch`` returns."""
    M, N = a.shape[-2], b.shape[-1]
    a_t, b_t = layout
    stored = [c] if g is None else [c, g]
    c_aligned = operands_aligned(stored, [s for t in stored for s in t.stride()])
    flags = {**flags, "C_ALIGNED": c_aligned, "A_T": a_t, "B_T": b_t, "NUM_SMS": sms}
    batch = 1  # outputs whose tiles the grid walks: products, or partial sums
    if c.dim() == 3:
        batch = c.shape[0]
        flags.update(BATCH=batch, stride_cb=c.stride(0), BATCHED=True)
    if a.dim() == 3:
        flags.update(A_BATCHED=_batched(a), B_BATCHED=_batched(b))
    if per_split is not None:
        flags.update(PER_SPLIT=per_split, PRODUCTS=a.shape[0], SUM_BATCH=True)

    def grid(meta):
        tiles = cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])
        return (min(sms, tiles * batch),)

    return launch(
        tuned_gemm_tma_kernel,
        grid,
        *tma_tensors(a, b, c, bias, g, column, layout),
        *tma_integers(a, b, c, bias, g),
        gpu_configs=lambda: _prune_configs(
            GPU_CONFIGS, {"c_ptr": c, "N_BUCKET": size_bucket(N)}, **flags
        ),
        **flags,
    )


def tma_tensors(
    a,
    b,
    c,
    bias,
    g,
    column,
    layout: tuple[bool, bool],
    *,
    tiles: tuple[list[int], list[int]] | None = None,
) -> tuple:
    """The TMA kernel's leading arguments: A's and B's descriptors (``tma_descriptors``),
    then C, the bias, G, and C's column sums, their partials and counters
    (``tma_pointers``)."""
    return (*tma_descriptors(a, b, layout, tiles=tiles), *tma_pointers(c, bias, g, column))


def tma_descriptors(
    a, b, layout: tuple[bool, bool], *, tiles: tuple[list[int], list[int]] | None = None
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """A's and B's descriptors (``layout``: whether each is described as its transpose).
    Binds the device's context to this thread first, which the descriptors' encoding at
    launch needs (``bind_context``). ``tiles``: a replay's (the tensors match a signature
    whose descriptors were checked before: ``_Vouched``), the tiles of its config
    (``tile_shapes``), with which the descriptors are made, so that no pre-hook need set
    them: a replayed 512^2 ``mpgemm.matmul`` took 24.0 us of host time with it, 22.9
    without (``bench/host_time.py``'s stubs)."""
    bind_context(a)
    a_t, b_t = layout
    kind = TensorDescriptor if tiles is None else _Vouched
    a_tile, b_tile = (None, None) if tiles is None else tiles
    return _descriptor(a, a_t, kind, a_tile), _descriptor(b, b_t, kind, b_tile)


def tma_pointers(c, bias, g, column) -> tuple[torch.Tensor, ...]:
    """The TMA kernel's tensor arguments after the descriptors: C, the bias, G, and C's
    column sums, their partials and counters (``column``); C where absent, so that no
    null pointer is formed."""
    return (
        c,
        bias if bias is not None else c,
        g if g is not None else c,
        *(column if column is not None else (c, c, c)),
    )


def tma_integers(a, b, c, bias, g) -> tuple[int, ...]:
    """The TMA kernel's integer arguments, after ``tma_tensors``'s: M, N, K, their size
    buckets, and the strides of C, G and the bias."""
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    return (
        M,
        N,
        K,
        size_bucket(M),
        size_bucket(N),
        size_bucket(K),
        c.stride(-2),
        c.stride(-1),
        *(g.stride() if g is not None else (0, 0)),
        bias.stride(0) if bias is not None else 0,
    )
