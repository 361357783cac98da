"""``mpgemm.matmul(..., out=...)``, as ``torch.matmul``'s ``out``: the result written into
the tensor given (any strides; the FP64 bar of tests/test_matmul.py) and that tensor
returned, torch's shapes, resizing and refusals."""

import pytest
import torch

import mpgemm
from mpgemm.reference import matmul_ref
from tests.accuracy import assert_within_torch_error
from tests.test_matmul import exact_matmul

NAN = float("nan")


def _outs(m, n, dtype, device):
    """(name, out, buffer): NaN-filled outs laid out three ways, and the buffer each
    lies in (a column slice's neighbours must stay NaN)."""
    plain = torch.full((m, n), NAN, dtype=dtype, device=device)
    column_major = torch.full((n, m), NAN, dtype=dtype, device=device)
    wide = torch.full((m, n + 7), NAN, dtype=dtype, device=device)
    return [
        ("contiguous", plain, plain),
        ("transposed", column_major.t(), column_major),
        ("column slice", wide[:, 3 : 3 + n], wide),
    ]


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("shape", [(64, 64, 64), (33, 7, 130)], ids=["aligned", "unaligned"])
def test_out_receives_the_product_in_any_layout(shape, out_dtype, device):
    pytest.importorskip("triton")
    from tests.accuracy import torch_ops_besides_launches

    m, n, k = shape
    a = torch.randn(m, k, device=device, dtype=torch.float16)
    b = torch.randn(k, n, device=device, dtype=torch.float16)
    exact = exact_matmul(a, b, torch.float16)
    baseline = matmul_ref(a, b, compute_dtype=torch.float16, out_dtype=out_dtype)
    for name, out, buffer in _outs(m, n, out_dtype or torch.float16, device):
        with torch_ops_besides_launches() as ops:  # the kernel writes out: no copy
            result = mpgemm.matmul(a, b, out_dtype=out_dtype, out=out)
        assert result is out, name
        assert not [op for op in ops if "copy" in op], f"{name}: {ops}"
        assert_within_torch_error(out, exact, baseline, name)
        assert buffer.isnan().sum() == buffer.numel() - m * n, f"{name}: written outside out"


# (a's shape, b's shape, out's layout): torch.matmul's vector and batch cases; an out of
# a 2-D b's product whose dimensions do not merge into rows, and the batched products,
# are computed, then copied in.
SHAPES = [
    ((16,), (16, 12), "contiguous"),
    ((8, 16), (16,), "contiguous"),
    ((16,), (16,), "contiguous"),
    ((2, 4, 16), (16, 12), "contiguous"),
    ((2, 4, 16), (16, 12), "batch last"),
    ((2, 4, 16), (2, 16, 12), "contiguous"),
    ((16,), (3, 16, 12), "contiguous"),
    ((0, 16), (16, 12), "contiguous"),
]


@pytest.mark.parametrize("a_shape, b_shape, layout", SHAPES)
def test_out_follows_torch_matmuls_shapes(a_shape, b_shape, layout, device):
    a = torch.randn(a_shape, device=device)
    b = torch.randn(b_shape, device=device)
    expected = mpgemm.matmul(a, b)
    assert expected.shape == torch.matmul(a, b).shape
    shape = expected.shape
    if layout == "batch last":  # (2, 4, 12) as a view of a (4, 12, 2) buffer
        out = torch.full((*shape[1:], shape[0]), NAN, dtype=torch.float16, device=device)
        out = out.permute(2, 0, 1)
    else:
        out = torch.full(shape, NAN, dtype=torch.float16, device=device)
    assert mpgemm.matmul(a, b, out=out) is out
    assert torch.equal(out, expected)


def test_out_is_resized_as_torch_resizes_it(device, recwarn):
    a, b = torch.randn(8, 16, device=device), torch.randn(16, 12, device=device)
    for matmul, dtype in ((torch.matmul, torch.float32), (mpgemm.matmul, torch.float16)):
        # From zero elements silently; an out with elements too, with a warning.
        empty = torch.empty(0, dtype=dtype, device=device)
        assert matmul(a, b, out=empty).shape == (8, 12)
        assert not [w for w in recwarn if issubclass(w.category, UserWarning)]
        out = torch.empty(3, dtype=dtype, device=device)
        with pytest.warns(UserWarning, match="resized"):
            matmul(a, b, out=out)
        assert out.shape == (8, 12)


