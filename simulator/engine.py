"""Discrete-event simulation of compiled per-rank programs on a cost model.

Each rank runs its program in order, like the executor's host thread. Resources per rank:
a compute stream, a TP-communication stream, a P2P engine and two host-copy engines
(device-to-host for ``OFFLOAD``, host-to-device for ``RELOAD``).

* **Compute** instructions run unit by unit in the order of :func:`braid.core.braiding.steps`.
  A task whose ``comm`` is an all-reduce (tp > 1) starts it on the TP stream when it ends (queued
  behind earlier ones), an all-to-all (``UnitCost.a2a_f``/``a2a_b`` > 0: ep > 1) on the EP stream,
  the rank's *all-to-all lane*; the next task of the same op with ``waits`` waits for it -- that
  wait is *exposed TP comm* (*exposed all-to-all*); the instruction ends when all its collectives
  are done (the tail wait is exposed too), except an all-reduce carried into the next compute
  instruction (:func:`braid.core.braiding.carries`): the Send/Recv run in between is posted (a
  chained run as of the all-reduce's end, the rank not waiting), then the next instruction's
  first unit task runs beside it, then the carried all-reduce is waited for. A chained run's
  posts are made at the rank's time with that later time stamp, so with a costly P2P its
  transfers may reserve the P2P engines ahead of earlier ones (free P2P is exact). Compute
  that runs while a collective is in flight on the rank is slowed by ``CostModel.ar_slowdown``
  (an all-reduce) or ``CostModel.a2a_factor`` (an all-to-all; both in flight: the larger), and a
  collective that the next task does not wait for (compute runs beside it) takes
  ``CostModel.ar_stretch`` times longer.
  Under sequence sharding an op's first unit with a gathering head (``UnitCost.ag_f``/``ag_b``)
  waits for its all-gather on the TP stream: started as the instruction starts where
  :func:`braid.core.braiding.early_heads` says so (the unit waits for it as for a pending
  all-reduce), else as the unit starts (all exposed).
  The *host lane*: the rank's host issues unit tasks one after another, ``host_task_s``
  each, never waiting for the device (the executor's host runs ahead of the GPU); a task
  cannot start before the host has issued it, so units shorter than their host time leave
  the device idle. A compute instruction involves no other rank, so it is timed in one pass over a
  precomputed step table, without the heap.
* **P2P** is asynchronous, like the executor's ``isend``/``irecv``: a ``SEND`` or ``RECV``
  is *posted* when the rank reaches it and the rank goes on. A send and its receive
  transfer once both are posted (rendezvous) and both ranks' P2P engines are free, taking
  the sending chunk's ``T_P2P``. Only the compute instruction that consumes a received
  tensor (the F of an activation, the B/BW of a gradient) waits for its transfer; a rank
  ends when its last send has gone. Posts happen in global time order through a
  ``heapq`` keyed on ``(time, seq)``, so runs are deterministic. If the heap empties with
  unfinished ranks, :class:`SimulationError` lists every rank's stuck instruction.
* **Offload/Reload** are asynchronous copies of ``frac`` of the (mb, chunk)'s resident
  activation bytes on the D2H / H2D engine at ``pcie_bytes_per_s``. Contention, kept
  simple: a copy's time is multiplied by ``copy_duplex_slowdown`` when a copy in the other
  direction is in flight at its start, plus 1 when a P2P transfer of the rank is (only with
  ``p2p_over_pcie``). An offload frees its bytes at the first offload, reload or compute
  instruction that finds its copy done, and at the latest when ``RELEASE_AFTER`` compute
  instructions have run after it (:mod:`braid.core.offload`): the next compute instruction
  starts no earlier than the copy's end and the bytes are freed at its start, as the
  runtime does (its host runs ahead of the GPU, so it releases in program order). A reload re-takes them when it is issued (the
  runtime allocates the device storage then, on the compute stream) and its copy starts no
  earlier than its offload's completion; B/W/BW of that (mb, chunk) wait for it.
* **Memory**: an F unit allocates its ``act`` bytes when it completes; a split-B unit
  keeps only ``w_res`` of them, W frees ``w_res``; a full backward (B then W per unit)
  frees all. A unit with workspace (``tmp``, from a GPU profile) holds it while it runs.
"""

