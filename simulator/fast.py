"""Fast path of the simulator: compiled programs cached, long runs extrapolated from short ones.

Past a schedule's warm-up every further micro-batch adds the same time to the step (with
the rare exceptions below) and no peak memory, from the schedule's declared ``steady_m * p``
on (:class:`braid.schedules.ScheduleSpec`). :func:`simulate_schedule` uses that where it
checks it: it simulates three short runs ``m0, m0 + k, m0 + 2k`` (``k`` = 1, or ``p`` for
schedules that need ``m % p == 0``; ``m0 >= steady_m * p``, ``m0 = m mod k``) and
extrapolates to ``m`` only when, on every rank, the two differences of step time, end time,
busy compute, nominal compute, exposed TP time and gradient-ready times agree to
``REL_TOL`` and the activation peak is the same in the last two runs. Otherwise it tries
once more from ``m0 + p`` (stages of uneven weight settle later), then simulates ``m`` in
full, as it does when the short runs would cost more than half of the long one (they
save little there: at p=32, m=256 three runs of 64 micro-batches cost 3/4 of the full
run) or the schedule declares no steady state (``steady_m=0``: GPipe's peak grows with m).
``FastResult.method`` says which was done.

How exact: the three-run check confirms the constant slope locally, not for every longer
run, and an extrapolated figure is an estimate. The known miss: qwen2-72b, zb_h1, p=32.
The step grows by 58.139663 ms per micro-batch from m=64 to 199 except one +0.2387 ms jump
at m=191. Its origin is a tie: at t=2.0367 s rank 16's P2P engine has two transfers ready
at the same instant in exact arithmetic (the activation of F42 from rank 15, the gradient of
B27 from rank 17), float rounding orders the two posts, and the one served second waits one
transfer, 0.2387 ms. That early part of the run is the same at m=190 and 191, and so is the
order taken; but the path through the transfer that waited becomes critical only from
m=191 on -- a late change of the critical path that short runs cannot see. With every time
cost scaled by 1 +- 1e-9 (same decisions in exact arithmetic) rounding takes the other order
and the slope is constant over m=186..195. Such ties are everywhere (a rank's sends and
receives share one P2P engine; on analytic costs hundreds of transfers per run wait for one
that was ready at the same instant, thousands at p=32), so their presence cannot tell when
to decline. Long runs like this one (p=32, m=256) are simulated in full by the rule above;
callers that need the full simulation's figure pass ``extrapolate=False``.

Compiled programs are cached per (schedule, p, m, options), without re-validation: the
registered generators' programs are validated by their own tests, and the engine still
raises :class:`~braid.simulator.SimulationError` on any mismatch or deadlock. Callers that
report a configuration validate it (``compile_plan(plan)``), as :mod:`braid.plan` does.

Besides the report, a run records when each (rank, chunk)'s weight gradients are complete
(the end of its last ``W``/``BW``): the data-parallel gradient reduction of that chunk can
start then (:mod:`braid.cost.cluster`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from operator import itemgetter
from typing import Any

from braid.cost.costs import CostModel
from braid.core.ir import Braided, Compute, OpKind, Plan, Program
from braid.simulator.engine import Engine
from braid.simulator.report import RankReport, Report, rank_report

REL_TOL = 1e-9
_GRAD_DONE = (OpKind.W, OpKind.BW)


@dataclass(frozen=True, slots=True)
class FastResult:
    """A simulated step: the report, when each (rank, chunk)'s gradients are ready, how it was got."""

    report: Report
    grad_ready: dict[tuple[int, int], float]
    method: str  # "full" or "extrapolated from m=a,b,c"


def _last_gradients(prog: Program) -> dict[int, list[int]]:
    """Instruction index -> the chunks whose weight gradients are complete when it ends (its last W/BW)."""
    last: dict[int, int] = {}
    for idx, ins in enumerate(prog.instructions):
        if isinstance(ins, (Compute, Braided)):
            for op in (ins,) if isinstance(ins, Compute) else ins.ops:
                if op.kind in _GRAD_DONE:
                    last[op.chunk] = idx
    out: dict[int, list[int]] = {}
    for chunk, idx in last.items():
        out.setdefault(idx, []).append(chunk)
    return out


@lru_cache(maxsize=256)
def compiled(name: str, p: int, m: int, options: tuple[tuple[str, Any], ...] = ()) -> tuple[Program, ...]:
    """The programs of ``schedules.build(name, p, m, **options)``, compiled once (not re-validated)."""
    from braid import schedules
    from braid.core.compiler import compile_plan

    return tuple(compile_plan(schedules.build(name, p, m, **dict(options)), validate=False))


def run_programs(programs: list[Program] | tuple[Program, ...], costs: CostModel, name: str, m: int,
                 *, grad_ready: bool = True) -> FastResult:
    """Simulate ``programs`` in full (no trace) and return the report with gradient-ready times
    (``grad_ready=False``: without them, a little faster)."""
    eng = Engine(list(programs), costs, record=False, tables=_tables_of(costs))
    chunks_at = [_last_gradients(prog) if grad_ready else {} for prog in programs]
    for rs, at in zip(eng.ranks, chunks_at):
        rs.watch = dict.fromkeys(at, 0.0)
    stats = eng.run()
    ready = {(r, c): eng.ranks[r].watch[idx] for r, at in enumerate(chunks_at) for idx, cs in at.items() for c in cs}
    step = max((st.end_s for st in stats), default=0.0)
    ranks = []
    for r, st in enumerate(stats):
        peak = _peak(st.mem)
        ranks.append(rank_report(r, st, step, peak, costs))
    return FastResult(_report(name, costs, m, step, ranks), ready, "full")


