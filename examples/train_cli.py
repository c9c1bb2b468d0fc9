"""Command line of the example training scripts: the flags, and every check made before any process group exists.

:func:`prepare` parses and validates (every rank reaches the same verdict, so a bad flag
stops all ranks before any communication) and builds the single-device model and the
schedules; :class:`Task` is what a script (``qwen2.py``, ``qwen2_vl.py``) plugs in.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from braid.core.partition import whole_layers
from braid.cost.optimizer_modes import DEFAULT_OPTIMIZER, OPTIMIZERS, describe
from braid.io.cli import layer_count
from train_fit import add_fit_args
from train_moe import add_moe_args, check_expert_parallel


class UsageError(ValueError):
    """A flag or a layout that cannot work: exit code 2 with one line."""


class RunError(RuntimeError):
    """A run stopped on purpose (every rank reaches the same verdict): one line, ``exit_code``."""

    exit_code = 1


class NonFiniteError(RunError):
    """The loss or a gradient became NaN or infinite: the run stops before the update (and any save)."""


@dataclass(frozen=True)
class Task:
    """What a training script plugs into the loop.

    ``build_model(args) -> nn.Module`` (single-device, under the caller's seed);
    ``stage_layers(model, num_stages, args) -> tuple``; ``check(model, topo, num_stages, args)``
    raises ``ValueError`` for layouts the model cannot take; ``build_chunks(model, plan,
    pp_rank, stage_layers, tp_rank, tp_size, tp_group)``; ``source(model, args)`` the data;
    ``inputs(model, batch, args) -> (tokens_item, labels)`` per micro-batch; ``seq_len(model, args)``
    the LM sequence; ``flops_per_sample(model, args)`` for MFU; ``models``: the ``--model`` presets;
    ``add_args(group)`` adds the script's own flags to the "batch and model" group.
    """

    prog: str
    description: str
    build_model: Callable[[argparse.Namespace], torch.nn.Module]
    stage_layers: Callable[..., tuple[int, ...]]
    check: Callable[..., None]
    build_chunks: Callable[..., dict]
    source: Callable[..., Any]
    inputs: Callable[..., tuple[Any, torch.Tensor]]
    seq_len: Callable[..., int]
    flops_per_sample: Callable[..., float]
    default_seq: int
    vision: bool = False
    models: tuple[str, ...] = ("tiny", "small", "7b", "15b")
    add_args: Callable[[Any], None] | None = None


# -- command line ----------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2 (argparse's default prints usage too)
        raise UsageError(message)

    def print_help(self, file: Any = None) -> None:  # under torchrun, once (rank 0) rather than once per rank
        if int(os.environ.get("RANK", "0")) == 0:
            super().print_help(file)


def build_parser(task: Task) -> argparse.ArgumentParser:
    from braid import schedules
    from braid.baselines.torch_pp import BASELINES
    from braid.io.cli import add_seq_shard_arg

    p = _Parser(prog=task.prog, description=task.description, formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=_EPILOG.format(prog=task.prog))
    lay = p.add_argument_group("layout (world size = dp * pp * tp)")
    lay.add_argument("--schedule", nargs="+", default=["braided_v"], metavar="NAME",
                     help="pipeline schedule: " + ", ".join(schedules.names()) + "; or a baseline (torch.distributed.pipelining's, "
                          "megatron-core's): " + ", ".join(BASELINES) + ". Several: each trains --steps steps from the same "
                          "weights and data, then one table compares them (default: braided_v)")
    lay.add_argument("--offload-alpha", type=float, default=None, metavar="A",
                     help="braided_v_offload: fraction of chunk-0 activations moved to host memory, 0..1 (default: "
                          "0.5 steady, half in warm-up; python -m braid.simulate --offload-alpha auto picks one)")
    lay.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: %(default)s)")
    lay.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default: %(default)s)")
    lay.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world size / (tp*pp))")
    lay.add_argument("--ep", type=int, default=1,
                     help="expert-parallel size: each mixture-of-experts layer's experts sharded over E of the data-parallel "
                          "ranks, tokens exchanged by all-to-all (default: %(default)s)")
    add_moe_args(lay)
    lay.add_argument("--cp", type=int, default=1,
                     help="sequence-parallel degree d_sp = d_hp x d_cp (LoongTrain 2D-Attention; default: %(default)s)")
    lay.add_argument("--hp", type=int, default=1, help="head-parallel part d_hp of --cp (default: %(default)s)")
    lay.add_argument("--ring-size", type=int, default=None,
                     help="inner ring size w of Double-Ring-Attention, dividing d_cp = cp/hp (default: one ring of d_cp)")
    add_seq_shard_arg(lay)
    lay.add_argument("--placement", default="head_first", choices=["head_first", "context_first"],
                     help="put the head-parallel (head_first) or the context-parallel group on adjacent ranks")
    lay.add_argument("--last-stage-lighter", type=layer_count, default=None,
                     help="layers fewer on the last virtual stage (heavy LM head; default: 2, 0 for --model tiny); "
                          "a half (0.5, 2.5) cuts a layer between attention and MLP, the stage before taking the attention half")
    run = p.add_argument_group("batch and model")
    run.add_argument("--model", default="tiny", choices=list(task.models), help="size preset (default: %(default)s)")
    run.add_argument("--hf", metavar="DIR", help="start from a local Hugging Face checkpoint (config.json + safetensors) "
                                                 "instead of --model; each rank reads only its chunks' tensors")
    run.add_argument("--global-batch-size", type=int, default=None, metavar="B",
                     help="samples per step over all data-parallel replicas (Megatron's name): the step runs "
                          "B / (--micro-batch-size x dp) micro-batches")
    run.add_argument("--micro-batch-size", type=int, default=2, help="samples per micro-batch (default: %(default)s)")
    run.add_argument("--mbs", type=int, default=None,
                     help="the NUMBER of micro-batches per step, not their size (that is --micro-batch-size); "
                          "instead of --global-batch-size (default: 2*pp)")
    run.add_argument("--seq", type=int, default=task.default_seq,
                     help=("caption tokens per sample; the LM sees visual tokens + these" if task.vision else "tokens per sample")
                     + " (default: %(default)s)")
    if task.add_args is not None:
        task.add_args(run)
    run.add_argument("--steps", type=int, default=40, help="training steps in total, counting resumed ones (default: %(default)s)")
    run.add_argument("--lr", type=float, default=None,
                     help="AdamW peak learning rate (default: by model size, as published recipes scale it: 1e-3 below "
                          "125M parameters, GPT-3's table above -- 6e-4 at 125M, 1.2e-4 at 7B; braid.training.lr.recipe_lr)")
    run.add_argument("--init-std", type=float, default=0.02, help="std of the random initialisation (default: %(default)s)")
    run.add_argument("--seed", type=int, default=0, help="model and data seed (default: %(default)s)")
    run.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="auto: cuda if available (bf16), else cpu (fp32) (default: %(default)s)")
    run.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                     help="torch.compile the units' element-wise functions (default: on with CUDA, off on CPU)")
    run.add_argument("--cuda-graph", choices=["none", "step"], default=None,
                     help="braid's steps as whole-step CUDA graphs: 'step' captures each rank's step after "
                          "2 eager warm-up steps and replays it, 'none' runs eager (default: step on CUDA where the "
                          "program is capturable; the reason is logged where not)")
    add_fit_args(run)
    opt = p.add_argument_group("optimizer (AdamW; braid's schedules)")
    opt.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine", "linear"],
                     help="decay after the warm-up, to --min-lr at the last step (default: %(default)s)")
    opt.add_argument("--warmup", type=int, default=None, metavar="N",
                     help="linear warm-up steps (default: none below 125M parameters, 10 above -- at most --steps; "
                          "the torch baselines: none)")
    opt.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay (default: %(default)s)")
    opt.add_argument("--clip-grad", type=float, default=None, metavar="NORM",
                     help="clip the gradients to this global norm over all ranks (default: no clipping)")
    opt.add_argument("--weight-decay", type=float, default=0.01,
                     help="decoupled weight decay of matrices; norms and biases take none (default: %(default)s, "
                          "torch's AdamW default)")
    opt.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                     help="; ".join(f"{m}: {describe(m)}" for m in OPTIMIZERS) + f". Default {DEFAULT_OPTIMIZER} "
                          "(plain where a torch_* baseline is among --schedule: the baselines' only mode). fp32 "
                          "gradient accumulation with zero1/master; the model computes in its dtype (bf16 on GPU)")
    opt.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                     help="activation recomputation: 'selective' re-runs the attention core in "
                          "the backward instead of keeping its activations; 'full' keeps only each layer's input and "
                          "re-runs the whole layer (its TP all-reduces included) before its backward (default: %(default)s)")
    dat = p.add_argument_group("data (default: synthetic)")
    dat.add_argument("--data", metavar="FILE_OR_DIR", help="local .jsonl/.parquet text files, packed to --seq tokens "
                                                         "(needs --tokenizer and the data extra: datasets, tokenizers)")
    dat.add_argument("--tokenizer", metavar="DIR", help="directory with tokenizer.json (e.g. next to an HF checkpoint)")
    dat.add_argument("--text-field", default="text", help="field of --data that holds the text (default: %(default)s)")
    p.add_argument("--config", metavar="RUN.toml",
                   help="read flags from a TOML run file (long flag names as keys: tp = 2, schedule = [\"zb_v\"]); "
                        "flags on the command line override it. Each run writes its effective configuration beside "
                        "its checkpoints (DIR/config.toml) and metrics (FILE.toml)")
    out = p.add_argument_group("outputs")
    out.add_argument("--metrics", metavar="FILE.jsonl", help="append one JSON object per step (rank 0 writes)")
    out.add_argument("--trace", metavar="FILE.json", help="measured trace of the last step, all ranks (view: python -m braid.viz)")
    out.add_argument("--profile", metavar="DIR", help="profile one step under torch.profiler: per rank the device's busy, "
                     "waiting and idle time, the host's, the data loader's share, host synchronisations, top operators "
                     "(DIR/profile.txt, DIR/profile.json, DIR/rank{r}.json.gz chrome traces)")
    out.add_argument("--memory-snapshot", metavar="FILE", help="record the step --profile-step names (default: the last) "
                     "under the CUDA allocator's history: torch's "
                     "snapshot pickle per rank (FILE with one process, else FILE.rank<r>.pickle; pytorch.org/memory_viz) and "
                     "the blocks live at its peak by term (model unit, runtime, optimizer), printed by rank 0. A replayed CUDA "
                     "graph allocates nothing (its pool is one term): --cuda-graph none shows the units. CUDA only")
    out.add_argument("--profile-step", type=int, default=None, metavar="N", help="the step --profile profiles and "
                     "--memory-snapshot records (1-based; default: the last, after any CUDA-graph warm-up)")
    out.add_argument("--tensorboard", metavar="DIR", help="also write the per-step metrics as TensorBoard events (needs tensorboard)")
    out.add_argument("--wandb", metavar="PROJECT", help="also log the per-step metrics to Weights & Biases project PROJECT "
                                                        "(needs wandb; WANDB_MODE=offline keeps the run in ./wandb)")
    out.add_argument("--save", metavar="DIR",
                     help="checkpoint at the end (and every --save-every steps) into DIR/step_N/, DIR/latest naming the newest")
    out.add_argument("--save-every", type=int, default=0, metavar="N", help="also checkpoint every N steps (default: only at the end)")
    out.add_argument("--keep-checkpoints", type=int, default=2, metavar="K", help="step folders kept in --save DIR (default: %(default)s)")
    out.add_argument("--resume", metavar="DIR",
                     help="continue from DIR's latest checkpoint (or a step folder): any tp, pp, dp and schedule; the same "
                          "model. With --save DIR too, a DIR without a checkpoint yet starts at step 0 (one command starts "
                          "and restarts a run). Checksums are verified first, but resume only from directories you trust: "
                          "torch's checkpoint reader unpickles DIR's .metadata")
    out.add_argument("--save-hf", metavar="DIR", help="at the end, write the trained model as a Hugging Face checkpoint "
                                                      "(a new directory; each pipeline rank writes its stages)")
    out.add_argument("--peak-tflops", type=float, default=None,
                     help="per-device peak for MFU (default: 989 on H100/H200, 0 = not reported on CPU)")
    out.add_argument("--reference", action="store_true",
                     help="also train the unsplit model on rank 0's device (same weights, data, AdamW) and compare "
                          "every schedule's per-step losses with it; exit code 1 beyond --reference-rtol")
    out.add_argument("--reference-rtol", type=float, default=None, metavar="R",
                     help="relative loss tolerance of --reference (default: 1e-4 in float32, 2e-2 in bfloat16)")
    out.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck communication fails the run")
    return p


_EPILOG = """\
examples:
  python {prog} --steps 40                                   # one process, CPU or one GPU
  torchrun --nproc-per-node 4 {prog} --schedule braided_v --tp 2 --pp 2
  torchrun --nproc-per-node 2 {prog} --pp 2 --metrics m.jsonl --trace t.json
  torchrun --nproc-per-node 4 {prog} --tp 2 --pp 2 --steps 6 --reference \
      --schedule braided_v braided_v_offload 1f1b_i zb_v torch_1f1b_i torch_zb_v torch_dualpipe_v
  python {prog} --steps 2 --save ckpt && python {prog} --steps 4 --resume ckpt

Bad flags, or a layout the world size or the model cannot take, exit with code 2 and one
line on rank 0 (every rank stops before any communication)."""


@dataclass
class Setup:
    """Everything decided before any process group exists (same on every rank)."""

    args: argparse.Namespace
    world: int
    rank: int
    topo: Any
    runs: list["Run"]
    model: torch.nn.Module
    parser: argparse.ArgumentParser | None = None
    resume_dir: Path | None = None  # the step folder --resume names (checked)
    source: Any = None  # the data (task.source), read before any process group

    @property
    def plan(self) -> Any:
        return self.runs[0].plan

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return self.runs[0].stage_layers


@dataclass(frozen=True)
class Run:
    """One schedule of the job: braid's (``plan`` set) or a torch.distributed.pipelining baseline (``plan`` None)."""

    name: str
    plan: Any
    stage_layers: tuple[int, ...]


def prepare(task: Task, argv: Sequence[str] | None) -> Setup:
    """Parse and validate; raises :class:`UsageError` (every rank reaches the same verdict)."""
    from braid import schedules
    from braid.baselines.torch_pp import BASELINES
    from braid.io.cli import resolve_seq_shard
    from braid.io.runconfig import ConfigError, config_argv
    from braid.core.topology import Topology

    parser = build_parser(task)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(config_argv(parser, argv))
    except ConfigError as err:
        raise UsageError(str(err)) from None
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    check_values(args)
    if args.dp is None:
        args.dp = max(1, world // (args.tp * args.pp * args.cp))
    if args.global_batch_size is not None:
        args.mbs = micro_batches(args)
    if args.mbs is None:
        args.mbs = 2 * args.pp
    if args.last_stage_lighter is None:
        args.last_stage_lighter = 0 if args.model.endswith("tiny") else 2
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available; use --device cpu")
    if args.cuda_graph == "step":
        from braid.runtime.graphs import config_reason

        dev = "cpu" if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()) else "cuda"
        why = config_reason(dev, cp=args.cp, tp=args.tp)
        if why:
            raise UsageError(f"--cuda-graph step: {why}; use --cuda-graph none")
    if args.memory_snapshot and (args.device == "cpu" or not torch.cuda.is_available()):
        raise UsageError("--memory-snapshot records the CUDA caching allocator's history; it needs --device cuda")
    check_outputs(args)
    names = args.schedule
    valid = list(schedules.names()) + list(BASELINES)
    for n in names:
        if n not in valid:
            raise UsageError(f"--schedule {n}: unknown; valid: {', '.join(valid)}")
        if n.startswith("mcore_"):
            from braid.baselines import megatron_gpt as megatron

            if not megatron.available():
                raise UsageError(f"--schedule {n}: {megatron.INSTALL_HINT}")
            if task.vision:
                raise UsageError(f"--schedule {n}: megatron-core's GPT model is a decoder LM; use a torch_* baseline for a VLM")
    if len(set(names)) != len(names):
        raise UsageError(f"--schedule names a schedule twice: {' '.join(names)}")
    if len(names) > 1 and (args.save or args.resume or args.trace or args.save_hf or args.profile or args.memory_snapshot):
        raise UsageError("--save, --save-hf, --resume, --trace, --profile and --memory-snapshot take one --schedule "
                         "(several schedules compare fresh runs)")
    if args.save_hf:
        check_new_dir("--save-hf", args.save_hf)
    if args.reference and (args.resume or args.cp > 1):
        raise UsageError("--reference compares fresh runs without sequence parallelism: drop --resume / use --cp 1")
    torch_names = [n for n in names if n in BASELINES]
    if torch_names and optimizer_flags_set(args):
        raise UsageError(f"{torch_names[0]} trains with plain AdamW at --lr: drop --lr-schedule/--warmup/--clip-grad/"
                         "--weight-decay/--optimizer/--recompute or use braid's schedules")
    if args.optimizer is None:  # the baselines' AdamW is plain; every schedule of a run and its reference train alike
        args.optimizer = "plain" if torch_names else DEFAULT_OPTIMIZER
    check_training_flags(task, args, model_vocab=None)
    if torch_names and (args.save or args.resume or args.save_hf):
        raise UsageError(f"--save/--save-hf/--resume checkpoint braid's schedules, not {torch_names[0]}")
    if torch_names and (args.dp != 1 or args.cp != 1):
        raise UsageError(f"{torch_names[0]} runs tp x pp layouts only: use --dp 1 --cp 1 (world size = tp * pp)")
    try:
        sp = sp_config(task, args)
        topo = Topology(world, pp=args.pp, dp=args.dp, tp=args.tp, cp=args.cp)
        opts = {}
        if args.offload_alpha is not None:
            takes = [n for n in names if n not in BASELINES and schedules.get_schedule(n).knob("offload_alpha")]
            if not takes or not 0.0 <= args.offload_alpha <= 1.0:
                raise ValueError(f"--offload-alpha {args.offload_alpha}: needs a schedule with that knob "
                                 f"(--schedule braided_v_offload) and a value in [0, 1]")
            opts = {"offload_alpha": args.offload_alpha, "offload_alpha_warmup": args.offload_alpha}
        torch.manual_seed(args.seed)
        if args.hf:
            import braid.hf
            from train_step import pick_device

            model = braid.hf.load_meta(args.hf, device=pick_device(args))  # materialised chunk by chunk
            braid.hf.check_tensors(model)  # every tensor there, of the right shape: checked before any process group
            if task.vision != hasattr(model.cfg, "lm"):
                from braid.models.registry import family_of

                kind, script = ("a vision-language", "qwen2_vl.py") if hasattr(model.cfg, "lm") else ("a language", "lm.py")
                raise ValueError(f"--hf {args.hf}: config.json describes {kind} model ({family_of(model).name}); "
                                 f"train it with examples/{script}")
        else:
            model = task.build_model(args)
        if args.save_hf:
            from braid.models.registry import family_of

            family_of(model)  # a model no registered family can write is refused before training
        recipe_defaults(args, model, torch_names)
        runs = []
        for n in names:
            knobs = {} if n in BASELINES else {k: v for k, v in opts.items() if schedules.get_schedule(n).knob(k)}
            plan = None if n in BASELINES else schedules.build(n, args.pp, args.mbs, **knobs)
            n_stages = 2 * args.pp if plan is None else plan.num_stages
            task.check(model, topo, n_stages, args)
            runs.append(Run(n, plan, tuple(task.stage_layers(model, n_stages, args))))
            if n in BASELINES and not whole_layers(runs[-1].stage_layers):
                raise ValueError(f"{n}: the external baselines split whole layers; --last-stage-lighter "
                                 f"{args.last_stage_lighter} cuts one in half (braid's schedules only)")
            if n.startswith("mcore_") and len(set(runs[-1].stage_layers)) != 1:
                raise ValueError(f"{n}: megatron-core splits layers evenly, got {list(runs[-1].stage_layers)} per stage; "
                                 "use --last-stage-lighter 0 and a layer count divisible by 2 * pp")
        check_training_flags(task, args, model_vocab=model.cfg.lm.vocab_size if task.vision else model.cfg.vocab_size)
        check_expert_parallel(args, model, torch_names)
        # braid's schedules (the baselines run their own TP): on at tp > 1 unless --cp > 1, a VLM or an MoE model's
        # eager step; the layout line says why where it is off (seq_shard_note, train_report.seq_shard_words)
        args.seq_shard_note = None
        args.sequence_parallel = resolve_seq_shard(args.sequence_parallel, args.tp, seq=args.seq, cp=args.cp,
                                                   vision=task.vision, moe=getattr(model.cfg, "experts", None) is not None,
                                                   note=lambda s: setattr(args, "seq_shard_note", s))
        if sp is not None:
            sp.check_model(heads=model.cfg.heads, kv_heads=model.cfg.kv_heads, tp=args.tp, seq_len=task.seq_len(model, args))
        # the data are read (and --data tokenised) here, on every rank before any process group: a bad file is
        # one line and exit code 2, not a traceback per rank
        source = task.source(model, args)
    except ValueError as err:
        raise UsageError(str(err).splitlines()[0]) from None
    from train_fit import check_fits

    refusal = check_fits(args, task.vision, [n for n in names if n not in BASELINES], task.seq_len(model, args), rank)
    if refusal:
        raise UsageError(refusal)
    setup = Setup(args, world, rank, topo, runs, model, parser, source=source)
    if args.resume:
        from train_checkpoint import check_resume

        setup.resume_dir = check_resume(task, setup)
    return setup


def micro_batches(args: argparse.Namespace) -> int:
    """The micro-batches per step that ``--global-batch-size`` means at ``--micro-batch-size`` and dp."""
    from braid.io.cli import MAX_MBS, MAX_PM

    gbs, size, dp = args.global_batch_size, args.micro_batch_size, args.dp
    if gbs < 1:
        raise UsageError(f"--global-batch-size must be >= 1, got {gbs}")
    if gbs % (size * dp):
        raise UsageError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {size} x dp {dp} = {size * dp}; "
                         f"use {max(size * dp, gbs - gbs % (size * dp))} or {gbs - gbs % (size * dp) + size * dp}")
    m = gbs // (size * dp)
    if args.mbs is not None and args.mbs != m:
        raise UsageError(f"--mbs {args.mbs} micro-batches and --global-batch-size {gbs} ({m} micro-batches of "
                         f"{size} on dp {dp}) disagree; give one of them")
    if m > MAX_MBS or args.pp * m > MAX_PM:
        raise UsageError(f"--global-batch-size {gbs} is {m:,} micro-batches per step: at most {MAX_MBS} and "
                         f"{MAX_PM:,} times --pp (the programs grow as pp x micro-batches)")
    return m


