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

**The rule both interpreters follow.** A task with ``ar=True`` starts a TP all-reduce of
its output on the communication stream as it ends. The next F or B task *of the same op*
waits for that all-reduce before it starts (W tasks never wait: they read stashed
tensors, not the reduced result). Every all-reduce of an instruction is complete when the
instruction ends -- except one that :func:`carries` carries into the next compute
instruction, whose first unit task then runs beside it. With ``tp == 1`` there are no
all-reduces.

**Segments and braiding.** An op's task list is cut into *segments*: after every task that
starts an all-reduce, and for W every two units (half a layer, matching the forward's
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
other op's next segment computes. A full backward (``BW``) runs each unit's weight
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


LAYER_UNITS: tuple[Unit, ...] = (Unit.PRE_ATTN, Unit.ATTN, Unit.PRE_MLP, Unit.MLP)
# Units that end with a TP all-reduce, per phase: defined here once and imported by the
# chunk runner, the cost model and the profiler.
AR_FORWARD: frozenset[Unit] = frozenset({Unit.EMBED, Unit.ATTN, Unit.MLP, Unit.MERGE})
AR_BACKWARD: frozenset[Unit] = frozenset({Unit.PRE_ATTN, Unit.PRE_MLP, Unit.HEAD, Unit.MERGE})


class Phase(str, enum.Enum):
    F = "F"  # forward
    B = "B"  # activation gradient
    W = "W"  # weight gradient


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """What one model chunk (virtual stage) contains, as far as scheduling cares.

    ``layers``: whole transformer layers in the chunk (0 allowed for a chunk that holds only
    the embedding or only the head); ``embed``/``head``: whether it is the first/last stage;
    ``merge``: the chunk ends with a VLM's patch merger joined with the text embedding.

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

    def __post_init__(self) -> None:
        if self.layers < 0:
            raise ValueError(f"ChunkSpec.layers must be >= 0, got {self.layers}")
        if self.layers == 0 and not (self.embed or self.head or self.half_in or self.half_out):
            raise ValueError("a chunk needs at least one layer, half a layer, the embedding or the head")
        if self.merge and self.head:
            raise ValueError("a chunk with the vision merger cannot also hold the LM head; give the LM its own stage")
        if self.merge and (self.half_in or self.half_out):
            raise ValueError("the vision stage holds whole ViT blocks; half-layer cuts are for decoder stages")

    @property
    def modules(self) -> int:
        """Layer modules the chunk holds: its whole layers and each half layer."""
        return self.layers + self.half_in + self.half_out

    def layer_units(self) -> list[tuple[Unit, int]]:
        """The chunk's layer units in forward order, as (unit, chunk-local layer)."""
        out = [(u, 0) for u in LAYER_UNITS[2:]] if self.half_in else []
        first = int(self.half_in)
        for layer in range(first, first + self.layers):
            out += [(u, layer) for u in LAYER_UNITS]
        if self.half_out:
            out += [(u, first + self.layers) for u in LAYER_UNITS[:2]]
        return out


@dataclass(frozen=True, slots=True)
class UnitTask:
    """One unit of work. ``layer`` is the chunk-local layer index (-1 for embed/head)."""

    phase: Phase
    unit: Unit
    layer: int
    ar: bool  # starts a TP all-reduce of its output when it ends

    @property
    def waits_ar(self) -> bool:
        """Whether it waits for its op's pending all-reduce before it starts."""
        return self.phase is not Phase.W

    @property
    def label(self) -> str:
        where = f"L{self.layer}." if self.layer >= 0 else ""
        return f"{self.phase.value}:{where}{self.unit.value}"


def _forward_tasks(spec: ChunkSpec) -> list[UnitTask]:
    out = []
    if spec.embed:
        out.append(UnitTask(Phase.F, Unit.EMBED, -1, True))
    out += [UnitTask(Phase.F, u, layer, u in AR_FORWARD) for u, layer in spec.layer_units()]
    if spec.merge:
        out.append(UnitTask(Phase.F, Unit.MERGE, -1, True))
    if spec.head:
        out.append(UnitTask(Phase.F, Unit.HEAD, -1, False))
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
        return [UnitTask(Phase.B, u, l, u in AR_BACKWARD) for u, l in units]
    if kind is OpKind.W:
        return [UnitTask(Phase.W, u, l, False) for u, l in units]
    # BW: each unit's weight gradient right after its activation gradient.
    out = []
    for u, l in units:
        out.append(UnitTask(Phase.B, u, l, u in AR_BACKWARD))
        out.append(UnitTask(Phase.W, u, l, False))
    return out


def segments(tasks: Sequence[UnitTask]) -> list[list[UnitTask]]:
    """Cut a task list after every all-reduce, and W-only runs every two units."""
    segs: list[list[UnitTask]] = []
    cur: list[UnitTask] = []
    for t in tasks:
        cur.append(t)
        w_run = all(x.phase is Phase.W for x in cur)
        if t.ar or (w_run and len(cur) == 2):
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
        # member has segments, so every all-reduce of the other runs beside W units.
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
