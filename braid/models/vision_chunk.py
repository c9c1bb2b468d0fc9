"""The vision stage of a Qwen2-VL as a model chunk, M-RoPE LM chunks, and the per-rank chunks of a pipelined VLM.

:class:`VisionChunk` is a :class:`~braid.models.chunk.ModelChunk` whose ``embed`` unit is the
patch embedding, whose layers are ViT blocks (the same four units as LM layers) and which
ends with a ``merge`` unit (:class:`braid.core.braiding.Unit`): patch merger, the text
embedding, and the visual tokens written over the image-pad tokens' embeddings -- the LM's
input. :class:`MRopeChunk` is an LM chunk whose layers rotate by M-RoPE positions, which
every LM chunk computes from the micro-batch's ``input_ids`` and image grids.

TP (paper Sec. 3 operators f and g, applied to the vision stage):

* patch embedding: row-parallel over the flattened patch features (each rank holds a
  slice of them) -> partial sum, all-reduced at the end of ``embed``;
* ViT blocks: as LM layers (column-parallel Q/K/V and fc1 or gate/up, row-parallel out
  and fc2 or down; biases of row-parallel layers on TP rank 0 only);
* merge: norm -> column-parallel fc1 -> GELU -> row-parallel fc2 (partial), scattered into
  the vocab-parallel text embedding (partial): a sum of partial sums, so one all-reduce
  in forward. In backward fc1's input gradient is partial: the unit ends with its
  all-reduce, and the merger norm's backward runs at the start of the next unit (the last
  ViT block's ``mlp``), as for LM layers.

Built from a meta-device model (:func:`braid.models.build.meta_model`,
:func:`braid.hf.load_meta`), a rank materialises only its own chunks: the vision chunk the
tower and the text embedding, an LM chunk its layers (read under the model's ``lm.`` names).
:func:`braid.models.global_names.global_name` names their parameters as the single-device
model does, so :func:`braid.hf.save_chunks` writes them.

A micro-batch item is ``(pixel_values, input_ids, image_grid_thw)`` or ``(images,
input_ids)`` (:func:`braid.models.qwen2_vl.split_item`); every micro-batch must have the
same ``input_ids`` shape (the activation between stages has a fixed shape: pad on the right).
The head reads braid's shifted labels of the whole sequence.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.distributed as dist

from braid.core.braiding import LAYER_UNITS, ChunkSpec, Unit
from braid.core.ir import Plan
from braid.models.build import (
    TIED_KEY,
    Prefixed,
    _real,
    _source,
    build_chunk,
    tied_holders,
)
from braid.models.chunk import ModelChunk
from braid.models.chunk_parts import ChunkStateError, _Backward, _leaf, _Piece
from braid.models.qwen2_vl import (
    MRopeLayer,
    Qwen2VLConfig,
    Qwen2VLModel,
    rope_index,
)
from braid.models.tied import Tie, mark
from braid.models.vlm_batch import BatchShape, ShapeCache, batch_shapes, capturing, flat_positions, scatter_rows
from braid.models.vlm_pack import PackedImages, packed_key, packed_layout, take_rows
from braid.models.vit import (
    PatchMerger,
    VisionBlock,
    VisionLayout,
    check_pixels,
    parallelize_block,
    patch_rows,
    vision_layout,
)
from braid.tp.embedding import VocabParallelEmbedding
from braid.tp.layers import (
    ColumnParallelLinear,
    DeferredWeightGrad,
    RowParallelLinear,
    _check_split,
    split_weight_grads,
)

# The single-device names of the vision chunk's modules (its text embedding is the LM's).
_VISION = {"layers": "visual.blocks", "embed": "visual.patch_embed", "merger": "visual.merger", "text_embed": "lm.embed_tokens"}


def _shapes(cfg: Qwen2VLConfig, tokens: Sequence) -> tuple:
    """The micro-batches' shapes that a VLM chunk's step depends on (its ``batch_key``): each one's
    :class:`BatchShape`, or for micro-batches padded to a visual-token budget (:mod:`braid.models.vlm_pack`)
    their fixed shape alone (no host read)."""
    packed = [isinstance(item, PackedImages) for item in tokens]
    if all(packed):
        return tuple(packed_key(item) for item in tokens)
    if any(packed):
        raise ValueError("a step mixes micro-batches padded to a visual-token budget (PackedImages) with others")
    return batch_shapes(tokens, cfg.vit.patch, cfg.vit.merge, cfg.image_token_id)


class VisionChunk(ModelChunk):
    """ViT stage: patch embedding, ``spec.layers`` ViT blocks, then the merge unit."""

    def __init__(
        self,
        spec: ChunkSpec,
        cfg: Qwen2VLConfig,
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
        self.cfg, self.vit = cfg, cfg.vit
        self.merger, self.text_embed = merger, text_embed
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.ids: list[torch.Tensor] = []
        self.layouts: list[VisionLayout] = []
        self.image_rows: list[torch.Tensor] = []
        self._plan_of = ShapeCache(self._build_plan)
        self._plans: list = []

    def global_name(self, local: str, *, vlm: bool = True) -> str:
        """The tower's blocks, patch embedding and merger under ``visual.``."""
        head, _, rest = local.partition(".")
        return f"{_VISION[head]}.{rest}"

    graph_safe_batch = True  # host reads happen in prepare_batch, once per step and outside a capture

    def batch_key(self, tokens: Sequence) -> tuple[BatchShape, ...]:
        """Each micro-batch's :class:`~braid.models.vlm_batch.BatchShape` (one host read of the step's ``input_ids``)."""
        return _shapes(self.cfg, tokens)

    def prepare_batch(self, tokens: Sequence) -> tuple[BatchShape, ...]:
        """The layouts and visual-token positions of these micro-batches, on this chunk's device (cached per shape;
        padded micro-batches carry theirs as data: :meth:`set_batch` makes them by device work)."""
        key = self.batch_key(tokens)
        self._plans = [None if isinstance(shape, tuple) and shape[0] == "padded" else self._plan_of(shape) for shape in key]
        return key

    def _build_plan(self, shape: BatchShape) -> tuple[VisionLayout, torch.Tensor, torch.Tensor]:
        dev = next(self.parameters()).device
        grid = torch.tensor(shape.grids, dtype=torch.long)
        return vision_layout(grid.to(dev), self.vit), flat_positions(shape).to(dev), grid

    def set_batch(self, tokens: Sequence, labels: Sequence[torch.Tensor]) -> None:
        """Per micro-batch: the patches in the tower's order (window order for Qwen2.5-VL), this TP rank's
        slice of their features, the layout the blocks need, where the visual tokens go, and the ``input_ids``.

        Outside a CUDA-graph capture the micro-batches' shapes are read here (:meth:`prepare_batch`);
        inside one, the graph runner has prepared them: everything below is device work."""
        if not capturing():
            self.prepare_batch(tokens)
        n = self.vit.patch_dim // self.tp_size
        patches, self.ids, self.layouts, self.image_rows = [], [], [], []
        for item, plan in zip(tokens, self._plans):
            if isinstance(item, PackedImages):  # padded to a visual-token budget: segments, positions and sources are data
                layout, rows, pixel_values = packed_layout(item, self.vit), item.token_src, item.pixel_values
            else:
                layout, rows, grid = plan
                pixel_values = item[0] if len(item) == 3 else patch_rows(item[0], self.vit)
                check_pixels(pixel_values, grid, self.vit)  # shapes only: the grid is on the host
            x = layout.reorder(pixel_values, self.vit.merge ** 2)
            patches.append(x[:, self.tp_rank * n : (self.tp_rank + 1) * n].unsqueeze(0))  # (1, N, pd/t)
            self.ids.append(item[1])
            self.layouts.append(layout)
            self.image_rows.append(rows)
        super().set_batch(patches, labels)

    def cut_reason(self) -> str | None:
        return "the vision chunk (its merge unit runs on cut pieces)"

    def set_recompute(self, mode: str) -> None:
        """The ViT stage keeps its activations under every recomputation mode (the LM chunks recompute)."""

    def _norm_of(self, unit: Unit, layer: int) -> torch.nn.Module:
        return self.layers[layer].unit_norm(unit)

    def _forward(self, mb: int, unit: Unit, layer: int) -> torch.Tensor | None:
        if unit is Unit.MERGE:
            return self._merge_forward(mb, unit, layer)
        if unit in LAYER_UNITS:
            self.layers[layer].layout = self.layouts[mb]
        out = super()._forward(mb, unit, layer)
        if unit in (Unit.PRE_ATTN, Unit.PRE_MLP):  # LayerNorm: the bias gets its gradient with the weight's
            self._saved[(mb, unit, layer)][0].params = tuple(self._norm_of(unit, layer).parameters())
        return out

    def _merge_forward(self, mb: int, unit: Unit, layer: int) -> torch.Tensor:
        if mb not in self._fwd:
            raise ChunkStateError(f"F{mb}: merge before the ViT blocks ran")
        (state,) = self._fwd[mb]
        key = (mb, unit, layer)
        layout, ids = self.layouts[mb], self.ids[mb]
        with self._saving(*key):
            x = _leaf(state)
            h = self.merger.group(x)  # (1, nv, 4hv), replicated
            hl = _leaf(h)
            vis = self.merger.project(hl)[0]  # (nv, H) partial over TP
            if layout.reverse is not None:
                vis = vis[layout.reverse]
            text = self.text_embed(ids)  # (b, s, H) partial
            if layout.masks is not None:  # padded: every LM position gathers its row; padded visual tokens go nowhere
                out = take_rows(text, vis, self.image_rows[mb])
            else:
                out = scatter_rows(text, self.image_rows[mb], vis)  # the image pads' rows, no host read
        self._saved[key] = [_Piece((x,), (h,), tuple(self.merger.ln_q.parameters())), _Piece((hl,), (out,))]
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

    def _deferred(self, unit: Unit, layer: int) -> Sequence[DeferredWeightGrad]:
        if unit is Unit.MERGE:
            return [self.merger.fc1, self.merger.fc2, self.text_embed]
        if unit in LAYER_UNITS:
            return self.layers[layer].unit_weights(unit)
        return super()._deferred(unit, layer)


