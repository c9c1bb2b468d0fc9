"""Interactive Plotly timeline viewer and Perfetto export for braid traces.

``render_html(traces, path)`` writes one standalone HTML timeline (offline by default; an MoE
run's expert load beside it, :mod:`viz.experts`);
``to_chrome_trace(trace)`` gives Chrome-trace JSON that Perfetto opens;
``python -m braid.viz TRACE.json -o timeline.html`` does both from the command line.
Plotly is imported only when a figure is built, so ``import braid.viz`` works without it.
"""

from braid.viz.chrome import to_chrome_trace
from braid.viz.html import render_html
from braid.viz.timeline import PlotlyMissingError, build_figure

__all__ = ["render_html", "to_chrome_trace", "build_figure", "PlotlyMissingError"]
