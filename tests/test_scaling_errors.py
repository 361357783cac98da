"""Every misuse of the scaler gets a clear error, as torch's GradScaler gives."""

import pickle

import pytest
import torch

import mpgemm
from mpgemm import scaling


def _setup(device, dtype=torch.float32):
    param = torch.nn.Parameter(torch.randn(4, 3, device=device, dtype=dtype))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = mpgemm.GradScaler(device.type)
    param.grad = scaler.scale(torch.randn(4, 3, device=device)).to(dtype)
    return param, optimizer, scaler


def test_unscale_twice_or_after_step_raises(device):
    _, optimizer, scaler = _setup(device)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(optimizer)
    scaler.update()
    scaler.unscale_(optimizer)  # a new iteration after update()


def test_fp16_gradients_are_refused_naming_the_parameter(device):
    param, optimizer, scaler = _setup(device, torch.float16)
    with pytest.raises(ValueError, match=r"FP16 gradients.*\[0\]\['params'\]\[0\].*\(4, 3\)"):
        scaler.unscale_(optimizer)
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.step(optimizer)


@pytest.mark.parametrize("error", [RuntimeError, AssertionError])
def test_use_before_scale_and_update_without_checks_raise(device, error):
    """RuntimeErrors that are AssertionErrors too, which torch's GradScaler raises for
    these (its asserts), so that code catching either sees them."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.randn(2, device=device))], lr=1)
    scaler = mpgemm.GradScaler(device.type)
    for call in (lambda: scaler.unscale_(optimizer), lambda: scaler.step(optimizer), scaler.update):
        with pytest.raises(error, match="scaler.scale"):
            call()
    scaler.scale(torch.ones(()))
    with pytest.raises(error, match="No inf checks were recorded prior to update"):
        scaler.update()
    with pytest.raises(error, match="No inf checks were recorded for this optimizer"):
        scaler.step(optimizer)  # no parameter has a gradient


def test_closure_and_bad_outputs_raise(device):
    param, optimizer, scaler = _setup(device)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(optimizer, closure=lambda: 0.0)
    with pytest.raises(ValueError, match="iterable of Tensors, got int"):
        scaler.scale([torch.ones(1), 3])
    with pytest.raises(ValueError, match="got str"):
        scaler.scale("loss")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(growth_factor=1.0), "growth factor"),
        (dict(backoff_factor=1.0), "backoff factor"),
        (dict(backoff_factor=0.0), "backoff factor"),
        (dict(growth_interval=0), "growth_interval"),
    ],
)
def test_invalid_factors_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mpgemm.GradScaler("cpu", **kwargs)
    if "factor" in match:  # torch asserts its factors
        with pytest.raises(AssertionError, match=match):
            mpgemm.GradScaler("cpu", **kwargs)


def test_bad_new_scale_and_empty_state_dict(device):
    _, optimizer, scaler = _setup(device)
    scaler.step(optimizer)
    with pytest.raises(ValueError, match="one element"):
        scaler.update(new_scale=torch.ones(2, device=device))
    with pytest.raises(ValueError, match="must not require grad"):
        scaler.update(new_scale=torch.ones((), device=device, requires_grad=True))
    with pytest.raises(TypeError, match="float or a one-element tensor"):
        scaler.update(new_scale="2.0")
    with pytest.raises(ValueError, match="new_scale is on meta"):
        scaler.update(new_scale=torch.ones((), device="meta"))
    with pytest.raises(RuntimeError, match="source state dict is empty"):
        scaler.load_state_dict({})


def test_pickling_mid_iteration_raises(device):
    _, optimizer, scaler = _setup(device)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="pickled"):
        pickle.dumps(scaler)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_cuda_scaler_without_cuda_warns_and_disables():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = mpgemm.GradScaler("cuda")
    assert not scaler.is_enabled()


@pytest.mark.parametrize(
    "name, value, error, match",
    [
        ("found_inf", torch.zeros((), dtype=torch.float64), TypeError, "float32"),
        ("found_inf", torch.zeros((), dtype=torch.int32), TypeError, "float32"),
        ("found_inf", torch.zeros(2), ValueError, "one element"),
        ("found_inf", 0.0, TypeError, "tensor"),
        ("inv_scale", 0.5, TypeError, "tensor"),  # crashed the interpreter before
        ("inv_scale", torch.full((), 0.5, dtype=torch.float64), TypeError, "float32"),
        ("inv_scale", torch.full((2,), 0.5), ValueError, "one element"),
    ],
)
def test_unscale_checks_its_flag_and_scale_as_torch_does(device, name, value, error, match):
    from mpgemm.scaling import unscale_

    grads = [torch.ones(5, device=device)]
    args = {
        "found_inf": torch.zeros((), device=device),
        "inv_scale": torch.full((), 0.5, device=device),
    }
    args[name] = value.to(device) if torch.is_tensor(value) else value
    with pytest.raises(error, match=f"{name}.*{match}"):
        unscale_(grads, args["found_inf"], args["inv_scale"])
    assert torch.equal(grads[0], torch.ones(5, device=device))  # nothing was written


def test_unscale_checks_its_lists(device):
    from mpgemm.scaling import unscale_

    flag, inv = torch.zeros((), device=device), torch.full((), 0.5, device=device)
    with pytest.raises(TypeError, match="src"):
        unscale_([None], flag, inv)
    with pytest.raises(ValueError, match="dst"):
        unscale_([torch.ones(5, device=device)], flag, inv, dst=[torch.ones(4, device=device)])


def test_an_optimizer_step_refuses_lists_of_different_lengths(device):
    # Its kernel's table is laid out from the first list: a shorter one must not reach it.
    params = [torch.zeros(5, device=device) for _ in range(2)]
    grads = [torch.ones(5, device=device) for _ in range(2)]
    with pytest.raises(ValueError, match="one length"):
        scaling.sgd_step_(
            params,
            grads[:1],
            None,
            lr=0.1,
            momentum=0.0,
            weight_decay=0.0,
            nesterov=False,
            maximize=False,
            grad_scale=None,
            found_inf=None,
        )
    assert all(torch.equal(p, torch.zeros(5, device=device)) for p in params)


@pytest.mark.parametrize(
    "op, name, position",
    [
        ("sgd_step_", "grads", 1),
        ("sgd_step_", "momentum_buffers", 2),
        ("adam_step_", "grads", 1),
        ("adam_step_", "exp_avgs", 2),
        ("adam_step_", "exp_avg_sqs", 3),
    ],
)
@pytest.mark.parametrize("shape", [(1,), (5, 1), (4,)], ids=["broadcast", "same size", "fewer"])
def test_an_optimizer_step_refuses_lists_of_other_shapes(device, op, name, position, shape):
    # A (1,)-shaped gradient would broadcast over its parameter in the reference's torch
    # ops, and the kernels walk a position's tensors as flat memory of one size: named
    # here, with nothing stepped.
    params = [torch.zeros(5, device=device), torch.zeros(2, 3, device=device)]
    lists = [params] + [[torch.ones_like(p) for p in params] for _ in range(3)]
    lists[position] = [torch.ones(shape, device=device), lists[position][1]]
    step = [torch.zeros((), device=device) for _ in params]
    hyper = dict(lr=0.1, weight_decay=0.0, maximize=False, grad_scale=None, found_inf=None)
    with pytest.raises(ValueError, match=f"{op}: the shapes of {name} must be those of params"):
        if op == "sgd_step_":
            scaling.sgd_step_(*lists[:3], momentum=0.9, nesterov=False, **hyper)
        else:
            hyper.update(beta1=0.9, beta2=0.999, eps=1e-8, decoupled_weight_decay=False)
            scaling.adam_step_(*lists[:4], step, **hyper)
    assert not any(p.any() for p in params)


@pytest.mark.parametrize(
    "op, name",
    [
        ("sgd_step_", "params"),
        ("sgd_step_", "grads"),
        ("sgd_step_", "momentum_buffers"),
        ("sgd_step_", "compute_copies"),
        ("sgd_step_", "steps"),
        ("adam_step_", "params"),
        ("adam_step_", "grads"),
        ("adam_step_", "exp_avgs"),
        ("adam_step_", "exp_avg_sqs"),
        ("adam_step_", "max_exp_avg_sqs"),
        ("adam_step_", "compute_copies"),
        ("adam_step_", "steps"),
    ],
)
@pytest.mark.parametrize("item", [0.0, None], ids=["number", "None"])
def test_an_optimizer_step_refuses_lists_of_other_than_tensors(path_device, op, name, item):
    # As torch's foreach and fused ops do (a TypeError), naming the list and the entry,
    # where a list holding a number once failed with an AttributeError.
    device = path_device
    params = [torch.zeros(5, device=device), torch.zeros(3, device=device)]
    lists = {
        "params": params,
        "grads": [torch.ones_like(p) for p in params],
        "compute_copies": [p.clone() for p in params],
        "steps": [torch.zeros((), device=device) for _ in params],
    }
    if op == "sgd_step_":
        lists["momentum_buffers"] = [torch.zeros_like(p) for p in params]
    else:
        for moments in ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
            lists[moments] = [torch.zeros_like(p) for p in params]

    def step(lists):
        hyper = dict(lr=0.1, weight_decay=0.0, maximize=False)
        if op == "sgd_step_":
            scaling.sgd_step_(**lists, momentum=0.9, dampening=0.5, nesterov=False, **hyper)
        else:
            hyper.update(beta1=0.9, beta2=0.999, eps=1e-8, decoupled_weight_decay=False)
            scaling.adam_step_(**lists, **hyper)

    message = f"{op}: {name} must be a sequence of tensors, got {type(item).__name__} at index 1"
    with pytest.raises(TypeError, match=message):
        step({**lists, name: [lists[name][0], item]})
    assert not any(p.any() for p in params)
    step(lists)  # the same call with tensors throughout
    assert all(p.any() for p in params)


def test_each_op_names_its_kernel_and_reference_in_one_table():
    # An explicit table, not names built from strings: each op's two implementations
    # take the same parameters, so either serves a call.
    import inspect

    pytest.importorskip("triton")
    assert (
        set(scaling.kernels())
        == set(scaling.REFERENCES)
        == {"unscale", "update_scale", "sgd_step", "adam_step"}
    )
    for op, reference in scaling.REFERENCES.items():
        kernel = scaling.kernels()[op]
        assert list(inspect.signature(kernel).parameters) == list(
            inspect.signature(reference).parameters
        ), op


@pytest.mark.parametrize(
    "counter",
    [torch.zeros((), dtype=torch.int32), torch.zeros(2, dtype=torch.int64)],
    ids=["int32", "two elements"],
)
def test_scale_update_refuses_a_bad_skip_counter(device, counter):
    scale, tracker = torch.ones((), device=device), torch.zeros((), dtype=torch.int32)
    with pytest.raises(ValueError, match="skipped_steps must be a one-element int64"):
        scaling.update_scale_(
            scale,
            tracker.to(device),
            torch.zeros((), device=device),
            2.0,
            0.5,
            2000,
            skipped_steps=counter.to(device),
        )


@pytest.mark.parametrize("name", ["scale", "growth_tracker", "found_inf", "skipped_steps"])
@pytest.mark.parametrize("value", [1.0, [1.0]], ids=["number", "list"])
def test_scale_update_takes_tensors(device, name, value):
    # torch's op refuses a number for a tensor argument with a TypeError.
    tensors = dict(
        scale=torch.ones((), device=device),
        growth_tracker=torch.zeros((), dtype=torch.int32, device=device),
        found_inf=torch.zeros((), device=device),
    )
    skipped = torch.zeros((), dtype=torch.int64, device=device)
    arguments = {**tensors, "skipped_steps": skipped, name: value}
    with pytest.raises(TypeError, match=f"update_scale_: {name} must be a tensor, got"):
        scaling.update_scale_(**arguments, growth_factor=2.0, backoff_factor=0.5, growth_interval=1)
    assert tensors["scale"].item() == 1.0 and skipped.item() == 0


def test_a_damped_sgd_step_needs_the_step_counts(device):
    # They tell each buffer's first step, which torch takes undamped.
    params = [torch.zeros(5, device=device)]
    with pytest.raises(ValueError, match="dampening needs the parameters' step counts"):
        scaling.sgd_step_(
            params,
            [torch.ones(5, device=device)],
            [torch.zeros(5, device=device)],
            lr=0.1,
            momentum=0.9,
            dampening=0.5,
            weight_decay=0.0,
            nesterov=False,
            maximize=False,
        )
    assert torch.equal(params[0], torch.zeros(5, device=device))


@pytest.mark.parametrize("op", ["sgd_step_", "adam_step_"])
def test_an_optimizer_step_refuses_step_counts_it_cannot_read(path_device, op):
    # Each count is read as one FP32 value, by the kernels as its bits: an FP64 count (as
    # torch's Adam keeps them under a float64 default dtype) was read as another number.
    device = path_device
    params = [torch.zeros(5, device=device), torch.zeros(3, device=device)]

    def step(counts):
        lists = [params, *([torch.ones_like(p) for p in params] for _ in range(3))]
        hyper = dict(lr=0.1, weight_decay=0.0, maximize=False)
        if op == "sgd_step_":
            scaling.sgd_step_(
                *lists[:3], steps=counts, momentum=0.9, dampening=0.5, nesterov=False, **hyper
            )
        else:
            hyper.update(beta1=0.9, beta2=0.999, eps=1e-8, decoupled_weight_decay=False)
            scaling.adam_step_(*lists[:4], counts, **hyper)

    fp32 = torch.zeros((), device=device)
    with pytest.raises(TypeError, match=f"{op}: the step counts .* float32, got torch.float64"):
        step([fp32, torch.zeros((), dtype=torch.float64, device=device)])
    with pytest.raises(ValueError, match=f"{op}: each step count .* one element"):
        step([fp32, torch.zeros(2, device=device)])
    assert not any(p.any() for p in params)
    step([fp32, torch.zeros(1, device=device)])  # one element, of any shape
    assert all(p.any() for p in params)
