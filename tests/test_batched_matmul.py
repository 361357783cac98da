"""mpgemm.matmul on torch.matmul's other shapes: vectors, and batches of products that
broadcast, against FP64 with torch's own product of the rounded operands as the bar."""

import functools
import itertools

import pytest
import torch

import mpgemm
from mpgemm.kernels import gemm
from mpgemm.kernels.launches import intercept, jit_function
from mpgemm.reference import matmul_ref, round_to
from tests.accuracy import assert_within_torch_error, launched_kernels, nan_padded

# (a's shape, b's shape): every rule of torch.matmul's that mpgemm.matmul follows.
VECTORS = [((33,), (33,)), ((33,), (33, 7)), ((5, 33), (33,)), ((2, 5, 33), (33,))]
BATCHES = [
    ((3, 17, 33), (3, 33, 9)),  # one batch
    ((17, 33), (3, 33, 9)),  # a broadcast over b's batch
    ((33,), (3, 33, 9)),  # a vector broadcast over b's batch
    ((3, 17, 33), (1, 33, 9)),  # b broadcast over a's
    ((2, 3, 17, 33), (3, 33, 9)),  # b broadcast over a's first dimension
    ((2, 1, 17, 33), (3, 33, 9)),  # both broadcast
    ((2, 3, 1, 17, 33), (4, 33, 9)),  # three batch dimensions
    # a's batch is the result's but for a leading 1, so its gradient sums over nothing,
    # kept over dimensions that do not merge (b's stride 0): the sum over no dimension
    # was taken over all of them (torch's sum(dim=()) reduces everything)
    ((3, 3, 17, 33), (1, 3, 1, 33, 9)),
]


def assert_product_within_torch_error(out, a, b, what=""):
    """``out``, FP32, against the FP64 product of the rounded operands, with torch's own
    product of them as the bar."""
    exact = round_to(a, torch.float16).double() @ round_to(b, torch.float16).double()
    assert_within_torch_error(out, exact, matmul_ref(a, b, out_dtype=torch.float32), what)


def assert_gradients_within_torch_error(a, b, grad_out, compute_dtype, what):
    """a.grad and b.grad, from ``mpgemm.matmul``'s backward of ``grad_out``, against
    FP64 autograd, with ``matmul_ref``'s backward (torch's) as the bar."""
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    (a64 @ b64).backward(grad_out.double())
    a_ref, b_ref = (t.detach().requires_grad_() for t in (a, b))
    matmul_ref(a_ref, b_ref, compute_dtype=compute_dtype).backward(grad_out)
    assert_within_torch_error(a.grad, a64.grad, a_ref.grad, f"grad a {what}")
    assert_within_torch_error(b.grad, b64.grad, b_ref.grad, f"grad b {what}")


@pytest.mark.parametrize("shapes", VECTORS + BATCHES)
def test_shapes_and_values_follow_torch_matmul(shapes, device):
    a, b = (torch.randn(shape, device=device) for shape in shapes)
    out = mpgemm.matmul(a, b, out_dtype=torch.float32)
    assert out.shape == torch.matmul(a, b).shape
    assert_product_within_torch_error(out, a, b, f"{shapes}")


@pytest.mark.parametrize("compute_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shapes", BATCHES)
def test_gradients_of_batches_that_broadcast(shapes, compute_dtype, device):
    # FP16 a, FP32 b: each gradient comes back in its operand's dtype; a broadcast
    # operand's gradient is summed over the batch in FP32, then rounded once.
    a = torch.randn(shapes[0], device=device, dtype=torch.float16, requires_grad=True)
    b = torch.randn(shapes[1], device=device, requires_grad=True)
    out = mpgemm.matmul(a, b, compute_dtype=compute_dtype)
    assert out.dtype == compute_dtype
    grad_out = torch.randn(out.shape, device=device).to(compute_dtype)
    out.backward(grad_out)
    assert a.grad.dtype == torch.float16 and b.grad.dtype == torch.float32
    assert_gradients_within_torch_error(a, b, grad_out, compute_dtype, f"{shapes}")


