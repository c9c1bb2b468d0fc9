"""Qwen3-MoE with expert parallelism inside a pipeline and beside tensor parallelism, against the
single-process model (gloo).

Two pipeline stages (or two TP ranks, each with its slice of the experts) times two
data-parallel ranks whose experts are split over both (``ep=2``): tokens cross ranks through
all-to-all in every MoE layer's forward and backward, expert gradients are reduced over the
expert-data-parallel group only, and the loss, every
gradient and the parameters after two AdamW steps equal the single-process model trained on
both ranks' micro-batches (float64; m not a multiple of p). Without pipelining:
``test_model_seam.test_moe_pipelines_match_single_process``.
"""

from __future__ import annotations

import pytest

import moe_cases as cases


@pytest.mark.slow
def test_pipeline_and_tensor_parallel_times_expert_parallel(pools) -> None:
    pool = pools(4)
    assert pool.run(cases.ep_equivalence, 2, 2, [("1f1b", 3)], timeout_s=300) == [["1f1b m=3"]] * 4
    # tp=2 x (dp=2, ep=2): each TP rank's slice of the experts sharded over its expert-parallel group
    assert pool.run(cases.ep_equivalence, 1, 2, [("braided_v", 3)], None, 0.2, 2, timeout_s=300) == [["braided_v m=3"]] * 4


BRAIDED = [("braided_v", 5), ("braided_v_lowmem", 5), ("braided_v_offload", 5), ("dualpipe_v", 5)]


@pytest.mark.slow
def test_braided_schedules_with_expert_parallelism(pools) -> None:
    # every braided schedule (forward units of one micro-batch beside backward units of another,
    # each MoE layer's dispatch and combine inside its MLP unit): dp=2 x ep=2 without pipelining,
    # and pp=2 x (dp=2, ep=2)
    want = [f"{n} m={m}" for n, m in BRAIDED]
    assert pools(2).run(cases.ep_equivalence, 1, 2, BRAIDED, timeout_s=300) == [want] * 2
    assert pools(4).run(cases.ep_equivalence, 2, 2, BRAIDED, timeout_s=300) == [want] * 4



@pytest.mark.slow
def test_compiled_units_with_expert_parallelism(pools) -> None:
    # the units call the compiled unit functions (the token counts per expert vary per micro-batch):
    # dp=2 x ep=2, a plain and a braided schedule, equal to the single-process model
    want = ["1f1b m=3", "braided_v m=5"]
    assert pools(2).run(cases.ep_equivalence, 1, 2, [("1f1b", 3), ("braided_v", 5)], None, 0.2, 1, True,
                        timeout_s=300) == [want] * 2


@pytest.mark.slow
def test_sequence_parallelism_with_an_moe_model(pools) -> None:
    # sequence parallelism inside TP (braid.tp.seq_shard) around the MoE layers -- the router and the
    # experts read the gathered sequence, the combine's output is reduce-scattered -- at pp=2 x tp=2
    # (m not a multiple of p) and tp=2 x (dp=2, ep=2), equal to the single-process model
    want = ["braided_v m=5", "zb_v m=4", "1f1b_i m=4"]
    assert pools(4).run(cases.ep_equivalence, 2, 1, [("braided_v", 5), ("zb_v", 4), ("1f1b_i", 4)], None, 0.2, 2,
                        False, "splits", "nccl", True, timeout_s=300) == [want] * 4
    assert pools(4).run(cases.ep_equivalence, 1, 2, [("braided_v", 3)], None, 0.2, 2, False, "splits",
                        "nccl", True, timeout_s=300) == [["braided_v m=3"]] * 4
