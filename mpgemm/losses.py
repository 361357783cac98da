"""``mpgemm.cross_entropy``: ``torch.nn.functional.cross_entropy`` with the logits'
softmax and the loss in FP32 in one launch forward and one backward
(``mpgemm.kernels.cross_entropy``), where torch takes two and three.

The kernels take the common case: (N, C) logits (float32, float16 or bfloat16) against
(N,) int64 class indices, without class weights, any ``ignore_index``,
``label_smoothing`` and ``reduction``, on a device the kernels run on (``backend``).
Everything else (class weights, probability targets, K-dimensional inputs, the old
``size_average``/``reduce`` arguments, tensor subclasses, negative views,
``torch.compile``'s, ``torch.func``'s and ``torch.jit.trace``'s tracing, eager
forward-mode AD, the reference backend) is torch's own ``cross_entropy``, which also
raises torch's errors for what it refuses; 16-bit logits reach it in FP32 (with 16-bit
class weights or probabilities), so that the softmax and the loss are FP32 on every
path, and the loss and the gradient are rounded once to the logits' dtype. A tensor
subclass or mode with a ``__torch_function__`` (torch.fx's tracing proxies among them)
sees the call as ``mpgemm.cross_entropy``, as it sees torch's functions. One
difference: a class index out of range, which torch refuses (an ``IndexError`` on the
CPU, a device-side assert on a GPU), gives a NaN loss and NaN gradients for its row
here: checking it would make the host wait for the GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.overrides import handle_torch_function, has_torch_function_variadic

from mpgemm.functional import (
    COMPUTE_DTYPES,
    INPUT_DTYPES,
    backend,
    is_plain,
)
from mpgemm.reference import cross_entropy_backward_ref

__all__ = ["cross_entropy"]


class CrossEntropyFunction(torch.autograd.Function):
    """The kernels' cross-entropy (``mpgemm.kernels.cross_entropy``): forward saves the
    logits, the targets, each row's log-sum-exp (in two parts: its largest logit, and
    the log of its sum of exp(x - that)) and the count of rows not ignored."""

    @staticmethod
    def forward(ctx, x, target, ignore_index, reduction, smoothing):
        from mpgemm.kernels.cross_entropy import triton_cross_entropy

        loss, lse, count = triton_cross_entropy(x, target, ignore_index, reduction, smoothing)
        ctx.save_for_backward(x, target, lse, count)
        ctx.options = ignore_index, reduction, smoothing
        return loss

    @staticmethod
    def backward(ctx, grad):
        x, target, lse, count = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the reference, recorded
            # The softmax's normaliser taken again from x, so that it is differentiated:
            # the row's largest logit, saved, is a constant of it. x widened once: the
            # gradients of its two uses, which cancel, are summed in FP32 and rounded to
            # 16 bits once (with a cast each, a BF16 logit's second derivative was off
            # by a unit of the terms, 0.004 of 0.03).
            m, wide = lse[0], x.float()
            lse = torch.stack((m, torch.logsumexp(wide - m[:, None], dim=1)))
            dx = cross_entropy_backward_ref(grad, wide, target, lse, count, *ctx.options)
            dx = dx.to(x.dtype)
        elif is_plain(grad):
            from mpgemm.kernels.cross_entropy import triton_cross_entropy_backward

            dx = triton_cross_entropy_backward(grad, x, target, lse, count, *ctx.options)
        else:  # batched by is_grads_batched: no memory of its own for the kernel to read
            dx = cross_entropy_backward_ref(grad, x, target, lse, count, *ctx.options)
        return dx, None, None, None, None


def _kernels_take(input, target, weight, size_average, reduce, reduction, smoothing) -> bool:
    return (
        # (first: traced by torch.compile, nothing below is evaluated)
        not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and weight is None
        and size_average is None
        and reduce is None
        and reduction in ("none", "sum", "mean")
        and isinstance(smoothing, float | int)
        and 0.0 <= smoothing <= 1.0
        and is_plain(input)
        and is_plain(target)
        and input.dim() == 2
        and input.shape[1] > 0
        and input.dtype in INPUT_DTYPES
        and target.dim() == 1
        and target.dtype == torch.int64
        and target.shape[0] == input.shape[0]
        and target.device == input.device
        and not torch._C._are_functorch_transforms_active()
        and forward_ad._current_level < 0  # (forward-mode AD: torch's, which has its rule)
        and backend(input.device) == "triton"
    )


def cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy``, same arguments and results, with the
    softmax and the loss taken in FP32 whatever the logits' dtype (the module
    docstring says which calls the kernels take).

    input: (N, C) logits; target: (N,) class indices (int64); the loss: input's dtype,
    () for "mean" and "sum" (the mean over the rows not ignored), (N,) for "none" (0
    where ignored). Differentiable in ``input``; its gradient has input's dtype."""
    handled = has_torch_function_variadic(input, target, weight)
    if not handled and _kernels_take(
        input, target, weight, size_average, reduce, reduction, label_smoothing
    ):
        return CrossEntropyFunction.apply(
            input, target, int(ignore_index), reduction, float(label_smoothing)
        )
    options: dict[str, Any] = dict(
        weight=weight,
        size_average=size_average,
        ignore_index=ignore_index,
        reduce=reduce,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    if handled:
        # As torch's own does: the call handed to a tensor subclass or mode with a
        # __torch_function__ (torch.fx's tracing proxies among them).
        return handle_torch_function(
            cross_entropy, (input, target, weight), input, target, **options
        )
    if isinstance(input, torch.Tensor) and input.dtype in COMPUTE_DTYPES:
        # 16-bit logits in FP32 here too, as the kernels take them: torch's op on them
        # rounds the log-probabilities to 16 bits (a BF16 mean loss over 17 rows of 100
        # classes, label smoothing 0.1: 5.9 times the error of torch's op in FP32,
        # against FP64). The loss is rounded once to the logits' dtype, and so is
        # their gradient.
        options["weight"] = _widened(weight)
        return F.cross_entropy(input.float(), _widened(target), **options).to(input.dtype)
    return F.cross_entropy(input, target, **options)


def _widened(t: Any) -> Any:
    """``t`` in FP32 if a 16-bit tensor (class weights, class probabilities beside
    widened logits, which torch's op wants in their dtype), else ``t``."""
    if isinstance(t, torch.Tensor) and t.dtype in COMPUTE_DTYPES:
        return t.float()
    return t
