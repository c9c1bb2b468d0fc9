"""Per-rank figures shown in the viewer's header, and op-by-op pairing of two traces.

The header states, per rank, the pipeline bubble, the exposed TP communication and the
peak activation memory (the three columns of the paper's Table 1, Sec. 3.3). A trace from
the simulator carries them in ``meta["summary"]``; a measured trace may not, so they are
recomputed from the events: bubble = step time minus the busy time of the compute lane,
exposed TP comm = time the tp-comm lane is busy while the compute lane is idle.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from braid.io.trace import Event, Trace


@dataclass(frozen=True, slots=True)
class RankStats:
    rank: int
    compute_s: float
    pp_bubble_s: float
    tp_exposed_s: float
    peak_bytes: int


@dataclass(frozen=True, slots=True)
class TraceStats:
    step_time_s: float
    ranks: tuple[RankStats, ...]

    @property
    def bubble_rate(self) -> float:
        """Mean over ranks of bubble time / step time (0 for an empty trace)."""
        if not self.ranks or self.step_time_s <= 0:
            return 0.0
        return sum(r.pp_bubble_s for r in self.ranks) / (len(self.ranks) * self.step_time_s)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def computed_stats(trace: Trace) -> TraceStats:
    """Stats recomputed from the events and memory series alone."""
    step = trace.step_time
    lanes: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for e in trace.events:
        lanes[(e.rank, e.lane)].append((e.start, e.end))
    ranks = []
    for r in trace.ranks:
        busy = _union(lanes.get((r, "compute"), []))
        comm = _union(lanes.get((r, "tp-comm"), []))
        compute_s = _length(busy)
        ranks.append(
            RankStats(r, compute_s, max(step - compute_s, 0.0), _length(comm) - _overlap(busy, comm), trace.peak_memory(r))
        )
    return TraceStats(step, tuple(ranks))


def trace_stats(trace: Trace) -> TraceStats:
    """The trace's own summary where it has one, else :func:`computed_stats`.

    Summary fields that are missing for a rank fall back to the computed value.
    """
    computed = computed_stats(trace)
    summary = trace.meta.get("summary")
    if not isinstance(summary, dict):
        return computed
    by_rank = {r.get("rank"): r for r in summary.get("ranks") or [] if isinstance(r, dict)}
    ranks = []
    for c in computed.ranks:
        s = by_rank.get(c.rank, {})
        ranks.append(
            RankStats(
                c.rank,
                float(s.get("compute_s", c.compute_s)),
                float(s.get("pp_bubble_s", c.pp_bubble_s)),
                float(s.get("tp_exposed_s", c.tp_exposed_s)),
                int(s.get("peak_activation_bytes", c.peak_bytes)),
            )
        )
    return TraceStats(float(summary.get("step_time_s", computed.step_time_s)), tuple(ranks))


def _event_key(e: Event) -> tuple:
    return (e.rank, e.lane, e.name, e.op_index, e.unit)


def pair_events(a: Trace, b: Trace) -> dict[int, int]:
    """Match the events of ``a`` to those of ``b`` of the same program, op by op.

    Events match when rank, lane, name, op index and unit agree; repeated keys pair in
    time order. Returns ``{index in a.events: index in b.events}``.
    """
    pending: dict[tuple, list[int]] = defaultdict(list)
    for j in sorted(range(len(b.events)), key=lambda j: b.events[j].start, reverse=True):
        pending[_event_key(b.events[j])].append(j)
    pairs: dict[int, int] = {}
    for i in sorted(range(len(a.events)), key=lambda i: a.events[i].start):
        stack = pending.get(_event_key(a.events[i]))
        if stack:
            pairs[i] = stack.pop()
    return pairs


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
