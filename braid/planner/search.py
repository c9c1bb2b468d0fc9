"""The planner's search: every valid job layout and schedule, memory first, then simulation.

A :class:`Candidate` is one way to run a training step on ``gpus`` GPUs: degrees (tp, pp,
dp, cp = hp x ring, SP placement), micro-batch size and count, schedule and its knob values
(:class:`braid.schedules.Knob`), recomputation. :func:`search` finds the fastest ones that fit
the memory cap:

1. **Enumerate** (:func:`candidates`): tp dividing the heads (at most a node), cp dividing the
   sequence into shards of at least ``MIN_LOCAL_SEQ`` tokens (LLMs only: the VLM example runs
   no SP), pp whose stages each get a layer, dp the
   rest, micro-batch sizes that split the per-replica batch, every registered schedule that
   accepts (p, m), with m and p x m within what the command lines accept
   (:data:`braid.io.cli.MAX_MBS`, :data:`braid.io.cli.MAX_PM`). Divisors are enumerated only up
   to the layer count (pp), so the search's cost does not grow with ``gpus``. Memory-saving variants (a schedule's ``saves_memory_of``, recomputation)
   are tried only for layouts whose plain form does not fit.
2. **Prune by memory**: weights, gradients and optimizer states (:func:`braid.cost.cluster.static_bytes`)
   plus the smallest activation any schedule keeps (one micro-batch of one chunk), as device
   memory in use (:func:`device_memory`: the allocator's fragmentation, the CUDA context, the
   layout's NCCL communicators, cuBLAS; :mod:`braid.cost.device_memory`) above the cap -> dropped
   unsimulated. A simulated candidate fits when its device memory in use is within the cap.
3. **Bound**: a lower bound of the step time per candidate (:func:`lower_bound`): on every
   rank, the forwards of the stages below its lowest one must run before it can start; then
   all its own compute, the waits of its plain (unbraided) ops on their own TP all-reduces
   (counted in the candidate's compiled programs: only for candidates that reach the front of
   the queue), and its last chunk's gradient reduction; and the activation backwards of the
   stages below follow its last activation backward; plus the optimizer step. The simulated
   step is never below it (compute only slows down beside all-reduces, waits add).
4. **Simulate** in order of the bound (:func:`braid.simulator.fast.simulate_schedule`, plus the
   data-parallel tail the simulator schedules, :func:`simulator.dp.dp_tail`, on the costs of
   :func:`braid.cost.cluster.dp_costs`), keeping the ``top`` fastest that fit;
   stop once ``top`` fit and the next bound is no less than the fastest step time found: then
   the first is the exhaustive search's best (``SearchResult.complete``), and places 2..top
   are the fastest of the candidates simulated by then. ``max_simulations`` (a count: the
   same answer on any machine) or, if given, ``time_budget_s`` stops the search earlier
   (``complete`` False, ``stopped`` says why: the ranking covers what was simulated).
5. **Half-layer cuts**: each ranked LM configuration of several pipeline ranks (no full
   recomputation) is simulated again with the head's stage half a layer lighter and half a
   layer heavier than the paper's split (:func:`braid.core.partition.split_layers`; a split
   already tried is not repeated), and the ranking takes those that fit. This refines the
   ranked configurations; the bound of step 4 covers the whole-layer splits only. Not with a
   ``costs_fn`` (a cost file prices the split it was measured with).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterator

from braid.cost.cluster import Cluster, DpCosts, Parallel, dp_costs, job_costs, reduce_time, static_bytes
from braid.cost.costs import CostModel, Layout, model_forward_flops, model_stage_layers, stage_lighter
from braid.cost.catalog import ModelConfig
from braid.cost.device_memory import planned_device_bytes, tp_comm_of
from braid.core.capture import captured_by_default
from braid.cost.optimizer_modes import DEFAULT_OPTIMIZER
from braid.io.cli import MAX_MBS, MAX_PM, resolve_seq_shard

MICRO_BATCH_SIZES = (1, 2, 4)
MAX_SIMULATIONS = 500  # a search's default budget: a count, so its answer is the same on any machine
MIN_LOCAL_SEQ = 1024  # sequence parallelism stops where a rank would hold fewer tokens (attention blocks too small)


@dataclass(frozen=True, slots=True)
class Candidate:
    par: Parallel
    schedule: str
    m: int
    options: tuple[tuple[str, Any], ...] = ()
    lighter: float | None = None  # layers fewer on the last stage (a half cuts a layer); None: the paper's split

    def describe(self) -> str:
        p = self.par
        sp = f" cp={p.cp} hp={p.hp}" + (f" ring={p.ring}" if p.ring else "") + f" {p.sp_placement}" if p.cp > 1 else ""
        opts = "".join(f" {k}={v:g}" if isinstance(v, float) else f" {k}={v}" for k, v in self.options)
        return (f"tp={p.tp} pp={p.pp} dp={p.dp}{f' ep={p.ep}' if p.ep > 1 else ''}{sp} {self.schedule}{opts} m={self.m} mbs={p.micro_batch_size}"
                + (" recompute" if p.recompute else "") + (f" lighter={self.lighter:g}" if self.lighter is not None else ""))


@dataclass(frozen=True, slots=True)
class Evaluation:
    """A simulated candidate: predicted step and memory (worst rank), and where the time goes."""

    cand: Candidate
    step_s: float
    tokens_s: float
    mfu: float
    peak_bytes: float  # device memory in use on the worst rank (braid.cost.device_memory), what the cap is checked against
    static_bytes: float
    bubble_frac: float  # idle share of the busiest rank (waiting on the pipeline)
    exposed_comm_frac: float  # exposed TP all-reduce and data-parallel reduction after the pipeline
    optimizer_s: float
    method: str
    lower_bound_s: float

    def to_dict(self) -> dict[str, Any]:
        p = self.cand.par
        return {"tp": p.tp, "pp": p.pp, "dp": p.dp, "ep": p.ep, "cp": p.cp, "hp": p.hp, "ring": p.ring, "sp_placement": p.sp_placement,
                "schedule": self.cand.schedule, "options": dict(self.cand.options), "m": self.cand.m,
                "micro_batch_size": p.micro_batch_size, "recompute": p.recompute, "optimizer": p.optimizer,
                "last_stage_lighter": self.cand.lighter,
                "step_s": self.step_s, "tokens_per_s": self.tokens_s, "mfu": self.mfu,
                "peak_memory_gib": self.peak_bytes / 2**30, "static_memory_gib": self.static_bytes / 2**30,
                "bubble": self.bubble_frac, "exposed_comm": self.exposed_comm_frac,
                "optimizer_s": self.optimizer_s, "simulation": self.method,
                "lower_bound_s": self.lower_bound_s}


@dataclass(frozen=True, slots=True)
class Problem:
    """What to plan for: the model (``seq`` = LM tokens per sample), GPUs, batch and memory cap."""

    model: ModelConfig  # seq = the LM sequence of one sample
    gpus: int
    cluster: Cluster
    global_batch: int
    memory_bytes: float
    optimizer: str = DEFAULT_OPTIMIZER  # a braid.cost.optimizer_modes mode
    seq_shard: bool = True  # sequence parallelism inside TP where the examples turn it on (braid.io.cli.resolve_seq_shard)
    ep: int | None = 1  # an MoE model's expert-parallel degree: given, layouts whose dp it divides (cp = 1) keep it;
    # None, searched: every power of two dividing a layout's dp whose experts split over tp x ep (:func:`expert_degrees`)
    moe_imbalance: float = 1.0  # the busiest expert rank's routed tokens over the mean (braid.cost.moe_costs)


@dataclass(slots=True)
class SearchResult:
    best: list[Evaluation]
    evaluated: list[Evaluation] = field(default_factory=list)  # every simulated candidate (fits or not)
    enumerated: int = 0
    memory_pruned: int = 0
    bound_pruned: int = 0
    complete: bool = True
    stopped: str = ""  # why the search stopped early ("after 1000 simulations"); "" when it ran to the end
    elapsed_s: float = 0.0


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def _divisors(n: int, upto: int | None = None) -> list[int]:
    """The divisors of ``n`` up to ``upto`` (all of them by default): the search runs to ``upto``, not to ``n``."""
    return [d for d in range(1, min(n, n if upto is None else upto) + 1) if n % d == 0]


def expert_degrees(prob: Problem, tp: int, dp: int) -> list[int]:
    """The expert-parallel degrees a layout of ``tp`` and ``dp`` takes: the given one where it divides ``dp``
    and, times tp, the experts; searched (``prob.ep`` None), every power of two that does (1 for a dense model)."""
    experts = prob.model.experts
    if not experts:
        return [1]
    cands = [prob.ep] if prob.ep is not None else _pow2_upto(dp)
    return [e for e in cands if dp % e == 0 and experts % (tp * e) == 0]


def layouts(prob: Problem) -> Iterator[Parallel]:
    """Every (tp, cp, hp, ring, placement, pp, dp, ep, micro-batch size) that fits the GPUs and the model."""
    mdl, g = prob.model, prob.cluster.gpus_per_node
    least_ep = 1 if prob.ep is None else prob.ep
    for tp in _pow2_upto(min(g, prob.gpus)):
        if mdl.heads % tp or (mdl.kv_heads % tp and tp % mdl.kv_heads) or (mdl.experts and mdl.experts % (tp * least_ep)):
            continue
        for cp in ([1] if mdl.vit is not None or least_ep > 1 else _pow2_upto(prob.gpus // tp)):
            if cp > 1 and (mdl.seq % (2 * cp) or mdl.seq // cp < MIN_LOCAL_SEQ):
                continue
            for sp in _sp_options(mdl, tp, cp, g):
                for pp in _divisors(prob.gpus // (tp * cp), upto=mdl.layers):  # a stage per layer at most
                    dp = prob.gpus // (tp * cp * pp)
                    if prob.global_batch % dp:
                        continue
                    for ep in expert_degrees(prob, tp, dp) if cp == 1 else [1]:  # experts beside cp > 1: not run
                        for mbs in MICRO_BATCH_SIZES:
                            if (prob.global_batch // dp) % mbs == 0:
                                shard = prob.seq_shard and resolve_seq_shard(None, tp, seq=mdl.seq, cp=cp, vision=mdl.vit is not None,
                                                                             moe=bool(mdl.experts))
                                yield Parallel(tp, pp, dp, cp, sp[0], sp[1], sp[2], mbs, False, prob.optimizer,  # type: ignore[arg-type]
                                               seq_shard=shard, ep=ep, moe_imbalance=prob.moe_imbalance)


def _sp_options(mdl: ModelConfig, tp: int, cp: int, g: int) -> list[tuple[int, int | None, str]]:
    if cp == 1:
        return [(1, None, "head_first")]
    heads_t, kv_t = mdl.heads // tp, max(mdl.kv_heads // tp, 1)
    out = []
    for hp in _divisors(cp):
        if heads_t % hp or (kv_t % hp and hp % kv_t):
            continue
        ring_ranks = cp // hp
        rings: list[int | None] = [None]
        inner = g // (tp * (hp if hp > 1 else 1))  # ranks of one ring that fit a node next to each other
        if 1 < inner < ring_ranks and ring_ranks % inner == 0:
            rings.append(inner)
        placements = ["head_first", "context_first"] if hp > 1 and ring_ranks > 1 else ["head_first"]
        out += [(hp, w, pl) for w in rings for pl in placements]
    return out


def schedule_candidates(prob: Problem, par: Parallel, plain: bool) -> Iterator[Candidate]:
    """Schedules (and knob values) that accept the layout; ``plain``: no memory-saving variants."""
    from braid import schedules

    m = prob.global_batch // par.dp // par.micro_batch_size
    if m > MAX_MBS or par.pp * m > MAX_PM:  # beyond what compiles and simulates in seconds (braid.io.cli)
        return
    for name in schedules.names():
        spec = schedules.get_schedule(name)
        if (spec.saves_memory_of is not None) == plain or not spec.accepts_m(par.pp, m):
            continue
        stages = par.pp * spec.v
        if stages > prob.model.layers + (prob.model.vit is not None) or (prob.model.vit is not None and stages < 2):
            continue
        try:
            stage_lighter(prob.model, stages)
        except ValueError:
            continue
        searched = [k for k in spec.knobs if k.search]
        if not searched:
            yield Candidate(par, name, m)
            continue
        for k in searched:  # one knob at a time, the others at their defaults
            for val in k.search:
                yield Candidate(par, name, m, ((k.name, val),))


def half_cuts(prob: Problem, cand: Candidate) -> Iterator[Candidate]:
    """``cand`` with the head's stage half a layer lighter and half a layer heavier than the paper's
    split (an LM of several pipeline ranks; not under full recomputation, which re-runs whole layers)."""
    from dataclasses import replace

    from braid import schedules

    par = cand.par
    if prob.model.vit is not None or par.pp < 2 or par.recompute or cand.lighter is not None:
        return
    layout = Layout(par.tp, par.pp, schedules.get_schedule(cand.schedule).v)
    seen = {model_stage_layers(prob.model, layout)}  # the paper's split; a half may round to the same stages
    lighter = stage_lighter(prob.model, layout.num_stages)
    for half in (lighter - 0.5, lighter + 0.5):
        if half <= 0:
            continue
        try:
            split = model_stage_layers(prob.model, layout, half)
        except ValueError:
            continue
        if split not in seen:
            seen.add(split)
            yield replace(cand, lighter=half)


@lru_cache(maxsize=4096)
def _costs(prob: Problem, par: Parallel, v: int, placement: str, lighter: float | None) -> CostModel:
    return job_costs(prob.model, prob.cluster, par, Layout(par.tp, par.pp, v, placement), lighter)  # type: ignore[arg-type]


def costs_of(prob: Problem, cand: Candidate) -> CostModel:
    """The pipeline's cost model (it does not depend on dp or the optimizer: those share one; an MoE
    model's expert-parallel all-to-alls depend on ep, which dp = ep keeps)."""
    from dataclasses import replace

    from braid import schedules

    spec = schedules.get_schedule(cand.schedule)
    return _costs(prob, replace(cand.par, dp=cand.par.ep, optimizer=DEFAULT_OPTIMIZER), spec.v, spec.placement, cand.lighter)


