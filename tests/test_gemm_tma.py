"""The TMA persistent GEMM (``mpgemm.kernels.gemm_tma``) through the interpreter, like the
pointer kernel: every launch kind of a training step (forward with bias, activation and
GELU's or SiLU's input z; the input gradient; the weight gradient reading dZ.T with the bias
gradient's row sums) against FP64 with torch's own 16-bit
product as the bar, operands NaN-padded so that a descriptor reaching outside its
matrix fails, outputs NaN-poisoned, and fewer programs than tiles so the persistent loop
walks several, with each tile stored whole or in quarters; and which launches the
default sends to it."""

import pytest
import torch

import mpgemm
from mpgemm.reference import gemm_ref, torch_activation
from tests.accuracy import (
    assert_sum_within_torch_error,
    assert_within_torch_error,
    launched_kernels,
    nan_padded,
    store_in_parts,
)

pytest.importorskip("triton")


from mpgemm.kernels import gemm, gemm_tma  # noqa: E402
from mpgemm.kernels.gemm_common import tile  # noqa: E402
from mpgemm.kernels.launches import (  # noqa: E402
    count_launches,
    intercept,
    jit_function,
    launch_options,
    named_arguments,
)

COMPUTE_DTYPES = [torch.float16, torch.bfloat16]
# M, K, N: ragged against the interpreter's 32x32x32 tiles and the H100's.
M, K, N = 72, 112, 48


@pytest.fixture(autouse=True)
def few_programs(monkeypatch):
    # 3 programs for the 12 tiles of a 72 x 48 output: each walks 4.
    monkeypatch.setattr(gemm, "multiprocessors", lambda device: 3)


def _operands(kind, dtype, device, shape=(M, K, N)):
    """(a, b, kwargs) of one launch kind, as LinearFunction makes it: 16-bit operands,
    views where the layer has them (W.T, dY.T), each padded with NaN; ``shape`` is
    (M, K, N) of the product."""
    M, K, N = shape  # noqa: N806 - the product's dimensions, as everywhere in this file

    def half(*shape, transposed=False):
        return nan_padded(torch.randn(*shape, device=device).to(dtype), transposed, aligned=True)

    if kind.startswith("forward"):
        activation = kind.split()[1] if " " in kind else None
        bias = torch.randn(N, device=device)
        w = half(N, K)
        return (
            half(M, K),
            w.t(),
            dict(bias=bias, activation=activation, store_preact=activation not in (None, "relu")),
        )
    if kind == "grad_input":  # dX = dZ @ W: A is dZ (M, K), B is W (K, N)
        return half(M, K), half(K, N), {}
    # dW = dZ.T @ X: A is dZ.T, and its row sums are the bias gradient.
    return half(K, M).t(), half(K, N), dict(rowsum_a=True)


KINDS = [
    "forward",
    "forward relu",
    "forward gelu",
    "forward gelu_tanh",
    "forward silu",
    "grad_input",
    "grad_weight",
]


@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("compute_dtype", COMPUTE_DTYPES)
def test_every_launch_kind_within_the_bar(kind, compute_dtype, parts, device, monkeypatch):
    torch.manual_seed(0)
    a, b, kwargs = _operands(kind, compute_dtype, device)
    out_dtype = torch.float32 if kind.startswith("grad_weight") else compute_dtype
    if parts > 1:
        # The interpreter's tiles stored in parts too (an H100's 128x256 FP32 ones are,
        # in quarters).
        store_in_parts(monkeypatch, parts, out_dtype.itemsize)
    names, (c, g, r) = launched_kernels(
        lambda: gemm.triton_gemm(a, b, compute_dtype=compute_dtype, out_dtype=out_dtype, **kwargs)
    )
    assert names == ["_gemm_tma_kernel"]
    ref_c, ref_g, ref_r = gemm_ref(a, b, compute_dtype=compute_dtype, out_dtype=out_dtype, **kwargs)

    a64 = a.double()
    z = a64 @ b.double()
    if "bias" in kwargs:
        z = z + kwargs["bias"].double()
    activation = kwargs.get("activation")
    exact = torch_activation(z, activation)
    assert_within_torch_error(c, exact, ref_c, kind)
    if kwargs.get("store_preact"):  # z, in C's dtype, for GELU's or SiLU's backward
        assert g.dtype == c.dtype
        assert_within_torch_error(g, z, ref_g, f"{kind}: z")
    if kwargs.get("rowsum_a"):
        assert_sum_within_torch_error(r, a64, ref_r, f"{kind}: row sums", dim=1)


