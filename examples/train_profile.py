"""``--profile DIR``: where one training step's time goes, per rank (the example loop's profiler).

The step ``--profile-step`` (default: the last) runs under ``torch.profiler`` with CPU and
CUDA activity. Each rank writes its chrome trace (``DIR/rank{r}.json.gz``, Perfetto opens
it) and rank 0 writes ``DIR/profile.txt`` and ``DIR/profile.json``: per rank the step's
span on the device, the union of its compute kernels (busy), its idle time split into
waiting for a collective and other idle (:func:`braid.measure.device_busy.idle_split`:
dependencies between streams, launch gaps, a host that is late), the host time of the
step, the time the loop waited for a step's data (the loader's share of the critical path,
timed every step), the host's synchronisations with the device (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, ``cudaEventSynchronize``: count and time), and the CPU operators
and GPU kernels with the most time. A step whose device is idle while its host is busy is host-bound: the CPU
table says on what.

``--memory-snapshot FILE`` records the same step (``--profile-step``, default the last) under the
CUDA allocator's history instead or as well (:class:`StepSnapshot`, :mod:`braid.measure.snapshot`):
per rank torch's snapshot file, and on rank 0 every rank's blocks live at the step's peak, by term.

The profiler's CPU activity adds a few microseconds to each launched operator, so an
eager step profiled runs somewhat slower than unprofiled; a CUDA graph's replay is one
launch and is not slowed.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

# The driver calls in which the host waits for the device: their count and time say how often the host stalls
# (``aten::item`` and friends wait inside one of these, so they are not counted again).
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
TOP = 15


@dataclass
class RankProfile:
    """One rank's profiled step (seconds)."""

    rank: int
    step_s: float  # host wall time of the profiled step (forward, backward, optimizer)
    data_s: float  # the main thread's wait for a step's micro-batches, their copy to the device included (mean over the run)
    span_s: float | None = None  # the device's first to last kernel
    busy_s: float | None = None
    waiting_s: float | None = None
    other_idle_s: float | None = None
    syncs: dict[str, tuple[int, float]] = field(default_factory=dict)  # op -> (calls, host seconds)
    cpu_top: list[tuple[str, float, int]] = field(default_factory=list)  # (op, self CPU seconds, calls)
    gpu_top: list[tuple[str, float, int]] = field(default_factory=list)  # (kernel, seconds, calls)


