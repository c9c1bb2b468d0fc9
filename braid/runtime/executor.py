"""The per-rank interpreter: runs a compiled :class:`braid.core.ir.Program` on torch.distributed.

One dispatch loop over the rank's instructions ("schedule as data, executor as one
loop"). Compute instructions -- F, B, W, BW and braided blocks -- run at unit granularity
in the order :func:`braid.core.braiding.steps` gives (the braid pattern is defined there, once).
A unit task with a ``comm`` starts it asynchronously as it ends: a TP all-reduce of its output
(``dist.all_reduce(..., async_op=True)``: NCCL runs it on its own stream ordered by
events, gloo on its worker thread; under sequence sharding a reduce-scatter over the
sequence, :mod:`braid.tp.seq_shard`), or expert parallelism's all-to-all the unit returns
(:class:`braid.models.moe_dispatch.Exchange`, the same way, on lane ``ep-comm``); the next F/B
task of the same op waits for it, and an
instruction's collectives are all complete when it ends (paper Sec. 3, Fig. 3) -- except a
trailing one that :func:`braid.core.braiding.carries` carries into the next compute instruction,
whose first unit task then runs beside it, as the simulator models. When the Send/Recv run
between the two sends the carried forward's output, the run is posted as the all-reduce
ends: on CUDA from a side stream that waits for it (the host goes on to the unit at once);
on CPU after the unit, or before it when the unit reads a tensor of that run.

P2P is asynchronous, as the simulator models it: consecutive Send/Recv instructions go out
as one ``batch_isend_irecv`` (see :mod:`braid.runtime.p2p`) without waiting; a received
tensor is waited for only by the compute instruction that consumes it (with the rest of its
batch); a sent tensor is let go once its batch was waited, or (NCCL, eager) before the first compute instruction
that finds it complete, the rest at the end of the program. The compiler's order (the same on both sides of
every pair of ranks) makes this deadlock-free. Hand-offs between two chunks of the same rank (V-shape turn)
stay in memory. After the program the caller reduces gradients over data/context
parallel ranks (:func:`braid.runtime.distributed.reduce_gradients`) and steps its
optimizer. The executor records a measured :class:`braid.io.trace.Trace` in the simulator's
format: unit compute events, all-reduces on lane ``tp-comm``, P2P events and a memory
series (``torch.cuda.memory_allocated`` on GPU, live saved-activation bytes on CPU).

Recording costs host time on every unit task (two clock marks -- CUDA events on GPU --
and one event tuple). Where nothing needs the unit cuts (tp=1, ep=1, no
sequence parallelism, no Offload/Reload in the program) the chunks run fused
(:meth:`braid.models.chunk.ModelChunk.choose_fused`): one backward engine call per op, a
``BW`` op's weight gradients computed inside it (:meth:`~braid.models.chunk.ModelChunk.set_joint`),
and, unless single units are timed, one chunk call per op
(:meth:`~braid.models.chunk.ModelChunk.run_op`). ``record`` picks how
much is measured: ``"units"`` (every unit task and all-reduce, the full trace),
``"instructions"`` (one clock pair per compute instruction, P2P/copy events and the memory
series, no per-unit or all-reduce events) or ``"off"`` (no clock, no events, no memory
series; counts only). The unit step lists of :func:`braid.core.braiding.steps` are computed once
per instruction shape and bound to each instruction once per executor. None of this changes
what is computed: only what is timed.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from braid.core.braiding import Carry, ChunkSpec, Comm, UnitTask, carries, early_heads, next_of_op, steps as braid_steps
from braid.core.ir import (Braided, CommKind, Compute, Instruction, Offload, OpKind, Plan, Program, Recv, Reload, Send,
                           compute_ops)
from braid.io.trace import Trace
from braid.models.chunk import ModelChunk
from braid.models.chunk_parts import ChunkStateError
from braid.models.seq_shard_ops import gather_through
from braid.runtime import compiled
from braid.runtime.distributed import Abort, ProcessGroups
from braid.runtime.follow import Follower
from braid.runtime.offload import ActivationOffloader, OffloadStateError
from braid.runtime.p2p import Staging, Transfer, issue
from braid.runtime.results import ExecutionError, Record, StepResult, _Clock, check_record, measured_trace
from braid.tp.autograd_calls import on_this_thread
from braid.tp.comm import TPComm
from braid.tp.layers import StashError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    work: dist.Work
    start: Any
    op: Compute
    unit: str
    block: str | None
    index: int
    comm: Comm = Comm.AR
    kind: str = ""  # the trace's event kind, if not the collective's (an all-gather run ahead: "AG")


@dataclass(slots=True)
class _Held:
    """A carried all-reduce between two compute instructions, and the chained Send/Recv run
    (start index, instructions) to post when it ends."""

    carry: Carry
    pending: _Pending
    run: tuple[int, Sequence[Instruction]] | None = None


# One step of a compute instruction, bound once per executor: member, op, the chunk call and
# its argument (``run`` and a unit task, or ``run_op`` and the op kind), waits for the op's
# collective, the collective it starts (None: none), op text, phase text, unit text (None for a whole op), and the op's
# next unit task after a step that starts a reduction (None otherwise): its head may follow it.
_Bound = tuple[int, Compute, Callable[[int, Any], Any], Any, bool, Comm | None, str, str, str | None, UnitTask | None]
_LANE = {Comm.AR: ("tp-comm", "AR"), Comm.A2A: ("ep-comm", "A2A")}  # trace lane and event kind of each collective


def _range(name: Callable[[], str]) -> Any:
    """A profiler range named after braid's instruction, block, unit or transfer (``name()``), so
    that a torch.profiler or nsys (``emit_nvtx``) timeline reads like braid's; nothing while none records."""
    return torch.profiler.record_function(name()) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


