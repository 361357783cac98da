"""Loss-scaling ops on lists of tensors, dispatched to the kernels or the references.

Each op takes tensors of any supported dtypes on one device, groups them by dtype and
sends each group to one kernel launch (``mpgemm.kernels.unscale``, ``.fused_optim``,
``.update_scale``) or, for CPU tensors without the interpreter, to
``mpgemm.scaling_ref``. A tensor the kernels cannot walk as flat memory (overlapping
or gapped strides, or strides that differ from its partners', or a tensor subclass)
goes to the reference, which is exact too. DTensors (FSDP2's sharded parameters,
gradients and states) are worked on through their local shards. ``found_inf`` and
``inv_scale`` stay on the device throughout.
"""

from __future__ import annotations

import functools
import itertools
import operator
from array import array
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeGuard, cast

import torch

from mpgemm import ops, scaling_ref
from mpgemm.functional import PLAIN_TYPES, backend, is_plain, read_otherwise, write_refused
from mpgemm.graphs import capturing
from mpgemm.native import ListFacts, bump_versions, list_facts, reading_once

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# What the kernels take; other dtypes (FP64) go to the reference implementation.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (its storage: in-place updates reach the DTensor),
    else ``t``. The ops are elementwise, so each rank works on its own shards (FSDP2)."""
    if _is_dtensor(t):
        return t.to_local()
    return t


def _is_dtensor(t: object) -> TypeGuard[DTensor]:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


@functools.cache
def _dtensor_type() -> type | None:
    # Looked up once: every tensor of every step is asked.
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


# A tensor's device as an int (-1 for the CPU), read without making a torch.device.
_device_index = torch.Tensor.get_device


def by_device(first: Sequence[torch.Tensor], *others: Sequence[torch.Tensor]) -> list[tuple]:
    """The parallel lists split by the device of ``first``'s tensors, one tuple of lists
    per device, in order of first appearance: a launch reads one device's memory. One
    device (the usual case), told by ``list_facts`` (or, for a list of subclasses such
    as DTensors and in a compiled step, whose tracer runs no C++ helper, by a pass that
    makes no ``torch.device``), keeps the lists themselves."""
    facts = None if torch.compiler.is_compiling() else list_facts(first, PLAIN_TYPES)
    if facts is not None and facts.plain and len(facts.devices) <= 1:
        return [(first, *others)] if first else []
    indices = list(map(_device_index, first))
    if len(set(indices)) <= 1:
        return [(first, *others)] if first else []
    parts: dict[int, tuple[list, ...]] = {}
    for position, index in enumerate(indices):
        part = parts.setdefault(index, tuple([] for _ in range(1 + len(others))))
        for lst, source in zip(part, (first, *others), strict=True):
            lst.append(source[position])
    return list(parts.values())


def is_flat(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill its storage span exactly once (dense, no
    overlap), in any dimension order, so a kernel can walk it as a flat array."""
    dims = sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape, strict=True) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _dispatch(
    name: str,
    lists: Sequence[Sequence[torch.Tensor]],
    call: Callable,
    *,
    strided: int,
    copies: int | None = None,
    groups: ParamGroups | None = None,
    written: dict[str, int] | None = None,
) -> None:
    """Call ``call(impl, sublists, subgroups)`` once per dtype group of the parallel
    ``lists``, with ``groups`` (an optimizer's hyperparameters per run of parameters)
    split as the lists are (None stays None). ``written``: the lists the op writes in
    place, by name (their index), which ``_check_writable`` asks first.

    The first ``strided`` lists are addressed elementwise; a position whose tensors are
    not all flat with equal strides, or of a dtype the kernels do not take, goes to the
    reference implementation. ``copies``: the index of a list of compute copies, where
    a parameter (list 0) without one is listed itself; such a position joins a group
    of its other dtypes whatever that group's copies' dtype, so that a layer's weight
    (with a 16-bit copy) and its bias (without) take one launch. Asked of every tensor
    of every step: whether the kernels take every position (the usual case) is answered
    by passes over each list that run in C (``_kernels_take_all``), and positions are
    checked one by one only otherwise (that loop made an unscale of 200 gradients cost
    0.86 ms of host time on the H100, for a 0.28 ms kernel: the README's Status).

    Raises ValueError for lists of different lengths; RuntimeError from
    ``_check_writable``."""
    if len({len(lst) for lst in lists}) > 1:
        raise ValueError(
            "mpgemm.scaling: the parallel lists of tensors must have one length, got "
            f"{[len(lst) for lst in lists]}"
        )
    if not lists[0]:
        return
    with reading_once():  # by the checks below and by the launch tables
        # An in-place op passes one list twice: each distinct list is converted once, and a
        # tensor in two lists (a parameter as its own copy) stays one tensor.
        # Each distinct list's facts (by id: of the list the ops then take) are read once.
        shards: dict[int, torch.Tensor] = {}
        local: dict[int, Sequence[torch.Tensor]] = {}
        facts: dict[int, ListFacts] = {}
        for given, lst in {id(lst): lst for lst in lists}.items():
            known = list_facts(lst, PLAIN_TYPES)
            if not known.plain:  # DTensors as their local shards; other subclasses stay
                lst = _local_list(lst, shards)
                known = list_facts(lst, PLAIN_TYPES)
            local[given], facts[id(lst)] = lst, known
        lists = [local[id(lst)] for lst in lists]
        if written:  # (of the local lists: a DTensor's shard is what the kernels write)
            _check_writable(f"{name}_", facts, {label: lists[i] for label, i in written.items()})
        device = lists[0][0].device
        use_kernels = backend(device) == "triton"
        dtypes = _dtype_sets(lists, copies, facts)
        take_all = use_kernels and _kernels_take_all(lists[:strided], dtypes[:strided], facts)
        if take_all and all(len(held) <= 1 for held in dtypes):
            call(kernels()[name], lists, groups)  # one group
            return
        if take_all:
            kernel_ok: Iterable[bool] = itertools.repeat(True, len(lists[0]))
        else:
            kernel_ok = (
                use_kernels and _kernel_takes(ts[:strided]) for ts in zip(*lists, strict=True)
            )
        positions: dict[tuple, list[int]] = defaultdict(list)
        for index, key in enumerate(zip(kernel_ok, *_dtype_keys(lists, copies), strict=True)):
            positions[key].append(index)
        if copies is not None:
            _merge_own_copies(positions, 1 + copies)  # (the key's first entry is kernel_ok)
        for (ok, *_), indices in positions.items():
            impl = kernels()[name] if ok else REFERENCES[name]
            if len(positions) == 1:
                call(impl, lists, groups)
            else:
                taken = None if groups is None else groups.take(indices)
                call(impl, [[lst[i] for i in indices] for lst in lists], taken)


