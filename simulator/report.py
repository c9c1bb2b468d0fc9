"""Per-schedule report of a simulation: step time, throughput, MFU and per-rank breakdown.

Definitions (per rank, seconds):

* ``compute_s`` -- time the compute stream is busy (including the all-reduce slowdown of
  overlapped units, paper Appendix F);
* ``tp_exposed_s`` -- time the compute stream waits on a TP all-reduce (a unit waiting for
  its op's previous all-reduce, or an instruction waiting for its last one);
* ``a2a_exposed_s`` -- time the compute stream waits on an expert-parallel all-to-all (a unit
  waiting for its op's previous dispatch or combine);
* ``pp_bubble_s`` -- everything else up to the step end: ``step_time - compute - tp_exposed -
  a2a_exposed``, i.e. waiting for P2P data, for a reload, or for the rest of the pipeline to finish.

MFU = model FLOPs of the step / (step time * devices * peak FLOP/s), devices = tp * p;
0 when the cost model knows no FLOPs (uniform cost files). Peak activation memory is in
bytes and in units of ``M_a`` (see :mod:`braid.cost.costs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain, compress, islice
from operator import itemgetter, ne
from typing import Any, Sequence

from braid.cost.costs import CostModel
from braid.simulator.engine import RankStats


@dataclass(frozen=True, slots=True)
class RankReport:
    rank: int
    compute_s: float
    tp_exposed_s: float
    pp_bubble_s: float
    peak_activation_bytes: int
    peak_activation_ma: float
    end_s: float
    nominal_compute_s: float
    a2a_exposed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {"rank": self.rank, "compute_s": self.compute_s, "pp_bubble_s": self.pp_bubble_s,
               "tp_exposed_s": self.tp_exposed_s, "peak_activation_bytes": self.peak_activation_bytes,
               "peak_activation_ma": self.peak_activation_ma, "end_s": self.end_s}
        return {**out, "a2a_exposed_s": self.a2a_exposed_s} if self.a2a_exposed_s else out


@dataclass(frozen=True, slots=True)
class Report:
    """What one simulated schedule achieves (see the module doc for the definitions)."""

    schedule: str
    step_time_s: float
    microbatches: int
    throughput_samples_s: float
    throughput_tokens_s: float
    mfu: float
    ranks: tuple[RankReport, ...]

    @property
    def max_bubble_s(self) -> float:
        return max(r.pp_bubble_s for r in self.ranks)

    @property
    def max_tp_exposed_s(self) -> float:
        return max(r.tp_exposed_s for r in self.ranks)

    @property
    def max_a2a_exposed_s(self) -> float:
        return max(r.a2a_exposed_s for r in self.ranks)

    @property
    def worst_peak(self) -> RankReport:
        return max(self.ranks, key=lambda r: r.peak_activation_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "throughput_samples_s": self.throughput_samples_s,
                "throughput_tokens_s": self.throughput_tokens_s, "mfu": self.mfu, "microbatches": self.microbatches,
                "ranks": [r.to_dict() for r in self.ranks]}


def memory_series(deltas: list[tuple[float, float]]) -> list[tuple[float, int]]:
    """Cumulative bytes over time from ``(time, delta)`` pairs; frees before allocations at equal times.

    The series starts at ``(0.0, 0)``; of several deltas at one time only the total after
    the last is kept. The running sum is taken in sorted order, so it is reproducible.
    """
    ordered = sorted(deltas)
    if not ordered:
        return [(0.0, 0)]
    times, changes = zip(*ordered)
    points = zip(times, map(round, accumulate(changes)))
    last_at_time = chain(map(ne, times, islice(times, 1, None)), (True,))  # next delta at a later time
    head: list[tuple[float, int]] = [] if times[0] == 0.0 else [(0.0, 0)]
    return head + list(compress(points, last_at_time))


def rank_report(rank: int, st: RankStats, step_time: float, peak: int, costs: CostModel) -> RankReport:
    """One rank's :class:`RankReport` from the engine's stats (the bubble is what the rest leaves)."""
    waits = st.tp_exposed_s + st.a2a_exposed_s
    return RankReport(rank, st.compute_s, st.tp_exposed_s, max(0.0, step_time - st.compute_s - waits), peak,
                      peak / costs.ma_bytes if costs.ma_bytes else 0.0, st.end_s, st.nominal_compute_s, st.a2a_exposed_s)


def build_report(name: str, stats: Sequence[RankStats], series: dict[int, list[tuple[float, int]]],
                 costs: CostModel, microbatches: int, step_time: float) -> Report:
    """Assemble the :class:`Report` of one run from the engine's per-rank stats."""
    ranks = []
    for r, st in enumerate(stats):
        peak = max(map(itemgetter(1), series[r]), default=0)
        ranks.append(rank_report(r, st, step_time, peak, costs))
    samples = microbatches * costs.samples_per_microbatch
    thr = samples / step_time if step_time > 0 else 0.0
    devices = costs.layout.tp * costs.layout.p
    mfu = 0.0
    if costs.peak_flops > 0 and step_time > 0:
        mfu = samples * costs.model_flops_per_sample / (step_time * devices * costs.peak_flops)
    return Report(name, step_time, microbatches, thr, thr * costs.tokens_per_sample, mfu, tuple(ranks))


def format_table(reports: Sequence[Report], baseline: str = "1f1b_i", order: Sequence[str] | None = None) -> str:
    """A text table sorted by step time (or in ``order``, schedule names): speed-up vs ``baseline``,
    bubble and exposed-TP share (worst rank), peak activation memory of the worst rank in GiB and M_a."""
    base = next((r for r in reports if r.schedule == baseline), None)
    head = (f"{'schedule':<18}{'step (ms)':>11}{'samples/s':>11}{'MFU %':>7}{f'vs {baseline}':>12}"
            f"{'bubble %':>10}{'TP exp %':>10}{'peak GiB':>10}{'peak M_a':>10}")
    lines = [head, "-" * len(head)]
    rank = {name: i for i, name in enumerate(order or ())}
    for r in sorted(reports, key=lambda x: (rank.get(x.schedule, len(rank)), x.step_time_s) if order else x.step_time_s):
        speed = f"{base.step_time_s / r.step_time_s:.3f}x" if base else "-"
        peak = r.worst_peak
        mfu = f"{r.mfu * 100:>7.1f}" if r.mfu > 0 else f"{'-':>7}"  # 0: the costs give no peak FLOP/s (a CPU profile)
        lines.append(f"{r.schedule:<18}{r.step_time_s * 1e3:>11.2f}{r.throughput_samples_s:>11.2f}{mfu}"
                     f"{speed:>12}{100 * r.max_bubble_s / r.step_time_s:>10.1f}{100 * r.max_tp_exposed_s / r.step_time_s:>10.1f}"
                     f"{peak.peak_activation_bytes / 2**30:>10.2f}{peak.peak_activation_ma:>10.2f}")
    return "\n".join(lines)
