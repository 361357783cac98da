"""mpgemm.LossScaleOptimizer against torch.amp.GradScaler + the same optimizer, side by
side; FP32 master weights for FP16 models; clipping, schedulers, checkpoints."""

import copy
import threading

import pytest
import torch

import mpgemm
from tests.accuracy import assert_same_bits

# step -> (parameter index, flat index, value) injected into the scaled gradients
INJECTIONS = {
    2: (0, 3, float("inf")),
    3: (3, 1, float("nan")),
    77: (2, 40, -float("inf")),
    150: (1, 0, float("nan")),
}


def _mlp(device, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(
        device, dtype
    )


def _batches(steps, device, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(64, 16, generator=g).to(device, dtype)
        y = torch.randint(0, 4, (64,), generator=g).to(device)
        yield step, x, y


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def _inject(params, step):
    if step in INJECTIONS:
        index, flat, value = INJECTIONS[step]
        params[index].grad.view(-1)[flat] = value


def _run_wrapper(model, optimizer, steps, device, *, dtype=torch.float32, clip=None):
    scales, params = [], list(model.parameters())
    for step, x, y in _batches(steps, device, dtype):
        optimizer.zero_grad()
        optimizer.scale_loss(_loss(model, x, y)).backward()
        _inject(params, step)
        if clip is not None:
            optimizer.unscale_()
            torch.nn.utils.clip_grad_norm_(optimizer.master_params(), clip)
        optimizer.step()
        scales.append(optimizer.loss_scale)
    return scales


def _run_torch(model, optimizer, scaler, steps, device, *, clip=None, masters=None):
    """torch's recipe. With ``masters`` (FP32 copies of an FP16 model's parameters), the
    FP16 gradients are copied to the masters first and the masters copied back after."""
    scales, params = [], list(model.parameters())
    for step, x, y in _batches(steps, device, params[0].dtype):
        optimizer.zero_grad()
        model.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        _inject(params, step)
        if masters is not None:
            for m, p in zip(masters, params, strict=True):
                m.grad = p.grad.float()
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(masters or params, clip)
        scaler.step(optimizer)
        scaler.update()
        if masters is not None:
            with torch.no_grad():
                for m, p in zip(masters, params, strict=True):
                    p.copy_(m)
        scales.append(scaler.get_scale())
    return scales


SCALER_ARGS = dict(init_scale=2.0**20, growth_interval=6)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        lambda p: torch.optim.Adam(p, lr=1e-3),
    ],
    ids=["sgd", "adam"],
)
def test_wrapping_a_torch_optimizer_is_bit_identical_to_torchs_recipe(device, make):
    ours, theirs = _mlp(device), _mlp(device)
    wrapped = mpgemm.LossScaleOptimizer(make(ours.parameters()), **SCALER_ARGS)
    our_scales = _run_wrapper(ours, wrapped, 200, device)
    torch_scales = _run_torch(
        theirs,
        make(theirs.parameters()),
        torch.amp.GradScaler(device.type, **SCALER_ARGS),
        200,
        device,
    )
    assert our_scales == torch_scales
    assert wrapped.skipped_steps == len(INJECTIONS)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.isfinite(p).all()
        assert_same_bits(p.detach(), q.detach(), "param")


# Along both paths (path_device): on the reference path, a CPU user's step, checked,
# skipped and rescaled by torch ops of mpgemm's own.
def test_with_mpgemm_adamw_scales_and_skips_match_and_params_track(path_device):
    device = path_device
    ours, theirs = _mlp(device), _mlp(device)
    wrapped = mpgemm.LossScaleOptimizer(
        mpgemm.optim.AdamW(ours.parameters(), lr=1e-3), **SCALER_ARGS
    )
    our_scales = _run_wrapper(ours, wrapped, 200, device)
    torch_scales = _run_torch(
        theirs,
        torch.optim.AdamW(theirs.parameters(), lr=1e-3),
        torch.amp.GradScaler(device.type, **SCALER_ARGS),
        200,
        device,
    )
    assert our_scales == torch_scales
    assert wrapped.skipped_steps == len(INJECTIONS)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["", "unscale_ and clip"])
