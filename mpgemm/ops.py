"""mpgemm's GEMM as a torch custom op, ``torch.ops.mpgemm.gemm``, for ``torch.compile``.

Traced code calls the op instead of the implementation (``functional._gemm``): the
compiler sees one opaque node, so it keeps the rounding to the compute dtype (inductor
folds a round trip such as ``x.to(fp16).to(fp32)`` away) and never traces the Triton
launcher. Eager code calls the implementation directly, without the op's dispatch.
"""

from __future__ import annotations

import torch

__all__ = ["gemm"]


@torch.library.custom_op("mpgemm::gemm", mutates_args=())
def _gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    activation: str | None,
    store_act_grad: bool,
    prologue: str | None,
    prologue_operand: torch.Tensor | None,
    rowsum_a: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from mpgemm.functional import _implementation

    c, g, r = _implementation(a.device, a, b, bias, prologue_operand)(
        a,
        b,
        compute_dtype=compute_dtype,
        out_dtype=out_dtype,
        bias=bias,
        activation=activation,
        store_act_grad=store_act_grad,
        prologue=prologue,
        prologue_operand=prologue_operand,
        rowsum_a=rowsum_a,
    )
    # An op returns tensors, none aliasing another: an output not asked for is empty.
    return (
        c,
        a.new_empty((0,), dtype=torch.float32) if g is None else g,
        a.new_empty((0,), dtype=torch.float32) if r is None else r,
    )


@_gemm_op.register_fake
def _(
    a,
    b,
    compute_dtype,
    out_dtype,
    bias,
    activation,
    store_act_grad,
    prologue,
    prologue_operand,
    rowsum_a,
):
    m, n = a.shape[0], b.shape[1]
    c = a.new_empty((m, n), dtype=out_dtype)
    g = a.new_empty((m, n) if store_act_grad else (0,), dtype=torch.float32)
    r = a.new_empty((m,) if rowsum_a else (0,), dtype=torch.float32)
    return c, g, r


def gemm(
    a,
    b,
    *,
    compute_dtype,
    out_dtype,
    bias=None,
    activation=None,
    store_act_grad=False,
    prologue=None,
    prologue_operand=None,
    rowsum_a=False,
    out=None,
):
    """``gemm_ref``'s contract (and ``triton_gemm``'s) through the custom op, which
    returns C as a new tensor: ``out`` must be None."""
    if out is not None:
        raise ValueError("mpgemm.ops.gemm returns C; it takes no out")
    c, g, r = _gemm_op(
        a,
        b,
        compute_dtype,
        out_dtype,
        bias,
        activation,
        store_act_grad,
        prologue,
        prologue_operand,
        rowsum_a,
    )
    return c, (g if store_act_grad else None), (r if rowsum_a else None)
