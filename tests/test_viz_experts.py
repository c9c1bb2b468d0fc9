"""The expert load of a mixture-of-experts run in the timeline viewer: ``braid.bench --ep 2 --trace-dir``
writes traces that carry the routing counts (``meta.expert_load``) and the imbalance the prediction
priced (``meta.moe_imbalance``); ``python -m braid.viz`` draws them beside the timeline with the
numbers the bench reports (read back from the figure JSON in the page). A trace without them renders
as before; a malformed one is one line and exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from braid.bench import main as bench_main
from braid.io.trace import ExpertLoad, TraceError, dump_traces, load_traces
from braid.simulate import main as simulate_main
from braid.viz.__main__ import main as viz_main
from test_bench_moe import FAST
from test_viz import fake_trace


def figure(page: Path) -> dict:
    """The figure JSON a rendered page plots."""
    m = re.search(r"var fig = (.*);\n  braidExpand", page.read_text())
    assert m is not None
    return json.loads(m.group(1))


def column(fig: dict) -> dict[str, dict]:
    """The expert-load column's traces by name."""
    return {t["name"]: t for t in fig["data"] if t.get("xaxis") in ("x3", "x4")}


def test_bench_traces_carry_the_expert_load_and_the_viewer_draws_it(tmp_path: Path) -> None:
    out, traces = tmp_path / "ep2.json", tmp_path / "traces"
    assert bench_main(["--model", "qwen3-moe-tiny", "--device", "cpu", *FAST, "--schedule", "braided_v", "--no-calibrate",
                       "--pp", "1", "--ep", "2", "--mbs", "4", "--json", str(out), "--trace-dir", str(traces)]) == 0
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    routing = run["routing"]
    sim, meas = load_traces(traces / "braided_v_m4.json")
    load = meas.expert_load
    assert load is not None and (load.ep, load.tp) == (2, 1) and sim.expert_load is None
    assert {str(k): list(v) for k, v in load.layers.items()} == routing["per_layer"] and len(load.layers) == 2
    assert load.summary()["tokens_per_expert"] == routing["tokens_per_expert"]
    priced = doc["profile"]["meta"]["moe"]["imbalance"]
    assert sim.meta["moe_imbalance"] == pytest.approx(priced) and "moe_imbalance" not in meas.meta

    assert viz_main([str(traces / "braided_v_m4.json"), "-o", str(tmp_path / "t.html"), "--plotlyjs", "cdn"]) == 0
    fig = figure(tmp_path / "t.html")
    col = column(fig)
    assert col["tokens per expert"]["y"] == routing["tokens_per_expert"] and len(routing["tokens_per_expert"]) == 4
    assert col["rows per EP rank"]["y"] == routing["rows_per_ep_rank"] and sum(routing["rows_per_ep_rank"]) == 4 * 8 * 2 * 2 * 2
    assert col["mean tokens per expert"]["y"][0] == pytest.approx(sum(routing["tokens_per_expert"]) / 4)
    top, bottom = (a["text"] for a in fig["layout"]["annotations"] if a.get("xref") in ("x3 domain", "x4 domain"))
    worst = max(routing["per_layer"], key=lambda k: max(routing["per_layer"][k]))
    assert f"tokens per expert · busiest/mean {routing['expert_imbalance']:.3f}" in top and "mean of 2 MoE layers" in top
    assert f"worst: layer {worst}, {routing['expert_imbalance_max']:.3f}" in top
    assert f"rows per EP rank · busiest/mean {routing['ep_imbalance']:.3f}" in bottom
    assert f"{routing['ep_imbalance_max']:.3f} · simulated at {priced:.3f}" in bottom
    assert fig["layout"]["xaxis4"]["ticktext"] == ["EP 0", "EP 1"] and fig["layout"]["xaxis"]["domain"] == [0, 0.7]


