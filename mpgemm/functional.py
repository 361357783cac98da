"""``mpgemm.matmul`` and ``mpgemm.linear``: checks, dispatch and the autograd function.

Both ops run through ``LinearFunction``: ``matmul(a, b)`` with a 2-D ``b`` is
``linear(a, b.T)`` on a transposed view, so one forward and one backward serve both; a
batched ``b`` takes ``BatchedMatmulFunction``, a batch of products. A layer's activation
adds ``ActivationFunction`` to the graph, for its derivative. A backward under
``create_graph=True`` is recorded, differentiable again (``_implementation``), and
under forward-mode AD each Function's subclass with a ``jvp`` rule takes its place
(``_Function.apply``). A product of two 16-bit matrices that ``matmul`` has made before
without autograd goes from its entry to the replay of its launches (``_replay_key``),
past the checks and layers between.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
from torch._functorch.utils import unwrap_dead_wrappers
from torch.autograd import forward_ad
from torch.overrides import handle_torch_function, has_torch_function_variadic

from mpgemm.reference import activation_backward_ref, compute_dtype_for, gemm_ref

COMPUTE_DTYPES = (torch.float16, torch.bfloat16)
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
VALID_ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
# Activations whose backward takes act'(z) from z, which the forward's epilogue stores
# beside the output, in its dtype, as torch's activations keep their input (ReLU's
# reads its output).
SAVES_PREACTIVATION = ("gelu", "gelu_tanh", "silu")


# Each op's reference (torch ops) and the module and name of its Triton launcher,
# imported on first use (triton may not be installed: CPU tensors still run the
# references).
_OPS: dict[str, tuple[Callable, str, str]] = {
    "gemm": (gemm_ref, "mpgemm.kernels.gemm", "triton_gemm"),
    "activation_backward": (
        activation_backward_ref,
        "mpgemm.kernels.activation",
        "triton_activation_backward",
    ),
}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# What makes mpgemm.kernels.launches intercept from its import on (see there).
_INTERCEPT_ENV = ("MPGEMM_RECORD_LAUNCHES", "MPGEMM_PRECOMPILE")


def _intercepting() -> bool:
    # Only launches.py intercepts: until it is imported (or its environment asks for
    # it), nothing is, and the reference path imports no triton module to learn that.
    if "mpgemm.kernels.launches" not in sys.modules and not any(
        os.environ.get(name) for name in _INTERCEPT_ENV
    ):
        return False
    try:
        from mpgemm.kernels.launches import intercepting
    except ImportError:
        return False
    return intercepting()


def backend(device: torch.device | str) -> str:
    """Which implementation runs tensors on ``device`` (a ``torch.device`` or a string
    such as ``"cuda:0"``): ``"triton"`` (compiled for CUDA, or interpreted on the CPU
    when ``TRITON_INTERPRET=1``) or ``"reference"``. While launches are intercepted
    (``mpgemm.kernels.launches``) nothing runs, and CPU tensors take the kernel path too.
    A GPU older than Ampere (compute capability below 8.0) takes the reference path,
    with a warning, once per GPU (``MIN_CAPABILITY``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return "triton" if _kernels_run_on(device.index) else "reference"
    if device.type == "cpu" and (_interpreting() or _intercepting()):
        return "triton"
    return "reference"


# The oldest GPUs the kernels run on, as Triton supports them: from Triton 3.3 on, Volta
# and Turing get no Tensor Core MMA (a dot falls back to FMAs; triton-lang/triton#5066),
# and Turing has no BF16 MMA at all.
MIN_CAPABILITY = (8, 0)


def _kernels_run_on(index: int | None) -> bool:
    """Whether CUDA device ``index`` (None: the current one) runs the kernels."""
    if index is None:
        if not torch.cuda.is_available():  # no CUDA tensors to run: nothing to ask
            return True
        index = torch.cuda.current_device()
    return _capable(index)


@functools.cache
def _capable(index: int) -> bool:
    # Asked once per device: a tensor's device always has its index.
    if not torch.cuda.is_available():  # a device named where there is none
        return True
    capability = torch.cuda.get_device_capability(index)
    if capability >= MIN_CAPABILITY:
        return True
    warnings.warn(
        f"mpgemm: cuda:{index} ({torch.cuda.get_device_name(index)}) has compute capability "
        f"{capability[0]}.{capability[1]}, below the {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
        "(Ampere) that mpgemm's kernels need; its tensors take the reference "
        "implementation (torch ops, the same numerics, without the kernels' speed)",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


# The only tensor types that reach the kernels, which read memory from ``data_ptr``.
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def _wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor a ``torch.func`` transform wraps (batched by ``vmap``,
    tracked by ``grad``), or one batched by autograd's ``is_grads_batched`` (the
    gradients a backward gets from ``torch.autograd.grad(..., is_grads_batched=True)``
    and ``torch.autograd.functional.jacobian(..., vectorize=True)``, torch's older
    vmap): either way a tensor of type ``torch.Tensor`` with no memory of its own."""
    return _functorch_wrapped(t) or _legacy_batched(t)


def read_otherwise(t: torch.Tensor) -> bool:
    """Whether ``t``'s values are not its memory's, as a kernel would read them: a
    negative view (its values the negation of its memory's: ``z.conj().imag`` of a
    complex ``z``, whose product the kernels computed with the wrong sign), or a zero
    tensor (all zeros, with no memory: a gradient some torch ops return)."""
    return t.is_neg() or t._is_zerotensor()


def write_refused(t: torch.Tensor) -> bool:
    """Whether torch's in-place ops refuse to write ``t`` here: an inference tensor
    (made under ``torch.inference_mode``, with no version counter for autograd to
    check) outside that mode, which the kernels, writing memory, would write."""
    return t.is_inference() and not torch.is_inference_mode_enabled()


def is_plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.Tensor`` or ``nn.Parameter`` and no other subclass,
    nor a wrapped or batched tensor (``_wrapped``: no memory of its own to read), nor
    one whose values are not its memory's (``read_otherwise``). Any other (a DTensor,
    a user's subclass, a wrapped tensor, a negative view) takes the reference path,
    whose torch ops it handles."""
    return type(t) in PLAIN_TYPES and not _wrapped(t) and not read_otherwise(t)


def _gemm(device: torch.device, *tensors: torch.Tensor | None) -> Callable:
    """The GEMM for these tensors: under ``torch.compile``, the custom op
    (``mpgemm.ops``), which runs the same implementation opaquely."""
    if torch.compiler.is_compiling():
        from mpgemm.ops import gemm

        return gemm
    return _implementation(device, *tensors)


def _implementation(
    device: torch.device, *tensors: torch.Tensor | None, op: str = "gemm"
) -> Callable:
    """Op ``op``'s implementation for these tensors: its reference (torch ops) on the
    reference backend, for a tensor subclass, or where autograd records the op, else
    its Triton kernel. Autograd records an op only in a backward (a Function's forward
    runs with grad mode off, and a product it does not record skips the Function), and
    only under ``create_graph=True`` (or a ``torch.func`` transform): the backward's
    torch ops are then differentiable again, as torch's layers' backwards are (a
    gradient penalty, a Hessian-vector product, ``grad`` of ``grad``), to any order.
    Its GEMMs are ``matmul``'s (``_RECORDED``): the kernels compute them, and autograd
    records them as the Functions it differentiates again. Derivatives through the
    roundings to the compute dtype are rounded there too, as under ``torch.autocast``."""
    recorded = False
    recording = torch.is_grad_enabled()
    for t in tensors:
        if t is not None:
            if not is_plain(t):
                return _OPS[op][0]
            recorded = recorded or (recording and t.requires_grad)
    if recorded:
        return _RECORDED.get(op, _OPS[op][0])
    if backend(device) == "reference":
        return _OPS[op][0]
    try:
        return _launcher(op)
    except ImportError:
        raise RuntimeError(
            f"mpgemm: tensors on {device} need triton, which is not installed"
        ) from None


@functools.cache
def _launcher(op: str) -> Callable:
    """Op ``op``'s Triton launcher, imported once (asked on every launch)."""
    _, module, launcher = _OPS[op]
    return getattr(importlib.import_module(module), launcher)


# ---------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------


def _check_compute_dtype(op: str, compute_dtype: torch.dtype) -> None:
    # (isinstance first: ``in`` would compare a tensor given here with each dtype)
    if not isinstance(compute_dtype, torch.dtype) or compute_dtype not in COMPUTE_DTYPES:
        raise TypeError(
            f"{op}: compute_dtype must be torch.float16 or torch.bfloat16, got {compute_dtype}"
        )


def _check_out_dtype(op: str, out_dtype: torch.dtype | None) -> None:
    if out_dtype is not None and (
        not isinstance(out_dtype, torch.dtype) or out_dtype not in INPUT_DTYPES
    ):
        raise TypeError(
            f"{op}: out_dtype must be None, torch.float32, torch.float16 or torch.bfloat16, "
            f"got {out_dtype}"
        )


def _check_activation(op: str, activation: str | None) -> None:
    if activation not in VALID_ACTIVATIONS:
        raise ValueError(
            f"{op}: unknown activation {activation!r}; valid ones are {VALID_ACTIVATIONS}"
        )


def _check_not_jit_traced(op: str) -> None:
    """RuntimeError under ``torch.jit.trace``, which would record the kernels' launches
    as constants of one call (and the layer's cached compute copy of its weight as a
    constant tensor), where ``torch.export`` and ``torch.compile`` record mpgemm's
    custom ops."""
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"{op}: torch.jit.trace cannot record mpgemm's kernels; export the model with "
            "torch.export.export (or compile it with torch.compile), which record mpgemm's "
            "custom ops"
        )


