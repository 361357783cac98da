"""A ReLU's backward in the epilogue of the GEMM that makes its output's gradient
(``mpgemm.functional._fusable_relu``).

The kernels: both GEMMs' ReLU mask (``relu_output``) and C's column sums (``colsum_c``)
against FP64, with torch's own product of the same 16-bit operands as the bar, NaN
around every operand, a NaN and a -0.0 in y, and partial rows of one and of two per
tile. The autograd contract: a ReLU layer into a layer takes one launch less and
leaves the same gradients as the ReLU's own kernel (the bias gradient summed in
another order, within FP32's bound); where anything could see the gradient at the
ReLU's output (a tensor hook, ``retain_grad``, a module's backward hook, a second
consumer, checkpointing's recomputed input) the ReLU's node runs its own kernel, and
every gradient and every hook sees what it sees unfused, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import mpgemm
from mpgemm import functional
from mpgemm.reference import gemm_ref
from tests.accuracy import (
    assert_same_bits,
    assert_sum_within_torch_error,
    assert_within_torch_error,
    fused_relu_gradients,
    launched_kernels,
    nan_padded,
    store_in_parts,
)

pytest.importorskip("triton")


from mpgemm.kernels import gemm  # noqa: E402
from mpgemm.kernels.launches import intercept, jit_function, named_arguments  # noqa: E402

# M, K, N: ragged against the interpreter's 32x32x32 tiles.
M, K, N = 72, 112, 48
RELU_KERNEL = "_activation_backward_kernel"


def _relu_output(dtype, device):
    """A ReLU's output, (M, N) in ``dtype``, NaN around it: zeros where z < 0, a NaN
    (threshold_backward passes the gradient on) and a -0.0 (it masks it)."""
    y = torch.relu(torch.randn(M, N, device=device)).to(dtype)
    y[0, :5] = float("nan")
    y[1, :5] = -0.0
    return nan_padded(y, aligned=True)


@pytest.mark.parametrize("summed_rows", [32, 16])  # a tile's 32 rows: 1 or 2 partial rows
@pytest.mark.parametrize("kernel", ["tma", "tma, stored in quarters", "pointer"])
@pytest.mark.parametrize("compute_dtype", [torch.float16, torch.bfloat16])
def test_the_masked_product_and_its_column_sums_within_the_bar(
    kernel, compute_dtype, summed_rows, device, monkeypatch
):
    monkeypatch.setattr(gemm, "multiprocessors", lambda device: 3)  # tiles a program: 4
    monkeypatch.setattr(gemm, "COLUMN_SUM_ROWS", summed_rows)  # (the launches' SUM_ROWS)
    if kernel.endswith("quarters"):
        store_in_parts(monkeypatch, 4, compute_dtype.itemsize)
    torch.manual_seed(0)
    a = nan_padded(torch.randn(M, K, device=device).to(compute_dtype), aligned=True)
    b = nan_padded(torch.randn(K, N, device=device).to(compute_dtype), aligned=True)
    y = _relu_output(compute_dtype, device)
    kwargs = dict(compute_dtype=compute_dtype, out_dtype=compute_dtype, relu_output=y)

    def product():
        with gemm.use_kernel(kernel.split(",")[0]):
            return gemm.triton_gemm(a, b, colsum_c=True, **kwargs)

    launched = []

    def keep(kernel, grid, args, kwargs, configs):
        launched.append((jit_function(kernel).fn.__name__, named_arguments(kernel, args, kwargs)))
        kernel[grid](*args, **kwargs)

    with intercept(keep):
        c, g, r = product()
    [(name, named)] = launched
    assert name == ("_gemm_kernel" if kernel == "pointer" else "_gemm_tma_kernel")
    assert g is None and r.shape == (N,) and r.dtype == torch.float32
    # The partials as the launch laid them out: a row per summed_rows rows of C, each
    # written (the allocation is poisoned with NaN).
    partials = named["p_ptr"]
    assert named["SUM_ROWS"] == summed_rows and partials.shape == (-(-M // summed_rows), N)
    assert partials.isfinite().all()
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


class _Step:
    """A ReLU layer into a layer, forward and backward, with ReLU fused as the flag
    says; what it records: the kernels launched, every parameter's gradient, the
    gradients its ``case`` lets the test see at y, and the fused input gradient."""

    def __init__(self, case, fused, device, monkeypatch, *, bias_grad=True, shape=(M, 40)):
        monkeypatch.setattr(functional, "_FUSE_RELU", fused)
        torch.manual_seed(0)
        self.relu = mpgemm.Linear(shape[-1], 48, activation="relu").to(device)
        self.head = mpgemm.Linear(48, 24).to(device)
        self.relu.bias.requires_grad_(bias_grad)
        x = torch.randn(*shape, device=device)
        self.seen: list[torch.Tensor] = []
        if case == "module backward hook":
            self.relu.register_full_backward_hook(lambda m, gi, go: self.seen.append(go[0]))
        if case == "checkpointed":
            out = torch.utils.checkpoint.checkpoint(
                lambda t: self.head(self.relu(t)), x, use_reentrant=False
            )
        else:
            y = self.relu(x)
            if case == "tensor hook":
                y.register_hook(lambda g: self.seen.append(g.clone()))
            if case == "retain_grad":
                y.retain_grad()
            out = self.head(y)
            if case == "second consumer":
                out = out.float().sum() + y.float().square().sum()
            self.y = y
        loss = out.float().square().sum()
        with fused_relu_gradients() as self.fused_dz:
            self.names, _ = launched_kernels(loss.backward)
        if case == "retain_grad":
            self.seen.append(self.y.grad)
        self.grads = [p.grad for p in (*self.relu.parameters(), *self.head.parameters())]


@pytest.mark.parametrize("bias_grad", [True, False])
@pytest.mark.parametrize("shape", [(M, 40), (4, 18, 40)])
def test_a_relu_into_a_layer_takes_its_backward_in_the_gemm(shape, bias_grad, device, monkeypatch):
    fused = _Step(None, True, device, monkeypatch, bias_grad=bias_grad, shape=shape)
    unfused = _Step(None, False, device, monkeypatch, bias_grad=bias_grad, shape=shape)
    assert RELU_KERNEL in unfused.names
    assert fused.names == [n for n in unfused.names if n != RELU_KERNEL]
    [dz] = fused.fused_dz
    for i, what in ((0, "weight"), (2, "head's weight"), (3, "head's bias")):
        assert_same_bits(fused.grads[i], unfused.grads[i], what)
    bias, unfused_bias = fused.grads[1], unfused.grads[1]
    if bias_grad:
        # FP32 sums of the same dZ in the GEMM's order, against the ReLU kernel's.
        terms = dz.reshape(-1, dz.shape[-1])
        assert_sum_within_torch_error(bias, terms, unfused_bias, "bias gradient", dim=0)
    else:
        assert bias is None and unfused_bias is None


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # x needs no gradient
@pytest.mark.parametrize(
    "case",
    ["tensor hook", "retain_grad", "module backward hook", "second consumer", "checkpointed"],
)
def test_where_the_gradient_at_the_relu_output_is_seen_nothing_differs(case, device, monkeypatch):
    fused = _Step(case, True, device, monkeypatch)
    unfused = _Step(case, False, device, monkeypatch)
    # A second consumer's gradient is added to the masked one: the ReLU's node masks
    # the sum itself, as unfused (the mask is idempotent); else nothing is fused.
    assert bool(fused.fused_dz) == (case == "second consumer")
    assert fused.names.count(RELU_KERNEL) == unfused.names.count(RELU_KERNEL) >= 1
    for got, want in zip(fused.grads + fused.seen, unfused.grads + unfused.seen, strict=True):
        assert_same_bits(got, want, case)
    assert len(fused.seen) == (case in ("tensor hook", "retain_grad", "module backward hook"))


def test_the_relu_output_changed_in_place_fails_the_backward_as_unfused(device, monkeypatch):
    for fused in (True, False):
        monkeypatch.setattr(functional, "_FUSE_RELU", fused)
        relu = mpgemm.Linear(40, 48, activation="relu").to(device)
        head = mpgemm.Linear(48, 24).to(device)
        y = relu(torch.randn(M, 40, device=device))
        out = head(y)
        with torch.no_grad():
            y.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.float().sum().backward()


def test_the_reference_path_fuses_to_the_same_gradients(device, monkeypatch):
    # CPU tensors on the reference backend (torch ops): the same contract.
    if device.type != "cpu":
        pytest.skip("the reference backend of CPU tensors")
    monkeypatch.setattr(functional, "_interpreting", lambda: False)
    monkeypatch.setattr(functional, "_intercepting", lambda: False)  # launched_kernels'
    fused = _Step(None, True, device, monkeypatch)
    unfused = _Step(None, False, device, monkeypatch)
    assert fused.names == unfused.names == [] and len(fused.fused_dz) == 1
    for got, want in zip(fused.grads, unfused.grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
