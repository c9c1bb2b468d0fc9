"""One trace format for simulated and measured runs.

A trace is a list of timed events, each on one *lane* of one rank, plus a per-rank memory
series. The simulator writes it from predictions, the executor from measurements (CUDA
events on GPU, wall clock on CPU), and the viewer reads either. Times are seconds from the
start of the step; memory is bytes of activation (simulated) or allocated (measured).

File layout (JSON)::

    {"format": "braid-trace/1",
     "traces": [
       {"meta": {"schedule": "braided_v", "source": "simulated" | "measured", ...,
                 "summary": {...optional report...}},
        "events": [{"rank": 0, "lane": "compute", "name": "F3c0", "kind": "F",
                    "mb": 3, "chunk": 0, "start": 0.0, "dur": 0.001,
                    "unit": "L0.attn" | null, "block": "F3c0&B1c0" | null,
                    "op_index": 7, "peer": null}, ...],
        "memory": {"0": [[t, bytes], ...], ...}}]}

``kind`` is one of F, B, W (compute units; a unit of a full backward is B or W), AR (TP
all-reduce; on the ``dp-comm`` lane the data-parallel gradient all-reduce), A2A (expert
parallelism's all-to-all, on the ``ep-comm`` lane), SEND, RECV
(P2P), OFFLOAD, RELOAD (host copies), RS, AG (data-parallel reduce-scatter and all-gather of
ZeRO-1), OPT (the optimizer step). ``block`` is the text of the
braided instruction an event belongs to, so both halves of a block can be paired.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from braid.io.inputs import InputFileError, read_json
from braid.io.limits import MAX_TRACE_EVENTS, TRACE_FILE

FORMAT = "braid-trace/1"
LANES: tuple[str, ...] = ("compute", "tp-comm", "p2p", "copy", "dp-comm", "ep-comm")
# RS/AG: the data-parallel reduce-scatter and all-gather (ZeRO-1), OPT: the optimizer step
KINDS: tuple[str, ...] = ("F", "B", "W", "AR", "SEND", "RECV", "OFFLOAD", "RELOAD", "RS", "AG", "OPT", "A2A")


class TraceError(ValueError):
    """A trace file that is missing, not JSON, or not of the braid trace schema."""


@dataclass(slots=True)
class Event:
    rank: int
    lane: str
    name: str
    kind: str
    start: float
    dur: float
    mb: int | None = None
    chunk: int | None = None
    unit: str | None = None
    block: str | None = None
    op_index: int | None = None
    peer: int | None = None

    @property
    def end(self) -> float:
        return self.start + self.dur


@dataclass(slots=True)
class Trace:
    meta: dict[str, Any]
    events: list[Event]
    memory: dict[int, list[tuple[float, int]]] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events} | set(self.memory))

    @property
    def step_time(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    def peak_memory(self, rank: int) -> int:
        return max((b for _, b in self.memory.get(rank, [])), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "events": [asdict(e) for e in self.events],
            "memory": {str(r): [[t, b] for t, b in s] for r, s in sorted(self.memory.items())},
        }

    @staticmethod
    def from_dict(d: Any, where: str = "trace") -> "Trace":
        if not isinstance(d, dict) or "events" not in d or not isinstance(d["events"], list):
            raise TraceError(f"{where}: expected an object with an 'events' list")
        for key in ("meta", "memory"):
            if d.get(key) is not None and not isinstance(d[key], dict):
                raise TraceError(f"{where}: {key!r} must be an object, got {type(d[key]).__name__}")
        events = [_event(e, f"{where}: event {i}") for i, e in enumerate(d["events"])]
        memory: dict[int, list[tuple[float, int]]] = {}
        for r, series in (d.get("memory") or {}).items():
            rank = _int_text(r)
            if rank is None or not isinstance(series, list):
                raise TraceError(f"{where}: memory must map a rank (a whole number >= 0) to [[time, bytes], ...], "
                                 f"got {r!r}")
            points = []
            for point in series:
                if (not isinstance(point, list) or len(point) != 2 or not all(_finite(x) for x in point)
                        or point[1] != int(point[1])):
                    raise TraceError(f"{where}: memory series of rank {r!r} must be [[time, bytes], ...] of finite "
                                     f"numbers, got {point!r}"[:300])
                points.append((float(point[0]), int(point[1])))
            memory[rank] = points
        return Trace(dict(d.get("meta") or {}), events, memory)


_INT_FIELDS = ("mb", "chunk", "op_index", "peer")
_TEXT_FIELDS = ("unit", "block")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_text(x: Any) -> int | None:
    """A rank key of the memory map ("3"), or None if it is not a whole number >= 0."""
    return int(x) if isinstance(x, str) and x.isdigit() else None


def _event(e: Any, where: str) -> Event:
    """One event of a trace file, checked field by field."""
    if not isinstance(e, dict):
        raise TraceError(f"{where} must be an object, got {type(e).__name__}")
    try:
        ev = Event(**e)
    except TypeError as err:
        raise TraceError(f"{where} does not match the schema ({err})") from None
    if not _is_int(ev.rank) or ev.rank < 0:
        raise TraceError(f"{where} has rank {ev.rank!r}; a rank is a whole number >= 0")
    if ev.lane not in LANES:
        raise TraceError(f"{where} has lane {ev.lane!r}; valid lanes: {', '.join(LANES)}")
    if ev.kind not in KINDS:
        raise TraceError(f"{where} has kind {ev.kind!r}; valid kinds: {', '.join(KINDS)}")
    if not isinstance(ev.name, str):
        raise TraceError(f"{where} has name {ev.name!r}; a name is text")
    if not (_finite(ev.start) and _finite(ev.dur)) or ev.dur < 0:
        raise TraceError(f"{where} needs finite numeric start and non-negative dur")
    for f in _INT_FIELDS:
        if getattr(ev, f) is not None and not _is_int(getattr(ev, f)):
            raise TraceError(f"{where} has {f} {getattr(ev, f)!r}; expected a whole number or null")
    for f in _TEXT_FIELDS:
        if getattr(ev, f) is not None and not isinstance(getattr(ev, f), str):
            raise TraceError(f"{where} has {f} {getattr(ev, f)!r}; expected text or null")
    return ev


def dump_traces(traces: Iterable[Trace], path: str | Path) -> None:
    """Write one or more traces to a JSON file (atomically: the old file or the new one, never half)."""
    from braid.io.files import atomic_write_text

    atomic_write_text(path, json.dumps({"format": FORMAT, "traces": [t.to_dict() for t in traces]}))


def load_traces(path: str | Path) -> list[Trace]:
    """Read a trace file; any problem becomes one :class:`TraceError` naming the file."""
    p = Path(path)
    try:
        d = read_json(p, "trace file", expect=object, limit=TRACE_FILE)
    except InputFileError as err:
        raise TraceError(str(err)) from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise TraceError(f"{p}: not a braid trace (format={got!r}, expected {FORMAT!r})")
    if not isinstance(d.get("traces"), list) or not d["traces"]:
        raise TraceError(f"{p}: 'traces' must be a non-empty list")
    events = sum(len(t["events"]) for t in d["traces"] if isinstance(t, dict) and isinstance(t.get("events"), list))
    if events > MAX_TRACE_EVENTS:
        raise TraceError(f"{p}: {events:,} events, more than a trace file may hold ({MAX_TRACE_EVENTS:,}); "
                         "trace fewer micro-batches or ranks")
    return [Trace.from_dict(t, where=f"{p}: trace {i}") for i, t in enumerate(d["traces"])]