_TERMS: dict[int, tuple[CostModel, list[tuple[float, float, float, float]]]] = {}
_WAITS: dict[int, tuple[CostModel, list[dict[tuple[int, Any], float]]]] = {}


def _pipeline_terms(costs: CostModel) -> list[tuple[float, float, float, float]]:
    """Per rank: forwards and activation backwards of the stages below its lowest one (one
    micro-batch each), its own compute per micro-batch, and its forwards + activation backwards."""
    from braid.core.ir import rank_chunk_of

    hit = _TERMS.get(id(costs))
    if hit is not None and hit[0] is costs:
        return hit[1]
    lay = costs.layout
    owner = [rank_chunk_of(lay.placement, lay.p, s) for s in range(lay.num_stages)]
    f = [costs.chunks[rc].total("f") for rc in owner]
    b = [costs.chunks[rc].total("b") for rc in owner]
    out = []
    for r in range(lay.p):
        first = next(s for s, rc in enumerate(owner) if rc[0] == r)
        fb = sum(costs.chunks[(r, c)].total(a) for c in range(lay.v) for a in ("f", "b"))
        own = fb + sum(costs.chunks[(r, c)].total("w") for c in range(lay.v))
        out.append((sum(f[:first]), sum(b[:first]), own, fb))
    _TERMS[id(costs)] = (costs, out)
    return out


