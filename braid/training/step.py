"""The optimizer side of a training step, configured once: reduction, global norm, clipping, AdamW, schedule.

:class:`OptimConfig` is what a run chooses (learning rate and its schedule, weight decay,
clipping, fp32 master weights, ZeRO-1 sharding). :class:`Optimization` applies it on one
rank after the executor's backward:

* plain (default): gradients in ``p.grad`` (the compute dtype), averaged over
  data-parallel replicas (:func:`braid.runtime.distributed.reduce_gradients`), clipped by
  the global norm (:func:`braid.training.grads.clip_grads_`), :class:`torch.optim.AdamW`
  on the parameters;
* ``master_fp32``/``zero1``: :class:`braid.training.optimizer.ShardedAdamW` -- fp32
  gradient accumulation and fp32 masters, their states sharded over data-parallel ranks
  with ``zero1``.

Either way decoupled weight decay skips norms and biases, the learning rate follows
:func:`braid.training.lr.build_scheduler`, and :meth:`Optimization.step` returns the
global gradient norm before clipping (the single-process model's norm). A non-finite norm
makes no update; the caller stops (:func:`braid.training.grads.check_finite`).

Without ``groups`` everything stays on this process (no collective): the unsplit
reference model, trained on one rank of a job, uses the same class with torch's own
:func:`torch.nn.utils.clip_grad_norm_`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from braid.training.grads import clip_grads_, param_groups, replica_mask, tp_norm_mask
from braid.training.lr import build_scheduler
from braid.training.optimizer import ShardedAdamW


@dataclass(frozen=True)
class OptimConfig:
    """A run's optimizer choices. ``total_steps``: the schedule's length; ``clip``: max global norm (None: no
    clipping); ``weight_decay``: of matrices only, default torch AdamW's 0.01."""

    lr: float = 1e-3
    total_steps: int = 1
    warmup: int = 0
    decay: str = "constant"
    min_lr: float = 0.0
    weight_decay: float = 0.01  # torch.optim.AdamW's default
    clip: float | None = None
    master_fp32: bool = False
    zero1: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    @classmethod
    def of_mode(cls, mode: str, **kw: Any) -> "OptimConfig":
        """The config of optimizer ``mode`` (:mod:`braid.cost.optimizer_modes`: zero1, master, plain); ``ValueError`` naming
        the valid modes for another."""
        from braid.cost.optimizer_modes import mode_bytes

        mode_bytes(mode, 2)
        return cls(master_fp32=mode != "plain", zero1=mode == "zero1", **kw)

    def check(self) -> None:
        """Raise ``ValueError`` (one line: what to change) for settings that cannot work."""
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr (got lr={self.lr}, min_lr={self.min_lr})")
        if not 0 <= self.warmup <= self.total_steps:
            raise ValueError(f"warm-up ({self.warmup} steps) must lie within the run's {self.total_steps} steps")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"gradient clipping needs a positive max norm, got {self.clip}")
        if self.weight_decay < 0:
            raise ValueError(f"weight decay must be >= 0, got {self.weight_decay}")


