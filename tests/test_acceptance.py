"""``python -m braid.acceptance``: its plumbing for real on CPU (``--cpu-smoke``), its refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _acceptance(*args: str, timeout: float = 120, forked: bool = False) -> subprocess.CompletedProcess:
    """``python -m braid.acceptance ARGS``; ``forked``: forked from the session's fork server (``forkserver.py``),
    its parts then too (they start ``sys.executable``), for a run whose launch is not what the test checks."""
    from forkserver import shared_bin

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    exe = str(shared_bin() / "python") if forked else sys.executable
    return subprocess.run([exe, "-m", "braid.acceptance", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_exits_2_with_one_line(tmp_path) -> None:
    proc = _acceptance("--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no CUDA device found" in proc.stderr and "--cpu-smoke" in proc.stderr
    assert not (tmp_path / "out").exists(), "refused before any work"


def test_bad_arguments_are_one_line(tmp_path) -> None:
    (tmp_path / "f").write_text("")
    for args, msg in ((["--out", str(tmp_path / "f")], "exists and is not a directory"),
                      (["--out", str(tmp_path), "--budget-s", "0"], "--budget-s"),
                      (["--out", str(tmp_path), "--only", "nope"], "invalid choice")):
        proc = _acceptance(*args, "--cpu-smoke")
        assert proc.returncode == 2 and msg in proc.stderr and proc.stderr.count("\n") == 1, (args, proc.stderr)


def test_cpu_smoke_writes_each_result_and_the_summary(tmp_path) -> None:
    out = tmp_path / "acc"
    parts = ["gpu-tests", "executor-limit", "bench-tp1-pp2", "braided-overlap"]  # bench-tp2-pp1: the same code path
    proc = _acceptance("--out", str(out), "--cpu-smoke", "--only", *parts, forked=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "summary.json").read_text())
    assert doc["mode"] == "cpu-smoke" and doc["device"] == "cpu" and doc["torch"] == torch.__version__
    assert doc["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    rows = {r["name"]: r for r in doc["parts"]}
    assert list(rows) == parts and all(r["status"] == "passed" for r in rows.values()), rows
    tests = rows["gpu-tests"]["tests"]
    assert tests["passed"] == len(tests["cases"]) > 0 and tests["failed"] == tests["error"] == 0
    assert all(c["id"].startswith("tests.test_reference_error::") for c in tests["cases"]), tests["cases"]
    assert rows["executor-limit"]["headline"]["braid_best/eager"] > 0
    bench = rows["bench-tp1-pp2"]["headline"]["m=4"]
    assert bench["min"] <= bench["median"] <= bench["max"] and bench["median"] > 0
    assert rows["braided-overlap"]["headline"]["gloo"] > 0
    overlap = json.loads((out / rows["braided-overlap"]["result"]).read_text())["gloo"]
    assert overlap["ends_ar"] > 0 and overlap["ends_exposed_ar_ms"] >= 0  # the unbraided first F and last BW, alone
    for r in rows.values():
        assert (out / r["log"]).is_file() and (out / r["result"]).is_file(), r
        assert r["seconds"] <= r["budget_s"]
    assert doc["table"] == proc.stdout.splitlines()[-len(doc["table"]) - 1:-1], "summary.json holds the printed table"
    bench_line = next(line for line in doc["table"] if line.startswith("bench-tp1-pp2"))
    assert "m=4 braid (braided_v, eager units, no graph) / best external" in bench_line, bench_line
    assert "braid / torch:ScheduleInterleaved1F1B [eager]" in bench_line, bench_line
    assert bench["peers"]["torch"]["best_row"] == "torch:ScheduleInterleaved1F1B [eager]"
    # the memory line: braid's fastest run's peak per rank, measured / predicted, as the bench's JSON has it
    run = json.loads((out / rows["bench-tp1-pp2"]["result"]).read_text())["runs"][0]
    mem = bench["memory"]
    assert mem["measured_mib"] == [round(b / 2**20, 1) for b in run["peak_bytes"]] and len(mem["measured_mib"]) == 2
    assert mem["predicted_mib"] == [round(b / 2**20, 1) for b in run["predicted_peak_bytes"]]
    line = doc["table"][doc["table"].index(bench_line) + 1]
    assert line.strip().startswith("memory m=4 braided_v: peak MiB per rank measured/predicted"), line


def test_a_part_past_its_budget_is_stopped_and_reported(tmp_path) -> None:
    out = tmp_path / "acc"
    proc = _acceptance("--out", str(out), "--cpu-smoke", "--only", "bench-tp2-pp1", "--budget-s", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (row,) = json.loads((out / "summary.json").read_text())["parts"]
    assert row["status"] == "timeout" and "timeout" in proc.stdout
    if row["result"] is None:  # stopped before its first round ended
        assert row["headline"] is None and "no result" in proc.stdout
    else:  # rounds ended in the grace after the stop (SIGINT, then 20 s): the bench left what it finished
        doc = json.loads((out / row["result"]).read_text())
        assert 1 <= doc["rounds_done"] <= doc["config"]["rounds"], doc["rounds_done"]
        partial = any(n.startswith("partial:") for n in doc["notes"])
        assert partial == (doc["rounds_done"] < doc["config"]["rounds"]), doc["notes"]


def test_overlap_hidden_in_blocks_leaves_out_the_unbraided_ends(monkeypatch) -> None:
    """bench_braided_overlap: of 60 all-reduces (10 in the first F and last BW, which have no
    partner), 1 ms exposed in the braided step of which 0.6 ms in the ends measured alone: the
    blocks' 50 all-reduces of 0.1 ms each left 0.4 ms exposed, 92% hidden."""
    import importlib

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = importlib.import_module("bench_braided_overlap")
    row = {"overlap": {"ar_alone_s": 1e-4}, "braided": (0.05, 1e-3, {"AR": 60}), "ends": (0.01, 6e-4, {"AR": 10})}
    assert bench._hidden_in_blocks(row) == pytest.approx(0.92)
    assert bench._hidden_in_blocks({**row, "overlap": None}) is None  # CPU: no all-reduce measured alone
    assert bench._hidden_in_blocks({**row, "ends": (0.01, 2e-3, {"AR": 10})}) == 1.0  # the ends alone exposed more
    # a burst of the step's 60 all-reduces timed alone (3 ms) is what they take, where it was timed
    assert bench._hidden_in_blocks({**row, "ar_burst_s": 3e-3}) == pytest.approx(1 - 4e-4 / 2.5e-3)


