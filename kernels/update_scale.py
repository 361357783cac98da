"""The dynamic loss scale's update, on the device: the rule of ``torch._amp_update_scale_``.

    found_inf != 0:  scale *= backoff_factor;   tracker = 0
    otherwise:       tracker += 1; once tracker == growth_interval:
                     scale *= growth_factor (kept only if finite);   tracker = 0

``scale`` is an FP32 tensor and ``tracker`` an int32 tensor of one element; products are
taken in FP64 and rounded to FP32, as torch does. A skipped-step counter (an int64
tensor: ``mpgemm.LossScaleOptimizer``'s) may be counted up in the same launch, and the
flag zeroed once read, so that the next iteration's checks raise it afresh without a
launch to zero it. One program, no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpgemm.kernels.dependent_launch import wait_for_prior_grid
from mpgemm.kernels.launches import launch
from mpgemm.kernels.tensor_table import scalar_table


@triton.jit
def _update_scale_kernel(
    scale_ptr,
    tracker_ptr,
    found_inf_ptr,
    # FP64 table: growth_factor, backoff_factor (a factor such as 1.1 is inexact in FP32)
    factors_ptr,
    growth_interval,
    skipped_ptr,  # int64 count of skipped steps (unused unless HAS_SKIPPED)
    HAS_SKIPPED: tl.constexpr,
    # zero found_inf once read
    CLEAR_FOUND_INF: tl.constexpr,
    # programmatic dependent launch (mpgemm.kernels.dependent_launch)
    PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    growth_factor = tl.load(factors_ptr)
    backoff_factor = tl.load(factors_ptr + 1)
    scale = tl.load(scale_ptr).to(tl.float64)
    tracker = tl.load(tracker_ptr)
    found_inf = tl.load(found_inf_ptr) != 0.0
    grown = (scale * growth_factor).to(tl.float32)
    grow = (tracker + 1 == growth_interval) & (tl.abs(grown) != float("inf")) & (grown == grown)
    new_scale = tl.where(grow, grown, scale.to(tl.float32))
    new_scale = tl.where(found_inf, (scale * backoff_factor).to(tl.float32), new_scale)
    new_tracker = tl.where(found_inf | (tracker + 1 == growth_interval), 0, tracker + 1)
    tl.store(scale_ptr, new_scale)
    tl.store(tracker_ptr, new_tracker)
    if HAS_SKIPPED:
        tl.store(skipped_ptr, tl.load(skipped_ptr) + found_inf.to(tl.int64))
    if CLEAR_FOUND_INF:
        tl.store(found_inf_ptr, 0.0)


def triton_update_scale_(
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
    """Update ``scale`` (FP32) and ``growth_tracker`` (int32) in place from ``found_inf``
    (FP32), add one to ``skipped_steps`` (int64) if it is set, and then, with
    ``clear_found_inf``, zero ``found_inf``: all one-element tensors on one device."""
    launch(
        _update_scale_kernel,
        (1,),
        scale,
        growth_tracker,
        found_inf,
        scalar_table((growth_factor, backoff_factor), scale.device),
        int(growth_interval),
        skipped_steps if skipped_steps is not None else scale,
        HAS_SKIPPED=skipped_steps is not None,
        CLEAR_FOUND_INF=clear_found_inf,
        num_warps=1,
    )
