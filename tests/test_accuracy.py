"""Stored measurements re-predicted from their stored profile: the simulator's accuracy targets.

Every ``tests/data/measurements_*.json`` (``python -m braid.bench --capture``) holds sets of
measured runs (schedule, m, step time, peak memory per rank) and the profile they are
predicted from. Targets: simulated step time within 5% of measured (median over a set's
runs) and 10% (worst); peak memory within 10%; of any two runs of one m whose measured
times differ by more than 3%, the simulator ranks the faster one first.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from braid.measure.report import MEASUREMENTS_FORMAT
from braid.measure.calibrate import predict
from braid.measure.calibrate import rel_err

DATA = Path(__file__).parent / "data"
SETS = [(f.name, s) for f in sorted(DATA.glob("measurements_*.json")) for s in json.loads(f.read_text())["sets"]]


def test_there_is_a_stored_set() -> None:
    assert SETS, "no tests/data/measurements_*.json: capture one with python -m braid.bench --capture"
    for f in DATA.glob("measurements_*.json"):
        assert json.loads(f.read_text())["format"] == MEASUREMENTS_FORMAT


def _timed(s: dict) -> bool:
    """Whether a set's step times measure the program: captured on an idle machine (load per
    core <= 1). A set captured on an oversubscribed machine (e.g. a shared 2-core box) keeps its
    exact memory check, but its step times are contention, so it takes no part in the timing
    targets -- those are asserted on the sets captured on the GPU machine."""
    return s.get("load_per_core", 0.0) <= 1.0


def _predict(s: dict):
    lay = s["layout"]
    out = []
    for r in s["runs"]:
        sim, peaks = predict(s["profile"], r["schedule"], r["m"], lay["pp"], lay["tp"], lay["layers_per_stage"], s["memory"])
        out.append((r, sim.report.step_time_s, peaks))
    return s, out


@pytest.fixture(scope="module", params=[pytest.param(s, id=f"{f}:{s['name']}") for f, s in SETS])
def predicted(request):
    return _predict(request.param)


@pytest.fixture(scope="module", params=[pytest.param(s, id=f"{f}:{s['name']}") for f, s in SETS if _timed(s)])
def predicted_timed(request):
    return _predict(request.param)


def test_step_time_within_5_percent_median_10_worst(predicted_timed) -> None:
    s, runs = predicted_timed
    errs = {f"{r['schedule']} m={r['m']}": rel_err(pred, r["step_s"]) for r, pred, _ in runs}
    med = statistics.median(abs(e) for e in errs.values())
    worst = max(abs(e) for e in errs.values())
    detail = ", ".join(f"{k}: {100 * v:+.1f}%" for k, v in errs.items())
    assert med <= 0.05, f"{s['name']}: median step-time error {100 * med:.1f}% > 5% ({detail})"
    assert worst <= 0.10, f"{s['name']}: worst step-time error {100 * worst:.1f}% > 10% ({detail})"


def test_peak_memory_within_10_percent(predicted) -> None:
    s, runs = predicted
    for r, _, peaks in runs:
        for rank, (pred, meas) in enumerate(zip(peaks, r["peak_bytes"])):
            assert abs(rel_err(pred, meas)) <= 0.10, f"{s['name']} {r['schedule']} m={r['m']} rank {rank}: predicted {pred} B, measured {meas} B"


def test_simulator_ranks_clearly_different_schedules(predicted_timed) -> None:
    s, runs = predicted_timed
    for i, (a, pa, _) in enumerate(runs):
        for b, pb, _ in runs[i + 1:]:
            if a["m"] != b["m"] or abs(a["step_s"] - b["step_s"]) <= 0.03 * min(a["step_s"], b["step_s"]):
                continue
            assert (a["step_s"] < b["step_s"]) == (pa < pb), (
                f"{s['name']} m={a['m']}: measured {a['schedule']} {a['step_s'] * 1e3:.2f} ms vs {b['schedule']} "
                f"{b['step_s'] * 1e3:.2f} ms, predicted {pa * 1e3:.2f} vs {pb * 1e3:.2f} ms")
