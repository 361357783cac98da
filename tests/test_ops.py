"""mpgemm's custom ops (``mpgemm.ops``) pass torch's own checks of a custom op,
``torch.library.opcheck``: the schema names every argument the op writes (a write it
does not declare lets a compiled graph reuse a stale value), the fake implementation
gives the real outputs' shapes, dtypes and strides, and the op traces under AOT
autograd. Each op runs its real implementation (the kernels, through the interpreter
on the CPU), with the arguments that make it write the most: a loss scale, so that the
optimizer steps unscale the gradients in place."""

import pytest
import torch

import mpgemm.ops  # registers torch.ops.mpgemm

f16, f32 = torch.float16, torch.float32


def _randn(*shape, dtype=f32):
    return torch.randn(*shape, device="cuda" if torch.cuda.is_available() else "cpu").to(dtype)


def _scalar(value, dtype=f32):
    return torch.tensor(value, dtype=dtype, device=_randn(1).device)


def _scaler():
    """(grad_scale, found_inf) of a step that is taken."""
    return _scalar(4.0), _scalar(0.0)


def _linear_backward(need_x, need_w, need_b):
    return (
        torch.ops.mpgemm.linear_backward.default,
        _randn(16, 24, dtype=f16),
        _randn(16, 32, dtype=f16),
        _randn(24, 32, dtype=f16),
        [16, 32],
        f16,
        f32,
        f16,
        need_x,
        need_w,
        need_b,
    )


def _activation_backward(activation, bias_grad):
    op = torch.ops.mpgemm.activation_backward.default
    return op, _randn(16, 24, dtype=f16), _randn(16, 24, dtype=f16), activation, f16, bias_grad


# Each op with arguments: the op and the tensors it takes, then its other arguments.
CASES = {
    "gemm": lambda: (
        torch.ops.mpgemm.gemm.default,
        _randn(16, 32, dtype=f16),
        _randn(32, 24, dtype=f16),
        f16,
        f32,
        _randn(24),
        "gelu",
        True,
        True,
    ),
    # A batch of products: a broadcast over b's batch (stride 0), FP16 into FP32.
    "gemm batched": lambda: (
        torch.ops.mpgemm.gemm.default,
        _randn(16, 32, dtype=f16).expand(3, 16, 32),
        _randn(3, 32, 24, dtype=f16),
        f16,
        f32,
        None,
        None,
        False,
        False,
    ),
    # Their sum, (16, 24): the gradient of an operand broadcast over the whole batch.
    "gemm batched sum": lambda: (
        torch.ops.mpgemm.gemm.default,
        _randn(3, 16, 32, dtype=f16),
        _randn(3, 32, 24, dtype=f16),
        f16,
        f16,
        None,
        None,
        False,
        False,
        True,
    ),
    "linear_backward": lambda: _linear_backward(True, True, True),
    # Gradients not asked for: empty results, as their fakes say (the batched gemm's
    # G and R above, too).
    "linear_backward of the weight alone": lambda: _linear_backward(False, True, False),
    "activation_backward": lambda: _activation_backward("relu", True),
    "activation_backward without the bias gradient": lambda: _activation_backward("gelu", False),
    "unscale_": lambda: (
        torch.ops.mpgemm.unscale_.default,
        [_randn(8), _randn(5, dtype=f16)],
        _scalar(0.0),
        _scalar(0.5),
        [_randn(8), _randn(5)],
    ),
    "update_scale_": lambda: (
        torch.ops.mpgemm.update_scale_.default,
        _scalar(4.0),
        _scalar(0, torch.int32),
        _scalar(0.0),
        2.0,
        0.5,
        3,
        _scalar(0, torch.int64),
    ),
    # params, grads, buffers, copies, step counts; lr, momentum, dampening, weight decay
    # (each with its tensor), nesterov, maximize, grad_scale, found_inf
    "sgd_step_": lambda: (
        torch.ops.mpgemm.sgd_step_.default,
        *_sgd_lists(),
        *(0.1, None, 0.9, None, 0.5, None, 0.01, None, False, False),
        *_scaler(),
    ),
    "sgd_step_ tensors": lambda: (
        torch.ops.mpgemm.sgd_step_.default,
        *_sgd_lists(),
        *(0.0, _scalar(0.1), 0.0, _scalar(0.9), 0.0, _scalar(0.5), 0.0, _scalar(0.01)),
        *(False, False, *_scaler()),
    ),
    # params, grads, moments, steps, copies, AMSGrad's maxima; lr, beta1, beta2, eps,
    # weight decay (each with its tensor), decoupled, maximize, grad_scale, found_inf
    "adam_step_": lambda: (
        torch.ops.mpgemm.adam_step_.default,
        *_adam_lists(),
        *(0.1, None, 0.9, None, 0.99, None, 1e-8, None, 0.01, None, False, False),
        *_scaler(),
    ),
    "adam_step_ tensors": lambda: (
        torch.ops.mpgemm.adam_step_.default,
        *_adam_lists(),
        *(0.0, _scalar(0.1), 0.0, _scalar(0.9), 0.0, _scalar(0.99)),
        *(0.0, _scalar(1e-8), 0.0, _scalar(0.01), False, False, *_scaler()),
    ),
}


def _sgd_lists():
    return [_randn(8)], [_randn(8)], [_randn(8)], [_randn(8, dtype=f16)], [_scalar(2.0)]


def _adam_lists():
    lists = [_randn(8)], [_randn(8)], [_randn(8)], [_randn(8).abs()], [_scalar(1.0)]
    return *lists, [_randn(8, dtype=f16)], [_randn(8).abs()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_custom_op_passes_torchs_opcheck(name):
    op, *args = CASES[name]()
    result = torch.library.opcheck(op, tuple(args))
    assert set(result.values()) == {"SUCCESS"}, result


def test_every_op_is_checked():
    assert {name.split()[0] for name in CASES} == set(mpgemm.ops.__all__)
