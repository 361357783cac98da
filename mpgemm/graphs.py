"""A whole training step as one CUDA graph: captured once, replayed every step.

A small model's step is bound by the host (Python, dispatch, one launch per kernel),
not by the GPU; a replayed graph launches every kernel of the step at once. mpgemm's
step is capturable because nothing in it waits for the GPU: the inf check, the skipped
step, the skip counter and the scale update stay on the device (``LossScaleOptimizer``,
``mpgemm.optim``), so a replay does exactly what the eager step would.

    step = GraphedStep(train_step)        # train_step(x, y) -> loss
    for x, y in batches:
        loss = step(x, y)

What a replay cannot see: the Python side of the step runs once, at capture. Hyper-
parameters read on the host (a float learning rate that a schedule changes in
``param_groups``), new parameters, or a change of the inputs' shapes need a new capture
(a call whose inputs' shapes or dtypes differ from the captured ones runs eagerly
instead). The param groups that mpgemm's optimizers and scalers step (and a
``LossScaleOptimizer``'s 16-bit parameters behind their masters) are checked before
each replay: a host value of theirs (a float ``lr``, ``betas``, ``weight_decay``...), a
group added, or a parameter added, removed or frozen since the capture raises
``RuntimeError``, where the replay would keep stepping what it captured. A tensor
``lr`` on the GPU (``mpgemm.optim``'s optimizers take one, as torch's do) is read by the
kernels at each replay, so a schedule that changes it in place between calls (torch's
schedulers ``fill_`` it) reaches every replay. A tensor read on the host (a CPU tensor,
or a weight decay, eps, momentum or dampening as a tensor) is checked by its value as
a float is; such a CUDA tensor is refused at the capture. What a capture read from
mpgemm's caches (the layers' 16-bit weight copies, the kernels' tables) stays allocated
for its replays, even where eager work between them remakes it (another optimizer's
step, then an eager forward, remakes the copies).
"""

from __future__ import annotations

import functools
import numbers
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["GraphedStep"]

# (numbers.Number: numpy's scalars too, an np.float32 lr, which torch's optimizers take)
_HOST_TYPES = (numbers.Number, str, type(None))
# The param group keys whose tensors mpgemm's kernels read on the device at every step
# (``mpgemm.scaling._TENSOR_HYPERPARAMETERS``), but for a CPU tensor with parameters
# elsewhere, which is read on the host. A tensor of another key is read on the host (a
# CUDA one refused in a capture: ``mpgemm.scaling.host_number``).
_READ_ON_DEVICE = ("lr", "betas")


