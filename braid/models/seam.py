"""The model seam: what the chunk runner and the executor need from a model, declared once.

A model family is written for one device (as torchtitan's models are); the runtime never
reads its attribute names. It asks a *layer* for its four units (:mod:`braid.core.braiding`:
pre_attn, attn, pre_mlp, mlp) through :class:`UnitLayer`, and a *model* for the pieces a
pipeline stage is cut from through :class:`StageModel`. A new family implements these two
protocols in one module and registers itself in :mod:`braid.models.registry`; the chunk
runner (:mod:`braid.models.chunk`), the chunk builder (:mod:`braid.models.build`), the
profiler and the cost model need no edit.

Unit contract (paper Sec. 3, Fig. 2-3). ``pre_attn`` / ``pre_mlp`` are a norm
(:meth:`UnitLayer.unit_norm`, run by the chunk runner so that its backward can be finished
after the all-reduce) followed by ``unit_forward(unit, h, positions=...)``, which returns the
tuple of tensors handed to the next unit. ``attn`` / ``mlp`` take that tuple and the layer
input ``residual`` and return one tensor *partial over TP* with ``residual/tp`` already
added (the fused residual; :func:`fused_residual`: under sequence sharding the residual is the
rank's ``s/t`` tokens, added once into those tokens). The runner passes ``residual`` detached where it cuts the graph
between units (and adds its +1 gradient itself), attached in fused mode (tp=1): a unit
must not detach it. Which units end
with a TP all-reduce is :data:`braid.core.braiding.AR_FORWARD` / :data:`braid.core.braiding.AR_BACKWARD`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from braid.core.braiding import Unit
from braid.tp.seq_shard import add_shard_residual


def fused_residual(layer: Any, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The fused residual of an ``attn``/``mlp`` unit: ``out + residual/tp``; under sequence
    sharding (``layer.seq_rank`` set by the chunk builder, :mod:`braid.tp.seq_shard`) the
    residual holds the rank's tokens only and goes once into those tokens of ``out``."""
    rank = getattr(layer, "seq_rank", None)
    if rank is None:
        return layer.fns.add_residual(out, residual, layer.tp)
    return add_shard_residual(out, residual, rank)


class UnitMethods:
    """``unit_forward`` for a layer that names its units' forward pieces ``qkv(h, positions)``,
    ``gate_up(h)``, ``attn(q, k, v, residual)`` and ``mlp(gate, up, residual)`` (Qwen2's
    decoder layer, the ViT block): the dispatch written once."""

    def unit_forward(self, unit: Unit, *inputs: torch.Tensor, residual: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """``pre_*``: normed input -> activations; ``attn``/``mlp``: activations -> output + residual/tp."""
        if unit is Unit.PRE_ATTN:
            return self.qkv(inputs[0], positions)
        if unit is Unit.PRE_MLP:
            return self.gate_up(inputs[0])
        if residual is None:
            raise ValueError(f"unit {unit.value} needs the residual")
        return self.attn(*inputs, residual) if unit is Unit.ATTN else self.mlp(*inputs, residual)


@runtime_checkable
class UnitLayer(Protocol):
    """One decoder layer (a TP shard or the full layer) seen as four units."""

    sp: Any  # sequence-parallel context (:class:`braid.models.sequence_parallel.SequenceParallel`) or None

    def unit_norm(self, unit: Unit) -> nn.Module:
        """The norm that starts ``pre_attn`` / ``pre_mlp`` (a module with a ``weight``)."""
        ...

    def unit_forward(self, unit: Unit, *inputs: torch.Tensor, residual: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """``pre_*``: normed input -> tuple of activations; ``attn``/``mlp``: those -> output + residual/tp."""
        ...

    def unit_weights(self, unit: Unit) -> tuple[nn.Module, ...]:
        """The linear modules of ``unit`` whose weight gradients a W task computes (TP shards split them off)."""
        ...


@runtime_checkable
class ExpertLayer(UnitLayer, Protocol):
    """A mixture-of-experts layer: its MLP side is the units pre_mlp, experts and mlp
    (:data:`braid.core.braiding.MOE_LAYER_UNITS`), cut at expert parallelism's exchanges
    (:mod:`braid.models.moe_ops` runs them). In one piece ``unit_forward`` runs Pre-MLP -> a tuple,
    Experts -> the MoE output, MLP -> that plus ``residual/tp``."""

    dispatcher: Any  # braid.models.moe_dispatch.Dispatcher: where the rows go (expert parallelism swaps it)

    def route_rows(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed states (b, s, h) -> top-k rows sorted by expert (T*k, h), slot weights (T, k), ``order`` (T*k,)
        and rows per expert (E,) (:func:`braid.models.moe.permute`)."""
        ...

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows (N, h) sorted by local expert, ``counts`` per local expert -> the experts' outputs (N, h)."""
        ...


@runtime_checkable
class StageModel(Protocol):
    """A single-device decoder LM that the chunk builder cuts into pipeline stages.

    ``lm_head.weight is embed_tokens.weight`` when the family ties them
    (``cfg.tie_embeddings``); the builder then gives the first and the last stage their own
    copy, marked so that :func:`braid.runtime.distributed.reduce_gradients` sums their
    gradients (:mod:`braid.models.tied`).
    """

    cfg: Any
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear

    def shard_layer(self, layer: nn.Module, tp_rank: int, tp_size: int) -> UnitLayer:
        """The TP shard of ``layer`` (one of ``self.layers``, or its materialised copy), copied."""
        ...

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(b, s) token ids -> (b, s, vocab) float logits."""
        ...


def keep_units(layer: nn.Module, units: tuple[Unit, ...]) -> nn.Module:
    """``layer`` (a :class:`UnitLayer`) cut down, in place, to the parameters of ``units`` (a half-layer cut's side).

    The other units' norms and linears (:meth:`UnitLayer.unit_norm`, :meth:`UnitLayer.unit_weights`
    and the parts of a joined group) are set to None where the layer holds them, so the
    chunk holds, counts, reduces and saves only its own half. Raises ``ValueError`` where a
    parameter would be left that none of ``units`` names (a family with more per-layer
    weights than the seam declares): such a layer cannot be cut in half.
    """
    if isinstance(layer, ExpertLayer) and Unit.MLP in units:  # a mixture's MLP side holds its experts
        units = (*units, Unit.EXPERTS)
    every = (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP) + ((Unit.EXPERTS,) if isinstance(layer, ExpertLayer) else ())

    def mods(us: tuple[Unit, ...]) -> set[int]:
        out: set[int] = set()
        for u in us:
            for m in (layer.unit_norm(u), *layer.unit_weights(u)) if u in (Unit.PRE_ATTN, Unit.PRE_MLP) else layer.unit_weights(u):
                out.update(id(s) for s in (m, *getattr(m, "_parts", ())))
        return out

    keep = mods(units)
    drop = mods(tuple(u for u in every if u not in units)) - keep
    for parent in list(layer.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in drop:
                setattr(parent, name, None)
    kept = {id(p) for m in layer.modules() if id(m) in keep for p in m.parameters()}
    left = [n for n, p in layer.named_parameters() if id(p) not in kept]
    if left:
        raise ValueError(f"{type(layer).__name__} cannot be cut in half: {left} belong to no unit the seam names")
    return layer
