"""Programmatic dependent launch (Hopper's PDL), off unless asked for.

Each kernel of a step waits for the one before it, and between them the GPU drains one
grid and starts the next: in run6's graphed guide step (H200) some 125 us of 1.85 ms
lay between and around 17 kernels. Launched with PDL (``launch_pdl``), a kernel's
programs may start while the kernel before it in the stream is finishing, as soon as
all of that kernel's programs have started and said so; each then waits, before it
touches global memory, until that kernel has completed and its writes are visible.

Every mpgemm kernel takes a ``PDL`` constexpr and opens with ``wait_for_prior_grid``:
with PDL it waits (``griddepcontrol.wait``) and then lets the next kernel start
(``griddepcontrol.launch_dependents``); without it, nothing (the binary is the one
compiled before). The wait comes first, in every program, before any load or store: a
kernel whose programs all waited has completed only after the kernel before it, so the
order of the stream holds transitively, whatever reads what. A kernel launched without
PDL (torch's) waits for everything before it, as always.

``enable(True)`` (or ``MPGEMM_PDL=1`` in the environment) makes ``launches.launch``
pass ``PDL`` and ``launch_pdl`` to every launch on a GPU of compute capability 9.0 or
more; not under the interpreter, which has no grids to overlap. Off by default: on an
H200 (run8) the graphed guide step took 0.98x as long without it and the small MLP's
1.02x, to the same bits (``bench/ab_graph.py`` times it beside the other variants).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mpgemm.kernels.gemm_common import INTERPRET

# The keyword arguments of a launch with PDL: the kernels' constexpr, and triton's
# launch option (a compile option: the binary's launcher sets the launch attribute).
OPTIONS = {"PDL": True, "launch_pdl": True}
# Hopper's griddepcontrol instructions; ptxas refuses them for older targets.
MIN_CAPABILITY = (9, 0)

_requested = os.environ.get("MPGEMM_PDL", "0") == "1"
_active: bool | None = None  # decided at the first launch that asks


@triton.jit
def wait_for_prior_grid(PDL: tl.constexpr):
    """With PDL: wait until the kernel launched before this one has completed and its
    memory is visible, then let the kernel after this one start its programs. The first
    thing every mpgemm kernel does."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def enable(flag: bool) -> None:
    """Launch mpgemm's kernels with PDL (``flag``) or without, from the next launch on.
    Raises RuntimeError if a visible GPU is older than Hopper. The launches made before
    are not repeated afterwards (``launches.relaunch``): their binaries are forgotten."""
    global _requested, _active
    from mpgemm.kernels import launches  # (which imports this module)

    if flag and not INTERPRET and torch.cuda.is_available():
        older = [i for i in range(torch.cuda.device_count()) if not _capable(i)]
        if older:
            raise RuntimeError(
                f"mpgemm: programmatic dependent launch needs compute capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or more; cuda:{older[0]} has "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(older[0])))}"
            )
    _requested, _active = flag, None
    launches.forget_binaries()


def enabled() -> bool:
    """Whether launches now pass ``OPTIONS``: PDL was asked for, the kernels are
    compiled (not interpreted), and every visible GPU has compute capability 9.0 or
    more (asked once: a launch must not initialise CUDA before it runs)."""
    global _active
    if _active is None:
        _active = (
            _requested
            and not INTERPRET
            and all(_capable(i) for i in range(torch.cuda.device_count()))
        )
    return _active


def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY
