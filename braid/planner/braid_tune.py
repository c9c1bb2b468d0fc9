"""Cost-aware braiding: which of a schedule's braided blocks to keep, chosen by simulating them.

Braiding is a trade. A block hides each TP all-reduce of one member behind the other
member's compute, but its forward output leaves only when the whole block ends. Where there
is little to hide (tp=1, a fast interconnect, small layers) a block costs step time: on
uniform costs with free all-reduces, dualpipe_v's cross-chunk blocks add p-1 op times
over torch's plain DualPipeV order. So a schedule's ``braid`` knob takes ``auto``
(``python -m braid.simulate``'s default): this pass decides, for each block of the
schedule's plan (``braid="all"``), whether to

* keep it braided, with the braiding rule's lead (:func:`braid.core.braiding.steps`),
* keep it braided but led by a fixed member (``F9c1&B3c1/a`` or ``/b``),
* keep it braided but finish its trailing all-reduce inside it (``/n``: not carried into
  the next instruction, :func:`braid.core.braiding.carries`),
* split it into its two ops, run one after the other in either order;

and, for two plain ops next to each other on a rank that could form a block (a forward and an
independent op of another micro-batch, :data:`braid.core.ir.BRAIDABLE`), whether to *fuse* them
into one (with the braiding rule's lead or a fixed one). A block delays its forward's output
to the block's end, so the schedules leave such ops plain -- but on a rank that is the
pipeline's bottleneck and has ops to spare, hiding their all-reduces is worth more (braided_v
on a measured H100 profile at tp=2 x pp=2, one layer per virtual stage: V placement puts the
embedding and the LM head both on device 0, and ``auto`` fuses its warm-up forwards).

The choice is written into the plan (those instruction forms), so the executor runs
exactly what was chosen: it interprets the same compiled programs.

The search, greedy with local improvement, evaluates every candidate plan with the
simulator (compiled without re-validation; the engine still raises on any deadlock):

1. the schedule with every block (``all``) and the schedule's own order without blocks
   (``none``): the faster one is the start, so the result is never slower than either --
   unless ``none`` holds more activation memory than ``all`` (below); a tie (within
   rounding, :data:`REL_GAIN`) goes to the one with the lower activation peak;
2. one decision for all blocks of one shape (member kinds and chunks, e.g. every F&BW
   block), each alternative tried in turn and kept where the step gets shorter;
3. the same per (rank, shape) -- a rank with slack gains by sending its outputs early, a
   bottleneck rank by hiding its all-reduces --, then fusing each fusable pair of plain ops,
   then per block, while the evaluation budget lasts: at least :data:`MAX_EVALS`
   simulations, more for short plans (:func:`eval_budget`).

A change is kept only if the step gets shorter and the worst rank's activation peak stays
at most the all-blocks plan's, the schedule as designed (splitting a block moves its
members' allocations apart, and the schedules' peaks -- 3p M_a for braided_v, less for its
memory-saving variants -- are part of what they promise); ``none`` is the start only under
the same guard.

Long runs (``p * m >= COARSE_PM``, where one simulation costs most of a second) only
compare ``all`` with ``none``, on the schedule's shortest steady-state run (``steady_m * p``
micro-batches, as the offload tuner does; at ``min_m * p`` the steady phase is too short to
judge: braided_v_lowmem at p=32 is faster without blocks at m=64 but with them at m=96 and
256) -- the caller simulates the winner at the real m. There the result is *not* guaranteed to be
at least as fast as ``none`` at that m: the note says at which m it was chosen. From
``p * m >= NO_SEARCH_PM`` (qwen2-72b at p=32, m=256: two short runs per schedule would add
a quarter to ``python -m braid.simulate``'s time) nothing is simulated and every block is
kept; the note says so (``--braid none`` simulates the order without blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from braid import schedules
from braid.core.compiler import ScheduleError, compile_plan
from braid.cost.costs import CostModel
from braid.core.ir import Braided, Compute, ComputeInstr, OpKind, Plan, ScheduleConfig
from braid.simulator import SimulationError
from braid.simulator.fast import FastResult, run_programs, simulate_schedule

COARSE_PM = 4096  # p*m from which only all-or-none is compared, on a short run
NO_SEARCH_PM = 8192  # p*m from which every block is kept without a simulation
UNSEARCHED = (f"kept every block: not searched at p*m >= {NO_SEARCH_PM} (a simulation costs about a second there; "
              "--braid none simulates the order without blocks)")
MAX_EVALS = 48  # simulations of the local search (after all and none), at least
EVAL_WORK = 4096  # ... and up to this many divided by p*m: a short plan simulates in milliseconds
REL_GAIN = 1e-9  # a change is kept only when it shortens the step by more than this fraction

# How one block runs. ``braid`` is the plan's block as generated.
BRAID, LEAD_A, LEAD_B, NO_CARRY, SPLIT_AB, SPLIT_BA = "braid", "lead_a", "lead_b", "no_carry", "split_ab", "split_ba"
VARIANTS = (BRAID, LEAD_A, LEAD_B, NO_CARRY, SPLIT_AB, SPLIT_BA)
_SPLITS = (SPLIT_AB, SPLIT_BA)
# How two adjacent plain ops run: as they are, or fused into a block (the forward is its first
# member; lead as the braiding rule says, or the forward's / the other op's units first).
PLAIN, FUSE, FUSE_A, FUSE_B = "plain", "fuse", "fuse_a", "fuse_b"
FUSES = (FUSE, FUSE_A, FUSE_B)


def eval_budget(p: int, m: int) -> int:
    """Simulations the local search may spend at (p, m): :data:`MAX_EVALS`, or more where one
    simulation is cheap (``EVAL_WORK // (p * m)``: 256 at p=2, m=8)."""
    return max(MAX_EVALS, EVAL_WORK // max(1, p * m))


@dataclass(frozen=True, slots=True)
class BraidChoice:
    """What :func:`tune_braiding` chose: the plan, its simulated step and a summary."""

    plan: Plan
    result: FastResult | None  # the chosen plan simulated at the plan's m (None: chosen on a short run)
    blocks: int  # braided blocks in the schedule's plan with every block
    braided: int  # blocks kept braided
    led: int  # ... of them with a fixed lead
    uncarried: int  # ... of them whose trailing all-reduce is not carried
    evaluations: int
    all_step_s: float  # the schedule with every block
    none_step_s: float  # the schedule's order without blocks
    m: int  # micro-batches of the runs compared
    fused: int = 0  # blocks made of two adjacent plain ops

    def to_dict(self) -> dict[str, Any]:
        return {"blocks": self.blocks, "braided": self.braided, "fixed_lead": self.led, "not_carried": self.uncarried,
                "fused": self.fused, "simulations": self.evaluations, "all_step_s": self.all_step_s if self.evaluations else None,
                "none_step_s": self.none_step_s if self.evaluations else None,
                "chosen_at_m": self.m}

    def describe(self) -> str:
        extra = [f"{n} {what}" for n, what in ((self.led, "with a fixed lead"), (self.uncarried, "not carrying their "
                                               "trailing all-reduce")) if n]
        if not self.evaluations:
            return f"kept all {self.blocks} blocks: {UNSEARCHED.split(': ', 1)[1]}"
        step = min(self.all_step_s, self.none_step_s) if self.result is None else self.result.report.step_time_s
        fused = f", fused {self.fused} pair{'s' * (self.fused != 1)} of plain ops" if self.fused else ""
        return (f"braided {self.braided} of {self.blocks} blocks" + (f" ({', '.join(extra)})" if extra else "") + fused
                + f"; step {step / self.all_step_s - 1:+.2%} vs all blocks, {step / self.none_step_s - 1:+.2%} vs none"
                + f" ({self.evaluations} simulations" + (f", chosen at m={self.m})" if self.result is None else ")"))


def count_blocks(plan: Plan) -> int:
    """Braided blocks in a plan (what the bench and the reports show)."""
    return sum(isinstance(ins, Braided) for ops in plan.ranks for ins in ops)


def tune_braiding(name: str, p: int, m: int, costs: CostModel, options: Iterable[tuple[str, Any]] = (), *,
                  max_evals: int | None = None, plan: Plan | None = None) -> BraidChoice:
    """Choose how schedule ``name``'s braided blocks run at (p, m) on ``costs`` (``braid="auto"``).

    ``options``: the schedule's other knobs (e.g. the offload fractions). The result's plan
    keeps the schedule's name; its options say ``braid="all"`` or ``"none"`` when every block
    is kept or split (the schedule's own plan), ``braid="auto"`` when the decisions differ
    block by block -- they are in its instructions, so such a plan is simulated and run as
    it is, never rebuilt from its options. ``plan``: the caller's ``schedules.build(name, p,
    m, **options)`` with every block, so it is not built again.
    """
    spec = schedules.get_schedule(name)
    opts = {k: v for k, v in options if k != "braid"}
    full = plan if plan is not None else schedules.build(name, p, m, **opts, braid="all")
    if p * m >= NO_SEARCH_PM:
        n = count_blocks(full)
        return BraidChoice(full, None, n, n, 0, 0, 0, float("nan"), float("nan"), m)
    if p * m >= COARSE_PM:
        return _coarse(name, p, m, costs, opts, spec, full)
    plain = schedules.build(name, p, m, **opts, braid="none")
    return _Search(full, plain, costs, eval_budget(p, m) if max_evals is None else max_evals).run()


def _coarse(name: str, p: int, m: int, costs: CostModel, opts: dict, spec, full: Plan) -> BraidChoice:
    k = p if spec.m_step == "p" else 1
    short = max(spec.steady_m, spec.min_m) * p  # the shortest run in steady state (a shorter one misleads: see above)
    short = min(m, short + (m - short) % k)
    reps = {mode: simulate_schedule(name, p, short, costs, tuple(sorted({**opts, "braid": mode}.items()))).report
            for mode in ("all", "none")}
    steps = {mode: rep.step_time_s for mode, rep in reps.items()}
    peaks = {mode: max(r.peak_activation_bytes for r in rep.ranks) for mode, rep in reps.items()}
    mode = "none" if _better(steps["none"], peaks["none"], steps["all"], peaks["all"]) else "all"
    plan = full if mode == "all" else schedules.build(name, p, m, **opts, braid="none")
    n = count_blocks(full)
    return BraidChoice(plan, None, n, n if mode == "all" else 0, 0, 0, 2, steps["all"], steps["none"], short)


def _better(t_none: float, m_none: int, t_all: float, m_all: int) -> bool:
    """Whether the order without blocks beats every block: no more activation memory and a
    shorter step, where within rounding (:data:`REL_GAIN`) the lower peak counts first."""
    if m_none > m_all:
        return False
    if m_none < m_all and abs(t_none - t_all) <= REL_GAIN * t_all:
        return True
    return t_none < t_all


class _Search:
    """Greedy search over per-block decisions (see the module docstring)."""

    def __init__(self, full: Plan, plain: Plan, costs: CostModel, max_evals: int) -> None:
        self.full, self.none, self.costs, self.max_evals = full, plain, costs, max_evals
        self.blocks = [(r, i) for r, ops in enumerate(full.ranks) for i, ins in enumerate(ops) if isinstance(ins, Braided)]
        self.plain = {blk: self._split_order(plain, blk) for blk in self.blocks}
        has_ar = costs.layout.tp > 1 and any(c.total("ar_f") + c.total("ar_b") > 0 for c in costs.chunks.values())
        has_a2a = any(c.total("a2a_f") + c.total("a2a_b") > 0 for c in costs.chunks.values())
        # the lead matters where there are collectives to hide, the carry only where there are all-reduces
        self.variants = VARIANTS if has_ar else (BRAID, LEAD_A, LEAD_B, SPLIT_AB, SPLIT_BA) if has_a2a else (
            BRAID, SPLIT_AB, SPLIT_BA)
        self.sites = fusable_pairs(full)
        self.fuses = FUSES if has_ar or has_a2a else (FUSE,)
        self.evals = 0
        self.seen: dict[tuple, tuple[float, int]] = {}

    def _split_order(self, plain: Plan, blk: tuple[int, int]) -> str:
        """How the schedule's order without blocks runs this block's two ops."""
        r, i = blk
        a, b = self.full.ranks[r][i].ops
        ops = plain.ranks[r]
        at = {op: k for k, op in enumerate(ops) if isinstance(op, Compute) and op in (a, b)}
        return SPLIT_AB if at.get(a, 0) <= at.get(b, 0) else SPLIT_BA

    def plan_of(self, state: dict[tuple[int, int], str]) -> Plan:
        return apply_choices(self.full, state)

    def step(self, state: dict[tuple[int, int], str]) -> tuple[float, int]:
        """(step time, worst-rank activation peak) of the plan with the blocks run as ``state`` says."""
        key = tuple(sorted((k, v) for k, v in state.items() if v not in (BRAID, PLAIN)))
        hit = self.seen.get(key)
        if hit is None:
            self.evals += 1
            try:
                progs = compile_plan(self.plan_of(state), validate=False)
                rep = run_programs(progs, self.costs, self.full.name, self.full.m, grad_ready=False).report
                hit = (rep.step_time_s, max(r.peak_activation_bytes for r in rep.ranks))
            except (ScheduleError, SimulationError):
                hit = (float("inf"), 0)  # cannot happen for splits or leads; kept as a guard
            self.seen[key] = hit
        return hit

    def run(self) -> BraidChoice:
        state_all = {blk: BRAID for blk in self.blocks}
        state_none = dict(self.plain)
        (t_all, m_all), (t_none, m_none) = self.step(state_all), self.step(state_none)
        # the start: the faster of the two within the all-blocks plan's activation peak, a tie the
        # lower peak; every later change must gain more than rounding and stay within that peak
        cap = m_all
        state, best = (state_none, t_none) if _better(t_none, m_none, t_all, m_all) else (state_all, t_all)
        budget = self.evals + self.max_evals
        for group in (self._by_shape, self._by_rank_shape, self._each_site, self._each):
            for members in group():
                for how in (self.fuses if members[0] in self.sites else self.variants):
                    if self.evals >= budget:
                        break
                    if all(state.get(b, PLAIN) == how for b in members) or self._clash(state, members):
                        continue
                    trial = dict(state) | dict.fromkeys(members, how)
                    t, peak = self.step(trial)
                    # faster, and no more activation memory than the start (a schedule's peak is part of its promise)
                    if t < best * (1 - REL_GAIN) and peak <= cap:
                        state, best = trial, t
        plan = self.plan_of(state)
        if state == state_none:
            plan = self.none
        elif state != state_all:
            # neither all nor none: the decisions are in the instructions, the option says where they came from
            opts = dict(plan.config.options) | {"braid": "auto"}
            plan = Plan(plan.name, ScheduleConfig(plan.p, plan.m, plan.v, tuple(sorted(opts.items()))), plan.placement,
                        plan.ranks)
        result = run_programs(compile_plan(plan, validate=False), self.costs, plan.name, plan.m)
        kept = [b for b in self.blocks if state[b] not in _SPLITS]
        return BraidChoice(plan, result, len(self.blocks), len(kept), sum(state[b] in (LEAD_A, LEAD_B) for b in kept),
                           sum(state[b] == NO_CARRY for b in kept), self.evals, t_all, t_none, plan.m,
                           sum(state.get(s, PLAIN) in FUSES for s in self.sites))

    def _clash(self, state: dict[tuple[int, int], str], members: list[tuple[int, int]]) -> bool:
        """Whether fusing the pair at ``members`` would take an op that a fused neighbour holds."""
        return any(members[0] in self.sites and state.get((r, i + d), PLAIN) in FUSES for r, i in members for d in (-1, 1))

    def _shape(self, blk: tuple[int, int]) -> tuple:
        ins = self.full.ranks[blk[0]][blk[1]]
        return tuple((op.kind, op.chunk) for op in ins.ops)

    def _groups(self, key: Callable) -> list[list[tuple[int, int]]]:
        out: dict[Any, list] = {}
        for blk in self.blocks:
            out.setdefault(key(blk), []).append(blk)
        return list(out.values())

    def _by_shape(self) -> list[list[tuple[int, int]]]:
        return self._groups(self._shape)

    def _each_site(self) -> list[list[tuple[int, int]]]:
        return [[site] for site in self.sites]

    def _by_rank_shape(self) -> list[list[tuple[int, int]]]:
        return self._groups(lambda blk: (blk[0], self._shape(blk)))

    def _each(self) -> list[list[tuple[int, int]]]:
        return [[blk] for blk in self.blocks]


def fusable_pairs(plan: Plan) -> list[tuple[int, int]]:
    """``(rank, index)`` of every two adjacent plain ops, ``index`` and ``index + 1``, that may form
    a braided block: a forward and an op of another micro-batch (so neither depends on the other)
    that :data:`braid.core.ir.BRAIDABLE` pairs with it."""
    out = []
    for r, ops in enumerate(plan.ranks):
        for i, (a, b) in enumerate(zip(ops, ops[1:])):
            if isinstance(a, Compute) and isinstance(b, Compute) and a.mb != b.mb and _fused(a, b, None) is not None:
                out.append((r, i))
    return out


def _fused(a: Compute, b: Compute, lead: int | None) -> Braided | None:
    """The block of plain ops ``a`` then ``b``, the forward first (``b`` first if only it is one); None if not braidable
    or neither is a forward (two backwards braid only where the generator places them, on the rank whose block
    waits for no other rank: :mod:`braid.schedules.generators.braided`)."""
    if OpKind.F not in (a.kind, b.kind):
        return None
    first, second = (a, b) if a.kind is OpKind.F else (b, a)
    try:
        return Braided(first, second, lead=lead)
    except ValueError:
        return None


def apply_choices(plan: Plan, choices: dict[tuple[int, int], str]) -> Plan:
    """``plan`` with block ``(rank, index)`` run as ``choices[(rank, index)]`` (one of
    :data:`VARIANTS`; blocks not named stay as they are), and the plain ops at ``index`` and
    ``index + 1`` fused into one block where ``choices[(rank, index)]`` is one of :data:`FUSES`
    (:func:`fusable_pairs`; ``ValueError`` for a pair that cannot be fused or overlaps another)."""
    ranks = []
    for r, ops in enumerate(plan.ranks):
        out: list[ComputeInstr] = []
        taken = False  # op i was fused with op i - 1
        for i, ins in enumerate(ops):
            how = choices.get((r, i), BRAID if isinstance(ins, Braided) else PLAIN)
            if how in FUSES:
                nxt = ops[i + 1] if i + 1 < len(ops) else None
                lead = {FUSE: None, FUSE_A: 0, FUSE_B: 1}[how]
                block = _fused(ins, nxt, lead) if isinstance(ins, Compute) and isinstance(nxt, Compute) and not taken else None
                if block is None or ins.mb == nxt.mb:
                    raise ValueError(f"rank {r}: cannot fuse op {i} ({ins}) with the next op ({nxt}) into a block")
                out.append(block)
                taken = True
                continue
            if taken:
                taken = False
            elif isinstance(ins, Compute):
                if how != PLAIN:
                    raise ValueError(f"rank {r}: op {i} ({ins}) is a plain op; it can be fused ({', '.join(FUSES)}), not {how!r}")
                out.append(ins)
            else:
                out += _apply(ins, how)
        ranks.append(tuple(out))
    return Plan(plan.name, plan.config, plan.placement, tuple(ranks))


def _apply(block: Braided, how: str) -> list[ComputeInstr]:
    a, b = block.ops
    if how == SPLIT_AB:
        return [a, b]
    if how == SPLIT_BA:
        return [b, a]
    if how == LEAD_A:
        return [Braided(a, b, lead=0)]
    if how == LEAD_B:
        return [Braided(a, b, lead=1)]
    if how == NO_CARRY:
        return [Braided(a, b, carry=False)]
    if how == BRAID:
        return [block]
    raise ValueError(f"unknown way to run a braided block: {how!r}; valid: {', '.join(VARIANTS)}")


def plain_beats_braided(reports: Iterable, costs: dict[str, CostModel], choices: dict[str, BraidChoice]) -> str | None:
    """One line when a plain schedule (zb_v, 1f1b_i) is faster than braided_v, saying why: how
    much TP all-reduce and expert-parallel all-to-all there was for braiding to hide. None when
    braided_v wins or is absent."""
    by = {r.schedule: r for r in reports}
    bv = by.get("braided_v")
    rivals = [by[n] for n in ("zb_v", "1f1b_i") if n in by and bv is not None and by[n].step_time_s < bv.step_time_s]
    if not rivals:
        return None
    best = min(rivals, key=lambda r: r.step_time_s)
    c = costs["braided_v"]
    ar = sum(ch.total("ar_f") + ch.total("ar_b") for ch in c.chunks.values()) if c.layout.tp > 1 else 0.0
    a2a = sum(ch.total("a2a_f") + ch.total("a2a_b") for ch in c.chunks.values())
    comp = sum(ch.total("f") + ch.total("b") + ch.total("w") for ch in c.chunks.values())
    gap = bv.step_time_s - best.step_time_s
    # the most braiding could take off the plain schedule's step
    exposed = max(r.tp_exposed_s + r.a2a_exposed_s for r in best.ranks)
    what = "TP all-reduces" + (" and all-to-alls" if a2a else "")
    if ar + a2a == 0:
        why = f"there is no TP all-reduce to hide (tp={c.layout.tp}{', T_AR=0' if c.layout.tp > 1 else ''})"
    else:
        why = (f"the {what} are {(ar + a2a) / comp:.1%} of a micro-batch's compute ({1e3 * (ar + a2a):.4g} of "
               f"{1e3 * comp:.4g} ms over all chunks) and {best.schedule} leaves only {1e3 * exposed:.4g} ms of them "
               "exposed on its worst rank")
        if exposed < gap:
            why += (f", less than the {1e3 * gap:.4g} ms gap: braided_v loses on pipeline bubble "
                    f"({_bubble(bv):.1%} of its step vs {_bubble(best):.1%})")
    ch = choices.get("braided_v")
    kept = f"; auto kept {ch.braided} of {ch.blocks} blocks" if ch is not None else ""
    return f"{best.schedule} beats braided_v by {bv.step_time_s / best.step_time_s - 1:.1%}: {why}{kept}"


def _bubble(report) -> float:
    return max(r.pp_bubble_s for r in report.ranks) / report.step_time_s
