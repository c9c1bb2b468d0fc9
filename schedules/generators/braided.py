"""The braided V schedule of "Synergistic Tensor and Pipeline Parallelism" (Sec. 4.2, Fig. 5).

V placement: rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1), so device 0 holds
the first and the last stage. Braided blocks interleave the units of two ops so every TP
all-reduce of one is in flight while the other computes (:mod:`braid.core.braiding`). Three kinds
appear, in the order of the authors' published step structure (and a fourth of braid's own, below):

* F&F -- two chunk-0 forwards of consecutive micro-batches (warm-up), and once per rank a
  chunk-0 forward with the chunk-1 forward before it (end of warm-up),
* F&W -- a chunk-0 forward with a deferred weight gradient (end of warm-up),
* F&B -- forward and backward of the *same* chunk, forward micro-batch later than the
  backward one; ``B`` (weight gradient split off) while gradients must move downstream
  fast, ``BW`` (full backward) in the steady phase.

Phases for rank r (closed-form counts; ``split`` = weight gradient deferred to a later W):

1. ``2(p-r-1)`` forwards of chunk 0,
2. ``r+1`` pairs F0, F1,
3. ``a`` more chunk-0 forwards -- one single F when ``a`` is odd (braided with phase 2's
   last forward, of chunk 1: a cross-chunk F&F block), then F&F blocks.
   ``a = r+1`` fills rank r with the maximum number of in-flight micro-batches (Fig. 11c);
   the memory-efficient warm-up (Appendix A/B, Fig. 11b, "Ours^") takes ``a = 1``: just the
   one extra forward that lets the first F&B block pair a later forward with an earlier
   backward,
4. ``p-r-1`` times: F1&B1 (split), then F0&W (the memory-efficient variant runs the W alone),
5. steady: F1&B1, F0&B0 alternate while chunk-0 forwards remain, closing with an F1&B1;
   the last ``r`` of them split again,
6. while chunk-1 forwards remain: a full backward of chunk 0, then F1&B1 (split) -- "when
   micro-batches run out, a full B then a split F&B, W re-enabled",
7. ``r+1`` pairs of full backwards B0, B1 -- on rank 0 braided, B0&B1 (braid's addition: the
   authors run them one after the other; rank 0 holds the first and the last stage, so the
   block waits for no gradient the plain order does not; ``braided_v_offload`` keeps the
   authors' order, since the block would need both members' activations reloaded at once),
8. the remaining chunk-0 full backwards, each gap filled with two deferred W,
9. the remaining W.

For m >= 3p-1 the counts are the authors' closed forms. Their generator asserts only
m >= 2p, but for 2p <= m < 3p-1 rank 0 would run out of chunk-0 forwards in phase 4; we
keep the structure and let phases 3-4 run only the forwards that exist (an F&W block
whose forward is missing becomes a plain W), and phases 5-9 take their counts from what
is left. m < 2p raises ``ValueError``.

Activation count on device 0 (F counted when it ends, B/BW when it ends, W not at all, a
braided block's members together at its end; see the tests): 3p for ``braided_v``, as in
Table 1 (min(3p, m+1) when the warm-up runs out of micro-batches), and 2p+1 for the
memory-efficient warm-up -- strictly lower whenever m > 2p; at m = 2p both hold 2p+1. The
memory-efficient variant pays for it with a longer tail (about 2(p-1) more unit steps
than ``braided_v`` at p=4, m=12 with unit op times).

Why not go lower than one extra forward: if rank 0 had no chunk-0 forward ahead of rank 1
when the F0&B0 blocks start, rank 0's block F(x)&B(y) would wait for rank 1's B(y), whose
block waits for rank 0's F(x) -- a cycle.
"""

from __future__ import annotations

from braid.core.ir import Plan, ScheduleConfig
from braid.schedules.generators._common import RankBuilder, braids, check_chunks, make_plan
from braid.schedules.registry import Knob, register

BRAID_KNOB = Knob("braid", (), "auto (braid.simulate's default): braid a block only where the cost model says it pays "
                                "(braid.planner.braid_tune); all: every block (the generator's default); none: no blocks")


@register("braided_v", v=2, placement="v", description="Braided TP/PP V schedule (paper Fig. 5): F&F, F&W and F&B blocks",
          knobs=(BRAID_KNOB,), min_m=2, steady_m=3)
def braided_v(cfg: ScheduleConfig) -> Plan:
    """The paper's braided schedule for m >= 2p (throughput-efficient warm-up)."""
    return _braided("braided_v", cfg, lowmem=False)


@register(
    "braided_v_lowmem",
    v=2,
    placement="v",
    description="Braided V schedule with the memory-efficient warm-up (paper Appendix B, Ours^)",
    knobs=(BRAID_KNOB,),
    min_m=2,
    steady_m=3,
    saves_memory_of="braided_v",
)
def braided_v_lowmem(cfg: ScheduleConfig) -> Plan:
    """Braided V schedule with one extra forward before the first braided block; lower peak memory."""
    return _braided("braided_v_lowmem", cfg, lowmem=True)


