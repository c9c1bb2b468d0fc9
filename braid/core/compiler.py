"""Compile a :class:`~braid.core.ir.Plan` into per-rank :class:`~braid.core.ir.Program`s, and validate them.

Lowering inserts the point-to-point communication a plan implies: for every dependency
that crosses ranks (F(mb, s) needs F(mb, s-1); B(mb, s) needs B(mb, s+1)) a ``Send`` after
the producer on one rank and a matching ``Recv`` before the consumer on the other. A
hand-off between two chunks of the same rank needs none.

**Why the order cannot deadlock.** The compiler list-schedules the plan once with unit
op times (F=B=W=1, BW=2, a braided block the sum of its members), which gives every
compute op a start time. Each send/recv pair becomes one *rendezvous event* whose key is
``(end of the producer, 0, sender, ...)``; each compute op has the key
``(start, 1, rank, index)``. Every rank's program is its events sorted by key. So all
programs are projections of one global total order in which a producer precedes its
send (its end is after its start) and a receive precedes its consumer (the consumer
starts after the producer ends). So the order is safe under blocking (rendezvous)
semantics -- the globally earliest unfinished event always has both sides waiting on it
-- and a fortiori under the executor's semantics, where sends and receives are posted
asynchronously in program order and only the compute that consumes a received tensor
waits for it (NCCL and gloo pair the messages between two ranks in posting order, which
both sides share). The validator checks the result independently: it builds the cross-rank
dependency graph with matched send/recv pairs contracted to one node and proves it is a
DAG with networkx.

**Activation accounting.** Counted in *chunk-activations* (M_a: the saved activations of
one micro-batch on one chunk) at instruction boundaries: an F adds one when it ends, a B
or BW removes one when it ends, a W changes nothing (the small residual W needs is
accounted in bytes by the simulator's cost model), and a braided block applies both
members at its end -- inside an F&B block the forward's activations grow while the
backward's shrink. ``peak`` is the largest count. Under this convention the device-0
peaks of Table 1 hold for ZB-V (2p) and braided_v (3p); Megatron's 1F1B-I gives 3p-1, one
more than the table's 3p-2, because its steady phase runs a forward before the backward
that frees the oldest activation (the table counts the 3p-2 warm-up forwards).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

import networkx as nx

from braid.core.gc_pause import gc_paused
from braid.core.offload import OffloadPolicy, insert_offload

from braid.core.ir import (
    Braided,
    CommKind,
    Compute,
    Instruction,
    Offload,
    OpKind,
    Plan,
    Program,
    Recv,
    Reload,
    Send,
    compute_ops,
)

UNIT_TIME = {OpKind.F: 1, OpKind.B: 1, OpKind.W: 1, OpKind.BW: 2}


class ScheduleError(ValueError):
    """A plan or program that breaks a rule; names the rank, the op and the rule."""

    def __init__(self, rule: str, message: str, rank: int | None = None, index: int | None = None,
                 instr: str | None = None, grid: str | None = None) -> None:
        self.rule, self.rank, self.index, self.instr, self.grid = rule, rank, index, instr, grid
        where = ""
        if rank is not None:
            where = f"rank {rank}"
            if index is not None:
                where += f", op {index}"
            if instr is not None:
                where += f" ({instr})"
            where += ": "
        super().__init__(f"{where}{message} [rule: {rule}]")


# --------------------------------------------------------------------------------------
# Dependencies of compute ops
# --------------------------------------------------------------------------------------
OpId = tuple[OpKind, int, int]  # (kind, mb, stage) -- B and BW share the id (OpKind.B)


def _op_id(op: Compute, plan: Plan, rank: int) -> OpId:
    kind = OpKind.B if op.kind is OpKind.BW else op.kind
    return (kind, op.mb, plan.stage_of(rank, op.chunk))


def _deps(op: Compute, plan: Plan, rank: int) -> list[OpId]:
    """Ops that must finish before ``op`` can start."""
    s = plan.stage_of(rank, op.chunk)
    last = plan.num_stages - 1
    if op.kind is OpKind.F:
        return [(OpKind.F, op.mb, s - 1)] if s > 0 else []
    if op.kind is OpKind.W:
        return [(OpKind.B, op.mb, s)]
    deps = [(OpKind.F, op.mb, s)]
    if s < last:
        deps.append((OpKind.B, op.mb, s + 1))
    return deps


def _check_plan_ops(plan: Plan) -> None:
    """Each (mb, chunk) on each rank: one F and either one BW or one B and one W."""
    p, m, v = plan.p, plan.m, plan.v
    bit = {kind: 1 << i for i, kind in enumerate(OpKind)}
    complete = (bit[OpKind.F] | bit[OpKind.BW], bit[OpKind.F] | bit[OpKind.B] | bit[OpKind.W])
    for rank, ops in enumerate(plan.ranks):
        seen: dict[tuple[OpKind, int, int], int] = {}
        kinds: dict[tuple[int, int], int] = {}  # (mb, chunk) -> bits of the op kinds present
        for idx, instr in enumerate(ops):
            if not isinstance(instr, (Compute, Braided)):
                raise ScheduleError("compute-only", "a plan holds compute instructions only; comm is inserted by the compiler",
                                    rank, idx, str(instr))
            for op in ((instr,) if isinstance(instr, Compute) else instr.ops):
                kind, mb, chunk = op.kind, op.mb, op.chunk
                if not (0 <= mb < m):
                    raise ScheduleError("mb-range", f"micro-batch {mb} outside 0..{m - 1}", rank, idx, str(instr))
                if not (0 <= chunk < v):
                    raise ScheduleError("chunk-range", f"chunk {chunk} outside 0..{v - 1}", rank, idx, str(instr))
                key = (kind, mb, chunk)
                if key in seen:
                    raise ScheduleError("unique-op", f"{op} appears twice (first at op {seen[key]})", rank, idx, str(instr))
                seen[key] = idx
                kinds[(mb, chunk)] = kinds.get((mb, chunk), 0) | bit[kind]
        if not seen and m * v > 0:
            raise ScheduleError("op-counts", f"this rank has no compute ops; each rank runs F and a backward (BW, or B "
                                f"and W) of every (micro-batch, chunk): {m} x {v} here", rank)
        for mb in range(m):
            for chunk in range(v):
                if kinds.get((mb, chunk), 0) in complete:
                    continue
                has = {k for k in OpKind if (k, mb, chunk) in seen}
                if has not in ({OpKind.F, OpKind.BW}, {OpKind.F, OpKind.B, OpKind.W}):
                    if not has:
                        need = "no ops; it needs F and a backward (BW, or B and W)"
                    elif OpKind.F not in has:
                        need = f"{sorted(k.value for k in has)} but no F; it needs F too"
                    elif has == {OpKind.F}:
                        need = "only F; it needs a backward too (BW, or B and W)"
                    else:
                        need = f"{sorted(k.value for k in has)}; it needs F and one backward (BW alone, or B with W)"
                    raise ScheduleError("op-counts", f"(mb {mb}, chunk {chunk}) has {need}", rank)
    if p < 1:
        raise ScheduleError("ranks", "plan has no ranks")


# --------------------------------------------------------------------------------------
# Unit-time list scheduling (gives the global order P2P placement relies on)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Timing:
    start: list[list[int]]  # [rank][index]
    end: list[list[int]]
    op_end: dict[OpId, int]
    op_rank: dict[OpId, tuple[int, int]]  # -> (rank, index)


def _instr_time(instr: Instruction) -> int:
    return sum(UNIT_TIME[op.kind] for op in compute_ops(instr))


def _stage_table(plan: Plan) -> list[list[int]]:
    """``table[rank][chunk]``: the virtual stage (one lookup instead of a placement call per op)."""
    return [[plan.stage_of(rank, chunk) for chunk in range(plan.v)] for rank in range(plan.p)]


def _instr_ids(instr: Instruction, stages: list[int], last: int) -> tuple[tuple[OpId, ...], list[OpId], int]:
    """(own op ids, dependencies in member order, unit time) of one compute instruction on a rank
    whose chunk -> stage map is ``stages`` (:func:`_op_id`, :func:`_deps` and :func:`_instr_time`)."""
    own: list[OpId] = []
    deps: list[OpId] = []
    time = 0
    for op in compute_ops(instr):
        kind, mb = op.kind, op.mb
        s = stages[op.chunk]
        time += UNIT_TIME[kind]
        if kind is OpKind.F:
            own.append((kind, mb, s))
            if s > 0:
                deps.append((kind, mb, s - 1))
        elif kind is OpKind.W:
            own.append((kind, mb, s))
            deps.append((OpKind.B, mb, s))
        else:
            own.append((OpKind.B, mb, s))
            deps.append((OpKind.F, mb, s))
            if s < last:
                deps.append((OpKind.B, mb, s + 1))
    return tuple(own), deps, time


def list_schedule(plan: Plan) -> Timing:
    """Start/end of every compute instruction with unit op times; raises on deadlock."""
    return _schedule(plan)[0]


def _schedule(plan: Plan) -> tuple[Timing, list[list[list[OpId]]]]:
    """:func:`list_schedule`, and the dependencies of every instruction (``[rank][index]``).

    Each rank runs its instructions in order, each as soon as the rank is free and its
    dependencies have ended. A rank that waits for an op is woken when that op ends, so the
    work is linear in the number of instructions. The times do not depend on the order in
    which ranks are advanced, and neither does the set of instructions that can never run.
    """
    p = plan.p
    last = plan.num_stages - 1
    table = _stage_table(plan)
    op_rank: dict[OpId, tuple[int, int]] = {}
    deps: list[list[list[OpId]]] = []
    owns: list[list[tuple[OpId, ...]]] = []
    times: list[list[int]] = []
    for rank, ops in enumerate(plan.ranks):
        rank_deps, rank_own, rank_time = [], [], []
        stages = table[rank]
        for idx, instr in enumerate(ops):
            own, d, time = _instr_ids(instr, stages, last)
            for oid in own:
                op_rank[oid] = (rank, idx)
            if len(own) > 1 and (own[0] in d or own[1] in d):
                raise ScheduleError("braid-independent", "a braided block's members must not depend on each other "
                                    "(their units interleave)", rank, idx, str(instr))
            rank_deps.append(d)
            rank_own.append(own)
            rank_time.append(time)
        deps.append(rank_deps)
        owns.append(rank_own)
        times.append(rank_time)
    for rank, ops in enumerate(plan.ranks):
        for idx, d in enumerate(deps[rank]):
            for dep in d:
                where = op_rank.get(dep)
                if where is None:
                    raise ScheduleError("dependency-exists", f"needs {_fmt_id(dep)}, which no rank runs", rank, idx, str(ops[idx]))
                dr, di = where
                if dr == rank and di > idx:
                    raise ScheduleError("dependency-order", f"needs {_fmt_id(dep)}, which comes later on this rank (op {di})",
                                        rank, idx, str(ops[idx]), grid=format_grid(plan.ranks, (rank, idx)))
    start = [[0] * len(ops) for ops in plan.ranks]
    end = [[0] * len(ops) for ops in plan.ranks]
    op_end: dict[OpId, int] = {}
    ptr = [0] * p
    free = [0] * p
    waiting: dict[OpId, list[int]] = {}  # op id -> ranks whose next instruction waits for it
    ready = list(range(p - 1, -1, -1))  # a stack of ranks to advance
    while ready:
        rank = ready.pop()
        rank_deps, rank_own, rank_time = deps[rank], owns[rank], times[rank]
        rank_start, rank_end = start[rank], end[rank]
        idx, n, t_free = ptr[rank], len(rank_deps), free[rank]
        while idx < n:
            t0 = t_free
            blocked = None
            for d in rank_deps[idx]:
                e = op_end.get(d)
                if e is None:
                    blocked = d
                    break
                if e > t0:
                    t0 = e
            if blocked is not None:
                waiting.setdefault(blocked, []).append(rank)
                break
            t_free = t0 + rank_time[idx]
            rank_start[idx], rank_end[idx] = t0, t_free
            for oid in rank_own[idx]:
                op_end[oid] = t_free
                woken = waiting.pop(oid, None)
                if woken:
                    ready.extend(woken)
            idx += 1
        ptr[rank], free[rank] = idx, t_free
    if any(ptr[r] < len(plan.ranks[r]) for r in range(p)):
        stuck = [(r, ptr[r], str(plan.ranks[r][ptr[r]])) for r in range(p) if ptr[r] < len(plan.ranks[r])]
        desc = "; ".join(f"rank {r} op {i} ({t}) waits for "
                         + ", ".join(_fmt_id(d) for d in deps[r][i] if d not in op_end) for r, i, t in stuck)
        r0, i0, t0 = stuck[0]
        raise ScheduleError("deadlock-free", f"the plan deadlocks: {desc}", r0, i0, t0,
                            grid=format_grid(plan.ranks, (r0, i0)))
    return Timing(start, end, op_end, op_rank), deps


def _fmt_id(op: OpId) -> str:
    kind, mb, stage = op
    return f"{'B/BW' if kind is OpKind.B else kind.value}(mb {mb}, stage {stage})"


# --------------------------------------------------------------------------------------
# Lowering
# --------------------------------------------------------------------------------------
def compile_plan(plan: Plan, *, validate: bool = True) -> list[Program]:
    """Lower a plan to one program per rank with P2P sends/receives; validate by default.

    A plan whose config has the option ``offload_alpha`` also gets OFFLOAD/RELOAD
    instructions (:mod:`braid.core.offload`).
    """
    with gc_paused():  # ~100k small objects at p=32, m=256 (braid.core.gc_pause)
        return _compile(plan, validate)


def _compile(plan: Plan, validate: bool) -> list[Program]:
    _check_plan_ops(plan)
    timing, deps = _schedule(plan)
    op_end = timing.op_end
    holder = [plan.rank_chunk_of(stage) for stage in range(plan.num_stages)]  # stage -> (rank, local chunk)
    f_kind, act, grad = OpKind.F, CommKind.ACT, CommKind.GRAD
    # events[rank] = list of (key, instruction)
    events: list[list[tuple[tuple, Instruction]]] = [[] for _ in range(plan.p)]
    for rank, ops in enumerate(plan.ranks):
        ev, rank_start, rank_deps = events[rank], timing.start[rank], deps[rank]
        for idx, instr in enumerate(ops):
            ev.append(((rank_start[idx], 1, rank, idx), instr))
            for dep in rank_deps[idx]:
                kind, mb, src_stage = dep
                src_rank, src_chunk = holder[src_stage]
                if src_rank == rank:
                    continue  # same-rank hand-off, kept in memory
                # an activation goes to the next stage, a gradient to the previous one (the consumer's, on this rank)
                comm, dst_stage = (act, src_stage + 1) if kind is f_kind else (grad, src_stage - 1)
                key = (op_end[dep], 0, src_rank, rank, comm.value, mb, src_stage)
                events[src_rank].append((key, Send(comm, mb, src_chunk, rank)))
                ev.append((key, Recv(comm, mb, holder[dst_stage][1], src_rank)))
    programs = [Program(rank, tuple(i for _, i in sorted(ev, key=lambda e: e[0]))) for rank, ev in enumerate(events)]
    policy = OffloadPolicy.from_plan(plan)
    if policy is not None:
        programs = insert_offload(programs, policy)
    if validate:
        validate_programs(plan, programs)
    return programs


# --------------------------------------------------------------------------------------
# Validation of compiled programs
# --------------------------------------------------------------------------------------
def validate_programs(plan: Plan, programs: Sequence[Program]) -> None:
    """Check compiled programs against every rule; raise :class:`ScheduleError` on the first break.

    Rules: ``op-counts``/``unique-op`` (each (mb, chunk) one F and one BW or B+W);
    ``braided-independent`` (neither member of a braided block needs the other's result);
    ``dependency-order`` (an op after its same-rank dependencies and after the receive of
    each remote one); ``send-after-producer``; ``send-recv-match`` (every send has exactly
    one matching receive and vice versa, in the same order between each pair of ranks);
    ``deadlock-free`` (the cross-rank graph with matched pairs contracted is acyclic);
    ``offload-order`` (an offload after its F and before the backward frees it, a reload
    after its offload and before the first op that needs it).
    """
    if len(programs) != plan.p:
        raise ScheduleError("ranks", f"{len(programs)} programs for p={plan.p}")
    grid_rows = [prog.instructions for prog in programs]
    compute_plan = Plan(plan.name, plan.config, plan.placement,
                        tuple(tuple(i for i in prog.instructions if isinstance(i, (Compute, Braided))) for prog in programs))
    _check_plan_ops(compute_plan)
    last = plan.num_stages - 1
    sends: dict[tuple[int, int], list[tuple[int, Send]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, Recv]]] = defaultdict(list)
    for prog in programs:
        rank = prog.rank
        done: set[OpId] = set()
        received: set[tuple[CommKind, int, int]] = set()  # (comm, mb, local chunk)
        offloaded: dict[tuple[int, int], int] = {}
        reloaded: set[tuple[int, int]] = set()
        freed: set[tuple[int, int]] = set()

        def fail(rule: str, msg: str, idx: int, instr: Instruction) -> ScheduleError:
            return ScheduleError(rule, msg, rank, idx, str(instr), grid=format_grid(grid_rows, (rank, idx)))

        for idx, instr in enumerate(prog.instructions):
            if isinstance(instr, (Compute, Braided)):
                own = {_op_id(op, plan, rank) for op in compute_ops(instr)}
                if isinstance(instr, Braided):
                    first, second = instr.ops
                    if _op_id(first, plan, rank) in _deps(second, plan, rank) or _op_id(second, plan, rank) in _deps(first, plan, rank):
                        raise fail("braided-independent", "the members of a braided block depend on each other; their units "
                                   "interleave, so neither may need the other's result", idx, instr)
                for op in compute_ops(instr):
                    for dep in _deps(op, plan, rank):
                        if dep in own:
                            continue
                        kind, mb, dstage = dep
                        drank, _ = plan.rank_chunk_of(dstage)
                        if drank == rank:
                            if dep not in done:
                                raise fail("dependency-order", f"{op} runs before {_fmt_id(dep)} on the same rank", idx, instr)
                        else:
                            comm = CommKind.ACT if kind is OpKind.F else CommKind.GRAD
                            if (comm, mb, op.chunk) not in received:
                                what = "input activation" if comm is CommKind.ACT else "output gradient"
                                raise fail("dependency-order", f"{op} runs before its {what} is received", idx, instr)
                    key = (op.mb, op.chunk)
                    if op.kind is not OpKind.F and key in offloaded and key not in reloaded:
                        raise fail("offload-order", f"{op} needs activations offloaded at op {offloaded[key]} "
                                   "but no RELOAD precedes it", idx, instr)
                for op in compute_ops(instr):
                    done.add(_op_id(op, plan, rank))
                    if op.kind in (OpKind.B, OpKind.BW):
                        freed.add(op.key)
            elif isinstance(instr, Send):
                s, peer_stage = plan.comm_stages(rank, instr)
                producer = (OpKind.F if instr.comm is CommKind.ACT else OpKind.B, instr.mb, s)
                if producer not in done:
                    raise fail("send-after-producer", f"sends before {_fmt_id(producer)} has run", idx, instr)
                if not (0 <= peer_stage <= last) or plan.rank_chunk_of(peer_stage)[0] != instr.peer:
                    raise fail("send-recv-match", f"stage {s} does not send {instr.comm.name} to rank {instr.peer}", idx, instr)
                sends[(rank, instr.peer)].append((idx, instr))
            elif isinstance(instr, Recv):
                s, peer_stage = plan.comm_stages(rank, instr)
                if not (0 <= peer_stage <= last) or plan.rank_chunk_of(peer_stage)[0] != instr.peer:
                    raise fail("send-recv-match", f"stage {s} does not receive {instr.comm.name} from rank {instr.peer}", idx, instr)
                received.add((instr.comm, instr.mb, instr.chunk))
                recvs[(instr.peer, rank)].append((idx, instr))
            elif isinstance(instr, Offload):
                key = (instr.mb, instr.chunk)
                if (OpKind.F, instr.mb, plan.stage_of(rank, instr.chunk)) not in done:
                    raise fail("offload-order", "offloads activations its F has not produced yet", idx, instr)
                if key in freed:
                    raise fail("offload-order", "offloads activations that a backward already freed", idx, instr)
                if key in offloaded:
                    raise fail("offload-order", "offloads the same activations twice", idx, instr)
                offloaded[key] = idx
            elif isinstance(instr, Reload):
                key = (instr.mb, instr.chunk)
                if key not in offloaded:
                    raise fail("offload-order", "reloads activations that were never offloaded", idx, instr)
                if key in reloaded:
                    raise fail("offload-order", "reloads the same activations twice", idx, instr)
                reloaded.add(key)
        for key, at in offloaded.items():
            if key not in reloaded:
                raise ScheduleError("offload-order", f"activations of (mb {key[0]}, chunk {key[1]}) offloaded at op {at} "
                                    "are never reloaded", rank, at, str(prog.instructions[at]))
    _check_matching(plan, programs, sends, recvs)
    _check_acyclic(plan, programs)


def _check_matching(plan: Plan, programs: Sequence[Program], sends, recvs) -> None:
    """Every send has exactly one receive with the same message identity, and the messages
    between each pair of ranks are received in the order they are sent (P2P libraries pair
    them in posting order)."""
    rows = [p.instructions for p in programs]
    for pair in sorted(set(sends) | set(recvs)):
        src, dst = pair
        by_msg_s = {}
        for idx, snd in sends.get(pair, []):
            s_stage, peer = plan.comm_stages(src, snd)
            by_msg_s[(snd.comm, snd.mb, s_stage, peer)] = (idx, snd)
        matched = []
        for ridx, rcv in recvs.get(pair, []):
            r_stage, peer = plan.comm_stages(dst, rcv)
            hit = by_msg_s.pop((rcv.comm, rcv.mb, peer, r_stage), None)
            if hit is None:
                raise ScheduleError("send-recv-match", f"no send on rank {src} matches this receive", dst, ridx, str(rcv),
                                    grid=format_grid(rows, (dst, ridx)))
            matched.append((hit[0], ridx, rcv))
        if by_msg_s:
            idx, snd = min(by_msg_s.values(), key=lambda x: x[0])
            raise ScheduleError("send-recv-match", f"no receive on rank {dst} matches this send", src, idx, str(snd),
                                grid=format_grid(rows, (src, idx)))
        matched.sort()
        for (s1, r1, _), (s2, r2, rcv2) in zip(matched, matched[1:]):
            if r2 < r1:
                raise ScheduleError("send-recv-match", f"messages from rank {src} are received in another order than "
                                    "they are sent", dst, r2, str(rcv2), grid=format_grid(rows, (dst, r2)))


def _check_acyclic(plan: Plan, programs: Sequence[Program]) -> None:
    """Program order + rendezvous pairs form a DAG, else some order of ranks can deadlock."""
    g = nx.DiGraph()
    node_of: dict[tuple[int, int], tuple[int, int]] = {}
    pair_count: dict[tuple[int, int], int] = defaultdict(int)
    send_nodes: dict[tuple[int, int, int], tuple[int, int]] = {}
    for prog in programs:
        for idx, instr in enumerate(prog.instructions):
            if isinstance(instr, Send):
                k = pair_count[(prog.rank, instr.peer)]
                pair_count[(prog.rank, instr.peer)] += 1
                send_nodes[(prog.rank, instr.peer, k)] = (prog.rank, idx)
    recv_count: dict[tuple[int, int], int] = defaultdict(int)
    for prog in programs:
        for idx, instr in enumerate(prog.instructions):
            node_of[(prog.rank, idx)] = (prog.rank, idx)
            if isinstance(instr, Recv):
                k = recv_count[(instr.peer, prog.rank)]
                recv_count[(instr.peer, prog.rank)] += 1
                node_of[(prog.rank, idx)] = send_nodes[(instr.peer, prog.rank, k)]  # contract the pair
    for prog in programs:
        prev = None
        for idx in range(len(prog.instructions)):
            node = node_of[(prog.rank, idx)]
            g.add_node(node)
            if prev is not None:
                g.add_edge(prev, node)
            prev = node
    if not nx.is_directed_acyclic_graph(g):
        cycle = nx.find_cycle(g)
        (r, i), _ = cycle[0]
        path = " -> ".join(f"r{a}:{programs[a].instructions[b]}" for (a, b), _ in cycle)
        raise ScheduleError("deadlock-free", f"send/receive order can deadlock; cycle: {path}", r, i,
                            str(programs[r].instructions[i]), grid=format_grid([p.instructions for p in programs], (r, i)))


# --------------------------------------------------------------------------------------
# Accounting and display
# --------------------------------------------------------------------------------------
def activation_counts(instructions: Iterable[Instruction]) -> list[int]:
    """Chunk-activations held after each instruction (see the module docstring).

    Offloaded activations still count: offloading moves bytes, not ownership; the
    simulator's byte accounting shows what offload saves.
    """
    held = 0
    out = []
    for instr in instructions:
        for op in compute_ops(instr):
            held += 1 if op.kind is OpKind.F else -1 if op.kind in (OpKind.B, OpKind.BW) else 0
        out.append(held)
    return out


def peak_activations(instructions: Iterable[Instruction]) -> int:
    """High-water mark of :func:`activation_counts`."""
    return max(activation_counts(instructions), default=0)


def format_grid(rows: Sequence[Sequence[Instruction]], mark: tuple[int, int] | None = None, context: int = 6) -> str:
    """A step x rank grid of instructions; ``mark=(rank, index)`` flags a cell ``<-- ERROR HERE``.

    Only ``context`` steps around the mark are shown for long programs.
    """
    n = max((len(r) for r in rows), default=0)
    lo, hi = 0, n
    if mark is not None and n > 2 * context + 1:
        lo, hi = max(0, mark[1] - context), min(n, mark[1] + context + 1)
    width = max([len(str(i)) for r in rows for i in r[lo:hi]] + [6]) + 2
    lines = ["step  " + "".join(f"rank {r}".ljust(width) for r in range(len(rows)))]
    for step in range(lo, hi):
        cells = []
        flag = ""
        for r, row in enumerate(rows):
            text = str(row[step]) if step < len(row) else ""
            if mark == (r, step):
                text = f">{text}<"
                flag = f"   <-- ERROR HERE (rank {r}, op {step})"
            cells.append(text.ljust(width))
        lines.append(f"{step:<6}" + "".join(cells) + flag)
    return "\n".join(lines)
