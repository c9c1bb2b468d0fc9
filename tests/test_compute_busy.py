"""The compute busy time per rank (``braid.bench --compute-busy``): the union of a profiled step's
kernels on one device, NCCL kernels and copies left out, and the ceiling it sets against the best
baseline."""

from __future__ import annotations

import pytest
import torch

from braid.measure.device_busy import StepProfile, compute_busy_s, compute_intervals, idle_split, top_kernels, union_length
from braid.measure.report import compute_bound, format_compute


def test_union_counts_overlaps_once_and_gaps_not_at_all() -> None:
    assert union_length([]) == 0.0
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7), (3, 4)]) == pytest.approx(5.0)  # [0, 4] and [5, 6]
    with pytest.raises(ValueError, match="ends before it starts"):
        union_length([(2, 1)])


def test_compute_intervals_keep_this_devices_kernels_and_memsets_only() -> None:
    def ev(cat, name, ts, dur, device=0, ph="X"):
        return {"ph": ph, "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"device": device, "stream": 7}}

    events = [ev("kernel", "sm90_xmma_gemm_bf16", 10, 5),
              ev("gpu_memset", "Memset (Device)", 16, 1),
              ev("kernel", "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 0, 100),  # spins on its peer
              ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 20, 30),  # a copy engine, beside the kernels
              ev("kernel", "sm90_xmma_gemm_bf16", 12, 50, device=1),  # another device's
              ev("cpu_op", "aten::mm", 10, 5),
              {"ph": "M", "name": "process_name", "args": {"name": "python"}}]
    assert compute_intervals(events, 0) == [(10.0, 15.0), (16.0, 17.0)]
    assert compute_intervals(events, 1) == [(12.0, 62.0)]
    events.append(ev("kernel", "Memset (Device)", 30, 3))
    events.append(ev("kernel", "sm90_xmma_gemm_bf16", 40, 6))
    assert top_kernels(events, 0, 2) == [("sm90_xmma_gemm_bf16", pytest.approx(11e-6), 2), ("Memset (Device)", pytest.approx(4e-6), 2)]


def test_compute_busy_needs_cuda() -> None:
    with pytest.raises(ValueError, match="not a CUDA device"):
        compute_busy_s(lambda: None, torch.device("cpu"))


def _run(name: str, m: int, compute: list[float] | None, step: float) -> dict:
    return {"schedule": name, "m": m, "step_s": step, "compute_s": compute}


def test_compute_bound_takes_the_least_busiest_rank_and_the_least_mean_against_the_best_baseline() -> None:
    runs = [_run("a", 8, [0.20, 0.16], 0.21), _run("b", 8, [0.21, 0.13], 0.22), _run("a", 4, None, 0.1)]
    ext = [{"schedule": "x [compile]", "m": 8, "step_s": 0.25, "compute_s": [0.24, 0.23]},
           {"schedule": "y [eager]", "m": 8, "step_s": 0.30, "compute_s": None},
           {"schedule": "z [graphed]", "m": 8, "error": "needs CUDA"}]
    b = compute_bound(runs, ext)
    assert list(b) == [8]  # m=4 was not profiled
    row = b[8]
    assert (row["busiest_of"], row["busiest_s"]) == ("a", 0.20)
    assert row["mean_of"] == "b" and row["mean_s"] == pytest.approx(0.17)
    assert row["external"] == "x [compile]" and row["ceiling"] == pytest.approx(1.25)
    assert row["ceiling_balanced"] == pytest.approx(0.25 / 0.17)
    assert compute_bound(runs, [])[8].get("ceiling") is None  # no baseline row: the figures without a ceiling
    lines = format_compute({"runs": runs, "external": ext, "compute_bound": b})
    assert lines[0].startswith("compute per rank at m=8") and "a 200.0/160.0" in lines[0] and "x [compile] 240.0/230.0" in lines[0]
    assert "y [eager]" not in lines[0]
    assert "gets past 1.250x" in lines[1] and f"no bubble {0.25 / 0.17:.3f}x" in lines[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compute_busy_sees_a_graph_replays_kernels_and_not_its_idle_time() -> None:
    """A CUDA graph of GEMMs with a host sleep before its replay: the profiler sees the graph's
    kernels (busy > 0), and the 50 ms the device sat idle are not counted (20 GEMMs of 2048^3
    take well under a millisecond on any GPU that runs bf16)."""
    import time

    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(3):
            b = a @ a  # warm-up (cuBLAS workspaces) outside the capture
    torch.cuda.current_stream(dev).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            b = a @ a
    def step():
        time.sleep(0.05)  # idle device, then the replay
        g.replay()

    t = time.perf_counter()
    busy, _, top = compute_busy_s(step, dev, 3)
    wall = time.perf_counter() - t
    assert 0 < busy < 0.05 < wall
    assert top and top[0][2] == 20  # the 20 GEMMs of one replay, one kernel name
    del b


def test_compare_kernels_lines_up_two_schedules_kernels(monkeypatch, tmp_path, capsys) -> None:
    """benchmarks/compare_kernels.py: the kernels of two profiled runs of one rank side by side."""
    import importlib
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    ck = importlib.import_module("compare_kernels")
    doc = {"runs": [{"schedule": "a", "m": 8, "compute_kernels": [[["gemm", 0.002, 4]], [["gemm", 0.003, 4], ["add", 0.001, 9]]]},
                    {"schedule": "b", "m": 8, "compute_kernels": [[["gemm", 0.002, 4]], [["gemm", 0.004, 4]]]},
                    {"schedule": "a", "m": 4, "compute_kernels": None}],
           "external": [{"schedule": "x [eager]", "m": 8, "error": "needs CUDA"}]}
    lines = ck.table(doc, 8, 1, None, 10)
    assert lines[1].split() == ["3.00", "x4", "4.00", "x4", "gemm"]
    assert lines[2].split() == ["1.00", "x9", "-", "add"]
    assert lines[-1].split()[:2] == ["4.00", "4.00"]
    path = tmp_path / "b.json"
    path.write_text(json.dumps(doc))
    assert ck.main([str(path), "--m", "4"]) == 2 and "no run at m=4 was profiled" in capsys.readouterr().err
    assert ck.main([str(path), "--m", "8", "--schedule", "c"]) == 2 and "'c' has no profiled kernels" in capsys.readouterr().err
    assert ck.main([str(path), "--m", "8", "--rank", "2"]) == 2 and "rank 2 outside 0..1" in capsys.readouterr().err
    assert ck.main([str(path), "--m", "8", "--rank", "0"]) == 0 and "gemm" in capsys.readouterr().out


def test_idle_split_separates_waiting_for_a_collective_from_other_gaps() -> None:
    """Compute [0,10] [30,40] [42,50], an NCCL kernel ending at 25 on this device and one at 41
    on another: the 20 us gap closed 5 us after the collective ended (waited for it); the 2 us
    gap had no collective of this device ending in it (other idle)."""
    def ev(name, ts, dur, device=0):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"device": device}}

    events = [ev("gemm", 0, 10), ev("gemm", 30, 10), ev("norm", 42, 8),
              ev("ncclDevKernel_AllReduce_Sum_bf16", 5, 20), ev("ncclDevKernel_AllReduce_Sum_bf16", 20, 21, device=1)]
    span, waiting, other = idle_split(events, 0)
    assert (span, waiting, other) == (pytest.approx(50e-6), pytest.approx(20e-6), pytest.approx(2e-6))
    assert span == pytest.approx(union_length(compute_intervals(events, 0)) / 1e6 + waiting + other)
    # a collective that ended long before the gap closed did not hold the next kernel back
    assert idle_split(events, 0, slack_us=4.0)[1:] == (0.0, pytest.approx(22e-6))
    assert idle_split([], 0) == (0.0, 0.0, 0.0)