def test_fp16_model_steps_fp32_masters_like_torch_with_hand_made_masters(path_device, clip):
    # With clip: unscale_ into the masters, clip them, then step (which must not
    # unscale again), as torch's documented order on masters by hand.
    device = path_device
    ours, theirs = _mlp(device, torch.float16), _mlp(device, torch.float16)
    wrapped = mpgemm.LossScaleOptimizer(torch.optim.Adam(ours.parameters(), lr=1e-3), **SCALER_ARGS)
    masters = [p.detach().float().requires_grad_() for p in theirs.parameters()]
    our_scales = _run_wrapper(ours, wrapped, 120, device, dtype=torch.float16, clip=clip)
    torch_scales = _run_torch(
        theirs,
        torch.optim.Adam(masters, lr=1e-3),
        torch.amp.GradScaler(device.type, **SCALER_ARGS),
        120,
        device,
        masters=masters,
        clip=clip,
    )
    assert our_scales == torch_scales
    # FP16 overflows at these scales: natural skips on top of the injected ones.
    assert wrapped.skipped_steps > len(INJECTIONS)
    for p, q, master, m in zip(
        ours.parameters(), theirs.parameters(), wrapped.master_params(), masters, strict=True
    ):
        assert p.dtype == torch.float16 and master.dtype == torch.float32
        assert_same_bits(master.detach(), m.detach(), "master")
        assert_same_bits(p.detach(), q.detach(), "fp16 param")
        assert_same_bits(p.detach(), master.detach().half(), "param = round(master)")


def test_updates_below_fp16_resolution_accumulate_in_the_masters(device):
    model = torch.nn.Linear(4, 1, bias=False).to(device).half()
    torch.nn.init.constant_(model.weight, 1.0)
    wrapped = mpgemm.LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-4), init_scale=1024.0
    )
    for _ in range(20):
        wrapped.zero_grad()
        wrapped.scale_loss(model(torch.ones(1, 4, device=device).half()).float().sum()).backward()
        wrapped.step()
    # 20 updates of 1e-4 each: each alone rounds away in FP16 (ulp at 1.0 is 1e-3).
    master = next(wrapped.master_params())
    torch.testing.assert_close(master, torch.full_like(master, 1 - 20e-4), rtol=0, atol=1e-6)
    assert model.weight.detach().float().sub(1.0).abs().max() > 0


def test_a_16_bit_parameter_without_a_gradient_this_step_is_not_stepped(device):
    # A layer a step does not use, its 16-bit gradient cleared by the model's zero_grad
    # (which leaves the masters' as they were): its master's gradient goes too, and the
    # step passes it by, as torch's Adam passes by a parameter whose gradient is None.
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8), "b": torch.nn.Linear(8, 8)})
    model = model.to(device).half()
    wrapped = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters(), lr=0.1))
    x = torch.randn(4, 8, device=device).half()
    for use_b in (True, False):
        model.zero_grad()
        y = model["a"](x)
        wrapped.backward((model["b"](y) if use_b else y).float().pow(2).mean())
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        wrapped.step()
    for (name, p), master in zip(model.named_parameters(), wrapped.master_params(), strict=True):
        used = name.startswith("a.")
        assert (not torch.equal(before[name], p.detach())) == used, name
        assert (master.grad is None) != used, name
        # (Adam's step count: one step for b, taken with a)
        assert wrapped.optimizer.state[master]["step"].item() == (2 if used else 1), name


def test_wrapping_an_optimizer_with_16_bit_state_hands_it_to_the_masters_in_fp32(device):
    # An optimizer that already stepped (or loaded the state of) an FP16 model, wrapped:
    # each master takes its parameter's state, widened, and its requires_grad.
    model = _mlp(device, torch.float16)
    model[0].bias.requires_grad_(False)  # listed but frozen
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16, device=device).half()).float().sum().backward()
    optimizer.step()
    before = {p: {k: v.clone() for k, v in optimizer.state[p].items()} for p in optimizer.state}
    wrapped = mpgemm.LossScaleOptimizer(optimizer)
    for p, master in zip(model.parameters(), wrapped.master_params(), strict=True):
        assert master.dtype == torch.float32 and master.requires_grad == p.requires_grad
        state = wrapped.state.get(master, {})
        assert state.keys() == before.get(p, {}).keys()
        for name, value in state.items():
            expected = before[p][name]
            expected = expected.float() if expected.dtype == torch.float16 else expected
            assert_same_bits(value, expected, f"{name} of a {tuple(p.shape)} parameter")
    assert len(wrapped.state) == len(before) == 3  # (the frozen bias never stepped)


