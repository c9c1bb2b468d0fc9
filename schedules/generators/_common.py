"""Small helpers shared by the generator modules: input checks and per-rank op builders.

Every generator is a pure function ``ScheduleConfig -> Plan``; these helpers keep the
bookkeeping (micro-batch counters, the deferred weight-gradient queue, validation messages)
out of the phase logic so each generator reads as its phases with closed-form counts.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from braid.core.ir import Braided, Compute, ComputeInstr, OpKind, Placement, Plan, ScheduleConfig


def check_chunks(name: str, cfg: ScheduleConfig, v: int) -> None:
    """Raise ``ValueError`` unless the config asks for exactly ``v`` chunks per rank."""
    if cfg.v != v:
        raise ValueError(f"{name} uses v={v} chunks per rank (got v={cfg.v}); drop the v argument or pass v={v}")


BRAID_VALUES = ("all", "none", "auto")


def braids(name: str, cfg: ScheduleConfig) -> bool:
    """The ``braid`` knob: ``"all"`` (default) emits the schedule's braided blocks, ``"none"`` runs
    each block's members one after the other (forward first: the schedule's order without
    blocks). ``"auto"`` needs a cost model (:func:`braid.planner.braid_tune.tune_braiding` chooses
    block by block; ``python -m braid.simulate`` does)."""
    mode = cfg.option("braid", "all")
    if mode == "auto":
        raise ValueError(f"{name}: braid='auto' needs a cost model; build the plan with braid='all' and choose its blocks "
                         "with braid.planner.braid_tune.tune_braiding (python -m braid.simulate does this)")
    if mode not in BRAID_VALUES:
        raise ValueError(f"{name}: braid must be one of {', '.join(BRAID_VALUES)}, got {mode!r}")
    return mode == "all"


def make_plan(name: str, cfg: ScheduleConfig, placement: Placement, ranks: Iterable[Iterable[ComputeInstr]]) -> Plan:
    return Plan(name, cfg, placement, tuple(tuple(ops) for ops in ranks))


class RankBuilder:
    """Hands out the next micro-batch index per (op kind, chunk) for one rank.

    Generators ask for "the next forward of chunk c" instead of tracking indices by hand;
    backwards with the weight gradient split off (``B``) queue their ``W`` so that a later
    :meth:`w` emits the oldest deferred weight gradient (zero-bubble's FIFO order).
    """

    def __init__(self, m: int, v: int, braided: bool = True) -> None:
        self.m = m
        self.braided = braided  # False: :meth:`braid` emits its two ops one after the other
        self.fwd = [0] * v
        self.bwd = [0] * v
        self.pending_w: deque[Compute] = deque()
        self.ops: list[ComputeInstr] = []

    # -- availability ----------------------------------------------------------------
    def has_f(self, chunk: int) -> bool:
        return self.fwd[chunk] < self.m

    def has_b(self, chunk: int) -> bool:
        return self.bwd[chunk] < self.m

    # -- op factories (they advance the counters but do not append) --------------------
    def next_f(self, chunk: int) -> Compute:
        op = Compute(OpKind.F, self.fwd[chunk], chunk)
        self.fwd[chunk] += 1
        return op

    def next_b(self, chunk: int, split: bool) -> Compute:
        """The next backward of ``chunk``: ``B`` (weight gradient queued) if ``split`` else ``BW``."""
        mb = self.bwd[chunk]
        self.bwd[chunk] += 1
        if split:
            self.pending_w.append(Compute(OpKind.W, mb, chunk))
            return Compute(OpKind.B, mb, chunk)
        return Compute(OpKind.BW, mb, chunk)

    def next_w(self, chunk: int | None = None) -> Compute:
        """The oldest deferred weight gradient (of ``chunk``, if given)."""
        for i, w in enumerate(self.pending_w):
            if chunk is None or w.chunk == chunk:
                del self.pending_w[i]
                return w
        raise ValueError(f"no deferred weight gradient{'' if chunk is None else f' of chunk {chunk}'} to run")

    # -- emitters ----------------------------------------------------------------------
    def f(self, chunk: int) -> None:
        self.ops.append(self.next_f(chunk))

    def b(self, chunk: int, split: bool = False) -> None:
        self.ops.append(self.next_b(chunk, split))

    def w(self, chunk: int | None = None) -> None:
        self.ops.append(self.next_w(chunk))

    def braid(self, first: Compute, second: Compute) -> None:
        self.ops += [Braided(first, second)] if self.braided else [first, second]
