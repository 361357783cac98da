"""gemm: mpgemm.matmul against torch.matmul on FP16 operands (``torch_fp16``: cuBLAS
on a GPU), under autocast from FP32 operands, and in FP32; mpgemm also from FP32
operands (rounded in the kernel, where autocast casts first), and with its pointer
kernel forced where the default takes the TMA kernel (``mpgemm_pointer``: the kernel
before TMA, in the same run). gemm_bf16: on BF16 operands, against cuBLAS's BF16.
Work: 2MNK flops."""

import pytest
import torch
from harness import GPU_SCALE, product_of
from report import in_gemm_geomean

import mpgemm
from mpgemm.kernels.gemm import use_kernel
from tests.accuracy import assert_within_torch_error

pytestmark = pytest.mark.benchmark(group="gemm")

# (M, K, N): squares, the TensorFlow guide's MLP layers (batch 8192, 784 -> 4096 ->
# 4096 -> 10), the small MLP (batch 128, 784 -> 128), a transformer's MLP (8192 tokens,
# 4096 -> 11008 and back).
SHAPES = (
    [(s, s, s) for s in (512, 1024, 2048, 4096, 8192)]
    + [
        (8192, 784, 4096),
        (8192, 4096, 4096),
        (8192, 4096, 10),
        (128, 784, 128),
        (8192, 4096, 11008),
        (8192, 11008, 4096),
    ]
    if GPU_SCALE
    else [(64, 64, 64), (128, 128, 128), (32, 48, 64)]
)
IMPLS = ["mpgemm", "mpgemm_pointer", "mpgemm_from_fp32", "torch_fp16", "autocast", "fp32"]
# What the targets read (``bench/report.py``), which ``MPGEMM_BENCH_TARGETS=1``
# runs alone (bench/conftest.py): the geomean's shapes (at the CPU's scale the first
# shape, so that a dry run has a GEMM), mpgemm against cuBLAS.
CASES = ["x".join(map(str, s)) for s in SHAPES]
TARGET_CASES = {case for case in CASES if in_gemm_geomean(case)} or {CASES[0]}
TARGET_IMPLS = {"mpgemm", "torch_fp16"}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm(run_case, device, shape, impl):
    m, k, n = shape
    a32, b32 = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    a16, b16 = a32.half(), b32.half()

    def autocast():
        with torch.autocast(device.type, dtype=torch.float16):
            return torch.matmul(a32, b32)

    def pointer():
        with use_kernel("pointer"):
            return mpgemm.matmul(a16, b16)

    fn = {
        "mpgemm": lambda: mpgemm.matmul(a16, b16),
        "mpgemm_pointer": pointer,
        "mpgemm_from_fp32": lambda: mpgemm.matmul(a32, b32),
        "torch_fp16": lambda: torch.matmul(a16, b16),
        "autocast": autocast,
        "fp32": lambda: torch.matmul(a32, b32),
    }[impl]
    case = "x".join(map(str, shape))
    # mpgemm's product of the same 16-bit operands (rounded in the kernel, or by a cast,
    # from FP32 ones).
    check = product_of(a16, b16, f"{case} {impl}") if impl.startswith("mpgemm") else None
    run_case(fn, case=case, impl=impl, flops=2 * m * n * k, check=check)


# BF16, what most training on Hopper computes in: the geomean's shapes (at the CPU's
# scale the first shape), mpgemm against cuBLAS in BF16. Named "bf16 MxKxN", so that
# the targets stage, which reads FP16, leaves them out.
BF16_SHAPES = [s for s in SHAPES if min(s) >= 2048] if GPU_SCALE else SHAPES[:1]


@pytest.mark.benchmark(group="gemm_bf16")
@pytest.mark.parametrize("impl", ["mpgemm", "torch_bf16"])
@pytest.mark.parametrize("shape", BF16_SHAPES, ids=lambda s: "bf16 " + "x".join(map(str, s)))
def test_gemm_bf16(run_case, device, shape, impl):
    m, k, n = shape
    a, b = torch.randn(m, k, device=device).bfloat16(), torch.randn(k, n, device=device).bfloat16()
    fn = {
        "mpgemm": lambda: mpgemm.matmul(a, b),
        "torch_bf16": lambda: torch.matmul(a, b),
    }[impl]
    case = "bf16 " + "x".join(map(str, shape))
    check = product_of(a, b, case) if impl == "mpgemm" else None
    run_case(fn, case=case, impl=impl, flops=2 * m * n * k, check=check)


# (batch, M, K, N) of batched products (``mpgemm.matmul`` of a batched b, the pointer
# kernel's batch axis): attention's two products at 1,024 tokens and 16 heads of 64 over
# 4 sequences, and 8 experts' 2048 x 4096 -> 1024 layers.
BATCHED_SHAPES = (
    [(64, 1024, 64, 1024), (64, 1024, 1024, 64), (8, 2048, 4096, 1024)]
    if GPU_SCALE
    else [(2, 32, 48, 64)]
)


