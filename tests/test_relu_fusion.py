"""A ReLU's backward in the epilogue of the GEMM that makes its output's gradient.

The kernels: both GEMMs' ReLU mask (``relu_output``) and C's column sums (``colsum_c``)
against FP64, with torch's own product of the same 16-bit operands as the bar, NaN
around every operand, a NaN and a -0.0 in y, and partial rows of one and of two per
tile.
"""

from __future__ import annotations

import pytest
import torch

from mpgemm.reference import gemm_ref
from tests.accuracy import (
    assert_same_bits,
    assert_sum_within_torch_error,
    assert_within_torch_error,
    launched_kernels,
    nan_padded,
)

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from mpgemm.kernels import gemm, gemm_common, gemm_tma  # noqa: E402

# M, K, N: ragged against the interpreter's 32x32x32 tiles.
M, K, N = 72, 112, 48


def _relu_output(dtype, device):
    """A ReLU's output, (M, N) in ``dtype``, NaN around it: zeros where z < 0, a NaN
    (threshold_backward passes the gradient on) and a -0.0 (it masks it)."""
    y = torch.relu(torch.randn(M, N, device=device)).to(dtype)
    y[0, :5] = float("nan")
    y[1, :5] = -0.0
    return nan_padded(y, aligned=True)


@pytest.mark.parametrize("summed_rows", [32, 16])  # a tile's 32 rows: 1 or 2 partial rows
@pytest.mark.parametrize("kernel", ["tma", "tma, stored in halves", "pointer"])
@pytest.mark.parametrize("compute_dtype", [torch.float16, torch.bfloat16])
def test_the_masked_product_and_its_column_sums_within_the_bar(
    kernel, compute_dtype, summed_rows, device, monkeypatch
):
    monkeypatch.setattr(gemm, "multiprocessors", lambda device: 3)  # tiles a program: 4
    monkeypatch.setattr(gemm, "COLUMN_SUM_ROWS", summed_rows)
    monkeypatch.setattr(gemm_common, "_SUM_ROWS", tl.constexpr(summed_rows))
    if kernel.endswith("halves"):
        monkeypatch.setattr(gemm_tma, "EPILOGUE_SCRATCH", 1024)
    torch.manual_seed(0)
    a = nan_padded(torch.randn(M, K, device=device).to(compute_dtype), aligned=True)
    b = nan_padded(torch.randn(K, N, device=device).to(compute_dtype), aligned=True)
    y = _relu_output(compute_dtype, device)
    kwargs = dict(compute_dtype=compute_dtype, out_dtype=compute_dtype, relu_output=y)

    def product():
        with gemm.use_kernel(kernel.split(",")[0]):
            return gemm.triton_gemm(a, b, colsum_c=True, **kwargs)

    names, (c, g, r) = launched_kernels(product)
    assert names == ["_gemm_kernel" if kernel == "pointer" else "_gemm_tma_kernel"]
    assert g is None and r.shape == (N,) and r.dtype == torch.float32
    ref_c, _, ref_r = gemm_ref(a, b, colsum_c=True, **kwargs)
    masked = y <= 0
    exact = (a.double() @ b.double()).masked_fill(masked, 0)
    assert_within_torch_error(c, exact, ref_c, "masked product")
    assert (c[masked] == 0).all() and (c[~masked] != 0).all()
    assert_sum_within_torch_error(r, c, ref_r, "column sums", dim=0)
    # Again: the same bits (the sums' counters were left at zero); without the sums, the
    # same product. (Replays, which the interpreter's launches skip, are compared with
    # launches decided anew in test_launches, compiled, on a step of ReLU layers.)
    c2, _, r2 = product()
    assert_same_bits(c2, c, "the product again")
    assert_same_bits(r2, r, "the column sums again")
    with gemm.use_kernel(kernel.split(",")[0]):
        c3, _, r3 = gemm.triton_gemm(a, b, **kwargs)
    assert r3 is None
    assert_same_bits(c3, c, "product without the sums")


def test_no_rows_sum_to_zeros(device):
    a = torch.randn(0, K, device=device).half()
    b = torch.randn(K, N, device=device).half()
    y = torch.randn(0, N, device=device).half()
    c, _, r = gemm.triton_gemm(
        a, b, compute_dtype=torch.float16, out_dtype=torch.float16, relu_output=y, colsum_c=True
    )
    assert c.shape == (0, N) and torch.equal(r, torch.zeros(N, device=device))
