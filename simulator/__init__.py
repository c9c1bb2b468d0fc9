"""Discrete-event simulator of compiled per-rank programs (the second interpreter of the IR).

``simulate(programs, costs)`` runs the programs the compiler produced against a
:class:`braid.cost.costs.CostModel` and returns a :class:`SimResult`: a
:class:`braid.io.trace.Trace` at unit granularity (the format the executor records, so a
prediction and a measurement line up op by op) and a :class:`~braid.simulator.report.Report`
(step time, throughput, MFU, per-rank PP bubble, exposed TP comm and peak activations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from braid.cost.costs import CostModel
from braid.cost.moe_costs import priced_imbalance
from braid.core.ir import Program, compute_ops
from braid.io.trace import Trace
from braid.simulator.engine import Engine, SimulationError
from braid.simulator.report import Report, build_report, format_table, memory_series

__all__ = ["SimResult", "SimulationError", "Report", "simulate", "format_table"]


@dataclass(frozen=True, slots=True)
class SimResult:
    trace: Trace
    report: Report


def simulate(programs: Sequence[Program], costs: CostModel, *, name: str = "schedule", record: bool = True,
             meta: dict[str, Any] | None = None) -> SimResult:
    """Simulate one step of compiled ``programs`` on ``costs`` (built for the schedule's layout).

    ``record=False`` skips the per-unit trace events (the report and memory series stay).
    Raises :class:`SimulationError` (a ``ValueError``) listing each rank's stuck instruction
    when the programs deadlock or do not match each other.
    """
    eng = Engine(list(programs), costs, record=record)
    stats = eng.run()
    series = {r: memory_series(st.mem) for r, st in enumerate(stats)}
    step = max((st.end_s for st in stats), default=0.0)
    mbs = {op.mb for prog in programs for ins in prog.instructions for op in compute_ops(ins)}
    report = build_report(name, stats, series, costs, len(mbs), step)
    lay = costs.layout
    imbalance = priced_imbalance(costs)
    trace_meta = {"schedule": name, "source": "simulated", "p": lay.p, "v": lay.v, "tp": lay.tp,
                  "placement": lay.placement, "m": len(mbs), "costs": costs.source, "ma_bytes": costs.ma_bytes,
                  **({"moe_imbalance": imbalance} if imbalance is not None else {}),
                  "summary": report.to_dict(), **(meta or {})}
    return SimResult(Trace(trace_meta, eng.events, series), report)
