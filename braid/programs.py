"""``python -m braid.programs``: print the compiled per-rank programs of a schedule.

Example::

    python -m braid.programs braided_v --pp 4 --mbs 12          # one program per rank
    python -m braid.programs braided_v --pp 4 --mbs 12 --grid   # step x rank grid
    python -m braid.programs zb_v --pp 4 --mbs 8 --json out.json
    python -m braid.programs braided_v --pp 4 --mbs 12 --format torch-csv -o braided_v.csv
    python -m braid.programs --import-torch-csv dualpipev.csv    # a schedule torch wrote

``--format torch-csv`` writes torch.distributed.pipelining's compute-only schedule CSV
(one row per rank of ``_Action`` strings, braided blocks as ``OVERLAP_F_B``), which
``_PipelineScheduleRuntime._load_csv`` reads; ``--import-torch-csv`` reads one (e.g. what
``ScheduleDualPipeV._dump_csv(path, format="compute_only")`` wrote) as a braid plan and
compiles it (see :mod:`braid.core.torch_format`).
"""

from __future__ import annotations

import sys
from typing import Sequence

from braid.io.cli import Parser, check_outputs, run_main
from braid.core.compiler import ScheduleError, compile_plan, format_grid, peak_activations
from braid.io.files import atomic_write_text
from braid.core.ir import Braided, programs_to_json
from braid.core.torch_format import PlanLimits, TorchFormatError, from_torch_csv, to_torch_csv
from braid.io.cli import check_counts, check_plan_size
from braid.io.inputs import InputFileError, read_text
from braid.io.limits import PLAN_FILE_LIMITS, TORCH_CSV


def main(argv: Sequence[str] | None = None) -> int:
    """Print (and with ``--json`` write) the compiled programs; bad input: one line, exit 2."""
    from braid import schedules

    names = schedules.names()
    ap = Parser(prog="python -m braid.programs", description=__doc__.split("\n\n")[0])
    ap.add_argument("schedule", nargs="?", help=f"schedule name: {', '.join(names)}")
    ap.add_argument("--pp", type=int, default=4, help="pipeline ranks p (default 4)")
    ap.add_argument("--mbs", type=int, default=12, help="micro-batches per step m (default 12)")
    ap.add_argument("--chunks", type=int, default=None, help="chunks per rank v (schedule default if omitted)")
    ap.add_argument("--braid", choices=("all", "none"), default=None,
                    help="schedules with braided blocks: all (their default) or none (each block's ops one after the "
                         "other); the cost-aware choice needs a cost model: python -m braid.simulate --braid auto")
    ap.add_argument("--plan-only", action="store_true", help="print the compute plan without P2P instructions")
    ap.add_argument("--grid", action="store_true", help="print a step x rank grid instead of one line per rank")
    ap.add_argument("--json", metavar="FILE", help="also write the compiled programs as JSON")
    ap.add_argument("--format", choices=("text", "torch-csv"), default="text",
                    help="text (default): print the programs; torch-csv: the plan as torch.distributed.pipelining's "
                         "compute-only schedule CSV, to -o or stdout")
    ap.add_argument("-o", "--output", metavar="FILE", help="--format torch-csv: write the CSV here instead of stdout")
    ap.add_argument("--import-torch-csv", metavar="FILE",
                    help="read the plan from a torch compute-only schedule CSV instead of a schedule name")
    args = ap.parse_args(argv)
    if (args.schedule is None) == (args.import_torch_csv is None):
        ap.error("give a schedule name or --import-torch-csv FILE (one of them)")
    if args.schedule is not None and args.schedule not in names:
        ap.error(f"unknown schedule {args.schedule!r}; valid names: {', '.join(names)}")
    check_counts(ap, args, ("pp", "mbs", "chunks"))
    if args.braid is not None and (args.schedule is None or schedules.get_schedule(args.schedule).knob("braid") is None):
        ap.error(f"--braid: {args.schedule or 'an imported CSV'} has no braided blocks to choose; use it with "
                 + ", ".join(n for n in names if schedules.get_schedule(n).knob("braid")))
    if args.output and args.format != "torch-csv":
        ap.error("-o writes the torch CSV: use it with --format torch-csv (or --json FILE for the programs)")
    check_outputs(ap, [("-o", args.output), ("--json", args.json)],
                  inputs=tuple(x for x in (args.import_torch_csv,) if x))
    check_plan_size(ap, args.pp, args.mbs)
    if args.import_torch_csv:
        try:
            text = read_text(args.import_torch_csv, "torch schedule CSV", TORCH_CSV)
            plan = from_torch_csv(text, name=args.import_torch_csv.rsplit("/", 1)[-1].removesuffix(".csv"),
                                  limits=PlanLimits(**PLAN_FILE_LIMITS))
            programs = compile_plan(plan)
        except InputFileError as err:
            ap.error(f"--import-torch-csv {err}")
        except (ScheduleError, ValueError, TorchFormatError) as err:  # a CSV that is not a runnable schedule: bad input
            ap.error(f"--import-torch-csv {args.import_torch_csv}: {str(err).splitlines()[0]}")
    try:
        if not args.import_torch_csv:
            knobs = {} if args.braid is None else {"braid": args.braid}
            plan = schedules.build(args.schedule, args.pp, args.mbs, v=args.chunks, **knobs)
            programs = compile_plan(plan)
    except ScheduleError as err:
        # a generator that emits an invalid plan: a bug, shown with its grid (exit 1)
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        if err.grid:
            print(err.grid, file=sys.stderr)
        return 1
    except (ValueError, TorchFormatError) as err:  # a configuration the schedule does not accept, a bad CSV
        ap.error(str(err))
    if args.json:  # before printing: a reader that stops early (| head) must not cost the file
        atomic_write_text(args.json, programs_to_json(plan, programs))
    if args.format == "torch-csv":
        text = to_torch_csv(plan)
        if args.output:
            atomic_write_text(args.output, text)
        else:
            sys.stdout.write(text)
        return 0
    rows = list(plan.ranks) if args.plan_only else [p.instructions for p in programs]
    blocks = sum(isinstance(i, Braided) for ops in plan.ranks for i in ops)
    print(f"# {plan.name}: p={plan.p} m={plan.m} v={plan.v} placement={plan.placement} braided blocks={blocks}")
    if args.grid:
        print(format_grid(rows))
    else:
        for rank, row in enumerate(rows):
            peak = peak_activations(row)
            print(f"rank {rank} (peak {peak} chunk-activations): " + " ".join(str(i) for i in row))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
