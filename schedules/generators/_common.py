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


def make_plan(name: str, cfg: ScheduleConfig, placement: Placement, ranks: Iterable[Iterable[ComputeInstr]]) -> Plan:
    return Plan(name, cfg, placement, tuple(tuple(ops) for ops in ranks))


class RankBuilder:
    """Hands out the next micro-batch index per (op kind, chunk) for one rank.

    Generators ask for "the next forward of chunk c" instead of tracking indices by hand;
    backwards with the weight gradient split off (``B``) queue their ``W`` so that a later
    :meth:`w` emits the oldest deferred weight gradient (zero-bubble's FIFO order).
    """

    def __init__(self, m: int, v: int) -> None:
        self.m = m
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
        self.ops.append(Braided(first, second))
