"""The profiler: every unit task of the executor's own chunks timed as the executor runs it, the TP
all-reduce alone and beside GEMMs, P2P and host copies; the measurements assembled into a cost model
(``docs/costs.md``)."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import asdict
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from braid.core.braiding import AR_BACKWARD, AR_FORWARD, ChunkSpec, Comm, Unit, unit_tasks
from braid.tp.seq_shard import reduce_now
from braid.core.ir import OpKind, stage_of
from braid.cost.costs import (
    ChunkCosts,
    CostModel,
    UnitCost,
    costs_to_dict,
    model_forward_flops,
)
from braid.measure.config import DTYPES, ProfileConfig, device_name, build_chunks
from braid.io.progress import Progress
from braid.measure.launch import launch
from braid.measure.pair import collective_pair
from braid.models.seq_shard_ops import gather_through
from braid.tp.autograd_calls import on_this_thread


# ----------------------------------------------------------------------------------------
# Measurements on one rank
# ----------------------------------------------------------------------------------------
class _Timer:
    """Times callables: CUDA events on GPU, ``perf_counter`` on CPU.

    :meth:`time` times one callable alone (a sync before and after). Unit tasks are timed
    *back to back* instead, as the executor runs them: :meth:`lap_start` / :meth:`lap_end`
    record events around each task without synchronising, so the host runs ahead and the
    device sees the same queue it sees in a pipeline (timing a unit alone adds its launch
    gaps: 1.1-1.7x on H200); :meth:`seconds` resolves a lap after :meth:`sync`.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._cycles_per_s: float | None = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def hold(self, seconds: float) -> None:
        """GPU: keep the device busy for about ``seconds`` (a spin kernel), so that the host
        queues the work issued next before the device reaches it; the events recorded between
        those tasks then time the device alone, back to back, and the host's own time to issue
        them is measured apart (the host lane). No-op on CPU."""
        if not self.cuda or seconds <= 0:
            return
        if self._cycles_per_s is None:
            self.sync()
            n = 10_000_000
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(n)
            b.record()
            b.synchronize()
            self._cycles_per_s = n / max(a.elapsed_time(b) / 1e3, 1e-6)
        torch.cuda._sleep(int(seconds * self._cycles_per_s))

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        self.sync()
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3, out
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out

    def lap_start(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def lap_end(self, start: Any) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return (start, e)
        return time.perf_counter() - start

    def seconds(self, lap: Any) -> float:
        """Duration of a finished lap (on GPU, call :meth:`sync` first)."""
        if self.cuda:
            return lap[0].elapsed_time(lap[1]) / 1e3
        return lap

    def memory(self, chunk) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else chunk.live_bytes()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def workspace(self, before: int, after: int) -> int:
        """Bytes allocated on top of ``max(before, after)`` while the unit ran (0 on CPU: no allocator peak)."""
        return max(0, torch.cuda.max_memory_allocated(self.device) - max(before, after)) if self.cuda else 0


def hold_for(issue_s: float | None) -> float:
    """Seconds to keep the device busy before a phase: twice the host's time to issue it (25 ms before it
    is known), so that every unit it times runs back to back on the device."""
    return 2.0 * (0.025 if issue_s is None else issue_s) + 0.005


def _aligned(held_s: float, group, dev: torch.device) -> float:
    """The longest of the group's holds (collective: every rank of ``group`` calls it), the ranks then synced."""
    t = torch.tensor([held_s], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def issue_time(spent_s: float, held_s: float, cuda: bool) -> float:
    """The host's time to issue a phase from the wall time ``spent_s`` it took after a hold of ``held_s``.
    A phase that reads the device on the host (an MoE layer's routing counts, a vision grid) waits there
    for the device, which first runs the hold: that wait is taken out (the phase's own device time stays
    in), else each iteration's hold would be about twice the last and a profile's time grows
    geometrically (an A3B MoE profile did 5 of 12 iterations in ~230 s on H100s)."""
    return spent_s - held_s if cuda and spent_s > held_s else spent_s


def _profile_chunk(chunk, spec: ChunkSpec, pc: ProfileConfig, timer: _Timer, tp_group, dev: torch.device,
                   progress: Progress, dp_rank: int = 0, ep_group: Any = None) -> dict[str, Any]:
    """Per-instance unit times (median) and memory deltas of one chunk, one micro-batch at a time
    (backward calls on this thread, as the executor runs them); ``dp_rank``: the replica whose data it reads.

    An MoE unit's all-to-all (expert parallelism, ``ep_group``) is started and waited for outside the
    unit's lap, as the executor starts it after the unit, and timed in a lap of its own (``a2a``:
    per instance its median and the rows' bytes this rank sent); every phase starts after a barrier
    of the group, so that the exchanges time the transfer and the routing's imbalance, not a peer's lag."""
    with on_this_thread():
        return _profile_chunk_units(chunk, spec, pc, timer, tp_group, dev, progress, dp_rank, ep_group)


def _profile_chunk_units(chunk, spec: ChunkSpec, pc: ProfileConfig, timer: _Timer, tp_group, dev: torch.device,
                         progress: Progress, dp_rank: int = 0, ep_group: Any = None) -> dict[str, Any]:
    dtype = DTYPES[pc.dtype]
    chunk.set_batch(*pc.micro_batches(1, dev, seed=0, dp_rank=dp_rank))  # token ids, or a VLM's (images, input_ids)
    a2a: dict[tuple[str, str, int], list[float]] = {}
    a2a_bytes: dict[tuple[str, str, int], int] = {}
    times: dict[tuple[str, str, int], list[float]] = {}
    mem: dict[tuple[str, str, int], int] = {}
    work: dict[tuple[str, str, int], int] = {}
    ar = lambda out, task: reduce_now(out, tp_group) if (task.ar and out is not None and tp_group is not None) else None  # noqa: E731
    host: list[float] = []
    host_ph: dict[str, list[float]] = {}  # the same, per phase
    issue_s: dict[OpKind, float] = {}  # host time to issue each phase, from the last iteration
    for it in range(pc.warmup + pc.iters):
        keep = it >= pc.warmup
        if not spec.embed:
            chunk.set_input(0, torch.randn(pc.act_shape(), dtype=dtype, device=dev))
        for phase in (OpKind.F, OpKind.B, OpKind.W):
            tasks = unit_tasks(phase, spec)
            if phase is OpKind.B and not spec.head:
                chunk.set_output_grad(0, torch.randn(pc.act_shape(), dtype=dtype, device=dev) * 1e-3)
            timer.sync()
            if ep_group is not None:
                dist.barrier(group=ep_group)
            # Fill the device queue: the host issues the whole phase while the device spins. The TP ranks
            # start together and spin alike, so a collective inside a unit (sequence sharding's gathers)
            # times the transfer, not one rank's longer hold or later start.
            held = hold_for(issue_s.get(phase))
            if tp_group is not None:
                held = _aligned(held, tp_group, dev)
            timer.hold(held)
            # the op's first unit starts by gathering (sequence sharding): its head and gather run before its
            # lap, as the other units' heads do (follow), and the simulator prices the gather; its memory counts
            lead = bool(tasks) and tp_group is not None and chunk.follows(tasks[0])
            laps, a2a_laps = [], []
            p0 = time.perf_counter()
            for i, task in enumerate(tasks):
                key = (task.phase.value, task.unit.value, task.layer)
                before = timer.memory(chunk)
                if lead and i == 0:
                    chunk.lead(0, task).wait()
                timer.reset_peak()
                start = timer.lap_start()
                h0 = time.perf_counter()
                out = chunk.run(0, task)
                h1 = time.perf_counter()
                if phase is OpKind.B and i == len(tasks) - 1:
                    # The norm backward left for the end of the op (ModelChunk.end_backward) is
                    # real compute of this op: charge it to its last unit.
                    chunk.end_backward(0)
                lap = timer.lap_end(start)
                ar(out, task)  # outside the lap; the next unit's start waits for it, as in the executor
                if task.comm is Comm.A2A and out is not None:  # an MoE unit's exchange (an Exchange), timed on its own
                    a2a_start = timer.lap_start()
                    out.start().wait()
                    if keep:
                        a2a_laps.append((key, timer.lap_end(a2a_start)))
                        a2a_bytes[key] = out.send.numel() * out.send.element_size()
                if task.ar and i + 1 < len(tasks) and chunk.follows(tasks[i + 1]):
                    chunk.follow(0, tasks[i + 1])[0].wait()  # the next unit's head, as the executor runs it (braid.runtime.follow)
                if keep:
                    laps.append((key, lap))
                    host.append(h1 - h0)
                    host_ph.setdefault(task.phase.value, []).append(h1 - h0)
                    after = timer.memory(chunk)
                    mem[key] = after - before
                    work[key] = max(work.get(key, 0), timer.workspace(before, after))
            if it > 0:  # the first iteration compiles and initialises lazily: not the phase's issue time
                issue_s[phase] = issue_time(time.perf_counter() - p0, held, timer.cuda)
            timer.sync()
            for key, lap in laps:
                times.setdefault(key, []).append(timer.seconds(lap))
            for key, lap in a2a_laps:
                a2a.setdefault(key, []).append(timer.seconds(lap))
            if phase is OpKind.F:
                chunk.end_forward(0)
                if not spec.head:
                    chunk.pop_output(0)
            elif phase is OpKind.B and not spec.embed:
                chunk.pop_input_grad(0)
        progress.step(f"stage units {it + 1}/{pc.warmup + pc.iters}")
    return {"times": [[*k, statistics.median(v)] for k, v in times.items()], "mem": [[*k, b] for k, b in mem.items()],
            "work": [[*k, b] for k, b in work.items()],
            "a2a": [[*k, statistics.median(v), a2a_bytes[k]] for k, v in a2a.items()],
            # Host time to issue one unit task (GPU: the host runs ahead of the device; on CPU
            # the unit times already hold it, so the host lane is off).
            "host_s": statistics.median(host) if (host and timer.cuda) else 0.0,
            "host_s_per_phase": {ph: statistics.median(v) for ph, v in host_ph.items()} if timer.cuda else {}}


def _median_time(timer: _Timer, fn: Callable[[], Any], n: int) -> float:
    fn()
    return statistics.median(timer.time(fn)[0] for _ in range(n))


def _comm_figures(pc: ProfileConfig, groups, timer: _Timer, dev: torch.device, comm=None) -> dict[str, float]:
    """All-reduce alone and its slowdown of a concurrent GEMM; P2P of a boundary tensor; copy bandwidth.

    ``comm``: the TP all-reduce to measure (:class:`braid.tp.comm.TPComm`; default the groups')."""
    comm = comm if comm is not None else groups.tp_comm

    def all_reduce(t: torch.Tensor):
        return comm.all_reduce(t)

    dtype = DTYPES[pc.dtype]
    n = max(5, 2 * pc.iters)
    x = torch.randn(pc.act_shape(), dtype=dtype, device=dev)
    out: dict[str, float] = {"ar_s": 0.0, "ar_slowdown": 1.0, "gemm_s": 0.0, "gemm_overlapped_s": 0.0, "p2p_s": 0.0,
                             "ar_stretch": 1.0}
    if pc.tp > 1:
        out["ar_s"] = ar = _median_time(timer, lambda: all_reduce(x).wait(), n)
        if pc.vision is not None:  # the tower's all-reduces carry its patches' activations, not the LM's
            v = pc.vision.vit
            xv = torch.randn(1, pc.micro_batch_size * v.patches, v.hidden, dtype=dtype, device=dev)  # (1, b*patches, hv)
            out["ar_vision_s"] = _median_time(timer, lambda: all_reduce(xv).wait(), n)
        tokens = pc.micro_batch_size * pc.seq
        a = torch.randn(tokens, pc.model.hidden, dtype=dtype, device=dev)
        b = torch.randn(pc.model.hidden, pc.model.ffn // pc.tp, dtype=dtype, device=dev)
        one = _median_time(timer, lambda: a @ b, n)
        reps = max(1, int(0.8 * ar / one)) if one > 0 else 1  # GEMM work shorter than the all-reduce window

        def gemm() -> None:
            for _ in range(reps):
                a @ b

        alone = _median_time(timer, gemm, n)
        over = []
        for _ in range(n + 1):
            timer.sync()
            dist.barrier(group=groups.tp)
            work = all_reduce(x)
            over.append(timer.time(gemm)[0])
            work.wait()
        d = statistics.median(over[1:])
        # The simulator slows compute by f while an all-reduce is in flight (window ``ar``):
        # d = dur*f inside the window, else win + (dur - win/f). Solve for f.
        if d <= ar:
            f = d / alone
        else:
            f = ar / max(ar + alone - d, ar / 2.0)
        out.update(ar_slowdown=min(2.0, max(1.0, f)), gemm_s=alone, gemm_overlapped_s=d)
        if timer.cuda:
            out.update(collective_pair(x, groups.tp, a, b, ar, one, dev, n, all_reduce))
    if pc.pp > 1:
        me = groups.coords.pp
        nxt, prv = groups.pp_ranks[(me + 1) % pc.pp], groups.pp_ranks[(me - 1) % pc.pp]
        buf = torch.empty_like(x)

        def ring() -> None:
            ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, buf, prv)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        vals = []
        for _ in range(n + 1):
            dist.barrier(group=groups.pp)  # both sides posted together: the transfer, not the peer's lag
            vals.append(timer.time(ring)[0])
        out["p2p_s"] = statistics.median(vals[1:])
    out["copy_bytes_per_s"], out["copy_duplex_slowdown"] = measure_host_link(dev)
    return out


def compare_tp_backends(pc: ProfileConfig, groups, dev: torch.device, backends: Sequence[str] | None = None) -> dict[str, Any]:
    """Each available TP backend alone and beside GEMMs (collective); the best for braiding.

    For every backend of :mod:`braid.tp.comm` that can run here: the all-reduce of a boundary
    activation alone, its stretch beside GEMMs that outlast it, the GEMMs' slowdown, and the
    time until both are done. The best backend for braided execution is the one whose
    all-reduce plus the compute beside it finish first (``together_s``): a braided block
    hides the all-reduce, so what counts is what it costs the GEMMs and how long it still
    sticks out. Backends that cannot be created here are listed with the reason.
    """
    from braid.tp.comm import CUDA_BACKENDS, TPBackendError, make_tp_comm

    if dev.type != "cuda" or pc.tp == 1:
        return {"chosen": "gloo" if dev.type != "cuda" else groups.tp_backend, "backends": {}}
    dtype = DTYPES[pc.dtype]
    n = max(5, 2 * pc.iters)
    x = torch.randn(pc.act_shape(), dtype=dtype, device=dev)
    tokens = pc.micro_batch_size * pc.seq
    a = torch.randn(tokens, pc.model.hidden, dtype=dtype, device=dev)
    b = torch.randn(pc.model.hidden, pc.model.ffn // pc.tp, dtype=dtype, device=dev)
    timer = _Timer(dev)
    one = _median_time(timer, lambda: a @ b, n)
    figures: dict[str, Any] = {}
    for name in backends or CUDA_BACKENDS:
        try:
            comm = make_tp_comm(groups, name)
            ar = _median_time(timer, lambda: comm.all_reduce(x).wait(), n)
            figures[name] = {"ar_s": ar, **collective_pair(x, groups.tp, a, b, ar, one, dev, n, comm.all_reduce)}
        except (TPBackendError, RuntimeError) as err:  # not available with this torch / NCCL / machine
            figures[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        dist.barrier()
    usable = {k: v for k, v in figures.items() if "error" not in v}
    chosen = min(usable, key=lambda k: usable[k]["together_s"]) if usable else groups.tp_backend
    return {"chosen": chosen, "backends": figures}


def measure_host_link(device: torch.device, nbytes: int | None = None, iters: int = 5) -> tuple[float, float]:
    """Host<->device copy bandwidth per direction (bytes/s) and its duplex slowdown.

    CUDA: pinned host buffers and non-blocking copies, each direction on a stream of its own
    as the offload runtime issues them. The bandwidth is the slower direction's, alone; the
    slowdown is the time of one copy in each direction at once over that (1 = full-duplex
    link, 2 = the directions share it). CPU: a memcpy (offload copies there are synchronous
    and never overlap, so the slowdown is 1).
    """
    timer = _Timer(device)
    if device.type != "cuda":
        n = nbytes or 16 << 20
        src, dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        return n / _median_time(timer, lambda: dst.copy_(src), iters), 1.0
    n = nbytes or 128 << 20
    host_in, host_out = (torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    dev_in, dev_out = (torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2))
    main = torch.cuda.current_stream(device)
    streams = {"h2d": torch.cuda.Stream(device), "d2h": torch.cuda.Stream(device)}
    copies = {"h2d": lambda: dev_in.copy_(host_in, non_blocking=True),
              "d2h": lambda: host_out.copy_(dev_out, non_blocking=True)}

    def run(*which: str) -> Callable[[], None]:
        def go() -> None:
            for w in which:
                streams[w].wait_stream(main)
                with torch.cuda.stream(streams[w]):
                    copies[w]()
            for w in which:
                main.wait_stream(streams[w])
        return go

    alone = max(_median_time(timer, run("h2d"), iters), _median_time(timer, run("d2h"), iters))
    both = _median_time(timer, run("h2d", "d2h"), iters)
    return n / alone, min(2.0, max(1.0, both / alone))


def tp_comm_for(pc: ProfileConfig, groups, dev: torch.device) -> tuple[Any, dict[str, Any] | None]:
    """The TP all-reduce a run of ``pc`` uses (collective): ``pc.tp_backend``, or with ``"all"``
    the best of :func:`compare_tp_backends` (returned with the comparison)."""
    from braid.tp.comm import make_tp_comm, resolve_tp_backend

    if pc.tp_backend == "all":
        choice = compare_tp_backends(pc, groups, dev)
        return make_tp_comm(groups, choice["chosen"], pc.tp_max_ctas), choice
    return make_tp_comm(groups, resolve_tp_backend(pc.tp_backend, dev, pc.seq_shard), pc.tp_max_ctas), None


def measure_rank(d, pc: ProfileConfig, groups, chunks: dict | None = None, comm=None,
                 choice: dict[str, Any] | None = None, experts: Any = None) -> dict[str, Any]:
    """Everything this rank measures (collective: every rank of the layout calls it).

    ``comm``: the TP all-reduce to measure (default: :func:`tp_comm_for`); ``choice``: the
    backend comparison it came from, if any (written to the cost file's meta); ``experts``: this
    rank's expert groups at ``pc.ep > 1`` (:mod:`braid.measure.experts`: the all-to-all and the
    routing counts are measured too)."""
    from braid.measure.experts import a2a_figures, count_routes

    dev = d.device
    if comm is None:
        comm, choice = tp_comm_for(pc, groups, dev)
    timer = _Timer(dev)
    chunks = chunks if chunks is not None else build_chunks(pc, groups, dev, experts=experts)
    gather_through(chunks, comm)  # sequence sharding's all-gathers as the executor runs them
    routes = count_routes(chunks)
    progress = Progress(pc.v * (pc.warmup + pc.iters), "profile", enabled=d.rank == 0)
    stages = {}
    for c, ch in sorted(chunks.items()):
        stage = stage_of(pc.placement, pc.pp, groups.coords.pp, c)
        stages[stage] = _profile_chunk(ch, ch.spec, pc, timer, groups.tp if pc.tp > 1 else None, dev, progress,
                                       groups.coords.dp, experts.ep_group if experts is not None else None)
        ch.zero_grad(set_to_none=True)
    figures = {**_comm_figures(pc, groups, timer, dev, comm), **a2a_figures(pc, experts, timer.time, dev, max(5, 2 * pc.iters))}
    return {"rank": d.rank, "stages": stages, "comm": figures, "tp_backend": comm.backend, "tp_backends": choice,
            "routes": routes.read() if routes is not None and groups.coords.tp == 0 else None}


# ----------------------------------------------------------------------------------------
# From measurements to a cost model
# ----------------------------------------------------------------------------------------
def _spread(per_unit: dict[str, float], count: dict[str, int]) -> dict[str, float]:
    """Per unit, its share of the chunk total ``sum(per_unit[u] * count[u])`` (at least 0), in proportion to its
    non-negative figure: the total is kept where a unit's own figure went below zero."""
    total = max(0.0, sum(v * count[u] for u, v in per_unit.items()))
    pos = {u: max(0.0, v) for u, v in per_unit.items()}
    norm = sum(v * count[u] for u, v in pos.items())
    return {u: (v * total / norm if norm > 0 else 0.0) for u, v in pos.items()}


def _unit_costs(entries: list[dict[str, Any]], spec: ChunkSpec, ar_s: float, ar_vision_s: float | None = None,
                a2a: tuple[float, float] = (0.0, 0.0)) -> dict[Unit, UnitCost]:
    """Average the per-instance medians (over layers and TP ranks) into one cost per unit kind.

    A vision stage (``spec.merge``): its units' all-reduces carry the tower's activations
    (``ar_vision_s``), but for the merge's forward one, which joins the visual tokens with the text
    embedding at the LM's width (``ar_s``). An MoE chunk at expert parallelism (``a2a``: the busiest
    rank's row exchange and the counts' exchange outside the units' times, seconds): the experts' times are the busiest
    rank's (the mean over its layers, the most over the ranks), as the cost model prices the rank
    every exchange waits for, and each MoE unit carries the all-to-all that ends it
    (:func:`braid.measure.experts.unit_a2a`)."""
    from braid.measure.experts import unit_a2a

    ar_in = ar_s if ar_vision_s is None or not spec.merge else ar_vision_s
    busiest: dict[tuple[str, str], float] = {}  # experts at ep > 1: the most, over the ranks, of a rank's mean
    if a2a[0] > 0:
        for e in entries:
            mine: dict[tuple[str, str], list[float]] = {}
            for ph, u, _layer, v in e["times"]:
                if u == Unit.EXPERTS.value:
                    mine.setdefault((ph, u), []).append(v)
            for k, v in mine.items():
                busiest[k] = max(busiest.get(k, 0.0), statistics.fmean(v))
    t: dict[tuple[str, str], list[float]] = {}
    m: dict[tuple[str, str], list[float]] = {}
    work: dict[str, float] = {}  # unit -> the most workspace any of its instances and phases took
    for e in entries:
        for _ph, u, _layer, b in e.get("work", ()):
            work[u] = max(work.get(u, 0.0), float(b))
        for ph, u, _layer, v in e["times"]:
            t.setdefault((ph, u), []).append(v)
        for ph, u, _layer, b in e["mem"]:
            m.setdefault((ph, u), []).append(b)
    t.update({k: [v] for k, v in busiest.items()})
    mean = lambda d, k: statistics.fmean(d[k]) if k in d else 0.0  # noqa: E731
    units = sorted({u for _, u in t}, key=[x.value for x in Unit].index)
    per_chunk = Counter(u.value for u, _ in spec.layer_units())  # half layers count their half
    count = {u: (1 if Unit(u) in (Unit.EMBED, Unit.HEAD, Unit.MERGE) else per_chunk[u]) for u in units}
    # A unit's own figure can be negative: boxes freed one unit late (norm backward at the start of the
    # next unit); under sequence sharding a unit's forward frees the gathered input its predecessor's
    # follow made (counted there). Keep each chunk total, spread over the non-negative figures: a
    # negative one read as 0 would count what it freed twice.
    act = _spread({u: mean(m, ("F", u)) for u in units}, count)
    w_res = _spread({u: mean(m, ("F", u)) + mean(m, ("B", u)) for u in units}, count)
    out = {}
    for u in units:
        unit = Unit(u)
        ar_f = (ar_s if unit is Unit.MERGE else ar_in) if unit in AR_FORWARD else 0.0
        a2a_f, a2a_b = unit_a2a(unit, *a2a) if spec.moe else (0.0, 0.0)
        out[unit] = UnitCost(mean(t, ("F", u)), mean(t, ("B", u)), mean(t, ("W", u)),
                             ar_f, ar_in if unit in AR_BACKWARD else 0.0, act[u], w_res[u], work.get(u, 0.0), a2a_f, a2a_b)
    return out


def assemble(pc: ProfileConfig, results: Sequence[dict[str, Any]]) -> CostModel:
    """The cost model of the layout from every rank's :func:`measure_rank` result."""
    from braid.cost.catalog import ModelConfig
    from braid.measure.experts import moe_meta

    specs = pc.specs(pc.placement)
    comm = [r["comm"] for r in results]
    ar_s = max(c["ar_s"] for c in comm)
    ar_v = max(c.get("ar_vision_s", ar_s) for c in comm)
    p2p = max(c["p2p_s"] for c in comm)
    moe = moe_meta(pc, results)
    # the busiest rank's row exchange (padded: the same blocks whatever the routing); the counts' exchange blocks
    # inside Pre-MLP's forward, whose time holds it
    a2a = (max(c["a2a_s"] for c in comm) * (1.0 if pc.moe_dispatch == "padded" else moe["imbalance"]), 0.0) if moe else (0.0, 0.0)
    chunks = {}
    for (rank, c), spec in specs.items():
        stage = stage_of(pc.placement, pc.pp, rank, c)
        entries = [r["stages"][stage] for r in results if stage in r["stages"]]
        chunks[(rank, c)] = ChunkCosts(spec, _unit_costs(entries, spec, ar_s, ar_v, a2a), p2p)
    ma = statistics.fmean(cc.total("act") for cc in chunks.values())
    mcfg = pc.model
    dtype_bytes = torch.finfo(DTYPES[pc.dtype]).bits // 8
    if pc.vision is not None:  # the tower's FLOPs count too (MFU as the example reports it)
        from braid.models.qwen2_vl import catalog_shape

        mc = catalog_shape(pc.full_model(), "profiled", seq=pc.seq, micro_batch_size=pc.micro_batch_size, dtype_bytes=dtype_bytes)
    elif getattr(mcfg, "experts", 0):  # the active experts (top-k) and the router (braid.cost.moe_costs)
        from braid.models.registry import family_of_config
        from braid.models.shapes import from_decoder_config

        mc = from_decoder_config("profiled", pc.full_model(), family_of_config(mcfg).name, seq=pc.seq,
                                 micro_batch_size=pc.micro_batch_size, dtype_bytes=dtype_bytes)
    else:
        mc = ModelConfig("profiled", pc.num_layers, mcfg.hidden, mcfg.heads, mcfg.kv_heads, mcfg.ffn,
                         mcfg.vocab_size, pc.seq, pc.micro_batch_size, dtype_bytes)
    meta = {"config": {**asdict(pc), "model": asdict(pc.model)}, "device": device_name(pc.device),
            "torch": torch.__version__, "comm": {k: statistics.fmean(c[k] for c in comm) for k in comm[0]},
            "tp_backend": results[0].get("tp_backend", "gloo")}
    if results[0].get("tp_backends"):
        meta["tp_backends"] = results[0]["tp_backends"]
    if moe:
        meta["moe"] = moe
    per_phase = [st["host_s_per_phase"] for r in results for st in r["stages"].values() if st.get("host_s_per_phase")]
    if per_phase:  # host time per unit task by phase (the host lane uses one figure: host_task_s)
        meta["host_task_s_per_phase"] = {ph: statistics.fmean(p[ph] for p in per_phase if ph in p)
                                         for ph in sorted({ph for p in per_phase for ph in p})}
    return CostModel(pc.layout, chunks, ma, statistics.fmean(c["copy_bytes_per_s"] for c in comm), False,
                     max(c["ar_slowdown"] for c in comm), pc.micro_batch_size, pc.seq,
                     3 * model_forward_flops(mc) / pc.micro_batch_size, pc.peak_flops, "profile", meta,
                     copy_duplex_slowdown=max(c["copy_duplex_slowdown"] for c in comm),
                     ar_stretch=max(c["ar_stretch"] for c in comm),
                     a2a_slowdown=max((c["a2a_slowdown"] for c in comm if "a2a_slowdown" in c), default=None),
                     host_task_s=statistics.fmean(st.get("host_s", 0.0) for r in results for st in r["stages"].values()))


def profile_to_dict(costs: CostModel) -> dict[str, Any]:
    """The cost-file form (``braid-costs/1``) with chunks keyed by virtual stage (any placement reads it)."""
    d = costs_to_dict(costs)
    lay = costs.layout
    d["chunks"] = {str(stage_of(lay.placement, lay.p, *map(int, k.split(",")))): v for k, v in d["chunks"].items()}
    return d


def _profile_job(d, pc: ProfileConfig) -> dict[str, Any] | None:
    from braid.measure.experts import job_groups

    groups, experts = job_groups(pc)
    res = measure_rank(d, pc, groups, experts=experts)
    gathered: list[Any] = [None] * pc.world_size
    dist.all_gather_object(gathered, res)
    return profile_to_dict(assemble(pc, gathered)) if d.rank == 0 else None


def profile(pc: ProfileConfig) -> dict[str, Any]:
    """Spawn the layout's ranks, measure, and return the cost-file dict."""
    return launch(pc.world_size, pc.device, _profile_job, pc)[0]
