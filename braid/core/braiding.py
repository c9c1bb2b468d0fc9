"""The braid pattern: how compute ops decompose into units and how two ops interleave.

Defined once here; the simulator and the executor both walk the step lists this module
returns, so a prediction and a measurement follow the same unit order.

Units of one transformer layer (paper Sec. 3, Fig. 2-3):

=========  =====================================  ===========================================
unit       forward (F)                            activation backward (B)
=========  =====================================  ===========================================
pre_attn   RMSNorm, QKV projection (column-par.)  QKV input-grad -> **AR** (operator f)
attn       attention, out-proj (row-par.) +       attention / out-proj input-grads (no AR);
           residual/t -> **AR** (operator g)      starts by finishing the norm's backward
pre_mlp    RMSNorm, gate/up projection (col.)     gate/up input-grad -> **AR** (operator f)
mlp        SwiGLU, down-proj (row-par.) +         SwiGLU / down-proj input-grads (no AR)
           residual/t -> **AR** (operator g)
=========  =====================================  ===========================================

The first virtual stage also has an ``embed`` unit (vocab-parallel embedding, AR in
forward), the last a ``head`` unit (final norm, vocab-parallel LM head and loss; AR of the
input gradient in backward). The vision stage of a VLM ends with a ``merge`` unit (patch
merger -- norm, column-parallel fc1, row-parallel fc2 -- joined with the vocab-parallel text
embedding: AR in forward; AR of fc1's input gradient in backward). A ``W`` op has the same units, weight gradients only, no AR.

A mixture-of-experts layer (:attr:`ChunkSpec.moe`) cuts its MLP side at expert parallelism's
all-to-alls (**A2A**, over the expert-parallel group) as a dense layer is cut at TP's all-reduces:

=========  =====================================  ===========================================
unit       forward (F)                            activation backward (B)
=========  =====================================  ===========================================
pre_mlp    RMSNorm, router, top-k, permutation    permutation / router input-grads and the
           -> **A2A** (dispatch)                  norm -> **AR** (operator f), as dense
experts    grouped expert GEMMs -> **A2A**        expert input-grads -> **A2A** (the
           (combine)                              dispatch's, back to the tokens' ranks)
mlp        un-permutation, weighted sum,          weighted sum's input-grads -> **A2A** (the
           residual/t -> **AR** (operator g)      combine's, to the experts' ranks)
=========  =====================================  ===========================================

W of ``experts`` computes the experts' weight gradients, W of ``pre_mlp`` the router's.

**The rule both interpreters follow.** A task whose ``comm`` is set starts a collective as it
ends: :attr:`Comm.AR`, a TP all-reduce of its output on the communication stream;
:attr:`Comm.A2A`, an all-to-all of its rows over the expert-parallel group. The next F or B
task *of the same op* waits for it before it starts (W tasks never wait: they read stashed
tensors, not the collective's result). Every collective of an instruction is complete when the
instruction ends -- except a trailing all-reduce that :func:`carries` carries into the next compute
instruction, whose first unit task then runs beside it (no op ends on an all-to-all). With
``tp == 1`` there are no all-reduces, with ``ep == 1`` no all-to-alls; the units and their cuts
stay the same. Under sequence parallelism inside TP the all-reduce is a reduce-scatter, and the next
unit's head (:data:`GATHER_HEAD_F`, :data:`GATHER_HEAD_B`: a norm, or a norm backward, then an
all-gather) runs as it ends, so the op's next task waits for both; an op's first such unit, which no
reduction of its op precedes, starts its head and gather as the instruction starts when it is not
the block's leader (:func:`early_heads`).

**Segments and braiding.** An op's task list is cut into *segments*: after every task that
starts a collective (an all-reduce or an all-to-all), and for W every two units (half a layer, matching the forward's
all-reduce spacing). A braided block alternates segments -- ``a0 b0 a1 b1 ...`` -- then
runs what is left of the longer op; a W member with fewer segments than its partner is cut
into as many even pieces instead (W waits for nothing), so a long forward braided with a
shorter chunk's W still has W units beside each of its all-reduces. A block whose ``lead`` is
set (text ``/a`` or ``/b``, chosen from costs by :mod:`braid.planner.braid_tune`) starts with that
member and takes no other order. Otherwise: if that order would end
the block on an all-reduce and the order led by the second member (``b0 a0 b1 a1 ...``)
would not, the block takes the latter: an F&B block on the last stage then ends with the
forward's head unit, which runs beside the backward's last all-reduce. When both orders end
on an all-reduce (an F&B block between two middle stages), the block ends on the
forward's, whose result is final when it lands (:func:`carries` can then chain its send). So each all-reduce of one op is in flight while the
other op's next segment computes; so is each all-to-all. A full backward (``BW``) runs each unit's weight
gradient right after its activation gradient, so its own all-reduces hide behind W work.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from braid.core.ir import Braided, CommKind, Compute, Instruction, OpKind, Recv, Send, compute_ops


class Unit(str, enum.Enum):
    EMBED = "embed"
    PRE_ATTN = "pre_attn"
    ATTN = "attn"
    PRE_MLP = "pre_mlp"
    MLP = "mlp"
    HEAD = "head"
    MERGE = "merge"
    EXPERTS = "experts"  # a mixture-of-experts layer's grouped expert GEMMs, between pre_mlp and mlp


class Comm(str, enum.Enum):
    """The collective a unit task starts as it ends (:attr:`UnitTask.comm`)."""

    AR = "AR"  # TP all-reduce (reduce-scatter under sequence sharding) over the TP group
    A2A = "A2A"  # expert parallelism's all-to-all of routed rows over the expert-parallel group


LAYER_UNITS: tuple[Unit, ...] = (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP)
# A mixture-of-experts layer's units: the experts between Pre-MLP and MLP (which is then the combine).
MOE_LAYER_UNITS: tuple[Unit, ...] = (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.EXPERTS, Unit.MLP)
# Units that end with a TP all-reduce, per phase: defined here once and imported by the
# chunk runner, the cost model and the profiler.
AR_FORWARD: frozenset[Unit] = frozenset({Unit.EMBED, Unit.ATTN, Unit.MLP, Unit.MERGE})
AR_BACKWARD: frozenset[Unit] = frozenset({Unit.PRE_ATTN, Unit.PRE_MLP, Unit.HEAD, Unit.MERGE})
# Units of a mixture-of-experts layer that end with an all-to-all, per phase (none also ends with an all-reduce).
A2A_FORWARD: frozenset[Unit] = frozenset({Unit.PRE_MLP, Unit.EXPERTS})
A2A_BACKWARD: frozenset[Unit] = frozenset({Unit.EXPERTS, Unit.MLP})
# Under sequence parallelism inside TP (braid.tp.seq_shard), units whose *head* -- a norm (forward), or
# a norm backward and the residual (backward), on the rank's tokens -- ends in an all-gather of the
# sequence, per phase: the units after an AR_FORWARD / AR_BACKWARD unit (the embedding's backward
# gathers the gradient it receives). See :func:`early_heads` for when that gather starts.
GATHER_HEAD_F: frozenset[Unit] = frozenset({Unit.PRE_ATTN, Unit.PRE_MLP, Unit.HEAD})
GATHER_HEAD_B: frozenset[Unit] = frozenset({Unit.ATTN, Unit.MLP, Unit.EMBED})


def unit_comm(phase: "Phase", unit: Unit, moe: bool) -> Comm | None:
    """The collective that ends ``unit``'s ``phase`` (None: none; W never communicates); ``moe``:
    the unit belongs to a mixture-of-experts layer."""
    if phase is Phase.W:
        return None
    if moe and unit in (A2A_FORWARD if phase is Phase.F else A2A_BACKWARD):
        return Comm.A2A
    return Comm.AR if unit in (AR_FORWARD if phase is Phase.F else AR_BACKWARD) else None


class Phase(str, enum.Enum):
    F = "F"  # forward
    B = "B"  # activation gradient
    W = "W"  # weight gradient


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """What one model chunk (virtual stage) contains, as far as scheduling cares.

    ``layers``: whole transformer layers in the chunk (0 allowed for a chunk that holds only
    the embedding or only the head); ``embed``/``head``: whether it is the first/last stage;
    ``merge``: the chunk ends with a VLM's patch merger joined with the text embedding;
    ``moe``: the chunk-local layer indices (as :meth:`layer_units` counts them) of its
    mixture-of-experts layers, whose MLP side is three units (:data:`MOE_LAYER_UNITS`).

    **Half-layer cuts.** ``half_in``: the chunk starts with the MLP half (``pre_mlp``,
    ``mlp``) of a layer whose attention half ended the stage before; ``half_out``: it ends
    with the attention half (``pre_attn``, ``attn``) of a layer the next stage finishes. The
    cut lies on the residual stream between ``attn`` and ``pre_mlp``, so the tensor that
    crosses it has a layer boundary's shape. Chunk-local layer indices count the half
    layers: with ``half_in`` layer 0 is the MLP half, the whole layers follow, the
    attention half of ``half_out`` comes last (:meth:`layer_units`).
    """

    layers: int
    embed: bool = False
    head: bool = False
    merge: bool = False
    half_in: bool = False
    half_out: bool = False
    moe: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe", frozenset(self.moe))
        if self.layers < 0:
            raise ValueError(f"ChunkSpec.layers must be >= 0, got {self.layers}")
        if self.layers == 0 and not (self.embed or self.head or self.half_in or self.half_out):
            raise ValueError("a chunk needs at least one layer, half a layer, the embedding or the head")
        if self.merge and self.head:
            raise ValueError("a chunk with the vision merger cannot also hold the LM head; give the LM its own stage")
        if self.merge and (self.half_in or self.half_out):
            raise ValueError("the vision stage holds whole ViT blocks; half-layer cuts are for decoder stages")
        if any(not 0 <= i < self.modules for i in self.moe):
            raise ValueError(f"ChunkSpec.moe names layers {sorted(self.moe)} outside the chunk's {self.modules} layer modules")

    @property
    def modules(self) -> int:
        """Layer modules the chunk holds: its whole layers and each half layer."""
        return self.layers + self.half_in + self.half_out

    def units_of(self, layer: int) -> tuple[Unit, ...]:
        """The units of chunk-local layer ``layer`` (a whole layer's; a half layer's are the MLP or
        the attention side of them)."""
        return MOE_LAYER_UNITS if layer in self.moe else LAYER_UNITS

    def layer_units(self) -> list[tuple[Unit, int]]:
        """The chunk's layer units in forward order, as (unit, chunk-local layer)."""
        out = [(u, 0) for u in self.units_of(0)[2:]] if self.half_in else []
        first = int(self.half_in)
        for layer in range(first, first + self.layers):
            out += [(u, layer) for u in self.units_of(layer)]
        if self.half_out:
            out += [(u, first + self.layers) for u in LAYER_UNITS[:2]]
        return out

    def instances(self) -> list[Unit]:
        """Every unit instance of the chunk in forward order: the embedding, the layer units, the merger, the head."""
        out = [Unit.EMBED] if self.embed else []
        out += [u for u, _ in self.layer_units()]
        out += [Unit.MERGE] if self.merge else []
        return out + ([Unit.HEAD] if self.head else [])


@dataclass(frozen=True, slots=True)
class UnitTask:
    """One unit of work. ``layer`` is the chunk-local layer index (-1 for embed/head); ``comm``:
    the collective it starts when it ends (None: none; :func:`unit_comm`)."""

    phase: Phase
    unit: Unit
    layer: int
    comm: Comm | None = None

    def __post_init__(self) -> None:
        if self.comm is not None and not isinstance(self.comm, Comm):
            raise TypeError(f"UnitTask.comm must be a Comm or None, got {self.comm!r}")

    @property
    def ar(self) -> bool:
        """Whether it starts a TP all-reduce of its output when it ends."""
        return self.comm is Comm.AR

    @property
    def waits(self) -> bool:
        """Whether it waits for its op's pending collective before it starts."""
        return self.phase is not Phase.W

    @property
    def label(self) -> str:
        where = f"L{self.layer}." if self.layer >= 0 else ""
        return f"{self.phase.value}:{where}{self.unit.value}"


def _task(phase: Phase, unit: Unit, layer: int, spec: ChunkSpec) -> UnitTask:
    return UnitTask(phase, unit, layer, unit_comm(phase, unit, layer in spec.moe))


def _forward_tasks(spec: ChunkSpec) -> list[UnitTask]:
    out = []
    if spec.embed:
        out.append(_task(Phase.F, Unit.EMBED, -1, spec))
    out += [_task(Phase.F, u, layer, spec) for u, layer in spec.layer_units()]
    if spec.merge:
        out.append(_task(Phase.F, Unit.MERGE, -1, spec))
    if spec.head:
        out.append(_task(Phase.F, Unit.HEAD, -1, spec))
    return out


