"""mpgemm.GradScaler against torch.amp.GradScaler("cpu"), side by side: the same
gradients every step, inf and NaN injected at chosen steps, tensors and positions, and
the scale trajectory, the skip decisions and the final parameters must be identical."""

import copy
import pickle

import pytest
import torch

import mpgemm
from mpgemm import scaling
from tests.accuracy import assert_same_bits, assert_within_torch_error

SHAPES = [(48, 32), (32,), (10, 48), (10,)]
# step -> (tensor, flat index, value) injected into the scaled gradients
INJECTIONS = {
    3: (0, 5, float("inf")),
    4: (3, 9, float("nan")),
    40: (2, 0, -float("inf")),
    41: (0, 1535, float("nan")),
    42: (1, 31, float("inf")),
    150: (2, 479, float("nan")),
}


def _params(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in SHAPES]


def _drive(scaler, optimizer, params, steps, *, dtype, seed=1, magnitude=8.0):
    """Run ``steps`` iterations: gradients are fresh random values (magnitudes over many
    binades) times the scaler's scale, as ``scale(loss).backward()`` would give, cast to
    the parameters' dtype; returns the scale and whether params changed, per step."""
    g = torch.Generator().manual_seed(seed)
    trajectory = []
    for step in range(steps):
        for p in params:
            true_grad = torch.randn(p.shape, generator=g) * torch.rand(p.shape, generator=g)
            p.grad = scaler.scale(true_grad.mul(magnitude).to(p.device)).to(dtype)
        if step in INJECTIONS:
            tensor, index, value = INJECTIONS[step]
            params[tensor].grad.view(-1)[index] = value
        before = [p.detach().clone() for p in params]
        scaler.step(optimizer)
        scaler.update()
        stepped = any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
        trajectory.append((scaler.get_scale(), stepped))
    return trajectory


def _side_by_side(make_optimizer, *, dtype, steps, device, magnitude=8.0, **scaler_args):
    ours_params, torch_params = _params(dtype, device), _params(dtype, device)
    ours = _drive(
        mpgemm.GradScaler(device.type, **scaler_args),
        make_optimizer(ours_params),
        ours_params,
        steps,
        dtype=dtype,
        magnitude=magnitude,
    )
    theirs = _drive(
        torch.amp.GradScaler(device.type, **scaler_args),
        make_optimizer(torch_params),
        torch_params,
        steps,
        dtype=dtype,
        magnitude=magnitude,
    )
    return ours, theirs, ours_params, torch_params


def _assert_identical(ours, theirs, ours_params, torch_params):
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == b, f"step {step}: (scale, stepped) {a} != torch's {b}"
    for i, (p, q) in enumerate(zip(ours_params, torch_params, strict=True)):
        assert torch.isfinite(p).all(), f"param {i} is not finite"
        assert_same_bits(p.detach(), q.detach(), f"param {i}")


def test_fp32_gradients_with_torch_sgd_over_300_steps(device):
    # growth_interval=2 doubles the scale until scale * grad overflows FP32.
    ours, theirs, *params = _side_by_side(
        lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
        dtype=torch.float32,
        steps=300,
        device=device,
        growth_interval=2,
    )
    _assert_identical(ours, theirs, *params)
    skipped = [step for step, (_, stepped) in enumerate(ours) if not stepped]
    assert set(INJECTIONS) <= set(skipped)
    assert len(skipped) > len(INJECTIONS), "natural overflows were expected too"


def test_scale_stops_growing_where_growth_would_overflow_fp32(device):
    # Gradients small enough that scale * grad stays finite at 2**127: growing further
    # would make the scale inf, which the rule refuses.
    ours, theirs, *params = _side_by_side(
        lambda p: torch.optim.SGD(p, lr=1e-3),
        dtype=torch.float32,
        steps=260,
        device=device,
        growth_interval=2,
        magnitude=1e-6,
    )
    _assert_identical(ours, theirs, *params)
    assert [scale for scale, _ in ours[-5:]] == [2.0**127] * 5