class MRopeChunk(ModelChunk):
    """LM layers of a Qwen2-VL (and possibly its head) rotating by M-RoPE positions of each micro-batch."""

    def __init__(self, base: ModelChunk, cfg: Qwen2VLConfig) -> None:
        layers = [MRopeLayer.from_layer(lay, cfg.mrope_section) for lay in base.layers]
        super().__init__(base.spec, layers, base.embed, base.norm, base.lm_head, num_microbatches=base.m,
                         tp_group=base.tp_group, vocab_start=base.vocab_start, fuse=base.fuse)
        self.cfg = cfg
        self.mrope: list[torch.Tensor] = []
        self._positions_of = ShapeCache(self._build_positions)


    def global_name(self, local: str, *, vlm: bool = True) -> str:
        """LM parameters of a vision-language model: under ``lm.``."""
        return super().global_name(local, vlm=True)

    graph_safe_batch = True

    def batch_key(self, tokens: Sequence) -> tuple[BatchShape, ...]:
        return _shapes(self.cfg, tokens)

    def prepare_batch(self, tokens: Sequence) -> tuple[BatchShape, ...]:
        """The M-RoPE positions of these micro-batches on this chunk's device (cached per shape; a padded
        micro-batch carries its own)."""
        key = self.batch_key(tokens)
        self.mrope = [item.mrope if isinstance(item, PackedImages) else self._positions_of(shape)
                      for item, shape in zip(tokens, key)]
        return key

    def _build_positions(self, shape: BatchShape) -> torch.Tensor:
        # The positions follow from the shape alone: ids with the image pads where the shape has them.
        cfg = self.cfg
        ids = torch.full(shape.ids_shape, (cfg.image_token_id + 1) % cfg.lm.vocab_size, dtype=torch.long)
        for i, start, n in shape.runs:
            ids[i, start : start + n] = cfg.image_token_id
        grid = torch.tensor(shape.grids, dtype=torch.long).reshape(-1, 3)
        return rope_index(cfg, ids, grid).to(next(self.parameters()).device)

    def set_batch(self, tokens: Sequence, labels: Sequence[torch.Tensor]) -> None:
        """Micro-batch items as the vision chunk's; this chunk reads their shapes (outside a capture)."""
        if not capturing():
            self.prepare_batch(tokens)
        super().set_batch(tokens, labels)

    def _forward(self, mb: int, unit: Unit, layer: int) -> torch.Tensor | None:
        if unit is Unit.PRE_ATTN:
            self.positions = self.mrope[mb]
        return super()._forward(mb, unit, layer)


