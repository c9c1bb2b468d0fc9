"""``braid.bench`` on CPU: one 2-rank gloo job runs two schedules and the pipelining baselines."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from braid.measure.config import BenchConfig
from braid.measure.calibrate import calibrate
from braid.measure.report import capture
from braid.measure.report import format_report
from braid.measure.calibrate import instruction_end_peaks
from braid.measure.calibrate import probe_plan
from braid.measure.runs import run_bench
from braid.core.compiler import compile_plan
from braid.cost.costs import Layout, costs_from_dict
from braid.core.partition import chunk_specs
from braid.models.qwen2 import Qwen2Config
from braid.measure.config import ProfileConfig
from braid.io.trace import Event, Trace
from braid.simulator import simulate


def _recalibrate_stored(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    return importlib.import_module("recalibrate_stored")


def test_recalibrate_stored_says_what_is_wrong_with_a_file_that_is_not_a_bench_run(tmp_path, capsys, monkeypatch) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"sets": []}))
    with pytest.raises(SystemExit) as e:
        _recalibrate_stored(monkeypatch).main([str(bad)])
    assert e.value.code == 2
    assert "not a braid.bench --json file" in capsys.readouterr().err


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


def test_calibration_recovers_per_phase_compute_scales_and_the_allreduce_scale() -> None:
    cfg = ProfileConfig(Qwen2Config(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64), (1, 1),
                        seq=8, pp=1, tp=2)
    stage = {"T_F": 1.0, "T_B": 1.2, "T_W": 0.8, "T_AR": 0.2, "T_AR_B": 0.15}
    doc = {"format": "braid-costs/1", "ar_slowdown": 1.05, "ar_stretch": 1.5, "chunks": {"0": dict(stage), "1": dict(stage)}}
    plan = probe_plan(1, 2, 2)
    progs = compile_plan(plan)
    lay, specs = Layout(2, 1, 2, plan.placement), chunk_specs((1, 1), 1, plan.placement)
    truth = {"F": 0.8, "B": 0.9, "W": 0.75}
    true_doc = {**doc, "chunks": {k: {**c, "T_F": c["T_F"] * truth["F"], "T_B": c["T_B"] * truth["B"], "T_W": c["T_W"] * truth["W"],
                                      "T_AR": c["T_AR"] * 1.3, "T_AR_B": c["T_AR_B"] * 1.3} for k, c in doc["chunks"].items()}}
    measured = simulate(progs, costs_from_dict(true_doc, lay, specs), name="probe")
    busy: dict[str, float] = {}  # as the recorder measures it: with the slowdown beside in-flight all-reduces
    for e in measured.trace.events:
        if e.lane == "compute":
            busy[e.kind] = busy.get(e.kind, 0.0) + e.dur
    out = calibrate(doc, cfg, plan, measured.report.step_time_s, busy)
    cal = out["meta"]["calibration"]
    for ph, k in truth.items():
        assert cal["compute_scale_per_phase"][ph] == pytest.approx(k, rel=1e-6)
    assert cal["ar_scale"] == pytest.approx(1.3, rel=1e-4)
    assert cal["predicted_step_s"] == pytest.approx(measured.report.step_time_s, rel=1e-6)


def test_calibration_at_pp1_tp1_recovers_the_host_time_per_unit_task() -> None:
    # One device, no communication: what the compute scales leave unexplained is the host lane.
    cfg = ProfileConfig(Qwen2Config(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64), (2, 2),
                        seq=8, pp=1, tp=1)
    stage = {"T_F": 1.0, "T_B": 1.2, "T_W": 0.8, "T_AR": 0.0}
    doc = {"format": "braid-costs/1", "chunks": {"0": dict(stage), "1": dict(stage)}}
    plan = probe_plan(1, 2, 2)
    progs = compile_plan(plan)
    lay, specs = Layout(1, 1, 2, plan.placement), chunk_specs((2, 2), 1, plan.placement)
    # a host slower than the short units: 0.2 s per task against decoder units of 1/8 .. 0.3 s
    true_doc = {**doc, "host_task_s": 0.2,
                "chunks": {k: {**c, "T_F": c["T_F"] * 0.9} for k, c in doc["chunks"].items()}}
    measured = simulate(progs, costs_from_dict(true_doc, lay, specs), name="probe")
    busy: dict[str, float] = {}
    for e in measured.trace.events:
        if e.lane == "compute":
            busy[e.kind] = busy.get(e.kind, 0.0) + e.dur
    assert measured.report.step_time_s > sum(busy.values()) * 1.01  # the host left the device idle
    out = calibrate(doc, cfg, plan, measured.report.step_time_s, busy)
    cal = out["meta"]["calibration"]
    assert cal["compute_scale_per_phase"]["F"] == pytest.approx(0.9, rel=1e-6)
    assert cal["host_task_s"] == pytest.approx(0.2, rel=1e-4)
    assert out["host_task_s"] == pytest.approx(0.2, rel=1e-4)
    assert cal["predicted_step_s"] == pytest.approx(measured.report.step_time_s, rel=1e-6)


def test_calibration_at_pp2_fits_the_host_lane_when_free_p2p_still_predicts_too_long() -> None:
    # Profiled host time per task 0.3 s, but the measured run issued tasks at 0.1 s (the
    # executor runs fused ops; host-bound units already carry launch gaps in their compute).
    cfg = ProfileConfig(Qwen2Config(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64), (1, 1, 1, 1),
                        seq=8, pp=2, tp=1)
    stage = {"T_F": 1.0, "T_B": 1.2, "T_W": 0.8, "T_AR": 0.0, "T_P2P": 0.0}
    doc = {"format": "braid-costs/1", "host_task_s": 0.3, "chunks": {str(i): dict(stage) for i in range(4)}}
    plan = probe_plan(2, 4, 2)
    progs = compile_plan(plan)
    lay, specs = Layout(1, 2, 2, plan.placement), chunk_specs((1, 1, 1, 1), 2, plan.placement)
    true_doc = {**doc, "host_task_s": 0.1}
    measured = simulate(progs, costs_from_dict(true_doc, lay, specs), name="probe")
    busy: dict[str, float] = {}
    for e in measured.trace.events:
        if e.lane == "compute":
            busy[e.kind] = busy.get(e.kind, 0.0) + e.dur
    assert simulate(progs, costs_from_dict(doc, lay, specs)).report.step_time_s > measured.report.step_time_s * 1.05
    out = calibrate(doc, cfg, plan, measured.report.step_time_s, busy)
    cal = out["meta"]["calibration"]
    assert cal["p2p_s"] == 0.0
    assert cal["host_task_s"] == pytest.approx(0.1, rel=1e-3)
    assert cal["predicted_step_s"] == pytest.approx(measured.report.step_time_s, rel=1e-4)


def test_calibration_at_pp2_keeps_the_profiled_host_lane_when_p2p_explains_the_rest() -> None:
    cfg = ProfileConfig(Qwen2Config(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64), (1, 1, 1, 1),
                        seq=8, pp=2, tp=1)
    stage = {"T_F": 1e-3, "T_B": 1.2e-3, "T_W": 0.8e-3, "T_AR": 0.0, "T_P2P": 0.0}
    doc = {"format": "braid-costs/1", "host_task_s": 1e-5, "chunks": {str(i): dict(stage) for i in range(4)}}
    plan = probe_plan(2, 4, 2)
    progs = compile_plan(plan)
    lay, specs = Layout(1, 2, 2, plan.placement), chunk_specs((1, 1, 1, 1), 2, plan.placement)
    true_doc = {**doc, "chunks": {k: {**c, "T_P2P": 2e-4} for k, c in doc["chunks"].items()}}
    measured = simulate(progs, costs_from_dict(true_doc, lay, specs), name="probe")
    busy: dict[str, float] = {}
    for e in measured.trace.events:
        if e.lane == "compute":
            busy[e.kind] = busy.get(e.kind, 0.0) + e.dur
    out = calibrate(doc, cfg, plan, measured.report.step_time_s, busy)
    cal = out["meta"]["calibration"]
    assert cal["p2p_s"] == pytest.approx(2e-4, rel=1e-3)
    assert "host_task_s" not in cal and out["host_task_s"] == 1e-5


@pytest.mark.slow
def test_cpu_bench_measures_and_predicts(tmp_path, monkeypatch) -> None:
    cfg = ProfileConfig(Qwen2Config(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64), (1, 1, 1, 1),
                        seq=8, pp=2, iters=2)
    from braid.baselines.torch_pp import available_baselines
    from braid.measure.peers import peer_runs

    # torch eager (its compiled mode builds C++ kernels on CPU: minutes on a small machine),
    # megatron-core eager and graphed (a row that says it needs CUDA)
    peers = tuple(peer_runs(available_baselines(), ["eager"], ["eager", "graphed"], tp=1, device_type="cpu"))
    partial = tmp_path / "partial.json"
    bc = BenchConfig(cfg, ("braided_v", "1f1b_i"), (4,), warmup=1, steps=2, rounds=2, peers=peers, partial_json=str(partial))
    s = run_bench(bc)
    # after round 1 of 2, rank 0 left the summary so far: a job stopped there keeps its first round
    first = json.loads(partial.read_text())
    assert first["rounds_done"] == 1 and s["rounds_done"] == 2 and "partial: 1 of 2 rounds" in first["notes"]
    assert [(r["schedule"], len(r["step_s_rounds"])) for r in first["runs"]] == [("braided_v", 1), ("1f1b_i", 1)]
    assert [r["step_s_rounds"][0] for r in first["runs"]] == [r["step_s_rounds"][0] for r in s["runs"]]
    assert len(first["best_over_external"]["4"]["rounds"]) == 1
    assert [(r["schedule"], r["m"]) for r in s["runs"]] == [("braided_v", 4), ("1f1b_i", 4)]
    from braid import schedules
    from braid.planner.braid_tune import count_blocks

    # which blocks ran braided: the plan's count, recorded per run
    assert [r["braided_blocks"] for r in s["runs"]] == [count_blocks(schedules.build("braided_v", 2, 4)), 0]
    assert s["runs"][0]["braided_blocks"] > 0
    for r in s["runs"]:
        assert r["step_s"] > 0 and r["predicted_step_s"] > 0 and r["loss"] > 0
        assert len(r["step_s_rounds"]) == 2 and r["step_s"] == pytest.approx(sum(r["step_s_rounds"]) / 2)
        assert r["tokens_per_s"] == pytest.approx(4 * 8 / r["step_s"])
        # CPU memory accounting is exact: saved bytes at instruction ends, measured and simulated
        assert r["peak_bytes"] == r["predicted_peak_bytes"] and min(r["peak_bytes"]) > 0
        # CPU time of the launching thread per step; on CPU the step runs eager (no CUDA graph)
        assert 0 < r["host_s"] and r["cuda_graph"] == "none" and r["graph_pool_bytes"] == [None, None]
        assert r["reserved_peak_bytes"] == r["device_used_bytes"] == [None, None]  # the device's: CUDA only
        sim, meas = s["_traces"][f"{r['schedule']}_m4"]
        assert sim.meta["source"] == "simulated" and meas.meta["source"] == "measured"
        assert {e.rank for e in meas.events} == {0, 1}
    # braid's best over the best baseline, one ratio per round, from that round's runs only
    best = s["best_over_external"][4]
    ok = [e for e in s["external"] if "step_s_rounds" in e]
    assert ok and len(best["rounds"]) == 2
    for i, ratio in enumerate(best["rounds"]):
        want = min(e["step_s_rounds"][i] for e in ok) / min(r["step_s_rounds"][i] for r in s["runs"])
        assert ratio == pytest.approx(want)
    assert best["min"] <= best["median"] <= best["max"]
    cal = s["profile"]["meta"]["calibration"]
    assert cal["compute_scale"] > 0 and cal["p2p_s"] >= 0
    assert set(cal["compute_scale_per_phase"]) == {"F", "B", "W"} and min(cal["compute_scale_per_phase"].values()) > 0
    names = {e["schedule"] for e in s["external"]}
    from braid.baselines import megatron_gpt as megatron

    mcore = {"mcore:interleaved 1F1B [eager]", "mcore:interleaved 1F1B [graphed]"} if megatron.available() else set()
    assert names == {"torch:ScheduleInterleaved1F1B [eager]", "torch:ScheduleZBVZeroBubble [eager]",
                     "torch:ScheduleDualPipeV [eager]"} | mcore
    for e in s["external"]:
        assert ("error" in e and e["error"]) or e["step_s"] > 0, e
        assert e["peer"] in ("torch", "mcore") and e["schedule"].endswith(f"[{e['mode']}]")
    if megatron.available():
        assert "needs CUDA" in next(e["error"] for e in s["external"] if e["mode"] == "graphed")
    assert set(s["best_per_peer"][4]) == ({"torch", "mcore"} if megatron.available() else {"torch"})
    text = format_report(s)
    assert "braided_v" in text and "megatron-core" in text
    assert f"braid's best / best external baseline at m=4 (tokens/s, within a round): {best['median']:.3f}x" in text
    assert "over 2 rounds" in text
    # benchmarks/recalibrate_stored.py rebuilds the uncalibrated profile from the stored one:
    # with the same calibration rule, its re-fitted predictions are the stored ones
    refit = _recalibrate_stored(monkeypatch).refit
    for name, m, meas, old, new in refit(s):
        assert new == pytest.approx(old, rel=1e-6), (name, m, old, new)
    out = tmp_path / "m.json"
    s.pop("_traces")
    capture(s, out, "cpu-a")
    capture(s, out, "cpu-b")
    capture(s, out, "cpu-a")  # replaces, does not duplicate
    doc = json.loads(out.read_text())
    assert [x["name"] for x in doc["sets"]] == ["cpu-b", "cpu-a"]
    assert doc["sets"][1]["runs"][0]["step_s"] == s["runs"][0]["step_s"]
    # what a re-fit needs offline: the profile before calibration, how each run and the
    # probe ran (eager here), and the probe's measured evidence
    st = doc["sets"][1]
    assert "calibration" not in st["raw_profile"]["meta"] and st["raw_profile"]["chunks"].keys() == st["profile"]["chunks"].keys()
    assert {r["cuda_graph"] for r in st["runs"]} == {"none"} and all(r["host_s"] > 0 for r in st["runs"])
    cal = st["profile"]["meta"]["calibration"]
    assert cal["probe_runs"]["cuda_graph"] == "none" and cal["probe_runs"]["recorded_step_s"] > 0
    assert cal["probe_runs"]["host_s"] > 0 and set(cal["measured_busy_s"]) == {"F", "B", "W"}
    # where the busy time was spent: per rank, chunk and phase, every rank and chunk of the probe
    per_chunk = cal["probe_runs"]["busy_per_chunk_s"]
    assert {k[:4] for k in per_chunk} == {f"r{r}c{c}" for r in range(2) for c in range(2)}
    assert all(v >= 0 for v in per_chunk.values()) and sum(per_chunk.values()) > 0
    # the probe's default length (m = 4p) and when its measured steps and each run's ran
    assert cal["probe"] == "probe p=2 m=8"
    t0, t1 = cal["probe_runs"]["timed_wall"]
    for r in s["runs"]:
        walls = r["timed_wall_rounds"]
        assert len(walls) == 2 and all(a < b for a, b in walls) and walls[0][1] <= walls[1][0] and t1 <= walls[0][0]
        assert {k[:4] for k in r["busy_per_chunk_s"]} == {f"r{rk}c{c}" for rk in range(2) for c in range(2)}
        assert r["compute_s"] is None  # profiled only with --compute-busy (CUDA)
    assert s["compute_bound"] == {} and all(e.get("compute_s") is None for e in s["external"])
    _clocks_by_run_lines_up_an_smi_log(s, tmp_path, monkeypatch)


def _clocks_by_run_lines_up_an_smi_log(s: dict, tmp_path, monkeypatch) -> None:
    """benchmarks/clocks_by_run.py: each run's mean clock and power over its own measured steps."""
    import datetime

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    clocks = importlib.import_module("clocks_by_run")
    lines = ["index, timestamp, clocks.current.sm [MHz], power.draw [W]"]

    def at(t: float) -> str:
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]

    # GPU 0 at 1000 + 100 x (run index) MHz inside each run's measured steps, GPU 1 at 500 MHz
    for i, r in enumerate(s["runs"]):
        for a, b in r["timed_wall_rounds"]:
            mid = (a + b) / 2
            lines += [f"0, {at(mid)}, {1000 + 100 * i}, {200 + i}", f"1, {at(mid)}, 500 MHz, 100.00 W"]  # with units: --format=csv
    smi = tmp_path / "smi.csv"
    smi.write_text("\n".join(lines) + "\n")
    out = clocks.report(s, clocks.read_smi(str(smi), 0.0))
    for i, r in enumerate(s["runs"]):
        row = next(line for line in out if line.startswith(f"{r['schedule']:<16}"))
        assert row.count(f"{1000 + 100 * i} MHz  {200 + i} W   500 MHz  100 W") == 2, row
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"runs": [{k: v for k, v in r.items() if k != "timed_wall_rounds"} for r in s["runs"]]}))
    assert clocks.main([str(bench), str(smi)]) == 2  # a bench from before the epoch times were kept: one line