def _backward_units(spec: ChunkSpec) -> list[tuple[Unit, int]]:
    out: list[tuple[Unit, int]] = []
    if spec.head:
        out.append((Unit.HEAD, -1))
    if spec.merge:
        out.append((Unit.MERGE, -1))
    out += spec.layer_units()[::-1]
    if spec.embed:
        out.append((Unit.EMBED, -1))
    return out


def unit_tasks(kind: OpKind, spec: ChunkSpec) -> list[UnitTask]:
    """The ordered unit tasks of one compute op on a chunk."""
    if kind is OpKind.F:
        return _forward_tasks(spec)
    units = _backward_units(spec)
    if kind is OpKind.B:
        return [_task(Phase.B, u, l, spec) for u, l in units]
    if kind is OpKind.W:
        return [_task(Phase.W, u, l, spec) for u, l in units]
    # BW: each unit's weight gradient right after its activation gradient.
    out = []
    for u, l in units:
        out.append(_task(Phase.B, u, l, spec))
        out.append(_task(Phase.W, u, l, spec))
    return out


def segments(tasks: Sequence[UnitTask]) -> list[list[UnitTask]]:
    """Cut a task list after every collective, and W-only runs every two units."""
    segs: list[list[UnitTask]] = []
    cur: list[UnitTask] = []
    for t in tasks:
        cur.append(t)
        w_run = all(x.phase is Phase.W for x in cur)
        if t.comm is not None or (w_run and len(cur) == 2):
            segs.append(cur)
            cur = []
    if cur:
        segs.append(cur)
    return segs


