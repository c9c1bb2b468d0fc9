"""The training loop shared by ``examples/qwen2.py`` (LLM) and ``examples/qwen2_vl.py`` (VLM).

One process per rank (torchrun) or a single process (world size 1). Every rank builds the
same single-device model from ``--seed``, keeps only its pipeline/TP shards, compiles the
schedule, and runs ``--steps`` steps of: executor program (forward + backward of all
micro-batches in the schedule's order), gradient all-reduce over data-parallel replicas,
AdamW. A :class:`Task` says what differs between the two scripts (model, data, chunks).

Outputs: one log line per step on rank 0 (and a progress bar on a terminal),
``--metrics`` (JSON lines), ``--trace`` (the last step's measured trace, all ranks merged),
``--save``/``--resume`` (``torch.distributed.checkpoint``: model shards, AdamW state,
step and data position; resuming reproduces the uninterrupted run's losses exactly).

Real data: give :func:`main` a ``source`` -- any :class:`data.SampleSource` returning
``tokens``/``labels`` (and ``pixels`` for the VLM) per global sample index; the loop
draws samples ``pos .. pos + global_batch - 1`` each step, so the position is all a
resumed run needs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger("braid.examples")


class UsageError(ValueError):
    """A flag or a layout that cannot work: exit code 2 with one line."""


@dataclass(frozen=True)
class Task:
    """What a training script plugs into the loop.

    ``build_model(args) -> nn.Module`` (single-device, under the caller's seed);
    ``stage_layers(model, num_stages, args) -> tuple``; ``check(model, topo, num_stages, args)``
    raises ``ValueError`` for layouts the model cannot take; ``build_chunks(model, plan,
    pp_rank, stage_layers, tp_rank, tp_size, tp_group)``; ``source(model, args)`` the data;
    ``inputs(model, batch) -> (tokens_item, labels)`` per micro-batch; ``seq_len(model, args)``
    the LM sequence; ``flops_per_sample(model, args)`` for MFU.
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


# -- command line ----------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2 (argparse's default prints usage too)
        raise UsageError(message)


def build_parser(task: Task) -> argparse.ArgumentParser:
    from braid import schedules
    from braid.baselines import BASELINES

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
    lay.add_argument("--cp", type=int, default=1,
                     help="sequence-parallel degree d_sp = d_hp x d_cp (LoongTrain 2D-Attention; default: %(default)s)")
    lay.add_argument("--hp", type=int, default=1, help="head-parallel part d_hp of --cp (default: %(default)s)")
    lay.add_argument("--ring-size", type=int, default=None,
                     help="inner ring size w of Double-Ring-Attention, dividing d_cp = cp/hp (default: one ring of d_cp)")
    lay.add_argument("--placement", default="head_first", choices=["head_first", "context_first"],
                     help="put the head-parallel (head_first) or the context-parallel group on adjacent ranks")
    lay.add_argument("--last-stage-lighter", type=int, default=None,
                     help="layers fewer on the last virtual stage (heavy LM head; default: 2, 0 for --model tiny)")
    run = p.add_argument_group("batch and model")
    run.add_argument("--model", default="tiny", choices=["tiny", "small", "7b", "15b"], help="size preset (default: %(default)s)")
    run.add_argument("--hf", metavar="DIR", help="start from a local Hugging Face checkpoint (config.json + safetensors) "
                                                 "instead of --model; each rank reads only its chunks' tensors")
    run.add_argument("--mbs", type=int, default=None, help="micro-batches per step (default: 2*pp)")
    run.add_argument("--micro-batch-size", type=int, default=2, help="samples per micro-batch (default: %(default)s)")
    run.add_argument("--seq", type=int, default=task.default_seq,
                     help=("caption tokens per sample; the LM sees visual tokens + these" if task.vision else "tokens per sample")
                     + " (default: %(default)s)")
    if task.vision:
        run.add_argument("--image-size", type=int, default=None, help="image side in pixels (default: the preset's)")
    run.add_argument("--steps", type=int, default=40, help="training steps in total, counting resumed ones (default: %(default)s)")
    run.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    run.add_argument("--init-std", type=float, default=0.02, help="std of the random initialisation (default: %(default)s)")
    run.add_argument("--seed", type=int, default=0, help="model and data seed (default: %(default)s)")
    run.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="auto: cuda if available (bf16), else cpu (fp32) (default: %(default)s)")
    run.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                     help="torch.compile the units' element-wise functions (default: on with CUDA, off on CPU)")
    out = p.add_argument_group("outputs")
    out.add_argument("--metrics", metavar="FILE.jsonl", help="append one JSON object per step (rank 0 writes)")
    out.add_argument("--trace", metavar="FILE.json", help="measured trace of the last step, all ranks (view: python -m braid.viz)")
    out.add_argument("--save", metavar="DIR", help="checkpoint at the end (and every --save-every steps)")
    out.add_argument("--save-every", type=int, default=0, metavar="N", help="also checkpoint every N steps (default: only at the end)")
    out.add_argument("--resume", metavar="DIR", help="continue from a checkpoint written with the same layout")
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


@dataclass(frozen=True)
class Setup:
    """Everything decided before any process group exists (same on every rank)."""

    args: argparse.Namespace
    world: int
    rank: int
    topo: Any
    runs: list["Run"]
    model: torch.nn.Module

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
    from braid.baselines import BASELINES
    from braid.topology import Topology

    args = build_parser(task).parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    for name in ("tp", "pp", "cp", "hp", "micro_batch_size", "seq", "steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.dp is None:
        args.dp = max(1, world // (args.tp * args.pp * args.cp))
    if args.mbs is None:
        args.mbs = 2 * args.pp
    if args.last_stage_lighter is None:
        args.last_stage_lighter = 0 if args.model == "tiny" else 2
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available; use --device cpu")
    if args.resume and not Path(args.resume, ".metadata").is_file():
        raise UsageError(f"--resume {args.resume}: no checkpoint there (missing .metadata)")
    names = args.schedule
    valid = list(schedules.names()) + list(BASELINES)
    for n in names:
        if n not in valid:
            raise UsageError(f"--schedule {n}: unknown; valid: {', '.join(valid)}")
        if n.startswith("mcore_"):
            from braid import megatron

            if not megatron.available():
                raise UsageError(f"--schedule {n}: {megatron.INSTALL_HINT}")
            if task.vision:
                raise UsageError(f"--schedule {n}: megatron-core's GPT model is a decoder LM; use a torch_* baseline for a VLM")
    if len(set(names)) != len(names):
        raise UsageError(f"--schedule names a schedule twice: {' '.join(names)}")
    if len(names) > 1 and (args.save or args.resume or args.trace or args.save_hf):
        raise UsageError("--save, --save-hf, --resume and --trace take one --schedule (several schedules compare fresh runs)")
    if args.save_hf and Path(args.save_hf).exists() and (not Path(args.save_hf).is_dir() or any(Path(args.save_hf).iterdir())):
        raise UsageError(f"--save-hf {args.save_hf}: exists and is not an empty directory; give a new directory")
    if args.reference and (args.resume or args.cp > 1):
        raise UsageError("--reference compares fresh runs without sequence parallelism: drop --resume / use --cp 1")
    torch_names = [n for n in names if n in BASELINES]
    if torch_names and (args.save or args.resume or args.save_hf):
        raise UsageError(f"--save/--save-hf/--resume checkpoint braid's schedules, not {torch_names[0]}")
    if torch_names and (args.dp != 1 or args.cp != 1):
        raise UsageError(f"{torch_names[0]} runs tp x pp layouts only: use --dp 1 --cp 1 (world size = tp * pp)")
    try:
        sp_config = _sp_config(task, args)
        topo = Topology(world, pp=args.pp, dp=args.dp, tp=args.tp, cp=args.cp)
        opts = {}
        if args.offload_alpha is not None:
            if "braided_v_offload" not in names or not 0.0 <= args.offload_alpha <= 1.0:
                raise ValueError(f"--offload-alpha {args.offload_alpha}: needs --schedule braided_v_offload and a value in [0, 1]")
            opts = {"offload_alpha": args.offload_alpha, "offload_alpha_warmup": args.offload_alpha}
        torch.manual_seed(args.seed)
        if args.hf:
            import braid.hf

            model = braid.hf.load_meta(args.hf, device=_device(args))  # materialised chunk by chunk
        else:
            model = task.build_model(args)
        if args.save_hf:
            from braid.models.registry import family_of

            family_of(model)  # a model no registered family can write is refused before training
        runs = []
        for n in names:
            plan = None if n in BASELINES else schedules.build(n, args.pp, args.mbs, **(opts if n == "braided_v_offload" else {}))
            n_stages = 2 * args.pp if plan is None else plan.num_stages
            task.check(model, topo, n_stages, args)
            runs.append(Run(n, plan, tuple(task.stage_layers(model, n_stages, args))))
            if n.startswith("mcore_") and len(set(runs[-1].stage_layers)) != 1:
                raise ValueError(f"{n}: megatron-core splits layers evenly, got {list(runs[-1].stage_layers)} per stage; "
                                 "use --last-stage-lighter 0 and a layer count divisible by 2 * pp")
        if sp_config is not None:
            sp_config.check_model(heads=model.cfg.heads, kv_heads=model.cfg.kv_heads, tp=args.tp, seq_len=task.seq_len(model, args))
    except ValueError as err:
        raise UsageError(str(err).splitlines()[0]) from None
    return Setup(args, world, rank, topo, runs, model)


def _sp_config(task: Task, args: argparse.Namespace) -> Any:
    """The sequence-parallel degrees from the flags, or None without sequence parallelism."""
    from braid.models.sequence_parallel import SPConfig

    if args.cp == 1:
        if args.hp != 1 or args.ring_size is not None:
            raise UsageError("--hp and --ring-size need --cp > 1 (the sequence-parallel degree)")
        return None
    if task.vision:
        raise UsageError("--cp > 1 is not supported by the vision-language example (the ViT stage is not "
                         "sequence-parallel); use examples/qwen2.py for long-sequence runs")
    if args.cp % args.hp:
        raise UsageError(f"--hp {args.hp} must divide --cp {args.cp}")
    return SPConfig(d_sp=args.cp, d_hp=args.hp, w=args.ring_size, placement=args.placement)


# -- the run -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(args: argparse.Namespace) -> torch.device:
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _peak_flops(args: argparse.Namespace, device: torch.device) -> float:
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if device.type == "cuda" and any(k in torch.cuda.get_device_name(device) for k in ("H100", "H200", "H800", "H20 ")):
        return 989e12
    return 0.0


class Progress:
    """Rank 0's progress: a carriage-return bar on a terminal, plain log lines otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = enabled and sys.stderr.isatty()

    def update(self, step: int, line: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            done = int(30 * step / self.total)
            sys.stderr.write(f"\r\033[K{line}\n[{'#' * done}{'.' * (30 - done)}] {step}/{self.total}")
            sys.stderr.flush()
        else:
            log.info(line)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def _state_dict(chunks: dict, plan, pp_rank: int, tp_rank: int, opt: torch.optim.Optimizer, progress: dict) -> dict:
    """Checkpoint contents: keys name (stage, tp rank, parameter), so shards never collide across ranks."""
    model, optim = {}, {}
    for c, ch in chunks.items():
        for n, p in ch.named_parameters():
            key = f"stage{plan.stage_of(pp_rank, c)}.tp{tp_rank}.{n}"
            model[key] = p
            st = opt.state[p]
            if not st:  # before the first step: create AdamW's state so a load can fill it in place
                st.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            optim[key] = {k: st[k] for k in ("step", "exp_avg", "exp_avg_sq")}
    return {"model": model, "optim": optim, "progress": progress}


@dataclass
class RunStats:
    """What one schedule's run measured: per-step losses and times, peak memory per rank (bytes, 0 = not measured)."""

    name: str
    losses: list[float]
    step_times: list[float]
    peak_bytes: list[int]


def run(task: Task, setup: Setup, source: Any = None) -> tuple[dict[str, RunStats], list[float] | None]:
    """Train every schedule of the job from the same weights and data.

    Returns the stats by schedule name and, with ``--reference``, the unsplit model's
    per-step losses (both on every rank).
    """
    from braid.runtime.distributed import Dist, ProcessGroups

    args = setup.args
    device = _device(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if "RANK" in os.environ:
        d = Dist.from_env(device=device, timeout_s=args.timeout)
    else:
        d = Dist.init(0, 1, master_port=_free_port(), device=device, timeout_s=args.timeout)
    try:
        groups = ProcessGroups.create(setup.topo, timeout_s=args.timeout)
        source = source if source is not None else task.source(setup.model, args)
        ref = _reference(task, setup, source, device, dtype) if args.reference else None
        stats = {r.name: _train(task, setup, r, d, groups, source, device, dtype) for r in setup.runs}
        if setup.rank == 0 and (len(stats) > 1 or ref is not None):
            print(format_comparison(task, setup, stats, ref, dtype), flush=True)
        return stats, ref
    except Exception:
        d.abort.signal("training loop failed")
        raise
    finally:
        d.close()


def _reference(task: Task, setup: Setup, source: Any, device: torch.device, dtype: torch.dtype) -> list[float]:
    """The unsplit model trained on rank 0's device (same weights, micro-batches, AdamW); losses broadcast to all ranks."""
    import copy

    import torch.distributed as dist

    args = setup.args
    losses: list[float] = []
    if setup.rank == 0:
        from braid.models.build import materialize

        model = materialize(copy.deepcopy(setup.model)).to(device=device, dtype=dtype)  # a meta-device model made whole
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        n, b = args.dp * args.mbs, args.micro_batch_size
        for step in range(args.steps):
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for i in range(n):  # replica r's micro-batch k is global micro-batch r * mbs + k
                batch = {k: _to(v, device, dtype) for k, v in _batch(source, (step * n + i) * b, b).items()}
                loss = model(*((batch["pixels"],) if task.vision else ()), batch["tokens"], batch["labels"]) / n
                loss.backward()
                total += float(loss.detach())
            opt.step()
            losses.append(total)
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("reference (unsplit model, one device): losses %s", " ".join(f"{x:.4f}" for x in losses))
    box = [losses]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _BraidRunner:
    """A braid schedule: this rank's chunks under the executor, data-parallel gradient reduction."""

    def __init__(self, task: Task, setup: Setup, run: Run, d: Any, groups: Any, device: torch.device, dtype: torch.dtype) -> None:
        from braid.compiler import compile_plan
        from braid.runtime.executor import Executor

        args, topo, plan = setup.args, setup.topo, run.plan
        c = groups.coords
        sp = None
        if topo.cp > 1:
            from braid.models.sequence_parallel import SequenceParallel

            sp = SequenceParallel.create(_sp_config(task, args), groups)
        model = setup.model
        self.chunks = task.build_chunks(model, plan, c.pp, run.stage_layers, c.tp, topo.tp, groups.tp if topo.tp > 1 else None,
                                        sp=sp, seq_len=task.seq_len(model, args))
        for ch in self.chunks.values():
            ch.to(device=device, dtype=dtype)
        seq = task.seq_len(model, args)
        hidden = model.cfg.lm.hidden if hasattr(model.cfg, "lm") else model.cfg.hidden
        local_seq = sp.local_len(seq) if sp is not None else seq
        self.ex = Executor.from_groups(plan, compile_plan(plan)[c.pp], self.chunks, groups, d.abort,
                                       act_shape=(args.micro_batch_size, local_seq, hidden), dtype=dtype, device=device,
                                       compile=args.compile)
        self.params = [p for ch in self.chunks.values() for p in ch.parameters()]
        self.groups, self.abort, self.device = groups, d.abort, device
        self.state_bytes = sum(p.numel() * p.element_size() * 4 for p in self.params)  # weights, grads, two AdamW moments
        self.res = None

    def step(self, toks: list, labs: list, traced: bool) -> tuple[float | None, int]:
        """Forward + backward of the step's micro-batches; (loss this rank reports, CPU memory estimate)."""
        from braid.runtime.distributed import reduce_gradients

        cuda = self.device.type == "cuda"
        # Unit-level timing costs host time per unit: only on the step whose trace is written.
        # Other steps keep the per-instruction memory series on CPU (the memory figure).
        self.res = res = self.ex.run(toks, labs, record="units" if traced else "off" if cuda else "instructions")
        reduce_gradients(self.params, self.groups, self.abort)
        c = self.groups.coords
        mem = 0 if cuda else max((b for _, b in next(iter(res.trace.memory.values()), [])), default=0) + self.state_bytes
        return (res.loss if res.loss is not None and c.tp == 0 and c.cp == 0 else None), mem  # the SP group already summed it


class _TorchRunner:
    """A torch.distributed.pipelining baseline (:mod:`braid.baselines`) on the same layers per stage."""

    def __init__(self, task: Task, setup: Setup, run: Run, d: Any, groups: Any, device: torch.device, dtype: torch.dtype) -> None:
        from braid.baselines import baseline_pipeline

        from braid.models.build import materialize

        model, layers = materialize(setup.model), run.stage_layers  # the baselines split the whole model themselves
        lm, vision = (model.lm, model.visual) if task.vision else (model, None)
        lm_layers = (0,) + layers[1:] if task.vision else layers  # the VLM's stage 0 holds the vision tower
        self.pipe = baseline_pipeline(run.name, lm, lm_layers, setup.args.mbs, groups=groups, device=device, dtype=dtype,
                                      vision=vision, seq_len=task.seq_len(setup.model, setup.args), timeout_s=setup.args.timeout)
        self.params = self.pipe.parameters()
        self.tp_rank = groups.coords.tp
        self.res = None

    def step(self, toks: list, labs: list, traced: bool) -> tuple[float | None, int]:
        items = [t if isinstance(t, tuple) else (t,) for t in toks]
        inputs = tuple(torch.cat([it[k] for it in items]) for k in range(len(items[0])))
        loss = self.pipe.step(inputs, torch.cat(labs))
        return (loss if self.tp_rank == 0 else None), 0


def _train(task: Task, setup: Setup, run: Run, d: Any, groups: Any, source: Any, device: torch.device,
           dtype: torch.dtype) -> RunStats:
    """``--steps`` AdamW steps of one schedule; per-step log line, metrics, checkpoints and trace as asked."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from braid.trace import Trace, dump_traces

    args, topo = setup.args, setup.topo
    c = groups.coords
    runner = (_TorchRunner if run.plan is None else _BraidRunner)(task, setup, run, d, groups, device, dtype)
    opt = runner.pipe.optimizer(lr=args.lr) if run.plan is None else torch.optim.AdamW(runner.params, lr=args.lr)
    per_step = args.dp * args.mbs * args.micro_batch_size
    step, pos = 0, 0
    if args.resume:
        sd = _state_dict(runner.chunks, run.plan, c.pp, c.tp, opt,
                         {"step": torch.zeros((), dtype=torch.int64), "pos": torch.zeros((), dtype=torch.int64)})
        dcp.load(sd, checkpoint_id=args.resume)
        step, pos = int(sd["progress"]["step"]), int(sd["progress"]["pos"])
        if setup.rank == 0:
            log.info("resumed from %s at step %d (sample %d)", args.resume, step, pos)
    seq = task.seq_len(setup.model, args)
    flops = task.flops_per_sample(setup.model, args)
    peak = _peak_flops(args, device)
    bar = Progress(args.steps, setup.rank == 0)
    metrics = open(args.metrics, "a") if args.metrics and setup.rank == 0 else None
    stats = RunStats(run.name, [], [], [0] * setup.world)
    while step < args.steps:
        first = pos + c.dp * args.mbs * args.micro_batch_size
        toks, labs = [], []
        for i in range(args.mbs):
            tok, lab = task.inputs(setup.model, _batch(source, first + i * args.micro_batch_size, args.micro_batch_size))
            toks.append(_to(tok, device, dtype))
            labs.append(lab.to(device))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        traced = bool(args.trace) and step + 1 == args.steps
        local_loss, mem = runner.step(toks, labs, traced)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            mem = torch.cuda.max_memory_allocated(device)
        dt = time.perf_counter() - t0
        loss_t = torch.tensor([local_loss if local_loss is not None else 0.0], dtype=torch.float64, device=device)
        dist.all_reduce(loss_t)
        loss = float(loss_t) / topo.dp
        mems = torch.zeros(setup.world, dtype=torch.int64, device=device)
        mems[setup.rank] = mem
        dist.all_reduce(mems)
        step += 1
        pos += per_step
        stats.losses.append(loss)
        stats.step_times.append(dt)
        stats.peak_bytes = [max(a, int(b)) for a, b in zip(stats.peak_bytes, mems.tolist())]
        samples = per_step / dt
        tokens = samples * seq
        mfu = flops * samples / (setup.world * peak) if peak else 0.0
        bar.update(step, f"{run.name}  step {step:>4}/{args.steps}  loss {loss:.4f}  {dt * 1e3:7.1f} ms  {tokens:,.0f} tok/s  "
                         f"mfu {mfu:.3f}  peak mem {max(mems.tolist()) / 2**20:,.1f} MiB")
        if metrics is not None:
            metrics.write(json.dumps({"step": step, "loss": loss, "step_time_s": dt, "samples_per_s": samples,
                                      "tokens_per_s": tokens, "mfu": mfu, "peak_memory_bytes": mems.tolist(),
                                      "schedule": run.name, "tp": topo.tp, "pp": topo.pp, "dp": topo.dp,
                                      "model": args.hf or args.model, "device": str(device), "dtype": str(dtype).replace("torch.", "")}) + "\n")
            metrics.flush()
        if args.save and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            progress = {"step": torch.tensor(step), "pos": torch.tensor(pos)}
            dcp.save(_state_dict(runner.chunks, run.plan, c.pp, c.tp, opt, progress), checkpoint_id=args.save)
    bar.close()
    if metrics is not None:
        metrics.close()
    if args.save_hf:
        import braid.hf
        from braid.models.registry import family_of

        braid.hf.save_chunks(runner.chunks, setup.model.cfg, family_of(setup.model), args.save_hf, groups)
        if setup.rank == 0:
            log.info("saved a Hugging Face checkpoint to %s", args.save_hf)
    if args.trace and runner.res is not None:
        _write_trace(runner.res.trace, setup.rank, setup.world, args, Trace, dump_traces)
    del runner, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return stats


def reference_rtol(args: argparse.Namespace, dtype: torch.dtype) -> float:
    if args.reference_rtol is not None:
        return args.reference_rtol
    return 2e-2 if dtype == torch.bfloat16 else 1e-4


def max_rel_diff(losses: Sequence[float], ref: Sequence[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))


def format_comparison(task: Task, setup: Setup, stats: dict[str, RunStats], ref: list[float] | None, dtype: torch.dtype) -> str:
    """The side-by-side table: throughput, MFU, peak memory per rank, losses vs the unsplit model."""
    import statistics

    args = setup.args
    device = _device(args)
    seq = task.seq_len(setup.model, args)
    per_step = args.dp * args.mbs * args.micro_batch_size
    flops = task.flops_per_sample(setup.model, args)
    peak = _peak_flops(args, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [f"# {task.prog} {f'--hf {args.hf}' if args.hf else f'--model {args.model}'}: tp={args.tp} pp={args.pp} dp={args.dp} m={args.mbs} "
             f"micro-batch {args.micro_batch_size} x {seq} tokens, {args.steps} steps on {setup.world} x {where} "
             f"({str(dtype).replace('torch.', '')}); step time = median after the first step"]
    head = f"{'schedule':<18} {'step ms':>9} {'tokens/s':>11} {'MFU':>6} {'last loss':>10}"
    if ref is not None:
        head += f" {'max rel diff':>13}"
    lines += [head + "  peak MiB per rank", "-" * (len(head) + 40)]
    for st in stats.values():
        times = st.step_times[1:] or st.step_times
        dt = statistics.median(times)
        tok = per_step * seq / dt
        mfu = f"{flops * per_step / dt / (setup.world * peak):6.3f}" if peak else f"{'-':>6}"
        row = f"{st.name:<18} {dt * 1e3:9.1f} {tok:11,.0f} {mfu} {st.losses[-1]:10.4f}"
        if ref is not None:
            row += f" {max_rel_diff(st.losses, ref):13.2e}"
        mem = " ".join(f"{b / 2**20:,.1f}" if b else "-" for b in st.peak_bytes)
        lines.append(f"{row}  {mem}")
    if ref is not None:
        lines.append(f"reference (unsplit model on one device): last loss {ref[-1]:.4f}; tolerance {reference_rtol(args, dtype):.0e} relative")
    return "\n".join(lines)


def _batch(source: Any, first: int, count: int) -> dict[str, torch.Tensor]:
    items = [source[first + k] for k in range(count)]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def _to(item: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(item, tuple):
        return tuple(_to(x, device, dtype) for x in item)
    return item.to(device=device, dtype=dtype if item.is_floating_point() else item.dtype)


def _write_trace(trace: Any, rank: int, world: int, args: argparse.Namespace, Trace: Any, dump_traces: Any) -> None:
    """Gather every rank's trace to rank 0 and merge them (events and memory keyed by global rank)."""
    import torch.distributed as dist

    d = trace.to_dict()
    for e in d["events"]:
        e["rank"] = rank
    d["memory"] = {str(rank): s for s in d["memory"].values()}
    got: list[Any] = [None] * world if rank == 0 else None
    dist.gather_object(d, got, dst=0)
    if rank != 0:
        return
    merged = Trace.from_dict({"meta": {**got[0]["meta"], "rank": None, "ranks": world, "tp": args.tp, "pp": args.pp, "dp": args.dp},
                              "events": [e for t in got for e in t["events"]],
                              "memory": {r: s for t in got for r, s in t["memory"].items()}})
    dump_traces([merged], args.trace)
    log.info("trace of the last step: %s (%d events, %d ranks)", args.trace, len(merged.events), world)


def _usage_barrier(rank: int) -> None:
    """Under torchrun, other ranks wait (briefly) until rank 0 has printed the error.

    The elastic agent stops the remaining workers as soon as one exits; without this, a
    fast rank 1 could get rank 0 killed before its one line reached the terminal.
    """
    import datetime

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or "MASTER_PORT" not in os.environ:
        return
    key = "braid/usage_error_reported"
    try:
        store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        if rank == 0:
            store.set(key, "1")
        else:
            store.wait([key])
    except Exception:  # noqa: BLE001 - best effort: the exit code is 2 either way
        log.debug("no store to coordinate the usage error", exc_info=True)


def main(task: Task, argv: Sequence[str] | None = None, source: Any = None) -> int:
    """Entry point of the example scripts; returns the exit code (2 for bad flags or layouts)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rank = int(os.environ.get("RANK", "0"))
    try:
        setup = prepare(task, argv)
    except UsageError as err:
        if rank == 0:
            print(f"{task.prog}: error: {err}", file=sys.stderr, flush=True)
        _usage_barrier(rank)
        return 2
    stats, ref = run(task, setup, source)
    if ref is None:
        return 0
    dtype = torch.bfloat16 if _device(setup.args).type == "cuda" else torch.float32
    tol = reference_rtol(setup.args, dtype)
    bad = [f"{st.name} ({max_rel_diff(st.losses, ref):.2e})" for st in stats.values() if max_rel_diff(st.losses, ref) > tol]
    if bad:
        if rank == 0:
            print(f"{task.prog}: losses differ from the unsplit model by more than {tol:.0e}: {', '.join(bad)}", file=sys.stderr, flush=True)
        return 1
    return 0