def test_fp16_gradients_with_a_scale_aware_optimizer_over_300_steps(device):
    # torch's fused SGD takes grad_scale/found_inf from either scaler, so FP16 params
    # and gradients are allowed; FP16 overflows as the scale grows past ~2048. (Without
    # momentum: torch's fused SGD leaves its momentum buffers uninitialised, from
    # torch.empty_like, when the first step is skipped, and reads them on the next.)
    ours, theirs, *params = _side_by_side(
        lambda p: torch.optim.SGD(p, lr=1e-3, fused=True),
        dtype=torch.float16,
        steps=300,
        device=device,
        growth_interval=5,
    )
    _assert_identical(ours, theirs, *params)
    assert sum(not stepped for _, stepped in ours) > len(INJECTIONS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mpgemm_fused_sgd_under_either_scaler(path_device, dtype):
    # Same optimizer, two scalers: ours checks without writing and passes the flag;
    # torch's checks with an unscale by 1. The steps must agree bit for bit, on the
    # kernels and on the reference path (its skips on the device, by torch.where).
    device = path_device
    if device.type == "cuda" and dtype == torch.bfloat16:
        pytest.skip(
            "torch's GradScaler cannot unscale BF16 gradients on CUDA "
            "(_amp_foreach_non_finite_check_and_unscale_cuda has no BF16 kernel)"
        )
    ours, theirs, *params = _side_by_side(
        lambda p: mpgemm.optim.SGD(p, lr=1e-3, momentum=0.9),
        dtype=dtype,
        steps=100,
        device=device,
        growth_interval=4,
    )
    _assert_identical(ours, theirs, *params)


def test_one_scaler_serves_two_optimizers(device):
    def run(scaler_cls):
        params = _params(torch.float32, device)
        opts = [torch.optim.SGD(params[:2], lr=0.1), torch.optim.Adam(params[2:], lr=0.1)]
        scaler = scaler_cls(device.type, growth_interval=3)
        scales = []
        for step in range(30):
            for p in params:
                p.grad = scaler.scale(torch.randn(p.shape, device=device))
            if step in (7, 8):
                params[3].grad[0] = float("inf")  # only the second optimizer's gradient
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, params

    torch.manual_seed(0)
    ours, ours_params = run(mpgemm.GradScaler)
    torch.manual_seed(0)
    theirs, torch_params = run(torch.amp.GradScaler)
    assert ours == theirs
    for p, q in zip(ours_params, torch_params, strict=True):
        assert_same_bits(p.detach(), q.detach(), "param")


def test_state_dict_mid_growth_interval_resumes_the_same_trajectory(device):
    params = _params(torch.float32, device)
    scaler = mpgemm.GradScaler(device.type, growth_interval=10)
    _drive(scaler, torch.optim.SGD(params, lr=1e-3), params, 7, dtype=torch.float32)
    state = scaler.state_dict()
    assert state["_growth_tracker"] == 2  # the injections at steps 3 and 4 reset it
    assert state["scale"] == 2.0**14
    # Resume in a fresh scaler of each kind and continue both: same scales.
    continued = []
    for cls in (mpgemm.GradScaler, torch.amp.GradScaler, mpgemm.GradScaler):
        resumed = cls(device.type)
        resumed.load_state_dict(state)
        assert resumed._get_growth_tracker() == 2
        resumed_params = [p.detach().clone().requires_grad_() for p in params]
        continued.append(
            _drive(
                resumed,
                torch.optim.SGD(resumed_params, lr=1e-3),
                resumed_params,
                20,
                dtype=torch.float32,
                seed=5,
            )
        )
    assert continued[0] == continued[1] == continued[2]
    assert continued[0][0] == (2.0**14, True)  # the saved scale, not the initial one
    # And a torch scaler's state dict loads into ours.
    theirs = torch.amp.GradScaler(device.type, init_scale=1024.0, growth_interval=5)
    ours = mpgemm.GradScaler(device.type)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict() == theirs.state_dict()


def test_a_state_dict_loaded_into_a_scaler_in_use_sets_its_live_scale(device):
    # Loaded mid-run (a checkpoint restored into the running job), as torch's scaler:
    # the scale and growth tracker tensors the next steps read take the loaded values.
    saved = mpgemm.GradScaler(device.type, init_scale=2.0**7, growth_interval=10)
    saved.load_state_dict({**saved.state_dict(), "_growth_tracker": 9})
    trajectories = []
    for cls in (mpgemm.GradScaler, torch.amp.GradScaler):
        params = _params(torch.float32, device)
        scaler = cls(device.type, growth_interval=10)
        _drive(scaler, torch.optim.SGD(params, lr=1e-3), params, 2, dtype=torch.float32)
        assert scaler._scale is not None and scaler.get_scale() == 2.0**16
        scaler.load_state_dict(saved.state_dict())
        assert (scaler.get_scale(), scaler._get_growth_tracker()) == (2.0**7, 9)
        optimizer = torch.optim.SGD(params, lr=1e-3)
        trajectories.append(_drive(scaler, optimizer, params, 2, dtype=torch.float32, seed=3))
    assert trajectories[0] == trajectories[1] == [(2.0**8, True), (2.0**8, True)]


def test_pickle_between_iterations_keeps_scale_and_tracker(device):
    params = _params(torch.float32, device)
    scaler = mpgemm.GradScaler(device.type, growth_interval=10)
    _drive(scaler, torch.optim.SGD(params, lr=1e-3), params, 8, dtype=torch.float32)
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()
    assert copy.deepcopy(scaler).get_scale() == scaler.get_scale()


def test_step_with_a_fused_optimizer_never_reads_the_flag_on_the_host(device, monkeypatch):
    params = _params(torch.float32, device)
    optimizer = mpgemm.optim.Adam(params, lr=1e-3)
    scaler = mpgemm.GradScaler(device.type)
    for p in params:
        p.grad = scaler.scale(torch.randn(p.shape, device=device))
    params[0].grad[0, 0] = float("nan")

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor was read on the host")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    before = [p.detach().clone() for p in params]
    scaler.step(optimizer)
    scaler.update()
    monkeypatch.undo()
    assert scaler.get_scale() == 2.0**15
    for b, p in zip(before, params, strict=True):
        assert_same_bits(p.detach(), b, "skipped step")


def test_mpgemm_optimizers_get_the_scale_and_flag_as_step_arguments(device, monkeypatch):
    # Not as attributes: torch.compile before torch 2.13 fails on setting an attribute of
    # an optimizer (pytorch#171590), which torch's protocol does around the step.
    params = _params(torch.float32, device)
    optimizer = mpgemm.optim.Adam(params, lr=1e-3)
    scaler = mpgemm.GradScaler(device.type, init_scale=2.0**10)
    for p in params:
        p.grad = scaler.scale(torch.randn(p.shape, device=device))
    seen = []
    step_groups = optimizer._step_groups

    def spy(parts, grad_scale, found_inf):
        attributes = {n for n in ("grad_scale", "found_inf") if n in vars(optimizer)}
        seen.append((attributes, grad_scale.item(), found_inf.item()))
        step_groups(parts, grad_scale, found_inf)

    monkeypatch.setattr(optimizer, "_step_groups", spy)
    scaler.step(optimizer)
    assert seen == [(set(), 2.0**10, 0.0)]


def test_disabled_scaler_is_a_pass_through(device):
    scaler = mpgemm.GradScaler(device.type, enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    params = _params(torch.float32, device)
    for p in params:
        p.grad = torch.ones_like(p)
    scaler.step(torch.optim.SGD(params, lr=1.0))
    scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    assert not scaler.is_enabled()
    # The rest of the API does nothing, as torch's disabled scaler: unscale_ leaves the
    # gradients, a state dict loads nothing (an empty one is no error), the tracker is 0.
    theirs = torch.amp.GradScaler(device.type, enabled=False)
    for each in (scaler, theirs):
        optimizer = torch.optim.SGD(params, lr=1.0)
        each.unscale_(optimizer)
        each.load_state_dict({"scale": 8.0, "_growth_tracker": 3})
        each.load_state_dict({})
        assert each._get_growth_tracker() == 0 and each.get_scale() == 1.0
        assert all(p.grad.eq(1).all() for p in params)


def test_getters_setters_and_nested_outputs(device):
    scaler = mpgemm.GradScaler(device.type, init_scale=8.0)
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (3.0, 0.25)
    assert scaler.get_growth_interval() == 7 and scaler.get_scale() == 8.0
    out = scaler.scale([torch.ones(2, device=device), (torch.full((1,), 2.0, device=device),)])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert out[0].tolist() == [8.0, 8.0] and out[1][0].tolist() == [16.0]
    scaler.update(new_scale=4.0)
    assert scaler.get_scale() == 4.0
    scaler.update(new_scale=torch.tensor(2.0, device=device))
    assert scaler.get_scale() == 2.0


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: mpgemm.optim.SGD(ps, lr=0.1),
        lambda ps: mpgemm.optim.Adam(ps, lr=0.1),
        lambda ps: mpgemm.optim.AdamW(ps, lr=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
    ],
    ids=["sgd", "adam", "adamw", "torch_sgd"],
)
@pytest.mark.parametrize(
    "scaler_class", [mpgemm.GradScaler, torch.amp.GradScaler], ids=["mpgemm_scaler", "torch_scaler"]
)
def test_after_step_the_gradients_are_unscaled_as_torch_leaves_them(
    path_device, make, scaler_class
):
    device = path_device
    p = torch.nn.Parameter(torch.ones(3, device=device))
    optimizer = make([p])
    scaler = scaler_class(device.type, init_scale=128.0)
    scaler.scale((p * 2).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert p.grad.tolist() == [2.0, 2.0, 2.0]


def test_unscale_grads_is_torchs_override_point(device):
    import inspect

    # The same name and parameters as torch.amp.GradScaler's, and both unscale_ and a
    # step that unscales go through it.
    ours = list(inspect.signature(mpgemm.GradScaler._unscale_grads_).parameters)
    assert ours == list(inspect.signature(torch.amp.GradScaler._unscale_grads_).parameters)

    class Counting(mpgemm.GradScaler):
        calls = []

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            self.calls.append(allow_fp16)
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    param = torch.nn.Parameter(torch.ones(3, device=device))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = Counting(device.type, init_scale=4.0)
    for unscale_first in (True, False):
        scaler.scale(param.sum()).backward()
        if unscale_first:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert Counting.calls == [False, False]


def test_unscale_grads_coalesces_a_sparse_fp16_gradient_it_unscales_as_torch(device):
    # The override point's allow_fp16 (torch's sharded scaler passes True): a 16-bit
    # sparse gradient with duplicate indices is coalesced first, as torch's, so that
    # its sums are checked, and param.grad becomes that unscaled coalesced tensor.
    grads = []
    for scaler_class in (mpgemm.GradScaler, torch.amp.GradScaler):
        param = torch.nn.Parameter(torch.zeros(6, 3, dtype=torch.float16, device=device))
        rows = torch.tensor([[0, 2, 0, 5]])
        values = torch.arange(1.0, 13.0).view(4, 3).to(torch.float16) * 1024
        param.grad = torch.sparse_coo_tensor(rows, values, (6, 3)).to(device)
        scaler = scaler_class(device.type, init_scale=1024.0)
        scaler._lazy_init_scale_growth_tracker(device)
        inv_scale = scaler._scale.double().reciprocal().float()
        found_inf = torch.zeros(1, device=device)
        scaler._unscale_grads_(torch.optim.SGD([param], lr=0.1), inv_scale, found_inf, True)
        assert param.grad.is_coalesced() and found_inf.item() == 0.0
        grads.append(param.grad.to_dense())
    assert grads[0][0].tolist() == [8.0, 10.0, 12.0]  # rows 0's two entries, summed
    assert_same_bits(grads[0], grads[1], "the unscaled gradient")


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: mpgemm.optim.Adam(ps, lr=0.1),
        lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
    ],
    ids=["mpgemm_adam", "torch_fused_adam"],
)
def test_a_grad_scale_set_on_the_optimizer_multiplies_the_scalers_as_torch(device, make):
    # torch's scaler steps a scale-aware optimizer with its scale times the
    # optimizer's own grad_scale where the caller set one, and removes the attribute.
    params = []
    for scaler_class in (mpgemm.GradScaler, torch.amp.GradScaler):
        param = torch.nn.Parameter(torch.ones(5, device=device))
        optimizer = make([param])
        scaler = scaler_class(device.type, init_scale=8.0)
        scaler.scale((param * torch.arange(1.0, 6.0, device=device)).sum()).backward()
        optimizer.grad_scale = torch.tensor(4.0, device=device)
        scaler.step(optimizer)
        scaler.update()
        assert not hasattr(optimizer, "grad_scale")
        assert param.grad.tolist() == [v / 4 for v in range(1, 6)]  # by 8, then by 4
        params.append(param.detach())
    assert_same_bits(params[0], params[1], "the stepped parameter")


