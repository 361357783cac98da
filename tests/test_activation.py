"""The fused activation backward (``mpgemm.kernels.activation``) through the interpreter
against its reference, ``activation_backward_ref`` (torch's threshold_backward, or the
FP32 product, and torch.sum): dZ bit for bit, NaN and inf included, with operands read
through strides out of NaN-padded buffers; the bias gradient against FP64 with the
reference's error as the bar, over several chunks of rows, the same run to run."""

import pytest
import torch

from mpgemm.reference import activation_backward_ref
from tests.accuracy import assert_same_bits, assert_within_torch_error, launched_kernels, nan_padded

pytest.importorskip("triton")

from mpgemm.kernels import activation as kernel_module  # noqa: E402
from mpgemm.kernels.activation import triton_activation_backward  # noqa: E402

# Ragged against the kernel's 32-row steps and 128-column blocks.
M, N = 75, 200


def _operands(activation, dtype, device, transposed):
    grad_y = nan_padded(torch.randn(M, N, device=device).to(dtype), transposed)
    if activation == "relu":
        y = torch.randn(M, N, device=device).relu().to(dtype)  # zeros where masked
        saved = nan_padded(y, not transposed)
    else:
        saved = nan_padded(torch.rand(M, N, device=device) * 1.2 - 0.1, not transposed)
    return grad_y, saved


@pytest.mark.parametrize("bias_grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_matches_the_reference(activation, dtype, bias_grad, device, monkeypatch):
    # 4 programs per SM on 2 "SMs" over 2 column blocks: 4 chunks of 32 rows.
    monkeypatch.setattr(kernel_module, "multiprocessors", lambda device: 2)
    torch.manual_seed(0)
    grad_y, saved = _operands(activation, dtype, device, transposed=bias_grad)
    names, (dz, db) = launched_kernels(
        lambda: triton_activation_backward(grad_y, saved, activation, dtype, bias_grad=bias_grad)
    )
    assert names == ["_activation_backward_kernel"]
    ref_dz, ref_db = activation_backward_ref(grad_y, saved, activation, dtype, bias_grad=bias_grad)
    assert dz.is_contiguous() and dz.dtype == ref_dz.dtype == dtype
    assert_same_bits(dz, ref_dz, "dZ")
    if not bias_grad:
        assert db is None
        return
    exact = grad_y.double() * (saved > 0 if activation == "relu" else saved.double())
    assert_within_torch_error(db, exact.sum(0), ref_db, "bias gradient")
    again = triton_activation_backward(grad_y, saved, activation, dtype, bias_grad=True)
    assert torch.equal(again[0], dz) and torch.equal(again[1], db)


def test_nan_and_inf_pass_as_through_torchs_ops(device):
    # threshold_backward's rule: zero where y <= 0 (-0.0 included), dY where y is NaN;
    # a NaN or inf dY passes where y > 0. GELU multiplies: inf * 0 is NaN.
    grad_y = torch.tensor([[1.0, float("nan"), float("inf"), 2.0, -3.0, float("nan")]] * 3)
    y = torch.tensor([[float("nan"), 1.0, 2.0, 0.0, -0.0, -1.0]] * 3)
    g = torch.tensor([[0.5, 1.0, 0.0, float("nan"), 1.0, 0.0]] * 3)
    for activation, saved in (("relu", y.half()), ("gelu", g)):
        dy = grad_y.half().to(device)
        got = triton_activation_backward(
            dy, saved.to(device), activation, torch.float16, bias_grad=True
        )
        want = activation_backward_ref(
            dy, saved.to(device), activation, torch.float16, bias_grad=True
        )
        assert_same_bits(got[0], want[0], f"{activation} dZ")
        assert_same_bits(got[1], want[1], f"{activation} bias gradient")


def test_a_broadcast_gradient_and_empty_shapes(device):
    # The gradient of y.sum() arrives expanded (strides 0): read through its strides.
    y = torch.randn(40, 16, device=device).relu().half()
    grad_y = torch.ones((), device=device, dtype=torch.float16).expand(40, 16)
    dz, db = triton_activation_backward(grad_y, y, "relu", torch.float16, bias_grad=True)
    assert torch.equal(dz, (y > 0).half()) and torch.equal(db, (y > 0).float().sum(0))
    for m, n in ((0, 16), (40, 0)):
        empty = torch.empty(m, n, device=device, dtype=torch.float16)
        dz, db = triton_activation_backward(empty, empty, "relu", torch.float16, bias_grad=True)
        assert dz.shape == (m, n) and torch.equal(db, torch.zeros(n, device=device))
