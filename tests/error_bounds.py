"""Forward error bounds for drawn cases whose roundings sit in different places in
different implementations: running error analysis (Wilkinson's), first order in the
unit roundoff. Each value is carried exactly in FP64 beside a bound on the error of
any computation of it that rounds every intermediate (to 16 bits, at most twice, or
by truncation once: one epsilon of the coarsest dtype in play) and accumulates its
products and sums in FP32. Two implementations that place their roundings
differently (``mpgemm``'s recorded backward and ``linear_ref`` differentiated by
torch) both lie within it; a wrong term, sign or operand is orders of magnitude
outside it.

    model = Rounding(torch.float16, torch.bfloat16)
    z = model.matmul(model.operand(x), model.operand(w).mT)

``linear_derivatives`` bounds ``mpgemm.linear``'s first and second derivatives: its
gradients, and the gradients of a penalty on them (a gradient penalty, a
Hessian-vector product)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from mpgemm.reference import torch_activation

# FP32's unit roundoff: the accumulators' (the products of 16-bit operands are exact).
_FP32_UNIT = 2.0**-24


@dataclass(frozen=True)
class Bounded:
    """A value, exact in FP64, and a bound on the error of its computed counterpart
    (elementwise, non-negative, the value's shape)."""

    value: torch.Tensor
    error: torch.Tensor

    @property
    def magnitude(self) -> torch.Tensor:
        return self.value.abs()

    @property
    def mT(self) -> Bounded:  # noqa: N802 (torch's name)
        return Bounded(self.value.mT, self.error.mT)


class Rounding:
    """The error model: every intermediate rounded with relative error at most
    ``unit`` (one epsilon of the coarsest of ``dtypes``, all 16-bit, FP32 ignored),
    and, where FP16 is in play, absolute error at most one FP16 subnormal spacing
    (2^-24: a value that underflows keeps no relative precision, and the Triton
    interpreter truncates there); products and sums of ``n`` terms accumulated in
    FP32 (error at most ``n`` FP32 units of the terms' magnitudes)."""

    def __init__(self, *dtypes: torch.dtype) -> None:
        halves = [d for d in dtypes if d.itemsize == 2]
        self.unit = max((torch.finfo(d).eps for d in halves), default=_FP32_UNIT)
        self.tiny = 2.0**-24 if torch.float16 in halves else 0.0

    def exact(self, t: torch.Tensor) -> Bounded:
        """``t`` as given: no error."""
        value = t.detach().double()
        return Bounded(value, torch.zeros_like(value))

    def rounded(self, b: Bounded) -> Bounded:
        """``b`` stored, or rounded to a GEMM's compute dtype."""
        return Bounded(b.value, b.error + self.unit * b.magnitude + self.tiny)

    def operand(self, t: torch.Tensor) -> Bounded:
        """``t`` rounded once: an input as a GEMM's operand."""
        return self.rounded(self.exact(t))

    def _accumulated(self, value, error, terms, n: int) -> Bounded:
        gamma = n * _FP32_UNIT / (1 - n * _FP32_UNIT)
        return self.rounded(Bounded(value, error + gamma * terms))

    def matmul(self, a: Bounded, b: Bounded) -> Bounded:
        """a @ b (matrices), accumulated over the inner dimension in FP32, rounded."""
        terms = a.magnitude @ b.magnitude
        error = a.error @ b.magnitude + a.magnitude @ b.error
        return self._accumulated(a.value @ b.value, error, terms, a.value.shape[-1])

    def add(self, a: Bounded, b: Bounded) -> Bounded:
        """a + b, broadcast, rounded."""
        return self.rounded(Bounded(a.value + b.value, a.error + b.error))

    def mul(self, a: Bounded, b: Bounded) -> Bounded:
        """a * b, broadcast, rounded."""
        error = a.error * b.magnitude + a.magnitude * b.error
        return self.rounded(Bounded(a.value * b.value, error))

    def scaled(self, a: Bounded, factor: torch.Tensor | float) -> Bounded:
        """a times an exact ``factor`` (a 0/1 mask, a constant), not rounded."""
        return Bounded(a.value * factor, a.error * abs(factor))

    def sum_to(self, a: Bounded, shape: tuple[int, ...]) -> Bounded:
        """a summed over its leading dimensions to ``shape`` (a bias's: (n,) or ()), as
        broadcasting's gradient is, in FP32, rounded."""
        dims = tuple(range(a.value.dim() - len(shape))) + tuple(
            a.value.dim() - len(shape) + i for i, size in enumerate(shape) if size == 1
        )
        if not dims:
            return a
        n = a.value.numel() // max(1, math.prod(shape))
        value, error, terms = (t.sum(dims).reshape(shape) for t in (a.value, a.error, a.magnitude))
        return self._accumulated(value, error, terms, n)

    def elementwise(self, a: Bounded, activation: str | None, order: int) -> Bounded:
        """act^(order)(a): the activation's value (order 0) or a derivative, by torch's
        function differentiated in FP64. Its error is the derivative's next one times
        a's error, plus the largest of the one after over the real line times a's error
        squared (Taylor's remainder: at an inflection the first term vanishes),
        rounded."""
        value = derivative(a.value, activation, order)
        slope = derivative(a.value, activation, order + 1).abs()
        error = slope * a.error + _largest_derivative(activation, order + 2) * a.error**2
        return self.rounded(Bounded(value, error))


def derivative(z: torch.Tensor, activation: str | None, order: int) -> torch.Tensor:
    """The ``order``-th derivative of ``activation`` (None: the identity) at ``z``
    (FP64), elementwise, by autograd through torch's own function; ReLU's away from 0."""
    z = z.detach().requires_grad_()
    with torch.enable_grad():
        out = torch_activation(z, activation) if activation else z * 1.0
        for _ in range(order):
            if not out.requires_grad:  # a constant: its derivatives vanish
                return torch.zeros_like(out)
            (out,) = torch.autograd.grad(out.sum(), z, create_graph=True, materialize_grads=True)
    return out.detach()


@functools.cache
def _largest_derivative(activation: str | None, order: int) -> float:
    """The largest magnitude of the ``order``-th derivative over the real line, read on
    a fine grid over [-20, 20] (beyond it GELU's and SiLU's derivatives of order 2 and
    more are below 1e-6 of their largest, and torch's tanh GELU's own formulas give NaN
    past 26), with a quarter more for what the grid misses."""
    grid = torch.linspace(-20, 20, 400001, dtype=torch.float64)
    return 1.25 * derivative(grid, activation, order).abs().max().item()


def _preactivation(model: Rounding, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """x's rows and W as a layer's rounded operands, and z = x W^T + b, stored."""
    xb, wb = model.operand(x.reshape(-1, x.shape[-1])), model.operand(w)
    z = model.matmul(xb, wb.mT)
    return xb, wb, z if b is None else model.add(z, model.exact(b))


def linear_derivatives(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    activation: str | None,
    loss: tuple[torch.Tensor, torch.Tensor, float],
    penalty: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    model: Rounding,
) -> tuple[tuple[Bounded, Bounded, Bounded | None], tuple[Bounded, Bounded, Bounded | None]]:
    """The gradients of L and the gradients of P, each (x's, W's, b's), with their error
    bounds: P = <Rx, dL/dx> + <Rw, dL/dW> + <Rb, dL/db> (``penalty``: (Rx, Rw, Rb),
    None for a gradient not penalised; one at least) for y = act(x W^T + b) (x (...,
    k), W (n, k), b (n,), () or None) and the loss L = <M C, y> + s/2 |M y|^2 (``loss``:
    (C, M, s), C and the 0/1 mask M of y's shape), whose gradient G = M (C + s y)
    depends on y where s != 0. With D = G act'(z) (the first backward's dZ) and E = Rx
    W^T + x Rw^T + Rb:

        dL/dx = D W,   dL/dW = D^T x,   dL/db = D summed to b's shape
        P = <D, E>,   H = (G act''(z) + s M act'(z)^2) E    (dP/dz)
        dP/dx = H W + D Rw,   dP/dW = H^T x + D^T Rx,   dP/db = H summed to b's shape

    Every intermediate is rounded (``Rounding``): x, W and the R as GEMM operands, z
    and y stored, G as y's gradient, D as a GEMM operand."""
    k = x.shape[-1]
    xb, wb, z = _preactivation(model, x, w, b)
    coef, mask, s = loss
    mask = mask.reshape(z.value.shape).double()
    y = model.elementwise(z, activation, 0)
    g = model.rounded(
        model.scaled(model.add(model.exact(coef.reshape(z.value.shape)), model.scaled(y, s)), mask)
    )
    slope = model.elementwise(z, activation, 1)
    d = model.rounded(model.mul(g, slope))
    rx, rw, rb = penalty
    rxb = None if rx is None else model.operand(rx.reshape(-1, k))
    rwb = None if rw is None else model.operand(rw)
    terms = [] if rxb is None else [model.matmul(rxb, wb.mT)]
    if rwb is not None:
        terms.append(model.matmul(xb, rwb.mT))
    if rb is not None:
        terms.append(model.exact(rb))
    e = functools.reduce(model.add, terms)
    h = model.mul(g, model.elementwise(z, activation, 2))
    if s:
        h = model.add(h, model.scaled(model.mul(model.scaled(slope, mask), slope), s))
    h = model.mul(h, e)  # (broadcast: E may be Rb alone)
    dx, dw = model.matmul(h, wb), model.matmul(h.mT, xb)
    if rwb is not None:
        dx = model.add(dx, model.matmul(d, rwb))
    if rxb is not None:
        dw = model.add(dw, model.matmul(d.mT, rxb))
    first = (model.matmul(d, wb), model.matmul(d.mT, xb), _summed(model, d, b))
    second = (dx, dw, _summed(model, h, b))
    return _as_input(first, x), _as_input(second, x)


def _summed(model: Rounding, dz: Bounded, b: torch.Tensor | None) -> Bounded | None:
    return None if b is None else model.sum_to(dz, tuple(b.shape))


def _as_input(grads: tuple, x: torch.Tensor) -> tuple:
    """``grads`` with x's (rows of k) in x's shape."""
    dx = grads[0]
    return (Bounded(dx.value.reshape(x.shape), dx.error.reshape(x.shape)), *grads[1:])


def _matrix(model: Rounding, t: torch.Tensor | None, row: bool):
    """``t`` as a product's operand, rounded: a vector as a row (``row``) or a column, as
    ``torch.matmul`` takes it; None for None."""
    if t is None:
        return None
    return model.operand(t.unsqueeze(0 if row else -1) if t.dim() == 1 else t)


def matmul_derivatives(
    a: torch.Tensor,
    b: torch.Tensor,
    loss: tuple[torch.Tensor, float],
    penalty: tuple[torch.Tensor | None, torch.Tensor | None],
    model: Rounding,
) -> tuple[tuple[Bounded, Bounded], tuple[Bounded, Bounded]]:
    """``linear_derivatives`` for y = a @ b (``torch.matmul``'s shapes: batches that
    broadcast, a vector a as a row, a vector b as a column): the gradients of L = <C,
    y> + s/2 |y|^2 (``loss``: (C, s)) and of P = <Ra, dL/da> + <Rb, dL/db>
    (``penalty``: (Ra, Rb), None for a gradient not penalised), each (a's, b's). With
    G = C + s y and E = Ra b + a Rb, the products broadcast and the gradients summed to
    their operands' shapes:

        dL/da = G b^T,   dL/db = a^T G
        dP/da = G Rb^T + s E b^T,   dP/db = Ra^T G + s a^T E"""

    ab, bb = _matrix(model, a, True), _matrix(model, b, False)
    y = model.matmul(ab, bb)
    coef, s = loss
    g = model.rounded(model.add(model.exact(coef.reshape(y.value.shape)), model.scaled(y, s)))
    ra, rb = _matrix(model, penalty[0], True), _matrix(model, penalty[1], False)
    terms = [model.matmul(t, u) for t, u in ((ra, bb), (ab, rb)) if t is not None and u is not None]
    e = functools.reduce(model.add, terms)
    da2, db2 = model.scaled(model.matmul(e, bb.mT), s), model.scaled(model.matmul(ab.mT, e), s)
    if rb is not None:
        da2 = model.add(da2, model.matmul(g, rb.mT))
    if ra is not None:
        db2 = model.add(db2, model.matmul(ra.mT, g))

    def summed(grad: Bounded, operand: torch.Tensor, matrix: Bounded) -> Bounded:
        grad = model.sum_to(grad, tuple(matrix.value.shape))
        return Bounded(grad.value.reshape(operand.shape), grad.error.reshape(operand.shape))

    first = (summed(model.matmul(g, bb.mT), a, ab), summed(model.matmul(ab.mT, g), b, bb))
    return first, (summed(da2, a, ab), summed(db2, b, bb))


def linear_tangent(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    activation: str | None,
    tangents: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    model: Rounding,
) -> Bounded:
    """Forward-mode AD's tangent of y = act(x W^T + b) (``linear_derivatives``'
    shapes), with its error bound, for the tangents (x_t, W_t, b_t) (``tangents``, None
    for an input without one; one at least): y_t = act'(z) (x_t W^T + x W_t^T + b_t),
    each product of rounded operands."""
    k = x.shape[-1]
    xb, wb, z = _preactivation(model, x, w, b)
    xt, wt, bt = tangents
    terms = [] if xt is None else [model.matmul(model.operand(xt.reshape(-1, k)), wb.mT)]
    if wt is not None:
        terms.append(model.matmul(xb, model.operand(wt).mT))
    if bt is not None:
        terms.append(model.exact(bt))
    zt = functools.reduce(model.add, terms)
    yt = model.mul(model.elementwise(z, activation, 1), zt)  # (broadcast: b_t alone)
    shape = (*x.shape[:-1], w.shape[0])
    return Bounded(yt.value.reshape(shape), yt.error.reshape(shape))


def matmul_tangent(
    a: torch.Tensor,
    b: torch.Tensor,
    tangents: tuple[torch.Tensor | None, torch.Tensor | None],
    model: Rounding,
) -> Bounded:
    """Forward-mode AD's tangent of y = a @ b (``torch.matmul``'s shapes), with its error
    bound, for the tangents (a_t, b_t) (None for an operand without one; one at least):
    y_t = a_t b + a b_t, each product of rounded operands."""
    at, bt = tangents
    terms = [] if at is None else [model.matmul(_matrix(model, at, True), _matrix(model, b, False))]
    if bt is not None:
        terms.append(model.matmul(_matrix(model, a, True), _matrix(model, bt, False)))
    yt = functools.reduce(model.add, terms)
    meta = (torch.empty(t.shape, device="meta") for t in (a, b))
    shape = torch.matmul(*meta).shape
    return Bounded(yt.value.reshape(shape), yt.error.reshape(shape))
