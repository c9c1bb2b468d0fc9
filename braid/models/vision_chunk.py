"""The vision stage of a VLM as a model chunk, and the per-rank chunks of a pipelined VLM.

:class:`VisionChunk` is a :class:`~braid.models.chunk.ModelChunk` whose ``embed`` unit is the
patch embedding, whose layers are ViT blocks (the same four units as LM layers) and which
ends with a ``merge`` unit (:class:`braid.braiding.Unit`): patch merger + text embedding,
concatenated into the LM's input ``[visual ; text]``.

TP (paper Sec. 3 operators f and g, applied to the vision stage):

* patch embedding: row-parallel over the flattened patch pixels (each rank holds a slice of
  the patch features) -> partial sum, all-reduced at the end of ``embed``;
* ViT blocks: exactly as LM layers (column-parallel QKV / gate-up, row-parallel out/down);
* merge: norm -> column-parallel fc1 -> GELU -> row-parallel fc2 (partial) next to the
  vocab-parallel text embedding (partial): one all-reduce in forward. In backward fc1's
  input gradient is partial: the unit ends with its all-reduce, and the merger norm's
  backward runs at the start of the next unit (the last ViT block's ``mlp``), as for LM
  layers.

A micro-batch's "tokens" for this chunk are a ``(pixels, text_tokens)`` pair; the LM chunks
ignore them, and the head reads the joint labels (:meth:`Qwen2VLModel.full_labels`).
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.distributed as dist

from braid.braiding import ChunkSpec, Unit
from braid.ir import Plan
from braid.models.chunk import ChunkStateError, ModelChunk, _Backward, _leaf, _Piece, build_chunk
from braid.models.qwen2_vl import Qwen2VLModel
from braid.models.vit import PatchMerger, ViTConfig, VisionBlock, parallelize_block, patchify
from braid.tp.embedding import VocabParallelEmbedding
from braid.tp.layers import ColumnParallelLinear, DeferredWeightGrad, RowParallelLinear, _check_split, split_weight_grads


class VisionChunk(ModelChunk):
    """ViT stage: patch embedding, ``spec.layers`` ViT blocks, then the merge unit."""

    def __init__(
        self,
        spec: ChunkSpec,
        vit: ViTConfig,
        patch_embed: RowParallelLinear,
        blocks: Sequence[VisionBlock],
        merger: PatchMerger,
        text_embed: VocabParallelEmbedding,
        *,
        num_microbatches: int,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        if not (spec.embed and spec.merge) or spec.head:
            raise ValueError(f"a vision chunk needs embed=True, merge=True and no head, got {spec}")
        super().__init__(spec, blocks, patch_embed, None, None, num_microbatches=num_microbatches)
        self.vit = vit
        self.merger, self.text_embed = merger, text_embed
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.text: list[torch.Tensor] = []

    def set_batch(self, tokens: Sequence, labels: Sequence[torch.Tensor]) -> None:
        """``tokens[mb]`` is ``(pixels (b, 3, H, W), text_tokens (b, s))``; the patch features are sliced for TP."""
        n = self.vit.patch_dim // self.tp_size
        patches, texts = [], []
        for item in tokens:
            pixels, text = item
            patches.append(patchify(pixels, self.vit)[..., self.tp_rank * n : (self.tp_rank + 1) * n])  # (b, n, pd/t)
            texts.append(text)
        super().set_batch(patches, labels)
        self.text = texts

    # -- the merge unit --------------------------------------------------------------------
    def _forward(self, mb: int, unit: Unit, layer: int) -> torch.Tensor | None:
        if unit is not Unit.MERGE:
            return super()._forward(mb, unit, layer)
        if mb not in self._fwd:
            raise ChunkStateError(f"F{mb}: merge before the ViT blocks ran")
        (state,) = self._fwd[mb]
        key = (mb, unit, layer)
        with self._saving(*key):
            x = _leaf(state)
            h = self.merger.group(x)  # (b, nv, 4hv), replicated
            hl = _leaf(h)
            vis = self.merger.project(hl)  # (b, nv, H) partial over TP
            out = torch.cat([vis, self.text_embed(self.text[mb])], dim=1)  # (b, nv + s, H) partial
        self._saved[key] = [_Piece((x,), (h,), (self.merger.ln_q.weight,)), _Piece((hl,), (out,))]
        self._fwd[mb] = (out.detach(),)
        return self._fwd[mb][0]

    def _backward(self, mb: int, unit: Unit, layer: int) -> torch.Tensor | None:
        if unit is not Unit.MERGE:
            return super()._backward(mb, unit, layer)
        if mb not in self._grad_out:
            raise ChunkStateError(f"B{mb}: output gradient missing (not received)")
        st = self._bwd.setdefault(mb, _Backward())
        norm_piece, proj_piece = self._take(mb, unit, layer)
        g = self._grad_out.pop(mb)
        (hl,) = proj_piece.inputs
        with split_weight_grads(self._deferred(unit, layer), mb):
            # The text embedding's weight is listed so its (stashing) backward runs too.
            torch.autograd.backward(proj_piece.outputs, (g,), inputs=[hl, self.text_embed.weight])
        st.pending = (norm_piece, hl.grad, None, (mb, unit, layer))
        return hl.grad  # partial over TP (fc1 is column-parallel): operator f

    def _deferred(self, unit: Unit, layer: int) -> list[DeferredWeightGrad]:
        if unit is Unit.MERGE:
            return [self.merger.fc1, self.merger.fc2, self.text_embed]
        return super()._deferred(unit, layer)


def build_vision_chunk(
    model: Qwen2VLModel, spec: ChunkSpec, *, tp_rank: int = 0, tp_size: int = 1, num_microbatches: int = 1
) -> VisionChunk:
    """The TP shard of the whole vision tower plus the text embedding (copied from ``model``)."""
    vit = model.cfg.vit
    if spec.layers != vit.layers:
        raise ValueError(f"the vision stage holds all {vit.layers} ViT blocks, spec has {spec.layers}")
    _check_split(vit.patch_dim, tp_size, tp_rank, f"patch features (channels*patch^2 = {vit.patch_dim})")
    tower = model.visual
    patch_embed = RowParallelLinear.from_full(tower.patch_embed, tp_rank, tp_size)
    blocks = [parallelize_block(b, tp_rank, tp_size) for b in tower.blocks]
    merger = copy.deepcopy(tower.merger)
    merger.fc1 = ColumnParallelLinear.from_full(tower.merger.fc1, tp_rank, tp_size)
    merger.fc2 = RowParallelLinear.from_full(tower.merger.fc2, tp_rank, tp_size)
    text_embed = VocabParallelEmbedding.from_full(model.lm.embed_tokens, tp_rank, tp_size)
    return VisionChunk(spec, vit, patch_embed, blocks, merger, text_embed,
                       num_microbatches=num_microbatches, tp_rank=tp_rank, tp_size=tp_size)


def vlm_chunk_specs(stage_layers: Sequence[int], plan: Plan) -> dict[int, ChunkSpec]:
    """``stage -> ChunkSpec``: stage 0 the vision stage, the last one with the LM head."""
    n = len(stage_layers)
    if n != plan.num_stages:
        raise ValueError(f"{n} layer counts for {plan.num_stages} virtual stages")
    return {s: ChunkSpec(stage_layers[0], embed=True, merge=True) if s == 0 else ChunkSpec(layers, head=s == n - 1)
            for s, layers in enumerate(stage_layers)}


def build_vlm_rank_chunks(
    model: Qwen2VLModel,
    plan: Plan,
    pp_rank: int,
    stage_layers: Sequence[int],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: dist.ProcessGroup | None = None,
) -> dict[int, ModelChunk]:
    """The local chunks of ``pp_rank``: the vision chunk where stage 0 lives, LM chunks elsewhere.

    ``stage_layers`` as from :func:`braid.models.qwen2_vl.vlm_stage_layers` (stage 0 counts ViT
    blocks, the others LM layers).
    """
    specs = vlm_chunk_specs(stage_layers, plan)
    out: dict[int, ModelChunk] = {}
    for c in range(plan.v):
        stage = plan.stage_of(pp_rank, c)
        if stage == 0:
            out[c] = build_vision_chunk(model, specs[0], tp_rank=tp_rank, tp_size=tp_size, num_microbatches=plan.m)
            out[c].first_layer = 0
            continue
        first = sum(stage_layers[1:stage])  # LM layer index
        out[c] = build_chunk(model.lm, specs[stage], first, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                             num_microbatches=plan.m)
        out[c].first_layer = first
    return out
