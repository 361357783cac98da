"""A short demo: an MLP trained in FP32 and, from the same weights, with mpgemm.

    python -m mpgemm [--steps 200] [--device cpu|cuda]

The data is synthetic (labels from a random teacher network), so it runs offline. Both
models see the same batches; the table shows their losses side by side.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import mpgemm


def make_mlp(features: int, hidden: int, classes: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def teacher_batches(steps: int, batch: int, features: int, classes: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(features, classes, generator=generator)
    for _ in range(steps):
        x = torch.randn(batch, features, generator=generator)
        yield x, (x @ teacher).argmax(dim=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mpgemm", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    torch.manual_seed(args.seed)
    fp32_model = make_mlp(64, 256, 10).to(device)
    mp_model = mpgemm.convert(copy.deepcopy(fp32_model))  # hidden FP16, logits FP32
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (fp32_model, mp_model)]
    print(f"mpgemm demo on {device} (backend: {mpgemm.backend(device)})")
    print(f"{'step':>5}  {'fp32 loss':>10}  {'mpgemm loss':>11}")
    for step, (x, y) in enumerate(teacher_batches(args.steps, 256, 64, 10, args.seed), 1):
        x, y = x.to(device), y.to(device)
        losses = []
        for model, optimizer in zip((fp32_model, mp_model), optimizers, strict=True):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if step == 1 or step % 20 == 0 or step == args.steps:
            print(f"{step:>5}  {losses[0]:>10.4f}  {losses[1]:>11.4f}")
