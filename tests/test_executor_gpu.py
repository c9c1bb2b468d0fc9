"""The executor on two GPUs (NCCL): PP=2 and TP=2 match the single-device reference; offload is exact.

Runs with ``PYTHONPATH=. python -m pytest tests/test_executor_gpu.py`` (spawned processes,
no torchrun). The model is fp32 here, but GPU matmuls may use TF32, so tolerances are loose.
"""

from __future__ import annotations

import pytest
import torch

from distributed_utils import DistPool
import executor_cases as cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


@pytest.fixture(scope="module")
def pool():
    p = DistPool(2, timeout_s=120, device="cuda")
    yield p
    p.close()


@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2)])
def test_two_gpus_match_reference(pool, pp: int, tp: int) -> None:
    combos = [("1f1b", 2 * pp + 1), ("zb_h1", 2 * pp + 1), ("braided_v", 2 * pp + 1), ("dualpipe_v", 2 * pp + 1)]
    ran = pool.run(cases.equivalence, pp, tp, combos, timeout_s=300)
    assert {(n, m) for n, m, _ in ran[0]} == set(combos)


def test_offload_on_cuda_streams_gives_bitwise_braided_v(pool) -> None:
    """Async D2H/H2D copies on their own streams, events, early release: loss and gradients unchanged."""
    from test_offload_runtime import ALPHAS, offload_matches_plain

    moved_by_rank = pool.run(offload_matches_plain, 1, 5, ALPHAS, timeout_s=300)
    for moved in moved_by_rank:
        got = [moved[a] for a in ALPHAS]
        assert got == sorted(got) and got[0] < got[-1], f"bytes offloaded per alpha {dict(zip(ALPHAS, got))}"


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
def test_chained_runs_on_a_side_stream_match_reference() -> None:
    """PP=2 x TP=2 on NCCL: a Send/Recv run chained to a carried all-reduce is issued from the
    executor's side stream (:func:`braid.braiding.carries`); results equal the reference and
    every chained run was taken (``equivalence`` counts them against the programs)."""
    pool4 = DistPool(4, timeout_s=120, device="cuda")
    try:
        combos = [("braided_v", 5), ("dualpipe_v", 5)]
        ran = pool4.run(cases.equivalence, 2, 2, combos, timeout_s=600)
    finally:
        pool4.close()
    assert {(n, m) for n, m, _ in ran[0]} == set(combos)
    assert sum(c["chained"] for rank_ran in ran for _, _, c in rank_ran) > 0