@pytest.mark.benchmark(group="gemm_batched")
@pytest.mark.parametrize("impl", ["mpgemm", "torch_fp16", "fp32"])
@pytest.mark.parametrize("shape", BATCHED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_batched_gemm(run_case, device, shape, impl):
    batch, m, k, n = shape
    a32 = torch.randn(batch, m, k, device=device)
    b32 = torch.randn(batch, k, n, device=device)
    a16, b16 = a32.half(), b32.half()
    fn = {
        "mpgemm": lambda: mpgemm.matmul(a16, b16),
        "torch_fp16": lambda: torch.matmul(a16, b16),
        "fp32": lambda: torch.matmul(a32, b32),
    }[impl]
    case = "x".join(map(str, shape))
    check = product_of(a16, b16, case) if impl == "mpgemm" else None
    run_case(fn, case=case, impl=impl, flops=2 * batch * m * n * k, check=check)


# (sequences, tokens, heads, head dim): attention's scores q @ k^T on (batch, heads)
# views of (batch, tokens, heads, dim) projections, whose batch dimensions do not
# merge. mpgemm: one launch of the pointer kernel over both (OUTER);
# ``mpgemm_per_index``: the TMA kernel, a launch per sequence (``use_kernel("tma")``,
# the way before OUTER); torch: a copy to contiguous heads, then one batched GEMM.
HEADS_SHAPES = [(4, 1024, 16, 64), (32, 128, 16, 64)] if GPU_SCALE else [(2, 32, 3, 16)]


@pytest.mark.benchmark(group="gemm_batched")
@pytest.mark.parametrize("impl", ["mpgemm", "mpgemm_per_index", "torch_fp16"])
@pytest.mark.parametrize("shape", HEADS_SHAPES, ids=lambda s: "heads_" + "x".join(map(str, s)))
def test_scores_of_transposed_heads(run_case, device, shape, impl):
    batch, tokens, heads, dim = shape
    q, k = (
        torch.randn(batch, tokens, heads * dim, device=device)
        .half()
        .view(batch, tokens, heads, dim)
        .transpose(1, 2)
        for _ in range(2)
    )

    def per_index():
        with use_kernel("tma"):
            return mpgemm.matmul(q, k.transpose(-1, -2))

    fn = {
        "mpgemm": lambda: mpgemm.matmul(q, k.transpose(-1, -2)),
        "mpgemm_per_index": per_index,
        "torch_fp16": lambda: torch.matmul(q, k.transpose(-1, -2)),
    }[impl]
    case = "heads " + "x".join(map(str, shape))
    check = product_of(q, k.transpose(-1, -2), f"{case} {impl}") if impl != "torch_fp16" else None
    run_case(fn, case=case, impl=impl, flops=2 * batch * heads * tokens * tokens * dim, check=check)


# (batch, M, K, N): a (M, K) broadcast over b's batch, and a's gradient, dC @ B^T summed
# over the batch (mpgemm: in the TMA kernel's K loop, SUM_BATCH): a 4096^2 weight over
# 8 products (1,024 tiles: into the gradient) and a 256^2 one over 64 (4 tiles: the
# batch in 32 parts of 2, FP32 partials). torch expands a and sums a batch of products.
BROADCAST_SHAPES = [(8, 4096, 4096, 1024), (64, 256, 256, 1024)] if GPU_SCALE else [(3, 32, 48, 16)]


@pytest.mark.benchmark(group="gemm_batched")
@pytest.mark.parametrize("impl", ["mpgemm", "torch_fp16"])
@pytest.mark.parametrize("shape", BROADCAST_SHAPES, ids=lambda s: "grad_a_" + "x".join(map(str, s)))
def test_broadcast_operand_gradient(run_case, device, shape, impl):
    batch, m, k, n = shape
    a = torch.randn(m, k, device=device).half().requires_grad_()
    b = torch.randn(batch, k, n, device=device).half()
    c = (mpgemm.matmul if impl == "mpgemm" else torch.matmul)(a, b)
    grad_c = torch.randn_like(c)
    case = "grad_a " + "x".join(map(str, shape))

    def check(grads):
        # dC @ B^T summed over the batch, against FP64 with torch's own as the bar.
        exact = torch.matmul(grad_c.double(), b.double().mT).sum(0)
        (torch_grad,) = torch.autograd.grad(torch.matmul(a, b), a, grad_c)
        assert_within_torch_error(grads[0], exact, torch_grad, case)

    run_case(
        lambda: torch.autograd.grad(c, a, grad_c, retain_graph=True),
        case=case,
        impl=impl,
        flops=2 * batch * m * n * k,
        check=check if impl == "mpgemm" else None,
    )