@pytest.mark.parametrize("whole", [True, False], ids=["whole batch", "some dimensions"])
def test_a_broadcast_operands_gradient_is_summed_before_its_one_rounding(whole, path_device):
    # a's gradient is the sum of two products that nearly cancel: rounded to FP16 one by
    # one, each would carry an error as large as the sum itself. a is broadcast over
    # the whole batch (summed by _sum_batched), or over b's second batch dimension only
    # (the products in FP32, then their sums). On the kernels, and on the reference
    # path (CPU tensors without the interpreter: gemm_ref's sum_batch).
    device = path_device
    a_shape = (17, 33) if whole else (3, 1, 17, 33)
    a = torch.randn(a_shape, device=device, dtype=torch.float16, requires_grad=True)
    b = torch.randn(33, 9, device=device).expand(3, 2, 33, 9)
    b.requires_grad_()
    first = torch.randn(3, 17, 9, device=device).half()
    grad_out = torch.stack([first, -first + 1e-2 * torch.randn_like(first)], dim=1)
    mpgemm.matmul(a, b).backward(grad_out)
    assert_gradients_within_torch_error(a, b, grad_out, torch.float16, "near cancellation")


def test_vector_gradients(device):
    a = torch.randn(33, device=device, requires_grad=True)
    b = torch.randn(4, 33, 9, device=device, requires_grad=True)
    grad_out = torch.randn(4, 9, device=device).half()
    mpgemm.matmul(a, b).backward(grad_out)
    assert_gradients_within_torch_error(a, b, grad_out, torch.float16, "vector a")


def test_strided_batches_run_without_copies(device):
    # Batch dimensions that do not merge (a's are transposed, as attention's
    # (batch, heads) of a (batch, tokens, heads, dim) projection): two in one launch of
    # the pointer kernel (OUTER); three, a launch per index of the outer two, each over
    # views of the operands. The NaN poison of the output shows any product left
    # unwritten.
    b = torch.randn(3, 33, 9, device=device)
    flags = []

    def keep(kernel, grid, args, kwargs, configs):
        flags.append(kwargs.get("OUTER", False))
        kernel[grid](*args, **kwargs)

    for a, launches in (
        (torch.randn(3, 2, 17, 33, device=device).transpose(0, 1), 1),  # (2, 3, 17, 33)
        (torch.randn(3, 2, 2, 17, 33, device=device).permute(2, 1, 0, 3, 4), 4),
    ):
        flags.clear()
        with intercept(keep):
            out = mpgemm.matmul(a, b, out_dtype=torch.float32)
        assert flags == [launches == 1] * launches
        assert_product_within_torch_error(out, a, b)

    # Contiguous batches merge into one launch, a broadcast 2-D a too.
    a, b = torch.randn(2, 3, 17, 33, device=device), torch.randn(2, 3, 33, 9, device=device)
    for left in (a, a[0, 0]):
        names, out = launched_kernels(lambda x=left: mpgemm.matmul(x, b, out_dtype=torch.float32))
        assert names == ["_gemm_kernel"]
        assert_product_within_torch_error(out, left, b)


def test_use_kernel_tma_keeps_the_tma_kernels_launch_per_outer_index(device):
    """Under ``use_kernel("tma")`` (the benchmarks' comparison) the one-launch pointer
    paths step aside: a batch over two dimensions that do not merge is a TMA launch per
    outer index, and a gradient kept over one dimension the TMA kernel's products,
    then their sum; the results meet the same bar."""
    q, k = (
        torch.randn(2, 40, 3 * 48, device=device).half().view(2, 40, 3, 48).transpose(1, 2)
        for _ in range(2)
    )
    with gemm.use_kernel("tma"):
        names, out = launched_kernels(lambda: mpgemm.matmul(q, k.mT, out_dtype=torch.float32))
    assert names == ["_gemm_tma_kernel"] * 2
    assert_product_within_torch_error(out, q, k.mT)

    a = torch.randn(2, 3, 40, 48, device=device).half()
    b = torch.randn(3, 48, 24, device=device).half().requires_grad_()
    grad_out = torch.randn(2, 3, 40, 24, device=device).half()
    with gemm.use_kernel("tma"):
        out = mpgemm.matmul(a, b)
        names, _ = launched_kernels(lambda: out.backward(grad_out, inputs=[b]))
    assert set(names) == {"_gemm_tma_kernel"}
    a.requires_grad_()
    mpgemm.matmul(a, b.detach()).backward(grad_out)
    assert_gradients_within_torch_error(a, b, grad_out, torch.float16, "use_kernel tma")


def test_a_batch_beyond_the_grid_limit_is_split_across_launches(device, monkeypatch):
    monkeypatch.setattr(gemm, "_MAX_BATCH", 2)
    a = torch.randn(5, 17, 33, device=device)
    b = torch.randn(5, 33, 9, device=device)
    names, out = launched_kernels(lambda: mpgemm.matmul(a, b, out_dtype=torch.float32))
    assert names == ["_gemm_kernel"] * 3
    assert_product_within_torch_error(out, a, b)


