"""Export a trace as Chrome-trace JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing open.

Each rank is a process (``pid`` = rank, named "rank N"), each lane a thread (``tid``), so
slices on one thread nest; if events of one lane overlap (say, two all-reduces in flight
in a measured run) the overlapping ones go to an extra thread "lane #2" rather than break
nesting. Times are microseconds. Every P2P SEND gets a flow arrow to its RECV: instruction
texts are ``SEND_A3c0>1`` on the sender and ``RECV_A3c1<0`` on the receiver (the chunks may
differ), so they are matched on (sender, receiver, A/G, micro-batch), in time order.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from braid.core.ir import Recv, Send, parse_instruction
from braid.io.trace import LANES, Event, Trace

log = logging.getLogger(__name__)

_TID_STRIDE = 100  # tid = (lane index + 1) * stride + overflow track


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _span(e: Event) -> tuple[float, float]:
    """(ts, dur) in microseconds; the end is rounded, not the duration, so rounding never makes siblings overlap."""
    ts = _us(e.start)
    return ts, round(_us(e.end) - ts, 3)


def _p2p_key(e: Event) -> tuple[int, int, str, int | None] | None:
    """(sender, receiver, comm kind, micro-batch) of a SEND/RECV event, or None if unknown."""
    try:
        instr = parse_instruction(e.name)
    except ValueError:
        instr = None
    if isinstance(instr, Send) and e.kind == "SEND":
        return (e.rank, instr.peer, instr.comm.value, instr.mb)
    if isinstance(instr, Recv) and e.kind == "RECV":
        return (instr.peer, e.rank, instr.comm.value, instr.mb)
    if e.peer is None:
        return None
    # Not an instruction text (e.g. a hand-written trace): fall back on the event fields.
    return (e.rank, e.peer, "?", e.mb) if e.kind == "SEND" else (e.peer, e.rank, "?", e.mb)


def _assign_tracks(events: list[Event]) -> dict[int, int]:
    """Map id(event) -> track index so that slices on one track nest or are disjoint, never partly overlap."""
    open_ends: list[list[float]] = []  # per track, the ends of the slices that contain the current time
    track: dict[int, int] = {}
    for e in sorted(events, key=lambda e: (_us(e.start), -_us(e.end))):
        s, end = _us(e.start), _us(e.end)
        for k, stack in enumerate(open_ends):
            while stack and stack[-1] <= s:
                stack.pop()
            if not stack or end <= stack[-1]:
                break
        else:
            k = len(open_ends)
            open_ends.append([])
        open_ends[k].append(end)
        track[id(e)] = k
    return track


def to_chrome_trace(trace: Trace) -> dict[str, Any]:
    """Chrome-trace dict (``{"traceEvents": [...], "displayTimeUnit": "ms", ...}``) of one trace."""
    out: list[dict[str, Any]] = []
    by_lane: dict[tuple[int, str], list[Event]] = defaultdict(list)
    for e in trace.events:
        by_lane[(e.rank, e.lane)].append(e)
    for r in trace.ranks:
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
    tid_of: dict[int, int] = {}
    for (rank, lane), events in sorted(by_lane.items(), key=lambda kv: (kv[0][0], LANES.index(kv[0][1]))):
        tracks = _assign_tracks(events)
        base = (LANES.index(lane) + 1) * _TID_STRIDE
        for k in sorted(set(tracks.values())):
            name = lane if k == 0 else f"{lane} #{k + 1}"
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": base + k, "args": {"name": name}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": base + k,
                        "args": {"sort_index": base + k}})  # fmt: skip
        for e in events:
            tid_of[id(e)] = base + tracks[id(e)]
    for e in trace.events:
        args = {k: v for k, v in (("mb", e.mb), ("chunk", e.chunk), ("unit", e.unit), ("block", e.block),
                                   ("op_index", e.op_index), ("peer", e.peer)) if v is not None}  # fmt: skip
        ts, dur = _span(e)
        out.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": e.rank, "tid": tid_of[id(e)], "ts": ts,
                    "dur": dur, "args": args})  # fmt: skip
    out += _flows(trace, tid_of)
    meta = {k: v for k, v in trace.meta.items() if isinstance(v, (str, int, float, bool))}
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta}


def _flows(trace: Trace, tid_of: dict[int, int]) -> list[dict[str, Any]]:
    """Flow arrows from each SEND to its RECV (matched in time order per key)."""
    sends: dict[tuple, list[Event]] = defaultdict(list)
    recvs: dict[tuple, list[Event]] = defaultdict(list)
    for e in sorted(trace.events, key=lambda e: e.start):
        if e.kind in ("SEND", "RECV") and (key := _p2p_key(e)) is not None:
            (sends if e.kind == "SEND" else recvs)[key].append(e)
    flows: list[dict[str, Any]] = []
    unmatched = 0
    for key in sorted(set(sends) | set(recvs), key=str):
        s_list, r_list = sends.get(key, []), recvs.get(key, [])
        unmatched += abs(len(s_list) - len(r_list))
        for s, r in zip(s_list, r_list):
            fid = len(flows) // 2 + 1
            comm = "activation" if key[2] == "A" else "gradient" if key[2] == "G" else "p2p"
            flows.append({"ph": "s", "id": fid, "name": comm, "cat": "p2p", "pid": s.rank, "tid": tid_of[id(s)],
                          "ts": _us(s.start)})  # fmt: skip
            flows.append({"ph": "f", "bp": "e", "id": fid, "name": comm, "cat": "p2p", "pid": r.rank,
                          "tid": tid_of[id(r)], "ts": _us(r.start)})  # fmt: skip
    if unmatched:
        log.warning("%d SEND/RECV events have no partner; no flow arrow drawn for them", unmatched)
    return flows
