"""mpgemm's ops as torch custom ops, for ``torch.compile``: ``torch.ops.mpgemm.gemm``
(a forward GEMM), ``linear_backward`` (a layer's GEMMs' backward),
``activation_backward`` (its activation's derivative and bias gradient), and the
loss-scaling ops and optimizer steps of ``mpgemm.scaling`` (``unscale_``,
``update_scale_``, ``sgd_step_``, ``adam_step_``).

Traced code calls an op instead of the implementation (``functional._gemm``, the
functions of ``mpgemm.scaling``): the compiler sees one opaque node, so it keeps the
rounding to the compute dtype (inductor folds a round trip such as
``x.to(fp16).to(fp32)`` away), never traces a Triton launcher or the per-dtype
dispatch, and the graph does not break there. Eager code calls the implementation
directly, without the op's dispatch: an op that writes its arguments bumps their
version counters, which would make every 16-bit weight copy look stale
(``mpgemm.compute_copy``) after an optimizer step that has just written it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "activation_backward",
    "adam_step_",
    "gemm",
    "linear_backward",
    "sgd_step_",
    "unscale_",
    "update_scale_",
]


@torch.library.custom_op("mpgemm::gemm", mutates_args=())
def _gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    activation: str | None,
    store_preact: bool,
    rowsum_a: bool,
    sum_batch: bool = False,
    kept_dims: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from mpgemm.functional import _implementation

    c, g, r = _implementation(a.device, a, b, bias)(
        a,
        b,
        compute_dtype=compute_dtype,
        out_dtype=out_dtype,
        bias=bias,
        activation=activation,
        store_preact=store_preact,
        rowsum_a=rowsum_a,
        sum_batch=sum_batch,
        kept_dims=kept_dims,
    )
    # An op returns tensors, none aliasing another: an output not asked for is empty.
    return (
        c,
        a.new_empty((0,), dtype=out_dtype) if g is None else g,
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
    store_preact,
    rowsum_a,
    sum_batch=False,
    kept_dims=0,
):
    m, n = a.shape[-2], b.shape[-1]
    batch = a.shape[:kept_dims] if sum_batch else a.shape[:-2]
    c = a.new_empty((*batch, m, n), dtype=out_dtype)
    g = a.new_empty((m, n) if store_preact else (0,), dtype=out_dtype)
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
    store_preact=False,
    rowsum_a=False,
    out=None,
    sum_batch=False,
    kept_dims=0,
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
        store_preact,
        rowsum_a,
        sum_batch,
        kept_dims,
    )
    return c, (g if store_preact else None), (r if rowsum_a else None)


@torch.library.custom_op("mpgemm::linear_backward", mutates_args=())
def _linear_backward_op(
    grad_z: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    x_shape: list[int],
    x_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    need_x: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from mpgemm.functional import _linear_backward

    grads = _linear_backward(
        grad_z,
        x2d,
        weight,
        x_shape=x_shape,
        x_dtype=x_dtype,
        weight_dtype=weight_dtype,
        compute_dtype=compute_dtype,
        need_x=need_x,
        need_w=need_w,
        need_b=need_b,
    )
    # A gradient not asked for is an empty tensor (an op returns tensors).
    return tuple(  # type: ignore[return-value]
        grad_z.new_empty((0,), dtype=torch.float32) if g is None else g for g in grads
    )


@_linear_backward_op.register_fake
def _(
    grad_z,
    x2d,
    weight,
    x_shape,
    x_dtype,
    weight_dtype,
    compute_dtype,
    need_x,
    need_w,
    need_b,
):
    none = grad_z.new_empty((0,), dtype=torch.float32)
    return (
        grad_z.new_empty(x_shape, dtype=x_dtype) if need_x else none,
        torch.empty_like(weight, dtype=weight_dtype) if need_w else none.clone(),
        grad_z.new_empty((weight.shape[0],), dtype=torch.float32) if need_b else none.clone(),
    )


def linear_backward(
    grad_z: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    *,
    x_shape: Sequence[int],
    x_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    need_x: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``mpgemm.functional._linear_backward`` as ``torch.ops.mpgemm.linear_backward``:
    a layer's GEMMs' backward in one node, so that its run-time choices (the bias
    gradient fused into the weight gradient's GEMM or summed beforehand) are made on the
    real tensors."""
    grads = _linear_backward_op(
        grad_z,
        x2d,
        weight,
        list(x_shape),
        x_dtype,
        weight_dtype,
        compute_dtype,
        need_x,
        need_w,
        need_b,
    )
    return tuple(  # type: ignore[return-value]
        g if needed else None for g, needed in zip(grads, (need_x, need_w, need_b), strict=True)
    )


