"""Fused optimizer steps that unscale as they read and skip on the device.

One launch per list of tensors (``tensor_table``) updates parameters and optimizer
state in FP32 registers, with the math of ``mpgemm.scaling_ref.sgd_step_ref_`` and
``adam_step_ref_`` (torch.optim.SGD's and Adam's). The scaled gradient is multiplied by
the reciprocal of ``grad_scale`` and rounded to its own dtype, as
``GradScaler.unscale_`` would leave it,
and written back (torch's optimizers leave ``.grad`` unscaled after ``scaler.step``);
where ``found_inf`` is nonzero, each program reads the flag and nothing else, so the
parameters and state keep their bits and the host never has to read the flag.

A program steps a span of one tensor's elements (``tensor_table``), a block at a time:
its reads of the table, the hyperparameters and the step count, and the bias
corrections and the arrival, are paid once per span (``blocks_per_program_for``).

A parameter may come with a compute copy (``mpgemm.compute_copy``: the 16-bit weight
an ``mpgemm.Linear``'s GEMMs read); the step writes it from the updated parameter in the
same pass, so the next forward needs no cast. A parameter without one is listed as its
own copy, which each program tells by address, so that a layer's weight (with a copy)
and bias (without) take one launch; ``HAS_COPY`` is off when no parameter has one.

The step counts (Adam's; SGD's with dampening, which mark a buffer's first step) are
advanced in the same launch where the step is taken: each program reads its
parameter's count of the steps before this one, and the last of the parameter's
programs to arrive (``mpgemm.kernels.arrivals``; each arrives after its first block's
loads, before its stores) stores the count plus one. That takes the place of two torch
launches a step (an ``eq`` of the flag, then ``_foreach_add_``).

Hyperparameters arrive in an FP64 table (``scalar_table``), as torch computes its
Python-side scalars (bias corrections, ``1 - lr * weight_decay``) in double before
rounding them to FP32. A learning rate or Adam beta given as a tensor (as torch's
optimizers take them) is read from that tensor at every launch and widened to FP64
(torch's fused kernels widen theirs to double too), so that changing it in place needs
no new launch configuration, trace or CUDA graph.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from mpgemm.kernels.arrivals import arrive, counters, leave
from mpgemm.kernels.dependent_launch import wait_for_prior_grid
from mpgemm.kernels.gemm_common import INTERPRET
from mpgemm.kernels.launches import Launched, launch
from mpgemm.kernels.rounding import cast_rne, widen
from mpgemm.kernels.tensor_table import (
    TRITON_DTYPES,
    load_part,
    narrow_pointers,
    scalar_table,
    store_part,
    table_address,
    table_pointer,
    table_programs,
    table_span,
    tensor_table,
)

if TYPE_CHECKING:
    from mpgemm.scaling import ParamGroups

# Elements a program of the optimizer steps takes at a time: 8 per thread for 8 warps,
# half the tensor table's BLOCK. Adam writing a 16-bit copy takes 120 registers a thread
# under Triton 3.6 and 3.9 (sm_90a; 84 before a program looped over a span of blocks,
# 100 before its stores kept one layout: narrow_pointers), so two 8-warp programs fit on
# an SM (capped at 80, three: no local memory under 3.6, 8 words reloaded from the stack
# every block under 3.9); at 16 per thread it took 153 (one program). On the H100, two
# programs per SM moved the guide's step from 54% to 82% of DRAM bandwidth
# (bench/results/h100-2026-11-22). SGD at 16 took 122 to 132 registers (146 under 3.9:
# one program per SM above 128), at 8 it takes 58 to 77 (four programs at 64 or fewer,
# else three) (python -m mpgemm.kernels.aot; bench/sweep_optim.py).
OPTIMIZER_BLOCK = 2048


@triton.jit
def _unscaled_grad(
    g,
    g_ptr,
    offsets,
    rest,
    grad_scale_ptr,
    GRAD_DTYPE: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The block's gradient ``g``, as loaded from ``g_ptr`` (the tensor's for its first
    ``rest`` elements: ``load_part``), in FP32, divided by the loss
    scale and rounded to its own dtype as ``GradScaler.unscale_`` would leave it (and left
    so in the gradient tensor, as torch's optimizers leave it after ``scaler.step``),
    negated to maximise."""
    g = widen(g, INTERPRETED)
    if HAS_GRAD_SCALE:
        # GradScaler.unscale_'s multiplier: the reciprocal taken in double (FP64
        # division is IEEE on the GPU: div.rn.f64) and rounded once to FP32. Taken here
        # rather than by three torch ops before the launch.
        inv_scale = (1.0 / tl.load(grad_scale_ptr).to(tl.float64)).to(tl.float32)
        g = cast_rne(g * inv_scale, GRAD_DTYPE, INTERPRETED)
        store_part(g_ptr, g, offsets, rest)
        g = widen(g, INTERPRETED)
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def _takes_step(found_inf_ptr, HAS_FOUND_INF: tl.constexpr):
    """Whether this step is taken: the flag is zero (or there is none). Kernels read it
    first, so that its latency overlaps their table's."""
    take_step = True
    if HAS_FOUND_INF:
        take_step = tl.load(found_inf_ptr) == 0.0
    return take_step


