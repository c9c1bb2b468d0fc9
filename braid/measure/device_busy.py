"""How long a GPU computes during one step: the union of its kernel and memset intervals in a
``torch.profiler`` trace of that step, NCCL kernels and copies left out.

The figure bounds what any schedule can do with the same kernels: a step is at least as long as
its busiest rank's compute, and no placement of the same work is shorter than the ranks' mean
(the work spread evenly, nothing idle). NCCL kernels are left out because a receive or an
all-reduce kernel spins on its stream until the peer arrives, which is waiting, not work; copies
(offload, P2P staging) run on copy engines beside the kernels. What remains is the compute a
schedule has to fit in, whether it runs as one CUDA graph replay (the profiler sees the graph's
kernels) or eagerly.

:func:`profile_step` also splits the step's idle time (its span less the busy time): *waiting for
a collective* -- a gap in the compute that ends as an NCCL kernel of the device ends, the next
kernel having waited for its result -- and *other idle* (dependencies between streams, launch
gaps). Two profiles of the same work with and without its collectives then say where the
collectives' cost went: kernels slowed beside them, waiting for them, or other gaps.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

COMPUTE_CATEGORIES = ("kernel", "gpu_memset")  # chrome-trace categories of device work; "gpu_memcpy" is left out


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"interval ends before it starts: ({start}, {end})")
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _device_work(events: list[dict[str, Any]], device: int, collectives: bool) -> Iterator[dict[str, Any]]:
    """The chrome-trace ``events`` (``torch.profiler``'s export) of work on CUDA ``device``: its
    NCCL kernels (``collectives``) or its compute -- kernels and memsets, NCCL kernels left out."""
    for e in events:
        if e.get("ph") != "X" or (e.get("args") or {}).get("device") != device:
            continue
        nccl = str(e.get("name", "")).startswith("nccl")
        if (e.get("cat") == "kernel" and nccl) if collectives else (e.get("cat") in COMPUTE_CATEGORIES and not nccl):
            yield e


def _compute_events(events: list[dict[str, Any]], device: int) -> Iterator[dict[str, Any]]:
    """The compute on CUDA ``device`` in ``events``: kernels and memsets, NCCL kernels left out."""
    return _device_work(events, device, collectives=False)


def compute_intervals(events: list[dict[str, Any]], device: int) -> list[tuple[float, float]]:
    """``(start, end)`` in microseconds of the compute on CUDA ``device`` (:func:`_compute_events`)."""
    return [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in _compute_events(events, device)]


def top_kernels(events: list[dict[str, Any]], device: int, n: int) -> list[tuple[str, float, int]]:
    """The ``n`` kernels (and memsets) of ``device`` with the most time in ``events``, NCCL's left out:
    ``(name, seconds, calls)``, most time first -- where two schedules' compute differs."""
    total: dict[str, tuple[float, int]] = {}
    for e in _compute_events(events, device):
        t, c = total.get(str(e.get("name", "")), (0.0, 0))
        total[str(e.get("name", ""))] = (t + float(e.get("dur", 0.0)) / 1e6, c + 1)
    return [(k, t, c) for k, (t, c) in sorted(total.items(), key=lambda kv: -kv[1][0])[:n]]


COLLECTIVE_SLACK_US = 15.0  # a gap ending this soon after an NCCL kernel ends waited for it (launch latency)


def _collective_ends(events: list[dict[str, Any]], device: int) -> list[float]:
    """End times (us) of the NCCL kernels of CUDA ``device`` in ``events``, sorted."""
    return sorted(float(e["ts"]) + float(e.get("dur", 0.0)) for e in _device_work(events, device, collectives=True))


def idle_split(events: list[dict[str, Any]], device: int, slack_us: float = COLLECTIVE_SLACK_US) -> tuple[float, float, float]:
    """``(span, waiting for a collective, other idle)`` in seconds of CUDA ``device``'s compute in
    ``events``: the span from its first compute start to its last compute end, and its gaps split
    by whether an NCCL kernel of the device ends inside the gap, at most ``slack_us`` before it
    closes (the next kernel waited for that collective)."""
    spans = sorted(compute_intervals(events, device))
    if not spans:
        return 0.0, 0.0, 0.0
    ends = _collective_ends(events, device)
    waiting = other = 0.0
    start, reach = spans[0]
    for s, e in spans[1:]:
        if s > reach:
            gap = s - reach
            if any(reach <= t <= s and t >= s - slack_us for t in ends):
                waiting += gap
            else:
                other += gap
        reach = max(reach, e)
    return (reach - start) / 1e6, waiting / 1e6, other / 1e6


@dataclass(frozen=True)
class StepProfile:
    """One profiled step of one device (seconds): ``busy_s + waiting_s + other_idle_s == span_s``."""

    span_s: float
    busy_s: float
    waiting_s: float  # compute idle until a collective ends
    other_idle_s: float
    top: list[tuple[str, float, int]]  # the kernels with the most time (top_kernels)

    @staticmethod
    def mean(profiles: Sequence["StepProfile"]) -> "StepProfile":
        """The mean of several profiles of the same step (still ``busy + waiting + other == span``);
        a kernel's time and calls are averaged over all of them (0 where one did not list it)."""
        if not profiles:
            raise ValueError("the mean of no step profiles")
        n = len(profiles)
        kernels: dict[str, tuple[float, int]] = {}
        for p in profiles:
            for name, t, calls in p.top:
                t0, c0 = kernels.get(name, (0.0, 0))
                kernels[name] = (t0 + t, c0 + calls)
        top = sorted(((k, t / n, round(c / n)) for k, (t, c) in kernels.items()), key=lambda x: -x[1])
        return StepProfile(sum(p.span_s for p in profiles) / n, sum(p.busy_s for p in profiles) / n,
                           sum(p.waiting_s for p in profiles) / n, sum(p.other_idle_s for p in profiles) / n, top)


STEP_MARK = "braid.profiled_step"  # the annotation around the profiled step when a prologue runs before it


def after_mark(events: list[dict[str, Any]], mark: str = STEP_MARK, required: bool = False) -> list[dict[str, Any]]:
    """The events of ``events`` that start at or after the CPU annotation ``mark`` starts (device
    work launched by a prologue before it left out); all of them where the mark is absent, or
    (``required``) a RuntimeError."""
    starts = [float(e["ts"]) for e in events if e.get("ph") == "X" and e.get("name") == mark and e.get("cat") == "user_annotation"]
    if not starts:
        if required:
            raise RuntimeError(f"the profiled step's annotation {mark!r} is not in the trace: cannot leave the prologue out")
        return events
    t0 = min(starts)
    return [e for e in events if e.get("ph") != "X" or float(e.get("ts", t0)) >= t0]


def trace_events(prof: Any, keep: str | Path | None = None) -> list[dict[str, Any]]:
    """The chrome-trace events of a finished ``torch.profiler`` run; ``keep``: also write the trace there, gzipped."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        text = path.read_text()
    if keep is not None:
        Path(keep).write_bytes(gzip.compress(text.encode()))
    return json.loads(text).get("traceEvents", [])


def profile_step(fn: Callable[[], Any], device: torch.device, top: int = 0, keep: str | Path | None = None,
                 prologue: Callable[[], Any] | None = None) -> tuple[StepProfile, Any]:
    """Run ``fn`` once under ``torch.profiler`` (CUDA activity): ``device``'s :class:`StepProfile`
    and ``fn``'s result; ``keep``: also write the chrome trace there, gzipped (a timeline for
    Perfetto or ``chrome://tracing``). ``prologue`` runs under the profiler first and is left
    out of the profile (e.g. a barrier, so that ranks whose profilers started at different
    times start the step together); the CPU activity this needs (for the step's annotation)
    adds per-op overhead to an eager step's launches, not to a CUDA graph's replay. CUDA only."""
    if device.type != "cuda":
        raise ValueError(f"the compute busy time is read off the CUDA profiler; {device} is not a CUDA device")
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if prologue is not None else [])
    torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        if prologue is not None:
            prologue()
            torch.cuda.synchronize(device)
        with record_function(STEP_MARK):
            res = fn()
            torch.cuda.synchronize(device)
    events = after_mark(trace_events(prof, keep), required=prologue is not None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    span, waiting, other = idle_split(events, index)
    busy = union_length(compute_intervals(events, index)) / 1e6
    return StepProfile(span, busy, waiting, other, top_kernels(events, index, top)), res


def compute_busy_s(fn: Callable[[], Any], device: torch.device, top: int = 0
                   ) -> tuple[float, Any, list[tuple[str, float, int]]]:
    """Run ``fn`` once under ``torch.profiler`` and return the seconds ``device`` spent computing
    in it (see the module doc), ``fn``'s result and the ``top`` kernels with the most time
    (:func:`top_kernels`). CUDA only."""
    prof, res = profile_step(fn, device, top)
    return prof.busy_s, res, prof.top
