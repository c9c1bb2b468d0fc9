"""Peak memory per GPU, measured against predicted, for every optimizer and recomputation mode.

Launched with torchrun on ``--dp`` x ``--tp`` x ``--pp`` processes. For each (optimizer mode,
recomputation mode) pair every rank builds its chunks of a Qwen2 model with the catalog
preset's layer shape (``--model``, default ``qwen2-7b``) but ``--layers`` layers, trains
``--warmup`` steps (the optimizer's state exists after them), resets the peak counter and
trains ``--steps`` more: the measured peak is ``torch.cuda.max_memory_allocated()`` (on CPU:
the executor's saved-activation series plus the optimizer mode's state bytes, as the example
loop estimates it). The prediction, per rank: weights, gradients and optimizer state by the
optimizer mode (:func:`braid.cost.cluster.dp_costs`, :mod:`braid.cost.optimizer_modes`, plus
:func:`braid.cost.step_memory.extra_state_bytes`), plus the larger of the simulator's activation
peak (analytic cost model, ``activations="runtime"``, the recomputation's transform, the eager
loss's workspace when the units run uncompiled: :func:`braid.cost.costs.eager_loss_workspace`) and
the optimizer step's temporaries on that data-parallel rank (:mod:`braid.cost.step_memory`). Printed and written (rank 0, atomically) as JSON::

    {"device": ..., "config": {...}, "command": ..., "runs": [{"optimizer": "zero1", "recompute": "full",
      "measured_bytes": [per rank], "predicted_bytes": [per rank], "rel_err": worst |pred - meas| / meas,
      "leftover_bytes": [per rank: allocated from earlier cases when this one starts],
      "reserved_bytes": [per rank: the allocator's reserved peak; CUDA], "device_used_bytes": [per rank: in use on
      the device after the steps, nvidia-smi's view; CUDA], "predicted_device_bytes": [per rank: what the planner
      checks against the card, braid.cost.device_memory.planned_device_bytes]}, ...]}

The 2-GPU check of issue 37 (dp=2, 7B-shaped layers, seq 4096)::

    torchrun --nproc-per-node 2 benchmarks/bench_memory.py --dp 2 --layers 4 --seq 4096 --mbs 4 \\
        --out benchmarks/results/memory_dp2_<gpu>.json

The same with device memory in use against the planner's figure, eager and as whole-step CUDA graphs (issue 51's
dp=2 sets)::

    torchrun --nproc-per-node 2 benchmarks/bench_memory.py --dp 2 --layers 4 --seq 4096 --mbs 4 --recompute none \
        --cuda-graph {none,step} --out benchmarks/results/memory_dp2_<gpu>_<mode>.json

``--memory-snapshot FILE`` (CUDA) records each case's steps, warm-up included, under the allocator's history and
writes torch's snapshot per case and rank (``FILE.<optimizer>-<recompute>.rank<r>.pickle``); rank 0 prints each rank's
attribution (:mod:`braid.measure.snapshot`): the blocks live at the peak, and the reserve's free bytes by the allocation
that made their segment -- where the reserve exceeds the allocated peak.

A CPU smoke run (gloo, seconds)::

    torchrun --nproc-per-node 2 benchmarks/bench_memory.py --model qwen2-tiny --dp 2 --layers 2 --seq 16 --mbs 2 \\
        --device cpu --out /tmp/memory.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from braid.cost.optimizer_modes import OPTIMIZERS  # noqa: E402

RECOMPUTE = ("none", "selective", "full")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2-7b", help="catalog preset whose layer shape is used (default qwen2-7b)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--mbs", type=int, default=4, help="micro-batches per step (default 4)")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--optimizer", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    ap.add_argument("--recompute", nargs="+", default=list(RECOMPUTE), choices=RECOMPUTE)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--cuda-graph", default="none", choices=["none", "step"],
                    help="the steps eager (none, default) or as a whole-step CUDA graph (step: CUDA; its eager warm-up "
                         "steps and capture are warm-up, the optimizer steps outside the graph, as the examples run)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compiled units (default: the executor's, on with CUDA); --no-compile saves the compile time")
    ap.add_argument("--memory-snapshot", metavar="FILE", default=None,
                    help="record each case's steps (warm-up included) under the CUDA allocator's history: a snapshot per "
                         "case and rank, FILE.<optimizer>-<recompute>.rank<r>.pickle, and its attribution printed (CUDA)")
    ap.add_argument("--hardware", default="h100", help="hardware preset of the simulation (memory does not depend on it)")
    ap.add_argument("--out", default=None, help="JSON file (default: print only)")
    return ap


def predicted(args: argparse.Namespace, plan, mode: str, recompute: str,
              dtype_bytes: int) -> dict[tuple[int, int], tuple[float, float]]:
    """The predicted peak per (pipeline rank, data-parallel rank), and the device memory in use the planner checks
    against the card there (:func:`braid.cost.device_memory.planned_device_bytes`, eager or graphed as the steps ran).

    Static bytes of the mode (:func:`braid.cost.cluster.dp_costs`) plus what the mode table leaves
    out (``zero1``'s reduce-scatter shard), plus the larger of the schedule's activation peak (the
    simulator on the analytic cost model, ``activations="runtime"``, the recomputation's transform)
    and the optimizer step's temporaries on that rank (:mod:`braid.cost.step_memory`): the two never
    coexist, the step runs after the last backward. ``args.compile``: whether the units ran compiled
    (``None``: the executor's default, compiled on CUDA); uncompiled, the head holds the eager loss's
    workspace.
    """
    from braid.cost.cluster import Cluster, Parallel, dp_costs, rank_param_list
    from braid.cost.costs import Layout, analytic_costs
    from braid.cost.device_memory import planned_device_bytes
    from braid.cost.hardware import get_hardware
    from braid.cost.catalog import get_model
    from braid.cost.step_memory import step_transient_bytes
    from braid.simulator.fast import simulate_schedule

    model = get_model(args.model).with_(layers=args.layers, seq=args.seq, micro_batch_size=args.micro_batch_size,
                                        dtype_bytes=dtype_bytes)
    hw = get_hardware(args.hardware)
    # the units compile by default on CUDA (a stored config's null compile is that default)
    compiled = args.compile if args.compile is not None else args.device == "cuda"
    costs = analytic_costs(model, hw, Layout(args.tp, plan.p, plan.v, plan.placement), activations="runtime",
                           recompute=recompute, compiled=compiled)
    rep = simulate_schedule(args.schedule, args.pp, args.mbs, costs).report
    dc = dp_costs(model, costs, Cluster(hw), Parallel(args.tp, args.pp, args.dp, optimizer=mode))
    out = {}
    for r in rep.ranks:
        params = rank_param_list(model, costs, r.rank)
        for k in range(args.dp):
            step = step_transient_bytes(mode, params, args.dp, k)
            static = dc.static_bytes[r.rank] + dc.extra_bytes[r.rank]
            out[(r.rank, k)] = (static + max(r.peak_activation_bytes, step),
                                planned_device_bytes(args.schedule, static_bytes=static,
                                                     activation_bytes=r.peak_activation_bytes, step_bytes=step,
                                                     graphed=getattr(args, "cuda_graph", "none") == "step",
                                                     tp=args.tp, pp=args.pp, pp_rank=r.rank, dp=args.dp,
                                                     placement=plan.placement,
                                                     captured_units=args.mbs * costs.units_on(r.rank)))
    return out


def measure(args, d, groups, plan, mode: str, recompute: str, device: torch.device,
            dtype: torch.dtype) -> tuple[int, int, int | None, int | None, list[str]]:
    """This rank's peak bytes over ``--steps`` steps after ``--warmup`` (module doc), the bytes still
    allocated from the cases before when this one starts (0 on CPU; should be 0 on CUDA), on CUDA the
    allocator's reserved peak over those steps (with what it kept cached from the warm-up) and the device memory
    in use after them (nvidia-smi's view), and with ``--memory-snapshot`` the recorded steps' attribution (lines)."""
    import gc
    from braid.core.compiler import compile_plan
    from braid.models.build import meta_model
    from braid.models.registry import get_family
    from braid.cost.catalog import get_model
    from braid.models.shapes import decoder_config
    from braid.core.partition import split_layers
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks
    from braid.cost.optimizer_modes import state_bytes_per_param
    from braid.training.step import OptimConfig, Optimization

    leftover = 0
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        leftover = torch.cuda.memory_allocated(device)
    preset = get_model(args.model)
    cfg = decoder_config(preset, layers=args.layers)
    model = meta_model(get_family(preset.family).model_cls, cfg, seed=1, std=0.02, device=device)
    c = groups.coords
    chunks = build_rank_chunks(model, plan, c.pp, split_layers(args.layers, plan.num_stages), tp_rank=c.tp,
                               tp_size=args.tp, tp_group=groups.tp if args.tp > 1 else None)
    for ch in chunks.values():
        ch.to(device=device, dtype=dtype)
        ch.set_recompute(recompute)
    ex = Executor.from_groups(plan, compile_plan(plan)[c.pp], chunks, groups, d.abort,
                              act_shape=(args.micro_batch_size, args.seq, cfg.hidden), dtype=dtype, device=device,
                              compile=args.compile)
    from braid.runtime.graphs import WARMUP_STEPS, step_runner

    runner = step_runner(ex, args.cuda_graph)
    warmup = max(args.warmup, WARMUP_STEPS + 1) if runner.mode == "step" else args.warmup  # warm-up, capture, then replays
    named = [(f"{ci}.{n}", p) for ci, ch in chunks.items() for n, p in ch.named_parameters()]
    opt = Optimization(OptimConfig.of_mode(mode, lr=1e-4), named, chunks.values(),
                       groups=groups, abort=d.abort)
    g = torch.Generator().manual_seed(7 + c.dp)
    shape = (args.micro_batch_size, args.seq)
    toks = [torch.randint(0, cfg.vocab_size, shape, generator=g).to(device) for _ in range(args.mbs)]
    labs = [torch.randint(0, cfg.vocab_size, shape, generator=g).to(device) for _ in range(args.mbs)]
    peak_act, res = 0, None

    def steps() -> None:
        nonlocal peak_act, res
        for step in range(warmup + args.steps):
            if step == warmup and device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            opt.zero_grad()
            res = runner.run(toks, labs)
            opt.step()
            if step >= warmup and res.trace.memory:
                peak_act = max(peak_act, max((b for _, b in next(iter(res.trace.memory.values()))), default=0))

    lines: list[str] = []
    if args.memory_snapshot:
        from braid.measure.snapshot import format_attribution, rank_path, record_step

        base = Path(args.memory_snapshot)
        path = rank_path(base.with_name(f"{base.stem if base.suffix else base.name}.{mode}-{recompute}{base.suffix or '.pickle'}"),
                         d.rank, d.world_size)
        lines = format_attribution(record_step(steps, path, device), f"{mode} {recompute} rank {d.rank} ({path})")
    else:
        steps()
    reserved = used = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
    else:
        n = sum(p.numel() for _, p in named)
        out = int(peak_act + n * state_bytes_per_param(mode, torch.empty((), dtype=dtype).element_size(), args.dp))
    opt.close()
    if runner.mode == "step":
        runner.release()
    del ex, runner, opt, chunks, named, model, res, toks, labs
    gc.collect()  # the executor and its chunks may hold each other: free them before the next case
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return int(out), int(leftover), reserved, used, lines


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from braid import schedules
    from braid.io.files import atomic_write_text
    from braid.runtime.distributed import Dist, ProcessGroups
    from braid.core.topology import Topology

    args = _parser().parse_args(argv)
    device = torch.device("cuda", int(__import__("os").environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.cuda_graph == "step" and device.type != "cuda":
        print("bench_memory: --cuda-graph step needs --device cuda", file=sys.stderr)
        return 2
    if args.memory_snapshot and device.type != "cuda":
        print("bench_memory: --memory-snapshot records the CUDA caching allocator's history; it needs --device cuda",
              file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from braid.runtime.compiled import resolve

    try:
        args.compile = resolve(args.compile, device)  # what runs, recorded in the config and used by the prediction
    except ValueError as e:
        print(f"bench_memory: {e}", file=sys.stderr)
        return 2
    d = Dist.from_env(device)
    topo = Topology(d.world_size, pp=args.pp, tp=args.tp, dp=args.dp)
    groups = ProcessGroups.create(topo)
    plan = schedules.build(args.schedule, args.pp, args.mbs)
    runs = []
    for mode in args.optimizer:
        for rc in args.recompute:
            mine = measure(args, d, groups, plan, mode, rc, device, dtype)
            every = [None] * d.world_size
            dist.all_gather_object(every, ((groups.coords.pp, groups.coords.dp), mine))
            both = predicted(args, plan, mode, rc, torch.empty((), dtype=dtype).element_size())
            pred = {at: p for at, (p, _) in both.items()}
            meas = [m for _, (m, *_) in every]
            worst = max(abs(pred[at] - m) / m for at, (m, *_) in every)
            runs.append({"optimizer": mode, "recompute": rc, "measured_bytes": meas,
                         "predicted_bytes": [pred[at] for at, _ in every], "rel_err": worst,
                         "leftover_bytes": [left for _, (_, left, *_) in every],
                         # CUDA: the reserved peak and the device memory in use, against the planner's device figure
                         "reserved_bytes": [r for _, (_, _, r, _, _) in every],
                         "device_used_bytes": [u for _, (_, _, _, u, _) in every],
                         "predicted_device_bytes": [both[at][1] for at, _ in every]})
            if d.rank == 0:
                print(f"{mode:<7} {rc:<10} measured {max(meas) / 2**20:10.1f} MiB  predicted "
                      f"{max(pred.values()) / 2**20:10.1f} MiB  worst error {100 * worst:5.1f}%", flush=True)
                for _, (*_, lines) in every:
                    if lines:
                        print("\n".join(lines), flush=True)
    if d.rank == 0:
        doc = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "config": {k: v for k, v in vars(args).items() if k != "out"},
               "command": "torchrun --nproc-per-node " + str(d.world_size) + " benchmarks/bench_memory.py "
                          + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
               "runs": runs}
        text = json.dumps(doc, indent=1)
        print(text)
        if args.out:
            atomic_write_text(args.out, text)
    d.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
