"""mpgemm.matmul against FP64, with torch's own product of the rounded operands as the bar."""

import itertools

import pytest
import torch

import mpgemm
from mpgemm.reference import gemm_ref, matmul_ref, round_to
from tests.accuracy import assert_within_torch_error, nan_padded

SIZES = [1, 7, 16, 33, 130, 257]
# Every size in every position (M, N, K) twice, with other sizes beside it.
SHAPES = [(SIZES[i], SIZES[(i + 1) % 6], SIZES[(i + 2) % 6]) for i in range(6)] + [
    (SIZES[i], SIZES[(i + 4) % 6], SIZES[(i + 3) % 6]) for i in range(6)
]
INPUT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
COMPUTE_DTYPES = [torch.float16, torch.bfloat16]


def exact_matmul(a, b, compute_dtype):
    """The FP64 product of the operands rounded to compute_dtype: the math claimed."""
    return round_to(a, compute_dtype).double() @ round_to(b, compute_dtype).double()


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("compute_dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_matmul_matches_fp64(case, compute_dtype, out_dtype, device):
    m, n, k = SHAPES[case]
    # Layouts and input dtypes rotate through the cases; all operands sit in NaN padding.
    a_transposed, b_transposed = [(False, False), (True, False), (False, True), (True, True)][
        case % 4
    ]
    dtype = INPUT_DTYPES[case % 3]
    a = nan_padded(torch.randn(m, k, device=device, dtype=dtype), a_transposed)
    b = nan_padded(torch.randn(k, n, device=device, dtype=dtype), b_transposed)

    out = mpgemm.matmul(a, b, compute_dtype=compute_dtype, out_dtype=out_dtype)

    assert out.dtype == (out_dtype or compute_dtype)
    baseline = matmul_ref(a, b, compute_dtype=compute_dtype, out_dtype=out_dtype)
    assert_within_torch_error(out, exact_matmul(a, b, compute_dtype), baseline, f"{m}x{n}x{k}")


@pytest.mark.parametrize("compute_dtype", COMPUTE_DTYPES)
def test_matmul_is_close_to_the_unrounded_fp64_product(compute_dtype, device):
    """The end-to-end error, operand rounding included, is that of 16-bit operands."""
    a = torch.randn(130, 257, device=device)
    b = torch.randn(257, 33, device=device)
    exact = a.double() @ b.double()
    out = mpgemm.matmul(a, b, compute_dtype=compute_dtype, out_dtype=torch.float32)
    relative = ((out.double() - exact).norm() / exact.norm()).item()
    unit_roundoff = torch.finfo(compute_dtype).eps / 2
    assert relative < 2 * unit_roundoff


@pytest.mark.parametrize("compute_dtype", COMPUTE_DTYPES)
def test_the_references_round_each_operand_once_and_accumulate_in_fp32(compute_dtype, device):
    """The references, against FP64 of operands rounded here: ``matmul_ref`` and
    ``linear_ref`` (public, and the bar every GEMM test holds the kernels to: a looser
    reference would loosen every test) and ``gemm_ref`` (what CPU tensors run without
    the interpreter), each within FP32 accumulation's error, where an operand left
    unrounded, or the bias rounded, is 16-bit rounding off."""
    a = torch.randn(37, 70, device=device)
    b = torch.randn(70, 29, device=device)
    bias = torch.randn(29, device=device)
    f32 = torch.float32
    exact = a.to(compute_dtype).double() @ b.to(compute_dtype).double()
    biased = exact + bias.double()
    got = {
        "matmul_ref": (matmul_ref(a, b, compute_dtype=compute_dtype, out_dtype=f32), exact),
        "linear_ref": (
            mpgemm.linear_ref(a, b.t(), bias, compute_dtype=compute_dtype, out_dtype=f32),
            biased,
        ),
        "gemm_ref": (
            gemm_ref(a, b, compute_dtype=compute_dtype, out_dtype=f32, bias=bias)[0],
            biased,
        ),
    }
    for name, (out, want) in got.items():
        assert out.dtype == f32, name
        bound = 1e-5 * want.abs().max().item()
        torch.testing.assert_close(out.double(), want, rtol=0.0, atol=bound, msg=name)


@pytest.mark.parametrize(
    "dtypes, chosen",
    [
        ((torch.bfloat16, torch.bfloat16), torch.bfloat16),
        ((torch.float32, torch.bfloat16), torch.bfloat16),
        ((torch.float16, torch.bfloat16), torch.bfloat16),
        ((torch.float16, torch.float16), torch.float16),
        ((torch.float32, torch.float32), torch.float16),
    ],
)
def test_the_default_compute_dtype_keeps_bf16_operands_in_bf16(device, dtypes, chosen):
    """compute_dtype=None: BF16 where an operand is BF16, as torch computes BF16 in
    BF16 (rounded to FP16, a BF16 value beyond 65504 becomes inf), else FP16; for the
    product, the layer function, both shapes of b, and the references alike."""
    # Values beyond FP16's range in the BF16 operand (b where both are), products some
    # 1e6; 1e3 within it.
    scale_a = 1.0 if dtypes[1] == torch.bfloat16 else 30.0
    scale_b = 3e5 if dtypes[1] == torch.bfloat16 else 30.0
    a = (torch.rand(9, 33, device=device) * scale_a).to(dtypes[0])
    b = (torch.rand(33, 16, device=device) * scale_b).to(dtypes[1])
    batched = (torch.rand(2, 33, 16, device=device) * scale_b).to(dtypes[1])
    results = {
        "matmul": (mpgemm.matmul(a, b), matmul_ref(a, b, compute_dtype=chosen)),
        "batched": (mpgemm.matmul(a, batched), matmul_ref(a, batched, compute_dtype=chosen)),
        "linear": (mpgemm.linear(a, b.t()), mpgemm.linear_ref(a, b.t(), compute_dtype=chosen)),
        "matmul_ref": (matmul_ref(a, b), matmul_ref(a, b, compute_dtype=chosen)),
        "linear_ref": (mpgemm.linear_ref(a, b.t()), matmul_ref(a, b, compute_dtype=chosen)),
    }
    for name, (got, want) in results.items():
        assert got.dtype == chosen, name
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, msg=name)
    if chosen == torch.bfloat16:  # asked for, FP16 is still what runs
        forced = mpgemm.matmul(a, b, compute_dtype=torch.float16)
        assert forced.dtype == torch.float16 and torch.isinf(forced).any()


