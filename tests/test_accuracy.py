"""Stored measurements re-predicted: the simulator's accuracy targets.

Every ``tests/data/measurements_*.json`` (``python -m braid.bench --capture``) holds sets of
measured runs (schedule, m, step time, peak memory per rank) and the profile they are
predicted from. A calibrated set's step times are predicted from its profile re-fitted by
the current calibration (:func:`braid.measure.refit.refit`: the stored probe evidence and
uncalibrated profile), so every set is judged by the calibration of the tree; an
uncalibrated one (``--costs``) from its stored profile. Targets: simulated step time within
5% of measured (median over a set's runs) and 10% (worst); of any two runs of one m whose
measured times differ by more than 3%, the simulator ranks the faster one first; every
fitted scale in :data:`braid.measure.calibrate.SCALE_BOUNDS`; peak memory within 10%
(eager runs: a graphed run's peak is its capture's allocator peak, which the simulator
does not model).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from braid.measure.report import MEASUREMENTS_FORMAT
from braid.measure.calibrate import SCALE_BOUNDS, fitted_factors, predict
from braid.measure.calibrate import rel_err
from braid.measure.refit import refit, run_mode

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


def _calibrated(s: dict) -> bool:
    return bool(s["profile"].get("meta", {}).get("calibration"))


def _predict(s: dict, timing: bool = False):
    """``(set, [(run, predicted step s, predicted peaks, simulated trace)])``; with ``timing``, from the re-fitted
    profile (calibrated sets), which is then the set's ``"refitted"`` entry."""
    lay = s["layout"]
    prof = s["profile"]
    if timing and _calibrated(s):
        prof = refit(s)
        s = {**s, "refitted": prof}
    out = []
    for r in s["runs"]:
        sim, peaks = predict(prof, r["schedule"], r["m"], lay["pp"], lay["tp"], lay["layers_per_stage"], s["memory"],
                             run_mode(s, r))
        out.append((r, sim.report.step_time_s, peaks, sim.trace))
    return s, out


def _two_gpus(s: dict) -> bool:
    lay = s["layout"]
    return s["memory"] == "allocator_peak" and lay["tp"] * lay["pp"] == 2


def test_there_is_a_stored_two_gpu_set_at_tp2_and_at_pp2() -> None:
    layouts = {(s["layout"]["tp"], s["layout"]["pp"]) for _, s in SETS if _two_gpus(s) and _timed(s)}
    assert {(2, 1), (1, 2)} <= layouts, f"2-GPU sets stored for (tp, pp) = {sorted(layouts)}"


@pytest.fixture(scope="module", params=[pytest.param(s, id=f"{f}:{s['name']}") for f, s in SETS])
def predicted(request):
    return _predict(request.param)


@pytest.fixture(scope="module", params=[pytest.param(s, id=f"{f}:{s['name']}") for f, s in SETS if _timed(s)])
def predicted_timed(request):
    return _predict(request.param, timing=True)


def test_fitted_factors_are_physical(predicted_timed) -> None:
    s, _ = predicted_timed
    if not _calibrated(s):
        pytest.skip(f"{s['name']}: not calibrated (--costs)")
    lo, hi = SCALE_BOUNDS
    factors = fitted_factors(s["refitted"]["meta"]["calibration"])
    assert factors and all(lo <= v <= hi for v in factors.values()), f"{s['name']}: fitted {factors}"


def test_step_time_within_5_percent_median_10_worst(predicted_timed) -> None:
    s, runs = predicted_timed
    errs = {f"{r['schedule']} m={r['m']}": rel_err(pred, r["step_s"]) for r, pred, *_ in runs}
    med = statistics.median(abs(e) for e in errs.values())
    worst = max(abs(e) for e in errs.values())
    detail = ", ".join(f"{k}: {100 * v:+.1f}%" for k, v in errs.items())
    assert med <= 0.05, f"{s['name']}: median step-time error {100 * med:.1f}% > 5% ({detail})"
    assert worst <= 0.10, f"{s['name']}: worst step-time error {100 * worst:.1f}% > 10% ({detail})"


def test_peak_memory_within_10_percent(predicted) -> None:
    s, runs = predicted
    eager = [(r, p, peaks) for r, p, peaks, _ in runs if run_mode(s, r) != "step"]
    if not eager:
        pytest.skip(f"{s['name']}: every run graphed (its peak is the capture's allocator peak, not simulated)")
    for r, _, peaks in eager:
        for rank, (pred, meas) in enumerate(zip(peaks, r["peak_bytes"])):
            assert abs(rel_err(pred, meas)) <= 0.10, f"{s['name']} {r['schedule']} m={r['m']} rank {rank}: predicted {pred} B, measured {meas} B"


def _device_errors(s: dict, runs: list, what: str, trace: bool = True) -> dict[str, float]:
    """Per run and rank of a GPU set captured with its device memory, the relative error of
    :func:`braid.measure.device_prediction.predicted_device_parts` against ``what``: the device memory in use
    (``device_used_bytes``, nvidia-smi's view: reserve and outside added) or the allocator's reserved peak
    (``reserved_peak_bytes``: the reserve); ``trace``: a graphed pool priced from the simulated step's trace."""
    from braid import schedules
    from braid.measure.device_prediction import predicted_device_parts

    lay = s["layout"]
    cfg = {"tp": lay["tp"], "pp": lay["pp"], "layers_per_stage": lay["layers_per_stage"], "dtype": s["dtype"],
           "model": s["model"], "tp_backend": s["tp_backend"], "tp_max_ctas": s["tp_max_ctas"], "seq": s["seq"],
           "micro_batch_size": s["micro_batch_size"]}
    errs = {}
    for r, _, peaks, sim_trace in runs:
        placement = schedules.build(r["schedule"], lay["pp"], r["m"]).placement
        parts = predicted_device_parts(cfg, r["schedule"], placement, peaks, run_mode(s, r) == "step",
                                       trace=sim_trace if trace else None, m=r["m"])
        for g, ((reserve, outside), got) in enumerate(zip(parts, r[what])):
            p = reserve if what == "reserved_peak_bytes" else reserve + outside
            errs[f"{r['schedule']} m={r['m']} rank {g}"] = rel_err(p, got)
    return errs