_TABLES: dict[int, tuple[CostModel, dict]] = {}


def _tables_of(costs: CostModel) -> dict:
    """The engine's unit-row tables of ``costs``, shared by the runs on it (the short runs of an
    extrapolation, a planner's candidates of one layout); the last 64 cost models are kept."""
    hit = _TABLES.get(id(costs))
    if hit is None or hit[0] is not costs:
        if len(_TABLES) >= 64:
            del _TABLES[next(iter(_TABLES))]
        hit = _TABLES[id(costs)] = (costs, {})
    return hit[1]


def _peak(deltas: list[tuple[float, float]]) -> int:
    """The highest point of :func:`~braid.simulator.report.memory_series` without building the series.

    Sorted by (time, delta), frees come first at a time and allocations after, so every
    running total inside a time step is at most that step's last one or the previous step's:
    the maximum running total is the series' peak."""
    if not deltas:
        return 0
    return max(0, round(max(accumulate(map(itemgetter(1), sorted(deltas))))))


def _report(name: str, costs: CostModel, m: int, step: float, ranks: list[RankReport]) -> Report:
    samples = m * costs.samples_per_microbatch
    thr = samples / step if step > 0 else 0.0
    devices = costs.layout.tp * costs.layout.p
    mfu = samples * costs.model_flops_per_sample / (step * devices * costs.peak_flops) if costs.peak_flops > 0 and step > 0 else 0.0
    return Report(name, step, m, thr, thr * costs.tokens_per_sample, mfu, tuple(ranks))


def simulate_schedule(name: str, p: int, m: int, costs: CostModel, options: tuple[tuple[str, Any], ...] = (),
                      *, extrapolate: bool = True, plan: Plan | None = None) -> FastResult:
    """Simulate schedule ``name`` at (p, m) on ``costs``: extrapolated where the slope checks out, else in full.

    ``options`` are the schedule's knobs as sorted (name, value) pairs. ``ValueError`` when the
    schedule rejects (p, m) or the costs do not fit its layout. ``plan``: the caller's
    ``schedules.build(name, p, m, **dict(options))``, compiled (once, not cached) for a full run
    instead of building it again.
    """
    from braid import schedules

    spec = schedules.get_schedule(name)
    k = p if spec.m_step == "p" else 1
    m0 = max(spec.steady_m, spec.min_m) * p
    m0 += (m - m0) % k
    # two tries: from the declared steady m, then p micro-batches later (uneven stages settle later)
    for start in (m0, m0 + p):
        if not extrapolate or not spec.steady_m or 2 * (3 * start + 3 * k) > m:
            break  # no steady state declared, or the short runs cost more than half of the long one
        runs = [_full(name, p, mm, costs, options) for mm in (start, start + k, start + 2 * k)]
        out = _extrapolate(runs, (m - start) // k, name, m, costs)
        if out is not None:
            return FastResult(out[0], out[1], f"extrapolated from m={start},{start + k},{start + 2 * k}")
    if plan is not None:
        from braid.core.compiler import compile_plan

        return run_programs(compile_plan(plan, validate=False), costs, name, m)
    return _full(name, p, m, costs, options)


def _full(name: str, p: int, m: int, costs: CostModel, options: tuple) -> FastResult:
    return run_programs(compiled(name, p, m, options), costs, name, m)


def _affine(a: float, b: float, c: float, n: int) -> float | None:
    """``a + n * (b - a)`` if a, b, c are equally spaced (to ``REL_TOL``), else None."""
    d1, d2 = b - a, c - b
    if abs(d1 - d2) > REL_TOL * max(abs(a), abs(b), abs(c), 1e-30):
        return None
    return a + n * d1


def _extrapolate(runs: list[FastResult], n: int, name: str, m: int, costs: CostModel) -> tuple[Report, dict] | None:
    a, b, c = (r.report for r in runs)
    ranks = []
    for ra, rb, rc in zip(a.ranks, b.ranks, c.ranks):
        if rb.peak_activation_bytes != rc.peak_activation_bytes:
            return None
        vals = [_affine(getattr(ra, f), getattr(rb, f), getattr(rc, f), n)
                for f in ("compute_s", "tp_exposed_s", "end_s", "nominal_compute_s", "a2a_exposed_s")]
        if any(v is None for v in vals):
            return None
        ranks.append(vals)
    step = _affine(a.step_time_s, b.step_time_s, c.step_time_s, n)
    if step is None or set(runs[0].grad_ready) != set(runs[2].grad_ready):
        return None
    ready = {}
    for key in runs[0].grad_ready:
        t = _affine(*(r.grad_ready[key] for r in runs), n)
        if t is None:
            return None
        ready[key] = t
    out = [RankReport(r, comp, exp, max(0.0, step - comp - exp - a2a), rc.peak_activation_bytes, rc.peak_activation_ma, end, nom,
                      a2a) for r, ((comp, exp, end, nom, a2a), rc) in enumerate(zip(ranks, c.ranks))]
    return _report(name, costs, m, step, out), ready
