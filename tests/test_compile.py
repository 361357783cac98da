"""torch.compile on a model of mpgemm.Linear layers: traced whole (fullgraph, no graph
break), with each GEMM one opaque custom op (torch.ops.mpgemm.gemm), so the rounding to
16 bits survives (without the op, inductor folded it away: 2.3e-4 off on this MLP)
and outputs and gradients equal eager's bit for bit, on the reference path and through
the kernels. The same for the optimizer side of a step: loss scaling and mpgemm's
fused optimizers are custom ops too (torch.ops.mpgemm.unscale_, ...), so a compiled
LossScaleOptimizer or GradScaler step traces whole, compiles once, and trains as
eager does."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import mpgemm
from mpgemm import compute_copy


def _model(device):
    # Every fused activation: ReLU, GELU, SiLU, tanh GELU, each in its layer's epilogue.
    torch.manual_seed(0)
    return mpgemm.convert(
        nn.Sequential(
            nn.Linear(64, 48),
            nn.ReLU(),
            nn.Linear(48, 48),
            nn.GELU(),
            nn.Linear(48, 48),
            nn.SiLU(),
            nn.Linear(48, 48),
            nn.GELU(approximate="tanh"),
            nn.Linear(48, 10),
        )
    ).to(device)


def _compare(device):
    """(compiled output, eager output, [(compiled grad, eager grad)]) of one step."""
    torch._dynamo.reset()
    eager, compiled = _model(device), _model(device)
    x = torch.randn(32, 64, device=device)
    outs = []
    for fn in (eager, torch.compile(compiled, fullgraph=True)):
        out = fn(x)  # fullgraph=True raises at any graph break
        out.float().square().mean().backward()
        outs.append(out)
    grads = [
        (q.grad, p.grad) for p, q in zip(eager.parameters(), compiled.parameters(), strict=True)
    ]
    return outs[1], outs[0], grads


def test_reference_path_compiles_whole_and_matches_eager_bit_for_bit(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU's reference path
    x = torch.randn(32, 64)
    explained = torch._dynamo.explain(_model("cpu"))(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    out, expected, grads = _compare(torch.device("cpu"))
    assert torch.equal(out, expected)
    assert all(torch.equal(got, want) for got, want in grads)


def test_kernels_compile_whole_and_match_eager_bit_for_bit(device):
    out, expected, grads = _compare(device)
    assert torch.equal(out, expected)
    assert all(torch.equal(got, want) for got, want in grads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_reduce_overhead_replays_match_eager_bit_for_bit():
    """mode="reduce-overhead" records the compiled forward and backward as CUDA graphs
    (the GEMM op's launches included) and replays them: each replay equals eager."""
    torch._dynamo.reset()
    eager, compiled = _model("cuda"), _model("cuda")
    forward = torch.compile(compiled, mode="reduce-overhead", fullgraph=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(5):  # warm-up, recording, replays
        torch.compiler.cudagraph_mark_step_begin()
        x = torch.randn(32, 64, device="cuda", generator=generator)
        outs = []
        for model, fn in ((eager, eager), (compiled, forward)):
            for p in model.parameters():
                p.grad = None
            out = fn(x)
            out.float().square().mean().backward()
            outs.append(out.clone())
        assert torch.equal(outs[1], outs[0])
        for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
            assert torch.equal(q.grad, p.grad)


# -- the optimizer side: loss scaling and the fused optimizers -------------------------

_OPTIMIZERS = {
    "adamw": lambda params: mpgemm.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "amsgrad": lambda params: mpgemm.optim.Adam(params, lr=1e-2, amsgrad=True),
    "sgd": lambda params: mpgemm.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True),
    "dampening": lambda params: mpgemm.optim.SGD(params, lr=1e-2, momentum=0.9, dampening=0.5),
}


def _train(device, step_fn, *, steps=6, inf_at=2, half=False, steady_from=None):
    """Train a small converted MLP for ``steps`` steps (a gradient made inf at step
    ``inf_at``, so one step is skipped) with forward and backward eager and the
    optimizer side run by ``step_fn(model)``, which returns (a per-step callable, a
    callable that reads the loss scale, the loss-scaling function). From step
    ``steady_from`` on, torch.compile must not recompile. Returns the parameters and
    the final scale."""
    torch.manual_seed(0)
    model = mpgemm.convert(nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10)))
    model = model.to(device)
    if half:
        model = model.half()
    step, scale, scale_loss = step_fn(model)
    generator = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(32, 64, generator=generator).to(device, next(model.parameters()).dtype)
        y = torch.randint(0, 10, (32,), generator=generator).to(device)
        loss = nn.functional.cross_entropy(model(x).float(), y)
        scale_loss(loss).backward()
        if i == inf_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        steady = steady_from is not None and i >= steady_from
        with torch.compiler.set_stance("fail_on_recompile" if steady else "default"):
            step()
        for p in model.parameters():
            p.grad = None
    return [p.detach().clone() for p in model.parameters()], scale()