def test_maybe_opt_step_is_torchs_override_point(device):
    import inspect

    # The same parameters as torch's; a step of an optimizer that does not skip on the
    # device goes through it, one that does (mpgemm's SGD) does not.
    ours = list(inspect.signature(mpgemm.GradScaler._maybe_opt_step).parameters)
    assert ours == list(inspect.signature(torch.amp.GradScaler._maybe_opt_step).parameters)

    class Counting(mpgemm.GradScaler):
        calls: list = []

        def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
            self.calls.append(type(optimizer))
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)

    for make in (torch.optim.SGD, mpgemm.optim.SGD):
        param = torch.nn.Parameter(torch.ones(3, device=device))
        optimizer = make([param], lr=0.5)
        scaler = Counting(device.type, init_scale=4.0)
        scaler.scale(param.sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        assert param.tolist() == [0.5, 0.5, 0.5]
    assert Counting.calls == [torch.optim.SGD]


@pytest.mark.parametrize("scaler_class", [mpgemm.GradScaler, torch.amp.GradScaler])
def test_torchs_private_helpers_that_scripts_call(device, scaler_class):
    # _get_scale_async (the scale without a sync), _lazy_init_scale_growth_tracker and
    # _check_scale_growth_tracker (make, then get, the scale and tracker),
    # _check_inf_per_device (check without unscaling) and _found_inf_per_device (this
    # iteration's flags), as torch's scaler has them: the test runs on both.
    param = torch.nn.Parameter(torch.ones(3, device=device))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scaler = scaler_class(device.type, init_scale=8.0)
    assert scaler._get_scale_async() is None
    assert scaler._found_inf_per_device(optimizer) == {}
    with pytest.raises((RuntimeError, AssertionError), match="update"):
        scaler._check_scale_growth_tracker("update")
    # Made ahead (before a CUDA graph's capture, say), then kept by scale().
    scaler._lazy_init_scale_growth_tracker(device)
    scale, tracker = scaler._check_scale_growth_tracker("update")
    assert scale.tolist() == 8.0 and tracker.tolist() == 0 and tracker.dtype == torch.int32
    scaler.scale(param.sum()).backward()
    assert scaler._get_scale_async() is scale
    param.grad[1] = float("inf")
    flags = scaler._check_inf_per_device(optimizer)
    # Keyed by the gradients' device, as torch's scaler keys them (cuda:0, not cuda).
    assert {device: flag.tolist() for device, flag in flags.items()} == {param.grad.device: 1.0}
    assert scaler._found_inf_per_device(optimizer) is flags
    assert param.grad.tolist() == [8.0, float("inf"), 8.0]  # checked, not unscaled
    scaler.step(optimizer)
    scaler.update()
    assert param.tolist() == [1.0, 1.0, 1.0]  # skipped
    assert scaler._get_scale_async() is scale and scale.tolist() == 4.0


@pytest.mark.parametrize("scaler_class", [mpgemm.GradScaler, torch.amp.GradScaler])
def test_an_optimizers_stage_is_torchs_enum(device, scaler_class):
    # Scripts read it: scaler._per_optimizer_states[id(optimizer)]["stage"] is
    # torch.amp.grad_scaler.OptState.READY (torch.cuda.amp's is the same enum).
    from torch.amp.grad_scaler import OptState

    param = torch.nn.Parameter(torch.ones(3, device=device))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scaler = scaler_class(device.type, init_scale=8.0)
    scaler.scale(param.sum()).backward()
    stages = [scaler._per_optimizer_states[id(optimizer)]["stage"]]
    scaler.unscale_(optimizer)
    stages.append(scaler._per_optimizer_states[id(optimizer)]["stage"])
    scaler.step(optimizer)
    stages.append(scaler._per_optimizer_states[id(optimizer)]["stage"])
    assert all(a is b for a, b in zip(stages, OptState, strict=True))


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=1e-3, fused=True),
        lambda p: mpgemm.optim.SGD(p, lr=1e-3, momentum=0.9),
    ],
    ids=["torch_sgd", "torch_fused_sgd", "mpgemm_sgd"],
)
def test_flags_raised_in_place_after_unscale_skip_the_step_as_in_torch(device, make):
    """Torch's idiom under DDP: after ``unscale_``, each flag of ``_found_inf_per_device``
    is all-reduced in place with MAX, so that every rank skips a step any rank found an
    inf in. Here the flags are raised in place at chosen steps, as another rank's inf
    would raise them, on finite gradients: both scalers skip those steps and back off,
    and take the others, with the same parameters, step by step."""
    results = []
    for scaler_class in (mpgemm.GradScaler, torch.amp.GradScaler):
        params = _params(torch.float32, device)
        optimizer = make(params)
        scaler = scaler_class(device.type, init_scale=256.0, growth_interval=2)
        g = torch.Generator().manual_seed(1)
        trajectory = []
        for step in range(8):
            for p in params:
                p.grad = scaler.scale(torch.randn(p.shape, generator=g).to(device))
            scaler.unscale_(optimizer)
            if step in (2, 3, 6):
                for flag in scaler._found_inf_per_device(optimizer).values():
                    flag.fill_(1.0)
            before = [p.detach().clone() for p in params]
            scaler.step(optimizer)
            scaler.update()
            stepped = any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
            trajectory.append((scaler.get_scale(), stepped))
        results.append((trajectory, params))
    (ours, ours_params), (theirs, torch_params) = results
    assert [stepped for _, stepped in ours] == [step not in (2, 3, 6) for step in range(8)]
    _assert_identical(ours, theirs, ours_params, torch_params)