@register(
    "braided_v_offload",
    v=2,
    placement="v",
    description="Braided V schedule with async activation offload of chunk 0 (paper Sec. 4.4)",
    knobs=(Knob("offload_alpha", (0.25, 0.5, 1.0), "steady-phase fraction of chunk-0 activations moved to host memory"),
           Knob("offload_alpha_warmup", (), "warm-up fraction (default: half of offload_alpha)"), BRAID_KNOB),
    min_m=2,
    steady_m=3,
    saves_memory_of="braided_v",
)
def braided_v_offload(cfg: ScheduleConfig) -> Plan:
    """braided_v whose chunk-0 activations are offloaded to host memory (paper Sec. 4.4, Fig. 6).

    Options: ``offload_alpha`` (steady-phase fraction, default 0.5), ``offload_alpha_warmup``
    (warm-up fraction, default half of alpha, so warm-up copies stay under T_F). The
    compiler's offload pass (:mod:`braid.core.offload`) inserts the OFFLOAD/RELOAD instructions.
    ``"auto"`` needs a cost model: pick the values with :func:`braid.planner.offload_tune.tune_offload`
    (``python -m braid.simulate --offload-alpha auto`` does).
    """
    if "auto" in (cfg.option("offload_alpha"), cfg.option("offload_alpha_warmup")):
        raise ValueError("braided_v_offload: offload_alpha='auto' needs a cost model; build the plan with numbers "
                         "from braid.planner.offload_tune.tune_offload(plan, costs).options() (python -m braid.simulate does this)")
    alpha = float(cfg.option("offload_alpha", 0.5))
    warm = float(cfg.option("offload_alpha_warmup", alpha / 2))
    opts = dict(cfg.options) | {"offload_alpha": alpha, "offload_alpha_warmup": warm}
    full = ScheduleConfig(cfg.p, cfg.m, cfg.v, tuple(sorted(opts.items())))
    return _braided("braided_v_offload", full, lowmem=False)


def _braided(name: str, cfg: ScheduleConfig, lowmem: bool) -> Plan:
    check_chunks(name, cfg, 2)
    p, m = cfg.p, cfg.m
    if m < 2 * p:
        raise ValueError(f"{name} needs m >= 2p (got p={p}, m={m})")
    braided = braids(name, cfg)
    # Offload keeps the authors' cool-down: a B0&B1 block needs both members' chunk activations reloaded as it starts
    cool = braided and name != "braided_v_offload"
    return make_plan(name, cfg, "v", [_rank_ops(p, m, r, lowmem, braided, cool) for r in range(p)])


def _rank_ops(p: int, m: int, r: int, lowmem: bool, braided: bool = True, cool: bool = True) -> list:
    rb = RankBuilder(m, 2, braided)
    # Phase 1: nF0.
    for _ in range(2 * (p - r - 1)):
        rb.f(0)
    # Phase 2: nF0F1.
    for _ in range(r + 1):
        rb.f(0)
        rb.f(1)
    # Phase 3: extra chunk-0 forwards, a single one first if odd, then F&F blocks. The single
    # one braids with phase 2's last forward (of chunk 1, so they do not depend on each
    # other): one more warm-up forward's all-reduces hide, at no cost in step time on uniform
    # costs (the memory-efficient variant keeps its lone forward).
    extra = min(1 if lowmem else r + 1, m - rb.fwd[0])
    if extra % 2 == 1 and lowmem:
        rb.f(0)
    elif extra % 2 == 1 and not braided:
        rb.f(0)
    elif extra % 2 == 1:
        last = rb.ops.pop()  # F(r) of chunk 1
        rb.braid(rb.next_f(0), last)
    for _ in range(extra // 2):
        rb.braid(rb.next_f(0), rb.next_f(0))
    # Phase 4: n(F1&B1, F0&W) -- split backwards push gradients downstream fast.
    for _ in range(p - r - 1):
        rb.braid(rb.next_f(1), rb.next_b(1, split=True))
        if rb.has_f(0) and not lowmem:
            rb.braid(rb.next_f(0), rb.next_w())
        else:
            rb.w()
    # Phase 5 (steady): n(F1&B1, F0&B0) + F1&B1, full backwards but the last r.
    n0 = m - rb.fwd[0]
    steady = 2 * n0 + 1
    for i in range(steady):
        chunk = 1 if i % 2 == 0 else 0
        rb.braid(rb.next_f(chunk), rb.next_b(chunk, split=i >= steady - r))
    # Phase 6: n(B0, F1&B1) while chunk-1 forwards remain; W split re-enabled.
    while rb.has_f(1):
        rb.b(0)
        rb.braid(rb.next_f(1), rb.next_b(1, split=True))
    # Phase 7: n(B0, B1); on rank 0 each pair braided (B0&B1). There chunk 1 is the last stage, whose backward
    # reads no gradient from another rank, and chunk 0 the first, whose backward sends none: the block waits
    # for nothing the plain order (B0 first) does not, and only B1's gradient leaves it. On another rank it
    # would wait for both members' gradients before either runs (simulated on analytic costs at p >= 2:
    # 2-20% longer steps).
    while rb.has_b(1):
        if r == 0 and cool:
            rb.braid(rb.next_b(0, split=False), rb.next_b(1, split=False))
        else:
            rb.b(0)
            rb.b(1)
    # Phase 8: n(B0, W, W) -- deferred weight gradients fill the waits between backwards.
    while rb.has_b(0):
        rb.b(0)
        for _ in range(2 if rb.has_b(0) else 0):
            if rb.pending_w:
                rb.w()
    # Phase 9: nW.
    while rb.pending_w:
        rb.w()
    return rb.ops
