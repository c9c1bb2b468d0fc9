"""``braid.profile`` / ``braid.bench`` on a vision-language model: the tower's units measured and predicted.

Two real 2-rank CPU jobs (gloo) of ``qwen2-vl-tiny``, pp=2 and tp=2, each a profile and one
measured schedule; the cost file is read back by ``braid.simulate``.
"""

from __future__ import annotations

import copy
import json

import pytest

from braid.bench import main as bench_main
from braid.core.braiding import Unit
from braid.measure.calibrate import predict
from braid.simulate import main as simulate_main

TEXT = 8  # caption tokens after the image's 4 visual tokens and its two markers
SEQ = TEXT + 4 + 2  # the LM's tokens per sample
QUICK = ["--model", "qwen2-vl-tiny", "--seq", str(TEXT), "--mbs", "4", "--iters", "1", "--steps", "1", "--warmup", "0",
         "--no-calibrate", "--no-external", "--schedule", "1f1b_i"]


def _bench(tmp_path, *layout: str) -> dict:
    out = tmp_path / "bench.json"
    assert bench_main([*QUICK, *layout, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _vision_zeroed(doc: dict) -> dict:
    """``doc`` with the vision stage's compute taken out (as if only the LM's layers had been profiled)."""
    out = copy.deepcopy(doc)
    for key in ("T_F", "T_B", "T_W"):
        out["chunks"]["0"][key] = 0.0
    return out


def test_pp2_profile_times_the_tower_and_the_simulator_predicts_the_bench_from_it(tmp_path, capsys) -> None:
    summary = _bench(tmp_path, "--pp", "2")
    doc = summary["profile"]
    assert doc["meta"]["config"]["layers_per_stage"] == [2, 2, 1, 1]  # the tower's 2 blocks, then the LM split
    assert doc["tokens_per_sample"] == SEQ
    vision = doc["chunks"]["0"]
    for phase in ("F", "B", "W"):
        assert vision[f"T_{phase}"] > 0
        assert all(vision["unit_split"][phase][u.value] > 0 for u in (Unit.EMBED, Unit.ATTN, Unit.MLP, Unit.MERGE))
    (run,) = summary["runs"]
    assert run["schedule"] == "1f1b_i" and run["step_s"] > 0 and run["predicted_step_s"] > 0
    assert run["step_err"] == pytest.approx(run["predicted_step_s"] / run["step_s"] - 1, rel=1e-9)
    # the prediction holds the tower's measured time: without it the same step is shorter
    lm_only = predict(_vision_zeroed(doc), "1f1b_i", 4, 2, 1, [2, 2, 1, 1], vision=True)[0].report.step_time_s
    assert lm_only < run["predicted_step_s"]
    # braid.simulate reads the file for the catalog model and predicts the step the bench predicted
    costs, sim_json = tmp_path / "costs.json", tmp_path / "sim.json"
    costs.write_text(json.dumps(doc))
    assert simulate_main(["--model", "qwen2-vl-tiny", "--tp", "1", "--pp", "2", "--mbs", "4", "--seq", str(SEQ), "--costs", str(costs),
                          "--schedule", "1f1b_i", "--json", str(sim_json)]) == 0
    assert "profiled for another shape" not in capsys.readouterr().out
    sim = json.loads(sim_json.read_text())["schedules"]["1f1b_i"]
    assert sim["step_time_s"] == pytest.approx(run["predicted_step_s"], rel=1e-9)


def test_tp2_vision_units_carry_the_towers_all_reduce(tmp_path) -> None:
    """In bfloat16, as on a GPU: the synthetic images come in the model's dtype."""
    summary = _bench(tmp_path, "--tp", "2", "--pp", "1", "--dtype", "bfloat16")
    doc = summary["profile"]
    comm = doc["meta"]["comm"]
    assert comm["ar_s"] > 0 and comm["ar_vision_s"] > 0
    ar_f, lm_ar_f = doc["chunks"]["0"]["unit_split"]["AR"], doc["chunks"]["1"]["unit_split"]["AR"]
    # the tower's units all-reduce its activations (1, patches, vit hidden), measured apart from the LM's;
    # the merge joins the visual tokens with the text embedding at the LM's width: the LM's all-reduce
    assert ar_f[Unit.ATTN.value] == ar_f[Unit.EMBED.value] == ar_f[Unit.MLP.value] > 0
    assert ar_f[Unit.MERGE.value] == lm_ar_f[Unit.ATTN.value] > 0
    (run,) = summary["runs"]
    assert run["step_s"] > 0 and run["predicted_step_s"] > 0


@pytest.mark.parametrize("argv, says", [
    (["--image-size", "10"], "image size 10 must be a multiple"),
    (["--hidden", "64"], "runs at its preset's shape"),
    (["--layers-per-stage", "1,1,1,1"], "stage 0 holds all 2 ViT blocks"),
    (["--pp", "1", "--chunks", "1"], "needs its own virtual stage"),
])
def test_bad_vision_language_flags_are_one_line(argv, says, capsys) -> None:
    with pytest.raises(SystemExit) as ex:
        bench_main(["--model", "qwen2-vl-tiny", *argv])
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1]
