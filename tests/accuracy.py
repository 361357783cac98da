"""Shared test helpers: the accuracy bar, operands that expose missing masks, the
kernels a call launches and the torch ops it runs besides, the optimizers' launch
shape, the input gradients that took a ReLU's backward, the TMA kernel's tiles stored
in parts."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


def away_from_relu_kink(t: torch.Tensor, x, w, b) -> torch.Tensor:
    """``t`` (a gradient or tangent at a ReLU layer's output, or that output), zeroed where
    z = x @ w.T + b is within operand-rounding noise of ReLU's kink: there 16-bit
    rounding decides the mask, differently for every implementation."""
    z = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    return torch.where(z.abs() < 0.02 * z.abs().max(), 0.0, t.double()).to(t)


def assert_within_torch_error(
    out: torch.Tensor,
    exact: torch.Tensor,
    baseline: torch.Tensor,
    what: str,
    rtol: float = 1e-6,
    atol: float = 0.0,
) -> None:
    """``out``'s max error against the FP64 ``exact`` is at most twice ``baseline``'s
    (torch's own product of the same 16-bit operands), plus ``rtol`` of ``exact``'s
    largest magnitude, plus ``atol``. Non-finite values never pass."""
    assert out.shape == exact.shape, f"{what}: shape {tuple(out.shape)} != {tuple(exact.shape)}"
    assert torch.isfinite(out).all(), f"{what}: {(~torch.isfinite(out)).sum()} non-finite"
    if exact.numel() == 0:
        return
    # On exact's device: a benchmark's products are hundreds of MB.
    exact = exact.to(torch.float64)
    err = (out.to(exact.device, torch.float64) - exact).abs().max().item()
    base = (baseline.to(exact.device, torch.float64) - exact).abs().max().item()
    atol = rtol * exact.abs().max().item() + atol + 1e-30
    assert err <= 2 * base + atol, f"{what}: error {err:.3g} > 2 x torch's {base:.3g} + {atol:.3g}"


def assert_sum_within_torch_error(
    out: torch.Tensor, terms: torch.Tensor, baseline: torch.Tensor, what: str, dim: int
) -> None:
    """``assert_within_torch_error`` for FP32 sums of ``terms`` over ``dim``, with one
    FP32 epsilon of the largest sum of the terms' magnitudes beside twice torch's
    error: the scale of any summation order's error bound. Where the terms cancel,
    torch's pairwise order can land far nearer the exact sum than a kernel's blocked
    one (one row of 300 standard normals summing to 0.47: the kernel 4.0e-06 off, torch
    2.5e-07, in 3 of 150 seeds beyond the bar without it), while a dropped block of
    terms, or terms rounded to 16 bits first, is thousands of times further off."""
    terms = terms.to("cpu", torch.float64)
    scale = terms.abs().sum(dim).max().item() if terms.numel() else 0.0
    atol = torch.finfo(torch.float32).eps * scale
    assert_within_torch_error(out, terms.sum(dim), baseline, what, atol=atol)


def nan_padded(
    t: torch.Tensor, transposed: bool = False, aligned: bool = False, multiple: int = 8
) -> torch.Tensor:
    """A copy of 2-D ``t`` living as a strided view inside a NaN-filled buffer (stored
    column-major when ``transposed``), so any read outside ``t`` shows up as NaN.
    ``aligned``: the view starts ``multiple`` elements into each row and its rows are a
    multiple of ``multiple`` elements apart: 8, a 16-byte boundary for 16-bit elements,
    as the TMA kernel's descriptors need; 16, the alignment triton's JIT specialises
    integers on, which vectorised loops need."""
    rows, cols = t.shape
    if transposed:
        rows, cols = cols, rows
    lead, skip = (multiple, 16) if aligned else (2, 5)  # elements before and after each row
    width = cols + lead + skip
    if aligned:
        width += -width % multiple
    buf = torch.full((rows + 3, width), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[1 : 1 + rows, lead : lead + cols]
    if transposed:
        view = view.t()
    view.copy_(t)
    return view


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """``out`` equals ``ref`` bit for bit, except that any NaN matches any NaN (torch's
    own CPU and CUDA kernels give NaN different payloads)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    nan = torch.isnan(out)
    assert torch.equal(nan, torch.isnan(ref)), f"{what}: NaNs at different positions"
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]
    same = out.view(ints) == ref.view(ints)
    assert bool((same | nan).all()), f"{what}: {(~(same | nan)).sum().item()} elements differ"


def launched_kernels(run):
    """(names of the kernels ``run()`` launches, in order; what it returns): each launch
    is run as usual and its kernel's name kept."""
    from mpgemm.kernels.launches import intercept, jit_function

    names = []

    def run_and_keep(kernel, grid, args, kwargs, configs):
        names.append(jit_function(kernel).fn.__name__)
        kernel[grid](*args, **kwargs)

    with intercept(run_and_keep):
        out = run()
    return names, out


class _TorchOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _launched_unseen(kernel, grid, args, kwargs, configs):
    with _disable_current_modes():  # the interpreter's own torch ops
        kernel[grid](*args, **kwargs)


@contextmanager
def torch_ops_besides_launches() -> Iterator[list[str]]:
    """The names of the aten ops that run in the block outside kernel launches (each
    launch runs, unseen), appended as they run."""
    from mpgemm.kernels.launches import intercept

    with intercept(_launched_unseen), _TorchOps() as ops:
        yield ops.names


class OpLog(TorchDispatchMode):
    """The aten ops that run, with their arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, out))
        return out

    def names(self) -> list[str]:
        return [func.__name__ for func, _, _ in self.calls]

    def casts_of(self, weight: torch.Tensor) -> list:
        """Ops that turn an FP32 tensor of ``weight``'s shape into a 16-bit one."""
        found = []
        for func, args, out in self.calls:
            made = args[0] if func.__name__.startswith("copy_") else out
            sources = [
                a
                for a in args
                if isinstance(a, torch.Tensor)
                and a.shape == weight.shape
                and a.dtype == torch.float32
            ]
            if (
                isinstance(made, torch.Tensor)
                and made.shape == weight.shape
                and made.dtype in (torch.float16, torch.bfloat16)
                and sources
            ):
                found.append(func)
        return found


@contextmanager
def optimizer_launch_shape(**shape: object) -> Iterator[None]:
    """Within the block, the fused optimizers' launches take ``shape``'s keywords of
    ``fused_optim._launch`` (``block``, ``blocks_per_program``): spans of several blocks
    for tensors too small to get them as shipped."""
    from mpgemm.kernels import fused_optim

    launch = fused_optim._launch
    fused_optim._launch = functools.partial(launch, **shape)
    try:
        yield
    finally:
        fused_optim._launch = launch


@contextmanager
def fused_relu_gradients() -> Iterator[list[torch.Tensor]]:
    """Within the block, a copy of each input gradient that took a ReLU's backward in its
    GEMM (``functional._input_gradient`` given ``relu_output``: dZ at the ReLU's
    input), in the order made."""
    from mpgemm import functional

    record, made = functional._input_gradient, []

    def recorded(*args, **kwargs):
        out = record(*args, **kwargs)
        if kwargs.get("relu_output") is not None:
            made.append(out[0].detach().clone())
        return out

    functional._input_gradient = recorded
    try:
        yield made
    finally:
        functional._input_gradient = record


def store_in_parts(monkeypatch, parts: int, c_bytes: int) -> None:
    """Make the TMA kernel store the interpreter's tile of C, of ``c_bytes`` elements, in
    ``parts`` parts (an H100's 128x256 FP32 tile is stored in quarters)."""
    from mpgemm.kernels import gemm_tma
    from mpgemm.kernels.gemm_common import tile

    block_m, block_n, _, _ = tile(gemm_tma.CONFIGS[0])
    whole = block_m * block_n * c_bytes
    monkeypatch.setattr(gemm_tma, "EPILOGUE_SCRATCH", whole - 1)
    monkeypatch.setattr(gemm_tma, "EPILOGUE_PART", whole // parts)
    assert gemm_tma.epilogue_parts(block_m, block_n, c_bytes) == parts
