"""The VLM's pipelined chunks against the single-device Qwen2-VL reference (loss and every gradient).

In-process (world 1, tp=1) for several schedules, and in 2 gloo processes for tp=2 (the
patch embedding, ViT blocks, merger and text embedding sharded; merge-unit all-reduces in
both directions) and pp=2. Every case draws the same micro-batches of ``ShapesCaptions``.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from distributed_utils import DistPool

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))

from braid.braiding import ChunkSpec  # noqa: E402
from braid.models.qwen2_vl import Qwen2VLModel, vlm_preset, vlm_stage_layers  # noqa: E402
from braid.models.vit import ViTConfig, patch_positions, patchify  # noqa: E402

MB_SIZE, TEXT = 2, 12
# fp32 throughout; sums of the same terms in another order (TP partial sums, micro-batch
# accumulation) differ by a few ulps.
RTOL, ATOL = 1e-4, 1e-5


def _microbatches(cfg, m: int):
    from data import ShapesCaptions, batch

    src = ShapesCaptions(cfg.vit.image_size, TEXT, cfg.lm.vocab_size, seed=3)
    return [batch(src, MB_SIZE * i, MB_SIZE) for i in range(m)]


def _reference(model, mbs):
    ref = copy.deepcopy(model)
    total = 0.0
    for b in mbs:
        loss = ref(b["pixels"], b["tokens"], b["labels"]) / len(mbs)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def compare_with_reference(ctx, schedule: str, pp: int, tp: int, m: int) -> dict:
    """Run one step of ``schedule`` on this rank's chunks; assert loss and gradients equal the reference."""
    from braid import schedules
    from braid.compiler import compile_plan
    from braid.runtime.executor import Executor
    from braid.models.vision_chunk import build_vlm_rank_chunks
    from braid.topology import Topology

    torch.manual_seed(7)
    cfg = vlm_preset("tiny")
    model = Qwen2VLModel(cfg)
    plan = schedules.build(schedule, pp, m)
    layers = vlm_stage_layers(cfg, plan.num_stages, last_stage_lighter=1)
    mbs = _microbatches(cfg, m)
    want_loss, want_grads = _reference(model, mbs)
    if ctx is None:
        pp_rank, tp_rank, kw, groups = 0, 0, {"pp_ranks": [0]}, None
    else:
        groups = ctx.process_groups(Topology(ctx.world_size, pp=pp, tp=tp))
        pp_rank, tp_rank = groups.coords.pp, groups.coords.tp
    tp_group = groups.tp if groups is not None and tp > 1 else None
    chunks = build_vlm_rank_chunks(model, plan, pp_rank, layers, tp_rank=tp_rank, tp_size=tp, tp_group=tp_group)
    program = compile_plan(plan)[pp_rank]
    shape = (MB_SIZE, cfg.visual_tokens + TEXT, cfg.lm.hidden)
    if groups is None:
        ex = Executor(plan, program, chunks, act_shape=shape, **kw)
    else:
        ex = Executor.from_groups(plan, program, chunks, groups, ctx.dist.abort, act_shape=shape)
    res = ex.run([(b["pixels"], b["tokens"]) for b in mbs], [model.full_labels(b["labels"]) for b in mbs])
    where = f"{schedule} pp={pp} tp={tp} m={m} rank={pp_rank}.{tp_rank}"
    if res.loss is not None:
        torch.testing.assert_close(res.loss, want_loss, rtol=RTOL, atol=ATOL, msg=lambda s: f"{where} loss: {s}")
    grad_model = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in grad_model.named_parameters():
            p.copy_(want_grads[n])
    want_chunks = build_vlm_rank_chunks(grad_model, plan, pp_rank, layers, tp_rank=tp_rank, tp_size=tp)
    checked = 0
    for c, ch in chunks.items():
        want = dict(want_chunks[c].named_parameters())
        for n, p in ch.named_parameters():
            assert p.grad is not None, f"{where}: chunk {c} {n} has no gradient"
            torch.testing.assert_close(p.grad, want[n], rtol=RTOL, atol=ATOL, msg=lambda s: f"{where} grad {c}.{n}: {s}")
            checked += 1
    return {"loss": res.loss, "checked": checked, "counts": res.counts, "merge": any(ch.spec.merge for ch in chunks.values())}


@pytest.mark.parametrize("schedule,m", [("braided_v", 3), ("zb_v", 2), ("1f1b_i", 2)])
def test_single_rank_chunks_equal_reference(schedule: str, m: int) -> None:
    out = compare_with_reference(None, schedule, 1, 1, m)
    assert out["merge"] and out["loss"] is not None
    n_params = sum(1 for _ in Qwen2VLModel(vlm_preset("tiny")).parameters())
    assert out["checked"] == n_params  # every parameter of the reference lives in a chunk and was compared


@pytest.fixture(scope="module")
def pool2():
    pool = DistPool(2, timeout_s=60)
    yield pool
    pool.close()


def test_tp2_and_pp2_equal_reference(pool2) -> None:
    tp_runs = pool2.run(compare_with_reference, "braided_v", 1, 2, 3, timeout_s=120)
    assert all(r["merge"] for r in tp_runs)
    assert all(r["counts"]["AR"] > 0 and r["counts"]["braided"] > 0 for r in tp_runs)
    pp_runs = pool2.run(compare_with_reference, "braided_v", 2, 1, 4, timeout_s=120)
    assert [r["merge"] for r in pp_runs] == [True, False]  # the ViT sits on device 0 only
    assert pp_runs[0]["loss"] is not None and pp_runs[1]["loss"] is None  # V-shape: the head is on device 0 too


def test_patch_order_matches_positions() -> None:
    cfg = ViTConfig(patch=2, image_size=8, hidden=16, heads=2)
    # Pixel value encodes its own (row, col): a patch's first pixel reveals where it came from.
    rr, cc = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    pixels = torch.stack([rr, cc, torch.zeros(8, 8)]).unsqueeze(0)
    patches = patchify(pixels, cfg).view(1, cfg.patches, 3, 2, 2)
    rows, cols = patch_positions(cfg)
    assert torch.equal(patches[0, :, 0, 0, 0], rows.float() * 2)
    assert torch.equal(patches[0, :, 1, 0, 0], cols.float() * 2)
    # The first four patches are one 2x2 block (what the merger groups).
    assert rows[:4].tolist() == [0, 0, 1, 1] and cols[:4].tolist() == [0, 1, 0, 1]


def test_bad_shapes_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="multiple of patch"):
        ViTConfig(patch=4, image_size=20)
    with pytest.raises(ValueError, match="at least 2 virtual stages"):
        vlm_stage_layers(vlm_preset("tiny"), 1)
    with pytest.raises(ValueError, match="LM head"):
        ChunkSpec(2, embed=True, merge=True, head=True)
    with pytest.raises(ValueError, match="unknown model preset"):
        vlm_preset("huge")
