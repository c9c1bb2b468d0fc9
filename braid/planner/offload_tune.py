"""The offload tuner: picks a policy for :mod:`braid.core.offload`'s pass by simulating candidates.

It sits beside the planner, above the simulator: the lowering pass (:mod:`braid.core.offload`) is
imported by the compiler and the simulator, and this module imports both, so
compiler -> offload -> simulator has no cycle.

Long runs are tuned on a *proxy*: the same schedule at the shortest micro-batch count of its
steady state (``steady_m * p``, :class:`braid.schedules.ScheduleSpec`), where each further
micro-batch adds the same time and no memory -- the policy (fractions and reload lead) does
not depend on m. ``tune_offload(..., proxy=True)`` does that; the caller simulates the chosen
policy at the real m.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from braid.core.compiler import compile_plan
from braid.core.ir import Plan, ScheduleConfig
from braid.core.offload import OFFLOAD_OPTIONS, OffloadPolicy, insert_offload
from braid.simulator.fast import run_programs


@dataclass(frozen=True, slots=True)
class OffloadChoice:
    """The offload policy :func:`tune_offload` picked, with the predictions it was picked on."""

    policy: OffloadPolicy
    step_s: float
    peak_bytes: tuple[int, ...]  # predicted activation peak per rank, with offload
    base_step_s: float
    base_peak_bytes: tuple[int, ...]  # the same schedule without offload
    m: int = 0  # micro-batches of the run it was tuned on (the plan's, or the proxy's)

    def options(self) -> dict[str, float | int]:
        """Plan options that reproduce the policy (``schedules.build(..., **choice.options())``)."""
        pol = self.policy
        return {"offload_alpha": pol.alpha, "offload_alpha_warmup": pol.alpha_warmup, "offload_lead": pol.lead,
                "offload_min_gap": pol.min_gap}

    def describe(self) -> str:
        pol, r = self.policy, max(range(len(self.peak_bytes)), key=self.base_peak_bytes.__getitem__)
        return (f"alpha={pol.alpha:g} warm-up={pol.alpha_warmup:g} lead={pol.lead}: predicted peak "
                f"{self.peak_bytes[r] / self.base_peak_bytes[r] - 1:+.1%} on rank {r}, "
                f"step {self.step_s / self.base_step_s - 1:+.1%} vs no offload")


COARSE_GRID = (0.0, 0.5, 1.0)  # alpha and warm-up fractions of the coarse search, at one lead


def tune_offload(plan: Plan, costs, *, max_slowdown: float = 0.01, leads: tuple[int, ...] = (1, 2, 3),
                 min_gap: int = 1, proxy: bool = False, coarse: bool = False,
                 build_proxy: Callable[[int], Plan] | None = None) -> OffloadChoice:
    """Pick (alpha, alpha_warmup, lead) for ``plan`` from the cost model (``offload_alpha="auto"``).

    Simulates ``plan``'s programs without offload, then with the offload pass for a grid of
    policies (fractions in steps of 0.25; then, from each of the three best, refined by 0.1
    and 0.05 at its lead -- one start alone can settle in a worse local optimum), and returns
    the policy with the lowest predicted worst-rank activation peak whose step time stays
    within ``1 + max_slowdown`` of the plan without offload. This is the paper's rule (warm-up
    copies under T_F, steady copies within the link's time, reloads hidden behind compute)
    made concrete by the simulator, which models copy bandwidth, contention and reload waits.
    ``costs`` must be built for the plan's layout. Raises ``ValueError`` for a negative
    ``max_slowdown``. ``proxy``: tune on the steady-state proxy (module doc) when it is
    shorter than the plan; the returned figures are then the proxy's. ``coarse``: only the
    :data:`COARSE_GRID` fractions at the middle lead, no refinement (9 simulations instead
    of ~100: for long plans, where each simulation costs most of a second). ``build_proxy(m)``:
    the plan at the proxy's m, where the schedule's options alone do not give it (blocks
    chosen one by one, :mod:`braid.planner.braid_tune`); default ``schedules.build`` with the options.
    """
    if max_slowdown < 0:
        raise ValueError(f"max_slowdown must be >= 0, got {max_slowdown}")
    cfg = plan.config
    rest = tuple(kv for kv in cfg.options if kv[0] not in OFFLOAD_OPTIONS)
    bare = Plan(plan.name, ScheduleConfig(cfg.p, cfg.m, cfg.v, rest), plan.placement, plan.ranks)
    validate = True
    if proxy:
        from braid import schedules

        spec = schedules.get_schedule(plan.name) if plan.name in schedules.names() else None
        m_proxy = spec.steady_m * cfg.p if spec is not None else cfg.m
        if 0 < m_proxy < cfg.m and spec.accepts_m(cfg.p, m_proxy):
            bare = (build_proxy(m_proxy) if build_proxy is not None
                    else schedules.build(plan.name, cfg.p, m_proxy, cfg.v, **dict(rest)))
            bare = Plan(bare.name, ScheduleConfig(cfg.p, m_proxy, cfg.v, rest), bare.placement, bare.ranks)
            validate = False  # a registered generator's plan, validated by its tests (as braid.simulator.fast)
    base = compile_plan(bare, validate=validate)

    def run(pol: OffloadPolicy) -> tuple[float, tuple[int, ...]]:
        progs = insert_offload(base, pol) if pol.alpha or pol.alpha_warmup else base
        rep = run_programs(progs, costs, plan.name, bare.config.m, grad_ready=False).report
        return rep.step_time_s, tuple(r.peak_activation_bytes for r in rep.ranks)

    base_step, base_peak = run(OffloadPolicy(0.0, 0.0))
    seen: dict[OffloadPolicy, tuple[float, tuple[int, ...]]] = {}
    feasible: dict[OffloadPolicy, tuple] = {}  # policy -> its ranking key (lower is better)

    def consider(alpha: float, warm: float, lead: int) -> OffloadPolicy:
        pol = OffloadPolicy(round(min(max(alpha, 0.0), 1.0), 3), round(min(max(warm, 0.0), 1.0), 3), lead, min_gap)
        if pol not in seen:
            # nothing offloaded: the programs without offload, already simulated, whatever the lead
            seen[pol] = step, peak = run(pol) if pol.alpha or pol.alpha_warmup else (base_step, base_peak)
            if step <= base_step * (1 + max_slowdown):
                feasible[pol] = (max(peak), step, pol.alpha + pol.alpha_warmup)
        return pol

    grid = list(COARSE_GRID) if coarse else [0.0, 0.25, 0.5, 0.75, 1.0]
    for lead in ((leads[len(leads) // 2],) if coarse else leads):
        for a in grid:
            for w in grid:
                consider(a, w, lead)
    for start in ([] if coarse else sorted(feasible, key=feasible.__getitem__)[:3]):
        pol = start
        for step in (0.1, 0.05):
            for da in (-step, 0.0, step):
                for dw in (-step, 0.0, step):
                    consider(pol.alpha + da, pol.alpha_warmup + dw, pol.lead)
            pol = min((q for q in feasible if q.lead == start.lead
                       and abs(q.alpha - pol.alpha) <= step + 1e-9 and abs(q.alpha_warmup - pol.alpha_warmup) <= step + 1e-9),
                      key=feasible.__getitem__)
    pol = min(feasible, key=feasible.__getitem__)  # alpha = warm-up = 0 is always feasible
    step, peak = seen[pol]
    return OffloadChoice(pol, step, peak, base_step, base_peak, bare.config.m)


