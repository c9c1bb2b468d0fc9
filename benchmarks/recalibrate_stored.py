"""Re-fit stored runs' calibration with the current :func:`braid.measure.calibrate.calibrate`
and print, per stored run, each schedule's measured step beside the stored and the re-fitted
prediction, the median and worst |error|, the fitted factors, and whether every pair of
schedules more than 3% apart is ranked right (the accuracy targets of ``docs/bench.md``).

Reads ``braid.bench --json`` files (or a file with a ``runs`` list of them) and stored sets
(``braid-measurements/1``, ``--capture``); the inputs of the re-fit come from the stored run
(:mod:`braid.measure.refit`), so no device is needed. Use it to check a change to the
calibration against runs measured on hardware that is not at hand:

    PYTHONPATH=. python benchmarks/recalibrate_stored.py benchmarks/results/bench_7b_h100x2_tp2_pp1_graphs.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from braid.measure.calibrate import SCALE_BOUNDS, predict
from braid.measure.refit import judge, profile_config, stored_set
from braid.measure.refit import refit as refit_profile
from braid.measure.report import add_set

TARGET_MEDIAN, TARGET_WORST = 0.05, 0.10


def refit(summary: dict[str, Any]) -> list[tuple[str, int, float, float, float]]:
    """(schedule, m, measured s, stored prediction s, re-fitted prediction s) per run of one stored run."""
    pc = profile_config(summary)
    new = judge(summary, refit_profile(summary))
    out = []
    for r, n in zip(summary["runs"], new["runs"]):
        old = r.get("predicted_step_s")
        if old is None:
            old = predict(summary["profile"], r["schedule"], r["m"], pc.pp, pc.tp, pc.layers_per_stage,
                          cuda_graph=r.get("cuda_graph"))[0].report.step_time_s
        out.append((r["schedule"], r["m"], r["step_s"], old, n["predicted_step_s"]))
    return out


def _summaries(doc: Any) -> list[dict[str, Any]]:
    """The stored runs in a loaded file: the file itself, its ``runs`` list of bench summaries,
    or its ``sets`` (empty when it is none of these)."""
    if not isinstance(doc, dict):
        return []
    found = [doc] if "profile" in doc else doc.get("sets", doc.get("runs", []))
    ok = isinstance(found, list) and all(isinstance(x, dict) and "profile" in x and "runs" in x for x in found)
    return found if ok else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="braid.bench --json files, files with a 'runs' list of them, or stored sets")
    ap.add_argument("--store", metavar="FILE", help="add the (one) bench summary read, re-fitted, as a stored set to FILE "
                    "(braid-measurements/1): for a run measured before --capture kept what a re-fit needs")
    ap.add_argument("--name", help="the stored set's name (with --store)")
    a = ap.parse_args(argv)
    if a.store and not a.name:
        ap.error("--store needs --name")
    n = 0
    all_ok = True
    for f in a.files:
        try:
            doc = json.load(open(f))
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"{f}: cannot read it as JSON ({e})")
        summaries = _summaries(doc)
        if not summaries:
            ap.error(f"{f}: not a braid.bench --json file, a file with a 'runs' list of them, or a measurements file")
        for i, s in enumerate(summaries):
            print(f"# {f} [{s.get('name', i)}]")
            try:
                rows = refit(s)
                j = judge(s, refit_profile(s))
            except (ValueError, KeyError) as e:
                ap.error(f"{f} [{i}]: {e}")
            for name, m, meas, old, new in rows:
                n += 1
                print(f"{name:<12}{m:>3}  measured {meas * 1e3:7.1f} ms  stored prediction {old * 1e3:7.1f} ({old / meas - 1:+.1%})"
                      f"  re-fitted {new * 1e3:7.1f} ({new / meas - 1:+.1%})")
            cal = j["calibration"]
            fitted = {k: cal[k] for k in ("p2p_s", "host_task_s", "compute_factor") if k in cal}
            lo, hi = SCALE_BOUNDS
            bad = {k: v for k, v in j["factors"].items() if not lo <= v <= hi}
            wrong = "; ".join(f"m={m}: {a_} measured {g:.1%} faster than {b_} but predicted slower" for m, a_, b_, g in j["ranked_wrong"])
            ok = j["median_abs_err"] <= TARGET_MEDIAN and j["worst_abs_err"] <= TARGET_WORST and not j["ranked_wrong"] and not bad
            all_ok &= ok
            print(f"re-fitted: median |error| {j['median_abs_err']:.1%}, worst {j['worst_abs_err']:.1%}; "
                  f"pairs > 3% apart ranked {'right' if not wrong else 'WRONG: ' + wrong}")
            print(f"fitted ({'graphed' if cal.get('cuda_graph') == 'step' else 'eager'} probe, error {cal.get('probe_error', 0.0):+.1%}): "
                  + " ".join(f"{k}={v:.3f}" for k, v in j["factors"].items())
                  + "".join(f" {k}={v:.4g}" for k, v in fitted.items())
                  + (f"; OUT OF [{lo}, {hi}]: {', '.join(bad)}" if bad else ""))
            print(f"targets (median <= {TARGET_MEDIAN:.0%}, worst <= {TARGET_WORST:.0%}, ranking, factors): "
                  + ("met" if ok else "NOT met"))
            if a.store:
                if len(a.files) != 1 or len(summaries) != 1 or "config" not in s:
                    ap.error("--store takes one braid.bench --json summary")
                add_set(a.store, stored_set(s, a.name, f))
                print(f"stored as set {a.name!r} in {a.store}")
    if not n:
        print("no runs", file=sys.stderr)
        return 1
    return 0 if all_ok else 3


if __name__ == "__main__":
    raise SystemExit(main())