@torch.library.custom_op("mpgemm::activation_backward", mutates_args=())
def _activation_backward_op(
    grad_y: torch.Tensor,
    saved: torch.Tensor,
    activation: str,
    compute_dtype: torch.dtype,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from mpgemm.functional import activation_backward as implementation

    grad_z, grad_b = implementation(grad_y, saved, activation, compute_dtype, bias_grad=bias_grad)
    return grad_z, grad_y.new_empty((0,), dtype=torch.float32) if grad_b is None else grad_b


@_activation_backward_op.register_fake
def _(grad_y, saved, activation, compute_dtype, bias_grad):
    n = grad_y.shape[-1] if bias_grad else 0
    return torch.empty_like(grad_y), grad_y.new_empty((n,), dtype=torch.float32)


def activation_backward(
    grad_y: torch.Tensor,
    saved: torch.Tensor,
    activation: str,
    compute_dtype: torch.dtype,
    *,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``mpgemm.functional.activation_backward`` as ``torch.ops.mpgemm.
    activation_backward``: opaque, so that the bias gradient's FP32 sums are eager's,
    bit for bit (inductor would fuse the product into a reduction of its own order)."""
    grad_z, grad_b = _activation_backward_op(grad_y, saved, activation, compute_dtype, bias_grad)
    return grad_z, grad_b if bias_grad else None


# -- loss scaling and the optimizer steps ----------------------------------------------
# Each op runs mpgemm.scaling's function of the same name (eagerly, when the compiled
# graph calls it), which checks its arguments again and dispatches per dtype; under
# torch.compile that function calls the op, with the same arguments by name. They
# return nothing: they write the tensors named in mutates_args. A schema has no optional
# list of tensors, so an empty list stands for None (an argument the function omits).


def _or_none(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    return tensors if tensors else None


def _either(value: float, tensor: torch.Tensor | None) -> float | torch.Tensor:
    """A hyperparameter that may be a tensor (torch's optimizers take any of theirs as
    one): a schema has no "float or Tensor", so the ops take a float and an optional
    ``<name>_tensor``, which ``mpgemm.scaling`` passes with 0 for the float."""
    return value if tensor is None else tensor


@torch.library.custom_op("mpgemm::unscale_", mutates_args=("src", "found_inf", "dst"))
def unscale_(
    src: list[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor | None,
    dst: list[torch.Tensor],
) -> None:
    """``mpgemm.scaling.unscale_`` (``dst`` empty: in place)."""
    from mpgemm import scaling

    scaling.unscale_(src, found_inf, inv_scale, dst=_or_none(dst))


@torch.library.custom_op(
    "mpgemm::update_scale_",
    mutates_args=("scale", "growth_tracker", "found_inf", "skipped_steps"),
)
def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    skipped_steps: torch.Tensor | None,
    clear_found_inf: bool = False,
) -> None:
    """``mpgemm.scaling.update_scale_`` (``found_inf`` is written only where
    ``clear_found_inf``)."""
    from mpgemm import scaling

    scaling.update_scale_(
        scale,
        growth_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        skipped_steps=skipped_steps,
        clear_found_inf=clear_found_inf,
    )


@torch.library.custom_op(
    "mpgemm::sgd_step_",
    mutates_args=("params", "grads", "momentum_buffers", "compute_copies", "steps"),
)
def sgd_step_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor],
    compute_copies: list[torch.Tensor],
    steps: list[torch.Tensor],
    lr: float,
    lr_tensor: torch.Tensor | None,
    momentum: float,
    momentum_tensor: torch.Tensor | None,
    dampening: float,
    dampening_tensor: torch.Tensor | None,
    weight_decay: float,
    weight_decay_tensor: torch.Tensor | None,
    nesterov: bool,
    maximize: bool,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """``mpgemm.scaling.sgd_step_`` (empty lists: no buffers, no copies, no step
    counts)."""
    from mpgemm import compute_copy, scaling

    # The step pre-hook that counts optimizer steps is skipped when traced: count here,
    # where the step runs (this compiled step wrote no compute copy: all are stale).
    compute_copy.count_step()
    scaling.sgd_step_(
        params,
        grads,
        _or_none(momentum_buffers),
        compute_copies=_or_none(compute_copies),
        steps=_or_none(steps),
        lr=_either(lr, lr_tensor),
        momentum=_either(momentum, momentum_tensor),
        dampening=_either(dampening, dampening_tensor),
        weight_decay=_either(weight_decay, weight_decay_tensor),
        nesterov=nesterov,
        maximize=maximize,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )


@torch.library.custom_op(
    "mpgemm::adam_step_",
    mutates_args=(
        "params",
        "grads",
        "exp_avgs",
        "exp_avg_sqs",
        "steps",
        "compute_copies",
        "max_exp_avg_sqs",
    ),
)
def adam_step_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    compute_copies: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    lr: float,
    lr_tensor: torch.Tensor | None,
    beta1: float,
    beta1_tensor: torch.Tensor | None,
    beta2: float,
    beta2_tensor: torch.Tensor | None,
    eps: float,
    eps_tensor: torch.Tensor | None,
    weight_decay: float,
    weight_decay_tensor: torch.Tensor | None,
    decoupled_weight_decay: bool,
    maximize: bool,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """``mpgemm.scaling.adam_step_`` (empty ``compute_copies``: none; empty
    ``max_exp_avg_sqs``: no AMSGrad)."""
    from mpgemm import compute_copy, scaling

    compute_copy.count_step()  # as in sgd_step_
    scaling.adam_step_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        steps,
        compute_copies=_or_none(compute_copies),
        max_exp_avg_sqs=_or_none(max_exp_avg_sqs),
        lr=_either(lr, lr_tensor),
        beta1=_either(beta1, beta1_tensor),
        beta2=_either(beta2, beta2_tensor),
        eps=_either(eps, eps_tensor),
        weight_decay=_either(weight_decay, weight_decay_tensor),
        decoupled_weight_decay=decoupled_weight_decay,
        maximize=maximize,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )
