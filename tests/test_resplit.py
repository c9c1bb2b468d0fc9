"""A profile re-split for another layer split (:mod:`braid.cost.resplit`): exact on the analytic
model, whose layer units cost the same in every layer; on a stored GPU profile it predicts the
runs measured at another split to the simulator's accuracy targets (``tests/test_accuracy.py``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from braid.cost.catalog import get_model
from braid.cost.costs import Layout, analytic_costs, costs_to_dict, model_stage_layers
from braid.cost.hardware import get_hardware
from braid.cost.resplit import resplit
from braid.measure.calibrate import predict, rel_err

ROOT = Path(__file__).resolve().parents[1]


def _stage_keyed(doc: dict, lay: Layout) -> dict:
    from braid.core.ir import stage_of

    return {**doc, "chunks": {str(stage_of(lay.placement, lay.p, *map(int, k.split(",")))): c for k, c in doc["chunks"].items()}}


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2), (2, 4)])
def test_resplit_of_the_analytic_model_is_the_analytic_model_at_the_new_split(tp, pp) -> None:
    model, hw = get_model("qwen2-7b"), get_hardware("h100")
    lay = Layout(tp, pp, 2, "v")
    old, new = model_stage_layers(model, lay, 0), model_stage_layers(model, lay, 2.5)
    assert old != new
    src = _stage_keyed(costs_to_dict(analytic_costs(model, hw, lay, last_stage_lighter=0)), lay)
    want = _stage_keyed(costs_to_dict(analytic_costs(model, hw, lay, last_stage_lighter=2.5)), lay)
    got = resplit(src, tp, pp, old, new)
    assert got["meta"]["resplit_from"] == list(old)
    for stage, c in want["chunks"].items():
        for key in ("T_F", "T_B", "T_W", "T_AR", "T_AR_B", "activation_bytes", "w_residual_bytes"):
            assert got["chunks"][stage][key] == pytest.approx(c[key], rel=1e-12, abs=1e-300), (stage, key)
    for m in (2 * pp, 4 * pp):
        for s in ("braided_v", "1f1b_i", "zb_v"):
            a = predict(got, s, m, pp, tp, new)[0].report.step_time_s
            b = predict(want, s, m, pp, tp, new)[0].report.step_time_s
            assert a == pytest.approx(b, rel=1e-9), (s, m)


def test_a_split_of_other_layers_or_stages_is_refused() -> None:
    doc = _stage_keyed(costs_to_dict(analytic_costs(get_model("qwen2-tiny"), get_hardware("h100"), Layout(1, 2, 2, "v"))),
                       Layout(1, 2, 2, "v"))
    old = model_stage_layers(get_model("qwen2-tiny"), Layout(1, 2, 2, "v"))
    with pytest.raises(ValueError, match="layers"):
        resplit(doc, 1, 2, old, [*old[:-1], old[-1] + 1])
    with pytest.raises(ValueError, match="virtual stages"):
        resplit(doc, 1, 2, old, [sum(old) / 2, sum(old) / 2])


def test_the_whole_layer_profile_on_four_gpus_predicts_the_half_layer_runs() -> None:
    # tp=2 x pp=2 on 4 H100s, 7b-layer shapes: the profile measured at whole layers (1,1,1,1),
    # re-split to (0.5,1.5,1.5,0.5), against the runs measured at that split in another job.
    whole = json.loads((ROOT / "benchmarks/results/bench_7b_h100x4_tp2_pp2.json").read_text())
    half = json.loads((ROOT / "benchmarks/results/bench_7b_h100x4_tp2_pp2_half.json").read_text())
    split = half["config"]["layers_per_stage"]
    doc = resplit(whole["profile"], 2, 2, whole["config"]["layers_per_stage"], split)
    errs = {f"{r['schedule']} m={r['m']}": rel_err(predict(doc, r["schedule"], r["m"], 2, 2, split, cuda_graph="step")[0]
                                                    .report.step_time_s, r["step_s"]) for r in half["runs"]}
    detail = ", ".join(f"{k}: {100 * v:+.1f}%" for k, v in errs.items())
    assert statistics.median(abs(e) for e in errs.values()) <= 0.05, detail
    assert max(abs(e) for e in errs.values()) <= 0.10, detail
