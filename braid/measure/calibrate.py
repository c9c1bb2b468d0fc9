"""Predictions of bench runs from a profile, and the calibration that fits the profile to a probe
run (a short measured step) so that the simulator predicts the rest (``docs/bench.md``).

The calibration fits physical quantities, each held to a physical range, never a free
constant (:func:`calibrate` gives the rule): the host lane follows how the steps run (the
profiled host time per unit task eager, none for a whole-step CUDA graph replay); at
tp > 1 the slowdown of compute beside an in-flight all-reduce is the one that reproduces the
profiled pair (GEMMs issued beside an all-reduce, :func:`pair_slowdown`); compute
scales per phase come from the probe's recorded busy time, which excludes exposed
all-reduce waits and can only over-state device time (host gaps), so a scale is at most 1
and at least 0.67, B and W sharing one where the executor fuses a BW op (tp = 1); then one
communication figure explains the rest of the probe's step -- the all-reduce scale at
tp > 1 (0.67 .. 1.5 of the profiled all-reduce), the P2P time at pp > 1 -- and what the
bounded figures cannot explain stays visible (the host lane fitted lower, then a factor
common to the phases, then ``probe_error``).
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

from braid.cost.costs import Layout, costs_from_dict
from braid.io.trace import Trace
from braid.measure.config import ProfileConfig
from braid.measure.pair import pair_slowdown_of


def predict(profile_doc: dict[str, Any], schedule: str, m: int, pp: int, tp: int, layers_per_stage: Sequence[int],
            memory: str = "instruction_end", cuda_graph: str | None = None, vision: bool = False,
            moe_layers: Sequence[int] = ()):
    """Simulate ``schedule`` (p=pp, m) on a profile dict; returns (SimResult, per-rank predicted peak bytes).

    ``vision``: stage 0 is a vision-language model's tower (ending with the merge unit); ``moe_layers``:
    the global indices of the mixture-of-experts layers (:attr:`braid.measure.config.ProfileConfig.moe_layers`).

    ``memory``: ``"instruction_end"`` (CPU measurements) or ``"allocator_peak"`` (GPU: true peak).
    ``cuda_graph``: how the run went (:func:`host_lane_for`); None takes the profile as it is.
    """
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.core.partition import chunk_specs
    from braid.simulator import simulate

    plan = schedules.build(schedule, pp, m)
    if len(layers_per_stage) != plan.num_stages:
        raise ValueError(f"{schedule} has {plan.num_stages} virtual stages; the profile has {len(layers_per_stage)}")
    specs = chunk_specs(tuple(layers_per_stage), pp, plan.placement, moe_layers=moe_layers, vision=vision)
    if cuda_graph is not None:
        profile_doc = {**profile_doc, "host_task_s": host_lane_for(profile_doc, cuda_graph)}
    costs = costs_from_dict(profile_doc, Layout(tp, pp, plan.v, plan.placement), specs, where=f"profile for {schedule}")
    sim = simulate(compile_plan(plan), costs, name=schedule)
    if memory == "instruction_end":
        peaks = instruction_end_peaks(sim.trace)
    else:
        peaks = {r.rank: r.peak_activation_bytes for r in sim.report.ranks}
    return sim, [peaks.get(r, 0) for r in range(pp)]


def host_lane_for(profile_doc: dict[str, Any], cuda_graph: str) -> float:
    """The host time per unit task of a run that went as ``cuda_graph`` says: none for a
    whole-step graph replay (``"step"``); for an eager run the profile's own, or the profiled
    one where the profile was calibrated on a graphed probe (which set its host lane to 0)."""
    if cuda_graph == "step":
        return 0.0
    cal = (profile_doc.get("meta") or {}).get("calibration") or {}
    if cal.get("cuda_graph") == "step":
        return float(cal.get("profiled_host_task_s", 0.0))
    return float(profile_doc.get("host_task_s", 0.0))


def rel_err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else 0.0


# ----------------------------------------------------------------------------------------
# Calibration on a probe schedule
# ----------------------------------------------------------------------------------------
def probe_plan(p: int, m: int, v: int = 2):
    """A GPipe-like plan over the profiled chunks (not one of the benchmarked schedules): per rank
    all forwards chunk by chunk in stage order, then all full backwards in reverse."""
    from braid.core.ir import Compute, OpKind, Plan, ScheduleConfig

    placement = "v" if v == 2 else "loop"
    ranks = []
    for r in range(p):
        chunks = sorted(range(v), key=lambda c: (r if placement == "loop" else 0) + c)  # stage order on this rank
        fwd = [Compute(OpKind.F, mb, c) for c in chunks for mb in range(m)]
        bwd = [Compute(OpKind.BW, mb, c) for c in reversed(chunks) for mb in range(m)]
        ranks.append(tuple(fwd + bwd))
    return Plan("probe", ScheduleConfig(p, m, v), placement, tuple(ranks))


# The probe's default m = 4p (bench --probe-mbs sets another). Under a power cap the SM clock
# follows how long a device stays busy: on 2 H200s at 700 W a probe of m = 2p ran its busiest
# rank at ~1730 MHz, the benchmarked m = 8 steps at ~1480-1540 MHz, and every run was
# predicted 3-12% fast; at m = 4p the probe ran at ~1550 MHz, as the runs do
# (benchmarks/results/probe_clocks_h200x2.txt).
PROBE_MBS_PER_RANK = 4
# The probe holds every micro-batch's activations at once. The profile's activation bytes have run
# 18-28% below the allocator's peak on H100s (benchmarks/results/acceptance_h100x2_bench.json), and a
# graphed probe keeps its graph's pool beside the eager one: a probe is sized for this much more.
PROBE_MEMORY_MARGIN = 1.5


def probe_fit(doc: dict[str, Any], pc: ProfileConfig, pp_rank: int, free_bytes: float, m: int) -> int:
    """The largest probe micro-batch count, at most ``m`` and at least ``pc.pp``, whose activations (every
    micro-batch of this pipeline rank's chunks at once, :data:`PROBE_MEMORY_MARGIN` over the profile's
    ``activation_bytes``) fit 90% of ``free_bytes`` (what the device can still give this process)."""
    from braid.core.ir import stage_of

    chunks = doc.get("chunks", {})
    act = sum(float(chunks.get(str(stage_of(pc.placement, pc.pp, pp_rank, c)), {}).get("activation_bytes", 0.0))
              for c in range(pc.v))
    if act <= 0:
        return m
    return max(pc.pp, min(m, int(0.9 * free_bytes / (PROBE_MEMORY_MARGIN * act))))


def probe_mbs(p: int, cal: dict[str, Any] | None = None) -> int:
    """The probe's micro-batch count: the one a stored calibration names (``"probe p=2 m=8"``),
    else the default ``PROBE_MBS_PER_RANK * p``."""
    label = (cal or {}).get("probe", "")
    m = next((w[2:] for w in label.split() if w.startswith("m=")), "")
    return int(m) if m.isdigit() else PROBE_MBS_PER_RANK * p


SCALE_BOUNDS = (0.67, 1.5)  # a fitted scale outside these is a missing mechanism, not a constant


def _clamp(x: float, lo: float = SCALE_BOUNDS[0], hi: float = SCALE_BOUNDS[1]) -> float:
    return min(hi, max(lo, x))


def _fit(f, target: float, lo: float, hi: float, limit: float | None = None, iters: int = 40) -> float:
    """The x in [lo, hi] where the non-decreasing ``f`` reaches ``target``, or the end it is held at;
    with ``limit``, ``hi`` doubles up to it first."""
    if f(lo) >= target:
        return lo
    while limit is not None and hi < limit and f(hi) < target:
        hi = min(limit, 2 * hi)
    if f(hi) <= target:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def pair_slowdown(comm: dict[str, Any]) -> float | None:
    """The slowdown of compute beside an in-flight all-reduce that gives the profiled pair's time
    (:func:`braid.measure.pair.pair_slowdown_of` of ``ar_beside_s``, ``gemm_alone_s`` and ``together_s``,
    measured by :func:`braid.measure.pair.collective_pair`). None where the profile has no such
    figures (CPU, tp = 1)."""
    w, g, t = (comm.get(k) for k in ("ar_beside_s", "gemm_alone_s", "together_s"))
    if not (isinstance(w, (int, float)) and isinstance(g, (int, float)) and isinstance(t, (int, float))) or w <= 0 or g <= 0:
        return None
    return pair_slowdown_of(w, g, t)


def calibrate(doc: dict[str, Any], pc: ProfileConfig, plan, measured_step_s: float,
              measured_busy_s: dict[str, float], probe: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fit the profile to one measured run of the probe plan (calibrated prediction).

    ``measured_busy_s``: seconds of unit compute per phase (``"F"``, ``"B"``, ``"W"``) in the
    probe's recorded steps (eager, every unit timed), summed over the ranks that recorded one.
    ``probe``: how the probe's timed steps ran (``cuda_graph``: ``"step"`` for a whole-step
    graph replay) and the rest of its evidence, kept in ``meta.calibration.probe_runs``.

    Every fitted figure is a physical quantity held to a physical range; a fit that would
    leave it is stopped at the bound and the next mechanism explains the rest (the residual
    stays visible as ``probe_error``). Written to ``meta.calibration``:

    1. **Host lane** (``host_task_s``). Eager: the profiled host time per unit task. A graph
       replay issues no unit task from the host, so a graphed probe (and the graphed runs
       it predicts) has no host lane: ``host_task_s = 0``.
    1a. **All-to-alls** (expert parallelism, ``a2a_scale`` in :data:`SCALE_BOUNDS`): the probe's recorded
       exchanges (``probe["a2a_span_s"]``: per pipeline rank the replica with the least, summed) over the
       simulated ones; it scales the profile's ``T_A2A`` and ``T_A2A_B``. A recorded span is an upper
       bound of the exchange (it holds the wait for the host's read of the routing counts), so where
       the all-to-all is the communication figure of step 3 it is fitted there, below that bound.
    1b. **Compute beside an all-reduce** (tp > 1, ``ar_slowdown``): :func:`pair_slowdown` of the
       profile's pair figures where it has them (the profiled figure, from GEMMs timed on
       their own stream, misses their late start; it stays as ``profiled_ar_slowdown``).
    2. **Compute scales** per phase (``compute_scale_per_phase``, each in
       :data:`SCALE_BOUNDS`). The probe's recorded steps run eager with every unit timed;
       their busy time per phase over the simulated busy time of the same probe
       (``busy_scale_per_phase``; both include the slowdown of compute beside an in-flight
       all-reduce, with the all-reduce times fitted so far, iterated to a fixed point, and
       neither holds an exposed all-reduce wait: the recorder starts a unit's clock after
       its wait) is an upper bound of the device time: a unit's recorded span is at least
       the host time to issue it, so host-bound units (short forward units, more so at
       tp > 1) record host gaps a device never spent. The profiled unit times are device
       times (the profiler fills the device queue first), so each scale is that ratio where
       it is below 1 and 1 otherwise; the host lane, not a compute scale, carries the host
       (and a replay has none). The exposed all-reduce never lands in a compute scale. At
       tp = 1 the executor runs a BW op fused (its weight gradients inside the backward:
       its W tasks record ~nothing), so B and W get one joint scale.
    3. **The one communication figure** that explains the rest of the probe's measured
       step: with pp > 1 the effective P2P time (``p2p_s``, from 0; it absorbs a loaded
       machine's per-transfer latency), with pp = 1 and tp > 1 a scale of the profiled
       all-reduce times (``ar_scale``, in :data:`SCALE_BOUNDS`: the profile measured the
       chosen backend's all-reduce alone and beside a GEMM), with pp = 1, tp = 1 and expert
       parallelism in eager the all-to-all scale (from the bound of 1a down to its lower bound,
       the host lane as profiled; at that bound, the host lane below it), with pp = 1 and tp = 1 in
       eager the host time per unit task (from 0; at pp = 1 nothing else can leave the
       device idle).
    4. Eager only: where that figure is at its lower bound and the prediction is still
       longer than measured, the host lane is fitted below its profiled value (the
       executor issues fused ops and runs ahead of the device; the profiler timed each
       unit call alone).
    5. Whatever is left (the figures at their bounds) is one factor common to the phases
       (``compute_factor``), each scaled phase held in :data:`SCALE_BOUNDS`.
    """
    import copy

    from braid.core.compiler import compile_plan
    from braid.simulator import simulate

    probe = dict(probe or {})
    graphed = probe.get("cuda_graph") == "step"
    programs = compile_plan(plan)
    lay = Layout(pc.tp, pc.pp, plan.v, plan.placement)
    specs = pc.specs(plan.placement)

    def sim(d: dict[str, Any], record: bool = False):
        return simulate(programs, costs_from_dict(d, lay, specs), name="probe", record=record)

    base = copy.deepcopy(doc)
    profiled_host = float(doc.get("host_task_s", 0.0))
    if graphed:
        base["host_task_s"] = 0.0
    slowdown = pair_slowdown((doc.get("meta") or {}).get("comm") or {}) if pc.tp > 1 else None
    if slowdown is not None:
        base["ar_slowdown"] = slowdown
    joint = pc.tp == 1
    total_meas = sum(measured_busy_s.values())
    ones = {ph: 1.0 for ph in "FBW"}

    def build(sc: dict[str, float], ar: float = 1.0, p2p: float | None = None, host: float | None = None,
              per_stage: dict[str, dict[str, float]] | None = None, a2a: float | None = None) -> dict[str, Any]:
        d = copy.deepcopy(base)
        for key, c in d["chunks"].items():
            for k in ("T_A2A", "T_A2A_B"):
                if k in c:
                    c[k] *= a2a_scale if a2a is None else a2a
            for ph in "FBW":
                c[f"T_{ph}"] *= sc[ph] * (per_stage[key][ph] if per_stage else 1.0)
            if pc.tp > 1:
                c["T_AR"], c["T_AR_B"] = c["T_AR"] * ar, c.get("T_AR_B", c["T_AR"]) * ar
            if p2p is not None:
                c["T_P2P"] = p2p
        if host is not None:
            d["host_task_s"] = host
        return d

    def busy_scales(sc: dict[str, float], fit: dict[str, float]) -> tuple[dict[str, float], float]:
        """``sc`` times measured over simulated busy time per phase (B and W joint at tp = 1),
        the probe simulated with ``sc`` and the communication figures fitted so far (the
        slowdown beside an all-reduce depends on how long it is in flight beside what)."""
        # the recorded steps ran eager: with the profiled host lane, whatever the timed steps were
        nominal = busy_by_phase(sim(build(sc, fit.get("ar_scale", 1.0), fit.get("p2p_s"), profiled_host), record=True).trace)
        total_nom = sum(nominal.values())
        k_all = total_meas / total_nom if total_nom > 0 and total_meas > 0 else 1.0
        out: dict[str, float] = {}
        for group in ((("F",), ("B", "W")) if joint else (("F",), ("B",), ("W",))):
            nom = sum(nominal.get(ph, 0.0) for ph in group)
            meas = sum(measured_busy_s.get(ph, 0.0) for ph in group)
            for ph in group:
                out[ph] = sc[ph] * (meas / nom if nom > 0 and meas > 0 else k_all)
        return out, k_all

    # 1c. Expert parallelism's all-to-alls: the probe's recorded exchanges (on each pipeline rank the
    # replica that waits least, the busiest, whose pace the others keep) over the simulated ones.
    a2a_scale = 1.0
    a2a_meas = float(probe.get("a2a_span_s") or 0.0)
    if a2a_meas > 0:
        a2a_nom = sum(e.dur for e in sim(base, record=True).trace.events if e.kind == "A2A")
        a2a_scale = _clamp(a2a_meas / a2a_nom) if a2a_nom > 0 else 1.0
    step = lambda d: sim(d).report.step_time_s  # noqa: E731
    fit: dict[str, float] = {}
    raw_scale = ones
    for _ in range(4 if pc.tp > 1 else 1):  # the all-reduce scale and the busy time beside it, to a fixed point
        raw_scale, k_all = busy_scales(raw_scale, fit)
        scale = {ph: _clamp(min(k, 1.0)) for ph, k in raw_scale.items()}
        if pc.pp > 1:
            fit["p2p_s"] = _fit(lambda x, sc=scale: step(build(sc, p2p=x)), measured_step_s, 0.0, 1e-3, measured_step_s)
        elif pc.tp > 1:
            fit["ar_scale"] = _fit(lambda x, sc=scale: step(build(sc, ar=x)), measured_step_s, *SCALE_BOUNDS)
        elif a2a_meas > 0 and not graphed:
            a2a_scale = _fit(lambda x, sc=scale: step(build(sc, host=profiled_host, a2a=x)), measured_step_s,
                             SCALE_BOUNDS[0], max(a2a_scale, SCALE_BOUNDS[0]))
            if step(build(scale, host=profiled_host)) > measured_step_s * (1 + 1e-3):  # the exchange at its bound
                fit["host_task_s"] = _fit(lambda x, sc=scale: step(build(sc, host=x)), measured_step_s, 0.0, profiled_host)
        elif not graphed:
            fit["host_task_s"] = _fit(lambda x, sc=scale: step(build(sc, host=x)), measured_step_s, 0.0, 1e-3, measured_step_s)
    # 2b. A probe at tp = 1 (graphed or eager): its busy time per stage and phase, where the
    # probe's own timed step confirms it is device time (see stage_busy_scales).
    per_stage = None
    if joint and pc.pp > 1 and probe.get("busy_per_chunk_s"):
        per_stage = stage_busy_scales(base, probe["busy_per_chunk_s"], programs, lay, specs)
        if step(build(ones, p2p=0.0, per_stage=per_stage)) <= measured_step_s * (1 + 1e-3):
            scale = ones
            fit["p2p_s"] = _fit(lambda x: step(build(ones, p2p=x, per_stage=per_stage)), measured_step_s, 0.0, 1e-3, measured_step_s)
        else:  # the spans hold more than the device's time: the capped per-phase scales stand
            per_stage = None
    knobs = lambda sc, **kw: build(sc, fit.get("ar_scale", 1.0), fit.get("p2p_s"), kw.get("host", fit.get("host_task_s")),  # noqa: E731
                                   per_stage)
    host = float(base.get("host_task_s", 0.0))
    if not graphed and "host_task_s" not in fit and host > 0 and step(knobs(scale)) > measured_step_s * (1 + 1e-3):
        fit["host_task_s"] = _fit(lambda x: step(knobs(scale, host=x)), measured_step_s, 0.0, host)
    factor = 1.0
    if abs(step(knobs(scale)) / measured_step_s - 1) > 1e-3:
        lo = max(SCALE_BOUNDS[0] / v for v in scale.values())
        hi = min(SCALE_BOUNDS[1] / v for v in scale.values())
        if lo < hi:
            factor = _fit(lambda x: step(knobs({ph: v * x for ph, v in scale.items()})), measured_step_s, lo, hi)
            scale = {ph: v * factor for ph, v in scale.items()}
    out = knobs(scale)
    predicted = step(out)
    cal: dict[str, Any] = {"probe": f"{plan.name} p={plan.p} m={plan.m}", "measured_step_s": measured_step_s,
                           "measured_busy_s": dict(measured_busy_s), "probe_runs": probe,
                           "profiled_host_task_s": profiled_host, "cuda_graph": "step" if graphed else "none",
                           "compute_scale": k_all, "busy_scale_per_phase": raw_scale, "compute_scale_per_phase": scale,
                           "compute_factor": factor, **fit, "predicted_step_s": predicted,
                           "probe_error": rel_err(predicted, measured_step_s)}
    if per_stage is not None:
        cal["compute_scale_per_stage"] = {key: {ph: v * scale[ph] for ph, v in sc.items()} for key, sc in per_stage.items()}
    if slowdown is not None:
        cal.update(ar_slowdown=slowdown, profiled_ar_slowdown=doc.get("ar_slowdown"))
    if a2a_meas > 0:
        cal.update(a2a_scale=a2a_scale, busy_a2a_s=a2a_meas)
    if graphed:
        cal["host_task_s"] = 0.0
    out["meta"] = {**out.get("meta", {}), "calibration": cal}
    return out


