"""Images of mixed resolutions padded to a fixed visual-token budget (:mod:`braid.models.vlm_pack`) give the
unpadded result.

The reference runs every sample *on its own and unpadded* (its image alone, its ids cut to
its real length) through the single-device Qwen2-VL / Qwen2.5-VL; the pipelined chunks run
the micro-batches padded to one budget (padding patches an attention segment of their own,
padded visual tokens gathered into no LM position, samples right-padded to one length). Loss
and every gradient must agree within :func:`reference_error.bound` of the float64 runs --
with no padding (a budget the micro-batch fills) and with a lot of it. Every micro-batch of
the run then has one shape (one CUDA graph), which the unpadded micro-batches do not.
"""

from __future__ import annotations

import copy

import pytest
import torch

from braid.models.qwen2_vl import IGNORE_INDEX, Qwen2VLModel, vlm_preset, vlm_stage_layers
from braid.models.vlm_pack import PackedImages, image_tokens_of, pack_images, padding_waste

MB_SIZE, TEXT = 2, 6
# image sides per micro-batch (tiny tower: patch 4, merge 2 -> multiples of 8): 1, 4, 9 and 16 visual tokens;
# the Qwen2.5-VL tower's windows are 16 px, so the 24 and 32 px images span partial and several windows
SIDES = ((32, 8), (16, 24), (24, 32))


def _samples(cfg, sides: tuple[int, ...], g: torch.Generator) -> list[tuple[torch.Tensor, list[int], list[int]]]:
    """Per sample: its image (3, s, s), its ids (vision start, image pads, end, text) and shifted labels, unpadded."""
    out = []
    text_ids = min(cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id)
    for side in sides:
        n_text = int(torch.randint(3, TEXT + 1, (1,), generator=g))
        ids = cfg.image_tokens(image_tokens_of(cfg.vit, side)) + torch.randint(0, text_ids, (n_text,), generator=g).tolist()
        labels = [x if x < text_ids else IGNORE_INDEX for x in ids[1:]] + [IGNORE_INDEX]
        out.append((torch.randn(cfg.vit.channels, side, side, generator=g), ids, labels))
    return out


def _seq(cfg) -> int:
    return image_tokens_of(cfg.vit, max(max(s) for s in SIDES)) + 2 + TEXT


def _pack(cfg, samples, budget: int) -> tuple[PackedImages, torch.Tensor]:
    s = _seq(cfg)
    ids = torch.tensor([i + [0] * (s - len(i)) for _, i, _ in samples])
    labels = torch.tensor([lab + [IGNORE_INDEX] * (s - len(lab)) for _, _, lab in samples])
    return pack_images(cfg, [img for img, _, _ in samples], ids, budget), labels


