"""Re-fit a stored ``braid.bench --json`` run's calibration with the current :func:`braid.measure.calibrate.calibrate`
and print each schedule's measured step beside the stored and the re-fitted prediction.

The stored profile is the calibrated one; the uncalibrated profile is rebuilt from it (the
per-phase compute scales divided out, the profiled host time per unit task restored) and the
probe's measured busy time per phase from those scales, so no device is needed. Use it to
check a change to the calibration against runs measured on hardware that is not at hand:

    PYTHONPATH=. python benchmarks/recalibrate_stored.py benchmarks/results/bench_small_h200x2_tp1_pp2.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from typing import Any

from braid.simulator import simulate

from braid.core.compiler import compile_plan
from braid.core.partition import chunk_specs
from braid.cost.costs import Layout, costs_from_dict
from braid.measure.calibrate import busy_by_phase, calibrate, predict, probe_plan
from braid.measure.config import ProfileConfig
from braid.models.qwen2 import Qwen2Config


def refit(summary: dict[str, Any]) -> list[tuple[str, int, float, float, float]]:
    """(schedule, m, measured s, stored prediction s, re-fitted prediction s) per run of one bench summary."""
    prof, c = summary["profile"], summary["config"]
    cal = prof.get("meta", {}).get("calibration")
    if not cal:
        raise ValueError("the run was not calibrated (--no-calibrate or --costs): nothing to re-fit")
    pc = ProfileConfig(Qwen2Config(**c["model"]), tuple(c["layers_per_stage"]), seq=c["seq"],
                       micro_batch_size=c["micro_batch_size"], tp=c["tp"], pp=c["pp"], v=c["v"], placement=c["placement"])
    raw = copy.deepcopy(prof)
    raw["meta"] = {k: v for k, v in prof["meta"].items() if k != "calibration"}
    raw["host_task_s"] = cal["profiled_host_task_s"]
    scale = cal["compute_scale_per_phase"]
    for ch in raw["chunks"].values():
        for ph in ("F", "B", "W"):
            ch[f"T_{ph}"] /= scale[ph]
    plan = probe_plan(pc.pp, 2 * pc.pp, pc.v)
    lay, specs = Layout(pc.tp, pc.pp, plan.v, plan.placement), chunk_specs(pc.layers_per_stage, pc.pp, plan.placement)
    nominal = busy_by_phase(simulate(compile_plan(plan), costs_from_dict({**raw, "ar_slowdown": 1.0}, lay, specs), record=True).trace)
    new = calibrate(raw, pc, plan, cal["measured_step_s"], {ph: t * scale[ph] for ph, t in nominal.items()})
    return [(r["schedule"], r["m"], r["step_s"], r["predicted_step_s"],
             predict(new, r["schedule"], r["m"], pc.pp, pc.tp, pc.layers_per_stage)[0].report.step_time_s)
            for r in summary["runs"]]


def _summaries(doc: Any) -> list[dict[str, Any]]:
    """The bench summaries in a loaded file: the file itself, or its ``runs`` list of them
    (empty when it is neither)."""
    if not isinstance(doc, dict):
        return []
    found = [doc] if "profile" in doc else doc.get("runs", [])
    ok = isinstance(found, list) and all(isinstance(x, dict) and "profile" in x and "runs" in x for x in found)
    return found if ok else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="braid.bench --json files, or a file with a 'runs' list of them")
    a = ap.parse_args(argv)
    old_err, new_err = [], []
    for f in a.files:
        try:
            doc = json.load(open(f))
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"{f}: cannot read it as JSON ({e})")
        summaries = _summaries(doc)
        if not summaries:
            ap.error(f"{f}: not a braid.bench --json file (or a file with a 'runs' list of them)")
        for i, s in enumerate(summaries):
            print(f"# {f} [{i}]")
            try:
                rows = refit(s)
            except ValueError as e:
                ap.error(f"{f} [{i}]: {e}")
            for name, m, meas, old, new in rows:
                old_err.append(old / meas - 1)
                new_err.append(new / meas - 1)
                print(f"{name:<12}{m:>3}  measured {meas * 1e3:7.1f} ms  stored prediction {old * 1e3:7.1f} ({old_err[-1]:+.0%})"
                      f"  re-fitted {new * 1e3:7.1f} ({new_err[-1]:+.0%})")
    if not old_err:
        print("no runs", file=sys.stderr)
        return 1
    mean_abs = lambda e: statistics.fmean(abs(x) for x in e)  # noqa: E731
    print(f"mean |error| over {len(old_err)} runs: stored {mean_abs(old_err):.1%}, re-fitted {mean_abs(new_err):.1%}; "
          f"median error: stored {statistics.median(old_err):+.1%}, re-fitted {statistics.median(new_err):+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
