"""Peak memory of one training step, per mode, counted on the CPU: the most bytes of
tensor storage alive at once, and which tensors they were.

A GPU's ``torch.cuda.max_memory_allocated`` (what ``mpgemm train`` reports) counts the
same storages plus the allocator's rounding and cuBLAS's workspaces. Here every
storage a step's ops make is followed from its allocation (a dispatch mode sees every
op's outputs) to its release (a weak reference); those alive before the step
(parameters, optimizer state, weight copies, the batch) count from the start. mpgemm's
launches are stubbed: its GEMMs allocate their outputs as on a GPU but compute
nothing. Autocast runs on the CPU with foreach Adam, torch's GPU default.

    python3 bench/step_memory.py [--batch B] [--features F] [--hidden H,H] [--top N]
                                 [--activation relu|gelu|gelu_tanh|silu]

The defaults are the guide MLP (batch 8192, 784 -> 4096 -> 4096 -> 10) with every
dimension divided by 8 (784 / 8 rounded to 96, a multiple of 8 as the TMA kernel
needs): tensors of a layer's activations and weights then hold 1/64 of the guide's.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mpgemm.app.train import ACTIVATIONS, Recipe, TrainConfig, build_mlp
from mpgemm.kernels.launches import intercept

MIB = 2**20
MODES = ("mpgemm", "autocast", "fp32")


class LiveStorages(TorchDispatchMode):
    """Tracks the storages alive while it is active and the most bytes they held at
    once (``peak``, with ``at_peak``: (bytes, op that made it, shape, dtype) of each)."""

    def __init__(self, held: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, tuple]] = {}
        for t in held:
            self._track(t, "before the step")
        self.peak = self._total()
        self.at_peak = self._snapshot()

    def _track(self, t: torch.Tensor, made_by: str) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in self.live:
            made = (made_by, tuple(t.shape), t.dtype)
            self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes(), made)

    def _total(self) -> int:
        for key in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        return sum(nbytes for _, nbytes, _ in self.live.values())

    def _snapshot(self) -> list[tuple]:
        return sorted(((n, *made) for _, n, made in self.live.values()), reverse=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t, str(func))
        total = self._total()
        if total > self.peak:
            self.peak, self.at_peak = total, self._snapshot()
        return out


def step_peak(
    mode: str, batch: int, features: int, hidden: tuple[int, ...], activation: str = "relu"
) -> LiveStorages:
    """The storages of one steady-state step of ``mode`` (after two warm-up steps)."""
    torch.manual_seed(0)
    net = build_mlp(features, hidden, 10, ACTIVATIONS[activation])
    recipe = Recipe(mode, net, TrainConfig(hidden=hidden, batch_size=batch, device="cpu"))
    if mode != "mpgemm":  # torch's GPU default; on the CPU its default is a loop
        recipe.optimizer = torch.optim.Adam(net.parameters(), lr=1e-3, foreach=True)
    x, y = torch.randn(batch, features), torch.randint(0, 10, (batch,))
    with intercept(lambda *launch: None):
        for _ in range(2):  # optimizer state and weight copies exist from here on
            recipe.step(x, y)
        gc.collect()
        held = [x, y, *net.parameters()]
        held += [v for state in recipe.optimizer.state.values() for v in state.values()]
        held += [
            m._weight_copy.tensor
            for m in net.modules()
            if getattr(m, "_weight_copy", None) is not None and m._weight_copy.tensor is not None
        ]
        with LiveStorages(t for t in held if isinstance(t, torch.Tensor)) as live:
            recipe.step(x, y)
    return live


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--features", type=int, default=96)
    parser.add_argument("--hidden", default="512,512")
    parser.add_argument("--top", type=int, default=8, help="tensors listed at each peak")
    parser.add_argument("--activation", choices=ACTIVATIONS, default="relu")
    args = parser.parse_args(argv)
    hidden = tuple(int(h) for h in args.hidden.split(","))
    print(
        f"MLP {args.features} -> {' -> '.join(map(str, hidden))} -> 10, batch {args.batch}, "
        f"{args.activation}"
    )
    peaks = {}
    for mode in MODES:
        live = step_peak(mode, args.batch, args.features, hidden, args.activation)
        peaks[mode] = live.peak / MIB
        print(f"{mode}: peak {peaks[mode]:.2f} MiB; alive then:")
        for nbytes, made_by, shape, dtype in live.at_peak[: args.top]:
            print(f"    {nbytes / MIB:8.2f} MiB  {made_by}  {shape} {dtype}")
    print(f"mpgemm / autocast: {peaks['mpgemm'] / peaks['autocast']:.3f}")
    return peaks


if __name__ == "__main__":
    main()