def _loss_scale_optimizer(name, compiled, mode=None):
    def make(model):
        optimizer = mpgemm.LossScaleOptimizer(
            _OPTIMIZERS[name](model.parameters()), init_scale=2.0**10, growth_interval=2
        )
        step = optimizer.step
        if compiled:
            step = torch.compile(step, fullgraph=True, mode=mode)
        return step, lambda: optimizer.loss_scale, optimizer.scale_loss

    return make


def _grad_scaler(compiled, device):
    """GradScaler around mpgemm's Adam, with unscale_ and clipping in the step."""

    def make(model):
        optimizer = mpgemm.optim.Adam(model.parameters(), lr=1e-2)
        scaler = mpgemm.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)

        def step():
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()

        step = torch.compile(step, fullgraph=True) if compiled else step
        return step, scaler.get_scale, scaler.scale

    return make


def _assert_compiled_step_matches_eager(device, make, **kwargs):
    """fullgraph=True raises at any graph break; from the third step on (the first
    builds the optimizer state) a recompile raises too."""
    torch._dynamo.reset()
    expected, expected_scale = _train(device, make(False), **kwargs)
    got, scale = _train(device, make(True), steady_from=2, **kwargs)
    assert scale == expected_scale == 2.0**11  # from 2**10: grown twice, halved once
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("half", [False, True], ids=["fp32-params", "fp16-params"])
@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_compiled_loss_scale_optimizer_step_matches_eager_bit_for_bit(device, name, half):
    """FP16 parameters get FP32 masters; FP32 ones (mpgemm.Linear) are stepped with
    their 16-bit compute copies (eager: written by the kernel; compiled: recast)."""
    _assert_compiled_step_matches_eager(
        device, lambda compiled: _loss_scale_optimizer(name, compiled), half=half
    )


