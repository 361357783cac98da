"""Fused optimizers that take loss scaling on the device: ``SGD``, ``Adam``, ``AdamW``.

Subclasses of torch's optimizers (same arguments, param groups, state and state_dict,
so LR schedulers and checkpoints work unchanged) whose ``step`` runs one fused kernel
per parameter dtype (``mpgemm.scaling.sgd_step_`` / ``adam_step_``), for all the param
groups that differ only in float hyperparameters (decay and no-decay, a learning rate
per layer): each parameter reads its group's values in the kernel. They follow
torch's protocol for scaler-aware optimizers (``_step_supports_amp_scaling``): a
scaler hands ``step`` ``grad_scale`` and ``found_inf`` tensors (``mpgemm.GradScaler`` as
its keyword arguments, torch's as attributes set on the optimizer), and the kernels
unscale the gradients as they read them and leave every parameter and state tensor
untouched when ``found_inf`` is set, without the host reading the flag. A parameter
with a compute copy (the 16-bit weight an ``mpgemm.Linear`` reads,
``mpgemm.compute_copy``) gets it written in the same pass.
Adam's step counts are FP32 tensors on the parameters' device, so a skipped step does
not advance them either.

torch's constructor keywords are accepted; the ones that choose torch's implementation
take the values the fused kernels honour (``foreach`` None or False, ``fused`` None or
True, ``differentiable`` False; ``capturable`` either way: the step never reads the
device on the host). FP64 and complex parameters (or gradients), and sparse gradients,
are stepped by torch's own implementation, as the torch optimizer would step them (under
a scaler: skipped on inf/NaN, which reads the flag on the host, else on gradients
unscaled in place), or refused as it refuses them (Adam's sparse gradients).

A learning rate (and Adam's betas) may be a one-element tensor, as in torch: the kernels
read it on the device at every step, widened to FP64 as torch's fused kernels widen it
(the same bits as the float of its value), so an LR scheduler that changes it in place
(torch's schedulers ``fill_`` a tensor ``lr``) reaches a replayed CUDA graph
(``mpgemm.graphs.GraphedStep``) and a compiled step without a recompile. A CPU tensor
for GPU parameters is read on the host, as torch's fused optimizers read it. So are
tensors for the other hyperparameters torch's optimizers take as tensors (SGD's
momentum, dampening and weight decay; Adam's eps and weight decay), whatever their
device, as torch's fused ops take them: as floats (a CUDA one waits for the GPU, and
is refused in a CUDA graph's capture). Compiled, the op reads weight decay and eps at
each step (no recompile); momentum and dampening choose the kernel on the host, so
dynamo cannot trace a tensor of theirs (a graph break; an error with ``fullgraph``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch

from mpgemm.compute_copy import copies_of, step_failed
from mpgemm.functional import PLAIN_TYPES, read_otherwise
from mpgemm.graphs import note_host_values
from mpgemm.native import list_facts, reading_once
from mpgemm.scaling import (
    KERNEL_DTYPES,
    ParamGroups,
    adam_step_,
    by_device,
    host_number,
    sgd_step_,
)

__all__ = ["SGD", "Adam", "AdamW"]


def _check_supported(**options: Any) -> None:
    for name, value in options.items():
        if value:
            raise ValueError(
                f"mpgemm's fused optimizers do not support {name}={value!r}; use the torch "
                "optimizer (mpgemm.LossScaleOptimizer wraps any)"
            )


def _check_implementation(foreach: bool | None, fused: bool | None, differentiable: bool) -> None:
    """torch's keywords that choose an implementation: accepted at values the fused
    kernels honour (None, or ``fused=True``, ``foreach=False``), refused otherwise; both
    True is torch's error first."""
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if fused is False:
        raise ValueError(
            "mpgemm's optimizers are fused kernels, so fused=False cannot be honoured; use the "
            "torch optimizer for its for-loop or foreach implementation"
        )
    _check_supported(foreach=foreach, differentiable=differentiable)