def build_vision_chunk(
    model: Qwen2VLModel, spec: ChunkSpec, *, tp_rank: int = 0, tp_size: int = 1, num_microbatches: int = 1
) -> VisionChunk:
    """The TP shard of the whole vision tower plus the text embedding (copied from ``model``).

    ``model`` may live on the meta device (:func:`braid.models.build.meta_model`,
    :func:`braid.hf.load_meta`): only the tower and the text embedding are then made real.
    """
    vit = model.cfg.vit
    if spec.layers != vit.layers:
        raise ValueError(f"the vision stage holds all {vit.layers} ViT blocks, spec has {spec.layers}")
    _check_split(vit.patch_dim, tp_size, tp_rank, f"patch features (channels*temporal_patch*patch^2 = {vit.patch_dim})")
    source, tower = _source(model), model.visual
    patch_embed = RowParallelLinear.from_full(_real(tower.patch_embed, source, "visual.patch_embed."), tp_rank, tp_size)
    blocks = [parallelize_block(_real(b, source, f"visual.blocks.{i}."), tp_rank, tp_size) for i, b in enumerate(tower.blocks)]
    full_merger = _real(tower.merger, source, "visual.merger.")
    merger = copy.deepcopy(full_merger)
    merger.fc1 = ColumnParallelLinear.from_full(full_merger.fc1, tp_rank, tp_size)
    merger.fc2 = RowParallelLinear.from_full(full_merger.fc2, tp_rank, tp_size)
    text_embed = VocabParallelEmbedding.from_full(_real(model.lm.embed_tokens, source, "lm.embed_tokens."), tp_rank, tp_size)
    return VisionChunk(spec, model.cfg, patch_embed, blocks, merger, text_embed,
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
    """The local chunks of ``pp_rank``: the vision chunk where stage 0 lives, M-RoPE LM chunks elsewhere.

    ``stage_layers`` as from :func:`braid.models.qwen2_vl.vlm_stage_layers` (stage 0 counts ViT
    blocks, the others LM layers). ``model`` may live on the meta device: this rank then
    materialises only its own chunks' parameters. A tied model's text embedding (vision
    chunk) and head (last chunk) are marked as copies whose gradients
    :func:`braid.runtime.distributed.reduce_gradients` sums.
    """
    specs = vlm_chunk_specs(stage_layers, plan)
    source = _source(model)
    lm = model.lm
    if source is not None:
        lm = copy.copy(model.lm)  # the same meta modules, read under the model's "lm." names
        lm.braid_source = Prefixed(source, "lm.")
    tie = Tie(TIED_KEY, tied_holders(plan)) if model.cfg.lm.tie_embeddings else None
    out: dict[int, ModelChunk] = {}
    for c in range(plan.v):
        stage = plan.stage_of(pp_rank, c)
        if stage == 0:
            out[c] = build_vision_chunk(model, specs[0], tp_rank=tp_rank, tp_size=tp_size, num_microbatches=plan.m)
            out[c].first_layer = 0
            if tie is not None:
                mark(out[c].text_embed.weight, tie)
            continue
        first = sum(stage_layers[1:stage])  # LM layer index
        base = build_chunk(lm, specs[stage], first, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                           num_microbatches=plan.m)
        out[c] = MRopeChunk(base, model.cfg)
        out[c].first_layer = first
        if tie is not None and base.lm_head is not None:
            mark(out[c].lm_head.weight, tie)
    return out
