"""``mpgemm.GradScaler``: dynamic loss scaling with torch.amp.GradScaler's API and rules.

The loss is multiplied by ``scale`` before backward, so that small FP16 gradients do not
underflow; before the optimizer step the gradients are multiplied by ``1 / scale`` and
checked for inf/NaN. A step with a non-finite gradient is skipped and the scale backs off
(``scale *= backoff_factor``); after ``growth_interval`` clean steps in a row it grows
(``scale *= growth_factor``). Unscaling, the check and the update run as fused kernels
(``mpgemm.scaling``) and keep the scale and the flag on the device.

Where torch's scaler must read the flag on the host to decide whether to call
``optimizer.step()``, an optimizer that sets ``_step_supports_amp_scaling`` (mpgemm's
``SGD``, ``Adam``, ``AdamW``, torch's ``fused=True`` ones) receives ``grad_scale`` and
``found_inf`` as tensors and skips on the device: such a step never synchronises.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

# Torch's enum of an optimizer's stage in an iteration, which scripts compare with
# (``scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY``).
from torch.amp.grad_scaler import OptState

from mpgemm.graphs import note_host_values
from mpgemm.scaling import by_device, unscale_, update_scale_

__all__ = ["GradScaler"]


# What torch's GradScaler asserts (AssertionError, which ``python -O`` strips) is a
# ValueError or RuntimeError here that is an AssertionError too, so that code written
# against torch's catches it as it did.


class _BadFactor(ValueError, AssertionError):
    """A growth factor not above 1, or a backoff factor not in (0, 1)."""


class _OutOfOrder(RuntimeError, AssertionError):
    """A scaler used out of order: no ``scale`` yet, or no inf check to step or update
    from."""


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (the scale, its inverse or a flag) on ``device``, without waiting for
    the copy, except into the CPU's memory. A GPU tensor copied to the CPU with
    ``non_blocking=True`` lands in pinned memory after the call returns, and the CPU op
    that reads it next (unscaling a CPU gradient, scaling a CPU loss) would read the
    memory before the copy. On an H200 under load, CPU parameters under a CUDA scaler
    stepped wrongly on a process's first step, and did not with
    ``CUDA_LAUNCH_BLOCKING=1`` (``bench/results/h200-2026-11-26/run9-two-failures``).
    pytorch/pytorch#176429 is the same race in FSDP's offloaded scaler."""
    return tensor.to(device, non_blocking=device.type != "cpu")