def _bumped(*written: Sequence[torch.Tensor] | None) -> None:
    """Bump the version counters of the tensors an op wrote in place (lists, or None for
    none), as torch's in-place ops do: autograd then refuses a tensor saved for a
    backward and changed since (torch's "modified by an inplace operation"), where the
    kernels' writes would otherwise pass unseen."""
    for tensors in written:
        if tensors:
            bump_versions(tensors)


def _copy_dtype(param: torch.Tensor, copy: torch.Tensor) -> torch.dtype | None:
    return None if copy is param else copy.dtype


def _dtype_keys(lists: Sequence[Sequence[torch.Tensor]], copies: int | None) -> list[Iterable]:
    """Per list, each position's dtype, by which positions are grouped; in the list of
    compute copies (index ``copies``), None for a parameter listed as its own copy."""
    keys: list[Iterable] = [map(_dtype, lst) for lst in lists]
    if copies is not None:
        keys[copies] = map(_copy_dtype, lists[0], lists[copies])
    return keys


def _dtype_sets(
    lists: Sequence[Sequence[torch.Tensor]], copies: int | None, facts: dict[int, ListFacts]
) -> list[set]:
    """Per list, the dtypes it holds (the compute copies: those of the copies that are
    not their parameter), each distinct list read once (an in-place op passes one
    twice), from its ``facts`` (by id) where it holds plain tensors: every position is
    one group when each holds at most one."""
    held: dict[tuple[int, bool], set] = {}
    out = []
    for index, (lst, keys) in enumerate(zip(lists, _dtype_keys(lists, copies), strict=True)):
        key = (id(lst), index == copies)
        if key not in held:
            known = facts[id(lst)]
            held[key] = known.dtypes if known.plain and index != copies else set(keys) - {None}
        out.append(held[key])
    return out


def _merge_own_copies(groups: dict[tuple, list[int]], position: int) -> None:
    """Fold each group of parameters listed as their own copies (None at ``position``
    of its key) into a group whose key differs there only, if there is one."""
    for key in [key for key in groups if key[position] is None]:
        rest = key[:position] + key[position + 1 :]
        partner = next(
            (
                other
                for other in groups
                if other[position] is not None and other[:position] + other[position + 1 :] == rest
            ),
            None,
        )
        if partner is not None:
            groups[partner] = sorted(groups[partner] + groups.pop(key))


def _local_list(
    tensors: Sequence[torch.Tensor], shards: dict[int, torch.Tensor]
) -> Sequence[torch.Tensor]:
    """``tensors`` with each DTensor replaced by its local shard (``_local``), one per
    DTensor: ``shards`` holds those already taken, by id."""
    if set(map(type, tensors)) <= _PLAIN_SET:
        return tensors
    for t in tensors:
        if id(t) not in shards:
            shards[id(t)] = _local(t)
    return [shards[id(t)] for t in tensors]


