"""One training step of the example loop: this rank's share of the model, its micro-batches, the optimizer.

:class:`BraidRunner` runs a braid schedule (this rank's chunks under the executor, then the
data-parallel gradient reduction); :class:`TorchRunner` a ``torch.distributed.pipelining``
baseline on the same layers per stage. :func:`make_optimizer` is the seam where the
optimizer is chosen; :func:`train_step` is one step (forward + backward of every
micro-batch, the loss known on every rank) before the optimizer update.
:func:`train_reference` trains the unsplit model on one device for ``--reference``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from train_cli import NonFiniteError, Run, Setup, Task, optim_config, sp_config

log = logging.getLogger("braid.examples")


def pick_device(args: argparse.Namespace) -> torch.device:
    """``--device``: cuda (this process's local rank) or cpu."""
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA, fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def peak_flops(args: argparse.Namespace, device: torch.device) -> float:
    """Per-device peak FLOP/s for MFU (0: not reported)."""
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if device.type == "cuda" and any(k in torch.cuda.get_device_name(device) for k in ("H100", "H200", "H800", "H20 ")):
        return 989e12
    return 0.0


def gather_batch(source: Any, first: int, count: int) -> dict[str, Any]:
    """Samples ``first .. first + count - 1`` of ``source`` stacked into one micro-batch; a field whose samples
    differ in shape (images of several sizes: ``--image-sizes``) stays a list of them."""
    items = [source[first + k] for k in range(count)]
    out = {}
    for k in items[0]:
        parts = [it[k] for it in items]
        out[k] = torch.stack(parts) if all(t.shape == parts[0].shape for t in parts) else parts
    return out


def to_device(item: Any, device: torch.device, dtype: torch.dtype, non_blocking: bool = False) -> Any:
    """A tensor (or a tuple -- named ones keep their type -- or list of tensors) on ``device``; floating-point
    ones in ``dtype``."""
    if isinstance(item, (tuple, list)):
        return _like(item, [to_device(x, device, dtype, non_blocking) for x in item])
    return item.to(device=device, dtype=dtype if item.is_floating_point() else item.dtype, non_blocking=non_blocking)


def local_tensors(params: list) -> list[torch.Tensor]:
    """This rank's part of each parameter (a DTensor's local block)."""
    return [p.to_local() if hasattr(p, "to_local") else p for p in params]


def model_state_bytes(params: list, mode: str, shards: int = 1) -> int:
    """Bytes of this rank's model state under optimizer ``mode``: weights, gradients and AdamW state
    (:mod:`braid.cost.optimizer_modes`; ``shards``: ranks a ``zero1`` state is divided over)."""
    from braid.cost.optimizer_modes import state_bytes_per_param

    return int(sum(t.numel() * state_bytes_per_param(mode, t.element_size(), shards) for t in local_tensors(params)))


class BraidRunner:
    """A braid schedule: this rank's chunks under the executor, data-parallel gradient reduction."""

    def __init__(self, task: Task, setup: Setup, run: Run, d: Any, groups: Any, device: torch.device, dtype: torch.dtype) -> None:
        from braid.core.compiler import compile_plan
        from braid.runtime.executor import Executor

        args, topo, plan = setup.args, setup.topo, run.plan
        c = groups.coords
        sp = None
        if topo.cp > 1:
            from braid.models.sequence_parallel import SequenceParallel

            sp = SequenceParallel.create(sp_config(task, args), groups)
        model = setup.model
        shard = {"seq_shard": True} if args.sequence_parallel else {}  # braid.tp.seq_shard (LM tasks only)
        self.chunks = task.build_chunks(model, plan, c.pp, run.stage_layers, c.tp, topo.tp, groups.tp if topo.tp > 1 else None,
                                        sp=sp, seq_len=task.seq_len(model, args), **shard)
        self.experts = None
        if args.ep > 1:  # this rank's share of the experts, their tokens exchanged by all-to-all
            from braid.runtime.expert_parallel import ExpertGroups, shard_experts

            self.experts = ExpertGroups.create(topo, groups.rank, args.ep, timeout_s=args.timeout)
            shard_experts(self.chunks.values(), self.experts.ep_rank, args.ep, self.experts, args.moe_dispatch)
        for ch in self.chunks.values():
            ch.to(device=device, dtype=dtype)
            if hasattr(ch, "set_recompute"):  # the LM chunks (the VLM's vision chunk keeps its activations)
                ch.set_recompute(args.recompute)
        seq = task.seq_len(model, args)
        hidden = model.cfg.lm.hidden if hasattr(model.cfg, "lm") else model.cfg.hidden
        local_seq = sp.local_len(seq) if sp is not None else seq // topo.tp if args.sequence_parallel else seq
        self.ex = Executor.from_groups(plan, compile_plan(plan)[c.pp], self.chunks, groups, d.abort,
                                       act_shape=(args.micro_batch_size, local_seq, hidden), dtype=dtype, device=device,
                                       compile=args.compile)
        from braid.runtime.graphs import step_runner

        self.graph = step_runner(self.ex, args.cuda_graph)  # whole-step CUDA graph (braid.runtime.graphs) or eager
        # The single-device model's names: they key the sharded optimizer's state (train_checkpoint.MasterState).
        from braid.models.global_names import chunk_shards

        shards = chunk_shards(self.chunks, c.tp, topo.tp, vlm=task.vision)
        if self.experts is not None:
            from braid.runtime.expert_parallel import expert_shards

            shards = expert_shards(shards, self.experts)
        self.shards = shards  # each parameter's block of the single-device model (checkpoints: train_checkpoint.TrainState)
        self.named = [(shards[p].name, p) for ch in self.chunks.values() for p in ch.parameters()]
        self.params = [p for _, p in self.named]
        self.groups, self.abort, self.device = groups, d.abort, device
        self.state_bytes = model_state_bytes(self.params, args.optimizer, topo.dp * topo.cp)
        self.res = None

    def step(self, toks: list, labs: list, traced: bool) -> tuple[float | None, int]:
        """Forward + backward of the step's micro-batches; (loss this rank reports, CPU memory estimate).

        The gradients are reduced over data-parallel ranks by the optimizer step (:class:`Optimization`).
        """
        cuda = self.device.type == "cuda"
        # Unit-level timing costs host time per unit: only on the step whose trace is written.
        # Other steps keep the per-instruction memory series on CPU (the memory figure).
        self.res = res = self.graph.run(toks, labs, record="units" if traced else "off" if cuda else "instructions")
        c = self.groups.coords
        mem = 0 if cuda else max((b for _, b in next(iter(res.trace.memory.values()), [])), default=0) + self.state_bytes
        return (res.loss if res.loss is not None and c.tp == 0 and c.cp == 0 else None), mem  # the SP group already summed it


class TorchRunner:
    """A torch.distributed.pipelining baseline (:mod:`braid.baselines.torch_pp`) on the same layers per stage."""

    def __init__(self, task: Task, setup: Setup, run: Run, d: Any, groups: Any, device: torch.device, dtype: torch.dtype) -> None:
        from braid.baselines.torch_pp import baseline_pipeline

        from braid.models.build import materialize

        model, layers = materialize(setup.model), run.stage_layers  # the baselines split the whole model themselves
        lm, vision = (model.lm, model.visual) if task.vision else (model, None)
        lm_layers = (0,) + layers[1:] if task.vision else layers  # the VLM's stage 0 holds the vision tower
        self.pipe = baseline_pipeline(run.name, lm, lm_layers, setup.args.mbs, groups=groups, device=device, dtype=dtype,
                                      vision=vision, seq_len=task.seq_len(setup.model, setup.args), timeout_s=setup.args.timeout)
        self.params = self.pipe.parameters()
        self.state_bytes = model_state_bytes(self.params, "plain")
        self.tp_rank = groups.coords.tp
        self.abort = d.abort
        self.res = None

    def step(self, toks: list, labs: list, traced: bool) -> tuple[float | None, int]:
        items = [t if isinstance(t, tuple) else (t,) for t in toks]
        inputs = tuple(torch.cat([it[k] for it in items]) for k in range(len(items[0])))
        loss = self.pipe.step(inputs, torch.cat(labs))
        return (loss if self.tp_rank == 0 else None), 0


def make_runner(task: Task, setup: Setup, run: Run, d: Any, groups: Any, device: torch.device,
                dtype: torch.dtype) -> BraidRunner | TorchRunner:
    """The runner of ``run``: braid's executor, or the torch baseline when the schedule is torch's."""
    return (TorchRunner if run.plan is None else BraidRunner)(task, setup, run, d, groups, device, dtype)


def make_optimizer(args: argparse.Namespace, runner: BraidRunner | TorchRunner) -> Any:
    """The optimizer over this rank's parameters: braid's schedules get :class:`braid.training.step.Optimization`
    (data-parallel reduction, schedule, clipping, weight decay, fp32 masters as the flags say); the torch
    baselines their own AdamW at ``--lr``."""
    if isinstance(runner, TorchRunner):
        return runner.pipe.optimizer(lr=args.lr)
    from braid.training.step import Optimization

    return Optimization(optim_config(args), runner.named, runner.chunks.values(), groups=runner.groups, abort=runner.abort,
                        experts=runner.experts)


def host_micro_batches(task: Task, setup: Setup, source: Any, pos: int, dp_rank: int, pin: bool) -> tuple[list, list]:
    """This data-parallel replica's ``--mbs`` micro-batches of the step that starts at global sample ``pos``, on the
    host (``pin``: in pinned memory, so that their copies to the device are asynchronous).

    Replica ``r``'s micro-batch ``k`` is global micro-batch ``r * mbs + k``.
    """
    args = setup.args
    first = pos + dp_rank * args.mbs * args.micro_batch_size
    toks, labs = [], []
    for i in range(args.mbs):
        tok, lab = task.inputs(setup.model, gather_batch(source, first + i * args.micro_batch_size, args.micro_batch_size), args)
        toks.append(_pinned(tok) if pin else tok)
        labs.append(_pinned(lab) if pin else lab)
    return toks, labs


def _pinned(item: Any) -> Any:
    return _like(item, [_pinned(x) for x in item]) if isinstance(item, (tuple, list)) else item.pin_memory()


def _like(item: Any, parts: list) -> Any:
    """``parts`` in ``item``'s container: a list, a tuple, or the same named tuple (a padded VLM micro-batch)."""
    if isinstance(item, list):
        return parts
    return type(item)(*parts) if hasattr(item, "_fields") else tuple(parts)


class Prefetcher:
    """Prepares the next step's micro-batches on a background thread while the current step runs.

    The samples are drawn, stacked and pinned on the host by a worker thread (the data
    source's work is off the critical path); :meth:`take` returns them on the device through
    asynchronous copies, and starts on the step after. A position other than the one
    prepared (a resume) is prepared on the spot."""

    def __init__(self, task: Task, setup: Setup, source: Any, dp_rank: int, step_samples: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.device, self.dtype, self.step_samples = device, dtype, step_samples
        pin = device.type == "cuda"
        self._load = lambda pos: host_micro_batches(task, setup, source, pos, dp_rank, pin)  # noqa: E731
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="braid-data")
        self._next: tuple[int, Any] | None = None

    def take(self, pos: int, more: bool) -> tuple[list, list]:
        """The micro-batches of the step at ``pos`` on the device; ``more``: prepare the next step's now."""
        ready = self._next[1].result() if self._next is not None and self._next[0] == pos else None
        toks, labs = ready if ready is not None else self._load(pos)
        self._next = (pos + self.step_samples, self._pool.submit(self._load, pos + self.step_samples)) if more else None
        nb = self.device.type == "cuda"
        return ([to_device(t, self.device, self.dtype, non_blocking=nb) for t in toks],
                [lab.to(self.device, non_blocking=nb) for lab in labs])

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class StepOut:
    """What one step measured: the global loss (mean over replicas), this rank's peak memory (bytes), and the
    global gradient norm before clipping (None: not measured -- the torch baselines)."""

    loss: float
    mem: int
    grad_norm: float | None = None


def train_step(runner: BraidRunner | TorchRunner, opt: Any, toks: list, labs: list, *, traced: bool, step: int,
               topo: Any, rank: int, device: torch.device) -> StepOut:
    """Step ``step`` (1-based): forward + backward of every micro-batch, the loss summed over ranks, the update.

    A non-finite loss or local gradient on any rank stops every rank *before* the update
    (:class:`NonFiniteError` naming the step and the first such rank), so no damaged
    weights are trained on or saved.
    """
    opt.zero_grad(set_to_none=True)
    local_loss, mem = runner.step(toks, labs, traced)
    world = topo.world_size
    # One all-reduce: the loss, then per rank a flag for a non-finite loss and one for a non-finite gradient.
    buf = torch.zeros(1 + 2 * world, dtype=torch.float64, device=device)
    if local_loss is not None:
        buf[0] = local_loss
        buf[1 + rank] = not math.isfinite(local_loss)
    buf[1 + world + rank] = not _grads_finite(runner)
    runner.abort.all_reduce(buf)  # bounded; a lost rank is named (braid.runtime.distributed.Abort)
    flags = buf[1:].tolist()
    if any(flags):
        what, first = ("loss", flags.index(1.0)) if any(flags[:world]) else ("gradient", flags.index(1.0, world) - world)
        raise NonFiniteError(f"non-finite {what} at step {step} (first on rank {first}); stopped before the optimizer "
                             "update, nothing saved from this step on -- lower --lr or --init-std")
    norm = opt.step()  # Optimization: the global gradient norm (no update when it is not finite); a torch optimizer: None
    if norm is not None and not math.isfinite(norm):
        raise NonFiniteError(f"non-finite gradient norm ({norm}) at step {step}; stopped without the optimizer update, "
                             "nothing saved from this step on -- lower --lr or --init-std, or set --clip-grad")
    return StepOut(float(buf[0]) / topo.dp, mem, norm)


def _grads_finite(runner: BraidRunner | TorchRunner) -> bool:
    """Whether this rank's gradients are finite (braid's plain tensors or fp32 accumulation buffers; the torch
    baselines' DTensors are not read)."""
    if not isinstance(runner, BraidRunner):
        return True
    grads = [g for g in (getattr(p, "main_grad", p.grad) for p in runner.params) if g is not None]
    if not grads:
        return True
    total = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    norm = total(grads) if total is not None else torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    return bool(torch.isfinite(norm))


def train_reference(task: Task, setup: Setup, source: Any, device: torch.device, dtype: torch.dtype,
                    abort: Any = None) -> tuple[list[float], list[float]]:
    """The unsplit model trained on rank 0's device (same weights, micro-batches, optimizer settings);
    per-step losses and gradient norms (before clipping), broadcast to all ranks."""
    import copy

    import torch.distributed as dist

    from braid.training.step import Optimization

    args = setup.args
    losses: list[float] = []
    norms: list[float] = []
    if setup.rank == 0:
        from braid.models.build import materialize

        model = materialize(copy.deepcopy(setup.model)).to(device=device, dtype=dtype)  # a meta-device model made whole
        opt = Optimization(optim_config(args), list(model.named_parameters()), [model])  # no groups: nothing leaves rank 0
        n, b = args.dp * args.mbs, args.micro_batch_size
        for step in range(args.steps):
            opt.zero_grad()
            total = 0.0
            for i in range(n):  # replica r's micro-batch k is global micro-batch r * mbs + k
                batch = {k: to_device(v, device, dtype) for k, v in gather_batch(source, (step * n + i) * b, b).items()}
                loss = model(*((batch["pixels"],) if task.vision else ()), batch["tokens"], batch["labels"]) / n
                loss.backward()
                total += float(loss.detach())
            norms.append(opt.step())
            losses.append(total)
        opt.close()
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("reference (unsplit model, one device): losses %s; gradient norms %s", " ".join(f"{x:.4f}" for x in losses),
                 " ".join(f"{x:.4f}" for x in norms))
    box = [(losses, norms)]
    with abort.collective() if abort is not None else contextlib.nullcontext():
        dist.broadcast_object_list(box, src=0)
    return box[0]
