"""``mpgemm.LossScaleOptimizer``: dynamic loss scaling and FP32 master weights around
any torch optimizer, in the spirit of Keras's ``LossScaleOptimizer``.

    optimizer = mpgemm.LossScaleOptimizer(torch.optim.AdamW(model.parameters()))
    optimizer.scale_loss(loss).backward()
    optimizer.unscale_()                                   # optional, to clip:
    torch.nn.utils.clip_grad_norm_(optimizer.master_params(), 1.0)
    optimizer.step()                 # unscale, check, step or skip, update the scale
    optimizer.zero_grad()

FP16/BF16 parameters (``model.half()``) get FP32 master copies: their scaled 16-bit
gradients are unscaled and checked straight into the masters' FP32 gradients (one
pass), the wrapped optimizer steps the masters, and the 16-bit parameters are
rewritten from them after each step, so small updates accumulate in FP32. FP32
parameters (``mpgemm.Linear``) need none.
With one of mpgemm's fused optimizers inside, a step never synchronises with the host.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mpgemm import graphs
from mpgemm.functional import read_otherwise, write_refused
from mpgemm.grad_scaler import GradScaler, OptState

__all__ = ["LossScaleOptimizer"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
# Whether ``LossScaleOptimizer.backward`` runs autograd's nodes on the calling thread
# (see there); off, on autograd's worker thread per device as torch does by default
# (for A/Bs: bench/profile_gpu.py's phases).
_CALLING_THREAD = True


def _check_writable_back(param: torch.Tensor, index: int) -> None:
    """RuntimeError for a 16-bit parameter into which its master could never be written
    back: a negative view or a zero tensor (torch's ``_foreach_copy_`` refuses both), or
    an inference tensor outside ``torch.inference_mode`` (torch refuses to write one
    there). Asked when the master is made: at the step, the write-back comes after the
    master has stepped and the scale has been updated, which an error would leave
    half done."""
    if read_otherwise(param):
        what = "a zero tensor" if param._is_zerotensor() else "a negative view"
        raise RuntimeError(
            f"LossScaleOptimizer: 16-bit parameter {index} of its param group is {what}, "
            "whose values are not its memory's, and its FP32 master could not be written "
            "back into it; give the model a parameter of its own memory "
            "(nn.Parameter(p.resolve_neg()))"
        )
    if write_refused(param):
        raise RuntimeError(
            f"LossScaleOptimizer: 16-bit parameter {index} of its param group is an "
            "inference tensor (made under torch.inference_mode), which its FP32 master "
            "could not be written back into outside that mode; clone the model's "
            "parameters first"
        )


class LossScaleOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` with dynamic loss scaling (an ``mpgemm.GradScaler`` with these
    arguments) and FP32 master weights for its FP16/BF16 parameters.

    It behaves as the wrapped optimizer: ``param_groups``, ``state`` and ``defaults``
    are the wrapped optimizer's (with master weights in place of 16-bit parameters), LR
    schedulers accept it, and ``state_dict()`` holds the wrapped optimizer's state, the
    scaler's, the skip count and the master weights, so a resumed run continues with
    the same scale and weights.

    Under ``torch.distributed``, ``all_reduce_found_inf`` (default: whenever a process
    group of more than one rank is initialised) reduces the inf/NaN flag across the
    ranks of ``process_group``, so that all ranks skip the same steps even when their
    gradients are not all-reduced (DDP's are, which makes the reduction redundant but
    harmless)."""

    # For mpgemm.compute_copy: a compiled step is counted by the wrapped optimizer's.
    _counts_own_compiled_steps = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        all_reduce_found_inf: bool | None = None,
        process_group: Any = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"LossScaleOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            raise ValueError("the wrapped optimizer has no parameters")
        self.optimizer = optimizer
        # master -> model parameter: whose gradient the scaler unscales into the master's
        self._grad_sources: dict[torch.Tensor, torch.Tensor] = {}
        self.scaler = _MasterScaler(
            params[0].device.type,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            grad_sources=self._grad_sources,
            skipped=torch.zeros((), dtype=torch.int64, device=params[0].device),
            all_reduce_found_inf=all_reduce_found_inf,
            process_group=process_group,
        )
        # The 16-bit model parameters that have FP32 masters, and their masters, in order
        self._low_params: list[torch.Tensor] = []
        self._masters: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            self._install_masters(group)
        # Hooks as torch.optim.Optimizer.__init__ sets them up (without its groups):
        # register_step_pre_hook, register_state_dict_post_hook and the others work on
        # the wrapper.
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()

    # -- the wrapped optimizer's face ------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        try:
            self._install_masters(self.optimizer.param_groups[-1])
        except RuntimeError:  # (a parameter refused: the group is not added)
            self.optimizer.param_groups.pop()
            raise

    def __repr__(self) -> str:
        return f"LossScaleOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        # All of it: torch's Optimizer.__getstate__ keeps defaults, state and
        # param_groups, the wrapped optimizer's here, and an unpickled or deep-copied
        # wrapper had no wrapped optimizer (AttributeError). Torch's __setstate__ then
        # restores the dict and patches step.
        return self.__dict__.copy()

    def _install_masters(self, group: dict[str, Any]) -> None:
        # Every parameter asked before any is replaced: a refusal leaves the group whole.
        for index, param in enumerate(group["params"]):
            if param.dtype in _LOW_PRECISION:
                _check_writable_back(param, index)
        for index, param in enumerate(group["params"]):
            if param.dtype not in _LOW_PRECISION:
                continue
            master = param.detach().float().requires_grad_(param.requires_grad)
            group["params"][index] = master
            if param in self.optimizer.state:
                state = self.optimizer.state.pop(param)
                self.optimizer.state[master] = {
                    k: v.float() if torch.is_tensor(v) and v.dtype in _LOW_PRECISION else v
                    for k, v in state.items()
                }
            self._low_params.append(param)
            self._masters.append(master)
            self._grad_sources[master] = param

    def master_params(self) -> Iterator[torch.Tensor]:
        """The parameters the wrapped optimizer steps (FP32 masters in place of 16-bit
        parameters): after ``unscale_()``, clip these gradients."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    # -- loss scaling ----------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``: call ``backward()`` on this (or use ``backward``)."""
        return self.scaler.scale(loss)

    def backward(
        self,
        loss: torch.Tensor,
        *,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        """``scale_loss(loss).backward()``, with the same gradients bit for bit and three
        launches fewer: autograd starts from the loss scale as the loss's gradient
        (``loss.backward(scale)``) where it would start from ones and multiply them by
        the scale (the product's backward), after the product itself. ``loss``: one
        element; the keywords are ``Tensor.backward``'s. The scale tensor itself is
        the seed: a tensor hook on ``loss`` must not change its gradient in place (as
        torch asks of every hook).

        The backward runs on the calling thread
        (``torch.autograd.set_multithreading_enabled(False)``), hooks included. By
        default autograd hands a GPU's nodes to a worker thread of that device and
        wakes the caller when they are done: for a graph on one device, two thread
        handoffs a step and nothing to overlap. In run8's profile of the guide MLP's
        eager step (an H200's host: ``bench/results/h200-2026-11-26/run8-at-c0225a0/
        profile/guide_mpgemm.trace.json``) the worker's first node began 107 to 196 us
        after the caller's last op, and the caller's next op came 124 to 324 us after
        the worker's last, mostly the handoffs (the Python between is a few calls);
        autocast's step on the H100 (run2) waited 69 to 229 and 116 to 271 us. Torch's
        engine is moving to the calling thread for graphs on one device (pytorch
        #192004, #192082). A graph spanning several GPUs of one process then runs
        their nodes one after another; ``scale_loss(loss).backward()`` gives the same
        gradients with autograd's threads, which overlap them."""
        if loss.numel() != 1:
            # (what scale_loss(loss).backward() raises)
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
        # (No copy where the device and dtype are the scale's: an FP32 loss.)
        seed = self.scaler._scale_on(loss.device).to(loss.dtype).expand_as(loss)
        with torch.autograd.set_multithreading_enabled(not _CALLING_THREAD):
            loss.backward(seed, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (reading it synchronises with a GPU: for logging)."""
        return self.scaler.get_scale()

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped for inf/NaN gradients (synchronises, as above)."""
        return int(self.scaler.skipped.item())

    def unscale_(self) -> None:
        """Unscale the gradients now, for clipping: scale, backward, ``unscale_``, clip,
        ``step``. A 16-bit parameter's gradient is unscaled straight into its FP32
        master's gradient, in the same pass that checks it."""
        self.scaler._unscale(self.optimizer)

    def _unscaled_this_iteration(self) -> bool:
        state = self.scaler._per_optimizer_states.get(id(self.optimizer))
        return state is not None and state["stage"] is not OptState.READY

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Unscale and check the gradients, step the wrapped optimizer unless one is
        inf/NaN (then count a skipped step), update the scale, and rewrite 16-bit
        parameters from their masters."""
        if closure is not None:
            raise RuntimeError("LossScaleOptimizer.step does not take a closure")
        if self.scaler._scale is None and self.scaler.is_enabled():
            self._step_before_any_scaled_loss()
            return
        if self._masters and not self._unscaled_this_iteration():
            # The masters' gradients come from the 16-bit ones: unscale them across now
            # (the scaler alone would not know where to read them).
            self.unscale_()
        self.scaler.step(self.optimizer)
        self.scaler.update()  # counts a skipped step too
        # A skipped step left the masters as they were, so this rewrites the same values.
        self._write_back_masters()

    def _write_back_masters(self) -> None:
        """The 16-bit parameters rewritten from their FP32 masters, in one launch."""
        if self._masters:
            # A replay steps the masters of what its capture saw requiring grad: the
            # 16-bit parameters are checked before each (the scaler notes the masters).
            graphs.note_parameters("LossScaleOptimizer's 16-bit parameters", self._low_params)
            torch._foreach_copy_(self._low_params, self._masters)

    def _step_before_any_scaled_loss(self) -> None:
        """A step before any loss was scaled, so with no scale to unscale by: the one
        that ``torch.distributed.checkpoint``'s state-dict functions take on a fresh
        optimizer to make its state, with zero gradients (and lr 0), is the wrapped
        optimizer's. Any other gradient came from a loss that was not scaled, and is
        refused (reading them waits for the GPU: on this path only)."""
        grads = (p.grad for p in (*self.master_params(), *self._low_params))
        if any(bool(grad.any()) for grad in grads if grad is not None):
            raise RuntimeError(
                "LossScaleOptimizer.step: no loss has been scaled yet, so the gradients are "
                "not scaled ones; backward through optimizer.backward(loss) or "
                "optimizer.scale_loss(loss).backward()"
            )
        self.optimizer.step()
        self._write_back_masters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the wrapped optimizer's parameters and of the 16-bit
        model parameters behind any masters."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for param in self._low_params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.zero_()

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict in torch's format ("state" and
        "param_groups": what ``torch.distributed.checkpoint``'s ``get_state_dict``
        reads, and what the wrapped optimizer's class loads), with the loss scaling's
        beside them: "scaler" (the scale and its growth tracker), "skipped_steps" and
        "master_params" (the FP32 masters of 16-bit parameters, in order). The hooks
        registered on this optimizer run as torch's run them
        (``register_state_dict_pre_hook``, ``register_state_dict_post_hook``)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = {
            **self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "master_params": [master.detach().clone() for master in self._masters],
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()``'s, or a wrapped optimizer's alone, which leaves the
        scale, the skip count and the masters as they are
        (``torch.distributed.checkpoint``'s ``set_state_dict`` hands over "state" and
        "param_groups" only; the scaler's ``state_dict()`` saves the scale beside), or
        one of the format before 2026-11-26, the wrapped optimizer's under
        "optimizer". The hooks registered on this optimizer run as torch's run them
        (``register_load_state_dict_pre_hook``, ``register_load_state_dict_post_hook``)."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if "optimizer" in state_dict:
            nested = {key: value for key, value in state_dict.items() if key != "optimizer"}
            state_dict = {**state_dict["optimizer"], **nested}
        masters = state_dict.get("master_params")
        if masters is not None and len(masters) != len(self._masters):
            raise ValueError(
                f"the state dict has {len(masters)} master weights, this optimizer "
                f"{len(self._masters)}"
            )
        self.optimizer.load_state_dict({key: state_dict[key] for key in ("state", "param_groups")})
        if "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])
        if "skipped_steps" in state_dict:
            self.scaler.skipped.fill_(state_dict["skipped_steps"])
        if masters is not None:
            with torch.no_grad():
                for param, master, saved in zip(
                    self._low_params, self._masters, masters, strict=True
                ):
                    master.copy_(saved)
                    param.copy_(saved)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


class _MasterScaler(GradScaler):
    """LossScaleOptimizer's scaler: FP32 masters take their 16-bit model parameters'
    gradients (``_grad_sources``), under ``torch.distributed`` each device's flag is
    MAX-reduced across ``process_group`` (``_reduce_found_inf``), the scale update
    counts skipped steps in ``skipped`` (``_skip_counter``) and zeroes the flag it
    reads, which the next eager iteration reuses (``_fresh_flag``,
    ``_zeroed_by_update``). Being methods, these survive pickling (a ProcessGroup
    itself does not pickle)."""

    def __init__(
        self,
        *args: Any,
        grad_sources: dict[torch.Tensor, torch.Tensor],
        skipped: torch.Tensor,
        all_reduce_found_inf: bool | None,
        process_group: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._sources = grad_sources
        self.skipped = skipped
        self._all_reduce_found_inf = all_reduce_found_inf
        self._process_group = process_group
        # The flag that eager iterations' checks raise, reused: the scale update zeroes
        # it once read, where a new flag would take a launch (a zeros) every step. None
        # until the first check; ``_flag_zeroed``: whether the last to write it was
        # such an update (in stream order), else it is zeroed before it is handed out.
        self._flag: torch.Tensor | None = None
        self._flag_zeroed = False

    def _grad_sources(self, optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor]:
        return self._sources

    def _fresh_flag(self, scale: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or graphs.capturing(scale.device):
            # A graph's iterations take flags of their own: its replays run apart from
            # the eager steps, which know nothing of what a replay left in this one.
            return super()._fresh_flag(scale)
        flag = self._flag
        if flag is None or flag.device != scale.device:
            flag = self._flag = super()._fresh_flag(scale)
        elif not self._flag_zeroed:
            flag.zero_()
        self._flag_zeroed = False
        return flag

    def _zeroed_by_update(self, found_inf: torch.Tensor) -> bool:
        # Only where the update reads this flag itself (one device; not a sum of flags),
        # never a compiled step's (asked first: dynamo would guard on the attribute).
        if torch.compiler.is_compiling() or found_inf is not self._flag:
            return False
        self._flag_zeroed = True
        return True

    def _skip_counter(self, scale: torch.Tensor) -> torch.Tensor:
        if self.skipped.device != scale.device:  # the loss, and so the scale, elsewhere
            self.skipped = self.skipped.to(scale.device)
        return self.skipped

    def _reduce_found_inf(self, found_inf: torch.Tensor) -> None:
        reduce = self._all_reduce_found_inf
        if reduce is None:
            reduce = (
                dist.is_available()
                and dist.is_initialized()
                and dist.get_world_size(self._process_group) > 1
            )
        if reduce:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self._process_group)
