"""The bench job on every rank: braid's schedules through the executor (eager or as whole-step CUDA
graphs) and the external baselines on the same model, layout and data, step by step."""

from __future__ import annotations

import gc
import logging
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from braid.measure.peers import PeerRun, peer_fields, peer_runs_default, peers_note, torch_groups
from braid.cost.costs import Layout, costs_from_dict
from braid.cost.device_memory import DEVICE_TERMS
from braid.planner.braid_tune import count_blocks
from braid.measure.calibrate import busy_by_chunk, busy_by_phase, calibrate, probe_fit, probe_mbs, probe_plan
from braid.measure.config import BenchConfig, ProfileConfig, build_chunks
from braid.measure.experts import count_routes, graph_reason, job_groups
from braid.io.cli import resolve_seq_shard
from braid.io.progress import Progress
from braid.measure.launch import launch
from braid.measure.report import slowest_rank_steps, summarize
from braid.measure.units import measure_rank, tp_comm_for
from braid.core.ctas import max_ctas_for

log = logging.getLogger(__name__)

NO_VLM_PEER = ("no vision-language row: the external baselines pipeline a decoder LM's layers, not a vision tower "
               "on the first stage")
NO_EP_PEER = ("no expert-parallel row: torch's pipelining schedules run the model without expert parallelism "
              "(megatron-core's rows shard the experts as braid does)")
PROBE_STEPS = 11  # measured steps of the calibration probe (at least --steps)


PROBE_BUSY_STEPS = 5  # recorded probe steps after the timed ones: unit busy time per phase (medians)


# ----------------------------------------------------------------------------------------
# The job on every rank
# ----------------------------------------------------------------------------------------
def release_earlier_rows(dev: torch.device) -> None:
    """Give back what earlier rows of this process hold on CUDA device ``dev`` and no later row uses: their
    garbage, cuBLAS's workspaces (one per stream a GEMM ran on, kept by torch for the process's life: every
    row's executor makes side streams of its own, and the memory in use beside a graph pool grew by a
    workspace a row, 1253 -> 1419 MiB over six rows, measurements_h100x2_graphed_memory_2.txt) and the
    allocator's cached blocks. Called before a row builds its weights and again before its steps: weights
    placed in an earlier row's cached segment keep that segment (and its free rest) reserved beside a graph's pool,
    as a training job, which builds its weights once on an empty cache, never does."""
    gc.collect()
    torch.cuda.synchronize(dev)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # what torch's cudagraph trees call before a capture
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _data(pc: ProfileConfig, m: int, dev: torch.device, dp_rank: int = 0) -> tuple[list[Any], list[torch.Tensor]]:
    return pc.micro_batches(m, dev, seed=7, dp_rank=dp_rank)


def _timed_steps(bc: BenchConfig, dev: torch.device, run_step, steps: int | None = None,
                 on_result=None, warmup: int | None = None, wall: list[float] | None = None,
                 peak_from: int | None = None) -> tuple[list[float], int, Any, list[float], dict[str, int]]:
    """Warm-up then measured steps (``steps``, default ``bc.steps``); returns (per-step seconds,
    peak bytes above the pre-step baseline, last result, per-step CPU seconds of this thread
    launching the step, the device-wide figures :func:`_device_memory` names). ``on_result`` sees each measured step's
    result; ``wall`` gets the epoch seconds at the start and the end of the measured steps (to
    line them up with a clock or power log taken beside the job). The peaks count the steps from
    index ``peak_from`` (default: the measured ones): a step captured into a CUDA graph during the
    warm-up allocates there what its replays reuse, so a graphed peer counts from its second step
    (its first allocates the gradients every later step keeps). The allocator's cache is emptied first
    (:func:`release_earlier_rows`): the blocks an earlier row (another schedule or peer in this process) left
    reserved are not this row's, and every row starts from the same state."""
    if dev.type == "cuda":
        release_earlier_rows(dev)
    times, peak, res, host = [], 0, None, []
    held = {"reserved": 0, "device_used": 0}
    steps = bc.steps if steps is None else steps
    warmup = bc.warmup if warmup is None else warmup
    peak_from = warmup if peak_from is None else min(peak_from, warmup + steps - 1)
    for i in range(warmup + steps):
        _sync(dev)
        dist.barrier()
        if wall is not None and i == warmup:
            wall.append(time.time())
        base = 0
        if dev.type == "cuda":
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t0, h0 = time.perf_counter(), time.thread_time()
        res = run_step()
        h = time.thread_time() - h0
        _sync(dev)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            host.append(h)
            if on_result is not None:
                on_result(res)
        if i >= peak_from and dev.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(dev) - base)
            now = _device_memory(dev)
            held = {k: max(v, now[k]) for k, v in held.items()}
    if wall is not None:
        wall.append(time.time())
    return times, peak, res, host, held


