"""mpgemm.optim's fused SGD, Adam and AdamW: the kernels against the references, the
optimizers against torch's, and a skipped step that leaves every bit in place."""

import contextlib
import copy
import functools

import pytest
import torch

import mpgemm
from mpgemm import scaling, scaling_ref
from mpgemm.kernels.launches import intercept
from tests.accuracy import assert_same_bits, launched_kernels, optimizer_launch_shape

SHAPES = [(5000,), (33, 7), (1,), (0,)]
PARAM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tensors(dtype, device, *, scale=1.0, positive=False):
    out = [torch.randn(s, device=device).mul(scale).to(dtype) for s in SHAPES]
    return [t.abs() for t in out] if positive else out


def _clones(lists):
    return [[t.clone() for t in lst] for lst in lists]


def _assert_close_lists(out, ref, what, rtol):
    for i, (a, b) in enumerate(zip(out, ref, strict=True)):
        assert torch.isfinite(a).all(), f"{what} {i}: non-finite"
        torch.testing.assert_close(
            a, b, rtol=rtol, atol=rtol * b.abs().max().item() if b.numel() else 0, msg=f"{what} {i}"
        )


def _adam_hyper(decoupled, grad_scale, found_inf):
    return dict(
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        decoupled_weight_decay=decoupled,
        maximize=False,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )


