"""Host time of mpgemm's eager path on any machine, down to triton's JIT launch: CPU
tensors take the kernel path (as while launches are intercepted), and
``mpgemm.kernels.launches.launch`` runs with triton's ``JITFunction.run`` a no-op, each
autotuner choosing its first config, and the binaries it caches stand-ins whose
launcher does nothing. So everything of ours runs (the launch layer and
``triton_gemm``'s replays included), and nothing of triton's launch.

    python3 bench/host_time.py
    python3 bench/host_time.py --replays   # the GEMM cases, triton_gemm's replays off/on

Prints microseconds per call (the best of 7 rounds) for a 512^2 FP16 product, a batch
of them (attention's scores: q @ k.T, (8, 16) x 128x64 by 64x128), an
``mpgemm.Linear(512, 512, activation="relu")`` forward and backward at batch 256, the
small MLP's training step (784-128-10, batch 128, Adam), the guide MLP's
(784-4096-4096-10) at batch 64, ``mpgemm.scaling.unscale_``
over 200 gradients, and a ``LossScaleOptimizer(Adam)`` step (the inf check, the fused
step, the scale update) over 100 ``mpgemm.Linear(64, 64)`` layers: 100 weights with
16-bit copies and 100 biases; then the same parameters under ``AdamW`` in two param
groups, weights decayed and biases not. Then a tiny MLP's step (8-8-10, batch 4, so that the
CPU's arithmetic hardly counts) split into its phases (``phase_times``: medians of 300
steps), mpgemm's and FP32's (torch's Adam runs its for-loop implementation on a CPU,
foreach on a GPU). On a shared machine compare two trees by alternating runs and
reading each one's minimum: ``--against REV`` does, running this script on commit REV's
package and on this tree's by turns (``against``). ``--replays`` instead compares, in
one process, the GEMM cases with ``triton_gemm``'s replays off and on (``replays_ab``).

    python3 bench/host_time.py --against 2245e49 [--runs 3]"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from triton.runtime.autotuner import Autotuner
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import mpgemm
from mpgemm import functional
from mpgemm.app.train import Recipe, TrainConfig, build_mlp
from mpgemm.kernels import gemm, launches
from mpgemm.kernels.aot import _hopper_target
from mpgemm.scaling import unscale_

REPO = Path(__file__).resolve().parents[1]


def _kernel_path() -> bool:
    return True


def _first_config(self, *args, **kwargs):
    self.best_config = self.configs[0]
    return self.fn.run(*args, **kwargs, **self.best_config.all_kwargs())


class _NoBinary:
    """Stands in for a compiled kernel, which the launch layer launches itself once the
    JIT has: its launcher does nothing."""

    function = packed_metadata = None

    def run(self, *args) -> None:
        return None

    def launch_metadata(self, *args) -> None:
        return None


def _no_launch(self, *args, grid, warmup, **kwargs) -> _NoBinary:
    return _NoBinary()


# The kernels are JIT functions, or the interpreter's under TRITON_INTERPRET=1 (the
# tests): both launch through ``run``.
_STUBS = ((JITFunction, _no_launch), (InterpretedFunction, _no_launch), (Autotuner, _first_config))


@contextmanager
def triton_stubbed() -> Iterator[None]:
    """Within the block, mpgemm's launches run down to a no-op JIT launch, or a no-op
    launcher where the launch layer calls the binary's itself; real binaries are not
    used within. The configs chosen meanwhile (the first of each autotuner's) and the
    stand-in binaries are forgotten afterwards: later launches of a kind first met here
    still go through the autotuner and the JIT."""
    saved = [(cls, cls.run) for cls, _ in _STUBS]
    kernel_path = functional._intercepting
    chosen = dict(launches._chosen)
    # The real binaries stay out of the block: their launchers would run.
    binaries, launches._binaries = launches._binaries, {}
    for cls, stub in _STUBS:
        cls.run = stub
    try:
        # CPU tensors take the kernel path, as while launches are intercepted; but
        # nothing intercepts, so that launches (and ``triton_gemm``'s replays of them)
        # run as on a GPU. The launch layer asks triton's driver for the device and
        # stream, as the JIT does: the compile check's stand-in answers on a machine
        # without a GPU.
        functional._intercepting = _kernel_path
        with _hopper_target():
            yield
    finally:
        functional._intercepting = kernel_path
        for cls, run in saved:
            cls.run = run
        launches._chosen.clear()
        launches._chosen.update(chosen)
        launches._binaries = binaries


# A step's phases, each timed by wrapping what the step calls for it (the step itself
# runs unchanged): the optimizer's ``zero_grad``, the forward and loss, ``backward``,
# and the optimizer step (autocast's: ``scaler.step`` and ``scaler.update``).
PHASES = ("zero_grad", "forward + loss", "backward", "optimizer step")
# What ``phase_times`` returns, in the order its tables print it.
PHASE_COLUMNS = (*PHASES, "rest", "step")


def phase_times(recipe: Recipe, x: torch.Tensor, y: torch.Tensor, steps: int = 50) -> dict:
    """Host microseconds of each phase of ``recipe.step(x, y)``, and of the whole step
    (``"step"``) and what lies outside the phases (``"rest"``: the loss scaling's
    multiply, the returned loss), medians over ``steps`` steps after 10 of warm-up. No
    synchronisation inside the steps: on a GPU each time is the host's enqueue, which
    the GPU's work overlaps."""
    spent = dict.fromkeys(PHASES, 0.0)

    def timed(phase: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - start

        return run

    stepper = recipe.scaler if recipe.scaler is not None else recipe.optimizer
    wrapped = [
        (recipe.optimizer, "zero_grad", "zero_grad"),
        (recipe, "loss", "forward + loss"),
        (stepper, "step", "optimizer step"),
    ]
    if recipe.scaler is not None:
        wrapped.append((recipe.scaler, "update", "optimizer step"))
    for owner, name, phase in wrapped:
        setattr(owner, name, timed(phase, getattr(owner, name)))
    backward = torch.Tensor.backward
    torch.Tensor.backward = timed("backward", backward)
    rows: dict[str, list[float]] = {name: [] for name in PHASE_COLUMNS}
    try:
        for call in range(10 + steps):
            for phase in PHASES:
                spent[phase] = 0.0
            start = time.perf_counter()
            recipe.step(x, y)
            total = time.perf_counter() - start
            if call >= 10:
                for phase in PHASES:
                    rows[phase].append(spent[phase] * 1e6)
                rows["step"].append(total * 1e6)
                rows["rest"].append((total - sum(spent.values())) * 1e6)
    finally:
        torch.Tensor.backward = backward
        for owner, name, _ in wrapped:
            delattr(owner, name)
    return {name: sorted(values)[len(values) // 2] for name, values in rows.items()}


def best_us(fn: Callable[[], object], calls: int, rounds: int = 7) -> float:
    for _ in range(max(calls // 10, 3)):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


@contextmanager
def replays_off() -> Iterator[None]:
    """Within the block, ``triton_gemm`` decides and keys every launch anew: its
    replays' guard (``current``) answers no, and ``mpgemm.matmul`` takes its full path
    (``entry_replays_off``)."""
    replayable, gemm.current = gemm.current, lambda launched: False
    try:
        with entry_replays_off():
            yield
    finally:
        gemm.current = replayable


@contextmanager
def entry_replays_off() -> Iterator[None]:
    """Within the block, ``mpgemm.matmul`` takes its full path at every call, its checks
    and layers down to ``triton_gemm`` (which may replay): no replay from its entry
    (``functional._replay_key`` answers None)."""
    key, functional._replay_key = functional._replay_key, lambda *args: None
    try:
        yield
    finally:
        functional._replay_key = key


def full_path(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` called with ``mpgemm.matmul``'s replays from its entry off
    (``entry_replays_off``): its checks and layers down to ``triton_gemm``'s replay."""

    def call() -> None:
        with entry_replays_off():
            fn()

    return call


def replays_ab(cases: dict, rounds: int = 4) -> None:
    """Print each case's host time with ``triton_gemm``'s replays off (``replays_off``)
    and on, alternating ``rounds`` times in this process (best of 5 each), and the
    minima's ratio. Within ``triton_stubbed``."""
    times: dict[str, dict[str, list[float]]] = {name: {"off": [], "on": []} for name in cases}
    for _ in range(rounds):
        for mode in ("off", "on"):
            with replays_off() if mode == "off" else nullcontext():
                for name, (fn, calls) in cases.items():
                    times[name][mode].append(best_us(fn, calls, rounds=5))
    print("| host us | replays off | on | ratio |\n| --- | --- | --- | --- |")
    for name, measured in times.items():
        off, on = min(measured["off"]), min(measured["on"])
        print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f}x |", flush=True)


def package_at(rev: str, into: Path) -> Path:
    """Commit ``rev``'s package, laid out for import from the returned folder (its
    ``mpgemm/``, with ``kernels/`` as ``mpgemm/kernels``, as the install maps them):
    put first on ``PYTHONPATH``, it shadows the installed tree."""
    archive = subprocess.run(
        ["git", "archive", rev, "mpgemm", "kernels"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into / "src", filter="data")
    package = into / "package"
    shutil.copytree(into / "src" / "mpgemm", package / "mpgemm")
    shutil.copytree(into / "src" / "kernels", package / "mpgemm" / "kernels")
    return package


# A case's line (``name: 24.1 us``), and a phase table's (``tiny MLP step by phase,
# mpgemm (us): zero_grad 21, forward + loss 237, ...``).
_CASE = re.compile(r"^(?P<name>[^:]+): (?P<us>[0-9.]+) us$")
_PHASES = re.compile(r"^tiny MLP step by phase, (?P<mode>\w+) \(us\): (?P<row>.*)$")


def parse_times(output: str) -> dict[str, float]:
    """Microseconds by case from this script's output; a phase of the tiny MLP's step
    as ``tiny MLP step, MODE: PHASE``."""
    times = {}
    for line in output.splitlines():
        if case := _CASE.match(line):
            times[case["name"]] = float(case["us"])
        elif phases := _PHASES.match(line):
            for entry in phases["row"].split(", "):
                phase, _, us = entry.rpartition(" ")
                times[f"tiny MLP step, {phases['mode']}: {phase}"] = float(us)
    return times


def against(rev: str, runs: int) -> None:
    """Print each case's host time on commit ``rev``'s package and on this tree's, the
    minimum over ``runs`` runs of this script each, the two taking turns (a change in
    the machine's load falls on both), and the ratio. This script's cases and stubs
    are the same for both: they reach into the launch layer, so a commit much older
    than this script may not run under them."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    times: dict[str, dict[str, list[float]]] = defaultdict(lambda: {rev: [], "this tree": []})
    with tempfile.TemporaryDirectory() as folder:
        trees = {rev: {"PYTHONPATH": str(package_at(rev, Path(folder)))}, "this tree": {}}
        for _ in range(runs):
            for tree, extra in trees.items():
                run = subprocess.run(
                    [sys.executable, __file__],
                    env={**env, **extra},
                    cwd=folder,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                for name, us in parse_times(run.stdout).items():
                    times[name][tree].append(us)
    print(f"| host us, best of {runs} runs | {rev} | this tree | ratio |")
    print("| --- | --- | --- | --- |")
    for name, measured in times.items():
        if measured[rev] and measured["this tree"]:
            old, new = min(measured[rev]), min(measured["this tree"])
            print(f"| {name} | {old:.1f} | {new:.1f} | {new / old:.2f}x |", flush=True)


def main() -> None:
    if "--against" in sys.argv:
        rev = sys.argv[sys.argv.index("--against") + 1]
        runs = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 3
        against(rev, runs)
        return
    torch.manual_seed(0)
    a, b = (torch.randn(512, 512, dtype=torch.float16) for _ in range(2))
    layer = mpgemm.Linear(512, 512, activation="relu")
    x = torch.randn(256, 512)
    config = TrainConfig(hidden=(128,), batch_size=128)
    recipe = Recipe("mpgemm", build_mlp(784, (128,), 10), config)
    xs, ys = torch.randn(128, 784), torch.randint(0, 10, (128,))
    grads = [torch.randn(5000) for _ in range(200)]
    found, inv_scale = torch.zeros(()), torch.ones(())
    layers = torch.nn.Sequential(*(mpgemm.Linear(64, 64) for _ in range(100)))
    optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(layers.parameters()))
    # The same parameters in a recipe's two groups: weights decayed, biases not.
    decay = [{"params": [p for p in layers.parameters() if p.dim() == dim]} for dim in (2, 1)]
    decay[0]["weight_decay"] = 0.01
    grouped = mpgemm.LossScaleOptimizer(mpgemm.optim.AdamW(decay, weight_decay=0.0))
    # The guide's MLP at batch 64: its launches, little of the CPU's arithmetic.
    guide = Recipe("mpgemm", build_mlp(784, (4096, 4096), 10), TrainConfig(hidden=(4096, 4096)))
    xg, yg = torch.randn(64, 784), torch.randint(0, 10, (64,))
    # Attention's scores, q @ k.T over (batch, heads): a batch of products.
    q, k = (torch.randn(8, 16, 128, 64, dtype=torch.float16) for _ in range(2))
    gemms = {
        "matmul 512^2 fp16": (lambda: mpgemm.matmul(a, b), 3000),
        "batched matmul (8, 16) x 128x64x128 fp16": (
            lambda: mpgemm.matmul(q, k.transpose(-1, -2)),
            2000,
        ),
        "Linear relu forward+backward": (lambda: layer(x).sum().backward(), 1000),
        "small MLP step": (lambda: recipe.step(xs, ys), 200),
        "guide MLP step, batch 64": (lambda: guide.step(xg, yg), 30),
    }
    cases = {
        **gemms,
        "unscale_ 200 tensors": (lambda: unscale_(grads, found, inv_scale), 500),
        "LossScaleOptimizer(Adam) step, 100 layers": (optimizer.step, 100),
        "LossScaleOptimizer(AdamW) step, 100 layers, 2 param groups": (grouped.step, 100),
    }
    # An MLP too small for the CPU's arithmetic to count, for the phases.
    tiny = TrainConfig(hidden=(8,), batch_size=4)
    tiny_batch = torch.randn(4, 8), torch.randint(0, 10, (4,))
    if "--replays" in sys.argv:
        with triton_stubbed():
            replays_ab(gemms)
        return
    with triton_stubbed():
        # The layers' gradients and 16-bit weight copies, which every step then reads.
        optimizer.scale_loss(layers(torch.randn(8, 64)).float().sum()).backward()
        grouped.scale_loss(torch.ones(()))  # (its scale, made at its first scaled loss)
        for name, (fn, calls) in cases.items():
            print(f"{name}: {best_us(fn, calls):.1f} us", flush=True)
        for mode in ("mpgemm", "fp32"):
            times = phase_times(Recipe(mode, build_mlp(8, (8,), 10), tiny), *tiny_batch, 300)
            row = ", ".join(f"{name} {times[name]:.0f}" for name in PHASE_COLUMNS)
            print(f"tiny MLP step by phase, {mode} (us): {row}", flush=True)


if __name__ == "__main__":
    main()