def _device_memory(dev: torch.device) -> dict[str, int]:
    """This rank's absolute device figures after a step: ``reserved``, the caching allocator's
    reserved peak since its counters were reset (what runs out first), and ``device_used``, the
    device's memory in use (total minus free, as nvidia-smi shows it: the CUDA context, NCCL's
    and cuBLAS's buffers and every other process on the device included). The allocator keeps
    what it reserved, so the step's end holds the step's reservation."""
    free, total = torch.cuda.mem_get_info(dev)
    return {"reserved": torch.cuda.max_memory_reserved(dev), "device_used": total - free}


def _run_schedule(d, bc: BenchConfig, groups, model, name: str, m: int, plan=None, steps: int | None = None,
                  comm=None, busy_step: bool = False, snapshot: str | None = None, experts=None) -> dict[str, Any]:
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.runtime.executor import Executor

    pc = bc.profile
    dev = d.device
    plan = plan or schedules.build(name, pc.pp, m)
    if plan.num_stages != len(pc.layers_per_stage):
        raise ValueError(f"{plan.num_stages} virtual stages, but --chunks gives {len(pc.layers_per_stage)}")
    program = compile_plan(plan)[groups.coords.pp]
    if dev.type == "cuda":  # before the row builds its weights (release_earlier_rows says why)
        release_earlier_rows(dev)
    chunks = build_chunks(pc, groups, dev, plan=plan, model=model, experts=experts)  # as profiled: sequence sharding included
    routes = count_routes(chunks)  # an MoE model's rows per expert, summed on the device
    from braid.measure.config import DTYPES

    kw = {} if comm is None else {"tp_comm": comm}
    ex = Executor.from_groups(plan, program, chunks, groups, d.abort, act_shape=pc.act_shape(), dtype=DTYPES[pc.dtype],
                              device=dev, compile=pc.compile, **kw)
    toks, labs = _data(pc, m, dev, groups.coords.dp)
    from braid.runtime.graphs import WARMUP_STEPS, reserve_breakdown, step_runner

    graph = step_runner(ex, bc.cuda_graph)  # whole-step CUDA graph, captured in the warm-up steps (an MoE at ep > 1: eager)

    # Every run is timed as it trains (record="off": no clocks, no unit events, and fused
    # chunks take one call per op); recorded steps after it give its trace (one step) or, for
    # the calibration probe, the unit busy time per phase (PROBE_BUSY_STEPS steps, medians).
    def step(record="off"):
        for ch in chunks.values():
            ch.zero_grad(set_to_none=False)
        return graph.run(toks, labs, record=record)

    wall: list[float] = []
    times, peak, _, host, held = _timed_steps(bc, dev, step, steps,
                                                  warmup=max(bc.warmup, WARMUP_STEPS + 1) if graph.mode == "step" else None,
                                                  wall=wall)
    mem = graph.memory()
    reserve = reserve_breakdown(getattr(graph, "pool", None)) if dev.type == "cuda" else None  # after the measured steps
    if graph.mode == "step":  # replays allocate nothing: the graph's memory is what its capture took, less the
        # gradients the capture allocated (an eager step's are allocated before it, below its baseline)
        peak = (mem["capture_peak_bytes"] or 0) - (mem.get("captured_grad_bytes") or 0)
    compute_s, kernels = _compute_step(dev, step) if busy_step else (None, None)
    graph.release()
    busy: list[dict[str, float]] = []
    chunk_busy: list[dict[str, float]] = []  # the same per rank, chunk and phase (where it was spent)
    recorded: list[dict[str, float]] = []  # per recorded step: its wall time and the all-reduce figures
    if routes is not None:
        routes.reset()  # the same micro-batches every step: the recorded step's rows per expert are every step's
    for _ in range(PROBE_BUSY_STEPS if name == "probe" else 1):
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        res = step("units")
        _sync(dev)
        summ = res.trace.meta.get("summary", {})
        recorded.append({"wall_s": time.perf_counter() - t0, "exposed_ar_s": float(summ.get("exposed_ar_s", 0.0)),
                         "ar_span_s": float(summ.get("ar_span_s", 0.0)),
                         **{k: float(summ[k]) for k in ("exposed_a2a_s", "a2a_span_s") if k in summ}})
        busy.append(busy_by_phase(res.trace))
        chunk_busy.append(busy_by_chunk(res.trace))
    if dev.type != "cuda":
        peak = res.trace.peak_memory(groups.coords.pp)
    shot = _snapshot_step(d, ex, chunks, toks, labs, snapshot) if snapshot else None
    keep = groups.coords.tp == 0  # one TP rank of each pipeline rank (and replica) tells the busy time
    cuda = dev.type == "cuda"
    return {"times": times, "peak": peak, "reserved": held["reserved"] if cuda else None, "pp": groups.coords.pp,
            "dp": groups.coords.dp, "routes": routes.read() if routes is not None and keep else None,
            "device_used": held["device_used"] if cuda else None, "loss": res.loss,
            "trace": res.trace if keep and groups.coords.dp == 0 else None, "busy": busy if keep else None,
            "chunk_busy": chunk_busy if keep else None, "wall": wall,
            "recorded": recorded, "host": host, "cuda_graph": graph.mode, "graph_pool_bytes": mem.get("graph_pool_bytes"),
            "reserve_breakdown": reserve, "braided_blocks": count_blocks(plan), "compute_s": compute_s, "compute_kernels": kernels, "snapshot": shot}


