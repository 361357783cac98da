"""Compile what the GPU will run, ahead of time, for an H100, on any machine.

The interpreter runs the kernels' Python, not the GPU compiler, which has rules of its
own (layouts, register budgets, what lowers to Hopper's async wgmma, approximate math).
This drives the real code paths (``mpgemm.linear`` forward and backward, the loss-scaling
launchers) on CPU tensors with every launch intercepted (``mpgemm.kernels.launches``),
and compiles each launch with triton's own JIT for ``GPUTarget("cuda", 90, 32)``: the
JIT specialises the arguments exactly as on a GPU (integers and strides divisible by 16,
16-byte-aligned pointers, unit strides), and only then pipelines the GEMM's main loop.
Each launch kind is compiled at an aligned shape (as at 4096, 8192 or 784) and at an
unaligned one (odd sizes, an operand off its 16-byte boundary), for every autotune
config that pruning keeps. cuobjdump (in the triton wheel) reads each binary's
registers and stack frame, where spills go. No GPU or driver is needed.

    python -m mpgemm.kernels.aot     # one JSON line per binary, exit 1 on a defect

A defect: a GEMM without wgmma, with a stack frame (register spills) or with more
shared memory than an H100 block may have (it would fail to launch); a streaming kernel
(loss scaling, an activation's backward, the cross-entropy) with a stack frame,
approximate FP32 math (torch divides and takes square roots exactly and keeps
denormals) or, when aligned, no 16-byte vector loads; an elementwise table kernel
(unscale, SGD, Adam) that moves values between thread layouts (``layout_conversions``:
through shared memory, with barriers).
The report also says, per binary, how many wgmma groups stay in flight
(``wgmma_pending``: the largest N of ``wgmma.wait_group N``; 0 means every MMA is waited
for at once, no overlap), and whether ``cp.async`` or TMA (``cp.async.bulk.tensor``)
feeds shared memory.

Each kernel's first launch is also compiled with programmatic dependent launch
(``mpgemm.kernels.dependent_launch``), for which a defect is, besides, any global
memory access before the wait for the prior grid, or no ``launch_dependents``.

Must run without ``TRITON_INTERPRET=1``: the interpreter replaces ``triton.jit``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from mpgemm.kernels import dependent_launch
from mpgemm.kernels.gemm_tma import SMEM_BYTES
from mpgemm.kernels.launches import compile_for_hopper, intercept, jit_function, named_arguments

HOPPER = GPUTarget("cuda", 90, 32)
SPECIALIZATIONS = ("aligned", "unaligned")
# (M, K, N) of a layer: multiples of 16 as the guide's 8192, 784 and 4096 are; or not.
_SHAPES = {"aligned": (256, 784, 512), "unaligned": (250, 781, 509)}


class _HopperDriver:
    """Stands in for the CUDA driver while compiling: the JIT asks the active driver
    only for a device, a stream and the target to compile for."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return HOPPER


@contextmanager
def _hopper_target() -> Iterator[None]:
    previous = driver._active
    driver.set_active(_HopperDriver())
    try:
        yield
    finally:
        driver.set_active(previous)