@pytest.mark.parametrize(
    "shapes", [((0, 17, 33), (0, 33, 9)), ((3, 0, 33), (3, 33, 9)), ((3, 17, 0), (3, 0, 9))]
)
def test_zero_size_batches(shapes, device):
    a, b = (torch.randn(shape, device=device, requires_grad=True) for shape in shapes)
    out = mpgemm.matmul(a, b, out_dtype=torch.float32)
    assert torch.equal(out, torch.zeros(torch.matmul(a, b).shape, device=device))
    out.sum().backward()
    assert torch.equal(a.grad, torch.zeros_like(a)) and torch.equal(b.grad, torch.zeros_like(b))


def test_nan_and_inf_reach_the_products_that_read_them(device):
    a = torch.randn(3, 4, 8, device=device)
    b = torch.randn(3, 8, 5, device=device)
    a[1, 2, 3] = float("nan")
    b[2, 0, 4] = float("inf")
    out = mpgemm.matmul(a, b, out_dtype=torch.float32)
    expected = matmul_ref(a, b, out_dtype=torch.float32)
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    assert torch.equal(torch.isinf(out), torch.isinf(expected))
    assert torch.isnan(out[1, 2]).all() and not torch.isnan(out[0]).any()


def nan_padded_batch(
    t: torch.Tensor, transposed: bool = False, aligned: bool = True
) -> torch.Tensor:
    """A copy of (B, rows, cols) ``t`` as one strided view inside a NaN-filled buffer,
    each matrix laid out as ``nan_padded(..., aligned=aligned)`` lays one out (stored
    column-major when ``transposed``): 16-byte-aligned for descriptors where
    ``aligned``, and any read outside a matrix, its neighbours' included, shows up as
    NaN."""
    batch, rows, cols = t.shape
    if transposed:
        rows, cols = cols, rows
    lead, skip = (8, 16) if aligned else (2, 5)  # as nan_padded's
    width = cols + lead + skip
    if aligned:
        width += -width % 8
    buf = torch.full((batch, rows + 3, width), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[:, 1 : 1 + rows, lead : lead + cols]
    if transposed:
        view = view.transpose(-1, -2)
    view.copy_(t)
    return view


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "case", ["batches", "a broadcast, b transposed", "both broadcast", "a transposed"]
)
def test_batches_of_aligned_16_bit_operands_run_the_tma_kernel(case, half, device):
    a = torch.randn(3, 40, 48, device=device).to(half)
    b = torch.randn(3, 48, 24, device=device).to(half)
    if case == "batches":
        a, b = nan_padded_batch(a), nan_padded_batch(b)
    elif case == "a broadcast, b transposed":
        a, b = nan_padded(a[0], aligned=True), nan_padded_batch(b, transposed=True)
    elif case == "both broadcast":  # every product the same: stride 0 in the batch
        a, b = nan_padded(a[0], aligned=True), nan_padded(b[0], aligned=True).expand(3, 48, 24)
    else:
        a, b = nan_padded_batch(a, transposed=True), nan_padded_batch(b)
    product = functools.partial(mpgemm.matmul, a, b, compute_dtype=half)
    names, out = launched_kernels(lambda: product(out_dtype=torch.float32))
    assert names == ["_gemm_tma_kernel"]
    exact = round_to(a, half).double() @ round_to(b, half).double()
    baseline = matmul_ref(a, b, compute_dtype=half, out_dtype=torch.float32)
    assert_within_torch_error(out, exact, baseline, case)

    # The backward's two batches: dC @ B^T and A^T @ dC, on 16-bit operands too.
    a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
    grad_out = torch.randn(out.shape, device=device).to(half)
    names, _ = launched_kernels(lambda: mpgemm.matmul(a, b, compute_dtype=half).backward(grad_out))
    assert set(names) == {"_gemm_tma_kernel"}
    assert_gradients_within_torch_error(a, b, grad_out, half, case)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "products, sms, a_transposed, parts",
    [(6, 1, False, 1), (6, 1, True, 1), (6, 132, False, 6), (7, 3, True, 3)],
    ids=["one part", "one part, a transposed", "a part per product", "parts of 3, 3 and 1"],
)
def test_a_gradient_summed_over_the_whole_batch_is_one_tma_launch(
    half, products, sms, a_transposed, parts, device, monkeypatch
):
    """The gradient of an operand broadcast over every batch dimension is summed in the
    TMA kernel's K loop (``SUM_BATCH``), in one launch: into the gradient, or, where its
    tiles are fewer than the SMs (here 1 tile, for ``sms``), into FP32 partial sums of
    parts of the batch, then added. Its products nearly cancel in pairs (each pair
    reads one B, and dC's pair nearly cancels), so that rounding any partial sum to 16
    bits would show; the operands sit in NaN-filled buffers."""
    monkeypatch.setattr(gemm, "multiprocessors", lambda device: sms)
    a = nan_padded(torch.randn(40, 48, device=device).to(half), a_transposed, aligned=True)
    a.requires_grad_()
    b = nan_padded_batch(_in_pairs(torch.randn(products, 48, 24, device=device).to(half)))
    first = torch.randn(products // 2, 40, 24, device=device)
    pairs = torch.stack([first, -first + 1e-2 * torch.randn_like(first)], dim=1).flatten(0, 1)
    grad_out = torch.cat([pairs, torch.randn(products % 2, 40, 24, device=device)]).to(half)
    out = mpgemm.matmul(a, b, compute_dtype=half)
    launches = []

    def run_and_keep(kernel, grid, args, kwargs, configs):
        launches.append((jit_function(kernel).fn.__name__, kwargs.get("BATCH", 1)))
        assert kwargs["SUM_BATCH"] and kwargs["PRODUCTS"] == products
        kernel[grid](*args, **kwargs)

    with intercept(run_and_keep):
        out.backward(grad_out, inputs=[a])
    assert launches == [("_gemm_tma_kernel", parts)]
    b.requires_grad_()
    mpgemm.matmul(a.detach(), b, compute_dtype=half).backward(grad_out)
    assert_gradients_within_torch_error(a, b, grad_out, half, "summed in the kernel")


@pytest.mark.parametrize("sms, parts", [(1, 1), (132, 5)])
def test_b_broadcast_over_as_batch_has_its_gradient_summed_in_the_kernel(
    sms, parts, device, monkeypatch
):
    """b (1, K, N) times a's batch of 5: b's gradient, sum_i A_i^T @ dC_i, reads A
    transposed through a batched descriptor (A_T), in one part or a part per product."""
    monkeypatch.setattr(gemm, "multiprocessors", lambda device: sms)
    a = nan_padded_batch(torch.randn(5, 40, 48, device=device).half())
    b = nan_padded_batch(torch.randn(1, 48, 24, device=device).half()).requires_grad_()
    grad_out = torch.randn(5, 40, 24, device=device).half()
    out = mpgemm.matmul(a, b)
    launches = []

    def run_and_keep(kernel, grid, args, kwargs, configs):
        launches.append((kwargs.get("SUM_BATCH"), kwargs["A_T"], kwargs.get("BATCH", 1)))
        kernel[grid](*args, **kwargs)

    with intercept(run_and_keep):
        out.backward(grad_out, inputs=[b])
    assert launches == [(True, True, parts)]
    a.requires_grad_()
    mpgemm.matmul(a, b.detach()).backward(grad_out)
    assert_gradients_within_torch_error(a, b, grad_out, torch.float16, "b summed")


def _in_pairs(batch: torch.Tensor) -> torch.Tensor:
    # Products 2j and 2j + 1 the same matrix (the first of each pair's).
    return batch[torch.arange(len(batch), device=batch.device) // 2 * 2]


@pytest.mark.parametrize(
    "dtype, products, sms, parts",
    [
        (torch.float32, 6, 1, 1),
        (torch.float32, 7, 3, 3),
        (torch.float16, 6, 132, 6),  # unaligned FP16: dC's rows are 23 elements apart
    ],
    ids=["FP32, one part", "FP32, parts of 3, 3 and 1", "FP16 unaligned, a part per product"],
)
def test_a_gradient_summed_over_the_whole_batch_in_the_pointer_kernel(
    dtype, products, sms, parts, device, monkeypatch
):
    """Operands the TMA kernel does not take (FP32, or unaligned 16-bit) have a whole
    batch's gradient summed in the pointer kernel's K loop (``SUM_BATCH``) too: one
    launch over the products one after another, into the gradient or into FP32
    partials of parts of the batch that are then added, never a batch of products in
    memory. Its products nearly cancel in pairs (each pair reads one B, and dC's pair
    nearly cancels), so that rounding any partial sum to 16 bits would show; the
    operands sit in NaN-filled buffers."""
    monkeypatch.setattr(gemm, "multiprocessors", lambda device: sms)
    n = 24 if dtype == torch.float32 else 23
    a = nan_padded(torch.randn(40, 48, device=device).to(dtype)).requires_grad_()
    b = nan_padded_batch(_in_pairs(torch.randn(products, 48, n, device=device).to(dtype)))
    first = torch.randn(products // 2, 40, n, device=device)
    pairs = torch.stack([first, -first + 1e-2 * torch.randn_like(first)], dim=1).flatten(0, 1)
    grad_out = torch.cat([pairs, torch.randn(products % 2, 40, n, device=device)])
    out = mpgemm.matmul(a, b)
    grad_out = nan_padded_batch(grad_out.to(out.dtype), aligned=False)
    launches = []

    def run_and_keep(kernel, grid, args, kwargs, configs):
        launches.append((jit_function(kernel).fn.__name__, kwargs.get("SUM_BATCH", False)))
        assert kwargs["PRODUCTS"] == products and -(-products // kwargs["PER_SPLIT"]) == parts
        kernel[grid](*args, **kwargs)

    with intercept(run_and_keep):
        out.backward(grad_out, inputs=[a])
    assert launches == [("_gemm_kernel", True)]
    b.requires_grad_()
    mpgemm.matmul(a.detach(), b).backward(grad_out)
    assert_gradients_within_torch_error(a, b, grad_out, torch.float16, f"{dtype} summed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_gradient_summed_over_some_batch_dimensions_keeps_the_others(dtype, device):
    """b (3, K, N) times a (2, 3, M, K): b's gradient sums over a's first dimension and
    keeps the second, sum_i A[i, h]^T @ dC[i, h] for each h, in one launch of the
    pointer kernel (``SUM_BATCH`` with kept indices, a part each), not a batch of FP32
    products in memory. The two products of each h nearly cancel (one A, and dC's pair
    nearly cancels), so that rounding either to 16 bits would show; a sits in a
    NaN-filled buffer."""
    a = torch.randn(1, 3, 40, 48, device=device).expand(2, 3, 40, 48).to(dtype)
    a = nan_padded_batch(a.reshape(6, 40, 48), aligned=False).view(2, 3, 40, 48)
    b = torch.randn(3, 48, 24, device=device).to(dtype).requires_grad_()
    first = torch.randn(3, 40, 24, device=device)
    grad_out = torch.stack([first, -first + 1e-2 * torch.randn_like(first)])
    out = mpgemm.matmul(a, b)
    grad_out = grad_out.to(out.dtype)
    launches = []

    def run_and_keep(kernel, grid, args, kwargs, configs):
        name = jit_function(kernel).fn.__name__
        launches.append((name, kwargs.get("SUM_BATCH", False), kwargs.get("INNER")))
        assert kwargs.get("PRODUCTS") == 6 and kwargs.get("PER_SPLIT") == 2
        kernel[grid](*args, **kwargs)

    with intercept(run_and_keep):
        out.backward(grad_out, inputs=[b])
    assert launches == [("_gemm_kernel", True, 2)]
    a.requires_grad_()
    mpgemm.matmul(a, b.detach()).backward(grad_out)
    assert_gradients_within_torch_error(a, b, grad_out, torch.float16, f"{dtype} kept")


def test_a_sum_that_keeps_every_batch_dimension_is_the_batch_of_products(device):
    """``triton_gemm(..., sum_batch=True)`` keeping every batch dimension, over ones that
    do not merge (b's stride 0): the batch of products, unsummed. It summed over every
    dimension (torch's sum over dim=()), a (1, M, N) result for (3, 2, M, N); matmul's
    backward no longer asks it for such a sum, ``ops.gemm``'s callers may."""
    a = torch.randn(3, 2, 17, 33, device=device, dtype=torch.float16)
    b = torch.randn(3, 1, 33, 9, device=device, dtype=torch.float16).expand(3, 2, 33, 9)
    summed, _, _ = gemm.triton_gemm(
        a, b, compute_dtype=torch.float16, out_dtype=torch.float32, sum_batch=True, kept_dims=2
    )
    assert summed.shape == (3, 2, 17, 9)
    assert_product_within_torch_error(summed, a.float(), b.float(), "every dimension kept")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shapes",
    [((17, 33), (0, 33, 9)), ((0, 33), (4, 33, 9)), ((17, 33), (4, 33, 0)), ((17, 0), (4, 0, 9))],
    ids=["no products", "no rows", "no columns", "empty products"],
)
def test_a_summed_gradient_of_nothing_is_zeros(shapes, dtype, device):
    a, b = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for shape in shapes)
    out = mpgemm.matmul(a, b)
    out.backward(torch.ones_like(out))
    assert torch.equal(a.grad, torch.zeros_like(a))


def test_inf_in_a_summed_gradient_lands_where_torchs_does(device, monkeypatch):
    """A's gradient summed in parts (7 products in parts of 3, 3 and 1) where B, read
    by every product (stride 0), holds an inf: with positive dC, a's gradient is +inf
    in that column and finite elsewhere, as torch's; a part that multiplied past the
    batch's end (a zero-filled tile against the inf) would make it NaN."""
    monkeypatch.setattr(gemm, "multiprocessors", lambda device: 3)
    a = nan_padded(torch.randn(40, 48, device=device).half(), aligned=True).requires_grad_()
    b = nan_padded(torch.randn(48, 24, device=device).half(), aligned=True)
    b[3, 5] = float("inf")
    grad_out = torch.rand(7, 40, 24, device=device).half() + 0.1
    mpgemm.matmul(a, b.expand(7, 48, 24)).backward(grad_out)
    want = (grad_out.float() @ b.float().t()).sum(0).half()
    assert torch.isinf(want[:, 3]).all() and torch.isfinite(want[:, :3]).all()
    assert torch.equal(torch.isinf(a.grad), torch.isinf(want))
    assert not torch.isnan(a.grad).any()


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((), (3, 4)), "at least 1-D"),
        (((4,), ()), "at least 1-D"),
        (((2, 5), (3, 4, 6)), "cannot be multiplied"),
        (((2, 3, 4), (5,)), "cannot be multiplied"),
        (((2, 3, 4), (3, 4, 6)), "do not broadcast"),
    ],
)
def test_shapes_torch_matmul_refuses_raise_value_error(shapes, match, device):
    a, b = (torch.randn(shape, device=device) for shape in shapes)
    with pytest.raises(RuntimeError):
        torch.matmul(a, b)
    with pytest.raises(ValueError, match=match):
        mpgemm.matmul(a, b)


