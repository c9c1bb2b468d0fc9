"""Interactive Plotly timeline viewer and Perfetto export for braid traces.

``render_html(traces, path)`` writes one standalone HTML timeline (offline by default);
``to_chrome_trace(trace)`` gives Chrome-trace JSON that Perfetto opens;
``python -m viz TRACE.json -o timeline.html`` does both from the command line.
Plotly is imported only when a figure is built, so ``import viz`` works without it.
"""

from viz.chrome import to_chrome_trace
from viz.html import render_html
from viz.timeline import PlotlyMissingError, build_figure

__all__ = ["render_html", "to_chrome_trace", "build_figure", "PlotlyMissingError"]
