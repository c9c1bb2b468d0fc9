"""Single-chunk baselines: GPipe and 1F1B (one model chunk per rank, v=1).

GPipe (Huang et al., 2019) runs every forward, then every backward. 1F1B (PipeDream-flush,
Narayanan et al., 2021) bounds the in-flight micro-batches on rank r to p-r: a warm-up of
forwards, a steady phase alternating one forward and one full backward, and a cool-down of
backwards. Both use the full backward ``BW`` (no weight-gradient split). They are the
reference points of the paper's evaluation (Sec. 5) and work for any p >= 1, m >= 1.
"""

from __future__ import annotations

from braid.core.ir import Plan, ScheduleConfig
from braid.schedules.generators._common import RankBuilder, check_chunks, make_plan
from braid.schedules.registry import register


@register("gpipe", v=1, placement="loop", description="GPipe: all forwards, then all full backwards",
          steady_m=0)
def gpipe(cfg: ScheduleConfig) -> Plan:
    """All m forwards, then all m full backwards, on every rank (peak m activations)."""
    check_chunks("gpipe", cfg, 1)
    ranks = []
    for _ in range(cfg.p):
        rb = RankBuilder(cfg.m, 1)
        for _ in range(cfg.m):
            rb.f(0)
        for _ in range(cfg.m):
            rb.b(0)
        ranks.append(rb.ops)
    return make_plan("gpipe", cfg, "loop", ranks)


@register("1f1b", v=1, placement="loop", description="1F1B (PipeDream-flush): warm-up, one F one BW, cool-down")
def one_f_one_b(cfg: ScheduleConfig) -> Plan:
    """1F1B: rank r keeps at most p-r micro-batches in flight."""
    check_chunks("1f1b", cfg, 1)
    p, m = cfg.p, cfg.m
    ranks = []
    for r in range(p):
        rb = RankBuilder(m, 1)
        # Warm-up: nF -- enough forwards to reach the last stage before the first backward.
        warmup = min(p - r - 1, m)
        for _ in range(warmup):
            rb.f(0)
        # Steady: nFB -- one forward, then the backward of the oldest in-flight micro-batch.
        for _ in range(m - warmup):
            rb.f(0)
            rb.b(0)
        # Cool-down: nB.
        for _ in range(warmup):
            rb.b(0)
        ranks.append(rb.ops)
    return make_plan("1f1b", cfg, "loop", ranks)
