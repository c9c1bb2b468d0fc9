"""The sharded fp32-master optimizer on two GPUs (NCCL, bf16 compute), through the example script.

Runs with ``PYTHONPATH=. python -m pytest -m gpu tests/test_training_gpu.py`` on a machine
with two CUDA devices (the script is launched with torchrun, as a user would).

* bf16 with fp32 masters sharded over dp=2, warm-up + cosine, clipping, selective
  recomputation: losses and gradient norms within the bf16 tolerance of the unsplit model;
* ``--optimizer zero1`` lowers each rank's peak memory below ``--optimizer master``'s by the optimizer
  state it no longer holds -- 12 bytes per parameter times (1 - 1/dp), less the all-gather
  bucket -- within 10%.
"""

from __future__ import annotations

import pytest
import torch

from test_examples import LLM, _metrics, _ok, _torchrun

# torchrun jobs: each test's limit is the sum of its jobs' (RUN_S each); --no-compile keeps a
# cold inductor cache (minutes on a fresh machine) out of what these tests measure.
RUN_S = 90
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

FLAGS = ["--model", "small", "--dp", "2", "--device", "cuda", "--micro-batch-size", "2", "--seq", "256", "--mbs", "2",
         "--schedule", "1f1b", "--seed", "1", "--no-compile"]


@pytest.mark.timeout(RUN_S + 10)
def test_bf16_zero1_with_schedule_clipping_and_recompute_matches_the_unsplit_model() -> None:
    proc = _torchrun(2, LLM, *FLAGS, "--steps", "4", "--optimizer", "zero1", "--lr-schedule", "cosine", "--warmup", "1",
                     "--clip-grad", "1.0", "--weight-decay", "0.1", "--recompute", "selective", "--reference", timeout=RUN_S)
    _ok(proc)
    assert "norm diff" in proc.stdout


@pytest.mark.timeout(2 * RUN_S + 10)
def test_zero1_saves_the_predicted_optimizer_memory(tmp_path) -> None:
    from braid.models.qwen2 import Qwen2Model
    from braid.models.qwen2_vl import LM_PRESETS
    from braid.training import optimizer

    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen2Model(LM_PRESETS["small"]).parameters())
    peaks = {}
    for mode in ("master", "zero1"):
        m = tmp_path / f"{mode}.jsonl"
        _ok(_torchrun(2, LLM, *FLAGS, "--steps", "3", "--optimizer", mode, "--metrics", str(m), timeout=RUN_S))
        peaks[mode] = max(_metrics(m)[-1]["peak_memory_bytes"])
    shard = -(-n // 2)
    bucket = min(shard, optimizer.BUCKET)
    predicted = 12 * n * (1 - 1 / 2) - (2 * bucket + bucket) * 2  # states no longer held, less the bf16 gather buffer + cast
    saved = peaks["master"] - peaks["zero1"]
    assert abs(saved - predicted) <= 0.1 * predicted, f"saved {saved / 2**20:.0f} MiB, predicted {predicted / 2**20:.0f} MiB"
