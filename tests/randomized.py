"""Randomised searches of mpgemm's ops against torch's: each case is drawn from its
seed (shapes, strides, dtypes, options, inf and NaN), run through mpgemm and torch,
and held to the suite's bars against FP64. Through the interpreter on a CPU, compiled
on a GPU.

    TRITON_INTERPRET=1 python -m tests.randomized linear 0 500   # op, first seed, count
    python -m tests.randomized linear 0 500                      # on a GPU

Ops: ``amp`` (unscale against torch's op, bit for bit; ``LossScaleOptimizer`` against
torch's scaler recipe), ``copies`` (a converted model's weight copies current through
steps, edits, loads and freezes: its outputs those of a fresh deep copy), ``matmul``,
``linear`` (with the activations, biases of any dtype and shape, the output dtypes),
``cross_entropy`` (ignore_index, smoothing, reductions, inf and NaN logits, classes out
of range), ``optim`` (SGD, Adam, AdamW against torch's, with and without a scaler,
param groups, 16-bit parameters against FP64; two cases in three on blocks of 4
elements, 2 or 3 a program, so that these small tensors span several blocks as a large
model's do), ``scaler`` (``mpgemm.GradScaler`` against torch's through drawn runs of its
API, bit for bit, state dicts loaded across) and ``masters`` (``LossScaleOptimizer``
over a 16-bit model against torch's recipe with FP32 masters by hand, bit for bit) and
``relu_fusion`` (a ReLU layer into a layer, its backward in that layer's input-gradient
GEMM against its own kernel, over dtypes, shapes, frozen parameters, hooks and a second
consumer: the same gradients, bit for bit but for the bias's summation order) and
``linear_second_order`` and ``matmul_second_order`` (``linear``'s and ``matmul``'s draws
differentiated twice: the gradients of a loss taken under ``create_graph`` and those of
a penalty on them, elementwise within a first-order error bound,
``tests.error_bounds``, which the references differentiated by torch must meet too)
and ``cross_entropy_second_order`` (the same of ``cross_entropy``'s draws, against
torch's), and ``linear_forward_mode`` and ``matmul_forward_mode`` (forward-mode AD:
tangents for some of the inputs, the tangent within ``tests.error_bounds``'s bound,
the primal the bits of a plain call), and ``linear_nonfinite`` and ``matmul_nonfinite``
(inf, -inf and NaN placed in the operands: the output and gradients non-finite exactly
where the references' are).
Tensors come in drawn layouts: contiguous, transposed, sliced, negative views
(``_operand``, ``_laid_out``), and incoming gradients also as one value broadcast
(``_incoming``). Prints each failing case and a count; exit status 1 on any. Searches
like these found four faults (``bench/NOTES.md``, 2026-11-26, fifth session), and with
the layouts a fifth (2026-11-28: ``cross_entropy`` took 16-bit logits in 16 bits on
torch's path), and the second-order searches two more (2026-11-28, twenty-fifth
session: ``cross_entropy``'s second derivatives); ``tests/test_randomized.py`` runs a
few seeds of each.

Where a product's terms cancel, its error against FP64 is bounded by the sum of their
magnitudes, not by the result's: each bar adds half a unit of the coarsest rounding the
operands pass through (the compute dtype, or a coarser 16-bit output whose gradient
carries dZ) times the largest such sum (``_cancelling``).
"""

from __future__ import annotations

import copy
import functools
import random
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad

