"""Predicted against measured peak memory per GPU on two GPUs (NCCL, bf16), every optimizer and
recomputation mode, through ``benchmarks/bench_memory.py`` (issue 37's acceptance: within 10%).

Runs with ``PYTHONPATH=. python -m pytest -m gpu tests/test_memory_gpu.py`` on a machine with two
CUDA devices; dp=2, two Qwen2-7B-shaped layers, seq 4096, uncompiled units (no compile time; the
loss then runs eager and its workspace decides the peak -- the full-size check is the bench's
documented command, 4 layers, compiled). One job of about 20 s checks

* each rank's peak against the shared model's (:meth:`braid.cost.cluster.DpCosts.peak_bytes`, as
  the bench predicts it), within 10%;
* what ``zero1`` saves against ``master`` on each rank (the masters and moments it shards, less the
  reduce-scatter shard it keeps), measured against the same model's difference, within 10%.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_examples import ROOT, _ok, _torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


@pytest.mark.timeout(120)
def test_predicted_peak_memory_and_zero1_saving_are_within_ten_percent(tmp_path) -> None:
    out = tmp_path / "memory.json"
    _ok(_torchrun(2, str(ROOT / "benchmarks" / "bench_memory.py"), "--dp", "2", "--layers", "2", "--seq", "4096",
                  "--mbs", "2", "--warmup", "1", "--steps", "1", "--no-compile", "--out", str(out), timeout=110))
    doc = json.loads(out.read_text())
    assert doc["config"]["compile"] is False
    runs = {(r["optimizer"], r["recompute"]): r for r in doc["runs"]}
    assert len(runs) == 9
    bad = [f"{o}/{rc}: {100 * r['rel_err']:.1f}%" for (o, rc), r in runs.items() if r["rel_err"] > 0.10]
    assert not bad, "prediction off by more than 10%: " + ", ".join(bad)
    saving = []
    for rc in ("none", "selective", "full"):
        m, z = runs[("master", rc)], runs[("zero1", rc)]
        for k in range(2):
            meas = m["measured_bytes"][k] - z["measured_bytes"][k]
            pred = m["predicted_bytes"][k] - z["predicted_bytes"][k]
            if not abs(meas - pred) <= 0.10 * pred:
                saving.append(f"{rc} rank {k}: saved {meas / 2**20:.0f} MiB, predicted {pred / 2**20:.0f} MiB")
    assert not saving, "zero1's saving over master off by more than 10%: " + ", ".join(saving)
    # each case starts from what the cases before it freed (the peak would otherwise carry their leftovers)
    left = [f"{o}/{rc}: {max(r['leftover_bytes']) / 2**20:.0f} MiB" for (o, rc), r in runs.items()
            if max(r["leftover_bytes"]) > 0.01 * min(r["measured_bytes"])]
    assert not left, "memory left from earlier cases: " + ", ".join(left)
