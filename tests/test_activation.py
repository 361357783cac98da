"""The fused activation backward (``mpgemm.kernels.activation``) through the interpreter
against its reference, ``activation_backward_ref`` (torch's threshold_backward, or act'(z)
from the stored z and the FP32 product, and torch.sum): ReLU's dZ bit for bit, GELU's
and SiLU's within the reference's error (their erf and exp are the GPU's, or numpy's),
NaN and inf included, with operands read through strides out of NaN-padded buffers;
the bias gradient against FP64 with the
reference's error as the bar, over several chunks of rows, the same run to run, summed
in the kernel's one launch."""

import pytest
import torch

from mpgemm.reference import (
    activation_backward_ref,
    activation_derivative,
    activation_value,
    torch_activation,
)
from tests.accuracy import (
    OpLog,
    assert_same_bits,
    assert_sum_within_torch_error,
    assert_within_torch_error,
    launched_kernels,
    nan_padded,
    torch_ops_besides_launches,
)

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mpgemm.kernels import activation as kernel_module  # noqa: E402
from mpgemm.kernels import arrivals  # noqa: E402
from mpgemm.kernels.activation import triton_activation_backward  # noqa: E402
from mpgemm.kernels.gemm_common import activation_and_derivative as kernel_derivative  # noqa: E402

# Ragged against the kernel's 32-row steps and 128-column blocks.
M, N = 75, 200


def _operands(activation, dtype, device, transposed):
    grad_y = nan_padded(torch.randn(M, N, device=device).to(dtype), transposed)
    if activation == "relu":
        y = torch.randn(M, N, device=device).relu().to(dtype)  # zeros where masked
        saved = nan_padded(y, not transposed)
    else:  # z as the forward stores it, in y's dtype: act' over its range and tails
        saved = nan_padded((torch.randn(M, N, device=device) * 3).to(dtype), not transposed)
    return grad_y, saved


def _exact(activation, grad_y, saved):
    """dZ in FP64 from the operands (the bias gradient's exact sums)."""
    if activation == "relu":
        return grad_y.double() * (saved > 0)
    return grad_y.double() * activation_derivative(saved.double(), activation)


def _check_dz(activation, dz, ref_dz, grad_y, saved):
    """ReLU's dZ bit for bit; GELU's and SiLU's, whose act'(z) takes an erf or exp (the
    GPU's, or numpy's when interpreted, against torch's), against FP64 with the
    reference's error as the bar."""
    if activation == "relu":
        assert_same_bits(dz, ref_dz, "dZ")
    else:
        assert_within_torch_error(dz, _exact(activation, grad_y, saved), ref_dz, "dZ")


# (dY's dtype, the compute dtype): dZ rounded to the coarser, in dY's dtype; an FP32
# dY is a layer's with out_dtype=torch.float32.
DTYPES = [
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.float16),
    (torch.float32, torch.float16),
]


@pytest.mark.parametrize("bias_grad", [True, False])
@pytest.mark.parametrize("dtype, compute_dtype", DTYPES)
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_matches_the_reference(activation, dtype, compute_dtype, bias_grad, device, monkeypatch):
    # 4 programs per SM on 2 "SMs" over 2 column blocks: 4 chunks of 32 rows.
    monkeypatch.setattr(kernel_module, "multiprocessors", lambda device: 2)
    torch.manual_seed(0)
    grad_y, saved = _operands(activation, dtype, device, transposed=bias_grad)
    args = (grad_y, saved, activation, compute_dtype)
    names, (dz, db) = launched_kernels(
        lambda: triton_activation_backward(*args, bias_grad=bias_grad)
    )
    assert names == ["_activation_backward_kernel"]
    ref_dz, ref_db = activation_backward_ref(*args, bias_grad=bias_grad)
    assert dz.is_contiguous() and dz.dtype == ref_dz.dtype == dtype
    _check_dz(activation, dz, ref_dz, grad_y, saved)
    if activation != "relu":  # act'(z) and the product in FP32, rounded once, to the coarser
        coarser = torch.bfloat16 if torch.bfloat16 in (dtype, compute_dtype) else torch.float16
        assert torch.equal(dz, dz.to(coarser).to(dtype))
        # The reference (what CPU tensors run) too: the FP32 product, rounded once.
        once = grad_y.float() * activation_derivative(saved.float(), activation)
        assert_same_bits(ref_dz, once.to(coarser).to(dtype), "the reference's dZ")
    if not bias_grad:
        assert db is None
        return
    exact = _exact(activation, grad_y, saved)
    assert_sum_within_torch_error(db, exact, ref_db, "bias gradient", dim=0)
    again = triton_activation_backward(*args, bias_grad=True)
    assert torch.equal(again[0], dz) and torch.equal(again[1], db)