def _snapshot_step(d, ex, chunks: dict, toks, labs, path: str) -> dict[str, Any]:
    """One more step of the run, eager (a graph replay allocates nothing), under the allocator's
    history: this rank's snapshot file and its attribution (:mod:`braid.measure.snapshot`)."""
    from dataclasses import asdict

    from braid.measure.snapshot import rank_path, record_step, tensor_labels

    params = [p for ch in chunks.values() for p in ch.parameters()]

    def step():
        for ch in chunks.values():
            ch.zero_grad(set_to_none=False)
        ex.run(toks, labs, record="off")

    _sync(d.device)
    dist.barrier()
    out = rank_path(path, d.rank, dist.get_world_size())
    att = record_step(step, out, d.device, lambda: tensor_labels(weights=params, gradients=[p.grad for p in params]))
    return {"file": str(out), "rank": d.rank, **asdict(att)}


COMPUTE_TOP_KERNELS = 30  # kernels kept per rank and run with --compute-busy (most time first)


def _compute_step(dev: torch.device, step) -> tuple[float, list]:
    """One more step, as the timed ones ran, under the CUDA profiler: this rank's compute seconds
    (:mod:`braid.measure.device_busy`) and its kernels with the most time. The ranks start it
    together, as every timed step."""
    from braid.measure.device_busy import compute_busy_s

    _sync(dev)
    dist.barrier()
    busy, _, top = compute_busy_s(step, dev, COMPUTE_TOP_KERNELS)
    return busy, top


