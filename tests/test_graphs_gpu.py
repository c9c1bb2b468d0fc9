"""Whole-step CUDA graphs on two GPUs (NCCL): a replayed step equals the eager executor bitwise.

Runs with ``PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python -m pytest -m gpu
tests/test_graphs_gpu.py`` (spawned processes, no torchrun). Each case trains two copies of
one model side by side on every rank, eager and graphed, with new micro-batches every step
(2 eager warm-up steps, the capture, 3 replays), and compares the loss, every gradient and
every parameter after AdamW with ``torch.equal`` (:func:`graph_cases.graphed_matches_eager`).
``benchmarks/graph_smoke.py`` runs the same cases one by one and prints what was captured.
"""

from __future__ import annotations

import pytest
import torch

import graph_cases as cases
from conftest import GPU_RUN_S, GPU_TEST_S

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
              pytest.mark.timeout(GPU_TEST_S)]

V_SCHEDULES = ["braided_v", "zb_v", "dualpipe_v"]


@pytest.fixture
def pool(gpu_pools):
    """The session's two GPU ranks (a pool of this module's own cost ~9 s to start and ~5 s to close)."""
    return gpu_pools(2)


def _check(got: list[list[dict]], n_runs: int) -> None:
    for rank, runs in enumerate(got):
        assert len(runs) == n_runs, f"rank {rank}: {len(runs)} runs, expected {n_runs}"
        for r in runs:
            kinds = [e.split(": ", 1)[1].split(" ")[0] for e in r["events"]]
            assert kinds[:3] == ["eager", "eager", "capture"] and kinds.count("replay") == 3, f"rank {rank} {r['run']}: {r['events']}"
            assert r["capture_peak_bytes"] and r["capture_peak_bytes"] > 0, f"rank {rank} {r['run']}: {r}"
            # every gradient is allocated by the captured backward (set to None before it), in the parameters' dtype
            assert r["captured_grad_bytes"] == r["param_bytes"] <= r["capture_peak_bytes"], f"rank {rank} {r['run']}: {r}"
            # the capture returns the segments freed while capturing (the warm-up's leftovers): nothing idle beside the pool
            assert r["cached_outside_bytes"] == 0, f"rank {rank} {r['run']}: {r}"


@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2)])
def test_graphed_replay_equals_eager_bitwise(pool, pp: int, tp: int) -> None:
    """braided_v, zb_v, dualpipe_v at pp=2 (P2P) and tp=2 (async and carried all-reduces)."""
    m = 2 * pp + 1
    runs = [(name, m, {}) for name in V_SCHEDULES]
    _check(pool.run(cases.graphed_matches_eager, pp, tp, runs, timeout_s=GPU_RUN_S), len(runs))


def test_graphed_half_layer_stages_equal_eager_bitwise(pool) -> None:
    """Stages cut between a layer's attention and its MLP (1.5, 0.5, 1.5, 0.5 layers) at pp=2: fused chunks replayed."""
    runs = [(name, 5, {}) for name in V_SCHEDULES]
    got = pool.run(cases.graphed_matches_eager, 2, 1, runs, 3, False, {4: (1.5, 0.5, 1.5, 0.5)}, timeout_s=GPU_RUN_S)
    _check(got, len(runs))


def test_graphed_sequence_parallel_equals_eager_bitwise(pool) -> None:
    """Sequence parallelism inside TP at tp=2 (braid.tp.seq_shard): reduce-scatters, unit heads on the
    executor's side stream (braid.runtime.follow), all-gathers in flight, inside the graph."""
    runs = [(name, 3, {}) for name in V_SCHEDULES]
    _check(pool.run(cases.graphed_matches_eager, 1, 2, runs, 3, False, None, True, timeout_s=GPU_RUN_S), len(runs))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_graphed_recompute_equals_eager_bitwise(pool, recompute: str) -> None:
    """braided_v and 1f1b_i at tp=2 with recomputation (full: each layer's forward re-run under autograd inside
    the backward, its all-reduces included) captured and replayed, as ``braid.plan`` picks it under a memory cap."""
    runs = [(name, 3, {}) for name in ("braided_v", "1f1b_i")]
    _check(pool.run(cases.graphed_matches_eager, 1, 2, runs, 3, False, None, False, 1, recompute, timeout_s=GPU_RUN_S),
           len(runs))


def test_graphed_offload_equals_eager_bitwise(pool) -> None:
    """braided_v with activation offload at pp=2: D2H/H2D copies on their streams inside the graph."""
    runs = [("braided_v_offload", 5, {"offload_alpha": 0.5, "offload_alpha_warmup": 0.5})]
    _check(pool.run(cases.graphed_matches_eager, 2, 1, runs, timeout_s=GPU_RUN_S), len(runs))


