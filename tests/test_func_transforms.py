"""torch.func's transforms over mpgemm's layers: per-sample gradients (vmap of grad),
model ensembles (vmap over stacked parameters), grad, vjp and jacrev, their forward
through the kernels. Each is held to
what the same computation gives without the transform: the eager layer per sample or
per model (itself held to FP64 elsewhere), or FP64 where the transform's math is
torch's own."""

import copy

import pytest
import torch
from torch import nn
from torch.autograd import forward_ad
from torch.func import functional_call, grad, jacrev, stack_module_state, vjp, vmap

import mpgemm
from mpgemm.reference import torch_activation
from tests.accuracy import assert_within_torch_error, away_from_relu_kink, launched_kernels

# The GEMM's two kernels: pointer or TMA, by the operands.
GEMM_KERNELS = {"_gemm_kernel", "_gemm_tma_kernel"}


def mlp(device, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(33, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10)
    ).to(device, dtype)


def converted(device, seed=0):
    return mpgemm.convert(mlp(device, seed))


def test_per_sample_gradients_are_each_samples_own_backward(device):
    """vmap(grad(loss)) over a batch, the parameters shared: each sample's gradients
    within twice the error (against FP64) of that sample's own eager backward."""
    model = converted(device)
    exact_model = mlp(device, dtype=torch.float64)
    x = torch.randn(6, 33, device=device)
    y = torch.randint(0, 10, (6,), device=device)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(params, xi, yi):
        logits = functional_call(model, params, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, yi.unsqueeze(0))

    kernels, per_sample = launched_kernels(
        lambda: vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    )
    # The forward's three GEMMs, the samples as rows (the backward runs as torch ops).
    assert len(kernels) == 3 and set(kernels) <= GEMM_KERNELS, kernels
    assert all(p.grad is None for p in model.parameters())  # functional: nothing kept
    assert per_sample.keys() == params.keys()
    for i in range(len(x)):
        for net, xi in ((model, x[i : i + 1]), (exact_model, x[i : i + 1].double())):
            net.zero_grad()
            nn.functional.cross_entropy(net(xi), y[i : i + 1]).backward()
        eager = dict(model.named_parameters())
        for name, exact in exact_model.named_parameters():
            got = per_sample[name][i]
            assert got.dtype == torch.float32, name  # the masters' dtype, as eager
            assert_within_torch_error(got, exact.grad, eager[name].grad, f"sample {i} {name}")


def test_an_ensemble_runs_under_vmap_over_stacked_parameters(device):
    """stack_module_state + vmap(functional_call): each model's output within twice
    the error (against FP64) of its own eager forward (the batched GEMMs run as torch
    ops on the same 16-bit operands)."""
    models = [converted(device, seed) for seed in range(3)]
    params, buffers = stack_module_state(models)
    skeleton = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(5, 33, device=device)

    def forward(params, buffers, x):
        return functional_call(skeleton, (params, buffers), (x,))

    kernels, out = launched_kernels(lambda: vmap(forward, in_dims=(0, 0, None))(params, buffers, x))
    assert len(kernels) == 9 and set(kernels) <= GEMM_KERNELS, kernels  # a model at a time
    assert out.shape == (3, 5, 10) and out.dtype == torch.float32  # FP32 logits
    for seed, (model, got) in enumerate(zip(models, out, strict=True)):
        exact = mlp(device, seed, dtype=torch.float64)(x.double())
        assert_within_torch_error(got, exact, model(x), f"model {seed}")