def _run_external(d, bc: BenchConfig, groups, model, run: PeerRun, m: int, shared: dict[str, Any],
                  busy_step: bool = False) -> dict[str, Any]:
    """One external baseline (torch.distributed.pipelining, megatron-core) in its mode on the same model split
    (:mod:`braid.baselines.torch_pp`); ``shared`` holds the torch baselines' groups, made once per job."""
    from braid.baselines.torch_pp import baseline_pipeline
    from braid.measure.config import DTYPES

    pc = bc.profile
    dev = d.device
    if dev.type == "cuda":  # as for braid's rows
        release_earlier_rows(dev)
    pipe = baseline_pipeline(run.name, model, pc.peer_layers_per_stage, m, groups=groups, device=dev, dtype=DTYPES[pc.dtype],
                             seq_len=pc.seq, mode=run.mode, comm=torch_groups(run, groups, dev, shared),
                             ep=pc.ep if pc.ep > 1 else None)
    # a replica steps its own micro-batches (megatron-core numbers its data-parallel ranks itself)
    toks, labs = _data(pc, m, dev, getattr(pipe, "dp_rank", groups.coords.dp))
    x, y = torch.cat(toks), torch.cat(labs)

    def step():
        for mod in pipe.modules:
            mod.zero_grad(set_to_none=False)
        return pipe.step((x,), y)

    times, peak, _, host, held = _timed_steps(bc, dev, step, peak_from=1)  # megatron-core graphed: captured in step 2
    compute_s, kernels = _compute_step(dev, step) if busy_step else (None, None)
    pipe.close()
    cuda = dev.type == "cuda"
    return {"times": times, "peak": peak if cuda else None, "reserved": held["reserved"] if cuda else None,
            "device_used": held["device_used"] if cuda else None, "host": host,
            "compute_s": compute_s,
            "compute_kernels": kernels}


def foreign_memory_note(used_at_start: list[int | None], slack: float = 2**30) -> str | None:
    """A note when a rank's device held more, as the job started, than this process's CUDA context and
    default communicator (:data:`braid.cost.device_memory.DEVICE_TERMS`) and ``slack``: another process's
    memory, which every "in use on the device" figure of the run then includes. None when none did."""
    own = DEVICE_TERMS.context + DEVICE_TERMS.default_group
    over = [(r, u) for r, u in enumerate(used_at_start) if u is not None and u > own + slack]
    if not over:
        return None
    where = ", ".join(f"rank {r}'s {u / 2**20:,.0f} MiB" for r, u in over)
    return (f"devices in use before this job's tensors: {where}, where this process's CUDA context and default "
            f"communicator take about {own / 2**20:,.0f} MiB: another process holds memory there, and the device "
            "memory in use below includes it")


