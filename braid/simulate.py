"""``python -m braid.simulate``: predict which pipeline schedule wins, before launch.

Compiles every registered schedule (or the ones named with ``--schedule``) for ``--pp``
pipeline ranks and ``--mbs`` micro-batches, simulates one training step of each on the
cost model, and prints a table sorted by step time: speed-up over interleaved 1F1B
(``1f1b_i``), PP bubble and exposed TP communication as a share of the step (worst rank),
and the worst rank's peak activation memory in GiB and in M_a (one micro-batch's
activations on one chunk). Schedules that reject the configuration (e.g. ``m < 2p`` for
``braided_v``) are skipped with a note.

``--layers``, ``--hidden``, ``--heads``, ``--kv-heads``, ``--ffn`` and ``--vocab`` change the
preset's shape. Without ``--trace``/``--html`` the simulator's fast path runs
(:mod:`braid.simulator.fast`: long runs extrapolated from short ones where that is checked
exact; programs compiled once, not re-validated) and ``--offload-alpha auto`` tunes on the
schedule's shortest steady-state run.

Defaults: the paper's 12.1B Qwen2 LLM on H200, TP=2 (so TP all-reduces matter, which is
what braided schedules hide), sequence 4096, micro-batch size 1. ``--costs FILE`` replaces
the analytic model with measured or hand-written per-chunk costs (``docs/costs.md``).

Examples::

    python -m braid.simulate --pp 4 --mbs 12
    python -m braid.simulate --pp 4 --mbs 16 --tp 8 --model qwen2-vl-15b --hardware a800
    python -m braid.simulate --pp 4 --mbs 12 --schedule braided_v --schedule zb_v --html timeline.html
    python -m braid.simulate --pp 2 --mbs 8 --schedule braided_v --schedule braided_v_offload --offload-alpha 0.5
    python -m braid.simulate --pp 4 --mbs 12 --costs uniform.json --json report.json --trace trace.json
    python -m braid.simulate --pp 4 --mbs 12 --torch-csv dualpipev.csv --schedule dualpipe_v
    python -m braid.simulate --model qwen2-72b --pp 32 --mbs 256
    python -m braid.simulate --pp 4 --mbs 12 --dp 8 --optimizer zero1 --recompute full
    python -m braid.simulate --model qwen3-moe-30b-a3b --tp 1 --pp 4 --mbs 8 --dp 16 --ep 8 --moe-imbalance 1.2
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from typing import Any, Sequence

from braid.io.cli import Parser as _Parser
from braid.io.cli import (add_moe_dispatch_arg, add_seq_shard_arg, check_counts, check_moe_dispatch, check_outputs,
                          check_plan_size, layer_count, resolve_seq_shard, run_main)
from braid.cost.costs import (RECOMPUTE_MODES, CostFileError, CostModel, Layout, analytic_costs, load_cost_json, model_stage_layers,
                         read_costs)
from braid.io.files import atomic_write_text
from braid.cost.hardware import HARDWARE, get_hardware
from braid.core.capture import capture_reason, captured_by_default
from braid.cost.device_memory import planned_device_bytes, planned_outside_bytes, tp_comm_of
from braid.core.ir import Plan, ScheduleConfig
from braid.core.offload import OFFLOAD_OPTIONS
from braid.cost.catalog import MODELS, ModelConfig, get_model
from braid.cost.moe_costs import check_moe
from braid.cost.optimizer_modes import DEFAULT_OPTIMIZER, OPTIMIZERS

log = logging.getLogger(__name__)


# ModelConfig field -> what it is (``--layers 80`` etc. replace the preset's value)
_OVERRIDES = {"layers": "LM layers", "hidden": "hidden size", "heads": "attention heads", "kv_heads": "key/value heads",
              "ffn": "MLP width", "vocab": "vocabulary size"}


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
    ap.add_argument("--model", default="qwen2-12b", metavar="NAME|CONFIG",
                    help=f"model preset (default qwen2-12b): {', '.join(MODELS)}; short names (7b) mean qwen2-*; "
                         "or a Hugging Face config.json (or its checkpoint directory)")
    for flag, what in _OVERRIDES.items():
        ap.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None, metavar="N", help=f"override the preset's {what}")
    ap.add_argument("--hardware", default="h200", help=f"hardware preset (default h200): {', '.join(HARDWARE)}")
    ap.add_argument("--costs", metavar="FILE", help="cost file replacing the analytic timings (schema: docs/costs.md)")
    ap.add_argument("--offload-alpha", default="auto", metavar="A|auto",
                    help="braided_v_offload: fraction of chunk-0 activations offloaded (0..1), or 'auto' (default): "
                         "the lowest predicted peak within --offload-budget of braided_v's step time "
                         "(braid.planner.offload_tune.tune_offload; ~100 simulations of the shortest steady run)")
    ap.add_argument("--offload-budget", type=float, default=0.01, metavar="F",
                    help="--offload-alpha auto: step-time slowdown allowed for a lower peak, as a fraction "
                         "(default 0.01 = 1%%)")
    ap.add_argument("--braid", default="auto", choices=["auto", "all", "none"],
                    help="schedules with braided blocks (braided_v, its variants, dualpipe_v): 'auto' (default) keeps a "
                         "block braided, picks which member leads and whether its trailing all-reduce is carried, only "
                         "where the simulated step gets shorter (braid.planner.braid_tune); 'all': every block; 'none': no blocks")
    ap.add_argument("--torch-csv", action="append", metavar="FILE",
                    help="also simulate a schedule torch.distributed.pipelining dumped as a compute-only CSV "
                         "(repeatable; its ranks and micro-batches must match --pp and --mbs; alone, without "
                         "--schedule, only these run)")
    ap.add_argument("--last-stage-lighter", type=layer_count, default=None, metavar="N",
                    help="layers fewer on the last virtual stage (default: the paper's split, 2 where the layers allow); "
                         "a half (0.5, 2.5) cuts a layer between attention and MLP")
    ap.add_argument("--recompute", default="none", choices=RECOMPUTE_MODES,
                    help="activation recomputation of the LM layers: 'selective' re-runs the attention core in the "
                         "backward, 'full' the whole layer before its backward, keeping only its "
                         "input (more backward time, fewer saved bytes; analytic costs)")
    add_seq_shard_arg(ap)
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel replicas: adds the gradient reduction (its own lane, beside the cool-down), "
                         "the optimizer step and ZeRO-1's all-gather, and the optimizer state per GPU (default 1)")
    ap.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                    help=f"optimizer mode of that tail (default {DEFAULT_OPTIMIZER}; bytes per parameter: docs/training.md); "
                         "with --dp or --optimizer the data-parallel table is printed")
    ap.add_argument("--gpus-per-node", type=int, default=8,
                    help="GPUs per node: a data-parallel group wider than a node reduces at the NIC rate (default 8)")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert-parallel degree of a mixture-of-experts model: ep consecutive data-parallel ranks share "
                         "each layer's experts (must divide --dp and the experts; adds the all-to-alls of the MLP units, "
                         "priced on the NIC once the group spans nodes; default 1)")
    ap.add_argument("--moe-imbalance", type=float, default=None, metavar="F",
                    help="mixture of experts: the busiest rank's routed tokens over the mean (>= 1); scales its expert "
                         "compute and all-to-all bytes (default 1: balanced; with --costs from braid.profile --ep, the "
                         "profile's own, meta.moe.imbalance, which F then replaces)")
    add_moe_dispatch_arg(ap)
    ap.add_argument("--cuda-graph", choices=("none", "step"), default=None,
                    help="how the run executes, for the device memory in use (--json's dp.device_memory_gib): 'step' a "
                         "whole-step CUDA graph (its pool keeps the activations beside the optimizer step's temporaries), "
                         "'none' eager (default: as the training examples run on CUDA, 'step' where they capture)")
    ap.add_argument("--json", metavar="FILE", help="write the reports as JSON: {config, schedules: {name: {...}}}")
    ap.add_argument("--trace", metavar="FILE", help="write the simulated traces (braid trace format, all schedules)")
    ap.add_argument("--html", metavar="FILE", help="write an interactive timeline of all simulated schedules (needs plotly)")
    return ap


def _parallel(args: argparse.Namespace, pp: int | None = None):
    """The job layout of the command line (``ValueError`` for degrees that do not fit together)."""
    from braid.cost.cluster import Parallel

    return Parallel(args.tp, args.pp if pp is None else pp, args.dp, optimizer=args.optimizer or DEFAULT_OPTIMIZER,
                    ep=args.ep, moe_imbalance=args.moe_imbalance, moe_dispatch=args.moe_dispatch)


def _moe(args: argparse.Namespace, hw, pp: int | None = None):
    """The MoE layers' expert parallelism of the command line (:func:`braid.cost.cluster.moe_layout`)."""
    from braid.cost.cluster import Cluster, moe_layout

    return moe_layout(Cluster(hw, args.gpus_per_node), _parallel(args, pp))