def _shards(*lists: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The lists as lists, each DTensor as its local shard: what the custom ops take
    under ``torch.compile``, as the kernels do eagerly (``_dispatch``). Unlike the eager
    path (``_local_list``), no tensor is looked up by ``id``, which dynamo cannot take
    of a tensor the traced step made (torch 2.11: the state an optimizer's first step
    creates), and none needs to be: compiled, no tensor is in two of the lists (a step
    writes no compute copies, ``Optimizer._compute_copies``; an in-place ``unscale_``
    passes one list)."""
    return [
        list(lst) if set(map(type, lst)) <= _PLAIN_SET else [_local(t) for t in lst]
        for lst in lists
    ]


_PLAIN_SET = frozenset(PLAIN_TYPES)
_KERNEL_DTYPE_SET = frozenset(KERNEL_DTYPES)
_dtype = operator.attrgetter("dtype")


def _kernels_take_all(
    strided: Sequence[Sequence[torch.Tensor]], dtypes: Sequence[set], facts: dict[int, ListFacts]
) -> bool:
    """Whether ``_kernel_takes`` every position of the parallel ``strided`` lists, in the
    usual case: contiguous plain tensors of the kernels' dtypes (``dtypes``: each list's,
    from ``_dtype_sets``), one shape per position (False leaves the other cases to
    ``_kernel_takes``), read from each list's ``facts`` (by id)."""
    if not all(held <= _KERNEL_DTYPE_SET for held in dtypes):
        return False
    known = [facts[id(lst)] for lst in strided]
    if not all(f.plain and f.contiguous for f in known):
        return False
    return all(f.shapes == known[0].shapes for f in known)