def _split_even(tasks: list[UnitTask], n: int) -> list[list[UnitTask]]:
    """``tasks`` in ``min(n, len(tasks))`` consecutive pieces whose sizes differ by at most one."""
    n = min(n, len(tasks))
    size, extra = divmod(len(tasks), n)
    out, k = [], 0
    for i in range(n):
        step = size + (i < extra)
        out.append(tasks[k:k + step])
        k += step
    return out


@dataclass(frozen=True, slots=True)
class Step:
    """One unit task of one member of an instruction (``member`` 0 or 1 of a braided block)."""

    member: int
    op: Compute
    task: UnitTask


def steps(instr: Instruction, spec_of) -> list[Step]:
    """The unit-level steps of a compute instruction, in execution order.

    ``spec_of(chunk) -> ChunkSpec`` describes the rank's local chunks. A plain op yields its
    tasks in order; a braided block alternates the segments of its two ops.
    """
    if isinstance(instr, Compute):
        return [Step(0, instr, t) for t in unit_tasks(instr.kind, spec_of(instr.chunk))]
    if not isinstance(instr, Braided):
        raise TypeError(f"{instr} is not a compute instruction")
    segs = [segments(unit_tasks(op.kind, spec_of(op.chunk))) for op in instr.ops]
    for member, other in ((0, 1), (1, 0)):
        # A weight-gradient member waits for nothing: cut it into as many pieces as the other
        # member has segments, so every collective of the other runs beside W units.
        if instr.ops[member].kind is OpKind.W and len(segs[member]) < len(segs[other]):
            segs[member] = _split_even([t for seg in segs[member] for t in seg], len(segs[other]))
    if instr.lead is not None:  # fixed by the plan (braid.planner.braid_tune chooses it from costs)
        return _alternate(instr, segs, (instr.lead, 1 - instr.lead))
    out = _alternate(instr, segs, (0, 1))
    if out[-1].task.ar:  # led by the second member, the block may end on a unit with nothing to hide
        swapped = _alternate(instr, segs, (1, 0))
        if not swapped[-1].task.ar:
            return swapped
        if out[-1].task.phase is not Phase.F and swapped[-1].task.phase is Phase.F:
            return swapped  # end on a forward's all-reduce: its result is the output, sent as it lands
    return out


