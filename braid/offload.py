"""Activation-offload lowering pass (paper Sec. 4.4, Fig. 6): insert OFFLOAD/RELOAD.

The staged strategy of the enhanced braided schedule:

* only chunk 0 is offloaded -- on a V pipeline its activations live longest (forward at the
  start of the V, backward at its end); chunk 1's short-lived activations stay, which also
  keeps the PCIe link free for reloads in time;
* in the steady phase (after the rank's first backward) a fraction ``alpha`` of each
  chunk-0 micro-batch's saved activations goes to host memory right after its forward;
* in the warm-up the fraction is ``alpha_warmup`` (the paper limits warm-up offload so its
  copy time stays under T_F); :func:`tune_offload` picks both, and the reload lead, from a
  cost model by simulating candidate policies (``offload_alpha="auto"``);
* the reload is issued ``lead`` compute instructions before the backward that needs the
  activations, so the host-to-device copy runs behind that compute;
* activations whose backward follows within ``min_gap`` compute instructions are not worth
  a round trip and stay on the device.

The pass works on compiled programs (after P2P insertion), so it never changes the
communication order the compiler proved deadlock-free: offload and reload are rank-local.
"""

from __future__ import annotations

from dataclasses import dataclass

from braid.ir import Instruction, Offload, OpKind, Plan, Program, Reload, compute_ops

# An offload's device memory is freed once its copy is done, and at the latest when this many
# compute instructions have run after it: the next one waits for the copy (runtime and
# simulator alike; the host runs ahead of the GPU, so the bound is in program order).
RELEASE_AFTER = 2


@dataclass(frozen=True, slots=True)
class OffloadPolicy:
    alpha: float
    alpha_warmup: float
    lead: int = 1
    min_gap: int = 3
    chunk: int = 0

    def __post_init__(self) -> None:
        for name in ("alpha", "alpha_warmup"):
            a = getattr(self, name)
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"offload {name} must be in [0, 1], got {a}")
        if self.lead < 0 or self.min_gap < 1:
            raise ValueError(f"offload lead must be >= 0 and min_gap >= 1, got lead={self.lead}, min_gap={self.min_gap}")

    @staticmethod
    def from_plan(plan: Plan) -> "OffloadPolicy | None":
        alpha = plan.config.option("offload_alpha")
        if alpha is None:
            return None
        warm = plan.config.option("offload_alpha_warmup", alpha)
        return OffloadPolicy(float(alpha), float(warm), int(plan.config.option("offload_lead", 1)),
                             int(plan.config.option("offload_min_gap", 3)))


@dataclass(frozen=True, slots=True)
class OffloadChoice:
    """The offload policy :func:`tune_offload` picked, with the predictions it was picked on."""

    policy: OffloadPolicy
    step_s: float
    peak_bytes: tuple[int, ...]  # predicted activation peak per rank, with offload
    base_step_s: float
    base_peak_bytes: tuple[int, ...]  # the same schedule without offload

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


OFFLOAD_OPTIONS = ("offload_alpha", "offload_alpha_warmup", "offload_lead", "offload_min_gap")


