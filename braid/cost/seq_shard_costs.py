"""The cost transform of sequence parallelism inside TP (:mod:`braid.tp.seq_shard`), used by the
analytic cost model (:func:`braid.cost.costs.analytic_costs`), and through it by the simulator and
the planner: reduce-scatters and all-gathers instead of all-reduces, and Korthikanti et al.'s
``34/t`` activation bytes per layer instead of ``10 + 24/t``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from braid.core.braiding import GATHER_HEAD_B, GATHER_HEAD_F, Unit
from braid.cost.hardware import Hardware


def _half_ring_time(nbytes: float, t: int, hw: Hardware) -> float:
    """A ring reduce-scatter or all-gather of ``nbytes`` (the whole tensor): half an all-reduce's traffic."""
    if t == 1:
        return 0.0
    return hw.ar_latency_s + (t - 1) / t * nbytes / hw.ar_bus_bytes_per_s


# Korthikanti's per-layer activation bytes per s*b*h (bf16), per unit: (kept whole on every TP rank,
# split over TP). Under sequence parallelism both parts are split: 34/t in all.
KORTHIKANTI_ACT: dict[Unit, tuple[float, float]] = {
    Unit.PRE_ATTN: (4, 0), Unit.ATTN: (1, 8), Unit.PRE_MLP: (4, 0), Unit.MLP: (1, 16),
}


def seq_shard_units(lm: Mapping[Unit, Any], head: Any, embed: Any, tokens: int, h: int, t: int, d: int,
                    hw: Hardware, runtime: bool) -> tuple[dict[Unit, Any], Any, Any]:
    """LM layer, head and embedding units (:class:`braid.cost.costs.UnitCost`) under sequence
    parallelism inside TP (:mod:`braid.tp.seq_shard`).

    Comm: each unit that ended with an all-reduce ends with a reduce-scatter, then the next
    unit's head (a norm, or a norm backward, on ``s/t`` tokens: not charged) and its
    all-gather (:mod:`braid.runtime.follow`); the next unit waits for the gather, so the
    unit's ``ar_f``/``ar_b`` is the two in a row: an all-reduce's traffic and two latencies.
    A unit with a gathering head (:data:`braid.core.braiding.GATHER_HEAD_F`, ``_B``) that is
    its op's first (its input came from another chunk) gathers alone: ``ag_f``/``ag_b``, one
    all-gather (the simulator starts it as :func:`braid.core.braiding.early_heads` says).
    Not charged: the one reduce-scatter a chunk's last unit has no gather after (it is part of
    its ``ar_f``) and the re-gather of the column-parallel linears' saved input in their W,
    which runs beside the row-parallel unit's W before it. A dense layer's split B stashes the rank's tokens of
    each whole-sequence tensor its W reads (``w_res``: the column-parallel linears' input, the row-parallel ones'
    output gradient; :mod:`braid.models.seq_shard_ops`; a full backward keeps the gradient whole, but frees its
    stash at once). Saved bytes: both parts of Korthikanti's
    per-unit coefficients over ``t`` (34/t per layer), or with ``runtime`` the norms' and the
    gathered linear inputs' bytes over ``t`` (:func:`braid.cost.runtime_act.runtime_act`); the
    head's norm and its input -- kept as the rank's tokens and gathered again in its W, as a column-parallel
    linear's (:mod:`braid.models.seq_shard_ops`) -- over ``t``, its logits unchanged; a split B's stash of that
    input is the rank's tokens too (``w_res``).
    """
    nbytes = tokens * h * d
    gather = _half_ring_time(nbytes, t, hw)
    chain = 2 * gather  # reduce-scatter, then the next unit's all-gather
    sbh = nbytes / 2
    dense = Unit.EXPERTS not in lm
    out = {}
    for u, c in lm.items():
        if u is Unit.EXPERTS:  # an MoE layer's experts: no TP collective, every routed row (not sequence-sharded)
            out[u] = c
            continue
        c = replace(c, ar_b=chain) if u in (Unit.PRE_ATTN, Unit.PRE_MLP) else replace(c, ar_f=chain)
        if dense:  # a split B's whole-sequence stash -- a pre unit's input, an attn/mlp unit's output gradient -- is the rank's tokens
            c = replace(c, w_res=c.w_res - nbytes + nbytes / t)
        c = replace(c, ag_f=gather if u in GATHER_HEAD_F else 0.0, ag_b=gather if u in GATHER_HEAD_B else 0.0)
        if runtime:
            whole = tokens * (4 * h + d * h + 4) + tokens * d * h if u in (Unit.PRE_ATTN, Unit.PRE_MLP) else 0.0
            c = replace(c, act=c.act - whole + whole / t)
        else:
            c = replace(c, act=sbh * sum(KORTHIKANTI_ACT[u]) / t)
        out[u] = c
    whole = tokens * (4 * h + d * h + 4) + nbytes if runtime else 4 * sbh  # the norm's saved bytes and the head's input
    head = replace(head, ar_b=chain, act=head.act - whole + whole / t, w_res=head.w_res - nbytes + nbytes / t, ag_f=gather)
    embed = replace(embed, ar_f=chain, ag_b=gather)
    return out, head, embed