def test_a_pickled_loss_scale_optimizers_scaler_still_reduces_its_flag(device, monkeypatch):
    from mpgemm import loss_scale_optimizer

    param = torch.nn.Parameter(torch.ones(3, device=device))
    wrapped = mpgemm.LossScaleOptimizer(torch.optim.SGD([param], lr=0.1), all_reduce_found_inf=True)
    scaler = pickle.loads(pickle.dumps(wrapped.scaler))
    reduced = []
    monkeypatch.setattr(
        loss_scale_optimizer.dist, "all_reduce", lambda flag, **kwargs: reduced.append(flag.item())
    )
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler.scale(param.sum()).backward()
    scaler.step(optimizer)
    assert reduced == [0.0]  # the hook was lost in pickling before: no reduction


def test_gradients_are_unscaled_per_device_in_their_order(monkeypatch, fake_second_device):
    """``_unscale_grads_`` launches once per device: the (source, destination) pairs
    split by the source's device, in order; one device keeps the lists themselves. (A
    second device is faked: the split reads each tensor's device index.)"""
    first = [torch.zeros(2), torch.zeros(3), torch.zeros(4)]
    second = [torch.zeros(5), torch.zeros(6)]
    fake_second_device({id(t) for t in second}, scaling)
    srcs = [first[0], second[0], first[1], second[1], first[2]]
    dsts = [torch.empty_like(t) for t in srcs]
    pair = {id(s): d for s, d in zip(srcs, dsts, strict=True)}
    split = scaling.by_device(srcs, dsts)
    assert len(split) == 2
    for (got_srcs, got_dsts), tensors in zip(split, (first, second), strict=True):
        assert [id(t) for t in got_srcs] == [id(t) for t in tensors]
        assert [id(t) for t in got_dsts] == [id(pair[id(t)]) for t in tensors]
    monkeypatch.undo()
    (only_srcs, only_dsts), *rest = scaling.by_device(srcs, srcs)
    assert not rest and only_srcs is srcs and only_dsts is srcs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA scaler")