def test_a_trace_without_expert_load_renders_as_before_and_a_dropdown_hides_the_column(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    dump_traces([fake_trace(p=2, m=2)], old)
    assert viz_main([str(old), "-o", str(tmp_path / "old.html"), "--plotlyjs", "cdn"]) == 0
    fig = figure(tmp_path / "old.html")
    assert not column(fig) and "xaxis3" not in fig["layout"] and len(fig["layout"]["annotations"]) == 1

    moe = fake_trace(p=2, m=2, schedule="moe", source="measured")
    moe.meta["expert_load"] = ExpertLoad({3: (5, 1, 1, 1), 7: (2, 2, 2, 2)}, ep=2, tp=2).to_dict()
    both = tmp_path / "both.json"
    dump_traces([moe, fake_trace(p=2, m=2)], both)
    assert viz_main([str(both), "-o", str(tmp_path / "both.html"), "--plotlyjs", "cdn"]) == 0
    fig = figure(tmp_path / "both.html")
    col = column(fig)
    assert col["tokens per expert"]["y"] == [7, 3, 3, 3] and col["rows per EP rank"]["y"] == [7, 3, 3, 3]
    assert fig["layout"]["xaxis4"]["ticktext"] == ["tp 0·ep 0", "tp 0·ep 1", "tp 1·ep 0", "tp 1·ep 1"]
    assert "worst: layer 3, 2.500" in fig["layout"]["annotations"][1]["text"]  # (5 / 2 and 2 / 2) / 2 = 1.75 mean
    assert "busiest/mean 1.750" in fig["layout"]["annotations"][1]["text"]
    first, second = (b["args"] for b in fig["layout"]["updatemenus"][0]["buttons"])
    assert first[1]["xaxis3.visible"] is True and second[1]["xaxis3.visible"] is False
    assert second[1]["xaxis.domain"] == [0, 1] and len(second[1]["annotations"]) == 1
    shown = [i for i, v in enumerate(second[0]["visible"]) if v]
    assert not any(fig["data"][i].get("xaxis") in ("x3", "x4") for i in shown)


def test_a_simulation_at_moe_imbalance_says_what_it_priced(tmp_path: Path) -> None:
    sim = tmp_path / "sim.json"
    assert simulate_main(["--model", "qwen3-moe-tiny", "--pp", "1", "--mbs", "2", "--dp", "2", "--ep", "2",
                          "--moe-imbalance", "1.5", "--schedule", "1f1b_i", "--trace", str(sim)]) == 0
    (t,) = load_traces(sim)
    assert t.meta["moe_imbalance"] == 1.5
    assert viz_main([str(sim), "-o", str(tmp_path / "sim.html"), "--plotlyjs", "cdn"]) == 0
    fig = figure(tmp_path / "sim.html")
    assert "MoE imbalance priced 1.500 (busiest EP rank / mean)" in fig["layout"]["annotations"][0]["text"]
    assert not column(fig)


GOOD = {"layers": {"0": [3, 1, 2, 2]}, "ep": 2, "tp": 1, "scope": "one step"}


@pytest.mark.parametrize("load", [
    "lots", {}, {**GOOD, "layers": {}}, {**GOOD, "layers": {"0": [3, -1, 2, 2]}}, {**GOOD, "layers": {"0": [3, 1.5, 2, 2]}},
    {**GOOD, "layers": {"0": [3, True, 2, 2]}}, {**GOOD, "layers": {"x": [1, 1]}}, {**GOOD, "layers": {"0": [1, 1], "1": [1, 1, 1, 1]}},
    {**GOOD, "ep": 3}, {**GOOD, "ep": 0}, {**GOOD, "tokens": [1]}, {**GOOD, "layers": {"0": [1] * ((1 << 14) + 1)}},
    {**GOOD, "layers": {"9" * 5000: [1, 1]}}, {**GOOD, "layers": {"²": [1, 1]}}, {**GOOD, "scope": ["x"]},
], ids=["text", "empty", "no-layers", "negative", "fraction", "bool", "layer-name", "ragged", "ep-uneven", "ep-0",
        "unknown-key", "too-many-experts", "huge-layer", "unicode-digit", "scope"])  # fmt: skip
def test_malformed_expert_load_is_one_line_and_exit_2(tmp_path: Path, load: object,
                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    t = fake_trace(p=1, m=1)
    t.meta["expert_load"] = load
    path = tmp_path / "bad.json"
    dump_traces([t], path)
    with pytest.raises(SystemExit) as info:
        viz_main([str(path), "-o", str(tmp_path / "x.html")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m braid.viz: error: ") and "meta.expert_load" in err and "bad.json" in err
    assert len(err.splitlines()) == 1 and len(err) < 500 and not (tmp_path / "x.html").exists()


@pytest.mark.parametrize("value", [0.5, "high", float("inf")])
def test_malformed_moe_imbalance_is_refused(value: object) -> None:
    t = fake_trace(p=1, m=1).to_dict()
    t["meta"]["moe_imbalance"] = value
    from braid.io.trace import Trace

    with pytest.raises(TraceError, match="meta.moe_imbalance must be a number"):
        Trace.from_dict(t)


def test_expert_load_figures() -> None:
    load = ExpertLoad.from_dict({"layers": {"4": [4, 0, 0, 4], "2": [2, 2, 2, 2]}, "ep": 2})
    assert list(load.layers) == [2, 4] and load.tp == 1 and load.scope == ""
    s = load.summary()
    assert s["tokens_per_expert"] == [6, 2, 2, 6] and s["rows_per_ep_rank"] == [8, 8]
    assert s["expert_imbalance"] == pytest.approx(1.5) and (s["expert_imbalance_max"], s["expert_imbalance_worst_layer"]) == (2.0, 4)
    assert s["ep_imbalance"] == 1.0 and s["ep_imbalance_worst_layer"] == 2  # ties: the first layer
    assert ExpertLoad.from_dict(load.to_dict()) == load
