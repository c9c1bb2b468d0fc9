"""``python -m braid.programs``: print the compiled per-rank programs of a schedule.

Example::

    python -m braid.programs braided_v --pp 4 --mbs 12          # one program per rank
    python -m braid.programs braided_v --pp 4 --mbs 12 --grid   # step x rank grid
    python -m braid.programs zb_v --pp 4 --mbs 8 --json out.json
"""

from __future__ import annotations

import sys
from typing import Sequence

from braid.cli import Parser, check_outputs, run_main
from braid.compiler import ScheduleError, compile_plan, format_grid, peak_activations
from braid.files import atomic_write_text
from braid.ir import programs_to_json


def main(argv: Sequence[str] | None = None) -> int:
    """Print (and with ``--json`` write) the compiled programs; bad input: one line, exit 2."""
    from braid import schedules

    names = schedules.names()
    ap = Parser(prog="python -m braid.programs", description=__doc__.split("\n\n")[0])
    ap.add_argument("schedule", help=f"schedule name: {', '.join(names)}")
    ap.add_argument("--pp", type=int, default=4, help="pipeline ranks p (default 4)")
    ap.add_argument("--mbs", type=int, default=12, help="micro-batches per step m (default 12)")
    ap.add_argument("--chunks", type=int, default=None, help="chunks per rank v (schedule default if omitted)")
    ap.add_argument("--plan-only", action="store_true", help="print the compute plan without P2P instructions")
    ap.add_argument("--grid", action="store_true", help="print a step x rank grid instead of one line per rank")
    ap.add_argument("--json", metavar="FILE", help="also write the compiled programs as JSON")
    args = ap.parse_args(argv)
    if args.schedule not in names:
        ap.error(f"unknown schedule {args.schedule!r}; valid names: {', '.join(names)}")
    for flag, val in (("--pp", args.pp), ("--mbs", args.mbs), ("--chunks", args.chunks)):
        if val is not None and val < 1:
            ap.error(f"{flag} must be a positive integer, got {val}")
    check_outputs(ap, [("--json", args.json)])
    try:
        plan = schedules.build(args.schedule, args.pp, args.mbs, v=args.chunks)
        programs = compile_plan(plan)
    except ScheduleError as err:
        # a generator that emits an invalid plan: a bug, shown with its grid (exit 1)
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        if err.grid:
            print(err.grid, file=sys.stderr)
        return 1
    except ValueError as err:  # the configuration is not one the schedule accepts
        ap.error(str(err))
    if args.json:  # before printing: a reader that stops early (| head) must not cost the file
        atomic_write_text(args.json, programs_to_json(plan, programs))
    rows = list(plan.ranks) if args.plan_only else [p.instructions for p in programs]
    print(f"# {plan.name}: p={plan.p} m={plan.m} v={plan.v} placement={plan.placement}")
    if args.grid:
        print(format_grid(rows))
    else:
        for rank, row in enumerate(rows):
            peak = peak_activations(row)
            print(f"rank {rank} (peak {peak} chunk-activations): " + " ".join(str(i) for i in row))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