def test_batched_and_non_contiguous_a(device):
    a = torch.randn(7, 3, 33, device=device).transpose(0, 1)  # (3, 7, 33), not contiguous
    b = torch.randn(33, 16, device=device)
    out = mpgemm.matmul(a, b, out_dtype=torch.float32)
    assert out.shape == (3, 7, 16)
    exact = exact_matmul(a, b, torch.float16)
    assert_within_torch_error(out, exact, matmul_ref(a, b, out_dtype=torch.float32), "batched")


def test_one_dimensional_a_follows_torch_matmul(device):
    a = torch.randn(33, device=device)
    b = torch.randn(33, 7, device=device)
    out = mpgemm.matmul(a, b, out_dtype=torch.float32)
    assert out.shape == torch.matmul(a, b).shape == (7,)
    exact = exact_matmul(a, b, torch.float16)
    assert_within_torch_error(out, exact, matmul_ref(a, b, out_dtype=torch.float32), "1-D a")


@pytest.mark.parametrize("m, n, k", [(0, 7, 16), (7, 0, 16), (7, 16, 0), (0, 0, 0)])
def test_zero_size_dimensions(m, n, k, device):
    a = torch.randn(m, k, device=device, requires_grad=True)
    b = torch.randn(k, n, device=device, requires_grad=True)
    out = mpgemm.matmul(a, b, out_dtype=torch.float32)
    assert out.shape == (m, n)
    assert torch.equal(out, torch.zeros(m, n, device=device))
    out.sum().backward()
    assert torch.equal(a.grad, torch.zeros_like(a))
    assert torch.equal(b.grad, torch.zeros_like(b))


