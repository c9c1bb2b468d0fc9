"""``braid.bench`` on CPU: one 2-rank gloo job runs two schedules and the pipelining baselines."""

from __future__ import annotations

import json

import pytest

from braid.bench import BenchConfig, capture, format_report, instruction_end_peaks, probe_plan, run_bench
from braid.compiler import compile_plan
from braid.models.qwen2 import Qwen2Config
from braid.profile import ProfileConfig
from braid.trace import Event, Trace


def test_instruction_end_peaks_samples_the_series_at_instruction_ends() -> None:
    ev = [Event(0, "compute", "F0c0", "F", 0.0, 1.0, op_index=0), Event(0, "compute", "F1c0", "F", 1.0, 1.0, op_index=1),
          Event(0, "compute", "F1c0", "F", 2.0, 1.0, op_index=1)]
    # 5 bytes live in the middle of instruction 1, only 3 at its end
    tr = Trace({}, ev, {0: [(0.0, 0), (1.0, 2), (2.5, 5), (3.0, 3)]})
    assert instruction_end_peaks(tr) == {0: 3}


def test_probe_plan_compiles_for_both_placements() -> None:
    for p, v in ((2, 2), (1, 2), (3, 2)):
        plan = probe_plan(p, 2 * p, v)
        progs = compile_plan(plan)
        assert len(progs) == p and all(len(pr) > 0 for pr in progs)


@pytest.mark.slow
def test_cpu_bench_measures_and_predicts(tmp_path) -> None:
    cfg = ProfileConfig(Qwen2Config(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64), (1, 1, 1, 1),
                        seq=8, pp=2, iters=2)
    bc = BenchConfig(cfg, ("braided_v", "1f1b_i"), (4,), warmup=1, steps=2)
    s = run_bench(bc)
    assert [(r["schedule"], r["m"]) for r in s["runs"]] == [("braided_v", 4), ("1f1b_i", 4)]
    for r in s["runs"]:
        assert r["step_s"] > 0 and r["predicted_step_s"] > 0 and r["loss"] > 0
        assert r["tokens_per_s"] == pytest.approx(4 * 8 / r["step_s"])
        # CPU memory accounting is exact: saved bytes at instruction ends, measured and simulated
        assert r["peak_bytes"] == r["predicted_peak_bytes"] and min(r["peak_bytes"]) > 0
        sim, meas = s["_traces"][f"{r['schedule']}_m4"]
        assert sim.meta["source"] == "simulated" and meas.meta["source"] == "measured"
        assert {e.rank for e in meas.events} == {0, 1}
    cal = s["profile"]["meta"]["calibration"]
    assert cal["compute_scale"] > 0 and cal["p2p_s"] >= 0
    names = {e["schedule"] for e in s["external"]}
    assert names == {"torch:ScheduleInterleaved1F1B", "torch:ScheduleZBVZeroBubble", "torch:ScheduleDualPipeV"}
    for e in s["external"]:
        assert ("error" in e and e["error"]) or e["step_s"] > 0, e
    text = format_report(s)
    assert "braided_v" in text and "megatron-core" in text
    out = tmp_path / "m.json"
    s.pop("_traces")
    capture(s, out, "cpu-a")
    capture(s, out, "cpu-b")
    capture(s, out, "cpu-a")  # replaces, does not duplicate
    doc = json.loads(out.read_text())
    assert [x["name"] for x in doc["sets"]] == ["cpu-b", "cpu-a"]
    assert doc["sets"][1]["runs"][0]["step_s"] == s["runs"][0]["step_s"]