def test_zero_grad_keeps_zeroed_16_bit_gradients_unless_set_to_none(device):
    # As torch.optim.Optimizer.zero_grad: zeros in place, or None (the default).
    model = _mlp(device, torch.float16)
    wrapped = mpgemm.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for set_to_none in (False, True):
        wrapped.backward(model(torch.randn(8, 16, device=device).half()).float().sum())
        grads = [p.grad for p in model.parameters()]
        wrapped.zero_grad(set_to_none=set_to_none)
        for p, grad in zip(model.parameters(), grads, strict=True):
            if set_to_none:
                assert p.grad is None
            else:
                assert p.grad is grad and not grad.any()


def test_unscale_then_clip_matches_torchs_documented_order(device):
    ours, theirs = _mlp(device), _mlp(device)
    wrapped = mpgemm.LossScaleOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), **SCALER_ARGS)
    our_scales = _run_wrapper(ours, wrapped, 40, device, clip=0.5)
    torch_scales = _run_torch(
        theirs,
        torch.optim.SGD(theirs.parameters(), lr=0.1),
        torch.amp.GradScaler(device.type, **SCALER_ARGS),
        40,
        device,
        clip=0.5,
    )
    assert our_scales == torch_scales
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert_same_bits(p.detach(), q.detach(), "param")
    wrapped.scale_loss(
        _loss(
            ours, torch.randn(2, 16, device=device), torch.zeros(2, dtype=torch.long, device=device)
        )
    ).backward()
    wrapped.unscale_()
    with pytest.raises(RuntimeError, match="already been called"):
        wrapped.unscale_()


def test_state_dict_round_trip_mid_growth_interval(device):
    def make(model):
        return mpgemm.LossScaleOptimizer(
            mpgemm.optim.Adam(model.parameters(), lr=1e-3), init_scale=2.0**20, growth_interval=50
        )

    straight = _mlp(device, torch.float16)
    _run_wrapper(straight, make(straight), 30, device, dtype=torch.float16)
    model = _mlp(device, torch.float16)
    first = make(model)
    _run_wrapper(model, first, 30, device, dtype=torch.float16)
    saved = copy.deepcopy(first.state_dict())
    assert 0 < saved["scaler"]["_growth_tracker"] < 50
    resumed_model = _mlp(device, torch.float16)  # fresh weights: the checkpoint restores
    resumed = make(resumed_model)
    resumed.load_state_dict(saved)
    assert resumed.loss_scale == first.loss_scale != 2.0**20
    assert resumed.skipped_steps == first.skipped_steps
    assert resumed.scaler._get_growth_tracker() == saved["scaler"]["_growth_tracker"]
    for p, q in zip(resumed_model.parameters(), model.parameters(), strict=True):
        assert_same_bits(p.detach(), q.detach(), "restored param")
    # Continuing from the checkpoint equals continuing the original.
    _run_wrapper(resumed_model, resumed, 10, device, dtype=torch.float16)
    _run_wrapper(model, first, 10, device, dtype=torch.float16)
    for p, q in zip(resumed_model.parameters(), model.parameters(), strict=True):
        assert_same_bits(p.detach(), q.detach(), "continued param")
    assert resumed.loss_scale == first.loss_scale


def test_skipped_step_leaves_params_and_state_bit_identical(device):
    model = _mlp(device)
    wrapped = mpgemm.LossScaleOptimizer(mpgemm.optim.AdamW(model.parameters(), lr=1e-2))
    _run_wrapper(model, wrapped, 1, device)
    before = copy.deepcopy((list(model.parameters()), wrapped.optimizer.state_dict()))
    wrapped.zero_grad()
    wrapped.scale_loss(
        _loss(
            model,
            torch.randn(8, 16, device=device),
            torch.zeros(8, dtype=torch.long, device=device),
        )
    ).backward()
    model[2].bias.grad[1] = float("nan")
    wrapped.step()
    assert wrapped.skipped_steps == 1 and wrapped.loss_scale == 2.0**15
    for p, b in zip(model.parameters(), before[0], strict=True):
        assert_same_bits(p.detach(), b.detach(), "param")
    state, old = wrapped.optimizer.state_dict()["state"], before[1]["state"]
    for index in old:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert_same_bits(state[index][key], old[index][key], f"{key} of {index}")


