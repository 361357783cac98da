"""mpgemm.linear forward and backward against FP64 nn.Linear, with torch's own 16-bit
computation (linear_ref through autograd) as the bar; and kernels against the
reference path, which must agree to FP32 rounding."""

import gc
import itertools
import statistics

import pytest
import torch
import torch.nn.functional as F

import mpgemm
from mpgemm import functional
from mpgemm.reference import (
    activation_backward_ref,
    activation_derivative,
    gemm_ref,
    linear_ref,
    torch_activation,
)
from tests.accuracy import (
    assert_within_torch_error,
    away_from_relu_kink,
    launched_kernels,
    nan_padded,
)

ACTIVATIONS = [None, "relu", "gelu", "gelu_tanh", "silu"]
COMPUTE_DTYPES = [torch.float16, torch.bfloat16]
SHAPES = [(1, 7, 16), (7, 33, 130), (33, 16, 7), (130, 257, 33), (16, 1, 257), (257, 130, 1)]
CASES = list(itertools.product(ACTIVATIONS, [True, False], COMPUTE_DTYPES))


def fp64_linear(x, w, b, activation):
    # The bias added after: F.linear refuses a bias beside a 1-D weight for 2-D inputs.
    z = F.linear(x, w) if b is None else F.linear(x, w) + b
    return torch_activation(z, activation)


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def assert_grad_within_torch_error(g, g64, g_ref, what, compute_dtype):
    """``assert_within_torch_error`` for a gradient, with half an ulp of the compute
    dtype at the gradient's scale beside twice linear_ref's error. linear_ref's
    gradients pass through its rounding of the operands, so autograd rounds each to the
    compute dtype, as autocast's are; ours stay FP32. Over 1 to 7 terms that extra
    rounding can cancel the operands' own rounding error by chance (seed 43, ReLU,
    FP16, 1x7x16: torch's weight gradient 0.00063 off FP64, ours, the exact product of
    the rounded operands, 0.00137): 8 of 1200 runs of the FP64 comparison's cases over
    60 seeds failed the bar without it, none of 2000 over 100 with it."""
    half_ulp = torch.finfo(compute_dtype).eps / 2
    assert_within_torch_error(g, g64, g_ref, what, rtol=half_ulp)


def run_three_ways(x, w, b, activation, compute_dtype, out_dtype, grad_out):
    """(mpgemm, FP64, linear_ref) results as (output, grads) with the same grad_out."""
    results = []
    for fn, cast in (
        (mpgemm.linear, lambda t: t),
        (fp64_linear, lambda t: t.double()),
        (linear_ref, lambda t: t),
    ):
        xl, wl, bl = leaves(*(None if t is None else cast(t) for t in (x, w, b)))
        if fn is fp64_linear:
            y = fn(xl, wl, bl, activation)
        else:
            y = fn(
                xl, wl, bl, activation=activation, compute_dtype=compute_dtype, out_dtype=out_dtype
            )
        y.backward(cast(grad_out.to(y.dtype)))
        results.append((y, [None if t is None else t.grad for t in (xl, wl, bl)]))
    return results


@pytest.mark.parametrize("activation, has_bias, compute_dtype", CASES)
def test_linear_forward_and_backward_match_fp64(activation, has_bias, compute_dtype, device):
    case = CASES.index((activation, has_bias, compute_dtype))
    m, n, k = SHAPES[case % len(SHAPES)]
    out_dtype = [None, torch.float32][case % 2]
    x = nan_padded(torch.randn(m, k, device=device), transposed=case % 3 == 0)
    w = nan_padded(torch.randn(n, k, device=device) / k**0.5, transposed=case % 2 == 0)
    b = torch.randn(n, device=device) if has_bias else None
    grad_out = away_from_relu_kink(torch.randn(m, n, device=device), x, w, b)

    (y, grads), (y64, grads64), (y_ref, grads_ref) = run_three_ways(
        x, w, b, activation, compute_dtype, out_dtype, grad_out
    )

    assert y.dtype == (out_dtype or compute_dtype)
    assert_within_torch_error(y, y64, y_ref, "output")
    for name, g, g64, g_ref in zip("xwb", grads, grads64, grads_ref, strict=True):
        if name == "b" and not has_bias:
            continue
        assert g.dtype == torch.float32, f"grad {name} must have its tensor's dtype"
        assert_grad_within_torch_error(g, g64, g_ref, f"grad {name}", compute_dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_kernels_agree_with_the_reference_path(activation, device, on_path):
    """The kernels and gemm_ref (what CPU tensors run without the interpreter) compute
    the same rounded math, so outputs and gradients agree up to FP32 accumulation order,
    which may tip a 16-bit rounding of dZ by one ulp: 1e-3 of the tensor's scale. The
    bias gradient is rounded nowhere on either path (FP32 sums of the FP32 dY, or of
    dZ before its rounding): 1e-5 of its scale, where summing rounded values is 1e-4
    off."""
    x = torch.randn(3, 11, 130, device=device)
    w = torch.randn(33, 130, device=device) / 130**0.5
    b = torch.randn(33, device=device)
    grad_out = away_from_relu_kink(torch.randn(3, 11, 33, device=device), x, w, b)

    def forward_backward(*tensors):
        xl, wl, bl = leaves(*tensors)
        y = mpgemm.linear(xl, wl, bl, activation=activation, out_dtype=torch.float32)
        y.backward(grad_out.to(y.device))
        return y, xl.grad, wl.grad, bl.grad

    on_kernels = forward_backward(x, w, b)
    on_path("reference")
    on_reference = forward_backward(*(t.cpu() for t in (x, w, b)))
    for name, got, want in zip(("y", "dx", "dw", "db"), on_kernels, on_reference, strict=True):
        rtol, scale = (0.0, 1e-5) if name == "db" else (2e-3, 1e-3)
        atol = scale * want.abs().max().item()
        torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=atol, msg=name)


