"""``mpgemm.Linear``, the drop-in ``nn.Linear``, and ``mpgemm.convert`` for whole models."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Proxy
from torch.nn.utils import parametrize

from mpgemm.compute_copy import ComputeCopy
from mpgemm.functional import (
    COMPUTE_DTYPES,
    INPUT_DTYPES,
    _check_activation,
    _check_compute_dtype,
    _check_out_dtype,
    _linear,
)
from mpgemm.reference import torch_activation


class Linear(nn.Linear):
    """``nn.Linear`` whose product runs with 16-bit operands and FP32 accumulation.

    Parameters are FP32 by default: they are the master weights, and their gradients
    arrive in FP32. The GEMMs read a ``compute_dtype`` copy of the weight
    (``mpgemm.compute_copy``), remade whenever the weight changes and written by
    mpgemm's fused optimizers in their step, so 16-bit operands reach the Tensor Cores.
    ``forward`` takes (*, in_features) inputs of dtype float32, float16 or bfloat16 and
    returns ``act(input @ weight.T + bias)`` of ``out_dtype`` (default ``compute_dtype``).
    ``state_dict`` is ``nn.Linear``'s, so checkpoints load both ways.

    ``dtype`` is the parameters', as for ``nn.Linear``. ``compute_dtype`` (FP16 or BF16)
    is what FP32 weights are rounded to; None (the default) takes ``dtype`` where it is
    16-bit, else FP16. A weight that is 16-bit at the forward (``dtype``, ``.half()``,
    ``.bfloat16()``, or FSDP2's ``param_dtype`` casting the gathered weight) is the GEMMs'
    operand as it is: the layer computes in its dtype, as a module of that dtype does in
    torch. One outside mixed precision (FP64, complex: ``dtype`` or ``.double()``)
    computes as ``nn.Linear`` of that dtype does, then its activation by torch's
    function, as under ``torch.autocast``, whose FP64 ops are not eligible and run in
    FP64.

    Mixed-precision rule: the layer whose output is the model's output (the logits)
    should use ``out_dtype=torch.float32`` so softmax and loss run in FP32;
    ``mpgemm.convert`` does that for you.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        compute_dtype: torch.dtype | None = None,
        activation: str | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        if dtype in COMPUTE_DTYPES and compute_dtype not in (None, dtype):
            raise ValueError(
                f"mpgemm.Linear: a layer of {dtype} parameters computes in {dtype} (its "
                f"weight is the GEMMs' operand), not compute_dtype={compute_dtype}, which is "
                "what FP32 weights are rounded to; give one or the other"
            )
        if compute_dtype is None:
            compute_dtype = dtype if dtype in COMPUTE_DTYPES else torch.float16
        _check_compute_dtype("mpgemm.Linear", compute_dtype)
        _check_out_dtype("mpgemm.Linear", out_dtype)
        _check_activation("mpgemm.Linear", activation)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.compute_dtype = compute_dtype
        self.activation = activation
        self.out_dtype = out_dtype
        self._weight_copy = ComputeCopy(compute_dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, Proxy):
            # torch.fx's symbolic tracing, whose proxies cannot answer the dtype test
            # below: the layer as a leaf of the graph, a call of this module, as torch.fx
            # records nn.Linear (so the traced graph runs this forward, compute copy and
            # hooks included).
            tracer = input.tracer
            return tracer.create_proxy("call_module", tracer.path_of_module(self), (input,), {})
        weight, bias = self.weight, self.bias
        if weight.dtype not in INPUT_DTYPES:  # outside mixed precision: FP64, complex
            return torch_activation(F.linear(input, weight, bias), self.activation)
        if self._weight_copy.dtype != self.compute_dtype:  # compute_dtype was reassigned
            self._weight_copy = ComputeCopy(self.compute_dtype)
        copy = None
        if weight.dtype == torch.float32:
            # The copy is a cache keyed by the weight's storage and version, for eager
            # code; a compiled graph casts in the graph, which is the same rounding, as
            # does a torch.func transform (its weight may be wrapped, with no storage to
            # key by, and what it makes is wrapped: kept, it would outlive the levels),
            # and so does a forward of an inference tensor's (a model made under
            # inference_mode), which has no version counter to key by.
            copy = (
                weight.to(self.compute_dtype)
                if torch.compiler.is_compiling()
                or torch._C._are_functorch_transforms_active()
                or weight.is_inference()
                else self._weight_copy.of(weight)
            )
        return _linear(
            input,
            weight,
            bias,
            activation=self.activation,
            # A 16-bit weight is the operand as it is, in its own dtype.
            compute_dtype=weight.dtype if weight.dtype in COMPUTE_DTYPES else self.compute_dtype,
            out_dtype=self.out_dtype,
            weight_copy=copy,
        )

    def __prepare_scriptable__(self) -> Linear:
        # torch.jit.script asks every module this before compiling it: TorchScript
        # cannot compile mpgemm's kernels (Python and Triton), and would fail deep in
        # this forward's code.
        raise RuntimeError(
            "mpgemm.Linear: torch.jit.script cannot compile mpgemm's kernels; export the "
            "model with torch.export.export (or compile it with torch.compile), which "
            "record mpgemm's custom ops"
        )

    def _load_from_state_dict(self, *args, **kwargs):
        # A sharded (FSDP2) weight reaches its unsharded storage with no version bump.
        self._weight_copy.drop()
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        # .to(dtype), .half(), .bfloat16(): parameters cast to a 16-bit dtype make it
        # the compute dtype too, as a module of that dtype computes in it in torch
        # (a BF16 layer computing in FP16 would turn inputs above 65504 into inf).
        # Masters are then the optimizer's business (mpgemm.LossScaleOptimizer).
        out = super()._apply(fn, recurse)
        if self.weight.dtype in COMPUTE_DTYPES:
            self.compute_dtype = self.weight.dtype
        return out

    def extra_repr(self) -> str:
        # out_dtype=None: the output takes the compute dtype.
        return (
            f"{super().extra_repr()}, compute_dtype={self.compute_dtype}, "
            f"activation={self.activation}, out_dtype={self.out_dtype}"
        )

    @classmethod
    def from_linear(
        cls,
        module: nn.Linear,
        *,
        compute_dtype: torch.dtype | None = None,
        out_dtype: torch.dtype | None = None,
        activation: str | None = None,
    ) -> Linear:
        """An ``mpgemm.Linear`` holding ``module``'s very own Parameter objects (no copy),
        so an optimizer built over ``module`` keeps stepping them, its buffers, and its
        hooks (forward, backward and state-dict hooks: the same registries, so a handle
        taken on ``module`` still removes its hook), as torch's own module swaps keep a
        module's forward hooks (``torch.ao.quantization.swap_module``).

        ``compute_dtype``: what an FP32 weight is rounded to (None: FP16); a weight in FP16
        or BF16 computes in its own dtype (a BF16 layer computing in FP16 would overflow
        where it did not)."""
        if not isinstance(module, nn.Linear):
            raise TypeError(
                "mpgemm.Linear.from_linear: module must be a torch.nn.Linear, got "
                f"{type(module).__name__}"
            )
        # Built on the meta device so no throw-away weights are allocated or initialised.
        new = cls(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device="meta",
            dtype=module.weight.dtype,
            compute_dtype=None if module.weight.dtype in COMPUTE_DTYPES else compute_dtype,
            activation=activation,
            out_dtype=out_dtype,
        )
        # The module's own parameters and buffers, in their order: ``weight`` and
        # ``bias``, or what ``torch.nn.utils.prune`` leaves (``weight_orig``, and the
        # ``weight_mask`` buffer, from which a forward pre-hook, carried below, makes
        # ``weight`` a plain attribute at each forward).
        new._parameters = dict(module._parameters)
        new._buffers = dict(module._buffers)
        new._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
        if "weight" not in module._parameters:
            new.weight = module.weight
        new.train(module.training)
        for name in (*_HOOK_REGISTRIES, "_is_full_backward_hook"):
            if hasattr(module, name):
                setattr(new, name, getattr(module, name))
        return new


# nn.Module's hook registries, as torch 2.11 to 2.13 name them (``from_linear`` also
# carries ``_is_full_backward_hook``, which says what kind of backward hooks they hold).
_HOOK_REGISTRIES = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _sees_output(module: nn.Module) -> bool:
    """Whether a hook of ``module`` sees its output or the output's gradient, which
    fusing the following activation into it would change."""
    return bool(module._forward_hooks or module._backward_hooks or module._backward_pre_hooks)


def _has_hooks(module: nn.Module) -> bool:
    return any(getattr(module, name, None) for name in _HOOK_REGISTRIES)


def _fusable_activation(module: nn.Module) -> str | None:
    """The ``activation`` of ``mpgemm.Linear`` that computes ``module``, if any."""
    if type(module) is nn.ReLU:
        return "relu"
    if type(module) is nn.GELU:
        return "gelu" if module.approximate == "none" else "gelu_tanh"
    if type(module) is nn.SiLU:
        return "silu"
    return None


def _following_activation(root: nn.Module, name: str) -> tuple[nn.Sequential, int, str] | None:
    """(parent, index, activation) of the activation module right after layer ``name``
    in an ``nn.Sequential``, when it is one ``_fusable_activation`` knows and fusing
    changes no hook's view: the layer's hooks see its output, and the activation's would
    no longer run."""
    parent, child_name = _slot(root, name)
    if type(parent) is not nn.Sequential or not child_name.isdigit():
        return None
    index = int(child_name) + 1
    if index == len(parent) or _sees_output(parent[index - 1]) or _has_hooks(parent[index]):
        return None
    activation = _fusable_activation(parent[index])
    return None if activation is None else (parent, index, activation)


def _sharded_linear(layer: nn.Module) -> bool:
    """Whether ``layer`` is an nn.Linear that FSDP2's ``fully_shard`` has made a class
    of its own (``FSDPLinear``)."""
    bases = type(layer).__bases__
    if len(bases) != 2 or bases[1] is not nn.Linear or not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return bases[0] is FSDPModule


# Layers that convert leaves as they are though a user would expect them converted,
# with why and what to do: an nn.LazyLinear before its first forward, and an nn.Linear
# that torch.nn.utils.parametrize (weight_norm, orthogonal...) or FSDP2 has made a class
# of its own, whose Parameters or hooks a conversion could not keep.
_UNCONVERTED = (
    (
        lambda layer: type(layer) is nn.LazyLinear,
        "an nn.LazyLinear becomes an nn.Linear at its first forward; run one (a batch) "
        "before convert",
    ),
    (
        lambda layer: parametrize.is_parametrized(layer) and type(layer).__bases__ == (nn.Linear,),
        "a parametrized nn.Linear (torch.nn.utils.parametrize: weight_norm, orthogonal...) "
        "is a class of its own; convert first, then register the parametrization on the "
        "mpgemm.Linear",
    ),
    (
        _sharded_linear,
        "an nn.Linear sharded by FSDP2's fully_shard is a class of its own; convert before "
        "fully_shard",
    ),
)


def _warn_unconverted_layers(module: nn.Module, chooses: Callable[[nn.Module, str], bool]) -> None:
    """Warn of the layers of ``_UNCONVERTED`` that ``chooses`` picks: left as they are,
    in FP32."""
    for left, why in _UNCONVERTED:
        names = [
            repr(name)
            for name, layer in module.named_modules()
            if left(layer) and chooses(layer, name)
        ]
        if names:
            warnings.warn(
                f"mpgemm.convert: layer(s) {', '.join(names)} left as they are: {why}",
                UserWarning,
                stacklevel=3,
            )


def convert(
    module: nn.Module,
    *,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    compute_dtype: torch.dtype | None = None,
    keep_output_fp32: bool | str = True,
    fuse_activations: bool = True,
) -> nn.Module:
    """Replace every ``nn.Linear`` in ``module`` by an ``mpgemm.Linear`` sharing its
    Parameters, in place; returns ``module`` (or the new layer if ``module`` itself is
    an ``nn.Linear``).

    module_filter_fn(layer, fully_qualified_name) -> bool picks the layers to convert
    (default: all). Only exact ``nn.Linear`` instances are converted: subclasses may
    have a ``forward`` of their own. An ``nn.LazyLinear`` not yet initialised (it
    becomes an ``nn.Linear`` at its first forward) is left as it is, with a warning, as
    is a parametrized ``nn.Linear`` (``torch.nn.utils.parametrize``; parametrize the
    converted layer instead) and one sharded by FSDP2 (convert before ``fully_shard``).

    ``compute_dtype`` (FP16 or BF16; None: FP16) is what the converted layers' FP32
    weights, which become the master weights, are rounded to; a layer already in FP16
    or BF16 computes in its own dtype (a BF16 model keeps computing in BF16, whose
    range FP16 lacks).

    Converted layers write their output in their compute dtype, except the model's output
    layer, which writes FP32 so the logits, softmax and loss stay FP32 (the
    mixed-precision rule). ``keep_output_fp32`` says which layer that is: ``True`` (the
    default) means the last converted layer in ``named_modules()`` order, the output
    layer of an ``nn.Sequential`` MLP; a string names the layer; ``False`` means none.

    ``fuse_activations``: a converted layer followed directly, in an ``nn.Sequential``,
    by ``nn.ReLU``, ``nn.GELU`` (either form) or ``nn.SiLU`` computes that activation in its
    GEMM's epilogue (its derivative in an autograd node of the layer's own), and
    the activation module becomes ``nn.Identity``, so ``state_dict`` keys and indexing
    are unchanged. A layer keeps its hooks (``Linear.from_linear``); one with hooks on
    its output or its output's gradient, or followed by an activation module with hooks,
    is not fused, so that every hook sees what it saw before.

    A layer registered in several places (one module reused) becomes one
    ``mpgemm.Linear`` in all of them (``module_filter_fn`` is asked of its first name,
    ``keep_output_fp32`` may give any); if those places have different parents or
    attribute names, it is called from each and fused with nothing.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"mpgemm.convert: module must be a torch.nn.Module, got {type(module).__name__}"
        )
    if compute_dtype is not None:
        _check_compute_dtype("mpgemm.convert", compute_dtype)

    def chooses(layer: nn.Module, name: str) -> bool:
        return module_filter_fn is None or module_filter_fn(layer, name)

    _warn_unconverted_layers(module, chooses)
    chosen = [
        name
        for name, layer in module.named_modules()
        if type(layer) is nn.Linear and chooses(layer, name)
    ]
    # Every name of each layer (its first, in ``chosen``, then any other): a layer
    # registered in several places (one module reused) becomes one mpgemm.Linear in all.
    names: dict[int, list[str]] = defaultdict(list)
    for name, layer in module.named_modules(remove_duplicate=False):
        if type(layer) is nn.Linear:
            names[id(layer)].append(name)
    if keep_output_fp32 is True:
        fp32_name = chosen[-1] if chosen else None
    elif keep_output_fp32 is False:
        fp32_name = None
    else:
        fp32_name = next(
            (name for name in chosen if keep_output_fp32 in names[id(module.get_submodule(name))]),
            None,
        )
        if fp32_name is None:
            raise ValueError(
                f"mpgemm.convert: keep_output_fp32={keep_output_fp32!r} names no converted "
                f"nn.Linear; converted layers are {chosen}"
            )

    def replacement(name: str, activation: str | None = None) -> Linear:
        return Linear.from_linear(
            cast(nn.Linear, module.get_submodule(name)),  # chosen among the nn.Linears
            compute_dtype=compute_dtype,
            out_dtype=torch.float32 if name == fp32_name else None,
            activation=activation,
        )

    if chosen == [""]:  # the root itself is an nn.Linear and cannot be swapped in place
        return replacement("")
    for name in chosen:
        aliases = names[id(module.get_submodule(name))]
        slots = {_slot(module, alias) for alias in aliases}
        activation = None
        # A layer called from several places is fused with none of what follows it: the
        # activation would run after every call.
        fusing = fuse_activations and len(slots) == 1
        following = _following_activation(module, name) if fusing else None
        if following is not None:
            sequential, index, activation = following
            sequential[index] = nn.Identity()
        new = replacement(name, activation)
        for parent, child_name in slots:
            setattr(parent, child_name, new)
    return module


def _slot(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding submodule ``name`` of ``root``, and its attribute name there."""
    parent_name, _, child_name = name.rpartition(".")
    return root.get_submodule(parent_name), child_name
