"""The device-memory terms the memory model leaves out, measured one by one on every rank (issue 51).

Launched with torchrun (``--nproc-per-node 2``; 1 works too), one process per GPU. Each rank
measures, in this order, what each term adds, with three probes read around it (after a
``torch.cuda.synchronize``):

* ``used``: ``total - free`` of ``torch.cuda.mem_get_info()``, the device-wide view (what
  nvidia-smi shows and what runs out). It counts *every* process on the GPU, not only this one:
  run nothing else on the GPUs while it measures. Driver pages are 2 MiB, so small terms round.
* ``reserved`` / ``allocated``: ``torch.cuda.memory_reserved`` / ``memory_allocated``, the caching
  allocator's segments and its live blocks (this process only; memory NCCL, cuBLAS handles, the
  CUDA context or loaded kernel modules hold outside the allocator is in neither).

The terms (``term`` in the table and the JSON):

1. ``context.this_process``: the CUDA context of this process (``set_device``, ``torch.cuda.init()``
   and a first tiny kernel), less the allocator's first segment. With NVML (``pynvml``) it is
   NVML's used memory before any context vs after; without it, ``used`` after the first kernel:
   an upper bound that counts whatever else holds the GPU (the row says which). Its loading mode
   is ``CUDA_MODULE_LOADING`` from the environment (unset: the driver's default, lazy).
   ``context.lazy`` / ``context.eager``: a child process started with that ``CUDA_MODULE_LOADING``
   on the same GPU, ``used`` before it starts vs while it holds its context after one kernel,
   less the child's allocator reserve. Eager loads every kernel module of torch's libraries at
   context creation (braid's GPU tests run eager: ``tests/distributed_utils.py``).
2. NCCL, each the ``used`` delta around a communicator's creation and its first collective, less
   the allocator's delta (the NCCL buffers live outside it): ``nccl.default_group``
   (``Dist.from_env``, which binds the device and creates the communicator eagerly, and a first
   all-reduce); ``nccl.new_group`` (a group of all ranks, NCCL defaults, as a TP group);
   ``nccl.capped_group`` (another, with ``nccl_group_options("nccl-capped", default_max_ctas(2))``, as
   ``braid.tp.comm.make_tp_comm`` creates one for a second backend); ``nccl.p2p_pair`` (a first
   ``batch_isend_irecv`` to the next rank and from the previous one on the default group, as
   ``braid.runtime.p2p`` issues them: torch opens a communicator per pair); ``nccl.layout_groups``
   (``ProcessGroups.create`` of the step's layout, every pp/tp/dp/cp/dp_cp group, and a first
   all-reduce on its TP group); with two ranks or more and NCCL >= 2.28, the ``nccl-ce`` backend's group and
   registered staging sets (:func:`ce_terms`). The NCCL variables of the environment, the torch and NCCL versions
   are in the JSON's ``env`` and ``versions``.
3. cuBLAS/cuBLASLt, each the ``used`` delta (detail: the reserved and allocated deltas; the
   workspaces come from the allocator, the handles and modules do not) of a first bf16 ``mm``
   (cuBLAS) and a first ``addmm`` with a bias (the cuBLASLt gemm-and-bias path where torch takes
   it) into preallocated ``--blas-n`` square outputs: ``blas.default_stream.*`` on the default
   stream, then ``blas.side_stream.*`` on a new stream (braid's executor, follower and offload
   work on side streams; torch keeps a workspace per handle and stream).
   ``torch.backends.cuda.preferred_blas_library()`` is in ``versions``.
4. A braid step (forward and backward of ``--mbs`` micro-batches, gradients kept, no optimizer
   step, as ``python -m braid.bench`` times it) of a ``--model``-shaped job of ``--layers``
   layers on a tp x pp layout, per schedule of ``--schedule``, built fresh per case after
   ``empty_cache``. Eager (``step.<schedule>.eager``): ``--warmup`` steps, then the peaks over
   ``--steps`` steps: ``allocated_peak`` and ``reserved_peak`` (``max_memory_*``, absolute),
   ``used_peak`` (the largest ``used`` sampled after each step; detail ``used_peak_bound``: the
   largest ``used - reserved`` sampled plus the reserved peak, nvidia-smi's view at the allocator's
   peak if nothing outside the allocator moved within a step), ``fragmentation`` (reserved peak
   over allocated peak: what the allocator holds per byte live), ``fragmentation_above_held`` (the
   same above the state held after the steps: what the device-memory model scales) and ``nonallocator`` (``used -
   reserved`` added by the case: lazily created communicators, cuBLAS handles of new streams,
   loaded Triton modules). Graphed (``step.<schedule>.graphed``: ``braid.runtime.graphs.step_runner``
   with mode ``"step"``, as ``braid.measure.runs`` runs it): its eager warm-up, then the capture
   step and ``--steps`` replays: the same peaks, ``graph_pool`` and ``capture_peak``
   (``GraphedStep.memory()``: the private pool's segment bytes and the allocator peak of the
   capture above what was allocated before) and ``used_after_capture`` (``used`` after the
   capture step less ``used`` when the case started, weights included). Compiled units (Inductor,
   ``ProfileConfig.compile``, on by default with Triton): the first schedule also runs eager
   uncompiled first (``step.<schedule>.eager.uncompiled``), and ``inductor.*`` is the compiled
   case less the uncompiled one (reserved peak, allocated peak, non-allocator bytes).

Not measured here: the optimizer's state and step (``benchmarks/bench_memory.py``), more than one
node, other processes' memory (they show in ``used``: a number here is this job's only on an
otherwise idle GPU). Every rank's rows are gathered; rank 0 prints a table per rank and writes
the JSON atomically to ``--out`` after every part (``"partial": true`` until the last), so a run
cut short keeps its parts::

    {"bench": "memory_terms", "partial": false, "command": ..., "versions": {...}, "env": {...},
     "config": {...}, "ranks": [{"rank": 0, "device": ..., "terms": [{"term": ..., "value": ...,
     "unit": "B" or "ratio", "how": ..., "detail": {...}}, ...]}, ...]}

On 2 GPUs (tp=2, qwen2-7b-shaped layers, seq 4096)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/bench_memory_terms.py \\
        --out memory_terms.json

Needs CUDA devices; on a machine without them it refuses in one line (exit code 2).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from braid.measure.memory_terms import (Probe, Term, above_held, nvml_bus, nvml_used, child_context, document,  # noqa: E402
                                        env_vars, inductor_terms, measure_delta, nvml_handle, run_peaks, table)

PROG = "bench_memory_terms.py"
CONTEXT_MODES = ("LAZY", "EAGER")
# A child holding a CUDA context on one GPU (context.<mode>): prints its allocator reserve, waits for a line.
CHILD = ("import sys, torch\n"
         "torch.cuda.set_device(int(sys.argv[1])); torch.cuda.init()\n"
         "x = torch.ones(1, device='cuda'); x.add_(1); torch.cuda.synchronize()\n"
         "print(torch.cuda.memory_reserved(), flush=True); sys.stdin.readline()\n")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2-7b", help="catalog model whose layer shape is used (default qwen2-7b)")
    ap.add_argument("--vocab", type=int, default=None, help="override the model's vocabulary (default: the model's)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the job (default 2)")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--mbs", type=int, default=4, help="micro-batches per step (default 4)")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the ranks over --pp)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline ranks (default 1)")
    ap.add_argument("--schedule", nargs="+", default=["braided_v", "1f1b_i", "zb_v"], help="schedules measured, in order")
    ap.add_argument("--warmup", type=int, default=1, help="eager steps before the peaks are reset (default 1)")
    ap.add_argument("--steps", type=int, default=2, help="steps whose peaks are taken (default 2)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compiled units (default: on with Triton); on, the first schedule also runs uncompiled")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure each schedule as a whole-step CUDA graph (default on)")
    ap.add_argument("--context-modes", nargs="*", default=list(CONTEXT_MODES), choices=CONTEXT_MODES,
                    help="CUDA_MODULE_LOADING modes whose context a child process measures (default both; none: skip)")
    ap.add_argument("--blas-n", type=int, default=4096, help="square bf16 matmul size of the cuBLAS terms (default 4096)")
    ap.add_argument("--timeout", type=float, default=600.0, help="process-group timeout in seconds (default 600)")
    ap.add_argument("--out", default=None, help="JSON file written by rank 0 (default: print only)")
    return ap


def profile_config(args: argparse.Namespace, world: int):
    """The job's :class:`braid.measure.config.ProfileConfig` (``compile`` left unresolved: resolving it
    may touch CUDA), or ``ValueError`` with one line."""
    from braid.core.partition import split_layers
    from braid.cost.catalog import get_model
    from braid.measure.config import ProfileConfig
    from braid.models.shapes import decoder_config

    for name in ("layers", "seq", "micro_batch_size", "mbs", "pp", "steps", "blas_n"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    tp = args.tp if args.tp is not None else max(1, world // args.pp)
    if tp < 1 or tp * args.pp != world:
        raise ValueError(f"tp x pp = {tp} x {args.pp} must equal the {world} ranks torchrun started")
    stages = 2 * args.pp
    if args.layers < stages:
        raise ValueError(f"--layers {args.layers}: the schedules' {stages} virtual stages need a layer each")
    from braid import schedules

    for name in args.schedule:
        schedules.build(name, args.pp, args.mbs)  # an unknown schedule or m: its one-line error
    cfg = decoder_config(get_model(args.model), layers=1, **({"vocab_size": args.vocab} if args.vocab else {}))
    return ProfileConfig(cfg, tuple(split_layers(args.layers, stages)), seq=args.seq, micro_batch_size=args.micro_batch_size,
                         tp=tp, pp=args.pp, v=2, dtype="bfloat16", device="cuda", warmup=args.warmup)


# ----------------------------------------------------------------------------------------
# The measurements on one rank (CUDA)
# ----------------------------------------------------------------------------------------
def cuda_probes(dev: torch.device) -> dict[str, Probe]:
    """``used`` (device-wide, ``mem_get_info``), ``reserved`` and ``allocated`` (this process's allocator)."""
    def used() -> int:
        free, total = torch.cuda.mem_get_info(dev)
        return total - free

    return {"used": used, "reserved": lambda: torch.cuda.memory_reserved(dev),
            "allocated": lambda: torch.cuda.memory_allocated(dev)}


def context_terms(index: int, modes: Sequence[str]) -> list[Term]:
    """Term 1 (module doc): this process's context, then a child's per loading mode."""
    handle = nvml_handle(index, os.environ)
    before = nvml_used(handle) if handle is not None else None  # before any context (device_count ran cuInit only)
    dev = torch.device("cuda", index)
    torch.cuda.set_device(dev)
    torch.cuda.init()
    x = torch.ones(1, device=dev)
    x.add_(1)
    torch.cuda.synchronize(dev)
    probes = cuda_probes(dev)
    res, used = torch.cuda.memory_reserved(dev), probes["used"]()
    after = None
    if before is not None and nvml_bus(handle) == getattr(torch.cuda.get_device_properties(dev), "pci_bus_id", None):
        after = nvml_used(handle)  # else NVML's GPU is not this one (CUDA_DEVICE_ORDER): fall back
    mode = os.environ.get("CUDA_MODULE_LOADING") or "unset (the driver's default, LAZY)"
    if before is not None and after is not None:
        t = Term("context.this_process", after - before - res,
                 f"NVML used before any context vs after set_device, init and a first kernel, less the allocator's "
                 f"reserve; CUDA_MODULE_LOADING {mode}", detail={"nvml_before": before, "nvml_after": after,
                                                                  "reserved": res, "used": used})
    else:
        t = Term("context.this_process", used - res,
                 f"no NVML: mem_get_info used after the first kernel less the allocator's reserve, an upper bound "
                 f"(counts every process on the GPU); CUDA_MODULE_LOADING {mode}", detail={"reserved": res, "used": used})
    terms = [t]
    for m in modes:
        env = dict(os.environ, CUDA_MODULE_LOADING=m)
        try:
            delta, child_res = child_context(probes["used"], [sys.executable, "-c", CHILD, str(index)], env)
            terms.append(Term(f"context.{m.lower()}", delta - child_res,
                              f"child with CUDA_MODULE_LOADING={m}: used while it holds its context after one kernel "
                              "less before it started, less its allocator reserve",
                              detail={"used_delta": delta, "child_reserved": child_res}))
        except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as err:
            terms.append(Term(f"context.{m.lower()}", None, f"not measured: {err}"))
    return terms


def nccl_terms(args, pc, d_box: list, probes: Mapping[str, Probe], dev: torch.device, sync) -> list[Term]:
    """Term 2 (module doc); puts the job's ``Dist`` and ``ProcessGroups`` into ``d_box``."""
    import torch.distributed as dist

    from braid.core.topology import Topology
    from braid.runtime.distributed import Dist, ProcessGroups
    from braid.core.ctas import default_max_ctas
    from braid.tp.comm import nccl_group_options

    outside = lambda dl: dl["used"] - dl["reserved"]  # noqa: E731 - NCCL's buffers are not the allocator's
    x = torch.ones(1024, device=dev)
    sync()

    def first(group=None):
        dist.all_reduce(x, group=group)

    def default():
        d = Dist.from_env(dev, timeout_s=args.timeout)
        first()
        return d

    t, d = measure_delta("nccl.default_group", default, probes, value=outside, sync=sync,
                         how="Dist.from_env (init_process_group, device bound: eager communicator) and a first all-reduce")
    terms = [t]
    world, ranks = d.world_size, list(range(d.world_size))

    def barrier():
        sync()
        dist.barrier(device_ids=[dev.index])
        sync()

    for label, opts, how in (("nccl.new_group", None, "dist.new_group(all ranks), NCCL defaults, and a first all-reduce"),
                             ("nccl.capped_group", nccl_group_options("nccl-capped", default_max_ctas(2)),
                              "dist.new_group(all ranks, nccl-capped options at tp=2's default_max_ctas, as make_tp_comm) and a first all-reduce")):
        barrier()
        t, _ = measure_delta(label, lambda o=opts: first(dist.new_group(ranks, pg_options=o)), probes, value=outside,
                             sync=sync, how=how)
        terms.append(t)
    barrier()
    if world > 1:
        y = torch.empty_like(x)

        def p2p():
            ops = [dist.P2POp(dist.isend, x, (d.rank + 1) % world), dist.P2POp(dist.irecv, y, (d.rank - 1) % world)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        t, _ = measure_delta("nccl.p2p_pair", p2p, probes, value=outside, sync=sync,
                             how="a first batch_isend_irecv to the next rank and from the previous on the default group")
        terms.append(t)
        barrier()
    else:
        terms.append(Term("nccl.p2p_pair", None, "one rank: no peer"))

    if world > 1:
        terms += ce_terms(pc, ranks, probes, dev, sync, outside, barrier)

    def layout():
        groups = ProcessGroups.create(Topology(world, pp=pc.pp, tp=pc.tp), timeout_s=args.timeout)
        if pc.tp > 1:
            first(groups.tp)
        return groups

    t, groups = measure_delta("nccl.layout_groups", layout, probes, value=outside, sync=sync,
                              how=f"ProcessGroups.create (tp={pc.tp} x pp={pc.pp}: pp, tp, dp, cp, dp_cp groups) and a "
                                  "first all-reduce on its TP group")
    terms.append(t)
    barrier()
    d_box.extend([d, groups])
    return terms


def ce_terms(pc, ranks: list[int], probes: Mapping[str, Probe], dev: torch.device, sync, outside, barrier) -> list[Term]:
    """The ``nccl-ce`` TP backend's (the default under sequence parallelism) terms, outside the allocator, each with the
    allocator's reserved delta in its detail: ``nccl.ce_group`` (a group with the zero-CTA policy, as ``make_tp_comm``
    makes it, and a first all-reduce), ``nccl.ce_staging`` (its first registered staging set, one micro-batch's
    (b, s, h) tensor: ``CEBuffers.staging``, which registers the window and runs the copy-engine collectives once;
    :func:`braid.cost.device_memory.ce_staging_bytes` is the allocator's part) and ``nccl.ce_staging_second`` (a
    second set, half the size: what each further window costs)."""
    import torch.distributed as dist

    from braid.tp.ce_reduce import CEBuffers
    from braid.tp.comm import copy_engine_collectives, nccl_group_options

    if not copy_engine_collectives():
        return [Term("nccl.ce_group", None, "this NCCL has no copy-engine collectives (nccl-ce needs >= 2.28)")]
    box: list[Any] = []

    def group():
        g = dist.new_group(ranks, pg_options=nccl_group_options("nccl-ce", None))
        dist.all_reduce(torch.ones(1024, device=dev), group=g)
        box.append(CEBuffers(g, dev))

    t, _ = measure_delta("nccl.ce_group", group, probes, value=outside, sync=sync,
                         how="dist.new_group(all ranks, nccl-ce options: the zero-CTA policy) and a first all-reduce")
    terms = [t]
    n = pc.seq * pc.micro_batch_size * pc.model.hidden
    for label, numel in (("nccl.ce_staging", n), ("nccl.ce_staging_second", n // 2)):
        barrier()
        t, _ = measure_delta(label, lambda k=numel: box[0].staging(k - k % len(ranks), torch.bfloat16), probes,
                             value=outside, sync=sync,
                             how=f"CEBuffers.staging of {numel} bf16 elements (window registered, copy-engine collectives run once)")
        terms.append(t)
    barrier()
    return terms


def blas_terms(n: int, probes: Mapping[str, Probe], dev: torch.device, sync) -> list[Term]:
    """Term 3 (module doc): first mm and addmm on the default stream, then on a new side stream."""
    g = torch.Generator(device=dev).manual_seed(0)
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=g)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(dev)
    terms = []
    for where, stream in (("default_stream", torch.cuda.current_stream(dev)), ("side_stream", side)):
        for op, fn, what in (("mm", lambda: torch.mm(a, b, out=c), "bf16 mm (cuBLAS)"),
                             ("addmm", lambda: torch.addmm(bias, a, b, out=c), "bf16 addmm with a bias (cuBLASLt gemm-and-bias)")):
            def on_stream(fn=fn, stream=stream):
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    fn()
                torch.cuda.current_stream(dev).wait_stream(stream)

            t, _ = measure_delta(f"blas.{where}.{op}", on_stream, probes, sync=sync,
                                 how=f"used delta of the first {what} {n}x{n} on the {where.replace('_', ' ')} "
                                     "(into a preallocated output)")
            terms.append(t)
    del a, b, bias, c
    return terms


def step_case(args, pc, d, groups, model, name: str, *, compiled: bool, graphed: bool, probes, dev, sync) -> list[Term]:
    """Term 4 for one schedule and one way of running it (module doc)."""
    import torch.distributed as dist

    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.measure.config import build_chunks
    from braid.runtime.executor import Executor
    from braid.runtime.graphs import WARMUP_STEPS, step_runner

    label = f"step.{name}.{'graphed' if graphed else 'eager'}" + ("" if compiled else ".uncompiled")
    gc.collect()
    torch.cuda.empty_cache()
    sync()
    dist.barrier(device_ids=[dev.index])
    base = {k: int(p()) for k, p in probes.items()}
    plan = schedules.build(name, pc.pp, args.mbs)
    pcx = replace(pc, compile=compiled)
    chunks = build_chunks(pcx, groups, dev, plan=plan, model=model)
    ex = Executor.from_groups(plan, compile_plan(plan)[groups.coords.pp], chunks, groups, d.abort, act_shape=pc.act_shape(),
                              dtype=torch.bfloat16, device=dev, compile=compiled)
    try:
        runner = step_runner(ex, "step" if graphed else "none")
    except ValueError as err:
        return [Term(label, None, f"not capturable: {err}")]
    g = torch.Generator().manual_seed(7)
    shape = (pc.micro_batch_size, pc.seq)
    toks = [torch.randint(0, pc.model.vocab_size, shape, generator=g).to(dev) for _ in range(args.mbs)]
    labs = [torch.randint(0, pc.model.vocab_size, shape, generator=g).to(dev) for _ in range(args.mbs)]

    def step():
        for ch in chunks.values():
            ch.zero_grad(set_to_none=False)
        return runner.run(toks, labs, record="off")

    for _ in range(WARMUP_STEPS if graphed else args.warmup):
        step()
    # graphed: the first measured step is the capture (its peak is the pool's), then --steps replays
    peaks = run_peaks(step, args.steps + (1 if graphed else 0), probes, reset=lambda: torch.cuda.reset_peak_memory_stats(dev),
                      peak_allocated=lambda: torch.cuda.max_memory_allocated(dev),
                      peak_reserved=lambda: torch.cuda.max_memory_reserved(dev), sync=sync)
    end = {k: int(p()) for k, p in probes.items()}
    what = "capture and replays" if graphed else f"{args.steps} eager steps after {args.warmup} warm-up"
    common = {"base": base, "end": end, "used_after_each_step": peaks["used_after_each_step"]}
    terms = [Term(f"{label}.allocated_peak", peaks["allocated_peak"], f"max_memory_allocated over the {what}", detail=common),
             Term(f"{label}.reserved_peak", peaks["reserved_peak"], f"max_memory_reserved over the {what}"),
             Term(f"{label}.used_peak", peaks["used_peak"], "largest mem_get_info used read after each step (device-wide)",
                  detail={"used_peak_bound": peaks["used_peak_bound"]}),
             Term(f"{label}.fragmentation", peaks["fragmentation"], "reserved peak / allocated peak", unit="ratio"),
             Term(f"{label}.fragmentation_above_held", above_held(peaks["reserved_peak"], peaks["allocated_peak"], end["allocated"]),
                  "(reserved peak - held) / (allocated peak - held); held: allocated after the steps", unit="ratio"),
             Term(f"{label}.nonallocator", (end["used"] - end["reserved"]) - (base["used"] - base["reserved"]),
                  "used - reserved at the end less at the case's start (outside the allocator)")]
    if graphed:
        mem = runner.memory()
        terms += [Term(f"{label}.graph_pool", mem.get("graph_pool_bytes"), "GraphedStep.memory(): the private pool's segments"),
                  Term(f"{label}.graph_exec", mem.get("graph_exec_bytes"),
                       "GraphedStep.memory(): the instantiated graph, outside the allocator"),
                  Term(f"{label}.capture_peak", mem.get("capture_peak_bytes"),
                       "GraphedStep.memory(): allocator peak of the capture above what was allocated before"),
                  Term(f"{label}.used_after_capture", peaks["used_after_each_step"][0] - base["used"],
                       "mem_get_info used after the capture step less at the case's start (weights included)",
                       detail={"events": list(runner.events)})]
    runner.release()
    del runner, ex, chunks, toks, labs
    gc.collect()
    torch.cuda.empty_cache()
    return terms


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    n_gpu = torch.cuda.device_count()
    if n_gpu < 1:
        print(f"{PROG}: needs CUDA devices (one per rank, launched with torchrun), {n_gpu} visible", file=sys.stderr)
        return 2
    if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        print(f"{PROG}: launch it with torchrun (torchrun --nproc-per-node 2 benchmarks/{PROG})", file=sys.stderr)
        return 2
    world, index = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if index >= n_gpu:
        print(f"{PROG}: local rank {index} needs GPU {index}; {n_gpu} visible", file=sys.stderr)
        return 2
    try:
        pc = profile_config(args, world)
    except ValueError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from braid.io.files import atomic_write_text
    from braid.runtime.compiled import resolve

    terms = context_terms(index, args.context_modes)  # first: before this process makes any other CUDA call
    dev = torch.device("cuda", index)
    probes = cuda_probes(dev)
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    box: list[Any] = []
    terms += nccl_terms(args, pc, box, probes, dev, sync)
    d, groups = box
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "device": torch.cuda.get_device_name(dev), "preferred_blas_library": str(torch.backends.cuda.preferred_blas_library())}
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"tp": pc.tp, "world_size": world}
    command = (f"torchrun --nproc-per-node {world} benchmarks/{PROG} "
               + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))).strip()

    def flush(partial: bool) -> None:
        every: list[Any] = [None] * world
        dist.all_gather_object(every, {"rank": d.rank, "device_index": index, "device": versions["device"], "terms": terms})
        if d.rank != 0:
            return
        if not partial:
            print("\n\n".join(table(r["rank"], f"{r['device']}, cuda:{r['device_index']}", r["terms"])
                              for r in sorted(every, key=lambda r: r["rank"])), flush=True)
        doc = document(every, command=command, versions=versions, env=env_vars(os.environ), config=config, partial=partial)
        if args.out:
            atomic_write_text(args.out, json.dumps(doc, indent=1))
        elif not partial:
            print(json.dumps(doc, indent=1))

    flush(True)
    terms += blas_terms(args.blas_n, probes, dev, sync)
    flush(True)
    compiled = resolve(args.compile, dev)
    config["compile"] = compiled
    model = pc.build_model()
    kw = dict(probes=probes, dev=dev, sync=sync)
    for i, name in enumerate(args.schedule):
        if i == 0 and compiled:
            plain = step_case(args, pc, d, groups, model, name, compiled=False, graphed=False, **kw)
            terms += plain
        eager = step_case(args, pc, d, groups, model, name, compiled=compiled, graphed=False, **kw)
        terms += eager
        if i == 0 and compiled:
            terms += inductor_terms(plain, eager)
        if args.graphs:
            terms += step_case(args, pc, d, groups, model, name, compiled=compiled, graphed=True, **kw)
        flush(i < len(args.schedule) - 1)
    d.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
