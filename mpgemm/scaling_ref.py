"""Reference implementations of loss scaling and the fused optimizer steps, in PyTorch.

They have the contracts of the kernels in ``mpgemm.kernels.unscale``,
``mpgemm.kernels.update_scale`` and ``mpgemm.kernels.fused_optim``, run CPU tensors when the
Triton interpreter is off, and are what the tests hold the kernels to. Unscaling and
the scale update are torch's own ops; the optimizer steps are torch's SGD and Adam
math, skipped on the device (``torch.where``) when ``found_inf`` is set, so that nothing
waits for the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mpgemm.scaling import ParamGroups


def unscale_ref_(
    src: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor | None,
    *,
    dst: Sequence[torch.Tensor] | None = None,
) -> None:
    """``found_inf = 1`` if any ``src`` element is inf/NaN; ``dst = src * inv_scale``
    (in place when ``dst`` is None; check only when ``inv_scale`` is None)."""
    if inv_scale is None:
        for t in src:
            found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(t)).any().float()))
        return
    if dst is not None:
        # The kernel's order: check src, then round src * inv_scale (an FP32 product)
        # once into dst's dtype. Copying first would round a narrower dst before scaling.
        unscale_ref_(src, found_inf, None)
        for d, s in zip(dst, src, strict=True):
            # Rounded before the copy: torch 2.13's copy_ (on the CPU) between FP32 and
            # FP16 into a negative view writes the values' negation; within one dtype
            # it is right.
            d.copy_((s.float() * inv_scale).to(d.dtype))
        return
    for dtype in {t.dtype for t in src}:
        group = [t for t in src if t.dtype == dtype]
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)


def update_scale_ref_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    *,
    skipped_steps: torch.Tensor | None = None,
    clear_found_inf: bool = False,
) -> None:
    """Torch's dynamic loss scale update, in place; one more ``skipped_steps`` where
    ``found_inf`` is set; then ``found_inf`` zeroed if ``clear_found_inf``."""
    if skipped_steps is not None:
        skipped_steps.add_((found_inf != 0).to(skipped_steps.dtype))
    torch._amp_update_scale_(
        scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
    )
    if clear_found_inf:
        found_inf.zero_()


def _unscaled_fp32(
    grad: torch.Tensor, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
) -> torch.Tensor:
    """As unscale_ followed by a step: the unscaled gradient (times the reciprocal of
    ``grad_scale``, taken in double as ``GradScaler.unscale_`` takes it), rounded to its
    own dtype, is what the step uses and what ``grad`` holds after a step that was taken
    (torch's optimizers leave ``.grad`` unscaled after ``scaler.step``)."""
    if grad_scale is None:
        return grad.float()
    inv_scale = grad_scale.double().reciprocal().float()
    unscaled = (grad.float() * inv_scale).to(grad.dtype)
    _store_unless_skipped(grad, unscaled, found_inf)
    return unscaled.float()


def _advance_counts(steps: Sequence[torch.Tensor], found_inf: torch.Tensor | None) -> None:
    """Add one to each step count, or nothing where ``found_inf`` is set: on the device
    (an FP32 increment of 0 or 1 per count, as the kernels add it)."""
    if not steps:
        return
    increment = 1.0 if found_inf is None else (found_inf == 0).to(steps[0].dtype)
    for step in steps:
        step.add_(increment)


def _widened(value: float | torch.Tensor) -> float | torch.Tensor:
    """A hyperparameter as the kernels take it: a tensor's value widened to FP64 (on its
    device: nothing waits for the host), a float as it is."""
    return value.double() if isinstance(value, torch.Tensor) else value


def _store_unless_skipped(
    dst: torch.Tensor, value: torch.Tensor, found_inf: torch.Tensor | None
) -> None:
    value = value.to(dst.dtype)
    dst.copy_(value if found_inf is None else torch.where(found_inf != 0, dst, value))


def _store_param(
    p: torch.Tensor,
    copy: torch.Tensor | None,
    value: torch.Tensor,
    found_inf: torch.Tensor | None,
) -> None:
    """The updated parameter, and its compute copy rounded from what was stored (a
    parameter listed as its own copy has none)."""
    _store_unless_skipped(p, value, found_inf)
    if copy is not None and copy is not p:
        _store_unless_skipped(copy, p, found_inf)


# An optimizer step's arguments that hold one tensor per parameter.
_PER_PARAMETER = frozenset(
    {
        "params",
        "grads",
        "momentum_buffers",
        "exp_avgs",
        "exp_avg_sqs",
        "steps",
        "compute_copies",
        "max_exp_avg_sqs",
    }
)


def each_run(step: Callable, groups: ParamGroups, arguments: dict) -> None:
    """``step`` (taking ``arguments`` by name) on each run of parameters of ``groups``:
    the per-parameter lists cut to the run, and the run's row of hyperparameters in
    place of the values given for all."""
    start = 0
    for row, size in zip(groups.rows, groups.sizes, strict=True):
        run = slice(start, start + size)
        start += size
        cut = {
            name: value[run] if name in _PER_PARAMETER and value is not None else value
            for name, value in arguments.items()
            if name != "groups"
        }
        step(**(cut | row))


def sgd_step_ref_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor] | None,
    *,
    lr: float | torch.Tensor,
    momentum: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    dampening: float = 0.0,
    steps: Sequence[torch.Tensor] | None = None,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    compute_copies: Sequence[torch.Tensor] | None = None,
    groups: ParamGroups | None = None,
) -> None:
    """SGD with momentum (torch.optim.SGD's math), in FP32:

        g = grad / grad_scale (negated if maximize) + weight_decay * p
        buf = g at a buffer's first step, else momentum * buf + (1 - dampening) * g
        d = g + momentum * buf if nesterov else buf;  p = p - lr * d

    Buffers start as zeros, which gives torch's first step (buf = g) without
    dampening; with it, ``steps`` count each parameter's steps taken before this one,
    each advanced by this step, and a count of 1 (with it) marks the first. A tensor
    ``lr`` (one element) is read in FP64, as a float would be. Each ``compute_copies``
    tensor gets its parameter's new value in its own dtype. Nothing changes where
    ``found_inf`` is nonzero, the step counts included. ``groups``: float
    hyperparameters per run of parameters (``mpgemm.scaling.ParamGroups``), each run
    stepped with its row's."""
    if groups is not None:
        return each_run(sgd_step_ref_, groups, locals())  # (the parameters, only)
    copies: Sequence[torch.Tensor | None] = compute_copies or [None] * len(params)
    lr = _widened(lr)
    if momentum != 0 and dampening != 0:
        assert steps is not None, "dampening needs the step counts"
        _advance_counts(steps, found_inf)
    for i, (p, grad) in enumerate(zip(params, grads, strict=True)):
        g = _unscaled_fp32(grad, grad_scale, found_inf)
        g = -g if maximize else g
        p32 = p.float()
        if weight_decay != 0:
            g = g + weight_decay * p32
        if momentum != 0:
            assert momentum_buffers is not None, "momentum needs buffers"
            # (Without dampening, 1.0 * g is g, exactly.)
            buf = momentum_buffers[i].float() * momentum + (1 - dampening) * g
            if dampening != 0:
                assert steps is not None  # (checked above)
                buf = torch.where(steps[i] == 1, g, buf)
            g = g + momentum * buf if nesterov else buf
            _store_unless_skipped(momentum_buffers[i], buf, found_inf)
        _store_param(p, copies[i], p32 - lr * g, found_inf)