class StepProfiler:
    """Profiles the step ``at`` (1-based) of a run and writes the report (see the module doc)."""

    def __init__(self, out: str | Path, at: int, device: torch.device, rank: int) -> None:
        self.out, self.at, self.device, self.rank = Path(out), at, device, rank
        self.data_times: list[float] = []
        self.result: RankProfile | None = None

    def time_data(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (this step's micro-batches), timed: the data loader's share of the step."""
        t0 = time.perf_counter()
        out = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # host-to-device copies of the batch are part of preparing it
        self.data_times.append(time.perf_counter() - t0)
        return out

    @contextlib.contextmanager
    def step(self, step: int):
        """Profile the body when ``step`` is the profiled one; otherwise run it as is."""
        if step != self.at:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize(self.device)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            yield
            if cuda:
                torch.cuda.synchronize(self.device)
            wall = time.perf_counter() - t0
        self.result = self._read(prof, wall)

    def _read(self, prof: Any, wall: float) -> RankProfile:
        from braid.measure.device_busy import compute_intervals, idle_split, top_kernels, trace_events, union_length

        self.out.mkdir(parents=True, exist_ok=True)
        events = trace_events(prof, keep=self.out / f"rank{self.rank}.json.gz")
        data = sum(self.data_times) / max(1, len(self.data_times))
        res = RankProfile(self.rank, wall, data)
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            res.span_s, res.waiting_s, res.other_idle_s = idle_split(events, index)
            res.busy_s = union_length(compute_intervals(events, index)) / 1e6
            res.gpu_top = top_kernels(events, index, TOP)
        cpu: dict[str, list[float]] = {}
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation"):
                slot = cpu.setdefault(e["name"], [0.0, 0])
                slot[0] += float(e.get("dur", 0.0)) / 1e6
                slot[1] += 1
        res.syncs = {k: (int(v[1]), v[0]) for k, v in cpu.items() if k in SYNC_OPS}
        # Self time would need the nesting; inclusive time of the top-level operators reads well enough for a hunt.
        res.cpu_top = sorted(((k, v[0], int(v[1])) for k, v in cpu.items()), key=lambda x: -x[1])[:TOP]
        return res


def gather_and_write(prof: StepProfiler, world: int, note: str) -> None:
    """Gather every rank's :class:`RankProfile` to rank 0, which writes ``profile.txt`` and ``profile.json``."""
    import torch.distributed as dist

    mine = asdict(prof.result) if prof.result is not None else None
    got: list[Any] | None = [None] * world if prof.rank == 0 else None
    if world > 1:
        dist.gather_object(mine, got, dst=0)
    else:
        got = [mine]
    if prof.rank != 0:
        return
    ranks = [g for g in got if g is not None]
    text = format_profiles(ranks, note)
    (prof.out / "profile.txt").write_text(text)
    (prof.out / "profile.json").write_text(json.dumps({"note": note, "step": prof.at, "ranks": ranks}, indent=1))
    print(text, flush=True)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:9.1f}"


def format_profiles(ranks: list[dict[str, Any]], note: str) -> str:
    """The per-rank table, then each rank's host synchronisations and top CPU operators / GPU kernels."""
    lines = [f"profiled step: {note}",
             f"{'rank':>4} {'step ms':>9} {'data ms':>9} {'span ms':>9} {'busy ms':>9} {'wait ms':>9} {'idle ms':>9} {'busy %':>7}"]
    for r in ranks:
        busy = "" if not r["span_s"] else f"{100 * r['busy_s'] / r['span_s']:6.1f}%"
        lines.append(f"{r['rank']:>4} {_ms(r['step_s'])} {_ms(r['data_s'])} {_ms(r['span_s'])} {_ms(r['busy_s'])} "
                     f"{_ms(r['waiting_s'])} {_ms(r['other_idle_s'])} {busy:>7}")
    lines.append("(span: the device's first to last kernel of the step; busy: union of compute kernels, NCCL left out; "
                 "wait: compute idle until a collective ends; idle: other gaps -- a late host, stream dependencies)")
    for r in ranks:
        lines.append(f"\nrank {r['rank']}: host synchronisations: "
                     + (", ".join(f"{k} x{c} ({t * 1e3:.1f} ms)" for k, (c, t) in sorted(r["syncs"].items())) or "none"))
        lines.append("  CPU (inclusive ms, calls): " + "; ".join(f"{n} {t * 1e3:.1f} x{c}" for n, t, c in r["cpu_top"]))
        if r["gpu_top"]:
            lines.append("  GPU kernels (ms, calls): " + "; ".join(f"{n[:60]} {t * 1e3:.1f} x{c}" for n, t, c in r["gpu_top"]))
    return "\n".join(lines) + "\n"


class StepSnapshot:
    """``--memory-snapshot FILE``: step ``at`` (1-based) runs under the CUDA allocator's history
    (:func:`braid.measure.snapshot.record_step`); each rank writes its snapshot file and keeps the
    attribution, and :meth:`gather_and_print` prints every rank's on rank 0. The blocks still live
    after the step are named by the tensors they hold: weights, gradients, optimizer state."""

    def __init__(self, path: str, at: int, device: torch.device, rank: int, world: int) -> None:
        from braid.measure.snapshot import rank_path

        self.path, self.at, self.device, self.rank = rank_path(path, rank, world), at, device, rank
        self.result: dict[str, Any] | None = None

    def run(self, step: int, fn: Callable[[], Any], params: list[torch.Tensor], opt: Any) -> Any:
        """``fn()`` (the training step), recorded when ``step`` is the chosen one."""
        if step != self.at:
            return fn()
        from braid.measure.snapshot import record_step, tensor_labels

        got: list[Any] = []
        grads = [g for p in params for g in (p.grad, getattr(p, "main_grad", None))]
        att = record_step(lambda: got.append(fn()), self.path, self.device,
                          lambda: tensor_labels(weights=params, gradients=grads, optimizer_state=opt))
        self.result = {"file": str(self.path), "rank": self.rank, **asdict(att)}
        return got[0]

    def gather_and_print(self, world: int, note: str) -> None:
        """Every rank's attribution to rank 0, which prints them (the ranks that recorded nothing send None)."""
        import torch.distributed as dist

        from braid.measure.snapshot import format_attribution

        got: list[Any] | None = [None] * world if self.rank == 0 else None
        if world > 1:
            dist.gather_object(self.result, got, dst=0)
        else:
            got = [self.result]
        if self.rank == 0:
            for att in (g for g in got if g is not None):
                print("\n".join(format_attribution(att, f"memory snapshot, {note}, rank {att['rank']} ({att['file']})")),
                      flush=True)
