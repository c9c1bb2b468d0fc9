"""The sharded fp32-master optimizer on two GPUs (NCCL, bf16 compute), through the example script.

Runs with ``PYTHONPATH=. python -m pytest -m gpu tests/test_training_gpu.py`` on a machine
with two CUDA devices (the script is launched with torchrun, as a user would).

bf16 with fp32 masters sharded over dp=2, warm-up + cosine, clipping, selective recomputation:
losses and gradient norms within the bf16 tolerance of the unsplit model. What ``zero1`` saves
over ``master`` in peak memory is checked against the shared memory model by
``tests/test_memory_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from test_examples import LLM, _ok, _torchrun

# a torchrun job: the test's limit is its job's (RUN_S) and a margin; --no-compile keeps a
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

