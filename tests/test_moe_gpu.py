"""Qwen3-MoE with expert parallelism on two GPUs (NCCL), against the single-device reference.

Runs with ``PYTHONPATH=. python -m pytest tests/test_moe_gpu.py``. One decoder layer of
Qwen3-30B-A3B's shapes (hidden 2048, 32 heads of 128, 4 KV heads, 128 experts of width 768,
8 per token) between two dense layers, fp32, the experts split over both GPUs (dp=2, ep=2): tokens
cross GPUs by all-to-all in forward and backward; loss, every gradient and the parameters after
two AdamW steps within the float64 reference's error; eager, and with the units calling the compiled
unit functions.
"""

from __future__ import annotations

import pytest
import torch

from conftest import GPU_RUN_S, GPU_TEST_S
import moe_cases as cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
              pytest.mark.timeout(3 * GPU_TEST_S)]

A3B_LAYER = dict(vocab_size=1024, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144, experts=128,
                 experts_per_token=8, moe_ffn=768, mlp_only_layers=(0, 2))  # layers 0 and 2 dense, 1 MoE


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a3b_layer_with_experts_over_two_gpus_matches_reference(gpu_pools, compiled: bool) -> None:
    # ~45 GiB per GPU (the float64 and float32 references with their AdamW states): fresh ranks, so
    # what earlier cases left outside the allocator does not count against it; compiled: the units call
    # the compiled unit functions (Triton kernels compiled in the case, hence its longer limit)
    limit = GPU_RUN_S * (3 if compiled else 1)
    ran = gpu_pools(2, fresh=True).run(cases.ep_equivalence, 1, 2, [("1f1b", 3)], A3B_LAYER, 0.02, 1, compiled,
                                       timeout_s=limit)
    assert ran == [["1f1b m=3"]] * 2


def test_padded_exchanges_on_the_copy_engines_match_reference(gpu_pools) -> None:
    # --ep-backend nccl-ce: the padded blocks staged in registered symmetric windows and exchanged by NCCL's
    # zero-CTA all-to-all (copy engines), braided beside the partner's units, within the reference's error
    if tuple(torch.cuda.nccl.version()) < (2, 28, 0):
        pytest.skip("nccl-ce needs NCCL >= 2.28")
    ran = gpu_pools(2, fresh=True).run(cases.ep_equivalence, 1, 2, [("braided_v", 5)], A3B_LAYER, 0.02, 1, False,
                                       "padded", "nccl-ce", timeout_s=GPU_RUN_S)
    assert ran == [["braided_v m=5"]] * 2
