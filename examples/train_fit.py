"""Whether a run fits its GPUs, asked before any process group starts.

The prediction is ``braid.simulate``'s device memory per GPU (:func:`braid.simulate.device_memory_gib`:
the allocator's reserve at the step's peak, model state and optimizer included, and what CUDA, NCCL and
cuBLAS hold outside it -- the figure the planner checks against the card, ``braid.cost.device_memory``),
for the run's own model preset, layout, schedule, micro-batches, optimizer, recomputation and layer split.

* Predicted above the card's memory: one line and exit code 2, naming the schedules of the same layout
  the same prediction fits, else the optimizer mode or recomputation under which the schedule fits;
  ``--skip-memory-check`` runs it anyway. On every stored GPU row the
  prediction has been low, never high (``tests/test_device_memory.py``), so by that evidence a refused
  run would not have fit. (Qwen2-VL-7B braided_v at tp=1 x pp=2 on 80 GB H100s: predicted 83.7 GiB;
  run, it sat at the card's limit after its first step, ``benchmarks/results/vlm_7b_h100x2_pp2_runs.txt``.)
* Predicted above :data:`WARN_SHARE` of the card: a warning line on rank 0 (a study of 454 training runs
  found runs safe only while the estimate stayed below 80% of the card).

Checked for CUDA runs of braid's schedules on a catalog preset that ``braid.simulate`` models: not for a
``--hf`` checkpoint, ``--cp`` > 1, another ``--image-size`` than the preset's, ``--image-sizes``, or a torch baseline.

``--memory-cap GiB`` makes a smaller card of the one at hand: the cap is device memory in use, the figure
the planner and the check above compare with a card. CUDA, NCCL and cuBLAS hold their part outside the
caching allocator, where no cap reaches; so each process's allocator is held
(``torch.cuda.set_per_process_memory_fraction``, set before anything is allocated) to the cap less what
``braid.cost.device_memory`` predicts outside it for this run (:func:`allocator_share`: its TP backend and its
whole-step graph included), and the check compares with the cap instead of the card -- how a planner's pick is shown to fit, and a faster
layout over the cap shown not to (``benchmarks/plan_fits.py``, which samples what the device holds).
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

WARN_SHARE = 0.9
LIGHTER = ("1f1b_i", "zb_v", "braided_v_lowmem", "braided_v_offload", "1f1b")  # tried, in this order, for the refusal


def catalog_name(args: argparse.Namespace, vision: bool) -> str | None:
    """The catalog preset ``braid.simulate`` models for the example's ``--model`` (None: not one)."""
    from braid.cost.catalog import get_model

    try:
        model = get_model(args.model, prefix="qwen2-vl-" if vision else "qwen2-")
    except ValueError:
        return None
    return model.name if (model.vit is not None) == vision else None


def simulate_argv(args: argparse.Namespace, model_name: str, seq_len: int) -> list[str]:
    """The ``braid.simulate`` command line of this run's layout and settings (schedules added by the caller)."""
    argv = ["--model", model_name, "--tp", str(args.tp), "--pp", str(args.pp), "--dp", str(args.dp), "--ep", str(args.ep),
            "--mbs", str(args.mbs), "--micro-batch-size", str(args.micro_batch_size), "--seq", str(seq_len),
            "--optimizer", args.optimizer, "--recompute", args.recompute,
            "--last-stage-lighter", f"{args.last_stage_lighter:g}"]
    argv.append("--sequence-parallel" if args.sequence_parallel else "--no-sequence-parallel")
    if args.offload_alpha is not None:
        argv += ["--offload-alpha", str(args.offload_alpha)]
    if getattr(args, "moe_dispatch", "splits") != "splits":  # padded: the experts' buffers hold ep blocks of rows
        argv += ["--moe-dispatch", args.moe_dispatch]
    if getattr(args, "cuda_graph", None):  # else as the example runs on CUDA: a whole-step graph where it captures
        argv += ["--cuda-graph", args.cuda_graph]
    return argv


def verdict(argv: Sequence[str], schedules: Sequence[str], card_bytes: float, capped: bool = False) -> tuple[str | None, str | None]:
    """(refusal, warning) for ``schedules`` under ``argv`` on a card of ``card_bytes`` (``capped``: by
    ``--memory-cap``); None where there is none."""
    from braid.simulate import device_memory_gib

    cap_note = " (--memory-cap)" if capped else ""
    got = device_memory_gib([*argv, *(x for s in schedules for x in ("--schedule", s))])
    card = card_bytes / 2**30
    over = [(s, g) for s, g in got.items() if g > card]
    if over:
        name, gib = over[0]
        others = device_memory_gib([*argv, *(x for s in LIGHTER if s not in schedules for x in ("--schedule", s))])
        fits = [f"{s} ({g:.1f} GiB)" for s in LIGHTER for g in [others.get(s)] if g is not None and g <= card]
        hint = f"--schedule {' or '.join(fits)}" if fits else _lighter_settings(argv, name, card)
        return (f"--schedule {name}: predicted {gib:.1f} GiB of device memory per GPU (braid.simulate, model state and "
                f"optimizer included) exceeds this GPU's {card:.1f} GiB{cap_note}; try {hint}, or --skip-memory-check to run it "
                "anyway"), None
    near = [(s, g) for s, g in got.items() if g > WARN_SHARE * card]
    if near:
        name, gib = near[0]
        return None, (f"warning: --schedule {name}: predicted {gib:.1f} GiB of device memory per GPU, "
                      f"{gib / card:.0%} of this GPU's {card:.1f} GiB{cap_note}: it may run out")
    return None, None


