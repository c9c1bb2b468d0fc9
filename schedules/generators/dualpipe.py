"""DeepSeek's DualPipeV (the "cut-in-half" DualPipe of DeepSeek-V3, V placement, v=2).

Rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1). DualPipeV overlaps the forward
of one chunk with the backward of the *other* chunk (different micro-batches, different
chunks) to hide expert-parallel communication. braid emits each overlapped pair as a
cross-chunk braided block (``F7c0&BW2c1``), so the units interleave and the TP all-reduces
of one member hide behind the other's compute -- the pairs torch's ``ScheduleDualPipeV``
marks ``OVERLAP_F_B``, forward first as DualPipe's notation "F0B1F1B0" names them. The
phases and their closed-form counts follow DualPipe's ``step()``; like DualPipe we require
m >= 2p.
"""

from __future__ import annotations

from braid.core.ir import Plan, ScheduleConfig
from braid.schedules.generators._common import RankBuilder, braids, check_chunks, make_plan
from braid.schedules.generators.braided import BRAID_KNOB
from braid.schedules.registry import register


@register("dualpipe_v", v=2, placement="v", description="DeepSeek DualPipeV: V placement, overlapped F/B pairs as cross-chunk braided blocks",
          knobs=(BRAID_KNOB,), min_m=2)
def dualpipe_v(cfg: ScheduleConfig) -> Plan:
    """DualPipeV for m >= 2p."""
    check_chunks("dualpipe_v", cfg, 2)
    p, m = cfg.p, cfg.m
    if m < 2 * p:
        raise ValueError(f"dualpipe_v needs m >= 2p (got p={p}, m={m})")
    braided = braids("dualpipe_v", cfg)
    return make_plan("dualpipe_v", cfg, "v", [_rank_ops(p, m, r, braided) for r in range(p)])


def _rank_ops(p: int, m: int, r: int, braided: bool = True) -> list:
    rb = RankBuilder(m, 2, braided)
    # Step 1: nF0.
    for _ in range((p - r - 1) * 2):
        rb.f(0)
    # Step 2: nF0F1.
    for _ in range(r + 1):
        rb.f(0)
        rb.f(1)
    # Step 3: nB1W1F1 -- split backward so the gradient leaves early; W fills the wait.
    for _ in range(p - r - 1):
        rb.b(1, split=True)
        if rb.pending_w:
            rb.w()
        rb.f(1)
    # Step 4 (main): n(F0&B1, F1&B0), each overlapped pair one cross-chunk braided block. Like
    # torch, the last rank runs its first F0, B1 pair unbraided (F0's output feeds its own F1
    # right after, so it should not wait for B1's units).
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:
            rb.f(0)
            rb.b(1)
        else:
            rb.braid(rb.next_f(0), rb.next_b(1, split=False))
        rb.braid(rb.next_f(1), rb.next_b(0, split=False))
    # Step 5: n(B1, F1&B0).
    for _ in range(p - r - 1):
        rb.b(1)
        rb.braid(rb.next_f(1), rb.next_b(0, split=False))
    # Step 6: nB1B0, weight-gradient split switched on half-way (rank parity decides
    # whether before B1 or before B0).
    split = False
    half = (r + 1) // 2
    for i in range(r + 1):
        if i == half and r % 2 == 1:
            split = True
        rb.b(1, split=split)
        if i == half and r % 2 == 0:
            split = True
        rb.b(0, split=split)
    # Step 7: nWB0.
    for _ in range(p - r - 1):
        if rb.pending_w:
            rb.w()
        rb.b(0, split=split)
    # Step 8: nW.
    while rb.pending_w:
        rb.w()
    return rb.ops
