"""``python -m braid.bench``: measured step time of several schedules next to the simulator's prediction.

One invocation spawns the layout's ranks once (gloo on CPU, NCCL on GPU), profiles the
model (:mod:`braid.profile`; or reads ``--costs FILE``), then runs every schedule for every
``--mbs`` on the same model, layout and data through the executor: median step time after
warm-up (slowest rank per step), tokens/s, MFU and peak memory per rank. Each is predicted
by the simulator from the profile, and the relative error is printed beside it -- the
"one IR, two interpreters" check of the design (measured and simulated traces of the same
programs). External baselines run on the same model in the same job:
``torch.distributed.pipelining`` (``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``, via :mod:`braid.baselines`; tp > 1 with DTensor tensor
parallelism) and megatron-core's interleaved 1F1B on a megatron-core GPT model with the
same weights (:mod:`braid.baselines_mcore`; reported as not installed when it is missing).

Peak memory: on GPU the allocator's peak during the step minus what was allocated before
it; on CPU the largest live saved-activation bytes at instruction ends (the executor's
memory series), compared with the simulated series sampled at the same points.

``--capture FILE`` stores the measurements with the profile they are predicted from
(``tests/test_accuracy.py`` re-predicts every stored set in CI). Examples::

    python -m braid.bench --preset tiny --pp 2 --mbs 4 8 --json out.json --trace-dir traces
    python -m braid.bench --preset 7b-layer --tp 2 --pp 1 --seq 4096 --mbs 4 8 --capture tests/data/measurements_h200.json
    python -m braid.viz traces/braided_v_m8.json -o braided_v.html
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from braid.baselines import available_baselines, baseline_label
from braid.cli import Parser, check_output_dir, check_outputs, check_plan_size, run_main
from braid.costs import CostFileError, Layout, costs_from_dict, load_cost_json
from braid.files import atomic_write_text
from braid.profile import (
    JobFailed,
    ProfileConfig,
    Progress,
    add_model_args,
    build_chunks,
    config_from_args,
    launch,
    measure_rank,
    tp_comm_for,
)
from braid.trace import Trace

log = logging.getLogger(__name__)

DEFAULT_SCHEDULES = ("braided_v", "1f1b_i", "zb_v")
PROBE_STEPS = 11  # measured steps of the calibration probe (at least --steps)
PROBE_BUSY_STEPS = 5  # recorded probe steps after the timed ones: unit busy time per phase (medians)
MEASUREMENTS_FORMAT = "braid-measurements/1"


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One bench job: what to profile/run, which schedules and micro-batch counts, how many steps."""

    profile: ProfileConfig
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    mbs: tuple[int, ...] = (4, 8)
    warmup: int = 2
    steps: int = 5
    costs: dict[str, Any] | None = None  # a cost-file dict instead of a fresh profile
    external: bool = True
    calibrate: bool = True  # fit a fresh profile to a measured probe run (see :func:`calibrate`)
    rounds: int = 1  # every run (schedules and baselines) this many times in turn; see :func:`round_ratios`


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


def predict(profile_doc: dict[str, Any], schedule: str, m: int, pp: int, tp: int, layers_per_stage: Sequence[int],
            memory: str = "instruction_end"):
    """Simulate ``schedule`` (p=pp, m) on a profile dict; returns (SimResult, per-rank predicted peak bytes).

    ``memory``: ``"instruction_end"`` (CPU measurements) or ``"allocator_peak"`` (GPU: true peak).
    """
    from braid import schedules
    from braid.compiler import compile_plan
    from braid.partition import chunk_specs
    from braid.simulator import simulate

    plan = schedules.build(schedule, pp, m)
    if len(layers_per_stage) != plan.num_stages:
        raise ValueError(f"{schedule} has {plan.num_stages} virtual stages; the profile has {len(layers_per_stage)}")
    specs = chunk_specs(tuple(layers_per_stage), pp, plan.placement)
    costs = costs_from_dict(profile_doc, Layout(tp, pp, plan.v, plan.placement), specs, where=f"profile for {schedule}")
    sim = simulate(compile_plan(plan), costs, name=schedule)
    if memory == "instruction_end":
        peaks = instruction_end_peaks(sim.trace)
    else:
        peaks = {r.rank: r.peak_activation_bytes for r in sim.report.ranks}
    return sim, [peaks.get(r, 0) for r in range(pp)]


def rel_err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else 0.0