def _kernel_takes(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a kernel can walk these parallel tensors as flat arrays: plain tensors
    (``is_plain``: their values are their memory's) of its dtypes and one shape, flat,
    with equal strides (contiguous tensors of one shape, the usual case, are answered
    without is_flat)."""
    first = tensors[0]
    if not is_plain(first) or first.dtype not in KERNEL_DTYPES:
        return False
    shape = first.shape
    contiguous = first.is_contiguous()
    for t in tensors[1:]:
        if t is first:  # an in-place op's source and destination
            continue
        if not is_plain(t) or t.dtype not in KERNEL_DTYPES or t.shape != shape:
            return False
        contiguous = contiguous and t.is_contiguous()
    if contiguous:
        return True
    stride = first.stride()
    return all(is_flat(t) and t.stride() == stride for t in tensors)


class ParamGroups(NamedTuple):
    """Float hyperparameters that differ between runs of consecutive parameters (the
    param groups of one optimizer launch, ``mpgemm.optim``): ``rows[i]`` (name -> value)
    holds for the ``sizes[i]`` parameters of run ``i``, in place of the values given
    for all. Per run, not per parameter, so that a step's host work grows with its
    groups, not its parameters."""

    rows: tuple[dict[str, float], ...]
    sizes: tuple[int, ...]

    def take(self, indices: Sequence[int]) -> ParamGroups:
        """The runs of the parameters at ``indices``, in their order."""
        run_of = [run for run, size in enumerate(self.sizes) for _ in range(size)]
        rows: list[dict[str, float]] = []
        sizes: list[int] = []
        for index in indices:
            row = self.rows[run_of[index]]
            if rows and rows[-1] is row:
                sizes[-1] += 1
            else:
                rows.append(row)
                sizes.append(1)
        return ParamGroups(tuple(rows), tuple(sizes))

    def run_of_each(self) -> bytes:
        """Each parameter's run index, as int64s in native byte order."""
        return b"".join(array("q", [run]).tobytes() * size for run, size in enumerate(self.sizes))


# Each op's two implementations, by the op's name: the reference (torch ops, any
# device) and the Triton kernel launcher.
REFERENCES: dict[str, Callable] = {
    "unscale": scaling_ref.unscale_ref_,
    "update_scale": scaling_ref.update_scale_ref_,
    "sgd_step": scaling_ref.sgd_step_ref_,
    "adam_step": scaling_ref.adam_step_ref_,
}


@functools.cache
def kernels() -> dict[str, Callable]:
    """The kernel launchers, by op (imported on first use: they import triton)."""
    from mpgemm.kernels.fused_optim import triton_adam_step_, triton_sgd_step_
    from mpgemm.kernels.unscale import triton_unscale_
    from mpgemm.kernels.update_scale import triton_update_scale_

    return {
        "unscale": triton_unscale_,
        "update_scale": triton_update_scale_,
        "sgd_step": triton_sgd_step_,
        "adam_step": triton_adam_step_,
    }


def unscale_(
    src: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor | None,
    *,
    dst: Sequence[torch.Tensor] | None = None,
) -> None:
    """``found_inf = 1.0`` if any element of ``src`` is inf or NaN (else unchanged), and
    ``dst = src * inv_scale`` rounded to ``dst``'s dtype: in place when ``dst`` is None,
    nothing written when ``inv_scale`` is None. Matches
    ``torch._amp_foreach_non_finite_check_and_unscale_`` bit for bit.

    ``src``: FP32/FP16/BF16 tensors on one device; ``dst``: tensors of ``src``'s shapes;
    ``found_inf``, ``inv_scale``: one-element FP32 tensors on that device.

    Raises TypeError for a non-tensor or a flag or scale that is not FP32, ValueError
    for a flag or scale of more than one element or on another device, or a ``dst``
    that does not match ``src``, RuntimeError for a ``found_inf`` that is a negative
    view or a zero tensor (``_check_written_scalar``) or, outside
    ``torch.inference_mode``, a ``dst`` holding an inference tensor. An ``inv_scale``
    whose values are not its memory's is read as its value (``_as_memory``)."""
    if torch.compiler.is_compiling():
        src_types = _check_lists("unscale_", src, dst)
        _check_scalars(src, found_inf, inv_scale)
        local_src, local_dst = _shards(src, dst or ())
        ops.unscale_(local_src, found_inf, inv_scale, local_dst)
        _reduce_over_shards(src, src_types, found_inf)
        return
    with reading_once():  # the checks, the split by dtype and the launch table
        src_types = _check_lists("unscale_", src, dst)
        _check_scalars(src, found_inf, inv_scale)
        _check_written_scalar("unscale_", "found_inf", found_inf, inference_refused=False)
        inv_scale = None if inv_scale is None else _as_memory(inv_scale)
        lists = [src, src if dst is None else dst]
        _dispatch(
            "unscale",
            lists,
            lambda impl, ls, _: impl(
                ls[0], found_inf, inv_scale, dst=None if dst is None else ls[1]
            ),
            strided=2,
            # (In place, as torch's op writes an inference tensor anywhere.)
            written=None if dst is None or inv_scale is None else {"dst": 1},
        )
    _bumped((found_inf,), None if inv_scale is None else src if dst is None else dst)
    _reduce_over_shards(src, src_types, found_inf)


def _check_writable(
    op: str, facts: dict[int, ListFacts], written: dict[str, Sequence[torch.Tensor]]
) -> None:
    """RuntimeError where one of the lists ``written`` (by name), which the op writes in
    place, holds an inference tensor (made under ``torch.inference_mode``) and the op
    runs outside that mode: torch's in-place ops refuse to write one there (it keeps no
    version counter for autograd to check), and so do the references, which write with
    them; the kernels, writing memory, would not. Asked by ``_dispatch`` before
    anything is written, of the lists it has read the ``facts`` of (by id; a DTensor's
    local shards, so that FSDP2's lists are not asked tensor by tensor): some 2 us a
    step of seven lists here; a list that is not plain (a negative view among plain
    tensors) is asked tensor by tensor (``functional.write_refused``)."""
    for name, items in written.items():
        known = facts[id(items)]
        if known.plain and not known.inference:
            continue
        if any(map(write_refused, items)):
            raise RuntimeError(
                f"mpgemm.scaling.{op}: {name} holds an inference tensor (made under "
                "torch.inference_mode), which an in-place update outside InferenceMode "
                "may not write, as torch's in-place ops refuse to; clone it first, or "
                "step within torch.inference_mode"
            )


def _check_scalars(src, found_inf, inv_scale) -> None:
    device = src[0].device if src else found_inf.device if torch.is_tensor(found_inf) else None
    _check_scalar("unscale_", "found_inf", found_inf, device)
    if inv_scale is not None:
        _check_scalar("unscale_", "inv_scale", inv_scale, device)


def _check_lists(op: str, src, dst) -> Collection[type]:
    """Raises for lists that are not of tensors, or a ``dst`` of other shapes than
    ``src``'s; returns a collection holding every type in ``src`` (which tells whether
    any is a DTensor)."""
    if not torch.compiler.is_compiling():
        # Plain tensors, the usual case, answered from the lists' facts (their shapes
        # read in the same pass), which the op's dispatch and launch table read too.
        facts = list_facts(src, PLAIN_TYPES)
        dst_facts = facts if dst is None else list_facts(dst, PLAIN_TYPES)
        if facts.plain and dst_facts.plain and dst_facts.shapes == facts.shapes:
            return _PLAIN_SET
    _check_sequences(op, src=src, dst=dst)
    _check_shapes(op, "src", src, dst=dst)
    return set(map(type, src))


def _check_sequences(op: str, **lists) -> None:
    """TypeError where one of ``lists`` (by name; None: not given) holds anything but
    tensors, as torch's foreach and fused ops refuse one. Plain tensors, the usual case,
    are answered from the lists' facts, which the op reads anyway (not when traced)."""
    facts = not torch.compiler.is_compiling()
    for name, items in lists.items():
        if items is None or (facts and list_facts(items, PLAIN_TYPES).plain):
            continue
        for index, item in enumerate(items):
            if not isinstance(item, torch.Tensor):
                raise TypeError(
                    f"mpgemm.scaling.{op}: {name} must be a sequence of tensors, got "
                    f"{type(item).__name__} at index {index}"
                )


def _check_shapes(op: str, name: str, tensors: Sequence[torch.Tensor], **lists) -> None:
    """ValueError where one of ``lists`` (by name; None: not given) holds other shapes
    than ``tensors`` (named ``name``), position by position: the kernels walk each
    position's tensors as flat memory of one size, and the references' torch ops would
    broadcast a gradient of shape (1,) over its parameter. Lists of other lengths are
    left to ``_dispatch``, which says so."""
    facts = None if torch.compiler.is_compiling() else list_facts(tensors, PLAIN_TYPES)
    for other, given in lists.items():
        if given is None or len(given) != len(tensors):
            continue
        # (torch 2.11's dynamo cannot trace `is` between two lists; traced, the same
        # list's shapes are compared below as any other's)
        if facts is not None and given is tensors:
            continue
        if facts is not None and facts.plain:
            known = list_facts(given, PLAIN_TYPES)  # (read once within reading_once)
            if known.plain and known.shapes == facts.shapes:
                continue
        shapes = [tuple(t.shape) for t in given]
        expected = [tuple(t.shape) for t in tensors]
        if shapes != expected:
            raise ValueError(
                f"mpgemm.scaling.{op}: the shapes of {other} must be those of {name}, "
                f"got {shapes} for {expected}"
            )


# A list's numels as ``list_facts`` gives them (int64s in native order): one element.
_ONE_ELEMENT = array("q", [1]).tobytes()


def _check_counts(op: str, steps: Sequence[torch.Tensor]) -> None:
    """TypeError where a step count of ``steps`` is not FP32, ValueError where one has
    other than one element: each is read as one FP32 value, by the kernels as its
    bits (an FP64 count, as torch's Adam keeps it under a float64 default dtype, would
    be read as another number and advanced into half of its bits)."""
    facts = list_facts(steps, PLAIN_TYPES)  # (read once within reading_once)
    if facts.plain:
        dtypes, one_each = facts.dtypes, facts.numels == _ONE_ELEMENT * len(steps)
    else:
        dtypes, one_each = {t.dtype for t in steps}, all(t.numel() == 1 for t in steps)
    if others := dtypes - {torch.float32}:
        raise TypeError(
            f"mpgemm.scaling.{op}: the step counts (steps) must be float32, got "
            f"{', '.join(sorted(map(str, others)))}"
        )
    if not one_each:
        raise ValueError(f"mpgemm.scaling.{op}: each step count (steps) must have one element")


def _check_scalar(op: str, name: str, t, device: torch.device | None) -> None:
    """``t`` must be a one-element FP32 tensor on ``device``, as torch's op requires."""
    if not torch.is_tensor(t):
        raise TypeError(
            f"mpgemm.scaling.{op}: {name} must be a one-element float32 "
            f"tensor, got {type(t).__name__}"
        )
    if t.dtype != torch.float32:
        raise TypeError(f"mpgemm.scaling.{op}: {name} must be float32, got {t.dtype}")
    if t.numel() != 1:
        raise ValueError(
            f"mpgemm.scaling.{op}: {name} must have one element, got shape {tuple(t.shape)}"
        )
    if device is not None and t.device != device:
        raise ValueError(f"mpgemm.scaling.{op}: {name} is on {t.device}, the tensors on {device}")


def _as_memory(t: torch.Tensor) -> torch.Tensor:
    """``t``, or, where its values are not its memory's (``read_otherwise``: a negative
    view, whose memory holds their negation, or a zero tensor, which has none), a copy
    that holds them, for a kernel that reads a one-element tensor's memory (it read a
    negative-view ``inv_scale`` or ``lr`` with the wrong sign, and a zero tensor's
    address 0)."""
    return t.to(copy=True) if read_otherwise(t) else t


def _check_written_scalar(op: str, name: str, t: torch.Tensor, *, inference_refused: bool) -> None:
    """RuntimeError where the one-element tensor ``t`` (``name``), which the op writes,
    has values that are not its memory's (``read_otherwise``: the kernels would write
    a negative view's memory with their value, and a zero tensor has none: torch's
    unscale raises for both) or, with ``inference_refused``, where it is an inference
    tensor and the op runs outside ``torch.inference_mode`` (as torch's op, which
    writes it with its in-place ops, raises)."""
    if read_otherwise(t):
        raise RuntimeError(
            f"mpgemm.scaling.{op}: {name} is a negative view or a zero tensor, whose values "
            "are not its memory's, and the op writes it: give a tensor of its own "
            f"({name}.resolve_neg(), or torch.zeros for a zero tensor)"
        )
    if inference_refused and write_refused(t):
        raise RuntimeError(
            f"mpgemm.scaling.{op}: {name} is an inference tensor (made under "
            "torch.inference_mode), which an in-place update outside InferenceMode may "
            "not write, as torch's op refuses to; clone it first"
        )


def _reduce_over_shards(
    src: Sequence[torch.Tensor], src_types: Collection[type], found_inf: torch.Tensor
) -> None:
    """DTensor gradients (FSDP2's shards): each rank checked its own shards, so the flag
    is MAX-reduced over every mesh dimension the gradients are not replicated on, as
    torch's DTensor handler of ``_amp_foreach_non_finite_check_and_unscale_`` does.
    ``src_types``: holds every type in ``src``."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return
    if not any(issubclass(kind, dtensor) for kind in src_types):
        return
    sharded = next(cast("DTensor", t) for t in src if isinstance(t, dtensor))
    from torch.distributed.tensor import Replicate

    mesh = sharded.device_mesh
    for dim, placement in enumerate(sharded.placements):
        if not isinstance(placement, Replicate):
            torch.distributed.all_reduce(
                found_inf, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group(dim)
            )


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    *,
    skipped_steps: torch.Tensor | None = None,
    clear_found_inf: bool = False,
) -> None:
    """Back the ``scale`` off when ``found_inf`` is nonzero, grow it after
    ``growth_interval`` clean steps (``torch._amp_update_scale_``), count a skipped
    step in ``skipped_steps`` (a one-element int64 tensor) if given, and with
    ``clear_found_inf`` zero ``found_inf`` once read (so that it can serve as the next
    iteration's flag): on the device, in one launch. RuntimeError for a tensor it
    writes that is a negative view or a zero tensor, or, outside
    ``torch.inference_mode``, an inference tensor (``_check_written_scalar``); a
    ``found_inf`` it only reads is read as its value."""
    named = [("scale", scale), ("growth_tracker", growth_tracker), ("found_inf", found_inf)]
    if skipped_steps is not None:
        named.append(("skipped_steps", skipped_steps))
    for name, t in named:  # (as torch's op refuses a number: TypeError)
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"mpgemm.scaling.update_scale_: {name} must be a tensor, got {type(t).__name__}"
            )
    if skipped_steps is not None and (
        skipped_steps.dtype != torch.int64
        or skipped_steps.numel() != 1
        or skipped_steps.device != scale.device
    ):
        raise ValueError(
            "mpgemm.scaling.update_scale_: skipped_steps must be a one-element int64 tensor "
            f"on {scale.device}, got {skipped_steps.dtype} of shape "
            f"{tuple(skipped_steps.shape)} on {skipped_steps.device}"
        )
    if not torch.compiler.is_compiling():  # (dynamo cannot trace is_neg)
        written = {"scale": scale, "growth_tracker": growth_tracker, "skipped_steps": skipped_steps}
        if clear_found_inf:
            written["found_inf"] = found_inf
        for name, tensor in written.items():
            if tensor is not None:
                _check_written_scalar("update_scale_", name, tensor, inference_refused=True)
        found_inf = _as_memory(found_inf)
    impl: Callable
    if torch.compiler.is_compiling():
        impl = ops.update_scale_
    elif backend(scale.device) == "triton":
        impl = kernels()["update_scale"]
    else:
        impl = REFERENCES["update_scale"]
    impl(
        scale,
        growth_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        skipped_steps=skipped_steps,
        clear_found_inf=clear_found_inf,
    )
    if not torch.compiler.is_compiling():
        _bumped(
            (scale, growth_tracker),
            (found_inf,) if clear_found_inf else None,
            None if skipped_steps is None else (skipped_steps,),
        )


# The hyperparameters a step takes as a float or a one-element tensor, as torch's
# optimizers take them (``lr``; Adam's ``beta1``, ``beta2``).
_TENSOR_HYPERPARAMETERS = ("lr", "beta1", "beta2")
# The ones torch's optimizers also take as a one-element tensor, but as a number of the
# host's: torch's fused ops take them as floats, and so do mpgemm's kernels.
_HOST_HYPERPARAMETERS = ("momentum", "dampening", "weight_decay", "eps")


def _as_op_arguments(hyper: dict) -> dict:
    """``hyper`` as ``mpgemm.ops``' steps take it: a tensor hyperparameter as
    ``<name>_tensor``, with 0 for the float (a schema has no "float or Tensor")."""
    arguments = dict(hyper)
    for name in (*_TENSOR_HYPERPARAMETERS, *_HOST_HYPERPARAMETERS):
        if name in hyper:
            value = hyper[name]
            tensor = isinstance(value, torch.Tensor)
            arguments[name], arguments[f"{name}_tensor"] = (0.0, value) if tensor else (value, None)
    return arguments


def _one_element(name: str, value: torch.Tensor) -> None:
    if value.numel() != 1:
        raise ValueError(
            f"a tensor {name} must have one element, got one of shape {tuple(value.shape)}"
        )


def host_number(name: str, value: float | torch.Tensor) -> float:
    """A hyperparameter ``name`` (one of ``_HOST_HYPERPARAMETERS``, or a param group
    run's) as the float the kernels take: a one-element tensor read on the host, as
    torch's fused ops read it (a GPU tensor's read waits for the GPU). ValueError: a
    tensor of another size; RuntimeError: a CUDA tensor in a CUDA graph's capture,
    which cannot wait (its replays would keep the value read at the capture)."""
    if not isinstance(value, torch.Tensor):
        return value
    _one_element(name, value)
    if capturing(value.device):
        on_device = " (only lr and betas are read on the device)"
        raise RuntimeError(
            f"a CUDA tensor {name} is read on the host at every step, which a CUDA graph's "
            f"capture cannot do: give {name} as a float or a CPU tensor"
            + (on_device if name in _HOST_HYPERPARAMETERS else "")
        )
    return value.item()


def _hyperparameters_on(
    hyper: dict, params: Sequence[torch.Tensor], groups: ParamGroups | None = None
) -> tuple[dict, ParamGroups | None]:
    """``hyper`` and ``groups`` with each tensor hyperparameter where the step reads it:
    one of ``_TENSOR_HYPERPARAMETERS`` on the parameters' device as it is, on the CPU for
    another device as its value (as torch's fused optimizers take it: reading it waits
    for no GPU), on another device copied there, and so is one whose values are not its
    memory's (``_as_memory``), as are a scaler's ``grad_scale`` and ``found_inf``; one of
    ``_HOST_HYPERPARAMETERS`` as its value (``host_number``); in ``groups``' rows, any
    tensor as its value. ValueError: a
    tensor with other than one element, or rows giving their own value of a
    hyperparameter that ``hyper`` gives as a tensor (which the kernels read for every
    row)."""
    device = params[0].device
    for name in _TENSOR_HYPERPARAMETERS:
        value = hyper.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        _one_element(name, value)
        if value.device != device and value.device.type == "cpu":
            hyper = {**hyper, name: value.item()}
        elif value.device != device or read_otherwise(value):  # (a copy holds its values)
            hyper = {**hyper, name: value.to(device, copy=True)}
    for name in ("grad_scale", "found_inf"):  # (a scaler's, read by the kernels)
        value = hyper.get(name)
        memory = None if value is None else _as_memory(value)
        if memory is not value:
            hyper = {**hyper, name: memory}

    def numbers(row: dict, names: Iterable[str]) -> dict:
        tensors = [n for n in names if isinstance(row.get(n), torch.Tensor)]
        return {**row, **{n: host_number(n, row[n]) for n in tensors}} if tensors else row

    hyper = numbers(hyper, _HOST_HYPERPARAMETERS)
    if groups is not None:
        for name in _TENSOR_HYPERPARAMETERS:
            if isinstance(hyper.get(name), torch.Tensor) and any(name in r for r in groups.rows):
                raise ValueError(
                    f"a tensor {name} is read for every run of parameters, so the runs "
                    f"(groups=) cannot give {name} values of their own"
                )
        groups = groups._replace(rows=tuple(numbers(row, row) for row in groups.rows))
    return hyper, groups


def sgd_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor] | None,
    *,
    compute_copies: Sequence[torch.Tensor] | None = None,
    steps: Sequence[torch.Tensor] | None = None,
    groups: ParamGroups | None = None,
    **hyper,
) -> None:
    """One SGD step of ``mpgemm.scaling_ref.sgd_step_ref_``'s math, fused per dtype.
    ``compute_copies``: per parameter, its compute copy (``mpgemm.compute_copy``) to
    write from the updated value, or the parameter itself for none. ``steps``: with
    momentum and ``dampening``, each parameter's count of steps taken before this one
    (FP32, one element, on its device), which tells a buffer's first step; the step
    advances it where it is taken. ``lr`` may be a one-element tensor, read on the
    device at each step; so may ``momentum``, ``dampening`` and ``weight_decay``, read
    on the host (``_hyperparameters_on``). ``groups``: float hyperparameters
    per run of parameters (``ParamGroups``: param groups stepped in one launch,
    ``mpgemm.optim``; compiled, a call per run), which must agree with those given on
    whether momentum and dampening are nonzero.

    Raises ValueError for momentum with dampening and no ``steps``, or for gradients,
    buffers or copies of other shapes than the parameters'."""
    compiling = torch.compiler.is_compiling()
    momentum, dampening = (host_number(n, hyper.get(n, 0.0)) for n in ("momentum", "dampening"))
    if momentum != 0 and dampening != 0 and steps is None:
        raise ValueError(
            "mpgemm.scaling.sgd_step_: momentum with dampening needs the parameters' step "
            "counts (steps=)"
        )
    if compiling:
        if groups is not None:  # (the op takes one value of each: a call per run)
            arguments: dict[str, Any] = dict(params=params, grads=grads)
            arguments |= dict(momentum_buffers=momentum_buffers, steps=steps, **hyper)
            arguments |= dict(compute_copies=compute_copies)
            return scaling_ref.each_run(sgd_step_, groups, arguments)
        ops.sgd_step_(
            *_shards(params, grads, momentum_buffers or (), compute_copies or (), steps or ()),
            **_as_op_arguments({"dampening": 0.0, **hyper}),  # (the op's schema has no default)
        )
        return
    copies = params if compute_copies is None else compute_copies
    # The buffers are walked with the parameters; the step counts, read once a program,
    # come last.
    buffers = [] if momentum_buffers is None else [momentum_buffers]
    counts = [] if steps is None else [steps]
    with reading_once():  # the checks, the split by dtype and the launch table
        lists = dict(grads=grads, momentum_buffers=momentum_buffers, compute_copies=compute_copies)
        _check_sequences("sgd_step_", params=params, steps=steps, **lists)
        if params:
            hyper, groups = _hyperparameters_on(hyper, params, groups)
        _check_shapes("sgd_step_", "params", params, **lists)
        if steps is not None:
            _check_counts("sgd_step_", steps)
        unscaled = grads if hyper.get("grad_scale") is not None else None
        # The lists the step writes, by index (the gradients where it unscales them).
        written = {"params": 0, "compute_copies": 2}
        written |= {"momentum_buffers": 3} if buffers else {}
        written |= {"steps": 3 + len(buffers)} if counts else {}
        written |= {"grads": 1} if unscaled is not None else {}
        _dispatch(
            "sgd_step",
            [params, grads, copies, *buffers, *counts],
            lambda impl, ls, runs: impl(
                ls[0],
                ls[1],
                ls[3] if buffers else None,
                compute_copies=ls[2],
                steps=ls[-1] if counts else None,
                groups=runs,
                **hyper,
            ),
            strided=3 + len(buffers),
            copies=2,
            groups=groups,
            written=written,
        )
    # (A parameter listed as its own copy is bumped twice, which is as good as once.)
    _bumped(params, unscaled, compute_copies, momentum_buffers, steps)


def adam_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    compute_copies: Sequence[torch.Tensor] | None = None,
    max_exp_avg_sqs: Sequence[torch.Tensor] | None = None,
    groups: ParamGroups | None = None,
    **hyper,
) -> None:
    """One Adam/AdamW step of ``mpgemm.scaling_ref.adam_step_ref_``'s math, fused per
    dtype. ``steps``: each parameter's count of steps taken before this one (FP32, one
    element, on its device), advanced by the step where it is taken.
    ``compute_copies`` as for ``sgd_step_``; ``max_exp_avg_sqs``: AMSGrad's maxima of
    the second moments (None: plain Adam); ``lr``, ``beta1`` and ``beta2`` may be
    one-element tensors, as ``sgd_step_``'s ``lr``, and ``eps`` and ``weight_decay``, as
    its ``weight_decay``; ``groups`` as ``sgd_step_``'s.

    Raises ValueError for gradients, moments or copies of other shapes than the
    parameters'."""
    if torch.compiler.is_compiling():
        if groups is not None:  # (the op takes one value of each: a call per run)
            arguments: dict[str, Any] = dict(params=params, grads=grads, exp_avgs=exp_avgs)
            arguments |= dict(exp_avg_sqs=exp_avg_sqs, steps=steps, compute_copies=compute_copies)
            arguments |= dict(max_exp_avg_sqs=max_exp_avg_sqs, **hyper)
            return scaling_ref.each_run(adam_step_, groups, arguments)
        ops.adam_step_(
            *_shards(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                steps,
                compute_copies or (),
                max_exp_avg_sqs or (),
            ),
            **_as_op_arguments(hyper),
        )
        return
    copies = params if compute_copies is None else compute_copies
    # AMSGrad's maxima are walked with the moments, before the copies and step counts.
    maxima = [] if max_exp_avg_sqs is None else [max_exp_avg_sqs]
    with reading_once():  # the checks, the split by dtype and the launch table
        lists: dict[str, Sequence[torch.Tensor] | None] = dict(
            grads=grads,
            exp_avgs=exp_avgs,
            exp_avg_sqs=exp_avg_sqs,
            max_exp_avg_sqs=max_exp_avg_sqs,
            compute_copies=compute_copies,
        )
        _check_sequences("adam_step_", params=params, steps=steps, **lists)
        if params:
            hyper, groups = _hyperparameters_on(hyper, params, groups)
        _check_shapes("adam_step_", "params", params, **lists)
        _check_counts("adam_step_", steps)
        unscaled = grads if hyper.get("grad_scale") is not None else None
        written = {"params": 0, "exp_avgs": 2, "exp_avg_sqs": 3}
        written |= {"max_exp_avg_sqs": 4} if maxima else {}
        written |= {"compute_copies": 4 + len(maxima), "steps": 5 + len(maxima)}
        written |= {"grads": 1} if unscaled is not None else {}
        _dispatch(
            "adam_step",
            [params, grads, exp_avgs, exp_avg_sqs, *maxima, copies, steps],
            lambda impl, ls, runs: impl(
                *ls[:4],
                ls[-1],
                compute_copies=ls[-2],
                max_exp_avg_sqs=ls[4] if maxima else None,
                groups=runs,
                **hyper,
            ),
            strided=5 + len(maxima),
            copies=4 + len(maxima),
            groups=groups,
            written=written,
        )
    _bumped(params, unscaled, compute_copies, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