def test_ranking_flags_only_pairs_apart_by_more_than_the_gap() -> None:
    """A pair more than 3% apart that the prediction orders the other way is flagged; a closer one is not."""
    from braid.measure.report import ranking

    runs = [{"schedule": "a", "m": 4, "step_s": 1.00, "predicted_step_s": 1.10},
            {"schedule": "b", "m": 4, "step_s": 1.05, "predicted_step_s": 1.00},   # 5% slower, predicted faster: wrong
            {"schedule": "c", "m": 4, "step_s": 1.02, "predicted_step_s": 1.20},   # predicted slowest, within 3% of both
            {"schedule": "a", "m": 8, "step_s": 2.0, "predicted_step_s": 2.0},
            {"schedule": "b", "m": 8, "step_s": 2.2, "predicted_step_s": 2.1}]
    r = ranking(runs)
    assert r[4]["measured"] == ["a", "c", "b"] and r[4]["predicted"] == ["b", "a", "c"]
    assert [(a, b) for a, b, _ in r[4]["wrong"]] == [("a", "b")]  # c vs b: 2.9% apart, within the gap
    assert r[4]["wrong"][0][2] == pytest.approx(0.05)
    assert r[8]["wrong"] == []


def test_a_probe_out_of_device_memory_says_how_to_make_it_fit(monkeypatch) -> None:
    import torch

    from braid.measure import runs
    from braid.measure.calibrate import probe_plan

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(runs, "_run_schedule", oom)
    cfg = ProfileConfig(Qwen2Config(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64), (1, 1, 1, 1), seq=8, pp=2)
    with pytest.raises(RuntimeError, match=r"probe \(m=8.*--probe-mbs \(at least --pp 2\) or skip it with --no-calibrate"):
        runs._run_probe(None, BenchConfig(cfg), None, None, probe_plan(2, 8, 2), None)


