"""``mpgemm.cross_entropy`` against ``torch.nn.functional.cross_entropy``: through the
interpreter (or compiled on a GPU), loss and gradient against torch's in FP64 with
torch's own error in the logits' dtype as the bar, logits read through strides out of
NaN-padded buffers, gradients in poisoned memory; NaN and inf as torch's; one launch
forward and one backward; every other call torch's own."""

import pytest
import torch
import torch.nn.functional as F

import mpgemm
from tests.accuracy import (
    assert_same_bits,
    assert_within_torch_error,
    launched_kernels,
    nan_padded,
    torch_ops_besides_launches,
)

pytest.importorskip("triton")

N = 37  # ragged against the kernels' 16 rows a program


def _case(classes, dtype, device, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, classes, generator=g) * scale).to(device, dtype)
    target = torch.randint(0, classes, (N,), generator=g).to(device)
    target[[5, 9]] = -100  # ignored
    return nan_padded(logits, transposed=classes > 100), target


def _torch(x, target, grad, **options):
    """torch's loss and gradient for logits ``x`` (in x's dtype)."""
    x = x.detach().clone().requires_grad_()
    loss = F.cross_entropy(x, target, **options)
    loss.backward(grad.to(loss.dtype))
    return loss.detach(), x.grad


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("classes", [10, 300])
def test_matches_torch(classes, dtype, reduction, smoothing, device):
    x, target = _case(classes, dtype, device)
    options = dict(reduction=reduction, label_smoothing=smoothing)
    shape = (N,) if reduction == "none" else ()
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
    leaf = x.detach().requires_grad_()
    names, loss = launched_kernels(lambda: mpgemm.cross_entropy(leaf, target, **options))
    assert names == ["_cross_entropy_forward_kernel"]
    names, _ = launched_kernels(lambda: loss.backward(grad.to(loss.dtype)))
    assert names == ["_cross_entropy_backward_kernel"]
    assert loss.dtype == dtype and loss.shape == shape and leaf.grad.dtype == dtype
    exact, exact_grad = _torch(x.double(), target, grad.double(), **options)
    theirs, their_grad = _torch(x, target, grad, **options)
    assert_within_torch_error(loss, exact, theirs, "loss", rtol=1e-6)
    assert_within_torch_error(leaf.grad, exact_grad, their_grad, "gradient", rtol=1e-6)
    if reduction == "none":
        assert torch.equal(loss[[5, 9]], torch.zeros(2, dtype=dtype, device=device))
    assert torch.equal(leaf.grad[[5, 9]], torch.zeros(2, classes, dtype=dtype, device=device))


