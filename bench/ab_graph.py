"""The graphed training steps (``mpgemm_cuda_graph``), then the eager ones (``mpgemm``),
as shipped against variants, in one process: the guide MLP's and the small MLP's
steps, each recipe built (graphed: captured) once per variant and once more as shipped
(a control), then run in alternating rounds, wall clock per step. The variants:

- ``grads zeroed in place``: the step as it was before the gradients were set to None
  under a graph too; each replay then zeroed every gradient and added the new one into
  it (two passes over the gradients more a step);
- ``pdl``: programmatic dependent launch (``mpgemm.kernels.dependent_launch``) on at the
  capture (run8, H200: the guide 0.98x, the small MLP 1.02x; it stays off);
- ``relu backward fused``: each ReLU's mask and bias sums in the next layer's
  input-gradient GEMM (``functional._FUSE_RELU``), as shipped until run13 (H200: the
  guide 1.10x the unfused step's time, the small MLP 0.97x). Its bias gradients are
  summed in another order, so its weights need not match the shipped recipe's bits;
- ``native launch``: the GEMMs' replays launched by their C++ plans
  (``mpgemm.kernels.native_launch``, off as shipped until a GPU has timed it): its
  eager rows are the host time it saves, and its weights must be the shipped bits.

The recipes start from the same weights and take the same steps on the same batch, so
they end with the same bits unless something races (the kernels add in fixed orders):
the control says whether a difference is the variant's.

    python3 bench/ab_graph.py [OUT.json]   # on a GPU of compute capability 9.0 or more
    python3 bench/ab_graph.py --smoke      # a small eager step, any machine (under the
                                           # interpreter PDL stays off: the rows say so)
    python3 bench/ab_graph.py --once [--smoke]   # each case's eager step once per variant,
                                                 # with the variant's settings on; nothing
                                                 # timed, checked or written
                                                 # (``compile_variants``)

Exit status 1 if a variant's weights differ from the shipped recipe's while the
control's match them.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from harness import DEVICE, ON_GPU, median, synchronize, write_rows

from mpgemm import functional
from mpgemm.app.train import Recipe, TrainConfig, build_mlp
from mpgemm.kernels import dependent_launch, native_launch

# batch, hidden widths, steps a round
CASES = {"guide": (8192, (4096, 4096), 50), "small": (128, (128,), 200)}
SMOKE_CASES = {"small": (16, (32,), 1)}
SHIPPED, CONTROL = "as shipped", "as shipped, control"
# name: (PDL on at the capture, gradients zeroed in place, ReLU's backward fused, the
# same bits as shipped expected, replays by C++ plans)
IMPLS = {
    SHIPPED: (False, False, False, True, False),
    "grads zeroed in place": (False, True, False, True, False),
    "pdl": (True, False, False, True, False),
    "relu backward fused": (False, False, True, False, False),
    "native launch": (False, False, False, True, True),
    CONTROL: (False, False, False, True, False),
}
ROUNDS, SMOKE_ROUNDS = 5, 2
# GraphedStep's 3 eager warm-up steps, its capture, and a replay: all under the
# recipe's own setting (the smoke run's eager steps need none).
WARMUP_STEPS = {"mpgemm_cuda_graph": 5, "mpgemm": 0}
MODES = ("mpgemm_cuda_graph", "mpgemm")


def _zeroed_in_place(optimizer) -> None:
    """Make ``optimizer.zero_grad`` zero the gradients in place whatever it is asked."""
    zero_grad = type(optimizer).zero_grad
    optimizer.zero_grad = lambda set_to_none=True: zero_grad(optimizer, set_to_none=False)


def _recipe(batch: int, hidden: tuple[int, ...], impl: str, mode: str):
    pdl, in_place, fused, _, native = IMPLS[impl]
    dependent_launch.enable(pdl)
    functional._FUSE_RELU = fused  # read by every backward: set again before each step
    native_launch._ENABLED = native  # read by every replay: the same
    torch.manual_seed(0)
    config = TrainConfig(hidden=hidden, batch_size=batch, device=DEVICE.type)
    recipe = Recipe(mode, build_mlp(784, hidden, 10).to(DEVICE), config)
    if in_place:
        _zeroed_in_place(recipe.optimizer)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(batch, 784, device=DEVICE, generator=g)
    y = torch.randint(0, 10, (batch,), device=DEVICE, generator=g)
    for _ in range(WARMUP_STEPS[mode]):
        recipe.step(x, y)
    synchronize()
    return recipe, x, y, dependent_launch.enabled()


@contextmanager
def _shipped_afterwards() -> Iterator[None]:
    """Within the block the variants set PDL, the ReLU fusion and the C++ launches
    (``_recipe``); after it, PDL is off and the others are as shipped."""
    fusion, native = functional._FUSE_RELU, native_launch._ENABLED
    try:
        yield
    finally:
        dependent_launch.enable(False)
        functional._FUSE_RELU = fusion
        native_launch._ENABLED = native


def compile_variants(cases: dict) -> None:
    """Each case's eager step once per variant, the variant's settings on while it
    steps (``_recipe`` sets them: PDL as at a graphed recipe's capture, the ReLU
    fusion): the kernels a GPU run of this script launches, the variants' among them.
    Run with every launch intercepted and compiled (``bench/warm_cache.py``), it
    compiles them ahead; its steps compute nothing to time or compare."""
    with _shipped_afterwards():
        for batch, hidden, _ in cases.values():
            for impl in IMPLS:
                recipe, x, y, _ = _recipe(batch, hidden, impl, "mpgemm")
                recipe.step(x, y)


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
    if "--once" in argv:
        compile_variants(SMOKE_CASES if smoke else CASES)
        return 0
    paths = [a for a in argv if not a.startswith("--")]
    out = paths[0] if paths else None
    # On a GPU the eager steps too: the ReLU fusion, slower graphed (run13), saves two
    # launches' host time where the eager step is bound by it.
    modes = MODES if ON_GPU and not smoke else ("mpgemm",)
    cases = SMOKE_CASES if smoke else CASES
    rounds = SMOKE_ROUNDS if smoke else ROUNDS
    rows: list[dict] = []
    raced = False
    with _shipped_afterwards():
        for mode, (case, (batch, hidden, steps)) in itertools.product(modes, cases.items()):
            built = {impl: _recipe(batch, hidden, impl, mode) for impl in IMPLS}
            dependent_launch.enable(False)
            times: dict[str, list[float]] = {impl: [] for impl in built}
            for round_ in range(rounds):
                for impl, (recipe, x, y, pdl) in built.items():
                    functional._FUSE_RELU = IMPLS[impl][2]
                    native_launch._ENABLED = IMPLS[impl][4]
                    synchronize()
                    start = time.perf_counter()
                    for _ in range(steps):
                        recipe.step(x, y)
                    synchronize()
                    us = (time.perf_counter() - start) / steps * 1e6
                    times[impl].append(us)
                    rows.append(dict(case=case, mode=mode, impl=impl, pdl=pdl, round=round_, us=us))
            shipped = built[SHIPPED][0]
            same = {impl: _same_bits(shipped, built[impl][0]) for impl in IMPLS if impl != SHIPPED}
            alike = [same[impl] for impl in same if IMPLS[impl][3]]
            raced = raced or (same[CONTROL] and not all(alike))
            base = median(times[SHIPPED])
            for impl in IMPLS:
                if impl != SHIPPED:
                    rows.append(
                        dict(
                            case=case,
                            mode=mode,
                            impl=impl,
                            us=median(times[impl]),
                            shipped_us=base,
                            shipped_speedup=median(times[impl]) / base,
                            same_bits=same[impl],
                        )
                    )
            del built
    write_rows(rows, out, rounds=rounds, warmup_steps={m: WARMUP_STEPS[m] for m in modes})
    return 1 if raced else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
