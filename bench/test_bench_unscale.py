"""unscale: the fused unscale + inf check against
``torch._amp_foreach_non_finite_check_and_unscale_``, in place, and the check alone
(what a fused optimizer step needs), on the gradients of a 4096-wide 4-layer MLP and on
100M elements in 200 tensors. Work: bytes read and written (read only for the check).
``device_copy`` copies the same tensors (``torch._foreach_copy_``), moving the same
bytes: mpgemm's ratio to it is the fraction of the reachable bandwidth it achieves."""

import pytest
import torch
from harness import GPU_SCALE

from mpgemm.scaling import unscale_

pytestmark = pytest.mark.benchmark(group="unscale")

WIDTH, LAYERS, MANY, COUNT = (4096, 4, 500_000, 200) if GPU_SCALE else (64, 4, 5_000, 20)
SETS = [f"mlp_{WIDTH}x{LAYERS}_fp32", f"{COUNT}x{MANY}_fp32", f"{COUNT}x{MANY}_fp16"]
# What the targets read (``bench/report.py``; ``MPGEMM_BENCH_TARGETS=1`` runs it
# alone): every set, against torch's op and a copy.
TARGET_CASES = set(SETS)
TARGET_IMPLS = {"mpgemm", "torch", "device_copy"}


def _gradients(name, device):
    if name.startswith("mlp"):
        return [
            t
            for _ in range(LAYERS)
            for t in (torch.randn(WIDTH, WIDTH, device=device), torch.randn(WIDTH, device=device))
        ]
    dtype = torch.float16 if name.endswith("fp16") else torch.float32
    return [torch.randn(MANY, device=device, dtype=dtype) for _ in range(COUNT)]


@pytest.mark.parametrize("impl", ["mpgemm", "torch", "mpgemm_check_only", "device_copy"])
@pytest.mark.parametrize("name", SETS)
def test_unscale(run_case, device, name, impl):
    grads = _gradients(name, device)
    found = torch.zeros((), device=device)
    # inv_scale 1 keeps the values as they are however many rounds run.
    inv = torch.ones((), device=device)
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    copies = [torch.empty_like(g) for g in grads] if impl == "device_copy" else []
    fn = {
        "mpgemm": lambda: unscale_(grads, found, inv),
        "torch": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv),
        "mpgemm_check_only": lambda: unscale_(grads, found, None),
        "device_copy": lambda: torch._foreach_copy_(copies, grads),
    }[impl]
    moved = nbytes if impl == "mpgemm_check_only" else 2 * nbytes
    run_case(fn, case=name, impl=impl, bytes=moved)
