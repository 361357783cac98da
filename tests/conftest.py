"""Run the Triton kernels on CUDA when there is a GPU, else through the interpreter.

TRITON_INTERPRET must be set before triton is first imported, hence at the top here.
"""

import math
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch._subclasses.fake_tensor import is_fake  # noqa: E402


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter swaps ``triton.language``'s builtins for numpy ones at each
    launch, and again at each call of a ``@triton.jit`` helper inside the kernel, though
    they are swapped already: an ``inspect.getmembers`` over the language per call, over
    half the interpreted time of an optimizer step (triton 3.6 and 3.9). Skip the swap
    when every language module the helper sees is swapped already (its ``load`` is no
    longer the builtin); the launch's own swap, and its undoing, are untouched. Where
    triton's interpreter is not laid out so, nothing changes."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    swap = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if swap is None or scope is None:
        return

    def swap_unless_swapped(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):
            return scope()  # nothing swapped, nothing to undo
        return swap(fn)

    interpreter._patch_lang = swap_unless_swapped


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()
    # Triton makes a kernel interpreted or compiled when its module is imported, by
    # TRITON_INTERPRET then. Some tests set it to 0 for a while (launches stubbed, the
    # reference path); a kernel module first imported there kept compiled kernels,
    # which every later test in the process then failed to launch on the CPU ("0
    # active drivers": tests/test_tracers.py after tests/test_step_memory.py).
    import mpgemm.kernels.activation  # noqa: E402, F401
    import mpgemm.kernels.arrivals  # noqa: E402, F401
    import mpgemm.kernels.cross_entropy  # noqa: E402, F401
    import mpgemm.kernels.fused_optim  # noqa: E402, F401
    import mpgemm.kernels.gemm  # noqa: E402, F401
    import mpgemm.kernels.gemm_tma  # noqa: E402, F401
    import mpgemm.kernels.unscale  # noqa: E402, F401
    import mpgemm.kernels.update_scale  # noqa: E402, F401

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def on_path(device, monkeypatch):
    """``on_path(path)``: the device a test runs on along ``path``. "kernels": the
    test's device (compiled kernels on a GPU, interpreted ones here); "reference": the
    CPU, with CPU tensors on the reference path (torch ops: what they run without the
    interpreter, a CPU user's every op) for the rest of the test."""

    def choose(path: str) -> torch.device:
        if path == "kernels":
            return device
        from mpgemm import functional

        monkeypatch.setattr(functional, "_interpreting", lambda: False)
        cpu = torch.device("cpu")
        assert functional.backend(cpu) == "reference"
        return cpu

    return choose


@pytest.fixture(params=["kernels", "reference"])
def path_device(request, on_path) -> torch.device:
    """The test, once along each path (``on_path``): the device it runs on."""
    return on_path(request.param)


@pytest.fixture(autouse=True)
def fresh_gemm_replays():
    """Each test starts with no ``triton_gemm`` replays: a replay is keyed by its launch's
    signature, not by what a test patches (``multiprocessors``, ``split_k_for``), so one
    kept from an earlier test would run another test's GEMM without its patch. (Only
    compiled kernels replay: on a GPU.)"""
    gemm = sys.modules.get("mpgemm.kernels.gemm")
    if gemm is not None:
        gemm._replays.clear()
    # (``matmul``'s decisions kept for its replays: each ends in the replays above.)
    functional = sys.modules.get("mpgemm.functional")
    if functional is not None:
        functional._matmul_replays.clear()


# torch.device(...) as a context reads its set of factory functions once, from what
# torch.empty is then (torch.utils._device._device_constructors): read while a test had
# it patched, the set held the wrapper, the real function it calls was not in it, and
# under `with torch.device("meta")` layers came out on the CPU. Read here, first.
try:
    from torch.utils._device import _device_constructors
except ImportError:  # a torch without it has nothing to prime
    pass
else:
    _device_constructors()


def _poisoned(make):
    def allocate(*args, **kwargs):
        t = make(*args, **kwargs)
        # Not in code torch.compile traces, nor in tensors its passes make: traced,
        # the fill became a copy_ into a graph intermediate that inductor rejects (an
        # AssertionError in its passes); under torch 2.11 is_compiling() is False while
        # AOT autograd traces (its tensors are fake) and in inductor's pattern matcher
        # (example inputs that require grad, which fill_ refuses). Compiled results
        # are compared with eager ones, which are poisoned.
        if torch.compiler.is_compiling() or t.requires_grad or is_fake(t):
            return t
        if t.is_floating_point() and t.device.type != "meta":
            t.fill_(math.nan)
        return t

    return allocate


# Made once for the session: dynamo builds its map of torch's functions once, from what
# torch.empty_like is then (trace_rules.get_torch_obj_rule_map). Built while a test had
# patched it, the map held that test's wrapper; a later test's wrapper, another object,
# was traced into, down to the real function, which the map then lacked: a compiled
# step that allocates a gradient failed with "Attempted to call function marked as
# skipped" after some other tests had run in the same process.
_POISONED = {
    name: _poisoned(getattr(torch, name)) for name in ("empty", "empty_like", "empty_strided")
}


@pytest.fixture(autouse=True)
def poison_allocations(request, monkeypatch):
    """Every floating tensor made by torch.empty/empty_like/empty_strided starts as NaN,
    so an output element the kernels leave unwritten fails the test (NaN never passes);
    not in tests marked ``unpoisoned``."""
    if request.node.get_closest_marker("unpoisoned"):
        return
    for name, poisoned in _POISONED.items():
        monkeypatch.setattr(torch, name, poisoned)


@pytest.fixture
def fake_second_device(monkeypatch):
    """``fake_second_device(ids, *modules)``: the tensors whose ``id`` is in ``ids`` read
    as on device 1, the others on device 0 (every tensor is on one device here), to
    ``modules``' reads of the lists' facts (``mpgemm.native.list_facts``, as each
    imported it) and to ``mpgemm.scaling``'s split by device."""
    from mpgemm import native, scaling

    def fake(ids, *modules):
        def index(t):
            return int(id(t) in ids)

        def facts(tensors, plain_types):
            real = native.python_list_facts(tensors, plain_types)
            return real._replace(devices=set(map(index, tensors))) if real.plain else real

        for module in modules:
            monkeypatch.setattr(module, "list_facts", facts)
        monkeypatch.setattr(scaling, "_device_index", index)

    return fake
