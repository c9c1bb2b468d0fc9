"""2D-Attention on GPUs (NCCL, bf16): exactness against an fp32 reference.

The distributed result may be at most twice as far from the fp32 reference as the
single-GPU bf16 result is (plus a small floor), for the output and all three gradients.
Needs at least 2 GPUs; run with ``PYTHONPATH=. python -m pytest tests/test_attention2d_gpu.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from conftest import GPU_RUN_S, GPU_TEST_S

from braid.attention import (
    Attention2DGroups,
    GroupPool,
    RingSpec,
    attention_2d,
    get_kernel,
    reference_attention,
    ring_attention,
    zigzag_shard,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

B, H, H_KV, S, D = 1, 8, 2, 4096, 128
FLOOR = 1e-3


def _layouts(world: int) -> list[tuple[int, int, int, str]]:
    out = [(world, 1, 1, "head_first"), (1, world, world, "head_first"), (1, world, 1, "head_first")]
    if world >= 4:
        out += [(2, world // 2, 1, "head_first"), (2, world // 2, world // 2, "context_first")]
    return out


def _case(ctx) -> None:
    """Every layout and kernel, causal and not, on this rank of the pool; raises on the first miss."""
    rank, world = ctx.rank, ctx.world_size
    dev = ctx.dist.device
    pool = GroupPool()
    g = torch.Generator(device=dev).manual_seed(0)
    q32, k32, v32 = (torch.randn(B, h, S, D, generator=g, device=dev) for h in (H, H_KV, H_KV))
    dout32 = torch.randn(B, H, S, D, generator=g, device=dev)
    scale = D ** -0.5
    for causal in (True, False):
        ref_in = [t.clone().requires_grad_() for t in (q32, k32, v32)]
        ref_out, _ = reference_attention(*ref_in, causal=causal, scale=scale)
        ref_out.backward(dout32)
        refs = [ref_out.detach()] + [t.grad for t in ref_in]
        one_err = {}  # single-GPU bf16 error of each kernel: the budget
        for backend in ("torch_flash", "torch_cudnn"):
            one_in = [t.bfloat16().requires_grad_() for t in (q32, k32, v32)]
            one_out, _ = ring_attention(*one_in, RingSpec(1, 1, 0), causal=causal, scale=scale,
                                        kernel=get_kernel(dev, backend))
            one_out.backward(dout32.bfloat16())
            one_err[backend] = [(a.float() - r).abs().max().item()
                                for a, r in zip([one_out] + [t.grad for t in one_in], refs)]
        for (d_hp, d_cp, w, placement), backend in itertools.product(_layouts(world), ("torch_flash", "torch_cudnn")):
            kernel = get_kernel(dev, backend)
            groups = Attention2DGroups.build(list(range(world)), d_hp, d_cp, w, placement, pool=pool)
            lay = groups.layout
            loc = [zigzag_shard(t, lay, rank).bfloat16().requires_grad_() for t in (q32, k32, v32)]
            out = attention_2d(*loc, groups=groups, causal=causal, scale=scale, kernel=kernel)
            out.backward(zigzag_shard(dout32, lay, rank).bfloat16())
            for name, got, ref, budget in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in loc], refs,
                                              one_err[backend]):
                err = (got.float() - zigzag_shard(ref, lay, rank)).abs().max().item()
                assert err <= 2 * budget + FLOOR, (
                    f"{name} {backend} hp={d_hp} cp={d_cp} w={w} causal={causal} rank={rank}: error {err:.3e} vs "
                    f"single-GPU bf16 {budget:.3e}")
    dist.barrier()


@pytest.mark.timeout(GPU_TEST_S)
def test_attention2d_bf16_error_within_twice_single_gpu(gpu_pools) -> None:
    """On the session's GPU ranks (spawning ranks of its own cost ~9 s of its ~12 s); a rank that
    fails is reported with its traceback, a hang with every rank's stack."""
    world = 4 if torch.cuda.device_count() >= 4 else 2
    gpu_pools(world).run(_case, timeout_s=GPU_RUN_S)