import mpgemm
from mpgemm import functional
from mpgemm.reference import (
    compute_dtype_for,
    dz_rounding,
    linear_ref,
    matmul_ref,
    torch_activation,
)
from mpgemm.scaling import unscale_
from tests import error_bounds
from tests.accuracy import (
    assert_same_bits,
    assert_sum_within_torch_error,
    assert_within_torch_error,
    away_from_relu_kink,
    fused_relu_gradients,
    optimizer_launch_shape,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HALVES = (torch.float16, torch.bfloat16)
# Where the cases' tensors live (``search``): drawn on the CPU, from the seed, and moved.
_device = torch.device("cpu")


def _randn(*size: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(size, generator=g).to(_device)


def _largest(t: torch.Tensor) -> float:
    """``t``'s largest magnitude (0 for no elements)."""
    return t.detach().abs().max().item() if t.numel() else 0.0


def _cancelling(dtype: torch.dtype, magnitudes: torch.Tensor) -> float:
    """Half a unit of ``dtype`` times the largest sum of the terms' magnitudes."""
    return torch.finfo(dtype).eps / 2 * _largest(magnitudes)


def _laid_out(values: torch.Tensor, kind: str) -> torch.Tensor:
    """A copy of ``values`` in layout ``kind``: "contiguous"; "transposed" (its last two
    dimensions' memory swapped); "sliced" (every other element of a last dimension
    twice as wide, NaN between, which a read there would carry); "negative" (a
    negative view: its memory the values negated, as ``z.conj().imag`` of a complex
    ``z``). A tensor with too few dimensions for its layout is contiguous."""
    if kind == "transposed" and values.dim() >= 2:
        return values.mT.contiguous().mT
    if kind == "sliced" and values.dim() >= 1:
        wide = values.new_full((*values.shape[:-1], 2 * values.shape[-1]), float("nan"))
        wide[..., ::2] = values
        return wide[..., ::2]
    if kind == "negative":
        return torch._neg_view(values.neg())
    return values.clone()


def _operand(
    shape: tuple, dtype: torch.dtype, g: torch.Generator, scale: float = 1.0
) -> torch.Tensor:
    """Normal values times ``scale`` in a tensor of ``shape``, in one of ``_laid_out``'s
    layouts or (batched) expanded over its first dimension."""
    kind = random.choice(["contiguous", "transposed", "sliced", "expanded", "negative"])
    if kind == "expanded" and len(shape) >= 3:
        return (_randn(1, *shape[1:], g=g) * scale).to(dtype).expand(*shape)
    return _laid_out((_randn(*shape, g=g) * scale).to(dtype), kind)


# The layouts of an incoming gradient (``_incoming``).
GRAD_LAYOUTS = ["contiguous", "transposed", "sliced", "negative", "broadcast"]


def _incoming(values: torch.Tensor, kind: str) -> torch.Tensor:
    """An incoming gradient from ``values``: in ``_laid_out``'s layout ``kind``, or for
    "broadcast" its first value over its shape, stride 0 throughout (as the backward of
    ``y.sum()`` hands it on)."""
    if kind == "broadcast":
        return values.reshape(-1)[:1].reshape((1,) * values.dim()).expand(values.shape)
    return _laid_out(values, kind)


def _matmul_operands(seed: int) -> tuple:
    """``matmul``'s draw from ``seed`` (seeding ``random`` too, for what follows): the
    generator for later tensors, a, b, the compute and output dtypes to give (None: the
    default), and a description of them."""
    random.seed(seed)
    g = torch.Generator().manual_seed(seed)
    m, k, n = (random.choice([0, 1, 2, 3, 5, 8, 16, 17, 31, 33, 40, 64, 70]) for _ in range(3))
    batch = tuple(random.choice([1, 2, 3]) for _ in range(random.choice([1, 2, 3])))
    batched = random.random() < 0.3
    # a's batch: b's, b's with sizes broadcast from 1 or leading dimensions dropped, or
    # none (a matrix, or a vector, against a batch of matrices).
    a_batch = tuple(d if random.random() < 0.7 else 1 for d in batch)[random.choice([0, 0, 1]) :]
    a_shape = (*a_batch, m, k) if batched and random.random() < 0.8 else (m, k)
    if random.random() < 0.1:
        a_shape = (k,)
    b_batch = tuple(d if random.random() < 0.8 else 1 for d in batch)
    if batched and random.random() < 0.3:
        # b's batch shorter than a's, or none (a batch of rows against a matrix or a
        # vector: one GEMM over a's rows, or a batch of products broadcast over b)
        b_batch = b_batch[random.randint(1, len(b_batch)) :]
    b_shape = (*b_batch, k, n) if batched else (k,) if random.random() < 0.1 else (k, n)
    if batched and not b_batch and random.random() < 0.2:
        b_shape = (k,)
    a = _operand(a_shape, random.choice(DTYPES), g)
    b = _operand(b_shape, random.choice(DTYPES), g)
    compute = random.choice([None, *HALVES])
    out_dtype = random.choice([None, *DTYPES])
    what = f"a {tuple(a.shape)} {a.dtype} {a.stride()}, b {tuple(b.shape)} {b.dtype} "
    what += f"{b.stride()}, compute {compute}, out {out_dtype}"
    return g, a, b, compute, out_dtype, what


def matmul_case(seed: int) -> None:
    g, a, b, compute, out_dtype, what = _matmul_operands(seed)
    grad = random.random() < 0.5
    a, b = a.detach().requires_grad_(grad), b.detach().requires_grad_(grad)
    what = f"matmul seed {seed}: {what}, grad {grad}"
    compute_given = compute
    compute = compute or compute_dtype_for(a, b)
    ar, br = a.detach().to(compute), b.detach().to(compute)
    if not grad and random.random() < 0.3:
        # out=, as torch.matmul's: written in place, transposed or not, returned.
        shape = torch.matmul(ar.float(), br.float()).shape
        out = torch.full(shape[::-1], float("nan"), device=_device, dtype=out_dtype or compute)
        reverse = tuple(reversed(range(out.dim())))  # (a tuple: a 0-dim out has none)
        out = out.permute(reverse) if random.random() < 0.5 else out.view(shape)
        if random.random() < 0.2:  # its memory the values negated
            out = torch._neg_view(out)
        what += f", out= {out.stride()}{' negative' if out.is_neg() else ''}"
        c = mpgemm.matmul(a, b, compute_dtype=compute_given, out_dtype=out_dtype, out=out)
        assert c is out, f"{what}: out= not returned"
    else:
        c = mpgemm.matmul(a, b, compute_dtype=compute_given, out_dtype=out_dtype)
    assert c.dtype == (out_dtype or compute), what
    terms = torch.matmul(ar.abs().double(), br.abs().double())
    exact = torch.matmul(ar.double(), br.double())
    base = torch.matmul(ar.float(), br.float()).to(c.dtype)
    assert_within_torch_error(c, exact, base, what, atol=_cancelling(torch.float32, terms))
    if not (grad and c.numel()):
        return
    grad_layout = random.choice(GRAD_LAYOUTS)
    what += f", dC {grad_layout}"
    grad_c = _incoming(_randn(*c.shape, g=g).to(c.dtype), grad_layout)
    c.backward(grad_c)
    # FP64, FP32 (torch's product of the rounded operands), and the magnitudes of the
    # gradients' terms: the backward of |A| @ |B| from |dC|.
    runs = [
        ([t.double() for t in (ar, br)], grad_c.to(compute).double()),
        ([t.float() for t in (ar, br)], grad_c.to(compute).float()),
        ([t.abs().double() for t in (ar, br)], grad_c.abs().double()),
    ]
    for leaves, seed_grad in runs:
        for leaf in leaves:
            leaf.requires_grad_()
        torch.matmul(*leaves).backward(seed_grad)
    rounding = dz_rounding(c.dtype, compute)
    for i, (name, t) in enumerate(zip("ab", (a, b), strict=True)):
        exact, theirs, magnitudes = (leaves[i].grad for leaves, _ in runs)
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape, f"{what}: d{name}"
        atol = _cancelling(rounding, magnitudes) + _cancelling(t.dtype, exact)
        assert_within_torch_error(t.grad, exact, theirs.to(t.dtype), f"{what}: d{name}", atol=atol)


def _linear_operands(seed: int) -> tuple:
    """``linear``'s draw from ``seed`` (seeding ``random`` too, for what follows): the
    generator for later tensors, x, W, the bias or None, the activation, the compute
    and output dtypes to give (None: the default), and a description of them."""
    random.seed(seed)
    g = torch.Generator().manual_seed(seed)
    lead = tuple(random.choice([1, 2, 3, 5, 17, 33]) for _ in range(random.choice([0, 1, 2])))
    k, n = random.choice([1, 3, 8, 16, 17, 40]), random.choice([1, 2, 10, 16, 24, 33])
    x = _operand((*lead, k), random.choice(DTYPES), g)
    w = _operand((n, k), random.choice(DTYPES), g, scale=k**-0.5)
    shape = random.choice([None, (n,), ()])
    bias = None if shape is None else _randn(*shape, g=g).to(random.choice(DTYPES))
    activation = random.choice([None, "relu", "gelu", "gelu_tanh", "silu"])
    compute = random.choice([None, *HALVES])
    out_dtype = random.choice([None, *DTYPES])
    what = f"x {tuple(x.shape)} {x.dtype} {x.stride()}, w {w.dtype} {w.stride()}, bias "
    what += f"{None if bias is None else (tuple(bias.shape), bias.dtype)}, {activation}, "
    what += f"compute {compute}, out {out_dtype}"
    return g, x, w, bias, activation, compute, out_dtype, what


def _layer_inputs(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> dict:
    """A layer's inputs by name: "x", "w" and, if it has one, "b"."""
    return {name: t for name, t in zip("xwb", (x, w, bias), strict=True) if t is not None}


def _layer(x, w, b, activation: str | None) -> torch.Tensor:
    """act(x @ w.T + b) by torch's ops, in the inputs' dtype (FP64 for the exact)."""
    z = x @ w.T
    return torch_activation(z if b is None else z + b, activation)


def linear_case(seed: int) -> None:
    g, x, w, bias, activation, compute, out_dtype, what = _linear_operands(seed)
    # dY's layout (``_incoming``; not broadcast with a ReLU, whose masking of dY near
    # the kink below that would undo).
    grad_layout = random.choice(GRAD_LAYOUTS[:-1] if activation == "relu" else GRAD_LAYOUTS)
    what = f"linear seed {seed}: {what}, dY {grad_layout}"
    compute = compute or compute_dtype_for(x, w)
    results, grad_y = [], None
    for fn, cast in ((mpgemm.linear, None), (None, torch.float64), (linear_ref, None)):
        xl, wl, bl = (
            None if t is None else t.detach().to(cast or t.dtype).requires_grad_()
            for t in (x, w, bias)
        )
        if fn is None:  # FP64
            y = _layer(xl, wl, bl, activation)
        else:
            y = fn(xl, wl, bl, activation=activation, compute_dtype=compute, out_dtype=out_dtype)
        if grad_y is None:
            grad_y = _randn(*y.shape, g=g)
            if activation == "relu":
                grad_y = away_from_relu_kink(grad_y, x, w, bias)
            grad_y = _incoming(grad_y.to(y.dtype), grad_layout)
        if y.numel():
            y.backward(grad_y.to(y.dtype))
        results.append((y, [None if t is None else t.grad for t in (xl, wl, bl)]))
    (y, grads), (y64, grads64), (y_ref, grads_ref) = results
    assert y.dtype == y_ref.dtype == (out_dtype or compute) and y.shape == y_ref.shape, what
    terms = F.linear(x.to(compute).abs().double(), w.to(compute).abs().double())
    atol = _cancelling(torch.float32, terms)
    assert_within_torch_error(y, y64.detach(), y_ref.detach(), f"{what}: y", atol=atol)
    if not y.numel():
        return
    # dZ reaches the GEMMs rounded to the coarser of y's dtype and the compute dtype
    # (the bar cannot tell that from a second rounding to the finer one: a test does).
    # The magnitudes of the gradients' terms: the backward of |x| W^T + |b| (their
    # absolute values) from 1.13 |dY| (GELU's derivative's largest).
    rounding = dz_rounding(y.dtype, compute)
    magnitudes = [
        None if t is None else t.detach().abs().double().requires_grad_() for t in (x, w, bias)
    ]
    z = F.linear(magnitudes[0], magnitudes[1])
    (z if magnitudes[2] is None else z + magnitudes[2]).backward(1.13 * grad_y.abs().double())
    for name, t, got, exact, theirs, terms in zip(
        "xwb", (x, w, bias), grads, grads64, grads_ref, magnitudes, strict=True
    ):
        if t is None:
            continue
        assert got is not None and got.dtype == t.dtype and got.shape == t.shape, f"{what}: d{name}"
        # (The bias gradient sums dZ in FP32, before its rounding.)
        summed = torch.float32 if name == "b" else rounding
        atol = _cancelling(summed, terms.grad) + _cancelling(t.dtype, exact)
        if activation in functional.SAVES_PREACTIVATION:
            # act'(z) is taken from z as stored, rounded to y's dtype (as autocast's
            # is from its 16-bit z): |act''(z) z| <= 0.34 for the three, so dZ moves by
            # up to 0.34 |dY| half-units of y's dtype (the terms' 1.13 |dY| scaled).
            atol += _cancelling(y.dtype, terms.grad) * 0.34 / 1.13
        assert_within_torch_error(got, exact, theirs, f"{what}: d{name}", atol=atol)


def _derivatives(y_of, given: dict, wrt: list, cast, loss: tuple, penalty: dict) -> tuple:
    """The gradients of L = <M C, y> + s/2 |M y|^2 (``loss``: (C, M, s)) for the
    tensors named ``wrt`` of ``given`` (made leaves, cast to ``cast`` unless None),
    taken under ``create_graph``, and those of P = <R, those gradients> (``penalty``:
    R by name): two dicts by name. y is ``y_of(leaves)``; L and P are summed in FP64."""
    leaves = {
        name: t.detach().to(cast or t.dtype).requires_grad_(name in wrt)
        for name, t in given.items()
    }
    coef, mask, s = loss
    y = mask * y_of(leaves).double()
    differentiated = [leaves[name] for name in wrt]
    firsts = torch.autograd.grad(
        (coef * y).sum() + s / 2 * (y * y).sum(), differentiated, create_graph=True
    )
    p = sum(
        (penalty[name].double() * d.double()).sum() for name, d in zip(wrt, firsts, strict=True)
    )
    # (P is recorded as a function of the leaves even where its value is not: L's y^2
    # term is in the graph with s 0 too; materialized, an unused leaf's gradient is 0.)
    seconds = torch.autograd.grad(p, differentiated, materialize_grads=True)
    return dict(zip(wrt, firsts, strict=True)), dict(zip(wrt, seconds, strict=True))


def _second_order_draw(given: dict, shape: tuple, g: torch.Generator) -> tuple:
    """What a second-order case draws besides its operands (``given``, by name; y of
    ``shape``): s (L's y^2 term, through which G depends on y), the tensors to
    differentiate (one at least), C, and R for each in one of ``_incoming``'s layouts."""
    s = random.choice([0.0, 0.5])
    wrt = sorted(random.sample(sorted(given), random.randint(1, len(given))), key=list(given).index)
    coef = _randn(*shape, g=g).double()
    penalty = {}
    for name in wrt:
        r = _randn(*given[name].shape, g=g).to(given[name].dtype)
        # (no value to broadcast from an empty R)
        penalty[name] = _incoming(r, random.choice(GRAD_LAYOUTS[: None if r.numel() else -1]))
    return s, wrt, coef, penalty


def _check_second_order(what: str, given: dict, wrt: list, runs: list, bounds: tuple) -> None:
    """``runs`` (mpgemm's, the reference's, FP64's ``_derivatives``) against ``bounds``
    (first and second gradients, ``given``'s order, None where not differentiated)."""
    for order, (got, theirs, exact), bound_set in zip(
        ("", "second "), zip(*runs, strict=True), bounds, strict=True
    ):
        for name, bound in zip(given, bound_set, strict=True):
            if name in wrt:
                at = f"{what}: {order}d{name}"
                _within_bound(given[name], got[name], theirs[name], exact[name], bound, at)


def linear_second_order_case(seed: int) -> None:
    """``mpgemm.linear``'s first and second derivatives (``linear``'s draws): the
    gradients of a loss whose gradient may depend on y, taken under ``create_graph``,
    and the gradients of a penalty P = <R, those> (a gradient penalty, a
    Hessian-vector product), against FP64. mpgemm's recorded backward and
    ``linear_ref`` differentiated by torch round in different places, which the second
    derivatives amplify past twice either's error (``bench/NOTES.md``, twenty-fourth
    session): both are held to a first-order bound on any computation that rounds
    every intermediate (``tests.error_bounds``), elementwise."""
    g, x, w, bias, activation, compute, out_dtype, what = _linear_operands(seed)
    given = _layer_inputs(x, w, bias)
    s, wrt, coef, penalty = _second_order_draw(given, (*x.shape[:-1], w.shape[0]), g)
    what = f"linear_second_order seed {seed}: {what}, s {s}, wrt {''.join(wrt)}"
    mask = torch.ones_like(coef)
    if activation == "relu":  # (G zero near the kink, whose side rounding decides)
        mask = away_from_relu_kink(mask, x, w, bias)
    options = dict(activation=activation, compute_dtype=compute, out_dtype=out_dtype)
    runs = [
        _derivatives(
            lambda t, fn=fn: fn(t["x"], t["w"], t.get("b"), **options),
            given,
            wrt,
            None,
            (coef, mask, s),
            penalty,
        )
        for fn in (mpgemm.linear, linear_ref)
    ]

    def exact(t):
        return _layer(t["x"], t["w"], t.get("b"), activation)

    runs.append(_derivatives(exact, given, wrt, torch.float64, (coef, mask, s), penalty))
    compute = compute or compute_dtype_for(x, w)
    model = error_bounds.Rounding(compute, out_dtype or compute, *(t.dtype for t in given.values()))
    bounds = error_bounds.linear_derivatives(
        x, w, bias, activation, (coef, mask, s), tuple(penalty.get(name) for name in "xwb"), model
    )
    _check_second_order(what, given, wrt, runs, tuple(b[: len(given)] for b in bounds))


def matmul_second_order_case(seed: int) -> None:
    """``mpgemm.matmul``'s first and second derivatives (``matmul``'s draws: batches
    that broadcast, vectors), as ``linear_second_order``'s, against ``matmul_ref``'s
    differentiated by torch and FP64, within ``tests.error_bounds``'s bound."""
    g, a, b, compute, out_dtype, what = _matmul_operands(seed)
    given = {"a": a, "b": b}
    s, wrt, coef, penalty = _second_order_draw(given, torch.matmul(a.double(), b.double()).shape, g)
    what = f"matmul_second_order seed {seed}: {what}, s {s}, wrt {''.join(wrt)}"
    options = dict(compute_dtype=compute, out_dtype=out_dtype)
    loss = (coef, 1.0, s)
    runs = [
        _derivatives(
            lambda t, fn=fn: fn(t["a"], t["b"], **options), given, wrt, None, loss, penalty
        )
        for fn in (mpgemm.matmul, matmul_ref)
    ]
    runs.append(_derivatives(lambda t: t["a"] @ t["b"], given, wrt, torch.float64, loss, penalty))
    compute = compute or compute_dtype_for(a, b)
    model = error_bounds.Rounding(compute, out_dtype or compute, a.dtype, b.dtype)
    bounds = error_bounds.matmul_derivatives(
        a, b, (coef, s), (penalty.get("a"), penalty.get("b")), model
    )
    _check_second_order(what, given, wrt, runs, bounds)


def _with_specials(given: dict) -> str:
    """One to three elements of one or two of ``given``'s tensors (by name; not an
    expanded one, whose elements share memory) set to inf, -inf or NaN, in place through
    their layouts; a description of them."""
    names = [name for name, t in given.items() if t.numel() and 0 not in t.stride()]
    placed = []
    for name in random.sample(names, min(len(names), random.randint(1, 2))):
        t = given[name]
        for _ in range(random.randint(1, 3)):
            index = tuple(random.randrange(size) for size in t.shape)
            value = random.choice([float("inf"), -float("inf"), float("nan")])
            t[index] = value
            placed.append(f"{name}{list(index)} {value}")
    return ", ".join(placed)


def _same_specials(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """NaN, +inf and -inf where ``want`` has them, and nowhere else."""
    for kind in ("isnan", "isposinf", "isneginf"):
        where = getattr(got, kind)().cpu()
        expected = getattr(want, kind)().cpu()
        assert torch.equal(where, expected), (
            f"{what}: {kind} at {where.nonzero().tolist()[:4]}, the reference's at "
            f"{expected.nonzero().tolist()[:4]}"
        )


def _nonfinite_runs(y_of, given: dict, g: torch.Generator, what: str, ops) -> None:
    """``y_of(fn, inputs)`` by each of ``ops`` (mpgemm's, then the reference's) on
    ``given``'s tensors as leaves, its backward from one drawn dY: the output and each
    gradient non-finite exactly where the reference's are."""
    results, grad = [], None
    for fn in ops:
        leaves = {name: t.detach().requires_grad_() for name, t in given.items()}
        y = y_of(fn, leaves)
        if grad is None:
            layout = random.choice(GRAD_LAYOUTS[: None if y.numel() else -1])
            grad = _incoming(_randn(*y.shape, g=g).to(y.dtype), layout)
            what += f", dY {layout}"
        if y.numel():
            y.backward(grad)
        results.append((y.detach(), {name: t.grad for name, t in leaves.items()}))
    (y, grads), (y_ref, grads_ref) = results
    _same_specials(y, y_ref, f"{what}: y")
    for name, got in grads.items():
        want = grads_ref[name]
        if want is None:  # (no element: no backward)
            assert got is None or not got.numel(), f"{what}: d{name}"
            continue
        _same_specials(got, want, f"{what}: d{name}")


def linear_nonfinite_case(seed: int) -> None:
    """``linear``'s draws with inf, -inf or NaN in some of x, W and the bias: its output
    and gradients NaN and inf exactly where ``linear_ref``'s are (torch's ops on the
    same rounded operands)."""
    g, x, w, bias, activation, compute, out_dtype, what = _linear_operands(seed)
    given = _layer_inputs(x, w, bias)
    what = f"linear_nonfinite seed {seed}: {what}, {_with_specials(given)}"
    options = dict(activation=activation, compute_dtype=compute, out_dtype=out_dtype)

    def y_of(fn, t):
        return fn(t["x"], t["w"], t.get("b"), **options)

    _nonfinite_runs(y_of, given, g, what, (mpgemm.linear, linear_ref))


def matmul_nonfinite_case(seed: int) -> None:
    """``matmul``'s draws with inf, -inf or NaN in a or b or both, as
    ``linear_nonfinite``'s, against ``matmul_ref``."""
    g, a, b, compute, out_dtype, what = _matmul_operands(seed)
    given = {"a": a, "b": b}
    what = f"matmul_nonfinite seed {seed}: {what}, {_with_specials(given)}"
    options = dict(compute_dtype=compute, out_dtype=out_dtype)
    _nonfinite_runs(
        lambda fn, t: fn(t["a"], t["b"], **options), given, g, what, (mpgemm.matmul, matmul_ref)
    )


def _tangents(given: dict, g: torch.Generator) -> dict:
    """Forward mode's draw: tangents (normal values in their input's dtype, in one of
    ``_laid_out``'s layouts) for some of ``given``'s inputs (one at least), by name."""
    names = random.sample(sorted(given), random.randint(1, len(given)))
    layouts = ["contiguous", "transposed", "sliced", "negative"]
    return {
        name: _laid_out(
            _randn(*given[name].shape, g=g).to(given[name].dtype), random.choice(layouts)
        )
        for name in sorted(names, key=list(given).index)
    }


def _forward_mode(y_of, given: dict, tangents: dict, cast) -> tuple:
    """(primal, tangent) of ``y_of(inputs)`` under forward-mode AD (dual tensors of
    ``torch.autograd.forward_ad``), the inputs ``given``'s cast to ``cast`` (None: as
    given), those named in ``tangents`` dual with theirs, the others plain."""
    with forward_ad.dual_level():
        inputs = {name: t.detach().to(cast or t.dtype) for name, t in given.items()}
        for name, tangent in tangents.items():
            primal = inputs[name]
            if 0 in primal.stride():  # (torch makes no dual of an expanded tensor)
                primal = primal.clone()
            inputs[name] = forward_ad.make_dual(primal, tangent.to(cast or tangent.dtype))
        primal, tangent = forward_ad.unpack_dual(y_of(inputs))
    return primal, tangent


def _check_forward_mode(what: str, runs: list, plain: torch.Tensor, bound, kept=None) -> None:
    """``runs`` (mpgemm's, the reference's and FP64's ``_forward_mode``): mpgemm's primal
    the bits of its call without forward mode (``plain``), its tangent and the
    reference's within ``bound`` of FP64's, where ``kept`` (default everywhere)."""
    (primal, tangent), (_, theirs), (_, exact) = runs
    assert_same_bits(primal, plain, f"{what}: the primal")
    if kept is not None:  # (no bound where a ReLU's kink decides)
        bound = error_bounds.Bounded(bound.value, bound.error.masked_fill(~kept, float("inf")))
    _within_bound(plain, tangent, theirs, exact, bound, f"{what}: the tangent")


def linear_forward_mode_case(seed: int) -> None:
    """``mpgemm.linear`` under forward-mode AD (``linear``'s draws, tangents for some of
    x, W and the bias in any layout): its primal the bits of a plain call, its tangent
    and ``linear_ref``'s within ``tests.error_bounds``'s bound of FP64's."""
    g, x, w, bias, activation, compute, out_dtype, what = _linear_operands(seed)
    given = _layer_inputs(x, w, bias)
    tangents = _tangents(given, g)
    what = f"linear_forward_mode seed {seed}: {what}, tangents {''.join(tangents)}"
    options = dict(activation=activation, compute_dtype=compute, out_dtype=out_dtype)
    runs = [
        _forward_mode(
            lambda t, fn=fn: fn(t["x"], t["w"], t.get("b"), **options), given, tangents, None
        )
        for fn in (mpgemm.linear, linear_ref)
    ]

    def exact(t):
        return _layer(t["x"], t["w"], t.get("b"), activation)

    runs.append(_forward_mode(exact, given, tangents, torch.float64))
    compute = compute or compute_dtype_for(x, w)
    model = error_bounds.Rounding(compute, out_dtype or compute, *(t.dtype for t in given.values()))
    bound = error_bounds.linear_tangent(
        x, w, bias, activation, tuple(tangents.get(name) for name in "xwb"), model
    )
    kept = None
    if activation == "relu":
        kept = away_from_relu_kink(torch.ones(bound.value.shape, device=_device), x, w, bias) > 0
    _check_forward_mode(what, runs, mpgemm.linear(x, w, bias, **options), bound, kept)


def matmul_forward_mode_case(seed: int) -> None:
    """``mpgemm.matmul`` under forward-mode AD (``matmul``'s draws), as
    ``linear_forward_mode``'s, against ``matmul_ref``'s and FP64's."""
    g, a, b, compute, out_dtype, what = _matmul_operands(seed)
    given = {"a": a, "b": b}
    tangents = _tangents(given, g)
    what = f"matmul_forward_mode seed {seed}: {what}, tangents {''.join(tangents)}"
    options = dict(compute_dtype=compute, out_dtype=out_dtype)
    runs = [
        _forward_mode(lambda t, fn=fn: fn(t["a"], t["b"], **options), given, tangents, None)
        for fn in (mpgemm.matmul, matmul_ref)
    ]
    runs.append(_forward_mode(lambda t: t["a"] @ t["b"], given, tangents, torch.float64))
    compute = compute or compute_dtype_for(a, b)
    model = error_bounds.Rounding(compute, out_dtype or compute, a.dtype, b.dtype)
    bound = error_bounds.matmul_tangent(a, b, (tangents.get("a"), tangents.get("b")), model)
    _check_forward_mode(what, runs, mpgemm.matmul(a, b, **options), bound)


def _within_bound(like, got, theirs, exact, bound, what: str) -> None:
    """``got`` (mpgemm's) and ``theirs`` (the reference's) within ``bound``'s error of the
    FP64 ``exact`` elementwise, finite, of ``like``'s dtype and shape (a gradient's
    input, a tangent's primal)."""
    exact = exact.detach()
    # (The closed form the bound follows is the derivative autograd takes in FP64.)
    scale = float(exact.abs().max()) if exact.numel() else 0.0
    assert torch.allclose(bound.value, exact, rtol=1e-9, atol=1e-12 * scale), f"{what}: form"
    for who, out in (("mpgemm", got), ("the reference", theirs)):
        at = f"{what} by {who}"
        assert out.dtype == like.dtype and out.shape == like.shape, at
        err = (out.detach().double() - exact).abs()
        beyond = err > bound.error
        assert not beyond.any() and torch.isfinite(out).all(), (
            f"{at}: {int(beyond.sum())} of {err.numel()} beyond the bound, error "
            f"{err.max().item():.3g}, worst {(err / bound.error).nan_to_num().max().item():.3g}"
            " x its bound"
        )


def _cross_entropy_operands(seed: int) -> tuple:
    """``cross_entropy``'s draw from ``seed`` (seeding ``random`` too, for what
    follows): the generator for later tensors, the logits, the targets, the options,
    and a description of them."""
    random.seed(seed)
    g = torch.Generator().manual_seed(seed)
    rows, classes = random.choice([0, 1, 2, 5, 17, 64]), random.choice([1, 2, 10, 33, 100])
    dtype = random.choice(DTYPES)
    x = _randn(rows, classes, g=g) * random.choice([1.0, 10.0, 100.0])
    if random.random() < 0.2 and rows:
        x[random.randrange(rows), random.randrange(classes)] = random.choice(
            [float("inf"), -float("inf"), float("nan")]
        )
    # Any layout (``_laid_out``): the kernels read strides; a negative view takes
    # torch's ops.
    layout = random.choice(["contiguous", "contiguous", "transposed", "sliced", "negative"])
    x = _laid_out(x.to(dtype), layout)
    target = torch.randint(0, classes, (rows,), generator=g).to(_device)
    ignore = random.choice([-100, 0, 3])
    if rows and random.random() < 0.4:
        target[random.randrange(rows)] = random.choice([ignore, -1, classes])
    options = dict(
        ignore_index=ignore,
        reduction=random.choice(["mean", "sum", "none"]),
        label_smoothing=random.choice([0.0, 0.0, 0.1, 0.5]),
    )
    return g, x, target, options, f"{rows} x {classes} {dtype} {layout}, {options}"


def _out_of_range(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> bool:
    """Whether a target not ignored names no class of ``logits``."""
    classes = logits.shape[1]
    return bool((((target < 0) | (target >= classes)) & (target != ignore_index)).any())


def cross_entropy_case(seed: int) -> None:
    g, x, target, options, what = _cross_entropy_operands(seed)
    what = f"cross_entropy seed {seed}: {what}"
    dtype = x.dtype
    ours = x.detach().requires_grad_()
    out_of_range = _out_of_range(x, target, options["ignore_index"])
    if out_of_range and x.is_neg():
        # torch's path (the kernels do not read a negative view): torch's IndexError
        try:
            mpgemm.cross_entropy(ours, target, **options)
        except IndexError:
            return
        raise AssertionError(f"{what}: a class out of range on torch's path, no IndexError")
    loss = mpgemm.cross_entropy(ours, target, **options)
    if out_of_range:
        # torch refuses; mpgemm gives the row NaN (its documented difference)
        assert loss.isnan().any(), f"{what}: a class out of range without a NaN"
        return
    theirs = x.detach().float().requires_grad_()
    their_loss = F.cross_entropy(theirs, target, **options)
    exact = x.detach().double().requires_grad_()
    exact_loss = F.cross_entropy(exact, target, **options)
    assert loss.dtype == dtype and loss.shape == their_loss.shape, what
    _same_nonfinite(loss, their_loss.to(dtype), f"{what}: loss")
    finite = torch.isfinite(exact_loss).detach()
    rtol = torch.finfo(dtype).eps / 2
    # Its FP32 terms cancel too: torch's can land far nearer FP64 than the 2 x bar
    # allows (seed 627: torch 0.08 of an FP32 unit off, mpgemm 1.08; over 300 drawn rows,
    # mpgemm 0.41 units on average and 1.03 at most, torch 0.47 and 1.37).
    atol = _cancelling(torch.float32, _loss_terms(exact.detach(), target, **options)[finite])
    assert_within_torch_error(
        loss[finite],
        exact_loss[finite].detach(),
        their_loss[finite].to(dtype),
        what,
        rtol=rtol,
        atol=atol,
    )
    if not loss.numel():
        return
    grad_layout = random.choice(GRAD_LAYOUTS)
    what += f", dL {grad_layout}"
    grad = _incoming(_randn(*loss.shape, g=g).to(dtype), grad_layout)
    for out, scalar in ((loss, dtype), (their_loss, torch.float32), (exact_loss, torch.float64)):
        out.backward(grad.to(scalar))
    _same_nonfinite(ours.grad, theirs.grad.to(dtype), f"{what}: gradient")
    finite = torch.isfinite(exact.grad)
    # dx = g (p - target): terms of at most 2 |g| that cancel where p nears the target.
    atol = 2 * torch.finfo(torch.float32).eps * grad.abs().max().item()
    assert_within_torch_error(
        ours.grad[finite],
        exact.grad[finite],
        theirs.grad[finite].to(dtype),
        f"{what}: gradient",
        rtol=rtol,
        atol=atol,
    )


def cross_entropy_second_order_case(seed: int) -> None:
    """``cross_entropy``'s first and second derivatives (``cross_entropy``'s draws but
    targets out of range, which torch refuses): the logits' gradient taken under
    ``create_graph`` and that of P = <R, it>, against torch's (of FP32 logits) and
    FP64: NaN and inf where torch's are, and within twice torch's error. P's gradient,
    w (p R - p (p . R)) a row (the softmax's Hessian; w the row's weight in the loss),
    has terms of at most 2 |w| |R| that cancel, to a sum that may round to an FP16
    subnormal."""
    g, x, target, options, what = _cross_entropy_operands(seed)
    if _out_of_range(x, target, options["ignore_index"]) or not x.numel():
        return
    dtype = x.dtype
    grad = _randn(*((x.shape[0],) if options["reduction"] == "none" else ()), g=g).to(dtype)
    r_layout = random.choice(GRAD_LAYOUTS)
    r = _incoming(_randn(*x.shape, g=g).to(dtype), r_layout)
    what = f"cross_entropy_second_order seed {seed}: {what}, R {r_layout}"
    results = []
    for fn, cast in (
        (mpgemm.cross_entropy, dtype),
        (F.cross_entropy, torch.float32),
        (F.cross_entropy, torch.float64),
    ):
        logits = x.detach().to(cast).requires_grad_()
        loss = fn(logits, target, **options)
        (first,) = torch.autograd.grad(loss, logits, grad.to(loss.dtype), create_graph=True)
        p = (r.double() * first.double()).sum()
        (second,) = torch.autograd.grad(p, logits)
        results.append((first.detach(), second))
    rtol = torch.finfo(dtype).eps / 2
    scale = grad.abs().max().item() if grad.numel() else 0.0
    for name, (got, theirs, exact), terms in zip(
        ("gradient", "second gradient"),
        zip(*results, strict=True),
        (scale, scale * r.abs().max().item()),
        strict=True,
    ):
        at = f"{what}: {name}"
        assert got.dtype == dtype and got.shape == x.shape, at
        _same_nonfinite(got, theirs.to(dtype), at)
        finite = torch.isfinite(exact)
        atol = 2 * torch.finfo(torch.float32).eps * terms + _half_subnormal(dtype)
        assert_within_torch_error(
            got[finite], exact[finite], theirs[finite].to(dtype), at, rtol=rtol, atol=atol
        )


def _half_subnormal(dtype: torch.dtype) -> float:
    """Half the spacing of ``dtype``'s subnormals: the most a rounding to it moves a
    value below its normal range."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2


def _loss_terms(
    x: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float
) -> torch.Tensor:
    """The sum of the magnitudes of the terms of the cross-entropy of ``x`` (FP64):
    s + (1 - eps) |x_t - m| + eps mean_c |x_c - m| a row (0 where ignored), reduced as
    the loss is (each row's for "none"), for ``_cancelling``."""
    m = x.max(dim=1, keepdim=True).values
    d = (x - m).abs()
    s = torch.logsumexp(x - m, dim=1)
    kept = target != ignore_index
    picked = d.gather(1, torch.where(kept, target, 0)[:, None])[:, 0]
    rows = s + (1 - label_smoothing) * picked
    if label_smoothing:  # (a -inf logit's |x - m| counts only where it is a term)
        rows = rows + label_smoothing * d.mean(dim=1)
    rows = torch.where(kept, rows, 0.0)
    if reduction == "none":
        return rows
    return rows.sum() / (kept.sum() if reduction == "mean" else 1)


def _same_nonfinite(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN where torch's differ"
    assert torch.equal(got.isinf(), want.isinf()), f"{what}: inf where torch's differ"


def optim_case(seed: int) -> None:
    # Blocks of 4, 2 or 3 a program, or as shipped (drawn apart from the case, whose
    # draws each seed keeps).
    per_program = random.Random(f"spans {seed}").choice([None, 2, 3])
    shape = {} if per_program is None else dict(block=4, blocks_per_program=per_program)
    with optimizer_launch_shape(**shape):
        _optim_case(seed)


def _scalar(value: float, *, dtype: torch.dtype, negative: bool) -> torch.Tensor:
    """A one-element tensor of ``value``; with ``negative``, a negative view (its memory
    holding -value)."""
    t = torch.tensor(value, dtype=dtype, device=_device)
    return torch._neg_view(t.neg()) if negative else t


def _optim_case(seed: int) -> None:
    random.seed(seed)
    g = torch.Generator().manual_seed(seed)
    kind = random.choice(["SGD", "Adam", "AdamW"])
    shapes = [
        random.choice([(), (1,), (5,), (3, 4), (0, 3), (17, 9), (4, 1, 2)])
        for _ in range(random.randint(1, 5))
    ]
    dtype = random.choice([torch.float32, torch.float32, *HALVES])
    params = [_randn(*s, g=g).to(dtype) for s in shapes]
    hyper: dict = {"lr": random.choice([1e-3, 0.1, 0.5])}
    if random.random() < 0.3:
        hyper["weight_decay"] = random.choice([0.0, 0.01, 0.1])
    if random.random() < 0.3:
        hyper["maximize"] = True
    if kind == "SGD" and random.random() < 0.6:
        hyper["momentum"] = random.choice([0.5, 0.9])
        if random.random() < 0.4:
            hyper["dampening"] = random.choice([0.1, 0.5])
        elif random.random() < 0.3:
            hyper["nesterov"] = True
    if kind != "SGD":
        if random.random() < 0.4:
            hyper["betas"] = (random.choice([0.8, 0.9]), random.choice([0.99, 0.999]))
        if random.random() < 0.3:
            hyper["amsgrad"] = True
        if random.random() < 0.3:
            hyper["eps"] = random.choice([1e-6, 1e-3])
    # torch's optimizers take each hyperparameter as a one-element tensor too; some as a
    # negative view, whose memory holds the value negated (the kernels read a tensor
    # lr's and betas' memory: such an lr stepped the wrong way until 2026-11-28).
    for key in [k for k in hyper if k not in ("maximize", "nesterov", "amsgrad")]:
        if random.random() < 0.25:
            dtype_of = random.choice([torch.float32, torch.float64])
            as_tensor = functools.partial(_scalar, dtype=dtype_of, negative=random.random() < 0.3)
            value = hyper[key]
            hyper[key] = tuple(map(as_tensor, value)) if key == "betas" else as_tensor(value)
    groups = len(params) > 1 and random.random() < 0.3
    # A scaler for FP32 parameters (16-bit ones are refused by both); against torch's
    # fused Adam and AdamW, which leave a skipped step's gradients as mpgemm's do
    # (torch's fused SGD on the CPU read stale buffers where a gradient was None). For
    # 16-bit parameters too: like mpgemm's kernels they compute in FP32, where torch's
    # for-loop and foreach Adam round each op to 16 bits (eps 1e-8 to 0 in FP16) and
    # send a parameter to inf where FP64 keeps it finite.
    scaled = dtype == torch.float32 and random.random() < 0.5
    fused = (scaled or dtype != torch.float32) and kind != "SGD"
    steps = random.randint(1, 4)
    # Parameters' and gradients' layouts (``_laid_out``): negative views only where
    # neither torch's fused step nor a scaler's in-place unscale takes part (torch's
    # ops refuse them in their mutable lists, as mpgemm's unscale does). torch's fused
    # step gets contiguous copies: torch 2.13's fused Adam on the CPU reads memory as
    # if every tensor were contiguous (a transposed or sliced gradient, or one whose
    # strides differ from its parameter's, stepped a (17, 9) parameter 0.3 to 0.6 off
    # its for-loop step after three steps at lr 0.1).
    layouts = ["contiguous", "transposed", "sliced"] + ([] if scaled or fused else ["negative"])
    param_layouts = [random.choice(layouts) for _ in shapes]
    what = (
        f"optim seed {seed}: {kind} {hyper} {dtype} {shapes} groups {groups} scaled {scaled}"
        f" fused {fused} layouts {param_layouts}"
    )

    # torch's for-loop Adam takes its bias corrections from tensor betas in their dtype:
    # FP32 ones lose up to some 1e-5 of a step to cancellation in 1 - beta2**step (seed
    # 403086: 6.4e-6 off at lr 0.5), where its fused step, as mpgemm's, widens them to
    # FP64. Its for-loop steps are given FP64 tensors of the same values.
    widened = {}
    if isinstance(hyper.get("betas", (None,))[0], torch.Tensor):
        widened["betas"] = tuple(b.double() for b in hyper["betas"])

    def make(library, cast=None, **extra):
        # Each library's own copies: a Parameter shares its tensor's memory, and two
        # made from one tensor were stepped by both optimizers and compared with
        # themselves (before 2026-11-28, a search that a step doing nothing passed).
        contiguous = extra.get("fused", False)
        options = hyper if library is mpgemm.optim or contiguous else {**hyper, **widened}
        leaves = [
            torch.nn.Parameter(
                _laid_out(p.to(cast or p.dtype), "contiguous" if contiguous else layout)
            )
            for p, layout in zip(params, param_layouts, strict=True)
        ]
        if groups:
            lr = hyper["lr"] / 2
            leaves_or_groups = [{"params": leaves[:1]}, {"params": leaves[1:], "lr": lr}]
        else:
            leaves_or_groups = leaves
        return leaves, getattr(library, kind)(leaves_or_groups, **options, **extra)

    ours, ours_opt = make(mpgemm.optim)
    # Otherwise torch's for-loop step: its foreach step (a GPU's default) refuses
    # negative views in the lists it writes.
    theirs, their_opt = make(torch.optim, **({"fused": True} if fused else {"foreach": False}))
    exact, exact_opt = make(torch.optim, torch.float64, foreach=False)
    scalers = []
    if scaled:
        scalers = [mpgemm.GradScaler(_device.type, init_scale=256.0, growth_interval=2)]
        scalers.append(torch.amp.GradScaler(_device.type, init_scale=256.0, growth_interval=2))
        for scaler in scalers:
            scaler.scale(torch.ones((), device=_device))
    # Each parameter's largest magnitude along FP64's steps: a 16-bit step rounds the
    # parameter each time, by up to half a unit of its value then, where FP64 does not.
    peaks = list(map(_largest, exact))
    for _ in range(steps):
        grads = [_randn(*s, g=g).to(dtype) for s in shapes]
        if scaled and grads[0].numel() and random.random() < 0.3:
            grads[0].view(-1)[0] = float("inf")
        missing = [random.random() < 0.15 for _ in shapes]
        grad_layouts = [random.choice(layouts) for _ in shapes]
        if all(missing):
            missing[-1] = False  # (with no gradient at all, both scalers raise)
        for leaves, scale in ((ours, 0), (theirs, 1), (exact, None)):
            for p, grad, absent, layout in zip(leaves, grads, missing, grad_layouts, strict=True):
                factor = 1.0 if scale is None or not scalers else scalers[scale].get_scale()
                if leaves is theirs and fused:
                    layout = "contiguous"
                p.grad = None if absent else _laid_out(grad.to(p.dtype) * factor, layout)
        if scalers:
            for scaler, optimizer in zip(scalers, (ours_opt, their_opt), strict=True):
                scaler.step(optimizer)
                scaler.update()
            assert scalers[0].get_scale() == scalers[1].get_scale(), f"{what}: scale"
        else:
            ours_opt.step()
            their_opt.step()
            exact_opt.step()
        peaks = [max(peak, _largest(p)) for peak, p in zip(peaks, exact, strict=True)]
    for i, (mine, torchs, fp64) in enumerate(zip(ours, theirs, exact, strict=True)):
        assert mine.dtype == torchs.dtype, what
        if scalers or dtype == torch.float32:  # FP32 rounding apart
            torch.testing.assert_close(mine, torchs, rtol=1e-5, atol=1e-6, msg=what)
            if mine.grad is not None and not (scalers and not fused):
                torch.testing.assert_close(mine.grad, torchs.grad, equal_nan=True, msg=what)
        else:  # 16-bit parameters: within twice torch's error against FP64
            # Their state is in their dtype too, as torch's: a second moment that
            # underflows to 0 sends a parameter to inf in both, which FP64 does not.
            finite = torch.isfinite(torchs.detach())
            _same_nonfinite(mine.detach(), torchs.detach(), f"{what}: {i}")
            mine, torchs, fp64 = (t.detach()[finite] for t in (mine, torchs, fp64))
            # One rounding a step (torch's for-loop SGD, which rounds each op, can land
            # on FP64's value where one rounding does not: seed 400779, a parameter of
            # one element, 2 units off after three steps, torch's 0, the bar's 1.4).
            atol = _cancelling(dtype, torch.tensor(peaks[i])) * 2 * steps
            assert_within_torch_error(mine, fp64, torchs.double(), f"{what}: {i}", atol=atol)
    # The state dicts load both ways.
    make(torch.optim)[1].load_state_dict(ours_opt.state_dict())
    make(mpgemm.optim)[1].load_state_dict(their_opt.state_dict())


def amp_case(seed: int) -> None:
    """``mpgemm.scaling.unscale_`` against torch's op, bit for bit, on lists of every
    dtype with inf and NaN, in drawn layouts, in place or into other tensors (NaN where
    unwritten; negative views among the sources there); then a ``LossScaleOptimizer``
    around torch's SGD or Adam against torch's ``GradScaler`` recipe over a few steps,
    inf gradients among them: the same scale, skips and parameters, bit for bit."""
    random.seed(seed)
    g = torch.Generator().manual_seed(seed)
    shapes = [random.choice([(), (0,), (1,), (7,), (3, 5), (4099,)]) for _ in range(5)]
    dtype = random.choice(DTYPES)
    grads = [_randn(*s, g=g).to(dtype) * random.choice([1.0, 1e4]) for s in shapes]
    for grad in grads:
        if grad.numel() and random.random() < 0.2:
            grad.view(-1)[random.randrange(grad.numel())] = random.choice(
                [float("inf"), -float("inf"), float("nan")]
            )
    inv_scale = torch.full((), random.choice([1.0, 2.0**-16, 3.0]), device=_device)
    what = f"amp seed {seed}: {dtype} {shapes} inv_scale {inv_scale.item()}"
    into_fp32 = random.random() < 0.5  # as a master's gradient from a 16-bit one
    # mpgemm's tensors in drawn layouts (``_laid_out``); negative views only as the
    # source of an unscale into FP32 (torch's op, and so mpgemm's, refuses them in place).
    layouts = ["contiguous", "transposed", "sliced", *(["negative"] if into_fp32 else [])]
    theirs = [t.to(torch.float32 if into_fp32 else t.dtype, copy=True) for t in grads]
    their_flag = torch.zeros((), device=_device)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, their_flag, inv_scale)
    drawn = [random.choice(layouts) for _ in grads]
    ours = [_laid_out(t, layout) for t, layout in zip(grads, drawn, strict=True)]
    flag = torch.zeros((), device=_device)
    what += f" into FP32 {into_fp32} layouts {drawn}"
    if into_fp32:
        dst = [
            _laid_out(torch.full(t.shape, float("nan"), device=_device), random.choice(layouts[:3]))
            for t in ours
        ]
        unscale_(ours, flag, inv_scale, dst=dst)
        ours = dst
    else:
        unscale_(ours, flag, inv_scale)
    assert torch.equal(flag, their_flag), f"{what}: flag"
    for mine, torchs in zip(ours, theirs, strict=True):
        _same_nonfinite(mine, torchs, what)
        assert torch.equal(mine.nan_to_num(), torchs.nan_to_num()), f"{what}: values"

    kind = random.choice(["SGD", "Adam"])
    options = {"lr": 0.1, "momentum": 0.9} if kind == "SGD" else {"lr": 0.01}
    params = [_randn(*s, g=g) for s in ((3, 4), (4,))]
    leaves = [[torch.nn.Parameter(p.clone()) for p in params] for _ in range(2)]
    wrapped = mpgemm.LossScaleOptimizer(
        getattr(torch.optim, kind)(leaves[0], **options), init_scale=2.0**10, growth_interval=2
    )
    optimizer = getattr(torch.optim, kind)(leaves[1], **options)
    scaler = torch.amp.GradScaler(_device.type, init_scale=2.0**10, growth_interval=2)
    wrapped.scale_loss(torch.ones((), device=_device))  # (each makes its scale at its
    scaler.scale(torch.ones((), device=_device))  # first scaled loss)
    for step in range(5):
        grads = [_randn(*p.shape, g=g) for p in params]
        if random.random() < 0.3:
            grads[random.randrange(2)].view(-1)[0] = float("inf")
        for p, grad in zip(leaves[0], grads, strict=True):
            p.grad = grad * wrapped.loss_scale
        for p, grad in zip(leaves[1], grads, strict=True):
            p.grad = grad * scaler.get_scale()
        wrapped.step()
        scaler.step(optimizer)
        scaler.update()
        assert wrapped.loss_scale == scaler.get_scale(), f"{what}: {kind} step {step}, scale"
    for mine, torchs in zip(*leaves, strict=True):
        assert torch.equal(mine, torchs), f"{what}: {kind} parameters"


def _scaler_world(library, base, kinds, opts):
    """Deep copies of the ``base`` layers, an optimizer for each of ``kinds`` (one: all
    the parameters; two: a layer each) and a GradScaler of ``library``'s."""
    models = [copy.deepcopy(m).to(_device) for m in base]
    optimizers = []
    for i, (kind, source) in enumerate(kinds):
        params = (
            list(models[i].parameters())
            if len(kinds) == 2
            else [p for m in models for p in m.parameters()]
        )
        extra = {"momentum": 0.9} if kind == "SGD" else {}
        if source == "torch fused":
            extra["fused"] = True
        make = getattr(mpgemm.optim if source == "mpgemm" else torch.optim, kind)
        optimizers.append(make(params, lr=0.01, **extra))
    return [models, optimizers, library.GradScaler(_device.type, **opts)]


def scaler_case(seed: int) -> None:
    """``mpgemm.GradScaler`` against ``torch.amp.GradScaler`` over a drawn run of
    iterations, each scaler driving its own copy of a two-layer model and one or two
    optimizers (torch's SGD, Adam or AdamW, the latter two fused or not, or mpgemm's):
    gradients accumulated over two backwards, a list and tuple of outputs scaled, an
    inf gradient, ``unscale_`` then clipping, an optimizer left unstepped, ``update``
    with a new scale (a float or a tensor), ``zero_grad`` to None or to zeros, and each
    scaler replaced by the other library's loaded from its state dict. After every
    iteration: the same scale and state dict, parameters and gradients bit for bit.
    (torch's fused SGD is not drawn: on a step a scaler skips, it updates its momentum
    buffers, uninitialised on a first step, where torch's other SGDs do not.)"""
    random.seed(seed)
    g = torch.Generator().manual_seed(seed)
    opts = {
        "init_scale": random.choice([2.0**4, 2.0**10, 2.0**16]),
        "growth_factor": random.choice([2.0, 1.5]),
        "backoff_factor": random.choice([0.5, 0.25]),
        "growth_interval": random.choice([1, 2, 3]),
    }
    kinds = []
    for _ in range(random.choice([1, 2])):
        kind = random.choice(["SGD", "Adam", "AdamW"])
        sources = ["torch", "mpgemm"] + (["torch fused"] if kind != "SGD" else [])
        kinds.append((kind, random.choice(sources)))
    what = f"scaler seed {seed}: {opts} {kinds}"
    torch.manual_seed(seed)
    base = [nn.Linear(4, 3), nn.Linear(3, 2)]
    worlds = [_scaler_world(library, base, kinds, opts) for library in (mpgemm, torch.amp)]
    for iteration in range(random.randint(2, 8)):
        x = _randn(5, 4, g=g)
        backwards = random.choice([1, 1, 2])
        nested, inf, clip = (random.random() < p for p in (0.3, 0.3, 0.5))
        unscaled = [random.random() < 0.3 for _ in kinds]
        stepped = [random.random() < 0.9 for _ in kinds]
        stepped[-1] = stepped[-1] or not any(stepped)  # (no step at all: both raise)
        new_scale = random.choice([None] * 6 + [128.0, "tensor"])
        to_none, swap = random.random() < 0.5, random.random() < 0.15
        step_what = (
            f"{what}: iteration {iteration}: backwards {backwards} nested {nested} inf {inf} "
            f"unscaled {unscaled} clip {clip} stepped {stepped} new scale {new_scale} "
            f"to none {to_none} swap {swap}"
        )
        for world in worlds:
            models, optimizers, scaler = world
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=to_none)
            for _ in range(backwards):
                hidden = models[0](x)
                out = models[1](torch.relu(hidden))
                if nested:
                    first, (second,) = scaler.scale([out.sum(), (hidden.square().mean(),)])
                    (first + second).backward()
                else:
                    scaler.scale(out.square().sum()).backward()
            if inf:
                models[0].weight.grad.view(-1)[0] = float("inf")
            for optimizer, unscale, step in zip(optimizers, unscaled, stepped, strict=True):
                if unscale:
                    scaler.unscale_(optimizer)
                    if clip:
                        params = [p for group in optimizer.param_groups for p in group["params"]]
                        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
                if step:
                    scaler.step(optimizer)
            if new_scale == "tensor":
                scaler.update(torch.full((), 64.0, device=_device))
            else:
                scaler.update(new_scale)
            if swap:
                other = torch.amp if isinstance(scaler, mpgemm.GradScaler) else mpgemm
                world[2] = other.GradScaler(_device.type)
                world[2].load_state_dict(scaler.state_dict())
        (ours, _, our_scaler), (theirs, _, their_scaler) = worlds
        assert our_scaler.get_scale() == their_scaler.get_scale(), f"{step_what}: scale"
        assert our_scaler.state_dict() == their_scaler.state_dict(), f"{step_what}: state"
        pairs = zip(
            (p for m in ours for p in m.parameters()),
            (p for m in theirs for p in m.parameters()),
            strict=True,
        )
        for i, (mine, torchs) in enumerate(pairs):
            assert_same_bits(mine.detach(), torchs.detach(), f"{step_what}: parameter {i}")
            assert (mine.grad is None) == (torchs.grad is None), f"{step_what}: gradient {i}"
            if mine.grad is not None:
                assert_same_bits(mine.grad, torchs.grad, f"{step_what}: gradient {i}")


def masters_case(seed: int) -> None:
    """``LossScaleOptimizer`` over a 16-bit model (FP32 masters) against torch's recipe
    done by hand: FP32 copies of the parameters stepped by the same optimizer class,
    gradients unscaled into them by torch's op, the scale updated by torch's, the model
    rewritten from them. Through a drawn run: inf gradients, ``unscale_`` then
    clipping, the last layer's parameters added by ``add_param_group`` mid-run, the
    optimizer rebuilt from its and its scaler's state dicts, ``zero_grad`` either way.
    After every iteration: the same scale, and the model and the masters bit for bit."""
    random.seed(seed)
    g = torch.Generator().manual_seed(seed)
    dtype = random.choice(HALVES)
    kind = random.choice(["SGD", "Adam", "AdamW"])
    library = random.choice([torch.optim, mpgemm.optim])
    hyper = {"lr": 0.01, **({"momentum": 0.9} if kind == "SGD" else {})}
    opts = {
        "init_scale": random.choice([2.0**8, 2.0**16]),
        "growth_interval": random.choice([1, 3]),
    }
    late = random.random() < 0.5  # the last layer's two parameters join mid-run
    what = f"masters seed {seed}: {dtype} {library.__name__}.{kind} {opts} late {late}"
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.ReLU(), nn.Linear(3, 2))
    model, reference = (copy.deepcopy(base).to(device=_device, dtype=dtype) for _ in range(2))
    params, ref_params = list(model.parameters()), list(reference.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in ref_params]
    joined = 4 if late else len(params)
    groups = [params[:joined]]  # the model's parameters of each param group

    def wrapped() -> mpgemm.LossScaleOptimizer:
        rest = [{"params": group, "lr": 0.005} for group in groups[1:]]
        inner = getattr(library, kind)([{"params": groups[0]}, *rest], **hyper)
        return mpgemm.LossScaleOptimizer(inner, **opts)

    ours = wrapped()
    theirs = getattr(library, kind)(masters[:joined], **hyper)
    scale = torch.full((), opts["init_scale"], device=_device)
    tracker = torch.zeros((), dtype=torch.int32, device=_device)
    for iteration in range(random.randint(3, 8)):
        x = _randn(5, 4, g=g).to(dtype)
        inf, clip, rebuild, to_none = (random.random() < p for p in (0.25, 0.3, 0.15, 0.5))
        join = joined < len(params) and random.random() < 0.4
        step_what = f"{what}: iteration {iteration}: inf {inf} clip {clip} join {join} "
        step_what += f"rebuild {rebuild} to none {to_none}"
        if join:
            groups.append(params[joined:])
            ours.add_param_group({"params": params[joined:], "lr": 0.005})
            theirs.add_param_group({"params": masters[joined:], "lr": 0.005})
            joined = len(params)
        ours.zero_grad(set_to_none=to_none)
        ours.backward(model(x).float().square().sum())
        for p in ref_params:
            p.grad = None
        (reference(x).float().square().sum() * scale).backward()
        for p in (params[0], ref_params[0]):
            if inf:
                p.grad.view(-1)[0] = float("inf")
        if clip:
            ours.unscale_()
            torch.nn.utils.clip_grad_norm_(list(ours.master_params()), 1.0, foreach=False)
        ours.step()
        found = torch.zeros((), device=_device)
        unscaled = [p.grad.float() for p in ref_params[:joined]]
        torch._amp_foreach_non_finite_check_and_unscale_(unscaled, found, scale.reciprocal())
        for master, grad in zip(masters, unscaled, strict=False):
            master.grad = grad
        if clip:
            torch.nn.utils.clip_grad_norm_(masters[:joined], 1.0, foreach=False)
        if not found.item():
            theirs.step()
        torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, opts["growth_interval"])
        with torch.no_grad():
            for p, master in zip(ref_params, masters, strict=True):
                p.copy_(master)
        if rebuild:
            state, scaler_state = copy.deepcopy((ours.state_dict(), ours.scaler.state_dict()))
            ours = wrapped()
            ours.load_state_dict(state)
            ours.scaler.load_state_dict(scaler_state)
        assert ours.loss_scale == scale.item(), f"{step_what}: scale"
        for i, (mine, torchs) in enumerate(zip(params, ref_params, strict=True)):
            assert_same_bits(mine.detach(), torchs.detach(), f"{step_what}: parameter {i}")
        for i, (mine, torchs) in enumerate(zip(ours.master_params(), masters, strict=False)):
            assert_same_bits(mine.detach(), torchs.detach(), f"{step_what}: master {i}")


def copies_case(seed: int) -> None:
    """A converted model's 16-bit weight copies kept current through a random run of
    what training scripts do between forwards: steps of torch's and mpgemm's optimizers
    (one or two of them, a LossScaleOptimizer among them), in-place edits under
    ``no_grad``, state dicts loaded, parameters frozen and unfrozen, evaluation under
    ``no_grad`` and ``inference_mode``. After each, the model's output must be, bit for
    bit, that of a deep copy of it (which has no copies: it makes them anew)."""
    random.seed(seed)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # (the layers' initialisation)
    dims = [random.choice([3, 8, 16, 17]) for _ in range(random.randint(2, 4))]
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1], bias=random.random() < 0.8))
        if i < len(dims) - 2 and random.random() < 0.7:
            layers.append(random.choice([nn.ReLU, nn.GELU, nn.SiLU])())
    model = mpgemm.convert(nn.Sequential(*layers).to(_device), compute_dtype=random.choice(HALVES))
    params = list(model.parameters())
    split = random.random() < 0.3 and len(params) > 1
    groups = [params[: len(params) // 2], params[len(params) // 2 :]] if split else [params]
    makers = [
        lambda ps: mpgemm.optim.Adam(ps, lr=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
        lambda ps: torch.optim.AdamW(ps, lr=0.01),
        lambda ps: mpgemm.LossScaleOptimizer(mpgemm.optim.AdamW(ps, lr=0.01)),
    ]
    optimizers = [random.choice(makers)(ps) for ps in groups]
    x = _randn(5, dims[0], g=g)
    kinds = [type(layer).__name__ for layer in model]
    what = f"copies seed {seed}: {dims} {kinds}, {[type(o).__name__ for o in optimizers]}"
    done = []
    for _ in range(8):
        op = random.choice(["train", "train", "edit", "load", "freeze", "eval"])
        done.append(op)
        # (An optimizer with nothing to step: torch's scaler asserts, as mpgemm's does.)
        trained = [
            o for o, ps in zip(optimizers, groups, strict=True) if any(p.requires_grad for p in ps)
        ]
        if op == "train" and trained:
            optimizer = random.choice(trained)
            optimizer.zero_grad()
            loss = model(x).float().square().mean()
            if isinstance(optimizer, mpgemm.LossScaleOptimizer):
                optimizer.backward(loss)
            else:
                loss.backward()
            optimizer.step()
        elif op == "edit":
            p, edit = random.choice(params), random.choice(["mul_", "add_", "copy_", "zero_"])
            with torch.no_grad():
                if edit == "mul_":
                    p.mul_(0.5)
                elif edit == "zero_":
                    p.zero_()
                else:
                    getattr(p, edit)(_randn(*p.shape, g=g))
        elif op == "load":
            state = {k: v + _randn(*v.shape, g=g) for k, v in model.state_dict().items()}
            model.load_state_dict(state)
        elif op == "freeze":
            p = random.choice(params)
            p.requires_grad_(not p.requires_grad)
        else:
            with random.choice([torch.no_grad, torch.inference_mode, torch.enable_grad])():
                model(x)
        fresh = copy.deepcopy(model)
        with torch.no_grad():  # (NaN where a run of loads and steps diverged: in both)
            assert_same_bits(model(x), fresh(x), f"{what}: after {done}")


def relu_fusion_case(seed: int) -> None:
    """A ReLU layer into a layer, backward with the ReLU's backward in the second layer's
    input-gradient GEMM (``functional._fusable_relu``) and with the ReLU's own kernel, on
    the same draw: every gradient and what a hook at the ReLU's output sees the same
    bits, but the ReLU's bias gradient, summed in another order: within FP32's bound of
    the sums of the same dZ, which the fused GEMM wrote."""
    random.seed(seed)
    lead = tuple(random.choice([1, 2, 3, 5, 17, 33]) for _ in range(random.choice([1, 2])))
    k, n, m = (random.choice([1, 3, 8, 16, 17, 40]) for _ in range(3))
    x_dtype, compute = random.choice(DTYPES), random.choice(HALVES)
    relu_out, head_out = random.choice([None, *DTYPES]), random.choice([None, torch.float32])
    bias = random.random() < 0.8
    frozen = random.choice([None, "weight", "bias", "head"])
    seen = random.choice([None, None, None, "hook", "retain_grad", "second consumer"])
    x_grad = random.random() < 0.3
    what = f"relu_fusion seed {seed}: x {(*lead, k)} {x_dtype} -> {n} ({relu_out}) -> {m} "
    what += f"({head_out}), compute {compute}, bias {bias}, frozen {frozen}, seen {seen}"
    runs, shipped = [], functional._FUSE_RELU
    try:
        for fuse in (True, False):
            functional._FUSE_RELU = fuse
            torch.manual_seed(seed)
            relu = mpgemm.Linear(
                k, n, bias=bias, activation="relu", compute_dtype=compute, out_dtype=relu_out
            ).to(_device)
            head = mpgemm.Linear(n, m, compute_dtype=compute, out_dtype=head_out).to(_device)
            if frozen == "head":
                head.requires_grad_(False)
            elif frozen is not None and getattr(relu, frozen) is not None:
                getattr(relu, frozen).requires_grad_(False)
            g = torch.Generator().manual_seed(seed)
            x = _randn(*lead, k, g=g).to(x_dtype).requires_grad_(x_grad)
            y, looks = relu(x), []
            if not y.requires_grad:  # nothing of the ReLU's to differentiate: no case
                return
            if seen == "hook":
                y.register_hook(lambda grad, looks=looks: looks.append(grad.clone()))
            elif seen == "retain_grad":
                y.retain_grad()
            loss = head(y).double().square().sum()
            if seen == "second consumer":
                loss = loss + y.double().sum()
            with fused_relu_gradients() as made:
                loss.backward()
            if fuse:
                fused_dz = made
            if seen == "retain_grad":
                looks.append(y.grad)
            params = [*relu.parameters(), *head.parameters()]
            runs.append([x.grad, *(p.grad for p in params), *looks])
    finally:
        functional._FUSE_RELU = shipped
    (fused, unfused), bias_at = runs, 2 if bias else None
    assert len(fused) == len(unfused), what
    for i, (got, want) in enumerate(zip(fused, unfused, strict=True)):
        if (got is None) != (want is None):
            raise AssertionError(f"{what}: gradient {i} is None on one side only")
        if got is None:
            continue
        if i == bias_at and fused_dz and seen != "second consumer":
            dz = fused_dz[0].reshape(-1, n)
            assert_sum_within_torch_error(got, dz, want, f"{what}: ReLU's bias", dim=0)
        else:
            assert_same_bits(got, want, f"{what}: gradient {i}")


CASES: dict[str, Callable[[int], None]] = {
    "amp": amp_case,
    "copies": copies_case,
    "matmul": matmul_case,
    "linear": linear_case,
    "masters": masters_case,
    "cross_entropy": cross_entropy_case,
    "optim": optim_case,
    "relu_fusion": relu_fusion_case,
    "scaler": scaler_case,
    "cross_entropy_second_order": cross_entropy_second_order_case,
    "linear_forward_mode": linear_forward_mode_case,
    "linear_nonfinite": linear_nonfinite_case,
    "linear_second_order": linear_second_order_case,
    "matmul_forward_mode": matmul_forward_mode_case,
    "matmul_nonfinite": matmul_nonfinite_case,
    "matmul_second_order": matmul_second_order_case,
}


def search(op: str, seeds: range, device: torch.device | str = "cpu") -> list[str]:
    """The failures of ``op``'s cases over ``seeds`` with tensors on ``device``, one line
    each: an assertion's, or any other exception's (named), which mpgemm raised where
    torch computed (seed 400173 of ``matmul`` raised from a backward, and ended the
    search)."""
    global _device
    _device = torch.device(device)
    failures = []
    for seed in seeds:
        try:
            CASES[op](seed)
        except AssertionError as error:
            failures.append(f"{op} seed {seed}: {str(error).splitlines()[0][:600]}")
        except Exception as error:
            line = (str(error).splitlines() or [""])[0][:600]
            failures.append(f"{op} seed {seed}: {type(error).__name__}: {line}")
    return failures


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in CASES:
        sys.exit(f"usage: python -m tests.randomized {{{','.join(CASES)}}} FIRST_SEED COUNT")
    first, count = int(argv[1]), int(argv[2])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    failures = search(argv[0], range(first, first + count), device)
    print(*failures, sep="\n")
    print(f"{argv[0]}: {count} cases, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