@pytest.mark.unpoisoned  # the poison's fills would count as launches
def test_one_flag_serves_every_iteration_zeroed_by_the_update_that_read_it(device):
    """The inf flag is made once: each scale update zeroes it as it reads it, so a later
    step launches nothing to zero it; back-to-back skips (steps 2 and 3) and the clean
    steps after them decide as torch's scaler does."""
    pytest.importorskip("triton")
    from mpgemm.kernels.launches import count_launches

    model, reference = _mlp(device), _mlp(device)
    optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters()), **SCALER_ARGS)
    flags, scales = [], []
    for step, x, y in _batches(6, device):
        optimizer.zero_grad()
        optimizer.backward(_loss(model, x, y))
        _inject(list(model.parameters()), step)
        optimizer.step()
        flags.append(optimizer.scaler._flag)
        scales.append(optimizer.loss_scale)
        assert flags[-1].item() == 0.0, f"the flag is left zero after step {step}"
    assert all(flag is flags[0] for flag in flags)
    scaler = torch.amp.GradScaler(device, **SCALER_ARGS)
    torch_optimizer = torch.optim.Adam(reference.parameters())
    assert scales == _run_torch(reference, torch_optimizer, scaler, 6, device)
    assert optimizer.skipped_steps == 2
    # (Counted, the kernels do not run: this step's results are not looked at.)
    with count_launches() as count:
        optimizer.zero_grad()
        optimizer.backward(_loss(model, x, y))
        optimizer.step()
    assert "aten.zeros" not in count.torch and "aten.zero_" not in count.torch, count.torch


def test_a_flag_left_raised_is_zeroed_before_the_next_iteration(device):
    # update(new_scale) sets the scale without reading the flags: the flag the check
    # raised stays raised, and the next iteration must not inherit it.
    model = _mlp(device)
    optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.SGD(model.parameters(), lr=0.1))
    [(_, x, y)] = _batches(1, device)
    optimizer.backward(_loss(model, x, y))
    model[0].weight.grad[0, 0] = float("inf")
    optimizer.unscale_()
    optimizer.scaler.update(new_scale=1024.0)
    assert optimizer.scaler._flag.item() == 1.0
    optimizer.zero_grad()
    optimizer.backward(_loss(model, x, y))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert optimizer.skipped_steps == 0 and optimizer.loss_scale == 1024.0
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_behaves_as_an_optimizer_for_lr_schedulers(device):
    model = _mlp(device)
    wrapped = mpgemm.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(wrapped, torch.optim.Optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(wrapped, step_size=3, gamma=0.1)
    for _ in range(6):
        _run_wrapper(model, wrapped, 1, device)
        scheduler.step()
    assert wrapped.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert wrapped.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert wrapped.state is wrapped.optimizer.state
    assert wrapped.defaults["lr"] == 0.1
    # Set, as on a torch optimizer (a state reset, a new defaults dict): the wrapped
    # optimizer's are what is set, which its step reads.
    groups, state, defaults = [dict(wrapped.param_groups[0])], {}, {"lr": 0.5}
    wrapped.param_groups, wrapped.state, wrapped.defaults = groups, state, defaults
    inner = wrapped.optimizer
    assert inner.param_groups is groups and inner.state is state and inner.defaults is defaults
    assert repr(wrapped) == f"LossScaleOptimizer({inner!r})"


def test_bad_arguments():
    with pytest.raises(TypeError, match="Optimizer"):
        mpgemm.LossScaleOptimizer(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="the wrapped optimizer has no parameters"):
        mpgemm.LossScaleOptimizer(torch.optim.SGD([{"params": []}], lr=0.1))
    model = torch.nn.Linear(2, 2).half()
    wrapped = mpgemm.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="closure"):
        wrapped.step(lambda: 0.0)
    other = mpgemm.LossScaleOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1))
    with pytest.raises(ValueError, match="2 master weights.*0"):
        other.load_state_dict(wrapped.state_dict())
    with pytest.raises(ValueError, match="growth factor"):
        mpgemm.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1), growth_factor=0.5)