_OPTIONAL = ("bias", "out")


def _check_tensors(op: str, **tensors: torch.Tensor | None) -> None:
    """Each tensor must be a dense float32/float16/bfloat16 tensor, all on one device;
    only a bias and an out may be None. (One pass over them, asked by every call; a
    type or dtype is named before devices, as a check of each in turn would.)"""
    device = None
    mixed = False
    for name, t in tensors.items():
        if t is None and name in _OPTIONAL:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(
                f"{op}: {name} is a {t.layout} tensor; only dense (torch.strided) tensors are "
                "supported (call .to_dense() first)"
            )
        if t.is_nested:  # (torch.strided too; it has no sizes of its own)
            raise TypeError(
                f"{op}: {name} is a nested tensor; only dense tensors are supported (call "
                ".to_padded_tensor(0.0) first, or multiply its components one by one)"
            )
        if t.dtype not in INPUT_DTYPES:
            raise TypeError(
                f"{op}: {name} has dtype {t.dtype}; supported are torch.float32, "
                "torch.float16 and torch.bfloat16"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            mixed = True
    if mixed:
        listing = ", ".join(f"{name} on {t.device}" for name, t in tensors.items() if t is not None)
        raise ValueError(f"{op}: tensors must be on one device, got {listing}")


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """(*, K) -> (prod(*), K), a view where the strides allow (``t`` itself when 2-D);
    explicit sizes because reshape(-1, 0) is ambiguous for zero-size tensors."""
    if t.dim() == 2:
        return t
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


# ---------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------


def _linear_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
    weight_copy: torch.Tensor | None,
    store_preact: bool,
    x_rounded: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``LinearFunction``'s forward without autograd: (y, G or None). ``x_rounded``:
    None, or x as (prod(*), K) rounded to the compute dtype, which the GEMM then reads."""
    gemm = _gemm(x.device, x, weight, bias, weight_copy)
    x2d = _as_rows(x) if x_rounded is None else x_rounded
    w = weight if weight_copy is None else weight_copy
    out, preact, _ = gemm(
        x2d,
        w.t(),
        compute_dtype=compute_dtype,
        out_dtype=out_dtype,
        bias=bias,
        activation=activation,
        store_preact=store_preact,
    )
    if x.dim() != 2:  # (*, N) views of the (M, N) results
        shape = (*x.shape[:-1], weight.shape[0])
        # Detached: a tensor of its own over C's memory. A view of a tensor made in
        # LinearFunction's forward may not be changed in place (autograd forbids it);
        # nn.Linear's output may.
        out = out.view(shape).detach()
        preact = None if preact is None else preact.view(shape)
    return out, preact


class _Function(torch.autograd.Function):
    """An autograd Function in ``setup_context`` form, which ``torch.func``'s transforms
    need, applied outside a transform as one in the older form is: torch's ``apply``
    binds the arguments to ``forward``'s signature (``inspect``) on every call of a
    Function with ``setup_context``: 14 us a call here, where the rest of an apply of
    a small Function costs 7. Callers pass every argument, so there is nothing to
    bind."""

    # The same Function with a ``jvp`` rule, applied in its place under forward-mode AD:
    # dynamo cannot trace a Function that defines ``jvp`` (a graph break).
    forward_mode: type[_Function] | None = None

    @classmethod
    def apply(cls, *args):
        function = cls
        transformed = torch._C._are_functorch_transforms_active()
        # (The common case, neither a transform nor a forward-AD level, asks no more.)
        if (transformed or forward_ad._current_level >= 0) and _forward_ad_active():
            function = cls.forward_mode or cls
        if transformed:
            return super(_Function, function).apply(*args)  # noqa: UP008 (not cls)
        # What torch's apply does outside a transform, less the binding.
        return super(torch.autograd.Function, function).apply(*unwrap_dead_wrappers(args))


class LinearFunction(_Function):
    """act(x @ W.T + bias) with 16-bit operands and FP32 accumulation: the layer's GEMMs.
    With an activation and a gradient to compute, ``ActivationFunction`` follows it in
    the graph (``_linear``) and owns the derivative and the bias gradient.

    x: (*, K) float32/float16/bfloat16; W: (N, K), any strides; bias: (N,) or None;
    weight_copy: None, or W in the compute dtype (``mpgemm.Linear``'s current copy of
    its FP32 master), which the GEMMs then read in W's place; store_preact: also
    return G = z in the output's dtype (GELU's or SiLU's input, for ``ActivationFunction``);
    x_rounded: None, or x as (prod(*), K) rounded to the compute dtype (no gradient),
    which the GEMMs then read in x's place (the caller rounds an FP32 x whose weight
    gradient is needed: the GEMMs would round it anyway, and it is half the memory).
    Forward: one GEMM with bias, activation and the output cast in the epilogue; returns
    (y, G or None).
    Backward, from the gradient at its output (dZ where an activation's node precedes
    it, dY otherwise): dx = dZ @ W (in x's dtype) and dW = dZ.T @ x (in W's dtype, FP32
    for master weights, laid out like W), with the bias gradient, the FP32 column sums
    of dZ, computed by the dW GEMM as it reads dZ (where the TMA kernel runs it, which
    fuses no sums, by one pass beforehand).

    In ``setup_context`` form, so that ``torch.func``'s transforms apply (``grad``,
    ``vjp``, ``vmap``, ``jacrev``, per-sample gradients), with a rule of its own for
    ``vmap`` (``vmap``). The backward under a transform sees wrapped tensors, which take
    the reference path (``is_plain``).
    """

    forward = staticmethod(_linear_forward)

    @staticmethod
    def vmap(info, in_dims, *args):
        """Under ``torch.vmap``: with only x batched (per-sample gradients' forward), the
        batch joins x's rows and the kernels run as for any (*, K) input; with a batched
        weight or bias (an ensemble), one apply per batch entry. Each apply's tensors
        are the level's own, so their kernels run too."""
        x_dim, rounded_dim = in_dims[0], in_dims[8]
        if x_dim is not None and all(d is None for i, d in enumerate(in_dims) if i not in (0, 8)):
            x, x_rounded = args[0].movedim(x_dim, 0), args[8]
            if x_rounded is not None:  # (prod(*), K) each: (batch x prod(*), K)
                x_rounded = x_rounded.movedim(rounded_dim, 0).flatten(0, 1)
            out, preact = LinearFunction.apply(x, *args[1:8], x_rounded)
            return (out, preact), (0, None if preact is None else 0)
        entries = [
            LinearFunction.apply(
                *(a if d is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True))
            )
            for i in range(info.batch_size)
        ]
        outs, preacts = zip(*entries, strict=True)
        preact = None if preacts[0] is None else torch.stack(preacts)
        return (torch.stack(outs), preact), (0, None if preact is None else 0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, _, compute_dtype, _, weight_copy, _, x_rounded = inputs
        if output[1] is not None:
            # G is z, as y is to autograd here: differentiable, for a backward under
            # create_graph whose activation derivative reads it (``ActivationFunction``);
            # its gradient, if any, is added to y's. Not when compiled, where a double
            # backward is not supported and a traced gradient for it could be zeros.
            if torch.compiler.is_compiling():
                ctx.mark_non_differentiable(output[1])
            # Else autograd hands the backward a gradient for G made of zeros: an FP32
            # tensor of the layer's output shape, filled at every step, that it ignores.
            ctx.set_materialize_grads(False)
        # What the GEMMs read: x (or its rounding) and W (or its copy).
        ctx.save_for_backward(
            x if x_rounded is None else x_rounded, weight if weight_copy is None else weight_copy
        )
        ctx.x_shape, ctx.x_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        ctx.compute_dtype = compute_dtype
        ctx.has_bias = bias is not None
        # The node of the activation whose output x is, and x weakly, for _fusable_relu
        # (not traced: a compiled backward is one op, which fuses nothing).
        ctx.activation_output = None
        if not torch.compiler.is_compiling():
            node = x.grad_fn
            if type(node) is ActivationFunction._backward_cls:
                ctx.activation_output = (node, weakref.ref(x))
        # A backward under create_graph differentiates the weight, not its copy.
        ctx.weight = None if weight_copy is None else weight

    @staticmethod
    def backward(ctx, grad_z, grad_preact):
        if grad_preact is not None:  # (the backward of a create_graph one reached G)
            grad_z = grad_preact if grad_z is None else grad_z + grad_preact
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled() and ctx.weight is not None:  # (create_graph)
            weight = ctx.weight
        # Compiled, the whole backward is one op (mpgemm.ops.linear_backward), which
        # runs this same function: its choices (the bias gradient fused or not) need the
        # real tensors.
        backward = _linear_backward
        relu = None
        if torch.compiler.is_compiling():
            from mpgemm.ops import linear_backward as backward
        elif need_x and ctx.activation_output is not None:
            relu = _fusable_relu(*ctx.activation_output, x, grad_z, weight)
        if relu is not None:
            # x's gradient at the ReLU's input, for its node to pass on (ActivationFunction).
            fused_x, sums = _input_gradient(
                _implementation(grad_z.device, grad_z, x, weight),
                _as_rows(grad_z),
                weight,
                x_shape=ctx.x_shape,
                x_dtype=ctx.x_dtype,
                compute_dtype=ctx.compute_dtype,
                relu_output=_as_rows(x),
                column_sums=relu.needs_input_grad[2],
            )
            relu.fused = (fused_x, fused_x._version, sums)
        grad_x, grad_w, grad_b = backward(
            grad_z,
            _as_rows(x),
            weight,
            x_shape=ctx.x_shape,
            x_dtype=ctx.x_dtype,
            weight_dtype=ctx.weight_dtype,
            compute_dtype=ctx.compute_dtype,
            need_x=need_x and relu is None,
            need_w=need_w,
            need_b=need_b and ctx.has_bias,
        )
        if relu is not None:
            grad_x = fused_x
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class _LinearWithJvp(LinearFunction):
    """``LinearFunction`` with its forward-mode rule, applied in its place under
    forward-mode AD (``_Function.apply``)."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        LinearFunction.setup_context(ctx, inputs, output)
        x, weight, *_, x_rounded = inputs
        ctx.save_for_forward(x if x_rounded is None else x_rounded, weight)
        ctx.out_dtype, ctx.has_preact = output[0].dtype, output[1] is not None

    @staticmethod
    def jvp(ctx, x_t, w_t, b_t, *_):
        """Forward-mode AD: z's tangent, x_t @ W.T + x @ w_t.T + b_t, each product of
        rounded operands in FP32 as the forward's, rounded once to the output's dtype,
        for y (which is z to autograd here: ``ActivationFunction`` follows) and G."""
        x, weight = ctx.saved_tensors
        rows = _as_rows(x)
        products = [] if x_t is None else [(_as_rows(x_t), weight)]
        if w_t is not None:
            products.append((rows, w_t))
        z_t = rows.new_zeros(rows.shape[0], weight.shape[0], dtype=torch.float32)
        for a, b in products:
            gemm = _gemm(a.device, a, b)
            p, _, _ = gemm(a, b.t(), compute_dtype=ctx.compute_dtype, out_dtype=torch.float32)
            z_t = z_t + p
        if b_t is not None:
            z_t = z_t + b_t
        z_t = z_t.view(*ctx.x_shape[:-1], weight.shape[0]).to(ctx.out_dtype)
        return z_t, z_t if ctx.has_preact else None


LinearFunction.forward_mode = _LinearWithJvp


# Whether a ReLU's backward may run in the epilogue of the GEMM that makes its output's
# gradient (``_fusable_relu``); off, each ReLU's node runs its own kernel. Off: on an
# H200 (run13, bench/results/h200-2026-11-27) the fused epilogue made the guide MLP's
# 4096-wide input gradient 566.9 us where the plain GEMM took 370.8 and the ReLU's own
# kernel 54.8, the head's 149.4 where they took 35.6 and 54.8, and the graphed guide
# step 1913 us where it took 1740 unfused (bench/ab_graph.py; the small MLP's 56.1 us
# against 57.6). The fused path stays for A/Bs, its tests and its compile check.
_FUSE_RELU = False


def _fusable_relu(
    node, output: weakref.ref, x: torch.Tensor, grad_z: torch.Tensor, weight: torch.Tensor
):
    """``node``, the node of the activation (``ActivationFunction``) whose ``output``
    was ``LinearFunction``'s input, if a ReLU whose backward may run in the GEMM that
    makes x's gradient (``_input_gradient``: the mask in its epilogue, and the ReLU's
    bias gradient, C's column sums, with it), else None. ``x``: that input as saved,
    which must be the output itself: not a rounding, nor a tensor a saved-tensor hook
    unpacked (checkpointing's recomputation, an offload's copy), which autograd gives
    the node as its ``grad_fn`` but whose hooks, kept on the node, it cannot show.

    The gradient at y = x then exists nowhere, so only where nothing could read it: y
    has no tensor hooks and does not retain its gradient (a module's backward hooks put
    a node of their own between, and FSDP's and ``register_multi_grad_hook``'s are
    tensor hooks), and the tensors are plain (not traced or transformed) and not recorded
    (``create_graph``). The ReLU's node takes the result only if it is handed that very
    tensor, unchanged: where y has other consumers autograd adds their gradients into a
    new tensor (or into this one, bumping its version), which that node then masks
    itself, as before (the mask is idempotent). Node hooks (``register_prehook``) on the
    ReLU's node would see the masked gradient. Saves the 64 MB read of dY and y and the
    64 MB write of dZ of the ReLU's own kernel at the guide MLP's 8192 x 4096, for a
    read of y in the GEMM's epilogue."""
    if not _FUSE_RELU or output() is not x or x.grad_fn is not node:
        return None
    if getattr(node, "activation", None) != "relu" or x.retains_grad or x._backward_hooks:
        return None
    if torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
        return None  # (create_graph records the reference path; a transform's tensors)
    if not all(map(is_plain, (x, grad_z, weight))):
        return None
    return node


def _records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a graph for an op on ``tensors``: grad mode is on and
    one of them requires grad."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def _forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open: eager autograd's (``dual_level``) or a
    ``torch.func`` ``jvp`` transform's (``jvp``, ``jacfwd``, ``hessian``)."""
    if forward_ad._current_level >= 0:
        return True
    if not torch._C._are_functorch_transforms_active():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


def _autograd_idle(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records nothing of an op on ``tensors``: no graph
    (``_records_grad``), no forward-AD level open, no functorch transform active, and
    not being compiled (dynamo traces ``LinearFunction`` itself)."""
    if torch.compiler.is_compiling() or _records_grad(*tensors):
        return False
    # forward_ad's level is -1 outside every dual_level(): the Function then raises for
    # want of a jvp, where its forward alone would drop the tangents.
    return forward_ad._current_level < 0 and not torch._C._are_functorch_transforms_active()


def _linear_function(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
    weight_copy: torch.Tensor | None = None,
    store_preact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``LinearFunction.apply``, or, where autograd records nothing (inference, a
    no-grad product), its forward alone: ``Function.apply`` cost 8 of an eager 512^2
    ``mpgemm.matmul``'s 43 us of host time (``bench/host_time.py``)."""
    args = (x, weight, bias, activation, compute_dtype, out_dtype, weight_copy, store_preact)
    if _autograd_idle(x, weight, bias):
        return _linear_forward(*args, None)
    # An FP32 x that the weight gradient needs is rounded once, here: the GEMMs read
    # the rounding and the backward keeps it (half the memory). Recorded where x
    # requires grad, for a backward under create_graph to differentiate (x's gradient
    # is LinearFunction's, unrounded: none reaches the cast).
    x_rounded = None
    if x.dtype == torch.float32 and weight.requires_grad and torch.is_grad_enabled():
        x_rounded = _as_rows(x if x.requires_grad else x.detach()).to(compute_dtype)
    return LinearFunction.apply(*args, x_rounded)


def _broadcast_batch(x: Sequence[int], y: Sequence[int]) -> tuple[int, ...]:
    """``torch.broadcast_shapes(x, y)`` (RuntimeError where they do not broadcast), by
    its rule for sizes that are plain integers: torch's runs its symbolic-shape
    machinery even for those, twice an eager batched ``matmul``'s call, a third of its
    host time (``bench/host_time.py``'s stub). Symbolic sizes (traced) take torch's."""
    if not all(type(d) is int for d in (*x, *y)):
        return tuple(torch.broadcast_shapes(x, y))
    if len(x) < len(y):
        x, y = y, x
    out = list(x)
    for i, d in enumerate(y, len(x) - len(y)):
        if out[i] == 1:
            out[i] = d
        elif d != 1 and d != out[i]:
            raise RuntimeError(f"shapes {tuple(x)} and {tuple(y)} do not broadcast")
    return tuple(out)


def _batched_product(
    a: torch.Tensor,
    b: torch.Tensor,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
    like: torch.Tensor | None = None,
) -> torch.Tensor:
    """round(a) @ round(b) for (*, M, K) and (*, K, N) operands whose batch shapes
    broadcast, FP32 accumulation: (*batch, M, N) of ``out_dtype``, a batch of GEMMs
    over the operands' broadcast views (no copies). With ``like``, a gradient for it:
    summed to its shape where it was broadcast (in FP32, rounded once) and of its
    dtype: the batch dimensions it was broadcast over go last, and the kernels sum the
    products over them (``sum_batch``), keeping the others."""
    batch = _broadcast_batch(a.shape[:-2], b.shape[:-2])
    shape = (*batch, a.shape[-2], b.shape[-1])
    a, b = a.expand(*batch, *a.shape[-2:]), b.expand(*batch, *b.shape[-2:])
    gemm = _gemm(a.device, a, b)
    if like is None or tuple(like.shape) == shape:
        product, _, _ = gemm(a, b, compute_dtype=compute_dtype, out_dtype=out_dtype)
        return product
    # like's batch sizes, aligned with the batch's (its missing leading ones are 1).
    sizes = (1,) * (len(batch) + 2 - like.dim()) + tuple(like.shape[:-2])
    summed = [i for i, (n, m) in enumerate(zip(sizes, batch, strict=True)) if n == 1 != m]
    if not summed:  # (like lacks only leading dimensions of size 1: nothing to sum)
        product, _, _ = gemm(a, b, compute_dtype=compute_dtype, out_dtype=out_dtype)
        return product.view(like.shape)
    order = [i for i in range(len(batch)) if i not in summed] + summed
    a, b = (t.permute(*order, len(batch), len(batch) + 1) for t in (a, b))
    product, _, _ = gemm(
        a,
        b,
        compute_dtype=compute_dtype,
        out_dtype=out_dtype,
        sum_batch=True,
        kept_dims=len(batch) - len(summed),
    )
    return product.view(like.shape)


class BatchedMatmulFunction(_Function):
    """C = round(a) @ round(b) with FP32 accumulation, for ``matmul``'s batched ``b``.

    a: (*, M, K), b: (*, K, N), batch shapes that broadcast (``torch.matmul``'s rule),
    float32/float16/bfloat16, any strides; C: (*batch, M, N) of ``out_dtype``.
    Forward: a batch of GEMMs over broadcast views (``_batched_product``). Backward:
    dA = dC @ B^T and dB = A^T @ dC, batches of GEMMs, each gradient in its operand's
    dtype; where an operand was broadcast over the batch, its gradient's products are
    summed in FP32 before their one rounding. Under ``torch.func`` transforms the
    forward and backward run on wrapped tensors, hence as torch ops
    (``generate_vmap_rule``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b, compute_dtype, out_dtype):
        return _batched_product(a, b, compute_dtype, out_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, compute_dtype, _ = inputs
        ctx.save_for_backward(a, b)
        ctx.compute_dtype = compute_dtype

    @staticmethod
    def backward(ctx, grad_c):
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[:2]
        compute_dtype = ctx.compute_dtype
        grad_a = grad_b = None
        if need_a:
            grad_a = _batched_product(grad_c, b.mT, compute_dtype, a.dtype, like=a)
        if need_b:
            grad_b = _batched_product(a.mT, grad_c, compute_dtype, b.dtype, like=b)
        return grad_a, grad_b, None, None


class _BatchedMatmulWithJvp(BatchedMatmulFunction):
    """``BatchedMatmulFunction`` with its forward-mode rule, applied in its place under
    forward-mode AD (``_Function.apply``)."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        BatchedMatmulFunction.setup_context(ctx, inputs, output)
        ctx.save_for_forward(*inputs[:2])
        ctx.out_shape, ctx.out_dtype = output.shape, output.dtype

    @staticmethod
    def jvp(ctx, a_t, b_t, *_):
        """Forward-mode AD: a_t @ b + a @ b_t, each a batch of products of rounded
        operands in FP32 as the forward's, rounded once to the output's dtype."""
        a, b = ctx.saved_tensors
        c_t = a.new_zeros(ctx.out_shape, dtype=torch.float32)  # (as LinearFunction's)
        for x, y in ((a_t, b), (a, b_t)):
            if x is not None and y is not None:
                c_t = c_t + _batched_product(x, y, ctx.compute_dtype, torch.float32)
        return c_t.to(ctx.out_dtype)


BatchedMatmulFunction.forward_mode = _BatchedMatmulWithJvp


class ActivationFunction(_Function):
    """y = act(z + bias) in the autograd graph, after ``LinearFunction`` (given the bias
    detached), whose epilogue has already computed y: the forward passes y on (the same
    memory); the backward turns dY into dZ = dY * act'(z) for the GEMMs' backward, and
    sums the bias gradient (``activation_backward``).

    A node of its own, as torch's activations are: the engine holds a node's incoming
    gradient until the node returns, and its saved tensors until then too, so with the
    derivative inside the layer's node dY and y would outlive the layer's GEMMs (two
    activations' worth more at the backward's peak than under autocast, whose ReLU frees
    both first). y: the layer's output; preact: GELU's or SiLU's input z as stored, else None.
    Under ``torch.vmap`` it runs as written on batched tensors (``generate_vmap_rule``:
    its forward is a detach, its backward torch ops there)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(y, preact, bias, activation, compute_dtype):
        return y.detach()  # y's memory, as this node's output

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, preact, _, activation, compute_dtype = inputs
        # ReLU's mask reads the output as saved here: an in-place change of it then
        # fails the backward, as it does after torch.relu.
        ctx.save_for_backward(output if activation == "relu" else preact)
        ctx.activation, ctx.compute_dtype = activation, compute_dtype
        ctx.bias = inputs[2]  # (z's part of act'(z) under create_graph: the bias's)
        # (dZ, its version, the bias gradient or None), where the next layer's node took
        # ReLU's backward in its GEMM (``_fusable_relu``).
        ctx.fused = None

    @staticmethod
    def backward(ctx, grad_y):
        (saved,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: dZ recorded, as a function of z
            if ctx.activation == "relu":  # (its derivative in y is 0: no edge to here)
                saved = saved.detach()
            elif ctx.bias is not None:  # G's node, the GEMMs', has the bias detached
                saved = saved.float() + (ctx.bias - ctx.bias.detach())  # (+ 0)
        fused, ctx.fused = ctx.fused, None
        if fused is not None and grad_y is fused[0] and grad_y._version == fused[1]:
            return grad_y, None, fused[2], None, None
        backward = activation_backward
        if torch.compiler.is_compiling():  # one opaque op, as for the GEMMs' backward
            from mpgemm.ops import activation_backward as backward
        grad_z, grad_b = backward(
            grad_y, saved, ctx.activation, ctx.compute_dtype, bias_grad=ctx.needs_input_grad[2]
        )
        return grad_z, None, grad_b, None, None


class _ActivationWithJvp(ActivationFunction):
    """``ActivationFunction`` with its forward-mode rule, applied in its place under
    forward-mode AD (``_Function.apply``)."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ActivationFunction.setup_context(ctx, inputs, output)
        ctx.save_for_forward(inputs[0] if ctx.activation == "relu" else inputs[1])

    @staticmethod
    def jvp(ctx, z_t, _, b_t, *__):
        """Forward-mode AD: y's tangent act'(z) * (z_t + b_t), by the backward's math
        (``activation_backward``: the derivative is elementwise). z_t: the GEMMs' node's
        tangent for y, which is z's there (G's is the same)."""
        (saved,) = ctx.saved_tensors
        if b_t is not None:
            z_t = (z_t.float() + b_t).to(z_t.dtype)
        y_t, _ = activation_backward(z_t, saved, ctx.activation, ctx.compute_dtype, bias_grad=False)
        return y_t


ActivationFunction.forward_mode = _ActivationWithJvp


def activation_backward(
    grad_y: torch.Tensor,
    saved: torch.Tensor,
    activation: str,
    compute_dtype: torch.dtype,
    *,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dZ, bias gradient or None) of ``ActivationFunction``, for (*, N) tensors:
    ``mpgemm.reference.activation_backward_ref``'s math, by the Triton kernel
    (``mpgemm.kernels.activation``: one pass) or that reference (torch ops). dZ is in
    dY's dtype, as y's gradient must be (``mpgemm.reference.dz_rounding``)."""
    impl = _implementation(grad_y.device, grad_y, saved, op="activation_backward")
    grad_z, grad_b = impl(
        _as_rows(grad_y), _as_rows(saved), activation, compute_dtype, bias_grad=bias_grad
    )
    return grad_z.view(grad_y.shape), grad_b


def _input_gradient(
    gemm: Callable,
    dz: torch.Tensor,
    weight: torch.Tensor,
    *,
    x_shape: Sequence[int],
    x_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    relu_output: torch.Tensor | None = None,
    column_sums: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx = dZ @ W in x's dtype and shape, None), by ``gemm`` (the kernel or its
    reference) from dZ (2-D); with ``relu_output`` (x as rows, the output y of a ReLU),
    the gradient at the ReLU's input instead, 0 where y <= 0, and with ``column_sums``
    its FP32 column sums (the ReLU's bias gradient) for None."""
    grad_x, _, sums = gemm(
        dz,
        weight,
        compute_dtype=compute_dtype,
        out_dtype=x_dtype,
        relu_output=relu_output,
        colsum_c=column_sums,
    )
    return grad_x.view(x_shape), sums


def _linear_backward(
    grad_z: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    *,
    x_shape: Sequence[int],
    x_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    need_x: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dW, bias gradient), each None unless needed: ``LinearFunction``'s backward
    from dZ and what its forward saved (x2d, the GEMMs' W)."""
    gemm = _implementation(grad_z.device, grad_z, x2d, weight)
    dz = _as_rows(grad_z)
    grad_x = grad_w = grad_b = None
    if need_x:
        grad_x, _ = _input_gradient(
            gemm, dz, weight, x_shape=x_shape, x_dtype=x_dtype, compute_dtype=compute_dtype
        )
    if need_w or need_b:
        # A frozen weight still lets its GEMM sum the bias gradient: B gets no columns.
        x_operand = x2d if need_w else x2d[:, :0]
        # Laid out like the weight (its copy is), in the weight's own dtype. Not under
        # vmap, where dZ may be batched and the weight not (per-sample gradients).
        laid_out = need_w and not (_wrapped(dz) or _wrapped(x2d))
        grad_w = torch.empty_like(weight, dtype=weight_dtype) if laid_out else None
        product, _, grad_b = gemm(
            dz.t(),
            x_operand,
            compute_dtype=compute_dtype,
            out_dtype=weight_dtype,
            rowsum_a=need_b,
            out=grad_w,
        )
        grad_w = product if need_w else None
    return grad_x, grad_w, grad_b


# ---------------------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------------------


def linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    compute_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``act(input @ weight.T + bias)``, the contract of ``torch.nn.functional.linear``
    with 16-bit Tensor Core operands and FP32 accumulation.

    input: (*, in_features); weight: (out_features, in_features), or (in_features,) for
    one output feature whose dimension is dropped from the result, as in F.linear; bias:
    (out_features,), a single value (shape () or (1,)) added to every feature, or None;
    each float32, float16 or bfloat16, all on one device. Operands are rounded
    to ``compute_dtype`` (float16 or bfloat16; default BF16 where input or weight is
    BF16, else FP16); bias and ``activation`` (None, "relu",
    "gelu", the exact erf form, "gelu_tanh", its tanh approximation, or "silu") are
    applied to the FP32 accumulator, which is then rounded to ``out_dtype`` (default
    ``compute_dtype``). Returns (*, out_features), or (*) for a 1-D weight.
    Differentiable in input, weight and bias; each gradient has its tensor's dtype, so
    FP32 master weights get FP32 gradients.
    """
    if has_torch_function_variadic(input, weight, bias):
        # As torch.nn.functional's functions do: a tensor subclass or mode with a
        # __torch_function__ (torch.fx's tracing proxies among them) gets the call.
        return handle_torch_function(
            linear,
            (input, weight, bias),
            input,
            weight,
            bias,
            activation=activation,
            compute_dtype=compute_dtype,
            out_dtype=out_dtype,
        )
    return _linear(
        input, weight, bias, activation=activation, compute_dtype=compute_dtype, out_dtype=out_dtype
    )


def _linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    activation: str | None,
    compute_dtype: torch.dtype | None,
    out_dtype: torch.dtype | None,
    weight_copy: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear``, with the GEMMs reading ``weight_copy`` (``weight`` in the compute
    dtype, from ``mpgemm.Linear``) in ``weight``'s place when given."""
    op = "mpgemm.linear"
    _check_not_jit_traced(op)
    _check_tensors(op, input=input, weight=weight, bias=bias)
    if compute_dtype is None:
        compute_dtype = compute_dtype_for(input, weight)
    _check_compute_dtype(op, compute_dtype)
    _check_out_dtype(op, out_dtype)
    _check_activation(op, activation)
    if input.dim() < 1 or weight.dim() not in (1, 2) or input.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"{op}: input of shape {tuple(input.shape)} and weight of shape "
            f"{tuple(weight.shape)} are incompatible: weight must be (out_features, "
            "in_features) or (in_features,), with in_features equal to input's last "
            "dimension"
        )
    weight_shape = tuple(weight.shape)
    vector = weight.dim() == 1  # F.linear's rule: one output feature, its dimension dropped
    if vector:
        weight = weight.unsqueeze(0)
    features = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (features,):
        # F.linear adds its bias by broadcasting: a single value (shape () or (1,)) is
        # one bias for every feature, a stride-0 view the kernels read as it is. In
        # FP32: the expansion's backward sums the features' FP32 gradients in the
        # view's dtype, so that the sum is rounded once, to the bias's own.
        if bias.dim() > 1 or bias.numel() != 1:
            raise ValueError(
                f"{op}: bias of shape {tuple(bias.shape)} does not match weight of shape "
                f"{weight_shape}; expected ({features},), or one value"
            )
        bias = bias.to(torch.float32).expand(features)
    # With an activation and a derivative to compute, the activation's node follows the
    # GEMMs' and owns the bias gradient: the GEMMs' node gets the bias's values only.
    activated = activation is not None and (
        _records_grad(input, weight, bias) or _forward_ad_active()
    )
    out, preact = _linear_function(
        input,
        weight,
        bias.detach() if activated and bias is not None else bias,
        activation,
        compute_dtype,
        out_dtype or compute_dtype,
        weight_copy,
        activated and activation in SAVES_PREACTIVATION,
    )
    if activated:
        out = ActivationFunction.apply(out, preact, bias, activation, compute_dtype)
    return out.squeeze(-1) if vector else out


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    compute_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b`` with 16-bit Tensor Core operands and FP32 accumulation.

    a, b: float32, float16 or bfloat16, on one device, each at least 1-D; the shapes
    follow ``torch.matmul``'s rules: a 1-D operand is a vector (a row for ``a``, a
    column for ``b``, its dimension dropped from the result), a (*, K) @ (K, N) product
    is one GEMM over a's rows, and a batched ``b`` (*, K, N) multiplies a (*, M, K)
    matrix by matrix, batch dimensions broadcasting. Operands are rounded to
    ``compute_dtype`` (float16 or bfloat16; default BF16 where an operand is BF16, as
    torch computes BF16 operands in BF16, else FP16), products accumulate in FP32, and
    the result is rounded to ``out_dtype`` (default ``compute_dtype``). Differentiable
    in both; each gradient has its operand's dtype.

    ``out``: as ``torch.matmul``'s, a tensor the result is written into and returned:
    of the result's dtype (``out_dtype``), on the operands' device, any strides;
    resized as torch resizes it (silently from zero elements, else with torch's
    warning); refused, as by torch, where autograd would record the product.
    """
    if has_torch_function_variadic(a, b, out):  # as in ``linear``
        return handle_torch_function(
            matmul, (a, b, out), a, b, compute_dtype=compute_dtype, out_dtype=out_dtype, out=out
        )
    op = "mpgemm.matmul"
    _check_not_jit_traced(op)
    key = None if out is not None else _replay_key(a, b, compute_dtype, out_dtype)
    if key is not None:
        replayed = _replayed_matmul(a, b, key)
        if replayed is not None:
            return replayed
    _check_tensors(op, a=a, b=b, out=out)
    if compute_dtype is None:
        compute_dtype = compute_dtype_for(a, b)
    _check_compute_dtype(op, compute_dtype)
    _check_out_dtype(op, out_dtype)
    out_dtype = out_dtype or compute_dtype
    if a.dim() == 0 or b.dim() == 0 or a.shape[-1] != b.shape[-2 if b.dim() > 1 else 0]:
        raise ValueError(
            f"{op}: a of shape {tuple(a.shape)} and b of shape {tuple(b.shape)} cannot be "
            "multiplied: both must be at least 1-D, with a's last dimension equal to b's "
            "first (1-D) or second-to-last"
        )
    if out is not None:
        return _matmul_into(a, b, out, compute_dtype, out_dtype)
    if b.dim() <= 2:
        weight = b.unsqueeze(1).t() if b.dim() == 1 else b.t()
        out, _ = _linear_function(a, weight, None, None, compute_dtype, out_dtype)
        if key is not None:
            _remember_matmul(key, compute_dtype, out_dtype)
        return out.squeeze(-1) if b.dim() == 1 else out
    rows = a.unsqueeze(0) if a.dim() == 1 else a
    try:
        _broadcast_batch(rows.shape[:-2], b.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"{op}: the batch dimensions of a of shape {tuple(a.shape)} and b of shape "
            f"{tuple(b.shape)} do not broadcast"
        ) from None
    if _autograd_idle(rows, b):
        out = _batched_product(rows, b, compute_dtype, out_dtype)
    else:
        out = BatchedMatmulFunction.apply(rows, b, compute_dtype, out_dtype)
    return out.squeeze(-2) if a.dim() == 1 else out


# ``matmul(a, b)``'s decisions for a product of two matrices that ``triton_gemm``
# computed without recording autograd, by ``_replay_key``: its launcher's replay, and
# the compute and output dtypes. A later call of the same key takes the replay of its
# launches directly (``_replayed_matmul``), without the checks and layers between:
# these took some two thirds of a replayed 512^2 product's host time on the CPU (18.5
# us a call under the stand-in driver, of which ``triton_gemm`` 7.2), and a GEMM from an
# idle GPU waits for all of it (``bench/NOTES.md``). At most so many keys.
_MAX_MATMUL_REPLAYS = 4096
_matmul_replays: dict[tuple, tuple[Callable, torch.dtype, torch.dtype]] = {}


def _recorded_product(a: torch.Tensor, b: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """round(a) @ round(b) in FP32 by ``matmul``: the kernels' product, recorded by
    autograd (in a backward under ``create_graph``)."""
    return matmul(a, b, compute_dtype=compute_dtype, out_dtype=torch.float32)


# The implementation of each op whose tensors autograd records (``_implementation``):
# the reference's math with its GEMMs by ``matmul``.
_RECORDED: dict[str, Callable] = {"gemm": functools.partial(gemm_ref, product=_recorded_product)}


def _replay_key(a, b, compute_dtype, out_dtype) -> tuple | None:
    """The key of ``matmul(a, b, compute_dtype=..., out_dtype=...)`` in
    ``_matmul_replays``, where a replay may answer it: a product of two plain
    (``is_plain``) 16-bit matrices (an FP32 operand is rounded first, in
    ``triton_gemm``) of which autograd records nothing (``_autograd_idle``: not
    compiled, no gradient, no forward-AD level, no functorch transform), the dtypes
    given dtypes or None; else None, at the cost of a few reads for any other call.
    The caller has handled ``__torch_function__`` and ``torch.jit.trace``. The key:
    each operand's shape, strides, dtype, layout and device, and the dtypes as given:
    what ``matmul``'s checks and decisions read of the call, but for that state."""
    if not (
        # (The types first, so that a non-tensor is not asked its dim; is_plain, which
        # asks them again, comes after the cheaper refusals.)
        type(a) in PLAIN_TYPES
        and type(b) in PLAIN_TYPES
        and a.dim() == b.dim() == 2
        and a.dtype in COMPUTE_DTYPES
        and b.dtype in COMPUTE_DTYPES
        and (compute_dtype is None or type(compute_dtype) is torch.dtype)
        and (out_dtype is None or type(out_dtype) is torch.dtype)
        and _autograd_idle(a, b)
        and is_plain(a)
        and is_plain(b)
    ):
        return None
    try:
        return (
            (a.shape, a.stride(), a.dtype, a.layout, a.device),
            (b.shape, b.stride(), b.dtype, b.layout, b.device),
            compute_dtype,
            out_dtype,
        )
    # No sizes (a 2-D nested tensor), or no strides (a sparse tensor, where torch gives
    # none: torch 2.13 gives a COO tensor (0, 0), and its layout keeps its key apart).
    except RuntimeError:
        return None


def _replayed_matmul(a: torch.Tensor, b: torch.Tensor, key: tuple) -> torch.Tensor | None:
    """``matmul``'s result by the replay kept for ``key`` (``_remember_matmul``), or None
    where none is kept or it does not apply now: a CPU tensor's backend (the
    interpreter, launches intercepted) is read again; the replay itself returns None
    where ``triton_gemm`` keeps no launches to repeat (``gemm.replayed_product``)."""
    kept = _matmul_replays.get(key)
    if kept is None:
        return None
    device = key[0][4]
    if device.type != "cuda" and backend(device) != "triton":
        return None
    replay, compute_dtype, out_dtype = kept
    return replay(a, b, compute_dtype, out_dtype)


def _remember_matmul(key: tuple, compute_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """Keep ``matmul``'s decisions for ``key`` (``_replay_key``), a product it has just
    computed without autograd (``_linear_forward``), where they end in
    ``triton_gemm(a, b, ...)`` itself: on the kernels' backend (``_implementation``). A
    CUDA device's backend is fixed (``_capable``); a CPU's is read again at each
    replay."""
    if backend(key[0][4]) != "triton":
        return
    if len(_matmul_replays) >= _MAX_MATMUL_REPLAYS:  # shapes without end: keep the newest
        _matmul_replays.clear()
    _matmul_replays[key] = (_product_replay(), compute_dtype, out_dtype)


@functools.cache
def _product_replay() -> Callable:
    """``gemm.replayed_product``, imported once (the kernels' module: triton's)."""
    from mpgemm.kernels.gemm import replayed_product

    return replayed_product


def _matmul_into(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``matmul(a, b)`` written into ``out`` (checked operands). A product with a 1-D or
    2-D ``b``, one GEMM over a's rows, writes into ``out`` where it is a view of them
    (any strides) that shares no memory with an operand; any other (a batch of
    products, an ``out`` whose dimensions do not merge into rows, that overlaps an
    operand, whose values are not its memory's: ``read_otherwise``, or an inference
    tensor outside ``torch.inference_mode``) is computed first, then copied in: within
    one dtype, which torch's ``copy_`` writes into a negative view as its values
    (between FP32 and FP16 torch 2.13's writes their negation), and refusing a zero
    tensor, or an inference tensor outside that mode, as torch's ``matmul`` does."""
    op = "mpgemm.matmul"
    if out.dtype != out_dtype:
        raise TypeError(
            f"{op}: out has dtype {out.dtype}, the result {out_dtype} (out_dtype, or "
            "compute_dtype when out_dtype is None); pass out_dtype to match out"
        )
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or out.requires_grad):
        raise RuntimeError(
            f"{op}: functions with out=... arguments don't support automatic "
            "differentiation, but one of the arguments requires grad (as torch.matmul)"
        )
    rows = a.unsqueeze(0) if a.dim() == 1 else a
    columns = b.unsqueeze(1) if b.dim() == 1 else b
    # torch.matmul's result shape: a vector's dimension dropped (a.shape[-2:-1] and
    # b.shape[1:] are empty for 1-D operands).
    if b.dim() > 2:
        batch = _broadcast_batch(rows.shape[:-2], b.shape[:-2])
        shape = (*batch, *a.shape[-2:-1], b.shape[-1])
    else:
        shape = (*a.shape[:-1], *b.shape[1:])
    if tuple(out.shape) != shape:
        if out.numel():
            warnings.warn(
                f"{op}: out of shape {tuple(out.shape)} was resized to the result's "
                f"{shape}, as torch resizes an out= tensor; torch deprecates resizing "
                "one with elements (resize it to zero elements first: out.resize_(0))",
                UserWarning,
                stacklevel=3,
            )
        out.resize_(shape)
    if any(stride == 0 and size > 1 for size, stride in zip(out.shape, out.stride(), strict=True)):
        # As torch refuses it: a result element would overwrite another.
        raise RuntimeError(
            f"{op}: out of strides {out.stride()} has elements that share memory (an "
            "expanded tensor); give out memory of its own (out.clone())"
        )
    written = None
    if (
        b.dim() <= 2
        and not torch.compiler.is_compiling()
        and not read_otherwise(out)
        and not write_refused(out)
        and not _shares_memory(out, a, b)
    ):
        try:
            written = out.view(math.prod(rows.shape[:-1]), columns.shape[1])
        except RuntimeError:  # dimensions that do not merge: computed, then copied
            pass
    if written is None:
        return out.copy_(matmul(a, b, compute_dtype=compute_dtype, out_dtype=out_dtype))
    gemm = _gemm(a.device, a, b, out)
    gemm(_as_rows(rows), columns, compute_dtype=compute_dtype, out_dtype=out_dtype, out=written)
    return out


def _shares_memory(out: torch.Tensor, *operands: torch.Tensor) -> bool:
    """Whether ``out`` lies in the storage of any of ``operands`` (written as they are
    read, a product would read its own results)."""
    base = out.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == base for t in operands)
