"""The generated timeline opens in a real headless Chromium, offline, with no page errors.

A copy of the page gets two small probe scripts: one at the top of <head> records
``window.onerror`` and ``console.error``, one at the end of <body> writes a JSON status
(traces Plotly rendered, points of the WebGL traces after the page expanded them, errors)
into the DOM, which ``--dump-dom`` returns. All network requests are blocked, so the page
must work from the embedded plotly.js alone. Skipped only without the Chromium binary
(Debian package ``chromium``; CI installs it).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from test_viz import fake_trace
from braid.viz import render_html
from braid.viz.timeline import assemble

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian package 'chromium'; CI installs it)")

PROBE_HEAD = """<script>
window.__errors = [];
window.addEventListener("error", function (e) { window.__errors.push("error: " + e.message); });
window.addEventListener("unhandledrejection", function (e) { window.__errors.push("rejection: " + e.reason); });
(function () {
  var ce = console.error;
  console.error = function () { window.__errors.push("console: " + Array.prototype.join.call(arguments, " ")); ce.apply(console, arguments); };
})();
</script>"""
PROBE_TAIL = """<script>
setTimeout(function () {
  var gd = document.getElementById("braid-timeline"), s = {errors: window.__errors};
  if (gd && gd._fullData) {
    s.traces = gd._fullData.length;
    s.visible = gd._fullData.filter(function (t) { return t.visible === true; }).length;
    s.gl_points = {};
    gd._fullData.forEach(function (t, i) { if (t.type === "scattergl") s.gl_points[i] = t._length; });
    s.canvases = document.querySelectorAll("canvas").length;
    s.bars = document.querySelectorAll("g.trace.bars path").length;
    s.dropdown = document.querySelectorAll("g.updatemenu-header-group").length;
  }
  var pre = document.createElement("pre");
  pre.id = "braid-status";
  pre.textContent = JSON.stringify(s);
  document.body.appendChild(pre);
}, 1500);
</script>"""


def chromium(tmp_path: Path, page: Path, *extra: str) -> str:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-unsafe-swiftshader",
        "--use-angle=swiftshader", "--disable-background-networking", "--no-first-run",
        "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
        "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9", "--disable-dev-shm-usage",
        *extra, page.as_uri(),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def probed_copy(page: Path) -> Path:
    text = page.read_text(encoding="utf-8")
    copy = page.with_name("probed-" + page.name)
    copy.write_text(text.replace("<head>", "<head>\n" + PROBE_HEAD, 1).replace("</body>", PROBE_TAIL + "\n</body>", 1))
    return copy


def status(dom: str) -> dict:
    m = re.search(r'<pre id="braid-status">(.*?)</pre>', dom, re.S)
    assert m, "status element missing: the page did not finish its scripts"
    return json.loads(html.unescape(m.group(1)))


def test_bar_timeline_with_dropdown_renders_offline(tmp_path: Path) -> None:
    traces = [fake_trace(p=3, m=6), fake_trace(p=2, m=4, schedule="other")]
    page = render_html(traces, tmp_path / "bars.html")
    fig, _ = assemble(traces, title=None, webgl_threshold=4000, compact=True)
    s = status(chromium(tmp_path, probed_copy(page), "--virtual-time-budget=5000", "--dump-dom"))
    assert s["errors"] == []
    assert s["traces"] == len(fig.data)
    assert s["visible"] == sum(t.visible is True for t in fig.data)
    # every compute/comm/copy block of the first trace and each braided outline is one bar path
    outlines = {(e.rank, e.block) for e in traces[0].events if e.block}
    assert s["bars"] == len(traces[0].events) + len(outlines)
    assert s["dropdown"] == 1


def test_expert_load_column_renders_offline(tmp_path: Path) -> None:
    from braid.io.trace import ExpertLoad

    moe = fake_trace(p=2, m=4, source="measured")
    moe.meta["expert_load"] = ExpertLoad({0: (5, 1, 1, 1), 1: (2, 2, 3, 1)}, ep=2).to_dict()
    page = render_html([moe, fake_trace(p=2, m=2, schedule="dense")], tmp_path / "moe.html")
    s = status(chromium(tmp_path, probed_copy(page), "--virtual-time-budget=5000", "--dump-dom"))
    assert s["errors"] == [] and s["dropdown"] == 1
    outlines = {(e.rank, e.block) for e in moe.events if e.block}
    assert s["bars"] == len(moe.events) + len(outlines) + 4 + 2  # + a bar per expert and per EP rank


def test_webgl_timeline_expands_renders_and_screenshots(tmp_path: Path) -> None:
    trace = fake_trace(p=4, m=12, layers=2)
    page = render_html(trace, tmp_path / "gl.html", webgl_threshold=1000)
    fig, payload = assemble([trace], title=None, webgl_threshold=1000, compact=True)
    s = status(chromium(tmp_path, probed_copy(page), "--virtual-time-budget=5000", "--dump-dom"))
    assert s["errors"] == []
    assert s["traces"] == len(fig.data) and s["canvases"] > 0
    # each block is a (start, end, gap) triple after the page expanded the compact columns
    expected = {str(g["trace"]): 3 * _count(g) for g in payload.groups}
    assert s["gl_points"] == expected
    kinds = Counter(e.kind for e in trace.events)
    assert sum(v for k, v in s["gl_points"].items() if fig.data[int(k)].name != "braided block") == 3 * sum(
        kinds.values()
    )
    shot = tmp_path / "shot.png"
    chromium(tmp_path, page, "--virtual-time-budget=5000", f"--screenshot={shot}", "--window-size=1400,900")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a real picture, not a blank page
    assert int.from_bytes(data[16:20], "big") == 1400


def _count(group: dict) -> int:
    import base64

    spec = group["cols"]["row"]
    if "const" in spec:
        return spec["n"]
    return len(base64.b64decode(spec["bdata"])) // {"u1": 1, "i1": 1, "u2": 2, "i2": 2, "u4": 4, "i4": 4}[spec["dtype"]]