def _by_device(
    params: list[torch.Tensor], grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
) -> list[tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]]:
    """``params`` split by device (``mpgemm.scaling.by_device``), each part with
    ``grad_scale`` and ``found_inf`` on its device, as torch's fused optimizers group
    them: a model split over GPUs (as a ``device_map`` splits one) puts one param group
    on several."""
    out = []
    for (part,) in by_device(params):
        device = part[0].device
        # (A CPU part waits for a GPU flag, as torch's does: a kernel on the CPU reads
        # it at once. Between GPUs the copy is queued.)
        scale, flag = (
            t if t is None or t.device == device else t.to(device) for t in (grad_scale, found_inf)
        )
        out.append((part, scale, flag))
    return out


def _hyperparameters(parts: list[tuple[dict, list]], **keys) -> dict[str, Any]:
    """The float hyperparameters of one launch over ``parts`` ((group, params) pairs),
    each ``name=key`` (a group's key, or (key, index) into a tuple such as "betas"):
    the first group's values, and over several groups ``groups``, a
    ``mpgemm.scaling.ParamGroups`` of every group's."""

    def row(group: dict) -> dict[str, Any]:
        return {
            name: group[key[0]][key[1]] if type(key) is tuple else group[key]
            for name, key in keys.items()
        }

    first = row(parts[0][0])
    if len(parts) == 1:
        return first
    rows = tuple(row(group) for group, _ in parts)
    return {**first, "groups": ParamGroups(rows, tuple(len(part) for _, part in parts))}


def _merged(parts: list[tuple[dict, list]]) -> tuple[dict, list]:
    """A launch's first param group, whose flags the merged ones share, and the
    parameters of all of ``parts`` ((group, params) pairs), in order."""
    if len(parts) == 1:
        return parts[0]
    return parts[0][0], [p for _, part in parts for p in part]


