"""Chunk building: a rank's model chunks (TP shards of its pipeline stages) from a single-device model.

Works for any family that implements :class:`braid.models.seam.StageModel`. The model may
live on the meta device (:func:`meta_model`, :func:`on_meta`): a rank then materialises only the layers of its
own chunks, one full layer at a time, with values from the model's
:class:`ParamSource` -- initialised by name (:func:`braid.models.init.init_tensor`: the
values the single-device model gets from ``init_weights`` with the same seed), or read
from a checkpoint (:func:`braid.hf.load_meta`: only the chunks' tensors) -- and slices
its TP shard from it. So a
7B/15B preset starts in seconds and no rank holds another rank's layers.

Tied embeddings: the first stage's embedding and the last stage's head are separate
copies marked with a :class:`braid.models.tied.Tie`; their gradients are summed by
:func:`braid.runtime.distributed.reduce_gradients`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from braid.core.braiding import LAYER_UNITS, ChunkSpec
from braid.core.ir import Plan
from braid.models.chunk import ModelChunk
from braid.models.init import init_tensor
from braid.models.seam import ExpertLayer, StageModel, UnitLayer, keep_units
from braid.models.sequence_parallel import SequenceParallel
from braid.models.tied import Tie, mark, tie_of
from braid.core.partition import chunk_specs, layer_offset
from braid.tp.embedding import VocabParallelEmbedding
from braid.tp.layers import ColumnParallelLinear, RowParallelLinear
from braid.io.cli import NO_SEQ_SHARD_WITH_CP, SeqShardError, check_seq

TIED_KEY = "embed_tokens.weight"


class ParamSource(Protocol):
    """Where a meta-device model's parameters get their values: ``fill(t, name)`` writes the
    values of the parameter with global (single-device model) name ``name`` into ``t``."""

    device: torch.device

    def fill(self, t: torch.Tensor, name: str) -> None: ...


@dataclass(frozen=True, slots=True)
class InitSource:
    """Deterministic by-name initialisation (:func:`braid.models.init.init_tensor`) under ``seed``."""

    seed: int
    std: float
    device: torch.device

    def fill(self, t: torch.Tensor, name: str) -> None:
        init_tensor(t, self.seed, name, self.std)


@dataclass(frozen=True, slots=True)
class Prefixed:
    """``inner``'s values under ``prefix + name``: the source of a sub-model (e.g. a VLM's ``lm.``) built on its own."""

    inner: ParamSource
    prefix: str

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def fill(self, t: torch.Tensor, name: str) -> None:
        self.inner.fill(t, self.prefix + name)


def on_meta(model_cls: type, cfg: object, source: ParamSource, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``model_cls(cfg)`` on the meta device (no storage); its parameters come from ``source``
    when :func:`build_chunk` or :func:`materialize` makes them real."""
    with torch.device("meta"):
        model = model_cls(cfg).to(dtype)
    model.braid_source = source
    return model