@pytest.mark.parametrize("make", [torch.optim.SGD, mpgemm.optim.SGD])
def test_cpu_tensors_under_a_cuda_scaler_read_the_scale_once_it_has_landed(make):
    """A CUDA scaler's scale, inverse and flag reach CPU tensors (a CPU loss scaled, CPU
    gradients unscaled and checked) only once the GPU has copied them, however far
    behind the host the GPU runs: here its stream spins ~0.1 s before each. A copy
    left asynchronous reads pinned memory the copy has not reached yet. 2**21 is a scale
    no earlier copy in the process left in that memory."""
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = make([param], lr=1.0)
    scaler = mpgemm.GradScaler("cuda", init_scale=2.0**21)
    scaler.scale(torch.ones((), device="cuda"))  # the scale, made on the GPU
    torch.cuda._sleep(200_000_000)
    scaled = scaler.scale(torch.full((), 3.0))
    assert scaled.item() == 3.0 * 2**21
    param.grad = torch.tensor([3.0, -1.0, 0.5, 2.0]) * 2**21
    torch.cuda._sleep(200_000_000)
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(param.grad, torch.tensor([3.0, -1.0, 0.5, 2.0]))
    assert torch.equal(param.detach(), torch.tensor([-3.0, 1.0, -0.5, -2.0]))
    param.grad[1] = float("inf")  # and a CPU inf is seen: the step skipped, the scale halved
    torch.cuda._sleep(200_000_000)
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(param.detach(), torch.tensor([-3.0, 1.0, -0.5, -2.0]))
    assert scaler.get_scale() == 2.0**20