def test_batch_shapes_broadcast_as_torch_broadcasts_them():
    """``_broadcast_batch``, matmul's own broadcast of batch shapes, against
    ``torch.broadcast_shapes`` over every pair of shapes of up to 3 dimensions of sizes
    0 to 3: the same shape, or both refuse."""
    from mpgemm.functional import _broadcast_batch

    shapes = [shape for rank in range(4) for shape in itertools.product(range(4), repeat=rank)]
    for x, y in itertools.product(shapes, repeat=2):
        try:
            expected = tuple(torch.broadcast_shapes(x, y))
        except RuntimeError:
            with pytest.raises(RuntimeError):
                _broadcast_batch(x, y)
            continue
        assert _broadcast_batch(x, y) == expected, (x, y)


def test_compiled_batched_matmul_matches_eager_bit_for_bit(device):
    torch._dynamo.reset()
    a = torch.randn(2, 3, 17, 33, device=device, requires_grad=True)
    b = torch.randn(3, 33, 9, device=device, requires_grad=True)
    results = []
    for fn in (mpgemm.matmul, torch.compile(mpgemm.matmul, fullgraph=True)):
        a.grad = b.grad = None
        out = fn(a, b)
        out.float().square().sum().backward()
        results.append((out, a.grad, b.grad))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def test_per_sample_gradients_under_vmap(device):
    # torch.func over a batched product: the transforms' tensors take the reference
    # path, whose gradient is the eager one's math.
    weights = torch.randn(4, 33, 9, device=device)
    xs = torch.randn(6, 4, 17, 33, device=device)

    def loss(w, x):
        return mpgemm.matmul(x, w, out_dtype=torch.float32).square().sum()

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(weights, xs)
    for i in range(len(xs)):
        w = weights.clone().requires_grad_()
        loss(w, xs[i]).backward()
        # The two paths sum the FP32 product in different orders, which may tip its
        # gradient's rounding to 16 bits by one ulp (4e-5 of the scale seen, in 1 of
        # some 200 samples): 1e-3 of the scale, as between the kernels and the reference.
        atol = 1e-3 * w.grad.abs().max().item()
        torch.testing.assert_close(grads[i], w.grad, rtol=2e-3, atol=atol)
