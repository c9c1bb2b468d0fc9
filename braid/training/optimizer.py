"""AdamW with fp32 master weights and fp32 gradient accumulation, sharded over data-parallel ranks.

Mixed precision as Megatron-LM and ZeRO-1 train: the model computes in its own dtype
(bf16 on GPU), while the optimizer keeps

* an **fp32 gradient buffer** (``p.main_grad``, views of one flat buffer): every
  micro-batch's contribution is added there in fp32 -- by the executor's weight-gradient
  passes (:func:`braid.tp.layers.accumulate_grad`) and, for gradients autograd
  accumulates itself, by a post-accumulate hook -- so no partial sum is rounded to bf16;
* **fp32 master weights and AdamW moments for one shard only**: the flat buffer is cut
  into ``W`` equal pieces over the sharding group (data-parallel, or data x context
  parallel ranks); a step reduce-scatters the gradients (each rank receives the sum of
  its piece), scales them by ``grad_scale`` (``1/dp``: the data-parallel mean), clips
  by the global norm, runs :class:`torch.optim.AdamW` on its piece of the masters, and
  all-gathers the updated weights in the model's dtype.

The class *is* a :class:`torch.optim.AdamW` over the master pieces (one tensor per
parameter piece this rank owns; decoupled weight decay in a separate param group for
matrices, none for norms and biases), so learning-rate schedulers attach to it as to any
optimizer, and the update is torch's own. With ``shard=False`` every rank keeps all
masters and the gradients are all-reduced instead (fp32 masters without ZeRO).

The global gradient norm (:mod:`braid.training.grads`) equals the single-process norm:
each element is counted on exactly one rank -- the rank of the sharding group that owns
it, and for TP-replicated parameters (norm weights) only TP rank 0 -- and the squares are
summed over all ranks. A non-finite norm skips the update (weights, moments and step
count unchanged) and is returned, so the training loop can stop.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from braid.tp.seq_shard import all_gather_into, reduce_scatter_into
from braid.training.grads import clip_coefficient, decays, square_sum


BUCKET = 1 << 24  # elements per rank and all-gather: 32 MiB of bf16, 64 MiB of fp32


@dataclass(frozen=True, slots=True)
class _Piece:
    """The part ``[lo, hi)`` of parameter ``index`` (flattened) that this rank owns; ``at``: offset in the shard."""

    index: int
    lo: int
    hi: int
    at: int


def _step_tensor(step: float, v: torch.Tensor) -> torch.Tensor:
    """AdamW's step count as its fused kernel reads it: a float32 scalar on the master's device."""
    return torch.tensor(step, dtype=torch.float32, device=v.device)


class ShardedAdamW(torch.optim.AdamW):
    """AdamW on fp32 masters of this rank's shard; see the module docstring.

    ``named_params``: this rank's parameters (its pipeline stages' TP shards) with names
    used as state-dict keys. ``group``: the sharding (and gradient-reduction) group,
    ``None`` for a single rank. ``counted``: per parameter, whether this TP rank counts
    it in the global norm (:func:`braid.training.grads.tp_norm_mask`); default all.
    ``norm_group``: the group over which the norm's squares are summed (default: the
    whole job; with neither ``group`` nor ``norm_group``, none -- one process on its
    own, e.g. a reference run on rank 0 of a job). ``wait``: waits on async work handles (:meth:`Abort.wait`, bounded
    waits that notice a failed peer); default ``Work.wait``.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        group: dist.ProcessGroup | None = None,
        shard: bool = True,
        grad_scale: float = 1.0,
        counted: Sequence[bool] | None = None,
        norm_group: dist.ProcessGroup | None = None,
        wait: Callable[[Any], None] | None = None,
    ) -> None:
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        if not self.params:
            raise ValueError("ShardedAdamW needs at least one parameter")
        if len(set(self.names)) != len(self.names):
            raise ValueError("parameter names must be unique (they key the state dict)")
        dev = self.params[0].device
        self._group, self.shard_states, self._grad_scale = group, shard, grad_scale
        self.norm_group = norm_group
        self._wait = wait or (lambda w: w.wait())
        self.world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        self.counted = list(counted) if counted is not None else [True] * len(self.params)
        if len(self.counted) != len(self.params):
            raise ValueError(f"counted has {len(self.counted)} entries for {len(self.params)} parameters")
        self.starts, n = [], 0
        for p in self.params:
            self.starts.append(n)
            n += p.numel()
        ways = self.world if shard else 1
        self.shard_len = -(-n // ways)  # ceil: the flat buffer is padded to ways * shard_len
        self.flat_len = self.shard_len * ways
        self.lo = rank * self.shard_len if shard else 0
        self.owner = shard or rank == 0  # without sharding, one rank of the group counts the norm
        self.main_grad = torch.zeros(self.flat_len, dtype=torch.float32, device=dev)
        self.master = torch.zeros(self.shard_len, dtype=torch.float32, device=dev)
        self.grad_shard = torch.zeros(self.shard_len, dtype=torch.float32, device=dev) if shard and self.world > 1 else None
        self.pieces: list[_Piece] = []
        for i, (p, s) in enumerate(zip(self.params, self.starts)):
            p.main_grad = self.main_grad[s:s + p.numel()].view_as(p)
            lo, hi = max(s, self.lo), min(s + p.numel(), self.lo + self.shard_len)
            if lo < hi:
                self.pieces.append(_Piece(i, lo - s, hi - s, lo - self.lo))
                self.master[lo - self.lo:hi - self.lo].copy_(p.detach().reshape(-1)[lo - s:hi - s])
        self._hooks = [p.register_post_accumulate_grad_hook(_fold_into_main_grad) for p in self.params]
        grads = self.grad_shard if self.grad_shard is not None else self.main_grad[self.lo:self.lo + self.shard_len]
        self.views: list[torch.Tensor] = []
        groups: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        for pc in self.pieces:
            v = self.master[pc.at:pc.at + pc.hi - pc.lo]
            v.grad = grads[pc.at:pc.at + pc.hi - pc.lo]
            self.views.append(v)
            groups[decays(self.params[pc.index])].append(v)
        if not self.views:  # a rank whose shard holds padding only still takes part in every collective
            v = self.master[:0]
            v.grad = grads[:0]
            groups[False].append(v)
        super().__init__([{"params": groups[True], "weight_decay": weight_decay},
                          {"params": groups[False], "weight_decay": 0.0}],
                         lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        for g in self.param_groups:  # eager state: a checkpoint can be loaded before the first step
            for v in g["params"]:
                self.state[v] = {"step": _step_tensor(0.0, v), "exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.zeros_like(v)}
        self.last_norm: float | None = None

    # -- the step ------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the fp32 gradient buffer (the masters' gradients are views of it, or of its reduced shard)."""
        self.main_grad.zero_()
        for p in self.params:
            p.grad = None

    def reduce(self) -> None:
        """Reduce the accumulated gradients over the group and scale them; this rank's shard is then final."""
        if self.world > 1:
            if self.grad_shard is not None:
                self._wait(reduce_scatter_into(self.grad_shard, self.main_grad, self._group))
            else:
                self._wait(dist.all_reduce(self.main_grad, group=self._group, async_op=True))
        if self._grad_scale != 1.0:
            self._grads().mul_(self._grad_scale)

    def _grads(self) -> torch.Tensor:
        return self.grad_shard if self.grad_shard is not None else self.main_grad[self.lo:self.lo + self.shard_len]

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm (collective over ``norm_group``); call after :meth:`reduce`."""
        grads = self._grads()
        sq = torch.zeros((), dtype=torch.float64, device=grads.device)
        if self.owner:
            for pc in self.pieces:
                if self.counted[pc.index]:
                    sq += square_sum(grads[pc.at:pc.at + pc.hi - pc.lo])
        if self._group is not None or self.norm_group is not None:
            self._wait(dist.all_reduce(sq, group=self.norm_group, async_op=True))
        return sq.sqrt()

    @torch.no_grad()
    def step(self, closure: None = None, max_norm: float | None = None,  # type: ignore[override]
             norm: torch.Tensor | None = None) -> float:
        """Reduce, measure the global norm, clip to ``max_norm`` (if given), update, all-gather.

        Returns the norm before clipping. A non-finite norm makes no update. ``norm``: the
        gradients are already reduced (:meth:`reduce`) and this is the global norm to clip by
        (several optimizers over disjoint parameters sharing one norm).
        """
        if closure is not None:
            raise ValueError("ShardedAdamW.step takes no closure")
        if norm is None:
            self.reduce()
            norm = self.grad_norm()
        self.last_norm = float(norm)
        if not torch.isfinite(norm):
            return self.last_norm
        if max_norm is not None:
            self._grads().mul_(clip_coefficient(norm, max_norm).to(torch.float32))
        super().step()
        self.publish()
        return self.last_norm

    @torch.no_grad()
    def publish(self) -> None:
        """Write the masters into the model's parameters (cast to their dtype; all-gathered when sharded)."""
        dtype = self.params[0].dtype
        if self.shard_states and self.world > 1:
            self._gather_into([p.view(-1) for p in self.params], lambda o, n: self.master[o:o + n].to(dtype))
            return
        for pc in self.pieces:
            self.params[pc.index].view(-1)[pc.lo:pc.hi].copy_(self.master[pc.at:pc.at + pc.hi - pc.lo])

    def _gather_into(self, targets: Sequence[torch.Tensor], piece: Callable[[int, int], torch.Tensor]) -> None:
        """All-gather every rank's shard into ``targets`` (flat, one per parameter), in buckets of at most
        ``BUCKET`` elements per rank: the transient buffer stays ``world * BUCKET`` elements, not the whole model.

        ``piece(offset, n)``: elements ``[offset, offset + n)`` of this rank's shard (any device/dtype of the targets).
        """
        size, world = self.shard_len, self.world
        bucket = max(1, min(size, BUCKET))
        probe = piece(0, 0)
        buf = torch.empty(world * bucket, dtype=probe.dtype, device=self.master.device)
        for o in range(0, size, bucket):
            n = min(bucket, size - o)
            out = buf[:world * n]
            self._wait(all_gather_into(out, piece(o, n).to(buf.device).contiguous(), self._group))
            for r in range(world):
                self._scatter(r * size + o, out[r * n:(r + 1) * n], targets)

    def _scatter(self, start: int, values: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
        """Copy flat-buffer elements ``[start, start + len(values))`` into the parameters' flat ``targets``."""
        end = start + values.numel()
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.params) and self.starts[i] < end:
            s, n = self.starts[i], self.params[i].numel()
            lo, hi = max(s, start), min(s + n, end)
            if lo < hi:
                targets[i][lo - s:hi - s].copy_(values[lo - start:hi - start])
            i += 1

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Masters and moments per parameter name, whole, in host memory, plus the step (a collective when sharded).

        ``{"step": tensor, "lr": tensor, "params": {name: {"master", "exp_avg", "exp_avg_sq"}}}``,
        fp32 CPU tensors shaped like the parameters -- what ``torch.distributed.checkpoint``
        saves as-is, and independent of the number of sharding ranks, so a run resumes at
        another data-parallel size. Gathered bucket by bucket (little device memory), but
        every rank then holds its model shard's whole optimizer state in host memory.
        """
        out: dict[str, Any] = {"step": torch.tensor(self._step_count_value(), dtype=torch.float32),
                               "lr": torch.tensor(float(self.param_groups[0]["lr"]), dtype=torch.float64),
                               "params": {n: {} for n in self.names}}
        for key in ("master", "exp_avg", "exp_avg_sq"):
            targets = [torch.zeros(p.numel(), dtype=torch.float32) for p in self.params]
            flat = self._flat_state(key)
            if self.shard_states and self.world > 1:
                self._gather_into(targets, lambda o, n: flat[o:o + n])
            else:
                self._scatter(self.lo, flat, targets)
            for name, p, t in zip(self.names, self.params, targets):
                out["params"][name][key] = t.view(p.shape)
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore from :meth:`state_dict`'s form (after ``dcp.load`` filled it); the parameters get the masters."""
        missing = [n for n in self.names if n not in state["params"]]
        if missing:
            raise KeyError(f"optimizer state has no entry for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        step = float(state["step"])
        for pc, v in zip(self.pieces, self.views):
            entry = state["params"][self.names[pc.index]]
            st = self.state[v]
            for key, dst in (("master", v), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
                dst.copy_(entry[key].reshape(-1)[pc.lo:pc.hi])
        for v, st in self.state.items():  # a rank whose shard holds padding only steps its empty piece too
            st["step"] = _step_tensor(step, v)
        if "lr" in state:
            for g in self.param_groups:
                g["lr"] = float(state["lr"])
        for p, name in zip(self.params, self.names):  # every rank: whole parameters, not only the owned pieces
            p.copy_(state["params"][name]["master"].to(p.dtype))

    def _step_count_value(self) -> float:
        for st in self.state.values():
            return float(st["step"])
        return 0.0

    def _flat_state(self, key: str) -> torch.Tensor:
        flat = torch.zeros(self.shard_len, dtype=torch.float32, device=self.master.device)
        for pc, v in zip(self.pieces, self.views):
            flat[pc.at:pc.at + pc.hi - pc.lo] = v if key == "master" else self.state[v][key]
        return flat

    def remove_hooks(self) -> None:
        """Detach the optimizer from the parameters (hooks and ``main_grad`` buffers)."""
        for h in self._hooks:
            h.remove()
        for p in self.params:
            if hasattr(p, "main_grad"):
                del p.main_grad


def _fold_into_main_grad(p: torch.Tensor) -> None:
    """Post-accumulate hook: a gradient autograd accumulated goes into the fp32 buffer."""
    if p.grad is not None:
        p.main_grad.add_(p.grad)
        p.grad = None