def _costs_for(args: argparse.Namespace, model, hw, plan) -> CostModel:
    layout = Layout(args.tp, plan.p, plan.v, plan.placement)
    base = analytic_costs(model, hw, layout, recompute=args.recompute, last_stage_lighter=args.last_stage_lighter,
                          seq_shard=args.sequence_parallel, moe=_moe(args, hw))
    if not args.costs:
        return base
    specs = {k: c.spec for k, c in base.chunks.items()}
    costs = read_costs(args.costs, layout, specs, base=base)
    if model.experts and getattr(args, "moe_imbalance_given", False):  # the profile's experts and all-to-alls at F
        from braid.cost.moe_costs import rescale_imbalance

        costs = rescale_imbalance(costs, args.moe_imbalance)[0]
    return costs


COARSE_PM = 4096  # p*m from which --offload-alpha auto searches the coarse grid (braid.planner.offload_tune)


def _offload_options(args: argparse.Namespace, name: str) -> dict[str, float]:
    from braid import schedules

    if schedules.get_schedule(name).knob("offload_alpha") is None or args.offload_alpha == "auto":
        return {}
    return {"offload_alpha": args.offload_alpha, "offload_alpha_warmup": args.offload_alpha}


def _profiled(doc: dict[str, Any], model: ModelConfig, path: str) -> tuple[str | None, str | None]:
    """What a profiled cost file records of its origin: the device it was measured on
    (``meta.device``, None when absent) and a note when the model shape it was measured for
    (``meta.config``) differs from the one simulated -- the times are the file's, the labels the model's."""
    meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
    device = meta.get("device") if isinstance(meta.get("device"), str) else None
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    shape = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    per_stage = cfg.get("layers_per_stage")
    if isinstance(cfg.get("vision"), dict) and isinstance(per_stage, list):
        per_stage = per_stage[1:]  # a vision-language profile: stage 0 holds the tower's blocks, not LM layers
    recorded = {"hidden": shape.get("hidden"), "heads": shape.get("heads"), "kv_heads": shape.get("kv_heads"),
                "ffn": shape.get("ffn"), "vocab": shape.get("vocab_size"), "seq": cfg.get("seq"),
                "layers": int(sum(per_stage)) if isinstance(per_stage, list) and per_stage
                and all(isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) for n in per_stage)
                and sum(per_stage) == int(sum(per_stage)) else None}
    differ = [f"{k} {v} (simulated: {getattr(model, k)})" for k, v in recorded.items()
              if isinstance(v, int) and not isinstance(v, bool) and v != getattr(model, k)]
    if not differ:
        return device, None
    flags = " ".join(f"--{k.replace('_', '-')} {recorded[k]}" for k in recorded if any(d.startswith(k + " ") for d in differ))
    return device, (f"{path} was profiled for another shape: {', '.join(differ)}; the times are the file's, the labels "
                    f"--model's: add {flags} to simulate the profiled shape")


