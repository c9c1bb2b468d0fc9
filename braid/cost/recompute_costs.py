"""The cost transforms of recomputation, shared by the analytic cost model
(:func:`braid.cost.costs.analytic_costs`), the simulator and the planner: full
(:mod:`braid.models.full_recompute`) and selective (:mod:`braid.models.recompute`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from braid.core.braiding import MOE_LAYER_UNITS, Unit


def full_recompute(units: Mapping[Unit, Any], layer_input_bytes: float) -> dict[Unit, Any]:
    """LM layer units (:class:`braid.cost.costs.UnitCost`) under full recomputation: the forward keeps
    only the layer input; the layer's first backward unit (MLP) first re-runs the whole layer,
    the Attn unit's forward all-reduce included (blocking: the MLP half needs its result).

    MLP: ``b`` grows by the layer units' forward and Attn's ``ar_f`` (an MoE layer's all-to-alls
    among them, blocking inside the re-run: ``b`` grows by the layer's ``a2a_f`` too; the runtime
    does not re-run MoE layers yet, :meth:`braid.models.chunk.ModelChunk.set_recompute`); while it runs, the
    re-run's activations (the layer's saved bytes less the input) are live on top of its own
    (``tmp``, workspace: the simulator counts it while the unit runs). They are freed unit by
    unit as the layer's backward proceeds, so the MLP's backward is the layer's most. Pre-Attn
    keeps ``layer_input_bytes``, the other units nothing.
    """
    layer = [u for u in MOE_LAYER_UNITS if u in units]
    rerun_s = sum(units[u].f + units[u].a2a_f for u in layer) + units[Unit.ATTN].ar_f
    rerun_bytes = max(0.0, sum(units[u].act for u in layer) - layer_input_bytes)
    out = {u: replace(units[u], act=layer_input_bytes if u is Unit.PRE_ATTN else 0.0) for u in layer}
    mlp = out[Unit.MLP]
    out[Unit.MLP] = replace(mlp, b=mlp.b + rerun_s, tmp=max(mlp.tmp, rerun_bytes))
    return {**units, **out}


def selective_recompute(units: Mapping[Unit, Any], tokens: int, seq: int, h: int, heads: int, ffn: int, t: int, d: int,
                        hw: Any, activations: str = "runtime") -> dict[Unit, Any]:
    """LM layer units under selective recomputation (:mod:`braid.models.recompute`): the attention
    core runs its forward again inside the backward, and keeps only its inputs.

    Attn: ``b`` grows by the core's forward time; its saved bytes lose the flash-attention
    log-sum-exp (fp32 per head and token) -- q, k, v and the output are kept either way (the
    output is the out-projection's input). The MLP keeps what it keeps without recomputation:
    braid's runtime never keeps the SwiGLU product (:mod:`braid.tp.swiglu_down`), and an MoE
    layer's experts recompute nothing.

    With ``activations="korthikanti"`` the saved bytes follow that formula's terms instead:
    it already assumes flash attention (no softmax term), so Attn keeps its bytes, and the
    MLP (an MoE layer's Experts) loses a quarter of its ffn-wide term (one of SwiGLU's four
    ffn-wide tensors), its ``b`` growing by the element-wise ``silu(gate) * up`` (a few FLOPs
    per element, at matmul speed here: a small term).
    """
    f_core = 4 * tokens * seq * (h // heads) * heads / t * 0.5  # causal
    swiglu = Unit.EXPERTS if Unit.EXPERTS in units else Unit.MLP  # the unit that runs the SwiGLU product
    attn, mlp = units[Unit.ATTN], units[swiglu]
    if activations == "runtime":
        attn_saved, mlp_saved = tokens * 4 * heads / t, 0.0
    else:
        attn_saved, mlp_saved = 0.0, tokens * h * d / 2 * 16 / t / 4
    out = dict(units)
    out[Unit.ATTN] = replace(attn, b=attn.b + f_core / hw.attn_flops, act=max(0.0, attn.act - attn_saved))
    if mlp_saved:
        out[swiglu] = replace(mlp, b=mlp.b + 5 * tokens * ffn / t / hw.matmul_flops, act=max(0.0, mlp.act - mlp_saved))
    return out
