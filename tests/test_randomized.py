"""A few seeds of each randomised search against torch (``tests/randomized.py``): drawn
cases of unscale and loss scaling, weight copies, matmul, linear, cross_entropy, the
optimizers, runs of the GradScaler's API and of LossScaleOptimizer's FP32 masters, a
ReLU's backward fused into the next layer's GEMM against its own kernel, second
derivatives and tangents, inf and NaN operands, each within the suite's bars; ``python
-m tests.randomized OP FIRST COUNT`` searches further."""

import pytest

pytest.importorskip("triton")

from tests import randomized  # noqa: E402


@pytest.mark.parametrize("op", sorted(randomized.CASES))
def test_drawn_cases_match_torch(op, device):
    # On a GPU, 2: each launch of a drawn case may be a specialisation of its own to
    # compile (some 3 a case, a second or so each), in the tests stage's minutes of a
    # 15-minute session. A copies case is a run of 8 steps and checks (half a second
    # each here, some 10 binaries on a GPU): 10, and 1.
    count = 40 if device.type == "cpu" else 2
    if op == "copies":
        count = 10 if device.type == "cpu" else 1
    if op == "masters":  # (runs of 3 to 8 steps: half a second each here)
        count = 20 if device.type == "cpu" else 2
    if op == "relu_fusion":  # (two backward passes a case: 0.4 s each here)
        count = 20 if device.type == "cpu" else 2
    if op.endswith(("second_order", "forward_mode")) and device.type != "cpu":
        # (a recorded backward's or a jvp rule's products in dtypes and layouts of their
        # own, each a binary: the suite's fixed tests of both run there too)
        count = 1
    assert randomized.search(op, range(count), device) == []
