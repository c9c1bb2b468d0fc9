"""Braided F&B blocks vs the same work as F then BW, one pipeline stage, TP=2 (paper Sec. 3, App. F).

Spawns two processes (NCCL on GPUs, gloo on CPU). Program, m micro-batches:
braided ``F0 F1&BW0 F2&BW1 ... BW(m-1)``; plain ``F0 F1 BW0 F2 BW1 ... BW(m-1)`` -- the
same units, without interleaving. Prints the step-time ratio and the all-reduce wait time
left exposed on the compute stream (from the measured trace) for both, per TP communication
backend (:mod:`braid.tp.comm`), with the backend's GEMM slowdown (GEMMs with its
all-reduce beside them over the same GEMMs alone, ``braid.profile``'s measurement).

Steps are timed as they train (``record="off"``), as whole-step CUDA graphs where the backend
can be captured (``--cuda-graph``, default ``step`` on GPU; ``symm-mem`` runs eager), so the
host's launch time is not in the comparison. The all-reduce time left exposed is the step
time with the units' all-reduces over the step time of the same program with them skipped
(a timing-only run: its sums are wrong), and ``AR hidden`` is the braided step's exposed
time over the time the step's all-reduces take alone (the step's count of them issued back to
back with nothing beside them, median of 5 bursts), subtracted from 1. Both programs' first F
and last BW have no partner; that pair is timed alone too (``ends exposed``), and ``hidden in
blocks`` is the same share for the all-reduces inside the braided blocks, the ends' exposed time
taken out.

``--profile [N]`` says where the exposed time goes: N more steps (default 3) of each program
with and without its all-reduces run under the profiler (both ranks starting each together),
and the difference of their mean spans is split into kernels slowed beside the all-reduces (busy time),
compute waiting for an all-reduce to end, and other idle time
(:func:`braid.measure.device_busy.idle_split`); ``--trace DIR`` keeps the first of those timelines.
Not for ``symm-mem``: its all-reduce waits in barrier kernels that spin beside the compute, so
its waiting would read as busy time.

    python benchmarks/bench_braided_overlap.py                             # GPU: Qwen2-7B-sized layers, seq 4096, bf16
    python benchmarks/bench_braided_overlap.py --tp-backend all            # every CUDA backend, side by side
    python benchmarks/bench_braided_overlap.py --tp-backend all --profile  # ... and where the exposed time goes
    python benchmarks/bench_braided_overlap.py --tiny                      # CPU smoke test
"""

from __future__ import annotations

import argparse
import statistics
from typing import TYPE_CHECKING

import torch
from _spawn import spawn_two

if TYPE_CHECKING:
    from braid.measure.device_busy import StepProfile


def _programs(m: int) -> dict[str, str]:
    """The two programs, and ``ends``: one micro-batch's F then BW, what both programs run unbraided
    (their first F and last BW have no partner) -- its exposed all-reduce time is what braiding
    cannot reach, so it is taken out of ``AR hidden in blocks``."""
    braided = ["F0c0"] + [f"F{i}c0&BW{i - 1}c0" for i in range(1, m)] + [f"BW{m - 1}c0"]
    plain = ["F0c0"] + [x for i in range(1, m) for x in (f"F{i}c0", f"BW{i - 1}c0")] + [f"BW{m - 1}c0"]
    return {"braided": "\n".join(braided), "plain": "\n".join(plain), "ends": "F0c0\nBW0c0"}