class Optimization:
    """One rank's optimizer, schedule and clipping (see the module docstring).

    ``named_params``: this rank's parameters, named uniquely per model shard and equally
    over data-parallel replicas (they key the sharded optimizer's state dict).
    ``modules``: the modules holding them (to tell TP-sharded parameters from replicated
    ones). ``groups``: the job's :class:`~braid.runtime.distributed.ProcessGroups`;
    ``abort``: its :class:`~braid.runtime.distributed.Abort` (bounded waits). ``experts``: the
    :class:`~braid.runtime.expert_parallel.ExpertGroups` of an expert-parallel run (its expert
    gradients are reduced over the expert-data-parallel group, :func:`~braid.runtime.expert_parallel.reduce_gradients_ep`;
    with fp32 masters / ZeRO-1 the experts get a :class:`ShardedAdamW` of their own over that group).
    """

    def __init__(self, cfg: OptimConfig, named_params: Sequence[tuple[str, nn.Parameter]], modules: Iterable[nn.Module], *,
                 groups: Any = None, abort: Any = None, experts: Any = None) -> None:
        cfg.check()
        self.cfg, self.groups, self.abort = cfg, groups, abort
        self.experts = experts if experts is not None and experts.ep > 1 else None
        self.params = [p for _, p in named_params]
        self.counted = tp_norm_mask(self.params, modules, groups.coords.tp if groups is not None else 0,
                                    groups.coords.pp if groups is not None else 0)
        # Expert parallelism with fp32 masters: the experts' own ShardedAdamW over the expert-data-parallel
        # group (their gradients summed there, then divided by dp), the global norm shared (step).
        self.expert_optimizer: ShardedAdamW | None = None
        if cfg.master_fp32 or cfg.zero1:
            sharded = lambda named, group, counted: ShardedAdamW(  # noqa: E731
                named, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, group=group, shard=cfg.zero1,
                grad_scale=1.0 / groups.topo.dp if groups is not None else 1.0, counted=counted,
                wait=abort.wait if abort is not None else None)
            if self.experts is None:
                self.optimizer: torch.optim.Optimizer = sharded(named_params, groups.dp_cp if groups is not None else None,
                                                                self.counted)
            else:
                from braid.runtime.expert_parallel import is_expert

                mine = [is_expert(p) for _, p in named_params]
                split = [[(named, c) for named, c, e in zip(named_params, self.counted, mine) if e is want] for want in (False, True)]
                self.optimizer = sharded([n for n, _ in split[0]], groups.dp_cp, [c for _, c in split[0]])
                self.expert_optimizer = sharded([n for n, _ in split[1]], self.experts.edp_group, [c for _, c in split[1]])
        else:
            self.optimizer = torch.optim.AdamW(param_groups(self.params, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                               fused=True)
        self.schedulers = [build_scheduler(o, total=cfg.total_steps, warmup=cfg.warmup, decay=cfg.decay, lr=cfg.lr,
                                           min_lr=cfg.min_lr) for o in (self.optimizer, self.expert_optimizer) if o is not None]
        self.scheduler = self.schedulers[0]
        self.last_norm: float | None = None

    @property
    def sharded(self) -> bool:
        """Whether the optimizer keeps fp32 masters (:class:`ShardedAdamW`) rather than stepping on the parameters."""
        return isinstance(self.optimizer, ShardedAdamW)

    @property
    def lr(self) -> float:
        """The learning rate the next step uses."""
        return float(self.optimizer.param_groups[0]["lr"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self.expert_optimizer is not None:
            self.expert_optimizer.zero_grad(set_to_none=set_to_none)

    def resume_at(self, step: int) -> None:
        """Put the schedule at ``step`` steps done (a resumed run: the schedule's state is the step count)."""
        for sched in self.schedulers:
            sched.last_epoch = step
            lrs = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
            for g, lr in zip(sched.optimizer.param_groups, lrs):
                g["lr"] = lr
            sched._last_lr = lrs

    def step(self) -> float:
        """Reduce, clip, update, advance the schedule; returns the global gradient norm before clipping."""
        clip = self.cfg.clip
        if isinstance(self.optimizer, ShardedAdamW):
            if self.groups is not None:
                # the copies of a tied embedding (first and last stage) sum their fp32 gradients
                # before the optimizer reduces them over data-parallel ranks
                from braid.models.tied import reduce_tied_gradients
                from braid.models.tp_partial import reduce_partial_gradients

                reduce_partial_gradients(self.params, self.groups.tp if self.groups.topo.tp > 1 else None, self.abort,
                                         attr="main_grad")
                reduce_tied_gradients(self.params, self.groups.pp_ranks, self.groups.coords.pp, self.abort, attr="main_grad")
            if self.expert_optimizer is None:
                norm = self.optimizer.step(max_norm=clip)
            else:  # one global norm over the dense and the expert parameters, each counted once
                both = (self.optimizer, self.expert_optimizer)
                for o in both:
                    o.reduce()
                total = sum(o.grad_norm().square() for o in both).sqrt()
                norm = [o.step(max_norm=clip, norm=total) for o in both][0]
        else:
            if self.groups is not None:
                first = self.groups.dp_cp_ranks[0] == self.groups.rank
                if self.experts is None:
                    from braid.runtime.distributed import reduce_gradients

                    reduce_gradients(self.params, self.groups, self.abort)
                    counted = replica_mask(self.counted, first)
                else:  # an expert's reduced gradient lives on one rank of each expert-parallel group: the first group counts it
                    from braid.runtime.expert_parallel import is_expert, reduce_gradients_ep

                    reduce_gradients_ep(self.params, self.groups, self.experts, self.abort)
                    first_ep = self.groups.coords.dp < self.experts.ep
                    counted = [c and (first_ep if is_expert(p) else first) for p, c in zip(self.params, self.counted)]
                norm = clip_grads_(self.params, counted, clip, abort=self.abort)
            else:
                norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip if clip is not None else math.inf))
            if math.isfinite(norm):
                self.optimizer.step()
        if math.isfinite(norm):
            for sched in self.schedulers:
                sched.step()
        self.last_norm = norm
        return norm

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer", "scheduler"}``. Sharded: the masters and moments by parameter name (a collective)."""
        if self.expert_optimizer is not None:
            raise ValueError("the optimizer state of an expert-parallel run is not checkpointed yet")
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def close(self) -> None:
        """Detach a sharded optimizer's gradient hooks and buffers from the parameters."""
        for o in (self.optimizer, self.expert_optimizer):
            if isinstance(o, ShardedAdamW):
                o.remove_hooks()


def reference_mismatches(losses: Sequence[float], norms: Sequence[float | None], ref_losses: Sequence[float],
                         ref_norms: Sequence[float], rtol: float) -> list[str]:
    """Where a run differs from the unsplit model by more than ``rtol`` (relative): loss *and* gradient norm of every step.

    The loss alone cannot catch a gradient that is wrong by a constant factor (AdamW
    divides the scale out of the update); the norm can. A ``None`` norm (a run that does
    not measure it) is skipped. Returns one phrase per mismatching step, empty when all agree.
    """
    out = []
    if len(losses) != len(ref_losses):
        out.append(f"{len(losses)} steps vs the reference's {len(ref_losses)}")
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        if not abs(a - b) <= rtol * max(abs(b), 1e-12):
            out.append(f"step {i + 1} loss {a:.6g} vs {b:.6g}")
    for i, (a, b) in enumerate(zip(norms, ref_norms)):
        if a is not None and not abs(a - b) <= rtol * max(abs(b), 1e-12):
            out.append(f"step {i + 1} gradient norm {a:.6g} vs {b:.6g}")
    return out
