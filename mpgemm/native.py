"""What the loss-scaling ops ask of every tensor of a list, in one pass: ``list_facts``;
and the version bump of every tensor they write: ``bump_versions``.

An unscale or optimizer step checks each of its lists (types, dtypes, contiguity,
shapes, devices) and reads each tensor's numel and address for its launch table. Each
attribute read from Python costs 60 to 80 ns through torch's bindings, even mapped in
C: some 14 us per pass over 200 tensors, several passes per list, hundreds of
microseconds of host time per step of a model with hundreds of parameters. So
``list_facts.cpp`` reads a whole list in C++ (about 2 us for 200 tensors), built on first
use by torch's extension builder (``torch.utils.cpp_extension.load``: a C++ compiler and
ninja), in some 25 s, into a folder of torch's extension directory named by the
source's contents, torch's version and Python's (``build_folder``), so that a machine
builds it once and later processes load it, whichever checkout or install they import
it from (torch's own folder, by name alone, holds a ninja file with the source's path,
and rebuilt the helper for each checkout in turn). Where it cannot be built (no
compiler, no ninja; or ``MPGEMM_NATIVE=0``), the same facts come from passes in Python,
with one warning.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import os
import sys
import threading
import warnings
from array import array
from collections.abc import Sequence
from typing import NamedTuple

import torch

from mpgemm.functional import read_otherwise

__all__ = [
    "ListFacts",
    "bump_versions",
    "list_facts",
    "native_list_facts",
    "native_module",
    "reading_once",
]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "list_facts.cpp")


class ListFacts(NamedTuple):
    """What ``list_facts`` reads. ``plain``: every tensor's type is one of the plain types
    asked for, and its values are its memory's, as a kernel reads them (not a negative
    view, nor a zero tensor: ``functional.read_otherwise``); when not, the other fields
    are empty (a subclass's metadata may run Python, or it may have no memory of its
    own). ``dtypes`` and ``devices`` (device indices, -1 for the CPU): the sets the
    tensors hold; ``contiguous``: all are; ``shapes``: each tensor's ndim, then its
    sizes; ``numels`` and ``addresses`` (``data_ptr``): one each per tensor; all three
    int64s in native byte order; ``inference``: any is an inference tensor (made under
    ``torch.inference_mode``, which torch's in-place ops write only within it)."""

    plain: bool
    dtypes: set[torch.dtype]
    devices: set[int]
    contiguous: bool
    shapes: bytes
    numels: bytes
    addresses: bytes
    inference: bool


class _Reading(threading.local):
    # While an op reads its lists (``reading_once``): each list's facts by the list's
    # id, with the list and the plain types asked for; else None.
    facts: dict[int, tuple[Sequence[torch.Tensor], tuple[type, ...], ListFacts]] | None = None


_reading = _Reading()


class reading_once:
    """Within the block, ``list_facts`` reads each list once: asked again of the same
    list object (an op's checks, its split by dtype and its launch table each ask), it
    answers what it read. For a block in which the lists do not change: one op's call.
    Blocks may nest (the outermost one's reads serve them all); each thread has its
    own."""

    __slots__ = ("_opened",)

    def __enter__(self) -> None:
        self._opened = _reading.facts is None
        if self._opened:
            _reading.facts = {}

    def __exit__(self, *exc: object) -> None:
        if self._opened:
            _reading.facts = None


def list_facts(tensors: Sequence[torch.Tensor], plain_types: tuple[type, ...]) -> ListFacts:
    """The ``ListFacts`` of ``tensors`` (a list or tuple of tensors), read in C++ where the
    helper is built, else in Python: the same facts either way (within ``reading_once``,
    read once per list)."""
    read = _reading.facts
    if read is not None:
        known = read.get(id(tensors))
        if known is not None and known[0] is tensors and known[1] is plain_types:
            return known[2]
    native = native_list_facts()
    if native is not None:
        facts = ListFacts(*native(tensors, plain_types))
    else:
        facts = python_list_facts(tensors, plain_types)
    if read is not None:
        read[id(tensors)] = (tensors, plain_types, facts)
    return facts


_dtype = operator.attrgetter("dtype")
# A tensor's device as an int (-1 for the CPU), read without making a torch.device.
_device_index = torch.Tensor.get_device


def python_list_facts(tensors: Sequence[torch.Tensor], plain_types: tuple[type, ...]) -> ListFacts:
    """``list_facts`` by passes in Python (where the C++ helper is not built)."""
    if not set(map(type, tensors)) <= set(plain_types) or any(map(read_otherwise, tensors)):
        return ListFacts(False, set(), set(), False, b"", b"", b"", False)
    shapes = array("q")
    for t in tensors:
        shapes.append(t.dim())
        shapes.extend(t.shape)
    return ListFacts(
        True,
        set(map(_dtype, tensors)),
        set(map(_device_index, tensors)),
        all(map(torch.Tensor.is_contiguous, tensors)),
        shapes.tobytes(),
        array("q", map(torch.Tensor.numel, tensors)).tobytes(),
        array("q", map(torch.Tensor.data_ptr, tensors)).tobytes(),
        any(map(torch.Tensor.is_inference, tensors)),
    )


@functools.cache
def native_module():
    """The C++ helper (``list_facts``, ``bump_versions``), built (or loaded from torch's
    extension cache) on first use; None where it cannot be (warned once) or
    ``MPGEMM_NATIVE=0``."""
    if os.environ.get("MPGEMM_NATIVE", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        folder, source = build_folder(_SOURCE)
        return load(
            name="mpgemm_list_facts",
            sources=[source],
            build_directory=folder,
            extra_cflags=["-O2"],
        )
    except Exception as error:  # no compiler or ninja, or headers it cannot build with
        warnings.warn(
            f"mpgemm: the C++ list helper did not build ({type(error).__name__}: {error}); "
            "the loss-scaling ops read their tensors in Python (more host time per step)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def build_folder(path: str, name: str = "mpgemm_list_facts") -> tuple[str, str]:
    """(folder, source): where the extension ``name`` whose source is the file at
    ``path`` is built, in torch's extension directory, and the copy of that source it is
    built from: both named by the source's contents and the torch and Python it is built
    for, not by ``path`` (the copy is made once)."""
    from torch.utils.cpp_extension import get_default_build_root

    with open(path, "rb") as f:
        text = f.read()
    build = f"{torch.__version__} {torch.version.cuda} {torch.version.hip} {sys.version}"
    key = hashlib.sha256(text + build.encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    folder = os.path.join(root, f"{name}_{key}")
    source = os.path.join(folder, os.path.basename(path))
    if not os.path.exists(source):
        os.makedirs(folder, exist_ok=True)
        partial = f"{source}.{os.getpid()}"
        with open(partial, "wb") as f:
            f.write(text)
        os.replace(partial, source)  # whole, for a process that builds it meanwhile
    return folder, source


def native_list_facts():
    """The C++ ``list_facts``, or None where the helper is not built (``native_module``)."""
    module = native_module()
    return None if module is None else module.list_facts


def bump_versions(tensors: Sequence[torch.Tensor]) -> None:
    """Bump the version counter of each tensor of ``tensors`` (a list or tuple), as
    torch's in-place ops do, for what a kernel wrote in place; inference tensors, which
    have none, are left. ``torch.autograd.graph.increment_version``'s effect, in C++
    where the helper is built: 11 ns a tensor here, against its 75."""
    module = native_module()
    if module is None:
        torch.autograd.graph.increment_version(tensors)
    else:
        module.bump_versions(tensors)