def _rank_waits(costs: CostModel) -> list[dict[tuple[int, Any], float]]:
    """Per rank: ``(chunk, kind) -> ``:func:`_waits` of a plain op of that kind on that chunk."""
    from braid.core.ir import OpKind

    hit = _WAITS.get(id(costs))
    if hit is not None and hit[0] is costs:
        return hit[1]
    lay = costs.layout
    out = [{(c, k): _waits(costs, r, c, k) for c in range(lay.v) for k in (OpKind.F, OpKind.B, OpKind.BW)}
           for r in range(lay.p)]
    _WAITS[id(costs)] = (costs, out)
    return out


def _waits(costs: CostModel, rank: int, chunk: int, kind: Any) -> float:
    """Time a plain (unbraided) op waits for its own TP all-reduces, at the least.

    Its unit tasks run one after another (:func:`braid.core.braiding.steps`). A task that waits
    for the all-reduce the task before it ends with starts ``ar`` after that task ends; with a
    weight-gradient task between them (a ``BW`` op), the all-reduce (stretched: compute runs
    beside it) less that task, slowed at most ``ar_slowdown``. The op's last all-reduce may
    be hidden by the next instruction: not counted. The simulator's rules (``simulator/engine.py``).
    """
    from braid.core.braiding import Phase, steps
    from braid.core.ir import Compute

    if costs.layout.tp == 1:
        return 0.0
    rows = steps(Compute(kind, 0, chunk), costs.spec_of(rank))
    units = costs.chunks[(rank, chunk)].units
    total = 0.0
    for k, st in enumerate(rows[:-1]):
        if not st.task.ar:
            continue
        u = units[st.task.unit]
        ar = u.ar_f if st.task.phase is Phase.F else u.ar_b
        nxt = rows[k + 1]
        if nxt.task.waits:
            total += ar
        elif k + 2 < len(rows) and rows[k + 2].task.waits:
            total += max(0.0, ar * costs.ar_stretch - costs.ar_slowdown * units[nxt.task.unit].w)
    return total


