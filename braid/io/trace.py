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

Optional ``meta`` of a mixture-of-experts run (absent from dense runs and older traces, which
load as before): ``expert_load``, the routed rows per expert of each MoE layer that a measured
run counted (:class:`ExpertLoad`: ``{"layers": {"3": [rows of expert 0, ...], ...}, "ep": 2,
"tp": 1, "scope": "one step, all replicas"}``; experts sharded contiguously over the ``ep * tp``
devices), and ``moe_imbalance``, the busiest expert-parallel rank's rows over the mean that a
simulation priced. Both are checked on load; bad ones are a :class:`TraceError`.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from braid.io.inputs import InputFileError, read_json
from braid.io.limits import (COUNT_LIMITS, MAX_EXPERT_LOAD_CELLS, MAX_EXPERTS, MAX_LAYERS, MAX_ROUTED_ROWS,
                             MAX_TRACE_EVENTS, TRACE_FILE)

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


def busiest_over_mean(xs: Sequence[int]) -> float:
    """The largest of ``xs`` over their mean (1 where they sum to 0): a load's imbalance factor."""
    mean = sum(xs) / len(xs)
    return max(xs) / mean if mean > 0 else 1.0


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    """Routed rows (tokens x top-k) per expert of each MoE layer of a run (``meta.expert_load``).

    ``layers`` maps a global layer index to its rows per expert; the experts are sharded
    contiguously over ``ep * tp`` devices (a TP slice of experts, then its expert-parallel
    share, as :func:`braid.measure.experts.routing_summary` describes). ``scope`` says what was
    counted (e.g. "one step, all replicas").
    """

    layers: dict[int, tuple[int, ...]]
    ep: int = 1
    tp: int = 1
    scope: str = ""

    @property
    def experts(self) -> int:
        return len(next(iter(self.layers.values())))

    @property
    def devices(self) -> int:
        return self.ep * self.tp

    def device_of(self, expert: int) -> int:
        """The device holding ``expert`` (contiguous shards)."""
        return expert // (self.experts // self.devices)

    def device_rows(self, counts: Sequence[int]) -> list[int]:
        """Rows per device of one layer's rows per expert."""
        rows = [0] * self.devices
        for e, c in enumerate(counts):
            rows[self.device_of(e)] += c
        return rows

    @property
    def tokens_per_expert(self) -> list[int]:
        return [sum(c[e] for c in self.layers.values()) for e in range(self.experts)]

    @property
    def rows_per_device(self) -> list[int]:
        per_layer = [self.device_rows(c) for c in self.layers.values()]
        return [sum(r[i] for r in per_layer) for i in range(self.devices)]

    def expert_factors(self) -> dict[int, float]:
        """Per layer, the busiest expert's rows over the mean."""
        return {layer: busiest_over_mean(c) for layer, c in sorted(self.layers.items())}

    def device_factors(self) -> dict[int, float]:
        """Per layer, the busiest device's rows over the mean."""
        return {layer: busiest_over_mean(self.device_rows(c)) for layer, c in sorted(self.layers.items())}

    def summary(self) -> dict[str, Any]:
        """Tokens per expert and rows per device summed over the layers, and the imbalance factors: per
        layer the busiest over the mean, then the mean over layers and the worst layer (its index too)."""
        ef, df = self.expert_factors(), self.device_factors()
        worst_e, worst_d = max(ef, key=ef.__getitem__), max(df, key=df.__getitem__)
        return {"tokens_per_expert": self.tokens_per_expert, "rows_per_ep_rank": self.rows_per_device,
                "per_layer": {str(k): list(v) for k, v in sorted(self.layers.items())},
                "expert_imbalance": statistics.fmean(ef.values()), "expert_imbalance_max": ef[worst_e],
                "expert_imbalance_worst_layer": worst_e,
                "ep_imbalance": statistics.fmean(df.values()), "ep_imbalance_max": df[worst_d],
                "ep_imbalance_worst_layer": worst_d, "devices": self.devices, "ep": self.ep, "tp": self.tp}

    def to_dict(self) -> dict[str, Any]:
        return {"layers": {str(k): list(v) for k, v in sorted(self.layers.items())}, "ep": self.ep, "tp": self.tp,
                "scope": self.scope}

    @staticmethod
    def from_dict(d: Any, where: str = "expert_load") -> "ExpertLoad":
        """Checked against the schema (module doc) and the limits of :mod:`braid.io.limits`; else a :class:`TraceError`."""
        if not isinstance(d, dict):
            raise TraceError(f"{where} must be an object, got {type(d).__name__}")
        extra = sorted(set(d) - {"layers", "ep", "tp", "scope"})
        if extra:
            raise TraceError(f"{where} has unknown key {extra[0][:40]!r}; keys: layers, ep, tp, scope")
        ep, tp, scope = d.get("ep", 1), d.get("tp", 1), d.get("scope", "")
        for name, v in (("ep", ep), ("tp", tp)):
            if not _is_int(v) or not 1 <= v <= COUNT_LIMITS[name]:
                raise TraceError(f"{where}.{name} must be a whole number in [1, {COUNT_LIMITS[name]}], got {repr(v)[:40]}")
        if not isinstance(scope, str) or len(scope) > 200:
            raise TraceError(f"{where}.scope must be text of at most 200 characters")
        layers = d.get("layers")
        if not isinstance(layers, dict) or not layers or len(layers) > MAX_LAYERS:
            raise TraceError(f"{where}.layers must map 1 to {MAX_LAYERS} MoE layers to their rows per expert")
        out: dict[int, tuple[int, ...]] = {}
        for key, counts in layers.items():
            layer = _int_text(key)
            if layer is None or layer >= MAX_LAYERS:
                raise TraceError(f"{where}.layers: {str(key)[:20]!r} is not a layer index (a whole number below {MAX_LAYERS})")
            if isinstance(counts, list) and len(counts) > MAX_EXPERTS:
                raise TraceError(f"{where}.layers[{key!r}] has {len(counts):,} experts, more than {MAX_EXPERTS:,}")
            if (not isinstance(counts, list) or not counts
                    or not all(_is_int(c) and 0 <= c < MAX_ROUTED_ROWS for c in counts)):
                raise TraceError(f"{where}.layers[{key!r}] must be a list of whole numbers >= 0 (rows per expert), "
                                 f"got {repr(counts)[:120]}")
            out[layer] = tuple(counts)
        experts = {len(c) for c in out.values()}
        if len(experts) > 1:
            raise TraceError(f"{where}.layers have different numbers of experts: {sorted(experts)[:4]}")
        n = experts.pop()
        if len(out) * n > MAX_EXPERT_LOAD_CELLS:
            raise TraceError(f"{where}: {len(out)} layers x {n} experts, more than {MAX_EXPERT_LOAD_CELLS:,} counts")
        if n % (ep * tp):
            raise TraceError(f"{where}: {n} experts do not shard over ep * tp = {ep * tp} devices")
        return ExpertLoad(dict(sorted(out.items())), ep, tp, scope)


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

    @property
    def expert_load(self) -> ExpertLoad | None:
        """The routed rows per expert the trace carries (``meta.expert_load``), or None."""
        got = self.meta.get("expert_load")
        return None if got is None else ExpertLoad.from_dict(got, "meta.expert_load")

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
        meta = dict(d.get("meta") or {})
        if meta.get("expert_load") is not None:
            ExpertLoad.from_dict(meta["expert_load"], f"{where}: meta.expert_load")
        imb = meta.get("moe_imbalance")
        if imb is not None and not (_finite(imb) and 1.0 <= imb <= 1e6):
            raise TraceError(f"{where}: meta.moe_imbalance must be a number in [1, 1e6] (the busiest expert-parallel "
                             f"rank's rows over the mean), got {repr(imb)[:40]}")
        return Trace(meta, events, memory)


_INT_FIELDS = ("mb", "chunk", "op_index", "peer")
_TEXT_FIELDS = ("unit", "block")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_text(x: Any) -> int | None:
    """A rank key of the memory map or a layer key of the expert load ("3"), or None if it is not a whole number >= 0
    (of at most 12 digits)."""
    return int(x) if isinstance(x, str) and x.isascii() and x.isdigit() and len(x) <= 12 else None


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
