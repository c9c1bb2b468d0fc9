import os
import sys

# Let test modules import shared helpers from each other (e.g. the hand-written plans).
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def pools():
    """``pools(n)``: a gloo process pool of ``n`` ranks, started once per test module and reused by its cases."""
    from distributed_utils import DistPool

    made: dict = {}

    def get(n: int):
        if n not in made:
            made[n] = DistPool(n, timeout_s=60)
        return made[n]

    yield get
    for p in made.values():
        p.close()