def adam_step_ref_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float | torch.Tensor,
    beta2: float | torch.Tensor,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    compute_copies: Sequence[torch.Tensor] | None = None,
    max_exp_avg_sqs: Sequence[torch.Tensor] | None = None,
    groups: ParamGroups | None = None,
) -> None:
    """Adam (AdamW with ``decoupled_weight_decay``), torch.optim.Adam's math in FP32,
    with t each parameter's count in ``steps`` of the steps taken before this one, plus
    this one (stored back):

        g = grad / grad_scale (negated if maximize);  L2: g += wd * p;  AdamW: p *= 1 - lr wd
        m = lerp(m, g, 1 - beta1);  v = beta2 v + (1 - beta2) g^2
        p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    AMSGrad (``max_exp_avg_sqs`` given, of the parameters' dtype): v_max = max(v_max, v)
    (``torch.maximum``: a NaN on either side is kept), and v_max replaces v in the
    denominator. A tensor ``lr``, ``beta1`` or ``beta2`` (one element) is read in FP64,
    as a float would be. Each ``compute_copies`` tensor gets its parameter's new value
    in its own dtype. Nothing changes where ``found_inf`` is nonzero, the step counts
    included. ``groups`` as ``sgd_step_ref_``'s."""
    if groups is not None:
        return each_run(adam_step_ref_, groups, locals())  # (the parameters, only)
    copies: Sequence[torch.Tensor | None] = compute_copies or [None] * len(params)
    maxima: Sequence[torch.Tensor | None] = max_exp_avg_sqs or [None] * len(params)
    lr, beta1, beta2 = _widened(lr), _widened(beta1), _widened(beta2)
    _advance_counts(steps, found_inf)
    for p, grad, m, v, step, copy, v_max in zip(
        params, grads, exp_avgs, exp_avg_sqs, steps, copies, maxima, strict=True
    ):
        g = _unscaled_fp32(grad, grad_scale, found_inf)
        g = -g if maximize else g
        p32 = p.float()
        if weight_decay != 0:
            if decoupled_weight_decay:
                p32 = p32 * (1 - lr * weight_decay)
            else:
                g = g + weight_decay * p32
        m32 = torch.lerp(m.float(), g, 1 - beta1)
        v32 = v.float() * beta2 + (1 - beta2) * g * g
        t = step.double()
        step_size = (lr / (1 - beta1**t)).float()
        bias_correction2_sqrt = (1 - beta2**t).sqrt().float()
        _store_unless_skipped(m, m32, found_inf)
        _store_unless_skipped(v, v32, found_inf)
        second = v32  # the second moment the step divides by
        if v_max is not None:
            second = torch.maximum(v_max.float(), v32)
            _store_unless_skipped(v_max, second, found_inf)
        denom = second.sqrt() / bias_correction2_sqrt + eps
        _store_param(p, copy, p32 - step_size * (m32 / denom), found_inf)