def test_overlap_profile_splits_exposed_time_into_slowed_waiting_and_other_idle(monkeypatch) -> None:
    """bench_braided_overlap --profile: the profiled step spans 75 ms with its all-reduces and 71 ms
    without; busy 70 vs 68 ms, waiting for collectives 1.5 vs 0.5 ms, other idle 3.5 vs 2.5 ms: of
    the 4 ms exposed, 2 ms kernels slowed beside the all-reduces, 1 ms waiting, 1 ms other idle."""
    import importlib

    from braid.measure.device_busy import StepProfile

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = importlib.import_module("bench_braided_overlap")
    ar = StepProfile(0.075, 0.070, 0.0015, 0.0035, [("gemm", 0.050, 9), ("norm", 0.020, 9)])
    skip = StepProfile(0.071, 0.068, 0.0005, 0.0025, [("gemm", 0.0485, 9), ("norm", 0.0195, 9)])
    split = bench._exposed_split({"braided": (0.075, 4e-3, {"AR": 60}), "busy_braided": (ar, skip)}, "braided")
    assert split["profiled_exposed_ms"] == pytest.approx(4.0)
    assert (split["slowed_ms"], split["waiting_ms"], split["other_idle_ms"]) == (pytest.approx(2.0), pytest.approx(1.0),
                                                                                 pytest.approx(1.0))
    assert split["profiled_exposed_ms"] == pytest.approx(split["slowed_ms"] + split["waiting_ms"] + split["other_idle_ms"])
    assert [k for k, _ in split["kernels_grown_ms"]] == ["gemm", "norm"]
    assert split["kernels_grown_ms"][0][1] == pytest.approx(1.5)
    assert bench._exposed_split({"braided": (0.075, 4e-3, {})}, "plain") is None  # not profiled


@pytest.mark.parametrize("argv, says", [
    (["--tiny", "--profile"], "--tiny runs on CPU"),
    (["--tiny", "--profile", "-1"], "0 or more"),
    (["--tiny", "--trace", "."], "needs --profile"),
    (["--profile", "--trace", "no/such/dir"], "not a directory"),
])
def test_overlap_bench_refuses_bad_profile_options_in_one_line(monkeypatch, capsys, argv, says) -> None:
    import importlib

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = importlib.import_module("bench_braided_overlap")
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err.strip().splitlines()[-1]


def _flag(argv: tuple[str, ...], name: str) -> list[str]:
    """The values after ``name`` in ``argv``, up to the next flag ([] where it is absent)."""
    if name not in argv:
        return []
    rest = argv[argv.index(name) + 1:]
    return list(next((rest[:i] for i, a in enumerate(rest) if a.startswith("--")), rest))