# ----------------------------------------------------------------------------------------
# Calibration on a probe schedule
# ----------------------------------------------------------------------------------------
def probe_plan(p: int, m: int, v: int = 2):
    """A GPipe-like plan over the profiled chunks (not one of the benchmarked schedules): per rank
    all forwards chunk by chunk in stage order, then all full backwards in reverse."""
    from braid.ir import Compute, OpKind, Plan, ScheduleConfig

    placement = "v" if v == 2 else "loop"
    ranks = []
    for r in range(p):
        chunks = sorted(range(v), key=lambda c: (r if placement == "loop" else 0) + c)  # stage order on this rank
        fwd = [Compute(OpKind.F, mb, c) for c in chunks for mb in range(m)]
        bwd = [Compute(OpKind.BW, mb, c) for c in reversed(chunks) for mb in range(m)]
        ranks.append(tuple(fwd + bwd))
    return Plan("probe", ScheduleConfig(p, m, v), placement, tuple(ranks))


def _bisect(f, target: float, lo: float, hi: float, iters: int = 30) -> float:
    """The x in [lo, hi] where the increasing ``f`` reaches ``target`` (clamped to the ends)."""
    if f(lo) >= target:
        return lo
    while f(hi) < target and hi < 1e3:
        hi *= 2
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def calibrate(doc: dict[str, Any], pc: ProfileConfig, plan, measured_step_s: float,
              measured_busy_s: dict[str, float]) -> dict[str, Any]:
    """Fit the profile to one measured run of the probe plan (calibrated prediction).

    ``measured_busy_s``: seconds of unit compute per phase (``"F"``, ``"B"``, ``"W"``) in the
    probe's measured trace, summed over the ranks that recorded one. Two kinds of figures,
    written to ``meta.calibration``: ``compute_scale`` per phase -- measured unit compute in
    the pipeline over the isolated unit times (caches, launch gaps, a busy neighbour; the
    phases differ: a backward overlaps its launches better than a short forward unit) --
    then the one communication figure that explains the rest of the measured step: the
    effective P2P time (pp > 1; it absorbs the per-transfer latency of a loaded machine),
    with pp=1 and tp > 1 a scale of the all-reduce times, and with pp=1 and tp=1 the host
    time per unit task (``host_task_s``, the simulator's host lane: at pp=1 nothing but the
    host can leave the device idle). With pp > 1, where even free P2P leaves the prediction
    above the measured step, ``host_task_s`` is fitted below its profiled value too.
    """
    import copy

    from braid.compiler import compile_plan
    from braid.partition import chunk_specs
    from braid.simulator import simulate

    programs = compile_plan(plan)
    lay = Layout(pc.tp, pc.pp, plan.v, plan.placement)
    specs = chunk_specs(pc.layers_per_stage, pc.pp, plan.placement)
    def sim(d: dict[str, Any], record: bool = False):
        return simulate(programs, costs_from_dict(d, lay, specs), name="probe", record=record)

    out = copy.deepcopy(doc)
    # Nominal compute per phase: the probe's unit durations with no all-reduce slowdown.
    nominal = _busy_by_phase(sim({**doc, "ar_slowdown": 1.0}, record=True).trace)
    total_meas = sum(measured_busy_s.values())
    total_nom = sum(nominal.values())
    k_all = total_meas / total_nom if total_nom > 0 else 1.0
    scale = {}
    for ph, key in (("F", "T_F"), ("B", "T_B"), ("W", "T_W")):
        nom, meas = nominal.get(ph, 0.0), measured_busy_s.get(ph, 0.0)
        scale[ph] = meas / nom if nom > 0 and meas > 0 else k_all
        for c in out["chunks"].values():
            c[key] *= scale[ph]
    cal: dict[str, Any] = {"probe": f"{plan.name} p={plan.p} m={plan.m}", "measured_step_s": measured_step_s,
                           "profiled_host_task_s": float(doc.get("host_task_s", 0.0)),
                           "compute_scale": k_all, "compute_scale_per_phase": scale}

    def with_knob(x: float) -> dict[str, Any]:
        d = copy.deepcopy(out)
        if pc.pp == 1 and pc.tp == 1:
            d["host_task_s"] = x
            return d
        for c, base in zip(d["chunks"].values(), doc["chunks"].values()):
            if pc.pp > 1:
                c["T_P2P"] = x
            else:
                c["T_AR"], c["T_AR_B"] = base["T_AR"] * x, base["T_AR_B"] * x
        return d

    if pc.pp > 1:
        x = _bisect(lambda v: sim(with_knob(v)).report.step_time_s, measured_step_s, 0.0, 1e-3)
        out, cal["p2p_s"] = with_knob(x), x
        host = float(out.get("host_task_s", 0.0))
        if x == 0.0 and host > 0.0 and sim(out).report.step_time_s > measured_step_s:
            # Free P2P still predicts a longer step: the host lane is shorter than profiled.
            # Host-bound units stretch their own measured compute (the device waits for
            # launches inside them), so the compute scales already hold part of the host time.
            h = _bisect(lambda v: sim({**out, "host_task_s": v}).report.step_time_s, measured_step_s, 0.0, host)
            out, cal["host_task_s"] = {**out, "host_task_s": h}, h
    elif pc.tp > 1:
        x = _bisect(lambda v: sim(with_knob(v)).report.step_time_s, measured_step_s, 0.0, 2.0)
        out, cal["ar_scale"] = with_knob(x), x
    else:
        x = _bisect(lambda v: sim(with_knob(v)).report.step_time_s, measured_step_s, 0.0, 1e-3)
        out, cal["host_task_s"] = with_knob(x), x
    cal["predicted_step_s"] = sim(out).report.step_time_s
    out["meta"] = {**out.get("meta", {}), "calibration": cal}
    return out