def test_mlp_of_mpgemm_linear_reaches_the_fp32_loss(device, monkeypatch):
    """A 2-hidden-layer MLP of mpgemm.Linear (FP16 operands, FP32 weights) with
    LossScaleOptimizer + Adam, against the same model in FP32: final training loss
    within 5% (relative) of FP32's after 150 steps on a fixed teacher task.

    On the CPU this runs the reference implementations (the interpreter would take
    minutes for 150 steps); the kernels' agreement with them is tested elsewhere."""
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(32, 8, generator=g)
    x = torch.randn(512, 32, generator=g)
    y = (x @ teacher).argmax(dim=1)
    x, y = x.to(device), y.to(device)

    def model():
        torch.manual_seed(3)
        return torch.nn.Sequential(
            torch.nn.Linear(32, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 8),
        ).to(device)

    fp32 = model()
    fp32_opt = torch.optim.Adam(fp32.parameters(), lr=3e-3)
    mixed = mpgemm.convert(model())
    assert all(type(m) is mpgemm.Linear for m in mixed if isinstance(m, torch.nn.Linear))
    mixed_opt = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(mixed.parameters(), lr=3e-3))
    for _ in range(150):
        for net, opt in ((fp32, fp32_opt), (mixed, mixed_opt)):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            (mixed_opt.scale_loss(loss) if opt is mixed_opt else loss).backward()
            opt.step()
    with torch.no_grad():
        final = [torch.nn.functional.cross_entropy(net(x), y).item() for net in (fp32, mixed)]
    assert final[0] < 0.3, f"FP32 did not learn: {final[0]}"
    assert abs(final[1] - final[0]) <= 0.05 * final[0] + 1e-3, final
    assert mixed_opt.skipped_steps == 0


def test_hooks_registered_on_the_wrapper_run(device):
    """torch.optim.Optimizer's hooks, registered on the wrapper: step hooks around each
    step; state-dict hooks as torch runs them, a returned state dict replacing the one
    given (registering one raised AttributeError before 2026-11-26)."""
    model = _mlp(device)
    wrapped = mpgemm.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    wrapped.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    wrapped.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    _run_wrapper(model, wrapped, 2, device)
    assert calls == ["pre", "post"] * 2

    def tagged(opt, state_dict):
        calls.append("saved")
        return {**state_dict, "tag": 1}

    def untagged(opt, state_dict):
        calls.append(f"loading tag {state_dict.pop('tag')}")

    calls.clear()
    wrapped.register_state_dict_pre_hook(lambda opt: calls.append("saving"))
    wrapped.register_state_dict_post_hook(tagged)
    wrapped.register_load_state_dict_pre_hook(untagged)
    wrapped.register_load_state_dict_post_hook(lambda opt: calls.append("loaded"))
    saved = wrapped.state_dict()
    assert saved["tag"] == 1
    wrapped.load_state_dict(saved)
    assert calls == ["saving", "saved", "loading tag 1", "loaded"]
    assert "tag" in saved  # the hooks are given a copy, as torch gives them

    def lowered(opt, state_dict):  # a load pre-hook's returned state dict is what loads
        groups = [{**group, "lr": 0.01} for group in state_dict["param_groups"]]
        return {**state_dict, "param_groups": groups}

    wrapped.register_load_state_dict_pre_hook(lowered)
    wrapped.load_state_dict(saved)
    assert wrapped.param_groups[0]["lr"] == 0.01


def test_add_param_group_gives_new_16_bit_params_masters(device):
    first, second = torch.nn.Linear(4, 4).to(device), torch.nn.Linear(4, 2).to(device).bfloat16()
    wrapped = mpgemm.LossScaleOptimizer(torch.optim.SGD(first.parameters(), lr=0.1))
    wrapped.add_param_group({"params": list(second.parameters()), "lr": 0.01})
    masters = wrapped.param_groups[1]["params"]
    assert [m.dtype for m in masters] == [torch.float32, torch.float32]
    x = torch.randn(3, 4, device=device)
    wrapped.scale_loss(second(first(x).bfloat16()).float().sum()).backward()
    before = [m.detach().clone() for m in masters]
    wrapped.step()
    for p, m, b in zip(second.parameters(), masters, before, strict=True):
        assert not torch.equal(m, b), "the master was stepped"
        assert_same_bits(p.detach(), m.detach().bfloat16(), "param = round(master)")