@pytest.mark.parametrize(("classes", "row"), [(10, 16), (16, 16), (20, 32), (5, 5), (300, 304)])
def test_the_gradients_rows_lie_16_elements_apart(classes, row, device):
    """The logits' gradient as the head's backward GEMMs read it best: rows 16
    elements apart (or a multiple), unless that more than doubles them; the same values
    as torch's, in the columns it has; a leaf's .grad is contiguous, as torch's."""
    x, target = _case(classes, torch.float32, device)
    leaf = x.detach().requires_grad_()
    (grad,) = torch.autograd.grad(mpgemm.cross_entropy(leaf, target), leaf)
    assert grad.shape == (N, classes) and grad.stride() == (row, 1)
    _, their_grad = _torch(x, target, torch.ones(()))
    torch.testing.assert_close(grad, their_grad, rtol=1e-5, atol=1e-7)
    mpgemm.cross_entropy(leaf, target).backward()
    assert leaf.grad.is_contiguous() and torch.equal(leaf.grad, grad)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp32_logits_in_the_hundreds_within_torchs_error(reduction, smoothing, device):
    """Logits of magnitude 100 to 400: the log-softmax taken as (x - m) - s, never
    through the log-sum-exp m + s, whose rounding there (a ulp of 256 is 3e-5) put the
    gradient 30 to 100 times torch's error from FP64 (seeds of a randomised search)."""
    x, target = _case(300, torch.float32, device, scale=100.0)
    options = dict(reduction=reduction, label_smoothing=smoothing)
    shape = (N,) if reduction == "none" else ()
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
    leaf = x.detach().requires_grad_()
    loss = mpgemm.cross_entropy(leaf, target, **options)
    loss.backward(grad)
    exact, exact_grad = _torch(x.double(), target, grad.double(), **options)
    theirs, their_grad = _torch(x, target, grad, **options)
    assert_within_torch_error(loss, exact, theirs, "loss")
    assert_within_torch_error(leaf.grad, exact_grad, their_grad, "gradient")


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backwards_reference_is_the_kernels_math(dtype, reduction, smoothing, device):
    """``mpgemm.reference.cross_entropy_backward_ref`` (the backward of gradients that
    the kernel cannot read: batched by ``is_grads_batched``) from the same saved
    tensors: within torch's own error of FP64, as the kernel, with its ignored rows'
    zeros and its NaN for a class out of range."""
    from mpgemm.kernels.cross_entropy import triton_cross_entropy
    from mpgemm.reference import cross_entropy_backward_ref

    x, target = _case(10, dtype, device)
    target[7] = 10  # out of range: NaN
    options = (-100, reduction, smoothing)
    _, lse, count = triton_cross_entropy(x, target, *options)
    shape = (N,) if reduction == "none" else ()
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
    ours = cross_entropy_backward_ref(grad, x, target, lse, count, *options)
    kept = torch.ones(N, dtype=torch.bool, device=device)
    kept[7] = False
    assert ours[7].isnan().all() and not ours[kept].isnan().any()
    assert torch.equal(ours[[5, 9]], torch.zeros(2, 10, dtype=dtype, device=device))
    # torch's, on the rows in range (its mean's count and its own rows: the same)
    valid = dict(reduction=reduction, label_smoothing=smoothing)
    g = grad[kept] if reduction == "none" else grad
    _, exact = _torch(x[kept].double(), target[kept], g.double(), **valid)
    _, theirs = _torch(x[kept], target[kept], g, **valid)
    if reduction == "mean":  # the forward's count had row 7 among those not ignored
        exact, theirs = (t * (count.item() - 1) / count.item() for t in (exact, theirs))
    assert_within_torch_error(ours[kept], exact, theirs, "gradient", rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_backwards_reference_puts_nan_where_the_kernel_does(reduction, device):
    """Where the kernel's backward gives NaN, its reference does, from the same saved
    tensors: the rows of a class index out of range either way (below 0 and not the
    ignored index, or past the last class), and in an ignored row, torch's 0 - p * 0,
    NaN where p is (ignored rows holding a +inf, or a NaN, have p NaN throughout)."""
    from mpgemm.kernels.cross_entropy import triton_cross_entropy, triton_cross_entropy_backward
    from mpgemm.reference import cross_entropy_backward_ref

    x, target = _case(10, torch.float32, device)
    target[2], target[7] = -3, 10
    x[5, 4] = float("inf")  # rows 5 and 9 are ignored
    x[9, 1] = float("nan")
    options = (-100, reduction, 0.0)
    _, lse, count = triton_cross_entropy(x, target, *options)
    grad = torch.ones((N,) if reduction == "none" else (), device=device)
    ours = cross_entropy_backward_ref(grad, x, target, lse, count, *options)
    kernels = triton_cross_entropy_backward(grad, x, target, lse, count, *options)
    assert torch.equal(ours.isnan(), kernels.isnan())
    assert ours.isnan().any(dim=1).nonzero().flatten().tolist() == [2, 5, 7, 9]
    torch.testing.assert_close(ours.nan_to_num(), kernels.nan_to_num(), rtol=1e-5, atol=1e-7)


def test_nan_and_inf_as_torchs(device):
    # A row with +inf (NaN loss), a target at -inf (inf loss), a NaN logit (NaN loss),
    # a row all -inf (NaN): torch's losses and gradients, NaN where torch's are. The
    # same rows ignored: loss 0, and the gradient of torch's log-softmax backward, 0 -
    # p * 0, NaN where p is (+inf's column, a NaN's row, the row all -inf).
    x = torch.randn(6, 5)
    x[0, 1] = float("inf")
    x[1, 2] = float("-inf")
    x[2, 3] = float("nan")
    x[3] = float("-inf")
    x = torch.cat([x, x[:4]])
    target = torch.tensor([0, 2, 1, 4, 3, 0, -100, -100, -100, -100])
    for reduction in ("none", "sum"):
        leaf = x.to(device, copy=True).requires_grad_()
        loss = mpgemm.cross_entropy(leaf, target.to(device), reduction=reduction)
        loss.backward(torch.ones_like(loss))
        theirs, their_grad = _torch(x, target, torch.ones(loss.shape), reduction=reduction)
        for ours, want in ((loss, theirs), (leaf.grad, their_grad)):
            ours = ours.cpu()
            assert torch.equal(ours.isnan(), want.isnan()), (ours, want)
            torch.testing.assert_close(ours.nan_to_num(), want.nan_to_num(), rtol=1e-6, atol=1e-6)


def test_empty_and_all_ignored_as_torchs(device):
    for rows, target in ((0, torch.empty(0, dtype=torch.int64)), (3, torch.full((3,), -100))):
        x = torch.randn(rows, 4)
        for reduction in ("mean", "sum", "none"):
            leaf = x.to(device, copy=True).requires_grad_()
            loss = mpgemm.cross_entropy(leaf, target.to(device), reduction=reduction)
            loss.backward(torch.ones_like(loss))
            theirs, their_grad = _torch(x, target, torch.ones(loss.shape), reduction=reduction)
            assert torch.equal(loss.cpu().isnan(), theirs.isnan()), (reduction, loss, theirs)
            assert torch.equal(loss.cpu().nan_to_num(), theirs.nan_to_num())
            assert torch.equal(leaf.grad.cpu(), their_grad)


def test_a_class_out_of_range_gives_nan_where_torch_refuses(device):
    x = torch.randn(4, 3, device=device, requires_grad=True)
    target = torch.tensor([0, 3, -1, 2], device=device)
    loss = mpgemm.cross_entropy(x, target, reduction="none")
    loss.sum().backward()
    assert loss.isnan().tolist() == [False, True, True, False]
    assert x.grad.isnan().all(dim=1).tolist() == [False, True, True, False]
    with pytest.raises(IndexError):  # torch's, on the CPU
        F.cross_entropy(x.detach().cpu(), target.cpu(), reduction="none")


@pytest.mark.unpoisoned  # the poison's fill would show as an op
def test_the_mean_is_summed_in_the_forwards_launch_the_same_bits_every_run(device, monkeypatch):
    # 7 programs' partial sums, added by the last to arrive (4 at a time here): no torch
    # op but the allocations, the counter left at zero, and the same bits run after run.
    from mpgemm.kernels import arrivals
    from mpgemm.kernels import cross_entropy as kernel_module

    monkeypatch.setattr(kernel_module, "BLOCK_P", 4)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(100, 10, generator=g).to(device)
    target = torch.randint(0, 10, (100,), generator=g).to(device)
    with torch_ops_besides_launches() as ops:
        first = mpgemm.cross_entropy(x, target)
    assert set(ops) <= {"empty.memory_format", "zeros"}, ops
    assert all(not buffer.any() for buffer in arrivals._buffers.values())
    exact = F.cross_entropy(x.double(), target)
    assert_within_torch_error(first, exact, F.cross_entropy(x, target), "mean")
    for _ in range(3):
        assert torch.equal(mpgemm.cross_entropy(x, target), first)


def test_every_other_call_is_torchs(device):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 5, generator=g).to(device)
    target = torch.randint(0, 5, (6,), generator=g).to(device)
    calls = [
        ((x, target), dict(weight=torch.rand(5, generator=g).to(device))),
        ((x.view(3, 5, 2), target.view(3, 2)), {}),  # K-dimensional
        ((x, x.softmax(1)), {}),  # class probabilities
        ((x, target.int()), {}),  # an int32 target: torch's error
        ((x, target[:4]), {}),  # a batch mismatch: torch's error
        ((x, target[:, None]), {}),  # a 2-D target: torch's error
        ((x[..., None], target), {}),  # K-dimensional logits, a 1-D target: torch's error
        # no classes: torch's error on the CPU; on a GPU torch's op asserts on the device
        # (every target out of bounds), which ends the process's CUDA context
        *([((x[:, :0], target), {})] if device.type == "cpu" else []),
        ((x.double(), target), {}),  # FP64 logits
        ((x, target), dict(size_average=False)),  # the deprecated arguments
        ((x, target), dict(reduce=False)),
        ((x, target), dict(reduction="avg")),  # torch's error
        ((x, target), dict(label_smoothing=1.5)),  # torch's error
        ((x, target), dict(label_smoothing=torch.tensor(0.1))),  # torch's error
    ]
    for args, options in calls:
        names, ours = launched_kernels(
            lambda a=args, o=options: _or_error(mpgemm.cross_entropy, a, o)
        )
        assert names == []
        theirs = _or_error(F.cross_entropy, args, options)
        if isinstance(theirs, Exception):
            assert type(ours) is type(theirs) and str(ours) == str(theirs)
        else:
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("why", ["reference backend", "negative view", "class weights"])
def test_16_bit_logits_on_torchs_path_take_the_softmax_in_fp32(on_path, dtype, why):
    # Where the kernels do not take a call, torch's op gets the logits in FP32 (and
    # class weights beside them), as the kernels read them; on 16-bit logits it would
    # round the log-probabilities to 16 bits. The loss and the gradient are rounded
    # once to the logits' dtype.
    device = on_path("reference" if why == "reference backend" else "kernels")
    x, target = _case(100, dtype, device)
    options: dict = dict(label_smoothing=0.1)
    if why == "class weights":
        options["weight"] = torch.rand(100, generator=torch.Generator().manual_seed(2))
        options["weight"] = options["weight"].to(device, dtype)
    leaf = (torch._neg_view(x.neg()) if why == "negative view" else x.detach()).requires_grad_()
    if why == "reference backend":  # (while launches are intercepted, CPU tensors are not)
        loss = mpgemm.cross_entropy(leaf, target, **options)
    else:
        names, loss = launched_kernels(lambda: mpgemm.cross_entropy(leaf, target, **options))
        assert names == []
    loss.backward()
    wide = leaf.detach().float().requires_grad_()
    if why == "class weights":
        options["weight"] = options["weight"].float()
    expected = F.cross_entropy(wide, target, **options)
    expected.backward()
    assert_same_bits(loss.detach(), expected.detach().to(dtype), "loss")
    assert_same_bits(leaf.grad, wide.grad.to(dtype), "gradient")