@pytest.mark.parametrize("cols", [256, 200])
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_programs_that_loop_over_row_steps(activation, stages, cols, device, monkeypatch):
    # One "SM" over 2 column blocks: 2 chunks of 128 rows, 4 and 3 row steps (the last
    # 8 rows), each step's loads issued STAGES - 1 steps ahead by triton's pipeliner on a
    # GPU (1: none) where every load is 16 bytes wide: operands NaN-padded on rows a
    # multiple of 16 elements apart, and dZ's rows (cols apart) aligned at 256 columns,
    # not at 200 (1 stage then).
    monkeypatch.setattr(kernel_module, "multiprocessors", lambda device: 1)
    monkeypatch.setitem(kernel_module._STAGES, activation, stages)
    launched = []

    def launch(kernel, grid, *args, **kwargs):
        launched.append(kwargs["STAGES"])
        return real_launch(kernel, grid, *args, **kwargs)

    real_launch = kernel_module.launch
    monkeypatch.setattr(kernel_module, "launch", launch)
    torch.manual_seed(2)
    grad_y = nan_padded(torch.randn(200, cols, device=device).half(), aligned=True, multiple=16)
    if activation == "relu":
        saved = torch.randn(200, cols, device=device).relu().half()
    else:
        saved = (torch.randn(200, cols, device=device) * 3).half()
    saved = nan_padded(saved, aligned=True, multiple=16)
    dz, db = triton_activation_backward(grad_y, saved, activation, torch.float16, bias_grad=True)
    assert launched == [stages if cols == 256 else 1]
    ref_dz, ref_db = activation_backward_ref(
        grad_y, saved, activation, torch.float16, bias_grad=True
    )
    _check_dz(activation, dz, ref_dz, grad_y, saved)
    exact = _exact(activation, grad_y, saved)
    assert_sum_within_torch_error(db, exact, ref_db, "bias gradient", dim=0)


def test_nan_and_inf_pass_as_through_torchs_ops(device):
    # threshold_backward's rule: zero where y <= 0 (-0.0 included), dY where y is NaN;
    # a NaN or inf dY passes where y > 0. GELU's derivative is NaN at a NaN or infinite z
    # (torch's formula: inf * 0 in z phi(z)), and exact at 0 and 10 (0.5 and 1), where
    # the two erfs cannot differ.
    grad_y = torch.tensor([[1.0, float("nan"), float("inf"), 2.0, -3.0, float("nan")]] * 3)
    y = torch.tensor([[float("nan"), 1.0, 2.0, 0.0, -0.0, -1.0]] * 3)
    g = torch.tensor([[0.0, 10.0, 0.0, float("nan"), float("inf"), -float("inf")]] * 3)
    for activation, saved in (("relu", y.half()), ("gelu", g.half())):
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


@pytest.mark.unpoisoned  # the poison's fill would show as an op
def test_the_bias_gradient_is_summed_in_the_one_launch(device, monkeypatch):
    # 2 column blocks of 4 chunks: the last chunk of each to finish adds the partials.
    # Nothing runs after the kernel (no torch.sum), and the counters are left at zero,
    # so the stream's next launch counts from zero.
    monkeypatch.setattr(kernel_module, "multiprocessors", lambda device: 2)
    torch.manual_seed(0)
    grad_y, saved = _operands("silu", torch.float16, device, transposed=False)
    with torch_ops_besides_launches() as ops:
        dz, db = triton_activation_backward(grad_y, saved, "silu", torch.float16, bias_grad=True)
    assert set(ops) <= {"empty.memory_format", "zeros"}, ops
    assert all(not buffer.any() for buffer in arrivals._buffers.values())
    ref_dz, ref_db = activation_backward_ref(grad_y, saved, "silu", torch.float16, bias_grad=True)
    exact = _exact("silu", grad_y, saved)
    assert_sum_within_torch_error(db, exact, ref_db, "bias gradient", dim=0)


@pytest.mark.unpoisoned  # (a poisoned allocation's fill would show as one)
@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_a_layers_stored_z_gets_no_gradient_filled_in(activation, device):
    # z, stored beside the output for the activation's node, has no gradient: autograd
    # must not make a tensor of zeros of the output's shape for it at every backward.
    import mpgemm

    layer = mpgemm.Linear(16, 8, activation=activation, device=device)
    y = layer(torch.randn(4, 16, device=device))
    with OpLog() as log:
        y.float().sum().backward()
    fills = [
        tuple(out.shape)
        for func, _, out in log.calls
        if func.overloadpacket.__name__ in ("zeros", "zeros_like", "zero_", "fill_")
    ]
    assert (4, 8) not in fills, fills
    assert layer.weight.grad is not None


def test_many_chunks_sum_to_the_same_bits_every_launch(device, monkeypatch):
    # On a GPU, chunks finish in any order and the last reads the others' partials from
    # memory (poisoned with NaN where one is read before it is written): the sum must
    # not depend on which finishes last. Under the interpreter, 35 chunks of 32 rows,
    # read back 32 at a time.
    rows, cols = (16384, 1024) if device.type == "cuda" else (1100, 300)
    if device.type != "cuda":
        monkeypatch.setattr(kernel_module, "multiprocessors", lambda device: 40)
    torch.manual_seed(1)
    grad_y = torch.randn(rows, cols, device=device).half()
    y = torch.randn(rows, cols, device=device).relu().half()
    first = triton_activation_backward(grad_y, y, "relu", torch.float16, bias_grad=True)[1]
    exact = (grad_y.double() * (y > 0)).sum(0)
    _, ref_db = activation_backward_ref(grad_y, y, "relu", torch.float16, bias_grad=True)
    assert_within_torch_error(first, exact, ref_db, "bias gradient")
    for _ in range(20 if device.type == "cuda" else 2):
        again = triton_activation_backward(grad_y, y, "relu", torch.float16, bias_grad=True)[1]
        assert torch.equal(again, first)