def meta_model(model_cls: type, cfg: object, *, seed: int, std: float = 0.2, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """``model_cls(cfg)`` on the meta device, to be materialised chunk by chunk with the values
    ``model_cls(cfg).init_weights(seed, std)`` has on ``device``."""
    return on_meta(model_cls, cfg, InitSource(seed, std, torch.device(device)), dtype)


def _source(model: nn.Module) -> ParamSource | None:
    if next(model.parameters()).device.type != "meta":
        return None
    source = getattr(model, "braid_source", None)
    if source is None:
        raise ValueError("a meta-device model needs a source for its values: build it with braid.models.build.meta_model")
    return source


def materialize(model: nn.Module) -> nn.Module:
    """Make a meta-device model (:func:`on_meta`) real, whole, on its source's device, in place;
    a model that is already real is returned unchanged."""
    source = _source(model)
    if source is None:
        return model
    shared: dict[int, list[tuple[nn.Module, str]]] = {}  # tied parameters: to_empty gives each use its own tensor
    for module in model.modules():
        for pname, p in module._parameters.items():
            if p is not None:
                shared.setdefault(id(p), []).append((module, pname))
    model.to_empty(device=source.device)
    for uses in shared.values():
        first = getattr(uses[0][0], uses[0][1])
        for module, pname in uses[1:]:
            setattr(module, pname, first)
    with torch.no_grad():
        for name, p in model.named_parameters():
            source.fill(p, name)
    del model.braid_source
    return model


def _real(module: nn.Module, source: ParamSource | None, prefix: str, name_of: dict[str, str] | None = None,
          only: set[str] | None = None) -> nn.Module:
    """``module`` itself, or (meta model) a materialised copy whose parameter ``n`` has global name
    ``prefix + n`` (or ``name_of[n]``); with ``only``, the other parameters are not read but set
    to NaN (their values are about to be dropped; one that was not would show)."""
    if source is None:
        return module
    out = copy.deepcopy(module).to_empty(device=source.device)
    with torch.no_grad():
        for n, p in out.named_parameters():
            if only is None or n in only:
                source.fill(p, name_of[n] if name_of is not None else prefix + n)
            else:
                p.fill_(float("nan"))
    return out


def _half_names(layer: nn.Module, units: tuple) -> set[str] | None:
    """The parameter names of a meta-device ``layer`` that a half-layer cut keeping ``units``
    keeps (:func:`braid.models.seam.keep_units` on a copy), so that only they are read; None
    where the single-device layer is not a :class:`~braid.models.seam.UnitLayer` (all are read)."""
    if not isinstance(layer, UnitLayer):
        return None
    return {n for n, _ in keep_units(copy.deepcopy(layer), units).named_parameters()}


def build_chunk(
    model: StageModel,
    spec: ChunkSpec,
    first_layer: int,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: dist.ProcessGroup | None = None,
    num_microbatches: int = 1,
    sp: SequenceParallel | None = None,
    seq_len: int | None = None,
    fuse: bool | None = None,
    seq_shard: bool = False,
) -> ModelChunk:
    """The TP shard of layers ``[first_layer, first_layer + spec.modules)`` of a single-device model (copied).

    A half layer (``spec.half_in``: the first, ``spec.half_out``: the last) keeps only its
    half's parameters (:func:`braid.models.seam.keep_units`).

    ``fuse``: fused mode (:meth:`ModelChunk.choose_fused`): None lets the executor choose,
    False keeps the unit cuts.

    ``sp``: sequence-parallel context; its degrees are checked against the heads (and
    ``seq_len`` when given) here, and the layers run 2D-Attention on sequence shards.
    ``seq_shard``: Megatron's sequence parallelism inside TP (:mod:`braid.tp.seq_shard`; no
    effect at tp=1; not with ``sp``), ``seq_len`` checked against ``tp_size`` when given.
    A tied model's embedding and head copies are marked as held by pipeline rank 0
    (:func:`build_rank_chunks` marks the real holders).
    """
    cfg = model.cfg
    if sp is not None:
        sp.config.check_model(heads=cfg.heads, kv_heads=cfg.kv_heads, tp=tp_size, seq_len=seq_len)
    seq_shard = seq_shard and tp_size > 1
    if seq_shard and sp is not None:
        raise SeqShardError(NO_SEQ_SHARD_WITH_CP)
    if seq_shard and seq_len is not None:
        check_seq(seq_len, tp_size)
    source = _source(model)
    layers = []
    halves = {first_layer: LAYER_UNITS[2:]} if spec.half_in else {}
    if spec.half_out:
        halves[first_layer + spec.modules - 1] = LAYER_UNITS[:2]
    for i in range(first_layer, first_layer + spec.modules):
        only = _half_names(model.layers[i], halves[i]) if i in halves and source is not None else None
        lay = model.shard_layer(_real(model.layers[i], source, f"layers.{i}.", only=only), tp_rank, tp_size)
        if not isinstance(lay, UnitLayer):
            raise TypeError(f"{type(model).__name__}.shard_layer returned a {type(lay).__name__}, which lacks the "
                            "unit methods of braid.models.seam.UnitLayer (unit_norm, unit_forward, unit_weights)")
        if i in halves:
            keep_units(lay, halves[i])
        lay.sp = sp
        lay.seq_rank = tp_rank if seq_shard else None
        layers.append(lay)
    # the chunk's mixture-of-experts layers (their units: braid.core.braiding.MOE_LAYER_UNITS)
    spec = replace(spec, moe=frozenset(i for i, lay in enumerate(layers) if isinstance(lay, ExpertLayer)))
    embed = norm = lm_head = None
    if spec.embed:
        embed = VocabParallelEmbedding.from_full(_real(model.embed_tokens, source, "embed_tokens."), tp_rank, tp_size)
    if spec.head:
        norm = copy.deepcopy(_real(model.norm, source, "norm."))  # keeps the model's dtype and device
        head_name = TIED_KEY if getattr(cfg, "tie_embeddings", False) else "lm_head.weight"
        lm_head = ColumnParallelLinear.from_full(_real(model.lm_head, source, "", {"weight": head_name}), tp_rank, tp_size)
    if getattr(cfg, "tie_embeddings", False):
        for p in (embed.weight if embed is not None else None, lm_head.weight if lm_head is not None else None):
            if p is not None:
                mark(p, Tie(TIED_KEY, (0,)))
    vocab_start = tp_rank * (cfg.vocab_size // tp_size)
    chunk = ModelChunk(
        spec, layers, embed, norm, lm_head,
        num_microbatches=num_microbatches, tp_group=tp_group if tp_size > 1 else None, vocab_start=vocab_start, sp=sp,
        fuse=fuse, seq_shard=seq_shard,
    )
    chunk.first_layer = first_layer
    return chunk


def _split_dim(module: nn.Module, pname: str) -> int | None:
    """The dimension a chunk parameter is split along over TP (None: replicated, or held by TP rank 0 only);
    a module that says so itself (``tp_split``: a mixture's experts, its router) is split as it says."""
    if hasattr(module, "tp_split"):
        return module.tp_split
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
        return 0
    if isinstance(module, RowParallelLinear):
        return 1 if pname == "weight" else None
    return None


def chunk_state(chunk: ModelChunk, tp_group: dist.ProcessGroup | None = None, *, tied: bool = False) -> dict[str, torch.Tensor]:
    """The chunk's parameters under their single-device model names, TP shards joined (the inverse of :func:`build_chunk`).

    Collective over ``tp_group`` (every TP rank of the chunk calls it and gets the same
    tensors). ``tied``: the model ties its head to the embedding, so the head's copy is
    left out (the first stage's embedding carries the matrix). Names as
    :func:`braid.models.global_names.global_name` gives them (VLM chunks included).
    """
    from braid.models.global_names import global_name

    out: dict[str, torch.Tensor] = {}
    for mod_name, module in chunk.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = global_name(chunk, f"{mod_name}.{pname}")
            if tied and name.removeprefix("lm.") == "lm_head.weight":
                continue
            dim = _split_dim(module, pname)
            t = p.detach()
            if dim is not None and tp_group is not None and dist.get_world_size(tp_group) > 1:
                parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
                dist.all_gather(parts, t.contiguous(), group=tp_group)
                t = torch.cat(parts, dim=dim)
            out[name] = t
    return out


def tied_holders(plan: Plan) -> tuple[int, ...]:
    """Pipeline ranks holding the first or the last virtual stage (the copies of a tied embedding)."""
    return tuple(sorted({plan.rank_chunk_of(0)[0], plan.rank_chunk_of(plan.num_stages - 1)[0]}))


def build_rank_chunks(
    model: StageModel,
    plan: Plan,
    pp_rank: int,
    layers_per_stage: Sequence[int],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: dist.ProcessGroup | None = None,
    sp: SequenceParallel | None = None,
    seq_len: int | None = None,
    seq_shard: bool = False,
) -> dict[int, ModelChunk]:
    """The local chunks of ``pp_rank`` (TP shards, copied out of the single-device ``model``).

    ``model`` may be a :func:`meta_model`: only this rank's layers are then materialised.
    ``sp``: this rank's sequence-parallel context (LoongTrain 2D-Attention), checked against
    the model's heads and ``seq_len`` here, at build time. ``seq_shard``: see :func:`build_chunk`.
    """
    if len(layers_per_stage) != plan.num_stages:
        raise ValueError(f"{len(layers_per_stage)} layer counts for {plan.num_stages} virtual stages")
    specs = chunk_specs(tuple(layers_per_stage), plan.p, plan.placement)
    holders = tied_holders(plan)
    out = {}
    for c in range(plan.v):
        stage = plan.stage_of(pp_rank, c)
        first = layer_offset(tuple(layers_per_stage), stage)
        out[c] = build_chunk(
            model, specs[(pp_rank, c)], first, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, num_microbatches=plan.m,
            sp=sp, seq_len=seq_len, seq_shard=seq_shard,
        )
        out[c].first_layer = first
        if getattr(model.cfg, "tie_embeddings", False):
            for p in out[c].parameters():
                if tie_of(p) is not None:
                    mark(p, Tie(TIED_KEY, holders))
    return out