def test_grad_runs_the_forward_kernels_and_tracks_the_backward(device):
    """grad alone hands the forward plain tensors: the kernels run it, as eagerly. Its
    backward sees the transform's wrapped tensors and runs as torch ops, the same
    roundings: the input's gradient within twice the eager backward's error."""
    model = converted(device)
    x = torch.randn(7, 33, device=device)
    kernels, got = launched_kernels(lambda: grad(lambda t: model(t).sum())(x))
    # The three layers' forward GEMMs, and nothing of the backward.
    assert len(kernels) == 3 and set(kernels) <= GEMM_KERNELS, kernels
    eager, exact = x.clone().requires_grad_(), x.double().requires_grad_()
    model(eager).sum().backward()
    mlp(device, dtype=torch.float64)(exact).sum().backward()
    assert_within_torch_error(got, exact.grad, eager.grad, "input gradient")


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
def test_jacrev_and_vjp_of_linear_match_the_reference(device, activation):
    """jacrev (vmap over vjp) and vjp of ``mpgemm.linear`` against the same of
    ``mpgemm.linear_ref`` (torch ops, whose derivative autograd takes: the same rounded
    operands, FP32 sums) and against the eager backward."""
    x = torch.randn(2, 12, device=device)
    w = torch.randn(9, 12, device=device)
    b = torch.randn(9, device=device)
    kw = dict(activation=activation, out_dtype=torch.float32)

    def ours(x, w, b):
        return mpgemm.linear(x, w, b, **kw)

    def ref(x, w, b):
        return mpgemm.linear_ref(x, w, b, **kw)

    got, want = (jacrev(f, argnums=(0, 1, 2))(x, w, b) for f in (ours, ref))
    for name, g, r in zip("xwb", got, want, strict=True):
        # The reference's backward does not round dZ to 16 bits; ours does.
        torch.testing.assert_close(g, r, rtol=2e-3, atol=2e-3, msg=name)
    out, pull = vjp(ours, x, w, b)
    cotangent = torch.randn_like(out)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    ours(*leaves).backward(cotangent)
    for name, g, leaf in zip("xwb", pull(cotangent), leaves, strict=True):
        # The eager backward's math as torch ops (summed in another order).
        torch.testing.assert_close(g, leaf.grad, msg=name)


