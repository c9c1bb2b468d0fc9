"""Timeline viewer (viz): figure content, Chrome-trace export, CLI errors, HTML size.

Traces are synthesised here by a small deterministic builder (a 1F1B-like pattern with
unit-level events, braided F&B blocks, TP all-reduces, P2P sends/receives, host copies and a
memory series), independent of the simulator.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

from braid.io.trace import Event, Trace, dump_traces
from braid.viz import build_figure, render_html, to_chrome_trace
from braid.viz.__main__ import main as cli_main
from braid.viz.timeline import PlotlyMissingError, assemble

UNITS = ("pre_attn", "attn", "pre_mlp", "mlp")
AR_AFTER = {"F": {"attn", "mlp"}, "B": {"pre_attn", "pre_mlp"}, "W": set()}
UNIT_MS = {"F": 1.0, "B": 1.5, "W": 0.8}
AR_MS, P2P_MS, GAP_MS, MB_BYTES = 0.3, 0.2, 1.0, 1 << 20


def fake_trace(p: int = 2, m: int = 4, layers: int = 1, *, schedule: str = "fake_1f1b", source: str = "simulated",
               scale: float = 1.0) -> Trace:  # fmt: skip
    """A deterministic 1F1B-like trace with braided F&B blocks in the steady phase.

    Rank r runs min(m, p-r) warm-up forwards, then blocks F(i)&B(i-warm), then the
    remaining backwards, then all W. Micro-batch i lives on chunk i % 2. Every F sends its
    activation to rank r+1, every B its gradient to rank r-1; matching receives precede the
    consumer op. Chunk-0 forwards offload, chunk-0 weight gradients reload first.
    ``scale`` multiplies every duration (a fake "measured" run).
    """
    events: list[Event] = []
    memory: dict[int, list[tuple[float, int]]] = {}
    for r in range(p):
        t = r * 4.0e-3 * scale
        op_index = 0
        live = 0
        mem = [(0.0, 0)]
        warm = min(m, p - r)
        ops: list[list[tuple[str, int]]] = [[("F", i)] for i in range(warm)]
        ops += [[("F", i), ("B", i - warm)] for i in range(warm, m)]
        ops += [[("B", j)] for j in range(m - warm, m)]
        ops += [[("W", j)] for j in range(m)]
        for block_ops in ops:
            names = [f"{k}{mb}c{mb % 2}" for k, mb in block_ops]
            block = "&".join(names) if len(block_ops) == 2 else None
            pre = 0.0
            for k, mb in block_ops:  # receives before the op
                peer = r - 1 if k == "F" else r + 1
                if k in "FB" and 0 <= peer < p:
                    pre += P2P_MS * 1e-3 * scale
                    comm = "A" if k == "F" else "G"
                    events.append(Event(r, "p2p", f"RECV_{comm}{mb}c{mb % 2}<{peer}", "RECV", t - pre,
                                        P2P_MS * 1e-3 * scale, mb, mb % 2, None, None, op_index, peer))  # fmt: skip
                    op_index += 1
                if k == "W" and mb % 2 == 0:
                    events.append(Event(r, "copy", f"RELOAD{mb}c0", "RELOAD", t - 0.7e-3 * scale, 0.6e-3 * scale,
                                        mb, 0, None, None, op_index, None))  # fmt: skip
                    op_index += 1
            idx = {k: op_index + n for n, (k, _) in enumerate(block_ops)}
            op_index += len(block_ops)
            # interleave units: a0 b0 a1 b1 ... (one op: a0 a1 ...)
            seq = [(k, mb, f"L{layer}.{u}") for layer in range(layers) for u in UNITS for k, mb in block_ops]
            seq.sort(key=lambda s: (int(s[2][1:].split(".")[0]) * 4 + UNITS.index(s[2].split(".")[1])))
            ar_end = {k: t for k, _ in block_ops}
            for k, mb, unit in seq:
                start = max(t, ar_end[k] if k != "W" else t)
                dur = UNIT_MS[k] * 1e-3 * scale
                name = f"{k}{mb}c{mb % 2}"
                events.append(Event(r, "compute", name, k, start, dur, mb, mb % 2, unit, block, idx[k], None))
                t = start + dur
                if unit.split(".")[1] in AR_AFTER[k]:
                    events.append(Event(r, "tp-comm", name, "AR", t, AR_MS * 1e-3 * scale, mb, mb % 2, unit, block,
                                        idx[k], None))  # fmt: skip
                    ar_end[k] = t + AR_MS * 1e-3 * scale
            t = max([t, *ar_end.values()])
            post = 0.0
            for k, mb in block_ops:
                peer = r + 1 if k == "F" else r - 1
                if k in "FB" and 0 <= peer < p:
                    comm = "A" if k == "F" else "G"
                    events.append(Event(r, "p2p", f"SEND_{comm}{mb}c{mb % 2}>{peer}", "SEND", t + post,
                                        P2P_MS * 1e-3 * scale, mb, mb % 2, None, None, op_index, peer))  # fmt: skip
                    op_index += 1
                    post += P2P_MS * 1e-3 * scale
                if k == "F" and mb % 2 == 0:
                    events.append(Event(r, "copy", f"OFFLOAD{mb}c0", "OFFLOAD", t, 0.6e-3 * scale, mb, 0, None,
                                        None, op_index, None))  # fmt: skip
                    op_index += 1
                live += {"F": 2, "B": -1, "W": -1}[k] * MB_BYTES
                mem.append((round(t, 9), live))
            t += GAP_MS * 1e-3 * scale
        memory[r] = mem
    return Trace({"schedule": schedule, "source": source}, events, memory)


def rank_of_row(fig, panel: int = 0) -> list[int]:
    return [row[0] for row in fig.layout.meta["panels"][panel]["rows"]]


def block_traces(fig):
    return [t for t in fig.data if t.yaxis == "y" and t.name != "braided block"]


def blocks_per_rank(fig, panel: int = 0) -> Counter:
    """Blocks drawn per rank: bars, or (start, end) pairs of NaN-separated WebGL segments."""
    ranks = rank_of_row(fig, panel)
    out: Counter = Counter()
    for t in block_traces(fig):
        if t.visible is False:
            continue
        rows = t.y if t.type == "bar" else np.asarray(t.y)[0::3]
        out.update(ranks[int(y)] for y in rows)
    return out


@pytest.fixture(scope="module")
def small() -> Trace:
    return fake_trace(p=3, m=6, layers=1)


@pytest.mark.parametrize("threshold", [100_000, 0], ids=["bars", "webgl"])
def test_blocks_per_rank_equal_events_per_rank(small: Trace, threshold: int) -> None:
    fig = build_figure([small], webgl_threshold=threshold)
    assert {t.type for t in block_traces(fig)} == ({"bar"} if threshold else {"scattergl"})
    assert blocks_per_rank(fig) == Counter(e.rank for e in small.events)
    # few traces: one per kind x chunk (6 compute + AR, SEND, RECV, OFFLOAD, RELOAD)
    assert len(block_traces(fig)) == 11


def test_colours_by_kind_and_chunk(small: Trace) -> None:
    fig = build_figure([small])
    colour = {t.name: t.marker.color for t in block_traces(fig)}
    kinds = Counter(e.kind for e in small.events)
    for t in block_traces(fig):  # one trace per kind (x chunk for compute): all its blocks are of it
        kind, *chunk = t.name.split(" chunk ")
        if chunk:
            assert {(cd[0][0], cd[2]) for cd in t.customdata} == {(kind, int(chunk[0]))}
        else:
            assert len(t.customdata) == kinds[kind]
    lum = lambda c: sum(int(c[i : i + 2], 16) for i in (1, 3, 5))  # noqa: E731
    for kind in "FBW":
        assert lum(colour[f"{kind} chunk 0"]) < lum(colour[f"{kind} chunk 1"])  # chunk 0 dark, chunk 1 light
    assert len(set(colour.values())) == len(colour)


def test_hover_fields_of_one_block(small: Trace) -> None:
    fig = build_figure([small])
    ev = next(e for e in small.events if e.kind == "B" and e.block)
    tr = next(t for t in block_traces(fig) if t.name == f"B chunk {ev.chunk}")
    for field in ("micro-batch", "chunk", "unit", "start", "end", "duration", "block"):
        assert field in tr.hovertemplate
    i = next(i for i, cd in enumerate(tr.customdata) if cd[0] == ev.name and cd[3] == ev.unit and cd[1] == ev.mb)
    name, mb, chunk, unit, start, end, dur, op, block, _ = tr.customdata[i]
    assert (name, mb, chunk, unit, op, block) == (ev.name, ev.mb, ev.chunk, ev.unit, ev.op_index, ev.block)
    assert start == pytest.approx(ev.start * 1e3, abs=1e-3)
    assert end == pytest.approx(ev.end * 1e3, abs=2e-3) and dur == pytest.approx(ev.dur * 1e3, abs=1e-3)
    assert tr.text[i] == str(ev.mb) and tr.textposition == "inside"
    assert fig.layout.uniformtext.mode == "hide"


def test_braided_blocks_are_outlined_once_per_block(small: Trace) -> None:
    fig = build_figure([small])
    outline = next(t for t in fig.data if t.name == "braided block")
    blocks = {(e.rank, e.block) for e in small.events if e.block}
    assert len(outline.y) == len(blocks) > 0
    # both halves of a block are inside its outline
    ev = [e for e in small.events if e.block and e.rank == 0 and e.lane == "compute"]
    first = min(ev, key=lambda e: e.start)
    halves = [e for e in ev if e.block == first.block]
    assert {e.kind for e in halves} == {"F", "B"}
    k = next(i for i, b in enumerate(outline.base) if b == pytest.approx(first.start * 1e3, abs=1e-3))
    assert outline.base[k] + outline.x[k] == pytest.approx(max(e.end for e in halves) * 1e3, abs=2e-3)


def test_memory_subplot_and_peak_marker(small: Trace) -> None:
    fig = build_figure([small])
    mem = [t for t in fig.data if t.yaxis == "y2" and t.name != "peak memory"]
    assert len(mem) == 3 and all(t.xaxis == "x2" for t in mem)
    peak = next(t for t in fig.data if t.name == "peak memory")
    for r in range(3):
        t_peak, b_peak = max(small.memory[r], key=lambda tb: tb[1])
        assert peak.y[r] == pytest.approx(b_peak / (1 << 20), rel=1e-6)  # MiB
        assert peak.x[r] == pytest.approx(t_peak * 1e3, abs=1e-3)
    assert fig.layout.xaxis2.rangeslider.visible is True
    assert fig.layout.xaxis.matches == "x2"  # shared time axis


def test_header_states_step_bubble_exposed_comm_and_peak(small: Trace) -> None:
    small_with_summary = Trace({**small.meta, "summary": {"step_time_s": 0.5, "ranks": [
        {"rank": 0, "compute_s": 0.4, "pp_bubble_s": 0.1, "tp_exposed_s": 0.002, "peak_activation_bytes": 3 << 30}]}},
        small.events, small.memory)  # fmt: skip
    fig = build_figure([small_with_summary])
    assert fig.layout.title.text == "<b>fake_1f1b (simulated)</b>"
    per_rank = fig.layout.annotations[0].text
    assert "step 500.000 ms" in per_rank and "peak 3.00 GiB" in per_rank
    assert "r0: bubble 20.0%, TP 2.000 ms, peak 3.00 GiB" in per_rank
    assert "r1: bubble" in per_rank and "r2: bubble" in per_rank  # computed from events


def test_dropdown_one_entry_per_schedule_and_compare_panel() -> None:
    pred = fake_trace(p=2, m=4, schedule="braided_v")
    meas = fake_trace(p=2, m=4, schedule="braided_v", source="measured", scale=1.1)
    other = fake_trace(p=2, m=3, schedule="1f1b")
    fig = build_figure([pred, other, meas])
    (menu,) = fig.layout.updatemenus
    labels = [b.label for b in menu.buttons]
    assert labels == ["braided_v: predicted vs measured", "1f1b (simulated)"]
    vis = [b.args[0]["visible"] for b in menu.buttons]
    assert all(a != b for a, b in zip(*vis))  # each trace belongs to exactly one entry
    assert blocks_per_rank(fig, 0) == Counter(e.rank for e in pred.events + meas.events)
    rows = fig.layout.meta["panels"][0]["rows"]
    assert [r[2] for r in rows[:8]] == ["predicted"] * 4 + ["measured"] * 4  # aligned rank by rank
    assert menu.buttons[1].args[1]["yaxis.ticktext"][0] == "r0 compute"
    # hover of a predicted block shows both durations
    f = next(t for t in block_traces(fig) if t.name == "F chunk 0" and t.visible is not False)
    ev = next(e for e in pred.events if e.kind == "F" and e.chunk == 0)
    note = next(cd[9] for cd in f.customdata if cd[0] == ev.name and cd[3] == ev.unit)
    assert note == f"predicted {ev.dur * 1e3:.3f} ms · measured {ev.dur * 1.1e3:.3f} ms"


def decode(spec: dict) -> np.ndarray:
    if "const" in spec:
        return np.full(spec["n"], spec["const"])
    return np.frombuffer(base64.b64decode(spec["bdata"]), dtype="<" + spec["dtype"])


def test_compact_payload_decodes_to_the_full_figure(small: Trace) -> None:
    full = build_figure([small], webgl_threshold=0)
    compact, payload = assemble([small], title=None, webgl_threshold=0, compact=True)
    assert len(payload.groups) == len([t for t in full.data if t.type == "scattergl"])
    for g in payload.groups:
        ref = full.data[g["trace"]]
        assert compact.data[g["trace"]].x is None or len(compact.data[g["trace"]].x) == 0
        start, dur, row = (decode(g["cols"][c]).astype(float) for c in ("start", "dur", "row"))
        np.testing.assert_allclose(np.asarray(ref.x)[0::3], start, atol=1e-3)
        np.testing.assert_allclose(np.asarray(ref.x)[1::3], start + dur, atol=2e-3)
        np.testing.assert_allclose(np.asarray(ref.y)[0::3], row + g["dy"])
        if g["hover"]:
            for k, c in ((0, "name"), (3, "unit"), (8, "block"), (9, "note")):
                texts = [payload.strings[c][int(i)] for i in decode(g["cols"][c])]
                assert texts == [cd[k] for cd in ref.customdata[0::3]]


def test_render_html_offline_cdn_directory(tmp_path: Path, small: Trace) -> None:
    import plotly.offline

    inline = render_html(small, tmp_path / "a.html")
    assert plotly.offline.get_plotlyjs()[:200] in inline.read_text()
    cdn = render_html([small], tmp_path / "b.html", plotlyjs="cdn", title="My run").read_text()
    assert f"cdn.plot.ly/plotly-{plotly.offline.get_plotlyjs_version()}.min.js" in cdn and "My run" in cdn
    (tmp_path / "d").mkdir()
    render_html([small], tmp_path / "d" / "c.html", plotlyjs="directory")
    assert (tmp_path / "d" / "plotly.min.js").stat().st_size > 1_000_000
    assert '<script src="plotly.min.js"' in (tmp_path / "d" / "c.html").read_text()
    with pytest.raises(ValueError, match="plotlyjs must be one of"):
        render_html([small], tmp_path / "e.html", plotlyjs="web")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one trace"):
        render_html([], tmp_path / "f.html")


def test_data_part_of_100k_event_html_is_small(tmp_path: Path) -> None:
    import plotly.offline

    big = fake_trace(p=8, m=64, layers=12)
    assert len(big.events) >= 100_000
    page = render_html(big, tmp_path / "big.html").read_text()
    data_bytes = len(page.encode()) - len(plotly.offline.get_plotlyjs().encode())
    assert data_bytes < 3_000_000, data_bytes
    fig, payload = assemble([big], title=None, webgl_threshold=4000, compact=True)
    assert {t.type for t in block_traces(fig)} == {"scattergl"} and len(fig.data) <= 24
    assert sum(len(decode(g["cols"]["start"])) for g in payload.groups if g["hover"]) == len(big.events)


def test_missing_plotly_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, small: Trace) -> None:
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    with pytest.raises(PlotlyMissingError, match="pip install plotly"):
        build_figure([small])


def test_core_imports_without_plotly() -> None:
    code = "import sys; sys.modules['plotly'] = None; import braid.viz as viz, braid.io.trace; print(viz.to_chrome_trace.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "to_chrome_trace"


# ---------------------------------------------------------------- Chrome / Perfetto export


def test_chrome_trace_units_processes_and_lanes(small: Trace) -> None:
    ct = to_chrome_trace(small)
    ev = ct["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {name for (pid, _), name in threads.items() if pid == 1} == {"compute", "tp-comm", "p2p", "copy"}
    slices = [e for e in ev if e["ph"] == "X"]
    assert len(slices) == len(small.events)
    first = small.events[0]
    s = next(e for e in slices if e["name"] == first.name and e["pid"] == first.rank)
    assert s["ts"] == pytest.approx(first.start * 1e6) and s["dur"] == pytest.approx(first.dur * 1e6)
    assert threads[(s["pid"], s["tid"])] == first.lane
    by_tid = defaultdict(list)
    for e in slices:
        by_tid[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_tid.values():  # slices on one thread nest or are disjoint
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[float] = []
        for a, b in spans:
            while stack and stack[-1] <= a + 1e-6:
                stack.pop()
            assert not stack or b <= stack[-1] + 1e-6
            stack.append(b)


def test_chrome_flows_pair_every_send_with_its_receive(small: Trace) -> None:
    ct = to_chrome_trace(small)
    slices = [e for e in ct["traceEvents"] if e["ph"] == "X"]
    starts = {e["id"]: e for e in ct["traceEvents"] if e["ph"] == "s"}
    ends = {e["id"]: e for e in ct["traceEvents"] if e["ph"] == "f"}
    sends = [e for e in small.events if e.kind == "SEND"]
    assert len(starts) == len(ends) == len(sends) > 0
    assert all(e["bp"] == "e" for e in ends.values())
    for fid, s in starts.items():
        f = ends[fid]
        send = next(x for x in slices if x["pid"] == s["pid"] and x["tid"] == s["tid"] and x["ts"] == s["ts"])
        recv = next(x for x in slices if x["pid"] == f["pid"] and x["tid"] == f["tid"] and x["ts"] == f["ts"])
        assert send["name"].startswith("SEND_") and recv["name"].startswith("RECV_")
        assert send["args"]["peer"] == f["pid"] and recv["args"]["peer"] == s["pid"]
        assert send["args"]["mb"] == recv["args"]["mb"] and send["name"][5] == recv["name"][5]  # A/G


def test_chrome_overlapping_events_move_to_an_extra_thread() -> None:
    tr = Trace({"schedule": "x"}, [Event(0, "tp-comm", "AR1", "AR", 0.0, 2e-3), Event(0, "tp-comm", "AR2", "AR", 1e-3,
                                                                                     2e-3)])  # fmt: skip
    threads = {e["args"]["name"] for e in to_chrome_trace(tr)["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"tp-comm", "tp-comm #2"}


# ---------------------------------------------------------------- CLI


def test_cli_writes_html_and_chrome(tmp_path: Path, small: Trace) -> None:
    dump_traces([small, fake_trace(p=2, m=2, schedule="other")], tmp_path / "t.json")
    rc = cli_main([str(tmp_path / "t.json"), "-o", str(tmp_path / "t.html"), "--chrome", str(tmp_path / "c.json"),
                   "--plotlyjs", "cdn"])  # fmt: skip
    assert rc == 0
    assert "braidExpand" in (tmp_path / "t.html").read_text()
    assert len(json.loads((tmp_path / "c.json").read_text())["traceEvents"]) > len(small.events)


@pytest.mark.parametrize("content", [None, "{not json", '{"format": "something-else/1", "traces": []}',
                                     '{"format": "braid-trace/1", "traces": [{"events": [{"rank": 0}]}]}'],
                         ids=["missing", "invalid-json", "wrong-format", "wrong-event-schema"])  # fmt: skip
def test_cli_bad_trace_file_exits_2_with_one_line(tmp_path: Path, content: str | None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as info:
        cli_main([str(path), "-o", str(tmp_path / "x.html")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m braid.viz: error: ") and "bad.json" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.html").exists()


def test_cli_as_module_exit_code(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "braid.viz", str(tmp_path / "nope.json")], capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent)  # fmt: skip
    assert out.returncode == 2 and "no such trace file" in out.stderr