def _bench_job(d, bc: BenchConfig) -> dict[str, Any] | None:
    from braid.measure.units import assemble
    from braid.measure.units import profile_to_dict

    pc = bc.profile
    # in use as the job starts: this process's CUDA context and default group only, if the device is ours alone
    before = _device_memory(d.device)["device_used"] if d.device.type == "cuda" else None
    groups, experts = job_groups(pc)
    lead = d.rank == 0
    doc = bc.costs
    raw_doc = None
    # The TP all-reduce every run uses: the flag's backend, or with 'all' the profile's pick.
    comm, choice = tp_comm_for(pc, groups, d.device)
    model = pc.build_model(d.device)  # once: the profile's chunks and every run are cut from it
    if doc is None:
        res = measure_rank(d, pc, groups, build_chunks(pc, groups, d.device, model=model, experts=experts), comm, choice,
                           experts)
        gathered: list[Any] = [None] * pc.world_size
        dist.all_gather_object(gathered, res)
        doc = raw_doc = profile_to_dict(assemble(pc, gathered))
    probe_note = None
    if bc.costs is None and bc.calibrate:
        # The probe (m = 4p by default, see calibrate.PROBE_MBS_PER_RANK): more steps than a
        # benchmarked run, medians of the step time and of each phase's busy time, so one slow
        # step on a shared machine does not land in the fitted communication figure.
        m_probe, probe_note = _probe_m(d, bc, doc, groups)
        plan = probe_plan(pc.pp, m_probe, pc.v)
        out = _run_probe(d, bc, groups, model, plan, comm, experts)
        gathered = [None] * pc.world_size
        dist.all_gather_object(gathered, out)
        if lead:
            step_s = statistics.median(slowest_rank_steps(gathered))
            per_step = [{ph: _over_pp(gathered, lambda rk: rk["busy"][i].get(ph, 0.0)) for ph in "FBW"}
                        for i in range(len(out["busy"]))]
            busy = {ph: statistics.median(b[ph] for b in per_step) for ph in "FBW"}
            # The probe's other evidence, kept with the calibration so that it can be re-fitted
            # offline: how its timed steps ran (eager or one graph replay), the launching
            # thread's CPU time per timed step, and per recorded (eager, unit-timed) step the
            # slowest rank's wall time and the all-reduce figures summed over the ranks that
            # recorded a trace; and the busy time per rank, chunk and phase (medians), which
            # tells where on the pipeline a phase's busy time above the profile's was spent.
            n_rec = len(out["recorded"])
            per_chunk = [_busiest_replica([rk["chunk_busy"][i] for rk in gathered if rk.get("chunk_busy") is not None])
                         for i in range(n_rec)]
            probe = {"cuda_graph": out["cuda_graph"], "timed_wall": out["wall"],
                     "host_s": max((statistics.median(rk["host"]) for rk in gathered if rk.get("host")), default=0.0),
                     "recorded_step_s": statistics.median(max(rk["recorded"][i]["wall_s"] for rk in gathered)
                                                          for i in range(n_rec)),
                     **{k: statistics.median(_over_pp(gathered, lambda rk: rk["recorded"][i][k]) for i in range(n_rec))
                        for k in ("exposed_ar_s", "ar_span_s")},
                     **({"a2a_span_s": statistics.median(_over_pp(gathered, lambda rk: rk["recorded"][i]["a2a_span_s"], min)
                                                         for i in range(n_rec))} if "a2a_span_s" in out["recorded"][0] else {}),
                     "busy_per_chunk_s": {k: statistics.median(b.get(k, 0.0) for b in per_chunk)
                                          for k in sorted(set().union(*per_chunk))}}
            doc = calibrate(doc, pc, plan, step_s, busy, probe)
    runs, notes = [], [probe_note] if probe_note else []
    jobs = [(n, m) for n in bc.schedules for m in bc.mbs]
    peers = bc.peers if bc.peers is not None else tuple(peer_runs_default(pc))
    if pc.vision is not None:
        peers = tuple(replace(p, why=p.why or NO_VLM_PEER) for p in peers)
    if pc.ep > 1:
        peers = tuple(replace(p, why=p.why or NO_EP_PEER) if p.peer != "mcore" else p for p in peers)
    ext = [(p, m) for p in peers for m in bc.mbs] if bc.external else []
    peer_groups: dict[str, Any] = {}  # the torch baselines' process groups, made once
    progress = Progress(bc.rounds * (len(jobs) + len(ext)), "bench", enabled=lead)
    external = []
    skip: set[tuple[str, int]] = set()  # runs that cannot run are tried in the first round only
    snapshot, shots = bc.memory_snapshot, None  # the first run that runs records one more step (then None)
    for rnd in range(bc.rounds):
        tag = f" (round {rnd + 1}/{bc.rounds})" if bc.rounds > 1 else ""
        for name, m in jobs:
            if (name, m) in skip:
                progress.step(f"{name} m={m} skipped")
                continue
            try:
                out = _run_schedule(d, bc, groups, model, name, m, comm=comm, busy_step=bc.compute_busy and rnd == 0,
                                    snapshot=snapshot, experts=experts)
            except ValueError as err:
                notes.append(f"skipped {name} m={m}: {err}")
                skip.add((name, m))
                progress.step(f"{name} m={m} skipped")
                continue
            gathered = [None] * pc.world_size
            dist.all_gather_object(gathered, out)
            runs.append({"schedule": name, "m": m, "round": rnd, "ranks": gathered})
            if snapshot:
                shots = {"schedule": name, "m": m, "ranks": [rk.pop("snapshot") for rk in gathered]}
                snapshot = None
            progress.step(f"{name} m={m}{tag}")
        for run, m in ext:
            if (run.label, m) in skip:
                progress.step(f"{run.label} m={m} could not run")
                continue
            out, err = None, run.why
            if err is None:
                try:
                    out = _run_external(d, bc, groups, model, run, m, peer_groups, busy_step=bc.compute_busy and rnd == 0)
                except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
                    err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            gathered = [None] * pc.world_size
            dist.all_gather_object(gathered, (out, err))
            errs = sorted({e for _, e in gathered if e})
            row = {"schedule": run.label, **peer_fields(run), "m": m, "round": rnd}
            if errs:
                external.append({**row, "error": errs[0]})
                skip.add((run.label, m))
            else:
                external.append({**row, "ranks": [o for o, _ in gathered]})
            progress.step(f"{run.label} m={m}{tag}")
        if lead and bc.partial_json and rnd + 1 < bc.rounds:
            _write_partial(bc, {"profile": doc, "raw_profile": raw_doc if raw_doc is not doc else None, "runs": runs,
                                "external": external, "notes": notes + [f"partial: {rnd + 1} of {bc.rounds} rounds"]})
    if bc.external:
        notes.append(peers_note(peers))
        from braid.baselines.megatron_moe import is_moe, row_note

        if is_moe(pc.model) and any(p.peer == "mcore" for p in peers):
            notes.append(row_note(pc.model, pc.ep))
        if pc.peer_layers_per_stage != pc.layers_per_stage:
            notes.append(f"braid's stages cut a layer in half (layers/stage={_counts(pc.layers_per_stage)}); the external "
                         f"baselines split whole layers, {_counts(pc.peer_layers_per_stage)}")
    # The uncalibrated profile travels too: its predictions are reported beside the calibrated
    # ones, so the raw model's error stays visible.
    raw = raw_doc if raw_doc is not doc else None
    if graph_reason(pc):
        notes.append(f"CUDA graphs off for braid's rows: {graph_reason(pc)}")
    if pc.tp > 1 and not pc.seq_shard and resolve_seq_shard(None, pc.tp, seq=pc.seq, vision=pc.vision is not None,
                                                             moe=bool(getattr(pc.model, "experts", 0)), note=notes.append):
        notes.append("sequence parallelism inside TP off: --no-sequence-parallel")  # the default would run it
    if pc.tp > 1:
        ctas = max_ctas_for(pc.tp_max_ctas, pc.tp) if comm.backend == "nccl-capped" else None
        notes.append(f"TP all-reduce backend: {comm.backend}" + (f", {ctas} thread blocks" if ctas else "")
                     + (" (chosen by measuring " + ", ".join(choice["backends"]) + ")" if choice else ""))
    if pc.ep > 1:
        notes.append(f"EP all-to-all backend: {pc.ep_backend}" + (f", {pc.ep_max_ctas} thread blocks" if pc.ep_max_ctas else ""))
    starts: list[Any] = [None] * pc.world_size
    dist.all_gather_object(starts, before)
    shared = foreign_memory_note(starts)
    if shared:
        notes.append(shared)
    return {"profile": doc, "raw_profile": raw, "runs": runs, "external": external, "notes": notes,
            "memory_snapshot": shots} if lead else None