def test_out_is_refused_where_torch_refuses_it_and_for_another_dtype(device):
    a, b = torch.randn(8, 16, device=device), torch.randn(16, 12, device=device)
    out = torch.empty(8, 12, dtype=torch.float16, device=device)
    with pytest.raises(TypeError, match=r"out has dtype torch\.float32, the result torch\.float16"):
        mpgemm.matmul(a, b, out=out.float())
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        mpgemm.matmul(a, b, out=[0.0])
    with pytest.raises(ValueError, match="out on meta"):
        mpgemm.matmul(a, b, out=torch.empty(8, 12, dtype=torch.float16, device="meta"))
    expanded = torch.empty(1, 12, dtype=torch.float16, device=device).expand(8, 12)
    with pytest.raises(RuntimeError, match="share memory"):
        mpgemm.matmul(a, b, out=expanded)
    # Autograd records no product into an out, torch's or ours.
    grad = a.clone().requires_grad_()
    for matmul, given in ((torch.matmul, out.float()), (mpgemm.matmul, out)):
        with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
            matmul(grad, b, out=given)
    with torch.no_grad():
        assert mpgemm.matmul(grad, b, out=out) is out


def test_an_out_over_an_operand_gets_the_product_of_the_operands_as_they_were(device):
    # Several tiles each way, so that a tile written early would be read by later ones.
    a = torch.randn(160, 160, device=device, dtype=torch.float16)
    b = torch.randn(160, 160, device=device, dtype=torch.float16)
    expected = mpgemm.matmul(a, b)
    assert mpgemm.matmul(a, b, out=a) is a
    assert torch.equal(a, expected)
    expected = mpgemm.matmul(a, b)
    mpgemm.matmul(a, b, out=b)
    assert torch.equal(b, expected)


def test_an_out_whose_values_are_not_its_memorys_is_written_as_torchs_is(device):
    # A negative view's values are its memory's negated: written by the kernels, or by
    # torch's copy_ from FP32 (which writes the negation), the product came out with
    # the wrong sign. A zero tensor has no memory: torch's copy_ refuses it, as
    # torch.matmul does.
    a = torch.randn(33, 40, device=device, dtype=torch.float16)
    b = torch.randn(40, 24, device=device, dtype=torch.float16)
    out = torch._neg_view(torch.full((33, 24), NAN, device=device, dtype=torch.float16))
    assert mpgemm.matmul(a, b, out=out) is out
    assert out.is_neg() and torch.equal(out, mpgemm.matmul(a, b))
    zero = torch._efficientzerotensor(33, 24, device=device, dtype=torch.float16)
    for matmul in (mpgemm.matmul, torch.matmul):  # (torch's copy_ and matmul word it apart)
        with pytest.raises(RuntimeError, match="ZeroTensors are immutable"):
            matmul(a, b, out=zero)


def test_an_inference_out_is_written_only_within_inference_mode(device):
    # An inference tensor (made under torch.inference_mode) keeps no version counter:
    # torch's in-place ops, and so torch.matmul's out, raise for one outside that mode
    # (after writing it, as torch's copy_ does). The kernels, writing memory, wrote it
    # silently, where the reference's copy_ raised: now both raise torch's error; within
    # the mode, it is written.
    a = torch.randn(33, 40, device=device, dtype=torch.float16)
    b = torch.randn(40, 24, device=device, dtype=torch.float16)
    with torch.inference_mode():
        out = torch.full((33, 24), NAN, device=device, dtype=torch.float16)
    for matmul in (mpgemm.matmul, torch.matmul):
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside"):
            matmul(a, b, out=out)
    with torch.inference_mode():
        out.fill_(NAN)
        assert mpgemm.matmul(a, b, out=out) is out
    assert torch.equal(out, mpgemm.matmul(a, b))


def test_a_compiled_product_into_out_matches_eager(device):
    torch._dynamo.reset()
    a, b = torch.randn(8, 16, device=device), torch.randn(16, 12, device=device)
    compiled = torch.compile(lambda a, b, out: mpgemm.matmul(a, b, out=out), fullgraph=True)
    out = torch.full((8, 12), NAN, dtype=torch.float16, device=device)
    assert compiled(a, b, out) is out
    assert torch.equal(out, mpgemm.matmul(a, b))
