"""cross_entropy: ``mpgemm.cross_entropy`` (one launch forward, one backward) against
``torch.nn.functional.cross_entropy`` (log-softmax and NLL, then their backward), the
mean loss's forward and backward together: on the guide MLP's FP32 logits (8192 x 10:
launch-bound, where torch's NLL forward reduces on one block) and on a language
model's FP16 logits (8192 x 32000: bandwidth-bound). Work: the logits read forward
and backward and their gradient written."""

import pytest
import torch
import torch.nn.functional as F
from harness import GPU_SCALE

import mpgemm

pytestmark = pytest.mark.benchmark(group="cross_entropy")

ROWS = 8192 if GPU_SCALE else 64
CASES = {f"{ROWS}x10_fp32": (10, torch.float32), f"{ROWS}x32000_fp16": (32000, torch.float16)}
if not GPU_SCALE:
    CASES = {f"{ROWS}x10_fp32": (10, torch.float32), f"{ROWS}x300_fp16": (300, torch.float16)}


@pytest.mark.parametrize("impl", ["mpgemm", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_cross_entropy(run_case, device, name, impl):
    classes, dtype = CASES[name]
    logits = torch.randn(ROWS, classes, device=device, dtype=dtype).requires_grad_()
    target = torch.randint(0, classes, (ROWS,), device=device)
    loss_fn = mpgemm.cross_entropy if impl == "mpgemm" else F.cross_entropy

    def fn():
        logits.grad = None
        loss_fn(logits, target).backward()

    run_case(fn, case=name, impl=impl, bytes=3 * logits.numel() * logits.element_size())