def _kind(key: str, value: object, params_device: torch.device | None) -> str | None:
    """How a replay uses a param group's value: "host" for a number, flag or string, or
    a tensor read on the host (or a tuple or list of them, as Adam's betas), which the
    capture baked in; "device" for a tensor that the kernels read (or a tuple or list
    with one), which each replay reads where it was; None for anything else.
    ``params_device``: the group's parameters'."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    if not all(isinstance(v, (torch.Tensor, *_HOST_TYPES)) for v in values):
        return None
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if (
        tensors
        and key in _READ_ON_DEVICE
        and all(t.device.type != "cpu" or t.device == params_device for t in tensors)
    ):
        return "device"
    # Read on the host: a CPU tensor's value is noted (a CUDA one is refused at capture).
    return "host" if all(t.device.type == "cpu" for t in tensors) else None


def _host_value(group: Mapping[str, Any], key: str) -> object:
    """``group[key]`` as a capture baked it in: a CPU tensor as its value (a list)."""
    value = group.get(key)
    if isinstance(value, (tuple, list)):
        return type(value)(v.tolist() if isinstance(v, torch.Tensor) else v for v in value)
    return value.tolist() if isinstance(value, torch.Tensor) else value


def _held(group: Mapping[str, Any], key: str) -> object:
    """``group[key]``, a list as a tuple: which tensors it holds now (the list itself
    may be changed in place)."""
    value = group.get(key)
    return tuple(value) if isinstance(value, list) else value


def _same_tensors(now: object, then: object) -> bool:
    """Whether ``now`` holds the very tensors ``then`` held (changed in place or not),
    and equal numbers beside them."""
    if isinstance(then, tuple):
        return (
            isinstance(now, tuple)
            and len(now) == len(then)
            and all(_same_tensors(a, b) for a, b in zip(now, then, strict=True))
        )
    if isinstance(then, torch.Tensor):
        return now is then
    return type(now) is type(then) and now == then


_requires_grad = operator.attrgetter("requires_grad")


def _params_key(params: list[torch.Tensor]) -> tuple:
    """Which parameters, and whether each still requires grad (read in C-level passes:
    a replay of a step over 200 parameters asks)."""
    return tuple(map(id, params)), tuple(map(_requires_grad, params))


def _group_params_key(group: Mapping[str, Any]) -> tuple:
    return _params_key(group["params"])


class HostReads:
    """What a capture's step read on the host, which each of its replays repeats: per
    optimizer, the number of its param groups, each group's parameters (which, and
    whether they require grad), its host values (a float ``lr``, ``betas``...), and the
    tensors it held (a tensor ``lr``: each replay reads the one captured, so a new one
    would not reach it). ``changed()`` says what differs now."""

    def __init__(self) -> None:
        # (what, a function that reads it now, its value then, its kind: "host", a value
        # compared by equality, which could have been a CUDA tensor the kernels read (lr,
        # betas); "host only", the same for another; "device", tensors by identity;
        # "structure", parameters)
        self._entries: list[tuple[str, Callable[[], object], object, str]] = []
        self._noted: list[object] = []  # the lists noted (held: ids stay)

    def _first_sight(self, noted: object) -> bool:
        if any(seen is noted for seen in self._noted):
            return False
        self._noted.append(noted)
        return True

    def note(self, groups: list[dict[str, Any]]) -> None:
        if not self._first_sight(groups):
            return
        self._add("the number of param groups", lambda: len(groups), "structure")
        for index, group in enumerate(groups):
            name = f"param group {index}"
            self._add(
                f"{name}'s parameters", functools.partial(_group_params_key, group), "structure"
            )
            params = group["params"]
            device = params[0].device if params else None
            for key, value in group.items():
                kind = None if key == "params" else _kind(key, value, device)
                if kind is None:
                    continue
                read = _host_value if kind == "host" else _held
                if kind == "host" and key not in _READ_ON_DEVICE:
                    kind = "host only"
                self._add(f"{name}'s {key}", functools.partial(read, group, key), kind)

    def note_parameters(self, what: str, params: list[torch.Tensor]) -> None:
        """Note ``params`` (a list that the caller keeps current), which a step reads
        beside its param groups (``LossScaleOptimizer``'s 16-bit parameters behind their
        masters): which, and whether each requires grad."""
        if self._first_sight(params):
            self._add(what, functools.partial(_params_key, params), "structure")

    def _add(self, what: str, read: Callable[[], object], kind: str) -> None:
        self._entries.append((what, read, read(), kind))

    def changed(self) -> str | None:
        """What differs now from the capture, and what to do, in words; None if nothing
        does."""
        for what, read, then, kind in self._entries:
            now = read()
            if kind == "device":
                if _same_tensors(now, then):
                    continue
            elif type(now) is type(then) and now == then:
                continue
            if kind == "structure":
                return (
                    f"{what} changed (added, removed or frozen) since the step was captured, "
                    "whose replays step what they captured: make a new GraphedStep after "
                    "such a change"
                )
            if kind == "device":
                return (
                    f"{what} was replaced since the step was captured, whose replays read "
                    "the tensor it held: change that tensor in place instead"
                )
            remedy = "make a new GraphedStep after changing it"
            if kind == "host":
                remedy = (
                    "give it as a CUDA tensor changed in place (as LR schedulers fill_ a "
                    f"tensor lr), or {remedy}"
                )
            return (
                f"{what} is {now!r}, but the step was captured with {then!r}, which its "
                f"replays keep using: {remedy}"
            )
        return None


# What CUDA graph captures used from mpgemm's caches: tables and their pinned host
# sources (``mpgemm.kernels.tensor_table``), the layers' 16-bit weight copies
# (``mpgemm.compute_copy``). Their replays read (and write) them again at the same
# addresses, so they are kept for the process whatever the caches drop: freed, their
# memory would be the allocator's to hand to another tensor.
_kept_for_replays: list[object] = []


def capturing(device: torch.device) -> bool:
    """Whether work for ``device`` is being captured into a CUDA graph (the current
    stream's capture; never for a CPU device, which a CPU-only torch cannot ask about)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def keep_for_replays(values: Iterable[object]) -> None:
    """Keep ``values``, which a capture used from a cache, for as long as the process."""
    _kept_for_replays.extend(values)


# Pinned host memory set aside before a capture, which the host-to-device copies made
# during it read from (``staged_for_capture``): asked for memory, torch's pinned
# allocator queried CUDA events, which a capture forbids, in torch versions without
# pytorch/pytorch#167507 (the oldest torch mpgemm supports, 2.11, may lack it). A
# region handed out is never handed out again: every replay copies from it. uint8.
_reserve: torch.Tensor | None = None
_reserved_used = 0


def reserve_host_memory(nbytes: int) -> None:
    """Outside a capture: have at least ``nbytes`` of pinned host memory ready for
    ``staged_for_capture``, in one block. Regions already handed out stay where they
    are (their tensors keep their memory)."""
    global _reserve, _reserved_used
    if _reserve is None or _reserve.numel() - _reserved_used < nbytes:
        _reserve = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        _reserved_used = 0


def _cached_table_bytes() -> int:
    """What the kernels' cached tables weigh (0 without triton: no kernels, no tables)."""
    try:
        from mpgemm.kernels.tensor_table import cached_bytes
    except ImportError:
        return 0
    return cached_bytes()


def staged_for_capture(host: torch.Tensor) -> torch.Tensor | None:
    """A copy of the CPU tensor ``host`` in the reserved pinned memory, for a capture's
    host-to-device copy to read at every replay (16-byte aligned; never handed out
    again); None where the reserve is too small (``reserve_host_memory``)."""
    global _reserved_used
    start = -(-_reserved_used // 16) * 16
    end = start + host.numel() * host.element_size()
    if _reserve is None or end > _reserve.numel():
        return None
    region = _reserve[start:end]
    _reserved_used = end
    region.copy_(host.contiguous().view(-1).view(torch.uint8))
    return region.view(host.dtype).view(host.shape)


# While a GraphedStep captures, what its step reads on the host; else None.
_host_reads: HostReads | None = None


def note_host_values(param_groups: list[dict[str, Any]]) -> None:
    """Say that the step now running reads an optimizer's ``param_groups`` on the host:
    while a ``GraphedStep`` captures, they are noted (``HostReads``) for its replays to
    check; otherwise nothing. Called by mpgemm's optimizers and scalers."""
    if _host_reads is not None:
        _host_reads.note(param_groups)


def note_parameters(what: str, params: list[torch.Tensor]) -> None:
    """Say that the step now running reads ``params`` beside its param groups: while a
    ``GraphedStep`` captures, they are noted (``HostReads.note_parameters``); otherwise
    nothing."""
    if _host_reads is not None:
        _host_reads.note_parameters(what, params)


@contextmanager
def _recording_host_reads() -> Iterator[HostReads]:
    """Within the block, ``note_host_values`` notes into the ``HostReads`` yielded."""
    global _host_reads
    reads = _host_reads = HostReads()
    try:
        yield reads
    finally:
        _host_reads = None


class GraphedStep:
    """``fn(*inputs) -> tensor`` run eagerly for ``warmup_steps`` calls (compiling and
    autotuning the kernels, creating the optimizer's state), captured as a CUDA graph on
    the next call, and replayed from then on.

    Each captured call copies its inputs into the graph's static input buffers, replays,
    and returns a copy of the static output (earlier results stay valid). Inputs must be
    CUDA tensors; ``fn`` must not synchronise with the host (capture raises if it does).
    A replay first checks what the capture's optimizer steps read on the host
    (``HostReads``: the param groups, their parameters and host values): a change
    raises ``RuntimeError``. The kernels' tables that the capture builds (for gradients
    it allocates anew) are copied to the GPU from pinned host memory set aside before
    it, twice what the tables cached by then weigh (``reserve_host_memory``). A ``fn``
    that sets the gradients to None
    (``zero_grad()``'s default) has the replays rewrite the gradients the capture made;
    gradients kept and zeroed in place cost each replay a pass to zero them and one to
    add the new ones into them.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], *, warmup_steps: int = 3) -> None:
        if not callable(fn):
            raise TypeError(f"GraphedStep: fn must be callable, got {type(fn).__name__}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be at least 1, got {warmup_steps}")
        self.fn, self.warmup_steps = fn, warmup_steps
        self.calls = 0
        self._inputs: list[torch.Tensor] = []
        # The graph and its static output, once captured.
        self._captured: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None
        # The warm-up runs on a side stream, as torch's capture recipe asks (lazy
        # initialisation must not land on the capturing stream).
        self._side: torch.cuda.Stream | None = None
        # What the capture read on the host (``note_host_values``).
        self._host_reads = HostReads()

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured graph (None before the capture)."""
        return None if self._captured is None else self._captured[0]

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        self._check(inputs)
        self.calls += 1
        if self._captured is None and self.calls <= self.warmup_steps:
            return self._warmup(inputs)
        if self._captured is None:
            self._captured = self._capture(inputs)
        elif not self._matches(inputs):
            return self.fn(*inputs)
        changed = self._host_reads.changed()
        if changed is not None:  # a replay runs no Python: it would not see the change
            raise RuntimeError(f"GraphedStep: {changed}")
        graph, output = self._captured
        for static, x in zip(self._inputs, inputs, strict=True):
            static.copy_(x)
        graph.replay()
        return output.clone()

    def _check(self, inputs) -> None:
        bad = [
            type(x).__name__ if not torch.is_tensor(x) else str(x.device)
            for x in inputs
            if not (torch.is_tensor(x) and x.is_cuda)
        ]
        if bad:
            raise ValueError(
                f"GraphedStep replays CUDA graphs: its inputs must be CUDA "
                f"tensors, got {', '.join(bad)}"
            )

    def _warmup(self, inputs) -> torch.Tensor:
        if self._side is None:
            self._side = torch.cuda.Stream(inputs[0].device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, inputs) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._inputs = [x.clone() for x in inputs]
        # The capture rebuilds the tables of tensors it allocates (gradients set to None
        # before the step), at the sizes of those the warm-up left in the cache.
        reserve_host_memory(2 * _cached_table_bytes() + 65536)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with _recording_host_reads() as self._host_reads, torch.cuda.graph(graph):
            output = self.fn(*self._inputs)
        return graph, output

    def _matches(self, inputs) -> bool:
        return all(
            x.shape == s.shape and x.dtype == s.dtype and x.device == s.device
            for x, s in zip(inputs, self._inputs, strict=True)
        )
