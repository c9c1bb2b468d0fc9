"""``python -m braid.simulate``: predict which pipeline schedule wins, before launch.

Compiles every registered schedule (or the ones named with ``--schedule``) for ``--pp``
pipeline ranks and ``--mbs`` micro-batches, simulates one training step of each on the
cost model, and prints a table sorted by step time: speed-up over interleaved 1F1B
(``1f1b_i``), PP bubble and exposed TP communication as a share of the step (worst rank),
and the worst rank's peak activation memory in GiB and in M_a (one micro-batch's
activations on one chunk). Schedules that reject the configuration (e.g. ``m < 2p`` for
``braided_v``) are skipped with a note.

Defaults: the paper's 12.1B Qwen2 LLM on H200, TP=2 (so TP all-reduces matter, which is
what braided schedules hide), sequence 4096, micro-batch size 1. ``--costs FILE`` replaces
the analytic model with measured or hand-written per-chunk costs (``docs/costs.md``).

Examples::

    python -m braid.simulate --pp 4 --mbs 12
    python -m braid.simulate --pp 4 --mbs 16 --tp 8 --model qwen2-vl-15b --hardware a800
    python -m braid.simulate --pp 4 --mbs 12 --schedule braided_v --schedule zb_v --html timeline.html
    python -m braid.simulate --pp 2 --mbs 8 --schedule braided_v --schedule braided_v_offload --offload-alpha 0.5
    python -m braid.simulate --pp 4 --mbs 12 --costs uniform.json --json report.json --trace trace.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Sequence

from braid.costs import CostFileError, CostModel, Layout, analytic_costs, read_costs
from braid.hardware import HARDWARE, get_hardware
from braid.models_catalog import MODELS, get_model

log = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser(schedule_names: Sequence[str]) -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m braid.simulate", description=__doc__.split("\n\n")[1] + "\n\n" + __doc__.split("\n\n")[2],
                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n\n".join(__doc__.split("\n\n")[3:]))
    ap.add_argument("--schedule", action="append", metavar="NAME",
                    help=f"schedule to simulate (repeatable; default: all of {', '.join(schedule_names)})")
    ap.add_argument("--pp", type=int, default=4, help="pipeline ranks p (default 4)")
    ap.add_argument("--mbs", type=int, default=12, help="micro-batches per step m (default 12)")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size t (default 2, so TP comm matters)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length in tokens (default: the model's, 4096)")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="samples per micro-batch (default 1)")
    ap.add_argument("--model", default="qwen2-12b", help=f"model preset (default qwen2-12b): {', '.join(MODELS)}")
    ap.add_argument("--hardware", default="h200", help=f"hardware preset (default h200): {', '.join(HARDWARE)}")
    ap.add_argument("--costs", metavar="FILE", help="cost file replacing the analytic timings (schema: docs/costs.md)")
    ap.add_argument("--offload-alpha", default="auto", metavar="A|auto",
                    help="braided_v_offload: fraction of chunk-0 activations offloaded (0..1), or 'auto' (default): "
                         "the lowest predicted peak within --offload-budget of braided_v's step time "
                         "(braid.offload.tune_offload; ~100 simulations: seconds at p=8, m=64)")
    ap.add_argument("--offload-budget", type=float, default=0.01, metavar="F",
                    help="--offload-alpha auto: step-time slowdown allowed for a lower peak, as a fraction "
                         "(default 0.01 = 1%%)")
    ap.add_argument("--recompute", default="none", choices=["none", "selective"],
                    help="activation recomputation of the LM layers: 'selective' re-runs the attention core and the "
                         "SwiGLU product in the backward (more backward time, fewer saved bytes; analytic costs)")
    ap.add_argument("--json", metavar="FILE", help="write the reports as JSON: {config, schedules: {name: {...}}}")
    ap.add_argument("--trace", metavar="FILE", help="write the simulated traces (braid trace format, all schedules)")
    ap.add_argument("--html", metavar="FILE", help="write an interactive timeline of all simulated schedules (needs plotly)")
    return ap


def _costs_for(args: argparse.Namespace, model, hw, plan) -> CostModel:
    layout = Layout(args.tp, plan.p, plan.v, plan.placement)
    base = analytic_costs(model, hw, layout, recompute=args.recompute)
    if not args.costs:
        return base
    specs = {k: c.spec for k, c in base.chunks.items()}
    return read_costs(args.costs, layout, specs, base=base)


def _offload_options(args: argparse.Namespace, name: str) -> dict[str, float]:
    if name != "braided_v_offload" or args.offload_alpha == "auto":
        return {}
    return {"offload_alpha": args.offload_alpha, "offload_alpha_warmup": args.offload_alpha}


def run(args: argparse.Namespace, schedule_names: Sequence[str]) -> tuple[dict[str, Any], list, list[str]]:
    """Simulate the selected schedules; returns (json document, traces, notes)."""
    from braid import schedules
    from braid.compiler import ScheduleError, compile_plan
    from braid.offload import tune_offload
    from braid.simulator import simulate

    model = get_model(args.model)
    changes = {k: v for k, v in (("seq", args.seq), ("micro_batch_size", args.micro_batch_size)) if v is not None}
    model = model.with_(**changes) if changes else model
    hw = get_hardware(args.hardware)
    doc: dict[str, Any] = {"config": {"pp": args.pp, "mbs": args.mbs, "tp": args.tp, "seq": model.seq,
                                      "micro_batch_size": model.micro_batch_size, "model": model.name,
                                      "hardware": hw.name, "costs": args.costs,
                                      "recompute": args.recompute}, "schedules": {}}
    traces, notes, reports = [], [], []
    for name in schedule_names:
        try:
            plan = schedules.build(name, args.pp, args.mbs, **_offload_options(args, name))
            costs = _costs_for(args, model, hw, plan)
            if name == "braided_v_offload" and args.offload_alpha == "auto":
                choice = tune_offload(plan, costs, max_slowdown=args.offload_budget)
                plan = schedules.build(name, args.pp, args.mbs, **choice.options())
                notes.append(f"braided_v_offload: auto offload {choice.describe()}")
            programs = compile_plan(plan)
        except CostFileError:
            raise
        except (ScheduleError, ValueError) as err:
            notes.append(f"skipped {name}: {err}")
            continue
        res = simulate(programs, costs, name=name, record=bool(args.trace or args.html))
        reports.append(res.report)
        traces.append(res.trace)
        doc["schedules"][name] = res.report.to_dict()
        doc["schedules"][name]["peak_memory_gib"] = res.report.worst_peak.peak_activation_bytes / 2**30
    doc["reports"] = reports
    # fastest first, as in the table, so the viewer opens on the winner
    traces.sort(key=lambda t: t.step_time)
    return doc, traces, notes


def main(argv: Sequence[str] | None = None) -> int:
    from braid import schedules
    from braid.simulator import format_table

    names = schedules.names()
    ap = _parser(names)
    args = ap.parse_args(argv)
    chosen = args.schedule or names
    unknown = [s for s in chosen if s not in names]
    if unknown:
        ap.error(f"unknown schedule {unknown[0]!r}; valid names: {', '.join(names)}")
    for flag, val in (("--pp", args.pp), ("--mbs", args.mbs), ("--tp", args.tp), ("--seq", args.seq),
                      ("--micro-batch-size", args.micro_batch_size)):
        if val is not None and val < 1:
            ap.error(f"{flag} must be a positive integer, got {val}")
    if args.offload_alpha != "auto":
        try:
            args.offload_alpha = float(args.offload_alpha)
        except ValueError:
            args.offload_alpha = -1.0
        if not 0.0 <= args.offload_alpha <= 1.0:
            ap.error("--offload-alpha must be a number in [0, 1] or 'auto'")
    if not 0.0 <= args.offload_budget < 1.0:
        ap.error(f"--offload-budget must be a fraction in [0, 1), e.g. 0.03 for 3%, got {args.offload_budget}")
    if args.model not in MODELS:
        ap.error(f"unknown model {args.model!r}; valid names: {', '.join(MODELS)}")
    if args.hardware not in HARDWARE:
        ap.error(f"unknown hardware {args.hardware!r}; valid names: {', '.join(HARDWARE)}")
    try:
        doc, traces, notes = run(args, chosen)
    except CostFileError as err:
        ap.error(str(err))
    reports = doc.pop("reports")
    cfg = doc["config"]
    print(f"# {cfg['model']} on {cfg['hardware']}: tp={cfg['tp']} pp={cfg['pp']} m={cfg['mbs']} "
          f"seq={cfg['seq']} micro-batch={cfg['micro_batch_size']}" + (f" costs={cfg['costs']}" if cfg["costs"] else ""))
    if reports:
        print(format_table(reports))
    for n in notes:
        print(f"note: {n}")
    if not reports:
        print("python -m braid.simulate: error: no selected schedule accepts this configuration "
              "(see the notes above; e.g. raise --mbs)", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.trace:
        from braid.trace import dump_traces

        dump_traces(traces, args.trace)
    if args.html:
        try:
            import plotly  # noqa: F401
            from braid import viz
        except ImportError as err:
            print(f"error: --html needs plotly and the viewer ({err}); pip install plotly", file=sys.stderr)
            return 1
        viz.render_html(traces, args.html)
    return 0


if __name__ == "__main__":
    sys.exit(main())
