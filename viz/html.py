"""Write the timeline as one standalone HTML file (offline by default).

``plotlyjs`` picks where plotly.js comes from: ``"inline"`` embeds it (~4.8 MB, works with
no network), ``"cdn"`` links the matching version on cdn.plot.ly, ``"directory"`` writes
``plotly.min.js`` next to the HTML file once and links it (for many files in one folder).

The figure travels as JSON; WebGL traces travel as compact typed columns
(:class:`viz.timeline.Payload`) which the small script below turns into NaN-separated
segments and per-point hover data before ``Plotly.newPlot`` -- start and end of a block are
sent once instead of three times per hover field, which keeps ~100k events within a few MB.
"""

from __future__ import annotations

import html
import json
import logging
from pathlib import Path
from typing import Literal, Sequence

from braid.io.files import atomic_write_text
from braid.io.trace import Trace
from braid.viz.timeline import WEBGL_THRESHOLD, assemble, require_plotly

log = logging.getLogger(__name__)

PlotlyJs = Literal["inline", "cdn", "directory"]
DIV_ID = "braid-timeline"

# Expands Payload groups into fig.data before plotting; mirrors viz.timeline._segments and
# viz.panels.Group.customdata exactly.
_EXPAND_JS = """
function braidDecode(spec) {
  if ("const" in spec) return new Float64Array(spec.n).fill(spec.const);
  var bin = atob(spec.bdata), buf = new Uint8Array(bin.length);
  for (var i = 0; i < bin.length; i++) buf[i] = bin.charCodeAt(i);
  var T = {u1: Uint8Array, i1: Int8Array, u2: Uint16Array, i2: Int16Array, u4: Uint32Array,
           i4: Int32Array, f4: Float32Array, f8: Float64Array}[spec.dtype];
  return new T(buf.buffer);
}
function braidExpand(data, payload) {
  var S = payload.strings, r3 = function (v) { return Math.round(v * 1000) / 1000; };
  var opt = function (v) { return v < 0 ? "-" : v; };
  payload.groups.forEach(function (g) {
    var c = {}, k;
    for (k in g.cols) c[k] = braidDecode(g.cols[k]);
    var n = c.start.length, x = new Float64Array(3 * n), y = new Float64Array(3 * n), cd = new Array(3 * n);
    for (var i = 0; i < n; i++) {
      var s = r3(c.start[i]), d = r3(c.dur[i]), e = r3(s + d);
      x[3 * i] = s; x[3 * i + 1] = e; x[3 * i + 2] = NaN;
      y[3 * i] = y[3 * i + 1] = c.row[i] + g.dy; y[3 * i + 2] = NaN;
      if (g.hover) {
        var row = [S.name[c.name[i]], opt(c.mb[i]), opt(c.chunk[i]), S.unit[c.unit[i]], s, e, d, opt(c.op[i]),
                   S.block[c.block[i]], S.note[c.note[i]]];
        cd[3 * i] = cd[3 * i + 1] = cd[3 * i + 2] = row;
      }
    }
    var tr = data[g.trace];
    tr.x = x; tr.y = y;
    if (g.hover) tr.customdata = cd;
  });
}
"""

_PAGE = """<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<title>{title}</title>
{plotly_script}
</head>
<body style="margin:0;font-family:sans-serif">
<div id="{div}" style="width:100%;height:{height}px"></div>
<script type="text/javascript">
{expand_js}
(function () {{
  var fig = {figure};
  braidExpand(fig.data, {payload});
  Plotly.newPlot("{div}", fig.data, fig.layout, {{responsive: true, displaylogo: false, scrollZoom: true}});
}})();
</script>
</body>
</html>
"""


def _script_safe(js: str) -> str:
    """JSON that cannot close the surrounding <script> element."""
    return js.replace("</", "<\\/")


def _plotly_script(mode: str, path: Path) -> str:
    import plotly.offline

    if mode == "inline":
        return f'<script type="text/javascript">{plotly.offline.get_plotlyjs()}</script>'
    if mode == "cdn":
        return f'<script src="https://cdn.plot.ly/plotly-{plotly.offline.get_plotlyjs_version()}.min.js" charset="utf-8"></script>'
    if mode == "directory":
        js = path.parent / "plotly.min.js"
        if not js.exists():
            atomic_write_text(js, plotly.offline.get_plotlyjs())
        return '<script src="plotly.min.js" charset="utf-8"></script>'
    raise ValueError(f"plotlyjs must be one of inline, cdn, directory; got {mode!r}")


def render_html(
    traces: Trace | Sequence[Trace],
    path: str | Path,
    *,
    plotlyjs: PlotlyJs = "inline",
    title: str | None = None,
    webgl_threshold: int = WEBGL_THRESHOLD,
) -> Path:
    """Render one or more traces to one standalone, interactive HTML timeline.

    Several traces get a dropdown (one entry per schedule); a simulated and a measured
    trace of the same schedule share one entry, aligned rank by rank. Returns the path.
    """
    require_plotly()
    if plotlyjs not in ("inline", "cdn", "directory"):
        raise ValueError(f"plotlyjs must be one of inline, cdn, directory; got {plotlyjs!r}")
    if isinstance(traces, Trace):
        traces = [traces]
    import plotly.io

    out = Path(path)
    fig, payload = assemble(list(traces), title=title, webgl_threshold=webgl_threshold, compact=True)
    page = _PAGE.format(
        title=html.escape(title or fig.layout.meta["panels"][0]["name"]),
        plotly_script=_plotly_script(plotlyjs, out),
        div=DIV_ID,
        height=fig.layout.height,
        expand_js=_EXPAND_JS,
        figure=_script_safe(plotly.io.to_json(fig, validate=False)),
        payload=_script_safe(json.dumps(payload.to_dict(), separators=(",", ":"))),
    )
    atomic_write_text(out, page)
    log.debug("wrote %s (%d traces, %.1f kB)", out, len(fig.data), len(page) / 1e3)  # the command lines say "wrote"
    return out
