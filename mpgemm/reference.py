"""Reference implementations, with the kernels' numerics, in plain PyTorch.

Operands are rounded to the compute dtype (FP16 or BF16), products accumulate in FP32,
bias and activation are applied in FP32, and only then is the result rounded to the
output dtype. ``gemm_ref`` has the contract of ``mpgemm.kernels.gemm.triton_gemm`` and
``activation_backward_ref`` that of ``mpgemm.kernels.activation``'s launcher; both run
CPU tensors when the Triton interpreter is off; ``matmul_ref`` and ``linear_ref``
are the references the tests and benchmarks compare against.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F

_F = TypeVar("_F", bound=Callable)


def _autocast_off(fn: _F) -> _F:
    """``fn`` (whose first argument is a tensor) run with autocast off for that tensor's
    device. These products state their precision, FP32 accumulation of rounded
    operands, as the kernels do; an enclosing ``torch.autocast`` would round the FP32
    product to 16 bits before its bias, activation and output rounding (0.12 off in a
    BF16 product over K = 256, where the kernels' results do not move)."""

    @functools.wraps(fn)
    def wrapper(t: torch.Tensor, *args, **kwargs):
        kind = t.device.type
        off = (
            torch.autocast(kind, enabled=False)
            if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
            else contextlib.nullcontext()
        )
        with off:
            return fn(t, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def compute_dtype_for(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """The compute dtype of a product of ``a`` and ``b`` when none is given: BF16 where
    either is BF16 (rounded to FP16, a BF16 value beyond 65504 would become inf; torch
    computes BF16 operands in BF16), else FP16. (No generator: an eager GEMM asks.)"""
    bf16 = torch.bfloat16
    return bf16 if a.dtype == bf16 or b.dtype == bf16 else torch.float16


def dz_rounding(grad_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype an activation's dZ = dY * act'(z) is rounded to from FP32, once: the
    coarser of dY's (y's) and the compute dtype. dZ goes to the GEMMs' node as y's
    gradient, in y's dtype (autograd casts it to that), and the GEMMs round it to the
    compute dtype; a value of the coarser dtype passes both exactly (bar FP16's range),
    where rounding to the finer first rounded it twice (an FP16 layer writing BF16, a
    BF16 layer writing FP16)."""
    coarser = torch.finfo(compute_dtype).eps >= torch.finfo(grad_dtype).eps
    return compute_dtype if coarser else grad_dtype


def round_to(t: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``compute_dtype`` and widened back to FP32 (exact)."""
    return t.to(compute_dtype).to(torch.float32)


def saturated(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 ``t`` with its finite values beyond ``dtype``'s range clamped to its largest
    finite value of their sign (so that rounding to ``dtype`` keeps them finite); inf
    and NaN as they are."""
    big = torch.finfo(dtype).max
    return torch.where(t.isfinite(), t.clamp(-big, big), t)


# torch's own function for each activation the layers fuse: what an mpgemm.Linear of a
# dtype outside mixed precision (FP64) runs, and the tests' and benchmarks' baseline.
TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}


def torch_activation(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    """act(z) by torch's own function (``TORCH_ACTIVATIONS``), in z's dtype; z itself
    for None."""
    return z if activation is None else TORCH_ACTIVATIONS[activation](z)


def activation_value(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    """act(z), z FP32 (z itself for None): torch's ReLU and tanh GELU, and GELU's and
    SiLU's values by the formulas ``activation_derivative`` differentiates."""
    if activation is None:
        return z
    if activation == "relu":
        return torch.relu(z)
    if activation == "gelu_tanh":  # torch's forward
        return F.gelu(z, approximate="tanh")
    if activation == "silu":  # torch's formula (its inf and NaN)
        return z / (1.0 + torch.exp(-z))
    return z * (0.5 * (1.0 + torch.erf(z * 0.7071067811865476)))


def activation_derivative(z: torch.Tensor, activation: str) -> torch.Tensor:
    """act'(z) for GELU (exact erf form, or its tanh approximation) and SiLU, the
    activations whose backward takes it from the stored z; z FP32 (or FP64)."""
    if activation == "gelu_tanh":  # torch's backward's formula
        t = torch.tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        slope = (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
        return 0.5 * (1.0 + t) + 0.5 * z * slope
    if activation == "silu":  # torch's formulas (its inf and NaN)
        s = 1.0 / (1.0 + torch.exp(-z))
        return s * (1.0 + z * (1.0 - s))
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * 0.7071067811865476))
        pdf = torch.exp(-0.5 * z * z) * 0.3989422804014327
        return cdf + z * pdf
    raise ValueError(f"no derivative is taken from z for activation {activation!r}")


@_autocast_off
def gemm_ref(
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
    product: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The math of ``triton_gemm`` (see ``mpgemm.kernels.gemm``), same arguments and
    results: C = act(round(A) @ round(B) + bias), G = the pre-activation z in C's dtype
    if asked (finite values beyond its range clamped to its largest), R = FP32 row
    sums of A; ``sum_batch``: C = the sum of a batch's products over every batch
    dimension after the first ``kept_dims``, in FP32. ``relu_output`` (y): C rounded,
    then 0 where y <= 0 (threshold_backward's rule: a NaN y passes C on); ``colsum_c``:
    R = FP32 column sums of C as stored. ``product(a, b, compute_dtype)``: round(A) @
    round(B) in FP32 (default: torch's product of the rounded operands)."""
    a32 = a.to(torch.float32)
    if product is None:
        z = round_to(a32, compute_dtype) @ round_to(b, compute_dtype)
    else:
        z = product(a, b, compute_dtype)
    if sum_batch and z.dim() > 2 + kept_dims:
        z = z.sum(dim=tuple(range(kept_dims, z.dim() - 2)))
    if bias is not None:
        z = z + bias.to(torch.float32)
    y = activation_value(z, activation)
    if out is None:
        out = y.to(out_dtype)
    else:
        out.copy_(y)
    if relu_output is not None:
        out.masked_fill_(relu_output <= 0, 0)
    g = saturated(z, out.dtype).to(out.dtype) if store_preact else None
    r = None
    if rowsum_a or colsum_c:
        r = out.sum(dim=0, dtype=torch.float32) if colsum_c else a32.sum(dim=1)
    return out, g, r


def activation_backward_ref(
    grad_y: torch.Tensor,
    saved: torch.Tensor,
    activation: str,
    compute_dtype: torch.dtype,
    *,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The math of ``mpgemm.kernels.activation.triton_activation_backward``, same
    arguments and results: (dZ, bias gradient or None), dZ = dY * act'(z), and, if
    ``bias_grad``, dZ's FP32 column sums taken before its rounding.

    grad_y, saved: (M, N). ReLU (``saved`` = y): zero where y <= 0, by torch's
    threshold_backward (a NaN y passes its gradient on; a positive z that underflowed to
    0 in a 16-bit y gets none, as under autocast), exact in dY's dtype. GELU (either
    form) and SiLU (``saved`` = z, their input, as the forward stored it): act'(z) and the
    product in FP32 (torch's formulas: their inf and NaN), rounded once to
    ``dz_rounding(dY's dtype, compute_dtype)``, in dY's dtype."""
    if activation == "relu":
        grad_z = exact = torch.ops.aten.threshold_backward(grad_y, saved, 0)
    else:
        derivative = activation_derivative(saved.to(torch.float32), activation)
        exact = torch.mul(grad_y, derivative)  # FP32, for the sums
        grad_z = exact.to(dz_rounding(grad_y.dtype, compute_dtype)).to(grad_y.dtype)
    return grad_z, torch.sum(exact, dim=0, dtype=torch.float32) if bias_grad else None


def cross_entropy_backward_ref(
    grad: torch.Tensor,
    x: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    count: torch.Tensor,
    ignore_index: int,
    reduction: str,
    smoothing: float,
) -> torch.Tensor:
    """The math of ``mpgemm.kernels.cross_entropy.triton_cross_entropy_backward``, same
    arguments and result: the gradient of the loss with respect to the (N, C) logits
    ``x``, from the loss's gradient ``grad`` ((N,) for "none", else ()), the forward's
    per-row log-sum-exp ``lse`` in its two parts ((2, N) FP32: m, the row's largest
    logit, and the log of its sum of exp(x - m)) and its count of rows not ignored. In
    FP32,

        dx[i, c] = (exp((x[i, c] - lse[0, i]) - lse[1, i]) - (1 - s) [c == t_i] - s / C) * g_i

    with g_i = grad[i] ("none"), grad ("sum") or grad / count ("mean"); NaN on the rows
    whose class index is out of range (as their loss); on the rows ignored, the
    exponential times 0 (torch's 0 - p * 0: NaN where p is, else 0); rounded once to
    x's dtype."""
    classes = x.shape[1]
    ignored = (target == ignore_index)[:, None]
    g = grad.float()
    g = g[:, None] if reduction == "none" else g / count if reduction == "mean" else g
    # g is 0 on the rows ignored, whose dx is the other branch's: differentiated again
    # (create_graph), the branch not taken gets zeros, times g, which for a mean over
    # no rows is inf (grad / 0): NaN, where torch's second derivative is 0.
    g = torch.where(ignored, 0.0, g)
    hit = torch.arange(classes, device=x.device)[None, :] == target[:, None]
    p = torch.exp((x.float() - lse[0, :, None]) - lse[1, :, None])
    dx = (p - hit * (1.0 - smoothing) - smoothing / classes) * g
    dx = dx.masked_fill(((target < 0) | (target >= classes))[:, None], float("nan"))
    return torch.where(ignored, p * 0.0, dx).to(x.dtype)


@_autocast_off
def matmul_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    compute_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``mpgemm.matmul``'s math: ``torch.matmul``'s shapes (a (*, K) @ b (K, N) ->
    (*, N), vectors, batches that broadcast), operands rounded to compute_dtype
    (default ``compute_dtype_for(a, b)``), FP32 accumulation, result of out_dtype
    (default compute_dtype)."""
    compute_dtype = compute_dtype or compute_dtype_for(a, b)
    out = round_to(a, compute_dtype) @ round_to(b, compute_dtype)
    return out.to(out_dtype or compute_dtype)


@_autocast_off
def linear_ref(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    compute_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``mpgemm.linear``'s math: act(round(input) @ round(weight).T + bias) with FP32
    accumulation, bias and activation, rounded to out_dtype (default compute_dtype;
    compute_dtype's default ``compute_dtype_for(input, weight)``)."""
    compute_dtype = compute_dtype or compute_dtype_for(input, weight)
    z = F.linear(round_to(input, compute_dtype), round_to(weight, compute_dtype))
    if bias is not None:
        z = z + bias.to(torch.float32)
    y = activation_value(z, activation)
    return y.to(out_dtype or compute_dtype)