def test_compiled_optimizer_step_on_the_reference_path_matches_eager(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU's reference path
    _assert_compiled_step_matches_eager(
        torch.device("cpu"), lambda compiled: _loss_scale_optimizer("adamw", compiled)
    )


def test_compiled_grad_scaler_step_with_clipping_matches_eager(device):
    _assert_compiled_step_matches_eager(device, lambda compiled: _grad_scaler(compiled, device))


def _scheduled_tensor_hyperparameters(compiled, device, name):
    """AdamW with a tensor lr, betas, eps and weight decay (or SGD with a tensor lr and
    weight decay), its lr and weight decay halved in place after each step (outside the
    compiled function, as torch's LR schedulers ``fill_`` a tensor lr; a scheduler
    itself wraps ``optimizer.step`` in a function dynamo skips): read by the op each
    step, they need no recompile."""

    def make(model):
        def tensor(value):
            return torch.tensor(value, device=device)

        if name == "adamw":
            inner = mpgemm.optim.AdamW(
                model.parameters(),
                lr=tensor(1e-2),
                betas=(tensor(0.8), tensor(0.99)),
                eps=tensor(1e-3),
                weight_decay=tensor(0.1),
            )
        else:
            inner = mpgemm.optim.SGD(
                model.parameters(), lr=tensor(0.05), momentum=0.9, weight_decay=tensor(0.1)
            )
        optimizer = mpgemm.LossScaleOptimizer(inner, init_scale=2.0**10, growth_interval=2)
        optimizer_step = optimizer.step
        if compiled:
            optimizer_step = torch.compile(optimizer_step, fullgraph=True)

        def step():
            optimizer_step()
            optimizer.param_groups[0]["lr"].mul_(0.5)
            optimizer.param_groups[0]["weight_decay"].mul_(0.5)

        return step, lambda: optimizer.loss_scale, optimizer.scale_loss

    return make


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_compiled_step_reads_scheduled_tensor_hyperparameters_without_recompiling(device, name):
    _assert_compiled_step_matches_eager(
        device, lambda compiled: _scheduled_tensor_hyperparameters(compiled, device, name)
    )


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_compiled_step_over_param_groups_matches_eager_bit_for_bit(device, name):
    # Compiled, the ops take one value of each hyperparameter: a call per run (eagerly,
    # one launch for all the runs).
    runs = mpgemm.scaling.ParamGroups(({"lr": 0.1}, {"lr": 0.2, "weight_decay": 0.1}), (2, 1))
    hyper = dict(lr=0.01, weight_decay=0.0, maximize=False, grad_scale=None, found_inf=None)
    if name == "sgd":
        step, hyper = mpgemm.scaling.sgd_step_, hyper | dict(momentum=0.9, nesterov=False)
    else:
        step = mpgemm.scaling.adam_step_
        hyper |= dict(beta1=0.9, beta2=0.99, eps=1e-8, decoupled_weight_decay=False)

    def state():
        torch.manual_seed(0)
        params = [torch.randn(40, device=device) for _ in range(3)]
        lists = [params, [torch.randn_like(p) for p in params]]
        lists += [[torch.zeros_like(p) for p in params] for _ in range(1 if name == "sgd" else 2)]
        if name == "adam":
            lists.append([torch.zeros((), device=device) for _ in params])
        return lists

    eager, compiled = state(), state()
    step(*eager, groups=runs, **hyper)
    torch.compile(lambda: step(*compiled, groups=runs, **hyper), fullgraph=True)()
    for got, want in zip(compiled, eager, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


class _OwnStepSGD(torch.optim.SGD):
    """An optimizer with a step of its own (not torch's or mpgemm's), which may write
    weights without a version bump (as bitsandbytes' kernels do)."""

    def step(self, closure=None):
        return super().step(closure)


@pytest.mark.parametrize(
    ("make", "counted"),
    [
        (torch.optim.SGD, False),
        (mpgemm.optim.SGD, True),
        (mpgemm.optim.Adam, True),
        (_OwnStepSGD, True),
    ],
    ids=["torch", "mpgemm", "mpgemm adam", "own step"],
)
def test_compiled_optimizer_steps_are_counted_without_recompiling(make, counted):
    """mpgemm.compute_copy counts the optimizer steps that may write weights without a
    version bump (a 16-bit copy is stale after one) with a global step pre-hook: an
    optimizer's with a step of its own; mpgemm's compiled steps, in their ops, which
    write no copy; not torch's, whose ops bump what they write. Traced, the count
    became a guard, and every compiled step of any optimizer (torch's too)
    recompiled. (A step that calls torch's, as the own step does, is counted again where
    torch's hook wraps that one too, after a torch SGD was made.)"""
    torch._dynamo.reset()
    param = nn.Parameter(torch.zeros(8))
    optimizer = make([param], lr=0.5)
    step = torch.compile(optimizer.step)
    before = compute_copy._steps
    for i in range(4):
        param.grad = torch.ones(8)
        with torch.compiler.set_stance("fail_on_recompile" if i >= 2 else "default"):
            step()
    steps = compute_copy._steps - before
    assert steps >= 4 if counted else steps == 0
    # (Adam's steps are lr / (1 + eps) each, with a constant gradient.)
    torch.testing.assert_close(param.detach(), torch.full((8,), -2.0))


def test_eager_and_compiled_loss_scale_optimizer_steps_mix_without_recompiling():
    """Eager steps reuse the scaler's inf flag (zeroed by the scale update), compiled
    steps take their own: neither the flag nor whether it is zeroed may become a guard
    of the compiled step, and each step is taken (none skipped for a stale flag)."""
    torch._dynamo.reset()
    param = nn.Parameter(torch.zeros(8))
    optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.SGD([param], lr=0.5))
    step = torch.compile(optimizer.step)
    for i, compiled in enumerate([True, True, False, True, False, True]):
        optimizer.zero_grad()
        optimizer.backward(param.sum())  # every gradient 1
        if compiled:
            with torch.compiler.set_stance("fail_on_recompile" if i >= 2 else "default"):
                step()
        else:
            optimizer.step()
    assert optimizer.skipped_steps == 0
    assert torch.equal(param.detach(), torch.full((8,), -3.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_reduce_overhead_optimizer_step_matches_eager_bit_for_bit():
    _assert_compiled_step_matches_eager(
        torch.device("cuda"),
        lambda compiled: _loss_scale_optimizer("adamw", compiled, mode="reduce-overhead"),
    )


def test_importing_mpgemm_leaves_torch_compile_unimported():
    # torch._dynamo took 1.4 s to import, as long as torch itself: imported where
    # mpgemm marked its eager-only functions, it taxed every process that imports
    # mpgemm. It is imported by the first traced call (or by torch's own optimizers'
    # first step) instead.
    run = subprocess.run(
        [sys.executable, "-c", "import sys, mpgemm; print('torch._dynamo' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"
