"""16-bit copies of FP32 master weights, for the Tensor Cores, that are never stale.

An ``mpgemm.Linear`` keeps its weight in FP32 (the master) and hands its GEMMs a copy
in the compute dtype: an FP32 operand would be converted in the kernel on every tile,
through shared memory, and keep Hopper's MMAs from overlapping the loads. The copy is
remade whenever the weight may have changed under it: a new tensor or storage (a new
Parameter, ``.to()``, ``.data =``), or a bump of its version counter (any in-place
change through torch: ``load_state_dict``, ``torch.optim`` optimizers, ``mul_``, ...).
mpgemm's fused optimizers write the copy in the same kernel pass that updates the
master (``copies_of``), then bump the master's version once, as torch's in-place ops
do (so that autograd refuses a graph saved before the step): at that version the copy
is known current (``ComputeCopy.tensor_for``), and no cast runs in the next
forward.

Some writers change a weight without a version bump: FSDP2, which all-gathers each
unsharded weight into the same storage under ``_unsafe_preserve_version_counter``,
often at the same address, with values from an optimizer step on its shards or a
loaded state dict (``mpgemm.Linear`` drops its copy when it loads one); and optimizers
whose own kernels write the weights (bitsandbytes'). So a copy is also stale once such
a step has begun since it was last current, unless that step's optimizer wrote it
(torch's global step pre-hook counts them): where a process group exists (FSDP2 needs
one), every optimizer's step; without one, the step of any optimizer but torch's and
mpgemm's, whose writes bump the versions (``_bumps_what_it_writes``). So with two
optimizers (a GAN's generator's and discriminator's), one's steps leave the other's
copies current. Only a weight with a gradient is stepped, so a frozen weight's copy
(``requires_grad`` off when it was last handed out, and now) outlives even those
steps without a process group: a frozen backbone's or LoRA's base layers keep their
copies across the steps of what trains (each was cast at every forward, as autocast
casts a frozen weight at every use). Under ``torch.compile``, mpgemm's optimizers count
their steps in their custom ops, at run time; any other optimizer's step is counted in
a graph break (torch's own optimizers break the graph there anyway; one compiled with
``fullgraph=True`` would raise there).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mpgemm import graphs

# id(weight) -> a weak reference to its ComputeCopy, for the optimizers. The holder,
# not the weight, is referenced weakly: ``torch.utils.swap_tensors`` refuses a tensor
# that has a weak reference (``module.to()`` swaps parameters under
# ``torch.__future__.set_swap_module_params_on_conversion``, and whenever the new value
# is of another tensor type). An entry is checked on each lookup by the storage the
# holder's copy was made from (``tensor_for``), so a weight whose id is reused finds
# nothing, or the copy of its own memory; each holder keeps one entry, removed with it.
_copies: dict[int, weakref.ref[ComputeCopy]] = {}


def _register(weight: torch.Tensor, holder: ComputeCopy) -> None:
    key = id(weight)
    if holder._key == key and (entry := _copies.get(key)) is not None and entry() is holder:
        return
    if holder._key is not None:  # its entry for its weight before this one
        previous = _copies.get(holder._key)
        if previous is not None and previous() is holder:
            del _copies[holder._key]
    holder._key = key

    def forget(ref: weakref.ref) -> None:
        if _copies.get(key) is ref:  # not a later holder's entry under this id
            del _copies[key]

    _copies[key] = weakref.ref(holder, forget)


# Optimizer steps begun so far that may have written weights without a version bump:
# with a process group, every step; without one, the steps of optimizers other than
# torch's and mpgemm's (``_bumps_what_it_writes``).
_steps = 0


def _count_step(optimizer, args, kwargs) -> None:
    # Traced by torch.compile, the count must not be read: ``_steps += 1`` became a
    # guard on its value, and every compiled step recompiled (dynamo gives up after 8
    # and runs the frame eagerly). mpgemm's optimizers (``_counts_own_compiled_steps``)
    # count a compiled step where it runs (mpgemm.ops); any other optimizer's count
    # runs eagerly, in a graph break (torch's optimizers break the graph there anyway).
    if not torch.compiler.is_compiling():
        _count_step_of(type(optimizer))
    elif not getattr(optimizer, "_counts_own_compiled_steps", False):
        _count_step_eagerly(type(optimizer))


def _count_step_of(optimizer_type: type) -> None:
    if _distributed() or not _bumps_what_it_writes(optimizer_type):
        count_step()


# Run eagerly where torch.compile traces the call (a graph break). torch's lazy form of
# torch.compiler.disable, which torch's own optimizers use: the eager one imports
# torch._dynamo where it decorates, 1.4 s of every ``import mpgemm`` here (torch's own
# import takes 1.5); this one imports it at its first call, which only a traced step
# makes (dynamo is imported by then).
_count_step_eagerly = torch._disable_dynamo(_count_step_of)


@functools.cache
def _bumps_what_it_writes(optimizer_type: type) -> bool:
    """Whether an optimizer's ``step`` is torch's (``torch.optim``: torch ops, each of
    which bumps the version of what it writes) or mpgemm's (its kernels' writes are
    bumped by the ops, ``mpgemm.scaling``). A step of anyone else's may write through
    its own kernels without a bump (bitsandbytes' optimizers do), so it makes every
    copy it may have written stale."""
    step = optimizer_type.step  # type: ignore[attr-defined]
    module = inspect.unwrap(step).__module__ or ""
    return module.startswith(("torch.optim.", "mpgemm."))


@torch._disable_dynamo  # (as _count_step_eagerly)
def count_step() -> None:
    """Count an optimizer step that may have written weights without a version bump."""
    global _steps
    _steps += 1


register_optimizer_step_pre_hook(_count_step)


def _distributed() -> bool:
    """Whether this process has a ``torch.distributed`` process group, without which
    FSDP2 (and any other sharding that rewrites weights without a version bump) cannot
    run."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _storage(weight: torch.Tensor) -> tuple:
    return (weight.data_ptr(), weight.device, weight.shape, weight.stride())


class _Made(NamedTuple):
    """A copy and what it was made from: the weight's storage and version
    (``_storage`` and ``_version``), and the weight itself, held so that its storage's
    address cannot be reused by a new weight's while the copy exists (a new storage
    always shows as a new address). It is the weight's own storage, so it costs nothing
    unless the weight moved (.to(), .data =), and then only until the next forward."""

    tensor: torch.Tensor
    made_from: tuple
    source: torch.Tensor


class ComputeCopy:
    """A ``dtype`` copy of one FP32 weight at a time, remade only when stale."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        # One attribute, read once per call: threads that share the layer with other
        # weights (nn.DataParallel's replicas share its attributes) each see a copy
        # with what it was made from, never one thread's copy with another's key.
        self._made: _Made | None = None
        # _steps when the copy was last known current: made, handed out unchanged, or
        # handed to an optimizer to write.
        self._current_at = -1
        # Whether the weight required grad when the copy was last handed out: frozen
        # after its backward, it is still stepped with the gradient it has.
        self._trainable = True
        # id of the weight it was last registered for (``_register``).
        self._key: int | None = None
        # (id of the weight, its version after the step) of a step that is writing the
        # copy (``tensor_for``'s ``stepping``), until the next ``of``.
        self._stepped: tuple[int, int] | None = None

    def __getstate__(self) -> dict:
        # A pickled or deep-copied layer (torch.save(model), copy.deepcopy for an EMA
        # model) leaves its copy behind, half its weight's bytes again: the next
        # forward remakes it. The dtype is all a holder without a copy has.
        return {"dtype": self.dtype}

    def __setstate__(self, state: dict) -> None:
        # A holder without a copy, also from a layer pickled before 2026-11-26, whose
        # state held the copy in three attributes (_tensor, _made_from, _source).
        self.__init__(state["dtype"])  # type: ignore[misc]

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` in ``dtype``, laid out like it; cast now only if the copy is stale."""
        identity = (*_storage(weight), weight._version)
        made = self._made
        stepped = self._stepped
        if stepped is not None:
            # The version an optimizer's step gave this weight when it wrote the copy:
            # still that version (no edit since) and storage, the copy is current.
            if (
                made is not None
                and stepped == (id(weight), identity[-1])
                and made.made_from[:-1] == identity[:-1]
            ):
                made = self._made = made._replace(made_from=identity)
            self._stepped = None
        trainable = weight.requires_grad
        if (
            made is None
            or made.made_from != identity
            or (self._current_at != _steps and self._stepped_maybe(trainable))
        ):
            # A normal tensor even under inference_mode (an evaluation pass): made there,
            # the kept copy would be an inference tensor, which the next training
            # forward could not save for backward.
            with torch.inference_mode(False), torch.no_grad():
                copy = torch.empty_like(weight, dtype=self.dtype)
                # (resolved first: torch 2.13's copy_ between FP32 and FP16 ignores a
                # negative view's sign, and made a negative-view weight's copy its
                # negation)
                copy.copy_(weight.resolve_neg())
            made = self._made = _Made(copy, identity, weight.detach())
        # Current as of now: made now, or neither changed nor possibly stepped since.
        self._current_at = _steps
        self._trainable = trainable
        _register(weight, self)
        # A capture's copy must outlive a remaking of it (after another optimizer's
        # step, a loaded state dict, a cast): the replays read and write it there. It
        # stays current while the graph's own steps write it.
        if graphs.capturing(made.tensor.device):
            graphs.keep_for_replays((made.tensor,))
        return made.tensor

    def _stepped_maybe(self, trainable: bool) -> bool:
        """Whether the steps taken since the copy was last current may have written the
        weight without a version bump (the module docstring): where it requires grad
        now or did then, or where FSDP2 (which needs a process group) may rewrite it."""
        return trainable or self._trainable or _distributed()

    @property
    def tensor(self) -> torch.Tensor | None:
        """The copy as last made (None before the first ``of`` or after ``drop``)."""
        made = self._made
        return None if made is None else made.tensor

    def drop(self) -> None:
        """Forget the copy: the next ``of`` casts."""
        self._made = None

    def tensor_for(self, weight: torch.Tensor, *, stepping: bool = False) -> torch.Tensor | None:
        """The copy's tensor when it was made from ``weight``'s storage (current or not:
        an optimizer overwrites all of it), else None. Asked by an optimizer's step,
        which then writes it: the copy is current after this step. ``stepping``: the
        step then bumps the weight's version once (``mpgemm.scaling``'s ops bump what
        they write, as torch's in-place ops do): at that version, if no edit follows,
        the copy is still current."""
        made = self._made
        storage = _storage(weight)
        if made is None or made.made_from[:-1] != storage:
            return None
        self._current_at = _steps
        if stepping:
            self._stepped = (id(weight), weight._version + 1)
        return made.tensor

    def step_failed(self) -> None:
        """The step that asked ``tensor_for(stepping=True)`` raised: it may not have bumped the
        version it was to give (a later edit's could then pass for it)."""
        self._stepped = None


def _holder(weight: torch.Tensor) -> ComputeCopy | None:
    """The ``ComputeCopy`` registered under ``weight``'s id, if alive (its copy's storage
    tells whether it is ``weight``'s: ``ComputeCopy.tensor_for``)."""
    entry = _copies.get(id(weight))
    return None if entry is None else entry()


def copy_of(weight: torch.Tensor, *, stepping: bool = False) -> torch.Tensor | None:
    """The compute copy an optimizer should write along with ``weight``, if it has one
    (``ComputeCopy.tensor_for``, ``stepping`` as there)."""
    holder = _holder(weight)
    return None if holder is None else holder.tensor_for(weight, stepping=stepping)


def copies_of(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's compute copy, or the parameter itself where it has none: what an
    optimizer's step writes, and then bumps the version of each parameter once
    (``ComputeCopy.tensor_for``'s ``stepping``; where the step raises,
    ``step_failed(params)``). Asked once per step and list, so the capture check is
    made once."""
    copies = [c if (c := copy_of(p, stepping=True)) is not None else p for p in params]
    if copies and graphs.capturing(copies[0].device):  # as in ComputeCopy.of
        graphs.keep_for_replays(c for c, p in zip(copies, params, strict=True) if c is not p)
    return copies


def step_failed(params: list[torch.Tensor]) -> None:
    """``ComputeCopy.step_failed`` for each parameter's copy: the step that ``copies_of``
    was asked for raised."""
    for p in params:
        if (holder := _holder(p)) is not None:
            holder.step_failed()
