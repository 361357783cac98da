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
instead). The param groups that mpgemm's optimizers and scalers step are checked before
each replay: a host value of theirs (a float ``lr``, ``betas``, ``weight_decay``...)
changed since the capture raises ``RuntimeError``, where the replay would keep the old
one. A tensor ``lr`` on the GPU (``mpgemm.optim``'s optimizers take one, as torch's do)
is read by the kernels at each replay, so a schedule that changes it in place between
calls (torch's schedulers ``fill_`` it) reaches every replay. What a capture read from
mpgemm's caches (the layers' 16-bit weight copies, the kernels' tables) stays allocated
for its replays, even where eager work between them remakes it (another optimizer's
step, then an eager forward, remakes the copies).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["GraphedStep"]

# While a GraphedStep captures (else None): the mappings that the step read on the host,
# so that a replay repeats what they held then: (whose, the live mapping, its values).
_HostRead = tuple[str, Mapping[str, Any], dict[str, Any]]
_host_reads: list[_HostRead] | None = None
_HOST_TYPES = (bool, int, float, str, type(None))


def _is_host_value(value: object) -> bool:
    """A number, flag or string (or a tuple of them, as Adam's betas): what a step reads
    on the host. Tensors are read on the device, by each replay."""
    if isinstance(value, tuple):
        return all(isinstance(v, _HOST_TYPES) for v in value)
    return isinstance(value, _HOST_TYPES)


def note_host_values(owner: str, *mappings: Mapping[str, Any]) -> None:
    """Say that the step now running reads ``mappings`` (param groups) on the host. While
    a ``GraphedStep`` captures, their host values (``_is_host_value``; a group's
    ``params`` aside) are remembered, for the replays to check; otherwise nothing.
    ``owner`` names them in the error: "param group" for optimizers' groups."""
    if _host_reads is None:
        return
    for index, mapping in enumerate(mappings):
        if any(seen is mapping for _, seen, _ in _host_reads):
            continue
        values = {k: v for k, v in mapping.items() if k != "params" and _is_host_value(v)}
        _host_reads.append((f"{owner} {index}", mapping, values))


@contextmanager
def _recording_host_reads() -> Iterator[list[_HostRead]]:
    """Within the block, ``note_host_values`` remembers into the list yielded."""
    global _host_reads
    reads: list[_HostRead] = []
    _host_reads = reads
    try:
        yield reads
    finally:
        _host_reads = None


def _changed_host_value(reads: list[_HostRead]) -> str | None:
    """What of ``reads`` (``_recording_host_reads``') differs now, in words; else None."""
    for owner, mapping, values in reads:
        for key, then in values.items():
            now = mapping.get(key)
            if type(now) is not type(then) or now != then:
                return f"{owner}'s {key} is {now!r}, but the step was captured with {then!r}"
    return None


class GraphedStep:
    """``fn(*inputs) -> tensor`` run eagerly for ``warmup_steps`` calls (compiling and
    autotuning the kernels, creating the optimizer's state), captured as a CUDA graph on
    the next call, and replayed from then on.

    Each captured call copies its inputs into the graph's static input buffers, replays,
    and returns a copy of the static output (earlier results stay valid). Inputs must be
    CUDA tensors; ``fn`` must not synchronise with the host (capture raises if it does).
    A replay first checks the host values of the param groups that the capture's
    optimizer steps read (``note_host_values``): one changed raises ``RuntimeError``.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], *, warmup_steps: int = 3) -> None:
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
        self._host_reads: list[_HostRead] = []

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
        changed = _changed_host_value(self._host_reads)
        if changed is not None:
            raise RuntimeError(
                f"GraphedStep: {changed}, which a replay would keep using (it runs no "
                "Python). Give it as a CUDA tensor changed in place (as LR schedulers fill_ "
                "a tensor lr), or make a new GraphedStep after changing it"
            )
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