def test_a_16_bit_parameter_a_master_could_not_be_written_into_is_refused_up_front(device):
    # A negative view (torch's _foreach_copy_ refuses one) or, outside inference mode,
    # an inference tensor (a model made under torch.inference_mode): the step wrote
    # its master back last, so it raised after the master had stepped and the scale had
    # been updated, half done. Now the wrapper refuses it, and add_param_group adds
    # nothing; made and stepped within inference mode, it trains.
    weight = torch.randn(4, 8, device=device).half()
    with torch.inference_mode():
        served = weight.clone()
    bias = torch.nn.Parameter(torch.zeros(4, device=device).half())
    for odd, what in (
        (torch._neg_view(weight.neg()), "a negative view"),
        (served, "an inference tensor"),
    ):
        optimizer = torch.optim.SGD([bias, odd], lr=0.1)
        with pytest.raises(RuntimeError, match=f"16-bit parameter 1 of its param group is {what}"):
            mpgemm.LossScaleOptimizer(optimizer)
        assert optimizer.param_groups[0]["params"][0] is bias  # (no master put in its place)
        wrapped = mpgemm.LossScaleOptimizer(torch.optim.SGD([torch.nn.Parameter(weight)], lr=0.1))
        with pytest.raises(RuntimeError, match=what):
            wrapped.add_param_group({"params": [bias, odd]})
        assert len(wrapped.param_groups) == 1 and len(list(wrapped.master_params())) == 1
    with torch.inference_mode():
        wrapped = mpgemm.LossScaleOptimizer(torch.optim.SGD([served], lr=0.5), init_scale=4.0)
        served.grad = torch.ones_like(served) * wrapped.scaler.get_scale()
        wrapped.scaler.scale(torch.ones((), device=device))
        wrapped.step()
    assert_same_bits(served, (weight.float() - 0.5).half(), "stepped within inference mode")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA synchronisations")
@pytest.mark.parametrize("recipe", ["loss_scale_optimizer", "grad_scaler"])
def test_a_step_never_waits_for_the_gpu(recipe):
    # Skips and scale updates stay on the device, so no step reads a flag on the host
    # (torch.cuda.set_sync_debug_mode raises at any synchronising call).
    model = mpgemm.convert(_mlp("cuda"))
    if recipe == "loss_scale_optimizer":
        optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters(), lr=1e-3))
        scaler = None
    else:
        optimizer = mpgemm.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        scaler = mpgemm.GradScaler("cuda")

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        optimizer.zero_grad()
        (scaler.scale(loss) if scaler else optimizer.scale_loss(loss)).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()

    batches = list(_batches(4, "cuda"))
    for _, x, y in batches[:3]:  # compile, tune, allocate
        step(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(*batches[3][1:])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.unpoisoned  # the poison's fills would count as launches
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_gives_scale_loss_backwards_gradients_in_three_launches_fewer(device, dtype):
    # Side by side over steps that back off and grow the scale, inf and NaN included:
    # the same gradients, bit for bit, before each step (an FP16 model's too, read by
    # the masters), the same scales and parameters.
    pytest.importorskip("triton")
    from mpgemm.kernels.launches import count_launches

    models = _mlp(device, dtype), _mlp(device, dtype)
    optimizers = [
        mpgemm.LossScaleOptimizer(torch.optim.Adam(m.parameters(), lr=1e-3), **SCALER_ARGS)
        for m in models
    ]
    launches = []
    for step, x, y in _batches(12, device, dtype):
        grads = []
        for model, optimizer, seeded in zip(models, optimizers, (True, False), strict=True):
            optimizer.zero_grad()
            loss = _loss(model, x, y)
            with count_launches() as count:
                if seeded:
                    optimizer.backward(loss)
                else:
                    optimizer.scale_loss(loss).backward()
            launches.append(count.total)
            params = list(model.parameters())
            _inject(params, step)
            grads.append([p.grad.clone() for p in params])
            optimizer.step()
        for ours, theirs in zip(*grads, strict=True):
            assert_same_bits(ours, theirs, f"gradient at step {step}")
        assert optimizers[0].loss_scale == optimizers[1].loss_scale
    assert optimizers[0].skipped_steps == optimizers[1].skipped_steps >= 2  # (FP16: 3)
    assert all(
        seeded == plain - 3 for seeded, plain in zip(launches[::2], launches[1::2], strict=True)
    )
    for p, q in zip(*(m.parameters() for m in models), strict=True):
        assert_same_bits(p.detach(), q.detach(), "param")


def test_backward_takes_tensor_backwards_keywords_and_refuses_what_it_would(device):
    model = _mlp(device)
    optimizer = mpgemm.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device)
    first = list(model.parameters())[0]
    loss = _loss(model, x, y)
    optimizer.backward(loss, inputs=[first], retain_graph=True)
    assert all(p.grad is None for p in list(model.parameters())[1:])
    optimizer.zero_grad()
    optimizer.backward(loss)  # the graph was kept
    expected = torch.autograd.grad(_loss(model, x, y) * optimizer.loss_scale, first)[0]
    assert_same_bits(first.grad, expected, "gradient from a retained graph")
    losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
    for call in (lambda: optimizer.backward(losses), optimizer.scale_loss(losses).backward):
        with pytest.raises(RuntimeError, match="only for scalar outputs"):
            call()
    # create_graph: the gradients keep their graph (torch's layers: a gradient penalty
    # differentiates them), as after scale_loss(loss).backward(create_graph=True).
    grads = []
    for backward in (
        optimizer.backward,
        lambda loss, **kw: optimizer.scale_loss(loss).backward(**kw),
    ):
        optimizer.zero_grad()
        backward(_loss(model, x, y), create_graph=True)
        assert first.grad.requires_grad and first.grad.grad_fn is not None
        grads.append(first.grad.detach())
    assert_same_bits(*grads, "gradient with its graph")


