"""Train one MLP in several modes, from the same initial weights on the same data order:

- ``fp32``: plain FP32 training;
- ``autocast``: ``torch.autocast`` + ``torch.amp.GradScaler`` + the same optimizer;
- ``mpgemm``: ``mpgemm.convert`` (16-bit operands, FP32 weights, FP32 logits) +
  ``mpgemm.LossScaleOptimizer`` around mpgemm's fused optimizer;
- ``mpgemm_cuda_graph`` (CUDA only): the ``mpgemm`` step captured as a CUDA graph after
  3 eager steps and replayed (``mpgemm.graphs.GraphedStep``), the same arithmetic
  without the host's time per launch.

The mixed-precision modes compute in ``TrainConfig.compute_dtype``: FP16 (the default)
with loss scaling as above, or BF16, which has FP32's range and so, as torch's and
Keras's BF16 recipes do, no loss scaling (no GradScaler; mpgemm's optimizer unwrapped).

Each run reports test accuracy, the final training loss, milliseconds per step after a
warm-up (the modes take turns, a window of steps each, each window timed between two
device synchronisations, so that nothing is added inside the steps; the median over
windows), samples per second, peak GPU memory, skipped steps and the final loss scale.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

import mpgemm
from mpgemm.app.data import Dataset
from mpgemm.graphs import GraphedStep

__all__ = [
    "ACTIVATIONS",
    "COMPUTE_DTYPES",
    "MODES",
    "ModeResult",
    "Recipe",
    "TrainConfig",
    "build_mlp",
    "check_modes",
    "modes_on",
    "train",
]

MODES = ("fp32", "autocast", "mpgemm", "mpgemm_cuda_graph")
# The modes that train with mpgemm's layers and optimizer, and those that need CUDA.
_MPGEMM_MODES = ("mpgemm", "mpgemm_cuda_graph")
_CUDA_MODES = ("mpgemm_cuda_graph",)
OPTIMIZERS = ("adam", "sgd")
# The mixed-precision modes' dtypes, by name; only FP16's range needs loss scaling.
COMPUTE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# The hidden layers' activation modules, by name (each one ``convert`` fuses).
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_tanh": functools.partial(nn.GELU, approximate="tanh"),
    "silu": nn.SiLU,
}


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how. ``steps``, when given, replaces ``epochs``; the first
    ``warmup_steps`` steps (compilation, autotuning, allocator growth) are not timed."""

    hidden: tuple[int, ...] = (256, 256)
    batch_size: int = 64
    epochs: int = 20
    steps: int | None = None
    lr: float = 1e-3
    optimizer: str = "adam"
    seed: int = 0
    device: str = "cpu"
    warmup_steps: int = 10
    # The mixed-precision modes' 16-bit dtype: "float16" (loss scaled) or "bfloat16".
    compute_dtype: str = "float16"
    # The hidden layers' activation: a key of ACTIVATIONS.
    activation: str = "relu"

    def __post_init__(self) -> None:
        if not self.hidden or any(not isinstance(w, int) or w < 1 for w in self.hidden):
            raise ValueError(f"hidden widths must be positive integers, got {self.hidden}")
        for name in ("batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, "
                f"got {self.compute_dtype!r}"
            )
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")