def stage_busy_scales(doc: dict[str, Any], busy_per_chunk_s: dict[str, float], programs, lay: Layout,
                      specs) -> dict[str, dict[str, float]]:
    """Per stage (the profile's chunk keys) and phase: the probe's recorded busy time over the
    profiled time of the same ops (B and W joint: the executor fuses a BW op at tp = 1), each
    held to :data:`SCALE_BOUNDS`.

    The profiler times each unit alone, on an idle device at full clocks; in the pipeline the
    same ops run slower (both devices busy, the power cap lowering clocks; the stage holding
    the LM head and loss more so), and by how much differs per stage. Recorded spans can also
    hold host gaps, so :func:`calibrate` takes these scales only where the probe's own timed
    step confirms them: the probe simulated with them, no P2P time at all and its host lane
    (none for a whole-step graph replay; the profiled one eager) must not be longer than
    measured."""
    from braid.core.ir import stage_of
    from braid.simulator import simulate

    nominal = busy_by_chunk(simulate(programs, costs_from_dict(doc, lay, specs), name="probe", record=True).trace)
    out: dict[str, dict[str, float]] = {}
    for rank in range(lay.p):
        for chunk in range(lay.v):
            key = str(stage_of(lay.placement, lay.p, rank, chunk))
            if key not in doc["chunks"]:
                continue
            pre = f"r{rank}c{chunk}"
            scales = {}
            for group in (("F",), ("B", "W")):
                meas = sum(busy_per_chunk_s.get(pre + ph, 0.0) for ph in group)
                nom = sum(nominal.get(pre + ph, 0.0) for ph in group)
                scales.update({ph: _clamp(meas / nom) if meas > 0 and nom > 0 else 1.0 for ph in group})
            out[key] = scales
    return out