@lru_cache(maxsize=1024)
def _plain_ops(name: str, p: int, m: int, options: tuple[tuple[str, Any], ...]) -> tuple[dict[tuple[int, Any], int], ...]:
    """Per rank: how many plain compute instructions of each (chunk, kind) its program has."""
    from collections import Counter

    from braid.core.ir import Compute
    from braid.simulator.fast import compiled

    return tuple(dict(Counter((ins.chunk, ins.kind) for ins in prog.instructions if isinstance(ins, Compute)))
                 for prog in compiled(name, p, m, options))


def lower_bound(prob: Problem, cand: Candidate, costs: CostModel, dc: DpCosts | None = None, *,
                waits: bool = True) -> float:
    """A step time no schedule of this layout beats (see the module doc, step 3).

    Rank r starts no earlier than the forwards of the stages below its lowest one (micro-batch
    0); it then computes everything it owns, waits for the all-reduces its plain ops cannot
    hide (``waits``: counted in the candidate's compiled programs), and the gradient reduction
    of the chunk it computes last follows. Its last activation backward (of its lowest stage:
    the others' precede it) comes after all its forwards and activation backwards, and the
    activation backwards of the stages below follow it (weight gradients may be deferred past
    it). ``dc``: the candidate's :func:`~braid.cost.cluster.dp_costs`, if the caller has them.
    """
    lay = costs.layout
    plain = _plain_ops(cand.schedule, cand.par.pp, cand.m, cand.options) if waits and lay.tp > 1 else None
    wait = _rank_waits(costs) if plain else None
    best = 0.0
    for r, (f_below, b_below, own, fb) in enumerate(_pipeline_terms(costs)):
        tail = min(reduce_time(prob.model, costs, prob.cluster, cand.par, r, c) for c in range(lay.v))
        held = sum(n * wait[r].get(key, 0.0) for key, n in plain[r].items()) if plain and wait else 0.0
        best = max(best, f_below + cand.m * own + held + tail, f_below + cand.m * fb + b_below)
    dc = dc or dp_costs(prob.model, costs, prob.cluster, cand.par)
    return best + max(s + g for s, g in zip(dc.step_s, dc.gather_s))


