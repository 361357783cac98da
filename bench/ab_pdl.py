"""Programmatic dependent launch (``mpgemm.kernels.dependent_launch``) against none, in
one process: the guide MLP's and the small MLP's graphed training steps
(``mpgemm_cuda_graph``), each captured once without PDL, once with it and once more
without (a control), then replayed in alternating rounds, wall clock per step. The
recipes start from the same weights and take the same steps on the same batch, so they
end with the same bits unless something races (the kernels add in fixed orders): the
control says whether a difference is PDL's.

    python3 bench/ab_pdl.py [OUT.json]   # on a GPU of compute capability 9.0 or more
    python3 bench/ab_pdl.py --smoke      # a small eager step, any machine (under the
                                         # interpreter PDL stays off: the rows say so)

Exit status 1 if the PDL recipe's weights differ from the first while the control's
match them.
"""

from __future__ import annotations

import sys
import time

import torch
from harness import DEVICE, ON_GPU, median, synchronize, write_rows

from mpgemm.app.train import Recipe, TrainConfig, build_mlp
from mpgemm.kernels import dependent_launch

# batch, hidden widths, steps a round
CASES = {"guide": (8192, (4096, 4096), 50), "small": (128, (128,), 200)}
SMOKE_CASES = {"small": (16, (32,), 1)}
IMPLS = (("no pdl", False), ("pdl", True), ("no pdl, control", False))
ROUNDS, SMOKE_ROUNDS = 5, 2
# GraphedStep's 3 eager warm-up steps, its capture, and a replay: all under the
# recipe's own setting (the smoke run's eager steps need none).
WARMUP_STEPS = {"mpgemm_cuda_graph": 5, "mpgemm": 0}


def _recipe(batch: int, hidden: tuple[int, ...], pdl: bool, mode: str):
    dependent_launch.enable(pdl)
    torch.manual_seed(0)
    config = TrainConfig(hidden=hidden, batch_size=batch, device=DEVICE.type)
    recipe = Recipe(mode, build_mlp(784, hidden, 10).to(DEVICE), config)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(batch, 784, device=DEVICE, generator=g)
    y = torch.randint(0, 10, (batch,), device=DEVICE, generator=g)
    for _ in range(WARMUP_STEPS[mode]):
        recipe.step(x, y)
    synchronize()
    return recipe, x, y, dependent_launch.enabled()


def _same_bits(a: Recipe, b: Recipe) -> bool:
    return (
        all(
            torch.equal(p, q)
            for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True)
        )
        and a.loss_scale() == b.loss_scale()
    )


def main(argv: list[str]) -> int:
    smoke = "--smoke" in argv
    paths = [a for a in argv if not a.startswith("--")]
    out = paths[0] if paths else None
    mode = "mpgemm_cuda_graph" if ON_GPU and not smoke else "mpgemm"
    rounds = SMOKE_ROUNDS if smoke else ROUNDS
    rows: list[dict] = []
    raced = False
    try:
        for case, (batch, hidden, steps) in (SMOKE_CASES if smoke else CASES).items():
            built = {name: _recipe(batch, hidden, pdl, mode) for name, pdl in IMPLS}
            times: dict[str, list[float]] = {name: [] for name in built}
            for round_ in range(rounds):
                for name, (recipe, x, y, active) in built.items():
                    synchronize()
                    start = time.perf_counter()
                    for _ in range(steps):
                        recipe.step(x, y)
                    synchronize()
                    us = (time.perf_counter() - start) / steps * 1e6
                    times[name].append(us)
                    rows.append(dict(case=case, impl=name, pdl=active, round=round_, us=us))
            first, dependent, control = (built[name][0] for name, _ in IMPLS)
            same, control_same = _same_bits(first, dependent), _same_bits(first, control)
            raced = raced or (control_same and not same)
            base = median(times["no pdl"])
            rows.append(
                dict(
                    case=case,
                    mode=mode,
                    **{f"{name} us": median(t) for name, t in times.items()},
                    pdl_speedup=base / median(times["pdl"]),
                    pdl_same_bits=same,
                    control_same_bits=control_same,
                )
            )
            del built
    finally:
        dependent_launch.enable(False)
    write_rows(rows, out, rounds=rounds, warmup_steps=WARMUP_STEPS[mode])
    return 1 if raced else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
