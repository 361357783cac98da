"""``mpgemm.matmul`` and ``mpgemm.linear``: checks, dispatch and the autograd function.

Both ops run through ``LinearFunction``: ``matmul(a, b)`` is ``linear(a, b.T)`` on a
transposed view, so one forward and one backward serve both.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

from mpgemm.reference import gemm_ref

COMPUTE_DTYPES = (torch.float16, torch.bfloat16)
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
VALID_ACTIVATIONS = (None, "relu", "gelu")

# The backward prologue that applies each activation's derivative to the output gradient:
# ReLU's from its saved output, as torch's threshold_backward does (zero where y <= 0; a
# positive z that underflows to 0 in a 16-bit y gets no gradient, as under autocast),
# GELU's by multiplying with the act'(z) its forward epilogue stored.
_DERIVATIVE_PROLOGUE = {None: None, "relu": "relu_mask", "gelu": "mul"}


def _triton_gemm() -> Callable | None:
    try:
        from mpgemm.kernels.gemm import triton_gemm
    except ImportError:  # no triton on this platform: CPU tensors still run gemm_ref
        return None
    return triton_gemm


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# What makes mpgemm.kernels.launches intercept from its import on (see there).
_INTERCEPT_ENV = ("MPGEMM_RECORD_LAUNCHES", "MPGEMM_PRECOMPILE")


def _intercepting() -> bool:
    # Only launches.py intercepts: until it is imported (or its environment asks for
    # it), nothing is, and the reference path imports no triton module to learn that.
    if "mpgemm.kernels.launches" not in sys.modules and not any(
        os.environ.get(name) for name in _INTERCEPT_ENV
    ):
        return False
    try:
        from mpgemm.kernels.launches import intercepting
    except ImportError:
        return False
    return intercepting()


def backend(device: torch.device | str) -> str:
    """Which implementation runs tensors on ``device`` (a ``torch.device`` or a string
    such as ``"cuda:0"``): ``"triton"`` (compiled for CUDA, or interpreted on the CPU
    when ``TRITON_INTERPRET=1``) or ``"reference"``. While launches are intercepted
    (``mpgemm.kernels.launches``) nothing runs, and CPU tensors take the kernel path too."""
    device = torch.device(device)
    if device.type == "cuda" or (device.type == "cpu" and (_interpreting() or _intercepting())):
        return "triton"
    return "reference"


# The only tensor types that reach the kernels, which read memory from ``data_ptr``.
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.Tensor`` or ``nn.Parameter`` and no other subclass.
    Any other (a DTensor, a user's subclass) takes the reference path, whose torch ops
    it handles."""
    return type(t) in PLAIN_TYPES


def _gemm(device: torch.device, *tensors: torch.Tensor | None) -> Callable:
    """The GEMM for these tensors: under ``torch.compile``, the custom op
    (``mpgemm.ops``), which runs the same implementation opaquely."""
    if torch.compiler.is_compiling():
        from mpgemm.ops import gemm

        return gemm
    return _implementation(device, *tensors)


def _implementation(device: torch.device, *tensors: torch.Tensor | None) -> Callable:
    plain = all(t is None or is_plain(t) for t in tensors)
    if backend(device) == "reference" or not plain:
        return gemm_ref
    impl = _triton_gemm()
    if impl is None:
        raise RuntimeError(f"mpgemm: tensors on {device} need triton, which is not installed")
    return impl


# ---------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------


def _check_compute_dtype(op: str, compute_dtype: torch.dtype) -> None:
    if compute_dtype not in COMPUTE_DTYPES:
        raise TypeError(
            f"{op}: compute_dtype must be torch.float16 or torch.bfloat16, got {compute_dtype}"
        )


def _check_out_dtype(op: str, out_dtype: torch.dtype | None) -> None:
    if out_dtype is not None and out_dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{op}: out_dtype must be None, torch.float32, torch.float16 or torch.bfloat16, "
            f"got {out_dtype}"
        )


def _check_activation(op: str, activation: str | None) -> None:
    if activation not in VALID_ACTIVATIONS:
        raise ValueError(
            f"{op}: unknown activation {activation!r}; valid ones are {VALID_ACTIVATIONS}"
        )


_OPTIONAL = ("bias",)


