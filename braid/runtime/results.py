"""What a step of the executor records and returns: the record modes, the clock of its trace
marks, the step result and the error naming a broken program invariant."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from braid.core.braiding import Comm
from braid.io.trace import Event, Trace


class ExecutionError(RuntimeError):
    """An invariant of the program was broken on this rank (names rank, instruction and micro-batch)."""


Record = Literal["units", "instructions", "off"]


RECORD_MODES: tuple[str, ...] = ("units", "instructions", "off")


def check_record(record: str) -> Record:
    if record not in RECORD_MODES:
        raise ValueError(f"record={record!r}: choose one of {', '.join(RECORD_MODES)}")
    return record  # type: ignore[return-value]


class _Clock:
    """Timestamps: CUDA events on GPU (resolved at the end of the step), ``perf_counter`` on CPU.

    ``enabled=False`` (recording off): every mark is ``None`` and costs one call.
    """

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self.t0 = self.mark()

    def mark(self) -> Any:
        if not self.enabled:
            return None
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, m: Any) -> float:
        if self.cuda:
            return self.t0.elapsed_time(m) / 1e3
        return m - self.t0


@dataclass(slots=True)
class StepResult:
    """What one run of a program produced on this rank.

    The loss stays on the device until it is read: reading ``loss`` waits for the step's
    kernels, so a caller that launches its optimizer step first keeps the device busy
    meanwhile (a float taken inside ``run`` would leave the device idle while the host
    launches the optimizer).
    """

    loss_tensor: torch.Tensor | None  # sum over micro-batches of loss/m, on the rank holding the last stage
    trace: Trace
    counts: dict[str, int] = field(default_factory=dict)  # executed braided blocks, W units, ...

    @property
    def loss(self) -> float | None:
        """The step's loss as a Python float (waits for the device), or None off the last stage."""
        return None if self.loss_tensor is None else float(self.loss_tensor)


def measured_trace(meta: dict[str, Any], rank: int, raw: list[tuple], exposed: list[tuple[Any, Any, Comm]],
                   memory: list[tuple[Any, int]], sec: Any, *, units: bool) -> Trace:
    """The executor's trace of one step: its raw events (lane, name, kind, start mark, end mark, mb, chunk,
    unit, block, index, peer), the waits for its collectives (start mark, end mark, kind) and its memory
    series, the marks turned into seconds by ``sec``; ``units``: single units were timed, so the summary
    gets the exposed and spanned collective time (all-to-all's only where the step had any)."""
    events = [Event(rank, lane, name, kind, sec(s), max(0.0, sec(e) - sec(s)), mb, chunk, unit, block, idx, peer)
              for lane, name, kind, s, e, mb, chunk, unit, block, idx, peer in raw]
    summary = meta["summary"]
    if units:
        for comm, key in ((Comm.AR, "ar"), (Comm.A2A, "a2a")):
            if comm is Comm.AR or any(c is comm for _, _, c in exposed):
                summary[f"exposed_{key}_s"] = sum(max(0.0, sec(e) - sec(b)) for b, e, c in exposed if c is comm)
                summary[f"{key}_span_s"] = sum(ev.dur for ev in events if ev.kind == comm.value)
    return Trace(meta, events, {rank: [(sec(t), b) for t, b in memory]})