def resolve_model(name: str) -> ModelConfig:
    """``--model``: a catalog preset, or a Hugging Face ``config.json`` read through the model
    registry (:func:`braid.models.shapes.resolve_model`; imported only then: it loads torch)."""
    try:
        return get_model(name)
    except ValueError:  # not a preset: a config.json path, or an unknown name (reported from there)
        from braid.models.shapes import resolve_model as from_path_or_preset

        return from_path_or_preset(name)


def _with_options(plan: Plan, options: dict[str, Any]) -> Plan:
    """``plan`` (its instructions as they are) with ``options`` set in its config -- the offload
    knobs, which the compiler reads from there."""
    if not options:
        return plan
    opts = dict(plan.config.options) | options
    cfg = ScheduleConfig(plan.p, plan.m, plan.v, tuple(sorted(opts.items())))
    return Plan(plan.name, cfg, plan.placement, plan.ranks)


def model_from_args(args: argparse.Namespace):
    """The preset (or config.json) with ``--seq``, ``--micro-batch-size`` and the size overrides applied."""
    model = args.model if isinstance(args.model, ModelConfig) else resolve_model(args.model)
    changes = {k: getattr(args, k) for k in ("seq", "micro_batch_size", *_OVERRIDES) if getattr(args, k, None) is not None}
    return model.with_(**changes) if changes else model


