"""The executor on two GPUs (NCCL): PP=2 and TP=2 match the single-device reference; offload is exact.

Runs with ``PYTHONPATH=. python -m pytest tests/test_executor_gpu.py`` (spawned processes,
no torchrun). The model is fp32 here, compared with the reference within the float64
reference's error (``reference_error``). The ranks are the session's shared GPU pool; every
test has a limit of ``GPU_TEST_S`` and the pool answers within ``GPU_RUN_S`` or prints the
stacks of the ranks that did not. Units run eager (a cold ``torch.compile`` cache costs
minutes on a fresh machine); compiled units across two GPUs have their own test.
"""

from __future__ import annotations

import pytest
import torch

from conftest import GPU_RUN_S, GPU_TEST_S
import executor_cases as cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
              pytest.mark.timeout(GPU_TEST_S)]


@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2)])
def test_two_gpus_match_reference(gpu_pools, pp: int, tp: int) -> None:
    combos = [("1f1b", 2 * pp + 1), ("zb_h1", 2 * pp + 1), ("braided_v", 2 * pp + 1), ("dualpipe_v", 2 * pp + 1)]
    ran = gpu_pools(2).run(cases.equivalence, pp, tp, combos, False, timeout_s=GPU_RUN_S)
    assert {(n, m) for n, m, _ in ran[0]} == set(combos)


def test_two_gpus_sequence_parallel_matches_reference(gpu_pools) -> None:
    """Sequence parallelism inside TP at tp=2 on NCCL (braid.tp.seq_shard): reduce-scatters, the unit heads
    run on the executor's side stream after them (braid.runtime.follow), all-gathers in flight beside the
    partner's units, saved inputs gathered again in the backward; with full recomputation too."""
    combos = [("1f1b", 3), ("zb_h1", 3), ("braided_v", 3), ("dualpipe_v", 3)]
    ran = gpu_pools(2).run(cases.equivalence, 1, 2, combos, False, None, "none", None, True, timeout_s=GPU_RUN_S)
    assert {(n, m) for n, m, _ in ran[0]} == set(combos) and all(c["seq_shard"] for _, _, c in ran[0])
    ran = gpu_pools(2).run(cases.equivalence, 1, 2, [("braided_v", 3)], False, None, "full", None, True, timeout_s=GPU_RUN_S)
    assert [(n, m) for n, m, _ in ran[0]] == [("braided_v", 3)]


@pytest.mark.timeout(3 * GPU_TEST_S)
def test_two_gpus_compiled_units_match_reference(gpu_pools) -> None:
    """Compiled units (Triton) at tp=2: all-reduces in place on compiled outputs. Its limit allows a
    cold inductor cache (kernels compiled for the first time on the machine)."""
    ran = gpu_pools(2).run(cases.equivalence, 1, 2, [("braided_v", 3)], True, timeout_s=3 * GPU_RUN_S)
    assert [(n, m) for n, m, _ in ran[0]] == [("braided_v", 3)]


def test_offload_on_cuda_streams_gives_bitwise_braided_v(gpu_pools) -> None:
    """Async D2H/H2D copies on their own streams, events, early release: loss and gradients unchanged."""
    from test_offload_runtime import ALPHAS, offload_matches_plain

    moved_by_rank = gpu_pools(2).run(offload_matches_plain, 1, 5, ALPHAS, False, timeout_s=GPU_RUN_S)
    for moved in moved_by_rank:
        got = [moved[a] for a in ALPHAS]
        assert got == sorted(got) and got[0] < got[-1], f"bytes offloaded per alpha {dict(zip(ALPHAS, got))}"


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
@pytest.mark.timeout(2 * GPU_TEST_S)  # four ranks start slower: the pool's own limit must fire first and name them
def test_chained_runs_on_a_side_stream_match_reference(gpu_pools) -> None:
    """PP=2 x TP=2 on NCCL: a Send/Recv run chained to a carried all-reduce is issued from the
    executor's side stream (:func:`braid.core.braiding.carries`); results equal the reference and
    every chained run was taken (``equivalence`` counts them against the programs)."""
    combos = [("braided_v", 5), ("dualpipe_v", 5)]
    ran = gpu_pools(4).run(cases.equivalence, 2, 2, combos, False, timeout_s=GPU_RUN_S)
    assert {(n, m) for n, m, _ in ran[0]} == set(combos)
    assert sum(c["chained"] for rank_ran in ran for _, _, c in rank_ran) > 0
