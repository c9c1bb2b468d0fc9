"""Costs of a mixture-of-experts layer: the router, the routed experts and expert parallelism's all-to-alls.

An MoE layer's units (:data:`braid.core.braiding.MOE_LAYER_UNITS`, :mod:`braid.models.moe_ops`):
Pre-Attn and Attn are priced as a dense layer's (:func:`braid.cost.costs._layer_units`), the MLP
side as the runtime runs it:

* **Pre-MLP**: the norm and the router, a linear ``hidden -> E`` kept whole on every TP rank:
  ``2*T*h*E`` FLOPs in F, B and W each (not divided by t), top-k and the permutation; its
  forward ends with the **dispatch** all-to-all (``a2a_f``: the per-expert counts, ``E/t`` int64,
  then the rows), its backward with the dense layer's TP all-reduce.
* **Experts**: the grouped GEMMs (gate and up ``h -> 2f``, down ``f -> h``: ``6*rows*h*f`` FLOPs
  in F, B and W each); its forward ends with the **combine** all-to-all (``a2a_f``), its
  backward with the dispatch's backward (``a2a_b``). Under TP the runtime gives every TP rank
  ``E/t`` whole experts (:class:`braid.models.moe_dispatch.ExpertSlice`: all TP ranks hold the
  same tokens, each runs the rows routed to its experts; the all-reduce sums the parts), so a
  rank runs on average ``T*k/t`` rows -- the same FLOPs as a ``1/t`` slice of every expert.
  ``imbalance`` (>= 1) is the busiest rank's rows over that mean: ``rows = T*k/t * imbalance``
  wherever the experts are spread over more than one rank (``ep * t > 1``; on one rank every
  token's k rows run there whatever the routing, so it is 1).
* **MLP** (the combine): un-permutation, weighted sum and residual (no FLOPs counted), the dense
  layer's forward TP all-reduce; its backward ends with the combine's backward (``a2a_b``).
* **Expert parallelism** (``ep`` ranks of one expert-parallel group,
  :mod:`braid.runtime.expert_parallel`): each row all-to-all moves ``rows * h * dtype`` bytes on
  the busiest rank, priced on the group's link (:func:`braid.cost.hardware.ring_s`: ``(ep-1)/ep``
  of the bytes at the link's rate, plus latency). The all-to-alls are :class:`braid.cost.costs.UnitCost`'s
  ``a2a_f``/``a2a_b`` -- not part of ``f``/``b``: the simulator runs them on the rank's all-to-all
  lane, beside the other member's units in a braided block (:mod:`braid.core.braiding`).
  **Padded** exchanges (``MoeLayout.padded``, ``--moe-dispatch padded``,
  :class:`braid.runtime.expert_parallel.PaddedAllToAllDispatch`) move ``ep`` blocks of
  ``T * min(k, E/ep)`` rows whatever the routing (:func:`exchanged_rows`); the experts' GEMMs
  still run only the routed rows, but their saved inputs and intermediates are the padded buffers.

Saved bytes, ``activations="runtime"`` (counted from the saved-tensor boxes of a CPU chunk,
``c`` = the fp32 compute size, 4 or the dtype's): Pre-MLP the dense Pre-MLP's (norm, the
router's input) plus the router's probabilities ``T * c * (E + 1)`` and the top-k indices,
weights and gather indices ``T*k * (16 + c)``; Experts the experts' inputs and SwiGLU
intermediates ``rows * (h + 4f) * d``, the local counts and, with ``ep > 1``, the regrouping's
two int64 orders of the received rows; MLP the combined rows and the weighting's copy
``2 * T*k * h * d`` (every TP rank holds all ``T*k`` rows, zero where another rank's experts ran)
and ``T*k * (16 + d)`` of indices and weights. Korthikanti's formula (the paper's yardstick)
keeps its shape with the routed width in place of the 4h MLP: Experts ``2 * rows * f * d``, MLP
``s*b*h * 1``. W residual (a split B's stash until W): Pre-MLP the router's input and output
gradient ``T * (h + E) * d``; Experts both expert GEMMs' inputs and output gradients
``rows * (2h + 3f) * d``; MLP none (no weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping

from braid.core.braiding import Unit
from braid.cost.catalog import ModelConfig
from braid.cost.hardware import Hardware, ring_s

INDEX_BYTES = 8  # int64 routing indices and counts


@dataclass(frozen=True, slots=True, kw_only=True)
class MoeLayout:
    """Expert parallelism of an MoE model as one layer's costs need it: ``ep`` ranks share the experts;
    ``imbalance``: the busiest rank's routed rows over the mean; the expert-parallel group's link
    (:meth:`braid.cost.cluster.Cluster.moe_layout` picks it: NVLink inside a node, the NIC across);
    ``padded``: the row exchanges move fixed blocks (:func:`exchanged_rows`)."""

    ep: int = 1
    imbalance: float = 1.0
    a2a_bytes_per_s: float = 1.0
    a2a_latency_s: float = 0.0
    padded: bool = False  # the row exchanges in fixed blocks (module doc), as --moe-dispatch padded runs them

    def __post_init__(self) -> None:
        if not (isinstance(self.ep, int) and self.ep >= 1):
            raise ValueError(f"--ep must be a positive integer, got {self.ep!r}")
        if not (math.isfinite(self.imbalance) and self.imbalance >= 1.0):
            raise ValueError(f"--moe-imbalance must be a number >= 1 (the busiest rank's routed tokens over the mean), "
                             f"got {self.imbalance}")
        if not self.a2a_bytes_per_s > 0:
            raise ValueError(f"the all-to-all link rate must be positive, got {self.a2a_bytes_per_s}")


def check_moe(model: ModelConfig, tp: int, ep: int) -> None:
    """``ValueError`` (one line) unless ``ep`` (and ``tp``) fit the model's experts, as the runtime requires."""
    if ep > 1 and not model.experts:
        raise ValueError(f"--ep {ep} shards the experts of a mixture-of-experts model; {model.name!r} is dense")
    if model.experts and model.experts % (ep * tp):
        what = f"--ep {ep} x --tp {tp} ({ep * tp})" if ep > 1 and tp > 1 else f"--ep {ep}" if ep > 1 else f"--tp {tp}"
        raise ValueError(f"{what} must divide the {model.experts} experts per layer of {model.name!r} "
                         "(TP ranks hold whole experts, expert-parallel ranks a share of those)")


