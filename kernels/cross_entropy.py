"""Cross-entropy of logits against class indices in FP32, forward and backward in one
launch each, for ``mpgemm.cross_entropy``:

    s[i]    = log(sum_c exp(x[i, c] - m[i])),  m[i] = max_c x[i, c]
    loss[i] = s[i] - (1 - eps) (x[i, t[i]] - m[i]) - (eps / C) sum_c (x[i, c] - m[i])
              (0 where t[i] == ignore_index; NaN where t[i] is out of range)
    out     = loss (reduction "none"), sum_i loss[i] ("sum"), or that sum over the
              count of rows not ignored ("mean")
    dx[i, c] = g[i] (p[i, c] - (1 - eps) [c == t[i]] - eps / C),
              p[i, c] = exp((x[i, c] - m[i]) - s[i])
              (NaN where t[i] is out of range), g[i] the output's gradient (over
              the count: "mean"); in an ignored row p[i, c] * 0: torch's 0 - p * 0
              of its log-softmax's backward, NaN where the row's logits make p NaN
              (a NaN, +inf), else 0

torch.nn.functional.cross_entropy's math with class-index targets (label smoothing
included), each logit widened to FP32, the sums in FP32, the log-softmax taken as torch
takes it, (x - m) - s: the log-sum-exp m + s is never formed, whose rounding at the
logits' magnitude (a ulp of 300 is 3e-5) made the gradient 30 to 100 times torch's
error against FP64 where logits reached the hundreds. The forward saves m and s.
torch takes two launches forward (log-softmax, NLL) and three backward (NLL's zeros
and scatter, log-softmax's backward); here one each. The forward's sum over the rows
is finished by the last program to arrive (``mpgemm.kernels.arrivals``), adding the
programs' partial sums in a fixed order (BLOCK_P at a time), so it is the same run to
run. Each program takes BLOCK_M rows and walks their logits BLOCK_C at a time: twice
forward (the maximum, then the sums), once backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpgemm.kernels.arrivals import arrive, counters, leave
from mpgemm.kernels.dependent_launch import wait_for_prior_grid
from mpgemm.kernels.gemm_common import INTERPRET, cdiv
from mpgemm.kernels.launches import launch
from mpgemm.kernels.rounding import cast_rne, widen

# A program's rows at least, and its columns at most (``blocks``).
BLOCK_M = 16
BLOCK_C = 128
# Programs' partial sums the forward's last program adds at a time.
BLOCK_P = 256
REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


@triton.jit
def _logits(x_rows, in_rows, c0, C, stride_xc, INTERPRETED: tl.constexpr, BLOCK_C: tl.constexpr):
    """(cols, mask, x): the BLOCK_C columns from ``c0`` on of the rows ``x_rows`` points
    at (those of ``in_rows``), and their logits widened to FP32 (0 outside ``mask``)."""
    cols = c0 + tl.arange(0, BLOCK_C)
    mask = in_rows[:, None] & (cols < C)[None, :]
    x = widen(tl.load(x_rows + cols[None, :] * stride_xc, mask=mask, other=0.0), INTERPRETED)
    return cols, mask, x


@triton.jit
def _cross_entropy_forward_kernel(
    x_ptr,
    t_ptr,
    out_ptr,
    lse_ptr,
    partial_ptr,
    count_ptr,
    counter_ptr,
    N,
    C,
    stride_xn,
    stride_xc,
    ignore_index,
    smoothing,
    smoothing_per_class,
    REDUCTION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    # programmatic dependent launch (mpgemm.kernels.dependent_launch)
    PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < N
    rows64 = rows.to(tl.int64)
    t = tl.load(t_ptr + rows64, mask=in_rows, other=0)
    ignored = t == ignore_index
    x_rows = x_ptr + rows64[:, None] * stride_xn
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols, mask, x = _logits(x_rows, in_rows, c0, C, stride_xc, INTERPRETED, BLOCK_C)
        x = tl.where(mask, x, float("-inf"))
        # torch.maximum's: a NaN logit makes the row's maximum NaN (max.f32 drops it).
        m = tl.maximum(m, tl.max(x, axis=1), propagate_nan=tl.PropagateNan.ALL)
    exp_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    shifted_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # of x - m
    x_t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols, mask, x = _logits(x_rows, in_rows, c0, C, stride_xc, INTERPRETED, BLOCK_C)
        shifted = tl.where(mask, x - m[:, None], float("-inf"))
        exp_sum += tl.sum(tl.exp(shifted), axis=1)
        if smoothing != 0.0:
            shifted_sum += tl.sum(tl.where(mask, shifted, 0.0), axis=1)
        x_t += tl.sum(tl.where(cols[None, :] == t[:, None], x, 0.0), axis=1)
    s = tl.log(tl.where(in_rows, exp_sum, 1.0))  # (rows past N: not stored)
    # (x_t - m: the target's logit shifted after the loop, the same bits as within it)
    loss = s - (1.0 - smoothing) * (x_t - m)
    if smoothing != 0.0:  # (without, a -inf logit's 0 x -inf would make the loss NaN)
        loss -= smoothing_per_class * shifted_sum
    loss = tl.where((t < 0) | (t >= C), float("nan"), loss)
    loss = tl.where(ignored, 0.0, loss)
    tl.store(lse_ptr + rows64, m, mask=in_rows)
    tl.store(lse_ptr + N + rows64, s, mask=in_rows)
    if REDUCTION == 0:
        tl.store(
            out_ptr + rows64, cast_rne(loss, out_ptr.dtype.element_ty, INTERPRETED), mask=in_rows
        )
    else:
        # This program's sum and count (the partials: sums, then counts), then the
        # last program's over all of them, BLOCK_P at a time: a fixed order.
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        tl.store(partial_ptr + pid, tl.sum(tl.where(in_rows, loss, 0.0), axis=0))
        kept = (in_rows & ~ignored).to(tl.float32)
        tl.store(partial_ptr + programs + pid, tl.sum(kept, axis=0))
        if arrive(counter_ptr, programs):
            totals = tl.zeros((BLOCK_P,), dtype=tl.float32)
            counts = tl.zeros((BLOCK_P,), dtype=tl.float32)
            for p0 in range(0, programs, BLOCK_P):
                # Past L1, which another SM's stores do not update.
                ps = p0 + tl.arange(0, BLOCK_P)
                totals += tl.load(
                    partial_ptr + ps, mask=ps < programs, other=0.0, cache_modifier=".cg"
                )
                counts += tl.load(
                    partial_ptr + programs + ps, mask=ps < programs, other=0.0, cache_modifier=".cg"
                )
            total = tl.sum(totals, axis=0)
            count = tl.sum(counts, axis=0)
            if REDUCTION == 2:
                total = tl.div_rn(total, count)  # (IEEE division, as torch's)
            tl.store(out_ptr, cast_rne(total, out_ptr.dtype.element_ty, INTERPRETED))
            tl.store(count_ptr, count)
            leave(counter_ptr)


@triton.jit
def _cross_entropy_backward_kernel(
    x_ptr,
    t_ptr,
    lse_ptr,
    grad_ptr,
    count_ptr,
    dx_ptr,
    stride_g,
    stride_dn,
    N,
    C,
    stride_xn,
    stride_xc,
    ignore_index,
    smoothing,
    smoothing_per_class,
    REDUCTION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    # programmatic dependent launch (mpgemm.kernels.dependent_launch)
    PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_rows = rows < N
    rows64 = rows.to(tl.int64)
    mask = in_rows[:, None] & (cols < C)[None, :]
    t = tl.load(t_ptr + rows64, mask=in_rows, other=0)
    m = tl.load(lse_ptr + rows64, mask=in_rows, other=0.0)
    s = tl.load(lse_ptr + N + rows64, mask=in_rows, other=0.0)
    if REDUCTION == 0:
        g = widen(tl.load(grad_ptr + rows64 * stride_g, mask=in_rows, other=0.0), INTERPRETED)
    else:
        g = widen(tl.load(grad_ptr), INTERPRETED)
        if REDUCTION == 2:
            g = tl.div_rn(g, tl.load(count_ptr))
        g = tl.zeros((BLOCK_M,), dtype=tl.float32) + g
    x = widen(
        tl.load(x_ptr + rows64[:, None] * stride_xn + cols[None, :] * stride_xc, mask=mask),
        INTERPRETED,
    )
    target = tl.where(cols[None, :] == t[:, None], 1.0 - smoothing, 0.0)
    p = tl.exp((x - m[:, None]) - s[:, None])
    dx = (p - target - smoothing_per_class) * g[:, None]
    # NaN where the forward's loss is NaN for the target's range; where ignored, p * 0
    # (the module docstring), whatever g.
    dx = tl.where(((t < 0) | (t >= C))[:, None], float("nan"), dx)
    dx = tl.where((t == ignore_index)[:, None], p * 0.0, dx)
    dx_ptrs = dx_ptr + rows64[:, None] * stride_dn + cols[None, :]
    tl.store(dx_ptrs, cast_rne(dx, dx_ptr.dtype.element_ty, INTERPRETED), mask=mask)


def blocks(C: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_C) for C classes: columns BLOCK_C at a time (C's power of two, 16
    to 128), BLOCK_M rows, 16 or enough for 512 places. A 10-class head's programs took
    16 rows of 128 columns, 10 of them logits, until 2026-11-26 (11.3 us forward for the
    guide's 8192 rows on an H200, run8); 32 rows of 16 now, and 56 registers a thread
    where they took 164 (sm_90a, its rows unaligned; the backward 24 where 48)."""
    # (1 << bit_length: triton.next_power_of_2 is a JIT function, some 5 us a call)
    block_c = min(BLOCK_C, max(16, 1 << (C - 1).bit_length()))
    return max(BLOCK_M, 512 // block_c), block_c


def _shared_arguments(
    x: torch.Tensor, ignore_index: int, reduction: str, smoothing: float
) -> tuple[tuple, dict]:
    """Both kernels' last positional arguments and their keyword arguments."""
    N, C = x.shape
    # smoothing / C in double, as torch takes it
    tail = (N, C, x.stride(0), x.stride(1), ignore_index, smoothing, smoothing / C)
    block_m, block_c = blocks(C)
    options = dict(
        REDUCTION=REDUCTIONS[reduction],
        INTERPRETED=INTERPRET,
        BLOCK_M=block_m,
        BLOCK_C=block_c,
        num_warps=4,
    )
    return tail, options


def triton_cross_entropy(
    x: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, count): the forward of the module docstring. x: (N, C) float32,
    float16 or bfloat16, any strides; target: (N,) int64. loss: x's dtype, (N,) for
    "none", else (); lse: (2, N) FP32, each row's log-sum-exp in its two parts, m then
    s; count: () FP32, the rows not ignored (for "sum" and "mean"; unset for "none")."""
    N, C = x.shape
    reduced = reduction != "none"
    out = torch.empty(() if reduced else (N,), device=x.device, dtype=x.dtype)
    lse = torch.empty((2, N), device=x.device, dtype=torch.float32)
    count = torch.empty((), device=x.device, dtype=torch.float32)
    tail, options = _shared_arguments(x, ignore_index, reduction, smoothing)
    programs = cdiv(N, options["BLOCK_M"])
    if programs == 0:  # no rows: torch's sum is 0, its mean 0 / 0
        if reduced:
            out.fill_(0.0 if reduction == "sum" else float("nan"))
            count.fill_(0.0)
        return out, lse, count
    partial = torch.empty(2 * programs, device=x.device, dtype=torch.float32) if reduced else lse
    launch(
        _cross_entropy_forward_kernel,
        (programs,),
        x,
        target,
        out,
        lse,
        partial,
        count,
        counters(x.device, 1) if reduced else lse,
        *tail,
        BLOCK_P=BLOCK_P,
        **options,
    )
    return out, lse, count


def padded_rows(N: int, C: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty (N, C) tensor whose rows lie 16 elements apart, or a multiple of that
    (a view of the first C columns of (N, C') rows), unless C' would be more than twice
    C (a handful of classes): the GEMMs of a head's backward read the logits'
    gradient, and only from rows so placed can they load it 16 bytes at a time (the
    guide's 10-class head: its input gradient took 36.7 us instead of 41.9 on an H200,
    run8's profile, ``head dX fp32 padded``). A few bytes a row more."""
    padded = -(-C // 16) * 16
    if padded > 2 * C:
        padded = C
    # (one call: a slice of an (N, padded) tensor cost 4 us more of host time)
    return torch.empty_strided((N, C), (padded, 1), device=device, dtype=dtype)


def triton_cross_entropy_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    count: torch.Tensor,
    ignore_index: int,
    reduction: str,
    smoothing: float,
) -> torch.Tensor:
    """dx, (N, C) in x's dtype (``padded_rows``): the backward of the module docstring,
    from the loss's gradient ``grad`` ((N,) for "none", else ()) and the forward's
    ``lse`` ((2, N): m and s) and ``count``."""
    N, C = x.shape
    dx = padded_rows(N, C, x.dtype, x.device)
    if N == 0 or C == 0:
        return dx
    tail, options = _shared_arguments(x, ignore_index, reduction, smoothing)
    launch(
        _cross_entropy_backward_kernel,
        (cdiv(N, options["BLOCK_M"]), cdiv(C, options["BLOCK_C"])),
        x,
        target,
        lse,
        grad,
        count,
        dx,
        grad.stride(0) if grad.dim() else 0,
        dx.stride(0),
        *tail,
        **options,
    )
    return dx
