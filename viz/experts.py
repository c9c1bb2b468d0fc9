"""The expert load of a mixture-of-experts run, drawn beside the timeline.

Where a panel's traces carry routing counts (``meta.expert_load``, :class:`braid.io.trace.ExpertLoad`:
what ``braid.bench --ep`` measured), a column right of the timeline shows the routed rows
(tokens x top-k) per expert summed over the MoE layers, beside the blocks, and the rows per
expert-parallel rank (a TP slice's share at ``tp > 1``), beside the memory plot. Each bar is
coloured by the rank holding the expert, the busiest in red, the mean dashed; above each plot
the busiest over the mean (per layer, the mean over layers, and the worst layer by name) and,
where the panel's simulation recorded one, the imbalance it priced (``meta.moe_imbalance``).
The figures are :meth:`ExpertLoad.summary`'s, the ones ``braid.bench`` prints.
"""

from __future__ import annotations

from typing import Any, Sequence

from braid.io.trace import ExpertLoad
from braid.viz.panels import Panel

X_SPLIT = (0.70, 0.78)  # the timeline's x domain ends at the first, the expert-load column starts at the second
MIN_PX = 220  # the least height of the timeline subplot (the tokens per expert beside it)
LINE_PX = 14  # one line of the plots' captions
SHADES = ("#5b7fa6", "#9db7d3")  # experts and ranks, alternating by rank
BUSIEST = "#c0392b"
AXES = ("xaxis3", "yaxis3", "xaxis4", "yaxis4")


def device_labels(load: ExpertLoad) -> list[str]:
    """One label per device holding experts: "EP e", or "tp t·ep e" where TP slices the experts too."""
    if load.tp == 1:
        return [f"EP {e}" for e in range(load.ep)]
    return [f"tp {i // load.ep}·ep {i % load.ep}" for i in range(load.devices)]


def captions(panel: Panel) -> tuple[str, str]:
    """The texts above the tokens per expert and above the rows per rank."""
    load = panel.expert_load
    assert load is not None
    s = load.summary()
    layers = len(load.layers)
    over = f"mean of {layers} MoE layers; " if layers > 1 else ""
    top = (f"<b>expert load</b>, {panel.load_source}{f': {load.scope}' if load.scope else ''}"
           f"<br>tokens per expert · busiest/mean {s['expert_imbalance']:.3f}"
           f"<br>{over}worst: layer {s['expert_imbalance_worst_layer']}, {s['expert_imbalance_max']:.3f}")
    what = "EP rank" if load.tp == 1 else "TP slice x EP rank"
    bottom = (f"rows per {what} · busiest/mean {s['ep_imbalance']:.3f}"
              f"<br>worst: layer {s['ep_imbalance_worst_layer']}, {s['ep_imbalance_max']:.3f}")
    if panel.priced_imbalance is not None:
        bottom += f" · simulated at {panel.priced_imbalance:.3f}"
    return top, bottom


def domains(paper_px: float, timeline: Sequence[float], memory: Sequence[float]) -> dict[str, Any]:
    """Where the column sits (the whole figure's layout): the tokens per expert beside the timeline, the
    rows per rank beside the memory plot (``timeline``, ``memory``: their y domains), each under its caption."""
    top_text, bottom_text = ((lines * LINE_PX + 8) / paper_px for lines in (3, 2))
    x = [X_SPLIT[1], 1.0]
    small = dict(font=dict(size=10))
    return {"xaxis3": dict(domain=x, anchor="y3", zeroline=False),  # "expert": in the caption and the hover
            "yaxis3": dict(domain=[timeline[0], max(timeline[0] + 0.02, timeline[1] - top_text)], anchor="x3",
                           title=dict(text="tokens", **small), rangemode="tozero"),
            "xaxis4": dict(domain=x, anchor="y4", tickmode="array", zeroline=False),
            "yaxis4": dict(domain=[memory[0], max(memory[0] + 0.02, memory[1] - bottom_text)], anchor="x4",
                           title=dict(text="rows", **small), rangemode="tozero")}


def load_traces(go: Any, panel: Panel) -> tuple[list[Any], dict[str, Any]]:
    """The column's traces of one panel (none without counts) and its layout properties (dotted paths, as
    relayout takes them): the captions, the ranks' tick labels, the column shown or hidden, the timeline's
    width."""
    load = panel.expert_load
    shown = load is not None
    layout: dict[str, Any] = {f"{a}.visible": shown for a in AXES}
    layout["xaxis.domain"] = layout["xaxis2.domain"] = [0, X_SPLIT[0] if shown else 1]
    if load is None:
        return [], layout | {"annotations": []}
    s = load.summary()
    tokens, rows = s["tokens_per_expert"], s["rows_per_ep_rank"]
    labels = device_labels(load)
    worst = load.layers[s["expert_imbalance_worst_layer"]]
    hot_e, hot_d = tokens.index(max(tokens)), rows.index(max(rows))
    common = dict(showlegend=False)
    experts = go.Bar(name="tokens per expert", x=list(range(load.experts)), y=tokens, xaxis="x3", yaxis="y3",
                     marker=dict(color=[BUSIEST if e == hot_e else SHADES[load.device_of(e) % 2] for e in range(load.experts)],
                                 line=dict(width=0)),
                     customdata=[[labels[load.device_of(e)], worst[e]] for e in range(load.experts)],
                     hovertemplate=(f"expert %{{x}} on %{{customdata[0]}}<br>%{{y}} tokens (all {len(load.layers)} MoE "
                                    f"layers)<br>layer {s['expert_imbalance_worst_layer']} (worst): %{{customdata[1]}}"
                                    "<extra></extra>"), **common)
    ranks = go.Bar(name="rows per EP rank", x=list(range(load.devices)), y=rows, xaxis="x4", yaxis="y4",
                   marker=dict(color=[BUSIEST if d == hot_d else SHADES[d % 2] for d in range(load.devices)],
                               line=dict(width=0)),
                   customdata=labels, hovertemplate="%{customdata}: %{y} rows<extra></extra>", **common)
    means = [go.Scatter(name=f"mean {name}", x=[-0.5, n - 0.5], y=[sum(v) / n] * 2, mode="lines", xaxis=xa, yaxis=ya,
                        line=dict(color="#333", width=1, dash="dash"), showlegend=False,
                        hovertemplate=f"mean {sum(v) / n:.1f}<extra></extra>")
             for name, v, n, xa, ya in (("tokens per expert", tokens, load.experts, "x3", "y3"),
                                        ("rows per EP rank", rows, load.devices, "x4", "y4"))]
    top, bottom = captions(panel)
    caption = dict(x=0, y=1, xanchor="left", yanchor="bottom", align="left", showarrow=False, font=dict(size=10))
    layout |= {"xaxis4.tickvals": list(range(load.devices)), "xaxis4.ticktext": labels,
               "annotations": [dict(text=top, xref="x3 domain", yref="y3 domain", **caption),
                               dict(text=bottom, xref="x4 domain", yref="y4 domain", **caption)]}
    return [experts, ranks, *means], layout
