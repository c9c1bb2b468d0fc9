"""The cost transform of full recomputation (:mod:`braid.models.full_recompute`), shared by the
analytic cost model (:func:`braid.cost.costs.analytic_costs`), the simulator and the planner.

Selective recomputation's transform is :func:`braid.cost.costs.selective_recompute`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from braid.core.braiding import Unit

LAYER = (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP)


def full_recompute(units: Mapping[Unit, Any], layer_input_bytes: float) -> dict[Unit, Any]:
    """LM layer units (:class:`braid.cost.costs.UnitCost`) under full recomputation: the forward keeps
    only the layer input; the layer's first backward unit (MLP) first re-runs the whole layer,
    the Attn unit's forward all-reduce included (blocking: the MLP half needs its result).

    MLP: ``b`` grows by the four units' forward and Attn's ``ar_f``; while it runs, the
    re-run's activations (the layer's saved bytes less the input) are live on top of its own
    (``tmp``, workspace: the simulator counts it while the unit runs). They are freed unit by
    unit as the layer's backward proceeds, so the MLP's backward is the layer's most. Pre-Attn
    keeps ``layer_input_bytes``, the other units nothing.
    """
    rerun_s = sum(units[u].f for u in LAYER) + units[Unit.ATTN].ar_f
    rerun_bytes = max(0.0, sum(units[u].act for u in LAYER) - layer_input_bytes)
    out = {u: replace(units[u], act=layer_input_bytes if u is Unit.PRE_ATTN else 0.0) for u in LAYER}
    mlp = out[Unit.MLP]
    out[Unit.MLP] = replace(mlp, b=mlp.b + rerun_s, tmp=max(mlp.tmp, rerun_bytes))
    return {**units, **out}
