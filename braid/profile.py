"""``python -m braid.profile``: measure a cost file (``docs/costs.md``) on the machine it runs on.

The simulator is only as good as its costs. This profiler builds the executor's own model
chunks (:func:`braid.runtime.executor.build_rank_chunks`) for a layout (tp, pp, chunks,
layers per stage) and times every unit task of every chunk back to back, as the executor
runs them, through the very call the executor makes (``ModelChunk.run(mb, UnitTask)``):
forward, activation-backward and weight-backward, median of ``--iters`` runs (CUDA events
recorded between the tasks without synchronising on GPU, ``perf_counter`` on CPU), and on
GPU the host time to issue one unit task (``host_task_s``, the simulator's host lane). It also measures the TP all-reduce of a boundary activation alone and overlapped
with a GEMM (-> ``ar_slowdown``, paper Appendix F) and, on GPU, how much longer it takes
while GEMMs run beside it (-> ``ar_stretch``), the P2P time of the stage-boundary
activation, the host-copy bandwidth (pinned host<->device on GPU, a memcpy on CPU), and
the activation bytes each unit keeps (``torch.cuda.memory_allocated`` deltas on GPU, the
chunk's ``live_bytes()`` on CPU), what a split backward keeps until W, and on GPU each
unit's workspace (allocator peak during the unit above what it keeps: logits, MLP
intermediates), which the simulator holds while the unit runs.

Chunks are keyed by virtual stage in the written file, so one profile serves every
placement (loop or V) of the same stage split. It spawns ``tp * pp`` processes itself
(gloo on CPU, NCCL on GPU). Examples::

    python -m braid.profile --preset tiny --pp 2 --layers-per-stage 1 --seq 16 -o costs.json
    python -m braid.profile --preset 7b-layer --tp 2 --pp 1 --layers-per-stage 1 --seq 4096 --device cuda -o h200.json
    python -m braid.simulate --pp 2 --mbs 8 --tp 1 --costs costs.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from braid.autograd_calls import on_this_thread
from braid.braiding import AR_BACKWARD, AR_FORWARD, ChunkSpec, Unit, unit_tasks
from braid.cli import Parser, check_cpu_ranks, check_outputs, check_range, run_main
from braid.costs import ChunkCosts, CostModel, Layout, UnitCost, costs_to_dict, model_forward_flops
from braid.files import atomic_write_text
from braid.ir import OpKind, Placement, Plan, ScheduleConfig, stage_of
from braid.models.qwen2 import Qwen2Config
from braid.models_catalog import decoder_config, get_model
from braid.partition import chunk_specs

log = logging.getLogger(__name__)

# Per-layer shapes from the one preset list (braid.models_catalog); the profiler's own
# choices are one layer (--layers-per-stage sets the count) and the vocabulary of its head.
PRESETS: dict[str, Qwen2Config] = {
    "tiny": decoder_config(get_model("qwen2-toy"), layers=1, vocab_size=128),
    "small": decoder_config(get_model("qwen2-small"), layers=1, vocab_size=8192),
    "7b-layer": decoder_config(get_model("qwen2-7b"), layers=1, vocab_size=32768),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    """What to profile: model shape, layout and data shape (see the module doc).

    ``layers_per_stage``: decoder layers of each virtual stage (``pp * v`` entries);
    ``peak_flops``: the MFU denominator written to the file (0 = unknown).
    """

    model: Qwen2Config
    layers_per_stage: tuple[int, ...]
    seq: int = 16
    micro_batch_size: int = 1
    tp: int = 1
    pp: int = 1
    v: int = 2
    placement: Placement = "v"
    dtype: str = "float32"
    device: str = "cpu"
    iters: int = 5
    warmup: int = 1
    peak_flops: float = 0.0
    compile: bool | None = None  # compiled units (:mod:`braid.runtime.compiled`); None: on with CUDA
    tp_backend: str = "auto"  # braid.tp.comm backend, or "all": measure each and pick the best

    def __post_init__(self) -> None:
        Layout(self.tp, self.pp, self.v, self.placement)  # validates degrees and placement
        if self.tp_backend != "all":
            from braid.tp.comm import resolve_tp_backend

            resolve_tp_backend(self.tp_backend, self.device)  # one clear error for a backend that cannot run here
        if len(self.layers_per_stage) != self.pp * self.v:
            raise ValueError(f"layers_per_stage has {len(self.layers_per_stage)} entries; pp*v = {self.pp * self.v} stages need one each")
        if any(n < 1 for n in self.layers_per_stage):
            raise ValueError(f"every stage needs at least one layer, got {self.layers_per_stage}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.seq < 1 or self.micro_batch_size < 1 or self.iters < 1 or self.warmup < 0:
            raise ValueError("seq, micro_batch_size and iters must be >= 1 and warmup >= 0")
        for what, n in (("heads", self.model.heads), ("KV heads", self.model.kv_heads), ("ffn", self.model.ffn),
                        ("vocab", self.model.vocab_size)):
            if n % self.tp:
                raise ValueError(f"tp={self.tp} must divide the model's {what} ({n})")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.v, self.placement)

    def full_model(self) -> Qwen2Config:
        """The model config with as many layers as the stages hold."""
        return Qwen2Config(**{**asdict(self.model), "layers": sum(self.layers_per_stage)})

    def act_shape(self) -> tuple[int, int, int]:
        return (self.micro_batch_size, self.seq, self.model.hidden)


# ----------------------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, device: str, fn: Callable, args: tuple, out, parent: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from braid.runtime.distributed import Dist, exit_with_parent

    exit_with_parent(parent)

    d = Dist.init(rank, world, master_port=port, device=f"cuda:{rank}" if device == "cuda" else "cpu", timeout_s=600)
    try:
        out.put((rank, True, fn(d, *args)))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises
        import traceback

        from braid.runtime.distributed import PeerFailure

        d.abort.fail(err)
        try:
            first = d.abort.first_failure()
        except PeerFailure:  # the store went with rank 0
            first = None
        out.put((rank, False, (traceback.format_exc(), first)))
    finally:
        d.close()


_GRACE_AFTER_DEATH_S = 30.0


class JobFailed(RuntimeError):
    """A spawned job failed: the first line names the cause, the rest holds each failed rank's traceback."""