def check_values(args: argparse.Namespace) -> None:
    """Ranges of the numeric flags (NaN is refused everywhere: it passes no comparison)."""
    for name in ("tp", "pp", "cp", "hp", "ep", "micro_batch_size", "seq", "steps", "keep_checkpoints"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("dp", "mbs", "image_size"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    from braid.io.cli import MAX_MBS, MAX_PM, MAX_PP

    mbs = args.mbs if args.mbs is not None else 2 * args.pp
    if args.pp > MAX_PP or mbs > MAX_MBS or args.pp * mbs > MAX_PM:
        raise UsageError(f"--pp {args.pp} x --mbs {mbs}: at most --pp {MAX_PP}, --mbs {MAX_MBS} and {MAX_PM:,} in product "
                         "(the programs grow as pp x mbs)")
    if args.save_every < 0:
        raise UsageError(f"--save-every must be >= 0 (0: only at the end), got {args.save_every}")
    from braid.io.limits import COUNT_LIMITS, MAX_TIMEOUT_S, count_error

    for name in COUNT_LIMITS:  # the upper bounds (the lower ones are above)
        if why := count_error(name, getattr(args, name, None), low=0):
            raise UsageError(why)
    positive = {"init_std": args.init_std, "timeout": args.timeout, **({} if args.lr is None else {"lr": args.lr})}
    at_least_zero = {"reference_rtol": args.reference_rtol, "peak_tflops": args.peak_tflops}
    for name, value in positive.items():
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
    for name, value in at_least_zero.items():
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if args.timeout > MAX_TIMEOUT_S:  # (a larger one overflows the process group's timedelta)
        raise UsageError(f"--timeout {args.timeout:g}: at most {MAX_TIMEOUT_S:,} s (a day)")


def check_outputs(args: argparse.Namespace) -> None:
    """Every output path can be written, checked before any work (files and the directories made later)."""
    from braid.io.files import OutputPathError, check_output_path

    files = {"--metrics": args.metrics, "--trace": args.trace, "--memory-snapshot": args.memory_snapshot}
    if args.metrics:
        files["the metrics' run file"] = str(Path(args.metrics).with_suffix(".toml"))
    try:
        for what, path in files.items():
            if path:
                check_output_path(path, what=what, inputs=tuple(p for w, p in files.items() if p and w != what))
    except OutputPathError as err:
        raise UsageError(str(err)) from None
    if args.profile_step is not None and not ((args.profile or args.memory_snapshot) and 1 <= args.profile_step <= args.steps):
        raise UsageError(f"--profile-step must be a step of the run (1..--steps={args.steps}) and needs --profile DIR or "
                         f"--memory-snapshot FILE, got {args.profile_step}")
    for what, path in (("--save", args.save), ("--tensorboard", args.tensorboard), ("--profile", args.profile)):
        if path:
            check_output_dir(what, path)
    if args.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    if args.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UsageError("--wandb needs the wandb package: pip install wandb") from None


def check_output_dir(what: str, path: str) -> None:
    """A directory that exists and is writable, or whose nearest existing parent is."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{what} {path!r} is a file; give a directory")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {path!r}: directory {str(probe)!r} is not writable")


def check_new_dir(what: str, path: str) -> None:
    """A directory to be made whole at the end (a rename into its parent): absent or empty, its parent writable."""
    p = Path(path)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise UsageError(f"{what} {path}: exists and is not an empty directory; give a new directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{what} {path}: directory {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {path}: directory {str(parent)!r} is not writable")


def sp_config(task: Task, args: argparse.Namespace) -> Any:
    """The sequence-parallel degrees from the flags, or None without sequence parallelism."""
    from braid.models.sequence_parallel import SPConfig

    if args.cp == 1:
        if args.hp != 1 or args.ring_size is not None:
            raise UsageError("--hp and --ring-size need --cp > 1 (the sequence-parallel degree)")
        return None
    if task.vision:
        raise UsageError("--cp > 1 is not supported by the vision-language example (the ViT stage is not "
                         "sequence-parallel); use examples/lm.py for long-sequence runs")
    if args.cp % args.hp:
        raise UsageError(f"--hp {args.hp} must divide --cp {args.cp}")
    return SPConfig(d_sp=args.cp, d_hp=args.hp, w=args.ring_size, placement=args.placement)




def recipe_defaults(args: argparse.Namespace, model: torch.nn.Module, torch_names: Sequence[str]) -> None:
    """``--lr`` and ``--warmup`` where not given, from the model's size (:func:`braid.training.lr.recipe_lr`,
    :func:`~braid.training.lr.recipe_warmup`); the torch baselines train at a constant ``--lr``."""
    from braid.training.lr import recipe_lr, recipe_warmup

    n = sum(p.numel() for p in model.parameters())  # a meta-device model counts as well
    if args.lr is None:
        args.lr = recipe_lr(n)
    if args.warmup is None:
        args.warmup = 0 if torch_names else min(recipe_warmup(n), args.steps)


def optim_config(args: argparse.Namespace) -> Any:
    """The run's :class:`braid.training.step.OptimConfig` from the flags."""
    from braid.training.step import OptimConfig

    return OptimConfig.of_mode(args.optimizer, lr=args.lr, total_steps=args.steps, warmup=args.warmup, decay=args.lr_schedule,
                               min_lr=args.min_lr, weight_decay=args.weight_decay, clip=args.clip_grad)


def optimizer_flags_set(args: argparse.Namespace) -> bool:
    """Whether any optimizer flag differs from plain AdamW at a constant --lr."""
    return (args.lr_schedule != "constant" or args.warmup or args.clip_grad is not None or args.weight_decay != 0.01
            or args.optimizer not in (None, "plain") or args.recompute != "none")


def check_training_flags(task: Task, args: argparse.Namespace, model_vocab: int | None) -> None:
    """Optimizer and data flags; with ``model_vocab`` also the tokenizer against the model (raises :class:`UsageError`)."""
    try:
        # --lr and --warmup left to the model's size are set once it is built (recipe_defaults), valid by construction
        given = vars(args) | {"lr": args.lr if args.lr is not None else 1.0, "warmup": args.warmup or 0}
        optim_config(argparse.Namespace(**given)).check()
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.recompute != "none" and args.cp > 1:
        raise UsageError(f"--recompute {args.recompute} does not cover 2D-Attention's sequence-parallel core: use --cp 1")
    if args.recompute == "full" and args.last_stage_lighter != int(args.last_stage_lighter):
        raise UsageError(f"--recompute full re-runs whole layers; --last-stage-lighter {args.last_stage_lighter} cuts one "
                         "in half: use a whole number or --recompute selective")
    if args.data is None:
        if args.tokenizer is not None:
            raise UsageError("--tokenizer needs --data")
        return
    if task.vision:
        raise UsageError("--data reads text; the vision-language example trains on its synthetic image-caption pairs")
    if args.tokenizer is None:
        raise UsageError("--data needs --tokenizer DIR (a directory with tokenizer.json)")
    if model_vocab is None:
        return
    from braid.training.data import data_files, load_tokenizer

    try:
        data_files(args.data)
        tok, _ = load_tokenizer(args.tokenizer)
    except ValueError as err:  # braid.training.data.DataError, braid.io.inputs.InputFileError
        raise UsageError(str(err)) from None
    if tok.get_vocab_size() > model_vocab:
        raise UsageError(f"--tokenizer has {tok.get_vocab_size()} tokens but --model {args.model}'s vocabulary is {model_vocab}; "
                         "pick a larger model or a smaller tokenizer")
