"""Costs of a mixture-of-experts layer: the router, the routed experts and expert parallelism's all-to-alls.

An MoE layer has the dense layer's four units (:mod:`braid.models.qwen3_moe`); Pre-Attn and Attn
are priced as a dense layer's (:func:`braid.cost.costs._layer_units`), the MLP side as the
runtime runs it:

* **Pre-MLP**: the norm and the router, a linear ``hidden -> E`` kept whole on every TP rank:
  ``2*T*h*E`` FLOPs in F, B and W each (not divided by t); it ends its backward with the
  dense layer's TP all-reduce.
* **MLP**: routing, the experts' grouped GEMMs (gate and up ``h -> 2f``, down ``f -> h``:
  ``6*rows*h*f`` FLOPs in F, B and W each), the combine, and the TP all-reduce of its
  forward. Under TP the runtime gives every TP rank ``E/t`` whole experts
  (:class:`braid.models.moe.ExpertSlice`: all TP ranks hold the same tokens, each runs the rows
  routed to its experts; the all-reduce sums the parts), so a rank runs on average
  ``T*k/t`` rows -- the same FLOPs as a ``1/t`` slice of every expert. ``imbalance`` (>= 1)
  is the busiest rank's rows over that mean: ``rows = T*k/t * imbalance`` wherever the
  experts are spread over more than one rank (``ep * t > 1``; on one rank every token's k
  rows run there whatever the routing, so it is 1).
* **Expert parallelism** (``ep`` ranks of one expert-parallel group,
  :mod:`braid.runtime.expert_parallel`): the rows of the rank's TP slice go to the ranks holding
  their experts and back, each an ``all_to_all_single`` of ``rows * h * dtype`` bytes on the
  busiest rank, priced on the group's link (:func:`braid.cost.hardware.ring_s`: ``(ep-1)/ep``
  of the bytes at the link's rate, plus latency). Forward: the per-expert row counts
  (``E/t`` int64, one small all-to-all), dispatch and combine; backward: dispatch and combine
  again with the splits swapped. The runtime runs them blocking inside the MLP unit, so they
  are folded into its ``f`` and ``b``, and recorded as :class:`braid.cost.costs.UnitCost`'s
  ``a2a_f``/``a2a_b`` (the share of ``f``/``b`` that is all-to-all).

Saved bytes of the MLP unit, ``activations="runtime"`` (counted from the saved-tensor boxes of a
CPU chunk, ``c`` = the fp32 compute size, 4 or the dtype's): the experts' inputs and SwiGLU
intermediates ``rows * (h + 4f) * d``; the combined rows and the weighting's copy
``2 * T*k * h * d`` (every TP rank holds all ``T*k`` rows, zero where another rank's experts ran);
indices and routing weights ``T*k * (32 + c + d)``; the router's probabilities ``T * c * (E + 1)``;
the local counts; with ``ep > 1`` the regrouping's two int64 orders of the received rows.
Korthikanti's formula (the paper's yardstick) keeps its shape with the routed width in place of
the 4h MLP: ``s*b*h * 1 + 2 * rows * f * d``. W residual (a split B's stash until W): Pre-MLP the
router's input and output gradient ``T * (h + E) * d``; MLP both expert GEMMs' inputs and
output gradients ``rows * (2h + 3f) * d``.
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
    (:meth:`braid.cost.cluster.Cluster.moe_layout` picks it: NVLink inside a node, the NIC across)."""

    ep: int = 1
    imbalance: float = 1.0
    a2a_bytes_per_s: float = 1.0
    a2a_latency_s: float = 0.0

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
    imbalance = moe.imbalance if moe.ep * t > 1 else 1.0
    return tokens * model.experts_per_token / t * imbalance


def a2a_seconds(model: ModelConfig, tokens: int, t: int, d: int, moe: MoeLayout) -> tuple[float, float]:
    """(forward, backward) all-to-all seconds of one MoE layer on the busiest expert-parallel rank."""
    if moe.ep == 1:
        return 0.0, 0.0
    link = (moe.a2a_bytes_per_s, moe.a2a_latency_s)
    rows = ring_s(routed_rows(model, tokens, t, moe) * model.hidden * d, moe.ep, *link)
    counts = ring_s(INDEX_BYTES * model.experts // t, moe.ep, *link)
    return counts + 2 * rows, 2 * rows


def moe_units(units: Mapping[Unit, Any], model: ModelConfig, tokens: int, t: int, d: int, hw: Hardware, moe: MoeLayout,
              activations: Literal["korthikanti", "runtime"] = "korthikanti") -> dict[Unit, Any]:
    """A dense layer's :class:`braid.cost.costs.UnitCost` s with Pre-MLP and MLP replaced by an MoE layer's
    (module doc); the all-reduces stay the dense layer's."""
    h, f, e, k = model.hidden, model.moe_ffn, model.experts, model.experts_per_token
    rows = routed_rows(model, tokens, t, moe)
    router = 2 * tokens * h * e / hw.matmul_flops
    experts = 2 * rows * h * 3 * f / hw.matmul_flops
    a2a_f, a2a_b = a2a_seconds(model, tokens, t, d, moe)
    if activations == "runtime":
        c = max(d, 4)
        act = (rows * (h + 4 * f) * d + tokens * k * (2 * h * d + 4 * INDEX_BYTES + c + d) + tokens * c * (e + 1)
               + INDEX_BYTES * e // (t * moe.ep) + (2 * INDEX_BYTES * rows if moe.ep > 1 else 0.0))
    else:
        act = tokens * h * d / 2 + 2 * rows * f * d
    pre, mlp = units[Unit.PRE_MLP], units[Unit.MLP]
    return {**units,
            Unit.PRE_MLP: replace(pre, f=router, b=router, w=router, w_res=tokens * (h + e) * d),
            Unit.MLP: replace(mlp, f=experts + a2a_f, b=experts + a2a_b, w=experts, act=act,
                              w_res=rows * (2 * h + 3 * f) * d, a2a_f=a2a_f, a2a_b=a2a_b)}


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
