"""Split-K: a GEMM whose tile grid would leave most SMs idle (the head's weight gradient:
10 x 4096 over a batch of 8192) splits K over more programs, each writing an FP32
partial, summed in a fixed order by a second kernel: as accurate as one pass, and the
same bits run to run."""

import pytest
import torch

from mpgemm.reference import gemm_ref, round_to
from tests.accuracy import (
    assert_sum_within_torch_error,
    assert_within_torch_error,
    launched_kernels,
    nan_padded,
)

pytest.importorskip("triton")

from mpgemm.kernels import gemm  # noqa: E402
from mpgemm.kernels.launches import intercept, jit_function  # noqa: E402


def test_the_heads_weight_gradient_is_split_and_large_grids_are_not():
    cpu = torch.device("cpu")  # counted as an H100's 132 SMs
    assert gemm.split_k_for(10, 4096, 8192, cpu) == 8  # 32 tiles -> 256 programs
    assert gemm.split_k_for(4096, 4096, 8192, cpu) == 1  # 1024 tiles fill the GPU
    assert gemm.split_k_for(10, 4096, 512, cpu) == 1  # too little K to share


@pytest.mark.parametrize("splits", [2, 3])
def test_split_k_weight_gradient_within_the_bar_and_deterministic(device, monkeypatch, splits):
    monkeypatch.setattr(gemm, "split_k_for", lambda m, n, k, device: splits)
    m, n, k = 10, 70, 300  # K = 300 is not a multiple of any BLOCK_K
    dy_t = nan_padded(torch.randn(k, m, device=device), transposed=True).t()  # dY.T, a view
    x = nan_padded(torch.randn(k, n, device=device, dtype=torch.float16))
    out = torch.empty(m, n, device=device)  # NaN-poisoned: every element must be written
    args = dict(compute_dtype=torch.float16, out_dtype=torch.float32, rowsum_a=True)
    names, (c, _, r) = launched_kernels(lambda: gemm.triton_gemm(dy_t, x, **args, out=out))
    assert names == ["_gemm_kernel", "_split_k_reduce_kernel"]
    ref_c, _, ref_r = gemm_ref(dy_t, x, **args)
    a = dy_t.double()
    exact = round_to(a, torch.float16).double() @ x.double()
    assert_within_torch_error(c, exact, ref_c, "split-K product")
    assert_sum_within_torch_error(r, a, ref_r, "split-K row sums", dim=1)
    again = gemm.triton_gemm(dy_t, x, **args)
    assert torch.equal(again[0], c) and torch.equal(again[2], r)


def test_split_k_leaves_launches_with_an_epilogue_whole(device, monkeypatch):
    monkeypatch.setattr(gemm, "split_k_for", lambda m, n, k, device: 4)
    a, b = torch.randn(16, 300, device=device), torch.randn(300, 8, device=device)
    names, _ = launched_kernels(
        lambda: gemm.triton_gemm(
            a,
            b,
            compute_dtype=torch.float16,
            out_dtype=torch.float32,
            bias=torch.randn(8, device=device),
            activation="relu",
        )
    )
    assert names == ["_gemm_kernel"]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("m, swapped", [(1, True), (10, True), (16, True), (17, False)])
def test_a_product_of_few_rows_runs_as_its_transpose_within_the_bar(
    device, monkeypatch, splits, m, swapped
):
    """At most 16 rows (a head's weight gradient, 10 classes): the kernel computes
    C.T = B.T @ A.T (its rows are B's columns) and the row sums of A as the column
    sums of A.T; C is written through the transposed strides of the output given."""
    monkeypatch.setattr(gemm, "split_k_for", lambda m, n, k, device: splits)
    n, k = 70, 300
    dy_t = nan_padded(torch.randn(k, m, device=device), transposed=True).t()  # dY.T
    x = nan_padded(torch.randn(k, n, device=device, dtype=torch.float16))
    out = torch.empty(m, n, device=device)  # NaN-poisoned: every element must be written
    args = dict(compute_dtype=torch.float16, out_dtype=torch.float32, rowsum_a=True)
    launched = []

    def run_and_keep(kernel, grid, launch_args, kwargs, configs):
        named = dict(zip(jit_function(kernel).arg_names, launch_args, strict=False))
        launched.append({**named, **kwargs})
        kernel[grid](*launch_args, **kwargs)

    with intercept(run_and_keep):
        c, _, r = gemm.triton_gemm(dy_t, x, **args, out=out)
    gemm_launch = launched[0]
    assert gemm_launch["M"] == (n if swapped else m)
    assert gemm_launch["K_SUMS"] == ("b" if swapped else "a")
    assert len(launched) == (2 if splits > 1 else 1)
    ref_c, _, ref_r = gemm_ref(dy_t, x, **args)
    exact = round_to(dy_t, torch.float16).double() @ x.double()
    assert c is out
    assert_within_torch_error(c, exact, ref_c, "product")
    assert_sum_within_torch_error(r, dy_t, ref_r, "row sums", dim=1)
