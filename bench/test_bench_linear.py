"""linear: forward, backward and forward+backward of mpgemm.Linear against nn.Linear
under autocast and in FP32, all from FP32 master weights; the input is the previous
layer's output (FP16 for the mixed-precision ones). Work: 2MNK flops forward, 4MNK
backward, 6MNK both."""

import pytest
import torch
from harness import GPU_SCALE

import mpgemm
from mpgemm.reference import TORCH_ACTIVATIONS

pytestmark = pytest.mark.benchmark(group="linear")

# (tokens, in, out): the guide's MLP layers, the small MLP, a transformer's MLP.
SHAPES = (
    [
        (8192, 784, 4096),
        (8192, 4096, 4096),
        (128, 784, 128),
        (8192, 4096, 11008),
        (8192, 11008, 4096),
    ]
    if GPU_SCALE
    else [(64, 48, 32), (128, 96, 64)]
)
PHASES = {"forward": 2, "backward": 4, "forward_backward": 6}


def _layer(impl, m, k, n, device, activation=None):
    """The layer's forward, its output dtype (FP16 for the mixed-precision ones) and
    what it differentiates (the input, the weight, the bias); ``activation``: mpgemm's
    fused, else torch's op after the layer."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(k, n, device=device)
    act = None if activation is None else TORCH_ACTIVATIONS[activation]
    if impl == "mpgemm":
        layer, act = mpgemm.Linear.from_linear(layer, activation=activation), None
    dtype = torch.float32 if impl == "fp32" else torch.float16
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)

    def apply():
        y = layer(x)
        return y if act is None else act(y)

    def forward():
        if impl == "autocast":
            with torch.autocast(device.type, dtype=torch.float16):
                return apply()
        return apply()

    return forward, dtype, [x, *layer.parameters()]


@pytest.mark.parametrize("impl", ["mpgemm", "autocast", "fp32"])
@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_linear(run_case, device, shape, phase, impl):
    m, k, n = shape
    forward, dtype, _ = _layer(impl, m, k, n, device)
    grad = torch.randn(m, n, device=device).to(dtype)
    case = f"{phase} {'x'.join(map(str, shape))}"
    flops = PHASES[phase] * m * n * k
    if phase == "forward":
        run_case(forward, case=case, impl=impl, flops=flops)
    elif phase == "backward":
        run_case(
            lambda y: y.backward(grad),
            setup=lambda: ((forward(),), {}),
            case=case,
            impl=impl,
            flops=flops,
        )
    else:
        run_case(lambda: forward().backward(grad), case=case, impl=impl, flops=flops)


# A transformer MLP's up-projection (8192 tokens, 4096 -> 11008) with each activation:
# mpgemm's in the GEMM's epilogue (z stored beside the output, but for ReLU's, then
# one pass for dZ, act'(z) taken from z, and the bias gradient), autocast's nn.Linear
# followed by torch's op.
ACTIVATION_SHAPE = (8192, 4096, 11008) if GPU_SCALE else (64, 48, 32)


@pytest.mark.parametrize("impl", ["mpgemm", "autocast"])
@pytest.mark.parametrize("activation", list(TORCH_ACTIVATIONS))
def test_linear_activation(run_case, device, activation, impl):
    m, k, n = ACTIVATION_SHAPE
    forward, dtype, _ = _layer(impl, m, k, n, device, activation=activation)
    grad = torch.randn(m, n, device=device).to(dtype)
    run_case(
        lambda: forward().backward(grad),
        case=f"forward_backward {activation} {'x'.join(map(str, ACTIVATION_SHAPE))}",
        impl=impl,
        flops=6 * m * n * k,
    )


# A gradient penalty on a guide MLP's hidden layer, as WGAN-GP's critic takes it:
# forward, the gradients with create_graph=True, then the backward of the loss plus
# their squares. mpgemm's recorded backward runs its GEMMs by mpgemm.matmul (the
# kernels), autocast's by cuBLAS. Work: 2 forward, 4 the first backward, 4 the loss's
# second, 8 the penalty's (each of the two gradient GEMMs differentiated in both
# operands): 18MNK.
PENALTY_SHAPE = (8192, 4096, 4096) if GPU_SCALE else (64, 48, 32)


@pytest.mark.parametrize("impl", ["mpgemm", "autocast"])
def test_linear_gradient_penalty(run_case, device, impl):
    m, k, n = PENALTY_SHAPE
    forward, _, inputs = _layer(impl, m, k, n, device)

    def step():
        loss = forward().float().square().mean()
        grads = torch.autograd.grad(loss, inputs, create_graph=True)
        (loss + sum(g.float().square().sum() for g in grads)).backward()

    run_case(
        step,
        case=f"gradient penalty {'x'.join(map(str, PENALTY_SHAPE))}",
        impl=impl,
        flops=18 * m * n * k,
    )