def _fresh_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class GradScaler:
    """A drop-in for ``torch.amp.GradScaler`` (same arguments, methods and semantics).

    Usage, as with torch::

        scaler = mpgemm.GradScaler("cuda")
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)        # optional: to clip unscaled gradients
        scaler.step(optimizer)
        scaler.update()

    The scale is an FP32 tensor and the growth tracker an int32 tensor, created on the
    device of the first tensor ``scale()`` sees. Invalid factors raise ``ValueError``
    (torch raises ``AssertionError``); call-order errors raise ``RuntimeError``."""

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self._device = str(device)
        self._enabled = enabled
        if enabled and self._device == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "mpgemm.GradScaler is enabled, but CUDA is not available. Disabling.",
                stacklevel=2,
            )
            self._enabled = False
        if self._enabled:
            if not growth_factor > 1.0:
                raise _BadFactor(f"The growth factor must be > 1.0, got {growth_factor}.")
            if not 0.0 < backoff_factor < 1.0:
                raise _BadFactor(f"The backoff factor must be in (0, 1), got {backoff_factor}.")
            if not (isinstance(growth_interval, int) and growth_interval > 0):
                raise ValueError(
                    f"growth_interval must be a positive int, got {growth_interval!r}."
                )
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._init_growth_tracker = 0
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(
            _fresh_optimizer_state
        )

    # -- scaling ---------------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or nested lists/tuples/iterables of tensors) times the
        current scale. Returned unchanged when disabled."""
        if not self._enabled:
            return outputs
        per_device: dict[torch.device, torch.Tensor] = {}

        def scaled(value):
            if isinstance(value, torch.Tensor):
                if value.device not in per_device:
                    per_device[value.device] = self._scale_on(value.device)
                return value * per_device[value.device]
            if isinstance(value, Iterable) and not isinstance(value, str | bytes):
                items = map(scaled, value)
                return type(value)(items) if isinstance(value, list | tuple) else items
            raise ValueError(
                f"outputs must be a Tensor or an iterable of Tensors, got {type(value).__name__}"
            )

        return scaled(outputs)

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        """The scale as a tensor on ``device``, made there first if there is none yet."""
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(device)
        scale, _ = self._check_scale_growth_tracker("scale")
        return _copy_to(scale, device)

    # Torch's names and signatures, which scripts call: to make the scale before a CUDA
    # graph's capture, to read it after update().

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        """Make the scale (FP32) and the growth tracker (int32) on ``dev``."""
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full(
            (), self._init_growth_tracker, dtype=torch.int32, device=dev
        )

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, growth tracker); RuntimeError naming ``funcname`` before they exist."""
        if self._scale is None or self._growth_tracker is None:
            raise _OutOfOrder(
                f"Attempted {funcname} but the scale is not initialised. This may indicate "
                "your script did not use scaler.scale(loss or outputs) earlier in the iteration."
            )
        return self._scale, self._growth_tracker

    # -- unscaling and the inf check ---------------------------------------------------

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor | None,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale ``optimizer``'s gradients in place (only check them when
        ``inv_scale`` is None) and raise the flags; torch's override point, with its
        signature: ``found_inf`` is the flag on the scale's device, other devices get a
        copy of it, and the flag of each device is returned.

        Subclasses change where gradients come from (``_grad_sources``) and what happens
        to each device's flag once set (``_reduce_found_inf``)."""
        sources = self._grad_sources(optimizer) if inv_scale is not None else {}
        # [sources], [destinations]: the same tensors when in place
        srcs: list[torch.Tensor] = []
        dsts: list[torch.Tensor] = []
        for group_index, group in enumerate(optimizer.param_groups):
            for param_index, param in enumerate(group["params"]):
                # (Asked of every parameter of every step: an empty dict is not asked.)
                if sources and param in sources:
                    src = sources[param].grad
                    if src is None:
                        param.grad = None
                        continue
                    if param.grad is None:
                        param.grad = torch.empty_like(param)
                    srcs.append(src)
                    dsts.append(param.grad)
                    continue
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError(
                        "Attempting to unscale FP16 gradients (param_groups"
                        f"[{group_index}]['params'][{param_index}], shape "
                        f"{tuple(param.shape)}): the optimizer must step FP32 master weights. "
                        "Keep the parameters in FP32 (mpgemm.Linear, mpgemm.convert) or "
                        "wrap the optimizer in mpgemm.LossScaleOptimizer."
                    )
                if grad.is_sparse:
                    if grad.dtype == torch.float16:
                        # As torch: sum duplicate indices now, not later in FP16.
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                srcs.append(grad)
                dsts.append(grad)
        # In place, one list: unscale_ then reads each tensor once.
        in_place = all(s is d for s, d in zip(srcs, dsts, strict=True))
        found_infs = {}
        for device_srcs, device_dsts in by_device(srcs, dsts):
            device = device_srcs[0].device
            flag = found_inf if found_inf.device == device else found_inf.to(device, copy=True)
            inv = None if inv_scale is None else _copy_to(inv_scale, device)
            with torch.no_grad():
                unscale_(device_srcs, flag, inv, dst=None if in_place else device_dsts)
            self._reduce_found_inf(flag)
            found_infs[device] = flag
        return found_infs

    def _grad_sources(self, optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor]:
        """Parameters of ``optimizer`` whose gradient is unscaled from another tensor's:
        ``{parameter: source}``, the source's ``.grad`` unscaled straight into the
        parameter's (one pass, no copy first). None here; LossScaleOptimizer's FP32
        masters take their 16-bit model parameters' gradients."""
        return {}

    def _skip_counter(self, scale: torch.Tensor) -> torch.Tensor | None:
        """A one-element int64 tensor on ``scale``'s device to which the scale update
        adds one when this iteration's gradients held an inf/NaN, in the same launch.
        None here; LossScaleOptimizer counts its skipped steps so."""
        return None

    def _reduce_found_inf(self, found_inf: torch.Tensor) -> None:
        """Called on each device's flag once this step's gradients have set it: nothing
        here; LossScaleOptimizer reduces it across ranks."""

    def _fresh_flag(self, scale: torch.Tensor) -> torch.Tensor:
        """A zero FP32 flag on ``scale``'s device for this iteration's checks to raise:
        a new one each iteration, as torch's scaler makes (LossScaleOptimizer reuses
        its own)."""
        return torch.zeros((), dtype=torch.float32, device=scale.device)

    def _zeroed_by_update(self, found_inf: torch.Tensor) -> bool:
        """Whether the scale update zeroes ``found_inf`` (this iteration's flags
        combined) once it has read it: no here, where every iteration's flags are new
        and remain readable after ``update()``; LossScaleOptimizer's own flag is zeroed
        so, for its next iteration."""
        return False

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale, in place, and record whether any
        is inf/NaN. Optional: call it between ``backward`` and ``step`` to clip the true
        gradients. At most once per optimizer per ``update()``, and not after ``step``."""
        self._unscale(optimizer)

    def _unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # As torch: the reciprocal in double, rounded once to FP32.
        inv_scale = scale.double().reciprocal().float()
        state["found_inf_per_device"] = self._unscale_grads_(
            optimizer, inv_scale, self._fresh_flag(scale), False
        )
        state["stage"] = OptState.UNSCALED

    # -- the step --------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``unscale_(optimizer)`` unless already done, then ``optimizer.step(*args,
        **kwargs)`` unless a gradient was inf/NaN. Returns what ``optimizer.step`` returns
        (None when skipped). Optimizers with ``_step_supports_amp_scaling`` get the scale
        and the flag and skip on the device, without a host synchronisation: mpgemm's as
        ``step``'s ``grad_scale`` and ``found_inf`` arguments, torch's as the attributes
        ``optimizer.grad_scale`` / ``optimizer.found_inf``, set for the call."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._check_scale_growth_tracker("step")
        # A torch optimizer's host values too, for a GraphedStep's replays.
        note_host_values(optimizer.param_groups)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if state["stage"] is OptState.READY:
                # Check only: the optimizer unscales as it reads the gradients.
                self._check_inf_per_device(optimizer)
            found_inf = self._found_inf(optimizer)
            previous = getattr(optimizer, "grad_scale", None)
            if state["stage"] is OptState.UNSCALED:
                grad_scale = previous
            else:
                grad_scale = scale if previous is None else scale * previous
            try:
                if getattr(optimizer, "_step_takes_scaling_tensors", False):
                    # mpgemm's optimizers take them as arguments. Setting an attribute on
                    # an optimizer fails to compile before torch 2.13 (pytorch#171590).
                    result = optimizer.step(  # type: ignore[call-overload]
                        *args, grad_scale=grad_scale, found_inf=found_inf, **kwargs
                    )
                else:
                    # The attributes torch's scale-aware optimizers read (as torch's
                    # scaler sets).
                    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
                    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
                    result = optimizer.step(*args, **kwargs)
            finally:
                # Torch's scaler removes both after the step: a grad_scale the caller set
                # counts for this step only.
                for name in ("grad_scale", "found_inf"):
                    if hasattr(optimizer, name):
                        delattr(optimizer, name)
            state["stage"] = OptState.STEPPED
            return result

        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            raise _OutOfOrder(
                "No inf checks were recorded for this optimizer: none of its parameters has "
                "a gradient."
            )
        result = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args, **kwargs
    ) -> Any:
        """``optimizer.step(*args, **kwargs)`` unless a flag of ``optimizer_state`` (this
        iteration's, per device) is set; None when skipped. For an optimizer that does
        not skip on the device, the flags are read on the host. Torch's override point,
        with its signature."""
        if sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
            return None
        return optimizer.step(*args, **kwargs)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict:
        """Check ``optimizer``'s gradients for inf/NaN without unscaling them, and record
        and return each device's flag for this iteration (``{device: flag}``), as
        torch's scaler does for an optimizer that unscales as it steps."""
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(
            optimizer, None, self._fresh_flag(scale), True
        )
        return state["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict:
        """This iteration's inf/NaN flags of ``optimizer`` by device, as recorded by
        ``unscale_`` (or by ``step``): the tensors ``step`` and ``update`` then read, so
        that a change made to them in place between (torch's idiom: an all-reduce of
        each with MAX, so that every rank skips a step any rank found an inf in) is what
        they act on. Empty before any check."""
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """This iteration's inf/NaN flags for ``optimizer``, summed over devices, on the
        scale's device (zero when none was recorded)."""
        scale, _ = self._check_scale_growth_tracker("step")
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
        total = self._sum_flags(flags, scale.device)
        return torch.zeros((), device=scale.device) if total is None else total

    @staticmethod
    def _sum_flags(flags: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor | None:
        """The sum of inf/NaN flags on ``device``; None when there are none."""
        total = None
        for flag in flags:
            flag = _copy_to(flag, device)
            total = flag if total is None else total + flag
        return total

    # -- the scale update ------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off or grow the scale from this iteration's inf checks (all optimizers),
        or set it to ``new_scale`` (a float, or a one-element FP32 tensor on this
        scaler's device type). Resets every optimizer's stage for the next iteration."""
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, float | int):
                scale.fill_(new_scale)
            else:
                self._check_new_scale(new_scale)
                scale.copy_(new_scale)
        else:
            combined = self._sum_flags(
                (
                    found_inf
                    for state in self._per_optimizer_states.values()
                    for found_inf in state["found_inf_per_device"].values()
                ),
                scale.device,
            )
            if combined is None:
                raise _OutOfOrder("No inf checks were recorded prior to update.")
            update_scale_(
                scale,
                tracker,
                combined,
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
                skipped_steps=self._skip_counter(scale),
                clear_found_inf=self._zeroed_by_update(combined),
            )
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    def _check_new_scale(self, new_scale: Any) -> None:
        if not isinstance(new_scale, torch.Tensor):
            raise TypeError(
                f"new_scale must be a float or a one-element tensor, got {type(new_scale)}"
            )
        if new_scale.device.type != self._device:
            raise ValueError(
                f"new_scale is on {new_scale.device}, the scaler on device type {self._device}"
            )
        if new_scale.numel() != 1:
            raise ValueError(f"new_scale must have one element, got shape {tuple(new_scale.shape)}")
        if new_scale.requires_grad:
            raise ValueError("new_scale must not require grad")

    # -- getters, setters, state -----------------------------------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float (a host synchronisation on a GPU); 1.0
        when disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor itself (no synchronisation), None before the first
        ``scale()``: as torch's scaler returns it."""
        return self._scale

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = new_interval

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        if self._growth_tracker is None:
            return self._init_growth_tracker
        return int(self._growth_tracker.item())

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval`` and
        ``_growth_tracker``, as torch's scaler saves them (empty when disabled)."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict`` of this class or of ``torch.amp.GradScaler``."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(self._init_growth_tracker)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if self._per_optimizer_states:
                raise RuntimeError(
                    "A GradScaler instance may only be pickled at the beginning of an "
                    "iteration, or at the end after scaler.update()."
                )
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_scale"] = None
            state["_growth_tracker"] = None
        state["_per_optimizer_states"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
