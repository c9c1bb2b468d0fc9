"""Megatron-LM's interleaved 1F1B (1F1B-I; Narayanan et al., SC'21, Sec. 2.2).

Each rank holds v model chunks in a loop placement (rank r holds virtual stages
r, r+p, r+2p, ...). Micro-batches advance in groups of p: the k-th forward of a rank runs
chunk ``(k // p) % v`` on micro-batch ``(k // (p*v)) * p + k % p``; backwards walk the
chunks in reverse. Warm-up on rank r runs ``(p - r - 1) * 2 + (v - 1) * p`` forwards
(all of them when m == p), then one forward and one full backward alternate, then the
remaining backwards drain. This is the baseline of the paper's Table 1 ("1F1B-I", peak
activation (3p-2)*M_a on device 0 for v=2, counted before the steady phase's forward).

Megatron's constraint: the micro-batch count must be a multiple of p, so that every group
of p micro-batches fills all chunks; other m raise ``ValueError``.
"""

from __future__ import annotations

from braid.core.ir import Compute, OpKind, Plan, ScheduleConfig
from braid.schedules.generators._common import make_plan
from braid.schedules.registry import register


def _virtual(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of the k-th forward (or backward) of a rank."""
    chunk = (k // p) % v
    if backward:
        chunk = v - 1 - chunk
    return (k // (p * v)) * p + k % p, chunk


@register("1f1b_i", v=2, placement="loop", description="Megatron interleaved 1F1B (v chunks per rank, loop placement)",
          m_step="p")
def interleaved_1f1b(cfg: ScheduleConfig) -> Plan:
    """Interleaved 1F1B with ``cfg.v`` chunks per rank; needs m % p == 0."""
    p, m, v = cfg.p, cfg.m, cfg.v
    if v < 2:
        raise ValueError(f"1f1b_i interleaves v >= 2 chunks per rank (got v={v}); use 1f1b for one chunk")
    if m % p != 0:
        raise ValueError(f"1f1b_i needs m to be a multiple of p (Megatron's interleaving constraint; got p={p}, m={m})")
    total = m * v
    ranks = []
    for r in range(p):
        # Warm-up: Megatron's count; with m == p every forward is a warm-up forward.
        warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
        ops: list[Compute] = []
        for k in range(warmup):
            mb, c = _virtual(k, p, v, backward=False)
            ops.append(Compute(OpKind.F, mb, c))
        # Steady: one forward, then one full backward.
        for k in range(total - warmup):
            mb, c = _virtual(warmup + k, p, v, backward=False)
            ops.append(Compute(OpKind.F, mb, c))
            mb, c = _virtual(k, p, v, backward=True)
            ops.append(Compute(OpKind.BW, mb, c))
        # Cool-down: the remaining backwards.
        for k in range(total - warmup, total):
            mb, c = _virtual(k, p, v, backward=True)
            ops.append(Compute(OpKind.BW, mb, c))
        ranks.append(ops)
    return make_plan("1f1b_i", cfg, "loop", ranks)