def device_memory(prob: Problem, cand: Candidate, costs: CostModel, rank: int, held: float, activation: float,
                  step: float = 0.0) -> float:
    """Device memory in use on pipeline rank ``rank`` (:func:`braid.cost.device_memory.planned_device_bytes`):
    what the planner compares with the card's memory, for the step as the printed command runs it (a whole-step
    CUDA graph where the examples capture one). ``held``: state held across steps; ``activation``: the step's
    activation peak; ``step``: the optimizer step's temporaries."""
    p, lay, mdl = cand.par, costs.layout, prob.model
    graphed = captured_by_default(tp=p.tp, ep=p.ep, moe=bool(mdl.experts), moe_dispatch=p.moe_dispatch)
    backend, staging = tp_comm_of(tp=p.tp, seq_shard=p.seq_shard, tokens=mdl.seq * mdl.micro_batch_size,
                                  hidden=mdl.hidden, itemsize=mdl.dtype_bytes)
    return planned_device_bytes(cand.schedule, static_bytes=held, activation_bytes=activation, step_bytes=step,
                                graphed=graphed, tp=p.tp, pp=p.pp, pp_rank=rank, dp=p.dp, cp=p.cp,
                                placement=lay.placement, tp_backend=backend, ce_staging=staging,
                                captured_units=cand.m * costs.units_on(rank))