def test_backward_runs_on_the_calling_thread_and_restores_autograds_setting(device):
    # Every node, hooks included, on the calling thread (autograd's multithreading off
    # within; on a GPU, not on autograd's worker thread of the device), and the
    # setting as it was afterwards, also where the backward raises.
    model = _mlp(device)
    optimizer = mpgemm.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device)
    seen = []

    def hook(grad):
        seen.append((threading.get_ident(), torch._C._is_multithreading_enabled()))

    for p in model.parameters():
        p.register_hook(hook)
    before = torch._C._is_multithreading_enabled()
    optimizer.backward(_loss(model, x, y))
    assert seen == [(threading.get_ident(), False)] * len(list(model.parameters()))
    assert torch._C._is_multithreading_enabled() == before

    def refuse(grad):
        raise ValueError("refused")

    handle = next(iter(model.parameters())).register_hook(refuse)
    with pytest.raises(ValueError, match="refused"):
        optimizer.backward(_loss(model, x, y))
    handle.remove()
    assert torch._C._is_multithreading_enabled() == before


def test_torch_distributed_checkpoints_state_dict_functions_take_it(device):
    """``torch.distributed.checkpoint``'s ``get_state_dict`` and ``set_state_dict`` (how
    FSDP2 runs save and resume) take a LossScaleOptimizer over a model of
    mpgemm.Linear layers: its state dict is the wrapped optimizer's format, the loss
    scaling's entries beside; a fresh one's state is made by their zero-gradient step;
    and a run resumed so, the scaler's state saved beside as for torch's GradScaler,
    continues as the original, bit for bit. The format before 2026-11-26 still loads,
    and the wrapped optimizer's class loads the new one. A step before any scaled loss
    with gradients (from an unscaled loss) is refused."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make(model):
        return mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters(), lr=1e-3))

    model = mpgemm.convert(_mlp(device))
    first = make(model)
    _run_wrapper(model, first, 6, device)
    saved = first.state_dict()
    assert {"state", "param_groups", "scaler", "skipped_steps", "master_params"} <= set(saved)
    # Copies, as a checkpoint on disk holds: loaded, a tensor of the right device and
    # dtype would be the original's own (torch's load_state_dict does not copy).
    model_state, optim_state = copy.deepcopy(get_state_dict(model, first))
    scaler_state = first.scaler.state_dict()
    resumed_model = mpgemm.convert(_mlp(device))
    with torch.no_grad():
        for p in resumed_model.parameters():
            p.add_(1.0)  # other weights: the checkpoint restores them
    resumed = make(resumed_model)
    set_state_dict(
        resumed_model, resumed, model_state_dict=model_state, optim_state_dict=optim_state
    )
    resumed.scaler.load_state_dict(scaler_state)
    for run_model, run in ((resumed_model, resumed), (model, first)):
        _run_wrapper(run_model, run, 5, device)
    assert resumed.loss_scale == first.loss_scale
    for p, q in zip(resumed_model.parameters(), model.parameters(), strict=True):
        assert_same_bits(p.detach(), q.detach(), "resumed param")

    nested = copy.deepcopy({"optimizer": first.optimizer.state_dict(), **first.state_dict()})
    for key in ("state", "param_groups"):
        del nested[key]
    other = make(mpgemm.convert(_mlp(device)))
    other.load_state_dict(nested)
    assert other.loss_scale == first.loss_scale
    assert other.optimizer.state_dict()["state"].keys() == saved["state"].keys()
    mpgemm.optim.Adam(_mlp(device).parameters()).load_state_dict(copy.deepcopy(saved))

    for dtype in (torch.float32, torch.float16):  # a 16-bit model's gradients too
        unscaled_model = _mlp(device, dtype)
        unscaled = make(unscaled_model)
        _loss(unscaled_model, *next(_batches(1, device, dtype))[1:]).backward()
        with pytest.raises(RuntimeError, match="no loss has been scaled yet"):
            unscaled.step()


_STEPPED: list = []


def _note_step(optimizer, args, kwargs):  # a step hook that pickles (a lambda does not)
    _STEPPED.append(optimizer)


def test_pickled_or_deep_copied_with_its_model_it_trains_on_as_the_original(device):
    """As a torch optimizer: ``copy.deepcopy((model, optimizer))`` and a pickle round
    trip give a wrapper whose wrapped optimizer, scaler, masters and hooks are the
    copy's own (an unpickled one had no wrapped optimizer before 2026-11-26), and which
    trains on as the original does, bit for bit."""
    import pickle

    model = _mlp(device, torch.float16)
    wrapped = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters(), lr=1e-3))
    wrapped.register_step_post_hook(_note_step)
    _run_wrapper(model, wrapped, 4, device, dtype=torch.float16)
    copies = [copy.deepcopy((model, wrapped)), pickle.loads(pickle.dumps((model, wrapped)))]
    for copied_model, copied in copies:
        assert copied._low_params == list(copied_model.parameters())
        assert copied.optimizer.param_groups[0]["params"] == copied._masters
    _STEPPED.clear()
    for run_model, run in [(model, wrapped), *copies]:
        _run_wrapper(run_model, run, 3, device, dtype=torch.float16)
    assert _STEPPED == [wrapped] * 3 + [copies[0][1]] * 3 + [copies[1][1]] * 3
    for copied_model, copied in copies:
        assert copied.loss_scale == wrapped.loss_scale
        for p, q in zip(copied_model.parameters(), model.parameters(), strict=True):
            assert_same_bits(p.detach(), q.detach(), "param")


def test_a_run_of_torchs_optimizer_and_scaler_resumes_under_it(device):
    """A checkpoint of torch's recipe (an optimizer's and a GradScaler's state dicts)
    loads into a LossScaleOptimizer over the converted model: the wrapped optimizer
    takes the optimizer's state dict as it is, its scaler torch's scaler's, and the run
    goes on from the same state and scale."""
    model = _mlp(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
    for _, x, y in _batches(3, device):
        optimizer.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        scaler.step(optimizer)
        scaler.update()
    checkpoint = copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
        }
    )
    converted = mpgemm.convert(_mlp(device))
    converted.load_state_dict(checkpoint["model"])
    wrapped = mpgemm.LossScaleOptimizer(mpgemm.optim.AdamW(converted.parameters(), lr=1e-3))
    wrapped.load_state_dict(checkpoint["optimizer"])
    wrapped.scaler.load_state_dict(checkpoint["scaler"])
    assert wrapped.loss_scale == scaler.get_scale()
    theirs = optimizer.state[next(model.parameters())]
    ours = wrapped.state[next(converted.parameters())]
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(ours[key].cpu(), theirs[key].cpu()), key
    _run_wrapper(converted, wrapped, 1, device)
    assert wrapped.state[next(converted.parameters())]["step"].item() == 4
