"""Where each parameter of a rank's model chunk sits in the single-device model.

A checkpoint keyed by the single-device model's parameter names (``layers.7.q_proj.weight``)
can be resumed under any (tp, pp, dp, schedule): each rank states, for every local
parameter, its global name and which block of the global tensor it holds
(:class:`ShardSpec`); ``torch.distributed.checkpoint`` reads and writes those blocks.

The block a parameter holds follows from its module's kind, as the TP layers slice them
(:mod:`braid.tp.layers`, :mod:`braid.tp.embedding`): column-parallel linears and the
vocabulary-parallel embedding hold a contiguous block of rows (dim 0, weight and bias),
row-parallel linears a block of columns (dim 1; their bias lives on TP rank 0 whole), all
other parameters (norms) are whole on every rank.

:func:`check_shards` compares every local parameter with its block of the single-device
model once, when the chunks are built, so a wrong name or block cannot go unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from braid.models.chunk import ModelChunk
from braid.tp.embedding import VocabParallelEmbedding
from braid.tp.layers import ColumnParallelLinear, RowParallelLinear


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """A local parameter's place in the single-device model.

    ``name``: the global parameter name; ``dim``: the dimension split over ``count`` TP
    ranks (``None``: the local tensor is the whole global tensor); ``index``: which block;
    ``over``: the ranks that split it, ``"tp"`` or ``"ep"`` (a mixture's experts sharded over
    expert-parallel ranks, :mod:`braid.runtime.expert_parallel`).
    """

    name: str
    dim: int | None = None
    index: int = 0
    count: int = 1
    over: str = "tp"

    def global_shape(self, local: torch.Size) -> tuple[int, ...]:
        shape = list(local)
        if self.dim is not None:
            shape[self.dim] *= self.count
        return tuple(shape)

    def block(self, full: torch.Tensor) -> torch.Tensor:
        """This spec's block of the global tensor ``full``."""
        if self.dim is None:
            return full
        n = full.shape[self.dim] // self.count
        return full.narrow(self.dim, self.index * n, n)


def _split_dim(module: nn.Module, attr: str) -> int | None:
    if hasattr(module, "tp_split"):  # a module that says how TP splits it (a mixture's experts and router)
        return module.tp_split
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
        return 0
    if isinstance(module, RowParallelLinear) and attr == "weight":
        return 1
    return None


def global_name(chunk: ModelChunk, local: str, *, vlm: bool = False) -> str:
    """The single-device name of chunk parameter ``local`` (each chunk kind names its own:
    :meth:`braid.models.chunk.ModelChunk.global_name`).

    LLM (:class:`braid.models.qwen2.Qwen2Model`): ``layers.{first_layer + i}.*``,
    ``embed_tokens``, ``norm``, ``lm_head``. VLM (:class:`braid.models.qwen2_vl.Qwen2VLModel`):
    the same under ``lm.``, and the vision chunk's blocks, patch embedding and merger under
    ``visual.`` (its text embedding is ``lm.embed_tokens``).
    """
    return chunk.global_name(local, vlm=vlm)


def chunk_shards(chunks: dict[int, ModelChunk], tp_rank: int, tp_size: int, *, vlm: bool = False) -> dict[nn.Parameter, ShardSpec]:
    """Every local parameter of ``chunks`` with its :class:`ShardSpec`."""
    out: dict[nn.Parameter, ShardSpec] = {}
    for chunk in chunks.values():
        for mod_name, module in chunk.named_modules():
            for attr, p in module.named_parameters(recurse=False):
                local = f"{mod_name}.{attr}" if mod_name else attr
                dim = _split_dim(module, attr) if tp_size > 1 else None
                out[p] = ShardSpec(global_name(chunk, local, vlm=vlm), dim, tp_rank if dim is not None else 0,
                                   tp_size if dim is not None else 1)
    return out


def _values(model: nn.Module, name: str, meta: torch.Tensor) -> torch.Tensor:
    """The values parameter ``name`` of a meta-device ``model`` gets from its source (only that tensor is made)."""
    source = getattr(model, "braid_source", None)
    if source is None:
        raise ValueError(f"{name!r} of the single-device model is on the meta device without a source to compare with")
    out = torch.empty(meta.shape, dtype=meta.dtype, device=source.device)
    with torch.no_grad():
        source.fill(out, name)
    return out


def check_shards(shards: dict[nn.Parameter, ShardSpec], model: nn.Module) -> None:
    """Raise ``ValueError`` unless every local parameter equals its block of ``model`` (same names, shapes, values).

    ``model`` may live on the meta device: each compared tensor is then made from its source alone.
    """
    full = dict(model.named_parameters())
    seen: set[str] = set()
    for p, spec in shards.items():
        if spec.name not in full:
            raise ValueError(f"chunk parameter maps to {spec.name!r}, which the single-device model does not have")
        if spec.name in seen:
            raise ValueError(f"two chunk parameters of this rank map to {spec.name!r}")
        seen.add(spec.name)
        g = full[spec.name]
        if g.is_meta:  # a meta-device model (braid.models.build.meta_model, braid.hf.load_meta): its values from its source
            g = _values(model, spec.name, g)
        if spec.global_shape(p.shape) != tuple(g.shape) or not torch.equal(spec.block(g.detach()).to(p.device, p.dtype), p.detach()):
            raise ValueError(f"chunk parameter {spec.name!r} {tuple(p.shape)} is not block {spec.index} of "
                             f"{tuple(g.shape)} along dim {spec.dim}")