@triton.jit
def _advance_count(counter_ptr, programs, step_ptr, step, leading, COUNTS: tl.constexpr):
    """With ``COUNTS``, store ``step``, the parameter's count with this step, once all the
    parameter's ``programs`` have read the count before it: the last of them to arrive
    on ``counter_ptr`` does. Called in every block of the program's span, after the
    block's loads and before its stores, it arrives in the ``leading`` (first) block
    only: the arrival's release waits for the program's earlier memory operations, and
    so only for loads that the program waits for anyway; its stores, which need no
    ordering with the count, drain after it. (Until 2026-11-26 the arrival came last,
    after the 28 KB of stores of an Adam program writing a copy.)"""
    if COUNTS:
        if leading:
            if arrive(counter_ptr, programs):
                tl.store(step_ptr, step)
                leave(counter_ptr)


@triton.jit
def _group_row(
    hyper_ptr,
    table_ptr,
    num_tensors,
    tensor,
    GROUP_LIST: tl.constexpr,
    NUM_HYPER: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """The FP64 table's row of hyperparameters for ``tensor``: with ``GROUPED``, the
    table holds one row of ``NUM_HYPER`` per param group of the launch, and the tensor
    table each tensor's group in the row after its lists (``GROUP_LIST``)."""
    if GROUPED:
        hyper_ptr += table_address(table_ptr, num_tensors, tensor, GROUP_LIST) * NUM_HYPER
    return hyper_ptr


@triton.jit
def _hyperparameter(hyper_ptr, INDEX: tl.constexpr, tensor_ptr, FROM_TENSOR: tl.constexpr):
    """Hyperparameter ``INDEX`` of the FP64 table, or, ``FROM_TENSOR``, the value of a
    tensor hyperparameter (a one-element tensor of any float dtype) widened to FP64,
    read at every launch: an LR schedule that changes it in place reaches a replayed
    CUDA graph and a compiled step."""
    if FROM_TENSOR:
        value = tl.load(tensor_ptr).to(tl.float64)
    else:
        value = tl.load(hyper_ptr + INDEX)
    return value


@triton.jit
def _store_param(
    p_ptr,
    c_ptr,
    p,
    offsets,
    rest,
    has_copy,
    PARAM_DTYPE: tl.constexpr,
    COPY_DTYPE: tl.constexpr,
    HAS_COPY: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Store the updated parameter, and its compute copy (if ``has_copy``: see
    ``_compute_copy``) rounded from what was stored."""
    p = cast_rne(p, PARAM_DTYPE, INTERPRETED)
    store_part(p_ptr, p, offsets, rest)
    if HAS_COPY:
        if has_copy:
            copy = cast_rne(widen(p, INTERPRETED), COPY_DTYPE, INTERPRETED)
            store_part(c_ptr, copy, offsets, rest)


@triton.jit
def _compute_copy(
    table_ptr,
    num_tensors,
    tensor,
    start,
    COPY_LIST: tl.constexpr,
    COPY_DTYPE: tl.constexpr,
    HAS_COPY: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """(the address of the span's first element in this tensor's compute copy, list
    ``COPY_LIST``; whether the copy is a tensor of its own). A parameter without one is
    listed as its own copy, so that one launch steps an ``mpgemm.Linear``'s weight,
    which has one, and its bias, which has none. False, with nothing read, when no
    tensor of the launch has one (``HAS_COPY`` off)."""
    c_ptr = table_pointer(table_ptr, num_tensors, tensor, start, COPY_LIST, COPY_DTYPE, ALIGNED)
    has_copy = False
    if HAS_COPY:
        copy = table_address(table_ptr, num_tensors, tensor, COPY_LIST)
        has_copy = copy != table_address(table_ptr, num_tensors, tensor, 0)
    return c_ptr, has_copy


@triton.jit
def _sgd_block(
    p_ptr,
    g_ptr,
    buf_ptr,
    c_ptr,
    offsets,
    rest,
    has_copy,
    grad_scale_ptr,
    lr,
    momentum,
    weight_decay,
    dampening,
    first_step,
    counter_ptr,
    programs,
    step_ptr,
    step,
    leading,
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    COPY_DTYPE: tl.constexpr,
    HAS_COPY: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    DAMPENING: tl.constexpr,
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # Every load is issued before the first store, which the compiler may not move them
    # past (it cannot tell that the tensors do not overlap): their latencies overlap.
    p = widen(load_part(p_ptr, offsets, rest), INTERPRETED)
    g = load_part(g_ptr, offsets, rest)
    if HAS_MOMENTUM:
        buf = widen(load_part(buf_ptr, offsets, rest), INTERPRETED)
    # The step count's arrival, after the loads and before any store.
    _advance_count(counter_ptr, programs, step_ptr, step, leading, DAMPENING)
    g = _unscaled_grad(
        g, g_ptr, offsets, rest, grad_scale_ptr, GRAD_DTYPE, HAS_GRAD_SCALE, MAXIMIZE, INTERPRETED
    )
    if weight_decay != 0:
        g = g + weight_decay.to(tl.float32) * p
    if HAS_MOMENTUM:
        if DAMPENING:
            # torch's first step takes the gradient itself as the buffer; dampening
            # applies from the second (a buffer of zeros would give (1 - dampening) g).
            damped = buf * momentum.to(tl.float32) + (1.0 - dampening).to(tl.float32) * g
            buf = tl.where(first_step, g, damped)
        else:
            # From a buffer of zeros, the first step's is the gradient, as torch's.
            buf = buf * momentum.to(tl.float32) + g
        store_part(buf_ptr, cast_rne(buf, PARAM_DTYPE, INTERPRETED), offsets, rest)
        if NESTEROV:
            g = g + momentum.to(tl.float32) * buf
        else:
            g = buf
    p = p - lr.to(tl.float32) * g
    _store_param(
        p_ptr, c_ptr, p, offsets, rest, has_copy, PARAM_DTYPE, COPY_DTYPE, HAS_COPY, INTERPRETED
    )


@triton.jit
def _sgd_kernel(
    # table of [param, grad, momentum buffer, (step count if DAMPENING), compute copy]
    # tensors and its size
    table_ptr,
    num_tensors,
    # one-element FP32 tensors (unused unless HAS_FOUND_INF / HAS_GRAD_SCALE)
    found_inf_ptr,
    grad_scale_ptr,
    # FP64 table: lr, momentum, weight_decay, dampening; lr's own tensor (unused unless
    # TENSOR_LR)
    hyper_ptr,
    lr_ptr,
    # int32 arrival counters, one per tensor (``mpgemm.kernels.arrivals``; unused
    # unless DAMPENING)
    counter_ptr,
    # the elements of a tensor each program steps, BLOCK at a time (``tensor_table``)
    span,
    # element types
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    COPY_DTYPE: tl.constexpr,
    # flags
    HAS_COPY: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    DAMPENING: tl.constexpr,
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    TENSOR_LR: tl.constexpr,
    # the table has a group row: each tensor's row of the FP64 table
    GROUPED: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    ALIGNED: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK: tl.constexpr,
    # programmatic dependent launch (mpgemm.kernels.dependent_launch)
    PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    take_step = _takes_step(found_inf_ptr, HAS_FOUND_INF)
    # (The copies move one place along with the step counts.)
    num_lists: tl.constexpr = 4 + DAMPENING + GROUPED
    tensor, start, remaining = table_span(table_ptr, num_tensors, num_lists, span)
    hyper_ptr = _group_row(hyper_ptr, table_ptr, num_tensors, tensor, 4 + DAMPENING, 4, GROUPED)
    p_ptr = table_pointer(table_ptr, num_tensors, tensor, start, 0, PARAM_DTYPE, ALIGNED)
    g_ptr = table_pointer(table_ptr, num_tensors, tensor, start, 1, GRAD_DTYPE, ALIGNED)
    buf_ptr = table_pointer(table_ptr, num_tensors, tensor, start, 2, PARAM_DTYPE, ALIGNED)
    c_ptr, has_copy = _compute_copy(
        table_ptr, num_tensors, tensor, start, 3 + DAMPENING, COPY_DTYPE, HAS_COPY, ALIGNED
    )
    lr = _hyperparameter(hyper_ptr, 0, lr_ptr, TENSOR_LR)
    momentum = tl.load(hyper_ptr + 1)
    weight_decay = tl.load(hyper_ptr + 2)
    dampening = tl.load(hyper_ptr + 3)
    # The parameter's count of steps taken, this one included: 1 when its buffer is new.
    first_step = False
    step_ptr = table_ptr  # (no counts without dampening)
    step = 0.0
    counter_ptr += tensor
    programs = 1
    if DAMPENING:
        step_ptr = table_pointer(table_ptr, num_tensors, tensor, 0, 3, tl.float32, False)
        step = tl.load(step_ptr) + 1.0
        first_step = step == 1.0
        programs = table_programs(table_ptr, num_tensors, tensor, num_lists, span)
    if take_step:
        offsets = tl.arange(0, BLOCK)
        # The span a block at a time (a zero-size tensor's program runs one, empty, to
        # arrive).
        for first in range(0, tl.maximum(remaining, 1), BLOCK):
            # The block's elements from the span's first (a jit function called here per
            # block would cost the interpreter more than the block's arithmetic).
            block = first + offsets
            p_block = p_ptr + block
            g_block = narrow_pointers(g_ptr, block, PARAM_DTYPE)
            buf_block = buf_ptr + block
            c_block = narrow_pointers(c_ptr, block, PARAM_DTYPE)
            _sgd_block(
                p_block,
                g_block,
                buf_block,
                c_block,
                offsets,
                remaining - first,
                has_copy,
                grad_scale_ptr,
                lr,
                momentum,
                weight_decay,
                dampening,
                first_step,
                counter_ptr,
                programs,
                step_ptr,
                step,
                first == 0,
                PARAM_DTYPE,
                GRAD_DTYPE,
                COPY_DTYPE,
                HAS_COPY,
                HAS_MOMENTUM,
                DAMPENING,
                NESTEROV,
                MAXIMIZE,
                HAS_GRAD_SCALE,
                INTERPRETED,
            )


@triton.jit
def _adam_block(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    v_max_ptr,
    c_ptr,
    offsets,
    rest,
    has_copy,
    grad_scale_ptr,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    counter_ptr,
    programs,
    step_ptr,
    leading,
    step_size,
    bias_correction2_sqrt,
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    COPY_DTYPE: tl.constexpr,
    HAS_COPY: tl.constexpr,
    DECOUPLED_WEIGHT_DECAY: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One block of the span, whose first ``rest`` elements are the tensor's (all, but in
    a tensor's last block); ``leading``, the span's first, which also takes the bias
    corrections (``step_size``, ``bias_correction2_sqrt``: returned for the span's
    other blocks) and the step count's arrival."""
    # Every load is issued first (the compiler may not move one past a store: it cannot
    # tell that the tensors do not overlap), then, in the leading block, the
    # double-precision bias corrections, a long dependent chain, run while the loads
    # are in flight.
    p = widen(load_part(p_ptr, offsets, rest), INTERPRETED)
    g = load_part(g_ptr, offsets, rest)
    m = widen(load_part(m_ptr, offsets, rest), INTERPRETED)
    v = widen(load_part(v_ptr, offsets, rest), INTERPRETED)
    if AMSGRAD:
        v_max = widen(load_part(v_max_ptr, offsets, rest), INTERPRETED)
    if leading:
        # The step count, this step included, gives the bias corrections, in double as
        # torch takes them.
        t = step.to(tl.float64)
        step_size = (lr / (1.0 - tl.exp(t * tl.log(beta1)))).to(tl.float32)
        bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp(t * tl.log(beta2))).to(tl.float32)
    # The step count's arrival, after the loads and before any store.
    _advance_count(counter_ptr, programs, step_ptr, step, leading, True)
    g = _unscaled_grad(
        g, g_ptr, offsets, rest, grad_scale_ptr, GRAD_DTYPE, HAS_GRAD_SCALE, MAXIMIZE, INTERPRETED
    )
    if weight_decay != 0:
        if DECOUPLED_WEIGHT_DECAY:
            p = p * (1.0 - lr * weight_decay).to(tl.float32)
        else:
            g = g + weight_decay.to(tl.float32) * p
    # torch.lerp's two forms, each exact at its end of the weight range
    weight = (1.0 - beta1).to(tl.float32)
    if weight < 0.5:
        m = m + weight * (g - m)
    else:
        m = g - (g - m) * (1.0 - weight)
    v = v * beta2.to(tl.float32) + (1.0 - beta2).to(tl.float32) * g * g
    second = v  # the second moment the step divides by
    if AMSGRAD:
        # torch.maximum's: a NaN on either side is kept (max.f32 would drop it).
        second = tl.maximum(v_max, v, propagate_nan=tl.PropagateNan.ALL)
    # IEEE square root and division, as torch's: tl.sqrt and "/" are approximate on GPUs.
    denom = tl.div_rn(tl.sqrt_rn(second), bias_correction2_sqrt) + eps.to(tl.float32)
    p = p - step_size * tl.div_rn(m, denom)
    store_part(m_ptr, cast_rne(m, PARAM_DTYPE, INTERPRETED), offsets, rest)
    store_part(v_ptr, cast_rne(v, PARAM_DTYPE, INTERPRETED), offsets, rest)
    if AMSGRAD:
        store_part(v_max_ptr, cast_rne(second, PARAM_DTYPE, INTERPRETED), offsets, rest)
    _store_param(
        p_ptr, c_ptr, p, offsets, rest, has_copy, PARAM_DTYPE, COPY_DTYPE, HAS_COPY, INTERPRETED
    )
    return step_size, bias_correction2_sqrt


@triton.jit
def _adam_kernel(
    # table of [param, grad, exp_avg, exp_avg_sq, (max_exp_avg_sq if AMSGRAD), step,
    # compute copy] tensors and its size
    table_ptr,
    num_tensors,
    # one-element FP32 tensors (unused unless HAS_FOUND_INF / HAS_GRAD_SCALE)
    found_inf_ptr,
    grad_scale_ptr,
    # FP64 table: lr, beta1, beta2, eps, weight_decay; the tensors of the first three
    # (each unused unless its TENSOR_ flag is set)
    hyper_ptr,
    lr_ptr,
    beta1_ptr,
    beta2_ptr,
    # int32 arrival counters, one per tensor (``mpgemm.kernels.arrivals``)
    counter_ptr,
    # the elements of a tensor each program steps, BLOCK at a time (``tensor_table``)
    span,
    # element types
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    COPY_DTYPE: tl.constexpr,
    # flags
    HAS_COPY: tl.constexpr,
    DECOUPLED_WEIGHT_DECAY: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    TENSOR_LR: tl.constexpr,
    TENSOR_BETA1: tl.constexpr,
    TENSOR_BETA2: tl.constexpr,
    # the table has a group row: each tensor's row of the FP64 table
    GROUPED: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    ALIGNED: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK: tl.constexpr,
    # programmatic dependent launch (mpgemm.kernels.dependent_launch)
    PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    take_step = _takes_step(found_inf_ptr, HAS_FOUND_INF)
    # (The lists after exp_avg_sq move one place along with AMSGrad's maxima.)
    num_lists: tl.constexpr = 6 + AMSGRAD + GROUPED
    tensor, start, remaining = table_span(table_ptr, num_tensors, num_lists, span)
    hyper_ptr = _group_row(hyper_ptr, table_ptr, num_tensors, tensor, 6 + AMSGRAD, 5, GROUPED)
    p_ptr = table_pointer(table_ptr, num_tensors, tensor, start, 0, PARAM_DTYPE, ALIGNED)
    g_ptr = table_pointer(table_ptr, num_tensors, tensor, start, 1, GRAD_DTYPE, ALIGNED)
    m_ptr = table_pointer(table_ptr, num_tensors, tensor, start, 2, PARAM_DTYPE, ALIGNED)
    v_ptr = table_pointer(table_ptr, num_tensors, tensor, start, 3, PARAM_DTYPE, ALIGNED)
    v_max_ptr = v_ptr  # (not read without AMSGrad)
    if AMSGRAD:
        v_max_ptr = table_pointer(table_ptr, num_tensors, tensor, start, 4, PARAM_DTYPE, ALIGNED)
    c_ptr, has_copy = _compute_copy(
        table_ptr, num_tensors, tensor, start, 5 + AMSGRAD, COPY_DTYPE, HAS_COPY, ALIGNED
    )
    lr = _hyperparameter(hyper_ptr, 0, lr_ptr, TENSOR_LR)
    beta1 = _hyperparameter(hyper_ptr, 1, beta1_ptr, TENSOR_BETA1)
    beta2 = _hyperparameter(hyper_ptr, 2, beta2_ptr, TENSOR_BETA2)
    eps = tl.load(hyper_ptr + 3)
    weight_decay = tl.load(hyper_ptr + 4)
    # The parameter's count of steps taken before this one, and with it.
    step_ptr = table_pointer(table_ptr, num_tensors, tensor, 0, 4 + AMSGRAD, tl.float32, False)
    step = tl.load(step_ptr) + 1.0
    counter_ptr += tensor
    programs = table_programs(table_ptr, num_tensors, tensor, num_lists, span)
    if take_step:
        offsets = tl.arange(0, BLOCK)
        # The bias corrections, taken in the leading block (_adam_block).
        step_size = tl.zeros((), tl.float32)
        bias_correction2_sqrt = tl.zeros((), tl.float32)
        # The span a block at a time (a zero-size tensor's program runs one, empty, to
        # arrive).
        for first in range(0, tl.maximum(remaining, 1), BLOCK):
            # The block's elements from the span's first (as _sgd_kernel's).
            block = first + offsets
            p_block = p_ptr + block
            g_block = narrow_pointers(g_ptr, block, PARAM_DTYPE)
            m_block = m_ptr + block
            v_block = v_ptr + block
            v_max_block = v_max_ptr + block
            c_block = narrow_pointers(c_ptr, block, PARAM_DTYPE)
            step_size, bias_correction2_sqrt = _adam_block(
                p_block,
                g_block,
                m_block,
                v_block,
                v_max_block,
                c_block,
                offsets,
                remaining - first,
                has_copy,
                grad_scale_ptr,
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                step,
                counter_ptr,
                programs,
                step_ptr,
                first == 0,
                step_size,
                bias_correction2_sqrt,
                PARAM_DTYPE,
                GRAD_DTYPE,
                COPY_DTYPE,
                HAS_COPY,
                DECOUPLED_WEIGHT_DECAY,
                AMSGRAD,
                MAXIMIZE,
                HAS_GRAD_SCALE,
                INTERPRETED,
            )


def _launch(
    kernel,
    lists,
    copies,
    found_inf,
    grad_scale,
    hyper,
    names: Sequence[str],
    groups: ParamGroups | None,
    *,
    strided,
    tensor_flags: Sequence[str],
    counts_steps: bool,
    block: int = OPTIMIZER_BLOCK,
    blocks_per_program: int | None = None,
    num_warps: int = 8,
    maxnreg: int | None = None,
    **flags,
) -> Launched | None:
    """One launch over the parallel ``lists`` and the compute ``copies`` (the table's last
    list); the first ``strided`` lists, and the copies, are walked element by element.
    ``hyper``: the hyperparameters, by ``names``, of which the first
    ``len(tensor_flags)`` may be one-element tensors on the lists' device (torch's
    optimizers take a tensor lr and betas), each passed after the table and read from
    there when its flag is set; ``groups``: their values per run of tensors, if any.
    ``counts_steps``: the last of ``lists`` holds step counts that the kernel advances
    where the step is taken (every tensor gets a program then, a zero-size one too,
    and the programs of a tensor arrive on a counter of their own: the last stores
    the count). ``block``: the elements a program steps at a time;
    ``blocks_per_program``: how many consecutive blocks of a tensor each program steps
    (None: ``tensor_table.blocks_per_program_for`` the launch's size); ``maxnreg``: a
    cap on a thread's registers (ptxas spills above it; None: no cap).
    ``bench/sweep_optim.py`` times other values of these and ``num_warps`` on a GPU, and
    reads the binary's registers from what this returns: ``launch``'s answer (None
    without a launch)."""
    params = lists[0]
    if copies is None:
        copies = params  # each parameter its own copy: nothing more is written
    # The first compute copy that is a tensor of its own, whose dtype all such share.
    first_copy = next(itertools.compress(copies, map(operator.is_not, copies, params)), None)
    has_copy = first_copy is not None
    rows, run_of_each = _hyper_rows(hyper, names, groups)
    table, num_tensors, num_programs, aligned, span = tensor_table(
        [*lists, copies],
        block,
        every_tensor=counts_steps,
        groups=run_of_each,
        blocks_per_program=blocks_per_program,
    )
    if num_programs == 0:
        return None
    # The lists walked element by element: the strided ones, and the copies if written.
    walked = [*aligned[:strided], *(aligned[-1:] if has_copy else ())]
    from_tensors = [isinstance(value, torch.Tensor) for value in hyper[: len(tensor_flags)]]
    # A tensor's slot of the FP64 table is not read: 0 keeps the table's cache key.
    values = [0.0 if isinstance(value, torch.Tensor) else value for row in rows for value in row]
    hyper_table = scalar_table(values, table.device)
    return launch(
        kernel,
        (num_programs,),
        table,
        num_tensors,
        found_inf if found_inf is not None else table,
        grad_scale if grad_scale is not None else table,
        hyper_table,
        *(hyper[i] if tensor else hyper_table for i, tensor in enumerate(from_tensors)),
        counters(table.device, num_tensors) if counts_steps else table,
        span,
        PARAM_DTYPE=TRITON_DTYPES[params[0].dtype],
        GRAD_DTYPE=TRITON_DTYPES[lists[1][0].dtype],
        COPY_DTYPE=TRITON_DTYPES[(first_copy if has_copy else params[0]).dtype],
        HAS_COPY=has_copy,
        HAS_FOUND_INF=found_inf is not None,
        HAS_GRAD_SCALE=grad_scale is not None,
        ALIGNED=all(walked),
        GROUPED=bool(run_of_each),
        INTERPRETED=INTERPRET,
        BLOCK=block,
        num_warps=num_warps,
        # (only when set: the launch's options, and so its binary, stay as they were)
        **({"maxnreg": maxnreg} if maxnreg is not None else {}),
        **dict(zip(tensor_flags, from_tensors, strict=True)),
        **flags,
    )


def _hyper_rows(
    hyper: Sequence, names: Sequence[str], groups: ParamGroups | None
) -> tuple[list[tuple], bytes]:
    """The FP64 table's rows and the tensor table's group row: ``hyper`` (by ``names``)
    as one row and no group row, or, with ``groups``, a row per run (its values in
    place of ``hyper``'s) and each tensor's run index."""
    if groups is None:
        return [tuple(hyper)], b""
    rows = [tuple(row.get(n, v) for n, v in zip(names, hyper, strict=True)) for row in groups.rows]
    return rows, groups.run_of_each() if len(rows) > 1 else b""


def triton_sgd_step_(
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
    """``sgd_step_ref_`` in one launch. ``params`` (and buffers) share a dtype, ``grads``
    share a dtype, ``compute_copies`` that are not their parameter share a dtype (a
    parameter's own tensor: none); all flat, one device, parallel tensors with equal
    strides. ``steps`` (FP32 one-element tensors, each parameter's count of steps taken
    before this one, advanced where it is taken) only with momentum and dampening. A
    tensor ``lr`` (one element, on that device) is read by the kernel. ``groups``: the
    float hyperparameters per run of parameters (``mpgemm.scaling.ParamGroups``), each
    parameter reading its run's; a nonzero ``momentum`` and ``dampening`` must then be
    nonzero in every run."""
    if not params:
        return
    buffers = momentum_buffers if momentum != 0 else params
    damped = momentum != 0 and dampening != 0
    _launch(
        _sgd_kernel,
        # (mpgemm.scaling.sgd_step_ has checked that a damped step has its counts)
        [params, grads, buffers, *([steps] if damped else [])],
        compute_copies,
        found_inf,
        grad_scale,
        (lr, momentum, weight_decay, dampening),
        ("lr", "momentum", "weight_decay", "dampening"),
        groups,
        strided=3,
        tensor_flags=("TENSOR_LR",),
        counts_steps=damped,
        HAS_MOMENTUM=momentum != 0,
        DAMPENING=damped,
        NESTEROV=nesterov,
        MAXIMIZE=maximize,
    )


def triton_adam_step_(
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
    """``adam_step_ref_`` in one launch. ``params`` and moments (and AMSGrad's
    ``max_exp_avg_sqs``) share a dtype, ``grads`` share a dtype, ``compute_copies`` that
    are not their parameter share a dtype (a parameter's own tensor: none), ``steps``
    are FP32 one-element tensors (each parameter's count of steps taken before this
    one, advanced where it is taken); all on one device. A tensor ``lr``, ``beta1`` or
    ``beta2`` (one element, on that device) is read by the kernel. ``groups`` as
    ``triton_sgd_step_``'s."""
    if not params:
        return
    maxima = [] if max_exp_avg_sqs is None else [max_exp_avg_sqs]
    _launch(
        _adam_kernel,
        [params, grads, exp_avgs, exp_avg_sqs, *maxima, steps],
        compute_copies,
        found_inf,
        grad_scale,
        (lr, beta1, beta2, eps, weight_decay),
        ("lr", "beta1", "beta2", "eps", "weight_decay"),
        groups,
        strided=4 + len(maxima),
        tensor_flags=("TENSOR_LR", "TENSOR_BETA1", "TENSOR_BETA2"),
        counts_steps=True,
        DECOUPLED_WEIGHT_DECAY=decoupled_weight_decay,
        AMSGRAD=bool(maxima),
        MAXIMIZE=maximize,
    )