def _within_5_median_10_worst(errs: dict[str, float], what: str) -> None:
    detail = ", ".join(f"{k}: {100 * v:+.1f}%" for k, v in errs.items())
    assert statistics.median(abs(e) for e in errs.values()) <= 0.05, f"{what}: {detail}"
    assert max(abs(e) for e in errs.values()) <= 0.10, f"{what}: {detail}"


@pytest.mark.parametrize("what", ["device_used_bytes", "reserved_peak_bytes"])
def test_device_memory_within_5_percent_median_10_worst(predicted, what: str) -> None:
    """A GPU set captured with its device memory (``braid.bench --capture`` since the sets carry it): per rank,
    what the device held in use (nvidia-smi's view) and the allocator's reserved peak against
    :func:`braid.measure.device_prediction.predicted_device_parts` of the set's layout and the simulated step."""
    s, runs = predicted
    runs = [x for x in runs if x[0].get("device_used_bytes")]
    if not runs:
        pytest.skip(f"{s['name']}: captured without device memory (CPU, or before sets carried it)")
    _within_5_median_10_worst(_device_errors(s, runs, what), f"{s['name']} {what}")


# tp=1 x pp=2 sets (2 H100s, tree 580ba51) kept out of tests/data while the eager set's reserved peak is not predicted
# (issue 51; measurements_h100x2_tp1_pp2_memory_7.txt says why): device memory in use of both, and the graphed set's reserved peak
# and the eager set again on 2 H200s (tree af7c40e), on the allocator's default and expandable segments
# (measurements_h200x2_tp1_pp2_memory.txt; their reserved peaks are not predicted either)
PP2_SETS = ("measurements_h100x2_tp1_pp2_graphed_memory_7.json", "measurements_h100x2_tp1_pp2_eager_memory_7.json",
            "measurements_h200x2_tp1_pp2_eager_memory.json", "measurements_h200x2_tp1_pp2_eager_memory_expandable.json")


@pytest.mark.parametrize("name", PP2_SETS)
def test_device_in_use_of_the_stored_pp2_sets_within_5_percent_median_10_worst(name: str) -> None:
    """Per rank of the stored pp=2 sets; graphed, the pool priced from the simulated step's activations and the
    gradients allocated by then (``captured_peak``), which misses less than every gradient beside the peak, and
    the reserved peak too (the pool and the weights: since braid.bench builds each row's weights on an empty cache,
    nothing else is reserved beside them)."""
    (s,) = json.loads((Path(__file__).parent.parent / "benchmarks" / "results" / name).read_text())["sets"]
    s, runs = _predict(s)
    errs = _device_errors(s, runs, "device_used_bytes")
    assert len(errs) == 12
    _within_5_median_10_worst(errs, name)
    if "graphed" in name:
        every_grad = _device_errors(s, runs, "device_used_bytes", trace=False)
        assert max(map(abs, errs.values())) < max(map(abs, every_grad.values())), (errs, every_grad)
        _within_5_median_10_worst(_device_errors(s, runs, "reserved_peak_bytes"), f"{name} reserved_peak_bytes")


# tp=2 x pp=1 with sequence parallelism, the default there (2 H200s, tree 223d60b: nccl-ce, its staging priced;
# measurements_h200x2_tp2_sp_memory.txt): kept out of tests/data, whose timing checks the eager set's host-bound steps miss
SP_SETS = ("measurements_h200x2_tp2_sp_graphed_memory.json", "measurements_h200x2_tp2_sp_eager_memory.json")


@pytest.mark.parametrize("name", SP_SETS)
@pytest.mark.parametrize("what", ["device_used_bytes", "reserved_peak_bytes"])
def test_device_memory_of_the_stored_sequence_parallel_sets_within_5_percent_median_10_worst(name: str, what: str) -> None:
    """Per rank of the stored SP sets: what the device held in use and the allocator's reserved peak, eager and graphed."""
    (s,) = json.loads((Path(__file__).parent.parent / "benchmarks" / "results" / name).read_text())["sets"]
    assert s["tp_backend"] == "nccl-ce"
    s, runs = _predict(s)
    errs = _device_errors(s, runs, what)
    assert len(errs) == 12
    _within_5_median_10_worst(errs, f"{name} {what}")


def test_simulator_ranks_clearly_different_schedules(predicted_timed) -> None:
    s, runs = predicted_timed
    for i, (a, pa, *_) in enumerate(runs):
        for b, pb, *_ in runs[i + 1:]:
            if a["m"] != b["m"] or abs(a["step_s"] - b["step_s"]) <= 0.03 * min(a["step_s"], b["step_s"]):
                continue
            assert (a["step_s"] < b["step_s"]) == (pa < pb), (
                f"{s['name']} m={a['m']}: measured {a['schedule']} {a['step_s'] * 1e3:.2f} ms vs {b['schedule']} "
                f"{b['step_s'] * 1e3:.2f} ms, predicted {pa * 1e3:.2f} vs {pb * 1e3:.2f} ms")