def test_vmap_of_matmul_over_either_operand(device):
    a = torch.randn(4, 5, 12, device=device)
    b = torch.randn(3, 12, 7, device=device)
    for got, want in (
        (vmap(lambda t: mpgemm.matmul(t, b[0]))(a), [mpgemm.matmul(t, b[0]) for t in a]),
        (vmap(lambda t: mpgemm.matmul(a[0], t))(b), [mpgemm.matmul(a[0], t) for t in b]),
    ):
        assert got.dtype == torch.float16
        torch.testing.assert_close(got, torch.stack(want), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("transform", ["grad of grad", "jacrev of jacrev"])
def test_nested_transforms_differentiate_the_backward(device, transform):
    """Nested transforms differentiate the backward, whose tensors they wrap (the
    reference path's torch ops): as the same transforms of the FP64 model, within twice
    the error of autocast's (FP16); a trial of once-differentiable backwards gave all
    zeros here. Nothing of theirs is kept (the weight copies: once kept, every later
    transform failed on a tensor of a level gone), so first-order transforms still work
    after."""
    model, exact_model, torch_model = (
        converted(device),
        mlp(device, dtype=torch.float64),
        mlp(device),
    )
    x = torch.randn(33, device=device)

    def f(model, t, autocast=False):
        with torch.autocast(device.type, dtype=torch.float16, enabled=autocast):
            return model(t).float().pow(2).sum()

    def nested(f):
        if transform == "grad of grad":
            return grad(lambda t: grad(f)(t).sum())
        return jacrev(jacrev(f))

    got = nested(lambda t: f(model, t))(x)
    expected = nested(lambda t: f(exact_model, t))(x.double())
    autocast = nested(lambda t: f(torch_model, t, autocast=True))(x)
    assert_within_torch_error(got, expected, autocast, transform)
    assert expected.abs().max() > 0
    eager = x.clone().requires_grad_()
    f(model, eager).backward()
    for first_order in (
        grad(lambda t: f(model, t))(x),
        jacrev(lambda t: f(model, t))(x),
        vmap(grad(lambda t: f(model, t)))(x.expand(2, -1))[1],
    ):
        # Under vmap the forward runs as torch ops: a 16-bit activation may round the
        # other way (one FP16 ulp is 1e-3 of it).
        torch.testing.assert_close(first_order, eager.grad, rtol=5e-3, atol=1e-4)


FORWARD_MODE = {
    "jvp": lambda f, x, v: torch.func.jvp(f, (x,), (v,))[1],
    "jacfwd": lambda f, x, v: torch.func.jacfwd(f)(x),
    "hessian": lambda f, x, v: torch.func.hessian(lambda t: f(t).float().pow(2).sum())(x),
    "dual numbers": lambda f, x, v: _dual_tangent(f, x, v),
}


def _dual_tangent(f, x, v):
    """f's tangent at x along v by eager forward-mode AD (``torch.autograd.forward_ad``)."""
    with forward_ad.dual_level():
        return forward_ad.unpack_dual(f(forward_ad.make_dual(x, v))).tangent


@pytest.mark.parametrize("transform", list(FORWARD_MODE))
def test_forward_mode_ad_matches_fp64_within_autocasts_error(device, transform):
    """Forward-mode AD through the layers (their ``jvp`` rules: each product of
    rounded operands in FP32, as the forward's) and, for the hessian (forward over
    reverse), through the recorded backward: as the FP64 model's, within twice the
    error of autocast's (FP16)."""
    model, exact_model, torch_model = (
        converted(device),
        mlp(device, dtype=torch.float64),
        mlp(device),
    )
    x, v = torch.randn(2, 33, device=device), torch.randn(2, 33, device=device)
    if transform in ("jacfwd", "hessian"):
        x = x[0]

    def autocast(t):
        with torch.autocast(device.type, dtype=torch.float16):
            return torch_model(t)

    apply = FORWARD_MODE[transform]
    got = apply(model, x, v)
    expected = apply(exact_model, x.double(), v.double())
    assert_within_torch_error(got, expected, apply(autocast, x, v), transform)
    assert expected.abs().max() > 0


@pytest.mark.parametrize("activation", [None, "relu", "silu"])
def test_a_layers_tangent_in_its_input_weight_and_bias(device, activation):
    """``linear``'s jvp with tangents for x, W and b at once (the activation's node adds
    the bias's, which the GEMMs' node has detached): as FP64's, within twice autocast's
    error."""
    x, w, b = (torch.randn(*shape, device=device) for shape in ((4, 16), (8, 16), (8,)))
    tangents = tuple(torch.randn_like(t) for t in (x, w, b))

    def tangent(f, dtype):
        primals = tuple(t.to(dtype) for t in (x, w, b))
        return torch.func.jvp(f, primals, tuple(t.to(dtype) for t in tangents))[1]

    def torchs(x, w, b):
        return torch_activation(torch.nn.functional.linear(x, w, b), activation)

    got = tangent(lambda x, w, b: mpgemm.linear(x, w, b, activation=activation), torch.float32)
    with torch.autocast(device.type, dtype=torch.float16):
        autocast = tangent(torchs, torch.float32)
    expected = tangent(torchs, torch.float64)
    if activation == "relu":
        got, expected, autocast = (
            away_from_relu_kink(t, x, w, b) for t in (got, expected, autocast)
        )
    # Half an FP16 ulp at the largest magnitude beside the bar: the tangent is rounded
    # to the output's FP16, where autocast's may land nearer by chance (seed 1015: ours
    # an ulp off at 19.6, autocast's 0.0004).
    half_ulp = torch.finfo(torch.float16).eps / 2
    assert_within_torch_error(got, expected, autocast, f"{activation} tangent", rtol=half_ulp)


def test_forward_mode_ad_through_a_batched_product_and_cross_entropy(device):
    """``matmul``'s batched product (operands broadcast) has its jvp rule; eager
    forward-mode AD through ``cross_entropy`` takes torch's (FP32 logits)."""
    a, b = torch.randn(2, 4, 8, device=device), torch.randn(1, 8, 5, device=device)
    a_t, b_t = torch.randn_like(a), torch.randn_like(b)
    _, got = torch.func.jvp(mpgemm.matmul, (a, b), (a_t, b_t))
    _, expected = torch.func.jvp(
        torch.matmul, (a.double(), b.double()), (a_t.double(), b_t.double())
    )
    with torch.autocast(device.type, dtype=torch.float16):
        _, autocast = torch.func.jvp(torch.matmul, (a, b), (a_t, b_t))
    half_ulp = torch.finfo(torch.float16).eps / 2  # (rounded to FP16, as above)
    assert_within_torch_error(got, expected, autocast, "batched tangent", rtol=half_ulp)
    target = torch.arange(4, device=device)
    logits, tangent = torch.randn(4, 6, device=device), torch.randn(4, 6, device=device)

    def tangent_of(loss, dtype):
        return _dual_tangent(lambda t: loss(t, target), logits.to(dtype), tangent.to(dtype))

    got = tangent_of(mpgemm.cross_entropy, torch.float16)
    expected = tangent_of(torch.nn.functional.cross_entropy, torch.float64)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), expected, rtol=2e-3, atol=2e-3)