def fitted_factors(cal: dict[str, Any]) -> dict[str, float]:
    """The fitted scales of a calibration (per-phase compute scales, the all-reduce scale) that
    must stay in :data:`SCALE_BOUNDS`."""
    out = {f"compute_{ph}": v for ph, v in cal.get("compute_scale_per_phase", {}).items()}
    for key, sc in cal.get("compute_scale_per_stage", {}).items():
        out.update({f"compute_stage{key}_{ph}": v for ph, v in sc.items()})
    for k in ("ar_scale", "a2a_scale"):
        if k in cal:
            out[k] = cal[k]
    return out


# ----------------------------------------------------------------------------------------
# Prediction (shared with the stored-measurement accuracy test)
# ----------------------------------------------------------------------------------------
def instruction_end_peaks(trace: Trace) -> dict[int, int]:
    """Per rank, the simulated activation bytes at compute-instruction ends (the CPU executor's sampling)."""
    ends: dict[int, dict[int, float]] = {}
    for e in trace.events:
        if e.lane == "compute" and e.op_index is not None:
            d = ends.setdefault(e.rank, {})
            d[e.op_index] = max(d.get(e.op_index, 0.0), e.end)
    out = {}
    for r, series in trace.memory.items():
        times = [t for t, _ in series]
        vals = [b for _, b in series]
        out[r] = max((vals[i - 1] for t in ends.get(r, {}).values() if (i := bisect.bisect_right(times, t)) > 0), default=0)
    return out


def busy_by_phase(trace: Trace) -> dict[str, float]:
    """Seconds of unit compute per phase (F, B, W) in a measured trace."""
    out: dict[str, float] = {}
    for e in trace.events:
        if e.lane == "compute":
            out[e.kind] = out.get(e.kind, 0.0) + e.dur
    return out


def busy_by_chunk(trace: Trace) -> dict[str, float]:
    """Seconds of unit compute per rank, chunk and phase in a measured trace, keyed
    ``"r<rank>c<chunk><phase>"`` (``"r0c1F"``): where on the pipeline a phase's busy time is."""
    out: dict[str, float] = {}
    for e in trace.events:
        if e.lane == "compute":
            key = f"r{e.rank}c{e.chunk}{e.kind}"
            out[key] = out.get(key, 0.0) + e.dur
    return out
