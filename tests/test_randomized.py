"""A few seeds of each randomised search against torch (``tests/randomized.py``): drawn
cases of matmul, linear, cross_entropy and the optimizers, each within the suite's
bars; ``python -m tests.randomized OP FIRST COUNT`` searches further."""

import pytest

pytest.importorskip("triton")

from tests import randomized  # noqa: E402


@pytest.mark.parametrize("op", sorted(randomized.CASES))
def test_drawn_cases_match_torch(op, device):
    assert randomized.search(op, range(40), device) == []
