"""Build the Plotly timeline figure of one or more traces (the viewer's core).

The upper subplot holds the blocks (rows from :mod:`viz.panels`), the lower one each rank's
memory over the same time axis with its peak starred; a range slider sits under the time
axis and the header states step time, bubble rate, exposed TP comm and peak memory per rank
(the quantities of the paper's Table 1, Sec. 3.3). Idle time is the white background. A
mixture-of-experts run's expert load, where its trace carries one, is a column on the right
(:mod:`viz.experts`).

Up to ``webgl_threshold`` events a panel draws horizontal ``go.Bar`` blocks (``base`` =
start, ``x`` = duration; micro-batch labels appear inside bars once zoomed in far enough).
Beyond it, ``go.Scattergl`` thick line segments, one trace per kind x chunk, so a p=8, m=64
unit-level trace (~100k events) stays smooth to zoom. With ``compact=True`` the WebGL
traces are shipped as small typed columns (:class:`Payload`) that a few lines of JavaScript
in the page expand before plotting, which keeps the HTML data part small; without it the
figure is complete on its own (for notebooks and tests).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from braid.io.trace import Trace
from braid.viz.colors import rank_color
from braid.viz.experts import MIN_PX as LOAD_MIN_PX, domains as load_axes, load_traces
from braid.viz.panels import HOVER_TEMPLATE, Group, Panel, header_text, make_panels, panel_groups
from braid.viz.stats import format_bytes

WEBGL_THRESHOLD = 4000
BRACKET_OFFSET = -0.44  # WebGL path: a braided block's bracket, in rows above the compute row
MEMORY_PX = 200


class PlotlyMissingError(ImportError):
    """Raised when the viewer is used without plotly installed."""


def require_plotly() -> Any:
    """Import plotly.graph_objects, or explain how to get it."""
    try:
        import plotly.graph_objects as go
    except ImportError:
        raise PlotlyMissingError("the timeline viewer needs plotly: pip install plotly") from None
    return go




def _memory_steps(series: list[tuple[float, int]], scale: float) -> tuple[np.ndarray, np.ndarray]:
    """A memory series as compact step-plot arrays: ms (float32 below 16 s), consecutive repeats dropped."""
    t = np.round(np.array([x for x, _ in series], dtype=np.float64) * 1e3, 3)
    b = np.array([v for _, v in series], dtype=np.float64) / scale
    keep = np.ones(len(b), dtype=bool)
    keep[1:] = b[1:] != b[:-1]
    keep[-1] = True  # the series still ends where it ends
    t, b = t[keep], b[keep]
    return (t.astype(np.float32) if t.size and np.abs(t).max() < 16_000 else t), b.astype(np.float32)


def _memory_traces(go: Any, panel: Panel) -> tuple[list[Any], str]:
    peak = max((b for t in panel.traces for s in t.memory.values() for _, b in s), default=0)
    unit, scale = ("GiB", 1 << 30) if peak >= 1 << 30 else ("MiB", 1 << 20)
    out = []
    px, py, pc, pt = [], [], [], []
    for trace, series in zip(panel.traces, panel.series):
        for rank, s in sorted(trace.memory.items()):
            if not s:
                continue
            t, b = _memory_steps(s, scale)
            name = " ".join(x for x in (f"r{rank}", series, "memory") if x)
            out.append(go.Scatter(x=t, y=b, mode="lines", line_shape="hv", name=name,
                                  line=dict(color=rank_color(rank), width=1.5, dash="dot" if series == "measured" else None),
                                  legendgroup="memory", legendgrouptitle_text="memory", xaxis="x2", yaxis="y2",
                                  hovertemplate=f"{name}<br>%{{x:.3f}} ms: %{{y:.3f}} {unit}<extra></extra>"))  # fmt: skip
            k = max(range(len(s)), key=lambda i: s[i][1])  # the first time the peak is reached
            px.append(round(s[k][0] * 1e3, 3))
            py.append(s[k][1] / scale)
            pc.append(rank_color(rank))
            pt.append(f"{name.replace(' memory', '')} peak {format_bytes(s[k][1])} at {px[-1]:.3f} ms")
    if px:
        out.append(go.Scatter(x=px, y=py, mode="markers", name="peak memory", legendgroup="memory",
                              marker=dict(symbol="star", size=12, color=pc, line=dict(color="black", width=1)),
                              hovertext=pt, hovertemplate="%{hovertext}<extra></extra>", xaxis="x2", yaxis="y2"))  # fmt: skip
    return out, unit


@dataclass(slots=True)
class Payload:
    """Compact columns of the WebGL traces, expanded in the page (see :mod:`viz.html`).

    ``groups[i]`` = {"trace": index in fig.data, "dy": row offset, "hover": bool,
    "cols": {column: spec}}; a spec is a typed array (Plotly's ``{"dtype", "bdata"}``) or
    ``{"const": v, "n": n}``; the string columns index ``strings[column]``.
    """

    strings: dict[str, list[str]] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)
    _index: dict[tuple[str, str], int] = field(default_factory=dict)

    def intern(self, column: str, s: str) -> int:
        i = self._index.get((column, s))
        if i is None:
            table = self.strings.setdefault(column, [])
            i = self._index[(column, s)] = len(table)
            table.append(s)
        return i

    def to_dict(self) -> dict[str, Any]:
        return {"strings": self.strings, "groups": self.groups}


_INT_DTYPES = ("u1", "i1", "u2", "i2", "u4", "i4")
STRING_COLUMNS = ("name", "unit", "block", "note")


def encode_column(values: Sequence[float] | Sequence[int], *, floating: bool) -> dict[str, Any]:
    """The smallest spec that holds the values: a constant, or a typed array of the narrowest dtype.

    Floats are times in ms rounded to microseconds: float32 keeps that precision below
    16 s, float64 beyond.
    """
    arr = np.asarray(values, dtype=np.float64 if floating else np.int64)
    if arr.size and (arr == arr[0]).all():
        return {"const": arr[0].item(), "n": int(arr.size)}
    if floating:
        dtype = "f4" if arr.size == 0 or np.abs(arr).max() < 16_000 else "f8"
    else:
        lo, hi = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
        dtype = next(d for d in _INT_DTYPES if np.iinfo(d).min <= lo and hi <= np.iinfo(d).max)
    return {"dtype": dtype, "bdata": base64.b64encode(arr.astype("<" + dtype).tobytes()).decode("ascii")}


def _compact_group(payload: Payload, trace_index: int, g: Group, *, hover: bool, dy: float) -> None:
    cols = {"start": encode_column(g.start, floating=True), "dur": encode_column(g.dur, floating=True),
            "row": encode_column(g.row, floating=False)}  # fmt: skip
    if hover:
        cols |= {c: encode_column(getattr(g, c), floating=False) for c in ("mb", "chunk", "op")}
        for k, c in enumerate(STRING_COLUMNS):
            cols[c] = encode_column([payload.intern(c, t[k]) for t in g.text], floating=False)
    payload.groups.append({"trace": trace_index, "dy": dy, "hover": hover, "cols": cols})


def _segments(g: Group, dy: float) -> tuple[np.ndarray, np.ndarray]:
    """x/y of NaN-separated line segments, one (start, end, gap) triple per block."""
    n = len(g.start)
    x = np.full(3 * n, np.nan)
    y = np.full(3 * n, np.nan)
    start = np.asarray(g.start)
    x[0::3] = start
    x[1::3] = np.round(start + np.asarray(g.dur), 3)
    y[0::3] = y[1::3] = np.asarray(g.row, dtype=np.float64) + dy
    return x, y


def _block_traces(go: Any, groups: list[Group], outline: Group, *, gl: bool, compact: bool, line_px: float,
                  payload: Payload, first_index: int, visible: bool) -> list[Any]:  # fmt: skip
    """One trace per group (plus the braided-block outlines, drawn first so blocks cover them)."""
    out: list[Any] = []
    common = dict(xaxis="x", yaxis="y", visible=visible)
    if outline.start:
        if not gl:
            out.append(go.Bar(name=outline.name, base=outline.start, x=outline.dur, y=outline.row, orientation="h",
                              width=0.96, marker=dict(color="rgba(0,0,0,0)", line=dict(color=outline.color, width=1.2)),
                              hoverinfo="skip", **common))  # fmt: skip
        else:
            tr = go.Scattergl(name=outline.name, mode="lines", line=dict(color=outline.color, width=2),
                              hoverinfo="skip", connectgaps=False, **common)  # fmt: skip
            if compact:
                _compact_group(payload, first_index + len(out), outline, hover=False, dy=BRACKET_OFFSET)
            else:
                tr.x, tr.y = _segments(outline, BRACKET_OFFSET)
            out.append(tr)
    for g in groups:
        if not gl:
            out.append(go.Bar(name=g.name, legendgroup=g.name, base=g.start, x=g.dur, y=g.row, orientation="h",
                              width=0.8, marker=dict(color=g.color, line=dict(width=0)),
                              text=[str(mb) if mb >= 0 else "" for mb in g.mb], textposition="inside",
                              insidetextanchor="middle", textangle=0,
                              customdata=[g.customdata(i) for i in range(len(g.start))],
                              hovertemplate=HOVER_TEMPLATE, **common))  # fmt: skip
            continue
        tr = go.Scattergl(name=g.name, legendgroup=g.name, mode="lines", line=dict(color=g.color, width=line_px),
                          connectgaps=False, hovertemplate=HOVER_TEMPLATE, **common)  # fmt: skip
        if compact:
            _compact_group(payload, first_index + len(out), g, hover=True, dy=0.0)
        else:
            tr.x, tr.y = _segments(g, 0.0)
            tr.customdata = [c for i in range(len(g.start)) for c in [g.customdata(i)] * 3]
        out.append(tr)
    return out


def _panel_layout(panel: Panel, title: str | None, mem_unit: str) -> tuple[dict[str, Any], int]:
    """Layout properties that differ between panels (dotted paths, as relayout takes them)."""
    head, per_rank, lines = header_text(panel, title)
    n = len(panel.rows)
    shapes = []
    group = len(panel.series) * len({r.lane for r in panel.rows})
    for g0 in range(0, n, group):
        if (g0 // group) % 2:
            shapes.append(dict(type="rect", xref="x domain", x0=0, x1=1, yref="y", y0=g0 - 0.5, y1=g0 + group - 0.5,
                               fillcolor="rgba(0,0,0,0.035)", line=dict(width=0), layer="below"))  # fmt: skip
        if g0:
            shapes.append(dict(type="line", xref="x domain", x0=0, x1=1, yref="y", y0=g0 - 0.5, y1=g0 - 0.5,
                               line=dict(color="#999", width=1)))  # fmt: skip
    annotations = [dict(text=per_rank, xref="paper", yref="paper", x=0, y=1, xanchor="left", yanchor="bottom",
                        align="left", showarrow=False, font=dict(size=10))]  # fmt: skip
    layout = {
        "title.text": head,
        "yaxis.tickvals": list(range(n)),
        "yaxis.ticktext": [r.label for r in panel.rows],
        "yaxis.range": [n - 0.5, -0.5],
        "yaxis2.title.text": f"memory ({mem_unit})",
        "annotations": annotations,
        "shapes": shapes,
    }
    return layout, lines


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """{"yaxis.range": r} -> {"yaxis": {"range": r}}."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def build_figure(traces: Sequence[Trace], *, title: str | None = None, webgl_threshold: int = WEBGL_THRESHOLD) -> Any:
    """The complete timeline figure (a ``plotly.graph_objects.Figure``) of one or more traces.

    Raises :class:`PlotlyMissingError` without plotly and ``ValueError`` for no traces.
    """
    return assemble(traces, title=title, webgl_threshold=webgl_threshold, compact=False)[0]


def assemble(traces: Sequence[Trace], *, title: str | None, webgl_threshold: int,
             compact: bool) -> tuple[Any, Payload]:  # fmt: skip
    """Build the figure; with ``compact`` the WebGL traces are left empty and their data is in the payload."""
    go = require_plotly()
    from plotly.subplots import make_subplots

    if webgl_threshold < 0:
        raise ValueError(f"webgl_threshold must be >= 0, got {webgl_threshold}")
    panels = make_panels(traces)
    n_rows = max(len(p.rows) for p in panels)
    row_px = 18 if n_rows <= 48 else 13
    side = any(p.expert_load is not None for p in panels)  # a column of expert load beside the timeline
    payload = Payload()
    data: list[Any] = []
    owner: list[int] = []
    layouts = []
    max_lines = 0
    for k, panel in enumerate(panels):
        groups, outline = panel_groups(panel)
        gl = panel.num_events > webgl_threshold
        blocks = _block_traces(go, groups, outline, gl=gl, compact=compact, line_px=row_px * 0.7, payload=payload,
                               first_index=len(data), visible=k == 0)  # fmt: skip
        memory, unit = _memory_traces(go, panel)
        for tr in memory:
            tr.visible = k == 0
        layout, lines = _panel_layout(panel, title, unit)
        load, load_layout = load_traces(go, panel) if side else ([], {})
        for tr in load:
            tr.visible = k == 0
        layout |= {**load_layout, "annotations": layout["annotations"] + load_layout.get("annotations", [])}
        data += blocks + memory + load
        owner += [k] * (len(blocks) + len(memory) + len(load))
        layouts.append(layout)
        max_lines = max(max_lines, lines)
    timeline_px = max(n_rows * row_px, LOAD_MIN_PX if side else 0)
    top = 50 + 15 * max_lines
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        row_heights=[timeline_px / (timeline_px + MEMORY_PX), MEMORY_PX / (timeline_px + MEMORY_PX)])  # fmt: skip
    fig.add_traces(data)
    height = top + timeline_px + MEMORY_PX + 140
    fig.update_layout(
        height=height,
        template="plotly_white",
        barmode="overlay",
        hovermode="closest",
        dragmode="zoom",
        uniformtext=dict(minsize=8, mode="hide"),
        margin=dict(t=top, l=140, r=20, b=40),
        title=dict(x=0.01, xanchor="left", xref="container", y=1 - 12 / height, yanchor="top", yref="container",
                   font=dict(size=15)),
        legend=dict(tracegroupgap=4),
        yaxis=dict(tickmode="array", showgrid=False, zeroline=False, tickfont=dict(size=10)),
        xaxis=dict(showgrid=True, zeroline=False),
        xaxis2=dict(title="time (ms)", rangeslider=dict(visible=True, thickness=0.04), zeroline=False),
        meta={"panels": [{"name": p.name, "rows": [[r.rank, r.lane, r.series] for r in p.rows]} for p in panels]},
    )
    if side:
        fig.update_layout(load_axes(height - top - 40, fig.layout.yaxis.domain, fig.layout.yaxis2.domain))
    fig.update_layout(_nested(layouts[0]))
    if len(panels) > 1:
        buttons = [dict(label=p.name, method="update", args=[{"visible": [o == k for o in owner]}, layouts[k]])
                   for k, p in enumerate(panels)]  # fmt: skip
        fig.update_layout(updatemenus=[dict(type="dropdown", buttons=buttons, active=0, x=1, xanchor="right", y=1,
                                            yanchor="bottom", pad=dict(b=4), showactive=True)])  # fmt: skip
    return fig, payload
