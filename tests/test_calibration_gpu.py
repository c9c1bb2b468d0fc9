"""The bench's calibration on 2 GPUs at tp=2 x pp=1 with whole-step CUDA graphs: the probe's
evidence is kept, a graphed probe has no host lane, the fitted factors stay physical, and a
stored set re-fits offline to the bench's own predictions.

    PYTHONPATH=. NCCL_NVLS_ENABLE=0 timeout 300 python -m pytest -q tests/test_calibration_gpu.py
"""

from __future__ import annotations

import json

import pytest
import torch

from braid.measure.calibrate import SCALE_BOUNDS, fitted_factors
from braid.measure.config import BenchConfig, ProfileConfig
from braid.measure.refit import judge, refit
from braid.measure.report import capture, format_report
from braid.models.qwen2 import Qwen2Config
from conftest import GPU_RUN_S, GPU_TEST_S

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def _bench_on_rank(ctx, bc: BenchConfig):
    """The bench job (what :func:`braid.measure.runs.run_bench` spawns on every rank) on this pool rank."""
    from braid.measure.runs import _bench_job

    return _bench_job(ctx.dist, bc)


@pytest.mark.timeout(GPU_TEST_S)
def test_graphed_tp2_calibration_keeps_its_evidence_and_refits_offline(gpu_pools, tmp_path) -> None:
    """The bench job runs on the session's GPU ranks (``run_bench`` spawning two of its own cost
    ~10 s of the test's ~18 s), then is summarised as ``run_bench`` does."""
    from braid.measure.report import summarize

    model = Qwen2Config(vocab_size=1024, hidden=256, layers=1, heads=8, kv_heads=4, ffn=512)
    pc = ProfileConfig(model, (1, 1), seq=256, tp=2, pp=1, dtype="bfloat16", device="cuda", iters=3, compile=False)
    bc = BenchConfig(pc, ("braided_v", "1f1b_i"), (4,), warmup=1, steps=3, external=False, cuda_graph="step",
                     compute_busy=True)
    s = summarize(bc, gpu_pools(2).run(_bench_on_rank, bc, timeout_s=GPU_RUN_S)[0])
    cal = s["profile"]["meta"]["calibration"]
    assert cal["cuda_graph"] == "step" and cal["probe_runs"]["cuda_graph"] == "step"
    assert s["profile"]["host_task_s"] == 0.0 and s["raw_profile"]["host_task_s"] > 0.0
    assert {r["cuda_graph"] for r in s["runs"]} == {"step"}
    for r in s["runs"]:  # what the allocator held at most, per rank: at least the activation peak above what was there before
        assert len(r["reserved_peak_bytes"]) == 2 and all(res >= max(r["peak_bytes"]) > 0 for res in r["reserved_peak_bytes"]), r
        assert all(used > res for used, res in zip(r["device_used_bytes"], r["reserved_peak_bytes"])), r  # + context, NCCL
    probe = cal["probe_runs"]
    assert probe["recorded_step_s"] > 0 and probe["ar_span_s"] > 0 and probe["exposed_ar_s"] >= 0 and probe["host_s"] > 0
    assert set(cal["measured_busy_s"]) == {"F", "B", "W"} and min(cal["measured_busy_s"].values()) > 0
    assert set(s["raw_profile"]["meta"]["host_task_s_per_phase"]) == {"F", "B", "W"}
    lo, hi = SCALE_BOUNDS
    assert all(lo <= v <= hi for v in fitted_factors(cal).values()), cal
    # --compute-busy: one profiled replay per run, every rank's compute (NCCL kernels left out)
    for r in s["runs"]:
        assert len(r["compute_s"]) == 2 and min(r["compute_s"]) > 0, r["compute_s"]
        assert all(k and all(t > 0 and n > 0 for _, t, n in k) for k in r["compute_kernels"])
    assert s["compute_bound"][4]["busiest_s"] == min(max(r["compute_s"]) for r in s["runs"])
    assert "graphed: no host lane" in format_report(s) and "compute per rank at m=4" in format_report(s)
    out = tmp_path / "m.json"
    s.pop("_traces")
    capture(s, out, "gpu-tp2-graphed")
    entry = json.loads(out.read_text())["sets"][0]
    # the stored set alone gives the bench's calibration and predictions back
    again = judge(entry, refit(entry))
    for r, j in zip(s["runs"], again["runs"]):
        assert j["predicted_step_s"] == pytest.approx(r["predicted_step_s"], rel=1e-6), (r["schedule"], r["m"])
