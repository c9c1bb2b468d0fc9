"""The VLM's pipelined chunks against the single-device Qwen2-VL / Qwen2.5-VL reference (loss and every gradient).

In-process (world 1, tp=1) for several schedules and both vision towers, and in 2 gloo
processes for tp=2 (the patch embedding, ViT blocks, merger and text embedding sharded;
merge-unit all-reduces in both directions) and pp=2. Micro-batches are HF-processor-shaped:
two samples whose images have different grids (4 and 16 visual tokens; the larger spans
four Qwen2.5-VL windows), right-padded to one length.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from conftest import GPU_RUN_S, GPU_TEST_S

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))

from braid.core.braiding import ChunkSpec  # noqa: E402
from braid.models.qwen2_vl import Qwen2VLModel, rope_index, split_item, vlm_preset, vlm_stage_layers  # noqa: E402
from braid.models.vit import ViTConfig, patch_positions, patchify, vision_layout  # noqa: E402

MB_SIZE, SEQ = 2, 30
GRIDS = ((1, 4, 4), (1, 8, 8))  # patches per image of the two samples: 4 and 16 visual tokens


def _microbatches(cfg, m: int, seed: int = 3, lead: int = 1) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """``m`` items ``(pixel_values, input_ids, image_grid_thw)`` with braid-shifted labels; ``lead`` text tokens
    before each image."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor(GRIDS)
    text_ids = cfg.vision_start_token_id  # ids below the vision tokens are text
    out = []
    for _ in range(m):
        pixel_values = torch.randn(int(grid.prod(-1).sum()), cfg.vit.patch_dim, generator=g)
        rows, labs = [], []
        for t, h, w in GRIDS:
            n_text = int(torch.randint(4, SEQ - t * h * w // 4 - 1 - lead, (1,), generator=g))
            ids = [3] * lead + cfg.image_tokens(t * h * w // 4) + torch.randint(0, text_ids, (n_text,), generator=g).tolist()
            lab = ids[1:] + [-100]
            lab = [x if x < text_ids else -100 for x in lab]
            rows.append(ids + [0] * (SEQ - len(ids)))
            labs.append(lab + [-100] * (SEQ - len(lab)))
        out.append(((pixel_values, torch.tensor(rows), grid), torch.tensor(labs)))
    return out


def _reference(model, mbs):
    ref = copy.deepcopy(model)
    dtype = next(ref.parameters()).dtype
    total = 0.0
    for (pixel_values, ids, grid), labels in mbs:
        loss = ref(pixel_values.to(dtype), ids, labels, grid) / len(mbs)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def compare_with_reference(ctx, schedule: str, pp: int, tp: int, m: int, kind: str = "qwen2_vl") -> dict:
    """Run one step of ``schedule`` on this rank's chunks; assert loss and gradients equal the reference
    within :func:`reference_error.bound`.

    On the rank's CUDA device when the pool runs on GPUs (``ctx.dist.device``: float32 against a
    float64 reference's error), else on the CPU in float64.
    """
    from executor_cases import run_dtype
    from reference_error import assert_matches_reference

    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.runtime.executor import Executor
    from braid.models.vision_chunk import build_vlm_rank_chunks
    from braid.core.topology import Topology

    device = torch.device("cpu") if ctx is None else torch.device(ctx.dist.device)
    dtype = run_dtype(device)
    torch.manual_seed(7)
    cfg = vlm_preset("tiny", kind=kind)
    model = Qwen2VLModel(cfg).to(device, dtype)
    plan = schedules.build(schedule, pp, m)
    layers = vlm_stage_layers(cfg, plan.num_stages, last_stage_lighter=1)
    mbs = [((px.to(device, dtype), *(t.to(device) for t in rest)), labels.to(device))
           for (px, *rest), labels in _microbatches(cfg, m)]
    want_loss, want_grads = _reference(model, mbs)
    want_loss64, want_grads64 = (None, None) if dtype == torch.float64 else _reference(copy.deepcopy(model).double(), mbs)
    if ctx is None:
        pp_rank, tp_rank, kw, groups = 0, 0, {"pp_ranks": [0]}, None
    else:
        groups = ctx.process_groups(Topology(ctx.world_size, pp=pp, tp=tp))
        pp_rank, tp_rank = groups.coords.pp, groups.coords.tp
    tp_group = groups.tp if groups is not None and tp > 1 else None
    chunks = build_vlm_rank_chunks(model, plan, pp_rank, layers, tp_rank=tp_rank, tp_size=tp, tp_group=tp_group)
    program = compile_plan(plan)[pp_rank]
    shape = (MB_SIZE, SEQ, cfg.lm.hidden)
    if groups is None:
        ex = Executor(plan, program, chunks, act_shape=shape, dtype=dtype, compile=False, **kw)
    else:  # eager units: compiled ones have their own tests (test_compiled_units, test_executor_gpu)
        ex = Executor.from_groups(plan, program, chunks, groups, ctx.dist.abort, act_shape=shape, device=device, dtype=dtype,
                                  compile=False)
    res = ex.run([item for item, _ in mbs], [labels for _, labels in mbs])
    where = f"{kind} {schedule} pp={pp} tp={tp} m={m} rank={pp_rank}.{tp_rank}"
    if res.loss is not None:
        assert_matches_reference(torch.tensor(res.loss, dtype=dtype), torch.tensor(want_loss, dtype=dtype), want_loss64,
                                 what=f"{where} loss")

    def shard(grads, dt):
        grad_model = copy.deepcopy(model).to(dt)
        with torch.no_grad():
            for n, p in grad_model.named_parameters():
                p.copy_(grads[n])
        return build_vlm_rank_chunks(grad_model, plan, pp_rank, layers, tp_rank=tp_rank, tp_size=tp)

    want_chunks = shard(want_grads, dtype)
    want64_chunks = None if want_grads64 is None else shard(want_grads64, torch.float64)
    scale = max(float(g.abs().max()) for g in want_grads.values())
    checked = 0
    for c, ch in chunks.items():
        want = dict(want_chunks[c].named_parameters())
        want64 = {} if want64_chunks is None else dict(want64_chunks[c].named_parameters())
        for n, p in ch.named_parameters():
            assert p.grad is not None, f"{where}: chunk {c} {n} has no gradient"
            assert_matches_reference(p.grad, want[n], want64.get(n), what=f"{where} grad {c}.{n}", scale=scale)
            checked += 1
    return {"loss": res.loss, "checked": checked, "counts": res.counts, "merge": any(ch.spec.merge for ch in chunks.values())}


@pytest.mark.parametrize("schedule,m,kind", [("braided_v", 3, "qwen2_vl"), ("braided_v", 2, "qwen2_5_vl"),
                                             ("zb_v", 2, "qwen2_5_vl"), ("1f1b_i", 2, "qwen2_vl")])
def test_single_rank_chunks_equal_reference(schedule: str, m: int, kind: str) -> None:
    out = compare_with_reference(None, schedule, 1, 1, m, kind)
    assert out["merge"] and out["loss"] is not None
    n_params = sum(1 for _ in Qwen2VLModel(vlm_preset("tiny", kind=kind)).parameters())
    assert out["checked"] == n_params  # every parameter of the reference lives in a chunk and was compared


@pytest.fixture(scope="module")
def pool2(pools):
    return pools(2)


def test_tp2_and_pp2_equal_reference(pool2) -> None:
    for kind in ("qwen2_vl", "qwen2_5_vl"):
        tp_runs = pool2.run(compare_with_reference, "braided_v", 1, 2, 3, kind, timeout_s=120)
        assert all(r["merge"] for r in tp_runs)
        assert all(r["counts"]["AR"] > 0 and r["counts"]["braided"] > 0 for r in tp_runs)
    pp_runs = pool2.run(compare_with_reference, "braided_v", 2, 1, 4, "qwen2_5_vl", timeout_s=120)
    assert [r["merge"] for r in pp_runs] == [True, False]  # the ViT sits on device 0 only
    assert pp_runs[0]["loss"] is not None and pp_runs[1]["loss"] is None  # V-shape: the head is on device 0 too


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(GPU_TEST_S)
def test_two_gpus_tp2_and_pp2_equal_reference(gpu_pools) -> None:
    """NCCL, CUDA kernels (float32 against the float64 reference's error), both towers."""
    for kind in ("qwen2_vl", "qwen2_5_vl"):
        for pp, tp in ((1, 2), (2, 1)):
            runs = gpu_pools(2).run(compare_with_reference, "braided_v", pp, tp, 4, kind, timeout_s=GPU_RUN_S)
            assert all(r["checked"] > 0 for r in runs)


def test_patch_order_matches_positions() -> None:
    cfg = ViTConfig(patch=2, image_size=8, hidden=16, heads=2)
    # Pixel value encodes its own (row, col): a patch's first pixel reveals where it came from.
    rr, cc = torch.meshgrid(torch.arange(8.0), torch.arange(12.0), indexing="ij")
    pixels = torch.stack([rr, cc, torch.zeros(8, 12)]).unsqueeze(0)
    pixel_values, grid = patchify(pixels, cfg)
    assert grid.tolist() == [[1, 4, 6]]
    patches = pixel_values.view(24, 3, 2, 2, 2)  # channel, frame, row, col
    pos = patch_positions(grid, cfg.merge)
    assert torch.equal(patches[:, 0, 0, 0, 0], pos[:, 0].float() * 2)
    assert torch.equal(patches[:, 1, 1, 0, 0], pos[:, 1].float() * 2)  # both frames are the image
    # The first four patches are one 2x2 block (what the merger groups).
    assert pos[:4].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]


def test_windows_tile_each_image() -> None:
    cfg = vlm_preset("tiny", kind="qwen2_5_vl").vit  # windows of 2x2 merged tokens
    layout = vision_layout(torch.tensor([[1, 4, 6], [1, 8, 8]]), cfg)
    assert layout.full == [24, 64]
    assert layout.windows == [16, 8, 16, 16, 16, 16]  # 4x6 patches: a full window and a half one; 8x8: four
    assert sorted(layout.order.tolist()) == list(range(22)) and torch.equal(layout.order[layout.reverse], torch.arange(22))


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_block_units_compose_to_its_forward(kind: str) -> None:
    from braid.core.braiding import Unit

    torch.manual_seed(0)
    model = Qwen2VLModel(vlm_preset("tiny", kind=kind))
    block = model.visual.blocks[0]
    block.layout = vision_layout(torch.tensor([[1, 8, 8]]), model.cfg.vit)
    x = torch.randn(1, 64, model.cfg.vit.hidden)
    acts = block.unit_forward(Unit.PRE_ATTN, block.unit_norm(Unit.PRE_ATTN)(x))
    y = block.unit_forward(Unit.ATTN, *acts, residual=torch.zeros_like(x)) + x
    acts = block.unit_forward(Unit.PRE_MLP, block.unit_norm(Unit.PRE_MLP)(y))
    out = block.unit_forward(Unit.MLP, *acts, residual=torch.zeros_like(y)) + y
    torch.testing.assert_close(out, block(x))
    names = {Unit.PRE_MLP: ("fc1",), Unit.MLP: ("fc2",)} if kind == "qwen2_vl" else \
        {Unit.PRE_MLP: ("gate_proj", "up_proj"), Unit.MLP: ("down_proj",)}
    for unit, want in names.items():
        assert block.unit_weights(unit) == tuple(getattr(block, n) for n in want)


def test_image_items_equal_processor_items() -> None:
    torch.manual_seed(0)
    cfg = vlm_preset("tiny")
    model = Qwen2VLModel(cfg)
    images = torch.rand(2, 3, 16, 16)
    ids = torch.tensor([[1] + cfg.image_tokens() + [2, 3]] * 2)
    pixel_values, _, grid = split_item(cfg, (images, ids))
    assert torch.equal(split_item(cfg, (images, ids), pixels=False)[2], grid)
    assert torch.equal(model.logits(ids, images), model.logits(ids, pixel_values, grid))
    pos = rope_index(cfg, ids, grid)
    # text, then a 2x2 grid of visual tokens at (t, row, col) offsets, then text from start + max(h, w)
    assert pos[:, 0, :7].tolist() == [[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]]


def test_bad_shapes_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="multiple of patch"):
        ViTConfig(patch=4, image_size=20)
    with pytest.raises(ValueError, match="window"):
        ViTConfig(kind="qwen2_5_vl", window=0)
    with pytest.raises(ValueError, match="at least 2 virtual stages"):
        vlm_stage_layers(vlm_preset("tiny"), 1)
    with pytest.raises(ValueError, match="LM head"):
        ChunkSpec(2, embed=True, merge=True, head=True)
    with pytest.raises(ValueError, match="unknown model preset"):
        vlm_preset("huge")
    cfg = vlm_preset("tiny")
    model = Qwen2VLModel(cfg)
    ids = torch.tensor([cfg.image_tokens() + [1]])
    with pytest.raises(ValueError, match="pixel_values of shape"):
        model.logits(ids, torch.zeros(15, cfg.vit.patch_dim), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="more images"):
        rope_index(cfg, torch.tensor([cfg.image_tokens() * 2]), torch.tensor([[1, 4, 4]]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_meta_vlm_chunks_on_a_device_equal_the_materialised_model(device: str) -> None:
    """Each rank's chunks made from the meta model on ``device`` hold the values the whole model gets there."""
    from braid import schedules
    from braid.models.build import materialize, meta_model
    from braid.models.vision_chunk import build_vlm_rank_chunks

    cfg = vlm_preset("tiny", kind="qwen2_5_vl")
    plan = schedules.build("braided_v", 2, 4)  # rank 0: the vision stage and the head
    layers = vlm_stage_layers(cfg, plan.num_stages, 0)
    full = materialize(meta_model(Qwen2VLModel, cfg, seed=9, device=device))
    for pp_rank in range(2):
        meta = meta_model(Qwen2VLModel, cfg, seed=9, device=device)
        got = build_vlm_rank_chunks(meta, plan, pp_rank, layers, tp_rank=1, tp_size=2)
        want = build_vlm_rank_chunks(full, plan, pp_rank, layers, tp_rank=1, tp_size=2)
        for c in want:
            w = dict(want[c].named_parameters())
            for n, p in got[c].named_parameters():
                assert p.device.type == device and torch.equal(p, w[n]), f"rank {pp_rank} chunk {c} {n}"
