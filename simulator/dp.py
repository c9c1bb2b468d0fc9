"""The data-parallel tail of a simulated step: gradient reduction, optimizer step, weight all-gather.

After (and beside) the pipeline, every rank reduces each chunk's gradients over its
data-parallel (x context-parallel) group as soon as the chunk's last weight gradient is
done (the ``grad_ready`` times of :mod:`simulator.fast`), one chunk after another on its own
lane (``dp-comm``) while the cool-down computes. The optimizer step needs the global
gradient norm (clipping): it starts once every rank's pipeline and reductions are done, runs
the update on the compute lane, and under ZeRO-1 all-gathers the updated weights on the
``dp-comm`` lane. What each costs comes from :class:`braid.cost.cluster.DpCosts` (the job cost model prices it:
:func:`braid.cost.cluster.dp_costs`, by the optimizer mode's bytes of :mod:`braid.cost.optimizer_modes`).

The planner (:mod:`braid.planner.search`) and ``python -m braid.simulate --dp N --optimizer MODE``
both take the tail from :func:`dp_tail`, with the trace events it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence  # noqa: F401

from braid.cost.cluster import DpCosts
from braid.io.trace import Event


@dataclass(frozen=True, slots=True)
class DpTail:
    """The tail of one simulated step (per rank unless said): ``reduce_exposed_s``: reduction
    beyond the rank's pipeline end; ``optimizer_s``: update + all-gather; ``step_s``: the step
    with the tail (all ranks); ``events``: trace events (``dp-comm`` and compute lanes)."""

    reduce_exposed_s: list[float]
    optimizer_s: list[float]
    step_s: float
    events: list[Event] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"reduce_exposed_s": self.reduce_exposed_s, "optimizer_s": self.optimizer_s, "step_s": self.step_s}


def dp_tail(end_s: Sequence[float], grad_ready: Mapping[tuple[int, int], float], dc: DpCosts, *,
            chunks: int, record: bool = False) -> DpTail:
    """Schedule the tail after a pipeline whose ranks end at ``end_s`` (module doc); ``chunks``: per rank."""
    events: list[Event] = []
    exposed, done = [], []
    for r, end in enumerate(end_s):
        free = 0.0
        for c in sorted(range(chunks), key=lambda c: grad_ready.get((r, c), 0.0)):
            start = max(free, grad_ready.get((r, c), 0.0))
            free = start + dc.reduce_s.get((r, c), 0.0)
            if record and free > start:
                events.append(Event(r, "dp-comm", f"{dc.reduce_kind}c{c}", dc.reduce_kind, start, free - start, chunk=c))
        exposed.append(max(0.0, free - end))
        done.append(max(end, free))
    begin = max(done, default=0.0)  # the global norm: every rank's gradients are reduced
    opts = [s + g for s, g in zip(dc.step_s, dc.gather_s)]
    if record:
        for r, (s, g) in enumerate(zip(dc.step_s, dc.gather_s)):
            events.append(Event(r, "compute", "OPT", "OPT", begin, s))
            if g:
                events.append(Event(r, "dp-comm", "AG", "AG", begin + s, g))
    return DpTail(exposed, opts, begin + max(opts, default=0.0), events)


def grad_ready_of(events: Sequence[Event]) -> dict[tuple[int, int], float]:
    """When each (rank, chunk)'s weight gradients are complete in a recorded trace: its last W unit's end."""
    out: dict[tuple[int, int], float] = {}
    for e in events:
        if e.kind == "W" and e.chunk is not None:
            out[(e.rank, e.chunk)] = max(out.get((e.rank, e.chunk), 0.0), e.end)
    return out


def format_dp_table(rows: Sequence[tuple[str, Any, DpTail, DpCosts]]) -> str:
    """One line per schedule (name, report, tail, costs): pipeline step, the tail, the step with it,
    and memory per GPU (weights + gradients + optimizer state, plus the larger of the worst rank's
    activations and the optimizer step's temporaries: :meth:`braid.cost.cluster.DpCosts.peak_bytes`)."""
    head = (f"{'schedule':<18}{'pipeline ms':>12}{'reduce exp ms':>14}{'optimizer ms':>13}{'step ms':>10}"
            f"{'state GiB':>10}{'peak GiB':>10}")
    lines = [head, "-" * len(head)]
    for name, rep, tail, dc in sorted(rows, key=lambda row: row[2].step_s):
        peak = max(dc.peak_bytes(r.rank, r.peak_activation_bytes) for r in rep.ranks)
        lines.append(f"{name:<18}{rep.step_time_s * 1e3:>12.2f}{max(tail.reduce_exposed_s) * 1e3:>14.2f}"
                     f"{max(tail.optimizer_s) * 1e3:>13.2f}{tail.step_s * 1e3:>10.2f}"
                     f"{max(dc.static_bytes) / 2**30:>10.2f}{peak / 2**30:>10.2f}")
    return "\n".join(lines)