def _probe_m(d, bc: BenchConfig, doc: dict[str, Any], groups) -> tuple[int, str | None]:
    """The probe's micro-batch count: ``--probe-mbs``, else the default lowered until every rank's probe
    activations fit its device (:func:`braid.measure.calibrate.probe_fit`; the ranks agree on the least),
    and the note that says so. Collective on CUDA."""
    pc = bc.profile
    m = bc.probe_mbs or probe_mbs(pc.pp)
    if bc.probe_mbs is not None or d.device.type != "cuda":
        return m, None
    free, _ = torch.cuda.mem_get_info(d.device)
    free += torch.cuda.memory_reserved(d.device) - torch.cuda.memory_allocated(d.device)  # cached, reusable
    fit = torch.tensor([probe_fit(doc, pc, groups.coords.pp, free, m)], device=d.device)
    dist.all_reduce(fit, op=dist.ReduceOp.MIN)
    got = int(fit.item())
    if got == m:
        return m, None
    return got, (f"calibration probe at m={got}, not {m}: every micro-batch's activations at once would not fit the "
                 f"device (--probe-mbs sets it)")


def _run_probe(d, bc: BenchConfig, groups, model, plan, comm, experts=None) -> dict[str, Any]:
    """The calibration probe's run; one that runs out of device memory says how to make it fit."""
    try:
        return _run_schedule(d, bc, groups, model, "probe", plan.m, plan, steps=max(PROBE_STEPS, bc.steps), comm=comm,
                             experts=experts)
    except torch.cuda.OutOfMemoryError as err:
        raise RuntimeError(f"the calibration probe (m={plan.m}: every micro-batch's activations at once) ran out of "
                           f"device memory; lower it with --probe-mbs (at least --pp {plan.p}) or skip it with "
                           f"--no-calibrate") from err