@pytest.mark.parametrize("n", [272, 264])
@pytest.mark.parametrize("kind", ["forward relu", "grad_input", "grad_weight"])
def test_every_tile_an_h100_may_choose_within_the_bar(kind, n, device):
    """Each tile that pruning keeps for the launch on an H100 (the autotuner may choose
    any, where the tests stage runs one a launch: among them the 128x256 FP32 tile stored
    in quarters, the 4-stage and the 256-row tiles), launched alone with its config on a
    shape ragged against every one, against FP64 with torch's product as the bar. On a
    GPU this runs each compiled tile; interpreted, each tile's own parts and bounds.
    C's rows 264 elements apart are not 16-aligned: its epilogue's conversion may take
    a whole 16-bit tile, so the 4-stage 128x256 and 256x128 tiles are not kept (on an
    H200 the latter failed to launch, 262,176 bytes of shared memory)."""
    m, k = 328, 200  # 3 programs walk 2 to 8 tiles each
    a, b, kwargs = _operands(kind, torch.float16, device, (m, k, n))
    out_dtype = torch.float32 if kind == "grad_weight" else torch.float16
    args = dict(compute_dtype=torch.float16, out_dtype=out_dtype, **kwargs)
    captured = []
    with intercept(lambda kernel, grid, *launch: captured.append((kernel, grid, *launch[:2]))):
        gemm.triton_gemm(a, b, **args)
    [(kernel, grid, launch_args, launch_kwargs)] = [
        c for c in captured if jit_function(c[0]).fn.__name__ == "_gemm_tma_kernel"
    ]
    named = named_arguments(kernel, launch_args, launch_kwargs)
    flags = {
        f: named[f] for f in ("HAS_BIAS", "ACTIVATION", "STORE_PREACT", "RELU_GRAD", "C_ALIGNED")
    }
    configs = gemm_tma._prune_configs(gemm_tma._hopper_configs(), named, **flags)
    tiles = {tile(config) + (config.num_stages,) for config in configs}
    assert named["C_ALIGNED"] == (n % 16 == 0)
    deep = {(128, 256, 64, 8, 4), (256, 128, 64, 8, 4)} & tiles
    if n % 16 == 0:
        assert len(deep) == 2
    elif out_dtype == torch.float16:
        assert not deep
    c = named["c_ptr"]
    exact = a.double() @ b.double()
    if "bias" in kwargs:
        exact = torch.relu(exact + kwargs["bias"].double())
    baseline, _, _ = gemm_ref(a, b, **args)
    for config in configs:
        c.fill_(float("nan"))
        options = launch_options(kernel, launch_args, launch_kwargs, config)
        jit_function(kernel)[grid](*launch_args, **options)
        assert_within_torch_error(c, exact, baseline, f"{kind}, {config}")


def test_nan_and_inf_propagate_as_in_torch(device):
    a = nan_padded(torch.randn(M, K, device=device).half(), aligned=True)
    b = nan_padded(torch.randn(K, N, device=device).half(), aligned=True)
    a[3, 5], a[7, 9] = float("nan"), float("inf")
    names, (c, _, _) = launched_kernels(
        lambda: gemm.triton_gemm(
            a, b, compute_dtype=torch.float16, out_dtype=torch.float32, activation="relu"
        )
    )
    assert names == ["_gemm_tma_kernel"]
    expected = torch.relu(a.float() @ b.float())
    assert torch.equal(torch.isnan(c), torch.isnan(expected))
    assert torch.equal(torch.isinf(c), torch.isinf(expected))
    assert torch.isnan(c[3]).all()  # ReLU keeps NaN


