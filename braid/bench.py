"""``python -m braid.bench``: measured step time of several schedules next to the simulator's prediction.

One invocation spawns the layout's ranks once (gloo on CPU, NCCL on GPU), profiles the
model (:mod:`braid.profile`; or reads ``--costs FILE``), then runs every schedule for every
``--mbs`` on the same model, layout and data through the executor: median step time after
warm-up (slowest rank per step), tokens/s, MFU and peak memory per rank. Each is predicted
by the simulator from the profile, and the relative error is printed beside it -- the
"one IR, two interpreters" check of the design (measured and simulated traces of the same
programs). External baselines run on the same model in the same job:
``torch.distributed.pipelining`` (``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``, via :mod:`braid.baselines.torch_pp`; tp > 1 with DTensor tensor
parallelism) and megatron-core's interleaved 1F1B on a megatron-core GPT model with the
same weights (:mod:`braid.baselines.mcore`; reported as not installed when it is missing),
each in the modes of its peer (eager and best by default; :mod:`braid.measure.peers`).

Peak memory: on GPU the allocator's peak during the step minus what was allocated before
it; on CPU the largest live saved-activation bytes at instruction ends (the executor's
memory series), compared with the simulated series sampled at the same points.

``--memory-snapshot FILE`` (CUDA) records one more step of the first run under the caching
allocator's history: torch's snapshot file per rank, and the blocks live at the step's peak by
term (model unit, runtime, optimizer; :mod:`braid.measure.snapshot`).

A mixture-of-experts ``--model`` (``qwen3-moe-tiny``, ``qwen3-moe-30b-a3b``, ...) with ``--ep E`` runs E
data-parallel replicas of the ``tp x pp`` layout, each on micro-batches of its own, every MoE layer's
experts sharded over them (:mod:`braid.measure.experts`); rows add the all-to-all per step (exposed of
all, predicted and measured) and the expert load (tokens per expert and per EP rank, the busiest over
the mean). Its steps read the routing counts on the host at ep > 1, so braid's rows run eager there.

A vision-language ``--model`` (``qwen2-vl-7b``, ...) runs the whole step as ``examples/qwen2_vl.py``
does, its vision chunk on the first virtual stage (:mod:`braid.profile`); the external baselines
pipeline decoder LMs only, and their rows say so.

``--capture FILE`` stores the measurements with the profile they are predicted from
(``tests/test_accuracy.py`` re-predicts every stored set in CI). Examples::

    python -m braid.bench --preset tiny --pp 2 --mbs 4 8 --json out.json --trace-dir traces
    python -m braid.bench --preset 7b-layer --tp 2 --pp 1 --seq 4096 --mbs 4 8 --capture tests/data/measurements_h200.json
    python -m braid.bench --model llama3-8b --hidden 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 128 --pp 2 --mbs 4
    python -m braid.bench --model qwen2-vl-7b --tp 2 --pp 1 --seq 2048 --micro-batch-size 2 --mbs 8 --rounds 5 --schedule braided_v 1f1b_i
    python -m braid.bench --model qwen3-moe-30b-a3b --ep 2 --pp 1 --layers-per-stage 1 --seq 4096 --mbs 4 8 --schedule braided_v 1f1b_i zb_v
    python -m braid.viz traces/braided_v_m8.json -o braided_v.html
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Sequence

from braid.cost.costs import CostFileError, load_cost_json
from braid.io.cli import Parser, check_counts, check_output_dir, check_outputs, check_plan_size, run_main
from braid.io.files import atomic_write_text
from braid.measure.config import (
    DEFAULT_SCHEDULES,
    BenchConfig,
    add_model_args,
    config_from_args,
)
from braid.measure.launch import JobFailed
from braid.measure.peers import add_peer_args, peer_runs_from_args
from braid.measure.report import capture, format_report, read_measurements
from braid.measure.runs import _check_costs, planned_runs, run_bench

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; bad input is one line on stderr and exit 2, before any process starts."""
    from braid import schedules

    ap = Parser(prog="python -m braid.bench", description=__doc__.split("\n\n")[1],
                epilog="Examples:\n" + __doc__.split("Examples::")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--schedule", nargs="+", default=list(DEFAULT_SCHEDULES), help=f"schedules (default {' '.join(DEFAULT_SCHEDULES)})")
    ap.add_argument("--mbs", type=int, nargs="+", default=[4, 8], help="micro-batch counts m (default 4 8)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps; the median is reported (default 5)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every schedule and baseline this many times in turn and report braid's best over the "
                         "best baseline per round, median [min, max] (default 1)")
    ap.add_argument("--cuda-graph", choices=["none", "step"], default=None,
                    help="braid's runs as whole-step CUDA graphs (step) or eager (none); default: step where capturable. "
                         "'peak' of a graphed run is its capture's allocator peak; 'host ms' is the launching thread's CPU time per step")
    ap.add_argument("--costs", metavar="FILE", help="predict from this cost file instead of a fresh profile")
    ap.add_argument("--no-calibrate", action="store_true", help="predict from the raw profile (no probe-run calibration)")
    ap.add_argument("--no-external", action="store_true", help="skip the external baselines (torch.distributed.pipelining; megatron-core when installed)")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON (with --rounds N, also after each round: "
                    "the rounds so far, 'rounds_done' of N, so a run stopped early leaves what it measured)")
    ap.add_argument("--trace-dir", metavar="DIR", help="write <schedule>_m<m>.json (simulated + measured trace) per run")
    ap.add_argument("--probe-mbs", type=int, default=None, metavar="M",
                    help="micro-batches of the calibration probe (default 4 x --pp: long enough that a power-capped "
                         "GPU runs it at the clock of the benchmarked steps; it holds all M micro-batches' "
                         "activations at once: without this flag m is lowered, to no less than --pp, until it fits)")
    ap.add_argument("--capture", metavar="FILE", help="add this run's measurements and profile to a stored set file")
    ap.add_argument("--capture-name", default=None, help="name of the stored set (default <device>-tp<t>-pp<p>, "
                    "with -graphed where every run was one CUDA graph replay)")
    ap.add_argument("--compute-busy", action="store_true",
                    help="profile one more step of every run and baseline in the first round (CUDA): each rank's "
                         "compute time, NCCL kernels and copies left out, and from it the most any schedule of this "
                         "partition and these kernels could gain over the best baseline")
    ap.add_argument("--memory-snapshot", metavar="FILE",
                    help="after the first run's timed steps, record one more step (eager) under the CUDA allocator's "
                         "history: torch's snapshot pickle per rank (FILE with one rank, else FILE.rank<r>.pickle; "
                         "pytorch.org/memory_viz opens it), and print the blocks live at its peak by term (model unit, "
                         "runtime, optimizer; python -m braid.measure.snapshot FILE prints it again). Narrow --schedule "
                         "and --mbs to pick the run; CUDA only")
    add_peer_args(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = schedules.names()
    bad = [s for s in args.schedule if s not in names]
    if bad:
        ap.error(f"unknown schedule {bad[0]!r}; valid names: {', '.join(names)}")
    if args.probe_mbs is not None and args.probe_mbs < args.pp:
        ap.error(f"--probe-mbs must be >= --pp ({args.pp}): every pipeline rank needs a micro-batch")
    check_counts(ap, args, ("mbs", "steps", "rounds", "warmup"), at_least_zero=("warmup",))
    pc = config_from_args(ap, args)
    peers = tuple(peer_runs_from_args(ap, args, pc.tp, pc.device, pc=pc))
    if not args.no_external:
        try:
            pc.peer_layers_per_stage  # the external baselines' whole-layer split
        except ValueError as err:
            ap.error(f"--layers-per-stage {args.layers_per_stage}: the external baselines split whole layers, and {err}; "
                     "use --no-external or more layers")
    if args.cuda_graph == "step":
        from braid.runtime.graphs import config_reason

        why = config_reason(pc.device, tp=pc.tp, tp_backend=pc.tp_backend, ep=pc.ep, moe=bool(getattr(pc.model, "experts", 0)),
                            moe_dispatch=pc.moe_dispatch)
        if why:
            ap.error(f"--cuda-graph step: {why}; use --cuda-graph none")
    if args.compute_busy and pc.device != "cuda":
        ap.error("--compute-busy reads the CUDA profiler; it needs --device cuda")
    if args.memory_snapshot and pc.device != "cuda":
        ap.error("--memory-snapshot records the CUDA caching allocator's history; it needs --device cuda")
    check_plan_size(ap, pc.pp, max([*args.mbs, args.probe_mbs or 0]))
    check_outputs(ap, [("--json", args.json), ("--capture", args.capture), ("--memory-snapshot", args.memory_snapshot)],
                  inputs=[args.costs] if args.costs else [])
    check_output_dir(ap, "--trace-dir", args.trace_dir)
    bc = BenchConfig(pc, tuple(args.schedule), tuple(args.mbs), args.warmup, args.steps, None, not args.no_external,
                     not args.no_calibrate, args.rounds, args.cuda_graph, peers=peers,
                     partial_json=str(Path(args.json).resolve()) if args.json else None, probe_mbs=args.probe_mbs,
                     compute_busy=args.compute_busy, memory_snapshot=args.memory_snapshot)
    runs, skipped = planned_runs(bc)
    if not runs:
        ap.error(f"no run fits this layout: {skipped[0]}" + (f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""))
    if args.costs:
        try:
            costs = load_cost_json(args.costs)
            _check_costs(costs, args.costs, pc, runs)
        except CostFileError as err:
            ap.error(str(err))
        bc = dataclasses.replace(bc, costs=costs)
    if args.capture:
        try:
            read_measurements(args.capture)
        except ValueError as err:
            ap.error(f"--capture {err}")
    try:
        summary = run_bench(bc)
    except JobFailed as err:
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        return 1
    traces = summary.pop("_traces")
    print(f"# {args.model or args.preset or 'tiny'}: tp={pc.tp} pp={pc.pp}{f' ep={pc.ep} (dp={pc.dp})' if pc.ep > 1 else ''} v={pc.v} layers/stage={','.join(map(str, pc.layers_per_stage))} "
          f"seq={pc.seq}{' sequence-parallel' if pc.seq_shard else ''} on {summary['device']} ({pc.dtype})")
    print(format_report(summary))
    shot = summary.get("memory_snapshot")
    if shot:
        from braid.measure.snapshot import format_attribution

        for att in shot["ranks"]:
            print("\n".join(format_attribution(att, f"memory snapshot, {shot['schedule']} m={shot['m']}, rank "
                                                     f"{att['rank']} ({att['file']})")))
    if args.json:
        atomic_write_text(args.json, json.dumps(summary, indent=1))
    if args.trace_dir:
        from braid.io.trace import dump_traces

        out = Path(args.trace_dir)
        out.mkdir(parents=True, exist_ok=True)
        for key, pair in traces.items():
            dump_traces(list(pair), out / f"{key}.json")
    if not summary["runs"]:
        print(f"{ap.prog}: error: every run was skipped (see the notes above)", file=sys.stderr)
        return 1
    if args.capture:
        graphed = "-graphed" if summary["runs"] and all(r.get("cuda_graph") == "step" for r in summary["runs"]) else ""
        capture(summary, args.capture, args.capture_name or f"{pc.device}-tp{pc.tp}-pp{pc.pp}{graphed}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
