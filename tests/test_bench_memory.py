"""``benchmarks/bench_memory.py`` at the tiny size on CPU (2 gloo processes): every optimizer and
recomputation mode measured and predicted per rank, written as JSON."""

from __future__ import annotations

import json
import math

import pytest

from test_examples import ROOT, _ok, _torchrun


@pytest.mark.slow
def test_memory_bench_runs_every_mode_at_tiny_size(tmp_path) -> None:
    out = tmp_path / "memory.json"
    _ok(_torchrun(2, str(ROOT / "benchmarks" / "bench_memory.py"), "--model", "qwen2-tiny", "--dp", "2", "--layers", "2",
                  "--seq", "16", "--mbs", "2", "--device", "cpu", "--out", str(out), timeout=600, forked=True))
    doc = json.loads(out.read_text())
    runs = {(r["optimizer"], r["recompute"]): r for r in doc["runs"]}
    assert set(runs) == {(o, r) for o in ("zero1", "master", "plain") for r in ("none", "selective", "full")}
    for r in runs.values():
        assert len(r["measured_bytes"]) == len(r["predicted_bytes"]) == 2 and min(r["measured_bytes"]) > 0
        assert math.isfinite(r["rel_err"])
        # the device figures are measured on CUDA only; the planner's device figure adds what lies outside the allocator
        assert r["reserved_bytes"] == r["device_used_bytes"] == [None, None]
        assert all(d > p for d, p in zip(r["predicted_device_bytes"], r["predicted_bytes"]))
    # fp32 on CPU: zero1 at dp=2 holds 4 + 4 + 6 bytes per parameter, master 4 + 4 + 12 -- both measured and predicted
    for key in ("measured_bytes", "predicted_bytes"):
        assert runs[("zero1", "none")][key][0] < runs[("master", "none")][key][0]
        assert runs[("zero1", "full")][key][0] < runs[("zero1", "none")][key][0]
    assert doc["command"].startswith("torchrun --nproc-per-node 2 benchmarks/bench_memory.py --model qwen2-tiny")


def test_graphed_steps_and_a_memory_snapshot_on_cpu_are_refused_in_one_line(capsys) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "benchmarks" / "bench_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "cpu", "--cuda-graph", "step"]) == 2
    assert capsys.readouterr().err.strip() == "bench_memory: --cuda-graph step needs --device cuda"
    assert bench.main(["--device", "cpu", "--memory-snapshot", "snap.pickle"]) == 2
    assert capsys.readouterr().err.strip() == ("bench_memory: --memory-snapshot records the CUDA caching allocator's "
                                               "history; it needs --device cuda")