def launch(world: int, device: str, fn: Callable, *args: Any, timeout_s: float = 3600.0) -> list[Any]:
    """Run ``fn(dist, *args)`` on ``world`` spawned ranks (``fn`` module-level); results by rank.

    A failure becomes a :class:`JobFailed` here whose first line names the rank that failed
    first and its exception text (or the rank whose process died without a report, e.g.
    killed), followed by every failed rank's traceback. A dead rank never makes this wait
    for ``timeout_s``: the others fail fast (:class:`~braid.runtime.distributed.PeerLost`).
    """
    import queue

    import torch.multiprocessing as mp

    if device == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"{world} ranks need {world} GPUs; {torch.cuda.device_count()} visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, device, fn, args, out, os.getpid())) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    died: dict[int, str] = {}  # rank -> how its process ended without a report
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) + len(died) < world:
            try:
                r, ok, val = out.get(timeout=1.0)
                got[r] = (ok, val)
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in got or r in died or p.is_alive():
                    continue
                # a report put just before exiting may still be in the pipe: give it a moment
                if now - dead_since.setdefault(r, now) > 5.0:
                    died[r] = _exit_text(p.exitcode)
            if died and now - min(dead_since.values()) > _GRACE_AFTER_DEATH_S:
                # the job cannot finish without the dead rank; the others had time to fail on their own
                first = min((r for r in died if r in dead_since), key=dead_since.get)
                for r in sorted(set(range(world)) - set(got) - set(died)):
                    procs[r].kill()
                    died[r] = f"was stopped {_GRACE_AFTER_DEATH_S:g} s after rank {first} died"
            if now > deadline:
                missing = sorted(set(range(world)) - set(got) - set(died))
                raise JobFailed(f"ranks {missing} did not finish within {timeout_s} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, (ok, v) in sorted(got.items()) if not ok}
    if failed or died:
        firsts = [first for _, first in failed.values() if first is not None]
        lost = not firsts or firsts[0][1].startswith("PeerLost")
        if died and lost:  # nobody recorded why: the rank that died is the cause
            r = min((r for r in died if r in dead_since), key=dead_since.get)
            head = f"rank {r} died first: its process {died[r]} without a report"
        elif firsts:
            head = f"rank {firsts[0][0]} failed first: {firsts[0][1]}"
        else:
            head = f"ranks {sorted(failed)} failed"
        body = [f"--- rank {r} ---\n{tb}" for r, (tb, _) in failed.items()]
        body += [f"--- rank {r} ---\nits process {how}" for r, how in sorted(died.items())]
        raise JobFailed(head + "\n" + "\n".join(body))
    return [got[r][1] for r in range(world)]


def _exit_text(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    import signal

    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Progress:
    """A one-line progress bar on stderr (only where ``enabled``)."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total, self.label, self.done, self.enabled = max(1, total), label, 0, enabled

    def step(self, what: str = "") -> None:
        self.done += 1
        if self.enabled:
            n = int(30 * self.done / self.total)
            sys.stderr.write(f"\r{self.label} [{'#' * n}{'.' * (30 - n)}] {self.done}/{self.total} {what:<28}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


# ----------------------------------------------------------------------------------------
# Measurements on one rank
# ----------------------------------------------------------------------------------------
class _Timer:
    """Times callables: CUDA events on GPU, ``perf_counter`` on CPU.

    :meth:`time` times one callable alone (a sync before and after). Unit tasks are timed
    *back to back* instead, as the executor runs them: :meth:`lap_start` / :meth:`lap_end`
    record events around each task without synchronising, so the host runs ahead and the
    device sees the same queue it sees in a pipeline (timing a unit alone adds its launch
    gaps: 1.1-1.7x on H200); :meth:`seconds` resolves a lap after :meth:`sync`.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._cycles_per_s: float | None = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def hold(self, seconds: float) -> None:
        """GPU: keep the device busy for about ``seconds`` (a spin kernel), so that the host
        queues the work issued next before the device reaches it; the events recorded between
        those tasks then time the device alone, back to back, and the host's own time to issue
        them is measured apart (the host lane). No-op on CPU."""
        if not self.cuda or seconds <= 0:
            return
        if self._cycles_per_s is None:
            self.sync()
            n = 10_000_000
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(n)
            b.record()
            b.synchronize()
            self._cycles_per_s = n / max(a.elapsed_time(b) / 1e3, 1e-6)
        torch.cuda._sleep(int(seconds * self._cycles_per_s))

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        self.sync()
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3, out
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out

    def lap_start(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def lap_end(self, start: Any) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return (start, e)
        return time.perf_counter() - start

    def seconds(self, lap: Any) -> float:
        """Duration of a finished lap (on GPU, call :meth:`sync` first)."""
        if self.cuda:
            return lap[0].elapsed_time(lap[1]) / 1e3
        return lap

    def memory(self, chunk) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else chunk.live_bytes()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def workspace(self, before: int, after: int) -> int:
        """Bytes allocated on top of ``max(before, after)`` while the unit ran (0 on CPU: no allocator peak)."""
        return max(0, torch.cuda.max_memory_allocated(self.device) - max(before, after)) if self.cuda else 0


def _profile_chunk(chunk, spec: ChunkSpec, pc: ProfileConfig, timer: _Timer, tp_group, dev: torch.device,
                   progress: Progress) -> dict[str, Any]:
    """Per-instance unit times (median) and memory deltas of one chunk, one micro-batch at a time
    (backward calls on this thread, as the executor runs them)."""
    with on_this_thread():
        return _profile_chunk_units(chunk, spec, pc, timer, tp_group, dev, progress)


def _profile_chunk_units(chunk, spec: ChunkSpec, pc: ProfileConfig, timer: _Timer, tp_group, dev: torch.device,
                         progress: Progress) -> dict[str, Any]:
    dtype = _DTYPES[pc.dtype]
    vocab = pc.model.vocab_size
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, vocab, (pc.micro_batch_size, pc.seq), generator=g).to(dev)
    chunk.set_batch([tok], [tok])
    times: dict[tuple[str, str, int], list[float]] = {}
    mem: dict[tuple[str, str, int], int] = {}
    work: dict[tuple[str, str, int], int] = {}
    ar = lambda out, task: dist.all_reduce(out, group=tp_group) if (task.ar and out is not None and tp_group is not None) else None  # noqa: E731
    host: list[float] = []
    issue_s: dict[OpKind, float] = {}  # host time to issue each phase, from the last iteration
    for it in range(pc.warmup + pc.iters):
        keep = it >= pc.warmup
        if not spec.embed:
            chunk.set_input(0, torch.randn(pc.act_shape(), dtype=dtype, device=dev))
        for phase in (OpKind.F, OpKind.B, OpKind.W):
            tasks = unit_tasks(phase, spec)
            if phase is OpKind.B and not spec.head:
                chunk.set_output_grad(0, torch.randn(pc.act_shape(), dtype=dtype, device=dev) * 1e-3)
            timer.sync()
            # Fill the device queue: the host issues the whole phase while the device spins.
            timer.hold(2.0 * issue_s.get(phase, 0.025) + 0.005)
            laps = []
            p0 = time.perf_counter()
            for i, task in enumerate(tasks):
                key = (task.phase.value, task.unit.value, task.layer)
                before = timer.memory(chunk)
                timer.reset_peak()
                start = timer.lap_start()
                h0 = time.perf_counter()
                out = chunk.run(0, task)
                h1 = time.perf_counter()
                if phase is OpKind.B and i == len(tasks) - 1:
                    # The norm backward left for the end of the op (ModelChunk.end_backward) is
                    # real compute of this op: charge it to its last unit.
                    chunk.end_backward(0)
                lap = timer.lap_end(start)
                ar(out, task)  # outside the lap; the next unit's start waits for it, as in the executor
                if keep:
                    laps.append((key, lap))
                    host.append(h1 - h0)
                    after = timer.memory(chunk)
                    mem[key] = after - before
                    work[key] = max(work.get(key, 0), timer.workspace(before, after))
            issue_s[phase] = time.perf_counter() - p0
            timer.sync()
            for key, lap in laps:
                times.setdefault(key, []).append(timer.seconds(lap))
            if phase is OpKind.F:
                chunk.end_forward(0)
                if not spec.head:
                    chunk.pop_output(0)
            elif phase is OpKind.B and not spec.embed:
                chunk.pop_input_grad(0)
        progress.step(f"stage units {it + 1}/{pc.warmup + pc.iters}")
    return {"times": [[*k, statistics.median(v)] for k, v in times.items()], "mem": [[*k, b] for k, b in mem.items()],
            "work": [[*k, b] for k, b in work.items()],
            # Host time to issue one unit task (GPU: the host runs ahead of the device; on CPU
            # the unit times already hold it, so the host lane is off).
            "host_s": statistics.median(host) if (host and timer.cuda) else 0.0}


def _median_time(timer: _Timer, fn: Callable[[], Any], n: int) -> float:
    fn()
    return statistics.median(timer.time(fn)[0] for _ in range(n))


def _comm_figures(pc: ProfileConfig, groups, timer: _Timer, dev: torch.device, comm=None) -> dict[str, float]:
    """All-reduce alone and its slowdown of a concurrent GEMM; P2P of a boundary tensor; copy bandwidth.

    ``comm``: the TP all-reduce to measure (:class:`braid.tp.comm.TPComm`; default the groups')."""
    comm = comm if comm is not None else groups.tp_comm

    def all_reduce(t: torch.Tensor):
        return comm.all_reduce(t)

    dtype = _DTYPES[pc.dtype]
    n = max(5, 2 * pc.iters)
    x = torch.randn(pc.act_shape(), dtype=dtype, device=dev)
    out: dict[str, float] = {"ar_s": 0.0, "ar_slowdown": 1.0, "gemm_s": 0.0, "gemm_overlapped_s": 0.0, "p2p_s": 0.0,
                             "ar_stretch": 1.0}
    if pc.tp > 1:
        out["ar_s"] = ar = _median_time(timer, lambda: all_reduce(x).wait(), n)
        tokens = pc.micro_batch_size * pc.seq
        a = torch.randn(tokens, pc.model.hidden, dtype=dtype, device=dev)
        b = torch.randn(pc.model.hidden, pc.model.ffn // pc.tp, dtype=dtype, device=dev)
        one = _median_time(timer, lambda: a @ b, n)
        reps = max(1, int(0.8 * ar / one)) if one > 0 else 1  # GEMM work shorter than the all-reduce window

        def gemm() -> None:
            for _ in range(reps):
                a @ b

        alone = _median_time(timer, gemm, n)
        over = []
        for _ in range(n + 1):
            timer.sync()
            dist.barrier(group=groups.tp)
            work = all_reduce(x)
            over.append(timer.time(gemm)[0])
            work.wait()
        d = statistics.median(over[1:])
        # The simulator slows compute by f while an all-reduce is in flight (window ``ar``):
        # d = dur*f inside the window, else win + (dur - win/f). Solve for f.
        if d <= ar:
            f = d / alone
        else:
            f = ar / max(ar + alone - d, ar / 2.0)
        out.update(ar_slowdown=min(2.0, max(1.0, f)), gemm_s=alone, gemm_overlapped_s=d)
        if timer.cuda:
            out.update(_ar_stretch(x, groups.tp, a, b, ar, one, dev, n, all_reduce))
    if pc.pp > 1:
        me = groups.coords.pp
        nxt, prv = groups.pp_ranks[(me + 1) % pc.pp], groups.pp_ranks[(me - 1) % pc.pp]
        buf = torch.empty_like(x)

        def ring() -> None:
            ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, buf, prv)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        vals = []
        for _ in range(n + 1):
            dist.barrier(group=groups.pp)  # both sides posted together: the transfer, not the peer's lag
            vals.append(timer.time(ring)[0])
        out["p2p_s"] = statistics.median(vals[1:])
    out["copy_bytes_per_s"], out["copy_duplex_slowdown"] = measure_host_link(dev)
    return out


def _ar_stretch(x: torch.Tensor, group, a: torch.Tensor, b: torch.Tensor, ar: float, one: float,
                dev: torch.device, n: int, all_reduce: Callable[[torch.Tensor], Any] | None = None) -> dict[str, float]:
    """How much longer an all-reduce takes while compute runs beside it (CUDA; ``ar_stretch``),
    and how much longer the compute takes beside it (``gemm_slowdown``).

    Both ranks start together (a barrier, then a sync); the all-reduce is issued, then GEMMs
    that outlast it go to another stream, as the next unit task of a braided block would; the
    all-reduce's time is from its issue to its end on the issuing stream. Alone: the same
    without the GEMMs. The ratio of the medians, clamped to [1, 4]. The GEMMs' own time on
    their stream, over the same GEMMs alone, is the slowdown the all-reduce causes; the time
    until both are done (``together_s``) is what a braided block pays for the pair.
    """
    if all_reduce is None:
        all_reduce = lambda t: dist.all_reduce(t, group=group, async_op=True)  # noqa: E731
    side = torch.cuda.Stream(device=dev)
    reps = max(1, int(3 * ar / one)) if one > 0 else 1

    def timed(with_ar: bool, with_gemm: bool) -> tuple[float, float, float]:
        ar_t, gemm_t, both_t = [], [], []
        for _ in range(n + 1):
            torch.cuda.synchronize(dev)
            dist.barrier(group=group)
            torch.cuda.synchronize(dev)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            gs, ge = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            work = all_reduce(x) if with_ar else None
            if with_gemm:
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    gs.record(side)
                    for _ in range(reps):
                        a @ b
                    ge.record(side)
            if work is not None:
                work.wait()
            e.record()
            torch.cuda.synchronize(dev)
            ar_t.append(s.elapsed_time(e) / 1e3 if with_ar else 0.0)
            gemm_t.append(gs.elapsed_time(ge) / 1e3 if with_gemm else 0.0)
            both_t.append(max(s.elapsed_time(e), s.elapsed_time(ge) if with_gemm else 0.0) / 1e3)
        return tuple(statistics.median(v[1:]) for v in (ar_t, gemm_t, both_t))  # type: ignore[return-value]

    alone = timed(True, False)[0]
    gemm_alone = timed(False, True)[1]
    beside, gemm_beside, together = timed(True, True)
    return {"ar_alone_s": alone, "ar_beside_s": beside, "ar_stretch": min(4.0, max(1.0, beside / alone)) if alone > 0 else 1.0,
            "gemm_alone_s": gemm_alone, "gemm_beside_s": gemm_beside,
            "gemm_slowdown": gemm_beside / gemm_alone if gemm_alone > 0 else 1.0, "together_s": together}


def compare_tp_backends(pc: ProfileConfig, groups, dev: torch.device, backends: Sequence[str] | None = None) -> dict[str, Any]:
    """Each available TP backend alone and beside GEMMs (collective); the best for braiding.

    For every backend of :mod:`braid.tp.comm` that can run here: the all-reduce of a boundary
    activation alone, its stretch beside GEMMs that outlast it, the GEMMs' slowdown, and the
    time until both are done. The best backend for braided execution is the one whose
    all-reduce plus the compute beside it finish first (``together_s``): a braided block
    hides the all-reduce, so what counts is what it costs the GEMMs and how long it still
    sticks out. Backends that cannot be created here are listed with the reason.
    """
    from braid.tp.comm import CUDA_BACKENDS, TPBackendError, make_tp_comm

    if dev.type != "cuda" or pc.tp == 1:
        return {"chosen": "gloo" if dev.type != "cuda" else groups.tp_backend, "backends": {}}
    dtype = _DTYPES[pc.dtype]
    n = max(5, 2 * pc.iters)
    x = torch.randn(pc.act_shape(), dtype=dtype, device=dev)
    tokens = pc.micro_batch_size * pc.seq
    a = torch.randn(tokens, pc.model.hidden, dtype=dtype, device=dev)
    b = torch.randn(pc.model.hidden, pc.model.ffn // pc.tp, dtype=dtype, device=dev)
    timer = _Timer(dev)
    one = _median_time(timer, lambda: a @ b, n)
    figures: dict[str, Any] = {}
    for name in backends or CUDA_BACKENDS:
        try:
            comm = make_tp_comm(groups, name)
            ar = _median_time(timer, lambda: comm.all_reduce(x).wait(), n)
            figures[name] = {"ar_s": ar, **_ar_stretch(x, groups.tp, a, b, ar, one, dev, n, comm.all_reduce)}
        except (TPBackendError, RuntimeError) as err:  # not available with this torch / NCCL / machine
            figures[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        dist.barrier()
    usable = {k: v for k, v in figures.items() if "error" not in v}
    chosen = min(usable, key=lambda k: usable[k]["together_s"]) if usable else groups.tp_backend
    return {"chosen": chosen, "backends": figures}


def measure_host_link(device: torch.device, nbytes: int | None = None, iters: int = 5) -> tuple[float, float]:
    """Host<->device copy bandwidth per direction (bytes/s) and its duplex slowdown.

    CUDA: pinned host buffers and non-blocking copies, each direction on a stream of its own
    as the offload runtime issues them. The bandwidth is the slower direction's, alone; the
    slowdown is the time of one copy in each direction at once over that (1 = full-duplex
    link, 2 = the directions share it). CPU: a memcpy (offload copies there are synchronous
    and never overlap, so the slowdown is 1).
    """
    timer = _Timer(device)
    if device.type != "cuda":
        n = nbytes or 16 << 20
        src, dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        return n / _median_time(timer, lambda: dst.copy_(src), iters), 1.0
    n = nbytes or 128 << 20
    host_in, host_out = (torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    dev_in, dev_out = (torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2))
    main = torch.cuda.current_stream(device)
    streams = {"h2d": torch.cuda.Stream(device), "d2h": torch.cuda.Stream(device)}
    copies = {"h2d": lambda: dev_in.copy_(host_in, non_blocking=True),
              "d2h": lambda: host_out.copy_(dev_out, non_blocking=True)}

    def run(*which: str) -> Callable[[], None]:
        def go() -> None:
            for w in which:
                streams[w].wait_stream(main)
                with torch.cuda.stream(streams[w]):
                    copies[w]()
            for w in which:
                main.wait_stream(streams[w])
        return go

    alone = max(_median_time(timer, run("h2d"), iters), _median_time(timer, run("d2h"), iters))
    both = _median_time(timer, run("h2d", "d2h"), iters)
    return n / alone, min(2.0, max(1.0, both / alone))


def build_chunks(pc: ProfileConfig, groups, dev: torch.device, m: int = 1, plan: Plan | None = None) -> dict:
    """This rank's TP-sharded model chunks on ``dev`` (same seed on every rank, so shards agree)."""
    from braid.models.qwen2 import Qwen2Model
    from braid.runtime.executor import build_rank_chunks

    plan = plan or Plan("profile", ScheduleConfig(pc.pp, m, pc.v), pc.placement, tuple(() for _ in range(pc.pp)))
    torch.manual_seed(1234)
    with torch.device("cpu"):
        model = Qwen2Model(pc.full_model()).to(_DTYPES[pc.dtype])
    tp_group = groups.tp if pc.tp > 1 else None
    chunks = build_rank_chunks(model, plan, groups.coords.pp, pc.layers_per_stage, tp_rank=groups.coords.tp,
                               tp_size=pc.tp, tp_group=tp_group)
    from braid.runtime.compiled import resolve, set_compiled

    set_compiled(chunks.values(), resolve(pc.compile, dev))  # units timed as the executor runs them
    return {c: ch.to(dev) for c, ch in chunks.items()}


def tp_comm_for(pc: ProfileConfig, groups, dev: torch.device) -> tuple[Any, dict[str, Any] | None]:
    """The TP all-reduce a run of ``pc`` uses (collective): ``pc.tp_backend``, or with ``"all"``
    the best of :func:`compare_tp_backends` (returned with the comparison)."""
    from braid.tp.comm import make_tp_comm, resolve_tp_backend

    if pc.tp_backend == "all":
        choice = compare_tp_backends(pc, groups, dev)
        return make_tp_comm(groups, choice["chosen"]), choice
    return make_tp_comm(groups, resolve_tp_backend(pc.tp_backend, dev)), None


def measure_rank(d, pc: ProfileConfig, groups, chunks: dict | None = None, comm=None,
                 choice: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything this rank measures (collective: every rank of the layout calls it).

    ``comm``: the TP all-reduce to measure (default: :func:`tp_comm_for`); ``choice``: the
    backend comparison it came from, if any (written to the cost file's meta)."""
    dev = d.device
    if comm is None:
        comm, choice = tp_comm_for(pc, groups, dev)
    timer = _Timer(dev)
    chunks = chunks if chunks is not None else build_chunks(pc, groups, dev)
    progress = Progress(pc.v * (pc.warmup + pc.iters), "profile", enabled=d.rank == 0)
    stages = {}
    for c, ch in sorted(chunks.items()):
        stage = stage_of(pc.placement, pc.pp, groups.coords.pp, c)
        stages[stage] = _profile_chunk(ch, ch.spec, pc, timer, groups.tp if pc.tp > 1 else None, dev, progress)
        ch.zero_grad(set_to_none=True)
    return {"rank": d.rank, "stages": stages, "comm": _comm_figures(pc, groups, timer, dev, comm),
            "tp_backend": comm.backend, "tp_backends": choice}


# ----------------------------------------------------------------------------------------
# From measurements to a cost model
# ----------------------------------------------------------------------------------------
def _unit_costs(entries: list[dict[str, Any]], spec: ChunkSpec, ar_s: float) -> dict[Unit, UnitCost]:
    """Average the per-instance medians (over layers and TP ranks) into one cost per unit kind."""
    t: dict[tuple[str, str], list[float]] = {}
    m: dict[tuple[str, str], list[float]] = {}
    work: dict[str, float] = {}  # unit -> the most workspace any of its instances and phases took
    for e in entries:
        for _ph, u, _layer, b in e.get("work", ()):
            work[u] = max(work.get(u, 0.0), float(b))
        for ph, u, _layer, v in e["times"]:
            t.setdefault((ph, u), []).append(v)
        for ph, u, _layer, b in e["mem"]:
            m.setdefault((ph, u), []).append(b)
    mean = lambda d, k: statistics.fmean(d[k]) if k in d else 0.0  # noqa: E731
    units = sorted({u for _, u in t}, key=[x.value for x in Unit].index)
    count = {u: (1 if Unit(u) in (Unit.EMBED, Unit.HEAD) else spec.layers) for u in units}
    act = {u: max(0.0, mean(m, ("F", u))) for u in units}
    kept = {u: mean(m, ("F", u)) + mean(m, ("B", u)) for u in units}
    # Boxes freed one unit late (norm backward at the start of the next unit) can make a
    # unit's own figure negative: keep the chunk total, spread over the non-negative ones.
    total_kept = max(0.0, sum(kept[u] * count[u] for u in units))
    pos = {u: max(0.0, kept[u]) for u in units}
    norm = sum(pos[u] * count[u] for u in units)
    w_res = {u: (pos[u] * total_kept / norm if norm > 0 else 0.0) for u in units}
    out = {}
    for u in units:
        unit = Unit(u)
        out[unit] = UnitCost(mean(t, ("F", u)), mean(t, ("B", u)), mean(t, ("W", u)),
                             ar_s if unit in AR_FORWARD else 0.0, ar_s if unit in AR_BACKWARD else 0.0, act[u], w_res[u],
                             work.get(u, 0.0))
    return out


def assemble(pc: ProfileConfig, results: Sequence[dict[str, Any]]) -> CostModel:
    """The cost model of the layout from every rank's :func:`measure_rank` result."""
    from braid.models_catalog import ModelConfig

    specs = chunk_specs(pc.layers_per_stage, pc.pp, pc.placement)
    comm = [r["comm"] for r in results]
    ar_s = max(c["ar_s"] for c in comm)
    p2p = max(c["p2p_s"] for c in comm)
    chunks = {}
    for (rank, c), spec in specs.items():
        stage = stage_of(pc.placement, pc.pp, rank, c)
        entries = [r["stages"][stage] for r in results if stage in r["stages"]]
        chunks[(rank, c)] = ChunkCosts(spec, _unit_costs(entries, spec, ar_s), p2p)
    ma = statistics.fmean(cc.total("act") for cc in chunks.values())
    mcfg = pc.model
    mc = ModelConfig("profiled", sum(pc.layers_per_stage), mcfg.hidden, mcfg.heads, mcfg.kv_heads, mcfg.ffn,
                     mcfg.vocab_size, pc.seq, pc.micro_batch_size, torch.finfo(_DTYPES[pc.dtype]).bits // 8)
    meta = {"config": {**asdict(pc), "model": asdict(pc.model)}, "device": _device_name(pc.device),
            "torch": torch.__version__, "comm": {k: statistics.fmean(c[k] for c in comm) for k in comm[0]},
            "tp_backend": results[0].get("tp_backend", "gloo")}
    if results[0].get("tp_backends"):
        meta["tp_backends"] = results[0]["tp_backends"]
    return CostModel(pc.layout, chunks, ma, statistics.fmean(c["copy_bytes_per_s"] for c in comm), False,
                     max(c["ar_slowdown"] for c in comm), pc.micro_batch_size, pc.seq,
                     3 * model_forward_flops(mc) / pc.micro_batch_size, pc.peak_flops, "profile", meta,
                     copy_duplex_slowdown=max(c["copy_duplex_slowdown"] for c in comm),
                     ar_stretch=max(c["ar_stretch"] for c in comm),
                     host_task_s=statistics.fmean(st.get("host_s", 0.0) for r in results for st in r["stages"].values()))


def profile_to_dict(costs: CostModel) -> dict[str, Any]:
    """The cost-file form (``braid-costs/1``) with chunks keyed by virtual stage (any placement reads it)."""
    d = costs_to_dict(costs)
    lay = costs.layout
    d["chunks"] = {str(stage_of(lay.placement, lay.p, *map(int, k.split(",")))): v for k, v in d["chunks"].items()}
    return d


def _device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({os.cpu_count()} cores)"


def _profile_job(d, pc: ProfileConfig) -> dict[str, Any] | None:
    from braid.runtime.distributed import ProcessGroups
    from braid.topology import Topology

    groups = ProcessGroups.create(Topology(pc.world_size, pp=pc.pp, tp=pc.tp),
                                  tp_backend="auto" if pc.tp_backend == "all" else pc.tp_backend)
    res = measure_rank(d, pc, groups)
    gathered: list[Any] = [None] * pc.world_size
    dist.all_gather_object(gathered, res)
    return profile_to_dict(assemble(pc, gathered)) if d.rank == 0 else None


def profile(pc: ProfileConfig) -> dict[str, Any]:
    """Spawn the layout's ranks, measure, and return the cost-file dict."""
    return launch(pc.world_size, pc.device, _profile_job, pc)[0]


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------
def add_model_args(ap: argparse.ArgumentParser) -> None:
    """Flags shared with ``python -m braid.bench``: model, layout, data shape, device."""
    ap.add_argument("--preset", default="tiny", help=f"model shape preset: {', '.join(PRESETS)} (default tiny)")
    for flag in ("hidden", "heads", "kv-heads", "ffn", "vocab"):
        ap.add_argument(f"--{flag}", type=int, default=None, help=f"override the preset's {flag}")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (default 2)")
    ap.add_argument("--chunks", type=int, default=2, help="chunks (virtual stages) per rank (default 2)")
    ap.add_argument("--layers-per-stage", default="1", help="layers of each virtual stage: one number or a comma list (default 1)")
    ap.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    ap.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch (default 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when enough GPUs, else cpu")
    ap.add_argument("--dtype", choices=tuple(_DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--iters", type=int, default=5, help="measured repetitions per unit (median; default 5)")
    ap.add_argument("--peak-flops", type=float, default=None, help="MFU denominator per device (default: 989e12 on cuda, 0 on cpu)")
    ap.add_argument("--tp-backend", default="auto",
                    help="how TP all-reduces run (braid.tp.comm): auto, nccl-capped, nccl, nccl-zero-cta, symm-mem, gloo; "
                         "or 'all': measure each available one alone and beside a GEMM and use the best (default auto)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the units' element-wise functions (default: on with CUDA, off on CPU)")


def config_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace, placement: Placement = "v") -> ProfileConfig:
    """A :class:`ProfileConfig` from the shared flags; bad values exit with one line (code 2)."""
    if args.preset not in PRESETS:
        ap.error(f"unknown preset {args.preset!r}; valid names: {', '.join(PRESETS)}")
    for flag in ("hidden", "heads", "kv_heads", "ffn", "vocab", "tp", "pp", "chunks", "seq", "micro_batch_size", "iters"):
        val = getattr(args, flag)
        if val is not None and val < 1:
            ap.error(f"--{flag.replace('_', '-')} must be a positive integer, got {val}")
    check_range(ap, "--peak-flops", args.peak_flops, 0.0, 1e18)
    base = asdict(PRESETS[args.preset])
    for flag, key in (("hidden", "hidden"), ("heads", "heads"), ("kv_heads", "kv_heads"), ("ffn", "ffn"), ("vocab", "vocab_size")):
        if getattr(args, flag) is not None:
            base[key] = getattr(args, flag)
    world = args.tp * args.pp
    device = args.device or ("cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu")
    if device == "cuda" and torch.cuda.device_count() < world:
        ap.error(f"--device cuda with tp*pp = {world} ranks needs {world} GPUs; {torch.cuda.device_count()} visible")
    if device == "cpu":
        check_cpu_ranks(ap, world)
    from braid.runtime.compiled import resolve as resolve_compile

    try:
        try:
            lps = [int(x) for x in str(args.layers_per_stage).split(",")]
        except ValueError:
            raise ValueError(f"--layers-per-stage must be a whole number or a comma list of them, "
                             f"got {args.layers_per_stage!r}") from None
        stages = args.pp * args.chunks
        if len(lps) == 1:
            lps = lps * stages
        model = Qwen2Config(**base)
        peak = args.peak_flops if args.peak_flops is not None else (989e12 if device == "cuda" else 0.0)
        return ProfileConfig(model, tuple(lps), args.seq, args.micro_batch_size, args.tp, args.pp, args.chunks,
                             placement if args.chunks == 2 else "loop", args.dtype or ("bfloat16" if device == "cuda" else "float32"),
                             device, args.iters, 1, peak, resolve_compile(args.compile, device), args.tp_backend)
    except ValueError as err:
        ap.error(str(err))
        raise  # unreachable: error() exits


def main(argv: Sequence[str] | None = None) -> int:
    ap = Parser(prog="python -m braid.profile", description=__doc__.split("\n\n")[1],
                epilog="Examples:\n" + __doc__.split("Examples::")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("-o", "--output", default="costs.json", help="cost file to write (default costs.json)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pc = config_from_args(ap, args)
    check_outputs(ap, [("-o", args.output)])
    try:
        doc = profile(pc)
    except JobFailed as err:
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        return 1
    atomic_write_text(args.output, json.dumps(doc, indent=1))
    c = doc["meta"]["comm"]
    log.info("wrote %s: %d stages on %s; all-reduce %.3g ms, ar_slowdown %.3f, ar_stretch %.2f, P2P %.3g ms, "
             "copy %.3g GB/s (x%.2f with both directions at once)", args.output, len(doc["chunks"]), doc["meta"]["device"],
             c["ar_s"] * 1e3, doc["ar_slowdown"], doc["ar_stretch"], c["p2p_s"] * 1e3, doc["pcie_bytes_per_s"] / 1e9,
             doc["copy_duplex_slowdown"])
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
