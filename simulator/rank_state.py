"""What the simulator keeps per rank while it runs (:mod:`braid.simulator.engine`), and its error."""

from __future__ import annotations

from dataclasses import dataclass, field

from braid.core.ir import Instruction


class SimulationError(ValueError):
    """A program that cannot run: deadlock, unmatched or misrouted P2P, reload without offload."""



@dataclass(slots=True)
class RankStats:
    """What one rank did: busy compute, exposed TP and all-to-all waits, end time, memory deltas."""

    compute_s: float = 0.0
    nominal_compute_s: float = 0.0
    tp_exposed_s: float = 0.0
    a2a_exposed_s: float = 0.0
    end_s: float = 0.0
    mem: list[tuple[float, float]] = field(default_factory=list)


@dataclass(slots=True)
class _Rank:
    rank: int
    prog: tuple[Instruction, ...]
    pc: int = 0
    t: float = 0.0
    host: float = 0.0  # host lane: when the host has issued the rank's last unit task
    posting: bool = False  # parked in the heap until its comm run's post time
    expected: set = field(default_factory=set)  # (comm, mb, chunk) of receives posted, not yet consumed
    arrived: dict = field(default_factory=dict)  # (comm, mb, chunk) -> transfer end
    blocked_on: tuple | None = None  # the receive a compute instruction waits for
    sends_end: float = 0.0
    p2p_free: float = 0.0
    p2p_busy: list[tuple[float, float]] = field(default_factory=list)
    d2h_free: float = 0.0
    h2d_free: float = 0.0
    d2h_busy: list[tuple[float, float]] = field(default_factory=list)
    h2d_busy: list[tuple[float, float]] = field(default_factory=list)
    resident: dict[tuple[int, int], float] = field(default_factory=dict)
    offloaded: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # key -> (bytes, d2h end)
    reload_end: dict[tuple[int, int], float] = field(default_factory=dict)
    releasing: list[list[float]] = field(default_factory=list)  # [compute instrs left, copy end, bytes] per offload
    # Memory deltas (time, bytes) as two float lists during the run; paired into stats.mem after it.
    mem_t: list[float] = field(default_factory=list)
    mem_d: list[float] = field(default_factory=list)
    stats: RankStats = field(default_factory=RankStats)
    carries: dict = field(default_factory=dict)  # instruction index -> braiding.Carry
    hoist: tuple | None = None  # (next compute index, carried all-reduce end) until its first task ran
    chained: float | None = None  # a chained Send/Recv run is posted as of this time (its all-reduce's end)
    resume: dict = field(default_factory=dict)  # compute index -> row state after its hoisted first task
    codes: list = field(default_factory=list)  # instruction index -> _COMPUTE, _OFFLOAD, _RELOAD or _COMM
    copies: bool = False  # the program has OFFLOAD/RELOAD: per-(mb, chunk) bytes and reload waits are tracked
    watch: dict = field(default_factory=dict)  # instruction index -> its end time (indices chosen by the caller)