def check_modes(modes: tuple[str, ...], device: str | torch.device) -> None:
    """ValueError naming any of ``modes`` that is unknown, or that ``device`` cannot
    train in (``modes_on``)."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    elsewhere = [m for m in modes if m not in modes_on(device)]
    if elsewhere:
        raise ValueError(f"mode {', '.join(elsewhere)} replays CUDA graphs: it needs --device cuda")


def modes_on(device: str | torch.device) -> tuple[str, ...]:
    """The modes that train on ``device`` (``--mode all``): every one on CUDA, those
    without a CUDA graph on the CPU."""
    cuda = torch.device(device).type == "cuda"
    return tuple(mode for mode in MODES if cuda or mode not in _CUDA_MODES)


@dataclass
class ModeResult:
    mode: str
    test_accuracy: float
    final_loss: float
    ms_per_step: float
    samples_per_s: float
    peak_memory_mb: float | None
    skipped_steps: int
    final_loss_scale: float | None
    steps: int
    losses: list[float] = field(repr=False)

    def as_dict(self) -> dict:
        return asdict(self)


def build_mlp(
    features: int,
    hidden: tuple[int, ...],
    classes: int,
    activation: Callable[[], nn.Module] = nn.ReLU,
) -> nn.Sequential:
    """Linear -> ``activation()`` (ReLU) for each hidden width, then a Linear head with
    ``classes`` logits."""
    layers, width = [], features
    for h in hidden:
        layers += [nn.Linear(width, h), activation()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, classes))


def _batches(data: Dataset, config: TrainConfig) -> list[torch.Tensor]:
    """Index batches, the same for every mode: a fresh permutation per epoch, the last
    batch of an epoch possibly short."""
    g = torch.Generator().manual_seed(config.seed)
    n = len(data.x_train)
    per_epoch = math.ceil(n / config.batch_size)
    total = config.steps or config.epochs * per_epoch
    batches: list[torch.Tensor] = []
    while len(batches) < total:
        batches += list(torch.randperm(n, generator=g).split(config.batch_size))
    return batches[:total]


def _optimizer(module, config: TrainConfig, params, **options):
    if config.optimizer == "adam":
        return module.Adam(params, lr=config.lr, **options)
    return module.SGD(params, lr=config.lr, momentum=0.9, **options)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Recipe:
    """One mode's model, optimizer and training step (``step(x, y)``), as ``mpgemm
    train`` and the step benchmarks run it. ``fused_torch_optimizer``: the torch
    optimizer of the fp32 and autocast modes with ``fused=True`` (else torch's default,
    foreach on a GPU)."""

    def __init__(
        self,
        mode: str,
        model: nn.Module,
        config: TrainConfig,
        *,
        fused_torch_optimizer: bool = False,
    ) -> None:
        self.mode, self.model = mode, model
        self.device = torch.device(config.device)
        self.scaler = None
        self.optimizer_steps = 0
        self._step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._eager_step
        self.uses_mpgemm = mode in _MPGEMM_MODES
        self.compute_dtype = COMPUTE_DTYPES[config.compute_dtype]
        # Loss scaling where the 16-bit dtype is FP16, whose gradients underflow.
        self.scales_loss = mode != "fp32" and self.compute_dtype == torch.float16
        if self.uses_mpgemm:
            mpgemm.convert(model, compute_dtype=self.compute_dtype)
            self.optimizer = _optimizer(mpgemm.optim, config, model.parameters())
            if self.scales_loss:
                self.optimizer = mpgemm.LossScaleOptimizer(self.optimizer)
            if mode == "mpgemm_cuda_graph":
                self._step = GraphedStep(self._eager_step)
            return
        options = {"fused": True} if fused_torch_optimizer else {}
        self.optimizer = _optimizer(torch.optim, config, model.parameters(), **options)
        if self.scales_loss:
            self.scaler = torch.amp.GradScaler(self.device.type)
            # torch's scaler skips by not calling step(): count the calls (on the host,
            # where the scaler has already read the flag).
            self.optimizer.register_step_post_hook(self._count_step)

    def _count_step(self, *args) -> None:
        self.optimizer_steps += 1

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output in FP32 (mpgemm's head writes FP32 already)."""
        if self.mode == "autocast":
            with torch.autocast(self.device.type, dtype=self.compute_dtype):
                return self.model(x).float()
        return self.model(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Logits, softmax and loss in FP32 (mpgemm's: one launch forward, one backward).
        cross_entropy = mpgemm.cross_entropy if self.uses_mpgemm else nn.functional.cross_entropy
        return cross_entropy(self.logits(x), y)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One training step on the batch (x, y); returns the loss."""
        return self._step(x, y)

    def _eager_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Set to None under a graph too, as torch's capture recipe does: the captured
        # backward then makes the gradients in the graph's pool, where every replay
        # writes them again, and the optimizer's tensor tables are built in the capture
        # (kept for its replays). Zeroed in place, each replay zeroed every gradient and
        # then added the new one into it: two passes over them more a step.
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(x, y)
        if self.uses_mpgemm and self.scales_loss:
            self.optimizer.backward(loss)  # scale_loss(loss).backward(), 3 launches fewer
            self.optimizer.step()
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        return loss.detach()

    def skipped_steps(self, steps: int) -> int:
        if isinstance(self.optimizer, mpgemm.LossScaleOptimizer):
            return self.optimizer.skipped_steps
        if self.scaler is not None:
            return steps - self.optimizer_steps
        return 0

    def loss_scale(self) -> float | None:
        if isinstance(self.optimizer, mpgemm.LossScaleOptimizer):
            return self.optimizer.loss_scale
        return self.scaler.get_scale() if self.scaler is not None else None


@torch.no_grad()
def _evaluate(recipe: Recipe, x: torch.Tensor, y: torch.Tensor, batch: int = 4096):
    """(mean loss, accuracy) over ``x``, in batches."""
    total_loss, correct = 0.0, 0
    for start in range(0, len(x), batch):
        xb, yb = x[start : start + batch], y[start : start + batch]
        logits = recipe.logits(xb).float()
        total_loss += nn.functional.cross_entropy(logits, yb, reduction="sum").item()
        correct += int((logits.argmax(dim=1) == yb).sum())
    return total_loss / len(x), correct / len(x)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class _Run:
    """One mode's model, recipe and measurements, stepped a window of batches at a time
    so that the modes can take turns (``train``)."""

    def __init__(
        self,
        mode: str,
        data: Dataset,
        config: TrainConfig,
        initial_state: dict,
        on_device: tuple[torch.Tensor, ...],
    ) -> None:
        self.device = torch.device(config.device)
        before = _allocated(self.device)
        model = build_mlp(
            data.features, config.hidden, data.num_classes, ACTIVATIONS[config.activation]
        )
        model.load_state_dict(initial_state)
        model.to(self.device)
        self.mode, self.config = mode, config
        self.recipe = Recipe(mode, model, config)
        # The data on the device, shared by the runs: x_train, y_train, x_test, y_test.
        self.x_train, self.y_train, self.x_test, self.y_test = on_device
        self.losses: list[torch.Tensor] = []
        self.ms_per_step: list[float] = []  # one per timed window
        self.samples_per_s: list[float] = []  # the same windows' (a batch may be short)
        # Memory this run holds (the others' is not its own), and its peak.
        self.held = _allocated(self.device) - before
        self.peak = self.held

    def run(self, window: list[torch.Tensor], timed: bool) -> None:
        """Train on ``window``'s batches, timed between two device synchronisations."""
        cuda = self.device.type == "cuda"
        _synchronize(self.device)
        before = _allocated(self.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        for index in window:
            index = index.to(self.device)
            self.losses.append(self.recipe.step(self.x_train[index], self.y_train[index]))
        _synchronize(self.device)
        if timed:
            seconds = time.perf_counter() - start
            self.ms_per_step.append(seconds * 1e3 / len(window))
            self.samples_per_s.append(sum(len(index) for index in window) / seconds)
        if cuda:  # the other runs are idle meanwhile: every change is this run's
            # The peak of the timed windows (steady training): the warm-up's include
            # Triton's autotuning, whose benchmarks allocate a 256 MB L2-flush buffer.
            if timed:
                self.peak = max(
                    self.peak, self.held + torch.cuda.max_memory_allocated(self.device) - before
                )
            self.held += _allocated(self.device) - before

    def result(self) -> ModeResult:
        recipe, steps = self.recipe, len(self.losses)
        ms_per_step = statistics.median(self.ms_per_step)
        final_loss, _ = _evaluate(recipe, self.x_train, self.y_train)
        _, accuracy = _evaluate(recipe, self.x_test, self.y_test)
        return ModeResult(
            mode=self.mode,
            test_accuracy=accuracy,
            final_loss=final_loss,
            ms_per_step=ms_per_step,
            samples_per_s=statistics.median(self.samples_per_s),
            peak_memory_mb=self.peak / 2**20 if self.device.type == "cuda" else None,
            skipped_steps=recipe.skipped_steps(steps),
            final_loss_scale=recipe.loss_scale(),
            steps=steps,
            losses=torch.stack(self.losses).float().cpu().tolist(),
        )


def _windows(steps: int, warmup: int) -> list[tuple[range, bool]]:
    """(steps, timed) windows: the warm-up, then about 10 timed windows of equal size."""
    warmup = min(warmup, steps - 1)
    size = max(1, (steps - warmup) // 10)
    windows = [(range(0, warmup), False)] if warmup > 0 else []
    windows += [(range(i, min(i + size, steps)), True) for i in range(warmup, steps, size)]
    return windows


def train(
    data: Dataset,
    config: TrainConfig,
    modes: tuple[str, ...] | None = None,
    *,
    progress: bool = True,
) -> list[ModeResult]:
    """Train once per mode (default: every one the device trains in, ``modes_on``) from
    the same initial weights on the same batches.

    The modes take turns, a window of steps each (the first in turn rotating), so that
    a change in the machine's load falls on all of them alike: a mode's time per step is
    the median over its timed windows. Peak GPU memory counts only what each mode holds
    (the others are idle during its windows)."""
    from tqdm.auto import tqdm

    if modes is None:
        modes = modes_on(config.device)
    check_modes(modes, config.device)
    torch.manual_seed(config.seed)
    initial = build_mlp(
        data.features, config.hidden, data.num_classes, ACTIVATIONS[config.activation]
    ).state_dict()
    batches = _batches(data, config)
    device = torch.device(config.device)
    on_device = tuple(t.to(device) for t in (data.x_train, data.y_train, data.x_test, data.y_test))
    runs = [_Run(mode, data, config, initial, on_device) for mode in modes]
    windows = _windows(len(batches), config.warmup_steps)
    # disable=None: tqdm draws no bar when stderr is not a terminal (a captured log).
    with tqdm(
        total=len(batches) * len(runs), disable=None if progress else True, leave=False, unit="step"
    ) as bar:
        for turn, (steps, timed) in enumerate(windows):
            for k in range(len(runs)):
                run = runs[(turn + k) % len(runs)]
                bar.set_description(f"{run.mode:>8}")
                run.run([batches[i] for i in steps], timed)
                bar.update(len(steps))
    return [run.result() for run in runs]