def test_counters_are_kept_zero_and_grow_on_demand(device):
    small = arrivals.counters(device, 3)
    assert small.dtype == torch.int32 and small.numel() >= 3 and not small.any()
    assert arrivals.counters(device, small.numel()) is small  # one buffer a stream
    larger = arrivals.counters(device, small.numel() + 1)
    assert larger.numel() > small.numel() and not larger.any()
    assert arrivals.counters(device, 3) is larger


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory pools")
def test_a_streams_counters_are_not_a_block_of_the_pool_its_thread_allocates_from():
    # As in torch inductor's CUDA-graph warm-up, which checks that its pool holds only
    # what it tracks: a buffer kept for the stream must come from outside the pool.
    device = torch.device("cuda")
    pool = torch.cuda.MemPool()
    with torch.cuda.stream(torch.cuda.Stream()), torch.cuda.use_mem_pool(pool):
        buffer = arrivals.counters(device, 3)
        in_pool = torch.zeros(3, device=device)  # the pool does take this thread's blocks
    index = torch.cuda.current_device()
    assert not buffer.any()
    assert torch._C._cuda_checkPoolLiveAllocations(index, pool.id, {in_pool.data_ptr()})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams and graph capture")
def test_each_stream_has_its_counters_and_a_capture_fresh_ones():
    device = torch.device("cuda")
    mine = arrivals.counters(device, 4)
    assert arrivals.counters(device, 4) is mine
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert arrivals.counters(device, 4) is not mine
    # A graph's launches count on zeros of their own, filled at each replay: a replay
    # on another stream than the capture's cannot meet that stream's eager launches.
    torch.manual_seed(2)
    grad_y = torch.randn(4096, 512, device=device).half()
    y = torch.randn(4096, 512, device=device).relu().half()
    eager = triton_activation_backward(grad_y, y, "relu", torch.float16, bias_grad=True)
    buffers = {key: id(buffer) for key, buffer in arrivals._buffers.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_activation_backward(grad_y, y, "relu", torch.float16, bias_grad=True)
    assert {key: id(buffer) for key, buffer in arrivals._buffers.items()} == buffers
    for _ in range(3):
        captured[1].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    assert all(not buffer.any() for buffer in arrivals._buffers.values())


@triton.jit
def _derivative_kernel(z_ptr, d_ptr, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    _, derivative = kernel_derivative(tl.load(z_ptr + offsets, mask=mask), ACTIVATION)
    tl.store(d_ptr + offsets, derivative, mask=mask)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_the_references_activations_are_torchs(activation):
    """act(z) as the references take it (``activation_value``: CPU tensors' forward
    without the interpreter, and the bar of the kernels' epilogues) is torch's own
    function to FP64 rounding, at every 64th between -12 and 12 and at inf, -inf and
    NaN (GELU's erf form 2e-10 off, relatively, where its tail cancels; a constant off
    in its fifth digit is 1e-5 off)."""
    special = torch.tensor([float("inf"), -float("inf"), float("nan")], dtype=torch.float64)
    z = torch.cat([torch.arange(-12, 12, 2**-6, dtype=torch.float64), special])
    ours, torchs = activation_value(z, activation), torch_activation(z, activation)
    torch.testing.assert_close(ours, torchs, rtol=1e-9, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_the_kernels_derivative_is_as_accurate_as_torchs(device, activation):
    """act'(z) as the backward's kernel takes it from the stored z, in FP32, at every 64th
    between -12 and 12 (tails and all): its largest error against FP64 at most twice
    that of torch's own FP32 derivative. (GELU's tanh form took 1 - t^2 from t, which
    lost its accuracy as t neared 1: 1.9 times torch's error through the interpreter,
    and more with a GPU's approximate exp; from exp(-2|u|), 0.17.)"""
    z = torch.arange(-12, 12, 2**-6, device=device)
    got = torch.full_like(z, float("nan"))
    _derivative_kernel[(triton.cdiv(z.numel(), 256),)](z, got, z.numel(), activation, 256)

    def derivative(dtype):
        t = z.to(dtype).requires_grad_()
        torch_activation(t, activation).sum().backward()
        return t.grad.double()

    exact = derivative(torch.float64)
    err = (got.double() - exact).abs().max().item()
    theirs = (derivative(torch.float32) - exact).abs().max().item()
    assert err <= 2 * theirs, f"{activation}': error {err:.3g}, torch's {theirs:.3g}"
