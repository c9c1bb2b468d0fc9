"""``python -m braid.simulate``: table, JSON shape, trace file, exit code 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from braid.simulate import main
from braid.io.trace import load_traces


def test_json_report_shape_and_trace(tmp_path, capsys):
    out, tr = tmp_path / "r.json", tmp_path / "t.json"
    rc = main(["--pp", "2", "--mbs", "4", "--model", "qwen2-1.5b", "--schedule", "1f1b_i", "--schedule", "zb_v",
               "--json", str(out), "--trace", str(tr)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "1f1b_i" in text and "zb_v" in text and "1.000x" in text
    doc = json.loads(out.read_text())
    assert doc["config"]["pp"] == 2 and doc["config"]["model"] == "qwen2-1.5b"
    assert set(doc["schedules"]) == {"1f1b_i", "zb_v"}
    for rep in doc["schedules"].values():
        assert isinstance(rep["step_time_s"], float) and rep["step_time_s"] > 0
        assert 0 < rep["mfu"] < 1 and rep["throughput_samples_s"] > 0
        assert [r["rank"] for r in rep["ranks"]] == [0, 1]
        for r in rep["ranks"]:
            assert {"rank", "compute_s", "pp_bubble_s", "tp_exposed_s", "peak_activation_bytes", "peak_activation_ma"} <= set(r)
            assert isinstance(r["peak_activation_bytes"], int) and r["peak_activation_bytes"] > 0
    traces = load_traces(tr)
    # fastest first, the order of the table
    assert sorted(t.meta["schedule"] for t in traces) == ["1f1b_i", "zb_v"]
    assert [t.meta["schedule"] for t in traces] == sorted(doc["schedules"], key=lambda n: doc["schedules"][n]["step_time_s"])
    for t in traces:
        assert t.step_time == pytest.approx(doc["schedules"][t.meta["schedule"]]["step_time_s"])


def test_cost_file_and_skip_note(tmp_path, capsys):
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"T_F": 1.0, "T_B": 1.0, "T_W": 1.0, "T_AR": 0.25, "T_P2P": 0.0}))
    out = tmp_path / "r.json"
    rc = main(["--pp", "4", "--mbs", "4", "--costs", str(costs), "--schedule", "1f1b_i", "--schedule", "braided_v",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "note: skipped braided_v" in text  # needs m >= 2p
    doc = json.loads(out.read_text())
    assert list(doc["schedules"]) == ["1f1b_i"]
    assert doc["schedules"]["1f1b_i"]["ranks"][0]["tp_exposed_s"] == pytest.approx(2 * 4 * 0.25)


def test_a_profiled_cost_file_labels_its_device_and_shape(tmp_path, capsys):
    """The header names the device a profile was measured on, not the hardware preset; a
    profile of another shape than the simulated model gets a note with the flags that match it."""
    meta = {"device": "cpu (2 cores)", "config": {"model": {"vocab_size": 128, "hidden": 64, "heads": 4, "kv_heads": 2,
                                                             "ffn": 128}, "seq": 16, "layers_per_stage": [1, 1, 1, 1]}}
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"T_F": 1e-3, "T_B": 1e-3, "T_W": 1e-3, "T_AR": 0.0, "T_P2P": 0.0, "peak_flops": 0.0, "meta": meta}))
    argv = ["--pp", "2", "--tp", "1", "--mbs", "4", "--costs", str(costs), "--schedule", "zb_v"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("# qwen2-12b on cpu (2 cores) (measured): tp=1 pp=2 m=4 seq=4096"), text
    assert "was profiled for another shape: hidden 64 (simulated: 4096)" in text and "layers 4 (simulated: 48)" in text
    flags = text.split("add ", 1)[1].split(" to simulate", 1)[0]
    assert main(["--model", "qwen2-12b", *flags.split(), *argv]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# qwen2-12b --layers 4 --hidden 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 128 on cpu (2 cores) "
                           "(measured): tp=1 pp=2 m=4 seq=16"), text
    assert "profiled for another shape" not in text
    assert text.splitlines()[3].split()[3] == "-"  # MFU: the file gives no peak FLOP/s (a CPU profile)


@pytest.mark.parametrize("argv,names", [
    (["--schedule", "nope"], "1f1b_i"),
    (["--model", "nope"], "qwen2-12b"),
    (["--hardware", "nope"], "h200"),
    (["--pp", "0"], None),
    (["--bogus"], None),
    (["--offload-alpha", "1.5"], None),
    (["--offload-budget", "3"], None),
    (["--model", "qwen3-moe-tiny", "--dp", "2", "--ep", "2", "--cuda-graph", "step"], None),  # splits read the host
])
def test_bad_arguments_exit_2_with_one_line(argv, names, capsys):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    msg = capsys.readouterr().err.strip()
    assert len(msg.splitlines()) == 1 or "usage" in msg
    if names:
        assert names in msg and "valid names" in msg


@pytest.mark.parametrize("argv,message", [
    (["--last-stage-lighter", "0.7"], "not a whole or half number of layers >= 0: '0.7'"),
    (["--last-stage-lighter", "nan"], "not a whole or half number of layers >= 0: 'nan'"),
    (["--last-stage-lighter", "9.5"], "with 8 virtual stages"),
    (["--last-stage-lighter", "0.5", "--costs", "tests/data/measurements_h200.json"], "re-splits the analytic model"),
    (["--last-stage-lighter", "0.5", "--recompute", "full"], "re-runs whole layers"),
    (["--last-stage-lighter", "0.5", "--model", "qwen2-vl-7b"], "the VLM's stages hold whole layers"),
])
def test_bad_last_stage_lighter_exits_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        main(["--pp", "4", "--mbs", "8", "--model", "qwen2-1.5b", "--schedule", "zb_v", *argv])
    assert err.value.code == 2
    msg = capsys.readouterr().err.strip().splitlines()[-1]
    assert msg.startswith("python -m braid.simulate: error:") and message in msg, msg


def test_a_split_one_schedule_cannot_hold_skips_that_schedule(capsys):
    # 6 layers: 8 virtual stages (zb_v at pp=4) cannot hold them, 4 (1f1b) can
    assert main(["--model", "qwen2-toy", "--layers", "6", "--pp", "4", "--mbs", "8", "--schedule", "1f1b",
                 "--schedule", "zb_v", "--last-stage-lighter", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "1f1b" in out and "layers per virtual stage: 2,2,1.5,0.5" in out and "skipped zb_v" in out, out


def test_a_half_layer_cut_moves_the_heads_work_and_is_predicted(tmp_path, capsys):
    # 4 layers of a 7B shape on 4 virtual stages: the head's stage gives layer 3's attention to the stage before
    base = ["--model", "qwen2-7b", "--layers", "4", "--vocab", "32768", "--pp", "2", "--tp", "1", "--mbs", "8",
            "--schedule", "zb_v"]
    steps = {}
    for lighter in (None, "0.5"):
        out = tmp_path / f"{lighter}.json"
        assert main(base + ["--json", str(out)] + (["--last-stage-lighter", lighter] if lighter else [])) == 0
        text = capsys.readouterr().out
        assert ("layers per virtual stage: 1,1,1.5,0.5" in text) == (lighter is not None), text
        steps[lighter] = json.loads(out.read_text())["schedules"]["zb_v"]
    whole, half = steps[None], steps["0.5"]
    assert half["step_time_s"] < whole["step_time_s"]
    # rank 0 (embedding and head) computes less, rank 1 more
    assert half["ranks"][0]["compute_s"] < whole["ranks"][0]["compute_s"]
    assert half["ranks"][1]["compute_s"] > whole["ranks"][1]["compute_s"]


def test_bad_cost_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"T_F": "fast"}))
    with pytest.raises(SystemExit) as err:
        main(["--pp", "2", "--mbs", "4", "--schedule", "1f1b", "--costs", str(bad)])
    assert err.value.code == 2 and "T_F" in capsys.readouterr().err


def test_offload_alpha_auto_and_fixed(tmp_path, capsys):
    out = tmp_path / "r.json"
    base = ["--pp", "2", "--mbs", "8", "--schedule", "braided_v", "--schedule", "braided_v_offload", "--json", str(out)]
    assert main(base) == 0
    text = capsys.readouterr().out
    auto = json.loads(out.read_text())["schedules"]
    assert "note: braided_v_offload: auto offload alpha=" in text
    bv, off = auto["braided_v"], auto["braided_v_offload"]
    # auto: a lower worst-rank peak within 1% of braided_v's step time
    assert off["peak_memory_gib"] < bv["peak_memory_gib"] and off["step_time_s"] <= 1.01 * bv["step_time_s"]
    # a looser budget: a peak no higher, within 3%
    assert main(base + ["--offload-budget", "0.03"]) == 0
    loose = json.loads(out.read_text())["schedules"]["braided_v_offload"]
    assert loose["peak_memory_gib"] <= off["peak_memory_gib"] and loose["step_time_s"] <= 1.03 * bv["step_time_s"]
    assert main(base + ["--offload-alpha", "0"]) == 0
    none = json.loads(out.read_text())["schedules"]["braided_v_offload"]
    assert none["peak_memory_gib"] == pytest.approx(bv["peak_memory_gib"])


def test_data_parallel_tail_on_its_own_lane_priced_by_the_optimizer_mode(tmp_path, capsys):
    """``--dp N --optimizer MODE``: the reduction, step and all-gather the planner uses, in the table,
    the JSON and the trace (``dp-comm`` lane); ZeRO-1 holds less state than fp32 masters on every replica."""
    from braid.cost.cluster import Cluster, Parallel, dp_costs
    from braid.cost.costs import Layout, analytic_costs
    from braid.cost.hardware import get_hardware
    from braid.cost.catalog import get_model

    docs = {}
    for mode in ("zero1", "master", "plain"):
        out, trace = tmp_path / f"{mode}.json", tmp_path / f"{mode}.trace.json"
        assert main(["--pp", "2", "--mbs", "4", "--dp", "8", "--optimizer", mode, "--schedule", "1f1b",
                     "--json", str(out), "--trace", str(trace)]) == 0
        text = capsys.readouterr().out
        assert f"dp=8 x 8 GPUs per node, optimizer {mode}" in text
        docs[mode] = json.loads(out.read_text())
        dp = docs[mode]["schedules"]["1f1b"]["dp"]
        assert dp["step_s"] >= docs[mode]["schedules"]["1f1b"]["step_time_s"] + max(dp["optimizer_s"])
        events = [e for t in load_traces(trace) for e in t.events if e.lane == "dp-comm"]
        kinds = {e.kind for e in events}
        assert kinds == ({"RS", "AG"} if mode == "zero1" else {"AR"}), kinds
        assert docs[mode]["config"]["optimizer"] == mode
    state = {m: max(d["schedules"]["1f1b"]["dp"]["static_bytes"]) for m, d in docs.items()}
    assert state["zero1"] < state["plain"] < state["master"]
    model, hw = get_model("qwen2-12b"), get_hardware("h200")
    costs = analytic_costs(model, hw, Layout(2, 2, 1, "loop"))
    assert state["zero1"] == max(dp_costs(model, costs, Cluster(hw, 8), Parallel(2, 2, 8)).static_bytes)  # the planner's figure


def test_with_a_data_parallel_tail_both_tables_rank_by_the_step_and_every_file_says_wrote(tmp_path, capsys):
    """One ranking per run: with --dp, the pipeline table follows the step with the tail (here it
    reorders braided_v, faster alone, behind dualpipe_v, whose gradient reduction hides better)."""
    out, trace = tmp_path / "r.json", tmp_path / "t.json"
    assert main(["--pp", "4", "--mbs", "12", "--dp", "8", "--optimizer", "zero1", "--recompute", "selective",
                 "--schedule", "braided_v", "--schedule", "dualpipe_v", "--json", str(out), "--trace", str(trace)]) == 0
    text = capsys.readouterr().out
    runs = json.loads(out.read_text())["schedules"]
    assert runs["braided_v"]["step_time_s"] < runs["dualpipe_v"]["step_time_s"]
    assert runs["braided_v"]["dp"]["step_s"] > runs["dualpipe_v"]["dp"]["step_s"]
    rows = [line.split()[0] for line in text.splitlines() if line.startswith(("braided_v ", "dualpipe_v "))]
    assert rows == ["dualpipe_v", "braided_v"] * 2 and "ranked by the step with the data-parallel tail" in text
    assert f"wrote {out}\nwrote {trace}\n" in text
    pytest.importorskip("plotly")
    html = tmp_path / "t.html"
    viz = subprocess.run([sys.executable, "-m", "braid.viz", str(trace), "-o", str(html)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert viz.returncode == 0 and (viz.stdout + viz.stderr).count("wrote") == 1, viz.stdout + viz.stderr


def test_device_memory_is_priced_as_the_run_executes(tmp_path) -> None:
    """The device memory in use of a whole-step CUDA graph (the examples' default on CUDA) holds the pool of
    the step's activations beside the optimizer step's temporaries; eager, the larger of the two. Default: as
    the examples run (captured for a dense LM; eager for MoE whose dispatch reads its counts on the host)."""
    def gib(*extra: str) -> float:
        out = tmp_path / "s.json"
        assert main(["--model", "qwen2-small", "--tp", "2", "--pp", "1", "--mbs", "16", "--schedule", "braided_v",
                     "--optimizer", "zero1", *extra, "--json", str(out)]) == 0
        return json.loads(out.read_text())["schedules"]["braided_v"]["dp"]["device_memory_gib"]

    eager, graphed = gib("--cuda-graph", "none"), gib("--cuda-graph", "step")
    assert graphed > eager and gib() == graphed

    def moe(*extra: str) -> float:
        out = tmp_path / "m.json"
        assert main(["--model", "qwen3-moe-tiny", "--dp", "2", "--ep", "2", "--pp", "1", "--mbs", "4", "--schedule",
                     "1f1b_i", "--optimizer", "zero1", *extra, "--json", str(out)]) == 0
        return json.loads(out.read_text())["schedules"]["1f1b_i"]["dp"]["device_memory_gib"]

    assert moe() == moe("--cuda-graph", "none")
