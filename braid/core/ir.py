"""The instruction IR shared by schedules, the compiler, the simulator and the executor.

A schedule generator produces a :class:`Plan`: for every pipeline rank an ordered list of
*compute* instructions (``F``, ``B``, ``W``, ``BW`` and braided pairs of them). The
compiler (:mod:`braid.core.compiler`) lowers a plan into one :class:`Program` per rank by
inserting point-to-point communication (``SEND``/``RECV``) and, for offloading schedules,
``OFFLOAD``/``RELOAD``. Both interpreters -- the simulator and the executor -- run the very
same programs.

Every instruction is a small frozen value with one compact text form that parses back::

    F3c0          forward of micro-batch 3 on local chunk 0
    B3c1          activation-gradient-only backward (weight gradient split off)
    W3c1          the deferred weight-gradient pass of B3c1
    BW3c1         full backward: activation *and* weight gradients
    F9c1&B3c1     braided block: units of F9c1 interleaved with units of B3c1
    F7c0&B2c1     cross-chunk braided block (DualPipeV's overlapped forward/backward pair)
    F9c1&B3c1/b   ... whose units start with the second member's (``/a``: the first's; without
                  either the braiding rule of :func:`braid.core.braiding.steps` picks)
    F9c1&B3c1/n   ... whose trailing all-reduce is not carried into the next instruction
                  (``/bn``: both; :func:`braid.core.braiding.carries`)
    SEND_A3c0>1   send the output activation of F3c0 to rank 1
    RECV_A3c1<0   receive the input activation of F3c1 from rank 0
    SEND_G3c1>0   send the input gradient produced by B3c1 to rank 0
    RECV_G3c0<1   receive the output gradient needed by B3c0 from rank 1
    OFFLOAD3c0    move the saved activations of (3, chunk 0) to host memory
    OFFLOAD3c0@0.5   ... only half of them
    RELOAD3c0     bring them back before the backward that needs them

``chunk`` is always the *local* chunk index on the rank (0 .. v-1); the plan's placement
maps (rank, chunk) to the virtual stage. Paper: "Synergistic Tensor and Pipeline
Parallelism", Sec. 3 (units and braided blocks) and Sec. 4 (V-shaped schedule).
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Union, get_args


class OpKind(str, enum.Enum):
    """Kinds of compute op.

    ``B`` is the activation-gradient-only backward (zero-bubble's "B"): it leaves the weight
    gradient to a later ``W``. ``BW`` is the full backward, activation and weight gradients
    in one op, and has no ``W`` of its own.
    """

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"


class CommKind(str, enum.Enum):
    ACT = "A"  # activation travelling forward (output of F on one stage, input of F on the next)
    GRAD = "G"  # gradient travelling backward (input grad of B on one stage, output grad on the previous)


Placement = Literal["loop", "v"]


@dataclass(frozen=True, slots=True, order=True)
class Compute:
    """One compute op of one micro-batch on one local model chunk."""

    kind: OpKind
    mb: int
    chunk: int

    def __post_init__(self) -> None:
        if self.mb < 0 or self.chunk < 0:
            raise ValueError(f"negative micro-batch or chunk in {self.kind.value}{self.mb}c{self.chunk}")

    @property
    def key(self) -> tuple[int, int]:
        return (self.mb, self.chunk)

    def __str__(self) -> str:
        return f"{self.kind.value}{self.mb}c{self.chunk}"


# Which pairs may be braided. The paper's authors' schedule uses F&F (warm-up), F&W (warm-up,
# cool-down) and F&B (steady state, with the weight gradient split off -- B -- or not -- BW), a
# forward first; the backward or weight member may act on the other chunk (DualPipeV overlaps the
# forward of one chunk with the backward of the other). BW&BW, two full backwards of different
# micro-batches, is braid's: the cool-down's pairs on the rank that holds the first and the last
# stage (schedules/generators/braided.py, phase 7).
BRAIDABLE: frozenset[tuple[OpKind, OpKind]] = frozenset(
    {(OpKind.F, OpKind.F), (OpKind.F, OpKind.W), (OpKind.F, OpKind.B), (OpKind.F, OpKind.BW), (OpKind.BW, OpKind.BW)}
)


@dataclass(frozen=True, slots=True)
class Braided:
    """Two compute ops of different micro-batches or chunks run as one block at unit granularity.

    The units of ``first`` and ``second`` alternate (see :mod:`braid.core.braiding`), so every
    TP all-reduce of one op is in flight while the other computes. An F&B block on one chunk
    pairs a later forward micro-batch with an earlier backward one (the paper's blocks); a
    *cross-chunk* block (``F7c0&B2c1``, DualPipeV's overlapped pair) may pair any micro-batches.
    The members must not depend on each other (the compiler's validator checks that).
    """

    first: Compute
    second: Compute
    lead: int | None = None  # 0/1: the member whose units start the block; None: braiding.steps' rule
    carry: bool = True  # False: its trailing all-reduce ends inside the block (never carried)

    def __post_init__(self) -> None:
        if self.lead not in (None, 0, 1):
            raise ValueError(f"braided block lead must be None, 0 or 1, got {self.lead!r}")
        pair = (self.first.kind, self.second.kind)
        if pair not in BRAIDABLE:
            raise ValueError(
                f"cannot braid {self.first}&{self.second}: allowed pairs are "
                + ", ".join(f"{a.value}&{b.value}" for a, b in sorted(BRAIDABLE))
            )
        if self.first.key == self.second.key:
            raise ValueError(f"cannot braid {self.first}&{self.second}: both act on the same (mb, chunk)")
        if (self.first.kind is OpKind.F and self.second.kind in (OpKind.B, OpKind.BW) and self.cross_chunk is False
                and self.first.mb <= self.second.mb):
            raise ValueError(
                f"F&B block {self.first}&{self.second} on one chunk: the forward micro-batch must be larger than the "
                "backward one (pair chunks differently for a cross-chunk block)"
            )

    @property
    def cross_chunk(self) -> bool:
        """Whether the two members act on different local chunks."""
        return self.first.chunk != self.second.chunk

    @property
    def ops(self) -> tuple[Compute, Compute]:
        return (self.first, self.second)

    def __str__(self) -> str:
        flags = ("" if self.lead is None else "ab"[self.lead]) + ("" if self.carry else "n")
        return f"{self.first}&{self.second}" + (f"/{flags}" if flags else "")


@dataclass(frozen=True, slots=True)
class Send:
    """Send to ``peer`` the activation produced by F(mb, chunk) or the gradient produced by B(mb, chunk)."""

    comm: CommKind
    mb: int
    chunk: int
    peer: int

    def __str__(self) -> str:
        return f"SEND_{self.comm.value}{self.mb}c{self.chunk}>{self.peer}"


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive from ``peer`` the input activation of F(mb, chunk) or the output gradient of B(mb, chunk)."""

    comm: CommKind
    mb: int
    chunk: int
    peer: int

    def __str__(self) -> str:
        return f"RECV_{self.comm.value}{self.mb}c{self.chunk}<{self.peer}"


@dataclass(frozen=True, slots=True)
class Offload:
    """Copy a fraction of the saved activations of (mb, chunk) to host memory, asynchronously."""

    mb: int
    chunk: int
    frac: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.frac <= 1.0:
            raise ValueError(f"offload fraction must be in (0, 1], got {self.frac}")

    def __str__(self) -> str:
        tail = "" if self.frac == 1.0 else f"@{self.frac:g}"
        return f"OFFLOAD{self.mb}c{self.chunk}{tail}"


@dataclass(frozen=True, slots=True)
class Reload:
    """Copy the offloaded activations of (mb, chunk) back to the device, asynchronously."""

    mb: int
    chunk: int

    def __str__(self) -> str:
        return f"RELOAD{self.mb}c{self.chunk}"


ComputeInstr = Union[Compute, Braided]
Instruction = Union[Compute, Braided, Send, Recv, Offload, Reload]

_COMPUTE_RE = r"(BW|F|B|W)(\d+)c(\d+)"
_RE_COMPUTE = re.compile(rf"^{_COMPUTE_RE}$")
_RE_BRAIDED = re.compile(rf"^{_COMPUTE_RE}&{_COMPUTE_RE}(?:/(?=.)([ab])?(n)?)?$")
_RE_SEND = re.compile(r"^SEND_([AG])(\d+)c(\d+)>(\d+)$")
_RE_RECV = re.compile(r"^RECV_([AG])(\d+)c(\d+)<(\d+)$")
_RE_OFFLOAD = re.compile(r"^OFFLOAD(\d+)c(\d+)(?:@([0-9.eE+-]+))?$")
_RE_RELOAD = re.compile(r"^RELOAD(\d+)c(\d+)$")


def parse_instruction(text: str) -> Instruction:
    """Parse the text form of any instruction (inverse of ``str``)."""
    s = text.strip()
    if m := _RE_COMPUTE.match(s):
        return Compute(OpKind(m[1]), int(m[2]), int(m[3]))
    if m := _RE_BRAIDED.match(s):
        return Braided(Compute(OpKind(m[1]), int(m[2]), int(m[3])), Compute(OpKind(m[4]), int(m[5]), int(m[6])),
                       None if m[7] is None else "ab".index(m[7]), m[8] is None)
    if m := _RE_SEND.match(s):
        return Send(CommKind(m[1]), int(m[2]), int(m[3]), int(m[4]))
    if m := _RE_RECV.match(s):
        return Recv(CommKind(m[1]), int(m[2]), int(m[3]), int(m[4]))
    if m := _RE_OFFLOAD.match(s):
        return Offload(int(m[1]), int(m[2]), float(m[3]) if m[3] else 1.0)
    if m := _RE_RELOAD.match(s):
        return Reload(int(m[1]), int(m[2]))
    raise ValueError(
        f"cannot parse instruction {text!r}: expected e.g. F3c0, B3c1, W3c1, BW3c1, F9c1&B3c1, F9c1&B3c1/bn, "
        "SEND_A3c0>1, RECV_G3c0<1, OFFLOAD3c0@0.5, RELOAD3c0"
    )


def compute_ops(instr: Instruction) -> tuple[Compute, ...]:
    """The compute ops an instruction performs (two for a braided block, none for comm/memory)."""
    if isinstance(instr, Compute):
        return (instr,)
    if isinstance(instr, Braided):
        return instr.ops
    return ()


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    """What a schedule generator is asked for.

    ``p``: pipeline ranks; ``m``: micro-batches per step; ``v``: chunks (virtual stages) per
    rank; ``options``: generator-specific knobs (sorted key/value pairs, e.g. offload alpha).
    """

    p: int
    m: int
    v: int = 1
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        bad = [f"{n}={val}" for n, val in (("p", self.p), ("m", self.m), ("v", self.v)) if not (isinstance(val, int) and val >= 1)]
        if bad:
            raise ValueError(f"ScheduleConfig needs positive integers, got {', '.join(bad)}")

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


@dataclass(frozen=True, slots=True)
class Plan:
    """A schedule: per-rank ordered compute instructions plus the stage placement.

    ``placement`` is ``"loop"`` (rank r holds virtual stages r, r+p, r+2p, ...; Megatron
    interleaving) or ``"v"`` (v=2; rank r holds stages r and 2p-1-r, so rank 0 holds the
    first and the last stage).
    """

    name: str
    config: ScheduleConfig
    placement: Placement
    ranks: tuple[tuple[ComputeInstr, ...], ...]

    def __post_init__(self) -> None:
        if len(self.ranks) != self.config.p:
            raise ValueError(f"plan {self.name!r} has {len(self.ranks)} rank lists for p={self.config.p}")
        if self.placement not in get_args(Placement):  # any other name would silently mean "loop" (stage_of)
            raise ValueError(f"plan {self.name!r}: unknown placement {self.placement!r}; valid: {', '.join(get_args(Placement))}")
        if self.placement == "v" and self.config.v != 2:
            raise ValueError(f"V placement needs v=2 chunks per rank, got v={self.config.v}")

    @property
    def p(self) -> int:
        return self.config.p

    @property
    def m(self) -> int:
        return self.config.m

    @property
    def v(self) -> int:
        return self.config.v

    @property
    def num_stages(self) -> int:
        return self.config.p * self.config.v

    def stage_of(self, rank: int, chunk: int) -> int:
        """Virtual stage held by ``rank`` as its local ``chunk``."""
        return stage_of(self.placement, self.config.p, rank, chunk)

    def rank_chunk_of(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) that holds virtual ``stage``."""
        return rank_chunk_of(self.placement, self.config.p, stage)

    def comm_stages(self, rank: int, instr: "Send | Recv") -> tuple[int, int]:
        """(own stage, peer stage) of a send/receive on ``rank`` (see :func:`comm_stages`)."""
        return comm_stages(self.placement, self.config.p, rank, instr)

    # -- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "braid-plan/1",
            "name": self.name,
            "config": {"p": self.config.p, "m": self.config.m, "v": self.config.v, "options": dict(self.config.options)},
            "placement": self.placement,
            "ranks": [[str(i) for i in ops] for ops in self.ranks],
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Plan":
        if d.get("format") != "braid-plan/1":
            raise ValueError(f"not a braid plan (format={d.get('format')!r}, expected 'braid-plan/1')")
        c = d["config"]
        cfg = ScheduleConfig(c["p"], c["m"], c.get("v", 1), tuple(sorted(c.get("options", {}).items())))
        ranks = []
        for r, ops in enumerate(d["ranks"]):
            parsed = [parse_instruction(t) for t in ops]
            for t, i in zip(ops, parsed):
                if not isinstance(i, (Compute, Braided)):
                    raise ValueError(f"plan rank {r}: {t!r} is not a compute instruction")
            ranks.append(tuple(parsed))  # type: ignore[arg-type]
        return Plan(d["name"], cfg, d["placement"], tuple(ranks))

    @staticmethod
    def from_json(text: str) -> "Plan":
        return Plan.from_dict(json.loads(text))


def stage_of(placement: Placement, p: int, rank: int, chunk: int) -> int:
    if placement == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def comm_stages(placement: Placement, p: int, rank: int, instr: Send | Recv) -> tuple[int, int]:
    """(stage on this side, stage on the peer's side) of a send/receive on ``rank``.

    An activation travels from stage s to s+1, a gradient from s to s-1; a ``Recv`` names
    the local consumer's chunk, a ``Send`` the local producer's. The peer stage may lie
    outside the pipeline for a malformed instruction -- callers check.
    """
    s = stage_of(placement, p, rank, instr.chunk)
    step = 1 if instr.comm is CommKind.ACT else -1
    return s, (s + step if isinstance(instr, Send) else s - step)


def rank_chunk_of(placement: Placement, p: int, stage: int) -> tuple[int, int]:
    if placement == "v":
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return (stage % p, stage // p)


@dataclass(frozen=True, slots=True)
class Program:
    """The compiled instruction list of one pipeline rank."""

    rank: int
    instructions: tuple[Instruction, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __len__(self) -> int:
        return len(self.instructions)

    def __iter__(self):
        return iter(self.instructions)

    def text(self) -> str:
        """One instruction per line; parses back with :meth:`from_text`."""
        return "\n".join(str(i) for i in self.instructions)

    @staticmethod
    def from_text(rank: int, text: str) -> "Program":
        return Program(rank, tuple(parse_instruction(line) for line in text.splitlines() if line.strip()))


def programs_to_json(plan: Plan, programs: Iterable[Program]) -> str:
    """Serialise a compiled plan (its plan header and the per-rank programs) to JSON."""
    d = plan.to_dict()
    d["format"] = "braid-programs/1"
    d["programs"] = [[str(i) for i in prog.instructions] for prog in programs]
    return json.dumps(d)


def programs_from_json(text: str) -> tuple[Plan, list[Program]]:
    d = json.loads(text)
    if d.get("format") != "braid-programs/1":
        raise ValueError(f"not compiled braid programs (format={d.get('format')!r}, expected 'braid-programs/1')")
    plan = Plan.from_dict({**d, "format": "braid-plan/1"})
    progs = [Program(r, tuple(parse_instruction(t) for t in ops)) for r, ops in enumerate(d["programs"])]
    return plan, progs
