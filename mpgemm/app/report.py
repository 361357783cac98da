"""The results of ``mpgemm train``: a table for the terminal, JSON, and a PNG figure."""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

from mpgemm.app.data import Dataset
from mpgemm.app.train import ModeResult, TrainConfig

__all__ = ["format_table", "write_figure", "write_json"]

_COLUMNS = [
    # header, format of one value
    ("mode", "{:>8}"),
    ("test acc %", "{:>10.2f}"),
    ("final loss", "{:>10.4f}"),
    ("ms/step", "{:>9.3f}"),
    ("samples/s", "{:>11.0f}"),
    ("peak MiB", "{:>9}"),
    ("skipped", "{:>7d}"),
    ("loss scale", "{:>10}"),
    ("x fp32", "{:>7}"),
]


def _row(result: ModeResult, fp32_ms: float | None) -> list:
    return [
        result.mode,
        100 * result.test_accuracy,
        result.final_loss,
        result.ms_per_step,
        result.samples_per_s,
        "-" if result.peak_memory_mb is None else f"{result.peak_memory_mb:.0f}",
        result.skipped_steps,
        "-" if result.final_loss_scale is None else f"{result.final_loss_scale:g}",
        "-" if fp32_ms is None else f"{fp32_ms / result.ms_per_step:.2f}",
    ]


def format_table(results: Sequence[ModeResult]) -> str:
    """One row per mode; ``x fp32`` is FP32's time per step over this mode's (above 1:
    faster than FP32; "-" where FP32 did not run). Peak memory is measured on a GPU
    only."""
    fp32_ms = next((r.ms_per_step for r in results if r.mode == "fp32"), None)
    rows = [
        [fmt.format(v) for (_, fmt), v in zip(_COLUMNS, _row(result, fp32_ms), strict=True)]
        for result in results
    ]
    # Each column as wide as its widest cell or header (a mode's name may be long).
    table = [[name for name, _ in _COLUMNS], *rows]
    widths = [max(map(len, column)) for column in zip(*table, strict=True)]
    return "\n".join(
        " ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in table
    )


def environment(device: str | torch.device) -> dict:
    """The device and the versions that a measurement depends on."""
    device = torch.device(device)
    info: dict[str, str | None] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def write_json(
    path: Path, results: Sequence[ModeResult], config: TrainConfig, data: Dataset
) -> None:
    payload = {
        "environment": environment(config.device),
        "config": {**config.__dict__, "hidden": list(config.hidden)},
        "data": {
            "name": data.name,
            "train": len(data.x_train),
            "test": len(data.x_test),
            "features": data.features,
            "classes": data.num_classes,
        },
        "results": [r.as_dict() for r in results],
    }
    path.write_text(json.dumps(payload, indent=2))


def _smoothed(losses: Sequence[float], window: int) -> torch.Tensor:
    values = torch.tensor(losses)
    return values.unfold(0, window, 1).mean(dim=1) if len(values) >= window else values


def write_figure(path: Path, results: Sequence[ModeResult], title: str) -> None:
    """Left: training loss per step of every mode (a moving average over 1/50 of the
    run, raw values faint behind it). Middle: each mode's smoothed loss minus FP32's,
    which the curves alone hide where they coincide (when FP32 was run). Right:
    milliseconds per step per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp32 = next((r for r in results if r.mode == "fp32"), None)
    panels = 3 if fp32 is not None and len(results) > 1 else 2
    fig, axes = plt.subplots(
        1,
        panels,
        figsize=(5.5 * panels, 4.4),
        gridspec_kw={"width_ratios": [2] * (panels - 1) + [1]},
    )
    curves, bars = axes[0], axes[-1]
    window = max(1, results[0].steps // 50)
    steps = range(window - 1, window - 1 + len(_smoothed(results[0].losses, window)))
    # Curves that agree lie on top of each other: styles keep each one visible.
    styles = [("-", 3.0), ("--", 2.0), (":", 2.0)]
    for i, result in enumerate(results):
        style, width = styles[i % len(styles)]
        (line,) = curves.plot(
            steps,
            _smoothed(result.losses, window),
            style,
            linewidth=width,
            label=result.mode,
            color=f"C{i}",
        )
        curves.plot(result.losses, color=line.get_color(), alpha=0.15, linewidth=0.8)
    curves.set(xlabel="step", ylabel="training loss (batch)", yscale="log", title="Loss curves")
    curves.legend()
    if fp32 is not None and panels == 3:
        difference = axes[1]
        reference = _smoothed(fp32.losses, window)
        for i, result in enumerate(results):
            if result is not fp32:
                difference.plot(
                    steps,
                    _smoothed(result.losses, window) - reference,
                    color=f"C{i}",
                    label=result.mode,
                )
        difference.axhline(0.0, color="0.5", linewidth=0.8)
        difference.set(
            xlabel="step", ylabel="smoothed loss minus FP32's", title="Difference from FP32"
        )
        difference.legend()
    names = [r.mode for r in results]
    times = [r.ms_per_step for r in results]
    drawn = bars.bar(names, times, color=[f"C{i}" for i in range(len(results))])
    bars.bar_label(drawn, fmt="%.3g")
    # Room above the tallest bar for its label, which the axes clipped.
    bars.set_ylim(0, max(times) * 1.15)
    bars.set(ylabel="ms per step (median over windows)", title="Time per step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