def min_memory(prob: Problem, cand: Candidate, costs: CostModel) -> float:
    """Static bytes of each rank plus one micro-batch's activations of one chunk, in use on the device: a floor."""
    act = max(cc.total("act") for cc in costs.chunks.values())
    return max(device_memory(prob, cand, costs, r, static_bytes(prob.model, costs, cand.par, r), act)
               for r in range(costs.layout.p))


def evaluate(prob: Problem, cand: Candidate, costs: CostModel | None = None, bound: float = 0.0,
             dc: DpCosts | None = None) -> Evaluation:
    """Simulate one candidate (fast path) and add the data-parallel tail and optimizer step
    (``dc``: the candidate's :func:`~braid.cost.cluster.dp_costs`, if the caller has them)."""
    from braid.simulator.dp import dp_tail
    from braid.simulator.fast import simulate_schedule

    costs = costs or costs_of(prob, cand)
    res = simulate_schedule(cand.schedule, cand.par.pp, cand.m, costs, cand.options)
    rep = res.report
    dc = dc or dp_costs(prob.model, costs, prob.cluster, cand.par)
    tail = dp_tail([r.end_s for r in rep.ranks], res.grad_ready, dc, chunks=costs.layout.v)
    step, tails, opts = tail.step_s, tail.reduce_exposed_s, tail.optimizer_s
    peak = max(device_memory(prob, cand, costs, r.rank, dc.held_bytes(r.rank), r.peak_activation_bytes,
                             dc.step_temp_bytes(r.rank)) for r in rep.ranks)
    stat = max(dc.static_bytes)
    tokens = prob.global_batch * prob.model.seq
    flops = 3 * model_forward_flops(prob.model.with_(micro_batch_size=1)) * prob.global_batch
    hw = prob.cluster.hw
    comm = max(r.tp_exposed_s for r in rep.ranks) + max(tails)
    busiest = max(rep.ranks, key=lambda r: r.compute_s)  # its idle time is the pipeline's cost
    return Evaluation(cand, step, tokens / step, flops / (step * prob.gpus * hw.peak_flops), peak, stat,
                      busiest.pp_bubble_s / step, comm / step, max(opts), res.method, bound)


OVER_CAP_SHOWN = 3  # pruned-by-memory candidates simulated after the search, to show what the cap cost