def test_an_enclosing_autocast_changes_nothing(path_device):
    """mpgemm states its own precision: under ``torch.autocast`` (16-bit, for the
    tensors' device) a layer, ``linear`` and ``matmul`` (2-D and batched) give the same
    bits, forward and backward, as without it, on the kernels and on the reference path
    (CPU tensors without the interpreter; also what torch.func's transforms run), whose
    FP32 products autocast would otherwise round to 16 bits."""
    device = path_device
    x = torch.randn(2, 5, 64, device=device)
    w = torch.randn(48, 64, device=device) / 8
    b = torch.randn(48, device=device)
    layer = mpgemm.Linear(64, 48, activation="gelu", device=device)
    batch = torch.randn(2, 64, 24, device=device)

    def run():
        xl, wl, bl, batch_l = leaves(x, w, b, batch)
        outs = [
            mpgemm.linear(xl, wl, bl, activation="relu", out_dtype=torch.float32),
            mpgemm.matmul(xl, wl.t(), compute_dtype=torch.bfloat16),
            mpgemm.matmul(xl, batch_l),
            layer(xl),
        ]
        sum(o.float().sum() for o in outs).backward()
        grads = [xl.grad, wl.grad, bl.grad, batch_l.grad, layer.weight.grad, layer.bias.grad]
        layer.zero_grad()
        return outs + grads

    plain = run()
    # CPU autocast takes BF16 only; CUDA's FP16, the mixed precision mpgemm replaces.
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    with torch.autocast(device.type, dtype=dtype):
        autocast = run()
    for i, (got, want) in enumerate(zip(autocast, plain, strict=True)):
        assert got.dtype == want.dtype and torch.equal(got, want), i


def test_batched_non_contiguous_input_and_input_dtypes(device):
    w = torch.randn(16, 33, device=device, requires_grad=True)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(7, 2, 33, device=device, dtype=dtype).transpose(0, 1)  # (2, 7, 33)
        x.requires_grad_()
        y = mpgemm.linear(x, w, out_dtype=torch.float32)
        assert y.shape == (2, 7, 16)
        y.sum().backward()
        assert x.grad.dtype == dtype and x.grad.shape == x.shape
        exact = F.linear(x.detach().double(), w.detach().double())
        assert_within_torch_error(y, exact, linear_ref(x, w, out_dtype=torch.float32), "fwd")


@pytest.mark.parametrize("m, n, k", [(0, 7, 16), (7, 0, 16), (7, 16, 0)])
def test_zero_size_dimensions_with_bias(m, n, k, device):
    x = torch.randn(m, k, device=device, requires_grad=True)
    w = torch.randn(n, k, device=device, requires_grad=True)
    b = torch.randn(n, device=device, requires_grad=True)
    y = mpgemm.linear(x, w, b, activation="relu", out_dtype=torch.float32)
    assert y.shape == (m, n)
    # With K = 0 the product is zero and the output is relu(bias) on every row.
    torch.testing.assert_close(y, F.relu(b.detach()).expand(m, n), rtol=0, atol=0)
    grad_out = torch.randn(m, n, device=device)
    y.backward(grad_out)
    mask = (b.detach() > 0).float()
    torch.testing.assert_close(b.grad, (grad_out * mask).sum(0), rtol=1e-6, atol=1e-6)
    # Nothing flows to x or w: either they are empty, or N = 0, or they meet no rows.
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_weight_gradient_accumulates_into_existing_grad_like_nn_linear(device):
    layer = mpgemm.Linear(
        33, 16, device=device, compute_dtype=torch.float16, out_dtype=torch.float32
    )
    reference = torch.nn.Linear(33, 16, device=device, dtype=torch.float64)
    reference.load_state_dict(layer.state_dict())
    xs = [torch.randn(7, 33, device=device) for _ in range(2)]
    for x in xs:
        layer(x).square().sum().backward()
        reference(x.double()).square().sum().backward()
    # The second backward added to the first: the sum of both micro-batches' gradients.
    torch.testing.assert_close(
        layer.weight.grad.double(), reference.weight.grad, rtol=1e-2, atol=1e-2
    )
    torch.testing.assert_close(layer.bias.grad.double(), reference.bias.grad, rtol=1e-2, atol=1e-2)


