"""mpgemm.graphs.GraphedStep and ``mpgemm train``'s ``mpgemm_cuda_graph`` mode: a step
captured once and replayed gives what the eager steps give, bit for bit (GPU), skipped
steps and scale updates included; what cannot be replayed is refused with a clear error
(any machine)."""

import pytest
import torch

from mpgemm.app.cli import main
from mpgemm.app.train import Recipe, TrainConfig, build_mlp
from mpgemm.graphs import GraphedStep


def test_inputs_must_be_cuda_tensors():
    step = GraphedStep(lambda x: x)
    with pytest.raises(ValueError, match="CUDA tensors"):
        step(torch.ones(3))
    with pytest.raises(ValueError, match="at least 1"):
        GraphedStep(lambda x: x, warmup_steps=0)


def test_the_cuda_graph_mode_needs_a_cuda_device(capsys):
    from mpgemm.app.data import load
    from mpgemm.app.train import MODES, modes_on, train

    # --mode all trains in every mode on CUDA, and leaves the graph out on the CPU.
    assert modes_on("cuda") == MODES and "mpgemm_cuda_graph" in MODES
    assert modes_on("cpu") == tuple(m for m in MODES if m != "mpgemm_cuda_graph")
    with pytest.raises(ValueError, match="mpgemm_cuda_graph replays CUDA graphs.*--device cuda"):
        train(load("digits"), TrainConfig(steps=2), ("mpgemm_cuda_graph",), progress=False)
    argv = ["train", "--device", "cpu", "--mode", "mpgemm_cuda_graph", "--steps", "2"]
    assert main(argv) == 2
    assert "--device cuda" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs")
def test_replayed_steps_match_eager_steps_bit_for_bit():
    # 784 -> 128 -> 10, batch 128; the 7th batch holds an inf, so one replay skips its
    # step and backs the scale off, on the device.
    def run(mode):
        torch.manual_seed(0)
        config = TrainConfig(hidden=(128,), batch_size=128, device="cuda")
        recipe = Recipe(mode, build_mlp(784, (128,), 10).cuda(), config)
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range(12):
            x = torch.randn(128, 784, generator=g)
            y = torch.randint(0, 10, (128,), generator=g)
            if step == 6:
                x[3, 5] = float("inf")
            losses.append(recipe.step(x.cuda(), y.cuda()))
        params = [p.detach().clone() for p in recipe.model.parameters()]
        return (torch.stack(losses), params, recipe.skipped_steps(12), recipe.loss_scale(), recipe)

    eager_losses, eager_params, eager_skipped, eager_scale, _ = run("mpgemm")
    losses, params, skipped, scale, recipe = run("mpgemm_cuda_graph")
    assert recipe._step.graph is not None  # captured at the 4th step, replayed after
    assert skipped == eager_skipped == 1 and scale == eager_scale
    assert torch.equal(losses.isnan(), eager_losses.isnan())
    assert torch.equal(losses.nan_to_num(), eager_losses.nan_to_num())
    for p, q in zip(params, eager_params, strict=True):
        assert torch.equal(p, q)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs")
def test_replays_read_a_tensor_lr_changed_between_them():
    """A tensor lr on the GPU, halved in place after each step (as an LR scheduler fills
    it), is read by every replay: the replayed steps equal the eager ones bit for bit."""
    import mpgemm

    def run(graphed):
        torch.manual_seed(0)
        model = mpgemm.convert(build_mlp(784, (128,), 10)).cuda()
        optimizer = mpgemm.LossScaleOptimizer(
            mpgemm.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device="cuda"))
        )

        def train_step(x, y):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.scale_loss(loss).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            return loss.detach()

        step = GraphedStep(train_step) if graphed else train_step
        g = torch.Generator().manual_seed(1)
        for _ in range(8):
            x = torch.randn(128, 784, generator=g).cuda()
            step(x, torch.randint(0, 10, (128,), generator=g).cuda())
            optimizer.param_groups[0]["lr"].mul_(0.5)
        return [p.detach().clone() for p in model.parameters()], step

    eager, _ = run(False)
    replayed, step = run(True)
    assert step.graph is not None  # captured at the 4th step, replayed after
    for p, q in zip(replayed, eager, strict=True):
        assert torch.equal(p, q)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs")
def test_eager_steps_beside_replays_keep_a_flag_of_their_own():
    """LossScaleOptimizer reuses one inf flag across eager steps (the scale update zeroes
    it), but a captured step takes its own: a replay that skips for an inf leaves no
    raised flag for the eager step after it, and the eager flag is still the one the
    warm-up made."""
    import mpgemm

    torch.manual_seed(0)
    model = mpgemm.convert(build_mlp(784, (128,), 10)).cuda()
    optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters()))

    def train_step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.detach()

    step = GraphedStep(train_step)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(128, 784, generator=g), torch.randint(0, 10, (128,))) for _ in range(8)]
    batches[5][0][3, 5] = float("inf")  # a replayed step (capture on the 4th call)
    for x, y in batches[:7]:
        step(x.cuda(), y.cuda())
    eager_flag = optimizer.scaler._flag
    assert step.graph is not None and optimizer.skipped_steps == 1
    before = [p.detach().clone() for p in model.parameters()]
    train_step(batches[7][0].cuda(), batches[7][1].cuda())  # eager, after the replays
    assert optimizer.skipped_steps == 1, "the eager step inherited the replay's flag"
    assert optimizer.scaler._flag is eager_flag and eager_flag.item() == 0.0
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
