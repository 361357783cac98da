"""mpgemm.graphs.GraphedStep and ``mpgemm train``'s ``mpgemm_cuda_graph`` mode: a step
captured once and replayed gives what the eager steps give, bit for bit (GPU), skipped
steps and scale updates included; what cannot be replayed is refused with a clear error
(any machine)."""

import numpy as np
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
    with pytest.raises(TypeError, match="fn must be callable, got NoneType"):
        GraphedStep(None)  # (said at once, not at the first call on a GPU)


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


def _steps(mode, steps, inf_at=None, **config):
    """``steps`` steps of ``mode``'s recipe on a 784 -> 128 -> 10 MLP, batch 128, the
    same batches for every mode (an inf in batch ``inf_at``): (the losses, the
    parameters after them, the recipe)."""
    torch.manual_seed(0)
    config = TrainConfig(hidden=(128,), batch_size=128, device="cuda", **config)
    recipe = Recipe(mode, build_mlp(784, (128,), 10).cuda(), config)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(128, 784, generator=g)
        y = torch.randint(0, 10, (128,), generator=g)
        if step == inf_at:
            x[3, 5] = float("inf")
        losses.append(recipe.step(x.cuda(), y.cuda()))
    params = [p.detach().clone() for p in recipe.model.parameters()]
    return torch.stack(losses), params, recipe


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs")
def test_replayed_steps_match_eager_steps_bit_for_bit():
    # The 7th batch holds an inf, so one replay skips its step and backs the scale off,
    # on the device.
    def run(mode):
        losses, params, recipe = _steps(mode, 12, inf_at=6)
        return losses, params, recipe.skipped_steps(12), recipe.loss_scale(), recipe

    eager_losses, eager_params, eager_skipped, eager_scale, eager = run("mpgemm")
    losses, params, skipped, scale, recipe = run("mpgemm_cuda_graph")
    assert recipe._step.graph is not None  # captured at the 4th step, replayed after
    assert skipped == eager_skipped == 1 and scale == eager_scale
    assert torch.equal(losses.isnan(), eager_losses.isnan())
    assert torch.equal(losses.nan_to_num(), eager_losses.nan_to_num())
    for p, q in zip(params, eager_params, strict=True):
        assert torch.equal(p, q)
    # The gradients the replays leave are the eager step's, in the tensors the capture
    # made (set to None before it, as in eager steps), which every replay rewrites.
    grads = [p.grad for p in recipe.model.parameters()]
    for g, p in zip(grads, eager.model.parameters(), strict=True):
        assert torch.equal(g, p.grad)
    x, y = torch.randn(128, 784, device="cuda"), torch.randint(0, 10, (128,), device="cuda")
    recipe.step(x, y)
    for g, p in zip(grads, recipe.model.parameters(), strict=True):
        assert p.grad is g


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs")
def test_replayed_bfloat16_steps_match_eager_steps_bit_for_bit():
    # BF16 trains without loss scaling: the graph holds mpgemm's optimizer unwrapped.
    eager_losses, eager_params, _ = _steps("mpgemm", 8, compute_dtype="bfloat16")
    losses, params, _ = _steps("mpgemm_cuda_graph", 8, compute_dtype="bfloat16")
    assert torch.equal(losses, eager_losses)
    for p, q in zip(params, eager_params, strict=True):
        assert torch.equal(p, q)