# ----------------------------------------------------------------------------------------
# The job on every rank
# ----------------------------------------------------------------------------------------
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _data(pc: ProfileConfig, m: int, dev: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    v = pc.model.vocab_size
    toks = [torch.randint(0, v, (pc.micro_batch_size, pc.seq), generator=g).to(dev) for _ in range(m)]
    labs = [torch.randint(0, v, (pc.micro_batch_size, pc.seq), generator=g).to(dev) for _ in range(m)]
    return toks, labs


def _timed_steps(bc: BenchConfig, dev: torch.device, run_step, steps: int | None = None,
                 on_result=None) -> tuple[list[float], int, Any]:
    """Warm-up then measured steps (``steps``, default ``bc.steps``); returns (per-step seconds,
    peak bytes above the pre-step baseline, last result). ``on_result`` sees each measured step's result."""
    times, peak, res = [], 0, None
    steps = bc.steps if steps is None else steps
    for i in range(bc.warmup + steps):
        _sync(dev)
        dist.barrier()
        base = 0
        if dev.type == "cuda":
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        res = run_step()
        _sync(dev)
        dt = time.perf_counter() - t0
        if i >= bc.warmup:
            times.append(dt)
            if on_result is not None:
                on_result(res)
            if dev.type == "cuda":
                peak = max(peak, torch.cuda.max_memory_allocated(dev) - base)
    return times, peak, res


def _busy_by_phase(trace: Trace) -> dict[str, float]:
    """Seconds of unit compute per phase (F, B, W) in a measured trace."""
    out: dict[str, float] = {}
    for e in trace.events:
        if e.lane == "compute":
            out[e.kind] = out.get(e.kind, 0.0) + e.dur
    return out


def _run_schedule(d, bc: BenchConfig, groups, model, name: str, m: int, plan=None, steps: int | None = None,
                  comm=None) -> dict[str, Any]:
    from braid import schedules
    from braid.compiler import compile_plan
    from braid.runtime.executor import Executor, build_rank_chunks

    pc = bc.profile
    dev = d.device
    plan = plan or schedules.build(name, pc.pp, m)
    if plan.num_stages != len(pc.layers_per_stage):
        raise ValueError(f"{plan.num_stages} virtual stages, but --chunks gives {len(pc.layers_per_stage)}")
    program = compile_plan(plan)[groups.coords.pp]
    chunks = build_rank_chunks(model, plan, groups.coords.pp, pc.layers_per_stage, tp_rank=groups.coords.tp,
                               tp_size=pc.tp, tp_group=groups.tp if pc.tp > 1 else None)
    chunks = {c: ch.to(dev) for c, ch in chunks.items()}
    from braid.profile import _DTYPES

    kw = {} if comm is None else {"tp_comm": comm}
    ex = Executor.from_groups(plan, program, chunks, groups, d.abort, act_shape=pc.act_shape(), dtype=_DTYPES[pc.dtype],
                              device=dev, compile=pc.compile, **kw)
    toks, labs = _data(pc, m, dev)

    # Every run is timed as it trains (record="off": no clocks, no unit events, and fused
    # chunks take one call per op); recorded steps after it give its trace (one step) or, for
    # the calibration probe, the unit busy time per phase (PROBE_BUSY_STEPS steps, medians).
    def step(record="off"):
        for ch in chunks.values():
            ch.zero_grad(set_to_none=False)
        return ex.run(toks, labs, record=record)

    times, peak, _ = _timed_steps(bc, dev, step, steps)
    busy: list[dict[str, float]] = []
    for _ in range(PROBE_BUSY_STEPS if name == "probe" else 1):
        _sync(dev)
        dist.barrier()
        res = step("units")
        busy.append(_busy_by_phase(res.trace))
    if dev.type != "cuda":
        peak = res.trace.peak_memory(groups.coords.pp)
    keep = groups.coords.tp == 0
    return {"times": times, "peak": peak, "loss": res.loss, "trace": res.trace if keep else None, "busy": busy if keep else None}


def _run_external(d, bc: BenchConfig, groups, model, name: str, m: int) -> dict[str, Any]:
    """One external baseline (torch.distributed.pipelining, megatron-core) on the same model split (:mod:`braid.baselines`)."""
    from braid.baselines import baseline_pipeline
    from braid.profile import _DTYPES

    pc = bc.profile
    dev = d.device
    pipe = baseline_pipeline(name, model, pc.layers_per_stage, m, groups=groups, device=dev, dtype=_DTYPES[pc.dtype],
                             seq_len=pc.seq)
    toks, labs = _data(pc, m, dev)
    x, y = torch.cat(toks), torch.cat(labs)

    def step():
        for mod in pipe.modules:
            mod.zero_grad(set_to_none=False)
        return pipe.step((x,), y)

    times, peak, _ = _timed_steps(bc, dev, step)
    return {"times": times, "peak": peak if dev.type == "cuda" else None}


def _bench_job(d, bc: BenchConfig) -> dict[str, Any] | None:
    from braid.models.qwen2 import Qwen2Model
    from braid.profile import _DTYPES, assemble, profile_to_dict
    from braid.runtime.distributed import ProcessGroups
    from braid.topology import Topology

    pc = bc.profile
    groups = ProcessGroups.create(Topology(pc.world_size, pp=pc.pp, tp=pc.tp),
                                  tp_backend="auto" if pc.tp_backend == "all" else pc.tp_backend)
    lead = d.rank == 0
    doc = bc.costs
    raw_doc = None
    # The TP all-reduce every run uses: the flag's backend, or with 'all' the profile's pick.
    comm, choice = tp_comm_for(pc, groups, d.device)
    if doc is None:
        res = measure_rank(d, pc, groups, build_chunks(pc, groups, d.device), comm, choice)
        gathered: list[Any] = [None] * pc.world_size
        dist.all_gather_object(gathered, res)
        doc = raw_doc = profile_to_dict(assemble(pc, gathered))
    torch.manual_seed(1234)
    with torch.device("cpu"):
        model = Qwen2Model(pc.full_model()).to(_DTYPES[pc.dtype])
    if bc.costs is None and bc.calibrate:
        # The probe is short (m = 2p): more steps than a benchmarked run, medians of the step
        # time and of each phase's busy time, so one slow step on a shared machine does not
        # land in the fitted communication figure.
        plan = probe_plan(pc.pp, 2 * pc.pp, pc.v)
        out = _run_schedule(d, bc, groups, model, "probe", plan.m, plan, steps=max(PROBE_STEPS, bc.steps), comm=comm)
        gathered = [None] * pc.world_size
        dist.all_gather_object(gathered, out)
        if lead:
            step_s = statistics.median(_slowest_rank_steps(gathered))
            per_step = [{ph: sum(rk["busy"][i].get(ph, 0.0) for rk in gathered if rk["busy"] is not None) for ph in "FBW"}
                        for i in range(len(out["busy"]))]
            busy = {ph: statistics.median(b[ph] for b in per_step) for ph in "FBW"}
            doc = calibrate(doc, pc, plan, step_s, busy)
    runs, notes = [], []
    jobs = [(n, m) for n in bc.schedules for m in bc.mbs]
    ext = [(c, m) for c in available_baselines() for m in bc.mbs] if bc.external else []
    progress = Progress(bc.rounds * (len(jobs) + len(ext)), "bench", enabled=lead)
    external = []
    skip: set[tuple[str, int]] = set()  # runs that cannot run are tried in the first round only
    for rnd in range(bc.rounds):
        tag = f" (round {rnd + 1}/{bc.rounds})" if bc.rounds > 1 else ""
        for name, m in jobs:
            if (name, m) in skip:
                progress.step(f"{name} m={m} skipped")
                continue
            try:
                out = _run_schedule(d, bc, groups, model, name, m, comm=comm)
            except ValueError as err:
                notes.append(f"skipped {name} m={m}: {err}")
                skip.add((name, m))
                progress.step(f"{name} m={m} skipped")
                continue
            gathered = [None] * pc.world_size
            dist.all_gather_object(gathered, out)
            runs.append({"schedule": name, "m": m, "round": rnd, "ranks": gathered})
            progress.step(f"{name} m={m}{tag}")
        for name, m in ext:
            if (name, m) in skip:
                progress.step(f"{baseline_label(name)} m={m} could not run")
                continue
            try:
                out = _run_external(d, bc, groups, model, name, m)
                err = None
            except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
                out, err = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            gathered = [None] * pc.world_size
            dist.all_gather_object(gathered, (out, err))
            errs = sorted({e for _, e in gathered if e})
            if errs:
                external.append({"schedule": baseline_label(name), "m": m, "round": rnd, "error": errs[0]})
                skip.add((name, m))
            else:
                external.append({"schedule": baseline_label(name), "m": m, "round": rnd, "ranks": [o for o, _ in gathered]})
            progress.step(f"{baseline_label(name)} m={m}{tag}")
    # The uncalibrated profile travels too: its predictions are reported beside the calibrated
    # ones, so the raw model's error stays visible.
    raw = raw_doc if raw_doc is not doc else None
    if pc.tp > 1:
        notes.append(f"TP all-reduce backend: {comm.backend}"
                     + (" (chosen by measuring " + ", ".join(choice["backends"]) + ")" if choice else ""))
    return {"profile": doc, "raw_profile": raw, "runs": runs, "external": external, "notes": notes} if lead else None


# ----------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------
def _megatron_line() -> str:
    from braid import megatron

    if not megatron.available():
        return "megatron-core interleaved 1F1B: not installed (pip install -e '.[megatron]' to compare against it)"
    return ("megatron-core interleaved 1F1B ('mcore:' rows): its GPT model (local layer spec, SDPA attention) "
            "with the same weights; its no-pipelining schedule at pp=1")


def summarize(bc: BenchConfig, raw: dict[str, Any]) -> dict[str, Any]:
    """Measured vs predicted figures per run (the ``--json`` document)."""
    pc = bc.profile
    doc = raw["profile"]
    memory = "allocator_peak" if pc.device == "cuda" else "instruction_end"
    tokens = pc.seq * pc.micro_batch_size
    flops = doc.get("model_flops_per_sample", 0.0)
    out_runs = []
    traces = {}
    by_round = _round_steps(raw["runs"])
    for r in raw["runs"]:
        if r.get("round", 0) != 0:
            continue  # later rounds only add step times (step_s_rounds)
        ranks = r["ranks"]
        rounds = by_round[(r["schedule"], r["m"])]
        step_s = statistics.median(rounds)
        # one figure per pipeline rank: the max over its TP ranks (global rank = pp * tp + tp_rank)
        peaks = [max(ranks[p * pc.tp + t]["peak"] for t in range(pc.tp)) for p in range(pc.pp)]
        sim, pred_peaks = predict(doc, r["schedule"], r["m"], pc.pp, pc.tp, pc.layers_per_stage, memory)
        pred = sim.report.step_time_s
        raw_pred = None
        if raw.get("raw_profile") is not None:
            raw_pred = predict(raw["raw_profile"], r["schedule"], r["m"], pc.pp, pc.tp, pc.layers_per_stage, memory)[0].report.step_time_s
        mfu = r["m"] * pc.micro_batch_size * flops / (step_s * pc.world_size * pc.peak_flops) if pc.peak_flops else 0.0
        out_runs.append({"schedule": r["schedule"], "m": r["m"], "step_s": step_s, "step_s_rounds": rounds,
                         "step_s_all": _slowest_rank_steps(ranks),
                         "tokens_per_s": r["m"] * tokens / step_s, "mfu": mfu, "peak_bytes": peaks,
                         "predicted_step_s": pred, "step_err": rel_err(pred, step_s), "predicted_peak_bytes": pred_peaks,
                         "raw_predicted_step_s": raw_pred,
                         "raw_step_err": rel_err(raw_pred, step_s) if raw_pred is not None else None,
                         "peak_err": max((abs(rel_err(p, q)) for p, q in zip(pred_peaks, peaks)), default=0.0),
                         "loss": next((rk["loss"] for rk in ranks if rk["loss"] is not None), None)})
        measured = [rk["trace"] for rk in ranks if rk["trace"] is not None]
        merged = Trace({"schedule": r["schedule"], "source": "measured", "m": r["m"], "device": pc.device},
                       [e for t in measured for e in t.events], {k: v for t in measured for k, v in t.memory.items()})
        traces[f"{r['schedule']}_m{r['m']}"] = (sim.trace, merged)
    ext = []
    ext_rounds = _round_steps([e for e in raw["external"] if "error" not in e])
    for e in raw["external"]:
        if e.get("round", 0) != 0:
            continue
        if "error" in e:
            ext.append({k: v for k, v in e.items() if k != "round"})
            continue
        rk = e["ranks"]
        rounds = ext_rounds[(e["schedule"], e["m"])]
        step_s = statistics.median(rounds)
        peaks = [x["peak"] for x in rk] if rk[0]["peak"] is not None else None
        ext.append({"schedule": e["schedule"], "m": e["m"], "step_s": step_s, "step_s_rounds": rounds,
                    "tokens_per_s": e["m"] * tokens / step_s, "peak_bytes": peaks})
    cfg = {**asdict(pc), "model": asdict(pc.model), "schedules": list(bc.schedules), "mbs": list(bc.mbs),
           "warmup": bc.warmup, "steps": bc.steps, "rounds": bc.rounds}
    return {"config": cfg, "device": doc.get("meta", {}).get("device"), "memory": memory, "runs": out_runs,
            "external": ext, "best_over_external": round_ratios(out_runs, ext),
            "notes": raw["notes"] + [_megatron_line()], "profile": doc, "_traces": traces}


def _slowest_rank_steps(ranks: list[dict[str, Any]]) -> list[float]:
    """Each measured step's time: that of its slowest rank (every rank reports ``times``)."""
    return [max(rk["times"][i] for rk in ranks) for i in range(len(ranks[0]["times"]))]


def _round_steps(runs: list[dict[str, Any]]) -> dict[tuple[str, int], list[float]]:
    """Per (schedule, m), the median step of each round, in round order."""
    out: dict[tuple[str, int], list[float]] = {}
    for r in sorted(runs, key=lambda r: r.get("round", 0)):
        out.setdefault((r["schedule"], r["m"]), []).append(statistics.median(_slowest_rank_steps(r["ranks"])))
    return out


def round_ratios(runs: list[dict[str, Any]], external: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per m: braid's best schedule over the best external baseline, as tokens/s, taken within
    each round (every run of a round ran in turn, so a host that drifts between rounds moves
    both sides): ``{m: {"rounds": [...], "median": .., "min": .., "max": ..}}``. Only for m
    with both sides measured in every round."""
    out: dict[int, dict[str, Any]] = {}
    for m in sorted({r["m"] for r in runs}):
        ours = [r["step_s_rounds"] for r in runs if r["m"] == m]
        theirs = [e["step_s_rounds"] for e in external if e["m"] == m and "step_s_rounds" in e]
        if not ours or not theirs:
            continue
        n = min(len(x) for x in ours + theirs)
        ratios = [min(t[i] for t in theirs) / min(o[i] for o in ours) for i in range(n)]
        out[m] = {"rounds": ratios, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def format_report(summary: dict[str, Any]) -> str:
    """The text table: one line per run, measured next to predicted."""
    head = (f"{'schedule':<28}{'m':>3}{'step ms':>10}{'pred ms':>10}{'err %':>8}{'raw %':>8}{'tokens/s':>11}{'MFU %':>7}"
            f"  peak MiB per rank (measured / predicted)")
    lines = [head, "-" * len(head)]
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    for r in summary["runs"]:
        peaks = " ".join(f"{mib(a)}/{mib(b)}" for a, b in zip(r["peak_bytes"], r["predicted_peak_bytes"]))
        raw_err = f"{100 * r['raw_step_err']:>+8.1f}" if r.get("raw_step_err") is not None else f"{'-':>8}"
        lines.append(f"{r['schedule']:<28}{r['m']:>3}{r['step_s'] * 1e3:>10.2f}{r['predicted_step_s'] * 1e3:>10.2f}"
                     f"{100 * r['step_err']:>+8.1f}{raw_err}{r['tokens_per_s']:>11.0f}{100 * r['mfu']:>7.1f}  {peaks}")
    for e in summary["external"]:
        if "error" in e:
            lines.append(f"{e['schedule']:<28}{e['m']:>3}  could not run: {e['error']}")
        else:
            peaks = " ".join(mib(b) for b in e["peak_bytes"]) if e["peak_bytes"] else "-"
            lines.append(f"{e['schedule']:<28}{e['m']:>3}{e['step_s'] * 1e3:>10.2f}{'-':>10}{'-':>8}{'-':>8}{e['tokens_per_s']:>11.0f}"
                         f"{'-':>7}  {peaks}")
    for m, b in sorted(summary.get("best_over_external", {}).items()):
        n = len(b["rounds"])
        spread = f" [{b['min']:.3f}, {b['max']:.3f}] over {n} rounds" if n > 1 else " (one round; --rounds N gives a spread)"
        lines.append(f"braid's best / best external baseline at m={m} (tokens/s, within a round): {b['median']:.3f}x{spread}")
    cal = summary["profile"].get("meta", {}).get("calibration")
    if cal:
        fitted = {k: v for k, v in cal.items() if k in ("p2p_s", "ar_scale", "host_task_s")}
        scales = " ".join(f"{ph}={v:.3f}" for ph, v in cal.get("compute_scale_per_phase", {}).items())
        lines.append(f"calibration ({cal['probe']}): compute scale {scales}; "
                     f"host time per unit task profiled {cal.get('profiled_host_task_s', 0.0) * 1e6:.0f} us; "
                     + (", ".join(f"{k}={v:.4g}" for k, v in fitted.items()) or "no communication figure")
                     + "; 'raw %' is the uncalibrated profile's error")
    lines += [f"note: {n}" for n in summary["notes"]]
    return "\n".join(lines)


def read_measurements(path: str | Path) -> dict[str, Any]:
    """A stored-measurements file (``braid-measurements/1``), or an empty one if ``path`` does not exist;
    a file that is not one is a ``ValueError`` naming it."""
    p = Path(path)
    if not p.exists():
        return {"format": MEASUREMENTS_FORMAT, "sets": []}
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise ValueError(f"{p}: not a readable measurements file ({type(err).__name__}: {err})"[:400]) from None
    fmt = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
    if fmt != MEASUREMENTS_FORMAT or not isinstance(doc.get("sets"), list):
        raise ValueError(f"{p}: not a measurements file (format={fmt!r}, expected {MEASUREMENTS_FORMAT!r} with a 'sets' list)")
    return doc


def capture(summary: dict[str, Any], path: str | Path, name: str) -> None:
    """Add (or replace) the set ``name`` in a stored-measurements file (``braid-measurements/1``),
    written atomically: a run killed while capturing leaves the previous file whole."""
    p = Path(path)
    doc = read_measurements(p)
    cfg = summary["config"]
    import os

    entry = {"name": name, "device": summary["device"], "memory": summary["memory"],
             # runnable processes per core over the last minute when captured: > 1 means the
             # machine was oversubscribed and the step times are not a timing reference
             "load_per_core": os.getloadavg()[0] / (os.cpu_count() or 1),
             "layout": {"tp": cfg["tp"], "pp": cfg["pp"], "v": cfg["v"], "layers_per_stage": list(cfg["layers_per_stage"])},
             "model": cfg["model"], "seq": cfg["seq"], "micro_batch_size": cfg["micro_batch_size"], "dtype": cfg["dtype"],
             "runs": [{k: r[k] for k in ("schedule", "m", "step_s", "step_s_all", "peak_bytes")} for r in summary["runs"]],
             "profile": summary["profile"]}
    doc["sets"] = [s for s in doc["sets"] if s.get("name") != name] + [entry]
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p, json.dumps(doc, indent=1))


def run_bench(bc: BenchConfig) -> dict[str, Any]:
    """Spawn the ranks, profile (unless costs were given), run and summarise."""
    raw = launch(bc.profile.world_size, bc.profile.device, _bench_job, bc)[0]
    return summarize(bc, raw)


def planned_runs(bc: BenchConfig) -> tuple[list[tuple[str, int, Any]], list[str]]:
    """The ``(schedule, m, plan)`` runs the layout accepts, and a note for each it does not."""
    from braid import schedules

    pc = bc.profile
    runs, notes = [], []
    for name in bc.schedules:
        for m in bc.mbs:
            try:
                plan = schedules.build(name, pc.pp, m)
            except ValueError as err:
                notes.append(f"{name} m={m}: {err}")
                continue
            if plan.num_stages != len(pc.layers_per_stage):
                notes.append(f"{name} m={m}: {plan.num_stages} virtual stages, but the layout has "
                             f"{len(pc.layers_per_stage)} (--pp x --chunks)")
                continue
            runs.append((name, m, plan))
    return runs, notes


def _check_costs(doc: dict[str, Any], where: str, pc: ProfileConfig, runs: list[tuple[str, int, Any]]) -> None:
    """Read ``doc`` against every planned run's layout, as the predictions will (CostFileError if it does not fit)."""
    from braid.partition import chunk_specs

    for placement, v in sorted({(plan.placement, plan.v) for _, _, plan in runs}):
        costs_from_dict(doc, Layout(pc.tp, pc.pp, v, placement), chunk_specs(pc.layers_per_stage, pc.pp, placement), where=where)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; bad input is one line on stderr and exit 2, before any process starts."""
    from braid import schedules

    ap = Parser(prog="python -m braid.bench", description=__doc__.split("\n\n")[1],
                epilog="Examples:\n" + __doc__.split("Examples::")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--schedule", nargs="+", default=list(DEFAULT_SCHEDULES), help=f"schedules (default {' '.join(DEFAULT_SCHEDULES)})")
    ap.add_argument("--mbs", type=int, nargs="+", default=[4, 8], help="micro-batch counts m (default 4 8)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps; the median is reported (default 5)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every schedule and baseline this many times in turn and report braid's best over the "
                         "best baseline per round, median [min, max] (default 1)")
    ap.add_argument("--costs", metavar="FILE", help="predict from this cost file instead of a fresh profile")
    ap.add_argument("--no-calibrate", action="store_true", help="predict from the raw profile (no probe-run calibration)")
    ap.add_argument("--no-external", action="store_true", help="skip the external baselines (torch.distributed.pipelining; megatron-core when installed)")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("--trace-dir", metavar="DIR", help="write <schedule>_m<m>.json (simulated + measured trace) per run")
    ap.add_argument("--capture", metavar="FILE", help="add this run's measurements and profile to a stored set file")
    ap.add_argument("--capture-name", default=None, help="name of the stored set (default <device>-tp<t>-pp<p>)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = schedules.names()
    bad = [s for s in args.schedule if s not in names]
    if bad:
        ap.error(f"unknown schedule {bad[0]!r}; valid names: {', '.join(names)}")
    if min(args.mbs) < 1 or args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        ap.error("--mbs, --steps and --rounds must be >= 1, --warmup >= 0")
    pc = config_from_args(ap, args)
    check_plan_size(ap, pc.pp, max(args.mbs))
    check_outputs(ap, [("--json", args.json), ("--capture", args.capture)], inputs=[args.costs] if args.costs else [])
    check_output_dir(ap, "--trace-dir", args.trace_dir)
    bc = BenchConfig(pc, tuple(args.schedule), tuple(args.mbs), args.warmup, args.steps, None, not args.no_external,
                     not args.no_calibrate, args.rounds)
    runs, skipped = planned_runs(bc)
    if not runs:
        ap.error(f"no run fits this layout: {skipped[0]}" + (f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""))
    if args.costs:
        try:
            costs = load_cost_json(args.costs)
            _check_costs(costs, args.costs, pc, runs)
        except CostFileError as err:
            ap.error(str(err))
        bc = dataclasses.replace(bc, costs=costs)
    if args.capture:
        try:
            read_measurements(args.capture)
        except ValueError as err:
            ap.error(f"--capture {err}")
    try:
        summary = run_bench(bc)
    except JobFailed as err:
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        return 1
    traces = summary.pop("_traces")
    print(f"# {args.preset}: tp={pc.tp} pp={pc.pp} v={pc.v} layers/stage={','.join(map(str, pc.layers_per_stage))} "
          f"seq={pc.seq} on {summary['device']} ({pc.dtype})")
    print(format_report(summary))
    if args.json:
        atomic_write_text(args.json, json.dumps(summary, indent=1))
    if args.trace_dir:
        from braid.trace import dump_traces

        out = Path(args.trace_dir)
        out.mkdir(parents=True, exist_ok=True)
        for key, pair in traces.items():
            dump_traces(list(pair), out / f"{key}.json")
    if not summary["runs"]:
        print(f"{ap.prog}: error: every run was skipped (see the notes above)", file=sys.stderr)
        return 1
    if args.capture:
        capture(summary, args.capture, args.capture_name or f"{pc.device}-tp{pc.tp}-pp{pc.pp}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
