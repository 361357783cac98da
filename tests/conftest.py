"""Run the Triton kernels on CUDA when there is a GPU, else through the interpreter.

TRITON_INTERPRET must be set before triton is first imported, hence at the top here.
"""

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch._subclasses.fake_tensor import is_fake  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(autouse=True)
def poison_allocations(request, monkeypatch):
    """Every floating tensor made by torch.empty/empty_like starts as NaN, so an output
    element the kernels leave unwritten fails the test (NaN never passes); not in tests
    marked ``unpoisoned``."""
    if request.node.get_closest_marker("unpoisoned"):
        return
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(make):
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

    monkeypatch.setattr(torch, "empty", poisoned(real_empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(real_empty_like))