def gather_head(task: UnitTask) -> bool:
    """Whether ``task``'s unit starts with a head that ends in an all-gather under sequence sharding
    (:data:`GATHER_HEAD_F`, :data:`GATHER_HEAD_B`; W has none)."""
    return task.unit in (GATHER_HEAD_F if task.phase is Phase.F else GATHER_HEAD_B if task.phase is Phase.B else ())


def next_of_op(tasks: Sequence[tuple[int, UnitTask]], k: int) -> UnitTask | None:
    """The F or B unit task of step ``k``'s member after it, when step ``k`` starts a reduction (its head
    then runs as that reduction ends, under sequence sharding); None otherwise. ``tasks``: (member, task).
    A full backward's W tasks in between (they wait for nothing) are passed over: the head runs beside them,
    on the stream that ran its forward's head (a CUDA graph capture reuses the reduction's buffer then)."""
    member, task = tasks[k]
    return next((t for m, t in tasks[k + 1:] if m == member and t.phase is not Phase.W), None) if task.ar else None


def early_heads(tasks: Sequence[tuple[int, UnitTask]]) -> tuple[int, ...]:
    """Steps (indices into ``tasks``, (member, task) in :func:`steps` order) whose head -- under
    sequence sharding a norm (backward) on the rank's tokens and an all-gather -- starts as the
    instruction starts, before its first step: the first task of a member that does not lead a
    braided block (its first step is not the block's first) and whose unit has a gathering head
    (:func:`gather_head`). That gather is then in flight while the leading member's first
    segment computes, as the reduce-scatter and gather inside an op run beside the partner's
    next segment; the step waits for it as for its op's pending collective. A leading member's
    first unit (and a plain op's) gathers when it starts, blocking: nothing of the instruction
    runs before it. With a carried all-reduce (:func:`carries`) the instruction "starts" after
    its first step and that wait, when every member's input is in hand."""
    out, seen = [], {tasks[0][0]} if tasks else set()
    for k, (member, task) in enumerate(tasks):
        if member not in seen:
            seen.add(member)
            if gather_head(task):
                out.append(k)
    return tuple(out)


def _alternate(instr: Braided, segs: list[list[list[UnitTask]]], order: tuple[int, int]) -> list[Step]:
    out: list[Step] = []
    for i in range(max(len(segs[0]), len(segs[1]))):
        for member in order:
            if i < len(segs[member]):
                op = instr.ops[member]
                out += [Step(member, op, t) for t in segs[member][i]]
    return out


# -- carrying an all-reduce across an instruction boundary -----------------------------------
@dataclass(frozen=True, slots=True)
class Carry:
    """The trailing all-reduce of a compute instruction left in flight into the next one.

    ``op``: the member whose last unit task started it; ``into``: program index of the next
    compute instruction, whose first unit task runs beside it. ``chained``: ``op``'s output
    is sent in the Send/Recv run between them, so that run is posted when the all-reduce
    ends instead of at once. ``head_reads_run``: the first unit task consumes a tensor
    received in that run.
    """

    op: Compute
    into: int
    chained: bool = False
    head_reads_run: bool = False


def input_message(op: Compute) -> tuple[CommKind, int, int] | None:
    """(comm, mb, chunk) of the message ``op`` consumes if it comes from another rank (``None`` for W)."""
    if op.kind is OpKind.W:
        return None
    return (CommKind.ACT if op.kind is OpKind.F else CommKind.GRAD, op.mb, op.chunk)