from __future__ import annotations

import heapq

from braid.core.braiding import Comm, Phase, carries, early_heads, gather_head, steps
from braid.cost.costs import CostModel
from braid.core.gc_pause import gc_paused
from braid.core.offload import RELEASE_AFTER
from braid.core.ir import (Braided, CommKind, Compute, Instruction, Offload, OpKind, Program, Recv, Reload, Send,
                      comm_stages, rank_chunk_of)
from braid.io.trace import Event
from braid.simulator.rank_state import RankStats, SimulationError, _Rank

__all__ = ["Engine", "RankStats", "SimulationError"]


# One row per unit task: (member, nominal compute s, all-reduce s / all-to-all s (0: none), waits, unit label,
# phase, bytes delta, workspace bytes held while it runs, all-gather s it waits for before it starts (0: none))
_Row = tuple[int, float, float, float, bool, str, str, float, float, float]
# Rows of one instruction shape, bytes kept per member, nominal compute s of the whole instruction, and the
# all-gathers started as the instruction starts: (row, member, s) (braiding.early_heads).
_Table = tuple[tuple[_Row, ...], tuple[float, float], float, tuple[tuple[int, int, float], ...]]


# Enum members bound once: looking them up on the enum class is slow in the per-instruction paths.
_F, _W = OpKind.F, OpKind.W
_ACT, _GRAD = CommKind.ACT, CommKind.GRAD


# What each instruction is, decided once per program (the main loop dispatches on these).
_COMPUTE, _OFFLOAD, _RELOAD, _COMM = 1, 2, 3, 4
_CODES = {Compute: _COMPUTE, Braided: _COMPUTE, Offload: _OFFLOAD, Reload: _RELOAD, Send: _COMM, Recv: _COMM}


def _code(ins: Instruction) -> int:
    """The code of an instruction whose type is not one of :data:`_CODES`' own (a subclass)."""
    if isinstance(ins, (Compute, Braided)):
        return _COMPUTE
    if isinstance(ins, Offload):
        return _OFFLOAD
    if isinstance(ins, Reload):
        return _RELOAD
    if isinstance(ins, (Send, Recv)):
        return _COMM
    raise SimulationError(f"not an instruction: {ins!r}")


def _in_flight(busy: list[tuple[float, float]], t: float) -> bool:
    return any(s <= t < e for s, e in busy[-8:])