@pytest.mark.parametrize(
    "case, expected",
    [
        ("16-bit, aligned", "_gemm_tma_kernel"),
        ("FP32 weight", "_gemm_kernel"),  # the TMA kernel converts nothing
        ("a row of 70 halves", "_gemm_kernel"),  # 140 bytes: no descriptor
        ("every 8th column", "_gemm_kernel"),  # no unit stride either way
        ("no K", "_gemm_kernel"),  # an empty dimension: no descriptor
        ("split K", "_gemm_kernel"),
    ],
)
def test_the_default_takes_the_tma_kernel_where_it_can(case, expected, device, monkeypatch):
    a = torch.randn(M, 70 if case.startswith("a row") else K, device=device).half()
    if case == "every 8th column":  # strides (8 K, 8): 16 bytes apart, but none of 1
        a = torch.randn(M, 8 * K, device=device).half()[:, ::8]
    if case == "no K":  # rows 16-byte aligned, with nothing in them
        a = a[:, :0]
    b = torch.randn(a.shape[1], N, device=device)
    b = b if case == "FP32 weight" else b.half()
    if case == "split K":
        monkeypatch.setattr(gemm, "split_k_for", lambda m, n, k, device: 2)
    names, _ = launched_kernels(
        lambda: gemm.triton_gemm(a, b, compute_dtype=torch.float16, out_dtype=torch.float32)
    )
    assert names[0] == expected
    with gemm.use_kernel("pointer"):
        names, _ = launched_kernels(
            lambda: gemm.triton_gemm(a, b, compute_dtype=torch.float16, out_dtype=torch.float32)
        )
    assert names[0] == "_gemm_kernel"
    if expected == "_gemm_kernel":
        with gemm.use_kernel("tma"), pytest.raises(ValueError, match="TMA"):
            gemm.triton_gemm(a, b, compute_dtype=torch.float16, out_dtype=torch.float32)


@pytest.mark.parametrize("batch_stride, expected", [(M * K, "_gemm_tma_kernel"), (M * K + 1, None)])
def test_a_batch_takes_the_tma_kernel_only_with_aligned_matrices(batch_stride, expected, device):
    # Each matrix of a batch starts 16-byte aligned for a descriptor, as each row does:
    # a batch stride of M * K + 1 halves leaves every other one 2 bytes off.
    a = torch.randn(2 * batch_stride, device=device).half()
    a = a.as_strided((2, M, K), (batch_stride, K, 1))
    b = torch.randn(2, K, N, device=device).half()
    names, (c, _, _) = launched_kernels(
        lambda: gemm.triton_gemm(a, b, compute_dtype=torch.float16, out_dtype=torch.float32)
    )
    assert names[0] == (expected or "_gemm_kernel")
    assert (gemm_tma.tma_layout(a, b, torch.float16) is not None) == (expected is not None)
    assert_within_torch_error(c, a.double() @ b.double(), a.float() @ b.float(), "the batch")