def _penalty(scaler_class, device, x, y, model=None, autocast=False):
    """torch's AMP example "Gradient penalty": the penalty's gradients taken from the
    scaled loss with ``create_graph``, unscaled by hand, then the whole loss scaled;
    ``model`` by default ``_two_layers``, its loss under autocast if asked."""
    model = _two_layers(device) if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_class(device.type, init_scale=256.0)
    for _ in range(4):
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16, enabled=autocast):
            loss = (model(x).float() - y).square().mean()
        scaled = torch.autograd.grad(
            scaler.scale(loss), list(model.parameters()), create_graph=True
        )
        inv_scale = 1.0 / scaler.get_scale()
        norm = torch.stack([(g * inv_scale).pow(2).sum() for g in scaled]).sum().sqrt()
        scaler.scale(loss + norm).backward()
        scaler.step(optimizer)
        scaler.update()
    return model, scaler


def _two_optimizers(scaler_class, device, x, y):
    """torch's AMP example "Working with multiple models, losses, and optimizers": two
    losses backward into two models, one optimizer's gradients unscaled and clipped, both
    stepped, one update; an inf in one loss skips both steps."""
    model = _two_layers(device)
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.Adam(model[1].parameters(), lr=0.01)
    scaler = scaler_class(device.type, init_scale=256.0, growth_interval=2)
    for step in range(5):
        first.zero_grad()
        second.zero_grad()
        hidden = model[0](x)
        loss0 = (hidden - 1).square().mean() * (float("inf") if step == 2 else 1.0)
        loss1 = (model[1](hidden) - y).square().mean()
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        scaler.unscale_(first)
        torch.nn.utils.clip_grad_norm_(model[0].parameters(), 1.0)
        scaler.step(first)
        scaler.step(second)
        scaler.update()
    return model, scaler