def run(args: argparse.Namespace, schedule_names: Sequence[str], plans: Sequence[Any] = (),
        progress: Any = None) -> tuple[dict[str, Any], list, list[str]]:
    """Simulate the selected schedules and the given ready-made ``plans`` (e.g. read from torch
    CSVs); returns (json document, traces, notes). ``progress``: a :class:`braid.io.progress.Progress`
    stepped once per schedule."""
    from braid import schedules
    from braid.planner.braid_tune import UNSEARCHED, count_blocks, plain_beats_braided, tune_braiding
    from braid.core.compiler import ScheduleError, compile_plan
    from braid.planner.offload_tune import tune_offload
    from braid.cost.cluster import Cluster, dp_costs
    from braid.cost.moe_costs import a2a_per_rank
    from braid.simulator import simulate
    from braid.simulator.dp import dp_tail, grad_ready_of
    from braid.simulator.fast import simulate_schedule

    model = model_from_args(args)
    record = bool(args.trace or args.html)
    hw = get_hardware(args.hardware)
    doc: dict[str, Any] = {"config": {"pp": args.pp, "mbs": args.mbs, "tp": args.tp, "seq": model.seq,
                                      "micro_batch_size": model.micro_batch_size, "model": model.name,
                                      "hardware": hw.name, "costs": args.costs,
                                      "recompute": args.recompute, "dp": args.dp, "sequence_parallel": args.sequence_parallel,
                                      "last_stage_lighter": getattr(args, "last_stage_lighter", None),
                                      "optimizer": args.optimizer or DEFAULT_OPTIMIZER, "ep": args.ep,
                                      "moe_imbalance": args.moe_imbalance, "moe_dispatch": args.moe_dispatch}, "schedules": {}}
    dp_rows = []
    traces, notes, reports, extrapolated = [], [], [], []
    braid_mode = getattr(args, "braid", "auto")
    cost_of: dict[str, CostModel] = {}
    choices: dict[str, Any] = {}
    unsearched: list[str] = []  # braid=auto kept every block without a search (long runs)
    # name -> (plan's v, why): "layers" (the model cannot fill its stages), "m" (too few micro-batches), "schedule"
    doc["skipped"] = {}
    given = {p.name: p for p in plans}
    for name in list(schedule_names) + list(given):
        if progress is not None:
            progress.step(name)
        try:
            options = {} if name in given else _offload_options(args, name)
            braids = name not in given and schedules.get_schedule(name).knob("braid") is not None
            if braids and braid_mode != "auto":
                options["braid"] = braid_mode
            plan = given[name] if name in given else schedules.build(name, args.pp, args.mbs, **options)
            if _max_pp(model, plan.v, args.pp) < args.pp:
                doc["skipped"][name] = (plan.v, "layers")
            costs = _costs_for(args, model, hw, plan)
            offloads = name not in given and schedules.get_schedule(name).knob("offload_alpha") is not None
            choice = None
            if braids and braid_mode == "auto":
                # blocks first, on the plan without offload; then offload on the chosen plan, so that the
                # offload budget is measured against the same schedule with its blocks chosen
                bare = {k: v for k, v in options.items() if k not in OFFLOAD_OPTIONS}
                if offloads:
                    bare |= {"offload_alpha": 0.0, "offload_alpha_warmup": 0.0}
                choice = choices[name] = tune_braiding(name, args.pp, args.mbs, costs, bare.items(),
                                                       plan=plan if bare == options else None)
                if choice.evaluations:
                    notes.append(f"{name}: auto {choice.describe()}")
                else:
                    unsearched.append(name)
                plan = _with_options(choice.plan, {k: v for k, v in options.items() if k in OFFLOAD_OPTIONS})
            if offloads and args.offload_alpha == "auto":
                # long plans (p*m >= COARSE_PM) get the coarse search: each simulation costs most of a second there
                def proxy(mm: int, name=name, costs=costs, opts=dict(plan.config.options)) -> Plan:
                    """The plan at the offload tuner's proxy m, its blocks chosen the same way (without offload)."""
                    return tune_braiding(name, args.pp, mm, costs, (opts | {"offload_alpha": 0.0,
                                                                           "offload_alpha_warmup": 0.0}).items()).plan

                off = tune_offload(plan, costs, max_slowdown=args.offload_budget, proxy=True,
                                   coarse=args.pp * args.mbs >= COARSE_PM,
                                   build_proxy=proxy if plan.config.option("braid") == "auto" else None)
                plan = _with_options(plan, off.options())
                notes.append(f"{name}: auto offload {off.describe()}"
                             + (f" (tuned at m={off.m})" if off.m != args.mbs else "")
                             + (" (coarse search)" if args.pp * args.mbs >= COARSE_PM else ""))
            if record or name in given or plan.config.option("braid") == "auto":
                # a plan whose blocks were chosen one by one is simulated as it is (no short runs to extrapolate
                # from); the trace gives when each chunk's gradients are ready for the data-parallel tail
                res = simulate(compile_plan(plan), costs, name=name, record=True)
                if record:
                    traces.append(res.trace)
                report, ready = res.report, grad_ready_of(res.trace.events)
            else:
                fast = simulate_schedule(name, args.pp, args.mbs, costs, plan.config.options, plan=plan)
                report, ready = fast.report, fast.grad_ready
                if fast.method != "full":
                    extrapolated.append(name)
        except CostFileError:
            raise
        except (ScheduleError, ValueError) as err:
            notes.append(f"skipped {name}: {err}")
            doc["skipped"].setdefault(name, (0, "m" if "needs m" in str(err) else "schedule"))
            continue
        doc["skipped"].pop(name, None)
        reports.append(report)
        cost_of[name] = costs
        doc["schedules"][name] = report.to_dict()
        doc["schedules"][name]["peak_memory_gib"] = report.worst_peak.peak_activation_bytes / 2**30
        doc["schedules"][name]["braided_blocks"] = count_blocks(plan)
        if name in choices:
            doc["schedules"][name]["braid_auto"] = choices[name].to_dict()
        a2a = a2a_per_rank(costs, args.mbs)
        if any(a2a):  # all the all-to-all time of the worst rank, and what of it the compute stream waits for
            doc["schedules"][name]["a2a_s"] = max(a2a)
            doc["schedules"][name]["a2a_exposed_s"] = report.max_a2a_exposed_s
            doc["schedules"][name]["a2a_share"] = max(r.a2a_exposed_s / r.end_s for r in report.ranks if r.end_s > 0)
        par = _parallel(args)
        dc = dp_costs(model, costs, Cluster(hw, args.gpus_per_node), par)
        graphed = args.cuda_graph == "step" if args.cuda_graph else captured_by_default(
            tp=par.tp, ep=par.ep, moe=bool(model.experts), moe_dispatch=par.moe_dispatch)
        backend, staging = tp_comm_of(tp=par.tp, seq_shard=bool(args.sequence_parallel), tokens=model.seq * model.micro_batch_size,
                                      hidden=model.hidden, itemsize=model.dtype_bytes)
        with_dp = args.dp > 1 or args.optimizer is not None  # asked for: the trace gets the tail's events
        tail = dp_tail([r.end_s for r in report.ranks], ready, dc, chunks=costs.layout.v, record=record and with_dp)
        if record and with_dp:
            traces[-1].events.extend(tail.events)
        dp_rows.append((name, report, tail, dc))
        where = [dict(graphed=graphed, tp=par.tp, pp=par.pp, pp_rank=r.rank, dp=par.dp, cp=par.cp, tp_backend=backend,
                      placement=costs.layout.placement, captured_units=args.mbs * costs.units_on(r.rank))
                 for r in report.ranks]
        doc["schedules"][name]["dp"] = {**tail.to_dict(), "static_bytes": list(dc.static_bytes),
                                        "peak_memory_gib": max(dc.peak_bytes(r.rank, r.peak_activation_bytes)
                                                               for r in report.ranks) / 2**30,
                                        # what the planner checks against the card (braid.cost.device_memory), and its
                                        # part outside the allocator
                                        "device_memory_gib": max(planned_device_bytes(
                                            name, static_bytes=dc.held_bytes(r.rank), activation_bytes=r.peak_activation_bytes,
                                            step_bytes=dc.step_temp_bytes(r.rank), ce_staging=staging, **w)
                                            for r, w in zip(report.ranks, where)) / 2**30,
                                        "device_outside_gib": max(planned_outside_bytes(**w) for w in where) / 2**30}
    if unsearched:
        notes.append(f"{', '.join(unsearched)}: auto {UNSEARCHED}")
    if getattr(args, "last_stage_lighter", None) is not None and cost_of:
        layouts = {cm.layout.num_stages: model_stage_layers(model, cm.layout, args.last_stage_lighter) for cm in cost_of.values()}
        notes.append("layers per virtual stage: " + "; ".join(",".join(map(str, ls)) for _, ls in sorted(layouts.items())))
    note = plain_beats_braided(reports, cost_of, choices)
    if note:
        notes.append(note)
    if extrapolated:
        notes.append(f"{', '.join(extrapolated)}: extrapolated from short runs (braid.simulator.fast; "
                     "a full simulation with --trace or --html)")
    doc["reports"] = reports
    doc["dp_rows"] = dp_rows
    # fastest first, as in the table, so the viewer opens on the winner
    traces.sort(key=lambda t: t.step_time)
    return doc, traces, notes