def _check_tensors(op: str, **tensors: torch.Tensor | None) -> None:
    """Each tensor must be a dense float32/float16/bfloat16 tensor, all on one device;
    only a bias may be None."""
    given: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t is None and name in _OPTIONAL:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        given[name] = t
    for name, t in given.items():
        if t.layout != torch.strided:
            raise TypeError(
                f"{op}: {name} is a {t.layout} tensor; only dense (torch.strided) tensors are "
                "supported (call .to_dense() first)"
            )
        if t.dtype not in INPUT_DTYPES:
            raise TypeError(
                f"{op}: {name} has dtype {t.dtype}; supported are torch.float32, "
                "torch.float16 and torch.bfloat16"
            )
    devices = {t.device for t in given.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in given.items())
        raise ValueError(f"{op}: tensors must be on one device, got {listing}")


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """(*, K) -> (prod(*), K), a view where the strides allow; explicit sizes because
    reshape(-1, 0) is ambiguous for zero-size tensors."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


# ---------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------


class LinearFunction(torch.autograd.Function):
    """y = act(x @ W.T + bias) with 16-bit operands and FP32 accumulation.

    x: (*, K) float32/float16/bfloat16; W: (N, K), any strides; bias: (N,) or None;
    weight_copy: None, or W in the compute dtype (``mpgemm.Linear``'s current copy of
    its FP32 master), which the GEMMs then read in W's place.
    Forward: one GEMM with bias, activation and the output cast in the epilogue. An FP32
    x that the weight gradient needs is rounded to the compute dtype once, and the
    rounded x is what is saved (the GEMMs would round it anyway; half the memory).
    Backward: dZ = dY * act'(z) is applied as the GEMMs load dY, then
    dx = dZ @ W (in x's dtype) and dW = dZ.T @ x (in W's dtype, FP32 for master weights,
    laid out like W), with the bias gradient, the FP32 column sum of dZ, computed by
    the dW GEMM as it reads dZ. Where the TMA kernel runs the GEMMs (it fuses neither),
    dZ and the bias gradient are computed once beforehand, with the same math.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, activation, compute_dtype, out_dtype, weight_copy=None):
        gemm = _gemm(x.device, x, weight, bias, weight_copy)
        x2d = _as_rows(x)
        if ctx.needs_input_grad[1] and x.dtype == torch.float32:
            x2d = x2d.to(compute_dtype)
        w = weight if weight_copy is None else weight_copy
        save_gelu_derivative = activation == "gelu" and any(ctx.needs_input_grad[:3])
        out, act_grad, _ = gemm(
            x2d,
            w.t(),
            compute_dtype=compute_dtype,
            out_dtype=out_dtype,
            bias=bias,
            activation=activation,
            store_act_grad=save_gelu_derivative,
        )
        out = out.view(*x.shape[:-1], weight.shape[0])
        # What the derivative prologue reads: ReLU's own output, GELU's stored act'(z).
        derivative_operand = {None: None, "relu": out, "gelu": act_grad}[activation]
        ctx.save_for_backward(x2d, w, derivative_operand)
        ctx.x_shape, ctx.x_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        ctx.activation, ctx.compute_dtype = activation, compute_dtype
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x2d, weight, derivative_operand = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # Compiled, the whole backward is one op (mpgemm.ops.linear_backward), which
        # runs this same function: its choices (dZ once per layer where the TMA kernel
        # takes the GEMMs) need the real tensors.
        backward = _linear_backward
        if torch.compiler.is_compiling():
            from mpgemm.ops import linear_backward as backward
        grad_x, grad_w, grad_b = backward(
            grad_out,
            x2d,
            weight,
            derivative_operand,
            x_shape=ctx.x_shape,
            x_dtype=ctx.x_dtype,
            weight_dtype=ctx.weight_dtype,
            activation=ctx.activation,
            compute_dtype=ctx.compute_dtype,
            need_x=need_x,
            need_w=need_w,
            need_b=need_b and ctx.has_bias,
        )
        return grad_x, grad_w, grad_b, None, None, None, None


