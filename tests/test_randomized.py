"""A few seeds of each randomised search against torch (``tests/randomized.py``): drawn
cases of unscale and loss scaling, weight copies, matmul, linear, cross_entropy and the
optimizers, each within the suite's bars; ``python -m tests.randomized OP FIRST COUNT``
searches further."""

import pytest

pytest.importorskip("triton")

from tests import randomized  # noqa: E402


@pytest.mark.parametrize("op", sorted(randomized.CASES))
def test_drawn_cases_match_torch(op, device):
    # On a GPU, 5: each drawn case may be a specialisation of its own to compile (a
    # second or more each), in the tests stage's minutes. A copies case is a run of 8
    # steps and checks (half a second each here): 10.
    count = 40 if device.type == "cpu" else 5
    if op == "copies":
        count = min(count, 10)
    assert randomized.search(op, range(count), device) == []