@pytest.mark.parametrize("mcore", [True, False])
def test_gpu_parts_run_braid_at_its_defaults_against_each_peer_at_its_best(monkeypatch, tmp_path, mcore) -> None:
    """The GPU plan: braid as the benches run it by default (no --no-compile, no --cuda-graph, the
    default schedules and TP backend), each peer in its best mode; sizes only are the part's own."""
    from braid import acceptance
    from braid.baselines.modes import BEST_MCORE_MODE, best_torch_mode

    monkeypatch.setattr(acceptance, "_has_mcore", lambda: mcore)
    plan = {p.name: p for p in acceptance.parts(tmp_path, smoke=False)}
    assert list(plan) == list(acceptance.WEIGHTS)
    for p in plan.values():
        assert not {"--no-compile", "--cuda-graph", "--tp-backend", "--schedule", "--device"} & set(p.argv), p.argv
        assert p.gpus == (1 if p.name in ("gpu-tests", "executor-limit") else 2)
    assert set(_flag(plan["executor-limit"].argv, "--skip")) == {"braid_eager", "braid_nograph"}  # the compiled loop runs
    for name, tp in (("bench-tp1-pp2", 1), ("bench-tp2-pp1", 2)):
        argv = plan[name].argv
        assert argv[1:3] == ("-m", "braid.bench") and _flag(argv, "--tp") == [str(tp)]
        assert _flag(argv, "--baselines") == ["torch_1f1b_i", *(["mcore_1f1b_i"] if mcore else [])]
        assert _flag(argv, "--torch-modes") == [best_torch_mode(tp)] and _flag(argv, "--mcore-modes") == [BEST_MCORE_MODE]
        assert _flag(argv, "--json") == [str(tmp_path / plan[name].result)]
    assert best_torch_mode(1) == "compile" and best_torch_mode(2) == "titan+compile+async_tp"
    smoke = {p.name: p for p in acceptance.parts(tmp_path, smoke=True)}
    assert all(p.gpus == 0 for p in smoke.values()) and "--tiny" in smoke["braided-overlap"].argv
    assert all(_flag(smoke[n].argv, "--device") == ["cpu"] for n in ("executor-limit", "bench-tp1-pp2", "bench-tp2-pp1"))


def test_bench_headline_names_braids_run_each_peers_best_row_and_the_memory_line(tmp_path) -> None:
    """Of a bench JSON with two schedules at m=4 (zb_v the faster, graphed) and two peers: zb_v's
    run, its peak per rank measured (the capture's) and predicted, and each peer's best row."""
    from braid.acceptance import _bench_headline, summarize

    mib = 2**20
    runs = [{"schedule": "braided_v", "m": 4, "step_s": 0.12, "cuda_graph": "step", "peak_bytes": [9 * mib, 9 * mib],
             "predicted_peak_bytes": [8 * mib, 8 * mib], "peak_err": 0.125},
            {"schedule": "zb_v", "m": 4, "step_s": 0.10, "cuda_graph": "step", "peak_bytes": [7.5 * mib, 6 * mib],
             "predicted_peak_bytes": [7 * mib, 6.5 * mib], "peak_err": 0.0714}]
    per_peer = {"mcore": {"median": 1.1, "best_rows": ["mcore:interleaved 1F1B [graphed]"] * 2},
                "torch": {"median": 1.3, "best_rows": ["torch:ScheduleInterleaved1F1B [compile]"] * 2}}
    doc = {"config": {"compile": True}, "runs": runs, "best_per_peer": {"4": per_peer},
           "best_over_external": {"4": {"rounds": [1.1, 1.12], "median": 1.11, "min": 1.1, "max": 1.12}}}
    (tmp_path / "b.json").write_text(json.dumps(doc))
    h = _bench_headline(tmp_path / "b.json")["m=4"]
    assert h["braid"] == {"schedule": "zb_v", "compiled": True, "cuda_graph": True} and h["rounds"] == 2
    assert h["peers"] == {"mcore": {"median": 1.1, "best_row": "mcore:interleaved 1F1B [graphed]"},
                          "torch": {"median": 1.3, "best_row": "torch:ScheduleInterleaved1F1B [compile]"}}
    assert h["memory"] == {"schedule": "zb_v", "graph_capture": True, "measured_mib": [7.5, 6.0], "predicted_mib": [7.0, 6.5],
                           "max_err": 0.0714}
    row = {"name": "bench-tp1-pp2", "status": "passed", "seconds": 90.0, "budget_s": 105.0, "log": "x.log", "headline": {"m=4": h}}
    head, line, mem = summarize([row])
    assert line.endswith("m=4 braid (zb_v, compiled units, CUDA graph) / best external 1.110x [1.100, 1.120] over 2 rounds; "
                         "braid / mcore:interleaved 1F1B [graphed] 1.100x; braid / torch:ScheduleInterleaved1F1B [compile] 1.300x")
    assert mem.strip() == ("memory m=4 zb_v: peak MiB per rank measured/predicted 7.5/7.0 6.0/6.5 (worst error 7.1%; "
                           "measured: the CUDA graph's capture peak, with the gradients)")


@pytest.mark.parametrize("visible, first", [(None, "0"), ("2,3", "2"), (" 5 , 6", "5"), ("", "0")])
def test_the_one_gpu_part_stays_on_the_devices_the_run_was_given(monkeypatch, tmp_path, visible, first) -> None:
    from braid import acceptance

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    plan = {p.name: p for p in acceptance.parts(tmp_path, smoke=False)}
    assert plan["executor-limit"].env == {"CUDA_VISIBLE_DEVICES": first}
