"""bench/host_time.py's ``phase_times`` (also profile_gpu.py's ``phases``): a step's host
time split into its phases by wrapping what the step calls, the step itself run
unchanged and left as it was."""

import pytest
import torch

from mpgemm.app.train import Recipe, TrainConfig, build_mlp
from tests.bench_scripts import load

pytest.importorskip("triton")
host_time = load("host_time")


@pytest.mark.parametrize("mode", ["fp32", "autocast", "mpgemm"])
def test_phase_times_split_a_step_and_leave_it_as_it_was(mode):
    torch.manual_seed(0)
    recipe = Recipe(mode, build_mlp(12, (16,), 10), TrainConfig(hidden=(16,), batch_size=8))
    x, y = torch.randn(8, 12), torch.randint(0, 10, (8,))
    before = [p.detach().clone() for p in recipe.model.parameters()]
    backward = torch.Tensor.backward

    times = host_time.phase_times(recipe, x, y, steps=3)

    assert set(times) == {*host_time.PHASES, "step", "rest"} == set(host_time.PHASE_COLUMNS)
    assert all(0 < times[phase] < times["step"] for phase in host_time.PHASES)
    # The steps ran (13 of them) and every wrapper is gone.
    after = list(recipe.model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(after, before, strict=True))
    assert torch.Tensor.backward is backward
    assert "loss" not in vars(recipe)
    assert not {"zero_grad", "step"} & set(vars(recipe.optimizer))
    if recipe.scaler is not None:
        assert not {"step", "update"} & set(vars(recipe.scaler))
