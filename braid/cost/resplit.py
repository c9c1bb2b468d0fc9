"""A profile measured at one split of the layers over virtual stages, rewritten for another split.

A profile (cost file, :mod:`braid.cost.costs`) times every unit instance of the stages it was
measured on: the layer units (Pre-Attn, Attn, Pre-MLP, MLP, an MoE layer's experts), the
embedding on the first stage and the head (with the loss) on the last. A stage of another split
holds the same kinds of units in other numbers -- a half layer cuts between Attn and Pre-MLP
(:func:`braid.core.partition.stage_halves`) -- so its costs are the sum of its instances, each
timed as the measured profile timed that unit: the mean over every instance of it measured (a
layer unit is the same work in any layer), the embedding's and head's own. The communication a
unit ends with (TP all-reduce, expert all-to-all), its activation and weight-gradient bytes and its
workspace travel with it; the boundary P2P time and every global figure (host lane, calibration,
all-reduce slowdown) are the profile's.

What it answers: where the head's stage outweighs the others (a large vocabulary against one
layer per stage), which split of half layers balances the ranks, from one measured profile
instead of one profile per candidate split (``benchmarks/resplit_search.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from braid.core.braiding import ChunkSpec, Unit
from braid.core.ir import stage_of
from braid.core.partition import chunk_specs
from braid.cost.costs import ChunkCosts, CostModel, Layout, UnitCost, costs_from_dict, costs_to_dict

_FIELDS = ("f", "b", "w", "ar_f", "ar_b", "act", "w_res", "a2a_f", "a2a_b")


def unit_means(costs: CostModel) -> dict[Unit, UnitCost]:
    """Each unit's cost: the mean over every instance of it in ``costs`` (workspace: the largest)."""
    seen: dict[Unit, list[UnitCost]] = {}
    for cc in costs.chunks.values():
        for u in cc.instances():
            seen.setdefault(u, []).append(cc.units[u])
    return {u: UnitCost(**{k: sum(getattr(c, k) for c in cs) / len(cs) for k in _FIELDS}, tmp=max(c.tmp for c in cs))
            for u, cs in seen.items()}


def resplit_costs(costs: CostModel, specs: Mapping[tuple[int, int], ChunkSpec]) -> CostModel:
    """``costs`` with its chunks rebuilt for ``specs`` (same layout) from :func:`unit_means`;
    ``ValueError`` naming a unit the new split needs that ``costs`` never measured (an MoE layer
    of a dense profile, a vision tower)."""
    means = unit_means(costs)
    p2p = max((cc.p2p for cc in costs.chunks.values()), default=0.0)
    chunks = {}
    for rc, spec in specs.items():
        probe = ChunkCosts(spec, {})
        missing = sorted({u.value for u in probe.instances()} - {u.value for u in means})
        if missing:
            raise ValueError(f"the split needs unit {missing[0]!r}, which the profile has no instance of")
        chunks[rc] = ChunkCosts(spec, {u: means[u] for u in set(probe.instances())}, p2p)
    return replace(costs, chunks=chunks)


def resplit(doc: Mapping[str, Any], tp: int, pp: int, old: Sequence[float], new: Sequence[float],
            placement: str = "v", moe_layers: Sequence[int] = ()) -> dict[str, Any]:
    """The cost-file dict of ``doc`` (measured at ``old`` layers per virtual stage) for the split
    ``new`` of the same layers; ``meta.resplit_from`` records ``old``."""
    if sum(old) != sum(new):
        raise ValueError(f"the split {list(new)} has {sum(new):g} layers; the profile's {list(old)} has {sum(old):g}")
    if len(old) != len(new):
        raise ValueError(f"the split {list(new)} has {len(new)} virtual stages; the profile's has {len(old)}")
    lay = Layout(tp, pp, len(old) // pp, placement)
    base = costs_from_dict(doc, lay, chunk_specs(tuple(old), pp, placement, moe_layers=moe_layers), where="profile")
    out = costs_to_dict(resplit_costs(base, chunk_specs(tuple(new), pp, placement, moe_layers=moe_layers)))
    # keyed by virtual stage, as a profile is: the file then serves every placement's schedules
    out["chunks"] = {str(stage_of(placement, pp, *map(int, k.split(",")))): c for k, c in out["chunks"].items()}
    keep = {k: doc[k] for k in ("W_residual",) if k in doc}
    out["meta"] = {**dict(doc.get("meta") or {}), "resplit_from": list(old)}
    return {**out, **keep}