def _or_error(fn, args, options):
    try:
        return fn(*args, **options)
    except Exception as error:  # noqa: BLE001 (compared with torch's own)
        return error


def test_compiled_or_transformed_it_is_torchs(device):
    # torch.compile traces torch's op (inductor fuses its own); torch.func transforms
    # see torch's too.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 5, generator=g).to(device)
    target = torch.randint(0, 5, (8,), generator=g).to(device)
    compiled = torch.compile(mpgemm.cross_entropy, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, target), F.cross_entropy(x, target))
    ours = torch.func.grad(lambda z: mpgemm.cross_entropy(z, target))(x)
    assert torch.equal(ours, torch.func.grad(lambda z: F.cross_entropy(z, target))(x))


def _second_derivative(loss_fn, x, target, r, **options):
    """The logits' gradient under ``create_graph`` (of the loss's sum) and the gradient
    of <r, it> (a Hessian-vector product of the loss), for logits ``x`` as given."""
    x = x.detach().clone().requires_grad_()
    loss = loss_fn(x, target, **options).sum()
    (first,) = torch.autograd.grad(loss, x, create_graph=True)
    (second,) = torch.autograd.grad((r.double() * first.double()).sum(), x)
    return first.detach(), second


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_logits_second_derivatives_within_torchs_fp32_error(dtype, reduction, device):
    """The recorded backward (``create_graph``) widens the logits once: the gradients of
    the softmax's two uses of them, p R and -p (p . R), which cancel, are summed in FP32
    and rounded to the logits' dtype once, as torch's FP32 second derivative is. (Widened
    for each use, each was rounded to 16 bits before the sum: a BF16 element 0.0234
    where FP64 has 0.0275, 0.0041 off where torch's FP32 rounded to BF16 is 1e-4; the
    cross_entropy_second_order search found it.)"""
    x, target = _case(10, dtype, device)
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    loss = (mpgemm.cross_entropy, F.cross_entropy, F.cross_entropy)
    runs = [
        _second_derivative(fn, x.to(cast), target, r, reduction=reduction)
        for fn, cast in zip(loss, (dtype, torch.float32, torch.float64), strict=True)
    ]
    for i, what in enumerate(("gradient", "second derivative")):
        ours, torchs, exact = (run[i] for run in runs)
        assert ours.dtype == dtype
        # (the terms' FP32 cancelling: at most 2 |w| |R| a row, w at most 1)
        atol = 2 * torch.finfo(torch.float32).eps * r.abs().max().item()
        rtol = torch.finfo(dtype).eps / 2  # (the rounding to the logits' dtype)
        assert_within_torch_error(ours, exact, torchs.to(dtype), what, rtol=rtol, atol=atol)


def test_a_mean_over_no_rows_has_torchs_second_derivative(device):
    """Every row ignored, the mean's gradient weight is grad / 0: inf. The recorded
    backward's branch not taken (the ignored rows' gradient is the other) got a zero
    gradient times it, NaN, where torch's second derivative is 0."""
    x = torch.randn(3, 4, device=device)
    target = torch.full((3,), -100, device=device)
    r = torch.randn(3, 4, device=device)
    for smoothing in (0.0, 0.5):
        options = dict(reduction="mean", label_smoothing=smoothing)
        ours = _second_derivative(mpgemm.cross_entropy, x, target, r, **options)
        torchs = _second_derivative(F.cross_entropy, x, target, r, **options)
        for got, want in zip(ours, torchs, strict=True):
            assert_same_bits(got, want, f"smoothing {smoothing}")