def carries(instructions: Sequence[Instruction], spec_of) -> dict[int, Carry]:
    """Where a program carries an all-reduce across an instruction boundary: index -> :class:`Carry`.

    Compute instruction ``I`` (index i) carries into the next compute instruction ``J`` when

    1. only ``Send``/``Recv`` lie between them (an offload or reload would read I's tensors),
    2. ``I`` or ``J`` is a braided block (braiding is what opts a boundary into unit-level
       overlap; plain ops next to plain ops finish their all-reduces, as the reference
       runtimes of 1F1B-I and ZB-V do), and ``I`` is not a block marked not to carry
       (``Braided.carry=False``, text ``/n``),
    3. ``I``'s last unit task starts an all-reduce (of its member ``op``) whose result is
       either not sent in the Send/Recv run between them, or is a forward's output (the
       all-reduced tensor itself, final when the all-reduce ends: the run is *chained*),
    4. ``J``'s first unit task has another micro-batch than ``op`` (so it consumes neither
       ``op``'s output nor a same-rank hand-off of it).

    Both interpreters then (with ``tp > 1``; without all-reduces nothing is carried): run I's
    units and finish its other all-reduces; post the Send/Recv run -- at once, or for a
    chained run when the carried all-reduce ends (``op`` finalised first, the rank not
    waiting: on CUDA the run is issued from a side stream ordered after the all-reduce);
    run J's first unit task beside the carried all-reduce (once its input, if received in
    the run, is there); wait for the all-reduce (any wait is exposed TP comm) and finalise
    ``op``; go on with J's second unit task. The executor on CPU, whose host blocks in
    every wait, runs a chained carry whose first unit reads from the run without the
    overlap: all-reduce, finalise, post, then the unit.

    Why only a forward's result may be chained: a backward's input gradient still needs its
    last norm backward after the all-reduce, which would sit on the compute stream after
    J's first unit and send the gradient a unit later (on uniform costs that lengthened
    braided_v's step more than the hidden all-reduce saved). A braided block with both
    orders ending on an all-reduce ends on the forward's (:func:`steps`) so that it can be.
    Why nothing deadlocks: a chained run keeps its messages and their order, and is delayed
    only by the carried all-reduce, which waits for the TP peers alone (they run the same
    program); an unchained run is posted before J's first unit as without a carry.
    """
    out: dict[int, Carry] = {}
    ends_of: dict[tuple, tuple[Step, Step]] = {}

    def ends(instr: Compute | Braided) -> tuple[Step, Step]:
        """First and last step of an instruction (by shape, rebound to its ops)."""
        ops = compute_ops(instr)
        key = tuple((op.kind, op.chunk) for op in ops) + (isinstance(instr, Braided) and (instr.lead,),)
        hit = ends_of.get(key)
        if hit is None:
            st = steps(instr, spec_of)
            hit = ends_of[key] = (st[0], st[-1])
        return tuple(Step(s.member, ops[s.member], s.task) for s in hit)  # type: ignore[return-value]

    compute_at = [k for k, ins in enumerate(instructions) if isinstance(ins, (Compute, Braided))]
    for i, j in zip(compute_at, compute_at[1:]):
        prev, nxt = instructions[i], instructions[j]
        if not (isinstance(prev, Braided) or isinstance(nxt, Braided)):
            continue
        if isinstance(prev, Braided) and not prev.carry:
            continue
        between = instructions[i + 1:j]
        if not all(isinstance(x, (Send, Recv)) for x in between):
            continue
        last = ends(prev)[1]
        if not last.task.ar:
            continue
        op, head = last.op, ends(nxt)[0].op
        if head.mb == op.mb:
            continue
        result = (CommKind.ACT if op.kind is OpKind.F else CommKind.GRAD, op.mb, op.chunk)
        chained = any(isinstance(x, Send) and (x.comm, x.mb, x.chunk) == result for x in between)
        if chained and op.kind is not OpKind.F:
            continue
        want = input_message(head)
        reads = want is not None and any(isinstance(x, Recv) and (x.comm, x.mb, x.chunk) == want for x in between)
        out[i] = Carry(op, j, chained, reads)
    return out