def routed_rows(model: ModelConfig, tokens: int, t: int, moe: MoeLayout) -> float:
    """Rows (token x top-k slots) the busiest rank's experts run for ``tokens`` tokens."""
    return tokens * model.experts_per_token / t * applied_imbalance(moe, t)


def exchanged_rows(model: ModelConfig, tokens: int, t: int, moe: MoeLayout) -> float:
    """Rows one row all-to-all of the busiest rank moves (its own block included): the routed rows, or
    padded ``ep`` blocks of ``tokens * min(k, E/ep)`` rows (the most one peer can get; tp=1)."""
    if moe.padded and moe.ep > 1:
        return moe.ep * tokens * min(model.experts_per_token, model.experts // moe.ep)
    return routed_rows(model, tokens, t, moe)


def applied_imbalance(moe: MoeLayout, t: int) -> float:
    """The imbalance the analytic model prices at TP ``t``: ``moe.imbalance`` where the experts are sharded
    (``ep * t > 1``), else 1 (one device holds them all)."""
    return moe.imbalance if moe.ep * t > 1 else 1.0


def a2a_seconds(model: ModelConfig, tokens: int, t: int, d: int, moe: MoeLayout) -> tuple[float, float]:
    """(counts, rows) all-to-all seconds of one MoE layer on the busiest expert-parallel rank: the
    per-expert counts' exchange and one exchange of the routed rows (the dispatch, the combine and
    their backwards each move that many)."""
    if moe.ep == 1:
        return 0.0, 0.0
    link = (moe.a2a_bytes_per_s, moe.a2a_latency_s)
    rows = ring_s(exchanged_rows(model, tokens, t, moe) * model.hidden * d, moe.ep, *link)
    counts = ring_s(INDEX_BYTES * model.experts // t, moe.ep, *link)
    return counts, rows


def moe_units(units: Mapping[Unit, Any], model: ModelConfig, tokens: int, t: int, d: int, hw: Hardware, moe: MoeLayout,
              activations: Literal["korthikanti", "runtime"] = "korthikanti") -> dict[Unit, Any]:
    """A dense layer's :class:`braid.cost.costs.UnitCost` s with Pre-MLP and MLP replaced by an MoE layer's
    and its Experts unit added (module doc); the all-reduces stay the dense layer's."""
    h, f, e, k = model.hidden, model.moe_ffn, model.experts, model.experts_per_token
    rows = routed_rows(model, tokens, t, moe)
    router = 2 * tokens * h * e / hw.matmul_flops
    experts = 2 * rows * h * 3 * f / hw.matmul_flops
    held = exchanged_rows(model, tokens, t, moe) if moe.padded else rows  # rows of the experts' buffers
    counts_s, rows_s = a2a_seconds(model, tokens, t, d, moe)
    pre, mlp = units[Unit.PRE_MLP], units[Unit.MLP]
    if activations == "runtime":
        c = max(d, 4)
        pre_act = pre.act + tokens * c * (e + 1) + tokens * k * (2 * INDEX_BYTES + c)
        experts_act = (held * (h + 4 * f) * d + INDEX_BYTES * e // (t * moe.ep)
                       + (2 * INDEX_BYTES * held if moe.ep > 1 else 0.0))
        mlp_act = tokens * k * (2 * h * d + 2 * INDEX_BYTES + d)
    else:
        pre_act, experts_act, mlp_act = pre.act, 2 * held * f * d, tokens * h * d / 2
    return {**units,
            Unit.PRE_MLP: replace(pre, f=router, b=router, w=router, act=pre_act, w_res=tokens * (h + e) * d,
                                  a2a_f=counts_s + rows_s),
            Unit.EXPERTS: replace(mlp, f=experts, b=experts, w=experts, ar_f=0.0, ar_b=0.0, act=experts_act,
                                  w_res=held * (2 * h + 3 * f) * d, a2a_f=rows_s, a2a_b=rows_s),
            Unit.MLP: replace(mlp, f=0.0, b=0.0, w=0.0, act=mlp_act, w_res=0.0, a2a_b=rows_s)}


def mlp_width(model: ModelConfig, t: int, moe: MoeLayout | None) -> float:
    """The MLP's intermediate width per token on the busiest rank, times ``t``: ``ffn`` for a dense model,
    ``k * moe_ffn * imbalance`` for an MoE one (what selective recomputation re-runs)."""
    if not model.experts:
        return model.ffn
    return routed_rows(model, 1, t, moe or MoeLayout()) * t * model.moe_ffn


def a2a_per_rank(costs: Any, m: int) -> list[float]:
    """All-to-all seconds of one step of ``m`` micro-batches on every pipeline rank of ``costs`` (a
    :class:`braid.cost.costs.CostModel`): each MoE unit instance's ``a2a_f + a2a_b``, once per micro-batch."""
    lay = costs.layout
    return [m * sum(cc.total("a2a_f") + cc.total("a2a_b") for cc in (costs.chunks[(r, c)] for c in range(lay.v)))
            for r in range(lay.p)]


def rescale_imbalance(costs: Any, imbalance: float) -> tuple[Any, float]:
    """A measured cost model (a :class:`braid.cost.costs.CostModel` read from a profile) at another load
    imbalance: the busiest expert-parallel rank's expert compute (F, B, W of every MoE chunk's Experts unit)
    and every all-to-all scaled by ``imbalance`` over the profile's own (``meta.moe.imbalance``, what
    ``braid.profile --ep`` measured; 1 where the file records none), as :func:`routed_rows` scales the
    analytic model's. Returns (the costs, the profile's imbalance)."""
    from dataclasses import replace as _replace

    profiled = float(((costs.meta or {}).get("moe") or {}).get("imbalance") or 1.0)
    k = imbalance / profiled
    if k == 1.0:
        return costs, profiled
    chunks = {}
    for key, cc in costs.chunks.items():
        if not cc.spec.moe:
            chunks[key] = cc
            continue
        units = {u: _replace(c, a2a_f=c.a2a_f * k, a2a_b=c.a2a_b * k) for u, c in cc.units.items()}
        if Unit.EXPERTS in units:
            e = units[Unit.EXPERTS]
            units[Unit.EXPERTS] = _replace(e, f=e.f * k, b=e.b * k, w=e.w * k)
        chunks[key] = _replace(cc, units=units)
    return _replace(costs, chunks=chunks, meta={**(costs.meta or {}), "moe_imbalance": imbalance}), profiled


def priced_imbalance(costs: Any) -> float | None:
    """The busiest expert-parallel rank's rows over the mean that ``costs`` price (``moe_imbalance`` of the
    analytic model or of :func:`rescale_imbalance`, else a profile's own ``meta.moe.imbalance``); None for a
    dense model or MoE costs that record none."""
    if not any(cc.spec.moe for cc in costs.chunks.values()):
        return None
    meta = costs.meta or {}
    got = meta.get("moe_imbalance", (meta.get("moe") or {}).get("imbalance"))
    return float(got) if isinstance(got, (int, float)) and not isinstance(got, bool) else None