# -- what to compile: the launches of the real code paths ------------------------------


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, aligned: bool) -> torch.Tensor:
    """An uninitialised tensor, or a view of one that starts 2 bytes past a 16-byte
    boundary (as a slice of a larger buffer can)."""
    if aligned:
        return torch.empty(shape, dtype=dtype)
    numel = 1
    for size in shape:
        numel *= size
    offset = max(1, 2 // torch.empty((), dtype=dtype).element_size())
    return torch.empty(numel + offset, dtype=dtype)[offset:].view(shape)


def _gemm_workloads(half: torch.dtype, spec: str) -> Iterator[tuple[str, object]]:
    """(label, run) pairs: each ``run`` makes one layer's launches, in the order
    LinearFunction makes them (forward; input gradient, then weight gradient)."""
    from mpgemm.functional import linear, matmul
    from mpgemm.losses import cross_entropy
    from mpgemm.modules import Linear

    aligned = spec == "aligned"
    m, k, n = _SHAPES[spec]
    f32 = torch.float32

    def module(x_dtype, *, activation, out_dtype=None, grad_x=True, shape=(m, k, n), loss=False):
        # A training step's layer: FP32 master weights, whose 16-bit copy the GEMMs read;
        # with ``loss``, the logits' cross-entropy, whose backward lays out the gradient
        # that the head's backward GEMMs read (cross_entropy.padded_rows).
        rows, fan_in, fan_out = shape
        layer = Linear(
            fan_in, fan_out, activation=activation, compute_dtype=half, out_dtype=out_dtype
        )
        x = _tensor((rows, fan_in), x_dtype, aligned).requires_grad_(grad_x)
        if loss:
            target = torch.zeros(rows, dtype=torch.int64)
            return lambda: cross_entropy(layer(x), target)
        return lambda: layer(x)

    def functional(x_dtype, w_dtype, *, bias, activation, grad=True):
        x = _tensor((m, k), x_dtype, aligned).requires_grad_(grad)
        w = _tensor((n, k), w_dtype, aligned).requires_grad_(grad)
        b = _tensor((n,), f32, aligned).requires_grad_(grad) if bias else None
        return lambda: linear(x, w, b, activation=activation, compute_dtype=half)

    def relu_into(fan_out, *, out_dtype=None, rows=m, loss=False):
        # A ReLU layer's output as the next layer's input: that layer's input gradient
        # takes the ReLU's backward into its epilogue (functional._fusable_relu; on in
        # _launches).
        relu = Linear(k, n, activation="relu", compute_dtype=half)
        layer = Linear(n, fan_out, compute_dtype=half, out_dtype=out_dtype)
        x = _tensor((rows, k), half, aligned)
        if loss:
            target = torch.zeros(rows, dtype=torch.int64)
            return lambda: cross_entropy(layer(relu(x)), target)
        return lambda: layer(relu(x))

    yield "forward 16-bit", functional(half, half, bias=False, activation=None, grad=False)
    # The layers of a converted MLP's training step: the first (an FP32 input, rounded
    # once), hidden ones with each fused activation, the FP32 logits.
    yield "step: first layer", module(f32, activation="relu", grad_x=False)
    yield "step: hidden relu", module(half, activation="relu")
    yield "step: hidden gelu", module(half, activation="gelu")
    yield "step: hidden silu", module(half, activation="silu")
    yield "step: hidden gelu_tanh", module(half, activation="gelu_tanh")
    # No activation: the weight gradient's GEMM sums the bias gradient (an activated
    # layer's is summed by its activation's node, with the derivative).
    yield "step: hidden linear", module(half, activation=None)
    yield "step: head", module(half, activation=None, out_dtype=f32)
    yield "step: hidden, after a ReLU", relu_into(n)
    yield "step: head, after a ReLU", relu_into(10, out_dtype=f32, loss=True)
    if aligned:
        # The guide MLP's head: its weight gradient (10 x 4096 over a batch of 8192)
        # fills 32 tiles, so K is split (split_k_for) and a reduction adds the parts.
        yield (
            "step: head, batch 8192",
            module(half, activation=None, out_dtype=f32, shape=(8192, 4096, 10), loss=True),
        )
        yield (
            "step: head, after a ReLU, batch 8192",
            relu_into(10, out_dtype=f32, rows=8192, loss=True),
        )
    if half == torch.bfloat16:
        # BF16 changes only the MMA's input type: its step and plain product suffice.
        return
    if aligned:
        # Operands a descriptor takes, C's rows 264 elements apart (not a multiple of 16):
        # the epilogue's layout conversion may then take a whole tile (gemm_tma's
        # C_ALIGNED; 256x128 in 4 stages took 262,176 bytes so).
        # The weights need a gradient, so that GELU's forward stores z beside its output
        # (STORE_PREACT); the output is detached: the forward's launch alone.
        x6 = _tensor((m, k), half, aligned)
        w6 = _tensor((264, k), half, aligned).requires_grad_()
        b6 = _tensor((264,), f32, aligned).requires_grad_()
        for activation in ("relu", "gelu"):
            yield (
                f"forward {activation}, C's rows unaligned",
                functools.partial(_detached, linear, x6, w6, b6, activation=activation),
            )
    # Launches of at most 16 columns take the 16-wide tiles: a 10-class head (its
    # forward, unaligned; its weight gradient, C.T = B.T @ A.T, either way), and,
    # unaligned, a 15 -> 16 layer's GEMMs with GELU's epilogue.
    yield (
        "step: head, 10 classes",
        module(half, activation=None, out_dtype=f32, shape=(m, k, 10), loss=True),
    )
    if not aligned:
        yield "step: 15 -> 16 gelu", module(half, activation="gelu", shape=(m, 15, 16))
    # mpgemm.linear and matmul on what they are given: FP32 operands rounded in the kernel.
    yield "functional fp32 weight", functional(half, f32, bias=True, activation="relu")
    yield "functional fp32 operands", functional(f32, f32, bias=True, activation=None, grad=False)
    yield "matmul 16-bit", functional(half, half, bias=False, activation=None)
    # A batch of products (the pointer kernel's batch axis), forward and backward.
    a, b = (_tensor(shape, half, aligned).requires_grad_() for shape in ((3, m, k), (3, k, n)))
    yield "matmul batched", lambda: matmul(a, b)
    # A 2-D a broadcast over b's batch: its gradient, the products' sum, summed in the
    # kernel's K loop (SUM_BATCH), into the gradient where its 128x128 tiles are at
    # least as many as an H100's SMs, else into FP32 partials, a part per product here.
    a2 = _tensor((8 * m, 2 * k), half, aligned).requires_grad_()
    b2 = _tensor((3, 2 * k, n), half, aligned).requires_grad_()
    yield "matmul batched, a broadcast", lambda: matmul(a2, b2)
    a3 = _tensor((m, k), half, aligned).requires_grad_()
    yield "matmul batched, a broadcast, in parts", lambda: matmul(a3, b)
    # FP32 operands (and, unaligned, 16-bit ones) take the pointer kernel, which sums
    # in its K loop too.
    a4 = _tensor((m, k), f32, aligned).requires_grad_()
    b4 = _tensor((3, k, n), f32, aligned).requires_grad_()
    yield "matmul batched fp32, a broadcast, in parts", lambda: matmul(a4, b4)
    # b broadcast over a's first batch dimension: its gradient sums over it and keeps
    # the second, a part per kept index (the pointer kernel).
    a5 = _tensor((2, 3, m, k), half, aligned).requires_grad_()
    yield "matmul batched, b broadcast over one dimension", lambda: matmul(a5, b)
    # Attention's scores on (batch, heads) views of (batch, tokens, heads, dim)
    # projections: two batch dimensions that do not merge, one launch (OUTER).
    q, kt = (_tensor((2, m, 3, k), half, aligned).transpose(1, 2) for _ in range(2))
    yield "matmul batched, transposed heads", lambda: matmul(q, kt.transpose(-1, -2))


def _detached(fn, *args, **kwargs) -> torch.Tensor:
    return fn(*args, **kwargs).detach()


def _scaling_workloads(spec: str) -> Iterator[tuple[str, object]]:
    """The launches GradScaler and the fused optimizers make."""
    from mpgemm.kernels.unscale import triton_unscale_
    from mpgemm.kernels.update_scale import triton_update_scale_

    aligned = spec == "aligned"
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    one = torch.ones((), dtype=f32)

    def tensors(dtype):
        return [_tensor((5000,), dtype, aligned) for _ in range(2)]

    for src, dst in ((f32, f32), (f16, f16), (bf16, bf16), (f16, f32), (bf16, f32)):
        yield (
            f"unscale {src} -> {dst}",
            lambda s=src, d=dst: triton_unscale_(tensors(s), torch.zeros(()), one, dst=tensors(d)),
        )
    for dtype in (f32, f16, bf16):
        yield f"check {dtype}", lambda d=dtype: triton_unscale_(tensors(d), torch.zeros(()), None)
    # GradScaler's, and LossScaleOptimizer's (its skipped steps counted, its flag
    # zeroed for reuse).
    updates = (("scale update", False), ("scale update, skips counted, flag zeroed", True))
    for name, lso in updates if aligned else ():
        yield (
            name,
            lambda lso=lso: triton_update_scale_(
                torch.ones(()),
                torch.zeros((), dtype=torch.int32),
                torch.zeros(()),
                2.0,
                0.5,
                2000,
                skipped_steps=torch.zeros((), dtype=torch.int64) if lso else None,
                clear_found_inf=lso,
            ),
        )
    # (parameter, gradient, compute copy): FP32 masters of mpgemm.Linear layers get
    # their 16-bit copy written in the step, in the launch that steps their biases,
    # which have none (listed as their own copy); None: no copy.
    for param, grad, copy in (
        (f32, f32, None),
        (f32, f16, None),
        (f32, bf16, None),
        (bf16, bf16, None),
        (f32, f32, f16),
        (f32, f32, bf16),
    ):
        name = f"{param} <- {grad}" + (f", copy {copy}" if copy else "")
        yield f"sgd {name}", functools.partial(_sgd_step, param, grad, copy, aligned)
        for decoupled in (False, True):
            yield (
                f"adam{'w' if decoupled else ''} {name}",
                functools.partial(_adam_step, param, grad, copy, aligned, decoupled),
            )
    # A tensor lr (and betas), read from its tensor in the kernel.
    name = f"{f32} <- {f32}, copy {f16}"
    yield (
        f"sgd {name}, tensor lr",
        functools.partial(_sgd_step, f32, f32, f16, aligned, tensor_hyperparameters=True),
    )
    yield (
        f"adamw {name}, tensor lr and betas",
        functools.partial(_adam_step, f32, f32, f16, aligned, True, tensor_hyperparameters=True),
    )
    # SGD with dampening: each program reads its tensor's step count too.
    yield (
        f"sgd {name}, dampening",
        functools.partial(_sgd_step, f32, f32, f16, aligned, dampening=0.5),
    )
    # Param groups in one launch: each program reads its tensor's row of the FP64 table.
    yield (
        f"sgd {name}, param groups",
        functools.partial(_sgd_step, f32, f32, f16, aligned, grouped=True),
    )
    yield (
        f"adamw {name}, param groups",
        functools.partial(_adam_step, f32, f32, f16, aligned, True, grouped=True),
    )
    # AMSGrad: a fourth tensor streamed (the maxima), with a copy written and without.
    for param, grad, copy in ((f32, f32, f16), (f32, f16, None)):
        name = f"{param} <- {grad}" + (f", copy {copy}" if copy else "")
        yield (
            f"adam {name}, amsgrad",
            functools.partial(_adam_step, param, grad, copy, aligned, False, amsgrad=True),
        )
    # The loss (mpgemm.cross_entropy), forward and backward: 1024 classes aligned, the
    # guide's 10 unaligned (rows of 40 bytes: no 16-byte loads).
    for dtype in (f32, f16, bf16):
        for reduction in ("mean", "none"):
            yield (
                f"cross_entropy {dtype} {reduction}",
                functools.partial(_cross_entropy, dtype, reduction, aligned),
            )


def _cross_entropy(dtype: torch.dtype, reduction: str, aligned: bool) -> torch.Tensor:
    from mpgemm.losses import cross_entropy

    logits = _tensor((256, 1024 if aligned else 10), dtype, aligned).requires_grad_()
    return cross_entropy(logits, torch.zeros(256, dtype=torch.int64), reduction=reduction)


def _step_lists(param, grad, copy, aligned: bool, states: int) -> tuple[list, list | None]:
    """([parameters, gradients, *states], compute copies) of a fused optimizer step on
    two tensors: a weight with a ``copy`` and a bias listed as its own (None: neither
    has one)."""
    lists = [[_tensor((5000,), dtype, aligned) for _ in range(2)] for dtype in (param, grad)]
    lists += [[_tensor((5000,), param, aligned) for _ in range(2)] for _ in range(states)]
    copies = None if copy is None else [_tensor((5000,), copy, aligned), lists[0][1]]
    return lists, copies


def _scaling_tensors() -> dict:
    return dict(grad_scale=torch.ones((), dtype=torch.float32), found_inf=torch.zeros(()))


def _hyperparameter(value: float, tensor: bool) -> float | torch.Tensor:
    return torch.tensor(value) if tensor else value


def _two_groups(**values: float) -> dict:
    """``groups``: two param groups of one tensor each, the second with half of each of
    ``values`` (as the launch takes them: mpgemm.scaling.ParamGroups)."""
    from mpgemm.scaling import ParamGroups

    halves = {name: value / 2 for name, value in values.items()}
    return {"groups": ParamGroups((values, halves), (1, 1))}


def _sgd_step(
    param,
    grad,
    copy,
    aligned: bool,
    grouped: bool = False,
    tensor_hyperparameters: bool = False,
    dampening: float = 0.0,
) -> None:
    from mpgemm.kernels.fused_optim import triton_sgd_step_

    lists, copies = _step_lists(param, grad, copy, aligned, states=1)
    triton_sgd_step_(
        *lists,
        steps=[torch.ones(()) for _ in range(2)] if dampening else None,
        lr=_hyperparameter(0.1, tensor_hyperparameters),
        momentum=0.9,
        dampening=dampening,
        weight_decay=0.0,
        nesterov=False,
        maximize=False,
        compute_copies=copies,
        **_scaling_tensors(),
        **(_two_groups(lr=0.1, momentum=0.9) if grouped else {}),
    )


def _adam_step(
    param,
    grad,
    copy,
    aligned: bool,
    decoupled: bool,
    tensor_hyperparameters: bool = False,
    amsgrad: bool = False,
    grouped: bool = False,
) -> None:
    from mpgemm.kernels.fused_optim import triton_adam_step_

    lists, copies = _step_lists(param, grad, copy, aligned, states=3 if amsgrad else 2)
    triton_adam_step_(
        *lists[:4],
        [torch.ones(()) for _ in range(2)],
        max_exp_avg_sqs=lists[4] if amsgrad else None,
        lr=_hyperparameter(1e-3, tensor_hyperparameters),
        beta1=_hyperparameter(0.9, tensor_hyperparameters),
        beta2=_hyperparameter(0.999, tensor_hyperparameters),
        eps=1e-8,
        weight_decay=0.01,
        decoupled_weight_decay=decoupled,
        maximize=False,
        compute_copies=copies,
        **_scaling_tensors(),
        **(_two_groups(lr=1e-3, eps=1e-8, weight_decay=0.01) if grouped else {}),
    )


@dataclass(frozen=True)
class Job:
    """One binary to compile: a launch's kernel, arguments and config, by description;
    jobs are rebuilt in the worker that compiles them (tensors do not travel)."""

    group: str  # "gemm" or "scaling"
    dtype: str  # compute dtype of the GEMM workloads
    spec: str
    workload: int
    launch: int
    config: int | None
    pdl: bool = False  # launched with programmatic dependent launch


def _workloads(group: str, dtype: str, spec: str):
    if group == "gemm":
        return list(_gemm_workloads(getattr(torch, dtype), spec))
    return list(_scaling_workloads(spec))


def _launches(run) -> list[tuple]:
    """The launches ``run`` makes, intercepted: (kernel, grid, args, kwargs, configs,
    phase), phase "forward" or "backward"."""
    from mpgemm import functional

    made = []
    phase = "forward"

    def keep(kernel, grid, args, kwargs, configs):
        made.append((kernel, grid, args, kwargs, configs(), phase))

    # The ReLU's backward fused into the next layer's input gradient too, which is off
    # by default (functional._FUSE_RELU), so that its launches are compiled as well.
    fuse, functional._FUSE_RELU = functional._FUSE_RELU, True
    try:
        with intercept(keep):
            out = run()
            if isinstance(out, torch.Tensor) and out.requires_grad:
                phase = "backward"
                out.backward(torch.empty_like(out))
    finally:
        functional._FUSE_RELU = fuse
    return made


_GEMMS = ("_gemm_kernel", "_gemm_tma_kernel")
# The workloads of a layer after a ReLU layer compile only the input gradient that takes
# the ReLU's backward: their other launches are other workloads' (a third of the
# binaries more, compiled twice).
_AFTER_A_RELU = ("after a ReLU", "after a ReLU, batch 8192")
_ELEMENTWISE = ("_unscale_kernel", "_sgd_kernel", "_adam_kernel")

# A head's loss, which the GEMM workloads run for the gradient it lays out; the scaling
# group compiles these (their logits there have rows that vector loads can read).
_LOSSES = ("_cross_entropy_forward_kernel", "_cross_entropy_backward_kernel")


def _operand(named: dict, name: str) -> torch.Tensor:
    # The pointer kernel's a_ptr, or the tensor the TMA kernel's a_desc describes.
    return named[f"{name}_ptr"] if f"{name}_ptr" in named else named[f"{name}_desc"].base


def _layout(phase: str, named: dict) -> str:
    # The weight gradient's A is dY.T, a transposed view: unit stride down its columns
    # (the TMA kernel describes it as dY, A_T).
    if phase == "forward":
        return "forward"
    transposed = named["A_T"] if "A_T" in named else named["stride_am"] == 1
    return "grad_weight" if transposed else "grad_input"


def jobs() -> list[Job]:
    found = []
    # Each kernel's first launch (aligned) once more with PDL: the wait's place is the
    # kernel's, whatever the config or the launch.
    first: dict[str, Job] = {}
    for group, dtypes in (("gemm", ("float16", "bfloat16")), ("scaling", ("-",))):
        for dtype in dtypes:
            for spec in SPECIALIZATIONS:
                for w, (label, run) in enumerate(_workloads(group, dtype, spec)):
                    for i, (kernel, _, _, kwargs, configs, _) in enumerate(_launches(run)):
                        if group == "gemm" and jit_function(kernel).fn.__name__ in _LOSSES:
                            continue
                        if label.endswith(_AFTER_A_RELU) and not kwargs.get("RELU_GRAD"):
                            continue
                        for c in range(len(configs)) if configs else (None,):
                            found.append(Job(group, dtype, spec, w, i, c))
                        if spec == "aligned":
                            first.setdefault(jit_function(kernel).fn.__name__, found[-1])
    return found + [dataclasses.replace(job, pdl=True) for job in first.values()]


# -- compiling and reading the binary ---------------------------------------------------


def resource_usage(cubin: bytes) -> dict:
    """Registers and stack frame bytes per thread of the binary the JIT assembled, as
    ``cuobjdump --dump-resource-usage`` (in the triton wheel) reads them from the cubin.
    A spilled register lives in the stack frame, and triton's kernels keep no arrays in
    local memory, so a frame of 0 bytes means no spills (ptxas's log, which gives the
    spills themselves, is discarded by triton's compile, and a second ptxas run without
    the JIT's options may assemble a different binary)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    registers = re.search(r"\bREG:(\d+)", usage)
    stack = re.search(r"\bSTACK:(\d+)", usage)
    if registers is None or stack is None:
        raise RuntimeError(f"cuobjdump gave no registers or stack size:\n{usage}")
    return {"registers": int(registers.group(1)), "stack_bytes": int(stack.group(1))}


# FP32 operations that round differently from torch's: approximate division, square
# root, reciprocal, or flushing denormals to zero.
_APPROX_FP32 = re.compile(
    r"\b(div\.(approx|full)|sqrt\.approx|rcp\.approx)[.\w]*\.f32\b"
    r"|\b(add|sub|mul|fma)\.\w*ftz\w*\.f32\b"
)
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# An instruction that reads or writes global memory (loads, stores, atomics, cp.async
# and TMA copies from or to it), and the wait for the prior grid.
_GLOBAL_ACCESS = re.compile(r"^\s*(@!?%p\d+\s+)?(ld|st|atom|red|cp|multimem)\.[\w.:]*global", re.M)
_GRID_WAIT = re.compile(r"^\s*griddepcontrol\.wait\b", re.M)


def waits_first(ptx: str) -> bool:
    """Whether the entry's first global memory access comes after its wait for the prior
    grid (programmatic dependent launch), in the PTX's order. The wait opens every
    mpgemm kernel, before any branch, so the order of the text is the order run."""
    body = ptx[ptx.index(".entry") :]
    wait = _GRID_WAIT.search(body)
    access = _GLOBAL_ACCESS.search(body)
    return wait is not None and (access is None or wait.start() < access.start())


def ptx_facts(ptx: str) -> dict:
    """What the PTX says about the main loop's overlap and the loads, and about the
    launch's dependence on the prior grid."""
    pending = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)]
    return {
        "wgmma": "wgmma.mma_async" in ptx,
        "wgmma_pending": max(pending) if pending else None,
        "cp_async": bool(re.search(r"\bcp\.async\.(ca|cg)\b", ptx)),
        "tma": "cp.async.bulk.tensor" in ptx,
        "vector_loads": len(re.findall(r"ld\.global(\.\w+)*\.v[24]\.", ptx)),
        "approx_fp32": sorted({m.group(0) for m in _APPROX_FP32.finditer(ptx)}),
        "waits_first": waits_first(ptx),
        "launches_dependents": "griddepcontrol.launch_dependents" in ptx,
    }