def test_rows_of_no_elements_under_batch_dimensions(device):
    """(2, 3, 0) @ (0, 4): zeros of shape (2, 3, 4), as torch's; the batch dimensions are
    merged into rows with explicit sizes (reshape(-1, 0) is ambiguous for a tensor of no
    elements, and raises)."""
    a = torch.randn(2, 3, 0, device=device, requires_grad=True)
    b = torch.randn(0, 4, device=device, requires_grad=True)
    out = mpgemm.matmul(a, b, out_dtype=torch.float32)
    assert torch.equal(out, torch.zeros(2, 3, 4, device=device))
    out.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    y = mpgemm.linear(a.detach(), b.detach().t(), torch.ones(4, device=device))
    assert torch.equal(y.float(), torch.ones(2, 3, 4, device=device))


@pytest.mark.parametrize(
    "compute_dtype, shape", list(itertools.product(COMPUTE_DTYPES, [(33, 7, 130), (1, 257, 16)]))
)
def test_matmul_gradients(compute_dtype, shape, device):
    m, n, k = shape
    a = torch.randn(m, k, device=device, requires_grad=True)
    b = torch.randn(k, n, device=device, requires_grad=True)
    grad_out = torch.randn(m, n, device=device).to(compute_dtype)

    mpgemm.matmul(a, b, compute_dtype=compute_dtype).backward(grad_out)

    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    (a64 @ b64).backward(grad_out.double())
    a_ref, b_ref = (t.detach().requires_grad_() for t in (a, b))
    matmul_ref(a_ref, b_ref, compute_dtype=compute_dtype).backward(grad_out)
    assert a.grad.dtype == b.grad.dtype == torch.float32
    # b.grad must come back in b's own layout, as autograd's accumulation expects.
    assert b.grad.stride() == b.stride()
    assert_within_torch_error(a.grad, a64.grad, a_ref.grad, "grad a")
    assert_within_torch_error(b.grad, b64.grad, b_ref.grad, "grad b")


def test_bf16_subnormal_operands(device):
    # 1e-39 is a BF16 subnormal: rounded, multiplied and accumulated exactly as torch
    # does with the same rounded operands (the interpreter used to give 5.9e-39).
    a = torch.tensor([[1e-39, 3e-39], [-2e-40, 1.0]], device=device)
    b = torch.tensor([[1.0, 0.5], [1.0, 2.0]], device=device)
    out = mpgemm.matmul(a, b, compute_dtype=torch.bfloat16, out_dtype=torch.float32)
    expected = a.bfloat16().float() @ b.bfloat16().float()
    assert torch.equal(out, expected)


def test_operands_whose_values_are_not_their_memorys_multiply_as_torchs(device):
    # A negative view (z.conj().imag: its values the negation of its memory's) and a
    # zero tensor (no memory at all), in a product and a layer, forward and backward:
    # the reference path's torch ops read them as torch does, where the kernels read
    # the memory (the negative view's product came out with the wrong sign).
    z = torch.randn(24, 40, dtype=torch.complex64, device=device)
    negative = z.conj().imag
    assert negative.is_neg()
    b = torch.randn(40, 32, device=device)
    zeros = torch._efficientzerotensor((40, 32), device=device)
    for a, w, a_values, w_values in [
        (negative, b, -z.imag, b),
        (z.real, zeros, z.real, torch.zeros(40, 32, device=device)),
    ]:
        exact = exact_matmul(a_values, w_values, torch.float16)
        ref = matmul_ref(a_values, w_values)
        assert_within_torch_error(mpgemm.matmul(a, w), exact, ref, "matmul")
        assert_within_torch_error(mpgemm.linear(a, w.t()), exact, ref, "linear")
    # The gradient through a negative view of x: -(dC @ W.T).
    x = z.imag.clone().requires_grad_()
    weight = b.clone().requires_grad_()
    out = mpgemm.matmul(torch._neg_view(x), weight, out_dtype=torch.float32)
    grad = torch.randn_like(out)
    out.backward(grad)
    exact = -exact_matmul(grad, weight.detach().t(), torch.float16)
    ref = -matmul_ref(grad, weight.detach().t(), out_dtype=torch.float32)
    assert_within_torch_error(x.grad, exact, ref, "x's gradient")