def test_outside_a_transform_apply_binds_no_signature(device, monkeypatch):
    """torch's ``Function.apply`` binds the arguments to ``forward``'s signature on every
    call of a Function with ``setup_context`` (``inspect.signature``: twice the cost of
    the rest of an apply); mpgemm's Functions skip it outside a transform, and use it
    inside one."""
    import inspect

    layer = mpgemm.Linear(8, 4, activation="gelu", device=device)
    x = torch.randn(3, 8, device=device)
    layer(x).sum().backward()  # compiled and autotuned first (triton inspects at compile)
    real_signature = inspect.signature
    bound = []

    def signature(fn, *args, **kwargs):
        bound.append(getattr(fn, "__name__", fn))
        return real_signature(fn, *args, **kwargs)

    monkeypatch.setattr(inspect, "signature", signature)
    layer(x).sum().backward()
    assert bound == []
    grad(lambda t: layer(t).sum())(x)
    assert "_linear_forward" in bound and "forward" in bound, bound


def test_autograds_batched_gradients_are_each_gradients_own_backward(device):
    """``torch.autograd.grad(..., is_grads_batched=True)`` (which
    ``torch.autograd.functional.jacobian(vectorize=True)`` uses) runs the backward on
    gradients batched by torch's older vmap, plain ``torch.Tensor``s with no memory of
    their own: they take the reference path. Through the layers' GEMMs and activations,
    a batched matmul and the cross-entropy, each batch entry is the backward of its own
    gradient (one per sample's loss: per-sample gradients), within 16-bit rounding."""
    model = converted(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 33, generator=g).to(device).requires_grad_()
    w = torch.randn(2, 10, 10, generator=g).to(device).requires_grad_()
    target = torch.randint(0, 10, (6,), generator=g).to(device)

    def losses(x):
        logits = mpgemm.matmul(model(x).view(2, 3, 10), w).reshape(6, 10)
        return mpgemm.cross_entropy(logits.float(), target, reduction="none", label_smoothing=0.1)

    out = losses(x)
    picks = torch.eye(6, device=device)
    batched = torch.autograd.grad(out, (x, w), picks, is_grads_batched=True, retain_graph=True)
    jacobian = torch.autograd.functional.jacobian(losses, x, vectorize=True)
    for i in range(6):
        own = torch.autograd.grad(out, (x, w), picks[i], retain_graph=True)
        pairs = zip((batched[0][i], batched[1][i], jacobian[i]), (*own, own[0]), strict=True)
        for got, expected in pairs:
            scale = expected.abs().max().item()
            torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3 * scale)