def _linear_backward(
    grad_out: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    derivative_operand: torch.Tensor | None,
    *,
    x_shape: Sequence[int],
    x_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    activation: str | None,
    compute_dtype: torch.dtype,
    need_x: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dW, bias gradient), each None unless needed: ``LinearFunction``'s backward
    from what its forward saved (x2d, the GEMMs' W, the derivative's operand)."""
    gemm = _implementation(grad_out.device, grad_out, x2d, weight, derivative_operand)
    dy = _as_rows(grad_out)
    s = None if derivative_operand is None else _as_rows(derivative_operand)
    prologue = _DERIVATIVE_PROLOGUE[activation]
    grad_b = None
    if prologue is not None and _derivative_first(gemm, dy, weight, compute_dtype):
        # dZ (and the bias gradient, its FP32 column sums) once for both GEMMs.
        dz_t, grad_b = _derivative_before_gemms(dy, s, prologue, compute_dtype, need_b)
        dy, s, prologue = dz_t.t(), None, None

    grad_x = grad_w = None
    if need_x:
        grad_x, _, _ = gemm(
            dy,
            weight,
            compute_dtype=compute_dtype,
            out_dtype=x_dtype,
            prologue=prologue,
            prologue_operand=s,
        )
        grad_x = grad_x.view(x_shape)
    if need_w or (need_b and grad_b is None):
        # A frozen weight still lets its GEMM sum the bias gradient: B gets no columns.
        x_operand = x2d if need_w else x2d[:, :0]
        # Laid out like the weight (its copy is), in the weight's own dtype.
        grad_w = torch.empty_like(weight, dtype=weight_dtype) if need_w else None
        product, _, row_sums = gemm(
            dy.t(),
            x_operand,
            compute_dtype=compute_dtype,
            out_dtype=weight_dtype,
            prologue=prologue,
            prologue_operand=None if s is None else s.t(),
            rowsum_a=need_b and grad_b is None,
            out=grad_w,
        )
        grad_w = product if need_w else None
        grad_b = row_sums if grad_b is None else grad_b
    return grad_x, grad_w, grad_b


def _derivative_first(
    gemm: Callable, dy: torch.Tensor, weight: torch.Tensor, compute_dtype: torch.dtype
) -> bool:
    """Whether the backward applies act' to dY before its GEMMs: where the TMA kernel
    runs them, which fuses no prologue (the pointer kernel and the reference do)."""
    if gemm is gemm_ref:
        return False
    from mpgemm.kernels.gemm import takes_tma

    return takes_tma(dy, weight, compute_dtype)


def _derivative_before_gemms(dy, s, prologue, compute_dtype, bias_grad):
    """(dZ.T, bias gradient or None): dZ = dY * act'(z) in the compute dtype and the
    FP32 column sums of dZ before its rounding, the math of the GEMMs' prologue and row
    sums, laid out as dY.T for the weight gradient's A."""
    from mpgemm.kernels.gemm import prologue_and_rowsum

    r = torch.empty(dy.shape[1], device=dy.device, dtype=torch.float32) if bias_grad else None
    return prologue_and_rowsum(dy.t(), prologue, s.t(), compute_dtype, r), r


# ---------------------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------------------


def linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    compute_dtype: torch.dtype = torch.float16,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``act(input @ weight.T + bias)``, the contract of ``torch.nn.functional.linear``
    with 16-bit Tensor Core operands and FP32 accumulation.

    input: (*, in_features); weight: (out_features, in_features); bias: (out_features,)
    or None; each float32, float16 or bfloat16, all on one device. Operands are rounded
    to ``compute_dtype`` (float16 or bfloat16); bias and ``activation`` (None, "relu" or
    "gelu", the exact erf form) are applied to the FP32 accumulator, which is then
    rounded to ``out_dtype`` (default ``compute_dtype``). Returns (*, out_features).
    Differentiable in input, weight and bias; each gradient has its tensor's dtype, so
    FP32 master weights get FP32 gradients.
    """
    return _linear(
        input, weight, bias, activation=activation, compute_dtype=compute_dtype, out_dtype=out_dtype
    )


def _linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    activation: str | None,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
    weight_copy: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear``, with the GEMMs reading ``weight_copy`` (``weight`` in the compute
    dtype, from ``mpgemm.Linear``) in ``weight``'s place when given."""
    op = "mpgemm.linear"
    _check_tensors(op, input=input, weight=weight, bias=bias)
    _check_compute_dtype(op, compute_dtype)
    _check_out_dtype(op, out_dtype)
    _check_activation(op, activation)
    if input.dim() < 1 or weight.dim() != 2 or input.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{op}: input of shape {tuple(input.shape)} and weight of shape "
            f"{tuple(weight.shape)} are incompatible: weight must be (out_features, "
            "in_features) with in_features equal to input's last dimension"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"{op}: bias of shape {tuple(bias.shape)} does not match weight of shape "
            f"{tuple(weight.shape)}; expected ({weight.shape[0]},)"
        )
    return LinearFunction.apply(
        input, weight, bias, activation, compute_dtype, out_dtype or compute_dtype, weight_copy
    )


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    compute_dtype: torch.dtype = torch.float16,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``a @ b`` with 16-bit Tensor Core operands and FP32 accumulation.

    a: (*, K); b: (K, N); float32, float16 or bfloat16, on one device. The shape rule is
    ``torch.matmul``'s with a 2-D ``b``: the result is (*, N). Operands are rounded to
    ``compute_dtype`` (float16 or bfloat16), products accumulate in FP32, and the result
    is rounded to ``out_dtype`` (default ``compute_dtype``). Differentiable in both.
    """
    op = "mpgemm.matmul"
    _check_tensors(op, a=a, b=b)
    _check_compute_dtype(op, compute_dtype)
    _check_out_dtype(op, out_dtype)
    if a.dim() < 1 or b.dim() != 2 or a.shape[-1] != b.shape[0]:
        raise ValueError(
            f"{op}: a of shape {tuple(a.shape)} and b of shape {tuple(b.shape)} cannot be "
            "multiplied: b must be 2-D (K, N) with K equal to a's last dimension"
        )
    return LinearFunction.apply(a, b.t(), None, None, compute_dtype, out_dtype or compute_dtype)