@pytest.mark.parametrize("param_dtype", PARAM_DTYPES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_kernel_matches_reference(device, param_dtype, grad_dtype, decoupled):
    # A scale whose reciprocal FP32 cannot hold: the kernel takes it in double.
    scale = torch.tensor(1000.0, device=device)
    found = torch.zeros((), device=device)
    lists = [
        _tensors(param_dtype, device),
        _tensors(grad_dtype, device, scale=1000.0),
        _tensors(param_dtype, device, scale=0.1),
        _tensors(param_dtype, device, scale=0.01, positive=True),
        [torch.tensor(float(t), device=device) for t in (1, 7, 300, 2)],
    ]
    ours, ref = _clones(lists), _clones(lists)
    scaling.adam_step_(*ours, **_adam_hyper(decoupled, scale, found))
    scaling_ref.adam_step_ref_(*ref, **_adam_hyper(decoupled, scale, found))
    # FP32: a few ulps (torch.lerp and the kernel round differently); 16-bit: one ulp.
    rtol = 1e-6 if param_dtype == torch.float32 else 1e-2
    for what, i in (("param", 0), ("exp_avg", 2), ("exp_avg_sq", 3)):
        _assert_close_lists(ours[i], ref[i], what, rtol)
        assert any(not torch.equal(a, b) for a, b in zip(ours[i], lists[i], strict=True))
    _assert_counted_in(ours[4], ref[4], lists[4])


@pytest.mark.parametrize("param_dtype", PARAM_DTYPES)
def test_amsgrad_kernel_matches_reference(device, param_dtype):
    """AMSGrad's maxima: about half of them above the new second moments, so that both
    sides of the maximum are taken."""
    scale = torch.tensor(1000.0, device=device)
    found = torch.zeros((), device=device)
    lists = [
        _tensors(param_dtype, device),
        _tensors(torch.float16, device, scale=1000.0),
        _tensors(param_dtype, device, scale=0.1),
        _tensors(param_dtype, device, scale=0.01, positive=True),
        [torch.tensor(float(t), device=device) for t in (1, 7, 300, 2)],
    ]
    maxima = _tensors(param_dtype, device, scale=0.01, positive=True)
    (*ours, our_max), (*ref, ref_max) = _clones([*lists, maxima]), _clones([*lists, maxima])
    hyper = _adam_hyper(False, scale, found)
    scaling.adam_step_(*ours, max_exp_avg_sqs=our_max, **hyper)
    scaling_ref.adam_step_ref_(*ref, max_exp_avg_sqs=ref_max, **hyper)
    rtol = 1e-6 if param_dtype == torch.float32 else 1e-2
    for what, a, b in (("param", ours[0], ref[0]), ("max_exp_avg_sq", our_max, ref_max)):
        _assert_close_lists(a, b, what, rtol)
    _assert_counted_in(ours[4], ref[4], lists[4])
    raised = [torch.ne(new, old) for new, old in zip(our_max, maxima, strict=True)]
    kept = sum(int((~r).sum()) for r in raised)
    assert 0 < kept < sum(r.numel() for r in raised), "both sides of the maximum taken"
    # Where the maximum rose, it is the new second moment.
    for r, new, v in zip(raised, our_max, ours[3], strict=True):
        assert_same_bits(new[r], v[r], "raised maximum")


def test_amsgrad_keeps_a_nan_as_torch_maximum_does(path_device):
    """A NaN gradient (no scaler to skip the step) reaches the second moment, and
    torch.maximum keeps it in the maximum, where the GPU's max.f32 would drop it: the
    state after the step has torch's Adam's bits, NaNs included (the kernels', and the
    reference path's, whose maximum a torch.fmax would drop it from)."""
    device = path_device
    values = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    values[1, 7] = float("nan")
    runs = []
    for cls in (mpgemm.optim.Adam, torch.optim.Adam):
        p = torch.nn.Parameter(values[0].clone().to(device))
        optimizer = cls([p], lr=0.1, amsgrad=True)
        for grad in values[1:]:
            p.grad = grad.clone().to(device)
            optimizer.step()
        runs.append((p.detach(), optimizer.state[p]))
    (ours, ours_state), (theirs, theirs_state) = runs
    assert ours_state["max_exp_avg_sq"][7].isnan()
    # equal_nan: NaNs at the same positions, the rest to FP32 rounding
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        torch.testing.assert_close(ours_state[key], theirs_state[key], equal_nan=True, msg=key)


@pytest.mark.parametrize("param_dtype", PARAM_DTYPES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_kernel_matches_reference(device, param_dtype, nesterov):
    scale = torch.tensor(3.0, device=device)
    lists = [
        _tensors(param_dtype, device),
        _tensors(torch.bfloat16, device),
        _tensors(param_dtype, device),
    ]
    ours, ref = _clones(lists), _clones(lists)
    hyper = dict(
        lr=0.01,
        momentum=0.9,
        weight_decay=1e-4,
        nesterov=nesterov,
        maximize=True,
        grad_scale=scale,
        found_inf=torch.zeros((), device=device),
    )
    scaling.sgd_step_(*ours, **hyper)
    scaling_ref.sgd_step_ref_(*ref, **hyper)
    rtol = 1e-6 if param_dtype == torch.float32 else 1e-2
    _assert_close_lists(ours[0], ref[0], "param", rtol)
    _assert_close_lists(ours[2], ref[2], "momentum buffer", rtol)


@pytest.mark.parametrize("param_dtype", PARAM_DTYPES)
def test_damped_sgd_kernel_matches_reference(device, param_dtype):
    """With dampening, a buffer's first step (its parameter's count of steps before it
    is 0) takes the gradient undamped, as torch's, and later ones damp it: both in one
    launch, which counts each step in."""
    scale = torch.tensor(3.0, device=device)
    lists = [
        _tensors(param_dtype, device),
        _tensors(torch.float16, device),
        _tensors(param_dtype, device),
        [torch.tensor(float(t), device=device) for t in (0, 1, 0, 8)],
    ]
    ours, ref = _clones(lists), _clones(lists)
    hyper = dict(
        lr=0.01,
        momentum=0.9,
        dampening=0.25,
        weight_decay=0.0,  # (so that a first step's buffer is the gradient itself)
        nesterov=False,
        maximize=False,
        grad_scale=scale,
        found_inf=torch.zeros((), device=device),
    )
    scaling.sgd_step_(*ours[:3], steps=ours[3], **hyper)
    scaling_ref.sgd_step_ref_(*ref[:3], steps=ref[3], **hyper)
    rtol = 1e-6 if param_dtype == torch.float32 else 1e-2
    _assert_close_lists(ours[0], ref[0], "param", rtol)
    _assert_close_lists(ours[2], ref[2], "momentum buffer", rtol)
    # The first steps' buffers are the unscaled gradients themselves.
    for i in (0, 2):
        assert_same_bits(ours[2][i], ours[1][i].to(param_dtype), f"first step's buffer {i}")
    _assert_counted_in(ours[3], ref[3], lists[3])


def _assert_counted_in(steps, ref_steps, before):
    """Each count is one more than before the step (the zero-size parameter's too)."""
    for i, (ours, ref, old) in enumerate(zip(steps, ref_steps, before, strict=True)):
        assert ours.dtype == torch.float32
        assert_same_bits(ours, old + 1, f"step count {i}")
        assert_same_bits(ref, old + 1, f"reference step count {i}")


# A step's function and reference, its float arguments, and the hyperparameters that
# torch's optimizers take as floats or one-element tensors, with their values.
_STEPS = {
    "sgd": (
        scaling.sgd_step_,
        scaling_ref.sgd_step_ref_,
        dict(nesterov=True, maximize=False),
        dict(lr=0.05, momentum=0.9, weight_decay=1e-2),
    ),
    "sgd damped": (
        scaling.sgd_step_,
        scaling_ref.sgd_step_ref_,
        dict(nesterov=False, maximize=True),
        dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-2),
    ),
    "adam": (
        scaling.adam_step_,
        scaling_ref.adam_step_ref_,
        dict(decoupled_weight_decay=True, maximize=False),
        dict(lr=0.05, beta1=0.8, beta2=0.99, eps=1e-3, weight_decay=1e-2),
    ),
    "adam coupled": (
        scaling.adam_step_,
        scaling_ref.adam_step_ref_,
        dict(decoupled_weight_decay=False, maximize=False),
        dict(lr=0.05, beta1=0.8, beta2=0.99, eps=1e-3, weight_decay=1e-2),
    ),
}


@pytest.mark.parametrize("tensor_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(_STEPS))
def test_tensor_hyperparameters_step_as_the_floats_of_their_values(device, name, tensor_dtype):
    """Every hyperparameter torch's optimizers take as a tensor (lr, SGD's momentum,
    dampening and weight decay, Adam's betas, eps and weight decay) steps as the float
    of its value, bit for bit, on the kernels and on the reference; changed in place,
    the next step reads the new value (a table cached by the tensor's identity would
    read the old one). The kernels took lr and the betas from their tensors and the
    others as 0 (a tensor weight decay was no weight decay at all)."""
    kernel, reference, hyper, values = _STEPS[name]
    adam = name.startswith("adam")
    lists = [_tensors(torch.float32, device), _tensors(torch.float16, device, scale=8.0)]
    lists += [
        _tensors(torch.float32, device, scale=0.1, positive=True) for _ in range(2 if adam else 1)
    ]
    scaler = dict(
        grad_scale=torch.tensor(8.0, device=device), found_inf=torch.zeros((), device=device)
    )
    for impl in (kernel, reference):
        run = functools.partial(_three_steps, impl, name, lists, hyper | scaler, device)
        tensors = {k: torch.tensor(v, dtype=tensor_dtype, device=device) for k, v in values.items()}
        first = {k: t.item() for k, t in tensors.items()}  # the tensors' values
        by_tensor = run(functools.partial(_halved_in_place, tensors))
        by_float = run(functools.partial(_halved, first))
        for i, (a, b) in enumerate(zip(by_tensor, by_float, strict=True)):
            for x, y in zip(a, b, strict=True):
                assert_same_bits(x, y, f"{impl.__name__}, list {i}")
        # Each value's change makes a difference, so that one read as another (or as
        # its first value) could not pass.
        for key in values:
            kept = run(functools.partial(_halved, first, fixed=(key,)))
            assert not all(torch.equal(x, y) for x, y in zip(kept[0], by_float[0], strict=True)), (
                f"{impl.__name__}: a change of {key} made no difference"
            )


def _three_steps(impl, name, lists, hyper, device, values_of_step):
    """Three steps of ``impl`` from ``lists``, step i's hyperparameters
    ``values_of_step(i)`` beside ``hyper`` (Adam's and a damped SGD's step counts,
    which the steps advance, from 0)."""
    adam = name.startswith("adam")
    out = _clones(lists)
    count = [torch.zeros((), device=device) for _ in SHAPES]
    for i in range(3):
        counted = dict(steps=count) if "damped" in name else {}
        impl(*out, *([count] if adam else []), **hyper, **values_of_step(i), **counted)
    return out


def _halved_in_place(tensors, i):
    if i:
        for t in tensors.values():
            t.mul_(0.5)  # in place, as torch's LR schedulers change a tensor lr
    return tensors


def _halved(values, i, fixed=()):
    """``values`` halved ``i`` times (exact: as the tensors halved in place), but for
    the keys ``fixed``."""
    return {k: v if k in fixed else v * 0.5**i for k, v in values.items()}


@pytest.mark.parametrize("key", ["lr", "momentum", "weight_decay"])
def test_a_tensor_hyperparameter_must_have_one_element(device, key):
    params = [torch.zeros(4, device=device)]
    hyper = dict(lr=0.1, momentum=0.5, weight_decay=0.1, nesterov=False, maximize=False)
    hyper[key] = torch.ones(2, device=device)
    with pytest.raises(ValueError, match=f"tensor {key} must have one element.*\\(2,\\)"):
        scaling.sgd_step_(
            params, [torch.ones(4, device=device)], [torch.zeros_like(params[0])], **hyper
        )


def test_runs_of_param_groups_take_tensors_as_their_values(device):
    """``groups``' rows (a launch's param groups) may hold tensors, each read as its
    value; a row's own value of a hyperparameter given as a tensor for all, which the
    kernels read for every row, is refused."""

    def step(lr, rows):
        params = [torch.ones(4, device=device), torch.ones(3, device=device)]
        grads = [torch.ones_like(p) for p in params]
        hyper = dict(lr=lr, momentum=0.0, weight_decay=0.0, nesterov=False, maximize=False)
        scaling.sgd_step_(params, grads, None, groups=scaling.ParamGroups(rows, (1, 1)), **hyper)
        return params

    def tensor(value):
        return torch.tensor(value, device=device)

    floats = step(0.1, ({"lr": 0.5, "weight_decay": 0.25}, {"lr": 0.25}))
    assert torch.equal(floats[0], torch.full((4,), 0.375, device=device))  # 1 - 0.5 * 1.25
    assert torch.equal(floats[1], torch.full((3,), 0.75, device=device))
    tensors = step(0.1, ({"lr": tensor(0.5), "weight_decay": tensor(0.25)}, {"lr": tensor(0.25)}))
    assert all(torch.equal(a, b) for a, b in zip(tensors, floats, strict=True))
    with pytest.raises(ValueError, match="a tensor lr is read for every run of parameters"):
        step(tensor(0.1), ({"lr": 0.5}, {}))


# Two param groups each, of tensor hyperparameters (those of torch's optimizers' that
# mpgemm's kernels read as floats), stepped in one launch.
_TENSOR_GROUPS = {
    "sgd": (
        {"momentum": 0.9, "dampening": 0.2, "weight_decay": 0.05},
        {"momentum": 0.5, "dampening": 0.1, "weight_decay": 0.01},
    ),
    "adam": ({"eps": 1e-2, "weight_decay": 0.1}, {"eps": 1e-3, "weight_decay": 0.02}),
    "adamw": ({"eps": 1e-2, "weight_decay": 0.1}, {"eps": 1e-3, "weight_decay": 0.02}),
}


def _train_decaying(model, optimizer, device):
    for batch in _batches(6, device):
        _train(model, optimizer, 1, device, batches=[batch])
        for group in optimizer.param_groups:
            group["weight_decay"].mul_(0.5)  # in place, as a schedule would


@pytest.mark.parametrize("name", sorted(_TENSOR_GROUPS))
def test_tensor_hyperparameters_in_param_groups_step_as_torchs(device, name):
    """torch's optimizers take momentum, dampening, weight decay and eps as tensors too
    (torch.optim.SGD's signature says so for weight_decay): param groups of them, merged
    into one launch, changed in place between steps, step as torch's own."""
    first, second = _TENSOR_GROUPS[name]
    runs = []
    for cls in (CLASSES[name], TORCH_CLASSES[name]):
        model = _mlp(device)
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        groups = [
            {"params": params, **{k: torch.tensor(v, device=device) for k, v in values.items()}}
            for params, values in ((weights, first), (biases, second))
        ]
        optimizer = cls(groups, lr=0.05)
        names, _ = launched_kernels(functools.partial(_train_decaying, model, optimizer, device))
        runs.append([p.detach().clone() for p in model.parameters()])
        if cls is CLASSES[name]:
            assert len(names) == 6, f"not a launch a step for both groups: {names}"
    for p, q, initial in zip(*runs, _mlp(device).parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert (p - initial).abs().max() > 1e-3, "training moved the parameters"


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_tensor_lr_and_betas_track_torch_under_a_schedule(device, name):
    """As in torch, lr (and Adam's betas) may be tensors, which an LR scheduler changes
    in place: the fused optimizer follows torch's over a schedule."""

    initial_lr = 0.05 if name == "sgd" else 1e-2

    def make(cls, params):
        def tensor(value):
            return torch.tensor(value, device=device)

        if name == "sgd":
            return cls(params, lr=tensor(initial_lr), momentum=0.9)
        return cls(params, lr=tensor(initial_lr), betas=(tensor(0.8), tensor(0.99)))

    runs = []
    for cls in (CLASSES[name], TORCH_CLASSES[name]):
        model = _mlp(device)
        optimizer = make(cls, model.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        for _ in range(20):
            _train(model, optimizer, 1, device)
            scheduler.step()
        lr = optimizer.param_groups[0]["lr"]  # still the tensor, filled in place
        assert isinstance(lr, torch.Tensor)
        assert lr.item() == pytest.approx(initial_lr / 16)
        runs.append(list(model.parameters()))
    for p, q, initial in zip(*runs, _mlp(device).parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert (p - initial).abs().max() > 1e-3, "training moved the parameters"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CPU tensor for GPU parameters")
def test_a_cpu_tensor_lr_steps_gpu_parameters_as_its_value():
    """As torch's fused optimizers do, a CPU tensor lr is read on the host: no GPU wait."""
    runs = []
    for lr in (torch.tensor(0.05), torch.tensor(0.05).item()):
        model = _mlp(torch.device("cuda"))
        optimizer = mpgemm.optim.Adam(model.parameters(), lr=lr)
        _train(model, optimizer, 1, torch.device("cuda"))  # builds the state
        batches = _batches(2, torch.device("cuda"))
        torch.cuda.set_sync_debug_mode("error")
        try:
            _train(model, optimizer, 2, torch.device("cuda"), batches=batches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runs.append(list(model.parameters()))
    for p, q in zip(*runs, strict=True):
        assert_same_bits(p.detach(), q.detach(), "CPU tensor lr vs its float")


@pytest.mark.parametrize("param_dtype", PARAM_DTYPES)
def test_found_inf_leaves_every_bit_in_place(device, param_dtype):
    found = torch.ones((), device=device)
    lists = [
        _tensors(param_dtype, device),
        _tensors(torch.float32, device),
        _tensors(param_dtype, device),
        _tensors(param_dtype, device, positive=True),
        [torch.tensor(5.0, device=device) for _ in SHAPES],
    ]
    lists.append(_tensors(param_dtype, device, positive=True))  # AMSGrad's maxima
    before = _clones(lists)
    scaling.adam_step_(*lists[:5], max_exp_avg_sqs=lists[5], **_adam_hyper(True, None, found))
    for dampening in (0.0, 0.5):
        scaling.sgd_step_(
            lists[0],
            lists[1],
            lists[2],
            steps=lists[4],
            lr=0.1,
            momentum=0.9,
            dampening=dampening,
            weight_decay=0.1,
            nesterov=False,
            maximize=False,
            found_inf=found,
        )
    for lst, old in zip(lists, before, strict=True):
        for t, b in zip(lst, old, strict=True):
            assert_same_bits(t, b, "after a skipped step")


@pytest.mark.parametrize("name", ["adam", "sgd"])
@pytest.mark.parametrize(
    "copy_dtypes",
    [(torch.float16, None, torch.float16, None), (torch.float16, None, torch.bfloat16, None)],
    ids=["fp16 copies", "fp16 and bf16 copies"],
)
def test_parameters_with_and_without_copies_share_a_launch(device, name, copy_dtypes):
    """mpgemm.Linear layers' FP32 weights have 16-bit compute copies and their biases
    none (listed as their own copy): one launch per copy dtype steps them all, writes
    each copy from its updated parameter, and leaves no 16-bit bits in a bias."""
    torch.manual_seed(0)
    scale, found = torch.tensor(1024.0, device=device), torch.zeros((), device=device)
    lists = [
        _tensors(torch.float32, device),
        _tensors(torch.float32, device, scale=1024.0),
        _tensors(torch.float32, device, scale=0.1),
        _tensors(torch.float32, device, scale=0.01, positive=True),
        [torch.tensor(float(t), device=device) for t in (1, 7, 300, 2)],
    ]

    def with_copies(lists):
        return lists, [
            p if dtype is None else torch.full_like(p, float("nan"), dtype=dtype)
            for p, dtype in zip(lists[0], copy_dtypes, strict=True)
        ]

    (ours, our_copies), (ref, ref_copies) = with_copies(_clones(lists)), with_copies(_clones(lists))
    hyper = dict(lr=0.01, momentum=0.9, weight_decay=1e-4, nesterov=False, maximize=False)

    def step():
        if name == "adam":
            scaling.adam_step_(*ours, compute_copies=our_copies, **_adam_hyper(False, scale, found))
        else:
            scaling.sgd_step_(*ours[:3], compute_copies=our_copies, **hyper, grad_scale=scale)

    names, _ = launched_kernels(step)
    if name == "adam":
        scaling_ref.adam_step_ref_(
            *ref, compute_copies=ref_copies, **_adam_hyper(False, scale, found)
        )
    else:
        scaling_ref.sgd_step_ref_(*ref[:3], compute_copies=ref_copies, **hyper, grad_scale=scale)
    assert names == [f"_{name}_kernel"] * len(set(copy_dtypes) - {None}), names
    _assert_close_lists(ours[0], ref[0], "param", rtol=1e-6)
    for i, dtype in enumerate(copy_dtypes):
        if dtype is not None:
            assert_same_bits(our_copies[i], ours[0][i].to(dtype), f"copy {i}")


# Spans of several blocks (fused_optim.OPTIMIZER_BLOCK, 2048): a partial last block
# after whole ones, spans that end on a block's end, a tensor of one span's elements
# (two blocks: 4096) and one element past it, a zero-size one that counts its step.
_SPAN_SHAPES = [(5000,), (4096,), (33, 7), (0,), (6145,), (1,)]


def _step_in_spans(name, blocks_per_program, device):
    """A step over _SPAN_SHAPES, each program of the launch stepping
    ``blocks_per_program`` blocks of a tensor: every list it writes, FP16 copies of the
    even-numbered parameters poisoned before (the others their own)."""
    g = torch.Generator().manual_seed(0)

    def rand(scale=1.0, positive=False):
        out = [torch.randn(s, generator=g).mul(scale).to(device) for s in _SPAN_SHAPES]
        return [t.abs() for t in out] if positive else out

    params, grads = rand(), rand(1024.0)
    states = [rand(0.1), rand(0.01, positive=True)]
    # Adam's counts, and SGD's with dampening: first steps (0) and later ones.
    steps = [torch.tensor(float(i % 3), device=device) for i in range(len(_SPAN_SHAPES))]
    copies = [
        torch.full_like(p, float("nan"), dtype=torch.float16) if i % 2 == 0 else p
        for i, p in enumerate(params)
    ]
    scaler = dict(
        grad_scale=torch.tensor(1024.0, device=device),
        found_inf=torch.zeros((), device=device),
    )
    with optimizer_launch_shape(blocks_per_program=blocks_per_program):
        if name == "adam":
            scaling.adam_step_(
                params,
                grads,
                *states,
                steps,
                compute_copies=copies,
                **_adam_hyper(False, scaler["grad_scale"], scaler["found_inf"]),
            )
        else:
            scaling.sgd_step_(
                params,
                grads,
                states[0],
                steps=steps,
                compute_copies=copies,
                lr=0.01,
                momentum=0.9,
                dampening=0.25,
                weight_decay=1e-4,
                nesterov=False,
                maximize=False,
                **scaler,
            )
    return [params, grads, *states, steps, copies]


@pytest.mark.parametrize("name", ["adam", "sgd"])
@pytest.mark.parametrize("blocks_per_program", [2, 3])
def test_programs_of_several_blocks_write_the_bits_of_one_block_a_program(
    device, name, blocks_per_program
):
    """A program steps a span of its tensor a block at a time (the bias corrections and
    the step count's arrival in its first block): every element of every list, the
    copies and the step counts come out as a launch of one block a program writes them,
    which the reference tests check."""
    one = _step_in_spans(name, 1, device)
    several = _step_in_spans(name, blocks_per_program, device)
    for i, (a, b) in enumerate(zip(several, one, strict=True)):
        for j, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_bits(x, y, f"{name}, list {i}, tensor {j}")
    assert not any(t.isnan().any() for t in several[-1]), "a copy left unwritten"
    counts = [float(t) for t in several[-2]]
    assert counts == [float(i % 3 + 1) for i in range(len(_SPAN_SHAPES))]


def test_a_launch_takes_more_blocks_a_program_as_it_grows():
    """The guide MLP's Adam (20M parameters, 9,800 blocks of 2048) takes 4 blocks a
    program on an H100's 132 SMs, 2,448 programs; a small model's one; never above 8."""
    from mpgemm.kernels.tensor_table import blocks_per_program_for

    h100 = torch.device("cpu")  # (a device without SMs of its own counts an H100's)
    guide = sum(-(-n // 2048) for n in (4096 * 784, 4096, 4096 * 4096, 4096, 10 * 4096, 10))
    assert blocks_per_program_for(guide, h100) == 4
    assert blocks_per_program_for(50, h100) == 1
    assert blocks_per_program_for(16 * 132 * 2 - 1, h100) == 1
    assert blocks_per_program_for(16 * 132 * 2, h100) == 2
    assert blocks_per_program_for(10**9, h100) == 8


def test_each_launch_takes_one_parameter_dtype_and_one_copy_dtype(monkeypatch):
    """How the dispatcher groups parameters: one launch per parameter dtype and copy
    dtype, each parameter listed as its own copy joining a launch of its parameter
    dtype; every parameter stepped once."""
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    dtypes = [(f32, f16), (f32, None), (f32, bf16), (bf16, None), (f32, None), (f32, f16)]
    params = [torch.zeros(8, dtype=param) for param, _ in dtypes]
    copies = [
        p if c is None else torch.zeros(8, dtype=c)
        for p, (_, c) in zip(params, dtypes, strict=True)
    ]
    launches = []
    monkeypatch.setitem(
        scaling.kernels(),
        "sgd_step",
        lambda ps, gs, bufs, compute_copies, **hyper: launches.append((ps, compute_copies)),
    )
    with intercept(lambda *launch: None):  # (CPU tensors take the kernel path meanwhile)
        scaling.sgd_step_(
            params,
            [torch.zeros_like(p) for p in params],
            None,
            compute_copies=copies,
            lr=0.1,
            momentum=0.0,
            weight_decay=0.0,
            nesterov=False,
            maximize=False,
        )
    # FP32 with FP16 copies, FP32 with BF16 copies, BF16: the FP32 parameters without a
    # copy go with one of the first two.
    assert len(launches) == 3
    position = {id(p): i for i, p in enumerate(params)}
    stepped = sorted(position[id(p)] for ps, _ in launches for p in ps)
    assert stepped == list(range(len(params)))
    for ps, cs in launches:
        assert len({p.dtype for p in ps}) == 1
        assert len({c.dtype for p, c in zip(ps, cs, strict=True) if c is not p}) <= 1


OPTIMIZERS = {
    "sgd": (
        lambda p: mpgemm.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    ),
    "dampening": (
        lambda p: mpgemm.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-3),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-3),
    ),
    "nesterov": (
        lambda p: mpgemm.optim.SGD(p, lr=0.05, momentum=0.5, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, nesterov=True),
    ),
    "adam": (
        lambda p: mpgemm.optim.Adam(p, lr=1e-2, weight_decay=1e-2),
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2),
    ),
    "adamw": (
        lambda p: mpgemm.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99), maximize=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99), maximize=True),
    ),
    "amsgrad": (
        lambda p: mpgemm.optim.Adam(p, lr=1e-2, betas=(0.8, 0.9), weight_decay=1e-2, amsgrad=True),
        lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.9), weight_decay=1e-2, amsgrad=True),
    ),
}