def test_frozen_weight_still_gets_bias_and_input_gradients(device):
    x = torch.randn(9, 33, device=device, requires_grad=True)
    w = torch.randn(16, 33, device=device)
    b = torch.randn(16, device=device, requires_grad=True)
    grad_out = torch.randn(9, 16, device=device)
    mpgemm.linear(x, w, b, activation="gelu", out_dtype=torch.float32).backward(grad_out)
    x64, b64 = leaves(x.double(), b.double())
    F.gelu(F.linear(x64, w.double(), b64)).backward(grad_out.double())
    torch.testing.assert_close(b.grad.double(), b64.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_nan_is_never_hidden_by_a_fused_activation(device, activation):
    # torch.relu(nan) is nan: a fused ReLU must not turn it into 0, or the loss
    # scaler's inf/NaN check would miss it.
    x = torch.tensor([[1.0, -2.0], [float("nan"), 1.0]], device=device, requires_grad=True)
    w = torch.eye(2, device=device)
    y = mpgemm.linear(x, w, activation=activation, out_dtype=torch.float32)
    expected = mpgemm.linear_ref(x, w, activation=activation, out_dtype=torch.float32)
    assert torch.equal(y.isnan(), expected.isnan()) and y[1].isnan().all()
    if activation == "relu":
        # The backward is torch's threshold_backward: zero where the output is <= 0, and
        # a NaN output passes its gradient on.
        y.backward(torch.ones_like(y))
        theirs = x.detach().clone().requires_grad_()
        torch.relu(theirs @ w).backward(torch.ones_like(y))
        assert torch.equal(x.grad, theirs.grad)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_silu_and_tanh_gelu_put_inf_and_nan_where_torchs_do(device, activation):
    # torch's formulas: silu(-inf) and gelu(-inf) are NaN, both inf at inf, -0.0 at
    # -100; their derivatives NaN at +-inf. K = 1 and a weight of 1 make z the input.
    values = [float("-inf"), -100.0, -1.0, 0.0, 1.0, 100.0, float("inf"), float("nan")]
    x = torch.tensor(values, device=device).unsqueeze(1).requires_grad_()
    w = torch.ones(1, 1, device=device)
    y = mpgemm.linear(x, w, activation=activation, out_dtype=torch.float32)
    theirs = x.detach().clone().requires_grad_()
    want = F.silu(theirs) if activation == "silu" else F.gelu(theirs, approximate="tanh")
    assert torch.equal(y.isnan(), want.isnan())
    torch.testing.assert_close(y[~y.isnan()], want[~want.isnan()], rtol=1e-3, atol=0)
    assert torch.equal(y.signbit(), want.signbit())  # -0.0 for -100
    y.backward(torch.ones_like(y))
    want.backward(torch.ones_like(want))
    assert torch.equal(x.grad.isnan(), theirs.grad.isnan())
    finite = ~theirs.grad.isnan()
    torch.testing.assert_close(x.grad[finite], theirs.grad[finite], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_the_forward_stores_z_in_the_outputs_dtype(device, activation, out_dtype):
    """GELU's and SiLU's backward takes act'(z) from z (``mpgemm.kernels.activation``),
    which the forward's epilogue stores beside the output, rounded to its dtype, as
    torch's activations keep their 16-bit input under autocast: z = x + bias here (K =
    1, a weight of 1), at every 64th between -12 and 12 and 10^5 further on, beyond
    FP16's range, where the stored z is FP16's largest finite value (an inf would make
    act'(z) NaN, where z itself was finite), and inf and NaN as they are."""
    x = torch.arange(-12, 12, 2**-6, device=device)  # exact in FP16 and BF16
    x = torch.cat([x, torch.tensor([float("inf"), -float("inf"), float("nan")], device=device)])
    one = torch.ones(1, 1, device=device, dtype=torch.float16)
    bias = torch.tensor([0.0, 1e5, -1e5], device=device)
    z = x[:, None] + bias  # exact in FP32
    big = torch.finfo(out_dtype).max
    want = torch.where(z.isfinite(), z.clamp(-big, big), z).to(out_dtype)
    # The kernel (or, without triton's interpreter on a CPU, the reference) and the
    # reference path.
    for gemm in (functional._implementation(x.device, x, one), gemm_ref):
        _, g, _ = gemm(
            x.half()[:, None],
            one.expand(1, 3),
            compute_dtype=torch.float16,
            out_dtype=out_dtype,
            bias=bias,
            activation=activation,
            store_preact=True,
        )
        assert g.dtype == out_dtype
        assert torch.equal(g.isnan(), want.isnan())
        assert torch.equal(g[~want.isnan()], want[~want.isnan()])
        if out_dtype == torch.float16:
            assert g[:-3, 1].eq(65504).all() and g[:-3, 2].eq(-65504).all()


@pytest.mark.parametrize("activation", ["gelu", "silu"])
@pytest.mark.parametrize(
    "compute_dtype, out_dtype",
    [
        (torch.float16, torch.bfloat16),
        (torch.bfloat16, torch.float16),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dz_reaches_the_gemms_rounded_once_whatever_the_output_dtype(
    device, activation, compute_dtype, out_dtype, monkeypatch
):
    """dZ = dY * act'(z) goes from the activation's node to the GEMMs' as y's gradient,
    in y's dtype (autograd casts it to that), and the GEMMs round it to the compute
    dtype: rounded once from the FP32 product, to the coarser of the two, it passes both
    exactly. (Rounded to the compute dtype, an FP16 layer writing BF16 had its dZ
    rounded to FP16 and again to BF16, its input gradient 7 half-ulps off where torch's
    own 16-bit computation was within one: a randomised search over linear's arguments
    found it.)"""
    seen = {}
    activation_backward, linear_backward = (
        functional.activation_backward,
        functional._linear_backward,
    )

    def derivative(grad_y, saved, *args, **kwargs):
        seen["dY"], seen["z"] = grad_y, saved
        return activation_backward(grad_y, saved, *args, **kwargs)

    def gemms(grad_z, *args, **kwargs):
        seen["dZ"] = grad_z
        return linear_backward(grad_z, *args, **kwargs)

    monkeypatch.setattr(functional, "activation_backward", derivative)
    monkeypatch.setattr(functional, "_linear_backward", gemms)
    x = torch.randn(64, 48, device=device, requires_grad=True)
    w = (torch.randn(80, 48, device=device) / 48**0.5).requires_grad_()
    b = torch.randn(80, device=device, requires_grad=True)
    y = mpgemm.linear(
        x, w, b, activation=activation, compute_dtype=compute_dtype, out_dtype=out_dtype
    )
    y.backward(torch.randn(y.shape, device=device).to(y.dtype))
    coarser = torch.bfloat16 if torch.bfloat16 in (compute_dtype, out_dtype) else torch.float16
    dy, dz, z = seen["dY"], seen["dZ"], seen["z"]
    assert dy.dtype == dz.dtype == z.dtype == out_dtype
    assert torch.equal(dz, dz.to(coarser).to(out_dtype))  # rounded to the coarser
    # and from the FP32 product: within the reference's error of it
    exact = dy.double() * activation_derivative(z.double(), activation)
    reference = activation_backward_ref(dy, z, activation, compute_dtype, bias_grad=False)[0]
    assert_within_torch_error(dz, exact, reference, "dZ")


@pytest.mark.parametrize(
    "make_bias",
    [
        lambda n, device: torch.randn(2 * n, device=device)[::2],  # every other element
        lambda n, device: torch.tensor(0.5, device=device).expand(n),  # one value, stride 0
    ],
    ids=["strided", "expanded"],
)
def test_a_bias_of_any_stride(device, make_bias):
    x, w = torch.randn(5, 8, device=device), torch.randn(6, 8, device=device)
    bias = make_bias(6, device)
    out = mpgemm.linear(x, w, bias, out_dtype=torch.float32)
    expected = linear_ref(x, w, bias.contiguous(), out_dtype=torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "weight_shape, bias_shape, activation",
    [((33,), None, None), ((33,), (), "relu"), ((16, 33), (), "relu"), ((16, 33), (1,), None)],
)
@pytest.mark.parametrize("input_shape", [(7, 33), (33,), (2, 3, 33)])
def test_f_linears_vector_weight_and_single_value_bias(
    device, weight_shape, bias_shape, activation, input_shape
):
    """F.linear's shapes: a 1-D weight is one output feature, its dimension dropped from
    the result, and a bias of one value (shape () or (1,)) is added to every feature;
    its gradient is the sum over the features. Values and gradients within twice the
    error of torch's product of the same rounded operands (linear_ref through autograd),
    against FP64. A 16-bit output, so that the backward's products read the same
    gradient as torch's: with a 1-D input each weight gradient is a single product,
    which rounding an FP32 gradient to 16 bits would dominate."""
    x = torch.randn(input_shape, device=device)
    w = torch.randn(weight_shape, device=device) / 33**0.5
    b = None if bias_shape is None else torch.randn(bias_shape, device=device)
    matrix = w if w.dim() == 2 else w.unsqueeze(0)
    out_shape = (*input_shape[:-1], *weight_shape[:-1])
    grad_out = away_from_relu_kink(
        torch.randn(*input_shape[:-1], matrix.shape[0], device=device), x, matrix, b
    ).reshape(out_shape)

    (y, grads), (y64, grads64), (y_ref, grads_ref) = run_three_ways(
        x, w, b, activation, torch.float16, None, grad_out
    )

    assert y.shape == out_shape
    assert_within_torch_error(y, y64, y_ref, "output")
    for name, g, g64, g_ref in zip("xwb", grads, grads64, grads_ref, strict=True):
        if g64 is not None:
            assert g.shape == g64.shape, name
            assert_grad_within_torch_error(g, g64, g_ref, f"grad {name}", torch.float16)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", ["0-D bias", "(1,) bias", "1-D weight"])
def test_f_linears_shapes_compute_what_their_explicit_forms_do(device, activation, case):
    """A 1-D weight is the (1, in_features) weight with the output's last dimension
    squeezed, and a single-value bias the bias expanded to every feature: the same bits,
    forward and backward. (GELU's backward rounds dZ to 16 bits before its GEMMs, where
    linear_ref keeps it in FP32, so that a few-row product's error against FP64 is not
    bounded by linear_ref's: hence equality here rather than the FP64 bar above.)"""
    x = torch.randn(2, 3, 33, device=device)
    w = torch.randn((33,) if case == "1-D weight" else (16, 33), device=device)
    b = torch.randn((1,) if case == "(1,) bias" else (), device=device)
    grad_out = torch.randn(*x.shape[:-1], *w.shape[:-1], device=device)

    def run(explicit: bool):
        xl, wl, bl = leaves(x, w, b)
        weight = wl.unsqueeze(0) if explicit and wl.dim() == 1 else wl
        bias = bl.expand(weight.shape[0]) if explicit else bl
        y = mpgemm.linear(xl, weight, bias, activation=activation)
        if explicit and wl.dim() == 1:
            y = y.squeeze(-1)
        y.backward(grad_out.to(y.dtype))
        return y, xl.grad, wl.grad, bl.grad

    for name, got, want in zip(("y", "dx", "dw", "db"), run(False), run(True), strict=True):
        assert got.shape == want.shape, name
        assert torch.equal(got, want), name


@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_single_value_bias_gets_its_gradient_rounded_once(device, dtype, activation):
    """The gradient of one bias value for every feature is the FP32 sum of dZ over all
    of them, rounded once to the bias's dtype: as the FP32 bias's, rounded. (Expanded in
    its own dtype, the features' FP32 sums were each rounded to it and then added in it
    by the expansion's backward: a BF16 bias's gradient 1.3 ulps off, where torch's
    F.linear sums in FP32.)"""
    x = torch.randn(64, 48, device=device)
    w = torch.randn(512, 48, device=device) / 48**0.5
    bias = torch.randn((), device=device).to(dtype)
    grad_out = torch.randn(64, 512, device=device).half()
    grads = []
    for b in (bias, bias.float()):
        b = b.detach().requires_grad_()
        mpgemm.linear(x, w, b, activation=activation).backward(grad_out)
        grads.append(b.grad)
    assert grads[0].dtype == dtype
    assert torch.equal(grads[0], grads[1].to(dtype))


def test_f_linears_bias_shapes_beyond_one_value_are_refused():
    with pytest.raises(ValueError, match=r"bias of shape \(2, 4\).*expected \(4,\), or one value"):
        mpgemm.linear(torch.randn(2, 3), torch.randn(4, 3), torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"bias of shape \(2,\).*\(3,\); expected \(1,\)"):
        mpgemm.linear(torch.randn(2, 3), torch.randn(3), torch.randn(2))
    # One value in a 2-D bias: refused whatever the input, where torch's linear adds it
    # by broadcasting, and so refuses it for a result of fewer dimensions (a 1-D input).
    with pytest.raises(ValueError, match=r"bias of shape \(1, 1\).*expected \(4,\), or one"):
        mpgemm.linear(torch.randn(3), torch.randn(4, 3), torch.randn(1, 1))


def test_a_tensor_subclass_gets_the_call_and_its_tensors_the_reference_path(device):
    # As torch's functions do, mpgemm.linear hands a subclass's call to its
    # __torch_function__: torch.Tensor's own runs the call with the subclass's handling
    # off and gives the result the subclass's type. A subclass's tensor never reaches
    # the kernels (a wrapper's has no memory of its own): the forward, which reads x,
    # takes the reference path; the backward's tensors are the plain ones torch made.
    class Wrapped(torch.Tensor):
        pass

    pytest.importorskip("triton")
    from tests.accuracy import launched_kernels

    x = torch.randn(8, 16, device=device).as_subclass(Wrapped).requires_grad_()
    w = torch.randn(4, 16, device=device, requires_grad=True)
    names, y = launched_kernels(lambda: mpgemm.linear(x, w, compute_dtype=torch.float16))
    assert names == []
    assert type(y) is Wrapped
    plain_x = x.detach().as_subclass(torch.Tensor)
    expected = linear_ref(plain_x, w.detach(), compute_dtype=torch.float16)
    assert torch.equal(y.as_subclass(torch.Tensor), expected)
    y.float().sum().backward()
    # The same gradients as plain tensors get, to FP32 rounding (kernels or reference).
    x0, w0 = plain_x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    mpgemm.linear(x0, w0, compute_dtype=torch.float16).float().sum().backward()
    torch.testing.assert_close(x.grad.as_subclass(torch.Tensor), x0.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w0.grad, rtol=1e-6, atol=1e-6)


# Each op as (mpgemm's of (x, w, b, compute dtype), torch's of (x, w, b)): w (8, 16),
# b (8,), x (4, 16).
PENALISED_OPS = {
    "linear": (
        lambda x, w, b, cd: mpgemm.linear(x, w, b, compute_dtype=cd),
        lambda x, w, b: F.linear(x, w, b),
    ),
    **{
        f"{act} layer": (
            lambda x, w, b, cd, act=act: mpgemm.linear(x, w, b, activation=act, compute_dtype=cd),
            lambda x, w, b, act=act: torch_activation(F.linear(x, w, b), act),
        )
        for act in ("relu", "gelu", "gelu_tanh", "silu")
    },
    # x's rounding, which the GEMMs read, made from an FP32 intermediate freed after.
    "linear of an intermediate": (
        lambda x, w, b, cd: mpgemm.linear(x * 2.0, w, b, activation="gelu", compute_dtype=cd),
        lambda x, w, b: F.gelu(F.linear(x * 2.0, w, b)),
    ),
    "two layers": (
        lambda x, w, b, cd: mpgemm.linear(
            mpgemm.linear(x, w, b, activation="silu", compute_dtype=cd), w.t(), compute_dtype=cd
        ),
        lambda x, w, b: F.linear(F.silu(F.linear(x, w, b)), w.t()),
    ),
    "batched matmul": (
        lambda x, w, b, cd: (
            mpgemm.matmul(x.expand(2, 4, 16), w.t().expand(2, 16, 8), compute_dtype=cd) + b
        ),
        lambda x, w, b: torch.matmul(x.expand(2, 4, 16), w.t().expand(2, 16, 8)) + b,
    ),
    "cross_entropy": (
        lambda x, w, b, cd: mpgemm.cross_entropy(
            mpgemm.linear(x, w, b, compute_dtype=cd, out_dtype=torch.float32),
            torch.arange(4, device=x.device),
        ),
        lambda x, w, b: F.cross_entropy(
            F.linear(x, w, b).float(), torch.arange(4, device=x.device)
        ),
    ),
}


def _penalised_gradients(op, tensors, penalised=None):
    """A gradient penalty, as in WGAN-GP and torch's AMP example: the gradients of
    ``op``'s loss with respect to ``penalised`` (default: all ``tensors``) taken with
    ``create_graph=True``, their squares added to the loss, and the gradients of that
    sum with respect to ``tensors``."""
    loss = op(*tensors).float().square().sum()
    first = torch.autograd.grad(loss, penalised or tensors, create_graph=True)
    penalty = sum(g.float().square().sum() for g in first)
    return torch.autograd.grad(loss + penalty, tensors)


def _relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).abs().max() / exact.abs().max()).item()


# The seeds of each penalty case's draws (``test_a_gradient_penalty_is_as_accurate_as_autocasts``).
PENALTY_SEEDS = range(8)


@pytest.mark.parametrize("compute_dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize("op", list(PENALISED_OPS))
def test_a_gradient_penalty_is_as_accurate_as_autocasts(device, op, compute_dtype):
    """Under ``create_graph=True`` the backward is recorded (``functional._implementation``:
    the reference's math, its GEMMs by ``matmul``), so a penalty on the gradients reaches
    the weights' and the input's, as through torch's layers. Held to autocast's accuracy
    (the same op in the same 16-bit dtype) against FP64 over draws: the median and the
    largest of the gradients' relative errors each within twice autocast's. (Per draw,
    twice autocast's error fails now and then: over 25 seeds and FP16 both had median
    relative errors of 4e-4 to 1e-3 and largest ones of 1.3e-3 to 3.6e-3, but one draw
    of "two layers" had autocast's bias gradient 1.5e-4 off and ours 1.6e-3; and
    autocast's FP16 overflows in some, which leave its side.) The penalty's own share of
    FP64's gradients is checked to be far above our error in every draw: the
    first-order gradients alone, or the penalty reaching some tensors and not others
    (once-differentiable backwards: 7.7 against 20.9 in a trial), fail it."""
    ours, torchs = PENALISED_OPS[op]
    our_errors, autocasts_errors = [], []
    for draw in PENALTY_SEEDS:
        g = torch.Generator().manual_seed(draw)
        shapes = ((4, 16), (8, 16), (8,))
        tensors = [torch.randn(*shape, generator=g).to(device) for shape in shapes]
        tensors[1] /= 4
        got = _penalised_gradients(lambda *t: ours(*t, compute_dtype), leaves(*tensors))
        wide = leaves(*(t.double() for t in tensors))
        expected = _penalised_gradients(torchs, wide)
        with torch.autocast(device.type, dtype=compute_dtype):
            autocast = _penalised_gradients(torchs, leaves(*tensors))
        first_order = torch.autograd.grad(torchs(*wide).square().sum(), wide)
        runs = (got, expected, autocast, first_order)
        for name, got_, g64, g_ac, g1 in zip("xwb", *runs, strict=True):
            what = f"{op}, draw {draw}: {name}'s gradient"
            assert got_.dtype == torch.float32 and torch.isfinite(got_).all(), what
            error = _relative_error(got_, g64)
            assert _relative_error(g1, g64) > 10 * error, f"{what}: the penalty's share is small"
            our_errors.append(error)
            if torch.isfinite(g_ac).all():
                autocasts_errors.append(_relative_error(g_ac, g64))
    assert len(autocasts_errors) >= len(our_errors) // 2  # (few overflows)
    for statistic in (statistics.median, max):
        ours_, theirs = statistic(our_errors), statistic(autocasts_errors)
        assert ours_ <= 2 * theirs, f"{op}: {statistic.__name__} {ours_:.3g} > 2 x {theirs:.3g}"


@pytest.mark.parametrize("op", ["gelu layer", "two layers", "cross_entropy"])
def test_an_enclosing_autocast_changes_no_penalty(device, op):
    """The recorded backward's math states its precision as the kernels' does: under an
    enclosing ``torch.autocast`` (BF16, which would round FP32 products and sums to 8
    bits) a penalty's gradients are the same bits."""
    ours, _ = PENALISED_OPS[op]
    torch.manual_seed(0)
    tensors = [torch.randn(4, 16, device=device), torch.randn(8, 16, device=device) / 4]
    tensors.append(torch.randn(8, device=device))
    expected = _penalised_gradients(lambda *t: ours(*t, torch.float16), leaves(*tensors))
    with torch.autocast(device.type, dtype=torch.bfloat16):
        got = _penalised_gradients(lambda *t: ours(*t, torch.float16), leaves(*tensors))
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e), op


def test_a_backward_under_create_graph_runs_its_gemms_on_the_kernels(device):
    """Recorded, the backward's products are ``matmul``'s (``functional._RECORDED``):
    the kernels compute them, as they compute the second backward's, where the
    reference's products would be torch's FP32 ones."""
    gemms = {"_gemm_kernel", "_gemm_tma_kernel"}
    x, w = leaves(torch.randn(4, 16, device=device), torch.randn(8, 16, device=device))
    loss = mpgemm.linear(x, w, activation="gelu").float().square().sum()
    names, grads = launched_kernels(lambda: torch.autograd.grad(loss, [x, w], create_graph=True))
    assert sum(name in gemms for name in names) == 2  # x's gradient and w's
    assert all(g.grad_fn is not None for g in grads)
    penalty = sum(g.square().sum() for g in grads)
    names, _ = launched_kernels(lambda: torch.autograd.grad(loss + penalty, [x, w]))
    assert sum(name in gemms for name in names) >= 4


def test_a_layers_penalty_differentiates_its_fp32_master_not_its_copy(device):
    """An ``mpgemm.Linear``'s GEMMs read its 16-bit weight copy; a penalty's derivative
    goes to the FP32 weight, as for the first-order gradient: WGAN-GP's penalty, on
    the input's gradient (dZ @ W), whose derivative in the weight is the copy's where
    the backward read the copy; and the layer's input gradient's own derivatives
    (``torch.autograd.functional``'s ``hvp`` and ``hessian``)."""
    torch.manual_seed(0)
    layer = mpgemm.Linear(16, 8, activation="gelu", device=device)
    x = torch.randn(4, 16, device=device)
    tensors = [x.requires_grad_(), layer.weight, layer.bias]
    got = _penalised_gradients(lambda x, w, b: layer(x), tensors, penalised=[x])
    wide = leaves(x.double(), layer.weight.double(), layer.bias.double())
    exact = lambda x, w, b: F.gelu(F.linear(x, w, b))  # noqa: E731
    expected = _penalised_gradients(exact, wide, penalised=wide[:1])
    first_order = torch.autograd.grad(exact(*wide).square().sum(), wide)
    for g, g64, g1 in zip(got, expected, first_order, strict=True):
        torch.testing.assert_close(g.double(), g64, rtol=0.02, atol=0.02 * g64.abs().max().item())
        assert (g64 - g1).abs().max() > 0.5 * g64.abs().max()  # (the penalty's share)
    v = torch.randn(4, 16, device=device)
    _, hvp = torch.autograd.functional.hvp(lambda t: layer(t).float().square().sum(), x, v)
    _, hvp64 = torch.autograd.functional.hvp(
        lambda t: F.gelu(F.linear(t, wide[1], wide[2])).square().sum(), x.double(), v.double()
    )
    torch.testing.assert_close(hvp.double(), hvp64, rtol=0.02, atol=0.02 * hvp64.abs().max().item())
    hessian = torch.autograd.functional.hessian(lambda t: layer(t).float().square().sum(), x[0])
    hessian64 = torch.autograd.functional.hessian(
        lambda t: F.gelu(F.linear(t, wide[1], wide[2])).square().sum(), x[0].double()
    )
    assert hessian64.abs().max() > 0
    torch.testing.assert_close(
        hessian.double(), hessian64, rtol=0.02, atol=0.02 * hessian64.abs().max().item()
    )


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_a_layers_gemms_run_backward_after_its_activation_freed_dy_and_y(
    activation, device, monkeypatch
):
    """The activation's derivative is a node of its own, as torch's activations are: by
    the time a layer's GEMMs run backward, its output y, the gradient dY that reached it
    and GELU's stored act'(z) are freed, as autocast's ReLU and GELU free theirs (inside
    the layer's node, the engine would hold dY and y until its GEMMs were done)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    x = torch.randn(64, 32, device=device, requires_grad=True)
    w1 = torch.randn(48, 32, device=device, requires_grad=True)
    w2 = torch.randn(16, 48, device=device, requires_grad=True)
    y = mpgemm.linear(x, w1, activation=activation)
    watched = {"y": StorageWeakRef(y.untyped_storage())}
    if activation != "relu":
        (preact,) = y.grad_fn.saved_tensors
        watched["act'(z)"] = StorageWeakRef(preact.untyped_storage())
        del preact

    def watch_dy(dy):
        watched["dY"] = StorageWeakRef(dy.untyped_storage())

    y.register_hook(watch_dy)
    out = mpgemm.linear(y, w2)
    del y
    alive_at_gemms = []
    real = functional._linear_backward

    def spy(*args, **kwargs):
        # The interpreter leaves a launch's operands in a reference cycle: collected,
        # what remains is what autograd holds.
        gc.collect()
        alive_at_gemms.append(sorted(name for name, ref in watched.items() if not ref.expired()))
        return real(*args, **kwargs)

    monkeypatch.setattr(functional, "_linear_backward", spy)
    out.float().sum().backward()
    # The second layer's GEMMs (y still needed, dY not made yet), then the first's.
    held = sorted(["y"] + (["act'(z)"] if activation != "relu" else []))
    assert alive_at_gemms == [held, []]
    assert x.grad is not None and w1.grad is not None


@pytest.mark.parametrize("batch", [(8,), (2, 4)], ids=["2-D", "3-D"])
def test_an_output_changed_in_place_is_handled_as_torch_handles_it(device, batch):
    """Like torch.matmul's and F.linear's, an output may be changed in place (``y +=
    residual``, an in-place ReLU after the layer) and the gradient follows the change;
    GELU's too (its derivative reads the stored act'(z), as F.gelu reads its input).
    ReLU's derivative reads its output, so changing that fails the backward, as after
    torch.relu. A 3-D input's output is a view of the GEMM's 2-D result."""
    x = torch.randn(*batch, 32, device=device)
    w = torch.randn(16, 32, device=device) / 32**0.5
    x64, w64 = leaves(x.double(), w.double())
    cases = {
        "matmul": (lambda a, b: mpgemm.matmul(a, b.t(), out_dtype=torch.float32), F.linear),
        "linear": (lambda a, b: mpgemm.linear(a, b, out_dtype=torch.float32), F.linear),
        "gelu": (
            lambda a, b: mpgemm.linear(a, b, activation="gelu", out_dtype=torch.float32),
            lambda a, b: F.gelu(F.linear(a, b)),
        ),
        "silu": (
            lambda a, b: mpgemm.linear(a, b, activation="silu", out_dtype=torch.float32),
            lambda a, b: F.silu(F.linear(a, b)),
        ),
        "gelu_tanh": (
            lambda a, b: mpgemm.linear(a, b, activation="gelu_tanh", out_dtype=torch.float32),
            lambda a, b: F.gelu(F.linear(a, b), approximate="tanh"),
        ),
    }
    for name, (ours, theirs) in cases.items():
        xl, wl = leaves(x, w)
        y = ours(xl, wl)
        y.mul_(2)
        y.sum().backward()
        x64.grad = w64.grad = None
        (2 * theirs(x64, w64)).sum().backward()
        for got, want in ((xl.grad, x64.grad), (wl.grad, w64.grad)):
            torch.testing.assert_close(got, want.float(), rtol=2e-2, atol=2e-2, msg=name)

    xl, wl = leaves(x, w)
    y = mpgemm.linear(xl, wl, activation="relu", out_dtype=torch.float32)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("batch", [(8,), (2, 4)], ids=["2-D", "3-D"])
def test_a_product_autograd_does_not_record_runs_without_the_autograd_function(
    device, batch, monkeypatch
):
    """Under no_grad or inference_mode, or with no input requiring grad, the forward
    runs without ``LinearFunction.apply`` (its host time is a fifth of an eager GEMM's)
    and gives bit for bit what the recorded forward gives; with a graph to record, or a
    forward-AD level open (the Function then raises for want of a jvp rather than drop
    the tangents) or under vmap, the Function runs."""
    x = torch.randn(*batch, 32, device=device)
    w = torch.randn(16, 32, device=device)
    b = torch.randn(16, device=device)
    ops = {
        "matmul": lambda x, w, b: mpgemm.matmul(x, w.t()),
        "linear gelu": lambda x, w, b: mpgemm.linear(x, w, b, activation="gelu"),
        "linear relu fp32": lambda x, w, b: mpgemm.linear(
            x, w, b, activation="relu", out_dtype=torch.float32
        ),
    }
    recorded = {name: op(*leaves(x, w, b)) for name, op in ops.items()}
    applied = []
    real_apply = functional.LinearFunction.apply

    def counting_apply(*args):
        applied.append(args)
        return real_apply(*args)

    monkeypatch.setattr(functional.LinearFunction, "apply", counting_apply)
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        for name, op in ops.items():
            with mode():
                y = op(x, w, b)
            assert applied == [], (mode.__name__, name)
            assert y.grad_fn is None and not y.requires_grad
            assert torch.equal(y, recorded[name].detach()), (mode.__name__, name)
    op(*leaves(x, w, b))
    assert len(applied) == 1
    import torch.autograd.forward_ad as fwAD

    # A forward-AD level: the Function, whose jvp rule gives the tangent, not dropped.
    tangent = torch.randn_like(x)
    with fwAD.dual_level():
        dual = mpgemm.matmul(fwAD.make_dual(x, tangent), w.t())
        got = fwAD.unpack_dual(dual).tangent
    assert len(applied) == 2
    expected = mpgemm.matmul(tangent, w.t())
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())
    # Under a functorch transform too (tests/test_func_transforms.py), even with no
    # gradient asked for; under vmap the Function's rule applies it again, on the
    # batch's rows.
    with torch.no_grad():
        torch.func.vmap(lambda t: mpgemm.matmul(t, w.t()))(x.unsqueeze(0))
    assert len(applied) == 4


@pytest.mark.parametrize("compute_dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_fp32_operands_of_large_products_are_cast_for_the_tma_kernel(
    activation, compute_dtype, device, monkeypatch
):
    """mpgemm.linear on an FP32 input and weight, with the thresholds of
    ``gemm.ROUND_FP32_FLOPS`` and ``ROUND_FP32_REUSE`` at this test's size: the forward
    GEMM and the input gradient's (dZ @ W, the FP32 weight rounded by a cast) run the
    TMA kernel, as the weight gradient's does (the layer saves x rounded), and the
    output and gradients match FP64 within the bar."""
    from mpgemm.kernels import gemm
    from tests.accuracy import launched_kernels

    m, k, n = 72, 112, 48
    monkeypatch.setattr(gemm, "ROUND_FP32_FLOPS", 2 * m * k * n)
    monkeypatch.setattr(gemm, "ROUND_FP32_REUSE", n)
    monkeypatch.setattr(gemm, "multiprocessors", lambda device: 3)  # no split of K
    torch.manual_seed(0)
    x = nan_padded(torch.randn(m, k, device=device))
    w = nan_padded(torch.randn(n, k, device=device) / k**0.5)
    b = torch.randn(n, device=device)
    grad_out = away_from_relu_kink(torch.randn(m, n, device=device), x, w, b)

    names, results = launched_kernels(
        lambda: run_three_ways(x, w, b, activation, compute_dtype, None, grad_out)
    )
    (y, grads), (y64, grads64), (y_ref, grads_ref) = results
    tma = "_gemm_tma_kernel"
    assert names == [tma, "_activation_backward_kernel", tma, tma]
    assert_within_torch_error(y, y64, y_ref, "output")
    for name, g, g64, g_ref in zip("xwb", grads, grads64, grads_ref, strict=True):
        assert_grad_within_torch_error(g, g64, g_ref, f"grad {name}", compute_dtype)