def _reference(model, batches) -> tuple[float, dict[str, torch.Tensor]]:
    """Each sample alone and unpadded; a micro-batch's loss is the mean over its real targets, the step's the
    mean over micro-batches (what the chunks compute)."""
    ref = copy.deepcopy(model)
    dtype = next(ref.parameters()).dtype
    total = 0.0
    for samples in batches:
        counts = [sum(x != IGNORE_INDEX for x in lab) for _, _, lab in samples]
        for (img, ids, lab), n in zip(samples, counts):
            loss = ref([img.to(dtype)], torch.tensor([ids]), torch.tensor([lab]))  # a list of (c, H, W): unpadded images
            part = loss * n / sum(counts) / len(batches)
            part.backward()
            total += part.item()
    return total, {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def compare_padded_with_reference(ctx, schedule: str, pp: int, tp: int, kind: str, extra: int) -> dict:
    """One step of ``schedule`` over micro-batches padded to their largest need + ``extra`` visual tokens; loss
    and gradients against each sample run alone (float64 on the CPU: the bound is float64's rounding)."""
    from reference_error import assert_matches_reference

    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.core.topology import Topology
    from braid.models.vision_chunk import build_vlm_rank_chunks
    from braid.runtime.executor import Executor

    dtype = torch.float64
    torch.manual_seed(7)
    cfg = vlm_preset("tiny", kind=kind)
    model = Qwen2VLModel(cfg).to(dtype)
    g = torch.Generator().manual_seed(5)
    batches = [_samples(cfg, sides, g) for sides in SIDES]
    budget = max(sum(image_tokens_of(cfg.vit, s) for s in sides) for sides in SIDES) + extra
    items = [_pack(cfg, samples, budget) for samples in batches]
    items = [(PackedImages(*(t.to(dtype) if t.is_floating_point() else t for t in item)), labels) for item, labels in items]
    want_loss, want_grads = _reference(model, batches)
    plan = schedules.build(schedule, pp, len(batches))
    layers = vlm_stage_layers(cfg, plan.num_stages, last_stage_lighter=1)
    if ctx is None:
        pp_rank, tp_rank, groups = 0, 0, None
    else:
        groups = ctx.process_groups(Topology(ctx.world_size, pp=pp, tp=tp))
        pp_rank, tp_rank = groups.coords.pp, groups.coords.tp
    chunks = build_vlm_rank_chunks(model, plan, pp_rank, layers, tp_rank=tp_rank, tp_size=tp,
                                   tp_group=groups.tp if groups is not None and tp > 1 else None)
    program = compile_plan(plan)[pp_rank]
    shape = (MB_SIZE, _seq(cfg), cfg.lm.hidden)
    if groups is None:
        ex = Executor(plan, program, chunks, act_shape=shape, dtype=dtype, compile=False, pp_ranks=[0])
    else:
        ex = Executor.from_groups(plan, program, chunks, groups, ctx.dist.abort, act_shape=shape, device="cpu", dtype=dtype,
                                  compile=False)
    res = ex.run([item for item, _ in items], [labels for _, labels in items])
    where = f"{kind} {schedule} pp={pp} tp={tp} padding+{extra} rank={pp_rank}.{tp_rank}"
    if res.loss is not None:
        assert_matches_reference(torch.tensor(res.loss, dtype=dtype), torch.tensor(want_loss, dtype=dtype), what=f"{where} loss")
    grad_model = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in grad_model.named_parameters():
            p.copy_(want_grads[n])
    want_chunks = build_vlm_rank_chunks(grad_model, plan, pp_rank, layers, tp_rank=tp_rank, tp_size=tp)
    scale = max(float(w.abs().max()) for w in want_grads.values())
    checked = 0
    for c, ch in chunks.items():
        want = dict(want_chunks[c].named_parameters())
        for n, p in ch.named_parameters():
            assert p.grad is not None, f"{where}: chunk {c} {n} has no gradient"
            assert_matches_reference(p.grad, want[n], what=f"{where} grad {c}.{n}", scale=scale)
            checked += 1
    real = [sum(image_tokens_of(cfg.vit, s) for s in sides) for sides in SIDES]
    return {"loss": res.loss, "checked": checked, "waste": padding_waste(real, budget)}


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("extra", [0, 23])
def test_padded_micro_batches_equal_each_sample_unpadded(kind: str, extra: int) -> None:
    out = compare_padded_with_reference(None, "braided_v", 1, 1, kind, extra)
    assert out["loss"] is not None
    assert out["checked"] == sum(1 for _ in Qwen2VLModel(vlm_preset("tiny", kind=kind)).parameters())
    assert (out["waste"] > 0.4) == (extra > 0)  # the padded case is mostly padding: 23 of 32+ tokens per micro-batch


def test_tp2_and_pp2_padded_equal_each_sample_unpadded(pools) -> None:
    """TP shards the patch features, blocks and merger (the gathered LM input is a sum of partial rows); PP sends
    the padded-length activations between devices."""
    for r in pools(2).run(compare_padded_with_reference, "braided_v", 1, 2, "qwen2_5_vl", 5, timeout_s=120):
        assert r["checked"] > 0 and r["loss"] is not None
    pp_runs = pools(2).run(compare_padded_with_reference, "zb_v", 2, 1, "qwen2_vl", 5, timeout_s=120)
    assert all(r["checked"] > 0 for r in pp_runs)


def test_every_padded_micro_batch_has_one_key() -> None:
    """The chunks' batch key (what a CUDA graph is captured for) is the same for micro-batches of different
    resolutions once padded, and differs between them unpadded; the graph's static buffers keep the item's type."""
    from braid import schedules
    from braid.models.vision_chunk import build_vlm_rank_chunks
    from braid.models.vlm_batch import batch_shapes
    from braid.runtime.graphs import _empty_like

    cfg = vlm_preset("tiny", kind="qwen2_5_vl")
    g = torch.Generator().manual_seed(1)
    batches = [_samples(cfg, sides, g) for sides in SIDES]
    items = [_pack(cfg, samples, 32)[0] for samples in batches]
    plan = schedules.build("braided_v", 1, 2)
    chunks = build_vlm_rank_chunks(Qwen2VLModel(cfg), plan, 0, vlm_stage_layers(cfg, plan.num_stages, 1))
    for ch in chunks.values():
        keys = {ch.batch_key([item]) for item in items}
        assert len(keys) == 1, keys
    unpadded = {batch_shapes([(item.pixel_values, item.input_ids, torch.tensor([[1, s // 4, s // 4] for s in sides]))],
                             cfg.vit.patch, cfg.vit.merge, cfg.image_token_id)
                for item, sides in zip(items, SIDES)}
    assert len(unpadded) == len(SIDES)
    assert isinstance(_empty_like(items[0], torch.device("cpu")), PackedImages)


def test_padding_is_its_own_segment_and_feeds_no_token() -> None:
    cfg = vlm_preset("tiny", kind="qwen2_5_vl")
    samples = _samples(cfg, (16, 24), torch.Generator().manual_seed(2))
    item, _ = _pack(cfg, samples, 20)  # 4 + 9 real visual tokens, 7 padded
    u = cfg.vit.merge ** 2
    real = 13 * u
    full, window = item.segment_ids
    assert set(full[:real].tolist()) == {0, 1} and set(full[real:].tolist()) == {2}
    assert set(window[real:].tolist()) == {int(window[:real].max()) + 1}
    b, s = item.input_ids.shape
    visual = item.token_src[item.token_src >= b * s] - b * s
    assert visual.tolist() == list(range(13))  # each real visual token taken once, in order; padded ones never
    assert torch.equal(item.pixel_values[real:], torch.zeros_like(item.pixel_values[real:]))


def test_a_micro_batch_over_the_budget_is_one_clear_error() -> None:
    cfg = vlm_preset("tiny")
    samples = _samples(cfg, (32, 24), torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"needs 25 visual tokens, more than the budget of 20; raise --visual-token-budget"):
        _pack(cfg, samples, 20)