def _over_pp(gathered: list[dict[str, Any]], figure, pick=max) -> float:
    """``figure`` of the ranks that recorded a busy time (one TP rank each), summed over the pipeline
    ranks: of the data-parallel replicas of one pipeline rank, the busiest's (``pick``; expert parallelism
    couples them at every all-to-all, so the busiest sets the pace, as the cost model prices it)."""
    per_pp: dict[int, list[float]] = {}
    for rk in gathered:
        if rk["busy"] is not None:
            per_pp.setdefault(rk.get("pp", 0), []).append(figure(rk))
    return sum(pick(v) for v in per_pp.values())


def _busiest_replica(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Busy seconds per ``r<pp rank>c<chunk><phase>`` merged over the ranks: the most of the replicas'."""
    out: dict[str, float] = {}
    for b in per_rank:
        for k, v in b.items():
            out[k] = max(out.get(k, 0.0), v)
    return out


def _write_partial(bc: BenchConfig, raw: dict[str, Any]) -> None:
    """The summary of the rounds so far to ``bc.partial_json`` (atomically; ``rounds_done`` says how
    many): a job stopped before its last round still leaves what it measured. The other ranks go
    on to the next run meanwhile and wait for this one at its first barrier, outside any timing."""
    import json

    from braid.io.files import atomic_write_text

    try:
        summary = summarize(bc, raw)
        summary.pop("_traces")
        atomic_write_text(bc.partial_json, json.dumps(summary, indent=1))
    except (OSError, ValueError, KeyError, TypeError) as err:  # the job goes on; its final JSON is written as usual
        log.warning("could not write the partial results to %s: %s: %s", bc.partial_json, type(err).__name__, err)


def run_bench(bc: BenchConfig) -> dict[str, Any]:
    """Spawn the ranks, profile (unless costs were given), run and summarise."""
    raw = launch(bc.profile.world_size, bc.profile.device, _bench_job, bc)[0]
    return summarize(bc, raw)


def planned_runs(bc: BenchConfig) -> tuple[list[tuple[str, int, Any]], list[str]]:
    """The ``(schedule, m, plan)`` runs the layout accepts, and a note for each it does not."""
    from braid import schedules

    pc = bc.profile
    runs, notes = [], []
    for name in bc.schedules:
        for m in bc.mbs:
            try:
                plan = schedules.build(name, pc.pp, m)
            except ValueError as err:
                notes.append(f"{name} m={m}: {err}")
                continue
            if plan.num_stages != len(pc.layers_per_stage):
                notes.append(f"{name} m={m}: {plan.num_stages} virtual stages, but the layout has "
                             f"{len(pc.layers_per_stage)} (--pp x --chunks)")
                continue
            runs.append((name, m, plan))
    return runs, notes


def _check_costs(doc: dict[str, Any], where: str, pc: ProfileConfig, runs: list[tuple[str, int, Any]]) -> None:
    """Read ``doc`` against every planned run's layout, as the predictions will (CostFileError if it does not fit)."""
    for placement, v in sorted({(plan.placement, plan.v) for _, _, plan in runs}):
        costs_from_dict(doc, Layout(pc.tp, pc.pp, v, placement), pc.specs(placement), where=where)


def _counts(layers_per_stage) -> str:
    return ",".join(map(str, layers_per_stage))