def _train_step(model, optimizer):
    """A training step of ``model`` by ``optimizer`` (a LossScaleOptimizer), which keeps
    the gradients' memory (zeroed) from step to step."""

    def train_step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.scale_loss(loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.detach()

    return train_step


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

        train_step = _train_step(model, optimizer)
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


def test_steps_note_the_host_values_a_capture_would_bake_in():
    """While a capture records, mpgemm's optimizers and scalers note the param groups
    they read on the host: how many, each one's parameters (and whether they require
    grad), its numbers, flags and tuples of them (a float lr, betas; not a tensor lr,
    which replays read on the device, where a new tensor would not reach them), each
    optimizer once. A change of any afterwards is named. Outside a capture nothing is
    kept."""
    import mpgemm
    from mpgemm import graphs

    def stepped(make):
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.ones(4)
        return make([p])

    adam = stepped(lambda ps: mpgemm.optim.Adam(ps, lr=0.01))
    adam.step()
    assert graphs._host_reads is None
    with graphs._recording_host_reads() as reads:
        adam.step()
        adam.step()  # the same groups: noted once
    assert reads.changed() is None
    group = adam.param_groups[0]
    group["lr"] = 0.005  # a schedule's float lr
    assert reads.changed().startswith(
        "param group 0's lr is 0.005, but the step was captured with 0.01, which its replays "
        "keep using: give it as a CUDA tensor"
    )
    group["lr"] = 0.01
    group["betas"] = (0.8, 0.999)
    assert reads.changed().startswith("param group 0's betas is (0.8, 0.999)")
    group["betas"] = (0.9, 0.999)
    group["params"][0].requires_grad_(False)  # frozen
    assert reads.changed().startswith(
        "param group 0's parameters changed (added, removed or frozen) since the step was "
        "captured, whose replays step what they captured: make a new GraphedStep"
    )
    group["params"][0].requires_grad_(True)
    group["eps"] = np.float32(1e-8)  # a numpy scalar is a host value too
    with graphs._recording_host_reads() as numpy_reads:
        adam.step()
    group["eps"] = np.float32(1e-6)
    assert numpy_reads.changed().startswith("param group 0's eps is")
    group["eps"] = 1e-8
    adam.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert reads.changed().startswith("the number of param groups changed")

    tensor_lr = stepped(lambda ps: mpgemm.optim.SGD(ps, lr=torch.tensor(0.1)))
    with graphs._recording_host_reads() as reads:
        tensor_lr.step()
    tensor_lr.param_groups[0]["lr"].fill_(0.05)  # read on the device by each replay
    assert reads.changed() is None
    tensor_lr.param_groups[0]["lr"] = torch.tensor(0.05)  # another tensor: not the replays'
    assert reads.changed().startswith("param group 0's lr was replaced")
    # A CPU tensor is read on the host (whatever the parameters' device), and a tensor
    # weight decay (eps, momentum, dampening) whatever its device: a capture bakes its
    # value in, which is noted and compared.
    cpu_tensors = stepped(
        lambda ps: mpgemm.optim.Adam(ps, lr=torch.tensor(0.5), weight_decay=torch.tensor(0.5))
    )
    with graphs._recording_host_reads() as reads:
        cpu_tensors.step()
    group = cpu_tensors.param_groups[0]
    group["weight_decay"] = torch.tensor(0.5)  # another tensor of the same value
    assert reads.changed() is None
    group["weight_decay"].fill_(0.25)
    assert reads.changed() == (
        "param group 0's weight_decay is 0.25, but the step was captured with 0.5, which its "
        "replays keep using: make a new GraphedStep after changing it"
    )
    group["weight_decay"].fill_(0.5)
    group["lr"].fill_(0.25)  # read on the device: the parameters' own
    assert reads.changed() is None
    betas = (torch.tensor(0.5), torch.tensor(0.75))
    elsewhere = [{"params": [torch.empty(4, device="meta")], "lr": torch.tensor(0.5)}]
    elsewhere[0]["betas"] = betas
    with graphs._recording_host_reads() as reads:
        graphs.note_host_values(elsewhere)
    elsewhere[0]["lr"].fill_(0.25)  # a CPU tensor for parameters elsewhere: its value
    assert reads.changed().startswith(
        "param group 0's lr is 0.25, but the step was captured with 0.5, which its replays "
        "keep using: give it as a CUDA tensor changed in place"
    )
    elsewhere[0]["lr"].fill_(0.5)
    betas[1].fill_(0.875)
    assert reads.changed().startswith(
        "param group 0's betas is (0.5, 0.875), but the step was captured with (0.5, 0.75)"
    )
    # Lists as tuples (torch's optimizers index betas: a list serves), changed in place.
    for betas, then in [([0.5, 0.75], "[0.5, 0.75]"), ([torch.tensor(0.5), 0.75], "[0.5, 0.75]")]:
        group = {"params": [torch.empty(4, device="meta")], "betas": betas}
        with graphs._recording_host_reads() as reads:
            graphs.note_host_values([group])
        betas[1] = 0.875
        assert reads.changed().startswith(
            f"param group 0's betas is [0.5, 0.875], but the step was captured with {then}"
        )
    meta = torch.empty(4, device="meta")
    group = {
        "params": [meta],
        "betas": [torch.tensor(0.5, device="meta"), torch.tensor(0.75, device="meta")],
    }
    with graphs._recording_host_reads() as reads:
        graphs.note_host_values([group])
    group["betas"][1] = torch.tensor(0.75, device="meta")  # read on the device: another tensor
    assert reads.changed().startswith("param group 0's betas was replaced")

    # torch's optimizers, stepped by mpgemm's scalers.
    sgd = stepped(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    scaler = mpgemm.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with graphs._recording_host_reads() as reads:
        scaler.step(sgd)
    sgd.param_groups[0]["momentum"] = 0.8
    assert reads.changed() == (
        "param group 0's momentum is 0.8, but the step was captured with 0.9, which its "
        "replays keep using: make a new GraphedStep after changing it"
    )  # (no kernel reads a tensor momentum on the device)
    wrapped = stepped(lambda ps: mpgemm.LossScaleOptimizer(torch.optim.SGD(ps, lr=0.1)))
    wrapped.scale_loss(torch.ones(()))
    with graphs._recording_host_reads() as reads:
        wrapped.step()
    wrapped.optimizer.param_groups[0]["lr"] = 1.0
    assert "param group 0's lr is 1.0" in reads.changed()
    # A 16-bit parameter behind its FP32 master: the groups hold the master, which
    # freezing the model's parameter leaves requiring grad.
    half = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    half.grad = torch.ones(4, dtype=torch.float16)
    masters = mpgemm.LossScaleOptimizer(mpgemm.optim.SGD([half], lr=0.1))
    masters.scale_loss(torch.ones(()))
    with graphs._recording_host_reads() as reads:
        masters.step()
    assert reads.changed() is None
    half.requires_grad_(False)
    assert reads.changed().startswith(
        "LossScaleOptimizer's 16-bit parameters changed (added, removed or frozen) since the "
        "step was captured"
    )
    assert graphs._host_reads is None


def test_a_capture_refuses_a_cuda_tensor_it_would_read_on_the_host(monkeypatch):
    """A CUDA tensor weight decay, eps, momentum or dampening is read on the host at
    each step (as torch's fused optimizers read it), which a capture cannot wait for:
    refused with its name, before anything is read. (``capturing`` stands in for a
    capture here: only its device is asked.)"""
    import mpgemm
    from mpgemm import scaling

    monkeypatch.setattr(scaling, "capturing", lambda device: True)
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    for make, name in [
        (lambda v: mpgemm.optim.SGD([p], lr=0.1, weight_decay=v), "weight_decay"),
        (lambda v: mpgemm.optim.SGD([p], lr=0.1, momentum=v), "momentum"),
        (lambda v: mpgemm.optim.SGD([p], lr=0.1, momentum=0.9, dampening=v), "dampening"),
        (lambda v: mpgemm.optim.AdamW([p], eps=v), "eps"),
    ]:
        optimizer = make(torch.tensor(0.5))
        with pytest.raises(RuntimeError, match=f"a CUDA tensor {name} is read on the host"):
            optimizer.step()
        assert torch.equal(p, torch.ones(4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph")
def test_a_cuda_tensor_weight_decay_is_refused_at_the_capture():
    import mpgemm

    model = mpgemm.convert(build_mlp(784, (128,), 10)).cuda()
    optimizer = mpgemm.LossScaleOptimizer(
        mpgemm.optim.AdamW(model.parameters(), weight_decay=torch.tensor(0.1, device="cuda"))
    )
    step = GraphedStep(_train_step(model, optimizer))
    x, y = torch.randn(128, 784, device="cuda"), torch.randint(0, 10, (128,), device="cuda")
    with pytest.raises(RuntimeError, match="a CUDA tensor weight_decay is read on the host"):
        for _ in range(5):  # (captured at the 4th)
            step(x, y)


def test_tables_a_capture_used_outlive_the_cache(monkeypatch):
    """A table that a capture read stays allocated when the cache drops it, since every
    replay reads it again; one read outside a capture goes with its cache entry."""
    import gc
    import weakref

    from mpgemm import graphs
    from mpgemm.kernels import tensor_table

    cuda = torch.device("cuda", 0)  # only the key's device: nothing is allocated there
    monkeypatch.setattr(graphs, "_kept_for_replays", [])
    kept = {}
    for capturing in (True, False):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda c=capturing: c)
        table = tensor_table._cached((cuda, "test", capturing), lambda: torch.ones(3))
        kept[capturing] = weakref.ref(table)
        del table
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for i in range(tensor_table._CACHE_SIZE):  # drops both entries
        tensor_table._cached((cuda, "filler", i), lambda: torch.zeros(1))
    gc.collect()
    assert kept[True]() is not None and kept[False]() is None


def test_a_capture_stages_its_host_copies_in_memory_set_aside_before_it(monkeypatch):
    """During a capture, a table's host bytes go into the pinned memory reserved before
    it (a CPU tensor stands in for it here), 16-byte aligned, each region handed out
    once; None where none is reserved or it is used up (the table then pins its own)."""
    from mpgemm import graphs

    monkeypatch.setattr(graphs, "_reserve", None)
    monkeypatch.setattr(graphs, "_reserved_used", 0)
    a = torch.arange(3, dtype=torch.int64)
    assert graphs.staged_for_capture(a) is None
    reserve = torch.zeros(100, dtype=torch.uint8)
    monkeypatch.setattr(graphs, "_reserve", reserve)
    staged_a = graphs.staged_for_capture(a)
    b = torch.tensor([1.5, -2.5], dtype=torch.float64)
    staged_b = graphs.staged_for_capture(b)
    assert torch.equal(staged_a, a) and torch.equal(staged_b, b)
    assert staged_b.dtype == torch.float64
    base = reserve.data_ptr()
    assert [t.data_ptr() - base for t in (staged_a, staged_b)] == [0, 32]
    a.add_(7)  # a copy: the replays read what the capture saw
    assert staged_a.tolist() == [0, 1, 2]
    assert graphs.staged_for_capture(torch.zeros(9, dtype=torch.int64)) is None  # 48 + 72
    # Room enough left: the reserve stays (no new pinned block, whose allocation a
    # CPU-only torch could not make).
    graphs.reserve_host_memory(100 - 48)
    assert graphs._reserve is reserve and graphs._reserved_used == 48
    # Not enough left, though the block is large enough: a new one (unpinned here).
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    graphs.reserve_host_memory(100 - 47)
    assert graphs._reserve is not reserve and graphs._reserve.numel() == 53
    assert graphs._reserved_used == 0


def test_a_capture_reserves_twice_what_the_cached_tables_weigh(monkeypatch):
    """What GraphedStep reserves before its capture: the capture rebuilds the tables of
    the tensors it allocates, at the sizes of those its warm-up left in the cache."""
    from collections import OrderedDict

    from mpgemm import graphs
    from mpgemm.kernels import tensor_table

    monkeypatch.setattr(tensor_table, "_cache", OrderedDict())
    assert graphs._cached_table_bytes() == 0
    table, *_ = tensor_table.tensor_table([[torch.ones(5000), torch.ones(3)]])
    hyper = tensor_table.scalar_table([0.1, 0.9], torch.device("cpu"))
    assert graphs._cached_table_bytes() == 8 * (table.numel() + hyper.numel()) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs")
def test_a_capture_of_a_step_that_sets_gradients_to_none_pins_nothing(monkeypatch):
    """The graphed recipe sets gradients to None, so its capture builds the optimizer's
    tables anew: their host bytes come from the memory reserved before the capture, and
    torch's pinned allocator is not asked during it (some torch versions fail there)."""
    from mpgemm import graphs

    asked = []
    pin_memory = torch.Tensor.pin_memory

    def watched(self, *args, **kwargs):
        asked.append(torch.cuda.is_current_stream_capturing())
        return pin_memory(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", watched)
    monkeypatch.setattr(graphs, "_reserve", None)
    monkeypatch.setattr(graphs, "_reserved_used", 0)
    _, _, recipe = _steps("mpgemm_cuda_graph", 6)
    assert recipe._step.graph is not None
    assert asked and not any(asked)  # pinned in the warm-up only
    assert graphs._reserve.is_pinned() and graphs._reserved_used > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs")
def test_a_float_lr_changed_after_the_capture_is_refused():
    """A float lr changed in param_groups (as a scheduler does with a float) would not
    reach a replay: the next call raises, naming it, and runs nothing; back to its
    captured value, replays go on."""
    import mpgemm

    torch.manual_seed(0)
    model = mpgemm.convert(build_mlp(784, (128,), 10)).cuda()
    optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.SGD(model.parameters(), lr=0.1))

    train_step = _train_step(model, optimizer)
    step = GraphedStep(train_step)
    x, y = torch.randn(128, 784, device="cuda"), torch.randint(0, 10, (128,), device="cuda")
    for _ in range(5):
        step(x, y)
    assert step.graph is not None
    optimizer.param_groups[0]["lr"] = 0.05
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"param group 0's lr is 0.05, but .* 0.1"):
        step(x, y)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    optimizer.param_groups[0]["lr"] = 0.1
    step(x, y)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs")
def test_replays_keep_the_weight_copies_that_eager_work_remakes():
    """Between replays, another optimizer steps and the model runs eagerly (a GAN's
    other half, say): the layers remake their 16-bit weight copies, and the old ones'
    memory goes to new tensors (NaN here). The replays read and write the copies they
    captured, which are kept: they step as the eager steps do, bit for bit."""
    import mpgemm

    def run(graphed):
        torch.manual_seed(0)
        model = mpgemm.convert(build_mlp(784, (128,), 10)).cuda()
        optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters()))
        other = torch.nn.Parameter(torch.ones(1, device="cuda"))
        other_optimizer = torch.optim.SGD([other], lr=0.1)
        train_step = _train_step(model, optimizer)
        step = GraphedStep(train_step) if graphed else train_step
        g = torch.Generator().manual_seed(1)
        poisoned = []
        for _ in range(8):
            x = torch.randn(128, 784, generator=g).cuda()
            step(x, torch.randint(0, 10, (128,), generator=g).cuda())
            other.grad = torch.ones_like(other)
            other_optimizer.step()  # the copies are stale now
            with torch.no_grad():
                model(x)  # remade
            poisoned += [
                torch.full_like(layer.weight, float("nan"), dtype=torch.float16)
                for layer in model
                if isinstance(layer, mpgemm.Linear)
            ]
        return [p.detach().clone() for p in model.parameters()], step, optimizer

    eager, _, eager_optimizer = run(False)
    replayed, step, optimizer = run(True)
    assert step.graph is not None
    assert optimizer.skipped_steps == eager_optimizer.skipped_steps
    for p, q in zip(replayed, eager, strict=True):
        assert torch.equal(p, q)
