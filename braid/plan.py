"""``python -m braid.plan``: the fastest layout and schedule for N GPUs under a memory cap.

Enumerates every valid (tp, pp, dp, cp = hp x ring, SP placement, schedule and its knobs,
micro-batch count and size, recomputation) for ``--gpus`` GPUs in nodes of
``--gpus-per-node``, prunes by memory first (weights, gradients, optimizer states), then
simulates candidates in order of a lower bound of their step time (the simulator's fast
path plus the data-parallel tail) until ``--top`` fit and no unsimulated one can beat the
first, or ``--max-simulations`` have run (a count, so the answer is the same on any machine;
the output then says the best is unproven). Prints the ranking (predicted
tokens/s, MFU, step time, peak memory per GPU, bubble of the busiest rank, exposed
communication) and the ``torchrun`` command line of the best configuration.
(:mod:`braid.planner.search` explains the search, :mod:`braid.cost.cluster` the job cost model.)

Examples::

    python -m braid.plan --model qwen2-vl-72b --gpus 1024 --gpus-per-node 8 --hardware h200 \\
        --global-batch 2048 --seq 8192 --json plan.json --html plan.html
    python -m braid.plan --model qwen2-72b --gpus 64 --seq 32768 --global-batch 128 --optimizer plain
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from braid.cost.cluster import Cluster
from braid.cost.costs import stage_lighter
from braid.cost.hardware import HARDWARE, get_hardware
from braid.cost.catalog import MODELS
from braid.cost.device_memory import MEMORY_MARGIN
from braid.planner.search import MAX_SIMULATIONS, MICRO_BATCH_SIZES, Evaluation, Problem, SearchResult, layouts, search
from braid.simulate import resolve_model
from braid.cost.optimizer_modes import DEFAULT_OPTIMIZER, OPTIMIZERS, describe
from braid.io.cli import MAX_MBS, check_outputs, resolve_seq_shard

MAX_GPUS = 1 << 20  # beyond any cluster: the job costs and torchrun lines of more are meaningless


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parts = __doc__.split("\n\n")
    ap = _Parser(prog="python -m braid.plan", description=parts[1], epilog="\n\n".join(parts[2:]),
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, metavar="NAME|CONFIG",
                    help=f"model preset: {', '.join(MODELS)}; or a Hugging Face config.json (or its checkpoint directory)")
    ap.add_argument("--gpus", type=int, required=True, help=f"GPUs of the job (world size, at most {MAX_GPUS:,})")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    ap.add_argument("--hardware", default="h200", help=f"hardware preset (default h200): {', '.join(HARDWARE)}")
    ap.add_argument("--memory", type=float, default=None, metavar="GiB",
                    help="memory cap per GPU in GiB (default: the hardware's device memory as the driver reports it, "
                         "140.4 GiB on h200 -- sold as 141 GB; braid.cost.hardware.DEVICE_MIB)")
    ap.add_argument("--memory-margin", type=float, default=MEMORY_MARGIN, metavar="F",
                    help="share of the cap kept back, in [0, 1): a pick's predicted device memory in use stays within "
                         "(1 - F) x the cap (default %(default)g: the median by which the measured memory in use has "
                         "exceeded the prediction, braid.cost.device_memory.MEMORY_MARGIN)")
    ap.add_argument("--global-batch", type=int, default=None, metavar="B", help="samples per step (default: 2 per GPU)")
    ap.add_argument("--seq", type=int, default=None, help="LM tokens per sample (default: the model's, 4096)")
    ap.add_argument("--optimizer", default=DEFAULT_OPTIMIZER, choices=OPTIMIZERS,
                    help="; ".join(f"{m}: {describe(m)}" for m in OPTIMIZERS)
                         + " -- the examples' --optimizer; bytes per parameter: docs/training.md")
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                    help="rank the layouts with sequence parallelism inside TP where the examples turn it on (tp > 1, no "
                         "--cp, a dense decoder LM; the examples' flag of that name) or without it (default: with it, as "
                         "the examples run)")
    ap.add_argument("--ep", default="auto", metavar="E|auto",
                    help="a mixture-of-experts model's expert-parallel degree: auto (default) searches every power of "
                         "two that divides a layout's data-parallel ranks and, times tp, the experts; a number fixes it "
                         "(the layouts whose data-parallel ranks it divides keep it; cp 1; the examples' --ep)")
    ap.add_argument("--moe-imbalance", type=float, default=1.0, metavar="F",
                    help="the busiest expert rank's routed tokens over the mean (>= 1, default 1; braid.simulate's)")
    ap.add_argument("--top", type=int, default=10, metavar="K", help="configurations to rank (default 10)")
    ap.add_argument("--max-simulations", type=int, default=MAX_SIMULATIONS, metavar="N",
                    help=f"simulations before the search stops with what it has (default {MAX_SIMULATIONS}): a count, "
                         "so the answer is the same on any machine")
    ap.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="also stop after S seconds (off by default: with it the answer depends on the machine's speed)")
    ap.add_argument("--json", metavar="F", help="write every ranked configuration with its command as JSON")
    ap.add_argument("--html", metavar="F", help="Plotly page: throughput vs memory of every simulated candidate, "
                                                "and the best one's timeline (F with .timeline.html; needs plotly)")
    return ap


def torchrun_command(prob: Problem, ev: Evaluation) -> str:
    """The command line that trains ``ev``'s configuration with the example scripts."""
    from braid import schedules

    c, p, mdl = ev.cand, ev.cand.par, prob.model
    g = prob.cluster.gpus_per_node
    nodes = max(1, prob.gpus // g)
    if nodes * min(g, prob.gpus) != prob.gpus:
        raise ValueError(f"{prob.gpus} GPUs are not {nodes} node(s) of {g}: torchrun starts as many processes on every node")
    vision = mdl.vit is not None
    script = "examples/qwen2_vl.py" if vision else "examples/lm.py"
    spec = schedules.get_schedule(c.schedule)
    args = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={min(g, prob.gpus)}"]
    if nodes > 1:
        args += ["--rdzv-backend=c10d", "--rdzv-endpoint=$MASTER_ADDR:29500"]
    seq = mdl.seq - (mdl.vit.patches // 4 if vision else 0)  # the VLM script's --seq counts caption tokens
    args += [script, "--model", mdl.name, "--schedule", c.schedule,
             "--tp", str(p.tp), "--pp", str(p.pp), "--dp", str(p.dp), "--global-batch-size", str(prob.global_batch),
             "--micro-batch-size", str(p.micro_batch_size), "--seq", str(seq),
             "--last-stage-lighter", f"{stage_lighter(mdl, p.pp * spec.v) if c.lighter is None else c.lighter:g}",
             "--optimizer", p.optimizer]
    if p.ep > 1:
        args += ["--ep", str(p.ep)]
    if p.recompute:
        args += ["--recompute", "full"]
    if p.seq_shard != resolve_seq_shard(None, p.tp, seq=mdl.seq, cp=p.cp, vision=vision, moe=bool(mdl.experts)):
        args += ["--sequence-parallel" if p.seq_shard else "--no-sequence-parallel"]  # not the example's default
    if p.cp > 1:
        args += ["--cp", str(p.cp), "--hp", str(p.hp), "--placement", p.sp_placement]
        if p.ring:
            args += ["--ring-size", str(p.ring)]
    for name, val in c.options:
        args += [f"--{name.replace('_', '-')}", f"{val:g}" if isinstance(val, float) else str(val)]
    return " ".join(a if a.startswith("--rdzv-endpoint") else shlex.quote(a) for a in args)


def _notes(prob: Problem, ev: Evaluation) -> list[str]:
    notes = []
    if prob.model.name not in MODELS:
        notes.append(f"examples/ build the catalog's presets: give the checkpoint of {prob.model.name} as --hf DIR "
                     "instead of --model")
    return notes


def document(prob: Problem, res: SearchResult, hw_name: str, cap_bytes: float | None = None,
             margin: float = 0.0) -> dict[str, Any]:
    """The JSON document: problem, search statistics, ranked configurations with their commands. ``cap_bytes``:
    the memory cap per GPU (default ``prob.memory_bytes``), of which ``margin`` is kept back: ``prob.memory_bytes``
    is the planned memory, what a pick's prediction may reach (``over_cap`` lists those above it)."""
    cap_bytes = prob.memory_bytes if cap_bytes is None else cap_bytes
    ranked = []
    for i, ev in enumerate(res.best, 1):
        ranked.append({"rank": i, **ev.to_dict(), "command": torchrun_command(prob, ev), "notes": _notes(prob, ev)})
    return {
        "problem": {"model": prob.model.name, "gpus": prob.gpus, "gpus_per_node": prob.cluster.gpus_per_node,
                    "hardware": hw_name, "memory_gib": cap_bytes / 2**30,
                    "memory_margin": margin, "planned_gib": prob.memory_bytes / 2**30, "global_batch": prob.global_batch,
                    "seq": prob.model.seq, "optimizer": prob.optimizer},
        "search": {"enumerated": res.enumerated, "memory_pruned": res.memory_pruned, "simulated": len(res.evaluated),
                   "bound_pruned": res.bound_pruned, "best_proven": res.complete, "stopped": res.stopped or None,
                   "elapsed_s": res.elapsed_s},
        "ranked": ranked,
        "over_cap": [{**ev.to_dict(), "command": torchrun_command(prob, ev)} for ev in over_cap(prob, res)],
        "simulated": [ev.to_dict() for ev in res.evaluated],
    }


def over_cap(prob: Problem, res: SearchResult) -> list[Evaluation]:
    """The simulated configurations faster than the pick that the planned memory (the cap less the margin)
    rejected, fastest first."""
    first = res.best[0].step_s if res.best else float("inf")
    return sorted((e for e in res.evaluated if e.peak_bytes > prob.memory_bytes and e.step_s < first), key=lambda e: e.step_s)


def format_ranking(res: SearchResult) -> str:
    head = (f"{'#':>3} {'tokens/s':>11} {'MFU %':>6} {'step s':>8} {'peak GiB':>9} {'bubble %':>9} {'comm %':>7}  configuration")
    lines = [head, "-" * len(head)]
    for i, ev in enumerate(res.best, 1):
        lines.append(f"{i:>3} {ev.tokens_s:>11.0f} {100 * ev.mfu:>6.1f} {ev.step_s:>8.3f} {ev.peak_bytes / 2**30:>9.1f} "
                     f"{100 * ev.bubble_frac:>9.1f} {100 * ev.exposed_comm_frac:>7.1f}  {ev.cand.describe()}")
    return "\n".join(lines)


def _write_html(prob: Problem, res: SearchResult, path: str) -> None:
    import plotly.graph_objects as go

    from braid import viz
    from braid.io.files import atomic_write_text
    from braid.planner.search import costs_of
    from braid.simulator import simulate
    from braid.simulator.fast import compiled

    best = res.best[0]
    fits = [e for e in res.evaluated if e.peak_bytes <= prob.memory_bytes]
    over = [e for e in res.evaluated if e.peak_bytes > prob.memory_bytes]
    fig = go.Figure()
    for evs, name in ((fits, "fits"), (over, "over the planned memory"), ([best], "chosen")):
        fig.add_trace(go.Scatter(x=[e.peak_bytes / 2**30 for e in evs], y=[e.tokens_s for e in evs], mode="markers",
                                 name=name, text=[e.cand.describe() for e in evs], hovertemplate="%{text}<br>%{x:.1f} GiB, %{y:.0f} tokens/s",
                                 marker={"size": 14 if name == "chosen" else 7, "symbol": "star" if name == "chosen" else "circle"}))
    fig.add_vline(x=prob.memory_bytes / 2**30, line_dash="dash", annotation_text="planned memory (cap less the margin)")
    fig.update_layout(title=f"{prob.model.name} on {prob.gpus} GPUs: throughput vs peak memory per GPU",
                      xaxis_title="peak memory per GPU (GiB)", yaxis_title="tokens/s")
    timeline = Path(path).with_suffix(".timeline.html")
    cand = best.cand
    trace = simulate(compiled(cand.schedule, cand.par.pp, cand.m, cand.options), costs_of(prob, cand), name=cand.schedule).trace
    viz.render_html(trace, timeline, title=f"best: {cand.describe()}")
    body = fig.to_html(full_html=False, include_plotlyjs="inline")
    atomic_write_text(path, f"<!doctype html><html><head><meta charset='utf-8'><title>braid plan</title></head><body>{body}"
                            f"<p>Timeline of the chosen configuration: <a href='{timeline.name}'>{timeline.name}</a></p></body></html>")


def _budget(res: SearchResult) -> str:
    """The option whose budget stopped the search."""
    return "--time-budget" if res.stopped.endswith(" s") else "--max-simulations"


def main(argv: Sequence[str] | None = None) -> int:
    from braid.io.files import atomic_write_text

    ap = _parser()
    args = ap.parse_args(argv)
    try:
        resolve_model(args.model)
    except ValueError as err:
        ap.error(str(err))
    if args.hardware not in HARDWARE:
        ap.error(f"unknown hardware {args.hardware!r}; valid names: {', '.join(HARDWARE)}")
    for flag, val in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node), ("--global-batch", args.global_batch),
                      ("--seq", args.seq), ("--top", args.top), ("--max-simulations", args.max_simulations)):
        if val is not None and val < 1:
            ap.error(f"{flag} must be a positive integer, got {val}")
    if args.ep != "auto":
        if not args.ep.isdigit() or int(args.ep) < 1:
            ap.error(f"--ep must be a positive integer or auto, got {args.ep!r}")
        args.ep = int(args.ep)
    if not (math.isfinite(args.moe_imbalance) and args.moe_imbalance >= 1):
        ap.error(f"--moe-imbalance must be a number >= 1 (the busiest rank's routed tokens over the mean), got {args.moe_imbalance}")
    if (args.ep not in ("auto", 1) or args.moe_imbalance != 1) and not resolve_model(args.model).experts:
        ap.error(f"--ep and --moe-imbalance weigh a mixture-of-experts model; {args.model!r} is dense")
    if args.gpus > MAX_GPUS:
        ap.error(f"--gpus {args.gpus:,}: at most {MAX_GPUS:,} GPUs")
    if args.memory is not None and not args.memory > 0:
        ap.error(f"--memory must be a positive number of GiB, got {args.memory}")
    if not (math.isfinite(args.memory_margin) and 0 <= args.memory_margin < 1):
        ap.error(f"--memory-margin must be a share of the cap in [0, 1), got {args.memory_margin}")
    if args.time_budget is not None and not args.time_budget > 0:
        ap.error(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        fits = [g for g in range(args.gpus_per_node - 1, 0, -1) if args.gpus % g == 0][0]
        ap.error(f"--gpus {args.gpus} is not a whole number of nodes of --gpus-per-node {args.gpus_per_node} (torchrun "
                 f"starts as many processes on every node): use --gpus {args.gpus - args.gpus % args.gpus_per_node} or "
                 f"{args.gpus + args.gpus_per_node - args.gpus % args.gpus_per_node}, or --gpus-per-node {fits} "
                 f"({args.gpus // fits} nodes)")
    gb = args.global_batch or 2 * args.gpus
    fewest = -(-gb // (args.gpus * MICRO_BATCH_SIZES[-1]))  # micro-batches per replica with dp = every GPU
    if fewest > MAX_MBS:
        ap.error(f"--global-batch {gb} on {args.gpus} GPUs is at least {fewest:,} micro-batches per pipeline: at most "
                 f"{MAX_MBS} (the programs grow with them); lower --global-batch or use more GPUs")
    timeline = str(Path(args.html).with_suffix(".timeline.html")) if args.html else None
    check_outputs(ap, [("--json", args.json), ("--html", args.html), ("--html's timeline page", timeline)],
                  inputs=[args.model] if Path(args.model).exists() else [])
    if args.html:
        try:
            import plotly  # noqa: F401
        except ImportError:
            ap.error("--html needs plotly (pip install plotly)")
    hw = get_hardware(args.hardware)
    model = resolve_model(args.model)
    model = model.with_(seq=args.seq) if args.seq else model
    cap = args.memory * 2**30 if args.memory else hw.memory_bytes
    usable = cap * (1 - args.memory_margin)  # what a pick's predicted device memory in use may reach
    prob = Problem(model, args.gpus, Cluster(hw, args.gpus_per_node), gb, usable, args.optimizer, args.sequence_parallel,
                   None if args.ep == "auto" else args.ep, args.moe_imbalance)
    if args.ep != "auto" and args.ep > 1 and next(layouts(prob), None) is None:
        ap.error(f"--ep {args.ep} fits no layout of {args.gpus} GPUs and --global-batch {gb}: it must divide the data-parallel "
                 f"ranks (dp = GPUs / (tp x pp), dividing the batch) and, times tp, the {model.experts} experts")
    from braid.io.progress import Progress

    bar = Progress(args.max_simulations, "plan: simulated", enabled=sys.stderr.isatty(), every_s=0.5)
    res = search(prob, top=args.top, max_simulations=args.max_simulations, time_budget_s=args.time_budget,
                 progress=lambda r: bar.step(f"in {r.elapsed_s:.0f} s"))
    bar.close()
    print(f"# {model.name} on {args.gpus} x {hw.name} ({args.gpus_per_node} per node), global batch {gb} x {model.seq} tokens, "
          f"cap {cap / 2**30:.1f} GiB per GPU ({usable / 2**30:.1f} planned: {args.memory_margin:.1%} kept back), "
          f"optimizer {args.optimizer}")
    print(f"# {res.enumerated} candidates, {res.memory_pruned} pruned by memory, {len(res.evaluated)} simulated, "
          f"{res.bound_pruned} left by the bound, in {res.elapsed_s:.1f} s"
          + ("; no unsimulated candidate can beat #1" if res.complete else
             f" -- stopped {res.stopped} ({_budget(res)}): the ranking covers what was simulated"))
    if not res.best and not res.complete:
        print(f"{ap.prog}: error: the search stopped {res.stopped}, before a configuration that fits was simulated; "
              f"raise {_budget(res)}", file=sys.stderr)
        return 2
    if not res.best:
        print(f"{ap.prog}: error: no configuration fits {usable / 2**30:.1f} GiB per GPU ({cap / 2**30:.1f} less "
              f"--memory-margin {args.memory_margin:g}); use more GPUs or a shorter --seq", file=sys.stderr)
        return 2
    print(format_ranking(res))
    from braid import schedules
    from braid.core.compiler import compile_plan

    best = res.best[0]
    compile_plan(schedules.build(best.cand.schedule, best.cand.par.pp, best.cand.m, **dict(best.cand.options)))  # validates
    proof = "" if res.complete else f"; not proven best: the search stopped {res.stopped}, raise {_budget(res)}"
    print(f"\nbest (compiled and validated{proof}):\n  " + torchrun_command(prob, best))
    for n in _notes(prob, best):
        print(f"note: {n}")
    faster = over_cap(prob, res)
    if faster:
        ev = faster[0]
        print(f"\nfaster, over the planned memory ({len(faster)} simulated): {ev.cand.describe()}: step {ev.step_s:.3f} s, "
              f"{ev.peak_bytes / 2**30:.1f} GiB > {usable / 2**30:.1f}\n  " + torchrun_command(prob, ev))
    if args.json:
        atomic_write_text(args.json, json.dumps(document(prob, res, hw.name, cap, args.memory_margin), indent=1))
        print(f"wrote {args.json}")
    if args.html:
        _write_html(prob, res, args.html)
        print(f"wrote {args.html}\nwrote {timeline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