def _max_pp(model, v: int, upto: int) -> int:
    """The most pipeline ranks (at most ``upto``) whose ``upto * v`` virtual stages the model's layers fill."""
    layers = model.layers + (model.vit.layers if model.vit is not None else 0)
    for p in range(min(upto, layers // v), 0, -1):  # every virtual stage holds a layer at least
        try:
            model_stage_layers(model, Layout(1, p, v))
            return p
        except ValueError:
            continue
    return 0


def _nothing_ran(args: argparse.Namespace, skipped: dict[str, tuple[int, str]]) -> str:
    """Why no selected schedule ran, and what to change."""
    if skipped and all(kind == "layers" for _, kind in skipped.values()):
        model = model_from_args(args)
        layers = model.layers + (model.vit.layers if model.vit is not None else 0)
        vs = sorted({v for v, _ in skipped.values()})
        stages = " or ".join(f"{args.pp * v}" for v in vs)
        fits = ", ".join(f"--pp {_max_pp(model, v, args.pp)} for {v} chunk{'s' if v > 1 else ''} per rank" for v in vs)
        return (f"the model's {layers} layers cannot fill {stages} virtual stages (--pp {args.pp} x chunks per rank); "
                f"use at most {fits}, or a model with more layers")
    hint = "; raise --mbs" if skipped and all(kind == "m" for _, kind in skipped.values()) else ""
    return f"no selected schedule accepts --pp {args.pp} --mbs {args.mbs} (see the notes above{hint})"


def main(argv: Sequence[str] | None = None) -> int:
    from braid import schedules
    from braid.simulator import format_table

    names = schedules.names()
    ap = _parser(names)
    args = ap.parse_args(argv)
    chosen = args.schedule or ([] if args.torch_csv else names)
    unknown = [s for s in chosen if s not in names]
    if unknown:
        ap.error(f"unknown schedule {unknown[0]!r}; valid names: {', '.join(names)}")
    check_counts(ap, args, ("pp", "mbs", "tp", "seq", "dp", "ep", "gpus_per_node", "micro_batch_size", *_OVERRIDES))
    args.moe_imbalance_given = args.moe_imbalance is not None
    if args.moe_imbalance is None:
        args.moe_imbalance = 1.0
    if args.offload_alpha != "auto":
        try:
            args.offload_alpha = float(args.offload_alpha)
        except ValueError:
            args.offload_alpha = -1.0
        if not 0.0 <= args.offload_alpha <= 1.0:
            ap.error("--offload-alpha must be a number in [0, 1] or 'auto'")
    if not 0.0 <= args.offload_budget < 1.0:
        ap.error(f"--offload-budget must be a fraction in [0, 1), e.g. 0.03 for 3%, got {args.offload_budget}")
    try:
        args.model = resolve_model(args.model)
    except ValueError as err:
        ap.error(str(err))
    if args.hardware not in HARDWARE:
        ap.error(f"unknown hardware {args.hardware!r}; valid names: {', '.join(HARDWARE)}")
    notes: list[str] = []  # printed once the input is known good (bad input stays one line)
    try:  # the model, hardware and tp on their own (one stage; an MLLM's ViT has its own), before any schedule
        model = model_from_args(args)
        args.sequence_parallel = resolve_seq_shard(args.sequence_parallel, args.tp, seq=model.seq, vision=model.vit is not None,
                                                   moe=bool(model.experts), note=notes.append)
        if args.moe_imbalance != 1.0 and not model.experts:
            raise ValueError(f"--moe-imbalance {args.moe_imbalance} weighs a mixture of experts; {model.name!r} is dense")
        check_moe(model, args.tp, args.ep)
        check_moe_dispatch(args.moe_dispatch, ep=args.ep, tp=args.tp)
        why = capture_reason("cuda", tp=args.tp, ep=args.ep, moe=bool(model.experts), moe_dispatch=args.moe_dispatch)
        if args.cuda_graph == "step" and why:
            raise ValueError(f"--cuda-graph step: {why}")
        analytic_costs(model, get_hardware(args.hardware), Layout(args.tp, 1, 1 if model.vit is None else 2),
                       seq_shard=args.sequence_parallel, moe=_moe(args, get_hardware(args.hardware), pp=1))
    except ValueError as err:
        ap.error(str(err))
    check_plan_size(ap, args.pp, args.mbs)
    if args.last_stage_lighter is not None:
        half = args.last_stage_lighter != int(args.last_stage_lighter)
        if half and args.recompute == "full":
            ap.error(f"--recompute full re-runs whole layers; --last-stage-lighter {args.last_stage_lighter} cuts one in half")
        if half and model.vit is not None:
            ap.error(f"--last-stage-lighter {args.last_stage_lighter}: the VLM's stages hold whole layers (the example runs no half-layer cut there)")
        if args.costs:
            ap.error("--last-stage-lighter re-splits the analytic model's layers; a --costs file's times are for the split "
                     "it was profiled with (profile that split: braid.profile --layers-per-stage)")
        chunks_per_rank, errors = sorted({schedules.get_schedule(n).v for n in chosen}), []
        for v in chunks_per_rank:  # a schedule the split does not fit is skipped; none fitting is an error
            try:
                model_stage_layers(model, Layout(1, args.pp, v), args.last_stage_lighter)
            except ValueError as err:
                errors.append(f"{args.pp * v} virtual stages: {err}")
        if len(errors) == len(chunks_per_rank):
            ap.error(f"--last-stage-lighter {args.last_stage_lighter} with {errors[0]}")
    if not args.torch_csv:  # layers enough for the stages, before anything is compiled
        need = {n: (schedules.get_schedule(n).v, "layers") for n in chosen}
        if all(_max_pp(model, v, args.pp) < args.pp for v, _ in need.values()):
            ap.error(_nothing_ran(args, need))
    check_outputs(ap, [("--json", args.json), ("--trace", args.trace), ("--html", args.html)],
                  inputs=([args.costs] if args.costs else []) + list(args.torch_csv or []))
    if args.html:
        try:
            import plotly  # noqa: F401
        except ImportError as err:
            ap.error(f"--html needs plotly ({err}); pip install plotly")
    measured_on, shape_note = None, None
    try:
        if args.costs:  # an unreadable file is one line before any simulation
            measured_on, shape_note = _profiled(load_cost_json(args.costs), model, args.costs)
    except CostFileError as err:
        ap.error(str(err))
    plans = []
    for path in args.torch_csv or []:
        from braid.core.torch_format import PlanLimits, TorchFormatError, from_torch_csv
        from braid.core.compiler import ScheduleError, compile_plan
        from braid.io.inputs import InputFileError, read_text
        from braid.io.limits import PLAN_FILE_LIMITS, TORCH_CSV

        try:
            plan = from_torch_csv(read_text(path, "torch schedule CSV", TORCH_CSV), name=path.rsplit("/", 1)[-1].removesuffix(".csv"),
                                  limits=PlanLimits(**PLAN_FILE_LIMITS))
            compile_plan(plan)  # a plan torch wrote that cannot run (deadlock, a missing op) is bad input too
        except InputFileError as err:
            ap.error(f"--torch-csv {err}")
        except (TorchFormatError, ScheduleError, ValueError) as err:
            ap.error(f"--torch-csv {path}: {str(err).splitlines()[0]}")
        if (plan.p, plan.m) != (args.pp, args.mbs):
            ap.error(f"--torch-csv {path} has {plan.p} ranks and {plan.m} micro-batches: pass --pp {plan.p} --mbs {plan.m}")
        plans.append(plan)
    try:
        model_from_args(args)
    except ValueError as err:
        ap.error(str(err))
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    from braid.io.progress import Progress

    bar = Progress(len(chosen) + len(plans), "simulate", enabled=sys.stderr.isatty())  # a terminal only: a log keeps bad input one line
    try:
        doc, traces, notes = run(args, chosen, plans, progress=bar)
    except CostFileError as err:
        ap.error(str(err))
    bar.close()
    reports = doc.pop("reports")
    dp_rows = doc.pop("dp_rows")
    skipped = doc.pop("skipped")
    cfg = doc["config"]
    if shape_note:
        notes.insert(0, shape_note)
    changed = "".join(f" --{k.replace('_', '-')} {getattr(args, k)}" for k in _OVERRIDES if getattr(args, k, None) is not None)
    where = f"{measured_on} (measured)" if measured_on else cfg["hardware"]
    print(f"# {cfg['model']}{changed} on {where}: tp={cfg['tp']}{' (sequence-parallel)' if cfg['sequence_parallel'] else ''} "
          f"pp={cfg['pp']}{f' ep={args.ep}' if args.ep > 1 else ''} m={cfg['mbs']} "
          f"seq={cfg['seq']} micro-batch={cfg['micro_batch_size']}" + (f" costs={cfg['costs']}" if cfg["costs"] else ""))
    with_dp = bool(dp_rows) and (args.dp > 1 or args.optimizer is not None)
    # one ranking: the step with the data-parallel tail where there is one (both tables in its order)
    order = [row[0] for row in sorted(dp_rows, key=lambda row: row[2].step_s)] if with_dp else None
    if reports:
        if with_dp:
            print("# the pipeline alone, ranked by the step with the data-parallel tail (the table below)")
        print(format_table(reports, order=order))
    if with_dp:
        from braid.simulator.dp import format_dp_table

        print(f"\n# data-parallel tail: dp={args.dp} x {args.gpus_per_node} GPUs per node, optimizer "
              f"{args.optimizer or DEFAULT_OPTIMIZER} (gradient reduction on its own lane; memory per GPU)")
        print(format_dp_table(dp_rows))
    shares = {n: s for n, s in doc["schedules"].items() if "a2a_share" in s}
    if shares:
        profiled = (((load_cost_json(args.costs).get("meta") or {}).get("moe") or {}).get("imbalance")
                    if args.costs and not args.moe_imbalance_given else None)
        weight = f"{profiled:.3f} as profiled" if isinstance(profiled, (int, float)) else f"{args.moe_imbalance:g}"
        notes.append(f"expert-parallel all-to-alls (ep={args.ep}, moe imbalance {weight}; each ends an MoE "
                     "unit, on its own lane), exposed of all (worst rank): " + ", ".join(
                         f"{n} {s['a2a_exposed_s'] * 1e3:.2f} of {s['a2a_s'] * 1e3:.2f} ms ({s['a2a_share']:.1%} of the step)"
                         for n, s in shares.items()))
    for n in notes:
        print(f"note: {n}")
    if not reports:
        print(f"{ap.prog}: error: {_nothing_ran(args, skipped)}", file=sys.stderr)
        return 2
    if args.json:
        atomic_write_text(args.json, json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    if args.trace:
        from braid.io.trace import dump_traces

        dump_traces(traces, args.trace)
        print(f"wrote {args.trace}")
    if args.html:
        from braid import viz

        print(f"wrote {viz.render_html(traces, args.html)}")
    return 0


def device_memory_gib(argv: Sequence[str], key: str = "device_memory_gib") -> dict[str, float]:
    """Per schedule of ``argv`` (a ``python -m braid.simulate`` command line), the most device memory one GPU
    is predicted to use, GiB: ``--json``'s ``schedules[name].dp.device_memory_gib``, what the planner checks
    against the card (``key="device_outside_gib"``: the most of it outside the caching allocator). Empty where
    braid.simulate refuses the command line or runs no schedule; prints nothing."""
    import contextlib
    import io
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "simulate.json")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                code = main([*argv, "--json", out])
            except SystemExit as stop:  # argparse's one-line refusal
                code = stop.code
        if code != 0 or not Path(out).exists():
            return {}
        doc = json.loads(Path(out).read_text())
    return {n: float(s["dp"][key]) for n, s in doc["schedules"].items()}


if __name__ == "__main__":
    sys.exit(run_main(main))
