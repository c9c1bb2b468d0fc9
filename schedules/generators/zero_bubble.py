"""Zero-bubble schedules with the weight gradient split off (Qi et al., ICLR'24; NeurIPS'24).

The backward is split into ``B`` (activation gradient, on the critical path) and ``W``
(weight gradient, deferred to fill bubbles).

* ``zb_h1`` (ZB-H1, "ZB1P", one chunk per rank): 1F1B's warm-up and steady order with
  B/W split; rank r holds back r weight gradients (the last stage the most) and runs them
  at the end, so the activation gradients travel upstream one B (not one B+W) per hop. Peak activation equals 1F1B's (W does not free activations in the
  counting convention; its small residual is accounted in bytes by the simulator).
* ``zb_v`` (ZB-V, two chunks per rank, V placement: rank r holds stages r and 2p-1-r).
  Rank r runs 2(p-r)-1 forwards of chunk 0; r pairs F1 F0; p-r triplets F1 B1 W1 (each
  chunk-1 backward starts as soon as its forward has come back up the V); the steady
  phase F0 B0 W0 F1 B1 W1 (no F0 once chunk 0 has run out) until every forward has run;
  then r pairs B0 B1 with the weight gradients deferred, p-r pairs B0 W, and the
  remaining W (chunk 1 first). For m >= 2p-1 its peak is 2p chunk activations on every
  rank (the paper's Table 1 row "ZB-V"), and with T_F = T_B = T_W every rank is busy
  without a gap from its first op to its last -- the paper's bubble (p-1)(T_F+T_B-2T_W)
  = 0: in unit time rank r runs from r to 6m+r. The only idle time of one step is the
  pipeline fill, (p-1)*T_F per rank (r before its first op, p-1-r after its last), which
  no schedule avoids: the rank holding stage p-1 cannot start before p-1 forwards have
  passed. For m < 2p-1 the full-size schedule is generated and the ops of absent
  micro-batches are dropped, as ``torch.distributed.pipelining``'s ZBV does.
"""

from __future__ import annotations

from braid.core.ir import Plan, ScheduleConfig, compute_ops
from braid.schedules.generators._common import RankBuilder, check_chunks, make_plan
from braid.schedules.registry import register


@register("zb_h1", v=1, placement="loop", description="Zero-bubble H1: 1F1B with B/W split, W deferred into the cool-down")
def zb_h1(cfg: ScheduleConfig) -> Plan:
    """ZB-H1 for any p >= 1, m >= 1."""
    check_chunks("zb_h1", cfg, 1)
    p, m = cfg.p, cfg.m
    ranks = []
    for r in range(p):
        rb = RankBuilder(m, 1)
        # Rank r holds back its first r weight gradients: the later a stage, the earlier its
        # gradient is needed upstream, so it runs B at once and spends the saved W at the end,
        # where it would otherwise wait for nothing.
        held_back = r
        # Warm-up: nF.
        warmup = min(p - r - 1, m)
        for _ in range(warmup):
            rb.f(0)
        # Steady: nFB(W), then cool-down nB(W) -- a W whenever more than `held_back` wait.
        for i in range(m):
            if i < m - warmup:
                rb.f(0)
            rb.b(0, split=True)
            if len(rb.pending_w) > held_back:
                rb.w()
        # The held-back W.
        while rb.pending_w:
            rb.w()
        ranks.append(rb.ops)
    return make_plan("zb_h1", cfg, "loop", ranks)


@register("zb_v", v=2, placement="v", description="Zero-bubble V: V placement, B/W split, peak 2p chunk activations")
def zb_v(cfg: ScheduleConfig) -> Plan:
    """ZB-V for any p >= 1, m >= 1 (gapless at peak 2p from m >= 2p-1)."""
    check_chunks("zb_v", cfg, 2)
    p, m = cfg.p, cfg.m
    n = max(2 * p - 1, m)  # build the full-size schedule, then drop micro-batches >= m
    ranks = []
    for r in range(p):
        rb = RankBuilder(n, 2)
        # Warm-up 1: nF0, enough to reach the V's turn at rank p-1.
        for _ in range(2 * (p - r) - 1):
            rb.f(0)
        # Warm-up 2: nF1F0.
        for _ in range(r):
            rb.f(1)
            rb.f(0)
        # Warm-up 3: nF1B1W1 -- chunk-1 backwards start as soon as their forward is back.
        for _ in range(p - r):
            rb.f(1)
            rb.b(1, split=True)
            rb.w()
        # Steady: F0 B0 W0 F1 B1 W1 until every forward has run.
        while rb.fwd[1] < rb.fwd[0] or rb.has_f(0):
            if rb.has_f(0):
                rb.f(0)
            rb.b(0, split=True)
            rb.w()
            rb.f(1)
            rb.b(1, split=True)
            rb.w()
        # Cool-down 1: nB0B1, weight gradients deferred.
        for _ in range(r):
            rb.b(0, split=True)
            rb.b(1, split=True)
        # Cool-down 2: nB0W -- the deferred W fill the gradient waits.
        for _ in range(p - r):
            rb.b(0, split=True)
            rb.w(0)
        # Cool-down 3: the remaining W, chunk 1 first (they are the older ones).
        rest = sorted(rb.pending_w, key=lambda w: (-w.chunk, w.mb))
        rb.ops.extend(rest)
        ranks.append([i for i in rb.ops if all(op.mb < m for op in compute_ops(i))])
    return make_plan("zb_v", cfg, "v", ranks)