def compile_job(job: Job) -> dict:
    label, run = _workloads(job.group, job.dtype, job.spec)[job.workload]
    dependent_launch.enable(job.pdl)
    try:
        kernel, grid, args, kwargs, configs, phase = _launches(run)[job.launch]
    finally:
        dependent_launch.enable(False)
    config = None if job.config is None else configs[job.config]
    named = named_arguments(kernel, args, kwargs)
    start = time.perf_counter()
    [compiled] = compile_for_hopper(kernel, grid, args, kwargs, lambda: [config] if config else [])
    seconds = time.perf_counter() - start
    ptx = compiled.asm["ptx"]
    name = jit_function(kernel).fn.__name__
    report = {
        "kernel": name,
        "launch": label if job.group == "scaling" else f"{label} {job.dtype}",
        "layout": _layout(phase, named) if name in _GEMMS else None,
        "specialization": job.spec,
        "config": str(config) if config is not None else None,
        "smem_bytes": compiled.metadata.shared,
        "compile_s": round(seconds, 2),
        "pdl": bool(compiled.metadata.launch_pdl),
        # Values moved between thread layouts through shared memory, with barriers.
        "layout_conversions": compiled.asm["ttgir"].count("ttg.convert_layout"),
        **ptx_facts(ptx),
        **resource_usage(compiled.asm["cubin"]),
    }
    if name in _GEMMS:
        report.update(
            a_dtype=_DTYPE_NAMES[_operand(named, "a").dtype],
            b_dtype=_DTYPE_NAMES[_operand(named, "b").dtype],
            flags={k: v for k, v in kwargs.items() if k.isupper()},
        )
        report["ok"] = (
            report["wgmma"] and report["stack_bytes"] == 0 and report["smem_bytes"] <= SMEM_BYTES
        )
    else:
        # The loss-scaling kernels and the activation's backward walk whole aligned
        # blocks: their loads must be 16 bytes wide (the scale update and split-K's
        # reduction have no such blocks).
        streams = name not in ("_update_scale_kernel", "_split_k_reduce_kernel")
        vectorised = report["vector_loads"] > 0 or job.spec == "unaligned" or not streams
        # The table kernels are elementwise: every list in one layout (narrow_pointers).
        one_layout = name not in _ELEMENTWISE or report["layout_conversions"] == 0
        report["ok"] = (
            report["stack_bytes"] == 0 and not report["approx_fp32"] and vectorised and one_layout
        )
    if job.pdl:
        report["ok"] = (
            report["ok"]
            and report["pdl"]
            and report["waits_first"]
            and report["launches_dependents"]
        )
    return report


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("mpgemm.kernels.aot: unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    todo = jobs()
    # Compiles are independent and CPU-bound: one process per core, spawned (a fork
    # would inherit the autograd engine's threads that ``jobs`` started).
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=spawn) as pool:
        reports = list(pool.map(compile_job, todo, chunksize=8))
    for report in reports:
        print(json.dumps(report))
    defects = sum(not report["ok"] for report in reports)
    print(
        f"{len(reports)} kernels compiled for sm_90a, {defects} with a defect (GEMM: no "
        "wgmma, a stack frame (spills) or too much shared memory; streaming: a stack frame, "
        "approximate FP32 math, scalar loads)"
    )
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