@pytest.mark.timeout(3 * GPU_TEST_S)
def test_graphed_compiled_units_equal_eager_bitwise(pool) -> None:
    """The units' torch.compile'd functions (the default on CUDA) inside the graph, at tp=2 (a cold
    compile cache gets the time test_executor_gpu's compiled-units case gets)."""
    _check(pool.run(cases.graphed_matches_eager, 1, 2, [("braided_v", 3, {})], 3, None, timeout_s=3 * GPU_RUN_S), 1)


def test_example_reference_with_cuda_graphs() -> None:
    """The LLM example at pp=2 with graphs on (bf16): the steps are captured and replayed, and the losses and
    gradient norms match the unsplit model within ``--reference``'s bf16 tolerance. (Not compared bitwise with
    an eager run of the example: bf16 flash-attention backward accumulates with atomics, so two processes differ.)"""
    from test_examples import LLM, _ok, _torchrun

    proc = _torchrun(2, LLM, "--model", "tiny", "--pp", "2", "--device", "cuda", "--mbs", "4", "--micro-batch-size", "2",
                     "--seq", "64", "--steps", "5", "--seed", "1", "--schedule", "braided_v", "--cuda-graph", "step", "--no-compile",
                     "--reference", "--timeout", str(GPU_RUN_S - 15), timeout=GPU_RUN_S + 5)  # a stuck wait fails the run, naming it
    _ok(proc)
    out = proc.stdout + proc.stderr
    assert "capture of" in out and "norm diff" in proc.stdout, out[-3000:]


def test_example_half_layer_cut_reference_with_cuda_graphs() -> None:
    """The same with --last-stage-lighter 0.5 (layer 3 cut between its attention and its MLP), zb_v."""
    from test_examples import LLM, _ok, _torchrun

    proc = _torchrun(2, LLM, "--model", "tiny", "--pp", "2", "--device", "cuda", "--mbs", "4", "--micro-batch-size", "2",
                     "--seq", "64", "--steps", "5", "--seed", "1", "--schedule", "zb_v", "--cuda-graph", "step", "--no-compile",
                     "--last-stage-lighter", "0.5", "--reference", "--timeout", str(GPU_RUN_S - 15), timeout=GPU_RUN_S + 5)
    _ok(proc)
    out = proc.stdout + proc.stderr
    assert "capture of" in out and "[1, 1, 1.5, 0.5] layers" in out and "norm diff" in proc.stdout, out[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
def test_graphed_chained_runs_on_the_side_stream_equal_eager_bitwise(gpu_pools) -> None:
    """PP=2 x TP=2: Send/Recv runs chained to a carried all-reduce leave from the executor's side
    stream, which joins the capture and is joined back at its end."""
    runs = [("braided_v", 5, {}), ("dualpipe_v", 5, {})]
    got = gpu_pools(4).run(cases.graphed_matches_eager, 2, 2, runs, timeout_s=GPU_RUN_S)
    _check(got, len(runs))
    assert any("chained runs" in e and " 0 chained" not in e for rank in got for r in rank for e in r["events"]), got


@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2)])
def test_graphed_vlm_equals_eager_bitwise(pool, pp: int, tp: int) -> None:
    """Qwen2-VL and Qwen2.5-VL (window attention) captured whole: the tower, the merge unit and the M-RoPE
    chunks replay bitwise like eager; micro-batches whose images sit elsewhere in the text are captured again."""
    for kind in ("qwen2_vl", "qwen2_5_vl"):
        got = pool.run(cases.vlm_graphed_matches_eager, "braided_v", pp, tp, 2 * pp + 1, kind, timeout_s=GPU_RUN_S)
        for rank, events in enumerate(got):
            kinds = [e.split(": ", 1)[1].split(" ")[0] for e in events]
            assert kinds[:3] == ["eager", "eager", "capture"] and "new" in kinds, f"rank {rank} {kind}: {events}"


def test_graphed_2d_attention_equals_eager_bitwise(pool) -> None:
    """cp=2 (2D-Attention: one ring of two ranks, each holding its zigzag share of every sequence; bf16, the
    CUDA block kernels' dtype): the ring's P2P, the loss sum over the SP group and the sharded positions replay like eager."""
    runs = [(name, 3, {}) for name in ("braided_v", "1f1b")]
    _check(pool.run(cases.graphed_matches_eager, 1, 1, runs, 3, False, None, False, 2, timeout_s=GPU_RUN_S), len(runs))