class Executor:
    """Runs one rank's program over its local model chunks.

    ``act_shape``: shape of the activation/gradient travelling between stages
    (micro-batch size, *local* sequence -- ``seq/d_sp`` under sequence parallelism --,
    hidden); ``tp_group=None`` means tp=1. ``sp_group``: the sequence-parallel group, over
    which the last stage sums its ranks' loss shares (``None``: no sequence parallelism).
    ``record``: what the trace of each step holds by default (``"units"``,
    ``"instructions"`` or ``"off"``, see the module docstring); :meth:`run` can override it
    per step, e.g. to trace only the last step of a training run. ``compile``: run the units'
    element-wise functions under ``torch.compile`` (:mod:`braid.runtime.compiled`; it switches
    the given chunks' modules); ``None`` means on for CUDA with Triton, off on CPU.
    """

    def __init__(
        self,
        plan: Plan,
        program: Program,
        chunks: dict[int, ModelChunk],
        *,
        pp_ranks: Sequence[int],
        act_shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp_group: dist.ProcessGroup | None = None,
        abort: Abort | None = None,
        sp_group: dist.ProcessGroup | None = None,
        record: Record = "units",
        tp_comm: TPComm | None = None,
        compile: bool | None = None,
    ) -> None:
        if set(chunks) != set(range(plan.v)):
            raise ValueError(f"rank {program.rank}: chunks {sorted(chunks)} for v={plan.v}")
        self.plan, self.program, self.chunks = plan, program, chunks
        self.rank = program.rank
        self.pp_ranks = list(pp_ranks)
        self.act_shape, self.dtype, self.device = tuple(act_shape), dtype, torch.device(device)
        self.tp_group = tp_group
        # How the TP all-reduces run (braid.tp.comm); a plain async all-reduce by default.
        self.tp_comm = tp_comm if tp_comm is not None else TPComm("gloo", tp_group)
        gather_through(chunks, self.tp_comm)  # sequence sharding's all-gathers through the backend of its reduce-scatters
        self.sp_group = sp_group
        self.abort = abort
        # One per rank and executor: its pinned host buffers are reused by every step.
        self.offloader = ActivationOffloader(self.device)
        self.record = check_record(record)
        self.compiled = compiled.resolve(compile, self.device)
        compiled.set_compiled(chunks.values(), self.compiled)
        # Fused chunks (ModelChunk.choose_fused) where nothing needs the unit cuts: the chunk
        # knows its TP and SP; only the program knows whether it offloads.
        offloads = any(isinstance(ins, (Offload, Reload)) for ins in program.instructions)
        cut = "the program offloads activations" if offloads else None
        self.fused = {c: ch.choose_fused(cut) for c, ch in chunks.items()}
        # A BW op's micro-batches (set_joint, again every step: chunks may be shared with another program's
        # executor): a fused chunk runs their backward as one loss.backward()-like call, a sequence-sharded one
        # stashes their row-parallel output gradients whole (no W split off to gather them in).
        self._joint = {c: frozenset(op.mb for ins in program.instructions for op in compute_ops(ins)
                                    if op.kind is OpKind.BW and op.chunk == c) for c in chunks}
        self._by_shape: dict[tuple, tuple[tuple[int, UnitTask], ...]] = {}
        self._bound: dict[tuple[int, bool], tuple[tuple[_Bound, ...], dict[str, int]]] = {}
        # Where an all-reduce stays in flight beside the next compute instruction's first unit task.
        self._carries = carries(program.instructions, self._spec) if tp_group is not None else {}
        self._side: Any = None  # CUDA stream that posts a chained Send/Recv run (created on first use)
        self._follow = Follower(self.device, self._wait)  # sequence sharding's unit heads after their reduce-scatter
        self.capturing = False  # a CUDA graph captures run() (braid.runtime.graphs): no host sync in the step
        self.staging, self.stage_p2p = Staging(), None  # P2P through kept buffers (braid.runtime.p2p); None: while capturing

    @staticmethod
    def from_groups(plan: Plan, program: Program, chunks: dict[int, ModelChunk], groups: ProcessGroups, abort: Abort, **kw: Any) -> "Executor":
        tp = groups.tp if groups.topo.tp > 1 else None
        sp = groups.cp if groups.topo.cp > 1 else None
        kw.setdefault("tp_comm", groups.tp_comm)
        return Executor(plan, program, chunks, pp_ranks=groups.pp_ranks, tp_group=tp, sp_group=sp, abort=abort, **kw)

    # -- helpers -------------------------------------------------------------------------
    def _spec(self, chunk: int) -> ChunkSpec:
        return self.chunks[chunk].spec

    def _wait(self, work: dist.Work) -> None:
        if self.abort is not None:
            self.abort.wait(work)
        else:
            work.wait()

    def _fail(self, idx: int, ins: Instruction, err: Exception) -> ExecutionError:
        mbs = sorted({op.mb for op in compute_ops(ins)} | ({ins.mb} if hasattr(ins, "mb") else set()))
        return ExecutionError(f"rank {self.rank}: instruction {idx} ({ins}), micro-batch {','.join(map(str, mbs))}: {err}")

    # -- the loop ------------------------------------------------------------------------
    def run(self, tokens: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], *, record: Record | None = None) -> StepResult:
        """Execute the program once (one training step's forward and backward, gradients accumulated).

        ``record`` overrides the executor's recording mode for this step only. Backward
        calls run on this thread (:func:`braid.tp.autograd_calls.on_this_thread`).
        """
        with on_this_thread():
            return self._run(tokens, labels, record)

    def _run(self, tokens: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], record: Record | None) -> StepResult:
        self._rec = self.record if record is None else check_record(record)
        for k, c in self.chunks.items():
            c.set_batch(tokens, labels)
            if c.joint != self._joint[k]:
                c.set_joint(self._joint[k])
            c.track_saved = self._rec != "off"  # the saved-tensor boxes feed only the memory series
        self.clock = _Clock(self.device, enabled=self._rec != "off")
        self._events: list[tuple] = []
        self._memory: list[tuple[Any, int]] = []
        self._exposed: list[tuple[Any, Any, Comm]] = []
        self.counts = {"braided": 0, "W": 0, "B": 0, "F": 0, "AR": 0, "P2P": 0, "chained": 0}
        self._recvs: dict[tuple[CommKind, int, int], tuple[list[dist.Work], Transfer, Any]] = {}
        self._sends: list[tuple[list[dist.Work], Transfer, Any]] = []
        self._held: _Held | None = None  # a carried all-reduce until the next compute instruction
        instrs = self.program.instructions
        i = 0
        try:
            while i < len(instrs):
                ins = instrs[i]
                if isinstance(ins, (Send, Recv)):
                    j = i
                    while j < len(instrs) and isinstance(instrs[j], (Send, Recv)):
                        j += 1
                    if self._held is not None and self._held.carry.chained:
                        self._held.run = (i, instrs[i:j])  # posted when the carried all-reduce ends
                    else:
                        with _range(lambda: " ".join(map(str, instrs[i:j]))):
                            self._comm(i, instrs[i:j])
                    i = j
                    continue
                try:
                    if isinstance(ins, (Compute, Braided)):
                        if self._sends:
                            self._drop_sent()
                        with _range(ins.__str__):  # a braided block: "F3c0&B1c1"
                            self._compute(i, ins)
                    elif isinstance(ins, (Offload, Reload)):
                        with _range(ins.__str__):
                            self._copy(i, ins)
                    else:
                        raise TypeError(f"unknown instruction type {type(ins).__name__}")
                except (ChunkStateError, StashError, OffloadStateError) as err:
                    raise self._fail(i, ins, err) from err
                i += 1
            sends, self._sends = self._sends, []  # the step keeps no sent tensor: they go before the optimizer's step
            for works, t, s in sends:
                self._finish_transfer(works, t, s)
            on_host = self.offloader.finish()
            if on_host:
                raise ExecutionError(f"rank {self.rank}: program ended with activations offloaded and never reloaded: "
                                     + ", ".join(f"mb {mb} chunk {c}" for c, mb in on_host))
            if self._recvs:
                raise ExecutionError(f"rank {self.rank}: program ended with receives never consumed: "
                                     + ", ".join(str(t.instr) for _, t, _ in self._recvs.values()))
            leftover = [f"chunk {c}: {w}" for c, ch in self.chunks.items() for w in ch.pending_work()]
            if leftover:
                raise ExecutionError(f"rank {self.rank}: program ended with work left: {'; '.join(leftover[:8])}")
            for ch in self.chunks.values():  # sequence sharding: the norms' weight-gradient shares
                ch.sum_seq_grads(self._wait)
        except Exception as err:
            if self.abort is None:
                raise
            # a raw communication failure (a collective inside a chunk: the vocabulary-parallel loss)
            # leaves as a wait's would: PeerLost naming the lost rank, or the recorded failure
            reported = self.abort.translate(err)
            self.abort.fail(reported)  # first failing rank wins the record; a PeerFailure is not recorded
            if reported is err:
                raise
            raise reported from err
        losses = [v for c in self.chunks.values() if c.spec.head for v in c.losses.values()]
        if any(c.spec.head for c in self.chunks.values()) and len(losses) != self.plan.m:
            raise ExecutionError(f"rank {self.rank}: {len(losses)} micro-batch losses for m={self.plan.m}")
        loss = None
        if losses:
            total = torch.stack(losses).sum()
            if self.sp_group is not None:  # each SP rank holds its tokens' share of the loss
                total = total.to(self.device)
                self._wait(dist.all_reduce(total, group=self.sp_group, async_op=True))
            loss = total.detach()
        return StepResult(loss, self._trace(), dict(self.counts))

    # -- compute -------------------------------------------------------------------------
    def _compute(self, idx: int, ins: Compute | Braided) -> None:
        """Run a compute instruction; its first unit task beside the previous instruction's
        carried all-reduce, if there is one (:func:`braid.core.braiding.carries`), and its own
        trailing all-reduce left in flight when it carries one."""
        ops = compute_ops(ins)
        block = str(ins) if isinstance(ins, Braided) else None
        bound, phases, early = self._steps_of(idx, ins)
        held, self._held = self._held, None
        if held is None:
            self._prepare(idx, ins, ops, ops)
            pending: dict[int, _Pending] = {}
            s, first = self.clock.mark() if self._rec == "instructions" else None, 0
        else:
            pending, s = self._beside(idx, ins, held)
            head_op = bound[0][1]
            self._prepare(idx, ins, ops, [op for op in ops if op != head_op], fresh=False)
            first = 1
        for k in early:  # sequence sharding: their heads and gathers now, beside the leader's first segment
            member, op, task = bound[k][0], bound[k][1], bound[k][3]
            if self.tp_group is not None and self.chunks[op.chunk].follows(task):
                pending[member] = _Pending(self.chunks[op.chunk].lead(op.mb, task), self.clock.mark(), op, bound[k][8], block, idx,
                                           Comm.AR, "AG")
        self._run_steps(idx, block, bound, first, len(bound), pending)
        for kind, n in phases.items():
            self.counts[kind] += n
        carry = self._carries.get(idx)
        last_member = bound[-1][0]
        carried = pending.pop(last_member, None) if carry is not None and bound[-1][5] is Comm.AR else None
        for member in sorted(pending):
            self._wait_pending(pending.pop(member))
        if self._rec == "instructions":
            e = self.clock.mark()
            for op in ops:  # one event per op, spanning the whole instruction (unit: None)
                kind = "B" if op.kind is OpKind.BW else op.kind.value
                self._events.append(("compute", str(op), kind, s, e, op.mb, op.chunk, None, block, idx, None))
        for op in ops:
            if carried is None or op != carried.op:
                self._finish_op(op)
        if carried is not None:
            self._held = _Held(carry, carried)
        self._sample_memory()

    def _beside(self, idx: int, ins: Compute | Braided, held: _Held) -> tuple[dict[int, _Pending], Any]:
        """Run instruction ``idx``'s first unit task beside the carried all-reduce ``held``:
        post a chained Send/Recv run when the all-reduce ends, wait for it, finalise its op."""
        p, run = held.pending, held.run
        self.counts["chained"] += run is not None
        if run is not None and self.device.type == "cuda":
            # Stream-ordered: the run leaves when the all-reduce ends; the host goes on to the unit.
            side = self._side_stream()
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._wait(p.work)
                self._finish_op(p.op)
                self._comm(*run)
            head = self._run_head(idx, ins)
            self._wait_pending(p)  # the compute stream waits too (and the trace gets the span)
            return head
        if run is not None and held.carry.head_reads_run:
            # This host blocks in every wait and the unit's input may depend on the run: post it first.
            self._wait_pending(p)
            self._finish_op(p.op)
            self._comm(*run)
            return self._run_head(idx, ins)
        head = self._run_head(idx, ins)
        self._wait_pending(p)
        self._finish_op(p.op)
        if run is not None:
            self._comm(*run)
        return head

    def _side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _prepare(self, idx: int, ins: Compute | Braided, ops: Sequence[Compute], inputs: Sequence[Compute],
                 *, fresh: bool = True) -> None:
        """Before an instruction's units: receive the inputs of ``inputs`` and check them; when
        ``fresh`` (its first unit has not run), also advance the offloader and wait for reloads."""
        for op in inputs:
            if op.kind is not OpKind.W:
                key = (CommKind.ACT if op.kind is OpKind.F else CommKind.GRAD, op.mb, op.chunk)
                if key in self._recvs:
                    self._finish_transfer(*self._recvs.pop(key))
        for op in ops:
            if self.chunks.get(op.chunk) is None:
                raise ChunkStateError(f"no local chunk {op.chunk} (v={self.plan.v})")
        for op in inputs:
            ch = self.chunks[op.chunk]
            if op.kind is OpKind.F and not ch.has_input(op.mb):
                raise ChunkStateError(f"{op} before its input activation was received")
            if op.kind in (OpKind.B, OpKind.BW) and not ch.has_output_grad(op.mb):
                raise ChunkStateError(f"{op} before its output gradient was received")
        if not fresh:
            return
        self.offloader.advance()
        for op in ops:
            if op.kind is not OpKind.F:  # the reload of its activations must have landed
                self.offloader.wait((op.chunk, op.mb))
        if isinstance(ins, Braided):
            self.counts["braided"] += 1

    def _run_head(self, idx: int, ins: Compute | Braided) -> tuple[dict[int, _Pending], Any]:
        """Run the first unit task of instruction ``idx`` (beside a carried all-reduce); returns
        its pending all-reduce, if any, and the instruction's start mark."""
        bound, _, _ = self._steps_of(idx, ins)
        self._prepare(idx, ins, compute_ops(ins), [bound[0][1]])
        s = self.clock.mark() if self._rec == "instructions" else None
        pending: dict[int, _Pending] = {}
        self._run_steps(idx, str(ins) if isinstance(ins, Braided) else None, bound, 0, 1, pending)
        return pending, s

    def _run_steps(self, idx: int, block: str | None, bound: Sequence[_Bound], first: int, stop: int,
                   pending: dict[int, _Pending]) -> None:
        """Run unit steps ``first:stop``; an all-reduce a step starts stays in ``pending`` for its member."""
        mark = self.clock.mark
        tp, events = self.tp_group, self._events
        timed = self._rec == "units"
        for k in range(first, stop):
            member, op, call, arg, waits, comm, name, kind, unit, follow = bound[k]
            if waits and member in pending:
                self._wait_pending(pending.pop(member))
            with _range(lambda: f"{name} {unit}" if unit else name):
                s = mark() if timed else None
                out = call(op.mb, arg)
                e = mark() if timed else None
            if timed:
                events.append(("compute", name, kind, s, e, op.mb, op.chunk, unit, block, idx, None))
            if comm is Comm.AR and out is not None and tp is not None:
                # The all-reduce starts as the unit ends: its span starts at the unit's end mark.
                work = self.tp_comm.reduce(out)
                if follow is not None and self.chunks[op.chunk].follows(follow):  # sequence sharding
                    work = self._follow(work, self.chunks[op.chunk], op.mb, follow, out)
                pending[member] = _Pending(work, e, op, unit, block, idx)
                self.counts["AR"] += 1
            elif comm is Comm.A2A and out is not None:
                # Expert parallelism's all-to-all (braid.models.moe_dispatch.Exchange), asynchronous as the
                # all-reduce: gloo on its worker thread, NCCL on its stream ordered after this one.
                pending[member] = _Pending(out.start(), e, op, unit, block, idx, Comm.A2A)
                self.counts["A2A"] = self.counts.get("A2A", 0) + 1

    def _wait_pending(self, p: _Pending) -> None:
        if self._rec == "units":
            self._wait_comm(p)
        else:  # all-reduces are waited for, not timed
            self._wait(p.work)

    def _finish_op(self, op: Compute) -> None:
        """After all of an op's all-reduces: its output or input gradient is ready; hand it to a local chunk."""
        ch = self.chunks[op.chunk]
        stage = self.plan.stage_of(self.rank, op.chunk)
        if op.kind is OpKind.F:
            ch.end_forward(op.mb)
            nxt = stage + 1
            if nxt < self.plan.num_stages and self.plan.rank_chunk_of(nxt)[0] == self.rank:
                self.chunks[self.plan.rank_chunk_of(nxt)[1]].set_input(op.mb, ch.pop_output(op.mb))
        elif op.kind in (OpKind.B, OpKind.BW):
            ch.end_backward(op.mb)
            prv = stage - 1
            if prv >= 0 and self.plan.rank_chunk_of(prv)[0] == self.rank:
                self.chunks[self.plan.rank_chunk_of(prv)[1]].set_output_grad(op.mb, ch.pop_input_grad(op.mb))

    def _steps_of(self, idx: int, ins: Compute | Braided) -> tuple[tuple[_Bound, ...], dict[str, int], tuple[int, ...]]:
        """The unit steps of instruction ``idx``, bound to its ops, its unit count per phase, and
        the steps whose head starts before the first (:func:`braid.core.braiding.early_heads`).

        :func:`braid.core.braiding.steps` depends only on the instruction's shape (op kinds and
        chunks) and the chunk specs, so it runs once per shape; binding the micro-batches
        and the text of each step happens once per instruction of the program.

        Where every op's chunk runs fused and single units are not timed, each op is one
        step (:meth:`ModelChunk.run_op`), in the order of the ops' first unit tasks; the
        phase counts are still the unit tasks'.
        """
        whole = self._rec != "units" and all(self.fused[op.chunk] for op in compute_ops(ins))
        got = self._bound.get((idx, whole))
        if got is not None:
            return got
        ops = compute_ops(ins)
        shape = tuple((op.kind, op.chunk) for op in ops) + (isinstance(ins, Braided) and (ins.lead,),)
        tasks = self._by_shape.get(shape)
        if tasks is None:
            tasks = tuple((st.member, st.task) for st in braid_steps(ins, self._spec))
            self._by_shape[shape] = tasks
        names = [str(op) for op in ops]
        if whole:
            order = list(dict.fromkeys(member for member, _ in tasks))
            bound = tuple((m, ops[m], self.chunks[ops[m].chunk].run_op, ops[m].kind, True, None, names[m],
                           ops[m].kind.value, None, None) for m in order)
        else:
            bound = tuple(
                (member, ops[member], self.chunks[ops[member].chunk].run, task, task.waits, task.comm, names[member],
                 task.phase.value, task.label.split(":", 1)[1], next_of_op(tasks, k))
                for k, (member, task) in enumerate(tasks)
            )
        phases: dict[str, int] = {}
        for _, task in tasks:
            phases[task.phase.value] = phases.get(task.phase.value, 0) + 1
        got = self._bound[(idx, whole)] = (bound, phases, () if whole else early_heads(tasks))
        return got

    def _wait_comm(self, p: _Pending) -> None:
        before = self.clock.mark()
        self._wait(p.work)
        end = self.clock.mark()
        self._exposed.append((before, end, p.comm))
        lane, kind = _LANE[p.comm][0], p.kind or _LANE[p.comm][1]
        self._events.append((lane, f"{kind} {p.op}", kind, p.start, end, p.op.mb, p.op.chunk, p.unit, p.block, p.index, None))

    # -- communication -------------------------------------------------------------------
    def _comm(self, start: int, batch: Sequence[Instruction]) -> None:
        transfers: list[Transfer] = []
        staged = self.capturing if self.stage_p2p is None else self.stage_p2p
        for k, ins in enumerate(batch):
            idx = start + k
            stage = self.plan.stage_of(self.rank, ins.chunk)
            try:
                ch = self.chunks[ins.chunk]
                if isinstance(ins, Send):
                    if ins.comm is CommKind.ACT:
                        buf = ch.pop_output(ins.mb)
                    else:
                        buf = ch.pop_input_grad(ins.mb)
                    dst = self.plan.comm_stages(self.rank, ins)[1]
                    buf = self.staging.send(buf) if staged else buf.contiguous()
                    transfers.append(Transfer(ins, idx, buf, dst, staged))
                else:
                    buf = (self.staging.take if staged else torch.empty)(self.act_shape, dtype=self.dtype, device=self.device)
                    transfers.append(Transfer(ins, idx, buf, stage, staged))
            except (ChunkStateError, KeyError) as err:
                raise self._fail(idx, ins, err) from err
        s = self.clock.mark()
        works = issue(transfers, lambda peer: self.pp_ranks[peer], self.plan.num_stages)
        for t in transfers:
            self.counts["P2P"] += 1
            ins = t.instr
            if isinstance(ins, Recv):
                self._recvs[(ins.comm, ins.mb, ins.chunk)] = (works, t, s)
            else:
                self._sends.append((works, t, s))

    def _finish_transfer(self, works: list[dist.Work], t: Transfer, start: Any) -> None:
        """Wait for a posted transfer (its whole batch) and hand a received tensor to its chunk."""
        for w in works:
            self._wait(w)
        works.clear()  # a batch is waited once; later transfers of it find nothing left to wait for
        e = self.clock.mark()
        ins = t.instr
        kind = "SEND" if isinstance(ins, Send) else "RECV"
        self._events.append(("p2p", str(ins), kind, start, e, ins.mb, ins.chunk, None, None, t.index, ins.peer))
        if isinstance(ins, Send) and t.staged:
            self.staging.give(t.buffer)
        if isinstance(ins, Recv):
            got = self.staging.received(t.buffer) if t.staged else t.buffer
            ch = self.chunks[ins.chunk]
            if ins.comm is CommKind.ACT:
                ch.set_input(ins.mb, got)
            else:
                ch.set_output_grad(ins.mb, got)
            if self._sends:
                self._drop_sent()

    def _drop_sent(self) -> None:
        """Sends whose batch was waited (with a receive), or is complete (NCCL says so unwaited, gloo does not; a capture
        cannot ask), are finished and let their tensors go now, as the simulator frees a sent tensor as its send ends."""
        done = [not works or (not self.capturing and all(w.is_completed() for w in works)) for works, _, _ in self._sends]
        if any(done):
            sends, self._sends = self._sends, [x for x, d in zip(self._sends, done) if not d]
            for x in (x for x, d in zip(sends, done) if d):
                self._finish_transfer(*x)

    def _copy(self, idx: int, ins: Offload | Reload) -> None:
        """Issue an offload or reload (asynchronous on CUDA; see :mod:`braid.runtime.offload`)."""
        ch = self.chunks.get(ins.chunk)
        if ch is None:
            raise ChunkStateError(f"no local chunk {ins.chunk} (v={self.plan.v})")
        key = (ins.chunk, ins.mb)
        if isinstance(ins, Offload):
            rec = self.offloader.offload(key, *ch.saved_for(ins.mb), ins.frac, mark=self.clock.mark)
        else:
            rec = self.offloader.reload(key, mark=self.clock.mark)
        kind = "OFFLOAD" if isinstance(ins, Offload) else "RELOAD"
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.counts[f"{kind}_bytes"] = self.counts.get(f"{kind}_bytes", 0) + rec.nbytes
        self._events.append(("copy", str(ins), kind, rec.start, rec.end, ins.mb, ins.chunk, None, None, idx, None))
        self._sample_memory()

    # -- trace ---------------------------------------------------------------------------
    def _sample_memory(self) -> None:
        if self._rec == "off":
            return
        if self.device.type == "cuda":
            b = torch.cuda.memory_allocated(self.device)
        else:
            b = sum(c.live_bytes() for c in self.chunks.values())
        self._memory.append((self.clock.mark(), b))

    def _trace(self) -> Trace:
        if self.clock.cuda and not self.capturing:
            torch.cuda.synchronize(self.device)
        summary: dict[str, Any] = {f"count_{k}": v for k, v in self.counts.items()}
        meta = {"schedule": self.plan.name, "source": "measured", "rank": self.rank, "device": str(self.device),
                "record": self._rec, "summary": summary}
        if self._rec == "off":  # copy marks were None: nothing was timed
            return Trace(meta, [], {})
        return measured_trace(meta, self.rank, self._events, self._exposed, self._memory, self.clock.seconds,
                              units=self._rec == "units")