class _ScaledStep(torch.optim.Optimizer):
    """The shared part of ``step``: read the scaler's tensors, group the parameters.
    Comes before a torch optimizer class in its subclasses' bases, whose ``__init__``
    and ``step`` its ``super()`` calls reach."""

    _step_supports_amp_scaling = True
    # mpgemm.GradScaler passes the scale and the flag as step's keyword arguments.
    _step_takes_scaling_tensors = True
    # A compiled step counts itself for mpgemm.compute_copy, in the custom op it calls.
    _counts_own_compiled_steps = True
    # The subclass's launch for param groups' parameters with a gradient, on one device:
    # ``_step_groups([(group, params), ...], grad_scale, found_inf)``, one launch per
    # dtype for all of them; and what groups must share to be stepped in one launch
    # (None: stepped alone), ``_merge_key(group)``.
    _step_groups: Callable[[list[tuple[dict, list[torch.Tensor]]], Any, Any], None]
    _merge_key: Callable[[dict], tuple | None]

    def _scaling_tensors(
        self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # step's arguments, else the attributes torch's scaler sets. The kernels divide by
        # the scale as GradScaler.unscale_ would.
        if grad_scale is None and found_inf is None:
            return getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        return grad_scale, found_inf

    @staticmethod
    def _compute_copies(params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        # A parameter without a compute copy stands for its own: nothing more is written.
        # Compiled, none is written: a compiled forward casts the weight in its graph,
        # and an eager one sees the step's version bump and casts anew.
        if torch.compiler.is_compiling():
            return None
        return copies_of(params)

    @staticmethod
    def _params_with_grad(group: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(what the kernels step: FP32/FP16/BF16 parameters with dense gradients of
        those dtypes; the rest, FP64, complex or with a sparse gradient, which torch's
        own implementation steps, or refuses as torch does)."""
        fused: list[torch.Tensor] = []
        rest: list[torch.Tensor] = []
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            kernel_ok = (
                p.dtype in KERNEL_DTYPES and grad.dtype in KERNEL_DTYPES and not grad.is_sparse
            )
            (fused if kernel_ok else rest).append(p)
        return fused, rest

    def step(
        self,
        closure: Callable | None = None,
        *,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Any:
        """One step of every param group (``_step_groups``, the subclass's launch, which
        takes the groups that share its flags on a device together); ``grad_scale`` and
        ``found_inf`` are a scaler's (module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        note_host_values(self.param_groups)  # for a GraphedStep's replays
        grad_scale, found_inf = self._scaling_tensors(grad_scale, found_inf)
        others = []
        # Param groups that differ in float hyperparameters only (decay and no-decay,
        # a learning rate per layer) take one launch per device: each group took its
        # own, some 80 us of host time each here (bench/NOTES.md). Compiled, each group
        # is its own op call (the ops take one value of each hyperparameter).
        # (device, merge key) -> (the device's scale and flag, [(group, params), ...])
        merged: dict[tuple, tuple[Any, Any, list]] = {}
        compiling = torch.compiler.is_compiling()
        alone = len(self.param_groups) == 1 or compiling
        try:
            # Eager, each list's facts, read by the step counts' check, serve the op that
            # steps it (reading_once).
            with torch.no_grad(), nullcontext() if compiling else reading_once():
                for group in self.param_groups:
                    params, rest = self._params_with_grad(group)
                    others.append(rest)
                    key = None if alone else self._merge_key(group)
                    for part, scale, flag in _by_device(params, grad_scale, found_inf):
                        if key is None:
                            self._step_groups([(group, part)], scale, flag)
                        else:
                            entry = merged.setdefault((part[0].device, key), (scale, flag, []))
                            entry[2].append((group, part))
                for scale, flag, parts in merged.values():
                    self._step_groups(parts, scale, flag)
        except BaseException:
            # A launch that raised may not have bumped the versions its copies expect.
            step_failed([p for group in self.param_groups for p in group["params"]])
            raise
        if any(others):
            self._torch_step(others, grad_scale, found_inf)
        return loss

    def _torch_step(self, others: list[list[torch.Tensor]], grad_scale, found_inf) -> None:
        """Step ``others`` (per param group) with torch's own implementation (the step
        of the torch class this one subclasses), as the torch optimizer would under a
        GradScaler: skipped when ``found_inf`` is set (read on the host: only for dtypes
        the kernels do not take), else on gradients unscaled in place first."""
        if found_inf is not None and found_inf.item():
            return
        if grad_scale is not None:
            # As GradScaler.unscale_ would: multiply by the reciprocal, taken in double.
            inv_scale = grad_scale.double().reciprocal().float()
            with torch.no_grad():
                for grad in (p.grad for rest in others for p in rest):
                    if grad is not None:  # (the params with a gradient)
                        grad.mul_(inv_scale.to(grad.device))
        # torch's unfused implementations refuse a scaler's tensors: hide them, and show
        # torch's step only these parameters; the state and hyperparameters are shared.
        scaling: dict[str, Any] = {
            name: self.__dict__.pop(name)
            for name in ("grad_scale", "found_inf")
            if name in self.__dict__
        }
        params = [group["params"] for group in self.param_groups]
        try:
            for group, rest in zip(self.param_groups, others, strict=True):
                group["params"] = rest
            super().step()
        finally:
            for group, kept in zip(self.param_groups, params, strict=True):
                group["params"] = kept
            self.__dict__.update(scaling)


def _step_counts(
    states: list[dict], params: list[torch.Tensor], *, zero_refused: bool
) -> list[torch.Tensor]:
    """Each parameter's ``state["step"]`` (``states`` in the order of ``params``, which
    share a device) as the kernels read it: an FP32 tensor on that device. One loaded
    from a CPU checkpoint, saved by torch's Adam under a float64 default dtype, or held
    as a number, is converted once, in its state, as torch's fused Adam converts it when
    loading. With ``zero_refused`` (Adam's counts, which torch's Adam advances in
    place), a zero tensor raises ``RuntimeError`` before anything is written, as torch's
    step refuses one; SGD's counts are mpgemm's own, and one is copied. The usual case,
    every count so already, is told by one pass in C (``list_facts``), which the step's
    op then reads again for nothing (within ``reading_once``)."""
    steps = [state["step"] for state in states]
    compiling = torch.compiler.is_compiling()
    if not compiling:  # (compiled, the checks below are traced once)
        facts = list_facts(steps, PLAIN_TYPES)
        device = params[0].get_device()
        if facts.plain and facts.dtypes == {torch.float32} and facts.devices == {device}:
            return steps
    for state, p in zip(states, params, strict=True):
        step = state["step"]
        # (not asked when traced: dynamo cannot trace _is_zerotensor, as it cannot is_neg)
        if (
            zero_refused
            and not compiling
            and isinstance(step, torch.Tensor)
            and step._is_zerotensor()
        ):
            raise RuntimeError(
                "mpgemm.optim: a parameter's state['step'] is a zero tensor, which is "
                "immutable and which the step advances in place, as torch's Adam refuses "
                "to; give it a tensor of its own (state['step'].clone())"
            )
        if not isinstance(step, torch.Tensor):
            # A number, as a checkpoint may hold it: torch's Adam makes a tensor of one
            # when loading; its SGD keeps no count, and so keeps one as it is.
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
        elif (
            step.device != p.device
            or step.dtype != torch.float32
            or (not compiling and read_otherwise(step))
        ):
            # (a copy: a negative view or zero tensor, whose memory is not its value,
            # would be read, and advanced, as its memory; not asked when traced, as
            # dynamo cannot trace is_neg)
            state["step"] = step.to(p.device, torch.float32, copy=True)
    return [state["step"] for state in states]


class SGD(_ScaledStep, torch.optim.SGD):
    """``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay, maximize) fused
    into one kernel per dtype. Momentum buffers start as zeros, which gives torch's
    first step (buffer = gradient); with dampening, which torch's first step skips, each
    parameter also keeps a step count (``state["step"]``, on its device), by which the
    kernel tells a buffer's first step."""

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float | torch.Tensor = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        _check_implementation(foreach, fused, differentiable)
        super().__init__(
            params,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )

    @staticmethod
    def _flags(group: dict) -> tuple[bool, bool]:
        """Whether the group's step has momentum, and dampening (tensors read on the
        host: they choose the kernel)."""
        momentum = host_number("momentum", group["momentum"]) != 0
        return momentum, momentum and host_number("dampening", group["dampening"]) != 0

    def _merge_key(self, group: dict) -> tuple | None:
        # The kernel's flags; a tensor lr is read from its own tensor.
        if isinstance(group["lr"], torch.Tensor):
            return None
        return *self._flags(group), group["nesterov"], group["maximize"]

    def _step_groups(self, parts, grad_scale, found_inf) -> None:
        group, params = _merged(parts)
        buffers: list[torch.Tensor] | None = None
        steps: list[torch.Tensor] | None = None
        momentum, damped = self._flags(group)
        if momentum:
            buffers = []
            # With dampening, a step count per parameter on its device (advanced only by
            # a step taken) tells the kernel a buffer's first step, which torch's takes
            # undamped: a skipped step must not count, and the host never reads the flag.
            states = []
            for p in params:
                state = self.state[p]
                states.append(state)
                new = state.get("momentum_buffer") is None
                if new:
                    state["momentum_buffer"] = torch.zeros_like(p)
                # 0 with a new buffer; 1 where the state has no count (torch's SGD keeps
                # none, and its buffer has seen a step: not a new one).
                if damped and (new or state.get("step") is None):
                    state["step"] = torch.full(
                        (), 0.0 if new else 1.0, dtype=torch.float32, device=p.device
                    )
                buffers.append(state["momentum_buffer"])
            if damped:
                steps = _step_counts(states, params, zero_refused=False)
        sgd_step_(
            params,
            [p.grad for p in params],
            buffers,
            steps=steps,
            **_hyperparameters(
                parts,
                lr="lr",
                momentum="momentum",
                dampening="dampening",
                weight_decay="weight_decay",
            ),
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            grad_scale=grad_scale,
            found_inf=found_inf,
            compute_copies=self._compute_copies(params),
        )


class _FusedAdamStep(_ScaledStep):
    _decoupled_weight_decay = False

    def _init(
        self,
        params,
        lr,
        betas,
        eps,
        weight_decay,
        amsgrad,
        maximize,
        *,
        foreach,
        fused,
        capturable,
        differentiable,
        **extra,
    ) -> None:
        _check_implementation(foreach, fused, differentiable)
        # torch.optim.Adam's or AdamW's, next in the MRO. The step counts live on the
        # parameters' device whatever ``capturable`` says (the step never reads them on
        # the host); it is kept as given, so that torch's optimizer loads the state dict.
        # (Adam's signature, not Optimizer's: mypy sees only _ScaledStep's base.)
        super().__init__(  # type: ignore[call-arg]
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            capturable=capturable,
            **extra,
        )

    def _merge_key(self, group: dict) -> tuple | None:
        # The kernel's flags; a tensor lr or beta is read from its own tensor.
        if any(isinstance(v, torch.Tensor) for v in (group["lr"], *group["betas"])):
            return None
        return group["amsgrad"], group["maximize"], self._decoupled(group)

    def _decoupled(self, group: dict) -> bool:
        return group.get("decoupled_weight_decay", self._decoupled_weight_decay)

    def _step_groups(self, parts, grad_scale, found_inf) -> None:
        group, params = _merged(parts)
        exp_avgs, exp_avg_sqs, states = [], [], []
        max_exp_avg_sqs: list[torch.Tensor] | None = [] if group["amsgrad"] else None
        for p in params:
            state = self.state[p]
            states.append(state)
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if max_exp_avg_sqs is not None:
                # Made where missing, as torch makes it with the other state: also for
                # a state from before amsgrad was turned on in the group (torch's step
                # fails on that one).
                if "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
        adam_step_(
            params,
            [p.grad for p in params],
            exp_avgs,
            exp_avg_sqs,
            _step_counts(states, params, zero_refused=True),
            **_hyperparameters(
                parts,
                lr="lr",
                beta1=("betas", 0),
                beta2=("betas", 1),
                eps="eps",
                weight_decay="weight_decay",
            ),
            decoupled_weight_decay=self._decoupled(group),
            maximize=group["maximize"],
            grad_scale=grad_scale,
            found_inf=found_inf,
            compute_copies=self._compute_copies(params),
            max_exp_avg_sqs=max_exp_avg_sqs,
        )


class Adam(_FusedAdamStep, torch.optim.Adam):
    """``torch.optim.Adam`` (L2 weight decay, or decoupled as AdamW's; AMSGrad;
    maximize) fused into one kernel per dtype."""

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
    ) -> None:
        # torch records decoupled_weight_decay in the param groups from 2.7 on; before,
        # AdamW was the only way to ask for it.
        extra = {"decoupled_weight_decay": True} if decoupled_weight_decay else {}
        self._init(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize,
            foreach=foreach,
            fused=fused,
            capturable=capturable,
            differentiable=differentiable,
            **extra,
        )


class AdamW(_FusedAdamStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay, AMSGrad, maximize) fused into one
    kernel per dtype."""

    _decoupled_weight_decay = True

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        self._init(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize,
            foreach=foreach,
            fused=fused,
            capturable=capturable,
            differentiable=differentiable,
        )
