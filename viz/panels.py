"""What the timeline shows, independent of Plotly: panels, rows and block groups.

A *panel* is what one dropdown entry of the viewer shows: one trace, or a simulated and a
measured trace of the same schedule laid side by side rank by rank ("r0 predicted" above
"r0 measured"), so a prediction and a measurement of one program can be compared op by op
(the design's "one IR, two interpreters"). Rows: per rank a group, per lane a row (compute,
TP comm, P2P, host copies). Blocks are grouped by kind x chunk -- one Plotly trace each --
and coloured as in the paper's schedule figures (Sec. 3, Fig. 4-6); braided blocks
(``block`` text such as ``F9c1&B3c1``) also get one outline each spanning both halves.
A panel of a mixture-of-experts run also carries the expert load its traces hold (the
measured routing counts, ``meta.expert_load``, and the imbalance a simulation priced,
``meta.moe_imbalance``), which :mod:`viz.experts` draws beside the timeline.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from braid.io.trace import KINDS, LANES, ExpertLoad, Trace
from braid.viz.colors import BLOCK_OUTLINE, COMPUTE_SHADES, block_color
from braid.viz.stats import TraceStats, format_bytes, pair_events, trace_stats

LANE_LABELS = {"compute": "compute", "tp-comm": "TP comm", "ep-comm": "EP comm", "p2p": "P2P", "copy": "copy", "dp-comm": "DP comm"}
# customdata columns of every block trace: name, mb, chunk, unit, start, end, dur, op, block, note
HOVER_TEMPLATE = (
    "<b>%{customdata[0]}</b> · micro-batch %{customdata[1]} · chunk %{customdata[2]}"
    "<br>unit %{customdata[3]}"
    "<br>start %{customdata[4]:.3f} ms · end %{customdata[5]:.3f} ms"
    "<br>duration %{customdata[6]:.3f} ms"
    "<br>op #%{customdata[7]} · block %{customdata[8]}"
    "<br>%{customdata[9]}<extra>%{fullData.name}</extra>"
)


@dataclass(frozen=True, slots=True)
class Row:
    rank: int
    lane: str
    series: str  # "" for a lone trace, else "predicted" / "measured"

    @property
    def label(self) -> str:
        return " ".join(x for x in (f"r{self.rank}", self.series, LANE_LABELS[self.lane]) if x)


@dataclass(slots=True)
class Panel:
    """What one dropdown entry shows: one trace, or a predicted/measured pair."""

    name: str
    traces: tuple[Trace, ...]
    series: tuple[str, ...]
    rows: list[Row] = field(default_factory=list)
    stats: tuple[TraceStats, ...] = ()
    expert_load: ExpertLoad | None = None  # the routing counts of its measured trace (else of any that has them)
    load_source: str = ""  # the source of the trace they came from
    priced_imbalance: float | None = None  # the busiest EP rank's rows over the mean its simulation priced

    @property
    def num_events(self) -> int:
        return sum(len(t.events) for t in self.traces)


@dataclass(slots=True)
class Group:
    """Blocks of one kind x chunk in one panel: becomes one Plotly trace."""

    name: str
    color: str
    start: list[float] = field(default_factory=list)  # ms, microsecond precision
    dur: list[float] = field(default_factory=list)
    row: list[int] = field(default_factory=list)
    mb: list[int] = field(default_factory=list)  # -1: none
    chunk: list[int] = field(default_factory=list)
    op: list[int] = field(default_factory=list)
    text: list[list[str]] = field(default_factory=list)  # [name, unit, block, note]

    def customdata(self, i: int) -> list[Any]:
        name, unit, block, note = self.text[i]
        end = round(self.start[i] + self.dur[i], 3)
        return [name, _opt(self.mb[i]), _opt(self.chunk[i]), unit, self.start[i], end, self.dur[i], _opt(self.op[i]),
                block, note]  # fmt: skip


def _opt(v: int) -> int | str:
    return "-" if v < 0 else v


def _ms(seconds: float) -> float:
    return round(seconds * 1e6) / 1e3


def make_panels(traces: Sequence[Trace]) -> list[Panel]:
    """Group traces into panels; a simulated trace pairs with the next measured one of its schedule."""
    if not traces:
        raise ValueError("nothing to draw: pass at least one trace")
    used: set[int] = set()
    panels: list[Panel] = []
    for i, t in enumerate(traces):
        if i in used:
            continue
        used.add(i)
        sched = str(t.meta.get("schedule", f"trace {i}"))
        partner = None
        if t.meta.get("source") == "simulated":
            partner = next(
                (j for j in range(i + 1, len(traces)) if j not in used and traces[j].meta.get("source") == "measured"
                 and traces[j].meta.get("schedule") == t.meta.get("schedule")), None)  # fmt: skip
        if partner is not None:
            used.add(partner)
            panels.append(Panel(f"{sched}: predicted vs measured", (t, traces[partner]), ("predicted", "measured")))
        else:
            panels.append(Panel(f"{sched} ({t.meta.get('source', 'trace')})", (t,), ("",)))
    seen: dict[str, int] = defaultdict(int)
    for p in panels:
        seen[p.name] += 1
        if seen[p.name] > 1:
            p.name = f"{p.name} #{seen[p.name]}"
    for p in panels:
        lanes = [l for l in LANES if any(e.lane == l for t in p.traces for e in t.events)] or ["compute"]
        ranks = sorted(set().union(*(t.ranks for t in p.traces))) or [0]
        p.rows = [Row(r, lane, s) for r in ranks for s in p.series for lane in lanes]
        p.stats = tuple(trace_stats(t) for t in p.traces)
        carrier = next((t for t in sorted(p.traces, key=lambda t: t.meta.get("source") != "measured")
                        if t.expert_load is not None), None)
        if carrier is not None:
            p.expert_load, p.load_source = carrier.expert_load, str(carrier.meta.get("source", "trace"))
        p.priced_imbalance = next((float(t.meta["moe_imbalance"]) for t in p.traces
                                   if t.meta.get("moe_imbalance") is not None), None)
    return panels


def panel_groups(panel: Panel) -> tuple[list[Group], Group]:
    """Blocks of a panel grouped by kind x chunk, plus the braided-block outlines."""
    row_of = {(r.rank, r.series, r.lane): i for i, r in enumerate(panel.rows)}
    chunks = [e.chunk for t in panel.traces for e in t.events if e.kind in COMPUTE_SHADES and e.chunk is not None]
    num_chunks = max(chunks, default=0) + 1
    other: list[dict[int, float]] = [{}, {}]
    if len(panel.traces) == 2:
        a, b = panel.traces
        pairs = pair_events(a, b)
        other[0] = {i: b.events[j].dur for i, j in pairs.items()}
        other[1] = {j: a.events[i].dur for i, j in pairs.items()}
    groups: dict[tuple[int, int], Group] = {}
    outline = Group("braided block", BLOCK_OUTLINE)
    for ti, (trace, series) in enumerate(zip(panel.traces, panel.series)):
        spans: dict[tuple[int, str], list[float]] = {}
        for ei, e in enumerate(trace.events):
            compute = e.kind in COMPUTE_SHADES
            key = (KINDS.index(e.kind), e.chunk if compute and e.chunk is not None else -1)
            g = groups.get(key)
            if g is None:
                label = f"{e.kind} chunk {key[1]}" if key[1] >= 0 else e.kind
                g = groups[key] = Group(label, block_color(e.kind, key[1] if key[1] >= 0 else None, num_chunks))
            start, dur = _ms(e.start), _ms(e.dur)
            row = row_of[(e.rank, series, e.lane)]
            g.start.append(start)
            g.dur.append(dur)
            g.row.append(row)
            g.mb.append(-1 if e.mb is None else e.mb)
            g.chunk.append(-1 if e.chunk is None else e.chunk)
            g.op.append(-1 if e.op_index is None else e.op_index)
            note = ""
            if e.peer is not None:
                note = f"{'to' if e.kind == 'SEND' else 'from' if e.kind == 'RECV' else 'peer'} rank {e.peer}"
            if ei in other[ti]:
                pred, meas = (dur, _ms(other[ti][ei])) if ti == 0 else (_ms(other[ti][ei]), dur)
                note = f"{note} · " if note else ""
                note += f"predicted {pred:.3f} ms · measured {meas:.3f} ms"
            g.text.append([e.name, e.unit or "-", e.block or "-", note])
            if e.block and e.lane == "compute":
                span = spans.setdefault((e.rank, e.block), [e.start, e.end, row])
                span[0], span[1] = min(span[0], e.start), max(span[1], e.end)
        for (_, block), (s, end, row) in spans.items():
            outline.start.append(_ms(s))
            outline.dur.append(round(_ms(end) - _ms(s), 3))
            outline.row.append(int(row))
            outline.text.append([block, "-", block, ""])
    return [groups[k] for k in sorted(groups)], outline


def header_text(panel: Panel, title: str | None) -> tuple[str, str, int]:
    """Title, header text (per-trace totals, then per-rank figures) and its number of lines."""
    head = f"<b>{title or panel.name}</b>"
    parts = []
    lines = []
    for trace, series, st in zip(panel.traces, panel.series, panel.stats):
        tag = f"{series}: " if series else ""
        parts.append(
            f"{tag}step {st.step_time_s * 1e3:.3f} ms · bubble {st.bubble_rate * 100:.1f}% (mean over ranks) · exposed TP comm "
            f"{sum(r.tp_exposed_s for r in st.ranks) * 1e3:.3f} ms (all ranks) · peak "
            f"{format_bytes(max((r.peak_bytes for r in st.ranks), default=0))}"
        )
        priced = trace.meta.get("moe_imbalance")
        if priced is not None and panel.expert_load is None:  # else beside the timeline, with the counts
            parts[-1] += f" · MoE imbalance priced {priced:.3f} (busiest EP rank / mean)"
        cells = [
            f"r{r.rank}: bubble {r.pp_bubble_s / st.step_time_s * 100 if st.step_time_s else 0:.1f}%, "
            f"TP {r.tp_exposed_s * 1e3:.3f} ms, peak {format_bytes(r.peak_bytes)}"
            for r in st.ranks
        ]
        for k in range(0, len(cells), 4):
            lines.append(tag + "  |  ".join(cells[k : k + 4]))
    return head, "<br>".join(parts + lines), len(lines) + len(parts)