def _mlp(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3)).to(
        device
    )


def _batches(steps, device, seed=1):
    """``steps`` batches for ``_mlp``, drawn on the CPU (the same on any device) and
    moved to ``device``: a copy from pageable memory waits for the GPU."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(32, 12, generator=g).to(device), torch.randn(32, 3, generator=g).to(device))
        for _ in range(steps)
    ]


def _train(model, optimizer, steps, device, seed=1, batches=None):
    for x, y in batches or _batches(steps, device, seed):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_optimizer_tracks_torch_over_100_steps(device, name):
    ours_make, torch_make = OPTIMIZERS[name]
    ours, theirs = _mlp(device), _mlp(device)
    _train(ours, ours_make(ours.parameters()), 100, device)
    _train(theirs, torch_make(theirs.parameters()), 100, device)
    for p, q, initial in zip(
        ours.parameters(), theirs.parameters(), _mlp(device).parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert (p - initial).abs().max() > 1e-3, "training moved the parameters"


def _param_groups(model, name):
    """A group per parameter, as recipes split them (decay and no-decay, a learning
    rate per layer): each with float hyperparameters of its own, and the flags (Adam's
    amsgrad and maximize, SGD's nonzero momentum and dampening, nesterov) of ``name``'s
    optimizer."""
    floats = (
        [{"betas": (0.8, 0.99), "eps": 1e-6}, {"betas": (0.85, 0.9)}, {}, {"eps": 1e-7}]
        if name in ("adam", "adamw", "amsgrad")
        else [{"momentum": 0.8}, {}, {"momentum": 0.7}, {}]
    )
    rates = [{"lr": 0.03, "weight_decay": 1e-2}, {"lr": 0.01, "weight_decay": 0.0}, {"lr": 0.02}]
    return [
        {"params": [p], **rate, **other}
        for p, rate, other in zip(model.parameters(), [*rates, {}], floats, strict=True)
    ]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_param_groups_that_differ_in_floats_step_in_one_launch(device, name):
    # Each parameter reads its group's values in the kernel (a group took a launch of
    # its own, some 80 us of host time each).
    ours_make, torch_make = OPTIMIZERS[name]
    ours, theirs = _mlp(device), _mlp(device)
    optimizer = ours_make(_param_groups(ours, name))
    names, _ = launched_kernels(lambda: _train(ours, optimizer, 3, device))
    kernel = "_adam_kernel" if name in ("adam", "adamw", "amsgrad") else "_sgd_kernel"
    assert names.count(kernel) == 3, names
    _train(ours, optimizer, 17, device, seed=2)
    reference = torch_make(_param_groups(theirs, name))
    _train(theirs, reference, 3, device)
    _train(theirs, reference, 17, device, seed=2)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_groups_that_differ_in_a_flag_or_read_a_tensor_lr_step_apart(device, monkeypatch):
    # A flag is the kernel's (AMSGrad's maxima, another list); a tensor lr is read from
    # its own tensor. The kernels' steps and the reference's (torch ops, which take one
    # value of each hyperparameter) step the merged groups alike.
    def groups(model):
        a, b, c, d = model.parameters()
        lr = torch.tensor(0.02, device=device)
        return [
            {"params": [a], "lr": 0.03, "amsgrad": True},
            {"params": [b], "lr": 0.01, "weight_decay": 0.1},
            {"params": [c], "lr": lr},
            {"params": [d], "betas": (0.8, 0.9)},
        ]

    runs = []
    for make in (mpgemm.optim.Adam, torch.optim.Adam):
        model = _mlp(device)
        optimizer = make(groups(model), lr=1e-2)
        names, _ = launched_kernels(functools.partial(_train, model, optimizer, 4, device))
        runs.append((model, names))
    (ours, names), (theirs, _) = runs
    assert names.count("_adam_kernel") == 3 * 4, names  # amsgrad, tensor lr, the rest
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    if device.type == "cpu":  # the reference path, where the kernels are interpreted
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        model = _mlp(device)
        _train(model, mpgemm.optim.Adam(groups(model), lr=1e-2), 4, device)
        for p, q in zip(model.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name, defaults, flagged",
    [
        ("Adam", {"weight_decay": 0.1}, {"maximize": True}),
        ("Adam", {"weight_decay": 0.1}, {"decoupled_weight_decay": True}),
        ("AdamW", {}, {"maximize": True}),
        ("SGD", {"momentum": 0.9}, {"maximize": True}),
        ("SGD", {"momentum": 0.9}, {"nesterov": True}),
        ("SGD", {"momentum": 0.9}, {"momentum": 0.0}),
        ("SGD", {"momentum": 0.9}, {"dampening": 0.5}),
    ],
)
def test_a_group_that_differs_in_each_flag_steps_by_its_own(device, name, defaults, flagged):
    # Every flag of the kernels' (a group's launch key, _merge_key): a group with it set
    # otherwise than the rest takes a launch of its own, and steps as torch steps it.
    runs = []
    for library in (mpgemm.optim, torch.optim):
        model = _mlp(device)
        first, *rest = model.parameters()
        groups = [{"params": [first], **flagged}, {"params": rest}]
        optimizer = getattr(library, name)(groups, lr=0.01, **defaults)
        names, _ = launched_kernels(functools.partial(_train, model, optimizer, 4, device))
        runs.append((model, names))
    (ours, names), (theirs, _) = runs
    assert names.count("_sgd_kernel" if name == "SGD" else "_adam_kernel") == 2 * 4, names
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_param_groups_of_mixed_dtypes_split_with_their_values(device):
    # One call over three runs of parameters, FP32 and BF16 mixed: the dtypes split the
    # launch (as the kernels take one dtype each), and each part keeps its parameters'
    # runs (ParamGroups.take); the same bits as a call per run.
    torch.manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]
    params = [torch.randn(300, device=device, dtype=dtype) for dtype in dtypes]
    rows = ({"lr": 0.1, "weight_decay": 0.01}, {"lr": 0.02}, {"lr": 0.05, "eps": 1e-6})
    runs = scaling.ParamGroups(rows, (2, 2, 1))
    hyper = _adam_hyper(True, None, None)  # (each run's lr differs from it)

    def state():
        grads = [torch.randn_like(p) for p in params]
        moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
        # The step counts on the parameters' device, as the optimizers keep them: one
        # launch reads one device's memory.
        steps = [torch.zeros((), device=device) for _ in params]
        return [p.clone() for p in params], grads, *moments, steps

    torch.manual_seed(1)
    merged = state()
    names, _ = launched_kernels(lambda: scaling.adam_step_(*merged, groups=runs, **hyper))
    assert names == ["_adam_kernel", "_adam_kernel"]  # FP32 and BF16
    torch.manual_seed(1)
    apart = state()
    start = 0
    for row, size in zip(runs.rows, runs.sizes, strict=True):
        scaling.adam_step_(*(lst[start : start + size] for lst in apart), **(hyper | row))
        start += size
    names = ("param", "grad", "exp_avg", "exp_avg_sq", "step")
    for name, got_list, want_list in zip(names, merged, apart, strict=True):
        for got, want in zip(got_list, want_list, strict=True):
            assert_same_bits(got, want, name)


def test_state_dict_round_trip_continues_exactly(device):
    ours_make, _ = OPTIMIZERS["adamw"]
    straight = _mlp(device)
    _train(straight, ours_make(straight.parameters()), 20, device)
    resumed = _mlp(device)
    first = ours_make(resumed.parameters())
    _train(resumed, first, 10, device)
    second = ours_make(resumed.parameters())
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    _train(resumed, second, 10, device, seed=2)
    rerun = _mlp(device)
    opt = ours_make(rerun.parameters())
    _train(rerun, opt, 10, device)
    _train(rerun, opt, 10, device, seed=2)
    for p, q in zip(resumed.parameters(), rerun.parameters(), strict=True):
        assert_same_bits(p.detach(), q.detach(), "resumed vs uninterrupted")
    state = second.state_dict()["state"][0]
    assert state["step"].item() == 20.0
    # torch's AdamW reads our state dict.
    torch_opt = torch.optim.AdamW(_mlp(device).parameters())
    torch_opt.load_state_dict(second.state_dict())
    assert torch_opt.state_dict()["state"][0]["step"].item() == 20.0


@pytest.mark.parametrize("dampening", [0.0, 0.5])
def test_sgd_first_step_skipped_then_taken_equals_torchs_first_step(device, dampening):
    """torch's first step takes the gradient as the buffer, undamped; a skipped step
    (torch's scaler does not call step()) is not a first one."""
    params = [torch.nn.Parameter(torch.randn(10, device=device))]
    reference = [torch.nn.Parameter(params[0].detach().clone())]
    hyper = dict(lr=0.1, momentum=0.9, dampening=dampening)
    ours = mpgemm.optim.SGD(params, **hyper)
    params[0].grad = torch.full((10,), float("nan"), device=device)
    ours.found_inf = torch.ones((), device=device)
    ours.step()
    del ours.found_inf
    assert_same_bits(params[0].detach(), reference[0].detach(), "skipped")
    theirs = torch.optim.SGD(reference, **hyper)
    for step in ("first real step", "second"):
        grad = torch.randn(10, device=device)
        params[0].grad, reference[0].grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
        if step == "first real step":
            assert_same_bits(ours.state[params[0]]["momentum_buffer"], grad, "buffer = grad")
        torch.testing.assert_close(params[0], reference[0], rtol=1e-6, atol=1e-7, msg=step)


def test_lr_scheduler_drives_the_fused_optimizer(device):
    model = _mlp(device)
    optimizer = mpgemm.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(4):
        _train(model, optimizer, 1, device)
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


CLASSES = {"sgd": mpgemm.optim.SGD, "adam": mpgemm.optim.Adam, "adamw": mpgemm.optim.AdamW}
TORCH_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


SPARSE_SGD = [
    dict(),
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.9, dampening=0.5, maximize=True),
    dict(weight_decay=0.1),
]


def _sparse_run(device, make_optimizer, make_scaler, hyper, inf_at=None):
    """A sparse embedding's weights and the scales after 4 steps on index batches that
    repeat an index (uncoalesced gradients); the loss squares the rows, so that each
    step's gradient depends on the last step's weights."""
    # CUDA adds a sparse gradient's repeated rows into a dense tensor with atomics
    # (index_add_), in any order, so that torch's own SGD differs from itself run to run
    # there unless deterministic algorithms are asked for (the mismatch seen on the H200).
    with _deterministic():
        return _sparse_steps(device, make_optimizer, make_scaler, hyper, inf_at)


@contextlib.contextmanager
def _deterministic():
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _sparse_steps(device, make_optimizer, make_scaler, hyper, inf_at):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(12, 5, sparse=True, device=device)
    optimizer = make_optimizer(embedding.parameters(), lr=0.1, **hyper)
    wrapped = make_scaler is mpgemm.LossScaleOptimizer
    if wrapped:
        optimizer = mpgemm.LossScaleOptimizer(optimizer, init_scale=2.0**8)
    scaler = make_scaler(device.type, init_scale=2.0**8) if make_scaler and not wrapped else None
    scales = []
    for step in range(4):
        optimizer.zero_grad()
        loss = embedding(torch.tensor([[1, 4, 4], [7, 1, step]], device=device)).pow(2).sum()
        if step == inf_at:
            loss = loss * float("inf")
        if wrapped:
            optimizer.backward(loss)
            optimizer.step()
            scales.append(optimizer.loss_scale)
        elif scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
    return embedding.weight.detach(), scales


@pytest.mark.parametrize("hyper", SPARSE_SGD, ids=str)
def test_sparse_gradients_are_stepped_as_torchs_sgd_steps_them(hyper, device):
    # torch's own implementation steps them (torch's SGD takes sparse gradients), or
    # raises what it raises (weight decay adds a dense tensor to the sparse gradient).
    results = []
    for make in (mpgemm.optim.SGD, torch.optim.SGD):
        try:
            results.append(_sparse_run(device, make, None, hyper)[0])
        except RuntimeError as error:
            results.append(str(error))
    ours, theirs = results
    if isinstance(theirs, str):
        assert ours == theirs and "sparse" in theirs
    else:
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("scaler", [mpgemm.GradScaler, mpgemm.LossScaleOptimizer])
def test_sparse_gradients_under_a_scaler_skip_and_step_as_torchs(scaler, device):
    # mpgemm's scaler (or LossScaleOptimizer) and SGD against torch's, an inf at the
    # second step: the same skips, scales and bits.
    hyper = dict(momentum=0.9)
    ours = _sparse_run(device, mpgemm.optim.SGD, scaler, hyper, inf_at=1)
    theirs = _sparse_run(device, torch.optim.SGD, torch.amp.GradScaler, hyper, inf_at=1)
    assert ours[1] == theirs[1] == [256.0, 128.0, 128.0, 128.0]
    assert torch.equal(ours[0], theirs[0])


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_refuses_sparse_gradients_as_torchs_does(name):
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.ones(3).to_sparse()
    messages = []
    for cls in (CLASSES[name], TORCH_CLASSES[name]):
        with pytest.raises(RuntimeError, match="does not support sparse gradients") as raised:
            cls([p]).step()
        messages.append(str(raised.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("scaler", [None, "grad_scaler", "torch_scaler"])
def test_fp64_and_complex_parameters_are_stepped_as_torch_steps_them(device, name, scaler):
    # What the kernels do not take goes to torch's own implementation, under a scaler
    # too (a step with an inf skipped): the same bits as the torch optimizer, beside an
    # FP32 parameter that the kernel steps. Under torch's scaler (torch_scaler), which
    # sets the scale and the flag on the optimizer and deletes them after its step,
    # mpgemm's optimizer hides them from torch's step and puts them back.
    hyper = {
        "sgd": dict(lr=0.1, momentum=0.9, weight_decay=0.01),
        "adam": dict(lr=0.01, weight_decay=0.01),
        "adamw": dict(lr=0.01),
    }[name]
    torch.manual_seed(0)
    values = [torch.randn(3, 2, dtype=torch.float64, device=device), torch.randn(5, device=device)]
    if scaler is None:  # torch's own scaler does not unscale complex gradients
        values.append(torch.randn(4, dtype=torch.complex64, device=device))
    runs = []
    for cls in (CLASSES[name], TORCH_CLASSES[name]):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        optimizer = cls(params, **hyper)
        ours = cls is CLASSES[name] and scaler == "grad_scaler"
        amp = (
            (mpgemm.GradScaler if ours else torch.amp.GradScaler)(device.type, init_scale=2.0**10)
            if scaler
            else None
        )
        g = torch.Generator().manual_seed(1)
        for step in range(4):
            optimizer.zero_grad()
            scale = amp.scale(torch.ones((), device=device)).item() if amp else 1.0
            for p in params:
                p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype).to(device) * scale
            if step == 2 and amp:
                params[0].grad[0, 0] = float("inf")
            if amp:
                amp.step(optimizer)
                amp.update()
            else:
                optimizer.step()
        runs.append(params)
    for ours, theirs in zip(*runs, strict=True):
        if ours.dtype == torch.float32:  # the kernel's: to FP32 rounding
            torch.testing.assert_close(ours, theirs)
        else:
            assert torch.equal(ours, theirs), ours.dtype
            assert torch.equal(ours.grad, theirs.grad)  # left unscaled, as torch leaves it


@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("kind", ["negative gradient", "negative parameter", "zero gradient"])
def test_tensors_whose_values_are_not_their_memorys_step_as_torch_steps_them(device, name, kind):
    # A negative view's values are its memory's negated (torch._neg_view; the kernels,
    # which read memory, stepped an FP32 parameter off by 0.4 after two Adam steps at
    # lr 0.1); a zero tensor has no memory (a kernel read address 0, and the
    # interpreter's process died of it). Such a position takes torch's implementation,
    # beside a parameter that the kernel steps.
    # torch's for-loop step: its foreach step (a GPU's default) refuses a negative view
    # in the lists it writes.
    hyper = {"sgd": dict(lr=0.1, momentum=0.9), "adam": dict(lr=0.1), "adamw": dict(lr=0.1)}[name]
    torch.manual_seed(0)
    values = [torch.randn(6, 5, device=device), torch.randn(64, device=device)]
    grads = [torch.randn(6, 5, device=device), torch.randn(64, device=device)]
    runs = []
    for cls in (CLASSES[name], TORCH_CLASSES[name]):
        odd = values[1].clone()
        if kind == "negative parameter":
            odd = torch._neg_view(odd.neg())
        params = [torch.nn.Parameter(values[0].clone()), torch.nn.Parameter(odd)]
        assert params[1].is_neg() == (kind == "negative parameter")
        optimizer = cls(params, **hyper, foreach=False)
        for _ in range(2):
            params[0].grad = grads[0].clone()
            params[1].grad = {
                "negative gradient": torch._neg_view(grads[1].neg()),
                "zero gradient": torch._efficientzerotensor(64, device=device),
            }.get(kind, grads[1].clone())
            optimizer.step()
        runs.append([p.detach().resolve_neg() for p in params])
    for ours, theirs in zip(*runs, strict=True):
        torch.testing.assert_close(ours, theirs, msg=kind)


def _odd(value, device):
    """A one-element tensor of ``value`` whose memory is not its value: a negative view
    (memory -value) or, for 0, a zero tensor (no memory)."""
    if value == 0:
        return torch._efficientzerotensor((), device=device)
    return torch._neg_view(torch.tensor(-value, device=device))


@pytest.mark.parametrize("name", list(CLASSES))
def test_tensor_hyperparameters_whose_values_are_not_their_memorys_step_as_torchs(device, name):
    # The kernels read a tensor lr's and betas' memory: a negative-view lr stepped 0.4
    # off torch's after two Adam steps at 0.1, negative-view betas gave NaN, and a zero
    # tensor read address 0. A copy holds the value. Against torch's for-loop step.
    torch.manual_seed(0)
    value, grad = torch.randn(64, device=device), torch.randn(64, device=device)
    cases = [dict(lr=_odd(0.1, device)), dict(lr=_odd(0, device))]
    if name == "sgd":
        cases = [{**case, "momentum": 0.9} for case in cases]
    else:
        cases.append(dict(lr=torch.tensor(0.1), betas=(_odd(0.9, device), _odd(0.999, device))))
        cases.append(dict(lr=torch.tensor(0.1), betas=(_odd(0, device), torch.tensor(0.999))))
    for case in cases:
        runs = []
        for cls in (CLASSES[name], TORCH_CLASSES[name]):
            param = torch.nn.Parameter(value.clone())
            optimizer = cls([param], **case, foreach=False)
            for _ in range(2):
                param.grad = grad.clone()
                optimizer.step()
            runs.append(param.detach())
        torch.testing.assert_close(*runs, msg=str(case))


def test_a_scalers_tensors_whose_values_are_not_their_memorys_are_read_as_their_values(device):
    # The step reads grad_scale and found_inf from memory too: a negative-view scale
    # stepped against the gradient.
    lists = [_tensors(torch.float32, device), _tensors(torch.float16, device, scale=8.0)]
    lists += [_tensors(torch.float32, device, scale=0.1, positive=True) for _ in range(2)]
    steps = [torch.tensor(3.0, device=device) for _ in SHAPES]
    runs = []
    for scale, found in [(_odd(8.0, device), _odd(0, device)), (torch.tensor(8.0), None)]:
        out, counts = _clones(lists), _clones([steps])[0]
        hyper = _adam_hyper(False, scale.to(device), found)
        scaling.adam_step_(*out, counts, **{**hyper, "lr": 0.1})
        runs.append(out)
    for ours, theirs in zip(*runs, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert_same_bits(a, b, "negative-view scale, zero-tensor flag")


@pytest.mark.parametrize("name", list(CLASSES))
def test_an_inference_parameter_is_stepped_only_within_inference_mode(device, name):
    # An inference tensor (made under torch.inference_mode, as a model built or loaded
    # there) keeps no version counter: torch's in-place ops raise for one outside that
    # mode, and so do torch's foreach and for-loop steps (after writing it). The kernels,
    # writing memory, stepped it silently, where the references raised: now the step
    # raises before anything is written. Within the mode it steps as torch's does.
    hyper = dict(lr=0.1, momentum=0.9) if name == "sgd" else dict(lr=0.1)
    torch.manual_seed(0)
    values = [torch.randn(6, 5, device=device), torch.randn(64, device=device)]
    grads = [torch.randn(6, 5, device=device), torch.randn(64, device=device)]

    def optimizer(cls):
        with torch.inference_mode():
            served = values[1].clone()
        params = [torch.nn.Parameter(values[0].clone()), served]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        return cls(params, **hyper, foreach=False), params

    for cls in (CLASSES[name], TORCH_CLASSES[name]):
        refusing, params = optimizer(cls)
        with pytest.raises(RuntimeError, match="inference tensor"):
            refusing.step()
        if cls is CLASSES[name]:  # (torch's wrote the parameters before raising)
            assert all(map(torch.equal, params, values))
    runs = []
    for cls in (CLASSES[name], TORCH_CLASSES[name]):
        stepping, params = optimizer(cls)
        with torch.inference_mode():
            stepping.step()
        runs.append(params)
    for ours, theirs in zip(*runs, strict=True):
        torch.testing.assert_close(ours.detach(), theirs.detach())


def test_the_steps_refuse_to_write_an_inference_tensor_they_would_write(device):
    # Each list a step writes (moments loaded under torch.inference_mode, step counts,
    # gradients it unscales) is asked before anything is written, and named; the
    # gradients, which a step without a scale only reads, may be inference tensors.
    def fresh():
        return [torch.rand(5, device=device) for _ in range(2)]  # (second moments >= 0)

    def lists(inference):
        made = {name: fresh() for name in ("params", "grads", "exp_avgs", "exp_avg_sqs")}
        made["steps"] = [torch.tensor(1.0, device=device) for _ in range(2)]
        with torch.inference_mode():
            made[inference] = [t.clone() for t in made[inference]]
        return made

    hyper = _adam_hyper(False, None, None)
    for name in ("params", "exp_avgs", "exp_avg_sqs", "steps"):
        given = lists(name)
        before = {key: [t.clone() for t in ts] for key, ts in given.items()}
        with pytest.raises(RuntimeError, match=f"adam_step_: {name} holds an inference tensor"):
            scaling.adam_step_(**given, **hyper)
        for key, ts in given.items():  # nothing written
            assert all(map(torch.equal, ts, before[key])), (name, key)
    scaling.adam_step_(**lists("grads"), **hyper)
    scale = torch.tensor(2.0, device=device)
    with pytest.raises(RuntimeError, match="sgd_step_: grads holds an inference tensor"):
        scaling.sgd_step_(fresh(), lists("grads")["grads"], None, grad_scale=scale, lr=0.1)
    buffers = lists("exp_avgs")["exp_avgs"]
    with pytest.raises(RuntimeError, match="sgd_step_: momentum_buffers holds an inference"):
        scaling.sgd_step_(fresh(), fresh(), buffers, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_a_step_count_that_is_a_negative_view_counts_on_as_torchs(device, name):
    # A count the kernels would read, and advance, as its memory (-1 for 1): it is
    # copied into the state once, as one of another dtype or device is. Against torch's
    # for-loop step (its foreach step refuses a negative view in the counts it writes).
    torch.manual_seed(0)
    value, grad = torch.randn(64, device=device), torch.randn(64, device=device)
    runs = []
    for cls in (CLASSES[name], TORCH_CLASSES[name]):
        param = torch.nn.Parameter(value.clone())
        optimizer = cls([param], lr=0.1, foreach=False)
        for step in range(3):
            param.grad = grad.clone()
            optimizer.step()
            if step == 0:
                optimizer.state[param]["step"] = torch._neg_view(torch.tensor(-1.0, device=device))
        runs.append((param.detach(), optimizer.state[param]["step"].item()))
    (ours, count), (theirs, their_count) = runs
    torch.testing.assert_close(ours, theirs)
    assert count == their_count == 3.0


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_a_step_count_that_is_a_zero_tensor_is_refused_as_torchs_step_refuses_it(device, name):
    # A zero tensor has no memory to advance: torch's Adam steps (for-loop, foreach and
    # fused) raise "ZeroTensors are immutable". Its copy counted on from 0, stepping
    # with the first step's bias correction. Now the step raises before it writes.
    torch.manual_seed(0)
    value = torch.randn(64, device=device)
    for cls in (CLASSES[name], TORCH_CLASSES[name]):
        param = torch.nn.Parameter(value.clone())
        optimizer = cls([param], lr=0.1)
        param.grad = torch.randn(64, device=device)
        optimizer.step()
        optimizer.state[param]["step"] = torch._efficientzerotensor((), device=device)
        before = param.detach().clone()
        with pytest.raises(RuntimeError, match="[Zz]ero ?[Tt]ensor"):
            optimizer.step()
        if cls is CLASSES[name]:
            assert_same_bits(param.detach(), before, "a refused step")


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_closure_is_called_with_grad_enabled_and_its_loss_returned_as_torchs(device, name):
    # torch's optimizers take step(closure): it recomputes the loss and gradients (with
    # grad mode on, whatever the caller's), and the step returns its loss.
    torch.manual_seed(0)
    value, x = torch.randn(5, 3, device=device), torch.randn(4, 3, device=device)
    runs = []
    for cls in (CLASSES[name], TORCH_CLASSES[name]):
        param = torch.nn.Parameter(value.clone())
        optimizer = cls([param], lr=0.1, foreach=False)

        def closure(optimizer=optimizer, param=param):
            optimizer.zero_grad()
            loss = (x @ param.t()).square().sum()
            loss.backward()
            return loss

        with torch.no_grad():
            returned = [optimizer.step(closure) for _ in range(3)]
        runs.append((param.detach(), [loss.item() for loss in returned]))
    (ours, our_losses), (theirs, their_losses) = runs
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(our_losses, their_losses)
    assert our_losses[2] < our_losses[0]


@pytest.mark.parametrize("name", list(CLASSES))
def test_torchs_constructor_keywords_are_accepted(name):
    params = [torch.nn.Parameter(torch.ones(3))]
    keywords = dict(foreach=None, fused=None, differentiable=False)
    if name != "sgd":
        keywords["capturable"] = False
    if name == "adam":
        keywords["decoupled_weight_decay"] = False
    # The values torch takes by default, and the ones the fused kernels honour.
    CLASSES[name](params, **keywords)
    CLASSES[name](params, foreach=False, fused=True)
    for refused in (dict(foreach=True), dict(fused=False), dict(differentiable=True)):
        with pytest.raises(ValueError, match=next(iter(refused))):
            CLASSES[name](params, **refused)
    for contradictory in (TORCH_CLASSES[name], CLASSES[name]):  # torch's error, as torch raises it
        with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
            contradictory(params, foreach=True, fused=True)
    # The param groups' options are torch's, capturable kept as given (the step counts
    # live on the parameters' device either way), so that a state dict saved from one
    # loads into the other as the same configuration.
    for given in (
        dict(),
        dict(capturable=True) if name != "sgd" else dict(nesterov=True, momentum=0.9),
    ):
        groups = [
            cls(params, **given).param_groups[0] for cls in (CLASSES[name], TORCH_CLASSES[name])
        ]
        ours, theirs = ({k: v for k, v in group.items() if k != "params"} for group in groups)
        assert ours == theirs


def test_adam_with_decoupled_weight_decay_steps_as_adamw(device):
    steps = []
    for make in (
        lambda ps: mpgemm.optim.Adam(ps, weight_decay=0.1, decoupled_weight_decay=True),
        lambda ps: mpgemm.optim.AdamW(ps, weight_decay=0.1),
    ):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(100, device=device))
        optimizer = make([p])
        p.grad = torch.randn(100, device=device)
        optimizer.step()
        steps.append(p.detach().clone())
    assert_same_bits(steps[0], steps[1], "Adam(decoupled_weight_decay=True) vs AdamW")


_RESUMED = {
    "adam": ("adam", dict(lr=0.1)),
    "adamw": ("adamw", dict(lr=0.1)),
    "adam amsgrad": ("adam", dict(lr=0.1, amsgrad=True)),
    "adamw amsgrad": ("adamw", dict(lr=0.1, amsgrad=True)),
    "sgd dampening": ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.5)),
}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _counts_as_numbers(state_dict: dict) -> dict:
    """``state_dict`` with each step count a Python number, as an older checkpoint (or
    torch's own ``test_load_nontensor_step``) holds it."""
    for state in state_dict["state"].values():
        if "step" in state:
            state["step"] = state["step"].item()
    return state_dict


@pytest.mark.parametrize("counts", ["tensors", "numbers"])
@pytest.mark.parametrize("default", [torch.float32, torch.float64], ids=["", "float64 default"])
@pytest.mark.parametrize("case", list(_RESUMED))
def test_state_dicts_load_both_ways_and_step_on_as_torch(device, case, default, counts):
    """A state dict of ours loads into torch's optimizer and torch's into ours (AMSGrad's
    maxima included; SGD's step counts, which torch's SGD does not keep, ignored by
    torch and not needed from it), and a step after either load goes where torch's own
    would. Under a float64 default dtype torch's Adam keeps its step counts in FP64,
    which ours take as FP32 (once read as FP32 bits, they stepped 0.03 off torch). Step
    counts held as numbers load too (torch's Adam makes tensors of them; a damped SGD
    of ours raised AttributeError at its next step)."""
    name, hyper = _RESUMED[case]
    classes = (CLASSES[name], TORCH_CLASSES[name])
    generator = torch.Generator().manual_seed(0)
    start, *grads = (torch.randn(10, generator=generator).to(device) for _ in range(3))
    finals = {}
    for first in classes:
        for second in classes:
            p = torch.nn.Parameter(start.clone())
            before = first([p], **hyper)
            p.grad = grads[0].clone()
            with _default_dtype(default):
                before.step()
            after = second([p], **hyper)
            # (capturable=True in our state dict once made torch's CPU step assert)
            state_dict = before.state_dict()
            after.load_state_dict(
                _counts_as_numbers(copy.deepcopy(state_dict)) if counts == "numbers" else state_dict
            )
            p.grad = grads[1].clone()
            after.step()
            finals[first, second] = p.detach()
    torch_only = finals[classes[1], classes[1]]
    assert not torch.equal(torch_only, start)
    for (first, second), final in finals.items():
        what = f"{first.__module__} then {second.__module__}"
        torch.testing.assert_close(final, torch_only, rtol=1e-6, atol=1e-7, msg=what)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_param_group_on_two_devices_takes_a_launch_per_device(device, name, fake_second_device):
    """A model split over two GPUs (as a device_map splits one) puts one param group on
    both: each device's parameters step in launches of their own, as torch's fused
    optimizers group them, and as torch's would. The second device is faked here (every
    tensor is on one device); the GPU test below uses two real ones."""
    ours_make, torch_make = OPTIMIZERS[name]
    ours, theirs = _mlp(device), _mlp(device)
    second = {id(p) for p in list(ours.parameters())[2:]}  # the second layer's
    fake_second_device(second, scaling)
    optimizer = ours_make(ours.parameters())
    names, _ = launched_kernels(lambda: _train(ours, optimizer, 3, device))
    _train(theirs, torch_make(theirs.parameters()), 3, device)
    assert names.count(f"_{name}_kernel") == 2 * 3, names
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a parameter on the GPU")
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_parameters_on_the_cpu_and_the_gpu_step_as_torchs(name, monkeypatch):
    """One param group on two devices, under a scaler on the GPU: each device's
    parameters get the scale and flag on their device. Torch's scaler copies them to
    the CPU asynchronously and reads them at once, a race (pytorch/pytorch#176429 has
    it in FSDP's scaler) that made ours step CPU parameters wrongly on a loaded H200
    until ``grad_scaler._copy_to``: torch's copies are waited for here, so that the
    reference is torch's arithmetic without its race."""
    replicator = torch.amp.grad_scaler._MultiDeviceReplicator
    torch_get = replicator.get

    def landed(self, device):
        copy = torch_get(self, device)
        torch.cuda.synchronize()
        return copy

    monkeypatch.setattr(replicator, "get", landed)
    ours_make, torch_make = OPTIMIZERS[name]
    runs = []
    for make, scaler_class in ((ours_make, mpgemm.GradScaler), (torch_make, torch.amp.GradScaler)):
        model = _mlp("cpu")
        model[0].cuda()  # the first layer on the GPU, the rest on the CPU
        optimizer, scaler = make(model.parameters()), scaler_class("cuda", init_scale=2.0**8)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(32, 12, generator=g), torch.randn(32, 3, generator=g)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model[1:](model[0](x.cuda()).cpu()), y)
            scaler.scale(loss.cuda()).backward()
            scaler.step(optimizer)
            scaler.update()
        runs.append(list(model.parameters()))
    for p, q in zip(*runs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_one_launch_over_two_devices_raises_value_error(device, monkeypatch, fake_second_device):
    """A kernel reads one device's memory: tensors on two reach no launch (the second
    device faked, as above; on a GPU a pointer into another's memory would fault)."""
    from mpgemm.kernels import tensor_table

    grads = [torch.ones(5, device=device), torch.ones(7, device=device)]
    fake_second_device({id(grads[1])}, tensor_table)
    monkeypatch.setattr(tensor_table, "_cache", type(tensor_table._cache)())  # (built anew)
    with pytest.raises(ValueError, match="one launch's tensors are on"):
        with intercept(lambda *launch: None):  # (CPU tensors take the kernel path)
            scaling.unscale_(grads, torch.zeros((), device=device), torch.ones((), device=device))


def _versions(lists):
    return [[t._version for t in lst] for lst in lists]


@pytest.mark.parametrize("grad_scale", [None, 4.0], ids=["unscaled", "scaled"])
def test_each_op_bumps_the_version_of_what_it_writes_and_nothing_else(device, grad_scale):
    """As torch's in-place ops (its fused optimizers' and AMP's included) do, so that
    autograd refuses a saved tensor a step has changed: the parameters, their copies
    and the optimizer state; the gradients where a scale is divided out of them; the
    flag, the scale and its tracker. A tensor only read keeps its version."""
    scale = None if grad_scale is None else torch.full((), grad_scale, device=device)
    found = torch.zeros((), device=device)
    params, grads, avgs = (_tensors(torch.float32, device) for _ in range(3))
    sqs, maxima = (_tensors(torch.float32, device, positive=True) for _ in range(2))
    copies = [p.half() for p in params[:2]] + params[2:]  # two copies; two own
    steps = [torch.zeros((), device=device) for _ in SHAPES]
    written = [params, avgs, sqs, maxima, steps, copies[:2]]
    read = [grads] if scale is None else []
    before = _versions(written + read)
    scaling.adam_step_(
        params,
        grads,
        avgs,
        sqs,
        steps,
        compute_copies=copies,
        max_exp_avg_sqs=maxima,
        **_adam_hyper(False, scale, found),
    )
    after = _versions(written + read)
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        if i < len(written):
            assert all(n > o for o, n in zip(old, new, strict=True)), i
        else:
            assert new == old, "read only"
    if scale is not None:
        assert all(g._version > 0 for g in grads)
    buffers = _tensors(torch.float32, device)
    before = _versions([params, buffers, grads])
    scaling.sgd_step_(
        params,
        grads,
        buffers,
        lr=0.1,
        momentum=0.9,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        maximize=False,
        grad_scale=scale,
        found_inf=found,
    )
    (p0, b0, g0), (p1, b1, g1) = before, _versions([params, buffers, grads])
    assert all(n > o for o, n in zip(p0 + b0, p1 + b1, strict=True))
    assert (g1 == g0) == (scale is None)
    # Unscale: the gradients it writes and the flag; a check alone writes the flag only.
    flag_version, grad_versions = found._version, _versions([grads])[0]
    scaling.unscale_(grads, found, None)
    assert _versions([grads])[0] == grad_versions and found._version > flag_version
    scaling.unscale_(grads, found, torch.ones((), device=device))
    assert all(n > o for o, n in zip(grad_versions, _versions([grads])[0], strict=True))
    scale = torch.ones((), device=device)
    tracker = torch.zeros((), device=device, dtype=torch.int32)
    versions = scale._version, tracker._version, found._version
    scaling.update_scale_(scale, tracker, found, 2.0, 0.5, 10)
    assert scale._version > versions[0] and tracker._version > versions[1]
    assert found._version == versions[2]  # read, not cleared


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("layer", ["nn.Linear", "mpgemm.Linear"])
def test_a_graph_saved_before_a_fused_step_refuses_its_backward_as_torchs(device, name, layer):
    """A backward through weights that an optimizer step changed since the forward saved
    them (a GAN's discriminator stepped before the generator's backward through it)
    raises torch's "modified by an inplace operation", as under torch's optimizers: the
    fused step bumps the versions of the weights and of the 16-bit copies the layers
    saved. Without the bumps the backward ran on the new weights without a word."""
    torch.manual_seed(0)
    make = torch.nn.Linear if layer == "nn.Linear" else mpgemm.Linear
    model = make(8, 4, device=device)
    optimizer = {
        "sgd": lambda ps: mpgemm.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adam": lambda ps: mpgemm.optim.Adam(ps, lr=0.1),
        "adamw": lambda ps: mpgemm.optim.AdamW(ps, lr=0.1),
    }[name](model.parameters())
    x = torch.randn(5, 8, device=device, requires_grad=True)
    out = model(x).float().sum()
    out.backward(retain_graph=True)
    optimizer.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()
