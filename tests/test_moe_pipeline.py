"""Qwen3-MoE with expert parallelism inside a pipeline, against the single-process model (gloo).

Two pipeline stages times two data-parallel ranks whose experts are split over both
(``ep=2``): tokens cross ranks through all-to-all in every MoE layer's forward and backward,
expert gradients are reduced over the expert-data-parallel group only, and the loss, every
gradient and the parameters after two AdamW steps equal the single-process model trained on
both ranks' micro-batches (float64; m not a multiple of p). Without pipelining:
``test_model_seam.test_moe_pipelines_match_single_process``.
"""

from __future__ import annotations

import pytest

import moe_cases as cases


@pytest.mark.slow
def test_pipeline_times_expert_parallel(pools) -> None:
    assert pools(4).run(cases.ep_equivalence, 2, 2, [("1f1b", 3)], timeout_s=300) == [["1f1b m=3"]] * 4