def test_cpu_bench_runs_sequence_sharding_when_asked() -> None:
    """``--sequence-parallel`` reaches the measured runs, not only the profile: on CPU the measured
    saved-activation peak equals the simulator's sequence-sharded prediction and is below the
    same run's without sharding (each run's memory series is exact on CPU)."""
    model = Qwen2Config(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64)
    peaks = {}
    for shard in (False, True):
        cfg = ProfileConfig(model, (1, 1), seq=8, tp=2, pp=1, iters=1, seq_shard=shard)
        s = run_bench(BenchConfig(cfg, ("braided_v",), (2,), warmup=1, steps=1, rounds=1, peers=()))
        (r,) = s["runs"]
        assert r["peak_bytes"] == r["predicted_peak_bytes"], (shard, r["peak_bytes"], r["predicted_peak_bytes"])
        peaks[shard] = max(r["peak_bytes"])
    assert 0 < peaks[True] < peaks[False], peaks


def test_device_memory_lines_show_what_runs_out_per_rank() -> None:
    from braid.measure.report import format_device_memory

    gib = 2**30
    cuda = {"runs": [{"schedule": "braided_v", "m": 4, "reserved_peak_bytes": [gib, 2 * gib], "device_used_bytes": [3 * gib, 4 * gib],
                      "predicted_device_used_bytes": [2.5 * gib, 3.5 * gib]}],
            "external": [{"schedule": "mcore:interleaved 1F1B [graphed]", "m": 4, "reserved_peak_bytes": [gib, gib],
                          "device_used_bytes": [2 * gib, 2 * gib]}, {"schedule": "torch", "m": 4, "error": "no"}]}
    assert format_device_memory(cuda) == ["device memory per rank, MiB (allocator reserved peak / in use on the device; "
                                          "braid rows: / predicted in use, braid.cost.device_memory):",
                                          "  braided_v m=4: 1024/3072/2560 2048/4096/3584",
                                          "  mcore:interleaved 1F1B [graphed] m=4: 1024/2048 1024/2048"]
    cpu = {"runs": [{"schedule": "braided_v", "m": 4, "reserved_peak_bytes": [None, None]}], "external": []}
    assert format_device_memory(cpu) == []
    mib = 2**20
    split = {"pool_bytes": 300 * mib, "other_bytes": 200 * mib, "other_active_bytes": 120 * mib, "pinned_bytes": 40 * mib,
             "pinned_active_bytes": 10 * mib}
    cuda["runs"][0]["reserve_breakdown"] = [split, None]
    assert format_device_memory(cuda)[3:] == [
        "where rank 0's reserve lies after the counted steps, MiB (graph pool; other segments, in use; of those partly in use, "
        "in use):", "  braided_v m=4: 300; 200, 120; 40, 10"]


def test_the_reserve_splits_into_the_graph_pool_and_segments_partly_in_use(monkeypatch) -> None:
    import torch

    from braid.runtime.graphs import reserve_breakdown

    segments = [{"total_size": 64, "active_size": 64, "segment_pool_id": (0, 7)},  # the graph's pool
                {"total_size": 32, "active_size": 0, "segment_pool_id": (0, 0)},  # free: empty_cache returns it
                {"total_size": 20, "active_size": 5, "segment_pool_id": (0, 0)},  # pinned by one live block
                {"total_size": 8, "active_size": 8, "segment_pool_id": (0, 0)}]
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: {"segments": segments})
    assert reserve_breakdown((0, 7)) == {"pool_bytes": 64, "other_bytes": 60, "other_active_bytes": 13, "pinned_bytes": 20,
                                         "pinned_active_bytes": 5}
    assert reserve_breakdown(None)["pool_bytes"] == 0