@pytest.mark.parametrize(
    "case", ["both FP32", "W.T FP32", "odd K", "A 16-bit", "few uses", "A summed"]
)
@pytest.mark.parametrize("compute_dtype", COMPUTE_DTYPES)
def test_a_large_products_fp32_operands_are_rounded_for_the_tma_kernel(
    case, compute_dtype, device, monkeypatch
):
    # The thresholds at this test's size: a product of M x 100 x N, each operand's
    # elements used at least 48 times ("few uses": A's, N - 1).
    monkeypatch.setattr(gemm, "ROUND_FP32_FLOPS", 2 * M * 100 * N)
    monkeypatch.setattr(gemm, "ROUND_FP32_REUSE", min(M, N))
    torch.manual_seed(0)
    k = 110 if case == "odd K" else K  # 440-byte FP32 rows, 220 bytes rounded: padded
    n = N - 1 if case == "few uses" else N
    a = nan_padded(torch.randn(M, k, device=device))
    if case == "A 16-bit":
        a = nan_padded(a.to(compute_dtype), aligned=True)
    # A weight (out, in) read as W.T: column-major, rounded into a column-major copy.
    b = nan_padded(torch.randn(k, n, device=device), transposed=case == "W.T FP32")
    summed = case == "A summed"  # A's row sums are of its FP32 values: not rounded
    before = a.clone(), b.clone()
    names, (c, _, r) = launched_kernels(
        lambda: gemm.triton_gemm(
            a, b, compute_dtype=compute_dtype, out_dtype=torch.float32, rowsum_a=summed
        )
    )
    rounded = case not in ("few uses", "A summed")
    assert names == ["_gemm_tma_kernel" if rounded else "_gemm_kernel"]
    assert all(torch.equal(t, t0) for t, t0 in zip((a, b), before, strict=True))
    ref_c, _, ref_r = gemm_ref(
        a, b, compute_dtype=compute_dtype, out_dtype=torch.float32, rowsum_a=summed
    )
    assert_within_torch_error(c, a.double() @ b.double(), ref_c, case)
    if summed:
        assert_sum_within_torch_error(r, a, ref_r, f"{case}: row sums", dim=1)
    # The same product rounded in the kernel: the same rounding of every operand.
    with gemm.use_kernel("pointer"):
        names, (c_pointer, _, _) = launched_kernels(
            lambda: gemm.triton_gemm(a, b, compute_dtype=compute_dtype, out_dtype=torch.float32)
        )
    assert names == ["_gemm_kernel"]
    torch.testing.assert_close(c, c_pointer, rtol=1e-5, atol=1e-5)


@pytest.mark.unpoisoned  # (a poisoned allocation's fill would count as a copy)
@pytest.mark.parametrize(
    "shape, rounded",
    [
        ((2048, 2048, 2048), True),  # 2^34 FLOPs: the casts pay (run6: 0.41x without)
        ((8192, 2048, 1024), True),  # A's elements each used 1024 times
        ((1024, 1024, 1024), False),  # 2^31 FLOPs: rounded in the kernel (run6: 0.96x)
        ((8192, 2048, 256), False),  # A's elements each used 256 times, under 512
    ],
    ids=str,
)
def test_which_fp32_products_are_rounded_by_a_cast_at_their_real_sizes(shape, rounded):
    """ROUND_FP32_FLOPS and ROUND_FP32_REUSE as they decide at full size (launches
    counted, not run): a large product of FP32 operands casts both and takes the TMA
    kernel; a smaller one, or one whose operand is read too few times, takes the pointer
    kernel with no cast."""
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    with count_launches() as count:
        mpgemm.matmul(a, b)
    kernel = "_gemm_tma_kernel" if rounded else "_gemm_kernel"
    assert count.triton.get(kernel) == 1, count.triton
    assert count.torch.get("aten.copy_", 0) == (2 if rounded else 0), count.torch


def test_use_kernel_names_the_choices():
    with pytest.raises(ValueError, match="pointer"), gemm.use_kernel("cublas"):
        pass


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_a_layer_backward_on_the_tma_kernel_agrees_with_the_pointer_kernel(activation, device):
    # 16-bit, aligned: the backward's GEMMs are the TMA kernel's, after the activation's
    # kernel has made dZ and the bias gradient.
    import mpgemm

    torch.manual_seed(0)
    x = torch.randn(M, K, device=device).half()
    w = (torch.randn(N, K, device=device) / K**0.5).half()
    bias = torch.randn(N, device=device)
    grad = torch.randn(M, N, device=device).half()

    def gradients():
        leaves = [t.clone().requires_grad_() for t in (x, w, bias)]
        y = mpgemm.linear(*leaves, activation=activation)
        y.backward(grad)
        return [t.grad for t in leaves]

    names, tma = launched_kernels(gradients)
    gemm_ = "_gemm_tma_kernel"  # forward; dZ and the bias gradient; dX, dW
    assert names == [gemm_, "_activation_backward_kernel", gemm_, gemm_]
    with gemm.use_kernel("pointer"):
        fused = gradients()
    for name, got, want in zip(("x", "weight", "bias"), tma, fused, strict=True):
        torch.testing.assert_close(
            got.float(),
            want.float(),
            rtol=1e-3,
            atol=1e-5,
            msg=lambda m, name=name: f"grad of {name}: {m}",
        )
