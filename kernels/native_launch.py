"""Launches of a compiled kernel from C++ (``native_launch.cpp``), for launches that
repeat an earlier one with new tensors of the same layout: ``triton_gemm``'s replays,
and the launch layer's later launches of a cached binary on the grid of its first
(``launches._launch_binary``).

Such a launch changes only its tensors' addresses and its float arguments: its
integers, its grid, its binary and its descriptors' shapes, strides and tiles are the
same each time (a replay's signature holds them; a binary's key holds every integer).
``plan`` lays out, once, every kernel parameter the binary takes, in the order and
widths Triton's launcher passes them (the signature without its constexprs; a tensor
descriptor as its 128-byte tensor map, then its shape as int32s and its strides as
int64s; then the global and profile scratch pointers), with the addresses and floats
left to fill; ``launch`` fills them from the sources given and calls
``cuLaunchKernelEx``. The launch layer's and Triton's Python (the argument list, the
launcher's scratch allocation and descriptor expansion, the TensorDescriptor objects
themselves) is not run: on the H200's host it took some 35 of a replayed
``mpgemm.matmul``'s 57 us.

Off unless ``MPGEMM_NATIVE_LAUNCH=1`` (``enabled``), until a GPU has timed it and run
the suite with it: ``tests/test_native_launch.py`` checks on the CPU, under a stand-in
driver (``tests/fake_libcuda.c``), that every planned launch hands the driver the same
bytes as Triton's launcher, for both triton versions this project meets.

Launches that ``plan`` cannot lay out (a bool, FP64 or tuple parameter, a descriptor
without Triton's metadata, scratch memory, clusters, more than 228 KiB of shared
memory) keep Triton's launcher, as do launches while Triton's launch hooks are set.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["enabled", "launch", "module", "plan"]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_launch.cpp")

# Integer parameters' widths in bytes, by Triton's type name.
_WIDTHS = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4}
_WIDTHS.update({"i64": 8, "u64": 8})
# Triton's TMA element types on the device, as the host's driver numbers them
# (triton's TMA_DTYPE_DEVICE_TO_HOST, the same in 3.6 and 3.9).
_HOST_DTYPES = {8: 10, 9: 8, 10: 9}


# Read once: ``enabled`` is asked at every launch.
_ENABLED = os.environ.get("MPGEMM_NATIVE_LAUNCH") == "1"


def enabled() -> bool:
    """Whether the launches that repeat an earlier one are made from C++:
    ``MPGEMM_NATIVE_LAUNCH=1`` in the environment when this module was imported, and
    the helper built (``module``)."""
    return _ENABLED and module() is not None


@functools.cache
def module():
    """The C++ launcher, built (or loaded from torch's extension cache) on first use
    against the CUDA header in the triton wheel; None where it cannot be (warned)."""
    try:
        import triton
        from torch.utils.cpp_extension import load

        from mpgemm.native import build_folder

        folder, source = build_folder(_SOURCE, "mpgemm_native_launch")
        include = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
        return load(
            name="mpgemm_native_launch",
            sources=[source],
            build_directory=folder,
            extra_include_paths=[include],
            extra_cflags=["-O2"],
            extra_ldflags=["-ldl"],
        )
    except Exception as error:  # no compiler or ninja
        warnings.warn(
            f"mpgemm: the C++ launcher did not build ({type(error).__name__}: {error}); "
            "replays keep Triton's launcher",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _integer(value: int, width: int, signed: bool = True) -> tuple[str, bytes]:
    # OverflowError for a value its type cannot hold (plan: none).
    return ("bytes", int(value).to_bytes(width, "little", signed=signed))


def _tensor_map(descriptor: TensorDescriptor, meta: dict, source: int) -> tuple | None:
    """The parameter of a descriptor's tensor map, encoded as Triton's
    ``fillTMADescriptor`` encodes it (dimensions innermost first, strides in bytes, no
    out-of-bounds fill); None for what no mpgemm kernel describes (a NaN padding, FP4
    padding, im2col, TF32 rounding)."""
    if (
        descriptor.padding != "zero"
        or meta.get("fp4_padded")
        or meta.get("is_im2col")
        or getattr(descriptor, "round_f32_to_tf32", False)
    ):
        return None
    size = meta["elem_size"]
    return (
        "map",
        source,
        _HOST_DTYPES.get(meta["elem_type"], meta["elem_type"]),
        tuple(reversed(descriptor.shape)),
        tuple(size * s for s in reversed(descriptor.strides[:-1])),
        tuple(reversed(meta["block_size"])),
        meta["swizzle"],
        0,  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE
    )


def plan(binary, grid: Sequence[int], args: Sequence, sources: Sequence):
    """The plan of a launch of ``binary`` (the launch layer's ``_Binary``) on ``grid``
    with ``args`` (the positional arguments its launcher is given, before the binary's
    ``tail``), to be repeated by ``launch`` with ``sources``: the tensors and floats of
    the arguments, in order (a descriptor's: the tensor it describes), each with the
    address or value it has now; every other value is the plan's for good. None where
    this launch is not one ``launch`` can repeat."""
    compiled = binary.compiled
    metadata = getattr(compiled, "metadata", None)
    if (
        metadata is None  # a stand-in binary (bench/host_time.py's), nothing to launch
        or not compiled.function
        or getattr(metadata, "num_ctas", 1) != 1
        # Triton 3.9's launcher adds an oversized-shared-memory attribute above 228 KiB
        # (more than a Hopper block may have): not laid out here.
        or metadata.shared > 228 * 1024
        or metadata.global_scratch_size
        or metadata.profile_scratch_size
        or not 1 <= len(grid) <= 3
        or any(g <= 0 for g in grid)
    ):
        return None
    signature = list(compiled.src.signature.values())
    values = (*args, *binary.tail)
    if len(signature) != len(values):
        return None
    try:
        params = _parameters(signature, values, sources, metadata)
    except (IndexError, OverflowError):  # fewer sources; an integer wider than its type
        return None
    if params is None:
        return None
    return module().plan(
        compiled.function,
        (*grid, *(1,) * (3 - len(grid))),
        32 * metadata.num_warps,
        metadata.shared,
        bool(metadata.launch_pdl),
        bool(metadata.launch_cooperative_grid),
        tuple(params),
    )


def _parameters(signature: list, values: Sequence, sources: Sequence, metadata) -> list | None:
    """``plan``'s parameters: one per kernel parameter, in order, with the global and
    profile scratch pointers last; None for a value it cannot lay out."""
    descriptors = iter(getattr(metadata, "tensordesc_meta", None) or ())
    params: list[tuple] = []
    source = 0
    for kind, value in zip(signature, values, strict=True):
        if kind == "constexpr":
            continue
        if not isinstance(kind, str):  # a tuple of parameters
            return None
        if kind.startswith("*"):
            if isinstance(value, torch.Tensor):
                if sources[source].data_ptr() != value.data_ptr():
                    return None
                params.append(("address", source))
                source += 1
            elif value is None:
                params.append(_integer(0, 8))
            else:
                return None
        elif kind.startswith("tensordesc"):
            meta = next(descriptors, None)
            if meta is None or not isinstance(value, TensorDescriptor):
                return None
            if sources[source].data_ptr() != value.base.data_ptr():
                return None
            tensor_map = _tensor_map(value, meta, source)
            if tensor_map is None:
                return None
            params.append(tensor_map)
            source += 1
            params += [_integer(s, 4) for s in value.shape]
            params += [_integer(s, 8) for s in value.strides]
        elif kind in _WIDTHS and type(value) is int:
            params.append(_integer(value, _WIDTHS[kind], signed=kind.startswith("i")))
        elif kind == "fp32" and type(value) is float:
            if sources[source] != value:
                return None
            params.append(("float32", source))
            source += 1
        else:  # a bool (not in the launch layer's key), a float of another width
            return None
    if source != len(sources):
        return None
    return [*params, _integer(0, 8), _integer(0, 8)]  # the global and profile scratch: none


def launch(planned, stream: int, *sources) -> None:
    """Launch ``planned`` (``plan``) on ``stream`` with ``sources`` in its tensors' and
    floats' places."""
    module().launch(planned, stream, *sources)