def tune_offload(plan: Plan, costs, *, max_slowdown: float = 0.01, leads: tuple[int, ...] = (1, 2, 3),
                 min_gap: int = 1) -> OffloadChoice:
    """Pick (alpha, alpha_warmup, lead) for ``plan`` from the cost model (``offload_alpha="auto"``).

    Simulates ``plan``'s programs without offload, then with the offload pass for a grid of
    policies (fractions in steps of 0.25; then, from each of the three best, refined by 0.1
    and 0.05 at its lead -- one start alone can settle in a worse local optimum), and returns
    the policy with the lowest predicted worst-rank activation peak whose step time stays
    within ``1 + max_slowdown`` of the plan without offload. This is the paper's rule (warm-up
    copies under T_F, steady copies within the link's time, reloads hidden behind compute)
    made concrete by the simulator, which models copy bandwidth, contention and reload waits.
    ``costs`` must be built for the plan's layout. Raises ``ValueError`` for a negative
    ``max_slowdown``.
    """
    from braid.compiler import compile_plan
    from braid.simulator import simulate

    if max_slowdown < 0:
        raise ValueError(f"max_slowdown must be >= 0, got {max_slowdown}")
    cfg = plan.config
    bare = Plan(plan.name, type(cfg)(cfg.p, cfg.m, cfg.v, tuple(kv for kv in cfg.options if kv[0] not in OFFLOAD_OPTIONS)),
                plan.placement, plan.ranks)
    base = compile_plan(bare)

    def run(pol: OffloadPolicy) -> tuple[float, tuple[int, ...]]:
        rep = simulate(insert_offload(base, pol) if pol.alpha or pol.alpha_warmup else base, costs, record=False).report
        return rep.step_time_s, tuple(r.peak_activation_bytes for r in rep.ranks)

    base_step, base_peak = run(OffloadPolicy(0.0, 0.0))
    seen: dict[OffloadPolicy, tuple[float, tuple[int, ...]]] = {}
    feasible: dict[OffloadPolicy, tuple] = {}  # policy -> its ranking key (lower is better)

    def consider(alpha: float, warm: float, lead: int) -> OffloadPolicy:
        pol = OffloadPolicy(round(min(max(alpha, 0.0), 1.0), 3), round(min(max(warm, 0.0), 1.0), 3), lead, min_gap)
        if pol not in seen:
            seen[pol] = step, peak = run(pol)
            if step <= base_step * (1 + max_slowdown):
                feasible[pol] = (max(peak), step, pol.alpha + pol.alpha_warmup)
        return pol

    grid = [0.0, 0.25, 0.5, 0.75, 1.0]
    for lead in leads:
        for a in grid:
            for w in grid:
                consider(a, w, lead)
    for start in sorted(feasible, key=feasible.__getitem__)[:3]:
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
    return OffloadChoice(pol, step, peak, base_step, base_peak)


def insert_offload(programs: list[Program], policy: OffloadPolicy) -> list[Program]:
    """Return the programs with OFFLOAD/RELOAD instructions added per ``policy``."""
    out = []
    for prog in programs:
        instrs = list(prog.instructions)
        compute_idx = [i for i, ins in enumerate(instrs) if compute_ops(ins)]
        pos_of = {i: k for k, i in enumerate(compute_idx)}  # instruction index -> compute ordinal
        f_at: dict[tuple[int, int], int] = {}
        b_at: dict[tuple[int, int], int] = {}
        first_backward = None
        for i in compute_idx:
            for op in compute_ops(instrs[i]):
                if op.kind is OpKind.F:
                    f_at[op.key] = i
                elif op.kind in (OpKind.B, OpKind.BW):
                    b_at[op.key] = i
                    first_backward = i if first_backward is None else first_backward
        after: dict[int, list[Instruction]] = {}
        before: dict[int, list[Instruction]] = {}
        for key, fi in sorted(f_at.items(), key=lambda kv: kv[1]):
            mb, chunk = key
            if chunk != policy.chunk or key not in b_at:
                continue
            bi = b_at[key]
            gap = pos_of[bi] - pos_of[fi]
            if gap < policy.min_gap:
                continue
            steady = first_backward is not None and fi > first_backward
            frac = policy.alpha if steady else policy.alpha_warmup
            if frac <= 0:
                continue
            after.setdefault(fi, []).append(Offload(mb, chunk, frac))
            # reload `lead` compute instructions before the backward, never before the offload's next op
            k = max(pos_of[bi] - policy.lead, pos_of[fi] + 1)
            before.setdefault(compute_idx[k], []).append(Reload(mb, chunk))
        new: list[Instruction] = []
        for i, ins in enumerate(instrs):
            new += before.get(i, [])
            new.append(ins)
            new += after.get(i, [])
        out.append(Program(prog.rank, tuple(new), prog.meta))
    return out