def search(prob: Problem, *, top: int = 10, max_simulations: int = MAX_SIMULATIONS, time_budget_s: float | None = None,
           only: Callable[[Candidate], bool] | None = None,
           costs_fn: Callable[[Candidate], CostModel] | None = None,
           progress: Callable[[SearchResult], None] | None = None) -> SearchResult:
    """The fastest candidate that fits ``prob.memory_bytes``, and up to ``top - 1`` runners-up (module doc).

    The search stops early (``complete`` False, ``stopped`` says why) after ``max_simulations``
    simulations -- a count, so the answer is the same on any machine -- or, only if given,
    ``time_budget_s`` seconds. ``only`` restricts the candidates (e.g. to one measured layout);
    ``costs_fn`` replaces the analytic job costs (e.g. with a profiled cost file) for every
    candidate; ``progress`` is called with the result so far after every simulation.
    """
    t0 = time.perf_counter()
    out = SearchResult([])
    # (bound, order, candidate, costs, dp costs, bound counts the waits on all-reduces)
    queue: list[tuple[float, int, Candidate, CostModel, DpCosts, bool]] = []
    seq = 0
    pruned: list[tuple[Candidate, CostModel]] = []  # dropped by memory unsimulated: the faster of them are shown over the cap
    dcs: dict[tuple[int, Parallel], tuple[CostModel, DpCosts]] = {}  # candidates of one layout share them

    def dp_costs_of(cand: Candidate, costs: CostModel) -> DpCosts:
        hit = dcs.get((id(costs), cand.par))
        if hit is None:
            hit = dcs[(id(costs), cand.par)] = (costs, dp_costs(prob.model, costs, prob.cluster, cand.par))
        return hit[1]

    def stop() -> bool:
        """Whether a budget ran out (and the result says so)."""
        if len(out.evaluated) >= max_simulations:
            out.stopped = f"after {max_simulations} simulations"
        elif time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            out.stopped = f"after {time_budget_s:g} s"
        else:
            return False
        out.complete = False
        return True

    def simulated(ev: Evaluation) -> None:
        out.evaluated.append(ev)
        if progress is not None:
            out.elapsed_s = time.perf_counter() - t0
            progress(out)

    def push(cands: Iterator[Candidate]) -> None:
        nonlocal seq
        for cand in cands:
            if only is not None and not only(cand):
                continue
            out.enumerated += 1
            try:
                costs = costs_fn(cand) if costs_fn is not None else costs_of(prob, cand)
            except ValueError:
                continue
            if min_memory(prob, cand, costs) > prob.memory_bytes:
                out.memory_pruned += 1
                pruned.append((cand, costs))
                if not cand.par.recompute:
                    push(_savers(prob, cand))
                continue
            seq += 1
            dc = dp_costs_of(cand, costs)
            heapq.heappush(queue, (lower_bound(prob, cand, costs, dc, waits=False), seq, cand, costs, dc, False))

    for par in layouts(prob):
        if time_budget_s is not None and stop():
            break
        push(schedule_candidates(prob, par, plain=True))
    best: list[tuple[float, int, Evaluation]] = []  # max-heap by step (negated): the top fastest that fit
    first = float("inf")  # the fastest that fits
    while queue and out.complete:
        bound, order, cand, costs, dc, full = heapq.heappop(queue)
        if len(best) >= top and bound >= first:  # nothing left can beat the best one
            out.bound_pruned += len(queue) + 1
            break
        if not full:  # the waits need the compiled programs: counted only for candidates that come this far
            try:
                tight = lower_bound(prob, cand, costs, dc)
            except ValueError:
                continue
            if tight > bound:
                heapq.heappush(queue, (tight, order, cand, costs, dc, True))
                continue
        if stop():
            break
        try:
            ev = evaluate(prob, cand, costs, bound, dc)
        except ValueError:
            continue
        simulated(ev)
        if ev.peak_bytes > prob.memory_bytes:
            push(_savers(prob, cand))
            continue
        first = min(first, ev.step_s)
        heapq.heappush(best, (-ev.step_s, id(ev), ev))
        if len(best) > top:
            heapq.heappop(best)
    # step 5: half-layer cuts of the ranked configurations (the analytic costs; a costs_fn prices one split)
    for ev in sorted((e for _, _, e in best), key=lambda e: e.step_s) if costs_fn is None and out.complete else []:
        for cand in half_cuts(prob, ev.cand):
            if only is not None and not only(cand):
                continue
            if stop():
                break
            try:
                costs = costs_of(prob, cand)
                cut = evaluate(prob, cand, costs, lower_bound(prob, cand, costs))
            except ValueError:
                continue
            simulated(cut)
            if cut.peak_bytes <= prob.memory_bytes:
                heapq.heappush(best, (-cut.step_s, id(cut), cut))
                if len(best) > top:
                    heapq.heappop(best)
    out.best = sorted((e for _, _, e in best), key=lambda e: e.step_s)
    # the layouts the cap took away: the few pruned candidates whose bound beats the pick, simulated (shown, not ranked)
    first = out.best[0].step_s if out.best else float("inf")
    bounded = sorted(((b, i) for i, (c, k) in enumerate(pruned) for b in [lower_bound(prob, c, k, dp_costs_of(c, k), waits=False)]
                      if b < first), key=lambda t: t[0])
    for bound, i in bounded[:OVER_CAP_SHOWN]:
        cand, costs = pruned[i]
        try:
            simulated(evaluate(prob, cand, costs, bound, dp_costs_of(cand, costs)))
        except ValueError:
            continue
    out.elapsed_s = time.perf_counter() - t0
    return out


def _savers(prob: Problem, cand: Candidate) -> Iterator[Candidate]:
    """Memory-saving variants of a plain candidate that does not fit: schedule variants, recomputation."""
    from dataclasses import replace

    from braid import schedules

    if cand.par.recompute or schedules.get_schedule(cand.schedule).saves_memory_of is not None:
        return
    for c in schedule_candidates(prob, cand.par, plain=False):
        if schedules.get_schedule(c.schedule).saves_memory_of == cand.schedule and c.lighter == cand.lighter:
            yield c
    # full recomputation: not of 2D-Attention's core, nor of half layers, nor of mixture-of-experts layers
    # (the runtime refuses it there: their all-to-alls end units, braid.models.chunk)
    if cand.par.cp == 1 and cand.lighter is None and not prob.model.experts:
        yield replace(cand, par=replace(cand.par, recompute=True))
