"""Re-fit a stored run's calibration offline and judge its predictions against the measured steps.

A stored run is either a ``braid.bench --json`` summary or a set of a ``braid-measurements/1``
file (``--capture``). What :func:`braid.measure.calibrate.calibrate` needs is read from it:

* the profile before calibration: ``raw_profile`` where it was stored; otherwise rebuilt
  from the calibrated profile, whose ``unit_split`` keeps the profiler's own per-unit
  times (the calibration scales only the chunk totals ``T_F``, ``T_B``, ``T_W``, ``T_AR``,
  ``T_AR_B``), with the profiled host time per unit task restored;
* the probe's measured step and busy time per phase (``meta.calibration``; sets stored
  before ``measured_busy_s`` was kept: the fitted per-phase scales times the busy time the
  calibration of that day simulated, with no all-reduce slowdown);
* how the probe ran (``probe_runs.cuda_graph``; else the runs' own ``cuda_graph``; else the
  set's ``cuda_graph``, which a set captured before the runs kept their mode may be given
  by hand: ``"step"`` for whole-step graphs; else eager).

:func:`judge` gives the figures the accuracy targets are about: per run the relative
step-time error, the median and worst of their magnitudes, the pairs of one m more than
:data:`~braid.measure.report.RANK_GAP` apart that the prediction orders the other way, and
the fitted factors.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

from braid.cost.costs import Layout, costs_from_dict
from braid.measure.calibrate import (
    busy_by_phase,
    calibrate,
    fitted_factors,
    predict,
    probe_mbs,
    probe_plan,
    rel_err,
)
from braid.measure.config import ProfileConfig

SPLIT_TOTALS = {"F": "T_F", "B": "T_B", "W": "T_W", "AR": "T_AR", "AR_B": "T_AR_B"}


def profile_config(entry: dict[str, Any]) -> ProfileConfig:
    """The layout and model of a bench summary (``config``) or a stored set (``layout``, ``model``, ...)."""
    from braid.models.registry import config_from_fields

    if "config" in entry:
        c = entry["config"]
        return ProfileConfig(config_from_fields(c["model"]), tuple(c["layers_per_stage"]), seq=c["seq"],
                             micro_batch_size=c["micro_batch_size"], tp=c["tp"], pp=c["pp"], v=c["v"], placement=c["placement"],
                             ep=c.get("ep", 1), moe_dispatch=c.get("moe_dispatch", "splits"))
    lay = entry["layout"]
    placement = entry["profile"].get("layout", {}).get("placement", "v" if lay["v"] == 2 else "loop")
    return ProfileConfig(config_from_fields(entry["model"]), tuple(lay["layers_per_stage"]), seq=entry["seq"],
                         micro_batch_size=entry["micro_batch_size"], tp=lay["tp"], pp=lay["pp"], v=lay["v"], placement=placement,
                         ep=lay.get("ep", 1))


def calibration_inputs(entry: dict[str, Any]) -> tuple[dict[str, Any], float, dict[str, float], dict[str, Any]]:
    """(profile before calibration, probe's measured step, its busy time per phase, probe evidence)
    of a stored run; ``ValueError`` if it was not calibrated."""
    from braid.core.compiler import compile_plan
    from braid.cost.costs import ChunkCosts
    from braid.simulator import simulate

    prof = entry["profile"]
    cal = prof.get("meta", {}).get("calibration")
    if not cal:
        raise ValueError("the run was not calibrated (--no-calibrate or --costs): nothing to re-fit")
    pc = profile_config(entry)
    plan = probe_plan(pc.pp, probe_mbs(pc.pp, cal), pc.v)
    specs = pc.specs(plan.placement)
    raw = entry.get("raw_profile")
    if raw is None:
        raw = copy.deepcopy(prof)
        raw["meta"] = {k: v for k, v in prof["meta"].items() if k != "calibration"}
        raw["host_task_s"] = cal.get("profiled_host_task_s", prof.get("host_task_s", 0.0))
        scale = cal.get("compute_scale_per_phase") or {ph: cal["compute_scale"] for ph in "FBW"}
        lay = Layout(pc.tp, pc.pp, plan.v, plan.placement)
        for key, ch in raw["chunks"].items():
            rc = next(rc for rc in specs if str(_stage(lay, rc)) == key or f"{rc[0]},{rc[1]}" == key)
            inst = ChunkCosts(specs[rc], {}).instances()
            split = ch.get("unit_split") or {}
            for part, total in SPLIT_TOTALS.items():
                if part in split:  # the profiler's per-unit times, untouched by the calibration
                    ch[total] = sum(split[part].get(u.value, 0.0) for u in inst)
                elif part in scale:
                    ch[total] /= cal.get("compute_scale_per_stage", {}).get(key, scale)[part]
    busy = cal.get("measured_busy_s")
    if busy is None:  # stored before it was kept: the scales times the busy time they were fitted against
        lay = Layout(pc.tp, pc.pp, plan.v, plan.placement)
        nominal = busy_by_phase(simulate(compile_plan(plan), costs_from_dict({**raw, "ar_slowdown": 1.0}, lay, specs),
                                         record=True).trace)
        scale = cal.get("compute_scale_per_phase") or {ph: cal["compute_scale"] for ph in "FBW"}
        busy = {ph: t * scale[ph] for ph, t in nominal.items()}
    probe = dict(cal.get("probe_runs") or {})
    if "cuda_graph" not in probe:
        modes = {run_mode(entry, r) for r in entry["runs"]}
        probe["cuda_graph"] = "step" if modes == {"step"} else "none"
    return raw, cal["measured_step_s"], busy, probe


def run_mode(entry: dict[str, Any], run: dict[str, Any]) -> str:
    """How a stored run went: its ``cuda_graph``, else its set's, else ``"none"`` (eager)."""
    return run.get("cuda_graph") or entry.get("cuda_graph") or "none"


def _stage(lay: Layout, rc: tuple[int, int]) -> int:
    from braid.core.ir import stage_of

    return stage_of(lay.placement, lay.p, *rc)


def refit(entry: dict[str, Any]) -> dict[str, Any]:
    """The profile a stored run's probe gives under the current calibration."""
    raw, step_s, busy, probe = calibration_inputs(entry)
    pc = profile_config(entry)
    cal = entry["profile"]["meta"]["calibration"]
    return calibrate(raw, pc, probe_plan(pc.pp, probe_mbs(pc.pp, cal), pc.v), step_s, busy, probe)


def judge(entry: dict[str, Any], profile: dict[str, Any], gap: float | None = None) -> dict[str, Any]:
    """Predict every run of a stored run from ``profile``; the errors, ranking and fitted factors."""
    from braid.measure.report import RANK_GAP, ranking

    pc = profile_config(entry)
    runs = []
    for r in entry["runs"]:
        pred = predict(profile, r["schedule"], r["m"], pc.pp, pc.tp, pc.layers_per_stage, cuda_graph=run_mode(entry, r),
                       vision=pc.vision is not None, moe_layers=pc.moe_layers)[0].report.step_time_s
        runs.append({"schedule": r["schedule"], "m": r["m"], "step_s": r["step_s"], "predicted_step_s": pred,
                     "err": rel_err(pred, r["step_s"])})
    errs = [abs(r["err"]) for r in runs]
    wrong = [(m, *w) for m, rk in ranking(runs, RANK_GAP if gap is None else gap).items() for w in rk["wrong"]]
    cal = profile.get("meta", {}).get("calibration", {})
    return {"runs": runs, "median_abs_err": statistics.median(errs) if errs else 0.0, "worst_abs_err": max(errs, default=0.0),
            "ranked_wrong": wrong, "factors": fitted_factors(cal), "calibration": cal}


def stored_set(summary: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    """A ``braid.bench --json`` summary as a stored set (``braid-measurements/1``), for a run
    measured before ``--capture`` kept what a re-fit needs: the rebuilt uncalibrated profile and
    the profile re-fitted by the current calibration. ``load_per_core`` is left out (it was
    not recorded on the machine that ran it); ``converted_from`` names ``source``."""
    from braid.measure.report import set_entry

    raw = calibration_inputs(summary)[0]
    entry = set_entry({**summary, "profile": refit(summary), "raw_profile": raw}, name)
    del entry["load_per_core"]
    return {**entry, "converted_from": source}