def _accumulation(scaler_class, device, x, y):
    """torch's AMP example "Gradient accumulation": scaled backward passes accumulate
    over two batches, then one step and update."""
    model = _two_layers(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = scaler_class(device.type, init_scale=256.0)
    for i in range(6):
        scaler.scale((model(x * (i + 1)) - y).square().mean() / 2).backward()
        if i % 2 == 1:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return model, scaler


def _two_layers(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(device)


def test_torchs_gradient_penalty_example_trains_a_converted_model_within_autocasts_error(
    device,
):
    """The "Gradient penalty" example on a model ``mpgemm.convert`` made (a GELU
    between), with mpgemm's scaler: its backward under ``create_graph`` is
    differentiated (it raised while once-differentiable), and after four steps the
    parameters are within twice the error of autocast's (FP16, torch's scaler) of the
    FP64 model's, trained without scaling."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 8, generator=g).to(device), torch.randn(4, 2, generator=g).to(device)

    def model(dtype=torch.float32):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)]
        return torch.nn.Sequential(*layers).to(device, dtype)

    def unscaled(device_type, init_scale):
        return torch.amp.GradScaler(device_type, init_scale=init_scale, enabled=False)

    ours, _ = _penalty(mpgemm.GradScaler, device, x, y, mpgemm.convert(model()))
    autocast, _ = _penalty(torch.amp.GradScaler, device, x, y, model(), autocast=True)
    exact, _ = _penalty(unscaled, device, x.double(), y.double(), model(torch.float64))
    start = model(torch.float64)
    models = (ours, autocast, exact, start)
    for p, p_ac, p64, p0 in zip(*(m.parameters() for m in models), strict=True):
        assert_within_torch_error(p.detach(), p64.detach(), p_ac.detach(), "parameter")
        assert not torch.equal(p64, p0)


@pytest.mark.parametrize("recipe", [_penalty, _two_optimizers, _accumulation])
def test_torchs_amp_examples_train_as_with_torchs_scaler(device, recipe):
    """The recipes of torch's "Automatic Mixed Precision examples" page give the
    parameters and the scale of torch's GradScaler, bit for bit."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 8, generator=g).to(device), torch.randn(4, 2, generator=g).to(device)
    ours, our_scaler = recipe(mpgemm.GradScaler, device, x, y)
    theirs, their_scaler = recipe(torch.amp.GradScaler, device, x, y)
    assert our_scaler.get_scale() == their_scaler.get_scale()
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert_same_bits(p.detach(), q.detach(), "parameter")