def _time(fn, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


class _Done:
    """The handle of an all-reduce that was skipped: nothing to wait for."""

    def wait(self, timeout: object | None = None) -> bool:  # dist.Work.wait's signature
        return True

    def is_completed(self) -> bool:
        return True


class _SkipAllReduce:
    """A TP communicator whose all-reduce does nothing (``backend`` kept: the same capture rules).
    For timing the step without its all-reduces only: the sums it leaves are wrong."""

    def __init__(self, backend: str, group) -> None:
        self.backend, self.group = backend, group

    def all_reduce(self, t: torch.Tensor) -> _Done:
        return _Done()

    def reduce(self, t: torch.Tensor) -> _Done:  # the executor's call for a unit's reduction (no sequence sharding here)
        return _Done()


def _step_s(ex, toks, mode: str, warmup: int, iters: int, device: torch.device, profiled: int = 0,
            keep: str | None = None) -> tuple[list[float], dict, str, StepProfile | None]:
    """Step times (s) of ``ex`` run ``warmup + iters`` times under CUDA-graph ``mode`` (the
    warm-up steps dropped), its op counts, the mode it got and, when ``profiled`` > 0 (CUDA),
    that many more steps under the profiler, both ranks starting each together: their mean
    :class:`~braid.measure.device_busy.StepProfile` (the first one's trace written to ``keep``)."""
    import time

    from braid.runtime.graphs import WARMUP_STEPS, step_runner

    runner = step_runner(ex, mode)
    if runner.mode == "step":
        warmup = max(warmup, WARMUP_STEPS + 1)
    times, counts = [], {}
    for it in range(warmup + iters):
        for ch in ex.chunks.values():
            ch.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        res = runner.run(toks, toks, record="off")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if it >= warmup:
            times.append(time.perf_counter() - t0)
        counts = res.counts or counts
    prof = None
    if profiled > 0 and device.type == "cuda":
        import torch.distributed as dist

        from braid.measure.device_busy import StepProfile, profile_step

        got = []
        for k in range(profiled):
            for ch in ex.chunks.values():
                ch.zero_grad(set_to_none=False)
            # the ranks start each profiled step together (the barrier runs once both profilers have started):
            # no wait for a late peer in it
            got.append(profile_step(lambda: runner.run(toks, toks, record="off"), device, PROFILE_KERNELS,
                                    keep if k == 0 else None, prologue=lambda: dist.barrier(group=ex.tp_group))[0])
        prof = StepProfile.mean(got)
    runner.release()
    return times, counts, runner.mode, prof


PROFILE_KERNELS = 400  # kernels kept per profiled step: every distinct kernel of these programs


def _worker(rank: int, args: argparse.Namespace, port: int, out) -> None:
    from braid.core.braiding import ChunkSpec
    from braid.core.ir import Plan, Program, ScheduleConfig
    from braid.models.build import build_chunk
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.runtime.distributed import Dist, ProcessGroups
    from braid.runtime.executor import Executor
    from braid.core.topology import Topology

    from braid.tp.comm import CUDA_BACKENDS, TPBackendError, make_tp_comm

    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() and not args.tiny else "cpu")
    d = Dist.init(rank, 2, master_port=port, device=device, timeout_s=300)
    groups = ProcessGroups.create(Topology(2, pp=1, tp=2), tp_max_ctas=args.tp_max_ctas)
    if args.tiny:
        cfg = Qwen2Config(vocab_size=64, hidden=64, layers=args.layers, heads=4, kv_heads=2, ffn=128)
        dtype, seq = torch.float32, 16
    else:
        cfg = Qwen2Config(vocab_size=1024, hidden=3584, layers=args.layers, heads=28, kv_heads=4, ffn=18944)
        dtype, seq = torch.bfloat16, args.seq
    from braid.models.build import materialize, meta_model

    model = materialize(meta_model(Qwen2Model, cfg, seed=0, dtype=dtype))  # by name, in one pass (same on both ranks)
    spec = ChunkSpec(cfg.layers, embed=True, head=True)
    chunk = build_chunk(model, spec, 0, tp_rank=rank, tp_size=2, tp_group=groups.tp, num_microbatches=args.mbs).to(device)
    del model
    toks = [torch.randint(0, cfg.vocab_size, (1, seq), device=device) for _ in range(args.mbs)]
    backends = ["gloo"] if device.type != "cuda" else (list(CUDA_BACKENDS) if args.tp_backend == ["all"] else args.tp_backend)
    results = {}
    progs = _programs(args.mbs)
    order = (["plain", "braided"] if args.plain_first else ["braided", "plain"]) + ["ends"]
    for backend in backends:
        try:
            comm = make_tp_comm(groups, backend, args.tp_max_ctas)
        except (TPBackendError, RuntimeError) as err:
            results[backend] = {"error": str(err).splitlines()[0]}
            continue
        row = {}
        mode = args.cuda_graph or ("step" if device.type == "cuda" and backend != "symm-mem" else "none")
        if backend == "symm-mem":
            mode = "none"  # symmetric memory's ops synchronise with the host: not capturable
        for name in order:
            text = progs[name]
            prog = Program.from_text(0, text)
            plan = Plan(name, ScheduleConfig(1, 1 if name == "ends" else args.mbs), "loop", ((),))
            got = {}
            for variant, c in (("ar", comm), ("skip", _SkipAllReduce(comm.backend, comm.group))):
                ex = Executor(plan, prog, {0: chunk}, pp_ranks=[rank], act_shape=(1, seq, cfg.hidden), dtype=dtype,
                              device=device, tp_group=groups.tp, abort=d.abort, tp_comm=c)
                keep = f"{args.trace}/{backend}_{name}_{variant}_rank{rank}.json.gz" if args.trace and name != "ends" else None
                # symm-mem's all-reduce waits in barrier kernels that spin beside the compute: its waiting would read as busy
                profiled = args.profile if name != "ends" and backend != "symm-mem" else 0
                got[variant] = _step_s(ex, toks[:plan.config.m], mode, args.warmup, args.iters, device,
                                       profiled=profiled, keep=keep if profiled else None)
            step, counts, ran = statistics.median(got["ar"][0]), got["ar"][1], got["ar"][2]
            row[name] = (step, max(step - statistics.median(got["skip"][0]), 0.0), counts)
            row["cuda_graph"] = ran
            if got["ar"][3] is not None:
                row[f"busy_{name}"] = (got["ar"][3], got["skip"][3])
        if device.type == "cuda":
            from braid.measure.pair import collective_pair

            x = torch.randn(1, seq, cfg.hidden, dtype=dtype, device=device)
            a = torch.randn(seq, cfg.hidden, dtype=dtype, device=device)
            b = torch.randn(cfg.hidden, cfg.ffn // 2, dtype=dtype, device=device)
            ar = statistics.median(_time(lambda: comm.all_reduce(x).wait(), device) for _ in range(6))
            one = statistics.median(_time(lambda: a @ b, device) for _ in range(6))
            row["overlap"] = collective_pair(x, groups.tp, a, b, ar, one, device, 6, comm.all_reduce)
            row["ar_burst_s"] = _burst_s(comm, x, row["braided"][2].get("AR", 0), groups.tp, device)
        results[backend] = row
    if rank == 0:
        out.put(results)
    d.close()


BURSTS = 5  # bursts of the step's all-reduces timed alone; the median is "AR alone"


def _burst_s(comm, x: torch.Tensor, n: int, group, device: torch.device) -> float | None:
    """The step's ``n`` all-reduces issued back to back with nothing beside them, as the step
    issues them: the median over :data:`BURSTS` bursts (both ranks start each together). One
    all-reduce timed on its own also holds the ranks' skew at its start, which a step's
    all-reduces do not pay one by one (it made "AR alone" move by 1.8x between two runs)."""
    import torch.distributed as dist

    if n <= 0:
        return None

    def burst() -> None:
        works = [comm.all_reduce(x) for _ in range(n)]
        for w in works:
            w.wait()

    times = []
    for _ in range(BURSTS + 1):  # the first burst warms up
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        times.append(_time(burst, device))
    return statistics.median(times[1:])


def _ar_alone_s(row: dict, counts: dict) -> float | None:
    """The time the step's unit all-reduces take one after another with nothing beside them:
    a burst of them (:func:`_burst_s`), or where none was timed, their count times one alone."""
    if row.get("ar_burst_s"):
        return row["ar_burst_s"]
    ov = row.get("overlap")
    return ov["ar_alone_s"] * counts.get("AR", 0) if ov and counts.get("AR") else None


def _hidden_in_blocks(row: dict) -> float | None:
    """The share of the all-reduce time inside the braided blocks that the braided program hides:
    its exposed time less that of the unbraided ends (one micro-batch's F then BW, measured
    alone), over the time the blocks' all-reduces take alone (their share of :func:`_ar_alone_s`)."""
    (_, eb, counts), (_, ee, ends) = row["braided"], row["ends"]
    total, n = counts.get("AR", 0), counts.get("AR", 0) - ends.get("AR", 0)
    alone = _ar_alone_s(row, counts)
    if not alone or n <= 0:
        return None
    return 1 - max(eb - ee, 0.0) / (alone * n / total)


def _exposed_split(row: dict, name: str, top: int = 5) -> dict | None:
    """Where program ``name``'s all-reduce cost goes, from its profiled steps (mean) with and without
    its all-reduces (profiled rows only; :class:`~braid.measure.device_busy.StepProfile`): the
    profiled exposed time (mean span with less mean span without) is ``slowed`` (compute busy time
    with less without: kernels that ran longer beside an all-reduce) + ``waiting`` (compute idle
    until an all-reduce ended) + ``other_idle`` (the rest of the idle time: dependencies between
    streams, launch gaps), with the ``top`` kernels whose time grew most."""
    got = row.get(f"busy_{name}")
    if got is None:
        return None
    ar, skip = got
    ar_k, skip_k = ({k: t for k, t, _ in p.top} for p in (ar, skip))
    grew = sorted(((k, ar_k.get(k, 0.0) - skip_k.get(k, 0.0)) for k in set(ar_k) | set(skip_k)), key=lambda kv: -kv[1])
    return {"profiled_exposed_ms": (ar.span_s - skip.span_s) * 1e3, "span_ms": [ar.span_s * 1e3, skip.span_s * 1e3],
            "busy_ms": [ar.busy_s * 1e3, skip.busy_s * 1e3], "slowed_ms": (ar.busy_s - skip.busy_s) * 1e3,
            "waiting_ms": (ar.waiting_s - skip.waiting_s) * 1e3, "other_idle_ms": (ar.other_idle_s - skip.other_idle_s) * 1e3,
            "kernels_grown_ms": [(k, d * 1e3) for k, d in grew[:top]]}


def _write_json(path: str, res: dict) -> None:
    import json

    from braid.io.files import atomic_write_text

    doc = {}
    for backend, row in res.items():
        if "error" in row:
            doc[backend] = {"error": row["error"]}
            continue
        (tb, eb, counts), (tp_, ep, _) = row["braided"], row["plain"]
        alone = _ar_alone_s(row, counts)
        inner = _hidden_in_blocks(row)
        doc[backend] = {"plain_ms": tp_ * 1e3, "braided_ms": tb * 1e3, "braided_over_plain": tb / tp_,
                        "exposed_ar_ms": [ep * 1e3, eb * 1e3], "ar_alone_ms": alone * 1e3 if alone else None,
                        "ar_hidden": (1 - eb / alone) if alone else None,
                        "ends_exposed_ar_ms": row["ends"][1] * 1e3, "ends_ar": row["ends"][2].get("AR", 0),
                        "ar_hidden_in_blocks": inner,
                        "ar_hidden_vs_plain": (1 - eb / ep) if ep > 0 else None,
                        "cuda_graph": row.get("cuda_graph"), "overlap": row.get("overlap"),
                        "exposed_split": {n: _exposed_split(row, n) for n in ("plain", "braided") if f"busy_{n}" in row} or None}
    atomic_write_text(path, json.dumps(doc, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model on CPU (smoke test)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers in the stage (default 2)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--mbs", type=int, default=6, help="micro-batches (default 6)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--tp-max-ctas", type=int, default=4, help="NCCL CTA cap of the TP group (0: NCCL default; default 4)")
    ap.add_argument("--tp-backend", nargs="+", default=["nccl-capped"], metavar="NAME",
                    help="TP all-reduce backends to compare (braid.tp.comm), or 'all' (default nccl-capped; CPU: gloo)")
    ap.add_argument("--plain-first", action="store_true", help="measure the plain program first")
    ap.add_argument("--cuda-graph", choices=["none", "step"], default=None,
                    help="steps as whole-step CUDA graphs (default: step on GPU where the backend can be captured)")
    ap.add_argument("--profile", type=int, nargs="?", const=3, default=0, metavar="N",
                    help="profile N more steps (default 3) of the plain and braided programs with and without their "
                    "all-reduces (GPU) and split the mean exposed time into kernels slowed beside the all-reduces, "
                    "compute waiting for them and other idle time")
    ap.add_argument("--trace", metavar="DIR", help="with --profile: write the first profiled step's chrome trace (gzipped JSON, "
                    "one per backend, program, with/without all-reduces and rank) into DIR")
    ap.add_argument("--json", metavar="FILE", help="also write the table as JSON: per backend plain_ms, braided_ms, "
                    "braided_over_plain, exposed_ar_ms [plain, braided], ar_alone_ms, ar_hidden, ar_hidden_vs_plain, "
                    "cuda_graph, with --profile exposed_split (or error)")
    args = ap.parse_args(argv)
    if args.json:
        from braid.io.cli import check_outputs

        check_outputs(ap, [("--json", args.json)])
    if args.profile < 0:
        ap.error(f"--profile {args.profile}: the number of profiled steps is 0 or more")
    if args.profile and args.tiny:
        ap.error("--profile reads the CUDA profiler; --tiny runs on CPU")
    if args.trace:
        if not args.profile:
            ap.error("--trace writes the profiled steps' traces: it needs --profile N with N > 0")
        from pathlib import Path

        if not Path(args.trace).is_dir():
            ap.error(f"--trace {args.trace}: not a directory")
    if args.tiny and args.cuda_graph == "step":
        ap.error("--cuda-graph step needs CUDA; --tiny runs on CPU")
    if not args.tiny and torch.cuda.device_count() < 2:
        ap.error("needs 2 GPUs (or --tiny for the CPU smoke test)")
    from braid.tp.comm import CUDA_BACKENDS

    bad = [b for b in args.tp_backend if b not in (*CUDA_BACKENDS, "all")]
    if bad:
        ap.error(f"unknown TP backend {bad[0]!r}; choose from all, {', '.join(CUDA_BACKENDS)}")
    (res,) = spawn_two(_worker, args)
    print(f"{'TP backend':<15}{'graph':>6}{'plain ms':>10}{'braided ms':>12}{'braided/plain':>15}"
          f"{'exposed AR plain->braided ms':>30}{'AR alone ms':>12}{'AR hidden':>11}{'ends exposed ms':>17}{'hidden in blocks':>18}"
          f"{'GEMM slowdown':>15}{'AR stretch':>12}")
    for backend, row in res.items():
        if "error" in row:
            print(f"{backend:<15}  not available: {row['error']}")
            continue
        (tb, eb, counts), (tp_, ep, _) = row["braided"], row["plain"]
        ov = row.get("overlap")
        slow = f"{ov['gemm_slowdown']:.3f}" if ov else "-"
        stretch = f"{ov['ar_stretch']:.2f}" if ov else "-"
        alone = _ar_alone_s(row, counts)
        hidden = f"{1 - eb / alone:.1%}" if alone else "-"
        inner = _hidden_in_blocks(row)
        ends = f"{row['ends'][1] * 1e3:.2f}"
        inner = f"{inner:.1%}" if inner is not None else "-"
        print(f"{backend:<15}{row.get('cuda_graph', '-'):>6}{tp_ * 1e3:>10.2f}{tb * 1e3:>12.2f}{tb / tp_:>15.3f}"
              f"{f'{ep * 1e3:.2f} -> {eb * 1e3:.2f}':>30}{(f'{alone * 1e3:.2f}' if alone else '-'):>12}"
              f"{hidden:>11}{ends:>17}{inner:>18}{slow:>15}{stretch:>12}")
    if args.json:
        _write_json(args.json, res)
    for backend, row in res.items():
        for name in ("plain", "braided"):
            split = _exposed_split(row, name) if "error" not in row else None
            if split:
                print(f"{backend} {name}: exposed {row[name][1] * 1e3:.2f} ms timed, {split['profiled_exposed_ms']:.2f} ms in the "
                      f"profiled steps (mean) = kernels slowed beside all-reduces {split['slowed_ms']:.2f} + waiting for all-reduces "
                      f"{split['waiting_ms']:.2f} + other idle {split['other_idle_ms']:.2f} ms; grew most: "
                      + "; ".join(f"{k[:40]} {d:+.2f}" for k, d in split["kernels_grown_ms"][:3]))
    ran = [row for row in res.values() if "error" not in row]
    if ran:
        counts = ran[-1]["braided"][2]
        print(f"braided blocks per step: {counts['braided']}, all-reduces per step: {counts['AR']}, "
              f"of them in the unbraided ends (first F, last BW): {ran[-1]['ends'][2].get('AR', 0)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