def _with(argv: Sequence[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def _lighter_settings(argv: Sequence[str], schedule: str, card: float) -> str:
    """The first of less optimizer state, then recomputation, under which ``schedule`` is predicted to fit."""
    from braid.simulate import device_memory_gib

    for flag, value in (("--optimizer", "plain"), ("--recompute", "selective"), ("--recompute", "full")):
        if argv[list(argv).index(flag) + 1] == value:
            continue
        got = device_memory_gib([*_with(argv, flag, value), "--schedule", schedule]).get(schedule)
        if got is not None and got <= card:
            return f"{flag} {value} ({got:.1f} GiB)"
    return "more --pp or --tp"


def add_fit_args(group: argparse._ArgumentGroup) -> None:
    """The memory check's flags (module doc)."""
    group.add_argument("--skip-memory-check", action="store_true",
                       help="run even where braid.simulate predicts more device memory than the GPU has (train_fit.py)")
    group.add_argument("--memory-cap", type=float, default=None, metavar="GiB",
                       help="a smaller card: device memory in use held to GiB (the allocator gets GiB less what CUDA and NCCL hold outside it)")


def allocator_share(cap: float, args: argparse.Namespace, rank: int, argv: Sequence[str] | None = None) -> float:
    """The caching allocator's bytes under a ``cap`` GiB of device memory in use: the cap less what
    :mod:`braid.cost.device_memory` predicts outside it. ``argv``: the run's ``braid.simulate`` command line
    with its schedules (a catalog preset), whose most outside the allocator over ranks and schedules counts the
    run's TP backend (nccl-ce under sequence parallelism) and its instantiated whole-step graph; else (or where
    braid.simulate refuses it) this rank's layout by :func:`braid.cost.device_memory.outside_allocator_bytes`
    (its pipeline rank's peers included). ``ValueError`` where nothing is left."""
    from braid.core.topology import Topology
    from braid.cost.device_memory import DEVICE_TERMS, outside_allocator_bytes
    from braid.simulate import device_memory_gib

    got = device_memory_gib(argv, key="device_outside_gib") if argv else {}
    topo = Topology(args.tp * args.pp * args.dp * args.cp, pp=args.pp, dp=args.dp, tp=args.tp, cp=args.cp)
    outside = max(got.values()) * 2**30 if got else outside_allocator_bytes(
        DEVICE_TERMS, tp=args.tp, pp=args.pp, pp_rank=topo.coords(rank).pp, dp=args.dp, cp=args.cp)
    share = cap * 2**30 - outside
    if share <= 0:
        raise ValueError(f"--memory-cap {cap:g}: CUDA, NCCL and cuBLAS are predicted to hold {outside / 2**30:.2f} GiB "
                         "outside the allocator at this layout; nothing is left for tensors")
    return share


def apply_cap(cap: float, cuda: bool, local: int, allocator_bytes: float | None = None) -> None:
    """Hold this process's CUDA caching allocator on device ``local`` to ``allocator_bytes`` (default: the
    whole ``cap`` GiB) under ``--memory-cap cap``; ``ValueError`` off CUDA, or for a cap not above 0 or
    above the card."""
    import torch

    if not cuda:
        raise ValueError("--memory-cap holds the CUDA caching allocator; it needs --device cuda")
    card = torch.cuda.get_device_properties(local).total_memory
    if not 0 < cap <= card / 2**30:
        raise ValueError(f"--memory-cap {cap:g}: must be above 0 and at most this GPU's {card / 2**30:.1f} GiB")
    held = cap * 2**30 if allocator_bytes is None else min(allocator_bytes, cap * 2**30)
    torch.cuda.set_per_process_memory_fraction(held / card, local)


def check_fits(args: argparse.Namespace, vision: bool, schedules: Sequence[str], seq_len: int, rank: int) -> str | None:
    """The refusal line for this run (None: it fits, or it is not checked); prints the warning on rank 0.
    Applies ``--memory-cap`` (:func:`apply_cap`; a bad one is the refusal)."""
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()) if cuda else 0
    cap = getattr(args, "memory_cap", None)
    name = catalog_name(args, vision)
    modelled = not (args.hf or args.cp > 1 or name is None or not schedules or getattr(args, "image_size", None) is not None
                    or getattr(args, "image_sizes", None) is not None)
    argv = simulate_argv(args, name, seq_len) if modelled else None
    if cap is not None:
        try:
            runs = argv and [*argv, *(x for s in schedules for x in ("--schedule", s))]
            apply_cap(cap, cuda, local, allocator_share(cap, args, rank, runs) if cuda else None)
        except ValueError as err:
            return str(err)
    if not cuda or args.skip_memory_check or argv is None:
        return None
    card = cap * 2**30 if cap is not None else torch.cuda.get_device_properties(local).total_memory
    refusal, warning = verdict(argv, schedules, card, cap is not None)
    if warning and rank == 0:
        print(warning, flush=True)
    return refusal