class Engine:
    """One simulation run: build with programs and costs, then :meth:`run`."""

    def __init__(self, programs: list[Program], costs: CostModel, *, record: bool = True,
                 tables: dict | None = None) -> None:
        lay = costs.layout
        if len(programs) != lay.p:
            raise SimulationError(f"got {len(programs)} programs for a cost layout of p={lay.p}; build the costs for this schedule's layout")
        self.costs = costs
        self.record = record
        self.events: list[Event] = []
        self.ranks = [_Rank(i, tuple(prog.instructions)) for i, prog in enumerate(programs)]
        for rs in self.ranks:
            rs.codes = [_CODES.get(type(ins)) or _code(ins) for ins in rs.prog]
            rs.copies = _OFFLOAD in rs.codes or _RELOAD in rs.codes
        if lay.tp > 1:
            for rs in self.ranks:
                rs.carries = carries(rs.prog, costs.spec_of(rs.rank))
        # unit rows per (rank, instruction shape, carried): they depend on the costs only, so runs on
        # one CostModel may share them (``tables``, :func:`simulator.fast.run_programs`)
        self._tables: dict[tuple[int, tuple], _Table] = {} if tables is None else tables
        self._posted: dict[tuple, tuple[int, float, int, Instruction]] = {}
        self._routes: dict[tuple, int] = {}
        self._heap: list[tuple[float, int, int]] = []
        self._seq = 0
        self._tp = lay.tp > 1

    # -- step tables ----------------------------------------------------------------
    def _table(self, rank: int, instr: Compute | Braided, carried: bool = False) -> _Table:
        """Unit rows of an instruction shape (its mb numbers do not matter), cached, with the
        per-member memory totals and the nominal compute time of the whole instruction.
        ``carried``: its last all-reduce runs beside the next instruction's first unit task."""
        shape_key = (rank, _shape(instr), carried)
        hit = self._tables.get(shape_key)
        if hit is not None:
            return hit
        for op in ([instr] if isinstance(instr, Compute) else instr.ops):
            if (rank, op.chunk) not in self.costs.chunks:
                raise SimulationError(f"rank {rank}: {instr} uses chunk {op.chunk}, but the layout has v={self.costs.layout.v}")
        spec_of = self.costs.spec_of(rank)
        rows: list[_Row] = []
        totals = [0.0, 0.0]
        nominal = 0.0  # summed in row order, as the unit loop would
        tasks = list(steps(instr, spec_of))
        stretch = self.costs.ar_stretch
        pairs = [(st.member, st.task) for st in tasks]
        early = early_heads(pairs) if self._tp else ()
        starts = []
        firsts = {member: next(k for k, (m, _) in enumerate(pairs) if m == member) for member in {m for m, _ in pairs}}
        for k, st in enumerate(tasks):
            u = self.costs.chunks[(rank, st.op.chunk)].units[st.task.unit]
            ph = st.task.phase
            if ph is Phase.F:
                dur, ar, a2a, dmem = u.f, u.ar_f, u.a2a_f, u.act
            elif ph is Phase.B:
                dur, ar, a2a, dmem = u.b, u.ar_b, u.a2a_b, u.w_res - u.act
            else:
                dur, ar, a2a, dmem = u.w, 0.0, 0.0, -u.w_res
            ar = ar if (self._tp and st.task.comm is Comm.AR) else 0.0
            a2a = a2a if st.task.comm is Comm.A2A else 0.0  # 0 unless ep > 1 (braid.cost.moe_costs)
            if (ar or a2a) and k + 1 < len(tasks):  # compute runs beside it unless the next task waits for it
                nxt = tasks[k + 1]
                if not (nxt.task.waits and nxt.member == st.member):
                    ar, a2a = ar * stretch, a2a * stretch
            elif ar and carried:  # the next instruction's first task runs beside it
                ar *= stretch
            label = (f"L{st.task.layer}." if st.task.layer >= 0 else "") + st.task.unit.value
            # sequence sharding: an op's first unit with a gathering head gathers first (0 without)
            ag = (u.ag_f if ph is Phase.F else u.ag_b) if self._tp and firsts[st.member] == k and gather_head(st.task) else 0.0
            if ag and k in early:  # started as the instruction starts, beside the leader's first segment
                starts.append((k, st.member, ag * stretch))
                ag = 0.0
            rows.append((st.member, dur, ar, a2a, st.task.waits, label, ph.value, dmem, u.tmp, ag))
            totals[st.member] += dmem
            nominal += dur
        out = (tuple(rows), (totals[0], totals[1]), nominal, tuple(starts))
        self._tables[shape_key] = out
        return out

    # -- compute -------------------------------------------------------------------------
    def _inputs_ready(self, rs: _Rank, instr: Compute | Braided) -> float | None:
        """When the received inputs of ``instr`` are all here; None (and ``blocked_on`` set) if one has not been sent yet."""
        ops = (instr,) if isinstance(instr, Compute) else instr.ops
        ready = 0.0
        for op in ops:
            kind = op.kind
            if kind is _W:
                continue
            key = (_ACT if kind is _F else _GRAD, op.mb, op.chunk)
            if key not in rs.expected:
                continue  # first stage, last stage, or a same-rank hand-off
            arrived = rs.arrived.get(key)
            if arrived is None:
                rs.blocked_on = key
                return None
            if arrived > ready:
                ready = arrived
        for op in ops:
            key = (_ACT if op.kind is _F else _GRAD, op.mb, op.chunk)
            if key in rs.arrived:
                rs.expected.discard(key)
                del rs.arrived[key]
        return ready

    def _compute(self, rs: _Rank, instr: Compute | Braided, idx: int) -> None:
        """Run a compute instruction (the rest of it, if its first unit task was hoisted)."""
        carry = rs.carries.get(idx) if self._tp else None
        rows, totals, nominal, starts = self._table(rs.rank, instr, carry is not None)
        resumed = rs.resume.pop(idx, None) if rs.resume else None
        if resumed is None:
            t0 = self._compute_start(rs, instr, idx) if rs.copies else rs.t
            state = (t0, t0, t0, [0.0, 0.0], [False, False], None)
            first = 0
        else:  # the inputs of its other member may have arrived after the hoisted task
            state, first = (max(rs.t, resumed[0]),) + resumed[1:], 1
            nominal -= rows[0][1]  # counted when the hoisted task ran
        if starts:  # sequence sharding: gathers started before the (rest of the) instruction's units
            state = self._gathers(rs, instr, idx, rows, starts, state)
        t, tp_free, ep_free, pend, lanes, ar_start = self._rows(rs, instr, idx, rows, first, len(rows), state)
        if ep_free > t:  # (no op ends on an all-to-all: each is waited for inside its instruction)
            rs.stats.a2a_exposed_s, t = rs.stats.a2a_exposed_s + ep_free - t, ep_free
        if carry is not None and rows[-1][2] > 0.0:
            # The last all-reduce stays in flight into the next instruction; the earlier ones
            # (queued before it on the TP stream) are done when it starts.
            if ar_start > t:
                rs.stats.tp_exposed_s += ar_start - t
                t = ar_start
            rs.hoist = (carry.into, tp_free)
            if carry.chained:  # the run between posts when the all-reduce ends; the rank goes on
                rs.chained = tp_free
        elif tp_free > t:
            rs.stats.tp_exposed_s += tp_free - t
            t = tp_free
        if rs.copies:  # the bytes an OFFLOAD moves
            for op, tot in zip((instr,) if isinstance(instr, Compute) else instr.ops, totals):
                rs.resident[op.key] = rs.resident.get(op.key, 0.0) + tot
        rs.stats.nominal_compute_s += nominal
        rs.t = t
        if idx in rs.watch:
            rs.watch[idx] = t

    def _compute_start(self, rs: _Rank, instr: Compute | Braided, idx: int) -> float:
        """When a compute instruction may start: reloads landed, due offloads released."""
        t0 = rs.t
        for op in ((instr,) if isinstance(instr, Compute) else instr.ops):
            if op.kind is _F:
                continue
            if op.key in rs.offloaded:
                raise SimulationError(f"rank {rs.rank}: op {idx} ({instr}) needs the activations of mb {op.mb} chunk {op.chunk}, "
                                      f"offloaded with no RELOAD{op.mb}c{op.chunk} before it")
            t0 = max(t0, rs.reload_end.get(op.key, 0.0))
        if rs.releasing:
            t0 = self._release(rs, t0)
        return t0

    def _hoisted(self, rs: _Rank) -> bool:
        """Run the first unit task of the next compute instruction beside a carried all-reduce, then
        wait for that all-reduce (:func:`braid.core.braiding.carries`); the Send/Recv run between is
        already posted. False if the task's input has not arrived."""
        j, carry_end = rs.hoist
        instr = rs.prog[j]
        rows, _, _, _ = self._table(rs.rank, instr, j in rs.carries)
        op = instr if isinstance(instr, Compute) else instr.ops[rows[0][0]]
        if op.kind is not _W:
            key = (_ACT if op.kind is _F else _GRAD, op.mb, op.chunk)
            if key in rs.expected:
                arrived = rs.arrived.get(key)
                if arrived is None:
                    rs.blocked_on = key
                    return False
                rs.expected.discard(key)
                del rs.arrived[key]
                rs.t = max(rs.t, arrived)
        rs.hoist = None
        t0 = self._compute_start(rs, instr, j) if rs.copies else rs.t
        state = (t0, max(t0, carry_end), t0, [0.0, 0.0], [False, False], None)
        t, tp_free, ep_free, pend, lanes, ar_start = self._rows(rs, instr, j, rows, 0, 1, state)
        rs.stats.nominal_compute_s += rows[0][1]
        if carry_end > t:  # the carried all-reduce must be done before the instruction goes on
            rs.stats.tp_exposed_s += carry_end - t
            t = carry_end
        rs.resume[j] = (t, tp_free, ep_free, pend, lanes, ar_start)
        rs.t = t
        return True

    def _gathers(self, rs: _Rank, instr: Compute | Braided, idx: int, rows, starts, state):
        """Start the all-gathers of ``starts`` at the state's time, on the TP stream, each the pending
        collective of its member (:func:`braid.core.braiding.early_heads`); returns the new state."""
        t, tp_free, ep_free, pend, lanes, s = state
        for k, member, ag in starts:
            g0 = t if t > tp_free else tp_free
            tp_free = pend[member] = g0 + ag
            lanes[member] = False
            if self.record:
                op = instr if isinstance(instr, Compute) else instr.ops[member]
                self.events.append(Event(rs.rank, "tp-comm", str(op), "AG", g0, ag, op.mb, op.chunk, rows[k][5],
                                         str(instr) if isinstance(instr, Braided) else None, idx))
        return t, tp_free, ep_free, pend, lanes, s

    def _rows(self, rs: _Rank, instr: Compute | Braided, idx: int, rows, first: int, stop: int, state):
        """Time unit rows ``first:stop`` from ``state`` = (t, TP and EP streams free, pending collective end
        and whether it is an all-to-all per member, last all-reduce start); returns the new state."""
        t, tp_free, ep_free, pend, lanes, s = state
        f, fa = self.costs.ar_slowdown, self.costs.a2a_factor
        rank = rs.rank
        mem_t, mem_d = rs.mem_t.append, rs.mem_d.append
        who = block = None
        if self.record:  # event fields that depend on the member, not the unit: (name, mb, chunk)
            who = [(str(op), op.mb, op.chunk) for op in ((instr,) if isinstance(instr, Compute) else instr.ops)]
            block = str(instr) if isinstance(instr, Braided) else None
        ev = self.events.append
        busy = exposed = exposed_a2a = 0.0
        host, host_s = rs.host, self.costs.host_task_s
        # The hot loop of the simulator, one pass per unit task: locals only.
        for member, dur, ar, a2a, waits, label, phase, dmem, tmp, ag in (rows if first == 0 and stop == len(rows) else rows[first:stop]):
            if host_s:
                host += host_s  # the host issues this task
                if host > t:
                    t = host
            if waits and pend[member] > t:
                exposed_a2a, exposed = (exposed_a2a + pend[member] - t, exposed) if lanes[member] else (
                    exposed_a2a, exposed + pend[member] - t)
                t = pend[member]
            if ag:  # its head's all-gather, blocking (behind the TP stream's queue): exposed
                g0 = t if t > tp_free else tp_free
                tp_free = g0 + ag
                exposed += tp_free - t
                if who is not None:
                    ev(Event(rank, "tp-comm", who[member][0], "AG", g0, ag, who[member][1], who[member][2], label, block, idx))
                t = tp_free
            if tp_free > t or ep_free > t:  # a collective is in flight: slowed down while it lasts
                k = f if tp_free > t else 1.0
                if ep_free > t and fa > k:
                    k = fa
                win = (tp_free if tp_free > ep_free else ep_free) - t
                d = dur * k if win >= dur * k else win + (dur - win / k)
            else:
                d = dur
            end = t + d
            busy += d
            if who is not None:
                name, mb, chunk = who[member]
                ev(Event(rank, "compute", name, phase, t, d, mb, chunk, label, block, idx))
            if tmp:  # workspace: taken while the unit runs
                mem_t(t)
                mem_d(tmp)
                mem_t(end)
                mem_d(dmem - tmp)
            elif dmem:
                mem_t(end)
                mem_d(dmem)
            if ar > 0.0:
                s = end if end > tp_free else tp_free
                tp_free = s + ar
                pend[member], lanes[member] = tp_free, False
                if who is not None:
                    ev(Event(rank, "tp-comm", name, "AR", s, ar, mb, chunk, label, block, idx))
            elif a2a > 0.0:
                s2 = end if end > ep_free else ep_free
                ep_free = s2 + a2a
                pend[member], lanes[member] = ep_free, True
                if who is not None:
                    ev(Event(rank, "ep-comm", name, "A2A", s2, a2a, mb, chunk, label, block, idx))
            t = end
        rs.host = host
        st = rs.stats
        st.compute_s += busy
        st.tp_exposed_s += exposed
        st.a2a_exposed_s += exposed_a2a
        return t, tp_free, ep_free, pend, lanes, s

    # -- host copies ---------------------------------------------------------------------
    def _copy_time(self, rs: _Rank, nbytes: float, start: float, other: list[tuple[float, float]]) -> float:
        k = (1 + (self.costs.copy_duplex_slowdown - 1) * _in_flight(other, start)
             + (self.costs.p2p_over_pcie and _in_flight(rs.p2p_busy, start)))
        return nbytes / self.costs.pcie_bytes_per_s * k

    def _offload(self, rs: _Rank, ins: Offload, idx: int) -> None:
        key = (ins.mb, ins.chunk)
        nbytes = ins.frac * rs.resident.get(key, 0.0)
        start = max(rs.t, rs.d2h_free)
        end = start + self._copy_time(rs, nbytes, start, rs.h2d_busy)
        rs.d2h_free = end
        rs.d2h_busy.append((start, end))
        rs.offloaded[key] = (nbytes, end)
        rs.resident[key] = rs.resident.get(key, 0.0) - nbytes
        rs.releasing.append([RELEASE_AFTER, end, nbytes])
        self._poll(rs)
        if self.record:
            self.events.append(Event(rs.rank, "copy", str(ins), "OFFLOAD", start, end - start, ins.mb, ins.chunk, None, None, idx))

    def _poll(self, rs: _Rank) -> None:
        """At an offload or reload: free the offloads whose copy has ended (the runtime polls there too)."""
        done = [item for item in rs.releasing if item[1] <= rs.t]
        if done:
            rs.releasing = [item for item in rs.releasing if item[1] > rs.t]
            for item in done:
                rs.mem_t.append(rs.t)
                rs.mem_d.append(-item[2])

    def _release(self, rs: _Rank, t0: float) -> float:
        """Before a compute instruction at ``t0``: free the offloads that are done or due; when it may start."""
        keep = []
        for item in rs.releasing:
            item[0] -= 1
            if item[1] <= t0 or item[0] < 0:
                t0 = max(t0, item[1])
                rs.mem_t.append(t0)
                rs.mem_d.append(-item[2])
            else:
                keep.append(item)
        rs.releasing = keep
        return t0

    def _reload(self, rs: _Rank, ins: Reload, idx: int) -> None:
        key = (ins.mb, ins.chunk)
        if key not in rs.offloaded:
            raise SimulationError(f"rank {rs.rank}: op {idx} ({ins}) reloads mb {ins.mb} chunk {ins.chunk}, which no earlier OFFLOAD moved out")
        self._poll(rs)
        nbytes, off_end = rs.offloaded.pop(key)
        start = max(rs.t, rs.h2d_free, off_end)
        end = start + self._copy_time(rs, nbytes, start, rs.d2h_busy)
        rs.h2d_free = end
        rs.h2d_busy.append((start, end))
        rs.reload_end[key] = end
        rs.resident[key] = rs.resident.get(key, 0.0) + nbytes
        rs.mem_t.append(rs.t)  # the runtime allocates the device storage when it issues the reload
        rs.mem_d.append(nbytes)
        if self.record:
            self.events.append(Event(rs.rank, "copy", str(ins), "RELOAD", start, end - start, ins.mb, ins.chunk, None, None, idx))

    # -- P2P -----------------------------------------------------------------------------
    def _route(self, rank: int, ins: Send | Recv, idx: int) -> tuple[tuple, bool]:
        """Rendezvous key (comm, mb, boundary stage) of a transfer and whether it is the send side.

        The boundary depends on the rank, side, comm kind, chunk and peer only: it is checked
        once per such combination and cached (a bad one raises, so it is never cached)."""
        is_send = isinstance(ins, Send)
        route = (rank, is_send, ins.comm, ins.chunk, ins.peer)
        boundary = self._routes.get(route)
        if boundary is None:
            boundary = self._routes[route] = self._boundary(rank, ins, idx)
        return (ins.comm, ins.mb, boundary), is_send

    def _boundary(self, rank: int, ins: Send | Recv, idx: int) -> int:
        """The lower stage of the boundary ``ins`` crosses; :class:`SimulationError` if its route is wrong."""
        lay = self.costs.layout
        if ins.chunk >= lay.v:
            raise SimulationError(f"rank {rank}: op {idx} ({ins}) names chunk {ins.chunk}, but the layout has v={lay.v}")
        s, other = comm_stages(lay.placement, lay.p, rank, ins)
        if not 0 <= other < lay.num_stages:
            raise SimulationError(f"rank {rank}: op {idx} ({ins}) crosses the pipeline's end (stage {s} has no stage {other})")
        peer = rank_chunk_of(lay.placement, lay.p, other)[0]
        if peer != ins.peer or peer == rank:
            raise SimulationError(f"rank {rank}: op {idx} ({ins}) names peer {ins.peer}, but stage {other} is on rank {peer}")
        return min(s, other)

    def _post(self, rs: _Rank, idx: int, ins: Send | Recv, at: float) -> None:
        """Post ``ins`` as of time ``at`` (``rs.t``, or later for a run chained to an all-reduce)."""
        is_send = isinstance(ins, Send)
        comm = ins.comm
        boundary = self._routes.get((rs.rank, is_send, comm, ins.chunk, ins.peer))  # _route, inlined
        if boundary is None:
            boundary = self._route(rs.rank, ins, idx)[0][2]
        side_key = (comm, ins.mb, boundary, is_send)
        posted = self._posted
        if side_key in posted:
            raise SimulationError(f"rank {rs.rank}: op {idx} ({ins}) is posted twice")
        if not is_send:
            rs.expected.add((comm, ins.mb, ins.chunk))
        other = posted.pop((comm, ins.mb, boundary, not is_send), None)
        if other is None:
            posted[side_key] = (rs.rank, at, idx, ins)
            return
        o_rank, o_t, o_idx, o_ins = other
        ro = self.ranks[o_rank]
        snd, s_idx, s_ins, rcv, r_idx, r_ins = (rs, idx, ins, ro, o_idx, o_ins) if is_send else (ro, o_idx, o_ins, rs, idx, ins)
        dur = self.costs.chunks[(snd.rank, s_ins.chunk)].p2p
        start = max(at, o_t, snd.p2p_free, rcv.p2p_free)
        end = start + dur
        if dur > 0:
            for r in (snd, rcv):
                r.p2p_free = end
                r.p2p_busy.append((start, end))
        if self.record:
            self.events.append(Event(snd.rank, "p2p", str(s_ins), "SEND", start, dur, s_ins.mb, s_ins.chunk, None, None, s_idx, rcv.rank))
            self.events.append(Event(rcv.rank, "p2p", str(r_ins), "RECV", start, dur, r_ins.mb, r_ins.chunk, None, None, r_idx, snd.rank))
        if end > snd.sends_end:
            snd.sends_end = end
        rkey = (r_ins.comm, r_ins.mb, r_ins.chunk)
        rcv.arrived[rkey] = end
        if rcv.blocked_on == rkey and rcv is not rs:
            rcv.blocked_on = None
            self._push(rcv)

    def _push(self, rs: _Rank) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (rs.t, self._seq, rs.rank))

    # -- main loop -----------------------------------------------------------------------
    def _advance(self, rs: _Rank) -> None:
        """Run a rank until it finishes, parks to post comm in time order, or waits for a receive."""
        prog, codes, n = rs.prog, rs.codes, len(rs.prog)
        pc = rs.pc
        while pc < n:
            if rs.hoist is not None and pc == rs.hoist[0] and not self._hoisted(rs):
                rs.pc = pc
                return  # woken by the matching send's post
            code = codes[pc]
            if code == _COMPUTE:
                ins = prog[pc]
                ready = self._inputs_ready(rs, ins)
                if ready is None:
                    rs.pc = pc
                    return  # woken by the matching send's post
                if ready > rs.t:
                    rs.t = ready
                self._compute(rs, ins, pc)
            elif code == _OFFLOAD:
                self._offload(rs, prog[pc], pc)
            elif code == _RELOAD:
                self._reload(rs, prog[pc], pc)
            elif not rs.posting:
                rs.posting = True  # park until the heap reaches this time, so posts happen in time order
                rs.pc = pc
                self._push(rs)
                return
            else:
                rs.posting = False
                at = rs.t if rs.chained is None else rs.chained
                rs.chained = None
                while pc < n and codes[pc] == _COMM:
                    self._post(rs, pc, prog[pc], at)
                    pc += 1
                continue
            pc += 1
        rs.pc = pc
        for _, end, nbytes in rs.releasing:  # the step's end waits for the copy streams
            rs.mem_t.append(end)
            rs.mem_d.append(-nbytes)
        rs.releasing.clear()
        rs.stats.end_s = max(rs.t, rs.sends_end)

    def run(self) -> list[RankStats]:
        """Simulate every rank to its end; :class:`SimulationError` on deadlock or bad programs."""
        with gc_paused():
            self._run()
        for rs in self.ranks:
            # Paired here, with the collector on: young tuples of floats it stops tracking at
            # its next cheap pass, instead of ~400k tracked ones promoted with the events.
            rs.stats.mem = list(zip(rs.mem_t, rs.mem_d))
        unmatched = {rank for rank, _, _, _ in self._posted.values()}
        stuck = [rs for rs in self.ranks if rs.pc < len(rs.prog) or rs.rank in unmatched]
        if stuck:
            raise SimulationError("deadlock: no rank can proceed\n" + "\n".join(self._stuck_line(rs) for rs in stuck))
        for rs in self.ranks:
            end_busy = max([e for _, e in rs.d2h_busy[-1:] + rs.h2d_busy[-1:]], default=0.0)
            rs.stats.end_s = max(rs.stats.end_s, end_busy, rs.sends_end)
        return [rs.stats for rs in self.ranks]

    def _run(self) -> None:
        for rs in self.ranks:
            self._push(rs)
        while self._heap:
            _, _, r = heapq.heappop(self._heap)
            self._advance(self.ranks[r])

    def _stuck_line(self, rs: _Rank) -> str:
        lines = []
        if rs.pc < len(rs.prog):
            line = f"  rank {rs.rank}: stuck at op {rs.pc} ({rs.prog[rs.pc]})"
            if rs.blocked_on is not None:
                comm, mb, chunk = rs.blocked_on
                line += f", waiting to receive {'the activation' if comm is CommKind.ACT else 'the gradient'} of mb {mb} chunk {chunk}"
            lines.append(line)
        waiting = [(idx, ins) for (rank, _, idx, ins) in self._posted.values() if rank == rs.rank]
        lines += [f"  rank {rs.rank}: op {idx} ({ins}) is never matched: its peer rank {ins.peer} never posts the "
                  f"{'RECV' if isinstance(ins, Send) else 'SEND'}" for idx, ins in sorted(waiting, key=lambda x: x[0])]
        return "\n".join(lines)


def _shape(instr: Compute | Braided) -> tuple:
    if isinstance(instr, Compute):
        return (instr.kind, instr.chunk)
    return (instr.first.kind, instr.first.chunk, instr.second.kind, instr.second.chunk, instr.lead)