def test_mean_of_step_profiles_keeps_the_split_additive() -> None:
    a = StepProfile(0.075, 0.070, 0.002, 0.003, [("gemm", 0.050, 10), ("norm", 0.020, 4)])
    b = StepProfile(0.077, 0.071, 0.001, 0.005, [("gemm", 0.052, 10)])
    m = StepProfile.mean([a, b])
    assert (m.span_s, m.busy_s, m.waiting_s, m.other_idle_s) == (pytest.approx(0.076), pytest.approx(0.0705),
                                                                 pytest.approx(0.0015), pytest.approx(0.004))
    assert m.span_s == pytest.approx(m.busy_s + m.waiting_s + m.other_idle_s)
    assert m.top == [("gemm", pytest.approx(0.051), 10), ("norm", pytest.approx(0.010), 2)]  # norm unlisted in b: 0 there
    with pytest.raises(ValueError, match="no step profiles"):
        StepProfile.mean([])


def test_after_mark_leaves_out_what_ran_before_the_profiled_step() -> None:
    """A barrier's kernels (before the step's annotation) are not the step's: the span starts at the step."""
    from braid.measure.device_busy import STEP_MARK, after_mark

    def ev(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"device": 0}}

    events = [ev("kernel", "fill", 0, 1), ev("kernel", "ncclDevKernel_AllReduce_Sum_f32", 1, 500),
              ev("user_annotation", STEP_MARK, 600, 100), ev("kernel", "gemm", 605, 50), ev("kernel", "gemm", 660, 30),
              {"ph": "M", "name": "process_name", "args": {"name": "python"}}]
    kept = after_mark(events)
    assert [e["name"] for e in kept] == [STEP_MARK, "gemm", "gemm", "process_name"]
    assert idle_split(kept, 0) == (pytest.approx(85e-6), 0.0, pytest.approx(5e-6))
    assert after_mark(events[:2]) == events[:2]  # no mark: every event


def test_after_mark_refuses_a_trace_without_the_mark_when_it_is_required() -> None:
    from braid.measure.device_busy import after_mark

    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 5, "args": {"device": 0}}]
    with pytest.raises(RuntimeError, match="not in the trace"):
        after_mark(events, required=True)
