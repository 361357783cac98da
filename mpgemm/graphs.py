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
instead). A tensor ``lr`` on the GPU (``mpgemm.optim``'s optimizers take one, as torch's
do) is read by the kernels at each replay, so a schedule that changes it in place
between calls (torch's schedulers ``fill_`` it) reaches every replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["GraphedStep"]


class GraphedStep:
    """``fn(*inputs) -> tensor`` run eagerly for ``warmup_steps`` calls (compiling and
    autotuning the kernels, creating the optimizer's state), captured as a CUDA graph on
    the next call, and replayed from then on.

    Each captured call copies its inputs into the graph's static input buffers, replays,
    and returns a copy of the static output (earlier results stay valid). Inputs must be
    CUDA tensors; ``fn`` must not synchronise with the host (capture raises if it does).
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
        with torch.cuda.graph(graph):
            output = self.fn(*self._inputs)
        return graph, output

    def _matches(self, inputs) -> bool:
        return all(
            x.shape == s.shape and x.dtype == s.dtype and x.device == s.device
            for x, s in zip(inputs, self._inputs, strict=True)
        )
