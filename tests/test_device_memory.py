"""The device-memory model (:mod:`braid.cost.device_memory`) held to the stored GPU measurements.

The constants must equal the figures of the measurement file they come from; the model must give,
for every braid row of the stored bench files (2 and 4 H100s), each rank's memory outside the
allocator (device in use less the allocator's reserved peak) within 5%. The whole prediction (the
reserve from the simulator's allocator peak, plus that) is checked against the band the data supports:
it is low on every row (see ``OVER``/``UNDER``), by the allocator peak the simulator under-predicts and,
at pp=2, by the eager reserve a graphed run keeps beside its pool.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from braid import schedules
from braid.core.ctas import default_max_ctas
from braid.cost.device_memory import (DEVICE_TERMS, H100_TORCH211, MEASURED, MEASURED_CE, MEASURED_GRAPH, MEMORY_MARGIN,
                                      ce_staging_bytes, graph_exec_bytes, nccl_bytes, outside_allocator_bytes, pipeline_peers,
                                      planned_device_bytes, reserve_bytes, tp_comm_of)
from braid.io.trace import Event, Trace
from braid.measure.memory_terms import above_held
from braid.measure.device_prediction import (DTYPE_BYTES, PRE_FLAG_CTAS, captured_peak, chunk_param_bytes,
                                             predicted_device_used, rank_params)

ROOT = Path(__file__).resolve().parent.parent
BENCH_FILES = ("bench_7b_h100x4_tp2_pp2.json", "bench_7b_h100x4_tp4_pp1.json", "sp_tp2_pp1_h100_busy.json",
               "bench_7b_h100x4_tp4_pp1_ctas.json")
OUTSIDE_TOL = 0.05
# the whole prediction's relative error on the stored rows lies in [UNDER, OVER] (worst seen: -44.1%, tp2 x pp2
# zb_v rank 0, a row that kept the reserve of the rows before it; best: -6.0%, tp4 1f1b_i)
UNDER, OVER = -0.45, 0.0
# rows measured with the allocator's cache emptied before each row (braid.bench since then): every rank within
CLEAN_FILES, CLEAN_TOL = ("bench_7b_h100x4_tp4_pp1_ctas.json",), 0.10


def _terms(rank: int = 0) -> dict[str, dict]:
    doc = json.loads((ROOT / MEASURED).read_text())
    return {t["term"]: t for t in doc["ranks"][rank]["terms"]}


def test_constants_are_the_measured_figures() -> None:
    t = _terms()
    v = lambda name: t[name]["value"]  # noqa: E731
    c = H100_TORCH211
    assert c.context == v("context.this_process")
    assert c.default_group == v("nccl.default_group")
    assert c.group == v("nccl.new_group")
    assert c.capped_group == v("nccl.capped_group")
    assert c.p2p_pair == v("nccl.p2p_pair")
    # the layout's groups at tp=2 x pp=1: the capped TP group and four of one rank
    assert c.capped_group + 4 * c.single_group == v("nccl.layout_groups")
    mm = t["blas.default_stream.mm"]
    assert c.blas == mm["value"] - mm["detail"]["reserved_delta"]
    first = f"step.{json.loads((ROOT / MEASURED).read_text())['config']['schedule'][0]}.eager.uncompiled.nonallocator"
    assert c.step_modules == v(first)
    for s in ("braided_v", "1f1b_i", "zb_v"):
        held = t[f"step.{s}.eager.allocated_peak"]["detail"]["end"]["allocated"]  # the state after the steps
        assert c.fragmentation[s] == above_held(v(f"step.{s}.eager.reserved_peak"), v(f"step.{s}.eager.allocated_peak"), held)
        assert c.pool_ratio[s] == v(f"step.{s}.graphed.graph_pool") / v(f"step.{s}.graphed.capture_peak")


def test_the_measured_layout_adds_up_to_its_terms() -> None:
    """At the measured layout (tp=2 x pp=1, capped TP) the communicators are the measured default and layout groups."""
    t = _terms()
    got = nccl_bytes(H100_TORCH211, tp=2, pp=1, pp_rank=0)
    assert got == t["nccl.default_group"]["value"] + t["nccl.layout_groups"]["value"]


@pytest.mark.parametrize("pp, rank, placement, want", [(1, 0, "v", 0), (2, 0, "v", 1), (2, 1, "loop", 1), (4, 0, "v", 1),
                                                       (4, 2, "v", 2), (4, 0, "loop", 2), (4, 3, "loop", 2)])
def test_pipeline_peers(pp: int, rank: int, placement: str, want: int) -> None:
    assert pipeline_peers(pp, rank, placement) == want


def test_groups_of_more_ranks_cost_more_than_groups_of_one() -> None:
    t = H100_TORCH211
    base = outside_allocator_bytes(t, tp=2, pp=1, pp_rank=0)
    assert outside_allocator_bytes(t, tp=2, pp=1, pp_rank=0, dp=2) == base + 2 * (t.group - t.single_group)
    assert outside_allocator_bytes(t, tp=2, pp=1, pp_rank=0, tp_backend="nccl") == base + t.group - t.capped_group
    with pytest.raises(ValueError, match="pipeline rank 2"):
        pipeline_peers(2, 2)


def test_the_capped_group_holds_buffers_per_thread_block() -> None:
    """NCCL's buffers are per channel: the capped TP group at 16 thread blocks holds 4x what it holds at 4, its
    default at tp=4 is the wider cap, and 0 (NCCL's own choice) is the uncapped group."""
    t = H100_TORCH211
    at4 = outside_allocator_bytes(t, tp=4, pp=1, pp_rank=0, tp_max_ctas=4)
    assert outside_allocator_bytes(t, tp=4, pp=1, pp_rank=0, tp_max_ctas=16) == at4 + 3 * t.capped_group
    assert outside_allocator_bytes(t, tp=4, pp=1, pp_rank=0) == outside_allocator_bytes(
        t, tp=4, pp=1, pp_rank=0, tp_max_ctas=default_max_ctas(4))
    assert outside_allocator_bytes(t, tp=4, pp=1, pp_rank=0, tp_max_ctas=0) == outside_allocator_bytes(
        t, tp=4, pp=1, pp_rank=0, tp_backend="nccl")


def test_reserve_eager_and_graphed() -> None:
    t = H100_TORCH211
    assert reserve_bytes(t, "1f1b_i", static_bytes=1.0, peak_bytes=3.0, graphed=False) == 1 + 3 * t.fragmentation["1f1b_i"]
    assert reserve_bytes(t, "braided_v", static_bytes=1.0, peak_bytes=3.0, graphed=True) == 1 + 3 * t.pool_ratio["braided_v"]
    # a schedule not measured takes the largest factor
    assert t.fragmentation_of("dualpipe_v") == max(t.fragmentation.values())


def test_a_captured_step_keeps_its_activations_beside_the_optimizers_temporaries() -> None:
    """Eager, the update's temporaries reuse the activations' freed blocks; under a whole-step CUDA graph (the
    examples' default on CUDA) the graph's pool keeps the activations' bytes between replays and the update,
    outside the graph, allocates beside it (the capped planner's pick, eager 6.20 GiB in use under a 6 GiB cap,
    stopped at its first captured step)."""
    from braid.core.capture import captured_by_default
    from braid.planner.search import Problem, device_memory

    gib = 2.0**30
    kw = dict(static_bytes=2 * gib, activation_bytes=0.6 * gib, step_bytes=0.25 * gib, tp=2, pp=1, pp_rank=0)
    outside = outside_allocator_bytes(DEVICE_TERMS, tp=2, pp=1, pp_rank=0)
    eager = planned_device_bytes("braided_v", graphed=False, **kw)
    graphed = planned_device_bytes("braided_v", graphed=True, **kw)
    assert eager == pytest.approx(outside + 2 * gib + DEVICE_TERMS.fragmentation["braided_v"] * 0.6 * gib)
    assert graphed == pytest.approx(outside + 2.25 * gib + DEVICE_TERMS.pool_ratio["braided_v"] * 0.6 * gib)
    # temporaries larger than the activations: eager pays only them, graphed both
    big = {**kw, "step_bytes": 0.8 * gib}
    assert planned_device_bytes("braided_v", graphed=False, **big) == pytest.approx(
        outside + 2 * gib + DEVICE_TERMS.fragmentation["braided_v"] * 0.8 * gib)
    assert planned_device_bytes("braided_v", graphed=True, **big) > graphed + 0.5 * gib
    # the planner prices what the printed command runs: captured for a dense LM, eager for MoE's host-read splits
    assert captured_by_default(tp=2) and captured_by_default(tp=1, ep=1, moe=True)
    assert not captured_by_default(tp=1, ep=2, moe=True) and not captured_by_default(tp=2, moe=True)
    from braid.cost.cluster import Cluster, Parallel
    from braid.cost.hardware import get_hardware
    from braid.planner.search import Candidate, costs_of
    from braid.simulate import resolve_model

    prob = Problem(resolve_model("qwen2-small"), 2, Cluster(get_hardware("h100"), 8), 16, 6 * gib)
    cand = Candidate(Parallel(tp=2, pp=1, dp=1, micro_batch_size=1, optimizer="zero1", recompute=True), "braided_v", 16)
    costs = costs_of(prob, cand)
    # the planner's graph also holds its instantiated nodes: 16 micro-batches of 66 unit instances (16 layers of 4, the
    # embedding, the head)
    assert device_memory(prob, cand, costs, 0, 2 * gib, 0.6 * gib, 0.25 * gib) == pytest.approx(
        graphed + graph_exec_bytes(DEVICE_TERMS, captured_units=16 * 66, tp=2))


def test_nccl_ce_holds_one_staging_set_of_the_sequence_tensor() -> None:
    """Under sequence parallelism the TP group runs on nccl-ce, whose staging (two buffers of one micro-batch's
    (b, s, h) tensor, registered once) the allocator holds from the first step; the group is a full NCCL group."""
    mib = 2**20
    assert ce_staging_bytes(4096, 3584, 2, 2) == 56 * mib  # qwen2-7b's layer at seq 4096 in bf16
    assert ce_staging_bytes(4096, 3584, 2, 1) == 0.0
    assert ce_staging_bytes(3, 5, 2, 4) == 2 * mib  # padded to tp, the second buffer at the next 4 KiB, one 2 MiB block
    assert tp_comm_of(tp=2, seq_shard=False, tokens=4096, hidden=3584, itemsize=2) == ("nccl-capped", 0.0)
    assert tp_comm_of(tp=2, seq_shard=True, tokens=4096, hidden=3584, itemsize=2) == ("nccl-ce", 56 * mib)
    assert tp_comm_of(tp=1, seq_shard=True, tokens=4096, hidden=3584, itemsize=2) == ("nccl-capped", 0.0)
    # the measured terms (2 H200s): the group as a default one, NCCL's copy-engine state once, the set in the allocator
    for rank in json.loads((ROOT / MEASURED_CE).read_text())["ranks"]:
        got = {t["term"]: t for t in rank["terms"]}
        assert got["nccl.ce_group"]["value"] == DEVICE_TERMS.group and got["nccl.ce_staging"]["value"] == DEVICE_TERMS.ce_init
        assert got["nccl.ce_staging_second"]["value"] == 0
        assert 0 <= got["nccl.ce_staging"]["detail"]["reserved_delta"] - 56 * mib <= 2 * mib
    kw = dict(static_bytes=2.0 * 2**30, activation_bytes=0.6 * 2**30, tp=2, pp=1, pp_rank=0, graphed=True)
    base = planned_device_bytes("1f1b_i", **kw)
    ce = planned_device_bytes("1f1b_i", tp_backend="nccl-ce", ce_staging=56 * mib, **kw)
    assert ce - base == pytest.approx(56 * mib + DEVICE_TERMS.group + DEVICE_TERMS.ce_init - DEVICE_TERMS.capped_group)
    from braid.cost.cluster import Cluster, Parallel
    from braid.cost.hardware import get_hardware
    from braid.planner.search import Candidate, Problem, costs_of, device_memory
    from braid.simulate import resolve_model

    model = resolve_model("qwen2-small")
    prob = Problem(model, 2, Cluster(get_hardware("h100"), 8), 16, 6.0 * 2**30)
    cand = Candidate(Parallel(tp=2, pp=1, dp=1, micro_batch_size=1, optimizer="zero1", seq_shard=True), "1f1b_i", 16)
    staging = ce_staging_bytes(model.seq, model.hidden, model.dtype_bytes, 2)
    costs = costs_of(prob, cand)
    units = 16 * costs.units_on(0)
    assert device_memory(prob, cand, costs, 0, kw["static_bytes"], kw["activation_bytes"]) == pytest.approx(
        planned_device_bytes("1f1b_i", tp_backend="nccl-ce", ce_staging=staging, captured_units=units, **kw))
    # its graph holds each unit's reduction as copy nodes
    assert graph_exec_bytes(DEVICE_TERMS, captured_units=units, tp=2, tp_backend="nccl-ce") - graph_exec_bytes(
        DEVICE_TERMS, captured_units=units, tp=2) == pytest.approx(units * (DEVICE_TERMS.graph_ce_collective
                                                                             - DEVICE_TERMS.graph_collective))


def _rows():
    for name in BENCH_FILES:
        doc = json.loads((ROOT / "benchmarks/results" / name).read_text())
        for r in doc["runs"]:
            yield name, doc["config"], r


def test_outside_allocator_within_5_percent_of_every_stored_braid_row() -> None:
    rows = list(_rows())
    assert len(rows) == 10
    for name, cfg, r in rows:
        placement = schedules.build(r["schedule"], cfg["pp"], r["m"]).placement
        for g, (res, used) in enumerate(zip(r["reserved_peak_bytes"], r["device_used_bytes"])):
            want = used - res
            got = outside_allocator_bytes(DEVICE_TERMS, tp=cfg["tp"], pp=cfg["pp"], pp_rank=g // cfg["tp"],
                                          placement=placement, tp_max_ctas=cfg.get("tp_max_ctas", PRE_FLAG_CTAS))
            assert abs(got / want - 1) <= OUTSIDE_TOL, (name, r["schedule"], g, got / 2**20, want / 2**20)


def test_device_in_use_prediction_lies_in_the_band_the_data_supports() -> None:
    errs = []
    for name, cfg, r in _rows():
        placement = schedules.build(r["schedule"], cfg["pp"], r["m"]).placement
        pred = predicted_device_used(cfg, r["schedule"], placement, r["predicted_peak_bytes"], r["cuda_graph"] == "step")
        errs += [(p / u - 1, name, r["schedule"], g) for g, (p, u) in enumerate(zip(pred, r["device_used_bytes"]))]
    assert all(UNDER <= e <= OVER for e, *_ in errs), [x for x in errs if not UNDER <= x[0] <= OVER]
    clean = [x for x in errs if x[1] in CLEAN_FILES]
    assert clean and all(abs(e) <= CLEAN_TOL for e, *_ in clean), clean


def test_a_graphed_rows_pool_holds_the_captured_gradients() -> None:
    """Under a whole-step graph the gradients are allocated in the capture: outside the pool the rank holds
    its weights only, and the pool holds the capture's peak with the gradients (the row's peak leaves them out)."""
    cfg = json.loads((ROOT / "benchmarks/results" / CLEAN_FILES[0]).read_text())["config"]
    placement = schedules.build("1f1b_i", cfg["pp"], 8).placement
    eager, graphed = (predicted_device_used(cfg, "1f1b_i", placement, [0.0] * cfg["pp"], g)[0] for g in (False, True))
    weights = rank_params(cfg, 0, placement) * DTYPE_BYTES[cfg["dtype"]]
    outside = outside_allocator_bytes(DEVICE_TERMS, tp=cfg["tp"], pp=cfg["pp"], pp_rank=0, placement=placement,
                                      tp_max_ctas=cfg["tp_max_ctas"])
    assert eager == pytest.approx(outside + 2 * weights)  # a peak of nothing above the held state fragments nothing
    assert graphed == pytest.approx(outside + weights + DEVICE_TERMS.pool_ratio_of("1f1b_i") * weights)


@pytest.mark.parametrize("w_at,want", [(0.5, 300 + 1000 + 10), (2.5, 200 + 1000 + 10), (None, 50 + 1000 + 10)])
def test_a_captured_peak_holds_the_gradients_allocated_by_then(w_at, want) -> None:
    """A graphed step's gradients are allocated by the captured backward: chunk 0's (1000 B) as its first W starts,
    chunk 1's (10 B, first W at 0.1) before anything; a peak reached before chunk 0's first W holds only chunk 1's.
    A chunk with no W in the trace has its gradients counted at the step's end."""
    series = [(0.0, 100), (1.0, 300), (2.0, 200), (3.0, 50)]
    events = [Event(0, "compute", "W0c1", "W", 0.1, 0.1, 0, 1)] + (
        [Event(0, "compute", "W0c0", "W", w_at, 0.2, 0, 0), Event(0, "compute", "W1c0", "W", w_at + 0.3, 0.2, 1, 0),
         Event(1, "compute", "W0c0", "W", 0.0, 0.2, 0, 0), Event(0, "compute", "F0c0", "F", 0.0, 0.2, 0, 0)]
        if w_at is not None else [])
    trace = Trace({}, events, {0: series})
    grads = {0: 1000, 1: 10}
    assert captured_peak(trace, 0, grads) == want


def test_chunk_gradients_add_up_to_the_ranks_parameters() -> None:
    cfg = json.loads((ROOT / "benchmarks/results" / CLEAN_FILES[0]).read_text())["config"]
    cfg = {**cfg, "pp": 2, "layers_per_stage": [1, 1, 1, 1]}
    grads = chunk_param_bytes(cfg, "v")
    assert sorted(grads) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank in range(2):
        assert sum(b for (r, _), b in grads.items() if r == rank) == rank_params(cfg, rank, "v") * DTYPE_BYTES[cfg["dtype"]]
    assert grads[(0, 0)] > grads[(1, 0)]  # stage 0 holds the embedding


def test_a_device_shared_with_another_process_is_noted() -> None:
    # The bench reads each rank's device in use as the job starts: above this process's CUDA context and default
    # communicator (and a GiB of slack) another process holds memory, and every "in use" figure of the run includes it.
    from braid.cost.device_memory import DEVICE_TERMS
    from braid.measure.runs import foreign_memory_note

    own = int(DEVICE_TERMS.context + DEVICE_TERMS.default_group)
    assert foreign_memory_note([None, None]) is None  # CPU
    assert foreign_memory_note([own, own + 2**29]) is None
    note = foreign_memory_note([own, own + 5 * 2**30])
    assert note is not None and "rank 1's" in note and "rank 0" not in note and "another process" in note, note


def test_the_planners_margin_is_the_median_shortfall_of_the_stored_graphed_sets() -> None:
    """MEMORY_MARGIN: the median by which the device memory in use measured above the prediction on the stored
    graphed memory sets (every rank of every row; the prediction is low on nearly all)."""
    import statistics

    doc = json.loads((ROOT / "benchmarks/results/measurements_h100x2_graphed_memory_2.json").read_text())
    over = []
    for st in doc["sets"]:
        cfg = {**st, **st["layout"]}
        for r in st["runs"]:
            placement = schedules.build(r["schedule"], cfg["pp"], r["m"]).placement
            pred = predicted_device_used(cfg, r["schedule"], placement, r["predicted_peak_bytes"], r["cuda_graph"] == "step")
            over += [used / p - 1 for used, p in zip(r["device_used_bytes"], pred)]
    assert len(over) == 36
    median = statistics.median(over)
    assert median <= MEMORY_MARGIN <= median + 0.005, median


def test_a_bench_row_starts_without_the_cublas_workspaces_of_earlier_rows(monkeypatch) -> None:
    """Every row's executor runs GEMMs on side streams of its own, and cuBLAS keeps a workspace per stream for
    the process's life: the memory in use beside a graph pool grew by one a row (measured), which no row's
    model counts. A row starts after those workspaces and the allocator's cache are given back, in that order."""
    import torch

    from braid.measure import runs

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear_workspaces"), raising=False)
    runs.release_earlier_rows(torch.device("cuda", 0))
    assert calls == ["sync", "clear_workspaces", "empty_cache"]


def _graph_lines() -> list[tuple[str, int, float]]:
    """(the command's section, unit tasks, MiB outside the allocator) of each capture line of MEASURED_GRAPH."""
    import re

    out, section = [], ""
    for line in (ROOT / MEASURED_GRAPH).read_text().splitlines():
        if line.startswith("## "):
            section = line
        got = re.search(r"capture of (\d+) unit tasks.*; graph ([\d.]+) MiB outside the allocator", line)
        if got:
            out.append((section, int(got[1]), float(got[2])))
    return out


def test_the_instantiated_graph_is_priced_per_captured_unit_from_its_measurement() -> None:
    """A whole-step CUDA graph's nodes live outside the allocator (2 H200s: 34 MiB for 592 captured unit instances at
    tp=1, 106 MiB for 528 at tp=2 on NCCL's kernels, 370 MiB on nccl-ce's copy nodes): the constants are those lines,
    and the other captures of the file (twice the micro-batches, the other pipeline rank) are predicted within the
    2 MiB the device reports in."""
    lines = _graph_lines()
    mib = 2**20

    def pick(tp_flags: str, tasks: int, sp: bool | None = None) -> float:
        got = {m for s, t, m in lines if tp_flags in s and t == tasks
               and (sp is None or ("--no-sequence-parallel" not in s) == sp)}
        assert len(got) == 1, (tp_flags, tasks, got)  # the ranks of one run agree
        return got.pop() * mib

    pp2, capped, ce = pick("--tp 1 --pp 2", 1776), pick("--tp 2", 1584, sp=False), pick("--tp 2", 1584, sp=True)
    assert DEVICE_TERMS.graph_unit == pytest.approx(pp2 / (1776 / 3))
    assert DEVICE_TERMS.graph_collective == pytest.approx(capped / 528 - DEVICE_TERMS.graph_unit)
    assert DEVICE_TERMS.graph_ce_collective == pytest.approx(ce / 528 - DEVICE_TERMS.graph_unit)
    # the captures the constants were not taken from
    assert abs(graph_exec_bytes(DEVICE_TERMS, captured_units=16 * 29) - pick("--tp 1 --pp 2", 1392)) <= 2 * mib
    assert abs(graph_exec_bytes(DEVICE_TERMS, captured_units=16 * 66, tp=2) - pick("--tp 2", 3168, sp=False)) <= 2 * mib
    # an eager step holds no graph; the planner prices the graph only where it captures one
    kw = dict(static_bytes=2.0 * 2**30, activation_bytes=0.6 * 2**30, tp=2, pp=1, pp_rank=0, captured_units=528)
    assert planned_device_bytes("braided_v", graphed=False, **kw) == planned_device_bytes(
        "braided_v", graphed=False, **{**kw, "captured_units": 0})
    assert planned_device_bytes("braided_v", graphed=True, **kw) - planned_device_bytes(
        "braided_v", graphed=True, **{**kw, "captured_units": 0}) == pytest.approx(capped)
