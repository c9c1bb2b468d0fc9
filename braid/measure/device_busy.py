"""How long a GPU computes during one step: the union of its kernel and memset intervals in a
``torch.profiler`` trace of that step, NCCL kernels and copies left out.

The figure bounds what any schedule can do with the same kernels: a step is at least as long as
its busiest rank's compute, and no placement of the same work is shorter than the ranks' mean
(the work spread evenly, nothing idle). NCCL kernels are left out because a receive or an
all-reduce kernel spins on its stream until the peer arrives, which is waiting, not work; copies
(offload, P2P staging) run on copy engines beside the kernels. What remains is the compute a
schedule has to fit in, whether it runs as one CUDA graph replay (the profiler sees the graph's
kernels) or eagerly.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable, Iterator
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


def _compute_events(events: list[dict[str, Any]], device: int) -> Iterator[dict[str, Any]]:
    """The chrome-trace ``events`` (``torch.profiler``'s export) of compute on CUDA ``device``:
    kernels and memsets, NCCL kernels left out."""
    for e in events:
        if (e.get("ph") == "X" and e.get("cat") in COMPUTE_CATEGORIES and (e.get("args") or {}).get("device") == device
                and not str(e.get("name", "")).startswith("nccl")):
            yield e


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


def compute_busy_s(fn: Callable[[], Any], device: torch.device, top: int = 0
                   ) -> tuple[float, Any, list[tuple[str, float, int]]]:
    """Run ``fn`` once under ``torch.profiler`` (CUDA activity) and return the seconds ``device``
    spent computing in it (see the module doc), ``fn``'s result and the ``top`` kernels with the
    most time (:func:`top_kernels`). CUDA only."""
    if device.type != "cuda":
        raise ValueError(f"the compute busy time is read off the CUDA profiler; {device} is not a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        res = fn()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    index = device.index if device.index is not None else torch.cuda.current_device()
    return union_length(compute_intervals(events, index)) / 1e6, res, top_kernels(events, index, top)
